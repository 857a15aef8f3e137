//! `--replace`: cancel-in-progress without overlap. The old holder is told at once,
//! stops its command, records its run `preempted` and exits 76; the replacement starts its own
//! command only after that — or once the old lease would have expired anyway.

use std::time::Duration;

use crate::common::*;

/// Timestamps (`date +%s%N`) of the lines of `log` starting with `tag`.
fn stamps(log: &str, tag: &str) -> Vec<u128> {
    log.lines()
        .filter_map(|l| l.strip_prefix(tag))
        .map(|t| t.trim().parse().unwrap())
        .collect()
}

#[test]
fn the_replacement_starts_only_after_the_old_child_that_ignores_sigterm_is_dead() {
    let env = Env::new();
    let log = env.path("log");
    // The old child ignores SIGTERM and writes a timestamp every 20ms until SIGKILLed; its
    // heartbeats are minutes apart, so only the announcement can stop it soon.
    let old = env.hold_with(
        env.command(),
        "deploy",
        &[
            "--ttl",
            "10m",
            "--heartbeat",
            "3m",
            "--kill-after",
            "2s",
            "--label",
            "old-sha",
        ],
        &format!(
            "trap '' TERM; while :; do echo \"old $(date +%s%N)\" >> '{}'; sleep 0.02; done",
            log.display()
        ),
    );
    let o = env.run(&[
        "run",
        "--target",
        "deploy",
        "--replace",
        "--label",
        "new-sha",
        "--",
        "sh",
        "-c",
        &format!("echo \"new $(date +%s%N)\" >> '{}'", log.display()),
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("waiting for it to stop"),
        "{}",
        stderr(&o)
    );
    let old = finish(old);
    assert_eq!(code(&old), 76, "{}", stderr(&old));
    assert!(
        stderr(&old).contains("taken by --replace") && stderr(&old).contains("[new-sha]"),
        "{}",
        stderr(&old)
    );

    // No overlap: every line the old child wrote is older than the new child's start.
    let text = std::fs::read_to_string(&log).unwrap();
    let (olds, news) = (stamps(&text, "old "), stamps(&text, "new "));
    assert!(!olds.is_empty() && news.len() == 1, "{text}");
    assert!(olds.iter().all(|t| *t < news[0]), "overlap:\n{text}");

    // runs: the old run is `preempted` by the new one's fence, which is higher.
    let rows = env.sql(
        "SELECT fence, outcome, preempted_by, label FROM runs WHERE target = 'deploy' ORDER BY fence",
    );
    assert_eq!(rows.len(), 2, "{rows:?}");
    let (old_run, new_run) = (&rows[0], &rows[1]);
    assert_eq!(old_run[1].as_deref(), Some("preempted"));
    assert_eq!(
        old_run[2], new_run[0],
        "preempted_by names the replacement's fence"
    );
    assert_eq!(old_run[3].as_deref(), Some("old-sha"));
    assert_eq!(new_run[1].as_deref(), Some("completed"));
    // A preempted run publishes nothing; the replacement's result does.
    assert_eq!(env.scalar("SELECT count(*) FROM outbox"), "1");
    let listed = env.run(&["runs", "--target", "deploy"]);
    assert!(stdout(&listed).contains(&format!("preempted by {}", new_run[0].as_deref().unwrap())));
}

#[test]
fn without_notifications_the_old_holder_stops_at_its_heartbeat_and_the_replacement_waits() {
    use_pooler();
    let env = Env::new();
    let log = env.path("log");
    let old = env.hold_with(
        env.command(),
        "p",
        &["--ttl", "20s", "--heartbeat", "1s", "--kill-after", "1s"],
        &format!(
            "trap '' TERM; while :; do echo \"old $(date +%s%N)\" >> '{}'; sleep 0.02; done",
            log.display()
        ),
    );
    let o = env.run(&[
        "run",
        "--target",
        "p",
        "--replace",
        "--",
        "sh",
        "-c",
        &format!("echo \"new $(date +%s%N)\" >> '{}'", log.display()),
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(code(&finish(old)), 76);
    let text = std::fs::read_to_string(&log).unwrap();
    let (olds, news) = (stamps(&text, "old "), stamps(&text, "new "));
    assert!(olds.iter().all(|t| *t < news[0]), "overlap:\n{text}");
}

/// The old holder was SIGKILLed (its watchdog killed its command): nobody records a stop, so the
/// replacement waits until the old lease would have expired, then runs.
#[test]
fn a_replaced_holder_that_was_killed_is_waited_out_until_its_lease_expires() {
    let env = Env::new();
    let log = env.path("log");
    let mut old = env.hold_with(
        env.command(),
        "k",
        &["--ttl", "6s"],
        &format!(
            "trap '' TERM; while :; do echo \"old $(date +%s%N)\" >> '{}'; sleep 0.02; done",
            log.display()
        ),
    );
    kill(old.id(), libc::SIGKILL);
    let _ = old.wait();
    let o = env.run(&[
        "-v",
        "run",
        "--target",
        "k",
        "--replace",
        "--",
        "sh",
        "-c",
        &format!("echo \"new $(date +%s%N)\" >> '{}'", log.display()),
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("recorded no stop, but its lease has expired"),
        "{}",
        stderr(&o)
    );
    let text = std::fs::read_to_string(&log).unwrap();
    let (olds, news) = (stamps(&text, "old "), stamps(&text, "new "));
    assert!(olds.iter().all(|t| *t < news[0]), "overlap:\n{text}");
}

#[test]
fn replacing_an_idle_acquired_lease_does_not_wait_and_its_token_is_dead() {
    let env = Env::new();
    let o = env.run(&[
        "acquire", "--target", "a", "--ttl", "10m", "--format", "json",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let token = doc["token"].as_str().unwrap().to_owned();
    // Well within the 10 minutes an old holder could otherwise still run.
    let o = env
        .command()
        .args(["run", "--target", "a", "--replace", "--", "true"])
        .output_within(Duration::from_secs(60));
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    for args in [
        vec!["run", "--target", "a", "--token", &token, "--", "true"],
        vec!["release", "--target", "a", "--token", &token],
    ] {
        let o = env.run(&args);
        assert_eq!(code(&o), 76, "{args:?}: {}", stderr(&o));
    }
}

#[test]
fn with_max_holders_the_oldest_holder_is_replaced() {
    let env = Env::new();
    let flags = [
        "--max-holders",
        "2",
        "--ttl",
        "10m",
        "--heartbeat",
        "3m",
        "--kill-after",
        "2s",
    ];
    let oldest = env.hold_with(env.command(), "pool", &flags, "exec sleep 300");
    std::fs::remove_file(env.path("started-pool")).unwrap();
    let younger = env.hold_with(env.command(), "pool", &flags, "exec sleep 300");
    let mut args = vec!["run", "--target", "pool", "--replace"];
    args.extend_from_slice(&flags);
    args.extend_from_slice(&["--", "sh", "-c", "echo $LEASECTL_HOLDER_INDEX"]);
    let o = env.run(&args);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let oldest = finish(oldest);
    assert_eq!(code(&oldest), 76, "{}", stderr(&oldest));
    // The younger holder runs on.
    let mut younger = younger;
    assert!(younger.try_wait().unwrap().is_none());
    assert_eq!(
        env.scalar("SELECT count(*) FROM runs WHERE outcome = 'preempted'"),
        "1"
    );
    env.stop(younger);
}

#[test]
fn replace_on_a_free_target_just_runs() {
    let env = Env::new();
    let o = env.run(&["run", "--target", "free", "--replace", "--", "echo", "hi"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(stdout(&o), "hi\n");
}

// Behind a pooler a running holder learns only at its next heartbeat: see
// `without_notifications_the_old_holder_stops_at_its_heartbeat_and_the_replacement_waits`.
crate::via_pooler!(
    replacing_an_idle_acquired_lease_does_not_wait_and_its_token_is_dead,
    replace_on_a_free_target_just_runs,
);
