//! `--sink http(s)://…`: a webhook. Each event is one `POST` of its JSON; a 2xx answer means
//! delivered.
//!
//! One [`reqwest::Client`] is built when the sink opens and shared by every delivery, so
//! concurrent deliveries (one per aggregate in flight) reuse a pool of keep-alive connections
//! instead of connecting per event. Every request carries:
//!
//! * `Content-Type: application/json` and the event's published JSON as the body — with
//!   `--format cloudevents`, CloudEvents' binary mode instead: the payload as the body and each
//!   attribute but `datacontenttype` (which is the `Content-Type`) as a `ce-` header, its value
//!   percent-encoded as the HTTP binding says ([`super::format`]);
//! * `Idempotency-Key: <event id>` — delivery is at least once, so the receiver deduplicates on it;
//! * `X-Leasectl-Event-Type: <type>` and `X-Leasectl-Aggregate: <aggregate_type>:<aggregate_id>`,
//!   so a receiver can route without parsing the body (characters that may not appear in a
//!   header — anything but visible ASCII, plus `%` — are percent-encoded);
//! * `User-Agent: leasectl/<version>`;
//! * `Authorization: Basic …` when the URL has `user:password@`. The credentials are taken out of
//!   the URL when the sink opens, so no error message or debug output can repeat them; messages
//!   name the URL with the password replaced by `***` ([`super::redact`]).
//!
//! How failures are classified (see [`super::DeliveryError`]):
//!
//! * **NoAnswer**: no complete answer within `--timeout` (the whole exchange: connect, send,
//!   response head and body): the event's refusal if the receiver answered other requests of
//!   the batch meanwhile, else the receiver counts as unavailable.
//! * **Rejected** (costs the event an attempt): any non-2xx status, including 3xx; the
//!   request was sent and the connection was then reset or closed before a response. The last
//!   one is the receiver's answer to *this* event as far as the relay can tell (a receiver that
//!   crashes or drops the connection on one particular event): the event is charged and backs
//!   off on its own schedule, and after `--max-attempts` it is dead, while other aggregates go
//!   on. Counting it as an outage instead backed the whole relay off for one event's sake, for
//!   ever. A receiver restarting mid-request costs the requests in flight one
//!   attempt each, retried after a second.
//! * **Unavailable** (no attempt counted; the relay backs off): the sink could not be reached —
//!   DNS failure, connection refused, connect timeout, TLS handshake failure. None of these says
//!   anything about the event, and a webhook that is down must not kill events.
//!
//! Connecting has its own, shorter limit (`connect_timeout`) so that an unreachable host is
//! reported as unavailable rather than running into the overall timeout, which would count as a
//! rejection.
//!
//! Redirects are not followed. A 301/302/303 answer to a POST is followed by clients as a GET
//! without the body, so "following" would report the event delivered while the receiver never
//! saw it; a 307/308 would re-send it, but to wherever the response points (possibly another
//! host, with our credentials and events). Either way a redirect means `--sink` names the wrong
//! URL, which the operator should fix: it is a rejection whose message says where it pointed.
//!
//! TLS is rustls with the ring provider, verifying against the system's root certificates
//! (`SSL_CERT_FILE` / `SSL_CERT_DIR` override them), like [`crate::db::tls`] does for PostgreSQL.
//! The configuration is handed to reqwest ready-made, so reqwest never needs a process-wide
//! default crypto provider. HTTP proxies from the environment (`HTTPS_PROXY`, `NO_PROXY`, …)
//! are honoured, as curl would.

use std::fmt;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use anyhow::{bail, Context};
use reqwest::header::{HeaderValue, CONTENT_TYPE, LOCATION};
use reqwest::{StatusCode, Url};

use super::format::percent_encode_header;
use super::{redact, DeliveryError, Event, Gate, SinkOptions};

/// Upper bound on connecting (DNS, TCP, TLS) before the webhook counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How much of an error response's body is read for the message.
const ERROR_BODY_READ: usize = 4096;
/// How much of the error body the message quotes, in characters.
const ERROR_BODY_QUOTE: usize = 200;
/// A 2xx response's body is read (and discarded) up to this size so that the connection can go
/// back to the pool; a longer body is dropped unread, which closes that connection.
const SUCCESS_BODY_DRAIN: usize = 64 * 1024;

const USER_AGENT: &str = concat!("leasectl/", env!("CARGO_PKG_VERSION"));

