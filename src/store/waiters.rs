//! The `waiters` table: the queue of `run --wait` callers of a busy target.
//!
//! A waiter joins once, on its first busy attempt ([`join`]), and gets a ticket from the
//! database: that is its place. On every poll after a busy attempt it reads the queue and
//! renews its row in one statement ([`look`]); the acquiring statement
//! ([`super::leases::acquire`]) grants the lease only while no live ordered waiter with an
//! earlier ticket exists, and deletes the winner's row in the same statement. A waiter that
//! gives up (signal, `--wait`'s limit, superseded) deletes its row ([`leave`]); one that dies is
//! ignored once its TTL ran out (`LIVE_WAITER` in the shared predicates) and deleted by the next arrival.
//!
//! Every change that can let another waiter go (a leave, a supersession) is announced on the
//! lease channel with the target as payload, like a release: waiters wake at once.

use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row};

use super::holder::{holder_from_row, Holder};
use super::{ms, sql};
use crate::db::Schema;
use crate::model::order::QueueMode;

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
    /// A previous holder of the target is still stopping its command (the lease was taken from
    /// it): nobody starts before it has stopped or its deadline passed.
    pub stopping: Option<Stopping>,
}

/// A previous holder still stopping its command (see migrations/0011_stopping.sql).
#[derive(Debug, Clone)]
pub struct Stopping {
    /// `host pid N`.
    pub who: String,
    pub fence: i64,
    /// Until its deadline at most.
    pub left: Duration,
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
/// channel so that they learn at once). `again`: the ticket of a waiter that was granted the
/// lease but could not start in time, which joins again in its old place.
pub async fn join(
    client: &Client,
    schema: &Schema,
    target: &str,
    (mode, again): (QueueMode, Option<i64>),
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
                    ({ticket}target, queue, ttl_ms, heartbeat_at, arrived_at, host, pid, label)
             {overriding} VALUES ({again}$1, $2, $3, now(), now(), $4, $5, $6)
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
    // Joining again takes the old ticket, so the waiter keeps its place.
    let (ticket, overriding, again_p) = match again {
        Some(_) => ("ticket, ", "OVERRIDING SYSTEM VALUE", "$8, "),
        None => ("", "", ""),
    };
    let sql = sql
        .replace("{ticket}", ticket)
        .replace("{overriding}", overriding)
        .replace("{again}", again_p);
    let mode_s = mode.as_str();
    let channel = schema.lease_channel();
    let ttl_ms = ms(ttl);
    let mut params: Vec<(&(dyn ToSql + Sync), Type)> = vec![
        (&target, Type::TEXT),
        (&mode_s, Type::TEXT),
        (&ttl_ms, Type::INT8),
        (&host, Type::TEXT),
        (&pid, Type::INT4),
        (&label, Type::TEXT),
        (&channel, Type::TEXT),
    ];
    if let Some(number) = &again {
        params.push((number, Type::INT8));
    }
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
///
/// A caller without a place that finds a live holder — the busy answer of a plain `run` —
/// learns it from two plain statements instead (`glance`); everything else is read by the full
/// statement.
pub async fn look(
    client: &Client,
    schema: &Schema,
    target: &str,
    ticket: Option<Ticket>,
) -> Result<Busy> {
    if ticket.is_none() {
        if let Some(busy) = glance(client, schema, target).await? {
            return Ok(busy);
        }
    }
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
                me.superseded_pid, me.superseded_label,
                st.stopping_host, st.stopping_pid, st.stopping_fence, st.stopping_left_ms
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
           LEFT JOIN me ON true
           -- The previous holder still stopping longest, of any place.
           LEFT JOIN LATERAL (
                SELECT l.stopping_host, l.stopping_pid, l.stopping_fence,
                       {stopping_left_ms} AS stopping_left_ms
                  FROM {s}.leases l WHERE l.target = $1 AND {stopping}
                 ORDER BY l.stopping_until DESC LIMIT 1
           ) st ON true",
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
    let stopping = row
        .get::<_, Option<i64>>("stopping_left_ms")
        .map(|left| Stopping {
            who: super::holder::who(row.get("stopping_host"), row.get("stopping_pid"), None),
            fence: row.get::<_, Option<i64>>("stopping_fence").unwrap_or(0),
            left: crate::fmt::millis(left),
        });
    Ok(Busy {
        stopping,
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

/// The busy answer of a caller without a place, when the target has a live holder: its lease
/// rows as stored and the count of its live waiters, two plain statements in one flight.
/// `None` when no place is held: then what goes first (a stopping holder, the queue) and who
/// is next is the full look's to tell.
///
/// The full look's statement costs a fresh server process about 3 ms to parse and plan (its
/// two data-modifying steps for a waiter's own row, eight subqueries, the time arithmetic);
/// these two about 0.9 ms. So the holder, its expiry and the stopping deadline are worked out
/// here from the rows' times and the database's `now()` — the same comparisons as `{expired}`
/// and `{stopping}`, at the same microseconds — and [`Busy::next`] is left empty: only the
/// answer without a holder names who goes next.
async fn glance(client: &Client, schema: &Schema, target: &str) -> Result<Option<Busy>> {
    let places = schema.sql(
        "SELECT l.token IS NOT NULL AS held, l.max_holders, l.place, l.holder_host, l.holder_pid,
                l.holder_label, l.fence, l.ttl_ms, l.heartbeat_at, l.acquired_at, l.queued_until,
                l.stopping_token IS NOT NULL AS stopping, l.stopping_until, l.stopping_host,
                l.stopping_pid, l.stopping_fence, now() AS now
           FROM {s}.leases l WHERE l.target = $1",
    );
    let queue = sql(
        schema,
        "SELECT count(*) AS waiting, count(*) FILTER (WHERE w.queue <> 'unordered') AS ordered
           FROM {s}.waiters w WHERE w.target = $1 AND {live_waiter}",
    );
    let param: [(&(dyn ToSql + Sync), Type); 1] = [(&target, Type::TEXT)];
    let (places, queue) = tokio::join!(
        client.query_typed(&places, &param),
        client.query_typed(&queue, &param),
    );
    let (places, queue) = (
        places.context("cannot read the lease")?,
        queue.context("cannot read the queue")?,
    );
    let Some(now) = places.first().map(|r| r.get::<_, SystemTime>("now")) else {
        return Ok(None);
    };
    let since = |then: SystemTime| now.duration_since(then).unwrap_or_default();
    let until = |then: SystemTime| then.duration_since(now).unwrap_or_default();
    let mut holders = 0;
    let mut first: Option<(SystemTime, Holder)> = None;
    let mut in_force = 1;
    let mut queued = false;
    let mut stopping: Option<(SystemTime, Stopping)> = None;
    for r in &places {
        let ttl = crate::fmt::millis(r.get("ttl_ms"));
        let heartbeat_at: SystemTime = r.get("heartbeat_at");
        let expires_at = heartbeat_at + ttl;
        if r.get::<_, i32>("place") == 0 {
            in_force = r.get("max_holders");
            queued = r
                .get::<_, Option<SystemTime>>("queued_until")
                .is_some_and(|q| q > now);
        }
        // `{expired}`: the heartbeat plus the TTL before now.
        if r.get("held") && expires_at >= now {
            holders += 1;
            if first.as_ref().is_none_or(|(at, _)| expires_at < *at) {
                let age = rounded(since(heartbeat_at));
                let holder = Holder {
                    host: r.get("holder_host"),
                    pid: r.get("holder_pid"),
                    label: r.get("holder_label"),
                    running: rounded(since(r.get("acquired_at"))),
                    fence: r.get("fence"),
                    ttl,
                    heartbeat_age: age,
                    expires_in: ttl.saturating_sub(age),
                };
                first = Some((expires_at, holder));
            }
        }
        // `{stopping}`: a stopping holder's deadline after now.
        let deadline = r.get::<_, Option<SystemTime>>("stopping_until");
        if let Some(until_at) = deadline.filter(|d| r.get("stopping") && *d > now) {
            if stopping.as_ref().is_none_or(|(at, _)| until_at > *at) {
                let st = Stopping {
                    who: super::holder::who(r.get("stopping_host"), r.get("stopping_pid"), None),
                    fence: r.get::<_, Option<i64>>("stopping_fence").unwrap_or(0),
                    left: rounded(until(until_at)),
                };
                stopping = Some((until_at, st));
            }
        }
    }
    let Some((_, holder)) = first else {
        return Ok(None);
    };
    let queue = queue.first().context("cannot read the queue")?;
    Ok(Some(Busy {
        holder: Some(holder),
        holders,
        in_force,
        queued,
        waiting: queue.get("waiting"),
        ahead: queue.get("ordered"),
        next: None,
        mine: None,
        stopping: stopping.map(|(_, st)| st),
    }))
}

/// A span to the nearest millisecond, as the full look's `round(… * 1000)` gives it.
fn rounded(d: Duration) -> Duration {
    Duration::from_millis(u64::try_from((d.as_micros() + 500) / 1000).unwrap_or(u64::MAX))
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

/// Leaves the queue (gave up, interrupted, superseded, or shared a result), waking the waiters
/// behind. One short statement on the waiter's own row: with many waiters leaving at once (the
/// callers of a singleflight sharing one result) none waits for another. `queued_until` is left
/// as it is — it may now say a waiter may exist for a while longer than one does, which only ever
/// errs on the safe side; the first caller that finds the target free with nobody queued corrects
/// it ([`requeue`]).
pub async fn leave(client: &Client, schema: &Schema, ticket: Ticket) -> Result<()> {
    let sql = schema.sql(
        "WITH gone AS (DELETE FROM {s}.waiters WHERE ticket = $1 RETURNING target)
         SELECT pg_notify($2, target) FROM gone",
    );
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

/// Lowers `queued_until` of `target` to when its last live ordered waiter runs out (NULL with
/// none), and returns whether one may still exist. For a caller that found the lease free and
/// nobody ahead, but the row still saying that waiters may exist.
///
/// `queued_until` is written by many sessions at once: joiners and renewing waiters only raise
/// it (`greatest`, re-evaluated on the newest row version when they wait for its lock), so they
/// can never lower it wrongly; but a statement that *recomputes* it from the waiters reads them
/// as of its start — it would still count a waiter leaving concurrently (leaving `queued_until`
/// a TTL too late, refusing plain runs meanwhile), and could miss a waiter that joined after its
/// start (too early: a caller could slip ahead of it). So the recomputation runs only here, in a
/// transaction whose first statement locks the target's row, so that the statement after it sees
/// every waiter committed before, and a joiner that comes later waits for the lock and raises the
/// value again.
pub async fn requeue(client: &Client, schema: &Schema, target: &str) -> Result<bool> {
    let work = async {
        lock_target(client, schema, target).await?;
        recompute(client, schema, target).await
    };
    in_transaction(client, work)
        .await
        .context("cannot update the queue")
}

/// Locks the target's place-0 row until the end of the transaction.
async fn lock_target(
    client: &Client,
    schema: &Schema,
    target: &str,
) -> Result<(), tokio_postgres::Error> {
    let lock = schema.sql("SELECT 1 FROM {s}.leases WHERE target = $1 AND place = 0 FOR UPDATE");
    client.query_typed(&lock, &[(&target, Type::TEXT)]).await?;
    Ok(())
}

/// Under the target's lock: `queued_until` from the live ordered waiters; whether one may exist.
async fn recompute(
    client: &Client,
    schema: &Schema,
    target: &str,
) -> Result<bool, tokio_postgres::Error> {
    let set = sql(
        schema,
        "UPDATE {s}.leases l SET queued_until = {queued_until}
          WHERE l.target = $1 AND l.place = 0
         RETURNING {queued} AS queued",
    )
    .replace("$TICKET", "NULL::int8");
    let rows = client.query_typed(&set, &[(&target, Type::TEXT)]).await?;
    Ok(rows.first().is_some_and(|r| r.get("queued")))
}

/// Runs `work` in a transaction: commits it if it succeeded, otherwise rolls it back.
async fn in_transaction<T>(
    client: &Client,
    work: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
) -> Result<T, tokio_postgres::Error> {
    client.batch_execute("BEGIN").await?;
    match work.await {
        Ok(t) => {
            client.batch_execute("COMMIT").await?;
            Ok(t)
        }
        Err(e) => {
            let _ = client.batch_execute("ROLLBACK").await;
            Err(e)
        }
    }
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
