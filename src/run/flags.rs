//! A run's flags, as clap parsed them ([`RunArgs`], [`LeaseArgs`]), into the checked
//! [`RunConfig`]: the rules that involve several flags, before anything connects. `config.rs`
//! holds the config and its rules on plain values and knows nothing of the flags; this is where
//! the two meet.

use std::time::Duration;

use crate::cli::{LeaseArgs, RunArgs};
use crate::config::{times, RunConfig, SlotConfig};
use crate::error::usage;
use crate::model::flags::{DEFAULT_WAIT_NOTICE, MAX_CAPTURE_LIMIT};
use crate::model::slot::Schedule;

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
}

#[cfg(test)]
mod tests {
    use super::*;

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
    use crate::model::flags::Wait;
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
