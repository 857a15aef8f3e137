//! The fault-injection ("chaos") suite of issue 7: rounds of contending `leasectl run`s on a
//! fenced register, each with one fault injected — kill -9 of leasectl, of its process group or
//! of its command, SIGSTOP past the TTL, database restarts, stop and freeze, a black-holed or cut
//! connection, broken stdout/stderr pipes — and six invariants (see `faults::Inv`) checked after
//! every round and printed as figures. Any violation prints the round's logs and fails the test.
//!
//! It brings its own PostgreSQL cluster (`cluster.rs`) and a TCP proxy (`proxy.rs`), so it needs
//! nothing from the machine but the PostgreSQL server packages. Settings (environment):
//!
//! * `LEASECTL_CHAOS_ROUNDS` — rounds to run (default 24: two of each fault, about two minutes);
//! * `LEASECTL_CHAOS_FAULTS` — comma-separated subset, e.g. `kill9,restart` (default all);
//! * `LEASECTL_CHAOS_SEED` — random seed (default: from the clock; printed, to replay timings);
//! * `LEASECTL_CHAOS_TTL_MS` — lease TTL (default 1000; heartbeat TTL/5, kill-after 3·TTL/10);
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
mod relay_round;
mod relay_sinks;
mod round;

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use rand::SeedableRng;

use cluster::Cluster;
use db::Db;
use faults::{Fault, Inv, INVARIANTS};
use invariants::TargetState;
use proxy::Proxy;

pub struct Cfg {
    pub rounds: usize,
    pub faults: Vec<Fault>,
    pub seed: u64,
    pub ttl_ms: u64,
    pub heartbeat_ms: u64,
    pub kill_after_ms: u64,
    pub report: Option<PathBuf>,
    pub keep: bool,
    pub bin: PathBuf,
}

