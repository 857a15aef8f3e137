//! The plain claim ("The plain claim" in src/store/outbox/mod.rs): taken when nothing is held,
//! busy or compressed and the batch fits, and then exactly what the general claim takes; and
//! for each condition it checks, a case where the plain claim must decline — each test fails
//! if that check were missing, because the plain claim would then take something the general
//! claim never takes (a held aggregate's events, an event behind a head another transaction
//! holds, more than `--batch-bytes`, an aggregate's later events before another one's head).
//!
//! The claims are made through the library (`store::outbox::claim`) on a real connection and
//! rolled back, so each test compares the two statements on the same outbox; the last tests
//! run the relay itself and read which statements claimed its batches from `-v`.

use std::process::Stdio;

use leasectl::db::{Db, Schema, Settings};
use leasectl::model::order::Order;
use leasectl::store::outbox::{
    self, Ask, ClaimLimits, Claimed, Declined, Prepared, Reach, Session, Via,
};

use crate::common::*;
use crate::events::*;

async fn connect(env: &Env) -> Db {
    let settings = Settings::new(Some(&env.direct_url)).unwrap();
    Db::connect(settings, Schema::new(&env.schema))
        .await
        .unwrap()
}

fn limits(batch: i64, bytes: i64, order: Order) -> ClaimLimits {
    ClaimLimits {
        batch,
        bytes,
        up_to: i64::MAX,
        order,
    }
}

/// One event as a claim returned it: `aggregate_id:n`.
fn tag(c: &Claimed) -> String {
    let payload: serde_json::Value = serde_json::from_str(&c.event.payload).unwrap();
    format!("{}:{}", c.event.aggregate_id, payload["n"])
}

/// A claim on `db` (trying the plain claim first with `plain`), rolled back: what it took, in
/// the order the relay publishes it, and which statement took it.
async fn claim(
    db: &Db,
    prepared: Option<&Prepared>,
    limits: ClaimLimits,
    plain: bool,
) -> (Vec<String>, Via) {
    let on = Session {
        client: &db.client,
        schema: &db.schema,
        prepared,
    };
    let ask = Ask {
        reach: Reach::None,
        after: None,
        plain,
    };
    let claimed = outbox::claim(on, limits, ask, std::time::Duration::from_secs(60))
        .await
        .unwrap();
    outbox::rollback(&db.client).await.unwrap();
    (claimed.events.iter().map(tag).collect(), claimed.via)
}

/// The plain claim's batch and how it came about, after checking that it is the general
/// claim's batch on the same outbox.
fn plain_and_general(env: &Env, limits: ClaimLimits) -> (Vec<String>, Via) {
    runtime().block_on(async {
        let db = connect(env).await;
        let (plain, via) = claim(&db, None, limits, true).await;
        let (general, general_via) = claim(&db, None, limits, false).await;
        assert_eq!(general_via, Via::General);
        assert_eq!(
            plain, general,
            "the plain claim ({via:?}) takes what the general one takes"
        );
        (plain, via)
    })
}

/// `n` events of each of the `aggregates`, interleaved, numbered per aggregate, payload
/// `{"n": …, "pad": <pad × "x">}`.
fn interleaved(env: &Env, aggregates: usize, n: usize, pad: usize) {
    env.sql(&format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', 'a' || (g % {aggregates}), 'order.paid',
                jsonb_build_object('n', g / {aggregates}, 'pad', repeat('x', {pad}))
           FROM generate_series(0, {} - 1) g ORDER BY g",
        aggregates * n
    ));
}

#[test]
fn the_plain_claim_takes_a_batch_of_distinct_aggregates_and_one_of_a_single_chain() {
    let env = migrated();
    interleaved(&env, 20, 3, 0);
    let (got, via) = plain_and_general(&env, limits(10, 1 << 20, Order::Insert));
    assert_eq!(via, Via::Plain);
    let expected: Vec<String> = (0..10).map(|a| format!("a{a}:0")).collect();
    assert_eq!(got, expected);

    // One aggregate: its first 10 events, which are also all the heads of the window.
    let chain = migrated();
    interleaved(&chain, 1, 30, 0);
    let (got, via) = plain_and_general(&chain, limits(10, 1 << 20, Order::Insert));
    assert_eq!(via, Via::Plain);
    assert_eq!(got, (0..10).map(|n| format!("a0:{n}")).collect::<Vec<_>>());
}

