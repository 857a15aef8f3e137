//! The `leases` table: the heartbeat lease, as plain SQL judged by the database clock.
//!
//! One row per target (`leases`). Every transition is one statement whose WHERE names the
//! holder's token, so a holder that was taken over or force-released touches 0 rows — and that
//! *is* how it learns it lost (river's `river_leader.sql` works the same way). Expiry is always
//! `heartbeat_at + ttl_ms < now()` on the server (`super::EXPIRED`): the holder's own TTL,
//! the database's clock.
//!
//! Statements use `query_typed`, which skips the separate prepare round trip; most of a short
//! `leasectl run` is round trips.

use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row};
use uuid::Uuid;

use super::holder::{holder_from_row, who, Holder};
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
    /// The row: 0 for the single holder, 1…N for one of `--max-holders` N.
    pub place: i32,
    /// The lease outlives this run: taken by `acquire`, used by `run --token`. Its save keeps
    /// the lease (renewed, and marked idle) instead of releasing it, and nothing else releases
    /// it either: that is `release --token`'s job, or its TTL's.
    pub keep: bool,
    /// The holder this lease was taken from by `--replace`.
    pub replaced: Option<Replaced>,
    /// A previous holder of the place may still be stopping its command (the one `--replace`
    /// took it from, or an earlier one): nothing may be started before [`gate`] says so.
    pub wait_for_stop: bool,
}

/// The holder a `--replace` took a lease from.
#[derive(Debug, Clone)]
pub struct Replaced {
    /// `host pid N [label]`.
    pub who: String,
    pub fence: i64,
    /// It ran no command (an `acquire`d lease between steps, or a replacement that was still
    /// waiting itself): nothing of its own to wait for.
    pub idle: bool,
}

impl Lease {
    /// `LEASECTL_HOLDER_INDEX`: 0…N−1.
    pub fn holder_index(&self) -> i32 {
        (self.place - 1).max(0)
    }
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

pub enum Acquired {
    Held(Lease),
    /// Someone else holds it, or waiters go first: the holder and the queue.
    Busy(Busy),
    /// The target's holders have another `--max-holders` (this N stands until no place is
    /// held).
    Mismatch {
        in_force: i32,
    },
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
    /// `--max-holders`: 1 for the single holder.
    pub max_holders: i32,
}

/// No live ordered waiter goes before the caller, and the caller's own place (if it has one)
/// is live: the queue's half of "may this caller take the lease now". `$target`, `$ticket`
/// (int8, NULL without a place) and `$ordered` (bool) name the statement's parameters.
fn queue_clear(target: &str, ticket: &str, ordered: &str) -> String {
    format!(
        "(NOT EXISTS (
              SELECT 1 FROM {{s}}.waiters w
               WHERE w.target = {target} AND w.queue <> 'unordered' AND {{live_waiter}}
                 AND NOT (coalesce({ordered}, false) AND w.ticket >= {ticket}))
          AND ({ticket}::int8 IS NULL OR EXISTS (
              SELECT 1 FROM {{s}}.waiters w WHERE w.ticket = {ticket} AND {{live_waiter}})))"
    )
}

/// Takes the lease if it is free or its holder's TTL has run out — and no live ordered waiter
/// goes first — in one statement. With `--max-holders` above 1, takes a free place instead
/// ([`acquire_place`]).
///
/// A concurrent acquirer blocks on the row lock of `ON CONFLICT DO UPDATE` and then re-checks
/// the WHERE against the committed winner, so exactly one of any number of racers gets the row.
///
/// The queue: a caller without a ticket (no `--wait`, or not yet queued) does not get a free
/// lease while a live `fifo`/`latest` waiter may exist (`queued_until`, kept on the lease row so
/// that this, the uncontended `run`, stays one statement on one row); an unordered waiter not
/// while any exists; an ordered waiter only when no such waiter has an earlier ticket, and only
/// while its own row is live and not superseded. The winner's row leaves the queue in the same
/// statement.
///
/// The single holder takes place 0 only while the target's N in force (`max_holders`, on that
/// same row, so the re-check sees a committed change) is 1; otherwise, once no place is held,
/// [`acquire_place`] sets it back under the target's lock.
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
    if who.max_holders > 1 {
        return acquire_place(client, schema, target, who).await;
    }
    let rows = match who.ticket {
        None => acquire_unqueued(client, schema, target, who).await,
        Some(ticket) => acquire_queued(client, schema, target, who, ticket).await,
    }
    .context("cannot acquire the lease")?;
    if let Some(row) = rows.first() {
        return Ok(Acquired::Held(lease_from_row(target, who, 0, row)));
    }
    let busy = waiters::look(client, schema, target, who.ticket).await?;
    match (busy.in_force, busy.holders) {
        (1, _) => Ok(Acquired::Busy(busy)),
        (n, 0) => {
            info!("'{target}' had --max-holders {n} and is idle; taking it as a single holder");
            acquire_place(client, schema, target, who).await
        }
        (n, _) => Ok(Acquired::Mismatch { in_force: n }),
    }
}

