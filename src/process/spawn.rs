//! Starting a child process without copying leasectl: a `clone` whose child shares leasectl's
//! memory until its `exec`, as `posix_spawn` starts one, but with leasectl's own steps between
//! the two (the process group, `PR_SET_PDEATHSIG`, the terminal; see [`super::group`]), which
//! `posix_spawn` cannot run.
//!
//! A `fork` copies the page tables of everything leasectl has mapped, and afterwards every page
//! the two processes shared is write-protected: each page leasectl writes again (its stack, its
//! heap, while it supervises the command and saves the run) takes a fault, also after the child
//! has exec'd. A run's command started that way cost about 45 page faults and the copy, on the
//! path between the acquisition and the save.
//!
//! What the child may do before `exec` is therefore narrow: it runs on a stack of its own
//! (`STACK`), reads what the parent prepared (the program, `argv`, `envp`, the descriptors to
//! move), makes only async-signal-safe system calls, and allocates nothing. It shares the
//! parent's thread-local `errno` too: a failing call in the child writes it, so the parent,
//! blocked in `read` meanwhile, never looks at `errno` while the child may run (it retries a
//! failed `read` of the report pipe without asking why; a pipe's `read` can only be
//! interrupted). Signal handlers are leasectl's code in leasectl's memory, so the parent blocks
//! every signal around the `clone`, and the child resets every caught signal to its default
//! before it unblocks them.
//!
//! The parent waits for the `exec` by reading a close-on-exec pipe: end of file once the child
//! has exec'd, four bytes (the `errno`) if it could not. That `read` can be interrupted, so
//! leasectl's SIGCONT handler still runs while it waits (see `resume`); a `vfork`-style
//! `CLONE_VFORK` would suspend leasectl where no handler runs.

use std::ffi::{c_char, c_int, c_void, CString, OsStr, OsString};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::Mutex;
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::net::unix::pipe;

/// What a child's standard stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stdio {
    /// leasectl's own.
    Inherit,
    /// A pipe, the parent's end in [`Child`].
    Piped,
}

/// A program to start: its path (or a name to look up in `PATH`, as `execvp` does), `argv`,
/// the variables added to leasectl's environment, and its standard streams.
#[derive(Debug, Clone)]
pub struct Command {
    program: OsString,
    argv: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    stdio: [Stdio; 3],
}

impl Command {
    /// `program` with `argv[0]` the same, no arguments, leasectl's environment and streams.
    pub fn new(program: impl AsRef<OsStr>) -> Command {
        let program = program.as_ref().to_owned();
        Command {
            argv: vec![program.clone()],
            program,
            env: Vec::new(),
            stdio: [Stdio::Inherit; 3],
        }
    }

    /// The name the program sees as its `argv[0]`.
    pub fn arg0(&mut self, name: impl AsRef<OsStr>) -> &mut Command {
        self.argv[0] = name.as_ref().to_owned();
        self
    }

    pub fn arg(&mut self, arg: impl AsRef<OsStr>) -> &mut Command {
        self.argv.push(arg.as_ref().to_owned());
        self
    }

    pub fn args<I, S>(&mut self, args: I) -> &mut Command
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.argv
            .extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// Sets a variable in the child's environment (over leasectl's value, if it has one).
    pub fn env(&mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> &mut Command {
        self.env
            .push((key.as_ref().to_owned(), value.as_ref().to_owned()));
        self
    }

    pub fn envs<I, K, V>(&mut self, vars: I) -> &mut Command
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        for (k, v) in vars {
            self.env(k, v);
        }
        self
    }

    pub fn stdin(&mut self, how: Stdio) -> &mut Command {
        self.stdio[0] = how;
        self
    }

    pub fn stdout(&mut self, how: Stdio) -> &mut Command {
        self.stdio[1] = how;
        self
    }

    pub fn stderr(&mut self, how: Stdio) -> &mut Command {
        self.stdio[2] = how;
        self
    }
}

/// A started child, not yet reaped until [`Child::wait`] or [`Child::try_wait`] saw it exit.
/// One dropped before that is reaped by a later spawn once it has exited.
pub struct Child {
    pid: i32,
    /// Readable once the child has exited; `None` on kernels without `pidfd_open` (before
    /// Linux 5.3), where [`Child::wait`] polls instead.
    pidfd: Option<AsyncFd<OwnedFd>>,
    status: Option<ExitStatus>,
    pub stdin: Option<pipe::Sender>,
    pub stdout: Option<pipe::Receiver>,
    pub stderr: Option<pipe::Receiver>,
}

