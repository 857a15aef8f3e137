//! Where the connection settings come from, and opening a connection.
//!
//! libpq's order, first match wins: the connection string (`--database-url` / `DATABASE_URL`, a
//! URL or a `key=value` string), then the service it names (`service=` or `PGSERVICE`, see
//! [`super::service`]), then `PGHOST`, `PGPORT` (both may be lists), `PGUSER`, `PGPASSWORD`,
//! `PGDATABASE`, `PGTARGETSESSIONATTRS`, `PGSSLMODE`, `PGCONNECT_TIMEOUT`, `PGSSLCERT`, `PGSSLKEY`, `PGSSLROOTCERT`, then the local
//! socket as the current OS user — what `psql` with no arguments reaches. Without a password,
//! the password file is consulted per host ([`super::pgpass`]). TLS is set up by [`super::tls`].
//!
//! `open` tries the hosts itself, one at a time, each under `connect_timeout` for everything
//! up to a ready session (TCP, TLS, startup, authentication): tokio-postgres' own timeout
//! covers only the TCP connect, so a server that accepts and never answers would otherwise hang
//! a command for minutes. Also here: how a tokio-postgres error reads in one line, and whether
//! it means "unreachable" (exit 69).

mod errors;
mod hosts;
mod settings;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use tokio::sync::mpsc;
use tokio_postgres::{Client, Config, Notification};

use super::pgpass::PassFile;
use super::tls;
use crate::error::Failure;
pub use errors::{is_unavailable, reason};
use hosts::{Attempt, Target};

/// Server-side limit on every statement, so a stuck lock cannot hold a statement past the
/// client's own deadline. Sent as a startup option (`-c statement_timeout=…`), which costs no
/// round trip and is the session's own state; a pooler that refuses startup options gets none
/// (see [`super::session`]).
pub const STATEMENT_TIMEOUT: &str = "30s";

/// Checked connection settings: what every attempt shares, the hosts to try, and what TLS and
/// the messages need.
#[derive(Clone)]
pub struct Settings {
    /// Everything but the hosts: an attempt clones it and adds one [`Target`].
    base: Config,
    targets: Vec<Target>,
    connect_timeout: Duration,
    verify_tls: bool,
    tls_files: tls::Files,
    /// The password file, read once, when no password was given.
    passfile: Option<Arc<PassFile>>,
}

impl Settings {
    /// These settings plus the startup option that sets the session's `statement_timeout`
    /// (appended to any `options` the connection string already has).
    pub(super) fn with_statement_timeout(&self) -> Settings {
        let mut s = self.clone();
        let own = format!("-c statement_timeout={STATEMENT_TIMEOUT}");
        let options = match self.base.get_options() {
            Some(o) if !o.trim().is_empty() => format!("{o} {own}"),
            _ => own,
        };
        s.base.options(&options);
        s
    }

    /// A plain connection without migrations (for tools and tests that manage databases).
    pub async fn open_client(&self) -> Result<Client> {
        Ok(open(self).await?.0)
    }

    /// The longest connecting may take: every host given its full `connect_timeout`.
    pub fn connect_budget(&self) -> Duration {
        let hosts = u32::try_from(self.targets.len()).unwrap_or(u32::MAX);
        self.connect_timeout.saturating_mul(hosts)
    }

    /// "host:port as user, database db" for messages — never the password.
    pub fn describe(&self) -> String {
        let hosts: Vec<String> = self.targets.iter().map(Target::label).collect();
        format!("{} {}", hosts.join(", "), self.who())
    }

    /// `as user "u", database "d"`.
    fn who(&self) -> String {
        let user = self.base.get_user().unwrap_or("?");
        let db = self.base.get_dbname().unwrap_or(user);
        format!("as user \"{user}\", database \"{db}\"")
    }
}

/// Opens one connection; its socket I/O runs as a task of its own (see [`super::notify`]).
///
/// The one place a connection is opened. Hosts are tried in turn, each with its own
/// single-host tokio-postgres config under the full `connect_timeout` (DNS, TCP, TLS, startup,
/// authentication and the `target_session_attrs` check, which tokio-postgres makes).
pub(super) async fn open(
    settings: &Settings,
) -> Result<(
    Client,
    (
        mpsc::UnboundedReceiver<Notification>,
        tokio::task::AbortHandle,
    ),
)> {
    let tls = settings.connector()?;
    let mut tried = Vec::new();
    for target in settings.order() {
        let config = settings.config_for(&target);
        let connect = while_waiting(config.connect(tls.clone()), warm_cpu_features);
        let attempt = match tokio::time::timeout(settings.connect_timeout, connect).await {
            Ok(Ok((client, connection))) => return Ok((client, super::notify::drive(connection))),
            Ok(Err(e)) => Attempt::Failed(e),
            Err(_) => Attempt::Silent,
        };
        let stop = attempt.ends_search();
        tried.push((target, attempt));
        if stop {
            return Err(Failure::Refused(settings.failure(&tried)).into());
        }
    }
    Err(Failure::Unavailable(settings.failure(&tried)).into())
}

/// Polls `fut` to completion, running `idle` once, the first time `fut` has to wait: for a
/// connection, while the server starts the session (a new server process, authentication),
/// so that work the client must do anyway is done while it would only wait.
async fn while_waiting<F: Future>(fut: F, idle: impl FnOnce()) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    let mut idle = Some(idle);
    std::future::poll_fn(move |cx| {
        let polled = fut.as_mut().poll(cx);
        if polled.is_pending() {
            if let Some(idle) = idle.take() {
                idle();
            }
        }
        polled
    })
    .await
}

/// Runs the standard library's CPU feature detection, which the protocol parser's `memchr`
/// asks for when it reads the server's first message: about seven `CPUID` instructions, each
/// of which traps to the hypervisor on a virtual machine (60 µs in all there, most of a
/// percent of a `run -- true`). The answer is kept for the process, so done while the server
/// starts the session it costs the connection nothing.
fn warm_cpu_features() {
    #[cfg(any(target_arch = "x86_64", target_arch = "x86"))]
    let _ = std::arch::is_x86_feature_detected!("avx2");
}

#[cfg(test)]
mod tests {
    use super::while_waiting;

    #[tokio::test]
    async fn the_idle_work_runs_once_when_the_future_first_waits() {
        let mut ran = 0;
        let out = while_waiting(
            async {
                tokio::task::yield_now().await;
                tokio::task::yield_now().await;
                7
            },
            || ran += 1,
        )
        .await;
        assert_eq!((out, ran), (7, 1));
    }

    #[tokio::test]
    async fn a_future_ready_at_once_does_without_the_idle_work() {
        let mut ran = false;
        let out = while_waiting(async { 7 }, || ran = true).await;
        assert_eq!((out, ran), (7, false));
    }
}
