//! A run's flags checked into the [`RunConfig`] the rest of the program trusts.
//!
//! Each value was checked alone by clap (the parsers of [`crate::model::flags`]);
//! [`RunConfig::new`] applies the rules that involve several flags, such as "two heartbeats plus
//! the kill grace must fit inside the TTL", before anything connects.

use std::ffi::OsString;
use std::time::Duration;

use crate::cli::{LeaseArgs, RunArgs};
use crate::error::usage;
use crate::model::flags::{Wait, DEFAULT_WAIT_NOTICE, MAX_CAPTURE_LIMIT};
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
    given: (Option<Duration>, Option<Duration>),
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

impl SlotConfig {
    fn new(a: &RunArgs) -> anyhow::Result<Option<SlotConfig>> {
        let Some(expr) = &a.slot else {
            return Ok(None);
        };
        let schedule = Schedule::new(expr, a.slot_tz.as_deref()).map_err(usage)?;
        let skew = match a.slot_skew {
            Some(s) if !schedule.skew_fits(s) => {
                return Err(usage(format!(
                    "--slot-skew {} is not shorter than the shortest interval of '{}' ({})",
                    humantime::format_duration(s),
                    schedule.expr,
                    humantime::format_duration(schedule.shortest_interval()),
                )))
            }
            Some(s) => s,
            None => schedule.default_skew(),
        };
        Ok(Some(SlotConfig {
            schedule,
            skew,
            until_success: a.until_success,
            done_exit_code: a.done_exit_code,
        }))
    }
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

    pub fn new(a: RunArgs) -> anyhow::Result<RunConfig> {
        let (heartbeat, kill_after) = times(a.lease.ttl, a.heartbeat, a.kill_after)?;
        if a.quiet && a.reuse_within.is_some() {
            // --quiet would silence the very output --reuse-within exists to hand out: every
            // caller, the one that runs included, would print nothing and exit 0.
            return Err(usage(
                "--quiet cannot go with --reuse-within: it would discard the result every caller is meant to print (redirect stdout to discard it instead)",
            ));
        }
        if a.capture_limit > MAX_CAPTURE_LIMIT {
            return Err(usage(format!(
                "--capture-limit {} is too large (at most 256MiB: stdout and stderr are stored in one PostgreSQL message, which holds at most 1GiB)",
                a.capture_limit
            )));
        }
        if a.events_limit > MAX_CAPTURE_LIMIT {
            return Err(usage(format!(
                "--events-limit {} is too large (at most 256MiB: the events travel to PostgreSQL in one message with the run)",
                a.events_limit
            )));
        }
        if a.timeout.is_some_and(|t| t.is_zero()) {
            return Err(usage("--timeout must be longer than 0"));
        }
        if a.command.first().is_none_or(|c| c.is_empty()) {
            return Err(usage(
                "no command given (put it after --, e.g. leasectl run --target x -- ./job.sh)",
            ));
        }
        if a.lease.max_holders > 1 && (a.slot.is_some() || a.reuse_within.is_some()) {
            // Both decide "has this been done already?" under the lease, which only a single
            // holder can answer for everyone.
            let other = if a.slot.is_some() {
                "--slot"
            } else {
                "--reuse-within"
            };
            return Err(usage(format!(
                "--max-holders cannot go with {other}: several holders would each do the work"
            )));
        }
        let slot = SlotConfig::new(&a)?;
        let event_type = if a.no_event {
            None
        } else if a.event_type.trim().is_empty() {
            return Err(usage(
                "--event-type must not be empty (use --no-event for none)",
            ));
        } else {
            Some(a.event_type)
        };
        Ok(RunConfig {
            slot,
            heartbeat,
            kill_after,
            token: a.token,
            given: (a.heartbeat, a.kill_after),
            reuse_within: a.reuse_within,
            timeout: a.timeout,
            event_type,
            quiet: a.quiet,
            capture_limit: a.capture_limit,
            events_limit: a.events_limit,
            command: a.command,
            ..RunConfig::lease(a.lease, (heartbeat, kill_after))
        })
    }

    /// `acquire`: how to take the lease, and nothing to run.
    pub fn acquire(a: LeaseArgs) -> anyhow::Result<RunConfig> {
        let times = times(a.ttl, None, None)?;
        Ok(RunConfig::lease(a, times))
    }

