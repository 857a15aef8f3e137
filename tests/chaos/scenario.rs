//! What a round starts: one scenario per round — who contends for the target, with which
//! leasectl features, in what order — while the round's fault hits one of them (the victim,
//! always a holder whose command runs) or its database path at a random moment.
//!
//! Every scenario keeps every fault applicable, and every draw comes from the round's seeded
//! generator, so a seed replays the same scenarios, variants and timings.

use std::fmt;

use rand::seq::SliceRandom;
use rand::Rng;

use crate::faults::Fault;
use crate::round::{ChildSpec, Round, Spec};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Scenario {
    /// A holder and a waiter (`--wait=60s`, or a short `--wait=DUR` whose bound is checked).
    Plain,
    /// A long-lived holder whose command may ignore SIGTERM, taken by `--replace` — a replacer
    /// that is then killed (-9), stopped, or replaced in turn — with a waiter behind.
    Replace,
    /// A long-lived holder (a run, or a step of an acquired lease) broken by `release --force`
    /// with waiters queued.
    Force,
    /// `acquire`, steps (`run --token`) one after the other and at once, `renew`, `release
    /// --token` (also while a step runs), with a waiter queued for the lease.
    Steps,
    /// A holder and several waiters that join one at a time: `--queue fifo` (their start order
    /// is checked) or `--queue latest`; some killed or stopped.
    Queue,
    /// `--slot` contenders on hosts whose clocks are minutes apart (libfaketime), arriving while
    /// the slot's run is in progress and after it.
    Slot,
    /// `--max-holders N` with more contenders than places.
    MaxHolders,
}

pub const ALL: [Scenario; 7] = [
    Scenario::Plain,
    Scenario::Replace,
    Scenario::Force,
    Scenario::Steps,
    Scenario::Queue,
    Scenario::Slot,
    Scenario::MaxHolders,
];

impl Scenario {
    pub fn name(self) -> &'static str {
        match self {
            Scenario::Plain => "plain",
            Scenario::Replace => "replace",
            Scenario::Force => "force",
            Scenario::Steps => "steps",
            Scenario::Queue => "queue",
            Scenario::Slot => "slot",
            Scenario::MaxHolders => "max-holders",
        }
    }

    /// Parses a comma-separated list (`LEASECTL_CHAOS_SCENARIOS`); `all` or empty = every one.
    pub fn parse_list(s: &str) -> Result<Vec<Scenario>, String> {
        let s = s.trim();
        if s.is_empty() || s == "all" {
            return Ok(ALL.to_vec());
        }
        s.split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(|name| {
                ALL.iter()
                    .copied()
                    .find(|k| k.name() == name)
                    .ok_or_else(|| {
                        let names: Vec<_> = ALL.iter().map(|k| k.name()).collect();
                        format!(
                            "unknown scenario '{name}' (known: {}, all)",
                            names.join(", ")
                        )
                    })
            })
            .collect()
    }

    /// The target of round `n`: the plain rounds share three targets (fences must keep
    /// growing across rounds and restarts); the others get one of their own, so that what a
    /// round leaves behind (a queue, a lease between steps, another `--max-holders`) cannot
    /// change the next one's.
    pub fn target(self, n: usize) -> String {
        match self {
            Scenario::Plain => format!("t{}", n % 3),
            _ => format!("{}{n}", &self.name()[..1]),
        }
    }

    pub fn drive(self, r: &mut Round) {
        match self {
            Scenario::Plain => plain(r),
            Scenario::Replace => replace(r),
            Scenario::Force => force(r),
            Scenario::Steps => steps(r),
            Scenario::Queue => queue(r),
            Scenario::Slot => slot(r),
            Scenario::MaxHolders => max_holders(r),
        }
    }
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The scenario of each round: every block of `kinds.len()` rounds runs each once, in an order
/// drawn from the seed — random, but even a short run covers every kind.
pub fn schedule(kinds: &[Scenario], rounds: usize, rng: &mut impl Rng) -> Vec<Scenario> {
    let mut out = Vec::with_capacity(rounds);
    while out.len() < rounds {
        let mut block = kinds.to_vec();
        block.shuffle(rng);
        out.extend(block);
    }
    out.truncate(rounds);
    out
}

