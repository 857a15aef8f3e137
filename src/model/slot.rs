//! `run --slot`'s schedules: which scheduled slot an instant belongs to.
//!
//! A schedule is a 5-field cron expression (or `@hourly`, `@daily`, `@weekly`, `@monthly`,
//! `@yearly`), parsed by `croner`, in an IANA time zone (UTC by default) read by `jiff` from the
//! system's time zone database (`/usr/share/zoneinfo`, or `TZDIR`), as cron itself reads it,
//! with a copy built in for hosts that have none. The
//! slot of an instant is the latest scheduled instant at or before it plus the skew, so a manual
//! run at 15:00 of a `0 2 * * *` job belongs to that day's 02:00 slot, never to tomorrow's; the
//! skew covers hosts whose clocks or cron daemons fire a little early. Everything here is pure:
//! the caller passes the database's clock, never the host's.

use std::time::{Duration, SystemTime};

use croner::parser::{CronParser, Seconds, Year};
use croner::Cron;
use jiff::tz::TimeZone;
use jiff::{Timestamp, Zoned};

/// The skew when the schedule's shortest interval is at least four times as long.
pub const DEFAULT_SKEW: Duration = Duration::from_secs(60);

/// How many occurrences [`Schedule::shortest_interval`] looks at: enough for every gap of a
/// minute-level pattern (they repeat hourly or daily) and for the rare short gaps of sparse
/// ones (a year boundary, a leap day), while costing well under a millisecond per hundred.
const INTERVAL_SAMPLES: usize = 1500;

/// A checked schedule and its zone.
#[derive(Debug, Clone)]
pub struct Schedule {
    /// The expression as given (stored on the target, see `store::runs`).
    pub expr: String,
    /// The IANA zone as given; `None` is UTC.
    pub zone: Option<String>,
    cron: Cron,
    tz: TimeZone,
}

/// One slot: its scheduled instant and the next one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub start: SystemTime,
    pub end: SystemTime,
}

/// Names in the zone database's directory that are not zones every host shares: `localtime`
/// is this host's own zone (a link to /etc/localtime), so two hosts could put the same slot at
/// different instants; `posixrules` is the rules file for POSIX TZ strings.
const NOT_SHARED: [&str; 2] = ["localtime", "posixrules"];

/// Parses an IANA zone name (`Europe/Berlin`, `UTC`), for `--slot-tz`.
pub fn parse_zone(s: &str) -> Result<TimeZone, String> {
    let name = s.trim();
    if NOT_SHARED.iter().any(|n| n.eq_ignore_ascii_case(name)) {
        return Err(format!(
            "'{name}' is this host's own zone, which other hosts need not share; give an IANA time zone name (e.g. UTC, Europe/Berlin, America/New_York)"
        ));
    }
    TimeZone::get(name).map_err(|_| {
        format!("'{s}' is not an IANA time zone name (e.g. UTC, Europe/Berlin, America/New_York)")
    })
}

/// A zone name as the time zone database spells it (`europe/berlin` is found as
/// `Europe/Berlin`): what is stored with the schedule, so every host and every reader of
/// `status` sees one name for one zone.
pub fn zone_name(s: &str) -> Result<String, String> {
    let tz = parse_zone(s)?;
    Ok(tz.iana_name().unwrap_or(s.trim()).to_owned())
}

/// Checks a schedule's syntax alone, for `--slot` (the zone is checked on its own flag).
pub fn parse_expr(s: &str) -> Result<String, String> {
    Schedule::new(s, None).map(|sch| sch.expr)
}

impl Schedule {
    /// `at` in this schedule's zone; `None` outside the calendar's range (years -9999 to 9999:
    /// a grace of centuries read from the database).
    fn zoned(&self, at: SystemTime) -> Option<Zoned> {
        Some(Timestamp::try_from(at).ok()?.to_zoned(self.tz.clone()))
    }

