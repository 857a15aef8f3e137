//! The webhook and exec sinks against real local peers: an HTTP/1.1 server written here (it
//! records every request and answers as each test programs it) and real `/bin/sh` commands.
//! Neither needs PostgreSQL.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasectl::relay::sink::exec::{self, Exec, KILL_GRACE};
use leasectl::relay::sink::http::{self, Http};
use leasectl::relay::sink::{DeliveryError, Event, Format, Gate, SinkOptions};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::common::{alive, runtime, wait_for, PATIENCE};

fn opts(timeout: Duration) -> SinkOptions {
    SinkOptions {
        timeout,
        format: Format::Json,
    }
}

/// An event as the relay would hand it over.
fn event(aggregate_id: &str, payload: serde_json::Value) -> Event {
    Event {
        seq: 1,
        id: uuid::Uuid::new_v4(),
        aggregate_type: "leasectl.target".into(),
        aggregate_id: aggregate_id.into(),
        event_type: "leasectl.run.finished".into(),
        payload: payload.to_string(),
        // 2025-01-02T03:04:05.678Z
        created_at: std::time::UNIX_EPOCH + Duration::from_millis(1_735_787_045_678),
    }
}

/// The published object for `e` (what `--format json` publishes), parsed.
fn spec_object(e: &Event) -> serde_json::Value {
    serde_json::json!({
        "id": e.id.to_string(),
        "aggregate_type": e.aggregate_type,
        "aggregate_id": e.aggregate_id,
        "type": e.event_type,
        "payload": serde_json::from_str::<serde_json::Value>(&e.payload).unwrap(),
        "created_at": "2025-01-02T03:04:05.678000Z",
    })
}

/// `bytes` as one JSON value on one line.
fn one_json_line(bytes: &[u8]) -> serde_json::Value {
    let text = std::str::from_utf8(bytes).unwrap();
    assert!(!text.contains('\n'), "{text}");
    serde_json::from_str(text).unwrap()
}

fn http_sink(url: &str, timeout: Duration) -> Http {
    Http::new(http::Spec::parse(url).unwrap(), opts(timeout)).unwrap()
}

fn rejected(r: Result<(), DeliveryError>) -> String {
    match r {
        Err(DeliveryError::Rejected(m)) => m,
        other => panic!("expected Rejected, got {other:?}"),
    }
}

fn no_answer(r: Result<(), DeliveryError>) -> String {
    match r {
        Err(DeliveryError::NoAnswer(m)) => m,
        other => panic!("expected NoAnswer, got {other:?}"),
    }
}

fn unavailable(r: Result<(), DeliveryError>) -> String {
    match r {
        Err(DeliveryError::Unavailable(m)) => m,
        other => panic!("expected Unavailable, got {other:?}"),
    }
}

/// Awaits `cond` from inside the runtime (so other tasks keep running), up to [`PATIENCE`].
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < PATIENCE, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// A small HTTP/1.1 peer.

/// How the peer answers each request.
#[derive(Clone)]
pub(crate) enum Answer {
    /// A response with this status line, extra headers and body.
    Status {
        code: u16,
        reason: &'static str,
        headers: Vec<(&'static str, String)>,
        body: String,
    },
    /// Reads the request, then never answers (the connection stays open).
    Silence,
    /// Reads the request, then closes the connection without a word.
    Hangup,
    /// Reads the request, then resets the connection (RST: SO_LINGER 0, then close).
    Reset,
    /// Waits this long after reading the request, then answers as the inner answer says.
    Late(Duration, Box<Answer>),
    /// Decided per request, from the request and its index among every request the peer has
    /// read (0 for the first): say, failing the first few, or refusing one aggregate's events.
    By(Decide),
}

/// Chooses the answer to a request, given the request and its index (see [`Answer::By`]).
pub(crate) type Decide = Arc<dyn Fn(&Request, usize) -> Answer + Send + Sync>;

pub(crate) fn status(code: u16, reason: &'static str, body: &str) -> Answer {
    Answer::Status {
        code,
        reason,
        headers: Vec::new(),
        body: body.to_owned(),
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Request {
    pub(crate) method: String,
    pub(crate) target: String,
    pub(crate) headers: Vec<(String, String)>,
    pub(crate) body: Vec<u8>,
    /// When the peer had read the whole request.
    pub(crate) at: Instant,
}

impl Request {
    /// The value of a header that must appear at most once.
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        let mut found = self
            .headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name));
        let first = found.next().map(|(_, v)| v.as_str());
        assert!(found.next().is_none(), "header {name} repeated");
        first
    }
}

