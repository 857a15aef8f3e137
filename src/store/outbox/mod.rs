//! The `outbox` table: every SQL statement on it, one concern per file: `claim.rs` takes a batch
//! for the relay (and `prepared.rs` keeps its statements prepared on a connection), `settle.rs`
//! puts back what was not delivered and commits the rest, `horizon.rs` reads the commit order's
//! horizon and who holds it back, `admin.rs` is the operator's list /
//! retry / discard and the backlog, and `wire.rs` the published form. This module holds what
//! they share ([`Event`], [`rollback`]) and re-exports the rest, so callers name
//! `store::outbox::…` whichever file an item lives in.
//!
//! # How a batch is claimed, and why per-aggregate order holds across relays
//!
//! An aggregate's *head* is its oldest event (lowest `seq`). Only heads are ever claimed
//! directly; the events behind a head are taken together with it, as a prefix of its chain, in
//! the same statement. [`claim`] is one `DELETE … RETURNING` run inside the relay's transaction:
//!
//! 1. a window of the oldest events (`--batch` × 2) of aggregates that are not *blocked* — whose
//!    events are neither dead nor waiting out a retry — so a dead aggregate never holds up the
//!    others. The window is an ordered scan of the partial index `outbox_live` (of
//!    `outbox_commit_order` for [`Order::Commit`]), which leaves dead events out
//!    (migrations/0010_live_events.sql), and each event it meets costs one probe of the partial
//!    index `outbox_held` for its aggregate (none while that index is empty): the claim never
//!    reads a dead event, so however many pile up it costs what it costs without them (docs/BENCHMARKS.md,
//!    "Dead heads ahead of live events", has the figures);
//! 2. the first event of each aggregate in that window — its head: an aggregate in the window
//!    has all its older events there too — locked `FOR UPDATE SKIP LOCKED`, `--batch` of them at
//!    most: a head another relay holds is skipped, and with it its whole aggregate;
//! 3. if that gives fewer than `--batch` heads (a burst on one aggregate, say, or aggregates whose
//!    heads other relays hold, or a session of this relay's that it lost and the server still
//!    keeps), a second window just past the first, of the events of the aggregates the first
//!    does not hold, looking up to 100 windows ahead, and its aggregates' heads, locked the same
//!    way, up to `--batch` heads in all: so the claim reaches past a busy or locked aggregate to
//!    the heads of others: a burst on one aggregate must not keep the others waiting or other
//!    relays idle, and a window filled by aggregates a stopped relay held must not leave this
//!    one claiming nothing until that relay's session ends;
//! 4. the windows' events of the aggregates whose head was locked, `--batch` of them: every
//!    head first, then the rest by `seq`. Each window is a `seq`-ordered run of the
//!    unblocked events of its aggregates, so each aggregate's events in it run contiguously
//!    from its head: each aggregate contributes a prefix of its chain, head first;
//! 5. those rows are deleted, which locks them until the transaction ends. (Heads locked but cut
//!    off by `--batch-bytes` stay locked until then too.)
//!
//! # The plain claim
//!
//! Most batches need none of the general claim's care: no event is dead or waiting out a
//! retry, no head is another relay's, no payload is stored compressed, the batch is within
//! `--batch-bytes`. For those the general claim takes the first `--batch` events of its
//! window, and [`claim`] tries a plainer statement first (`CLAIM_PLAIN`; not when the claim
//! looks past its window, which only the general claim does) that costs less: the first
//! `--batch` events (and the rest of the general claim's window only when some aggregate has
//! more than one event among them), one count of their aggregates, one lock of their heads
//! (found among those events by a hash join, for their `ctid`s), the `DELETE`; no sort or
//! running sum, and no copy of the rows. It takes exactly what
//! the general claim would — the first `--batch` events of the window, in the same order — and
//! checks, in the statement itself, that the general claim would take just those:
//!
//! * no event of the outbox is *held* (dead or waiting out a retry): one probe of the empty
//!   partial index `outbox_held`, so every event is due and no aggregate is blocked;
//! * none of those events' payloads is stored compressed, and their stored sizes add up to
//!   `--batch-bytes` at most: then every prefix fits, and the general claim takes them all;
//! * either they belong to `--batch` different aggregates (each is a head), or every aggregate
//!   of the window has its head among them: the general claim takes every head of its window
//!   first, so an aggregate whose head lies past them would go first there (a burst on one
//!   aggregate must not keep the others waiting);
//! * each of their aggregates' heads among them could be locked `FOR UPDATE SKIP LOCKED`, as
//!   the general claim locks them: none is another relay's, or was deleted since the window's
//!   snapshot; the `DELETE` then takes the events behind them, as the general claim's does;
//! * the `DELETE` returned every one of them. The lock and the `DELETE` fetch the rows by the
//!   `ctid` the window read (a tid scan, where looking each one up by `seq` descended the
//!   primary key a thousand times a batch: a tenth of the statement), and a row another
//!   transaction changed or removed since is no longer there; this check is made by the relay,
//!   from the count the verdict carries (`taken N`).
//!
//! If one of the first four checks fails it deletes nothing and says which ([`Declined`]) in
//! a setting of its transaction, read in the same round trip (a `DELETE … RETURNING` returns
//! only deleted rows, and a query around it that could add a row saying so copied every
//! returned row once more); the last one fails after the `DELETE`, and counts as
//! [`Declined::Locked`]. Either way the relay then rolls its transaction back — with whatever
//! it locked or deleted, so no head stays locked by a claim that took nothing — and sends the
//! general claim in a new one, in the same round trip as the rollback, and uses the general
//! claim alone for a second before it tries the plain one again (`relay/plain.rs`). Both claims see the same rules above, so whichever
//! claimed a batch, the rule below holds.
//!
//! A second relay cannot take any event of an aggregate this relay is working on: the head is
//! locked, and every later event has an older event (the head) still visible to it until this
//! relay commits — by which time everything it deleted has been published. Rows are deleted
//! *before* publishing but the deletion is committed only *after* the sink confirmed them, so a
//! relay killed mid-batch leaves them all in place (at-least-once). What was not delivered is
//! put back by `restore` in the same transaction, with its original `seq` and `id`.
//!
//! # No session state, except prepared claims on a direct connection
//!
//! Every statement here is unnamed (`query_typed`, or `batch_execute` where there are no
//! parameters), never a named prepared statement (`prepare`, or `query(&str, …)` which
//! prepares "s0", "s1"… behind the scenes): behind a transaction-mode pooler such as pgbouncer
//! each transaction may run on another server connection, where a named statement is missing
//! or already exists. For the same reason the claim's planner settings are `SET LOCAL`, inside
//! its own transaction, and nothing here sets anything for the session. An unnamed statement
//! is also planned afresh with its actual parameters every time (never a generic plan), and
//! `BEGIN` with the claim still go out in one round trip.
//!
//! The one exception are the claim statements on a connection that reaches its own server
//! session ([`Session::prepared`], which the relay leaves out behind a pooler): they are
//! prepared once per connection ([`Prepared`]), since parsing and planning them took a good
//! part of every batch. Planned generically after a few batches (PostgreSQL's choice), their
//! plans are the same index scans and hashes: the transaction's planner settings leave the
//! claim nothing else, whatever its parameters or the statistics. Not a claim ahead, though:
//! its `seq`s of the batch in hand would be compared one by one in a generic plan, where the
//! unnamed statement's plan hashes them.
//!
//! # Insert order and commit order
//!
//! With [`Order::Insert`] an aggregate's order is `seq`, taken at insert: an event inserted with
//! a lower `seq` that commits after a higher one of the same aggregate is published after it.
//! Applications must serialise the transactions that write one aggregate, as they would any
//! write to it. [`Order::Commit`] (`relay --order commit`) reads everything above in
//! `(xid, seq)` order instead — windows, heads, the reach past them, the batch — over only the
//! events whose transaction is below the horizon of the claim's own snapshot
//! (`pg_snapshot_xmin`): every transaction that can still commit has an id at or past it, so
//! nothing can later appear ahead of an event already published. The index
//! `outbox_commit_order` on `(xid, seq)` (of the events that are not dead) makes the horizon an
//! index condition: the scan stops where the events of open transactions start. Put-backs keep the event's `xid`.
//!
//! # Bytes
//!
//! The batch is also bounded in payload bytes (`--batch-bytes`): the claim takes the longest
//! prefix of its order (heads first) whose payloads fit, and at least one event.
//!
//! # Claiming ahead
//!
//! While one batch is published, the relay claims the next on a second connection, so the
//! sink does not wait for the database between batches (`Relay::batch`). That claim is given
//! the `seq`s of the batch in hand and treats them as gone, although its snapshot still sees
//! them (their deletion is not committed yet): each aggregate's first event past them is its
//! head for this claim, and the prefix taken from there continues the one in hand. The relay
//! keeps the batch claimed ahead only if every event of the batch in hand was delivered, and
//! rolls it back **before** that batch commits otherwise, or when that batch's commit fails:
//! what it holds continues chains that are then not gone after all. So outside this relay's
//! two transactions the rule above is kept — whoever holds an event of an aggregate holds its
//! head: until the batch in hand commits, its events are the heads, held by the first
//! transaction; once it commits, the batch claimed ahead holds the new heads. The two
//! commit in order, and a batch claimed ahead is published only once the one before it was
//! confirmed, so an aggregate's events still leave one after another.
//!
//! [`claim`]: claim()
//! [`Order::Commit`]: crate::model::order::Order::Commit
//! [`Order::Insert`]: crate::model::order::Order::Insert

