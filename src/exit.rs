//! Every exit code leasectl can return, in one place.
//!
//! Scripts branch on these numbers (README lists them), so they never change meaning. The
//! child's own status is passed through unchanged: its exit code, or 128+N when a signal ended it,
//! the same convention as the shell and hyperfine's `exit_code.rs`.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;

pub use crate::error::{usage, Failure};

/// The exit codes leasectl returns; each keeps its meaning across releases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Success, or the passed-through status of a stored run.
    Code(u8),
    /// 2: usage error.
    Usage,
    /// 65: the command's `LEASECTL_EVENTS` were malformed or too large; the run was stored
    /// without them.
    DataError,
    /// 69: database unreachable or it rejected the connection.
    Unavailable,
    /// 70: internal error.
    Internal,
    /// 75 by default: another holder has a live lease (`--busy-exit-code` overrides it).
    Busy(u8),
    /// 76: the lease was lost during the run; the child was stopped; nothing but a `lost` record stored.
    LeaseLost,
    /// 77: the role lacks a privilege it needs, or may not create or upgrade the schema.
    NoPermission,
    /// 78: the database schema is newer than this binary, or was migrated differently.
    SchemaTooNew,
    /// 124: `--timeout` expired.
    TimedOut,
    /// 126: the command exists but could not be executed.
    NotExecutable,
    /// 127: the command was not found.
    NotFound,
}

impl Exit {
    pub const USAGE: u8 = 2;
    pub const DATA_ERROR: u8 = 65;
    pub const UNAVAILABLE: u8 = 69;
    pub const INTERNAL: u8 = 70;
    pub const BUSY: u8 = 75;
    pub const LEASE_LOST: u8 = 76;
    pub const NO_PERMISSION: u8 = 77;
    pub const SCHEMA_TOO_NEW: u8 = 78;
    pub const TIMED_OUT: u8 = 124;
    pub const NOT_EXECUTABLE: u8 = 126;
    pub const NOT_FOUND: u8 = 127;

    /// The number the process exits with.
    pub fn code(self) -> u8 {
        match self {
            Exit::Code(c) | Exit::Busy(c) => c,
            Exit::Usage => Self::USAGE,
            Exit::DataError => Self::DATA_ERROR,
            Exit::Unavailable => Self::UNAVAILABLE,
            Exit::Internal => Self::INTERNAL,
            Exit::LeaseLost => Self::LEASE_LOST,
            Exit::NoPermission => Self::NO_PERMISSION,
            Exit::SchemaTooNew => Self::SCHEMA_TOO_NEW,
            Exit::TimedOut => Self::TIMED_OUT,
            Exit::NotExecutable => Self::NOT_EXECUTABLE,
            Exit::NotFound => Self::NOT_FOUND,
        }
    }

    /// The exit code for a leasectl that received signal `signo`: 128+N.
    pub fn from_signal(signo: i32) -> Exit {
        Exit::Code(signal_code(signo))
    }

    /// Maps an error to its exit code: typed failures to theirs, the database's "permission
    /// denied" to 77, everything else to 70.
    pub fn from_error(err: &anyhow::Error) -> Exit {
        if crate::error::permission_denied(err).is_some() {
            return Exit::NoPermission;
        }
        for cause in err.chain() {
            if let Some(f) = cause.downcast_ref::<Failure>() {
                return match f {
                    Failure::Usage(_) => Exit::Usage,
                    Failure::Unavailable(_) | Failure::Refused(_) => Exit::Unavailable,
                    Failure::SchemaTooNew(_) => Exit::SchemaTooNew,
                    Failure::Permission(_) => Exit::NoPermission,
                };
            }
            if let Some(e) = cause.downcast_ref::<tokio_postgres::Error>() {
                if crate::db::is_unavailable(e) {
                    return Exit::Unavailable;
                }
            }
        }
        Exit::Internal
    }
}

/// 128+N, saturating at 255 (signal numbers on Linux stop at 64).
pub fn signal_code(signo: i32) -> u8 {
    u8::try_from(128 + signo.clamp(0, 127)).unwrap_or(255)
}

/// How a child process ended, in the form runs are stored and exit codes derived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildStatus {
    /// Exited by itself with this code.
    Exited(i32),
    /// Ended by this signal.
    Signaled(i32),
}

impl ChildStatus {
    pub fn from_exit_status(status: ExitStatus) -> ChildStatus {
        match (status.code(), status.signal()) {
            (Some(code), _) => ChildStatus::Exited(code),
            (None, Some(sig)) => ChildStatus::Signaled(sig),
            // Neither code nor signal only happens for stopped/continued states, which `wait`
            // does not report; treat it as a generic failure rather than panic.
            (None, None) => ChildStatus::Exited(1),
        }
    }

    /// The exit code leasectl passes through: the child's code, or 128+N for signal N.
    pub fn exit_code(self) -> u8 {
        match self {
            ChildStatus::Exited(code) => (code & 0xff) as u8,
            ChildStatus::Signaled(sig) => signal_code(sig),
        }
    }

    /// The `exit_code` column / payload field: `None` when a signal ended the child.
    pub fn code(self) -> Option<i32> {
        match self {
            ChildStatus::Exited(c) => Some(c),
            ChildStatus::Signaled(_) => None,
        }
    }

    /// The `signal` column / payload field.
    pub fn signal(self) -> Option<i32> {
        match self {
            ChildStatus::Exited(_) => None,
            ChildStatus::Signaled(s) => Some(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_map_to_128_plus_n() {
        assert_eq!(ChildStatus::Signaled(9).exit_code(), 137);
        assert_eq!(ChildStatus::Signaled(15).exit_code(), 143);
        assert_eq!(ChildStatus::Exited(7).exit_code(), 7);
        assert_eq!(ChildStatus::Exited(256 + 3).exit_code(), 3);
        assert_eq!(Exit::from_signal(2).code(), 130);
    }

    #[test]
    fn typed_failures_pick_their_code() {
        let e = anyhow::Error::from(Failure::Unavailable("x".into())).context("connecting");
        assert_eq!(Exit::from_error(&e), Exit::Unavailable);
        assert_eq!(Exit::from_error(&usage("bad")), Exit::Usage);
        assert_eq!(Exit::from_error(&anyhow::anyhow!("boom")), Exit::Internal);
        let denied = anyhow::Error::from(Failure::Permission("x".into()));
        assert_eq!(Exit::from_error(&denied).code(), 77);
    }
}
