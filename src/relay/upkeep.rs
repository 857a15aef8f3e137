//! Upkeep between batches: the backlog the progress line shows, and vacuuming the outbox after
//! heavy draining.

use std::time::Duration;

use anyhow::Result;
use futures_util::FutureExt;
use tokio::time::Instant;

use super::liveness::{self, bounded};
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

    /// Vacuums the outbox after heavy draining so it and its indexes stay small: on a
    /// connection of its own, while this relay goes on claiming (the VACUUM reads every index
    /// of the table, about as long as three batches of 1000, and the server has the cores to do
    /// both). One at a time: while one is under way, the next waits for the next
    /// [`VACUUM_EVERY`] events. Best effort: a role that may not vacuum the table leaves it to
    /// autovacuum, and so does a VACUUM unanswered after [`liveness::VACUUM_DEADLINE`] (a silent
    /// server, or a table too large to vacuum in that time); a connection that cannot be opened
    /// is tried again next time.
    pub(super) fn maybe_vacuum(&mut self, db: &Db, delivered: usize) {
        self.since_vacuum += delivered as u64;
        if self.vacuuming.as_ref().is_some_and(|t| t.is_finished()) {
            if let Some(Ok(ended)) = self.vacuuming.take().and_then(|t| t.now_or_never()) {
                self.vacuumed(ended);
            }
        }
        if !self.vacuum || self.vacuuming.is_some() || self.since_vacuum < vacuum_every() {
            return;
        }
        self.since_vacuum = 0;
        let open = db.another();
        let d = self.cfg.statement_deadline.max(liveness::VACUUM_DEADLINE);
        let connect = self.cfg.statement_deadline;
        self.vacuuming = Some(tokio::spawn(async move {
            let started = Instant::now();
            let conn = match tokio::time::timeout(connect, open).await {
                Ok(Ok(conn)) => conn,
                Ok(Err(e)) => return Vacuumed::NoConnection(format!("{e:#}")),
                Err(_) => return Vacuumed::NoConnection("the database did not answer".into()),
            };
            let vacuumed = tokio::time::timeout(d, outbox::vacuum(&conn.client, &conn.schema));
            match vacuumed.await {
                Ok(Ok(true)) => Vacuumed::Done(started.elapsed()),
                Ok(Ok(false)) => Vacuumed::NotAllowed,
                Ok(Err(e)) => Vacuumed::Failed(db::reason(&e)),
                Err(_) => {
                    conn.close_now();
                    Vacuumed::Unanswered(d)
                }
            }
        }));
    }

    /// Takes the outcome of a VACUUM under way once it ended, waiting for it `at_most` (a
    /// `--once` pass before it ends: one statement deadline, the bound every wait on the
    /// database has, where a VACUUM may take its own minute and a silent server longer; a
    /// relay about to rest: not at all). One still running then is left to finish on the
    /// server (a relay that exits drops the connection, which the server notices only once the
    /// VACUUM is done), or its outcome is taken after a later batch.
    pub(super) async fn end_vacuum(&mut self, at_most: Duration) {
        let Some(mut task) = self.vacuuming.take() else {
            return;
        };
        match tokio::time::timeout(at_most, &mut task).await {
            Ok(Ok(ended)) => self.vacuumed(ended),
            Ok(Err(_)) => {}
            Err(_) => {
                if !at_most.is_zero() {
                    info!(
                        "the outbox's VACUUM is still under way after {}; not waiting for it",
                        fmt::duration(at_most)
                    );
                }
                self.vacuuming = Some(task);
            }
        }
    }

    fn vacuumed(&mut self, ended: Vacuumed) {
        match ended {
            Vacuumed::Done(took) => info!("vacuumed the outbox in {}", fmt::duration(took)),
            // Once per relay: the role stays what it is.
            Vacuumed::NotAllowed => {
                say!("notice: this role may not VACUUM the outbox (it needs the table's ownership); leaving it to autovacuum");
                self.vacuum = false;
            }
            Vacuumed::Failed(why) => {
                info!("cannot vacuum the outbox ({why}); leaving it to autovacuum");
                self.vacuum = false;
            }
            Vacuumed::Unanswered(d) => {
                warn!(
                    "the database did not answer the outbox's VACUUM within {}; this relay leaves it to autovacuum from now on",
                    fmt::duration(d)
                );
                self.vacuum = false;
            }
            Vacuumed::NoConnection(why) => info!(
                "cannot open a connection to vacuum the outbox ({why}); trying again after the next {VACUUM_EVERY} events"
            ),
        }
    }
}

/// [`VACUUM_EVERY`], or in debug builds `LEASECTL_TEST_VACUUM_EVERY` (the chaos suite's relays
/// vacuum every few hundred events, so that a VACUUM is under way in its rounds' faults).
fn vacuum_every() -> u64 {
    crate::config::test_count("LEASECTL_TEST_VACUUM_EVERY").unwrap_or(VACUUM_EVERY)
}

/// How a VACUUM of the outbox on its own connection ended ([`Relay::maybe_vacuum`]).
pub(super) enum Vacuumed {
    Done(Duration),
    /// The role may not vacuum the table.
    NotAllowed,
    /// The VACUUM failed: why.
    Failed(String),
    /// Not answered within this deadline.
    Unanswered(Duration),
    /// Its connection could not be opened: why.
    NoConnection(String),
}
