//! Every SQL statement on the outbox: claiming a batch for the relay, putting back what was not
//! delivered, and the operator's list / retry / discard / backlog.
//!
//! # How a batch is claimed, and why per-aggregate order holds across relays
//!
//! An aggregate's *head* is its oldest event (lowest `seq`). Only heads are ever claimed
//! directly; the events behind a head are taken together with it, as a prefix of its chain, in
//! the same statement. [`claim`] is one `DELETE … RETURNING` run inside the relay's transaction:
//!
//! 1. a window of the oldest events (`--batch` × 2) of aggregates that are not *blocked* — whose
//!    events are neither dead nor waiting out a retry (the `outbox_held` partial index makes that
//!    one probe) — so a dead aggregate never holds up the others;
//! 2. the first event of each aggregate in that window, kept only if no older event of the
//!    aggregate exists, and locked `FOR UPDATE SKIP LOCKED`: a head another relay holds is
//!    skipped, and with it its whole aggregate;
//! 3. the window's events of the aggregates whose head was locked, the `--batch` oldest of
//!    them. The window is a `seq`-ordered prefix of the unblocked events, so each aggregate's
//!    events in it run contiguously from its head: each aggregate contributes a prefix of its
//!    chain, head first;
//! 4. those rows are deleted, which locks them until the transaction ends.
//!
//! A second relay cannot take any event of an aggregate this relay is working on: the head is
//! locked, and every later event has an older event (the head) still visible to it until this
//! relay commits — by which time everything it deleted has been published. Rows are deleted
//! *before* publishing but the deletion is committed only *after* the sink confirmed them, so a
//! relay killed mid-batch leaves them all in place (at-least-once). What was not delivered is
//! put back by [`restore`] in the same transaction, with its original `seq` and `id`.
//!
//! The one thing no relay can fix is commit order: an event inserted with a lower `seq` that
//! commits after a higher one of the same aggregate. SPEC makes applications serialise the
//! transactions that write one aggregate, as they would any write to it.

use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use tokio_postgres::types::Type;
use tokio_postgres::{Client, Row, Statement};

use crate::db::Schema;
use crate::lease::rfc3339;
use crate::sink::Event;

/// How many of the oldest events the claim looks at, per event it may return.
const WINDOW_FACTOR: i64 = 2;

/// The claim statement; see the module documentation. `$1` = batch size, `$2` = window size,
/// `$3` = highest `seq` to consider (`--once` stops at what existed when it started).
const CLAIM: &str = "
WITH win AS MATERIALIZED (
    SELECT o.seq, o.aggregate_type, o.aggregate_id
      FROM {s}.outbox o
     WHERE o.seq <= $3
       -- NOT IN over the few blocked aggregates becomes one hashed lookup per row, which keeps
       -- the plan an ordered scan that stops after the window (NOT EXISTS would be planned as
       -- an anti join over the whole table).
       AND (o.aggregate_type, o.aggregate_id) NOT IN (
            SELECT b.aggregate_type, b.aggregate_id FROM {s}.outbox b
             WHERE (b.dead_at IS NOT NULL OR b.next_attempt_at > b.created_at)
               AND (b.dead_at IS NOT NULL OR b.next_attempt_at > now()))
     ORDER BY o.seq
     LIMIT $2
), firsts AS (
    SELECT min(seq) AS seq FROM win GROUP BY aggregate_type, aggregate_id
), heads AS (
    SELECT o.seq, o.aggregate_type, o.aggregate_id
      FROM {s}.outbox o
     WHERE o.seq IN (SELECT seq FROM firsts)
     ORDER BY o.seq
     LIMIT $1
       FOR UPDATE SKIP LOCKED
), claimed AS (
    SELECT w.seq
      FROM win w
      JOIN heads h ON h.aggregate_type = w.aggregate_type AND h.aggregate_id = w.aggregate_id
     ORDER BY w.seq
     LIMIT $1
)
DELETE FROM {s}.outbox o
 USING claimed
 WHERE o.seq = claimed.seq
RETURNING o.seq, o.id, o.aggregate_type, o.aggregate_id, o.type, o.payload::text, o.created_at,
          o.attempts, o.next_attempt_at, o.last_error, o.dead_at,
          o.dead_at IS NOT NULL OR o.next_attempt_at > now()";

