//! The relay under the faults of issue 12 §5's fault-injection campaign: each test here failed
//! before its fix. Webhook receivers are the HTTP peer of `sink_local.rs` (a tokio
//! `TcpListener` on a thread of its own, see `relay_sinks.rs`).

use std::collections::HashSet;
use std::sync::Arc;

use crate::common::*;
use crate::events::*;
use crate::relay_sinks::{body, key, no_content, server_error, Relay, Webhook};
use crate::sink_local::Answer;

/// §5.1: a receiver that resets the connection on one aggregate's requests (after reading
/// them) must cost only that aggregate: its head is charged, backs off and goes dead after
/// `--max-attempts`, while every other aggregate drains. Before the fix a reset counted as
/// "sink unreachable": nothing was charged, the whole relay backed off, and the poison event
/// never went dead.
#[test]
fn a_webhook_resetting_one_aggregates_requests_stalls_only_that_aggregate() {
    let env = migrated();
    // 2,000 events over aggregates '0'…'19', interleaved; '7' is the poisoned one.
    insert_events(&env, 2000, 20, 0);
    let rows = snapshot(&env);
    let poisoned: Vec<String> = rows
        .iter()
        .filter(|r| r.aggregate_id == "7")
        .map(|r| r.id.clone())
        .collect();
    let others: HashSet<String> = rows
        .iter()
        .filter(|r| r.aggregate_id != "7")
        .map(|r| r.id.clone())
        .collect();
    let hook = Webhook::start(Answer::By(Arc::new(|r, _| {
        if body(r)["aggregate_id"] == "7" {
            Answer::Reset
        } else {
            no_content()
        }
    })));
    let relay = Relay::spawn(
        &env,
        &["--sink", &hook.url(), "--max-attempts", "3", "--poll", "1s"],
    );
    wait_for("the other aggregates to drain and '7' to go dead", || {
        env.scalar(
            "SELECT count(*) FILTER (WHERE aggregate_id <> '7') = 0
                AND count(*) FILTER (WHERE dead_at IS NOT NULL) = 1
               FROM outbox",
        ) == "t"
    });
    let dead = outbox_list(&env, true);
    assert_eq!(dead["events"][0]["id"], poisoned[0].as_str(), "{dead}");
    assert_eq!(dead["events"][0]["attempts"], 3, "{dead}");
    let error = dead["events"][0]["last_error"].as_str().unwrap();
    assert!(
        error.contains("connection failed before a response"),
        "{error}"
    );
    assert_eq!(outbox_count(&env), poisoned.len(), "'7' keeps its events");

    let requests = hook.requests();
    let delivered: Vec<String> = requests
        .iter()
        .filter(|r| body(r)["aggregate_id"] != "7")
        .map(key)
        .collect();
    assert_eq!(delivered.len(), others.len(), "an event was posted twice");
    assert_same_ids(&delivered, &others, "the other aggregates' events");
    assert_per_aggregate_order(
        &requests
            .iter()
            .map(body)
            .filter(|b| b["aggregate_id"] != "7")
            .collect::<Vec<_>>(),
    );
    let tried: Vec<String> = requests
        .iter()
        .filter(|r| body(r)["aggregate_id"] == "7")
        .map(key)
        .collect();
    assert_eq!(
        tried,
        vec![poisoned[0].clone(); 3],
        "only the head, 3 times"
    );

    let o = relay.stop();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(!err.contains("is unavailable"), "{err}");
    assert!(err.contains("is dead after 3 attempts"), "{err}");
}

/// A ~3 kB aggregate id (random hex: a btree entry of 3,224 bytes, over the 2,704 limit).
const BIG_ID: &str = "(SELECT string_agg(md5(g::text), '') FROM generate_series(1, 100) g)";

