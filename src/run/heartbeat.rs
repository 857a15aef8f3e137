//! Keeping a held lease alive, and knowing when to give up on it.
//!
//! The rule "stop before the lease can be taken over", in one place: the database moved
//! `heartbeat_at` no earlier than the moment we *sent* a heartbeat that succeeded, so the lease
//! cannot expire before `sent + ttl`. Stopping the command starts at
//! `sent + ttl - kill_after - margin`, so its SIGKILL lands before anyone can take over.

use std::time::Duration;

use tokio::time::{sleep_until, timeout, Instant};

use crate::db::{self, Db};
use crate::model::time::{deadline, stop_budget, Times};
use crate::store::leases::{self, Lease};

/// Renews the lease and decides, on the local monotonic clock, when it must be given up.
///
/// The database moved `heartbeat_at` no earlier than the moment we *sent* a successful
/// heartbeat, so the lease cannot expire before `sent + ttl`. We start stopping the child at
/// `sent + ttl - kill_after - margin`, so its SIGKILL lands before anyone can take over.
/// Failed heartbeats are retried until that moment (one dropped packet must not kill a long
/// job); a heartbeat that matches 0 rows means the lease is gone now.
pub struct Heartbeat<'a> {
    lease: &'a Lease,
    interval: Duration,
    retry: Duration,
    /// `ttl - kill_after - margin`: how long after a confirmed heartbeat we may keep running.
    budget: Duration,
    ttl: Duration,
    kill_after: Duration,
    next_at: Instant,
    stop_at: Instant,
    /// When the last heartbeat that succeeded (or the acquisition) was sent.
    confirmed_sent: Instant,
    failures: u32,
    /// Check the lease as soon as a release of its target is announced (see
    /// [`Heartbeat::watch_releases`]).
    watch: bool,
    /// The LISTEN that `watch` needs is still to be sent on this connection.
    listen: bool,
}

