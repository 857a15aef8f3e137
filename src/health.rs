//! The dead-man switch: is a watched target doing what is expected of it?
//!
//! A target is *watched* when it has a schedule (stored by `run --slot`) or an expectation (set
//! by `leasectl expect`). Everything is judged on the **database clock**: the store hands over
//! `now()` with the facts ([`Watch`]), and this module only compares instants — no host clock
//! is ever read here, so two hosts (or a relay and `check`) always agree.
//!
//! Four problems, each an incident of its own ([`Kind`]); when several apply, the target's one
//! health word is the first in this order (the most urgent and most specific first):
//!
//! * **too long**: the live holder acquired the lease more than `--max-duration` ago;
//! * **missed**: the latest slot that is over (the next slot began, plus the grace) has no
//!   completed run in it or in any later slot;
//! * **overdue**: no successful run (exit 0) finished within `--every` plus the grace;
//! * **failing**: the newest run that says how the job fared failed.
//!
//! The SQL that gathers the facts is in [`crate::store::health`].

use std::time::{Duration, SystemTime};

use serde_json::{json, Value};

use crate::fmt::{millis, ms, rfc3339};
pub use crate::model::health::{Holder, Kind, LastRun, Watch, RECOVERED};

/// The grace a late run gets when `--grace` is not given: a tenth of the interval, at most this.
pub const MAX_DEFAULT_GRACE: Duration = Duration::from_secs(3600);

/// How many slots [`Schedule::due_slot`] walks at most (a minutely schedule needs 60).
const MAX_STEPS: usize = 2_000;

/// The schedules of `run --slot` (a stored schedule is one `--slot` accepted).
pub use crate::model::slot::Schedule;

impl Schedule {
    /// The latest slot that is over at `now`: the slot `[start, end)` with the latest end such
    /// that `end + grace(start, end) <= now`, and that grace.
    pub fn due_slot(
        &self,
        now: SystemTime,
        grace: Option<Duration>,
    ) -> Option<(SystemTime, SystemTime, Duration)> {
        let grace_of = |s: SystemTime, e: SystemTime| {
            grace.unwrap_or_else(|| default_grace(e.duration_since(s).unwrap_or_default()))
        };
        let due = |s, e| e_plus(e, grace_of(s, e)).is_some_and(|d| d <= now);
        // Every slot ending at or before `now - upper` is due, whatever its length.
        let upper = grace.unwrap_or(MAX_DEFAULT_GRACE);
        let a = self.at_or_before(now.checked_sub(upper)?)?;
        let mut slot = (self.before(a)?, a);
        for _ in 0..MAX_STEPS {
            let next = (slot.1, self.after(slot.1)?);
            if !due(next.0, next.1) {
                break;
            }
            slot = next;
        }
        Some((slot.0, slot.1, grace_of(slot.0, slot.1)))
    }
}

/// A tenth of `interval`, at most [`MAX_DEFAULT_GRACE`].
pub fn default_grace(interval: Duration) -> Duration {
    (interval / 10).min(MAX_DEFAULT_GRACE)
}

fn e_plus(t: SystemTime, d: Duration) -> Option<SystemTime> {
    t.checked_add(d)
}

impl LastRun {
    pub fn failed(&self) -> bool {
        self.outcome != "completed" || self.exit_code != Some(0)
    }

    fn status(&self) -> String {
        match (self.exit_code, self.signal) {
            (_, Some(sig)) => format!("signal {sig}"),
            (Some(code), None) => format!("exit {code}"),
            (None, None) => "no status".into(),
        }
    }
}

impl Watch {
    /// What watches the target, as `status` names it: `expect` (its `--every` or
    /// `--max-duration`) and `--slot` (the schedule its latest `run --slot` stored).
    pub fn watched_by(&self) -> Vec<&'static str> {
        let mut by = Vec::new();
        if self.every_ms.is_some() || self.max_duration_ms.is_some() {
            by.push("expect");
        }
        if self.schedule.is_some() {
            by.push("--slot");
        }
        by
    }
}

