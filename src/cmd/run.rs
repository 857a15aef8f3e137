//! `leasectl run`: take the lease, run the command, keep the lease alive, store the result.
//!
//! The flow, top to bottom in [`run`]:
//!
//! 1. `--reuse-within`: print a fresh stored result and stop.
//! 2. [`obtain`]: acquire, or with `--wait` sleep until the lease is released (NOTIFY) or due
//!    to expire (polling), sharing the result of the run we waited for when reuse is on.
//! 3. [`execute`]: spawn the child, then select between "child exited", "lease lost",
//!    "--timeout" and "signal received"; stop the child when needed; store the run and its
//!    event with the fenced save, which also releases the lease.

use std::io::IsTerminal;
use std::time::Duration;

use anyhow::Result;
use indicatif::ProgressBar;
use nix::sys::signal::Signal;
use tokio::time::{sleep, sleep_until, Instant};
use uuid::Uuid;

use crate::cli::{DbArgs, RunArgs};
use crate::config::{RunConfig, Wait};
use crate::db::{self, Db};
use crate::exit::{ChildStatus, Exit};
use crate::heartbeat::Heartbeat;
use crate::signals::Signals;
use crate::store::leases::{self, Acquired, DbClock, Lease};
use crate::store::runs::{self, Outcome, RunRecord, Saved};
use crate::supervise::{Capture, Child, Spec};
use crate::{info, warn};

/// Fallback poll while waiting, for when a NOTIFY is missed or LISTEN is unavailable.
const WAIT_POLL: Duration = Duration::from_secs(1);

/// Who we are, as recorded in the lease row and the run.
struct Me {
    host: String,
    pid: i32,
}

pub async fn run(db_args: &DbArgs, args: RunArgs) -> Result<Exit> {
    let cfg = RunConfig::new(args)?;
    let mut signals = Signals::install()?;
    let mut db = tokio::select! {
        db = super::connect(db_args) => db?,
        sig = signals.recv() => return Ok(Exit::from_signal(sig)),
    };
    let me = Me {
        host: nix::unistd::gethostname()
            .map(|h| h.to_string_lossy().into_owned())
            .unwrap_or_else(|_| "unknown".into()),
        pid: std::process::id() as i32,
    };

    if let Some(within) = cfg.reuse_within {
        if let Some(r) = runs::reusable(&db.client, &db.schema, &cfg.target, within).await? {
            info!("reusing run {} of '{}'", r.id, cfg.target);
            print_stdout(&cfg, &r.stdout)?;
            return Ok(Exit::Code(0));
        }
    }

    let (lease, acquired_at) = match obtain(&mut db, &cfg, &me, &mut signals).await? {
        Obtained::Lease(l, at) => (l, at),
        Obtained::Done(exit) => return Ok(exit),
    };
    info!("acquired '{}' (fence {})", lease.target, lease.fence);

    // A run may have finished between our reuse check and the acquisition.
    if let Some(within) = cfg.reuse_within {
        if let Some(r) = runs::reusable(&db.client, &db.schema, &cfg.target, within).await? {
            leases::release(&db.client, &db.schema, &lease).await?;
            print_stdout(&cfg, &r.stdout)?;
            return Ok(Exit::Code(0));
        }
    }

    execute(&mut db, &cfg, &me, lease, acquired_at, &mut signals).await
}

enum Obtained {
    /// We hold the lease; the instant is when the acquiring statement was sent.
    Lease(Lease, Instant),
    /// Nothing to run: busy, shared a waited-for result, or a signal arrived while waiting.
    Done(Exit),
}

