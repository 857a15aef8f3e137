//! `--reuse-within` and `--wait` as a cross-process singleflight (the OAuth refresh case).

use crate::common::*;

/// A command that counts its runs in `count` and prints a value unique to this run.
fn refresh_script(env: &Env, extra: &str) -> String {
    format!(
        "echo ran >> '{}'; {extra} echo token-$LEASECTL_FENCE-$$",
        env.path("count").display()
    )
}

fn runs_counted(env: &Env) -> usize {
    std::fs::read_to_string(env.path("count"))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

#[test]
fn eight_concurrent_waiting_callers_run_the_command_once_and_print_the_same_output() {
    let env = Env::new();
    let script = refresh_script(&env, "sleep 0.5;");
    let children: Vec<_> = (0..8)
        .map(|_| {
            env.spawn(&[
                "run",
                "--target",
                "oauth",
                "--wait",
                "--reuse-within",
                "1m",
                "--",
                "sh",
                "-c",
                &script,
            ])
        })
        .collect();
    let outputs: Vec<_> = children.into_iter().map(finish).collect();
    for o in &outputs {
        assert_eq!(code(o), 0, "{}", stderr(o));
    }
    let first = stdout(&outputs[0]);
    assert!(first.starts_with("token-1-"), "{first:?}");
    assert!(
        outputs.iter().all(|o| stdout(o) == first),
        "outputs differ: {:?}",
        outputs.iter().map(stdout).collect::<Vec<_>>()
    );
    assert_eq!(runs_counted(&env), 1);
    assert_eq!(env.scalar("SELECT count(*) FROM runs"), "1");
}

#[test]
fn a_fresh_result_is_reused_and_an_expired_window_runs_again() {
    let env = Env::new();
    let script = refresh_script(&env, "");
    let first = env.run(&["run", "--target", "tok", "--", "sh", "-c", &script]);
    assert_eq!(code(&first), 0);
    let reused = env.run(&[
        "run",
        "--target",
        "tok",
        "--reuse-within",
        "1h",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    assert_eq!(code(&reused), 0);
    assert_eq!(stdout(&reused), stdout(&first));
    assert_eq!(runs_counted(&env), 1);

    wait_for("the stored run to age past 300ms", || {
        env.scalar("SELECT bool_and(finished_at < now() - interval '300 milliseconds') FROM runs")
            == "t"
    });
    let fresh = env.run(&[
        "run",
        "--target",
        "tok",
        "--reuse-within",
        "300ms",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    assert_eq!(code(&fresh), 0);
    assert_ne!(stdout(&fresh), stdout(&first));
    assert_eq!(runs_counted(&env), 2);
}

#[test]
fn a_failed_run_is_not_reused_by_a_caller_that_did_not_wait_for_it() {
    let env = Env::new();
    let fail = refresh_script(&env, "exit 3;");
    assert_eq!(
        code(&env.run(&["run", "--target", "f", "--", "sh", "-c", &fail])),
        3
    );
    let ok = refresh_script(&env, "");
    let o = env.run(&[
        "run",
        "--target",
        "f",
        "--reuse-within",
        "1h",
        "--",
        "sh",
        "-c",
        &ok,
    ]);
    assert_eq!(code(&o), 0);
    assert_eq!(runs_counted(&env), 2);
}

/// Starts a holder that counts its run, blocks until the gate opens, then runs `tail`;
/// returns once it holds the lease.
fn gated_holder(env: &Env, tail: &str) -> std::process::Child {
    let script = format!(
        "echo ran >> '{}'; {}; {tail}",
        env.path("count").display(),
        env.gate()
    );
    env.hold("sf", &script)
}

/// Starts `n` waiting singleflight callers and returns once all are in their wait loop.
fn waiters(env: &Env, n: usize) -> Vec<Watched> {
    let script = refresh_script(env, "");
    let ws: Vec<_> = (0..n)
        .map(|_| {
            Watched::new(env.spawn(&[
                "run",
                "-v",
                "--target",
                "sf",
                "--wait",
                "--reuse-within",
                "1m",
                "--",
                "sh",
                "-c",
                &script,
            ]))
        })
        .collect();
    for w in &ws {
        w.wait_for_stderr("waiting for 'sf'");
    }
    ws
}

#[test]
fn waiters_share_the_failure_of_the_run_they_waited_for() {
    let env = Env::new();
    let holder = gated_holder(&env, "echo refresh-failed; exit 3");
    let ws = waiters(&env, 3);
    env.open_gate();
    assert_eq!(code(&finish(holder)), 3);
    for w in ws {
        let o = w.finish();
        assert_eq!(code(&o), 3, "{}", stderr(&o));
        assert_eq!(stdout(&o), "refresh-failed\n");
    }
    assert_eq!(runs_counted(&env), 1);
}

#[test]
fn after_an_interrupted_run_the_waiters_compete_and_one_runs_for_all() {
    let env = Env::new();
    let holder = gated_holder(&env, "true");
    let ws = waiters(&env, 3);
    env.stop(holder);
    let outs: Vec<_> = ws.into_iter().map(Watched::finish).collect();
    for o in &outs {
        assert_eq!(code(o), 0, "{}", stderr(o));
    }
    assert!(
        stdout(&outs[0]).starts_with("token-2-"),
        "{}",
        stdout(&outs[0])
    );
    assert!(outs.iter().all(|o| stdout(o) == stdout(&outs[0])));
    // The interrupted holder plus exactly one waiter ran.
    assert_eq!(runs_counted(&env), 2);
    assert_eq!(
        env.scalar("SELECT string_agg(outcome, ',' ORDER BY fence) FROM runs"),
        "interrupted,completed"
    );
}

#[test]
fn a_result_stored_while_the_caller_acquired_is_reused_instead_of_running_again() {
    // Caller B finds no fresh result, then acquires; A stores its result in between. B must
    // look again after acquiring, or two refreshes run back to back. B's acquisition is held
    // inside the database (a BEFORE INSERT trigger that waits for a `go` row) until A is done.
    let env = Env::new();
    assert_eq!(code(&env.run(&["migrate"])), 0);
    env.sql(&format!(
        "CREATE TABLE go (ok bool);
         CREATE TABLE hold (pid int);
         CREATE FUNCTION hold_acquire() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF EXISTS (SELECT 1 FROM \"{s}\".hold WHERE pid = NEW.holder_pid) THEN
                 WHILE NOT EXISTS (SELECT 1 FROM \"{s}\".go) LOOP PERFORM pg_sleep(0.02); END LOOP;
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER hold BEFORE INSERT ON leases FOR EACH ROW EXECUTE FUNCTION hold_acquire();",
        s = env.schema
    ));
    let a = env.spawn(&[
        "run",
        "--target",
        "oauth",
        "--",
        "sh",
        "-c",
        &format!("{}; {}", env.gate(), refresh_script(&env, "")),
    ]);
    wait_for("A to hold the lease", || env.held_leases() == "1");
    let b = env
        .command()
        .args([
            "run",
            "--target",
            "oauth",
            "--wait",
            "--reuse-within",
            "1h",
            "--",
            "sh",
            "-c",
        ])
        .arg(refresh_script(&env, ""))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    env.sql(&format!("INSERT INTO hold VALUES ({})", b.id()));
    // B's next acquisition attempt now waits in the trigger; wake A and let it finish.
    wait_for("B's acquisition to be held", || {
        env.scalar(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND query LIKE '%\"{}\".leases%'",
            env.schema
        )) != "0"
    });
    env.open_gate();
    let a = finish(a);
    assert_eq!(code(&a), 0, "{}", stderr(&a));
    env.sql("INSERT INTO go VALUES (true)");
    let b = finish(b);
    assert_eq!(code(&b), 0, "{}", stderr(&b));
    assert_eq!(stdout(&b), stdout(&a), "B must print A's stored result");
    let runs = std::fs::read_to_string(env.path("count")).unwrap();
    assert_eq!(
        runs.lines().count(),
        1,
        "the refresh ran {} times",
        runs.lines().count()
    );
}

// The same tests with leasectl behind a transaction-mode pgbouncer (every command
// works through a pooler).
crate::via_pooler!(
    eight_concurrent_waiting_callers_run_the_command_once_and_print_the_same_output,
    a_fresh_result_is_reused_and_an_expired_window_runs_again,
    a_failed_run_is_not_reused_by_a_caller_that_did_not_wait_for_it,
    waiters_share_the_failure_of_the_run_they_waited_for,
    after_an_interrupted_run_the_waiters_compete_and_one_runs_for_all,
    a_result_stored_while_the_caller_acquired_is_reused_instead_of_running_again,
);

/// A `--slot` caller that skips without the lease records the fence of the run that did its
/// slot, possibly after that run ended. Such a skip is not the awaited acquisition's run: the
/// waiters still share the run itself — here its failure, which only the awaited run gives
/// them (a caller reuses only a success). (The skip is a row written as that caller writes it,
/// finishing after the run.)
#[test]
fn a_skip_carrying_the_awaited_fence_does_not_hide_the_run_from_its_waiters() {
    let env = Env::new();
    let holder = gated_holder(&env, "echo refresh-failed; exit 3");
    let ws = waiters(&env, 2);
    env.sql(
        "INSERT INTO runs (id, target, fence, token, outcome, argv, host, pid, started_at,
                           finished_at, stdout, stderr, stdout_truncated, stderr_truncated,
                           slot, slot_end, done_by, done_by_running)
         SELECT gen_random_uuid(), target, fence, gen_random_uuid(), 'skipped', '{true}', 'cron-2',
                1, now() + interval '1 hour', now() + interval '1 hour', '', '', false, false,
                now(), now() + interval '1 day', gen_random_uuid(), false
           FROM leases WHERE target = 'sf'",
    );
    env.open_gate();
    assert_eq!(code(&finish(holder)), 3);
    for w in ws {
        let o = w.finish();
        assert_eq!(
            (code(&o), stdout(&o)),
            (3, "refresh-failed\n".to_owned()),
            "{}",
            stderr(&o)
        );
    }
    assert_eq!(runs_counted(&env), 1);
}