    /// Parses `expr` in `zone` (UTC when `None`). A schedule that never fires is refused too.
    pub fn new(expr: &str, zone: Option<&str>) -> Result<Schedule, String> {
        let expr = expr.trim();
        let shape = "expected 5 fields (minute hour day-of-month month day-of-week) or @hourly, @daily, @weekly, @monthly, @yearly, @annually";
        let fields = expr.split_whitespace().count();
        let nickname = expr.starts_with('@');
        if nickname && fields != 1 || !nickname && fields != 5 {
            return Err(format!("'{expr}' is not a cron schedule ({shape})"));
        }
        if nickname
            && ![
                "@hourly",
                "@daily",
                "@weekly",
                "@monthly",
                "@yearly",
                "@annually",
            ]
            .iter()
            .any(|n| n.eq_ignore_ascii_case(expr))
        {
            return Err(format!("'{expr}' is not a cron schedule ({shape})"));
        }
        let cron = CronParser::builder()
            .seconds(Seconds::Disallowed)
            .year(Year::Disallowed)
            .build()
            .parse(expr)
            .map_err(|e| format!("'{expr}' is not a cron schedule ({e})"))?;
        let tz = match zone {
            Some(z) => parse_zone(z)?,
            None => TimeZone::UTC,
        };
        let schedule = Schedule {
            expr: expr.to_owned(),
            zone: zone.map(|z| z.trim().to_owned()),
            cron,
            tz,
        };
        // `0 0 31 2 *` parses but never fires; better said now than after taking the lease.
        let since = reference(&schedule.tz);
        if schedule.cron.find_next_occurrence(&since, false).is_err() {
            return Err(format!("'{expr}' never fires"));
        }
        Ok(schedule)
    }

    /// The slot `at` belongs to: the latest scheduled instant at or before `at + skew`, and the
    /// next scheduled instant after it. `None` only if the schedule has no such instant (out of
    /// the calendar's range).
    pub fn slot_at(&self, at: SystemTime, skew: Duration) -> Option<Slot> {
        let probe = at.checked_add(skew)?;
        // Whole seconds: scheduled instants are, and the search steps by seconds.
        let secs = probe.duration_since(SystemTime::UNIX_EPOCH).ok()?.as_secs();
        let probe = Timestamp::from_second(i64::try_from(secs).ok()?).ok()?;
        let probe = probe.to_zoned(self.tz.clone());
        let start = self.cron.find_previous_occurrence(&probe, true).ok()?;
        let end = self.cron.find_next_occurrence(&start, false).ok()?;
        Some(Slot {
            start: to_system(&start)?,
            end: to_system(&end)?,
        })
    }

    /// The latest scheduled instant at or before `at` (for the dead-man switch, `health`).
    pub fn at_or_before(&self, at: SystemTime) -> Option<SystemTime> {
        let t = self.zoned(at)?;
        to_system(&self.cron.find_previous_occurrence(&t, true).ok()?)
    }

    /// The first scheduled instant after `at`.
    pub fn after(&self, at: SystemTime) -> Option<SystemTime> {
        let t = self.zoned(at)?;
        to_system(&self.cron.find_next_occurrence(&t, false).ok()?)
    }

    /// The last scheduled instant before `at`.
    pub fn before(&self, at: SystemTime) -> Option<SystemTime> {
        let t = self.zoned(at)?;
        to_system(&self.cron.find_previous_occurrence(&t, false).ok()?)
    }

    /// The shortest time between two consecutive scheduled instants, over the first
    /// `INTERVAL_SAMPLES` instants from a fixed reference (so every host computes the same
    /// value, whatever its clock says).
    pub fn shortest_interval(&self) -> Duration {
        let mut shortest: Option<Duration> = None;
        let mut at = reference(&self.tz);
        for _ in 0..INTERVAL_SAMPLES {
            let Ok(next) = self.cron.find_next_occurrence(&at, false) else {
                break;
            };
            let gap = next.timestamp().as_second() - at.timestamp().as_second();
            let gap = Duration::from_secs(u64::try_from(gap).unwrap_or(0));
            // The first gap runs from the reference, not from an occurrence.
            if self.cron.is_time_matching(&at).unwrap_or(false) && !gap.is_zero() {
                shortest = Some(shortest.map_or(gap, |s| s.min(gap)));
            }
            if shortest == Some(Duration::from_secs(60)) {
                break; // a 5-field schedule cannot do better than a minute
            }
            at = next;
        }
        shortest.unwrap_or(Duration::from_secs(365 * 86_400))
    }

