//! A relay draining a large backlog runs at the same speed whether or not the outbox has ever
//! been analyzed.
//!
//! Without statistics the planner guesses that nearly every outbox row is dead or waiting out a
//! retry: the claim's estimated cost went into the millions, which made PostgreSQL JIT-compile
//! it (about a second per batch, for a statement that runs in milliseconds), and the blocked
//! aggregates' lookup looked too big to hash, so it became a rescan per window row. A 100k
//! backlog drained at a few hundred events/s until someone ran ANALYZE.
//!
//! No absolute times: each test drains a reference outbox filled the same way and allows at
//! most [`SLOWER_AT_MOST`] times its time.

use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use crate::events::*;

/// Events in the backlog (what the issue reported).
const EVENTS: usize = 100_000;

/// Dead events in front of the backlog, each in an aggregate of its own: the blocked
/// aggregates every claim must skip (with statistics their lookup is hashed).
const DEAD: usize = 1_000;

/// How much slower than its reference a drain may be. (The never-analyzed one was ~40×.)
const SLOWER_AT_MOST: f64 = 3.0;

/// A migrated schema that autovacuum leaves alone (so it is never analyzed behind the test's
/// back), holding `dead` dead events followed by `events` due ones over 1000 aggregates with
/// ≈200-byte payloads (the benchmark's), each lot inserted in one statement as an
/// application's bulk insert would.
fn backlog(dead: usize, events: usize) -> Env {
    let env = migrated();
    env.sql(&format!(
        "ALTER TABLE outbox SET (autovacuum_enabled = off);
         INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, attempts, dead_at)
         SELECT 'order', 'dead-' || g, 'order.paid', jsonb_build_object('n', g), 10, now()
           FROM generate_series(1, {dead}) g;
         INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', (g % 1000)::text, 'order.paid',
                jsonb_build_object('n', g, 'pad', repeat('x', 150))
           FROM generate_series(1, {events}) g"
    ));
    env
}

/// True once the outbox has column statistics (ANALYZE ran, by hand or by autovacuum).
fn analyzed(env: &Env) -> bool {
    env.scalar(&format!(
        "SELECT count(*) FROM pg_stats WHERE schemaname = '{}' AND tablename = 'outbox'",
        env.schema
    )) != "0"
}

/// Starts `relay --once --sink stdout` (output to /dev/null) on `env`, through `url`.
fn drain(env: &Env, url: &str) -> std::process::Child {
    env.command_at(url)
        .args(["relay", "--once", "--sink", "stdout"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for a drain and returns its output and how long it took. With a `reference`, the
/// drain may take at most [`SLOWER_AT_MOST`] times that plus `slack` (scheduling noise and
/// one-off costs): past that it is killed and the test fails naming how far it got.
fn timed(
    env: &Env,
    mut relay: std::process::Child,
    reference: Option<Duration>,
    slack: Duration,
    what: &str,
) -> (Output, Duration) {
    let started = Instant::now();
    if let Some(reference) = reference {
        let limit = reference.mul_f64(SLOWER_AT_MOST) + slack;
        if exited_within(&mut relay, limit).is_none() {
            let _ = relay.kill();
            let _ = relay.wait();
            let left = env.scalar("SELECT count(*) FROM outbox WHERE dead_at IS NULL");
            panic!(
                "{what}: {left} events still due after {:.1}s; the reference drained all in \
                 {:.1}s (at most {SLOWER_AT_MOST}× that is allowed)",
                started.elapsed().as_secs_f64(),
                reference.as_secs_f64()
            );
        }
    }
    let o = finish(relay);
    let took = started.elapsed();
    assert_eq!(code(&o), 0, "{what}: {}", stderr(&o));
    assert_eq!(
        env.scalar("SELECT count(*) FROM outbox WHERE dead_at IS NULL"),
        "0",
        "{what}: every due event delivered"
    );
    eprintln!("{what}: {:.2}s", took.as_secs_f64());
    (o, took)
}

#[test]
fn a_never_analyzed_outbox_drains_as_fast_as_an_analyzed_one() {
    let never = backlog(DEAD, EVENTS);
    let reference = backlog(DEAD, EVENTS);
    reference.sql("ANALYZE outbox");
    assert!(analyzed(&reference));
    let (_, reference_time) = timed(
        &reference,
        drain(&reference, &reference.url),
        None,
        Duration::ZERO,
        "analyzed outbox",
    );

    assert!(
        !analyzed(&never),
        "the outbox under test must never have been analyzed"
    );
    timed(
        &never,
        drain(&never, &never.url),
        Some(reference_time),
        Duration::from_secs(1),
        "never-analyzed outbox",
    );
    assert_eq!(outbox_count(&never), DEAD, "the dead events stay");
    assert!(
        !analyzed(&never),
        "drained without statistics: the claim must not depend on them"
    );
}

#[test]
fn the_claim_is_never_jit_compiled_whatever_its_estimated_cost() {
    // A never-analyzed outbox of a few million rows costs the claim past every JIT threshold
    // even with the blocked aggregates' lookup hashed; here the thresholds come down to 0
    // instead, for the relay's whole session. Its one-off statements (the migration check, the
    // highest seq) may be compiled; the 50 claims must not be, at about a second each.
    let events = 5_000;
    let forced = backlog(0, events);
    let reference = backlog(0, events);
    let (_, reference_time) = timed(
        &reference,
        drain(&reference, &reference.url),
        None,
        Duration::ZERO,
        "default JIT settings",
    );
    let url = with_options(
        &forced.url,
        "-c jit=on -c jit_above_cost=0 -c jit_inline_above_cost=0 -c jit_optimize_above_cost=0",
    );
    timed(
        &forced,
        drain(&forced, &url),
        Some(reference_time),
        Duration::from_secs(5),
        "JIT thresholds at 0",
    );
}
