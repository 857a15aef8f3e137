//! `leasectl doctor`: looks at the deployment a user points it at and judges it, one [`Check`]
//! per line — `ok`, `warn` or `fail`, with what to do.
//!
//! Doctor only looks. It connects without migrating ([`crate::db::Db::inspect`]), reads inside
//! read-only transactions ([`read_only`]) and never writes a row, creates the schema or
//! publishes to a sink. What it cannot see — `pg_stat_replication` and other roles' sessions
//! are hidden from a role without `pg_monitor` — is a warning that says so, never an `ok`.
//!
//! One file per group, each check a function returning a [`Check`], so that printing (text or
//! `--json`) is one piece of code ([`Report`]):
//!
//! * [`server`]: the server's version, the schema's migrations and their checksums, the role's
//!   privileges against [`crate::db::migrate::grants::GRANTS`] (missing, and more than needed);
//! * [`pooler`]: a pooler in front, its mode, and what leasectl does about it;
//! * [`replication`]: primary or standby, synchronous standbys, the timeline fences carry, the
//!   server settings that break promises, and the failover budget of a TTL;
//! * [`clock`]: the host's clock against the database's;
//! * [`outbox`]: backlog, dead events, who holds back the xmin horizon;
//! * [`sink`]: `--sink`, reached without publishing.

pub mod clock;
pub mod outbox;
pub mod pooler;
pub mod replication;
pub mod server;
pub mod sink;

use std::future::Future;
use std::time::Duration;

use anyhow::Result;
use tokio_postgres::Client;

use crate::db::{Db, Detected};
use crate::exit::Exit;
use crate::relay::sink::SinkSpec;

/// A check's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Ok,
    /// Works, but a promise is weaker than it could be, or something could not be seen.
    Warn,
    /// Broken: exit 1.
    Fail,
}

impl Status {
    pub fn label(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Fail => "fail",
        }
    }
}

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// Stable, for scripts: `schema`, `privileges`, `replication`, …
    pub name: &'static str,
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// What to do about it (for `warn` and `fail`).
    pub fix: Option<String>,
}

impl Check {
    pub fn ok(name: &'static str, detail: impl Into<String>) -> Check {
        Check {
            name,
            status: Status::Ok,
            detail: detail.into(),
            fix: None,
        }
    }

    pub fn warn(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            name,
            status: Status::Warn,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }

    pub fn fail(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            name,
            status: Status::Fail,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }
}

/// What the user asked doctor to judge beyond the database itself.
#[derive(Debug, Clone)]
pub struct Options {
    /// `--ttl`: the TTL the jobs run with (else `run`'s default).
    pub ttl: Option<Duration>,
    pub heartbeat: Option<Duration>,
    pub kill_after: Option<Duration>,
    /// `--failover-time`: how long the user's failover takes (else [`DEFAULT_FAILOVER_TIME`]).
    pub failover_time: Option<Duration>,
    /// `--connections`: how many connections the user's holders, waiters and relays open at
    /// their peak.
    pub connections: Option<u32>,
    pub sink: Option<SinkSpec>,
    /// How long the sink may take to answer.
    pub sink_timeout: Duration,
    /// How long one check's statements may take.
    pub check_deadline: Duration,
}

/// The failover time assumed without `--failover-time`: a typical automatic failover (a
/// Patroni cluster's defaults — a 30 s leader TTL — promote a standby within about that).
pub const DEFAULT_FAILOVER_TIME: Duration = Duration::from_secs(30);

/// What the checks share: the connection and the facts about the session every check needs.
pub struct Ctx {
    pub db: Db,
    pub detected: Detected,
    pub role: String,
    pub database: String,
    pub superuser: bool,
    /// The role may read every session's details and `pg_stat_replication` (superuser, or a
    /// member of `pg_read_all_stats`, which `pg_monitor` includes).
    pub sees_all: bool,
    pub opts: Options,
}

impl Ctx {
    /// Reads the session's facts.
    pub async fn new(db: Db, detected: Detected, opts: Options) -> Result<Ctx> {
        let row = db
            .client
            .query_typed_one(
                "SELECT current_user::text AS role, current_database()::text AS database,
                        coalesce((SELECT rolsuper FROM pg_roles WHERE rolname = current_user), false) AS superuser,
                        pg_has_role(current_user, 'pg_read_all_stats', 'USAGE') AS sees_all",
                &[],
            )
            .await?;
        let superuser: bool = row.try_get("superuser")?;
        Ok(Ctx {
            role: row.try_get("role")?,
            database: row.try_get("database")?,
            superuser,
            sees_all: superuser || row.try_get::<_, bool>("sees_all")?,
            detected,
            db,
            opts,
        })
    }

    pub fn client(&self) -> &Client {
        &self.db.client
    }

    /// The role quoted for SQL in a fix line.
    pub fn role_sql(&self) -> String {
        crate::db::migrate::grants::quote_ident(&self.role)
    }
}

/// Runs `work` inside `BEGIN READ ONLY … ROLLBACK`, so nothing a check sends can write, even by
/// mistake. One round trip each way; a pooler keeps the transaction on one server connection.
pub async fn read_only<T>(client: &Client, work: impl Future<Output = Result<T>>) -> Result<T> {
    client.batch_execute("BEGIN READ ONLY").await?;
    let out = work.await;
    // After a failed statement the transaction is aborted; ROLLBACK ends it either way.
    client.batch_execute("ROLLBACK").await?;
    out
}

/// Whether `e` means the database is gone (exit 69) rather than this check's finding.
pub fn unavailable(e: &anyhow::Error) -> bool {
    Exit::from_error(e) == Exit::Unavailable
}

