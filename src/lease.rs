//! The heartbeat lease, as plain SQL judged by the database clock.
//!
//! One row per target (`leases`). Every transition is one statement whose WHERE names the
//! holder's token, so a holder that was taken over or force-released touches 0 rows — and that
//! *is* how it learns it lost (river's `river_leader.sql` works the same way). Expiry is always
//! `heartbeat_at + ttl_ms < now()` on the server: the holder's own TTL, the database's clock.
//!
//! Statements use `query_typed`, which skips the separate prepare round trip; most of a short
//! `leasectl run` is round trips.

use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Client;
use uuid::Uuid;

use crate::db::Schema;
use crate::exit::ChildStatus;

/// A lease we hold.
#[derive(Debug, Clone)]
pub struct Lease {
    pub target: String,
    pub token: Uuid,
    pub fence: i64,
    /// The database's clock when it granted the lease; with the local monotonic clock it dates
    /// the run on the database clock (see [`DbClock`]).
    pub granted_at: SystemTime,
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
    pub fence: i64,
    pub ttl: Duration,
    pub heartbeat_age: Duration,
    /// Time left until the holder's TTL runs out (zero if already expired).
    pub expires_in: Duration,
}

impl Holder {
    pub fn describe(&self) -> String {
        let who = match (&self.host, self.pid) {
            (Some(h), Some(p)) => format!("{h} pid {p}"),
            (Some(h), None) => h.clone(),
            _ => "an unknown holder".into(),
        };
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
    /// Someone else holds it. `None`: it was released between our attempt and our look at the
    /// holder, so trying again at once is right.
    Busy(Option<Holder>),
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Takes the lease if it is free or its holder's TTL has run out, in one statement.
///
/// A concurrent acquirer blocks on the row lock of `ON CONFLICT DO UPDATE` and then re-checks
/// the WHERE against the committed winner, so exactly one of any number of racers gets the row.
pub async fn acquire(
    client: &Client,
    schema: &Schema,
    target: &str,
    ttl: Duration,
    host: &str,
    pid: i32,
) -> Result<Acquired> {
    let token = Uuid::new_v4();
    let sql = schema.sql(
        "INSERT INTO {s}.leases AS l
                (target, token, fence, ttl_ms, heartbeat_at, acquired_at, holder_host, holder_pid)
         VALUES ($1, $2, 1, $3, now(), now(), $4, $5)
         ON CONFLICT (target) DO UPDATE
            SET token = excluded.token, fence = l.fence + 1, ttl_ms = excluded.ttl_ms,
                heartbeat_at = now(), acquired_at = now(),
                holder_host = excluded.holder_host, holder_pid = excluded.holder_pid
          WHERE l.token IS NULL
             OR l.heartbeat_at + l.ttl_ms * interval '1 millisecond' < now()
         RETURNING fence, now()",
    );
    let params: [(&(dyn ToSql + Sync), Type); 5] = [
        (&target, Type::TEXT),
        (&token, Type::UUID),
        (&ms(ttl), Type::INT8),
        (&host, Type::TEXT),
        (&pid, Type::INT4),
    ];
    let rows = client
        .query_typed(&sql, &params)
        .await
        .context("cannot acquire the lease")?;
    if let Some(row) = rows.first() {
        return Ok(Acquired::Held(Lease {
            target: target.to_owned(),
            token,
            fence: row.get(0),
            granted_at: row.get(1),
        }));
    }
    Ok(Acquired::Busy(holder(client, schema, target).await?))
}

/// The live holder of `target`, if any.
pub async fn holder(client: &Client, schema: &Schema, target: &str) -> Result<Option<Holder>> {
    let sql = schema.sql(
        "SELECT holder_host, holder_pid, fence, ttl_ms,
                greatest(0, (extract(epoch FROM now() - heartbeat_at) * 1000))::int8 AS age_ms
           FROM {s}.leases
          WHERE target = $1 AND token IS NOT NULL",
    );
    let rows = client
        .query_typed(&sql, &[(&target, Type::TEXT)])
        .await
        .context("cannot read the lease")?;
    Ok(rows.first().map(holder_from_row))
}

/// A holder from a row of (holder_host, holder_pid, fence, ttl_ms, age_ms).
fn holder_from_row(r: &tokio_postgres::Row) -> Holder {
    let ttl_ms: i64 = r.get(3);
    let age_ms: i64 = r.get(4);
    Holder {
        host: r.get(0),
        pid: r.get(1),
        fence: r.get(2),
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
        "UPDATE {s}.leases SET token = NULL, holder_host = NULL, holder_pid = NULL
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
    let sql = schema.sql(
        "WITH old AS (
             SELECT target, holder_host, holder_pid, fence, ttl_ms,
                    greatest(0, (extract(epoch FROM now() - heartbeat_at) * 1000))::int8 AS age_ms
               FROM {s}.leases WHERE target = $1 AND token IS NOT NULL FOR UPDATE
         )
         UPDATE {s}.leases l SET token = NULL, holder_host = NULL, holder_pid = NULL
           FROM old WHERE l.target = old.target
         RETURNING old.holder_host, old.holder_pid, old.fence, old.ttl_ms, old.age_ms, pg_notify($2, l.target)",
    );
    let channel = schema.lease_channel();
    let rows = client
        .query_typed(&sql, &[(&target, Type::TEXT), (&channel, Type::TEXT)])
        .await
        .context("cannot release the lease")?;
    Ok(rows.first().map(holder_from_row))
}

/// How a run ended, as stored in `runs.outcome`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Completed,
    TimedOut,
    Interrupted,
    Lost,
    ExecFailed,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::TimedOut => "timed_out",
            Outcome::Interrupted => "interrupted",
            Outcome::Lost => "lost",
            Outcome::ExecFailed => "exec_failed",
        }
    }

    pub fn parse(s: &str) -> Option<Outcome> {
        Some(match s {
            "completed" => Outcome::Completed,
            "timed_out" => Outcome::TimedOut,
            "interrupted" => Outcome::Interrupted,
            "lost" => Outcome::Lost,
            "exec_failed" => Outcome::ExecFailed,
            _ => return None,
        })
    }
}

