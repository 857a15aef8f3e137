//! The child under supervision: output streaming and capture, stdin, environment, timeouts,
//! forwarded signals.

use std::io::Write;
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::*;

#[test]
fn binary_output_streams_live_and_round_trips_through_output() {
    let env = Env::new();
    let data: Vec<u8> = (0..=255u8).cycle().take(256 * 4).collect();
    let file = env.path("bin");
    std::fs::write(&file, &data).unwrap();
    let o = env.run(&["run", "--target", "b", "--", "cat", file.to_str().unwrap()]);
    assert_eq!(code(&o), 0);
    assert_eq!(o.stdout, data, "live stdout differs");
    let stored = env.run(&["output", "--target", "b"]);
    assert_eq!(code(&stored), 0);
    assert_eq!(stored.stdout, data, "stored stdout differs");
}

#[test]
fn stderr_is_captured_separately() {
    let env = Env::new();
    let o = env.run(&[
        "run",
        "--target",
        "e",
        "--",
        "sh",
        "-c",
        "echo out; echo err >&2",
    ]);
    assert_eq!(
        (stdout(&o).as_str(), stderr(&o).as_str()),
        ("out\n", "err\n")
    );
    assert_eq!(
        stdout(&env.run(&["output", "--target", "e", "--stderr"])),
        "err\n"
    );
    assert_eq!(stdout(&env.run(&["output", "--target", "e"])), "out\n");
}

