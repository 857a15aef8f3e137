//! Where `leasectl relay` publishes events: one module per sink `--sink` accepts.
//!
//! A sink is chosen by `--sink SINK` ([`SinkSpec::parse`], a usage error when malformed) and
//! opened once by the relay ([`Sink::open`]). The relay then calls [`Sink::deliver`] for each
//! event — concurrently for events of different aggregates, one at a time within an aggregate —
//! and [`Sink::flush`] once per batch. An event counts as delivered only when `deliver` (and the
//! batch's `flush`) returned `Ok`: the sink confirmed it.
//!
//! Failures come in two kinds, because they are handled differently:
//!
//! * [`DeliveryError::Rejected`]: the sink answered and refused *this event* (HTTP non-2xx, a
//!   broker nack or an unroutable message, a command that exited non-zero, no confirmation
//!   a webhook request sent and then answered by a reset). It costs the
//!   event an attempt; after `--max-attempts` it is dead.
//! * [`DeliveryError::NoAnswer`]: no answer within `--timeout`. It is the event's refusal
//!   (charged) when the sink answered another delivery of the batch while this one waited,
//!   else the sink counts as unavailable (nothing charged): a broker black-holed for minutes
//!   used to charge every event an attempt per `--timeout` and turn healthy events dead.
//! * [`DeliveryError::Unavailable`]: the sink could not be reached at all (connection refused or
//!   lost). No attempt is counted — a broker outage must not kill events. If nothing in the
//!   batch got through, the relay backs off and tries again later; if other deliveries of the
//!   batch did get through, only the aggregate concerned stops for this batch
//!   ([`crate::relay::publish`]). Sinks reconnect lazily on the next `deliver`.
//! * [`DeliveryError::Late`]: the event did not leave, because its batch's transaction may have
//!   ended before it could ([`Gate`]): nothing charged, and its aggregate stops for the batch.
//!
//! Every delivery is handed its batch's [`Gate`] and looks at it at the last moment before the
//! event is irrevocably out, so that an event held up after the relay's check (a paused relay,
//! a webhook connection still being made) never reaches the sink after another relay may have
//! claimed its aggregate.

// The network sinks are Cargo features, on by default: `--no-default-features` builds a smaller
// binary without lapin, async-nats and reqwest (stdout and exec: remain), e.g. for cron hosts
// that only `run`. A sink asked for but left out is a usage error naming its feature.
#[cfg(feature = "amqp")]
pub mod amqp;
pub mod exec;
pub mod format;
#[cfg(feature = "http")]
pub mod http;
#[cfg(feature = "nats")]
pub mod nats;
pub mod stdout;

use std::time::Duration;

pub use crate::relay::liveness::Gate;
/// The event every sink publishes; it lives with the outbox's SQL, which builds it.
pub use crate::store::outbox::Event;
/// What a sink publishes for it (`--format`).
pub use format::Format;

/// Why an event was not delivered; see the module documentation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeliveryError {
    /// The sink refused this event: counts as an attempt.
    Rejected(String),
    /// The sink is unreachable: no attempt is counted; the relay backs off.
    Unavailable(String),
    /// No answer within `--timeout` (no confirm, no ack, no response, a command that did not
    /// finish). This event's refusal only if the sink answered other deliveries meanwhile: a
    /// sink that answers nobody is down, not refusing ([`crate::relay::publish`]).
    NoAnswer(String),
    /// Not sent: the batch's transaction may have ended before the event could leave
    /// ([`Gate`]). Nothing is charged; the event goes out with a later batch.
    Late(String),
}

impl DeliveryError {
    /// What a delivery turned away by its gate reports.
    pub fn late() -> DeliveryError {
        DeliveryError::Late(
            "not sent: the batch's transaction may have ended before it could leave".into(),
        )
    }
}

impl std::fmt::Display for DeliveryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeliveryError::Rejected(m)
            | DeliveryError::Unavailable(m)
            | DeliveryError::NoAnswer(m)
            | DeliveryError::Late(m) => f.write_str(m),
        }
    }
}

/// A parsed `--sink` value.
#[derive(Debug, Clone)]
pub enum SinkSpec {
    Stdout,
    Exec(exec::Spec),
    #[cfg(feature = "http")]
    Http(http::Spec),
    #[cfg(feature = "amqp")]
    Amqp(amqp::Spec),
    #[cfg(feature = "nats")]
    Nats(nats::Spec),
}

