//! One relay round (see `relay.rs`): a backlog, writers, 1–3 relays on one sink, one fault at a
//! random moment (or at the moment it is aimed at: mid-batch, in the claim, with a batch claimed
//! ahead), then healing, draining, stopping and a final drain; then what reached the consumer
//! and what the database committed are handed to the invariants.
//!
//! The harness is the relays' supervisor: a service relay that died (kill -9) is started again
//! after a moment, and a `--once` slot starts the next `--once` as soon as one exits. Every
//! process has a bound; one that outlives it is killed and the round says so (invariant B), so a
//! round never hangs. The main thread drives everything through `tick` (poll the processes,
//! enforce bounds, restart slots), which every wait of the round calls.

use std::collections::HashSet;
use std::fs::File;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use rand::{Rng, SeedableRng};
use tokio_postgres::types::Type;

use crate::procs::{self, now};
use crate::relay::{RCtx, RelayBounds};
use crate::relay_faults::{RFault, SinkKind};
use crate::relay_operator::{operator, OperatorSpec, OperatorStats};
use crate::relay_sinks::{Arrival, Consumer};

/// How long the harness waits before starting a killed service relay again (a supervisor's
/// restart delay).
const RESTART_DELAY: f64 = 0.3;
/// Time allowed per event of a backlog on top of a liveness bound: liveness is checked, not
/// throughput (the slowest sink here, `exec:` with a 20 ms command, four at a time, a debug
/// build on a loaded machine, manages well over 50 events a second).
const PER_EVENT: f64 = 0.02;
/// How long a fault may wait for the moment it aims at (a batch in hand, a claim running, a
/// batch claimed ahead) before it strikes anyway.
const AIM_PATIENCE: f64 = 3.0;

/// What a round does, drawn from the round's own seed (so a round is replayed by seed and number).
#[derive(Debug, Clone)]
pub struct Plan {
    pub round: usize,
    pub fault: RFault,
    pub sink: SinkKind,
    /// One entry per relay slot: `true` = a loop of `--once` runs, `false` = a service.
    pub slots: Vec<bool>,
    pub batch: i64,
    pub commit_order: bool,
    pub batch_bytes: Option<&'static str>,
    /// `--timeout`, seconds: short where a black-holed broker should time deliveries out within
    /// the hole; long where a stopped relay's deliveries in flight must not time out when it
    /// resumes (they would, and the relay would publish nothing stale — with the default of 30 s
    /// it does); otherwise long enough that a loaded machine does not time out a delivery that
    /// got through (which would be a copy without a fault).
    pub timeout: u64,
    pub writers: usize,
    /// Milliseconds between a writer's transactions (range).
    pub pace_ms: (u64, u64),
    pub hot: usize,
    pub cold: usize,
    pub backlog: usize,
    /// Probability of a large payload (100–600 kB) per event.
    pub large_p: f64,
    /// Probability that a writer holds its transaction open (0.2–1 s) before ending it.
    pub open_p: f64,
    pub rollback_p: f64,
    pub web_delay_ms: u64,
    pub exec_sleep_ms: u64,
    /// Seconds after the writers start at which the fault is aimed.
    pub fault_delay: f64,
    /// How long the writers write at least.
    pub write_s: f64,
    /// A fault's own choice: restart mode, whether a SIGSTOP also terminates, a hold.
    pub variant: u32,
    pub hold: f64,
    pub seed: u64,
    /// Whether an operator runs `leasectl outbox retry` on live events during the round
    /// ([`crate::relay_operator`]).
    pub operator: bool,
    /// Whether a target is watched (an expectation never due within the round), so that the
    /// relays' health evaluation runs its statements under the fault; otherwise nothing is
    /// watched and the evaluation stops at its lock.
    pub watched: bool,
}