/// A parsed webhook URL (`http://…` or `https://…`, credentials allowed).
#[derive(Clone)]
pub struct Spec {
    /// The checked URL, credentials included: print it only through [`super::redact`].
    pub url: Url,
}

impl Spec {
    /// Checks the URL. The message never repeats it (it may hold a password in a form
    /// `redact` cannot recognise, such as an unescaped `/` in the password).
    pub fn parse(url: &str) -> Result<Spec, String> {
        let parsed = Url::parse(url).map_err(|e| format!("invalid webhook URL: {e}"))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err("a webhook URL must start with http:// or https://".into());
        }
        if parsed.host_str().is_none_or(str::is_empty) {
            return Err("a webhook URL needs a host".into());
        }
        Ok(Spec { url: parsed })
    }
}

impl Spec {
    /// `leasectl doctor --sink`: resolves the host, connects over TCP and, for `https://`,
    /// completes the TLS handshake against the system's roots, then closes the connection
    /// without sending a request (a POST would be a delivery). Goes direct: an HTTP proxy from
    /// the environment, which the relay would use, is named but not tried.
    pub async fn probe(&self, timeout: Duration) -> super::Probed {
        use super::Probed;
        let shown = redact(self.url.as_str());
        let host = self
            .url
            .host_str()
            .unwrap_or_default()
            .trim_matches(['[', ']'])
            .to_owned();
        let port = self.url.port_or_known_default().unwrap_or(80);
        let https = self.url.scheme() == "https";
        let proxy = [
            "HTTPS_PROXY",
            "https_proxy",
            "HTTP_PROXY",
            "http_proxy",
            "ALL_PROXY",
            "all_proxy",
        ]
        .iter()
        .find(|k| std::env::var_os(k).is_some_and(|v| !v.is_empty()))
        .map_or(String::new(), |k| {
            format!(" ({k} is set: the relay may go through that proxy, which was not tried)")
        });
        let config = match tls_config(https) {
            Ok(c) => Arc::new(c),
            Err(e) => {
                return Probed::Fail(
                    format!("{shown}: {e:#}"),
                    "install the system's CA certificates".into(),
                )
            }
        };
        let look = async {
            let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host((host.as_str(), port))
                .await
                .map_err(|e| format!("cannot resolve {host}: {e}"))?
                .collect();
            let mut last = format!("{host} resolves to no address");
            for addr in addrs {
                match tokio::net::TcpStream::connect(addr).await {
                    Ok(tcp) => {
                        if !https {
                            return Ok(format!("connected to {addr}"));
                        }
                        let tcp = tcp.into_std().map_err(|e| e.to_string())?;
                        let (config, name) = (config.clone(), host.clone());
                        return tokio::task::spawn_blocking(move || {
                            handshake(tcp, config, &name, timeout)
                        })
                        .await
                        .map_err(|e| e.to_string())?
                        .map(|v| format!("connected to {addr}, TLS {v} verified"));
                    }
                    Err(e) => last = format!("cannot connect to {addr}: {e}"),
                }
            }
            Err(last)
        };
        match tokio::time::timeout(timeout, look).await {
            Err(_) => Probed::Fail(
                format!("{shown}: no answer within {}{proxy}", crate::fmt::duration(timeout)),
                "check the host, port and firewall".into(),
            ),
            Ok(Err(why)) => Probed::Fail(
                format!("{shown}: {why}{proxy}"),
                "check the URL's host and port, and for https:// the server's certificate".into(),
            ),
            Ok(Ok(how)) => Probed::Ok(format!(
                "{shown}: {how}; no request sent, so whether it accepts the POSTs is not checked{proxy}"
            )),
        }
    }
}

/// A TLS handshake over a connected socket, blocking, each read and write bounded by
/// `timeout`; the negotiated protocol version.
fn handshake(
    tcp: std::net::TcpStream,
    config: Arc<rustls::ClientConfig>,
    host: &str,
    timeout: Duration,
) -> Result<String, String> {
    let mut tcp = tcp;
    tcp.set_nonblocking(false).map_err(|e| e.to_string())?;
    tcp.set_read_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    tcp.set_write_timeout(Some(timeout))
        .map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from(host.to_owned())
        .map_err(|e| format!("{host} is not a TLS server name: {e}"))?;
    let mut conn = rustls::ClientConnection::new(config, name).map_err(|e| e.to_string())?;
    while conn.is_handshaking() {
        conn.complete_io(&mut tcp)
            .map_err(|e| format!("TLS handshake failed: {e}"))?;
    }
    conn.send_close_notify();
    let _ = conn.complete_io(&mut tcp);
    Ok(conn
        .protocol_version()
        .map_or_else(|| "?".to_owned(), |v| format!("{v:?}").replace('_', ".")))
}