pub(crate) struct Peer {
    pub(crate) addr: SocketAddr,
    /// Every request read, in the order they arrived.
    pub(crate) requests: Arc<Mutex<Vec<Request>>>,
    pub(crate) connections: Arc<AtomicUsize>,
    pub(crate) answer: Arc<Mutex<Answer>>,
}

impl Peer {
    /// Listens on a free local port; serves on the current runtime until it is dropped.
    pub(crate) async fn start(answer: Answer) -> Peer {
        Peer::start_at("127.0.0.1:0".parse().unwrap(), answer).await
    }

    /// Like [`Peer::start`], on `addr` (say, a port a client was told about before the peer
    /// existed).
    pub(crate) async fn start_at(addr: SocketAddr, answer: Answer) -> Peer {
        let listener = TcpListener::bind(addr).await.unwrap();
        let peer = Peer {
            addr: listener.local_addr().unwrap(),
            requests: Arc::default(),
            connections: Arc::default(),
            answer: Arc::new(Mutex::new(answer)),
        };
        let (requests, connections, answer) = (
            peer.requests.clone(),
            peer.connections.clone(),
            peer.answer.clone(),
        );
        tokio::spawn(async move {
            loop {
                let (socket, _) = listener.accept().await.unwrap();
                connections.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(socket, requests.clone(), answer.clone()));
            }
        });
        peer
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub(crate) fn set(&self, answer: Answer) {
        *self.answer.lock().unwrap() = answer;
    }

    pub(crate) fn requests(&self) -> Vec<Request> {
        self.requests.lock().unwrap().clone()
    }
}

/// One connection: requests one after another (keep-alive) until the client closes it.
async fn serve(mut socket: TcpStream, log: Arc<Mutex<Vec<Request>>>, answer: Arc<Mutex<Answer>>) {
    let mut buf = Vec::new();
    loop {
        let Some(request) = read_request(&mut socket, &mut buf).await else {
            return;
        };
        let index = {
            let mut log = log.lock().unwrap();
            log.push(request.clone());
            log.len() - 1
        };
        let mut answer = answer.lock().unwrap().clone();
        loop {
            match answer {
                Answer::By(decide) => answer = decide(&request, index),
                Answer::Late(delay, inner) => {
                    tokio::time::sleep(delay).await;
                    answer = *inner;
                }
                _ => break,
            }
        }
        match answer {
            Answer::Status {
                code,
                reason,
                headers,
                body,
            } => {
                let mut out = format!("HTTP/1.1 {code} {reason}\r\n");
                for (k, v) in headers {
                    out.push_str(&format!("{k}: {v}\r\n"));
                }
                out.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
                if socket.write_all(out.as_bytes()).await.is_err() {
                    return;
                }
            }
            Answer::Silence => std::future::pending::<()>().await,
            Answer::Hangup => return,
            Answer::Reset => {
                // Linger 0 never blocks: the close sends RST at once.
                #[allow(deprecated)]
                let _ = socket.set_linger(Some(Duration::ZERO));
                return;
            }
            Answer::By(_) | Answer::Late(..) => unreachable!("resolved above"),
        }
    }
}