/// How long a contender waits for its turn when it should get one.
const LONG_WAIT_MS: u64 = 60_000;
/// How long the harness waits for a command to start, or a waiter to join, before it goes on.
const PATIENCE: f64 = 30.0;

/// A short command (a waiter's, a step's).
fn short(r: &mut Round, lo: u64, hi: u64) -> ChildSpec {
    let rng = r.rng();
    ChildSpec {
        sleep_ms: rng.random_range(lo..=hi),
        gate: None,
        ignore_term: rng.random_bool(0.5),
        exit_code: if rng.random_bool(0.5) { 0 } else { 3 },
        yes: false,
    }
}

/// The victim's command: works until its gate opens (at most `max_ms`), ignores SIGTERM with
/// probability `ignore`, and ends in `yes` under the broken-stdout fault.
fn gated(r: &mut Round, name: &str, max_ms: u64, ignore: f64) -> ChildSpec {
    let gate = r.gate(name);
    let fault = r.fault;
    let rng = r.rng();
    ChildSpec {
        sleep_ms: max_ms,
        gate: Some(gate),
        ignore_term: rng.random_bool(ignore),
        exit_code: if rng.random_bool(0.5) { 0 } else { 3 },
        yes: fault == Fault::StdoutPipe,
    }
}

/// The fault's pipes go to the victim.
fn with_pipes(mut s: Spec, fault: Fault) -> Spec {
    s.stderr_pipe = fault == Fault::StderrPipe;
    s.stdout_pipe = fault == Fault::StdoutPipe;
    s
}

/// A uniform draw in seconds.
fn secs(r: &mut Round, lo: f64, hi: f64) -> f64 {
    r.rng().random_range(lo..hi)
}

/// Waits until the victim `v` has exited or every other contender has (they wait for it), at
/// most `patience` seconds, then opens its gate: a command still working then ends on its own.
/// Never earlier — a command that ignores SIGTERM must be seen through its whole grace.
fn release_victim(r: &mut Round, v: usize, gate: &std::path::Path, patience: f64) {
    let until = crate::procs::now() + patience;
    r.wait_until(until, |r| {
        r.exited(v)
            || r.cs
                .iter()
                .enumerate()
                .all(|(i, c)| i == v || c.exit.is_some())
    });
    r.open_gate(gate);
}

/// A holder and one waiter; the fault hits the holder at a random moment of its command. In
/// some rounds the holder's lease is 3 × TTL (the exit bounds hold for any TTL), and the
/// waiter's `--wait` is a short DUR whose bound is checked: it joins the queue before the fault,
/// so a silence meets it on an established connection. In half the rounds a caller without
/// `--wait` comes as the fault strikes.
fn plain(r: &mut Round) {
    let fault = r.fault;
    let ttl = if r.rng().random_bool(0.3) {
        3 * r.ttl_ms()
    } else {
        r.ttl_ms()
    };
    // (Not under SIGSTOP: that fault waits for another command to start, which a waiter that
    // gave up never does.)
    let bounded = r.rng().random_bool(0.4) && fault != Fault::SigStop;
    // A command that outlives the silence, so that its holder surely loses its lease to it.
    let long = bounded || (fault.silences_db() && r.rng().random_bool(0.5));
    let sleep_ms = if long {
        ttl + 3500
    } else {
        r.rng().random_range(250..=700)
    };
    let mut child = short(r, sleep_ms, sleep_ms);
    child.yes = fault == Fault::StdoutPipe;
    r.variant = format!(
        "ttl {}s{}",
        ttl as f64 / 1e3,
        if bounded { ", --wait=DUR waiter" } else { "" }
    );
    let a = r.spawn(with_pipes(
        Spec::run("a", ttl, child).wait(LONG_WAIT_MS),
        fault,
    ));
    if !r.wait_started(a, PATIENCE) {
        return;
    }
    let wait_ms = if bounded {
        r.rng().random_range(1000..=2500)
    } else {
        LONG_WAIT_MS
    };
    let mut b = Spec::run("b", ttl, short(r, 50, 250)).wait(wait_ms);
    b.wait_bound = bounded;
    let b = r.spawn(b);
    let delay = if bounded {
        r.wait_joined(b, PATIENCE);
        secs(r, 0.0, 0.4)
    } else {
        secs(r, 0.0, sleep_ms as f64 / 1e3 * 0.9)
    };
    r.pause(delay);
    r.inject(a);
    // A caller without `--wait`, arriving as the fault strikes: it starts its command's watchdog
    // while its first acquisition is answered (or goes unanswered), and the busy answer, a
    // database that stopped answering or a lease it did get must all leave no watchdog behind.
    if r.rng().random_bool(0.5) {
        let child = short(r, 50, 250);
        r.variant.push_str(", a caller without --wait");
        r.spawn(Spec::run("c", ttl, child));
    }
}

