//! `relay --order insert|commit`, `--batch-bytes`, and the warnings naming
//! what holds a relay back: an open transaction under `--order commit`, a snapshot holding the
//! xmin horizon.
//!
//! The scene: transaction A inserts event A of aggregate X and stays open; transaction B
//! then inserts event B of X and commits. `seq` says A comes first, but only B is committed.

use std::process::Stdio;

use crate::common::*;
use crate::events::*;
use crate::metrics::{scrape, value};
use crate::relay_wake::Session;

fn insert(n: u32) -> String {
    format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         VALUES ('order', 'X', 'order.event', '{{\"n\": {n}}}');"
    )
}

/// The `n` of each event on the stdout of `relay --once --sink stdout`.
fn numbers(out: &std::process::Output) -> Vec<u64> {
    stdout(out)
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["payload"]["n"].as_u64().unwrap()
        })
        .collect()
}

/// A open with event 1 inserted, B committed with event 2.
fn scene(env: &Env) -> Session {
    let mut a = Session::open(env);
    a.run(&format!("BEGIN; {}", insert(1)));
    env.sql(&insert(2));
    a
}

fn once(env: &Env, order: &str) -> std::process::Output {
    env.run(&["relay", "--once", "--sink", "stdout", "--order", order])
}

#[test]
fn commit_order_publishes_nothing_past_an_open_transaction_then_both_in_its_order() {
    let env = migrated();
    let mut a = scene(&env);
    let o = once(&env, "commit");
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(
        numbers(&o),
        Vec::<u64>::new(),
        "B waits for A's transaction"
    );
    assert!(
        stderr(&o).contains("wait for it (--order commit)"),
        "{}",
        stderr(&o)
    );
    assert_eq!(env.scalar("SELECT count(*) FROM outbox"), "1");

    a.run("COMMIT;");
    // Other tests share the database, and any transaction of theirs that is older than B's holds
    // B back too: drain until both are out, in as many passes as that takes.
    let mut got = Vec::new();
    wait_for("A and B published", || {
        let o = once(&env, "commit");
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        got.extend(numbers(&o));
        got.len() >= 2
    });
    assert_eq!(got, [1, 2], "A before B");
    assert_eq!(env.scalar("SELECT count(*) FROM outbox"), "0");
}

#[test]
fn insert_order_publishes_the_later_commit_first_as_the_readme_warns() {
    let env = migrated();
    let mut a = scene(&env);
    let o = once(&env, "insert");
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(numbers(&o), [2], "B is published while A is open");
    a.run("COMMIT;");
    let o = once(&env, "insert");
    assert_eq!(numbers(&o), [1], "then A, after B");
}

