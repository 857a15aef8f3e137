//! The files in examples/ run: the OAuth singleflight against a provider that really rotates and
//! revokes tokens (examples/oauth), and every leasectl command line of the other examples.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

fn examples_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples")
}

/// examples/oauth/provider.py on a free port, killed on drop.
struct Provider {
    child: Child,
    port: u16,
}

impl Provider {
    fn start(env: &Env, refresh_token: &str) -> Provider {
        let port_file = env.path("provider-port");
        let child = Command::new("python3")
            .arg(examples_dir().join("oauth/provider.py"))
            .args([
                "--refresh-token",
                refresh_token,
                "--delay",
                "0.2",
                "--port-file",
            ])
            .arg(&port_file)
            .stdin(Stdio::null())
            .spawn()
            .expect("python3 runs examples/oauth/provider.py");
        let port = wait_for_file(&port_file).parse().unwrap();
        Provider { child, port }
    }

    fn token_url(&self) -> String {
        format!("http://127.0.0.1:{}/token", self.port)
    }

    fn get(&self, path: &str) -> serde_json::Value {
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").unwrap();
        let mut reply = String::new();
        s.read_to_string(&mut reply).unwrap();
        let (_, body) = reply.split_once("\r\n\r\n").unwrap();
        serde_json::from_str(body).unwrap()
    }

    /// (refreshes, invalid_grant) so far.
    fn stats(&self) -> (u64, u64) {
        let s = self.get("/stats");
        (
            s["refreshes"].as_u64().unwrap(),
            s["invalid_grant"].as_u64().unwrap(),
        )
    }

    /// Whether `token` is the provider's live access token.
    fn active(&self, token: &str) -> bool {
        self.get(&format!("/introspect?token={token}"))["active"] == true
    }
}