/// A long-lived holder (TTL 4 × TTL, grace 2 × TTL, ignoring SIGTERM in most rounds) is taken
/// by `--replace` with a short TTL, while a waiter queues behind; once it holds the lease the
/// replacer is left alone, killed with -9, SIGSTOPped past its TTL, or replaced by a second
/// `--replace`. Nobody's command may start while the original's still runs (its grace
/// included): not the waiter once the replacer's short lease ran out, nor the second replacer.
fn replace(r: &mut Round) {
    let fault = r.fault;
    let t = r.ttl_ms();
    let long = 4 * t;
    let child = gated(r, "a", 20_000, 0.75);
    let gate = child.gate.clone().unwrap();
    let a = r.spawn(with_pipes(
        Spec::long_run("a", long, child).wait(LONG_WAIT_MS),
        fault,
    ));
    if !r.wait_started(a, PATIENCE) {
        r.open_gate(&gate);
        return;
    }
    let c = short(r, 100, 300);
    let w = r.spawn(Spec::run("w", t, c).wait(LONG_WAIT_MS));
    r.wait_joined(w, PATIENCE);
    let variant = [
        "replacer",
        "kill9-replacer",
        "sigstop-replacer",
        "two-replacers",
    ][r.rng().random_range(0..4)];
    // SIGSTOP first: after the replacer the victim is soon gone (stopped) and the fault would
    // miss it; stopped first, it lasts until the waiter starts, after the victim's TTL.
    let fault_first = r.rng().random_bool(0.5) || fault == Fault::SigStop;
    r.variant = format!(
        "{variant}, fault {}",
        if fault_first { "first" } else { "after" }
    );
    let d = secs(r, 0.0, 0.3);
    r.pause(d);
    if fault_first {
        r.inject(a);
    }
    let mut s = Spec::run("r1", t, short(r, 100, 300));
    s.replace = true;
    let r1 = r.spawn(s);
    // What happens to the replacer happens once it holds the lease (it waits for the old
    // holder's stop then, unless the fault got there first).
    if variant != "replacer" {
        r.wait_holding(r1, PATIENCE);
    }
    match variant {
        "kill9-replacer" => {
            let d = secs(r, 0.0, 0.3);
            r.pause(d);
            r.kill9(r1);
        }
        "sigstop-replacer" => {
            let d = secs(r, 0.0, 0.3);
            r.pause(d);
            let at = r.sigstop(r1);
            let d = secs(r, t as f64 / 1e3 + 0.3, 2.0 * t as f64 / 1e3 + 0.3);
            r.pause(d);
            r.sigcont(r1, at);
        }
        "two-replacers" => {
            let d = secs(r, 0.0, 0.3);
            r.pause(d);
            let mut s = Spec::run("r2", t, short(r, 100, 300));
            s.replace = true;
            r.spawn(s);
        }
        _ => {}
    }
    if !fault_first {
        let d = secs(r, 0.0, 0.5);
        r.pause(d);
        r.inject(a);
    }
    release_victim(r, a, &gate, long as f64 / 1e3 + 3.0);
}

