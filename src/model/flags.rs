//! The flag values the rest of the program trusts, and the clap value parsers that check them:
//! a bad value is a one-line usage error naming the flag.

use std::time::Duration;

use super::time::MAX_DURATION;

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

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn sizes() {
        assert_eq!(parse_byte_size("1MiB"), Ok(1 << 20));
        assert_eq!(parse_byte_size("64k"), Ok(64 << 10));
        assert_eq!(parse_byte_size("100"), Ok(100));
        assert!(parse_byte_size("1XB").is_err());
    }
}
