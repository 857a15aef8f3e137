//! Test harness: a fresh schema per test in a shared test database, and a command builder.
//!
//! Every test calls [`Env::new`], which picks a unique schema name; leasectl creates it on first
//! use (migrations run implicitly) and [`Env`]'s drop removes it, so tests run in parallel and
//! never see each other's rows. The database comes from `LEASECTL_TEST_DATABASE_URL`, else
//! `dbname=leasectl_test` on the local socket as the current user (created when missing).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use leasectl::db::Settings;

/// Generous upper bound for "soon" in a loaded CI machine; tests wait on conditions, so a
/// healthy run never comes near it.
pub const PATIENCE: Duration = Duration::from_secs(60);

pub fn database_url() -> String {
    std::env::var("LEASECTL_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "dbname=leasectl_test".to_owned())
}

thread_local! {
    /// Set by the `via_pooler` copies of tests (see [`via_pooler!`]): every [`Env`] this thread
    /// creates then points leasectl at the pooler.
    static THROUGH_POOLER: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Makes the [`Env`]s of this thread send leasectl through the transaction-mode pgbouncer that
/// scripts/test starts (its address in `LEASECTL_TEST_POOLER`, `host:port`).
pub fn use_pooler() {
    THROUGH_POOLER.with(|p| p.set(true));
}

/// The pooler's `host` and `port`; panics with how to get one, so a missing pooler fails loudly.
pub fn pooler_address() -> (String, String) {
    let addr = std::env::var("LEASECTL_TEST_POOLER").unwrap_or_else(|_| {
        panic!(
            "LEASECTL_TEST_POOLER (host:port of a pgbouncer in transaction mode) is not set: \
             run the suite with scripts/test, which starts one"
        )
    });
    let (host, port) = addr
        .rsplit_once(':')
        .unwrap_or_else(|| panic!("LEASECTL_TEST_POOLER '{addr}' is not host:port"));
    (host.to_owned(), port.to_owned())
}

/// A connection string to the test database through the pooler. `dbname` is a database name
/// of the pooler's: `leasectl_test`, or `leasectl_test_single`, the same database with a pool of
/// one server connection (so consecutive clients surely share it).
pub fn pooler_url(dbname: &str) -> String {
    let (host, port) = pooler_address();
    format!("host={host} port={port} dbname={dbname}")
}

/// Declares, inside a test module, a `via_pooler` module with a copy of each named test that
/// runs it with leasectl connecting through the pooler (the test's own SQL stays direct).
#[macro_export]
macro_rules! via_pooler {
    ($($test:ident),* $(,)?) => {
        mod via_pooler {
            $(
                #[test]
                fn $test() {
                    $crate::common::use_pooler();
                    super::$test();
                }
            )*
        }
    };
}

/// A current-thread runtime with I/O and timers, for a test's own async client work.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Creates the test database once per process when the default URL is used.
fn ensure_database() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        if std::env::var("LEASECTL_TEST_DATABASE_URL").is_ok() {
            return;
        }
        runtime().block_on(async {
            let settings = Settings::new(Some("dbname=postgres")).unwrap();
            let client = settings
                .open_client()
                .await
                .expect("cannot reach PostgreSQL for tests (see docs/guide/testing.md)");
            if let Err(e) = client.batch_execute("CREATE DATABASE leasectl_test").await {
                let code = e.code().map(|c| c.code().to_owned()).unwrap_or_default();
                // 42P04: exists; 23505: a parallel test process created it at the same moment.
                assert!(
                    code == "42P04" || code == "23505",
                    "cannot create the test database: {e}"
                );
            }
        });
    });
}

pub struct Env {
    pub schema: String,
    /// What leasectl connects to: the test database, directly or through the pooler.
    pub url: String,
    /// The test database, always directly: for the test's own SQL and clean-up.
    pub direct_url: String,
    pub dir: tempfile::TempDir,
}

impl Env {
    pub fn new() -> Env {
        ensure_database();
        let schema = format!(
            "t_{}",
            uuid::Uuid::new_v4().simple().to_string().get(..16).unwrap()
        );
        let url = if THROUGH_POOLER.with(|p| p.get()) {
            pooler_url("leasectl_test")
        } else {
            database_url()
        };
        Env {
            schema,
            url,
            direct_url: database_url(),
            dir: tempfile::tempdir().unwrap(),
        }
    }

    /// `leasectl --database-url … --schema …` as a std Command (spawnable, for concurrency).
    pub fn command(&self) -> Command {
        self.command_at(&self.url)
    }

