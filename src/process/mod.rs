//! Child processes: one supervisor for every process leasectl starts ([`group`]) and the
//! capture of their output ([`capture`]).

pub mod capture;
pub mod group;

pub use capture::{Capture, OnEchoError, Pump};
pub use group::{Group, Options};
