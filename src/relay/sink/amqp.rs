//! `--sink amqp://…` / `amqps://…`: RabbitMQ, with publisher confirms.
//!
//! Each event is published to the exchange named by `?exchange=NAME` (default `leasectl`; the
//! parameter is ours and removed before lapin sees the URL) with routing key = event type,
//! `mandatory`, persistent (delivery mode 2), `message_id` = event id, `type` = event type,
//! `content_type` `application/json`, `app_id` `leasectl` and the headers `aggregate_type` and
//! `aggregate_id`; the body is the event JSON. An event is delivered once the broker confirmed
//! it — and was able to route it.
//!
//! Choices worth knowing:
//!
//! * **Lazy connection.** [`Amqp::new`] connects to nothing; the first [`Amqp::deliver`] does,
//!   and so does the first one after the connection was lost. Connecting happens under a lock,
//!   so concurrent deliveries wait for one attempt instead of opening one connection each; when
//!   that attempt fails, the deliveries that were waiting for it fail with its message instead
//!   of each trying again (a black-holed broker would otherwise cost them a timeout apiece).
//! * **The exchange is declared once per connection**, as a durable `topic` exchange. If it
//!   already exists with another type (or durability) RabbitMQ refuses the declaration; that is
//!   reported as [`DeliveryError::Unavailable`] naming the exchange, and the connection is
//!   dropped so the next delivery tries again — the operator has to fix it, and no event is
//!   lost meanwhile. Names starting with `amq.` are reserved to the broker and cannot be
//!   declared: those are only checked for existence (a passive declaration).
//! * **One publish in flight per channel.** lapin hands a returned (unroutable) message to the
//!   *next* confirmation it resolves on that channel — and resolves the confirms of a
//!   `multiple` ack in hash-map order — so with several publishes in flight on one channel a
//!   return could be pinned on the wrong event, and an unroutable event would count as
//!   delivered. Each delivery therefore takes a channel of its own from a small pool (opened
//!   with `confirm.select` on demand, at most [`MAX_IDLE_CHANNELS`] kept) and gives it back only
//!   after a clean confirm. RabbitMQ sends `basic.return` before the `basic.ack` of the same
//!   message, so with one publish outstanding the return on a confirmation is that event's.
//!   A channel whose confirm timed out is closed rather than reused: its late confirm or return
//!   must not be read by the next event.
//!
//! Failures, classified as in [`super`]:
//!
//! | what happened | result |
//! |---|---|
//! | connection refused, lost, or timed out; channel closed by the broker for any other reason (say, the exchange was deleted); exchange declaration refused | `Unavailable` (the broken connection is dropped; the next delivery reconnects and redeclares) |
//! | broker nack | `Rejected` |
//! | broker closed the channel refusing the message (PRECONDITION_FAILED, e.g. larger than its `max_message_size`) | `Rejected` |
//! | message returned as unroutable (no queue bound for its routing key) | `Rejected`, although the broker acks it after returning it |
//! | no confirm within `--timeout` | `Rejected` — `Unavailable` if meanwhile the connection was lost or the broker is blocking publishers (resource alarm) |
//! | event type longer than 255 bytes (an AMQP routing key's limit) | `Rejected` |

use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::AMQPUri;
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ErrorKind,
    ExchangeKind,
};

use super::{DeliveryError, Event, SinkOptions};

/// The exchange used when the URL has no `?exchange=`.
pub const DEFAULT_EXCHANGE: &str = "leasectl";

/// How many idle channels a connection keeps for reuse (the relay's parallelism for brokers).
const MAX_IDLE_CHANNELS: usize = 64;

/// Query parameters lapin itself understands; anything else (but our `exchange`) is refused so
/// a typo such as `?exchnage=` does not silently publish to the default exchange.
const LAPIN_QUERY_PARAMS: [&str; 5] = [
    "frame_max",
    "channel_max",
    "heartbeat",
    "connection_timeout",
    "auth_mechanism",
];

