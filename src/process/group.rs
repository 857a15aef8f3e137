//! The one process-group supervisor: `leasectl run`'s command and the relay's `exec:` sink
//! both run through [`Group`].
//!
//! A [`Group`] is a child process in a process group of its own, so that a stop reaches
//! everything it started:
//!
//! * with [`Options::watchdog`], a [`Watchdog`] process kills the whole group if leasectl
//!   vanishes (even `kill -9`, even a SIGKILL to leasectl's whole process group), which also
//!   covers grandchildren such as the commands of a `sh -c` pipeline. The watchdog is started
//!   *first* and leads the process group the child then joins, so there is no moment in which
//!   the child runs unguarded; it stays in that group, out of leasectl's, and ignores the
//!   signals a terminal or a job runner sends, so whatever kills leasectl's group does not
//!   kill the watchdog. A panic never stands it down: the unwinding only closes its pipe,
//!   which the watchdog takes as "leasectl is gone".
//! * `PR_SET_PDEATHSIG` kills the direct child when the thread that started it dies. Linux ties
//!   it to the *thread*, so leasectl starts children from the runtime's main thread (it runs a
//!   current-thread runtime), never from a pooled thread that could retire mid-run. It is what
//!   still stops the command when something kills leasectl and its watchdog together (`pkill -9
//!   leasectl` matches both names). It needs code between the child's start and its exec,
//!   which `posix_spawn` cannot run, so the child is started by [`super::spawn`]: a
//!   `clone` that shares leasectl's memory until the exec, where a `fork` would copy it.
//! * stopping is "signal, wait until a deadline, SIGKILL" ([`Group::stop`]); what the child
//!   left behind in its group is found in `/proc`, zombies not counted ([`Group::has_leftovers`]).
//! * dropping a group whose child has not been reaped SIGKILLs the group: a supervisor that
//!   gives up on a child (a cancelled delivery, an error) never leaves it running.

use std::io::{self, IsTerminal};
use std::process::ExitStatus;
use std::time::Duration;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::time::Instant;

use super::spawn::{self, Child, Command};
use super::{resume, Watchdog};

/// How a [`Group`] is set up around its command.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// A [`Watchdog`] kills the group if leasectl dies (see the module docs).
    pub watchdog: bool,
    /// When stdin is leasectl's terminal and leasectl is in its foreground, hand the terminal
    /// to the command's group for the command's lifetime (interactive commands can read it).
    pub terminal: bool,
    /// Tests only: the child stops itself once it has left leasectl's process group, as a stop
    /// signal sent to that group just before can make it do (see `resume`).
    #[cfg(test)]
    pub stop_in_its_group: bool,
}

impl Options {
    /// Whether the child stops itself out of leasectl's group: in tests only.
    fn stops_in_its_group(&self) -> bool {
        #[cfg(test)]
        return self.stop_in_its_group;
        #[cfg(not(test))]
        false
    }
}

/// A child process leading (or, with a watchdog, in) a process group of its own.
pub struct Group {
    child: Child,
    /// The direct child's pid (see [`Group::has_leftovers`]).
    pid: i32,
    pgid: Pid,
    status: Option<ExitStatus>,
    /// Dropped after the group is dealt with: stand the watchdog down, give the terminal back.
    watchdog: Option<Watchdog>,
    _terminal: Option<Terminal>,
}

impl Group {
    /// Spawns `cmd` (its arguments, environment and stdio already set) in a new process group.
    pub fn spawn(cmd: Command, opts: Options) -> io::Result<Group> {
        Group::spawn_guarded(cmd, opts, None)
    }