#[test]
fn the_plain_claim_is_prepared_once_per_connection() {
    let env = migrated();
    interleaved(&env, 20, 3, 0);
    runtime().block_on(async {
        let db = connect(&env).await;
        let prepared = Prepared::default();
        let l = limits(10, 1 << 20, Order::Insert);
        let (first, via) = claim(&db, Some(&prepared), l, true).await;
        assert_eq!(via, Via::Plain);
        assert_eq!(
            prepared.len(),
            3,
            "the plain claim, the idle timeout's and the verdict's statements, prepared"
        );
        let named: i64 = db
            .client
            .query_one("SELECT count(*) FROM pg_prepared_statements", &[])
            .await
            .unwrap()
            .get(0);
        assert!(named >= 3, "named statements on the server");
        let (again, _) = claim(&db, Some(&prepared), l, true).await;
        assert_eq!(
            again, first,
            "the prepared statement claims the same (rolled back) batch"
        );
        assert_eq!(prepared.len(), 3, "prepared once");
        let (_, via) = claim(&db, Some(&prepared), l, false).await;
        assert_eq!(via, Via::General);
        assert_eq!(prepared.len(), 4, "the general claim, prepared too");
        // Planned once, not again at every execution (PostgreSQL plans a prepared statement
        // for its values at least five times before it considers one plan for all).
        for _ in 0..6 {
            claim(&db, Some(&prepared), l, true).await;
        }
        let plans: Vec<(i64, i64)> = db
            .client
            .query_typed(
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements
                  WHERE statement LIKE '%DELETE FROM%'",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        assert_eq!(plans.len(), 2, "{plans:?}");
        assert!(
            plans
                .iter()
                .all(|&(generic, custom)| generic >= 1 && custom == 0),
            "every execution of the claims ran the one plan made for any values: {plans:?}"
        );

        // A cache that outlived its statements (the server forgot them): forgotten, and the
        // claim still goes out.
        db.client.batch_execute("DEALLOCATE ALL").await.unwrap();
        let (after, via) = claim(&db, Some(&prepared), l, true).await;
        assert_eq!((after, via), (first, Via::Plain));
        assert!(prepared.is_empty(), "the stale statements are forgotten");
    });
}

#[test]
fn a_held_event_anywhere_makes_the_plain_claim_decline_and_its_aggregate_stays_held() {
    let env = migrated();
    interleaved(&env, 5, 3, 0);
    // a0's head is dead: its live events behind it must not be claimed.
    env.sql(
        "UPDATE outbox SET dead_at = now(), attempts = 5, last_error = 'HTTP 500'
          WHERE seq = (SELECT min(seq) FROM outbox WHERE aggregate_id = 'a0')",
    );
    let (got, via) = plain_and_general(&env, limits(10, 1 << 20, Order::Insert));
    assert_eq!(via, Via::Fallback(Declined::Held));
    assert!(
        got.iter().all(|t| !t.starts_with("a0:")),
        "nothing of the held aggregate: {got:?}"
    );
    assert_eq!(got.len(), 10);

    // Waiting out a retry holds its aggregate the same way.
    let retry = migrated();
    interleaved(&retry, 5, 3, 0);
    retry.sql(
        "UPDATE outbox SET next_attempt_at = now() + interval '1 hour', attempts = 1
          WHERE seq = (SELECT min(seq) FROM outbox WHERE aggregate_id = 'a1')",
    );
    let (got, via) = plain_and_general(&retry, limits(10, 1 << 20, Order::Insert));
    assert_eq!(via, Via::Fallback(Declined::Held));
    assert!(got.iter().all(|t| !t.starts_with("a1:")), "{got:?}");
}

#[test]
fn a_head_another_transaction_holds_makes_the_plain_claim_decline_and_skip_its_aggregate() {
    let env = migrated();
    interleaved(&env, 5, 3, 0);
    runtime().block_on(async {
        // Another relay's batch: a0's head deleted in a transaction left open.
        let other = Settings::new(Some(&env.direct_url))
            .unwrap()
            .open_client()
            .await
            .unwrap();
        other
            .batch_execute(&format!(
                "BEGIN; DELETE FROM \"{s}\".outbox
                  WHERE seq = (SELECT min(seq) FROM \"{s}\".outbox WHERE aggregate_id = 'a0')",
                s = env.schema
            ))
            .await
            .unwrap();
        let db = connect(&env).await;
        let l = limits(10, 1 << 20, Order::Insert);
        let on = Session {
            client: &db.client,
            schema: &db.schema,
            prepared: None,
        };
        let ask = Ask {
            reach: Reach::None,
            after: None,
            plain: true,
        };
        let claimed = outbox::claim(on, l, ask, std::time::Duration::from_secs(60))
            .await
            .unwrap();
        let plain: Vec<String> = claimed.events.iter().map(tag).collect();
        assert!(
            plain.iter().all(|t| !t.starts_with("a0:")),
            "nothing behind the head another transaction holds: {plain:?}"
        );
        assert_eq!(claimed.via, Via::Fallback(Declined::Locked));
        // While the batch is held: nothing of a0 behind its head is locked (the plain claim's
        // locks went with its transaction, the general claim skipped the aggregate).
        let third = Settings::new(Some(&env.direct_url))
            .unwrap()
            .open_client()
            .await
            .unwrap();
        let free: i64 = third
            .query_one(
                &format!(
                    "SELECT count(*) FROM (SELECT seq FROM \"{}\".outbox WHERE aggregate_id = 'a0'
                                              FOR UPDATE SKIP LOCKED) f",
                    env.schema
                ),
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(free, 2, "no lock of the declined claim left behind");
        outbox::rollback(&db.client).await.unwrap();
        let (general, _) = claim(&db, None, l, false).await;
        assert_eq!(plain, general);
        other.batch_execute("ROLLBACK").await.unwrap();
    });
}

/// The plain claim on `env`'s outbox (batch 10) while another transaction runs `change` (on
/// `a1`'s second event) and keeps it open: once the claim waits for that event's row lock, the
/// other transaction commits. Returns what the claim took (rolled back) and how, and the general
/// claim's batch on the outbox as it is after the change.
fn plain_claim_across(env: &Env, change: &str) -> ((Vec<String>, Via), Vec<String>) {
    interleaved(env, 5, 3, 0);
    runtime().block_on(async {
        let settings = Settings::new(Some(&env.direct_url)).unwrap();
        let other = settings.open_client().await.unwrap();
        let s = &env.schema;
        other
            .batch_execute(&format!(
                "BEGIN; {} WHERE seq = (SELECT seq FROM \"{s}\".outbox WHERE aggregate_id = 'a1'
                                         ORDER BY seq OFFSET 1 LIMIT 1)",
                change.replace("{s}", s)
            ))
            .await
            .unwrap();
        let watcher = settings.open_client().await.unwrap();
        let db = connect(env).await;
        let l = limits(10, 1 << 20, Order::Insert);
        let claiming = claim(&db, None, l, true);
        let commit = async {
            // The claim's DELETE waits for the other transaction's row lock: the window was
            // read before the change committed.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            loop {
                let waiting: i64 = watcher
                    .query_one(
                        "SELECT count(*) FROM pg_stat_activity
                          WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'",
                        &[&s],
                    )
                    .await
                    .unwrap()
                    .get(0);
                if waiting > 0 {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "the plain claim never waited for the changed row"
                );
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            other.batch_execute("COMMIT").await.unwrap();
        };
        let (taken, ()) = tokio::join!(claiming, commit);
        let (general, _) = claim(&db, None, l, false).await;
        (taken, general)
    })
}

#[test]
fn an_event_removed_while_the_plain_claim_waited_for_it_makes_it_decline() {
    let env = migrated();
    // a1's second event is deleted by a transaction that commits after the plain claim read
    // its window: fetched by the ctid it had, the row is gone, and a batch without it would
    // not be what the general claim takes now.
    let ((got, via), general) = plain_claim_across(&env, "DELETE FROM \"{s}\".outbox");
    assert_eq!(via, Via::Fallback(Declined::Locked), "took {got:?}");
    assert_eq!(
        got, general,
        "the general claim's batch, on the outbox as it is now"
    );
    assert!(!got.contains(&"a1:1".to_owned()) && got.contains(&"a1:0".to_owned()));
}

#[test]
fn an_event_changed_while_the_plain_claim_waited_for_it_stays_in_its_place_in_the_batch() {
    let env = migrated();
    // The same with an UPDATE: whichever claim took the batch, a1's second event is in it,
    // after a1's head, as the general claim takes it.
    let ((got, via), general) = plain_claim_across(
        &env,
        "UPDATE \"{s}\".outbox SET last_error = 'changed meanwhile'",
    );
    assert_eq!(got, general, "took by {via:?}");
    let at = |t: &str| got.iter().position(|g| g == t);
    assert!(at("a1:0") < at("a1:1") && at("a1:1").is_some(), "{got:?}");
}

#[test]
fn a_compressed_payload_makes_the_plain_claim_decline_and_the_batch_stays_within_its_bytes() {
    let env = migrated();
    // The first event: 100 kB as text, a few kB stored (compressed inline).
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         VALUES ('order', 'big', 'order.paid', jsonb_build_object('n', 0, 'pad', repeat('x', 100000)))",
    );
    interleaved(&env, 4, 2, 0);
    let packed = env.scalar(
        "SELECT pg_column_compression(payload) IS NOT NULL AND pg_column_size(payload) < 10000
           FROM outbox ORDER BY seq LIMIT 1",
    );
    assert_eq!(
        packed, "t",
        "the big payload is stored compressed, and small"
    );
    // 50 kB: the compressed payload's stored size fits, its text does not.
    let bytes = 50_000;
    let (got, via) = plain_and_general(&env, limits(10, bytes, Order::Insert));
    assert_eq!(via, Via::Fallback(Declined::Packed));
    // The first event goes whatever its size, and alone: the rest would exceed the bytes.
    assert_eq!(got, ["big:0"]);
}

