//! What the relay shows while it runs: the indicatif line on a terminal (events/s and backlog)
//! and, with `-v`, throughput reports.
//!
//! The backlog is read when the relay starts and then at most once a second, between batches
//! as well as when idle: a relay draining a large backlog (or `--once`, which is never idle)
//! shows it going down. Counting a large outbox takes a while, so the line never spends more
//! than about 1/`BACKLOG_SHARE` of the relay's time on it.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::ProgressBar;
use tokio::time::Instant;

use crate::db::Schema;
use crate::fmt;
use crate::store::outbox::{self, Backlog};

/// How often `-v` reports throughput.
const REPORT_EVERY: Duration = Duration::from_secs(10);

/// The backlog is read at most once per this interval…
const BACKLOG_EVERY: Duration = Duration::from_secs(1);

/// …and at most once per this many times as long as the last read took.
const BACKLOG_SHARE: u32 = 20;

/// The indicatif line on a terminal (events/s and backlog), and `-v` throughput reports.
pub struct Progress {
    bar: Option<ProgressBar>,
    started: Instant,
    delivered: u64,
    window_start: Instant,
    window_delivered: u64,
    /// When the backlog may be read again (`None`: now).
    next_backlog: Option<Instant>,
    backlog: Option<Backlog>,
    /// Events were delivered since the backlog was read.
    stale: bool,
}

impl Progress {
    pub fn new(sink: &str) -> Progress {
        // The stdout sink's own output would fight with the line if both were a terminal.
        let bar = (std::io::stderr().is_terminal() && !crate::log::verbose()).then(|| {
            let pb = ProgressBar::new_spinner();
            pb.enable_steady_tick(Duration::from_millis(200));
            pb.set_message(format!("relaying to {sink}"));
            pb
        });
        Progress {
            bar,
            started: Instant::now(),
            delivered: 0,
            window_start: Instant::now(),
            window_delivered: 0,
            next_backlog: None,
            backlog: None,
            stale: false,
        }
    }

    /// Counts a batch's deliveries.
    pub fn batch(&mut self, delivered: usize) {
        self.delivered += delivered as u64;
        self.window_delivered += delivered as u64;
        self.stale |= delivered > 0;
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

    /// Refreshes the backlog figures when they are due (only for the terminal line). Called at
    /// the start, after every batch and when idle.
    pub async fn refresh_backlog(&mut self, client: &tokio_postgres::Client, schema: &Schema) {
        if self.bar.is_none() || self.next_backlog.is_some_and(|t| Instant::now() < t) {
            return;
        }
        let started = Instant::now();
        // A failed read keeps the last figures; the relay reports a lost connection itself.
        if let Ok(b) = outbox::backlog(client, schema).await {
            self.backlog = Some(b);
            self.stale = false;
        }
        self.next_backlog = Some(started + BACKLOG_EVERY.max(started.elapsed() * BACKLOG_SHARE));
        self.draw();
    }

    /// When the line shows a backlog from before the last deliveries: how soon it may be read
    /// again. An idle relay wakes up then, so the line ends up showing what is left.
    pub fn backlog_due_in(&self) -> Option<Duration> {
        (self.bar.is_some() && self.stale).then(|| {
            self.next_backlog.map_or(Duration::ZERO, |t| {
                t.saturating_duration_since(Instant::now())
            })
        })
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

    pub fn finish(&mut self) {
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
