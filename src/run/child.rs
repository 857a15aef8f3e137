//! The command of a run: a [`Group`] with a watchdog, its stdin passed through, its stdout
//! and stderr streamed live and captured.

use std::ffi::OsString;
use std::io;
use std::process::ExitStatus;

use nix::sys::signal::Signal;
use tokio::time::Instant;

use crate::process::spawn::{Command, Stdio};
use crate::process::{Capture, Group, OnEchoError, Options, Pump, Watchdog};

/// Why the command could not be started.
#[derive(Debug)]
pub struct SpawnError {
    /// 127 for "not found", 126 for "found but not executable".
    pub exit_code: u8,
    pub message: String,
}

pub struct Spec<'a> {
    pub argv: &'a [OsString],
    pub env: Vec<(&'static str, String)>,
    pub echo: bool,
    pub capture_limit: usize,
    /// Armed ahead to guard the command's group ([`Group::spawn_guarded`]).
    pub watchdog: Option<Watchdog>,
}

/// The running command and the tasks pumping its output.
pub struct Child {
    group: Group,
    stdout: Pump,
    stderr: Pump,
}

impl Child {
    pub fn spawn(spec: Spec<'_>) -> Result<Child, SpawnError> {
        let (program, args) = spec
            .argv
            .split_first()
            .expect("RunConfig guarantees a command");
        // Looked up here rather than by execvp in the child (see `process::path`); the
        // command still sees the name it was given as its argv[0].
        let mut cmd = Command::new(crate::process::path::resolved(program));
        cmd.arg0(program)
            .args(args)
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::Inherit)
            .stdout(Stdio::Piped)
            .stderr(Stdio::Piped);
        let opts = Options {
            watchdog: true,
            terminal: true,
            #[cfg(test)]
            stop_in_its_group: false,
        };
        let mut group =
            Group::spawn_guarded(cmd, opts, spec.watchdog).map_err(|e| spawn_error(program, &e))?;
        let out = group.child_mut().stdout.take().expect("stdout is piped");
        let err = group.child_mut().stderr.take().expect("stderr is piped");
        let limit = spec.capture_limit;
        // A reader of our stdout that went away must reach the command as a broken pipe, as
        // it would without leasectl (`leasectl run -- yes | head`); a broken stderr only
        // stops the echo, since diagnostics must not kill the command.
        let stdout = Pump::start(
            out,
            spec.echo.then(tokio::io::stdout),
            limit,
            OnEchoError::ClosePipe,
        );
        let stderr = Pump::start(
            err,
            spec.echo.then(tokio::io::stderr),
            limit,
            OnEchoError::KeepReading,
        );
        Ok(Child {
            group,
            stdout,
            stderr,
        })
    }

    /// Waits for the command to exit. Cancel-safe.
    pub async fn wait(&mut self) -> ExitStatus {
        self.group.wait().await
    }

    /// The command's status if it has already exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.group.exited()
    }

    /// See [`Group::stop`].
    pub async fn stop(&mut self, first: Signal, kill_at: Instant) -> ExitStatus {
        self.group.stop(first, kill_at).await
    }

    /// SIGKILL to whatever is left in the command's group.
    pub fn kill_leftovers(&self) {
        self.group.kill_leftovers();
    }

    /// See [`Group::end_now`].
    pub fn end_now(&mut self) {
        self.group.end_now();
    }

    /// See [`Group::end_leftovers`].
    pub async fn end_leftovers(&self, kill_at: Instant) -> bool {
        self.group.end_leftovers(kill_at).await
    }

    /// Collects the captured output. Call after the command exited: reads until end of file,
    /// but at most until `until` (see [`Pump::drain`]), then closes the pipes.
    pub async fn finish(&mut self, until: Instant) -> (Capture, Capture) {
        tokio::join!(self.stdout.drain(until), self.stderr.drain(until))
    }
}

fn spawn_error(program: &OsString, e: &io::Error) -> SpawnError {
    let exit_code = if e.kind() == io::ErrorKind::NotFound {
        127
    } else {
        126
    };
    SpawnError {
        exit_code,
        message: format!("cannot run '{}': {e}", program.to_string_lossy()),
    }
}