    /// [`Group::spawn`], with a watchdog armed ahead ([`Watchdog::arm`]) to guard the group if
    /// `opts` asks for one — unless it is gone meanwhile: then one is started now.
    pub fn spawn_guarded(
        cmd: Command,
        opts: Options,
        armed: Option<Watchdog>,
    ) -> io::Result<Group> {
        // The watchdog leads the group; without one the child leads its own.
        let watchdog = if opts.watchdog {
            match armed.filter(Watchdog::alive).map_or_else(Watchdog::arm, Ok) {
                Ok(w) => Some(w),
                Err(e) => {
                    crate::warn!(
                        "cannot start the watchdog ({e}); the command may outlive a killed leasectl"
                    );
                    None
                }
            }
        } else {
            None
        };
        let terminal = if opts.terminal {
            Terminal::foreground()
        } else {
            None
        };
        // Held until the child has exec'd (see `resume`).
        let slot = resume::Slot::take();
        let group = watchdog.as_ref().map_or(0, |w| w.pid.as_raw());
        let stop = opts.stops_in_its_group();
        let setup = set_up_in_child(group, terminal.is_some(), slot.cell(), stop);
        let child = spawn::spawn(&cmd, &setup)?;
        drop(slot);
        let pid = child.id();
        let pgid = watchdog
            .as_ref()
            .map_or(Pid::from_raw(pid as i32), |w| w.pid);
        Ok(Group {
            child,
            pid: pid as i32,
            pgid,
            status: None,
            watchdog,
            _terminal: terminal,
        })
    }

    /// The child's stdin, stdout and stderr pipes (those set to [`spawn::Stdio::Piped`]).
    pub fn child_mut(&mut self) -> &mut Child {
        &mut self.child
    }

    /// Waits for the direct child to exit. Cancel-safe; returns the same status once known.
    pub async fn wait(&mut self) -> ExitStatus {
        if let Some(s) = self.status {
            return s;
        }
        let status = match self.child.wait().await {
            Ok(s) => s,
            // wait(2) can only fail if the child was reaped elsewhere; report a generic failure.
            Err(_) => std::os::unix::process::ExitStatusExt::from_raw(1 << 8),
        };
        self.status = Some(status);
        status
    }

    /// The child's status if it has already exited, without waiting.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    /// Sends `sig` to the child's whole process group. The watchdog, a member of the group,
    /// ignores every signal this is used with except SIGKILL, and is expendable by then.
    pub fn signal(&self, sig: Signal) {
        let _ = killpg(self.pgid, sig);
    }

    /// Stop: `first` to the group, then SIGKILL at `kill_at` if the child is still there (at
    /// once if that moment has already passed, e.g. after leasectl was paused), then SIGKILL
    /// to whatever of the group remains. Returns the child's status.
    ///
    /// The caller passes a *deadline*, not a grace: a stop that starts late must not grant
    /// the full grace again, or the command would overlap the next holder.
    pub async fn stop(&mut self, first: Signal, kill_at: Instant) -> ExitStatus {
        if Instant::now() < kill_at {
            self.signal(first);
        }
        let status = match tokio::time::timeout_at(kill_at, self.wait()).await {
            Ok(s) => s,
            Err(_) => {
                self.signal(Signal::SIGKILL);
                self.wait().await
            }
        };
        // What the child started may still be there, ignoring `first`: the same deadline.
        self.end_leftovers(kill_at).await;
        status
    }

    /// SIGKILL to the group right now (the lease is gone; no grace left).
    pub async fn kill_now(&mut self) -> ExitStatus {
        self.signal(Signal::SIGKILL);
        self.wait().await
    }

    /// Kills processes the child left behind in its group.
    pub fn kill_leftovers(&self) {
        self.signal(Signal::SIGKILL);
    }

    /// The end of a run, done early: SIGKILL to the whole group (the watchdog included) and the
    /// terminal back to leasectl, as dropping the group does. Only the watchdog's reap is left
    /// to the drop, so its exit can overlap other work (`run`'s fenced save); until then its
    /// pid, the group id, cannot be reused.
    pub fn end_now(&mut self) {
        self.signal(Signal::SIGKILL);
        self._terminal = None;
    }

