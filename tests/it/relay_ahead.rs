//! The relay claims its next batch on a second connection while it publishes one ("Claiming
//! ahead" in src/store/outbox/mod.rs): that it does, that the two batches stay within
//! `--batch-bytes`, that a refusal in the batch in hand puts the batch claimed ahead back before
//! anything of it is published, that a batch claimed ahead whose session was ended is claimed
//! again rather than published, and that when the batch in hand cannot commit, the one claimed
//! ahead is not committed either; that under SIGKILL nothing is lost; and that a relay writing
//! to stdout, which nothing could overlap, never claims ahead.
//!
//! What a relay's open transactions hold is read from another session through `xmax`: a row
//! that an open transaction deleted is still visible to others, with that transaction's id as
//! its `xmax` (reading it takes no lock, so it cannot get in the relay's way). A row whose
//! deleter rolled back keeps that `xmax` too, so only the ids of transactions still open count.

use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;

use serde_json::Value;

use crate::common::*;
use crate::events::*;
use crate::flights::Recorder;

/// The `n`s of the events in a sink's log (one JSON object per line), in delivery order.
fn delivered(env: &Env) -> Vec<(String, u64)> {
    std::fs::read_to_string(env.path("delivered"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}"));
            (
                v["aggregate_id"].as_str().unwrap().to_owned(),
                v["payload"]["n"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// For each open transaction deleting outbox rows (a relay's batch): the `n`s of its rows, the
/// transactions in the order of their lowest `seq`. (A head the claim locked but did not take,
/// cut by `--batch` or `--batch-bytes`, counts too: its lock shows as `xmax` as well.)
fn open_batches(env: &Env) -> Vec<Vec<u64>> {
    env.sql(
        "SELECT string_agg((payload->>'n'), ',' ORDER BY seq)
           FROM outbox
          WHERE xmax::text IN (SELECT backend_xid::text FROM pg_stat_activity
                                WHERE backend_xid IS NOT NULL)
          GROUP BY xmax::text ORDER BY min(seq)",
    )
    .into_iter()
    .map(|r| {
        r[0].as_deref()
            .unwrap()
            .split(',')
            .map(|n| n.parse().unwrap())
            .collect()
    })
    .collect()
}

/// An exec sink that marks that a delivery started, waits for the gate, and appends the event.
/// Waits until [`open_batches`] is `expected`, saying what it last was if it never is.
fn wait_for_batches(env: &Env, what: &str, expected: &[&[u64]]) {
    let last = std::cell::RefCell::new(Vec::new());
    let seen = || {
        *last.borrow_mut() = open_batches(env);
        *last.borrow() == expected
    };
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| wait_for(what, seen))).is_err() {
        panic!(
            "timed out waiting for {what}: the open batches are {:?}",
            last.borrow()
        );
    }
}

fn gated_sink(env: &Env) -> String {
    format!(
        "exec:touch '{}'; {}; cat >> '{}'",
        env.path("started").display(),
        env.gate(),
        env.path("delivered").display()
    )
}

/// One event for each of `aggregates` ('order', 'a0'…), payload `{"n": g, "pad": PAD}`.
fn insert_padded(env: &Env, first: usize, aggregates: usize, pad: usize) {
    env.sql(&format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', 'a' || g, 'order.paid', jsonb_build_object('n', g, 'pad', repeat('x', {pad}))
           FROM generate_series({first}, {}) g",
        first + aggregates - 1
    ));
}

fn spawn(env: &Env, args: &[&str]) -> Watched {
    Watched::new(
        env.command()
            .arg("-v")
            .arg("relay")
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    )
}

#[test]
fn the_next_batch_is_claimed_while_one_is_published() {
    let env = migrated();
    insert_padded(&env, 1, 8, 10);
    let sink = gated_sink(&env);
    let relay = spawn(&env, &["--once", "--batch", "2", "--sink", &sink]);
    wait_for_file_exists(&env.path("started"));
    // The batch in hand (events 1 and 2) and, in a second transaction, the next one.
    wait_for_batches(&env, "the next batch claimed ahead", &[&[1, 2], &[3, 4]]);
    env.open_gate();
    let o = relay.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let got: Vec<u64> = delivered(&env).into_iter().map(|(_, n)| n).collect();
    let mut sorted = got.clone();
    sorted.sort_unstable();
    assert_eq!(
        sorted,
        (1..=8).collect::<Vec<_>>(),
        "each event exactly once"
    );
    assert_eq!(outbox_count(&env), 0);
}

#[test]
fn the_batch_in_hand_and_the_one_claimed_ahead_stay_within_batch_bytes() {
    let env = migrated();
    // Two small events (about 220 bytes each), then two larger ones (about 360 each) of one
    // aggregate: the claim ahead locks that aggregate's head alone, whatever it takes of it.
    insert_padded(&env, 1, 2, 200);
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', 'c', 'order.paid', jsonb_build_object('n', g, 'pad', repeat('x', 340))
           FROM generate_series(3, 4) g",
    );
    let sink = gated_sink(&env);
    let relay = spawn(
        &env,
        &[
            "--once",
            "--batch",
            "2",
            "--batch-bytes",
            "1000",
            "--sink",
            &sink,
        ],
    );
    wait_for_file_exists(&env.path("started"));
    // 1000 bytes less the ≈ 440 in hand leave room for one of the larger events, not two (which
    // --batch-bytes alone would allow).
    wait_for_batches(&env, "one larger event claimed ahead", &[&[1, 2], &[3]]);
    env.open_gate();
    let o = relay.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(delivered(&env).len(), 4);
    assert_eq!(outbox_count(&env), 0);
}