/// A claimed event: what the sink gets, plus the bookkeeping needed to put it back unchanged.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub event: Event,
    pub payload: String,
    pub created_at: SystemTime,
    pub attempts: i32,
    pub next_attempt_at: SystemTime,
    pub last_error: Option<String>,
    pub dead_at: Option<SystemTime>,
    /// Dead or not yet due: claimed only because it sits behind a head that is due (possible
    /// only when commit order differed from `seq` order). Never published in this batch.
    pub blocked: bool,
}

impl Claimed {
    fn from_row(r: &Row) -> Claimed {
        let id: uuid::Uuid = r.get(1);
        let aggregate_type: String = r.get(2);
        let aggregate_id: String = r.get(3);
        let event_type: String = r.get(4);
        let payload: String = r.get(5);
        let created_at: SystemTime = r.get(6);
        let json = published_json(
            &id,
            &aggregate_type,
            &aggregate_id,
            &event_type,
            &payload,
            created_at,
        );
        Claimed {
            event: Event {
                seq: r.get(0),
                id,
                aggregate_type,
                aggregate_id,
                event_type,
                json,
            },
            payload,
            created_at,
            attempts: r.get(7),
            next_attempt_at: r.get(8),
            last_error: r.get(9),
            dead_at: r.get(10),
            blocked: r.get(11),
        }
    }
}

/// SPEC's published form: `{"id","aggregate_type","aggregate_id","type","payload","created_at"}`
/// on one line. `payload` is PostgreSQL's own jsonb text, spliced in as it is (valid JSON, never
/// a raw newline), which spares a parse and re-serialisation per event.
pub fn published_json(
    id: &uuid::Uuid,
    aggregate_type: &str,
    aggregate_id: &str,
    event_type: &str,
    payload: &str,
    created_at: SystemTime,
) -> String {
    let string = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
    let mut out = String::with_capacity(payload.len() + 160);
    out.push_str("{\"id\":\"");
    out.push_str(&id.hyphenated().to_string());
    out.push_str("\",\"aggregate_type\":");
    out.push_str(&string(aggregate_type));
    out.push_str(",\"aggregate_id\":");
    out.push_str(&string(aggregate_id));
    out.push_str(",\"type\":");
    out.push_str(&string(event_type));
    out.push_str(",\"payload\":");
    out.push_str(payload);
    out.push_str(",\"created_at\":\"");
    out.push_str(&rfc3339(created_at));
    out.push_str("\"}");
    out
}

/// The relay's prepared statements on one connection.
pub struct Statements {
    claim: Statement,
}

impl Statements {
    pub async fn prepare(client: &Client, schema: &Schema) -> Result<Statements> {
        let claim = client
            .prepare_typed(&schema.sql(CLAIM), &[Type::INT8, Type::INT8, Type::INT8])
            .await
            .context("cannot prepare the claim statement")?;
        Ok(Statements { claim })
    }
}

/// Claims up to `batch` events in the transaction that `client` has open, sorted by `seq`.
pub async fn claim(
    client: &Client,
    stmts: &Statements,
    batch: i64,
    up_to_seq: i64,
) -> Result<Vec<Claimed>, tokio_postgres::Error> {
    let window = batch.saturating_mul(WINDOW_FACTOR);
    let rows = client
        .query(&stmts.claim, &[&batch, &window, &up_to_seq])
        .await?;
    let mut claimed: Vec<Claimed> = rows.iter().map(Claimed::from_row).collect();
    claimed.sort_unstable_by_key(|c| c.event.seq);
    Ok(claimed)
}

/// What happened to one claimed event, decided by the relay.
#[derive(Debug, Clone)]
pub enum Settle {
    /// Confirmed by the sink: stays deleted.
    Delivered,
    /// Not attempted (or the sink was unreachable): put back exactly as it was.
    Untouched,
    /// Refused by the sink: put back with one more attempt, the error, and either the time of
    /// the next attempt (`retry_in`) or, with `dead`, marked dead.
    Failed {
        error: String,
        retry_in: Duration,
        dead: bool,
    },
}

