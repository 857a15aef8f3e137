//! Child processes: one supervisor for every process leasectl starts ([`group`]), the watchdog
//! that kills a command's group if leasectl dies ([`Watchdog`]) and the capture of their output
//! ([`capture`]).

pub mod capture;
pub mod group;
mod watchdog;

pub use capture::{Capture, OnEchoError, Pump};
pub use group::{Group, Options};
pub use watchdog::Watchdog;
