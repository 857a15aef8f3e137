//! The machinery every round shares: the command the contenders run, the leasectl processes of a
//! round ([`Contender`], started from a [`Spec`]), the monitor that watches what they started,
//! the fault injected into one of them (or into its database path), and the end of a round —
//! everything waited for within a bound, observed and cleaned up ([`Round::finish`]). What a
//! round starts, and in what order, is its scenario's (`scenario.rs`).
//!
//! While the round runs, a monitor thread follows the children's O_APPEND log and polls every
//! pid the children announced (the `sh` and a `sleep 300 &` grandchild), recording the last
//! moment each was seen alive; the commands also log a tick every 100 ms while they work (and
//! while they ignore SIGTERM in their grace). A violation is only ever reported from such a
//! lower bound ("was still alive at t"), never from a missed sample, so it cannot be an artefact
//! of polling.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::OwnedFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::faults::Fault;
use crate::procs::{self, now};
use crate::scenario::Scenario;
use crate::Ctx;

/// The command every contender runs under leasectl: a fenced read-modify-write of a counter,
/// with a grandchild that would outlive it (`sleep 300 &`), a tick logged every 100 ms while it
/// works (until `$CHAOS_GATE` exists or `$CHAOS_SLEEP_MS` passed), every step logged, and after
/// its write an event of its own in `$LEASECTL_EVENTS` (aggregate `<target>.job`, its fence),
/// which only a stored result may bring into the outbox (I2) — the commands that exit 3 do, those
/// that exit 0 write none, so both ways of the fenced save (the plain one planned while the
/// command runs, alone or followed by the events' own `INSERT` in its transaction) meet every
/// fault. A
/// command that ignores SIGTERM keeps ticking through its grace, so a command still alive then
/// is seen by its own log as well as by the monitor. A host clock faked by libfaketime must not
/// reach the log: the preload is dropped before the first timestamp.
const CHILD: &str = r#"
unset LD_PRELOAD FAKETIME FAKETIME_NO_CACHE
ts() { date +%s.%N; }
L=$CHAOS_LOG
[ "$CHAOS_IGNORE_TERM" = 1 ] && trap '' TERM
echo "start $CHAOS_ID $$ $LEASECTL_FENCE $LEASECTL_TOKEN $(ts)" >> "$L"
sleep 300 &
echo "grand $CHAOS_ID $! $LEASECTL_FENCE $(ts)" >> "$L"
echo "child $CHAOS_ID has fence $LEASECTL_FENCE"
echo "child $CHAOS_ID is working" >&2
v=$("$CHAOS_PSQL" -XqtA -d "$CHAOS_DB" -c "SELECT value FROM chaos.register WHERE target = '$LEASECTL_TARGET'" 2>/dev/null)
t0=$(date +%s%N)
while :; do
    n=$(date +%s%N)
    echo "tick $CHAOS_ID $$ $LEASECTL_FENCE ${n%?????????}.${n#${n%?????????}}" >> "$L"
    [ -n "$CHAOS_GATE" ] && [ -e "$CHAOS_GATE" ] && break
    [ $(( (n - t0) / 1000000 )) -ge "$CHAOS_SLEEP_MS" ] && break
    sleep 0.1
done
r=-
if [ -n "$v" ]; then
    r=$("$CHAOS_PSQL" -XqtA -d "$CHAOS_DB" -c "UPDATE chaos.register SET value = $v + 1, fence = $LEASECTL_FENCE WHERE target = '$LEASECTL_TARGET' AND fence $CHAOS_CMP $LEASECTL_FENCE RETURNING value" 2>/dev/null)
    [ -n "$r" ] || r=-
fi
echo "write $CHAOS_ID $$ $LEASECTL_FENCE $r $(ts)" >> "$L"
[ "$CHAOS_EXIT" != 0 ] && [ -n "$LEASECTL_EVENTS" ] && printf '{"aggregate_type":"chaos.job","aggregate_id":"%s.job","type":"job.done","payload":{"fence":%s}}\n' "$LEASECTL_TARGET" "$LEASECTL_FENCE" >> "$LEASECTL_EVENTS"
echo "child $CHAOS_ID is done" >&2
echo "end $CHAOS_ID $$ $LEASECTL_FENCE $(ts)" >> "$L"
[ "$CHAOS_YES" = 1 ] && exec yes chaos
exit "$CHAOS_EXIT"
"#;

/// The cron schedule of `--slot` contenders, and its skew: every two minutes, so host clocks
/// minutes apart (libfaketime) would each pick another slot if they were asked.
pub const SLOT_SCHEDULE: &str = "*/2 * * * *";
pub const SLOT_PERIOD: f64 = 120.0;
pub const SLOT_SKEW: f64 = 30.0;

/// The slot of [`SLOT_SCHEDULE`] a caller at wall-clock `t` belongs to (the harness's clock is
/// the database's: one machine).
pub fn slot_of(t: f64) -> i64 {
    ((t + SLOT_SKEW) / SLOT_PERIOD).floor() as i64
}

