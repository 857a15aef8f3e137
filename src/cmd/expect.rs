//! `leasectl expect --target T (--every DUR [--grace DUR] [--max-duration DUR] | --clear)`:
//! what the dead-man switch expects of a target (see [`crate::health`]).

use anyhow::Result;

use crate::cli::{DbArgs, ExpectArgs};
use crate::exit::Exit;
use crate::fmt;
use crate::store::health::{self, Expectation};

pub async fn run(db: &DbArgs, args: ExpectArgs) -> Result<Exit> {
    let db = super::connect(db).await?;
    let line = if args.clear {
        match health::clear_expectation(&db.client, &db.schema, &args.target).await? {
            None => format!("'{}' is not watched\n", args.target),
            Some(e) => format!("'{}': {}\n", args.target, cleared(&e)),
        }
    } else {
        let e = health::set_expectation(
            &db.client,
            &db.schema,
            &args.target,
            args.every,
            args.grace,
            args.max_duration,
        )
        .await?;
        format!("'{}': expecting {}\n", args.target, describe(&e))
    };
    super::print(line.as_bytes())?;
    Ok(Exit::Code(0))
}

/// "its schedule '0 2 * * *' (UTC, from run --slot)", if it has one.
fn schedule(e: &Expectation) -> Option<String> {
    e.schedule.as_ref().map(|s| {
        format!(
            "its schedule '{s}' ({}, from run --slot)",
            e.schedule_tz.as_deref().unwrap_or("UTC")
        )
    })
}

/// What `--clear` forgot, in one phrase.
fn cleared(e: &Expectation) -> String {
    let expected = e.every_ms.is_some() || e.max_duration_ms.is_some() || e.grace_ms.is_some();
    match (expected, schedule(e)) {
        (_, Some(s)) => format!(
            "no longer watched ({}{s} forgotten; the next `run --slot` stores it again)",
            if expected { "the expectation and " } else { "" }
        ),
        (true, None) => "no longer watched (the expectation forgotten)".into(),
        (false, None) => "no longer watched".into(),
    }
}

/// What is now expected, in one phrase.
fn describe(e: &Expectation) -> String {
    let d = |ms: i64| fmt::duration(fmt::millis(ms));
    let mut parts = Vec::new();
    if let Some(every) = e.every_ms {
        parts.push(format!("a successful run at least every {}", d(every)));
    }
    if let Some(max) = e.max_duration_ms {
        parts.push(format!("runs of at most {}", d(max)));
    }
    if let Some(s) = schedule(e) {
        parts.push(format!("a completed run in every slot of {s}"));
    }
    let grace = match e.grace_ms {
        Some(g) => format!("grace {}", d(g)),
        None => default_grace(e),
    };
    if parts.is_empty() {
        // Only --grace: it waits for a schedule from `run --slot`.
        return format!("nothing yet ({grace}, for the schedule of a future `run --slot`)");
    }
    if e.every_ms.is_some() || e.schedule.is_some() {
        parts.push(grace);
    }
    parts.join(", ")
}

/// The grace in force without --grace, as a value: a tenth of --every, and of each slot of the
/// schedule, at most 1h (see [`crate::health::default_grace`]).
fn default_grace(e: &Expectation) -> String {
    let every = e
        .every_ms
        .map(|ms| fmt::duration(crate::health::default_grace(fmt::millis(ms))));
    // A schedule's slots may differ in length (`0 9 * * 1-5`): the grace of its shortest, named
    // as such unless it is already the cap, which every longer slot gets too.
    let slot = e.schedule.as_deref().and_then(|expr| {
        let schedule = crate::health::Schedule::new(expr, e.schedule_tz.as_deref()).ok()?;
        let g = crate::health::default_grace(schedule.shortest_interval());
        Some(if g >= crate::health::MAX_DEFAULT_GRACE {
            fmt::duration(g)
        } else {
            format!("{} (a tenth of its shortest slot)", fmt::duration(g))
        })
    });
    match (every, slot) {
        (Some(every), Some(slot)) => format!("grace {every} for --every, {slot} for a slot"),
        (Some(g), None) | (None, Some(g)) => format!("grace {g}"),
        (None, None) => "grace a tenth of the interval, at most 1h".into(),
    }
}
