//! Getting the lease: acquire, or with `--wait` queue for it (`store::waiters`) and sleep until
//! it is released or the queue moves (NOTIFY) or it is due to expire (polling), sharing the result
//! of the run we waited for when `--reuse-within` is on (singleflight). A signal or `--wait`'s
//! limit ends the wait at any point, even in the middle of a statement; a waiter that leaves
//! without the lease leaves the queue too.
//!
//! A waiter joins the queue at its first busy attempt and renews its place at every poll (the
//! statement that reads the queue after a busy attempt does it), so its row lives as long as it
//! waits: a waiter that is killed is passed over once its TTL ([`waiter_ttl`]) ran out.

use std::future::Future;
use std::io::IsTerminal;
use std::time::Duration;

use anyhow::Result;
use indicatif::ProgressBar;
use tokio::time::{sleep, sleep_until, timeout, Instant};

use super::{bounded, is_unavailable, print_stdout, Me, STATEMENT_DEADLINE};
use crate::config::RunConfig;
use crate::db::first::First;
use crate::db::{self, Db};
use crate::exit::{ChildStatus, Exit};
use crate::heap::on_heap;
use crate::model::flags::Wait;
use crate::signals::Signals;
use crate::store::leases::{self, Acquired, Contender, Lease};
use crate::store::runs::{self, Outcome};
use crate::store::waiters::{self, Busy, Place, Ticket};

/// Fallback poll while waiting, for when a NOTIFY is missed or LISTEN failed.
const WAIT_POLL: Duration = Duration::from_secs(1);
/// The poll behind a transaction-mode pooler, where LISTEN cannot work: it is the wake-up
/// latency there, so shorter (one short statement per waiter per interval).
const POOLED_POLL: Duration = Duration::from_millis(250);

/// A waiter's TTL in the queue: the caller's `--ttl`, but at least 10s — a waiter renews its
/// row at every poll (every second at most), and a loaded machine or a short outage must not
/// cost it its place — and at most 1m, so a waiter killed with SIGKILL holds nobody up for long.
pub(super) fn waiter_ttl(ttl: Duration) -> Duration {
    ttl.clamp(Duration::from_secs(10), Duration::from_secs(60))
}

pub(super) enum Obtained {
    /// We hold the lease.
    Lease(Granted),
    /// Nothing to run: busy, shared a waited-for result, or a signal arrived while waiting.
    Done(Exit),
}

/// A lease just obtained, and what the caller needs to know about how.
pub(super) struct Granted {
    pub lease: Lease,
    /// When the acquiring statement was sent: the lease cannot expire before this plus its TTL.
    pub sent: Instant,
    /// When its answer arrived: a late answer means the database (or the path to it) was slow.
    pub answered: Instant,
    /// The connection still LISTENs for releases.
    pub listening: bool,
    /// The place in the queue the caller had when the lease was granted, to join again with if
    /// the command cannot be started in time after all.
    pub ticket: Option<Ticket>,
}

/// Where a caller that waits again stands in the queue (see `run::keep_place`).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Resume {
    /// Queued already, with this ticket.
    pub ticket: Option<Ticket>,
    /// Not queued, but to join again with this old ticket, keeping the place.
    pub again: Option<Ticket>,
}

/// How long the first attempt of a waiter may take past `--wait`'s limit: `--wait=0s` (or any
/// limit already spent on connecting) still tries once.
const FIRST_TRY: Duration = Duration::from_millis(250);

/// How long the schema check of a waiter's first attempt may take past `--wait`'s limit, as
/// its connection may (a schema's first use migrates it).
const FIRST_CHECK: Duration = Duration::from_secs(2);

/// How long a waiter that gives up (or is interrupted) may spend leaving the queue: a row left
/// behind costs the others only its TTL, and the exit is promised within `--wait` + 0.5 s.
const LEAVE_QUICKLY: Duration = Duration::from_millis(250);
/// How long any other waiter that leaves without the lease (it shared a result, or was
/// superseded) may spend on it: a row left behind holds the waiters behind it up for its TTL.
const LEAVE: Duration = Duration::from_secs(2);

/// Why waiting ended without the lease.
enum Interrupted {
    Signal(i32),
    GaveUp,
}

