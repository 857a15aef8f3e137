//! Fair, visible queues: `run --wait` waiters take the lease in arrival order, `--queue latest`
//! supersedes older waiters, a dead waiter leaves the queue within its TTL, `--wait-notice`
//! reports progress without a terminal, and `status` / `runs` show waiters and `--label`s.

use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::*;

/// A holder of `target` that runs until the file `gate` exists; returns once it holds.
fn hold_until(env: &Env, target: &str, gate: &str, extra: &[&str]) -> std::process::Child {
    let script = format!(
        "while [ ! -e '{}' ]; do sleep 0.02; done",
        env.path(gate).display()
    );
    env.hold_with(env.command(), target, extra, &script)
}

fn open(env: &Env, gate: &str) {
    std::fs::write(env.path(gate), "").unwrap();
}

/// Live waiters of `target` in the table (what `status` would list).
fn queued(env: &Env, target: &str) -> usize {
    env.scalar(&format!(
        "SELECT count(*) FROM waiters WHERE target = '{target}' AND superseded_at IS NULL"
    ))
    .parse()
    .unwrap()
}

/// `rounds` times: a holder, then 10 waiters started one after the other — each only once the
/// previous one's row is in the queue, so arrival order is known — then the holder lets go.
/// The waiters' commands append their index to one O_APPEND file: it must read 0…9.
fn arrival_order(rounds: usize) {
    let env = Env::new();
    for round in 0..rounds {
        let target = format!("fifo-{round}");
        let gate = format!("gate-{round}");
        let order = env.path(&format!("order-{round}"));
        let holder = hold_until(&env, &target, &gate, &[]);
        let mut waiters = Vec::new();
        for i in 0..10 {
            let append = format!("echo {i} >> '{}'", order.display());
            waiters.push(env.spawn(&[
                "run",
                "--target",
                &target,
                "--wait",
                "--wait-notice",
                "0",
                "--",
                "sh",
                "-c",
                &append,
            ]));
            wait_for(&format!("waiter {i} of round {round} to queue"), || {
                queued(&env, &target) == i + 1
            });
        }
        open(&env, &gate);
        assert_eq!(code(&finish(holder)), 0);
        for (i, w) in waiters.into_iter().enumerate() {
            let o = finish(w);
            assert_eq!(code(&o), 0, "waiter {i}: {}", stderr(&o));
            assert_eq!(
                stderr(&o),
                "",
                "waiter {i} prints nothing with --wait-notice 0"
            );
        }
        let got: Vec<usize> = std::fs::read_to_string(&order)
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
        assert_eq!(got, (0..10).collect::<Vec<_>>(), "round {round}");
        assert_eq!(queued(&env, &target), 0, "the queue is empty again");
        // And says so: a caller without --wait runs at once.
        let o = env.run(&["run", "--target", &target, "--", "true"]);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
    }
}

#[test]
fn ten_waiters_take_the_lease_in_arrival_order_over_ten_rounds() {
    arrival_order(10);
}

/// The same in two rounds (the copy that runs through a transaction pooler, polling).
#[test]
fn waiters_take_the_lease_in_arrival_order() {
    arrival_order(2);
}

#[test]
fn a_caller_without_wait_does_not_jump_the_queue_of_a_free_target() {
    let env = Env::new();
    let holder = hold_until(&env, "j", "gate", &[]);
    let w = env.spawn(&[
        "run", "--target", "j", "--wait", "--label", "first", "--", "echo", "ran",
    ]);
    wait_for("the waiter to queue", || queued(&env, "j") == 1);
    // Paused, the waiter keeps its place (its row is live for its TTL) while the lease is free.
    kill(w.id(), libc::SIGSTOP);
    open(&env, "gate");
    assert_eq!(code(&finish(holder)), 0);
    let o = env.run(&["run", "--target", "j", "--", "echo", "jumped"]);
    assert_one_line_error(&o, 75, "not held, but 1 caller queue for it (next: ");
    assert!(stderr(&o).contains("[first]"), "{}", stderr(&o));
    assert_eq!(stdout(&o), "");
    kill(w.id(), libc::SIGCONT);
    let o = finish(w);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(stdout(&o), "ran\n");
}

