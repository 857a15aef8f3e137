//! The `runs` table: the fenced save of a finished run (with its outbox event), the record of a
//! run that lost its lease, the look-ups `--reuse-within` and `--wait` make, and what the
//! operator commands `runs`, `output` and `prune` read or delete.

use std::future::Future;
use std::pin::Pin;
use std::sync::OnceLock;
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use futures_util::FutureExt;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row, Statement};
use uuid::Uuid;

use super::leases::Lease;
use super::{ms, sql};
use crate::db::Schema;
use crate::exit::ChildStatus;
use crate::fmt::rfc3339;
use crate::model::slot::Slot;

/// The columns of a run row, in the order of [`RunFields::params`]' `$1…$21` and then
/// `done_by`: written once for every insert (the fenced save, the `lost` record, the skip).
const INSERT_RUN: &str =
    "INSERT INTO {s}.runs (id, target, fence, token, outcome, argv, host, pid, started_at,
                           finished_at, exit_code, signal, stdout, stderr, stdout_truncated,
                           stderr_truncated, error, events, slot, slot_end, label, done_by)";
/// `$1…$21`; `done_by` follows (NULL but for a skip).
const RUN_VALUES: &str = "$1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, \
                          $17, $18, $19, $20, $21";

/// How a run ended, as stored in `runs.outcome`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Completed,
    TimedOut,
    Interrupted,
    Lost,
    ExecFailed,
    /// `run --slot` found its slot already done, or being done by the lease's holder, and did
    /// not run (see [`skip_if_done`], [`skip_without_lease`]).
    Skipped,
    /// A `--replace` took the lease; the command was stopped (see [`record_lost`]).
    Preempted,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::TimedOut => "timed_out",
            Outcome::Interrupted => "interrupted",
            Outcome::Lost => "lost",
            Outcome::ExecFailed => "exec_failed",
            Outcome::Skipped => "skipped",
            Outcome::Preempted => "preempted",
        }
    }

    pub fn parse(s: &str) -> Option<Outcome> {
        Some(match s {
            "completed" => Outcome::Completed,
            "timed_out" => Outcome::TimedOut,
            "interrupted" => Outcome::Interrupted,
            "lost" => Outcome::Lost,
            "exec_failed" => Outcome::ExecFailed,
            "skipped" => Outcome::Skipped,
            "preempted" => Outcome::Preempted,
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
    /// When the command started and finished, on the database clock ([`DbClock`](super::leases::DbClock)): hosts'
    /// clocks never enter the record.
    pub started_at: SystemTime,
    pub finished_at: SystemTime,
    pub stdout: &'a [u8],
    pub stderr: &'a [u8],
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    pub error: Option<String>,
    /// The command's `LEASECTL_EVENTS` lines as written (at most `--events-limit`), kept in
    /// the row — the operator's copy when they were not stored as events (a `lost` run, or
    /// refused lines).
    pub events_kept: Option<&'a [u8]>,
    /// The command's events to insert after the run's own, as a JSON array of
    /// `{aggregate_type, aggregate_id, type, payload}` (see `run::events`).
    pub job_events: Option<&'a serde_json::Value>,
    /// `run --slot`: the slot the run belongs to.
    pub slot: Option<Slot>,
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
/// * `run` inserts the run; `event` inserts the run's outbox event and then the command's own
///   events (`LEASECTL_EVENTS`), in that order, in one INSERT so that `seq` follows it;
///   `released` frees the lease and wakes waiters (NOTIFY is delivered at commit, after the
///   result is visible) — or, for a step's lease ([`Lease::keep`]), renews it and marks it
///   idle, which wakes a step waiting to take it up. A step's lease must not have expired:
///   renewing it then would revive a lease its holder already counted as lost.
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
    planned: Option<&Planned>,
) -> Result<Saved> {
    let stored_already = || async {
        let done = client
            .query_typed(
                &sql(schema, "SELECT 1 FROM {s}.runs WHERE id = $1"),
                &[(&run.id, Type::UUID)],
            )
            .await?;
        Ok::<bool, anyhow::Error>(!done.is_empty())
    };
    if retrying && stored_already().await? {
        return Ok(Saved::Stored);
    }
    let lease_channel = schema.lease_channel();
    let outbox_channel = schema.outbox_channel();
    let f = RunFields::new(run);
    let payload = event_payload(lease, run, &f);
    let mut params = f.params(lease, run);
    let save: [&(dyn ToSql + Sync); 6] = [
        &event_type,
        &payload,
        &lease_channel,
        &outbox_channel,
        &run.job_events,
        &lease.keep,
    ];
    params.extend(save.into_iter().zip(SAVE_TYPES));
    let shape = Shape::of(lease.keep, run.job_events);
    let ahead = match (planned, run.job_events) {
        // The command wrote events of its own, and the plain save was planned: the plan stores
        // the run and releases the lease, the events follow in the same transaction.
        (Some(p), Some(events)) if shape == Shape::Full && p.shape == Shape::Plain => {
            let then = (run.id, events, outbox_channel.as_str());
            save_then_events(client, schema, &p.statement, &params, then).await
        }
        _ => execute_planned(client, planned, shape, &params).await,
    };
    let rows = match ahead {
        Some(rows) => rows?,
        None => {
            client
                .query_typed(&save_sql(schema, shape), &params)
                .await?
        }
    };
    if !rows.is_empty() {
        return Ok(Saved::Stored);
    }
    // An earlier attempt whose answer was lost may have committed while this one ran: it then
    // holds the lease row's lock, and this statement, after waiting for it, finds the lease
    // released — by that very save. Its run, committed now, is what a fresh look shows.
    if retrying && stored_already().await? {
        return Ok(Saved::Stored);
    }
    Ok(Saved::NotOwner)
}

/// The fenced save, prepared while the command starts ([`plan_save_ahead`]); nothing on a
/// session that may be pooled.
pub struct SaveAhead<'a>(Option<Preparing<'a>>);

struct Preparing<'a> {
    client: &'a Client,
    shape: Shape,
    prepared: Pin<Box<dyn Future<Output = Result<Statement, tokio_postgres::Error>> + 'a>>,
}

