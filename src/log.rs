//! Messages to stderr: errors and warnings always, `-v` details only when asked.
//!
//! Every diagnostic goes through [`emit`], never `eprintln!`: `eprintln!` panics when stderr is
//! a pipe whose reader has gone (`2>&1 | head`, a dead log shipper), and a panic mid-run would
//! abandon the lease and the run. A message that cannot be written is dropped; the run goes on.
//! (`clippy.toml` disallows the std print macros so none creeps back in.)

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

static VERBOSE: AtomicBool = AtomicBool::new(false);

pub fn set_verbose(on: bool) {
    VERBOSE.store(on, Ordering::Relaxed);
}

pub fn verbose() -> bool {
    VERBOSE.load(Ordering::Relaxed)
}

/// Writes one line to stderr, ignoring a closed or broken stderr.
pub fn emit(args: std::fmt::Arguments<'_>) {
    let mut err = std::io::stderr().lock();
    let _ = err.write_fmt(args).and_then(|()| err.write_all(b"\n"));
}

/// `leasectl: …` — an error or a notice the user must see.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => { $crate::log::emit(format_args!("leasectl: {}", format_args!($($arg)*))) };
}

/// `leasectl: warning: …` — something went wrong but leasectl carries on.
#[macro_export]
macro_rules! warn {
    ($($arg:tt)*) => { $crate::log::emit(format_args!("leasectl: warning: {}", format_args!($($arg)*))) };
}

/// `leasectl: …` — only with `-v`.
#[macro_export]
macro_rules! info {
    ($($arg:tt)*) => { if $crate::log::verbose() { $crate::say!($($arg)*) } };
}
