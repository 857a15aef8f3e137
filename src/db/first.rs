//! The first transaction of a connection opened without its schema check ([`Db::unchecked`]):
//! the check, the caller's statement and the LISTEN on the lease channel, sent in one flight
//! and answered in one round trip.
//!
//! tokio-postgres pipelines the requests of one client that are issued before their answers
//! arrive. The flight is `BEGIN` with the schema check ([`super::migrate::begin_if_current`]),
//! the caller's statement, the LISTEN where the session may listen, and `COMMIT`. The check
//! fails unless the ledger is exactly this binary's, which aborts the transaction: then none of
//! it took effect (the acquisition is rolled back with it), and the caller takes the old path,
//! [`super::migrate()`] (which creates, upgrades or refuses) and its statement again. The same
//! holds for any error in the flight: a transaction whose every statement succeeded is the only
//! one that commits.
//!
//! The LISTEN goes in the flight only when the session is known to be direct (see
//! [`super::session`]: `LEASECTL_POOLER=none`). Where that is known only from the check's
//! answer, the heartbeat sends it while the command runs, as it does after waiting.

use std::future::Future;

use anyhow::Result;
use tokio_postgres::SimpleQueryMessage;

use super::{is_unavailable, session, Db, Pooling};
use crate::error::Failure;
use Pooling::{Direct, Pooled};

/// Whether `e` says the database is unavailable (its first typed cause, as the exit code
/// would judge it).
fn lost(e: &anyhow::Error) -> bool {
    for cause in e.chain() {
        if let Some(f) = cause.downcast_ref::<Failure>() {
            return matches!(f, Failure::Unavailable(_) | Failure::Refused(_));
        }
        if cause
            .downcast_ref::<tokio_postgres::Error>()
            .is_some_and(is_unavailable)
        {
            return true;
        }
    }
    false
}

/// How a first transaction ended.
pub enum First<T> {
    /// Committed: the schema is current and the caller's statement took effect. Hand it to
    /// [`Db::accept`], which records what the check found.
    Committed(Committed<T>),
    /// Nothing took effect (the schema is not current, or a statement failed for a reason that
    /// the old path reports better). The schema is still unchecked.
    Redo,
}

/// A first transaction that committed (see [`First::Committed`]).
pub struct Committed<T> {
    value: T,
    /// The LISTEN was sent in the flight.
    listen_sent: bool,
    pooling: Pooling,
}

impl Db {
    /// Runs `work` (statements on this connection that must only take effect on a current
    /// schema) in the first transaction; see the module docs. An answer that says the database
    /// is unavailable is returned as the error; any other failure is [`First::Redo`]. On a
    /// connection whose schema is checked already, this is `work` alone.
    pub async fn first<T>(&self, work: impl Future<Output = Result<T>>) -> Result<First<T>> {
        let Some(known) = self.unchecked else {
            let value = work.await?;
            return Ok(First::Committed(Committed {
                value,
                listen_sent: false,
                pooling: self.pooling,
            }));
        };
        let begin = super::migrate::begin_if_current(&self.schema);
        let channel = self.schema.lease_channel().replace('"', "\"\"");
        let listen = match known {
            Some(Direct) => Some(format!("LISTEN \"{channel}\"")),
            // Not known yet (the check in this flight tells): no LISTEN here, the caller's
            // heartbeat sends it once the session is judged direct, while the command runs.
            // Deciding in the database instead takes a DO block, and loading PL/pgSQL into
            // the fresh server process costs more than the whole rest of the flight.
            Some(Pooled) | None => None,
        };
        let client = &self.client;
        // Polled in this order, each sends its request before any answer is awaited, so the
        // connection writes them in this order and in one flight.
        let (checked, value, listened, committed) = tokio::join!(
            client.simple_query(&begin),
            work,
            async {
                match &listen {
                    Some(sql) => client.batch_execute(sql).await.map(|()| true),
                    None => Ok(false),
                }
            },
            client.batch_execute("COMMIT"),
        );
        // The connection itself failed: the caller's outage handling takes over, as it would
        // for the statement alone.
        let checked = match checked {
            Err(e) if is_unavailable(&e) => return Err(e.into()),
            other => other,
        };
        let listened = match listened {
            Err(e) if is_unavailable(&e) => return Err(e.into()),
            other => other,
        };
        if let Err(e) = committed {
            if is_unavailable(&e) {
                return Err(e.into());
            }
            return Ok(First::Redo);
        }
        let value = match value {
            Ok(v) => v,
            Err(e) if lost(&e) => return Err(e),
            Err(_) => return Ok(First::Redo),
        };
        let (Ok(msgs), Ok(listening)) = (checked, listened) else {
            return Ok(First::Redo);
        };
        let timeout = msgs
            .iter()
            .find_map(|m| match m {
                SimpleQueryMessage::Row(r) => r.get("statement_timeout").map(str::to_owned),
                _ => None,
            })
            .unwrap_or_default();
        Ok(First::Committed(Committed {
            value,
            listen_sent: listening,
            pooling: session::judge(known, &timeout),
        }))
    }

    /// Takes a committed first transaction's result: the schema counts as checked, the session
    /// as direct or pooled as the check found. Also returns whether the connection now listens
    /// on the lease channel.
    pub fn accept<T>(&mut self, committed: Committed<T>) -> (T, bool) {
        self.settle(committed.pooling);
        (committed.value, committed.listen_sent && self.can_listen())
    }
}