/// The fenced save prepared and planned ahead, and which of its texts it is.
pub struct Planned {
    statement: Statement,
    shape: Shape,
}

/// Prepares the fenced save (a named statement) and sends the settings its plan ahead needs,
/// without waiting for the answers; [`SaveAhead::finish`] then plans it while the command
/// runs. In a fresh server process, parsing and planning the save — its three tables, their
/// ten indexes, the functions it calls — is most of its cost; done ahead, the save after the
/// command's exit only binds the plan and executes it.
///
/// `plan_cache_mode = force_generic_plan` (for the session, until the save resets it) keeps
/// the plan made ahead for the save: otherwise the server plans each of a statement's first
/// five executions anew with their values. The other statements of a run (the heartbeat's,
/// the release) look rows up by their keys, which a generic plan does as well as any.
///
/// Preparing and planning lock the tables the save names, and the heartbeats go out after
/// them on the same connection: a lock held elsewhere on the outbox or the runs (an
/// application's migration, a `VACUUM FULL`, a `LOCK TABLE`) would hold them up until the
/// lease expired and the command was stopped, where without the plan only the save waits for
/// it. So both wait for a lock 10 ms at most and are given up otherwise (the save then sends
/// its statement itself), and the session's own `lock_timeout` is restored right after them.
///
/// The text planned is the full one for a step's lease (`keep`, [`Lease::keep`]) and the plain
/// one otherwise ([`Shape`]): whether the command writes events of its own is known only once
/// it is over. A released run whose command wrote some executes the plain plan and inserts its
/// events after it in the same transaction (`save_then_events`).
///
/// Only for a `direct` session: behind a transaction-mode pooler the save may run in another
/// server process, so nothing is sent there.
pub async fn plan_save_ahead<'a>(
    client: &'a Client,
    schema: &Schema,
    keep: bool,
    direct: bool,
) -> SaveAhead<'a> {
    if !direct {
        return SaveAhead(None);
    }
    let settings = client.batch_execute(PLAN_AHEAD);
    let shape = Shape::of(keep, None);
    let sql = save_sql(schema, shape);
    let mut prepared: Pin<Box<dyn Future<Output = _> + 'a>> = Box::pin(async move {
        let types: Vec<Type> = RUN_TYPES.into_iter().chain(SAVE_TYPES).collect();
        // Named, so it must never reach a pooler: only a direct session plans ahead.
        #[allow(clippy::disallowed_methods)]
        client.prepare_typed(&sql, &types).await
    });
    // One poll each queues the requests on the connection, in this order; the yield lets the
    // connection's task write them before leasectl starts the command, so that the server
    // parses meanwhile.
    let _ = std::pin::pin!(settings).now_or_never();
    let _ = prepared.as_mut().now_or_never();
    tokio::task::yield_now().await;
    SaveAhead(Some(Preparing {
        client,
        shape,
        prepared,
    }))
}

/// What [`plan_save_ahead`] sends first: a lock waited for 10 ms at most, and the plan made
/// ahead kept for the save.
const PLAN_AHEAD: &str = "SET lock_timeout = '10ms'; SET plan_cache_mode = force_generic_plan";

/// Sent before the save is planned by executing it ([`SaveAhead::finish`]): the outbox trigger
/// is told, as the save itself tells it, that nobody need be notified — that execution inserts
/// nothing. (The trigger fires once per `INSERT` statement, whatever its rows.)
const QUIET: &str = "SET leasectl.outbox_notified = 'on'";

/// Undoes [`PLAN_AHEAD`] but for the plan cache mode, which the save needs, and [`QUIET`].
const PLANNED: &str = "RESET lock_timeout; RESET leasectl.outbox_notified";

impl<'a> SaveAhead<'a> {
    /// Once the command has started: waits up to `within` for the prepared statement (the
    /// heartbeats and signals wait meanwhile; a server slower than that leaves the save to send
    /// its statement itself). Then, if `running()` still says so, plans it by executing it once
    /// with every parameter NULL — which locks no lease row and stores nothing (each of the
    /// save's steps follows from the lease row its token names) — without waiting for that
    /// answer. A command that is over already is saved at once; the save's own execution then
    /// makes the plan, one round trip sooner.
    pub async fn finish(self, within: Duration, running: impl FnOnce() -> bool) -> Option<Planned> {
        let Preparing {
            client,
            shape,
            prepared,
        } = self.0?;
        let statement = match tokio::time::timeout(within, prepared).await {
            Ok(Ok(statement)) => Some(statement),
            Ok(Err(e)) => {
                info!(
                    "the save was not prepared ahead ({}); it sends its own statement",
                    crate::db::reason(&e)
                );
                None
            }
            Err(_) => {
                info!(
                    "the save's preparation was not answered within {}; the save sends its own statement",
                    crate::fmt::duration(within)
                );
                None
            }
        };
        let nulls = [&Null as &(dyn ToSql + Sync); SAVE_PARAMS];
        {
            let plan = statement.as_ref().filter(|_| running()).map(|s| {
                // The statement prepared above, on this direct session.
                #[allow(clippy::disallowed_methods)]
                let plan = client.query(s, &nulls);
                (client.batch_execute(QUIET), plan)
            });
            let restore = client.batch_execute(match (&plan, &statement) {
                (Some(_), _) => PLANNED,
                (None, Some(_)) => "RESET lock_timeout",
                // Nothing prepared: nothing for the plan cache mode to keep.
                (None, None) => "RESET lock_timeout; RESET plan_cache_mode",
            });
            if let Some((quiet, plan)) = plan {
                let _ = std::pin::pin!(quiet).now_or_never();
                let _ = std::pin::pin!(plan).now_or_never();
            }
            let _ = std::pin::pin!(restore).now_or_never();
        }
        // Lets the connection's task write them before leasectl turns to the command.
        tokio::task::yield_now().await;
        statement.map(|statement| Planned { statement, shape })
    }
}

/// How many parameters the fenced save takes: the run's, then the save's own.
const SAVE_PARAMS: usize = RUN_TYPES.len() + SAVE_TYPES.len();

