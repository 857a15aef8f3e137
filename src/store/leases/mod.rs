//! The `leases` table: the heartbeat lease, as plain SQL judged by the database clock, one
//! concern per file: `acquire.rs` takes a place (free, expired, under `--max-holders`, or by
//! `--replace`), `keep.rs` is what a holder does with it afterwards (the stop gate, `run
//! --token`'s adoption, heartbeat, renew, release, force-release), and `read.rs` the read-model
//! (`status`, the holders, the census, why a token no longer holds its lease). This module holds
//! the types they share and re-exports the rest, so callers name `store::leases::…` whichever
//! file an item lives in.
//!
//! One row per target (`leases`). Every transition is one statement whose WHERE names the
//! holder's token, so a holder that was taken over or force-released touches 0 rows — and that
//! *is* how it learns it lost (river's `river_leader.sql` works the same way). Expiry is always
//! `heartbeat_at + ttl_ms < now()` on the server (`super::EXPIRED`): the holder's own TTL,
//! the database's clock.
//!
//! Statements use `query_typed`, which skips the separate prepare round trip; most of a short
//! `leasectl run` is round trips.

mod acquire;
mod keep;
mod read;

use std::time::{Duration, SystemTime};

use uuid::Uuid;

use super::waiters::{Busy, Ticket};

pub use acquire::{acquire, acquire_place, replace};
pub use keep::{
    adopt, force_release, gate, heartbeat, release, release_token, renew, set_idle, Adopted, Gate,
    Released,
};
pub use read::{census, holders, status, why_not_held, Census, LastRun, Place, TargetStatus};

/// A lease we hold.
#[derive(Debug, Clone)]
pub struct Lease {
    pub target: String,
    pub token: Uuid,
    pub fence: i64,
    /// The database's clock when it granted the lease; with the local monotonic clock it dates
    /// the run on the database clock (see [`DbClock`]).
    pub granted_at: SystemTime,
    /// `--label`, stored with the holder and the run.
    pub label: Option<String>,
    /// The row: 0 for the single holder, 1…N for one of `--max-holders` N.
    pub place: i32,
    /// The lease outlives this run: taken by `acquire`, used by `run --token`. Its save keeps
    /// the lease (renewed, and marked idle) instead of releasing it, and nothing else releases
    /// it either: that is `release --token`'s job, or its TTL's.
    pub keep: bool,
    /// The holder this lease was taken from by `--replace`.
    pub replaced: Option<Replaced>,
    /// A previous holder of the place may still be stopping its command (the one `--replace`
    /// took it from, or an earlier one): nothing may be started before [`gate`] says so.
    pub wait_for_stop: bool,
}

/// The holder a `--replace` took a lease from.
#[derive(Debug, Clone)]
pub struct Replaced {
    /// `host pid N [label]`.
    pub who: String,
    pub fence: i64,
    /// It ran no command (an `acquire`d lease between steps, or a replacement that was still
    /// waiting itself): nothing of its own to wait for.
    pub idle: bool,
}

impl Lease {
    /// `LEASECTL_HOLDER_INDEX`: 0…N−1.
    pub fn holder_index(&self) -> i32 {
        (self.place - 1).max(0)
    }
}

/// Dates events on the database's clock without asking it again: the time the database
/// reported at a known local instant, plus monotonic time elapsed since.
#[derive(Debug, Clone, Copy)]
pub struct DbClock {
    pub db_time: SystemTime,
    pub local: tokio::time::Instant,
}

impl DbClock {
    pub fn at(&self, instant: tokio::time::Instant) -> SystemTime {
        self.db_time + instant.saturating_duration_since(self.local)
    }
}

pub enum Acquired {
    Held(Lease),
    /// Someone else holds it, or waiters go first: the holder and the queue.
    Busy(Busy),
    /// The target's holders have another `--max-holders` (this N stands until no place is
    /// held).
    Mismatch {
        in_force: i32,
    },
}

/// Who asks for a lease, as the acquiring statement records it.
#[derive(Debug, Clone, Copy)]
pub struct Contender<'a> {
    /// The caller's for all its attempts (see [`acquire`]).
    ///
    /// [`acquire`]: acquire()
    pub token: Uuid,
    pub ttl: Duration,
    pub host: &'a str,
    pub pid: i32,
    pub label: Option<&'a str>,
    /// The caller's place in the queue, once it waits (see [`super::waiters`]).
    pub ticket: Option<Ticket>,
    /// `--max-holders`: 1 for the single holder.
    pub max_holders: i32,
}