#[test]
fn commit_order_keeps_an_events_transaction_when_it_is_put_back() {
    // Event 1 of X is refused once and put back by the relay's own transaction, whose id is
    // newer than event 2's (--batch 1: event 2 is not in that batch); event 2 must still follow.
    let env = migrated();
    // Two settled transactions, event 1's the older: no transaction open elsewhere on the
    // server holds them back, and the order the test is about stays theirs.
    let xid = settled_xid(&env);
    let settled = |n: u32, xid: i64| {
        format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, xid)
             VALUES ('order', 'X', 'order.event', '{{\"n\": {n}}}', '{xid}'::xid8);"
        )
    };
    env.sql(&format!(
        "BEGIN; {} COMMIT; BEGIN; {} COMMIT;",
        settled(1, xid - 1),
        settled(2, xid)
    ));
    let log = env.path("delivered");
    let sink = format!(
        "exec:line=$(cat); if [ ! -e '{flag}' ]; then touch '{flag}'; exit 1; fi; printf '%s\\n' \"$line\" >> '{log}'",
        flag = env.path("refused-once").display(),
        log = log.display()
    );
    let relay = Watched::new(
        env.command()
            .args([
                "relay", "--sink", &sink, "--order", "commit", "--poll", "50ms",
            ])
            .args(["--batch", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_for("both events delivered", || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .count()
            == 2
    });
    kill(relay.child.id(), libc::SIGTERM);
    let o = relay.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let ns: Vec<u64> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["payload"]["n"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(ns, [1, 2]);
}

#[test]
fn once_in_commit_order_takes_a_late_event_of_a_transaction_older_than_its_cut_off() {
    // `--once` drains what existed when it started. In commit order that must be a prefix of
    // every aggregate's (xid, seq) order: transaction A's second event of X is inserted after
    // the relay started (so its seq is past every seq the relay saw), yet it sorts before B's
    // event, which the relay did see. A cut on seq published 1, 3 and left 2 for the next relay.
    let env = migrated();
    let xid = settled_xid(&env);
    let settled = |agg: &str, n: u32, xid: i64| {
        format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, xid)
             VALUES ('order', '{agg}', 'order.event', '{{\"n\": {n}}}', '{xid}'::xid8);"
        )
    };
    // Fillers of another aggregate, older than both transactions, keep the relay busy (one at a
    // time, a tenth of a second each) while A's late event goes in.
    let fillers: String = (0..20).map(|n| settled("F", n, xid - 10)).collect();
    env.sql(&format!(
        "{fillers} {} {}",
        settled("X", 1, xid - 5),
        settled("X", 3, xid - 3)
    ));
    let log = env.path("delivered");
    let sink = format!(
        "exec:printf '%s\\n' \"$(cat)\" >> '{}'; sleep 0.1",
        log.display()
    );
    let relay = Watched::new(
        env.command()
            .args(["relay", "--once", "--sink", &sink, "--order", "commit"])
            .args(["--batch", "1"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let xs = || -> Vec<u64> {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|v| v["aggregate_id"] == "X")
            .map(|v| v["payload"]["n"].as_u64().unwrap())
            .collect()
    };
    wait_for("the first filler delivered", || log.exists());
    assert!(xs().is_empty(), "X waits behind the fillers: {:?}", xs());
    env.sql(&settled("X", 2, xid - 5));
    let o = relay.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(
        xs(),
        [1, 2, 3],
        "A's two events, then B's, from the one relay"
    );
}

#[test]
fn commit_order_warns_naming_the_backend_of_the_open_transaction() {
    let env = migrated();
    let mut a = scene(&env);
    let log = env.path("delivered");
    let sink = format!(
        "exec:cat >> '{}'; echo >> '{}'",
        log.display(),
        log.display()
    );
    // --poll 50ms: held back for longer than 500ms is worth a warning.
    let relay = Watched::new(
        env.command()
            .args([
                "relay", "--sink", &sink, "--order", "commit", "--poll", "50ms",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // Another test's older transaction may be named first; then A's, once it is the oldest.
    let needle = format!("backend pid {}", a.pid);
    relay.wait_for_stderr(&needle);
    let err = relay.stderr();
    let ours: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("--order commit: events have waited") && l.contains(&needle))
        .collect();
    assert_eq!(ours.len(), 1, "once a minute at most: {err}");
    assert!(ours[0].contains("idle in transaction"), "{err}");
    assert_eq!(std::fs::read_to_string(&log).unwrap_or_default(), "");
    a.run("COMMIT;");
    wait_for("A and B delivered", || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.is_empty())
            .count()
            == 2
    });
    kill(relay.child.id(), libc::SIGTERM);
    let o = relay.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let text = std::fs::read_to_string(&log).unwrap();
    let first = text.find("\"n\": 1").unwrap();
    let second = text.find("\"n\": 2").unwrap();
    assert!(first < second, "A before B: {text}");
}

#[test]
fn a_batch_stops_at_batch_bytes_and_a_larger_event_goes_alone() {
    let env = migrated();
    // Ten events of 960,000 bytes of JSON text each, which PostgreSQL stores compressed (a few
    // kB): measured by what the stored size says they would all fit in one 3 MiB batch.
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'blob', (i % 4)::text, 'blob', to_jsonb(repeat(md5(i::text), 30000))
           FROM generate_series(1, 10) i;
         INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'big', 'one', 'blob', to_jsonb(repeat(md5('big'), 120000));",
    );
    let port = spare_port();
    let log = env.path("delivered");
    let sink = format!("exec:wc -c >> '{}'", log.display());
    let relay = Watched::new(
        env.command()
            .args(["relay", "--sink", &sink, "--batch-bytes", "3MiB"])
            .args(["--metrics", &format!("127.0.0.1:{port}")])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut body = String::new();
    wait_for("11 events delivered", || {
        body = scrape(port, "/metrics").1;
        value(&body, "leasectl_relay_events_delivered_total", &[]) == 11.0
    });
    kill(relay.child.id(), libc::SIGTERM);
    let o = relay.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let batches = value(&body, "leasectl_relay_batch_size_count", &[]);
    let up_to_4 = value(&body, "leasectl_relay_batch_size_bucket", &["le=\"4.0\""]);
    let alone = value(&body, "leasectl_relay_batch_size_bucket", &["le=\"1.0\""]);
    // 3 per batch at most (3 × 960,032 bytes ≤ 3 MiB < 4 ×), so at least 4 batches for the ten,
    // and the 3.8 MB event alone.
    assert!(batches >= 5.0, "{body}");
    assert_eq!(up_to_4, batches, "every batch within 3 MiB: {body}");
    assert!(alone >= 1.0, "{body}");
}

#[test]
fn a_snapshot_holding_the_xmin_horizon_is_named_once() {
    let env = migrated();
    let mut reader = Session::open(&env);
    reader.run("BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT count(*) FROM outbox;");
    let relay = Watched::new(
        env.command()
            .args(["relay", "--sink", "exec:cat > /dev/null", "--poll", "20ms"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    // The relay must delete events for the held horizon to matter: insert until it warns.
    let needle = format!("backend pid {}", reader.pid);
    let mut n = 0;
    wait_for("the warning naming the reader", || {
        n += 1;
        env.sql(&insert(n));
        std::thread::sleep(std::time::Duration::from_millis(50));
        relay.stderr().contains(&needle)
    });
    for _ in 0..10 {
        n += 1;
        env.sql(&insert(n));
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    reader.run("COMMIT;");
    kill(relay.child.id(), libc::SIGTERM);
    let o = relay.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let err = stderr(&o);
    // Once per backend (other tests' open transactions may be named too).
    let ours: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("holds back the xmin horizon") && l.contains(&needle))
        .collect();
    assert_eq!(ours.len(), 1, "{err}");
    assert!(ours[0].contains("idle in transaction"), "{err}");
}

crate::via_pooler!(
    commit_order_publishes_nothing_past_an_open_transaction_then_both_in_its_order,
    commit_order_keeps_an_events_transaction_when_it_is_put_back,
);

/// Writers that do not serialise: four sessions, each inserting two events of the same three
/// aggregates per transaction with a pause in between, so that transactions overlap and commit
/// in every order; three relays with `--order commit` at once. Every aggregate's events arrive
/// in `(xid, seq)` order — the inserting transaction's id travels in the payload — and none is
/// lost or published twice.
#[test]
fn concurrent_unserialised_writers_and_three_relays_deliver_in_transaction_order() {
    use std::collections::{HashMap, HashSet};
    use std::fs::OpenOptions;

    let env = migrated();
    let out = env.path("out.jsonl");
    let relays: Vec<Watched> = (0..3)
        .map(|_| {
            let file = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&out)
                .unwrap();
            Watched::new(
                env.command()
                    .args(["relay", "--sink", "stdout", "--order", "commit"])
                    .args(["--batch", "5", "--poll", "20ms"])
                    .stdout(Stdio::from(file))
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap(),
            )
        })
        .collect();
    const WRITERS: u32 = 4;
    const TRANSACTIONS: u32 = 25;
    std::thread::scope(|s| {
        for w in 0..WRITERS {
            let env = &env;
            s.spawn(move || {
                let mut session = Session::open(env);
                let event = |t: u32, k: u32| {
                    format!(
                        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
                         SELECT 'order', '{agg}', 'order.event',
                                jsonb_build_object('w', {w}, 't', {t}, 'k', {k},
                                                   'xid', pg_current_xact_id()::text::int8);",
                        agg = (w + t + k) % 3
                    )
                };
                for t in 0..TRANSACTIONS {
                    session.run(&format!("BEGIN; {}", event(t, 0)));
                    std::thread::sleep(std::time::Duration::from_millis(u64::from(
                        (w * 7 + t * 3) % 11,
                    )));
                    session.run(&format!("{} COMMIT;", event(t, 1)));
                }
            });
        }
    });
    let total = (WRITERS * TRANSACTIONS * 2) as usize;
    let lines = || {
        std::fs::read_to_string(&out)
            .unwrap_or_default()
            .lines()
            .count()
    };
    wait_for("every event published", || lines() >= total);
    for r in &relays {
        kill(r.child.id(), libc::SIGTERM);
    }
    for r in relays {
        let o = r.finish();
        assert_eq!(code(&o), 0, "{}", stderr(&o));
    }
    let events: Vec<serde_json::Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let unique: HashSet<&str> = events.iter().map(|e| e["id"].as_str().unwrap()).collect();
    assert_eq!(events.len(), total, "published twice");
    assert_eq!(unique.len(), total);
    // Within a transaction, event k = 0 was inserted before k = 1.
    let mut last: HashMap<String, (i64, i64)> = HashMap::new();
    for e in &events {
        let p = &e["payload"];
        let key = (p["xid"].as_i64().unwrap(), p["k"].as_i64().unwrap());
        let agg = e["aggregate_id"].as_str().unwrap().to_owned();
        if let Some(prev) = last.insert(agg.clone(), key) {
            assert!(
                prev < key,
                "aggregate {agg}: {key:?} published after {prev:?}"
            );
        }
    }
    assert_eq!(env.scalar("SELECT count(*) FROM outbox"), "0");
}