    /// True while any live process other than the watchdog remains in the command's group.
    /// Zombies do not count: they run nothing (an init that reaps late must not make us wait
    /// out the grace for processes that are already gone).
    ///
    /// The common case is a command that started nothing, and it costs one small read instead
    /// of a look at every process on the machine: while the pid namespace's last allocated pid
    /// is still the child's, no process (or thread) was created anywhere since the child, so
    /// the child left nothing in its group: the watchdog was started before the child, and
    /// whatever the command starts is created after it. (A process from outside the command
    /// could join the group only by its own `setpgid`; it is not the command's leftover — and a
    /// run SIGKILLs its whole group at the end in any case, [`Group::end_now`].)
    pub fn has_leftovers(&self) -> bool {
        if last_pid() == Some(self.pid) {
            return false;
        }
        group_has_live_members(self.pgid, self.watchdog.as_ref().map(|w| w.pid))
    }

    /// After the child exited: anything it left running in its group (`cmd &`) gets SIGTERM,
    /// then SIGKILL at `kill_at` (at once if that has passed). Returns whether there was
    /// anything to stop. (A process that must outlive the child has to leave the group, e.g.
    /// with setsid.)
    pub async fn end_leftovers(&self, kill_at: Instant) -> bool {
        if !self.has_leftovers() {
            return false;
        }
        if Instant::now() < kill_at {
            self.signal(Signal::SIGTERM);
        }
        while self.has_leftovers() && Instant::now() < kill_at {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.kill_leftovers();
        true
    }
}

/// What the child does before its exec: name itself in its `resume` slot (`cell`), join
/// process group `group` (0: a new one it leads), `PR_SET_PDEATHSIG`, and with `hand_over_tty`
/// the terminal's foreground group.
fn set_up_in_child(
    group: i32,
    hand_over_tty: bool,
    cell: Option<&'static std::sync::atomic::AtomicI32>,
    stop: bool,
) -> impl Fn() -> io::Result<()> {
    let parent = nix::unistd::getpid();
    // Only async-signal-safe calls run in the child (see `spawn`): signal, getpid, kill,
    // setpgid, prctl, getppid, tcsetpgrp, getpgrp and _exit are plain system calls, and the
    // slot is an atomic store; nothing allocates or takes a lock.
    move || {
        resume::name_child(cell);
        // SAFETY: as above.
        unsafe {
            if libc::setpgid(0, group) != 0 {
                return Err(io::Error::last_os_error());
            }
            if stop {
                // Not raise(): it signals the thread its thread-local data names, which is
                // leasectl's, not this child's.
                libc::kill(libc::getpid(), libc::SIGSTOP);
            }
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
            // leasectl may have died before the prctl: then nobody would kill us.
            if nix::unistd::getppid() != parent {
                libc::_exit(1);
            }
            if hand_over_tty {
                // Interactive use: make our new group the terminal's foreground group so the
                // command can read the terminal (a background group reading it is stopped
                // by SIGTTIN). SIGTTOU must be ignored to do this from a background group.
                libc::signal(libc::SIGTTOU, libc::SIG_IGN);
                libc::tcsetpgrp(libc::STDIN_FILENO, libc::getpgrp());
                libc::signal(libc::SIGTTOU, libc::SIG_DFL);
            }
        }
        Ok(())
    }
}

/// A group whose child was never reaped is killed: whoever dropped it gave up on it. With a
/// watchdog, the group is SIGKILLed in any case — at the end of a run nothing in it may live
/// on (the watchdog itself goes too; it has nothing left to guard), and one signal is cheaper
/// than looking through /proc. (Without a watchdog, once the child is reaped the group id may
/// be reused, so it is left alone.)
impl Drop for Group {
    fn drop(&mut self) {
        if self.status.is_none() || self.watchdog.is_some() {
            self.signal(Signal::SIGKILL);
        }
        if self.status.is_none() {
            let _ = self.child.start_kill();
        }
    }
}

/// The pid the kernel allocated last in our pid namespace (`/proc/sys/kernel/ns_last_pid`), if
/// it can be read.
fn last_pid() -> Option<i32> {
    let mut buf = [0u8; 24];
    let mut f = std::fs::File::open("/proc/sys/kernel/ns_last_pid").ok()?;
    let n = std::io::Read::read(&mut f, &mut buf).ok()?;
    std::str::from_utf8(&buf[..n]).ok()?.trim().parse().ok()
}

/// Whether a process other than `except` and not a zombie is in process group `pgid`, from
/// `/proc` (`kill(-pgid, 0)` cannot tell: it counts zombies, and the watchdog is a member).
fn group_has_live_members(pgid: Pid, except: Option<Pid>) -> bool {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        // No /proc: fall back to the kernel's answer, which may count zombies.
        return killpg(pgid, None).is_ok() && except.is_none();
    };
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        if except.is_some_and(|e| e.as_raw() == pid) {
            continue;
        }
        // getpgid(2) first: a system call, where reading /proc/PID/stat makes the kernel
        // format a page of text — for every process on the machine, at the end of every run.
        if nix::unistd::getpgid(Some(Pid::from_raw(pid))) != Ok(pgid) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let mut fields = stat_fields(&stat);
        let state = fields.next().unwrap_or("Z");
        let pgrp = fields.nth(1).and_then(|p| p.parse::<i32>().ok());
        if pgrp == Some(pgid.as_raw()) && state != "Z" && state != "X" {
            return true;
        }
    }
    false
}

