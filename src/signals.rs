//! The signals leasectl forwards to its child: SIGINT, SIGTERM and SIGHUP.
//!
//! Handlers are installed before the lease is taken, so a signal can never kill leasectl
//! while it holds a lease without the child being stopped and the lease released.

use anyhow::{Context, Result};
use tokio::signal::unix::{signal, Signal, SignalKind};

pub struct Signals {
    int: Signal,
    term: Signal,
    hup: Signal,
}

impl Signals {
    pub fn install() -> Result<Signals> {
        let make = |k: SignalKind| signal(k).context("cannot install signal handlers");
        Ok(Signals {
            int: make(SignalKind::interrupt())?,
            term: make(SignalKind::terminate())?,
            hup: make(SignalKind::hangup())?,
        })
    }

    /// The next signal received, as its number.
    pub async fn recv(&mut self) -> i32 {
        tokio::select! {
            _ = self.int.recv() => libc::SIGINT,
            _ = self.term.recv() => libc::SIGTERM,
            _ = self.hup.recv() => libc::SIGHUP,
        }
    }
}
