//! A lease taken from a holder whose command may still run — `release --force`, `release --token`
//! during a step, `--replace` — is free for nobody until that holder has stopped (it records its
//! run) or its own deadline (last heartbeat + TTL) has passed: not for a waiter, not for the next
//! `--replace`, not after the replacement died or was replaced in turn. Each test runs an old
//! command that ignores SIGTERM and logs a tick every 20 ms until its SIGKILL, so its whole grace
//! is visible, and checks that every other command started after its last tick.

use std::process::Child;
use std::time::{Duration, Instant};

use crate::common::*;

/// A command that ignores SIGTERM and appends `NAME <ns>` to `log` every 20 ms until killed.
fn ticking(name: &str, log: &std::path::Path) -> String {
    format!(
        "trap '' TERM; while :; do echo \"{name} $(date +%s%N)\" >> '{}'; sleep 0.02; done",
        log.display()
    )
}

/// A command that appends `NAME <ns>` to `log` once, at its start.
fn starting(name: &str, log: &std::path::Path) -> String {
    format!("echo \"{name} $(date +%s%N)\" >> '{}'", log.display())
}

/// The timestamps of `log`'s lines for `name`.
fn stamps(log: &std::path::Path, name: &str) -> Vec<u128> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix(&format!("{name} ")))
        .map(|t| t.trim().parse().unwrap())
        .collect()
}

/// Asserts that `later` started (once) after the last tick of `old`.
fn no_overlap(log: &std::path::Path, old: &str, later: &str) {
    let (olds, news) = (stamps(log, old), stamps(log, later));
    let text = std::fs::read_to_string(log).unwrap_or_default();
    assert!(!olds.is_empty(), "{old} never ticked:\n{text}");
    assert_eq!(news.len(), 1, "{later} did not start once:\n{text}");
    let last = *olds.iter().max().unwrap();
    assert!(
        last < news[0],
        "{later} started {} ms before {old}'s last tick:\n{text}",
        (last - news[0]) / 1_000_000
    );
}

/// An old holder of `target`: TTL 10 s, heartbeats minutes apart (only the announced release
/// stops it soon), a 2 s grace it spends entirely, since its command ignores SIGTERM.
fn old_holder(env: &Env, target: &str, log: &std::path::Path) -> Child {
    env.hold_with(
        env.command(),
        target,
        &["--ttl", "20s", "--heartbeat", "5s", "--kill-after", "2s"],
        &ticking("old", log),
    )
}