/// A parsed `--sink amqp://…`. Its `Debug` output, like [`Spec::describe`], has no password.
#[derive(Clone)]
pub struct Spec {
    /// The broker URL without our `exchange` parameter.
    pub url: String,
    pub exchange: String,
    /// `url`, checked and parsed.
    uri: AMQPUri,
}

impl std::fmt::Debug for Spec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spec")
            .field("url", &super::redact(&self.url))
            .field("exchange", &self.exchange)
            .finish_non_exhaustive()
    }
}

impl Spec {
    /// Parses `amqp[s]://[user[:password]@]host[:port][/vhost][?exchange=NAME&…]`. The error
    /// is one line and never repeats the password.
    pub fn parse(url: &str) -> Result<Spec, String> {
        let (url, ours) = super::take_query_params(url, &["exchange"]);
        let exchange = ours
            .into_iter()
            .find(|(k, _)| k == "exchange")
            .map_or_else(|| DEFAULT_EXCHANGE.to_owned(), |(_, v)| v);
        let shown = super::redact(&url);

        if let Some((_, query)) = url.split_once('?') {
            let query = query.split('#').next().unwrap_or_default();
            for key in query.split('&').filter(|p| !p.is_empty()) {
                let key = key.split('=').next().unwrap_or_default();
                if !LAPIN_QUERY_PARAMS.contains(&key) {
                    return Err(format!(
                        "AMQP URL {shown}: unknown parameter '{key}' (expected exchange, {})",
                        LAPIN_QUERY_PARAMS.join(", ")
                    ));
                }
            }
        }
        // The parser's messages never quote the URL, so they cannot leak the password.
        let mut uri =
            AMQPUri::from_str(&url).map_err(|e| format!("invalid AMQP URL {shown}: {e}"))?;
        // amq-protocol-uri reads the host with `Url::domain`, which is empty for an IPv6
        // literal, and then falls back to localhost: put the address back.
        if let Some(ip) = ip_host(&url) {
            uri.authority.host = ip;
        }
        // `amqp://host/` names the vhost "" by the letter of the URI spec, which no broker has;
        // every other client takes it as the default vhost.
        if uri.vhost.is_empty() {
            uri.vhost = "/".to_owned();
        }
        if exchange.is_empty() || exchange.len() > 255 || exchange.chars().any(char::is_control) {
            return Err(format!(
                "AMQP URL {shown}: the exchange name must be 1-255 bytes without control characters"
            ));
        }
        Ok(Spec { url, exchange, uri })
    }

    /// How the sink is named in messages, without any password.
    pub fn describe(&self) -> String {
        format!("{} exchange {}", super::redact(&self.url), self.exchange)
    }
}

/// The host of `scheme://[userinfo@]host[:port]…` when it is an IP address (without the
/// brackets of an IPv6 literal).
fn ip_host(url: &str) -> Option<String> {
    let rest = &url[url.find("://")? + 3..];
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let host_port = &authority[authority.rfind('@').map_or(0, |at| at + 1)..];
    let host = match host_port.strip_prefix('[') {
        Some(v6) => &v6[..v6.find(']')?],
        None => host_port.split(':').next()?,
    };
    host.parse::<std::net::IpAddr>()
        .ok()
        .map(|ip| ip.to_string())
}

/// The RabbitMQ sink. Cheap to create; connects on the first delivery.
pub struct Amqp {
    spec: Spec,
    opts: SinkOptions,
    /// The current connection, if any; the lock serialises connection attempts.
    state: tokio::sync::Mutex<State>,
    /// Failed connection attempts so far: a delivery that waited for the lock while an attempt
    /// failed reports that failure instead of making another attempt.
    failures: AtomicU64,
}

#[derive(Default)]
struct State {
    link: Option<Arc<Link>>,
    last_error: String,
}

/// An open connection whose exchange is declared, with its idle confirm-mode channels.
struct Link {
    connection: Connection,
    exchange: ShortString,
    idle: Mutex<Vec<Channel>>,
}

impl Amqp {
    pub fn new(spec: Spec, opts: SinkOptions) -> Amqp {
        Amqp {
            spec,
            opts,
            state: tokio::sync::Mutex::new(State::default()),
            failures: AtomicU64::new(0),
        }
    }

