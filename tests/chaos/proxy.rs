//! An in-test TCP proxy between leasectl and the cluster, switchable at runtime:
//!
//! * `pass` forwards bytes both ways;
//! * `black_hole` keeps every connection (and accepts new ones) but stops forwarding: nothing is
//!   lost, nothing arrives — like a network path that drops packets until it heals, after which
//!   TCP delivers what was queued;
//! * `cut` closes every connection now (a server restart or a reset as the client sees it);
//! * `reset` aborts every connection with a TCP reset (`SO_LINGER` 0), as a crashed peer or a
//!   middlebox would;
//! * `black_hole_on` arms a black hole that starts the moment a client sends a given text (the
//!   chunk that carries it is held too): the path goes silent exactly where a client is.
//!
//! A black hole also models what no client can undo: a request it gave up on (no answer within
//! its timeout, connection closed) is still queued, and reaches the server once the path heals
//! — after whatever the client sent since on new connections, perhaps. The proxy marks such a
//! connection before forwarding it ([`abandoned`]), so a receiver can tell a late copy of an
//! abandoned request from what the client sends now.
//!
//! Plain std threads: two forwarders per connection, polling the mode every few milliseconds.

use std::collections::{HashMap, HashSet};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

struct State {
    black_hole: AtomicBool,
    stop: AtomicBool,
    /// While set, a forwarder that ends closes its sockets without a FIN (see `reset`).
    resetting: AtomicBool,
    next_id: AtomicU64,
    /// Both sockets of every open connection, so `cut` can shut them down.
    conns: Mutex<HashMap<u64, (TcpStream, TcpStream)>>,
    /// An armed trigger (`black_hole_on`).
    trigger: Mutex<Option<Trigger>>,
}

/// A black hole armed to start when a client sends `text`, for `hold` seconds; `fired`: when it
/// started, as seconds since the epoch.
struct Trigger {
    text: Vec<u8>,
    hold: f64,
    fired: Option<f64>,
}

impl State {
    /// Whether the path is black-holed now; a triggered black hole heals by itself once its
    /// time is up.
    fn black_holed(&self) -> bool {
        if let Some(Trigger {
            hold,
            fired: Some(at),
            ..
        }) = *self.trigger.lock().unwrap()
        {
            if crate::procs::now() >= at + hold {
                self.black_hole.store(false, Ordering::SeqCst);
            }
        }
        self.black_hole.load(Ordering::SeqCst)
    }

    /// Whether `chunk`, on its way to the server, fires the armed trigger: the black hole starts
    /// now, before the chunk is forwarded.
    fn fires(&self, chunk: &[u8]) -> bool {
        let mut trigger = self.trigger.lock().unwrap();
        let Some(Trigger {
            text,
            fired: fired @ None,
            ..
        }) = trigger.as_mut()
        else {
            return false;
        };
        if !chunk.windows(text.len()).any(|w| w == text.as_slice()) {
            return false;
        }
        self.black_hole.store(true, Ordering::SeqCst);
        *fired = Some(crate::procs::now());
        true
    }
}

pub struct Proxy {
    pub port: u16,
    state: Arc<State>,
    acceptor: Option<JoinHandle<()>>,
}

const TICK: Duration = Duration::from_millis(10);

/// The upstream ends (the address a receiver sees as its peer) of connections whose client had
/// closed its side before the proxy forwarded what the black hole held: requests the client
/// abandoned.
static ABANDONED: Mutex<Option<HashSet<SocketAddr>>> = Mutex::new(None);

/// Whether what arrives from `peer` (a connection the proxy opened upstream) is what a black
/// hole held for a client that had already closed the connection: a request it abandoned.
pub fn abandoned(peer: SocketAddr) -> bool {
    ABANDONED
        .lock()
        .unwrap()
        .as_ref()
        .is_some_and(|s| s.contains(&peer))
}

fn mark_abandoned(upstream_end: SocketAddr, on: bool) {
    let mut set = ABANDONED.lock().unwrap();
    let set = set.get_or_insert_with(HashSet::new);
    if on {
        set.insert(upstream_end);
    } else {
        set.remove(&upstream_end);
    }
}