fn spawn_run(env: &Env, args: &[&str], script: &str) -> Watched {
    let mut all = vec!["-v", "run"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--", "sh", "-c", script]);
    Watched::new(env.spawn(&all))
}

/// How many waiters `target` has in the table.
fn queued(env: &Env, target: &str) -> usize {
    env.scalar(&format!(
        "SELECT count(*) FROM waiters WHERE target = '{target}'"
    ))
    .parse()
    .unwrap()
}

#[test]
fn a_waiter_starts_only_after_a_force_released_holder_has_spent_its_grace() {
    let env = Env::new();
    let log = env.path("log");
    let old = old_holder(&env, "t", &log);
    let waiter = spawn_run(
        &env,
        &["--target", "t", "--wait=60s"],
        &starting("new", &log),
    );
    wait_for("the waiter to queue", || queued(&env, "t") == 1);
    let released = Instant::now();
    let o = env.run(&["release", "--target", "t", "--force"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stdout(&o).contains("the holder stopped and recorded run"),
        "{}",
        stdout(&o)
    );
    let w = waiter.finish();
    assert_eq!(code(&w), 0, "{}", stderr(&w));
    assert_eq!(code(&finish(old)), 76);
    no_overlap(&log, "old", "new");
    // And no needless wait: the old holder's deadline (its last heartbeat + 20 s) was far off;
    // the waiter went once the old command had been killed, after its 2 s grace.
    assert!(
        released.elapsed() < Duration::from_secs(12),
        "the waiter waited {:?}, as if for the old deadline",
        released.elapsed()
    );
    // While the old holder was stopping, `status` said so.
}

#[test]
fn a_plain_run_is_busy_while_a_force_released_holder_is_stopping_and_says_why() {
    let env = Env::new();
    let log = env.path("log");
    let old = old_holder(&env, "t", &log);
    let o = env.run(&["release", "--target", "t", "--force", "--no-wait"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    // The old command is in its grace now (it ignores SIGTERM).
    let o = env.run(&[
        "run",
        "--target",
        "t",
        "--",
        "sh",
        "-c",
        &starting("new", &log),
    ]);
    assert_eq!(code(&o), 75, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("is still stopping its command"),
        "{}",
        stderr(&o)
    );
    let s = env.status();
    assert_eq!(s["targets"][0]["state"], "stopping", "{s}");
    assert_eq!(code(&finish(old)), 76);
    // Once it has stopped, the target is free at once.
    let o = env.run(&[
        "run",
        "--target",
        "t",
        "--",
        "sh",
        "-c",
        &starting("new", &log),
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    no_overlap(&log, "old", "new");
}

#[test]
fn a_replacement_killed_while_waiting_leaves_the_old_holders_stop_to_be_waited_for() {
    let env = Env::new();
    let log = env.path("log");
    let old = old_holder(&env, "t", &log);
    let waiter = spawn_run(
        &env,
        &["--target", "t", "--ttl", "1s", "--wait=60s"],
        &starting("waiter", &log),
    );
    wait_for("the waiter to queue", || queued(&env, "t") == 1);
    let replacer = spawn_run(
        &env,
        &["--target", "t", "--ttl", "1s", "--replace"],
        &starting("replacer", &log),
    );
    replacer.wait_for_stderr("waiting for it to stop");
    kill(replacer.child.id(), libc::SIGKILL);
    let w = waiter.finish();
    assert_eq!(code(&w), 0, "{}", stderr(&w));
    assert_eq!(code(&finish(old)), 76);
    no_overlap(&log, "old", "waiter");
    assert!(
        stamps(&log, "replacer").is_empty(),
        "the killed replacement ran"
    );
}

#[test]
fn a_replacement_paused_while_waiting_leaves_the_old_holders_stop_to_be_waited_for() {
    let env = Env::new();
    let log = env.path("log");
    let old = old_holder(&env, "t", &log);
    let waiter = spawn_run(
        &env,
        &["--target", "t", "--ttl", "1s", "--wait=60s"],
        &starting("waiter", &log),
    );
    wait_for("the waiter to queue", || queued(&env, "t") == 1);
    let replacer = spawn_run(
        &env,
        &["--target", "t", "--ttl", "1s", "--replace"],
        &starting("replacer", &log),
    );
    replacer.wait_for_stderr("waiting for it to stop");
    kill(replacer.child.id(), libc::SIGSTOP);
    let w = waiter.finish();
    kill(replacer.child.id(), libc::SIGCONT);
    assert_eq!(code(&w), 0, "{}", stderr(&w));
    assert_eq!(code(&finish(old)), 76);
    let r = replacer.finish();
    assert_eq!(code(&r), 76, "{}", stderr(&r));
    no_overlap(&log, "old", "waiter");
    assert!(
        stamps(&log, "replacer").is_empty(),
        "the paused replacement ran"
    );
}

#[test]
fn a_second_replace_waits_for_the_original_holder_and_not_a_moment_longer() {
    let env = Env::new();
    let log = env.path("log");
    let old = old_holder(&env, "t", &log);
    let taken = Instant::now();
    // Equal TTLs: the first replacement's own deadline is as far off as the original's.
    let first = spawn_run(
        &env,
        &["--target", "t", "--ttl", "20s", "--replace"],
        &starting("first", &log),
    );
    first.wait_for_stderr("waiting for it to stop");
    let second = spawn_run(
        &env,
        &["--target", "t", "--ttl", "20s", "--replace"],
        &starting("second", &log),
    );
    let s = second.finish();
    assert_eq!(code(&s), 0, "{}", stderr(&s));
    let f = first.finish();
    assert_eq!(code(&f), 76, "{}", stderr(&f));
    assert_eq!(code(&finish(old)), 76);
    no_overlap(&log, "old", "second");
    assert!(
        stamps(&log, "first").is_empty(),
        "the replaced replacement ran"
    );
    // The original stopped after its 2 s grace; its deadline was 20 s after its last heartbeat,
    // and the first replacement's 20 s after the take.
    assert!(
        taken.elapsed() < Duration::from_secs(12),
        "the second replacement waited {:?}, as if for a deadline",
        taken.elapsed()
    );
}

#[test]
fn a_replace_of_a_force_released_holder_waits_for_its_stop() {
    let env = Env::new();
    let log = env.path("log");
    let old = old_holder(&env, "t", &log);
    let o = env.run(&["release", "--target", "t", "--force", "--no-wait"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let r = env.run(&[
        "run",
        "--target",
        "t",
        "--replace",
        "--",
        "sh",
        "-c",
        &starting("new", &log),
    ]);
    assert_eq!(code(&r), 0, "{}", stderr(&r));
    assert!(
        stderr(&r).contains("is stopping") && stderr(&r).contains("waiting for it to stop"),
        "{}",
        stderr(&r)
    );
    assert_eq!(code(&finish(old)), 76);
    no_overlap(&log, "old", "new");
}

#[test]
fn release_token_during_a_step_stops_the_step_before_anyone_else_starts() {
    let env = Env::new();
    let log = env.path("log");
    let a = env.run(&[
        "acquire", "--target", "t", "--ttl", "20s", "--format", "json",
    ]);
    assert_eq!(code(&a), 0, "{}", stderr(&a));
    let lease: serde_json::Value = serde_json::from_slice(&a.stdout).unwrap();
    let token = lease["token"].as_str().unwrap().to_owned();
    let started = env.path("started-step");
    let step = spawn_run(
        &env,
        &["--target", "t", "--token", &token, "--kill-after", "2s"],
        &format!("touch '{}'; {}", started.display(), ticking("old", &log)),
    );
    wait_for_file_exists(&started);
    let waiter = spawn_run(
        &env,
        &["--target", "t", "--wait=60s"],
        &starting("new", &log),
    );
    wait_for("the waiter to queue", || queued(&env, "t") == 1);
    let o = env.run(&["release", "--target", "t", "--token", &token]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stdout(&o).contains("while a step ran") && stdout(&o).contains("stopped"),
        "{}",
        stdout(&o)
    );
    let w = waiter.finish();
    assert_eq!(code(&w), 0, "{}", stderr(&w));
    assert_eq!(code(&step.finish()), 76);
    no_overlap(&log, "old", "new");
}

/// With `--max-holders`, every place whose holder was force-released is taken by nobody until
/// that holder has stopped — also not by a caller with another N, which is busy (75), not a
/// usage error, while the old holders are only stopping.
#[test]
fn force_released_places_stay_taken_until_their_holders_have_stopped() {
    let env = Env::new();
    let log = env.path("log");
    let holders: Vec<Child> = (0..2)
        .map(|i| {
            let started = env.path(&format!("started-{i}"));
            let c = env
                .command()
                .args(["run", "--target", "pool", "--max-holders", "2"])
                .args(["--ttl", "20s", "--heartbeat", "5s", "--kill-after", "2s"])
                .args(["--", "sh", "-c"])
                .arg(format!(
                    "touch '{}'; {}",
                    started.display(),
                    ticking(&format!("old{i}"), &log)
                ))
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            wait_for_file_exists(&started);
            c
        })
        .collect();
    let o = env.run(&["release", "--target", "pool", "--force", "--no-wait"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    for extra in [&["--max-holders", "2"][..], &[][..]] {
        let mut args = vec!["run", "--target", "pool"];
        args.extend_from_slice(extra);
        args.extend_from_slice(&["--", "true"]);
        let o = env.run(&args);
        assert_eq!(code(&o), 75, "{extra:?}: {}", stderr(&o));
    }
    for h in holders {
        assert_eq!(code(&finish(h)), 76);
    }
    let o = env.run(&[
        "run",
        "--target",
        "pool",
        "--",
        "sh",
        "-c",
        &starting("new", &log),
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    no_overlap(&log, "old0", "new");
    no_overlap(&log, "old1", "new");
}
