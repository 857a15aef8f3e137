//! Outbox helpers shared by the relay tests: a migrated schema, events inserted the way an
//! application would, and checks on what a sink received (the published form, the same set
//! of ids, per-aggregate order).

use std::collections::{HashMap, HashSet};

use serde_json::Value;

use crate::common::*;

/// A test environment whose schema exists already, so SQL can run before leasectl does.
pub(crate) fn migrated() -> Env {
    let env = Env::new();
    let o = env.run(&["migrate"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    env
}

/// An `xid` (as an `int8`) for events a test writes as long settled: one below the commit
/// order's horizon now, so older than every transaction open anywhere in the cluster (another
/// test's, or anyone's `BEGIN` left open) and than any that opens later. `relay --order commit`
/// holds back events of transactions that may still be followed by an older one's commit: a test
/// whose subject is not that wait gives its events this `xid` (it is the `outbox.xid` default's
/// to fill, not the public interface's) so that what it checks does not depend on what else runs
/// on the server. Events of one transaction share their `xid`, as these do.
pub(crate) fn settled_xid(env: &Env) -> i64 {
    env.scalar("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::int8 - 1")
        .parse()
        .unwrap()
}

/// Inserts `n` events numbered `first…` (payload `{"n": g}`) over `aggregates` aggregates
/// ('order', '0'…), cycling through three event types, in one transaction from another
/// connection, like an application would.
pub(crate) fn insert_events(env: &Env, n: usize, aggregates: usize, first: usize) {
    env.sql(&format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', (g % {aggregates})::text,
                (ARRAY['order.created', 'order.paid', 'order.shipped'])[g % 3 + 1],
                jsonb_build_object('n', g)
           FROM generate_series({first}, {}) g",
        first + n - 1
    ));
}

/// One outbox row, as the published form must show it.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    pub id: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub payload: Value,
    pub created_at: String,
}

/// The outbox's rows in `seq` order.
pub(crate) fn snapshot(env: &Env) -> Vec<Row> {
    env.sql(
        "SELECT id::text, aggregate_type, aggregate_id, type, payload::text, rfc3339(created_at)
           FROM outbox ORDER BY seq",
    )
    .into_iter()
    .map(|r| {
        let r: Vec<String> = r.into_iter().map(Option::unwrap).collect();
        Row {
            id: r[0].clone(),
            aggregate_type: r[1].clone(),
            aggregate_id: r[2].clone(),
            event_type: r[3].clone(),
            payload: serde_json::from_str(&r[4]).unwrap(),
            created_at: r[5].clone(),
        }
    })
    .collect()
}

pub(crate) fn by_id(rows: &[Row]) -> HashMap<String, Row> {
    rows.iter().map(|r| (r.id.clone(), r.clone())).collect()
}

pub(crate) fn outbox_ids(env: &Env) -> HashSet<String> {
    env.sql("SELECT id::text FROM outbox")
        .into_iter()
        .map(|r| r[0].clone().unwrap())
        .collect()
}

pub(crate) fn outbox_count(env: &Env) -> usize {
    env.scalar("SELECT count(*) FROM outbox").parse().unwrap()
}

/// `leasectl outbox list [--dead] --json`, parsed.
pub(crate) fn outbox_list(env: &Env, dead: bool) -> Value {
    let mut args = vec!["outbox", "list", "--json"];
    if dead {
        args.push("--dead");
    }
    let o = env.run(&args);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

/// Checks that `body` is the published form of one of `rows` (keys in the published order, values
/// those of the row) and returns it parsed.
pub(crate) fn assert_published_form(body: &[u8], rows: &HashMap<String, Row>) -> Value {
    let text = std::str::from_utf8(body).expect("UTF-8 body");
    assert!(!text.contains('\n'), "one line: {text:?}");
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "id",
            "aggregate_type",
            "aggregate_id",
            "type",
            "payload",
            "created_at"
        ],
        "{text}"
    );
    let id = v["id"].as_str().unwrap();
    let row = rows
        .get(id)
        .unwrap_or_else(|| panic!("published an event that is not in the outbox: {text}"));
    assert_eq!(v["aggregate_type"], row.aggregate_type.as_str());
    assert_eq!(v["aggregate_id"], row.aggregate_id.as_str());
    assert_eq!(v["type"], row.event_type.as_str());
    assert_eq!(v["payload"], row.payload);
    assert_eq!(v["created_at"], row.created_at.as_str());
    v
}

/// Asserts `got` and `expected` hold the same ids; says how they differ without listing
/// thousands of them.
pub(crate) fn assert_same_ids<'a>(
    got: impl IntoIterator<Item = &'a String>,
    expected: &HashSet<String>,
    what: &str,
) {
    let got: HashSet<&String> = got.into_iter().collect();
    let expected: HashSet<&String> = expected.iter().collect();
    let missing: Vec<_> = expected.difference(&got).collect();
    let extra: Vec<_> = got.difference(&expected).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{what}: {} missing (say {:?}), {} unexpected (say {:?})",
        missing.len(),
        &missing[..missing.len().min(3)],
        extra.len(),
        &extra[..extra.len().min(3)],
    );
}

/// Asserts every aggregate's events appear in increasing `payload.n` order.
pub(crate) fn assert_per_aggregate_order<'a>(events: impl IntoIterator<Item = &'a Value>) {
    let mut last: HashMap<String, i64> = HashMap::new();
    for e in events {
        let agg = format!("{}/{}", e["aggregate_type"], e["aggregate_id"]);
        let n = e["payload"]["n"].as_i64().unwrap();
        if let Some(prev) = last.insert(agg.clone(), n) {
            assert!(
                prev < n,
                "aggregate {agg}: event {n} published after {prev}"
            );
        }
    }
}

/// `(who, aggregate, n)` of every line of a log that exec sinks append `WHO <event JSON>` to, in
/// the order they were appended.
pub(crate) fn tagged_log(env: &Env) -> Vec<(String, String, u64)> {
    std::fs::read_to_string(env.path("log"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let (who, json) = l.split_once(' ').unwrap_or_else(|| panic!("{l:?}"));
            let v: Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{l:?}: {e}"));
            (
                who.to_owned(),
                v["aggregate_id"].as_str().unwrap().to_owned(),
                v["payload"]["n"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// An exec sink that sleeps `sleep` seconds, then appends `WHO <event JSON>` to the log.
pub(crate) fn tagged_sink(env: &Env, who: &str, sleep: &str) -> String {
    format!(
        "exec:sleep {sleep}; printf '{who} %s\\n' \"$(cat)\" >> '{}'",
        env.path("log").display()
    )
}

/// Per aggregate, in delivery order (events numbered 1… per aggregate): the first delivery is
/// event 1, and each one after it is either the next event or a redelivery starting again at or
/// before the last one — never a jump ahead. That is what at-least-once in order allows a
/// consumer to see: a redelivered run completes its prefix before any newer event arrives.
pub(crate) fn assert_redeliveries_complete(log: &[(String, String, u64)]) {
    let mut last: HashMap<&str, u64> = HashMap::new();
    for (i, (who, agg, n)) in log.iter().enumerate() {
        let prev = last.insert(agg, *n).unwrap_or(0);
        assert!(
            *n <= prev + 1,
            "aggregate {agg}: event {n} (from relay {who}) came right after event {prev}; \
             the log around it: {:?}",
            &log[i.saturating_sub(8)..(i + 8).min(log.len())]
        );
    }
}
