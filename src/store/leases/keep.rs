//! Holding a lease once it is taken: the gate that keeps a command from starting while a previous
//! holder still stops its own, `run --token` taking up an `acquire`d lease for a step, marking
//! it idle, the heartbeat and `renew`, and the ways a lease ends — the holder's own release,
//! `release --token`, and the operator's `release --force`.

use std::time::Duration;

use anyhow::{Context, Result};
use tokio_postgres::types::Type;
use tokio_postgres::Client;
use uuid::Uuid;

use super::Lease;
use crate::db::Schema;
use crate::store::holder::{holder_from_row, who, Holder};
use crate::store::{ms, sql};

/// Whether a lease that had to wait for a previous holder's stop may start its command now.
#[derive(Debug)]
pub enum Gate {
    /// Nobody is stopping any more: marked busy (or kept idle, for `acquire`).
    Go,
    /// A previous holder is still stopping: who, its fence, and how long it may still take at
    /// most (its own deadline).
    Wait {
        who: String,
        fence: i64,
        left: Duration,
    },
    /// The lease is no longer ours: taken, released or expired.
    Lost,
}

/// After a `--replace` (or any acquisition of a place whose last holder is still stopping): marks
/// the lease busy (`busy`; `acquire` keeps it idle) once no previous holder is stopping on the
/// place — or, for the single holder's place 0, on any place of the target, and for another
/// place, on place 0. One statement, so a stop recorded and a lease lost are both seen as of now.
pub async fn gate(client: &Client, schema: &Schema, lease: &Lease, busy: bool) -> Result<Gate> {
    let sql = sql(
        schema,
        "WITH blocking AS (
             SELECT l.stopping_host, l.stopping_pid, l.stopping_fence,
                    {stopping_left_ms} AS left_ms
               FROM {s}.leases l
              WHERE l.target = $1 AND (l.place = $2 OR l.place = 0 OR $2 = 0) AND {stopping}
              ORDER BY l.stopping_until DESC LIMIT 1
         ), go AS (
             UPDATE {s}.leases l SET idle_token = CASE WHEN $4 THEN NULL ELSE l.token END
              WHERE l.target = $1 AND l.place = $2 AND l.token = $3 AND NOT {expired}
                AND NOT EXISTS (SELECT 1 FROM blocking)
             RETURNING 1
         )
         SELECT (SELECT count(*) FROM go) AS went,
                EXISTS (SELECT 1 FROM {s}.leases l
                         WHERE l.target = $1 AND l.place = $2 AND l.token = $3
                           AND NOT {expired}) AS held,
                b.stopping_host, b.stopping_pid, b.stopping_fence, b.left_ms
           FROM (SELECT 1) one LEFT JOIN blocking b ON true",
    );
    let row = client
        .query_typed_one(
            &sql,
            &[
                (&lease.target, Type::TEXT),
                (&lease.place, Type::INT4),
                (&lease.token, Type::UUID),
                (&busy, Type::BOOL),
            ],
        )
        .await
        .context("cannot check whether the previous holder has stopped")?;
    if row.get::<_, i64>("went") == 1 {
        return Ok(Gate::Go);
    }
    if !row.get::<_, bool>("held") {
        return Ok(Gate::Lost);
    }
    Ok(match row.get::<_, Option<i64>>("left_ms") {
        Some(left_ms) => Gate::Wait {
            who: who(row.get("stopping_host"), row.get("stopping_pid"), None),
            fence: row.get::<_, Option<i64>>("stopping_fence").unwrap_or(0),
            left: crate::fmt::millis(left_ms),
        },
        // The stop was confirmed between the two looks: ask again.
        None => Gate::Wait {
            who: "the previous holder".into(),
            fence: 0,
            left: Duration::ZERO,
        },
    })
}

/// What [`adopt`] found.
#[derive(Debug)]
pub enum Adopted {
    /// Taken up for this step, with the TTL the lease was taken with.
    Held(Lease, Duration),
    /// Another step of the lease is running: `host pid N`. Steps of one lease run one at a time.
    StepRunning(String),
    /// The token does not hold a live lease of the target (taken over, released, or expired
    /// since the last renewal).
    NotHeld,
}

