//! Claiming ahead: while batches come back full and publishing is the slower part, the next
//! batch is claimed on the other connection while this one is published (see the relay's module
//! documentation and "Claiming ahead" in [`outbox`]).

use std::time::Duration;

use anyhow::Result;
use tokio::time::Instant;

use super::liveness::{bounded, Lost, Open};
use super::Relay;
use crate::db::{Db, Pooling};
use crate::store::outbox::{self, Claimed, PendingCommit, Prepared, Session};

/// After the second connection could not be opened, how long the relay claims one batch at a
/// time before it tries again.
const SPARE_RETRY: Duration = Duration::from_secs(60);

/// Which of the relay's connections a batch's transaction is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Conn {
    /// The one the relay connected with: LISTEN, the idle mark, and a batch claimed normally.
    Main,
    /// The second one, opened for claiming ahead.
    Spare,
}

impl Conn {
    pub(super) fn other(self) -> Conn {
        match self {
            Conn::Main => Conn::Spare,
            Conn::Spare => Conn::Main,
        }
    }
}

/// The second connection, and the batch claimed ahead on one of the two while the batch before
/// it was published (see the module documentation and "Claiming ahead" in [`outbox`]).
///
/// A batch claimed ahead is kept only if every event of the batch before it was delivered, the
/// relay is not stopping, and it is not empty; otherwise it is rolled back before that batch
/// commits. Claiming ahead is only done on direct connections: behind a transaction-mode pooler
/// the second transaction could wait for a server connection that only the first one's commit
/// frees, and the first commits only after the second was claimed.
#[derive(Default)]
pub(super) struct Ahead {
    /// Opened when first needed; dropped when a statement on it failed (opened again later).
    pub(super) spare: Option<Db>,
    /// The next batch.
    pub(super) next: Option<Next>,
    /// The last batch's COMMIT, sent and not answered yet, how many events that batch
    /// delivered, and the connection it went out on (see `commit.rs`).
    pub(super) pending: Option<(PendingCommit, usize, Conn)>,
    /// When opening the second connection last failed: not tried again for [`SPARE_RETRY`].
    pub(super) failed_at: Option<Instant>,
    /// The claim statements prepared on each connection: forgotten with the connection.
    main_prepared: Prepared,
    spare_prepared: Prepared,
}

/// A claimed batch and its transaction.
pub(super) struct Next {
    /// The connection its transaction is on.
    pub(super) conn: Conn,
    pub(super) events: Vec<Claimed>,
    /// How long its claim took.
    pub(super) took: Duration,
    /// When the last statement of its transaction that the server answered was sent (its
    /// claim, or a later check), and the idle timeout its claim set: see [`Open`].
    pub(super) confirmed: Instant,
    pub(super) idle: Duration,
}

impl Ahead {
    pub(super) fn conn<'a>(&'a self, db: &'a Db, conn: Conn) -> &'a Db {
        match conn {
            Conn::Main => db,
            Conn::Spare => self
                .spare
                .as_ref()
                .expect("a batch on the second connection"),
        }
    }

    /// A connection as the claim needs it: with its prepared statements, unless it goes
    /// through a transaction-mode pooler (where only unnamed statements work).
    pub(super) fn session<'a>(&'a self, db: &'a Db, conn: Conn) -> Session<'a> {
        let on = self.conn(db, conn);
        let prepared = match conn {
            Conn::Main => &self.main_prepared,
            Conn::Spare => &self.spare_prepared,
        };
        Session {
            client: &on.client,
            schema: &on.schema,
            prepared: (on.pooling() == Pooling::Direct).then_some(prepared),
        }
    }

    /// The connection without a batch's transaction open: where the relay's statements between
    /// batches go.
    pub(super) fn free<'a>(&'a self, db: &'a Db) -> &'a Db {
        match (&self.next, &self.spare) {
            (
                Some(Next {
                    conn: Conn::Main, ..
                }),
                Some(spare),
            ) => spare,
            _ => db,
        }
    }

