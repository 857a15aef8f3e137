//! Primary or standby, synchronous replication, the server settings that break leasectl's
//! promises, and whether a TTL outlasts a failover (docs/OPERATIONS.md, "High availability").

use std::time::Duration;

use anyhow::Result;

use super::{could_not, read_only, Check, Ctx, DEFAULT_FAILOVER_TIME};
use crate::db::migrate::Ledger;
use crate::db::Pooling;
use crate::fmt;

/// The hint for a session that reached a standby.
const READ_WRITE_HINT: &str = "list every host and ask for the writable one: postgres://user@db1,db2/db?target_session_attrs=read-write (or PGHOST=db1,db2 PGTARGETSESSIONATTRS=read-write)";

/// `primary`: a standby (in recovery) refuses every write leasectl makes.
pub async fn primary(ctx: &Ctx) -> Result<Check> {
    let row = ctx
        .client()
        .query_typed_one("SELECT pg_is_in_recovery() AS standby", &[])
        .await?;
    Ok(if row.try_get::<_, bool>("standby")? {
        Check::fail(
            "primary",
            "connected to a standby (pg_is_in_recovery() is true): every acquisition, heartbeat and save fails there",
            READ_WRITE_HINT,
        )
    } else {
        Check::ok("primary", "connected to a primary (not in recovery)")
    })
}

