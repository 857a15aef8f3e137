//! `run --slot` when the target is busy: `skip_if_running`.
//!
//! If the holder is doing this very slot, there is nothing left to do — the caller records a
//! `skipped` run and exits with `--done-exit-code` at once, `--wait` or not. Only a holder of an
//! earlier slot (or of none) makes it busy (75), or wait with `--wait`. Which slot an instant
//! belongs to is [`crate::model::slot`]'s.

use std::time::Duration;

/// How long a `--slot` caller that found the target busy gives a live holder that has not said
/// yet which slot it is doing, counted from the holder's acquisition on the database's clock.
/// A `--slot` holder says it in its first statement after the acquisition (a round trip or
/// two); a holder without `--slot` never does, and the caller is then busy after this long.
const UNSAID_PATIENCE: Duration = Duration::from_secs(2);

/// The first pause between two looks at a holder that has not said its slot yet; it doubles up
/// to [`UNSAID_POLL_MAX`].
const UNSAID_POLL: Duration = Duration::from_millis(10);
const UNSAID_POLL_MAX: Duration = Duration::from_millis(160);

/// For a `--slot` caller that found the target busy: records a skip and returns the exit code
/// (`--done-exit-code`) when the lease row says this slot's run is in progress — the holder is
/// doing the same slot of the same schedule, by the database's clock — or that the run named
/// there has just done it (see `store::runs::skip_without_lease`). `None`: busy as without
/// `--slot` (an earlier slot's run, another schedule, no slot at all).
///
/// A holder that took the lease moments ago may not have said its slot yet (it does so when
/// it checks the slot, right after acquiring): it is looked at again, a little later each time,
/// for up to [`UNSAID_PATIENCE`] after its acquisition. The caller's own limits still hold: a
/// signal or `--wait`'s limit ends the wait (the caller runs this inside them).
pub(super) async fn skip_if_running(
    db: &crate::db::Db,
    cfg: &crate::config::RunConfig,
    me: &super::Me,
) -> anyhow::Result<Option<crate::exit::Exit>> {
    use crate::store::runs::{self, SlotCaller, SlotElsewhere};
    let Some(sc) = &cfg.slot else {
        return Ok(None);
    };
    let argv = super::argv(cfg);
    let mut caller = SlotCaller {
        id: uuid::Uuid::new_v4(),
        token: me.token,
        argv: &argv,
        host: &me.host,
        pid: me.pid,
        label: cfg.label.as_deref(),
        schedule: &sc.schedule.expr,
        zone: sc.schedule.zone.as_deref(),
        skew: sc.skew,
        until_success: sc.until_success,
    };
    let mut pause = UNSAID_POLL;
    loop {
        caller.id = uuid::Uuid::new_v4();
        match runs::skip_without_lease(&db.client, &db.schema, &cfg.target, &caller).await? {
            SlotElsewhere::Skipped {
                by,
                fence,
                slot,
                running,
                holder,
            } => {
                let fence = crate::fmt::fence(fence);
                let doing = match (running, holder) {
                    (true, Some(h)) => format!("is being done by run {by} ({h}, fence {fence})"),
                    (true, None) => format!("is being done by run {by} (fence {fence})"),
                    (false, _) => format!("was done by run {by} (fence {fence})"),
                };
                info!(
                    "the slot {} of '{}' {doing}; skipped",
                    crate::fmt::rfc3339(slot),
                    cfg.target
                );
                return Ok(Some(crate::exit::Exit::Code(sc.done_exit_code)));
            }
            SlotElsewhere::Unsaid { held } if held < UNSAID_PATIENCE => {
                tokio::time::sleep(pause.min(UNSAID_PATIENCE - held)).await;
                pause = (pause * 2).min(UNSAID_POLL_MAX);
            }
            SlotElsewhere::Unsaid { .. } | SlotElsewhere::Busy => return Ok(None),
        }
    }
}