/// Puts back every claimed event that was not delivered, inside the claim's transaction, with
/// its original `seq`, `id` and `created_at`. Returns how many were put back.
pub async fn restore(
    client: &Client,
    schema: &Schema,
    claimed: &[Claimed],
    settled: &[Settle],
) -> Result<u64, tokio_postgres::Error> {
    let mut seq = Vec::new();
    let mut id = Vec::new();
    let mut aggregate_type = Vec::new();
    let mut aggregate_id = Vec::new();
    let mut event_type = Vec::new();
    let mut payload = Vec::new();
    let mut created_at = Vec::new();
    let mut attempts = Vec::new();
    let mut next_attempt_at = Vec::new();
    let mut retry_in_ms: Vec<Option<i64>> = Vec::new();
    let mut last_error = Vec::new();
    let mut dead_at = Vec::new();
    let mut die = Vec::new();
    for (c, s) in claimed.iter().zip(settled) {
        let (tries, error, retry, dies) = match s {
            Settle::Delivered => continue,
            Settle::Untouched => (c.attempts, c.last_error.clone(), None, false),
            Settle::Failed {
                error,
                retry_in,
                dead,
            } => (
                c.attempts.saturating_add(1),
                Some(error.clone()),
                Some(i64::try_from(retry_in.as_millis()).unwrap_or(i64::MAX)),
                *dead,
            ),
        };
        seq.push(c.event.seq);
        id.push(c.event.id);
        aggregate_type.push(c.event.aggregate_type.as_str());
        aggregate_id.push(c.event.aggregate_id.as_str());
        event_type.push(c.event.event_type.as_str());
        payload.push(c.payload.as_str());
        created_at.push(c.created_at);
        attempts.push(tries);
        next_attempt_at.push(c.next_attempt_at);
        retry_in_ms.push(retry);
        last_error.push(error);
        dead_at.push(c.dead_at);
        die.push(dies);
    }
    if seq.is_empty() {
        return Ok(0);
    }
    // Restored events were already announced; skip the NOTIFY trigger for them.
    client
        .batch_execute("SET LOCAL leasectl.outbox_notified = 'on'")
        .await?;
    let sql = schema.sql(
        "INSERT INTO {s}.outbox (seq, id, aggregate_type, aggregate_id, type, payload, created_at,
                                 attempts, next_attempt_at, last_error, dead_at)
         OVERRIDING SYSTEM VALUE
         SELECT seq, id, aggregate_type, aggregate_id, type, payload::jsonb, created_at, attempts,
                CASE WHEN retry_in_ms IS NULL THEN next_attempt_at
                     ELSE now() + retry_in_ms * interval '1 millisecond' END,
                last_error,
                CASE WHEN die THEN now() ELSE dead_at END
           FROM unnest($1::int8[], $2::uuid[], $3::text[], $4::text[], $5::text[], $6::text[],
                       $7::timestamptz[], $8::int4[], $9::timestamptz[], $10::int8[], $11::text[],
                       $12::timestamptz[], $13::bool[])
             AS r(seq, id, aggregate_type, aggregate_id, type, payload, created_at, attempts,
                  next_attempt_at, retry_in_ms, last_error, dead_at, die)",
    );
    client
        .execute(
            &sql,
            &[
                &seq,
                &id,
                &aggregate_type,
                &aggregate_id,
                &event_type,
                &payload,
                &created_at,
                &attempts,
                &next_attempt_at,
                &retry_in_ms,
                &last_error,
                &dead_at,
                &die,
            ],
        )
        .await
}

/// The highest `seq` now in the outbox (0 when empty): where `--once` stops.
pub async fn max_seq(client: &Client, schema: &Schema) -> Result<i64> {
    let row = client
        .query_one(
            &schema.sql("SELECT coalesce(max(seq), 0) FROM {s}.outbox"),
            &[],
        )
        .await
        .context("cannot read the outbox")?;
    Ok(row.get(0))
}

/// When the earliest retry falls due, if any event is waiting out a backoff.
pub async fn next_retry_in(client: &Client, schema: &Schema) -> Result<Option<Duration>> {
    let row = client
        .query_one(
            &schema.sql(
                "SELECT round(extract(epoch FROM min(next_attempt_at) - now()) * 1000)::int8
                   FROM {s}.outbox
                  WHERE dead_at IS NULL AND next_attempt_at > created_at
                    AND next_attempt_at > now()",
            ),
            &[],
        )
        .await
        .context("cannot read the outbox")?;
    Ok(row
        .get::<_, Option<i64>>(0)
        .map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0))))
}

/// The backlog `status` and the relay's progress line show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backlog {
    /// Not yet delivered and not dead (includes events waiting out a retry).
    pub pending: i64,
    /// Of those, waiting out a retry after a failed attempt.
    pub retrying: i64,
    pub dead: i64,
    /// Age of the oldest pending event.
    pub oldest_pending_ms: Option<i64>,
}

