//! `outbox`: the backlog, dead events and the oldest pending one; `xmin_horizon`: who holds
//! back the horizon VACUUM needs to clean up after the relay. Both read what the relay itself
//! reads ([`crate::store::outbox::backlog`], [`crate::store::outbox::horizon_holders`]).

use std::time::Duration;

use anyhow::Result;

use super::{could_not, read_only, Check, Ctx};
use crate::db::migrate::Ledger;
use crate::fmt;
use crate::store::outbox;

/// A pending event older than this means no relay is draining the outbox, or its sink refuses.
const STALE: Duration = Duration::from_secs(300);

/// A transaction open this long while holding the xmin horizon is reported.
const HORIZON_AGE: Duration = Duration::from_secs(60);

pub async fn backlog(ctx: &Ctx, ledger: Option<&Ledger>) -> Result<Check> {
    if !super::tables_exist(ledger) {
        return Ok(Check::warn(
            "outbox",
            "not checked: the schema has no leasectl tables yet",
            "see `schema`",
        ));
    }
    let b = match read_only(ctx.client(), outbox::backlog(ctx.client(), &ctx.db.schema)).await {
        Ok(b) => b,
        Err(e) => return could_not(ctx, "outbox", "read the outbox backlog", e),
    };
    let oldest = b
        .oldest_pending_ms
        .map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0)));
    let detail = format!(
        "{} pending ({} retrying), {} dead, oldest pending {}",
        b.pending,
        b.retrying,
        b.dead,
        oldest.map_or_else(
            || "none".to_owned(),
            |o| format!("{} old", fmt::duration(o))
        )
    );
    let stale = oldest.is_some_and(|o| o > STALE);
    let cmd = |args: &str| crate::db::migrate::grants::leasectl_command(&ctx.db.schema, args);
    Ok(match (b.dead > 0, stale) {
        (false, false) => Check::ok("outbox", detail),
        (true, _) => Check::warn(
            "outbox",
            format!("{detail}: {} dead event(s) each hold back the later events of their aggregate until retried or discarded", b.dead),
            format!(
                "see them with `{}`, then `{}` (once the sink takes them) or `{}`",
                cmd("outbox list --dead"),
                cmd("outbox retry --all-dead"),
                cmd("outbox discard ID")
            ),
        ),
        (false, true) => Check::warn(
            "outbox",
            format!("{detail}: no relay is draining the outbox, or its sink refuses the events"),
            format!("run `{}` (see its log for refusals)", cmd("relay --sink SINK")),
        ),
    })
}

pub async fn horizon(ctx: &Ctx) -> Result<Check> {
    let look = outbox::horizon_holders(ctx.client(), fmt::ms(HORIZON_AGE));
    let holders = match read_only(ctx.client(), look).await {
        Ok(h) => h,
        Err(e) => return could_not(ctx, "xmin_horizon", "read pg_stat_activity", e),
    };
    if let Some(h) = holders.first() {
        let pid = h.pid.map_or_else(
            || "the backend".to_owned(),
            |p| format!("SELECT pg_terminate_backend({p})"),
        );
        return Ok(Check::warn(
            "xmin_horizon",
            format!(
                "a snapshot {} transactions old holds back the xmin horizon: {}; VACUUM cannot remove the outbox rows relays delete meanwhile, and every claim wades through them",
                h.xmin_age.unwrap_or(0),
                crate::relay::describe(h)
            ),
            format!("end that transaction (commit, roll back, or {pid}) and find why it stays open"),
        ));
    }
    if !ctx.sees_all {
        return Ok(Check::warn(
            "xmin_horizon",
            format!(
                "no session this role can see has held a snapshot open for {}; other roles' sessions are hidden from role {}",
                fmt::duration(HORIZON_AGE),
                ctx.role_sql()
            ),
            format!("GRANT pg_monitor TO {}; or run doctor as a member of pg_monitor", ctx.role_sql()),
        ));
    }
    Ok(Check::ok(
        "xmin_horizon",
        format!(
            "no transaction has held back the xmin horizon for {} or more",
            fmt::duration(HORIZON_AGE)
        ),
    ))
}
