//! The dead-man switch: `expect`, health in `status`, `check`, and the incident
//! events a running relay inserts — exactly once, even with three relays.
//!
//! Fixtures are SQL rows (expectations, runs, leases) dated relative to the database's `now()`,
//! so every state is reached at once instead of by waiting for a schedule.

use std::fs::OpenOptions;
use std::path::Path;
use std::process::Stdio;

use serde_json::Value;

use crate::common::*;
use crate::events::migrated;

/// Inserts a run of `target`: `outcome`, `exit` (SQL: a number or NULL), finished `ago` (an SQL
/// interval) before now, in `slot` (SQL: a timestamptz or NULL).
fn insert_run(env: &Env, target: &str, outcome: &str, exit: &str, ago: &str, slot: &str) {
    env.sql(&format!(
        "INSERT INTO runs (id, target, fence, token, outcome, argv, host, pid, started_at,
                           finished_at, exit_code, signal, stdout, stderr, stdout_truncated,
                           stderr_truncated, slot, slot_end)
         VALUES (gen_random_uuid(), '{target}', 1, gen_random_uuid(), '{outcome}', '{{true}}',
                 'test', 1, now() - interval '{ago}' - interval '1 second',
                 now() - interval '{ago}', {exit}, NULL, '', '', false, false,
                 ({slot})::timestamptz, ({slot})::timestamptz + interval '1 minute')"
    ));
}

/// An expectation row written directly (`every` etc. in ms, SQL NULL allowed).
fn expect_sql(env: &Env, target: &str, schedule: &str, every: &str, max: &str, since: &str) {
    env.sql(&format!(
        "INSERT INTO expectations (target, schedule, every_ms, max_duration_ms, updated_at)
         VALUES ('{target}', {schedule}, {every}, {max}, now() - interval '{since}')"
    ));
}

/// `status --json`'s targets by name: their `health`.
fn health_of(env: &Env) -> std::collections::BTreeMap<String, Value> {
    env.status()["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["target"].as_str().unwrap().to_owned(),
                t["health"].clone(),
            )
        })
        .collect()
}

