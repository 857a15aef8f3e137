//! `leasectl relay`: the loop that moves outbox events to a sink.
//!
//! One batch is one transaction: BEGIN and the claim ([`outbox::claim`], which deletes the rows
//! it returns) go out together; then the events are published — aggregates concurrently, each
//! aggregate's events one after another, stopping at its first failure; then whatever was not
//! confirmed is put back ([`outbox::restore`]) and the transaction commits. Nothing is ever
//! marked delivered before the sink confirmed it, and a relay that dies mid-batch loses
//! nothing: its transaction rolls back and the events are published again (at-least-once).
//!
//! Failures:
//! * the sink refused an event → it gets an attempt, a backoff (1s doubling to 5m, ±20%
//!   jitter) and, after `--max-attempts`, is dead; its aggregate waits, others carry on;
//! * the sink is unreachable → nothing is charged; the relay backs off (1s doubling to 30s)
//!   and tries again (with `--once` it exits 69 instead);
//! * the database connection is lost → reconnect with backoff; the batch in flight rolled back
//!   and will be published again.
//!
//! Waking: LISTEN on `<schema>.outbox` (the insert trigger and `leasectl run`'s save NOTIFY
//! it), else `--poll`, else the earliest retry falling due. SIGINT/SIGTERM finish the batch in
//! hand and exit 0; a second one exits at once (that batch is published again later).

use std::cell::RefCell;
use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use futures_util::StreamExt;
use indicatif::ProgressBar;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::db::{self, Db};
use crate::exit::{Exit, Failure};
use crate::fmt;
use crate::outbox::{self, Claimed, Settle, Statements};
use crate::sink::{DeliveryError, Sink, SinkOptions, SinkSpec};

/// First retry delay after a refused delivery; doubles per attempt up to [`RETRY_CAP`].
const RETRY_BASE: Duration = Duration::from_secs(1);
const RETRY_CAP: Duration = Duration::from_secs(300);
/// Backoff while the sink or the database is unreachable.
const OUTAGE_BASE: Duration = Duration::from_secs(1);
const OUTAGE_CAP: Duration = Duration::from_secs(30);
/// While the sink stays down, the warning is repeated this often (services run without `-v`).
const OUTAGE_REMINDER: Duration = Duration::from_secs(300);
/// The relay vacuums the outbox after deleting this many rows (autovacuum looks only once a
/// minute, and a fast relay can churn through millions of rows in that time).
const VACUUM_EVERY: u64 = 20_000;
/// How often `-v` reports throughput.
const REPORT_EVERY: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct RelayConfig {
    pub sink: SinkSpec,
    pub batch: i64,
    pub once: bool,
    pub poll: Duration,
    pub max_attempts: i32,
    pub timeout: Duration,
    pub parallel: Option<usize>,
}

/// Runs the relay until `--once` has drained what was due, or a signal arrives.
pub async fn run(mut db: Db, cfg: RelayConfig) -> Result<Exit> {
    let stop = Stop::install()?;
    let sink = Sink::open(
        &cfg.sink,
        SinkOptions {
            timeout: cfg.timeout,
        },
    )?;
    let mut relay = Relay {
        stmts: Statements::prepare(&db.client, &db.schema).await?,
        parallel: cfg.parallel.unwrap_or_else(|| sink.parallelism()).max(1),
        sink,
        up_to_seq: i64::MAX,
        listening: false,
        progress: Progress::new(&cfg),
        since_vacuum: 0,
        vacuum: true,
        cfg,
    };
    if relay.cfg.once {
        relay.up_to_seq = outbox::max_seq(&db.client, &db.schema).await?;
    } else {
        relay.listen(&db).await?;
    }
    info!(
        "relaying schema \"{}\" to {} (batch {}, {} aggregates at a time{})",
        db.schema.name(),
        relay.cfg.sink.describe(),
        relay.cfg.batch,
        relay.parallel,
        if relay.cfg.once { ", once" } else { "" }
    );
    let result = relay.main_loop(&mut db, &stop).await;
    relay.progress.finish();
    result
}