/// Runs `what` unless a signal arrives or `--wait`'s limit passes first. Everything the waiter
/// does goes through here, statements included: a stuck acquire must not outlast either.
async fn interruptible<T>(
    what: impl Future<Output = T>,
    signals: &mut Signals,
    give_up_at: Option<Instant>,
) -> Result<T, Interrupted> {
    let give_up = async {
        match give_up_at {
            Some(t) => sleep_until(t).await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        // Signals first: one that arrived while a statement was stuck must win even if the
        // statement completes in the same instant, or the command could start after it. Then
        // the statement: a lease acquired as the wait runs out is used, not left to expire.
        biased;
        sig = signals.recv() => Err(Interrupted::Signal(sig)),
        r = what => Ok(r),
        _ = give_up => Err(Interrupted::GaveUp),
    }
}

/// Acquires the lease, waiting for it with `--wait`.
///
/// A waiter survives the database going away (a restart, a failover): it reports the outage
/// once, reconnects with backoff and carries on waiting, within its `--wait` limit
/// (`give_up_at`, which the caller computes once for all attempts). A signal
/// or the limit ends the wait at any point, even in the middle of a statement.
pub(super) async fn obtain(
    db: &mut Db,
    cfg: &RunConfig,
    me: &Me,
    signals: &mut Signals,
    (give_up_at, resume): (Option<Instant>, Resume),
) -> Result<Obtained> {
    let mut w = Waiter {
        listening: false,
        awaited: None,
        spinner: Spinner::default(),
        outage: None,
        last_error: None,
        ticket: resume.ticket,
        again: resume.again,
        requeued: false,
        hurried: false,
        since: None,
        next_notice: None,
        noticed: false,
    };
    let mut first = true;
    let result = loop {
        let attempt =
            on_heap(|| bounded(Instant::now() + STATEMENT_DEADLINE, w.attempt(db, cfg, me)));
        // Any --wait tries at least once, however short or already spent.
        let limit = match give_up_at {
            Some(g) if first => Some(g.max(Instant::now() + FIRST_TRY)),
            g => g,
        };
        first = false;
        let attempt = match interruptible(attempt, signals, limit).await {
            Ok(a) => a,
            Err(why) => break Ok(w.interrupted(why, cfg)),
        };
        // The schema check (and a migration it may need) is bounded by its own window, as
        // connecting bounded it, not by the acquiring statement's deadline.
        let attempt = match attempt {
            Ok(Attempt::CheckSchema) => {
                // However short `--wait`, the check gets the time connecting had for it, and
                // the acquisition after it counts as a first try again.
                let check = crate::db::deadline::check_schema(db);
                let limit = give_up_at.map(|g| g.max(Instant::now() + FIRST_CHECK));
                match interruptible(check, signals, limit).await {
                    Ok(Ok(())) => {
                        first = true;
                        continue;
                    }
                    Ok(Err(e)) => Err(e),
                    Err(why) => break Ok(w.interrupted(why, cfg)),
                }
            }
            other => other,
        };
        let wake = match attempt {
            Ok(Attempt::Done(obtained)) => break Ok(obtained),
            // (A schema check was made above.)
            Ok(Attempt::Again | Attempt::CheckSchema) => continue,
            Ok(Attempt::Wait(busy)) => {
                if cfg.wait.is_none() {
                    if !cfg.quiet {
                        say!("'{}' is busy: {}", cfg.target, describe_busy(&busy));
                    }
                    break Ok(Obtained::Done(Exit::Busy(cfg.busy_exit_code)));
                }
                w.outage = None;
                w.waiting(cfg, &busy);
                // Wake at the holder's expiry (or a stopping holder's deadline) or at the
                // fallback poll, unless a release of our target, a confirmed stop or a move of
                // its queue is announced first.
                let poll = if db.can_listen() {
                    WAIT_POLL
                } else {
                    POOLED_POLL
                };
                let wake = match (&busy.holder, &busy.stopping) {
                    (Some(h), _) => poll.min(h.expires_in + Duration::from_millis(20)),
                    (None, Some(st)) => poll.min(st.left + Duration::from_millis(20)),
                    (None, None) => poll,
                };
                // And in time for the next --wait-notice line.
                match w.next_notice {
                    Some(t) => wake.min(t.saturating_duration_since(Instant::now())),
                    None => wake,
                }
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
                w.last_error = Some(format!("{e:#}"));
                w.outage = Some(backoff);
                w.listening = false;
                backoff
            }
            Err(e) => break Err(e),
        };
        let woken = async {
            tokio::select! {
                _ = db::notify::announced(&mut db.notifications, &cfg.target) => {}
                _ = sleep(wake) => {}
            }
        };
        if let Err(why) = interruptible(woken, signals, give_up_at).await {
            break Ok(w.interrupted(why, cfg));
        }
        if w.outage.is_some() {
            let reconnect = on_heap(|| timeout(STATEMENT_DEADLINE, db.reconnect()));
            match interruptible(reconnect, signals, give_up_at).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => {
                    info!("reconnect failed: {e:#}");
                    w.last_error = Some(format!("{e:#}"));
                }
                Ok(Err(_)) => info!("reconnect timed out"),
                Err(why) => break Ok(w.interrupted(why, cfg)),
            }
        }
    };
    w.spinner.clear();
    match &result {
        // The acquiring statement took us out of the queue.
        Ok(Obtained::Lease(..)) => w.acquired(cfg),
        // Leave it, best-effort: otherwise the waiters behind wait out our TTL.
        _ => w.leave(db, cfg).await,
    }
    result
}

