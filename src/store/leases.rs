//! The `leases` table: the heartbeat lease, as plain SQL judged by the database clock.
//!
//! One row per target (`leases`). Every transition is one statement whose WHERE names the
//! holder's token, so a holder that was taken over or force-released touches 0 rows — and that
//! *is* how it learns it lost (river's `river_leader.sql` works the same way). Expiry is always
//! `heartbeat_at + ttl_ms < now()` on the server ([`super::EXPIRED`]): the holder's own TTL,
//! the database's clock.
//!
//! Statements use `query_typed`, which skips the separate prepare round trip; most of a short
//! `leasectl run` is round trips.

use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row};
use uuid::Uuid;

use super::waiters::{self, Busy, Ticket};
use super::{ms, sql};
use crate::db::Schema;

/// A lease we hold.
#[derive(Debug, Clone)]
pub struct Lease {
    pub target: String,
    pub token: Uuid,
    pub fence: i64,
    /// The database's clock when it granted the lease; with the local monotonic clock it dates
    /// the run on the database clock (see [`DbClock`]).
    pub granted_at: SystemTime,
    /// `--label`, stored with the holder and the run.
    pub label: Option<String>,
}

/// Dates events on the database's clock without asking it again: the time the database
/// reported at a known local instant, plus monotonic time elapsed since.
#[derive(Debug, Clone, Copy)]
pub struct DbClock {
    pub db_time: SystemTime,
    pub local: tokio::time::Instant,
}

impl DbClock {
    pub fn at(&self, instant: tokio::time::Instant) -> SystemTime {
        self.db_time + instant.saturating_duration_since(self.local)
    }
}

/// Who holds a busy target, as the database sees it now.
#[derive(Debug, Clone)]
pub struct Holder {
    pub host: Option<String>,
    pub pid: Option<i32>,
    pub label: Option<String>,
    /// How long it has held the lease.
    pub running: Duration,
    pub fence: i64,
    pub ttl: Duration,
    pub heartbeat_age: Duration,
    /// Time left until the holder's TTL runs out (zero if already expired).
    pub expires_in: Duration,
}

impl Holder {
    /// `ci-7 pid 4411 [label]`.
    pub fn who(&self) -> String {
        let mut who = match (&self.host, self.pid) {
            (Some(h), Some(p)) => format!("{h} pid {p}"),
            (Some(h), None) => h.clone(),
            _ => "an unknown holder".into(),
        };
        if let Some(l) = &self.label {
            who.push_str(&format!(" [{l}]"));
        }
        who
    }

    pub fn describe(&self) -> String {
        let who = self.who();
        format!(
            "held by {who} (fence {}), last heartbeat {} ago, ttl {}",
            self.fence,
            crate::fmt::duration(self.heartbeat_age),
            crate::fmt::duration(self.ttl)
        )
    }
}

pub enum Acquired {
    Held(Lease),
    /// Someone else holds it, or waiters go first: the holder and the queue.
    Busy(Busy),
}

/// Who asks for a lease, as the acquiring statement records it.
#[derive(Debug, Clone, Copy)]
pub struct Contender<'a> {
    /// The caller's for all its attempts (see [`acquire`]).
    pub token: Uuid,
    pub ttl: Duration,
    pub host: &'a str,
    pub pid: i32,
    pub label: Option<&'a str>,
    /// The caller's place in the queue, once it waits (see [`super::waiters`]).
    pub ticket: Option<Ticket>,
}