/// A check's statement failed: an unavailable database ends the doctor (returned); anything
/// else — a missing privilege, a missing table — is this check's warning, saying what could not
/// be read.
pub fn could_not(ctx: &Ctx, name: &'static str, what: &str, e: anyhow::Error) -> Result<Check> {
    if unavailable(&e) {
        return Err(e);
    }
    let fix = if crate::error::permission_denied(&e).is_some() {
        format!(
            "have the schema's owner apply `{}`",
            crate::db::migrate::grants::print_grants_hint(&ctx.db.schema, &ctx.role)
        )
    } else {
        "see the error".to_owned()
    };
    Ok(Check::warn(
        name,
        format!(
            "cannot {what}: {}",
            crate::fmt::one_line(&format!("{e:#}"), 300)
        ),
        fix,
    ))
}

/// Every check's line, in order, and the exit code they make.
#[derive(Debug, Default)]
pub struct Report {
    pub checks: Vec<Check>,
    /// The database could not be reached, or stopped answering (exit 69).
    pub unreachable: bool,
}

impl Report {
    pub fn push(&mut self, c: Check) {
        self.checks.push(c);
    }

    /// 69 when the database could not be reached, 1 when a check failed, else 0.
    pub fn exit(&self) -> Exit {
        if self.unreachable {
            Exit::Unavailable
        } else if self.checks.iter().any(|c| c.status == Status::Fail) {
            Exit::Code(1)
        } else {
            Exit::Code(0)
        }
    }

    /// One line per check: `ok   name: detail`, `warn name: detail; fix`.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for c in &self.checks {
            out.push_str(&format!("{:<4} {}: {}", c.status.label(), c.name, c.detail));
            if let Some(fix) = &c.fix {
                out.push_str("; ");
                out.push_str(fix);
            }
            out.push('\n');
        }
        out
    }

    /// `{"ok": bool, "checks": [{"name", "status", "detail", "fix"}]}`; `ok` is false when any
    /// check failed or the database was unreachable; `fix` is null for an `ok` check.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "ok": self.exit() == Exit::Code(0),
            "checks": self.checks.iter().map(|c| serde_json::json!({
                "name": c.name,
                "status": c.status.label(),
                "detail": c.detail,
                "fix": c.fix,
            })).collect::<Vec<_>>(),
        })
    }
}

/// Runs every database check in order on `ctx`, each within the check deadline. A database
/// that stops answering (or goes away) ends the run there with a failing line: the report so
/// far is kept and marked unreachable.
pub async fn run_database_checks(ctx: &Ctx, report: &mut Report) {
    macro_rules! step {
        ($name:literal, $check:expr) => {
            if !report.unreachable {
                match tokio::time::timeout(ctx.opts.check_deadline, $check).await {
                    Ok(Ok(checks)) => {
                        for c in checks {
                            report.push(c);
                        }
                    }
                    Ok(Err(e)) => {
                        report.unreachable = true;
                        report.push(Check::fail(
                            $name,
                            format!(
                                "the database stopped answering: {}",
                                crate::fmt::one_line(&format!("{e:#}"), 300)
                            ),
                            "check the server and the network, then run doctor again",
                        ));
                    }
                    Err(_) => {
                        report.unreachable = true;
                        report.push(Check::fail(
                            $name,
                            format!(
                                "no answer from the database within {}",
                                crate::fmt::duration(ctx.opts.check_deadline)
                            ),
                            "check the server and the network (a hung host, a black-holed path), then run doctor again",
                        ));
                    }
                }
            }
        };
    }
    step!("server", one(server::version(ctx)));
    step!("primary", one(replication::primary(ctx)));
    step!("pooler", one(pooler::check(ctx)));
    let mut ledger = None;
    step!("schema", async {
        let (check, found) = server::schema(ctx).await?;
        ledger = found;
        anyhow::Ok(vec![check])
    });
    step!("privileges", one(server::privileges(ctx, ledger.as_ref())));
    step!("replication", one(replication::replication(ctx)));
    step!("fences", one(replication::fences(ctx)));
    step!(
        "statement_timeout",
        one(replication::statement_timeout(ctx))
    );
    step!(
        "idle_in_transaction_session_timeout",
        one(replication::idle_timeout(ctx))
    );
    step!(
        "max_connections",
        one(replication::max_connections(ctx, ledger.as_ref()))
    );
    step!("notify_queue", one(replication::notify_queue(ctx)));
    step!("clock", one(clock::check(ctx)));
    step!("outbox", one(outbox::backlog(ctx, ledger.as_ref())));
    step!("xmin_horizon", one(outbox::horizon(ctx)));
}

/// A check that makes one line, as [`run_database_checks`] takes them.
async fn one(check: impl Future<Output = Result<Check>>) -> Result<Vec<Check>> {
    Ok(vec![check.await?])
}

/// Whether a ledger says the leasectl tables are there to read.
pub fn tables_exist(ledger: Option<&crate::db::migrate::Ledger>) -> bool {
    matches!(ledger, Some(crate::db::migrate::Ledger::Found(_)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_aligns_statuses_and_picks_the_exit_code() {
        let mut r = Report::default();
        r.push(Check::ok("schema", "version 12"));
        r.push(Check::warn("clock", "2m ahead", "run NTP"));
        assert_eq!(
            r.text(),
            "ok   schema: version 12\nwarn clock: 2m ahead; run NTP\n"
        );
        assert_eq!(r.exit(), Exit::Code(0));
        assert_eq!(r.json()["ok"], true);
        assert_eq!(r.json()["checks"][0]["fix"], serde_json::Value::Null);
        r.push(Check::fail("sink", "refused", "start it"));
        assert_eq!(r.exit(), Exit::Code(1));
        assert_eq!(r.json()["ok"], false);
        r.unreachable = true;
        assert_eq!(r.exit(), Exit::Unavailable);
    }
}
