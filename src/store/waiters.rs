//! The `waiters` table: the queue of `run --wait` callers of a busy target.
//!
//! A waiter joins once, on its first busy attempt ([`join`]), and gets a ticket from the
//! database: that is its place. On every poll after a busy attempt it reads the queue and
//! renews its row in one statement ([`look`]); the acquiring statement
//! ([`super::leases::acquire`]) grants the lease only while no live ordered waiter with an
//! earlier ticket exists, and deletes the winner's row in the same statement. A waiter that
//! gives up (signal, `--wait`'s limit, superseded) deletes its row ([`leave`]); one that dies is
//! ignored once its TTL ran out ([`LIVE`]) and deleted by the next arrival.
//!
//! Every change that can let another waiter go (a leave, a supersession) is announced on the
//! lease channel with the target as payload, like a release: waiters wake at once.

use std::time::Duration;

use anyhow::{Context, Result};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row};

use super::leases::{holder_from_row, Holder};
use super::{ms, sql};
use crate::db::Schema;

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

/// Our place in the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    pub number: i64,
    pub mode: QueueMode,
}

/// A caller as a queue shows it: host, pid and `--label`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Who {
    pub host: Option<String>,
    pub pid: Option<i32>,
    pub label: Option<String>,
}

impl std::fmt::Display for Who {
    /// `ci-7 pid 4411 [label]`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.host, self.pid) {
            (Some(h), Some(p)) => write!(f, "{h} pid {p}")?,
            (Some(h), None) => f.write_str(h)?,
            _ => f.write_str("an unknown caller")?,
        }
        if let Some(l) = &self.label {
            write!(f, " [{l}]")?;
        }
        Ok(())
    }
}

/// What a busy caller sees: the holder and the queue.
#[derive(Debug, Clone)]
pub struct Busy {
    /// `None`: the lease is free (or its holder's TTL ran out) — then either ordered waiters
    /// go first (`ahead > 0`) or it was released since the attempt and trying again is right.
    /// Of several holders, the one whose lease runs out first.
    pub holder: Option<Holder>,
    /// How many live holders the target has (more than one with `--max-holders`).
    pub holders: i64,
    /// The `--max-holders` in force (1 for a single holder).
    pub in_force: i32,
    /// The lease row says an ordered waiter may exist (`queued_until`), which is what a caller
    /// without a place goes by.
    pub queued: bool,
    /// Live waiters of the target, of every mode.
    pub waiting: i64,
    /// Ordered waiters that go before the caller (all of them for a caller without a place).
    pub ahead: i64,
    /// The first ordered waiter: who goes next.
    pub next: Option<Who>,
    /// The caller's own place, when it has a ticket.
    pub mine: Option<Place>,
}

/// A waiter's own row, as its last poll found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Place {
    /// Still queued: 1-based, among [`Busy::waiting`].
    Position(i64),
    /// A later `--queue latest` waiter took our place.
    Superseded(Who),
    /// The row is gone or its TTL ran out (we were paused or cut off for that long): join again,
    /// at the back.
    Lost,
}

