//! The run path of `leasectl run`: take the lease, run the command, keep the lease alive,
//! store the result. `wait` gets the lease, [`heartbeat`] keeps it, `child` is the
//! command.
//!
//! The flow, top to bottom in [`run`]:
//!
//! 1. `--reuse-within`: print a fresh stored result and stop.
//! 2. `wait::obtain`: acquire, or with `--wait` sleep until the lease is released (NOTIFY) or due
//!    to expire (polling), sharing the result of the run we waited for when reuse is on.
//! 3. `prepare`: what must happen between acquiring and spawning, each statement bounded by
//!    the lease's own deadline: nothing is spawned unless there is still time to stop it
//!    before the lease could expire. With `--slot`, this is where the slot is computed (on the
//!    database's clock, from the acquisition) and a slot already done is skipped, under the
//!    lease ([`slot`], `store::runs::skip_if_done`).
//! 4. `execute`: spawn the child, then select between "child exited", "lease lost",
//!    "--timeout" and "signal received"; stop the child when needed; store the run and its
//!    event with the fenced save, which also releases the lease.
//!
//! No statement waits on the database without a client-side deadline: a silent server (a hung
//! host, a black-holed connection) must never keep leasectl, or its lease, waiting forever.

mod child;
pub mod events;
mod flags;
pub mod heartbeat;
mod replace;
pub mod slot;
mod steps;
mod wait;

pub use steps::acquire;

use std::future::Future;
use std::time::Duration;

use anyhow::Result;
use nix::sys::signal::Signal;
use tokio::time::{sleep, sleep_until, timeout, Instant};
use uuid::Uuid;

use crate::cli::{DbArgs, RunArgs};
use crate::config::RunConfig;
use crate::db::Db;
use crate::exit::{ChildStatus, Exit, Failure};
use crate::model::flags::Wait;
use crate::model::slot::Slot;
use crate::model::time::deadline;
use crate::process::Capture;
use crate::signals::Signals;
use crate::store;
use crate::store::leases::{self, DbClock, Lease};
use crate::store::runs::{self, Outcome, RunRecord, Saved, SlotCheck};
use child::{Child, Spec};
use events::{EventsFile, JobEvents};
use heartbeat::Heartbeat;
use wait::{obtain, Obtained, Resume};

/// How long one statement may go unanswered before the database counts as unavailable (the
/// server-side `statement_timeout` cannot help when the server, or the path to it, is silent).
pub(crate) const STATEMENT_DEADLINE: Duration = Duration::from_secs(10);

/// How long the best-effort bookkeeping after a lost lease (the `lost` record, the release)
/// may take in all: the command is already stopped, and the exit code must not wait on a
/// database that stopped answering. The TTL, within 1s..5s: a short lease is a request for
/// quick answers.
fn lost_record_deadline(ttl: Duration) -> Duration {
    ttl.clamp(Duration::from_secs(1), Duration::from_secs(5))
}

/// Who we are, as recorded in the lease row and the run.
struct Me {
    host: String,
    pid: i32,
    /// The lease token of every acquisition attempt this process makes (see
    /// [`leases::acquire`]).
    token: Uuid,
    /// The id of the run of this process's command, whatever its outcome (a process runs its
    /// command at most once). Chosen up front so that a `--slot` holder can name it on its lease
    /// row before the run exists: a contender's skip names it in `done_by` (see [`slot`]). A
    /// skip gets an id of its own: nothing names it, and a skip whose commit went unanswered
    /// must not collide with a later record.
    run: Uuid,
}

impl Me {
    fn new() -> Me {
        Me {
            host: nix::unistd::gethostname()
                .map(|h| h.to_string_lossy().into_owned())
                .unwrap_or_else(|_| "unknown".into()),
            pid: std::process::id() as i32,
            token: Uuid::new_v4(),
            run: Uuid::new_v4(),
        }
    }
}

/// The start of `run` and `acquire`: signals handled, connected (a waiter waits out a database
/// it cannot reach yet), and when `--wait=DUR` gives up. `Err(exit)`: a signal came first.
struct Started {
    signals: Signals,
    db: Db,
    give_up_at: Option<Instant>,
}

