//! Ending a batch: its commit — sent without waiting for the answer when nothing is put back,
//! so that the next claim goes out right behind it — and what a commit that failed or went
//! unanswered means for the events the batch delivered.
//!
//! A batch whose every event was delivered only has to commit, and nothing the relay does next
//! depends on the answer until it publishes again: the upkeep between batches and the next
//! claim go out on the connection behind the COMMIT, and the server runs them one after the
//! other (a round trip per batch less; a tenth of a batch's time when draining to stdout). The
//! answer is awaited ([`Relay::commit_answered`]) once the next claim is back and before any of
//! it is published, before the relay rests or stops, and whenever a connection is given up: a
//! failed commit puts the batch's events back in the outbox, and publishing what the next
//! claim found before knowing that could publish events after ones that now come again. A
//! claim on the *other* connection waits for the answer before it goes out: the server would
//! run it beside the commit, not after it, and find the batch's events still locked (a `--once`
//! pass would take the empty claim for the end of the outbox).

use std::time::Duration;

use anyhow::Result;
use futures_util::FutureExt;
use tokio_util::sync::CancellationToken;

use super::ahead::{Ahead, Conn};
use super::liveness::Lost;
use super::Relay;
use crate::db::{self, Db};
use crate::fmt;
use crate::store::outbox::{self, Claimed, Settle, SettleFailed};

impl Relay {
    /// Ends the batch's transaction on `on`: puts back what was not delivered and commits. With
    /// a full batch all delivered and the relay not stopping, only sends the COMMIT
    /// ([`Ahead::pending`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn settle_batch(
        &self,
        db: &Db,
        ahead: &mut Ahead,
        on: Conn,
        claimed: &[Claimed],
        settled: &[Settle],
        delivered: usize,
        stop: &CancellationToken,
    ) -> Result<()> {
        let d = self.cfg.statement_deadline;
        let client = &ahead.conn(db, on).client;
        // Only a full batch (by count) of events all delivered: then the next claim follows at
        // once, and a round trip is a share of a batch worth saving. A batch cut short by
        // --batch-bytes holds large events, whose transfer dwarfs a round trip; answering its
        // commit first also lets their memory go before the next large batch arrives (the
        // relay's documented bound, tests/it/relay_memory.rs, is exceeded otherwise).
        let full = claimed.len() as i64 == self.cfg.batch;
        if full && delivered == claimed.len() && !stop.is_cancelled() {
            match outbox::commit_later(client).await {
                Ok(commit) => {
                    ahead.pending = Some((commit, delivered, on));
                    return Ok(());
                }
                Err(failed) => {
                    ahead.reset();
                    return Err(commit_failed(delivered, failed));
                }
            }
        }
        let settle = outbox::settle(client, &db.schema, claimed, settled);
        match tokio::time::timeout(d, settle).await {
            Ok(Ok(())) => Ok(()),
            // The batch claimed ahead continues this one, which may not be gone either: its
            // transaction must end uncommitted. Not with a ROLLBACK that could wait on a server
            // gone silent: the caller reconnects the main connection or exits, and this drops
            // the second one; either way the server ends the transaction with its session.
            Ok(Err(failed)) => {
                ahead.reset();
                Err(commit_failed(delivered, failed))
            }
            Err(_) => {
                // The batch claimed ahead ends with the sessions, as above.
                ahead.reset();
                Err(commit_unanswered(delivered, d))
            }
        }
    }

    /// The answer to the last batch's COMMIT, if it is still owed ([`Ahead::pending`]). A commit that
    /// failed (or, with `wait`, did not answer within the statement deadline) is an error, as
    /// it is for a batch that commits at once, and both connections' state is forgotten: what
    /// was claimed since is not published. Without `wait` (the connection has failed already,
    /// and waiting could stretch the relay's exit by another deadline) only an answer already
    /// there is taken; no answer means the commit's outcome is unknown.
    pub(super) async fn commit_answered(&self, ahead: &mut Ahead, wait: bool) -> Result<()> {
        let Some((commit, delivered, _)) = ahead.pending.take() else {
            return Ok(());
        };
        let d = self.cfg.statement_deadline;
        let answered = if wait {
            tokio::time::timeout(d, commit.answer()).await.ok()
        } else {
            commit.answer().now_or_never()
        };
        match answered {
            Some(Ok(())) => Ok(()),
            Some(Err(failed)) => {
                ahead.reset();
                Err(commit_failed(delivered, failed))
            }
            None => {
                ahead.reset();
                Err(commit_unanswered(delivered, d))
            }
        }
    }
}

/// A batch's commit failed: says what it means for the events it delivered, and returns the
/// error. Only "will" when the transaction certainly rolled back: a COMMIT whose answer never
/// came may have committed, and then the events are not published again.
fn commit_failed(delivered: usize, failed: SettleFailed) -> anyhow::Error {
    if delivered > 0 {
        warn!(
            "could not record {delivered} delivered events ({}); {}",
            db::reason(&failed.error),
            if failed.outcome_unknown {
                "the commit's outcome is unknown: they may be published again"
            } else {
                "they will be published again"
            }
        );
    }
    failed.error.into()
}

/// A batch's commit went unanswered within `d`.
fn commit_unanswered(delivered: usize, d: Duration) -> anyhow::Error {
    Lost(format!(
        "the database did not answer the commit of {delivered} delivered events within {}; they may be published again",
        fmt::duration(d)
    ))
    .into()
}