    /// The shortest circular distance between two minutes of the minute field (60 for one
    /// minute a hour): a lower bound of [`Schedule::shortest_interval`] that costs nothing,
    /// since consecutive instants are at least that far apart on the wall clock, and a clock
    /// change only skips or repeats whole stretches of it.
    fn minute_gap(&self) -> Duration {
        let minutes: Vec<u32> = (0..60)
            .filter(|&m| self.cron.pattern.minute_match(m).unwrap_or(false))
            .collect();
        let wrap = match (minutes.first(), minutes.last()) {
            (Some(first), Some(last)) => first + 60 - last,
            _ => 60,
        };
        let gap = minutes.windows(2).map(|w| w[1] - w[0]).fold(wrap, u32::min);
        Duration::from_secs(u64::from(gap) * 60)
    }

    /// `--slot-skew`'s default: a minute, or a quarter of the shortest interval if less. Most
    /// schedules are settled by `Schedule::minute_gap` without a search.
    pub fn default_skew(&self) -> Duration {
        if self.minute_gap() >= DEFAULT_SKEW * 4 {
            return DEFAULT_SKEW;
        }
        DEFAULT_SKEW.min(self.shortest_interval() / 4)
    }

    /// Whether `skew` is shorter than the shortest interval: a longer one would take a caller
    /// past the coming slot into the one after it.
    pub fn skew_fits(&self, skew: Duration) -> bool {
        skew < self.minute_gap() || skew < self.shortest_interval()
    }
}

/// 2000-01-01T00:00:00Z in `tz`: the fixed start of [`Schedule::shortest_interval`]'s sample.
fn reference(tz: &TimeZone) -> Zoned {
    Timestamp::from_second(946_684_800)
        .unwrap_or(Timestamp::UNIX_EPOCH)
        .to_zoned(tz.clone())
}

