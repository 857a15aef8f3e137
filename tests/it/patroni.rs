//! High availability under a real HA engine (docs/OPERATIONS.md, "Patroni"): a two-node Patroni
//! cluster with `synchronous_mode: true`, its own etcd, and both started by the test in a
//! temporary directory on spare ports (Debian's patroni and etcd-server packages and the
//! PostgreSQL server binaries failover.rs uses). leasectl is given both hosts with
//! `target_session_attrs=read-write`. While a holder runs a command that writes a line every
//! 100 ms, a second caller waits for the same target, a relay publishes to a file and a writer
//! inserts outbox events, the test switches the primary over (Patroni's REST API) and then fails
//! it (its Patroni SIGKILLed, its PostgreSQL stopped immediately: a crashed host as far as
//! anyone can tell), and checks that
//!
//! * the two commands never overlapped: one holder at a time, by the lines' timestamps;
//! * fences never went back, and the second holder's fence is greater than the first's: the
//!   first is of timeline 1, the second of the timeline of the second promotion;
//! * the holder rode both (its `--ttl` exceeds Patroni's failover time): its run is stored on the
//!   last primary under the fence it started with;
//! * every event the writer saw committed reached the relay's output;
//! * `leasectl doctor` reports the replication as synchronous, and its `failover` check agrees
//!   with the failover time measured here.
//!
//! Every wait is on a condition (Patroni's REST API, `pg_is_in_recovery()`, files, exits); the
//! processes are stopped by [`Patroni`]'s drop, also when the test fails. The binaries missing is
//! a failure, not a skip (scripts/test installs them).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;
use crate::failover::{as_postgres, doctor_check, must, pg_bin, pg_bin_dir, Node};

/// Patroni's leader key lives this long without renewal (seconds): after a crash the standby is
/// promoted once it has expired, so the failover takes about this long. The HA loop runs every
/// `LOOP_WAIT` seconds; etcd and PostgreSQL operations are retried for `RETRY_TIMEOUT`.
const PATRONI_TTL: u64 = 10;
const LOOP_WAIT: u64 = 1;
const RETRY_TIMEOUT: u64 = 3;
/// The holders' lease TTL: well above Patroni's failover time, so a holder rides it.
const LEASE_TTL: &str = "30s";

/// A program of the HA packages, found on PATH or in /usr/bin, or a failure saying how to get it.
fn ha_bin(name: &str, package: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin")])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "{name} is missing: the Patroni test needs it (Debian: apt-get install {package}; \
                 scripts/test installs it)"
            )
        })
}

/// One HTTP/1.0 request to 127.0.0.1:PORT; the status and the body.
fn http(port: u16, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String)> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    // A switchover answers once it is done (a few seconds).
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.set_write_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut response = String::new();
    s.read_to_string(&mut response)?;
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok((status, body))
}

/// One Patroni member: its PostgreSQL (data directory and port), its REST API port and its
/// Patroni process while it runs.
struct Member {
    node: Node,
    api: u16,
    config: PathBuf,
    patroni: Option<Child>,
}

/// A Patroni cluster of two members and its etcd, all of the test's own; everything it started
/// is stopped when it is dropped.
struct Patroni {
    members: Vec<Member>,
    etcd: Option<Child>,
    dir: tempfile::TempDir,
}

