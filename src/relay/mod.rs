//! `leasectl relay`: the loop that moves outbox events to a sink.
//!
//! One batch is one transaction: BEGIN and the claim ([`outbox::claim`], which deletes the rows
//! it returns) go out together; then the events are published ([`publish`]: aggregates
//! concurrently, each aggregate's events one after another, stopping at its first failure);
//! then whatever was not confirmed is put back and the transaction commits
//! ([`outbox::settle`]). Nothing is ever
//! marked delivered before the sink confirmed it, and a relay that dies mid-batch loses
//! nothing: its transaction rolls back and the events are published again (at-least-once).
//!
//! While batches come back full (a backlog), publishing takes longer than claiming, and every
//! event of a batch was delivered, the next batch is claimed on a second connection while this
//! one is published (`Ahead`; the
//! statement's side is "Claiming ahead" in [`outbox`]), so the sink never waits for the
//! database between batches. The two batches commit in order, and the second is published only
//! after the first committed.
//!
//! Failures ([`backoff`]):
//! * the sink refused an event → it gets an attempt, a backoff (1s doubling to 5m, ±20%
//!   jitter) and, after `--max-attempts`, is dead; its aggregate waits, others carry on;
//! * the sink is unreachable → nothing is charged; the relay backs off (1s doubling to 30s)
//!   and tries again (with `--once` it exits 69 instead);
//! * the database connection is lost, or a statement goes unanswered past its deadline, or the
//!   batch's transaction may have ended → drop the connection and reconnect with backoff; the
//!   batch in flight rolls back with its session and will be published again ([`liveness`]);
//!   `--once` exits 69 instead.
//!
//! Waking: LISTEN on `<schema>.outbox` (the insert trigger and `leasectl run`'s save NOTIFY
//! it; the trigger only while a relay holds the idle mark, see [`wake`]), else `--poll`, else
//! the earliest retry falling due. SIGINT/SIGTERM cancel a
//! [`CancellationToken`] ([`crate::signals::cancel_on_stop`]): the batch in hand is finished and
//! the relay exits 0; a second signal drops the batch at once — its transaction rolls back, so
//! it is published again later — and exits 128+N. [`progress`] is the terminal line and `-v`
//! reports; [`sink`] holds one module per sink.
//!
//! The dead-man switch rides along: before a batch, at most once a second, the relay
//! evaluates the watched targets' health and opens or closes their incidents, each with one
//! outbox event ([`crate::health::reconcile`]); `--once` evaluates once, before it drains.

pub mod backoff;
pub mod liveness;
pub mod metrics;
pub mod progress;
pub mod publish;
pub mod sink;
pub mod wake;

use std::time::Duration;

use anyhow::Result;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::db::{self, Db};
use crate::exit::{Exit, Failure};
use crate::fmt;
use crate::model::order::Order;
use crate::store::outbox::{self, ClaimLimits, Claimed, Holder, Reach, Settle};
use backoff::{Backoff, Outage, OUTAGE_BASE, OUTAGE_CAP};
use liveness::{best_effort, bounded, Lost, Open};
use metrics::Metrics;
use progress::Progress;
use publish::Publisher;
use sink::{Sink, SinkOptions, SinkSpec};
use wake::{IdleMark, Take};

/// The relay vacuums the outbox after deleting this many rows (autovacuum looks only once a
/// minute, and a fast relay can churn through millions of rows in that time).
const VACUUM_EVERY: u64 = 20_000;

/// How often at most the relay evaluates the targets' health.
const HEALTH_EVERY: Duration = Duration::from_secs(1);

/// While the claim fills its batches from its window alone, how often it still looks past the
/// window for aggregates waiting behind a burst ([`outbox::claim`]'s `reach`).
const REACH_EVERY: Duration = Duration::from_secs(1);

/// With `--order commit`, how often at most a relay whose claims come back short looks whether
/// committed events wait behind an open transaction, and how soon it claims again while they
/// do (the transaction may end without a NOTIFY: it need not have inserted any event).
const HELD_EVERY: Duration = Duration::from_millis(100);

/// A warning about what holds the relay back is repeated at most this often.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// After the second connection could not be opened, how long the relay claims one batch at a
/// time before it tries again.
const SPARE_RETRY: Duration = Duration::from_secs(60);

#[derive(Debug, Clone)]
pub struct RelayConfig {
    pub sink: SinkSpec,
    pub batch: i64,
    pub once: bool,
    pub poll: Duration,
    pub max_attempts: i32,
    pub timeout: Duration,
    pub parallel: Option<usize>,
    /// What is published for an event (`--format`, `--source`).
    pub format: sink::Format,
    pub order: Order,
    /// Payload bytes per batch (`--batch-bytes`).
    pub batch_bytes: i64,
    /// How long one statement may go unanswered before its connection is dropped
    /// ([`liveness::STATEMENT_DEADLINE`] unless `LEASECTL_STATEMENT_TIMEOUT` says otherwise).
    pub statement_deadline: Duration,
}