/// A long-lived holder — a run, or a step of an acquired lease — with one or two waiters queued,
/// broken by `release --force` (which waits for its stop, or with `--no-wait`). The waiters'
/// commands may start only once the old command has stopped (its grace included) or its lease
/// would have expired.
fn force(r: &mut Round) {
    let fault = r.fault;
    let t = r.ttl_ms();
    let long = 4 * t;
    let step = r.rng().random_bool(0.5);
    let no_wait = r.rng().random_bool(0.3);
    // SIGSTOP first, as in `replace`.
    let fault_first = r.rng().random_bool(0.5) || fault == Fault::SigStop;
    r.variant = format!(
        "{}{}, fault {}",
        if step {
            "during a step"
        } else {
            "during a run"
        },
        if no_wait { ", --no-wait" } else { "" },
        if fault_first { "first" } else { "after" }
    );
    let child = gated(r, "a", 20_000, 0.75);
    let gate = child.gate.clone().unwrap();
    let spec = if step {
        let acq = r.spawn(Spec::acquire("acq", long));
        r.wait_exit(acq, PATIENCE);
        let Some(token) = r.printed_token(acq) else {
            return;
        };
        Spec::step("a", &token, long, child)
    } else {
        Spec::long_run("a", long, child).wait(LONG_WAIT_MS)
    };
    let a = r.spawn(with_pipes(spec, fault));
    if !r.wait_started(a, PATIENCE) {
        r.open_gate(&gate);
        return;
    }
    let waiters = r.rng().random_range(1..=2);
    for k in 0..waiters {
        let c = short(r, 100, 300);
        let w = r.spawn(Spec::run(&format!("w{k}"), t, c).wait(LONG_WAIT_MS));
        r.wait_joined(w, PATIENCE);
    }
    let d = secs(r, 0.0, 0.3);
    r.pause(d);
    if fault_first {
        r.inject(a);
    }
    r.spawn(Spec::release_force("rel", no_wait));
    if !fault_first {
        let d = secs(r, 0.0, 0.4);
        r.pause(d);
        r.inject(a);
    }
    release_victim(r, a, &gate, long as f64 / 1e3 + 3.0);
}

/// A lease across steps: `acquire`, a waiter queued for the lease, step 1 (the victim) and —
/// in most rounds — a second step while it runs (with `--wait` when the binary takes it), then
/// `renew`, step 3, and `release --token` (sometimes while step 3 runs, sometimes never: the
/// lease then expires). Two steps of one lease never run at once, a stale token never acts, and
/// the waiter's command never overlaps a step's.
fn steps(r: &mut Round) {
    let fault = r.fault;
    let t = r.ttl_ms();
    let ttl = if r.rng().random_bool(0.5) { 2 * t } else { t };
    let second = ["concurrent", "concurrent --wait", "none"][r.rng().random_range(0..3)];
    let second = if second == "concurrent --wait" && !r.ctx.caps.step_wait {
        "concurrent"
    } else {
        second
    };
    let end = ["release", "release during step 3", "expire"][r.rng().random_range(0..3)];
    r.variant = format!("ttl {}s, {second} step 2, {end}", ttl as f64 / 1e3);
    let acq = r.spawn(Spec::acquire("acq", ttl));
    r.wait_exit(acq, PATIENCE);
    let Some(token) = r.printed_token(acq) else {
        return;
    };
    // Under SIGSTOP there must be someone to take over (that fault lasts until one does).
    if r.rng().random_bool(0.6) || fault == Fault::SigStop {
        let c = short(r, 100, 300);
        let w = r.spawn(Spec::run("w", t, c).wait(LONG_WAIT_MS));
        r.wait_joined(w, PATIENCE);
    }
    let mut c1 = short(r, 600, 1200);
    c1.yes = fault == Fault::StdoutPipe;
    let work = c1.sleep_ms as f64 / 1e3;
    let s1 = r.spawn(with_pipes(Spec::step("step1", &token, ttl, c1), fault));
    if !r.wait_started(s1, PATIENCE) {
        return;
    }
    let mut s2 = None;
    if second != "none" {
        let d = secs(r, 0.1, 0.4);
        r.pause(d);
        let mut s = Spec::step("step2", &token, ttl, short(r, 100, 300));
        if second == "concurrent --wait" {
            s = s.wait(10_000);
        }
        s2 = Some(r.spawn(s));
    }
    let d = secs(r, 0.0, work * 0.9);
    r.pause(d);
    r.inject(s1);
    let patience = 10.0 + 4.0 * ttl as f64 / 1e3;
    r.wait_exit(s1, patience);
    if let Some(s2) = s2 {
        r.wait_exit(s2, patience);
    }
    if r.rng().random_bool(0.7) {
        let n = r.spawn(Spec::renew("renew", &token, ttl));
        r.wait_exit(n, patience);
    }
    let c3 = if end == "release during step 3" {
        short(r, 800, 1200)
    } else {
        short(r, 100, 300)
    };
    let s3 = r.spawn(Spec::step("step3", &token, ttl, c3));
    if end == "release during step 3" {
        r.wait_started(s3, PATIENCE);
        let d = secs(r, 0.1, 0.3);
        r.pause(d);
        let rel = r.spawn(Spec::release_token("rel", &token));
        r.wait_exit(rel, patience);
    }
    r.wait_exit(s3, patience);
    if end == "release" {
        let rel = r.spawn(Spec::release_token("rel", &token));
        r.wait_exit(rel, patience);
    }
}

