//! The fault-injection ("chaos") suite: rounds of contending leasectl processes on a fenced
//! register, each round one scenario (`scenario.rs`: plain holders and waiters, `--replace`,
//! `release --force`, steps of an acquired lease, fifo/latest queues, `--slot` on skewed clocks,
//! `--max-holders`) with one fault injected — kill -9 of leasectl, of its process group or of
//! its command, SIGSTOP past the TTL, database restarts, stop and freeze, a black-holed or cut
//! connection, broken stdout/stderr pipes — and the invariants of `faults::Inv` checked after
//! every round and printed as figures. Any violation prints the round's logs and fails the test.
//!
//! It brings its own PostgreSQL cluster (`cluster.rs`) and a TCP proxy (`proxy.rs`), so it needs
//! nothing from the machine but the PostgreSQL server packages (and libfaketime for skewed
//! clocks). [`Bench`] is that set-up, for any kind of round: a test of its own calls
//! [`Bench::start_or_skip`] and migrates a schema of its own. Settings (environment):
//!
//! * `LEASECTL_CHAOS_ROUNDS` — rounds to run (default 24: two of each fault, about three
//!   minutes);
//! * `LEASECTL_CHAOS_FAULTS` — comma-separated subset, e.g. `kill9,restart` (default all);
//! * `LEASECTL_CHAOS_SCENARIOS` — comma-separated subset, e.g. `replace,force` (default all);
//! * `LEASECTL_CHAOS_SEED` — random seed (default: from the clock; printed, to replay a run);
//! * `LEASECTL_CHAOS_TTL_MS` — base lease TTL (default 1000; heartbeat TTL/5, kill-after
//!   3·TTL/10; long-lived holders get 4 × TTL);
//! * `LEASECTL_CHAOS_REPORT` — also write the figures (markdown) to this file;
//! * `LEASECTL_CHAOS_KEEP` — keep the rounds' directories (logs) instead of deleting them;
//! * `LEASECTL_CHAOS_BIN` — test this leasectl binary instead of the one just built (e.g. an
//!   older commit's, to see that the suite finds what was fixed since).
//!
//! Under `CI=true` a set-up failure fails the test; elsewhere it is skipped with a loud notice.

// The harness reports on its own stderr, which the test runner captures or shows; the print
// macros clippy.toml bans for leasectl itself are fine here.
#![allow(clippy::disallowed_macros)]

mod cluster;
mod db;
mod faults;
mod invariants;
mod procs;
mod proxy;
mod relay;
mod relay_faults;
mod relay_invariants;
mod relay_operator;
mod relay_round;
mod relay_sinks;
mod round;
mod scenario;

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use rand::SeedableRng;

use cluster::Cluster;
use db::Db;
use faults::{Fault, Inv, INVARIANTS};
use invariants::TargetState;
use proxy::Proxy;
use scenario::Scenario;

pub struct Cfg {
    pub rounds: usize,
    pub faults: Vec<Fault>,
    pub scenarios: Vec<Scenario>,
    pub seed: u64,
    pub ttl_ms: u64,
    pub heartbeat_ms: u64,
    pub kill_after_ms: u64,
    pub report: Option<PathBuf>,
    pub keep: bool,
    pub bin: PathBuf,
}

/// A setting from the environment; unset or blank is `None`.
pub fn setting(k: &str) -> Option<String> {
    std::env::var(k).ok().filter(|v| !v.trim().is_empty())
}

/// A numeric setting, or `d`; panics (the test fails) on a value that is not a number.
pub fn number(k: &str, d: u64) -> u64 {
    setting(k).map_or(d, |v| {
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{k}={v}: not a number"))
    })
}

/// The binary under test: `LEASECTL_CHAOS_BIN`, else the one cargo just built.
pub fn binary() -> PathBuf {
    setting("LEASECTL_CHAOS_BIN")
        .map_or(PathBuf::from(env!("CARGO_BIN_EXE_leasectl")), PathBuf::from)
}

