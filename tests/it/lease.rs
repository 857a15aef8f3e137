//! The lease itself: mutual exclusion, fences, takeover after a crash, fencing out a paused
//! holder, force release, exit codes passed through.

use std::time::{Duration, Instant};

use crate::common::*;

#[test]
fn sixteen_simultaneous_runs_exactly_one_runs_the_rest_exit_busy_promptly() {
    let env = Env::new();
    let gate = env.path("gate");
    let count = env.path("count");
    // The winner blocks until the test opens the gate, so "promptly" means: every loser has
    // exited while the winner still holds the lease.
    let script = format!(
        "echo ran >> '{}'; while [ ! -e '{}' ]; do sleep 0.02; done",
        count.display(),
        gate.display()
    );
    let mut children: Vec<_> = (0..16)
        .map(|_| env.spawn(&["run", "--target", "shared", "--", "sh", "-c", &script]))
        .collect();
    let mut exited = [None; 16];
    wait_for("15 contenders to exit while the winner runs", || {
        for (i, c) in children.iter_mut().enumerate() {
            if exited[i].is_none() {
                exited[i] = c.try_wait().unwrap();
            }
        }
        exited.iter().filter(|e| e.is_some()).count() >= 15
    });
    std::fs::write(&gate, "").unwrap();
    let outputs: Vec<_> = children.into_iter().map(finish).collect();
    let codes: Vec<i32> = outputs.iter().map(code).collect();
    assert_eq!(
        codes.iter().filter(|&&c| c == 0).count(),
        1,
        "codes: {codes:?}"
    );
    assert_eq!(
        codes.iter().filter(|&&c| c == 75).count(),
        15,
        "codes: {codes:?}"
    );
    for o in outputs.iter().filter(|o| code(o) == 75) {
        assert!(
            stderr(o).contains("'shared' is busy: held by"),
            "{}",
            stderr(o)
        );
    }
    assert_eq!(
        std::fs::read_to_string(&count).unwrap().lines().count(),
        1,
        "the command ran more than once"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM runs"), "1");
}

#[test]
fn exit_codes_and_signals_pass_through_and_are_stored() {
    let env = Env::new();
    let o = env.run(&["run", "--target", "t", "--", "sh", "-c", "exit 7"]);
    assert_eq!(code(&o), 7);
    let o = env.run(&["run", "--target", "t", "--", "sh", "-c", "kill -TERM $$"]);
    assert_eq!(code(&o), 143, "{}", stderr(&o));
    let o = env.run(&["run", "--target", "t", "--", "true"]);
    assert_eq!(code(&o), 0);
    let rows = env.sql("SELECT outcome, exit_code, signal FROM runs ORDER BY fence");
    let rows: Vec<Vec<String>> = rows
        .into_iter()
        .map(|r| r.into_iter().map(|v| v.unwrap_or("null".into())).collect())
        .collect();
    assert_eq!(
        rows,
        vec![
            vec!["completed".to_string(), "7".into(), "null".into()],
            vec!["completed".to_string(), "null".into(), "15".into()],
            vec!["completed".to_string(), "0".into(), "null".into()],
        ]
    );
    // Each stored run has one event, with the documented payload.
    let payload: serde_json::Value = serde_json::from_str(
        &env.scalar("SELECT payload FROM outbox WHERE payload->>'fence' = '2'"),
    )
    .unwrap();
    assert_eq!(payload["exit_code"], serde_json::Value::Null);
    assert_eq!(payload["signal"], 15);
    assert_eq!(payload["target"], "t");
    for key in ["run_id", "started_at", "finished_at", "host"] {
        assert!(payload[key].is_string(), "{key} missing in {payload}");
    }
    assert_eq!(env.scalar("SELECT count(*) FROM outbox WHERE aggregate_type = 'leasectl.target' AND aggregate_id = 't' AND type = 'leasectl.run.finished'"), "3");
}

#[test]
fn exec_failures_exit_126_or_127_and_release_the_lease() {
    let env = Env::new();
    let o = env.run(&["run", "--target", "t", "--", "/no/such/command"]);
    assert_eq!(code(&o), 127);
    assert!(
        stderr(&o).contains("cannot run '/no/such/command'"),
        "{}",
        stderr(&o)
    );
    let script = env.path("not-executable.sh");
    std::fs::write(&script, "#!/bin/sh\necho hi\n").unwrap();
    let o = env.run(&["run", "--target", "t", "--", script.to_str().unwrap()]);
    assert_eq!(code(&o), 126, "{}", stderr(&o));
    assert_eq!(env.status()["targets"][0]["state"], "free");
    assert_eq!(
        env.scalar("SELECT string_agg(outcome || ':' || exit_code, ',' ORDER BY fence) FROM runs"),
        "exec_failed:127,exec_failed:126"
    );
    // Released means the next run gets it at once.
    assert_eq!(code(&env.run(&["run", "--target", "t", "--", "true"])), 0);
}

/// Reads LEASECTL_FENCE as printed by a run's command.
fn fence_of(o: &std::process::Output) -> i64 {
    stdout(o)
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("no fence in {:?} / {:?}", stdout(o), stderr(o)))
}