impl Cfg {
    fn from_env() -> Cfg {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let num = |k: &str, d: u64| {
            var(k).map_or(d, |v| {
                v.trim()
                    .parse()
                    .unwrap_or_else(|_| panic!("{k}={v}: not a number"))
            })
        };
        let ttl_ms = num("LEASECTL_CHAOS_TTL_MS", 1000);
        Cfg {
            rounds: num("LEASECTL_CHAOS_ROUNDS", 24) as usize,
            faults: Fault::parse_list(&var("LEASECTL_CHAOS_FAULTS").unwrap_or_default())
                .unwrap_or_else(|e| panic!("LEASECTL_CHAOS_FAULTS: {e}")),
            seed: num(
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
            report: var("LEASECTL_CHAOS_REPORT").map(PathBuf::from),
            keep: var("LEASECTL_CHAOS_KEEP").is_some(),
            bin: var("LEASECTL_CHAOS_BIN")
                .map_or(PathBuf::from(env!("CARGO_BIN_EXE_leasectl")), PathBuf::from),
        }
    }

    /// How long a SIGSTOPped supervisor's command may still run after SIGCONT: the time to be
    /// scheduled and send SIGKILL — deliberately shorter than the kill-after grace, since the
    /// deadline has passed and no grace is left.
    pub fn resume_slack(&self) -> f64 {
        (self.ttl_ms as f64 / 5e3).max(0.2)
    }
}

/// Everything a round needs. Field order is drop order: contenders and proxy go before the
/// cluster, the temp dir last.
pub struct Ctx {
    pub cfg: Cfg,
    pub db: Db,
    pub proxy: Proxy,
    pub cluster: Cluster,
    pub rng: rand::rngs::StdRng,
    pub schema: String,
    pub psql: PathBuf,
    pub proxy_conninfo: String,
    pub direct_conninfo: String,
    pub dir: PathBuf,
    pub targets: HashMap<String, TargetState>,
    pub lease_log_mark: i64,
    pub run_log_mark: i64,
    _tmp: tempfile::TempDir,
}

fn in_ci() -> bool {
    matches!(std::env::var("CI").as_deref(), Ok("true") | Ok("1"))
}

fn setup(cfg: Cfg) -> Result<Ctx, String> {
    let cluster = Cluster::start()?;
    let direct = cluster.conninfo();
    let proxy = Proxy::start(([127, 0, 0, 1], cluster.port).into());
    let proxy_conninfo = format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres",
        proxy.port
    );
    let schema = "chaos_l".to_owned();
    let out = std::process::Command::new(&cfg.bin)
        .args(["--database-url", &direct, "--schema", &schema, "migrate"])
        .env_remove("DATABASE_URL")
        .output()
        .map_err(|e| format!("leasectl migrate: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "leasectl migrate: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let mut db = Db::new(&direct);
    db::instrument(&mut db, &schema);
    db.query("INSERT INTO chaos.register VALUES ('t0', 0, 0), ('t1', 0, 0), ('t2', 0, 0)");
    let psql = cluster::find_bin()?.join("psql");
    let tmp = tempfile::Builder::new()
        .prefix("leasectl-chaos.")
        .tempdir()
        .map_err(|e| e.to_string())?;
    Ok(Ctx {
        rng: rand::rngs::StdRng::seed_from_u64(cfg.seed),
        cfg,
        db,
        proxy,
        cluster,
        schema,
        psql,
        proxy_conninfo,
        direct_conninfo: direct,
        dir: tmp.path().to_owned(),
        targets: HashMap::new(),
        lease_log_mark: 0,
        run_log_mark: 0,
        _tmp: tmp,
    })
}

#[derive(Default)]
struct Figures {
    rounds: usize,
    injected: usize,
    violations: BTreeMap<Inv, usize>,
    /// How the first holder's leasectl ended, e.g. "exit 76" → count.
    exits: BTreeMap<String, usize>,
}

/// The round's logs, printed with its violations.
fn dump(ctx: &mut Ctx, o: &round::Outcome) -> String {
    let mut s = String::new();
    for c in &o.contenders {
        let stopped = c.stopped.map_or(String::new(), |(a, b)| {
            format!(", SIGSTOP {a:.3} → SIGCONT {b:.3}")
        });
        let _ = writeln!(
            s,
            "  {} leasectl pid {}: {}{}",
            c.id,
            c.pid,
            c.describe_exit(),
            stopped
        );
        if let Some((t, _)) = c.exit {
            let _ = writeln!(s, "    exited at {t:.3}");
        }
    }
    if let Some((t, hold)) = o.silence {
        let _ = writeln!(s, "  database silent from {t:.3} for {hold:.1}s");
    }
    let log = std::fs::read_to_string(o.dir.join("children.log")).unwrap_or_default();
    let _ = writeln!(
        s,
        "  --- children.log (kind id pid fence [extra] wall-clock) ---"
    );
    for l in log.lines() {
        let _ = writeln!(s, "  {l}");
    }
    for (pid, w) in &o.observed.watches {
        let _ = writeln!(
            s,
            "  watch pid {pid} {} {}: last alive {:.3}",
            w.id, w.kind, w.last_alive
        );
    }
    for c in &o.contenders {
        let err = std::fs::read_to_string(o.dir.join(format!("{}.err", c.id))).unwrap_or_default();
        let _ = writeln!(s, "  --- {} stderr ---", c.id);
        for l in err.lines().take(60) {
            let _ = writeln!(s, "  {l}");
        }
    }
    let rows = ctx.db.query(&format!(
        "SELECT id, fence, token, extract(epoch FROM heartbeat_at), extract(epoch FROM acquired_at)
           FROM chaos.lease_log WHERE target = '{}' ORDER BY id DESC LIMIT 40",
        o.target
    ));
    let _ = writeln!(
        s,
        "  --- lease_log (newest first: id, fence, token, heartbeat_at, acquired_at) ---"
    );
    for r in rows {
        let _ = writeln!(s, "  {r:?}");
    }
    s
}

fn table(cfg: &Cfg, per_fault: &BTreeMap<Fault, Figures>, wall: f64) -> String {
    let mut s = String::new();
    let total_rounds: usize = per_fault.values().map(|f| f.rounds).sum();
    let _ = writeln!(
        s,
        "leasectl chaos: {total_rounds} rounds in {:.0}s (seed {}, TTL {}ms, heartbeat {}ms, kill-after {}ms, {})\n",
        wall, cfg.seed, cfg.ttl_ms, cfg.heartbeat_ms, cfg.kill_after_ms, cfg.bin.display()
    );
    let _ = writeln!(
        s,
        "| fault | rounds | injected | I1 | I2 | I3 | I4 | I5 | I6 | H | first holder's exits |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    let mut tot = Figures::default();
    for (fault, f) in per_fault {
        let cells: Vec<String> = INVARIANTS
            .iter()
            .map(|i| f.violations.get(i).copied().unwrap_or(0).to_string())
            .collect();
        let exits: Vec<String> = f.exits.iter().map(|(k, n)| format!("{k}: {n}")).collect();
        let _ = writeln!(
            s,
            "| {fault} | {} | {} | {} | {} |",
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
    s
}

#[test]
fn chaos() {
    let cfg = Cfg::from_env();
    eprintln!(
        "chaos: {} rounds, faults {}, seed {}",
        cfg.rounds,
        cfg.faults
            .iter()
            .map(|f| f.name())
            .collect::<Vec<_>>()
            .join(","),
        cfg.seed
    );
    let mut ctx = match setup(cfg) {
        Ok(c) => c,
        Err(e) if in_ci() => panic!("chaos suite cannot set up under CI: {e}"),
        Err(e) => {
            eprintln!("\n*** chaos suite SKIPPED: cannot set up (CI is not set): {e} ***\n");
            return;
        }
    };
    let started = Instant::now();
    let mut per_fault: BTreeMap<Fault, Figures> = BTreeMap::new();
    let mut failures = 0usize;
    let mut printed: HashMap<Fault, usize> = HashMap::new();
    for n in 0..ctx.cfg.rounds {
        let fault = ctx.cfg.faults[n % ctx.cfg.faults.len()];
        let outcome = round::run(&mut ctx, n, fault);
        let violations = invariants::check(&mut ctx, &outcome);
        let fig = per_fault.entry(fault).or_default();
        fig.rounds += 1;
        fig.injected += outcome.injected as usize;
        if let Some(a) = outcome.contenders.first() {
            // Rounds whose second contender used --replace are counted apart.
            let how = if outcome.contenders.iter().any(|c| c.replace) {
                format!("{} (replaced)", a.describe_exit())
            } else {
                a.describe_exit()
            };
            *fig.exits.entry(how).or_default() += 1;
        }
        for (inv, _) in &violations {
            *fig.violations.entry(*inv).or_default() += 1;
        }
        let verdict = if violations.is_empty() {
            "ok".to_owned()
        } else {
            format!("{} VIOLATION(S)", violations.len())
        };
        eprintln!(
            "chaos: round {n} {fault} on {}: {} [{}] ({:.0}s elapsed)",
            outcome.target,
            verdict,
            outcome
                .contenders
                .iter()
                .map(|c| format!("{} {}", c.id, c.describe_exit()))
                .collect::<Vec<_>>()
                .join(", "),
            started.elapsed().as_secs_f64()
        );
        if !violations.is_empty() {
            failures += 1;
            for (inv, what) in &violations {
                eprintln!("  {inv}: {what}");
            }
            // The full log of the first few failing rounds of each fault; the rest by line.
            let p = printed.entry(fault).or_default();
            if *p < 3 {
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
    let report = table(&ctx.cfg, &per_fault, started.elapsed().as_secs_f64());
    eprintln!("\n{report}");
    if let Some(path) = &ctx.cfg.report {
        std::fs::write(path, &report).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    }
    if ctx.cfg.keep {
        eprintln!("chaos: round directories kept in {}", ctx.dir.display());
        std::mem::forget(ctx._tmp);
    }
    assert_eq!(
        failures, 0,
        "{failures} round(s) violated an invariant (figures above)"
    );
}
