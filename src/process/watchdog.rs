//! The watchdog of a command's process group: a process that SIGKILLs the group when leasectl
//! dies, however it dies.
//!
//! It is leasectl's own binary started afresh ([`Watchdog::arm`]): a [`super::spawn`] of
//! `/proc/self/exe` under the watchdog's title, which `main` hands to [`serve_if_asked`] before
//! anything else. Forked instead (as it still is where that exec fails), it would share every
//! page of leasectl's memory for the whole run, and each page leasectl wrote again would be
//! copied then, about sixty per run. It is armed ahead of the command it will guard, as `run`
//! does while its acquisition is answered, so its start overlaps the wait for the server.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;

use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use super::group::stat_fields;
use super::{resume, spawn};

/// Set in the environment of a leasectl started as a watchdog (with its title as `argv[0]`).
const MODE_VAR: &str = "LEASECTL_WATCHDOG";
/// The start of the watchdog's `argv[0]` and its `comm`.
const NAME: &str = "leasectl-watch";

/// A process that creates the child's process group and SIGKILLs that group when leasectl
/// dies.
///
/// It is started before the command and leads a new process group, which the command then
/// joins, so the command is never unguarded. It *stays* in that group, out of leasectl's own:
/// `kill -9 -- -$(leasectl's pgid)`, `timeout -s KILL`, a CI runner cancelling a step all
/// signal leasectl's group, and must not take the watchdog with them. It ignores the signals
/// a terminal or a supervisor sends to a group (INT, TERM, HUP, QUIT, TSTP, PIPE), so the only
/// things that end it are its pipe (below), SIGKILL (which leasectl sends the group only to
/// kill everything in it) and a cgroup kill.
///
/// It blocks reading a pipe whose only write end leasectl holds: end of file means leasectl
/// is gone (however it died, panics included) and the group is killed. Standing it down is a
/// SIGKILL to the watchdog alone (see its `Drop`). Forked, it makes only async-signal-safe system calls until `_exit`, so forking from
/// a multi-threaded process is sound. The group id is the watchdog's pid, which cannot be
/// reused while the watchdog lives, so it never kills a stranger's group.
pub struct Watchdog {
    /// The pipe's only write end; `None` once closed.
    write: Option<OwnedFd>,
    pub(super) pid: Pid,
}

/// The signals the watchdog ignores: those a terminal, `kill -- -PGID` without `-9`, or a
/// job runner send to stop a process group politely.
const WATCHDOG_IGNORES: [libc::c_int; 6] = [
    libc::SIGINT,
    libc::SIGTERM,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGTSTP,
    libc::SIGPIPE,
];

impl Watchdog {
    /// Starts the watchdog, the leader of a new process group for a command to join
    /// ([`super::Group::spawn_guarded`]): leasectl's binary started afresh, or forked where
    /// that fails (no `/proc`, say). Unit tests fork: their binary is the test harness.
    pub fn arm() -> io::Result<Watchdog> {
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        #[cfg(not(test))]
        if let Ok(pid) = Watchdog::exec(&read) {
            return Ok(Watchdog {
                write: Some(write),
                pid,
            });
        }
        Watchdog::fork(read, write)
    }