/// Takes the lease if it is free or its holder's TTL has run out — and no live ordered waiter
/// goes first — in one statement.
///
/// A concurrent acquirer blocks on the row lock of `ON CONFLICT DO UPDATE` and then re-checks
/// the WHERE against the committed winner, so exactly one of any number of racers gets the row.
///
/// The queue: a caller without a ticket (no `--wait`, or not yet queued) or with an unordered
/// one does not get a free lease while any live `fifo`/`latest` waiter exists (no queue
/// jumping); an ordered waiter gets it only when no such waiter has an earlier ticket, and only
/// while its own row is live and not superseded. The winner's row leaves the queue in the same
/// statement. With no waiters this is one index probe more, not one round trip more.
///
/// `token` is the caller's for all its attempts: an attempt the caller gave up on (its
/// statement stalled past the client's deadline) may still commit, and the lease it took is
/// then the caller's own to take again at once — not a ghost the caller waits out for a TTL.
pub async fn acquire(
    client: &Client,
    schema: &Schema,
    target: &str,
    who: &Contender<'_>,
) -> Result<Acquired> {
    let sql = sql(
        schema,
        "WITH acquired AS (
             INSERT INTO {s}.leases AS l
                    (target, token, fence, ttl_ms, heartbeat_at, acquired_at, holder_host,
                     holder_pid, holder_label)
             VALUES ($1, $2, 1, $3, now(), now(), $4, $5, $6)
             ON CONFLICT (target) DO UPDATE
                SET token = excluded.token, fence = l.fence + 1, ttl_ms = excluded.ttl_ms,
                    heartbeat_at = now(), acquired_at = now(),
                    holder_host = excluded.holder_host, holder_pid = excluded.holder_pid,
                    holder_label = excluded.holder_label
              WHERE l.token = excluded.token
                 OR ((l.token IS NULL OR {expired})
                     AND NOT EXISTS (
                         SELECT 1 FROM {s}.waiters w
                          WHERE w.target = $1 AND w.queue <> 'unordered' AND {live_waiter}
                            AND NOT (coalesce($8, false) AND w.ticket >= $7))
                     AND ($7::int8 IS NULL OR EXISTS (
                         SELECT 1 FROM {s}.waiters w WHERE w.ticket = $7 AND {live_waiter})))
             RETURNING fence, now() AS granted_at
         ), dequeued AS (
             DELETE FROM {s}.waiters WHERE ticket = $7 AND EXISTS (SELECT 1 FROM acquired)
         )
         SELECT fence, granted_at FROM acquired",
    );
    let number = who.ticket.map(|t| t.number);
    let ordered = who.ticket.map(|t| t.mode.ordered());
    let params: [(&(dyn ToSql + Sync), Type); 8] = [
        (&target, Type::TEXT),
        (&who.token, Type::UUID),
        (&ms(who.ttl), Type::INT8),
        (&who.host, Type::TEXT),
        (&who.pid, Type::INT4),
        (&who.label, Type::TEXT),
        (&number, Type::INT8),
        (&ordered, Type::BOOL),
    ];
    let rows = client
        .query_typed(&sql, &params)
        .await
        .context("cannot acquire the lease")?;
    if let Some(row) = rows.first() {
        return Ok(Acquired::Held(Lease {
            target: target.to_owned(),
            token: who.token,
            fence: row.get("fence"),
            granted_at: row.get("granted_at"),
            label: who.label.map(str::to_owned),
        }));
    }
    Ok(Acquired::Busy(
        waiters::look(client, schema, target, who.ticket).await?,
    ))
}

/// A holder from a row with the columns holder_host, holder_pid, holder_label, fence, ttl_ms,
/// age_ms and running_ms.
pub(super) fn holder_from_row(r: &Row) -> Holder {
    let ttl_ms: i64 = r.get("ttl_ms");
    let age_ms: i64 = r.get("age_ms");
    Holder {
        host: r.get("holder_host"),
        pid: r.get("holder_pid"),
        label: r.get("holder_label"),
        running: crate::fmt::millis(r.get("running_ms")),
        fence: r.get("fence"),
        ttl: crate::fmt::millis(ttl_ms),
        heartbeat_age: crate::fmt::millis(age_ms),
        expires_in: crate::fmt::millis(ttl_ms - age_ms),
    }
}

/// Renews the lease. `Ok(false)` means the token no longer matches: the lease was taken over
/// or force-released, and the holder must stop at once.
pub async fn heartbeat(
    client: &Client,
    schema: &Schema,
    lease: &Lease,
) -> Result<bool, tokio_postgres::Error> {
    let sql =
        schema.sql("UPDATE {s}.leases SET heartbeat_at = now() WHERE target = $1 AND token = $2");
    let n = client
        .execute_typed(
            &sql,
            &[(&lease.target, Type::TEXT), (&lease.token, Type::UUID)],
        )
        .await?;
    Ok(n == 1)
}

/// Releases the lease if we still hold it and wakes waiters. Returns whether it was ours.
pub async fn release(client: &Client, schema: &Schema, lease: &Lease) -> Result<bool> {
    let sql = schema.sql(
        "UPDATE {s}.leases SET token = NULL, holder_host = NULL, holder_pid = NULL,
                holder_label = NULL
          WHERE target = $1 AND token = $2
         RETURNING pg_notify($3, target)",
    );
    let channel = schema.lease_channel();
    let rows = client
        .query_typed(
            &sql,
            &[
                (&lease.target, Type::TEXT),
                (&lease.token, Type::UUID),
                (&channel, Type::TEXT),
            ],
        )
        .await
        .context("cannot release the lease")?;
    Ok(!rows.is_empty())
}