struct Relay {
    cfg: RelayConfig,
    sink: Sink,
    stmts: Statements,
    parallel: usize,
    /// `--once` publishes only events that existed when it started.
    up_to_seq: i64,
    listening: bool,
    progress: Progress,
    since_vacuum: u64,
    vacuum: bool,
}

/// What one batch did.
#[derive(Debug, Default)]
struct BatchReport {
    claimed: usize,
    delivered: usize,
    /// Set when the sink could not be reached: the message.
    sink_down: Option<String>,
}

impl Relay {
    async fn main_loop(&mut self, db: &mut Db, stop: &Stop) -> Result<Exit> {
        let mut sink_outage = Outage::new(self.cfg.sink.describe());
        let mut db_outage = Backoff::new(OUTAGE_BASE, OUTAGE_CAP);
        loop {
            if stop.requested() {
                return Ok(Exit::Code(0));
            }
            // Notifications that arrived while we were busy are answered by this very claim.
            while db.notifications.try_recv().is_ok() {}
            let report = match self.batch(db).await {
                Ok(r) => r,
                Err(e) => {
                    let Some(pg) = e.downcast_ref::<tokio_postgres::Error>() else {
                        return Err(e);
                    };
                    if !db::is_unavailable(pg) || self.cfg.once {
                        return Err(e);
                    }
                    // Also a statement timeout: a fresh session is the cure for a stuck one.
                    warn!(
                        "database connection failed ({}); reconnecting",
                        db::reason(pg)
                    );
                    self.reconnect(db, stop, &mut db_outage).await?;
                    continue;
                }
            };
            db_outage.reset();
            self.progress.batch(&report);
            self.maybe_vacuum(db, report.delivered).await;

            if let Some(msg) = report.sink_down {
                if self.cfg.once || matches!(self.sink, Sink::Stdout(_)) {
                    return Err(Failure::Unavailable(format!(
                        "{}: {msg}; undelivered events stay in the outbox",
                        self.cfg.sink.describe()
                    ))
                    .into());
                }
                let delay = sink_outage.down(&msg);
                tokio::select! {
                    _ = tokio::time::sleep(delay) => {}
                    _ = stop.wait() => return Ok(Exit::Code(0)),
                }
                continue;
            }
            sink_outage.up();
            if report.claimed > 0 {
                continue;
            }
            if self.cfg.once {
                return Ok(Exit::Code(0));
            }
            self.idle(db, stop).await?;
        }
    }

    /// Claims, publishes and settles one batch in one transaction.
    async fn batch(&mut self, db: &Db) -> Result<BatchReport> {
        let client = &db.client;
        let (begun, claimed) = tokio::join!(
            client.batch_execute("BEGIN"),
            outbox::claim(client, &self.stmts, self.cfg.batch, self.up_to_seq)
        );
        begun?;
        let claimed = match claimed {
            Ok(c) => c,
            Err(e) => {
                let _ = client.batch_execute("ROLLBACK").await;
                return Err(e.into());
            }
        };
        if claimed.is_empty() {
            client.batch_execute("ROLLBACK").await?;
            return Ok(BatchReport::default());
        }
        let (settled, sink_down) = self.publish(&claimed).await;
        let delivered = settled
            .iter()
            .filter(|s| matches!(s, Settle::Delivered))
            .count();
        let finish = async {
            outbox::restore(client, &db.schema, &claimed, &settled).await?;
            client.batch_execute("COMMIT").await
        };
        if let Err(e) = finish.await {
            let _ = client.batch_execute("ROLLBACK").await;
            if delivered > 0 {
                warn!(
                    "could not record {delivered} delivered events ({}); they will be published again",
                    db::reason(&e)
                );
            }
            return Err(e.into());
        }
        self.report_failures(&claimed, &settled);
        Ok(BatchReport {
            claimed: claimed.len(),
            delivered,
            sink_down,
        })
    }

