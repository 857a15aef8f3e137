//! The relay under injected faults: each test here failed before its fix. Webhook receivers are the HTTP peer of `sink_local.rs` (a tokio
//! `TcpListener` on a thread of its own, see `relay_sinks.rs`).

use std::collections::HashSet;
use std::sync::Arc;

use crate::common::*;
use crate::events::*;
use crate::relay_sinks::{body, key, no_content, server_error, Relay, StreamGuard, Webhook};
use crate::sink_brokers::{unique, Proxy};
use crate::sink_local::Answer;

/// A receiver that resets the connection on one aggregate's requests (after reading
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

/// One refused event with a ~3 kB aggregate_id could not be put back (`index row size
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

/// The general rule: a put-back PostgreSQL refuses (here a CHECK an application added that
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

/// The claim looked only at the oldest 2 × `--batch` events, so 3,000 events of one
/// aggregate ahead of 1,000 others kept the others waiting until the burst had (nearly) drained.
/// Now it reaches past the busy aggregate to the others' heads: they arrive at the sink while
/// most of the burst is still to come (asserted by order of arrival, not by time).
#[test]
fn a_burst_on_one_aggregate_does_not_hold_the_others_back() {
    burst_then_others(&[]);
}

/// The same with `--order commit`, whose claim reads the outbox in `(xid, seq)`
/// order: the burst's transaction is older, so it fills the windows just the same.
#[test]
fn a_burst_on_one_aggregate_does_not_hold_the_others_back_in_commit_order() {
    burst_then_others(&["--order", "commit"]);
}

fn burst_then_others(order: &[&str]) {
    let env = migrated();
    // Settled events (one transaction's, as an application's burst would be): in commit order
    // no transaction open elsewhere on the server holds them back.
    let xid = settled_xid(&env);
    env.sql(&format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, xid)
         SELECT 'order', 'burst', 'order.paid', jsonb_build_object('n', g), '{xid}'::xid8
           FROM generate_series(1, 3000) g;
         INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, xid)
         SELECT 'order', 'o' || g, 'order.paid', jsonb_build_object('n', g), '{xid}'::xid8
           FROM generate_series(1, 1000) g"
    ));
    let hook = Webhook::start(no_content());
    let url = hook.url();
    let o = env.run(&[&["relay", "--once", "--sink", &url][..], order].concat());
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(outbox_count(&env), 0, "one pass drains the outbox");
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

/// The next attempt was timed from the batch's start (`now()` in its transaction), not
/// from the refusal: against a receiver that answers 500 only after 1.5 s, the first retry
/// (1 s backoff) was due before the refusal arrived and went out at once. Now the gap between
/// a refusal and the next request is the documented backoff: 1 s, then 2 s, ±20%.
#[test]
fn retry_backoff_runs_from_the_refusal_not_from_the_batchs_start() {
    let env = migrated();
    insert_events(&env, 1, 1, 1);
    let delay = std::time::Duration::from_millis(1500);
    let hook = Webhook::start(Answer::By(Arc::new(move |_, n| {
        if n < 3 {
            Answer::Late(delay, Box::new(server_error()))
        } else {
            no_content()
        }
    })));
    let relay = Relay::spawn(&env, &["--sink", &hook.url(), "--timeout", "10s"]);
    wait_for("the fourth request", || hook.count() >= 4);
    wait_for("the outbox to be empty", || outbox_count(&env) == 0);
    let at: Vec<std::time::Instant> = hook.requests().iter().map(|r| r.at).collect();
    // From each refusal (request + 1.5 s) to the next request.
    let waits: Vec<std::time::Duration> = (1..4).map(|i| at[i] - at[i - 1] - delay).collect();
    let ms = |d: std::time::Duration| d.as_millis();
    for (i, (wait, backoff)) in waits.iter().zip([1000, 2000, 4000]).enumerate() {
        // ±20% jitter; 150 ms more for the response's way back and the relay's wake-up.
        assert!(
            ms(*wait) >= backoff * 8 / 10 && ms(*wait) <= backoff * 12 / 10 + 300,
            "wait {i} after the refusal: {waits:?}"
        );
    }
    let o = relay.stop();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

/// A deferred trigger on the put-back of aggregate 'b' (a refused event: attempts > 0), which
/// fires at the batch's COMMIT and runs `body`.
fn at_commit_of_a_put_back(env: &Env, body: &str) {
    env.sql(&format!(
        "CREATE FUNCTION at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN {body} RETURN NULL; END $$;
         CREATE CONSTRAINT TRIGGER at_commit AFTER INSERT ON outbox DEFERRABLE INITIALLY DEFERRED
             FOR EACH ROW WHEN (NEW.aggregate_id = 'b' AND NEW.attempts > 0) EXECUTE FUNCTION at_commit();"
    ));
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         VALUES ('order', 'a', 'order.paid', '{}'), ('order', 'b', 'order.paid', '{}')",
    );
}