/// Reads one request (head, then a Content-Length body) from `socket`, keeping what follows it
/// in `buf`. `None` when the connection ends first.
async fn read_request(socket: &mut TcpStream, buf: &mut Vec<u8>) -> Option<Request> {
    let head_len = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        if !fill(socket, buf).await {
            // The client went away (or sent something that is not HTTP, such as a TLS hello).
            return None;
        }
    };
    let head = String::from_utf8(buf[..head_len - 4].to_vec()).expect("ASCII head");
    let mut lines = head.split("\r\n");
    let mut request_line = lines.next().unwrap().split(' ');
    let method = request_line.next().unwrap().to_owned();
    let target = request_line.next().unwrap().to_owned();
    assert_eq!(request_line.next(), Some("HTTP/1.1"));
    let headers: Vec<(String, String)> = lines
        .map(|l| {
            let (k, v) = l.split_once(':').expect("header line");
            (k.to_owned(), v.trim().to_owned())
        })
        .collect();
    assert!(
        !headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("transfer-encoding")),
        "the peer only understands Content-Length bodies"
    );
    let length: usize = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("content-length"))
        .map_or(0, |(_, v)| v.parse().unwrap());
    while buf.len() < head_len + length {
        if !fill(socket, buf).await {
            return None; // cut off mid-body: not a request
        }
    }
    let body = buf[head_len..head_len + length].to_vec();
    buf.drain(..head_len + length);
    Some(Request {
        method,
        target,
        headers,
        body,
        at: Instant::now(),
    })
}

/// Reads more into `buf`; false at end of file (or a reset).
async fn fill(socket: &mut TcpStream, buf: &mut Vec<u8>) -> bool {
    let mut chunk = [0u8; 16 * 1024];
    match socket.read(&mut chunk).await {
        Ok(0) | Err(_) => false,
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            true
        }
    }
}

/// A local port with nothing listening on it.
pub(crate) fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

// ---------------------------------------------------------------------------------------------
// The webhook sink.

#[test]
fn http_posts_the_event_with_its_headers_over_one_connection() {
    runtime().block_on(async {
        let peer = Peer::start(status(204, "No Content", "")).await;
        let sink = http_sink(&peer.url("/hooks/leasectl?src=ci"), Duration::from_secs(10));
        let first = event("déploy 1", serde_json::json!({"exit_code": 0}));
        sink.deliver(&first, &Gate::always()).await.unwrap();

        let seen = peer.requests();
        assert_eq!(seen.len(), 1);
        let r = &seen[0];
        assert_eq!(r.method, "POST");
        assert_eq!(r.target, "/hooks/leasectl?src=ci");
        assert_eq!(one_json_line(&r.body), spec_object(&first));
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(
            r.header("idempotency-key"),
            Some(first.id.to_string().as_str())
        );
        assert_eq!(
            r.header("user-agent"),
            Some(concat!("leasectl/", env!("CARGO_PKG_VERSION")))
        );
        assert_eq!(
            r.header("x-leasectl-event-type"),
            Some("leasectl.run.finished")
        );
        assert_eq!(
            r.header("x-leasectl-aggregate"),
            Some("leasectl.target:d%C3%A9ploy%201")
        );
        assert_eq!(r.header("authorization"), None);

        // Any 2xx is a delivery; the second request reuses the kept-alive connection.
        peer.set(status(202, "Accepted", "queued"));
        let second = event("b", serde_json::json!({}));
        sink.deliver(&second, &Gate::always()).await.unwrap();
        let seen = peer.requests();
        assert_eq!(seen.len(), 2);
        assert_eq!(
            seen[1].header("idempotency-key"),
            Some(second.id.to_string().as_str())
        );
        assert_eq!(peer.connections.load(Ordering::SeqCst), 1);
    });
}