#[test]
fn expect_stores_and_clears_what_is_expected_and_bad_durations_are_usage_errors() {
    let env = migrated();
    let o = env.run(&[
        "expect",
        "--target",
        "nightly",
        "--every",
        "1h",
        "--grace",
        "5m",
        "--max-duration",
        "30m",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(
        stdout(&o),
        "'nightly': expecting a successful run at least every 1h00m, runs of at most 30m00s, grace 5m00s\n"
    );
    assert_eq!(
        env.sql("SELECT every_ms, grace_ms, max_duration_ms FROM expectations")[0],
        vec![
            Some("3600000".to_owned()),
            Some("300000".to_owned()),
            Some("1800000".to_owned())
        ]
    );
    // A new `expect` replaces the old one whole.
    let o = env.run(&["expect", "--target", "nightly", "--every", "2h"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(
        env.sql("SELECT every_ms, grace_ms, max_duration_ms FROM expectations")[0],
        vec![Some("7200000".to_owned()), None, None]
    );

    for bad in [
        &["--every", "0s"][..],
        &["--every", "soon"],
        &["--every", "5"],
        &["--max-duration", "0ms"],
        &["--grace", "-1s"],
        &[],
        &["--clear", "--every", "1h"],
    ] {
        let mut args = vec!["expect", "--target", "nightly"];
        args.extend_from_slice(bad);
        let o = env.run(&args);
        assert_one_line_error(&o, 2, "leasectl:");
    }
    let o = env.run(&["expect", "--target", "", "--every", "1h"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));

    let o = env.run(&["expect", "--target", "nightly", "--clear"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(
        stdout(&o),
        "'nightly': no longer watched (the expectation forgotten)\n"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM expectations"), "0");
    let o = env.run(&["expect", "--target", "nightly", "--clear"]);
    assert_eq!(
        (code(&o), stdout(&o)),
        (0, "'nightly' is not watched\n".to_owned())
    );

    // A schedule from `run --slot` goes with it.
    expect_sql(&env, "cron", "'0 2 * * *'", "60000", "NULL", "0s");
    let o = env.run(&["expect", "--target", "cron", "--clear"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(
        stdout(&o),
        "'cron': no longer watched (the expectation and its schedule '0 2 * * *' (UTC, from run --slot) forgotten; the next `run --slot` stores it again)\n"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM expectations"), "0");
}

/// A target run once with `--slot` is watched by its schedule. `expect --clear` stops that too,
/// and `status` says what watches a target; a later `run --slot` stores the schedule again,
/// watching from then on: the slots that ended while it was not watched are not missed.
#[test]
fn expect_clear_stops_a_slot_watch_and_a_later_slot_run_watches_again_from_then_on() {
    let env = Env::new();
    let once = env.run(&[
        "run",
        "--target",
        "tried",
        "--slot",
        "* * * * *",
        "--",
        "true",
    ]);
    assert_eq!(code(&once), 0, "{}", stderr(&once));
    // Ten minutes later, as far as the schedule is concerned: every slot since then is missed.
    env.sql("UPDATE expectations SET schedule_since = schedule_since - interval '10 minutes'");
    env.sql("UPDATE runs SET slot = slot - interval '10 minutes'");
    let o = env.run(&["check"]);
    assert_eq!(code(&o), 1, "{}", stdout(&o));
    assert!(
        stdout(&o).starts_with("tried: missed since "),
        "{}",
        stdout(&o)
    );
    let status = env.status();
    let t = &status["targets"][0];
    assert_eq!(
        (
            &t["health"],
            &t["watched_by"],
            &t["schedule"],
            &t["schedule_tz"]
        ),
        (
            &Value::from("missed"),
            &serde_json::json!(["--slot"]),
            &Value::from("* * * * *"),
            &Value::Null
        )
    );
    let table = stdout(&env.run(&["status"]));
    assert!(table.contains(" missed (--slot) "), "{table}");

    let o = env.run(&["expect", "--target", "tried", "--clear"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(
        stdout(&o),
        "'tried': no longer watched (its schedule '* * * * *' (UTC, from run --slot) forgotten; the next `run --slot` stores it again)\n"
    );
    let o = env.run(&["check"]);
    assert_eq!((code(&o), stdout(&o)), (0, String::new()), "{}", stderr(&o));
    let status = env.status();
    let t = &status["targets"][0];
    assert_eq!(
        (&t["health"], &t["watched_by"], &t["schedule"]),
        (&Value::Null, &serde_json::json!([]), &Value::Null)
    );
    let o = env.run(&["check", "--target", "tried"]);
    assert_eq!(code(&o), 1);
    assert!(
        stdout(&o).starts_with("tried: not watched"),
        "{}",
        stdout(&o)
    );

    // The schedule again, from a `run --slot` still going: it watches from then on, so the
    // slots that ended before are not missed although none was done (nor is anything in the
    // run's own slot or a later one yet).
    let again = env.hold_with(
        env.command(),
        "tried",
        &["--slot", "* * * * *"],
        &env.gate(),
    );
    let status = env.status();
    let t = &status["targets"][0];
    assert_eq!(
        (&t["health"], &t["watched_by"]),
        (&Value::from("ok"), &serde_json::json!(["--slot"]))
    );
    env.open_gate();
    assert_eq!(code(&finish(again)), 0);

    // The same when an expectation came first (the schedule joins its row): both watch.
    let o = env.run(&["expect", "--target", "tried", "--clear"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    env.sql("UPDATE runs SET slot = slot - interval '10 minutes'");
    let o = env.run(&["expect", "--target", "tried", "--max-duration", "1h"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    std::fs::remove_file(env.path("gate")).unwrap();
    std::fs::remove_file(env.path("started-tried")).unwrap();
    let again = env.hold_with(
        env.command(),
        "tried",
        &["--slot", "* * * * *"],
        &env.gate(),
    );
    let status = env.status();
    let t = &status["targets"][0];
    assert_eq!(
        (&t["health"], &t["watched_by"]),
        (&Value::from("ok"), &serde_json::json!(["expect", "--slot"]))
    );
    let table = stdout(&env.run(&["status"]));
    assert!(table.contains(" ok (expect, --slot) "), "{table}");
    env.open_gate();
    assert_eq!(code(&finish(again)), 0);
}

#[test]
fn each_health_state_shows_in_status_and_check() {
    let env = migrated();
    // ok: a success a minute ago, expected hourly.
    expect_sql(&env, "fine", "NULL", "3600000", "NULL", "1 day");
    insert_run(&env, "fine", "completed", "0", "1 minute", "NULL");
    // overdue: the last success two hours ago, expected hourly (grace 6 min).
    expect_sql(&env, "late", "NULL", "3600000", "NULL", "1 day");
    insert_run(&env, "late", "completed", "0", "2 hours", "NULL");
    // overdue too: expected every minute for ten minutes, and never ran.
    expect_sql(&env, "never", "NULL", "60000", "NULL", "10 minutes");
    // failing: the newest run exited 3 (a newer `lost` and `skipped` say nothing about the job).
    expect_sql(&env, "broken", "NULL", "NULL", "3600000", "1 day");
    insert_run(&env, "broken", "completed", "3", "3 minutes", "NULL");
    insert_run(&env, "broken", "lost", "NULL", "2 minutes", "NULL");
    insert_run(&env, "broken", "skipped", "NULL", "1 minute", "NULL");
    // ok: a success, then a run that lost its lease (its successor's result is what counts).
    expect_sql(&env, "flaky", "NULL", "NULL", "3600000", "1 day");
    insert_run(&env, "flaky", "completed", "0", "3 minutes", "NULL");
    insert_run(&env, "flaky", "lost", "NULL", "2 minutes", "NULL");
    // missed: a minutely schedule stored ten minutes ago, and no run in any slot.
    expect_sql(&env, "gone", "'* * * * *'", "NULL", "NULL", "10 minutes");
    // too long: held for five minutes, expected to take at most one; it also failed last time.
    expect_sql(&env, "stuck", "NULL", "NULL", "60000", "1 day");
    insert_run(&env, "stuck", "timed_out", "124", "1 hour", "NULL");
    env.sql(
        "INSERT INTO leases (target, token, fence, ttl_ms, heartbeat_at, acquired_at, holder_host, holder_pid)
         VALUES ('stuck', gen_random_uuid(), 2, 120000, now(), now() - interval '5 minutes', 'web-1', 42)",
    );
    // Not watched.
    insert_run(&env, "free", "completed", "1", "1 minute", "NULL");
    env.sql(
        "INSERT INTO leases (target, token, fence, ttl_ms, heartbeat_at, acquired_at)
         SELECT DISTINCT target, NULL::uuid, 1, 120000, now(), now() FROM runs
          WHERE target <> 'stuck'",
    );

    let health = health_of(&env);
    let expected = [
        ("broken", "failing"),
        ("fine", "ok"),
        ("flaky", "ok"),
        ("gone", "missed"),
        ("late", "overdue"),
        ("never", "overdue"),
        ("stuck", "too long"),
    ];
    for (t, h) in expected {
        assert_eq!(health[t], h, "{t}: {health:?}");
    }
    // The table's HEALTH also says what watches the target.
    let watched_by = |t: &str| if t == "gone" { "--slot" } else { "expect" };
    assert_eq!(health["free"], Value::Null);
    assert_eq!(health.len(), 8, "{health:?}");
    // Expected but never ran: listed, free, no lease yet.
    let status = env.status();
    let never = status["targets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["target"] == "never")
        .unwrap()
        .clone();
    assert_eq!(never["state"], "free");
    assert_eq!(never["fence"], 0);
    assert_eq!(never["last_run"], Value::Null);

    let o = env.run(&["status"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let table = stdout(&o);
    let column = table.find("HEALTH").expect("a HEALTH column");
    for (t, h) in expected.iter().chain(&[("free", "-")]) {
        let line = table
            .lines()
            .find(|l| l.starts_with(&format!("{t} ")))
            .unwrap_or_else(|| panic!("no row for {t}: {table}"));
        let cell = line[column..].split("  ").next().unwrap();
        let h = match *t {
            "free" => "-".to_owned(),
            t => format!("{h} ({})", watched_by(t)),
        };
        assert_eq!(cell, h, "{line}");
    }
    // The table says what --json says of a target that never ran: fence 0, nobody waiting.
    let header = table.lines().next().unwrap();
    let never = table.lines().find(|l| l.starts_with("never ")).unwrap();
    let cell = |name: &str| {
        let at = header.find(name).unwrap();
        never[at..].split("  ").next().unwrap().trim().to_owned()
    };
    assert_eq!(
        (cell("FENCE"), cell("WAITERS"), cell("TTL")),
        ("0".into(), "0".into(), "-".into()),
        "{table}"
    );

    let o = env.run(&["check"]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert_eq!(stderr(&o), "");
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 5, "{out}");
    for (t, h) in expected.iter().filter(|(_, h)| *h != "ok") {
        let line = lines
            .iter()
            .find(|l| l.starts_with(&format!("{t}: {h} since 20")))
            .unwrap_or_else(|| panic!("no line for {t}: {out}"));
        assert!(line.contains(" ago): "), "{line}");
    }
    assert!(out.contains("stuck: too long since "), "{out}");
    assert!(out.contains("held by web-1 pid 42 (fence 2)"), "{out}");

    let o = env.run(&["check", "--target", "fine"]);
    assert_eq!((code(&o), stdout(&o)), (0, String::new()), "{}", stderr(&o));
    let o = env.run(&["check", "--target", "fine", "--target", "broken"]);
    assert_eq!(code(&o), 1);
    assert_eq!(stdout(&o).lines().count(), 1);
    let o = env.run(&["check", "--target", "free"]);
    assert_eq!(code(&o), 1);
    assert!(
        stdout(&o).starts_with("free: not watched"),
        "{}",
        stdout(&o)
    );

    let o = env.run(&["status", "--target", "gone", "--json"]);
    let doc: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(doc["targets"].as_array().unwrap().len(), 1, "{doc}");
    assert_eq!(doc["targets"][0]["health"], "missed");

    // A fresh, empty schema: nothing watched, all is well.
    let empty = migrated();
    let o = empty.run(&["check"]);
    assert_eq!((code(&o), stdout(&o)), (0, String::new()), "{}", stderr(&o));
}

#[test]
fn a_slot_counts_as_done_by_a_completed_or_timed_out_run_in_it_or_a_later_one() {
    let env = migrated();
    // Every target: a minutely schedule stored ten minutes ago. The current minute's slot is
    // never due, so a run in it covers the due slot ("or a later one") whatever the second.
    let now_slot = "date_trunc('minute', now())";
    let old_slot = "date_trunc('minute', now()) - interval '5 minutes'";
    let cases = [
        ("current", "completed", "0", now_slot, "ok"),
        // Done, though failed: the slot counts, the failure shows.
        ("timed", "timed_out", "124", now_slot, "failing"),
        ("skip", "skipped", "NULL", now_slot, "ok"),
        // A skip recorded while the slot's run was still running, a run never stored (its
        // holder was killed): nothing did the slot.
        ("skip-running", "skipped", "NULL", now_slot, "missed"),
        ("stale", "completed", "0", old_slot, "missed"),
        ("cut", "interrupted", "143", now_slot, "missed"),
        ("gone", "lost", "NULL", now_slot, "missed"),
    ];
    for (t, outcome, exit, slot, _) in cases {
        expect_sql(&env, t, "'* * * * *'", "NULL", "NULL", "10 minutes");
        insert_run(&env, t, outcome, exit, "1 second", slot);
    }
    env.sql("UPDATE runs SET done_by_running = true WHERE target = 'skip-running'");
    // A schedule stored just now: the slots that ended before it cannot have been missed.
    expect_sql(&env, "new", "'* * * * *'", "NULL", "NULL", "0s");
    let health = health_of(&env);
    for (t, _, _, _, h) in cases {
        assert_eq!(health[t], h, "{t}: {health:?}");
    }
    assert_eq!(health["new"], "ok");
}

/// A relay whose stdout appends to `out`.
fn spawn_relay(env: &Env, out: &Path) -> Watched {
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(out)
        .unwrap();
    let child = env
        .command()
        .args(["-v", "relay", "--sink", "stdout", "--poll", "100ms"])
        .stdout(Stdio::from(file))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    Watched::new(child)
}

fn events_of_type(path: &Path, prefix: &str) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|e| e["type"].as_str().unwrap().starts_with(prefix))
        .collect()
}

#[test]
fn three_relays_announce_a_missed_slot_once_and_its_recovery_once() {
    let env = migrated();
    let out = env.path("events.jsonl");
    let relays: Vec<Watched> = (0..3).map(|_| spawn_relay(&env, &out)).collect();
    for r in &relays {
        r.wait_for_stderr("relaying schema");
    }
    // The relays are evaluating (each once a second) when the slot turns out missed.
    expect_sql(&env, "nightly", "'* * * * *'", "NULL", "NULL", "10 minutes");
    wait_for("the missed event", || {
        !events_of_type(&out, "leasectl.target.missed").is_empty()
    });
    // Every relay evaluates again (at least a second later) while the incident is open.
    let opened = env.scalar("SELECT count(*) FROM incidents");
    assert_eq!(opened, "1");
    wait_for("three more evaluations with the incident open", || {
        env.scalar("SELECT now() - opened_at > interval '2.5 seconds' FROM incidents") == "t"
    });

    // The job runs in the current slot: the incident is over.
    insert_run(
        &env,
        "nightly",
        "completed",
        "0",
        "0s",
        "date_trunc('minute', now())",
    );
    wait_for("the recovered event", || {
        !events_of_type(&out, "leasectl.target.recovered").is_empty()
    });
    wait_for("the incident to be closed and the outbox drained", || {
        env.scalar("SELECT (SELECT count(*) FROM incidents) + (SELECT count(*) FROM outbox)") == "0"
    });
    // Every relay evaluates again with the incident closed.
    let closed_at = env.scalar("SELECT now()");
    wait_for("a few more evaluations", || {
        env.scalar(&format!(
            "SELECT now() - '{closed_at}'::timestamptz > interval '2.5 seconds'"
        )) == "t"
    });
    for r in relays {
        kill(r.child.id(), libc::SIGTERM);
        let o = r.finish();
        assert_eq!(code(&o), 0, "{}", stderr(&o));
    }

    let missed = events_of_type(&out, "leasectl.target.missed");
    let recovered = events_of_type(&out, "leasectl.target.recovered");
    assert_eq!(missed.len(), 1, "{missed:?}");
    assert_eq!(recovered.len(), 1, "{recovered:?}");
    assert_eq!(
        events_of_type(&out, "leasectl.target.").len(),
        2,
        "no other incident"
    );
    let m = &missed[0];
    assert_eq!(m["aggregate_type"], "leasectl.target");
    assert_eq!(m["aggregate_id"], "nightly");
    assert_eq!(m["payload"]["target"], "nightly");
    assert_eq!(m["payload"]["kind"], "missed");
    assert_eq!(m["payload"]["detail"]["schedule"], "* * * * *");
    let slot = m["payload"]["detail"]["slot"].as_str().unwrap();
    assert!(slot.ends_with(":00.000000Z"), "{slot}");
    let r = &recovered[0];
    assert_eq!(r["aggregate_id"], "nightly");
    assert_eq!(r["payload"]["kind"], "missed");
    assert_eq!(r["payload"]["since"], m["payload"]["since"]);
    assert_eq!(r["payload"]["detail"], m["payload"]["detail"]);
    assert!(r["payload"]["recovered_at"].is_string(), "{r}");
}

#[test]
fn relay_once_evaluates_once_and_publishes_what_it_opened_and_closed() {
    let env = migrated();
    expect_sql(&env, "deploy", "NULL", "NULL", "1800000", "1 day");
    insert_run(&env, "deploy", "exec_failed", "127", "1 minute", "NULL");

    let o = env.run(&["relay", "--once", "--sink", "stdout"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let events: Vec<Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(events.len(), 1, "{events:?}");
    let e = &events[0];
    assert_eq!(e["type"], "leasectl.target.failing");
    assert_eq!(e["aggregate_type"], "leasectl.target");
    assert_eq!(e["aggregate_id"], "deploy");
    let p = &e["payload"];
    assert_eq!(p["target"], "deploy");
    assert_eq!(p["kind"], "failing");
    assert_eq!(p["since"], p["detail"]["finished_at"]);
    assert_eq!(p["detail"]["outcome"], "exec_failed");
    assert_eq!(p["detail"]["exit_code"], 127);

    // Still failing: nothing new.
    let o = env.run(&["relay", "--once", "--sink", "stdout"]);
    assert_eq!((code(&o), stdout(&o)), (0, String::new()), "{}", stderr(&o));

    insert_run(&env, "deploy", "completed", "0", "0s", "NULL");
    let o = env.run(&["relay", "--once", "--sink", "stdout"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let e: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(e["type"], "leasectl.target.recovered");
    assert_eq!(e["payload"]["kind"], "failing");
    assert_eq!(e["payload"]["since"], p["since"]);
    assert_eq!(env.scalar("SELECT count(*) FROM incidents"), "0");

    // An expectation cleared while an incident is open ends it too.
    insert_run(&env, "deploy", "completed", "1", "0s", "NULL");
    let o = env.run(&["relay", "--once", "--sink", "stdout"]);
    assert!(
        stdout(&o).contains("leasectl.target.failing"),
        "{}",
        stdout(&o)
    );
    assert_eq!(
        code(&env.run(&["expect", "--target", "deploy", "--clear"])),
        0
    );
    let o = env.run(&["relay", "--once", "--sink", "stdout"]);
    assert!(
        stdout(&o).contains("leasectl.target.recovered"),
        "{}",
        stdout(&o)
    );
}

/// Without --grace, `expect` says the grace that applies — a tenth of --every or of the
/// schedule's slots, at most 1h — as a value, not as the rule.
#[test]
fn expect_prints_the_grace_it_will_apply() {
    let env = Env::new();
    let said = |args: &[&str]| {
        let o = env.run(args);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        stdout(&o)
    };
    let out = said(&["expect", "--target", "hourly", "--every", "1h"]);
    assert_eq!(
        out,
        "'hourly': expecting a successful run at least every 1h00m, grace 6m00s\n"
    );
    let out = said(&["expect", "--target", "daily", "--every", "1d"]);
    assert!(out.ends_with(", grace 1h00m\n"), "{out}");
    // A schedule from `run --slot`: a tenth of its slot.
    let o = env.run(&[
        "run",
        "--target",
        "five",
        "--slot",
        "*/5 * * * *",
        "--",
        "true",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let out = said(&["expect", "--target", "five", "--max-duration", "1m"]);
    assert!(
        out.ends_with("grace 30.0s (a tenth of its shortest slot)\n"),
        "{out}"
    );
    let out = said(&["expect", "--target", "five", "--every", "1h"]);
    assert!(
        out.ends_with("grace 6m00s for --every, 30.0s (a tenth of its shortest slot) for a slot\n"),
        "{out}"
    );
    for out in [
        &out,
        &said(&["expect", "--target", "daily", "--every", "2d"]),
    ] {
        assert!(!out.contains("a tenth of the interval"), "{out}");
    }
}
