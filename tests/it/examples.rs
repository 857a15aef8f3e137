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

// ---- The other examples: every file parsed, every leasectl line run -------------------------

/// Every file under examples/, relative, sorted.
fn example_files() -> Vec<String> {
    fn walk(dir: &std::path::Path, base: &std::path::Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, base, out);
            } else {
                out.push(p.strip_prefix(base).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    let mut out = Vec::new();
    walk(&examples_dir(), &examples_dir(), &mut out);
    out.sort();
    out
}

pub(crate) fn read_example(name: &str) -> String {
    std::fs::read_to_string(examples_dir().join(name)).unwrap()
}

pub(crate) fn yaml(name: &str) -> serde_norway::Value {
    serde_norway::from_str(&read_example(name))
        .unwrap_or_else(|e| panic!("examples/{name} is not YAML: {e}"))
}

/// The `leasectl run …` command in a line of shell, split as the shell would (a trailing `)`
/// of `$(…)` dropped).
fn leasectl_line(line: &str) -> Option<Vec<String>> {
    let at = line.find("leasectl run ")?;
    let rest = line[at..].trim_end().trim_end_matches(')');
    Some(shlex::split(rest).unwrap_or_else(|| panic!("unbalanced quotes: {line}")))
}

/// Every string in a YAML document, depth first.
fn yaml_strings(v: &serde_norway::Value, out: &mut Vec<String>) {
    use serde_norway::Value;
    match v {
        Value::String(s) => out.push(s.clone()),
        Value::Sequence(s) => s.iter().for_each(|v| yaml_strings(v, out)),
        Value::Mapping(m) => m.values().for_each(|v| yaml_strings(v, out)),
        Value::Tagged(t) => yaml_strings(&t.value, out),
        _ => {}
    }
}

/// A systemd unit's `Key=value` lines, comments and sections dropped.
fn unit_settings(name: &str) -> Vec<(String, String)> {
    read_example(name)
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with('#') && !l.starts_with('['))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

fn seconds(d: &str) -> u64 {
    let d = d.trim();
    match d.strip_suffix('s') {
        Some(n) => n.parse().unwrap(),
        None => d.strip_suffix("min").map_or_else(
            || panic!("a duration in s or min: {d:?}"),
            |m| m.parse::<u64>().unwrap() * 60,
        ),
    }
}

/// The value after `flag` in an argv (`--flag value` or `--flag=value`).
fn flag(argv: &[String], name: &str) -> Option<String> {
    let prefix = format!("{name}=");
    argv.iter().enumerate().find_map(|(i, a)| {
        if a == name {
            argv.get(i + 1).cloned()
        } else {
            a.strip_prefix(&prefix).map(str::to_owned)
        }
    })
}

/// Every `leasectl run` command line of every example, by file, after the file's own checks.
fn example_command_lines() -> Vec<(String, Vec<String>)> {
    let mut lines = Vec::new();
    for name in example_files() {
        let found: Vec<Vec<String>> = match name.as_str() {
            "crontab" => {
                let mut found = Vec::new();
                for l in read_example(&name).lines().map(str::trim) {
                    if l.is_empty() || l.starts_with('#') {
                        continue;
                    }
                    if l.split_once('=')
                        .is_some_and(|(k, _)| k.chars().all(|c| c.is_ascii_uppercase() || c == '_'))
                    {
                        continue;
                    }
                    let fields: Vec<&str> = l.split_whitespace().collect();
                    let argv = leasectl_line(l).unwrap_or_else(|| panic!("not leasectl: {l}"));
                    // Both hosts' slots are the cron schedule itself.
                    assert_eq!(
                        flag(&argv, "--slot").as_deref(),
                        Some(fields[..5].join(" ").as_str()),
                        "{l}"
                    );
                    found.push(argv);
                }
                found
            }
            "systemd/nightly.service" => {
                let s = unit_settings(&name);
                let get = |k: &str| {
                    s.iter()
                        .find(|(key, _)| key == k)
                        .map(|(_, v)| v.clone())
                        .unwrap_or_else(|| panic!("{name}: no {k}="))
                };
                let argv = leasectl_line(&get("ExecStart")).unwrap();
                assert!(["mixed", "control-group"].contains(&get("KillMode").as_str()));
                // The stop rule: SIGTERM, SIGKILL after --kill-after, then the save (a 10s
                // statement deadline) must all fit before systemd's own SIGKILL.
                let kill_after = seconds(&flag(&argv, "--kill-after").unwrap());
                assert!(seconds(&get("TimeoutStopSec")) > kill_after + 10);
                vec![argv]
            }
            "systemd/nightly.timer" => {
                let s = unit_settings(&name);
                assert!(s.iter().any(|(k, _)| k == "OnCalendar"), "{name}");
                let text = read_example(&name);
                assert!(text.contains("[Timer]") && text.contains("[Install]"));
                vec![]
            }
            "kubernetes-cronjob.yaml" => {
                let doc = yaml(&name);
                assert_eq!(doc["kind"].as_str(), Some("CronJob"));
                assert_eq!(doc["spec"]["concurrencyPolicy"].as_str(), Some("Allow"));
                let pod = &doc["spec"]["jobTemplate"]["spec"]["template"]["spec"];
                let command: Vec<String> = pod["containers"][0]["command"]
                    .as_sequence()
                    .expect("a container command")
                    .iter()
                    .map(|a| a.as_str().unwrap().to_owned())
                    .collect();
                let kill_after = seconds(&flag(&command, "--kill-after").unwrap());
                assert!(pod["terminationGracePeriodSeconds"].as_u64().unwrap() > kill_after + 10);
                assert_eq!(
                    flag(&command, "--slot").as_deref(),
                    doc["spec"]["schedule"].as_str()
                );
                vec![command]
            }
            // Each job is also run step by step by tests/it/ci_examples.rs; here, every `run`
            // line that stands alone (a `--token` step needs the lease its job acquired).
            "github-actions.yml" | "gitlab-ci.yml" => {
                let doc = yaml(&name);
                let mut strings = Vec::new();
                yaml_strings(&doc, &mut strings);
                strings
                    .iter()
                    .flat_map(|s| s.lines())
                    .filter_map(leasectl_line)
                    .filter(|argv| flag(argv, "--token").is_none())
                    .collect()
            }
            "oauth/refresh-token" => read_example(&name)
                .lines()
                .filter_map(leasectl_line)
                .collect(),
            // Run by the OAuth tests above.
            "oauth/provider.py" => vec![],
            other => panic!("examples/{other} is not exercised by tests/it/examples.rs"),
        };
        let wanted = usize::from(!matches!(
            name.as_str(),
            "systemd/nightly.timer" | "oauth/provider.py"
        ));
        assert!(found.len() >= wanted, "no leasectl line in examples/{name}");
        lines.extend(found.into_iter().map(|argv| (name.clone(), argv)));
    }
    lines
}

/// Every leasectl line of the examples runs as written, with `true` for the job, against the
/// test schema: the flags exist, their values parse and combine.
#[test]
fn every_leasectl_line_in_the_examples_runs_with_a_harmless_command() {
    let lines = example_command_lines();
    assert!(lines.len() >= 8, "{lines:?}");
    for (file, argv) in lines {
        assert_eq!(
            argv[0].rsplit('/').next(),
            Some("leasectl"),
            "{file}: {argv:?}"
        );
        let dashdash = argv
            .iter()
            .position(|a| a == "--")
            .unwrap_or_else(|| panic!("{file}: no `--` before the command: {argv:?}"));
        let env = Env::new();
        let out = env
            .command()
            .args(&argv[1..dashdash])
            .args(["--", "true"])
            .output_in_time();
        assert_eq!(code(&out), 0, "examples/{file}: {argv:?}: {}", stderr(&out));
        assert_eq!(
            env.scalar("SELECT count(*) FROM runs WHERE outcome = 'completed'"),
            "1",
            "examples/{file}: {argv:?}"
        );
    }
}
