//! Raw flag values checked into the values the rest of the program trusts.
//!
//! The `parse_*` functions are clap value parsers, so a bad value is a one-line usage error
//! naming the flag. [`RunConfig::new`] applies the rules that involve several flags, such as
//! "two heartbeats plus the kill grace must fit inside the TTL", before anything connects.

use std::ffi::OsString;
use std::time::Duration;

use crate::cli::{LeaseArgs, RunArgs};
use crate::error::usage;
use crate::run::slot::Schedule;
use crate::store::waiters::QueueMode;

/// Longest accepted target, in Unicode scalar values.
pub const MAX_TARGET_CHARS: usize = 200;
/// Longest accepted schema name. PostgreSQL allows 63 bytes; the notification channels add a
/// suffix to it and must stay within 63 themselves.
pub const MAX_SCHEMA_BYTES: usize = 48;

/// The largest `--capture-limit`: stdout and stderr travel to PostgreSQL in one message, which
/// it caps at 1 GiB, so each stream gets at most a quarter of that (room for the rest).
pub const MAX_CAPTURE_LIMIT: usize = 256 << 20;

/// The duration forms the help and the README use; every message about a bad duration names
/// them, and only them.
const DURATION_FORMS: &str = "e.g. 500ms, 30s, 2m, 1h, 1d or 1h30m";

/// Parses `500ms`, `30s`, `2m`, `1h`, `1d` (and combinations such as `1h30m`).
///
/// Errors speak of those forms alone (humantime's own text suggests `30sec`, a unit the
/// documentation never uses), and a negative value is named as such: the flags that take a
/// duration accept a leading `-` as a value so that it reaches this parser instead of being read
/// as another flag.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if t.is_empty() {
        return Err(format!("empty duration (expected {DURATION_FORMS})"));
    }
    if t.starts_with('-') && t[1..].starts_with(|c: char| c.is_ascii_digit()) {
        return Err(format!(
            "'{t}' is negative (a duration is 0 or more, {DURATION_FORMS})"
        ));
    }
    if t.chars().all(|c| c.is_ascii_digit()) {
        return Err(format!("'{t}' has no unit (expected e.g. {t}s or {t}ms)"));
    }
    let d = humantime::parse_duration(t).map_err(|e| match e {
        humantime::DurationError::UnknownUnit { unit, value, .. } if unit.is_empty() => {
            format!("'{t}' is not a duration: {value} has no unit (units ms, s, m, h, d; {DURATION_FORMS})")
        }
        humantime::DurationError::UnknownUnit { unit, .. } => {
            format!("'{t}' is not a duration: '{unit}' is not a unit (units ms, s, m, h, d; {DURATION_FORMS})")
        }
        humantime::DurationError::NumberOverflow => {
            format!("'{t}' is too long (at most 100 years)")
        }
        _ => format!("'{t}' is not a duration (expected {DURATION_FORMS})"),
    })?;
    if d > MAX_DURATION {
        return Err(format!("'{t}' is too long (at most 100 years)"));
    }
    Ok(d)
}

/// A lease token (`--token`): the UUID `acquire` printed as LEASECTL_TOKEN.
pub fn parse_token(s: &str) -> Result<uuid::Uuid, String> {
    const WHAT: &str =
        "a token is the UUID `leasectl acquire` printed as LEASECTL_TOKEN, e.g. 0b6c5c2e-4f7e-4a8f-9d47-2a1f0e4c9b11";
    let t = s.trim();
    if t.is_empty() {
        return Err(format!("the token is empty ({WHAT}; is the variable set?)"));
    }
    t.parse()
        .map_err(|_| format!("'{t}' is not a token ({WHAT})"))
}

/// An exit code for `--busy-exit-code` / `--done-exit-code`: 0 to 255.
pub fn parse_exit_code(s: &str) -> Result<u8, String> {
    s.trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u8::try_from(n).ok())
        .ok_or_else(|| format!("'{s}' is not an exit code (0 to 255)"))
}

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

/// `--wait` alone waits forever; `--wait=DUR` waits up to DUR.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    Forever,
    Upto(Duration),
}

pub fn parse_wait(s: &str) -> Result<Wait, String> {
    if s == "forever" {
        Ok(Wait::Forever)
    } else {
        parse_duration(s).map(Wait::Upto)
    }
}

/// A target is 1–200 Unicode scalar values, none of them control characters, with no white
/// space at either end: `' deploy'` would be another target than `deploy` that looks the same
/// in every table and message.
pub fn parse_target(s: &str) -> Result<String, String> {
    let n = s.chars().count();
    if n == 0 {
        return Err("the target is empty (it needs 1 to 200 characters)".into());
    }
    if n > MAX_TARGET_CHARS {
        return Err(format!(
            "the target is {n} characters long (at most {MAX_TARGET_CHARS})"
        ));
    }
    if let Some(c) = s.chars().find(|c| c.is_control()) {
        return Err(format!("the target contains the control character {:?}", c));
    }
    if s.trim().is_empty() {
        return Err("the target is only white space (it needs a visible character)".into());
    }
    if s.trim() != s {
        return Err(format!(
            "the target '{s}' begins or ends with white space (it would be another target than '{}')",
            s.trim()
        ));
    }
    Ok(s.to_owned())
}

/// The largest `--max-holders`.
pub const MAX_HOLDERS: i32 = 1000;

/// Longest accepted `--label`, in Unicode scalar values.
pub const MAX_LABEL_CHARS: usize = 200;