/// The busy answer of a caller that does not wait names the live holder and counts the live
/// waiters of every mode (a `--queue unordered` one too), and says nothing of a dead holder's
/// row: a holder whose TTL ran out is not a holder.
#[test]
fn a_busy_answer_names_the_holder_and_counts_the_waiters_of_every_mode() {
    let env = Env::new();
    let holder = hold_until(&env, "b", "gate", &["--label", "keeper", "--ttl", "90s"]);
    let waiters = [
        env.spawn(&[
            "run",
            "--target",
            "b",
            "--wait",
            "--queue",
            "unordered",
            "--",
            "true",
        ]),
        env.spawn(&["run", "--target", "b", "--wait", "--", "true"]),
    ];
    wait_for("both waiters to queue", || queued(&env, "b") == 2);
    let o = env.run(&["run", "--target", "b", "--", "true"]);
    let expected = format!(
        "'b' is busy: held by {} pid {} [keeper] (fence 1), last heartbeat ",
        hostname(),
        holder.id()
    );
    assert_one_line_error(&o, 75, &expected);
    assert!(
        stderr(&o)
            .trim_end()
            .ends_with("ttl 1m30s; 2 callers waiting"),
        "{}",
        stderr(&o)
    );
    // Another row of the target whose holder's TTL ran out long ago is no holder: the answer
    // still names the live one.
    env.sql(
        "INSERT INTO leases (target, place, token, fence, ttl_ms, heartbeat_at, acquired_at,
                             holder_host, holder_pid)
         VALUES ('b', 1, gen_random_uuid(), 7, 1000, now() - interval '1 hour',
                 now() - interval '1 hour', 'elsewhere', 1)",
    );
    let o = env.run(&["run", "--target", "b", "--", "true"]);
    assert_one_line_error(&o, 75, &expected);
    assert!(!stderr(&o).contains("elsewhere"), "{}", stderr(&o));
    env.sql("DELETE FROM leases WHERE target = 'b' AND place = 1");
    open(&env, "gate");
    assert_eq!(code(&finish(holder)), 0);
    for w in waiters {
        let o = finish(w);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
    }
}