/// `run --token`: takes up a lease held by `acquire` for one step — renews it, marks it busy and
/// names this process as its holder — only while the token holds it, it has not expired on the
/// database clock, and no other step runs under it (the lease is idle).
pub async fn adopt(
    client: &Client,
    schema: &Schema,
    target: &str,
    token: Uuid,
    (host, pid): (&str, i32),
) -> Result<Adopted> {
    let sql = sql(
        schema,
        "WITH cur AS (
             SELECT l.holder_host, l.holder_pid,
                    l.idle_token IS NOT DISTINCT FROM l.token AS idle
               FROM {s}.leases l
              WHERE l.target = $1 AND l.token = $2 AND NOT {expired}
         ), up AS (
             UPDATE {s}.leases l
                SET heartbeat_at = now(), idle_token = NULL, holder_host = $3, holder_pid = $4
              WHERE l.target = $1 AND l.token = $2 AND NOT {expired} AND l.idle_token = l.token
             RETURNING l.fence, l.place, l.ttl_ms, l.holder_label, now() AS granted_at
         )
         SELECT up.fence, up.place, up.ttl_ms, up.holder_label, up.granted_at,
                cur.holder_host, cur.holder_pid, cur.idle
           FROM (SELECT 1) one LEFT JOIN up ON true LEFT JOIN cur ON true",
    );
    let row = client
        .query_typed_one(
            &sql,
            &[
                (&target, Type::TEXT),
                (&token, Type::UUID),
                (&host, Type::TEXT),
                (&pid, Type::INT4),
            ],
        )
        .await
        .context("cannot take up the lease")?;
    if let Some(fence) = row.get::<_, Option<i64>>("fence") {
        let lease = Lease {
            target: target.to_owned(),
            token,
            fence,
            granted_at: row.get("granted_at"),
            label: row.get("holder_label"),
            place: row.get("place"),
            keep: true,
            replaced: None,
            wait_for_stop: false,
        };
        return Ok(Adopted::Held(lease, crate::fmt::millis(row.get("ttl_ms"))));
    }
    Ok(match row.get::<_, Option<bool>>("idle") {
        Some(false) => {
            Adopted::StepRunning(who(row.get("holder_host"), row.get("holder_pid"), None))
        }
        // Idle in the snapshot but not for the update: a step took it up at this very moment.
        Some(true) => Adopted::StepRunning("another step".into()),
        None => Adopted::NotHeld,
    })
}

/// `acquire`, once it holds the lease: renews it and marks it idle — no command runs under it
/// until a `run --token` step takes it up. `false` when the token no longer holds it.
pub async fn set_idle(client: &Client, schema: &Schema, lease: &Lease) -> Result<bool> {
    let sql = sql(
        schema,
        "UPDATE {s}.leases l SET heartbeat_at = now(), idle_token = l.token
          WHERE l.target = $1 AND l.token = $2 AND NOT {expired}",
    );
    let n = client
        .execute_typed(
            &sql,
            &[(&lease.target, Type::TEXT), (&lease.token, Type::UUID)],
        )
        .await
        .context("cannot hand out the lease")?;
    Ok(n == 1)
}

/// `renew`: extends a lease held by `token` (by its TTL, or `ttl` from now on). `None` when the
/// token does not hold a live lease of the target. Returns the fence and the TTL in force.
pub async fn renew(
    client: &Client,
    schema: &Schema,
    target: &str,
    token: Uuid,
    ttl: Option<Duration>,
) -> Result<Option<(i64, Duration)>> {
    let sql = sql(
        schema,
        "UPDATE {s}.leases l SET heartbeat_at = now(), ttl_ms = coalesce($3, l.ttl_ms)
          WHERE l.target = $1 AND l.token = $2 AND NOT {expired}
         RETURNING l.fence, l.ttl_ms",
    );
    let ttl = ttl.map(ms);
    let rows = client
        .query_typed(
            &sql,
            &[
                (&target, Type::TEXT),
                (&token, Type::UUID),
                (&ttl, Type::INT8),
            ],
        )
        .await
        .context("cannot renew the lease")?;
    Ok(rows
        .first()
        .map(|r| (r.get("fence"), crate::fmt::millis(r.get("ttl_ms")))))
}

