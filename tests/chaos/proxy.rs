//! An in-test TCP proxy between leasectl and the cluster, switchable at runtime:
//!
//! * `pass` forwards bytes both ways;
//! * `black_hole` keeps every connection (and accepts new ones) but stops forwarding: nothing is
//!   lost, nothing arrives — like a network path that drops packets until it heals, after which
//!   TCP delivers what was queued;
//! * `cut` closes every connection now (a server restart or a reset as the client sees it);
//! * `reset` aborts every connection with a TCP reset (`SO_LINGER` 0), as a crashed peer or a
//!   middlebox would.
//!
//! Plain std threads: two forwarders per connection, polling the mode every few milliseconds.

use std::collections::HashMap;
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
}

pub struct Proxy {
    pub port: u16,
    state: Arc<State>,
    acceptor: Option<JoinHandle<()>>,
}

const TICK: Duration = Duration::from_millis(10);

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
    while st.black_hole.load(Ordering::SeqCst) && !st.stop.load(Ordering::SeqCst) {
        std::thread::sleep(TICK);
    }
    let Ok(server) = TcpStream::connect_timeout(&upstream, Duration::from_secs(5)) else {
        return; // dropping `client` closes it, as a refused connection would look through a proxy
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
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
    let up = std::thread::spawn(move || forward(&st2, client, server));
    forward(&st, s2, c2);
    let _ = up.join();
    st.conns.lock().unwrap().remove(&id);
}

/// Copies `from` to `to` until either side closes; while black-holed, reads nothing.
fn forward(st: &State, mut from: TcpStream, mut to: TcpStream) {
    let _ = from.set_read_timeout(Some(TICK));
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if st.stop.load(Ordering::SeqCst) {
            break;
        }
        if st.black_hole.load(Ordering::SeqCst) {
            std::thread::sleep(TICK);
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
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
}