#[test]
fn fences_strictly_increase_across_release_force_release_and_takeover() {
    let env = Env::new();
    let print_fence = ["--", "sh", "-c", "echo $LEASECTL_FENCE"];
    let mut fences = Vec::new();
    for _ in 0..2 {
        fences.push(fence_of(
            &env.run(&[&["run", "--target", "f"][..], &print_fence].concat()),
        ));
    }

    // Force release of a live holder: it notices at its next heartbeat and exits 76.
    let marker = env.path("forced");
    let script = format!("echo $LEASECTL_FENCE > '{}'; sleep 30", marker.display());
    let holder = env.spawn(&[
        "run", "--target", "f", "--ttl", "2s", "--", "sh", "-c", &script,
    ]);
    fences.push(wait_for_file(&marker).parse().unwrap());
    let o = env.run(&["release", "--target", "f", "--force"]);
    assert!(
        code(&o) == 0 && stdout(&o).contains("released 'f'"),
        "{}",
        stdout(&o)
    );
    let out = finish(holder);
    assert_eq!(code(&out), 76, "{}", stderr(&out));
    fences.push(fence_of(
        &env.run(&[&["run", "--target", "f"][..], &print_fence].concat()),
    ));

    // Takeover after a crash.
    let marker = env.path("crashed");
    let script = format!("echo $LEASECTL_FENCE > '{}'; sleep 30", marker.display());
    let holder = env.spawn(&[
        "run", "--target", "f", "--ttl", "1s", "--", "sh", "-c", &script,
    ]);
    fences.push(wait_for_file(&marker).parse().unwrap());
    kill(holder.id(), libc::SIGKILL);
    finish(holder);
    fences.push(fence_of(&env.run(
        &[&["run", "--target", "f", "--wait=30s"][..], &print_fence].concat(),
    )));

    assert!(
        fences.windows(2).all(|w| w[0] < w[1]),
        "fences not strictly increasing: {fences:?}"
    );
    assert_eq!(fences, vec![1, 2, 3, 4, 5, 6]);
}

#[test]
fn kill_9_of_the_holder_kills_its_command_and_a_waiter_takes_over_only_after_the_ttl() {
    let env = Env::new();
    let ttl = Duration::from_secs(4);
    let child_pid = env.path("child");
    let grandchild_pid = env.path("grandchild");
    let script = format!(
        "sleep 300 & echo $! > '{}'; echo $$ > '{}'; wait",
        grandchild_pid.display(),
        child_pid.display()
    );
    let holder = env.spawn(&[
        "run", "--target", "k", "--ttl", "4s", "--", "sh", "-c", &script,
    ]);
    let child: i32 = wait_for_file(&child_pid).parse().unwrap();
    let grandchild: i32 = wait_for_file(&grandchild_pid).parse().unwrap();
    assert!(alive(child) && alive(grandchild));

    kill(holder.id(), libc::SIGKILL);
    let killed_at = Instant::now();
    finish(holder);
    wait_for("the orphaned command and its child to die", || {
        !alive(child) && !alive(grandchild)
    });

    // The lease outlives its holder until the TTL: nobody takes over early.
    let busy = env.run(&["run", "--target", "k", "--", "true"]);
    if killed_at.elapsed() < ttl / 2 {
        assert_eq!(
            code(&busy),
            75,
            "took over before the TTL: {}",
            stderr(&busy)
        );
    }
    let waiter = env.run(&[
        "run",
        "--target",
        "k",
        "--wait",
        "--",
        "sh",
        "-c",
        "echo $LEASECTL_FENCE",
    ]);
    let waited = killed_at.elapsed();
    assert_eq!(code(&waiter), 0, "{}", stderr(&waiter));
    assert_eq!(stdout(&waiter).trim(), "2");
    // The last heartbeat was at most ttl/4 before the kill, so expiry is >= 3/4 ttl after it.
    assert!(
        waited >= ttl * 3 / 4 - Duration::from_millis(100),
        "took over after only {waited:?}"
    );
    assert!(
        waited < ttl + Duration::from_secs(15),
        "waiter needed {waited:?}"
    );
}

