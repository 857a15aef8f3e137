//! Where a relay round's relays publish, and the consumer that records every delivery in the
//! order it arrived (see `relay.rs`): one destination per round that every relay of the round
//! shares, so that "arrival order" is one sequence the invariants can read.
//!
//! * `stdout`: every relay's stdout is the same file, opened `O_APPEND` by each: the relay writes
//!   a batch with one `write`, so batches never interleave, and a relay writes its batch before
//!   it commits it — before any other relay can claim what follows.
//! * `exec:`: the command appends `<relay> <aggregate> <event id>` to one `O_APPEND` file (one
//!   short `write`), and exits 0; it runs before the relay counts the event delivered.
//! * webhook: a small HTTP/1.1 server on 127.0.0.1 that records a request (under one lock) before
//!   it answers 204 — or 500 for the aggregate it is told to refuse (not a delivery). Each relay
//!   posts to a path of its own.
//! * AMQP: an exchange per relay, all bound with `#` to one queue of the round, read by a consumer
//!   of the harness (the queue's order is the order the broker routed the messages in).
//! * NATS: one stream per round capturing `chaosrelay.<round>.>`; each relay publishes under a
//!   prefix of its own; the stream is read back in stream order, timed by the server's stamp.
//!
//! The brokers and the webhook are reached through a proxy (`proxy.rs`) that the broker faults
//! cut, reset or black-hole; the harness's own consumers talk to them directly. A round deletes
//! what it created (queue, exchanges, stream) when its consumer is dropped.

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::procs::now;
use crate::proxy::Proxy;
use crate::relay_faults::SinkKind;

pub const AMQP_ADDR: &str = "127.0.0.1:5672";
pub const NATS_ADDR: &str = "127.0.0.1:4222";

/// One delivery as the consumer saw it.
#[derive(Debug, Clone)]
pub struct Arrival {
    /// Wall-clock seconds: when the consumer recorded it (the webhook, the file tails, AMQP) or
    /// the server stored it (NATS).
    pub t: f64,
    /// The relay that published it (its label, e.g. `s1`, `fin`), `?` for stdout.
    pub relay: String,
    pub id: String,
    pub agg: String,
    /// A request its relay had given up on before it arrived: a black hole held it, and the
    /// relay closed the connection meanwhile ([`crate::proxy::abandoned`]; the webhook only).
    pub late: bool,
}

/// `id` and `aggregate_id` of a published event object (`--format json`).
fn parse_event(body: &[u8]) -> Option<(String, String)> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    Some((
        v.get("id")?.as_str()?.to_owned(),
        v.get("aggregate_id")?.as_str()?.to_owned(),
    ))
}

/// Every arrival in order, and the ids seen (the round asks "has X arrived" every few ms).
#[derive(Default)]
struct Inner {
    list: Vec<Arrival>,
    seen: HashSet<String>,
}

type Arrivals = Arc<Mutex<Inner>>;

fn push(arrivals: &Arrivals, a: Arrival) {
    let mut inner = arrivals.lock().unwrap();
    inner.seen.insert(a.id.clone());
    inner.list.push(a);
}

/// What the webhook answers, changeable while it runs.
#[derive(Default)]
struct WebState {
    /// Aggregate whose events are refused with 500.
    refuse: Mutex<Option<String>>,
    /// Milliseconds each accepted request takes before it is answered.
    delay_ms: AtomicU64,
    /// Requests answered 500.
    refused: AtomicU64,
}

/// The round's destination and its consumer.
pub struct Consumer {
    pub kind: SinkKind,
    arrivals: Arrivals,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    /// In front of the broker or webhook (none for stdout and exec:).
    pub proxy: Option<Proxy>,
    web: Option<Arc<WebState>>,
    file: PathBuf,
    tag: String,
    exec_sleep_ms: u64,
    /// Set when the consumer's own connection failed (its figures cannot be trusted).
    pub broken: Arc<Mutex<Option<String>>>,
}

