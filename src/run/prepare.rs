//! From connecting to holding the lease, up to the moment the command may be spawned: the
//! connection (a waiter waits out a database it cannot reach yet), and between acquiring and
//! spawning the checks under the lease's own deadline (`--reuse-within`, `--slot`), or why the
//! command was not started in time.

use std::time::Duration;

use anyhow::Result;
use tokio::time::{sleep_until, timeout, Instant};
use uuid::Uuid;

use super::heartbeat::Heartbeat;
use super::wait::{self, Resume};
use super::{
    bounded, is_unavailable, new_record, print_stdout, release_within, Me, STATEMENT_DEADLINE,
};
use crate::cli::DbArgs;
use crate::config::RunConfig;
use crate::db::Db;
use crate::exit::{Exit, Failure};
use crate::heap::on_heap;
use crate::model::flags::Wait;
use crate::model::slot::Slot;
use crate::model::time::deadline;
use crate::signals::Signals;
use crate::store;
use crate::store::leases::{DbClock, Lease};
use crate::store::runs::{self, Outcome, RunRecord, SlotCheck};

/// The start of `run` and `acquire`: signals handled, connected (a waiter waits out a database
/// it cannot reach yet), and when `--wait=DUR` gives up. `Err(exit)`: a signal came first.
pub(super) struct Started {
    pub(super) signals: Signals,
    pub(super) db: Db,
    pub(super) give_up_at: Option<Instant>,
}

/// `unchecked`: the schema check is left to the caller's first transaction (see
/// [`crate::db::first`]) or its own [`crate::db::deadline::check_schema`].
pub(super) async fn start(
    db_args: &DbArgs,
    cfg: &RunConfig,
    unchecked: bool,
) -> Result<Result<Started, Exit>> {
    let mut signals = Signals::install()?;
    let started = Instant::now();
    // `--wait=DUR` counts from the start, across connecting and every attempt.
    let give_up_at = match cfg.wait {
        Some(Wait::Upto(d)) => Some(deadline(started, d)),
        _ => None,
    };
    let db = tokio::select! {
        db = on_heap(|| connect(db_args, cfg, give_up_at, unchecked)) => match db? {
            Some(db) => db,
            None => return Ok(Err(Exit::Busy(cfg.busy_exit_code))),
        },
        sig = signals.recv() => return Ok(Err(Exit::from_signal(sig))),
    };
    Ok(Ok(Started {
        signals,
        db,
        give_up_at,
    }))
}

/// How long the release of a lease whose command was not started may take: it is best-effort
/// (the lease expires by its TTL otherwise), and the caller is about to exit or wait again.
pub(super) const RELEASE_QUICKLY: Duration = Duration::from_millis(500);

/// A waiter whose lease could not be started in time: its place in the queue is taken again
/// (the acquisition had removed it) before the lease is released, so that no waiter behind it
/// can slip in between — unless it was away longer than a waiter's TTL, after which a waiter
/// that stopped answering has lost its place anyway.
pub(super) async fn keep_place(
    db: &mut Db,
    cfg: &RunConfig,
    me: &Me,
    granted: &wait::Granted,
) -> Resume {
    let ticket = granted
        .ticket
        .filter(|_| granted.sent.elapsed() < wait::waiter_ttl(cfg.ttl));
    let mut resume = Resume::default();
    if let Some(t) = ticket {
        let who = (me.host.as_str(), me.pid, cfg.label.as_deref());
        let join = store::waiters::join(
            &db.client,
            &db.schema,
            &cfg.target,
            (t.mode, Some(t.number)),
            wait::waiter_ttl(cfg.ttl),
            who,
        );
        match bounded(Instant::now() + STATEMENT_DEADLINE, join).await {
            Ok(t) => {
                info!(
                    "kept our place in the queue for '{}' (ticket {})",
                    cfg.target, t.number
                );
                resume.ticket = Some(t);
            }
            // Joined again at the first attempt that gets through.
            Err(e) => {
                info!("cannot take our place in the queue again yet ({e:#})");
                resume.again = Some(t);
            }
        }
    }
    release_within(db, &granted.lease, Instant::now() + RELEASE_QUICKLY).await;
    if resume.again.is_some() {
        if let Ok(Err(e)) = timeout(STATEMENT_DEADLINE, db.reconnect()).await {
            info!("reconnect failed: {e:#}");
        }
    }
    resume
}

