//! Child processes: one supervisor for every process leasectl starts ([`group`]), the watchdog
//! that kills a command's group if leasectl dies ([`Watchdog`]), the capture of their output
//! ([`capture`]), the lookup of a command in `PATH` before it starts ([`path`]), the start
//! itself without copying leasectl's memory ([`spawn`]) and the SIGCONT that continues a child
//! stopped on its way out of leasectl's process group (`resume`).

pub mod capture;
pub mod group;
pub mod path;
mod resume;
pub mod spawn;
pub mod watchdog;

pub use capture::{Capture, OnEchoError, Pump};
pub use group::{Group, Options};
pub use watchdog::Watchdog;
