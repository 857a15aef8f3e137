//! leasectl: run a command at most once at a time per target, with PostgreSQL as the only
//! coordinator.
//!
//! How a `leasectl run` flows through the modules:
//!
//! * [`cli`] parses flags (values checked there, by the parsers of [`model::flags`]); the run
//!   path turns them into a [`config::RunConfig`] with the cross-flag rules of [`config`] applied
//!   — all before anything connects.
//! * [`db`] finds the database like libpq does, connects (TLS in [`db::tls`]; a one-shot
//!   command's deadline in [`db::deadline`]) and migrates the schema under an advisory lock,
//!   refusing a schema that is newer or was migrated differently.
//! * [`store`] holds the SQL of the tables, one module per table: [`store::leases`] (acquire,
//!   heartbeat, release), [`store::waiters`] (the `--wait` queue), [`store::runs`] (the fenced
//!   save that stores the run and its outbox event only while the token still matches),
//!   [`store::outbox`] and [`store::health`].
//! * [`run`] is the run path: `run::wait`-ing for the lease, the [`run::heartbeat`] that
//!   renews it and decides, on the monotonic clock, when the command must be stopped, and
//!   the fenced save at the end.
//! * [`process`] is the one process supervisor (process group, watchdog, stop by a deadline,
//!   leftovers, output capture), shared by `run` and the relay's `exec:` sink.
//! * [`relay`] moves outbox events to a sink: the loop, [`relay::publish`] (the scheduler) and
//!   one module per sink in [`relay::sink`], which all publish what [`relay::sink::format`] builds
//!   (`--format json|cloudevents`).
//! * [`cmd`] has one thin module per subcommand; [`doctor`] holds the checks of `leasectl
//!   doctor`, which only looks.
//! * [`exit`] lists every exit code (the typed failures that pick one are in [`error`]);
//!   `main.rs` maps the outcome to one and prints errors once; [`out`] writes data to stdout.
//! * [`model`] is the vocabulary underneath them all (flag values, durations and deadlines,
//!   `--slot` schedules, queue and publishing orders, the dead-man switch's facts): it imports
//!   nothing else of the crate, and `scripts/check-cycles` keeps every import between modules
//!   going one way.

pub mod cli;
pub mod cmd;
pub mod config;
pub mod db;
pub mod doctor;
pub mod error;
pub mod exit;
pub mod fmt;
pub mod health;
pub mod heap;
#[macro_use]
pub mod log;
pub mod model;
pub mod out;
pub mod process;
pub mod relay;
pub mod run;
pub mod signals;
pub mod store;
