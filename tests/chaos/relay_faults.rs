//! The relay rounds' faults, sinks and invariants (see `relay.rs`).

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RFault {
    /// `kill -9` of a relay while it holds a claimed batch (publishing it).
    Kill9,
    /// `kill -9` of a relay while its claim statement runs.
    Kill9Claim,
    /// `kill -9` of a relay while it holds two batches: the one in hand and the one claimed ahead.
    Kill9Ahead,
    /// SIGSTOP of a relay's process group mid-batch, past the server's
    /// `idle_in_transaction_session_timeout` (the server ends its session; in half the rounds
    /// `pg_terminate_backend` ends it first), then SIGCONT.
    SigStop,
    /// `pg_terminate_backend` of every backend of a relay mid-batch.
    Terminate,
    /// `pg_ctl restart` (fast or immediate) mid-drain.
    Restart,
    /// The proxy between the relays and PostgreSQL forwards nothing, mid-drain: for a `--once`
    /// until it exited (or its bound passed), for services past the statement deadline.
    DbBlackHole,
    /// SIGSTOP of every backend of the relays mid-batch, at a moment when none runs a statement
    /// (new connections still work), until the services delivered an event of a fresh aggregate
    /// and every `--once` exited, or their bounds passed (`Round::freeze_at_rest` says why
    /// that moment).
    DbFreeze,
    /// The proxy closes every relay's database connection.
    DbCut,
    /// The proxy in front of the broker (or webhook) closes every connection.
    BrokerCut,
    /// The same with a TCP reset (`SO_LINGER` 0).
    BrokerReset,
    /// The proxy in front of the broker (or webhook) forwards nothing for 1–3 s.
    BrokerBlackHole,
    /// The webhook answers 500 to every event of one hot aggregate for the rest of the round.
    WebhookRefuse,
}

pub const ALL: [RFault; 13] = [
    RFault::Kill9,
    RFault::SigStop,
    RFault::DbBlackHole,
    RFault::DbFreeze,
    RFault::Kill9Claim,
    RFault::WebhookRefuse,
    RFault::Terminate,
    RFault::BrokerCut,
    RFault::Restart,
    RFault::Kill9Ahead,
    RFault::BrokerBlackHole,
    RFault::DbCut,
    RFault::BrokerReset,
];

/// The order the rounds cycle through when no subset is asked for: every fault, SIGSTOP twice
/// (what a stale batch does is visible only when a newer event of one of its aggregates follows
/// it, so it takes more rounds to show).
pub const SCHEDULE: [RFault; 14] = [
    RFault::Kill9,
    RFault::SigStop,
    RFault::DbBlackHole,
    RFault::DbFreeze,
    RFault::Kill9Claim,
    RFault::WebhookRefuse,
    RFault::SigStop,
    RFault::Terminate,
    RFault::BrokerCut,
    RFault::Restart,
    RFault::Kill9Ahead,
    RFault::BrokerBlackHole,
    RFault::DbCut,
    RFault::BrokerReset,
];

impl RFault {
    pub fn name(self) -> &'static str {
        match self {
            RFault::Kill9 => "kill9",
            RFault::Kill9Claim => "kill9-claim",
            RFault::Kill9Ahead => "kill9-ahead",
            RFault::SigStop => "sigstop",
            RFault::Terminate => "terminate",
            RFault::Restart => "restart",
            RFault::DbBlackHole => "db-blackhole",
            RFault::DbFreeze => "db-freeze",
            RFault::DbCut => "db-cut",
            RFault::BrokerCut => "broker-cut",
            RFault::BrokerReset => "broker-reset",
            RFault::BrokerBlackHole => "broker-blackhole",
            RFault::WebhookRefuse => "webhook-refuse",
        }
    }

    /// Comma-separated names (`LEASECTL_CHAOS_RELAY_FAULTS`): empty = [`SCHEDULE`], `all` = every
    /// fault once, `kill` = the three kill -9s, `broker` = the three broker faults.
    pub fn parse_list(s: &str) -> Result<Vec<RFault>, String> {
        let s = s.trim();
        if s.is_empty() {
            return Ok(SCHEDULE.to_vec());
        }
        if s == "all" {
            return Ok(ALL.to_vec());
        }
        let mut out = Vec::new();
        for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match name {
                "kill" => out.extend([RFault::Kill9, RFault::Kill9Claim, RFault::Kill9Ahead]),
                "broker" => out.extend([
                    RFault::BrokerCut,
                    RFault::BrokerReset,
                    RFault::BrokerBlackHole,
                ]),
                _ => out.push(*ALL.iter().find(|f| f.name() == name).ok_or_else(|| {
                    let names: Vec<_> = ALL.iter().map(|f| f.name()).collect();
                    format!(
                        "unknown relay fault '{name}' (known: {}, kill, broker, all)",
                        names.join(", ")
                    )
                })?),
            }
        }
        Ok(out)
    }

    /// The sinks this fault applies to.
    pub fn sinks(self) -> &'static [SinkKind] {
        use SinkKind::*;
        match self {
            RFault::BrokerCut | RFault::BrokerReset | RFault::BrokerBlackHole => {
                &[Webhook, Amqp, Nats]
            }
            RFault::WebhookRefuse => &[Webhook],
            // A relay writing to stdout never holds two batches: it never claims ahead.
            RFault::Kill9Ahead => &[Exec, Webhook, Amqp, Nats],
            _ => &[Stdout, Exec, Webhook, Amqp, Nats],
        }
    }
}

impl fmt::Display for RFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SinkKind {
    Stdout,
    Exec,
    Webhook,
    Amqp,
    Nats,
}

pub const ALL_SINKS: [SinkKind; 5] = [
    SinkKind::Stdout,
    SinkKind::Exec,
    SinkKind::Webhook,
    SinkKind::Amqp,
    SinkKind::Nats,
];

impl SinkKind {
    pub fn name(self) -> &'static str {
        match self {
            SinkKind::Stdout => "stdout",
            SinkKind::Exec => "exec",
            SinkKind::Webhook => "webhook",
            SinkKind::Amqp => "amqp",
            SinkKind::Nats => "nats",
        }
    }

    pub fn parse_list(s: &str) -> Result<Vec<SinkKind>, String> {
        let s = s.trim();
        if s.is_empty() || s == "all" {
            return Ok(ALL_SINKS.to_vec());
        }
        s.split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(|name| {
                ALL_SINKS
                    .iter()
                    .copied()
                    .find(|k| k.name() == name)
                    .ok_or_else(|| {
                        format!("unknown sink '{name}' (known: stdout, exec, webhook, amqp, nats)")
                    })
            })
            .collect()
    }
}

impl fmt::Display for SinkKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RInv {
    /// Nothing committed is lost: every committed event reached the sink (after a final drain),
    /// or is still in the outbox.
    L,
    /// Nothing rolled back (or never written) reaches the sink.
    R,
    /// Per aggregate, in arrival order: first deliveries in order, and a redelivered run
    /// completes its prefix before any event delivered for the first time.
    O,
    /// An event reaches the sink more than once only around a fault.
    D,
    /// Every relay exits within its bound, with a documented code: `--once` in time (69 within
    /// the statement deadline + slack of a silent database), a service on SIGTERM.
    B,
    /// One stuck part never holds up the rest: an event of a fresh aggregate is delivered within
    /// its bound while a relay is stopped, an aggregate refused or backends frozen, and once
    /// the faults healed everything drains.
    P,
}

pub const RINVARIANTS: [RInv; 6] = [RInv::L, RInv::R, RInv::O, RInv::D, RInv::B, RInv::P];

impl fmt::Display for RInv {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self:?}")
    }
}
