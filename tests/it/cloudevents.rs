//! `leasectl relay --format cloudevents` end to end: each CloudEvents binding checked at a real
//! receiver — structured JSON on stdout and on an `exec:` command's stdin; binary mode at a
//! webhook (`ce-*` headers), a RabbitMQ consumer (`cloudEvents:*` headers) and a JetStream
//! stream (`ce-*` headers), the payload alone as the body. And `--source` checked as a
//! URI-reference before anything connects.

use std::collections::HashMap;
use std::process::Output;

use serde_json::Value;

use crate::common::*;
use crate::events::*;
use crate::relay_sinks::{consume, key, no_content, ExchangeGuard, StreamGuard, Webhook};
use crate::sink_brokers::{
    amqp_url, bound_queue, header, jetstream, nats_url, rabbit, stream_messages, unique,
};

/// The attributes a structured event has, in the order leasectl writes them.
const STRUCTURED_KEYS: [&str; 10] = [
    "specversion",
    "id",
    "source",
    "type",
    "subject",
    "time",
    "datacontenttype",
    "aggregatetype",
    "aggregateid",
    "data",
];

/// An aggregate id that must be percent-encoded in a header: a space, a double quote, a
/// percent sign and a character outside ASCII.
const ODD_ID: &str = "ü 1\"%";
/// [`ODD_ID`]'s subject as the HTTP and NATS bindings encode it.
const ODD_SUBJECT_ENCODED: &str = "order/%C3%BC%201%22%25";

/// 30 events over 3 aggregates, then one of aggregate [`ODD_ID`]; returns the rows by id.
fn outbox(env: &Env) -> HashMap<String, Row> {
    insert_events(env, 30, 3, 1);
    env.sql(&format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         VALUES ('order', '{}', 'order.paid', '{{\"n\": 0, \"note\": \"é\"}}')",
        ODD_ID.replace('\'', "''")
    ));
    by_id(&snapshot(env))
}

fn relay_once(env: &Env, args: &[&str]) -> Output {
    let mut all = vec!["relay", "--once", "--format", "cloudevents"];
    all.extend_from_slice(args);
    let o = env.run(&all);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    o
}

/// Checks one CloudEvent's attributes (`attr` reads one by name, decoded) against the outbox
/// row its `id` names; returns the row.
fn assert_attributes(
    attr: impl Fn(&str) -> Option<String>,
    rows: &HashMap<String, Row>,
    source: &str,
) -> Row {
    assert_eq!(attr("specversion").as_deref(), Some("1.0"));
    let id = attr("id").expect("no id attribute");
    let row = rows
        .get(&id)
        .unwrap_or_else(|| panic!("published an event that is not in the outbox: {id}"))
        .clone();
    assert_eq!(attr("source").as_deref(), Some(source));
    assert_eq!(attr("type").as_ref(), Some(&row.event_type));
    assert_eq!(
        attr("subject"),
        Some(format!("{}/{}", row.aggregate_type, row.aggregate_id))
    );
    assert_eq!(
        attr("time").as_ref(),
        Some(&row.created_at),
        "time = created_at"
    );
    assert_eq!(attr("aggregatetype").as_ref(), Some(&row.aggregate_type));
    assert_eq!(attr("aggregateid").as_ref(), Some(&row.aggregate_id));
    row
}

/// What [`assert_per_aggregate_order`] reads, for a row whose `data` was received.
fn ordered(row: &Row, data: &Value) -> Value {
    serde_json::json!({
        "aggregate_type": row.aggregate_type,
        "aggregate_id": row.aggregate_id,
        "payload": data,
    })
}

/// A structured-mode CloudEvent (one JSON object on one line): checked, with its row.
fn assert_structured(line: &str, rows: &HashMap<String, Row>, source: &str) -> Value {
    assert!(!line.contains('\n'));
    let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{line:?}: {e}"));
    let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(keys, STRUCTURED_KEYS, "{line}");
    assert_eq!(v["datacontenttype"], "application/json");
    let row = assert_attributes(|name| v[name].as_str().map(str::to_owned), rows, source);
    assert_eq!(v["data"], row.payload, "data = payload");
    ordered(&row, &v["data"])
}

/// Percent-decoding of a header value, as the HTTP and NATS bindings prescribe; also checks
/// the value needed no other quoting (printable ASCII without space or `"`).
fn decode_header(value: &str) -> String {
    assert!(
        value
            .bytes()
            .all(|b| (0x21..=0x7e).contains(&b) && b != b'"'),
        "not percent-encoded: {value:?}"
    );
    let bytes = value.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            out.push(u8::from_str_radix(&value[i + 1..i + 3], 16).unwrap());
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).unwrap()
}

#[test]
fn cloudevents_on_stdout_are_structured_json_with_every_attribute() {
    let env = migrated();
    let rows = outbox(&env);
    let o = relay_once(&env, &["--sink", "stdout"]);
    assert_eq!(outbox_count(&env), 0);
    let source = format!("leasectl://{}", env.schema);
    let out = stdout(&o);
    let events: Vec<Value> = out
        .lines()
        .map(|line| assert_structured(line, &rows, &source))
        .collect();
    assert_eq!(events.len(), rows.len());
    assert_per_aggregate_order(&events);
}