/// The fenced save through the statement prepared and planned ahead ([`plan_save_ahead`]), with
/// the plan cache mode reset in the same round trip. `None` without one, when it is of another
/// `shape` than the run needs (the plan cache mode is then reset alone), or when the session no
/// longer has it (the connection was replaced meanwhile): the caller sends the statement itself.
/// Any other failure is the save's.
async fn execute_planned(
    client: &Client,
    planned: Option<&Planned>,
    shape: Shape,
    params: &[(&(dyn ToSql + Sync), Type)],
) -> Option<Result<Vec<Row>, tokio_postgres::Error>> {
    let planned = planned?;
    let reset = client.batch_execute("RESET plan_cache_mode");
    if planned.shape != shape {
        // Queued now, it goes out with the statement the caller sends next.
        let _ = std::pin::pin!(reset).now_or_never();
        return None;
    }
    let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
    // The statement prepared ahead on this session (or gone with it: answered below).
    #[allow(clippy::disallowed_methods)]
    let save = client.query(&planned.statement, &values);
    let (rows, _) = tokio::join!(save, reset);
    match rows {
        Err(e) if e.code() == Some(&SqlState::INVALID_SQL_STATEMENT_NAME) => None,
        rows => Some(rows),
    }
}

/// The plain save planned ahead, then the command's own `events` — in one transaction, sent in
/// one flight (`BEGIN`, the plan, the events' `INSERT`, `COMMIT`), with the plan cache mode reset
/// after it. The events go in only where the run was stored (its id is there, inserted by the
/// statement before, under the lease row's lock that the commit releases), after the run's own
/// event and in the file's order, and notify relays as the save does. Cheaper than the full
/// text sent unplanned, whose parse and plan a fresh server process pays after the command.
/// `None` when the session no longer has the statement (the transaction is then rolled back
/// and the caller sends the full text itself); any other failure is the save's.
async fn save_then_events(
    client: &Client,
    schema: &Schema,
    planned: &Statement,
    params: &[(&(dyn ToSql + Sync), Type)],
    (run_id, events, outbox_channel): (Uuid, &serde_json::Value, &str),
) -> Option<Result<Vec<Row>, tokio_postgres::Error>> {
    let insert = sql(
        schema,
        &format!(
            "INSERT INTO {{s}}.outbox (aggregate_type, aggregate_id, type, payload)
         SELECT {JOB_EVENT}
           FROM jsonb_array_elements($1::jsonb) WITH ORDINALITY AS j(e, ord)
          WHERE EXISTS (SELECT 1 FROM {{s}}.runs r WHERE r.id = $2)
          ORDER BY j.ord
         RETURNING pg_notify($3, '')"
        ),
    );
    let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
    let inserted: [(&(dyn ToSql + Sync), Type); 3] = [
        (events, Type::JSONB),
        (&run_id, Type::UUID),
        (&outbox_channel, Type::TEXT),
    ];
    // Polled in this order, each request goes out before any answer is awaited: one flight.
    // The statement prepared ahead on this session (or gone with it: answered below).
    #[allow(clippy::disallowed_methods)]
    let (begun, saved, added, committed, _) = tokio::join!(
        client.batch_execute("BEGIN"),
        client.query(planned, &values),
        client.query_typed(&insert, &inserted),
        client.batch_execute("COMMIT"),
        client.batch_execute("RESET plan_cache_mode"),
    );
    // A failed statement aborted the transaction, and its COMMIT rolled it back.
    match saved {
        Err(e) if e.code() == Some(&SqlState::INVALID_SQL_STATEMENT_NAME) => return None,
        Err(e) => return Some(Err(e)),
        Ok(_) => {}
    }
    Some(begun.and(added).and(committed).and(saved))
}

/// One of the command's own events as outbox columns (`aggregate_type`, `aggregate_id`, `type`,
/// `payload`), from its JSON object `j.e` (see `run::events` for what a line may hold).
const JOB_EVENT: &str =
    "j.e->>'aggregate_type', j.e->>'aggregate_id', j.e->>'type', j.e->'payload'";

/// SQL NULL as a parameter of any type.
#[derive(Debug)]
struct Null;

impl ToSql for Null {
    fn to_sql(
        &self,
        _: &Type,
        _: &mut bytes::BytesMut,
    ) -> Result<tokio_postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        Ok(tokio_postgres::types::IsNull::Yes)
    }

    fn accepts(_: &Type) -> bool {
        true
    }

    tokio_postgres::types::to_sql_checked!();
}

/// Which text of the fenced save a run sends. Both take the same parameters (the run's, then
/// the save's own); the plain one leaves out what only the others need. A fresh server
/// process parses, plans and executes it in about 0.7 of the full one's time (2.7 against
/// 3.5 ms here): the command's own events cost it a set-returning JSON function, a `UNION ALL`
/// and a sort, a step's lease the expiry test and the renewal's `CASE`s.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// The lease is released and the command wrote no events of its own: nearly every run.
    Plain,
    /// A step's lease (`run --token`: renewed and marked idle, not released), or the
    /// command's own events to store after the run's. (Where the plain text was planned ahead,
    /// a released run stores them with a statement of their own after the plan instead.)
    Full,
}

impl Shape {
    /// The text a run needs: `keep` is [`Lease::keep`]; `job_events` the command's own events.
    pub fn of(keep: bool, job_events: Option<&serde_json::Value>) -> Shape {
        let own_events =
            job_events.is_some_and(|v| v.as_array().is_none_or(|events| !events.is_empty()));
        if keep || own_events {
            Shape::Full
        } else {
            Shape::Plain
        }
    }
}

/// The fenced save's statement of `shape` (see [`save_fenced`]): `$1`…`$21` the run
/// ([`RUN_TYPES`]), then [`SAVE_TYPES`] (the plain text leaves `$26` and `$27` unused). Spliced
/// once per process: a run prepares one ahead and sends one itself only where the prepared one
/// is gone or of the other shape.
fn save_sql(schema: &Schema, shape: Shape) -> String {
    static PLAIN: OnceLock<(String, String)> = OnceLock::new();
    static FULL: OnceLock<(String, String)> = OnceLock::new();
    let spliced = match shape {
        Shape::Plain => &PLAIN,
        Shape::Full => &FULL,
    };
    let (name, text) =
        spliced.get_or_init(|| (schema.name().to_owned(), splice_save(schema, shape)));
    if name == schema.name() {
        text.clone()
    } else {
        splice_save(schema, shape)
    }
}

