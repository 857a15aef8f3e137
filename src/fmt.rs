//! Small formatting helpers for human-readable output.

use std::time::{Duration, SystemTime};
use unicode_width::UnicodeWidthStr;

/// RFC 3339 in UTC with microseconds: the one timestamp format leasectl publishes (event
/// payloads, `--json` output), whatever the database session's TimeZone. (Migration 0001 also
/// defines an `rfc3339()` SQL function of the same format; leasectl itself no longer calls it.)
pub fn rfc3339(t: SystemTime) -> String {
    let mut out = String::with_capacity(27);
    write_rfc3339(&mut out, t);
    out
}

/// [`rfc3339`], appended to `out`.
pub fn write_rfc3339(out: &mut String, t: SystemTime) {
    use std::fmt::Write;
    // Writing into a String cannot fail.
    let _ = write!(out, "{}", humantime::format_rfc3339_micros(t));
}

/// The fences of one server timeline: 2^40 acquisitions of a target (35 years at 1,000 a
/// second). Timeline `t` hands out the fences from `(t - 1) × FENCE_BLOCK + 1` on, so a promotion
/// (a new timeline) never repeats a fence of the timelines before it.
pub const FENCE_BLOCK: i64 = 1 << 40;

/// A fence for people: the counter alone on timeline 1 (a server never promoted: `17`), else
/// `TIMELINE:COUNTER` (`2:17` is the integer 2^40 + 17, what `LEASECTL_FENCE` and `--json` carry).
pub fn fence(f: i64) -> String {
    if f <= FENCE_BLOCK {
        return f.to_string();
    }
    let (block, counter) = ((f - 1) / FENCE_BLOCK, (f - 1) % FENCE_BLOCK + 1);
    format!("{}:{counter}", block + 1)
}

/// A compact duration for tables and messages: `850ms`, `4.2s`, `3m07s`, `2h05m`, `3d04h`.
pub fn duration(d: Duration) -> String {
    let ms = d.as_millis();
    let s = d.as_secs();
    match s {
        _ if ms < 1000 => format!("{ms}ms"),
        0..=59 => format!("{:.1}s", d.as_secs_f64()),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        3600..=86399 => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d{:02}h", s / 86400, (s % 86400) / 3600),
    }
}

/// Text for a one-line message or table cell: control characters and runs of white space
/// collapsed to one space, cut at `max` characters with `…`.
pub fn one_line(text: &str, max: usize) -> String {
    let words: Vec<&str> = text
        .split(|c: char| c.is_whitespace() || c.is_control())
        .filter(|w| !w.is_empty())
        .collect();
    let line = words.join(" ");
    match line.char_indices().nth(max) {
        Some((cut, _)) => format!("{}…", &line[..cut]),
        None => line,
    }
}

/// `text` cut to at most `max` terminal columns, the cut marked with `…` (which takes one of
/// them); text that fits is returned as it is.
pub fn cut_to_width(text: &str, max: usize) -> String {
    use unicode_width::UnicodeWidthChar;
    if text.width() <= max {
        return text.to_owned();
    }
    let mut out = String::new();
    let mut used = 0;
    for c in text.chars() {
        let w = c.width().unwrap_or(0);
        if used + w + 1 > max {
            break;
        }
        used += w;
        out.push(c);
    }
    out.push('…');
    out
}

/// Milliseconds from the database as a duration (negative values clamp to zero).
pub fn millis(ms: i64) -> Duration {
    Duration::from_millis(ms.max(0) as u64)
}

/// A duration as whole milliseconds (a `bigint` parameter, a JSON number), saturating.
pub fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Left-aligned columns, two spaces apart, widths by the widest cell in terminal columns
/// (display width: an emoji or a CJK character takes two, a combining mark none).
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.width()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.width());
        }
    }
    let mut out = String::new();
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut l = String::new();
        for (i, cell) in cells.enumerate() {
            if i > 0 {
                l.push_str("  ");
            }
            l.push_str(cell);
            if i + 1 < widths.len() {
                l.extend(std::iter::repeat_n(
                    ' ',
                    widths[i].saturating_sub(cell.width()),
                ));
            }
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(&mut header.iter().copied());
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_well() {
        assert_eq!(duration(Duration::from_millis(850)), "850ms");
        assert_eq!(duration(Duration::from_millis(4200)), "4.2s");
        assert_eq!(duration(Duration::from_secs(187)), "3m07s");
        assert_eq!(duration(Duration::from_secs(7500)), "2h05m");
        assert_eq!(duration(Duration::from_secs(3 * 86400 + 4 * 3600)), "3d04h");
    }

    #[test]
    fn fences_show_their_timeline_past_the_first() {
        assert_eq!(fence(0), "0");
        assert_eq!(fence(17), "17");
        assert_eq!(fence(FENCE_BLOCK), FENCE_BLOCK.to_string());
        assert_eq!(fence(FENCE_BLOCK + 1), "2:1");
        assert_eq!(fence(FENCE_BLOCK + 17), "2:17");
        assert_eq!(fence(2 * FENCE_BLOCK), format!("2:{FENCE_BLOCK}"));
        assert_eq!(fence(2 * FENCE_BLOCK + 5), "3:5");
    }

    #[test]
    fn one_line_collapses_and_cuts() {
        assert_eq!(one_line("a\n\n  b\tc\u{7}", 10), "a b c");
        assert_eq!(one_line("abcdef", 3), "abc…");
        assert_eq!(one_line("äöü", 3), "äöü");
    }

    #[test]
    fn cut_to_width_counts_columns() {
        assert_eq!(cut_to_width("short", 10), "short");
        assert_eq!(cut_to_width("exactly-10", 10), "exactly-10");
        assert_eq!(cut_to_width("abcdefghijk", 10), "abcdefghi…");
        // Wide characters take two columns: four of them and the ellipsis fill nine.
        assert_eq!(cut_to_width("日本日本日本", 10), "日本日本…");
        assert!(cut_to_width(&"x".repeat(200), 40).width() <= 40);
    }

    #[test]
    fn table_aligns() {
        let t = table(&["A", "BB"], &[vec!["xyz".into(), "1".into()]]);
        assert_eq!(t, "A    BB\nxyz  1\n");
        // Wide characters: the second column starts in the same terminal column on each line.
        let t = table(
            &["TARGET", "N"],
            &[
                vec!["🚀🚀".into(), "1".into()],
                vec!["日本".into(), "2".into()],
                vec!["ab".into(), "3".into()],
            ],
        );
        assert_eq!(t, "TARGET  N\n🚀🚀    1\n日本    2\nab      3\n");
    }
}