#[test]
fn cloudevents_to_exec_arrive_structured_on_stdin_with_the_given_source() {
    let env = migrated();
    let rows = outbox(&env);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("events");
    let sink = format!("exec:cat >> '{}'", file.display());
    relay_once(
        &env,
        &[
            "--sink",
            &sink,
            "--parallel",
            "1",
            "--source",
            "https://example.com/orders",
        ],
    );
    assert_eq!(outbox_count(&env), 0);
    let got = std::fs::read_to_string(&file).unwrap();
    let events: Vec<Value> = got
        .lines()
        .map(|line| assert_structured(line, &rows, "https://example.com/orders"))
        .collect();
    assert_eq!(events.len(), rows.len());
    assert_per_aggregate_order(&events);
}

#[test]
fn cloudevents_to_a_webhook_are_binary_with_ce_headers_and_the_payload_as_body() {
    let env = migrated();
    let rows = outbox(&env);
    let hook = Webhook::start(no_content());
    relay_once(&env, &["--sink", &hook.url(), "--source", "/orders"]);
    assert_eq!(outbox_count(&env), 0);

    let requests = hook.requests();
    assert_eq!(requests.len(), rows.len());
    let mut events = Vec::new();
    for r in &requests {
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(
            r.header("ce-datacontenttype"),
            None,
            "HTTP carries datacontenttype as Content-Type"
        );
        let row = assert_attributes(
            |name| r.header(&format!("ce-{name}")).map(decode_header),
            &rows,
            "/orders",
        );
        assert_eq!(key(r), row.id, "Idempotency-Key = ce-id");
        if row.aggregate_id == ODD_ID {
            assert_eq!(r.header("ce-subject"), Some(ODD_SUBJECT_ENCODED));
        }
        let data: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(data, row.payload, "the body is the payload");
        events.push(ordered(&row, &data));
    }
    assert_per_aggregate_order(&events);
}

#[test]
fn cloudevents_to_rabbitmq_are_binary_with_cloudevents_headers() {
    let env = migrated();
    let rows = outbox(&env);
    let rt = runtime();
    let exchange = unique("leasectl-ce-test-");
    let (_conn, channel) = rt.block_on(rabbit());
    let queue = rt.block_on(bound_queue(&channel, &exchange, "#"));
    let _cleanup = ExchangeGuard(exchange.clone());
    let sink = format!("{}?exchange={exchange}", amqp_url());
    let source = format!("leasectl://{}", env.schema);
    relay_once(&env, &["--sink", &sink]);
    assert_eq!(outbox_count(&env), 0);

    let deliveries = rt.block_on(consume(&channel, &queue, rows.len()));
    let mut events = Vec::new();
    for d in &deliveries {
        assert_eq!(
            d.properties.content_type().as_ref().map(|s| s.as_str()),
            Some("application/json"),
            "the content-type property is datacontenttype"
        );
        assert_eq!(header(d, "cloudEvents:datacontenttype"), None);
        // AMQP header values are binary-safe: no percent-encoding.
        let row = assert_attributes(
            |name| header(d, &format!("cloudEvents:{name}")),
            &rows,
            &source,
        );
        let data: Value = serde_json::from_slice(&d.data).unwrap();
        assert_eq!(data, row.payload, "the body is the payload");
        events.push(ordered(&row, &data));
    }
    assert_per_aggregate_order(&events);
}

#[test]
fn cloudevents_to_jetstream_are_binary_with_ce_headers() {
    let env = migrated();
    let rows = outbox(&env);
    let subject = unique("leasectl_ce_test_");
    let stream = unique("LEASECTL_CE_TEST_");
    let _cleanup = StreamGuard(stream.clone());
    let sink = format!("{}?subject={subject}&stream={stream}", nats_url());
    relay_once(&env, &["--sink", &sink, "--source", "urn:example:orders"]);
    assert_eq!(outbox_count(&env), 0);

    let rt = runtime();
    let js = rt.block_on(jetstream());
    let messages = rt.block_on(stream_messages(&js, &stream));
    assert_eq!(messages.len(), rows.len());
    let mut events = Vec::new();
    for m in &messages {
        let get = |name: &str| m.headers.get(name).map(|v| v.as_str().to_owned());
        assert_eq!(
            get("ce-datacontenttype").as_deref(),
            Some("application/json"),
            "NATS carries datacontenttype as a ce- header"
        );
        let row = assert_attributes(
            |name| get(&format!("ce-{name}")).as_deref().map(decode_header),
            &rows,
            "urn:example:orders",
        );
        assert_eq!(get("Nats-Msg-Id"), Some(row.id.clone()));
        if row.aggregate_id == ODD_ID {
            assert_eq!(get("ce-subject").as_deref(), Some(ODD_SUBJECT_ENCODED));
        }
        let data: Value = serde_json::from_slice(&m.payload).unwrap();
        assert_eq!(data, row.payload, "the body is the payload");
        events.push(ordered(&row, &data));
    }
    assert_per_aggregate_order(&events);
}

#[test]
fn a_source_that_is_not_a_uri_reference_is_a_usage_error() {
    let env = Env::new();
    for bad in ["two words", "http://h/%zz", "1x:y", ""] {
        let o = env.run(&[
            "relay",
            "--once",
            "--sink",
            "stdout",
            "--format",
            "cloudevents",
            "--source",
            bad,
        ]);
        assert_one_line_error(&o, 2, "--source");
        assert!(stdout(&o).is_empty());
    }
    let o = env.run(&["relay", "--once", "--sink", "stdout", "--source", "/orders"]);
    assert_one_line_error(&o, 2, "--format cloudevents");
}