impl SinkSpec {
    /// Parses `stdout`, `exec:COMMAND`, `amqp://…`, `amqps://…`, `nats://…`, `tls://…`,
    /// `http://…` or `https://…`. The message never repeats a password.
    pub fn parse(s: &str) -> Result<SinkSpec, String> {
        let lower = s.to_ascii_lowercase();
        if s == "stdout" || s == "-" {
            Ok(SinkSpec::Stdout)
        } else if let Some(cmd) = s.strip_prefix("exec:") {
            exec::Spec::parse(cmd).map(SinkSpec::Exec)
        } else if lower.starts_with("http://") || lower.starts_with("https://") {
            parse_http(s)
        } else if lower.starts_with("amqp://") || lower.starts_with("amqps://") {
            parse_amqp(s)
        } else if lower.starts_with("nats://") || lower.starts_with("tls://") {
            parse_nats(s)
        } else {
            Err(format!(
                "unknown sink '{}' (expected stdout, exec:COMMAND, amqp://…, nats://… or http(s)://…)",
                redact(s)
            ))
        }
    }

    /// Whether what the sink publishes to depends on the database the relay serves (an AMQP
    /// URL without `?exchange=`: [`SinkSpec::for_deployment`]).
    pub fn needs_deployment(&self) -> bool {
        match self {
            #[cfg(feature = "amqp")]
            SinkSpec::Amqp(s) => !s.exchange_given,
            _ => false,
        }
    }

    /// Fills in what depends on the database the relay serves (`database`, as the server names
    /// it, and `schema`): an AMQP URL without `?exchange=` publishes to this deployment's own
    /// exchange ([`amqp::default_exchange`]), so that two deployments on one RabbitMQ vhost never
    /// publish into each other's queues. Returns what the operator should be told (the exchange
    /// chosen, a login as guest).
    #[allow(unused_variables)]
    pub fn for_deployment(&mut self, database: &str, schema: &str) -> Vec<String> {
        match self {
            #[cfg(feature = "amqp")]
            SinkSpec::Amqp(s) => s.for_deployment(database, schema),
            _ => Vec::new(),
        }
    }

    /// How the sink is named in messages, without any password.
    pub fn describe(&self) -> String {
        match self {
            SinkSpec::Stdout => "stdout".into(),
            SinkSpec::Exec(s) => format!("exec:{}", s.command),
            #[cfg(feature = "http")]
            SinkSpec::Http(s) => redact(s.url.as_str()),
            #[cfg(feature = "amqp")]
            SinkSpec::Amqp(s) => s.describe(),
            #[cfg(feature = "nats")]
            SinkSpec::Nats(s) => s.describe(),
        }
    }
}

// Each network sink's parser, or the usage error of a binary built without its feature.
#[cfg(feature = "http")]
fn parse_http(s: &str) -> Result<SinkSpec, String> {
    http::Spec::parse(s).map(SinkSpec::Http)
}
#[cfg(not(feature = "http"))]
fn parse_http(s: &str) -> Result<SinkSpec, String> {
    Err(not_compiled_in(s, "http"))
}
#[cfg(feature = "amqp")]
fn parse_amqp(s: &str) -> Result<SinkSpec, String> {
    amqp::Spec::parse(s).map(SinkSpec::Amqp)
}
#[cfg(not(feature = "amqp"))]
fn parse_amqp(s: &str) -> Result<SinkSpec, String> {
    Err(not_compiled_in(s, "amqp"))
}
#[cfg(feature = "nats")]
fn parse_nats(s: &str) -> Result<SinkSpec, String> {
    nats::Spec::parse(s).map(SinkSpec::Nats)
}
#[cfg(not(feature = "nats"))]
fn parse_nats(s: &str) -> Result<SinkSpec, String> {
    Err(not_compiled_in(s, "nats"))
}

/// `the amqp:// sink needs the "amqp" feature: …`, naming the scheme as the user wrote it
/// (lower-cased) and never the rest of the URL, which may hold a password.
#[cfg(not(all(feature = "http", feature = "amqp", feature = "nats")))]
fn not_compiled_in(sink: &str, feature: &str) -> String {
    let scheme = sink.split_once("://").map_or(sink, |(scheme, _)| scheme);
    format!(
        "the {}:// sink needs the \"{feature}\" feature: cargo install leasectl --features {feature}",
        scheme.to_ascii_lowercase()
    )
}

/// How many aggregates the broker sinks have in flight at once: at least a batch of the
/// benchmark's `--batch 1000`, as many as a reference client keeps unconfirmed.
#[cfg(any(feature = "amqp", feature = "nats"))]
const BROKER_PARALLELISM: usize = 1024;

/// Options every sink honours.
#[derive(Debug, Clone)]
pub struct SinkOptions {
    /// How long one delivery may take (HTTP response, broker confirm, command run).
    pub timeout: Duration,
    /// What is published for an event (`--format`, `--source`).
    pub format: Format,
}