fn refusing_b() -> Webhook {
    Webhook::start(Answer::By(Arc::new(|r, _| {
        if body(r)["aggregate_id"] == "b" {
            server_error()
        } else {
            no_content()
        }
    })))
}

/// The relay failed, saying that the `delivered` events of a batch whose commit the server
/// refused will be published again.
fn assert_refused_commit(o: &std::process::Output, delivered: usize) {
    assert_ne!(code(o), 0, "{}", stderr(o));
    let err = stderr(o);
    assert!(
        err.contains(&format!("could not record {delivered} delivered events"))
            && err.contains("they will be published again"),
        "{err}"
    );
}

/// When the COMMIT certainly failed (the server answered it with an error), the delivered
/// events *will* be published again — and they are still in the outbox.
#[test]
fn a_commit_refused_by_the_server_says_the_events_will_be_published_again() {
    let env = migrated();
    at_commit_of_a_put_back(&env, "RAISE EXCEPTION 'no put-backs today';");
    let hook = refusing_b();
    let o = env.run(&["relay", "--once", "--sink", &hook.url()]);
    assert_refused_commit(&o, 1);
    assert_eq!(outbox_count(&env), 2, "rolled back: 'a' is still there");
}

/// A full batch's COMMIT goes out with the next claim, unanswered (see src/relay/commit.rs).
/// When the server refuses it, the relay must learn that before it publishes anything the
/// next claim found: that claim ran after the rollback, so it found the same events again.
/// They come out once, the relay says they will be published again, and all are still there.
#[test]
fn a_full_batchs_commit_refused_after_the_next_claim_went_out_stops_before_publishing_more() {
    let env = migrated();
    env.sql(
        "CREATE FUNCTION at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'no commits today'; END $$;
         CREATE CONSTRAINT TRIGGER at_commit AFTER DELETE ON outbox DEFERRABLE INITIALLY DEFERRED
             FOR EACH ROW WHEN (OLD.aggregate_id = '1') EXECUTE FUNCTION at_commit();",
    );
    insert_events(&env, 20, 10, 1);
    let o = env.run(&["relay", "--once", "--batch", "10", "--sink", "stdout"]);
    assert_refused_commit(&o, 10);
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    let ids: Vec<&str> = out.lines().collect();
    assert_eq!(ids.len(), 10, "the first batch, once: {out}");
    assert_eq!(
        outbox_count(&env),
        20,
        "rolled back: every event is still there"
    );
}