#[test]
fn a_refusal_in_the_batch_in_hand_puts_the_batch_claimed_ahead_back_first() {
    let env = migrated();
    // x1 y1 x2 y2: the batch in hand is x1 y1, the one claimed ahead x2 y2.
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES
           ('order', 'x', 'order.paid', '{\"n\": 1}'), ('order', 'y', 'order.paid', '{\"n\": 2}'),
           ('order', 'x', 'order.paid', '{\"n\": 3}'), ('order', 'y', 'order.paid', '{\"n\": 4}')",
    );
    // x1 is refused once; every delivery waits for the gate, so x2 y2 are claimed ahead first.
    let sink = format!(
        "exec:line=$(cat); touch '{started}'; {gate}; \
         if [ \"$LEASECTL_AGGREGATE_ID\" = x ] && [ ! -e '{flag}' ]; then touch '{flag}'; exit 1; fi; \
         printf '%s\\n' \"$line\" >> '{log}'",
        started = env.path("started").display(),
        gate = env.gate(),
        flag = env.path("refused-once").display(),
        log = env.path("delivered").display()
    );
    let relay = spawn(&env, &["--batch", "2", "--poll", "50ms", "--sink", &sink]);
    wait_for_file_exists(&env.path("started"));
    wait_for_batches(&env, "the next batch claimed ahead", &[&[1, 2], &[3, 4]]);
    env.open_gate();
    wait_for("all four delivered", || delivered(&env).len() == 4);
    kill(relay.child.id(), libc::SIGTERM);
    let o = relay.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let x: Vec<u64> = delivered(&env)
        .into_iter()
        .filter(|(a, _)| a == "x")
        .map(|(_, n)| n)
        .collect();
    assert_eq!(
        x,
        [1, 3],
        "x2 must wait for x1's retry: {:?}",
        delivered(&env)
    );
    assert!(stderr(&o).contains("failed (attempt 1"), "{}", stderr(&o));
}

#[test]
fn a_batch_claimed_ahead_whose_session_ended_is_claimed_again_not_published() {
    let env = migrated();
    insert_padded(&env, 1, 6, 10);
    let sink = gated_sink(&env);
    let relay = spawn(&env, &["--once", "--batch", "2", "--sink", &sink]);
    wait_for_file_exists(&env.path("started"));
    wait_for_batches(&env, "the next batch claimed ahead", &[&[1, 2], &[3, 4]]);
    // End the session of the batch claimed ahead, as idle_in_transaction_session_timeout would.
    let ended = env.scalar(
        "SELECT pg_terminate_backend(a.pid)::text FROM pg_stat_activity a
          WHERE a.backend_xid::text = (SELECT xmax::text FROM outbox
                                        WHERE (payload->>'n')::int = 3)",
    );
    assert_eq!(ended, "true");
    wait_for_batches(&env, "its events back", &[&[1, 2]]);
    env.open_gate();
    let o = relay.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("the batch claimed ahead was lost with its session"),
        "{}",
        stderr(&o)
    );
    let mut got: Vec<u64> = delivered(&env).into_iter().map(|(_, n)| n).collect();
    got.sort_unstable();
    assert_eq!(got, (1..=6).collect::<Vec<_>>(), "each event exactly once");
    assert_eq!(outbox_count(&env), 0);
}