/// An open sink.
pub enum Sink {
    Stdout(stdout::Stdout),
    Exec(exec::Exec),
    #[cfg(feature = "http")]
    Http(http::Http),
    #[cfg(feature = "amqp")]
    Amqp(amqp::Amqp),
    #[cfg(feature = "nats")]
    Nats(nats::Nats),
}

impl Sink {
    /// Opens the sink. An unreachable broker is not an error here: the connection is made
    /// lazily by the first `deliver`, so a relay started before its broker just waits for it.
    pub fn open(spec: &SinkSpec, opts: SinkOptions) -> anyhow::Result<Sink> {
        Ok(match spec {
            SinkSpec::Stdout => Sink::Stdout(stdout::Stdout::new(opts.format)),
            SinkSpec::Exec(s) => Sink::Exec(exec::Exec::new(s.clone(), opts)),
            #[cfg(feature = "http")]
            SinkSpec::Http(s) => Sink::Http(http::Http::new(s.clone(), opts)?),
            #[cfg(feature = "amqp")]
            SinkSpec::Amqp(s) => Sink::Amqp(amqp::Amqp::new(s.clone(), opts)),
            #[cfg(feature = "nats")]
            SinkSpec::Nats(s) => Sink::Nats(nats::Nats::new(s.clone(), opts)),
        })
    }

    /// Publishes one event and waits for the sink to confirm it, sending nothing once `gate`
    /// has closed. May be called concurrently (for events of different aggregates) from the
    /// relay's single thread.
    pub async fn deliver(&self, event: &Event, gate: &Gate) -> Result<(), DeliveryError> {
        match self {
            // Buffered until `flush`, which the relay calls only while the batch is known open.
            Sink::Stdout(s) => s.deliver(event),
            Sink::Exec(s) => s.deliver(event, gate).await,
            #[cfg(feature = "http")]
            Sink::Http(s) => s.deliver(event, gate).await,
            #[cfg(feature = "amqp")]
            Sink::Amqp(s) => s.deliver(event, gate).await,
            // Boxed: the JetStream publication's future is several kilobytes, and inline it would
            // make every sink's deliveries that large — the relay holds one per aggregate in
            // flight, up to a thousand, whatever the sink.
            #[cfg(feature = "nats")]
            Sink::Nats(s) => Box::pin(s.deliver(event, gate)).await,
        }
    }

    /// Completes the batch: everything `deliver` accepted is confirmed once this returns `Ok`.
    /// Only stdout buffers; the others confirm each event inside `deliver`.
    pub async fn flush(&self) -> Result<(), DeliveryError> {
        match self {
            Sink::Stdout(s) => s.flush(),
            _ => Ok(()),
        }
    }

    /// Whether `deliver` only buffers, publishing nothing before `flush` (stdout): its
    /// deliveries cannot fail or wait, and what must happen while the batch's transaction is
    /// known open is the flush alone.
    pub fn buffers_until_flush(&self) -> bool {
        matches!(self, Sink::Stdout(_))
    }

    /// Drops what `deliver` accepted but did not publish yet (only stdout buffers, until
    /// `flush`): the batch is not to be published after all.
    pub fn discard(&self) {
        if let Sink::Stdout(s) = self {
            s.discard();
        }
    }

    /// How long after its delivery started an event may still reach the sink's consumers: a
    /// command or a webhook's handler may act on it until it is stopped or given up on
    /// (`timeout`); a broker has it as soon as it is written, and stdout's buffer is written at
    /// once, by `flush`.
    pub fn in_flight(&self, timeout: Duration) -> Duration {
        match self {
            Sink::Exec(_) => timeout,
            #[cfg(feature = "http")]
            Sink::Http(_) => timeout,
            _ => Duration::ZERO,
        }
    }

    /// Whether publishing a batch blocks the relay's thread: stdout is written by one blocking
    /// write at the batch's end, so nothing else the relay has under way moves meanwhile, and
    /// a batch claimed ahead could only be claimed after the write, never beside it (the relay
    /// then waits for that claim too, on a second connection it opened for nothing).
    pub fn blocks_the_relay(&self) -> bool {
        matches!(self, Sink::Stdout(_))
    }

    /// How many aggregates may be in flight at once within a batch.
    pub fn parallelism(&self) -> usize {
        match self {
            Sink::Stdout(_) => 1,
            Sink::Exec(_) => 4,
            // The brokers confirm many publications in flight at once (the AMQP sink gathers
            // them into groups on one channel, JetStream acks each by its own reply subject):
            // a whole batch of aggregates goes out together.
            #[cfg(feature = "amqp")]
            Sink::Amqp(_) => BROKER_PARALLELISM,
            #[cfg(feature = "nats")]
            Sink::Nats(_) => BROKER_PARALLELISM,
            // The webhook (unreachable when it is not compiled in).
            #[allow(unreachable_patterns)]
            _ => 64,
        }
    }
}