#[test]
fn http_error_status_is_rejected_with_the_status_and_the_body() {
    runtime().block_on(async {
        let peer = Peer::start(status(500, "Internal Server Error", "")).await;
        let sink = http_sink(&peer.url("/"), Duration::from_secs(10));
        let m = rejected(
            sink.deliver(&event("a", serde_json::json!({})), &Gate::always())
                .await,
        );
        assert_eq!(m, "HTTP 500 Internal Server Error");

        peer.set(status(
            503,
            "Service Unavailable",
            &format!("down for\r\n  maintenance {}", "x".repeat(1000)),
        ));
        let m = rejected(
            sink.deliver(&event("a", serde_json::json!({})), &Gate::always())
                .await,
        );
        assert!(
            m.starts_with("HTTP 503 Service Unavailable: down for maintenance xxx"),
            "{m}"
        );
        assert!(m.chars().count() < 300 && !m.contains('\n'), "{m}");

        peer.set(status(409, "Conflict", "duplicate"));
        let m = rejected(
            sink.deliver(&event("a", serde_json::json!({})), &Gate::always())
                .await,
        );
        assert_eq!(m, "HTTP 409 Conflict: duplicate");
        assert_eq!(peer.requests().len(), 3);
    });
}

#[test]
fn http_redirects_are_rejected_not_followed() {
    runtime().block_on(async {
        let peer = Peer::start(status(200, "OK", "")).await;
        for (code, reason) in [(302, "Found"), (307, "Temporary Redirect")] {
            peer.set(Answer::Status {
                code,
                reason,
                headers: vec![("Location", peer.url("/elsewhere"))],
                body: String::new(),
            });
            let sink = http_sink(&peer.url("/hook"), Duration::from_secs(10));
            let m = rejected(
                sink.deliver(&event("a", serde_json::json!({})), &Gate::always())
                    .await,
            );
            assert!(m.starts_with(&format!("HTTP {code} {reason}")), "{m}");
            assert!(m.contains(&peer.url("/elsewhere")), "{m}");
        }
        let targets: Vec<String> = peer.requests().into_iter().map(|r| r.target).collect();
        assert_eq!(targets, ["/hook", "/hook"], "a redirect was followed");
    });
}

#[test]
fn http_silent_peer_is_no_answer_at_the_timeout() {
    runtime().block_on(async {
        let peer = Peer::start(Answer::Silence).await;
        let sink = http_sink(&peer.url("/"), Duration::from_millis(500));
        let start = Instant::now();
        let m = no_answer(
            sink.deliver(&event("a", serde_json::json!({})), &Gate::always())
                .await,
        );
        assert_eq!(m, "no response within 500ms");
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
        // It was the answer that was missing, not the connection.
        assert_eq!(peer.requests().len(), 1);
    });
}

#[test]
fn http_an_event_whose_gate_has_closed_is_not_sent_and_costs_nothing() {
    // The gate is what the relay's batch transaction allows: a request that reaches the point of
    // being written after it closed (a paused relay, a slow connect) must not reach the receiver.
    runtime().block_on(async {
        let peer = Peer::start(status(204, "No Content", "")).await;
        let sink = http_sink(&peer.url("/hook"), Duration::from_secs(10));
        let late = event("a", serde_json::json!({"n": 1}));
        match sink.deliver(&late, &Gate::closed()).await {
            Err(DeliveryError::Late(msg)) => assert!(msg.contains("not sent"), "{msg}"),
            other => panic!("expected Late, got {other:?}"),
        }
        // Give a request that did go out the time to arrive, then check none did.
        let next = event("b", serde_json::json!({"n": 2}));
        sink.deliver(&next, &Gate::always()).await.unwrap();
        let ids: Vec<String> = peer
            .requests()
            .iter()
            .filter_map(|r| r.header("idempotency-key").map(str::to_owned))
            .collect();
        assert_eq!(
            ids,
            vec![next.id.to_string()],
            "only the event whose gate was open"
        );
    });
}

#[test]
fn http_nothing_listening_is_unavailable() {
    runtime().block_on(async {
        let url = format!("http://127.0.0.1:{}/hook", closed_port());
        let sink = http_sink(&url, Duration::from_secs(10));
        let m = unavailable(
            sink.deliver(&event("a", serde_json::json!({})), &Gate::always())
                .await,
        );
        // The relay names the sink in front of it, once.
        assert!(
            m.starts_with("cannot connect: ") && !m.contains(&url),
            "{m}"
        );
    });
}

