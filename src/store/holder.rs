//! Who holds a lease, as the database sees it: the row shape the lease and queue statements
//! share, and how messages name a holder.

use std::time::Duration;

use tokio_postgres::Row;

/// Who holds a busy target, as the database sees it now.
#[derive(Debug, Clone)]
pub struct Holder {
    pub host: Option<String>,
    pub pid: Option<i32>,
    pub label: Option<String>,
    /// How long it has held the lease.
    pub running: Duration,
    pub fence: i64,
    pub ttl: Duration,
    pub heartbeat_age: Duration,
    /// Time left until the holder's TTL runs out (zero if already expired).
    pub expires_in: Duration,
}

/// `ci-7 pid 4411 [label]`: a holder as messages name it.
pub fn who(host: Option<String>, pid: Option<i32>, label: Option<String>) -> String {
    let mut who = match (host, pid) {
        (Some(h), Some(p)) => format!("{h} pid {p}"),
        (Some(h), None) => h,
        _ => "an unknown holder".into(),
    };
    if let Some(l) = label {
        who.push_str(&format!(" [{l}]"));
    }
    who
}

impl Holder {
    /// `ci-7 pid 4411 [label]`.
    pub fn who(&self) -> String {
        who(self.host.clone(), self.pid, self.label.clone())
    }

    pub fn describe(&self) -> String {
        let who = self.who();
        format!(
            "held by {who} (fence {}), last heartbeat {} ago, ttl {}",
            crate::fmt::fence(self.fence),
            crate::fmt::duration(self.heartbeat_age),
            crate::fmt::duration(self.ttl)
        )
    }
}

/// A holder from a row with the columns holder_host, holder_pid, holder_label, fence, ttl_ms,
/// age_ms and running_ms.
pub(super) fn holder_from_row(r: &Row) -> Holder {
    let ttl_ms: i64 = r.get("ttl_ms");
    let age_ms: i64 = r.get("age_ms");
    Holder {
        host: r.get("holder_host"),
        pid: r.get("holder_pid"),
        label: r.get("holder_label"),
        running: crate::fmt::millis(r.get("running_ms")),
        fence: r.get("fence"),
        ttl: crate::fmt::millis(ttl_ms),
        heartbeat_age: crate::fmt::millis(age_ms),
        expires_in: crate::fmt::millis(ttl_ms - age_ms),
    }
}