/// Everything stored about one run.
#[derive(Debug)]
pub struct RunRecord<'a> {
    pub id: Uuid,
    pub outcome: Outcome,
    /// `None` when the command never started (exec failure).
    pub status: Option<ChildStatus>,
    /// For `exec_failed`: 126 or 127.
    pub exit_code_override: Option<i32>,
    pub argv: Vec<String>,
    pub host: &'a str,
    pub pid: i32,
    /// When the command started and finished, on the database clock ([`DbClock`]): hosts'
    /// clocks never enter the record.
    pub started_at: SystemTime,
    pub finished_at: SystemTime,
    pub stdout: &'a [u8],
    pub stderr: &'a [u8],
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    pub error: Option<String>,
}

/// The result of the fenced save.
#[derive(Debug, PartialEq, Eq)]
pub enum Saved {
    /// Run (and event) stored and lease released, all in one transaction.
    Stored,
    /// The token no longer matched: nothing was stored by this call.
    NotOwner,
}

/// Stores the run, its outbox event (unless `event_type` is `None`) and releases the lease —
/// all in **one statement**, hence one transaction, that first locks the lease row
/// `FOR UPDATE` and re-checks the token:
///
/// * `owner` locks the row only if the token still matches. Between this check and the commit
///   nobody can take the lease over (they block on the row lock), so a holder that was taken
///   over can never write a result or an event: with no `owner` row, every later step selects
///   from an empty set and nothing is written.
/// * `run` inserts the run; `event` builds the outbox payload from the stored row, so its
///   timestamps are exactly the stored ones; `released` frees the lease and wakes waiters
///   (NOTIFY is delivered at commit, after the result is visible).
///
/// One statement instead of BEGIN/SELECT/INSERT/INSERT/UPDATE/COMMIT saves five round trips,
/// most of a short run's cost. It also notifies relays itself and sets
/// `leasectl.outbox_notified`, which the outbox trigger's WHEN clause checks, so this
/// connection need not load PL/pgSQL just to send the same NOTIFY (see migration 0001).
///
/// `retrying` makes the call idempotent after a connection lost mid-commit: if the run id is
/// already stored, the earlier attempt committed.
pub async fn save_fenced(
    client: &Client,
    schema: &Schema,
    lease: &Lease,
    run: &RunRecord<'_>,
    event_type: Option<&str>,
    retrying: bool,
) -> Result<Saved> {
    if retrying {
        let done = client
            .query_typed(
                &schema.sql("SELECT 1 FROM {s}.runs WHERE id = $1"),
                &[(&run.id, Type::UUID)],
            )
            .await?;
        if !done.is_empty() {
            return Ok(Saved::Stored);
        }
    }
    let sql = schema.sql(
        "WITH owner AS (
             SELECT target, set_config('leasectl.outbox_notified', 'on', true)
               FROM {s}.leases WHERE target = $2 AND token = $4 FOR UPDATE
         ), run AS (
             INSERT INTO {s}.runs (id, target, fence, token, outcome, argv, host, pid, started_at,
                                   finished_at, exit_code, signal, stdout, stderr,
                                   stdout_truncated, stderr_truncated, error)
             SELECT $1, owner.target, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17
               FROM owner
             RETURNING target
         ), event AS (
             INSERT INTO {s}.outbox (aggregate_type, aggregate_id, type, payload)
             SELECT 'leasectl.target', run.target, $18, $19 FROM run WHERE $18::text IS NOT NULL
             RETURNING pg_notify($21, '')
         ), released AS (
             UPDATE {s}.leases l SET token = NULL, holder_host = NULL, holder_pid = NULL
               FROM run WHERE l.target = run.target AND l.token = $4
             RETURNING pg_notify($20, l.target)
         )
         SELECT (SELECT count(*) FROM run), (SELECT count(*) FROM event), (SELECT count(*) FROM released)",
    );
    let lease_channel = schema.lease_channel();
    let outbox_channel = schema.outbox_channel();
    let f = RunFields::new(run);
    let payload = event_payload(lease, run, &f);
    let mut params = f.params(lease, run);
    params.extend([
        (&event_type as &(dyn ToSql + Sync), Type::TEXT),
        (&payload, Type::JSONB),
        (&lease_channel, Type::TEXT),
        (&outbox_channel, Type::TEXT),
    ]);
    let row = client.query_typed_one(&sql, &params).await?;
    let stored: i64 = row.get(0);
    Ok(if stored == 1 {
        Saved::Stored
    } else {
        Saved::NotOwner
    })
}

