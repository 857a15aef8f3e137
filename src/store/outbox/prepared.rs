//! The claim's statements prepared once per connection ([`Prepared`]): parsed and planned once,
//! then only bound and executed for every batch.
//!
//! Only for a connection that reaches its own server session: behind a transaction-mode pooler
//! each transaction may run on another server connection, where a named statement is missing
//! or already exists, so there the claim stays an unnamed statement ("No session state" in
//! [`super`]). A cache belongs to one connection: whoever replaces the connection forgets it
//! ([`Prepared::forget`]); a statement the server no longer knows is forgotten too and the
//! claim is sent unnamed once more (see [`super::claim()`]), so a cache that outlived its
//! connection costs one retry, never the batch.

use std::cell::RefCell;

use tokio_postgres::types::Type;
use tokio_postgres::{Client, Statement};

use crate::model::order::Order;

/// Which statement of a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Key {
    /// The general claim or the plain one, for an order.
    Claim { order: Order, plain: bool },
    /// The batch transaction's idle timeout (`SET_IDLE`).
    SetIdle,
    /// The read of the plain claim's verdict (`PLAIN_VERDICT`).
    Verdict,
}

/// The claim statements prepared on one connection (at most six: two claims for each of two
/// orders, the idle timeout's and the verdict's).
#[derive(Default)]
pub struct Prepared {
    // A RefCell, never borrowed across an await: the relay's claims on its two connections
    // each have a cache of their own, and a statement is cloned out (it is reference-counted).
    statements: RefCell<Vec<(Key, Statement)>>,
}

impl Prepared {
    /// Forgets every statement: for a connection that was closed or replaced.
    pub fn forget(&self) {
        self.statements.borrow_mut().clear();
    }

    /// How many statements are prepared (for tests).
    pub fn len(&self) -> usize {
        self.statements.borrow().len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The statement for `key` on `client`, prepared from the text `sql` makes, with parameter
    /// `types`, the first time it is asked for (the text is spliced only then).
    pub(super) async fn statement(
        &self,
        client: &Client,
        key: Key,
        sql: impl FnOnce() -> String,
        types: &[Type],
    ) -> Result<Statement, tokio_postgres::Error> {
        let known = self
            .statements
            .borrow()
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, s)| s.clone());
        if let Some(statement) = known {
            return Ok(statement);
        }
        // Named, so it must never reach a pooler: the relay gives a cache only to a connection
        // that reaches its own server session (see the module documentation).
        #[allow(clippy::disallowed_methods)]
        let statement = client.prepare_typed(&sql(), types).await?;
        self.statements.borrow_mut().push((key, statement.clone()));
        Ok(statement)
    }
}
