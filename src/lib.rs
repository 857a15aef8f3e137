//! leasectl: run a command at most once at a time per target, with PostgreSQL as the only
//! coordinator.
//!
//! How a `leasectl run` flows through the modules:
//!
//! * [`cli`] parses flags (values checked there), [`config`] turns them into a [`config::RunConfig`]
//!   with the cross-flag rules applied — all before anything connects.
//! * [`db`] finds the database like libpq does, connects (TLS in [`db::tls`]) and migrates the
//!   schema under an advisory lock, refusing a schema that is newer or was migrated differently.
//! * [`store`] holds every SQL statement, one module per table: [`store::leases`] (acquire,
//!   heartbeat, release), [`store::runs`] (the fenced save that stores the run and its outbox
//!   event only while the token still matches) and [`store::outbox`].
//! * [`heartbeat`] renews a held lease and decides, on the monotonic clock, when the command
//!   must be stopped because the lease could otherwise expire under it.
//! * [`supervise`] owns the child process: its process group, output capture, signals, the
//!   stop with grace, and the watchdog that kills it if leasectl dies.
//! * [`cmd::run`] ties them together; the other [`cmd`] modules are the operator commands.
//! * [`relay`] moves outbox events to a sink: the loop, [`relay::publish`] (the scheduler) and
//!   one module per sink in [`relay::sink`].
//! * [`exit`] lists every exit code (the typed failures that pick one are in [`error`]);
//!   `main.rs` maps the outcome to one and prints errors once.

pub mod cli;
pub mod cmd;
pub mod config;
pub mod db;
pub mod error;
pub mod exit;
pub mod fmt;
pub mod heartbeat;
#[macro_use]
pub mod log;
pub mod relay;
pub mod signals;
pub mod store;
pub mod supervise;