/// One problem of a target: what, since when (database clock), and the facts behind it.
#[derive(Debug, Clone)]
pub struct Problem {
    pub kind: Kind,
    pub since: SystemTime,
    pub detail: Value,
    /// One human line, without the target and the kind.
    pub text: String,
}

/// A watched target's problems, most urgent first, and a schedule it could not read.
#[derive(Debug, Clone)]
pub struct Assessment {
    pub target: String,
    pub problems: Vec<Problem>,
    pub schedule_error: Option<String>,
}

impl Assessment {
    /// The health word: `ok`, or the label of the first problem.
    pub fn health(&self) -> &'static str {
        self.problems.first().map_or("ok", |p| p.kind.label())
    }
}

/// Judges one watched target.
pub fn assess(w: &Watch) -> Assessment {
    let grace = w.grace_ms.map(millis);
    let mut problems = Vec::new();
    let mut schedule_error = None;

    if let (Some(max_ms), Some(h)) = (w.max_duration_ms, &w.holder) {
        let max = millis(max_ms);
        if let Some(limit) = e_plus(h.acquired_at, max).filter(|l| *l < w.now) {
            let who = match (&h.host, h.pid) {
                (Some(host), Some(pid)) => format!("{host} pid {pid}"),
                (Some(host), None) => host.clone(),
                _ => "an unknown holder".into(),
            };
            problems.push(Problem {
                kind: Kind::TooLong,
                since: limit,
                detail: json!({
                    "fence": h.fence,
                    "holder_host": h.host,
                    "holder_pid": h.pid,
                    "acquired_at": rfc3339(h.acquired_at),
                    "max_duration_ms": max_ms,
                }),
                text: format!(
                    "held by {who} (fence {}) since {}, longer than the expected {}",
                    crate::fmt::fence(h.fence),
                    rfc3339(h.acquired_at),
                    crate::fmt::duration(max)
                ),
            });
        }
    }

    if let Some(expr) = &w.schedule {
        match Schedule::new(expr, w.schedule_tz.as_deref()) {
            Err(e) => schedule_error = Some(e),
            Ok(schedule) => {
                if let Some(p) = missed(w, expr, &schedule, grace) {
                    problems.push(p);
                }
            }
        }
    }

    if let Some(every_ms) = w.every_ms {
        let every = millis(every_ms);
        let g = grace.unwrap_or_else(|| default_grace(every));
        let reference = w.last_success_at.unwrap_or(w.updated_at);
        if let Some(due) = e_plus(reference, every)
            .and_then(|t| e_plus(t, g))
            .filter(|d| *d < w.now)
        {
            let last = w
                .last_success_at
                .map_or("no successful run yet".into(), |t| {
                    format!("last successful run finished {}", rfc3339(t))
                });
            problems.push(Problem {
                kind: Kind::Overdue,
                since: due,
                detail: json!({
                    "every_ms": every_ms,
                    "grace_ms": ms(g),
                    "last_success_at": w.last_success_at.map(rfc3339),
                }),
                text: format!(
                    "{last}; expected every {} (grace {})",
                    crate::fmt::duration(every),
                    crate::fmt::duration(g)
                ),
            });
        }
    }

    if let Some(run) = w.last_run.as_ref().filter(|r| r.failed()) {
        problems.push(Problem {
            kind: Kind::Failing,
            since: run.finished_at,
            detail: json!({
                "run_id": run.id.to_string(),
                "outcome": run.outcome,
                "exit_code": run.exit_code,
                "signal": run.signal,
                "finished_at": rfc3339(run.finished_at),
            }),
            text: format!("the last run {}: {}, {}", run.id, run.outcome, run.status()),
        });
    }

    problems.sort_by_key(|p| p.kind);
    Assessment {
        target: w.target.clone(),
        problems,
        schedule_error,
    }
}

