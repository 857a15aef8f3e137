//! How a tokio-postgres error reads in one line, and whether it means "unreachable or refused"
//! (exit 69) rather than a bug or bad data (exit 70).

use tokio_postgres::error::SqlState;

/// One attempt's failure in a few words: the server's message, or the innermost cause
/// ("Connection refused"), without the wrapper's "error connecting to server".
pub(super) fn brief_reason(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return db.message().to_owned();
    }
    let mut inner = None;
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        inner = Some(s.to_string());
        source = s.source();
    }
    let top = e.to_string();
    let Some(inner) = inner else {
        return top;
    };
    let inner = match inner.find(" (os error ") {
        Some(i) => inner[..i].to_owned(),
        None => inner,
    };
    if top == "error connecting to server" || top == "error communicating with the server" {
        inner
    } else {
        format!("{top}: {inner}")
    }
}

/// The most useful one-line reason inside a tokio-postgres error.
pub fn reason(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return db.message().to_owned();
    }
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg = format!("{msg}: {s}");
        source = s.source();
    }
    msg
}

/// True when an error means "the database is unreachable or refused us" (exit 69) rather than
/// a bug or bad data (exit 70).
pub fn is_unavailable(e: &tokio_postgres::Error) -> bool {
    if let Some(code) = e.code() {
        let c = code.code();
        return c.starts_with("08") // connection exception
            || c.starts_with("28") // invalid authorization
            || c.starts_with("53") // insufficient resources (too many connections, disk full)
            || c.starts_with("57") // operator intervention: shutdown, statement timeout
            || *code == SqlState::UNDEFINED_DATABASE
            // The server ended the session for sitting idle in a transaction (a relay paused
            // past the timeout): its answer to the next statement is this error, and then the
            // connection is closed — lost like any other.
            || *code == SqlState::IDLE_IN_TRANSACTION_SESSION_TIMEOUT
            // A write refused as read-only: the server is a standby now (a demoted primary
            // after a failover). A fresh connection finds the primary, through
            // `target_session_attrs`, within the caller's usual deadline.
            || *code == SqlState::READ_ONLY_SQL_TRANSACTION;
    }
    if e.is_closed() {
        return true;
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if s.is::<std::io::Error>() {
            return true;
        }
        source = s.source();
    }
    let text = e.to_string();
    text.starts_with("error connecting")
        || text.starts_with("timeout")
        || text.starts_with("error communicating")
}