    /// Like [`Env::command`] with another database URL (e.g. one with an application_name).
    pub fn command_at(&self, url: &str) -> Command {
        let mut c = Command::new(bin());
        c.env_remove("DATABASE_URL")
            .arg("--database-url")
            .arg(url)
            .arg("--schema")
            .arg(&self.schema)
            .current_dir(self.dir.path())
            .stdin(Stdio::null());
        c
    }

    /// Runs leasectl with `args` to completion, or kills it after [`PATIENCE`] and panics with
    /// its output so far (see [`OutputInTime`]).
    pub fn run(&self, args: &[&str]) -> Output {
        self.command().args(args).output_in_time()
    }

    /// Spawns leasectl with `args`, output piped.
    pub fn spawn(&self, args: &[&str]) -> std::process::Child {
        self.command()
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Runs SQL in this test's schema (search_path set) and returns every row as text.
    pub fn sql(&self, sql: &str) -> Vec<Vec<Option<String>>> {
        let url = self.direct_url.clone();
        let full = format!("SET search_path = \"{}\"; {sql}", self.schema);
        runtime().block_on(async move {
            let client = Settings::new(Some(&url))
                .unwrap()
                .open_client()
                .await
                .unwrap();
            let msgs = client
                .simple_query(&full)
                .await
                .unwrap_or_else(|e| panic!("{full}: {e:?}"));
            msgs.into_iter()
                .filter_map(|m| match m {
                    tokio_postgres::SimpleQueryMessage::Row(r) => {
                        Some((0..r.len()).map(|i| r.get(i).map(str::to_owned)).collect())
                    }
                    _ => None,
                })
                .collect()
        })
    }

    /// The single value of a one-row, one-column query.
    pub fn scalar(&self, sql: &str) -> String {
        let rows = self.sql(sql);
        assert_eq!(rows.len(), 1, "{sql} returned {} rows", rows.len());
        rows[0][0].clone().unwrap_or_default()
    }

    /// The test database for `tokio_postgres::connect`, which has no libpq defaults: the
    /// server's own socket, port and user spelled out.
    pub fn direct_conninfo(&self) -> String {
        format!(
            "{} host={} port={} user={}",
            self.direct_url,
            self.scalar("SELECT split_part(current_setting('unix_socket_directories'), ',', 1)"),
            self.scalar("SELECT current_setting('port')"),
            self.scalar("SELECT current_user"),
        )
    }

    /// How many leases of this schema are held right now (as text, like [`Env::scalar`]).
    pub fn held_leases(&self) -> String {
        self.scalar("SELECT count(*) FROM leases WHERE token IS NOT NULL")
    }

    /// `leasectl status --json`, parsed.
    pub fn status(&self) -> serde_json::Value {
        let out = self.run(&["status", "--json"]);
        assert!(
            out.status.success(),
            "status failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        let url = self.direct_url.clone();
        let drop = format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.schema);
        runtime().block_on(async move {
            if let Ok(c) = Settings::new(Some(&url)).unwrap().open_client().await {
                let _ = c.batch_execute(&drop).await;
            }
        });
    }
}

/// The leasectl under test: the one this build made, or `LEASECTL_TEST_BIN` (an older build, to
/// see a new test fail against the code before its fix).
pub fn bin() -> PathBuf {
    std::env::var_os("LEASECTL_TEST_BIN").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_leasectl")),
        PathBuf::from,
    )
}

/// Polls `cond` every 20ms until it holds; panics with `what` after [`PATIENCE`].
pub fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < PATIENCE, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for a file to exist and returns its trimmed contents.
pub fn wait_for_file(path: &Path) -> String {
    wait_for(&format!("{}", path.display()), || {
        path.exists() && !std::fs::read_to_string(path).unwrap_or_default().is_empty()
    });
    std::fs::read_to_string(path).unwrap().trim().to_owned()
}

/// Waits for a file to exist.
pub fn wait_for_file_exists(p: &Path) {
    wait_for(&p.display().to_string(), || p.exists());
}

/// True while a process with this pid exists (and is not a zombie).
pub fn alive(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

/// kill(2): `sig` 0 only checks that the process exists, as with the system call.
pub fn kill(pid: u32, sig: i32) {
    let sig =
        (sig != 0).then(|| nix::sys::signal::Signal::try_from(sig).expect("a known signal number"));
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig);
}