impl Cfg {
    fn from_env() -> Cfg {
        let ttl_ms = number("LEASECTL_CHAOS_TTL_MS", 1000);
        Cfg {
            rounds: number("LEASECTL_CHAOS_ROUNDS", 24) as usize,
            faults: Fault::parse_list(&setting("LEASECTL_CHAOS_FAULTS").unwrap_or_default())
                .unwrap_or_else(|e| panic!("LEASECTL_CHAOS_FAULTS: {e}")),
            scenarios: Scenario::parse_list(
                &setting("LEASECTL_CHAOS_SCENARIOS").unwrap_or_default(),
            )
            .unwrap_or_else(|e| panic!("LEASECTL_CHAOS_SCENARIOS: {e}")),
            seed: number(
                "LEASECTL_CHAOS_SEED",
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_nanos() as u64
                    % 1_000_000,
            ),
            // 2 heartbeats + kill-after must fit in the TTL (leasectl's own rule): 0.4 + 0.3.
            ttl_ms,
            heartbeat_ms: ttl_ms / 5,
            kill_after_ms: ttl_ms * 3 / 10,
            report: setting("LEASECTL_CHAOS_REPORT").map(PathBuf::from),
            keep: setting("LEASECTL_CHAOS_KEEP").is_some(),
            bin: binary(),
        }
    }

    /// How long a SIGSTOPped supervisor's command may still run after SIGCONT: the time to be
    /// scheduled and send SIGKILL — deliberately shorter than the kill-after grace, since the
    /// deadline has passed and no grace is left.
    pub fn resume_slack(&self) -> f64 {
        (self.ttl_ms as f64 / 5e3).max(0.2)
    }
}

pub fn in_ci() -> bool {
    matches!(std::env::var("CI").as_deref(), Ok("true") | Ok("1"))
}

/// What every kind of chaos round needs: a PostgreSQL cluster of its own, a TCP proxy in front
/// of it that the faults switch, a connection of the checker's (direct, not through the proxy),
/// `psql` for the children, and a temp dir for the rounds' logs. Field order is drop order: the
/// checker and the proxy go before the cluster, the temp dir last.
pub struct Bench {
    pub db: Db,
    pub proxy: Proxy,
    pub cluster: Cluster,
    pub psql: PathBuf,
    /// Through the proxy: what leasectl gets.
    pub proxy_conninfo: String,
    /// Straight to the cluster: what the checker and the children's register writes use.
    pub direct_conninfo: String,
    pub dir: PathBuf,
    tmp: Option<tempfile::TempDir>,
}