    /// Publishes `event` and waits for the broker's confirm; see the module documentation for
    /// how failures are classified.
    pub async fn deliver(&self, event: &Event) -> Result<(), DeliveryError> {
        let routing_key = ShortString::try_new(event.event_type.as_str()).map_err(|_| {
            DeliveryError::Rejected(format!(
                "event type is {} bytes long; an AMQP routing key has at most 255",
                event.event_type.len()
            ))
        })?;
        let link = self.link().await?;

        let published = tokio::time::timeout(self.opts.timeout, async {
            let channel = link.checkout().await?;
            let confirm = channel
                .basic_publish(
                    link.exchange.clone(),
                    routing_key.clone(),
                    BasicPublishOptions {
                        mandatory: true,
                        immediate: false,
                    },
                    event.json.as_bytes(),
                    properties(event, &routing_key),
                )
                .await?
                .await?;
            Ok::<_, lapin::Error>((channel, confirm))
        })
        .await;

        let (channel, confirm) = match published {
            Ok(Ok(done)) => done,
            Ok(Err(e)) => {
                // The channel (a channel error closes it) or the connection is gone. Start
                // afresh — and redeclare the exchange — next time.
                self.forget(&link).await;
                let message = format!("{}: {}", self.spec.describe(), lapin_message(&e));
                return Err(if refuses_the_message(&e) {
                    DeliveryError::Rejected(message)
                } else {
                    DeliveryError::Unavailable(message)
                });
            }
            Err(_elapsed) => {
                // The channel that timed out is dropped (closed) here, never reused.
                let status = link.connection.status();
                let why = if !status.connected() {
                    "the connection was lost"
                } else if status.blocked() {
                    "the broker is blocking publishers (resource alarm)"
                } else {
                    return Err(DeliveryError::Rejected(format!(
                        "{}: no publisher confirm within {}",
                        self.spec.describe(),
                        humantime::format_duration(self.opts.timeout)
                    )));
                };
                return Err(DeliveryError::Unavailable(format!(
                    "{}: no publisher confirm within {}: {why}",
                    self.spec.describe(),
                    humantime::format_duration(self.opts.timeout)
                )));
            }
        };

        // The channel had this one publish outstanding, so it is clean again and reusable.
        link.checkin(channel);
        match confirm {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(_)) | Confirmation::Nack(Some(_)) => {
                Err(DeliveryError::Rejected(format!(
                    "unroutable: no queue bound to exchange {} for routing key {}",
                    self.spec.exchange, event.event_type
                )))
            }
            Confirmation::Nack(None) => Err(DeliveryError::Rejected(format!(
                "{}: the broker refused the message (nack)",
                self.spec.describe()
            ))),
            // Every channel of ours is in confirm mode; this cannot happen.
            Confirmation::NotRequested => Err(DeliveryError::Rejected(format!(
                "{}: no publisher confirm was requested",
                self.spec.describe()
            ))),
        }
    }

    /// The open connection, connecting (and declaring the exchange) when there is none or the
    /// last one was lost.
    async fn link(&self) -> Result<Arc<Link>, DeliveryError> {
        let failures_seen = self.failures.load(Ordering::Relaxed);
        let mut state = self.state.lock().await;
        if let Some(link) = &state.link {
            if link.connection.status().connected() {
                return Ok(link.clone());
            }
        }
        state.link = None;
        if self.failures.load(Ordering::Relaxed) != failures_seen {
            // An attempt failed while we waited for the lock: share its verdict.
            return Err(DeliveryError::Unavailable(state.last_error.clone()));
        }
        let attempt = tokio::time::timeout(self.opts.timeout, self.connect()).await;
        let error = match attempt {
            Ok(Ok(link)) => {
                let link = Arc::new(link);
                state.link = Some(link.clone());
                return Ok(link);
            }
            Ok(Err(e)) => e,
            Err(_elapsed) => format!(
                "cannot connect to {}: no answer within {}",
                self.spec.describe(),
                humantime::format_duration(self.opts.timeout)
            ),
        };
        self.failures.fetch_add(1, Ordering::Relaxed);
        state.last_error = error.clone();
        Err(DeliveryError::Unavailable(error))
    }

    /// Connects, declares the exchange and keeps the declaring channel (in confirm mode) as the
    /// first idle one.
    async fn connect(&self) -> Result<Link, String> {
        let exchange = ShortString::try_new(self.spec.exchange.as_str())
            .map_err(|e| format!("invalid exchange name: {e}"))?;
        let properties =
            ConnectionProperties::default().with_connection_name("leasectl relay".into());
        let connection = Connection::connect_uri(self.spec.uri.clone(), properties)
            .await
            .map_err(|e| {
                format!(
                    "cannot connect to {}: {}",
                    self.spec.describe(),
                    lapin_message(&e)
                )
            })?;
        let channel = connection.create_channel().await.map_err(|e| {
            format!(
                "{}: cannot open a channel: {}",
                self.spec.describe(),
                lapin_message(&e)
            )
        })?;
        let declared = if self.spec.exchange.starts_with("amq.") {
            // Reserved to the broker: it exists (or not), and we may not declare it.
            let passive = ExchangeDeclareOptions {
                passive: true,
                ..ExchangeDeclareOptions::default()
            };
            channel
                .exchange_declare(
                    exchange.clone(),
                    ExchangeKind::Topic,
                    passive,
                    FieldTable::default(),
                )
                .await
        } else {
            let durable = ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            };
            channel
                .exchange_declare(
                    exchange.clone(),
                    ExchangeKind::Topic,
                    durable,
                    FieldTable::default(),
                )
                .await
        };
        declared.map_err(|e| {
            format!(
                "{}: cannot declare exchange '{}' as a durable topic exchange: {}",
                super::redact(&self.spec.url),
                self.spec.exchange,
                lapin_message(&e)
            )
        })?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| {
                format!(
                    "{}: cannot enable publisher confirms: {}",
                    self.spec.describe(),
                    lapin_message(&e)
                )
            })?;
        Ok(Link {
            connection,
            exchange,
            idle: Mutex::new(vec![channel]),
        })
    }

    /// Drops `link` if it is still the current one, so the next delivery reconnects.
    async fn forget(&self, link: &Arc<Link>) {
        let mut state = self.state.lock().await;
        if state.link.as_ref().is_some_and(|l| Arc::ptr_eq(l, link)) {
            state.link = None;
        }
    }
}