#[test]
fn http_unknown_host_is_unavailable() {
    runtime().block_on(async {
        // .invalid never resolves (RFC 2606); without DNS at all this fails too.
        let sink = http_sink("http://leasectl-test.invalid/", Duration::from_secs(4));
        let m = unavailable(
            sink.deliver(&event("a", serde_json::json!({})), &Gate::always())
                .await,
        );
        assert!(m.starts_with("cannot connect: "), "{m}");
    });
}

#[test]
fn http_hangup_or_reset_after_the_request_is_this_events_refusal() {
    // The request went out: the connection dropped on this event is this event's failure
    // (charged), not an unreachable sink (which would back off every aggregate).
    for answer in [Answer::Hangup, Answer::Reset] {
        runtime().block_on(async {
            let peer = Peer::start(answer).await;
            let sink = http_sink(&peer.url("/"), Duration::from_secs(10));
            let m = rejected(
                sink.deliver(&event("a", serde_json::json!({})), &Gate::always())
                    .await,
            );
            assert!(
                m.contains("the request was sent but the connection failed"),
                "{m}"
            );
            assert_eq!(peer.requests().len(), 1);
        });
    }
}

#[test]
fn https_to_a_peer_without_tls_is_unavailable() {
    runtime().block_on(async {
        // The peer never completes a TLS handshake: the connect timeout (half of 1s) ends it.
        // This also proves the TLS setup needs no process-wide rustls provider.
        let peer = Peer::start(status(200, "OK", "")).await;
        let url = format!("https://{}/", peer.addr);
        let sink = http_sink(&url, Duration::from_secs(1));
        let m = unavailable(
            sink.deliver(&event("a", serde_json::json!({})), &Gate::always())
                .await,
        );
        assert!(m.starts_with("cannot connect: "), "{m}");
        assert!(peer.requests().is_empty());
    });
}

#[test]
fn http_credentials_in_the_url_become_basic_auth_and_stay_secret() {
    runtime().block_on(async {
        let peer = Peer::start(status(401, "Unauthorized", "bad credentials")).await;
        let url = format!("http://alice:s3cr%40t@{}/hook", peer.addr);
        let sink = http_sink(&url, Duration::from_secs(10));
        let m = rejected(
            sink.deliver(&event("a", serde_json::json!({})), &Gate::always())
                .await,
        );
        assert_eq!(m, "HTTP 401 Unauthorized: bad credentials");
        let r = &peer.requests()[0];
        // base64("alice:s3cr@t"): the password is percent-decoded first.
        assert_eq!(r.header("authorization"), Some("Basic YWxpY2U6czNjckB0"));
        assert_eq!(r.target, "/hook");
        assert!(!r.header("host").unwrap().contains('@'));

        let url = format!("http://alice:s3cr%40t@127.0.0.1:{}/hook", closed_port());
        let sink = http_sink(&url, Duration::from_secs(10));
        let m = unavailable(
            sink.deliver(&event("a", serde_json::json!({})), &Gate::always())
                .await,
        );
        assert!(
            m.starts_with("cannot connect: ") && !m.contains("s3cr"),
            "{m}"
        );
    });
}

// ---------------------------------------------------------------------------------------------
// The exec sink.

fn exec_sink(command: &str, timeout: Duration) -> Exec {
    Exec::new(exec::Spec::parse(command).unwrap(), opts(timeout))
}