fn splice_save(schema: &Schema, shape: Shape) -> String {
    // `owner` has a row only when `owner.target` = $2: the run's target is $2 either way.
    // The data-modifying steps run to completion whether or not the final SELECT reads them;
    // it reads `run` alone, whose one row says the run was stored.
    let (still_live, events, release) = match shape {
        Shape::Plain => (
            "",
            "SELECT 'leasectl.target', run.target, $22::text, $23::jsonb
               FROM run WHERE $22::text IS NOT NULL"
                .to_owned(),
            "SET token = NULL, holder_host = NULL, holder_pid = NULL, holder_label = NULL,
                    idle_token = NULL, heartbeat_at = now()",
        ),
        Shape::Full => (
            " AND (NOT $27 OR NOT {expired})",
            format!(
                "SELECT e.aggregate_type, e.aggregate_id, e.type, e.payload FROM (
                 SELECT 0::int8 AS ord, 'leasectl.target' AS aggregate_type,
                        run.target AS aggregate_id, $22::text AS type, $23::jsonb AS payload
                   FROM run WHERE $22::text IS NOT NULL
                 UNION ALL
                 SELECT j.ord, {JOB_EVENT}
                   FROM run, jsonb_array_elements(coalesce($26::jsonb, '[]'))
                             WITH ORDINALITY AS j(e, ord)
             ) e ORDER BY e.ord"
            ),
            // Released — or, for a lease that outlives the run ($27: `run --token`), renewed
            // and marked idle until the next step.
            "SET token = CASE WHEN $27 THEN l.token END,
                    holder_host = CASE WHEN $27 THEN l.holder_host END,
                    holder_pid = CASE WHEN $27 THEN l.holder_pid END,
                    holder_label = CASE WHEN $27 THEN l.holder_label END,
                    idle_token = CASE WHEN $27 THEN l.token END,
                    heartbeat_at = now()",
        ),
    };
    sql(
        schema,
        &format!(
            "WITH owner AS (
             SELECT l.target, set_config('leasectl.outbox_notified', 'on', true)
               FROM {{s}}.leases l
              WHERE l.target = $2 AND l.token = $4{still_live}
                FOR UPDATE
         ), run AS (
             {INSERT_RUN}
             SELECT {RUN_VALUES}, NULL::uuid FROM owner
             RETURNING target
         ), event AS (
             INSERT INTO {{s}}.outbox (aggregate_type, aggregate_id, type, payload)
             {events}
             RETURNING pg_notify($25, '')
         ), released AS (
             UPDATE {{s}}.leases l
                {release}
               FROM run WHERE l.target = run.target AND l.token = $4
             RETURNING pg_notify($24, l.target)
         )
         SELECT 1::int8 AS runs FROM run"
        ),
    )
}

/// The derived column values of a run.
struct RunFields {
    outcome: &'static str,
    exit_code: Option<i32>,
    signal: Option<i32>,
    slot: Option<SystemTime>,
    slot_end: Option<SystemTime>,
}

impl RunFields {
    fn new(run: &RunRecord<'_>) -> RunFields {
        RunFields {
            outcome: run.outcome.as_str(),
            exit_code: run
                .exit_code_override
                .or_else(|| run.status.and_then(ChildStatus::code)),
            signal: run.status.and_then(ChildStatus::signal),
            slot: run.slot.map(|s| s.start),
            slot_end: run.slot.map(|s| s.end),
        }
    }

    /// $1…$21 of every run insert, in the column order of [`INSERT_RUN`], typed as
    /// [`RUN_TYPES`] says.
    fn params<'a>(
        &'a self,
        lease: &'a Lease,
        run: &'a RunRecord<'_>,
    ) -> Vec<(&'a (dyn ToSql + Sync), Type)> {
        let values: [&'a (dyn ToSql + Sync); 21] = [
            &run.id,
            &lease.target,
            &lease.fence,
            &lease.token,
            &self.outcome,
            &run.argv,
            &run.host,
            &run.pid,
            &run.started_at,
            &run.finished_at,
            &self.exit_code,
            &self.signal,
            &run.stdout,
            &run.stderr,
            &run.stdout_truncated,
            &run.stderr_truncated,
            &run.error,
            &run.events_kept,
            &self.slot,
            &self.slot_end,
            &lease.label,
        ];
        values.into_iter().zip(RUN_TYPES).collect()
    }
}

/// The types of a run insert's $1…$21 ([`RunFields::params`]).
const RUN_TYPES: [Type; 21] = [
    Type::UUID,
    Type::TEXT,
    Type::INT8,
    Type::UUID,
    Type::TEXT,
    Type::TEXT_ARRAY,
    Type::TEXT,
    Type::INT4,
    Type::TIMESTAMPTZ,
    Type::TIMESTAMPTZ,
    Type::INT4,
    Type::INT4,
    Type::BYTEA,
    Type::BYTEA,
    Type::BOOL,
    Type::BOOL,
    Type::TEXT,
    Type::BYTEA,
    Type::TIMESTAMPTZ,
    Type::TIMESTAMPTZ,
    Type::TEXT,
];

/// The types of the fenced save's $22…$27, after the run's: the event's type and payload, the
/// lease and outbox channels, the command's own events, and whether the lease outlives the run.
const SAVE_TYPES: [Type; 6] = [
    Type::TEXT,
    Type::JSONB,
    Type::TEXT,
    Type::TEXT,
    Type::JSONB,
    Type::BOOL,
];

/// The outbox event of a stored run (at least run_id, target, fence, exit_code — null
/// when a signal ended the command, with `signal` set — started_at, finished_at, host; and
/// `slot`, `slot_end` for `run --slot`, null otherwise).
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
        "job_events": run.job_events.and_then(serde_json::Value::as_array).map_or(0, Vec::len),
        "slot": f.slot.map(rfc3339),
        "slot_end": f.slot_end.map(rfc3339),
        "label": lease.label,
    })
}