impl Proxy {
    pub fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy: bind 127.0.0.1:0");
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(State {
            black_hole: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            resetting: AtomicBool::new(false),
            next_id: AtomicU64::new(0),
            conns: Mutex::new(HashMap::new()),
            trigger: Mutex::new(None),
        });
        let st = state.clone();
        let acceptor = std::thread::spawn(move || {
            for client in listener.incoming() {
                if st.stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(client) = client else { continue };
                let st = st.clone();
                std::thread::spawn(move || connect(st, client, upstream));
            }
        });
        Proxy {
            port,
            state,
            acceptor: Some(acceptor),
        }
    }

    pub fn set_black_hole(&self, on: bool) {
        self.state.black_hole.store(on, Ordering::SeqCst);
    }

    /// Arms a black hole that starts as soon as a client sends `text` (in one chunk) and lasts
    /// `hold` seconds: that chunk and everything after it are held until then (or until
    /// `set_black_hole(false)`).
    pub fn black_hole_on(&self, text: &str, hold: f64) {
        *self.state.trigger.lock().unwrap() = Some(Trigger {
            text: text.as_bytes().to_vec(),
            hold,
            fired: None,
        });
    }

    /// When the armed trigger fired, if it did.
    pub fn fired(&self) -> Option<f64> {
        self.state
            .trigger
            .lock()
            .unwrap()
            .as_ref()
            .and_then(|t| t.fired)
    }

    /// Disarms the trigger; returns when it fired, if it did (its black hole may still be on).
    pub fn disarm(&self) -> Option<f64> {
        self.state
            .trigger
            .lock()
            .unwrap()
            .take()
            .and_then(|t| t.fired)
    }

    /// Closes every open connection (new ones are accepted as usual).
    pub fn cut(&self) {
        let conns = std::mem::take(&mut *self.state.conns.lock().unwrap());
        for (_, (a, b)) in conns {
            let _ = a.shutdown(Shutdown::Both);
            let _ = b.shutdown(Shutdown::Both);
        }
    }
}

impl Proxy {
    /// Aborts every open connection with a TCP reset: `SO_LINGER` 0 on both sockets, then the
    /// forwarders end without shutting them down, so the last close sends RST instead of FIN.
    pub fn reset(&self) {
        self.state.resetting.store(true, Ordering::SeqCst);
        let conns = std::mem::take(&mut *self.state.conns.lock().unwrap());
        for (a, b) in conns.values() {
            for s in [a, b] {
                linger_zero(s);
                // Ends the forwarders' reads (nothing is sent to the peer).
                let _ = s.shutdown(Shutdown::Read);
            }
        }
        // Our copies of the sockets close here; the forwarders' close within a tick or two.
        drop(conns);
        std::thread::sleep(TICK * 5);
        self.state.resetting.store(false, Ordering::SeqCst);
    }
}

fn linger_zero(s: &TcpStream) {
    use std::os::fd::AsRawFd;
    let l = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt on a socket we own, with a correctly sized struct.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&l as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.state.stop.store(true, Ordering::SeqCst);
        self.cut();
        // Wake the acceptor so it sees `stop`.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        if let Some(a) = self.acceptor.take() {
            let _ = a.join();
        }
    }
}