impl Link {
    /// An idle open channel, or a new one in confirm mode.
    async fn checkout(&self) -> lapin::Result<Channel> {
        loop {
            let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
            match idle {
                Some(channel) if channel.status().connected() => return Ok(channel),
                Some(_closed) => continue,
                None => break,
            }
        }
        let channel = self.connection.create_channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await?;
        Ok(channel)
    }

    /// Returns a channel with nothing outstanding to the pool (or closes it if the pool is full).
    fn checkin(&self, channel: Channel) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < MAX_IDLE_CHANNELS && channel.status().connected() {
            idle.push(channel);
        }
    }
}

/// The message properties of `event`'s publication.
fn properties(event: &Event, routing_key: &ShortString) -> BasicProperties {
    let mut headers = FieldTable::default();
    headers.insert(
        "aggregate_type".into(),
        AMQPValue::LongString(LongString::from(event.aggregate_type.as_str())),
    );
    headers.insert(
        "aggregate_id".into(),
        AMQPValue::LongString(LongString::from(event.aggregate_id.as_str())),
    );
    BasicProperties::default()
        .with_message_id(event.id.to_string().into())
        .with_type(routing_key.clone())
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_app_id("leasectl".into())
        .with_headers(headers)
}

/// Whether a failed publication was the broker refusing *this message* by closing the channel
/// with PRECONDITION_FAILED (e.g. larger than its `max_message_size`) — an event-specific
/// refusal that must cost an attempt, or the event would stall the relay forever — rather than
/// the broker or its topology being unusable (connection lost, NOT_FOUND for a deleted
/// exchange, ACCESS_REFUSED, …).
fn refuses_the_message(e: &lapin::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::ProtocolError(amqp)
            if *amqp.kind() == AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)
    )
}