/// The fields of a `/proc/PID/stat` line after `(comm)`, from field 3 (the state) on. `comm`
/// may contain anything, spaces and parentheses included, so the split is after its last ')'.
pub(super) fn stat_fields(stat: &str) -> std::str::SplitWhitespace<'_> {
    stat.rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
}

/// The terminal handed to an interactive child, given back when it is done.
struct Terminal;

impl Terminal {
    /// `Some` when stdin is a terminal and leasectl is in its foreground process group.
    fn foreground() -> Option<Terminal> {
        let stdin = io::stdin();
        if !stdin.is_terminal() {
            return None;
        }
        let fg = nix::unistd::tcgetpgrp(&stdin).ok()?;
        (fg == nix::unistd::getpgrp()).then_some(Terminal)
    }
}

/// Gives the terminal back to leasectl's own process group when the child is done (or could
/// not be started after its pre-exec step took the terminal).
impl Drop for Terminal {
    fn drop(&mut self) {
        // leasectl is a background group of this terminal until the call succeeds, and a
        // background tcsetpgrp raises SIGTTOU (which would stop us) unless it is blocked.
        let ttou = nix::sys::signal::SigSet::from(Signal::SIGTTOU);
        let _ = ttou.thread_block();
        let _ = nix::unistd::tcsetpgrp(io::stdin(), nix::unistd::getpgrp());
        let _ = ttou.thread_unblock();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The state letter of `/proc/PID/stat` (`None` once the process is reaped).
    fn state(pid: Pid) -> Option<String> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        stat_fields(&stat).next().map(str::to_owned)
    }