/// The caller has no place in the queue: the lease is free or expired and no ordered waiter
/// may exist (`queued_until`, on the same row). This is the uncontended `run`: one statement that
/// reads nothing but the lease row.
async fn acquire_unqueued(
    client: &Client,
    schema: &Schema,
    target: &str,
    who: &Contender<'_>,
) -> Result<Vec<Row>, tokio_postgres::Error> {
    let sql = sql(
        schema,
        "INSERT INTO {s}.leases AS l
                (target, place, token, fence, ttl_ms, heartbeat_at, acquired_at, holder_host,
                 holder_pid, holder_label)
         VALUES ($1, 0, $2, {fence_floor}, $3, now(), now(), $4, $5, $6)
         ON CONFLICT (target, place) DO UPDATE
            SET token = excluded.token, fence = greatest(l.fence + 1, {fence_floor}),
                ttl_ms = excluded.ttl_ms,
                heartbeat_at = now(), acquired_at = now(),
                holder_host = excluded.holder_host, holder_pid = excluded.holder_pid,
                holder_label = excluded.holder_label
          WHERE l.token = excluded.token
             OR (l.max_holders = 1 AND (l.token IS NULL OR {expired}) AND NOT {queued}
                 AND NOT {stopping})
         RETURNING fence, now() AS granted_at",
    );
    let params: [(&(dyn ToSql + Sync), Type); 6] = [
        (&target, Type::TEXT),
        (&who.token, Type::UUID),
        (&ms(who.ttl), Type::INT8),
        (&who.host, Type::TEXT),
        (&who.pid, Type::INT4),
        (&who.label, Type::TEXT),
    ];
    client.query_typed(&sql, &params).await
}

/// A waiter: the lease is free or expired, no live ordered waiter goes first and its own place
/// is live. Its row leaves the queue in the same statement. `queued_until` is left as it is: it
/// only ever says that an ordered waiter *may* exist, and lowering it safely needs the target's
/// lock and a fresh look at the queue ([`waiters::requeue`]), which whoever finds it stale does.
async fn acquire_queued(
    client: &Client,
    schema: &Schema,
    target: &str,
    who: &Contender<'_>,
    ticket: Ticket,
) -> Result<Vec<Row>, tokio_postgres::Error> {
    let sql = sql(
        schema,
        &format!(
            "WITH acquired AS (
                 INSERT INTO {{s}}.leases AS l
                        (target, place, token, fence, ttl_ms, heartbeat_at, acquired_at,
                         holder_host, holder_pid, holder_label)
                 VALUES ($1, 0, $2, {{fence_floor}}, $3, now(), now(), $4, $5, $6)
                 ON CONFLICT (target, place) DO UPDATE
                    SET token = excluded.token, fence = greatest(l.fence + 1, {{fence_floor}}),
                        ttl_ms = excluded.ttl_ms,
                        heartbeat_at = now(), acquired_at = now(),
                        holder_host = excluded.holder_host, holder_pid = excluded.holder_pid,
                        holder_label = excluded.holder_label
                  WHERE l.token = excluded.token
                     OR (l.max_holders = 1 AND (l.token IS NULL OR {{expired}})
                         AND NOT {{stopping}} AND {clear})
                 RETURNING fence, now() AS granted_at
             ), dequeued AS (
                 DELETE FROM {{s}}.waiters WHERE ticket = $7 AND EXISTS (SELECT 1 FROM acquired)
             )
             SELECT fence, granted_at FROM acquired",
            clear = queue_clear("$1", "$7", "$8"),
        ),
    );
    let ordered = ticket.mode.ordered();
    let params: [(&(dyn ToSql + Sync), Type); 8] = [
        (&target, Type::TEXT),
        (&who.token, Type::UUID),
        (&ms(who.ttl), Type::INT8),
        (&who.host, Type::TEXT),
        (&who.pid, Type::INT4),
        (&who.label, Type::TEXT),
        (&ticket.number, Type::INT8),
        (&ordered, Type::BOOL),
    ];
    client.query_typed(&sql, &params).await
}