    fn lease(a: LeaseArgs, (heartbeat, kill_after): (Duration, Duration)) -> RunConfig {
        RunConfig {
            target: a.target,
            ttl: a.ttl,
            heartbeat,
            kill_after,
            wait: a.wait,
            queue: a.queue,
            wait_notice: Some(a.wait_notice.unwrap_or(DEFAULT_WAIT_NOTICE))
                .filter(|d| !d.is_zero()),
            label: a.label,
            max_holders: a.max_holders,
            replace: a.replace,
            token: None,
            given: (None, None),
            reuse_within: None,
            timeout: None,
            busy_exit_code: a.busy_exit_code,
            event_type: None,
            quiet: false,
            capture_limit: 0,
            events_limit: 0,
            slot: None,
            command: Vec::new(),
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

    fn run_config(flags: &[&str]) -> anyhow::Result<RunConfig> {
        use clap::Parser;
        let argv = ["leasectl", "run", "--target", "t"]
            .iter()
            .chain(flags)
            .chain(&["--", "true"]);
        let cli = crate::cli::Cli::try_parse_from(argv)?;
        let crate::cli::Command::Run(args) = cli.command else {
            unreachable!()
        };
        RunConfig::new(*args)
    }

    #[test]
    fn slot_skews() {
        let skew = |flags: &[&str]| run_config(flags).unwrap().slot.unwrap().skew;
        assert_eq!(skew(&["--slot", "0 2 * * *"]), Duration::from_secs(60));
        assert_eq!(skew(&["--slot", "* * * * *"]), Duration::from_secs(15));
        assert_eq!(
            skew(&["--slot", "0 2 * * *", "--slot-skew", "5m"]),
            Duration::from_secs(300)
        );
        assert!(run_config(&["--slot", "*/2 * * * *", "--slot-skew", "2m"]).is_err());
        assert!(run_config(&[]).unwrap().slot.is_none());
    }
}

/// Whatever a user types, every flag parser and the run config answer with a value or a
/// usage error — never a panic — and every duration they accept can be added to an instant
/// (deadlines are `now + duration` throughout `run`).
#[cfg(test)]
mod never_panic {
    use super::*;
    use crate::cli::Cli;
    use clap::Parser;
    use proptest::prelude::*;

    /// Numbers of any size with any unit humantime knows, and now and then a bad one.
    fn duration_text() -> impl Strategy<Value = String> {
        (
            prop_oneof![9 => "[1-9][0-9]{0,19}", 1 => Just(String::new())],
            prop_oneof![
                Just("ns"),
                Just("ms"),
                Just("s"),
                Just("m"),
                Just("h"),
                Just("d"),
                Just("w"),
                Just("y"),
                Just("x")
            ],
        )
            .prop_map(|(n, u)| format!("{n}{u}"))
    }

    fn text() -> impl Strategy<Value = String> {
        prop_oneof![duration_text(), any::<String>(), "[0-9]{1,25}[KMG]i?B"]
    }

    proptest! {
        #[test]
        fn parsers_return_a_value_or_an_error(s in text()) {
            use crate::model::flags::*;
            let _ = parse_duration(&s);
            let _ = parse_wait(&s);
            let _ = parse_target(&s);
            let _ = parse_schema(&s);
            let _ = parse_byte_size(&s);
        }

    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn a_run_config_is_valid_or_a_usage_error(
            flags in proptest::collection::vec(
                (prop_oneof![
                    Just("--ttl"), Just("--heartbeat"), Just("--kill-after"), Just("--timeout"),
                    Just("--wait="), Just("--reuse-within")
                ], duration_text()),
                0..6,
            ),
        ) {
            let mut argv: Vec<String> = ["leasectl", "run", "--target", "t"].map(String::from).into();
            for (flag, value) in flags {
                if let Some(flag) = flag.strip_suffix('=') {
                    argv.push(format!("{flag}={value}"));
                } else {
                    argv.extend([flag.to_owned(), value]);
                }
            }
            argv.extend(["--", "true"].map(String::from));
            let Ok(cli) = Cli::try_parse_from(argv) else { return Ok(()) };
            let crate::cli::Command::Run(args) = cli.command else { unreachable!() };
            if let Ok(cfg) = RunConfig::new(*args) {
                let now = std::time::Instant::now();
                let longest = [Some(cfg.ttl), Some(cfg.heartbeat), Some(cfg.kill_after), cfg.timeout, cfg.reuse_within];
                for d in longest.into_iter().flatten() {
                    prop_assert!(now.checked_add(d * 2).is_some(), "{d:?} overflows an instant");
                }
                if let Some(Wait::Upto(d)) = cfg.wait {
                    prop_assert!(now.checked_add(d).is_some());
                }
            }
        }
    }
}
