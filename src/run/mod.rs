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
mod prepare;
mod replace;
mod save;
pub mod slot;
mod steps;
mod supervise;
mod wait;

pub use steps::acquire;

use std::future::Future;
use std::time::Duration;

use anyhow::Result;
use tokio::time::Instant;
use uuid::Uuid;

use crate::cli::{DbArgs, RunArgs};
use crate::config::RunConfig;
use crate::db::Db;
use crate::exit::{ChildStatus, Exit, Failure};
use crate::heap::on_heap;
use crate::model::slot::Slot;
use crate::process::Watchdog;
use crate::store::leases::{self, DbClock, Lease};
use crate::store::runs::{self, Outcome, RunRecord};
use heartbeat::Heartbeat;
use prepare::{keep_place, prepare, start, too_late, Prepared, Started, RELEASE_QUICKLY};
use supervise::{execute, Launch};
use wait::{obtain, Obtained, Resume};

/// How long one statement may go unanswered before the database counts as unavailable (the
/// server-side `statement_timeout` cannot help when the server, or the path to it, is silent).
pub(crate) const STATEMENT_DEADLINE: Duration = Duration::from_secs(10);

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

pub async fn run(db_args: &DbArgs, args: RunArgs) -> Result<Exit> {
    let cfg = RunConfig::new(args)?;
    let Started {
        mut signals,
        mut db,
        give_up_at,
    } = match on_heap(|| start(db_args, &cfg, true)).await? {
        Ok(s) => s,
        Err(exit) => return Ok(exit),
    };
    let me = Me::new();
    // The plain acquisition carries the schema check in its own transaction (see
    // `wait::obtain`); anything that reads or writes before it checks the schema first.
    if cfg.token.is_some() || cfg.reuse_within.is_some() {
        let checked = tokio::select! {
            r = crate::db::deadline::check_schema(&mut db) => r,
            sig = signals.recv() => return Ok(Exit::from_signal(sig)),
        };
        checked?;
    }
    if let Some(token) = cfg.token {
        return on_heap(|| steps::step(&mut db, cfg, &me, token, &mut signals, give_up_at)).await;
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
    let mut arm = arms_ahead(&cfg);
    let mut watchdog = None;
    loop {
        let attempt = on_heap(|| obtain(&mut db, &cfg, &me, &mut signals, (give_up_at, resume)));
        let obtained = if std::mem::take(&mut arm) {
            let (obtained, armed) = tokio::join!(attempt, arm_behind());
            watchdog = armed;
            obtained
        } else {
            attempt.await
        };
        let granted = match obtained? {
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
            on_heap(|| replace::await_stop(&mut db, &cfg, lease, true, &mut hb, &mut signals)).await
        {
            return Ok(exit);
        }
        let clock = DbClock {
            db_time: lease.granted_at,
            local: acquired_at,
        };
        let timing = (granted.sent, granted.answered);
        let prepared = on_heap(|| {
            prepare(
                &mut db,
                &cfg,
                &me,
                lease,
                &mut hb,
                (clock, timing),
                &mut signals,
            )
        });
        match prepared.await? {
            Prepared::Spawn(slot) => {
                let launch = Launch {
                    acquired_at,
                    slot,
                    watchdog: watchdog.take(),
                };
                return on_heap(|| execute(&mut db, &cfg, &me, lease, hb, launch, &mut signals))
                    .await;
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

/// Whether the command's watchdog is started while the first acquisition is answered
/// ([`arm_behind`]) rather than when the command starts: for the run that expects to start its
/// command at once. A caller that may wait (`--wait`) or reuse another run's result
/// (`--reuse-within`) starts it when it starts its command, as a step (`--token`) does.
fn arms_ahead(cfg: &RunConfig) -> bool {
    cfg.wait.is_none() && cfg.reuse_within.is_none() && cfg.token.is_none()
}

/// Starts the command's watchdog once the acquisition's requests are on their way: leasectl
/// would only wait for the server meanwhile, and the watchdog's own start-up overlaps that wait
/// (see [`Watchdog`]). If the lease is busy, the watchdog is stood down unused. `None` (the
/// spawn starts one) if it cannot be started.
async fn arm_behind() -> Option<Watchdog> {
    // Polled after the acquisition: the yield lets the connection's task write its requests.
    tokio::task::yield_now().await;
    Watchdog::arm().ok()
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

/// Runs `what` with a client-side deadline: past `until`, the database counts as unavailable
/// (exit 69) and the connection must be replaced before it is used again, since the statement
/// may still be queued on it.
pub(crate) async fn bounded<T>(until: Instant, what: impl Future<Output = Result<T>>) -> Result<T> {
    match tokio::time::timeout_at(until, what).await {
        Ok(r) => r,
        Err(_) => Err(Failure::Unavailable("the database did not answer in time".into()).into()),
    }
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

fn is_unavailable(e: &anyhow::Error) -> bool {
    Exit::from_error(e) == Exit::Unavailable
}
