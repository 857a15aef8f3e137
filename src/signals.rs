//! The signals leasectl forwards to its child: SIGINT, SIGTERM and SIGHUP.
//!
//! Handlers are installed before the lease is taken, so a signal can never kill leasectl
//! while it holds a lease without the child being stopped and the lease released.

use anyhow::{Context, Result};
use nix::sys::signal::Signal as Sig;
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
            _ = self.int.recv() => Sig::SIGINT as i32,
            _ = self.term.recv() => Sig::SIGTERM as i32,
            _ = self.hup.recv() => Sig::SIGHUP as i32,
        }
    }
}

/// SIGINT/SIGTERM for a loop that stops gracefully (the relay) rather than forwarding them: the
/// first cancels `token` (after calling `on_first` with its number), so every `select!` on it
/// winds down after the work in hand; the second is delivered on the returned channel, for
/// the caller to abandon that work at once. The handlers are installed before this returns.
pub fn cancel_on_stop(
    token: tokio_util::sync::CancellationToken,
    on_first: impl FnOnce(i32) + Send + 'static,
) -> Result<tokio::sync::oneshot::Receiver<i32>> {
    let make = |k: SignalKind| signal(k).context("cannot install signal handlers");
    let mut int = make(SignalKind::interrupt())?;
    let mut term = make(SignalKind::terminate())?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        on_first(next_stop(&mut int, &mut term).await);
        token.cancel();
        let _ = tx.send(next_stop(&mut int, &mut term).await);
    });
    Ok(rx)
}

async fn next_stop(int: &mut Signal, term: &mut Signal) -> i32 {
    tokio::select! {
        _ = int.recv() => Sig::SIGINT as i32,
        _ = term.recv() => Sig::SIGTERM as i32,
    }
}
