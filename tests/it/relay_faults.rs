//! The relay under the faults of issue 12 §5's fault-injection campaign: each test here failed
//! before its fix. Webhook receivers are the HTTP peer of `sink_local.rs` (a tokio
//! `TcpListener` on a thread of its own, see `relay_sinks.rs`).

use std::collections::HashSet;
use std::sync::Arc;

use crate::common::*;
use crate::events::*;
use crate::relay_sinks::{body, key, no_content, Relay, Webhook};
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