#[test]
fn a_batch_whose_commit_fails_takes_the_batch_claimed_ahead_down_with_it() {
    let env = migrated();
    // a1 b1 c1 d1 a2 b2 c2 d2: the batch in hand is the first four, the one claimed ahead the rest.
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', chr(96 + (g - 1) % 4 + 1), 'order.paid', jsonb_build_object('n', g)
           FROM generate_series(1, 8) g",
    );
    let sink = gated_sink(&env);
    let relay = spawn(&env, &["--batch", "4", "--poll", "50ms", "--sink", &sink]);
    wait_for_file_exists(&env.path("started"));
    wait_for_batches(
        &env,
        "the next batch claimed ahead",
        &[&[1, 2, 3, 4], &[5, 6, 7, 8]],
    );
    // The batch in hand's session ends: its commit fails after its events were published.
    let ended = env.scalar(
        "SELECT pg_terminate_backend(a.pid)::text FROM pg_stat_activity a
          WHERE a.backend_xid::text = (SELECT xmax::text FROM outbox
                                        WHERE (payload->>'n')::int = 1)",
    );
    assert_eq!(ended, "true");
    env.open_gate();
    wait_for("every event delivered and the outbox empty", || {
        outbox_count(&env) == 0 && delivered(&env).len() >= 8
    });
    kill(relay.child.id(), libc::SIGTERM);
    let o = relay.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stderr(&o).contains("reconnected"), "{}", stderr(&o));
    // At least once, and an aggregate's second event only after the last copy of its first.
    let got = delivered(&env);
    for agg in ["a", "b", "c", "d"] {
        let seen: Vec<u64> = got
            .iter()
            .filter(|(a, _)| a == agg)
            .map(|(_, n)| *n)
            .collect();
        let last_first = seen.iter().rposition(|&n| n <= 4);
        let first_second = seen.iter().position(|&n| n > 4);
        assert!(
            last_first.is_some() && first_second.is_some() && last_first < first_second,
            "aggregate {agg}: {seen:?} (all: {got:?})"
        );
    }
}

#[test]
fn a_sigkilled_relay_leaves_both_its_batches_in_the_outbox() {
    let env = migrated();
    insert_padded(&env, 1, 8, 10);
    let sink = gated_sink(&env);
    let relay = spawn(&env, &["--once", "--batch", "2", "--sink", &sink]);
    wait_for_file_exists(&env.path("started"));
    wait_for_batches(&env, "the next batch claimed ahead", &[&[1, 2], &[3, 4]]);
    kill(relay.child.id(), libc::SIGKILL);
    let o = relay.finish();
    assert_eq!(o.status.signal(), Some(libc::SIGKILL));
    // Both sessions end with the process: nothing is held, nothing was deleted.
    wait_for_batches(&env, "both transactions rolled back", &[]);
    assert_eq!(outbox_count(&env), 8);
    assert!(delivered(&env).is_empty(), "the gate was never opened");
    // A later relay delivers every event once.
    env.open_gate();
    let o = env.run(&["relay", "--once", "--batch", "2", "--sink", &sink]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let mut got: Vec<u64> = delivered(&env).into_iter().map(|(_, n)| n).collect();
    got.sort_unstable();
    assert_eq!(got, (1..=8).collect::<Vec<_>>());
}

/// Stdout is written by one blocking write at the batch's end: a claim ahead could only go out
/// after it, and the relay would wait for it on a second connection. So a relay writing to
/// stdout claims nothing ahead, not even after its first full batch (where a sink that is not
/// known yet to be fast tries): three full batches and the empty claim after them go through
/// one connection.
#[test]
fn a_relay_writing_to_stdout_never_claims_ahead() {
    let env = migrated();
    insert_padded(&env, 1, 30, 10);
    let rec = Recorder::start();
    let o = rec.relay_once(&env);
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().count(), 30);
    assert_eq!(outbox_count(&env), 0);
    assert_eq!(rec.flights().len(), 1, "connections made by the relay");
}
