//! The relay rounds' invariants (see `relay_faults::RInv`), checked after every round against
//! what the consumer received (in arrival order), what the ledger says committed, and how every
//! relay process ended.
//!
//! As in the run rounds, a violation needs proof — a delivery that must not exist, an arrival
//! order that cannot be, a process that was still running at its bound — so a slow machine can
//! hide a violation but never invent one. The one judgement call is the documented window of
//! the O invariant, stated where it is applied.

use std::collections::{HashMap, HashSet};

use crate::relay::RelayBounds;
use crate::relay_faults::RInv;
use crate::relay_round::Outcome;

#[derive(Debug, Default, Clone, Copy)]
pub struct Figures {
    pub committed: usize,
    pub deliveries: usize,
    /// Deliveries of an event that had arrived before.
    pub copies: usize,
    /// Copies that arrived late because their relay had abandoned the request
    /// ([`crate::relay_sinks::Arrival::late`]): left out of the order.
    pub late: usize,
    /// O violations inside the documented window of an abruptly ended session.
    pub excused: usize,
}

pub fn check(b: &RelayBounds, o: &Outcome) -> (Vec<(RInv, String)>, Figures) {
    let mut v: Vec<(RInv, String)> = Vec::new();
    let t0 = o.started;
    let rel = |t: f64| t - t0;
    let mut fig = Figures {
        committed: o.committed.len(),
        deliveries: o.arrivals.len(),
        ..Figures::default()
    };

    // Each committed event's place in its aggregate's order: by seq (insert order), or by
    // (xid, seq) for --order commit.
    let mut by_agg: HashMap<&str, Vec<&crate::relay_round::Committed>> = HashMap::new();
    for c in &o.committed {
        by_agg.entry(c.agg.as_str()).or_default().push(c);
    }
    let mut rank: HashMap<&str, (&str, usize)> = HashMap::new();
    for (agg, events) in by_agg.iter_mut() {
        if o.plan.commit_order {
            events.sort_by_key(|c| (c.xid, c.seq));
        } else {
            events.sort_by_key(|c| c.seq);
        }
        for (i, c) in events.iter().enumerate() {
            rank.insert(c.id.as_str(), (agg, i + 1));
        }
    }

    // R: nothing that did not commit reaches the sink.
    let mut foreign = Vec::new();
    for a in &o.arrivals {
        match rank.get(a.id.as_str()) {
            None => foreign.push(format!("{} ({}) from {}", a.id, a.agg, a.relay)),
            Some((agg, _)) if *agg != a.agg => foreign.push(format!(
                "{} published as aggregate {} but committed as {agg}",
                a.id, a.agg
            )),
            _ => {}
        }
    }
    if !foreign.is_empty() {
        v.push((
            RInv::R,
            format!(
                "{} deliveries of events that never committed (rolled back or unknown), e.g. {}",
                foreign.len(),
                foreign[..foreign.len().min(3)].join("; ")
            ),
        ));
    }

    // L (and the drain part of P): every committed event arrived.
    let seen: HashSet<&str> = o.arrivals.iter().map(|a| a.id.as_str()).collect();
    let (mut lost, mut stuck) = (Vec::new(), Vec::new());
    for c in &o.committed {
        if !seen.contains(c.id.as_str()) {
            if o.left.contains(&c.id) {
                stuck.push(c);
            } else {
                lost.push(c);
            }
        }
    }
    if !lost.is_empty() {
        let e: Vec<String> = lost
            .iter()
            .take(3)
            .map(|c| format!("{} ({} #{})", c.id, c.agg, rank[c.id.as_str()].1))
            .collect();
        v.push((
            RInv::L,
            format!(
                "{} committed events never reached the sink and are no longer in the outbox, e.g. {}",
                lost.len(),
                e.join(", ")
            ),
        ));
    }
    if !stuck.is_empty() {
        v.push((
            RInv::P,
            format!(
                "{} committed events were still in the outbox after the final drain",
                stuck.len()
            ),
        ));
    }
    if let Some(u) = &o.undrained {
        v.push((RInv::P, u.clone()));
    }

    // O: per aggregate, in arrival order. `expect` is the next number the consumer can
    // accept: the one after the highest delivered (a first delivery), or, during a redelivered
    // run, the one after the run's last. A number below `expect` restarts a run (a prefix
    // delivered again, from wherever the redelivery starts); one above it is either a first
    // delivery out of order or a newer event before the redelivered run completed its prefix.
    //
    // The documented window: a relay whose session was ended at an arbitrary moment (the
    // operator's pg_terminate_backend, a restart, a cut connection) learns it only at its next
    // round trip, which it makes at the latest when its idle-in-transaction timeout is about to
    // pass; what it publishes meanwhile may interleave with the relay that took over. Violations
    // whose offending arrival falls in that window after such a fault are counted as excused,
    // not as violations.
    //
    // A request its relay abandoned — no answer within --timeout, the connection closed — may
    // still reach the receiver: a black hole (a middlebox, or TCP retransmitting once the path
    // heals) held it, and delivers it after whatever was sent since. No client can call such
    // a request back; the receiver dedupes it by its Idempotency-Key. A copy of an event that
    // had already arrived, which the proxy marked as abandoned, therefore takes no place in the
    // order (it is counted as `late`). A first arrival takes its place whatever its path.
    let mut arrivals_of: HashMap<&str, Vec<usize>> = HashMap::new();
    for (i, a) in o.arrivals.iter().enumerate() {
        if let Some((agg, _)) = rank.get(a.id.as_str()) {
            arrivals_of.entry(agg).or_default().push(i);
        }
    }
    let mut aggs: Vec<&&str> = arrivals_of.keys().collect();
    aggs.sort();
    for agg in aggs {
        let idx = &arrivals_of[*agg];
        let (mut expect, mut hi) = (1usize, 0usize);
        let mut run_from = 0usize;
        let mut first: Option<String> = None;
        let mut bad = 0usize;
        let mut arrived: HashSet<usize> = HashSet::new();
        for (k, &i) in idx.iter().enumerate() {
            let a = &o.arrivals[i];
            let r = rank[a.id.as_str()].1;
            if !arrived.insert(r) && a.late {
                fig.late += 1;
                continue;
            }
            if r == expect {
                expect += 1;
            } else if r < expect {
                expect = r + 1;
                run_from = r;
            } else {
                let excused = o.excuse.is_some_and(|(s, e)| a.t >= s && a.t <= e);
                if excused {
                    fig.excused += 1;
                } else {
                    bad += 1;
                    if first.is_none() {
                        let what = if expect == hi + 1 {
                            format!("#{r} arrived before #{expect} had ever arrived")
                        } else {
                            format!(
                                "#{r} arrived while the redelivered run from #{run_from} had reached only #{} of #{hi}",
                                expect - 1
                            )
                        };
                        first = Some(format!(
                            "{agg}: {what} (+{:.3} s, from {}): {}",
                            rel(a.t),
                            a.relay,
                            excerpt(o, idx, k, &rank)
                        ));
                    }
                }
                expect = r + 1;
            }
            hi = hi.max(r);
        }
        if let Some(f) = first {
            v.push((
                RInv::O,
                if bad > 1 {
                    format!("{f} [{bad} out-of-order arrivals on this aggregate]")
                } else {
                    f
                },
            ));
        }
    }

    // D: an event arrives more than once only around the fault: no copy before the fault
    // began, and the first copy arrived while a batch that the fault ended could have been in
    // flight (a batch lives at most the idle timeout past its last statement, plus a delivery).
    let pre = b.idle + o.plan.timeout as f64 + 1.0;
    let post = o.plan.timeout as f64 + 1.0;
    // The harness killing a relay at its bound is a fault too (and a violation of B already).
    let mut windows = vec![(o.fault_start - pre, o.fault_end + post)];
    for p in o.procs.iter().filter(|p| p.hung) {
        if let Some((t, _)) = p.exit {
            windows.push((t - pre, t + post));
        }
    }
    let (lo, up) = windows[0];
    let around = |t: f64| windows.iter().any(|&(a, b)| t >= a && t <= b);
    let mut count: HashMap<&str, (usize, f64, String)> = HashMap::new();
    let mut early = Vec::new();
    for a in &o.arrivals {
        let e = count
            .entry(a.id.as_str())
            .or_insert((0, a.t, a.relay.clone()));
        e.0 += 1;
        if e.0 > 1 && a.t < o.fault_start {
            early.push(format!(
                "{} again from {} at +{:.3} s (first from {} at +{:.3} s)",
                a.id,
                a.relay,
                rel(a.t),
                e.2,
                rel(e.1)
            ));
        }
    }
    if !early.is_empty() {
        v.push((
            RInv::D,
            format!(
                "{} copies arrived before the fault (+{:.3} s), e.g. {}",
                early.len(),
                rel(o.fault_start),
                early[..early.len().min(3)].join("; ")
            ),
        ));
    }
    let mut outside = Vec::new();
    for (id, (n, t, relay)) in &count {
        if *n > 1 {
            fig.copies += n - 1;
            if !around(*t) {
                outside.push((
                    t,
                    format!("{id} ×{n}, first from {relay} at +{:.3} s", rel(*t)),
                ));
            }
        }
    }
    if !outside.is_empty() {
        outside.sort_by(|a, b| a.0.total_cmp(b.0));
        let e: Vec<String> = outside.iter().take(3).map(|(_, s)| s.clone()).collect();
        v.push((
            RInv::D,
            format!(
                "{} events arrived more than once with their first copy outside the fault's window (+{:.1} … +{:.1} s) and any kill at a bound, e.g. {}",
                outside.len(),
                rel(lo),
                rel(up),
                e.join("; ")
            ),
        ));
    }

    // B: bounded, documented exits.
    for p in &o.procs {
        let code = p.exit.and_then(|(_, s)| s.code());
        let exited = p.exit.map_or(f64::NAN, |(t, _)| rel(t));
        if p.hung {
            v.push((
                RInv::B,
                format!(
                    "{} had not exited at its bound ({}; started +{:.1} s, bound +{:.1} s) and was killed",
                    p.name(),
                    p.bound_why,
                    rel(p.started),
                    rel(p.bound)
                ),
            ));
        } else if p.killed {
        } else if p.once {
            if !matches!(code, Some(0 | 1 | 69)) {
                v.push((
                    RInv::B,
                    format!(
                        "{} ended with {} at +{exited:.1} s (a --once exits 0, 1 or 69): {}",
                        p.name(),
                        p.describe_exit(),
                        last_line(&p.err)
                    ),
                ));
            }
        } else if p.termed.is_some() {
            if code != Some(0) {
                v.push((
                    RInv::B,
                    format!(
                        "{} ended with {} after SIGTERM (expected exit 0): {}",
                        p.name(),
                        p.describe_exit(),
                        last_line(&p.err)
                    ),
                ));
            }
        } else {
            v.push((
                RInv::B,
                format!(
                    "{} exited by itself with {} at +{exited:.1} s: {}",
                    p.name(),
                    p.describe_exit(),
                    last_line(&p.err)
                ),
            ));
        }
    }

    // P: the fresh aggregates' events arrived within their bounds.
    for p in &o.probes {
        match p.arrived {
            Some(t) if t - p.at <= p.bound => {}
            Some(t) => v.push((
                RInv::P,
                format!(
                    "{}: an event of the fresh aggregate {} arrived {:.1} s after it committed (bound {:.1} s)",
                    p.what,
                    p.agg,
                    t - p.at,
                    p.bound
                ),
            )),
            None => v.push((
                RInv::P,
                format!(
                    "{}: an event of the fresh aggregate {} committed at +{:.1} s never arrived",
                    p.what,
                    p.agg,
                    rel(p.at)
                ),
            )),
        }
    }
    (v, fig)
}

