//! `--replace`: after taking the lease from a live holder ([`leases::replace`]), do not start
//! until that holder has recorded its stop — or its lease would have expired anyway, which bounds
//! how long it could still run. Two copies of the command never overlap, which is what
//! cancel-in-progress elsewhere (Kubernetes `Replace`, killing the old CI job) cannot promise.
//!
//! Meanwhile the new lease is renewed: the old holder's TTL may be far longer than ours.

use std::time::Duration;

use tokio::time::{sleep, Instant};

use super::heartbeat::Heartbeat;
use super::{bounded, release_within, STATEMENT_DEADLINE};
use crate::config::{deadline, RunConfig};
use crate::db::Db;
use crate::exit::Exit;
use crate::signals::Signals;
use crate::store::leases::Lease;
use crate::store::runs;

/// How often to look for the old holder's record.
const POLL: Duration = Duration::from_millis(100);

/// Waits for the holder `lease` replaced, if any (`sent`: when the statement that took it was
/// sent), renewing `lease` meanwhile. `Some(exit)` when
/// the wait ended without a go: our own lease was lost, or a signal arrived (the lease is then
/// released).
pub(super) async fn await_stop(
    db: &mut Db,
    cfg: &RunConfig,
    (lease, sent): (&Lease, Instant),
    hb: &mut Heartbeat<'_>,
    signals: &mut Signals,
) -> Option<Exit> {
    let r = lease.replaced.as_ref()?;
    if r.idle {
        info!(
            "replaced {} (fence {}) on '{}', which ran no command",
            r.who, r.fence, cfg.target
        );
        return None;
    }
    if !cfg.quiet {
        say!(
            "replacing {} (fence {}) on '{}'; waiting for it to stop",
            r.who,
            r.fence,
            cfg.target
        );
    }
    let started = Instant::now();
    // Counted from the acquisition's send, before the database's `now()`: never late.
    let expires_at = deadline(sent, r.expires_in);
    loop {
        let until = (Instant::now() + STATEMENT_DEADLINE).min(hb.stop_at());
        let look = runs::stop_recorded(&db.client, &db.schema, &cfg.target, r.fence);
        match bounded(until, look).await {
            Ok(Some((id, outcome))) => {
                info!(
                    "{} stopped after {} (run {id}, {})",
                    r.who,
                    crate::fmt::duration(started.elapsed()),
                    outcome.as_str()
                );
                return None;
            }
            Ok(None) => {}
            Err(e) => info!("cannot look for the replaced holder's run yet ({e:#})"),
        }
        let now = Instant::now();
        if now >= expires_at {
            info!(
                "{} recorded no stop, but its lease has expired by now",
                r.who
            );
            return None;
        }
        tokio::select! {
            _ = sleep(POLL.min(expires_at - now)) => {}
            reason = hb.keep(db) => {
                say!("{reason} while waiting for {} to stop; the command was not started", r.who);
                return Some(Exit::LeaseLost);
            }
            sig = signals.recv() => {
                release_within(db, lease, Instant::now() + STATEMENT_DEADLINE).await;
                return Some(Exit::from_signal(sig));
            }
        }
    }
}