mod admin;
mod claim;
mod horizon;
mod prepared;
mod settle;
mod wire;

use std::time::SystemTime;

use tokio_postgres::Client;

pub use admin::{
    backlog, discard, in_a_batch, list, next_retry_in, retry, retry_one, vacuum, Backlog,
    Discarded, Listed, RetryWhich,
};
pub use claim::{
    claim, cut_off, explain_claim, explain_plain_claim, Ask, Claim, ClaimLimits, Claimed, Declined,
    Reach, Session, Via, REACH_FACTOR,
};
pub use horizon::{commit_horizon, horizon_holders, xid_holder, Holder, Horizon};
pub use prepared::Prepared;
pub use settle::{commit_later, settle, PendingCommit, Settle, SettleFailed};
pub use wire::Published;

/// One outbox event, ready to publish: what every sink gets.
#[derive(Debug, Clone)]
pub struct Event {
    /// Position in the outbox (creation order).
    pub seq: i64,
    /// The stable id consumers deduplicate on.
    pub id: uuid::Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    /// The event type (AMQP routing key, NATS subject suffix).
    pub event_type: String,
    /// The payload: PostgreSQL's jsonb text (valid JSON on one line).
    pub payload: String,
    pub created_at: SystemTime,
}

/// Ends a batch's transaction without changing anything: every claimed event is back.
pub async fn rollback(client: &Client) -> Result<(), tokio_postgres::Error> {
    client.batch_execute("ROLLBACK").await
}