/// Records a run that lost its lease, without any lease check and without an event: the
/// operator keeps its output (a rotated token printed by a fenced-out refresh must not vanish),
/// but nothing downstream hears of it and `--reuse-within` never returns it.
///
/// It is sent only once nothing of the command runs any more, so it also confirms the stop: if
/// the lease was taken from this holder (`release --force`, `--replace`), the place's stopping
/// fact is cleared and waiters are woken — the next holder need not wait out this one's
/// deadline (see migrations/0011_stopping.sql).
///
/// The outcome is `preempted` when a `--replace` took the lease from this token (the place's
/// `preempted_token`), with the replacement's fence in `preempted_by`; otherwise `lost`.
pub async fn record_lost(
    client: &Client,
    schema: &Schema,
    lease: &Lease,
    run: &RunRecord<'_>,
) -> Result<Lost> {
    let sql = sql(
        schema,
        &format!(
            "WITH by AS (
                 SELECT fence, holder_host, holder_pid, holder_label FROM {{s}}.leases
                  WHERE target = $2 AND preempted_token = $4 LIMIT 1
             ), confirmed AS (
                 UPDATE {{s}}.leases SET stopping_token = NULL
                  WHERE target = $2 AND stopping_token = $4
                 RETURNING pg_notify($22, target)
             ), run AS (
                 {insert}
                 SELECT $1, $2, $3, $4, CASE WHEN by.fence IS NULL THEN $5 ELSE 'preempted' END,
                        $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21,
                        NULL, by.fence
                   FROM (SELECT 1) one LEFT JOIN by ON true
                 ON CONFLICT (id) DO NOTHING
             )
             SELECT by.fence, by.holder_host, by.holder_pid, by.holder_label,
                    (SELECT count(*) FROM confirmed) AS confirmed
               FROM (SELECT 1) one LEFT JOIN by ON true",
            insert = INSERT_RUN.replace("done_by)", "done_by, preempted_by)"),
        ),
    );
    let mut f = RunFields::new(run);
    f.outcome = Outcome::Lost.as_str();
    let channel = schema.lease_channel();
    let mut params = f.params(lease, run);
    params.push((&channel, Type::TEXT));
    let row = client
        .query_typed_one(&sql, &params)
        .await
        .context("cannot record the lost run")?;
    Ok(match row.get::<_, Option<i64>>("fence") {
        None => Lost::Lost,
        Some(fence) => Lost::Preempted {
            fence,
            by: super::holder::who(
                row.get("holder_host"),
                row.get("holder_pid"),
                row.get("holder_label"),
            ),
        },
    })
}

/// How [`record_lost`] recorded a run.
#[derive(Debug, PartialEq, Eq)]
pub enum Lost {
    Lost,
    /// A `--replace` by `by` (`host pid N [label]`) took the lease, with this fence.
    Preempted {
        fence: i64,
        by: String,
    },
}

/// The stop of a holder whose lease was taken (`release --force`, `--replace`): its run of
/// `target` with `fence` recorded `lost` or `preempted` — the only outcomes a holder that finds
/// its token gone records, whatever it was doing. The outcome, not just the fence, tells the
/// stop from the earlier steps of a lease that spans several (`run --token`), which share its
/// fence and were stored (or interrupted, or timed out) while it was still held.
pub async fn stop_recorded(
    client: &Client,
    schema: &Schema,
    target: &str,
    fence: i64,
) -> Result<Option<(Uuid, Outcome)>> {
    let sql = sql(
        schema,
        "SELECT id, outcome FROM {s}.runs
          WHERE target = $1 AND fence = $2 AND outcome IN ('lost', 'preempted')
          ORDER BY finished_at DESC LIMIT 1",
    );
    let rows = client
        .query_typed(&sql, &[(&target, Type::TEXT), (&fence, Type::INT8)])
        .await
        .context("cannot look up the old holder's run")?;
    Ok(rows.first().map(|r| {
        let outcome: &str = r.get("outcome");
        (
            r.get("id"),
            Outcome::parse(outcome).unwrap_or(Outcome::Lost),
        )
    }))
}

/// What [`skip_if_done`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum SlotCheck {
    /// No run did the slot yet: the caller runs, still holding the lease.
    Open,
    /// Run `by` did the slot: the skip is recorded and the lease released.
    Done { by: Uuid },
    /// The token no longer matched: nothing was written.
    NotOwner,
}

/// The outcomes that "do" a slot. `completed` (any exit code, or a signal) and `timed_out`
/// are results: the command ran in the slot and ended, and the promise is at most one run per
/// slot. `lost` (the result was never stored by a holder: the command was stopped, or its save
/// was fenced out), `interrupted` (leasectl was told to stop it, say a host shutting down),
/// `exec_failed` (the command never started, perhaps only this host lacks it) and `skipped` (it
/// did not run) are not: the next caller of the slot runs. With `--until-success` only a
/// `completed` run that exited 0 counts (`{until_success}`: the flag's placeholder).
const SLOT_DONE: &str = "(r.outcome IN ('completed', 'timed_out')
                           AND (NOT {until_success} OR (r.outcome = 'completed' AND r.exit_code = 0
                                                        AND r.signal IS NULL)))";

