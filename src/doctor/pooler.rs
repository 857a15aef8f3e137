//! `pooler`: whether a connection pooler sits in front, in which mode, and what leasectl does
//! about it ([`crate::db::session`] detects it the same way every command does).
//!
//! The mode is seen from the server's side: a session-mode pooler gives each client its own
//! server connection for as long as it is connected, a transaction-mode one hands the server
//! connection back after every transaction. So doctor asks for `pg_backend_pid()` on its own
//! connection, on a second one, then on the first again, each in its own transaction: the same
//! backend for two clients, or a new backend for the same client, is transaction pooling. A
//! pool that happened to give each client its own backend proves nothing; leasectl assumes
//! transaction mode behind any pooler, which is safe in both.

use anyhow::Result;
use tokio_postgres::{Client, SimpleQueryMessage};

use super::{Check, Ctx};
use crate::db::{Detected, Pooling};

/// What leasectl does behind a pooler, for the report.
const BEHIND: &str = "leasectl polls instead of LISTEN (a --wait waiter every 250ms, a relay every --poll, a holder notices `release --force` at its next heartbeat), sends unnamed statements only and sets nothing beyond one transaction (SET LOCAL); the server-side statement_timeout is not set, the client-side deadlines remain";

/// The server backend that serves one read-only transaction on `client`.
async fn backend(client: &Client) -> Result<i32> {
    let msgs = client
        .simple_query("BEGIN READ ONLY; SELECT pg_backend_pid(); COMMIT")
        .await?;
    let pid = msgs.iter().find_map(|m| match m {
        SimpleQueryMessage::Row(r) => r.get(0).and_then(|p| p.parse().ok()),
        _ => None,
    });
    pid.ok_or_else(|| anyhow::anyhow!("the server sent no backend pid"))
}

/// Whether the server connection changes hands between transactions; `None` when it could not
/// be seen.
async fn shares_backends(ctx: &Ctx) -> Result<Option<bool>> {
    let first = backend(ctx.client()).await?;
    let other = ctx.db.another().await?;
    let second = backend(&other.client).await?;
    let again = backend(ctx.client()).await?;
    Ok((first == second || first != again).then_some(true))
}

pub async fn check(ctx: &Ctx) -> Result<Check> {
    let shared = match shares_backends(ctx).await {
        Ok(s) => s,
        Err(e) if format!("{e:#}").contains("statement pooling") => {
            return Ok(Check::fail(
                "pooler",
                "a pooler in statement mode: leasectl's fenced save and the relay's claim are transactions, which statement pooling refuses",
                "use transaction (or session) pool_mode for leasectl's database",
            ))
        }
        Err(e) if super::unavailable(&e) => return Err(e),
        Err(e) => {
            return Ok(Check::warn(
                "pooler",
                format!(
                    "cannot tell whether the server connection is shared: {}",
                    crate::fmt::one_line(&format!("{e:#}"), 200)
                ),
                "see the error",
            ))
        }
    };
    let mode = match shared {
        Some(true) => "transaction mode (two client connections were served by one server backend)",
        _ => "session mode, or transaction mode whose pool gave each client its own server connection so far",
    };
    Ok(match ctx.detected {
        Detected::Direct if shared == Some(true) => Check::fail(
            "pooler",
            "the session applied leasectl's startup option, yet two client connections were served by one server backend: a transaction-mode pooler that passes startup options, where LISTEN does not work",
            "set LEASECTL_POOLER=transaction for every leasectl of this deployment",
        ),
        Detected::Direct => Check::ok(
            "pooler",
            "none in transaction mode: the session is leasectl's own (it applied the startup option), so LISTEN wakes waiters and relays at once",
        ),
        Detected::Forced(Pooling::Direct) if shared == Some(true) => Check::fail(
            "pooler",
            format!("LEASECTL_POOLER=none, but a pooler is in front in {mode}: LISTEN there loses notifications (waiters are woken late, a forced release is noticed late)"),
            "unset LEASECTL_POOLER (or set it to transaction)",
        ),
        Detected::Forced(Pooling::Direct) => Check::ok(
            "pooler",
            "LEASECTL_POOLER=none: detection skipped; no sign of transaction pooling (each client kept its own server backend)",
        ),
        Detected::Forced(Pooling::Pooled) => Check::ok(
            "pooler",
            format!("LEASECTL_POOLER=transaction: {mode}; {BEHIND}"),
        ),
        Detected::Refused => Check::ok(
            "pooler",
            format!("pgbouncer (it refused the startup option `options`), {mode}; {BEHIND}"),
        ),
        Detected::Dropped => Check::ok(
            "pooler",
            format!("a pooler that drops startup options (the session did not get leasectl's statement_timeout), {mode}; {BEHIND}"),
        ),
    })
}