/// Kills a command the test expected leasectl to stop, should the test fail before it was: it
/// must not outlive the test. Only while it still runs `sleep 3600` (its pid is not reused).
struct Reap(i32);

impl Drop for Reap {
    fn drop(&mut self) {
        let cmd = std::fs::read(format!("/proc/{}/cmdline", self.0)).unwrap_or_default();
        if alive(self.0) && String::from_utf8_lossy(&cmd).contains("3600") {
            kill(self.0 as u32, libc::SIGKILL);
        }
    }
}

#[test]
fn a_paused_holder_is_taken_over_and_on_resume_stops_its_command_stores_nothing_and_exits_76() {
    let env = Env::new();
    let pidfile = env.path("pid");
    // The command would run for an hour, far past every wait of this test: if it is gone, the
    // resumed holder stopped it (a `sleep` as long as the test's patience could end by itself).
    let script = format!(
        "echo $$ > '{}'; echo rotated-token; exec sleep 3600",
        pidfile.display()
    );
    let holder = env.spawn(&[
        "run", "--target", "p", "--ttl", "1s", "--", "sh", "-c", &script,
    ]);
    let child: i32 = wait_for_file(&pidfile).parse().unwrap();
    let _reap = Reap(child);
    kill(holder.id(), libc::SIGSTOP);

    let taker = env.run(&[
        "run",
        "--target",
        "p",
        "--wait=30s",
        "--",
        "sh",
        "-c",
        "echo $LEASECTL_FENCE",
    ]);
    assert_eq!(code(&taker), 0, "{}", stderr(&taker));
    assert_eq!(stdout(&taker).trim(), "2");

    kill(holder.id(), libc::SIGCONT);
    let out = finish(holder);
    assert_eq!(code(&out), 76, "{}", stderr(&out));
    assert!(stderr(&out).contains("lost"), "{}", stderr(&out));
    wait_for("the fenced-out command to be stopped", || !alive(child));

    // Recorded as lost, with its output, and no event for it.
    assert_eq!(
        env.scalar("SELECT outcome FROM runs WHERE fence = 1"),
        "lost"
    );
    assert_eq!(
        env.scalar("SELECT convert_from(stdout, 'UTF8') FROM runs WHERE fence = 1"),
        "rotated-token\n"
    );
    assert_eq!(
        env.scalar("SELECT string_agg(payload->>'fence', ',') FROM outbox"),
        "2"
    );
    // `output` skips lost runs unless asked by id.
    assert_eq!(stdout(&env.run(&["output", "--target", "p"])), "2\n");
    let lost_id = env.scalar("SELECT id FROM runs WHERE fence = 1");
    assert_eq!(
        stdout(&env.run(&["output", "--target", "p", "--run", &lost_id])),
        "rotated-token\n"
    );
    // The old holder's token-matched release touched nothing; the target ends free.
    assert_eq!(env.status()["targets"][0]["state"], "free");
}

#[test]
fn three_waiters_serialise_without_overlap() {
    let env = Env::new();
    let lock = env.path("inside");
    let log = env.path("log");
    let script = format!(
        "if mkdir '{l}' 2>/dev/null; then sleep 0.3; rmdir '{l}'; echo ok >> '{g}'; else echo OVERLAP >> '{g}'; fi",
        l = lock.display(),
        g = log.display()
    );
    let children: Vec<_> = (0..3)
        .map(|_| env.spawn(&["run", "--target", "s", "--wait", "--", "sh", "-c", &script]))
        .collect();
    for o in children.into_iter().map(finish) {
        assert_eq!(code(&o), 0, "{}", stderr(&o));
    }
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "ok\nok\nok\n");
    assert_eq!(
        env.scalar("SELECT string_agg(fence::text, ',' ORDER BY fence) FROM runs"),
        "1,2,3"
    );
}