impl Plan {
    pub fn draw(seed: u64, round: usize, fault: RFault, sinks: &[SinkKind]) -> Plan {
        let round_seed = seed ^ (round as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let mut rng = rand::rngs::StdRng::seed_from_u64(round_seed);
        let fits: Vec<SinkKind> = fault
            .sinks()
            .iter()
            .copied()
            .filter(|s| sinks.contains(s))
            .collect();
        let mut sink = fits[rng.random_range(0..fits.len())];
        // A stale batch shows where a stop can fall inside a batch's publication and every copy
        // reaches the consumer: not through NATS (its stream drops copies of an id), stdout (a
        // batch is written in one go at its end) or RabbitMQ (a batch goes out in a few ms).
        // Mostly the others, then.
        let shows = [SinkKind::Exec, SinkKind::Webhook];
        if fault == RFault::SigStop && rng.random_bool(0.75) {
            let f: Vec<SinkKind> = fits.iter().copied().filter(|k| shows.contains(k)).collect();
            if !f.is_empty() {
                sink = f[rng.random_range(0..f.len())];
            }
        }
        let n = match fault {
            // A second relay takes over what the stopped one held.
            RFault::SigStop => rng.random_range(2..=3),
            _ => rng.random_range(1..=3),
        };
        let mut slots: Vec<bool> = (0..n).map(|_| rng.random_bool(0.3)).collect();
        match fault {
            // The stopped relay and the one that takes over are services.
            RFault::SigStop => slots.iter_mut().take(2).for_each(|s| *s = false),
            // A drain that the silence interrupts.
            RFault::DbBlackHole => slots[0] = true,
            RFault::DbFreeze => slots[0] = false,
            _ => {}
        }
        let slow = sink == SinkKind::Exec;
        Plan {
            round,
            fault,
            sink,
            slots,
            batch: if fault == RFault::SigStop {
                [20, 50, 100][rng.random_range(0..3)]
            } else {
                [5, 10, 20, 50, 100][rng.random_range(0..5)]
            },
            // A frozen backend holds the commit horizon back for everyone until it is thawed:
            // commit order cannot be live then (documented), so those rounds use insert order.
            commit_order: fault != RFault::DbFreeze && rng.random_bool(0.3),
            batch_bytes: if rng.random_bool(0.2) {
                Some("1MiB")
            } else {
                None
            },
            timeout: match fault {
                RFault::SigStop => 10,
                RFault::BrokerBlackHole => 2,
                _ => 5,
            },
            writers: if slow { 2 } else { rng.random_range(3..=4) },
            pace_ms: if slow { (10, 30) } else { (1, 8) },
            hot: 3,
            cold: rng.random_range(20..=120),
            backlog: if matches!(fault, RFault::DbBlackHole | RFault::SigStop) {
                rng.random_range(300..=600)
            } else {
                rng.random_range(0..=600)
            },
            large_p: if rng.random_bool(0.5) { 0.003 } else { 0.0 },
            open_p: 0.05,
            rollback_p: 0.12,
            // A stopped relay is caught mid-publication more often when publishing takes a
            // while.
            web_delay_ms: if fault == RFault::SigStop {
                rng.random_range(3..=10)
            } else {
                rng.random_range(0..=8)
            },
            exec_sleep_ms: match fault {
                RFault::DbBlackHole => 20,
                RFault::SigStop => 15,
                _ => [0, 0, 10][rng.random_range(0..3)],
            },
            fault_delay: rng.random_range(0.5..1.4),
            write_s: rng.random_range(2.0..3.0),
            variant: rng.random_range(0..1000),
            hold: rng.random_range(1.0..3.0),
            seed: round_seed,
            // Drawn last, so that a seed still draws the rest of the plan as before.
            operator: rng.random_bool(0.5),
            watched: rng.random_bool(0.5),
        }
    }

    pub fn describe(&self) -> String {
        let slots: Vec<&str> = self
            .slots
            .iter()
            .map(|&o| if o { "once" } else { "service" })
            .collect();
        format!(
            "{} relay(s) [{}] on {}, --batch {} --timeout {}s{}{}, {} writers{}, backlog {}, {} cold aggregates{}{}{}{}",
            self.slots.len(),
            slots.join(", "),
            self.sink,
            self.batch,
            self.timeout,
            if self.commit_order {
                " --order commit"
            } else {
                ""
            },
            self.batch_bytes
                .map_or(String::new(), |b| format!(" --batch-bytes {b}")),
            self.writers,
            if self.operator {
                " and an operator's `outbox retry`"
            } else {
                ""
            },
            self.backlog,
            self.cold,
            if self.large_p > 0.0 {
                ", large payloads"
            } else {
                ""
            },
            if self.watched {
                ", a target watched"
            } else {
                ""
            },
            if self.web_delay_ms > 0 && self.sink == SinkKind::Webhook {
                format!(", webhook answers in {} ms", self.web_delay_ms)
            } else {
                String::new()
            },
            if self.exec_sleep_ms > 0 && self.sink == SinkKind::Exec {
                format!(", exec sleeps {} ms", self.exec_sleep_ms)
            } else {
                String::new()
            },
        )
    }

    pub fn agg(&self, name: &str) -> String {
        format!("r{}-{name}", self.round)
    }
}

/// One relay process.
pub struct Proc {
    pub label: String,
    pub inc: usize,
    pub once: bool,
    pub pid: i32,
    child: Child,
    pub started: f64,
    pub exit: Option<(f64, ExitStatus)>,
    /// The moment by which it must have exited, and why that moment.
    pub bound: f64,
    pub bound_why: String,
    /// Killed by the harness at its bound.
    pub hung: bool,
    /// Killed by the fault (kill -9): its exit is the fault's, not the relay's.
    pub killed: bool,
    /// When the harness sent SIGTERM (services, at the end of the round).
    pub termed: Option<f64>,
    /// SIGSTOP, SIGCONT.
    pub stopped: Option<(f64, f64)>,
    stop_at: Option<f64>,
    pub err: PathBuf,
}

impl Proc {
    pub fn describe_exit(&self) -> String {
        match self.exit {
            None => "running".into(),
            Some((_, s)) => match (s.code(), s.signal()) {
                (Some(c), _) => format!("exit {c}"),
                (_, Some(sig)) => format!("signal {sig}"),
                _ => format!("{s:?}"),
            },
        }
    }

    pub fn name(&self) -> String {
        format!(
            "{}#{} ({}, pid {})",
            self.label,
            self.inc,
            if self.once { "--once" } else { "service" },
            self.pid
        )
    }
}

/// A relay left running by a round that panicked is killed with its process group.
impl Drop for Proc {
    fn drop(&mut self) {
        if self.exit.is_none() {
            procs::signal(-self.pid, libc::SIGCONT);
            procs::signal(-self.pid, libc::SIGKILL);
            let _ = self.child.wait();
        }
    }
}

struct Slot {
    label: String,
    once: bool,
    cur: Option<usize>,
    next_start: Option<f64>,
    run: bool,
    inc: usize,
}

/// An event of a fresh aggregate, inserted while (or once) the round should be live, and how
/// soon it must arrive.
#[derive(Debug, Clone)]
pub struct Probe {
    pub id: String,
    pub agg: String,
    pub at: f64,
    pub bound: f64,
    pub what: String,
    pub arrived: Option<f64>,
}

/// A committed event: `(id, aggregate, seq, xid)`.
#[derive(Debug, Clone)]
pub struct Committed {
    pub id: String,
    pub agg: String,
    pub seq: i64,
    pub xid: i64,
}

#[derive(Debug, Default, Clone, Copy)]
pub struct WriterStats {
    pub committed: u64,
    pub rolled_back: u64,
    pub failed: u64,
    pub events: u64,
}

pub struct Outcome {
    pub plan: Plan,
    /// The fault struck at the moment it aimed at.
    pub hit: bool,
    pub fault_start: f64,
    pub fault_end: f64,
    /// The documented window after a session was ended abruptly (see the O invariant).
    pub excuse: Option<(f64, f64)>,
    pub procs: Vec<Proc>,
    pub probes: Vec<Probe>,
    pub arrivals: Vec<Arrival>,
    pub committed: Vec<Committed>,
    /// Events still in the outbox after the final drain.
    pub left: HashSet<String>,
    /// What the round could not drain once the faults had healed.
    pub undrained: Option<String>,
    pub consumer_broken: Option<String>,
    pub writers: WriterStats,
    /// What the operator did, in a round that has one.
    pub operator: Option<OperatorStats>,
    pub refused: u64,
    pub notes: Vec<String>,
    pub dir: PathBuf,
    pub started: f64,
}

/// The marker (`procs::MARKER`) of a relay of this round, and the prefix of all of them: it
/// names this test process too, so that the cleanup never touches the relays of another run of
/// the suite on the same machine.
fn marker(round: usize, rest: &str) -> String {
    format!("rr{}.{round}-{rest}", std::process::id())
}

struct Backend {
    pid: i32,
    xid: bool,
    claim: bool,
}

struct Round<'a> {
    ctx: &'a mut RCtx,
    plan: Plan,
    bounds: RelayBounds,
    dir: PathBuf,
    consumer: Consumer,
    procs: Vec<Proc>,
    slots: Vec<Slot>,
    probes: Vec<Probe>,
    silent_since: Option<f64>,
    notes: Vec<String>,
    frozen: Vec<i32>,
}

