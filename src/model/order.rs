//! Who goes first: how `run --wait` callers queue for a lease, and in which order the relay
//! publishes an aggregate's events.

/// How a waiter keeps its place (`run --queue`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum QueueMode {
    // (Plain comments: doc comments here would turn `run --help` into its long form.)
    // First come, first served: waiters take the lease in arrival order.
    Fifo,
    // A new waiter supersedes every older waiter of the target (which exit busy).
    Latest,
    // No order among these waiters (leasectl before queues); they still go after the ordered
    // waiters, and are listed in `status`.
    Unordered,
}

impl QueueMode {
    pub fn as_str(self) -> &'static str {
        match self {
            QueueMode::Fifo => "fifo",
            QueueMode::Latest => "latest",
            QueueMode::Unordered => "unordered",
        }
    }

    /// Whether the waiter keeps (and holds others to) its place.
    pub fn ordered(self) -> bool {
        self != QueueMode::Unordered
    }
}

/// In which order the relay publishes an aggregate's events (`relay --order`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// By `seq`, taken at insert: every committed event is published at once. Two transactions
    /// writing one aggregate concurrently can commit in the other order than their `seq`s.
    Insert,
    /// By `(xid, seq)`, and only events whose transaction is older than every transaction still
    /// in progress (migrations/0009_commit_order.sql): nothing can commit later ahead of them.
    Commit,
}