impl Bench {
    pub fn start() -> Result<Bench, String> {
        let cluster = Cluster::start()?;
        let direct = cluster.conninfo();
        let proxy = Proxy::start(([127, 0, 0, 1], cluster.port).into());
        let proxy_conninfo = format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            proxy.port
        );
        let psql = cluster::find_bin()?.join("psql");
        let tmp = tempfile::Builder::new()
            .prefix("leasectl-chaos.")
            .tempdir()
            .map_err(|e| e.to_string())?;
        Ok(Bench {
            db: Db::new(&direct),
            proxy,
            cluster,
            psql,
            proxy_conninfo,
            direct_conninfo: direct,
            dir: tmp.path().to_owned(),
            tmp: Some(tmp),
        })
    }

    /// [`Bench::start`], or — outside CI — `None` after a loud notice that the test `what` is
    /// skipped; under CI a set-up failure fails the test.
    pub fn start_or_skip(what: &str) -> Option<Bench> {
        match Bench::start() {
            Ok(b) => Some(b),
            Err(e) if in_ci() => panic!("{what} cannot set up under CI: {e}"),
            Err(e) => {
                eprintln!("\n*** {what} SKIPPED: cannot set up (CI is not set): {e} ***\n");
                None
            }
        }
    }

    /// `leasectl migrate` of `schema`, straight to the cluster.
    pub fn migrate(&self, bin: &Path, schema: &str) -> Result<(), String> {
        let out = std::process::Command::new(bin)
            .args([
                "--database-url",
                &self.direct_conninfo,
                "--schema",
                schema,
                "migrate",
            ])
            .env_remove("DATABASE_URL")
            .output()
            .map_err(|e| format!("leasectl migrate: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "leasectl migrate: {}",
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// Keeps the temp dir (the rounds' logs) after the test.
    pub fn keep(&mut self) {
        if let Some(t) = self.tmp.take() {
            let _ = t.keep();
        }
    }
}

/// What the binary under test accepts (an older build, `LEASECTL_CHAOS_BIN`, may lack a flag
/// of today's contract), and what the machine offers.
pub struct Caps {
    /// `run --token T --wait`: wait for the lease's running step instead of exiting busy.
    pub step_wait: bool,
    /// libfaketime is installed: `--slot` contenders get clocks minutes apart.
    pub faketime: bool,
}

impl Caps {
    fn probe(bin: &Path) -> Caps {
        // Argument errors come before any connection: an unreachable database answers the rest.
        let out = std::process::Command::new(bin)
            .args([
                "--database-url",
                "host=/nonexistent connect_timeout=1",
                "run",
                "--target",
                "probe",
                "--token",
                "00000000-0000-0000-0000-000000000000",
                "--wait=1s",
                "--",
                "true",
            ])
            .env_remove("DATABASE_URL")
            .output()
            .expect("cannot run leasectl");
        Caps {
            step_wait: out.status.code() != Some(2),
            faketime: !round::libfaketime().is_empty(),
        }
    }
}

/// Everything the lease rounds need.
pub struct Ctx {
    pub cfg: Cfg,
    pub bench: Bench,
    pub caps: Caps,
    pub rng: rand::rngs::StdRng,
    pub schema: String,
    pub targets: HashMap<String, TargetState>,
    pub lease_log_mark: i64,
    pub run_log_mark: i64,
    pub waiter_log_mark: i64,
}

fn setup(cfg: Cfg, bench: Bench) -> Result<Ctx, String> {
    let schema = "chaos_l".to_owned();
    bench.migrate(&cfg.bin, &schema)?;
    let mut bench = bench;
    db::instrument(&mut bench.db, &schema);
    let caps = Caps::probe(&cfg.bin);
    if !caps.faketime {
        let msg = "libfaketime is not installed (apt-get install faketime): --slot contenders run on one clock";
        if in_ci() {
            return Err(msg.to_owned());
        }
        eprintln!("chaos: warning: {msg}");
    }
    Ok(Ctx {
        rng: round_rng(cfg.seed, 0),
        cfg,
        bench,
        caps,
        schema,
        targets: HashMap::new(),
        lease_log_mark: 0,
        run_log_mark: 0,
        waiter_log_mark: 0,
    })
}

#[derive(Default)]
struct Figures {
    rounds: usize,
    injected: usize,
    violations: BTreeMap<Inv, usize>,
    /// How the victim's leasectl ended, e.g. "exit 76" → count.
    exits: BTreeMap<String, usize>,
}

impl Figures {
    fn add(&mut self, o: &round::Outcome, violations: &[(Inv, String)]) {
        self.rounds += 1;
        self.injected += o.injected as usize;
        if let Some(v) = o.victim() {
            *self.exits.entry(v.describe_exit()).or_default() += 1;
        }
        // A round counts once per invariant it violated.
        let mut seen: Vec<Inv> = violations.iter().map(|(i, _)| *i).collect();
        seen.dedup();
        for inv in seen {
            *self.violations.entry(inv).or_default() += 1;
        }
    }
}

/// The round's logs, printed with its violations.
fn dump(ctx: &mut Ctx, o: &round::Outcome) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "  scenario {} ({}), fault {} on target {}",
        o.scenario, o.variant, o.fault, o.target
    );
    for c in &o.contenders {
        let stopped = c.stopped.map_or(String::new(), |(a, b)| {
            format!(", SIGSTOP {a:.3} → SIGCONT {b:.3}")
        });
        let killed = c
            .killed
            .map_or(String::new(), |t| format!(", killed at {t:.3}"));
        let _ = writeln!(
            s,
            "  {} leasectl pid {}{}: {}{stopped}{killed}\n    spawned {:.3}{}{}\n    {}",
            c.id,
            c.pid,
            if c.victim { " (victim)" } else { "" },
            c.describe_exit(),
            c.spawned,
            c.exit
                .map_or(String::new(), |(t, _)| format!(", exited {t:.3}")),
            c.ticket
                .map_or(String::new(), |t| format!(", queue ticket {t}")),
            c.args
        );
    }
    if let Some(t) = o.fault_at {
        let _ = writeln!(s, "  fault at {t:.3}");
    }
    if let Some((t, hold)) = o.silence {
        let _ = writeln!(s, "  database silent from {t:.3} for {hold:.1}s");
    }
    let log = std::fs::read_to_string(o.dir.join("children.log")).unwrap_or_default();
    let _ = writeln!(
        s,
        "  --- children.log (kind id pid fence [extra] wall-clock; ticks summarised) ---"
    );
    // Ticks: the first and last of each run of them, not every one.
    let lines: Vec<&str> = log.lines().collect();
    for (i, l) in lines.iter().enumerate() {
        let key = |l: &str| {
            let f: Vec<&str> = l.split_whitespace().take(2).collect();
            (f.first() == Some(&"tick")).then(|| f.get(1).map(|x| x.to_string()))
        };
        let k = key(l);
        let same_before = i > 0 && k.is_some() && key(lines[i - 1]) == k;
        let same_after = i + 1 < lines.len() && k.is_some() && key(lines[i + 1]) == k;
        if same_before && same_after {
            continue;
        }
        let _ = writeln!(s, "  {l}");
    }
    let mut watches: Vec<_> = o.observed.watches.iter().collect();
    watches.sort_by(|a, b| a.1.last_alive.total_cmp(&b.1.last_alive));
    for (pid, w) in watches {
        let _ = writeln!(
            s,
            "  watch pid {pid} {} {}: last alive {:.3}",
            w.id, w.kind, w.last_alive
        );
    }
    for c in &o.contenders {
        let err =
            std::fs::read_to_string(o.dir.join(format!("{}.err", c.role))).unwrap_or_default();
        let _ = writeln!(s, "  --- {} stderr ---", c.id);
        for l in err.lines().take(60) {
            let _ = writeln!(s, "  {l}");
        }
    }
    let rows = ctx.bench.db.query(&format!(
        "SELECT id, place, fence, token, holder_pid, xid, extract(epoch FROM heartbeat_at),
                ttl_ms, extract(epoch FROM at)
           FROM chaos.lease_log WHERE target = '{}' ORDER BY id DESC LIMIT 60",
        o.target
    ));
    let _ = writeln!(
        s,
        "  --- lease_log (newest first: id, place, fence, token, holder pid, xid, heartbeat_at, ttl_ms, at) ---"
    );
    for r in rows {
        let _ = writeln!(s, "  {r:?}");
    }
    let rows = ctx.bench.db.query(&format!(
        "SELECT id, op, ticket, queue, pid, extract(epoch FROM heartbeat_at), ttl_ms, superseded,
                extract(epoch FROM at)
           FROM chaos.waiter_log WHERE target = '{}' ORDER BY id DESC LIMIT 60",
        o.target
    ));
    let _ = writeln!(
        s,
        "  --- waiter_log (newest first: id, op, ticket, queue, pid, heartbeat_at, ttl_ms, superseded, at) ---"
    );
    for r in rows {
        let _ = writeln!(s, "  {r:?}");
    }
    s
}

