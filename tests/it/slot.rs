//! `run --slot`: at most one run per scheduled slot across hosts, judged by the database clock.

use std::process::{Command, Output};
use std::time::Duration;

use serde_json::Value;

use crate::common::*;

/// A script that counts its runs in `count` and prints what the slot looks like to it.
fn job(env: &Env, extra: &str) -> String {
    format!(
        "echo ran >> '{}'; {extra} echo \"slot=$LEASECTL_SLOT end=$LEASECTL_SLOT_END\"",
        env.path("count").display()
    )
}

fn runs_counted(env: &Env) -> usize {
    std::fs::read_to_string(env.path("count"))
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

/// `run --target TARGET --slot SCHEDULE EXTRA… -- sh -c SCRIPT` as a command, not yet started.
fn slot_command(
    mut cmd: Command,
    target: &str,
    schedule: &str,
    extra: &[&str],
    script: &str,
) -> Command {
    cmd.args(["run", "--target", target, "--slot", schedule])
        .args(extra)
        .args(["--", "sh", "-c", script]);
    cmd
}

fn slot_run(env: &Env, target: &str, schedule: &str, extra: &[&str], script: &str) -> Output {
    slot_command(env.command(), target, schedule, extra, script).output_in_time()
}

/// `runs --json` of `target`, newest first.
fn runs_json(env: &Env, target: &str) -> Vec<Value> {
    let out = env.run(&["runs", "--target", target, "--json"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["runs"].as_array().unwrap().clone()
}

fn with_outcome<'a>(runs: &'a [Value], outcome: &str) -> Vec<&'a Value> {
    runs.iter().filter(|r| r["outcome"] == outcome).collect()
}

/// Waits until `now() + lead` on the database clock is at least `margin_s` seconds away from
/// the next multiple of `period_s` seconds — the next slot boundary of a schedule that fires
/// every `period_s` (aligned to the epoch), as the callers will see it with skew `lead` — so a
/// test whose callers must share a slot does not straddle a boundary.
fn away_from_boundary(env: &Env, period_s: u32, lead: &str, margin_s: u32) {
    let sql = format!(
        "SELECT {period_s} - mod(extract(epoch FROM now() + interval '{lead}')::numeric, {period_s}) > {margin_s}"
    );
    wait_for("the database clock to be away from a slot boundary", || {
        env.scalar(&sql) == "t"
    });
}

/// libfaketime's preload library (Debian package `faketime`; scripts/test installs it).
fn libfaketime() -> String {
    ["x86_64-linux-gnu", "aarch64-linux-gnu"]
        .iter()
        .map(|arch| format!("/usr/lib/{arch}/faketime/libfaketime.so.1"))
        .find(|p| std::path::Path::new(p).exists())
        .expect("libfaketime is not installed: apt-get install faketime (scripts/test does)")
}

/// leasectl on a "host" whose clock is off by `offset` (`+2m`, `-2m`). Both clocks are moved:
/// the wall clock, and the monotonic one by the same constant, which tokio's timers do not
/// mind (DONT_FAKE_MONOTONIC=1 works as well). FAKETIME_NO_CACHE makes the offset apply from the
/// first call.
fn host_with_clock(env: &Env, offset: &str) -> Command {
    let mut c = env.command();
    c.env("LD_PRELOAD", libfaketime())
        .env("FAKETIME", offset)
        .env("FAKETIME_NO_CACHE", "1");
    c
}

#[test]
fn two_hosts_with_clocks_four_minutes_apart_do_their_slot_once() {
    let env = Env::new();
    // Every 3 minutes: the hosts' clocks (+2m, -2m) would put them in different slots; the
    // database's clock puts them in the same one. Default skew: 45s.
    away_from_boundary(&env, 180, "45 seconds", 10);
    let script = format!(
        "date +%s > '{}'; {}",
        env.path("clock").display(),
        job(&env, "sleep 0.3;")
    );
    let hosts: Vec<_> = ["+2m", "-2m"]
        .iter()
        .map(|offset| {
            slot_command(
                host_with_clock(&env, offset),
                "nightly",
                "*/3 * * * *",
                &["--wait"],
                &script,
            )
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
        })
        .collect();
    let outputs: Vec<_> = hosts.into_iter().map(finish).collect();
    for o in &outputs {
        assert_eq!(code(o), 0, "{}", stderr(o));
    }
    assert_eq!(runs_counted(&env), 1, "{outputs:?}");

    // The job ran on a host whose clock really was two minutes off the database's.
    let host_clock: i64 = std::fs::read_to_string(env.path("clock"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let db_clock: i64 = env
        .scalar("SELECT extract(epoch FROM now())::int8")
        .parse()
        .unwrap();
    assert!(
        (host_clock - db_clock).abs() >= 100,
        "host {host_clock}, database {db_clock}"
    );

    let runs = runs_json(&env, "nightly");
    let done = with_outcome(&runs, "completed");
    let skipped = with_outcome(&runs, "skipped");
    assert_eq!((done.len(), skipped.len()), (1, 1), "{runs:#?}");
    assert_eq!(skipped[0]["slot"], done[0]["slot"]);
    assert_eq!(skipped[0]["done_by"], done[0]["run_id"]);
}

#[test]
fn eight_callers_of_a_slot_at_once_run_it_once_and_seven_record_a_skip() {
    let env = Env::new();
    let script = job(&env, "sleep 0.3;");
    let callers: Vec<_> = (0..8)
        .map(|_| {
            slot_command(env.command(), "nightly", "0 2 * * *", &["--wait"], &script)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs: Vec<_> = callers.into_iter().map(finish).collect();
    for o in &outputs {
        assert_eq!(code(o), 0, "{}", stderr(o));
    }
    assert_eq!(runs_counted(&env), 1);
    // The seven that skipped said nothing (no -v) and printed nothing.
    let silent = outputs
        .iter()
        .filter(|o| o.stdout.is_empty() && o.stderr.is_empty())
        .count();
    assert_eq!(silent, 7, "{outputs:?}");

    let runs = runs_json(&env, "nightly");
    let done = with_outcome(&runs, "completed");
    let skipped = with_outcome(&runs, "skipped");
    assert_eq!((done.len(), skipped.len()), (1, 7), "{runs:#?}");
    for s in &skipped {
        assert_eq!(s["done_by"], done[0]["run_id"]);
        assert_eq!(s["slot"], done[0]["slot"]);
        assert_eq!(s["stdout_bytes"], 0);
        assert_eq!(s["exit_code"], Value::Null);
    }
    // Only the run that ran has an event.
    assert_eq!(env.scalar("SELECT count(*) FROM outbox"), "1");
    let status = env.status();
    assert_eq!(status["targets"][0]["skipped"], 7);
    assert_eq!(status["targets"][0]["last_run"]["outcome"], "completed");
    assert_eq!(env.held_leases(), "0");
}

#[test]
fn the_child_sees_its_slot_the_event_carries_it_and_a_skip_is_silent_unless_verbose() {
    let env = Env::new();
    let script = job(&env, "");
    let first = slot_run(&env, "report", "0 2 * * *", &[], &script);
    assert_eq!(code(&first), 0, "{}", stderr(&first));
    // A manual run in the afternoon belongs to the morning's slot: 02:00 today (on the
    // database's clock), or yesterday's before 01:59 (the skew is a minute).
    let expected = env.scalar(
        "SELECT to_char(date_trunc('day', (now() AT TIME ZONE 'UTC') + interval '1 minute'
                                          - interval '2 hours') + interval '2 hours',
                        'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')",
    );
    let out = stdout(&first);
    let slot = out
        .trim()
        .strip_prefix("slot=")
        .unwrap()
        .split(' ')
        .next()
        .unwrap();
    assert_eq!(slot, expected, "{out}");
    assert!(out.contains(" end="), "{out}");
    let end = out.trim().rsplit("end=").next().unwrap();
    assert!(end > slot, "{out}");

    let payload: Value =
        serde_json::from_str(&env.scalar("SELECT payload::text FROM outbox")).unwrap();
    assert_eq!(payload["slot"], slot);
    assert_eq!(payload["slot_end"], end);
    assert_eq!(payload["exit_code"], 0, "existing keys kept");

    // The second caller: no output, no event, exit 0.
    let skip = slot_run(&env, "report", "0 2 * * *", &[], &script);
    assert_eq!(code(&skip), 0);
    assert!(skip.stdout.is_empty() && skip.stderr.is_empty(), "{skip:?}");
    assert_eq!(env.scalar("SELECT count(*) FROM outbox"), "1");
    // With -v, one line says which run did the slot; --done-exit-code picks the code.
    let done_by = env.scalar("SELECT id FROM runs WHERE outcome = 'completed'");
    let verbose = env
        .command()
        .arg("-v")
        .args([
            "run",
            "--target",
            "report",
            "--slot",
            "0 2 * * *",
            "--done-exit-code",
            "3",
        ])
        .args(["--", "sh", "-c", &script])
        .output_in_time();
    assert_eq!(code(&verbose), 3, "{}", stderr(&verbose));
    assert!(verbose.stdout.is_empty());
    let lines: Vec<_> = stderr(&verbose)
        .lines()
        .filter(|l| l.contains("was done by run"))
        .map(str::to_owned)
        .collect();
    assert_eq!(lines.len(), 1, "{}", stderr(&verbose));
    assert!(
        lines[0].contains(&done_by) && lines[0].contains(slot),
        "{lines:?}"
    );
    assert_eq!(runs_counted(&env), 1);
    assert_eq!(env.scalar("SELECT count(*) FROM runs WHERE outcome = 'skipped' AND done_by IS NOT NULL AND stdout = '' AND stderr = ''"), "2");
    // `output` shows the run that did the slot, not the empty skip.
    let printed = env.run(&["output", "--target", "report"]);
    assert_eq!(stdout(&printed), out);
}

#[test]
fn a_new_slot_runs_although_the_previous_one_was_done() {
    let env = Env::new();
    // Every minute (skew 15s): a run stored for the previous slot does not do this one.
    away_from_boundary(&env, 60, "15 seconds", 8);
    assert_eq!(code(&env.run(&["migrate"])), 0);
    env.sql(
        "INSERT INTO runs (id, target, fence, token, outcome, argv, host, pid, started_at,
                           finished_at, exit_code, stdout, stderr, stdout_truncated,
                           stderr_truncated, slot, slot_end)
         SELECT gen_random_uuid(), 'tick', 1, gen_random_uuid(), 'completed', '{true}', 'other', 1,
                now() - interval '1 minute', now() - interval '1 minute', 0, '', '', false, false,
                date_trunc('minute', now() + interval '15 seconds') - interval '1 minute',
                date_trunc('minute', now() + interval '15 seconds')",
    );
    let script = job(&env, "");
    let ran = slot_run(&env, "tick", "* * * * *", &[], &script);
    assert_eq!(code(&ran), 0, "{}", stderr(&ran));
    assert_eq!(runs_counted(&env), 1, "the new slot ran");
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM runs a JOIN runs b ON b.slot = a.slot + interval '1 minute'
              WHERE a.host = 'other' AND b.host <> 'other' AND b.outcome = 'completed'"
        ),
        "1"
    );
    // …and that slot, now done, is skipped.
    let again = slot_run(&env, "tick", "* * * * *", &[], &script);
    assert_eq!(code(&again), 0);
    assert_eq!(runs_counted(&env), 1);
    assert_eq!(
        env.scalar("SELECT count(*) FROM runs WHERE outcome = 'skipped'"),
        "1"
    );
}