impl Child {
    pub fn id(&self) -> u32 {
        self.pid.unsigned_abs()
    }

    /// Waits for the child to exit and reaps it. Cancel-safe.
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        loop {
            if let Some(status) = self.try_wait()? {
                return Ok(status);
            }
            match &self.pidfd {
                Some(fd) => {
                    let mut ready = fd.readable().await?;
                    // Readable means exited. A wake-up before that (none is known) just waits
                    // again.
                    if let Some(status) = reap(self.pid)? {
                        drop(ready);
                        self.status = Some(status);
                        return Ok(status);
                    }
                    ready.clear_ready();
                }
                None => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
    }

    /// The child's status if it has exited (reaping it), without waiting.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        if self.status.is_none() {
            self.status = reap(self.pid)?;
        }
        Ok(self.status)
    }

    /// SIGKILL to the child, unless it has been reaped (its pid may be another's then).
    pub fn start_kill(&mut self) -> io::Result<()> {
        if self.status.is_none() {
            // SAFETY: kill on our own, unreaped child.
            if unsafe { libc::kill(self.pid, libc::SIGKILL) } != 0 {
                return Err(io::Error::last_os_error());
            }
        }
        Ok(())
    }
}

/// A child dropped unreaped is left to `ORPHANS` (its supervisor has killed it, or lets it
/// run on, as a relay's cancelled delivery does with what the command left behind): a
/// long-running relay would otherwise collect zombies.
impl Drop for Child {
    fn drop(&mut self) {
        if self.status.is_none() {
            if let Ok(mut orphans) = ORPHANS.lock() {
                orphans.push(self.pid);
            }
        }
    }
}

/// Children dropped before they were reaped; each [`spawn`] reaps those that have exited.
static ORPHANS: Mutex<Vec<i32>> = Mutex::new(Vec::new());

fn reap_orphans() {
    let Ok(mut orphans) = ORPHANS.lock() else {
        return;
    };
    orphans.retain(|&pid| matches!(reap(pid), Ok(None)));
}

/// Reaps child `pid` if it has exited: its status, or `None` while it runs.
fn reap(pid: i32) -> io::Result<Option<ExitStatus>> {
    let mut raw: c_int = 0;
    // SAFETY: waitpid on a child of ours, into a local.
    match unsafe { libc::waitpid(pid, &mut raw, libc::WNOHANG) } {
        0 => Ok(None),
        -1 => Err(io::Error::last_os_error()),
        _ => Ok(Some(ExitStatus::from_raw(raw))),
    }
}

/// The stack the child runs on until its `exec`: mapped once, with a guard page below it, and
/// held (the lock) by one spawn at a time. 64 KiB: the child's steps are a few system calls,
/// and `execvp`'s `PATH` search takes a path's length on it.
static STACK: Mutex<Option<Stack>> = Mutex::new(None);

const STACK_SIZE: usize = 64 * 1024;

struct Stack {
    base: *mut c_void,
}

// SAFETY: the mapping is used by one spawn at a time, under STACK's lock.
unsafe impl Send for Stack {}

impl Stack {
    fn map() -> io::Result<Stack> {
        let page = 4096;
        // SAFETY: a fresh anonymous mapping; its lowest page becomes the guard.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                STACK_SIZE + page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the first page of the mapping just made.
        if unsafe { libc::mprotect(base, page, libc::PROT_NONE) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Stack { base })
    }

    /// The top (stacks grow down), 16-byte aligned.
    fn top(&self) -> *mut c_void {
        // SAFETY: one past the end of the mapping (guard page + STACK_SIZE).
        unsafe { self.base.cast::<u8>().add(4096 + STACK_SIZE).cast() }
    }
}

/// All the child reads, prepared by the parent and alive until the child has exec'd.
struct Plan<'a> {
    program: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
    /// (from, to): descriptors to move onto the standard streams; `from` is -1 for none.
    moves: [(RawFd, RawFd); 3],
    /// The write end of the report pipe.
    report: RawFd,
    setup: &'a dyn Fn() -> io::Result<()>,
}

