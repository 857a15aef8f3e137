//! How many round trips a command makes: a TCP proxy in front of the test database that records
//! every chunk each side sends, in the order it read them, and splits what the client sent into
//! the frontend messages of the PostgreSQL protocol.
//!
//! A *flight* is what the client sends between two answers of the server: the client's
//! messages up to the next byte from the server. Statements that tokio-postgres pipelines go in
//! one flight; a statement sent only after an answer starts another. The server answers a
//! flight only once it has read it, and the client sends the next only once it has read that
//! answer, so the order of the record is the order on the wire.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One chunk as read: which connection, from the client (or the server), the bytes.
type Chunk = (usize, bool, Vec<u8>);

/// One frontend message: its type byte (0 in the startup phase) and body.
pub type Message = (u8, Vec<u8>);

/// What the client sent between two answers of the server.
pub type Flight = Vec<Message>;

pub struct Recorder {
    pub port: u16,
    log: Arc<Mutex<Vec<Chunk>>>,
}

/// Holds the server's answers back once the client has sent a given text, until a condition
/// holds ([`Recorder::holding`]): a test's way to order what a client sees against what else
/// happens, instead of racing it.
struct Gate {
    after: &'static [u8],
    until: Box<dyn Fn() -> bool + Send + Sync>,
    seen: std::sync::atomic::AtomicBool,
}