    /// Publishes a claimed batch. Returns each event's fate and, if the sink was unreachable,
    /// why (everything not yet confirmed is then left untouched).
    async fn publish(&self, claimed: &[Claimed]) -> (Vec<Settle>, Option<String>) {
        let down: RefCell<Option<String>> = RefCell::new(None);
        let mut settled = vec![Settle::Untouched; claimed.len()];
        if self.parallel == 1 {
            // In seq order; an aggregate that failed is skipped for the rest of the batch.
            let mut stopped: Vec<(&str, &str)> = Vec::new();
            for (i, c) in claimed.iter().enumerate() {
                let key = (
                    c.event.aggregate_type.as_str(),
                    c.event.aggregate_id.as_str(),
                );
                if down.borrow().is_some() {
                    break;
                }
                if stopped.contains(&key) {
                    continue;
                }
                let s = self.deliver_one(c, &down).await;
                if !matches!(s, Settle::Delivered) {
                    stopped.push(key);
                }
                settled[i] = s;
            }
        } else {
            let chains = chains(claimed);
            let results: Vec<Vec<(usize, Settle)>> = futures_util::stream::iter(chains)
                .map(|chain| {
                    let down = &down;
                    async move {
                        let mut out = Vec::with_capacity(chain.len());
                        for i in chain {
                            if down.borrow().is_some() {
                                break;
                            }
                            let s = self.deliver_one(&claimed[i], down).await;
                            let ok = matches!(s, Settle::Delivered);
                            out.push((i, s));
                            if !ok {
                                break;
                            }
                        }
                        out
                    }
                })
                .buffer_unordered(self.parallel)
                .collect()
                .await;
            for (i, s) in results.into_iter().flatten() {
                settled[i] = s;
            }
        }
        if let Err(e) = self.sink.flush().await {
            for s in settled.iter_mut() {
                if matches!(s, Settle::Delivered) {
                    *s = Settle::Untouched;
                }
            }
            down.borrow_mut().get_or_insert(e.to_string());
        }
        (settled, down.into_inner())
    }

    async fn deliver_one(&self, c: &Claimed, down: &RefCell<Option<String>>) -> Settle {
        if c.blocked {
            return Settle::Untouched;
        }
        match self.sink.deliver(&c.event).await {
            Ok(()) => Settle::Delivered,
            Err(DeliveryError::Unavailable(msg)) => {
                down.borrow_mut().get_or_insert(msg);
                Settle::Untouched
            }
            Err(DeliveryError::Rejected(error)) => {
                let attempt = c.attempts.saturating_add(1);
                Settle::Failed {
                    error,
                    retry_in: retry_delay(attempt, fastrand::f64()),
                    dead: attempt >= self.cfg.max_attempts,
                }
            }
        }
    }

    fn report_failures(&self, claimed: &[Claimed], settled: &[Settle]) {
        for (c, s) in claimed.iter().zip(settled) {
            let Settle::Failed {
                error,
                retry_in,
                dead,
            } = s
            else {
                continue;
            };
            let e = &c.event;
            let what = format!(
                "event {} ({} {}, {})",
                e.id, e.aggregate_type, e.aggregate_id, e.event_type
            );
            let attempt = c.attempts.saturating_add(1);
            if *dead {
                warn!(
                    "{what} is dead after {attempt} attempts: {error}; later events of its aggregate wait until `leasectl outbox retry {}` or `outbox discard {}`",
                    e.id, e.id
                );
            } else {
                warn!(
                    "{what} failed (attempt {attempt} of {}): {error}; retrying in {}",
                    self.cfg.max_attempts,
                    fmt::duration(*retry_in)
                );
            }
        }
    }