fn lease_from_row(target: &str, who: &Contender<'_>, place: i32, row: &Row) -> Lease {
    Lease {
        target: target.to_owned(),
        token: who.token,
        fence: row.get("fence"),
        granted_at: row.get("granted_at"),
        label: who.label.map(str::to_owned),
        place,
        keep: false,
        replaced: None,
        wait_for_stop: false,
    }
}

/// What [`claim_place`] decided under the target's lock.
enum Claim {
    Held(Lease),
    Busy,
    Mismatch(i32),
}

/// Takes a place of a target with `--max-holders` N (or, N = 1, place 0 of a target whose N in
/// force must go back to 1), in one transaction that first locks the target's place-0 row.
///
/// Why a transaction and not one statement: choosing a free place and checking the N in force
/// read *other* rows, and a statement that waited for a row lock still reads them as of its
/// start — two acquirers could pick the same place, or hold with different N. Every change of
/// places and of the N in force happens under this lock (the single holder's statement only
/// takes place 0 while the N in force, on that locked row, is 1), and the statements after the
/// lock see everything committed before it. Five round trips; the uncontended single holder
/// never comes here.
pub async fn acquire_place(
    client: &Client,
    schema: &Schema,
    target: &str,
    who: &Contender<'_>,
) -> Result<Acquired> {
    let claimed = claim_place(client, schema, target, who);
    let claim = under_target_lock(client, claimed, |c| matches!(c, Claim::Held(_)))
        .await
        .context("cannot acquire the lease")?;
    Ok(match claim {
        Claim::Held(l) => Acquired::Held(l),
        Claim::Mismatch(n) => Acquired::Mismatch { in_force: n },
        Claim::Busy => Acquired::Busy(waiters::look(client, schema, target, who.ticket).await?),
    })
}