/// §5.3: one refused event with a ~3 kB aggregate_id could not be put back (`index row size
/// 3224 exceeds btree … "outbox_held"`): the batch rolled back, the relay exited 70 and
/// republished the batch on every restart, and `outbox retry` exited 70 too.
#[test]
fn a_refused_event_with_a_3kb_aggregate_id_goes_dead_like_any_other() {
    let env = migrated();
    insert_events(&env, 20, 4, 0);
    env.sql(&format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         VALUES ('order', {BIG_ID}, 'order.paid', '{{}}')"
    ));
    insert_events(&env, 20, 4, 20);
    let big = env.scalar("SELECT id FROM outbox WHERE length(aggregate_id) > 1000");
    let others: HashSet<String> = outbox_ids(&env)
        .into_iter()
        .filter(|id| *id != big)
        .collect();
    let hook = Webhook::start(Answer::By(Arc::new(|r, _| {
        if body(r)["aggregate_id"].as_str().unwrap().len() > 1000 {
            server_error()
        } else {
            no_content()
        }
    })));
    let o = env.run(&[
        "relay",
        "--once",
        "--sink",
        &hook.url(),
        "--max-attempts",
        "1",
    ]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("1 event went dead during this pass"),
        "{}",
        stderr(&o)
    );
    let delivered: Vec<String> = hook
        .requests()
        .iter()
        .map(key)
        .filter(|k| *k != big)
        .collect();
    assert_same_ids(&delivered, &others, "the other events, once each");
    assert_eq!(delivered.len(), 40, "posted twice");
    assert_eq!(
        env.scalar("SELECT string_agg(id::text || ' ' || attempts || ' ' || (dead_at IS NOT NULL), ',') FROM outbox"),
        format!("{big} 1 true")
    );

    // The operator brings it back, and it goes through.
    hook.set(no_content());
    let o = env.run(&["outbox", "retry", &big]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = env.run(&["relay", "--once", "--sink", &hook.url()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(outbox_count(&env), 0);
}

/// §5.3, the general rule: a put-back PostgreSQL refuses (here a CHECK an application added that
/// no charged event passes) never rolls the others back. The refused event goes back as it was
/// claimed; the delivered ones stay delivered — each posted once, however often the refused one
/// comes round again.
#[test]
fn a_put_back_postgresql_refuses_never_rolls_back_the_rest_of_the_batch() {
    let env = migrated();
    insert_events(&env, 30, 3, 0);
    env.sql("ALTER TABLE outbox ADD CONSTRAINT no_second_tries CHECK (attempts = 0) NOT VALID");
    let refused = env.scalar("SELECT id FROM outbox WHERE aggregate_id = '1' ORDER BY seq LIMIT 1");
    let hook = Webhook::start(Answer::By(Arc::new(|r, _| {
        if body(r)["aggregate_id"] == "1" {
            server_error()
        } else {
            no_content()
        }
    })));
    let relay = Relay::spawn(&env, &["--sink", &hook.url(), "--poll", "200ms"]);
    wait_for("aggregates 0 and 2 to drain", || {
        env.scalar("SELECT count(*) FROM outbox WHERE aggregate_id <> '1'") == "0"
    });
    // The refused head came round again (it is due at once: its attempt was not recorded).
    wait_for("the refused event to be tried again", || {
        hook.requests().iter().filter(|r| key(r) == refused).count() >= 3
    });
    let o = relay.stop();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!("cannot record the outcome of event {refused}")),
        "{}",
        stderr(&o)
    );
    let keys: Vec<String> = hook
        .requests()
        .iter()
        .filter(|r| body(r)["aggregate_id"] != "1")
        .map(key)
        .collect();
    let unique: HashSet<&String> = keys.iter().collect();
    assert_eq!((keys.len(), unique.len()), (20, 20), "posted twice");
    assert_eq!(
        env.scalar("SELECT count(*) FILTER (WHERE attempts = 0) || '/' || count(*) FROM outbox"),
        "10/10",
        "aggregate 1 is back as it was"
    );
}

/// §5.2: the claim looked only at the oldest 2 × `--batch` events, so 3,000 events of one
/// aggregate ahead of 1,000 others kept the others waiting until the burst had (nearly) drained.
/// Now it reaches past the busy aggregate to the others' heads: they arrive at the sink while
/// most of the burst is still to come (asserted by order of arrival, not by time).
#[test]
fn a_burst_on_one_aggregate_does_not_hold_the_others_back() {
    let env = migrated();
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', 'burst', 'order.paid', jsonb_build_object('n', g)
           FROM generate_series(1, 3000) g;
         INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', 'o' || g, 'order.paid', jsonb_build_object('n', g)
           FROM generate_series(1, 1000) g",
    );
    let hook = Webhook::start(no_content());
    let o = env.run(&["relay", "--once", "--sink", &hook.url()]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(outbox_count(&env), 0);
    let bodies: Vec<serde_json::Value> = hook.requests().iter().map(body).collect();
    assert_eq!(bodies.len(), 4000, "posted twice");
    assert_per_aggregate_order(&bodies);
    let last_other = bodies
        .iter()
        .rposition(|b| b["aggregate_id"] != "burst")
        .unwrap();
    let burst_before = bodies[..last_other]
        .iter()
        .filter(|b| b["aggregate_id"] == "burst")
        .count();
    // 1,000 heads at 100 per batch: about 10 batches, each with the burst's next event.
    assert!(
        burst_before < 300,
        "{burst_before} of the burst's events went before the last of the others"
    );
}
