//! One round: two contenders on one target, a fault injected into the first holder (or its
//! database path) at a random moment of its run, then everything they started is waited for,
//! observed and cleaned up.
//!
//! While the round runs, a monitor thread follows the children's O_APPEND log and polls every
//! pid the children announced (the `sh`, its foreground `sleep` and a `sleep 300 &` grandchild),
//! recording the last moment each was seen alive. A violation is only ever reported from such a
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

use rand::Rng;

use crate::faults::Fault;
use crate::procs::{self, now};
use crate::Ctx;

/// The command every contender runs under leasectl: a fenced read-modify-write of a counter,
/// with a grandchild that would outlive it (`sleep 300 &`) and every step logged.
const CHILD: &str = r#"
ts() { date +%s.%N; }
L=$CHAOS_LOG
[ "$CHAOS_IGNORE_TERM" = 1 ] && trap '' TERM
echo "start $CHAOS_ID $$ $LEASECTL_FENCE $LEASECTL_TOKEN $(ts)" >> "$L"
sleep 300 &
echo "grand $CHAOS_ID $! $LEASECTL_FENCE $(ts)" >> "$L"
echo "child $CHAOS_ID has fence $LEASECTL_FENCE"
echo "child $CHAOS_ID is working" >&2
v=$("$CHAOS_PSQL" -XqtA -d "$CHAOS_DB" -c "SELECT value FROM chaos.register WHERE target = '$LEASECTL_TARGET'" 2>/dev/null)
sleep "$CHAOS_SLEEP" &
echo "fg $CHAOS_ID $! $LEASECTL_FENCE $(ts)" >> "$L"
wait $!
r=-
if [ -n "$v" ]; then
    r=$("$CHAOS_PSQL" -XqtA -d "$CHAOS_DB" -c "UPDATE chaos.register SET value = $v + 1, fence = $LEASECTL_FENCE WHERE target = '$LEASECTL_TARGET' AND fence < $LEASECTL_FENCE RETURNING value" 2>/dev/null)
    [ -n "$r" ] || r=-