#[test]
fn a_batch_over_its_bytes_makes_the_plain_claim_decline_and_the_batch_stays_within_them() {
    let env = migrated();
    interleaved(&env, 10, 2, 1000);
    let size: i64 = env
        .scalar("SELECT max(octet_length(payload::text)) FROM outbox")
        .parse()
        .unwrap();
    // Room for 3 events of the 10 the batch would take.
    let (got, via) = plain_and_general(&env, limits(10, size * 3 + size / 2, Order::Insert));
    assert_eq!(via, Via::Fallback(Declined::Bytes));
    assert_eq!(got, ["a0:0", "a1:0", "a2:0"]);
}

#[test]
fn heads_past_the_batch_make_the_plain_claim_decline_so_a_burst_keeps_no_one_waiting() {
    let env = migrated();
    // A burst of 15 on a0, then b's only event: the general claim takes b's head (in its
    // window of 20) before a0's later events.
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', 'a0', 'order.paid', jsonb_build_object('n', g) FROM generate_series(0, 14) g;
         INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         VALUES ('order', 'b', 'order.paid', '{\"n\": 0}')",
    );
    let (got, via) = plain_and_general(&env, limits(10, 1 << 20, Order::Insert));
    assert_eq!(via, Via::Fallback(Declined::Spread));
    assert!(
        got.contains(&"b:0".to_owned()),
        "b's head in the batch: {got:?}"
    );
    let mut expected: Vec<String> = (0..9).map(|n| format!("a0:{n}")).collect();
    expected.push("b:0".into());
    assert_eq!(got, expected, "published in seq order");
}