/// The one line of a busy caller that does not wait, or the start of it: a previous holder
/// still stopping.
fn describe_stopping(st: &waiters::Stopping) -> String {
    format!(
        "its previous holder {} (fence {}) is still stopping its command (at most {} more)",
        st.who,
        crate::fmt::fence(st.fence),
        crate::fmt::duration(st.left)
    )
}

fn mismatch(cfg: &RunConfig, in_force: i32) -> anyhow::Error {
    crate::error::usage(format!(
        "'{}' is held with --max-holders {in_force} (the N of its first holder stands until none is left); this caller asked for {}",
        cfg.target, cfg.max_holders
    ))
}

/// The one line of a busy caller that does not wait: the holder, or the queue that goes first.
fn describe_busy(busy: &Busy) -> String {
    let n = busy.waiting;
    let callers = if n == 1 { "caller" } else { "callers" };
    let places = match busy.in_force {
        1 => String::new(),
        max => format!(
            "{} of {max} places held; the first to expire is ",
            busy.holders
        ),
    };
    match (&busy.holder, &busy.next) {
        (Some(h), _) if n == 0 => format!("{places}{}", h.describe()),
        (Some(h), _) => format!("{places}{}; {n} {callers} waiting", h.describe()),
        (None, _) if busy.stopping.is_some() && busy.ahead == 0 => {
            describe_stopping(busy.stopping.as_ref().unwrap())
        }
        (None, next) => {
            let next = next
                .as_ref()
                .map_or(String::new(), |w| format!(" (next: {w})"));
            format!("not held, but {n} {callers} queue for it{next}; only --wait joins the queue")
        }
    }
}

/// The state of one caller waiting for a lease.
struct Waiter {
    listening: bool,
    /// The acquisition whose result we wait for (singleflight with --reuse-within).
    awaited: Option<i64>,
    spinner: Spinner,
    /// Backoff while the database is unreachable.
    outage: Option<Duration>,
    /// The last error while the database was unreachable, for the give-up line.
    last_error: Option<String>,
    /// Our place in the queue, once we wait.
    ticket: Option<Ticket>,
    /// The place we had before our lease could not be started in time: we join at it again.
    again: Option<Ticket>,
    /// `queued_until` was recomputed for the busy state we saw (see [`waiters::requeue`]): not
    /// again until something changed.
    requeued: bool,
    /// The wait ended by `--wait`'s limit or a signal: leave the queue quickly.
    hurried: bool,
    /// When we first found the target busy.
    since: Option<Instant>,
    /// When the next `--wait-notice` line is due.
    next_notice: Option<Instant>,
    /// Whether the wait was reported: a `--wait-notice` line, or the spinner.
    noticed: bool,
}

enum Attempt {
    Done(Obtained),
    /// Try again at once.
    Again,
    /// Busy: the holder and the queue.
    Wait(Busy),
    /// The schema is to be checked (and perhaps migrated) first; then try again.
    CheckSchema,
}