/// A `--label`: 1–200 Unicode scalar values, none of them control characters (it is shown on
/// one line wherever holders are).
pub fn parse_label(s: &str) -> Result<String, String> {
    let n = s.chars().count();
    if n == 0 {
        return Err("the label is empty (it needs 1 to 200 characters)".into());
    }
    if n > MAX_LABEL_CHARS {
        return Err(format!(
            "the label is {n} characters long (at most {MAX_LABEL_CHARS})"
        ));
    }
    if let Some(c) = s.chars().find(|c| c.is_control()) {
        return Err(format!("the label contains the control character {:?}", c));
    }
    Ok(s.to_owned())
}

/// `--wait-notice`: a duration, or `0` for never.
pub fn parse_notice(s: &str) -> Result<Duration, String> {
    if s.trim() == "0" {
        return Ok(Duration::ZERO);
    }
    parse_duration(s)
}

/// How often a waiter says where it stands, unless told otherwise.
pub const DEFAULT_WAIT_NOTICE: Duration = Duration::from_secs(30);

/// A schema name: an ASCII letter or underscore, then letters, digits or underscores.
///
/// The name is always double-quoted in SQL, so case is kept exactly as given.
pub fn parse_schema(s: &str) -> Result<String, String> {
    let ok_first = s
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    let ok_rest = s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !ok_first || !ok_rest {
        return Err(format!(
            "'{s}' is not a valid schema name (use letters, digits and underscores, not starting with a digit)"
        ));
    }
    if s.len() > MAX_SCHEMA_BYTES {
        return Err(format!(
            "the schema name is {} bytes long (at most {MAX_SCHEMA_BYTES})",
            s.len()
        ));
    }
    if s.starts_with("pg_") {
        return Err(format!(
            "'{s}' is reserved by PostgreSQL (names starting with pg_ are)"
        ));
    }
    Ok(s.to_owned())
}

/// Parses a byte count: `65536`, `64KiB`, `1MiB`, `1MB` (units are powers of 1024).
pub fn parse_byte_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num
        .parse()
        .map_err(|_| format!("'{t}' is not a size (expected e.g. 65536, 64KiB, 1MiB)"))?;
    let mult: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => {
            return Err(format!(
                "'{t}' has an unknown unit (use B, KiB, MiB or GiB)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("'{t}' is too large"))
}

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
    pub fn times(&self) -> crate::run::heartbeat::Times {
        crate::run::heartbeat::Times {
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
    // child dead (SIGTERM, grace, SIGKILL) before the TTL runs out. SPEC makes anything
    // tighter a usage error rather than a lease that silently cannot keep its promise.
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
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1d"), Ok(Duration::from_secs(86400)));
        assert!(parse_duration("5").unwrap_err().contains("no unit"));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("").is_err());
        assert!(parse_duration("100y").is_ok());
        assert!(parse_duration("150000000000000d")
            .unwrap_err()
            .contains("too long"));
        assert!(parse_wait("150000000000000d").is_err());
    }

    #[test]
    fn labels_and_notices() {
        assert!(parse_label("").is_err());
        assert!(parse_label(&"x".repeat(201)).unwrap_err().contains("201"));
        assert!(parse_label(&"é".repeat(200)).is_ok());
        assert!(parse_label("a\tb").unwrap_err().contains("control"));
        assert!(parse_label("https://ci.example/p/42 abc123").is_ok());
        assert_eq!(parse_notice("0"), Ok(Duration::ZERO));
        assert_eq!(parse_notice("45s"), Ok(Duration::from_secs(45)));
        assert!(parse_notice("5").is_err());
    }

    #[test]
    fn duration_errors_use_leasectls_forms() {
        assert!(parse_duration("-5s").unwrap_err().contains("negative"));
        assert!(parse_duration("1h30")
            .unwrap_err()
            .contains("30 has no unit"));
        assert!(parse_duration("5x")
            .unwrap_err()
            .contains("'x' is not a unit"));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        assert!(parse_token("").unwrap_err().contains("empty"));
        assert!(parse_token("x").unwrap_err().contains("LEASECTL_TOKEN"));
        assert!(parse_token("0b6c5c2e-4f7e-4a8f-9d47-2a1f0e4c9b11").is_ok());
        assert_eq!(parse_exit_code("255"), Ok(255));
        assert!(parse_exit_code("-1").is_err());
        assert!(parse_exit_code("256").is_err());
    }

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

    #[test]
    fn targets() {
        assert!(parse_target(" leading").is_err());
        assert!(parse_target("trailing\u{a0}").is_err());
        assert!(parse_target("  ").unwrap_err().contains("only white space"));
        assert!(parse_target("in between").is_ok());
        assert!(parse_target("").is_err());
        assert!(parse_target(&"x".repeat(201)).is_err());
        assert!(parse_target(&"é".repeat(200)).is_ok());
        assert!(parse_target("a\nb").is_err());
        assert!(parse_target("nightly report/eu-1").is_ok());
    }

    #[test]
    fn schemas() {
        assert!(parse_schema("leasectl").is_ok());
        assert!(parse_schema("My_Schema2").is_ok());
        assert!(parse_schema("1abc").is_err());
        assert!(parse_schema("a-b").is_err());
        assert!(parse_schema("a\"; drop").is_err());
        assert!(parse_schema("pg_catalog").is_err());
        assert!(parse_schema(&"s".repeat(49)).is_err());
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

    #[test]
    fn sizes() {
        assert_eq!(parse_byte_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_byte_size("64k"), Ok(64 << 10));
        assert_eq!(parse_byte_size("100"), Ok(100));
        assert!(parse_byte_size("1XB").is_err());
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
