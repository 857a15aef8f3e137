//! The invariants, checked after every round against what the monitor saw, what the children
//! logged and what the database recorded (see `db.rs` for the instrumentation).
//!
//! Every check is one-sided on purpose: a violation needs proof (a process seen alive at a time
//! it must have been dead, a row that must not exist), so noise from polling or a loaded machine
//! can hide a short violation but never invent one.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::faults::Inv;
use crate::round::{slot_of, Contender, Kind, Outcome, LEFTOVER_SLACK, SLOT_PERIOD};
use crate::scenario::Scenario;
use crate::Ctx;

/// How long a waiter's first connection may take, however short its `--wait` (leasectl's
/// `FIRST_CONNECT`, in src/run/prepare.rs).
const FIRST_CONNECT_S: f64 = 2.0;

/// What the harness remembers about a target across rounds.
#[derive(Default)]
pub struct TargetState {
    /// Highest fence granted so far (I5 across rounds and restarts).
    pub max_fence: i64,
    /// Values the register accepted: a value accepted twice is a lost update.
    pub register: HashSet<i64>,
}

/// One command's process tree, from its log lines and the monitor's watches.
struct Tree {
    id: String,
    fence: i64,
    token: String,
    start: f64,
    last_alive: f64,
}

/// Outcomes recorded for a holder that lost its lease (kept for the operator, never a result)
/// or for a caller whose slot was done: not a result of the lease.
fn not_a_result(outcome: Option<&str>) -> bool {
    matches!(outcome, Some("lost" | "preempted" | "skipped"))
}

fn f64_of(v: &Option<String>) -> f64 {
    v.as_deref().and_then(|s| s.parse().ok()).unwrap_or(0.0)
}