impl Patroni {
    /// Starts etcd, then member 0 (which bootstraps the cluster and becomes the leader), then
    /// member 1, and returns once member 1 is the synchronous standby, streaming.
    fn start() -> Patroni {
        let patroni = ha_bin("patroni", "patroni");
        let etcd = ha_bin("etcd", "etcd-server");
        // The server binaries too: Patroni runs them from this directory.
        pg_bin("pg_ctl");
        let bin_dir = pg_bin_dir();
        let dir = tempfile::tempdir().unwrap();
        let postgres = nix::unistd::geteuid().is_root().then(|| {
            nix::unistd::User::from_name("postgres")
                .unwrap()
                .expect("an OS user named postgres (the Debian package creates it)")
        });
        if let Some(pg) = &postgres {
            std::os::unix::fs::chown(dir.path(), Some(pg.uid.as_raw()), Some(pg.gid.as_raw()))
                .unwrap();
        }
        let (etcd_port, peer_port) = (spare_port(), spare_port());
        let mut cluster = Patroni {
            members: Vec::new(),
            etcd: None,
            dir,
        };
        let root = cluster.dir.path().to_owned();
        let log = |name: &str| {
            let f = std::fs::File::create(root.join(name)).unwrap();
            (Stdio::from(f.try_clone().unwrap()), Stdio::from(f))
        };
        let (out, err) = log("etcd.log");
        let client_url = format!("http://127.0.0.1:{etcd_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        cluster.etcd = Some(
            Command::new(etcd)
                .args(["--name", "etcd", "--data-dir"])
                .arg(cluster.dir.path().join("etcd"))
                .args(["--listen-client-urls", &client_url])
                .args(["--advertise-client-urls", &client_url])
                .args(["--listen-peer-urls", &peer_url])
                .args(["--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &format!("etcd={peer_url}")])
                .stdin(Stdio::null())
                .stdout(out)
                .stderr(err)
                .spawn()
                .unwrap(),
        );
        cluster.wait_until("etcd to answer", || {
            http(etcd_port, "GET", "/health", "").is_ok_and(|(s, b)| s == 200 && b.contains("true"))
        });

        for name in ["node1", "node2"] {
            let member = Member {
                node: Node {
                    name,
                    data: cluster.dir.path().join(name),
                    port: spare_port(),
                },
                api: spare_port(),
                config: cluster.dir.path().join(format!("{name}.yml")),
                patroni: None,
            };
            // JSON is YAML: Patroni reads this as its configuration file.
            let config = serde_json::json!({
                "scope": "leasectl-test",
                "name": name,
                "restapi": {
                    "listen": format!("127.0.0.1:{}", member.api),
                    "connect_address": format!("127.0.0.1:{}", member.api),
                },
                "etcd3": {"hosts": format!("127.0.0.1:{etcd_port}")},
                "bootstrap": {
                    "dcs": {
                        "ttl": PATRONI_TTL,
                        "loop_wait": LOOP_WAIT,
                        "retry_timeout": RETRY_TIMEOUT,
                        "maximum_lag_on_failover": 1048576,
                        "synchronous_mode": true,
                        "postgresql": {
                            "use_pg_rewind": true,
                            // fsync off: the servers are stopped, never the machine.
                            "parameters": {
                                "fsync": "off",
                                "max_connections": 50,
                                "shared_buffers": "16MB",
                                "wal_log_hints": "on",
                            },
                        },
                    },
                    "initdb": [{"auth": "trust"}, {"encoding": "UTF8"}],
                    "pg_hba": [
                        "local all all trust",
                        "host replication replicator 127.0.0.1/32 trust",
                        "host all all 127.0.0.1/32 trust",
                    ],
                },
                "postgresql": {
                    "listen": format!("127.0.0.1:{}", member.node.port),
                    "connect_address": format!("127.0.0.1:{}", member.node.port),
                    "data_dir": member.node.data,
                    "bin_dir": bin_dir,
                    "pgpass": cluster.dir.path().join(format!("{name}.pgpass")),
                    "authentication": {
                        "replication": {"username": "replicator", "password": "replicator"},
                        "superuser": {"username": "postgres", "password": "postgres"},
                        "rewind": {"username": "postgres", "password": "postgres"},
                    },
                    "parameters": {"unix_socket_directories": cluster.dir.path()},
                },
                "watchdog": {"mode": "off"},
            });
            std::fs::write(&member.config, config.to_string()).unwrap();
            cluster.members.push(member);
        }
        let start = |cluster: &mut Patroni, i: usize| {
            let name = cluster.members[i].node.name;
            let (out, err) = log(&format!("{name}.log"));
            let mut cmd = Command::new(&patroni);
            cmd.arg(&cluster.members[i].config)
                .current_dir(cluster.dir.path())
                .env("HOME", cluster.dir.path())
                .stdin(Stdio::null())
                .stdout(out)
                .stderr(err);
            // PostgreSQL refuses to run as root; Patroni runs it as itself.
            if let Some(pg) = &postgres {
                use std::os::unix::process::CommandExt;
                cmd.uid(pg.uid.as_raw()).gid(pg.gid.as_raw());
            }
            cluster.members[i].patroni = Some(cmd.spawn().unwrap());
        };
        start(&mut cluster, 0);
        cluster.wait_until("node1 to bootstrap and lead", || {
            cluster.role("node1").as_deref() == Some("leader") && cluster.writable(0)
        });
        start(&mut cluster, 1);
        cluster.wait_for_sync(0, 1);
        cluster
    }

    /// Polls `cond` every 100 ms until it holds; after [`PATIENCE`] panics with `what` and the
    /// tails of Patroni's logs.
    fn wait_until(&self, what: &str, mut cond: impl FnMut() -> bool) {
        let start = Instant::now();
        while !cond() {
            if start.elapsed() > PATIENCE {
                panic!("timed out waiting for {what}\n{}", self.logs());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The last lines of etcd's and each member's log, for a failure message.
    fn logs(&self) -> String {
        ["etcd", "node1", "node2"]
            .iter()
            .map(|name| {
                let text = std::fs::read_to_string(self.dir.path().join(format!("{name}.log")))
                    .unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                format!(
                    "--- {name}.log ---\n{}",
                    lines[lines.len().saturating_sub(15)..].join("\n")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// `GET /cluster` from any member that answers: the members as Patroni sees them.
    fn members(&self) -> Vec<serde_json::Value> {
        self.members
            .iter()
            .filter(|m| m.patroni.is_some())
            .find_map(|m| {
                let (status, body) = http(m.api, "GET", "/cluster", "").ok()?;
                let doc: serde_json::Value = serde_json::from_str(&body).ok()?;
                (status == 200).then(|| doc["members"].as_array().cloned())?
            })
            .unwrap_or_default()
    }

    /// The member's role as Patroni reports it (`leader`, `sync_standby`, `replica`), while it is
    /// running.
    fn role(&self, name: &str) -> Option<String> {
        self.members()
            .into_iter()
            .find(|m| m["name"] == name && m["state"] == "running")
            .and_then(|m| m["role"].as_str().map(str::to_owned))
    }

    /// Whether member `i`'s PostgreSQL takes writes: `pg_is_in_recovery()` is false.
    fn writable(&self, i: usize) -> bool {
        self.members[i]
            .node
            .try_sql("SELECT pg_is_in_recovery()")
            .is_ok_and(|r| r == "f")
    }

    /// Waits until member `primary` leads and takes writes, and member `standby` is its
    /// synchronous standby, streaming, as both Patroni and the primary's pg_stat_replication say.
    fn wait_for_sync(&self, primary: usize, standby: usize) {
        let (p, s) = (&self.members[primary].node, &self.members[standby].node);
        self.wait_until(
            &format!(
                "{} to lead with {} as its synchronous standby",
                p.name, s.name
            ),
            || {
                self.role(p.name).as_deref() == Some("leader")
                    && self.role(s.name).as_deref() == Some("sync_standby")
                    && self.writable(primary)
                    && p.try_sql(&format!(
                        "SELECT state || '/' || sync_state FROM pg_stat_replication \
                          WHERE application_name = '{}'",
                        s.name
                    ))
                    .is_ok_and(|r| r == "streaming/sync")
            },
        );
    }

    /// A switchover through the REST API of the current leader `from`, to `to`.
    fn switchover(&self, from: usize, to: usize) {
        let body = serde_json::json!({
            "leader": self.members[from].node.name,
            "candidate": self.members[to].node.name,
        })
        .to_string();
        let (status, answer) = http(self.members[from].api, "POST", "/switchover", &body)
            .unwrap_or_else(|e| panic!("POST /switchover: {e}\n{}", self.logs()));
        assert_eq!(status, 200, "POST /switchover: {answer}\n{}", self.logs());
    }

    /// Member `i`'s host crashes: its Patroni is SIGKILLed (it neither releases the leader key
    /// nor restarts PostgreSQL), then its PostgreSQL is stopped immediately (every connection
    /// dropped, no checkpoint). The other member can take over only once the leader key
    /// expires in etcd.
    fn crash(&mut self, i: usize) {
        let member = &mut self.members[i];
        let mut patroni = member.patroni.take().expect("a running member");
        let _ = patroni.kill();
        let _ = patroni.wait();
        must(
            as_postgres("pg_ctl")
                .arg("-D")
                .arg(&member.node.data)
                .args(["-m", "immediate", "stop"]),
        );
    }

    /// Both hosts, the writable one wanted.
    fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write&connect_timeout=2",
            self.members[0].node.port, self.members[1].node.port
        )
    }

    /// `leasectl` pointed at both hosts.
    fn leasectl(&self) -> Command {
        let mut c = Command::new(bin());
        c.env_remove("DATABASE_URL")
            .args(["--database-url", &self.url()])
            .current_dir(self.dir.path())
            .stdin(Stdio::null());
        c
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// The pids of every process whose command line names this cluster's directory: Patroni,
    /// etcd, PostgreSQL's postmasters, pg_rewind, and the test's own shell commands.
    fn processes(&self) -> Vec<i32> {
        let needle = self.dir.path().to_string_lossy().into_owned();
        let me = std::process::id() as i32;
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
            .filter(|&pid| pid != me)
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                    String::from_utf8_lossy(&c)
                        .replace('\0', " ")
                        .contains(&needle)
                })
            })
            .filter(|&pid| alive(pid))
            .collect()
    }
}

impl Drop for Patroni {
    /// Patroni first (else it would restart PostgreSQL), then every process that names this
    /// directory: SIGQUIT (an immediate shutdown for a postmaster, which ends its backends),
    /// then SIGKILL for whatever is left after 10 s.
    fn drop(&mut self) {
        for member in &mut self.members {
            if let Some(mut p) = member.patroni.take() {
                let _ = p.kill();
                let _ = p.wait();
            }
        }
        for sig in [libc::SIGQUIT, libc::SIGKILL] {
            let start = Instant::now();
            for pid in self.processes() {
                kill(pid as u32, sig);
            }
            while !self.processes().is_empty() && start.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        if let Some(mut etcd) = self.etcd.take() {
            let _ = etcd.kill();
            let _ = etcd.wait();
        }
    }
}

/// What the writer did: the events whose INSERT returned success, and those whose fate it cannot
/// know (the connection failed around the commit).
#[derive(Default)]
struct Written {
    committed: Vec<u64>,
    uncertain: Vec<u64>,
}

/// A thread inserting one outbox event at a time (payload `{"n": N}`, N counting up) through the
/// cluster's URL, reconnecting whenever a statement fails.
struct Writer {
    stop: Arc<AtomicBool>,
    written: Arc<Mutex<Written>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    fn start(url: String) -> Writer {
        let stop = Arc::new(AtomicBool::new(false));
        let written = Arc::new(Mutex::new(Written::default()));
        let (stopping, record) = (stop.clone(), written.clone());
        let thread = std::thread::spawn(move || {
            let rt = runtime();
            rt.block_on(async move {
                let settings = leasectl::db::Settings::new(Some(&url)).unwrap();
                let mut client = None;
                let mut n = 0u64;
                while !stopping.load(Ordering::SeqCst) {
                    if client.is_none() {
                        match tokio::time::timeout(Duration::from_secs(5), settings.open_client())
                            .await
                        {
                            Ok(Ok(c)) => client = Some(c),
                            _ => {
                                tokio::time::sleep(Duration::from_millis(100)).await;
                                continue;
                            }
                        }
                    }
                    n += 1;
                    let insert = format!(
                        "INSERT INTO leasectl.outbox (aggregate_type, aggregate_id, type, payload) \
                         VALUES ('writer', '{n}', 'test.written', '{{\"n\": {n}}}')"
                    );
                    let c = client.as_ref().unwrap();
                    let done =
                        tokio::time::timeout(Duration::from_secs(5), c.simple_query(&insert)).await;
                    let committed = matches!(done, Ok(Ok(_)));
                    {
                        let mut w = record.lock().unwrap();
                        if committed {
                            w.committed.push(n);
                        } else {
                            w.uncertain.push(n);
                        }
                    }
                    if !committed {
                        client = None;
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            });
        });
        Writer {
            stop,
            written,
            thread: Some(thread),
        }
    }

    fn committed(&self) -> usize {
        self.written.lock().unwrap().committed.len()
    }

    /// Stops the thread; what it wrote.
    fn finish(mut self) -> Written {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.take().unwrap().join().unwrap();
        std::mem::take(&mut *self.written.lock().unwrap())
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// The `n` of every writer event in the relay's output.
fn relayed(path: &Path) -> std::collections::BTreeSet<u64> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["type"] == "test.written")
        .filter_map(|e| e["payload"]["n"].as_u64())
        .collect()
}

/// One line a holder's command wrote: its fence, the shell's pid and the wall-clock time.
struct Line {
    fence: i64,
    pid: u32,
    at: f64,
}

fn lines(path: &Path) -> Vec<Line> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            assert_eq!(f.len(), 3, "a torn line: {l:?}");
            Line {
                fence: f[0].parse().unwrap(),
                pid: f[1].parse().unwrap(),
                at: f[2].parse().unwrap(),
            }
        })
        .collect()
}

/// Shell code that appends `FENCE PID TIME` to `out` every 100 ms, `forever` until `gate`
/// exists, else five times.
fn ticking(out: &Path, gate: Option<&Path>) -> String {
    let line = format!(
        "echo \"$LEASECTL_FENCE $$ $(date +%s.%N)\" >> '{}'; sleep 0.1",
        out.display()
    );
    match gate {
        Some(g) => format!("while [ ! -e '{}' ]; do {line}; done", g.display()),
        None => format!("for i in 1 2 3 4 5; do {line}; done"),
    }
}

/// The timeline of this server (it must take writes).
fn timeline(node: &Node) -> i64 {
    let hex = node.sql("SELECT left(pg_walfile_name(pg_current_wal_lsn()), 8)");
    i64::from_str_radix(&hex, 16).unwrap()
}

#[test]
fn patroni_switchover_and_failover_keep_one_holder_at_a_time_growing_fences_and_every_event() {
    let mut c = Patroni::start();
    let out = c.leasectl().arg("migrate").output_in_time();
    assert_eq!(code(&out), 0, "{}", stderr(&out));

    let published = c.path("published");
    let mut relay = Watched::new(
        c.leasectl()
            .args(["relay", "--poll", "100ms", "--sink", "stdout"])
            .stdout(std::fs::File::create(&published).unwrap())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let writer = Writer::start(c.url());

    // The first holder runs until the gate opens; the second waits for the lease meanwhile.
    let (ticks, gate) = (c.path("ticks"), c.path("gate"));
    let lease = ["--ttl", LEASE_TTL, "--heartbeat", "1s"];
    let first = Watched::new(
        c.leasectl()
            .args(["run", "--target", "job"])
            .args(lease)
            .args(["--", "sh", "-c", &ticking(&ticks, Some(&gate))])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    c.wait_until("the first holder's command to run", || {
        !lines(&ticks).is_empty()
    });
    let second = Watched::new(
        c.leasectl()
            .args(["-v", "run", "--target", "job", "--wait=100s"])
            .args(lease)
            .args(["--", "sh", "-c", &ticking(&ticks, None)])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    second.wait_for_stderr("waiting for 'job'");
    let committed = writer.committed();
    c.wait_until("the writer to commit on node1", || {
        writer.committed() >= committed + 10
    });

    // Switchover: node1 is shut down cleanly and node2, its synchronous standby, promoted;
    // node1 rejoins as node2's synchronous standby.
    let switched = Instant::now();
    c.switchover(0, 1);
    c.wait_until("node2 to take writes", || c.writable(1));
    eprintln!(
        "switchover: node2 took writes {:?} after the request",
        switched.elapsed()
    );
    c.wait_for_sync(1, 0);
    let committed = writer.committed();
    c.wait_until("the writer to commit on node2", || {
        writer.committed() >= committed + 10
    });

    // doctor, through both hosts, finds node2 with node1 as its synchronous standby.
    let out = c.leasectl().args(["doctor", "--json"]).output_in_time();
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("doctor printed no JSON ({e}): {out:?}"));
    assert_eq!(doctor_check(&doc, "primary").0, "ok", "{doc:#}");
    let (status, detail) = doctor_check(&doc, "replication");
    assert_eq!(status, "ok", "{doc:#}");
    assert!(
        detail.contains("1 streaming standby(s), 1 synchronous"),
        "{detail}"
    );
    assert_eq!(code(&out), 0, "{doc:#}");

    // Failover: node2's host crashes; node1 is promoted once node2's leader key expires.
    let crashed = Instant::now();
    c.crash(1);
    c.wait_until("node1 to take writes after the failover", || {
        c.role("node1").as_deref() == Some("leader") && c.writable(0)
    });
    let failover_time = crashed.elapsed();
    eprintln!("failover: node1 took writes {failover_time:?} after node2's crash");
    let committed = writer.committed();
    c.wait_until("the writer to commit on node1 after the failover", || {
        writer.committed() >= committed + 10
    });

    // The first holder rode both: its heartbeats failed during the failover and recovered.
    first.wait_for_stderr("recovered after");
    assert!(
        first.stderr().contains("heartbeat for 'job' failed"),
        "{}",
        first.stderr()
    );
    std::fs::write(&gate, "").unwrap();
    let out = first.finish();
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let out = second.finish();
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let written = writer.finish();

    // One holder at a time, and fences never go back.
    let ticks = lines(&ticks);
    let mut runs: Vec<(i64, u32, f64, f64)> = Vec::new();
    for l in &ticks {
        match runs.iter_mut().find(|r| r.0 == l.fence && r.1 == l.pid) {
            Some(r) => {
                r.2 = r.2.min(l.at);
                r.3 = r.3.max(l.at);
            }
            None => runs.push((l.fence, l.pid, l.at, l.at)),
        }
    }
    runs.sort_by(|a, b| a.2.total_cmp(&b.2));
    assert_eq!(runs.len(), 2, "one run per holder: {runs:?}");
    for pair in runs.windows(2) {
        let (before, after) = (pair[0], pair[1]);
        assert!(
            before.3 < after.2,
            "two commands overlapped: {before:?} and {after:?}"
        );
        assert!(
            before.0 < after.0,
            "the new holder's fence is not greater: {before:?} then {after:?}"
        );
    }
    let mut by_time: Vec<&Line> = ticks.iter().collect();
    by_time.sort_by(|a, b| a.at.total_cmp(&b.at));
    let mut highest = i64::MIN;
    for l in by_time {
        assert!(l.fence >= highest, "fence {} after {highest}", l.fence);
        highest = l.fence;
    }
    // The first fence is of timeline 1; the second of the timeline the failover started (two
    // promotions later).
    let (first_fence, second_fence) = (runs[0].0, runs[1].0);
    let now = timeline(&c.members[0].node);
    assert!(now >= 3, "two promotions, timeline {now}");
    assert_eq!(first_fence >> 40, 0, "{first_fence}");
    assert_eq!(
        second_fence >> 40,
        now - 1,
        "{second_fence} on timeline {now}"
    );
    assert_eq!(
        c.members[0].node.sql(&format!(
            "SELECT outcome FROM leasectl.runs WHERE target = 'job' AND fence = {first_fence}"
        )),
        "completed",
        "the first run is stored on the last primary under the fence it started with"
    );

    // Every event the writer saw committed was published.
    c.wait_until("the relay to publish every committed event", || {
        let got = relayed(&published);
        written.committed.iter().all(|n| got.contains(n))
    });
    let got = relayed(&published);
    let lost: Vec<u64> = written
        .committed
        .iter()
        .copied()
        .filter(|n| !got.contains(n))
        .collect();
    assert!(
        lost.is_empty(),
        "committed events never published: {lost:?}"
    );
    eprintln!(
        "{} events committed, {} of uncertain fate, {} published",
        written.committed.len(),
        written.uncertain.len(),
        got.len()
    );
    assert!(
        relay.child.try_wait().unwrap().is_none(),
        "the relay exited: {}",
        relay.stderr()
    );
    kill(relay.child.id(), libc::SIGTERM);
    let out = relay.finish();
    assert_eq!(code(&out), 0, "{}", stderr(&out));

    // doctor's failover check, given the failover time measured above: the holders' TTL covers
    // it; a TTL as short as the failover does not.
    let failover = format!("{}s", failover_time.as_secs() + 1);
    let doctor = |ttl: &str| {
        let out = c
            .leasectl()
            .args(["doctor", "--json", "--ttl", ttl, "--heartbeat", "1s"])
            .args(["--failover-time", &failover])
            .output_in_time();
        let doc: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("doctor printed no JSON ({e}): {out:?}"));
        doctor_check(&doc, "failover")
    };
    assert_eq!(doctor(LEASE_TTL).0, "ok");
    assert_eq!(doctor(&failover).0, "warn");
}