impl Waiter {
    async fn attempt(&mut self, db: &mut Db, cfg: &RunConfig, me: &Me) -> Result<Attempt> {
        if let (Some(_), Some(fence)) = (cfg.reuse_within, self.awaited) {
            if let Some(exit) = share_awaited(db, cfg, fence).await? {
                return Ok(Attempt::Done(Obtained::Done(exit)));
            }
        }
        let sent = Instant::now();
        let granted = |lease, listening, ticket| {
            Ok(Attempt::Done(Obtained::Lease(Granted {
                lease,
                sent,
                answered: Instant::now(),
                listening,
                ticket,
            })))
        };
        let who = Contender {
            token: me.token,
            ttl: cfg.ttl,
            host: &me.host,
            pid: me.pid,
            label: cfg.label.as_deref(),
            ticket: self.ticket,
            max_holders: cfg.max_holders,
        };
        let Some(acquired) = self.acquire(db, cfg, &who).await? else {
            return Ok(Attempt::CheckSchema);
        };
        let busy = match acquired {
            Acquired::Held(l) => return granted(l, self.listening, self.ticket),
            Acquired::Busy(_) if cfg.replace => {
                return match leases::replace(&db.client, &db.schema, &cfg.target, &who).await? {
                    Acquired::Held(l) => granted(l, self.listening, self.ticket),
                    Acquired::Mismatch { in_force } => Err(mismatch(cfg, in_force)),
                    Acquired::Busy(_) => Ok(Attempt::Again),
                };
            }
            Acquired::Busy(b) => b,
            Acquired::Mismatch { in_force } => return Err(mismatch(cfg, in_force)),
        };
        // `--slot`: a holder doing this very slot leaves nothing to do (a skip), `--wait` or not.
        if let Some(exit) = super::slot::skip_if_running(db, cfg, me).await? {
            return Ok(Attempt::Done(Obtained::Done(exit)));
        }
        match &busy.mine {
            Some(Place::Superseded(by)) => {
                if !cfg.quiet {
                    say!(
                        "superseded in the queue for '{}' by {by} (--queue latest)",
                        cfg.target
                    );
                }
                return Ok(Attempt::Done(Obtained::Done(Exit::Busy(
                    cfg.busy_exit_code,
                ))));
            }
            // Our row's TTL ran out (we were paused, or cut off, for that long): we lost our
            // place and join again, at the back.
            Some(Place::Lost) => {
                info!(
                    "lost our place in the queue for '{}'; joining again",
                    cfg.target
                );
                self.ticket = None;
            }
            Some(Place::Position(_)) | None => {}
        }
        let free = busy.holder.is_none() && busy.stopping.is_none() && busy.ahead == 0;
        // Released since our attempt, and nobody goes first: just try again. (Without a place,
        // the lease row's word that waiters may exist counts, as it did for the attempt.)
        if free && (self.ticket.is_some() || !busy.queued) {
            self.requeued = false;
            return Ok(Attempt::Again);
        }
        // Free, nobody queues, but the row still says someone may: the waiters that made it
        // say so have left or acquired. Correct it (under the target's lock) and try again.
        if free && !self.requeued {
            self.requeued = true;
            let queued = waiters::requeue(&db.client, &db.schema, &cfg.target).await?;
            info!(
                "'{}' had no live waiter left in its queue{}",
                cfg.target,
                if queued { ", but one joined since" } else { "" }
            );
            return Ok(Attempt::Again);
        }
        self.requeued = false;
        if cfg.wait.is_none() {
            return Ok(Attempt::Wait(busy));
        }
        if self.ticket.is_none() {
            let me = (me.host.as_str(), me.pid, cfg.label.as_deref());
            let ttl = waiter_ttl(cfg.ttl);
            let again = self.again.take().map(|t| t.number);
            let how = (cfg.queue, again);
            let t = waiters::join(&db.client, &db.schema, &cfg.target, how, ttl, me).await?;
            match again {
                Some(_) => info!(
                    "queued again for '{}' in our old place (ticket {})",
                    cfg.target, t.number
                ),
                None => info!("queued for '{}' (ticket {})", cfg.target, t.number),
            }
            self.ticket = Some(t);
            // Try again at once, now with our place: the target may be free with nobody ahead.
            return Ok(Attempt::Again);
        }
        if !self.listening && db.can_listen() {
            self.listening = true;
            // LISTEN may be unavailable (e.g. behind a transaction pooler); polling still works.
            match db::notify::listen(&db.client, &db.schema.lease_channel()).await {
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
        if let Some(holder) = &busy.holder {
            if self.awaited != Some(holder.fence) {
                info!("waiting for '{}': {}", cfg.target, holder.describe());
                self.awaited = Some(holder.fence);
            }
        }
        Ok(Attempt::Wait(busy))
    }

    /// The acquiring statement. On a connection whose schema is still unchecked (the first
    /// attempt of a run), it goes in one flight with the check and the LISTEN that the
    /// heartbeat or the wait would send next ([`Db::first`]): one round trip for all three.
    /// `None` when the schema must be checked (and perhaps migrated) first, as a connection
    /// always did, before the statement is sent alone: the flight did not commit, or the
    /// statement cannot go in it (`--max-holders` above 1 opens a transaction of its own).
    async fn acquire(
        &mut self,
        db: &mut Db,
        cfg: &RunConfig,
        who: &Contender<'_>,
    ) -> Result<Option<Acquired>> {
        if !db.schema_checked() {
            if cfg.max_holders > 1 {
                return Ok(None);
            }
            let work = leases::acquire(&db.client, &db.schema, &cfg.target, who);
            return match crate::db::deadline::first(db, db.first(work)).await? {
                First::Committed(c) => {
                    let (acquired, listening) = db.accept(c);
                    self.listening |= listening;
                    Ok(Some(acquired))
                }
                First::Redo => Ok(None),
            };
        }
        leases::acquire(&db.client, &db.schema, &cfg.target, who)
            .await
            .map(Some)
    }

    /// Shows where we stand: on a terminal in the spinner; otherwise one line every
    /// `--wait-notice` (the first after one interval, so that a short wait stays silent in logs).
    fn waiting(&mut self, cfg: &RunConfig, busy: &Busy) {
        let now = Instant::now();
        let since = *self.since.get_or_insert(now);
        let msg = standing(cfg, busy);
        if std::io::stderr().is_terminal() {
            self.spinner.show(msg);
            self.noticed = true;
            return;
        }
        let Some(every) = cfg.wait_notice.filter(|_| !cfg.quiet) else {
            return;
        };
        let due = *self
            .next_notice
            .get_or_insert_with(|| crate::model::time::deadline(since, every));
        if now >= due {
            say!("{msg}");
            self.noticed = true;
            self.next_notice = Some(crate::model::time::deadline(now, every));
        }
    }

    /// After a wait that was reported (a `--wait-notice` line, or the spinner): one line with
    /// how long it took (unless `--wait-notice 0` or `--quiet`).
    fn acquired(&self, cfg: &RunConfig) {
        let wanted = self.noticed && cfg.wait_notice.is_some() && !cfg.quiet;
        if let (Some(since), true) = (self.since, wanted) {
            say!(
                "acquired '{}' after waiting {}",
                cfg.target,
                crate::fmt::duration(since.elapsed())
            );
        }
    }

    /// Leaves the queue, if we joined it: best-effort, briefly (a signal may be waiting for
    /// our exit, `--wait`'s limit has passed, and a row left behind only costs the others its
    /// TTL).
    async fn leave(&mut self, db: &Db, cfg: &RunConfig) {
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        let until = Instant::now() + if self.hurried { LEAVE_QUICKLY } else { LEAVE };
        let leave = waiters::leave(&db.client, &db.schema, ticket);
        if let Err(e) = bounded(until, leave).await {
            info!(
                "could not leave the queue for '{}' ({e:#}); it expires with its TTL",
                cfg.target
            );
        }
    }

    /// The exit code when waiting ends without the lease.
    fn interrupted(&mut self, why: Interrupted, cfg: &RunConfig) -> Obtained {
        self.spinner.clear();
        self.hurried = true;
        match why {
            Interrupted::Signal(sig) => Obtained::Done(Exit::from_signal(sig)),
            Interrupted::GaveUp => {
                if !cfg.quiet {
                    let waited = match cfg.wait {
                        Some(Wait::Upto(d)) => d,
                        _ => Duration::ZERO,
                    };
                    let why = match (&self.outage, &self.last_error) {
                        (Some(_), Some(e)) => format!(" (the database did not answer: {e})"),
                        _ => String::new(),
                    };
                    say!(
                        "gave up waiting for '{}' after {}{why}",
                        cfg.target,
                        crate::fmt::duration(waited)
                    );
                }
                Obtained::Done(Exit::Busy(cfg.busy_exit_code))
            }
        }
    }
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
        Outcome::Lost | Outcome::Interrupted | Outcome::Skipped | Outcome::Preempted => {
            return Ok(None)
        }
    };
    if truncated {
        return Ok(None);
    }
    info!(
        "sharing the result of run {} (fence {})",
        run.id,
        crate::fmt::fence(fence)
    );
    print_stdout(cfg, &run.stdout)?;
    Ok(Some(Exit::Code(exit)))
}

/// `waiting for 'deploy' (position 2 of 3; held by ci-7 pid 4411 [abc123], running 3m12s)`.
fn standing(cfg: &RunConfig, busy: &Busy) -> String {
    let place = match &busy.mine {
        Some(Place::Position(p)) => format!("position {p} of {}", busy.waiting),
        _ => format!("{} waiting", busy.waiting),
    };
    let held = match (&busy.holder, &busy.next) {
        (Some(h), _) if busy.in_force > 1 => format!(
            "{} of {} places held; next to free: {}, running {}",
            busy.holders,
            busy.in_force,
            h.who(),
            crate::fmt::duration(h.running)
        ),
        (Some(h), _) => format!(
            "held by {}, running {}",
            h.who(),
            crate::fmt::duration(h.running)
        ),
        (None, _) if busy.stopping.is_some() => describe_stopping(busy.stopping.as_ref().unwrap()),
        (None, Some(next)) => format!("not held; next in line: {next}"),
        (None, None) => "not held".to_owned(),
    };
    format!("waiting for '{}' ({place}; {held})", cfg.target)
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