/// Under the lease, in one statement: stores the schedule on the target (`expectations`, the
/// latest one seen wins; `schedule_since` says since when, for the health check: a schedule
/// that is new, changed, or stored again after `expect --clear` forgot it watches the target
/// from now on) and, if a run of the target already did `skip.slot` (`SLOT_DONE`),
/// records `skip` as a `skipped` run naming it (`done_by`; no output, no outbox event) and
/// releases the lease. Otherwise it writes on the lease row which slot of which schedule the
/// caller is now doing, and the id its run will be stored with (`run_id`): a contender of the
/// same slot finds it there and records a skip at once ([`skip_without_lease`]) instead of
/// finding the target busy. Those columns describe a run in progress only while their fence is
/// the row's: the next acquisition does not inherit them.
///
/// The row lock on the lease (`owner`) makes the check and the skip, or the check and the
/// run that follows, one critical section: two callers of the same slot cannot both find it
/// open, since the second acquires only after the first stored its run (fenced save) or
/// released the lease.
pub async fn skip_if_done(
    client: &Client,
    schema: &Schema,
    lease: &Lease,
    skip: &RunRecord<'_>,
    run_id: Uuid,
    (schedule, zone): (&str, Option<&str>),
    until_success: bool,
) -> Result<SlotCheck> {
    let lease_channel = schema.lease_channel();
    let mut f = RunFields::new(skip);
    f.outcome = Outcome::Skipped.as_str();
    let mut params = f.params(lease, skip);
    // This statement's own parameters follow the run's, however many columns a run has.
    let [slot, until, sched, tz, channel, run] =
        std::array::from_fn(|i| format!("${}", params.len() + i + 1));
    // The skip's own `slot_end`.
    let slot_end = "$20";
    params.extend([
        (&f.slot as &(dyn ToSql + Sync), Type::TIMESTAMPTZ),
        (&until_success, Type::BOOL),
        (&schedule, Type::TEXT),
        (&zone, Type::TEXT),
        (&lease_channel, Type::TEXT),
        (&run_id, Type::UUID),
    ]);
    let slot_done = SLOT_DONE.replace("{until_success}", &until);
    let sql = sql(
        schema,
        &format!(
            "WITH owner AS (
             SELECT target FROM {{s}}.leases WHERE target = $2 AND token = $4 FOR UPDATE
         ), schedule AS (
             INSERT INTO {{s}}.expectations AS e (target, schedule, schedule_tz, schedule_since)
             SELECT target, {sched}, {tz}, now() FROM owner
             ON CONFLICT (target) DO UPDATE
                SET schedule = excluded.schedule, schedule_tz = excluded.schedule_tz,
                    schedule_since = now(), updated_at = now()
              WHERE (e.schedule, e.schedule_tz)
                    IS DISTINCT FROM (excluded.schedule, excluded.schedule_tz)
         ), done AS (
             SELECT r.id FROM {{s}}.runs r JOIN owner ON r.target = owner.target
              WHERE r.slot = {slot} AND {slot_done}
              ORDER BY r.finished_at LIMIT 1
         ), run AS (
             {INSERT_RUN}
             SELECT {RUN_VALUES}, done.id FROM done
             RETURNING target, done_by
         ), released AS (
             UPDATE {{s}}.leases l SET token = NULL, holder_host = NULL, holder_pid = NULL, holder_label = NULL
               FROM run WHERE l.target = run.target AND l.token = $4
             RETURNING pg_notify({channel}, l.target)
         ), doing AS (
             -- Not done: the row says which slot this fence is doing (exclusive with `released`,
             -- which updates the row only when the slot was done).
             UPDATE {{s}}.leases l
                SET slot_fence = l.fence, slot = {slot}, slot_end = {slot_end},
                    slot_schedule = {sched}, slot_tz = {tz}, slot_run = {run}
               FROM owner
              WHERE l.target = owner.target AND l.token = $4 AND NOT EXISTS (SELECT 1 FROM done)
         )
         SELECT (SELECT count(*) FROM owner) AS owned, (SELECT done_by FROM run) AS done_by,
                (SELECT count(*) FROM released) AS released"
        ),
    );
    let row = client
        .query_typed_one(&sql, &params)
        .await
        .context("cannot check whether the slot was done")?;
    if row.get::<_, i64>("owned") == 0 {
        return Ok(SlotCheck::NotOwner);
    }
    Ok(match row.get::<_, Option<Uuid>>("done_by") {
        Some(by) => SlotCheck::Done { by },
        None => SlotCheck::Open,
    })
}

/// What [`skip_without_lease`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum SlotElsewhere {
    /// The skip is recorded: run `by` (of fence `fence`) is doing the caller's slot (`running`:
    /// its outcome is not known yet) or has done it.
    Skipped {
        by: Uuid,
        fence: i64,
        /// The slot's start.
        slot: SystemTime,
        running: bool,
        /// `host pid N [label]` of the lease's holder, if it is held.
        holder: Option<String>,
    },
    /// A live holder that has not said which slot it is doing — a `--slot` run between its
    /// acquisition and its check, or a run without `--slot` — took the lease `held` ago.
    Unsaid { held: Duration },
    /// Anything else: another slot or schedule in progress, an expired or stopping holder, a
    /// run of this slot that ended without doing it. Busy, as without `--slot`.
    Busy,
}

/// A `--slot` caller that found the target busy, as its skip would record it.
#[derive(Debug)]
pub struct SlotCaller<'a> {
    /// The id of its skip (a new one for every statement: one whose commit went unanswered
    /// must not collide with the next).
    pub id: Uuid,
    /// Its own token (it holds no lease; `runs.token` is never empty).
    pub token: Uuid,
    pub argv: &'a [String],
    pub host: &'a str,
    pub pid: i32,
    pub label: Option<&'a str>,
    /// `--slot` and `--slot-tz` as given (NULL: UTC), `--slot-skew` and `--until-success`.
    pub schedule: &'a str,
    pub zone: Option<&'a str>,
    pub skew: Duration,
    pub until_success: bool,
}

