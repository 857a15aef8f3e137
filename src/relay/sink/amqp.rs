//! `--sink amqp://…` / `amqps://…`: RabbitMQ, with publisher confirms.
//!
//! Each event is published to the exchange named by `?exchange=NAME` (the parameter is ours and
//! removed before lapin sees the URL; without it, this deployment's own,
//! `leasectl.DATABASE.SCHEMA`: [`default_exchange`]) with routing key = event type,
//! `mandatory`, persistent (delivery mode 2), `message_id` = event id and `content_type`
//! `application/json`; the body is the event JSON. An event is delivered once the broker
//! confirmed it — and was able to route it.
//!
//! `?properties=full` adds `type` = event type, `app_id` `leasectl` and the headers
//! `aggregate_type` and `aggregate_id`, for consumers that route or shard on them (a headers
//! exchange, a consistent-hash exchange's `hash-header`) without reading the body. They are not
//! the default because of what they cost the broker: RabbitMQ keeps a message's encoded
//! properties of up to 64 bytes on the process heap (an Erlang heap binary) and larger ones as
//! reference-counted binaries, and past that line every persistent message costs it about a
//! quarter more CPU (docs/BENCHMARKS.md, "the 64-byte line"). The default set is 57 bytes
//! whatever the event — the id is a UUID — and everything the full set adds is in the body.
//!
//! With `--format cloudevents` the message is in CloudEvents' binary mode, per the AMQP binding
//! carried over to AMQP 0-9-1 as RabbitMQ maps AMQP 1.0 application properties to and from
//! message headers: the body is the payload, the `content-type` property is `datacontenttype`
//! (`application/json`), and every other attribute is a `cloudEvents:NAME` header
//! (`cloudEvents:specversion`, `cloudEvents:id`, …). Values are long strings, the attributes'
//! canonical string forms, which the binding allows: 0-9-1's own timestamp type has whole
//! seconds only, and would lose `time`'s microseconds. (The binding's revision 1.0.3 also allows
//! the prefix `cloudEvents_`, for JMS selectors; consumers are told to accept both.)
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
//! * **Many publishes in flight, judged per group.** Concurrent deliveries (the relay runs one
//!   per aggregate, up to [`super::Sink::parallelism`] at once) are gathered into a *group*: the
//!   first delivery to arrive yields once so that the others of the same scheduling pass can
//!   join, then publishes the whole group on one confirm-mode channel and waits for all of its
//!   confirms together — a window of hundreds of publishes instead of one per channel. (Should
//!   that first delivery be dropped before it publishes, the next one to join leads the group.)
//!   Within a group there is at most one event per aggregate (the relay delivers an aggregate's
//!   events one after another, each only once the previous was confirmed), so an aggregate's
//!   later event is never published before its earlier one is confirmed: order at the consumer
//!   holds even when an event is refused.
//! * **Returns are mapped by message id, not by confirmation.** lapin hands a returned
//!   (unroutable) message to the *next* confirmation it resolves on that channel — with a
//!   `multiple` ack in hash-map order, and RabbitMQ may ack out of order — so the return found
//!   on a confirmation is not necessarily that message's. RabbitMQ sends `basic.return` before
//!   the `basic.ack` of the same message, so once every confirm of the group has resolved, every
//!   return of the group's messages sits on one of the group's confirmations (a channel serves
//!   one group at a time). The group's verdicts are therefore made only then, and a message
//!   counts as returned when its `message_id` (= the event id) is among the returns collected.
//!   A channel is reused only after a group whose confirms all resolved; one that timed out or
//!   failed is closed, so a late confirm or return is never read by the next group.
//! * **Frames of 16 KiB** unless the URL asks for others (`?frame_max=`): lapin keeps 32 frames
//!   of buffer each way, resident for the connection's life (`FRAME_MAX`). A message's
//!   properties travel in one frame; one whose properties do not fit is refused
//!   (`header_fits`) rather than sent, which would make the broker close the connection.
//! * **A refusal that closes the channel** (PRECONDITION_FAILED, e.g. a message larger than the
//!   broker's `max_message_size`) fails every unconfirmed publish of the group alike, without
//!   saying which message caused it; those events are published again one per channel, so only
//!   the offending one is charged an attempt.
//!
//! Failures, classified as in [`super`]:
//!
//! | what happened | result |
//! |---|---|
//! | connection refused, lost, or timed out; channel closed by the broker for any other reason (say, the exchange was deleted); exchange declaration refused | `Unavailable` (the broken connection is dropped; the next delivery reconnects and redeclares) |
//! | broker nack | `Rejected` |
//! | broker closed the channel refusing the message (PRECONDITION_FAILED, e.g. larger than its `max_message_size`) | `Rejected` |
//! | message returned as unroutable (no queue bound for its routing key) | `Rejected`, although the broker acks it after returning it |
//! | no confirm within `--timeout` | `NoAnswer` (the event's refusal if the broker confirmed others meanwhile) — `Unavailable` if meanwhile the connection was lost or the broker is blocking publishers (resource alarm) |
//! | event type longer than 255 bytes (an AMQP routing key's limit) | `Rejected` |
//! | message properties larger than one frame (`?frame_max=`, 16 KiB unless the URL says) | `Rejected` |

