//! High availability (docs/OPERATIONS.md): a primary and a streaming standby of the
//! test's own, started from the Debian PostgreSQL server binaries in a temporary directory on
//! spare ports; leasectl is given both hosts with `target_session_attrs=read-write`; the primary
//! is stopped (`pg_ctl stop -m immediate`, a crash as far as clients can tell) and the standby
//! promoted. The tests show what OPERATIONS.md says a failover does:
//!
//! * a holder whose heartbeat reaches the new primary within its TTL keeps its lease, its
//!   command never notices, and the run is stored on the new primary under the same fence;
//! * a holder whose heartbeat cannot get through in time stops its command and exits 76, and a
//!   waiter that waited through the outage acquires on the new primary;
//! * with a synchronous standby and `synchronous_commit = remote_apply` (set for the role, as
//!   OPERATIONS.md recommends) no fence handed out before the failover is handed out again;
//! * with asynchronous replication an acquisition the standby never received is lost, yet the
//!   next fence is greater (the promotion's new timeline is in its high bits);
//! * a primary demoted under a running holder and relay (it turns read-only, SQLSTATE 25006 on
//!   every write): both carry on through the new primary.
//!
//! Every wait is on a condition (the servers' answers, files, leasectl's exit); the servers are
//! stopped by [`Cluster`]'s drop, also when a test fails. The binaries missing is a failure, not a
//! skip (scripts/test installs PostgreSQL).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

/// The directory of the server binaries: `LEASECTL_TEST_PG_BIN`, else the newest of Debian's
/// `/usr/lib/postgresql/<version>/bin` (`postgresql-15` on this project's machines).
pub(crate) fn pg_bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("LEASECTL_TEST_PG_BIN") {
        return dir.into();
    }
    let newest = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| Some((e.file_name().to_str()?.parse::<u32>().ok()?, e.path())))
        .filter(|(_, p)| p.join("bin/pg_ctl").exists())
        .max();
    match newest {
        Some((_, dir)) => dir.join("bin"),
        None => panic!(
            "no PostgreSQL server binaries in /usr/lib/postgresql/*/bin: the failover tests need \
             initdb, pg_ctl and pg_basebackup (Debian: apt-get install postgresql; scripts/test \
             installs it), or LEASECTL_TEST_PG_BIN naming their directory"
        ),
    }
}

/// A server binary, or a failure saying how to get it.
pub(crate) fn pg_bin(name: &str) -> PathBuf {
    let path = pg_bin_dir().join(name);
    assert!(
        path.exists(),
        "{} is missing: the failover tests need the PostgreSQL server binaries \
         (Debian: apt-get install postgresql; scripts/test installs it)",
        path.display()
    );
    path
}

/// A server binary run as the `postgres` OS user when the tests run as root (the server refuses
/// to run as root), from `/` (the checkout may be closed to that user).
pub(crate) fn as_postgres(name: &str) -> Command {
    let bin = pg_bin(name);
    let mut c = if nix::unistd::geteuid().is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(bin);
        c
    } else {
        Command::new(bin)
    };
    c.current_dir("/").stdin(Stdio::null());
    c
}

/// Runs `cmd` to completion and panics with its output unless it succeeded.
pub(crate) fn must(cmd: &mut Command) -> Output {
    let out = cmd.output_within(PATIENCE);
    assert!(
        out.status.success(),
        "{cmd:?}: {}{}",
        stdout(&out),
        stderr(&out)
    );
    out
}

/// One PostgreSQL server: its data directory, its port and its log.
pub(crate) struct Node {
    pub(crate) name: &'static str,
    pub(crate) data: PathBuf,
    pub(crate) port: u16,
}

impl Node {
    fn log(&self) -> PathBuf {
        self.data.with_extension("log")
    }

    fn start(&self) {
        must(
            as_postgres("pg_ctl")
                .arg("-D")
                .arg(&self.data)
                .arg("-l")
                .arg(self.log())
                .args(["-w", "-t", "60", "start"]),
        );
    }