/// Joins the queue of `target` and returns the ticket; deletes the rows of dead waiters of the
/// target and, for `--queue latest`, supersedes every older live waiter (announced on the lease
/// channel so that they learn at once).
pub async fn join(
    client: &Client,
    schema: &Schema,
    target: &str,
    mode: QueueMode,
    ttl: Duration,
    (host, pid, label): (&str, i32, Option<&str>),
) -> Result<Ticket> {
    // The delete and the supersession touch disjoint rows (dead / live), as a row must not be
    // changed twice by one statement.
    let sql = sql(
        schema,
        "WITH dead AS (
             DELETE FROM {s}.waiters w WHERE w.target = $1 AND NOT {live_waiter}
                AND w.superseded_at IS NULL
         ), stale AS (
             DELETE FROM {s}.waiters w WHERE w.target = $1 AND w.superseded_at IS NOT NULL
                AND w.superseded_at + w.ttl_ms * interval '1 millisecond' < now()
         ), joined AS (
             INSERT INTO {s}.waiters
                    (target, queue, ttl_ms, heartbeat_at, arrived_at, host, pid, label)
             VALUES ($1, $2, $3, now(), now(), $4, $5, $6)
             RETURNING ticket
         ), superseded AS (
             UPDATE {s}.waiters w
                SET superseded_at = now(), superseded_host = $4, superseded_pid = $5,
                    superseded_label = $6
               FROM joined
              WHERE $2 = 'latest' AND w.target = $1 AND w.ticket < joined.ticket AND {live_waiter}
             RETURNING w.ticket
         ), flagged AS (
             UPDATE {s}.leases l
                SET queued_until = greatest(l.queued_until, now() + $3 * interval '1 millisecond')
              WHERE l.target = $1 AND l.place = 0 AND $2 <> 'unordered'
         )
         SELECT joined.ticket,
                CASE WHEN EXISTS (SELECT 1 FROM superseded) THEN pg_notify($7, $1) END
           FROM joined",
    );
    let mode_s = mode.as_str();
    let channel = schema.lease_channel();
    let params: [(&(dyn ToSql + Sync), Type); 7] = [
        (&target, Type::TEXT),
        (&mode_s, Type::TEXT),
        (&ms(ttl), Type::INT8),
        (&host, Type::TEXT),
        (&pid, Type::INT4),
        (&label, Type::TEXT),
        (&channel, Type::TEXT),
    ];
    let row = client
        .query_typed_one(&sql, &params)
        .await
        .context("cannot join the queue")?;
    Ok(Ticket {
        number: row.get("ticket"),
        mode,
    })
}

/// After a busy attempt: the holder and the queue of `target`, and — for a waiter (`ticket`) —
/// its own place, renewing its row in the same statement (a row whose TTL already ran out is
/// not renewed: the waiter joins again).
pub async fn look(
    client: &Client,
    schema: &Schema,
    target: &str,
    ticket: Option<Ticket>,
) -> Result<Busy> {
    let sql = sql(
        schema,
        "WITH me AS (
             UPDATE {s}.waiters w SET heartbeat_at = now()
              WHERE w.ticket = $2 AND (w.superseded_at IS NOT NULL OR {live_waiter})
             RETURNING w.ticket, w.superseded_at IS NOT NULL AS superseded,
                       w.superseded_host, w.superseded_pid, w.superseded_label, w.ttl_ms,
                       w.queue <> 'unordered' AS ordered
         ), flagged AS (
             -- Keeps `queued_until` ahead of a live ordered waiter: renewed once it is within half
             -- the waiter's TTL of running out, so not every waiter writes the lease row at
             -- every poll.
             UPDATE {s}.leases l
                SET queued_until = now() + me.ttl_ms * interval '1 millisecond'
               FROM me
              WHERE l.target = $1 AND l.place = 0 AND me.ordered AND NOT me.superseded
                AND (l.queued_until IS NULL
                     OR l.queued_until < now() + me.ttl_ms * interval '0.5 millisecond')
         ), q AS (
             SELECT w.ticket, w.queue <> 'unordered' AS ordered, w.host, w.pid, w.label
               FROM {s}.waiters w WHERE w.target = $1 AND {live_waiter}
         ), nxt AS (
             SELECT host, pid, label FROM q WHERE ordered ORDER BY ticket LIMIT 1
         )
         SELECT h.holder_host, h.holder_pid, h.holder_label, h.fence, h.ttl_ms, h.age_ms,
                h.running_ms,
                (SELECT count(*) FROM {s}.leases l
                  WHERE l.target = $1 AND l.token IS NOT NULL AND NOT {expired}) AS holders,
                coalesce((SELECT l.max_holders FROM {s}.leases l
                           WHERE l.target = $1 AND l.place = 0), 1) AS in_force,
                coalesce((SELECT {queued} FROM {s}.leases l
                           WHERE l.target = $1 AND l.place = 0), false) AS queued,
                (SELECT count(*) FROM q) AS waiting,
                (SELECT count(*) FROM q WHERE ordered AND NOT (coalesce($3, false)
                                                               AND q.ticket >= $2)) AS ahead,
                (SELECT count(*) FROM q WHERE q.ticket < $2) + 1 AS position,
                nxt.host AS next_host, nxt.pid AS next_pid, nxt.label AS next_label,
                me.ticket AS my_ticket, me.superseded, me.superseded_host,
                me.superseded_pid, me.superseded_label
           FROM (SELECT 1) one
           -- The live holder whose lease runs out first (of several, with --max-holders).
           LEFT JOIN LATERAL (
                SELECT l.holder_host, l.holder_pid, l.holder_label, l.fence, l.ttl_ms,
                       {heartbeat_age_ms} AS age_ms, {running_ms} AS running_ms
                  FROM {s}.leases l
                 WHERE l.target = $1 AND l.token IS NOT NULL AND NOT {expired}
                 ORDER BY l.heartbeat_at + l.ttl_ms * interval '1 millisecond' LIMIT 1
           ) h ON true
           LEFT JOIN nxt ON true
           LEFT JOIN me ON true",
    );
    let number = ticket.map(|t| t.number);
    let ordered = ticket.map(|t| t.mode.ordered());
    let row = client
        .query_typed_one(
            &sql,
            &[
                (&target, Type::TEXT),
                (&number, Type::INT8),
                (&ordered, Type::BOOL),
            ],
        )
        .await
        .context("cannot read the queue")?;
    let holder = row
        .get::<_, Option<i64>>("fence")
        .map(|_| holder_from_row(&row));
    let next = row.get::<_, Option<String>>("next_host").map(|host| Who {
        host: Some(host),
        pid: row.get("next_pid"),
        label: row.get("next_label"),
    });
    let mine = ticket.map(|_| place_from_row(&row));
    Ok(Busy {
        holder,
        holders: row.get("holders"),
        in_force: row.get("in_force"),
        queued: row.get("queued"),
        waiting: row.get("waiting"),
        ahead: row.get("ahead"),
        next,
        mine,
    })
}

