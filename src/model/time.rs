//! Bounds on durations and deadlines, so no value a flag or the database gives can overflow a
//! clock.

use std::time::Duration;

/// The longest duration any flag takes. Bounding them at parse time keeps every sum with an
/// instant (a deadline) and every interval PostgreSQL computes from them in range, so no
/// value a user types can make leasectl panic — least of all after it took the lease.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 31_557_600); // 100 × 365.25 days

/// `at + d` for a deadline, checked: a duration that would overflow the clock (none a flag can
/// give, see [`MAX_DURATION`], but one read from the database could) means "as late as
/// representable", never a panic.
pub fn deadline(at: tokio::time::Instant, d: std::time::Duration) -> tokio::time::Instant {
    at.checked_add(d)
        .or_else(|| at.checked_add(MAX_DURATION))
        .unwrap_or(at)
}

/// The durations a heartbeat schedule is made of.
#[derive(Debug, Clone, Copy)]
pub struct Times {
    pub ttl: Duration,
    /// How often to renew.
    pub interval: Duration,
    /// The grace between SIGTERM and SIGKILL when stopping the command.
    pub kill_after: Duration,
}

/// How long after a confirmed heartbeat's send the command may keep running before it must
/// be stopped: `ttl - kill_after - margin`, with `margin = min(ttl/20, 500ms)` for the SIGKILL
/// to land and the process to die.
pub fn stop_budget(ttl: Duration, kill_after: Duration) -> Duration {
    let margin = (ttl / 20).min(Duration::from_millis(500));
    ttl.saturating_sub(kill_after + margin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_never_overflows() {
        let now = tokio::time::Instant::now();
        assert_eq!(
            deadline(now, Duration::from_secs(1)),
            now + Duration::from_secs(1)
        );
        let far = deadline(now, Duration::MAX);
        assert!(
            far >= now + MAX_DURATION,
            "saturates at the latest representable deadline"
        );
    }

    #[test]
    fn the_sigkill_lands_a_margin_before_the_ttl() {
        let s = Duration::from_secs;
        assert_eq!(stop_budget(s(120), s(10)), Duration::from_millis(109_500));
        assert_eq!(
            stop_budget(s(1), Duration::from_millis(100)),
            Duration::from_millis(850)
        );
        for (ttl_ms, kill_ms) in [
            (100, 10),
            (1000, 100),
            (120_000, 10_000),
            (3_600_000, 10_000),
        ] {
            let (ttl, kill) = (
                Duration::from_millis(ttl_ms),
                Duration::from_millis(kill_ms),
            );
            let budget = stop_budget(ttl, kill);
            assert!(
                budget + kill < ttl,
                "SIGKILL at {:?} is not before the TTL {ttl:?}",
                budget + kill
            );
            assert!(budget > Duration::ZERO);
        }
    }
}