/// A holder, and three or four waiters that join one at a time (each is listed in the queue
/// before the next starts): `--queue fifo` in most rounds — they must then start in that order,
/// across the fault — or `--queue latest`, where each supersedes the ones before. In some rounds
/// a waiter is killed with -9 or stopped for a while (it then has no place to keep).
fn queue(r: &mut Round) {
    let fault = r.fault;
    let t = r.ttl_ms();
    let mode = if r.rng().random_bool(0.25) {
        "latest"
    } else {
        "fifo"
    };
    let n = r.rng().random_range(3..=4);
    let disturb = match r.rng().random_range(0..10) {
        0..=1 => "kill9 the last waiter",
        2 => "kill9 a waiter",
        3 => "sigstop a waiter",
        _ => "",
    };
    let gate_first = r.rng().random_bool(0.5);
    r.variant = format!(
        "{n} {mode} waiters{}{}, {}",
        if disturb.is_empty() { "" } else { ", " },
        disturb,
        if gate_first {
            "holder done, then fault"
        } else {
            "fault, then holder done"
        }
    );
    let child = gated(r, "a", 15_000, 0.5);
    let gate = child.gate.clone().unwrap();
    let a = r.spawn(with_pipes(
        Spec::run("a", t, child).wait(LONG_WAIT_MS),
        fault,
    ));
    if !r.wait_started(a, PATIENCE) {
        r.open_gate(&gate);
        return;
    }
    let mut ws = Vec::new();
    for k in 0..n {
        let c = short(r, 80, 200);
        let mut s = Spec::run(&format!("w{k}"), t, c).wait(LONG_WAIT_MS);
        s.queue = Some(mode);
        let w = r.spawn(s);
        r.wait_joined(w, PATIENCE);
        ws.push(w);
    }
    match disturb {
        "kill9 the last waiter" => r.kill9(ws[n - 1]),
        "kill9 a waiter" => {
            let k = r.rng().random_range(0..n);
            r.kill9(ws[k]);
        }
        "sigstop a waiter" => {
            let k = r.rng().random_range(0..n);
            let at = r.sigstop(ws[k]);
            let d = secs(r, 0.5, 1.5);
            r.pause(d);
            r.sigcont(ws[k], at);
        }
        _ => {}
    }
    let d = secs(r, 0.0, 0.3);
    r.pause(d);
    if gate_first {
        r.open_gate(&gate);
        let d = secs(r, 0.0, 0.3);
        r.pause(d);
        r.inject(a);
    } else {
        r.inject(a);
        let d = secs(r, 0.0, 0.3);
        r.pause(d);
        r.open_gate(&gate);
    }
}