fi
echo "write $CHAOS_ID $$ $LEASECTL_FENCE $r $(ts)" >> "$L"
echo "child $CHAOS_ID is done" >&2
echo "end $CHAOS_ID $$ $LEASECTL_FENCE $(ts)" >> "$L"
[ "$CHAOS_YES" = 1 ] && exec yes chaos
exit "$CHAOS_EXIT"
"#;

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
                    if matches!(l.kind.as_str(), "start" | "grand" | "fg") {
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

    fn lines(&self) -> Vec<Line> {
        self.state.lock().unwrap().lines.clone()
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

/// A leasectl process of this round.
pub struct Contender {
    pub id: String,
    pub pid: i32,
    child: std::process::Child,
    pub exit: Option<(f64, ExitStatus)>,
    /// Set when the harness had to kill it because it did not exit within the bound.
    pub hung: bool,
    /// SIGSTOP and SIGCONT times, when the fault stopped it.
    pub stopped: Option<(f64, f64)>,
    /// Read ends of a broken-pipe fault, dropped to make the reader "go away".
    readers: Vec<OwnedFd>,
    /// It ran with `--replace` (took the lease from the first contender).
    pub replace: bool,
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
}

/// Kills a contender's leasectl, its group, and everything carrying its marker.
impl Drop for Contender {
    fn drop(&mut self) {
        if self.exit.is_none() {
            procs::signal(-self.pid, libc::SIGKILL);
            procs::signal(self.pid, libc::SIGKILL);
            let _ = self.child.wait();
        }
        for (pid, _, _) in procs::marked(&self.id) {
            procs::signal(pid, libc::SIGCONT);
            procs::signal(pid, libc::SIGKILL);
        }
    }
}

pub struct Spec {
    pub id: String,
    pub target: String,
    pub sleep_ms: u64,
    pub ignore_term: bool,
    pub exit_code: u8,
    pub stderr_pipe: bool,
    pub stdout_pipe: bool,
    pub yes: bool,
    /// `--replace` instead of `--wait`: take the lease from the holder, which must stop first.
    pub replace: bool,
}

/// A pipe whose ends are close-on-exec: the read end must stay in this process only, or the
/// next contender (or any process the harness starts) would inherit it and the reader would
/// never "go away".
fn pipe() -> (OwnedFd, OwnedFd) {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).expect("pipe2")
}

fn spawn(ctx: &Ctx, dir: &Path, s: &Spec) -> Contender {
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
    cmd.args([
        "--database-url",
        &ctx.proxy_conninfo,
        "--schema",
        &ctx.schema,
        "-v",
        "run",
    ])
    .args(["--target", &s.target])
    .arg(format!("--ttl={}ms", ctx.cfg.ttl_ms))
    .arg(format!("--heartbeat={}ms", ctx.cfg.heartbeat_ms))
    .arg(format!("--kill-after={}ms", ctx.cfg.kill_after_ms))
    .arg(if s.replace { "--replace" } else { "--wait=60s" })
    .args(["--", "sh", "-c", CHILD])
    .env(procs::MARKER, &s.id)
    .env("CHAOS_LOG", dir.join("children.log"))
    .env("CHAOS_PSQL", &ctx.psql)
    .env(
        "CHAOS_DB",
        format!("{} connect_timeout=3", ctx.direct_conninfo),
    )
    .env("CHAOS_SLEEP", format!("{:.3}", s.sleep_ms as f64 / 1000.0))
    .env("CHAOS_IGNORE_TERM", if s.ignore_term { "1" } else { "0" })
    .env("CHAOS_EXIT", s.exit_code.to_string())
    .env("CHAOS_YES", if s.yes { "1" } else { "0" })
    .current_dir(dir)
    .stdin(Stdio::null())
    // Its own process group, so that a group kill hits leasectl's group and not ours.
    .process_group(0);
    let mut readers = Vec::new();
    if s.stdout_pipe {
        let (r, w) = pipe();
        readers.push(r);
        cmd.stdout(Stdio::from(w));
    } else {
        cmd.stdout(File::create(dir.join(format!("{}.out", s.id))).unwrap());
    }
    if s.stderr_pipe {
        let (r, w) = pipe();
        readers.push(r);
        cmd.stderr(Stdio::from(w));
    } else {
        cmd.stderr(File::create(dir.join(format!("{}.err", s.id))).unwrap());
    }
    let child = cmd.spawn().expect("cannot spawn leasectl");
    Contender {
        id: s.id.clone(),
        pid: child.id() as i32,
        child,
        exit: None,
        hung: false,
        stopped: None,
        readers,
        replace: s.replace,
    }
}

/// Everything a round observed, for the invariant checks.
pub struct Outcome {
    pub fault: Fault,
    pub injected: bool,
    pub target: String,
    pub contenders: Vec<Contender>,
    pub observed: Observed,
    /// Processes still alive (pid, marker, command line) after their leasectl had exited.
    pub leftovers: Vec<(i32, String, String)>,
    /// When the database (path) went silent and for how long, for silence faults.
    pub silence: Option<(f64, f64)>,
    pub dir: PathBuf,
}

/// Polls until `cond` or the deadline (a wall-clock time); returns whether `cond` held.
fn wait_until(deadline: f64, mut cond: impl FnMut() -> bool) -> bool {
    loop {
        if cond() {
            return true;
        }
        if now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// How long after its leasectl exited anything it started may take to disappear.
pub const LEFTOVER_SLACK: f64 = 1.0;

pub fn run(ctx: &mut Ctx, round: usize, fault: Fault) -> Outcome {
    let ttl = ctx.cfg.ttl_ms as f64 / 1000.0;
    let target = format!("t{}", round % 3);
    let dir = ctx.dir.join(format!("round-{round:05}"));
    std::fs::create_dir_all(&dir).unwrap();
    let monitor = Monitor::start(dir.join("children.log"));
    let rng = &mut ctx.rng;
    let a = Spec {
        id: format!("r{round}-a"),
        target: target.clone(),
        sleep_ms: rng.random_range(250..=700),
        ignore_term: rng.random_bool(0.5),
        exit_code: if rng.random_bool(0.5) { 0 } else { 3 },
        stderr_pipe: fault == Fault::StderrPipe,
        stdout_pipe: fault == Fault::StdoutPipe,
        yes: fault == Fault::StdoutPipe,
        replace: false,
    };
    let b = Spec {
        id: format!("r{round}-b"),
        target: target.clone(),
        sleep_ms: rng.random_range(50..=250),
        ignore_term: rng.random_bool(0.5),
        exit_code: if rng.random_bool(0.5) { 0 } else { 3 },
        stderr_pipe: false,
        stdout_pipe: false,
        yes: false,
        replace: rng.random_bool(0.3),
    };
    let delay = rng.random_range(0.0..(a.sleep_ms as f64 / 1000.0) * 0.9);
    let mut cs = vec![spawn(ctx, &dir, &a)];
    // The first contender must be the holder: the second starts once its command runs.
    let a_started = wait_until(now() + 30.0, || {
        cs[0].poll()
            || monitor
                .lines()
                .iter()
                .any(|l| l.kind == "start" && l.id == a.id)
    }) && cs[0].exit.is_none();
    cs.push(spawn(ctx, &dir, &b));
    let mut silence = None;
    let mut fault_end = now();
    if a_started {
        std::thread::sleep(Duration::from_secs_f64(delay));
        let a_line = monitor
            .lines()
            .into_iter()
            .find(|l| l.kind == "start" && l.id == a.id)
            .unwrap();
        // A silence outlasts the TTL by more than the bound in `invariants` (TTL + 1.5 s) in
        // which a holder that lost its lease must have exited.
        let hold = ttl + 2.5;
        match fault {
            Fault::Kill9 => procs::signal(cs[0].pid, libc::SIGKILL),
            Fault::Kill9Group => procs::signal(-cs[0].pid, libc::SIGKILL),
            Fault::Kill9Child => procs::signal(a_line.pid, libc::SIGKILL),
            Fault::SigStop => {
                procs::signal(cs[0].pid, libc::SIGSTOP);
                let stop = now();
                // Past the TTL, and until the next holder's command runs (if it can).
                let b_id = b.id.clone();
                wait_until(stop + 4.0 * ttl + 5.0, || {
                    now() > stop + ttl
                        && monitor
                            .lines()
                            .iter()
                            .any(|l| l.kind == "start" && l.id == b_id)
                });
                let cont = now();
                procs::signal(cs[0].pid, libc::SIGCONT);
                cs[0].stopped = Some((stop, cont));
            }
            Fault::RestartFast => ctx.cluster.restart("fast"),
            Fault::RestartImmediate => ctx.cluster.restart("immediate"),
            Fault::DbStop => {
                let t = now();
                ctx.cluster.stop();
                silence = Some((t, hold));
                poll_until(&mut cs, t + hold);
                ctx.cluster.start_again();
            }
            Fault::DbFreeze => {
                let t = now();
                ctx.cluster.freeze();
                silence = Some((t, hold));
                poll_until(&mut cs, t + hold);
                ctx.cluster.thaw();
            }
            Fault::BlackHole => {
                let t = now();
                ctx.proxy.set_black_hole(true);
                silence = Some((t, hold));
                poll_until(&mut cs, t + hold);
                ctx.proxy.set_black_hole(false);
            }
            Fault::Cut => ctx.proxy.cut(),
            Fault::StderrPipe | Fault::StdoutPipe => cs[0].readers.clear(),
        }
        fault_end = now();
    }
    // Every leasectl must be done within a bound; one that is not is killed (and counted).
    // The faulted holder first: the waiter may legitimately wait for it to go away.
    let bound = fault_end + 10.0 + 4.0 * ttl;
    wait_until(bound, || cs.iter_mut().all(|c| c.poll()));
    for c in cs.iter_mut().take(1).filter(|c| c.exit.is_none()) {
        c.hung = true;
        procs::signal(-c.pid, libc::SIGKILL);
        procs::signal(c.pid, libc::SIGKILL);
    }
    // The others may now need a TTL to take over from the killed one.
    wait_until(now() + 10.0 + 4.0 * ttl, || cs.iter_mut().all(|c| c.poll()));
    for c in cs.iter_mut().filter(|c| c.exit.is_none()) {
        c.hung = true;
        procs::signal(-c.pid, libc::SIGKILL);
        procs::signal(c.pid, libc::SIGKILL);
        let _ = c.child.wait();
        c.exit = Some((now(), ExitStatus::from_raw(libc::SIGKILL)));
    }
    // Nothing a leasectl started may be alive LEFTOVER_SLACK after it exited.
    let prefix = format!("r{round}-");
    let last_exit = cs
        .iter()
        .filter_map(|c| c.exit.map(|e| e.0))
        .fold(0.0, f64::max);
    wait_until(last_exit + LEFTOVER_SLACK, || {
        procs::marked(&prefix).is_empty()
    });
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
    wait_until(now() + 10.0, || procs::marked(&prefix).is_empty());
    let observed = monitor.finish();
    Outcome {
        fault,
        injected: a_started,
        target,
        contenders: cs,
        observed,
        leftovers,
        silence,
        dir,
    }
}

/// Sleeps until `t` (a [`now`] value) while noting when each contender exits, so that an exit
/// during a silence is timed when it happens, not when the silence ends.
fn poll_until(cs: &mut [Contender], t: f64) {
    while now() < t {
        for c in cs.iter_mut() {
            c.poll();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