#[test]
fn a_caller_firing_within_the_skew_belongs_to_the_coming_slot() {
    let env = Env::new();
    // With a skew of 59s, every instant but the first second of a minute belongs to the next
    // minute's slot, as a host whose cron fires up to 59s early would want. Start well inside a
    // minute — past its first second, and with time to start before it ends.
    wait_for("the database clock to be inside a minute", || {
        env.scalar("SELECT mod(extract(epoch FROM now())::numeric, 60) BETWEEN 3 AND 50") == "t"
    });
    let ran = slot_run(
        &env,
        "early",
        "* * * * *",
        &["--slot-skew", "59s"],
        &job(&env, ""),
    );
    assert_eq!(code(&ran), 0, "{}", stderr(&ran));
    assert_eq!(
        env.scalar(
            "SELECT slot = date_trunc('minute', started_at) + interval '1 minute' FROM runs"
        ),
        "t"
    );
}

#[test]
fn until_success_lets_a_failed_slot_run_again_and_a_success_close_it() {
    let env = Env::new();
    let counted = |extra: &str| job(&env, extra);
    // Without --until-success a failure does the slot: at most once.
    let failed = slot_run(&env, "plain", "0 2 * * *", &[], &counted("exit 3;"));
    assert_eq!(code(&failed), 3);
    let skipped = slot_run(&env, "plain", "0 2 * * *", &[], &counted(""));
    assert_eq!(code(&skipped), 0);
    assert_eq!(runs_counted(&env), 1);

    // With it, the next caller runs after a failure (and after a timeout)…
    let until = ["--until-success"];
    let failed = slot_run(&env, "retried", "0 2 * * *", &until, &counted("exit 3;"));
    assert_eq!(code(&failed), 3);
    let timed_out = slot_run(
        &env,
        "retried",
        "0 2 * * *",
        &["--until-success", "--timeout", "200ms"],
        &counted("sleep 30;"),
    );
    assert_eq!(code(&timed_out), 124);
    let ok = slot_run(&env, "retried", "0 2 * * *", &until, &counted(""));
    assert_eq!(code(&ok), 0, "{}", stderr(&ok));
    assert_eq!(runs_counted(&env), 4);
    // …and a success closes it.
    let closed = slot_run(&env, "retried", "0 2 * * *", &until, &counted(""));
    assert_eq!(code(&closed), 0);
    assert_eq!(runs_counted(&env), 4);
    let runs = runs_json(&env, "retried");
    let outcomes: Vec<_> = runs
        .iter()
        .map(|r| r["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["skipped", "completed", "timed_out", "completed"]);
    assert_eq!(runs[0]["done_by"], runs[1]["run_id"]);
}

/// A run stopped by `--timeout` ran in its slot and ended: it did the slot (at most one run
/// per slot), so the next caller of that slot skips — unless `--until-success`.
#[test]
fn a_timed_out_run_does_its_slot() {
    let env = Env::new();
    let timed_out = slot_run(
        &env,
        "slow",
        "0 2 * * *",
        &["--timeout", "200ms"],
        &job(&env, "sleep 30;"),
    );
    assert_eq!(code(&timed_out), 124, "{}", stderr(&timed_out));
    let next = slot_run(&env, "slow", "0 2 * * *", &[], &job(&env, ""));
    assert_eq!(code(&next), 0, "{}", stderr(&next));
    assert_eq!(
        runs_counted(&env),
        1,
        "the slot was done by the timed-out run"
    );
    let runs = runs_json(&env, "slow");
    let outcomes: Vec<_> = runs
        .iter()
        .map(|r| r["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["skipped", "timed_out"]);
    assert_eq!(runs[0]["done_by"], runs[1]["run_id"]);
}

/// Two cron hosts firing together: the second finds this slot's run in progress and has
/// nothing to do. It records a skip naming that run and exits with `--done-exit-code` at once —
/// with or without `--wait`, while the holder still runs — and says nothing unless `-v`.
#[test]
fn a_caller_that_finds_this_slots_run_in_progress_records_a_skip_at_once() {
    let env = Env::new();
    let holder = env.hold_with(
        env.command(),
        "nightly",
        &["--slot", "0 2 * * *"],
        &format!("{}; echo first", env.gate()),
    );
    let quiet = slot_command(env.command(), "nightly", "0 2 * * *", &[], "echo second")
        .output_within(Duration::from_secs(20));
    assert_eq!(code(&quiet), 0, "{}", stderr(&quiet));
    assert!(
        quiet.stdout.is_empty() && quiet.stderr.is_empty(),
        "{quiet:?}"
    );
    let mut verbose = env.command();
    verbose.arg("-v");
    let waiter = slot_command(
        verbose,
        "nightly",
        "0 2 * * *",
        &["--wait", "--done-exit-code", "3"],
        "echo second",
    )
    .output_within(Duration::from_secs(20));
    assert_eq!(code(&waiter), 3, "{}", stderr(&waiter));
    assert!(waiter.stdout.is_empty(), "{waiter:?}");
    let mut holder = holder;
    assert!(
        holder.try_wait().unwrap().is_none(),
        "the holder still runs: the skips did not wait for it"
    );
    // Both skips name the run in progress, by the id it is stored with once it ends.
    let running = with_outcome(&runs_json(&env, "nightly"), "skipped")
        .iter()
        .map(|r| (r["done_by"].clone(), r["done_by_running"].clone()))
        .collect::<Vec<_>>();
    env.open_gate();
    let out = finish(holder);
    assert_eq!((code(&out), stdout(&out)), (0, "first\n".to_owned()));
    let runs = runs_json(&env, "nightly");
    let done = with_outcome(&runs, "completed");
    let skipped = with_outcome(&runs, "skipped");
    assert_eq!((done.len(), skipped.len()), (1, 2), "{runs:#?}");
    assert_eq!(
        running,
        vec![(done[0]["run_id"].clone(), Value::Bool(true)); 2]
    );
    for s in &skipped {
        assert_eq!(s["done_by"], done[0]["run_id"]);
        assert_eq!(s["done_by_running"], true);
        assert_eq!(s["fence"], done[0]["fence"]);
        assert_eq!(s["slot"], done[0]["slot"]);
        assert_eq!(s["slot_end"], done[0]["slot_end"]);
        assert_eq!(
            (s["stdout_bytes"].clone(), s["exit_code"].clone()),
            (0.into(), Value::Null)
        );
    }
    assert_eq!(done[0]["done_by_running"], Value::Null);
    let said = stderr(&waiter);
    let run_id = done[0]["run_id"].as_str().unwrap();
    assert!(
        said.contains(&format!("is being done by run {run_id} (")) && said.contains("; skipped"),
        "{said}"
    );
    // Only the run that ran has an event.
    assert_eq!(env.scalar("SELECT count(*) FROM outbox"), "1");
    assert_eq!(env.held_leases(), "0");
}

/// Only this slot's run in progress leaves nothing to do. A holder of an earlier slot of the
/// same schedule (here: a holder whose skew kept it in the current minute, a caller whose skew
/// takes it into the next), of another schedule, or without `--slot` makes the target busy
/// as ever (75, unrecorded) — and a waiter waits for it, then runs its own slot.
#[test]
fn a_run_of_an_earlier_slot_or_another_schedule_is_busy_as_ever() {
    let env = Env::new();
    // Inside a minute, with time left for the whole test before it ends.
    wait_for("the database clock to be inside a minute", || {
        env.scalar("SELECT mod(extract(epoch FROM now())::numeric, 60) BETWEEN 3 AND 35") == "t"
    });
    let every_minute = ["--slot-skew", "1s"];
    let holder = env.hold_with(
        env.command(),
        "tick",
        &["--slot", "* * * * *", every_minute[0], every_minute[1]],
        &format!("{}; echo first", env.gate()),
    );
    let coming = ["--slot-skew", "59s"];
    let busy = slot_run(&env, "tick", "* * * * *", &coming, "echo second");
    assert_one_line_error(&busy, 75, "'tick' is busy: held by ");
    let other = slot_run(&env, "tick", "30 4 * * *", &[], "echo third");
    assert_one_line_error(&other, 75, "'tick' is busy: held by ");
    assert_eq!(
        env.scalar("SELECT count(*) FROM runs"),
        "0",
        "busy callers record nothing"
    );
    // The coming slot's waiter waits for the earlier slot's run, then runs.
    let mut verbose = env.command();
    verbose.arg("-v");
    let waiter = Watched::new(
        slot_command(
            verbose,
            "tick",
            "* * * * *",
            &["--slot-skew", "59s", "--wait=30s"],
            "echo second",
        )
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap(),
    );
    waiter.wait_for_stderr("waiting for 'tick'");
    env.open_gate();
    assert_eq!(code(&finish(holder)), 0);
    let out = waiter.finish();
    assert_eq!(
        (code(&out), stdout(&out)),
        (0, "second\n".to_owned()),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        env.scalar(
            "SELECT string_agg(outcome, ',' ORDER BY slot) || ' ' || (max(slot) - min(slot))::text FROM runs"
        ),
        "completed,completed 00:01:00"
    );

    // A holder without --slot never says a slot: busy, once it has had its moment to say one.
    let plain = env.hold("plain", &env.gate().replace("gate", "gate-plain"));
    let busy = slot_run(&env, "plain", "* * * * *", &[], "echo second");
    assert_one_line_error(&busy, 75, "'plain' is busy: held by ");
    std::fs::write(env.path("gate-plain"), "").unwrap();
    assert_eq!(code(&finish(plain)), 0);
}

/// With `--until-success`, a run in progress that then fails leaves its slot open again: the
/// caller that skipped while it ran did not run it, the next caller does.
#[test]
fn a_slot_whose_run_in_progress_fails_with_until_success_is_open_again() {
    let env = Env::new();
    let until = ["--until-success"];
    let holder = env.hold_with(
        env.command(),
        "sync",
        &["--slot", "*/15 * * * *", "--until-success"],
        &format!("{}; echo failing; exit 3", env.gate()),
    );
    let skipped = slot_run(&env, "sync", "*/15 * * * *", &until, &job(&env, ""));
    assert_eq!(code(&skipped), 0, "{}", stderr(&skipped));
    assert_eq!(runs_counted(&env), 0);
    env.open_gate();
    assert_eq!(code(&finish(holder)), 3);
    let retried = slot_run(&env, "sync", "*/15 * * * *", &until, &job(&env, ""));
    assert_eq!(code(&retried), 0, "{}", stderr(&retried));
    assert_eq!(runs_counted(&env), 1, "the next caller ran the slot");
    let runs = runs_json(&env, "sync");
    let outcomes: Vec<_> = runs
        .iter()
        .map(|r| format!("{} {}", r["outcome"].as_str().unwrap(), r["exit_code"]))
        .collect();
    assert_eq!(outcomes, ["completed 0", "completed 3", "skipped null"]);
    assert_eq!(runs[2]["done_by"], runs[1]["run_id"]);
    assert_eq!(runs[2]["done_by_running"], true);
    assert_eq!(runs[0]["slot"], runs[1]["slot"]);
}

/// A run in progress that never ends — its leasectl SIGKILLed — never did its slot: a caller
/// that came while its lease lived skipped, and the first caller after its TTL runs the slot.
#[test]
fn a_slot_whose_holder_was_killed_is_run_by_the_first_caller_after_its_ttl() {
    let env = Env::new();
    let holder = env.hold_with(
        env.command(),
        "nightly",
        &["--slot", "0 2 * * *", "--ttl", "1s"],
        &env.gate(),
    );
    let skip = slot_run(&env, "nightly", "0 2 * * *", &[], &job(&env, ""));
    assert_eq!(code(&skip), 0, "{}", stderr(&skip));
    kill(holder.id(), libc::SIGKILL);
    finish(holder);
    wait_for("the killed holder's lease to expire", || {
        env.scalar(
            "SELECT count(*) FROM leases
              WHERE token IS NOT NULL AND heartbeat_at + ttl_ms * interval '1 millisecond' >= now()",
        ) == "0"
    });
    let ran = slot_run(&env, "nightly", "0 2 * * *", &[], &job(&env, ""));
    assert_eq!(code(&ran), 0, "{}", stderr(&ran));
    assert_eq!(runs_counted(&env), 1, "the slot was run after all");
    let runs = runs_json(&env, "nightly");
    let outcomes: Vec<_> = runs
        .iter()
        .map(|r| r["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["completed", "skipped"]);
    assert_eq!(runs[1]["done_by_running"], true);
    assert_ne!(runs[1]["done_by"], runs[0]["run_id"]);
    assert_eq!(runs[1]["slot"], runs[0]["slot"]);
    env.open_gate();
}

/// A run that already did this slot counts, whoever holds the lease now: a caller that finds
/// the target busy with another job (here a run without `--slot`) after the slot's run ended
/// records a skip naming that run, as it would have with the lease.
#[test]
fn a_slot_already_done_is_skipped_even_while_another_run_holds_the_target() {
    let env = Env::new();
    let done = slot_run(&env, "nightly", "0 2 * * *", &[], &job(&env, ""));
    assert_eq!(code(&done), 0, "{}", stderr(&done));
    let plain = env.hold("nightly", &env.gate());
    let skip = slot_run(&env, "nightly", "0 2 * * *", &[], &job(&env, ""));
    assert_eq!(code(&skip), 0, "{}", stderr(&skip));
    assert!(skip.stdout.is_empty() && skip.stderr.is_empty(), "{skip:?}");
    assert_eq!(runs_counted(&env), 1);
    let runs = runs_json(&env, "nightly");
    let ran = with_outcome(&runs, "completed");
    let skipped = with_outcome(&runs, "skipped");
    assert_eq!((ran.len(), skipped.len()), (1, 1), "{runs:#?}");
    assert_eq!(skipped[0]["done_by"], ran[0]["run_id"]);
    assert_eq!(skipped[0]["done_by_running"], false);
    assert_eq!(skipped[0]["fence"], ran[0]["fence"]);
    env.open_gate();
    assert_eq!(code(&finish(plain)), 0);
}

/// A holder's slot is on its lease row only once it has checked it, right after acquiring. A
/// caller that finds a holder in between looks again for a moment instead of calling the
/// target busy. (The holder here is a row: one that never says its slot until the caller has
/// looked once, its acquisition kept fresh meanwhile.)
#[test]
fn a_holder_that_has_not_said_its_slot_yet_is_given_a_moment_to_say_it() {
    let env = Env::new();
    assert_eq!(code(&env.run(&["migrate"])), 0);
    env.sql(
        "INSERT INTO leases (target, token, fence, ttl_ms, heartbeat_at, acquired_at, holder_host, holder_pid)
         VALUES ('n', gen_random_uuid(), 7, 60000, now(), now(), 'cron-1', 4242)",
    );
    let mut caller = slot_command(env.command(), "n", "0 2 * * *", &[], "echo ran")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The caller's look shows in pg_stat_activity (the pattern is split so that this query's
    // own text does not match it) — unless it has already given up on the holder.
    let looked = format!(
        "SELECT count(*) FROM pg_stat_activity
          WHERE query LIKE '%' || 'slot_schedule = ' || '$3%' AND query LIKE '%{}%'",
        env.schema
    );
    wait_for("the caller to look at the holder", || {
        env.sql("UPDATE leases SET acquired_at = now(), heartbeat_at = now()");
        env.scalar(&looked) != "0" || caller.try_wait().unwrap().is_some()
    });
    let run = "6c1f3a52-0b7e-4d55-9a43-4f7a1d2e9b10";
    env.sql(&format!(
        "UPDATE leases
            SET slot_fence = fence, slot_schedule = '0 2 * * *', slot_tz = NULL, slot_run = '{run}',
                slot = (date_trunc('day', (now() AT TIME ZONE 'UTC') + interval '1 minute'
                                          - interval '2 hours') + interval '2 hours') AT TIME ZONE 'UTC',
                slot_end = (date_trunc('day', (now() AT TIME ZONE 'UTC') + interval '1 minute'
                                              - interval '2 hours') + interval '26 hours') AT TIME ZONE 'UTC'"
    ));
    let out = finish(caller);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(out.stdout.is_empty(), "{out:?}");
    assert_eq!(
        env.scalar(
            "SELECT outcome || ' ' || done_by || ' ' || fence || ' ' || done_by_running FROM runs"
        ),
        format!("skipped {run} 7 true")
    );
}

/// Hosts' clocks never enter: a caller on a host whose clock is four minutes behind the
/// holder's finds the holder's slot in progress by the database's clock, and skips.
#[test]
fn a_caller_on_a_skewed_host_clock_skips_the_slot_in_progress() {
    let env = Env::new();
    away_from_boundary(&env, 180, "45 seconds", 20);
    let holder = env.hold_with(
        host_with_clock(&env, "+2m"),
        "nightly",
        &["--slot", "*/3 * * * *"],
        &env.gate(),
    );
    let skip = slot_command(
        host_with_clock(&env, "-2m"),
        "nightly",
        "*/3 * * * *",
        &[],
        "echo second",
    )
    .output_within(Duration::from_secs(20));
    assert_eq!(code(&skip), 0, "{}", stderr(&skip));
    env.open_gate();
    assert_eq!(code(&finish(holder)), 0);
    let runs = runs_json(&env, "nightly");
    let outcomes: Vec<_> = runs
        .iter()
        .map(|r| r["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["completed", "skipped"]);
    assert_eq!(runs[1]["done_by"], runs[0]["run_id"]);
    assert_eq!(runs[1]["slot"], runs[0]["slot"]);
}

/// Eight cron lines firing at once without `--wait`: one runs, seven record a skip and exit 0
/// — none is busy, whether it comes before the holder has said its slot, while its run is in
/// progress, or after it.
#[test]
fn eight_callers_without_wait_at_once_run_the_slot_once_and_none_is_busy() {
    let env = Env::new();
    let script = job(&env, "sleep 1;");
    let callers: Vec<_> = (0..8)
        .map(|_| {
            slot_command(env.command(), "nightly", "0 2 * * *", &[], &script)
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs: Vec<_> = callers.into_iter().map(finish).collect();
    for o in &outputs {
        assert_eq!(code(o), 0, "{}", stderr(o));
    }
    assert_eq!(runs_counted(&env), 1);
    let runs = runs_json(&env, "nightly");
    let done = with_outcome(&runs, "completed");
    let skipped = with_outcome(&runs, "skipped");
    assert_eq!((done.len(), skipped.len()), (1, 7), "{runs:#?}");
    for s in &skipped {
        assert_eq!(s["done_by"], done[0]["run_id"]);
    }
}

#[test]
fn the_schedule_is_stored_on_the_target_and_the_latest_wins() {
    let env = Env::new();
    let ok = slot_run(
        &env,
        "t",
        "0 2 * * *",
        &["--slot-tz", "Europe/Berlin"],
        "true",
    );
    assert_eq!(code(&ok), 0, "{}", stderr(&ok));
    let stored = || env.sql("SELECT schedule, schedule_tz FROM expectations WHERE target = 't'");
    assert_eq!(
        stored(),
        [[
            Some("0 2 * * *".to_owned()),
            Some("Europe/Berlin".to_owned())
        ]]
    );
    let ok = slot_run(&env, "t", "@hourly", &[], "true");
    assert_eq!(code(&ok), 0, "{}", stderr(&ok));
    assert_eq!(stored(), [[Some("@hourly".to_owned()), None]]);
    // A zone is stored as the database spells it, whatever case it was given in.
    let ok = slot_run(
        &env,
        "t",
        "@hourly",
        &["--slot-tz", "europe/berlin"],
        "true",
    );
    assert_eq!(code(&ok), 0, "{}", stderr(&ok));
    assert_eq!(
        stored(),
        [[Some("@hourly".to_owned()), Some("Europe/Berlin".to_owned())]]
    );
}

/// Zones come from the system's time zone database, as cron's do (`TZDIR` names another
/// directory, as for glibc): a zone that only that database has is accepted, and the slot
/// follows its rules, updates included, not a copy built into the binary.
#[test]
fn zones_are_read_from_the_systems_time_zone_database() {
    let env = Env::new();
    let tzdir = tempfile::tempdir().unwrap();
    std::fs::create_dir(tzdir.path().join("Leasectl")).unwrap();
    // Berlin's rules under a name no built-in database has: 02:00 there is 00:00 UTC in
    // summer (CEST).
    std::fs::copy(
        "/usr/share/zoneinfo/Europe/Berlin",
        tzdir.path().join("Leasectl/Test"),
    )
    .unwrap();
    let run = |tzdir: Option<&std::path::Path>| {
        let mut cmd = env.command();
        if let Some(dir) = tzdir {
            cmd.env("TZDIR", dir);
        }
        cmd.args(["run", "--target", "t", "--slot", "0 2 * * *"])
            .args(["--slot-tz", "Leasectl/Test", "--", "sh", "-c"])
            .arg("echo $LEASECTL_SLOT")
            .output_in_time()
    };
    assert_one_line_error(&run(None), 2, "IANA");
    let ok = run(Some(tzdir.path()));
    assert_eq!(code(&ok), 0, "{}", stderr(&ok));
    let slot = String::from_utf8_lossy(&ok.stdout).trim().to_owned();
    // The same slot by PostgreSQL's own Europe/Berlin: the latest 02:00 there at or before
    // the database's now plus the default skew, a minute.
    let expected = env.sql(
        "WITH t AS (SELECT (now() + interval '1 minute') AT TIME ZONE 'Europe/Berlin' AS local),
              d AS (SELECT date_trunc('day', local) + interval '2 hours' AS two, local FROM t)
         SELECT to_char(((two - CASE WHEN local < two THEN interval '1 day' ELSE interval '0' END)
                         AT TIME ZONE 'Europe/Berlin') AT TIME ZONE 'UTC',
                        'YYYY-MM-DD\"T\"HH24:MI:SS') FROM d",
    );
    let expected = expected[0][0].clone().unwrap();
    assert!(
        slot.starts_with(&expected),
        "the slot by Berlin's rules starts at {expected}Z: {slot}"
    );
}

#[test]
fn bad_schedules_zones_and_combinations_are_usage_errors() {
    let env = Env::new();
    let run = |args: &[&str]| {
        env.command()
            .args(["run", "--target", "t"])
            .args(args)
            .args(["--", "true"])
            .output_in_time()
    };
    assert_one_line_error(&run(&["--slot", "0 2 * *"]), 2, "not a cron schedule");
    assert_one_line_error(&run(&["--slot", "@reboot"]), 2, "not a cron schedule");
    assert_one_line_error(&run(&["--slot", "0 0 31 2 *"]), 2, "never fires");
    assert_one_line_error(
        &run(&["--slot", "0 2 * * *", "--slot-tz", "Mars/Olympus"]),
        2,
        "IANA",
    );
    // A path, or this host's own zone, is not a zone every host shares.
    for zone in [
        "../../../etc/passwd",
        "/usr/share/zoneinfo/UTC",
        "localtime",
        "posixrules",
    ] {
        let o = run(&["--slot", "0 2 * * *", "--slot-tz", zone]);
        assert_one_line_error(&o, 2, "--slot-tz");
    }
    assert_one_line_error(
        &run(&["--slot", "0 2 * * *", "--slot-tz", "localtime"]),
        2,
        "this host's own zone",
    );
    assert_one_line_error(&run(&["--slot-tz", "UTC"]), 2, "--slot");
    assert_one_line_error(&run(&["--until-success"]), 2, "--slot");
    assert_one_line_error(
        &run(&["--slot", "* * * * *", "--slot-skew", "2m"]),
        2,
        "--slot-skew",
    );
    assert_one_line_error(
        &run(&["--slot", "0 2 * * *", "--reuse-within", "1m"]),
        2,
        "--reuse-within",
    );
}

crate::via_pooler!(
    eight_callers_of_a_slot_at_once_run_it_once_and_seven_record_a_skip,
    the_child_sees_its_slot_the_event_carries_it_and_a_skip_is_silent_unless_verbose,
    a_caller_that_finds_this_slots_run_in_progress_records_a_skip_at_once,
);