/// Waits for a spawned leasectl and returns its output, panicking after [`PATIENCE`].
pub fn finish(mut child: std::process::Child) -> Output {
    if exited_within(&mut child, PATIENCE).is_none() {
        let _ = child.kill();
        panic!(
            "leasectl did not exit in time: {:?}",
            child.wait_with_output().unwrap()
        );
    }
    child.wait_with_output().unwrap()
}

/// The child's exit status once it exits, or `None` if it is still running after `limit`.
pub fn exited_within(
    child: &mut std::process::Child,
    limit: Duration,
) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Waits for `child` to exit within `limit` — shorter than [`PATIENCE`] where a test is about
/// a hang — and returns its status; kills it and panics naming `what` if it does not.
pub fn exits_within(
    child: &mut std::process::Child,
    limit: Duration,
    what: &str,
) -> std::process::ExitStatus {
    exited_within(child, limit).unwrap_or_else(|| {
        let _ = child.kill();
        let _ = child.wait();
        panic!("{what}: leasectl still running after {limit:?}")
    })
}

/// `Command::output` with a deadline, so that a liveness bug (say, `relay --once` that never
/// runs dry) fails its test with what the command printed instead of hanging the suite.
pub trait OutputInTime {
    /// Runs to completion within [`PATIENCE`]; see [`OutputInTime::output_within`].
    fn output_in_time(&mut self) -> Output {
        self.output_within(PATIENCE)
    }

    /// Runs to completion (exit and end of both pipes) within `deadline`, else kills the process
    /// and panics with its stdout and stderr so far. Stdout and stderr are always captured
    /// (stdin is empty): for a command that writes elsewhere, spawn it and use [`finish`].
    fn output_within(&mut self, deadline: Duration) -> Output;
}

