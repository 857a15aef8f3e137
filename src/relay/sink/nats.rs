//! `--sink nats://…` / `tls://…`: NATS JetStream, waiting for the stream's ack.
//!
//! Each event is published to `PREFIX.<event type>` (`?subject=PREFIX`, default `leasectl`)
//! with the header `Nats-Msg-Id` = event id, so the stream drops a re-publication within its
//! duplicate window (a relay that died before marking the event processed); the payload is the
//! event JSON. An event is delivered once JetStream acked it — a duplicate ack included, since
//! the stream already holds the event. `subject` and `stream` are our parameters and removed
//! before async-nats sees the URL; several servers may be given, comma-separated.
//!
//! With `--format cloudevents` the message is in CloudEvents' binary mode, per the NATS binding:
//! the payload is the body and every attribute, `datacontenttype` included, is a `ce-NAME`
//! header, percent-encoded as the binding says ([`super::format`]).
//!
//! Choices worth knowing:
//!
//! * **Lazy connection.** [`Nats::new`] connects to nothing; the first [`Nats::deliver`] does.
//!   If the server is down then, the delivery is `Unavailable` and the next one tries again.
//!   Once connected, async-nats reconnects by itself (forever) when the connection drops, so the
//!   client is kept for the life of the sink. Connecting happens under a lock, and deliveries
//!   that waited for a failed attempt share its verdict instead of each trying again.
//! * **A lost connection is said at once.** Publications made while async-nats reconnects wait
//!   for it, up to `--timeout`, before the relay can tell the sink is down; so the sink warns
//!   once when the connection drops and once when it is back, from the client's
//!   event callback.
//! * **The stream is ensured once per connection**, by looking up which stream captures
//!   `PREFIX.>` (JetStream's own subject lookup). An existing stream is used whatever its name —
//!   the operator's configuration wins. Only when none exists is stream `?stream=NAME` (default
//!   `LEASECTL`) created with subjects `[PREFIX.>]`, file storage and the server's defaults
//!   (a 2-minute duplicate window). A publication answered with "no responders" means no stream
//!   captures the subject any more (deleted by an operator, say): it is `Unavailable`, and the
//!   next delivery looks the stream up again, creating it if missing.
//!
//! Failures, classified as in [`super`]:
//!
//! | what happened | result |
//! |---|---|
//! | server unreachable at connect, JetStream unavailable, stream lookup or creation failed | `Unavailable` |
//! | no stream captures the subject ("no responders") | `Unavailable`; the stream is ensured again next time |
//! | error ack while connected | `Rejected` |
//! | no ack within `--timeout` while connected | `NoAnswer` (the event's refusal if the server acked others meanwhile) |
//! | the same while the client is disconnected (reconnecting) | `Unavailable` |
//! | event type that is not a valid subject suffix (empty token, whitespace, `*`, `>`) | `Rejected` |

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use async_nats::connection::State as ConnectionState;
use async_nats::jetstream::context::{GetStreamByNameErrorKind, PublishError, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, stream};
use async_nats::{Client, ConnectOptions, ServerAddr};

use super::format::percent_encode_header;
use super::{DeliveryError, Event, Gate, SinkOptions};

/// The subject prefix used when the URL has no `?subject=`.
pub const DEFAULT_SUBJECT: &str = "leasectl";
/// The stream created (when none captures the subjects) when the URL has no `?stream=`.
pub const DEFAULT_STREAM: &str = "LEASECTL";

/// A parsed `--sink nats://…`. Its `Debug` output, like [`Spec::describe`], has no password or
/// token.
#[derive(Clone)]
pub struct Spec {
    /// The server URL(s) without our `subject` and `stream` parameters.
    pub url: String,
    /// The subject prefix: events go to `subject.<event type>`.
    pub subject: String,
    /// The name of the stream created when none captures `subject.>`.
    pub stream: String,
}

impl std::fmt::Debug for Spec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spec")
            .field("url", &redact(&self.url))
            .field("subject", &self.subject)
            .field("stream", &self.stream)
            .finish()
    }
}