fn connect(st: Arc<State>, client: TcpStream, upstream: SocketAddr) {
    // A black hole also swallows the connection attempt's traffic: hold the client until the
    // path heals, then connect upstream.
    let mut held = false;
    while st.black_holed() && !st.stop.load(Ordering::SeqCst) {
        held = true;
        std::thread::sleep(TICK);
    }
    let Ok(server) = TcpStream::connect_timeout(&upstream, Duration::from_secs(5)) else {
        return; // dropping `client` closes it, as a refused connection would look through a proxy
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    // A port the kernel hands out again must not carry an earlier connection's mark.
    if let Ok(end) = server.local_addr() {
        mark_abandoned(end, false);
    }
    let id = st.next_id.fetch_add(1, Ordering::SeqCst);
    let (Ok(c2), Ok(s2), Ok(c3), Ok(s3)) = (
        client.try_clone(),
        server.try_clone(),
        client.try_clone(),
        server.try_clone(),
    ) else {
        return;
    };
    st.conns.lock().unwrap().insert(id, (c3, s3));
    let st2 = st.clone();
    let up = std::thread::spawn(move || forward(&st2, client, server, Some(held)));
    forward(&st, s2, c2, None);
    let _ = up.join();
    st.conns.lock().unwrap().remove(&id);
}

/// Copies `from` to `to` until either side closes; while black-holed, reads nothing. Towards
/// the server (`upstream` is `Some`: whether a black hole held the connection's start), what a
/// black hole held is read whole first: if the client closed its side meanwhile, the connection
/// is marked [`abandoned`] before any of it is forwarded.
fn forward(st: &State, mut from: TcpStream, mut to: TcpStream, upstream: Option<bool>) {
    let _ = from.set_read_timeout(Some(TICK));
    let mut buf = vec![0u8; 64 * 1024];
    let mut held = upstream == Some(true);
    // A chunk read as a trigger fired, forwarded once the path heals.
    let mut pending: Vec<u8> = Vec::new();
    loop {
        if st.stop.load(Ordering::SeqCst) {
            break;
        }
        if st.black_holed() {
            held = true;
            std::thread::sleep(TICK);
            continue;
        }
        if std::mem::take(&mut held) && upstream.is_some() {
            let (queued, closed) = read_queued(&mut from, &mut buf);
            let queued = [std::mem::take(&mut pending), queued].concat();
            if closed && !queued.is_empty() {
                if let Ok(end) = to.local_addr() {
                    mark_abandoned(end, true);
                }
            }
            if to.write_all(&queued).is_err() || closed {
                break;
            }
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if upstream.is_some() && st.fires(&buf[..n]) {
                    pending = buf[..n].to_vec();
                    held = true;
                    continue;
                }
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(_) => break,
        }
    }
    if !st.resetting.load(Ordering::SeqCst) {
        let _ = from.shutdown(Shutdown::Both);
        let _ = to.shutdown(Shutdown::Both);
    }
}

/// Everything queued on `from` now (reads until one finds nothing within a tick), and whether
/// the peer had closed its side behind it.
fn read_queued(from: &mut TcpStream, buf: &mut [u8]) -> (Vec<u8>, bool) {
    let mut queued = Vec::new();
    loop {
        match from.read(buf) {
            Ok(0) => return (queued, true),
            Ok(n) => queued.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return (queued, false)
            }
            Err(_) => return (queued, true),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The client of a reset connection reads ECONNRESET, not an orderly end of file.
    #[test]
    fn reset_aborts_the_connection_with_a_tcp_reset() {
        let upstream = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = upstream.local_addr().unwrap();
        std::thread::spawn(move || {
            for s in upstream.incoming().flatten() {
                std::thread::spawn(move || {
                    let mut s = s;
                    let mut buf = [0u8; 64];
                    while let Ok(n) = s.read(&mut buf) {
                        if n == 0 || s.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                });
            }
        });
        let proxy = Proxy::start(addr);
        let mut c = TcpStream::connect(("127.0.0.1", proxy.port)).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(b"ping").unwrap();
        let mut buf = [0u8; 4];
        c.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"ping");
        proxy.reset();
        let got = c.read(&mut buf);
        assert_eq!(
            got.map_err(|e| e.kind()),
            Err(ErrorKind::ConnectionReset),
            "expected a reset"
        );
    }

    /// A request sent into a black hole by a client that then closes is forwarded when the path
    /// heals, marked as abandoned before its first byte arrives; one whose client still waits
    /// is not marked.
    #[test]
    fn a_request_abandoned_in_a_black_hole_arrives_marked() {
        let upstream = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = upstream.local_addr().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for s in upstream.incoming().flatten() {
                let tx = tx.clone();
                std::thread::spawn(move || {
                    let mut s = s;
                    let mut buf = [0u8; 16];
                    if let Ok(n) = s.read(&mut buf) {
                        let peer = s.peer_addr().unwrap();
                        let _ = tx.send((buf[..n].to_vec(), abandoned(peer)));
                    }
                });
            }
        });
        let proxy = Proxy::start(addr);
        let mut gone = TcpStream::connect(("127.0.0.1", proxy.port)).unwrap();
        let mut waiting = TcpStream::connect(("127.0.0.1", proxy.port)).unwrap();
        // Both connections reach upstream before the path goes dark.
        std::thread::sleep(TICK * 10);
        proxy.set_black_hole(true);
        // A forwarder sees the mode between reads: within a tick.
        std::thread::sleep(TICK * 5);
        gone.write_all(b"gone").unwrap();
        waiting.write_all(b"wait").unwrap();
        drop(gone);
        // One connected while the path was dark: its start was held too.
        let mut late = TcpStream::connect(("127.0.0.1", proxy.port)).unwrap();
        late.write_all(b"late").unwrap();
        drop(late);
        std::thread::sleep(TICK * 10);
        proxy.set_black_hole(false);
        let mut got: Vec<(Vec<u8>, bool)> = (0..3)
            .map(|_| rx.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        got.sort();
        assert_eq!(
            got,
            [
                (b"gone".to_vec(), true),
                (b"late".to_vec(), true),
                (b"wait".to_vec(), false)
            ]
        );
    }
}
