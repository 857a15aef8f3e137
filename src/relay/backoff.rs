//! How long the relay waits after a failure: the retry schedule of a refused event (exponential
//! from 1s, capped at 5m, with jitter) and the backoff and warnings while a sink is down.

use std::time::Duration;

use tokio::time::Instant;

use crate::fmt;

/// First retry delay after a refused delivery; doubles per attempt up to [`RETRY_CAP`].
const RETRY_BASE: Duration = Duration::from_secs(1);
const RETRY_CAP: Duration = Duration::from_secs(300);
/// Backoff while the sink or the database is unreachable.
pub const OUTAGE_BASE: Duration = Duration::from_secs(1);
pub const OUTAGE_CAP: Duration = Duration::from_secs(30);
/// While the sink stays down, the warning is repeated this often (services run without `-v`).
const OUTAGE_REMINDER: Duration = Duration::from_secs(300);

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
/// `OUTAGE_REMINDER` while it lasts, and when it ends (details with `-v`).
pub struct Outage {
    sink: String,
    backoff: Backoff,
    since: Option<Instant>,
    warned: Option<Instant>,
}

impl Outage {
    pub fn new(sink: String) -> Outage {
        Outage {
            sink,
            backoff: Backoff::new(OUTAGE_BASE, OUTAGE_CAP),
            since: None,
            warned: None,
        }
    }

    /// Records a failed try; returns how long to wait before the next one.
    pub fn down(&mut self, msg: &str) -> Duration {
        let delay = self.backoff.next_delay();
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
    pub fn up(&mut self) {
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
pub struct Backoff {
    base: Duration,
    cap: Duration,
    current: Duration,
}

impl Backoff {
    pub fn new(base: Duration, cap: Duration) -> Backoff {
        Backoff {
            base,
            cap,
            current: base,
        }
    }

    pub fn next_delay(&mut self) -> Duration {
        let d = self.current;
        self.current = (self.current * 2).min(self.cap);
        d.mul_f64(0.8 + 0.4 * fastrand::f64())
    }

    pub fn reset(&mut self) {
        self.current = self.base;
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
        let seen: Vec<Duration> = (0..8).map(|_| b.next_delay()).collect();
        assert!(seen[0] >= Duration::from_millis(800) && seen[0] <= Duration::from_millis(1200));
        assert!(seen[7] >= Duration::from_secs(24) && seen[7] <= Duration::from_secs(36));
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(1200));
    }
}
