//! Dead events ahead of the live ones: a claim must not walk through them (docs/BENCHMARKS.md,
//! "Dead heads ahead of live events", has the figures). The relay must still deliver every live
//! event, in each aggregate's order, and still hold back every aggregate with a dead or retrying event — and a
//! claim must touch about as much of the table as it does without the dead events.
//!
//! No wall-clock thresholds: the speed property is asserted on the buffers the claim statement
//! touches (`EXPLAIN (ANALYZE, BUFFERS)` of the relay's own statement, through
//! `store::outbox::explain_claim`), with and without the dead events, in the same test. Times
//! are bench/dead-heads.py's.

use std::collections::HashSet;

use serde_json::Value;

use crate::common::*;
use crate::events::*;

/// Dead events ahead of the live ones, each its own aggregate: enough that a claim reading
/// them (about one buffer each) stands far out of the noise of one that does not.
const DEAD: usize = 20_000;

/// Live aggregates behind them, each with [`CHAIN`] events inserted interleaved (so their order
/// is checked), plus the held aggregates of [`fill`].
const LIVE: usize = 300;
const CHAIN: usize = 3;

/// Events of one aggregate right behind the dead ones: the claim's first window holds only it,
/// so the claim reaches past it (its second window) for the others.
const BURST: usize = 400;

/// A migrated schema that autovacuum leaves alone (its statistics are the test's to decide),
/// holding `dead` dead events (each its own aggregate, `dead-…`), then:
///
/// * `live-burst`: [`BURST`] events of one aggregate;
/// * `held-dead`: a dead head with three live events behind it, which must not be delivered;
/// * `held-retry`: a head waiting out a retry an hour away, with two live events behind it;
/// * `late-dead`: a live event, then a dead one: the aggregate is held as a whole;
/// * [`LIVE`] aggregates `live-…` of [`CHAIN`] events each, interleaved, `n` increasing.
///
/// Every event is settled ([`settled_xid`]): in commit order too, what the relay may deliver
/// and what a claim touches do not depend on transactions open elsewhere on the server.
fn fill(env: &Env, dead: usize) {
    let xid = settled_xid(env);
    env.sql(&format!(
        "ALTER TABLE outbox SET (autovacuum_enabled = off);
         INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, attempts, last_error, dead_at, xid)
         SELECT 'order', 'dead-' || g, 'order.paid', jsonb_build_object('n', g), 5, 'HTTP 500', now(), {x}
           FROM generate_series(1, {dead}) g;
         INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, xid)
         SELECT 'order', 'live-burst', 'order.paid', jsonb_build_object('n', g), {x}
           FROM generate_series(1, {BURST}) g;
         INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, attempts, dead_at, xid)
         VALUES ('order', 'held-dead', 'order.paid', '{{\"n\": 1}}', 5, now(), {x});
         INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, attempts, next_attempt_at, xid)
         VALUES ('order', 'held-retry', 'order.paid', '{{\"n\": 1}}', 1, now() + interval '1 hour', {x});
         INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, xid)
         VALUES ('order', 'late-dead', 'order.paid', '{{\"n\": 1}}', {x});
         INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, xid)
         SELECT 'order', 'live-' || (g % {LIVE}), 'order.paid', jsonb_build_object('n', g), {x}
           FROM generate_series(1, {live}) g;
         INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, xid)
         SELECT 'order', a, 'order.paid', jsonb_build_object('n', g), {x}
           FROM generate_series(2, 4) g, (VALUES ('held-dead'), ('held-retry')) v(a)
          WHERE g <= 3 OR a = 'held-dead'
          ORDER BY g, a;
         INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, attempts, dead_at, xid)
         VALUES ('order', 'late-dead', 'order.paid', '{{\"n\": 2}}', 5, now(), {x});",
        live = LIVE * CHAIN,
        x = format!("'{xid}'::xid8"),
    ));
}

/// What must stay in the outbox after a drain besides the dead events: every event of the three
/// held aggregates (`held-dead` 4, `held-retry` 3, `late-dead` 2).
const HELD_LEFT: usize = 4 + 3 + 2;