    /// Starts `/proc/self/exe` as the watchdog: its signals ignored, its streams on /dev/null,
    /// the pipe's read end as descriptor 3, in a new process group it leads. Returns once it
    /// has exec'd; [`serve_if_asked`] does the rest in it.
    #[cfg_attr(test, allow(dead_code))]
    fn exec(read: &OwnedFd) -> io::Result<Pid> {
        let null = nix::fcntl::open(
            "/dev/null",
            nix::fcntl::OFlag::O_RDWR | nix::fcntl::OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )?;
        // Above 3, so that moving them onto 0–3 in the child overwrites neither.
        let null = spawn::above(null, 10)?;
        let pipe = spawn::above(read.try_clone()?, 10)?;
        let (null_fd, pipe_fd) = (null.as_raw_fd(), pipe.as_raw_fd());
        let mut cmd = spawn::Command::new("/proc/self/exe");
        // leasectl's environment, as a fork's would be, so that whoever finds leasectl's
        // processes by a variable of theirs finds the watchdog too.
        cmd.arg0(title(std::process::id())).env(MODE_VAR, "1");
        // Named for leasectl's SIGCONT handler until it has exec'd, as any child that leaves
        // leasectl's group (see `resume`).
        let slot = resume::Slot::take();
        let cell = slot.cell();
        let setup = move || {
            resume::name_child(cell);
            // SAFETY: signal, dup2 and setpgid are async-signal-safe system calls (see
            // `spawn`); ignored dispositions survive the exec.
            unsafe {
                for sig in WATCHDOG_IGNORES {
                    libc::signal(sig, libc::SIG_IGN);
                }
                for (from, to) in [(null_fd, 0), (null_fd, 1), (null_fd, 2), (pipe_fd, 3)] {
                    if libc::dup2(from, to) < 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                if libc::setpgid(0, 0) != 0 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        };
        let (pid, _) = spawn::start(&cmd, &setup)?;
        drop(slot);
        Ok(Pid::from_raw(pid))
    }

    /// Forks the watchdog (see [`Watchdog::arm`]).
    fn fork(read: OwnedFd, write: OwnedFd) -> io::Result<Watchdog> {
        let read_fd = read.as_raw_fd();
        let write_fd = write.as_raw_fd();
        // Prepared before the fork, so that the child only copies bytes.
        let title = Title::prepare();
        // SAFETY: between fork and _exit the child calls only async-signal-safe functions
        // (getpid, close, open, dup2, the close_range syscall, getrlimit, prctl, signal, read,
        // kill, _exit) and writes to memory it owns: no allocation, no locks, nothing another
        // thread of leasectl could hold.
        match unsafe { libc::fork() } {
            -1 => Err(io::Error::last_os_error()),
            0 => unsafe {
                // No setpgid here: the parent creates the group right after fork, before it
                // spawns the command; doing it here too would only race with that.
                title.apply();
                libc::close(write_fd);
                // Keep nothing of leasectl open (its stdout may be a pipe someone waits on).
                let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
                if null >= 0 {
                    libc::dup2(null, 0);
                    libc::dup2(null, 1);
                    libc::dup2(null, 2);
                }
                if read_fd != 3 {
                    libc::dup2(read_fd, 3);
                }
                for sig in WATCHDOG_IGNORES {
                    libc::signal(sig, libc::SIG_IGN);
                }
                guard()
            },
            pid => {
                drop(read);
                // The group exists before the command is spawned into it, whether or not the
                // watchdog has run yet.
                nix::unistd::setpgid(Pid::from_raw(pid), Pid::from_raw(pid))?;
                Ok(Watchdog {
                    write: Some(write),
                    pid: Pid::from_raw(pid),
                })
            }
        }
    }
}

/// In a leasectl started as a watchdog ([`Watchdog::arm`]): guards, and never returns. Else
/// returns at once. `main` calls it first thing.
pub fn serve_if_asked() {
    if std::env::var_os(MODE_VAR).is_none()
        || !std::env::args_os()
            .next()
            .is_some_and(|a| a.as_bytes().starts_with(NAME.as_bytes()))
    {
        return;
    }
    // SAFETY: prctl with a static name; `guard` makes only system calls.
    unsafe {
        libc::prctl(
            libc::PR_SET_NAME,
            c"leasectl-watch".as_ptr() as libc::c_ulong,
            0,
            0,
            0,
        );
        guard()
    }
}

/// The watchdog's work once set up, with the pipe on descriptor 3: closes every other
/// descriptor above the standard streams, then blocks reading the pipe. End of file (leasectl is
/// gone) kills its whole process group, the command's.
///
/// # Safety
/// Async-signal-safe system calls only: it also runs in a forked child.
unsafe fn guard() -> ! {
    let own_pid = libc::getpid();
    if libc::syscall(libc::SYS_close_range, 4u32, u32::MAX, 0u32) != 0 {
        // Older kernels (< 5.9) or a seccomp filter: close one by one.
        let mut lim = libc::rlimit {
            rlim_cur: 1024,
            rlim_max: 1024,
        };
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        let top = lim.rlim_cur.min(65_536) as libc::c_int;
        for fd in 4..top {
            libc::close(fd);
        }
    }
    let mut byte = 0u8;
    loop {
        let n = libc::read(3, (&mut byte as *mut u8).cast(), 1);
        if n < 0 && *libc::__errno_location() == libc::EINTR {
            continue;
        }
        // Nothing is ever written: leasectl is gone. Kills the command's whole group, the
        // watchdog included.
        libc::kill(-own_pid, libc::SIGKILL);
        libc::_exit(0);
    }
}

/// The watchdog's title (its command line), naming the leasectl it guards.
fn title(leasectl: u32) -> String {
    format!("{NAME} (kills the command's group if leasectl pid {leasectl} dies)")
}

impl Watchdog {
    /// Whether it is still there to guard a command (one armed ahead may have been killed
    /// meanwhile, and a command cannot join the group of a process that is gone).
    pub fn alive(&self) -> bool {
        matches!(
            waitpid(self.pid, Some(WaitPidFlag::WNOHANG)),
            Ok(WaitStatus::StillAlive)
        )
    }
}

/// The watchdog's own name, so that `pgrep -f 'leasectl run …'`, `pidof leasectl` and `ps`
/// find the supervisor, not the watchdog (which ignores SIGTERM: an operator's `kill` must
/// reach leasectl, which forwards it). Its `comm` becomes `leasectl-watch`, and its command
/// line, the fork's copy of leasectl's argv, is overwritten in place.
struct Title {
    /// leasectl's argv strings in memory (`arg_start..arg_end` of /proc/self/stat).
    area: Option<(usize, usize)>,
    text: Vec<u8>,
}

impl Title {
    fn prepare() -> Title {
        // One read into a buffer that fits any stat line (a few hundred bytes), where
        // read_to_string probes with small reads, each making the kernel format the line again.
        let mut buf = [0u8; 4096];
        let stat = std::fs::File::open("/proc/self/stat")
            .and_then(|mut f| std::io::Read::read(&mut f, &mut buf))
            .ok()
            .and_then(|n| std::str::from_utf8(&buf[..n]).ok());
        let area = stat.and_then(|stat| {
            // state is field 3, arg_start 48 and arg_end 49.
            let mut rest = stat_fields(stat).skip(45);
            let start: usize = rest.next()?.parse().ok()?;
            let end: usize = rest.next()?.parse().ok()?;
            (end > start).then_some((start, end - start))
        });
        let text = title(std::process::id());
        Title {
            area,
            text: text.into_bytes(),
        }
    }

    /// In the forked watchdog only: renames it. Plain memory writes and one prctl.
    unsafe fn apply(&self) {
        libc::prctl(
            libc::PR_SET_NAME,
            c"leasectl-watch".as_ptr() as libc::c_ulong,
            0,
            0,
            0,
        );
        if let Some((start, len)) = self.area {
            let area = start as *mut u8;
            let n = self.text.len().min(len - 1);
            std::ptr::copy_nonoverlapping(self.text.as_ptr(), area, n);
            std::ptr::write_bytes(area.add(n), 0, len - n);
        }
    }
}

/// Dropping the watchdog (the run is over, the spawn failed, or the command was never started)
/// stands it down with a SIGKILL to it alone, and reaps it — except while panicking: then
/// leasectl's state is unknown, so the pipe just closes and the watchdog kills the group.
/// Nothing of its group needs it by then: a [`super::Group`] with a watchdog SIGKILLs its whole
/// group before it lets the watchdog go, and one never used leads a group of its own alone. A
/// SIGKILL, not a word through the pipe, because a watchdog that is still starting would read
/// the word only once it is up (a busy answer would wait for that). (Reaped, not left to
/// whoever adopts it once leasectl is gone: in a container, that may be a process that never
/// reaps.)
impl Drop for Watchdog {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = nix::sys::signal::kill(self.pid, nix::sys::signal::Signal::SIGKILL);
        }
        // Closed here, before the reap: while panicking, this end of file is the signal.
        self.write.take();
        let _ = waitpid(self.pid, None);
    }
}
