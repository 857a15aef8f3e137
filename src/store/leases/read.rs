//! The read-model of the `leases` table: `status`'s targets and their newest runs, every holder
//! by place, the census of open connections, and why a token no longer holds its lease (which
//! reads the `runs` table to tell "released" from "taken and released since"). Only reads.

use std::time::SystemTime;

use anyhow::{Context, Result};
use tokio_postgres::types::Type;
use tokio_postgres::Client;
use uuid::Uuid;

use crate::db::Schema;
use crate::store::holder::{holder_from_row, who, Holder};
use crate::store::sql;

/// Why `token` does not hold a live lease of `target`, for the one line that says so: which of
/// the things that end a lease happened, as the target's rows show it — the token's place is
/// still there but expired; a `--replace` took it (the place remembers the token it preempted);
/// nobody holds the target any more (released); or another holder has it now (taken).
pub async fn why_not_held(
    client: &Client,
    schema: &Schema,
    target: &str,
    token: Uuid,
) -> Result<String> {
    let sql = sql(
        schema,
        "SELECT l.token IS NOT DISTINCT FROM $2 AS mine, l.token IS NOT NULL AS held,
                l.preempted_token IS NOT DISTINCT FROM $2 AS preempted_me,
                {expired} AS expired, {heartbeat_age_ms} AS age_ms, l.ttl_ms,
                l.holder_host, l.holder_pid, l.holder_label, l.fence
           FROM {s}.leases l WHERE l.target = $1
          ORDER BY l.place",
    );
    let rows = client
        .query_typed(&sql, &[(&target, Type::TEXT), (&token, Type::UUID)])
        .await
        .context("cannot read the lease")?;
    let holder = |r: &tokio_postgres::Row| {
        format!(
            "{} (fence {})",
            who(
                r.get("holder_host"),
                r.get("holder_pid"),
                r.get("holder_label")
            ),
            crate::fmt::fence(r.get::<_, i64>("fence"))
        )
    };
    let held: Vec<_> = rows.iter().filter(|r| r.get::<_, bool>("held")).collect();
    if let Some(r) = rows.iter().find(|r| r.get::<_, bool>("mine")) {
        return Ok(format!(
            "the lease on '{target}' expired (last heartbeat {} ago, ttl {})",
            crate::fmt::duration(crate::fmt::millis(r.get("age_ms"))),
            crate::fmt::duration(crate::fmt::millis(r.get("ttl_ms")))
        ));
    }
    if let Some(r) = rows.iter().find(|r| r.get::<_, bool>("preempted_me")) {
        return Ok(if r.get::<_, bool>("held") {
            format!(
                "the lease on '{target}' was replaced: --replace of {} took it",
                holder(r)
            )
        } else {
            format!("the lease on '{target}' was replaced by a --replace (since released)")
        });
    }
    Ok(match held.as_slice() {
        [] if rows.len() == 1 => released_or_taken_since(client, schema, target, token, &rows[0])
            .await?
            .unwrap_or_else(|| {
                format!("the lease on '{target}' was released ('{target}' is free now)")
            }),
        [] => format!("the lease on '{target}' was released ('{target}' is free now)"),
        [r] if rows.len() == 1 => format!(
            "the lease on '{target}' was taken by {}",
            holder(r)
        ),
        others => format!(
            "this token holds no place of '{target}' any more: it was released or taken ({} of {} places are held by others)",
            others.len(),
            rows.len()
        ),
    })
}

/// For a free target: whether the last acquisition was someone else's — a run stored under the
/// row's fence with another token, or one of ours under an older fence — so the lease was
/// taken (after it expired or was released) and released since, not merely released.
async fn released_or_taken_since(
    client: &Client,
    schema: &Schema,
    target: &str,
    token: Uuid,
    row: &tokio_postgres::Row,
) -> Result<Option<String>> {
    let fence: i64 = row.get("fence");
    let sql = sql(
        schema,
        "SELECT (SELECT max(r.fence) FROM {s}.runs r WHERE r.target = $1 AND r.token = $2) AS mine,
                (SELECT r.host || ' pid ' || r.pid FROM {s}.runs r
                  WHERE r.target = $1 AND r.fence = $3 AND r.token <> $2 LIMIT 1) AS other",
    );
    let rows = client
        .query_typed(
            &sql,
            &[
                (&target, Type::TEXT),
                (&token, Type::UUID),
                (&fence, Type::INT8),
            ],
        )
        .await
        .context("cannot read the runs")?;
    let (mine, other): (Option<i64>, Option<String>) = rows
        .first()
        .map_or((None, None), |r| (r.get("mine"), r.get("other")));
    let shown = crate::fmt::fence(fence);
    let taken = |by: String| {
        format!("the lease on '{target}' was taken by {by}, which has released it since ('{target}' is free now)")
    };
    Ok(match (other, mine) {
        (Some(who), _) => Some(taken(format!("{who} (fence {shown})"))),
        (None, Some(m)) if m < fence => Some(taken(format!("another holder (fence {shown})"))),
        _ => None,
    })
}

