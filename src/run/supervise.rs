//! Running the command under the heartbeat: spawn it, then watch it until it exits, the lease
//! is lost, `--timeout` passes or a signal arrives; stop it by its deadlines (never past the
//! lease's); collect what it left; hand the run to the fenced save.

use std::time::Duration;

use anyhow::Result;
use nix::sys::signal::Signal;
use tokio::time::{sleep, sleep_until, Instant};

use super::child::{Child, Spec};
use super::events::{self, EventsFile, JobEvents};
use super::heartbeat::Heartbeat;
use super::new_record;
use super::save::{record_lost, store, SILENT_EXIT_AFTER};
use super::Me;
use crate::config::RunConfig;
use crate::db::Db;
use crate::exit::{ChildStatus, Exit};
use crate::model::slot::Slot;
use crate::model::time::deadline;
use crate::process::{Capture, Watchdog};
use crate::signals::Signals;
use crate::store::leases::{DbClock, Lease};
use crate::store::runs::{self, Outcome, RunRecord};

/// How the command ended, as the run records it.
struct Ended {
    status: ChildStatus,
    outcome: Outcome,
    exit: Exit,
    /// Why the lease was lost, if it was (the run is then recorded `lost`).
    lost: Option<String>,
}

/// What a command is started with besides its lease.
pub(super) struct Launch {
    /// When the acquisition was sent: the run's clock counts from it.
    pub(super) acquired_at: Instant,
    /// The `--slot` the command runs for.
    pub(super) slot: Option<Slot>,
    /// A watchdog armed ahead (see `super::arm_behind`); one is started at the spawn otherwise.
    pub(super) watchdog: Option<Watchdog>,
}

pub(super) async fn execute(
    db: &mut Db,
    cfg: &RunConfig,
    me: &Me,
    lease: &Lease,
    mut hb: Heartbeat<'_>,
    launch: Launch,
    signals: &mut Signals,
) -> Result<Exit> {
    let Launch {
        acquired_at,
        slot,
        watchdog,
    } = launch;
    let clock = DbClock {
        db_time: lease.granted_at,
        local: acquired_at,
    };
    // The server prepares and plans the save while the command starts and runs. Only on a
    // direct session: behind a transaction-mode pooler the save may run in another server
    // process.
    let ahead = runs::plan_save_ahead(&db.client, &db.schema, lease.keep, db.can_listen()).await;
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
        watchdog,
    };
    let record = |outcome, status, finished: Instant| {
        let times = (clock.at(started), clock.at(finished));
        new_record(cfg, me, outcome, status, times, slot)
    };
    let mut child = match Child::spawn(spec) {
        Ok(c) => c,
        Err(e) => {
            say!("{}", e.message);
            let planned = ahead.finish(PREPARED_WITHIN, || false).await;
            let failed = RunRecord {
                exit_code_override: Some(i32::from(e.exit_code)),
                error: Some(e.message),
                ..record(Outcome::ExecFailed, None, Instant::now())
            };
            let planned = planned.as_ref();
            return store(db, cfg, lease, &failed, Exit::Code(e.exit_code), planned).await;
        }
    };
    // The command runs while the save is planned.
    let planned = ahead
        .finish(PREPARED_WITHIN, || child.exited().is_none())
        .await;
    let planned = planned.as_ref();
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
    store(db, cfg, lease, &run, exit, planned).await
}

/// How long a run waits, once its command has started, for the save it prepared ahead (see
/// `runs::plan_save_ahead`); a server slower than that leaves the save to send its statement
/// itself. The heartbeats and the signals wait meanwhile, so it is kept far below the least TTL.
const PREPARED_WITHIN: Duration = Duration::from_millis(50);

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