pub fn run(ctx: &mut RCtx, plan: Plan) -> Result<Outcome, String> {
    let dir = ctx.dir.join(format!("relay-round-{:05}", plan.round));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let started = now();
    let left_over = ctx.db.query(&format!(
        "WITH d AS (DELETE FROM \"{}\".outbox RETURNING 1) SELECT count(*) FROM d",
        ctx.schema
    ));
    let mut notes = Vec::new();
    if left_over[0][0].as_deref() != Some("0") {
        notes.push(format!(
            "{} events of earlier rounds were left in the outbox (deleted)",
            left_over[0][0].as_deref().unwrap_or("?")
        ));
    }
    // Unique on the machine: two runs of the suite may share a seed, never a process.
    let tag = format!("{}-{}-{}", ctx.cfg.seed, plan.round, std::process::id());
    let labels: Vec<String> = (0..plan.slots.len())
        .map(|i| format!("s{i}"))
        .chain(["fin".to_owned()])
        .collect();
    let consumer = Consumer::start(
        plan.sink,
        &dir,
        &tag,
        &labels,
        plan.exec_sleep_ms,
        plan.web_delay_ms,
    )?;
    let bounds = ctx.bounds();
    let slots = plan
        .slots
        .iter()
        .enumerate()
        .map(|(i, &once)| Slot {
            label: format!("s{i}"),
            once,
            cur: None,
            next_start: None,
            run: true,
            inc: 0,
        })
        .collect();
    let mut r = Round {
        ctx,
        plan,
        bounds,
        dir,
        consumer,
        procs: Vec::new(),
        slots,
        probes: Vec::new(),
        silent_since: None,
        notes,
        frozen: Vec::new(),
    };
    let result = r.play(started);
    // Whatever happened: nothing of this round may outlive it.
    r.thaw();
    r.ctx.proxy.set_black_hole(false);
    if let Some(p) = &r.consumer.proxy {
        p.set_black_hole(false);
    }
    for p in r.procs.iter_mut().filter(|p| p.exit.is_none()) {
        procs::signal(-p.pid, libc::SIGCONT);
        procs::signal(-p.pid, libc::SIGKILL);
        let _ = p.child.wait();
        p.exit = Some((now(), ExitStatus::from_raw(libc::SIGKILL)));
        p.hung = true;
    }
    let prefix = marker(r.plan.round, "");
    for (pid, _, _) in procs::marked(&prefix) {
        procs::signal(pid, libc::SIGCONT);
        procs::signal(pid, libc::SIGKILL);
    }
    result
}

impl Drop for Round<'_> {
    fn drop(&mut self) {
        self.thaw();
    }
}