impl<'a> Heartbeat<'a> {
    /// `sent`: when the statement that acquired (or last renewed) the lease was sent.
    pub fn new(lease: &'a Lease, times: Times, sent: Instant) -> Heartbeat<'a> {
        let budget = stop_budget(times.ttl, times.kill_after);
        Heartbeat {
            lease,
            interval: times.interval,
            retry: times.interval.min(Duration::from_secs(1)),
            budget,
            ttl: times.ttl,
            kill_after: times.kill_after,
            next_at: deadline(sent, times.interval),
            stop_at: deadline(sent, budget),
            confirmed_sent: sent,
            failures: 0,
            watch: false,
            listen: false,
        }
    }

    /// Checks the lease at once — not at the next heartbeat — when a release of its target is
    /// announced on the lease channel: `release --force` then stops the command within about
    /// a round trip. Only where LISTEN works (not behind a transaction-mode pooler);
    /// `listening` says the connection already listens (it waited for the lease).
    pub fn watch_releases(&mut self, listening: bool) {
        self.watch = true;
        self.listen = !listening;
    }

    /// The moment the command must start being stopped unless a heartbeat succeeds first.
    /// Nothing may be spawned at or after it: there would not be time to stop it.
    pub fn stop_at(&self) -> Instant {
        self.stop_at
    }

    /// How long after a confirmed heartbeat's send the command may run (see [`stop_budget`]).
    pub fn budget(&self) -> Duration {
        self.budget
    }

    /// The earliest moment the lease can expire on the database's clock: the send of the last
    /// heartbeat that succeeded (or of the acquisition) plus the TTL.
    pub fn lease_deadline(&self) -> Instant {
        deadline(self.confirmed_sent, self.ttl)
    }

    /// One heartbeat now, outside the schedule: for a lease whose acquisition was answered too
    /// late to start the command within its stop budget (the statement may have run late, not
    /// early). `Ok(true)`: renewed, and the budget counts from this send. `Ok(false)`: the lease
    /// is gone (expired or taken). `Err`: no answer within `limit`.
    pub async fn confirm(&mut self, db: &Db, limit: Duration) -> Result<bool, String> {
        let sent = Instant::now();
        match timeout(limit, leases::heartbeat(&db.client, &db.schema, self.lease)).await {
            Ok(Ok(true)) => {
                self.renewed(sent);
                Ok(true)
            }
            Ok(Ok(false)) => Ok(false),
            Ok(Err(e)) => Err(db::reason(&e)),
            Err(_) => Err("timed out".into()),
        }
    }

    /// A heartbeat sent at `sent` succeeded.
    fn renewed(&mut self, sent: Instant) {
        self.confirmed_sent = sent;
        self.stop_at = deadline(sent, self.budget);
        self.next_at = deadline(sent, self.interval);
    }

    /// The moment by which the command must have been SIGKILLed: the lease can expire, on
    /// the database's clock, a margin after it. A stop that starts late (leasectl paused, a
    /// timer fired late) still kills by then, so no grace outlives the lease.
    pub fn kill_at(&self) -> Instant {
        deadline(self.stop_at, self.kill_after)
    }

    /// Runs until the lease is lost; returns why. Cancel-safe: dropping the future between
    /// polls loses nothing, and calling it again resumes the schedule.
    pub async fn keep(&mut self, db: &mut Db) -> String {
        loop {
            if self.listen {
                self.listen = false;
                self.send_listen(db).await;
            }
            let wake = self.next_at.min(self.stop_at);
            if self.watch {
                tokio::select! {
                    _ = sleep_until(wake) => {}
                    _ = db::notify::announced(&mut db.notifications, &self.lease.target) => {
                        info!("a release of '{}' was announced; checking the lease now", self.lease.target);
                    }
                }
            } else {
                sleep_until(wake).await;
            }
            let sent = Instant::now();
            if sent >= self.stop_at {
                return format!(
                    "no heartbeat for '{}' confirmed in {} (ttl {})",
                    self.lease.target,
                    crate::fmt::duration(self.budget),
                    crate::fmt::duration(self.ttl)
                );
            }
            let limit = (self.stop_at - sent).min(self.interval.max(Duration::from_secs(2)));
            match timeout(limit, leases::heartbeat(&db.client, &db.schema, self.lease)).await {
                Ok(Ok(true)) => {
                    if self.failures > 0 {
                        warn!(
                            "heartbeat for '{}' recovered after {} failed attempts",
                            self.lease.target, self.failures
                        );
                    }
                    self.failures = 0;
                    self.renewed(sent);
                }
                Ok(Ok(false)) => {
                    // The lease is gone: taken from us (whoever took it waits for our stop, or
                    // for our deadline), or expired before this heartbeat reached the database.
                    // Either way the grace starts now at the latest.
                    self.stop_at = self.stop_at.min(Instant::now());
                    return format!(
                        "the lease on '{}' was lost (taken over, force-released, or expired before a heartbeat reached the database)",
                        self.lease.target
                    );
                }
                Ok(Err(e)) => self.failed(db, &db::reason(&e)).await,
                Err(_) => self.failed(db, "timed out").await,
            }
        }
    }

    /// LISTENs on the lease channel, bounded so that a silent database cannot hold up the
    /// heartbeat schedule; if it fails, a forced release is noticed at the next heartbeat.
    async fn send_listen(&mut self, db: &Db) {
        let limit = self
            .stop_at
            .saturating_duration_since(Instant::now())
            .min(Duration::from_secs(2));
        let channel = db.schema.lease_channel();
        match timeout(limit, db::notify::listen(&db.client, &channel)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => info!(
                "LISTEN failed ({}); a forced release is noticed at the next heartbeat",
                db::reason(&e)
            ),
            Err(_) => info!("LISTEN timed out; a forced release is noticed at the next heartbeat"),
        }
    }

    async fn failed(&mut self, db: &mut Db, why: &str) {
        self.failures += 1;
        let left = self.stop_at.saturating_duration_since(Instant::now());
        if self.failures == 1 {
            warn!(
                "heartbeat for '{}' failed ({why}); retrying, the command is stopped in {} unless one succeeds",
                self.lease.target,
                crate::fmt::duration(left)
            );
        } else {
            info!(
                "heartbeat attempt {} failed ({why}); {} left",
                self.failures,
                crate::fmt::duration(left)
            );
        }
        // A fresh connection, in case this one is dead or hung; bounded by the deadline.
        if let Ok(Err(e)) = timeout(left, db.reconnect()).await {
            info!("reconnect failed: {e:#}");
        }
        // A new connection listens to nothing yet.
        self.listen = self.watch;
        self.next_at = Instant::now() + self.retry;
    }
}
