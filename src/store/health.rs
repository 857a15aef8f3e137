//! The `expectations` and `incidents` tables: what `leasectl expect` sets, the facts the
//! dead-man switch judges ([`watched`], one statement, on the database clock), and the incidents
//! a relay opens and closes — each with its outbox event in the same statement, so that several
//! relays announce every incident exactly once.

use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Client;

use super::{ms, sql};
use crate::db::Schema;
use crate::model::health::{Holder, Kind, LastRun, Watch, RECOVERED};

/// An `expectations` row.
#[derive(Debug, Clone)]
pub struct Expectation {
    pub target: String,
    /// The schedule of the target's latest `run --slot`, and its zone (`None`: UTC).
    pub schedule: Option<String>,
    pub schedule_tz: Option<String>,
    pub every_ms: Option<i64>,
    pub grace_ms: Option<i64>,
    pub max_duration_ms: Option<i64>,
}

const EXPECTATION_COLUMNS: &str =
    "target, schedule, schedule_tz, every_ms, grace_ms, max_duration_ms";

fn expectation(r: &tokio_postgres::Row) -> Expectation {
    Expectation {
        target: r.get("target"),
        schedule: r.get("schedule"),
        schedule_tz: r.get("schedule_tz"),
        every_ms: r.get("every_ms"),
        grace_ms: r.get("grace_ms"),
        max_duration_ms: r.get("max_duration_ms"),
    }
}

/// `expect`: replaces the target's expectation whole (a flag left out is cleared); the schedule
/// `run --slot` stored is kept.
pub async fn set_expectation(
    client: &Client,
    schema: &Schema,
    target: &str,
    every: Option<Duration>,
    grace: Option<Duration>,
    max_duration: Option<Duration>,
) -> Result<Expectation> {
    let sql = sql(
        schema,
        &format!(
            "INSERT INTO {{s}}.expectations AS e (target, every_ms, grace_ms, max_duration_ms)
             VALUES ($1, $2, $3, $4)
             ON CONFLICT (target) DO UPDATE
                SET every_ms = excluded.every_ms, grace_ms = excluded.grace_ms,
                    max_duration_ms = excluded.max_duration_ms, updated_at = now()
             RETURNING {EXPECTATION_COLUMNS}"
        ),
    );
    let (every, grace, max) = (every.map(ms), grace.map(ms), max_duration.map(ms));
    let params: [(&(dyn ToSql + Sync), Type); 4] = [
        (&target, Type::TEXT),
        (&every, Type::INT8),
        (&grace, Type::INT8),
        (&max, Type::INT8),
    ];
    let row = client
        .query_typed_one(&sql, &params)
        .await
        .context("cannot store the expectation")?;
    Ok(expectation(&row))
}

/// `expect --clear`: forgets everything that watches the target — what `expect` set and the
/// schedule its `run --slot` stored — and returns it, if there was a row. The target is no
/// longer watched; a later `run --slot` stores its schedule again, and it watches the target
/// from then on (`schedule_since`: no slot before it is missed).
pub async fn clear_expectation(
    client: &Client,
    schema: &Schema,
    target: &str,
) -> Result<Option<Expectation>> {
    let sql = sql(
        schema,
        &format!(
            "DELETE FROM {{s}}.expectations WHERE target = $1 RETURNING {EXPECTATION_COLUMNS}"
        ),
    );
    let rows = client
        .query_typed(&sql, &[(&target, Type::TEXT)])
        .await
        .context("cannot clear the expectation")?;
    Ok(rows.first().map(expectation))
}

/// The facts about every watched target (or those named), on the database clock. A target is
/// watched when it has a schedule, `--every` or `--max-duration`.
pub async fn watched(
    client: &Client,
    schema: &Schema,
    targets: Option<&[String]>,
) -> Result<Vec<Watch>> {
    let targets: Option<Vec<String>> = targets.map(<[String]>::to_vec);
    let sql = sql(
        schema,
        "SELECT now() AS now, e.target, e.schedule, e.schedule_tz, e.every_ms, e.grace_ms,
                e.max_duration_ms, e.updated_at, e.schedule_since,
                (SELECT max(r.slot) FROM {s}.runs r
                  WHERE r.target = e.target AND r.slot IS NOT NULL
                    AND (r.outcome IN ('completed', 'timed_out')
                         OR r.outcome = 'skipped' AND NOT r.done_by_running)) AS done_slot,
                (SELECT max(r.finished_at) FROM {s}.runs r
                  WHERE r.target = e.target AND r.outcome = 'completed' AND r.exit_code = 0)
                  AS last_success_at,
                lr.id AS run_id, lr.outcome, lr.exit_code, lr.signal, lr.finished_at,
                l.holder_host, l.holder_pid, l.fence, l.acquired_at
           FROM {s}.expectations e
           LEFT JOIN LATERAL (
                SELECT r.id, r.outcome, r.exit_code, r.signal, r.finished_at FROM {s}.runs r
                 WHERE r.target = e.target AND r.outcome NOT IN ('skipped', 'lost')
                 ORDER BY r.finished_at DESC LIMIT 1
           ) lr ON true
           -- The longest-running live holder (of several, with --max-holders).
           LEFT JOIN LATERAL (
                SELECT l.holder_host, l.holder_pid, l.fence, l.acquired_at FROM {s}.leases l
                 WHERE l.target = e.target AND l.token IS NOT NULL AND NOT {expired}
                 ORDER BY l.acquired_at LIMIT 1
           ) l ON true
          WHERE (e.schedule IS NOT NULL OR e.every_ms IS NOT NULL OR e.max_duration_ms IS NOT NULL)
            AND ($1::text[] IS NULL OR e.target = ANY ($1))
          ORDER BY e.target",
    );
    let rows = client
        .query_typed(&sql, &[(&targets, Type::TEXT_ARRAY)])
        .await
        .context("cannot read what is expected of the targets")?;
    Ok(rows
        .iter()
        .map(|r| Watch {
            target: r.get("target"),
            now: r.get("now"),
            schedule: r.get("schedule"),
            schedule_tz: r.get("schedule_tz"),
            every_ms: r.get("every_ms"),
            grace_ms: r.get("grace_ms"),
            max_duration_ms: r.get("max_duration_ms"),
            updated_at: r.get("updated_at"),
            schedule_since: r.get("schedule_since"),
            done_slot: r.get("done_slot"),
            last_success_at: r.get("last_success_at"),
            last_run: r.get::<_, Option<uuid::Uuid>>("run_id").map(|id| LastRun {
                id,
                outcome: r.get("outcome"),
                exit_code: r.get("exit_code"),
                signal: r.get("signal"),
                finished_at: r.get("finished_at"),
            }),
            holder: r
                .get::<_, Option<SystemTime>>("acquired_at")
                .map(|acquired_at| Holder {
                    host: r.get("holder_host"),
                    pid: r.get("holder_pid"),
                    fence: r.get("fence"),
                    acquired_at,
                }),
        })
        .collect())
}