/// The latest slot that is over, if nothing completed in it or after it — and if the target
/// was already watched then: a slot that ended before the schedule was stored cannot have been
/// missed.
fn missed(w: &Watch, expr: &str, schedule: &Schedule, grace: Option<Duration>) -> Option<Problem> {
    let (start, end, g) = schedule.due_slot(w.now, grace)?;
    let watched_from = w.schedule_since.unwrap_or(w.updated_at);
    if end <= watched_from || w.done_slot.is_some_and(|d| d >= start) {
        return None;
    }
    let zone = w.schedule_tz.as_deref().unwrap_or("UTC");
    Some(Problem {
        kind: Kind::Missed,
        since: e_plus(end, g)?,
        detail: json!({
            "slot": rfc3339(start),
            "slot_end": rfc3339(end),
            "schedule": expr,
            "schedule_tz": w.schedule_tz,
            "grace_ms": ms(g),
            "last_done_slot": w.done_slot.map(rfc3339),
        }),
        text: format!(
            "no completed run in the slot {} to {} (schedule '{expr}' {zone}, grace {})",
            rfc3339(start),
            rfc3339(end),
            crate::fmt::duration(g)
        ),
    })
}

/// What one [`reconcile`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Reconciled {
    pub opened: usize,
    pub recovered: usize,
}

/// Brings the open incidents in line with the targets' health, on the database clock, in one
/// transaction: opens each new incident with its `leasectl.target.<kind>` event and closes each
/// incident whose condition is gone (or whose target is no longer watched) with a
/// `leasectl.target.recovered` event. Several relays may call it at once: each incident's row
/// is claimed by the very statement that inserts its event, and one transaction-level advisory
/// lock lets one relay evaluate at a time (the others skip the round: `None`).
pub async fn reconcile(
    client: &tokio_postgres::Client,
    schema: &crate::db::Schema,
) -> anyhow::Result<Option<Reconciled>> {
    let result = reconcile_in_transaction(client, schema).await;
    match result {
        Ok(done) => {
            client.batch_execute("COMMIT").await?;
            Ok(done)
        }
        Err(e) => {
            let _ = client.batch_execute("ROLLBACK").await;
            Err(e)
        }
    }
}

