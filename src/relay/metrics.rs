//! `relay --metrics ADDR`: the relay's Prometheus metrics, served over HTTP.
//!
//! The metrics are `prometheus-client` families, encoded in the OpenMetrics text format that
//! Prometheus scrapes. The relay loop reports into a [`Metrics`] handle — a no-op without
//! `--metrics` — at four points: a settled batch ([`Metrics::settled`]: delivered, refused and
//! dead events by sink and type, the delivery latency from `created_at` to the sink's
//! confirmation, the batch size), the sink going down or up, a database reconnect, and between
//! batches [`Metrics::refresh`], which reads the backlog and the watched targets' health from
//! the database at most every [`REFRESH_EVERY`] (and never spends more than 1/`REFRESH_SHARE`
//! of the relay's time on it: counting a huge backlog takes a while).
//!
//! The HTTP side is a small tokio accept loop, not a framework: it answers `GET /metrics` (and
//! `/`) with the encoded registry and anything else with 404, one request per connection.
//! Scrapes never touch the database: they read what the relay last stored.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use anyhow::Result;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use crate::db::Schema;
use crate::error::Failure;
use crate::store::outbox::{self, Claimed, Settle};

/// The backlog and health gauges are read from the database at most this often…
pub const REFRESH_EVERY: Duration = Duration::from_secs(5);
/// …and at most once per this many times as long as the last read took.
const REFRESH_SHARE: u32 = 20;
/// A scraper must send its request within this long.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest request head read; a scrape's is a few hundred bytes.
const MAX_REQUEST: usize = 8 * 1024;

type Labels = Vec<(String, String)>;

/// Every metric of one relay.
struct Inner {
    registry: Registry,
    sink: String,
    delivered: Family<Labels, Counter>,
    refused: Family<Labels, Counter>,
    dead: Family<Labels, Counter>,
    latency: Histogram,
    batch: Histogram,
    backlog: Gauge,
    retrying: Gauge,
    dead_backlog: Gauge,
    oldest: Gauge<f64, AtomicU64>,
    sink_up: Family<Labels, Gauge>,
    reconnects: Counter,
    healthy: Family<Labels, Gauge>,
}

impl Inner {
    fn new(sink: &str) -> Inner {
        let mut registry = Registry::with_prefix("leasectl");
        let mut inner = Inner {
            registry: Registry::default(),
            sink: sink.to_owned(),
            delivered: Family::default(),
            refused: Family::default(),
            dead: Family::default(),
            // 1 ms to about 9 hours: a healthy relay delivers within milliseconds, a backlog or
            // an outage takes minutes to hours.
            latency: Histogram::new(exponential_buckets(0.001, 4.0, 13)),
            batch: Histogram::new(exponential_buckets(1.0, 2.0, 14)),
            backlog: Gauge::default(),
            retrying: Gauge::default(),
            dead_backlog: Gauge::default(),
            oldest: Gauge::default(),
            sink_up: Family::default(),
            reconnects: Counter::default(),
            healthy: Family::default(),
        };
        registry.register(
            "relay_events_delivered",
            "Events the sink confirmed",
            inner.delivered.clone(),
        );
        registry.register(
            "relay_events_refused",
            "Delivery attempts the sink refused (each is retried with backoff, or goes dead)",
            inner.refused.clone(),
        );
        registry.register(
            "relay_events_dead",
            "Events that went dead after --max-attempts refusals",
            inner.dead.clone(),
        );
        registry.register(
            "relay_delivery_latency_seconds",
            "From an event's created_at to the sink's confirmation",
            inner.latency.clone(),
        );
        registry.register(
            "relay_batch_size",
            "Events claimed per batch",
            inner.batch.clone(),
        );
        registry.register(
            "relay_backlog_events",
            "Pending events in the outbox (not dead; includes those waiting out a retry)",
            inner.backlog.clone(),
        );
        registry.register(
            "relay_retrying_events",
            "Pending events waiting out a retry after a refusal",
            inner.retrying.clone(),
        );
        registry.register(
            "relay_dead_events",
            "Dead events in the outbox (leasectl outbox list --dead)",
            inner.dead_backlog.clone(),
        );
        registry.register(
            "relay_oldest_pending_age_seconds",
            "Age of the oldest pending event, 0 when none",
            inner.oldest.clone(),
        );
        registry.register(
            "relay_sink_up",
            "1 while the sink is reachable, 0 while the relay backs off from it",
            inner.sink_up.clone(),
        );
        registry.register(
            "relay_database_reconnects",
            "Times the relay reconnected to the database after losing it",
            inner.reconnects.clone(),
        );
        registry.register(
            "target_healthy",
            "1 while a watched target is healthy (leasectl check), 0 while it has a problem",
            inner.healthy.clone(),
        );
        inner.registry = registry;
        inner
    }

    fn labels(&self, event_type: &str) -> Labels {
        vec![
            ("sink".into(), self.sink.clone()),
            ("type".into(), event_type.into()),
        ]
    }

    fn sink_label(&self) -> Labels {
        vec![("sink".into(), self.sink.clone())]
    }
}

/// The metrics' address, bound; nothing served yet.
pub struct Bound(TcpListener);

impl Bound {
    /// Serves the metrics of a relay to `sink` (its label) from a task of its own.
    pub fn serve(self, sink: &str) -> Metrics {
        let inner = Arc::new(Inner::new(sink));
        tokio::spawn(accept_loop(self.0, inner.clone()));
        Metrics {
            inner: Some(inner),
            next_refresh: None,
        }
    }
}

/// The relay's handle on its metrics: a no-op unless `--metrics` is on.
#[derive(Default)]
pub struct Metrics {
    inner: Option<Arc<Inner>>,
    /// When the database-read gauges may be refreshed again (`None`: now).
    next_refresh: Option<Instant>,
}