async fn claim_place(
    client: &Client,
    schema: &Schema,
    target: &str,
    who: &Contender<'_>,
) -> Result<Claim> {
    lock_target(client, schema, target, who).await?;
    let number = who.ticket.map(|t| t.number);
    let ordered = who.ticket.map(|t| t.mode.ordered());
    let read = sql(
        schema,
        &format!(
            "SELECT l.place, l.max_holders, l.token = $2 AS mine,
                    l.token IS NOT NULL AND NOT {{expired}} AS live, {{stopping}} AS stopping,
                    {clear} AS clear
               FROM {{s}}.leases l WHERE l.target = $1 ORDER BY l.place",
            clear = queue_clear("$1", "$3", "$4"),
        ),
    );
    let rows = client
        .query_typed(
            &read,
            &[
                (&target, Type::TEXT),
                (&who.token, Type::UUID),
                (&number, Type::INT8),
                (&ordered, Type::BOOL),
            ],
        )
        .await?;
    let live: Vec<i32> = rows
        .iter()
        .filter(|r| r.get::<_, Option<bool>>("live") == Some(true))
        .map(|r| r.get("place"))
        .collect();
    // An attempt of ours that committed after we gave up on it.
    if let Some(r) = rows
        .iter()
        .find(|r| r.get::<_, Option<bool>>("mine") == Some(true) && r.get::<_, bool>("live"))
    {
        let place: i32 = r.get("place");
        let again = schema.sql(
            "SELECT fence, now() AS granted_at FROM {s}.leases WHERE target = $1 AND place = $2",
        );
        let row = client
            .query_typed_one(&again, &[(&target, Type::TEXT), (&place, Type::INT4)])
            .await?;
        return Ok(Claim::Held(lease_from_row(target, who, place, &row)));
    }
    let n = who.max_holders;
    let in_force = rows
        .first()
        .filter(|_| !live.is_empty())
        .map_or(n, |r| r.get("max_holders"));
    if in_force != n {
        return Ok(Claim::Mismatch(in_force));
    }
    if !rows.first().is_some_and(|r| r.get::<_, bool>("clear")) {
        return Ok(Claim::Busy);
    }
    // A place whose last holder is still stopping its command is taken by nobody; the single
    // holder's place 0 excludes every other place, and every other place excludes place 0.
    let stopping: Vec<i32> = rows
        .iter()
        .filter(|r| r.get::<_, bool>("stopping"))
        .map(|r| r.get("place"))
        .collect();
    let place = if n == 1 {
        Some(0).filter(|_| live.is_empty() && stopping.is_empty())
    } else if stopping.contains(&0) {
        None
    } else {
        (1..=n).find(|p| !live.contains(p) && !stopping.contains(p))
    };
    let Some(place) = place else {
        return Ok(Claim::Busy);
    };
    // Place 0 counts the fences of every place. Tokens left on rows that are not live (expired
    // holders of the other mode) are cleared, so a paused old holder cannot renew them later.
    let claim = sql(
        schema,
        "WITH counter AS (
             UPDATE {s}.leases l
                SET fence = greatest(l.fence + 1, {fence_floor}), max_holders = $8,
                    token = CASE WHEN $9 = 0 THEN $2 END,
                    ttl_ms = CASE WHEN $9 = 0 THEN $3 ELSE l.ttl_ms END,
                    heartbeat_at = now(), acquired_at = now(),
                    holder_host = CASE WHEN $9 = 0 THEN $4 END,
                    holder_pid = CASE WHEN $9 = 0 THEN $5 END,
                    holder_label = CASE WHEN $9 = 0 THEN $6 END,
                    queued_until = CASE WHEN $7::int8 IS NULL THEN l.queued_until
                                        ELSE {queued_until} END
              WHERE l.target = $1 AND l.place = 0
             RETURNING l.fence
         ), stale AS (
             UPDATE {s}.leases l
                SET token = NULL, holder_host = NULL, holder_pid = NULL, holder_label = NULL
              WHERE l.target = $1 AND l.place NOT IN (0, $9) AND l.token IS NOT NULL
                AND {expired}
         ), placed AS (
             INSERT INTO {s}.leases AS l
                    (target, place, token, fence, ttl_ms, heartbeat_at, acquired_at,
                     holder_host, holder_pid, holder_label, max_holders)
             SELECT $1, $9, $2, counter.fence, $3, now(), now(), $4, $5, $6, $8
               FROM counter WHERE $9 > 0
             ON CONFLICT (target, place) DO UPDATE
                SET token = excluded.token, fence = excluded.fence, ttl_ms = excluded.ttl_ms,
                    heartbeat_at = now(), acquired_at = now(),
                    holder_host = excluded.holder_host, holder_pid = excluded.holder_pid,
                    holder_label = excluded.holder_label, max_holders = excluded.max_holders
         ), dequeued AS (
             DELETE FROM {s}.waiters WHERE ticket = $7
         )
         SELECT fence, now() AS granted_at FROM counter",
    )
    .replace("$TICKET", "$7");
    let row = client
        .query_typed_one(
            &claim,
            &[
                (&target, Type::TEXT),
                (&who.token, Type::UUID),
                (&ms(who.ttl), Type::INT8),
                (&who.host, Type::TEXT),
                (&who.pid, Type::INT4),
                (&who.label, Type::TEXT),
                (&number, Type::INT8),
                (&n, Type::INT4),
                (&place, Type::INT4),
            ],
        )
        .await?;
    Ok(Claim::Held(lease_from_row(target, who, place, &row)))
}

/// `--replace`: takes a place of `target` even from a live holder, in one transaction under the
/// target's lock (place 0's row, as [`acquire_place`] takes it). The place is a free one if there
/// is any (a free lease, or one only waiters queue for: a replacement goes first), otherwise the
/// oldest live holder's. That holder is told at once (NOTIFY on the lease channel) and, finding
/// its token gone, stops its command and records its run `preempted` (the place keeps its token
/// in `preempted_token`). The caller must not start its own command before that holder has
/// recorded its stop or its lease would have expired anyway ([`Lease::replaced`] says until when).
pub async fn replace(
    client: &Client,
    schema: &Schema,
    target: &str,
    who: &Contender<'_>,
) -> Result<Acquired> {
    let taken = take_place(client, schema, target, who);
    under_target_lock(client, taken, |a| matches!(a, Acquired::Held(_)))
        .await
        .context("cannot replace the holder")
}

