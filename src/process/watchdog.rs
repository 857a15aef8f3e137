//! The watchdog of a command's process group: a forked process that SIGKILLs the group when
//! leasectl dies, however it dies.
//!
//! It can be forked ahead of the command it will guard ([`Watchdog::arm`], as `run` does before
//! it connects): a fork copies the page tables of everything leasectl has mapped, and every page
//! the two processes then share is copied again the first time leasectl writes to it. Forked
//! while leasectl is small, both are few; the memory leasectl allocates afterwards (the
//! connection, the run's state) is its own from the start.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use super::group::stat_fields;

/// A forked process that creates the child's process group and SIGKILLs that group when
/// leasectl dies.
///
/// It is forked before the command and leads a new process group, which the command then
/// joins, so the command is never unguarded. It *stays* in that group, out of leasectl's own:
/// `kill -9 -- -$(leasectl's pgid)`, `timeout -s KILL`, a CI runner cancelling a step all
/// signal leasectl's group, and must not take the watchdog with them. It ignores the signals
/// a terminal or a supervisor sends to a group (INT, TERM, HUP, QUIT, TSTP, PIPE), so the only
/// things that end it are its pipe (below), SIGKILL (which leasectl sends the group only to
/// kill everything in it) and a cgroup kill.
///
/// It blocks reading a pipe whose only write end leasectl holds: end of file means leasectl
/// is gone (however it died, panics included) and the group is killed; a byte means "stand
/// down". Between fork and `_exit` it makes only async-signal-safe system calls, so forking
/// from a multi-threaded process is sound. The group id is the watchdog's pid, which cannot be
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
    /// Forks the watchdog and makes it the leader of a new process group, for a command to
    /// join ([`super::Group::spawn_guarded`]).
    pub fn arm() -> io::Result<Watchdog> {
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
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
                let own_pid = libc::getpid();
                title.apply();
                libc::close(write_fd);
                // Keep nothing of leasectl open (its stdout may be a pipe someone waits on).
                let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
                if null >= 0 {
                    libc::dup2(null, 0);
                    libc::dup2(null, 1);
                    libc::dup2(null, 2);
                }
                let keep = if read_fd == 3 {
                    3
                } else {
                    libc::dup2(read_fd, 3)
                };
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
                for sig in WATCHDOG_IGNORES {
                    libc::signal(sig, libc::SIG_IGN);
                }
                let mut byte = 0u8;
                loop {
                    let n = libc::read(keep, (&mut byte as *mut u8).cast(), 1);
                    if n < 0 && *libc::__errno_location() == libc::EINTR {
                        continue;
                    }
                    if n != 1 {
                        // Kills the command's whole group, the watchdog included.
                        libc::kill(-own_pid, libc::SIGKILL);
                    }
                    libc::_exit(0);
                }
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
        let text = format!(
            "leasectl-watch (kills the command's group if leasectl pid {} dies)",
            std::process::id()
        );
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
/// tells it to exit without killing, and reaps it — except while panicking: then leasectl's
/// state is unknown, so the pipe just closes and the watchdog kills the group. (Reaped, not
/// left to whoever adopts it once leasectl is gone: in a container, that may be a process that
/// never reaps.)
impl Drop for Watchdog {
    fn drop(&mut self) {
        if let Some(write) = self.write.take() {
            if !std::thread::panicking() {
                let _ = nix::unistd::write(&write, b"x");
            }
            // Closed here, before the reap: while panicking, this end of file is the signal.
        }
        let _ = waitpid(self.pid, None);
    }
}