/// Whole seconds since the epoch, from a scheduled instant; `None` before the epoch.
fn to_system(t: &Zoned) -> Option<SystemTime> {
    let secs = u64::try_from(t.timestamp().as_second()).ok()?;
    SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A UTC instant from RFC 3339 text.
    fn at(s: &str) -> SystemTime {
        humantime::parse_rfc3339(s).unwrap()
    }

    fn show(t: SystemTime) -> String {
        humantime::format_rfc3339_seconds(t).to_string()
    }

    fn slot(expr: &str, zone: Option<&str>, now: &str, skew: Duration) -> (String, String) {
        let s = Schedule::new(expr, zone)
            .unwrap()
            .slot_at(at(now), skew)
            .unwrap();
        (show(s.start), show(s.end))
    }

    fn pair(a: &str, b: &str) -> (String, String) {
        (a.to_owned(), b.to_owned())
    }

    const MIN: Duration = Duration::from_secs(60);

    #[test]
    fn a_manual_run_in_the_afternoon_belongs_to_that_mornings_slot() {
        assert_eq!(
            slot("0 2 * * *", None, "2026-03-10T15:00:00Z", MIN),
            pair("2026-03-10T02:00:00Z", "2026-03-11T02:00:00Z")
        );
        // Just before 02:00 it is still yesterday's slot…
        assert_eq!(
            slot("0 2 * * *", None, "2026-03-10T01:58:00Z", MIN),
            pair("2026-03-09T02:00:00Z", "2026-03-10T02:00:00Z")
        );
    }

    #[test]
    fn the_skew_takes_a_host_that_fires_early_into_the_coming_slot() {
        // …but a cron daemon firing at 01:59:30 (its clock 30s fast) is in the 02:00 slot.
        assert_eq!(
            slot("0 2 * * *", None, "2026-03-10T01:59:30Z", MIN),
            pair("2026-03-10T02:00:00Z", "2026-03-11T02:00:00Z")
        );
        // Exactly on the instant, with no skew: that slot (at or before).
        assert_eq!(
            slot("0 2 * * *", None, "2026-03-10T02:00:00Z", Duration::ZERO),
            pair("2026-03-10T02:00:00Z", "2026-03-11T02:00:00Z")
        );
        // Sub-second precision is not a problem.
        assert_eq!(
            slot(
                "0 2 * * *",
                None,
                "2026-03-10T01:59:59.999Z",
                Duration::ZERO
            ),
            pair("2026-03-09T02:00:00Z", "2026-03-10T02:00:00Z")
        );
    }

    #[test]
    fn zones_and_daylight_saving_time() {
        // 02:00 in Berlin is 01:00Z in winter and 00:00Z in summer.
        assert_eq!(
            slot(
                "0 2 * * *",
                Some("Europe/Berlin"),
                "2026-01-15T12:00:00Z",
                MIN
            ),
            pair("2026-01-15T01:00:00Z", "2026-01-16T01:00:00Z")
        );
        assert_eq!(
            slot(
                "0 2 * * *",
                Some("Europe/Berlin"),
                "2026-07-15T12:00:00Z",
                MIN
            ),
            pair("2026-07-15T00:00:00Z", "2026-07-16T00:00:00Z")
        );
        // The night the clocks go forward (2026-03-29, 02:00 → 03:00 in Berlin): the 03:00 slot
        // of the day before ends at 03:00 CEST = 01:00Z, a 23-hour slot.
        assert_eq!(
            slot(
                "0 3 * * *",
                Some("Europe/Berlin"),
                "2026-03-28T12:00:00Z",
                MIN
            ),
            pair("2026-03-28T02:00:00Z", "2026-03-29T01:00:00Z")
        );
        // …and back (2026-10-25, 03:00 → 02:00): a 25-hour slot.
        assert_eq!(
            slot(
                "0 3 * * *",
                Some("Europe/Berlin"),
                "2026-10-24T12:00:00Z",
                MIN
            ),
            pair("2026-10-24T01:00:00Z", "2026-10-25T02:00:00Z")
        );
        let half_past_two = |now| slot("30 2 * * *", Some("Europe/Berlin"), now, MIN);
        // 02:30 does not exist on 2026-03-29 in Berlin: that day's slot is at 03:00 CEST
        // (01:00Z), once; on 2026-10-25 it exists twice and is one slot, the first (00:30Z).
        assert_eq!(
            half_past_two("2026-03-29T12:00:00Z"),
            pair("2026-03-29T01:00:00Z", "2026-03-30T00:30:00Z")
        );
        assert_eq!(
            half_past_two("2026-03-28T12:00:00Z"),
            pair("2026-03-28T01:30:00Z", "2026-03-29T01:00:00Z")
        );
        assert_eq!(
            half_past_two("2026-10-25T01:45:00Z"),
            pair("2026-10-25T00:30:00Z", "2026-10-26T01:30:00Z")
        );
        // New York's midnight is 05:00Z in winter.
        assert_eq!(
            slot(
                "@daily",
                Some("America/New_York"),
                "2026-01-15T04:00:00Z",
                MIN
            ),
            pair("2026-01-14T05:00:00Z", "2026-01-15T05:00:00Z")
        );
    }

    #[test]
    fn month_ends_weeks_and_nicknames() {
        // The 31st: months without one are skipped.
        assert_eq!(
            slot("0 0 31 * *", None, "2026-05-15T00:00:00Z", MIN),
            pair("2026-03-31T00:00:00Z", "2026-05-31T00:00:00Z")
        );
        // @monthly across a year end.
        assert_eq!(
            slot("@monthly", None, "2026-12-31T23:59:30Z", MIN),
            pair("2027-01-01T00:00:00Z", "2027-02-01T00:00:00Z")
        );
        // @weekly is Sunday 00:00; 2026-03-11 is a Wednesday.
        assert_eq!(
            slot("@weekly", None, "2026-03-11T10:00:00Z", MIN),
            pair("2026-03-08T00:00:00Z", "2026-03-15T00:00:00Z")
        );
        assert_eq!(
            slot("@hourly", None, "2026-03-11T10:59:00Z", MIN),
            pair("2026-03-11T11:00:00Z", "2026-03-11T12:00:00Z")
        );
        // Leap day.
        assert_eq!(
            slot("0 12 29 2 *", None, "2027-06-01T00:00:00Z", MIN),
            pair("2024-02-29T12:00:00Z", "2028-02-29T12:00:00Z")
        );
        // Day of month OR day of week when both are restricted, as in Vixie cron: the 13th or
        // any Friday (2026-03-13 is a Friday; 2026-03-20 is the next one).
        assert_eq!(
            slot("0 0 13 * 5", None, "2026-03-14T00:00:00Z", MIN),
            pair("2026-03-13T00:00:00Z", "2026-03-20T00:00:00Z")
        );
    }

    #[test]
    fn every_minute_crosses_a_boundary_each_minute() {
        let s = Schedule::new("* * * * *", None).unwrap();
        let skew = s.default_skew();
        assert_eq!(skew, Duration::from_secs(15));
        let a = s.slot_at(at("2026-03-11T10:00:44Z"), skew).unwrap();
        let b = s.slot_at(at("2026-03-11T10:00:45Z"), skew).unwrap();
        assert_eq!(show(a.start), "2026-03-11T10:00:00Z");
        assert_eq!(show(a.end), "2026-03-11T10:01:00Z");
        assert_eq!(show(b.start), "2026-03-11T10:01:00Z");
    }

    #[test]
    fn the_default_skew_is_a_minute_or_a_quarter_of_the_shortest_interval() {
        let skew = |e: &str| Schedule::new(e, None).unwrap().default_skew();
        assert_eq!(skew("0 2 * * *"), Duration::from_secs(60));
        assert_eq!(skew("*/2 * * * *"), Duration::from_secs(30));
        assert_eq!(skew("*/5 * * * *"), Duration::from_secs(60));
        // The short gap is only at the turn of the hour: 59 → 00.
        assert_eq!(skew("0,59 * * * *"), Duration::from_secs(15));
        // Once a year a one-minute gap (Dec 31 23:59 → Jan 1 00:00).
        assert_eq!(skew("0,59 0,23 1,31 1,12 *"), Duration::from_secs(15));
        let s = Schedule::new("0 2 * * *", None).unwrap();
        assert!(s.skew_fits(Duration::from_secs(3600)));
        assert!(!s.skew_fits(Duration::from_secs(86_400)));
        assert!(!Schedule::new("* * * * *", None)
            .unwrap()
            .skew_fits(Duration::from_secs(60)));
        assert_eq!(
            Schedule::new("*/3 * * * *", None)
                .unwrap()
                .shortest_interval(),
            Duration::from_secs(180)
        );
    }

    #[test]
    fn bad_schedules_and_zones_are_refused_with_one_line() {
        for bad in [
            "",
            "* * * *",
            "0 0 * * * *",
            "0 0 * * * 2026",
            "61 * * * *",
            "0 25 * * *",
            "@reboot",
            "@every 5m",
            "soon",
            "0 0 31 2 *",
        ] {
            let e = Schedule::new(bad, None).unwrap_err();
            assert!(!e.contains('\n'), "{e}");
            assert!(
                e.contains("cron schedule") || e.contains("never fires"),
                "{bad}: {e}"
            );
        }
        let e = Schedule::new("0 2 * * *", Some("Mars/Olympus")).unwrap_err();
        assert!(e.contains("IANA"), "{e}");
        assert!(Schedule::new("0 2 * * MON-FRI", Some("Asia/Tokyo")).is_ok());
        assert!(Schedule::new("@DAILY", None).is_ok());
    }
}
