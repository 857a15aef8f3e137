//! The invariants, checked after every round against what the monitor saw, what the children
//! logged and what the database recorded (see `db.rs` for the instrumentation).
//!
//! Every check is one-sided on purpose: a violation needs proof (a process seen alive at a time
//! it must have been dead, a row that must not exist), so noise from polling or a loaded machine
//! can hide a short violation but never invent one.

use std::collections::{HashMap, HashSet};

use crate::faults::{Fault, Inv};
use crate::round::{Outcome, LEFTOVER_SLACK};
use crate::Ctx;

/// What the harness remembers about a target across rounds.
#[derive(Default)]
pub struct TargetState {
    /// Highest fence granted so far (I5 across rounds and restarts).
    pub max_fence: i64,
    /// Values the register accepted: a value accepted twice is a lost update.
    pub register: HashSet<i64>,
}

/// One child's process tree, from its log lines and the monitor's watches.
struct Tree {
    id: String,
    fence: i64,
    token: String,
    start: f64,
    last_alive: f64,
}

/// Outcomes recorded for a holder that lost its lease: kept for the operator, never a result.
fn not_a_result(outcome: Option<&str>) -> bool {
    matches!(outcome, Some("lost" | "preempted"))
}

fn f64_of(v: &Option<String>) -> f64 {
    v.as_deref().and_then(|s| s.parse().ok()).unwrap_or(0.0)
}