use std::collections::HashSet;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures_util::{FutureExt, StreamExt};
use tokio::sync::oneshot;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::uri::AMQPUri;
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ErrorKind,
    ExchangeKind,
};

use super::{DeliveryError, Event, Format, Gate, SinkOptions};

/// The exchange a URL without `?exchange=` publishes to: this deployment's own (the database as
/// its server names it, and the schema), never one that every deployment on the broker's vhost
/// shares — a first relay started with a bare URL used to publish into any queue another team
/// had bound to a shared default.
pub fn default_exchange(database: &str, schema: &str) -> String {
    format!("leasectl.{database}.{schema}")
}

/// How many idle channels a connection keeps for reuse (the relay's parallelism for brokers).
const MAX_IDLE_CHANNELS: usize = 64;

/// The largest frame the relay asks the broker for when the URL does not say (`?frame_max=`).
/// lapin keeps a send and a receive buffer of 32 frames each, zero-filled once the connection
/// is tuned: at RabbitMQ's default of 128 KiB that is 8 MiB resident for as long as the relay
/// runs, a quarter of its memory, for messages of a few hundred bytes. At 16 KiB the two take
/// 1 MiB. A larger body is split into more frames (at no cost worth measuring: lapin copies
/// every body into its frames anyway); a message's properties cannot be, see [`header_fits`].
const FRAME_MAX: u32 = 16 * 1024;

/// Whether a message whose properties take `len` bytes (as [`properties`] counts them) can be
/// published on a connection whose frames are at most `frame_max` bytes. The properties travel
/// in one content header frame, which cannot be split: 7 bytes of frame header, 12 of class,
/// weight and body size, the properties, and the frame-end byte. A larger frame makes the broker
/// close the whole connection (FRAME_ERROR): every delivery of the batch would fail as
/// unavailable and the event would hold up the relay for ever, so it is refused instead (an
/// attempt, like any event the broker refuses) — an `aggregate_id` of many kilobytes with
/// `?properties=full` or `--format cloudevents` is the one way to get there.
fn header_fits(len: usize, frame_max: u32) -> bool {
    len + HEADER_FRAME_OVERHEAD <= frame_max as usize
}

/// What a content header frame takes besides the properties (see [`header_fits`]).
const HEADER_FRAME_OVERHEAD: usize = 7 + 12 + 1;

/// Which message properties are published (`?properties=compact|full`, default `compact`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Properties {
    /// `message_id`, `content_type` and `delivery_mode`: 57 bytes, within RabbitMQ's cheap path.
    Compact,
    /// Also `type`, `app_id` and the `aggregate_type` and `aggregate_id` headers.
    Full,
}

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
    /// `?exchange=NAME`; without it, [`default_exchange`] once the relay knows its database
    /// ([`Spec::for_deployment`]).
    pub exchange: String,
    /// Whether the URL named the exchange.
    pub exchange_given: bool,
    /// Whether the URL names a user (else the broker is logged in to as guest).
    user_given: bool,
    pub properties: Properties,
    /// `url`, checked and parsed.
    uri: AMQPUri,
}

impl std::fmt::Debug for Spec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spec")
            .field("url", &super::redact(&self.url))
            .field("exchange", &self.exchange)
            .field("properties", &self.properties)
            .finish_non_exhaustive()
    }
}

impl Spec {
    /// Parses
    /// `amqp[s]://[user[:password]@]host[:port][/vhost][?exchange=NAME&properties=compact|full&…]`.
    /// The error is one line and never repeats the password.
    pub fn parse(url: &str) -> Result<Spec, String> {
        let (url, ours) = super::take_query_params(url, &["exchange", "properties"]);
        let ours = |key: &str| ours.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str());
        let exchange_given = ours("exchange").is_some();
        let exchange = ours("exchange").unwrap_or("leasectl").to_owned();
        let shown = super::redact(&url);
        let (host, user_given) = authority(&url);
        if host.is_empty() {
            // The URI spec's defaults would make it localhost, as guest: say where to publish.
            return Err(format!(
                "AMQP URL {shown} names no host: give the broker's, e.g. amqp://user:password@rabbit.internal/%2f"
            ));
        }
        let properties = match ours("properties") {
            None | Some("compact") => Properties::Compact,
            Some("full") => Properties::Full,
            Some(other) => {
                return Err(format!(
                    "AMQP URL {shown}: properties must be compact or full, not '{other}'"
                ))
            }
        };