/// One markdown table of figures, by fault or by scenario.
fn table<K: std::fmt::Display>(s: &mut String, what: &str, rows: &BTreeMap<K, Figures>) {
    let invs: Vec<String> = INVARIANTS.iter().map(|i| i.to_string()).collect();
    let _ = writeln!(
        s,
        "| {what} | rounds | injected | {} | victim's exits |",
        invs.join(" | ")
    );
    let _ = writeln!(s, "|---|---:|---:|{}---|", "---:|".repeat(INVARIANTS.len()));
    let mut tot = Figures::default();
    for (k, f) in rows {
        let cells: Vec<String> = INVARIANTS
            .iter()
            .map(|i| f.violations.get(i).copied().unwrap_or(0).to_string())
            .collect();
        let exits: Vec<String> = f.exits.iter().map(|(k, n)| format!("{k}: {n}")).collect();
        let _ = writeln!(
            s,
            "| {k} | {} | {} | {} | {} |",
            f.rounds,
            f.injected,
            cells.join(" | "),
            exits.join(", ")
        );
        tot.rounds += f.rounds;
        tot.injected += f.injected;
        for (i, n) in &f.violations {
            *tot.violations.entry(*i).or_default() += n;
        }
    }
    let cells: Vec<String> = INVARIANTS
        .iter()
        .map(|i| tot.violations.get(i).copied().unwrap_or(0).to_string())
        .collect();
    let _ = writeln!(
        s,
        "| **total** | {} | {} | {} | |",
        tot.rounds,
        tot.injected,
        cells.join(" | ")
    );
}

fn report(
    cfg: &Cfg,
    by_fault: &BTreeMap<Fault, Figures>,
    by_scenario: &BTreeMap<Scenario, Figures>,
    wall: f64,
) -> String {
    let mut s = String::new();
    let total: usize = by_fault.values().map(|f| f.rounds).sum();
    let _ = writeln!(
        s,
        "leasectl chaos: {total} rounds in {wall:.0}s (seed {}, TTL {}ms, heartbeat {}ms, kill-after {}ms, {})\n",
        cfg.seed, cfg.ttl_ms, cfg.heartbeat_ms, cfg.kill_after_ms, cfg.bin.display()
    );
    table(&mut s, "fault", by_fault);
    s.push('\n');
    table(&mut s, "scenario", by_scenario);
    s.push_str(
        "\n(A round counts once per invariant it violated. Victim: the holder the fault hit.)\n",
    );
    s
}