async fn start(db_args: &DbArgs, cfg: &RunConfig) -> Result<Result<Started, Exit>> {
    let mut signals = Signals::install()?;
    let started = Instant::now();
    // `--wait=DUR` counts from the start, across connecting and every attempt.
    let give_up_at = match cfg.wait {
        Some(Wait::Upto(d)) => Some(deadline(started, d)),
        _ => None,
    };
    let db = tokio::select! {
        db = connect(db_args, cfg, give_up_at) => match db? {
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

pub async fn run(db_args: &DbArgs, args: RunArgs) -> Result<Exit> {
    let cfg = RunConfig::new(args)?;
    let Started {
        mut signals,
        mut db,
        give_up_at,
    } = match start(db_args, &cfg).await? {
        Ok(s) => s,
        Err(exit) => return Ok(exit),
    };
    let me = Me::new();
    if let Some(token) = cfg.token {
        return steps::step(&mut db, cfg, &me, token, &mut signals, give_up_at).await;
    }

    if let Some(within) = cfg.reuse_within {
        let found = tokio::select! {
            r = bounded(Instant::now() + STATEMENT_DEADLINE, runs::reusable(&db.client, &db.schema, &cfg.target, within)) => r?,
            sig = signals.recv() => return Ok(Exit::from_signal(sig)),
        };
        if let Some(r) = found {
            info!("reusing run {} of '{}'", r.id, cfg.target);
            print_stdout(&cfg, &r.stdout)?;
            return Ok(Exit::Code(0));
        }
    }

    // A waiter whose lease could not be started in time keeps its place in the queue.
    let mut resume = Resume::default();
    loop {
        let granted = match obtain(&mut db, &cfg, &me, &mut signals, (give_up_at, resume)).await? {
            Obtained::Lease(g) => g,
            Obtained::Done(exit) => return Ok(exit),
        };
        let (lease, acquired_at) = (&granted.lease, granted.sent);
        info!(
            "acquired '{}' (fence {})",
            lease.target,
            crate::fmt::fence(lease.fence)
        );
        let mut hb = Heartbeat::new(lease, cfg.times(), acquired_at);
        if db.can_listen() {
            hb.watch_releases(granted.listening);
        }
        if let Some(exit) =
            replace::await_stop(&mut db, &cfg, lease, true, &mut hb, &mut signals).await
        {
            return Ok(exit);
        }
        let clock = DbClock {
            db_time: lease.granted_at,
            local: acquired_at,
        };
        let timing = (granted.sent, granted.answered);
        match prepare(
            &mut db,
            &cfg,
            &me,
            lease,
            &mut hb,
            (clock, timing),
            &mut signals,
        )
        .await?
        {
            Prepared::Spawn(slot) => {
                let at = (acquired_at, slot);
                return execute(&mut db, &cfg, &me, lease, hb, at, &mut signals).await;
            }
            Prepared::Done(exit) => return Ok(exit),
            // A waiter waits on: the database (or leasectl) was slow, the lease is not gone
            // for good. The next acquisition gets a fresh lease, with a higher fence — or the
            // same lease again if it is still ours.
            Prepared::TooLate { why, .. } if cfg.wait.is_some() => {
                warn!("{why}; the command was not started; waiting again");
                resume = keep_place(&mut db, &cfg, &me, &granted).await;
            }
            Prepared::TooLate { why, silent_db } => {
                release_within(&db, lease, Instant::now() + RELEASE_QUICKLY).await;
                return too_late(why, silent_db);
            }
        }
    }
}

/// How long the release of a lease whose command was not started may take: it is best-effort
/// (the lease expires by its TTL otherwise), and the caller is about to exit or wait again.
const RELEASE_QUICKLY: Duration = Duration::from_millis(500);

/// A waiter whose lease could not be started in time: its place in the queue is taken again
/// (the acquisition had removed it) before the lease is released, so that no waiter behind it
/// can slip in between — unless it was away longer than a waiter's TTL, after which a waiter
/// that stopped answering has lost its place anyway.
async fn keep_place(db: &mut Db, cfg: &RunConfig, me: &Me, granted: &wait::Granted) -> Resume {
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
fn too_late(why: String, silent_db: bool) -> Result<Exit> {
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
) -> Result<Option<Db>> {
    if cfg.wait.is_none() {
        return crate::db::deadline::connect(db_args.database_url.as_deref(), &db_args.schema)
            .await
            .map(Some);
    }
    let started = Instant::now();
    let mut backoff = Duration::from_millis(200);
    let mut warned = false;
    loop {
        // The first attempt is made however short the limit; later ones only within it.
        let limit = give_up_at.map(|g| g.max(started + FIRST_CONNECT));
        let attempt =
            crate::db::deadline::connect(db_args.database_url.as_deref(), &db_args.schema);
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

/// A run of this caller with no output, error or events yet; `times` are its start and end on
/// the database's clock.
fn new_record<'a>(
    cfg: &RunConfig,
    me: &'a Me,
    outcome: Outcome,
    status: Option<ChildStatus>,
    (started_at, finished_at): (std::time::SystemTime, std::time::SystemTime),
    slot: Option<Slot>,
) -> RunRecord<'a> {
    RunRecord {
        id: me.run,
        outcome,
        status,
        exit_code_override: None,
        argv: argv(cfg),
        host: &me.host,
        pid: me.pid,
        started_at,
        finished_at,
        stdout: &[],
        stderr: &[],
        stdout_truncated: false,
        stderr_truncated: false,
        error: None,
        events_kept: None,
        job_events: None,
        slot,
    }
}

/// Whether the server refused us (see [`Failure::Refused`]).
fn refused(e: &anyhow::Error) -> bool {
    e.chain()
        .any(|c| matches!(c.downcast_ref::<Failure>(), Some(Failure::Refused(_))))
}

/// Runs `what` with a client-side deadline: past `until`, the database counts as unavailable
/// (exit 69) and the connection must be replaced before it is used again, since the statement
/// may still be queued on it.
pub(crate) async fn bounded<T>(until: Instant, what: impl Future<Output = Result<T>>) -> Result<T> {
    match tokio::time::timeout_at(until, what).await {
        Ok(r) => r,
        Err(_) => Err(Failure::Unavailable("the database did not answer in time".into()).into()),
    }
}

/// What to do once the lease is acquired.
enum Prepared {
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
async fn prepare(
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

fn argv(cfg: &RunConfig) -> Vec<String> {
    cfg.command
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect()
}

/// Releases the lease, best-effort, giving up at `until` — unless it outlives the run (a step's,
/// [`Lease::keep`]: `release --token` ends it).
async fn release_within(db: &Db, lease: &Lease, until: Instant) {
    if lease.keep {
        return;
    }
    let until = until.max(Instant::now() + Duration::from_millis(500));
    if let Err(e) = bounded(until, leases::release(&db.client, &db.schema, lease)).await {
        info!(
            "could not release '{}' ({e:#}); it expires with its TTL",
            lease.target
        );
    }
}

fn print_stdout(cfg: &RunConfig, bytes: &[u8]) -> Result<()> {
    if cfg.quiet {
        return Ok(());
    }
    crate::out::print(bytes)
}

/// How the command ended, as the run records it.
struct Ended {
    status: ChildStatus,
    outcome: Outcome,
    exit: Exit,
    /// Why the lease was lost, if it was (the run is then recorded `lost`).
    lost: Option<String>,
}

async fn execute(
    db: &mut Db,
    cfg: &RunConfig,
    me: &Me,
    lease: &Lease,
    mut hb: Heartbeat<'_>,
    (acquired_at, slot): (Instant, Option<Slot>),
    signals: &mut Signals,
) -> Result<Exit> {
    let clock = DbClock {
        db_time: lease.granted_at,
        local: acquired_at,
    };
    let events_file = match EventsFile::create() {
        Ok(f) => Some(f),
        Err(e) => {
            warn!(
                "cannot create the file for the command's events ({e}); it runs without {}",
                events::VAR
            );
            None
        }
    };
    let mut env = vec![
        ("LEASECTL_TARGET", lease.target.clone()),
        ("LEASECTL_TOKEN", lease.token.to_string()),
        ("LEASECTL_FENCE", lease.fence.to_string()),
        ("LEASECTL_HOLDER_INDEX", lease.holder_index().to_string()),
    ];
    if let Some(f) = &events_file {
        env.push((events::VAR, f.path().to_string_lossy().into_owned()));
    }
    let started = Instant::now();
    if let Some(s) = slot {
        env.push(("LEASECTL_SLOT", crate::fmt::rfc3339(s.start)));
        env.push(("LEASECTL_SLOT_END", crate::fmt::rfc3339(s.end)));
    }
    let spec = Spec {
        argv: &cfg.command,
        env,
        echo: !cfg.quiet,
        capture_limit: cfg.capture_limit,
    };
    let record = |outcome, status, finished: Instant| {
        let times = (clock.at(started), clock.at(finished));
        new_record(cfg, me, outcome, status, times, slot)
    };
    let mut child = match Child::spawn(spec) {
        Ok(c) => c,
        Err(e) => {
            say!("{}", e.message);
            let failed = RunRecord {
                exit_code_override: Some(i32::from(e.exit_code)),
                error: Some(e.message),
                ..record(Outcome::ExecFailed, None, Instant::now())
            };
            return store(db, cfg, lease, &failed, Exit::Code(e.exit_code)).await;
        }
    };
    test_panic_trigger().await;

    let end = supervise(&mut child, &mut hb, db, cfg, signals, started).await;
    let ended = Instant::now();
    let completed = end.lost.is_none() && end.outcome == Outcome::Completed;
    let (out, err) = wind_up(&mut child, &mut hb, db, cfg, completed).await;
    // Nothing of the group may outlive the run: it is SIGKILLed and the terminal handed back
    // now, before the save, as dropping `child` here used to do. The watchdog is reaped when
    // `child` drops at the end of this function, so its exit overlaps the save's commit
    // instead of delaying it (0.1–3 ms on a busy machine).
    child.end_now();
    let outcome = if end.lost.is_some() {
        Outcome::Lost
    } else {
        end.outcome
    };
    let job = events_file
        .as_ref()
        .map_or(JobEvents::None, |f| f.read(cfg.events_limit));
    let (job_events, events_kept, refused) = match &job {
        JobEvents::None => (None, None, None),
        JobEvents::Valid(events, raw) => (Some(events), Some(raw.as_slice()), None),
        JobEvents::Refused(why, raw) => (None, Some(raw.as_slice()), Some(why.clone())),
    };
    let mut exit = end.exit;
    if let (Some(why), None) = (&refused, &end.lost) {
        say!("{why}; the run is stored without any of the command's events (exit 65)");
        exit = Exit::DataError;
    }
    let run = RunRecord {
        stdout: &out.bytes,
        stderr: &err.bytes,
        stdout_truncated: out.truncated,
        stderr_truncated: err.truncated,
        error: end.lost.clone().or(refused),
        events_kept,
        job_events,
        ..record(outcome, Some(end.status), ended)
    };
    if end.lost.is_some() {
        // The exit is due a second after the lease's deadline at the latest, whatever the record
        // still waits for: the database may have gone silent (before the loss, or during the
        // stop that followed a takeover).
        let exit_by = hb.lease_deadline() + SILENT_EXIT_AFTER;
        return record_lost(db, cfg, lease, &run, Some(exit_by)).await;
    }
    store(db, cfg, lease, &run, exit).await
}

/// A test-only trigger (debug builds): panics once the file named by `LEASECTL_TEST_PANIC`
/// exists, to prove that a panic mid-run still ends the command.
async fn test_panic_trigger() {
    let Some(path) = std::env::var_os("LEASECTL_TEST_PANIC").filter(|_| cfg!(debug_assertions))
    else {
        return;
    };
    while !std::path::Path::new(&path).exists() {
        sleep(Duration::from_millis(20)).await;
    }
    panic!("LEASECTL_TEST_PANIC");
}

/// Watches the running command until it exits, the lease is lost, `--timeout` passes or a
/// signal arrives, and stops it in the last three cases.
async fn supervise(
    child: &mut Child,
    hb: &mut Heartbeat<'_>,
    db: &mut Db,
    cfg: &RunConfig,
    signals: &mut Signals,
    started: Instant,
) -> Ended {
    let timeout_at = cfg.timeout.map(|t| deadline(started, t));
    tokio::select! {
        status = child.wait() => exited(status),
        // A child that already exited (say while leasectl was paused past the TTL) goes to the
        // fenced save, which alone decides whether its result may be stored; the runtime may
        // report the expired timer before the child's exit.
        reason = hb.keep(db) => match child.exited() {
            Some(status) => exited(status),
            None => {
                warn!("{reason}; stopping the command");
                // SIGKILL by the lease's deadline, not a full grace from now: if this stop
                // starts late (leasectl was paused, a timer fired late), no grace is left.
                let s = child.stop(Signal::SIGTERM, hb.kill_at()).await;
                Ended {
                    status: ChildStatus::from_exit_status(s),
                    outcome: Outcome::Lost,
                    exit: Exit::LeaseLost,
                    lost: Some(reason),
                }
            }
        },
        _ = sleep_until_opt(timeout_at) => {
            say!(
                "'{}' timed out after {}; stopping the command",
                cfg.target,
                crate::fmt::duration(cfg.timeout.unwrap_or_default())
            );
            let how = (Signal::SIGTERM, Outcome::TimedOut, Exit::TimedOut);
            stop_keeping_the_lease(child, hb, db, cfg, how).await
        }
        sig = signals.recv() => {
            info!("received signal {sig}; forwarding it to the command");
            let first = Signal::try_from(sig).unwrap_or(Signal::SIGTERM);
            let how = (first, Outcome::Interrupted, Exit::from_signal(sig));
            stop_keeping_the_lease(child, hb, db, cfg, how).await
        }
    }
}

fn exited(status: std::process::ExitStatus) -> Ended {
    let status = ChildStatus::from_exit_status(status);
    Ended {
        status,
        outcome: Outcome::Completed,
        exit: Exit::Code(status.exit_code()),
        lost: None,
    }
}

/// Stops the command for `--timeout` or a signal: `first`, then SIGKILL after the grace — but
/// never past the lease's own deadline. The lease is kept alive meanwhile; if it goes anyway,
/// the deadline still holds (it only moves later with a successful heartbeat).
async fn stop_keeping_the_lease(
    child: &mut Child,
    hb: &mut Heartbeat<'_>,
    db: &mut Db,
    cfg: &RunConfig,
    (first, outcome, exit): (Signal, Outcome, Exit),
) -> Ended {
    let kill_at = deadline(Instant::now(), cfg.kill_after).min(hb.kill_at());
    let stop = child.stop(first, kill_at);
    tokio::pin!(stop);
    let mut lost = None;
    let status = tokio::select! {
        s = &mut stop => s,
        reason = hb.keep(db) => {
            warn!("{reason}; killing the command");
            lost = Some(reason);
            stop.await
        }
    };
    Ended {
        status: ChildStatus::from_exit_status(status),
        outcome,
        exit,
        lost,
    }
}

/// After the command exited or was stopped: end what it left in its group and collect the
/// rest of its output — bounded, and with heartbeats going on, so that a helper holding the
/// output pipes open (one that left the group with `setsid`) can neither keep leasectl
/// draining forever nor let the lease lapse under a command that succeeded.
///
/// `completed`: the command exited by itself, so what it left behind gets SIGTERM and a
/// grace (by the lease's deadline); otherwise everything left is SIGKILLed at once.
async fn wind_up(
    child: &mut Child,
    hb: &mut Heartbeat<'_>,
    db: &mut Db,
    cfg: &RunConfig,
    completed: bool,
) -> (Capture, Capture) {
    let leftovers_by = deadline(Instant::now(), cfg.kill_after).min(hb.kill_at());
    let tail = async {
        if !completed {
            child.kill_leftovers();
        } else if child.end_leftovers(leftovers_by).await {
            warn!("the command left processes running in its process group; they were stopped");
        }
        child.finish(deadline(Instant::now(), cfg.kill_after)).await
    };
    tokio::pin!(tail);
    tokio::select! {
        out = &mut tail => out,
        // A lease lost now is the fenced save's to judge; the tail's deadlines already
        // end by the lease's.
        _ = hb.keep(db), if completed => tail.await,
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(t) => sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// The fenced save, retried across connection failures for as long as the lease could still
/// be ours. A retry first looks for the run id, in case a lost connection hid a commit. Each
/// attempt has a client-side deadline; when time runs out, leasectl says so and exits 69.
async fn store(
    db: &mut Db,
    cfg: &RunConfig,
    lease: &Lease,
    record: &RunRecord<'_>,
    exit: Exit,
) -> Result<Exit> {
    let give_up_at = deadline(Instant::now(), cfg.ttl.max(Duration::from_secs(10)));
    let mut delay = Duration::from_millis(100);
    let mut attempt = 0;
    loop {
        let event_type = cfg.event_type.as_deref();
        // At most half the time left, so that a connection stuck behind an unanswered
        // statement leaves time for a retry on a fresh one.
        let left = give_up_at.saturating_duration_since(Instant::now());
        let until = Instant::now() + STATEMENT_DEADLINE.min(left / 2);
        let result = bounded(
            until,
            runs::save_fenced(
                &db.client,
                &db.schema,
                lease,
                record,
                event_type,
                attempt > 0,
            ),
        )
        .await;
        attempt += 1;
        match result {
            Ok(Saved::Stored) => {
                info!(
                    "stored run {} of '{}' ({})",
                    record.id,
                    lease.target,
                    record.outcome.as_str()
                );
                return Ok(exit);
            }
            Ok(Saved::NotOwner) => {
                let reason =
                    "the lease was taken over before the result could be stored".to_owned();
                warn!("{reason}");
                let lost = RunRecord {
                    outcome: Outcome::Lost,
                    error: Some(reason),
                    ..clone_record(record)
                };
                return record_lost(db, cfg, lease, &lost, None).await;
            }
            Err(e) if Instant::now() < give_up_at && is_unavailable(&e) => {
                warn!("cannot store run {} yet ({:#}); retrying", record.id, e);
                sleep(delay.min(give_up_at.saturating_duration_since(Instant::now()))).await;
                delay = (delay * 2).min(Duration::from_secs(2));
                let left = give_up_at.saturating_duration_since(Instant::now());
                let _ = timeout(left.max(Duration::from_millis(100)), db.reconnect()).await;
            }
            Err(e) => {
                return Err(e.context(format!(
                    "the command finished ({}) but its run {} could not be stored",
                    describe_status(record),
                    record.id
                )));
            }
        }
    }
}

fn is_unavailable(e: &anyhow::Error) -> bool {
    Exit::from_error(e) == Exit::Unavailable
}

fn clone_record<'a>(r: &RunRecord<'a>) -> RunRecord<'a> {
    RunRecord {
        argv: r.argv.clone(),
        error: r.error.clone(),
        ..*r
    }
}

fn describe_status(r: &RunRecord<'_>) -> String {
    match (r.status, r.exit_code_override) {
        (Some(ChildStatus::Exited(c)), _) => format!("exit code {c}"),
        (Some(ChildStatus::Signaled(s)), _) => format!("killed by signal {s}"),
        (None, Some(c)) => format!("exec failed, {c}"),
        (None, None) => "unknown status".into(),
    }
}

/// How long after its lease's deadline a holder that lost its lease while its command ran exits
/// at the latest: the time its best-effort `lost` record and release may still take. The promise is an exit
/// within the TTL plus 1.5 s of the database going silent, on a fresh connection or an
/// established one alike; this leaves half a second for the rest of the exit.
const SILENT_EXIT_AFTER: Duration = Duration::from_secs(1);

/// Keeps the `lost` record of a run (no event), releases the lease if it is somehow still
/// ours, and exits 76. All of it best-effort within [`lost_record_deadline`] — and by `exit_by`
/// (but at least half a second): the command is already stopped, and a silent database must not
/// hold up the exit.
async fn record_lost(
    db: &mut Db,
    cfg: &RunConfig,
    lease: &Lease,
    record: &RunRecord<'_>,
    exit_by: Option<Instant>,
) -> Result<Exit> {
    let now = Instant::now();
    let mut until = now + lost_record_deadline(cfg.ttl);
    if let Some(by) = exit_by {
        until = until.min(by.max(now + Duration::from_millis(500)));
    }
    let limit = until - now;
    // The connection may be stuck behind the heartbeat that went unanswered: half the time
    // for it, the other half for a fresh one.
    let first = Instant::now() + limit / 2;
    let mut stored = bounded(
        first,
        runs::record_lost(&db.client, &db.schema, lease, record),
    )
    .await;
    if stored.is_err()
        && matches!(
            tokio::time::timeout_at(until, db.reconnect()).await,
            Ok(Ok(()))
        )
    {
        stored = bounded(
            until,
            runs::record_lost(&db.client, &db.schema, lease, record),
        )
        .await;
    }
    match stored {
        Ok(runs::Lost::Lost) => say!(
            "lease on '{}' lost; no result stored (output kept as lost run {})",
            lease.target,
            record.id
        ),
        Ok(runs::Lost::Preempted { fence, by }) => say!(
            "lease on '{}' taken by --replace of {by} (fence {}); no result stored (output kept as preempted run {})",
            lease.target,
            crate::fmt::fence(fence),
            record.id
        ),
        Err(e) => warn!(
            "lease on '{}' lost, and the lost run could not be recorded: {e:#}",
            lease.target
        ),
    }
    if Instant::now() >= until {
        // The deadline went to a database that did not answer: a release would only wait for
        // it too (release_within grants at least 500 ms), past the bound promised above.
        info!(
            "not releasing '{}' (the database did not answer in time); it expires with its TTL",
            lease.target
        );
    } else {
        release_within(db, lease, until).await;
    }
    Ok(Exit::LeaseLost)
}