impl OutputInTime for Command {
    // Every way out of the loop has waited for the child (or killed and waited); the lint
    // cannot tell, and the remaining exits are panics that end the test anyway.
    #[allow(clippy::zombie_processes)]
    fn output_within(&mut self, deadline: Duration) -> Output {
        use std::io::Read;
        use std::sync::{Arc, Mutex};
        let start = Instant::now();
        // As `Command::output` does: the child's stdin is empty, not the test's.
        let mut child = self
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {self:?}: {e}"));
        let collect = |mut pipe: Box<dyn Read + Send>| {
            let buf = Arc::new(Mutex::new(Vec::new()));
            let sink = buf.clone();
            let reader = std::thread::spawn(move || {
                let mut chunk = [0u8; 8192];
                while let Ok(n) = pipe.read(&mut chunk) {
                    if n == 0 {
                        break;
                    }
                    sink.lock().unwrap().extend_from_slice(&chunk[..n]);
                }
            });
            (buf, reader)
        };
        let (out, out_reader) = collect(Box::new(child.stdout.take().unwrap()));
        let (err, err_reader) = collect(Box::new(child.stderr.take().unwrap()));
        let mut status = None;
        loop {
            if status.is_none() {
                status = child.try_wait().unwrap();
            }
            // A grandchild still holding a pipe keeps it open after the exit: wait for both.
            if status.is_some() && out_reader.is_finished() && err_reader.is_finished() {
                break;
            }
            if start.elapsed() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "{self:?} (pid {}) did not finish within {deadline:?} and was killed\n--- stdout so far ---\n{}\n--- stderr so far ---\n{}",
                    child.id(),
                    String::from_utf8_lossy(&out.lock().unwrap()),
                    String::from_utf8_lossy(&err.lock().unwrap())
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let (stdout, stderr) = (out.lock().unwrap().clone(), err.lock().unwrap().clone());
        Output {
            status: status.unwrap(),
            stdout,
            stderr,
        }
    }
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn code(o: &Output) -> i32 {
    o.status.code().unwrap_or(-1)
}

/// Asserts a failing command printed exactly one line to stderr, naming `needle`, no panic.
pub fn assert_one_line_error(o: &Output, expected_code: i32, needle: &str) {
    let err = stderr(o);
    assert_eq!(code(o), expected_code, "stderr: {err}");
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "expected one line, got: {err:?}"
    );
    assert!(err.contains(needle), "expected {needle:?} in {err:?}");
    assert!(
        !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
        "{err}"
    );
}

/// A spawned leasectl whose stderr is collected by a thread, so a test can wait for a message
/// (e.g. `-v`'s "waiting for …") while the process runs.
pub struct Watched {
    pub child: std::process::Child,
    stderr: std::sync::Arc<std::sync::Mutex<String>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Watched {
    pub fn new(mut child: std::process::Child) -> Watched {
        use std::io::Read;
        let mut pipe = child.stderr.take().expect("stderr must be piped");
        let stderr = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let sink = stderr.clone();
        let reader = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                sink.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Watched {
            child,
            stderr,
            reader: Some(reader),
        }
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    pub fn wait_for_stderr(&self, needle: &str) {
        wait_for(&format!("{needle:?} on stderr"), || {
            self.stderr().contains(needle)
        });
    }

    /// Waits for exit; returns the output with the collected stderr.
    pub fn finish(mut self) -> Output {
        let mut out = finish(std::mem::replace(
            &mut self.child,
            Command::new("true").spawn().unwrap(),
        ));
        if let Some(r) = self.reader.take() {
            r.join().unwrap();
        }
        out.stderr = self.stderr().into_bytes();
        out
    }
}

impl Drop for Watched {
    /// A test that fails before [`Watched::finish`] leaves no leasectl running behind it.
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Env {
    /// Shell code that blocks until [`Env::open_gate`] is called, or this `Env` is dropped (its
    /// directory removed), so that a test that fails leaves no gated command waiting forever.
    pub fn gate(&self) -> String {
        format!(
            "while [ ! -e '{}' ] && [ -d '{}' ]; do sleep 0.02; done",
            self.path("gate").display(),
            self.dir.path().display()
        )
    }

    pub fn open_gate(&self) {
        std::fs::write(self.path("gate"), "").unwrap();
    }

    /// Starts `cmd run --target TARGET EXTRA… -- sh -c SCRIPT`, where the script first marks
    /// that it runs, and returns once it does — that is, once the lease is held.
    pub fn hold_with(
        &self,
        mut cmd: Command,
        target: &str,
        extra: &[&str],
        script: &str,
    ) -> std::process::Child {
        let started = self.path(&format!("started-{target}"));
        let child = cmd
            .args(["run", "--target", target])
            .args(extra)
            .args(["--", "sh", "-c"])
            .arg(format!("touch '{}'; {script}", started.display()))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_for(&format!("the holder of '{target}' to start"), || {
            started.exists()
        });
        child
    }

    /// [`Env::hold_with`] on this test's database: a holder of TARGET running SCRIPT.
    pub fn hold(&self, target: &str, script: &str) -> std::process::Child {
        self.hold_with(self.command(), target, &[], script)
    }

    /// Stops a holder started by [`Env::hold`] with SIGTERM (leasectl forwards it: exit 143).
    pub fn stop(&self, holder: std::process::Child) {
        kill(holder.id(), libc::SIGTERM);
        assert_eq!(code(&finish(holder)), 143);
    }
}

/// A port nothing listens on right now.
pub fn spare_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// SIGCONT for every pid it holds when dropped, so that no test leaves a process stopped.
pub struct Stopped(pub Vec<u32>);

impl Stopped {
    pub fn stop(pids: Vec<u32>) -> Stopped {
        for &pid in &pids {
            kill(pid, libc::SIGSTOP);
        }
        Stopped(pids)
    }

    pub fn resume(&mut self) {
        for pid in self.0.drain(..) {
            kill(pid, libc::SIGCONT);
        }
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        self.resume();
    }
}

/// `line` with its shell variables (`$V`, `${V}`, `${V:-default}`) replaced by what `value`
/// gives for each name and default; a `$` followed by no name stays.
pub fn expand_vars<'a>(
    line: &'a str,
    value: impl Fn(&'a str, Option<&'a str>) -> &'a str,
) -> String {
    let mut out = String::new();
    let mut rest = line;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        rest = &rest[at + 1..];
        let (name, default, len) = if let Some(body) = rest.strip_prefix('{') {
            let close = body.find('}').expect("an unclosed ${");
            let inner = &body[..close];
            match inner.split_once(":-") {
                Some((n, d)) => (n, Some(d), close + 2),
                None => (inner, None, close + 2),
            }
        } else {
            let len = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            if len == 0 {
                out.push('$');
                continue;
            }
            (&rest[..len], None, len)
        };
        out.push_str(value(name, default));
        rest = &rest[len..];
    }
    out.push_str(rest);
    out
}

/// `url` with server options for the session (libpq's `options`), in either URL form.
pub fn with_options(url: &str, options: &str) -> String {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let sep = if url.contains('?') { '&' } else { '?' };
        let encoded = options.replace(' ', "%20").replace('=', "%3D");
        format!("{url}{sep}options={encoded}")
    } else {
        format!("{url} options='{options}'")
    }
}
