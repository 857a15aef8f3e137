//! What holds the relay back, and its warnings: with `--order commit`, committed events waiting
//! behind a transaction still open (the commit-order horizon); and a snapshot holding back the
//! xmin horizon while the relay deletes events, so VACUUM cannot remove them.

use std::time::Duration;

use tokio::time::Instant;

use super::liveness::{best_effort, Lost};
use super::Relay;
use crate::db::Db;
use crate::fmt;
use crate::model::order::Order;
use crate::store::outbox::{self, Holder};

/// With `--order commit`, how often at most a relay whose claims come back short looks whether
/// committed events wait behind an open transaction, and how soon it claims again while they
/// do (the transaction may end without a NOTIFY: it need not have inserted any event).
pub(super) const HELD_EVERY: Duration = Duration::from_millis(100);

/// A warning about what holds the relay back is repeated at most this often.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// A backend for a warning: `backend 1234 (application "psql", idle in transaction, transaction
/// open 5m 3s)`.
pub fn describe(h: &Holder) -> String {
    let mut parts = Vec::new();
    if let Some(app) = h.application_name.as_deref().filter(|a| !a.is_empty()) {
        parts.push(format!("application \"{}\"", fmt::one_line(app, 60)));
    }
    if let Some(state) = &h.state {
        parts.push(state.clone());
    }
    if let Some(ms) = h.xact_ms {
        parts.push(format!(
            "transaction open {}",
            fmt::duration(Duration::from_millis(u64::try_from(ms).unwrap_or(0)))
        ));
    }
    let who = match (&h.pid, &h.gid) {
        (Some(pid), _) => format!("backend pid {pid}"),
        (None, Some(gid)) => format!("prepared transaction \"{}\"", fmt::one_line(gid, 60)),
        (None, None) => "a backend of another role".to_owned(),
    };
    if parts.is_empty() {
        who
    } else {
        format!("{who} ({})", parts.join(", "))
    }
}

impl Relay {
    /// `--order commit`: notes whether committed events wait behind a transaction still in
    /// progress, and warns — naming its backend — when the same one has held them back for
    /// longer than `--poll` × 10: once for each such transaction, repeated at most once per
    /// [`WARN_EVERY`] while it lasts. Looks at most once per [`HELD_EVERY`], after a short claim
    /// (a full one is not held back). Best effort.
    pub(super) async fn watch_commit_horizon(&mut self, db: &Db) -> Result<(), Lost> {
        if self.cfg.order != Order::Commit
            || (!self.cfg.once && self.held_at.is_some_and(|t| t.elapsed() < HELD_EVERY))
        {
            return Ok(());
        }
        let d = self.cfg.statement_deadline;
        self.held_at = Some(Instant::now());
        let horizon = outbox::commit_horizon(&db.client, &db.schema);
        let Some(h) = best_effort(d, "the look at the commit horizon", horizon).await? else {
            return Ok(());
        };
        if !h.held {
            self.held = None;
            return Ok(());
        }
        let since = match self.held {
            Some((xmin, since)) if xmin == h.xmin => since,
            _ => {
                self.held = Some((h.xmin, Instant::now()));
                return Ok(());
            }
        };
        let waited = since.elapsed();
        if waited < self.cfg.poll.saturating_mul(10)
            || self
                .held_warned
                .is_some_and(|(xmin, t)| xmin == h.xmin && t.elapsed() < WARN_EVERY)
        {
            return Ok(());
        }
        self.held_warned = Some((h.xmin, Instant::now()));
        let holder = outbox::xid_holder(&db.client, h.xmin);
        let who = match best_effort(d, "the look at pg_stat_activity", holder).await? {
            Some(Some(holder)) => describe(&holder),
            // Ended meanwhile, or in no view this role may read.
            _ => "no backend in pg_stat_activity has it (ended meanwhile?)".to_owned(),
        };
        warn!(
            "--order commit: events have waited {} for transaction {} to end: {who}; events committed after it began are published once it commits or rolls back",
            fmt::duration(waited),
            h.xmin
        );
        Ok(())
    }

    /// Warns, naming the backend, when a transaction open longer than `--poll` × 10 holds back
    /// the xmin horizon while this relay deletes events: VACUUM cannot remove the deleted rows,
    /// and every claim wades through them. Looks at most once per `--poll` × 10
    /// (capped at a minute), only after deleting events, and warns once per backend. Best
    /// effort.
    pub(super) async fn watch_xmin_horizon(&mut self, db: &Db) -> Result<(), Lost> {
        let every = self.cfg.poll.saturating_mul(10).min(WARN_EVERY);
        if self.horizon_at.is_some_and(|t| t.elapsed() < every) {
            return Ok(());
        }
        self.horizon_at = Some(Instant::now());
        let deleted = std::mem::take(&mut self.deleted_since_horizon);
        if deleted == 0 {
            return Ok(());
        }
        let min_ms = fmt::ms(self.cfg.poll.saturating_mul(10));
        let look = outbox::horizon_holders(&db.client, min_ms);
        let d = self.cfg.statement_deadline;
        let Some(holders) = best_effort(d, "the look at pg_stat_activity", look).await? else {
            return Ok(());
        };
        for holder in holders {
            // Once per backend (a pid is reused only after that backend ended).
            if self.horizon_warned.contains(&holder.pid) {
                continue;
            }
            if self.horizon_warned.len() >= 1000 {
                self.horizon_warned.clear();
            }
            self.horizon_warned.push(holder.pid);
            warn!(
                "a snapshot {} transactions old holds back the xmin horizon: {}; VACUUM cannot remove the {deleted} events this relay deleted meanwhile, and claims slow down until it ends",
                holder.xmin_age.unwrap_or(0),
                describe(&holder)
            );
        }
        Ok(())
    }
}