    /// Waits for a NOTIFY, the poll interval, the earliest retry falling due, or a signal.
    async fn idle(&mut self, db: &mut Db, stop: &Stop) -> Result<()> {
        let mut wait = self.cfg.poll;
        match outbox::next_retry_in(&db.client, &db.schema).await {
            Ok(Some(due)) => wait = wait.min(due.max(Duration::from_millis(10))),
            Ok(None) => {}
            // The next claim reports (and recovers from) a lost connection.
            Err(_) => return Ok(()),
        }
        self.progress.idle(&db.client, &db.schema).await;
        tokio::select! {
            n = db.notifications.recv() => {
                if n.is_none() {
                    // The connection is gone: let the next claim notice and reconnect, but not
                    // in a tight loop.
                    tokio::time::sleep(OUTAGE_BASE.min(self.cfg.poll)).await;
                }
            }
            _ = tokio::time::sleep(wait) => {}
            _ = stop.wait() => {}
        }
        Ok(())
    }

    async fn listen(&mut self, db: &Db) -> Result<()> {
        let sql = format!("LISTEN \"{}\"", db.schema.outbox_channel());
        match db.client.batch_execute(&sql).await {
            Ok(()) => self.listening = true,
            Err(e) if db::is_unavailable(&e) => return Err(e.into()),
            // Behind a transaction pooler LISTEN may not work; polling still does.
            Err(e) => warn!(
                "LISTEN failed ({}); new events are found by polling every {}",
                db::reason(&e),
                fmt::duration(self.cfg.poll)
            ),
        }
        Ok(())
    }