/// Starts `cmd`, running `setup` in the child just before its `exec`; returns once the child
/// has exec'd (or with the error that kept it from doing so: a missing program is
/// `NotFound`). `setup` runs in the child on a small stack of its own, sharing leasectl's
/// memory: only async-signal-safe calls, no allocation, no locks (see the module docs).
pub fn spawn(cmd: &Command, setup: &dyn Fn() -> io::Result<()>) -> io::Result<Child> {
    reap_orphans();
    let (pid, [stdin, stdout, stderr]) = start(cmd, setup)?;
    let pidfd = pidfd_open(pid)
        // SAFETY: the AsyncFd owns the descriptor: it stays open, the same one, as long as it
        // is registered.
        .map(|fd| unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) })
        .transpose()?;
    Ok(Child {
        pid,
        pidfd,
        status: None,
        stdin: stdin.map(pipe::Sender::from_owned_fd).transpose()?,
        stdout: stdout.map(pipe::Receiver::from_owned_fd).transpose()?,
        stderr: stderr.map(pipe::Receiver::from_owned_fd).transpose()?,
    })
}

/// [`spawn`] without the runtime: the child's pid and the parent's ends of its piped streams,
/// for a caller that waits for the child itself (the watchdog).
pub fn start(
    cmd: &Command,
    setup: &dyn Fn() -> io::Result<()>,
) -> io::Result<(i32, [Option<OwnedFd>; 3])> {
    let program = c_string(&cmd.program)?;
    let argv_owned = cmd
        .argv
        .iter()
        .map(|a| c_string(a))
        .collect::<io::Result<Vec<_>>>()?;
    let env_owned = environment(&cmd.env)?;
    let argv = null_terminated(&argv_owned);
    let envp = null_terminated(&env_owned);

    let mut ours: [Option<OwnedFd>; 3] = [None, None, None];
    let mut theirs: Vec<OwnedFd> = Vec::new();
    let mut moves = [(-1, -1); 3];
    for (i, how) in cmd.stdio.iter().enumerate() {
        if *how == Stdio::Piped {
            let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
            let (mine, child) = if i == 0 { (write, read) } else { (read, write) };
            let child = above(child, 3)?;
            moves[i] = (child.as_raw_fd(), i as RawFd);
            ours[i] = Some(mine);
            theirs.push(child);
        }
    }
    let (report_read, report_write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let report_write = above(report_write, 3)?;
    let plan = Plan {
        program: program.as_ptr(),
        argv: argv.as_ptr(),
        envp: envp.as_ptr(),
        moves,
        report: report_write.as_raw_fd(),
        setup,
    };

    let mut stack = STACK
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if stack.is_none() {
        *stack = Some(Stack::map()?);
    }
    let top = stack.as_ref().map_or(std::ptr::null_mut(), Stack::top);
    // SAFETY: blocking every signal of this thread around the clone, restored below; the child
    // runs `child_main` on its own stack with `plan`, which outlives it (see `Plan`).
    let pid = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        let arg = std::ptr::from_ref(&plan).cast_mut().cast();
        let pid = if under_valgrind() {
            match libc::fork() {
                0 => child_main(arg),
                pid => pid,
            }
        } else {
            libc::clone(child_main, top, libc::CLONE_VM | libc::SIGCHLD, arg)
        };
        let cloned = if pid < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(pid)
        };
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        cloned
    }?;
    drop(theirs);
    drop(report_write);
    if let Some(errno) = read_report(&report_read) {
        let mut raw: c_int = 0;
        // SAFETY: the child reported and exits; reaped here, before its stack is reused.
        unsafe { libc::waitpid(pid, &mut raw, 0) };
        return Err(io::Error::from_raw_os_error(errno));
    }
    // The child has exec'd: nothing of leasectl's memory is in use by it any more.
    drop(stack);
    drop((plan, argv, envp, argv_owned, env_owned, program));
    Ok((pid, ours))
}

/// Whether leasectl runs under valgrind, which runs a `clone` only as a thread, a `fork` or a
/// `vfork` and ends the whole program on any other: there the child is forked, as before.
/// Valgrind preloads its own library into every program it runs.
fn under_valgrind() -> bool {
    static UNDER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *UNDER.get_or_init(|| {
        std::env::var_os("LD_PRELOAD")
            .is_some_and(|p| p.as_bytes().windows(9).any(|w| w == b"vgpreload"))
    })
}