fn dead_heads_then_live(order: &str) {
    let env = migrated();
    fill(&env, DEAD);
    let expected: HashSet<String> = env
        .sql("SELECT id::text FROM outbox WHERE aggregate_id LIKE 'live-%'")
        .into_iter()
        .map(|r| r[0].clone().unwrap())
        .collect();
    assert_eq!(expected.len(), LIVE * CHAIN + BURST);
    let rows = by_id(&snapshot(&env));

    // One pass delivers every live event (the held ones stay), in either order: the events are
    // settled, so no transaction open elsewhere on the server holds them back.
    let o = env.run(&[
        "relay", "--once", "--batch", "100", "--sink", "stdout", "--order", order,
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let out = o.stdout;
    let published: Vec<Value> = out
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| assert_published_form(l, &rows))
        .collect();
    let ids: Vec<String> = published
        .iter()
        .map(|v| v["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids.len(), expected.len(), "each live event published once");
    assert_same_ids(&ids, &expected, "published");
    assert_per_aggregate_order(&published);

    assert_eq!(outbox_count(&env), DEAD + HELD_LEFT);
    assert_eq!(
        env.scalar(
            "SELECT string_agg(aggregate_id || ':' || (payload->>'n'), ',' ORDER BY seq)
               FROM outbox WHERE aggregate_id NOT LIKE 'dead-%'"
        ),
        "held-dead:1,held-retry:1,late-dead:1,held-dead:2,held-retry:2,held-dead:3,held-retry:3,held-dead:4,late-dead:2",
        "the held aggregates are held whole, behind a dead head, a retrying one or a later dead event"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM outbox WHERE attempts = 0 AND aggregate_id LIKE 'held-%'"),
        "5",
        "nothing behind a held head was attempted"
    );
}

#[test]
fn every_live_event_behind_dead_heads_is_delivered_in_order_and_held_aggregates_stay() {
    dead_heads_then_live("insert");
}

#[test]
fn every_live_event_behind_dead_heads_is_delivered_in_order_in_commit_order_too() {
    dead_heads_then_live("commit");
}

/// The buffers (shared, hit or read) the relay's claim statement touches on `env`'s outbox, for
/// one claim of `--batch 100` as the relay sends it (`reach` when `reach`), per
/// `EXPLAIN (ANALYZE, BUFFERS)`, and the plan as text for a failure message.
fn claim_buffers(env: &Env, order: leasectl::model::order::Order, reach: bool) -> (i64, String) {
    use leasectl::store::outbox::{explain_claim, ClaimLimits};
    let rt = runtime();
    rt.block_on(async {
        let settings = leasectl::db::Settings::new(Some(&env.direct_url)).unwrap();
        let db = leasectl::db::Db::connect(settings, leasectl::db::Schema::new(&env.schema))
            .await
            .unwrap();
        let limits = ClaimLimits {
            batch: 100,
            bytes: 16 << 20,
            up_to: i64::MAX,
            order,
        };
        let plan = explain_claim(&db.client, &db.schema, limits, reach)
            .await
            .unwrap();
        let top = &plan[0]["Plan"];
        let buffers = top["Shared Hit Blocks"].as_i64().unwrap()
            + top["Shared Read Blocks"].as_i64().unwrap();
        assert_eq!(top["Actual Rows"], 100, "a full batch claimed: {plan:#}");
        (buffers, serde_json::to_string_pretty(&plan).unwrap())
    })
}

/// `VACUUM ANALYZE` of `env`'s outbox: a statement of its own, outside any transaction block.
fn vacuum_analyze(env: &Env) {
    let url = env.direct_url.clone();
    let vacuum = format!("VACUUM ANALYZE \"{}\".outbox", env.schema);
    runtime().block_on(async move {
        let client = leasectl::db::Settings::new(Some(&url))
            .unwrap()
            .open_client()
            .await
            .unwrap();
        client.batch_execute(&vacuum).await.unwrap();
    });
}

/// What a claim may touch beyond what it touches without the dead events: a fixed allowance
/// (the probes of the held events' index, one level deeper with them in it), nowhere near one
/// buffer per dead event — which is what reading them costs (the claim before migration 0010
/// touched ~1 buffer per dead event: 308,000 for 300,000).
const ALLOWANCE: i64 = (DEAD / 10) as i64;

fn claim_work_does_not_grow_with_dead_heads(order: leasectl::model::order::Order) {
    let none = migrated();
    fill(&none, 0);
    let dead = migrated();
    fill(&dead, DEAD);
    // Both never analyzed, then both analyzed: the plan must not depend on statistics.
    for state in ["never analyzed", "analyzed"] {
        if state == "analyzed" {
            none.sql("ANALYZE outbox");
            dead.sql("ANALYZE outbox");
        }
        for reach in [false, true] {
            let (reference, _) = claim_buffers(&none, order, reach);
            let (behind, plan) = claim_buffers(&dead, order, reach);
            eprintln!("{state}, reach {reach}: {reference} buffers without dead events, {behind} behind {DEAD}");
            assert!(
                behind <= reference + ALLOWANCE,
                "{state}, reach {reach}: the claim touched {behind} buffers behind {DEAD} dead \
                 events, {reference} without them (at most {ALLOWANCE} more allowed):\n{plan}"
            );
        }
    }
    // An outbox vacuumed and analyzed while empty, whose statistics say "no rows", then a burst.
    let burst = migrated();
    burst.sql("ALTER TABLE outbox SET (autovacuum_enabled = off)");
    vacuum_analyze(&burst);
    assert_eq!(
        burst.scalar("SELECT reltuples FROM pg_class WHERE oid = 'outbox'::regclass"),
        "0"
    );
    fill(&burst, DEAD);
    let (reference, _) = claim_buffers(&none, order, false);
    let (behind, plan) = claim_buffers(&burst, order, false);
    eprintln!("empty then burst: {reference} buffers without dead events, {behind} behind {DEAD}");
    assert!(
        behind <= reference + ALLOWANCE,
        "empty then burst: the claim touched {behind} buffers behind {DEAD} dead events, \
         {reference} without them (at most {ALLOWANCE} more allowed):\n{plan}"
    );
}

#[test]
fn a_claim_behind_dead_heads_touches_no_more_than_without_them() {
    claim_work_does_not_grow_with_dead_heads(leasectl::model::order::Order::Insert);
}

#[test]
fn a_claim_behind_dead_heads_touches_no_more_than_without_them_in_commit_order() {
    claim_work_does_not_grow_with_dead_heads(leasectl::model::order::Order::Commit);
}