impl Drop for Provider {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The line every caller runs (README: the singleflight section), with a short reuse window so
/// the test can outlive it.
fn caller(env: &Env, provider: &Provider, reuse_within: &str, extra: &[&str]) -> Command {
    let mut c = env.command();
    c.args([
        "run",
        "--target",
        "oauth",
        "--wait=30s",
        "--reuse-within",
        reuse_within,
    ])
    .args(extra)
    .arg("--")
    .arg(examples_dir().join("oauth/refresh-token"))
    .env("OAUTH_TOKEN_URL", provider.token_url())
    .env("OAUTH_STATE_FILE", env.path("refresh-token.state"))
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    c
}

/// Starts `n` callers at once, waits for all, and returns the one access token they all
/// printed, after checking each exited 0; also the round's wall time.
fn round(env: &Env, provider: &Provider, reuse_within: &str, n: usize) -> (String, Duration) {
    let start = Instant::now();
    let children: Vec<_> = (0..n)
        .map(|_| caller(env, provider, reuse_within, &[]).spawn().unwrap())
        .collect();
    let outs: Vec<_> = children.into_iter().map(finish).collect();
    let took = start.elapsed();
    for o in &outs {
        assert_eq!(code(o), 0, "a caller failed: {}", stderr(o));
    }
    let token = stdout(&outs[0]);
    assert!(token.starts_with("at-"), "{token:?}");
    let differing: Vec<_> = outs.iter().map(stdout).filter(|t| *t != token).collect();
    assert!(differing.is_empty(), "{token:?} vs {differing:?}");
    (token.trim().to_owned(), took)
}

/// 100 concurrent callers, three times: the second round within the reuse window, the third
/// after it. One refresh per window, one token per round, and never an invalid_grant.
///
/// Through the transaction-mode pooler (scripts/test starts one): every waiting caller holds a
/// database connection, so 100 direct callers exhaust PostgreSQL's default max_connections of
/// 100 ("sorry, too many clients already") -- the README's singleflight section says so.
#[test]
fn a_hundred_concurrent_callers_three_times_refresh_once_per_window_without_invalid_grant() {
    const CALLERS: usize = 100;
    // Long enough that round 2 surely starts within it on a loaded machine, short enough to
    // wait out.
    const WINDOW: &str = "15s";
    use_pooler();
    let env = Env::new();
    std::fs::write(env.path("refresh-token.state"), "rt-0\n").unwrap();
    let provider = Provider::start(&env, "rt-0");

    let (first, took1) = round(&env, &provider, WINDOW, CALLERS);
    assert_eq!(
        provider.stats(),
        (1, 0),
        "round 1: (refreshes, invalid_grant)"
    );
    assert!(provider.active(&first));

    let (second, took2) = round(&env, &provider, WINDOW, CALLERS);
    assert_eq!(
        second, first,
        "round 2 is within the window: the stored token"
    );
    assert_eq!(
        provider.stats(),
        (1, 0),
        "round 2: (refreshes, invalid_grant)"
    );

    // The window is the behaviour under test: wait until the stored run is older than it.
    let waited = Instant::now();
    wait_for("the stored refresh to age past the reuse window", || {
        env.scalar("SELECT bool_and(finished_at < now() - interval '15s') FROM runs") == "t"
    });
    let waited = waited.elapsed();

    let (third, took3) = round(&env, &provider, WINDOW, CALLERS);
    assert_ne!(third, first, "round 3 is after the window: a new token");
    assert_eq!(
        provider.stats(),
        (2, 0),
        "round 3: (refreshes, invalid_grant)"
    );
    assert!(provider.active(&third));
    assert!(
        !provider.active(&first),
        "the provider revoked the first access token"
    );
    assert_eq!(
        std::fs::read_to_string(env.path("refresh-token.state"))
            .unwrap()
            .trim()
            .split('-')
            .nth(1),
        Some("2"),
        "the state file holds the second rotated refresh token"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM runs WHERE outcome = 'completed'"),
        "2"
    );
    println!(
        "figures: {CALLERS} callers x 3 rounds, 2 refreshes, 0 invalid_grant; \
         round walls {took1:.2?} / {took2:.2?} / {took3:.2?}; waited {waited:.2?} for the window"
    );
}

/// The refreshing holder is SIGKILLed after the provider rotated the refresh token and before
/// leasectl stored the run: no run of any kind is stored (leasectl is gone; the watchdog kills
/// the script), the lease runs out by its TTL, and the waiters refresh with the refresh token
/// the script had already written to its state file: still zero invalid_grant.
#[test]
fn a_refresher_killed_after_the_rotation_leaves_the_rotated_token_in_the_state_file() {
    let env = Env::new();
    let state = env.path("refresh-token.state");
    std::fs::write(&state, "rt-0\n").unwrap();
    let provider = Provider::start(&env, "rt-0");
    let gate = env.path("never-opened");

    let mut holder = caller(&env, &provider, "5m", &["--ttl", "2s"])
        .env("OAUTH_TEST_PAUSE_UNTIL", &gate)
        .spawn()
        .unwrap();
    // The access token streams to the caller as the script prints it; the script then pauses.
    let mut line = String::new();
    BufReader::new(holder.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("at-1-"), "{line:?}");
    assert_eq!(provider.stats(), (1, 0));
    let rotated = std::fs::read_to_string(&state).unwrap();
    assert!(rotated.starts_with("rt-1-"), "{rotated:?}");
    assert_eq!(
        env.scalar("SELECT fence FROM leases WHERE target = 'oauth'"),
        "1"
    );

    // Callers arriving now wait for the holder.
    let waiters: Vec<_> = (0..5)
        .map(|_| Watched::new(caller(&env, &provider, "5m", &["-v"]).spawn().unwrap()))
        .collect();
    for w in &waiters {
        w.wait_for_stderr("waiting for 'oauth'");
    }

    let gate_env = format!("OAUTH_TEST_PAUSE_UNTIL={}", gate.display());
    // leasectl, its watchdog, the script and the script's sleep.
    assert!(pids_with_env(&gate_env).len() >= 3, "the paused script");
    kill(holder.id(), libc::SIGKILL);
    let _ = holder.wait();
    wait_for("the watchdog to kill the paused script", || {
        pids_with_env(&gate_env).is_empty()
    });
    // leasectl could record nothing: no `lost` run, no output to fetch.
    assert_eq!(env.scalar("SELECT count(*) FROM runs"), "0");

    // After the TTL one waiter refreshes with rt-1 from the state file; all share its token.
    let outs: Vec<_> = waiters.into_iter().map(Watched::finish).collect();
    for o in &outs {
        assert_eq!(code(o), 0, "{}", stderr(o));
    }
    let token = stdout(&outs[0]);
    assert!(token.starts_with("at-2-"), "{token:?}");
    assert!(outs.iter().all(|o| stdout(o) == token));
    assert_eq!(provider.stats(), (2, 0), "(refreshes, invalid_grant)");
    assert!(provider.active(token.trim()));
    assert_eq!(
        env.scalar("SELECT string_agg(fence || ':' || outcome, ',' ORDER BY fence) FROM runs"),
        "2:completed"
    );
}

/// Pids of live processes (not zombies) whose environment holds `var` (`NAME=value`).
fn pids_with_env(var: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .map(|e| e.split(|b| *b == 0).any(|v| v == var.as_bytes()))
                .unwrap_or(false)
                && alive(*pid)
        })
        .collect()
}
