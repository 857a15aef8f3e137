//! The outbox outside a batch: what it holds (the [`Backlog`] `status` and the relay's progress
//! line show, when the next retry falls due), its upkeep ([`vacuum`]), and the operator's
//! `outbox list` / `retry` / `discard`.

use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use tokio_postgres::types::Type;
use tokio_postgres::Client;

use super::wire::Published;
use crate::db::Schema;
use crate::store::sql;

/// Vacuums the outbox so it and its indexes stay small after heavy draining. Returns `false`,
/// without vacuuming, when the role may not: VACUUM needs the table's (or the database's)
/// owner, or from PostgreSQL 17 the MAINTAIN privilege, and without it only warns and skips the
/// table — a warning the relay would never see.
///
/// Without parallel workers (`PARALLEL 0`): the outbox has five indexes, and once they pass
/// `min_parallel_index_scan_size` (512 kB, about 20,000 events) PostgreSQL starts two worker
/// processes to vacuum them. For indexes this small, starting and coordinating the workers cost
/// more than they share out — 18–21 ms against 10.6 ms for the same VACUUM alone after 20,000
/// deliveries — and their CPU time is taken from the relay's claims, which run beside the VACUUM.
pub async fn vacuum(client: &Client, schema: &Schema) -> Result<bool, tokio_postgres::Error> {
    let may = client
        .query_typed_one(
            &sql(
                schema,
                "SELECT pg_has_role(c.relowner, 'USAGE') OR pg_has_role(d.datdba, 'USAGE')
                        OR CASE WHEN current_setting('server_version_num')::int >= 170000
                                THEN has_table_privilege(c.oid, 'MAINTAIN') ELSE false END
                   FROM pg_class c, pg_database d
                  WHERE c.oid = '{s}.outbox'::regclass AND d.datname = current_database()",
            ),
            &[],
        )
        .await?
        .try_get(0)?;
    if may {
        client
            .batch_execute(&sql(schema, "VACUUM (SKIP_LOCKED, PARALLEL 0) {s}.outbox"))
            .await?;
    }
    Ok(may)
}