fn place_from_row(row: &Row) -> Place {
    if row.get::<_, Option<i64>>("my_ticket").is_none() {
        return Place::Lost;
    }
    if row.get::<_, Option<bool>>("superseded") == Some(true) {
        return Place::Superseded(Who {
            host: row.get("superseded_host"),
            pid: row.get("superseded_pid"),
            label: row.get("superseded_label"),
        });
    }
    Place::Position(row.get("position"))
}

/// Leaves the queue (gave up, interrupted, superseded), waking the waiters behind, and
/// recomputes `queued_until` from the waiters left.
pub async fn leave(client: &Client, schema: &Schema, ticket: Ticket) -> Result<()> {
    let sql = sql(
        schema,
        "WITH gone AS (
             DELETE FROM {s}.waiters WHERE ticket = $1 RETURNING target
         ), flagged AS (
             UPDATE {s}.leases l SET queued_until = {queued_until}
               FROM gone WHERE l.target = gone.target AND l.place = 0
         )
         SELECT pg_notify($2, target) FROM gone",
    )
    .replace("$TICKET", "$1");
    let channel = schema.lease_channel();
    client
        .query_typed(
            &sql,
            &[(&ticket.number, Type::INT8), (&channel, Type::TEXT)],
        )
        .await
        .context("cannot leave the queue")?;
    Ok(())
}

/// One waiter as `status` lists it.
#[derive(Debug)]
pub struct Listed {
    pub target: String,
    /// 1-based, in ticket order among the target's live waiters.
    pub position: i64,
    pub queue: String,
    pub who: Who,
    pub waiting_ms: i64,
}

/// The live waiters of every target (or just `target`), in queue order.
pub async fn list(client: &Client, schema: &Schema, target: Option<&str>) -> Result<Vec<Listed>> {
    let sql = sql(
        schema,
        "SELECT w.target, w.queue, w.host, w.pid, w.label,
                row_number() OVER (PARTITION BY w.target ORDER BY w.ticket) AS position,
                greatest(0, round(extract(epoch FROM now() - w.arrived_at) * 1000))::int8
                  AS waiting_ms
           FROM {s}.waiters w
          WHERE ($1::text IS NULL OR w.target = $1) AND {live_waiter}
          ORDER BY w.target, w.ticket",
    );
    let rows = client
        .query_typed(&sql, &[(&target, Type::TEXT)])
        .await
        .context("cannot read the waiters")?;
    Ok(rows
        .iter()
        .map(|r| Listed {
            target: r.get("target"),
            position: r.get("position"),
            queue: r.get("queue"),
            who: Who {
                host: r.get("host"),
                pid: r.get("pid"),
                label: r.get("label"),
            },
            waiting_ms: r.get("waiting_ms"),
        })
        .collect())
}