fn read_pid(path: &Path) -> i32 {
    std::fs::read_to_string(path)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn exec_gets_the_event_on_stdin_and_in_its_environment() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display();
    let sink = exec_sink(
        &format!("cat > '{d}/stdin' && env | grep '^LEASECTL_' | grep -v '^LEASECTL_CHAOS_' | grep -v '^LEASECTL_TEST_' | sort > '{d}/env'"),
        Duration::from_secs(30),
    );
    let ev = event("deploy", serde_json::json!({"exit_code": 0, "x": "y z"}));
    runtime()
        .block_on(sink.deliver(&ev, &Gate::always()))
        .unwrap();
    let stdin = std::fs::read_to_string(dir.path().join("stdin")).unwrap();
    let line = stdin.strip_suffix('\n').expect("a newline after the event");
    assert_eq!(one_json_line(line.as_bytes()), spec_object(&ev));
    let env = std::fs::read_to_string(dir.path().join("env")).unwrap();
    assert_eq!(
        env,
        format!(
            "LEASECTL_AGGREGATE_ID=deploy\nLEASECTL_AGGREGATE_TYPE=leasectl.target\n\
             LEASECTL_EVENT_ID={}\nLEASECTL_EVENT_TYPE=leasectl.run.finished\n",
            ev.id
        )
    );
}

#[test]
fn exec_an_event_whose_gate_has_closed_never_starts_the_command() {
    let dir = tempfile::tempdir().unwrap();
    let ran = dir.path().join("ran");
    let sink = exec_sink(
        &format!("touch '{}'", ran.display()),
        Duration::from_secs(30),
    );
    let ev = event("deploy", serde_json::json!({}));
    match runtime().block_on(sink.deliver(&ev, &Gate::closed())) {
        Err(DeliveryError::Late(_)) => {}
        other => panic!("expected Late, got {other:?}"),
    }
    assert!(
        !ran.exists(),
        "the command ran for an event that may no longer leave"
    );
    runtime()
        .block_on(sink.deliver(&ev, &Gate::always()))
        .unwrap();
    assert!(ran.exists());
}

#[test]
fn exec_exit_status_decides() {
    let rt = runtime();
    let ev = event("a", serde_json::json!({}));
    let deliver = |cmd: &str| {
        rt.block_on(exec_sink(cmd, Duration::from_secs(30)).deliver(&ev, &Gate::always()))
    };
    deliver("cat >/dev/null; exit 0").unwrap();
    assert_eq!(rejected(deliver("exit 3")), "exited with status 3");
    assert_eq!(
        rejected(deliver("kill -KILL $$")),
        "killed by signal SIGKILL"
    );
}

#[test]
fn exec_missing_or_unrunnable_command_is_unavailable() {
    let rt = runtime();
    let ev = event("a", serde_json::json!({}));
    let sink = exec_sink("nonexistent-cmd-xyz", Duration::from_secs(30));
    let m = unavailable(rt.block_on(sink.deliver(&ev, &Gate::always())));
    assert!(m.starts_with("command not found"), "{m}");
    assert!(m.contains("nonexistent-cmd-xyz"), "{m}");

    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("not-executable.sh");
    std::fs::write(&script, "#!/bin/sh\nexit 0\n").unwrap();
    let sink = exec_sink(&format!("'{}'", script.display()), Duration::from_secs(30));
    let m = unavailable(rt.block_on(sink.deliver(&ev, &Gate::always())));
    assert!(m.starts_with("command not executable"), "{m}");
}