async fn reconcile_in_transaction(
    client: &tokio_postgres::Client,
    schema: &crate::db::Schema,
) -> anyhow::Result<Option<Reconciled>> {
    use crate::store::health as store;
    // BEGIN and the lock's statement in one flight. Should BEGIN fail, the statement has run
    // on its own and its lock ended with it: the error is returned and nothing is evaluated.
    let (begun, evaluation) = tokio::join!(
        client.batch_execute("BEGIN"),
        store::try_lock_evaluation(client, schema)
    );
    begun?;
    let evaluation = evaluation?;
    if !evaluation.locked {
        return Ok(None);
    }
    if !evaluation.watched {
        return Ok(Some(Reconciled::default()));
    }
    let open: std::collections::HashSet<(String, Kind)> = store::open_incidents(client, schema)
        .await?
        .into_iter()
        .collect();
    let mut active = std::collections::HashSet::new();
    let mut done = Reconciled::default();
    for watch in store::watched(client, schema, None).await? {
        let assessment = assess(&watch);
        for p in assessment.problems {
            let key = (watch.target.clone(), p.kind);
            if !open.contains(&key) {
                let payload = json!({
                    "target": watch.target,
                    "kind": p.kind.as_str(),
                    "since": rfc3339(p.since),
                    "detail": p.detail,
                });
                if store::open_incident(
                    client,
                    schema,
                    &watch.target,
                    p.kind,
                    p.since,
                    &p.detail,
                    &payload,
                )
                .await?
                {
                    done.opened += 1;
                    crate::info!("{}: {} ({})", watch.target, p.kind.label(), p.text);
                }
            }
            active.insert(key);
        }
    }
    for (target, kind) in open.difference(&active) {
        if store::close_incident(client, schema, target, *kind).await? {
            done.recovered += 1;
            crate::info!("{target}: recovered from {}", kind.label());
        }
    }
    Ok(Some(done))
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    fn t(s: &str) -> SystemTime {
        humantime::parse_rfc3339(s).unwrap()
    }

    fn watch(now: &str) -> Watch {
        Watch {
            target: "nightly".into(),
            now: t(now),
            schedule: None,
            schedule_tz: None,
            every_ms: None,
            grace_ms: None,
            max_duration_ms: None,
            updated_at: t("2026-01-01T00:00:00Z"),
            schedule_since: None,
            done_slot: None,
            last_success_at: None,
            last_run: None,
            holder: None,
        }
    }

    #[test]
    fn schedules_accept_five_fields_and_nicknames_only() {
        assert!(Schedule::new("0 2 * * *", None).is_ok());
        assert!(Schedule::new("@hourly", None).is_ok());
        assert!(Schedule::new("@daily", Some("Europe/Berlin")).is_ok());
        assert!(Schedule::new("0 0 2 * * *", None).is_err());
        assert!(Schedule::new("nonsense", None).is_err());
        assert!(Schedule::new("0 2 * * *", Some("Mars/Olympus")).is_err());
    }

    #[test]
    fn the_due_slot_is_the_latest_one_over_plus_its_grace() {
        let daily = Schedule::new("0 2 * * *", None).unwrap();
        // 2026-03-10 02:30: yesterday's slot ends at 02:00 today, grace 1h: not over yet.
        let (s, e, g) = daily.due_slot(t("2026-03-10T02:30:00Z"), None).unwrap();
        assert_eq!(
            (s, e),
            (t("2026-03-08T02:00:00Z"), t("2026-03-09T02:00:00Z"))
        );
        assert_eq!(g, MAX_DEFAULT_GRACE);
        let (s, _, _) = daily.due_slot(t("2026-03-10T03:00:00Z"), None).unwrap();
        assert_eq!(s, t("2026-03-09T02:00:00Z"));
        // Minutely: grace 6s.
        let minutely = Schedule::new("* * * * *", None).unwrap();
        let (s, e, g) = minutely.due_slot(t("2026-03-10T12:00:05Z"), None).unwrap();
        assert_eq!(
            (s, e),
            (t("2026-03-10T11:58:00Z"), t("2026-03-10T11:59:00Z"))
        );
        assert_eq!(g, Duration::from_secs(6));
        let (s, _, _) = minutely.due_slot(t("2026-03-10T12:00:06Z"), None).unwrap();
        assert_eq!(s, t("2026-03-10T11:59:00Z"));
        // An explicit grace.
        let (s, _, g) = minutely
            .due_slot(t("2026-03-10T12:00:00Z"), Some(Duration::from_secs(150)))
            .unwrap();
        assert_eq!(s, t("2026-03-10T11:56:00Z"));
        assert_eq!(g, Duration::from_secs(150));
    }

    #[test]
    fn a_zone_moves_the_slots() {
        let berlin = Schedule::new("0 2 * * *", Some("Europe/Berlin")).unwrap();
        assert_eq!(
            berlin.at_or_before(t("2026-01-10T12:00:00Z")),
            Some(t("2026-01-10T01:00:00Z"))
        );
    }

    #[test]
    fn missed_needs_a_done_run_in_or_after_the_due_slot() {
        let mut w = watch("2026-03-10T12:00:30Z");
        w.schedule = Some("* * * * *".into());
        let a = assess(&w);
        assert_eq!(a.health(), "missed");
        assert_eq!(a.problems[0].since, t("2026-03-10T12:00:06Z"));
        w.done_slot = Some(t("2026-03-10T11:59:00Z"));
        assert_eq!(assess(&w).health(), "ok");
        w.done_slot = Some(t("2026-03-10T12:00:00Z"));
        assert_eq!(assess(&w).health(), "ok", "a later slot done counts");
        w.done_slot = Some(t("2026-03-10T11:58:00Z"));
        assert_eq!(assess(&w).health(), "missed");
        // Not yet watched when the slot ended.
        w.updated_at = t("2026-03-10T12:00:00Z");
        assert_eq!(assess(&w).health(), "ok");
        // The schedule's own start decides, not the row's last change (an `expect` later on).
        w.schedule_since = Some(t("2026-03-10T11:00:00Z"));
        assert_eq!(assess(&w).health(), "missed");
        // A schedule stored again (after `expect --clear`) after the slot ended.
        w.schedule_since = Some(t("2026-03-10T12:00:10Z"));
        assert_eq!(assess(&w).health(), "ok");
    }

    #[test]
    fn a_watch_says_what_set_it() {
        let mut w = watch("2026-03-10T12:00:00Z");
        assert!(w.watched_by().is_empty());
        w.grace_ms = Some(60_000);
        assert!(w.watched_by().is_empty(), "a grace alone watches nothing");
        w.schedule = Some("0 2 * * *".into());
        assert_eq!(w.watched_by(), ["--slot"]);
        w.max_duration_ms = Some(60_000);
        assert_eq!(w.watched_by(), ["expect", "--slot"]);
        w.schedule = None;
        assert_eq!(w.watched_by(), ["expect"]);
    }

    #[test]
    fn overdue_counts_from_the_last_success_plus_grace() {
        let mut w = watch("2026-03-10T12:00:00Z");
        w.every_ms = Some(3_600_000);
        w.last_success_at = Some(t("2026-03-10T10:54:00Z"));
        assert_eq!(assess(&w).health(), "ok", "due at 12:00, not past it");
        w.last_success_at = Some(t("2026-03-10T10:53:59Z"));
        assert_eq!(assess(&w).health(), "overdue");
        w.grace_ms = Some(0);
        w.last_success_at = Some(t("2026-03-10T10:59:59Z"));
        assert_eq!(assess(&w).health(), "overdue");
    }

    #[test]
    fn failing_and_too_long_and_their_order() {
        let mut w = watch("2026-03-10T12:00:00Z");
        w.max_duration_ms = Some(60_000);
        w.last_run = Some(LastRun {
            id: Uuid::nil(),
            outcome: "completed".into(),
            exit_code: Some(3),
            signal: None,
            finished_at: t("2026-03-10T11:00:00Z"),
        });
        assert_eq!(assess(&w).health(), "failing");
        w.holder = Some(Holder {
            host: Some("web-1".into()),
            pid: Some(7),
            fence: 4,
            acquired_at: t("2026-03-10T11:58:00Z"),
        });
        let a = assess(&w);
        assert_eq!(a.health(), "too long");
        assert_eq!(a.problems.len(), 2);
        assert_eq!(a.problems[0].since, t("2026-03-10T11:59:00Z"));
        w.last_run.as_mut().unwrap().exit_code = Some(0);
        w.holder.as_mut().unwrap().acquired_at = t("2026-03-10T11:59:30Z");
        assert_eq!(assess(&w).health(), "ok");
    }

    #[test]
    fn absurd_stored_values_never_panic() {
        let mut w = watch("2026-03-10T12:00:00Z");
        w.every_ms = Some(i64::MAX);
        w.grace_ms = Some(i64::MAX);
        w.max_duration_ms = Some(i64::MAX);
        w.schedule = Some("0 0 29 2 *".into());
        w.holder = Some(Holder {
            host: None,
            pid: None,
            fence: 1,
            acquired_at: t("2026-03-10T11:00:00Z"),
        });
        assert_eq!(assess(&w).health(), "ok");
    }
}
