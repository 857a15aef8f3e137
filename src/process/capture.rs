//! A child's output stream, copied live to ours and into a capped buffer.
//!
//! One [`Pump`] per stream runs as its own task from the spawn on, so a command that writes
//! more than a pipe holds never blocks on leasectl. Collecting the capture ([`Pump::drain`])
//! is bounded: a process that keeps the pipe open after the command exited cannot keep
//! leasectl reading forever.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// What a stream of the child produced, up to the capture limit.
#[derive(Debug, Default)]
pub struct Capture {
    pub bytes: Vec<u8>,
    pub truncated: bool,
}

/// How long to keep reading output after the child exited, in case something it left behind
/// still holds the pipe open.
const DRAIN_AFTER_EXIT: Duration = Duration::from_secs(1);

/// What a [`Pump`] does when echoing to our own stream fails (its reader went away).
#[derive(Clone, Copy)]
pub enum OnEchoError {
    /// Stop reading and close the child's pipe, so the child gets SIGPIPE/EPIPE on its next
    /// write, as it would have writing to our stream directly.
    ClosePipe,
    /// Stop echoing, keep capturing.
    KeepReading,
}

/// One output stream of the child, copied to ours (unless quiet) and into a capped buffer.
pub struct Pump {
    task: JoinHandle<()>,
    capture: Arc<Mutex<Capture>>,
    /// Bytes seen so far, to tell a stream that is still flowing from one held open idly.
    seen: Arc<AtomicU64>,
}

impl Pump {
    pub fn start<R, W>(from: R, echo: Option<W>, limit: usize, on_error: OnEchoError) -> Pump
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let capture = Arc::new(Mutex::new(Capture::default()));
        let seen = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn(pump(
            from,
            echo,
            limit,
            on_error,
            capture.clone(),
            seen.clone(),
        ));
        Pump {
            task,
            capture,
            seen,
        }
    }

    /// Reads to end of file, until the stream has been idle for `DRAIN_AFTER_EXIT`, or
    /// until `until`, whichever comes first; then drops the pipe's read end.
    pub async fn drain(&mut self, until: Instant) -> Capture {
        loop {
            let before = self.seen.load(Ordering::Relaxed);
            let idle_at = (Instant::now() + DRAIN_AFTER_EXIT).min(until);
            if tokio::time::timeout_at(idle_at, &mut self.task)
                .await
                .is_ok()
            {
                break;
            }
            if self.seen.load(Ordering::Relaxed) == before || Instant::now() >= until {
                self.task.abort();
                // Aborting drops the task, and with it the read end, at its next poll.
                let _ = (&mut self.task).await;
                break;
            }
        }
        std::mem::take(&mut *self.capture.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

async fn pump<R, W>(
    mut from: R,
    mut echo: Option<W>,
    limit: usize,
    on_error: OnEchoError,
    capture: Arc<Mutex<Capture>>,
    seen: Arc<AtomicU64>,
) where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    // Read into spare capacity: zeroing 64 KiB first (twice a run, stdout and stderr) cost
    // more than the rest of the pump for a command that writes little.
    let mut buf = Vec::with_capacity(64 * 1024);
    loop {
        buf.clear();
        let n = match from.read_buf(&mut buf).await {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        seen.fetch_add(n as u64, Ordering::Relaxed);
        let chunk = &buf[..n];
        {
            let mut cap = capture.lock().unwrap_or_else(|p| p.into_inner());
            let room = limit.saturating_sub(cap.bytes.len());
            if n > room {
                cap.truncated = true;
            }
            cap.bytes.extend_from_slice(&chunk[..n.min(room)]);
        }
        if let Some(w) = echo.as_mut() {
            if w.write_all(chunk).await.is_err() || w.flush().await.is_err() {
                echo = None;
                if let OnEchoError::ClosePipe = on_error {
                    // Returning drops `from`: the child's next write fails with EPIPE.
                    return;
                }
            }
        }
    }
}