        if let Some((_, query)) = url.split_once('?') {
            let query = query.split('#').next().unwrap_or_default();
            for key in query.split('&').filter(|p| !p.is_empty()) {
                let key = key.split('=').next().unwrap_or_default();
                if !LAPIN_QUERY_PARAMS.contains(&key) {
                    return Err(format!(
                        "AMQP URL {shown}: unknown parameter '{key}' (expected exchange, properties, {})",
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
        if uri.query.frame_max.is_none() {
            uri.query.frame_max = Some(FRAME_MAX);
        }
        if exchange.is_empty() || exchange.len() > 255 || exchange.chars().any(char::is_control) {
            return Err(format!(
                "AMQP URL {shown}: the exchange name must be 1-255 bytes without control characters"
            ));
        }
        Ok(Spec {
            url,
            exchange,
            exchange_given,
            user_given,
            properties,
            uri,
        })
    }

    /// Without `?exchange=`, publishes to this deployment's exchange ([`default_exchange`]);
    /// returns what the operator should be told: the exchange chosen, and a login as guest.
    pub fn for_deployment(&mut self, database: &str, schema: &str) -> Vec<String> {
        let mut notices = Vec::new();
        if !self.exchange_given {
            self.exchange = default_exchange(database, schema);
            self.exchange_given = true;
            notices.push(format!(
                "--sink names no exchange: publishing to \"{}\", this deployment's own (database \"{database}\", schema \"{schema}\"); bind your queues to it, or name one with ?exchange=NAME",
                self.exchange
            ));
        }
        if !self.user_given {
            notices.push(format!(
                "--sink names no user: logging in to {} as guest",
                super::redact(&self.url)
            ));
        }
        notices
    }

    /// How the sink is named in messages, without any password.
    pub fn describe(&self) -> String {
        format!("{} exchange {}", super::redact(&self.url), self.exchange)
    }
}

impl Spec {
    /// `leasectl doctor --sink`: connects and logs in, then asks whether the exchange exists
    /// with a passive declare (which creates nothing), and publishes nothing. Whether a queue is
    /// bound for the event types cannot be seen over AMQP 0-9-1 without publishing (a
    /// `mandatory` message that a consumer could receive), so the verdict says so.
    pub async fn probe(&self, timeout: std::time::Duration) -> super::Probed {
        use super::Probed;
        let shown = super::redact(&self.url);
        let bindings = format!(
            "whether a queue is bound for your event types cannot be seen over AMQP without publishing:              `rabbitmqctl list_bindings source_name routing_key destination_name` shows the bindings of exchange {}",
            self.exchange
        );
        let look = async {
            let properties =
                ConnectionProperties::default().with_connection_name("leasectl doctor".into());
            let connection = Connection::connect_uri(self.uri.clone(), properties)
                .await
                .map_err(|e| (true, format!("cannot connect: {}", lapin_message(&e))))?;
            let channel = connection.create_channel().await.map_err(|e| {
                (
                    true,
                    format!("cannot open a channel: {}", lapin_message(&e)),
                )
            })?;
            let passive = ExchangeDeclareOptions {
                passive: true,
                ..ExchangeDeclareOptions::default()
            };
            let exchange = ShortString::try_new(self.exchange.as_str())
                .map_err(|e| (true, format!("invalid exchange name: {e}")))?;
            let found = channel
                .exchange_declare(
                    exchange,
                    ExchangeKind::Topic,
                    passive,
                    FieldTable::default(),
                )
                .await;
            let _ = connection
                .close(200, "leasectl doctor is done".into())
                .await;
            match found {
                Ok(()) => Ok(()),
                Err(e) => Err((false, lapin_message(&e))),
            }
        };
        match tokio::time::timeout(timeout, look).await {
            Err(_) => Probed::Fail(
                format!("{shown}: no answer within {}", crate::fmt::duration(timeout)),
                "check the broker's host, port and firewall".into(),
            ),
            Ok(Err((true, why))) => Probed::Fail(
                format!("{shown}: {why}"),
                "check the URL's host, port, vhost and credentials (the relay would retry, delivering nothing)".into(),
            ),
            Ok(Ok(())) => Probed::Ok(format!(
                "{shown}: connected and logged in; exchange {} exists; {bindings}",
                self.exchange
            )),
            Ok(Err((false, why))) if self.exchange.starts_with("amq.") => Probed::Fail(
                format!("{shown}: exchange {} does not exist ({why})", self.exchange),
                "amq.* exchanges belong to the broker: name another with ?exchange=NAME".into(),
            ),
            Ok(Err((false, why))) => Probed::Warn(
                format!(
                    "{shown}: connected and logged in; exchange {} does not exist yet ({why}): the relay declares it (a durable topic exchange) on its first connection, but no queue is bound to it, so every event would come back unroutable and die after --max-attempts",
                    self.exchange
                ),
                format!(
                    "declare exchange {} (topic, durable) and bind your queues to it before starting the relay, e.g. rabbitmqadmin declare exchange name={} type=topic durable=true",
                    self.exchange, self.exchange
                ),
            ),
        }
    }
}

/// The host of `scheme://[userinfo@]host[:port]…` (without the brackets of an IPv6 literal;
/// empty when there is none) and whether a user name comes before it.
fn authority(url: &str) -> (String, bool) {
    let rest = url.find("://").map_or("", |i| &url[i + 3..]);
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let (user, host_port) = match authority.rfind('@') {
        Some(at) => (&authority[..at], &authority[at + 1..]),
        None => ("", authority),
    };
    let host = match host_port.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => host_port.split(':').next().unwrap_or_default(),
    };
    let user = user.split(':').next().unwrap_or_default();
    (host.to_owned(), !user.is_empty())
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
    /// The group being formed: deliveries waiting for its leader to publish them.
    forming: Mutex<Forming>,
}

/// The group being formed, and which one it is.
#[derive(Default)]
struct Forming {
    group: Vec<Waiting>,
    /// Counts the groups taken for publication: which group a leader leads.
    taken: u64,
    /// The group's leader was dropped before it took the group (its batch abandoned): the next
    /// delivery to join leads it instead, or the group's members would wait for ever.
    leaderless: bool,
}

impl Forming {
    fn take(&mut self) -> Vec<Waiting> {
        self.taken += 1;
        self.leaderless = false;
        std::mem::take(&mut self.group)
    }
}

/// Marks the group leaderless if its leader is dropped before taking it.
struct LeaderGuard<'a> {
    forming: &'a Mutex<Forming>,
    group: u64,
}

impl Drop for LeaderGuard<'_> {
    fn drop(&mut self) {
        let mut forming = self.forming.lock().unwrap_or_else(|e| e.into_inner());
        if forming.taken == self.group {
            forming.leaderless = true;
        }
    }
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

/// One delivery of a group: what to publish, and where its verdict goes.
struct Waiting {
    routing_key: ShortString,
    /// The event id, which is also the message id: how a return is matched to its event.
    id: String,
    body: Vec<u8>,
    properties: BasicProperties,
    /// The size of `properties` once encoded: whether they fit in one frame ([`header_fits`]).
    properties_len: usize,
    /// Its batch's gate, looked at just before the message is published.
    gate: Gate,
    verdict: oneshot::Sender<Result<(), DeliveryError>>,
}

/// A publication's verdict, or that it must be published again alone: a refusal closed the
/// channel while several publications were outstanding, so whose message it refused is unknown.
enum Verdict {
    Final(Result<(), DeliveryError>),
    AgainAlone(DeliveryError),
}

/// What became of one publication of a group, before it is turned into a verdict.
enum Outcome {
    /// Boxed: a confirmation may carry a whole returned message.
    Confirmed(Box<Confirmation>),
    /// The publication or its confirm failed (the channel or the connection closed).
    Failed(lapin::Error),
    /// No confirm before the group's deadline.
    TimedOut,
    /// Not published: its batch's gate had closed by the time its turn came.
    Late,
}

impl Amqp {
    pub fn new(spec: Spec, opts: SinkOptions) -> Amqp {
        Amqp {
            spec,
            opts,
            state: tokio::sync::Mutex::new(State::default()),
            failures: AtomicU64::new(0),
            forming: Mutex::new(Forming::default()),
        }
    }

    /// Publishes `event` and waits for the broker's confirm; see the module documentation for
    /// how deliveries are grouped and how failures are classified.
    pub async fn deliver(&self, event: &Event, gate: &Gate) -> Result<(), DeliveryError> {
        let routing_key = ShortString::try_new(event.event_type.as_str()).map_err(|_| {
            DeliveryError::Rejected(format!(
                "event type is {} bytes long; an AMQP routing key has at most 255",
                event.event_type.len()
            ))
        })?;
        let (tx, rx) = oneshot::channel();
        let (properties, properties_len) =
            properties(event, &routing_key, &self.opts.format, self.spec.properties);
        let leader = {
            let mut forming = self.forming.lock().unwrap_or_else(|e| e.into_inner());
            forming.group.push(Waiting {
                properties,
                properties_len,
                routing_key,
                id: event.id.to_string(),
                body: self.opts.format.body(event).into_bytes(),
                gate: gate.clone(),
                verdict: tx,
            });
            // The first to join leads the group, or the next to join one whose leader is gone.
            let leads = forming.group.len() == 1 || forming.leaderless;
            forming.leaderless = false;
            leads.then_some(forming.taken)
        };
        if let Some(group) = leader {
            let guard = LeaderGuard {
                forming: &self.forming,
                group,
            };
            // Let the deliveries of the same scheduling pass join this group first.
            tokio::task::yield_now().await;
            let taken = {
                let mut forming = self.forming.lock().unwrap_or_else(|e| e.into_inner());
                (forming.taken == group).then(|| forming.take())
            };
            drop(guard);
            // Boxed, because only a group's leader runs it: inline, the state of a group's
            // publication (a channel being opened, the publications' futures) would make every
            // delivery's future that large, and a batch holds a thousand deliveries at once.
            if let Some(group) = taken {
                Box::pin(self.publish_group(group)).await;
            }
        }
        rx.await.unwrap_or_else(|_| {
            // The leader was dropped mid-group (the relay is stopping): nothing is known.
            Err(DeliveryError::Unavailable(
                "the publication was abandoned".into(),
            ))
        })
    }

    /// Publishes a group and sends each delivery its verdict.
    async fn publish_group(&self, mut group: Vec<Waiting>) {
        // A delivery dropped meanwhile (its batch abandoned) is not published: nobody would
        // learn its verdict, and its event stays in the outbox for a later batch.
        group.retain(|w| !w.verdict.is_closed());
        if group.is_empty() {
            return;
        }
        let link = match self.link().await {
            Ok(link) => link,
            Err(e) => {
                for w in group {
                    let _ = w.verdict.send(Err(e.clone()));
                }
                return;
            }
        };
        // The group formed (and the link may have been made) after the relay's check: what
        // may no longer leave does not.
        let (group, late): (Vec<Waiting>, Vec<Waiting>) =
            group.into_iter().partition(|w| w.gate.allows_now());
        for w in late {
            let _ = w.verdict.send(Err(DeliveryError::late()));
        }
        let frame_max = link.connection.configuration().frame_max();
        let (group, too_large): (Vec<Waiting>, Vec<Waiting>) = group
            .into_iter()
            .partition(|w| header_fits(w.properties_len, frame_max));
        for w in too_large {
            let _ = w.verdict.send(Err(DeliveryError::Rejected(format!(
                "its message properties take {} bytes, more than one frame of the connection's {frame_max} bytes holds: raise it with ?frame_max=BYTES in the sink URL (up to the broker's own frame_max, 128 KiB by default)",
                w.properties_len
            ))));
        }
        if group.is_empty() {
            return;
        }
        let outcomes = self.publish_on_a_channel(&link, &group).await;
        let mut again = Vec::new();
        for (w, verdict) in group.into_iter().zip(outcomes) {
            match verdict {
                Verdict::Final(verdict) => {
                    let _ = w.verdict.send(verdict);
                }
                // A refusal closed the channel: whose message it was is unknown when several
                // were outstanding, so each is published again on its own.
                Verdict::AgainAlone(_) => again.push(w),
            }
        }
        if again.len() == 1 {
            // It was this one's own refusal, or the others were all confirmed before it.
            let w = again.pop().expect("one");
            let verdict = self.publish_alone(&link, &w).await;
            let _ = w.verdict.send(verdict);
        } else if !again.is_empty() {
            let verdicts =
                futures_util::future::join_all(again.iter().map(|w| self.publish_alone(&link, w)))
                    .await;
            for (w, verdict) in again.into_iter().zip(verdicts) {
                let _ = w.verdict.send(verdict);
            }
        }
    }

    /// Publishes one delivery on a channel of its own; its refusal is its own.
    async fn publish_alone(&self, link: &Arc<Link>, w: &Waiting) -> Result<(), DeliveryError> {
        if !w.gate.allows_now() {
            return Err(DeliveryError::late());
        }
        match self
            .publish_on_a_channel(link, std::slice::from_ref(w))
            .await
            .pop()
        {
            Some(Verdict::Final(verdict)) => verdict,
            // Alone, a refusal is the message's own (`AgainAlone` is only given to groups).
            Some(Verdict::AgainAlone(e)) => Err(e),
            None => Err(DeliveryError::Unavailable(
                "the publication was abandoned".into(),
            )),
        }
    }

    /// Publishes `group` on one channel, waits (until `--timeout`) for every confirm and returns
    /// each publication's verdict, in order.
    async fn publish_on_a_channel(&self, link: &Arc<Link>, group: &[Waiting]) -> Vec<Verdict> {
        let deadline = tokio::time::Instant::now() + self.opts.timeout;
        let mut outcomes: Vec<Option<Outcome>> = group.iter().map(|_| None).collect();
        let channel = match tokio::time::timeout_at(deadline, link.checkout()).await {
            Ok(Ok(channel)) => Some(channel),
            Ok(Err(e)) => {
                outcomes
                    .iter_mut()
                    .for_each(|o| *o = Some(Outcome::Failed(e.clone())));
                None
            }
            Err(_elapsed) => {
                outcomes
                    .iter_mut()
                    .for_each(|o| *o = Some(Outcome::TimedOut));
                None
            }
        };
        let mut clean = false;
        if let Some(channel) = &channel {
            // All publications are started at once: each `basic_publish` waits for lapin's I/O
            // loop to have written its frames, and waiting for those one after another would
            // cost a thread round trip per event. Their order does not matter: a group holds at
            // most one event per aggregate.
            let mut pending: futures_util::stream::FuturesUnordered<_> = group
                .iter()
                .map(|w| async move {
                    // The gate once more, as the message is handed to lapin: taking a channel
                    // may have cost a round trip to the broker (or the relay was paused) since
                    // the group's look.
                    if !w.gate.allows_now() {
                        return Outcome::Late;
                    }
                    let published = async {
                        channel
                            .basic_publish(
                                link.exchange.clone(),
                                w.routing_key.clone(),
                                BasicPublishOptions {
                                    mandatory: true,
                                    immediate: false,
                                },
                                &w.body,
                                w.properties.clone(),
                            )
                            .await?
                            .await
                    };
                    match published.await {
                        Ok(c) => Outcome::Confirmed(Box::new(c)),
                        Err(e) => Outcome::Failed(e),
                    }
                })
                .enumerate()
                .map(|(i, outcome)| async move { (i, outcome.await) })
                .collect();
            let waited = tokio::time::timeout_at(deadline, async {
                while let Some((i, outcome)) = pending.next().await {
                    outcomes[i] = Some(outcome);
                }
            })
            .await;
            // Confirms resolved just as the deadline passed still count: they may carry returns.
            for (i, outcome) in std::iter::from_fn(|| pending.next().now_or_never().flatten()) {
                outcomes[i] = Some(outcome);
            }
            clean = waited.is_ok()
                && outcomes
                    .iter()
                    .all(|o| matches!(o, Some(Outcome::Confirmed(_) | Outcome::Late)));
        }
        match channel {
            // Every confirm resolved, so every return was read: the channel is clean.
            Some(channel) if clean => link.checkin(channel),
            // Closed when dropped: a late confirm or return is never read by another group.
            _ => {}
        }

        // Every return of the group sits on one of its resolved confirmations (see the module
        // documentation); which one does not matter.
        let returned: HashSet<String> = outcomes
            .iter_mut()
            .filter_map(|o| match o {
                Some(Outcome::Confirmed(c)) => match &mut **c {
                    Confirmation::Ack(r) | Confirmation::Nack(r) => r.take(),
                    Confirmation::NotRequested => None,
                },
                _ => None,
            })
            .filter_map(|r| {
                r.delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|id| id.to_string())
            })
            .collect();

        let several = group.len() > 1;
        let mut lost_link = false;
        let verdicts = group
            .iter()
            .zip(outcomes)
            .map(|(w, outcome)| {
                if returned.contains(&w.id) {
                    return Verdict::Final(Err(DeliveryError::Rejected(format!(
                        "unroutable: no queue bound to exchange {} for routing key {}",
                        self.spec.exchange,
                        w.routing_key.as_str()
                    ))));
                }
                Verdict::Final(match outcome.unwrap_or(Outcome::TimedOut) {
                    Outcome::Confirmed(c) if c.is_ack() => Ok(()),
                    Outcome::Confirmed(c) if c.is_nack() => Err(DeliveryError::Rejected(
                        "the broker refused the message (nack)".into(),
                    )),
                    // Every channel of ours is in confirm mode; this cannot happen.
                    Outcome::Confirmed(_not_requested) => Err(DeliveryError::Rejected(
                        "no publisher confirm was requested".into(),
                    )),
                    Outcome::Failed(e) => {
                        let message = lapin_message(&e);
                        if !refuses_the_message(&e) {
                            // The connection is gone, or the broker closed the channel for a
                            // reason of its own (the exchange was deleted, say): start afresh —
                            // and redeclare the exchange — next time.
                            lost_link = true;
                            Err(DeliveryError::Unavailable(message))
                        } else if several {
                            return Verdict::AgainAlone(DeliveryError::Rejected(message));
                        } else {
                            Err(DeliveryError::Rejected(message))
                        }
                    }
                    Outcome::TimedOut => Err(self.no_confirm(link)),
                    Outcome::Late => Err(DeliveryError::late()),
                })
            })
            .collect();
        if lost_link {
            self.forget(link).await;
        }
        verdicts
    }

    /// Why a publication had no confirm within `--timeout`: `Rejected` when the broker is
    /// connected and not blocking publishers, `Unavailable` otherwise.
    fn no_confirm(&self, link: &Link) -> DeliveryError {
        let status = link.connection.status();
        let why = if !status.connected() {
            "the connection was lost"
        } else if status.blocked() {
            "the broker is blocking publishers (resource alarm)"
        } else {
            return DeliveryError::NoAnswer(format!(
                "no publisher confirm within {}",
                humantime::format_duration(self.opts.timeout)
            ));
        };
        DeliveryError::Unavailable(format!(
            "no publisher confirm within {}: {why}",
            humantime::format_duration(self.opts.timeout)
        ))
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
                "cannot connect: no answer within {}",
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
            .map_err(|e| format!("cannot connect: {}", lapin_message(&e)))?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| format!("cannot open a channel: {}", lapin_message(&e)))?;
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
                "cannot declare exchange '{}' as a durable topic exchange: {}",
                self.spec.exchange,
                lapin_message(&e)
            )
        })?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| format!("cannot enable publisher confirms: {}", lapin_message(&e)))?;
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