/// The derived column values of a run.
struct RunFields {
    outcome: &'static str,
    exit_code: Option<i32>,
    signal: Option<i32>,
}

impl RunFields {
    fn new(run: &RunRecord<'_>) -> RunFields {
        RunFields {
            outcome: run.outcome.as_str(),
            exit_code: run
                .exit_code_override
                .or_else(|| run.status.and_then(ChildStatus::code)),
            signal: run.status.and_then(ChildStatus::signal),
        }
    }

    /// $1…$17 of both run inserts, in the column order of `runs`.
    fn params<'a>(
        &'a self,
        lease: &'a Lease,
        run: &'a RunRecord<'_>,
    ) -> Vec<(&'a (dyn ToSql + Sync), Type)> {
        vec![
            (&run.id, Type::UUID),
            (&lease.target, Type::TEXT),
            (&lease.fence, Type::INT8),
            (&lease.token, Type::UUID),
            (&self.outcome, Type::TEXT),
            (&run.argv, Type::TEXT_ARRAY),
            (&run.host, Type::TEXT),
            (&run.pid, Type::INT4),
            (&run.started_at, Type::TIMESTAMPTZ),
            (&run.finished_at, Type::TIMESTAMPTZ),
            (&self.exit_code, Type::INT4),
            (&self.signal, Type::INT4),
            (&run.stdout, Type::BYTEA),
            (&run.stderr, Type::BYTEA),
            (&run.stdout_truncated, Type::BOOL),
            (&run.stderr_truncated, Type::BOOL),
            (&run.error, Type::TEXT),
        ]
    }
}