fn i64_of(v: &Option<String>) -> i64 {
    v.as_deref().and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// A pid of the round as the messages name it: its contender's id.
fn who(o: &Outcome, pid: i64) -> String {
    o.contenders
        .iter()
        .find(|c| c.pid as i64 == pid)
        .map_or(format!("pid {pid}"), |c| c.id.clone())
}

pub fn check(ctx: &mut Ctx, o: &Outcome) -> Vec<(Inv, String)> {
    let mut v: Vec<(Inv, String)> = Vec::new();
    let t = &o.target;
    let schema = ctx.schema.clone();
    let resume_slack = ctx.cfg.resume_slack();
    let stopped: HashMap<&str, (f64, f64)> = o
        .contenders
        .iter()
        .filter_map(|c| c.stopped.map(|s| (c.id.as_str(), s)))
        .collect();
    let steps = o.contenders.iter().any(|c| c.kind == Kind::Step);

    // The trees, with the last moment anything of each was certainly alive.
    let mut trees: Vec<Tree> = o
        .observed
        .lines
        .iter()
        .filter(|l| l.kind == "start")
        .map(|l| Tree {
            id: l.id.clone(),
            fence: l.fence,
            token: l.extra.clone(),
            start: l.ts,
            last_alive: l.ts,
        })
        .collect();
    for tr in &mut trees {
        for l in o.observed.lines.iter().filter(|l| l.id == tr.id) {
            tr.last_alive = tr.last_alive.max(l.ts);
        }
        for w in o.observed.watches.values().filter(|w| w.id == tr.id) {
            tr.last_alive = tr.last_alive.max(w.last_alive);
        }
    }
    // Alive at `at` beyond what a SIGSTOPped supervisor excuses (its command may run while it is
    // stopped, and for the slack after SIGCONT).
    let excused = |tr: &Tree, at: f64| match stopped.get(tr.id.as_str()) {
        Some(&(_, cont)) => at <= cont + resume_slack,
        None => false,
    };

    // I1: commands of one target never overlap — of different leases, nor two steps of one
    // lease — or, with --max-holders N, never more than N at once.
    match o.max_holders {
        None => {
            for x in &trees {
                for y in trees.iter().filter(|y| y.id != x.id && y.start >= x.start) {
                    if x.last_alive <= y.start {
                        continue;
                    }
                    let what = if x.fence == y.fence {
                        "two steps of one lease"
                    } else {
                        "two leases"
                    };
                    match stopped.get(x.id.as_str()) {
                        Some(&(_, cont)) if x.last_alive <= cont + resume_slack => {}
                        Some(&(_, cont)) => v.push((Inv::I1, format!(
                            "{} (fence {}) still ran {:.0} ms after its supervisor was resumed, alongside {} (fence {})",
                            x.id, x.fence, (x.last_alive - cont) * 1e3, y.id, y.fence))),
                        None => v.push((Inv::I1, format!(
                            "{} (fence {}) was alive {:.0} ms after {} (fence {}) started ({what} at once)",
                            x.id, x.fence, (x.last_alive - y.start) * 1e3, y.id, y.fence))),
                    }
                }
            }
        }
        Some(n) => {
            for y in &trees {
                let alive: Vec<&Tree> = trees
                    .iter()
                    .filter(|x| x.start <= y.start && x.last_alive > y.start)
                    .filter(|x| !excused(x, x.last_alive))
                    .collect();
                if alive.len() > n as usize {
                    let names: Vec<String> = alive
                        .iter()
                        .map(|x| format!("{} (fence {})", x.id, x.fence))
                        .collect();
                    v.push((
                        Inv::I1,
                        format!(
                            "{} commands ran at once with --max-holders {n} when {} started: {}",
                            alive.len(),
                            y.id,
                            names.join(", ")
                        ),
                    ));
                }
            }
        }
    }
    let state = ctx.targets.entry(t.clone()).or_default();
    // The register is a single-writer counter: with several holders at once, or while a
    // supervisor is stopped (documented), a lost update is no violation.
    let register_checked = o.max_holders.is_none() && stopped.is_empty();
    for l in o
        .observed
        .lines
        .iter()
        .filter(|l| l.kind == "write" && l.extra != "-")
    {
        let Ok(value) = l.extra.parse::<i64>() else {
            continue;
        };
        if !state.register.insert(value) && register_checked {
            v.push((Inv::I1, format!(
                "lost update: {} (fence {}) wrote register value {value}, which an earlier holder had already written",
                l.id, l.fence)));
        }
    }
    let prev_max = state.max_fence;

    // The database's record of this round.
    let leases = ctx.bench.db.query(&format!(
        "SELECT id, place, token, fence, extract(epoch FROM heartbeat_at), ttl_ms, holder_pid,
                extract(epoch FROM at)
           FROM chaos.lease_log WHERE id > {} AND target = '{t}' ORDER BY id",
        ctx.lease_log_mark
    ));
    // Each place's row as the rounds before left it, where it was still held: a holder they
    // killed leaves its lease held until its TTL runs out, and this round may still write to that
    // version without acquiring it (a waiter's place in the queue is recorded on the row).
    let left_held = ctx.bench.db.query(&format!(
        "SELECT place, fence, token FROM (
             SELECT DISTINCT ON (place) place, fence, token
               FROM chaos.lease_log WHERE id <= {} AND target = '{t}' ORDER BY place, id DESC) x
          WHERE token IS NOT NULL",
        ctx.lease_log_mark
    ));
    let runs = ctx.bench.db.query(&format!(
        "SELECT id, run_id, fence, token, outcome, pid, lease_fence, lease_token, exit_code, signal,
                extract(epoch FROM slot)
           FROM chaos.run_log WHERE id > {} AND target = '{t}' ORDER BY id",
        ctx.run_log_mark
    ));
    // Renewals of an expired lease: a version of a place's row with the token and fence of the
    // version before it, and a heartbeat later than that version's expiry — not written by a
    // save (its transaction stored no run). Compared on the database's own timestamps.
    let revived = ctx.bench.db.query(&format!(
        "SELECT id, place, fence, holder_pid,
                round(extract(epoch FROM heartbeat_at - (phb + pttl * interval '1 millisecond')) * 1000),
                round(extract(epoch FROM heartbeat_at - phb) * 1000), pttl
           FROM (SELECT l.*, lag(token) OVER w AS ptoken, lag(fence) OVER w AS pfence,
                        lag(heartbeat_at) OVER w AS phb, lag(ttl_ms) OVER w AS pttl
                   FROM chaos.lease_log l WHERE target = '{t}'
                 WINDOW w AS (PARTITION BY place ORDER BY id)) x
          WHERE id > {} AND token IS NOT NULL AND token = ptoken AND fence = pfence
            AND heartbeat_at > phb + pttl * interval '1 millisecond'
            AND xid NOT IN (SELECT xid FROM chaos.run_log WHERE xid IS NOT NULL)
          ORDER BY id",
        ctx.lease_log_mark
    ));
    // Waiters whose place lapsed: a version of their row not renewed, deleted or left for a new
    // ticket of the same waiter within its TTL, on the database clock. Such a waiter
    // legitimately joins again at the back.
    let mark = ctx.waiter_log_mark;
    let lapsed: HashSet<i64> = ctx
        .bench
        .db
        .query(&format!(
            "SELECT DISTINCT ticket FROM (
                 SELECT ticket, pid, heartbeat_at, ttl_ms,
                        lead(at) OVER (PARTITION BY ticket ORDER BY id) AS next_at
                   FROM chaos.waiter_log WHERE target = '{t}' AND id > {mark}) x
              WHERE coalesce(next_at,
                             (SELECT min(w.at) FROM chaos.waiter_log w
                               WHERE w.target = '{t}' AND w.id > {mark} AND w.pid = x.pid
                                 AND w.ticket > x.ticket))
                    > heartbeat_at + ttl_ms * interval '1 millisecond'"
        ))
        .iter()
        .map(|r| i64_of(&r[0]))
        .collect();
    let marks = ctx.bench.db.query(
        "SELECT (SELECT coalesce(max(id), 0) FROM chaos.lease_log),
                (SELECT coalesce(max(id), 0) FROM chaos.run_log),
                (SELECT coalesce(max(id), 0) FROM chaos.waiter_log)",
    );
    ctx.lease_log_mark = i64_of(&marks[0][0]);
    ctx.run_log_mark = i64_of(&marks[0][1]);
    ctx.waiter_log_mark = i64_of(&marks[0][2]);

    // I2: results are fenced.
    for r in runs.iter().filter(|r| !not_a_result(r[4].as_deref())) {
        let (fence, lease_fence) = (i64_of(&r[2]), i64_of(&r[6]));
        if lease_fence != fence || (r[7].is_some() && r[7] != r[3]) {
            v.push((Inv::I2, format!(
                "run {} of fence {fence} ({}) was stored while its lease row was at fence {lease_fence} (token {:?})",
                r[1].as_deref().unwrap_or("?"), who(o, i64_of(&r[5])), r[7])));
        }
    }
    // One result per lease — per step for a lease across steps, whose steps share its fence.
    let per = if steps { "fence, pid" } else { "fence" };
    for r in ctx.bench.db.query(&format!(
        "SELECT {per}, count(*) FROM \"{schema}\".runs WHERE target = '{t}'
            AND outcome NOT IN ('lost', 'preempted', 'skipped') AND fence > {prev_max}
          GROUP BY {per} HAVING count(*) > 1"
    )) {
        v.push((
            Inv::I2,
            format!(
                "fence {} has {} stored results{}",
                i64_of(&r[0]),
                i64_of(&r[r.len() - 1]),
                if steps { " from one process" } else { "" }
            ),
        ));
    }
    let per = if steps {
        "payload->>'run_id'"
    } else {
        "payload->>'fence'"
    };
    for r in ctx.bench.db.query(&format!(
        "SELECT {per}, count(*) FROM \"{schema}\".outbox WHERE aggregate_id = '{t}'
            AND (payload->>'fence')::bigint > {prev_max} GROUP BY 1 HAVING count(*) > 1"
    )) {
        v.push((
            Inv::I2,
            format!(
                "{} {} has {} events",
                if steps { "run" } else { "fence" },
                r[0].as_deref().unwrap_or("?"),
                i64_of(&r[1])
            ),
        ));
    }
    for r in ctx.bench.db.query(&format!(
        "SELECT o.payload->>'run_id', o.payload->>'fence' FROM \"{schema}\".outbox o
           LEFT JOIN \"{schema}\".runs r ON r.id::text = o.payload->>'run_id'
          WHERE o.aggregate_id = '{t}' AND (o.payload->>'fence')::bigint > {prev_max}
            AND (r.id IS NULL OR r.outcome IN ('lost', 'preempted', 'skipped'))"
    )) {
        v.push((
            Inv::I2,
            format!(
                "event for run {:?} (fence {:?}) has no stored, non-lost run",
                r[0], r[1]
            ),
        ));
    }

    // The commands' own events (`$LEASECTL_EVENTS`, aggregate `<target>.job`): only a stored,
    // non-lost result brings them in, with its fence, and one result brings its command's once.
    for r in ctx.bench.db.query(&format!(
        "SELECT e.fence, e.events,
                (SELECT count(*) FROM \"{schema}\".runs r
                  WHERE r.target = '{t}' AND r.fence = e.fence
                    AND r.outcome NOT IN ('lost', 'preempted', 'skipped'))
           FROM (SELECT (o.payload->>'fence')::bigint AS fence, count(*) AS events
                   FROM \"{schema}\".outbox o
                  WHERE o.aggregate_id = '{t}.job' AND (o.payload->>'fence')::bigint > {prev_max}
                  GROUP BY 1) e"
    )) {
        let (events, results) = (i64_of(&r[1]), i64_of(&r[2]));
        if events > results {
            v.push((
                Inv::I2,
                format!(
                    "fence {} has {events} events of its command and {results} stored results",
                    r[0].as_deref().unwrap_or("?")
                ),
            ));
        }
    }

    // I3: a lease that ended by expiry (not by release) had no live tree after the expiry.
    let mut groups: BTreeMap<(i64, i64), Vec<&Vec<Option<String>>>> = BTreeMap::new();
    for r in &leases {
        groups
            .entry((i64_of(&r[1]), i64_of(&r[3])))
            .or_default()
            .push(r);
    }
    for ((_, fence), rows) in &groups {
        let held: Vec<_> = rows.iter().filter(|r| r[2].is_some()).collect();
        if held.is_empty() || rows.iter().any(|r| r[2].is_none()) {
            continue; // never held in this round, or released
        }
        let last = held
            .iter()
            .map(|r| f64_of(&r[4]) + i64_of(&r[5]) as f64 / 1e3)
            .fold(0.0, f64::max);
        for tr in trees.iter().filter(|tr| tr.fence == *fence) {
            if tr.last_alive > last && !stopped.contains_key(tr.id.as_str()) {
                v.push((Inv::I3, format!(
                    "{} (fence {fence}) was alive {:.0} ms after the database's expiry of its lease",
                    tr.id, (tr.last_alive - last) * 1e3)));
            }
        }
    }

    // I4: exit codes match what was stored.
    for c in &o.contenders {
        let Some(code) = c.code() else { continue };
        let mine: Vec<_> = runs
            .iter()
            .filter(|r| i64_of(&r[5]) == c.pid as i64)
            .collect();
        let stored = mine
            .iter()
            .filter(|r| !matches!(r[4].as_deref(), Some("lost" | "preempted")))
            .count();
        let outcomes: Vec<_> = mine
            .iter()
            .map(|r| r[4].clone().unwrap_or_default())
            .collect();
        let bad = match (c.kind, code) {
            (Kind::Run | Kind::Step, 0 | 3 | 124 | 126 | 127 | 129..=192) => stored != 1,
            (Kind::Run | Kind::Step, 76) => stored != 0,
            (Kind::Run | Kind::Step, 75) => !mine.is_empty(),
            (Kind::Run | Kind::Step, 69 | 70) => false,
            (Kind::Acquire | Kind::Renew | Kind::ReleaseToken, 0 | 75 | 76 | 69) => {
                !mine.is_empty()
            }
            (Kind::ReleaseForce, 0 | 69) => !mine.is_empty(),
            _ => {
                v.push((
                    Inv::I4,
                    format!(
                        "{} exited {code}, which {:?} never documents as an outcome here",
                        c.id, c.kind
                    ),
                ));
                false
            }
        };
        if bad {
            v.push((Inv::I4, format!(
                "{} exited {code} but the database holds {stored} stored run(s) for it ({outcomes:?})",
                c.id)));
        }
    }

    // I5: fences strictly increase with every acquisition, across rounds and restarts (per
    // place: the places of --max-holders take their fences from one counter).
    let mut acquired: HashSet<(i64, String)> = HashSet::new();
    let mut max = prev_max;
    let mut last: HashMap<i64, (i64, String)> = left_held
        .iter()
        .map(|r| (i64_of(&r[0]), (i64_of(&r[1]), r[2].clone().unwrap())))
        .collect();
    for r in leases.iter().filter(|r| r[2].is_some()) {
        let (place, fence, token) = (i64_of(&r[1]), i64_of(&r[3]), r[2].clone().unwrap());
        let prev = last.get(&place);
        if let Some((pf, _)) = prev {
            if fence < *pf {
                v.push((
                    Inv::I5,
                    format!("place {place}'s row went back from fence {pf} to {fence}"),
                ));
            }
        }
        if prev != Some(&(fence, token.clone())) {
            if fence <= max && !acquired.contains(&(fence, token.clone())) {
                v.push((
                    Inv::I5,
                    format!("an acquisition got fence {fence}, not above {max}"),
                ));
            }
            acquired.insert((fence, token.clone()));
        }
        max = max.max(fence);
        last.insert(place, (fence, token));
    }
    for tr in &trees {
        if !acquired.contains(&(tr.fence, tr.token.clone())) {
            v.push((
                Inv::I5,
                format!(
                "{} ran with fence {} / token {}, which the database never granted in this round",
                tr.id, tr.fence, tr.token),
            ));
        }
    }
    ctx.targets.get_mut(t).unwrap().max_fence = max;

    // I6: nothing outlived its leasectl — no process, and no `$LEASECTL_EVENTS` file or lock
    // (`events-<pid>-…` in the round's TMPDIR) of a leasectl that was neither killed nor hung.
    for (pid, id, cmd) in &o.leftovers {
        v.push((Inv::I6, format!(
            "pid {pid} ({cmd}) of {id} was alive more than {LEFTOVER_SLACK}s after its leasectl exited")));
    }
    for (file, c) in events_files_left(o) {
        v.push((
            Inv::I6,
            format!(
                "{file} of {} (pid {}) was left after its leasectl exited",
                c.id, c.pid
            ),
        ));
    }

    // I7: a stale token never acts.
    for r in &revived {
        v.push((Inv::I7, format!(
            "the lease at fence {} (place {}, holder {}) was renewed {} ms after it had expired on the database clock (heartbeat {} ms after the one before, ttl {} ms): a stale token acted",
            i64_of(&r[2]), i64_of(&r[1]), who(o, i64_of(&r[3])), i64_of(&r[4]), i64_of(&r[5]), i64_of(&r[6]))));
    }

    // I8: fifo waiters that were neither killed nor stopped, and whose place did not lapse,
    // start in the order they joined.
    if o.scenario == Scenario::Queue {
        let mut ws: Vec<_> = o
            .contenders
            .iter()
            .filter(|c| c.queue == Some("fifo") && c.ticket.is_some())
            .filter(|c| !c.disturbed() && !lapsed.contains(&c.ticket.unwrap()))
            .collect();
        ws.sort_by_key(|c| c.ticket);
        for (i, x) in ws.iter().enumerate() {
            for y in &ws[i + 1..] {
                let (sx, sy) = (o.observed.started(&x.id), o.observed.started(&y.id));
                match (sx, sy) {
                    (Some(sx), Some(sy)) if sy < sx => v.push((Inv::I8, format!(
                        "{} (ticket {}) started {:.0} ms before {} (ticket {}), which joined the queue first",
                        y.id, y.ticket.unwrap(), (sx - sy) * 1e3, x.id, x.ticket.unwrap()))),
                    (None, Some(_)) => v.push((Inv::I8, format!(
                        "{} (ticket {}) never ran ({}) although {} (ticket {}), behind it, did",
                        x.id, x.ticket.unwrap(), x.describe_exit(), y.id, y.ticket.unwrap()))),
                    _ => {}
                }
            }
        }
    }

    // I9: at most one result per slot; a contender that arrived while its slot's run was in
    // progress (the first holder's command ran from before it came until after it left, with
    // nothing injected meanwhile) recorded `skipped` and exited 0.
    if o.scenario == Scenario::Slot {
        let mut results: HashMap<i64, Vec<String>> = HashMap::new();
        for r in runs
            .iter()
            .filter(|r| matches!(r[4].as_deref(), Some("completed" | "timed_out")))
        {
            results
                .entry(f64_of(&r[10]) as i64)
                .or_default()
                .push(who(o, i64_of(&r[5])));
        }
        for (slot, by) in results.iter().filter(|(_, by)| by.len() > 1) {
            v.push((
                Inv::I9,
                format!(
                    "the slot at {slot} has {} results, by {}",
                    by.len(),
                    by.join(", ")
                ),
            ));
        }
        let first = o.contender(&format!("r{}-s0", o.n));
        let tree = trees.iter().find(|tr| tr.id == format!("r{}-s0", o.n));
        if let (Some(s0), Some(tree)) = (first, tree) {
            let cutoff = [o.fault_at, s0.killed, s0.stopped.map(|s| s.0)]
                .into_iter()
                .flatten()
                .fold(f64::INFINITY, f64::min);
            let ended = o.observed.ended(&s0.id).unwrap_or(f64::INFINITY);
            // The slot s0 is doing, as it decided it (by the database's clock when it checked its
            // slot, after acquiring and before starting its command): its stored run says it;
            // without one, only when its spawn and its command's start fall in one slot. Near a
            // boundary the skew moves a caller into the next slot, whose contenders then find an
            // earlier slot's run in progress — busy, rightly.
            let s0_slot = runs
                .iter()
                .find(|r| i64_of(&r[5]) == s0.pid as i64 && r[10].is_some())
                .map(|r| (f64_of(&r[10]) / SLOT_PERIOD).round() as i64)
                .or_else(|| {
                    (slot_of(s0.spawned) == slot_of(tree.start)).then(|| slot_of(tree.start))
                });
            for c in o.contenders.iter().filter(|c| {
                c.slot && c.id != s0.id && !c.waits && c.role != "late" && !c.disturbed()
            }) {
                let Some((out, _)) = c.exit else { continue };
                let in_progress = tree.start <= c.spawned
                    && out <= tree.last_alive.min(ended)
                    && out < cutoff
                    && s0_slot == Some(slot_of(c.spawned))
                    && slot_of(c.spawned) == slot_of(out);
                if !in_progress {
                    continue;
                }
                let skipped = runs
                    .iter()
                    .any(|r| i64_of(&r[5]) == c.pid as i64 && r[4].as_deref() == Some("skipped"));
                if c.code() != Some(0) || !skipped {
                    v.push((Inv::I9, format!(
                        "{} came while {}'s run of the same slot was in progress and {} ({}): expected a `skipped` run and exit 0",
                        c.id, s0.id, c.describe_exit(),
                        if skipped { "recorded skipped" } else { "recorded no skip" })));
                }
            }
        }
    }

    // H: bounded exits.
    for c in o.contenders.iter().filter(|c| c.hung) {
        v.push((
            Inv::H,
            format!(
                "{} had not exited at the round's bound and was killed",
                c.id
            ),
        ));
    }
    if let Some((start, hold)) = o.silence {
        // A holder whose command ran on an established connection when the database went
        // silent must not wait for it to answer again: its stop is due within its TTL, and
        // recording the lost run is best effort. (A holder whose command had finished by itself
        // may retry its save until the database is back: that keeps a result, not a hang.)
        for c in o
            .contenders
            .iter()
            .filter(|c| c.kind.runs_command() && !c.disturbed())
        {
            let Some(began) = o.observed.started(&c.id) else {
                continue;
            };
            let bound = c.ttl + 1.5;
            if began >= start || bound >= hold {
                continue;
            }
            if o.observed.ended(&c.id).is_some_and(|e| e < start + bound) {
                continue;
            }
            let exit = c.exit.map_or(f64::INFINITY, |(t, _)| t);
            if exit > start + bound {
                v.push((Inv::H, format!(
                    "{} (ttl {:.1}s) was running when the database went silent for {hold:.1}s and exited ({}) only {:.2}s after the silence began (bound {bound:.1}s)",
                    c.id, c.ttl, c.describe_exit(), exit - start)));
            }
        }
    }
    for c in o.contenders.iter().filter(|c| !c.disturbed()) {
        let Some(dur) = c.wait_bound else { continue };
        // However short DUR, the first connection may take 2 s (`run --help`: one attempt is
        // always made); a waiter whose connection the silence holds exits at that bound.
        let deadline = c.spawned + dur.max(FIRST_CONNECT_S) + 0.5;
        let held = leases
            .iter()
            .any(|r| i64_of(&r[6]) == c.pid as i64 && f64_of(&r[7]) <= deadline);
        let exit = c.exit.map_or(f64::INFINITY, |(t, _)| t);
        if !held && exit > deadline {
            v.push((Inv::H, format!(
                "{} (--wait={dur:.1}s) never got the lease and exited ({}) {:.2}s after it started (bound {:.1}s)",
                c.id, c.describe_exit(), exit - c.spawned, dur + 0.5)));
        }
    }
    v
}

/// The `$LEASECTL_EVENTS` files and locks in the round's TMPDIR whose leasectl exited on its own
/// (not killed by the fault or the scenario, not hung), with that contender.
fn events_files_left(o: &Outcome) -> Vec<(String, &Contender)> {
    let uid = nix::unistd::geteuid();
    let dir = o.dir.join("tmp").join(format!("leasectl-{uid}"));
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut left = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix("events-")
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        if let Some(c) = o
            .contenders
            .iter()
            .find(|c| c.pid == pid && c.exit.is_some() && c.killed.is_none() && !c.hung)
        {
            left.push((name, c));
        }
    }
    left
}