/// The message properties of `event`'s publication, and their size once encoded (see
/// [`header_fits`]).
fn properties(
    event: &Event,
    routing_key: &ShortString,
    format: &Format,
    set: Properties,
) -> (BasicProperties, usize) {
    // What each property takes on the wire: a short string its length and one byte, a table
    // entry its name as a short string, a type byte and (a long string) 4 bytes and its value.
    let short = |s: &str| 1 + s.len();
    let entry = |name: &str, value: &str| short(name) + 1 + 4 + value.len();
    let mut headers = FieldTable::default();
    let mut table_len = 0;
    for (name, value) in format.attributes(event) {
        // `datacontenttype` is the `content-type` property below.
        if name != "datacontenttype" {
            let name = format!("cloudEvents:{name}");
            table_len += entry(&name, &value);
            headers.insert(name.into(), AMQPValue::LongString(LongString::from(value)));
        }
    }
    let message_id = event.id.to_string();
    // The property flags (2 bytes), `content-type`, delivery mode (1 byte) and `message-id`.
    let mut len = 2 + short("application/json") + 1 + short(&message_id);
    let mut props = BasicProperties::default()
        .with_message_id(message_id.into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2);
    if set == Properties::Full {
        table_len += entry("aggregate_type", &event.aggregate_type);
        table_len += entry("aggregate_id", &event.aggregate_id);
        headers.insert(
            "aggregate_type".into(),
            AMQPValue::LongString(LongString::from(event.aggregate_type.as_str())),
        );
        headers.insert(
            "aggregate_id".into(),
            AMQPValue::LongString(LongString::from(event.aggregate_id.as_str())),
        );
        len += short(routing_key.as_str()) + short("leasectl");
        props = props
            .with_type(routing_key.clone())
            .with_app_id("leasectl".into());
    }
    // An empty table is still encoded (4 bytes, and the broker decodes it): leave it out.
    if !headers.inner().is_empty() {
        len += 4 + table_len;
        props = props.with_headers(headers);
    }
    (props, len)
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
        assert!(!s.exchange_given);
        assert_eq!(s.uri.vhost, "/");
        let s = Spec::parse("amqp://h/vh?heartbeat=10&exchange=ev%2Ets").unwrap();
        assert_eq!(s.exchange, "ev.ts");
        assert_eq!(s.url, "amqp://h/vh?heartbeat=10");
        assert_eq!(s.uri.query.heartbeat, Some(10));
        assert_eq!(s.uri.vhost, "vh");
        let s = Spec::parse("AMQPS://h").unwrap();
        assert_eq!(s.uri.authority.port, 5671);
        assert_eq!(s.properties, Properties::Compact);
        let s = Spec::parse("amqp://h/?properties=full&exchange=x").unwrap();
        assert_eq!((s.properties, s.exchange.as_str()), (Properties::Full, "x"));
        assert_eq!(s.url, "amqp://h/");
        let s = Spec::parse("amqp://h/?properties=compact").unwrap();
        assert_eq!(s.properties, Properties::Compact);
    }

    #[test]
    fn no_exchange_means_this_deployments_own_and_no_host_is_refused() {
        let mut s = Spec::parse("amqp://rabbit/%2f").unwrap();
        assert!(!s.exchange_given);
        let notices = s.for_deployment("app", "leasectl");
        assert_eq!(s.exchange, "leasectl.app.leasectl");
        assert_eq!(notices.len(), 2, "{notices:?}");
        assert!(
            notices[0].contains("\"leasectl.app.leasectl\""),
            "{notices:?}"
        );
        assert!(notices[1].contains("as guest"), "{notices:?}");
        let mut s = Spec::parse("amqp://u:p@rabbit/%2f?exchange=orders").unwrap();
        assert!(s.for_deployment("app", "leasectl").is_empty());
        assert_eq!(s.exchange, "orders");
        for bad in [
            "amqp://",
            "amqp:///%2f",
            "amqps://u:s3cret@/vh",
            "amqp://u@:5672/",
        ] {
            let e = Spec::parse(bad).unwrap_err();
            assert!(
                e.contains("names no host") && !e.contains("s3cret"),
                "{bad}: {e}"
            );
        }
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
            "amqp://u:s3cret@h/?properties=all",
        ] {
            let e = Spec::parse(bad).unwrap_err();
            assert!(!e.contains("s3cret") && !e.contains('\n'), "{bad}: {e}");
            assert!(e.contains("AMQP URL"), "{bad}: {e}");
        }
    }

    /// The size of `props` on the wire, encoded by lapin's own encoder.
    fn encoded_len(props: &BasicProperties) -> usize {
        let (buf, _) =
            cookie_factory::gen(lapin::protocol::basic::gen_properties(props), Vec::new()).unwrap();
        buf.len()
    }

    #[test]
    fn compact_properties_stay_within_the_brokers_64_bytes() {
        let event = |event_type: &str, aggregate_id: &str| Event {
            seq: 1,
            id: uuid::Uuid::new_v4(),
            aggregate_type: "order".into(),
            aggregate_id: aggregate_id.into(),
            event_type: event_type.into(),
            payload: "{}".into(),
            created_at: std::time::SystemTime::now(),
        };
        let long = event(&"t".repeat(255), &"x".repeat(3000));
        let short = event("order.paid", "123");
        for e in [&long, &short] {
            let key = ShortString::from(e.event_type.clone());
            let (compact, len) = properties(e, &key, &Format::Json, Properties::Compact);
            assert_eq!(encoded_len(&compact), 57, "whatever the event");
            assert_eq!(len, 57);
            // What the full set costs even a short event: past the line.
            let (full, len) = properties(e, &key, &Format::Json, Properties::Full);
            assert!(encoded_len(&full) > 64, "{}", encoded_len(&full));
            assert_eq!(len, encoded_len(&full));
            let cloudevents = Format::CloudEvents {
                source: "leasectl://app".into(),
            };
            for set in [Properties::Compact, Properties::Full] {
                let (props, len) = properties(e, &key, &cloudevents, set);
                assert_eq!(len, encoded_len(&props), "{set:?}");
            }
        }
    }

    #[test]
    fn frames_are_16_kib_unless_the_url_says_and_properties_must_fit_in_one() {
        let s = Spec::parse("amqp://h/").unwrap();
        assert_eq!(s.uri.query.frame_max, Some(16 * 1024));
        let s = Spec::parse("amqp://h/?frame_max=131072").unwrap();
        assert_eq!(s.uri.query.frame_max, Some(131072));
        // A content header frame: 7 bytes of frame header, 12 of class, weight and body size,
        // the properties and the frame-end byte.
        assert!(header_fits(16 * 1024 - 20, 16 * 1024));
        assert!(!header_fits(16 * 1024 - 19, 16 * 1024));
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