/// Reads the report pipe until the child has exec'd (end of file: `None`) or reported why it
/// could not (`Some(errno)`). Never looks at `errno` (the child may be writing it): a failed
/// `read` of a pipe is an interruption, and is retried.
fn read_report(fd: &OwnedFd) -> Option<i32> {
    let mut buf = [0u8; 4];
    let mut got = 0;
    loop {
        // SAFETY: reading into the rest of a local buffer.
        let n = unsafe {
            libc::read(
                fd.as_raw_fd(),
                buf[got..].as_mut_ptr().cast(),
                buf.len() - got,
            )
        };
        match n {
            0 => return (got == buf.len()).then(|| i32::from_ne_bytes(buf)),
            n if n > 0 => {
                got += n.unsigned_abs();
                if got == buf.len() {
                    return Some(i32::from_ne_bytes(buf));
                }
            }
            _ => continue,
        }
    }
}

/// The child, from `clone` to `exec`. Returns only by `_exit`.
extern "C" fn child_main(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the parent's `Plan`, alive until the report pipe closes.
    let plan = unsafe { &*arg.cast::<Plan<'_>>() };
    // SAFETY: see `prepare_and_exec`.
    let errno = unsafe { prepare_and_exec(plan) };
    let bytes = errno.to_ne_bytes();
    // SAFETY: a write to the report pipe and _exit: async-signal-safe system calls.
    unsafe {
        libc::write(plan.report, bytes.as_ptr().cast(), bytes.len());
        libc::_exit(127)
    }
}

/// Resets the signals, moves the standard streams, runs the caller's setup and execs; returns
/// the `errno` of whatever failed.
///
/// # Safety
/// Only in the child of [`spawn`]'s `clone`, with every signal blocked.
unsafe fn prepare_and_exec(plan: &Plan<'_>) -> i32 {
    let errno = || {
        io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EINVAL)
    };
    // Leasectl's handlers must not run in the child: every caught signal back to its default,
    // and SIGPIPE too (leasectl ignores it; a command expects to die of it). What leasectl
    // inherited as ignored stays ignored, as with any exec.
    let mut current: libc::sigaction = std::mem::zeroed();
    let mut default: libc::sigaction = std::mem::zeroed();
    default.sa_sigaction = libc::SIG_DFL;
    for sig in 1..=64 {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        if libc::sigaction(sig, std::ptr::null(), &mut current) != 0 {
            continue;
        }
        if sig == libc::SIGPIPE
            || (current.sa_sigaction != libc::SIG_DFL && current.sa_sigaction != libc::SIG_IGN)
        {
            libc::sigaction(sig, &default, std::ptr::null_mut());
        }
    }
    // A child starts with no signal blocked.
    let mut none: libc::sigset_t = std::mem::zeroed();
    libc::sigemptyset(&mut none);
    libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
    for (from, to) in plan.moves {
        if from >= 0 && libc::dup2(from, to) < 0 {
            return errno();
        }
    }
    if let Err(e) = (plan.setup)() {
        return e.raw_os_error().unwrap_or(libc::EINVAL);
    }
    libc::execvpe(plan.program, plan.argv, plan.envp);
    errno()
}

/// The child's environment: leasectl's, with `added` set over it (a later value of the same
/// name wins).
fn environment(added: &[(OsString, OsString)]) -> io::Result<Vec<CString>> {
    let mut vars: Vec<(OsString, OsString)> = std::env::vars_os()
        .filter(|(k, _)| !added.iter().any(|(a, _)| a == k))
        .collect();
    for (k, v) in added {
        vars.retain(|(have, _)| have != k);
        vars.push((k.clone(), v.clone()));
    }
    vars.into_iter()
        .map(|(k, v)| {
            let mut kv = k.into_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            CString::new(kv).map_err(|_| nul_error())
        })
        .collect()
}

fn c_string(s: &OsStr) -> io::Result<CString> {
    CString::new(s.as_bytes()).map_err(|_| nul_error())
}

fn nul_error() -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        "an argument or variable contains a NUL byte",
    )
}