impl Gate {
    /// Called by the server-to-client pump before it passes a chunk on.
    fn wait(&self) {
        if self.seen.load(std::sync::atomic::Ordering::SeqCst) {
            let give_up = std::time::Instant::now() + crate::common::PATIENCE;
            while !(self.until)() && std::time::Instant::now() < give_up {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

/// The test database's server as a `host:port` the proxy can reach.
fn upstream() -> String {
    std::env::var("LEASECTL_TEST_PG_TCP").unwrap_or_else(|_| "127.0.0.1:5432".to_owned())
}

impl Recorder {
    pub fn start() -> Recorder {
        Recorder::with_gate(None)
    }

    /// A recorder that, once the client has sent `after` (anywhere in one chunk), passes no
    /// answer of the server on until `until()` holds (checked every millisecond, for
    /// [`PATIENCE`](crate::common::PATIENCE) at most).
    pub fn holding(
        after: &'static str,
        until: impl Fn() -> bool + Send + Sync + 'static,
    ) -> Recorder {
        Recorder::with_gate(Some(Gate {
            after: after.as_bytes(),
            until: Box::new(until),
            seen: std::sync::atomic::AtomicBool::new(false),
        }))
    }

    fn with_gate(gate: Option<Gate>) -> Recorder {
        let gate = gate.map(Arc::new);
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let log = Arc::new(Mutex::new(Vec::new()));
        let l = log.clone();
        std::thread::spawn(move || {
            for (id, client) in listener.incoming().enumerate() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(upstream()) else {
                    continue;
                };
                for s in [&client, &server] {
                    s.set_nodelay(true).unwrap();
                }
                pump(
                    id,
                    true,
                    client.try_clone().unwrap(),
                    server.try_clone().unwrap(),
                    &l,
                    gate.clone(),
                );
                pump(id, false, server, client, &l, gate.clone());
            }
        });
        Recorder { port, log }
    }

    /// A libpq connection string to the test database through the proxy, without TLS (the
    /// messages must be readable).
    pub fn url(&self) -> String {
        format!(
            "host=127.0.0.1 port={} dbname=leasectl_test sslmode=disable user={}",
            self.port,
            nix::unistd::User::from_uid(nix::unistd::geteuid())
                .unwrap()
                .unwrap()
                .name
        )
    }

    /// `relay --once --batch 10 --sink stdout` on `env`'s schema through this proxy, which must
    /// exit 0: its output.
    pub fn relay_once(&self, env: &crate::common::Env) -> std::process::Output {
        use crate::common::*;
        let o = env
            .command_at(&self.url())
            .args(["relay", "--once", "--batch", "10", "--sink", "stdout"])
            .output_in_time();
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        o
    }

    /// The flights of every connection so far, in order: each flight is its frontend
    /// messages, as (type byte, body). Startup-phase packets have type 0.
    pub fn flights(&self) -> Vec<Vec<Flight>> {
        self.connections()
            .into_iter()
            .map(|chunks| {
                let mut flights: Vec<Vec<u8>> = Vec::new();
                let mut last_from_client = false;
                for (from_client, bytes) in &chunks {
                    if *from_client {
                        if !last_from_client {
                            flights.push(Vec::new());
                        }
                        flights.last_mut().unwrap().extend_from_slice(bytes);
                    }
                    last_from_client = *from_client;
                }
                split(&flights)
            })
            .collect()
    }
}

impl Recorder {
    /// Each connection's chunks in the order they were read: (from the client, bytes).
    fn connections(&self) -> Vec<Vec<(bool, Vec<u8>)>> {
        let log = self.log.lock().unwrap().clone();
        let conns = log.iter().map(|c| c.0 + 1).max().unwrap_or(0);
        (0..conns)
            .map(|id| {
                log.iter()
                    .filter(|c| c.0 == id)
                    .map(|c| (c.1, c.2.clone()))
                    .collect()
            })
            .collect()
    }

    /// What the server sent on each connection, split into backend messages (type byte, body).
    /// The server's stream is typed from its first byte: [`Recorder::url`] asks for no TLS.
    pub fn answers(&self) -> Vec<Vec<Message>> {
        self.connections()
            .into_iter()
            .map(|chunks| {
                let bytes: Vec<u8> = chunks
                    .iter()
                    .filter(|(from_client, _)| !from_client)
                    .flat_map(|(_, b)| b.iter().copied())
                    .collect();
                let mut msgs = Vec::new();
                let mut at = 0;
                while at + 5 <= bytes.len() {
                    let len =
                        u32::from_be_bytes(bytes[at + 1..at + 5].try_into().unwrap()) as usize;
                    msgs.push((bytes[at], bytes[at + 5..at + 1 + len].to_vec()));
                    at += 1 + len;
                }
                msgs
            })
            .collect()
    }
}

/// The `ErrorResponse` messages among `answers`, as text (their fields, NULs as spaces).
pub fn errors(answers: &[Message]) -> Vec<String> {
    answers
        .iter()
        .filter(|(k, _)| *k == b'E')
        .map(|(_, body)| String::from_utf8_lossy(body).replace('\0', " "))
        .collect()
}

/// Splits each flight's bytes into frontend messages; the stream starts in the startup phase
/// (untyped packets: SSL and GSS requests, then the startup message).
fn split(flights: &[Vec<u8>]) -> Vec<Flight> {
    let mut started = false;
    let mut out = Vec::new();
    for bytes in flights {
        let mut msgs = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let (kind, len_at) = if started {
                (bytes[at], at + 1)
            } else {
                (0, at)
            };
            let len = u32::from_be_bytes(bytes[len_at..len_at + 4].try_into().unwrap()) as usize;
            let body = bytes[len_at + 4..len_at + len].to_vec();
            if !started {
                let code = u32::from_be_bytes(body[..4].try_into().unwrap());
                // SSLRequest and GSSENCRequest come before the startup message.
                started = code != 80_877_103 && code != 80_877_104;
            }
            msgs.push((kind, body));
            at = len_at + len;
        }
        out.push(msgs);
    }
    out
}

fn pump(
    id: usize,
    from_client: bool,
    mut from: TcpStream,
    mut to: TcpStream,
    log: &Arc<Mutex<Vec<Chunk>>>,
    gate: Option<Arc<Gate>>,
) {
    let log = log.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 65536];
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if let Some(gate) = &gate {
                if from_client {
                    if buf[..n].windows(gate.after.len()).any(|w| w == gate.after) {
                        gate.seen.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                } else {
                    gate.wait();
                }
            }
            // Recorded before it is passed on: an answer to it can only come after.
            log.lock()
                .unwrap()
                .push((id, from_client, buf[..n].to_vec()));
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
        std::thread::sleep(Duration::from_millis(10));
    });
}

/// Whether a flight sends a statement: a simple query ('Q') or an extended-protocol Parse ('P').
pub fn has_statement(flight: &[Message]) -> bool {
    !statements(flight).is_empty()
}

/// The SQL text of a flight's statements, and `BIND name` for each execution of a statement
/// prepared earlier under a name (a Bind names it; its text went in an earlier Parse).
pub fn statements(flight: &[Message]) -> Vec<String> {
    flight
        .iter()
        .filter_map(|(k, body)| match k {
            b'Q' => Some(String::from_utf8_lossy(body).into_owned()),
            // Parse: statement name, NUL, query text, NUL, ...
            b'P' => {
                let text = body.splitn(3, |b| *b == 0).nth(1)?;
                Some(String::from_utf8_lossy(text).into_owned())
            }
            // Bind: portal name, NUL, statement name, NUL, ... (an unnamed statement's Bind
            // follows its Parse in the same flight, which already stands for it).
            b'B' => {
                let name = body.splitn(3, |b| *b == 0).nth(1)?;
                (!name.is_empty()).then(|| format!("BIND {}", String::from_utf8_lossy(name)))
            }
            _ => None,
        })
        .collect()
}
