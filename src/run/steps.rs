//! Leases across steps: `acquire` takes a lease that outlives the process and prints its token;
//! `run --token` runs one step under it.
//!
//! Nothing heartbeats between steps: the lease lives for its TTL from its last renewal (the
//! acquisition, the end of a step, or `renew`). A step takes the lease up with one statement that
//! renews it only while its token still holds it and it has not expired ([`leases::adopt`]) —
//! otherwise the step does not start and exits 76 — and from there it is an ordinary run: the
//! heartbeat renews it by its own TTL, a lost lease stops the command, and the fenced save stores
//! the step's run and events. Only the end differs: the save keeps the lease (renewed, marked
//! idle) instead of releasing it ([`Lease::keep`]), and nothing else in the run path releases it.
//! `release --token` ends it.

use std::io::Write;
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::json;
use tokio::time::Instant;
use uuid::Uuid;

use super::heartbeat::Heartbeat;
use super::wait::{obtain, Obtained, Resume};
use super::{
    bounded, execute, prepare, release_within, replace, start, too_late, Launch, Me, Prepared,
    Started, STATEMENT_DEADLINE,
};
use crate::cli::{AcquireArgs, AcquireFormat, DbArgs};
use crate::config::RunConfig;
use crate::db::Db;
use crate::exit::{Exit, Failure};
use crate::signals::Signals;
use crate::store::leases::{self, Adopted, DbClock, Lease};

/// `leasectl acquire`: takes the lease as `run` would, waits out a replaced holder, marks the
/// lease idle (it runs nothing) and prints it. If it cannot be printed, it is released: a lease
/// nobody knows the token of would only block the target for its TTL.
pub async fn acquire(db_args: &DbArgs, args: AcquireArgs) -> Result<Exit> {
    let format = args.format;
    let cfg = RunConfig::acquire(args.lease)?;
    let Started {
        mut signals,
        mut db,
        give_up_at,
    } = match start(db_args, &cfg, false).await? {
        Ok(s) => s,
        Err(exit) => return Ok(exit),
    };
    let me = Me::new();
    let granted = match obtain(
        &mut db,
        &cfg,
        &me,
        &mut signals,
        (give_up_at, Resume::default()),
    )
    .await?
    {
        Obtained::Lease(g) => g,
        Obtained::Done(exit) => return Ok(exit),
    };
    let (lease, acquired_at, listening) = (granted.lease, granted.sent, granted.listening);
    let mut hb = Heartbeat::new(&lease, cfg.times(), acquired_at);
    if db.can_listen() {
        hb.watch_releases(listening);
    }
    if let Some(exit) =
        replace::await_stop(&mut db, &cfg, &lease, false, &mut hb, &mut signals).await
    {
        return Ok(exit);
    }
    let until = hb.stop_at();
    let idle = tokio::select! {
        r = bounded(until, leases::set_idle(&db.client, &db.schema, &lease)) => r,
        sig = signals.recv() => {
            release_within(&db, &lease, Instant::now() + STATEMENT_DEADLINE).await;
            return Ok(Exit::from_signal(sig));
        }
    };
    match idle {
        Ok(true) => {}
        Ok(false) => {
            say!(
                "the lease on '{}' was taken over before it could be handed out",
                cfg.target
            );
            return Ok(Exit::LeaseLost);
        }
        Err(e) => {
            release_within(&db, &lease, Instant::now() + STATEMENT_DEADLINE).await;
            return Err(e);
        }
    }
    if let Err(e) = print_lease(format, &lease, cfg.ttl) {
        release_within(&db, &lease, Instant::now() + STATEMENT_DEADLINE).await;
        // Like the relay's closed stdout: the output's reader is gone, nothing is broken (69).
        let why = format!("{e:#}; the lease was released");
        return Err(Failure::Unavailable(why).into());
    }
    info!(
        "acquired '{}' (fence {}); it lives {} from each renewal: run --token steps, renew, release --token",
        lease.target,
        crate::fmt::fence(lease.fence),
        crate::fmt::duration(cfg.ttl)
    );
    Ok(Exit::Code(0))
}

/// The lease as `--format` prints it. Any failure to write — a closed pipe included — is an
/// error: the caller must not believe it holds a lease it cannot name.
fn print_lease(format: AcquireFormat, lease: &Lease, ttl: Duration) -> Result<()> {
    let vars = [
        ("LEASECTL_TARGET", lease.target.clone()),
        ("LEASECTL_TOKEN", lease.token.to_string()),
        ("LEASECTL_FENCE", lease.fence.to_string()),
        ("LEASECTL_HOLDER_INDEX", lease.holder_index().to_string()),
    ];
    let text = match format {
        AcquireFormat::Sh => vars
            .iter()
            .map(|(k, v)| format!("export {k}={}\n", sh_quote(v)))
            .collect(),
        // Targets hold no control characters (`parse_target`), so one line per variable.
        AcquireFormat::Env => vars.iter().map(|(k, v)| format!("{k}={v}\n")).collect(),
        AcquireFormat::Json => {
            let doc = json!({
                "target": lease.target,
                "token": lease.token.to_string(),
                "fence": lease.fence,
                "holder_index": lease.holder_index(),
                "ttl_ms": crate::fmt::ms(ttl),
                "label": lease.label,
            });
            format!("{doc}\n")
        }
    };
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .context("cannot print the lease")
}