#[test]
fn the_plain_claim_in_commit_order_takes_events_by_transaction_and_not_past_the_horizon() {
    let env = migrated();
    runtime().block_on(async {
        let settings = Settings::new(Some(&env.direct_url)).unwrap();
        let first = settings.open_client().await.unwrap();
        let second = settings.open_client().await.unwrap();
        let insert = |n: i64| {
            format!(
                "INSERT INTO \"{}\".outbox (aggregate_type, aggregate_id, type, payload)
                 VALUES ('order', 'x', 'order.paid', '{{\"n\": {n}}}')",
                env.schema
            )
        };
        // The first transaction takes its xid first, the second inserts (a lower seq) and
        // commits first: commit order puts the first transaction's event first.
        first
            .batch_execute("BEGIN; SELECT pg_current_xact_id()")
            .await
            .unwrap();
        second.batch_execute(&insert(2)).await.unwrap();
        first.batch_execute(&insert(1)).await.unwrap();

        let db = connect(&env).await;
        let l = limits(10, 1 << 20, Order::Commit);
        // While the first transaction is open, its xid holds the horizon: nothing is due.
        let (got, via) = claim(&db, None, l, true).await;
        assert_eq!((got, via), (Vec::<String>::new(), Via::Plain));
        first.batch_execute("COMMIT").await.unwrap();
        // Wait until no older transaction elsewhere on the server holds the horizon back.
        let due = || async {
            let (got, _) = claim(&db, None, l, false).await;
            got.len() == 2
        };
        for _ in 0..600 {
            if due().await {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        let (plain, via) = claim(&db, None, l, true).await;
        assert_eq!(via, Via::Plain);
        assert_eq!(plain, ["x:1", "x:2"], "commit order, not seq order");
        let (general, _) = claim(&db, None, l, false).await;
        assert_eq!(plain, general);
    });
}

/// `relay --once -v` over `env` to stdout: its stdout lines and its stderr.
fn relay_once(env: &Env, args: &[&str]) -> (Vec<serde_json::Value>, String) {
    let out = env
        .command()
        .args(["-v", "relay", "--once", "--sink", "stdout"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let lines = stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (lines, stderr(&out))
}

/// The relay's `-v` summary of its claims: (all, plain, general, after a decline).
fn claims(stderr: &str) -> (u64, u64, u64, u64) {
    let line = stderr
        .lines()
        .find(|l| l.contains("claims: "))
        .unwrap_or_else(|| panic!("no claims summary in: {stderr}"));
    let numbers: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap())
        .collect();
    (numbers[0], numbers[1], numbers[2], numbers[3])
}

#[test]
fn a_relay_drains_a_plain_backlog_with_the_plain_claim_in_order() {
    let env = migrated();
    insert_events(&env, 500, 50, 1);
    let ids = outbox_ids(&env);
    let (lines, err) = relay_once(&env, &["--batch", "100"]);
    assert_eq!(lines.len(), 500);
    assert_per_aggregate_order(&lines);
    let got: Vec<String> = lines
        .iter()
        .map(|l| l["id"].as_str().unwrap().to_owned())
        .collect();
    assert_same_ids(&got, &ids, "the relay's drain");
    let (all, plain, _, fallback) = claims(&err);
    // Five full batches by the plain claim, and the empty claim that ends the pass (the first
    // batch looks past its window, which only the general claim does).
    assert!(plain >= 4, "{err}");
    assert_eq!(fallback, 0, "{err}");
    assert!(all >= 5, "{err}");
}

#[test]
fn a_relay_falls_back_to_the_general_claim_while_an_aggregate_is_held() {
    let env = migrated();
    insert_events(&env, 300, 30, 1);
    env.sql(
        "UPDATE outbox SET dead_at = now(), attempts = 5, last_error = 'HTTP 500'
          WHERE seq = (SELECT min(seq) FROM outbox WHERE aggregate_id = '7')",
    );
    let (lines, err) = relay_once(&env, &["--batch", "50"]);
    assert_eq!(lines.len(), 290, "all but the held aggregate's 10 events");
    assert!(lines.iter().all(|l| l["aggregate_id"] != "7"));
    assert_per_aggregate_order(&lines);
    let (_, plain, _, fallback) = claims(&err);
    assert_eq!(plain, 0, "{err}");
    assert!(fallback >= 1, "{err}");
    assert_eq!(outbox_count(&env), 10);
}
