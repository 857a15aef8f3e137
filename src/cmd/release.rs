//! `leasectl release`: end a lease.
//!
//! * `--token TOK` ends the lease that `acquire` took (the last step of a lease across CI
//!   steps): 0 when released, 76 when the token no longer holds the target — it expired and was
//!   taken, or was replaced — so the pipeline learns that its steps were not all under one lease.
//!   A step still running under it is stopped like a `--force`d holder, and waited for.
//! * `--force` breaks the lease whoever holds it (operator use) — every place of a target with
//!   `--max-holders`. The release is announced on the lease channel, so a holder that listens
//!   (see `run::heartbeat`) checks its token at once, stops its command and records a `lost` run;
//!   one behind a transaction-mode pooler notices at its next heartbeat. Then, unless
//!   `--no-wait`, this waits until that run is recorded — the old command has stopped — or until
//!   the old lease would have expired anyway, and says which: only then is it certain that the
//!   next holder cannot overlap with the old one. An idle holder (an `acquire`d lease between
//!   steps) runs nothing: no wait. The fence stays in the row, so the next acquisition is still
//!   numbered higher.

use std::time::Duration;

use anyhow::Result;
use tokio::time::{sleep, Instant};
use uuid::Uuid;

use crate::cli::{DbArgs, ReleaseArgs};
use crate::db::Db;
use crate::exit::Exit;
use crate::store::holder::Holder;
use crate::store::{leases, runs};

/// How often to look for the old holder's record while waiting.
const POLL: Duration = Duration::from_millis(100);

pub async fn run(db: &DbArgs, args: ReleaseArgs) -> Result<Exit> {
    let db = super::connect(db).await?;
    match args.token {
        Some(token) => release_token(&db, &args, token).await,
        None => release_force(&db, &args).await,
    }
}

async fn release_token(db: &Db, args: &ReleaseArgs, token: Uuid) -> Result<Exit> {
    let target = args.target.as_str();
    let started = Instant::now();
    match leases::release_token(&db.client, &db.schema, target, token).await? {
        Some(released) => {
            if released.expired {
                crate::warn!("the lease on '{target}' had expired (nobody took it); released");
            } else {
                crate::info!("released '{target}'");
            }
            // A step was running under the lease: nobody may take it before that step has
            // stopped, and the pipeline may want to know when it has.
            if let Some(h) = released.stopping {
                let outcome = if args.no_wait {
                    "not waiting for it to stop".to_owned()
                } else {
                    wait_for_stop(db, target, &h, started).await?
                };
                let line = format!(
                    "released '{target}' while a step ran ({}); {outcome}\n",
                    h.who()
                );
                super::print(line.as_bytes())?;
            }
            Ok(Exit::Code(0))
        }
        None => {
            crate::say!(
                "{}",
                leases::why_not_held(&db.client, &db.schema, target, token).await?
            );
            Ok(Exit::LeaseLost)
        }
    }
}

async fn release_force(db: &Db, args: &ReleaseArgs) -> Result<Exit> {
    let started = Instant::now();
    let holders = leases::force_release(&db.client, &db.schema, &args.target).await?;
    if holders.is_empty() {
        super::print(format!("'{}' was not held\n", args.target).as_bytes())?;
        return Ok(Exit::Code(0));
    }
    // With --max-holders, every place is released: one line per holder.
    for (h, idle) in &holders {
        let line = format!("released '{}' ({})", args.target, h.describe());
        let outcome = if *idle {
            "it ran no command (a lease between steps)".to_owned()
        } else if args.no_wait {
            "not waiting for the holder to stop".to_owned()
        } else {
            wait_for_stop(db, &args.target, h, started).await?
        };
        super::print(format!("{line}; {outcome}\n").as_bytes())?;
    }
    Ok(Exit::Code(0))
}

/// Waits until the old holder has recorded its stop, or its lease would have expired anyway,
/// and says which. `started`: before the statement that released it was sent.
async fn wait_for_stop(db: &Db, target: &str, old: &Holder, started: Instant) -> Result<String> {
    // The old holder cannot run past its TTL after its last heartbeat; measured from before
    // the release was sent, so never later than on the database's clock.
    let expires_at = crate::model::time::deadline(started, old.expires_in);
    super::extend_deadline(old.expires_in);
    loop {
        let recorded = runs::stop_recorded(&db.client, &db.schema, target, old.fence);
        if let Some((id, outcome)) = recorded.await? {
            return Ok(format!(
                "the holder stopped and recorded run {id} as {} after {}",
                outcome.as_str(),
                crate::fmt::duration(started.elapsed())
            ));
        }
        let now = Instant::now();
        if now >= expires_at {
            return Ok(format!(
                "the holder recorded no stop, but its lease has expired by now (ttl {})",
                crate::fmt::duration(old.ttl)
            ));
        }
        sleep(POLL.min(expires_at - now)).await;
    }
}
