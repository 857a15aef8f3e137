//! `leasectl relay` end to end against real sinks: RabbitMQ and NATS JetStream (the brokers of
//! `sink_brokers.rs`) and a webhook (the HTTP peer of `sink_local.rs`, served from a thread of
//! its own since leasectl runs as a separate process).
//!
//! Events are inserted by SQL, as an application's own transaction would; every test uses its
//! own schema, exchange, queue, subject, stream and port, so the tests run in parallel, and
//! deletes the broker objects it created (even when it fails).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::process::{Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::{FieldTable, ShortString};
use serde_json::Value;

use crate::common::*;
use crate::events::*;
use crate::sink_brokers::{
    amqp_url, bound_queue, delete_exchange, jetstream, msg_id, nats_url, rabbit, stream_messages,
    unique,
};
use crate::sink_local::{closed_port, status, Answer, Peer, Request};

// ---------------------------------------------------------------------------------------------
// The relay.

/// A continuous `leasectl -v relay ARGS…`, killed if the test ends without stopping it.
pub(crate) struct Relay(Option<Watched>);

impl Relay {
    pub(crate) fn spawn(env: &Env, args: &[&str]) -> Relay {
        let child = env
            .command()
            .arg("-v")
            .arg("relay")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        Relay(Some(Watched::new(child)))
    }

    fn watched(&self) -> &Watched {
        self.0.as_ref().unwrap()
    }

    pub(crate) fn stderr(&self) -> String {
        self.watched().stderr()
    }

    pub(crate) fn wait_for_stderr(&self, needle: &str) {
        self.watched().wait_for_stderr(needle);
    }

    /// SIGTERM, then the relay's output once it exited.
    pub(crate) fn stop(mut self) -> Output {
        let watched = self.0.take().unwrap();
        kill(watched.child.id(), libc::SIGTERM);
        watched.finish()
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if let Some(mut w) = self.0.take() {
            let _ = w.child.kill();
            let _ = w.child.wait();
        }
    }
}