/// When the connection breaks while the COMMIT is out and no answer comes back, nobody
/// knows whether it went through: "may", never "will". The relay talks to PostgreSQL through a
/// TCP proxy that passes the batch's COMMIT on and then cuts the relay off: the commit does go
/// through (the outbox is empty), and the relay must not claim otherwise.
#[test]
fn a_commit_whose_answer_is_lost_says_the_events_may_be_published_again() {
    let env = migrated();
    insert_events(&env, 3, 3, 1);
    let hook = Webhook::start(no_content());
    let port = cut_after_the_batchs_commit();
    let url = format!("host=127.0.0.1 port={port} dbname=leasectl_test sslmode=disable");
    let o = env
        .command_at(&url)
        .args(["relay", "--once", "--sink", &hook.url()])
        .output()
        .unwrap();
    assert_eq!(code(&o), 69, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("could not record 3 delivered events")
            && err.contains("the commit's outcome is unknown: they may be published again"),
        "{err}"
    );
    wait_for("the commit to be visible", || outbox_count(&env) == 0);
}

/// A TCP proxy to PostgreSQL on 127.0.0.1:5432 that, once a client sent the relay's claim
/// (`RETURNING o.seq`), passes its next `COMMIT` to the server and then closes the client's
/// connection without an answer. Returns its port; it runs on a thread of its own.
fn cut_after_the_batchs_commit() -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let runtime = runtime();
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            loop {
                let (client, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let server = tokio::net::TcpStream::connect("127.0.0.1:5432")
                        .await
                        .unwrap();
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let back = tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut sr, &mut cw).await;
                    });
                    let mut claimed = false;
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let n = match cr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        let text = String::from_utf8_lossy(&buf[..n]);
                        claimed |= text.contains("RETURNING o.seq");
                        let commit = claimed && text.contains("COMMIT");
                        if commit {
                            back.abort(); // the answer never reaches the client
                        }
                        if sw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        if commit {
                            // The server runs the COMMIT; the client's side closes (both
                            // halves drop here), and it never hears back.
                            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
                            break;
                        }
                    }
                });
            }
        });
    });
    port
}

/// `outbox retry ID` on an event inside a running batch waited for the batch and then said
/// "no event … already delivered or discarded?" (exit 1) while the event was back, retrying.
/// Now it says the event is being delivered, waits, and re-queues the put-back event.
#[test]
fn outbox_retry_of_an_event_in_a_running_batch_says_so_and_requeues_it() {
    let env = migrated();
    insert_events(&env, 1, 1, 1);
    let id = env.scalar("SELECT id FROM outbox");
    let hook = Webhook::start(Answer::Late(
        std::time::Duration::from_secs(4),
        Box::new(server_error()),
    ));
    let relay = Relay::spawn(&env, &["--sink", &hook.url(), "--timeout", "20s"]);
    wait_for("the event to be in flight", || hook.count() >= 1);
    hook.set(no_content());
    let o = env.run(&["outbox", "retry", &id]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("is being delivered by a relay right now"),
        "{err}"
    );
    assert!(err.contains(&format!("event {id} is due now")), "{err}");
    wait_for("the retried event to be delivered", || {
        outbox_count(&env) == 0
    });
    let o = relay.stop();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(hook.count(), 2, "the refused try, then the re-queued one");
}

/// A NATS outage was silent until `--timeout` ran out on a delivery (async-nats
/// reconnects by itself and a publication waits for it). The sink now warns once when the
/// connection drops and once when it is back — long before the `--timeout` of 60 s here. The
/// outage is a TCP proxy in front of NATS that is cut (every connection closed, nothing
/// listening) and restored on the same port.
#[test]
fn a_nats_outage_is_warned_when_the_connection_drops_and_when_it_is_back() {
    let env = migrated();
    // A multi-thread runtime: the proxy's tasks run on its workers while the test blocks.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let proxy = rt.block_on(Proxy::start("127.0.0.1:4222"));
    let subject = unique("leasectl_outage_test_");
    let stream = unique("LEASECTL_OUTAGE_TEST_");
    let _cleanup = StreamGuard(stream.clone());
    let sink = format!(
        "nats://127.0.0.1:{}?subject={subject}&stream={stream}",
        proxy.port
    );
    insert_events(&env, 20, 4, 1);
    let relay = Relay::spawn(&env, &["--sink", &sink, "--timeout", "60s"]);
    wait_for("the first events delivered", || outbox_count(&env) == 0);

    let cut = std::time::Instant::now();
    rt.block_on(proxy.cut());
    relay.wait_for_stderr("lost the connection to the server");
    let noticed = cut.elapsed();
    assert!(
        noticed < std::time::Duration::from_secs(30),
        "the outage was said only after {noticed:?}"
    );
    // Events inserted meanwhile wait for the connection (async-nats keeps them).
    insert_events(&env, 20, 4, 21);
    rt.block_on(proxy.restore());
    relay.wait_for_stderr("connected again after");
    wait_for("the events of the outage delivered", || {
        outbox_count(&env) == 0
    });

    let o = relay.stop();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let err = stderr(&o);
    let lost: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("lost the connection"))
        .collect();
    assert_eq!(lost.len(), 1, "warned once per outage: {err}");
    assert!(
        lost[0].starts_with("leasectl: warning: ")
            && lost[0].contains(&format!("127.0.0.1:{}", proxy.port)),
        "{}",
        lost[0]
    );
    assert_eq!(
        err.lines()
            .filter(|l| l.contains("connected again"))
            .count(),
        1,
        "{err}"
    );
}