/// Shows the URL with its password replaced, so that `{:?}` of a sink spec is safe to log.
impl fmt::Debug for Spec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Spec")
            .field("url", &redact(self.url.as_str()))
            .finish()
    }
}

pub struct Http {
    client: reqwest::Client,
    /// Where to POST: the URL without its credentials.
    endpoint: Url,
    /// Basic-auth credentials from the URL, percent-decoded.
    credentials: Option<(String, Option<String>)>,
    opts: SinkOptions,
}

impl Http {
    /// Builds the client (and, for `https://`, loads the system's root certificates). Does not
    /// connect: an unreachable webhook shows up as `Unavailable` on the first delivery.
    pub fn new(spec: Spec, opts: SinkOptions) -> anyhow::Result<Http> {
        let shown = redact(spec.url.as_str());
        let mut endpoint = spec.url;
        let credentials = take_credentials(&mut endpoint);
        let client = reqwest::Client::builder()
            .tls_backend_preconfigured(tls_config(endpoint.scheme() == "https")?)
            .user_agent(USER_AGENT)
            .redirect(reqwest::redirect::Policy::none())
            .timeout(opts.timeout)
            .connect_timeout(connect_timeout(opts.timeout))
            .build()
            .with_context(|| format!("cannot set up the webhook client for {shown}"))?;
        Ok(Http {
            client,
            endpoint,
            credentials,
            opts,
        })
    }

    /// POSTs the event and classifies the outcome (see the module documentation).
    pub async fn deliver(&self, event: &Event, gate: &Gate) -> Result<(), DeliveryError> {
        let aggregate = format!("{}:{}", event.aggregate_type, event.aggregate_id);
        let mut request = self
            .client
            .post(self.endpoint.clone())
            .header(CONTENT_TYPE, "application/json")
            .header("Idempotency-Key", event.id.to_string())
            .header("X-Leasectl-Event-Type", header_value(&event.event_type))
            .header("X-Leasectl-Aggregate", header_value(&aggregate));
        for (name, value) in self.opts.format.attributes(event) {
            if name != "datacontenttype" {
                request = request.header(format!("ce-{name}"), percent_encode_header(&value));
            }
        }
        let body = GatedBody::new(self.opts.format.body(event), gate.clone());
        let turned_away = body.turned_away.clone();
        request = request.body(reqwest::Body::wrap(body));
        if let Some((user, password)) = &self.credentials {
            request = request.basic_auth(user, password.as_ref());
        }
        let mut response = match request.send().await {
            Ok(r) => r,
            Err(_) if turned_away.load(Ordering::SeqCst) => return Err(DeliveryError::late()),
            Err(e) => return Err(self.send_error(&e)),
        };
        let status = response.status();
        if status.is_success() {
            // Delivered, whatever happens to the rest of the body.
            let _ = read_prefix(&mut response, SUCCESS_BODY_DRAIN).await;
            return Ok(());
        }
        let location = response
            .headers()
            .get(LOCATION)
            .map(|l| redact(&String::from_utf8_lossy(l.as_bytes())));
        let body = read_prefix(&mut response, ERROR_BODY_READ).await;
        Err(DeliveryError::Rejected(rejection(
            status,
            location.as_deref(),
            &body,
        )))
    }

    /// Classifies an error from `send`, which means no response (head) arrived.
    fn send_error(&self, e: &reqwest::Error) -> DeliveryError {
        let cause = root_cause(e);
        if e.is_connect() {
            // Includes DNS failures, refused connections, the connect timeout and TLS errors.
            DeliveryError::Unavailable(format!("cannot connect: {cause}"))
        } else if e.is_timeout() {
            DeliveryError::NoAnswer(format!(
                "no response within {}",
                humantime::format_duration(self.opts.timeout)
            ))
        } else if e.is_builder() {
            // Our request could not be built for this event; retrying will not help it.
            DeliveryError::Rejected(format!("cannot build the request: {cause}"))
        } else {
            // Connected and (at least partly) sent, then reset or closed before a response, or
            // the peer does not speak HTTP: this event's failure (see the module documentation).
            DeliveryError::Rejected(format!(
                "the request was sent but the connection failed before a response: {cause}"
            ))
        }
    }
}