/// The command could not be started in time to be stopped before the lease could expire.
pub(super) fn too_late(why: String, silent_db: bool) -> Result<Exit> {
    let why = format!("{why}; the command was not started");
    if silent_db {
        return Err(Failure::Unavailable(why).into());
    }
    say!("{why}");
    Ok(Exit::LeaseLost)
}

/// How long a waiter's first connection (with the schema check) may take, however short its
/// `--wait`: `--wait=0s` still tries once, and a schema's first use migrates it.
const FIRST_CONNECT: Duration = Duration::from_secs(2);

/// Connects (and checks the schema). A waiter (`--wait`) also waits out a database it cannot
/// reach yet — down, restarting, or out of connections (`too many clients`, when many callers
/// wait at once) — retrying with backoff until its `--wait` limit (`give_up_at`) is spent, as it
/// does once connected; `None` then, having said so with the last error. Each attempt is bounded
/// by the limit too, and the last one is made at it.
async fn connect(
    db_args: &DbArgs,
    cfg: &RunConfig,
    give_up_at: Option<Instant>,
    unchecked: bool,
) -> Result<Option<Db>> {
    let open = || {
        let (url, schema) = (db_args.database_url.as_deref(), db_args.schema.as_str());
        async move {
            if unchecked {
                crate::db::deadline::connect_unchecked(url, schema).await
            } else {
                crate::db::deadline::connect(url, schema).await
            }
        }
    };
    if cfg.wait.is_none() {
        return open().await.map(Some);
    }
    let started = Instant::now();
    let mut backoff = Duration::from_millis(200);
    let mut warned = false;
    loop {
        // The first attempt is made however short the limit; later ones only within it.
        let limit = give_up_at.map(|g| g.max(started + FIRST_CONNECT));
        let attempt = open();
        let e = match limit {
            Some(l) => match tokio::time::timeout_at(l, attempt).await {
                Ok(r) => r,
                Err(_) => Err(Failure::Unavailable(
                    "no connection within the time --wait had left".into(),
                )
                .into()),
            },
            None => attempt.await,
        };
        let e = match e {
            Ok(db) => return Ok(Some(db)),
            // A refusal of *us* (bad password, unknown role or database) will not go away.
            Err(e) if is_unavailable(&e) && !refused(&e) => e,
            Err(e) => return Err(e),
        };
        let now = Instant::now();
        if limit.is_some_and(|l| now >= l) {
            if !cfg.quiet {
                let waited = match cfg.wait {
                    Some(Wait::Upto(d)) => d,
                    _ => started.elapsed(),
                };
                say!(
                    "gave up waiting for '{}' after {}: cannot reach the database ({e:#})",
                    cfg.target,
                    crate::fmt::duration(waited)
                );
            }
            return Ok(None);
        }
        if !warned {
            warn!(
                "cannot reach the database yet ({e:#}); retrying while waiting for '{}'",
                cfg.target
            );
            warned = true;
        } else {
            info!("still cannot reach the database ({e:#})");
        }
        let next = now + backoff;
        sleep_until(limit.map_or(next, |l| next.min(l))).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// Whether the server refused us (see [`Failure::Refused`]).
fn refused(e: &anyhow::Error) -> bool {
    e.chain()
        .any(|c| matches!(c.downcast_ref::<Failure>(), Some(Failure::Refused(_))))
}

/// What to do once the lease is acquired.
pub(super) enum Prepared {
    /// Start the command (in this slot, with `--slot`).
    Spawn(Option<Slot>),
    /// Do not run: a fresh result was printed, the slot was done, or a signal arrived.
    Done(Exit),
    /// The command could not be started in time to be stopped before the lease could expire:
    /// the database did not confirm the lease in time (`silent_db`), or the deadline passed
    /// anyway (leasectl was paused?).
    TooLate { why: String, silent_db: bool },
}

/// What [`prepare`]'s statement found.
enum Check {
    /// Nothing against running (in this slot, with `--slot`).
    Go(Option<Slot>),
    /// `--reuse-within`: a fresh result to print instead.
    Reuse(runs::Reusable),
    /// `--slot`: the slot was done; the skip is recorded and the lease released.
    SlotDone(Slot, Uuid),
    /// `--slot`: the lease was no longer ours.
    NotOwner,
}

/// Between acquiring and spawning: forget the releases announced while we waited and, with
/// `--reuse-within`, look once more for a result that was stored while we acquired; with
/// `--slot`, find the slot and skip it if it was already done.
///
/// The lease was confirmed when the acquiring statement was sent; the heartbeat schedule's
/// `stop_at` is the last moment at which a command spawned now could still be stopped before
/// the lease can expire. Every statement here is bounded by it, a signal ends the wait, and it
/// is checked once more right before returning: a command is never started on a lease that
/// may already be someone else's. When the acquisition was answered too late for that (the
/// statement may have reached the database late, as after a black-holed connection, and then
/// the lease is fresh), one heartbeat outside the schedule confirms the lease first: it
/// succeeds only on a lease that has not expired, and the budget counts from it.
///
/// When the command is not started because it is done (reuse, a done slot) or a signal came,
/// the lease is released (best-effort); when it is too late, the caller decides
/// ([`Prepared::TooLate`]).
pub(super) async fn prepare(
    db: &mut Db,
    cfg: &RunConfig,
    me: &Me,
    lease: &Lease,
    hb: &mut Heartbeat<'_>,
    (clock, (sent, answered)): (DbClock, (Instant, Instant)),
    signals: &mut Signals,
) -> Result<Prepared> {
    let late = |hb: &Heartbeat<'_>| Instant::now() + CONFIRM_AHEAD >= hb.stop_at();
    if late(hb) {
        if let Some(too_late) = confirm(db, cfg, hb, (sent, answered)).await {
            return Ok(too_late);
        }
    }
    let until = hb.stop_at();
    let checks = async {
        // Releases announced while we waited are old news; the heartbeat keeps listening
        // for the next one (a `release --force` of our own target).
        while db.notifications.try_recv().is_ok() {}
        if let Some(within) = cfg.reuse_within {
            // A run may have finished between our reuse check and the acquisition.
            let found = runs::reusable(&db.client, &db.schema, &cfg.target, within);
            return Ok(match bounded(until, found).await? {
                Some(r) => Check::Reuse(r),
                None => Check::Go(None),
            });
        }
        match &cfg.slot {
            Some(sc) => check_slot(db, cfg, me, lease, clock, sc, until).await,
            None => Ok(Check::Go(None)),
        }
    };
    let checked = tokio::select! {
        // A signal already received wins over checks that happen to be done: the command
        // must not start after leasectl was told to stop.
        biased;
        sig = signals.recv() => Err(sig),
        r = checks => Ok(r),
    };
    let prepared = match checked {
        Err(sig) => Prepared::Done(Exit::from_signal(sig)),
        Ok(Ok(Check::Reuse(r))) => {
            print_stdout(cfg, &r.stdout)?;
            Prepared::Done(Exit::Code(0))
        }
        // Skipped and released in one statement: nothing left to release.
        Ok(Ok(Check::SlotDone(slot, by))) => {
            info!(
                "the slot {} of '{}' was done by run {by}; skipped",
                crate::fmt::rfc3339(slot.start),
                cfg.target
            );
            let code = cfg.slot.as_ref().map_or(0, |s| s.done_exit_code);
            return Ok(Prepared::Done(Exit::Code(code)));
        }
        Ok(Ok(Check::NotOwner)) => {
            return Ok(Prepared::TooLate {
                why: format!(
                    "the lease on '{}' was taken over before the command could be started",
                    cfg.target
                ),
                silent_db: false,
            })
        }
        Ok(Ok(Check::Go(slot))) => {
            if late(hb) {
                if let Some(too_late) = confirm(db, cfg, hb, (sent, answered)).await {
                    return Ok(too_late);
                }
            }
            return Ok(Prepared::Spawn(slot));
        }
        // The connection may be stuck behind the unanswered statement; the caller's release
        // is tried anyway, and otherwise the lease expires by its TTL.
        Ok(Err(e)) => {
            return Ok(Prepared::TooLate {
                why: format!(
                    "'{}' was acquired, but the database did not confirm it in time ({e:#})",
                    cfg.target
                ),
                silent_db: true,
            })
        }
    };
    release_within(db, lease, until).await;
    Ok(prepared)
}

/// How much of the stop budget must be left to start the command without confirming the lease
/// first: a spawn takes a few milliseconds, and the heartbeat schedule needs a moment to begin.
const CONFIRM_AHEAD: Duration = Duration::from_millis(50);

/// Confirms a lease whose stop budget ran out before the command could start (see [`prepare`]).
/// `None`: renewed, go on. Otherwise why not, naming what was slow: the database's answer to
/// the acquisition (`sent` → `answered`) or leasectl itself (paused or starved after it).
async fn confirm(
    db: &Db,
    cfg: &RunConfig,
    hb: &mut Heartbeat<'_>,
    (sent, answered): (Instant, Instant),
) -> Option<Prepared> {
    let limit = cfg.ttl.min(STATEMENT_DEADLINE);
    let slow = match answered.saturating_duration_since(sent) {
        d if d >= hb.budget() => format!(
            "the database answered the acquisition only after {} (ttl {})",
            crate::fmt::duration(d),
            crate::fmt::duration(cfg.ttl)
        ),
        _ => format!(
            "leasectl itself was held up for {} after the acquisition (paused, or starved of CPU)",
            crate::fmt::duration(answered.elapsed())
        ),
    };
    match hb.confirm(db, limit).await {
        Ok(true) => {
            info!(
                "{slow}; the lease on '{}' is confirmed, starting",
                cfg.target
            );
            None
        }
        Ok(false) => Some(Prepared::TooLate {
            why: format!(
                "{slow}, and the lease on '{}' had expired or been taken by then",
                cfg.target
            ),
            silent_db: false,
        }),
        Err(e) => Some(Prepared::TooLate {
            why: format!(
                "{slow}, and the database did not confirm the lease on '{}' in time ({e})",
                cfg.target
            ),
            silent_db: true,
        }),
    }
}

/// `--slot`: the slot of the acquisition, on the database's clock (the instant it granted the
/// lease: hosts' clocks never enter), and under the lease the check whether a run already did
/// it, which records the skip if so.
async fn check_slot(
    db: &Db,
    cfg: &RunConfig,
    me: &Me,
    lease: &Lease,
    clock: DbClock,
    sc: &crate::config::SlotConfig,
    until: Instant,
) -> Result<Check> {
    let Some(slot) = sc.schedule.slot_at(lease.granted_at, sc.skew) else {
        return Err(crate::error::usage(format!(
            "the schedule '{}' has no slot at {}",
            sc.schedule.expr,
            crate::fmt::rfc3339(lease.granted_at)
        )));
    };
    let now = clock.at(Instant::now());
    let skip = RunRecord {
        id: Uuid::new_v4(),
        ..new_record(cfg, me, Outcome::Skipped, None, (now, now), Some(slot))
    };
    let schedule = (sc.schedule.expr.as_str(), sc.schedule.zone.as_deref());
    let checked = runs::skip_if_done(
        &db.client,
        &db.schema,
        lease,
        &skip,
        me.run,
        schedule,
        sc.until_success,
    );
    Ok(match bounded(until, checked).await? {
        SlotCheck::Open => Check::Go(Some(slot)),
        SlotCheck::Done { by } => Check::SlotDone(slot, by),
        SlotCheck::NotOwner => Check::NotOwner,
    })
}