#[test]
fn exec_command_that_ignores_stdin_is_delivered() {
    let rt = runtime();
    // Far more than a pipe holds, so the write cannot complete unless someone reads.
    let ev = event("a", serde_json::json!({ "blob": "x".repeat(4 << 20) }));
    // Never reads, leaves stdin open until it exits: the write is abandoned at the exit.
    rt.block_on(exec_sink("exit 0", Duration::from_secs(30)).deliver(&ev, &Gate::always()))
        .unwrap();
    // Closes stdin first: the write fails with EPIPE, which must not matter.
    rt.block_on(
        exec_sink("exec 0<&-; sleep 0.2; exit 0", Duration::from_secs(30))
            .deliver(&ev, &Gate::always()),
    )
    .unwrap();
    // Exits while a background child holds the stdin pipe open without reading it (as fd 3:
    // the shell points a background job's stdin at /dev/null): the write is abandoned at the
    // exit rather than waiting for that child.
    let dir = tempfile::tempdir().unwrap();
    let pid_file = dir.path().join("holder.pid");
    let holder = format!(
        "exec 3<&0; sleep 300 & echo $! > '{}'; exit 0",
        pid_file.display()
    );
    let start = Instant::now();
    let outcome =
        rt.block_on(exec_sink(&holder, Duration::from_secs(10)).deliver(&ev, &Gate::always()));
    let elapsed = start.elapsed();
    // Stopping the background child is the test's job: a normal exit leaves the group alone.
    let pid = read_pid(&pid_file);
    assert!(alive(pid), "the background child should still be there");
    crate::common::kill(pid as u32, libc::SIGKILL);
    outcome.unwrap();
    assert!(elapsed < Duration::from_secs(10), "{elapsed:?}");
    // The exit status still decides.
    assert_eq!(
        rejected(rt.block_on(
            exec_sink("exec 0<&-; exit 5", Duration::from_secs(30)).deliver(&ev, &Gate::always())
        )),
        "exited with status 5"
    );
}

/// Starts a command that records its shell's pid and a background child's pid, then sleeps;
/// `prefix` runs first (e.g. to ignore SIGTERM).
fn sleeper(dir: &Path, prefix: &str) -> String {
    let d = dir.display();
    format!("{prefix} echo $$ > '{d}/sh.pid'; sleep 300 & echo $! > '{d}/child.pid'; wait")
}

fn assert_gone(dir: &Path) {
    for name in ["sh.pid", "child.pid"] {
        let pid = read_pid(&dir.join(name));
        wait_for(&format!("{name} {pid} to be gone"), || !alive(pid));
    }
}

#[test]
fn exec_timeout_stops_the_command_and_its_children() {
    let dir = tempfile::tempdir().unwrap();
    let timeout = Duration::from_secs(2);
    let sink = exec_sink(&sleeper(dir.path(), ""), timeout);
    let start = Instant::now();
    let m = no_answer(
        runtime().block_on(sink.deliver(&event("a", serde_json::json!({})), &Gate::always())),
    );
    assert_eq!(m, "timed out after 2s");
    // SIGTERM was enough: no need to wait out the grace period.
    assert!(
        start.elapsed() < timeout + KILL_GRACE,
        "{:?}",
        start.elapsed()
    );
    assert!(
        dir.path().join("child.pid").exists(),
        "the command did not start in time"
    );
    assert_gone(dir.path());
}

#[test]
fn exec_timeout_escalates_to_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let timeout = Duration::from_secs(2);
    // An ignored SIGTERM is inherited by the background sleep too.
    let sink = exec_sink(&sleeper(dir.path(), "trap '' TERM;"), timeout);
    let start = Instant::now();
    let m = no_answer(
        runtime().block_on(sink.deliver(&event("a", serde_json::json!({})), &Gate::always())),
    );
    assert_eq!(m, "timed out after 2s");
    assert!(
        start.elapsed() >= timeout + KILL_GRACE,
        "{:?}",
        start.elapsed()
    );
    assert_gone(dir.path());
}

#[test]
fn exec_abandoned_delivery_kills_the_command_and_its_children() {
    let dir = tempfile::tempdir().unwrap();
    let sink = exec_sink(&sleeper(dir.path(), ""), Duration::from_secs(600));
    let ev = event("a", serde_json::json!({}));
    runtime().block_on(async {
        let child_pid = dir.path().join("child.pid");
        let started = until("the command to start", || {
            std::fs::read_to_string(&child_pid).is_ok_and(|s| s.ends_with('\n'))
        });
        let gate = Gate::always();
        let delivery = sink.deliver(&ev, &gate);
        tokio::select! {
            r = delivery => panic!("the delivery ended: {r:?}"),
            () = started => {}
        }
        // `delivery` has been dropped here, as a relay dropping its future would.
    });
    assert_gone(dir.path());
}
