//! Taking a place: the acquiring statements. The single holder's one-statement upsert (with or
//! without a place in the `--wait` queue), a place of `--max-holders` N under the target's lock,
//! and `--replace`, which takes a place even from a live holder and records it as stopping.
//! Every one of them judges expiry on the database clock and re-checks against the committed
//! winner, so exactly one of any number of racers gets a place.

use anyhow::{Context, Result};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row};
use uuid::Uuid;

use super::{Acquired, Contender, Lease, Replaced};
use crate::db::Schema;
use crate::store::holder::holder_from_row;
use crate::store::waiters::{self, Ticket};
use crate::store::{ms, sql};

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
///
/// A new fence's floor (`{fence_floor}`, the server's timeline) is computed once, for the
/// proposed row; the update of an existing lease takes it from there (`excluded.fence`), so a
/// fresh server process looks up and plans that expression once, not twice.
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
            SET token = excluded.token, fence = greatest(l.fence + 1, excluded.fence),
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
                    SET token = excluded.token, fence = greatest(l.fence + 1, excluded.fence),
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