/// Round `n`'s generator: seeded from the run's seed and `n` alone.
fn round_rng(seed: u64, n: usize) -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(
        seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(n as u64 + 1),
    )
}

#[test]
fn chaos() {
    let cfg = Cfg::from_env();
    eprintln!(
        "chaos: {} rounds, faults {}, scenarios {}, seed {}",
        cfg.rounds,
        cfg.faults
            .iter()
            .map(|f| f.name())
            .collect::<Vec<_>>()
            .join(","),
        cfg.scenarios
            .iter()
            .map(|k| k.name())
            .collect::<Vec<_>>()
            .join(","),
        cfg.seed
    );
    let Some(bench) = Bench::start_or_skip("chaos suite") else {
        return;
    };
    let mut ctx = match setup(cfg, bench) {
        Ok(c) => c,
        Err(e) if in_ci() => panic!("chaos suite cannot set up under CI: {e}"),
        Err(e) => {
            eprintln!("\n*** chaos suite SKIPPED: cannot set up (CI is not set): {e} ***\n");
            return;
        }
    };
    if !ctx.caps.step_wait {
        eprintln!(
            "chaos: this binary has no `run --token --wait`: concurrent steps run without it"
        );
    }
    let started = Instant::now();
    // The plan and every round draw from generators of their own, derived from the seed: a
    // seed replays the same rounds whatever the round count (a longer run extends a shorter).
    let mut planner = rand::rngs::StdRng::seed_from_u64(ctx.cfg.seed);
    let plan = scenario::schedule(&ctx.cfg.scenarios, ctx.cfg.rounds, &mut planner);
    let mut by_fault: BTreeMap<Fault, Figures> = BTreeMap::new();
    let mut by_scenario: BTreeMap<Scenario, Figures> = BTreeMap::new();
    let mut failures = 0usize;
    let mut printed: HashMap<(Fault, Scenario), usize> = HashMap::new();
    for (n, &kind) in plan.iter().enumerate() {
        let fault = ctx.cfg.faults[n % ctx.cfg.faults.len()];
        ctx.rng = round_rng(ctx.cfg.seed, n);
        let mut r = round::Round::new(&mut ctx, n, fault, kind, kind.target(n));
        kind.drive(&mut r);
        let outcome = r.finish();
        let violations = invariants::check(&mut ctx, &outcome);
        by_fault
            .entry(fault)
            .or_default()
            .add(&outcome, &violations);
        by_scenario
            .entry(kind)
            .or_default()
            .add(&outcome, &violations);
        let verdict = if violations.is_empty() {
            "ok".to_owned()
        } else {
            format!("{} VIOLATION(S)", violations.len())
        };
        eprintln!(
            "chaos: round {n} {kind} ({}) × {fault} on {}: {} [{}] ({:.0}s elapsed)",
            outcome.variant,
            outcome.target,
            verdict,
            outcome
                .contenders
                .iter()
                .map(|c| format!("{} {}", c.role, c.describe_exit()))
                .collect::<Vec<_>>()
                .join(", "),
            started.elapsed().as_secs_f64()
        );
        if !violations.is_empty() {
            failures += 1;
            for (inv, what) in &violations {
                eprintln!("  {inv}: {what}");
            }
            // The full log of the first few failing rounds of each pair; the rest by line.
            let p = printed.entry((fault, kind)).or_default();
            if *p < 2 {
                *p += 1;
                eprintln!("{}", dump(&mut ctx, &outcome));
            }
        }
        let dir = outcome.dir.clone();
        drop(outcome);
        if !ctx.cfg.keep && violations.is_empty() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
    let report = report(
        &ctx.cfg,
        &by_fault,
        &by_scenario,
        started.elapsed().as_secs_f64(),
    );
    eprintln!("\n{report}");
    if let Some(path) = &ctx.cfg.report {
        std::fs::write(path, &report).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
    if ctx.cfg.keep {
        eprintln!(
            "chaos: round directories kept in {}",
            ctx.bench.dir.display()
        );
        ctx.bench.keep();
    }
    assert_eq!(
        failures, 0,
        "{failures} round(s) violated an invariant (figures above)"
    );
}