/// The outbox event of a stored run (SPEC: at least run_id, target, fence, exit_code — null
/// when a signal ended the command, with `signal` set — started_at, finished_at, host).
/// Built here rather than in SQL: a fresh server backend would otherwise spend more time
/// looking up the JSON and formatting functions than running the insert.
fn event_payload(lease: &Lease, run: &RunRecord<'_>, f: &RunFields) -> serde_json::Value {
    let duration = run
        .finished_at
        .duration_since(run.started_at)
        .unwrap_or_default();
    serde_json::json!({
        "run_id": run.id.to_string(),
        "target": lease.target,
        "fence": lease.fence,
        "outcome": f.outcome,
        "exit_code": f.exit_code,
        "signal": f.signal,
        "started_at": rfc3339(run.started_at),
        "finished_at": rfc3339(run.finished_at),
        "duration_ms": ms(duration),
        "host": run.host,
        "pid": run.pid,
        "argv": run.argv,
        "stdout_bytes": run.stdout.len(),
        "stdout_truncated": run.stdout_truncated,
        "stderr_bytes": run.stderr.len(),
        "stderr_truncated": run.stderr_truncated,
    })
}

/// RFC 3339 in UTC with microseconds, as the `rfc3339()` SQL function formats it.
pub fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_micros(t).to_string()
}

/// Records a run that lost its lease (outcome `lost`), without any lease check and without an
/// event: the operator keeps its output (a rotated token printed by a fenced-out refresh must
/// not vanish), but nothing downstream hears of it and `--reuse-within` never returns it.
pub async fn record_lost(
    client: &Client,
    schema: &Schema,
    lease: &Lease,
    run: &RunRecord<'_>,
) -> Result<()> {
    let sql = schema.sql(
        "INSERT INTO {s}.runs (id, target, fence, token, outcome, argv, host, pid, started_at, finished_at,
                               exit_code, signal, stdout, stderr, stdout_truncated, stderr_truncated, error)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)
         ON CONFLICT (id) DO NOTHING",
    );
    let mut f = RunFields::new(run);
    f.outcome = Outcome::Lost.as_str();
    let params = f.params(lease, run);
    client
        .execute_typed(&sql, &params)
        .await
        .context("cannot record the lost run")?;
    Ok(())
}

/// A stored run whose stdout another caller may print instead of running.
#[derive(Debug)]
pub struct Reusable {
    pub id: Uuid,
    pub outcome: Outcome,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub stdout: Vec<u8>,
}

/// The newest successful run (exit 0, stdout stored whole) that finished less than `within` ago.
pub async fn reusable(
    client: &Client,
    schema: &Schema,
    target: &str,
    within: Duration,
) -> Result<Option<Reusable>> {
    let sql = schema.sql(
        "SELECT id, outcome, exit_code, signal, stdout FROM {s}.runs
          WHERE target = $1 AND outcome = 'completed' AND exit_code = 0 AND NOT stdout_truncated
            AND finished_at > now() - $2 * interval '1 millisecond'
          ORDER BY finished_at DESC LIMIT 1",
    );
    let rows = client
        .query_typed(&sql, &[(&target, Type::TEXT), (&ms(within), Type::INT8)])
        .await
        .context("cannot look up a reusable run")?;
    Ok(rows.first().map(reusable_from_row))
}

/// The run stored by the acquisition numbered `fence`, if it has finished.
pub async fn run_by_fence(
    client: &Client,
    schema: &Schema,
    target: &str,
    fence: i64,
) -> Result<Option<(Reusable, bool)>> {
    let sql = schema.sql(
        "SELECT id, outcome, exit_code, signal, stdout, stdout_truncated FROM {s}.runs
          WHERE target = $1 AND fence = $2 ORDER BY finished_at DESC LIMIT 1",
    );
    let rows = client
        .query_typed(&sql, &[(&target, Type::TEXT), (&fence, Type::INT8)])
        .await
        .context("cannot look up the awaited run")?;
    Ok(rows
        .first()
        .map(|r| (reusable_from_row(r), r.get::<_, bool>(5))))
}

fn reusable_from_row(r: &tokio_postgres::Row) -> Reusable {
    let outcome: &str = r.get(1);
    Reusable {
        id: r.get(0),
        outcome: Outcome::parse(outcome).unwrap_or(Outcome::Completed),
        exit_code: r.get(2),
        signal: r.get(3),
        stdout: r.get(4),
    }
}