/// Every open incident: target and kind.
pub async fn open_incidents(client: &Client, schema: &Schema) -> Result<Vec<(String, Kind)>> {
    let rows = client
        .query_typed(&sql(schema, "SELECT target, kind FROM {s}.incidents"), &[])
        .await
        .context("cannot read the open incidents")?;
    Ok(rows
        .iter()
        .filter_map(|r| Some((r.get("target"), Kind::parse(r.get("kind"))?)))
        .collect())
}

/// Opens an incident and inserts its event, in one statement: only the caller whose INSERT
/// created the row inserts the event. Returns whether it was this call.
pub async fn open_incident(
    client: &Client,
    schema: &Schema,
    target: &str,
    kind: Kind,
    since: SystemTime,
    detail: &serde_json::Value,
    payload: &serde_json::Value,
) -> Result<bool> {
    let sql = sql(
        schema,
        "WITH opened AS (
             INSERT INTO {s}.incidents (target, kind, opened_at, detail) VALUES ($1, $2, $3, $4)
             ON CONFLICT (target, kind) DO NOTHING
             RETURNING target
         )
         INSERT INTO {s}.outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'leasectl.target', target, $5, $6 FROM opened
         RETURNING id",
    );
    let (kind_str, event_type) = (kind.as_str(), kind.event_type());
    let params: [(&(dyn ToSql + Sync), Type); 6] = [
        (&target, Type::TEXT),
        (&kind_str, Type::TEXT),
        (&since, Type::TIMESTAMPTZ),
        (detail, Type::JSONB),
        (&event_type, Type::TEXT),
        (payload, Type::JSONB),
    ];
    let rows = client
        .query_typed(&sql, &params)
        .await
        .context("cannot open the incident")?;
    Ok(!rows.is_empty())
}

/// Closes an incident and inserts its `recovered` event, in one statement: only the caller whose
/// DELETE removed the row inserts the event. The payload names when the incident began
/// (`since`), when it ended (`recovered_at`, the database's now) and its stored detail.
pub async fn close_incident(
    client: &Client,
    schema: &Schema,
    target: &str,
    kind: Kind,
) -> Result<bool> {
    let sql = sql(
        schema,
        "WITH closed AS (
             DELETE FROM {s}.incidents WHERE target = $1 AND kind = $2
             RETURNING target, kind, opened_at, detail
         )
         INSERT INTO {s}.outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'leasectl.target', target, $3,
                jsonb_build_object('target', target, 'kind', kind,
                                   'since', {s}.rfc3339(opened_at),
                                   'recovered_at', {s}.rfc3339(now()), 'detail', detail)
           FROM closed
         RETURNING id",
    );
    let kind_str = kind.as_str();
    let rows = client
        .query_typed(
            &sql,
            &[
                (&target, Type::TEXT),
                (&kind_str, Type::TEXT),
                (&RECOVERED, Type::TEXT),
            ],
        )
        .await
        .context("cannot close the incident")?;
    Ok(!rows.is_empty())
}

/// What the evaluation's first statement found ([`try_lock_evaluation`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Evaluation {
    /// This transaction holds the schema's health-evaluation lock.
    pub locked: bool,
    /// Some target has an expectation, or some incident is open: there may be something to
    /// evaluate.
    pub watched: bool,
}

/// Takes the schema's health-evaluation lock for the current transaction, if no other relay
/// holds it: one relay evaluates at a time, so a relay with a stale view can never reopen an
/// incident another one has just closed. The same statement tells whether anything is watched
/// at all: with no expectation and no open incident (a schema where nobody ran `expect`) there
/// is nothing to evaluate, and the evaluation's own statement — whose planning in a fresh server
/// process costs more than the rest of a relay's start-up statements together — is not sent.
pub async fn try_lock_evaluation(client: &Client, schema: &Schema) -> Result<Evaluation> {
    let row = client
        .query_typed_one(
            &sql(
                schema,
                "SELECT pg_try_advisory_xact_lock(hashtext('leasectl.health:' || $1::text)) AS got,
                        EXISTS (SELECT 1 FROM {s}.expectations)
                        OR EXISTS (SELECT 1 FROM {s}.incidents) AS watched",
            ),
            &[(&schema.name(), Type::TEXT)],
        )
        .await
        .context("cannot take the health-evaluation lock")?;
    Ok(Evaluation {
        locked: row.get("got"),
        watched: row.get("watched"),
    })
}