#[test]
fn wait_with_a_limit_gives_up_with_the_busy_code() {
    let env = Env::new();
    let holder = env.hold("w", "sleep 30");
    let t = Instant::now();
    let o = env.run(&[
        "run",
        "--target",
        "w",
        "--wait=300ms",
        "--busy-exit-code",
        "9",
        "--",
        "true",
    ]);
    assert_eq!(code(&o), 9, "{}", stderr(&o));
    assert!(t.elapsed() >= Duration::from_millis(300));
    assert!(stderr(&o).contains("gave up waiting"), "{}", stderr(&o));
    env.stop(holder);
}

#[test]
fn a_result_finished_after_a_takeover_is_fenced_out_by_the_save() {
    // The command completes while its holder is paused past the TTL and someone else holds
    // the lease; on resume the holder's fenced save must refuse to store it.
    let env = Env::new();
    let pidfile = env.path("pid");
    let gate = env.path("gate");
    let script = format!(
        "echo $$ > '{}'; while [ ! -e '{}' ]; do sleep 0.02; done; echo stale-result",
        pidfile.display(),
        gate.display()
    );
    let holder = env.spawn(&[
        "run", "--target", "z", "--ttl", "1s", "--", "sh", "-c", &script,
    ]);
    let child: i32 = wait_for_file(&pidfile).parse().unwrap();
    let _reap = Reap(child);
    kill(holder.id(), libc::SIGSTOP);
    let taker = env.run(&["run", "--target", "z", "--wait=30s", "--", "true"]);
    assert_eq!(code(&taker), 0, "{}", stderr(&taker));
    std::fs::write(&gate, "").unwrap();
    wait_for("the command to finish while its holder is paused", || {
        !alive(child)
    });
    kill(holder.id(), libc::SIGCONT);
    let out = finish(holder);
    assert_eq!(code(&out), 76, "{}", stderr(&out));
    assert_eq!(
        env.scalar("SELECT outcome FROM runs WHERE fence = 1"),
        "lost"
    );
    assert_eq!(
        env.scalar("SELECT convert_from(stdout, 'UTF8') FROM runs WHERE fence = 1"),
        "stale-result\n"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM outbox"), "1");
}

#[test]
fn waiters_are_woken_by_the_release_not_by_their_fallback_poll() {
    // Five runs queue up on one target; each hands over to the next. A waiter polls only every
    // second, so gaps of a few milliseconds between one run's end and the next one's start show
    // that the release's NOTIFY woke it.
    let env = Env::new();
    let holder = env.hold("q", &format!("{}; sleep 0.1", env.gate()));
    let waiters: Vec<_> = (0..4)
        .map(|_| {
            Watched::new(env.spawn(&[
                "run", "-v", "--target", "q", "--ttl", "1h", "--wait", "--", "sleep", "0.1",
            ]))
        })
        .collect();
    for w in &waiters {
        w.wait_for_stderr("waiting for 'q'");
    }
    env.open_gate();
    assert_eq!(code(&finish(holder)), 0);
    for w in waiters {
        assert_eq!(code(&w.finish()), 0);
    }
    let gaps: Vec<f64> = env
        .sql(
            "SELECT extract(epoch FROM started_at - lag(finished_at) OVER (ORDER BY fence)) * 1000
               FROM runs ORDER BY fence OFFSET 1",
        )
        .into_iter()
        .map(|r| r[0].as_deref().unwrap().parse().unwrap())
        .collect();
    let mut sorted = gaps.clone();
    sorted.sort_by(f64::total_cmp);
    let median = (sorted[1] + sorted[2]) / 2.0;
    assert!(
        median < 300.0,
        "handover gaps {gaps:?} ms look like polling, not NOTIFY"
    );
}

// The same tests with leasectl behind a transaction-mode pgbouncer (every command
// works through a pooler).
crate::via_pooler!(
    sixteen_simultaneous_runs_exactly_one_runs_the_rest_exit_busy_promptly,
    exit_codes_and_signals_pass_through_and_are_stored,
    exec_failures_exit_126_or_127_and_release_the_lease,
    fences_strictly_increase_across_release_force_release_and_takeover,
    kill_9_of_the_holder_kills_its_command_and_a_waiter_takes_over_only_after_the_ttl,
    a_paused_holder_is_taken_over_and_on_resume_stops_its_command_stores_nothing_and_exits_76,
    three_waiters_serialise_without_overlap,
    wait_with_a_limit_gives_up_with_the_busy_code,
    a_result_finished_after_a_takeover_is_fenced_out_by_the_save,
);
