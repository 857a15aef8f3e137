//! No command outlives its lease: each test reproduces one way a wrapped command
//! used to keep running without the lease, or leasectl used to hang while holding one, and
//! checks it cannot happen any more.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

/// Reads a pid a script wrote to `path`.
fn pid_in(path: &std::path::Path) -> i32 {
    wait_for_file(path).parse().unwrap()
}

/// A pipe whose reader is already gone, to hand to leasectl as stdout or stderr.
fn broken_pipe() -> std::os::fd::OwnedFd {
    let (read, write) = nix::unistd::pipe().unwrap();
    drop(read);
    write
}

/// A `psql` session holding the lease row of `target` locked (`SELECT … FOR NO KEY UPDATE` in
/// an open transaction): every statement that updates or locks that row (heartbeat, release,
/// the fenced save) hangs, as on a stuck server, until the session is dropped. Inserting a
/// run (whose foreign key only needs a KEY SHARE lock) still works.
struct RowLock(Child);

impl RowLock {
    fn new(env: &Env, target: &str) -> RowLock {
        let mut psql = Command::new("psql")
            .args([
                "-X",
                "-q",
                "-t",
                "-A",
                "-v",
                "ON_ERROR_STOP=1",
                "-d",
                &env.url,
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("psql runs");
        let stdin = psql.stdin.as_mut().unwrap();
        writeln!(
            stdin,
            "BEGIN; SELECT 'locked' FROM \"{}\".leases WHERE target = '{target}' FOR NO KEY UPDATE;",
            env.schema
        )
        .unwrap();
        stdin.flush().unwrap();
        let mut out = BufReader::new(psql.stdout.take().unwrap());
        let mut line = String::new();
        while line.trim() != "locked" {
            line.clear();
            assert!(out.read_line(&mut line).unwrap() > 0, "psql ended early");
        }
        RowLock(psql)
    }
}

impl Drop for RowLock {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Makes the next acquisition of `target` stall inside the database for `secs` after it has
/// taken the lease (a trigger sleeping in the acquiring statement's transaction): the lease
/// row's `heartbeat_at` is the statement's start, so by the time leasectl hears back, the
/// lease may have little or no time left.
fn stall_next_acquire(env: &Env, target: &str, secs: f64) {
    let o = env.run(&["migrate"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    env.sql(&format!(
        "CREATE TABLE stall (target text PRIMARY KEY, secs float8);
         INSERT INTO stall VALUES ('{target}', {secs});
         CREATE FUNCTION stall_acquire() RETURNS trigger LANGUAGE plpgsql AS $$
         DECLARE s float8;
         BEGIN
             DELETE FROM \"{schema}\".stall WHERE target = NEW.target RETURNING secs INTO s;
             IF s IS NOT NULL THEN PERFORM pg_sleep(s); END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER stall AFTER INSERT OR UPDATE OF token ON leases
             FOR EACH ROW WHEN (NEW.token IS NOT NULL) EXECUTE FUNCTION stall_acquire();",
        schema = env.schema
    ));
}

/// Cancels a statement still sleeping in [`stall_next_acquire`]'s trigger, so the schema can
/// be dropped at the end of the test without waiting for it.
fn cancel_stalls(env: &Env) {
    env.sql(&format!(
        "SELECT pg_cancel_backend(pid) FROM pg_stat_activity
          WHERE {} AND pid <> pg_backend_pid()",
        stalled(env)
    ));
}

/// The pg_stat_activity condition for this test's acquisitions sleeping in the trigger.
fn stalled(env: &Env) -> String {
    format!(
        "wait_event = 'PgSleep' AND query LIKE '%\"{}\".leases%'",
        env.schema
    )
}

#[test]
fn a_broken_stderr_neither_panics_nor_abandons_the_run() {
    // `leasectl run … 2>&1 >/dev/null | true`: the first diagnostic used to panic in
    // eprintln!, leaving the lease held, the run unstored and the command's children running.
    let env = Env::new();
    let bg = env.path("bg");
    let script = format!(
        "echo one >&2; sleep 0.5; echo two >&2; sleep 300 & echo $! > '{}'; exit 3",
        bg.display()
    );
    let mut leasectl = env.command();
    leasectl
        .args(["-v", "run", "--target", "t", "--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(broken_pipe());
    let mut child = leasectl.spawn().unwrap();
    let status = exits_within(&mut child, PATIENCE, "broken stderr");
    assert_eq!(status.code(), Some(3), "{status:?}");
    assert_eq!(
        env.scalar(
            "SELECT outcome || ':' || exit_code || ':' || convert_from(stderr, 'UTF8') FROM runs"
        ),
        "completed:3:one\ntwo\n"
    );
    assert_eq!(env.held_leases(), "0", "the lease must be released");
    let bg = pid_in(&bg);
    wait_for("the left-behind sleep to be stopped", || !alive(bg));
}

#[test]
fn sigkill_to_leasectls_whole_process_group_kills_the_commands_grandchildren() {
    // `kill -9 -- -PGID`, `timeout -s KILL`, a CI runner cancelling a step: the watchdog used
    // to sit in leasectl's group and die with it, leaving `a` of `sh -c 'a & b'` running.
    let env = Env::new();
    let bg = env.path("bg");
    let script = format!("sleep 300 & echo $! > '{}'; wait", bg.display());
    let mut leasectl = env.command();
    leasectl
        .args(["run", "--target", "g", "--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0);
    let mut child = leasectl.spawn().unwrap();
    let grandchild = pid_in(&bg);
    kill(child.id(), 0); // still there
                         // SAFETY: plain kill(2) of the process group leasectl leads.
    unsafe {
        libc::kill(-(child.id() as i32), libc::SIGKILL);
    }
    let _ = child.wait();
    wait_for("the grandchild to be killed by the watchdog", || {
        !alive(grandchild)
    });
}

#[test]
fn a_command_is_not_started_when_the_acquire_came_back_too_late_to_stop_it_in_time() {
    // The acquiring statement stalls past the lease's TTL: by the time leasectl hears it got
    // the lease, another holder may already have it. It must not start the command.
    let env = Env::new();
    stall_next_acquire(&env, "late", 1.5);
    let marker = env.path("ran");
    let script = format!("touch '{}'", marker.display());
    let o = env.run(&[
        "run",
        "--target",
        "late",
        "--ttl",
        "1s",
        "--kill-after",
        "100ms",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    assert_eq!(code(&o), 76, "{}", stderr(&o));
    assert_one_line_error(&o, 76, "was not started");
    assert!(!marker.exists(), "the command ran on an expired lease");
    // And the lease is free for the next caller at once (the late holder released it).
    let o = env.run(&["run", "--target", "late", "--ttl", "1s", "--", "true"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

#[test]
fn a_waiter_whose_acquire_came_back_too_late_acquires_again_and_runs() {
    // With --wait, a lease that ran out before the start is not the end: leasectl releases it,
    // acquires afresh (a higher fence) and runs the command on a lease it can still stop.
    let env = Env::new();
    stall_next_acquire(&env, "late", 1.5);
    let o = env.run(&[
        "run",
        "--target",
        "late",
        "--ttl",
        "1s",
        "--kill-after",
        "100ms",
        "--wait=30s",
        "--",
        "sh",
        "-c",
        "echo fence=$LEASECTL_FENCE",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(stdout(&o), "fence=2\n");
    assert!(stderr(&o).contains("waiting again"), "{}", stderr(&o));
}

#[test]
fn sigterm_to_a_waiter_whose_acquire_is_stuck_ends_it_without_running_the_command() {
    let env = Env::new();
    stall_next_acquire(&env, "stuck", 30.0);
    let marker = env.path("ran");
    let script = format!("touch '{}'", marker.display());
    let mut waiter = env
        .command()
        .args([
            "run", "--target", "stuck", "--wait", "--", "sh", "-c", &script,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the acquire to stall in the database", || {
        env.scalar(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE {}",
            stalled(&env)
        )) != "0"
    });
    kill(waiter.id(), libc::SIGTERM);
    let status = exits_within(
        &mut waiter,
        Duration::from_secs(10),
        "SIGTERM while acquiring",
    );
    assert_eq!(status.code(), Some(143));
    cancel_stalls(&env);
    assert!(!marker.exists(), "the command ran after SIGTERM");
}

#[test]
fn wait_with_a_limit_ends_even_while_the_acquire_is_stuck() {
    let env = Env::new();
    stall_next_acquire(&env, "stuck", 30.0);
    let mut waiter = env
        .command()
        .args(["run", "--target", "stuck", "--wait=1s", "--", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = exits_within(
        &mut waiter,
        Duration::from_secs(10),
        "--wait=1s while acquiring",
    );
    cancel_stalls(&env);
    assert_eq!(status.code(), Some(75));
}

#[test]
fn a_stop_that_starts_late_grants_no_grace_past_the_lease() {
    // leasectl paused (SIGSTOP) past the TTL: on resume, its SIGKILL time has already passed,
    // so the command is killed at once — no SIGTERM and no fresh --kill-after of overlap
    // with the next holder.
    let env = Env::new();
    let log = env.path("log");
    let pidfile = env.path("pid");
    let script = format!(
        "trap 'echo TERM >> {log}' TERM; echo $$ > '{pid}'; while :; do sleep 0.05; done",
        log = log.display(),
        pid = pidfile.display()
    );
    let mut holder = env
        .command()
        .args([
            "run",
            "--target",
            "p",
            "--ttl",
            "4s",
            "--heartbeat",
            "500ms",
            "--kill-after",
            "2500ms",
            "--",
            "sh",
            "-c",
            &script,
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let command = pid_in(&pidfile);
    kill(holder.id(), libc::SIGSTOP);
    // Past the TTL on the database's clock: someone else could have the lease now.
    wait_for("the paused holder's lease to expire", || {
        env.scalar("SELECT heartbeat_at + ttl_ms * interval '1 ms' < now() FROM leases") == "t"
    });
    kill(holder.id(), libc::SIGCONT);
    let resumed = Instant::now();
    wait_for("the command to be killed", || !alive(command));
    let took = resumed.elapsed();
    let status = exits_within(&mut holder, PATIENCE, "resumed holder");
    assert_eq!(status.code(), Some(76));
    assert!(
        !std::fs::read_to_string(&log)
            .unwrap_or_default()
            .contains("TERM"),
        "the command was sent SIGTERM and a grace after the lease's deadline had passed"
    );
    assert!(
        took < Duration::from_millis(2000),
        "the command lived {took:?} after leasectl resumed (the grace is 2.5s)"
    );
}

#[test]
fn a_lease_lost_to_a_silent_database_ends_with_76_without_waiting_for_it() {
    // Heartbeats, and the release after the loss, hang on a locked lease row as on a stuck
    // server. leasectl stops the command, records the lost run (best-effort, bounded) and
    // exits 76 while the database is still silent.
    let env = Env::new();
    let pidfile = env.path("pid");
    let mut holder = env
        .command()
        .args([
            "run",
            "--target",
            "s",
            "--ttl",
            "2s",
            "--",
            "sh",
            "-c",
            &format!("echo $$ > '{}'; exec sleep 300", pidfile.display()),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let command = pid_in(&pidfile);
    let lock = RowLock::new(&env, "s");
    let status = exits_within(
        &mut holder,
        Duration::from_secs(25),
        "lost lease, silent DB",
    );
    let mut err = String::new();
    std::io::Read::read_to_string(holder.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(76), "{err}");
    assert!(!alive(command));
    assert_eq!(env.scalar("SELECT outcome FROM runs"), "lost", "{err}");
    drop(lock);
}

#[test]
fn a_save_that_the_database_never_answers_gives_up_with_69() {
    let env = Env::new();
    assert_eq!(code(&env.run(&["migrate"])), 0);
    let mut holder = env
        .command()
        .args([
            "run",
            "--target",
            "v",
            "--ttl",
            "2s",
            "--",
            "sh",
            "-c",
            &env.gate(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the lease to be held", || env.held_leases() == "1");
    let lock = RowLock::new(&env, "v");
    env.open_gate();
    // Well before the server's own statement_timeout (30s) could end the wait.
    let status = exits_within(&mut holder, Duration::from_secs(25), "stuck save");
    let mut err = String::new();
    std::io::Read::read_to_string(holder.stderr.as_mut().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(69), "{err}");
    assert!(err.contains("could not be stored"), "{err}");
    drop(lock);
}

#[test]
fn a_closed_stdout_reaches_the_command_as_a_broken_pipe() {
    // `leasectl run -- yes | head -2` used to run forever: leasectl swallowed EPIPE and kept
    // draining, so `yes` never got SIGPIPE and the lease was held for good.
    let env = Env::new();
    let mut leasectl = env
        .command()
        .args(["run", "--target", "y", "--", "yes"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(leasectl.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line, "y\n");
    drop(out);
    let status = exits_within(&mut leasectl, Duration::from_secs(20), "yes | head");
    assert_eq!(
        status.code(),
        Some(141),
        "yes must die of SIGPIPE, as without leasectl"
    );
    assert_eq!(
        env.scalar("SELECT outcome || ':' || signal FROM runs"),
        "completed:13"
    );
    assert_eq!(env.held_leases(), "0");
}

#[test]
fn a_helper_that_keeps_stdout_open_neither_holds_leasectl_nor_costs_the_lease() {
    // The README's advice for a process that must outlive the run is `setsid`; such a helper
    // inherits stdout and may keep writing to it. leasectl must stop reading after a bounded
    // drain, keep heartbeating meanwhile, and store the command's success.
    let env = Env::new();
    let helper = env.path("helper");
    let script = format!(
        // The command waits until the helper has left the group: before that it would be
        // stopped as a left-behind process.
        "setsid sh -c 'echo $$ > {h}; while :; do echo tick; sleep 0.05; done' &
         while [ ! -s {h} ]; do sleep 0.01; done; echo done",
        h = helper.display()
    );
    let mut leasectl = env
        .command()
        .args([
            "run",
            "--target",
            "h",
            "--ttl",
            "1s",
            "--kill-after",
            "300ms",
            "--",
            "sh",
            "-c",
            &script,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let helper_pid = pid_in(&helper);
    let mut out = leasectl.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut out, &mut s);
    });
    let status = exits_within(&mut leasectl, Duration::from_secs(20), "setsid helper");
    kill(helper_pid as u32, libc::SIGKILL);
    let _ = reader.join();
    assert_eq!(status.code(), Some(0));
    assert_eq!(env.scalar("SELECT outcome FROM runs"), "completed");
}

#[test]
fn a_capture_limit_beyond_what_postgresql_can_store_is_a_usage_error() {
    let env = Env::new();
    let o = env.run(&[
        "run",
        "--target",
        "c",
        "--capture-limit",
        "2GiB",
        "--",
        "true",
    ]);
    assert_one_line_error(&o, 2, "--capture-limit");
    let o = env.run(&[
        "run",
        "--target",
        "c",
        "--capture-limit",
        "256MiB",
        "--",
        "true",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

/// Makes the lease table's statements for `target` slow: each heartbeat of it takes `secs`
/// longer inside the database (a trigger that sleeps after the row is locked), while
/// `heartbeat_at` still records the statement's start.
fn slow_heartbeats(env: &Env, target: &str, secs: f64) {
    let o = env.run(&["migrate"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    env.sql(&format!(
        "CREATE FUNCTION slow_heartbeat() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.target = '{target}' AND NEW.token = OLD.token THEN PERFORM pg_sleep({secs}); END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER slow BEFORE UPDATE OF heartbeat_at ON leases
             FOR EACH ROW EXECUTE FUNCTION slow_heartbeat();"
    ));
}

/// Holds the lease row locked until `command` (a pid) is dead, then returns whether it died
/// before the lease could expire, judged on the database's clock from the last heartbeat
/// the database recorded, and how long after that heartbeat it was seen dead.
fn died_before_expiry(env: &Env, target: &str, command: i32, ttl: Duration) -> (bool, String) {
    let rt = runtime();
    rt.block_on(async {
        let mut client = leasectl::db::Settings::new(Some(&env.url))
            .unwrap()
            .open_client()
            .await
            .unwrap();
        let tx = client.transaction().await.unwrap();
        let q = format!(
            "SELECT heartbeat_at::text FROM \"{}\".leases WHERE target = '{target}' FOR NO KEY UPDATE",
            env.schema
        );
        let last: String = tx.query_one(&q, &[]).await.unwrap().get(0);
        while alive(command) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let q = format!(
            "SELECT clock_timestamp() - '{last}'::timestamptz < interval '{} milliseconds',
                    (clock_timestamp() - '{last}'::timestamptz)::text",
            ttl.as_millis()
        );
        let row = tx.query_one(&q, &[]).await.unwrap();
        tx.rollback().await.unwrap();
        (row.get(0), row.get(1))
    })
}

/// Starts a holder of `target` (`run_args` between the target and `--`) whose command ignores
/// SIGTERM, and returns it with the command's pid.
fn hold_ignoring_sigterm(env: &Env, target: &str, run_args: &[&str]) -> (Child, i32) {
    let pidfile = env.path(&format!("pid-{target}"));
    let script = format!(
        "trap '' TERM; echo $$ > '{}'; while :; do sleep 0.05; done",
        pidfile.display()
    );
    let holder = env
        .command()
        .args(["run", "--target", target])
        .args(run_args)
        .args(["--", "sh", "-c", &script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    (holder, pid_in(&pidfile))
}

/// Silences the database for `target` and asserts that the command was SIGKILLed before the
/// lease could expire (TTL 2s) and that leasectl then exited 76.
fn assert_killed_before_expiry(env: &Env, target: &str, holder: Child, command: i32) {
    let (in_time, age) = died_before_expiry(env, target, command, Duration::from_secs(2));
    assert!(
        in_time,
        "the command was still alive {age} after the last heartbeat (ttl 2s)"
    );
    assert_eq!(code(&finish(holder)), 76);
}

#[test]
fn a_command_that_ignores_sigterm_is_killed_before_a_silent_databases_lease_expires() {
    // The grace after a lost lease is bounded by the lease: SIGTERM, and SIGKILL a margin
    // before the TTL can run out, even for a command that ignores SIGTERM.
    let env = Env::new();
    let (holder, command) =
        hold_ignoring_sigterm(&env, "g", &["--ttl", "2s", "--kill-after", "600ms"]);
    assert_killed_before_expiry(&env, "g", holder, command);
}

#[test]
fn the_stop_is_timed_from_the_send_of_the_last_good_heartbeat_not_its_answer() {
    // Heartbeats that take 600ms to be answered: the database dated each at its start (about
    // when it was sent). Timing the stop from the answer would SIGKILL 600ms too late.
    let env = Env::new();
    slow_heartbeats(&env, "s", 0.6);
    let (holder, command) = hold_ignoring_sigterm(
        &env,
        "s",
        &[
            "--ttl",
            "2s",
            "--heartbeat",
            "300ms",
            "--kill-after",
            "500ms",
        ],
    );
    // Let a few slow heartbeats succeed first.
    wait_for("a slow heartbeat to be confirmed", || {
        env.scalar("SELECT heartbeat_at > acquired_at FROM leases WHERE target = 's'") == "t"
    });
    assert_killed_before_expiry(&env, "s", holder, command);
}

#[test]
fn a_panic_mid_run_is_one_line_exit_70_and_the_command_dies_with_leasectl() {
    // A bug must not leave the command running without supervision: the panic unwinds, and the
    // group is killed (by the group's drop, and by the watchdog whose pipe closed).
    let env = Env::new();
    let bg = env.path("bg");
    let trigger = env.path("panic-now");
    let script = format!(
        "sleep 300 & echo $! > '{}'; touch '{}'; wait",
        bg.display(),
        trigger.display()
    );
    let o = env
        .command()
        .env("LEASECTL_TEST_PANIC", &trigger)
        .args(["run", "--target", "p", "--", "sh", "-c", &script])
        .output()
        .unwrap();
    assert_eq!(code(&o), 70, "{}", stderr(&o));
    let err = stderr(&o);
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.starts_with("leasectl: internal error: LEASECTL_TEST_PANIC"),
        "{err}"
    );
    assert!(!err.contains("RUST_BACKTRACE"), "{err}");
    let bg = pid_in(&bg);
    wait_for("the grandchild to die with leasectl", || !alive(bg));
}

/// Pids whose command line contains `needle`, from /proc.
fn pids_with_cmdline(needle: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| {
                    String::from_utf8_lossy(&c)
                        .replace('\0', " ")
                        .contains(needle)
                })
                .unwrap_or(false)
        })
        .collect()
}

#[test]
fn pgrep_for_the_run_finds_leasectl_not_its_watchdog() {
    // The watchdog ignores SIGTERM; were it to look like leasectl, `kill $(pgrep -n -f 'leasectl
    // run --target X')` would hit it instead of the supervisor, and nothing would stop.
    let env = Env::new();
    let target = format!("pgrep-{}", std::process::id());
    let holder = env.hold(&target, &env.gate());
    let found = pids_with_cmdline(&format!("run --target {target}"));
    assert_eq!(
        found,
        vec![holder.id() as i32],
        "pgrep -f would find {found:?}"
    );
    let watch = pids_with_cmdline(&format!("leasectl pid {} dies", holder.id()));
    assert_eq!(watch.len(), 1, "{watch:?}");
    let comm = std::fs::read_to_string(format!("/proc/{}/comm", watch[0])).unwrap();
    assert_eq!(comm.trim(), "leasectl-watch");
    env.open_gate();
    assert_eq!(code(&finish(holder)), 0);
}

#[test]
fn the_watchdog_is_started_afresh_not_forked() {
    // Forked, the watchdog would share every page of leasectl's memory for the whole run, and
    // each page leasectl wrote again would be copied then. Started afresh (leasectl's binary
    // again, as the watchdog) it holds none of it. Its environment tells: leasectl's with the
    // variable that makes it the watchdog, where a fork's would be leasectl's as it started. It
    // still leads the command's group.
    let env = Env::new();
    let target = format!("afresh-{}", std::process::id());
    let holder = env.hold(&target, &env.gate());
    let watch = pids_with_cmdline(&format!("leasectl pid {} dies", holder.id()));
    assert_eq!(watch.len(), 1, "{watch:?}");
    let environ = std::fs::read(format!("/proc/{}/environ", watch[0])).unwrap();
    let vars: Vec<&[u8]> = environ.split(|&b| b == 0).collect();
    assert!(
        vars.contains(&&b"LEASECTL_WATCHDOG=1"[..]),
        "the watchdog's environment is leasectl's as it started: it was forked"
    );
    assert!(
        vars.iter().any(|v| v.starts_with(b"PATH=")),
        "leasectl's environment is not passed on"
    );
    // SAFETY: getpgid(2) on a live process of this test.
    assert_eq!(unsafe { libc::getpgid(watch[0]) }, watch[0]);
    env.open_gate();
    assert_eq!(code(&finish(holder)), 0);
}

#[test]
fn the_command_dies_when_leasectl_and_its_watchdog_are_killed_together() {
    // `pkill -9 leasectl` matches the watchdog's name too: with the watchdog gone first, only
    // the command's own PR_SET_PDEATHSIG still stops it when leasectl dies.
    let env = Env::new();
    let child_pid = env.path("child");
    let script = format!("echo $$ > '{}'; exec sleep 300", child_pid.display());
    let holder = env.spawn(&["run", "--target", "both", "--", "sh", "-c", &script]);
    let child: i32 = wait_for_file(&child_pid).parse().unwrap();
    let watch = pids_with_cmdline(&format!("leasectl pid {} dies", holder.id()));
    assert_eq!(watch.len(), 1, "{watch:?}");
    kill(watch[0] as u32, libc::SIGKILL);
    wait_for("the watchdog to die", || !alive(watch[0]));
    assert!(alive(child), "the command died with its watchdog alone");
    kill(holder.id(), libc::SIGKILL);
    finish(holder);
    wait_for("the command to die with leasectl", || !alive(child));
}

#[test]
fn a_busy_answer_stands_its_watchdog_down_and_reaps_it() {
    // The plain run starts its command's watchdog while the acquisition is answered; when the
    // lease is busy, that watchdog must neither outlive leasectl nor be left for an init that
    // may never reap it.
    // Orphans of this test's processes are adopted by this process, where they can be seen.
    // SAFETY: a plain prctl(2) on this process.
    assert_eq!(
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) },
        0
    );
    let env = Env::new();
    let holder = env.hold("busy-watch", &env.gate());
    let mut busy = env
        .command()
        .args(["run", "--target", "busy-watch", "--", "true"])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = busy.id();
    assert_eq!(busy.wait().unwrap().code(), Some(75));
    assert_eq!(
        pids_with_cmdline(&format!("leasectl pid {pid} dies")),
        Vec::<i32>::new(),
        "the busy caller's watchdog is still there"
    );
    let me = std::process::id().to_string();
    let adopted: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
        .filter(|stat| {
            let (comm, rest) = stat.rsplit_once(')').unwrap_or_default();
            comm.ends_with("(leasectl-watch") && rest.split_whitespace().nth(1) == Some(&me)
        })
        .collect();
    assert!(adopted.is_empty(), "left for its adopter: {adopted:?}");
    env.open_gate();
    assert_eq!(code(&finish(holder)), 0);
}

#[test]
fn an_acquire_given_up_on_that_commits_later_is_the_waiters_own_lease_not_a_ghost() {
    // The acquiring statement stalls past the client's 10 s statement deadline: the waiter gives
    // up on it and tries again, but the stalled statement still commits and takes the lease.
    // With a fresh token per attempt that lease was a ghost nobody held, and the waiter waited
    // out its TTL (5 minutes here); with one token for all attempts it is the waiter's own.
    let env = Env::new();
    stall_next_acquire(&env, "ghost", 11.0);
    let o = env
        .command()
        .args([
            "run",
            "--target",
            "ghost",
            "--ttl",
            "5m",
            "--wait=40s",
            "--",
            "echo",
            "ran",
        ])
        .output_within(Duration::from_secs(90));
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(stdout(&o), "ran\n");
    assert!(
        stderr(&o).contains("did not answer in time") || stderr(&o).contains("reconnecting"),
        "{}",
        stderr(&o)
    );
    assert_eq!(env.held_leases(), "0");
    cancel_stalls(&env);
}
