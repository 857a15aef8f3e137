//! The command's own events, `LEASECTL_EVENTS` and `leasectl emit`: stored in the
//! fenced save's transaction after the run's event, in file order — all or nothing, and never
//! for a run that lost its lease.

use crate::common::*;

/// `leasectl emit …` as shell code, with the test's binary.
fn emit(aggregate_id: &str, event_type: &str, payload: &str) -> String {
    format!(
        "'{}' emit --aggregate-type invoice --aggregate-id {aggregate_id} --type {event_type} --payload '{payload}'",
        bin().display()
    )
}

/// `aggregate_type/aggregate_id/type payload` of every outbox row, in `seq` order.
fn outbox(env: &Env) -> Vec<String> {
    env.sql("SELECT aggregate_type || '/' || aggregate_id || '/' || type || ' ' || payload::text FROM outbox ORDER BY seq")
        .into_iter()
        .map(|r| r[0].clone().unwrap_or_default())
        .collect()
}

#[test]
fn emitted_events_follow_the_run_event_in_file_order() {
    let env = Env::new();
    let script = format!(
        "{} && {} && printf '%s\\n' '{{\"aggregate_type\":\"export\",\"aggregate_id\":\"d\",\"type\":\"export.ready\",\"payload\":[1,2]}}' >> \"$LEASECTL_EVENTS\"",
        emit("7", "invoice.sent", r#"{"total": 42}"#),
        emit("8", "invoice.sent", "null"),
    );
    let o = env.run(&["run", "--target", "j", "--", "sh", "-c", &script]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let rows = outbox(&env);
    assert_eq!(rows.len(), 4, "{rows:?}");
    assert!(
        rows[0].starts_with("leasectl.target/j/leasectl.run.finished "),
        "{rows:?}"
    );
    assert!(rows[0].contains(r#""job_events": 3"#), "{rows:?}");
    assert_eq!(
        rows[1..],
        [
            r#"invoice/7/invoice.sent {"total": 42}"#,
            "invoice/8/invoice.sent null",
            "export/d/export.ready [1, 2]",
        ]
    );
    // The private file and its directory are gone after the run.
    let o = env.run(&[
        "run",
        "--target",
        "k",
        "--",
        "sh",
        "-c",
        "echo \"$LEASECTL_EVENTS\"",
    ]);
    let path = std::path::PathBuf::from(stdout(&o).trim());
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("events-") && name.ends_with(".jsonl"),
        "{path:?}"
    );
    assert!(!path.exists(), "{path:?} is left");
    assert!(!path.with_extension("lock").exists(), "its lock is left");
}

#[test]
fn a_malformed_line_stores_the_run_without_any_of_its_events_and_exits_65() {
    let env = Env::new();
    let script = format!(
        "{} && echo 'not json' >> \"$LEASECTL_EVENTS\"",
        emit("7", "invoice.sent", "1")
    );
    let o = env.run(&["run", "--target", "m", "--", "sh", "-c", &script]);
    assert_one_line_error(&o, 65, "LEASECTL_EVENTS line 2: not JSON");
    let rows = outbox(&env);
    assert_eq!(rows.len(), 1, "only the run's own event: {rows:?}");
    assert_eq!(
        env.scalar("SELECT outcome || ' ' || (error LIKE 'LEASECTL_EVENTS line 2%') || ' ' || (convert_from(events, 'UTF8') LIKE '%not json%') FROM runs"),
        "completed true true"
    );
}

#[test]
fn more_than_the_events_limit_stores_none_and_exits_65() {
    let env = Env::new();
    let script = format!(
        "for i in 1 2 3 4 5 6; do {}; done",
        emit("7", "invoice.sent", "1")
    );
    let o = env.run(&[
        "run",
        "--target",
        "l",
        "--events-limit",
        "200B",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    assert_one_line_error(&o, 65, "more than --events-limit");
    assert_eq!(outbox(&env).len(), 1);
    // Within the limit, the same lines are stored.
    let o = env.run(&["run", "--target", "l", "--", "sh", "-c", &script]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(outbox(&env).len(), 1 + 1 + 6);
}

#[test]
fn a_run_that_lost_its_lease_stores_none_of_its_events_and_keeps_them_in_its_lost_record() {
    let env = Env::new();
    let emitted = env.path("emitted");
    let script = format!(
        "{} && touch '{}' && exec sleep 300",
        emit("7", "invoice.sent", "1"),
        emitted.display()
    );
    let mut holder = env.hold_with(env.command(), "f", &[], &script);
    wait_for_file_exists(&emitted);
    let o = env.run(&["release", "--target", "f", "--force"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let status = exits_within(&mut holder, PATIENCE, "the forced-out holder");
    assert_eq!(status.code(), Some(76));
    assert_eq!(outbox(&env).len(), 0, "a lost run stores no event at all");
    assert_eq!(
        env.scalar("SELECT outcome || ' ' || (convert_from(events, 'UTF8') LIKE '%invoice.sent%') FROM runs"),
        "lost true"
    );
}

#[test]
fn emit_outside_a_run_or_with_a_bad_payload_is_a_usage_error() {
    let env = Env::new();
    let o = std::process::Command::new(bin())
        .env_remove("LEASECTL_EVENTS")
        .args([
            "emit",
            "--aggregate-type",
            "a",
            "--aggregate-id",
            "b",
            "--type",
            "c",
            "--payload",
            "1",
        ])
        .output_in_time();
    assert_one_line_error(&o, 2, "only in a command run by `leasectl run`");
    let script = format!("{}; echo \"exit $?\"", emit("7", "invoice.sent", "{oops"));
    let o = env.run(&["run", "--target", "u", "--", "sh", "-c", &script]);
    assert_eq!(code(&o), 0);
    assert!(stdout(&o).contains("exit 2"), "{}", stdout(&o));
    assert!(
        stderr(&o).contains("the payload is not JSON"),
        "{}",
        stderr(&o)
    );
    assert_eq!(outbox(&env).len(), 1, "nothing was appended");
}

#[test]
fn events_of_a_command_that_finished_after_a_takeover_are_fenced_out_by_the_save() {
    // As lease::a_result_finished_after_a_takeover_is_fenced_out_by_the_save, with events: the
    // command completes while its holder is paused past the TTL and another run holds the
    // lease; on resume the fenced save must store neither the result nor the events.
    let env = Env::new();
    let (pidfile, gate) = (env.path("pid"), env.path("gate"));
    let script = format!(
        "echo $$ > '{}'; while [ ! -e '{}' ]; do sleep 0.02; done; {}",
        pidfile.display(),
        gate.display(),
        emit("7", "invoice.sent", "1")
    );
    let holder = env.spawn(&[
        "run", "--target", "z", "--ttl", "1s", "--", "sh", "-c", &script,
    ]);
    let child: i32 = wait_for_file(&pidfile).parse().unwrap();
    kill(holder.id(), libc::SIGSTOP);
    let taker = env.run(&[
        "run",
        "--target",
        "z",
        "--wait=30s",
        "--no-event",
        "--",
        "true",
    ]);
    assert_eq!(code(&taker), 0, "{}", stderr(&taker));
    std::fs::write(&gate, "").unwrap();
    wait_for("the command to finish while its holder is paused", || {
        !alive(child)
    });
    kill(holder.id(), libc::SIGCONT);
    let out = finish(holder);
    assert_eq!(code(&out), 76, "{}", stderr(&out));
    assert_eq!(
        outbox(&env),
        Vec::<String>::new(),
        "no event of the fenced-out run"
    );
    assert_eq!(
        env.scalar("SELECT outcome || ' ' || (convert_from(events, 'UTF8') LIKE '%invoice.sent%') FROM runs WHERE fence = 1"),
        "lost true"
    );
}

/// A SIGKILLed leasectl cannot remove its `LEASECTL_EVENTS` file and lock (in the user's
/// `$TMPDIR/leasectl-<uid>`); a later run's sweep on the machine does, once they are old enough,
/// and leaves a live run's alone. (One run in 32 sweeps; `LEASECTL_TEST_SWEEP_ONE_IN=1` makes
/// this one.)
#[test]
fn a_sigkilled_runs_events_file_is_swept_by_a_later_run() {
    let env = Env::new();
    let tmp = env.path("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let user_dir = tmp.join(format!("leasectl-{}", nix::unistd::geteuid()));
    let files = || -> Vec<String> {
        let mut d: Vec<_> = std::fs::read_dir(&user_dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        d.sort();
        d
    };
    // Two holders, both with their events file; one is SIGKILLed (its command too).
    let mut dead = env.command();
    dead.env("TMPDIR", &tmp);
    let dead = env.hold_with(dead, "a", &[], "echo $$ > pid-a; sleep 600");
    let mut live = env.command();
    live.env("TMPDIR", &tmp);
    let live = env.hold_with(live, "b", &[], "sleep 600");
    assert_eq!(files().len(), 4, "{:?}", files());
    assert_eq!(
        std::fs::read_dir(&tmp).unwrap().count(),
        1,
        "one directory for the user"
    );
    kill(dead.id(), libc::SIGKILL);
    finish(dead);
    kill(
        wait_for_file(&env.path("pid-a")).trim().parse().unwrap(),
        libc::SIGKILL,
    );
    // All are older than the sweep's minimum age.
    for f in files() {
        std::fs::File::open(user_dir.join(f))
            .unwrap()
            .set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(3600))
            .unwrap();
    }
    let before = files();
    let o = env
        .command()
        .env("TMPDIR", &tmp)
        .env("LEASECTL_TEST_SWEEP_ONE_IN", "1")
        .args(["run", "--target", "c", "--", "true"])
        .output_in_time();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let after = files();
    let pid = live.id();
    assert_eq!(after.len(), 2, "{before:?} → {after:?}");
    assert!(
        after
            .iter()
            .all(|f| f.starts_with(&format!("events-{pid}-"))),
        "the live holder's files are kept: {after:?}"
    );
    env.stop(live);
    assert!(files().is_empty(), "{:?}", files());
}

/// A command that replaces its events file by a FIFO must not hang leasectl in `open()` (a FIFO
/// without a writer blocks a plain open forever): anything but a regular file is a malformed
/// events file, found at once — the run is stored with the error, none of the command's events,
/// exit 65, and the lease is released.
#[test]
fn a_fifo_in_place_of_the_events_file_is_refused_at_once_with_65() {
    let env = Env::new();
    let script = format!(
        "{} && rm -f \"$LEASECTL_EVENTS\" && mkfifo \"$LEASECTL_EVENTS\"",
        emit("7", "invoice.sent", "1")
    );
    let o = env
        .command()
        .args(["run", "--target", "q", "--", "sh", "-c", &script])
        .output_within(std::time::Duration::from_secs(20));
    assert_one_line_error(
        &o,
        65,
        "LEASECTL_EVENTS is not a regular file (the command left a FIFO there)",
    );
    assert_eq!(outbox(&env).len(), 1, "only the run's own event");
    assert_eq!(
        env.scalar("SELECT outcome || ' ' || exit_code || ' ' || (error LIKE '%a FIFO%') || ' ' || coalesce(length(events), 0) FROM runs"),
        "completed 0 true 0"
    );
    assert_eq!(env.held_leases(), "0");
}
