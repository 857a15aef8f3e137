//! Relays never wait for each other: a relay skips an aggregate whose head another relay's
//! batch holds (`FOR UPDATE SKIP LOCKED` on the heads of the claim, src/store/outbox/claim.rs), also
//! when that batch is the one claimed ahead on the other relay's second connection, and also
//! when the held aggregates' later events fill its whole window. Order needs the heads locked;
//! liveness needs the skip: without it the second relay's claim waits on the first relay's
//! row lock, and two relays claiming ahead can each wait on the other's batch in hand while
//! that one waits for its own claim ahead.
//!
//! Events are numbered per aggregate (`payload.n`); what a relay holds is read from another
//! session through `xmax`, as in relay_ahead.rs.

use std::process::Stdio;
use std::time::Duration;

use crate::common::*;
use crate::events::*;

/// A relay whose exec sink waits for the gate before appending `A <event>` to the log, and
/// marks that it started a delivery.
fn gated(env: &Env, args: &[&str]) -> Watched {
    let sink = format!(
        "exec:touch '{}'; {}; printf 'A %s\\n' \"$(cat)\" >> '{}'",
        env.path("started").display(),
        env.gate(),
        env.path("log").display()
    );
    Watched::new(
        env.command_at(&named(env, "A"))
            .args(["-v", "relay"])
            .args(args)
            .args(["--sink", &sink])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    )
}

/// The aggregates of the rows an open transaction deleted (a relay's batches), sorted.
fn held(env: &Env) -> Vec<String> {
    env.sql(
        "SELECT DISTINCT aggregate_id FROM outbox
          WHERE xmax::text IN (SELECT backend_xid::text FROM pg_stat_activity
                                WHERE backend_xid IS NOT NULL)
          ORDER BY 1",
    )
    .into_iter()
    .map(|r| r[0].clone().unwrap())
    .collect()
}

/// The test database with an application_name for `who`'s connections in this test.
fn named(env: &Env, who: &str) -> String {
    format!("{} application_name=lk_{who}_{}", env.url, env.schema)
}

/// How many of this test's relays' backends wait for a lock right now.
fn lock_waits(env: &Env) -> usize {
    env.scalar(&format!(
        "SELECT count(*) FROM pg_stat_activity
          WHERE application_name LIKE 'lk\\_%\\_{}' AND wait_event_type = 'Lock'",
        env.schema
    ))
    .parse()
    .unwrap()
}

