//! The broker sinks against a real RabbitMQ and a real NATS JetStream server, no mocks.
//!
//! The brokers come from `LEASECTL_TEST_AMQP_URL` (default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`) and `LEASECTL_TEST_NATS_URL` (default
//! `nats://127.0.0.1:4222`, JetStream enabled). Every test uses exchanges, queues, subjects and
//! streams of its own (uuid-named), so tests run in parallel, and deletes what it created.
//! Results are checked with a consumer of our own (AMQP) or by reading the stream (NATS); the
//! sinks are driven on a current-thread runtime, as the relay drives them.

use std::future::Future;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use futures_util::StreamExt;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};
use leasectl::relay::sink::amqp::{self, Amqp};
use leasectl::relay::sink::nats::{self, Nats};
use leasectl::relay::sink::{DeliveryError, Event, Format, Gate, Sink, SinkOptions, SinkSpec};

use crate::common::PATIENCE;

/// The gate of deliveries made outside a relay's batch: always open.
static ALWAYS: std::sync::LazyLock<Gate> = std::sync::LazyLock::new(Gate::always);

pub(crate) fn amqp_url() -> String {
    std::env::var("LEASECTL_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned())
}

/// The NATS server for the tests; before the first use in a test process, the anchor stream
/// is made sure of ([`anchor`]).
pub(crate) fn nats_url() -> String {
    let url = std::env::var("LEASECTL_TEST_NATS_URL")
        .unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    static ANCHORED: std::sync::Once = std::sync::Once::new();
    ANCHORED.call_once(|| {
        let url = url.clone();
        // On a thread of its own: callers may be inside a runtime already.
        let _ = std::thread::spawn(move || crate::common::runtime().block_on(anchor(&url))).join();
    });
    url
}

/// A file-stored stream that no test deletes. When an account's last file-stored stream is
/// deleted, nats-server removes the account's stream directory, and a stream that a parallel
/// test creates at that moment fails with "mkdir …/jetstream/$G/streams: no such file or
/// directory". With this one always there, the directory stays. Failing to make it is left
/// to the test's own use of the server to report.
async fn anchor(url: &str) {
    let Ok(client) = async_nats::connect(url).await else {
        return;
    };
    let _ = async_nats::jetstream::new(client)
        .get_or_create_stream(async_nats::jetstream::stream::Config {
            name: "LEASECTL_TEST_ANCHOR".to_owned(),
            subjects: vec!["leasectl_test_anchor.>".to_owned()],
            storage: async_nats::jetstream::stream::StorageType::File,
            max_messages: 1,
            ..Default::default()
        })
        .await;
}

/// Runs `f` on a current-thread runtime, like the relay.
fn run<F: Future>(f: F) -> F::Output {
    crate::common::runtime().block_on(f)
}

/// A name no other test (or run) uses: `prefix` plus 12 hex digits.
pub(crate) fn unique(prefix: &str) -> String {
    format!(
        "{prefix}{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

fn opts() -> SinkOptions {
    SinkOptions {
        timeout: Duration::from_secs(10),
        format: Format::Json,
    }
}

/// Event number `n` of aggregate `aggregate`, of type `event_type`.
fn event(aggregate: &str, n: i64, event_type: &str) -> Event {
    Event {
        seq: n,
        id: uuid::Uuid::new_v4(),
        aggregate_type: "order".to_owned(),
        aggregate_id: aggregate.to_owned(),
        event_type: event_type.to_owned(),
        payload: serde_json::json!({"n": n}).to_string(),
        // 2024-01-01T00:00:00Z
        created_at: std::time::UNIX_EPOCH + Duration::from_secs(1_704_067_200),
    }
}

/// The published object for `e` (what `--format json` publishes), parsed from a message body.
fn body_is_spec_object(body: &[u8], e: &Event) {
    let got: serde_json::Value = serde_json::from_slice(body).unwrap();
    let want = serde_json::json!({
        "id": e.id.to_string(),
        "aggregate_type": e.aggregate_type,
        "aggregate_id": e.aggregate_id,
        "type": e.event_type,
        "payload": serde_json::from_str::<serde_json::Value>(&e.payload).unwrap(),
        "created_at": "2024-01-01T00:00:00.000000Z",
    });
    assert_eq!(got, want);
}

/// Events `0..count` of `aggregate`, cycling through a few `prefix.*` types.
fn history(aggregate: &str, count: i64, prefix: &str) -> Vec<Event> {
    let types = ["created", "paid", "shipped"];
    (0..count)
        .map(|n| event(aggregate, n, &format!("{prefix}.{}", types[n as usize % 3])))
        .collect()
}

/// Delivers each history in order, the histories concurrently (as the relay does for several
/// aggregates), and returns every result.
async fn deliver_histories<'a, F, Fut>(histories: &'a [Vec<Event>], deliver: F)
where
    F: Fn(&'a Event) -> Fut,
    Fut: Future<Output = Result<(), DeliveryError>>,
{
    let deliver = &deliver;
    join_all(histories.iter().map(|h| async move {
        for e in h {
            if let Err(err) = deliver(e).await {
                panic!("event {} of {}: {err:?}", e.seq, e.aggregate_id);
            }
        }
    }))
    .await;
}

/// A TCP proxy to a broker that the test can cut (every connection closed, nothing listening,
/// so reconnecting is refused) and restore on the same port: a broker outage, as the sink sees
/// one.
pub(crate) struct Proxy {
    pub(crate) port: u16,
    target: std::net::SocketAddr,
    serving: std::cell::RefCell<Option<tokio::task::JoinHandle<()>>>,
}

impl Proxy {
    pub(crate) async fn start(target: &str) -> Proxy {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = Proxy {
            port: listener.local_addr().unwrap().port(),
            target: target.parse().unwrap(),
            serving: Default::default(),
        };
        proxy.serve(listener);
        proxy
    }

    fn serve(&self, listener: tokio::net::TcpListener) {
        let target = self.target;
        let task = tokio::spawn(async move {
            // Dropped with this task when it is aborted: that closes every proxied connection.
            let mut connections = tokio::task::JoinSet::new();
            while let Ok((mut inbound, _)) = listener.accept().await {
                connections.spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        *self.serving.borrow_mut() = Some(task);
    }

    pub(crate) async fn cut(&self) {
        let serving = self.serving.borrow_mut().take();
        if let Some(task) = serving {
            task.abort();
            let _ = task.await;
        }
    }

    pub(crate) async fn restore(&self) {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", self.port))
            .await
            .unwrap();
        self.serve(listener);
    }
}

/// Delivers `e` until it is delivered, within [`PATIENCE`]; every failure before must be
/// `Unavailable` (an outage must not cost the event attempts).
async fn deliver_once_back<F, Fut>(e: &Event, deliver: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<(), DeliveryError>>,
{
    let deadline = Instant::now() + PATIENCE;
    loop {
        match deliver().await {
            Ok(()) => return,
            Err(DeliveryError::Unavailable(_)) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(err) => panic!("event {} after the outage: {err:?}", e.seq),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// AMQP

/// The test's own connection and channel to RabbitMQ, for declaring and consuming.
pub(crate) async fn rabbit() -> (Connection, lapin::Channel) {
    let conn = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .expect("cannot reach RabbitMQ for tests (LEASECTL_TEST_AMQP_URL)");
    let channel = conn.create_channel().await.unwrap();
    (conn, channel)
}

fn amqp_sink(exchange: &str) -> Amqp {
    let spec = amqp::Spec::parse(&format!("{}?exchange={exchange}", amqp_url())).unwrap();
    Amqp::new(spec, opts())
}

/// Declares `exchange` as the sink would: a durable topic exchange.
async fn declare_exchange(channel: &lapin::Channel, exchange: &str) {
    channel
        .exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
}

/// Declares `exchange` as the sink would and an exclusive queue bound to it with `binding`;
/// returns a consumer of that queue.
pub(crate) async fn bound_consumer(
    channel: &lapin::Channel,
    exchange: &str,
    binding: &str,
) -> lapin::Consumer {
    let queue = bound_queue(channel, exchange, binding).await;
    channel
        .basic_consume(
            queue,
            "".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap()
}

/// Declares `exchange` as the sink would and an exclusive queue (deleted with the channel's
/// connection) bound to it with `binding`; returns the queue's name.
pub(crate) async fn bound_queue(
    channel: &lapin::Channel,
    exchange: &str,
    binding: &str,
) -> ShortString {
    declare_exchange(channel, exchange).await;
    let queue = channel
        .queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    channel
        .queue_bind(
            queue.name().clone(),
            exchange.into(),
            binding.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    queue.name().clone()
}

pub(crate) async fn delete_exchange(channel: &lapin::Channel, exchange: &str) {
    channel
        .exchange_delete(exchange.into(), ExchangeDeleteOptions::default())
        .await
        .unwrap();
}

pub(crate) fn header(d: &lapin::message::Delivery, key: &str) -> Option<String> {
    property_header(&d.properties, key)
}

fn property_header(p: &BasicProperties, key: &str) -> Option<String> {
    match p.headers().as_ref()?.inner().get(key)? {
        AMQPValue::LongString(s) => Some(s.to_string()),
        other => Some(format!("{other:?}")),
    }
}

/// Delivers two aggregates' histories through a sink made from `?exchange=…{query}` and checks
/// each message's routing, order, body and properties; returns each message's properties.
fn amqp_delivers_two_histories(query: &str) -> Vec<(BasicProperties, Event)> {
    run(async {
        let exchange = unique("leasectl-test-");
        let (_conn, channel) = rabbit().await;
        let mut consumer = bound_consumer(&channel, &exchange, "order.*").await;
        let spec = amqp::Spec::parse(&format!("{}?exchange={exchange}{query}", amqp_url()));
        let sink = Amqp::new(spec.unwrap(), opts());
        let histories = vec![history("a", 15, "order"), history("b", 15, "order")];
        deliver_histories(&histories, |e| sink.deliver(e, &ALWAYS)).await;

        let mut seen = Vec::new();
        while seen.len() < 30 {
            let d = tokio::time::timeout(PATIENCE, consumer.next())
                .await
                .expect("a published event never reached the queue")
                .expect("consumer ended")
                .unwrap();
            seen.push(d);
        }
        let aggregate_of = |d: &lapin::message::Delivery| {
            let body: serde_json::Value = serde_json::from_slice(&d.data).unwrap();
            body["aggregate_id"].as_str().unwrap().to_owned()
        };
        let mut checked = Vec::new();
        for h in &histories {
            let got: Vec<_> = seen
                .iter()
                .filter(|d| aggregate_of(d) == h[0].aggregate_id)
                .collect();
            assert_eq!(got.len(), h.len(), "aggregate {}", h[0].aggregate_id);
            for (d, e) in got.into_iter().zip(h) {
                let p = &d.properties;
                assert_eq!(
                    p.message_id().as_ref().map(|s| s.as_str()),
                    Some(e.id.to_string().as_str()),
                    "in order within the aggregate"
                );
                assert_eq!(d.exchange.as_str(), exchange);
                assert_eq!(d.routing_key.as_str(), e.event_type);
                assert_eq!(*p.delivery_mode(), Some(2), "persistent");
                assert_eq!(
                    p.content_type().as_ref().map(|s| s.as_str()),
                    Some("application/json")
                );
                body_is_spec_object(&d.data, e);
                checked.push((p.clone(), e.clone()));
            }
        }
        delete_exchange(&channel, &exchange).await;
        checked
    })
}

#[test]
fn amqp_delivers_every_event_persistent_with_its_id_in_order() {
    for (p, _) in amqp_delivers_two_histories("") {
        // The compact set only: anything more takes the encoded properties past the 64 bytes
        // RabbitMQ keeps on the heap, which costs it about a quarter more CPU per message.
        assert_eq!(p.kind(), &None, "no type property by default");
        assert_eq!(p.app_id(), &None, "no app_id by default");
        assert_eq!(p.headers(), &None, "no headers by default");
    }
}

#[test]
fn amqp_properties_full_adds_type_app_id_and_the_aggregate_headers() {
    for (p, e) in amqp_delivers_two_histories("&properties=full") {
        assert_eq!(
            p.kind().as_ref().map(|s| s.as_str()),
            Some(e.event_type.as_str())
        );
        assert_eq!(p.app_id().as_ref().map(|s| s.as_str()), Some("leasectl"));
        assert_eq!(
            property_header(&p, "aggregate_type").as_deref(),
            Some("order")
        );
        assert_eq!(
            property_header(&p, "aggregate_id").as_deref(),
            Some(e.aggregate_id.as_str())
        );
    }
}

#[test]
fn amqp_unroutable_events_are_rejected_even_among_routable_ones() {
    run(async {
        let exchange = unique("leasectl-test-");
        let (_conn, channel) = rabbit().await;
        // Nothing bound yet: the sink declares the exchange itself, and the event is returned.
        let sink = amqp_sink(&exchange);
        let lonely = event("a", 0, "nobody.listens");
        match sink.deliver(&lonely, &ALWAYS).await {
            Err(DeliveryError::Rejected(m)) => {
                assert!(m.contains("unroutable"), "{m}");
                assert!(m.contains(&exchange) && m.contains("nobody.listens"), "{m}");
            }
            other => panic!("an unroutable event must be rejected, got {other:?}"),
        }

        // Many in flight at once, routable and not: each is judged on its own (a return must
        // never be pinned on another event).
        let mut consumer = bound_consumer(&channel, &exchange, "routed.*").await;
        let events: Vec<Event> = (0..40)
            .map(|n| {
                let t = if n % 2 == 0 { "routed.x" } else { "dropped.x" };
                event(&format!("agg{n}"), n, t)
            })
            .collect();
        let results = join_all(events.iter().map(|e| sink.deliver(e, &ALWAYS))).await;
        for (e, r) in events.iter().zip(&results) {
            if e.event_type.starts_with("routed") {
                assert_eq!(r, &Ok(()), "event {}", e.seq);
            } else {
                assert!(
                    matches!(r, Err(DeliveryError::Rejected(m)) if m.contains("unroutable")),
                    "event {}: {r:?}",
                    e.seq
                );
            }
        }
        for _ in 0..20 {
            let d = tokio::time::timeout(PATIENCE, consumer.next())
                .await
                .expect("a routed event never reached the queue")
                .unwrap()
                .unwrap();
            assert_eq!(d.routing_key.as_str(), "routed.x");
        }
        delete_exchange(&channel, &exchange).await;
    });
}

#[test]
fn amqp_a_thousand_in_flight_each_judged_by_its_own_return() {
    run(async {
        let exchange = unique("leasectl-test-");
        let (_conn, channel) = rabbit().await;
        let queue = bound_queue(&channel, &exchange, "routed.*").await;
        let sink = amqp_sink(&exchange);
        // One delivery per aggregate, all at once: the sink publishes them together on one
        // channel, where lapin pins each return on whichever confirmation resolves next.
        // Every seventh is unroutable, so returns and acks interleave all through the window.
        let events: Vec<Event> = (0..1000)
            .map(|n| {
                let t = if n % 7 == 3 { "dropped.x" } else { "routed.x" };
                event(&format!("agg{n}"), n, t)
            })
            .collect();
        let results = join_all(events.iter().map(|e| sink.deliver(e, &ALWAYS))).await;
        let mut routed = std::collections::HashSet::new();
        for (e, r) in events.iter().zip(&results) {
            if e.event_type.starts_with("routed") {
                assert_eq!(r, &Ok(()), "event {}", e.seq);
                routed.insert(e.id.to_string());
            } else {
                assert!(
                    matches!(r, Err(DeliveryError::Rejected(m)) if m.contains("unroutable")),
                    "event {}: {r:?}",
                    e.seq
                );
            }
        }
        // The queue holds exactly the events the sink called delivered.
        let mut consumer = channel
            .basic_consume(
                queue,
                "".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let mut seen = std::collections::HashSet::new();
        while seen.len() < routed.len() {
            let d = tokio::time::timeout(PATIENCE, consumer.next())
                .await
                .expect("a delivered event never reached the queue")
                .unwrap()
                .unwrap();
            let id = d.properties.message_id().as_ref().unwrap().to_string();
            assert!(routed.contains(&id), "{id} was not delivered, yet queued");
            seen.insert(id);
        }
        // The sink is still good for the next group.
        sink.deliver(&event("after", 0, "routed.x"), &ALWAYS)
            .await
            .unwrap();
        delete_exchange(&channel, &exchange).await;
    });
}

/// The sink asks for 16 KiB frames (lapin keeps 32 frames' worth of buffer each way, resident
/// for the relay's life): a body of many frames still arrives whole, and a message whose
/// properties cannot fit in one frame is refused — on its own, charged like any refusal —
/// instead of making the broker close the connection under the whole batch.
#[test]
fn amqp_frames_of_16_kib_carry_large_bodies_and_refuse_properties_that_do_not_fit() {
    run(async {
        let exchange = unique("leasectl-test-");
        let (_conn, channel) = rabbit().await;
        let mut consumer = bound_consumer(&channel, &exchange, "order.*").await;
        let sink = |query: &str| {
            let url = format!("{}?exchange={exchange}&properties=full{query}", amqp_url());
            Amqp::new(amqp::Spec::parse(&url).unwrap(), opts())
        };
        let small_frames = sink("");
        let mut large = event("large", 0, "order.paid");
        large.payload = serde_json::json!({"pad": "y".repeat(200_000)}).to_string();
        // With `?properties=full` its aggregate_id is a header: 20 kB, more than a frame holds.
        let long_id = event(&"z".repeat(20_000), 1, "order.paid");
        let plain = event("plain", 2, "order.paid");
        let batch = [&large, &long_id, &plain];
        let results = join_all(batch.iter().map(|e| small_frames.deliver(e, &ALWAYS))).await;
        assert_eq!(results[0], Ok(()), "a 200 kB body over 16 KiB frames");
        match &results[1] {
            Err(DeliveryError::Rejected(m)) => {
                assert!(m.contains("frame") && m.contains("?frame_max="), "{m}")
            }
            other => panic!("properties larger than a frame must be refused, got {other:?}"),
        }
        assert_eq!(results[2], Ok(()), "the rest of the group is unaffected");
        // The connection survived: the same sink delivers again.
        small_frames.deliver(&plain, &ALWAYS).await.unwrap();
        // With larger frames asked for in the URL, the same event goes out.
        sink("&frame_max=131072")
            .deliver(&long_id, &ALWAYS)
            .await
            .unwrap();

        let mut got = std::collections::HashMap::new();
        while got.len() < 3 {
            let d = tokio::time::timeout(PATIENCE, consumer.next())
                .await
                .expect("a delivered event never reached the queue")
                .unwrap()
                .unwrap();
            let id = d.properties.message_id().as_ref().unwrap().to_string();
            got.insert(id, d.data);
        }
        body_is_spec_object(&got[&large.id.to_string()], &large);
        body_is_spec_object(&got[&long_id.id.to_string()], &long_id);
        assert!(got.contains_key(&plain.id.to_string()));
        delete_exchange(&channel, &exchange).await;
    });
}

/// A group whose first delivery was dropped before it published the group (its batch
/// abandoned mid-yield) is published by the next delivery to join, without the dropped one:
/// else every later delivery would join the leaderless group and wait for ever.
#[test]
fn amqp_a_group_whose_leader_was_dropped_is_led_by_the_next_delivery() {
    use futures_util::FutureExt;
    run(async {
        let exchange = unique("leasectl-test-");
        let (_conn, channel) = rabbit().await;
        let mut consumer = bound_consumer(&channel, &exchange, "order.*").await;
        let sink = amqp_sink(&exchange);
        let warm = event("warm", 0, "order.paid");
        sink.deliver(&warm, &ALWAYS).await.unwrap();
        // The first delivery starts a group and yields; then it is dropped.
        let dropped = event("dropped", 0, "order.paid");
        let mut leader = Box::pin(sink.deliver(&dropped, &ALWAYS));
        assert!((&mut leader).now_or_never().is_none());
        drop(leader);
        let next = event("next", 0, "order.paid");
        tokio::time::timeout(PATIENCE, sink.deliver(&next, &ALWAYS))
            .await
            .expect("the group of a dropped leader must still be published")
            .unwrap();
        let after = event("after", 0, "order.paid");
        sink.deliver(&after, &ALWAYS).await.unwrap();

        let mut ids = Vec::new();
        while ids.len() < 3 {
            let d = tokio::time::timeout(PATIENCE, consumer.next())
                .await
                .expect("a delivered event never reached the queue")
                .unwrap()
                .unwrap();
            ids.push(d.properties.message_id().as_ref().unwrap().to_string());
        }
        // Nobody would learn the dropped delivery's verdict: its event is not published.
        assert_eq!(
            ids,
            [
                warm.id.to_string(),
                next.id.to_string(),
                after.id.to_string()
            ]
        );
        delete_exchange(&channel, &exchange).await;
    });
}

#[test]
fn amqp_a_nack_is_rejected() {
    run(async {
        let exchange = unique("leasectl-test-");
        let (_conn, channel) = rabbit().await;
        let sink = amqp_sink(&exchange);
        // A queue that holds one message and refuses more: RabbitMQ nacks the publication.
        declare_exchange(&channel, &exchange).await;
        let mut args = FieldTable::default();
        args.insert("x-max-length".into(), AMQPValue::LongInt(1));
        args.insert(
            "x-overflow".into(),
            AMQPValue::LongString("reject-publish".into()),
        );
        let queue = channel
            .queue_declare(
                "".into(),
                QueueDeclareOptions {
                    exclusive: true,
                    ..Default::default()
                },
                args,
            )
            .await
            .unwrap();
        channel
            .queue_bind(
                queue.name().clone(),
                exchange.as_str().into(),
                "order.*".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        sink.deliver(&event("a", 0, "order.created"), &ALWAYS)
            .await
            .unwrap();
        match sink.deliver(&event("a", 1, "order.paid"), &ALWAYS).await {
            Err(DeliveryError::Rejected(m)) => assert!(m.contains("nack"), "{m}"),
            other => panic!("expected Rejected, got {other:?}"),
        }
        delete_exchange(&channel, &exchange).await;
    });
}

/// Every delivery to a broker at 127.0.0.1:1 failed as Unavailable, well before the 30s
/// timeout, saying it could not connect and not the password `s3cret` (the relay names the sink
/// in front of the message, once).
fn assert_quickly_unavailable(results: Vec<Result<(), DeliveryError>>, took: Duration) {
    assert!(took < Duration::from_secs(5), "{took:?}");
    for r in results {
        match r {
            Err(DeliveryError::Unavailable(m)) => {
                assert!(
                    m.starts_with("cannot connect: ") && !m.contains("s3cret"),
                    "{m}"
                )
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }
}

#[test]
fn amqp_unreachable_broker_is_unavailable_quickly_without_the_password() {
    run(async {
        let spec = amqp::Spec::parse("amqp://guest:s3cret@127.0.0.1:1/%2f?exchange=x").unwrap();
        let sink = Amqp::new(
            spec,
            SinkOptions {
                timeout: Duration::from_secs(30),
                format: Format::Json,
            },
        );
        let start = Instant::now();
        let events = history("a", 10, "order");
        let results = join_all(events.iter().map(|e| sink.deliver(e, &ALWAYS))).await;
        assert_quickly_unavailable(results, start.elapsed());
    });
}

#[test]
fn amqp_exchange_of_another_type_is_reported_by_name() {
    run(async {
        let exchange = unique("leasectl-test-");
        let (_conn, channel) = rabbit().await;
        channel
            .exchange_declare(
                exchange.as_str().into(),
                ExchangeKind::Fanout,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap();
        let sink = amqp_sink(&exchange);
        for _ in 0..2 {
            match sink.deliver(&event("a", 0, "order.created"), &ALWAYS).await {
                Err(DeliveryError::Unavailable(m)) => {
                    assert!(m.contains(&format!("exchange '{exchange}'")), "{m}");
                    assert!(m.contains("fanout"), "the broker's reason: {m}");
                }
                other => panic!("expected Unavailable, got {other:?}"),
            }
        }
        delete_exchange(&channel, &exchange).await;
    });
}

#[test]
fn amqp_recovers_when_its_exchange_is_deleted_under_it() {
    run(async {
        let exchange = unique("leasectl-test-");
        let (_conn, channel) = rabbit().await;
        let mut consumer = bound_consumer(&channel, &exchange, "#").await;
        // Through the relay's entry points this time.
        let spec = SinkSpec::parse(&format!("{}?exchange={exchange}", amqp_url())).unwrap();
        let sink = Sink::open(&spec, opts()).unwrap();
        let first = event("a", 0, "order.created");
        sink.deliver(&first, &ALWAYS).await.unwrap();
        let d = tokio::time::timeout(PATIENCE, consumer.next())
            .await
            .expect("the first event never arrived")
            .unwrap()
            .unwrap();
        assert_eq!(
            d.properties.message_id().as_ref().unwrap().as_str(),
            first.id.to_string()
        );

        delete_exchange(&channel, &exchange).await;
        // Publishing to a missing exchange closes the channel: unavailable, not a rejection.
        let second = event("a", 1, "order.paid");
        match sink.deliver(&second, &ALWAYS).await {
            Err(DeliveryError::Unavailable(m)) => assert!(m.contains("NOT_FOUND"), "{m}"),
            other => panic!("expected Unavailable, got {other:?}"),
        }
        // The next delivery reconnects and declares the exchange again — which has lost its
        // binding, so the event is returned rather than refused for a missing exchange.
        match sink.deliver(&second, &ALWAYS).await {
            Err(DeliveryError::Rejected(m)) => assert!(m.contains("unroutable"), "{m}"),
            other => panic!("expected the exchange redeclared, got {other:?}"),
        }
        let mut consumer = bound_consumer(&channel, &exchange, "#").await;
        sink.deliver(&second, &ALWAYS).await.unwrap();
        let d = tokio::time::timeout(PATIENCE, consumer.next())
            .await
            .expect("the event after the reconnection never arrived")
            .unwrap()
            .unwrap();
        assert_eq!(
            d.properties.message_id().as_ref().unwrap().as_str(),
            second.id.to_string()
        );
        delete_exchange(&channel, &exchange).await;
    });
}

#[test]
fn amqp_lost_connection_is_unavailable_then_reconnects() {
    run(async {
        let exchange = unique("leasectl-test-");
        let (_conn, channel) = rabbit().await;
        let mut consumer = bound_consumer(&channel, &exchange, "#").await;
        let proxy = Proxy::start("127.0.0.1:5672").await;
        let spec = amqp::Spec::parse(&format!(
            "amqp://guest:guest@127.0.0.1:{}/%2f?exchange={exchange}",
            proxy.port
        ))
        .unwrap();
        let sink = Amqp::new(spec, opts());
        let events = history("a", 3, "order");
        sink.deliver(&events[0], &ALWAYS).await.unwrap();

        proxy.cut().await;
        for e in &events[1..] {
            match sink.deliver(e, &ALWAYS).await {
                Err(DeliveryError::Unavailable(_)) => {}
                other => panic!("during the outage: {other:?}"),
            }
        }
        proxy.restore().await;
        for e in &events[1..] {
            deliver_once_back(e, || sink.deliver(e, &ALWAYS)).await;
        }
        for e in &events {
            let d = tokio::time::timeout(PATIENCE, consumer.next())
                .await
                .expect("an event never arrived")
                .unwrap()
                .unwrap();
            assert_eq!(
                d.properties.message_id().as_ref().unwrap().as_str(),
                e.id.to_string()
            );
        }
        proxy.cut().await;
        delete_exchange(&channel, &exchange).await;
    });
}

// ---------------------------------------------------------------------------------------------
// NATS

pub(crate) async fn jetstream() -> async_nats::jetstream::Context {
    let url = nats_url();
    let client = async_nats::connect(url)
        .await
        .expect("cannot reach NATS for tests (LEASECTL_TEST_NATS_URL)");
    async_nats::jetstream::new(client)
}

fn nats_sink(subject: &str, stream: &str) -> Nats {
    let spec =
        nats::Spec::parse(&format!("{}?subject={subject}&stream={stream}", nats_url())).unwrap();
    Nats::new(spec, opts())
}

/// Every message of `stream`, in stream order.
pub(crate) async fn stream_messages(
    js: &async_nats::jetstream::Context,
    stream: &str,
) -> Vec<async_nats::jetstream::message::StreamMessage> {
    let mut s = js.get_stream(stream).await.unwrap();
    let state = s.info().await.unwrap().state.clone();
    let mut out = Vec::new();
    for seq in state.first_sequence..=state.last_sequence {
        if state.messages == 0 {
            break;
        }
        out.push(s.get_raw_message(seq).await.unwrap());
    }
    assert_eq!(out.len() as u64, state.messages);
    out
}

pub(crate) fn msg_id(m: &async_nats::jetstream::message::StreamMessage) -> String {
    m.headers
        .get("Nats-Msg-Id")
        .map(|v| v.as_str().to_owned())
        .unwrap_or_default()
}

#[test]
fn nats_creates_the_stream_and_stores_every_event_once_in_order() {
    run(async {
        let subject = unique("leasectl_test_");
        let stream = unique("LEASECTL_TEST_");
        let js = jetstream().await;
        assert!(js.get_stream(&stream).await.is_err(), "fresh name");
        let sink = nats_sink(&subject, &stream);
        let histories = vec![history("a", 15, "order"), history("b", 15, "order")];
        deliver_histories(&histories, |e| sink.deliver(e, &ALWAYS)).await;

        let mut s = js
            .get_stream(&stream)
            .await
            .expect("the sink creates the stream");
        let config = s.info().await.unwrap().config.clone();
        assert_eq!(config.subjects, vec![format!("{subject}.>")]);
        assert_eq!(
            config.storage,
            async_nats::jetstream::stream::StorageType::File
        );

        let messages = stream_messages(&js, &stream).await;
        assert_eq!(messages.len(), 30);
        for h in &histories {
            let got: Vec<_> = messages
                .iter()
                .filter(|m| {
                    let v: serde_json::Value = serde_json::from_slice(&m.payload).unwrap();
                    v["aggregate_id"] == h[0].aggregate_id.as_str()
                })
                .collect();
            assert_eq!(got.len(), h.len());
            for (m, e) in got.iter().zip(h) {
                assert_eq!(msg_id(m), e.id.to_string(), "in order within the aggregate");
                assert_eq!(m.subject.as_str(), format!("{subject}.{}", e.event_type));
                body_is_spec_object(&m.payload, e);
            }
        }
        js.delete_stream(&stream).await.unwrap();
    });
}

#[test]
fn nats_an_event_whose_gate_has_closed_is_not_published() {
    run(async {
        let subject = unique("leasectl_test_");
        let stream = unique("LEASECTL_TEST_");
        let js = jetstream().await;
        let sink = nats_sink(&subject, &stream);
        let late = event("a", 0, "order.created");
        match sink.deliver(&late, &Gate::closed()).await {
            Err(DeliveryError::Late(_)) => {}
            other => panic!("expected Late, got {other:?}"),
        }
        let next = event("a", 1, "order.paid");
        sink.deliver(&next, &ALWAYS).await.unwrap();
        let ids: Vec<_> = stream_messages(&js, &stream)
            .await
            .iter()
            .map(msg_id)
            .collect();
        assert_eq!(
            ids,
            vec![next.id.to_string()],
            "only the event whose gate was open"
        );
        js.delete_stream(&stream).await.unwrap();
    });
}

#[test]
fn amqp_an_event_whose_gate_has_closed_is_not_published() {
    run(async {
        let exchange = unique("leasectl-test-");
        let (_conn, channel) = rabbit().await;
        let mut consumer = bound_consumer(&channel, &exchange, "#").await;
        let sink = amqp_sink(&exchange);
        let late = event("a", 0, "order.created");
        let next = event("b", 0, "order.created");
        // Both in one group: the gate is looked at per message when the group is published.
        let (l, n) = futures_util::future::join(
            sink.deliver(&late, &Gate::closed()),
            sink.deliver(&next, &ALWAYS),
        )
        .await;
        assert!(matches!(l, Err(DeliveryError::Late(_))), "{l:?}");
        n.unwrap();
        let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .expect("a message")
            .unwrap()
            .unwrap();
        assert_eq!(
            d.properties.message_id().as_ref().map(|s| s.as_str()),
            Some(next.id.to_string().as_str())
        );
        // Nothing else arrives.
        let more = tokio::time::timeout(Duration::from_millis(500), consumer.next()).await;
        assert!(more.is_err(), "the late event was published: {more:?}");
        delete_exchange(&channel, &exchange).await;
    });
}

#[test]
fn nats_the_same_event_twice_is_stored_once() {
    run(async {
        let subject = unique("leasectl_test_");
        let stream = unique("LEASECTL_TEST_");
        let js = jetstream().await;
        let sink = nats_sink(&subject, &stream);
        let e = event("a", 0, "order.created");
        sink.deliver(&e, &ALWAYS).await.unwrap();
        sink.deliver(&e, &ALWAYS)
            .await
            .expect("a duplicate counts as delivered");
        let other = event("a", 1, "order.paid");
        sink.deliver(&other, &ALWAYS).await.unwrap();
        let ids: Vec<_> = stream_messages(&js, &stream)
            .await
            .iter()
            .map(msg_id)
            .collect();
        assert_eq!(ids, vec![e.id.to_string(), other.id.to_string()]);
        js.delete_stream(&stream).await.unwrap();
    });
}

#[test]
fn nats_unreachable_server_is_unavailable_without_secrets() {
    run(async {
        let spec = nats::Spec::parse("nats://u:s3cret@127.0.0.1:1").unwrap();
        let sink = Nats::new(
            spec,
            SinkOptions {
                timeout: Duration::from_secs(30),
                format: Format::Json,
            },
        );
        let start = Instant::now();
        let events = history("a", 10, "order");
        let results = join_all(events.iter().map(|e| sink.deliver(e, &ALWAYS))).await;
        assert_quickly_unavailable(results, start.elapsed());
    });
}

#[test]
fn nats_uses_an_existing_stream_that_captures_the_prefix() {
    run(async {
        let subject = unique("leasectl_test_");
        let theirs = unique("THEIRS_");
        let ours = unique("LEASECTL_TEST_");
        let js = jetstream().await;
        js.create_stream(async_nats::jetstream::stream::Config {
            name: theirs.clone(),
            subjects: vec![format!("{subject}.>")],
            storage: async_nats::jetstream::stream::StorageType::Memory,
            ..Default::default()
        })
        .await
        .unwrap();
        let sink = nats_sink(&subject, &ours);
        let e = event("a", 0, "order.created");
        sink.deliver(&e, &ALWAYS).await.unwrap();
        assert!(js.get_stream(&ours).await.is_err(), "no second stream");
        let ids: Vec<_> = stream_messages(&js, &theirs)
            .await
            .iter()
            .map(msg_id)
            .collect();
        assert_eq!(ids, vec![e.id.to_string()]);
        js.delete_stream(&theirs).await.unwrap();
    });
}

#[test]
fn nats_a_deleted_stream_is_unavailable_then_recreated() {
    run(async {
        let subject = unique("leasectl_test_");
        let stream = unique("LEASECTL_TEST_");
        let js = jetstream().await;
        let sink = nats_sink(&subject, &stream);
        sink.deliver(&event("a", 0, "order.created"), &ALWAYS)
            .await
            .unwrap();
        js.delete_stream(&stream).await.unwrap();

        let e = event("a", 1, "order.paid");
        match sink.deliver(&e, &ALWAYS).await {
            Err(DeliveryError::Unavailable(m)) => assert!(m.contains("no responders"), "{m}"),
            other => panic!("expected Unavailable, got {other:?}"),
        }
        sink.deliver(&e, &ALWAYS)
            .await
            .expect("the stream is created again");
        let ids: Vec<_> = stream_messages(&js, &stream)
            .await
            .iter()
            .map(msg_id)
            .collect();
        assert_eq!(ids, vec![e.id.to_string()]);
        js.delete_stream(&stream).await.unwrap();
    });
}

#[test]
fn nats_lost_connection_is_unavailable_then_recovers() {
    run(async {
        let subject = unique("leasectl_test_");
        let stream = unique("LEASECTL_TEST_");
        let js = jetstream().await;
        let proxy = Proxy::start("127.0.0.1:4222").await;
        let spec = nats::Spec::parse(&format!(
            "nats://127.0.0.1:{}?subject={subject}&stream={stream}",
            proxy.port
        ))
        .unwrap();
        let sink = Nats::new(
            spec,
            SinkOptions {
                timeout: Duration::from_secs(2),
                format: Format::Json,
            },
        );
        let events = history("a", 2, "order");
        sink.deliver(&events[0], &ALWAYS).await.unwrap();

        proxy.cut().await;
        match sink.deliver(&events[1], &ALWAYS).await {
            Err(DeliveryError::Unavailable(m)) => assert!(m.contains("disconnected"), "{m}"),
            other => panic!("during the outage: {other:?}"),
        }
        proxy.restore().await;
        deliver_once_back(&events[1], || sink.deliver(&events[1], &ALWAYS)).await;
        // The publication buffered during the outage may have reached the stream too: the
        // stream's deduplication keeps one copy.
        let ids: Vec<_> = stream_messages(&js, &stream)
            .await
            .iter()
            .map(msg_id)
            .collect();
        assert_eq!(
            ids,
            vec![events[0].id.to_string(), events[1].id.to_string()]
        );
        proxy.cut().await;
        js.delete_stream(&stream).await.unwrap();
    });
}

#[test]
fn nats_an_error_ack_is_rejected() {
    run(async {
        let subject = unique("leasectl_test_");
        let theirs = unique("THEIRS_");
        let js = jetstream().await;
        js.create_stream(async_nats::jetstream::stream::Config {
            name: theirs.clone(),
            subjects: vec![format!("{subject}.>")],
            storage: async_nats::jetstream::stream::StorageType::Memory,
            max_messages: 1,
            discard: async_nats::jetstream::stream::DiscardPolicy::New,
            ..Default::default()
        })
        .await
        .unwrap();
        let sink = nats_sink(&subject, "UNUSED");
        sink.deliver(&event("a", 0, "order.created"), &ALWAYS)
            .await
            .unwrap();
        match sink.deliver(&event("a", 1, "order.paid"), &ALWAYS).await {
            Err(DeliveryError::Rejected(m)) => assert!(m.contains("maximum messages"), "{m}"),
            other => panic!("expected Rejected, got {other:?}"),
        }
        js.delete_stream(&theirs).await.unwrap();
    });
}
