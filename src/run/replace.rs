//! Waiting for a previous holder to stop before starting: after a `--replace` took the lease from
//! a live holder ([`leases::replace`]), or took a place whose last holder is still stopping its
//! command (a forced release, an earlier replacement), the command starts only once that holder
//! has recorded its stop — or its own deadline has passed, which bounds how long it could still
//! run. The fact lives on the lease row ([`leases::gate`]), not in this process: if this caller
//! dies, pauses or is replaced in turn, whoever comes next waits for the same stop. Two copies
//! of the command never overlap, which is what cancel-in-progress elsewhere (Kubernetes
//! `Replace`, killing the old CI job) cannot promise.
//!
//! Meanwhile the new lease is renewed: the old holder's TTL may be far longer than ours.

use std::time::Duration;

use tokio::time::{sleep, Instant};

use super::heartbeat::Heartbeat;
use super::{bounded, release_within, STATEMENT_DEADLINE};
use crate::config::RunConfig;
use crate::db::Db;
use crate::exit::Exit;
use crate::signals::Signals;
use crate::store::leases::{self, Gate, Lease};

/// How often to look whether the old holder has stopped.
const POLL: Duration = Duration::from_millis(100);

/// Waits until no previous holder of `lease`'s place is stopping any more, renewing `lease`
/// meanwhile, and marks it busy (`busy`; `acquire` keeps it idle). `Some(exit)` when the wait
/// ended without a go: our own lease was lost, or a signal arrived (the lease is then released).
pub(super) async fn await_stop(
    db: &mut Db,
    cfg: &RunConfig,
    lease: &Lease,
    busy: bool,
    hb: &mut Heartbeat<'_>,
    signals: &mut Signals,
) -> Option<Exit> {
    if let Some(r) = lease.replaced.as_ref().filter(|r| r.idle) {
        info!(
            "replaced {} (fence {}) on '{}', which ran no command",
            r.who,
            crate::fmt::fence(r.fence),
            cfg.target
        );
    }
    if !lease.wait_for_stop {
        return None;
    }
    let started = Instant::now();
    let mut announced = false;
    // When the previous holder's deadline passes, as last seen: a go after it is that deadline,
    // not a recorded stop.
    let mut deadline_at = started;
    loop {
        let until = (Instant::now() + STATEMENT_DEADLINE).min(hb.stop_at());
        let left = match bounded(until, leases::gate(&db.client, &db.schema, lease, busy)).await {
            Ok(Gate::Go) => {
                if announced && Instant::now() + Duration::from_millis(20) >= deadline_at {
                    info!(
                        "the previous holder of '{}' recorded no stop, but its lease has expired by now",
                        cfg.target
                    );
                } else if announced {
                    info!(
                        "the previous holder of '{}' stopped after {}",
                        cfg.target,
                        crate::fmt::duration(started.elapsed())
                    );
                }
                return None;
            }
            Ok(Gate::Lost) => {
                say!(
                    "the lease on '{}' was lost while waiting for its previous holder to stop; the command was not started",
                    cfg.target
                );
                return Some(Exit::LeaseLost);
            }
            Ok(Gate::Wait { who, fence, left }) => {
                if !announced && !cfg.quiet {
                    let shown = crate::fmt::fence(fence);
                    let whom = match &lease.replaced {
                        Some(r) if !r.idle && r.fence == fence => {
                            format!("replacing {} (fence {shown})", r.who)
                        }
                        _ => format!("the previous holder {who} (fence {shown}) is stopping"),
                    };
                    say!(
                        "{whom} on '{}'; waiting for it to stop (at most {})",
                        cfg.target,
                        crate::fmt::duration(left)
                    );
                }
                announced = true;
                deadline_at = Instant::now() + left;
                left
            }
            Err(e) => {
                info!("cannot look whether the previous holder has stopped yet ({e:#})");
                POLL
            }
        };
        tokio::select! {
            _ = sleep(POLL.min(left + Duration::from_millis(5))) => {}
            reason = hb.keep(db) => {
                say!("{reason} while waiting for the previous holder to stop; the command was not started");
                return Some(Exit::LeaseLost);
            }
            sig = signals.recv() => {
                release_within(db, lease, Instant::now() + STATEMENT_DEADLINE).await;
                return Some(Exit::from_signal(sig));
            }
        }
    }
}
