//! `clock`: this host's clock against the database's. leasectl decides nothing on a host's
//! clock (expiry, slots and health are judged on the database's), but a large skew still
//! confuses the people who read logs and `--slot` schedules in a host's time zone.
//!
//! Measured like NTP's simplest exchange: the host's time before and after one round trip that
//! reads `clock_timestamp()`; the database's reading is compared with the midpoint, so the error
//! is at most half the round trip. The fastest of a few round trips is kept.

use std::time::{Duration, SystemTime};

use anyhow::Result;

use super::{Check, Ctx};
use crate::fmt;

/// Round trips measured; the one with the shortest time wins.
const SAMPLES: usize = 3;

/// A skew beyond this (and beyond the measurement's error) is worth a warning.
const TOLERATED: Duration = Duration::from_secs(1);

/// The database's clock minus the host's (positive: the database is ahead), in milliseconds,
/// and the round trip it was measured with.
async fn measure(ctx: &Ctx) -> Result<(i64, Duration)> {
    let mut best: Option<(i64, Duration)> = None;
    for _ in 0..SAMPLES {
        let sent = SystemTime::now();
        let row = ctx
            .client()
            .query_typed_one(
                "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::int8 AS us",
                &[],
            )
            .await?;
        let received = SystemTime::now();
        let db_us: i64 = row.try_get("us")?;
        let rtt = received.duration_since(sent).unwrap_or_default();
        let mid = sent + rtt / 2;
        let host_us = match mid.duration_since(SystemTime::UNIX_EPOCH) {
            Ok(d) => i64::try_from(d.as_micros()).unwrap_or(i64::MAX),
            Err(e) => -i64::try_from(e.duration().as_micros()).unwrap_or(i64::MAX),
        };
        let skew_ms = (db_us - host_us) / 1000;
        if best.is_none_or(|(_, r)| rtt < r) {
            best = Some((skew_ms, rtt));
        }
    }
    best.ok_or_else(|| anyhow::anyhow!("no sample"))
}

pub async fn check(ctx: &Ctx) -> Result<Check> {
    let (skew_ms, rtt) = match measure(ctx).await {
        Ok(m) => m,
        Err(e) => return super::could_not(ctx, "clock", "read the database's clock", e),
    };
    let size = fmt::duration(Duration::from_millis(skew_ms.unsigned_abs()));
    let error = fmt::duration(rtt / 2);
    let way = if skew_ms > 0 { "behind" } else { "ahead of" };
    let beyond = Duration::from_millis(skew_ms.unsigned_abs()).saturating_sub(rtt / 2);
    Ok(if beyond > TOLERATED {
        Check::warn(
            "clock",
            format!("this host's clock is {size} {way} the database's (± {error}, round trip {}): leasectl judges leases, slots and health on the database's clock alone, but this host's logs and its idea of a --slot's time disagree with `status`", fmt::duration(rtt)),
            "synchronise both clocks with NTP (chrony, systemd-timesyncd)",
        )
    } else {
        Check::ok(
            "clock",
            format!(
                "this host's clock is within {} of the database's (skew {size}, round trip {})",
                fmt::duration(TOLERATED + rtt / 2),
                fmt::duration(rtt)
            ),
        )
    })
}
