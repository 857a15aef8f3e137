//! `leasectl relay` end to end with the stdout sink, and the outbox operator commands.
//!
//! The receiver is a file the relays append to (O_APPEND, one `write` per batch), so its line
//! order is the order in which events were published, even with several relays writing to it.

use std::collections::HashSet;
use std::fs::OpenOptions;
use std::path::Path;
use std::process::{Child, Stdio};

use serde_json::Value;

use crate::common::*;
use crate::events::*;

/// A relay whose stdout appends to `out`.
fn spawn_relay(env: &Env, out: &Path, args: &[&str]) -> Watched {
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(out)
        .unwrap();
    let child = env
        .command()
        .arg("-v")
        .arg("relay")
        .args(args)
        .stdout(Stdio::from(file))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    Watched::new(child)
}

fn read_events(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad line {l:?}: {e}")))
        .collect()
}

fn line_count(path: &Path) -> usize {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .count()
}

fn ids(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["id"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn once_drains_20k_events_to_stdout_each_exactly_once_in_aggregate_order() {
    let env = migrated();
    insert_events(&env, 20_000, 37, 1);
    let expected = outbox_ids(&env);
    let o = env.run(&["relay", "--once", "--sink", "stdout"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(
        stderr(&o),
        "",
        "no progress line or chatter when stderr is not a terminal"
    );
    let events: Vec<Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(events.len(), 20_000);
    let got: HashSet<String> = ids(&events).into_iter().collect();
    assert_eq!(got.len(), 20_000, "an event was published twice");
    assert_eq!(got, expected);
    assert_per_aggregate_order(&events);
    assert_eq!(outbox_count(&env), 0, "delivered events must be deleted");
}

#[test]
fn the_published_form_is_spec_json_for_application_and_run_events() {
    let env = migrated();
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         VALUES ('order', '42', 'order.paid', '{\"total\": 1500, \"note\": \"a\\nb\"}')",
    );
    assert_eq!(code(&env.run(&["run", "--target", "t1", "--", "true"])), 0);
    let rows = by_id(&snapshot(&env));
    let o = env.run(&["relay", "--once", "--sink", "stdout"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let text = stdout(&o);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    // Keys in the published order, values those of the rows, one line each.
    let app = assert_published_form(lines[0].as_bytes(), &rows);
    assert_eq!(app["aggregate_id"], "42");
    assert_eq!(
        app["payload"],
        serde_json::json!({"total": 1500, "note": "a\nb"})
    );

    let run = assert_published_form(lines[1].as_bytes(), &rows);
    assert_eq!(run["aggregate_type"], "leasectl.target");
    assert_eq!(run["aggregate_id"], "t1");
    assert_eq!(run["type"], "leasectl.run.finished");
    for key in [
        "run_id",
        "target",
        "fence",
        "exit_code",
        "started_at",
        "finished_at",
        "host",
    ] {
        assert!(
            run["payload"].get(key).is_some(),
            "payload lacks {key}: {run}"
        );
    }
}

#[test]
fn a_running_relay_is_woken_by_notify_long_before_its_poll() {
    let env = migrated();
    let out = env.path("out.jsonl");
    // An hour's poll: only the NOTIFY can explain a prompt delivery.
    let relay = spawn_relay(&env, &out, &["--sink", "stdout", "--poll", "1h"]);
    relay.wait_for_stderr("relaying schema");
    for round in 0..3 {
        insert_events(&env, 1, 1, round + 1);
        wait_for("the event to be published", || {
            line_count(&out) == round + 1
        });
    }
    kill(relay.child.id(), libc::SIGTERM);
    let o = relay.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_per_aggregate_order(&read_events(&out));
}

#[test]
fn an_event_whose_notify_was_missed_is_found_by_polling() {
    let env = migrated();
    let out = env.path("out.jsonl");
    let relay = spawn_relay(&env, &out, &["--sink", "stdout", "--poll", "200ms"]);
    relay.wait_for_stderr("relaying schema");
    // The trigger skips its NOTIFY when this setting is on in the inserting transaction.
    env.sql(
        "BEGIN;
         SET LOCAL leasectl.outbox_notified = 'on';
         INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         VALUES ('order', '1', 'order.paid', '{\"n\": 1}');
         COMMIT;",
    );
    wait_for("the polled event", || line_count(&out) == 1);
    kill(relay.child.id(), libc::SIGINT);
    assert_eq!(
        code(&relay.finish()),
        0,
        "SIGINT, like SIGTERM, is a clean stop"
    );
}

#[test]
fn three_relays_at_once_deliver_everything_once_in_aggregate_order() {
    let env = migrated();
    let out = env.path("out.jsonl");
    // Few aggregates and small batches, so the relays fight over the same aggregates.
    insert_events(&env, 3_000, 5, 1);
    let relays: Vec<Watched> = (0..3)
        .map(|_| {
            spawn_relay(
                &env,
                &out,
                &["--sink", "stdout", "--batch", "7", "--poll", "100ms"],
            )
        })
        .collect();
    // More events while they run, from other connections, one transaction at a time.
    let mut next = 3_001;
    for _ in 0..20 {
        insert_events(&env, 100, 5, next);
        next += 100;
    }
    let total = next - 1;
    wait_for("every event to be published", || line_count(&out) >= total);
    for r in &relays {
        kill(r.child.id(), libc::SIGTERM);
    }
    for r in relays {
        let o = r.finish();
        assert_eq!(code(&o), 0, "{}", stderr(&o));
    }
    let events = read_events(&out);
    let unique: HashSet<String> = ids(&events).into_iter().collect();
    assert_eq!(events.len(), total, "duplicates in steady state");
    assert_eq!(unique.len(), total);
    assert_per_aggregate_order(&events);
    assert_eq!(outbox_count(&env), 0);
}

/// Starts a relay draining 20k events to a file in batches of `batch`, sends it `signal` once
/// more than `after` lines arrived, and waits for it. Returns the events' ids as inserted, the
/// file and the relay's output.
fn signal_a_draining_relay(
    env: &Env,
    batch: &str,
    after: usize,
    signal: i32,
) -> (HashSet<String>, std::path::PathBuf, std::process::Output) {
    insert_events(env, 20_000, 10, 1);
    let all = outbox_ids(env);
    let out = env.path("out.jsonl");
    let relay = spawn_relay(env, &out, &["--sink", "stdout", "--batch", batch]);
    wait_for("some events to be published", || line_count(&out) > after);
    kill(relay.child.id(), signal);
    (all, out, relay.finish())
}

#[test]
fn sigterm_finishes_the_batch_in_hand_and_exits_0_losing_nothing() {
    let env = migrated();
    let (all, out, o) = signal_a_draining_relay(&env, "20", 100, libc::SIGTERM);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let published = ids(&read_events(&out));
    let left = outbox_ids(&env);
    assert!(!left.is_empty(), "the relay should have stopped early");
    // Nothing lost and nothing published twice: what is left is exactly what was not published.
    assert_eq!(published.len() + left.len(), all.len());
    let mut union: HashSet<String> = published.into_iter().collect();
    union.extend(left);
    assert_eq!(union, all);
}

#[test]
fn a_relay_killed_mid_batch_loses_nothing_and_a_restart_delivers_the_rest() {
    let env = migrated();
    let (all, out, _) = signal_a_draining_relay(&env, "50", 500, libc::SIGKILL);
    // A relay killed while writing may leave its last line incomplete. That event was not
    // confirmed (the batch did not commit), so it is published again; a consumer drops the
    // fragment, as this one does.
    let written = std::fs::read(&out).unwrap();
    let complete = written
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |i| i + 1);
    std::fs::write(&out, &written[..complete]).unwrap();
    let before = line_count(&out);
    let o = finish(
        env.command()
            .args(["relay", "--once", "--sink", "stdout"])
            .stdout(Stdio::from(
                OpenOptions::new().append(true).open(&out).unwrap(),
            ))
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let events = read_events(&out);
    let got: HashSet<String> = ids(&events).into_iter().collect();
    assert_eq!(got, all, "an event was lost");
    let duplicates = events.len() - got.len();
    // At most the one batch in flight can be published twice.
    assert!(
        duplicates <= 50,
        "{duplicates} duplicates (killed after {before} lines)"
    );
    assert_eq!(outbox_count(&env), 0);
    // Each aggregate's order holds in the second run, and across the two: a redelivered event
    // appears again, but never one after its successor's first appearance… unless it was the
    // batch in flight, which is replayed whole, in order.
    let mut seen = HashSet::new();
    let firsts: Vec<Value> = events
        .into_iter()
        .filter(|e| seen.insert(e["id"].as_str().unwrap().to_owned()))
        .collect();
    assert_per_aggregate_order(&firsts);
}

#[test]
fn a_dead_event_blocks_only_its_own_aggregate_until_retried() {
    let env = migrated();
    insert_events(&env, 30, 3, 1); // aggregates '0', '1', '2'
                                   // Kill aggregate '1''s oldest event as the relay would after --max-attempts.
    env.sql(
        "UPDATE outbox SET attempts = 10, dead_at = now(), last_error = 'HTTP 500: boom'
          WHERE seq = (SELECT min(seq) FROM outbox WHERE aggregate_id = '1')",
    );
    let o = env.run(&["relay", "--once", "--sink", "stdout"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let events: Vec<Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(events.len(), 20, "every other aggregate is delivered");
    assert!(events.iter().all(|e| e["aggregate_id"] != "1"));
    assert_eq!(
        outbox_count(&env),
        10,
        "aggregate 1 waits behind its dead event"
    );

    let listed = env.run(&["outbox", "list", "--json"]);
    let doc: Value = serde_json::from_slice(&listed.stdout).unwrap();
    assert_eq!(doc["total"], 10);
    let states: Vec<&str> = doc["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["state"].as_str().unwrap())
        .collect();
    assert_eq!(states[0], "dead");
    assert!(states[1..].iter().all(|s| *s == "blocked"), "{states:?}");
    assert_eq!(doc["events"][0]["last_error"], "HTTP 500: boom");
    assert_eq!(doc["events"][0]["attempts"], 10);
    let dead_id = doc["events"][0]["id"].as_str().unwrap().to_owned();
    assert_eq!(env.status()["outbox"]["dead"], 1);

    let o = env.run(&["outbox", "retry", &dead_id]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = env.run(&["relay", "--once", "--sink", "stdout"]);
    let events: Vec<Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(events.len(), 10);
    assert_eq!(
        events[0]["id"],
        dead_id.as_str(),
        "the re-queued event goes first"
    );
    assert_per_aggregate_order(&events);
    assert_eq!(outbox_count(&env), 0);
}

#[test]
fn an_event_waiting_out_a_retry_is_left_by_once_and_blocks_its_aggregate() {
    let env = migrated();
    insert_events(&env, 4, 2, 1);
    env.sql(
        "UPDATE outbox SET attempts = 1, next_attempt_at = now() + interval '1 hour',
                last_error = 'nack'
          WHERE seq = (SELECT min(seq) FROM outbox WHERE aggregate_id = '0')",
    );
    let o = env.run(&["relay", "--once", "--sink", "stdout"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let text = stdout(&o);
    let events: Vec<&str> = text.lines().collect();
    assert_eq!(events.len(), 2, "only aggregate 1: {events:?}");
    let status = env.status();
    assert_eq!(status["outbox"]["pending"], 2);
    assert_eq!(status["outbox"]["dead"], 0);
    let listed = env.run(&["outbox", "list"]);
    let table = stdout(&listed);
    assert!(
        table.contains("retrying") && table.contains("in 59m5"),
        "{table}"
    );
}

#[test]
fn outbox_retry_all_dead_and_discard() {
    let env = migrated();
    insert_events(&env, 3, 3, 1);
    env.sql("UPDATE outbox SET attempts = 10, dead_at = now(), last_error = 'x' WHERE aggregate_id <> '2'");
    let o = env.run(&["outbox", "list", "--dead", "--json"]);
    let doc: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(doc["total"], 2);
    let ids: Vec<String> = doc["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["id"].as_str().unwrap().to_owned())
        .collect();
    let live = env.scalar("SELECT id FROM outbox WHERE aggregate_id = '2'");

    // Discarding a live event needs --force; a dead one is printed so it is not lost.
    let o = env.run(&["outbox", "discard", &live]);
    assert_one_line_error(&o, 1, "is not dead");
    let o = env.run(&["outbox", "discard", &ids[0]]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let printed: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(printed["id"], ids[0].as_str());
    assert_eq!(printed["payload"]["n"], 1);
    let o = env.run(&["outbox", "discard", &ids[0]]);
    assert_one_line_error(&o, 1, "no event");

    let o = env.run(&["outbox", "retry", "--all-dead"]);
    assert_eq!(code(&o), 0);
    assert!(
        stderr(&o).contains("re-queued 1 dead event"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL OR attempts > 0"),
        "0"
    );
    let o = env.run(&["outbox", "retry", "00000000-0000-0000-0000-000000000000"]);
    assert_one_line_error(&o, 1, "no event");
    let o = env.run(&["outbox", "discard", "--force", &live]);
    assert_eq!(code(&o), 0);
    assert_eq!(outbox_count(&env), 1);
}

#[test]
fn prune_deletes_old_runs_but_keeps_each_targets_newest() {
    let env = migrated();
    for target in ["a", "a", "a", "b"] {
        assert_eq!(
            code(&env.run(&["run", "--no-event", "--target", target, "--", "true"])),
            0
        );
    }
    env.sql("UPDATE runs SET finished_at = finished_at - interval '2 days', started_at = started_at - interval '2 days'");
    assert_eq!(
        code(&env.run(&["run", "--no-event", "--target", "c", "--", "true"])),
        0
    );
    let o = env.run(&["prune", "--older-than", "1d", "--dry-run"]);
    assert_eq!(code(&o), 0);
    assert!(stderr(&o).contains("would delete 2 runs"), "{}", stderr(&o));
    assert_eq!(env.scalar("SELECT count(*) FROM runs"), "5");
    let o = env.run(&["prune", "--older-than", "1d"]);
    assert_eq!(code(&o), 0);
    assert!(stderr(&o).contains("deleted 2 runs"), "{}", stderr(&o));
    assert_eq!(
        env.scalar("SELECT string_agg(target, ',' ORDER BY target) FROM runs"),
        "a,b,c"
    );
    // The newest run of 'a' is the one kept.
    assert_eq!(
        env.scalar("SELECT count(*) FROM runs WHERE target = 'a' AND fence = 3"),
        "1"
    );
}

#[test]
fn bad_relay_and_outbox_arguments_are_usage_errors() {
    let env = migrated();
    for (args, needle) in [
        (
            vec!["relay", "--sink", "kafka://u:secret@h"],
            "unknown sink",
        ),
        (vec!["relay"], "--sink"),
        (vec!["relay", "--sink", "stdout", "--batch", "0"], "--batch"),
        (
            vec!["relay", "--sink", "stdout", "--poll", "1ms"],
            "too short",
        ),
        (
            vec!["relay", "--sink", "stdout", "--max-attempts", "0"],
            "--max-attempts",
        ),
        (vec!["relay", "--sink", "exec:"], "needs a command"),
        (vec!["outbox", "retry"], "ID"),
        (vec!["outbox", "retry", "not-a-uuid"], "ID"),
        (vec!["outbox", "discard"], "ID"),
        (vec!["prune"], "--older-than"),
        (vec!["prune", "--older-than", "soon"], "soon"),
    ] {
        let o = env.run(&args);
        assert_one_line_error(&o, 2, needle);
        assert!(!stderr(&o).contains("secret"), "{}", stderr(&o));
    }
}

#[test]
fn a_relay_without_its_database_exits_69_with_one_line() {
    let env = migrated();
    let o = env
        .command_at("host=127.0.0.1 port=1 user=nobody dbname=x connect_timeout=2")
        .args(["relay", "--sink", "stdout"])
        .output_in_time();
    assert_one_line_error(&o, 69, "cannot connect");
}

#[test]
fn a_relay_whose_stdout_is_closed_exits_69_and_keeps_the_events() {
    let env = migrated();
    insert_events(&env, 10, 2, 1);
    let mut child: Child = env
        .command()
        .args(["relay", "--once", "--sink", "stdout"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader went away: EPIPE
    let o = finish(child);
    assert_one_line_error(&o, 69, "stdout");
    assert_eq!(outbox_count(&env), 10, "nothing may be marked delivered");
}

/// A leasectl running on a pseudo-terminal (script(1)), its stdout to a file, with what the
/// terminal shows collected as it arrives.
struct OnTerminal {
    child: Child,
    pid: u32,
    screen: std::sync::Arc<std::sync::Mutex<String>>,
    reader: std::thread::JoinHandle<()>,
}

impl OnTerminal {
    fn start(env: &Env, args: &[&str], out: &Path) -> OnTerminal {
        let pid_file = env.path("pid");
        let quote = |s: &str| format!("'{}'", s.replace('\'', "'\\''"));
        let line = format!(
            "echo $$ > {}; exec {} --database-url {} --schema {} {} > {}",
            quote(pid_file.to_str().unwrap()),
            quote(bin().to_str().unwrap()),
            quote(&env.url),
            quote(&env.schema),
            args.iter().map(|a| quote(a)).collect::<Vec<_>>().join(" "),
            quote(out.to_str().unwrap()),
        );
        let mut child = std::process::Command::new("script")
            .args(["-qfc", &line, "/dev/null"])
            .env_remove("DATABASE_URL")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("script(1) from util-linux is needed for terminal tests");
        let screen = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let mut pty = child.stdout.take().unwrap();
        let reader = {
            let screen = screen.clone();
            std::thread::spawn(move || {
                use std::io::Read;
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = pty.read(&mut buf) {
                    screen
                        .lock()
                        .unwrap()
                        .push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            })
        };
        let pid = wait_for_file(&pid_file).parse().unwrap();
        OnTerminal {
            child,
            pid,
            screen,
            reader,
        }
    }

    fn screen(&self) -> String {
        self.screen.lock().unwrap().clone()
    }

    /// Waits for the exit; returns the exit code and everything the terminal showed.
    fn finish(self) -> (i32, String) {
        let code = code(&finish(self.child));
        self.reader.join().unwrap();
        let screen = self.screen.lock().unwrap().clone();
        (code, screen)
    }
}

#[test]
fn on_a_terminal_the_relay_shows_a_progress_line_with_rate_and_backlog() {
    let env = migrated();
    insert_events(&env, 500, 5, 1);
    let out = env.path("out.jsonl");
    let term = OnTerminal::start(&env, &["relay", "--sink", "stdout"], &out);
    wait_for("the events", || line_count(&out) == 500);
    // The line is refreshed with the backlog once the relay is idle.
    wait_for("the progress line with the backlog", || {
        term.screen().contains("backlog 0 pending")
    });
    kill(term.pid, libc::SIGTERM);
    let (code, screen) = term.finish();
    assert_eq!(code, 0);
    assert!(screen.contains("500 delivered"), "{screen:?}");
    assert!(screen.contains("events/s"), "{screen:?}");
    assert!(
        screen.contains("backlog 0 pending (0 retrying), 0 dead"),
        "{screen:?}"
    );
}

#[test]
fn on_a_terminal_the_progress_line_shows_the_backlog_going_down_while_draining() {
    // `--once` is never idle, and neither is a relay working through a large backlog: the
    // line used to show the backlog only when idle, so exactly when it mattered it showed none.
    let env = migrated();
    insert_events(&env, 10, 10, 1);
    let out = env.path("out.jsonl");
    // One event per batch, each delivery a little slow: the drain takes seconds.
    let sink = format!(
        "exec:sleep 0.3; cat >> '{}'",
        env.path("delivered").display()
    );
    let args = ["relay", "--once", "--batch", "1", "--sink", &sink];
    let term = OnTerminal::start(&env, &args, &out);
    wait_for("the backlog as the relay starts", || {
        term.screen()
            .contains("backlog 10 pending (0 retrying), 0 dead")
    });
    let part_way = |screen: &str| (1..10).any(|n| screen.contains(&format!("backlog {n} pending")));
    wait_for("the backlog part way through the drain", || {
        part_way(&term.screen())
    });
    let (code, _) = term.finish();
    assert_eq!(code, 0);
    assert_eq!(read_events(&env.path("delivered")).len(), 10);
}

#[test]
fn an_event_inserted_for_later_waits_without_busy_looping_and_holds_its_aggregate() {
    let env = migrated();
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, next_attempt_at)
         VALUES ('order', '1', 'order.later', '{\"n\": 1}', now() + interval '1 hour'),
                ('order', '1', 'order.paid', '{\"n\": 2}', DEFAULT),
                ('order', '2', 'order.paid', '{\"n\": 3}', DEFAULT)",
    );
    let o = env.run(&["relay", "--once", "--sink", "stdout"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let text = stdout(&o);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1, "only aggregate 2 is due: {lines:?}");
    assert!(lines[0].contains("\"n\": 3"), "{lines:?}");
    let doc: Value =
        serde_json::from_slice(&env.run(&["outbox", "list", "--json"]).stdout).unwrap();
    let states: Vec<&str> = doc["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, ["scheduled", "blocked"]);
}

/// A relay with an exec sink that marks when a delivery starts and then waits for the gate.
fn relay_with_a_slow_command(env: &Env) -> Watched {
    let started = env.path("started");
    let command = format!(
        "exec:touch '{}'; {}; cat >> '{}'",
        started.display(),
        env.gate(),
        env.path("delivered").display()
    );
    let relay = Watched::new(
        env.command()
            .args(["-v", "relay", "--sink", &command, "--timeout", "1m"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    insert_events(env, 1, 1, 1);
    wait_for_file_exists(&started);
    relay
}

#[test]
fn sigterm_mid_batch_waits_for_the_delivery_in_hand_then_exits_0() {
    let env = migrated();
    let relay = relay_with_a_slow_command(&env);
    kill(relay.child.id(), libc::SIGTERM);
    relay.wait_for_stderr("finishing the batch in hand");
    assert!(
        alive(relay.child.id() as i32),
        "the relay must wait for its delivery"
    );
    env.open_gate();
    let o = relay.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(read_events(&env.path("delivered")).len(), 1);
    assert_eq!(outbox_count(&env), 0, "the finished batch was committed");
}

#[test]
fn a_second_signal_exits_at_once_and_the_batch_stays_in_the_outbox() {
    let env = migrated();
    let relay = relay_with_a_slow_command(&env);
    kill(relay.child.id(), libc::SIGTERM);
    relay.wait_for_stderr("finishing the batch in hand");
    kill(relay.child.id(), libc::SIGTERM);
    let o = relay.finish();
    assert_eq!(code(&o), 143, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("will be published again"),
        "{}",
        stderr(&o)
    );
    env.open_gate();
    assert_eq!(outbox_count(&env), 1, "the unfinished batch rolled back");
}

#[test]
fn a_burst_after_the_relay_vacuumed_an_empty_outbox_drains_at_full_speed() {
    // Regression: a VACUUM of an empty outbox leaves statistics saying "no rows"; the claim,
    // planned with them, used to scan the table once per head, and a 10k burst took 30s. Here
    // 30k events must drain within the test's patience (seconds, not minutes).
    let env = migrated();
    let out = env.path("out.jsonl");
    let relay = spawn_relay(&env, &out, &["--sink", "stdout", "--batch", "1000"]);
    relay.wait_for_stderr("relaying schema");
    insert_events(&env, 20_000, 1000, 1);
    wait_for("the first 20k events", || line_count(&out) == 20_000);
    relay.wait_for_stderr("vacuumed the outbox");
    // What misled the planner: the vacuum of the empty table recorded zero rows.
    assert_eq!(
        env.scalar("SELECT reltuples FROM pg_class WHERE oid = 'outbox'::regclass"),
        "0"
    );
    insert_events(&env, 30_000, 1000, 20_001);
    wait_for("the burst", || line_count(&out) == 50_000);
    kill(relay.child.id(), libc::SIGTERM);
    assert_eq!(code(&relay.finish()), 0);
    assert_per_aggregate_order(&read_events(&out));
}

/// The relay's VACUUM of the outbox runs on a connection of its own, and the relay goes on
/// claiming meanwhile: its output grows while one VACUUM (one backend, one start) is under way. The table is bloated first, so that the VACUUM takes long enough to be seen — and its
/// indexes large enough that PostgreSQL would vacuum them with parallel workers, which the
/// relay's VACUUM must not start (their start-up costs more than they share out, on CPU the
/// claims need).
#[test]
fn the_relay_goes_on_claiming_while_it_vacuums_the_outbox() {
    let env = migrated();
    env.sql(
        "ALTER TABLE outbox SET (autovacuum_enabled = off);
         INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'old', (g % 100)::text, 'e', jsonb_build_object('n', g) FROM generate_series(1, 300000) g;
         DELETE FROM outbox",
    );
    insert_events(&env, 60_000, 100, 1);
    let out = env.path("out.jsonl");
    let relay = spawn_relay(&env, &out, &["--sink", "stdout", "--batch", "1000"]);
    // The relay's progress is its output's size, read between two looks at the VACUUM: a count
    // of the bloated outbox took longer than a whole VACUUM on a fast machine, so no VACUUM was
    // seen twice.
    let watch = format!(
        "SELECT (SELECT pid || ' ' || query_start FROM pg_stat_activity
                  WHERE state = 'active' AND backend_type = 'client backend' AND pid <> pg_backend_pid()
                    AND query LIKE 'VACUUM%' AND query LIKE '%\"{}\".outbox%'),
                (SELECT count(*) FROM pg_stat_activity
                  WHERE backend_type = 'parallel worker'
                    AND query LIKE 'VACUUM%' AND query LIKE '%\"{}\".outbox%')",
        env.schema, env.schema
    );
    let url = env.direct_url.clone();
    let written = {
        let out = out.clone();
        move || std::fs::metadata(&out).map_or(0, |m| m.len())
    };
    let drained = {
        let out = out.clone();
        move || line_count(&out) == 60_000
    };
    let seen = runtime().block_on(async move {
        let client = leasectl::db::Settings::new(Some(&url))
            .unwrap()
            .open_client()
            .await
            .unwrap();
        // (the VACUUM's backend and start, the bytes the relay had written) at each look that
        // saw one.
        let mut during: Vec<(String, u64)> = Vec::new();
        // Whether the relay wrote events during one VACUUM; whether a parallel worker of the
        // VACUUM was ever seen (watched until every event is out: the workers come in its
        // index phase).
        let (mut seen, mut workers) = (false, false);
        let start = std::time::Instant::now();
        for look in 0u64.. {
            let row = client.query_one(&watch, &[]).await.unwrap();
            let vacuum: Option<String> = row.get(0);
            workers |= row.get::<_, i64>(1) > 0;
            let bytes = written();
            if let Some(v) = vacuum {
                seen |= during.iter().any(|(w, n)| *w == v && *n != bytes);
                during.push((v, bytes));
            }
            if (look % 32 == 0 && drained()) || start.elapsed() > PATIENCE {
                break;
            }
        }
        (seen, workers, during, start.elapsed())
    });
    let (seen, workers, mut during, watched) = seen;
    let looks = during.len();
    during.dedup();
    wait_for("the 60k events", || line_count(&out) == 60_000);
    kill(relay.child.id(), libc::SIGTERM);
    let o = relay.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        seen,
        "the relay wrote no event while a VACUUM of the outbox was under way; watched \
         {watched:?}, {looks} looks saw a VACUUM (its backend and start, the bytes written; \
         repeats left out): {during:?}; \
         relay's stderr: {}",
        stderr(&o)
    );
    assert!(!workers, "the relay's VACUUM started parallel workers");
    assert!(
        stderr(&o).contains("vacuumed the outbox in"),
        "{}",
        stderr(&o)
    );
    assert_per_aggregate_order(&read_events(&out));
}

/// A `--once` pass waits for its VACUUM at most one statement deadline, the bound of every
/// wait on the database: one the server takes long over (throttled here by the session's
/// `vacuum_cost_delay`) is left to finish there, and the pass ends on time.
#[test]
fn a_once_pass_does_not_wait_past_the_statement_deadline_for_its_vacuum() {
    let env = migrated();
    insert_events(&env, 3000, 50, 1);
    let url = with_options(&env.url, "-c vacuum_cost_delay=100 -c vacuum_cost_limit=1");
    let started = std::time::Instant::now();
    let o = env
        .command_at(&url)
        .env("LEASECTL_TEST_VACUUM_EVERY", "1000")
        .env("LEASECTL_STATEMENT_TIMEOUT", "1s")
        .args([
            "-v", "relay", "--once", "--batch", "500", "--sink", "stdout",
        ])
        .output_in_time();
    let took = started.elapsed();
    // The throttled VACUUM, still running on the server, is not the next test's business.
    env.sql(&format!(
        "SELECT pg_cancel_backend(pid) FROM pg_stat_activity
          WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()
            AND query LIKE 'VACUUM%' AND query LIKE '%\"{}\".outbox%'",
        env.schema
    ));
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().count(), 3000);
    assert!(
        stderr(&o)
            .contains("the outbox's VACUUM is still under way after 1.0s; not waiting for it"),
        "{}",
        stderr(&o)
    );
    assert!(
        took < std::time::Duration::from_secs(8),
        "the pass took {took:?}: it waited for its VACUUM"
    );
}

#[test]
fn the_relay_and_the_outbox_commands_work_through_a_transaction_mode_pooler() {
    let env = migrated();
    // The pooler's database with ONE server connection (see scripts/test): every session's
    // transactions run on it, so a named statement left by one leasectl meets the next.
    let single = pooler_url("leasectl_test_single");
    let through = |args: &[&str]| env.command_at(&single).args(args).output_in_time();
    // Every command below used to leave a named statement on the pooler's one server
    // connection, and the next one failed with `prepared statement "s0" already exists`.
    for round in 0..2 {
        insert_events(&env, 300, 7, 1 + round * 300);
        let o = through(&["relay", "--once", "--batch", "50", "--sink", "stdout"]);
        assert_eq!(code(&o), 0, "relay, round {round}: {}", stderr(&o));
        assert_eq!(stdout(&o).lines().count(), 300, "round {round}");
        assert_eq!(outbox_count(&env), 0);
    }
    // A refused event goes back with its attempt (the restore statement), then is retried.
    insert_events(&env, 1, 1, 1_000);
    let o = through(&[
        "relay",
        "--once",
        "--sink",
        "exec:exit 3",
        "--max-attempts",
        "1",
    ]);
    assert_eq!(code(&o), 1, "went dead: {}", stderr(&o));
    let id = env.scalar("SELECT id::text FROM outbox");
    for _ in 0..2 {
        let o = through(&["outbox", "list", "--json"]);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        let o = through(&["outbox", "retry", &id]);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
    }
    for _ in 0..2 {
        let o = through(&[
            "outbox",
            "discard",
            "--force",
            "00000000-0000-0000-0000-000000000000",
        ]);
        assert_eq!(code(&o), 1, "no such event: {}", stderr(&o));
    }
    let o = through(&["outbox", "discard", "--force", &id]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(outbox_count(&env), 0);
}

// The same tests with leasectl behind a transaction-mode pgbouncer (every command
// works through a pooler; the relay polls there).
crate::via_pooler!(
    once_drains_20k_events_to_stdout_each_exactly_once_in_aggregate_order,
    the_published_form_is_spec_json_for_application_and_run_events,
    an_event_whose_notify_was_missed_is_found_by_polling,
    three_relays_at_once_deliver_everything_once_in_aggregate_order,
    sigterm_finishes_the_batch_in_hand_and_exits_0_losing_nothing,
    a_relay_killed_mid_batch_loses_nothing_and_a_restart_delivers_the_rest,
    a_dead_event_blocks_only_its_own_aggregate_until_retried,
    an_event_waiting_out_a_retry_is_left_by_once_and_blocks_its_aggregate,
    outbox_retry_all_dead_and_discard,
    prune_deletes_old_runs_but_keeps_each_targets_newest,
);
