//! `leasectl release --target T --force`: break a lease (operator use) — every place of a
//! target with `--max-holders`.
//!
//! The release is announced on the lease channel, so a holder that listens (see
//! `run::heartbeat`) checks its token at once, stops its command and records a `lost` run; one
//! behind a transaction-mode pooler notices at its next heartbeat. Then, unless `--no-wait`,
//! this waits until that `lost` run is recorded — the old command has stopped — or until the
//! old lease would have expired anyway, and says which: only then is it certain that the next
//! holder cannot overlap with the old one. The fence stays in the row, so the next acquisition
//! is still numbered higher.

use std::time::Duration;

use anyhow::Result;
use tokio::time::{sleep, Instant};

use crate::cli::{DbArgs, ReleaseArgs};
use crate::exit::Exit;
use crate::store::{leases, runs};

/// How often to look for the old holder's record while waiting.
const POLL: Duration = Duration::from_millis(100);

pub async fn run(db: &DbArgs, args: ReleaseArgs) -> Result<Exit> {
    let db = super::connect(db).await?;
    let started = Instant::now();
    let holders = leases::force_release(&db.client, &db.schema, &args.target).await?;
    if holders.is_empty() {
        super::print(format!("'{}' was not held\n", args.target).as_bytes())?;
        return Ok(Exit::Code(0));
    }
    // With --max-holders, every place is released: one line per holder.
    for h in &holders {
        let released = format!("released '{}' ({})", args.target, h.describe());
        if args.no_wait {
            super::print(format!("{released}; not waiting for the holder to stop\n").as_bytes())?;
            continue;
        }
        let outcome = wait_for_stop(&db, &args.target, h, started).await?;
        super::print(format!("{released}; {outcome}\n").as_bytes())?;
    }
    Ok(Exit::Code(0))
}

/// Waits until the released holder `h` has recorded its stop, or its lease would have expired
/// anyway, and says which.
async fn wait_for_stop(
    db: &crate::db::Db,
    target: &str,
    h: &leases::Holder,
    started: Instant,
) -> Result<String> {
    // The old holder cannot run past its TTL after its last heartbeat; measured from before
    // the release was sent, so never later than on the database's clock.
    let expires_at = crate::config::deadline(started, h.expires_in);
    super::extend_deadline(h.expires_in);
    loop {
        if let Some((run, _)) = runs::run_by_fence(&db.client, &db.schema, target, h.fence).await? {
            return Ok(format!(
                "the holder stopped and recorded run {} as {} after {}",
                run.id,
                run.outcome.as_str(),
                crate::fmt::duration(started.elapsed())
            ));
        }
        let now = Instant::now();
        if now >= expires_at {
            return Ok(format!(
                "the holder recorded no stop, but its lease has expired by now (ttl {})",
                crate::fmt::duration(h.ttl)
            ));
        }
        sleep(POLL.min(expires_at - now)).await;
    }
}