/// One parsed line of the children's log: `kind id pid fence [extra] ts`.
#[derive(Debug, Clone)]
pub struct Line {
    pub kind: String,
    pub id: String,
    pub pid: i32,
    pub fence: i64,
    pub extra: String,
    pub ts: f64,
}

fn parse_line(l: &str) -> Option<Line> {
    let f: Vec<&str> = l.split_whitespace().collect();
    if f.len() < 5 {
        return None;
    }
    Some(Line {
        kind: f[0].to_owned(),
        id: f[1].to_owned(),
        pid: f[2].parse().ok()?,
        fence: f[3].parse().ok()?,
        extra: if f.len() > 5 {
            f[4].to_owned()
        } else {
            String::new()
        },
        ts: f[f.len() - 1].parse().ok()?,
    })
}

/// What the monitor knows about one announced pid.
#[derive(Debug, Clone)]
pub struct Watch {
    pub id: String,
    pub kind: String,
    pub ticks: Option<u64>,
    /// Last moment the process was certainly alive (a clock reading taken before a /proc read
    /// that found it alive, or the time it logged).
    pub last_alive: f64,
    pub dead: bool,
}

#[derive(Default)]
pub struct Observed {
    pub lines: Vec<Line>,
    pub watches: HashMap<i32, Watch>,
}

impl Observed {
    /// When the command of contender `id` logged its start.
    pub fn started(&self, id: &str) -> Option<f64> {
        self.lines
            .iter()
            .find(|l| l.kind == "start" && l.id == id)
            .map(|l| l.ts)
    }

    /// When the command of contender `id` logged its end (it finished by itself).
    pub fn ended(&self, id: &str) -> Option<f64> {
        self.lines
            .iter()
            .find(|l| l.kind == "end" && l.id == id)
            .map(|l| l.ts)
    }
}

