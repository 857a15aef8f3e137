//! `--sink exec:COMMAND`: runs COMMAND once per event with the event JSON on stdin; exit 0 means
//! delivered.
//!
//! COMMAND is a shell command line, run as `/bin/sh -c COMMAND` (so quoting, pipes and
//! `$VARIABLES` work as in a script). For each event:
//!
//! * stdin is the event's JSON ([`super::Format::document`]: the published JSON object, or a CloudEvent in
//!   structured mode) followed by a newline, then end of file. A command that does not
//!   read it is fine: a write that fails because the command closed its stdin (`EPIPE`) is
//!   ignored, and the write is abandoned once the command has exited — only the exit status
//!   decides;
//! * the environment is leasectl's plus `LEASECTL_EVENT_ID`, `LEASECTL_EVENT_TYPE`,
//!   `LEASECTL_AGGREGATE_TYPE` and `LEASECTL_AGGREGATE_ID`;
//! * stdout and stderr are leasectl's own, so the operator sees what the command prints;
//! * the command runs in a process group of its own ([`crate::process::Group`], the same
//!   supervisor as `leasectl run`'s), so that everything it started can be stopped together: when it runs longer than `--timeout` the group gets SIGTERM, then SIGKILL
//!   after [`KILL_GRACE`]. If the delivery is abandoned (the relay drops the future) the group
//!   is killed at once; if leasectl itself dies, the command gets SIGKILL (`PR_SET_PDEATHSIG`;
//!   this reaches the shell or the program it `exec`s, not processes it forked). After a
//!   normal exit the group is left alone: what the command chose to leave running in the
//!   background is its business (and the exit status has already decided the delivery).
//!
//! How outcomes are classified (see [`super::DeliveryError`]):
//!
//! * exit 0: delivered;
//! * exit N, or killed by a signal: **Rejected** — the command refused this event;
//! * still running at `--timeout` (stopped then): **NoAnswer** — this event's refusal if other
//!   commands of the batch finished meanwhile, else the sink counts as unavailable;
//! * exit 126 or 127: **Unavailable**. The shell uses these for "found but not executable" and
//!   "command not found": the sink is misconfigured, which is no fault of the event, so the
//!   relay backs off without spending the event's attempts (and the operator sees the shell's
//!   own message on stderr). A command must therefore not use 126 or 127 to reject an event;
//! * `/bin/sh` cannot be started at all (fork fails, no shell): **Unavailable**.
//!
//! Events of different aggregates are delivered concurrently, so several commands may run at
//! once (up to the sink's [`super::Sink::parallelism`]); the command must cope with that.

use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::io::AsyncWriteExt;
use tokio::net::unix::pipe;
use tokio::time::Instant;

use crate::process::spawn::{Command, Stdio};
use crate::process::{Group, Options};

use super::{DeliveryError, Event, Gate, SinkOptions};

/// How long a timed-out command has between SIGTERM and SIGKILL.
pub const KILL_GRACE: Duration = Duration::from_secs(2);
/// The shell that runs COMMAND.
const SHELL: &str = "/bin/sh";

#[derive(Debug, Clone)]
pub struct Spec {
    pub command: String,
}

impl Spec {
    pub fn parse(command: &str) -> Result<Spec, String> {
        if command.trim().is_empty() {
            return Err("exec: needs a command, e.g. --sink 'exec:./publish.sh'".into());
        }
        Ok(Spec {
            command: command.to_owned(),
        })
    }
}

pub struct Exec {
    spec: Spec,
    opts: SinkOptions,
}

impl Exec {
    pub fn new(spec: Spec, opts: SinkOptions) -> Exec {
        Exec { spec, opts }
    }

