//! What a `run` needs of its machine besides the database: a shallow stack. Its big futures
//! are built on the heap (`src/heap.rs`); nested in the stack's frames they made a plain run
//! touch hundreds of KiB of stack, and touch every page again after each fork (the watchdog, the
//! command). A run started with a small stack limit overflows it, and aborts, if they are back.
//! And nothing a debugger or profiler refuses: a run under valgrind runs its command.

use std::os::unix::process::CommandExt;
use std::process::Command;

use crate::common::*;

/// The main thread's stack limit for these runs (`ulimit -s`): well below what the nested
/// frames took (more than 384 KiB optimized, more than 2 MiB unoptimized) and above what the
/// run takes now (at most 128 KiB optimized, 768 KiB unoptimized, where frames are several
/// times bigger).
const STACK: libc::rlim_t = if cfg!(debug_assertions) {
    1 << 20
} else {
    256 << 10
};

/// `cmd` with its stack limit lowered to [`STACK`].
fn small_stack(mut cmd: Command) -> Command {
    // SAFETY: getrlimit and setrlimit are async-signal-safe, and nothing else runs in the child
    // between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            let mut lim = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            if libc::getrlimit(libc::RLIMIT_STACK, &mut lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            lim.rlim_cur = STACK.min(lim.rlim_max);
            if libc::setrlimit(libc::RLIMIT_STACK, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

#[test]
fn a_run_fits_in_a_small_stack_whether_it_runs_waits_or_is_told_busy() {
    let env = Env::new();
    // A run that migrates the schema, then one that finds it current: each runs its command
    // and saves the run with its event.
    for word in ["first", "second"] {
        let o = small_stack(env.command())
            .args(["run", "--target", "t", "--", "echo", word])
            .output_in_time();
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        assert_eq!(stdout(&o), format!("{word}\n"));
    }
    // Told busy, and made to wait, while another run holds the target.
    let holder = env.hold("t", &env.gate());
    let o = small_stack(env.command())
        .args(["run", "--target", "t", "--", "true"])
        .output_in_time();
    assert_eq!(code(&o), 75, "{}", stderr(&o));
    let waiter = Watched::new(
        small_stack(env.command())
            .args(["run", "--target", "t", "--wait=60s", "--", "echo", "waited"])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_for("the waiter to queue", || {
        env.scalar("SELECT count(*) FROM waiters") == "1"
    });
    env.open_gate();
    assert_eq!(code(&finish(holder)), 0);
    let o = waiter.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(stdout(&o), "waited\n");
    // The two, the holder and the waiter.
    assert_eq!(env.scalar("SELECT count(*) FROM runs"), "4");
}

/// Valgrind runs a `clone` only as a thread, a `fork` or a `vfork`, and ends the whole program
/// on any other, such as the one that starts leasectl's children sharing its memory until their
/// `exec` (`src/process/spawn.rs`): under valgrind they are forked instead.
#[test]
fn a_run_under_valgrind_runs_its_command() {
    let Some(valgrind) = ["/usr/bin/valgrind", "/usr/local/bin/valgrind"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
    else {
        assert!(
            std::env::var_os("CI").is_none(),
            "valgrind is not installed; CI needs it for this test"
        );
        return;
    };
    let env = Env::new();
    let run = env.command();
    let mut cmd = Command::new(valgrind);
    cmd.args(["--tool=none", "-q"])
        .arg(run.get_program())
        .args(run.get_args());
    for (key, value) in run.get_envs() {
        match value {
            Some(v) => cmd.env(key, v),
            None => cmd.env_remove(key),
        };
    }
    let o = cmd
        .args([
            "run",
            "--target",
            "vg",
            "--",
            "sh",
            "-c",
            "echo \"$LEASECTL_TARGET\"",
        ])
        .output_in_time();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(stdout(&o), "vg\n");
    assert_eq!(
        env.scalar("SELECT count(*) FROM runs WHERE target = 'vg'"),
        "1"
    );
}