struct Monitor {
    state: Arc<Mutex<Observed>>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Monitor {
    fn start(log: PathBuf) -> Monitor {
        let state = Arc::new(Mutex::new(Observed::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (st, sp) = (state.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut offset = 0u64;
            let mut partial = String::new();
            loop {
                let last = sp.load(Ordering::SeqCst);
                let mut new = String::new();
                if let Ok(mut f) = File::open(&log) {
                    let _ = f.seek(SeekFrom::Start(offset));
                    if let Ok(n) = f.read_to_string(&mut new) {
                        offset += n as u64;
                    }
                }
                partial.push_str(&new);
                let mut o = st.lock().unwrap();
                while let Some(nl) = partial.find('\n') {
                    let line: String = partial.drain(..=nl).collect();
                    let Some(l) = parse_line(&line) else { continue };
                    if matches!(l.kind.as_str(), "start" | "grand") {
                        let ticks = match procs::stat(l.pid) {
                            // Started well after it logged: the pid was already reused.
                            Some((st, _, t))
                                if st != 'Z' && procs::start_time(t) <= l.ts + 0.05 =>
                            {
                                Some(t)
                            }
                            _ => None,
                        };
                        o.watches.insert(
                            l.pid,
                            Watch {
                                id: l.id.clone(),
                                kind: l.kind.clone(),
                                dead: ticks.is_none(),
                                ticks,
                                last_alive: l.ts,
                            },
                        );
                    }
                    o.lines.push(l);
                }
                for (&pid, w) in o.watches.iter_mut().filter(|(_, w)| !w.dead) {
                    let t = now();
                    match procs::stat(pid) {
                        Some((st, _, ticks)) if st != 'Z' && Some(ticks) == w.ticks => {
                            w.last_alive = w.last_alive.max(t)
                        }
                        _ => w.dead = true,
                    }
                }
                drop(o);
                if last {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        Monitor {
            state,
            stop,
            thread: Some(thread),
        }
    }

    fn started(&self, id: &str) -> Option<f64> {
        self.state.lock().unwrap().started(id)
    }

    /// Whether a command other than `id`'s logged its start after `t`.
    fn other_started_after(&self, id: &str, t: f64) -> bool {
        self.state
            .lock()
            .unwrap()
            .lines
            .iter()
            .any(|l| l.kind == "start" && l.id != id && l.ts > t)
    }

    fn finish(mut self) -> Observed {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        std::mem::take(&mut *self.state.lock().unwrap())
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// What a contender's leasectl does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `run -- CHILD` (plain, `--replace`, `--slot`, `--max-holders`, queued).
    Run,
    /// `run --token T -- CHILD`: a step of a lease taken by `acquire`.
    Step,
    /// `acquire --format json`.
    Acquire,
    /// `renew --token T`.
    Renew,
    /// `release --token T`.
    ReleaseToken,
    /// `release --force`.
    ReleaseForce,
}

impl Kind {
    /// Runs a command (has a process tree the invariants follow).
    pub fn runs_command(self) -> bool {
        matches!(self, Kind::Run | Kind::Step)
    }
}

/// How a contender runs its command.
#[derive(Debug, Clone)]
pub struct ChildSpec {
    /// Works for this long at most (ticking).
    pub sleep_ms: u64,
    /// Stops working as soon as this file exists (the scenario opens it).
    pub gate: Option<PathBuf>,
    pub ignore_term: bool,
    pub exit_code: u8,
    /// Ends by writing to stdout forever (`yes`), for the broken-stdout fault.
    pub yes: bool,
}

/// A leasectl process for a round to start.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Unique within the round (`a`, `w2`, `step1`, …); the contender's id is `r<N>-<role>`.
    pub role: String,
    pub kind: Kind,
    pub ttl_ms: u64,
    pub heartbeat_ms: Option<u64>,
    pub kill_after_ms: Option<u64>,
    /// `--wait=<ms>ms`.
    pub wait_ms: Option<u64>,
    /// Check that it exits within its `--wait` + 0.5 s unless it got the lease in time.
    pub wait_bound: bool,
    /// `--queue MODE`.
    pub queue: Option<&'static str>,
    pub replace: bool,
    pub token: Option<String>,
    pub max_holders: Option<u32>,
    pub slot: bool,
    /// libfaketime's `FAKETIME` for a host whose clock is off.
    pub faketime: Option<String>,
    /// `release --force --no-wait`.
    pub no_wait: bool,
    pub child: Option<ChildSpec>,
    pub stderr_pipe: bool,
    pub stdout_pipe: bool,
}

impl Spec {
    fn new(role: &str, kind: Kind, ttl_ms: u64) -> Spec {
        Spec {
            role: role.to_owned(),
            kind,
            ttl_ms,
            heartbeat_ms: None,
            kill_after_ms: None,
            wait_ms: None,
            wait_bound: false,
            queue: None,
            replace: false,
            token: None,
            max_holders: None,
            slot: false,
            faketime: None,
            no_wait: false,
            child: None,
            stderr_pipe: false,
            stdout_pipe: false,
        }
    }

    /// `run` with TTL `ttl_ms`, heartbeat TTL/5 and kill-after 3·TTL/10 (2 heartbeats + grace
    /// must fit in the TTL: 0.4 + 0.3).
    pub fn run(role: &str, ttl_ms: u64, child: ChildSpec) -> Spec {
        Spec {
            heartbeat_ms: Some(ttl_ms / 5),
            kill_after_ms: Some(ttl_ms * 3 / 10),
            child: Some(child),
            ..Spec::new(role, Kind::Run, ttl_ms)
        }
    }

    /// A long-lived holder: TTL `ttl_ms`, heartbeat TTL/5 and a long grace (TTL/2), so that a
    /// command ignoring SIGTERM is still alive well after its lease was taken.
    pub fn long_run(role: &str, ttl_ms: u64, child: ChildSpec) -> Spec {
        Spec {
            kill_after_ms: Some(ttl_ms / 2),
            ..Spec::run(role, ttl_ms, child)
        }
    }

    /// `run --token`: heartbeat TTL/4 (the default; a step may not set it) and kill-after
    /// 2·TTL/5, so that the two fit (0.5 + 0.4).
    pub fn step(role: &str, token: &str, ttl_ms: u64, child: ChildSpec) -> Spec {
        Spec {
            token: Some(token.to_owned()),
            kill_after_ms: Some(ttl_ms * 2 / 5),
            child: Some(child),
            ..Spec::new(role, Kind::Step, ttl_ms)
        }
    }

    pub fn acquire(role: &str, ttl_ms: u64) -> Spec {
        Spec {
            wait_ms: Some(30_000),
            ..Spec::new(role, Kind::Acquire, ttl_ms)
        }
    }

    pub fn renew(role: &str, token: &str, ttl_ms: u64) -> Spec {
        Spec {
            token: Some(token.to_owned()),
            ..Spec::new(role, Kind::Renew, ttl_ms)
        }
    }

    pub fn release_token(role: &str, token: &str) -> Spec {
        Spec {
            token: Some(token.to_owned()),
            ..Spec::new(role, Kind::ReleaseToken, 0)
        }
    }

    pub fn release_force(role: &str, no_wait: bool) -> Spec {
        Spec {
            no_wait,
            ..Spec::new(role, Kind::ReleaseForce, 0)
        }
    }

    pub fn wait(mut self, ms: u64) -> Spec {
        self.wait_ms = Some(ms);
        self
    }
}

/// A leasectl process of this round.
pub struct Contender {
    pub id: String,
    pub role: String,
    pub kind: Kind,
    pub pid: i32,
    child: std::process::Child,
    /// When the harness started it.
    pub spawned: f64,
    pub exit: Option<(f64, ExitStatus)>,
    /// Set when the harness had to kill it because it did not exit within the bound.
    pub hung: bool,
    /// SIGSTOP and SIGCONT times, when the fault or the scenario stopped it.
    pub stopped: Option<(f64, f64)>,
    /// When the fault or the scenario killed it (kill -9 of leasectl or of its group).
    pub killed: Option<f64>,
    /// Hit by the round's fault (any kind).
    pub victim: bool,
    /// Read ends of a broken-pipe fault, dropped to make the reader "go away".
    readers: Vec<OwnedFd>,
    /// Its lease TTL in seconds (a step's: the acquired lease's).
    pub ttl: f64,
    /// `--wait` in seconds, when its bound is checked.
    pub wait_bound: Option<f64>,
    /// `--queue` mode, and its ticket once it was seen in the queue.
    pub queue: Option<&'static str>,
    pub ticket: Option<i64>,
    pub replace: bool,
    pub slot: bool,
    /// It was started with `--wait`.
    pub waits: bool,
    pub stdout_path: PathBuf,
    /// The command line, for the round's log.
    pub args: String,
}

impl Contender {
    fn poll(&mut self) -> bool {
        if self.exit.is_none() {
            if let Ok(Some(st)) = self.child.try_wait() {
                self.exit = Some((now(), st));
            }
        }
        self.exit.is_some()
    }

    pub fn code(&self) -> Option<i32> {
        self.exit.and_then(|(_, s)| s.code())
    }

    pub fn describe_exit(&self) -> String {
        match self.exit {
            None => "running".into(),
            Some((_, s)) => match (s.code(), s.signal()) {
                (Some(c), _) => format!("exit {c}"),
                (_, Some(sig)) => format!("killed by signal {sig}"),
                _ => format!("{s:?}"),
            },
        }
    }

    /// Killed or stopped by the fault or the scenario: exempt from the promises that need a
    /// live, running process (FIFO order, slots, exit bounds).
    pub fn disturbed(&self) -> bool {
        self.killed.is_some() || self.stopped.is_some() || self.hung
    }
}

/// Kills a contender's leasectl, its group, and everything carrying its marker.
impl Drop for Contender {
    fn drop(&mut self) {
        if self.exit.is_none() {
            procs::signal(-self.pid, libc::SIGKILL);
            procs::signal(self.pid, libc::SIGKILL);
            let _ = self.child.wait();
        }
        for (pid, _, _) in procs::marked(&self.id)
            .into_iter()
            .filter(|(_, id, _)| *id == self.id)
        {
            procs::signal(pid, libc::SIGCONT);
            procs::signal(pid, libc::SIGKILL);
        }
    }
}

/// A pipe whose ends are close-on-exec: the read end must stay in this process only, or the
/// next contender (or any process the harness starts) would inherit it and the reader would
/// never "go away".
fn pipe() -> (OwnedFd, OwnedFd) {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("pipe2")
}

/// Everything a round observed, for the invariant checks.
pub struct Outcome {
    pub n: usize,
    pub fault: Fault,
    pub scenario: Scenario,
    /// Which flavour of the scenario ran, e.g. `kill9-replacer`.
    pub variant: String,
    pub injected: bool,
    pub target: String,
    pub contenders: Vec<Contender>,
    pub observed: Observed,
    /// Processes still alive (pid, marker, command line) after their leasectl had exited.
    pub leftovers: Vec<(i32, String, String)>,
    /// When the database (path) went silent and for how long, for silence faults.
    pub silence: Option<(f64, f64)>,
    /// When the fault was injected.
    pub fault_at: Option<f64>,
    /// `--max-holders` of the round's run contenders.
    pub max_holders: Option<u32>,
    pub dir: PathBuf,
}

impl Outcome {
    pub fn contender(&self, id: &str) -> Option<&Contender> {
        self.contenders.iter().find(|c| c.id == id)
    }

    /// The contender hit by the fault.
    pub fn victim(&self) -> Option<&Contender> {
        self.contenders.iter().find(|c| c.victim)
    }
}

/// How long after its leasectl exited anything it started may take to disappear.
pub const LEFTOVER_SLACK: f64 = 1.0;

/// A round in progress: its contenders, its monitor, and the fault it injects.
pub struct Round<'a> {
    pub ctx: &'a mut Ctx,
    pub n: usize,
    pub fault: Fault,
    pub scenario: Scenario,
    pub variant: String,
    pub target: String,
    pub dir: PathBuf,
    monitor: Monitor,
    pub cs: Vec<Contender>,
    pub silence: Option<(f64, f64)>,
    pub fault_at: Option<f64>,
    pub fault_end: f64,
    pub injected: bool,
    pub max_holders: Option<u32>,
}

/// What a holder sends as its command starts, preparing its fenced save (a session setting
/// nothing else sends): where [`Fault::BlackHoleAtSave`] silences the database.
const SAVE_PREPARED: &str = "plan_cache_mode = force_generic_plan";

/// How long [`Fault::BlackHoleAtSave`]'s silence lasts: armed before the round knows whose
/// preparation it will catch, it outlasts the longest TTL a scenario gives a holder (4 × the
/// base TTL), as the other silences outlast their victim's.
fn save_hold(ctx: &Ctx) -> f64 {
    4.0 * ctx.cfg.ttl_ms as f64 / 1e3 + 2.5
}

impl<'a> Round<'a> {
    pub fn new(
        ctx: &'a mut Ctx,
        n: usize,
        fault: Fault,
        scenario: Scenario,
        target: String,
    ) -> Round<'a> {
        let dir = ctx.bench.dir.join(format!("round-{n:05}"));
        std::fs::create_dir_all(&dir).unwrap();
        ctx.bench.db.query(&format!(
            "INSERT INTO chaos.register VALUES ('{target}', 0, 0) ON CONFLICT DO NOTHING"
        ));
        let monitor = Monitor::start(dir.join("children.log"));
        if fault == Fault::BlackHoleAtSave {
            ctx.bench.proxy.black_hole_on(SAVE_PREPARED, save_hold(ctx));
        }
        Round {
            ctx,
            n,
            fault,
            scenario,
            variant: String::new(),
            target,
            dir,
            monitor,
            cs: Vec::new(),
            silence: None,
            fault_at: None,
            fault_end: now(),
            injected: false,
            max_holders: None,
        }
    }

    /// The round's base lease TTL in milliseconds.
    pub fn ttl_ms(&self) -> u64 {
        self.ctx.cfg.ttl_ms
    }

    pub fn rng(&mut self) -> &mut rand::rngs::StdRng {
        &mut self.ctx.rng
    }

    /// A gate file for a command to wait on (`ChildSpec::gate`).
    pub fn gate(&self, name: &str) -> PathBuf {
        self.dir.join(format!("gate-{name}"))
    }

    pub fn open_gate(&self, gate: &Path) {
        let _ = File::create(gate);
    }

    /// Starts a contender; returns its index.
    pub fn spawn(&mut self, s: Spec) -> usize {
        let ctx = &*self.ctx;
        let id = format!("r{}-{}", self.n, s.role);
        let mut cmd = Command::new(&ctx.cfg.bin);
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
        let mut args: Vec<String> = vec![
            "--database-url".into(),
            ctx.bench.proxy_conninfo.clone(),
            "--schema".into(),
            ctx.schema.clone(),
            "-v".into(),
        ];
        let target = ["--target".to_owned(), self.target.clone()];
        match s.kind {
            Kind::Run | Kind::Step => {
                args.push("run".into());
                args.extend(target);
                if s.kind == Kind::Run {
                    args.push(format!("--ttl={}ms", s.ttl_ms));
                }
                if let Some(hb) = s.heartbeat_ms {
                    args.push(format!("--heartbeat={hb}ms"));
                }
                if let Some(ka) = s.kill_after_ms {
                    args.push(format!("--kill-after={ka}ms"));
                }
            }
            Kind::Acquire => {
                args.extend(["acquire".into(), "--format".into(), "json".into()]);
                args.extend(target);
                args.push(format!("--ttl={}ms", s.ttl_ms));
            }
            Kind::Renew => {
                args.push("renew".into());
                args.extend(target);
            }
            Kind::ReleaseToken | Kind::ReleaseForce => {
                args.push("release".into());
                args.extend(target);
                if s.kind == Kind::ReleaseForce {
                    args.push("--force".into());
                }
                if s.no_wait {
                    args.push("--no-wait".into());
                }
            }
        }
        if let Some(t) = &s.token {
            args.extend(["--token".into(), t.clone()]);
        }
        if let Some(w) = s.wait_ms {
            args.push(format!("--wait={w}ms"));
        }
        if let Some(q) = s.queue {
            args.extend(["--queue".into(), q.into()]);
        }
        if s.replace {
            args.push("--replace".into());
        }
        if let Some(n) = s.max_holders {
            args.push(format!("--max-holders={n}"));
        }
        if s.slot {
            args.extend([
                "--slot".into(),
                SLOT_SCHEDULE.into(),
                format!("--slot-skew={}s", SLOT_SKEW),
            ]);
        }
        if let Some(child) = &s.child {
            args.extend(["--".into(), "sh".into(), "-c".into(), CHILD.into()]);
            cmd.env("CHAOS_LOG", self.dir.join("children.log"))
                .env("CHAOS_PSQL", &ctx.bench.psql)
                .env(
                    "CHAOS_DB",
                    format!("{} connect_timeout=3", ctx.bench.direct_conninfo),
                )
                .env("CHAOS_SLEEP_MS", child.sleep_ms.to_string())
                .env(
                    "CHAOS_GATE",
                    child
                        .gate
                        .as_deref()
                        .map(Path::as_os_str)
                        .unwrap_or_default(),
                )
                .env(
                    "CHAOS_IGNORE_TERM",
                    if child.ignore_term { "1" } else { "0" },
                )
                .env("CHAOS_EXIT", child.exit_code.to_string())
                .env("CHAOS_YES", if child.yes { "1" } else { "0" })
                // The steps of a lease share its fence: each may write after the one before.
                .env("CHAOS_CMP", if s.kind == Kind::Step { "<=" } else { "<" });
        }
        if let Some(f) = &s.faketime {
            cmd.env("LD_PRELOAD", libfaketime())
                .env("FAKETIME", f)
                .env("FAKETIME_NO_CACHE", "1");
        }
        // The round's own temporary directory: what a leasectl leaves in it is the round's to
        // judge (I6).
        let tmp = self.dir.join("tmp");
        let _ = std::fs::create_dir_all(&tmp);
        cmd.args(&args)
            .env("TMPDIR", &tmp)
            .env(procs::MARKER, &id)
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            // Its own process group, so that a group kill hits leasectl's group and not ours.
            .process_group(0);
        let mut readers = Vec::new();
        let stdout_path = self.dir.join(format!("{}.out", s.role));
        if s.stdout_pipe {
            let (r, w) = pipe();
            readers.push(r);
            cmd.stdout(Stdio::from(w));
        } else {
            cmd.stdout(File::create(&stdout_path).unwrap());
        }
        if s.stderr_pipe {
            let (r, w) = pipe();
            readers.push(r);
            cmd.stderr(Stdio::from(w));
        } else {
            cmd.stderr(File::create(self.dir.join(format!("{}.err", s.role))).unwrap());
        }
        let spawned = now();
        let child = cmd.spawn().expect("cannot spawn leasectl");
        let shown: Vec<String> = args
            .iter()
            .map(|a| {
                if a == CHILD {
                    "CHILD".to_owned()
                } else {
                    a.clone()
                }
            })
            .skip(4)
            .collect();
        let mut env = String::new();
        if let Some(c) = &s.child {
            env = format!(
                " [work {}ms{}{}{}]",
                c.sleep_ms,
                if c.gate.is_some() { " gated" } else { "" },
                if c.ignore_term {
                    " ignoring SIGTERM"
                } else {
                    ""
                },
                s.faketime
                    .as_deref()
                    .map(|f| format!(" clock {f}"))
                    .unwrap_or_default()
            );
        }
        self.cs.push(Contender {
            id,
            role: s.role.clone(),
            kind: s.kind,
            pid: child.id() as i32,
            child,
            spawned,
            exit: None,
            hung: false,
            stopped: None,
            killed: None,
            victim: false,
            readers,
            ttl: s.ttl_ms as f64 / 1e3,
            wait_bound: s
                .wait_bound
                .then(|| s.wait_ms.map(|w| w as f64 / 1e3))
                .flatten(),
            queue: s.queue,
            ticket: None,
            replace: s.replace,
            slot: s.slot,
            waits: s.wait_ms.is_some(),
            stdout_path,
            args: format!("{}{env}", shown.join(" ")),
        });
        self.cs.len() - 1
    }

    fn poll_all(&mut self) {
        for c in self.cs.iter_mut() {
            c.poll();
        }
    }

    /// Polls until `cond` or the deadline (a wall-clock time), noting every contender's exit
    /// when it happens; returns whether `cond` held.
    pub fn wait_until(&mut self, deadline: f64, mut cond: impl FnMut(&mut Self) -> bool) -> bool {
        loop {
            self.poll_all();
            if cond(self) {
                return true;
            }
            if now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Sleeps `secs` while noting exits.
    pub fn pause(&mut self, secs: f64) {
        let until = now() + secs;
        self.wait_until(until, |_| false);
    }

    pub fn exited(&self, i: usize) -> bool {
        self.cs[i].exit.is_some()
    }

    /// Waits until contender `i`'s command logged its start; false when it exited first or
    /// `patience` passed.
    pub fn wait_started(&mut self, i: usize, patience: f64) -> bool {
        let id = self.cs[i].id.clone();
        self.wait_until(now() + patience, |r| {
            r.monitor.started(&id).is_some() || r.cs[i].exit.is_some()
        });
        self.monitor.started(&id).is_some()
    }

    pub fn started(&self, i: usize) -> Option<f64> {
        self.monitor.started(&self.cs[i].id)
    }

    /// Waits until contender `i` is listed in the target's queue (the waiters table) and
    /// returns its ticket; `None` when it exited, started its command, or `patience` passed.
    pub fn wait_joined(&mut self, i: usize, patience: f64) -> Option<i64> {
        let (schema, target, pid, id) = (
            self.ctx.schema.clone(),
            self.target.clone(),
            self.cs[i].pid,
            self.cs[i].id.clone(),
        );
        let deadline = now() + patience;
        loop {
            self.poll_all();
            let rows = self.ctx.bench.db.query(&format!(
                "SELECT ticket FROM \"{schema}\".waiters WHERE target = '{target}' AND pid = {pid}
                  ORDER BY ticket LIMIT 1"
            ));
            if let Some(t) = rows.first().and_then(|r| r[0].as_deref()?.parse().ok()) {
                self.cs[i].ticket = Some(t);
                return Some(t);
            }
            if self.cs[i].exit.is_some() || self.monitor.started(&id).is_some() || now() > deadline
            {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until contender `i` holds the target's lease (a row names its pid); false when it
    /// exited first or `patience` passed.
    pub fn wait_holding(&mut self, i: usize, patience: f64) -> bool {
        let (schema, target, pid) = (self.ctx.schema.clone(), self.target.clone(), self.cs[i].pid);
        let deadline = now() + patience;
        loop {
            self.poll_all();
            let rows = self.ctx.bench.db.query(&format!(
                "SELECT 1 FROM \"{schema}\".leases
                  WHERE target = '{target}' AND holder_pid = {pid} AND token IS NOT NULL"
            ));
            if !rows.is_empty() {
                return true;
            }
            if self.cs[i].exit.is_some() || now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits up to `patience` for contender `i` to exit; one that does not is killed and counted
    /// as hung.
    pub fn wait_exit(&mut self, i: usize, patience: f64) -> bool {
        if self.wait_until(now() + patience, |r| r.cs[i].exit.is_some()) {
            return true;
        }
        self.kill_hung(i);
        false
    }

    fn kill_hung(&mut self, i: usize) {
        let c = &mut self.cs[i];
        if c.exit.is_some() {
            return;
        }
        c.hung = true;
        procs::signal(-c.pid, libc::SIGKILL);
        procs::signal(c.pid, libc::SIGKILL);
        let _ = c.child.wait();
        c.exit = Some((now(), ExitStatus::from_raw(libc::SIGKILL)));
    }

    /// `kill -9` of contender `i`'s leasectl (not its group: its watchdog must act).
    pub fn kill9(&mut self, i: usize) {
        if self.cs[i].poll() {
            return;
        }
        self.cs[i].killed = Some(now());
        procs::signal(self.cs[i].pid, libc::SIGKILL);
    }

    pub fn sigstop(&mut self, i: usize) -> f64 {
        procs::signal(self.cs[i].pid, libc::SIGSTOP);
        now()
    }

    pub fn sigcont(&mut self, i: usize, stopped_at: f64) {
        let cont = now();
        procs::signal(self.cs[i].pid, libc::SIGCONT);
        self.cs[i].stopped = Some((stopped_at, cont));
    }

    /// The token `acquire --format json` printed, once it exited 0.
    pub fn printed_token(&self, i: usize) -> Option<String> {
        let out = std::fs::read_to_string(&self.cs[i].stdout_path).ok()?;
        let v: serde_json::Value = serde_json::from_str(out.trim()).ok()?;
        v["token"].as_str().map(str::to_owned)
    }

    /// Injects the round's fault into contender `v` (or into the database or its path). A fault
    /// of the victim's own process (kill, stop, pipes) needs it alive; one of the database or
    /// the network hits whoever is left even when the victim is done.
    pub fn inject(&mut self, v: usize) {
        self.cs[v].poll();
        let own = matches!(
            self.fault,
            Fault::Kill9
                | Fault::Kill9Group
                | Fault::Kill9Child
                | Fault::SigStop
                | Fault::StderrPipe
                | Fault::StdoutPipe
        );
        if self.injected || (own && self.cs[v].exit.is_some()) {
            return;
        }
        self.injected = true;
        self.cs[v].victim = true;
        let ttl = self.cs[v].ttl;
        let t = now();
        self.fault_at = Some(t);
        // A silence outlasts the victim's TTL by more than the bound in `invariants` (TTL +
        // 1.5 s) in which a holder that lost its lease must have exited.
        let hold = ttl + 2.5;
        let pid = self.cs[v].pid;
        let id = self.cs[v].id.clone();
        match self.fault {
            Fault::Kill9 => {
                self.cs[v].killed = Some(t);
                procs::signal(pid, libc::SIGKILL)
            }
            Fault::Kill9Group => {
                self.cs[v].killed = Some(t);
                procs::signal(-pid, libc::SIGKILL)
            }
            Fault::Kill9Child => {
                let sh = self
                    .monitor
                    .state
                    .lock()
                    .unwrap()
                    .lines
                    .iter()
                    .find(|l| l.kind == "start" && l.id == id)
                    .map(|l| l.pid);
                if let Some(sh) = sh {
                    procs::signal(sh, libc::SIGKILL)
                }
            }
            Fault::SigStop => {
                let stop = self.sigstop(v);
                // Past the TTL, and until another command runs (if one can).
                self.wait_until(stop + 4.0 * ttl + 5.0, |r| {
                    now() > stop + ttl && r.monitor.other_started_after(&id, stop)
                });
                self.sigcont(v, stop);
            }
            Fault::RestartFast => self.ctx.bench.cluster.restart("fast"),
            Fault::RestartImmediate => self.ctx.bench.cluster.restart("immediate"),
            Fault::DbStop => {
                self.ctx.bench.cluster.stop();
                self.silence = Some((t, hold));
                self.pause(t + hold - now());
                self.ctx.bench.cluster.start_again();
            }
            Fault::DbFreeze => {
                self.ctx.bench.cluster.freeze();
                self.silence = Some((t, hold));
                self.pause(t + hold - now());
                self.ctx.bench.cluster.thaw();
            }
            Fault::BlackHole => {
                self.ctx.bench.proxy.set_black_hole(true);
                self.silence = Some((t, hold));
                self.pause(t + hold - now());
                self.ctx.bench.proxy.set_black_hole(false);
            }
            Fault::BlackHoleAtSave => {
                // The silence began when a holder sent its save's preparation (and heals by
                // itself after its hold), or begins now if none did.
                let hold = save_hold(self.ctx);
                let proxy = &self.ctx.bench.proxy;
                let began = proxy.disarm().unwrap_or_else(|| {
                    proxy.set_black_hole(true);
                    t
                });
                self.fault_at = Some(began);
                self.silence = Some((began, hold));
                self.pause(began + hold - now());
                self.ctx.bench.proxy.set_black_hole(false);
            }
            Fault::Cut => self.ctx.bench.proxy.cut(),
            Fault::StderrPipe | Fault::StdoutPipe => self.cs[v].readers.clear(),
        }
        self.fault_end = now();
    }

    /// Ends the round: every leasectl must be done within a bound (one that is not is killed
    /// and counted), nothing it started may outlive it, and everything left is cleaned up.
    pub fn finish(mut self) -> Outcome {
        // A trigger that fired without the fault being injected (the scenario ended early)
        // still made a silence: it is healed and counted as the fault; one that did not fire
        // is disarmed.
        if self.fault == Fault::BlackHoleAtSave && !self.injected && !self.cs.is_empty() {
            if self.ctx.bench.proxy.fired().is_some() {
                self.inject(0);
            } else {
                self.ctx.bench.proxy.disarm();
            }
        }
        let max_ttl = self.cs.iter().map(|c| c.ttl).fold(0.0, f64::max);
        // The victim first: the others may legitimately wait for it to go away.
        let bound = self.fault_end.max(now()) + 10.0 + 4.0 * max_ttl;
        self.wait_until(bound, |r| r.cs.iter().all(|c| c.exit.is_some()));
        if let Some(v) = self.cs.iter().position(|c| c.victim) {
            self.kill_hung(v);
        }
        // The others may now need a TTL to take over from the killed one.
        self.wait_until(now() + 10.0 + 4.0 * max_ttl, |r| {
            r.cs.iter().all(|c| c.exit.is_some())
        });
        for i in 0..self.cs.len() {
            self.kill_hung(i);
        }
        // Nothing a leasectl started may be alive LEFTOVER_SLACK after it exited.
        let prefix = format!("r{}-", self.n);
        let last_exit = self
            .cs
            .iter()
            .filter_map(|c| c.exit.map(|e| e.0))
            .fold(0.0, f64::max);
        self.wait_until(last_exit + LEFTOVER_SLACK, |_| {
            procs::marked(&prefix).is_empty()
        });
        let cs = &self.cs;
        let leftovers: Vec<_> = procs::marked(&prefix)
            .into_iter()
            .filter(|(_, id, _)| {
                // A process still alive now, later than its own leasectl's exit + slack.
                cs.iter()
                    .find(|c| &c.id == id)
                    .and_then(|c| c.exit)
                    .is_some_and(|(t, _)| now() > t + LEFTOVER_SLACK)
            })
            .collect();
        for (pid, _, _) in procs::marked(&prefix) {
            procs::signal(pid, libc::SIGCONT);
            procs::signal(pid, libc::SIGKILL);
        }
        self.wait_until(now() + 10.0, |_| procs::marked(&prefix).is_empty());
        let observed = self.monitor.finish();
        Outcome {
            n: self.n,
            fault: self.fault,
            scenario: self.scenario,
            variant: self.variant,
            injected: self.injected,
            target: self.target,
            contenders: self.cs,
            observed,
            leftovers,
            silence: self.silence,
            fault_at: self.fault_at,
            max_holders: self.max_holders,
            dir: self.dir,
        }
    }
}

/// libfaketime's preload library (Debian package `faketime`; scripts/test installs it).
pub fn libfaketime() -> String {
    ["x86_64-linux-gnu", "aarch64-linux-gnu"]
        .iter()
        .map(|arch| format!("/usr/lib/{arch}/faketime/libfaketime.so.1"))
        .find(|p| Path::new(p).exists())
        .unwrap_or_default()
}
