//! Upkeep between batches: the backlog the progress line shows, and vacuuming the outbox after
//! heavy draining.

use anyhow::Result;
use tokio::time::Instant;

use super::liveness::{self, bounded, Lost};
use super::Relay;
use crate::db::{self, Db};
use crate::fmt;
use crate::store::outbox;

/// The relay vacuums the outbox after deleting this many rows (autovacuum looks only once a
/// minute, and a fast relay can churn through millions of rows in that time).
const VACUUM_EVERY: u64 = 20_000;

impl Relay {
    /// Reads the backlog for the progress line, when it is due ([`Progress::refresh_backlog`]).
    pub(super) async fn refresh_backlog(&mut self, db: &Db) -> Result<()> {
        let d = self.cfg.statement_deadline;
        bounded(d, "the look at the backlog", async {
            self.progress.refresh_backlog(&db.client, &db.schema).await;
            Ok::<_, anyhow::Error>(())
        })
        .await
    }

    /// Vacuums the outbox after heavy draining so it and its indexes stay small. Best effort:
    /// a role that may not vacuum the table leaves it to autovacuum. A VACUUM unanswered after
    /// [`liveness::VACUUM_DEADLINE`] (a silent server, or a table too large to vacuum in that
    /// time) loses the connection, and this relay leaves the table to autovacuum from then on.
    pub(super) async fn maybe_vacuum(&mut self, db: &Db, delivered: usize) -> Result<(), Lost> {
        self.since_vacuum += delivered as u64;
        if !self.vacuum || self.since_vacuum < VACUUM_EVERY {
            return Ok(());
        }
        self.since_vacuum = 0;
        let started = Instant::now();
        let d = self.cfg.statement_deadline.max(liveness::VACUUM_DEADLINE);
        let Ok(vacuumed) = tokio::time::timeout(d, outbox::vacuum(&db.client, &db.schema)).await
        else {
            self.vacuum = false;
            return Err(Lost(format!(
                "the database did not answer the outbox's VACUUM within {} (this relay leaves it to autovacuum from now on)",
                fmt::duration(d)
            )));
        };
        match vacuumed {
            Ok(true) => info!(
                "vacuumed the outbox in {}",
                fmt::duration(started.elapsed())
            ),
            // Once per relay: the role stays what it is.
            Ok(false) => {
                say!("notice: this role may not VACUUM the outbox (it needs the table's ownership); leaving it to autovacuum");
                self.vacuum = false;
            }
            Err(e) => {
                info!(
                    "cannot vacuum the outbox ({}); leaving it to autovacuum",
                    db::reason(&e)
                );
                self.vacuum = false;
            }
        }
        Ok(())
    }
}