impl Metrics {
    /// No metrics (`--metrics` not given).
    pub fn off() -> Metrics {
        Metrics::default()
    }

    /// Binds `addr` (before the relay connects: a port that is taken is the operator's to fix,
    /// whatever the database); [`Bound::serve`] then serves. A bind failure is a usage error
    /// naming the address.
    pub async fn bind(addr: SocketAddr) -> Result<Bound> {
        let listener = TcpListener::bind(addr).await.map_err(|e| {
            Failure::Usage(format!("--metrics: cannot listen on {addr}: {}", brief(&e)))
        })?;
        Ok(Bound(listener))
    }

    /// Counts a settled batch: what was delivered (and how long after its creation), refused
    /// and dead, and its size.
    pub fn settled(&self, claimed: &[Claimed], settled: &[Settle]) {
        let Some(m) = &self.inner else { return };
        m.batch.observe(claimed.len() as f64);
        let now = SystemTime::now();
        for (c, s) in claimed.iter().zip(settled) {
            match s {
                Settle::Delivered => {
                    m.delivered
                        .get_or_create(&m.labels(&c.event.event_type))
                        .inc();
                    let age = now.duration_since(c.event.created_at).unwrap_or_default();
                    m.latency.observe(age.as_secs_f64());
                }
                Settle::Failed { dead, .. } => {
                    let labels = m.labels(&c.event.event_type);
                    m.refused.get_or_create(&labels).inc();
                    if *dead {
                        m.dead.get_or_create(&labels).inc();
                    }
                }
                Settle::Untouched => {}
            }
        }
    }

    /// The sink is reachable (`true`) or the relay backs off from it (`false`).
    pub fn sink_up(&self, up: bool) {
        if let Some(m) = &self.inner {
            m.sink_up.get_or_create(&m.sink_label()).set(i64::from(up));
        }
    }

    /// The relay reconnected to the database.
    pub fn reconnected(&self) {
        if let Some(m) = &self.inner {
            m.reconnects.inc();
        }
    }

    /// How long until [`Metrics::refresh`] has work, for an idle relay's wait (`None`: never).
    pub fn refresh_due_in(&self) -> Option<Duration> {
        self.inner.as_ref()?;
        Some(self.next_refresh.map_or(Duration::ZERO, |t| {
            t.saturating_duration_since(Instant::now())
        }))
    }

    /// Reads the backlog and the watched targets' health from the database, if they are due.
    /// Best effort: a failed read keeps the last values (the relay's own statements report a
    /// lost connection).
    pub async fn refresh(&mut self, client: &tokio_postgres::Client, schema: &Schema) {
        let Some(m) = &self.inner else { return };
        if self.next_refresh.is_some_and(|t| Instant::now() < t) {
            return;
        }
        let started = Instant::now();
        if let Ok(b) = outbox::backlog(client, schema).await {
            m.backlog.set(b.pending);
            m.retrying.set(b.retrying);
            m.dead_backlog.set(b.dead);
            m.oldest
                .set(b.oldest_pending_ms.unwrap_or(0).max(0) as f64 / 1000.0);
        }
        if let Ok(watched) = crate::store::health::watched(client, schema, None).await {
            for w in &watched {
                let ok = crate::health::assess(w).problems.is_empty();
                m.healthy
                    .get_or_create(&vec![("target".into(), w.target.clone())])
                    .set(i64::from(ok));
            }
        }
        let took = started.elapsed();
        self.next_refresh = Some(Instant::now() + REFRESH_EVERY.max(took * REFRESH_SHARE));
    }
}

/// Accepts scrapers until the process exits; each connection is answered by a task of its own.
async fn accept_loop(listener: TcpListener, inner: Arc<Inner>) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                tokio::spawn(answer(stream, inner.clone()));
            }
            Err(e) => {
                // Out of file descriptors, say: the relay goes on; scrapes fail meanwhile.
                info!("--metrics: accept failed: {}", brief(&e));
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Reads one request head and answers it; a slow or broken scraper only loses its own answer.
async fn answer(mut stream: TcpStream, inner: Arc<Inner>) {
    let mut head = Vec::new();
    let read = tokio::time::timeout(REQUEST_TIMEOUT, async {
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < MAX_REQUEST {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
        }
        Ok::<(), std::io::Error>(())
    })
    .await;
    if !matches!(read, Ok(Ok(()))) {
        return;
    }
    let line = String::from_utf8_lossy(head.split(|b| *b == b'\n').next().unwrap_or(&[]));
    let mut words = line.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let response = match (method, path) {
        ("GET" | "HEAD", "/metrics" | "/") => {
            let mut body = String::new();
            if encode(&mut body, &inner.registry).is_err() {
                return;
            }
            reply(
                "200 OK",
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                if method == "HEAD" { "" } else { &body },
                body.len(),
            )
        }
        ("GET" | "HEAD", _) => {
            let body = "not found: the metrics are at /metrics\n";
            reply("404 Not Found", "text/plain", body, body.len())
        }
        _ => {
            let body = "only GET /metrics\n";
            reply("405 Method Not Allowed", "text/plain", body, body.len())
        }
    };
    let _ = tokio::time::timeout(REQUEST_TIMEOUT, stream.write_all(response.as_bytes())).await;
    let _ = stream.shutdown().await;
}

fn reply(status: &str, content_type: &str, body: &str, length: usize) -> String {
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\nConnection: close\r\n\r\n{body}"
    )
}

/// An I/O error without its "(os error N)".
fn brief(e: &std::io::Error) -> String {
    let s = e.to_string();
    match s.find(" (os error ") {
        Some(i) => s[..i].to_owned(),
        None => s,
    }
}