/// `--slot` contenders of one slot on hosts whose clocks are off by minutes (libfaketime): the
/// first runs the slot (the victim); two or three more arrive while it runs — they must record
/// `skipped` and exit 0 at once (one in three waits with `--wait` instead) — and one after it.
fn slot(r: &mut Round) {
    let fault = r.fault;
    let t = r.ttl_ms();
    let faketime = r.ctx.caps.faketime;
    // SIGSTOP lasts until another command starts: a contender that waits must exist by then.
    let fault_late = r.rng().random_bool(0.7) || fault == Fault::SigStop;
    r.variant = format!(
        "fault {}{}",
        if fault_late {
            "after the contenders"
        } else {
            "before them"
        },
        if faketime { "" } else { ", no libfaketime" }
    );
    let child = gated(r, "s0", 10_000, 0.5);
    let gate = child.gate.clone().unwrap();
    let mut s = Spec::run("s0", t, child).wait(LONG_WAIT_MS);
    s.slot = true;
    s.faketime = clock(r, faketime);
    let s0 = r.spawn(with_pipes(s, fault));
    if !r.wait_started(s0, PATIENCE) {
        r.open_gate(&gate);
        return;
    }
    if !fault_late {
        let d = secs(r, 0.0, 0.3);
        r.pause(d);
        r.inject(s0);
    }
    let k = r.rng().random_range(2..=3);
    for i in 1..=k {
        let mut s = Spec::run(&format!("s{i}"), t, short(r, 100, 300));
        s.slot = true;
        s.faketime = clock(r, faketime);
        if r.rng().random_bool(0.33) || (i == k && fault == Fault::SigStop) {
            s = s.wait(LONG_WAIT_MS);
            r.spawn(s);
        } else {
            let c = r.spawn(s);
            r.wait_exit(c, 10.0 + 4.0 * t as f64 / 1e3);
        }
    }
    if fault_late {
        let d = secs(r, 0.0, 0.3);
        r.pause(d);
        r.inject(s0);
    }
    let d = secs(r, 0.0, 0.3);
    r.pause(d);
    r.open_gate(&gate);
    r.wait_exit(s0, 10.0 + 4.0 * t as f64 / 1e3);
    let mut s = Spec::run("late", t, short(r, 100, 300));
    s.slot = true;
    s.faketime = clock(r, faketime);
    r.spawn(s);
}

/// A host clock off by up to five minutes either way (libfaketime's `FAKETIME`), or none.
fn clock(r: &mut Round, faketime: bool) -> Option<String> {
    if !faketime {
        return None;
    }
    let offsets = ["+0", "+150", "-150", "+300", "-300", "+75", "-75"];
    Some(offsets[r.rng().random_range(0..offsets.len())].to_owned())
}

/// `--max-holders N` (2 or 3) with one or two contenders more than places, all waiting; the
/// fault hits the first holder. Never more than N commands at once.
fn max_holders(r: &mut Round) {
    let fault = r.fault;
    let t = r.ttl_ms();
    let n: u32 = r.rng().random_range(2..=3);
    let count = n + r.rng().random_range(1..=2);
    r.max_holders = Some(n);
    r.variant = format!("N = {n}, {count} contenders");
    let mut first = None;
    let mut victim_work = 0.0;
    for k in 0..count {
        let mut c = short(r, 300, 900);
        let mut s;
        if k == 0 {
            c.yes = fault == Fault::StdoutPipe;
            victim_work = c.sleep_ms as f64 / 1e3;
            s = with_pipes(Spec::run("h0", t, c), fault);
        } else {
            s = Spec::run(&format!("h{k}"), t, c);
        }
        s = s.wait(LONG_WAIT_MS);
        s.max_holders = Some(n);
        let i = r.spawn(s);
        if k == 0 {
            first = Some(i);
            if !r.wait_started(i, PATIENCE) {
                return;
            }
        }
    }
    let v = first.unwrap();
    let d = secs(r, 0.0, victim_work * 0.9);
    r.pause(d);
    r.inject(v);
}
