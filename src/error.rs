//! The typed failures that decide an exit code other than "internal error".
//!
//! A leaf module: the layers that raise these (config, db) need not know the exit codes, and
//! [`crate::exit`], which maps errors to codes, may look into the database's errors without
//! `db` and `exit` importing each other.

use std::fmt;

/// A typed error for the failures whose exit code is not "internal error".
///
/// Everything else travels as an `anyhow::Error` with context and ends in
/// [`Exit::Internal`](crate::exit::Exit::Internal).
#[derive(Debug)]
pub enum Failure {
    /// Bad flag, duration, target or schema name (exit 2).
    Usage(String),
    /// The database could not be reached, or could not take the connection now (exit 69).
    Unavailable(String),
    /// The server refused *us*: authentication, an unknown role or database (exit 69 too, but
    /// waiting will not help).
    Refused(String),
    /// The database schema was written by a newer leasectl, or a migration applied to it differs
    /// from this binary's (exit 78).
    SchemaTooNew(String),
    /// The role lacks a privilege leasectl needs, or may not create or upgrade the schema
    /// (exit 77). The message names the privilege and the object, and who can fix it.
    Permission(String),
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Usage(m)
            | Failure::Unavailable(m)
            | Failure::Refused(m)
            | Failure::SchemaTooNew(m)
            | Failure::Permission(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for Failure {}

/// Shorthand for a usage error as an `anyhow::Error`.
pub fn usage(msg: impl Into<String>) -> anyhow::Error {
    Failure::Usage(msg.into()).into()
}

/// The database's "permission denied" (SQLSTATE 42501, insufficient_privilege) somewhere in
/// `err`'s chain, unless a typed [`Failure`] comes first (then the error was explained already).
///
/// The one classifier of privilege errors: [`crate::exit::Exit::from_error`] maps what it finds
/// to exit 77, and `cmd::dispatch` has it rewritten into a [`Failure::Permission`] that names the
/// privilege, the object and the fix.
pub fn permission_denied(err: &anyhow::Error) -> Option<&tokio_postgres::error::DbError> {
    for cause in err.chain() {
        if cause.is::<Failure>() {
            return None;
        }
        if let Some(db) = cause
            .downcast_ref::<tokio_postgres::Error>()
            .and_then(tokio_postgres::Error::as_db_error)
        {
            if *db.code() == tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE {
                return Some(db);
            }
        }
    }
    None
}