fn i64_of(v: &Option<String>) -> i64 {
    v.as_deref().and_then(|s| s.parse().ok()).unwrap_or(0)
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

    // I1: no overlap between the trees of different fences.
    for x in &trees {
        for y in trees.iter().filter(|y| y.fence > x.fence) {
            if x.last_alive <= y.start {
                continue;
            }
            match stopped.get(x.id.as_str()) {
                Some(&(_, cont)) if x.last_alive <= cont + resume_slack => {}
                Some(&(_, cont)) => v.push((Inv::I1, format!(
                    "{} (fence {}) still ran {:.0} ms after its supervisor was resumed, alongside {} (fence {})",
                    x.id, x.fence, (x.last_alive - cont) * 1e3, y.id, y.fence))),
                None => v.push((Inv::I1, format!(
                    "{} (fence {}) was alive {:.0} ms after {} (fence {}) started",
                    x.id, x.fence, (x.last_alive - y.start) * 1e3, y.id, y.fence))),
            }
        }
    }
    let state = ctx.targets.entry(t.clone()).or_default();
    for l in o
        .observed
        .lines
        .iter()
        .filter(|l| l.kind == "write" && l.extra != "-")
    {
        let Ok(value) = l.extra.parse::<i64>() else {
            continue;
        };
        if !state.register.insert(value) && o.fault != Fault::SigStop {
            v.push((Inv::I1, format!(
                "lost update: {} (fence {}) wrote register value {value}, which an earlier holder had already written",
                l.id, l.fence)));
        }
    }
    let prev_max = state.max_fence;

    // The database's record of this round.
    let leases = ctx.db.query(&format!(
        "SELECT id, token, fence, extract(epoch FROM heartbeat_at), ttl_ms FROM chaos.lease_log
          WHERE id > {} AND target = '{t}' ORDER BY id",
        ctx.lease_log_mark
    ));
    let runs = ctx.db.query(&format!(
        "SELECT id, run_id, fence, token, outcome, pid, lease_fence, lease_token, exit_code, signal
           FROM chaos.run_log WHERE id > {} AND target = '{t}' ORDER BY id",
        ctx.run_log_mark
    ));
    let marks = ctx.db.query(
        "SELECT (SELECT coalesce(max(id), 0) FROM chaos.lease_log), (SELECT coalesce(max(id), 0) FROM chaos.run_log)",
    );
    ctx.lease_log_mark = i64_of(&marks[0][0]);
    ctx.run_log_mark = i64_of(&marks[0][1]);

    // I2: results are fenced.
    for r in runs.iter().filter(|r| !not_a_result(r[4].as_deref())) {
        let (fence, lease_fence) = (i64_of(&r[2]), i64_of(&r[6]));
        if lease_fence != fence || (r[7].is_some() && r[7] != r[3]) {
            v.push((Inv::I2, format!(
                "run {} of fence {fence} was stored while the lease was at fence {lease_fence} (token {:?})",
                r[1].as_deref().unwrap_or("?"), r[7])));
        }
    }
    for r in ctx.db.query(&format!(
        "SELECT fence, count(*) FROM \"{schema}\".runs WHERE target = '{t}' AND outcome NOT IN ('lost', 'preempted')
            AND fence > {prev_max} GROUP BY fence HAVING count(*) > 1"
    )) {
        v.push((
            Inv::I2,
            format!(
                "fence {} has {} stored results",
                i64_of(&r[0]),
                i64_of(&r[1])
            ),
        ));
    }
    for r in ctx.db.query(&format!(
        "SELECT payload->>'fence', count(*) FROM \"{schema}\".outbox WHERE aggregate_id = '{t}'
            AND (payload->>'fence')::bigint > {prev_max} GROUP BY 1 HAVING count(*) > 1"
    )) {
        v.push((
            Inv::I2,
            format!("fence {} has {} events", i64_of(&r[0]), i64_of(&r[1])),
        ));
    }
    for r in ctx.db.query(&format!(
        "SELECT o.payload->>'run_id', o.payload->>'fence' FROM \"{schema}\".outbox o
           LEFT JOIN \"{schema}\".runs r ON r.id::text = o.payload->>'run_id'
          WHERE o.aggregate_id = '{t}' AND (o.payload->>'fence')::bigint > {prev_max}
            AND (r.id IS NULL OR r.outcome IN ('lost', 'preempted'))"
    )) {
        v.push((
            Inv::I2,
            format!(
                "event for run {:?} (fence {:?}) has no stored, non-lost run",
                r[0], r[1]
            ),
        ));
    }

    // I3: a lease that ended by expiry (not by release) had no live tree after the expiry.
    let mut acquired: HashSet<(i64, String)> = HashSet::new();
    let mut fences: Vec<i64> = leases.iter().map(|r| i64_of(&r[2])).collect();
    fences.dedup();
    for fence in fences {
        let rows: Vec<_> = leases.iter().filter(|r| i64_of(&r[2]) == fence).collect();
        if rows.iter().any(|r| r[1].is_none()) {
            continue; // released
        }
        let Some(last) = rows
            .iter()
            .map(|r| f64_of(&r[3]) + i64_of(&r[4]) as f64 / 1e3)
            .reduce(f64::max)
        else {
            continue;
        };
        for tr in trees.iter().filter(|tr| tr.fence == fence) {
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
            .filter(|r| !not_a_result(r[4].as_deref()))
            .count();
        let outcomes: Vec<_> = mine
            .iter()
            .map(|r| r[4].clone().unwrap_or_default())
            .collect();
        let bad = match code {
            0 | 3 | 124 | 126 | 127 | 129..=192 => stored != 1,
            76 => stored != 0,
            75 => !mine.is_empty(),
            69 | 70 => false,
            _ => {
                v.push((
                    Inv::I4,
                    format!("{} exited {code}, which `run` never documents", c.id),
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

    // I5: fences strictly increase with every acquisition, across rounds and restarts.
    let mut max = prev_max;
    let mut prev_token: Option<String> = None;
    for r in &leases {
        let fence = i64_of(&r[2]);
        if fence < max {
            v.push((
                Inv::I5,
                format!("the lease row went back from fence {max} to {fence}"),
            ));
        }
        if r[1].is_some() && r[1] != prev_token {
            if fence <= max {
                v.push((
                    Inv::I5,
                    format!("an acquisition got fence {fence}, not above {max}"),
                ));
            }
            acquired.insert((fence, r[1].clone().unwrap()));
        }
        max = max.max(fence);
        prev_token = r[1].clone();
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

    // I6: nothing outlived its leasectl.
    for (pid, id, cmd) in &o.leftovers {
        v.push((Inv::I6, format!(
            "pid {pid} ({cmd}) of {id} was alive more than {LEFTOVER_SLACK}s after its leasectl exited")));
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
    if let (Some((start, hold)), Some(a)) = (o.silence, o.contenders.first()) {
        // A holder that lost its lease to a silent database (exit 76) must not wait for the
        // database to answer again before exiting: its stop is due within the TTL, and recording
        // the lost run is best effort. (A holder whose command had finished may retry its save
        // until the database is back: that keeps a result and is not a hang.)
        let bound = ctx.cfg.ttl_ms as f64 / 1e3 + 1.5;
        // Its command finished by itself (it logged its end) before the silence was over.
        let finished = o
            .observed
            .lines
            .iter()
            .any(|l| l.kind == "end" && l.id == a.id);
        if let Some((exit, _)) = a.exit {
            if a.code() == Some(76) && !finished && exit > start + bound && bound < hold && !a.hung
            {
                v.push((Inv::H, format!(
                    "{} lost its database for {hold:.1}s and exited only {:.1}s after the silence began (bound {bound:.1}s)",
                    a.id, exit - start)));
            }
        }
    }
    v
}