/// When the earliest retry falls due, if any event is waiting out a backoff.
pub async fn next_retry_in(client: &Client, schema: &Schema) -> Result<Option<Duration>> {
    let row = client
        .query_typed_one(
            &sql(
                schema,
                "SELECT round(extract(epoch FROM min(next_attempt_at) - now()) * 1000)::int8 AS ms
                   FROM {s}.outbox
                  WHERE {held} AND {held_now} AND dead_at IS NULL",
            ),
            &[],
        )
        .await
        .context("cannot read the outbox")?;
    Ok(row
        .get::<_, Option<i64>>("ms")
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
        .query_typed_one(
            &sql(
                schema,
                "SELECT count(*) FILTER (WHERE dead_at IS NULL) AS pending,
                        count(*) FILTER (WHERE dead_at IS NULL AND attempts > 0) AS retrying,
                        count(*) FILTER (WHERE dead_at IS NOT NULL) AS dead,
                        round(extract(epoch FROM now() - min(created_at) FILTER (WHERE dead_at IS NULL)) * 1000)::int8
                          AS oldest_pending_ms
                   FROM {s}.outbox",
            ),
            &[],
        )
        .await
        .context("cannot read the outbox backlog")?;
    Ok(Backlog {
        pending: row.get("pending"),
        retrying: row.get("retrying"),
        dead: row.get("dead"),
        oldest_pending_ms: row.get("oldest_pending_ms"),
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
    let sql = sql(
        schema,
        "SELECT o.seq, o.id, o.aggregate_type, o.aggregate_id, o.type, o.payload, o.created_at,
                o.attempts, o.next_attempt_at, o.last_error, o.dead_at,
                EXISTS (SELECT 1 FROM {s}.outbox b
                         WHERE {held}
                           AND {agg_key:b} = {agg_key:o}
                           AND b.seq < o.seq
                           AND b.aggregate_type = o.aggregate_type
                           AND b.aggregate_id = o.aggregate_id
                           AND {held_now}) AS blocked,
                count(*) OVER () AS total,
                o.next_attempt_at > now() AS scheduled
           FROM {s}.outbox o
          WHERE NOT $1 OR o.dead_at IS NOT NULL
          ORDER BY o.seq
          LIMIT $2",
    );
    let rows = client
        .query_typed(&sql, &[(&dead_only, Type::BOOL), (&limit, Type::INT8)])
        .await
        .context("cannot read the outbox")?;
    let total = rows.first().map_or(0, |r| r.get::<_, i64>("total"));
    let listed = rows
        .iter()
        .map(|r| {
            let attempts: i32 = r.get("attempts");
            let dead_at: Option<SystemTime> = r.get("dead_at");
            let blocked: bool = r.get("blocked");
            let state = if dead_at.is_some() {
                "dead"
            } else if blocked {
                "blocked"
            } else if attempts > 0 {
                "retrying"
            } else if r.get::<_, bool>("scheduled") {
                "scheduled"
            } else {
                "pending"
            };
            Listed {
                seq: r.get("seq"),
                id: r.get("id"),
                aggregate_type: r.get("aggregate_type"),
                aggregate_id: r.get("aggregate_id"),
                event_type: r.get("type"),
                payload: r.get("payload"),
                created_at: r.get("created_at"),
                attempts,
                next_attempt_at: r.get("next_attempt_at"),
                last_error: r.get("last_error"),
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
    let sql = sql(
        schema,
        &format!(
            "WITH requeued AS (
             UPDATE {{s}}.outbox SET attempts = 0, next_attempt_at = now(), dead_at = NULL
              WHERE {filter}
             RETURNING 1)
         SELECT count(*) AS n, pg_notify($2, '') FROM requeued"
        ),
    );
    let row = client
        .query_typed_one(
            &sql,
            &[(&id, Type::UUID), (&schema.outbox_channel(), Type::TEXT)],
        )
        .await
        .context("cannot re-queue the events")?;
    Ok(u64::try_from(row.get::<_, i64>("n")).unwrap_or(0))
}

/// True when a relay's batch holds the event right now (it is being delivered: its row is
/// locked by the batch's transaction), so that `outbox retry` can say so before waiting for it.
pub async fn in_a_batch(client: &Client, schema: &Schema, id: uuid::Uuid) -> Result<bool> {
    let probe = client
        .query_typed(
            &sql(
                schema,
                "SELECT 1 FROM {s}.outbox WHERE id = $1 FOR UPDATE NOWAIT",
            ),
            &[(&id, Type::UUID)],
        )
        .await;
    match probe {
        Ok(_) => Ok(false),
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) => {
            Ok(true)
        }
        Err(e) => Err(e).context("cannot read the outbox"),
    }
}

/// Whether the outbox still holds event `id`, in whatever state.
async fn exists(client: &Client, schema: &Schema, id: uuid::Uuid) -> Result<bool> {
    let row = client
        .query_typed_opt(
            &sql(schema, "SELECT 1 FROM {s}.outbox WHERE id = $1"),
            &[(&id, Type::UUID)],
        )
        .await
        .context("cannot read the outbox")?;
    Ok(row.is_some())
}

/// [`retry`] of one event, also when a relay's batch holds it: the UPDATE then waits for the
/// batch, and if the batch put the event back (refused, or not reached) the row it waited for
/// is gone and the put-back one is new to the statement's snapshot — so it is looked up again,
/// a few times, rather than reporting "no event" for an event that is still there, retrying.
/// Returns whether it was re-queued; `false` means it is gone (delivered or
/// discarded).
pub async fn retry_one(client: &Client, schema: &Schema, id: uuid::Uuid) -> Result<bool> {
    for _ in 0..5 {
        if retry(client, schema, RetryWhich::One(id)).await? > 0 {
            return Ok(true);
        }
        if !exists(client, schema, id).await? {
            return Ok(false);
        }
    }
    Ok(false)
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
    let delete = sql(
        schema,
        "DELETE FROM {s}.outbox
          WHERE id = $1 AND ($2 OR dead_at IS NOT NULL)
         RETURNING id, aggregate_type, aggregate_id, type, payload::text AS payload, created_at,
                   dead_at IS NOT NULL AS dead, attempts",
    );
    let rows = client
        .query_typed(&delete, &[(&id, Type::UUID), (&any_state, Type::BOOL)])
        .await
        .context("cannot discard the event")?;
    if let Some(r) = rows.first() {
        let id = r.get("id");
        let json = Published {
            id: &id,
            aggregate_type: r.get("aggregate_type"),
            aggregate_id: r.get("aggregate_id"),
            event_type: r.get("type"),
            payload: r.get("payload"),
            created_at: r.get("created_at"),
        }
        .json();
        return Ok(Ok(Discarded {
            json,
            dead: r.get("dead"),
            attempts: r.get("attempts"),
        }));
    }
    Ok(Err(match exists(client, schema, id).await? {
        true => format!(
            "event {id} is not dead; discarding it would skip it silently (use --force to discard it anyway)"
        ),
        false => format!("no event {id} in the outbox (already delivered or discarded?)"),
    }))
}