/// The arrivals of one aggregate around position `k`: `#n` numbers, `*` for a copy of one that
/// arrived before, the relay that published it.
fn excerpt(o: &Outcome, idx: &[usize], k: usize, rank: &HashMap<&str, (&str, usize)>) -> String {
    let from = k.saturating_sub(4);
    let to = (k + 3).min(idx.len());
    let mut before: HashSet<usize> = HashSet::new();
    for &i in &idx[..from] {
        before.insert(rank[o.arrivals[i].id.as_str()].1);
    }
    let mut parts = Vec::new();
    for (j, &i) in idx[from..to].iter().enumerate() {
        let a = &o.arrivals[i];
        let r = rank[a.id.as_str()].1;
        let copy = if before.contains(&r) { "*" } else { "" };
        before.insert(r);
        let mark = if from + j == k { " <<" } else { "" };
        parts.push(format!("#{r}{copy} ({}){mark}", a.relay));
    }
    format!(
        "{}{}{}",
        if from > 0 { "… " } else { "" },
        parts.join(", "),
        if to < idx.len() { " …" } else { "" }
    )
}

/// The last line of a relay's stderr that says something (for one-line reports).
pub fn last_line(path: &std::path::Path) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    s.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("(no output)")
        .chars()
        .take(200)
        .collect()
}