#[test]
fn three_megabytes_stream_completely_and_are_stored_capped() {
    let env = Env::new();
    let data: Vec<u8> = (0..3 * 1024 * 1024)
        .map(|i: u32| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let file = env.path("big");
    std::fs::write(&file, &data).unwrap();
    let o = env.run(&[
        "run",
        "--target",
        "big",
        "--",
        "cat",
        file.to_str().unwrap(),
    ]);
    assert_eq!(code(&o), 0);
    assert_eq!(o.stdout.len(), data.len());
    assert!(o.stdout == data, "streamed output differs");
    let stored = env.run(&["output", "--target", "big"]);
    assert_eq!(stored.stdout.len(), 1024 * 1024);
    assert!(stored.stdout[..] == data[..1024 * 1024]);
    let runs: serde_json::Value =
        serde_json::from_slice(&env.run(&["runs", "--target", "big", "--json"]).stdout).unwrap();
    assert_eq!(runs["runs"][0]["stdout_truncated"], true);
    assert_eq!(runs["runs"][0]["stderr_truncated"], false);
    // A truncated result is never reused.
    let again = env.run(&[
        "run",
        "--target",
        "big",
        "--reuse-within",
        "1h",
        "--",
        "sh",
        "-c",
        "echo ran-again",
    ]);
    assert_eq!(stdout(&again), "ran-again\n", "{}", stderr(&again));
    assert_eq!(
        env.scalar("SELECT count(*) FROM runs"),
        "2",
        "{}",
        stderr(&again)
    );
}

#[test]
fn capture_limit_and_quiet() {
    let env = Env::new();
    let o = env.run(&[
        "run",
        "--target",
        "q",
        "--quiet",
        "--capture-limit",
        "4",
        "--",
        "sh",
        "-c",
        "echo 123456789",
    ]);
    assert_eq!(code(&o), 0);
    assert!(
        o.stdout.is_empty() && o.stderr.is_empty(),
        "quiet printed {:?}",
        o
    );
    assert_eq!(stdout(&env.run(&["output", "--target", "q"])), "1234");
}

#[test]
fn stdin_is_passed_through_and_the_environment_names_the_lease() {
    let env = Env::new();
    let mut child = env
        .command()
        .args([
            "run",
            "--target",
            "env",
            "--",
            "sh",
            "-c",
            "cat; echo \"$LEASECTL_TARGET $LEASECTL_FENCE $LEASECTL_TOKEN\"",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"from stdin\n")
        .unwrap();
    let o = finish(child);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let token = env.scalar("SELECT token FROM runs");
    assert_eq!(stdout(&o), format!("from stdin\nenv 1 {token}\n"));
}

#[test]
fn timeout_stops_a_child_that_ignores_sigterm_after_the_grace_and_exits_124() {
    let env = Env::new();
    let t = Instant::now();
    let o = env.run(&[
        "run",
        "--target",
        "slow",
        "--timeout",
        "300ms",
        "--kill-after",
        "700ms",
        "--",
        "sh",
        "-c",
        "trap '' TERM; sleep 30",
    ]);
    let took = t.elapsed();
    assert_eq!(code(&o), 124, "{}", stderr(&o));
    assert!(
        took >= Duration::from_millis(1000),
        "stopped after only {took:?}: no grace given"
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");
    assert_eq!(
        env.scalar("SELECT outcome || ':' || signal FROM runs"),
        "timed_out:9"
    );
    assert_eq!(
        env.scalar("SELECT payload->>'outcome' FROM outbox"),
        "timed_out"
    );
    assert_eq!(env.status()["targets"][0]["state"], "free");
}

#[test]
fn a_child_that_honours_sigterm_stops_within_the_grace() {
    let env = Env::new();
    let t = Instant::now();
    let o = env.run(&[
        "run",
        "--target",
        "slow",
        "--timeout",
        "200ms",
        "--kill-after",
        "20s",
        "--ttl",
        "1m",
        "--",
        "sleep",
        "30",
    ]);
    assert_eq!(code(&o), 124);
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "waited for the whole grace"
    );
    assert_eq!(
        env.scalar("SELECT outcome || ':' || signal FROM runs"),
        "timed_out:15"
    );
}

#[test]
fn sigterm_to_leasectl_is_forwarded_the_run_is_interrupted_and_the_lease_released() {
    let env = Env::new();
    let ready = env.path("ready");
    let got = env.path("got");
    let script = format!(
        "trap 'echo got-term > \"{}\"; exit 3' TERM; touch '{}'; while :; do sleep 0.05; done",
        got.display(),
        ready.display()
    );
    let holder = env.spawn(&["run", "--target", "sig", "--", "sh", "-c", &script]);
    wait_for_file_exists(&ready);
    kill(holder.id(), libc::SIGTERM);
    let o = finish(holder);
    assert_eq!(code(&o), 143, "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(&got).unwrap(), "got-term\n");
    assert_eq!(
        env.scalar("SELECT outcome || ':' || exit_code FROM runs"),
        "interrupted:3"
    );
    assert_eq!(env.status()["targets"][0]["state"], "free");
    // Released: the next run gets the lease at once.
    assert_eq!(code(&env.run(&["run", "--target", "sig", "--", "true"])), 0);
}

#[test]
fn sigint_to_a_waiting_leasectl_exits_130_without_running() {
    let env = Env::new();
    let holder = env.hold("w", "sleep 30");
    let waiter = Watched::new(env.spawn(&[
        "run",
        "--target",
        "w",
        "--wait",
        "-v",
        "--",
        "touch",
        env.path("waiter-ran").to_str().unwrap(),
    ]));
    // -v logs the wait; once it is logged the waiter is in its wait loop.
    waiter.wait_for_stderr("waiting for 'w'");
    kill(waiter.child.id(), libc::SIGINT);
    let o = waiter.finish();
    assert_eq!(code(&o), 130, "{}", stderr(&o));
    assert!(!env.path("waiter-ran").exists());
    env.stop(holder);
}

/// Runs `leasectl ARGS` under `script(1)`, i.e. on a pseudo-terminal, feeding `input`.
fn on_a_terminal(env: &Env, args: &[&str], input: &str) -> std::process::Output {
    let quote = |s: &str| format!("'{}'", s.replace('\'', "'\\''"));
    let mut line = vec![
        quote(bin().to_str().unwrap()),
        "--database-url".into(),
        quote(&env.url),
        "--schema".into(),
        quote(&env.schema),
    ];
    line.extend(args.iter().map(|a| quote(a)));
    let mut child = std::process::Command::new("script")
        .args(["-qefc", &line.join(" "), "/dev/null"])
        .env_remove("DATABASE_URL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("script(1) from util-linux is needed for terminal tests");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    finish(child)
}

#[test]
fn an_interactive_command_can_read_the_terminal() {
    // The child runs in its own process group; on a terminal it must be made the foreground
    // group, or its first read would stop it with SIGTTIN and the run would hang.
    let env = Env::new();
    let o = on_a_terminal(
        &env,
        &[
            "run",
            "--target",
            "tty",
            "--",
            "sh",
            "-c",
            "read answer; echo got-$answer",
        ],
        "yes\n",
    );
    assert_eq!(code(&o), 0, "{}", stdout(&o));
    assert!(stdout(&o).contains("got-yes"), "{:?}", stdout(&o));
    assert_eq!(
        env.scalar("SELECT convert_from(stdout, 'UTF8') FROM runs"),
        "got-yes\n"
    );
}

#[test]
fn waiting_shows_a_spinner_on_a_terminal_and_nothing_but_one_line_in_logs() {
    let env = Env::new();
    let holder = env.hold("w", "sleep 30");

    let tty = on_a_terminal(
        &env,
        &["run", "--target", "w", "--wait=1500ms", "--", "true"],
        "",
    );
    assert_eq!(code(&tty), 75, "{}", stdout(&tty));
    assert!(
        stdout(&tty).contains("waiting for 'w' (position 1 of 1; held by"),
        "{:?}",
        stdout(&tty)
    );
    assert!(
        stdout(&tty).contains(&format!("pid {}", holder.id())),
        "{:?}",
        stdout(&tty)
    );

    let log = env.run(&["run", "--target", "w", "--wait=500ms", "--", "true"]);
    assert_one_line_error(&log, 75, "gave up waiting for 'w'");
    assert!(
        !stderr(&log).contains('\x1b'),
        "escape codes in a log: {:?}",
        stderr(&log)
    );

    env.stop(holder);
}

#[test]
fn processes_the_command_leaves_running_are_stopped_when_it_completes() {
    // `cmd &` left behind would keep working after the lease is released: at-most-once
    // would no longer hold. It also holds the output pipes open.
    let env = Env::new();
    let pidfile = env.path("bg");
    let t = Instant::now();
    let script = format!(
        "sleep 30 & echo $! > '{}'; echo started-bg",
        pidfile.display()
    );
    let o = env.run(&["run", "--target", "bg", "--", "sh", "-c", &script]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(stdout(&o), "started-bg\n");
    assert!(
        stderr(&o).contains("left processes running"),
        "{}",
        stderr(&o)
    );
    let bg: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    wait_for("the left-behind process to be stopped", || !alive(bg));
    assert!(
        t.elapsed() < Duration::from_secs(15),
        "took {:?}",
        t.elapsed()
    );
    assert_eq!(
        stdout(&env.run(&["output", "--target", "bg"])),
        "started-bg\n"
    );
    assert_eq!(
        env.scalar("SELECT outcome || ':' || exit_code FROM runs"),
        "completed:0"
    );
}

#[test]
fn a_left_behind_process_that_ignores_sigterm_is_killed_after_the_grace() {
    let env = Env::new();
    let pidfile = env.path("bg");
    let script = format!(
        "(trap '' TERM; sleep 30) & echo $! > '{}'",
        pidfile.display()
    );
    let o = env.run(&[
        "run",
        "--target",
        "bg",
        "--kill-after",
        "300ms",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let bg: i32 = std::fs::read_to_string(&pidfile)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    wait_for("the left-behind process to be killed", || !alive(bg));
}

#[test]
fn quick_commands_never_find_the_watchdog_left_in_their_group() {
    // Regression: a watchdog scheduled late used to put itself back into the command's group
    // after leasectl had moved it out, so a run of `true` warned about left-behind processes
    // and waited out --kill-after (10s) for nothing. A race, so try it many times.
    let env = Env::new();
    for i in 0..30 {
        let o = env.run(&["run", "--no-event", "--target", "quick", "--", "true"]);
        assert_eq!(code(&o), 0, "run {i}: {}", stderr(&o));
        assert_eq!(stderr(&o), "", "run {i}");
    }
}