/// How many connections leasectl's callers hold open now, as the tables show them: each live
/// lease holder and each live waiter keeps one (relays appear in no table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Census {
    pub holders: i64,
    pub waiters: i64,
}

/// Counts the live holders and waiters ([`Census`]) in one statement.
pub async fn census(client: &Client, schema: &Schema) -> Result<Census> {
    let row = client
        .query_typed_one(
            &sql(
                schema,
                "SELECT (SELECT count(*) FROM {s}.leases l
                          WHERE l.token IS NOT NULL AND NOT {expired}) AS holders,
                        (SELECT count(*) FROM {s}.waiters w WHERE {live_waiter}) AS waiters",
            ),
            &[],
        )
        .await
        .context("cannot count the holders and waiters")?;
    Ok(Census {
        holders: row.try_get("holders")?,
        waiters: row.try_get("waiters")?,
    })
}

/// One target as `status` shows it: its lease and its newest run.
#[derive(Debug)]
pub struct TargetStatus {
    pub target: String,
    /// `held`, `stopping` (not held, but a holder it was taken from is still stopping its
    /// command: nobody can take it yet), `expired` or `free`.
    pub state: String,
    pub holder_host: Option<String>,
    pub holder_pid: Option<i32>,
    pub holder_label: Option<String>,
    /// The target's fence counter: the last fence handed out, of any place.
    pub fence: i64,
    /// The `--max-holders` of the current (or last) holders.
    pub max_holders: i32,
    /// `None` while the target is free.
    pub heartbeat_age_ms: Option<i64>,
    pub ttl_ms: i64,
    /// The newest run that was not `skipped`.
    pub last_run: Option<LastRun>,
    /// How many `run --slot` callers found their slot done (among the stored runs).
    pub skipped: i64,
}

/// One holder of a target (with a token, live or expired), for `status`.
#[derive(Debug)]
pub struct Place {
    pub target: String,
    /// `LEASECTL_HOLDER_INDEX` of the holder.
    pub index: i32,
    pub holder: Holder,
    pub expired: bool,
    /// An `acquire`d lease between its steps: no command runs under it.
    pub idle: bool,
}

/// Every holder of every target (or just `target`), by target and place.
pub async fn holders(client: &Client, schema: &Schema, target: Option<&str>) -> Result<Vec<Place>> {
    let sql = sql(
        schema,
        "SELECT l.target, greatest(l.place - 1, 0) AS index, {expired} AS expired,
                l.idle_token IS NOT DISTINCT FROM l.token AS idle,
                l.holder_host, l.holder_pid, l.holder_label, l.fence, l.ttl_ms,
                {heartbeat_age_ms} AS age_ms, {running_ms} AS running_ms
           FROM {s}.leases l
          WHERE ($1::text IS NULL OR l.target = $1) AND l.token IS NOT NULL
          ORDER BY l.target, l.place",
    );
    let rows = client
        .query_typed(&sql, &[(&target, Type::TEXT)])
        .await
        .context("cannot read the holders")?;
    Ok(rows
        .iter()
        .map(|r| Place {
            target: r.get("target"),
            index: r.get("index"),
            holder: holder_from_row(r),
            expired: r.get("expired"),
            idle: r.get("idle"),
        })
        .collect())
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
                CASE WHEN p.live > 0 THEN 'held' WHEN p.stopping > 0 THEN 'stopping'
                     WHEN p.tokens > 0 THEN 'expired' ELSE 'free' END AS state,
                l.holder_host, l.holder_pid, l.holder_label, l.fence, l.max_holders,
                CASE WHEN l.token IS NOT NULL THEN {heartbeat_age_ms} END AS heartbeat_age_ms,
                l.ttl_ms,
                r.id AS run_id, r.outcome, r.exit_code, r.signal, r.finished_at,
                round(extract(epoch FROM r.finished_at - r.started_at) * 1000)::int8 AS duration_ms,
                round(extract(epoch FROM now() - r.finished_at) * 1000)::int8 AS run_age_ms,
                (SELECT count(*) FROM {s}.runs k
                  WHERE k.target = l.target AND k.slot IS NOT NULL AND k.outcome = 'skipped')
                  AS skipped
           FROM {s}.leases l
           -- Every place of the target (place 0 alone without --max-holders).
           CROSS JOIN LATERAL (
                SELECT count(*) FILTER (WHERE a.token IS NOT NULL) AS tokens,
                       count(*) FILTER (WHERE a.token IS NOT NULL
                           AND a.heartbeat_at + a.ttl_ms * interval '1 millisecond' >= now())
                         AS live,
                       count(*) FILTER (WHERE a.stopping_token IS NOT NULL
                           AND a.stopping_until > now()) AS stopping
                  FROM {s}.leases a WHERE a.target = l.target
           ) p
           LEFT JOIN LATERAL (
                SELECT * FROM {s}.runs
                 WHERE runs.target = l.target AND runs.outcome <> 'skipped'
                 ORDER BY finished_at DESC LIMIT 1
           ) r ON true
          WHERE ($1::text IS NULL OR l.target = $1) AND l.place = 0
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
            max_holders: r.get("max_holders"),
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