/// Acquires the lease, waiting for it with `--wait`.
///
/// A waiter survives the database going away (a restart, a failover): it reports the outage
/// once, reconnects with backoff and carries on waiting, within its `--wait` limit.
async fn obtain(db: &mut Db, cfg: &RunConfig, me: &Me, signals: &mut Signals) -> Result<Obtained> {
    let mut w = Waiter {
        give_up_at: match cfg.wait {
            Some(Wait::Upto(d)) => Some(Instant::now() + d),
            _ => None,
        },
        listening: false,
        awaited: None,
        spinner: Spinner::default(),
        outage: None,
    };
    let result = loop {
        let wake = match w.attempt(db, cfg, me).await {
            Ok(Attempt::Done(obtained)) => break Ok(obtained),
            Ok(Attempt::Again) => continue,
            Ok(Attempt::Wait(holder)) => {
                if cfg.wait.is_none() {
                    if !cfg.quiet {
                        eprintln!("leasectl: '{}' is busy: {}", cfg.target, holder.describe());
                    }
                    break Ok(Obtained::Done(Exit::Busy(cfg.busy_exit_code)));
                }
                w.outage = None;
                w.spinner.show(format!(
                    "waiting for '{}': {}",
                    cfg.target,
                    holder.describe()
                ));
                // Wake at the holder's expiry or at the fallback poll, unless a release of our
                // target is announced first.
                WAIT_POLL.min(holder.expires_in + Duration::from_millis(20))
            }
            Err(e) if cfg.wait.is_some() && is_unavailable(&e) => {
                let backoff = w.outage.map_or(Duration::from_millis(200), |d| {
                    (d * 2).min(Duration::from_secs(5))
                });
                if w.outage.is_none() {
                    warn!(
                        "lost the database while waiting for '{}' ({e:#}); reconnecting",
                        cfg.target
                    );
                }
                w.outage = Some(backoff);
                w.listening = false;
                backoff
            }
            Err(e) => break Err(e),
        };
        let give_up = async {
            match w.give_up_at {
                Some(t) => sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = released(&mut db.notifications, &cfg.target) => {}
            _ = sleep(wake) => {}
            _ = give_up => {
                if !cfg.quiet {
                    eprintln!("leasectl: gave up waiting for '{}' after {}", cfg.target, crate::fmt::duration(match cfg.wait { Some(Wait::Upto(d)) => d, _ => Duration::ZERO }));
                }
                break Ok(Obtained::Done(Exit::Busy(cfg.busy_exit_code)));
            }
            sig = signals.recv() => break Ok(Obtained::Done(Exit::from_signal(sig))),
        }
        if w.outage.is_some() {
            if let Err(e) = db.reconnect().await {
                info!("reconnect failed: {e:#}");
            }
        }
    };
    w.spinner.clear();
    result
}

/// The state of one caller waiting for a lease.
struct Waiter {
    give_up_at: Option<Instant>,
    listening: bool,
    /// The acquisition whose result we wait for (singleflight with --reuse-within).
    awaited: Option<i64>,
    spinner: Spinner,
    /// Backoff while the database is unreachable.
    outage: Option<Duration>,
}

enum Attempt {
    Done(Obtained),
    /// Try again at once.
    Again,
    /// Busy: this is the holder.
    Wait(leases::Holder),
}

impl Waiter {
    async fn attempt(&mut self, db: &mut Db, cfg: &RunConfig, me: &Me) -> Result<Attempt> {
        if let (Some(_), Some(fence)) = (cfg.reuse_within, self.awaited) {
            if let Some(exit) = share_awaited(db, cfg, fence).await? {
                return Ok(Attempt::Done(Obtained::Done(exit)));
            }
        }
        let sent = Instant::now();
        let holder = match leases::acquire(
            &db.client,
            &db.schema,
            &cfg.target,
            cfg.ttl,
            &me.host,
            me.pid,
        )
        .await?
        {
            Acquired::Held(l) => {
                if self.listening {
                    // Stop queueing other targets' releases for the rest of a long run.
                    db.client.batch_execute("UNLISTEN *").await?;
                    while db.notifications.try_recv().is_ok() {}
                }
                return Ok(Attempt::Done(Obtained::Lease(l, sent)));
            }
            // Released between our attempt and the look at its holder: just try again.
            Acquired::Busy(None) => return Ok(Attempt::Again),
            Acquired::Busy(Some(h)) => h,
        };
        if cfg.wait.is_some() && !self.listening {
            self.listening = true;
            // LISTEN may be unavailable (e.g. behind a transaction pooler); polling still works.
            let listen = format!("LISTEN \"{}\"", db.schema.lease_channel());
            match db.client.batch_execute(&listen).await {
                // Try again at once: the release may have happened before LISTEN took effect.
                Ok(()) => return Ok(Attempt::Again),
                Err(e) if db::is_unavailable(&e) => return Err(e.into()),
                Err(e) => info!(
                    "LISTEN failed ({}); polling every {}",
                    db::reason(&e),
                    crate::fmt::duration(WAIT_POLL)
                ),
            }
        }
        if cfg.wait.is_some() && self.awaited != Some(holder.fence) {
            info!("waiting for '{}': {}", cfg.target, holder.describe());
            self.awaited = Some(holder.fence);
        }
        Ok(Attempt::Wait(holder))
    }
}

/// Resolves when a release of `target` is announced. If the connection's notification stream
/// ended, never resolves: polling takes over.
async fn released(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<tokio_postgres::Notification>,
    target: &str,
) {
    while let Some(n) = rx.recv().await {
        if n.payload() == target {
            return;
        }
    }
    std::future::pending::<()>().await
}

/// Singleflight: if the run we waited for has finished with a result, print its stdout and
/// return its exit code instead of running again. A run that was `lost` or `interrupted` (or
/// whose stdout was cut) is not shared: the waiters compete and one of them runs.
async fn share_awaited(db: &Db, cfg: &RunConfig, fence: i64) -> Result<Option<Exit>> {
    let Some((run, truncated)) =
        runs::run_by_fence(&db.client, &db.schema, &cfg.target, fence).await?
    else {
        return Ok(None);
    };
    let exit = match run.outcome {
        Outcome::Completed => match (run.exit_code, run.signal) {
            (_, Some(sig)) => ChildStatus::Signaled(sig).exit_code(),
            (Some(code), None) => ChildStatus::Exited(code).exit_code(),
            (None, None) => return Ok(None),
        },
        Outcome::TimedOut => Exit::TIMED_OUT,
        Outcome::ExecFailed => run
            .exit_code
            .and_then(|c| u8::try_from(c).ok())
            .unwrap_or(Exit::NOT_FOUND),
        Outcome::Lost | Outcome::Interrupted => return Ok(None),
    };
    if truncated {
        return Ok(None);
    }
    info!("sharing the result of run {} (fence {fence})", run.id);
    print_stdout(cfg, &run.stdout)?;
    Ok(Some(Exit::Code(exit)))
}

fn print_stdout(cfg: &RunConfig, bytes: &[u8]) -> Result<()> {
    if cfg.quiet {
        return Ok(());
    }
    super::print(bytes)
}

/// How the supervision loop ended.
enum Ending {
    Exited(std::process::ExitStatus),
    Lost(String),
    TimedOut,
    Interrupted(i32),
}

async fn execute(
    db: &mut Db,
    cfg: &RunConfig,
    me: &Me,
    lease: Lease,
    acquired_at: Instant,
    signals: &mut Signals,
) -> Result<Exit> {
    let run_id = Uuid::new_v4();
    let argv: Vec<String> = cfg
        .command
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let clock = DbClock {
        db_time: lease.granted_at,
        local: acquired_at,
    };
    let started = Instant::now();
    let spec = Spec {
        argv: &cfg.command,
        env: vec![
            ("LEASECTL_TARGET", lease.target.clone()),
            ("LEASECTL_TOKEN", lease.token.to_string()),
            ("LEASECTL_FENCE", lease.fence.to_string()),
        ],
        echo: !cfg.quiet,
        capture_limit: cfg.capture_limit,
    };
    let mut child = match Child::spawn(spec) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("leasectl: {}", e.message);
            let record = RunRecord {
                id: run_id,
                outcome: Outcome::ExecFailed,
                status: None,
                exit_code_override: Some(i32::from(e.exit_code)),
                argv,
                host: &me.host,
                pid: me.pid,
                started_at: clock.at(started),
                finished_at: clock.at(Instant::now()),
                stdout: &[],
                stderr: &[],
                stdout_truncated: false,
                stderr_truncated: false,
                error: Some(e.message),
            };
            return store(db, cfg, &lease, &record, Exit::Code(e.exit_code)).await;
        }
    };

    let mut hb = Heartbeat::new(&lease, cfg, acquired_at);
    let timeout_at = cfg.timeout.map(|t| started + t);
    let ending = tokio::select! {
        status = child.wait() => Ending::Exited(status),
        // A child that already exited (say while leasectl was paused past the TTL) goes to the
        // fenced save, which alone decides whether its result may be stored; the runtime may
        // report the expired timer before the child's exit.
        reason = hb.keep(db) => match child.exited() {
            Some(status) => Ending::Exited(status),
            None => Ending::Lost(reason),
        },
        _ = sleep_until_opt(timeout_at) => Ending::TimedOut,
        sig = signals.recv() => Ending::Interrupted(sig),
    };

    let mut lost: Option<String> = None;
    let (status, outcome, exit) = match ending {
        Ending::Exited(s) => {
            let st = ChildStatus::from_exit_status(s);
            (st, Outcome::Completed, Exit::Code(st.exit_code()))
        }
        Ending::Lost(reason) => {
            warn!("{reason}; stopping the command");
            lost = Some(reason);
            // Deadline arithmetic: the SIGKILL of this stop lands before the TTL can run out.
            let s = child.stop(Signal::SIGTERM, cfg.kill_after).await;
            (
                ChildStatus::from_exit_status(s),
                Outcome::Lost,
                Exit::LeaseLost,
            )
        }
        Ending::TimedOut | Ending::Interrupted(_) => {
            let (first, outcome, exit) = match ending {
                Ending::Interrupted(sig) => {
                    info!("received signal {sig}; forwarding it to the command");
                    (
                        Signal::try_from(sig).unwrap_or(Signal::SIGTERM),
                        Outcome::Interrupted,
                        Exit::from_signal(sig),
                    )
                }
                _ => {
                    eprintln!(
                        "leasectl: '{}' timed out after {}; stopping the command",
                        cfg.target,
                        crate::fmt::duration(cfg.timeout.unwrap_or_default())
                    );
                    (Signal::SIGTERM, Outcome::TimedOut, Exit::TimedOut)
                }
            };
            // Keep the lease alive during the grace; if it goes anyway, no grace is left.
            let s = tokio::select! {
                s = child.stop(first, cfg.kill_after) => s,
                reason = hb.keep(db) => {
                    warn!("{reason}; killing the command");
                    lost = Some(reason);
                    child.kill_now().await
                }
            };
            (ChildStatus::from_exit_status(s), outcome, exit)
        }
    };
    let ended = Instant::now();
    if lost.is_some() || outcome != Outcome::Completed {
        child.kill_leftovers();
    } else if child.end_leftovers(cfg.kill_after).await {
        warn!("the command left processes running in its process group; they were stopped");
    }
    let (out, err): (Capture, Capture) = child.finish().await;
    let record = RunRecord {
        id: run_id,
        outcome: if lost.is_some() {
            Outcome::Lost
        } else {
            outcome
        },
        status: Some(status),
        exit_code_override: None,
        argv,
        host: &me.host,
        pid: me.pid,
        started_at: clock.at(started),
        finished_at: clock.at(ended),
        stdout: &out.bytes,
        stderr: &err.bytes,
        stdout_truncated: out.truncated,
        stderr_truncated: err.truncated,
        error: lost.clone(),
    };
    if lost.is_some() {
        return record_lost(db, &lease, &record).await;
    }
    store(db, cfg, &lease, &record, exit).await
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(t) => sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// The fenced save, retried across connection failures for as long as the lease could still
/// be ours. A retry first looks for the run id, in case a lost connection hid a commit.
async fn store(
    db: &mut Db,
    cfg: &RunConfig,
    lease: &Lease,
    record: &RunRecord<'_>,
    exit: Exit,
) -> Result<Exit> {
    let give_up_at = Instant::now() + cfg.ttl.max(Duration::from_secs(10));
    let mut delay = Duration::from_millis(100);
    let mut attempt = 0;
    loop {
        let event_type = cfg.event_type.as_deref();
        let result = runs::save_fenced(
            &db.client,
            &db.schema,
            lease,
            record,
            event_type,
            attempt > 0,
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
                return record_lost(db, lease, &lost).await;
            }
            Err(e) if Instant::now() < give_up_at && is_unavailable(&e) => {
                warn!("cannot store run {} yet ({:#}); retrying", record.id, e);
                sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
                let _ = db.reconnect().await;
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

/// Keeps the `lost` record of a run (no event), releases the lease if it is somehow still
/// ours, and exits 76.
async fn record_lost(db: &mut Db, lease: &Lease, record: &RunRecord<'_>) -> Result<Exit> {
    let mut stored = runs::record_lost(&db.client, &db.schema, lease, record).await;
    if stored.is_err() && db.reconnect().await.is_ok() {
        stored = runs::record_lost(&db.client, &db.schema, lease, record).await;
    }
    match stored {
        Ok(()) => eprintln!(
            "leasectl: lease on '{}' lost; no result stored (output kept as lost run {})",
            lease.target, record.id
        ),
        Err(e) => warn!(
            "lease on '{}' lost, and the lost run could not be recorded: {e:#}",
            lease.target
        ),
    }
    let _ = leases::release(&db.client, &db.schema, lease).await;
    Ok(Exit::LeaseLost)
}

/// A spinner on stderr while waiting, for people only: nothing is drawn unless stderr is a
/// terminal, so cron and CI logs stay clean.
#[derive(Default)]
struct Spinner(Option<ProgressBar>);

impl Spinner {
    fn show(&mut self, msg: String) {
        if self.0.is_none() && std::io::stderr().is_terminal() {
            let pb = ProgressBar::new_spinner();
            pb.enable_steady_tick(Duration::from_millis(120));
            self.0 = Some(pb);
        }
        if let Some(pb) = &self.0 {
            pb.set_message(msg);
        }
    }

    fn clear(&mut self) {
        if let Some(pb) = self.0.take() {
            pb.finish_and_clear();
        }
    }
}
