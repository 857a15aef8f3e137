//! One integration-test binary (faster to build than one per file). Every test talks to a real
//! PostgreSQL, in a schema of its own; see `common.rs`.

mod common;

mod cli;
mod completions;
mod faults;
mod inspect;
mod lease;
mod singleflight;
mod sink_local;
mod supervise;