/// `leasectl relay --once --sink SINK` to completion, asserting exit 0.
fn relay_once(env: &Env, sink: &str) -> Output {
    let o = env.run(&["relay", "--once", "--sink", sink]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    o
}

// ---------------------------------------------------------------------------------------------
// RabbitMQ

fn amqp_sink(exchange: &str) -> String {
    format!("{}?exchange={exchange}", amqp_url())
}

/// Deletes the exchange when dropped, on a connection of its own (also when the test fails).
pub(crate) struct ExchangeGuard(pub(crate) String);

impl Drop for ExchangeGuard {
    fn drop(&mut self) {
        runtime().block_on(async {
            let (_conn, channel) = rabbit().await;
            delete_exchange(&channel, &self.0).await;
        });
    }
}

/// How many messages `queue` holds (a passive declaration).
async fn queue_length(channel: &lapin::Channel, queue: &ShortString) -> u32 {
    channel
        .queue_declare(
            queue.clone(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap()
        .message_count()
}

/// Consumes exactly `count` messages from `queue`, in queue order; then the queue must be empty.
pub(crate) async fn consume(
    channel: &lapin::Channel,
    queue: &ShortString,
    count: usize,
) -> Vec<lapin::message::Delivery> {
    let mut consumer = channel
        .basic_consume(
            queue.clone(),
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut seen = Vec::with_capacity(count);
    while seen.len() < count {
        let d = tokio::time::timeout(PATIENCE, consumer.next())
            .await
            .unwrap_or_else(|_| panic!("only {} of {count} messages arrived", seen.len()))
            .expect("consumer ended")
            .unwrap();
        seen.push(d);
    }
    assert_eq!(queue_length(channel, queue).await, 0, "more than {count}");
    seen
}

fn message_id(d: &lapin::message::Delivery) -> String {
    d.properties
        .message_id()
        .as_ref()
        .map(|s| s.to_string())
        .unwrap_or_default()
}

#[test]
fn relay_to_rabbitmq_delivers_every_event_with_its_id_as_message_id() {
    let env = migrated();
    insert_events(&env, 2_000, 20, 1);
    let rows = snapshot(&env);
    let rows_by_id = by_id(&rows);
    let rt = runtime();
    let exchange = unique("leasectl-relay-test-");
    let (_conn, channel) = rt.block_on(rabbit());
    // Bound before relaying: an unroutable event would be refused, not delivered.
    let queue = rt.block_on(bound_queue(&channel, &exchange, "#"));
    let _cleanup = ExchangeGuard(exchange.clone());

    relay_once(&env, &amqp_sink(&exchange));
    assert_eq!(outbox_count(&env), 0, "delivered events must be deleted");

    // Publisher confirms: everything is in the queue once the relay has exited.
    assert_eq!(rt.block_on(queue_length(&channel, &queue)), 2_000);
    let deliveries = rt.block_on(consume(&channel, &queue, 2_000));
    let mut events = Vec::new();
    for d in &deliveries {
        let v = assert_published_form(&d.data, &rows_by_id);
        assert_eq!(
            message_id(d),
            v["id"].as_str().unwrap(),
            "message id = event id"
        );
        assert_eq!(d.exchange.as_str(), exchange);
        assert_eq!(d.routing_key.as_str(), v["type"].as_str().unwrap());
        assert_eq!(*d.properties.delivery_mode(), Some(2), "persistent");
        events.push(v);
    }
    let got: HashSet<String> = deliveries.iter().map(message_id).collect();
    let expected: HashSet<String> = rows.iter().map(|r| r.id.clone()).collect();
    assert_eq!(got.len(), 2_000, "a message was delivered twice");
    assert_same_ids(&got, &expected, "message ids");
    assert_per_aggregate_order(&events);
}

#[test]
fn relay_to_rabbitmq_without_a_bound_queue_charges_attempts_not_deliveries() {
    let env = migrated();
    // One event per aggregate: each is its aggregate's head, so each is tried (and dies).
    insert_events(&env, 10, 10, 1);
    let ids = outbox_ids(&env);
    let exchange = unique("leasectl-relay-test-");
    let _cleanup = ExchangeGuard(exchange.clone());
    // Nothing bound: the relay declares the exchange and every event comes back unroutable.
    let relay = Relay::spawn(
        &env,
        &["--sink", &amqp_sink(&exchange), "--max-attempts", "2"],
    );
    wait_for("every event to be dead (or gone)", || {
        outbox_count(&env) < 10 || outbox_list(&env, true)["total"] == 10
    });
    assert_eq!(outbox_count(&env), 10, "a refused event was deleted");
    let doc = outbox_list(&env, true);
    let mut dead = HashSet::new();
    for e in doc["events"].as_array().unwrap() {
        assert_eq!(e["state"], "dead", "{e}");
        assert_eq!(e["attempts"], 2, "{e}");
        let error = e["last_error"].as_str().unwrap();
        assert!(error.contains("unroutable"), "{error}");
        dead.insert(e["id"].as_str().unwrap().to_owned());
    }
    assert_same_ids(&dead, &ids, "dead events");
    let err = relay.stderr();
    assert!(err.contains("(attempt 1 of 2)"), "{err}");
    assert!(err.contains("is dead after 2 attempts"), "{err}");
    let o = relay.stop();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

#[test]
fn an_unroutable_event_mid_aggregate_holds_back_its_later_events_among_many_in_flight() {
    let env = migrated();
    // 400 other aggregates in the same batch, so the refused event's publication shares its
    // channel with hundreds of others in flight (1000 events per batch, 1024 aggregates at once).
    insert_events(&env, 400, 400, 1);
    // Aggregate X: created (routed), then one nobody listens to, then two more routed ones.
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', 'X', t, jsonb_build_object('n', n)
           FROM unnest(ARRAY['order.created', 'nobody.listens', 'order.paid', 'order.shipped'])
                WITH ORDINALITY AS u(t, n)
          ORDER BY n",
    );
    let x: Vec<String> = env
        .sql("SELECT id::text FROM outbox WHERE aggregate_id = 'X' ORDER BY seq")
        .into_iter()
        .map(|r| r[0].clone().unwrap())
        .collect();
    let rt = runtime();
    let exchange = unique("leasectl-relay-test-");
    let (_conn, channel) = rt.block_on(rabbit());
    let queue = rt.block_on(bound_queue(&channel, &exchange, "order.*"));
    let _cleanup = ExchangeGuard(exchange.clone());

    let o = env.run(&[
        "relay",
        "--once",
        "--batch",
        "1000",
        "--sink",
        &amqp_sink(&exchange),
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stderr(&o).contains("unroutable"), "{}", stderr(&o));

    // Everything else and X's first event arrived; X's later events were never published.
    let deliveries = rt.block_on(consume(&channel, &queue, 401));
    let got: HashSet<String> = deliveries.iter().map(message_id).collect();
    assert!(got.contains(&x[0]), "X's first event was not delivered");
    for later in &x[1..] {
        assert!(!got.contains(later), "event {later} of X reached the queue");
    }
    // The refused event was charged (a second time if its 1 s retry came due before `--once`
    // finished); the ones behind it wait, never tried, in the outbox.
    let rows = env.sql("SELECT id::text, attempts, last_error FROM outbox ORDER BY seq");
    let left: Vec<&String> = rows.iter().map(|r| r[0].as_ref().unwrap()).collect();
    assert_eq!(left, x[1..].iter().collect::<Vec<_>>());
    assert_ne!(rows[0][1].as_deref(), Some("0"));
    assert!(rows[0][2]
        .as_deref()
        .unwrap_or_default()
        .contains("unroutable"));
    assert_eq!(rows[1][1].as_deref(), Some("0"));
    assert_eq!(rows[2][1].as_deref(), Some("0"));
}

#[test]
fn sigterm_stops_a_relay_mid_rabbitmq_batch_with_exit_0_and_nothing_lost() {
    let env = migrated();
    insert_events(&env, 10_000, 10, 1);
    let all = outbox_ids(&env);
    let rt = runtime();
    let exchange = unique("leasectl-relay-test-");
    let (_conn, channel) = rt.block_on(rabbit());
    let queue = rt.block_on(bound_queue(&channel, &exchange, "#"));
    let _cleanup = ExchangeGuard(exchange.clone());

    let relay = Relay::spawn(&env, &["--sink", &amqp_sink(&exchange), "--batch", "50"]);
    wait_for("some events in the queue", || {
        rt.block_on(queue_length(&channel, &queue)) > 200
    });
    let o = relay.stop();
    assert_eq!(code(&o), 0, "{}", stderr(&o));

    let left = outbox_ids(&env);
    assert!(!left.is_empty(), "the relay should have stopped early");
    let published = rt.block_on(queue_length(&channel, &queue)) as usize;
    let deliveries = rt.block_on(consume(&channel, &queue, published));
    let ids: Vec<String> = deliveries.iter().map(message_id).collect();
    // Nothing lost and nothing published twice: what is left is exactly what was not published.
    assert_eq!(
        ids.len() + left.len(),
        all.len(),
        "lost or duplicated events"
    );
    let mut union: HashSet<String> = ids.into_iter().collect();
    union.extend(left);
    assert_same_ids(&union, &all, "published or left");
    let events: Vec<Value> = deliveries
        .iter()
        .map(|d| serde_json::from_slice(&d.data).unwrap())
        .collect();
    assert_per_aggregate_order(&events);
}

/// Without `?exchange=`, the relay publishes to this deployment's own exchange,
/// `leasectl.DATABASE.SCHEMA`, and says so when it starts: a first `--sink amqp://…` on a shared
/// vhost used to publish to `leasectl`, into whatever another team had bound to it.
#[test]
fn amqp_without_an_exchange_publishes_to_this_deployments_own_and_says_so() {
    let env = migrated();
    insert_events(&env, 30, 3, 1);
    let exchange = format!(
        "leasectl.{}.{}",
        env.scalar("SELECT current_database()"),
        env.schema
    );
    let rt = runtime();
    let (_conn, channel) = rt.block_on(rabbit());
    let queue = rt.block_on(bound_queue(&channel, &exchange, "#"));
    let _cleanup = ExchangeGuard(exchange.clone());

    let o = relay_once(&env, &amqp_url());
    assert_eq!(outbox_count(&env), 0);
    assert_eq!(rt.block_on(queue_length(&channel, &queue)), 30);
    let err = stderr(&o);
    assert!(
        err.contains(&format!(
            "publishing to \"{exchange}\", this deployment's own"
        )),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
}

/// `--sink amqp://` named no broker: the URI's defaults made it localhost, as guest, without a
/// word. It is a usage error now, before anything connects.
#[test]
fn an_amqp_url_without_a_host_is_a_usage_error() {
    let env = Env::new();
    for sink in ["amqp://", "amqp:///%2f", "amqps://guest:s3cret@/"] {
        let o = env.run(&["relay", "--once", "--sink", sink]);
        assert_one_line_error(&o, 2, "names no host");
        assert!(!stderr(&o).contains("s3cret"), "{}", stderr(&o));
    }
}

/// A wrong password: one line naming the sink once (it was named twice, the sink's own message
/// repeating what the relay put in front of it).
#[test]
fn a_wrong_amqp_password_names_the_sink_once() {
    let env = migrated();
    insert_events(&env, 3, 1, 1);
    let url = amqp_url().replacen("guest:guest@", "guest:not-the-password@", 1);
    assert_ne!(
        url,
        amqp_url(),
        "the test broker's URL logs in as guest:guest"
    );
    let sink = format!("{url}?exchange={}", unique("leasectl-relay-test-"));
    let o = env.run(&["relay", "--once", "--sink", &sink]);
    assert_one_line_error(&o, 69, "ACCESS_REFUSED");
    let err = stderr(&o);
    assert_eq!(err.matches("guest:***@").count(), 1, "{err}");
    assert!(!err.contains("not-the-password"), "{err}");
    assert_eq!(outbox_count(&env), 3, "nothing charged, nothing lost");
    assert_eq!(
        env.scalar("SELECT max(attempts) FROM outbox"),
        "0",
        "an unreachable sink charges no attempt"
    );
}

// ---------------------------------------------------------------------------------------------
// NATS JetStream

/// Deletes the stream when dropped, on a connection of its own (also when the test fails).
pub(crate) struct StreamGuard(pub(crate) String);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        runtime().block_on(async {
            let _ = jetstream().await.delete_stream(&self.0).await;
        });
    }
}

#[test]
fn relay_to_jetstream_stores_every_event_once_even_when_a_batch_is_republished() {
    let env = migrated();
    insert_events(&env, 500, 10, 1);
    // What a relay killed after publishing but before committing leaves behind: the same rows.
    env.sql(
        "CREATE TABLE snapshot AS
         SELECT seq, aggregate_type, aggregate_id, type, payload, id FROM outbox",
    );
    let rows = snapshot(&env);
    let rows_by_id = by_id(&rows);
    let expected: HashSet<String> = rows.iter().map(|r| r.id.clone()).collect();
    let subject = unique("leasectl_relay_test_");
    let stream = unique("LEASECTL_RELAY_TEST_");
    let _cleanup = StreamGuard(stream.clone());
    let sink = format!("{}?subject={subject}&stream={stream}", nats_url());
    let rt = runtime();
    let js = rt.block_on(jetstream());

    let check_stream = || {
        let messages = rt.block_on(stream_messages(&js, &stream));
        assert_eq!(messages.len(), 500);
        let mut events = Vec::new();
        for m in &messages {
            let v = assert_published_form(&m.payload, &rows_by_id);
            assert_eq!(
                msg_id(m),
                v["id"].as_str().unwrap(),
                "Nats-Msg-Id = event id"
            );
            assert_eq!(
                m.subject.as_str(),
                format!("{subject}.{}", v["type"].as_str().unwrap())
            );
            events.push(v);
        }
        let ids: Vec<String> = messages.iter().map(msg_id).collect();
        let unique_ids: HashSet<String> = ids.iter().cloned().collect();
        assert_eq!(unique_ids.len(), ids.len(), "an event is stored twice");
        assert_same_ids(&unique_ids, &expected, "stored events");
        assert_per_aggregate_order(&events);
        messages.last().unwrap().sequence
    };

    relay_once(&env, &sink);
    assert_eq!(outbox_count(&env), 0);
    let last = check_stream();

    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, id)
         SELECT aggregate_type, aggregate_id, type, payload, id FROM snapshot ORDER BY seq",
    );
    assert_same_ids(&outbox_ids(&env), &expected, "re-inserted events");
    assert_eq!(
        env.scalar("SELECT count(*) FROM outbox WHERE seq <= (SELECT max(seq) FROM snapshot)"),
        "0",
        "the events come back with new seqs"
    );
    relay_once(&env, &sink);
    assert_eq!(outbox_count(&env), 0, "a duplicate ack counts as delivered");
    assert_eq!(
        check_stream(),
        last,
        "the stream stored a republished event again"
    );
}

// ---------------------------------------------------------------------------------------------
// Webhooks

/// A [`Peer`] serving from a thread of its own (with its own runtime), so that the test thread
/// can block on leasectl; stopped when dropped.
pub(crate) struct Webhook {
    addr: SocketAddr,
    requests: Arc<Mutex<Vec<Request>>>,
    answer: Arc<Mutex<Answer>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

type PeerHandles = (SocketAddr, Arc<Mutex<Vec<Request>>>, Arc<Mutex<Answer>>);

impl Webhook {
    pub(crate) fn start(answer: Answer) -> Webhook {
        Webhook::start_at("127.0.0.1:0".parse().unwrap(), answer)
    }

    fn start_at(addr: SocketAddr, answer: Answer) -> Webhook {
        let (started, handles) = std::sync::mpsc::channel::<PeerHandles>();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            runtime().block_on(async move {
                let peer = Peer::start_at(addr, answer).await;
                started
                    .send((peer.addr, peer.requests.clone(), peer.answer.clone()))
                    .unwrap();
                let _ = stopped.await;
            });
        });
        let (addr, requests, answer) = handles.recv().expect("the webhook peer did not start");
        Webhook {
            addr,
            requests,
            answer,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    pub(crate) fn set(&self, answer: Answer) {
        *self.answer.lock().unwrap() = answer;
    }

    /// Every request so far, in arrival order.
    pub(crate) fn requests(&self) -> Vec<Request> {
        self.requests.lock().unwrap().clone()
    }

    pub(crate) fn count(&self) -> usize {
        self.requests.lock().unwrap().len()
    }
}

impl Drop for Webhook {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

pub(crate) fn no_content() -> Answer {
    status(204, "No Content", "")
}

pub(crate) fn server_error() -> Answer {
    status(500, "Internal Server Error", "")
}

pub(crate) fn key(r: &Request) -> String {
    r.header("idempotency-key")
        .expect("no Idempotency-Key")
        .to_owned()
}

pub(crate) fn body(r: &Request) -> Value {
    serde_json::from_slice(&r.body).unwrap()
}

#[test]
fn relay_to_a_webhook_posts_each_event_with_its_idempotency_key() {
    let env = migrated();
    insert_events(&env, 600, 20, 1);
    let rows = snapshot(&env);
    let rows_by_id = by_id(&rows);
    let hook = Webhook::start(no_content());
    relay_once(&env, &hook.url());
    assert_eq!(outbox_count(&env), 0);

    let requests = hook.requests();
    assert_eq!(requests.len(), 600);
    let mut events = Vec::new();
    for r in &requests {
        assert_eq!(r.method, "POST");
        assert_eq!(r.target, "/hook");
        assert_eq!(r.header("content-type"), Some("application/json"));
        let v = assert_published_form(&r.body, &rows_by_id);
        assert_eq!(
            key(r),
            v["id"].as_str().unwrap(),
            "Idempotency-Key = event id"
        );
        events.push(v);
    }
    let keys: HashSet<String> = requests.iter().map(key).collect();
    assert_eq!(keys.len(), 600, "an event was posted twice");
    let expected: HashSet<String> = rows.iter().map(|r| r.id.clone()).collect();
    assert_same_ids(&keys, &expected, "Idempotency-Keys");
    assert_per_aggregate_order(&events);
}

#[test]
fn a_stopped_webhook_that_comes_back_gets_everything_and_no_attempt_is_charged() {
    let env = migrated();
    insert_events(&env, 200, 10, 1);
    let ids = outbox_ids(&env);
    let port = closed_port();
    let url = format!("http://127.0.0.1:{port}/hook");
    let relay = Relay::spawn(&env, &["--sink", &url, "--poll", "200ms"]);
    wait_for("the relay to find the webhook unavailable", || {
        let err = relay.stderr();
        err.contains("is unavailable") || err.contains("failed (attempt")
    });
    assert!(
        !relay.stderr().contains("failed (attempt"),
        "{}",
        relay.stderr()
    );
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM outbox
              WHERE attempts = 0 AND last_error IS NULL AND dead_at IS NULL"
        ),
        "200",
        "an unreachable webhook must not cost events attempts"
    );

    // Back on the same port, soon: the relay retries after 1s (then 2s, 4s…).
    let hook = Webhook::start_at(([127, 0, 0, 1], port).into(), no_content());
    wait_for("every event to reach the webhook", || hook.count() >= 200);
    relay.wait_for_stderr("reachable again");
    wait_for("the outbox to be empty", || outbox_count(&env) == 0);
    let keys: Vec<String> = hook.requests().iter().map(key).collect();
    assert_eq!(keys.len(), 200, "an event was posted twice");
    assert_same_ids(&keys, &ids, "Idempotency-Keys");
    assert_per_aggregate_order(&hook.requests().iter().map(body).collect::<Vec<_>>());
    let o = relay.stop();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(!err.contains("failed (attempt"), "{err}");
    assert!(!err.contains("is dead"), "{err}");
}

#[test]
fn a_webhook_failing_twice_then_succeeding_delivers_the_event() {
    let env = migrated();
    insert_events(&env, 1, 1, 1);
    let id = env.scalar("SELECT id FROM outbox");
    let hook = Webhook::start(Answer::By(Arc::new(|_, n| {
        if n < 2 {
            server_error()
        } else {
            no_content()
        }
    })));
    let relay = Relay::spawn(&env, &["--sink", &hook.url()]);
    wait_for("the third request", || hook.count() >= 3);
    wait_for("the outbox to be empty", || outbox_count(&env) == 0);
    let requests = hook.requests();
    assert_eq!(requests.len(), 3, "delivered on the third request, once");
    for r in &requests {
        assert_eq!(key(r), id, "every try carries the same Idempotency-Key");
    }
    // Retries back off 1s then 2s, ±20%. The lower bounds leave 100ms for the relay's clock
    // (the next attempt is timed from its transaction's start, a little before the request);
    // the upper ones are generous but well below the 5s poll, which must not be what woke it.
    let gaps = [
        requests[1].at - requests[0].at,
        requests[2].at - requests[1].at,
    ];
    assert!(
        gaps[0] >= Duration::from_millis(700) && gaps[0] <= Duration::from_millis(2_700),
        "{gaps:?}"
    );
    assert!(
        gaps[1] >= Duration::from_millis(1_500) && gaps[1] <= Duration::from_millis(3_900),
        "{gaps:?}"
    );
    let o = relay.stop();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("(attempt 1 of 10): HTTP 500"), "{err}");
    assert!(err.contains("(attempt 2 of 10): HTTP 500"), "{err}");
    assert!(!err.contains("attempt 3 of"), "{err}");
}

#[test]
fn a_webhook_that_always_refuses_one_aggregate_kills_only_that_aggregate() {
    let env = migrated();
    // Three rounds over five aggregates, interleaved: n = 0…14.
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', (ARRAY['a', 'b', 'bad', 'c', 'd'])[g % 5 + 1], 'order.paid',
                jsonb_build_object('n', g)
           FROM generate_series(0, 14) g",
    );
    let rows = snapshot(&env);
    let bad: Vec<String> = rows
        .iter()
        .filter(|r| r.aggregate_id == "bad")
        .map(|r| r.id.clone())
        .collect();
    let good: HashSet<String> = rows
        .iter()
        .filter(|r| r.aggregate_id != "bad")
        .map(|r| r.id.clone())
        .collect();
    let hook = Webhook::start(Answer::By(Arc::new(|r, _| {
        if body(r)["aggregate_id"] == "bad" {
            server_error()
        } else {
            no_content()
        }
    })));
    let relay = Relay::spawn(&env, &["--sink", &hook.url(), "--max-attempts", "3"]);
    wait_for("the oldest 'bad' event to die", || {
        outbox_list(&env, true)["total"] != 0
    });
    let dead = outbox_list(&env, true);
    assert_eq!(dead["total"], 1, "{dead}");
    let d = &dead["events"][0];
    assert_eq!(d["id"], bad[0].as_str(), "the head of 'bad' dies");
    assert_eq!(d["attempts"], 3);
    let error = d["last_error"].as_str().unwrap();
    assert!(error.contains("HTTP 500"), "{error}");

    let keys_of = |agg_bad: bool| -> Vec<String> {
        hook.requests()
            .iter()
            .filter(|r| (body(r)["aggregate_id"] == "bad") == agg_bad)
            .map(key)
            .collect()
    };
    wait_for("the other aggregates' events", || {
        keys_of(false).len() >= 12
    });
    let delivered: Vec<String> = keys_of(false);
    assert_eq!(delivered.len(), 12, "posted twice");
    assert_same_ids(&delivered, &good, "the other aggregates' events");
    assert_eq!(
        keys_of(true),
        vec![bad[0].clone(); 3],
        "later 'bad' events were posted"
    );

    let listed = outbox_list(&env, false);
    assert_eq!(listed["total"], 3, "{listed}");
    let left: Vec<(&str, &str)> = listed["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["id"].as_str().unwrap(), e["state"].as_str().unwrap()))
        .collect();
    assert_eq!(
        left,
        [
            (bad[0].as_str(), "dead"),
            (bad[1].as_str(), "blocked"),
            (bad[2].as_str(), "blocked")
        ]
    );

    hook.set(no_content());
    let o = env.run(&["outbox", "retry", &bad[0]]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    wait_for("the 'bad' events to be delivered", || {
        outbox_count(&env) == 0
    });
    let mut expected = vec![bad[0].clone(); 4];
    expected.extend_from_slice(&bad[1..]);
    assert_eq!(keys_of(true), expected, "re-queued, then in order");
    let o = relay.stop();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("is dead after 3 attempts"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn relay_once_exits_1_with_the_count_when_events_went_dead_in_its_pass() {
    // A cron'd `relay --once` must not report success while events died under it.
    let env = migrated();
    insert_events(&env, 3, 3, 1);
    let o = env.run(&[
        "relay",
        "--once",
        "--sink",
        "exec:exit 1",
        "--max-attempts",
        "1",
    ]);
    assert_eq!(code(&o), 1, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("3 events went dead during this pass"),
        "{}",
        stderr(&o)
    );
    assert_eq!(outbox_list(&env, true)["total"], 3);
    // The next pass finds nothing due (dead events wait for an operator): success again.
    relay_once(&env, "exec:exit 1");
}