    /// Runs SQL as the superuser through psql; the rows, `|`-separated, or the error.
    pub(crate) fn try_sql(&self, sql: &str) -> Result<String, String> {
        let out = Command::new(pg_bin("psql"))
            .args([
                "-XtAq",
                "-v",
                "ON_ERROR_STOP=1",
                "-h",
                "127.0.0.1",
                "-U",
                "postgres",
            ])
            .args(["-p", &self.port.to_string(), "-d", "postgres", "-c", sql])
            .env("PGCONNECT_TIMEOUT", "5")
            .output_within(PATIENCE);
        if out.status.success() {
            Ok(stdout(&out).trim().to_owned())
        } else {
            Err(stderr(&out))
        }
    }

    pub(crate) fn sql(&self, sql: &str) -> String {
        self.try_sql(sql)
            .unwrap_or_else(|e| panic!("{} ({}): {sql}: {e}", self.name, self.port))
    }
}

/// A primary and a streaming standby, stopped (immediately) when dropped.
struct Cluster {
    primary: Node,
    standby: Node,
    dir: tempfile::TempDir,
}

impl Cluster {
    /// Starts a primary and a standby streaming from it; with `synchronous`, the standby is a
    /// synchronous one and the role leasectl uses waits for it to apply every commit
    /// (`ALTER ROLE … SET synchronous_commit = remote_apply`, docs/OPERATIONS.md).
    fn start(synchronous: bool) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        if nix::unistd::geteuid().is_root() {
            let pg = nix::unistd::User::from_name("postgres")
                .unwrap()
                .expect("an OS user named postgres (the Debian package creates it)");
            std::os::unix::fs::chown(dir.path(), Some(pg.uid.as_raw()), Some(pg.gid.as_raw()))
                .unwrap();
        }
        let node = |name| Node {
            name,
            data: dir.path().join(name),
            port: spare_port(),
        };
        let (primary, standby) = (node("primary"), node("standby"));
        let cluster = Cluster {
            primary,
            standby,
            dir,
        };
        let (p, s) = (&cluster.primary, &cluster.standby);
        must(as_postgres("initdb").arg("-D").arg(&p.data).args([
            "-U",
            "postgres",
            "-A",
            "trust",
            "-N",
            "--no-instructions",
        ]));
        // fsync off: the servers are stopped, never the machine, so nothing the OS holds is lost.
        let sync_names = if synchronous { "*" } else { "" };
        append(
            &p.data.join("postgresql.conf"),
            &format!(
                "port = {}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n\
                 fsync = off\nmax_connections = 50\nshared_buffers = 16MB\n\
                 wal_level = replica\nmax_wal_senders = 4\n\
                 synchronous_standby_names = '{sync_names}'\n",
                p.port,
                cluster.dir.path().display()
            ),
        );
        p.start();
        must(as_postgres("pg_basebackup").arg("-D").arg(&s.data).args([
            "-h",
            "127.0.0.1",
            "-p",
            &p.port.to_string(),
            "-U",
            "postgres",
            "-R",
            "-X",
            "stream",
            "-c",
            "fast",
        ]));
        // Promoted, the standby has no standby of its own to wait for.
        append(
            &s.data.join("postgresql.conf"),
            &format!("port = {}\nsynchronous_standby_names = ''\n", s.port),
        );
        s.start();
        let want = if synchronous { "sync" } else { "async" };
        wait_for(&format!("the standby to stream ({want})"), || {
            p.sql("SELECT state || '/' || sync_state FROM pg_stat_replication")
                == format!("streaming/{want}")
        });
        // Only now: until a synchronous standby streams, every commit on the primary waits.
        if synchronous {
            p.sql("ALTER ROLE postgres SET synchronous_commit = 'remote_apply'");
        }
        cluster
    }

    /// Both hosts, the writable one wanted, as a user would list them.
    fn url(&self) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write&connect_timeout=2",
            self.primary.port, self.standby.port
        )
    }

    /// `leasectl` pointed at both hosts through `--database-url`.
    fn leasectl(&self) -> Command {
        let mut c = Command::new(bin());
        c.env_remove("DATABASE_URL")
            .args(["--database-url", &self.url()])
            .current_dir(self.dir.path())
            .stdin(Stdio::null());
        c
    }

    /// `leasectl` pointed at both hosts through libpq's environment:
    /// `PGHOST=h1,h2 PGPORT=p1,p2 PGTARGETSESSIONATTRS=read-write`.
    fn leasectl_by_env(&self) -> Command {
        let mut c = Command::new(bin());
        c.env_remove("DATABASE_URL")
            .env("PGHOST", "127.0.0.1,127.0.0.1")
            .env(
                "PGPORT",
                format!("{},{}", self.primary.port, self.standby.port),
            )
            .env("PGTARGETSESSIONATTRS", "read-write")
            .env("PGCONNECT_TIMEOUT", "2")
            .env("PGUSER", "postgres")
            .env("PGDATABASE", "postgres")
            .current_dir(self.dir.path())
            .stdin(Stdio::null());
        c
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Stops the primary as a crash would look to its clients: every connection dropped, no
    /// checkpoint, no goodbye.
    fn crash_primary(&self) {
        must(
            as_postgres("pg_ctl")
                .arg("-D")
                .arg(&self.primary.data)
                .args(["-m", "immediate", "stop"]),
        );
    }

    /// Promotes the standby and waits until it accepts writes.
    fn promote(&self) {
        must(
            as_postgres("pg_ctl")
                .arg("-D")
                .arg(&self.standby.data)
                .args(["-w", "-t", "60", "promote"]),
        );
        wait_for("the promoted standby to accept writes", || {
            self.standby.sql("SELECT pg_is_in_recovery()") == "f"
        });
    }

    /// One `leasectl run --target TARGET` to completion that prints its fence; the fence.
    fn fence_of_a_run(&self, target: &str) -> i64 {
        let out = self
            .leasectl()
            .args([
                "run",
                "--target",
                target,
                "--",
                "sh",
                "-c",
                "echo $LEASECTL_FENCE",
            ])
            .output_in_time();
        assert_eq!(code(&out), 0, "{}", stderr(&out));
        stdout(&out).trim().parse().unwrap()
    }

    /// Starts a holder of TARGET (with `lease` flags) whose command writes its fence and pid and
    /// then runs until [`Cluster::release`]; returns once the command runs, with its fence and pid.
    fn hold(&self, mut cmd: Command, target: &str, lease: &[&str]) -> (Watched, i64, i32) {
        let (fence, pid, gate) = (self.path("fence"), self.path("pid"), self.path("gate"));
        let script = format!(
            "echo $$ > '{pid}.tmp' && mv '{pid}.tmp' '{pid}'; echo $LEASECTL_FENCE > '{fence}'; \
             while [ ! -e '{gate}' ]; do sleep 0.05; done",
            pid = pid.display(),
            fence = fence.display(),
            gate = gate.display()
        );
        let child = cmd
            .args(["run", "--target", target])
            .args(lease)
            .args(["--", "sh", "-c", &script])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let holder = Watched::new(child);
        let fence = wait_for_file(&fence).parse().unwrap();
        let pid = wait_for_file(&pid).parse().unwrap();
        (holder, fence, pid)
    }

    /// Lets the command started by [`Cluster::hold`] finish.
    fn release(&self) {
        std::fs::write(self.path("gate"), "").unwrap();
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in [&self.standby, &self.primary] {
            if node.data.join("postmaster.pid").exists() {
                let _ = as_postgres("pg_ctl")
                    .arg("-D")
                    .arg(&node.data)
                    .args(["-m", "immediate", "stop"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
        }
    }
}

fn append(path: &Path, text: &str) {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
}

#[test]
fn a_holder_whose_heartbeat_reaches_the_promoted_standby_in_time_keeps_its_lease() {
    let c = Cluster::start(true);
    let before: Vec<i64> = (0..3).map(|_| c.fence_of_a_run("job")).collect();
    let (holder, fence, pid) = c.hold(c.leasectl_by_env(), "job", &["--ttl", "10s"]);
    assert!(before.iter().all(|&f| f < fence), "{before:?} then {fence}");

    c.crash_primary();
    c.promote();

    // The holder's connection died with the primary: a heartbeat failed, and one got through to
    // the new primary, well within the TTL.
    holder.wait_for_stderr("recovered after");
    assert!(
        holder.stderr().contains("heartbeat for 'job' failed"),
        "{}",
        holder.stderr()
    );
    assert!(alive(pid), "the command was stopped: {}", holder.stderr());
    assert_eq!(
        c.standby.sql(
            "SELECT fence FROM leasectl.leases WHERE target = 'job' AND token IS NOT NULL \
               AND heartbeat_at > now() - interval '5 seconds'"
        ),
        fence.to_string(),
        "the new primary has the lease, renewed"
    );

    c.release();
    let out = holder.finish();
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(
        c.standby.sql(&format!(
            "SELECT outcome || ' ' || exit_code FROM leasectl.runs WHERE fence = {fence}"
        )),
        "completed 0",
        "the run is stored on the new primary under the same fence"
    );
    // The promotion started timeline 2: the next fence is the first of its block.
    let after = c.fence_of_a_run("job");
    assert_eq!(
        after,
        (1 << 40) + 1,
        "fences never repeat: {fence} then {after}"
    );
}

#[test]
fn a_holder_cut_off_past_its_ttl_stops_its_command_and_a_waiter_acquires_on_the_new_primary() {
    let c = Cluster::start(true);
    let before: Vec<i64> = (0..3).map(|_| c.fence_of_a_run("job")).collect();
    let (mut holder, fence, pid) = c.hold(c.leasectl(), "job", &["--ttl", "10s"]);
    let cut_off = Instant::now();
    c.crash_primary();

    // A waiter that starts during the outage: no host will take writes yet.
    let mut waiter = Watched::new(
        c.leasectl()
            .args(["run", "--target", "job", "--wait=60s", "--"])
            .args(["sh", "-c", "echo $LEASECTL_FENCE"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );

    // No heartbeat can get through: the holder stops its command and exits 76. The moment the
    // command died (wall clock) is compared below with when the lease could expire.
    let mut died = None;
    let status = loop {
        if died.is_none() && !alive(pid) {
            died = Some(std::time::SystemTime::now());
        }
        if let Some(status) = holder.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            cut_off.elapsed() < PATIENCE,
            "the cut-off holder still runs: {}",
            holder.stderr()
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(status.code(), Some(76), "{}", holder.stderr());
    let died = died
        .or_else(|| (!alive(pid)).then(std::time::SystemTime::now))
        .expect("the command outlived its holder");
    assert!(
        holder.stderr().contains("no heartbeat for 'job' confirmed"),
        "{}",
        holder.stderr()
    );
    assert!(
        waiter.child.try_wait().unwrap().is_none(),
        "the waiter gave up during the outage: {}",
        waiter.stderr()
    );

    // The lease as the standby has it (replicated synchronously), read before the promotion
    // lets the waiter take it: the command died before anyone could take the lease over.
    let expires: f64 = c
        .standby
        .sql(&format!(
            "SELECT extract(epoch FROM heartbeat_at + ttl_ms * interval '1 ms') \
               FROM leasectl.leases WHERE target = 'job' AND fence = {fence}"
        ))
        .parse()
        .unwrap();
    let died = died
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    eprintln!(
        "the command died {:.3}s before its lease could expire; the holder said:\n{}",
        expires - died,
        holder.stderr()
    );
    assert!(
        died < expires,
        "the command died {:.3}s after its lease could expire",
        died - expires
    );

    c.promote();
    let out = waiter.finish();
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let acquired: i64 = stdout(&out).trim().parse().unwrap();
    assert!(
        before.iter().chain([&fence]).all(|&f| f < acquired),
        "fence {acquired} after {before:?} and {fence}: a fence was handed out twice"
    );
    assert_eq!(
        c.standby.sql(&format!(
            "SELECT outcome FROM leasectl.runs WHERE target = 'job' AND fence = {acquired}"
        )),
        "completed"
    );
}

#[test]
fn with_asynchronous_replication_a_fence_after_a_lossy_failover_is_greater_than_every_fence_before()
{
    // The standby stops receiving (as if it lagged), a holder acquires on the primary, and the
    // primary fails: the promoted standby never saw that acquisition. Its counter is one behind,
    // but the promotion started timeline 2, whose fences all lie above timeline 1's.
    let c = Cluster::start(false);
    let replicated = c.fence_of_a_run("job");
    assert_eq!(
        replicated, 1,
        "a server never promoted counts fences from 1"
    );
    let lsn = c.primary.sql("SELECT pg_current_wal_lsn()");
    wait_for("the standby to replay the first run", || {
        c.standby
            .sql(&format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'"))
            == "t"
    });
    must(
        as_postgres("pg_ctl")
            .arg("-D")
            .arg(&c.standby.data)
            .args(["-m", "fast", "-w", "stop"]),
    );
    // A TTL long enough that only the new primary's answer can end this holder.
    let (mut holder, fence, pid) =
        c.hold(c.leasectl(), "job", &["--ttl", "60s", "--heartbeat", "1s"]);
    assert_eq!(fence, replicated + 1);
    c.crash_primary();
    c.standby.start();
    c.promote();
    let timeline = c
        .standby
        .sql("SELECT left(pg_walfile_name(pg_current_wal_lsn()), 8)");
    assert_eq!(timeline, "00000002", "the promotion starts a new timeline");

    // The new primary never saw the acquisition, yet the next caller's fence is greater ...
    let next = c.fence_of_a_run("job");
    assert_eq!(
        next,
        (1 << 40) + 1,
        "the first fence of timeline 2 (the lost fence was {fence})"
    );
    assert!(next > fence);
    // ... it is shown as timeline:counter, and the holder's first heartbeat to get through
    // matches no row: it stops at once.
    let runs = c
        .leasectl()
        .args(["runs", "--target", "job"])
        .output_in_time();
    let listing = stdout(&runs);
    assert!(listing.contains(" 2:1 "), "{listing}");
    let status = exits_within(
        &mut holder.child,
        PATIENCE,
        "the holder of a lost acquisition",
    );
    assert_eq!(status.code(), Some(76), "{}", holder.stderr());
    assert!(
        holder
            .stderr()
            .contains("the lease on 'job' was lost (taken over"),
        "{}",
        holder.stderr()
    );
    assert!(!alive(pid), "the command outlived its lease");
    // doctor names the new timeline and where its fences start.
    let (doc, _) = doctor_at(&c.standby, c.dir.path());
    let (status, detail) = doctor_check(&doc, "fences");
    assert_eq!(status, "ok", "{doc:#}");
    assert!(
        detail.contains("timeline 2: fences from 2:1 on"),
        "{detail}"
    );
    // And on timeline 2 the counter goes on from there.
    assert_eq!(c.fence_of_a_run("job"), (1 << 40) + 2);
    // A new target on timeline 2 starts at the timeline's block — or, with the timeline
    // turned off (for servers that cannot name it), at 1.
    assert_eq!(c.fence_of_a_run("new"), (1 << 40) + 1);
    let out = c
        .leasectl()
        .env("LEASECTL_FENCE_TIMELINE", "off")
        .args([
            "run",
            "--target",
            "other",
            "--",
            "sh",
            "-c",
            "echo $LEASECTL_FENCE",
        ])
        .output_in_time();
    assert_eq!(stdout(&out).trim(), "1", "{}", stderr(&out));
}

#[test]
fn a_primary_demoted_under_a_holder_and_a_relay_is_left_for_the_new_one() {
    // The old primary stays up but turns read-only, as a demoted primary does: connections to
    // it stay open and every write on them fails with SQLSTATE 25006, not a connection error.
    let c = Cluster::start(true);
    c.fence_of_a_run("before");
    let delivered = c.path("delivered");
    let mut relay = Watched::new(
        c.leasectl()
            .args(["-v", "relay", "--poll", "100ms", "--sink"])
            .arg(format!(
                "exec:printf '%s\\n' \"$(cat)\" >> '{}'",
                delivered.display()
            ))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let lines = |path: &Path| {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    wait_for("the relay to publish the first run's event", || {
        lines(&delivered).iter().any(|l| l.contains("\"before\""))
    });
    let (holder, fence, pid) = c.hold(c.leasectl(), "job", &["--ttl", "10s"]);

    c.primary
        .sql("ALTER SYSTEM SET default_transaction_read_only = on");
    c.primary.sql("SELECT pg_reload_conf()");
    c.promote();

    // The holder's heartbeat is refused as read-only; it retries on a fresh connection, which
    // target_session_attrs takes to the new primary, where its lease is (replicated).
    holder.wait_for_stderr("recovered after");
    assert!(
        holder.stderr().contains("read-only transaction"),
        "{}",
        holder.stderr()
    );
    assert!(alive(pid), "the command was stopped: {}", holder.stderr());
    // The relay's claims are refused the same way: it reconnects, and publishes what is
    // committed on the new primary.
    c.fence_of_a_run("after");
    wait_for(
        "the relay to publish the event of a run on the new primary",
        || lines(&delivered).iter().any(|l| l.contains("\"after\"")),
    );
    assert!(
        relay.stderr().contains("read-only transaction"),
        "{}",
        relay.stderr()
    );
    assert!(
        relay.child.try_wait().unwrap().is_none(),
        "the relay exited: {}",
        relay.stderr()
    );

    c.release();
    let out = holder.finish();
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(
        c.standby.sql(&format!(
            "SELECT outcome FROM leasectl.runs WHERE target = 'job' AND fence = {fence}"
        )),
        "completed",
        "the run is stored on the new primary"
    );
    kill(relay.child.id(), libc::SIGTERM);
    let out = relay.finish();
    assert_eq!(code(&out), 0, "{}", stderr(&out));
}

/// `leasectl doctor --json` against one node of the cluster alone; the report.
fn doctor_at(node: &Node, dir: &Path) -> (serde_json::Value, Output) {
    let out = Command::new(bin())
        .env_remove("DATABASE_URL")
        .args([
            "--database-url",
            &format!(
                "postgres://postgres@127.0.0.1:{}/postgres?connect_timeout=5",
                node.port
            ),
            "doctor",
            "--json",
        ])
        .current_dir(dir)
        .output_in_time();
    let doc = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("doctor printed no JSON ({e}): {out:?}"));
    (doc, out)
}

/// The `name` check of a doctor report: its status and its detail with its fix.
pub(crate) fn doctor_check(doc: &serde_json::Value, name: &str) -> (String, String) {
    let c = doc["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no check {name} in {doc:#}"));
    (
        c["status"].as_str().unwrap().to_owned(),
        format!("{} {}", c["detail"], c["fix"]),
    )
}

#[test]
fn doctor_warns_of_an_asynchronous_standby_on_the_primary_and_fails_on_the_standby() {
    let cluster = Cluster::start(false);
    let (doc, out) = doctor_at(&cluster.primary, cluster.dir.path());
    let (status, detail) = doctor_check(&doc, "replication");
    assert_eq!(status, "warn", "{doc:#}");
    assert!(
        detail.contains("1 streaming standby(s), all asynchronous"),
        "{detail}"
    );
    // Fences carry the timeline: what a lossy failover costs is an overlap, not a repeated fence.
    assert!(
        detail.contains("under a greater fence of the new timeline")
            && !detail.contains("same fence"),
        "{detail}"
    );
    assert!(
        detail.contains("ALTER ROLE \\\"postgres\\\" SET synchronous_commit = 'remote_apply'"),
        "{detail}"
    );
    assert_eq!(doctor_check(&doc, "primary").0, "ok");
    assert_eq!(code(&out), 0, "{doc:#}");

    let (doc, out) = doctor_at(&cluster.standby, cluster.dir.path());
    let (status, detail) = doctor_check(&doc, "primary");
    assert_eq!(status, "fail", "{doc:#}");
    assert!(
        detail.contains("target_session_attrs=read-write"),
        "{detail}"
    );
    assert_eq!(code(&out), 1, "{doc:#}");
}