/// What `leasectl doctor --sink` found out about a sink without publishing anything: a
/// verdict, what was seen (no password in it), and for a warning or a failure what to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probed {
    Ok(String),
    Warn(String, String),
    Fail(String, String),
}

impl SinkSpec {
    /// Looks at the sink the way the relay would reach it — connecting, logging in, looking up
    /// the exchange or the stream — within `timeout`, and never publishes: a probe message could
    /// reach a consumer. `deployment` is the database (as its server names it) and schema, for
    /// an AMQP URL without `?exchange=` (see [`SinkSpec::for_deployment`]); `None` when the
    /// database could not be asked.
    #[allow(unused_variables)]
    pub async fn probe(&self, timeout: Duration, deployment: Option<(&str, &str)>) -> Probed {
        match self {
            SinkSpec::Stdout => Probed::Ok("stdout: nothing to reach".into()),
            SinkSpec::Exec(s) => Probed::Ok(format!(
                "exec:{}: not run (running it would deliver to it); the relay runs it once per event",
                s.command
            )),
            #[cfg(feature = "http")]
            SinkSpec::Http(s) => s.probe(timeout).await,
            #[cfg(feature = "amqp")]
            SinkSpec::Amqp(s) => {
                let mut s = s.clone();
                if let Some((database, schema)) = deployment {
                    s.for_deployment(database, schema);
                } else if !s.exchange_given {
                    return Probed::Warn(
                        format!("{}: no ?exchange= and the database could not be asked which deployment's exchange the relay would use", redact(&s.url)),
                        "name the exchange with ?exchange=NAME, or make the database reachable".into(),
                    );
                }
                s.probe(timeout).await
            }
            #[cfg(feature = "nats")]
            SinkSpec::Nats(s) => s.probe(timeout).await,
        }
    }
}

/// Replaces the password in `scheme://user:password@host…` with `***`.
pub fn redact(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_owned();
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    match (authority.rfind('@'), authority.find(':')) {
        (Some(at), Some(colon)) if colon < at => format!(
            "{}{}:***{}",
            &url[..scheme_end + 3],
            &authority[..colon],
            &url[scheme_end + 3 + at..]
        ),
        _ => url.to_owned(),
    }
}

/// Splits `?a=1&b=2` off a URL: the URL without the keys in `ours`, and their values.
/// Used by the broker sinks, whose own options (`exchange`, `subject`, `stream`) are not part
/// of the broker's URL.
pub fn take_query_params(url: &str, ours: &[&str]) -> (String, Vec<(String, String)>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_owned(), Vec::new());
    };
    let (query, fragment) = match query.split_once('#') {
        Some((q, f)) => (q, Some(f)),
        None => (query, None),
    };
    let mut kept = Vec::new();
    let mut taken = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if ours.contains(&k) {
            taken.push((k.to_owned(), percent_decode(v)));
        } else {
            kept.push(pair);
        }
    }
    let mut out = base.to_owned();
    if !kept.is_empty() {
        out.push('?');
        out.push_str(&kept.join("&"));
    }
    if let Some(f) = fragment {
        out.push('#');
        out.push_str(f);
    }
    (out, taken)
}

/// Decodes `%XX` escapes (and `+` as a space is *not* applied: these are URL paths and values).
pub fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
            if let Some(b) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords_only() {
        assert_eq!(
            redact("amqp://guest:secret@host:5672/%2f?exchange=x"),
            "amqp://guest:***@host:5672/%2f?exchange=x"
        );
        assert_eq!(redact("nats://host:4222"), "nats://host:4222");
        assert_eq!(redact("https://u@h/p:q@r"), "https://u@h/p:q@r");
    }

    #[test]
    fn takes_only_our_query_parameters() {
        let (url, ours) = take_query_params(
            "amqp://h/%2f?heartbeat=10&exchange=ev%2Ets&x=1",
            &["exchange"],
        );
        assert_eq!(url, "amqp://h/%2f?heartbeat=10&x=1");
        assert_eq!(ours, vec![("exchange".to_owned(), "ev.ts".to_owned())]);
        let (url, ours) = take_query_params("nats://h:4222?subject=a", &["subject"]);
        assert_eq!(url, "nats://h:4222");
        assert_eq!(ours.len(), 1);
    }

    #[test]
    fn unknown_sinks_are_refused_without_the_password() {
        let e = SinkSpec::parse("kafka://u:pw@h").unwrap_err();
        assert!(e.contains("unknown sink") && !e.contains("pw"), "{e}");
        assert!(matches!(SinkSpec::parse("stdout"), Ok(SinkSpec::Stdout)));
    }
}