#[test]
fn a_waiter_that_gives_up_or_is_interrupted_leaves_the_queue_at_once() {
    let env = Env::new();
    let holder = hold_until(&env, "g", "gate", &[]);
    let o = env.run(&["run", "--target", "g", "--wait=1s", "--", "true"]);
    assert_one_line_error(&o, 75, "gave up waiting for 'g'");
    let w = env.spawn(&["run", "--target", "g", "--wait", "--", "true"]);
    wait_for("the waiter to queue", || queued(&env, "g") == 1);
    kill(w.id(), libc::SIGTERM);
    assert_eq!(code(&finish(w)), 143);
    assert_eq!(queued(&env, "g"), 0);
    open(&env, "gate");
    assert_eq!(code(&finish(holder)), 0);
    // Nobody queues any more: a caller without --wait is not held up for a TTL.
    let o = env.run(&["run", "--target", "g", "--", "true"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

#[test]
fn queue_latest_leaves_only_the_newest_waiter_and_the_others_say_who_superseded_them() {
    let env = Env::new();
    let holder = hold_until(&env, "l", "gate", &[]);
    let mut waiters = Vec::new();
    for i in 0..5 {
        let label = format!("sha-{i}");
        let child = env
            .command()
            .args(["run", "--target", "l", "--wait", "--queue", "latest"])
            .args([
                "--label",
                &label,
                "--wait-notice",
                "0",
                "--",
                "echo",
                &label,
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_for(&format!("waiter {i} to queue"), || {
            env.scalar(&format!(
                "SELECT count(*) FROM waiters WHERE label = '{label}'"
            )) == "1"
        });
        waiters.push(child);
    }
    // The four older ones learn at once (NOTIFY), while the holder still holds.
    let newest = waiters.pop().unwrap();
    let newest_pid = newest.id();
    for (i, mut w) in waiters.into_iter().enumerate() {
        let status = exits_within(&mut w, PATIENCE, "a superseded waiter");
        let o = w.wait_with_output().unwrap();
        assert_eq!(status.code(), Some(75), "waiter {i}: {}", stderr(&o));
        assert_eq!(stdout(&o), "", "waiter {i} did not run");
        let err = stderr(&o);
        assert_eq!(err.lines().count(), 1, "{err}");
        // Superseded by the next one to arrive: host, pid and label.
        assert!(
            err.contains("superseded in the queue for 'l' by ")
                && err.contains(&format!("[sha-{}]", i + 1)),
            "waiter {i}: {err}"
        );
    }
    assert!(alive(holder.id() as i32), "the holder still holds");
    assert_eq!(queued(&env, "l"), 1);
    let err_pid = format!("pid {newest_pid} [sha-4]");
    let listed = env.status();
    assert_eq!(
        listed["targets"][0]["waiters"][0]["label"], "sha-4",
        "{listed}"
    );
    open(&env, "gate");
    assert_eq!(code(&finish(holder)), 0);
    let o = finish(newest);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(stdout(&o), "sha-4\n");
    let runs = env.run(&["runs", "--target", "l"]);
    assert!(stdout(&runs).contains(&err_pid), "{}", stdout(&runs));
}

#[test]
fn a_sigkilled_waiter_leaves_the_queue_within_its_ttl_and_the_next_one_proceeds() {
    let env = Env::new();
    let holder = hold_until(&env, "k", "gate", &[]);
    // --ttl 3s gives the waiter the shortest queue TTL, 10s.
    let doomed = env.spawn(&[
        "run", "--target", "k", "--wait", "--ttl", "3s", "--", "true",
    ]);
    wait_for("the first waiter to queue", || queued(&env, "k") == 1);
    let started = env.path("started");
    let next = env.spawn(&[
        "run",
        "--target",
        "k",
        "--wait",
        "--",
        "sh",
        "-c",
        &format!("touch '{}'", started.display()),
    ]);
    wait_for("the second waiter to queue", || queued(&env, "k") == 2);
    let mut doomed = doomed;
    kill(doomed.id(), libc::SIGKILL);
    let killed = Instant::now();
    doomed.wait().unwrap();
    open(&env, "gate");
    assert_eq!(code(&finish(holder)), 0);
    let o = finish(next);
    let waited = killed.elapsed();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(started.exists());
    // The dead waiter kept its place until its TTL ran out (it renewed its row at most a
    // poll before the kill), not longer.
    assert!(
        waited >= Duration::from_secs(8),
        "went ahead of a waiter that was still within its TTL after {waited:?}"
    );
    assert!(
        waited < Duration::from_secs(10) + Duration::from_secs(20),
        "needed {waited:?}"
    );
    // The dead row is no longer listed, and holds nobody up.
    assert_eq!(env.status()["targets"][0]["waiters"], serde_json::json!([]));
    assert_eq!(code(&env.run(&["run", "--target", "k", "--", "true"])), 0);
}

#[test]
fn wait_notice_reports_position_and_holder_without_a_terminal_and_the_wait_on_acquiring() {
    let env = Env::new();
    let holder = hold_until(&env, "n", "gate", &["--label", "deploy-7"]);
    let quiet = env.spawn(&[
        "run",
        "--target",
        "n",
        "--wait",
        "--wait-notice",
        "0",
        "--",
        "true",
    ]);
    wait_for("the first waiter to queue", || queued(&env, "n") == 1);
    let w = Watched::new(env.spawn(&[
        "run",
        "--target",
        "n",
        "--wait",
        "--wait-notice",
        "1s",
        "--",
        "true",
    ]));
    let line = format!(
        "leasectl: waiting for 'n' (position 2 of 2; held by {} pid {} [deploy-7], running ",
        hostname(),
        holder.id()
    );
    // One line a second (the first after a second: a short wait stays silent).
    wait_for("two notices", || w.stderr().matches(&line).count() >= 2);
    open(&env, "gate");
    assert_eq!(code(&finish(holder)), 0);
    let o = finish(quiet);
    assert_eq!(code(&o), 0);
    assert_eq!(stderr(&o), "", "--wait-notice 0 says nothing");
    let o = w.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.lines().all(|l| l.starts_with(&line)
            || l.starts_with("leasectl: acquired 'n' after waiting ")),
        "{err}"
    );
    assert!(err
        .lines()
        .last()
        .unwrap()
        .starts_with("leasectl: acquired 'n' after waiting "));
}

fn hostname() -> String {
    nix::unistd::gethostname()
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

#[test]
fn status_lists_waiters_with_positions_and_labels_and_holders_with_theirs() {
    let env = Env::new();
    let holder = hold_until(&env, "s", "gate", &["--label", "main@abc123"]);
    let mut waiters = Vec::new();
    for i in 0..3 {
        let label = format!("pipeline/{i}");
        waiters.push(env.spawn(&[
            "run", "--target", "s", "--wait", "--label", &label, "--", "true",
        ]));
        wait_for("the waiter to queue", || queued(&env, "s") == i + 1);
    }
    let doc = env.status();
    let t = &doc["targets"][0];
    assert_eq!(t["holder_label"], "main@abc123", "{doc}");
    let listed = t["waiters"].as_array().unwrap();
    assert_eq!(listed.len(), 3, "{doc}");
    for (i, w) in listed.iter().enumerate() {
        assert_eq!(w["position"], i + 1);
        assert_eq!(w["label"], format!("pipeline/{i}"));
        assert_eq!(w["pid"], waiters[i].id());
        assert_eq!(w["host"], hostname());
        assert_eq!(w["queue"], "fifo");
        assert!(w["waiting_ms"].as_i64().unwrap() >= 0);
    }
    assert!(listed[0]["waiting_ms"].as_i64() >= listed[2]["waiting_ms"].as_i64());
    let table = stdout(&env.run(&["status"]));
    let row = table.lines().find(|l| l.starts_with("s ")).unwrap();
    assert!(row.contains("[main@abc123]"), "{table}");
    let cols: Vec<&str> = row.split_whitespace().collect();
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    let at = header.iter().position(|h| *h == "WAITERS").unwrap();
    // HOLDER is three words ("host pid N") plus the label.
    assert_eq!(cols[at + 3], "3", "{table}");
    open(&env, "gate");
    finish(holder);
    for w in waiters {
        assert_eq!(code(&finish(w)), 0);
    }
    assert_eq!(env.status()["targets"][0]["waiters"], serde_json::json!([]));
}

#[test]
fn labels_are_stored_with_the_run_and_its_event_and_bad_ones_are_usage_errors() {
    let env = Env::new();
    let o = env.run(&[
        "run",
        "--target",
        "r",
        "--label",
        "v1.2.3 (abc)",
        "--",
        "true",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let runs = env.run(&["runs", "--target", "r", "--json"]);
    let doc: serde_json::Value = serde_json::from_slice(&runs.stdout).unwrap();
    assert_eq!(doc["runs"][0]["label"], "v1.2.3 (abc)");
    assert!(stdout(&env.run(&["runs", "--target", "r"])).contains("[v1.2.3 (abc)]"));
    assert_eq!(
        env.scalar("SELECT payload->>'label' FROM outbox"),
        "v1.2.3 (abc)"
    );
    // Without --label: null, and the tables look as before.
    assert_eq!(code(&env.run(&["run", "--target", "r", "--", "true"])), 0);
    let doc: serde_json::Value =
        serde_json::from_slice(&env.run(&["runs", "--target", "r", "--json"]).stdout).unwrap();
    assert_eq!(doc["runs"][0]["label"], serde_json::Value::Null);

    let long = "x".repeat(201);
    for (label, needle) in [
        (long.as_str(), "201 characters"),
        ("a\nb", "control character"),
        ("", "empty"),
    ] {
        let o = env.run(&["run", "--target", "r", "--label", label, "--", "true"]);
        assert_one_line_error(&o, 2, needle);
    }
    let o = env.run(&["run", "--target", "r", "--queue", "latest", "--", "true"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("--wait"), "{}", stderr(&o));
}

crate::via_pooler!(
    waiters_take_the_lease_in_arrival_order,
    queue_latest_leaves_only_the_newest_waiter_and_the_others_say_who_superseded_them,
);

/// Eight callers of a free target at once, `--wait --reuse-within`: one runs, the other seven
/// reuse its result and leave the queue together. Each leaver used to lower `queued_until` from a
/// snapshot that still saw the others, leaving it a TTL in the future: a plain run then found the
/// free target "busy: 0 callers queue for it" for up to a minute. It must run at once.
#[test]
fn after_many_waiters_leave_together_a_free_target_runs_a_plain_caller_at_once() {
    let env = Env::new();
    for round in 0..3 {
        let target = format!("oauth-{round}");
        let gate = format!("gate-{round}");
        let holder = hold_until(&env, &target, &gate, &[]);
        let waiters: Vec<_> = (0..8)
            .map(|_| {
                env.spawn(&[
                    "run",
                    "--target",
                    &target,
                    "--wait",
                    "--reuse-within",
                    "1h",
                    "--",
                    "echo",
                    "token",
                ])
            })
            .collect();
        wait_for("eight waiters to queue", || queued(&env, &target) == 8);
        open(&env, &gate);
        assert_eq!(code(&finish(holder)), 0);
        for w in waiters {
            let o = finish(w);
            assert_eq!(code(&o), 0, "{}", stderr(&o));
        }
        assert_eq!(queued(&env, &target), 0);
        let o = env.run(&["run", "--target", &target, "--", "true"]);
        assert_eq!(code(&o), 0, "round {round}: {}", stderr(&o));
    }
}

/// A waiter leaves while another joins: the leaver must not lower `queued_until` below the
/// joiner's TTL, or a caller without `--wait` could take the lease ahead of a live waiter. The
/// joiner here is the test's own transaction (the join's insert and raise, held open), so that
/// the leave certainly overlaps it: a leave that recomputes the mark waits for the target's row
/// and then, from its statement's earlier snapshot, misses the joiner.
#[test]
fn a_waiter_leaving_while_another_joins_leaves_the_queue_marked_for_the_joiner() {
    let env = Env::new();
    let holder = hold_until(&env, "t", "gate", &[]);
    let mut leaver = env.spawn(&["run", "--target", "t", "--wait", "--", "true"]);
    wait_for("the leaver to queue", || queued(&env, "t") == 1);
    let rt = runtime();
    let joiner = rt.block_on(async {
        let c = leasectl::db::Settings::new(Some(&env.direct_url))
            .unwrap()
            .open_client()
            .await
            .unwrap();
        c.batch_execute(&format!(
            "SET search_path = \"{}\"; BEGIN;
             INSERT INTO waiters (target, queue, ttl_ms, heartbeat_at, arrived_at, host, pid)
             VALUES ('t', 'fifo', 60000, now(), now(), 'joiner', 1);
             UPDATE leases SET queued_until = greatest(queued_until, now() + interval '60 s')
              WHERE target = 't' AND place = 0;",
            env.schema
        ))
        .await
        .unwrap();
        c
    });
    kill(leaver.id(), libc::SIGTERM);
    // Either the leave is done, or it waits for the joiner's lock on the target's row.
    wait_for("the leave to end or to wait for the joiner's lock", || {
        leaver.try_wait().unwrap().is_some()
            || env.scalar(
                "SELECT count(*) FROM pg_stat_activity
                  WHERE wait_event_type = 'Lock' AND datname = current_database()
                    AND query ILIKE '%waiters%'",
            ) != "0"
    });
    rt.block_on(joiner.batch_execute("COMMIT")).unwrap();
    assert!(exited_within(&mut leaver, PATIENCE).is_some());
    assert_eq!(
        env.scalar("SELECT queued_until > now() FROM leases WHERE target = 't' AND place = 0"),
        "t",
        "the leave lowered queued_until below a live waiter's TTL"
    );
    open(&env, "gate");
    assert_eq!(code(&finish(holder)), 0);
    // The joiner (a live row, nobody renews it) still goes first.
    let o = env.run(&["run", "--target", "t", "--", "true"]);
    assert_eq!(code(&o), 75, "{}", stderr(&o));
}

/// `--wait=0s` (or any limit spent before the first attempt) still tries once.
#[test]
fn a_wait_of_zero_on_a_free_target_runs() {
    let env = Env::new();
    for wait in ["--wait=0s", "--wait=1ms"] {
        let o = env.run(&["run", "--target", "t", wait, "--", "true"]);
        assert_eq!(code(&o), 0, "{wait}: {}", stderr(&o));
    }
    let holder = hold_until(&env, "busy", "gate", &[]);
    let o = env.run(&["run", "--target", "busy", "--wait=0s", "--", "true"]);
    assert_eq!(code(&o), 75, "{}", stderr(&o));
    open(&env, "gate");
    assert_eq!(code(&finish(holder)), 0);
}

/// A waiter keeps trying to reach a database that is down until its `--wait` is spent, then
/// exits 75 (gave up) naming the last connection error — not 69 halfway through.
#[test]
fn a_waiter_retries_an_unreachable_database_until_its_wait_is_spent_then_exits_75() {
    let env = Env::new();
    let url = format!("postgresql://nobody@127.0.0.1:{}/none", spare_port());
    for secs in [2u64, 3] {
        let started = std::time::Instant::now();
        let o = env
            .command_at(&url)
            .args([
                "run",
                "--target",
                "t",
                &format!("--wait={secs}s"),
                "--",
                "true",
            ])
            .output_in_time();
        let took = started.elapsed();
        assert_eq!(code(&o), 75, "{}", stderr(&o));
        assert!(
            took >= Duration::from_secs(secs),
            "gave up after {took:?}, before --wait={secs}s was spent"
        );
        assert!(
            took < Duration::from_secs(secs) + Duration::from_millis(1500),
            "gave up only after {took:?}"
        );
        let err = stderr(&o);
        assert!(
            err.contains("gave up waiting for 't'") && err.contains("Connection refused"),
            "{err}"
        );
    }
}
