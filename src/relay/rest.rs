//! Between batches when nothing is due: taking the idle mark ([`wake`]), then sleeping until a
//! NOTIFY, the poll interval, the earliest retry falling due, or a signal.

use std::time::Duration;

use anyhow::Result;
use tokio_util::sync::CancellationToken;

use super::backoff::OUTAGE_BASE;
use super::horizon::HELD_EVERY;
use super::liveness::{best_effort, bounded, Lost};
use super::wake::{self, Take};
use super::Relay;
use crate::db::{self, Db};
use crate::fmt;
use crate::store::outbox;

impl Relay {
    /// Before sleeping: takes the idle mark, then claims once more — whatever committed without
    /// a NOTIFY did so before the mark was taken ([`wake`]) — or sleeps.
    pub(super) async fn rest(&mut self, db: &mut Db, stop: &CancellationToken) -> Result<()> {
        let mut nap = self.cfg.poll;
        if self.held.is_some() {
            nap = nap.min(HELD_EVERY);
        }
        if self.listening {
            let d = self.cfg.statement_deadline;
            let taken = tokio::time::timeout(d, self.mark.take(&db.client, &db.schema)).await;
            match taken {
                Ok(Ok(Take::Taken)) => {
                    self.mark_waits = false;
                    return Ok(());
                }
                // Claim again meanwhile, and retry; said once per episode.
                Ok(Ok(Take::Busy)) => {
                    if !self.mark_waits {
                        self.mark_waits = true;
                        info!("an open transaction that inserted events without a NOTIFY keeps this relay from sleeping on LISTEN; polling every {} until it ends", fmt::duration(wake::TAKE_WAIT));
                    }
                    return Ok(());
                }
                Ok(Ok(Take::Held)) => {}
                // The holder may die or start working: try again soon, so that an
                // unnotified event waits at most this long when this relay is the only one
                // left.
                Ok(Ok(Take::Other)) => nap = nap.min(wake::OTHER_RETRY),
                // Sleep unmarked: the connection is gone (the next claim reconnects), or
                // `--poll` finds the events.
                Ok(Err(e)) => info!("cannot take the idle mark ({})", db::reason(&e)),
                Err(_) => {
                    // The mark may or may not be held now: a new session starts without it.
                    return Err(Lost(format!(
                        "the database did not answer the idle mark within {}",
                        fmt::duration(d)
                    ))
                    .into());
                }
            }
        }
        self.idle(db, stop, nap).await
    }

    /// Waits for a NOTIFY, the poll interval, the earliest retry falling due, or a signal.
    async fn idle(&mut self, db: &mut Db, stop: &CancellationToken, nap: Duration) -> Result<()> {
        let mut wait = nap;
        let d = self.cfg.statement_deadline;
        let retry = outbox::next_retry_in(&db.client, &db.schema);
        match best_effort(d, "the look for retries", retry).await? {
            Some(Some(due)) => wait = wait.min(due.max(Duration::from_millis(10))),
            Some(None) => {}
            // The next claim reports (and recovers from) a lost connection.
            None => return Ok(()),
        }
        self.refresh_backlog(db).await?;
        if let Some(due) = self.progress.backlog_due_in() {
            wait = wait.min(due.max(Duration::from_millis(10)));
        }
        bounded(d, "the metrics' look at the outbox", async {
            self.metrics.refresh(&db.client, &db.schema).await;
            Ok::<_, anyhow::Error>(())
        })
        .await?;
        if let Some(due) = self.metrics.refresh_due_in() {
            wait = wait.min(due.max(Duration::from_millis(10)));
        }
        tokio::select! {
            n = db.notifications.recv() => {
                if n.is_none() {
                    // The connection is gone: let the next claim notice and reconnect, but not
                    // in a tight loop.
                    tokio::time::sleep(OUTAGE_BASE.min(self.cfg.poll)).await;
                }
            }
            _ = tokio::time::sleep(wait) => {}
            _ = stop.cancelled() => {}
        }
        Ok(())
    }
}
