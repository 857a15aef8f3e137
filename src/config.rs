//! A run's flags checked into the [`RunConfig`] the rest of the program trusts.
//!
//! Each value was checked alone by clap (the parsers of [`crate::model::flags`]);
//! [`RunConfig::new`] (in `run/flags.rs`, where the flags meet this module) applies the rules
//! that involve several flags, such as "two heartbeats plus the kill grace must fit inside the
//! TTL" ([`times`]), before anything connects. Nothing here knows the clap structs.

use std::ffi::OsString;
use std::time::Duration;

use crate::error::usage;
use crate::model::flags::Wait;
use crate::model::order::QueueMode;
use crate::model::slot::Schedule;

/// A `run` invocation, with defaults filled in and every cross-flag rule checked.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub target: String,
    pub ttl: Duration,
    pub heartbeat: Duration,
    pub kill_after: Duration,
    pub wait: Option<Wait>,
    /// How waiters take turns (only with `wait`).
    pub queue: QueueMode,
    /// Every how long a waiter without a terminal prints where it stands; `None`: never.
    pub wait_notice: Option<Duration>,
    pub label: Option<String>,
    /// `--max-holders`: 1 for the single holder.
    pub max_holders: i32,
    /// `--replace`: take the lease from a live holder.
    pub replace: bool,
    /// `run --token`: a step under a lease taken by `acquire`.
    pub token: Option<uuid::Uuid>,
    /// `--heartbeat` and `--kill-after` as given (a step's TTL is the held lease's, known only
    /// once it is taken up: see [`RunConfig::with_ttl`]).
    pub(crate) given: (Option<Duration>, Option<Duration>),
    pub reuse_within: Option<Duration>,
    pub timeout: Option<Duration>,
    pub busy_exit_code: u8,
    pub event_type: Option<String>,
    pub quiet: bool,
    pub capture_limit: usize,
    /// The most bytes the command may write to `LEASECTL_EVENTS`.
    pub events_limit: usize,
    /// `--slot` and its companions.
    pub slot: Option<SlotConfig>,
    pub command: Vec<OsString>,
}

/// `run --slot`: the schedule and how a done slot is judged and answered.
#[derive(Debug, Clone)]
pub struct SlotConfig {
    pub schedule: Schedule,
    pub skew: Duration,
    /// Only a run that exited 0 does the slot.
    pub until_success: bool,
    /// The exit code of a caller that finds its slot done.
    pub done_exit_code: u8,
}

impl RunConfig {
    /// The heartbeat schedule's durations.
    pub fn times(&self) -> crate::model::time::Times {
        crate::model::time::Times {
            ttl: self.ttl,
            interval: self.heartbeat,
            kill_after: self.kill_after,
        }
    }

    /// `run --token`: the TTL of the held lease, and the heartbeat and grace that follow from it
    /// (or the ones given, if they fit).
    pub fn with_ttl(&mut self, ttl: Duration) -> anyhow::Result<()> {
        let (heartbeat, kill_after) = times(ttl, self.given.0, self.given.1)?;
        self.ttl = ttl;
        self.heartbeat = heartbeat;
        self.kill_after = kill_after;
        Ok(())
    }
}

/// The shortest `--heartbeat` for a TTL: 10ms, and a thousandth of the TTL. A renewal is a
/// database round trip; a thousand of them per TTL buys no safety (two per TTL are enough to
/// survive a missed one) and only loads the database.
/// A positive count from the environment variable `var`, in debug builds only: how the tests
/// make rare upkeep frequent (`LEASECTL_TEST_SWEEP_ONE_IN`, `LEASECTL_TEST_VACUUM_EVERY`). A
/// release build never reads it.
pub fn test_count(var: &str) -> Option<u64> {
    if !cfg!(debug_assertions) {
        return None;
    }
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|n| *n > 0)
}

pub fn heartbeat_floor(ttl: Duration) -> Duration {
    (ttl / 1000).max(Duration::from_millis(10))
}

/// The heartbeat interval and the kill grace for a TTL — given, or the defaults (TTL/4, and
/// min(10s, TTL/10)) — checked to fit in it.
pub fn times(
    ttl: Duration,
    heartbeat: Option<Duration>,
    kill_after: Option<Duration>,
) -> anyhow::Result<(Duration, Duration)> {
    if ttl < Duration::from_millis(100) {
        return Err(usage(format!(
            "--ttl {} is too short (at least 100ms)",
            humantime::format_duration(ttl)
        )));
    }
    let heartbeat = heartbeat.unwrap_or(ttl / 4);
    let kill_after = kill_after.unwrap_or_else(|| Duration::from_secs(10).min(ttl / 10));
    if heartbeat.is_zero() {
        return Err(usage("--heartbeat must be longer than 0"));
    }
    let floor = heartbeat_floor(ttl);
    if heartbeat < floor {
        return Err(usage(format!(
            "--heartbeat {} is too short for --ttl {} (at least {}: 10ms, and TTL/1000)",
            crate::fmt::duration(heartbeat),
            crate::fmt::duration(ttl),
            crate::fmt::duration(floor),
        )));
    }
    // The holder must be able to miss one heartbeat, notice at the next, and still have the
    // child dead (SIGTERM, grace, SIGKILL) before the TTL runs out. Anything tighter is
    // a usage error rather than a lease that silently cannot keep its promise.
    if heartbeat * 2 + kill_after >= ttl {
        return Err(usage(format!(
            "--heartbeat {} and --kill-after {} do not fit in --ttl {} (need 2×heartbeat + kill-after < ttl)",
            humantime::format_duration(heartbeat),
            humantime::format_duration(kill_after),
            humantime::format_duration(ttl),
        )));
    }
    Ok((heartbeat, kill_after))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeats_have_a_floor() {
        assert_eq!(
            heartbeat_floor(Duration::from_secs(1)),
            Duration::from_millis(10)
        );
        assert_eq!(
            heartbeat_floor(Duration::from_secs(3600)),
            Duration::from_millis(3600)
        );
        let hb = |ttl: u64, hb: u64| {
            times(
                Duration::from_millis(ttl),
                Some(Duration::from_millis(hb)),
                None,
            )
        };
        assert!(hb(3_600_000, 3_599).is_err());
        assert!(hb(3_600_000, 3_600).is_ok());
        assert!(hb(1_000, 9).is_err());
        assert!(hb(1_000, 10).is_ok());
        // The default, TTL/4, is always above it.
        assert!(times(Duration::from_millis(100), None, None).is_ok());
    }
}