impl Consumer {
    /// Sets up the destination for relays labelled `labels` and starts consuming. `tag` names
    /// the round's broker objects.
    pub fn start(
        kind: SinkKind,
        dir: &Path,
        tag: &str,
        labels: &[String],
        exec_sleep_ms: u64,
        web_delay_ms: u64,
    ) -> Result<Consumer, String> {
        let arrivals: Arrivals = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let broken: Arc<Mutex<Option<String>>> = Arc::default();
        let file = dir.join("delivered.log");
        File::create(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        let mut c = Consumer {
            kind,
            arrivals: arrivals.clone(),
            stop: stop.clone(),
            threads: Vec::new(),
            proxy: None,
            web: None,
            file: file.clone(),
            tag: tag.to_owned(),
            exec_sleep_ms,
            broken: broken.clone(),
        };
        match kind {
            SinkKind::Stdout | SinkKind::Exec => {
                let exec = kind == SinkKind::Exec;
                c.threads.push(std::thread::spawn(move || {
                    tail(&file, exec, &arrivals, &stop)
                }));
            }
            SinkKind::Webhook => {
                let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
                let addr = listener.local_addr().unwrap();
                let web = Arc::new(WebState::default());
                web.delay_ms.store(web_delay_ms, Ordering::SeqCst);
                c.web = Some(web.clone());
                let st = stop.clone();
                c.threads.push(std::thread::spawn(move || {
                    serve(listener, web, arrivals, st)
                }));
                c.proxy = Some(Proxy::start(addr));
            }
            SinkKind::Amqp => {
                let (ready, is_ready) = mpsc::channel();
                let labels = labels.to_vec();
                let tag = tag.to_owned();
                c.threads.push(std::thread::spawn(move || {
                    amqp_consume(&tag, &labels, ready, &arrivals, &stop, &broken)
                }));
                is_ready
                    .recv_timeout(Duration::from_secs(20))
                    .map_err(|_| "AMQP consumer: no answer within 20 s".to_owned())??;
                c.proxy = Some(Proxy::start(AMQP_ADDR.parse().unwrap()));
            }
            SinkKind::Nats => {
                let (ready, is_ready) = mpsc::channel();
                let tag = tag.to_owned();
                c.threads.push(std::thread::spawn(move || {
                    nats_consume(&tag, ready, &arrivals, &stop, &broken)
                }));
                is_ready
                    .recv_timeout(Duration::from_secs(20))
                    .map_err(|_| "NATS consumer: no answer within 20 s".to_owned())??;
                c.proxy = Some(Proxy::start(NATS_ADDR.parse().unwrap()));
            }
        }
        Ok(c)
    }

    /// The `--sink` of the relay labelled `label`.
    pub fn sink_arg(&self, label: &str) -> String {
        let port = self.proxy.as_ref().map_or(0, |p| p.port);
        match self.kind {
            SinkKind::Stdout => "stdout".to_owned(),
            SinkKind::Exec => {
                let sleep = if self.exec_sleep_ms > 0 {
                    format!("sleep {:.3}; ", self.exec_sleep_ms as f64 / 1e3)
                } else {
                    String::new()
                };
                format!(
                    "exec:{sleep}printf '%s %s %s\\n' {label} \"$LEASECTL_AGGREGATE_ID\" \"$LEASECTL_EVENT_ID\" >> '{}'",
                    self.file.display()
                )
            }
            SinkKind::Webhook => format!("http://127.0.0.1:{port}/{label}"),
            SinkKind::Amqp => format!(
                "amqp://guest:guest@127.0.0.1:{port}/%2f?exchange={}",
                amqp_exchange(&self.tag, label)
            ),
            SinkKind::Nats => format!(
                "nats://127.0.0.1:{port}?subject={}.{label}&stream={}",
                nats_subject(&self.tag),
                nats_stream(&self.tag)
            ),
        }
    }

    /// The relay's stdout: the shared delivery file for the stdout sink, else nothing.
    pub fn stdout_for_relay(&self) -> std::process::Stdio {
        if self.kind == SinkKind::Stdout {
            OpenOptions::new()
                .append(true)
                .open(&self.file)
                .map(std::process::Stdio::from)
                .unwrap_or_else(|_| std::process::Stdio::null())
        } else {
            std::process::Stdio::null()
        }
    }

    pub fn arrivals(&self) -> Vec<Arrival> {
        self.arrivals.lock().unwrap().list.clone()
    }

    pub fn has(&self, id: &str) -> bool {
        self.arrivals.lock().unwrap().seen.contains(id)
    }

    /// How many of `ids` have not arrived.
    pub fn missing<'a>(&self, ids: impl IntoIterator<Item = &'a String>) -> usize {
        let inner = self.arrivals.lock().unwrap();
        ids.into_iter()
            .filter(|id| !inner.seen.contains(*id))
            .count()
    }