impl Round<'_> {
    fn play(&mut self, started: f64) -> Result<Outcome, String> {
        self.prepare();
        for i in 0..self.slots.len() {
            self.slots[i].next_start = Some(now());
        }
        self.tick();
        // The relays connect before the writers start (a debug build takes a moment).
        let t = now() + 5.0;
        let labels: Vec<String> = self.slots.iter().map(|s| s.label.clone()).collect();
        self.wait_until(t, |r| {
            labels
                .iter()
                .all(|l| r.current(l).is_none() || !r.backends(Some(l)).is_empty())
        });
        let stop_writers = Arc::new(AtomicBool::new(false));
        let writers = self.start_writers(&stop_writers);
        let operator = self.plan.operator.then(|| {
            let spec = OperatorSpec {
                bin: self.ctx.cfg.bin.clone(),
                conninfo: self.ctx.direct_conninfo.clone(),
                schema: self.ctx.schema.clone(),
                seed: self.plan.seed.wrapping_add(0x0fe7),
            };
            let stop = stop_writers.clone();
            std::thread::spawn(move || operator(&spec, &stop))
        });
        let t0 = now();
        let fault_at = t0 + self.plan.fault_delay;
        self.wait_until(fault_at, |_| false);
        let (hit, fault_start, fault_end, excuse) = self.inject();
        // Writers go on after the fault, so that what a relay publishes late meets newer events.
        let writers_until = (t0 + self.plan.write_s).max(fault_end + 1.0);
        self.wait_until(writers_until, |_| false);
        stop_writers.store(true, Ordering::SeqCst);
        let mut stats = WriterStats::default();
        for w in writers {
            // A writer may hold a transaction open for up to 1 s, and reconnects after a
            // restart; joining is bounded by that.
            let s = w.join().unwrap_or_default();
            stats.committed += s.committed;
            stats.rolled_back += s.rolled_back;
            stats.failed += s.failed;
            stats.events += s.events;
            self.tick();
        }
        // Its last retry ends within its deadline.
        let operator = operator.map(|o| o.join().unwrap_or_default());
        self.heal();
        // Events of a refused aggregate wait out their backoff: due now.
        self.ctx.db.query(&format!(
            "UPDATE \"{}\".outbox SET next_attempt_at = now() WHERE next_attempt_at > now()",
            self.ctx.schema
        ));
        let committed = self.committed();
        let ids: HashSet<String> = committed.iter().map(|c| c.id.clone()).collect();
        // Liveness, not throughput: a backlog that grew during an outage gets time to drain.
        let pending = self.outbox_count();
        let drain = self.bounds.drain + pending as f64 * PER_EVENT;
        let drained_by = now() + drain;
        let drained = self.wait_until(drained_by, |r| r.all_arrived(&ids) && r.outbox_empty());
        let undrained = (!drained).then(|| {
            let missing = self.consumer.missing(&ids);
            let outbox = self.outbox_count();
            format!(
                "{drain:.0} s after the faults healed ({pending} events pending then), {missing} committed events had not arrived ({outbox} still in the outbox)"
            )
        });
        self.stop_relays();
        self.final_drain();
        // The consumer may lag behind the sink (a broker's queue): wait for the rest.
        let mut last = (self.consumer.count(), now());
        let deadline = now() + 10.0;
        self.wait_until(deadline, |r| {
            let n = r.consumer.count();
            if n != last.0 {
                last = (n, now());
            }
            r.all_arrived(&ids) || now() > last.1 + 2.0
        });
        let left = self.outbox_ids();
        // Read again: what committed since (nothing, normally) counts too.
        let committed = self.committed();
        let arrivals = self.consumer.arrivals();
        for p in self.probes.iter_mut() {
            p.arrived = arrivals.iter().find(|a| a.id == p.id).map(|a| a.t);
        }
        Ok(Outcome {
            plan: self.plan.clone(),
            hit,
            fault_start,
            fault_end,
            excuse,
            procs: std::mem::take(&mut self.procs),
            probes: std::mem::take(&mut self.probes),
            arrivals,
            committed,
            left,
            undrained,
            consumer_broken: self.consumer.broken.lock().unwrap().clone(),
            writers: stats,
            operator,
            refused: self.consumer.refused(),
            notes: std::mem::take(&mut self.notes),
            dir: self.dir.clone(),
            started,
        })
    }

    // -----------------------------------------------------------------------------------------
    // Set-up

    fn prepare(&mut self) {
        let (s, n) = (&self.ctx.schema, self.plan.round);
        let p = &self.plan;
        // Due an hour from now: the evaluation reads everything it reads for a watched target
        // and opens no incident, whose event the ledger would not know.
        self.ctx.db.query(&if p.watched {
            format!(
                "INSERT INTO \"{s}\".expectations (target, every_ms, updated_at)
                 VALUES ('chaos-watched', 3600000, now())
                 ON CONFLICT (target) DO UPDATE SET updated_at = now()"
            )
        } else {
            format!("DELETE FROM \"{s}\".expectations")
        });
        self.ctx.db.query(&format!(
            "INSERT INTO chaos.counters (agg)
             SELECT 'r{n}-h' || g FROM generate_series(0, {}) g
             UNION ALL SELECT 'r{n}-c' || g FROM generate_series(0, {}) g
             ON CONFLICT DO NOTHING",
            p.hot - 1,
            p.cold - 1
        ));
        if p.backlog > 0 {
            let large = if p.large_p > 0.0 {
                "CASE WHEN g % 97 = 13 THEN repeat('x', 100000 + (g * 7919) % 500000) ELSE '' END"
            } else {
                "''"
            };
            // One transaction, in seq order: aggregates interleaved, hot ones most of all.
            self.ctx.db.query(&format!(
                "WITH e AS (
                    INSERT INTO \"{s}\".outbox (aggregate_type, aggregate_id, type, payload)
                    SELECT 'chaos',
                           'r{n}-' || CASE WHEN g % 10 < 6 THEN 'h' || (g % {}) ELSE 'c' || (g % {}) END,
                           'chaos.e', jsonb_build_object('backlog', g, 'pad', {large})
                      FROM generate_series(1, {}) g ORDER BY g
                    RETURNING id, aggregate_id, seq, xid)
                 INSERT INTO chaos.ledger (id, round, agg, seq, xid)
                 SELECT id, {n}, aggregate_id, seq, xid::text::int8 FROM e",
                p.hot, p.cold, p.backlog
            ));
        }
    }

    fn start_writers(&self, stop: &Arc<AtomicBool>) -> Vec<JoinHandle<WriterStats>> {
        (0..self.plan.writers)
            .map(|i| {
                let spec = WriterSpec {
                    idx: i,
                    conninfo: format!(
                        "{} connect_timeout=3 application_name=chaos_writer",
                        self.ctx.direct_conninfo
                    ),
                    schema: self.ctx.schema.clone(),
                    plan: self.plan.clone(),
                    seed: self.plan.seed.wrapping_add(i as u64 + 1),
                };
                let stop = stop.clone();
                std::thread::spawn(move || writer(&spec, &stop))
            })
            .collect()
    }

    // -----------------------------------------------------------------------------------------
    // Relays

    fn app(&self, label: &str) -> String {
        format!("chaos_r{}_{label}", self.plan.round)
    }

    fn spawn_relay(&mut self, label: &str, once: bool, inc: usize, direct: bool) -> usize {
        let base = if direct {
            &self.ctx.direct_conninfo
        } else {
            &self.ctx.proxy_conninfo
        };
        let conninfo = format!(
            "{base} user=chaos_relay connect_timeout={} application_name={}",
            self.bounds.connect_timeout_s,
            self.app(label)
        );
        let err = self.dir.join(format!("{label}-{inc}.err"));
        let mut cmd = Command::new(&self.ctx.cfg.bin);
        for v in [
            "DATABASE_URL",
            "PGHOST",
            "PGPORT",
            "PGUSER",
            "PGDATABASE",
            "PGPASSWORD",
            "PGSERVICE",
        ] {
            cmd.env_remove(v);
        }
        cmd.args([
            "--database-url",
            &conninfo,
            "--schema",
            &self.ctx.schema,
            "-v",
            "relay",
            "--sink",
            &self.consumer.sink_arg(label),
        ])
        .args(["--batch", &self.plan.batch.to_string()])
        .args(["--poll", "500ms", "--max-attempts", "1000"])
        .arg(format!("--timeout={}s", self.plan.timeout))
        .args([
            "--order",
            if self.plan.commit_order {
                "commit"
            } else {
                "insert"
            },
        ]);
        if let Some(b) = self.plan.batch_bytes {
            cmd.args(["--batch-bytes", b]);
        }
        if once {
            cmd.arg("--once");
        }
        cmd.env(
            "LEASECTL_STATEMENT_TIMEOUT",
            format!("{}ms", (self.bounds.deadline * 1e3) as u64),
        )
        // The relay's VACUUM, on a connection of its own beside the claims, every few hundred
        // events (20,000 otherwise): under way during the round's faults.
        .env("LEASECTL_TEST_VACUUM_EVERY", "300")
        .env(
            procs::MARKER,
            marker(self.plan.round, &format!("{label}-{inc}")),
        )
        .current_dir(&self.dir)
        .stdin(Stdio::null())
        .stdout(self.consumer.stdout_for_relay())
        .stderr(File::create(&err).unwrap())
        .process_group(0);
        let child = cmd.spawn().expect("cannot spawn leasectl relay");
        let t = now();
        let (bound, bound_why) = if !once {
            (f64::INFINITY, String::new())
        } else if let Some(s) = self.silent_since {
            (
                t + self.bounds.once_silent,
                format!(
                    "started {:.1} s into a database silence: statement deadline {:.0} s + {:.0} s",
                    t - s,
                    self.bounds.deadline,
                    self.bounds.once_slack
                ),
            )
        } else {
            (
                t + self.bounds.once,
                format!("a --once drain of this size: {:.0} s", self.bounds.once),
            )
        };
        self.procs.push(Proc {
            label: label.to_owned(),
            inc,
            once,
            pid: child.id() as i32,
            child,
            started: t,
            exit: None,
            bound,
            bound_why,
            hung: false,
            killed: false,
            termed: None,
            stopped: None,
            stop_at: None,
            err,
        });
        self.procs.len() - 1
    }

    /// Polls every relay, kills those past their bound, starts slots that are due.
    fn tick(&mut self) {
        let t = now();
        for p in self.procs.iter_mut().filter(|p| p.exit.is_none()) {
            if let Ok(Some(st)) = p.child.try_wait() {
                p.exit = Some((now(), st));
            } else if t > p.bound && p.stop_at.is_none() {
                procs::signal(-p.pid, libc::SIGKILL);
                procs::signal(p.pid, libc::SIGKILL);
                let _ = p.child.wait();
                p.exit = Some((now(), ExitStatus::from_raw(libc::SIGKILL)));
                p.hung = true;
            }
        }
        for i in 0..self.slots.len() {
            if let Some(c) = self.slots[i].cur {
                if self.procs[c].exit.is_some() {
                    self.slots[i].cur = None;
                    if self.slots[i].run {
                        let delay = if self.procs[c].killed || !self.slots[i].once {
                            RESTART_DELAY
                        } else {
                            0.1
                        };
                        self.slots[i].next_start = Some(t + delay);
                    }
                }
            }
            let due = self.slots[i].next_start.is_some_and(|s| s <= t);
            if self.slots[i].cur.is_none() && self.slots[i].run && due {
                let (label, once, inc) = (
                    self.slots[i].label.clone(),
                    self.slots[i].once,
                    self.slots[i].inc,
                );
                let p = self.spawn_relay(&label, once, inc, false);
                self.slots[i].cur = Some(p);
                self.slots[i].inc += 1;
                self.slots[i].next_start = None;
            }
        }
    }

    /// Ticks until `cond` or the deadline; returns whether `cond` held.
    fn wait_until(&mut self, deadline: f64, mut cond: impl FnMut(&mut Self) -> bool) -> bool {
        loop {
            self.tick();
            if cond(self) {
                return true;
            }
            if now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(4));
        }
    }

    fn backends(&mut self, label: Option<&str>) -> Vec<Backend> {
        let filter = match label {
            Some(l) => format!("application_name = '{}'", self.app(l)),
            None => format!(
                "application_name LIKE 'chaos\\_r{}\\_%' AND application_name <> '{}'",
                self.plan.round,
                self.app("fin")
            ),
        };
        self.ctx
            .db
            .query(&format!(
                "SELECT pid, backend_xid IS NOT NULL,
                        state = 'active' AND query LIKE '%WITH win1 AS%'
                   FROM pg_stat_activity WHERE {filter}"
            ))
            .into_iter()
            .map(|r| Backend {
                pid: r[0].as_deref().and_then(|v| v.parse().ok()).unwrap_or(0),
                xid: r[1].as_deref() == Some("t"),
                claim: r[2].as_deref() == Some("t"),
            })
            .collect()
    }

    /// The live process of slot `label`.
    fn current(&self, label: &str) -> Option<usize> {
        self.slots
            .iter()
            .find(|s| s.label == label)
            .and_then(|s| s.cur)
            .filter(|&i| self.procs[i].exit.is_none())
    }

    /// The slot a fault aims at: the first service, else the first slot.
    fn target(&self) -> String {
        self.slots
            .iter()
            .find(|s| !s.once)
            .unwrap_or(&self.slots[0])
            .label
            .clone()
    }

    /// Waits (up to [`AIM_PATIENCE`]) until `label`'s relay is in the state `aim` looks for;
    /// returns whether it was.
    fn aim(&mut self, label: &str, aim: impl Fn(&[Backend]) -> bool) -> bool {
        let t = now() + AIM_PATIENCE;
        let label = label.to_owned();
        self.wait_until(t, |r| {
            r.current(&label).is_some() && {
                let b = r.backends(Some(&label));
                aim(&b)
            }
        })
    }

    fn kill9(&mut self, label: &str) {
        if let Some(i) = self.current(label) {
            self.procs[i].killed = true;
            procs::signal(self.procs[i].pid, libc::SIGKILL);
        }
    }

    // -----------------------------------------------------------------------------------------
    // Faults

    /// Injects the round's fault; returns (hit, start, end, excuse window).
    fn inject(&mut self) -> (bool, f64, f64, Option<(f64, f64)>) {
        let fault = self.plan.fault;
        let target = self.target();
        let mid_batch = |b: &[Backend]| b.iter().any(|b| b.xid);
        let any_mid_batch = |r: &mut Self| r.backends(None).iter().any(|b| b.xid);
        let others_run = self.slots.len() > 1;
        let live = self.bounds.probe_live;
        let healed = self.bounds.probe_healed;
        let hit;
        let start;
        let mut excuse = None;
        match fault {
            RFault::Kill9 | RFault::Kill9Claim | RFault::Kill9Ahead => {
                hit = match fault {
                    RFault::Kill9 => self.aim(&target, mid_batch),
                    RFault::Kill9Claim => self.aim(&target, |b| b.iter().any(|b| b.claim)),
                    _ => self.aim(&target, |b| b.iter().filter(|b| b.xid).count() >= 2),
                };
                start = now();
                self.kill9(&target);
                self.probe(live + RESTART_DELAY, "after a relay was killed");
            }
            RFault::SigStop => {
                // Mid-publication: a batch in hand and deliveries under way (stdout writes a
                // batch at its end, so any moment with a batch in hand is mid-publication).
                hit = if self.plan.sink == SinkKind::Stdout {
                    self.aim(&target, mid_batch)
                } else {
                    let t = now() + AIM_PATIENCE;
                    let label = target.clone();
                    self.wait_until(t, |r| {
                        r.current(&label).is_some()
                            && r.consumer
                                .last_from(&label)
                                .is_some_and(|a| now() - a < 0.03)
                            && r.backends(Some(&label)).iter().any(|b| b.xid)
                    })
                };
                start = now();
                let Some(i) = self.current(&target) else {
                    return (false, start, now(), None);
                };
                let pids: Vec<i32> = self.backends(Some(&target)).iter().map(|b| b.pid).collect();
                procs::signal(-self.procs[i].pid, libc::SIGSTOP);
                self.procs[i].stop_at = Some(start);
                let terminate = self.plan.variant % 2 == 0;
                if others_run {
                    self.probe(live, "while a relay was stopped, by the other relays");
                }
                // Past the server's idle_in_transaction_session_timeout: its session is over.
                let cont_at = start + self.bounds.idle + 1.0 + self.plan.hold / 4.0;
                if terminate {
                    let t = start + 0.3;
                    self.wait_until(t, |_| false);
                    self.terminate(&pids);
                    self.notes
                        .push("the stopped relay's sessions were also terminated".into());
                }
                self.wait_until(cont_at, |_| false);
                let cont = now();
                procs::signal(-self.procs[i].pid, libc::SIGCONT);
                self.procs[i].stop_at = None;
                self.procs[i].stopped = Some((start, cont));
                self.procs[i].bound += cont - start;
                if !others_run {
                    self.probe(live, "after the stopped relay was resumed");
                }
                return (hit, start, cont, None);
            }
            RFault::Terminate => {
                hit = self.aim(&target, mid_batch);
                start = now();
                let pids: Vec<i32> = self.backends(Some(&target)).iter().map(|b| b.pid).collect();
                self.terminate(&pids);
                excuse = Some(self.excuse_from(start));
                self.probe(healed, "after a relay's sessions were terminated");
            }
            RFault::DbCut => {
                hit = self.aim(&target, mid_batch);
                start = now();
                self.ctx.proxy.cut();
                excuse = Some(self.excuse_from(start));
                self.probe(healed, "after the relays' connections were cut");
            }
            RFault::Restart => {
                hit = self.wait_until(now() + AIM_PATIENCE, any_mid_batch);
                start = now();
                let mode = if self.plan.variant % 2 == 0 {
                    "fast"
                } else {
                    "immediate"
                };
                self.notes.push(format!("pg_ctl restart -m {mode}"));
                self.ctx.db.disconnect();
                self.ctx.cluster.restart(mode);
                excuse = Some(self.excuse_from(start));
                self.probe(healed, "after the database restarted");
            }
            RFault::DbBlackHole => {
                // Mid-drain: a --once relay holds a batch.
                let once = self
                    .slots
                    .iter()
                    .find(|s| s.once)
                    .map(|s| s.label.clone())
                    .unwrap_or(target);
                hit = self.aim(&once, mid_batch);
                start = now();
                self.ctx.proxy.set_black_hole(true);
                self.silence_begins(start);
                let waiting: Vec<usize> = self.live(|p| p.once);
                // Until every --once that faced the silence exited (or was killed at its
                // bound); services past their statement deadline.
                let until = start + self.bounds.once_silent + 0.5;
                let services_until = start + self.bounds.deadline + 1.5;
                self.wait_until(until, |r| {
                    now() >= services_until && waiting.iter().all(|&i| r.procs[i].exit.is_some())
                });
                self.ctx.proxy.set_black_hole(false);
                self.silence_ends();
                let end = now();
                self.probe(healed, "after the database path healed");
                return (hit, start, end, None);
            }
            RFault::DbFreeze => {
                self.aim(&target, mid_batch);
                let ahead = self.outbox_count() as f64 * PER_EVENT;
                // Thawed by a deadline whatever this thread is doing: a backend stopped while
                // holding a page lock could block the harness's own statements, from the
                // first look at what the stopped backends do onwards. The deadline allows for
                // the search for a moment at rest and for the probe's bound.
                let longest = self
                    .bounds
                    .once_silent
                    .max(self.bounds.deadline + live + ahead + 1.0);
                let stopped = Arc::new(std::sync::Mutex::new(Vec::new()));
                let (guard, at) = (stopped.clone(), now() + AIM_PATIENCE + longest + 5.0);
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_secs_f64((at - now()).max(0.0)));
                    let pids =
                        std::mem::take(&mut *guard.lock().unwrap_or_else(|e| e.into_inner()));
                    for p in pids {
                        procs::signal(p, libc::SIGCONT);
                    }
                });
                let at_rest = self.freeze_at_rest(&target, &stopped);
                hit = at_rest;
                start = now();
                let what = self.activity(&self.frozen.clone());
                self.notes.push(format!("frozen: {what}"));
                self.notes
                    .push(format!("{} relay backends frozen", self.frozen.len()));
                self.silence_begins(start);
                let waiting: Vec<usize> = self.live(|p| p.once);
                let t = start + 0.2;
                self.wait_until(t, |_| false);
                if at_rest {
                    // New connections still work: the relays must get past their frozen
                    // backends and the row locks those hold.
                    self.probe(
                        self.bounds.deadline + live,
                        "while the relays' backends were frozen",
                    );
                    if self
                        .probes
                        .last()
                        .is_some_and(|p| !self.consumer.has(&p.id))
                    {
                        let others: Vec<i32> = self
                            .backends(None)
                            .iter()
                            .map(|b| b.pid)
                            .filter(|p| !self.frozen.contains(p))
                            .collect();
                        let what = self.activity(&others);
                        self.notes.push(format!(
                            "the probe was late; the relays' other sessions: {what}"
                        ));
                    }
                } else {
                    self.notes.push(
                        "no moment with every backend at rest: stopped mid-statement, where one \
                         may hold a lock every session needs; probed after the thaw"
                            .to_owned(),
                    );
                }
                let until = start + self.bounds.once_silent + 0.5;
                self.wait_until(until, |r| {
                    waiting.iter().all(|&i| r.procs[i].exit.is_some())
                });
                self.thaw();
                self.silence_ends();
                let end = now();
                if !at_rest {
                    self.probe(healed, "after the frozen backends were thawed");
                }
                return (hit, start, end, None);
            }
            RFault::BrokerCut | RFault::BrokerReset | RFault::BrokerBlackHole => {
                hit = self.wait_until(now() + AIM_PATIENCE, any_mid_batch);
                start = now();
                let hold = self.plan.hold;
                if let Some(p) = &self.consumer.proxy {
                    match fault {
                        RFault::BrokerCut => p.cut(),
                        RFault::BrokerReset => p.reset(),
                        _ => p.set_black_hole(true),
                    }
                }
                if fault == RFault::BrokerBlackHole {
                    self.wait_until(start + hold, |_| false);
                    if let Some(p) = &self.consumer.proxy {
                        p.set_black_hole(false);
                    }
                }
                let end = now();
                self.probe(healed, "after the broker path healed");
                return (hit, start, end, None);
            }
            RFault::WebhookRefuse => {
                start = now();
                let bad = self.plan.agg("h0");
                self.consumer.refuse(Some(bad.clone()));
                self.notes.push(format!("the webhook refuses {bad}"));
                let t = start + 0.5;
                self.wait_until(t, |_| false);
                self.probe(live, "while the webhook refused one aggregate");
                // Refused until the writers stop (see heal).
                return (true, start, now(), None);
            }
        }
        (hit, start, now(), excuse)
    }

    /// The documented window after a relay's session ended at an arbitrary moment: what it
    /// publishes until its next round trip (at the latest once the idle timeout, minus a margin,
    /// has passed since its last statement), plus one delivery in flight.
    fn excuse_from(&self, t: f64) -> (f64, f64) {
        (t, t + self.bounds.idle + self.plan.timeout as f64 + 1.0)
    }

    fn terminate(&mut self, pids: &[i32]) {
        if pids.is_empty() {
            return;
        }
        self.ctx.db.query(&format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid IN ({})",
            pid_list(pids)
        ));
    }

    fn live(&self, f: impl Fn(&Proc) -> bool) -> Vec<usize> {
        (0..self.procs.len())
            .filter(|&i| self.procs[i].exit.is_none() && f(&self.procs[i]))
            .collect()
    }

    /// Every `--once` running now must exit within the silence bound from now.
    fn silence_begins(&mut self, t: f64) {
        self.silent_since = Some(t);
        let b = self.bounds.clone();
        for p in self.procs.iter_mut().filter(|p| p.exit.is_none() && p.once) {
            if t + b.once_silent < p.bound {
                p.bound = t + b.once_silent;
                p.bound_why = format!(
                    "the database went silent mid-drain: statement deadline {:.0} s + {:.0} s",
                    b.deadline, b.once_slack
                );
            }
        }
    }

    /// The database answers again: a `--once` still running (one started during the silence,
    /// which may now drain what piled up) is held to the ordinary bound from its start.
    fn silence_ends(&mut self) {
        self.silent_since = None;
        let b = self.bounds.clone();
        for p in self.procs.iter_mut().filter(|p| p.exit.is_none() && p.once) {
            if p.started + b.once > p.bound {
                p.bound = p.started + b.once;
                p.bound_why = format!(
                    "a --once drain of this size once the database answered again: {:.0} s",
                    b.once
                );
            }
        }
    }

    /// Stops every backend of the relays at a moment when the target's is mid-batch and none
    /// is running a statement: each is idle (in its transaction or not), or waits for its
    /// client or for a lock on a row or a table. That is how a real server's session gets
    /// stuck. A backend stopped while it runs a statement may hold one of the server's
    /// internal locks (a page's, the commit log's): every session that needs it then waits
    /// uninterruptibly — no statement timeout ends that wait — so no client, a relay or any
    /// other, can get past it until the backend runs again. Tries for up to [`AIM_PATIENCE`]
    /// (stopping, looking, resuming); returns whether it found such a moment. If not, the
    /// backends stay stopped where the last try caught them.
    ///
    /// `stopped` always holds the backends stopped now, for the caller's watchdog to thaw.
    fn freeze_at_rest(&mut self, target: &str, stopped: &std::sync::Mutex<Vec<i32>>) -> bool {
        let until = now() + AIM_PATIENCE;
        let app = self.app(target);
        loop {
            self.frozen = self.backends(None).iter().map(|b| b.pid).collect();
            *stopped.lock().unwrap_or_else(|e| e.into_inner()) = self.frozen.clone();
            for &p in &self.frozen {
                procs::signal(p, libc::SIGSTOP);
            }
            let rows = self.ctx.db.query(&format!(
                "SELECT coalesce(bool_and(state LIKE 'idle%'
                                          OR wait_event_type IN ('Client', 'Lock')), false),
                        coalesce(bool_or(backend_xid IS NOT NULL AND application_name = '{app}'),
                                 false)
                   FROM pg_stat_activity WHERE pid IN ({})",
                pid_list(&self.frozen)
            ));
            let at_rest = rows
                .first()
                .is_some_and(|r| r[0].as_deref() == Some("t") && r[1].as_deref() == Some("t"));
            if at_rest || now() >= until {
                return at_rest;
            }
            self.thaw();
            let t = now() + 0.003;
            self.wait_until(t, |_| false);
        }
    }

    /// What the backends `pids` are doing, as pg_stat_activity and pg_locks tell it: state,
    /// wait event, the locks they wait for and the start of their statement.
    fn activity(&mut self, pids: &[i32]) -> String {
        if pids.is_empty() {
            return "none".to_owned();
        }
        let rows = self.ctx.db.query(&format!(
            "SELECT a.pid, a.state, coalesce(a.wait_event_type || '/' || a.wait_event, '-'),
                    coalesce((SELECT string_agg(l.locktype || ' ' || l.mode, ', ')
                                FROM pg_locks l WHERE l.pid = a.pid AND NOT l.granted), '-'),
                    array_to_string(pg_blocking_pids(a.pid), ','),
                    regexp_replace(left(a.query, 50), '[[:space:]]+', ' ', 'g')
               FROM pg_stat_activity a WHERE a.pid IN ({})",
            pid_list(pids)
        ));
        let each: Vec<String> = rows
            .iter()
            .map(|r| {
                let f = |i: usize| r[i].clone().unwrap_or_default();
                format!(
                    "{} {} waiting {} (locks {}; blocked by [{}]) on {:?}",
                    f(0),
                    f(1),
                    f(2),
                    f(3),
                    f(4),
                    f(5)
                )
            })
            .collect();
        each.join("; ")
    }

    fn thaw(&mut self) {
        for p in self.frozen.drain(..) {
            procs::signal(p, libc::SIGCONT);
        }
    }

    /// Inserts an event of a fresh aggregate and waits (up to `bound`) for it to arrive.
    fn probe(&mut self, bound: f64, what: &str) {
        let k = self.probes.len();
        let agg = self.plan.agg(&format!("p{k}"));
        let rows = self.ctx.db.query(&format!(
            "WITH e AS (
                INSERT INTO \"{}\".outbox (aggregate_type, aggregate_id, type, payload)
                VALUES ('chaos', '{agg}', 'chaos.e', '{{\"probe\": {k}}}')
                RETURNING id, seq, xid)
             INSERT INTO chaos.ledger (id, round, agg, seq, xid)
             SELECT id, {}, '{agg}', seq, xid::text::int8 FROM e RETURNING id",
            self.ctx.schema, self.plan.round
        ));
        let id = rows.first().and_then(|r| r[0].clone()).unwrap_or_default();
        let at = now();
        // What is ahead of it in the outbox goes first (in order, a relay claims the oldest
        // events): the bound allows for that backlog, at PER_EVENT a piece.
        let ahead = self.outbox_count().saturating_sub(1);
        let bound = bound + ahead as f64 * PER_EVENT;
        let deadline = at + bound;
        self.wait_until(deadline, |r| r.consumer.has(&id));
        self.probes.push(Probe {
            id,
            agg,
            at,
            bound,
            what: what.to_owned(),
            arrived: None,
        });
    }

    // -----------------------------------------------------------------------------------------
    // The end of the round

    fn heal(&mut self) {
        self.thaw();
        self.ctx.proxy.set_black_hole(false);
        if let Some(p) = &self.consumer.proxy {
            p.set_black_hole(false);
        }
        self.consumer.refuse(None);
        for p in self.procs.iter_mut().filter(|p| p.exit.is_none()) {
            if let Some(s) = p.stop_at.take() {
                procs::signal(-p.pid, libc::SIGCONT);
                p.stopped = Some((s, now()));
            }
        }
    }

    fn stop_relays(&mut self) {
        for s in self.slots.iter_mut() {
            s.run = false;
        }
        let t = now();
        let stop = self.bounds.stop;
        for p in self.procs.iter_mut().filter(|p| p.exit.is_none()) {
            if !p.once {
                procs::signal(p.pid, libc::SIGTERM);
                p.termed = Some(t);
                p.bound = t + stop;
                p.bound_why = format!("SIGTERM: finish the batch in hand and exit, {stop:.0} s");
            }
        }
        let deadline = self
            .procs
            .iter()
            .filter(|p| p.exit.is_none())
            .map(|p| p.bound)
            .fold(t, f64::max)
            + 1.0;
        self.wait_until(deadline, |r| r.procs.iter().all(|p| p.exit.is_some()));
    }

    /// A fresh `--once` on a direct connection, passes until the outbox is empty (at most 3).
    fn final_drain(&mut self) {
        for pass in 0..3 {
            if self.outbox_empty() {
                return;
            }
            let i = self.spawn_relay("fin", true, pass, true);
            let bound = self.procs[i].bound + 1.0;
            self.wait_until(bound, |r| r.procs[i].exit.is_some());
        }
    }

    fn outbox_empty(&mut self) -> bool {
        self.ctx.db.query(&format!(
            "SELECT NOT EXISTS (SELECT 1 FROM \"{}\".outbox)",
            self.ctx.schema
        ))[0][0]
            .as_deref()
            == Some("t")
    }

    fn outbox_count(&mut self) -> usize {
        self.ctx.db.query(&format!(
            "SELECT count(*) FROM \"{}\".outbox",
            self.ctx.schema
        ))[0][0]
            .as_deref()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    fn outbox_ids(&mut self) -> HashSet<String> {
        self.ctx
            .db
            .query(&format!("SELECT id FROM \"{}\".outbox", self.ctx.schema))
            .into_iter()
            .filter_map(|r| r[0].clone())
            .collect()
    }

    fn all_arrived(&self, ids: &HashSet<String>) -> bool {
        self.consumer.missing(ids) == 0
    }

    fn committed(&mut self) -> Vec<Committed> {
        self.ctx
            .db
            .query(&format!(
                "SELECT id, agg, seq, xid FROM chaos.ledger WHERE round = {} ORDER BY seq",
                self.plan.round
            ))
            .into_iter()
            .map(|r| Committed {
                id: r[0].clone().unwrap_or_default(),
                agg: r[1].clone().unwrap_or_default(),
                seq: r[2].as_deref().and_then(|v| v.parse().ok()).unwrap_or(0),
                xid: r[3].as_deref().and_then(|v| v.parse().ok()).unwrap_or(0),
            })
            .collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Writers: applications inserting events in their own transactions.

struct WriterSpec {
    idx: usize,
    conninfo: String,
    schema: String,
    plan: Plan,
    seed: u64,
}

/// Writes until `stop`: transactions of 1–4 events on hot and cold aggregates, some held open,
/// some rolled back, a few with large payloads. Each event is recorded in `chaos.ledger` in its
/// own transaction, so the ledger says exactly what committed, whatever happens to the
/// connection. In insert order the transactions writing one aggregate are serialised (a lock on
/// its counter row, taken in a fixed order), as the outbox's contract asks of applications; in
/// commit order they are not.
fn writer(spec: &WriterSpec, stop: &AtomicBool) -> WriterStats {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(spec.seed);
    let mut stats = WriterStats::default();
    let p = &spec.plan;
    let insert = format!(
        "WITH e AS (
            INSERT INTO \"{}\".outbox (aggregate_type, aggregate_id, type, payload)
            VALUES ('chaos', $1, 'chaos.e', $2::text::jsonb) RETURNING id, seq, xid)
         INSERT INTO chaos.ledger (id, round, agg, seq, xid)
         SELECT id, $3, $1, seq, xid::text::int8 FROM e",
        spec.schema
    );
    let mut client: Option<tokio_postgres::Client> = None;
    let mut txn = 0u64;
    while !stop.load(Ordering::SeqCst) {
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            match rt.block_on(tokio_postgres::connect(
                &spec.conninfo,
                tokio_postgres::NoTls,
            )) {
                Ok((c, conn)) => {
                    rt.spawn(conn);
                    client = Some(c);
                }
                Err(_) => {
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            }
        }
        let c = client.as_ref().unwrap();
        txn += 1;
        let k = rng.random_range(1..=4);
        let hold = rng
            .random_bool(p.open_p)
            .then(|| rng.random_range(0.2..1.0));
        // In insert order a transaction held open keeps its aggregates' writers waiting (they
        // are serialised): it writes cold aggregates only, so the hot ones keep flowing.
        let hot_ok = hold.is_none() || p.commit_order;
        let mut aggs: Vec<String> = (0..k)
            .map(|_| {
                if hot_ok && rng.random_bool(0.5) {
                    p.agg(&format!("h{}", rng.random_range(0..p.hot)))
                } else {
                    p.agg(&format!("c{}", rng.random_range(0..p.cold)))
                }
            })
            .collect();
        let payloads: Vec<String> = (0..k)
            .map(|j| {
                let pad = if rng.random_bool(p.large_p) {
                    rng.random_range(100_000..600_000)
                } else {
                    rng.random_range(0..40)
                };
                format!(
                    "{{\"w\": {}, \"txn\": {txn}, \"k\": {j}, \"pad\": \"{}\"}}",
                    spec.idx,
                    "x".repeat(pad)
                )
            })
            .collect();
        let rollback = rng.random_bool(p.rollback_p);
        let round = p.round as i32;
        let work = async {
            c.batch_execute("BEGIN").await?;
            if !p.commit_order {
                let mut lock = aggs.clone();
                lock.sort();
                lock.dedup();
                c.execute_typed(
                    "SELECT 1 FROM chaos.counters WHERE agg = ANY($1) ORDER BY agg FOR UPDATE",
                    &[(&lock, Type::TEXT_ARRAY)],
                )
                .await?;
            }
            for (agg, payload) in aggs.iter().zip(&payloads) {
                c.execute_typed(
                    &insert,
                    &[
                        (agg, Type::TEXT),
                        (payload, Type::TEXT),
                        (&round, Type::INT4),
                    ],
                )
                .await?;
            }
            if let Some(h) = hold {
                tokio::time::sleep(Duration::from_secs_f64(h)).await;
            }
            c.batch_execute(if rollback { "ROLLBACK" } else { "COMMIT" })
                .await
        };
        // A silent server must not hold a writer past the round: bounded.
        match rt.block_on(async { tokio::time::timeout(Duration::from_secs(10), work).await }) {
            Ok(Ok(())) if rollback => stats.rolled_back += 1,
            Ok(Ok(())) => {
                stats.committed += 1;
                stats.events += k as u64;
            }
            _ => {
                stats.failed += 1;
                client = None;
            }
        }
        aggs.clear();
        let pause = rng.random_range(p.pace_ms.0..=p.pace_ms.1);
        std::thread::sleep(Duration::from_millis(pause));
    }
    stats
}

/// Process ids for SQL's `IN (…)`: comma-separated, and `0` (no backend's) for none.
fn pid_list(pids: &[i32]) -> String {
    if pids.is_empty() {
        return "0".to_owned();
    }
    let list: Vec<String> = pids.iter().map(i32::to_string).collect();
    list.join(",")
}
