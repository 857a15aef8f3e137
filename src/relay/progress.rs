//! What the relay shows while it runs: the indicatif line on a terminal (events/s and backlog)
//! and, with `-v`, throughput reports.

use std::io::IsTerminal;
use std::time::Duration;

use indicatif::ProgressBar;
use tokio::time::Instant;

use crate::db::Schema;
use crate::fmt;
use crate::store::outbox::{self, Backlog};

/// How often `-v` reports throughput.
const REPORT_EVERY: Duration = Duration::from_secs(10);

/// The indicatif line on a terminal (events/s and backlog), and `-v` throughput reports.
pub struct Progress {
    bar: Option<ProgressBar>,
    started: Instant,
    delivered: u64,
    window_start: Instant,
    window_delivered: u64,
    last_backlog: Option<Instant>,
    backlog: Option<Backlog>,
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
            last_backlog: None,
            backlog: None,
        }
    }

    /// Counts a batch's deliveries.
    pub fn batch(&mut self, delivered: usize) {
        self.delivered += delivered as u64;
        self.window_delivered += delivered as u64;
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
    pub async fn idle(&mut self, client: &tokio_postgres::Client, schema: &Schema) {
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
