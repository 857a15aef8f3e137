//! Storing the run: the fenced save (retried across connection failures while the lease could
//! still be ours) and what it prints; a lost lease's `lost` record instead.

use std::time::Duration;

use anyhow::Result;
use tokio::time::{sleep, timeout, Instant};

use super::{bounded, is_unavailable, release_within, STATEMENT_DEADLINE};
use crate::config::RunConfig;
use crate::db::Db;
use crate::exit::{ChildStatus, Exit};
use crate::model::time::deadline;
use crate::store::leases::Lease;
use crate::store::runs::{self, Outcome, RunRecord, Saved};

/// The fenced save, retried across connection failures for as long as the lease could still
/// be ours. A retry first looks for the run id, in case a lost connection hid a commit. Each
/// attempt has a client-side deadline; when time runs out, leasectl says so and exits 69.
pub(super) async fn store(
    db: &mut Db,
    cfg: &RunConfig,
    lease: &Lease,
    record: &RunRecord<'_>,
    exit: Exit,
    planned: Option<&runs::Planned>,
) -> Result<Exit> {
    let give_up_at = deadline(Instant::now(), cfg.ttl.max(Duration::from_secs(10)));
    let mut delay = Duration::from_millis(100);
    let mut attempt = 0;
    loop {
        let event_type = cfg.event_type.as_deref();
        // At most half the time left, so that a connection stuck behind an unanswered
        // statement leaves time for a retry on a fresh one.
        let left = give_up_at.saturating_duration_since(Instant::now());
        let until = Instant::now() + STATEMENT_DEADLINE.min(left / 2);
        let result = bounded(
            until,
            runs::save_fenced(
                &db.client,
                &db.schema,
                lease,
                record,
                event_type,
                attempt > 0,
                planned,
            ),
        )
        .await;
        attempt += 1;
        match result {
            Ok(Saved::Stored) => {
                info!(
                    "stored run {} of '{}' ({})",
                    record.id,
                    lease.target,
                    record.outcome.as_str()
                );
                return Ok(exit);
            }
            Ok(Saved::NotOwner) => {
                let reason =
                    "the lease was taken over before the result could be stored".to_owned();
                warn!("{reason}");
                let lost = RunRecord {
                    outcome: Outcome::Lost,
                    error: Some(reason),
                    ..clone_record(record)
                };
                return record_lost(db, cfg, lease, &lost, None).await;
            }
            Err(e) if Instant::now() < give_up_at && is_unavailable(&e) => {
                warn!("cannot store run {} yet ({:#}); retrying", record.id, e);
                sleep(delay.min(give_up_at.saturating_duration_since(Instant::now()))).await;
                delay = (delay * 2).min(Duration::from_secs(2));
                let left = give_up_at.saturating_duration_since(Instant::now());
                let _ = timeout(left.max(Duration::from_millis(100)), db.reconnect()).await;
            }
            Err(e) => {
                return Err(e.context(format!(
                    "the command finished ({}) but its run {} could not be stored",
                    describe_status(record),
                    record.id
                )));
            }
        }
    }
}

fn clone_record<'a>(r: &RunRecord<'a>) -> RunRecord<'a> {
    RunRecord {
        argv: r.argv.clone(),
        error: r.error.clone(),
        ..*r
    }
}

fn describe_status(r: &RunRecord<'_>) -> String {
    match (r.status, r.exit_code_override) {
        (Some(ChildStatus::Exited(c)), _) => format!("exit code {c}"),
        (Some(ChildStatus::Signaled(s)), _) => format!("killed by signal {s}"),
        (None, Some(c)) => format!("exec failed, {c}"),
        (None, None) => "unknown status".into(),
    }
}

/// How long after its lease's deadline a holder that lost its lease while its command ran exits
/// at the latest: the time its best-effort `lost` record and release may still take. The promise is an exit
/// within the TTL plus 1.5 s of the database going silent, on a fresh connection or an
/// established one alike; this leaves half a second for the rest of the exit.
pub(super) const SILENT_EXIT_AFTER: Duration = Duration::from_secs(1);

/// How long the best-effort bookkeeping after a lost lease (the `lost` record, the release)
/// may take in all: the command is already stopped, and the exit code must not wait on a
/// database that stopped answering. The TTL, within 1s..5s: a short lease is a request for
/// quick answers.
fn lost_record_deadline(ttl: Duration) -> Duration {
    ttl.clamp(Duration::from_secs(1), Duration::from_secs(5))
}

/// Keeps the `lost` record of a run (no event), releases the lease if it is somehow still
/// ours, and exits 76. All of it best-effort within [`lost_record_deadline`] — and by `exit_by`
/// (but at least half a second): the command is already stopped, and a silent database must not
/// hold up the exit.
pub(super) async fn record_lost(
    db: &mut Db,
    cfg: &RunConfig,
    lease: &Lease,
    record: &RunRecord<'_>,
    exit_by: Option<Instant>,
) -> Result<Exit> {
    let now = Instant::now();
    let mut until = now + lost_record_deadline(cfg.ttl);
    if let Some(by) = exit_by {
        until = until.min(by.max(now + Duration::from_millis(500)));
    }
    let limit = until - now;
    // The connection may be stuck behind the heartbeat that went unanswered: half the time
    // for it, the other half for a fresh one.
    let first = Instant::now() + limit / 2;
    let mut stored = bounded(
        first,
        runs::record_lost(&db.client, &db.schema, lease, record),
    )
    .await;
    if stored.is_err()
        && matches!(
            tokio::time::timeout_at(until, db.reconnect()).await,
            Ok(Ok(()))
        )
    {
        stored = bounded(
            until,
            runs::record_lost(&db.client, &db.schema, lease, record),
        )
        .await;
    }
    match stored {
        Ok(runs::Lost::Lost) => say!(
            "lease on '{}' lost; no result stored (output kept as lost run {})",
            lease.target,
            record.id
        ),
        Ok(runs::Lost::Preempted { fence, by }) => say!(
            "lease on '{}' taken by --replace of {by} (fence {}); no result stored (output kept as preempted run {})",
            lease.target,
            crate::fmt::fence(fence),
            record.id
        ),
        Err(e) => warn!(
            "lease on '{}' lost, and the lost run could not be recorded: {e:#}",
            lease.target
        ),
    }
    if Instant::now() >= until {
        // The deadline went to a database that did not answer: a release would only wait for
        // it too (release_within grants at least 500 ms), past the bound promised above.
        info!(
            "not releasing '{}' (the database did not answer in time); it expires with its TTL",
            lease.target
        );
    } else {
        release_within(db, lease, until).await;
    }
    Ok(Exit::LeaseLost)
}