/// Runs `work` in a transaction — its first statement is [`lock_target`] — and commits it when
/// `keep` says its outcome changed something worth keeping; otherwise (or on error) rolls back.
async fn under_target_lock<T>(
    client: &Client,
    work: impl std::future::Future<Output = Result<T>>,
    keep: impl FnOnce(&T) -> bool,
) -> Result<T> {
    client.batch_execute("BEGIN").await?;
    let done = work.await;
    let end = match &done {
        Ok(t) if keep(t) => "COMMIT",
        _ => "ROLLBACK",
    };
    let ended = client.batch_execute(end).await;
    let done = done?;
    ended?;
    Ok(done)
}

/// The target's row (place 0), created if need be, locked until the end of the transaction:
/// every change of places, of the N in force and every `--replace` happens under it.
async fn lock_target(
    client: &Client,
    schema: &Schema,
    target: &str,
    who: &Contender<'_>,
) -> Result<(), tokio_postgres::Error> {
    let lock = schema.sql(
        "INSERT INTO {s}.leases AS l (target, place, fence, ttl_ms, heartbeat_at, acquired_at)
         VALUES ($1, 0, 0, $2, now(), now())
         ON CONFLICT (target, place) DO UPDATE SET max_holders = l.max_holders",
    );
    client
        .execute_typed(&lock, &[(&target, Type::TEXT), (&ms(who.ttl), Type::INT8)])
        .await?;
    Ok(())
}