/// `'…'`, with every `'` as `'\''`: one word for any shell, whatever the target holds.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// How often a step that waits for the running one (`run --token --wait`) looks again, besides
/// being woken by the running step's save (NOTIFY on the lease channel).
const STEP_POLL: Duration = Duration::from_millis(500);

/// `run --token`: takes up the lease `acquire` took and runs the command under it as one step.
///
/// Steps of one lease run one at a time: while another step runs, this one exits busy at once,
/// naming it — or, with `--wait`, waits for it to end (up to `--wait`'s limit, counted from
/// `give_up_at`) and then runs if the lease is still held.
pub(super) async fn step(
    db: &mut Db,
    mut cfg: RunConfig,
    me: &Me,
    token: Uuid,
    signals: &mut Signals,
    give_up_at: Option<Instant>,
) -> Result<Exit> {
    let mut listening = false;
    let mut waited: Option<Instant> = None;
    let (lease, ttl, sent, answered) = loop {
        let sent = Instant::now();
        let adopt = leases::adopt(
            &db.client,
            &db.schema,
            &cfg.target,
            token,
            (&me.host, me.pid),
        );
        let adopted = tokio::select! {
            r = bounded(sent + STATEMENT_DEADLINE, adopt) => r?,
            sig = signals.recv() => return Ok(Exit::from_signal(sig)),
        };
        let running = match adopted {
            Adopted::Held(lease, ttl) => break (lease, ttl, sent, Instant::now()),
            Adopted::NotHeld => {
                let why = leases::why_not_held(&db.client, &db.schema, &cfg.target, token);
                let why = bounded(Instant::now() + STATEMENT_DEADLINE, why).await?;
                say!("{why}; the step was not started");
                return Ok(Exit::LeaseLost);
            }
            Adopted::StepRunning(who) => who,
        };
        if cfg.wait.is_none() {
            if !cfg.quiet {
                say!(
                    "another step of the lease on '{}' is running ({running}); steps of one lease run one at a time (--wait waits for it)",
                    cfg.target
                );
            }
            return Ok(Exit::Busy(cfg.busy_exit_code));
        }
        if waited.is_none() {
            info!(
                "waiting for the running step of '{}' ({running}) to end",
                cfg.target
            );
            waited = Some(Instant::now());
        }
        if !listening && db.can_listen() {
            listening = true;
            let channel = db.schema.lease_channel();
            let listen = async {
                crate::db::notify::listen(&db.client, &channel)
                    .await
                    .map_err(anyhow::Error::from)
            };
            if let Err(e) = bounded(Instant::now() + STATEMENT_DEADLINE, listen).await {
                info!(
                    "LISTEN failed ({e:#}); polling every {}",
                    crate::fmt::duration(STEP_POLL)
                );
            }
            // The step may have ended before LISTEN took effect: look again at once.
            continue;
        }
        let woken = async {
            tokio::select! {
                _ = crate::db::notify::announced(&mut db.notifications, &cfg.target) => {}
                _ = tokio::time::sleep(STEP_POLL) => {}
            }
        };
        let give_up = async {
            match give_up_at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            sig = signals.recv() => return Ok(Exit::from_signal(sig)),
            _ = woken => {}
            _ = give_up => {
                if !cfg.quiet {
                    say!(
                        "gave up waiting for the running step of '{}' ({running}) after {}",
                        cfg.target,
                        crate::fmt::duration(waited.map_or(Duration::ZERO, |w| w.elapsed()))
                    );
                }
                return Ok(Exit::Busy(cfg.busy_exit_code));
            }
        }
    };
    // The step heartbeats by the TTL the lease was taken with.
    cfg.with_ttl(ttl)?;
    info!(
        "took up '{}' (fence {}) for a step",
        lease.target,
        crate::fmt::fence(lease.fence)
    );
    let mut hb = Heartbeat::new(&lease, cfg.times(), sent);
    if db.can_listen() {
        hb.watch_releases(listening);
    }
    let clock = DbClock {
        db_time: lease.granted_at,
        local: sent,
    };
    match prepare(
        db,
        &cfg,
        me,
        &lease,
        &mut hb,
        (clock, (sent, answered)),
        signals,
    )
    .await?
    {
        Prepared::Spawn(slot) => {
            let launch = Launch {
                acquired_at: sent,
                slot,
                watchdog: None,
            };
            execute(db, &cfg, me, &lease, hb, launch, signals).await
        }
        Prepared::Done(exit) => Ok(exit),
        Prepared::TooLate { why, silent_db } => too_late(why, silent_db),
    }
}

#[cfg(test)]
mod tests {
    use super::sh_quote;

    #[test]
    fn sh_quoting_survives_quotes() {
        assert_eq!(sh_quote("deploy"), "'deploy'");
        assert_eq!(sh_quote("it's"), r"'it'\''s'");
    }
}
