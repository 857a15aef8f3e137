//! `leasectl relay`: the loop that moves outbox events to a sink.
//!
//! One batch is one transaction: BEGIN and the claim ([`outbox::claim`], which deletes the rows
//! it returns) go out together; then the events are published ([`publish`]: aggregates
//! concurrently, each aggregate's events one after another, stopping at its first failure);
//! then whatever was not confirmed is put back and the transaction commits
//! ([`outbox::settle`]; a full batch with nothing to put back sends its COMMIT with the next
//! claim and learns its answer before it publishes more, see `commit`). Nothing is ever
//! marked delivered before the sink confirmed it, and a relay that dies mid-batch loses
//! nothing: its transaction rolls back and the events are published again (at-least-once).
//!
//! While batches come back full (a backlog), publishing takes longer than claiming, and every
//! event of a batch was delivered, the next batch is claimed on a second connection while this
//! one is published — never for stdout, whose blocking write nothing could overlap (`Ahead`; the
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

mod ahead;
pub mod backoff;
mod commit;
mod heap;
mod horizon;
pub mod liveness;
pub mod metrics;
mod plain;
pub mod progress;
pub mod publish;
mod reach;
mod rest;
pub mod sink;
mod upkeep;
pub mod wake;

use std::time::Duration;

use anyhow::Result;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::db::{self, Db};
use crate::exit::{Exit, Failure};
use crate::fmt;
use crate::model::order::Order;
use crate::store::outbox::{self, Ask, Claim, ClaimLimits, Reach, Settle};
use backoff::{Backoff, Outage, OUTAGE_BASE, OUTAGE_CAP};
use liveness::{bounded, Lost, Open};
use metrics::Metrics;
use plain::Claims;
use progress::Progress;
use publish::Publisher;
use sink::{Sink, SinkOptions, SinkSpec};
use wake::IdleMark;

use ahead::{worth_claiming_ahead, Ahead, Conn, Next};
pub use horizon::describe;
use reach::reach_after;

/// How often at most the relay evaluates the targets' health.
const HEALTH_EVERY: Duration = Duration::from_secs(1);

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
    heap::keep_freed_memory();
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
        vacuuming: None,
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
        claims: Claims::default(),
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
    if let Some(summary) = relay.claims.summary() {
        info!("{summary}");
    }
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
    /// The VACUUM under way on a connection of its own, if any.
    vacuuming: Option<tokio::task::JoinHandle<upkeep::Vacuumed>>,
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
    /// Which statements claimed the batches, and when the plain claim may be tried again.
    claims: Claims,
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
                // The last batch's commit, if still owed, is waited for (a failure says what
                // it means for its events). Best effort: exiting closes the connection, which
                // rolls back the batch claimed ahead anyway.
                let _ = self.commit_answered(&mut ahead, true).await;
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
                self.end_vacuum(d).await;
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
            // Nothing to claim: a VACUUM that ended meanwhile says so before the relay rests;
            // one still running is not waited for (new events would wait with it).
            self.end_vacuum(Duration::ZERO).await;
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
        self.maybe_vacuum(free, report.delivered);
        Ok(report)
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
        // A commit of the last batch that was answered meanwhile says what it means for its
        // events; an unanswered one's outcome is unknown, and its events may come again.
        let _ = self.commit_answered(ahead, false).await;
        if self.cfg.once {
            return Err(unavailable(e));
        }
        warn!("{why}; reconnecting");
        // Whatever the server still owes on these connections is not waited for.
        db.close_now();
        ahead.reset();
        self.reconnect(db, stop, backoff).await
    }

    /// The batch claimed ahead, if it is still open, else a batch claimed now on the main
    /// connection.
    async fn claim_or_take(
        &mut self,
        db: &Db,
        ahead: &mut Ahead,
        limits: ClaimLimits,
    ) -> Result<Next> {
        if let Some(next) = ahead.next.take() {
            if let Some(next) = self.still_open(db, ahead, next).await? {
                return Ok(next);
            }
        }
        // A commit still owed on the second connection is answered first: this claim would
        // otherwise run beside it and find its events locked (see `commit`).
        if ahead
            .pending
            .as_ref()
            .is_some_and(|(_, _, conn)| *conn != Conn::Main)
        {
            self.commit_answered(ahead, true).await?;
        }
        let reach = self.reach_now();
        let ask = Ask {
            reach,
            after: None,
            plain: self.claims.plain_now(),
        };
        let sent = Instant::now();
        let claim = outbox::claim(ahead.session(db, Conn::Main), limits, ask, self.idle);
        let d = self.cfg.statement_deadline;
        let Claim {
            events: claimed,
            idle,
            via,
        } = bounded(d, "the claim", claim).await?;
        self.claimed(reach, &claimed);
        self.claims.record(via);
        Ok(Next {
            conn: Conn::Main,
            events: claimed,
            took: sent.elapsed(),
            confirmed: sent,
            idle,
        })
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
        let next = self.claim_or_take(db, ahead, limits).await;
        // The last batch's commit went out before this claim: its answer first, before
        // anything of this batch is published (see `commit`).
        self.commit_answered(ahead, next.is_ok()).await?;
        let Next {
            conn: on,
            events: claimed,
            took: claim_took,
            confirmed,
            idle,
        } = next?;
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
            && !self.sink.blocks_the_relay()
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
        let plain = self.claims.plain_now();
        let (published, next, lost) = {
            let ahead = &*ahead;
            let open = Open::new(&ahead.conn(db, on).client, confirmed, idle, in_flight, d);
            let claim_next = async {
                let on = ahead.session(db, next_on?);
                let ask = Ask {
                    reach,
                    after: Some(&claimed),
                    plain,
                };
                let sent = Instant::now();
                let claim = outbox::claim(on, next_limits, ask, own_idle);
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
                Ok(Claim {
                    events: next,
                    idle,
                    via,
                }) => {
                    (self.reach_next, self.reach_windows) =
                        reach_after(self.cfg.batch, reach, self.reach_windows, &next);
                    self.claims.record(via);
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
        self.settle_batch(db, ahead, on, &claimed, &settled, delivered, stop)
            .await?;
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