impl Spec {
    /// Parses `nats://[user:password@ | token@]host[:port][,nats://…][?subject=P&stream=S]`
    /// (or `tls://…`). The error is one line and never repeats a password or token.
    pub fn parse(url: &str) -> Result<Spec, String> {
        let (url, ours) = super::take_query_params(url, &["subject", "stream"]);
        let get = |key: &str, default: &str| {
            ours.iter()
                .find(|(k, _)| k == key)
                .map_or_else(|| default.to_owned(), |(_, v)| v.clone())
        };
        let spec = Spec {
            subject: get("subject", DEFAULT_SUBJECT),
            stream: get("stream", DEFAULT_STREAM),
            url,
        };
        let shown = redact(&spec.url);
        // The parser's messages never quote the URL, so they cannot leak a secret.
        spec.servers()
            .map_err(|e| format!("invalid NATS URL {shown}: {e}"))?;
        if let Some(bad) = bad_subject(&spec.subject) {
            return Err(format!(
                "NATS URL {shown}: subject prefix '{}' {bad}",
                spec.subject
            ));
        }
        // Stream names are also file names on the server: no separators or wildcards.
        if spec.stream.is_empty()
            || spec.stream.len() > 255
            || spec.stream.chars().any(|c| {
                c.is_whitespace() || c.is_control() || matches!(c, '.' | '*' | '>' | '/' | '\\')
            })
        {
            return Err(format!(
                "NATS URL {shown}: stream name '{}' must be 1-255 characters without whitespace, '.', '*', '>', '/' or '\\'",
                spec.stream
            ));
        }
        Ok(spec)
    }

    /// How the sink is named in messages, without any password or token.
    pub fn describe(&self) -> String {
        format!(
            "{} subject {}.* stream {}",
            redact(&self.url),
            self.subject,
            self.stream
        )
    }

    /// The server addresses of `url`, which may list several, comma-separated.
    fn servers(&self) -> Result<Vec<ServerAddr>, String> {
        self.url
            .split(',')
            .map(|one| {
                let one = one.trim();
                if one.is_empty() {
                    return Err("empty server address".to_owned());
                }
                let addr = one.parse::<ServerAddr>().map_err(|e| e.to_string())?;
                if addr.host().is_empty() {
                    return Err("no host".to_owned());
                }
                Ok(addr)
            })
            .collect()
    }
}

impl Spec {
    /// `leasectl doctor --sink`: connects (credentials included), then asks JetStream which
    /// stream captures `PREFIX.>`; creates nothing and publishes nothing.
    pub async fn probe(&self, timeout: std::time::Duration) -> super::Probed {
        use super::Probed;
        let shown = redact(&self.url);
        let servers = match self.servers() {
            Ok(s) => s,
            Err(e) => {
                return Probed::Fail(
                    format!("invalid NATS URL {shown}: {e}"),
                    "fix --sink".into(),
                )
            }
        };
        let wildcard = format!("{}.>", self.subject);
        let look = async {
            let client = ConnectOptions::new()
                .name("leasectl doctor")
                .connection_timeout(timeout)
                .request_timeout(Some(timeout))
                .connect(servers)
                .await
                .map_err(|e| (true, format!("cannot connect: {e}")))?;
            let js = jetstream::ContextBuilder::new()
                .timeout(timeout)
                .build(client.clone());
            let found = js.stream_by_subject(wildcard.as_str()).await;
            drop(client);
            match found {
                Ok(name) => Ok(Some(name)),
                Err(e) if e.kind() == GetStreamByNameErrorKind::NotFound => Ok(None),
                Err(e) => Err((
                    false,
                    format!("cannot look up the JetStream stream for {wildcard}: {e}"),
                )),
            }
        };
        match tokio::time::timeout(timeout, look).await {
            Err(_) => Probed::Fail(
                format!("{shown}: no answer within {}", crate::fmt::duration(timeout)),
                "check the server's host, port and firewall".into(),
            ),
            Ok(Err((true, why))) => Probed::Fail(
                format!("{shown}: {why}"),
                "check the URL's host, port and credentials (the relay would retry, delivering nothing)".into(),
            ),
            Ok(Err((false, why))) => Probed::Fail(
                format!("{shown}: connected; {why}"),
                "enable JetStream on the server (nats-server -js), and let this user use its API".into(),
            ),
            Ok(Ok(Some(stream))) => Probed::Ok(format!(
                "{shown}: connected; stream {stream} captures {wildcard}"
            )),
            Ok(Ok(None)) => Probed::Ok(format!(
                "{shown}: connected; no stream captures {wildcard} yet: the relay creates stream {} (file storage, the server's defaults) on its first delivery",
                self.stream
            )),
        }
    }
}

