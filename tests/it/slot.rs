//! `run --slot`: at most one run per scheduled slot across hosts, judged by the database clock.

use std::process::{Command, Output};

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

#[test]
fn a_waiter_behind_the_slots_run_skips_once_it_ends() {
    let env = Env::new();
    let holder = env.hold_with(
        env.command(),
        "nightly",
        &["--slot", "0 2 * * *"],
        &format!("{}; echo first", env.gate()),
    );
    // Without --wait, busy as ever.
    let busy = slot_run(&env, "nightly", "0 2 * * *", &[], "echo second");
    assert_eq!(code(&busy), 75, "{}", stderr(&busy));
    let mut verbose = env.command();
    verbose.arg("-v");
    let waiter = Watched::new(
        slot_command(verbose, "nightly", "0 2 * * *", &["--wait"], "echo second")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    waiter.wait_for_stderr("waiting for 'nightly'");
    env.open_gate();
    assert_eq!(code(&finish(holder)), 0);
    let out = waiter.finish();
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(out.stdout.is_empty(), "{out:?}");
    assert!(stderr(&out).contains("was done by run"), "{}", stderr(&out));
    let runs = runs_json(&env, "nightly");
    let outcomes: Vec<_> = runs
        .iter()
        .map(|r| r["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(outcomes, ["skipped", "completed"]);
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
    a_waiter_behind_the_slots_run_skips_once_it_ends,
);