/// Renews the lease — only while it has not expired on the database clock as the statement runs:
/// a heartbeat that reaches the database late (a black-holed connection delivering it after
/// the TTL) must not revive a lease whose holder already counts as gone. `Ok(false)` means the
/// lease was lost (expired, taken over or force-released), and the holder must stop at once.
pub async fn heartbeat(
    client: &Client,
    schema: &Schema,
    lease: &Lease,
) -> Result<bool, tokio_postgres::Error> {
    let sql = sql(
        schema,
        "UPDATE {s}.leases l SET heartbeat_at = now()
          WHERE l.target = $1 AND l.token = $2 AND NOT {expired}",
    );
    let n = client
        .execute_typed(
            &sql,
            &[(&lease.target, Type::TEXT), (&lease.token, Type::UUID)],
        )
        .await?;
    Ok(n == 1)
}

/// The holder's own release, once nothing of its command runs any more (or it never started):
/// frees the place if the token still holds it (live or expired: nobody took it), confirms the
/// stop if the lease was taken from it meanwhile (a forced release or `--replace`: see
/// migrations/0011_stopping.sql), and wakes waiters. Returns whether the token held the place.
pub async fn release(client: &Client, schema: &Schema, lease: &Lease) -> Result<bool> {
    let sql = schema.sql(
        "WITH old AS (
             SELECT place, token = $2 AS mine FROM {s}.leases
              WHERE target = $1 AND (token = $2 OR stopping_token = $2) FOR UPDATE
         )
         UPDATE {s}.leases l
            SET token = CASE WHEN old.mine THEN NULL ELSE l.token END,
                holder_host = CASE WHEN old.mine THEN NULL ELSE l.holder_host END,
                holder_pid = CASE WHEN old.mine THEN NULL ELSE l.holder_pid END,
                holder_label = CASE WHEN old.mine THEN NULL ELSE l.holder_label END,
                idle_token = CASE WHEN old.mine THEN NULL ELSE l.idle_token END,
                stopping_token = CASE WHEN l.stopping_token = $2 THEN NULL
                                      ELSE l.stopping_token END
           FROM old WHERE l.target = $1 AND l.place = old.place
         RETURNING old.mine, pg_notify($3, l.target)",
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
    Ok(rows.iter().any(|r| r.get::<_, bool>("mine")))
}

/// What `release --token` found.
#[derive(Debug)]
pub struct Released {
    /// The lease had expired (nobody took it).
    pub expired: bool,
    /// A step was running under it: its holder, who is stopping now (it learns at once, or at
    /// its next heartbeat) and may run until its own deadline at most.
    pub stopping: Option<Holder>,
}

/// `release --token`: releases the place of `target` that `token` holds (live or expired: nobody
/// took it) and wakes waiters. If a step runs under it, that step's holder is recorded as
/// stopping, so nobody starts a command on the place before it has stopped (see
/// migrations/0011_stopping.sql). `None` when the token holds no place.
pub async fn release_token(
    client: &Client,
    schema: &Schema,
    target: &str,
    token: Uuid,
) -> Result<Option<Released>> {
    let sql = sql(
        schema,
        &format!(
            "WITH old AS (
                 {OLD_HOLDER} AND l.token = $2 FOR UPDATE
             )
             UPDATE {{s}}.leases l SET {FREE_PLACE}
               FROM old WHERE l.target = old.target AND l.place = old.place
             RETURNING NOT old.live AS expired, old.running, old.holder_host, old.holder_pid,
                       old.holder_label, old.fence, old.ttl_ms, old.age_ms, old.running_ms,
                       pg_notify($3, l.target)"
        ),
    );
    let channel = schema.lease_channel();
    let rows = client
        .query_typed(
            &sql,
            &[
                (&target, Type::TEXT),
                (&token, Type::UUID),
                (&channel, Type::TEXT),
            ],
        )
        .await
        .context("cannot release the lease")?;
    Ok(rows.first().map(|r| Released {
        expired: r.get("expired"),
        stopping: r.get::<_, bool>("running").then(|| holder_from_row(r)),
    }))
}