/// [`super::redact`] for every server of the list, and a bare `token@` hidden too (NATS takes
/// a lone user-info as a token).
fn redact(url: &str) -> String {
    url.split(',')
        .map(|one| {
            let redacted = super::redact(one);
            if redacted != one {
                return redacted; // user:password
            }
            let Some(scheme_end) = one.find("://") else {
                return redacted;
            };
            let rest = &one[scheme_end + 3..];
            let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
            match authority.rfind('@') {
                Some(at) => format!("{}***{}", &one[..scheme_end + 3], &rest[at..]),
                None => redacted,
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Why `subject` is not a valid publish subject (tokens separated by `.`, none empty, no
/// wildcards or whitespace), if it is not.
fn bad_subject(subject: &str) -> Option<&'static str> {
    if subject.is_empty() {
        Some("is empty")
    } else if subject.split('.').any(str::is_empty) {
        Some("has an empty token (a leading, trailing or double '.')")
    } else if subject.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Some("contains whitespace")
    } else if subject.split('.').any(|t| t == "*" || t == ">") {
        Some("contains a wildcard token ('*' or '>')")
    } else {
        None
    }
}

/// The NATS JetStream sink. Cheap to create; connects on the first delivery.
pub struct Nats {
    spec: Spec,
    opts: SinkOptions,
    /// The client, once connected, and whether the stream is known to exist; the lock
    /// serialises connecting and ensuring the stream.
    state: tokio::sync::Mutex<State>,
    /// Failed attempts to get ready so far: a delivery that waited for the lock while an
    /// attempt failed reports that failure instead of making another attempt.
    failures: AtomicU64,
}

#[derive(Default)]
struct State {
    /// Boxed: a connected client is large, and the sink lives in an enum of sinks.
    client: Option<Box<(Client, jetstream::Context)>>,
    stream_ready: bool,
    last_error: String,
}

impl Nats {
    pub fn new(spec: Spec, opts: SinkOptions) -> Nats {
        Nats {
            spec,
            opts,
            state: tokio::sync::Mutex::new(State::default()),
            failures: AtomicU64::new(0),
        }
    }

    /// Publishes `event` and waits for JetStream's ack; see the module documentation for how
    /// failures are classified.
    pub async fn deliver(&self, event: &Event, gate: &Gate) -> Result<(), DeliveryError> {
        if let Some(bad) = bad_subject(&event.event_type) {
            return Err(DeliveryError::Rejected(format!(
                "event type '{}' {bad}, so it cannot end a NATS subject",
                event.event_type
            )));
        }
        let subject = format!("{}.{}", self.spec.subject, event.event_type);
        let (client, js) = self.ready().await?;
        // Connecting may have taken a while after the relay's check.
        if !gate.allows_now() {
            return Err(DeliveryError::late());
        }

        let mut publish = PublishMessage::build()
            .payload(self.opts.format.body(event).into())
            .message_id(event.id.to_string());
        for (name, value) in self.opts.format.attributes(event) {
            publish = publish.header(
                format!("ce-{name}").as_str(),
                percent_encode_header(&value).as_str(),
            );
        }
        let acked = tokio::time::timeout(self.opts.timeout, async {
            js.send_publish(subject.clone(), publish).await?.await
        })
        .await;

        let why = match acked {
            // Stored — or a duplicate (`ack.duplicate`): the stream already holds it either way.
            Ok(Ok(_ack)) => return Ok(()),
            Ok(Err(e)) if e.kind() == PublishErrorKind::StreamNotFound => {
                self.state.lock().await.stream_ready = false;
                return Err(DeliveryError::Unavailable(format!(
                    "no JetStream stream captures subject {subject} (no responders); \
                     looking for one, or creating it, on the next delivery"
                )));
            }
            Ok(Err(e)) if e.kind() != PublishErrorKind::TimedOut => (publish_message(&e), false),
            Ok(Err(_)) | Err(_) => (
                format!(
                    "no ack within {}",
                    humantime::format_duration(self.opts.timeout)
                ),
                true,
            ),
        };
        let (why, silent) = why;
        let message = format!("{subject}: {why}");
        if client.connection_state() == ConnectionState::Connected {
            if silent {
                return Err(DeliveryError::NoAnswer(message));
            }
            Err(DeliveryError::Rejected(message))
        } else {
            Err(DeliveryError::Unavailable(format!(
                "{message} (disconnected from the server)"
            )))
        }
    }

    /// The client and its JetStream context, connecting and ensuring the stream as needed.
    async fn ready(&self) -> Result<(Client, jetstream::Context), DeliveryError> {
        let failures_seen = self.failures.load(Ordering::Relaxed);
        let mut state = self.state.lock().await;
        if let (Some(ready), true) = (&state.client, state.stream_ready) {
            return Ok((ready.0.clone(), ready.1.clone()));
        }
        if self.failures.load(Ordering::Relaxed) != failures_seen {
            // An attempt failed while we waited for the lock: share its verdict.
            return Err(DeliveryError::Unavailable(state.last_error.clone()));
        }
        let attempt = tokio::time::timeout(self.opts.timeout, self.prepare(&mut state)).await;
        let error = match attempt {
            Ok(Ok(ready)) => return Ok(ready),
            Ok(Err(e)) => e,
            Err(_elapsed) => format!(
                "not ready within {}",
                humantime::format_duration(self.opts.timeout)
            ),
        };
        self.failures.fetch_add(1, Ordering::Relaxed);
        state.last_error = error.clone();
        Err(DeliveryError::Unavailable(error))
    }

    /// Connects if not yet connected, then makes sure a stream captures our subjects.
    async fn prepare(&self, state: &mut State) -> Result<(Client, jetstream::Context), String> {
        if state.client.is_none() {
            let servers = self
                .spec
                .servers()
                .map_err(|e| format!("invalid NATS URL {}: {e}", redact(&self.spec.url)))?;
            let client = ConnectOptions::new()
                .name("leasectl relay")
                .event_callback(connection_events(self.spec.describe()))
                .connection_timeout(self.opts.timeout)
                .request_timeout(Some(self.opts.timeout))
                .connect(servers)
                .await
                .map_err(|e| format!("cannot connect: {e}"))?;
            let js = jetstream::ContextBuilder::new()
                .timeout(self.opts.timeout)
                .build(client.clone());
            state.client = Some(Box::new((client, js)));
            state.stream_ready = false;
        }
        let (client, js) = *state.client.clone().expect("connected above");
        self.ensure_stream(&js).await?;
        state.stream_ready = true;
        Ok((client, js))
    }

    /// Finds the stream capturing `PREFIX.>`, or creates ours.
    async fn ensure_stream(&self, js: &jetstream::Context) -> Result<(), String> {
        let wildcard = format!("{}.>", self.spec.subject);
        match js.stream_by_subject(wildcard.as_str()).await {
            Ok(_existing) => Ok(()),
            Err(e) if e.kind() == GetStreamByNameErrorKind::NotFound => {
                let config = stream::Config {
                    name: self.spec.stream.clone(),
                    subjects: vec![wildcard.clone()],
                    storage: stream::StorageType::File,
                    ..Default::default()
                };
                js.create_stream(config).await.map(drop).map_err(|e| {
                    format!(
                        "no stream captures {wildcard} and creating stream {} failed: {e}",
                        self.spec.stream
                    )
                })
            }
            Err(e) => Err(format!(
                "cannot look up the JetStream stream for {wildcard} (is JetStream enabled?): {e}"
            )),
        }
    }
}

/// The client's event callback: warns once when the connection is lost and once when it is
/// back (async-nats reconnects by itself, and says `Connected` on the first connection too).
fn connection_events(
    sink: String,
) -> impl Fn(async_nats::Event) -> std::future::Ready<()> + Send + Sync + 'static {
    let lost: Mutex<Option<Instant>> = Mutex::new(None);
    move |event| {
        let mut lost = lost.lock().unwrap_or_else(|e| e.into_inner());
        match event {
            async_nats::Event::Disconnected if lost.is_none() => {
                *lost = Some(Instant::now());
                warn!("{sink}: lost the connection to the server; reconnecting (deliveries wait for it, up to --timeout each)");
            }
            async_nats::Event::Connected if lost.is_some() => {
                let since = lost.take().expect("checked by the guard");
                warn!(
                    "{sink}: connected again after {}",
                    crate::fmt::duration(since.elapsed())
                );
            }
            _ => {}
        }
        std::future::ready(())
    }
}

/// A publish error as one line, with JetStream's own description when it gave one.
fn publish_message(e: &PublishError) -> String {
    match std::error::Error::source(e) {
        Some(source) => format!("{}: {source}", e.kind()),
        None => e.kind().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_custom_subject_and_stream() {
        let s = Spec::parse("nats://127.0.0.1:4222").unwrap();
        assert_eq!(
            (s.subject.as_str(), s.stream.as_str()),
            ("leasectl", "LEASECTL")
        );
        assert_eq!(s.url, "nats://127.0.0.1:4222");
        let s = Spec::parse("tls://h:4222?subject=app.events&stream=APP_EVENTS").unwrap();
        assert_eq!(s.subject, "app.events");
        assert_eq!(s.stream, "APP_EVENTS");
        assert_eq!(s.url, "tls://h:4222");
        assert_eq!(s.servers().unwrap().len(), 1);
        let s = Spec::parse("nats://a:4222,nats://b:4223?stream=X").unwrap();
        assert_eq!(s.servers().unwrap().len(), 2);
    }

    #[test]
    fn garbage_is_refused_without_secrets() {
        for bad in [
            "nats://u:s3cret@h:notaport",
            "nats://u:s3cret@h:4222,",
            "nats://u:s3cret@h?subject=a..b",
            "nats://u:s3cret@h?subject=a.*",
            "nats://u:s3cret@h?subject=",
            "nats://u:s3cret@h?stream=a.b",
            "nats://s3cret@h?stream=",
        ] {
            let e = Spec::parse(bad).unwrap_err();
            assert!(!e.contains("s3cret") && !e.contains('\n'), "{bad}: {e}");
            assert!(e.contains("NATS URL"), "{bad}: {e}");
        }
    }

    #[test]
    fn describe_and_debug_hide_passwords_and_tokens() {
        let s = Spec::parse("nats://u:s3cret@h:4222,nats://t0ken@g:4222?stream=S").unwrap();
        let d = s.describe();
        assert_eq!(
            d,
            "nats://u:***@h:4222,nats://***@g:4222 subject leasectl.* stream S"
        );
        let debug = format!("{s:?}");
        assert!(
            !debug.contains("s3cret") && !debug.contains("t0ken"),
            "{debug}"
        );
        assert_eq!(redact("nats://h:4222"), "nats://h:4222");
    }

    #[test]
    fn event_types_must_make_valid_subjects() {
        assert_eq!(bad_subject("order.paid"), None);
        assert!(bad_subject("order paid").is_some());
        assert!(bad_subject("order.").is_some());
        assert!(bad_subject(">").is_some());
        assert!(bad_subject("").is_some());
    }
}