fn null_terminated(strings: &[CString]) -> Vec<*const c_char> {
    strings
        .iter()
        .map(|s| s.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect()
}

/// `fd` numbered `min` or above: itself if it is, else a close-on-exec copy (and `fd` closed).
/// Descriptors the child moves onto its standard streams must be above them: a leasectl
/// started with one of them closed gets such a number for a new pipe, which moving the streams
/// would then overwrite.
pub(super) fn above(fd: OwnedFd, min: RawFd) -> io::Result<OwnedFd> {
    if fd.as_raw_fd() >= min {
        return Ok(fd);
    }
    // SAFETY: F_DUPFD_CLOEXEC makes a new descriptor that we then own.
    let new = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_DUPFD_CLOEXEC, min) };
    if new < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `new` is a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}

/// A descriptor that becomes readable when `pid` exits, if the kernel has `pidfd_open`.
fn pidfd_open(pid: i32) -> Option<OwnedFd> {
    // SAFETY: the pidfd_open system call (its descriptors are close-on-exec, and it takes no
    // other flag we need); a non-negative result is a new descriptor we own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    let fd = RawFd::try_from(fd).ok().filter(|fd| *fd >= 0)?;
    // SAFETY: as above.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn a_child_gets_its_arguments_environment_and_pipes() {
        let mut cmd = Command::new("sh");
        cmd.arg0("renamed")
            .arg("-c")
            .arg(
                "read line; name=$(tr '\\0' '\\n' < /proc/$$/cmdline | head -n 1); \
                 echo \"$name $0 $1 $LEASECTL_SPAWN_TEST $line\"; echo oops >&2; exit 3",
            )
            .arg("zero")
            .arg("one")
            .env("LEASECTL_SPAWN_TEST", "set")
            .stdin(Stdio::Piped)
            .stdout(Stdio::Piped)
            .stderr(Stdio::Piped);
        let mut child = spawn(&cmd, &|| Ok(())).unwrap();
        // Every kernel this runs on has pidfd_open (5.3 and later): the exit is awaited, not
        // polled for.
        assert!(child.pidfd.is_some(), "no pidfd for the child");
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(b"fed\n").await.unwrap();
        drop(stdin);
        let (mut out, mut err) = (String::new(), String::new());
        child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .await
            .unwrap();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .await
            .unwrap();
        let status = child.wait().await.unwrap();
        assert_eq!(out, "renamed zero one set fed\n");
        assert_eq!(err, "oops\n");
        assert_eq!(status.code(), Some(3));
        assert_eq!(
            child.try_wait().unwrap(),
            Some(status),
            "the same status again"
        );
    }

    #[tokio::test]
    async fn a_missing_program_is_not_found_and_a_failed_setup_is_reported() {
        let missing = spawn(&Command::new("/nonexistent/leasectl-test"), &|| Ok(()));
        assert_eq!(missing.err().unwrap().kind(), io::ErrorKind::NotFound);
        let unnamed = spawn(&Command::new("leasectl-no-such-program"), &|| Ok(()));
        assert_eq!(unnamed.err().unwrap().kind(), io::ErrorKind::NotFound);
        let refused = spawn(&Command::new("true"), &|| {
            Err(io::Error::from_raw_os_error(libc::EPERM))
        });
        assert_eq!(refused.err().unwrap().raw_os_error(), Some(libc::EPERM));
    }

    /// The child does not inherit leasectl's handlers nor its ignored SIGPIPE: a command
    /// writing to a closed pipe dies of SIGPIPE, as it would started by a shell.
    #[tokio::test]
    async fn sigpipe_is_back_to_its_default_in_the_child() {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg("exec 3>&1; exec yes >&3")
            .stdout(Stdio::Piped);
        let mut child = spawn(&cmd, &|| Ok(())).unwrap();
        drop(child.stdout.take());
        let status = child.wait().await.unwrap();
        assert_eq!(status.signal(), Some(libc::SIGPIPE));
    }

    /// A child dropped unreaped does not stay a zombie past the next spawn after its exit.
    #[tokio::test]
    async fn a_dropped_child_is_reaped_by_a_later_spawn() {
        let child = spawn(&Command::new("true"), &|| Ok(())).unwrap();
        let pid = child.pid;
        drop(child);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let mut done = spawn(&Command::new("true"), &|| Ok(())).unwrap();
            done.wait().await.unwrap();
            if std::fs::metadata(format!("/proc/{pid}")).is_err() {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{pid} is still there");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
