//! Messages to stderr: errors and warnings always, `-v` details only when asked.

use std::sync::atomic::{AtomicBool, Ordering};

static VERBOSE: AtomicBool = AtomicBool::new(false);

pub fn set_verbose(on: bool) {
    VERBOSE.store(on, Ordering::Relaxed);
}

pub fn verbose() -> bool {
    VERBOSE.load(Ordering::Relaxed)
}

/// `leasectl: warning: …` — something went wrong but leasectl carries on.
#[macro_export]
macro_rules! warn {
    ($($arg:tt)*) => { eprintln!("leasectl: warning: {}", format_args!($($arg)*)) };
}

/// `leasectl: …` — only with `-v`.
#[macro_export]
macro_rules! info {
    ($($arg:tt)*) => { if $crate::log::verbose() { eprintln!("leasectl: {}", format_args!($($arg)*)) } };
}