/// A sink that answers nobody (a webhook black hole: requests accepted, never answered) is down,
/// not refusing: the relay backs off and charges nothing, however long it lasts. Before, every
/// event was charged an attempt per `--timeout` (a black-holed broker: 334 in 12 s), so a long
/// outage turned healthy events dead.
#[test]
fn a_sink_that_answers_nobody_charges_no_attempt() {
    let env = migrated();
    insert_events(&env, 20, 4, 0);
    let hook = Webhook::start(Answer::Silence);
    let relay = Relay::spawn(
        &env,
        &[
            "--sink",
            &hook.url(),
            "--timeout",
            "300ms",
            "--max-attempts",
            "2",
            "--poll",
            "100ms",
        ],
    );
    // Three rounds of requests nobody answered, each at least one per aggregate.
    wait_for("three rounds of unanswered requests", || hook.count() >= 12);
    let o = relay.stop();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(
        env.scalar("SELECT max(attempts) || '/' || count(*) FILTER (WHERE dead_at IS NOT NULL) FROM outbox"),
        "0/0",
        "{}",
        stderr(&o)
    );
    assert!(stderr(&o).contains("is unavailable"), "{}", stderr(&o));
}

/// …while a receiver that hangs on one aggregate's requests and answers the others' is refusing
/// that aggregate: its head is charged whenever others were answered while it hung, and dead
/// after `--max-attempts`, as the others drain (slowly here, so that they are still there when it
/// comes back: with nothing else to deliver, a silence cannot be told from an outage).
#[test]
fn a_webhook_hanging_on_one_aggregate_charges_only_that_one() {
    let env = migrated();
    insert_events(&env, 600, 20, 0);
    let hook = Webhook::start(Answer::By(Arc::new(|r, _| {
        if body(r)["aggregate_id"] == "7" {
            Answer::Silence
        } else {
            Answer::Late(
                std::time::Duration::from_millis(100),
                Box::new(no_content()),
            )
        }
    })));
    let relay = Relay::spawn(
        &env,
        &[
            "--sink",
            &hook.url(),
            "--timeout",
            "500ms",
            "--max-attempts",
            "2",
            "--poll",
            "100ms",
        ],
    );
    wait_for("'7' to go dead", || {
        env.scalar("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL") == "1"
    });
    wait_for("the others to drain", || {
        env.scalar("SELECT count(*) FROM outbox WHERE aggregate_id <> '7'") == "0"
    });
    let o = relay.stop();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("is dead after 2 attempts"),
        "{}",
        stderr(&o)
    );
    let dead = outbox_list(&env, true);
    assert_eq!(dead["events"][0]["aggregate_id"], "7", "{dead}");
    let error = dead["events"][0]["last_error"].as_str().unwrap();
    assert!(error.contains("no response within 500ms"), "{error}");
}