pub async fn backlog(client: &Client, schema: &Schema) -> Result<Backlog> {
    let row = client
        .query_one(
            &schema.sql(
                "SELECT count(*) FILTER (WHERE dead_at IS NULL),
                        count(*) FILTER (WHERE dead_at IS NULL AND attempts > 0),
                        count(*) FILTER (WHERE dead_at IS NOT NULL),
                        round(extract(epoch FROM now() - min(created_at) FILTER (WHERE dead_at IS NULL)) * 1000)::int8
                   FROM {s}.outbox",
            ),
            &[],
        )
        .await
        .context("cannot read the outbox backlog")?;
    Ok(Backlog {
        pending: row.get(0),
        retrying: row.get(1),
        dead: row.get(2),
        oldest_pending_ms: row.get(3),
    })
}

/// One row of `outbox list`.
#[derive(Debug, Clone)]
pub struct Listed {
    pub seq: i64,
    pub id: uuid::Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub payload: serde_json::Value,
    pub created_at: SystemTime,
    pub attempts: i32,
    pub next_attempt_at: SystemTime,
    pub last_error: Option<String>,
    pub dead_at: Option<SystemTime>,
    /// `pending`, `retrying` (waiting out a backoff), `scheduled` (inserted with a future
    /// `next_attempt_at`), `blocked` (behind a dead or not yet due event) or `dead`.
    pub state: &'static str,
}

/// Undelivered events in `seq` order (only dead ones with `dead_only`), at most `limit`, and
/// how many matched in all.
pub async fn list(
    client: &Client,
    schema: &Schema,
    dead_only: bool,
    limit: i64,
) -> Result<(Vec<Listed>, i64)> {
    let sql = schema.sql(
        "SELECT o.seq, o.id, o.aggregate_type, o.aggregate_id, o.type, o.payload, o.created_at,
                o.attempts, o.next_attempt_at, o.last_error, o.dead_at,
                EXISTS (SELECT 1 FROM {s}.outbox b
                         WHERE (b.dead_at IS NOT NULL OR b.next_attempt_at > b.created_at)
                           AND b.seq < o.seq
                           AND b.aggregate_type = o.aggregate_type
                           AND b.aggregate_id = o.aggregate_id
                           AND (b.dead_at IS NOT NULL OR b.next_attempt_at > now())),
                count(*) OVER (),
                o.next_attempt_at > now()
           FROM {s}.outbox o
          WHERE NOT $1 OR o.dead_at IS NOT NULL
          ORDER BY o.seq
          LIMIT $2",
    );
    let rows = client
        .query_typed(&sql, &[(&dead_only, Type::BOOL), (&limit, Type::INT8)])
        .await
        .context("cannot read the outbox")?;
    let total = rows.first().map_or(0, |r| r.get::<_, i64>(12));
    let listed = rows
        .iter()
        .map(|r| {
            let attempts: i32 = r.get(7);
            let dead_at: Option<SystemTime> = r.get(10);
            let blocked: bool = r.get(11);
            let state = if dead_at.is_some() {
                "dead"
            } else if blocked {
                "blocked"
            } else if attempts > 0 {
                "retrying"
            } else if r.get::<_, bool>(13) {
                "scheduled"
            } else {
                "pending"
            };
            Listed {
                seq: r.get(0),
                id: r.get(1),
                aggregate_type: r.get(2),
                aggregate_id: r.get(3),
                event_type: r.get(4),
                payload: r.get(5),
                created_at: r.get(6),
                attempts,
                next_attempt_at: r.get(8),
                last_error: r.get(9),
                dead_at,
                state,
            }
        })
        .collect();
    Ok((listed, total))
}

/// Which events `outbox retry` re-queues.
#[derive(Debug, Clone, Copy)]
pub enum RetryWhich {
    One(uuid::Uuid),
    AllDead,
}