/// Runs the relay until `--once` has drained what was due, or a signal arrives, reporting into
/// `metrics` ([`Metrics::off`] without `--metrics`).
pub async fn run(mut db: Db, cfg: RelayConfig, metrics: Metrics) -> Result<Exit> {
    let stop = CancellationToken::new();
    let mut second = crate::signals::cancel_on_stop(stop.clone(), |first| {
        info!("signal {first}: finishing the batch in hand, then exiting");
    })?;
    let sink = Sink::open(
        &cfg.sink,
        SinkOptions {
            timeout: cfg.timeout,
            format: cfg.format.clone(),
        },
    )?;
    let in_flight = sink.in_flight(cfg.timeout);
    let mut relay = Relay {
        parallel: cfg.parallel.unwrap_or_else(|| sink.parallelism()).max(1),
        in_flight,
        idle: liveness::idle_timeout(in_flight),
        sink,
        up_to: i64::MAX,
        listening: false,
        mark: IdleMark::default(),
        mark_waits: false,
        progress: Progress::new(&cfg.sink.describe()),
        since_vacuum: 0,
        vacuum: true,
        health_at: None,
        health_on: true,
        metrics,
        reach_at: None,
        reach_next: true,
        reach_windows: 1,
        held: None,
        held_at: None,
        held_warned: None,
        horizon_at: None,
        horizon_warned: Vec::new(),
        deleted_since_horizon: 0,
        took: None,
        cfg,
    };
    let d = relay.cfg.statement_deadline;
    // Before `--once` fixes what it drains, so the incidents it opens are published too.
    let started = async {
        relay.watch_health(&db).await?;
        if relay.cfg.once {
            relay.up_to = bounded(
                d,
                "the look at the outbox",
                outbox::cut_off(&db.client, &db.schema, relay.cfg.order),
            )
            .await?;
        } else {
            relay.listen(&db).await?;
        }
        relay.refresh_backlog(&db).await
    };
    if let Err(e) = started.await {
        return Err(unavailable(e));
    }
    info!(
        "relaying schema \"{}\" to {} (batch {}, {} aggregates at a time{})",
        db.schema.name(),
        relay.cfg.sink.describe(),
        relay.cfg.batch,
        relay.parallel,
        if relay.cfg.once { ", once" } else { "" }
    );
    let result = tokio::select! {
        r = relay.main_loop(&mut db, &stop) => r,
        Ok(sig) = &mut second => {
            // Dropping the loop drops the batch in hand; its transaction never commits.
            crate::say!(
                "second signal ({sig}): exiting now; the batch in hand will be published again"
            );
            return Ok(Exit::from_signal(sig));
        }
    };
    relay.progress.finish();
    result
}

struct Relay {
    cfg: RelayConfig,
    sink: Sink,
    parallel: usize,
    /// How long an event may still take to reach the sink's consumers once its delivery
    /// started ([`Sink::in_flight`]), and the idle timeout the claims set for their batches'
    /// transactions ([`liveness::idle_timeout`]).
    in_flight: Duration,
    idle: Duration,
    /// `--once` publishes only events that existed when it started ([`outbox::cut_off`]).
    up_to: i64,
    listening: bool,
    /// Held while this relay sleeps on LISTEN: the trigger notifies only then ([`wake`]).
    mark: IdleMark,
    /// Whether this relay is waiting out a transaction to take the mark (said once).
    mark_waits: bool,
    progress: Progress,
    since_vacuum: u64,
    vacuum: bool,
    /// When health was last evaluated, and whether this relay still does.
    health_at: Option<Instant>,
    health_on: bool,
    metrics: Metrics,
    /// When the claim last looked past its window, and whether the next one should.
    reach_at: Option<Instant>,
    reach_next: bool,
    /// How many windows' worth of other aggregates' events the next look past the window
    /// takes in ([`Reach`]): doubled after every look that still left the batch short.
    reach_windows: u32,
    /// `--order commit`: the horizon committed events wait behind, and since when this relay
    /// has seen it unchanged; when it last looked, and last warned.
    held: Option<(i64, Instant)>,
    held_at: Option<Instant>,
    held_warned: Option<(i64, Instant)>,
    /// When this relay last looked for what holds back the xmin horizon, and the backends it
    /// warned about.
    horizon_at: Option<Instant>,
    horizon_warned: Vec<Option<i32>>,
    /// Events deleted since that look: without them no dead rows pile up behind the holder.
    deleted_since_horizon: u64,
    /// How long the last batch's claim and its publication took: claiming ahead pays only
    /// where publishing takes longer than claiming (a broker, a webhook), not where the claim
    /// is the slow part (stdout), which claiming ahead makes slower still — it reads past the
    /// batch in hand. None before the first batch: claim ahead, and see.
    took: Option<(Duration, Duration)>,
}

/// What one batch did.
#[derive(Debug, Default)]
struct BatchReport {
    claimed: usize,
    delivered: usize,
    /// Events refused for the last time (`--max-attempts`) in this batch.
    went_dead: usize,
    /// Set when the sink could not be reached: the message.
    sink_down: Option<String>,
}

/// Which of the relay's connections a batch's transaction is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Conn {
    /// The one the relay connected with: LISTEN, the idle mark, and a batch claimed normally.
    Main,
    /// The second one, opened for claiming ahead.
    Spare,
}

impl Conn {
    fn other(self) -> Conn {
        match self {
            Conn::Main => Conn::Spare,
            Conn::Spare => Conn::Main,
        }
    }
}

/// The second connection, and the batch claimed ahead on one of the two while the batch before
/// it was published (see the module documentation and "Claiming ahead" in [`outbox`]).
///
/// A batch claimed ahead is kept only if every event of the batch before it was delivered, the
/// relay is not stopping, and it is not empty; otherwise it is rolled back before that batch
/// commits. Claiming ahead is only done on direct connections: behind a transaction-mode pooler
/// the second transaction could wait for a server connection that only the first one's commit
/// frees, and the first commits only after the second was claimed.
#[derive(Default)]
struct Ahead {
    /// Opened when first needed; dropped when a statement on it failed (opened again later).
    spare: Option<Db>,
    /// The next batch.
    next: Option<Next>,
    /// When opening the second connection last failed: not tried again for [`SPARE_RETRY`].
    failed_at: Option<Instant>,
}