/// For a `--slot` caller that found the target busy, in one statement and without the lease:
/// if the lease row says its holder is doing the caller's slot — the same schedule and zone,
/// and the database's `now() + skew` inside the slot the holder recorded (see [`skip_if_done`])
/// — and that run is not stored yet, or it is stored and did the slot (`SLOT_DONE`, by the
/// caller's `--until-success`), records `skip` as a `skipped` run naming it (`done_by`, the id
/// the holder's run has or will have; `done_by_running` while it is not stored) with that run's
/// fence, the slot and the caller's host, pid and label; no output, no outbox event.
///
/// "In progress" needs the holder's own fence on the slot columns and a live token; "did it"
/// needs only the stored run, whoever holds the lease now. A run of the slot that ended without
/// doing it (a failure with `--until-success`, `lost`, `interrupted`) leaves the slot open: the
/// caller is busy, or waits, and whoever takes the lease next runs the slot.
pub async fn skip_without_lease(
    client: &Client,
    schema: &Schema,
    target: &str,
    c: &SlotCaller<'_>,
) -> Result<SlotElsewhere> {
    let slot_done = SLOT_DONE.replace("{until_success}", "$11");
    let sql = sql(
        schema,
        &format!(
            "WITH l AS (
             SELECT l.target, l.fence, l.slot_fence, l.slot, l.slot_end, l.slot_run,
                    l.holder_host, l.holder_pid, l.holder_label,
                    (l.token IS NOT NULL AND NOT {{expired}}) AS live, {{running_ms}} AS held_ms,
                    coalesce(l.slot_schedule = $3 AND l.slot_tz IS NOT DISTINCT FROM $4
                             AND l.slot <= now() + $5 * interval '1 millisecond'
                             AND now() + $5 * interval '1 millisecond' < l.slot_end, false)
                      AS this_slot
               FROM {{s}}.leases l WHERE l.target = $1 AND l.place = 0
         ), stored AS (
             SELECT {slot_done} AS done FROM {{s}}.runs r JOIN l ON r.id = l.slot_run
         ), decided AS (
             SELECT l.*,
                    CASE WHEN NOT l.this_slot THEN NULL
                         WHEN EXISTS (SELECT 1 FROM stored WHERE done) THEN false
                         WHEN l.live AND l.slot_fence = l.fence
                              AND NOT EXISTS (SELECT 1 FROM stored) THEN true
                    END AS running
               FROM l
         ), run AS (
             INSERT INTO {{s}}.runs (id, target, fence, token, outcome, argv, host, pid,
                                     started_at, finished_at, stdout, stderr, stdout_truncated,
                                     stderr_truncated, slot, slot_end, label, done_by,
                                     done_by_running)
             SELECT $2, d.target, d.slot_fence, $6, 'skipped', $7, $8, $9, now(), now(), '', '',
                    false, false, d.slot, d.slot_end, $10, d.slot_run, d.running
               FROM decided d WHERE d.running IS NOT NULL
             RETURNING id
         )
         SELECT d.slot_fence, d.slot_run, d.slot, d.running, d.live, d.held_ms, d.holder_host,
                d.holder_pid, d.holder_label,
                (d.slot_fence IS NOT DISTINCT FROM d.fence) AS said,
                (SELECT count(*) FROM run) AS recorded
           FROM decided d"
        ),
    );
    let skew_ms = ms(c.skew);
    let params: [(&(dyn ToSql + Sync), Type); 11] = [
        (&target, Type::TEXT),
        (&c.id, Type::UUID),
        (&c.schedule, Type::TEXT),
        (&c.zone, Type::TEXT),
        (&skew_ms, Type::INT8),
        (&c.token, Type::UUID),
        (&c.argv, Type::TEXT_ARRAY),
        (&c.host, Type::TEXT),
        (&c.pid, Type::INT4),
        (&c.label, Type::TEXT),
        (&c.until_success, Type::BOOL),
    ];
    let rows = client
        .query_typed(&sql, &params)
        .await
        .context("cannot check whether the holder is doing this slot")?;
    let Some(row) = rows.first() else {
        return Ok(SlotElsewhere::Busy);
    };
    if row.get::<_, i64>("recorded") == 1 {
        let live: bool = row.get("live");
        return Ok(SlotElsewhere::Skipped {
            by: row.get("slot_run"),
            fence: row.get("slot_fence"),
            slot: row.get("slot"),
            running: row.get("running"),
            holder: live.then(|| {
                super::holder::who(
                    row.get("holder_host"),
                    row.get("holder_pid"),
                    row.get("holder_label"),
                )
            }),
        });
    }
    if row.get("live") && !row.get::<_, bool>("said") {
        return Ok(SlotElsewhere::Unsaid {
            held: crate::fmt::millis(row.get("held_ms")),
        });
    }
    Ok(SlotElsewhere::Busy)
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
    let sql = sql(
        schema,
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

/// The run stored by the acquisition numbered `fence`, if it has finished. Skips are not runs of
/// that acquisition even when they carry its fence: a `--slot` caller that skips without the
/// lease records the fence of the run that did (or is doing) its slot, possibly after that run
/// ended ([`skip_without_lease`]).
pub async fn run_by_fence(
    client: &Client,
    schema: &Schema,
    target: &str,
    fence: i64,
) -> Result<Option<(Reusable, bool)>> {
    let sql = sql(
        schema,
        "SELECT id, outcome, exit_code, signal, stdout, stdout_truncated FROM {s}.runs
          WHERE target = $1 AND fence = $2 AND outcome <> 'skipped'
          ORDER BY finished_at DESC LIMIT 1",
    );
    let rows = client
        .query_typed(&sql, &[(&target, Type::TEXT), (&fence, Type::INT8)])
        .await
        .context("cannot look up the awaited run")?;
    Ok(rows
        .first()
        .map(|r| (reusable_from_row(r), r.get("stdout_truncated"))))
}

fn reusable_from_row(r: &Row) -> Reusable {
    let outcome: &str = r.get("outcome");
    Reusable {
        id: r.get("id"),
        outcome: Outcome::parse(outcome).unwrap_or(Outcome::Completed),
        exit_code: r.get("exit_code"),
        signal: r.get("signal"),
        stdout: r.get("stdout"),
    }
}

/// One row of `leasectl runs`.
#[derive(Debug)]
pub struct Listed {
    pub id: Uuid,
    pub fence: i64,
    pub outcome: String,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub host: String,
    pub pid: i32,
    pub started_at: SystemTime,
    pub finished_at: SystemTime,
    pub duration_ms: i64,
    /// How long ago it finished, by the database clock.
    pub age_ms: i64,
    pub stdout_bytes: i64,
    pub stdout_truncated: bool,
    pub stderr_bytes: i64,
    pub stderr_truncated: bool,
    pub argv: Vec<String>,
    pub error: Option<String>,
    /// `run --slot`: the slot, its end, and for a skip the run that had done it — or was doing
    /// it (`done_by_running`) when the skip was recorded.
    pub slot: Option<SystemTime>,
    pub slot_end: Option<SystemTime>,
    pub done_by: Option<Uuid>,
    pub done_by_running: bool,
    /// `run --label`.
    pub label: Option<String>,
    /// `preempted`: the fence of the `--replace` that took the lease.
    pub preempted_by: Option<i64>,
}

/// The newest `limit` runs of `target`, newest first, without their output.
pub async fn list(
    client: &Client,
    schema: &Schema,
    target: &str,
    limit: i64,
) -> Result<Vec<Listed>> {
    let sql = sql(
        schema,
        "SELECT id, fence, outcome, exit_code, signal, host, pid, started_at, finished_at,
                round(extract(epoch FROM finished_at - started_at) * 1000)::int8 AS duration_ms,
                round(extract(epoch FROM now() - finished_at) * 1000)::int8 AS age_ms,
                length(stdout)::int8 AS stdout_bytes, stdout_truncated,
                length(stderr)::int8 AS stderr_bytes, stderr_truncated, argv, error,
                slot, slot_end, done_by, done_by_running, label, preempted_by
           FROM {s}.runs WHERE target = $1
          ORDER BY finished_at DESC LIMIT $2",
    );
    let rows = client
        .query_typed(&sql, &[(&target, Type::TEXT), (&limit, Type::INT8)])
        .await
        .context("cannot list runs")?;
    Ok(rows
        .iter()
        .map(|r| Listed {
            id: r.get("id"),
            fence: r.get("fence"),
            outcome: r.get("outcome"),
            exit_code: r.get("exit_code"),
            signal: r.get("signal"),
            host: r.get("host"),
            pid: r.get("pid"),
            started_at: r.get("started_at"),
            finished_at: r.get("finished_at"),
            duration_ms: r.get("duration_ms"),
            age_ms: r.get("age_ms"),
            stdout_bytes: r.get("stdout_bytes"),
            stdout_truncated: r.get("stdout_truncated"),
            stderr_bytes: r.get("stderr_bytes"),
            stderr_truncated: r.get("stderr_truncated"),
            argv: r.get("argv"),
            error: r.get("error"),
            preempted_by: r.get("preempted_by"),
            slot: r.get("slot"),
            slot_end: r.get("slot_end"),
            done_by: r.get("done_by"),
            done_by_running: r.get("done_by_running"),
            label: r.get("label"),
        })
        .collect())
}

/// Which captured stream [`output`] returns.
#[derive(Debug, Clone, Copy)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// The captured bytes of run `run` of `target` or, without `run`, of its newest run that was not
/// lost (a lost run's output is there for the operator who asks for it by id, not for scripts)
/// nor skipped (a skip has no output; the run that did its slot has).
pub async fn output(
    client: &Client,
    schema: &Schema,
    target: &str,
    run: Option<Uuid>,
    stream: Stream,
) -> Result<Option<Vec<u8>>> {
    let column = match stream {
        Stream::Stdout => "stdout",
        Stream::Stderr => "stderr",
    };
    let sql = sql(
        schema,
        &format!(
            "SELECT {column} AS bytes FROM {{s}}.runs
              WHERE target = $1 AND CASE WHEN $2::uuid IS NULL THEN outcome NOT IN ('lost', 'skipped') ELSE id = $2 END
              ORDER BY finished_at DESC LIMIT 1"
        ),
    );
    let rows = client
        .query_typed(&sql, &[(&target, Type::TEXT), (&run, Type::UUID)])
        .await
        .context("cannot read the run")?;
    Ok(rows.first().map(|r| r.get("bytes")))
}

/// Deletes runs that finished more than `older_than` ago, except each target's newest run that
/// was not skipped (so `status` keeps showing it), in chunks so no lock is held for long. With
/// `dry_run`, only counts. Returns the number of runs.
pub async fn prune(
    client: &Client,
    schema: &Schema,
    older_than: Duration,
    dry_run: bool,
) -> Result<u64> {
    let ms = ms(older_than);
    let candidates = "SELECT r.id FROM {s}.runs r
                       WHERE r.finished_at < now() - $1::int8 * interval '1 millisecond'
                         AND (r.outcome = 'skipped'
                              OR EXISTS (SELECT 1 FROM {s}.runs n
                                          WHERE n.target = r.target AND n.finished_at > r.finished_at
                                            AND n.outcome <> 'skipped'))";
    if dry_run {
        let row = client
            .query_typed_one(
                &sql(
                    schema,
                    &format!("SELECT count(*) AS n FROM ({candidates}) c"),
                ),
                &[(&ms, Type::INT8)],
            )
            .await
            .context("cannot count old runs")?;
        return Ok(u64::try_from(row.get::<_, i64>("n")).unwrap_or(0));
    }
    let delete = sql(
        schema,
        &format!("DELETE FROM {{s}}.runs WHERE id IN ({candidates} LIMIT 5000)"),
    );
    let mut total = 0;
    loop {
        let n = client
            .execute_typed(&delete, &[(&ms, Type::INT8)])
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

    /// The statement spliced once is the first schema's; another schema still gets its own,
    /// never the first one's tables.
    #[test]
    fn the_save_names_the_schema_it_is_for() {
        let (a, b) = (Schema::new("first"), Schema::new("second"));
        for shape in [Shape::Plain, Shape::Full, Shape::Plain] {
            let (for_a, for_b) = (save_sql(&a, shape), save_sql(&b, shape));
            assert!(for_a.contains("\"first\".runs") && !for_a.contains("\"second\""));
            assert!(for_b.contains("\"second\".runs") && !for_b.contains("\"first\""));
            assert_eq!(for_a, splice_save(&a, shape));
        }
    }

    #[test]
    fn only_a_step_or_a_command_with_events_of_its_own_needs_the_full_save() {
        let none = serde_json::json!([]);
        let some = serde_json::json!([{"aggregate_type": "a", "aggregate_id": "1", "type": "t"}]);
        assert_eq!(Shape::of(false, None), Shape::Plain);
        assert_eq!(Shape::of(false, Some(&none)), Shape::Plain);
        assert_eq!(Shape::of(false, Some(&some)), Shape::Full);
        assert_eq!(Shape::of(true, None), Shape::Full);
        // The plain text neither renews a lease nor reads the command's events; the full one
        // does both, and both take the same parameters.
        let schema = Schema::new("s");
        let (plain, full) = (
            save_sql(&schema, Shape::Plain),
            save_sql(&schema, Shape::Full),
        );
        for part in ["$26", "$27", JOB_EVENT] {
            assert!(!plain.contains(part) && full.contains(part), "{part}");
        }
        for text in [&plain, &full] {
            assert!(
                text.contains("$25") && text.contains("FOR UPDATE"),
                "{text}"
            );
        }
    }
}
