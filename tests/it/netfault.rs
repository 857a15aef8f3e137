//! A TCP proxy in front of the test database that can go silent: [`Proxy::black_hole`] stops
//! forwarding in both directions while every connection stays open — the client's statements
//! wait in the proxy and reach the server late, when the hole closes, as after a network
//! partition that TCP retransmission survives. That is the fault an *established* connection
//! meets, which a refused or timed-out connect does not show.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub struct Proxy {
    pub port: u16,
    hole: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
}

/// The test database's server as a `host:port` this proxy can reach.
fn upstream() -> String {
    std::env::var("LEASECTL_TEST_PG_TCP").unwrap_or_else(|_| "127.0.0.1:5432".to_owned())
}

impl Proxy {
    pub fn start() -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let hole = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Mutex::new(Vec::new()));
        let (h, s, c) = (hole.clone(), stop.clone(), conns.clone());
        listener.set_nonblocking(true).unwrap();
        std::thread::spawn(move || {
            while !s.load(Ordering::SeqCst) {
                let client = match listener.accept() {
                    Ok((client, _)) => client,
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                };
                client.set_nonblocking(false).unwrap();
                let Ok(server) = TcpStream::connect(upstream()) else {
                    continue;
                };
                for sock in [&client, &server] {
                    c.lock().unwrap().push(sock.try_clone().unwrap());
                }
                pump(
                    client.try_clone().unwrap(),
                    server.try_clone().unwrap(),
                    h.clone(),
                );
                pump(server, client, h.clone());
            }
        });
        Proxy {
            port,
            hole,
            stop,
            conns,
        }
    }

    /// A libpq connection string to the test database through this proxy.
    pub fn url(&self) -> String {
        format!(
            "host=127.0.0.1 port={} dbname=leasectl_test user={}",
            self.port,
            nix::unistd::User::from_uid(nix::unistd::geteuid())
                .unwrap()
                .unwrap()
                .name
        )
    }

    /// Forward nothing (`true`) or everything held back and from now on (`false`).
    pub fn black_hole(&self, on: bool) {
        self.hole.store(on, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        self.hole.store(false, Ordering::SeqCst);
        for s in self.conns.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Copies `from` to `to` until either side closes, holding each chunk while the hole is open.
fn pump(mut from: TcpStream, mut to: TcpStream, hole: Arc<AtomicBool>) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 16384];
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            while hole.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(2));
            }
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
}