/// The connect limit: [`CONNECT_TIMEOUT`], but at most half the delivery timeout, so that a
/// host that cannot be reached is always reported as such before the overall timeout fires.
fn connect_timeout(timeout: Duration) -> Duration {
    CONNECT_TIMEOUT.min(timeout / 2)
}

/// Removes `user:password@` from the URL and returns them percent-decoded.
fn take_credentials(url: &mut Url) -> Option<(String, Option<String>)> {
    if url.username().is_empty() && url.password().is_none() {
        return None;
    }
    let user = super::percent_decode(url.username());
    let password = url.password().map(super::percent_decode);
    // Cannot fail: http(s) URLs always have a host, hence can carry credentials.
    let _ = url.set_username("");
    let _ = url.set_password(None);
    Some((user, password))
}

/// The rustls configuration: ring, the system roots (only loaded for `https://` — a plain
/// `http://` sink never does TLS, since redirects are not followed), HTTP/1.1 by ALPN (reqwest
/// is built without HTTP/2).
fn tls_config(https: bool) -> anyhow::Result<rustls::ClientConfig> {
    let roots = if https {
        let roots = crate::db::tls::system_roots();
        if roots.is_empty() {
            bail!(
                "no trusted root certificates found for https:// (install the system's CA \
                 certificates or point SSL_CERT_FILE at a bundle)"
            );
        }
        roots
    } else {
        rustls::RootCertStore::empty()
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("cannot set up TLS")?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// A header value for arbitrary text: visible ASCII stays, everything else (spaces, controls,
/// non-ASCII bytes of UTF-8) and `%` itself become `%XX`, so the value is always valid and the
/// original can be recovered by percent-decoding.
fn header_value(text: &str) -> HeaderValue {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_graphic() && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    HeaderValue::from_str(&out).expect("visible ASCII is a valid header value")
}

/// Reads up to `limit` bytes of the body; stops quietly at an error or the timeout.
async fn read_prefix(response: &mut reqwest::Response, limit: usize) -> Vec<u8> {
    let mut body = Vec::new();
    while body.len() < limit {
        match response.chunk().await {
            Ok(Some(chunk)) => body.extend_from_slice(&chunk),
            Ok(None) | Err(_) => break,
        }
    }
    body.truncate(limit);
    body
}

/// `HTTP 503 Service Unavailable: <start of the body, on one line>`; for a redirect, where it
/// pointed.
fn rejection(status: StatusCode, location: Option<&str>, body: &[u8]) -> String {
    let mut message = format!("HTTP {status}");
    if status.is_redirection() {
        message.push_str(" (redirects are not followed; point --sink at the final URL");
        if let Some(location) = location {
            message.push_str(": ");
            message.push_str(&one_line(location.as_bytes(), ERROR_BODY_QUOTE));
        }
        message.push(')');
    }
    let quote = one_line(body, ERROR_BODY_QUOTE);
    if !quote.is_empty() {
        message.push_str(": ");
        message.push_str(&quote);
    }
    message
}

/// Bytes from the peer as a one-line quote (invalid UTF-8 replaced).
fn one_line(bytes: &[u8], max: usize) -> String {
    crate::fmt::one_line(&String::from_utf8_lossy(bytes), max)
}

/// The innermost error in the chain: the specific reason ("Connection refused (os error 111)",
/// "invalid peer certificate: UnknownIssuer") without reqwest's generic wrappers.
fn root_cause(e: &reqwest::Error) -> String {
    let mut cause: &dyn std::error::Error = e;
    while let Some(inner) = cause.source() {
        cause = inner;
    }
    cause.to_string()
}

/// A request's body, handed over only while its batch's [`Gate`] is open. The connection's task
/// polls it when it writes the request — after a pool checkout, a connect or a pause of the
/// relay that came after the relay's own check — so this is the last look before the event
/// leaves. Turned away, it fails the request before its body is sent: the receiver gets at most
/// a head whose body never comes, which no HTTP server takes for a request.
struct GatedBody {
    data: Option<bytes::Bytes>,
    len: u64,
    gate: Gate,
    turned_away: Arc<AtomicBool>,
}

impl GatedBody {
    fn new(data: String, gate: Gate) -> GatedBody {
        GatedBody {
            len: data.len() as u64,
            data: Some(data.into()),
            gate,
            turned_away: Arc::new(AtomicBool::new(false)),
        }
    }
}

/// Why a [`GatedBody`] was not sent.
#[derive(Debug)]
struct TurnedAway;

impl fmt::Display for TurnedAway {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the batch's transaction may have ended before the request could be sent")
    }
}

impl std::error::Error for TurnedAway {}

impl http_body::Body for GatedBody {
    type Data = bytes::Bytes;
    type Error = TurnedAway;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let Some(data) = self.data.take() else {
            return Poll::Ready(None);
        };
        if self.gate.allows_now() {
            Poll::Ready(Some(Ok(http_body::Frame::data(data))))
        } else {
            self.turned_away.store(true, Ordering::SeqCst);
            Poll::Ready(Some(Err(TurnedAway)))
        }
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        // Exact, so the request has a Content-Length (a receiver can tell a body cut short).
        http_body::SizeHint::with_exact(if self.data.is_some() { self.len } else { 0 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_webhook_urls() {
        let s = Spec::parse("https://hooks.example.com:8443/leasectl?k=v").unwrap();
        assert_eq!(
            s.url.as_str(),
            "https://hooks.example.com:8443/leasectl?k=v"
        );
        assert_eq!(Spec::parse("HTTP://h").unwrap().url.as_str(), "http://h/");
        assert!(Spec::parse("http://").is_err());
        assert!(Spec::parse("ftp://h/x")
            .unwrap_err()
            .contains("http:// or https://"));
        assert!(Spec::parse("not a url").is_err());
    }

    #[test]
    fn never_repeats_the_password() {
        for bad in [
            "http://user:hunter2@h:99999/",
            "http://user:hunter2@/x",
            "http://user:hunt/er2@h/",
            "http://user:hunter2@h o s t/",
        ] {
            let e = Spec::parse(bad).unwrap_err();
            assert!(!e.contains("hunt") && !e.contains("er2"), "{bad}: {e}");
        }
        let s = Spec::parse("https://user:hunter2@h/hook").unwrap();
        assert!(!format!("{s:?}").contains("hunter2"), "{s:?}");
        let described = super::super::SinkSpec::Http(s).describe();
        assert_eq!(described, "https://user:***@h/hook");
    }

    #[test]
    fn credentials_leave_the_url_decoded() {
        let mut url = Url::parse("http://al%20ice:p%40ss@h:8080/x").unwrap();
        let creds = take_credentials(&mut url);
        assert_eq!(creds, Some(("al ice".into(), Some("p@ss".into()))));
        assert_eq!(url.as_str(), "http://h:8080/x");
        let mut url = Url::parse("http://h/x").unwrap();
        assert_eq!(take_credentials(&mut url), None);
        let mut url = Url::parse("http://token@h/x").unwrap();
        assert_eq!(take_credentials(&mut url), Some(("token".into(), None)));
    }

    #[test]
    fn header_values_are_always_valid() {
        assert_eq!(header_value("leasectl.run"), "leasectl.run");
        assert_eq!(header_value("a b%c\nd"), "a%20b%25c%0Ad");
        assert_eq!(header_value("dé"), "d%C3%A9");
    }

    #[test]
    fn rejections_quote_the_body_on_one_line() {
        let m = rejection(
            StatusCode::SERVICE_UNAVAILABLE,
            None,
            b"  down\r\n\tfor\x00maintenance ",
        );
        assert_eq!(m, "HTTP 503 Service Unavailable: down for maintenance");
        assert_eq!(
            rejection(StatusCode::NOT_FOUND, None, b""),
            "HTTP 404 Not Found"
        );
        let long = "x".repeat(500);
        let m = rejection(StatusCode::BAD_REQUEST, None, long.as_bytes());
        assert_eq!(m.chars().count(), "HTTP 400 Bad Request: ".len() + 200 + 1);
        assert!(m.ends_with('…'));
        let m = rejection(StatusCode::FOUND, Some("https://elsewhere/"), b"");
        assert!(
            m.starts_with("HTTP 302 Found (redirects are not followed"),
            "{m}"
        );
        assert!(m.contains("https://elsewhere/"), "{m}");
    }

    #[test]
    fn connecting_gives_up_before_the_delivery_does() {
        assert_eq!(
            connect_timeout(Duration::from_secs(10)),
            Duration::from_secs(5)
        );
        assert_eq!(connect_timeout(Duration::from_secs(600)), CONNECT_TIMEOUT);
    }
}
