//! The idle mark: how a relay tells the outbox trigger that it sleeps on LISTEN (migration 0007).
//!
//! A NOTIFY makes its transaction's commit take a database-wide lock (the notification queue's)
//! until the commit record is flushed, so notifying writers commit one at a time. The trigger
//! therefore notifies only while some relay holds the *mark*: an exclusive session-level
//! advisory lock keyed on the outbox table. A transaction whose insert found the mark free
//! sends no NOTIFY but keeps the same lock *shared* until it ends.
//!
//! The race this guards against: a relay finds the outbox empty and goes to sleep while a
//! writer, which saw no relay idle and so sent no NOTIFY, has yet to commit. Hence the order
//! (the caller's, in `super::Relay`): take the mark — a blocking request, which waits for
//! every transaction holding the shared lock, i.e. every one that skipped its NOTIFY — then
//! claim once more, then sleep. An event either notifies a relay holding the mark (its insert
//! saw the mark, or queued behind the relay's request: a waiting exclusive request makes the
//! writers' shared probe fail too) or its transaction had ended before the mark was taken, so
//! that claim sees it. LISTEN itself was issued when the relay started, long before.
//!
//! Only one relay can hold the mark. The others sleep without it (a NOTIFY reaches every
//! listener, so they wake too as long as the holder sleeps); a second lock, taken with a
//! non-blocking try, says that some relay already holds or is taking the mark, so they never
//! queue behind it. They try again every [`OTHER_RETRY`] (or `--poll`, if shorter): while the
//! holder works it claims everything anyway, and should it die, one of them holds the mark
//! about a second later.
//!
//! The wait is bounded ([`TAKE_WAIT`]): an application transaction that inserted an event
//! and stays open would otherwise keep the relay from sleeping — and from hearing the NOTIFYs
//! that arrive meanwhile (they are delivered only once its statement ends). A relay whose
//! request times out claims again and retries, so while such a transaction is open the relay
//! polls every [`TAKE_WAIT`].
//!
//! A relay that dies releases its locks with its backend; one cut off without its backend
//! noticing leaves a stale mark until TCP keepalive ends the session, which costs NOTIFYs but
//! never loses a wake-up. Behind a transaction-mode pooler the relay neither listens nor takes
//! the mark (a session lock there would belong to whichever connection ran it).

use std::time::Duration;

use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, SimpleQueryMessage};

use crate::db::Schema;

/// The advisory lock key space (`"leas"` in ASCII) of the mark; the second key is the outbox
/// table's OID. Must match migration 0007's trigger.
const MARK_CLASS: i32 = 0x6c65_6173;

/// The key space of the lock that says some relay holds or is taking the mark.
const TAKER_CLASS: i32 = MARK_CLASS + 1;

/// How long a relay waits at most for the transactions that skipped their NOTIFY before it
/// claims again and retries.
pub const TAKE_WAIT: Duration = Duration::from_millis(100);

/// How long a relay sleeps at most while another holds the mark, before it tries again.
pub const OTHER_RETRY: Duration = Duration::from_secs(1);

/// What [`IdleMark::take`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Take {
    /// This relay now holds the mark, and did not before: claim once more, then sleep.
    Taken,
    /// This relay already held it: sleep.
    Held,
    /// Another relay holds or is taking the mark: sleep without it (until a NOTIFY it gets as
    /// well, or `--poll`).
    Other,
    /// A transaction that skipped its NOTIFY is still open after [`TAKE_WAIT`]: claim again
    /// and retry.
    Busy,
}

/// This relay's side of the mark: whether its session holds it.
#[derive(Debug, Default)]
pub struct IdleMark {
    held: bool,
    key: Option<i32>,
}

impl IdleMark {
    pub fn held(&self) -> bool {
        self.held
    }

    /// A new session holds nothing (after a reconnect).
    pub fn forget(&mut self) {
        self.held = false;
    }

    /// Takes the mark before the relay sleeps; see the module documentation.
    pub async fn take(
        &mut self,
        client: &Client,
        schema: &Schema,
    ) -> Result<Take, tokio_postgres::Error> {
        if self.held {
            return Ok(Take::Held);
        }
        let key = self.key(client, schema).await?;
        let taker = client
            .simple_query(&format!(
                "SELECT pg_try_advisory_lock({TAKER_CLASS}, {key})"
            ))
            .await?;
        if !first_bool(&taker) {
            return Ok(Take::Other);
        }
        // SET LOCAL bounds the wait without touching the session's settings; a session lock
        // taken inside a transaction outlives its COMMIT.
        let taking = client
            .simple_query(&format!(
                "BEGIN;
                 SET LOCAL lock_timeout = '{}ms';
                 SELECT pg_advisory_lock({MARK_CLASS}, {key});
                 COMMIT",
                TAKE_WAIT.as_millis()
            ))
            .await;
        let Err(e) = taking else {
            self.held = true;
            return Ok(Take::Taken);
        };
        let undo = client
            .simple_query(&format!(
                "ROLLBACK; SELECT pg_advisory_unlock({TAKER_CLASS}, {key})"
            ))
            .await;
        if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) {
            undo?;
            return Ok(Take::Busy);
        }
        Err(e)
    }

    /// Gives the mark up when the relay has work again, so that the writers stop notifying.
    /// Session locks are released at once, even inside the batch's transaction.
    pub async fn release(&mut self, client: &Client) -> Result<(), tokio_postgres::Error> {
        let (true, Some(key)) = (self.held, self.key) else {
            return Ok(());
        };
        client
            .simple_query(&format!(
                "SELECT pg_advisory_unlock({MARK_CLASS}, {key}),
                        pg_advisory_unlock({TAKER_CLASS}, {key})"
            ))
            .await?;
        self.held = false;
        Ok(())
    }

    /// The mark's second key: the outbox table's OID, as the trigger has it (a `regclass`
    /// constant there). Looked up once.
    async fn key(
        &mut self,
        client: &Client,
        schema: &Schema,
    ) -> Result<i32, tokio_postgres::Error> {
        if let Some(key) = self.key {
            return Ok(key);
        }
        let row = client
            .query_typed_one(
                "SELECT to_regclass($1)::oid::integer",
                &[(&schema.sql("{s}.outbox"), Type::TEXT)],
            )
            .await?;
        let key: i32 = row.try_get(0)?;
        self.key = Some(key);
        Ok(key)
    }
}

fn first_bool(msgs: &[SimpleQueryMessage]) -> bool {
    msgs.iter().any(|m| match m {
        SimpleQueryMessage::Row(r) => r.get(0) == Some("t"),
        _ => false,
    })
}