/// A claimed batch and its transaction.
struct Next {
    /// The connection its transaction is on.
    conn: Conn,
    events: Vec<Claimed>,
    /// How long its claim took.
    took: Duration,
    /// When the last statement of its transaction that the server answered was sent (its
    /// claim, or a later check), and the idle timeout its claim set: see [`Open`].
    confirmed: Instant,
    idle: Duration,
}

impl Ahead {
    fn conn<'a>(&'a self, db: &'a Db, conn: Conn) -> &'a Db {
        match conn {
            Conn::Main => db,
            Conn::Spare => self
                .spare
                .as_ref()
                .expect("a batch on the second connection"),
        }
    }

    /// The connection without a batch's transaction open: where the relay's statements between
    /// batches go.
    fn free<'a>(&'a self, db: &'a Db) -> &'a Db {
        match (&self.next, &self.spare) {
            (
                Some(Next {
                    conn: Conn::Main, ..
                }),
                Some(spare),
            ) => spare,
            _ => db,
        }
    }

    /// Rolls back the batch claimed ahead, if any: its events are back in the outbox as they
    /// were. A failure on the main connection is returned (the relay then reconnects, which
    /// ends that transaction too); the second connection is simply dropped.
    async fn roll_back(&mut self, db: &Db, deadline: Duration) -> Result<()> {
        let Some(next) = self.next.take() else {
            return Ok(());
        };
        let client = &self.conn(db, next.conn).client;
        match bounded(deadline, "a rollback", outbox::rollback(client)).await {
            Err(e) if next.conn == Conn::Main => Err(e),
            Err(_) => {
                self.failed(next.conn);
                Ok(())
            }
            Ok(()) => Ok(()),
        }
    }

    /// A statement on `conn` failed: the second connection is closed (and opened again when
    /// next needed; the server ends its transaction once it notices); a main connection that
    /// failed tells at its next statement.
    fn failed(&mut self, conn: Conn) {
        if conn == Conn::Spare {
            if let Some(spare) = self.spare.take() {
                spare.close_now();
            }
        }
    }

    /// Forgets both transactions' connection state after a failure: the second connection is
    /// closed (the server rolls back whatever was open on it); the main one is reconnected by
    /// the caller.
    fn reset(&mut self) {
        self.next = None;
        self.failed(Conn::Spare);
    }
}