/// `fences`: the server's timeline, which every fence carries in its high bits so that fences
/// grow across failovers, even lossy ones. A server that cannot name it (no WAL of its own)
/// fails every acquisition unless `LEASECTL_FENCE_TIMELINE=off`.
pub async fn fences(ctx: &Ctx) -> Result<Check> {
    const NAME: &str = "fences";
    let carry = crate::store::fences_carry_the_timeline();
    let found = read_only(ctx.client(), async {
        let row = ctx
            .client()
            .query_typed_one(
                "SELECT CASE WHEN pg_is_in_recovery() THEN NULL
                        ELSE ('x' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::int8
                        END AS timeline",
                &[],
            )
            .await?;
        anyhow::Ok(row.try_get::<_, Option<i64>>("timeline")?)
    })
    .await;
    Ok(match (found, carry) {
        (Ok(None), _) => Check::warn(
            NAME,
            "connected to a standby: its timeline is the next primary's to name",
            READ_WRITE_HINT,
        ),
        (Ok(Some(t)), true) => Check::ok(
            NAME,
            format!(
                "timeline {t}: fences from {} on, greater than every fence before any promotion",
                fmt::fence((t - 1).min(8_388_607) * fmt::FENCE_BLOCK + 1)
            ),
        ),
        (Ok(Some(t)), false) => Check::warn(
            NAME,
            format!("LEASECTL_FENCE_TIMELINE=off: fences grow by their counter alone (the server is on timeline {t}), and a failover to a standby that missed an acquisition hands its fence out again"),
            "unset LEASECTL_FENCE_TIMELINE: this server names its timeline",
        ),
        (Err(e), _) if super::unavailable(&e) => return Err(e),
        (Err(e), true) => Check::fail(
            NAME,
            format!(
                "the server cannot name its timeline ({}): every acquisition fails",
                fmt::one_line(&format!("{e:#}"), 200)
            ),
            "set LEASECTL_FENCE_TIMELINE=off for every leasectl of this deployment (fences then grow by their counter alone)",
        ),
        (Err(_), false) => Check::ok(
            NAME,
            "LEASECTL_FENCE_TIMELINE=off: fences grow by their counter alone (this server cannot name its timeline)",
        ),
    })
}

/// What the primary says about its standbys and the role's commits.
struct Replication {
    standby: bool,
    standbys: i64,
    /// Standbys whose `sync_state` this role may see.
    visible: i64,
    synchronous: i64,
    names: String,
    commit: String,
}

/// `replication`: standbys present while this role's commits do not wait for a synchronous one
/// mean a failover can lose what leasectl reported stored.
pub async fn replication(ctx: &Ctx) -> Result<Check> {
    let look = async {
        let r = ctx
            .client()
            .query_typed_one(
                "SELECT pg_is_in_recovery() AS standby,
                        (SELECT count(*) FROM pg_stat_replication) AS standbys,
                        (SELECT count(sync_state) FROM pg_stat_replication) AS visible,
                        (SELECT count(*) FROM pg_stat_replication
                          WHERE sync_state IN ('sync', 'quorum')) AS synchronous,
                        current_setting('synchronous_standby_names') AS names,
                        current_setting('synchronous_commit') AS commit",
                &[],
            )
            .await?;
        anyhow::Ok(Replication {
            standby: r.try_get("standby")?,
            standbys: r.try_get("standbys")?,
            visible: r.try_get("visible")?,
            synchronous: r.try_get("synchronous")?,
            names: r.try_get("names")?,
            commit: r.try_get("commit")?,
        })
    };
    let r = match read_only(ctx.client(), look).await {
        Ok(r) => r,
        Err(e) => return could_not(ctx, "replication", "read pg_stat_replication", e),
    };
    if r.standby {
        return Ok(Check::warn(
            "replication",
            "not checked: this is a standby (see `primary`)",
            READ_WRITE_HINT,
        ));
    }
    let role = ctx.role_sql();
    let settings = format!(
        "synchronous_commit = {} for role {role}, synchronous_standby_names = '{}'",
        r.commit, r.names
    );
    let waits = matches!(r.commit.as_str(), "on" | "remote_write" | "remote_apply");
    let alter = format!("ALTER ROLE {role} SET synchronous_commit = 'remote_apply';");
    let loses = "a failover to one can lose stored runs, their results and outbox events that leasectl reported stored, and an acquisition (another caller then acquires while the lost holder still runs, under a greater fence of the new timeline: docs/OPERATIONS.md, \"What asynchronous replication can lose\")";
    if r.standbys == 0 {
        return Ok(Check::ok(
            "replication",
            format!("no streaming standby connected ({settings}); replication this server cannot see (a managed service's storage-level standby) is not judged here"),
        ));
    }
    if r.names.trim().is_empty() {
        return Ok(Check::warn(
            "replication",
            format!(
                "{} streaming standby(s), all asynchronous ({settings}): {loses}",
                r.standbys
            ),
            format!("on the primary name a standby in synchronous_standby_names, then: {alter}"),
        ));
    }
    if !waits {
        return Ok(Check::warn(
            "replication",
            format!("{} streaming standby(s), but this role's commits do not wait for one ({settings}): {loses}", r.standbys),
            alter,
        ));
    }
    if r.visible == 0 && !ctx.sees_all {
        return Ok(Check::warn(
            "replication",
            format!("{} streaming standby(s) ({settings}); whether one is synchronous cannot be seen: pg_stat_replication hides sync_state from role {role}", r.standbys),
            format!("GRANT pg_monitor TO {role}; or run doctor as a member of pg_monitor"),
        ));
    }
    if r.synchronous == 0 {
        return Ok(Check::fail(
            "replication",
            format!("{} streaming standby(s), none of them synchronous, while commits wait for one ({settings}): commits hang until a standby named there connects", r.standbys),
            "fix synchronous_standby_names on the primary to name a connected standby (pg_stat_replication.application_name)",
        ));
    }
    Ok(Check::ok(
        "replication",
        format!(
            "{} streaming standby(s), {} synchronous ({settings}): a commit returns once a synchronous standby has it",
            r.standbys, r.synchronous
        ),
    ))
}

/// A setting as the session has it, in milliseconds, and where it came from.
async fn setting_ms(ctx: &Ctx, name: &str) -> Result<(i64, String, String)> {
    let row = ctx
        .client()
        .query_typed_one(
            "SELECT round(extract(epoch FROM current_setting(name)::interval) * 1000)::int8 AS ms,
                    current_setting(name) AS shown, source
               FROM pg_settings WHERE name = $1",
            &[(&name, tokio_postgres::types::Type::TEXT)],
        )
        .await?;
    Ok((
        row.try_get("ms")?,
        row.try_get("shown")?,
        row.try_get("source")?,
    ))
}

/// `statement_timeout`: leasectl sets its own (30s) on a session of its own; behind a pooler the
/// role's, the database's or the server's applies, and a short one cancels a large save or a
/// relay's claim under load.
pub async fn statement_timeout(ctx: &Ctx) -> Result<Check> {
    const NAME: &str = "statement_timeout";
    let own = crate::db::connect::STATEMENT_TIMEOUT;
    if ctx.db.pooling() == Pooling::Direct {
        return Ok(Check::ok(
            NAME,
            format!("leasectl sets {own} for its own sessions (a startup option), whatever the role or server says"),
        ));
    }
    let (ms, shown, source) = match read_only(ctx.client(), setting_ms(ctx, NAME)).await {
        Ok(v) => v,
        Err(e) => return could_not(ctx, NAME, "read statement_timeout", e),
    };
    let floor = crate::model::flags::parse_duration(own).map_or(30_000, fmt::ms);
    Ok(if ms > 0 && ms < floor {
        Check::warn(
            NAME,
            format!("{shown} (from {source}) behind the pooler, shorter than leasectl's own {own}: a save of a large run, a relay's claim under load or a prune can be cancelled"),
            format!("ALTER ROLE {} SET statement_timeout = '{own}'; (or 0: leasectl bounds every statement on its side)", ctx.role_sql()),
        )
    } else {
        Check::ok(
            NAME,
            format!("{shown} (from {source}) behind the pooler; leasectl bounds every statement on its side too"),
        )
    })
}

/// `idle_in_transaction_session_timeout`: a relay's batch transaction stays open while it
/// publishes; it sets its own timeout for it but keeps a shorter one of the role's, the
/// database's or the server's, and a delivery slower than that ends its session.
pub async fn idle_timeout(ctx: &Ctx) -> Result<Check> {
    const NAME: &str = "idle_in_transaction_session_timeout";
    let (ms, shown, source) = match read_only(ctx.client(), setting_ms(ctx, NAME)).await {
        Ok(v) => v,
        Err(e) => return could_not(ctx, NAME, "read idle_in_transaction_session_timeout", e),
    };
    // What the relay's batch wants for the sink given (a webhook or command may take its whole
    // --timeout, 30s by default, after the event left), else for a broker.
    let in_flight = match &ctx.opts.sink {
        Some(crate::relay::sink::SinkSpec::Exec(_)) => Duration::from_secs(30),
        #[cfg(feature = "http")]
        Some(crate::relay::sink::SinkSpec::Http(_)) => Duration::from_secs(30),
        _ => Duration::ZERO,
    };
    let wanted = crate::relay::liveness::idle_timeout(in_flight);
    Ok(if ms > 0 && ms < fmt::ms(wanted) {
        Check::warn(
            NAME,
            format!(
                "{shown} (from {source}), shorter than a relay batch's transaction needs ({}): the relay keeps the shorter one, confirms its transaction before events more often, and a delivery slower than it ends the relay's session (the batch is published again: at least once)",
                fmt::duration(wanted)
            ),
            format!(
                "ALTER ROLE {} RESET idle_in_transaction_session_timeout; (or set it to at least {}): the relay sets its own per batch, SET LOCAL",
                ctx.role_sql(),
                fmt::duration(wanted)
            ),
        )
    } else if ms == 0 {
        Check::ok(
            NAME,
            format!(
                "0 (none, from {source}); the relay sets {} for each batch's transaction",
                fmt::duration(wanted)
            ),
        )
    } else {
        Check::ok(
            NAME,
            format!(
                "{shown} (from {source}): enough for a relay batch ({})",
                fmt::duration(wanted)
            ),
        )
    })
}

/// `max_connections`: every holder and waiter keeps a connection, a relay one or two.
pub async fn max_connections(ctx: &Ctx, ledger: Option<&Ledger>) -> Result<Check> {
    const NAME: &str = "max_connections";
    let look = async {
        let row = ctx
            .client()
            .query_typed_one(
                "SELECT current_setting('max_connections')::int8 AS max,
                        current_setting('superuser_reserved_connections')::int8 AS reserved,
                        (SELECT count(*) FROM pg_stat_activity
                          WHERE backend_type = 'client backend' OR backend_type IS NULL) AS used",
                &[],
            )
            .await?;
        let census = if super::tables_exist(ledger) {
            crate::store::leases::census(ctx.client(), &ctx.db.schema)
                .await
                .ok()
        } else {
            None
        };
        anyhow::Ok((
            row.try_get::<_, i64>("max")?,
            row.try_get::<_, i64>("reserved")?,
            row.try_get::<_, i64>("used")?,
            census,
        ))
    };
    let (max, reserved, used, census) = match read_only(ctx.client(), look).await {
        Ok(v) => v,
        Err(e) => return could_not(ctx, NAME, "read max_connections", e),
    };
    let usable = (max - reserved).max(0);
    let free = (usable - used).max(0);
    let now = census.map_or(String::new(), |c| {
        format!(
            "; leasectl's callers now: {} holder(s) and {} waiter(s), one connection each (a relay takes one, two while it drains)",
            c.holders, c.waiters
        )
    });
    let pooled = if ctx.db.pooling() == Pooling::Pooled {
        "; behind the pooler, its pool size and max_client_conn bound leasectl's callers first"
    } else {
        ""
    };
    let detail = format!("{used} of {usable} in use ({max} less {reserved} reserved for superusers), {free} free{now}{pooled}");
    let fix = "raise max_connections, or put the callers behind a pooler in transaction mode (docs/OPERATIONS.md, \"Behind a connection pooler\")";
    Ok(match ctx.opts.connections {
        Some(n) if i64::from(n) > free => Check::warn(
            NAME,
            format!("{detail}: fewer than the {n} your callers open at their peak (--connections); one that finds none gets \"too many clients\" and retries within --wait, or exits 69"),
            fix,
        ),
        None if free < (usable / 10).max(5) => Check::warn(
            NAME,
            format!("{detail}: close to the limit; a caller that finds none gets \"too many clients\" and retries within --wait, or exits 69"),
            fix,
        ),
        Some(n) => Check::ok(NAME, format!("{detail}: room for the {n} your callers open (--connections)")),
        None => Check::ok(NAME, format!("{detail} (--connections N checks room for your peak)")),
    })
}

/// `notify_queue`: the outbox's trigger and every release NOTIFY; a full queue makes those
/// commits fail.
pub async fn notify_queue(ctx: &Ctx) -> Result<Check> {
    const NAME: &str = "notify_queue";
    let row = ctx
        .client()
        .query_typed_one("SELECT pg_notification_queue_usage() AS usage", &[])
        .await;
    let usage: f64 = match row.and_then(|r| r.try_get("usage")) {
        Ok(u) => u,
        Err(e) => return could_not(ctx, NAME, "read pg_notification_queue_usage()", e.into()),
    };
    let pct = format!("{:.1}%", usage * 100.0);
    let why = "a session that LISTENs and sits in a long transaction (or is stopped) keeps the queue from draining; once it is full, NOTIFY fails and with it every outbox insert and release that sends one";
    let fix = "find the LISTENing session with the oldest xact_start in pg_stat_activity and end its transaction";
    Ok(if usage >= 0.5 {
        Check::fail(NAME, format!("the NOTIFY queue is {pct} full: {why}"), fix)
    } else if usage >= 0.1 {
        Check::warn(NAME, format!("the NOTIFY queue is {pct} full: {why}"), fix)
    } else {
        Check::ok(NAME, format!("the NOTIFY queue is {pct} full"))
    })
}

/// `failover`: docs/OPERATIONS.md's rule — a running holder survives a failover only if a
/// heartbeat reaches the new primary within its stop budget, so TTL − heartbeat − kill-after
/// (less the margin for SIGKILL) must cover the failover time.
pub fn failover(opts: &super::Options) -> Check {
    const NAME: &str = "failover";
    let (ttl, given) = match opts.ttl {
        Some(t) => (t, "--ttl"),
        None => (Duration::from_secs(120), "run's default --ttl"),
    };
    let (heartbeat, kill_after) = match crate::config::times(ttl, opts.heartbeat, opts.kill_after) {
        Ok(t) => t,
        Err(e) => {
            return Check::fail(
                NAME,
                format!("{e:#}: `run` refuses these durations"),
                "choose a longer --ttl, or a shorter --heartbeat or --kill-after",
            )
        }
    };
    let budget = survivable(ttl, heartbeat, kill_after);
    let (failover, assumed) = match opts.failover_time {
        Some(f) => (f, "--failover-time"),
        None => (
            DEFAULT_FAILOVER_TIME,
            "assumed; --failover-time DUR gives yours",
        ),
    };
    let d = fmt::duration;
    let detail = format!(
        "{given} {}, heartbeat {}, kill-after {}: a running holder outlasts a failover of up to {} (TTL − heartbeat − kill-after − {} for the SIGKILL to land); failover time {} ({assumed})",
        d(ttl), d(heartbeat), d(kill_after), d(budget), d(ttl.saturating_sub(kill_after).saturating_sub(crate::model::time::stop_budget(ttl, kill_after))), d(failover)
    );
    if budget > failover {
        return Check::ok(NAME, detail);
    }
    let fix = match enough_ttl(opts, failover) {
        Some(t) => format!("run with --ttl {} or longer (or make the failover faster)", d(t)),
        None => "raise --ttl (and shorten --heartbeat and --kill-after) until TTL − heartbeat − kill-after exceeds the failover time".to_owned(),
    };
    Check::warn(
        NAME,
        format!("{detail}: a failover that long stops every running holder's command (exit 76, recorded `lost`) before a heartbeat can reach the new primary"),
        fix,
    )
}

/// How long a failover a holder outlasts in the worst case: the primary dies just after a
/// heartbeat was confirmed, and the next one is sent a heartbeat later.
fn survivable(ttl: Duration, heartbeat: Duration, kill_after: Duration) -> Duration {
    crate::model::time::stop_budget(ttl, kill_after).saturating_sub(heartbeat)
}

/// The shortest whole-second TTL (with the given --heartbeat and --kill-after, or their
/// defaults for it) whose holders outlast `failover`.
fn enough_ttl(opts: &super::Options, failover: Duration) -> Option<Duration> {
    (1..=86_400u64).map(Duration::from_secs).find(|&ttl| {
        crate::config::times(ttl, opts.heartbeat, opts.kill_after)
            .is_ok_and(|(h, k)| survivable(ttl, h, k) > failover)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(ttl: Option<u64>, failover: Option<u64>) -> super::super::Options {
        super::super::Options {
            ttl: ttl.map(Duration::from_secs),
            heartbeat: None,
            kill_after: None,
            failover_time: failover.map(Duration::from_secs),
            connections: None,
            sink: None,
            sink_timeout: Duration::from_secs(10),
            check_deadline: Duration::from_secs(10),
        }
    }

    #[test]
    fn the_failover_budget_is_ttl_less_heartbeat_kill_after_and_margin() {
        // 2m: heartbeat 30s, kill-after 10s, margin 0.5s.
        assert_eq!(
            survivable(
                Duration::from_secs(120),
                Duration::from_secs(30),
                Duration::from_secs(10)
            ),
            Duration::from_millis(79_500)
        );
        assert_eq!(failover(&opts(None, None)).status, super::super::Status::Ok);
        let short = failover(&opts(Some(10), Some(20)));
        assert_eq!(short.status, super::super::Status::Warn);
        // 30s: heartbeat 7.5s, kill-after 3s, margin 0.5s leave 19s; 31s leaves 19.7s; …
        let t = enough_ttl(&opts(Some(10), Some(20)), Duration::from_secs(20)).unwrap();
        let (h, k) = crate::config::times(t, None, None).unwrap();
        assert!(survivable(t, h, k) > Duration::from_secs(20));
        assert!(short.fix.unwrap().contains(&fmt::duration(t)), "{t:?}");
        assert_eq!(
            failover(&opts(Some(1), Some(1))).status,
            super::super::Status::Warn
        );
    }
}
