//! Leases across steps: `acquire` prints a lease that outlives it, `run --token`
//! runs steps under it with the same fenced save, `renew` extends it between steps and
//! `release --token` ends it; a token that no longer holds the target gets 76 everywhere.

use std::time::Duration;

use crate::common::*;

/// `acquire --format json` on `target` with `extra` flags: (token, fence).
fn acquire(env: &Env, target: &str, extra: &[&str]) -> (String, i64) {
    let mut args = vec!["acquire", "--target", target, "--format", "json"];
    args.extend_from_slice(extra);
    let o = env.run(&args);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(doc["target"], target);
    (
        doc["token"].as_str().unwrap().to_owned(),
        doc["fence"].as_i64().unwrap(),
    )
}

/// `run --target T --token TOK -- sh -c SCRIPT`.
fn step(env: &Env, target: &str, token: &str, script: &str) -> std::process::Output {
    env.run(&[
        "run", "--target", target, "--token", token, "--", "sh", "-c", script,
    ])
}

#[test]
fn three_steps_run_under_one_lease_with_one_fence_and_the_lease_is_held_between_them() {
    let env = Env::new();
    let (token, fence) = acquire(&env, "deploy", &["--ttl", "10m", "--label", "sha-1"]);
    let log = env.path("steps");
    for n in 1..=3 {
        let script = format!(
            "echo \"step{n} $LEASECTL_FENCE $LEASECTL_TOKEN\" >> '{}'",
            log.display()
        );
        let o = step(&env, "deploy", &token, &script);
        assert_eq!(code(&o), 0, "step {n}: {}", stderr(&o));
        // Between steps the lease is held: another caller finds the target busy.
        let other = env.run(&["run", "--target", "deploy", "--", "true"]);
        assert_eq!(code(&other), 75, "{}", stderr(&other));
        assert_eq!(env.held_leases(), "1");
    }
    let lines = std::fs::read_to_string(&log).unwrap();
    for n in 1..=3 {
        assert!(
            lines.contains(&format!("step{n} {fence} {token}\n")),
            "{lines}"
        );
    }
    // Each step is a stored run of that fence (with its event), labelled like the lease.
    let stored = env.scalar(&format!(
        "SELECT count(*) FROM runs WHERE target = 'deploy' AND fence = {fence}
            AND outcome = 'completed' AND label = 'sha-1'"
    ));
    assert_eq!(stored, "3");
    let events = env.scalar("SELECT count(*) FROM outbox WHERE aggregate_id = 'deploy'");
    assert_eq!(events, "3");
    // The lease is idle between steps, and `status` says so.
    let status = env.status();
    let target = status["targets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["target"] == "deploy")
        .unwrap()
        .clone();
    assert_eq!(target["holders"][0]["idle"], true, "{target}");

    let o = env.run(&["release", "--target", "deploy", "--token", &token]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(env.held_leases(), "0");
    // The next acquisition gets a higher fence.
    let (_, next) = acquire(&env, "deploy", &[]);
    assert!(next > fence);
}

#[test]
fn a_token_whose_lease_expired_and_was_taken_gets_76_from_run_renew_and_release() {
    let env = Env::new();
    let (token, fence) = acquire(&env, "t", &["--ttl", "1s"]);
    wait_for("the lease to expire", || {
        env.scalar(
            "SELECT heartbeat_at + ttl_ms * interval '1ms' < now() FROM leases WHERE target = 't'",
        ) == "t"
    });
    // Expired but not taken yet: a step does not start, and says why.
    let ran = env.path("ran");
    let o = step(&env, "t", &token, &format!("touch '{}'", ran.display()));
    assert_eq!(code(&o), 76, "{}", stderr(&o));
    assert!(stderr(&o).contains("expired"), "{}", stderr(&o));
    assert!(!ran.exists(), "the step must not run on an expired lease");

    // Someone else takes the target.
    let o = env.run(&["run", "--target", "t", "--", "true"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let newer = env.scalar("SELECT fence FROM leases WHERE target = 't'");
    assert!(newer.parse::<i64>().unwrap() > fence);

    let o = step(&env, "t", &token, &format!("touch '{}'", ran.display()));
    assert_eq!(code(&o), 76, "{}", stderr(&o));
    assert!(!ran.exists());
    // What happened, as the database knows it: another holder took it (its run is stored
    // under the target's fence) and has released it since.
    for cmd in ["renew", "release"] {
        let o = env.run(&[cmd, "--target", "t", "--token", &token]);
        assert_one_line_error(
            &o,
            76,
            &format!("the lease on 't' was taken by {} pid ", host()),
        );
        assert_one_line_error(
            &o,
            76,
            &format!("(fence {newer}), which has released it since"),
        );
    }
    // Taken and still held: by whom.
    let holder = env.spawn(&[
        "run", "--target", "t", "--label", "sha-2", "--", "sleep", "30",
    ]);
    wait_for("the new holder", || env.held_leases() == "1");
    let o = env.run(&["renew", "--target", "t", "--token", &token]);
    assert_one_line_error(&o, 76, "the lease on 't' was taken by ");
    assert_one_line_error(&o, 76, "[sha-2] (fence ");
    kill(holder.id(), libc::SIGTERM);
    finish(holder);
}

fn host() -> String {
    nix::unistd::gethostname().unwrap().into_string().unwrap()
}

/// A token that no longer holds its target says which of the things that end a lease
/// happened: released, or replaced by --replace (a token that expired, or was taken, is above).
#[test]
fn a_token_that_lost_its_lease_is_told_whether_it_was_released_or_replaced() {
    let env = Env::new();
    let (token, _) = acquire(&env, "rel", &[]);
    let o = env.run(&["release", "--target", "rel", "--token", &token]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = step(&env, "rel", &token, "true");
    assert_one_line_error(
        &o,
        76,
        "the lease on 'rel' was released ('rel' is free now)",
    );
    assert!(!stderr(&o).contains(" or "), "{}", stderr(&o));

    let (token, _) = acquire(&env, "rep", &[]);
    let holder = env.spawn(&["run", "--target", "rep", "--replace", "--", "sleep", "30"]);
    wait_for("the replacement", || {
        env.scalar(&format!(
            "SELECT count(*) FROM leases WHERE target = 'rep' AND token <> '{token}'"
        )) == "1"
    });
    let o = step(&env, "rep", &token, "true");
    assert_one_line_error(&o, 76, "the lease on 'rep' was replaced: --replace of ");
    kill(holder.id(), libc::SIGTERM);
    finish(holder);
    let o = env.run(&["renew", "--target", "rep", "--token", &token]);
    assert_one_line_error(
        &o,
        76,
        "the lease on 'rep' was replaced by a --replace (since released)",
    );
}

#[test]
fn renew_extends_the_lease_and_can_change_its_ttl() {
    let env = Env::new();
    let (token, _) = acquire(&env, "r", &["--ttl", "2s"]);
    let o = env.run(&["renew", "--target", "r", "--token", &token, "--ttl", "1h"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(
        env.scalar("SELECT ttl_ms FROM leases WHERE target = 'r'"),
        "3600000"
    );
    // Past the old TTL, the lease is still held: the target is busy.
    wait_for("the old TTL to pass", || {
        env.scalar("SELECT heartbeat_at + interval '2500ms' < now() FROM leases WHERE target = 'r'")
            == "t"
    });
    let o = env.run(&["run", "--target", "r", "--", "true"]);
    assert_eq!(code(&o), 75, "{}", stderr(&o));
    // A step heartbeats by the lease's TTL (1h): a quick step is unaffected, and keeps it.
    let o = step(&env, "r", &token, "true");
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(env.held_leases(), "1");
}

#[test]
fn the_sh_and_env_formats_export_the_lease() {
    let env = Env::new();
    let script = format!(
        "eval \"$('{}' --database-url '{}' --schema {} acquire --target \"it's\" --ttl 1m)\" && \
         echo \"$LEASECTL_TARGET|$LEASECTL_FENCE|$LEASECTL_HOLDER_INDEX|$LEASECTL_TOKEN\"",
        bin().display(),
        env.url,
        env.schema
    );
    let o = std::process::Command::new("sh")
        .args(["-c", &script])
        .output_in_time();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let out = stdout(&o);
    let fields: Vec<&str> = out.trim().split('|').collect();
    assert_eq!(&fields[..3], ["it's", "1", "0"], "{out}");
    let token = env.scalar("SELECT token FROM leases WHERE target = 'it''s'");
    assert_eq!(fields[3], token);

    let o = env.run(&["acquire", "--target", "e", "--format", "env"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let token = env.scalar("SELECT token FROM leases WHERE target = 'e'");
    assert_eq!(
        stdout(&o),
        format!(
            "LEASECTL_TARGET=e\nLEASECTL_TOKEN={token}\nLEASECTL_FENCE=1\nLEASECTL_HOLDER_INDEX=0\n"
        )
    );
}

#[test]
fn a_busy_target_makes_acquire_exit_busy_and_wait_takes_it_when_released() {
    let env = Env::new();
    let (token, _) = acquire(&env, "b", &["--ttl", "10m"]);
    let o = env.run(&["acquire", "--target", "b", "--busy-exit-code", "9"]);
    assert_eq!(code(&o), 9, "{}", stderr(&o));
    assert!(stdout(&o).is_empty());
    let waiter = env.spawn(&["acquire", "--target", "b", "--wait=60s", "--format", "json"]);
    wait_for("the waiter to queue", || {
        env.scalar("SELECT count(*) FROM waiters") == "1"
    });
    let o = env.run(&["release", "--target", "b", "--token", &token]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = finish(waiter);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(doc["fence"], 2);
}

#[test]
fn a_forced_release_during_a_step_waits_for_that_step_not_an_earlier_one() {
    let env = Env::new();
    let (token, fence) = acquire(&env, "f", &["--ttl", "10m"]);
    // An earlier step of the same fence, stored as completed.
    assert_eq!(code(&step(&env, "f", &token, "true")), 0);
    let started = env.path("started");
    let running = env
        .command()
        .args(["run", "--target", "f", "--token", &token, "--", "sh", "-c"])
        .arg(format!("touch '{}'; exec sleep 300", started.display()))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_file_exists(&started);
    let o = env.run(&["release", "--target", "f", "--force"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    // release names the running step's stop, not the earlier step's completed run.
    assert!(stdout(&o).contains("as lost"), "{}", stdout(&o));
    let o = finish(running);
    assert_eq!(code(&o), 76, "{}", stderr(&o));
    let lost = env.scalar(&format!(
        "SELECT count(*) FROM runs WHERE fence = {fence} AND outcome = 'lost'"
    ));
    assert_eq!(lost, "1");
}

/// A lease nobody can learn the token of would block the target for its TTL: when stdout is a
/// pipe whose reader is gone, acquire releases it and exits 69 (not 70: nothing is broken).
#[test]
fn acquire_releases_the_lease_it_cannot_print() {
    let env = Env::new();
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    let child = env
        .command()
        .args(["acquire", "--target", "p", "--ttl", "10m"])
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let o = finish(child);
    assert_one_line_error(&o, 69, "the lease was released");
    assert_eq!(env.held_leases(), "0");
}

#[test]
fn a_forced_release_of_an_idle_lease_does_not_wait() {
    let env = Env::new();
    acquire(&env, "i", &["--ttl", "10m"]);
    let o = env
        .command()
        .args(["release", "--target", "i", "--force"])
        .output_within(Duration::from_secs(30));
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).contains("it ran no command"), "{}", stdout(&o));
}

#[test]
fn token_flags_are_checked_before_connecting() {
    let env = Env::new();
    let tok = "6f1c0c1e-8a43-4c43-9c55-1d5b0d6a0c11";
    for (args, needle) in [
        (
            vec![
                "run", "--target", "x", "--token", tok, "--queue", "latest", "--", "true",
            ],
            "--queue",
        ),
        (
            vec![
                "run", "--target", "x", "--token", tok, "--ttl", "1m", "--", "true",
            ],
            "--ttl",
        ),
        (vec!["release", "--target", "x"], "--force"),
        (vec!["release", "--target", "x", "--token", "nope"], "nope"),
        (
            vec!["renew", "--target", "x", "--token", tok, "--ttl", "1ms"],
            "too short",
        ),
        (vec!["acquire", "--target", "x", "--format", "yaml"], "yaml"),
        (
            vec!["acquire", "--target", "x", "--replace", "--wait"],
            "--wait",
        ),
    ] {
        let o = env
            .command_at("postgresql://nobody@127.0.0.1:1/none")
            .args(&args)
            .output_in_time();
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert!(stderr(&o).contains(needle), "{args:?}: {}", stderr(&o));
    }
}

crate::via_pooler!(
    three_steps_run_under_one_lease_with_one_fence_and_the_lease_is_held_between_them,
    a_token_whose_lease_expired_and_was_taken_gets_76_from_run_renew_and_release,
);

/// Steps of one lease run one at a time: a second step while one runs is refused at once (75,
/// naming the running one), nothing of it runs, and the running step is not disturbed.
#[test]
fn a_second_step_while_one_runs_is_busy_and_names_the_running_step() {
    let env = Env::new();
    let (token, _) = acquire(&env, "deploy", &["--ttl", "10m"]);
    let log = env.path("log");
    let a = env.spawn(&[
        "run",
        "--target",
        "deploy",
        "--token",
        &token,
        "--",
        "sh",
        "-c",
        &format!(
            "echo \"a-start $(date +%s%N)\" >> '{0}'; {1}; echo \"a-end $(date +%s%N)\" >> '{0}'",
            log.display(),
            env.gate()
        ),
    ]);
    wait_for("step a to start", || {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("a-start"))
    });
    let b = step(
        &env,
        "deploy",
        &token,
        &format!("echo b >> '{}'", log.display()),
    );
    assert_eq!(code(&b), 75, "{}", stderr(&b));
    let pid = a.id().to_string();
    assert!(
        stderr(&b).contains("another step of the lease on 'deploy' is running")
            && stderr(&b).contains(&format!("pid {pid}")),
        "{}",
        stderr(&b)
    );
    env.open_gate();
    let a = finish(a);
    assert_eq!(code(&a), 0, "{}", stderr(&a));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(!text.contains("b\n"), "the refused step ran:\n{text}");
    // Once the step has ended, the next one runs.
    let c = step(&env, "deploy", &token, "true");
    assert_eq!(code(&c), 0, "{}", stderr(&c));
}

/// `run --token --wait` waits for the running step to end, then runs under the same lease.
#[test]
fn a_step_with_wait_runs_after_the_running_step_has_ended() {
    let env = Env::new();
    let (token, fence) = acquire(&env, "deploy", &["--ttl", "10m"]);
    let log = env.path("log");
    let stamp = |name: &str| format!("echo \"{name} $(date +%s%N)\" >> '{}'", log.display());
    let a = env.spawn(&[
        "run",
        "--target",
        "deploy",
        "--token",
        &token,
        "--",
        "sh",
        "-c",
        &format!("{}; sleep 1; {}", stamp("a-start"), stamp("a-end")),
    ]);
    wait_for("step a to start", || {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("a-start"))
    });
    let b = env.run(&[
        "run",
        "--target",
        "deploy",
        "--token",
        &token,
        "--wait=60s",
        "--",
        "sh",
        "-c",
        &format!(
            "{}; echo \"$LEASECTL_FENCE\" >> '{}'",
            stamp("b-start"),
            log.display()
        ),
    ]);
    assert_eq!(code(&b), 0, "{}", stderr(&b));
    assert_eq!(code(&finish(a)), 0);
    let text = std::fs::read_to_string(&log).unwrap();
    let at = |name: &str| -> u128 {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
            .parse()
            .unwrap()
    };
    assert!(at("a-end") < at("b-start"), "the steps overlapped:\n{text}");
    assert!(text.contains(&format!("\n{fence}\n")), "{text}");
}

/// A heartbeat that reaches the database after the lease expired does not revive it: the step
/// loses its lease (76) and stops, and a later step with the stale token is refused (76) —
/// even though nobody took the lease meanwhile. The expiry is made on the database clock by
/// moving the last heartbeat back, as a black-holed connection would have let it lapse.
#[test]
fn a_heartbeat_after_the_expiry_does_not_revive_the_lease_and_the_stale_token_runs_nothing() {
    let env = Env::new();
    let (token, _) = acquire(&env, "deploy", &["--ttl", "3s"]);
    let log = env.path("log");
    let a = env.spawn(&[
        "run",
        "--target",
        "deploy",
        "--token",
        &token,
        "--",
        "sh",
        "-c",
        &format!(
            "while :; do echo \"a $(date +%s%N)\" >> '{}'; sleep 0.05; done",
            log.display()
        ),
    ]);
    wait_for("step a to run", || log.exists());
    env.sql("UPDATE leases SET heartbeat_at = now() - interval '1 minute' WHERE target = 'deploy'");
    let a = finish(a);
    assert_eq!(code(&a), 76, "{}", stderr(&a));
    assert_eq!(
        env.scalar(
            "SELECT heartbeat_at < now() - interval '30 seconds' OR token IS NULL
               FROM leases WHERE target = 'deploy'"
        ),
        "t",
        "the late heartbeat revived the lease"
    );
    let b = step(
        &env,
        "deploy",
        &token,
        &format!("echo b >> '{}'", log.display()),
    );
    assert_eq!(code(&b), 76, "{}", stderr(&b));
    assert!(
        !std::fs::read_to_string(&log).unwrap().contains("b\n"),
        "a step ran with a stale token"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM runs WHERE outcome = 'completed'"),
        "0"
    );
}

/// The same for a plain run: its next heartbeat after the expiry is a lost lease (76), and the
/// lease is not left held by a process that exited.
#[test]
fn a_plain_runs_heartbeat_after_the_expiry_loses_the_lease_and_leaves_it_free() {
    let env = Env::new();
    let holder = env.hold_with(env.command(), "job", &["--ttl", "3s"], "sleep 60");
    env.sql("UPDATE leases SET heartbeat_at = now() - interval '1 minute' WHERE target = 'job'");
    let o = finish(holder);
    assert_eq!(code(&o), 76, "{}", stderr(&o));
    let next = env.run(&["run", "--target", "job", "--", "true"]);
    assert_eq!(code(&next), 0, "{}", stderr(&next));
}