    /// Waits (10 s at most) until `pid` has exited and is not yet reaped.
    fn wait_until_zombie(pid: Pid, what: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while state(pid).as_deref() != Some("Z") {
            assert!(
                std::time::Instant::now() < deadline,
                "{what} is still {:?}",
                state(pid)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[tokio::test]
    async fn end_now_kills_the_watchdog_and_the_drop_reaps_it() {
        let opts = GUARDED;
        let mut group = Group::spawn(Command::new("true"), opts).unwrap();
        let watchdog = group.watchdog.as_ref().unwrap().pid;
        assert!(group.wait().await.success());
        assert!(!group.has_leftovers());
        group.end_now();
        // Killed, not yet reaped: a zombie until the drop.
        wait_until_zombie(watchdog, "the watchdog after end_now");
        drop(group);
        assert_eq!(state(watchdog), None, "the drop reaps the watchdog");
    }

    /// A command that exits leaving a process behind in its group is found out, the quick
    /// check on the last allocated pid notwithstanding; once that process is gone, nothing is.
    #[tokio::test]
    async fn a_process_left_behind_is_found_and_then_not() {
        let opts = GUARDED;
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("bg");
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(format!("sleep 30 & echo $! > '{}'", pidfile.display()));
        let mut group = Group::spawn(cmd, opts).unwrap();
        assert!(group.wait().await.success());
        assert!(group.has_leftovers(), "the sleep left behind is not found");
        let bg: i32 = std::fs::read_to_string(&pidfile)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(state(Pid::from_raw(bg)).is_some());
        let stopped = group
            .end_leftovers(Instant::now() + Duration::from_secs(10))
            .await;
        assert!(stopped);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while group.has_leftovers() {
            assert!(std::time::Instant::now() < deadline, "still has leftovers");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    const GUARDED: Options = Options {
        watchdog: true,
        terminal: false,
        stop_in_its_group: false,
    };

    /// A child stopped once it has left leasectl's group (a stop signal to that group reached
    /// it just before) holds the spawn, which waits for its exec, until leasectl is continued:
    /// then so is the child, and the spawn returns. Without that, the spawn would wait forever.
    #[test]
    fn a_child_stopped_out_of_our_group_is_continued_with_us() {
        let (spawned, returned) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                let opts = Options {
                    stop_in_its_group: true,
                    ..Options::default()
                };
                let mut group = Group::spawn(Command::new("true"), opts).unwrap();
                spawned.send(group.pid).unwrap();
                assert!(group.wait().await.success());
            });
        });
        assert!(
            returned.recv_timeout(Duration::from_millis(300)).is_err(),
            "the spawn returned while its child was stopped"
        );
        // What a SIGCONT to leasectl's group does for leasectl.
        nix::sys::signal::kill(nix::unistd::getpid(), Signal::SIGCONT).unwrap();
        let pid = returned
            .recv_timeout(Duration::from_secs(10))
            .expect("the spawn still waits for its stopped child");
        assert!(pid > 0);
    }

    /// A program without a `#!` line runs with /bin/sh, as a shell runs it (`execvpe` does
    /// that; `posix_spawn`, were it used, would refuse it with ENOEXEC).
    #[tokio::test]
    async fn a_program_without_an_interpreter_line_runs_with_sh() {
        let dir = tempfile::tempdir().unwrap();
        let (script, out) = (dir.path().join("plain"), dir.path().join("out"));
        std::fs::write(&script, format!("echo ran > '{}'\n", out.display())).unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let mut group = Group::spawn(Command::new(&script), GUARDED).unwrap();
        assert!(group.wait().await.success());
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "ran\n");
    }

    /// A watchdog armed ahead leads the command's group: no second one is started.
    #[tokio::test]
    async fn a_watchdog_armed_ahead_guards_the_group() {
        let armed = Watchdog::arm().unwrap();
        let pid = armed.pid;
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg("test \"$(ps -o pgid= -p $$ | tr -d ' ')\" = \"$1\"");
        cmd.arg("sh").arg(pid.to_string());
        let mut group = Group::spawn_guarded(cmd, GUARDED, Some(armed)).unwrap();
        assert_eq!(group.pgid, pid);
        assert_eq!(group.watchdog.as_ref().map(|w| w.pid), Some(pid));
        assert!(
            group.wait().await.success(),
            "the command is not in the watchdog's group"
        );
    }

    /// One armed ahead that was killed meanwhile cannot lead a group any more: the spawn forks
    /// another, and the command runs guarded all the same.
    #[tokio::test]
    async fn a_watchdog_armed_ahead_that_died_is_replaced() {
        let armed = Watchdog::arm().unwrap();
        let dead = armed.pid;
        nix::sys::signal::kill(dead, Signal::SIGKILL).unwrap();
        wait_until_zombie(dead, "the killed watchdog");
        let mut group = Group::spawn_guarded(Command::new("true"), GUARDED, Some(armed)).unwrap();
        assert!(group.wait().await.success());
        let fresh = group.watchdog.as_ref().unwrap().pid;
        assert_ne!(fresh, dead);
        assert_eq!(group.pgid, fresh);
        assert_eq!(state(dead), None, "the dead one is reaped");
    }

    /// One armed ahead for a command that is never started (a busy lease) stands down when
    /// dropped, and is reaped then, not left to whoever adopts it.
    #[test]
    fn a_watchdog_never_used_is_stood_down_and_reaped() {
        let armed = Watchdog::arm().unwrap();
        let pid = armed.pid;
        assert!(armed.alive());
        assert!(matches!(state(pid).as_deref(), Some(s) if s != "Z"));
        drop(armed);
        assert_eq!(state(pid), None);
    }
}
