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
}