/// `relay --once --batch 10` appending `B <event>` to the log, which must be done while the
/// gated relay still holds its batches: it may not wait for them.
fn second_relay_finishes_without_waiting(env: &Env) {
    let mut b = env
        .command_at(&named(env, "B"))
        .args(["relay", "--once", "--batch", "10", "--sink"])
        .arg(tagged_sink(env, "B", "0"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = exits_within(
        &mut b,
        Duration::from_secs(20),
        "the second relay, beside a relay holding aggregates",
    );
    let out = b.wait_with_output().unwrap();
    assert_eq!(status.code(), Some(0), "{}", stderr(&out));
}

/// Relay A holds aggregate x and o1 in its batch in hand and x, o2 in the batch it claimed ahead
/// (its gate is closed). Relay B delivers every other aggregate and exits, without waiting for
/// A; then A delivers the rest, each event exactly once and in order.
#[test]
fn a_second_relay_skips_the_aggregates_another_holds_also_in_its_batch_claimed_ahead() {
    let env = migrated();
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', 'x', 'order.paid', jsonb_build_object('n', g) FROM generate_series(1, 3) g;
         INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', 'o' || g, 'order.paid', '{\"n\": 1}' FROM generate_series(1, 40) g",
    );
    let a = gated(&env, &["--once", "--batch", "2"]);
    wait_for_file_exists(&env.path("started"));
    // [x1, o1] in hand, [x2, o2] claimed ahead on A's second connection.
    wait_for("A's two batches", || held(&env) == ["o1", "o2", "x"]);
    assert_eq!(
        env.scalar(
            "SELECT count(DISTINCT xmax::text) FROM outbox
              WHERE xmax::text IN (SELECT backend_xid::text FROM pg_stat_activity)"
        ),
        "2",
        "two transactions of A"
    );
    second_relay_finishes_without_waiting(&env);
    let by_b: Vec<String> = tagged_log(&env)
        .into_iter()
        .filter(|(w, _, _)| w == "B")
        .map(|(_, a, _)| a)
        .collect();
    let mut expected: Vec<String> = (3..=40).map(|g| format!("o{g}")).collect();
    let mut got = by_b.clone();
    got.sort();
    expected.sort();
    assert_eq!(
        got, expected,
        "B delivers every aggregate A does not hold, once"
    );
    assert_eq!(lock_waits(&env), 0);

    env.open_gate();
    let o = a.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(outbox_count(&env), 0);
    let log = tagged_log(&env);
    assert_eq!(log.len(), 43, "each event exactly once: {log:?}");
    assert_redeliveries_complete(&log);
}

/// Relay A holds ten aggregates whose later events fill relay B's whole window (the oldest 20
/// events): B still reaches past them to the others' heads. Before, B's claim looked past its
/// window only when the window held fewer than `--batch` aggregates, whoever held them, and
/// claimed nothing until A committed.
#[test]
fn a_second_relay_reaches_past_a_window_filled_by_aggregates_another_holds() {
    let env = migrated();
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', 'h' || a, 'order.paid', jsonb_build_object('n', n)
           FROM generate_series(1, 5) n, generate_series(1, 10) a ORDER BY n, a;
         INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', 'o' || g, 'order.paid', '{\"n\": 1}' FROM generate_series(1, 30) g",
    );
    let a = gated(&env, &["--once", "--batch", "10"]);
    wait_for_file_exists(&env.path("started"));
    let hs: Vec<String> = {
        let mut h: Vec<String> = (1..=10).map(|a| format!("h{a}")).collect();
        h.sort();
        h
    };
    wait_for("A holding the ten h aggregates", || held(&env) == hs);
    second_relay_finishes_without_waiting(&env);
    let mut by_b: Vec<String> = tagged_log(&env)
        .into_iter()
        .filter(|(w, _, _)| w == "B")
        .map(|(_, a, _)| a)
        .collect();
    by_b.sort();
    let mut expected: Vec<String> = (1..=30).map(|g| format!("o{g}")).collect();
    expected.sort();
    assert_eq!(by_b, expected, "B delivers the o aggregates, once each");

    env.open_gate();
    let o = a.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(outbox_count(&env), 0);
    let log = tagged_log(&env);
    assert_eq!(log.len(), 80, "each event exactly once");
    assert_redeliveries_complete(&log);
}

/// Two relays that both claim ahead drain one backlog together: no backend of theirs ever waits
/// for a lock (sampled while they run), neither waits for the other's batches, and every event
/// arrives once, in order.
#[test]
fn two_relays_claiming_ahead_never_wait_for_each_others_locks() {
    let env = migrated();
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', 'a' || (g % 40), 'order.paid', jsonb_build_object('n', (g - 1) / 40 + 1)
           FROM generate_series(1, 800) g",
    );
    let relays: Vec<Watched> = ["A", "B"]
        .iter()
        .map(|who| {
            Watched::new(
                env.command_at(&named(&env, who))
                    .args(["-v", "relay", "--once", "--batch", "10", "--sink"])
                    .arg(tagged_sink(&env, who, "0"))
                    .stdout(Stdio::null())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap(),
            )
        })
        .collect();
    let mut waits = 0;
    let mut relays: Vec<Option<Watched>> = relays.into_iter().map(Some).collect();
    let start = std::time::Instant::now();
    while relays.iter_mut().any(|r| {
        r.as_mut()
            .is_some_and(|w| w.child.try_wait().unwrap().is_none())
    }) {
        waits += lock_waits(&env);
        assert!(start.elapsed() < PATIENCE, "the relays did not finish");
        std::thread::sleep(Duration::from_millis(20));
    }
    for r in relays.iter_mut() {
        let o = r.take().unwrap().finish();
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        assert!(stderr(&o).contains("delivered"), "{}", stderr(&o));
    }
    assert_eq!(waits, 0, "backends seen waiting for a lock");
    // Another pass for what a relay skipped while the other held it at the end.
    let o = env
        .command()
        .args(["relay", "--once", "--sink"])
        .arg(tagged_sink(&env, "C", "0"))
        .output_in_time();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(outbox_count(&env), 0);
    let log = tagged_log(&env);
    assert_eq!(log.len(), 800, "each event exactly once");
    let both = ["A", "B"]
        .iter()
        .all(|who| log.iter().any(|(w, _, _)| w == who));
    assert!(both, "both relays delivered");
    assert_redeliveries_complete(&log);
}

/// Relay A holds forty aggregates, whose events fill relay B's window and the next three
/// windows' worth past it; an aggregate behind them gets its event delivered by B all the same,
/// while A still holds them. Before, B's look past its window took in one window's worth of
/// other aggregates' events and no more: it found A's aggregates again at every claim and
/// never the ones behind them, until A's batch ended (the relay chaos rounds' frozen backends:
/// a fresh aggregate's event waited for the thaw).
#[test]
fn a_relay_looks_further_past_its_window_while_what_it_finds_there_is_held() {
    let env = migrated();
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', 'h' || a, 'order.paid', '{\"n\": 1}' FROM generate_series(1, 40) a",
    );
    let a = gated(&env, &["--once", "--batch", "40"]);
    wait_for_file_exists(&env.path("started"));
    let hs: Vec<String> = {
        let mut h: Vec<String> = (1..=40).map(|a| format!("h{a}")).collect();
        h.sort();
        h
    };
    wait_for("A holding the forty h aggregates", || held(&env) == hs);
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         VALUES ('order', 'f', 'order.paid', '{\"n\": 1}')",
    );
    // B: --batch 5, so a window of 10 events; A's aggregates fill the window and 3 more.
    let b = Watched::new(
        env.command_at(&named(&env, "B"))
            .args(["-v", "relay", "--batch", "5", "--poll", "100ms", "--sink"])
            .arg(tagged_sink(&env, "B", "0"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_for("B to deliver f while A holds the h aggregates", || {
        tagged_log(&env)
            .iter()
            .any(|(w, agg, _)| w == "B" && agg == "f")
    });
    assert_eq!(held(&env), hs, "A still holds its batch");
    assert_eq!(lock_waits(&env), 0);
    env.open_gate();
    let o = a.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    wait_for("the outbox to drain", || outbox_count(&env) == 0);
    kill(b.child.id(), libc::SIGTERM);
    let o = b.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let log = tagged_log(&env);
    assert_eq!(log.len(), 41, "each event exactly once: {log:?}");
}