/// The holders of `target` (alias `l`, the rows to free), as [`FREE_PLACE`] and the callers need
/// them: `running` is a live holder whose command may still run (not an idle lease between
/// steps), `deadline` its last heartbeat plus its TTL. Continued with `AND …` conditions.
const OLD_HOLDER: &str = "SELECT l.target, l.place, l.token, l.holder_host, l.holder_pid,
                    l.holder_label, l.fence, l.ttl_ms, {heartbeat_age_ms} AS age_ms,
                    {running_ms} AS running_ms, NOT {expired} AS live,
                    l.idle_token IS NOT DISTINCT FROM l.token AS idle,
                    NOT {expired} AND l.idle_token IS DISTINCT FROM l.token AS running,
                    l.heartbeat_at + l.ttl_ms * interval '1 millisecond' AS deadline
               FROM {s}.leases l WHERE l.target = $1";

/// The `SET` of a release from outside (`release --force`, `release --token`) for the row of
/// `old` ([`OLD_HOLDER`]): the place is freed, and a holder whose command may still run is
/// recorded as stopping until it confirms or its deadline passes. A stop already recorded (an
/// idle replacement waiting for it) stays.
const FREE_PLACE: &str = "token = NULL, holder_host = NULL, holder_pid = NULL,
                    holder_label = NULL, idle_token = NULL,
                    stopping_token = CASE WHEN old.running THEN old.token
                                          ELSE l.stopping_token END,
                    stopping_until = CASE WHEN old.running THEN old.deadline
                                          ELSE l.stopping_until END,
                    stopping_host = CASE WHEN old.running THEN old.holder_host
                                         ELSE l.stopping_host END,
                    stopping_pid = CASE WHEN old.running THEN old.holder_pid
                                        ELSE l.stopping_pid END,
                    stopping_fence = CASE WHEN old.running THEN old.fence
                                          ELSE l.stopping_fence END";

/// Operator override: frees `target` whoever holds it — every place, with `--max-holders`.
/// Returns the holders it had, by place, and whether each was idle (an `acquire`d lease between
/// steps: nothing runs). A holder whose command may still run is recorded as stopping: the place
/// stays taken for everyone until it confirmed its stop or its deadline passed. The fence is
/// kept, so the next acquisition is still numbered higher. One statement, so the holders
/// reported are the ones actually released.
pub async fn force_release(
    client: &Client,
    schema: &Schema,
    target: &str,
) -> Result<Vec<(Holder, bool)>> {
    let sql = sql(
        schema,
        &format!(
            "WITH old AS (
                 {OLD_HOLDER} AND l.token IS NOT NULL FOR UPDATE
             )
             UPDATE {{s}}.leases l SET {FREE_PLACE}
               FROM old WHERE l.target = old.target AND l.place = old.place
             RETURNING old.place, old.holder_host, old.holder_pid, old.holder_label, old.fence,
                       old.ttl_ms, old.age_ms, old.running_ms, old.idle,
                       pg_notify($2, l.target)"
        ),
    );
    let channel = schema.lease_channel();
    let rows = client
        .query_typed(&sql, &[(&target, Type::TEXT), (&channel, Type::TEXT)])
        .await
        .context("cannot release the lease")?;
    let mut holders: Vec<(i32, Holder, bool)> = rows
        .iter()
        .map(|r| (r.get("place"), holder_from_row(r), r.get("idle")))
        .collect();
    holders.sort_by_key(|(place, ..)| *place);
    Ok(holders.into_iter().map(|(_, h, idle)| (h, idle)).collect())
}