    /// When the relay labelled `label` last delivered something (not known for stdout).
    pub fn last_from(&self, label: &str) -> Option<f64> {
        self.arrivals
            .lock()
            .unwrap()
            .list
            .iter()
            .rev()
            .find(|a| a.relay == label)
            .map(|a| a.t)
    }

    pub fn count(&self) -> usize {
        self.arrivals.lock().unwrap().list.len()
    }

    /// Makes the webhook refuse (500) every event of `agg`, or nothing.
    pub fn refuse(&self, agg: Option<String>) {
        if let Some(w) = &self.web {
            *w.refuse.lock().unwrap() = agg;
        }
    }

    pub fn refused(&self) -> u64 {
        self.web
            .as_ref()
            .map_or(0, |w| w.refused.load(Ordering::SeqCst))
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.proxy = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// stdout and exec: a file of lines, followed as it grows.

fn tail(path: &Path, exec: bool, arrivals: &Arrivals, stop: &AtomicBool) {
    let mut offset = 0u64;
    let mut partial: Vec<u8> = Vec::new();
    loop {
        let last = stop.load(Ordering::SeqCst);
        let mut new = Vec::new();
        if let Ok(mut f) = File::open(path) {
            let _ = f.seek(SeekFrom::Start(offset));
            if let Ok(n) = f.read_to_end(&mut new) {
                offset += n as u64;
            }
        }
        let t = now();
        partial.extend_from_slice(&new);
        while let Some(nl) = partial.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = partial.drain(..=nl).collect();
            let line = &line[..line.len() - 1];
            let parsed = if exec {
                let s = String::from_utf8_lossy(line);
                let f: Vec<&str> = s.split_whitespace().collect();
                (f.len() == 3).then(|| (f[0].to_owned(), f[2].to_owned(), f[1].to_owned()))
            } else {
                parse_event(line).map(|(id, agg)| ("?".to_owned(), id, agg))
            };
            let (relay, id, agg) = parsed.unwrap_or_else(|| {
                (
                    "?".to_owned(),
                    format!(
                        "unparseable: {}",
                        String::from_utf8_lossy(&line[..line.len().min(80)])
                    ),
                    String::new(),
                )
            });
            push(
                arrivals,
                Arrival {
                    t,
                    relay,
                    id,
                    agg,
                    late: false,
                },
            );
        }
        if last {
            break;
        }
        std::thread::sleep(Duration::from_millis(3));
    }
}

// ---------------------------------------------------------------------------------------------
// The webhook: HTTP/1.1 with keep-alive, Content-Length or chunked bodies.

fn serve(listener: TcpListener, web: Arc<WebState>, arrivals: Arrivals, stop: Arc<AtomicBool>) {
    listener.set_nonblocking(true).unwrap();
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((conn, _)) => {
                let (web, arrivals) = (web.clone(), arrivals.clone());
                // Detached: it ends when the relay (or the proxy) closes the connection.
                std::thread::spawn(move || {
                    let _ = conn.set_nonblocking(false);
                    let _ = conn.set_nodelay(true);
                    let _ = http_conn(conn, &web, &arrivals);
                });
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

fn http_conn(conn: TcpStream, web: &WebState, arrivals: &Arrivals) -> std::io::Result<()> {
    let peer = conn.peer_addr()?;
    let mut out = conn.try_clone()?;
    let mut r = BufReader::new(conn);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let path = line.split_whitespace().nth(1).unwrap_or("/").to_owned();
        let (mut length, mut chunked) = (0usize, false);
        loop {
            let mut h = String::new();
            if r.read_line(&mut h)? == 0 {
                return Ok(());
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            let (k, v) = h.split_once(':').unwrap_or((h, ""));
            match k.trim().to_ascii_lowercase().as_str() {
                "content-length" => length = v.trim().parse().unwrap_or(0),
                "transfer-encoding" => chunked = v.to_ascii_lowercase().contains("chunked"),
                _ => {}
            }
        }
        let mut body = Vec::new();
        if chunked {
            loop {
                let mut size = String::new();
                r.read_line(&mut size)?;
                let n = usize::from_str_radix(size.trim().split(';').next().unwrap_or("0"), 16)
                    .unwrap_or(0);
                let mut chunk = vec![0u8; n + 2];
                r.read_exact(&mut chunk)?;
                if n == 0 {
                    break;
                }
                body.extend_from_slice(&chunk[..n]);
            }
        } else {
            body.resize(length, 0);
            r.read_exact(&mut body)?;
        }
        let relay = path.trim_start_matches('/').to_owned();
        let (id, agg) = parse_event(&body).unwrap_or_else(|| {
            (
                format!(
                    "unparseable: {}",
                    String::from_utf8_lossy(&body[..body.len().min(80)])
                ),
                String::new(),
            )
        });
        let refused = web.refuse.lock().unwrap().as_deref() == Some(agg.as_str());
        if refused {
            web.refused.fetch_add(1, Ordering::SeqCst);
            out.write_all(
                b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 7\r\n\r\nrefused",
            )?;
            continue;
        }
        let delay = web.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            std::thread::sleep(Duration::from_millis(delay));
        }
        // Recorded before the answer: the relay can only count it delivered after this.
        push(
            arrivals,
            Arrival {
                t: now(),
                relay,
                id,
                agg,
                late: crate::proxy::abandoned(peer),
            },
        );
        out.write_all(b"HTTP/1.1 204 No Content\r\n\r\n")?;
    }
}

// ---------------------------------------------------------------------------------------------
// AMQP

pub fn amqp_exchange(tag: &str, label: &str) -> String {
    format!("chaos-relay-{tag}-{label}")
}

fn amqp_queue(tag: &str) -> String {
    format!("chaos-relay-{tag}")
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn amqp_consume(
    tag: &str,
    labels: &[String],
    ready: mpsc::Sender<Result<(), String>>,
    arrivals: &Arrivals,
    stop: &AtomicBool,
    broken: &Mutex<Option<String>>,
) {
    use futures_util::StreamExt;
    use lapin::options::{
        BasicConsumeOptions, ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions,
        QueueDeclareOptions, QueueDeleteOptions,
    };
    use lapin::types::{AMQPValue, FieldTable};
    use lapin::{Connection, ConnectionProperties, ExchangeKind};

    runtime().block_on(async {
        let url = format!("amqp://guest:guest@{AMQP_ADDR}/%2f");
        let setup = async {
            let conn = Connection::connect(&url, ConnectionProperties::default()).await?;
            let ch = conn.create_channel().await?;
            let queue = amqp_queue(tag);
            let mut args = FieldTable::default();
            // Gone by itself ten minutes after a run that could not clean up.
            args.insert("x-expires".into(), AMQPValue::LongUInt(600_000));
            ch.queue_declare(queue.as_str().into(), QueueDeclareOptions::default(), args)
                .await?;
            for l in labels {
                let ex = amqp_exchange(tag, l);
                // As the sink declares it: a durable topic exchange.
                ch.exchange_declare(
                    ex.as_str().into(),
                    ExchangeKind::Topic,
                    ExchangeDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await?;
                ch.queue_bind(
                    queue.as_str().into(),
                    ex.as_str().into(),
                    "#".into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await?;
            }
            let consumer = ch
                .basic_consume(
                    queue.as_str().into(),
                    "".into(),
                    BasicConsumeOptions {
                        no_ack: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await?;
            Ok::<_, lapin::Error>((conn, ch, consumer))
        };
        let (conn, ch, mut consumer) = match setup.await {
            Ok(x) => {
                let _ = ready.send(Ok(()));
                x
            }
            Err(e) => {
                let _ = ready.send(Err(format!("AMQP consumer at {AMQP_ADDR}: {e}")));
                return;
            }
        };
        let by_exchange: HashMap<String, String> = labels
            .iter()
            .map(|l| (amqp_exchange(tag, l), l.clone()))
            .collect();
        loop {
            match tokio::time::timeout(Duration::from_millis(50), consumer.next()).await {
                Ok(Some(Ok(d))) => {
                    let relay = by_exchange
                        .get(d.exchange.as_str())
                        .cloned()
                        .unwrap_or_else(|| d.exchange.to_string());
                    let (id, agg) = parse_event(&d.data)
                        .unwrap_or_else(|| ("unparseable AMQP message".to_owned(), String::new()));
                    push(
                        arrivals,
                        Arrival {
                            t: now(),
                            relay,
                            id,
                            agg,
                            late: false,
                        },
                    );
                }
                Ok(Some(Err(e))) => {
                    *broken.lock().unwrap() = Some(format!("AMQP consumer: {e}"));
                    break;
                }
                Ok(None) => {
                    *broken.lock().unwrap() = Some("AMQP consumer ended".to_owned());
                    break;
                }
                Err(_) if stop.load(Ordering::SeqCst) => break,
                Err(_) => {}
            }
        }
        let _ = ch
            .queue_delete(
                amqp_queue(tag).as_str().into(),
                QueueDeleteOptions::default(),
            )
            .await;
        for ex in by_exchange.keys() {
            let _ = ch
                .exchange_delete(ex.as_str().into(), ExchangeDeleteOptions::default())
                .await;
        }
        let _ = conn.close(0, "done".into()).await;
    });
}

// ---------------------------------------------------------------------------------------------
// NATS JetStream

pub fn nats_subject(tag: &str) -> String {
    format!("chaosrelay.{tag}")
}

fn nats_stream(tag: &str) -> String {
    format!("CHAOSRELAY_{}", tag.replace(['-', '.'], "_"))
}

fn nats_consume(
    tag: &str,
    ready: mpsc::Sender<Result<(), String>>,
    arrivals: &Arrivals,
    stop: &AtomicBool,
    broken: &Mutex<Option<String>>,
) {
    use async_nats::jetstream::stream;
    runtime().block_on(async {
        let name = nats_stream(tag);
        let setup = async {
            let client = async_nats::connect(NATS_ADDR)
                .await
                .map_err(|e| e.to_string())?;
            let js = async_nats::jetstream::new(client);
            let s = js
                .create_stream(stream::Config {
                    name: name.clone(),
                    subjects: vec![format!("{}.>", nats_subject(tag))],
                    storage: stream::StorageType::Memory,
                    // Gone by themselves ten minutes after a run that could not clean up.
                    max_age: Duration::from_secs(600),
                    ..Default::default()
                })
                .await
                .map_err(|e| e.to_string())?;
            Ok::<_, String>((js, s))
        };
        let (js, s) = match setup.await {
            Ok(x) => {
                let _ = ready.send(Ok(()));
                x
            }
            Err(e) => {
                let _ = ready.send(Err(format!("NATS consumer at {NATS_ADDR}: {e}")));
                return;
            }
        };
        let prefix = format!("{}.", nats_subject(tag));
        let mut next = 1u64;
        let mut failures = 0;
        loop {
            match s.get_raw_message(next).await {
                Ok(m) => {
                    failures = 0;
                    next += 1;
                    let relay = m
                        .subject
                        .as_str()
                        .strip_prefix(&prefix)
                        .and_then(|rest| rest.split('.').next())
                        .unwrap_or("?")
                        .to_owned();
                    let (id, agg) = parse_event(&m.payload)
                        .unwrap_or_else(|| ("unparseable NATS message".to_owned(), String::new()));
                    push(
                        arrivals,
                        Arrival {
                            t: m.time.unix_timestamp_nanos() as f64 / 1e9,
                            relay,
                            id,
                            agg,
                            late: false,
                        },
                    );
                    continue;
                }
                Err(e) => {
                    // "no message found" until the next one is stored; anything else a few
                    // times in a row is the consumer's own trouble.
                    let text = e.to_string();
                    if !text.contains("no message found") && !text.contains("10037") {
                        failures += 1;
                        if failures > 200 {
                            *broken.lock().unwrap() = Some(format!("NATS consumer: {text}"));
                            break;
                        }
                    }
                }
            }
            if stop.load(Ordering::SeqCst) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = js.delete_stream(&name).await;
    });
}

/// Whether a TCP port answers (for the set-up's broker checks).
pub fn reachable(addr: &str) -> bool {
    let addr: SocketAddr = addr.parse().unwrap();
    TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_ok()
}