    async fn reconnect(&mut self, db: &mut Db, stop: &Stop, backoff: &mut Backoff) -> Result<()> {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(backoff.next()) => {}
                _ = stop.wait() => return Ok(()),
            }
            let attempt = async {
                db.reconnect().await?;
                self.stmts = Statements::prepare(&db.client, &db.schema).await?;
                self.listen(db).await
            };
            match attempt.await {
                Ok(()) => {
                    warn!("reconnected to the database");
                    return Ok(());
                }
                Err(e) if Exit::from_error(&e) == Exit::Unavailable => {
                    info!("still cannot reach the database: {e:#}");
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Vacuums the outbox after heavy draining so it and its indexes stay small. Best effort:
    /// a role that may not vacuum the table leaves it to autovacuum.
    async fn maybe_vacuum(&mut self, db: &Db, delivered: usize) {
        self.since_vacuum += delivered as u64;
        if !self.vacuum || self.since_vacuum < VACUUM_EVERY {
            return;
        }
        self.since_vacuum = 0;
        let started = Instant::now();
        let sql = db.schema.sql("VACUUM (SKIP_LOCKED) {s}.outbox");
        match db.client.batch_execute(&sql).await {
            Ok(()) => info!(
                "vacuumed the outbox in {}",
                fmt::duration(started.elapsed())
            ),
            Err(e) => {
                info!(
                    "cannot vacuum the outbox ({}); leaving it to autovacuum",
                    db::reason(&e)
                );
                self.vacuum = false;
            }
        }
    }
}

/// The claimed events grouped by aggregate, each group in `seq` order, groups in the order of
/// their first event.
fn chains(claimed: &[Claimed]) -> Vec<Vec<usize>> {
    let mut index: HashMap<(&str, &str), usize> = HashMap::new();
    let mut chains: Vec<Vec<usize>> = Vec::new();
    for (i, c) in claimed.iter().enumerate() {
        let key = (
            c.event.aggregate_type.as_str(),
            c.event.aggregate_id.as_str(),
        );
        let n = *index.entry(key).or_insert_with(|| {
            chains.push(Vec::new());
            chains.len() - 1
        });
        chains[n].push(i);
    }
    chains
}

/// The wait before attempt `attempt + 1` after `attempt` refusals: 1s, 2s, 4s … capped at 5m,
/// then scaled by a jitter factor from 0.8 to 1.2 (`unit` is uniform in [0, 1)) so that events
/// that failed together do not retry in lockstep.
pub fn retry_delay(attempt: i32, unit: f64) -> Duration {
    let doublings = u32::try_from(attempt.saturating_sub(1).clamp(0, 30)).unwrap_or(0);
    let base = RETRY_BASE
        .saturating_mul(1u32 << doublings.min(20))
        .min(RETRY_CAP);
    base.mul_f64(0.8 + 0.4 * unit.clamp(0.0, 1.0))
}

/// A sink outage: backoff between tries, and a warning when it starts, every
/// [`OUTAGE_REMINDER`] while it lasts, and when it ends (details with `-v`).
struct Outage {
    sink: String,
    backoff: Backoff,
    since: Option<Instant>,
    warned: Option<Instant>,
}

impl Outage {
    fn new(sink: String) -> Outage {
        Outage {
            sink,
            backoff: Backoff::new(OUTAGE_BASE, OUTAGE_CAP),
            since: None,
            warned: None,
        }
    }

    /// Records a failed try; returns how long to wait before the next one.
    fn down(&mut self, msg: &str) -> Duration {
        let delay = self.backoff.next();
        let now = Instant::now();
        let sink = &self.sink;
        match self.since {
            None => {
                self.since = Some(now);
                self.warned = Some(now);
                warn!("{sink} is unavailable ({msg}); retrying with backoff, no event is charged an attempt");
            }
            Some(since) if self.warned.is_none_or(|w| w.elapsed() >= OUTAGE_REMINDER) => {
                self.warned = Some(now);
                warn!(
                    "{sink} still unavailable after {} ({msg})",
                    fmt::duration(since.elapsed())
                );
            }
            Some(_) => info!(
                "{sink} still unavailable ({msg}); next try in {}",
                fmt::duration(delay)
            ),
        }
        delay
    }

    /// Records a successful batch, ending any outage.
    fn up(&mut self) {
        if let Some(since) = self.since.take() {
            warn!(
                "{} is reachable again after {}",
                self.sink,
                fmt::duration(since.elapsed())
            );
            self.backoff.reset();
        }
    }
}

/// Exponential backoff with jitter for outages.
struct Backoff {
    base: Duration,
    cap: Duration,
    current: Duration,
}

impl Backoff {
    fn new(base: Duration, cap: Duration) -> Backoff {
        Backoff {
            base,
            cap,
            current: base,
        }
    }

    fn next(&mut self) -> Duration {
        let d = self.current;
        self.current = (self.current * 2).min(self.cap);
        d.mul_f64(0.8 + 0.4 * fastrand::f64())
    }

    fn reset(&mut self) {
        self.current = self.base;
    }
}

/// SIGINT/SIGTERM: the first asks the loop to stop after the batch in hand; a second exits at
/// once with 128+N (the unfinished batch rolls back and is published again later).
struct Stop {
    flag: Arc<AtomicBool>,
    notify: Arc<Notify>,
}

impl Stop {
    fn install() -> Result<Stop> {
        use tokio::signal::unix::{signal, SignalKind};
        let mut int = signal(SignalKind::interrupt()).context("cannot install signal handlers")?;
        let mut term = signal(SignalKind::terminate()).context("cannot install signal handlers")?;
        let flag = Arc::new(AtomicBool::new(false));
        let notify = Arc::new(Notify::new());
        let (f, n) = (flag.clone(), notify.clone());
        tokio::spawn(async move {
            let first = next_signal(&mut int, &mut term).await;
            info!("signal {first}: finishing the batch in hand, then exiting");
            f.store(true, Ordering::SeqCst);
            n.notify_one();
            let second = next_signal(&mut int, &mut term).await;
            eprintln!(
                "leasectl: second signal ({second}): exiting now; the batch in hand will be published again"
            );
            std::process::exit(i32::from(crate::exit::signal_code(second)));
        });
        Ok(Stop { flag, notify })
    }

    fn requested(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    async fn wait(&self) {
        if !self.requested() {
            self.notify.notified().await;
            // Leave the permit for the next waiter.
            self.notify.notify_one();
        }
    }
}

async fn next_signal(
    int: &mut tokio::signal::unix::Signal,
    term: &mut tokio::signal::unix::Signal,
) -> i32 {
    tokio::select! {
        _ = int.recv() => libc::SIGINT,
        _ = term.recv() => libc::SIGTERM,
    }
}

/// The indicatif line on a terminal (events/s and backlog), and `-v` throughput reports.
struct Progress {
    bar: Option<ProgressBar>,
    started: Instant,
    delivered: u64,
    window_start: Instant,
    window_delivered: u64,
    last_backlog: Option<Instant>,
    backlog: Option<outbox::Backlog>,
}

impl Progress {
    fn new(cfg: &RelayConfig) -> Progress {
        // The stdout sink's own output would fight with the line if both were a terminal.
        let bar = (std::io::stderr().is_terminal() && !crate::log::verbose()).then(|| {
            let pb = ProgressBar::new_spinner();
            pb.enable_steady_tick(Duration::from_millis(200));
            pb.set_message(format!("relaying to {}", cfg.sink.describe()));
            pb
        });
        Progress {
            bar,
            started: Instant::now(),
            delivered: 0,
            window_start: Instant::now(),
            window_delivered: 0,
            last_backlog: None,
            backlog: None,
        }
    }

    fn batch(&mut self, r: &BatchReport) {
        self.delivered += r.delivered as u64;
        self.window_delivered += r.delivered as u64;
        let elapsed = self.window_start.elapsed();
        if elapsed >= REPORT_EVERY {
            if self.window_delivered > 0 {
                info!(
                    "delivered {} events in the last {} ({:.0}/s), {} in all",
                    self.window_delivered,
                    fmt::duration(elapsed),
                    self.window_delivered as f64 / elapsed.as_secs_f64(),
                    self.delivered
                );
            }
            self.window_start = Instant::now();
            self.window_delivered = 0;
        }
        self.draw();
    }

    /// Refreshes the backlog figures (at most once a second, and only for the terminal line).
    async fn idle(&mut self, client: &tokio_postgres::Client, schema: &crate::db::Schema) {
        if self.bar.is_none()
            || self
                .last_backlog
                .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            return;
        }
        self.last_backlog = Some(Instant::now());
        self.backlog = outbox::backlog(client, schema).await.ok();
        self.draw();
    }

    fn draw(&self) {
        let Some(bar) = &self.bar else { return };
        let secs = self.started.elapsed().as_secs_f64().max(0.001);
        let mut msg = format!(
            "{} delivered, {:.0} events/s",
            self.delivered,
            self.delivered as f64 / secs
        );
        if let Some(b) = self.backlog {
            msg.push_str(&format!(
                "; backlog {} pending ({} retrying), {} dead",
                b.pending, b.retrying, b.dead
            ));
        }
        bar.set_message(msg);
    }

    fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        info!(
            "delivered {} events in {}",
            self.delivered,
            fmt::duration(self.started.elapsed())
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_delays_double_from_one_second_and_cap_at_five_minutes() {
        let mid = |a| retry_delay(a, 0.5);
        assert_eq!(mid(1), Duration::from_secs(1));
        assert_eq!(mid(2), Duration::from_secs(2));
        assert_eq!(mid(3), Duration::from_secs(4));
        assert_eq!(mid(9), Duration::from_secs(256));
        assert_eq!(mid(10), Duration::from_secs(300));
        assert_eq!(mid(1000), Duration::from_secs(300));
        assert_eq!(retry_delay(1, 0.0), Duration::from_millis(800));
        let top = retry_delay(1, 0.999_999);
        assert!(top > Duration::from_millis(1199) && top < Duration::from_millis(1200));
        assert!(retry_delay(10, 1.0) <= Duration::from_secs(360));
        assert_eq!(retry_delay(0, 0.5), Duration::from_secs(1));
    }

    #[test]
    fn backoff_doubles_to_its_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_secs(1), Duration::from_secs(30));
        let seen: Vec<Duration> = (0..8).map(|_| b.next()).collect();
        assert!(seen[0] >= Duration::from_millis(800) && seen[0] <= Duration::from_millis(1200));
        assert!(seen[7] >= Duration::from_secs(24) && seen[7] <= Duration::from_secs(36));
        b.reset();
        assert!(b.next() <= Duration::from_millis(1200));
    }
}