/// Operator override: frees `target` whoever holds it. Returns the holder it had, if any.
/// The fence is kept, so the next acquisition is still numbered higher. One statement, so the
/// holder reported is the one that was actually released.
pub async fn force_release(
    client: &Client,
    schema: &Schema,
    target: &str,
) -> Result<Option<Holder>> {
    let sql = sql(
        schema,
        "WITH old AS (
             SELECT l.target, l.holder_host, l.holder_pid, l.holder_label, l.fence, l.ttl_ms,
                    {heartbeat_age_ms} AS age_ms, {running_ms} AS running_ms
               FROM {s}.leases l WHERE l.target = $1 AND l.token IS NOT NULL FOR UPDATE
         )
         UPDATE {s}.leases l SET token = NULL, holder_host = NULL, holder_pid = NULL,
                holder_label = NULL
           FROM old WHERE l.target = old.target
         RETURNING old.holder_host, old.holder_pid, old.holder_label, old.fence, old.ttl_ms,
                   old.age_ms, old.running_ms, pg_notify($2, l.target)",
    );
    let channel = schema.lease_channel();
    let rows = client
        .query_typed(&sql, &[(&target, Type::TEXT), (&channel, Type::TEXT)])
        .await
        .context("cannot release the lease")?;
    Ok(rows.first().map(holder_from_row))
}

/// One target as `status` shows it: its lease and its newest run.
#[derive(Debug)]
pub struct TargetStatus {
    pub target: String,
    /// `held`, `expired` or `free`.
    pub state: String,
    pub holder_host: Option<String>,
    pub holder_pid: Option<i32>,
    pub holder_label: Option<String>,
    pub fence: i64,
    /// `None` while the target is free.
    pub heartbeat_age_ms: Option<i64>,
    pub ttl_ms: i64,
    /// The newest run that was not `skipped`.
    pub last_run: Option<LastRun>,
    /// How many `run --slot` callers found their slot done (among the stored runs).
    pub skipped: i64,
}

/// The newest run of a target, for `status`.
#[derive(Debug)]
pub struct LastRun {
    pub id: Uuid,
    pub outcome: String,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub finished_at: SystemTime,
    pub duration_ms: i64,
    /// How long ago it finished, by the database clock.
    pub age_ms: i64,
}

/// Every target (or just `target`), by name, with its newest run that ran (a skip is counted,
/// not shown: the last run is what the command last did).
pub async fn status(
    client: &Client,
    schema: &Schema,
    target: Option<&str>,
) -> Result<Vec<TargetStatus>> {
    let sql = sql(
        schema,
        "SELECT l.target,
                CASE WHEN l.token IS NULL THEN 'free' WHEN {expired} THEN 'expired'
                     ELSE 'held' END AS state,
                l.holder_host, l.holder_pid, l.holder_label, l.fence,
                CASE WHEN l.token IS NOT NULL THEN {heartbeat_age_ms} END AS heartbeat_age_ms,
                l.ttl_ms,
                r.id AS run_id, r.outcome, r.exit_code, r.signal, r.finished_at,
                round(extract(epoch FROM r.finished_at - r.started_at) * 1000)::int8 AS duration_ms,
                round(extract(epoch FROM now() - r.finished_at) * 1000)::int8 AS run_age_ms,
                (SELECT count(*) FROM {s}.runs k
                  WHERE k.target = l.target AND k.slot IS NOT NULL AND k.outcome = 'skipped')
                  AS skipped
           FROM {s}.leases l
           LEFT JOIN LATERAL (
                SELECT * FROM {s}.runs
                 WHERE runs.target = l.target AND runs.outcome <> 'skipped'
                 ORDER BY finished_at DESC LIMIT 1
           ) r ON true
          WHERE $1::text IS NULL OR l.target = $1
          ORDER BY l.target",
    );
    let rows = client
        .query_typed(&sql, &[(&target, Type::TEXT)])
        .await
        .context("cannot read the leases")?;
    Ok(rows
        .iter()
        .map(|r| TargetStatus {
            target: r.get("target"),
            state: r.get("state"),
            holder_host: r.get("holder_host"),
            holder_pid: r.get("holder_pid"),
            holder_label: r.get("holder_label"),
            fence: r.get("fence"),
            heartbeat_age_ms: r.get("heartbeat_age_ms"),
            ttl_ms: r.get("ttl_ms"),
            last_run: r.get::<_, Option<Uuid>>("run_id").map(|id| LastRun {
                id,
                outcome: r.get("outcome"),
                exit_code: r.get("exit_code"),
                signal: r.get("signal"),
                finished_at: r.get("finished_at"),
                duration_ms: r.get("duration_ms"),
                age_ms: r.get("run_age_ms"),
            }),
            skipped: r.get("skipped"),
        })
        .collect())
}