/// Makes events due now with a fresh attempt budget (dead ones come back to life), wakes the
/// relays, and returns how many were re-queued.
pub async fn retry(client: &Client, schema: &Schema, which: RetryWhich) -> Result<u64> {
    let (filter, id) = match which {
        RetryWhich::One(id) => ("id = $1", Some(id)),
        RetryWhich::AllDead => ("dead_at IS NOT NULL AND $1::uuid IS NULL", None),
    };
    let sql = schema.sql(&format!(
        "WITH requeued AS (
             UPDATE {{s}}.outbox SET attempts = 0, next_attempt_at = now(), dead_at = NULL
              WHERE {filter}
             RETURNING 1)
         SELECT count(*), pg_notify($2, '') FROM requeued"
    ));
    let row = client
        .query_one(&sql, &[&id, &schema.outbox_channel()])
        .await
        .context("cannot re-queue the events")?;
    Ok(u64::try_from(row.get::<_, i64>(0)).unwrap_or(0))
}

/// A discarded event, in its published form, and whether it was dead.
pub struct Discarded {
    pub json: String,
    pub dead: bool,
    pub attempts: i32,
}

/// Deletes one event. Unless `any_state`, only a dead one: discarding a live event would skip
/// it silently. Returns `Err` naming the reason when nothing was discarded.
pub async fn discard(
    client: &Client,
    schema: &Schema,
    id: uuid::Uuid,
    any_state: bool,
) -> Result<Result<Discarded, String>> {
    let sql = schema.sql(
        "DELETE FROM {s}.outbox
          WHERE id = $1 AND ($2 OR dead_at IS NOT NULL)
         RETURNING id, aggregate_type, aggregate_id, type, payload::text, created_at,
                   dead_at IS NOT NULL, attempts",
    );
    let rows = client
        .query(&sql, &[&id, &any_state])
        .await
        .context("cannot discard the event")?;
    if let Some(r) = rows.first() {
        let json = published_json(&r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5));
        return Ok(Ok(Discarded {
            json,
            dead: r.get(6),
            attempts: r.get(7),
        }));
    }
    let exists = client
        .query_opt(
            &schema.sql("SELECT 1 FROM {s}.outbox WHERE id = $1"),
            &[&id],
        )
        .await
        .context("cannot read the outbox")?;
    Ok(Err(match exists {
        Some(_) => format!(
            "event {id} is not dead; discarding it would skip it silently (use --force to discard it anyway)"
        ),
        None => format!("no event {id} in the outbox (already delivered or discarded?)"),
    }))
}

/// Deletes runs that finished more than `older_than` ago, except each target's newest run (so
/// `status` keeps showing it), in chunks so no lock is held for long. With `dry_run`, only
/// counts. Returns the number of runs.
pub async fn prune_runs(
    client: &Client,
    schema: &Schema,
    older_than: Duration,
    dry_run: bool,
) -> Result<u64> {
    let ms = i64::try_from(older_than.as_millis()).unwrap_or(i64::MAX);
    let candidates = "SELECT r.id FROM {s}.runs r
                       WHERE r.finished_at < now() - $1::int8 * interval '1 millisecond'
                         AND EXISTS (SELECT 1 FROM {s}.runs n
                                      WHERE n.target = r.target AND n.finished_at > r.finished_at)";
    if dry_run {
        let row = client
            .query_one(
                &schema.sql(&format!("SELECT count(*) FROM ({candidates}) c")),
                &[&ms],
            )
            .await
            .context("cannot count old runs")?;
        return Ok(u64::try_from(row.get::<_, i64>(0)).unwrap_or(0));
    }
    let delete = schema.sql(&format!(
        "DELETE FROM {{s}}.runs WHERE id IN ({candidates} LIMIT 5000)"
    ));
    let mut total = 0;
    loop {
        let n = client
            .execute(&delete, &[&ms])
            .await
            .context("cannot delete old runs")?;
        total += n;
        if n == 0 {
            return Ok(total);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_json_is_one_valid_line_with_spec_keys() {
        let id = uuid::Uuid::nil();
        let t = SystemTime::UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456);
        let s = published_json(
            &id,
            "order",
            "4\"2\n",
            "order.paid",
            r#"{"total": 1500}"#,
            t,
        );
        assert!(!s.contains('\n'));
        let v: serde_json::Value = serde_json::from_str(&s).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "id",
                "aggregate_type",
                "aggregate_id",
                "type",
                "payload",
                "created_at"
            ]
        );
        assert_eq!(v["aggregate_id"], "4\"2\n");
        assert_eq!(v["payload"]["total"], 1500);
        assert_eq!(v["created_at"], "2023-11-14T22:13:20.123456Z");
        assert_eq!(v["id"], "00000000-0000-0000-0000-000000000000");
    }
}