impl Relay {
    async fn main_loop(&mut self, db: &mut Db, stop: &CancellationToken) -> Result<Exit> {
        let mut sink_outage = Outage::new(self.cfg.sink.describe());
        let mut db_outage = Backoff::new(OUTAGE_BASE, OUTAGE_CAP);
        // For `--once`: events that went dead during this pass make its exit code 1.
        let mut went_dead = 0;
        let mut ahead = Ahead::default();
        let d = self.cfg.statement_deadline;
        loop {
            if stop.is_cancelled() {
                // Best effort: exiting closes the connection, which rolls it back anyway.
                let _ = ahead.roll_back(db, d).await;
                return Ok(Exit::Code(0));
            }
            // Notifications that arrived while we were busy are answered by this very claim.
            while db.notifications.try_recv().is_ok() {}
            let report = match self.turn(db, &mut ahead, stop).await {
                Ok(r) => r,
                Err(e) => {
                    self.recover(db, &mut ahead, stop, &mut db_outage, e)
                        .await?;
                    continue;
                }
            };
            db_outage.reset();
            went_dead += report.went_dead;

            self.metrics.sink_up(report.sink_down.is_none());
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
                    _ = stop.cancelled() => return Ok(Exit::Code(0)),
                }
                continue;
            }
            sink_outage.up();
            if report.claimed > 0 {
                continue;
            }
            if self.cfg.once {
                if self.held.is_some() {
                    crate::say!("notice: events committed after a transaction that is still open began wait for it (--order commit); a later pass publishes them");
                }
                if went_dead > 0 {
                    crate::say!(
                        "{went_dead} event{} went dead during this pass (see `leasectl outbox list --dead`)",
                        if went_dead == 1 { "" } else { "s" }
                    );
                    return Ok(Exit::Code(1));
                }
                return Ok(Exit::Code(0));
            }
            if let Err(e) = self.rest(db, stop).await {
                self.recover(db, &mut ahead, stop, &mut db_outage, e)
                    .await?;
            }
        }
    }

    /// One batch and the bookkeeping after it, every statement under its deadline.
    async fn turn(
        &mut self,
        db: &Db,
        ahead: &mut Ahead,
        stop: &CancellationToken,
    ) -> Result<BatchReport> {
        if !self.cfg.once {
            self.watch_health(ahead.free(db)).await?;
        }
        let report = self.batch(db, ahead, stop).await?;
        // Between batches the relay's other statements go to the connection without an open
        // batch (the main one, unless the next batch was claimed ahead on it).
        let free = ahead.free(db);
        if (report.claimed as i64) < self.cfg.batch {
            self.watch_commit_horizon(free).await?;
        }
        self.deleted_since_horizon += report.delivered as u64;
        self.watch_xmin_horizon(free).await?;
        self.progress.batch(report.delivered);
        self.refresh_backlog(free).await?;
        let d = self.cfg.statement_deadline;
        bounded(d, "the metrics' look at the outbox", async {
            self.metrics.refresh(&free.client, &free.schema).await;
            Ok::<_, anyhow::Error>(())
        })
        .await?;
        self.maybe_vacuum(free, report.delivered).await?;
        Ok(report)
    }

    /// Before sleeping: takes the idle mark, then claims once more — whatever committed without
    /// a NOTIFY did so before the mark was taken ([`wake`]) — or sleeps.
    async fn rest(&mut self, db: &mut Db, stop: &CancellationToken) -> Result<()> {
        let mut nap = self.cfg.poll;
        if self.held.is_some() {
            nap = nap.min(HELD_EVERY);
        }
        if self.listening {
            let d = self.cfg.statement_deadline;
            let taken = tokio::time::timeout(d, self.mark.take(&db.client, &db.schema)).await;
            match taken {
                Ok(Ok(Take::Taken)) => {
                    self.mark_waits = false;
                    return Ok(());
                }
                // Claim again meanwhile, and retry; said once per episode.
                Ok(Ok(Take::Busy)) => {
                    if !self.mark_waits {
                        self.mark_waits = true;
                        info!("an open transaction that inserted events without a NOTIFY keeps this relay from sleeping on LISTEN; polling every {} until it ends", fmt::duration(wake::TAKE_WAIT));
                    }
                    return Ok(());
                }
                Ok(Ok(Take::Held)) => {}
                // The holder may die or start working: try again soon, so that an
                // unnotified event waits at most this long when this relay is the only one
                // left.
                Ok(Ok(Take::Other)) => nap = nap.min(wake::OTHER_RETRY),
                // Sleep unmarked: the connection is gone (the next claim reconnects), or
                // `--poll` finds the events.
                Ok(Err(e)) => info!("cannot take the idle mark ({})", db::reason(&e)),
                Err(_) => {
                    // The mark may or may not be held now: a new session starts without it.
                    return Err(Lost(format!(
                        "the database did not answer the idle mark within {}",
                        fmt::duration(d)
                    ))
                    .into());
                }
            }
        }
        self.idle(db, stop, nap).await
    }

    /// What the relay does when a statement failed: a lost connection (an error that means the
    /// database is unavailable, or [`Lost`]) is dropped and reconnected, with a warning; the
    /// batch in flight rolls back with its session and is published again. With `--once`, and
    /// for any other error, returns the error to exit with.
    async fn recover(
        &mut self,
        db: &mut Db,
        ahead: &mut Ahead,
        stop: &CancellationToken,
        backoff: &mut Backoff,
        e: anyhow::Error,
    ) -> Result<()> {
        let why = if let Some(lost) = e.downcast_ref::<Lost>() {
            lost.to_string()
        } else if let Some(pg) = e
            .downcast_ref::<tokio_postgres::Error>()
            .filter(|pg| db::is_unavailable(pg))
        {
            // Also a statement timeout: a fresh session is the cure for a stuck one.
            format!("database connection failed ({})", db::reason(pg))
        } else {
            return Err(e);
        };
        if self.cfg.once {
            return Err(unavailable(e));
        }
        warn!("{why}; reconnecting");
        // Whatever the server still owes on these connections is not waited for.
        db.close_now();
        ahead.reset();
        self.reconnect(db, stop, backoff).await
    }

    /// Claims, publishes and settles one batch in one transaction — or takes the one claimed
    /// ahead ([`Ahead`]) — and, while batches come back full, claims the next one on the other
    /// connection meanwhile. An event is published only while its batch's transaction is known
    /// to be open ([`Open`]); once it may have ended, the rest of the batch is left unpublished
    /// and the batch fails with [`Lost`].
    async fn batch(
        &mut self,
        db: &Db,
        ahead: &mut Ahead,
        stop: &CancellationToken,
    ) -> Result<BatchReport> {
        let d = self.cfg.statement_deadline;
        let limits = ClaimLimits {
            batch: self.cfg.batch,
            bytes: self.cfg.batch_bytes,
            up_to: self.up_to,
            order: self.cfg.order,
        };
        let taken = match ahead.next.take() {
            Some(next) => self.still_open(db, ahead, next).await?,
            None => None,
        };
        let Next {
            conn: on,
            events: claimed,
            took: claim_took,
            confirmed,
            idle,
        } = match taken {
            Some(next) => next,
            None => {
                let reach = self.reach_now();
                let sent = Instant::now();
                let claim = outbox::claim(&db.client, &db.schema, limits, reach, None, self.idle);
                let (claimed, idle) = bounded(d, "the claim", claim).await?;
                self.claimed(reach, &claimed);
                Next {
                    conn: Conn::Main,
                    events: claimed,
                    took: sent.elapsed(),
                    confirmed: sent,
                    idle,
                }
            }
        };
        if claimed.is_empty() {
            let client = &ahead.conn(db, on).client;
            bounded(d, "a rollback", outbox::rollback(client)).await?;
            return Ok(BatchReport::default());
        }
        // Working again: writers may stop notifying. (The mark is the main connection's; it
        // is only ever held after an empty claim, so never while a batch is claimed ahead.)
        bounded(d, "the idle mark's release", self.mark.release(&db.client)).await?;

        let bytes: i64 = claimed.iter().map(|c| c.event.payload.len() as i64).sum();
        let next_on = if (claimed.len() as i64) == self.cfg.batch
            && bytes <= self.cfg.batch_bytes / 2
            && worth_claiming_ahead(self.took)
            && !stop.is_cancelled()
        {
            self.ready_to_claim_ahead(db, ahead, on.other()).await
        } else {
            None
        };
        let reach = if next_on.is_some() {
            self.reach_now()
        } else {
            Reach::None
        };
        let publisher = Publisher {
            sink: &self.sink,
            parallel: self.parallel,
            max_attempts: self.cfg.max_attempts,
        };
        // The two batches together stay within --batch-bytes.
        let next_limits = ClaimLimits {
            bytes: self.cfg.batch_bytes - bytes,
            ..limits
        };
        let (own_idle, in_flight) = (self.idle, self.in_flight);
        let (published, next, lost) = {
            let ahead = &*ahead;
            let open = Open::new(&ahead.conn(db, on).client, confirmed, idle, in_flight, d);
            let claim_next = async {
                let conn = ahead.conn(db, next_on?);
                let sent = Instant::now();
                let claim = outbox::claim(
                    &conn.client,
                    &db.schema,
                    next_limits,
                    reach,
                    Some(&claimed),
                    own_idle,
                );
                let next = bounded(d, "the claim of the next batch", claim).await;
                Some((next, sent))
            };
            let publish = async {
                let started = Instant::now();
                // Keeping the transaction confirmed meanwhile; abandoned once it may have
                // ended (what was under way is dropped: its events go back with the session).
                let published = tokio::select! {
                    published = publisher.publish(&claimed, &open) => Some(published),
                    () = open.keep_alive() => None,
                };
                (published, started.elapsed())
            };
            let (published, next) = tokio::join!(publish, claim_next);
            (published, next, open.lost())
        };
        let (published, publish_took) = published;
        self.took = Some((claim_took, publish_took));
        if let Some(why) = lost {
            // Its events are back in the outbox (or will be, once the server notices), and
            // whoever claims them next publishes them in order. What went out of this batch
            // goes out again (at least once); nothing more of it does. The batch claimed
            // ahead continues this one: it ends uncommitted with its session too.
            ahead.reset();
            return Err(Lost(format!(
                "the transaction of a batch of {} events may have ended ({why}): the rest of the batch is left unpublished, and what was published will be again",
                claimed.len()
            ))
            .into());
        }
        let (settled, sink_down) =
            published.expect("publication ends only with the transaction lost");
        let delivered = settled
            .iter()
            .filter(|s| matches!(s, Settle::Delivered))
            .count();
        if let (Some(conn), Some((next, sent))) = (next_on, next) {
            match next {
                Ok((next, idle)) => {
                    (self.reach_next, self.reach_windows) =
                        reach_after(self.cfg.batch, reach, self.reach_windows, &next);
                    ahead.next = Some(Next {
                        conn,
                        events: next,
                        took: sent.elapsed(),
                        confirmed: sent,
                        idle,
                    });
                }
                // Unanswered: the server (or the path to it) is most likely silent for both
                // connections. Not committing this batch either keeps `--once` within one
                // deadline of the silence; its events go out again, at least once.
                Err(e) if e.is::<Lost>() => {
                    ahead.reset();
                    return Err(e);
                }
                Err(e) => {
                    info!(
                        "could not claim the next batch ahead ({}); claiming it after this one",
                        reason(&e)
                    );
                    ahead.failed(conn);
                }
            }
        }
        // Before this batch commits: what the next one holds continues chains that, with an
        // event of this one put back, are not gone after all.
        let keep = delivered == claimed.len()
            && !stop.is_cancelled()
            && ahead.next.as_ref().is_some_and(|n| !n.events.is_empty());
        if !keep {
            ahead.roll_back(db, d).await?;
        }
        let client = &ahead.conn(db, on).client;
        let settle = outbox::settle(client, &db.schema, &claimed, &settled);
        let failed = match tokio::time::timeout(d, settle).await {
            Ok(Ok(())) => None,
            Ok(Err(failed)) => Some(failed),
            Err(_) => {
                // The batch claimed ahead ends with the sessions, as below.
                ahead.reset();
                return Err(Lost(format!(
                    "the database did not answer the commit of {delivered} delivered events within {}; they may be published again",
                    fmt::duration(d)
                ))
                .into());
            }
        };
        if let Some(failed) = failed {
            if delivered > 0 {
                // Only say "will" when the transaction certainly rolled back: a COMMIT whose answer
                // never came may have committed, and then the events are not published again.
                warn!(
                    "could not record {delivered} delivered events ({}); {}",
                    db::reason(&failed.error),
                    if failed.outcome_unknown {
                        "the commit's outcome is unknown: they may be published again"
                    } else {
                        "they will be published again"
                    }
                );
            }
            // The batch claimed ahead continues this one, which may not be gone either: its
            // transaction must end uncommitted. Not with a ROLLBACK that could wait on a server
            // gone silent: the caller reconnects the main connection or exits, and this drops
            // the second one; either way the server ends the transaction with its session.
            ahead.reset();
            return Err(failed.error.into());
        }
        publisher.report_failures(&claimed, &settled);
        self.metrics.settled(&claimed, &settled);
        let went_dead = settled
            .iter()
            .filter(|s| matches!(s, Settle::Failed { dead: true, .. }))
            .count();
        Ok(BatchReport {
            claimed: claimed.len(),
            delivered,
            went_dead,
            sink_down,
        })
    }

    /// The batch claimed ahead, if its transaction is still open. It waited while the batch
    /// before it was published, and its session may have ended meanwhile (by the idle timeout
    /// while this relay was paused, say): its events are then back in the outbox, for any relay
    /// to claim, and must not be published from here. Known without a round trip within the
    /// transaction's window ([`Open`]), with one past it. Lost on the second connection, it is
    /// claimed again; on the main one, that connection is lost too ([`Lost`]).
    async fn still_open(&self, db: &Db, ahead: &mut Ahead, mut next: Next) -> Result<Option<Next>> {
        let d = self.cfg.statement_deadline;
        let why = {
            let client = &ahead.conn(db, next.conn).client;
            let open = Open::new(client, next.confirmed, next.idle, self.in_flight, d);
            if open.may_publish().await {
                next.confirmed = open.confirmed();
                return Ok(Some(next));
            }
            open.lost().unwrap_or_default()
        };
        if next.conn == Conn::Main {
            return Err(Lost(format!(
                "the batch claimed ahead was lost with its session ({why})"
            ))
            .into());
        }
        info!("the batch claimed ahead was lost with its session ({why}); claiming again");
        ahead.failed(next.conn);
        Ok(None)
    }

    /// Whether the next claim should look past its window (step 2 of [`outbox`]'s claim).
    /// Looking past the window costs a scan of up to 100 windows; it is worth it only while it
    /// finds something or the batches come back short (a burst, or heads that other relays
    /// hold). A relay draining one long chain in full batches looks once a second, so others
    /// that queue up behind it wait at most about that long.
    ///
    /// How far it looks grows while it keeps coming back short: the events just past the
    /// window may all belong to aggregates whose heads other sessions hold (a relay's frozen
    /// backends, another relay's batches, while writers add to those aggregates), and a look
    /// of one window would then find them again and again and never the aggregates behind
    /// them. Each short batch doubles it, up to the whole reach; a full one starts over.
    fn reach_now(&mut self) -> Reach {
        let reach = self.reach_next || self.reach_at.is_none_or(|t| t.elapsed() >= REACH_EVERY);
        if !reach {
            return Reach::None;
        }
        self.reach_at = Some(Instant::now());
        Reach::Windows(self.reach_windows)
    }

    /// After a claim that looked as far as `reach`: what the next one should do.
    fn claimed(&mut self, reach: Reach, claimed: &[Claimed]) {
        (self.reach_next, self.reach_windows) =
            reach_after(self.cfg.batch, reach, self.reach_windows, claimed);
    }

    /// Whether the next batch can be claimed ahead on `conn`: the main connection is always
    /// there; the second is opened when first needed. Neither behind a transaction-mode pooler
    /// (see [`Ahead`]).
    async fn ready_to_claim_ahead(
        &mut self,
        db: &Db,
        ahead: &mut Ahead,
        conn: Conn,
    ) -> Option<Conn> {
        if !db.can_listen() {
            return None;
        }
        if conn == Conn::Main || ahead.spare.is_some() {
            return Some(conn);
        }
        if ahead.failed_at.is_some_and(|t| t.elapsed() < SPARE_RETRY) {
            return None;
        }
        match db.another().await {
            Ok(spare) => {
                ahead.spare = Some(spare);
                ahead.failed_at = None;
                Some(conn)
            }
            Err(e) => {
                if ahead.failed_at.is_none() {
                    warn!(
                        "cannot open a second database connection ({e:#}); claiming one batch at a time"
                    );
                }
                ahead.failed_at = Some(Instant::now());
                None
            }
        }
    }

    /// `--order commit`: notes whether committed events wait behind a transaction still in
    /// progress, and warns — naming its backend — when the same one has held them back for
    /// longer than `--poll` × 10: once for each such transaction, repeated at most once per
    /// [`WARN_EVERY`] while it lasts. Looks at most once per [`HELD_EVERY`], after a short claim
    /// (a full one is not held back). Best effort.
    async fn watch_commit_horizon(&mut self, db: &Db) -> Result<(), Lost> {
        if self.cfg.order != Order::Commit
            || (!self.cfg.once && self.held_at.is_some_and(|t| t.elapsed() < HELD_EVERY))
        {
            return Ok(());
        }
        let d = self.cfg.statement_deadline;
        self.held_at = Some(Instant::now());
        let horizon = outbox::commit_horizon(&db.client, &db.schema);
        let Some(h) = best_effort(d, "the look at the commit horizon", horizon).await? else {
            return Ok(());
        };
        if !h.held {
            self.held = None;
            return Ok(());
        }
        let since = match self.held {
            Some((xmin, since)) if xmin == h.xmin => since,
            _ => {
                self.held = Some((h.xmin, Instant::now()));
                return Ok(());
            }
        };
        let waited = since.elapsed();
        if waited < self.cfg.poll.saturating_mul(10)
            || self
                .held_warned
                .is_some_and(|(xmin, t)| xmin == h.xmin && t.elapsed() < WARN_EVERY)
        {
            return Ok(());
        }
        self.held_warned = Some((h.xmin, Instant::now()));
        let holder = outbox::xid_holder(&db.client, h.xmin);
        let who = match best_effort(d, "the look at pg_stat_activity", holder).await? {
            Some(Some(holder)) => describe(&holder),
            // Ended meanwhile, or in no view this role may read.
            _ => "no backend in pg_stat_activity has it (ended meanwhile?)".to_owned(),
        };
        warn!(
            "--order commit: events have waited {} for transaction {} to end: {who}; events committed after it began are published once it commits or rolls back",
            fmt::duration(waited),
            h.xmin
        );
        Ok(())
    }

    /// Warns, naming the backend, when a transaction open longer than `--poll` × 10 holds back
    /// the xmin horizon while this relay deletes events: VACUUM cannot remove the deleted rows,
    /// and every claim wades through them. Looks at most once per `--poll` × 10
    /// (capped at a minute), only after deleting events, and warns once per backend. Best
    /// effort.
    async fn watch_xmin_horizon(&mut self, db: &Db) -> Result<(), Lost> {
        let every = self.cfg.poll.saturating_mul(10).min(WARN_EVERY);
        if self.horizon_at.is_some_and(|t| t.elapsed() < every) {
            return Ok(());
        }
        self.horizon_at = Some(Instant::now());
        let deleted = std::mem::take(&mut self.deleted_since_horizon);
        if deleted == 0 {
            return Ok(());
        }
        let min_ms = fmt::ms(self.cfg.poll.saturating_mul(10));
        let look = outbox::horizon_holders(&db.client, min_ms);
        let d = self.cfg.statement_deadline;
        let Some(holders) = best_effort(d, "the look at pg_stat_activity", look).await? else {
            return Ok(());
        };
        for holder in holders {
            // Once per backend (a pid is reused only after that backend ended).
            if self.horizon_warned.contains(&holder.pid) {
                continue;
            }
            if self.horizon_warned.len() >= 1000 {
                self.horizon_warned.clear();
            }
            self.horizon_warned.push(holder.pid);
            warn!(
                "a snapshot {} transactions old holds back the xmin horizon: {}; VACUUM cannot remove the {deleted} events this relay deleted meanwhile, and claims slow down until it ends",
                holder.xmin_age.unwrap_or(0),
                describe(&holder)
            );
        }
        Ok(())
    }

    /// Evaluates the targets' health and opens or closes incidents, at most once per
    /// [`HEALTH_EVERY`]. An unavailable database is returned (the caller reconnects); any other
    /// failure — a role without the grants on `incidents`, say — is reported once and this relay
    /// stops evaluating, so the events keep flowing.
    async fn watch_health(&mut self, db: &Db) -> Result<()> {
        if !self.health_on || self.health_at.is_some_and(|t| t.elapsed() < HEALTH_EVERY) {
            return Ok(());
        }
        self.health_at = Some(Instant::now());
        let reconcile = crate::health::reconcile(&db.client, &db.schema);
        let d = self.cfg.statement_deadline;
        match tokio::time::timeout(d, reconcile).await.map_err(|_| {
            Lost(format!(
                "the database did not answer the health evaluation within {}",
                fmt::duration(d)
            ))
        })? {
            Ok(Some(r)) if r.opened + r.recovered > 0 => {
                info!(
                    "health: {} incident(s) opened, {} recovered",
                    r.opened, r.recovered
                );
                Ok(())
            }
            Ok(_) => Ok(()),
            Err(e) => {
                let unavailable = e
                    .downcast_ref::<tokio_postgres::Error>()
                    .is_some_and(db::is_unavailable);
                if unavailable {
                    return Err(e);
                }
                warn!("cannot evaluate the targets' health ({e:#}); this relay no longer does");
                self.health_on = false;
                Ok(())
            }
        }
    }

    /// Waits for a NOTIFY, the poll interval, the earliest retry falling due, or a signal.
    async fn idle(&mut self, db: &mut Db, stop: &CancellationToken, nap: Duration) -> Result<()> {
        let mut wait = nap;
        let d = self.cfg.statement_deadline;
        let retry = outbox::next_retry_in(&db.client, &db.schema);
        match best_effort(d, "the look for retries", retry).await? {
            Some(Some(due)) => wait = wait.min(due.max(Duration::from_millis(10))),
            Some(None) => {}
            // The next claim reports (and recovers from) a lost connection.
            None => return Ok(()),
        }
        self.refresh_backlog(db).await?;
        if let Some(due) = self.progress.backlog_due_in() {
            wait = wait.min(due.max(Duration::from_millis(10)));
        }
        bounded(d, "the metrics' look at the outbox", async {
            self.metrics.refresh(&db.client, &db.schema).await;
            Ok::<_, anyhow::Error>(())
        })
        .await?;
        if let Some(due) = self.metrics.refresh_due_in() {
            wait = wait.min(due.max(Duration::from_millis(10)));
        }
        tokio::select! {
            n = db.notifications.recv() => {
                if n.is_none() {
                    // The connection is gone: let the next claim notice and reconnect, but not
                    // in a tight loop.
                    tokio::time::sleep(OUTAGE_BASE.min(self.cfg.poll)).await;
                }
            }
            _ = tokio::time::sleep(wait) => {}
            _ = stop.cancelled() => {}
        }
        Ok(())
    }

    async fn listen(&mut self, db: &Db) -> Result<()> {
        if !db.can_listen() {
            info!(
                "behind a transaction-mode pooler: new events are found by polling every {}",
                fmt::duration(self.cfg.poll)
            );
            return Ok(());
        }
        let d = self.cfg.statement_deadline;
        let channel = db.schema.outbox_channel();
        let listen = db::notify::listen(&db.client, &channel);
        let listened = tokio::time::timeout(d, listen).await.map_err(|_| {
            Lost(format!(
                "the database did not answer LISTEN within {}",
                fmt::duration(d)
            ))
        })?;
        match listened {
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

    async fn reconnect(
        &mut self,
        db: &mut Db,
        stop: &CancellationToken,
        backoff: &mut Backoff,
    ) -> Result<()> {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(backoff.next_delay()) => {}
                _ = stop.cancelled() => return Ok(()),
            }
            self.mark.forget();
            let attempt = async {
                db.reconnect().await?;
                self.listen(db).await
            };
            match attempt.await {
                Ok(()) => {
                    warn!("reconnected to the database");
                    self.metrics.reconnected();
                    return Ok(());
                }
                Err(e) if Exit::from_error(&e) == Exit::Unavailable || e.is::<Lost>() => {
                    // A session that went silent at once is closed, not left to linger.
                    db.close_now();
                    info!("still cannot reach the database: {e:#}");
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Reads the backlog for the progress line, when it is due ([`Progress::refresh_backlog`]).
    async fn refresh_backlog(&mut self, db: &Db) -> Result<()> {
        let d = self.cfg.statement_deadline;
        bounded(d, "the look at the backlog", async {
            self.progress.refresh_backlog(&db.client, &db.schema).await;
            Ok::<_, anyhow::Error>(())
        })
        .await
    }

    /// Vacuums the outbox after heavy draining so it and its indexes stay small. Best effort:
    /// a role that may not vacuum the table leaves it to autovacuum. A VACUUM unanswered after
    /// [`liveness::VACUUM_DEADLINE`] (a silent server, or a table too large to vacuum in that
    /// time) loses the connection, and this relay leaves the table to autovacuum from then on.
    async fn maybe_vacuum(&mut self, db: &Db, delivered: usize) -> Result<(), Lost> {
        self.since_vacuum += delivered as u64;
        if !self.vacuum || self.since_vacuum < VACUUM_EVERY {
            return Ok(());
        }
        self.since_vacuum = 0;
        let started = Instant::now();
        let d = self.cfg.statement_deadline.max(liveness::VACUUM_DEADLINE);
        let Ok(vacuumed) = tokio::time::timeout(d, outbox::vacuum(&db.client, &db.schema)).await
        else {
            self.vacuum = false;
            return Err(Lost(format!(
                "the database did not answer the outbox's VACUUM within {} (this relay leaves it to autovacuum from now on)",
                fmt::duration(d)
            )));
        };
        match vacuumed {
            Ok(true) => info!(
                "vacuumed the outbox in {}",
                fmt::duration(started.elapsed())
            ),
            // Once per relay: the role stays what it is.
            Ok(false) => {
                say!("notice: this role may not VACUUM the outbox (it needs the table's ownership); leaving it to autovacuum");
                self.vacuum = false;
            }
            Err(e) => {
                info!(
                    "cannot vacuum the outbox ({}); leaving it to autovacuum",
                    db::reason(&e)
                );
                self.vacuum = false;
            }
        }
        Ok(())
    }
}

/// A [`Lost`] connection as the exit it means (69), saying that nothing was lost; any other
/// error as it is.
fn unavailable(e: anyhow::Error) -> anyhow::Error {
    match e.downcast::<Lost>() {
        Ok(lost) => {
            Failure::Unavailable(format!("{lost}; undelivered events stay in the outbox")).into()
        }
        Err(e) => e,
    }
}

/// A failed statement's error in one line: the server's message, or what the client saw.
fn reason(e: &anyhow::Error) -> String {
    match e.downcast_ref::<tokio_postgres::Error>() {
        Some(pg) => db::reason(pg),
        None => fmt::one_line(&format!("{e:#}"), 300),
    }
}

/// Whether claiming the next batch ahead pays, from how long the last batch's claim and
/// publication took (`None`: no batch yet): only where publishing is the slower part.
fn worth_claiming_ahead(took: Option<(Duration, Duration)>) -> bool {
    took.is_none_or(|(claim, publish)| publish > claim)
}

/// Whether the claim after one that found `claimed` should look past its window
/// ([`Relay::reach_now`]): it came back short, or found something there.
fn reach_next(batch: i64, claimed: &[Claimed]) -> bool {
    (claimed.len() as i64) < batch || claimed.iter().any(|c| c.reached)
}

/// After a claim that looked as far as `reach` (`windows` being what the relay had asked of
/// looks past the window so far): whether the next claim should look past the window, and how
/// much the next look takes in — twice as much after a look that still left the batch short,
/// one window again after a full batch (see `Relay::reach_now`).
fn reach_after(batch: i64, reach: Reach, windows: u32, claimed: &[Claimed]) -> (bool, u32) {
    let windows = match reach {
        Reach::Windows(n) if (claimed.len() as i64) < batch => {
            n.saturating_mul(2).min(outbox::REACH_FACTOR)
        }
        Reach::Windows(_) => 1,
        Reach::None => windows,
    };
    (reach_next(batch, claimed), windows)
}

/// A backend for a warning: `backend 1234 (application "psql", idle in transaction, transaction
/// open 5m 3s)`.
pub fn describe(h: &Holder) -> String {
    let mut parts = Vec::new();
    if let Some(app) = h.application_name.as_deref().filter(|a| !a.is_empty()) {
        parts.push(format!("application \"{}\"", fmt::one_line(app, 60)));
    }
    if let Some(state) = &h.state {
        parts.push(state.clone());
    }
    if let Some(ms) = h.xact_ms {
        parts.push(format!(
            "transaction open {}",
            fmt::duration(Duration::from_millis(u64::try_from(ms).unwrap_or(0)))
        ));
    }
    let who = match (&h.pid, &h.gid) {
        (Some(pid), _) => format!("backend pid {pid}"),
        (None, Some(gid)) => format!("prepared transaction \"{}\"", fmt::one_line(gid, 60)),
        (None, None) => "a backend of another role".to_owned(),
    };
    if parts.is_empty() {
        who
    } else {
        format!("{who} ({})", parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claiming_ahead_pays_only_where_publishing_is_slower_than_claiming() {
        let ms = Duration::from_millis;
        assert!(worth_claiming_ahead(None), "the first batch tries");
        assert!(worth_claiming_ahead(Some((ms(8), ms(60)))), "a broker");
        assert!(!worth_claiming_ahead(Some((ms(8), ms(1)))), "stdout");
        assert!(!worth_claiming_ahead(Some((ms(8), ms(8)))));
    }
}
