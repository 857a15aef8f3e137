//! Direct sessions and pooled ones.
//!
//! Behind a transaction-mode pooler (pgbouncer's `pool_mode = transaction`, the common
//! production set-up) each transaction may run on a different server connection, so nothing
//! may outlive a transaction: no named prepared statements (every statement in `store` is
//! unnamed, `query_typed`), no session `SET` (planner settings are `SET LOCAL`), and no
//! LISTEN — the server connection that ran it goes back to the pool, and its notifications
//! would reach whichever client uses it next, or nobody.
//!
//! A session is **direct** when the server applied the startup option that sets our
//! `statement_timeout`, which a pooler either refuses ("unsupported startup parameter",
//! pgbouncer's default; we then reconnect without it) or drops
//! (`ignore_startup_parameters = options`; the migration probe reads the setting back in the
//! round trip it makes anyway). Either way costs nothing on a direct connection.
//! `LEASECTL_POOLER=transaction` or `none` overrides the detection.
//!
//! What a pooled session gives up, and what replaces it:
//! * LISTEN: every waiter polls (a `--wait` waiter every 250 ms instead of being woken within
//!   milliseconds; a relay every `--poll`; a holder notices `release --force` at its next
//!   heartbeat instead of at once);
//! * the server-side `statement_timeout`: the client-side deadlines remain (run, relay, and
//!   the one-shot commands bound every statement themselves).

use anyhow::Result;
use tokio::sync::mpsc;
use tokio_postgres::{Client, Notification};

use super::connect::{self, Settings, STATEMENT_TIMEOUT};

/// A connection's notifications and the task that drives its socket.
pub(super) type Driven = (
    mpsc::UnboundedReceiver<Notification>,
    tokio::task::AbortHandle,
);
use crate::error::Failure;

/// How a connection reaches its server connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// Our own server session: LISTEN and session settings work.
    Direct,
    /// Through a transaction-mode pooler (or so we must assume): polling only.
    Pooled,
}

/// What `LEASECTL_POOLER` asks for: `None` means detect.
fn forced() -> Result<Option<Pooling>> {
    match std::env::var("LEASECTL_POOLER").ok().as_deref() {
        None | Some("") | Some("auto") => Ok(None),
        Some("transaction") => Ok(Some(Pooling::Pooled)),
        Some("none") => Ok(Some(Pooling::Direct)),
        Some(other) => Err(Failure::Usage(format!(
            "LEASECTL_POOLER must be auto, transaction or none, not '{other}'"
        ))
        .into()),
    }
}

/// Opens a connection, with our `statement_timeout` as a startup option unless the server (a
/// pooler) refuses it. `known` is what an earlier connection with the same settings found.
pub(super) async fn open(
    settings: &Settings,
    known: Option<Pooling>,
) -> Result<(Client, Driven, Option<Pooling>)> {
    let forced = forced()?;
    let known = forced.or(known);
    if known == Some(Pooling::Pooled) {
        let (c, n) = connect::open(settings).await?;
        return Ok((c, n, known));
    }
    match connect::open(&settings.with_statement_timeout()).await {
        Ok((c, n)) => Ok((c, n, known)),
        Err(e) if refused_startup_options(&e) => {
            let (c, n) = connect::open(settings).await?;
            Ok((c, n, forced.or(Some(Pooling::Pooled))))
        }
        Err(e) => Err(e),
    }
}

/// How a session was found to be direct or pooled, for `leasectl doctor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detected {
    /// `LEASECTL_POOLER` said so.
    Forced(Pooling),
    /// The server applied our startup option: our own server session.
    Direct,
    /// The server refused the startup option ("unsupported startup parameter"): pgbouncer.
    Refused,
    /// The server accepted the startup option but did not apply it: a pooler that drops it
    /// (pgbouncer's `ignore_startup_parameters = options`, or another pooler).
    Dropped,
}

/// Opens a connection as [`open`] does and reads back the session's `statement_timeout`, without
/// touching the schema: how the session reaches its server, and why leasectl thinks so.
pub(super) async fn inspect(settings: &Settings) -> Result<(Client, Driven, Pooling, Detected)> {
    let (client, driven, known) = open(settings, None).await?;
    if let Some(forced) = forced()? {
        return Ok((client, driven, forced, Detected::Forced(forced)));
    }
    if known == Some(Pooling::Pooled) {
        return Ok((client, driven, Pooling::Pooled, Detected::Refused));
    }
    let shown = client.simple_query("SHOW statement_timeout").await?;
    let timeout = shown
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
        .unwrap_or_default();
    Ok(match judge(None, &timeout) {
        Pooling::Direct => (client, driven, Pooling::Direct, Detected::Direct),
        Pooling::Pooled => (client, driven, Pooling::Pooled, Detected::Dropped),
    })
}

/// Decides from the `statement_timeout` the session reports (see [`super::migrate`]) unless
/// the connection already told.
pub(super) fn judge(known: Option<Pooling>, statement_timeout: &str) -> Pooling {
    known.unwrap_or(if statement_timeout == STATEMENT_TIMEOUT {
        Pooling::Direct
    } else {
        Pooling::Pooled
    })
}

/// pgbouncer answers a startup packet with parameters it does not pass on with
/// `unsupported startup parameter: options` (SQLSTATE 08P01).
fn refused_startup_options(e: &anyhow::Error) -> bool {
    format!("{e:#}").contains("unsupported startup parameter")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_setting_tells_direct_from_pooled() {
        assert_eq!(judge(None, STATEMENT_TIMEOUT), Pooling::Direct);
        assert_eq!(judge(None, "0"), Pooling::Pooled);
        assert_eq!(
            judge(Some(Pooling::Pooled), STATEMENT_TIMEOUT),
            Pooling::Pooled
        );
    }
}
