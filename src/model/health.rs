//! The facts the dead-man switch judges, as the store reads them, and the incident kinds it
//! names: plain data, no rule (the rules are in `crate::health`).

use std::time::SystemTime;

use uuid::Uuid;

/// One kind of incident, as stored in `incidents.kind` and named in event types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    TooLong,
    Missed,
    Overdue,
    Failing,
}

impl Kind {
    /// In `incidents.kind` and the event type `leasectl.target.<kind>`.
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::TooLong => "too_long",
            Kind::Missed => "missed",
            Kind::Overdue => "overdue",
            Kind::Failing => "failing",
        }
    }

    /// The health word `status` and `check` show.
    pub fn label(self) -> &'static str {
        match self {
            Kind::TooLong => "too long",
            other => other.as_str(),
        }
    }

    pub fn parse(s: &str) -> Option<Kind> {
        [Kind::TooLong, Kind::Missed, Kind::Overdue, Kind::Failing]
            .into_iter()
            .find(|k| k.as_str() == s)
    }

    pub fn event_type(self) -> String {
        format!("leasectl.target.{}", self.as_str())
    }
}

/// The event type announcing that an incident ended.
pub const RECOVERED: &str = "leasectl.target.recovered";

/// The newest run that says how the job fared (neither `skipped` nor `lost`).
#[derive(Debug, Clone)]
pub struct LastRun {
    pub id: Uuid,
    pub outcome: String,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub finished_at: SystemTime,
}

/// The live holder of a watched target.
#[derive(Debug, Clone)]
pub struct Holder {
    pub host: Option<String>,
    pub pid: Option<i32>,
    pub fence: i64,
    pub acquired_at: SystemTime,
}

/// What the database knows about one watched target, read at `now` (its clock).
#[derive(Debug, Clone)]
pub struct Watch {
    pub target: String,
    pub now: SystemTime,
    pub schedule: Option<String>,
    pub schedule_tz: Option<String>,
    pub every_ms: Option<i64>,
    pub grace_ms: Option<i64>,
    pub max_duration_ms: Option<i64>,
    /// When the expectation row was last written.
    pub updated_at: SystemTime,
    /// Since when the schedule watches the target: when a `run --slot` stored it (first, changed,
    /// or again after `expect --clear`). `None` only for a row written by hand.
    pub schedule_since: Option<SystemTime>,
    /// The latest slot with a completed (or timed-out) run, or a skip recorded after the slot's
    /// run had done it (such a skip outlives that run when `prune` removed it). A skip recorded
    /// while the slot's run was still running does not count: that run counts for itself once
    /// stored, and if it never is (its holder was killed), the slot was not done.
    pub done_slot: Option<SystemTime>,
    /// When the newest successful run (completed, exit 0) finished.
    pub last_success_at: Option<SystemTime>,
    pub last_run: Option<LastRun>,
    pub holder: Option<Holder>,
}