/// A lapin error as one line: the broker's own reply text for protocol errors (it names the
/// exchange and the cause, e.g. "PRECONDITION_FAILED - inequivalent arg 'type' …").
fn lapin_message(e: &lapin::Error) -> String {
    match e.kind() {
        ErrorKind::ProtocolError(amqp) => amqp.get_message().to_string(),
        ErrorKind::IOError(io) => io.to_string(),
        _ => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::protocol::AMQPError;

    #[test]
    fn defaults_and_custom_exchange() {
        let s = Spec::parse("amqp://guest:guest@localhost:5672/%2f").unwrap();
        assert_eq!(s.exchange, "leasectl");
        assert_eq!(s.uri.vhost, "/");
        let s = Spec::parse("amqp://h/vh?heartbeat=10&exchange=ev%2Ets").unwrap();
        assert_eq!(s.exchange, "ev.ts");
        assert_eq!(s.url, "amqp://h/vh?heartbeat=10");
        assert_eq!(s.uri.query.heartbeat, Some(10));
        assert_eq!(s.uri.vhost, "vh");
        let s = Spec::parse("AMQPS://h").unwrap();
        assert_eq!(s.uri.authority.port, 5671);
    }

    #[test]
    fn ip_hosts_and_the_empty_vhost() {
        let s = Spec::parse("amqp://u:p@10.1.2.3:5673/").unwrap();
        assert_eq!(s.uri.authority.host, "10.1.2.3");
        assert_eq!(s.uri.authority.port, 5673);
        assert_eq!(s.uri.vhost, "/");
        let s = Spec::parse("amqp://[::1]:5672").unwrap();
        assert_eq!(s.uri.authority.host, "::1");
        let s = Spec::parse("amqp://rabbit.internal").unwrap();
        assert_eq!(s.uri.authority.host, "rabbit.internal");
    }

    #[test]
    fn garbage_is_refused_without_the_password() {
        for bad in [
            "amqp://u:s3cret@h:notaport/",
            "amqp://u:s3cret@h/?heartbeat=often",
            "amqp://u:s3cret@h/?exchnage=x",
            "amqp://u:s3cret@h/?exchange=",
            "amqp://u:s3cret@h/?auth_mechanism=magic",
        ] {
            let e = Spec::parse(bad).unwrap_err();
            assert!(!e.contains("s3cret") && !e.contains('\n'), "{bad}: {e}");
            assert!(e.contains("AMQP URL"), "{bad}: {e}");
        }
    }

    #[test]
    fn only_a_refused_message_costs_an_attempt() {
        let closed = |kind: AMQPSoftError, text: &str| -> lapin::Error {
            ErrorKind::ProtocolError(AMQPError::new(AMQPErrorKind::Soft(kind), text.into())).into()
        };
        let too_big = closed(
            AMQPSoftError::PRECONDITIONFAILED,
            "PRECONDITION_FAILED - message size 200 is larger than configured max size 100",
        );
        assert!(refuses_the_message(&too_big));
        assert_eq!(
            lapin_message(&too_big),
            "PRECONDITION_FAILED - message size 200 is larger than configured max size 100"
        );
        let gone = closed(AMQPSoftError::NOTFOUND, "NOT_FOUND - no exchange 'x'");
        assert!(!refuses_the_message(&gone));
        let refused: lapin::Error =
            std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into();
        assert!(!refuses_the_message(&refused));
    }

    #[test]
    fn describe_and_debug_hide_the_password() {
        let s = Spec::parse("amqp://guest:s3cret@h:5672/%2f?exchange=orders").unwrap();
        assert_eq!(s.describe(), "amqp://guest:***@h:5672/%2f exchange orders");
        let debug = format!("{s:?}");
        assert!(
            !debug.contains("s3cret") && debug.contains("orders"),
            "{debug}"
        );
    }
}
