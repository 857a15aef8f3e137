//! A one-shot command's client-side deadline, and connecting under it: a server that goes
//! silent (a hung host, a black-holed connection) ends the command with exit 69 instead of a
//! hang. `run` and `relay`, which bound their own statements, connect through it too, and then
//! it bounds the connection and the schema check alone.

use std::future::Future;
use std::time::Duration;

use anyhow::Result;
use tokio::sync::watch;
use tokio::time::Instant;

use super::{Db, Schema, Settings};
use crate::error::Failure;

/// How long a one-shot command's database work may take after connecting, unless
/// `LEASECTL_STATEMENT_TIMEOUT` says otherwise (for operators with slow prunes, and for tests).
pub const STATEMENT_WINDOW: Duration = Duration::from_secs(30);

tokio::task_local! {
    /// Set by [`one_shot`] around its command; [`connect`] arms it with the command's deadline
    /// and what to name in the message.
    static DEADLINE: watch::Sender<Option<(Instant, String)>>;
}

/// Runs a one-shot command (status, runs, output, release, outbox, prune, migrate) under one
/// client-side deadline, so a server that goes silent mid-command (a hung host, a black-holed
/// connection: no error ever arrives) ends it with exit 69 instead of a hang. A server-side
/// `statement_timeout` cannot help there, and it leaks through transaction poolers.
///
/// One deadline for the whole command rather than one per statement keeps it in this one
/// place: the statements live in `store`, and these commands send a handful of small ones. It
/// is armed by [`connect`] once the settings are known: connecting is bounded by itself (each
/// host gets `connect_timeout`), so the deadline is that budget plus [`STATEMENT_WINDOW`].
pub async fn one_shot<T>(work: impl Future<Output = Result<T>>) -> Result<T> {
    let (armed, mut watched) = watch::channel::<Option<(Instant, String)>>(None);
    // Follows the deadline as it is armed and extended; ends with `None` when the command is
    // done (the sender is dropped).
    let expired = async move {
        loop {
            let current = watched.borrow_and_update().clone();
            match current {
                None => watched.changed().await.ok()?,
                Some((at, what)) => tokio::select! {
                    _ = tokio::time::sleep_until(at) => return Some(what),
                    changed = watched.changed() => changed.ok()?,
                },
            }
        }
    };
    tokio::select! {
        biased;
        result = DEADLINE.scope(armed, work) => result,
        Some(what) = expired => Err(Failure::Unavailable(what).into()),
    }
}

/// Moves the armed deadline of the [`one_shot`] command running on this task `extra` later:
/// for a command that has a known reason to wait (`release` waiting out the old holder's TTL).
pub fn extend_deadline(extra: Duration) {
    let _ = DEADLINE.try_with(|d| {
        d.send_modify(|armed| {
            if let Some((at, _)) = armed {
                *at = at.checked_add(extra).unwrap_or(*at);
            }
        })
    });
}

/// `LEASECTL_STATEMENT_TIMEOUT` (a duration such as `30s`), else [`STATEMENT_WINDOW`].
fn statement_window() -> Result<Duration> {
    Ok(statement_timeout()?.unwrap_or(STATEMENT_WINDOW))
}

/// `LEASECTL_STATEMENT_TIMEOUT`, if set: a one-shot command's window, or how long one of the
/// relay's statements may go unanswered.
pub fn statement_timeout() -> Result<Option<Duration>> {
    match std::env::var("LEASECTL_STATEMENT_TIMEOUT") {
        Ok(v) if !v.trim().is_empty() => crate::model::flags::parse_duration(v.trim())
            .map(Some)
            .map_err(|e| crate::error::usage(format!("LEASECTL_STATEMENT_TIMEOUT: {e}"))),
        _ => Ok(None),
    }
}

/// Connects with the shared database options and brings the schema up to date, within
/// `connect_timeout` per host plus the statement window. Inside [`one_shot`] that arms the
/// command's deadline (which then also covers its statements); for `run` and `relay`, which
/// bound their own statements, it bounds the connection and the schema check alone.
pub async fn connect(database_url: Option<&str>, schema: &str) -> Result<Db> {
    let settings = Settings::new(database_url)?;
    bounded(settings, |settings| {
        Db::connect(settings, Schema::new(schema))
    })
    .await
}

/// Connects as [`connect`] does, under the same deadline, leaving the schema check to the first
/// transaction ([`Db::first`]) or to [`check_schema`]: for `run`, whose acquisition carries it.
pub async fn connect_unchecked(database_url: Option<&str>, schema: &str) -> Result<Db> {
    let settings = Settings::new(database_url)?;
    bounded(settings, |settings| {
        Db::unchecked(settings, Schema::new(schema))
    })
    .await
}

/// [`Db::check_schema`] within the statement window (a schema's first use migrates it), as
/// [`connect`] bounds it.
pub async fn check_schema(db: &mut Db) -> Result<()> {
    let (window, what) = schema_window(db)?;
    match tokio::time::timeout(window, db.check_schema()).await {
        Ok(checked) => checked,
        Err(_) => Err(Failure::Unavailable(what).into()),
    }
}

/// Runs `first` (a [`Db::first`] transaction, which carries the schema check) within the
/// statement window, as [`check_schema`] bounds the check alone.
pub async fn first<T>(db: &Db, first: impl Future<Output = Result<T>>) -> Result<T> {
    let (window, what) = schema_window(db)?;
    match tokio::time::timeout(window, first).await {
        Ok(done) => done,
        Err(_) => Err(Failure::Unavailable(what).into()),
    }
}

/// How long the schema check may take, and what to say when it took longer (as [`bounded`]).
fn schema_window(db: &Db) -> Result<(Duration, String)> {
    let window = statement_window()?;
    let what = format!(
        "no answer from PostgreSQL at {} within {} (LEASECTL_STATEMENT_TIMEOUT)",
        db.settings.describe(),
        crate::fmt::duration(window)
    );
    Ok((window, what))
}

/// Connects as [`connect`] does, under the same deadline, without touching the schema: for
/// `doctor`, which only looks ([`Db::inspect`]).
pub async fn connect_to_inspect(
    database_url: Option<&str>,
    schema: &str,
) -> Result<(Db, super::Detected)> {
    let settings = Settings::new(database_url)?;
    bounded(settings, |settings| {
        Db::inspect(settings, Schema::new(schema))
    })
    .await
}

/// Runs `open(settings)` within `connect_timeout` per host plus the statement window (see
/// [`connect`]).
async fn bounded<T, F>(settings: Settings, open: impl FnOnce(Settings) -> F) -> Result<T>
where
    F: Future<Output = Result<T>>,
{
    let window = statement_window()?;
    let limit = settings.connect_budget().saturating_add(window);
    let at = crate::model::time::deadline(Instant::now(), limit);
    let what = format!(
        "no answer from PostgreSQL at {} within {} (LEASECTL_STATEMENT_TIMEOUT)",
        settings.describe(),
        crate::fmt::duration(window)
    );
    if DEADLINE.try_with(|_| ()).is_ok() {
        DEADLINE.with(|d| d.send_replace(Some((at, what))));
        return open(settings).await;
    }
    match tokio::time::timeout_at(at, open(settings)).await {
        Ok(connected) => connected,
        Err(_) => Err(Failure::Unavailable(what).into()),
    }
}