    /// Rolls back the batch claimed ahead, if any: its events are back in the outbox as they
    /// were. A failure on the main connection is returned (the relay then reconnects, which
    /// ends that transaction too); the second connection is simply dropped.
    pub(super) async fn roll_back(&mut self, db: &Db, deadline: Duration) -> Result<()> {
        let Some(next) = self.next.take() else {
            return Ok(());
        };
        let client = &self.conn(db, next.conn).client;
        match bounded(deadline, "a rollback", outbox::rollback(client)).await {
            Err(e) if next.conn == Conn::Main => Err(e),
            Err(_) => {
                self.failed(next.conn);
                Ok(())
            }
            Ok(()) => Ok(()),
        }
    }

    /// A statement on `conn` failed: the second connection is closed (and opened again when
    /// next needed; the server ends its transaction once it notices); a main connection that
    /// failed tells at its next statement.
    pub(super) fn failed(&mut self, conn: Conn) {
        if conn == Conn::Spare {
            if let Some(spare) = self.spare.take() {
                spare.close_now();
            }
            self.spare_prepared.forget();
        }
    }

    /// Forgets both transactions' connection state after a failure: the second connection is
    /// closed (the server rolls back whatever was open on it); the main one is reconnected by
    /// the caller, so its prepared statements are forgotten too.
    pub(super) fn reset(&mut self) {
        self.next = None;
        self.pending = None;
        self.failed(Conn::Spare);
        self.main_prepared.forget();
    }
}

/// Whether claiming the next batch ahead pays, from how long the last batch's claim and
/// publication took (`None`: no batch yet, and a sink that does not block the relay tries):
/// only where publishing is the slower part.
pub(super) fn worth_claiming_ahead(took: Option<(Duration, Duration)>) -> bool {
    took.is_none_or(|(claim, publish)| publish > claim)
}

impl Relay {
    /// The batch claimed ahead, if its transaction is still open. It waited while the batch
    /// before it was published, and its session may have ended meanwhile (by the idle timeout
    /// while this relay was paused, say): its events are then back in the outbox, for any relay
    /// to claim, and must not be published from here. Known without a round trip within the
    /// transaction's window ([`Open`]), with one past it. Lost on the second connection, it is
    /// claimed again; on the main one, that connection is lost too ([`Lost`]).
    pub(super) async fn still_open(
        &self,
        db: &Db,
        ahead: &mut Ahead,
        mut next: Next,
    ) -> Result<Option<Next>> {
        let d = self.cfg.statement_deadline;
        let why = {
            let client = &ahead.conn(db, next.conn).client;
            let open = Open::new(client, next.confirmed, next.idle, self.in_flight, d);
            if open.may_publish().await {
                next.confirmed = open.confirmed();
                return Ok(Some(next));
            }
            open.lost().unwrap_or_default()
        };
        if next.conn == Conn::Main {
            return Err(Lost(format!(
                "the batch claimed ahead was lost with its session ({why})"
            ))
            .into());
        }
        info!("the batch claimed ahead was lost with its session ({why}); claiming again");
        ahead.failed(next.conn);
        Ok(None)
    }

    /// Whether the next batch can be claimed ahead on `conn`: the main connection is always
    /// there; the second is opened when first needed. Neither behind a transaction-mode pooler
    /// (see [`Ahead`]).
    pub(super) async fn ready_to_claim_ahead(
        &mut self,
        db: &Db,
        ahead: &mut Ahead,
        conn: Conn,
    ) -> Option<Conn> {
        if !db.can_listen() {
            return None;
        }
        if conn == Conn::Main || ahead.spare.is_some() {
            return Some(conn);
        }
        if ahead.failed_at.is_some_and(|t| t.elapsed() < SPARE_RETRY) {
            return None;
        }
        match db.another().await {
            Ok(spare) => {
                ahead.spare = Some(spare);
                ahead.spare_prepared.forget();
                ahead.failed_at = None;
                Some(conn)
            }
            Err(e) => {
                if ahead.failed_at.is_none() {
                    warn!(
                        "cannot open a second database connection ({e:#}); claiming one batch at a time"
                    );
                }
                ahead.failed_at = Some(Instant::now());
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claiming_ahead_pays_only_where_publishing_is_slower_than_claiming() {
        let ms = Duration::from_millis;
        assert!(worth_claiming_ahead(None), "the first batch tries");
        assert!(worth_claiming_ahead(Some((ms(8), ms(60)))), "a broker");
        assert!(!worth_claiming_ahead(Some((ms(8), ms(1)))), "stdout");
        assert!(!worth_claiming_ahead(Some((ms(8), ms(8)))));
    }
}