async fn take_place(
    client: &Client,
    schema: &Schema,
    target: &str,
    who: &Contender<'_>,
) -> Result<Acquired> {
    lock_target(client, schema, target, who).await?;
    let read = sql(
        schema,
        "SELECT l.place, l.max_holders, l.token, l.fence, l.ttl_ms,
                l.token IS NOT NULL AND NOT {expired} AS live, {stopping} AS stopping,
                l.idle_token IS NOT DISTINCT FROM l.token AS idle,
                l.holder_host, l.holder_pid, l.holder_label,
                {heartbeat_age_ms} AS age_ms, {running_ms} AS running_ms
           FROM {s}.leases l WHERE l.target = $1 ORDER BY l.place",
    );
    let rows = client.query_typed(&read, &[(&target, Type::TEXT)]).await?;
    let live: Vec<&Row> = rows.iter().filter(|r| r.get::<_, bool>("live")).collect();
    let stopping: Vec<i32> = rows
        .iter()
        .filter(|r| r.get::<_, bool>("stopping"))
        .map(|r| r.get("place"))
        .collect();
    let n = who.max_holders;
    let in_force = match (rows.first(), live.is_empty()) {
        (Some(r), false) => r.get("max_holders"),
        _ => n,
    };
    if in_force != n {
        return Ok(Acquired::Mismatch { in_force });
    }
    let held = |p: i32| live.iter().any(|r| r.get::<_, i32>("place") == p);
    // A free place, best one nobody is still stopping on (then nothing to wait for); otherwise
    // one whose last holder is still stopping (the replacement waits for that stop, but stops
    // nobody new); otherwise the oldest live holder's: the one that has run longest.
    let places: Vec<i32> = if n == 1 { vec![0] } else { (1..=n).collect() };
    let free = places
        .iter()
        .copied()
        .filter(|p| !held(*p))
        .min_by_key(|p| stopping.contains(p));
    let victim = match free {
        Some(_) => None,
        None => live
            .iter()
            .filter(|r| n == 1 || r.get::<_, i32>("place") > 0)
            .max_by_key(|r| r.get::<_, i64>("running_ms")),
    };
    let place = match (free, victim) {
        (Some(p), _) => p,
        (None, Some(v)) => v.get("place"),
        (None, None) => unreachable!("a target with no free place has a live holder"),
    };
    let old_token: Option<Uuid> = victim.and_then(|v| v.get("token"));
    // A victim that runs a command is stopping from now on: the place keeps that fact (see
    // migrations/0011_stopping.sql). An idle victim (an `acquire`d lease between steps, or a
    // replacement still waiting for a stop itself) runs nothing, and a stop it was waiting for
    // stays on the place as it is.
    let victim_runs = victim.is_some_and(|v| !v.get::<_, bool>("idle"));
    let wait = victim_runs
        || stopping.contains(&place)
        || (n == 1 && !stopping.is_empty())
        || (n > 1 && stopping.contains(&0));
    // Until it may start, the replacement is marked idle: if it is replaced or force-released
    // in turn, nothing of its own has to be waited for.
    let take = sql(
        schema,
        "WITH counter AS (
             UPDATE {s}.leases l
                SET fence = greatest(l.fence + 1, {fence_floor}), max_holders = $8,
                    token = CASE WHEN $9 = 0 THEN $2 END,
                    ttl_ms = CASE WHEN $9 = 0 THEN $3 ELSE l.ttl_ms END,
                    heartbeat_at = now(), acquired_at = now(),
                    holder_host = CASE WHEN $9 = 0 THEN $4 END,
                    holder_pid = CASE WHEN $9 = 0 THEN $5 END,
                    holder_label = CASE WHEN $9 = 0 THEN $6 END,
                    idle_token = CASE WHEN $9 = 0 AND $11 THEN $2 END,
                    preempted_token = CASE WHEN $9 = 0 THEN coalesce($7, l.preempted_token)
                                           ELSE l.preempted_token END,
                    {take_stop}
              WHERE l.target = $1 AND l.place = 0
             RETURNING l.fence
         ), placed AS (
             INSERT INTO {s}.leases AS l
                    (target, place, token, fence, ttl_ms, heartbeat_at, acquired_at,
                     holder_host, holder_pid, holder_label, max_holders, preempted_token,
                     idle_token)
             SELECT $1, $9, $2, counter.fence, $3, now(), now(), $4, $5, $6, $8, $7,
                    CASE WHEN $11 THEN $2 END
               FROM counter WHERE $9 > 0
             ON CONFLICT (target, place) DO UPDATE
                SET token = excluded.token, fence = excluded.fence, ttl_ms = excluded.ttl_ms,
                    heartbeat_at = now(), acquired_at = now(),
                    holder_host = excluded.holder_host, holder_pid = excluded.holder_pid,
                    holder_label = excluded.holder_label, max_holders = excluded.max_holders,
                    preempted_token = coalesce(excluded.preempted_token, l.preempted_token),
                    idle_token = excluded.idle_token,
                    {take_stop}
         )
         SELECT fence, now() AS granted_at, pg_notify($10, $1) FROM counter"
            .replace("{take_stop}", TAKE_STOP)
            .as_str(),
    );
    let channel = schema.lease_channel();
    let row = client
        .query_typed_one(
            &take,
            &[
                (&target, Type::TEXT),
                (&who.token, Type::UUID),
                (&ms(who.ttl), Type::INT8),
                (&who.host, Type::TEXT),
                (&who.pid, Type::INT4),
                (&who.label, Type::TEXT),
                (&old_token, Type::UUID),
                (&n, Type::INT4),
                (&place, Type::INT4),
                (&channel, Type::TEXT),
                (&wait, Type::BOOL),
                (&victim_runs, Type::BOOL),
            ],
        )
        .await?;
    let mut lease = lease_from_row(target, who, place, &row);
    lease.wait_for_stop = wait;
    lease.replaced = victim.map(|v| {
        let h = holder_from_row(v);
        Replaced {
            who: h.who(),
            fence: h.fence,
            idle: v.get("idle"),
        }
    });
    Ok(Acquired::Held(lease))
}

/// The `SET` items of a `--replace` that record its victim as stopping (`$12`: the victim runs
/// a command), on whichever row the take updates (alias `l`, its values before the update). The
/// row must still hold the victim's token (`$7`): if the victim released meanwhile, its command
/// is done, and if a `release --force` came first, that one has recorded the stop already.
const TAKE_STOP: &str = "stopping_token = CASE WHEN $12 AND l.token = $7 THEN l.token
                                        ELSE l.stopping_token END,
                    stopping_until = CASE WHEN $12 AND l.token = $7
                                          THEN l.heartbeat_at + l.ttl_ms * interval '1 millisecond'
                                          ELSE l.stopping_until END,
                    stopping_host = CASE WHEN $12 AND l.token = $7 THEN l.holder_host
                                         ELSE l.stopping_host END,
                    stopping_pid = CASE WHEN $12 AND l.token = $7 THEN l.holder_pid
                                        ELSE l.stopping_pid END,
                    stopping_fence = CASE WHEN $12 AND l.token = $7 THEN l.fence
                                          ELSE l.stopping_fence END";

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