    /// Runs the command for one event and classifies the outcome (see the module
    /// documentation). Cancel-safe: dropping the future kills the command's process group.
    pub async fn deliver(&self, event: &Event, gate: &Gate) -> Result<(), DeliveryError> {
        // The command acts on the event as soon as it starts: the last moment to look.
        if !gate.allows_now() {
            return Err(DeliveryError::late());
        }
        let mut group = self.spawn(event)?;
        let mut input = self.opts.format.document(event).into_bytes();
        input.push(b'\n');
        let stdin = group.child_mut().stdin.take();
        let outcome = tokio::time::timeout(self.opts.timeout, async {
            // Feed stdin while waiting for the exit, not before it: a command that never reads
            // would otherwise block a large write forever. The write is dropped (closing the
            // pipe) when it completes or when the command exits, whichever is first.
            let feed = feed(stdin, input);
            tokio::pin!(feed);
            let mut fed = false;
            loop {
                tokio::select! {
                    status = group.wait() => break status,
                    () = &mut feed, if !fed => fed = true,
                }
            }
        })
        .await;
        match outcome {
            Ok(status) => self.classify(status),
            Err(_) => {
                // SIGTERM to the group, SIGKILL once KILL_GRACE has passed with anything of
                // it still alive.
                group
                    .stop(Signal::SIGTERM, Instant::now() + KILL_GRACE)
                    .await;
                Err(DeliveryError::NoAnswer(format!(
                    "timed out after {}",
                    humantime::format_duration(self.opts.timeout)
                )))
            }
        }
    }

    /// Starts `sh -c COMMAND` in a process group of its own; no watchdog and no terminal: a
    /// delivery is short, and what it leaves running after a normal exit is its business.
    fn spawn(&self, event: &Event) -> Result<Group, DeliveryError> {
        let mut cmd = Command::new(SHELL);
        cmd.arg("-c")
            .arg(&self.spec.command)
            .env("LEASECTL_EVENT_ID", event.id.to_string())
            .env("LEASECTL_EVENT_TYPE", &event.event_type)
            .env("LEASECTL_AGGREGATE_TYPE", &event.aggregate_type)
            .env("LEASECTL_AGGREGATE_ID", &event.aggregate_id)
            .stdin(Stdio::Piped)
            .stdout(Stdio::Inherit)
            .stderr(Stdio::Inherit);
        Group::spawn(cmd, Options::default()).map_err(|e| {
            DeliveryError::Unavailable(format!("cannot run {SHELL} for the exec sink: {e}"))
        })
    }

    fn classify(&self, status: ExitStatus) -> Result<(), DeliveryError> {
        match (status.code(), status.signal()) {
            (Some(0), _) => Ok(()),
            (Some(code @ (126 | 127)), _) => Err(DeliveryError::Unavailable(format!(
                "{} (exit status {code} from the shell): exec:{}",
                if code == 127 {
                    "command not found"
                } else {
                    "command not executable"
                },
                self.spec.command
            ))),
            (Some(code), _) => Err(DeliveryError::Rejected(format!(
                "exited with status {code}"
            ))),
            (None, Some(sig)) => Err(DeliveryError::Rejected(format!(
                "killed by signal {}",
                Signal::try_from(sig).map_or_else(|_| sig.to_string(), |s| s.as_str().to_owned())
            ))),
            (None, None) => Err(DeliveryError::Rejected(format!("ended with {status}"))),
        }
    }
}

/// Writes the event to the command's stdin and closes it; errors (the command closed its end,
/// typically `EPIPE`) are ignored: the exit status decides.
async fn feed(stdin: Option<pipe::Sender>, input: Vec<u8>) {
    if let Some(mut stdin) = stdin {
        let _ = stdin.write_all(&input).await;
        // Dropping `stdin` closes the pipe: the command reads end of file.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn needs_a_command() {
        assert!(Spec::parse("").is_err());
        assert!(Spec::parse("  \t").is_err());
        assert_eq!(
            Spec::parse("./publish.sh --to 'a b'").unwrap().command,
            "./publish.sh --to 'a b'"
        );
    }
}
