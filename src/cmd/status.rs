//! `leasectl status [--target T] [--json]`: leases, their waiters, last runs, health and the
//! outbox backlog.

use std::collections::BTreeMap;
use std::io::IsTerminal;

use anyhow::Result;
use serde_json::{json, Value};

use crate::cli::{DbArgs, StatusArgs};
use crate::exit::Exit;
use crate::fmt;
use crate::health;
use crate::store::leases::TargetStatus;
use crate::store::{leases, outbox, waiters};

/// The widest TARGET or HOLDER cell on a terminal, in columns (targets and labels may be 200
/// characters long).
const TERMINAL_CELL_WIDTH: usize = 40;

pub async fn run(db: &DbArgs, args: StatusArgs) -> Result<Exit> {
    let db = super::connect(db).await?;
    let leases = leases::status(&db.client, &db.schema, args.target.as_deref()).await?;
    let named = args.target.as_ref().map(std::slice::from_ref);
    let watched = crate::store::health::watched(&db.client, &db.schema, named).await?;
    // Health per watched target, and what watches it; a target expected before its first run
    // has no lease row yet and is listed all the same (free, fence 0, no TTL).
    let mut health: BTreeMap<String, Watched> = watched
        .iter()
        .map(|w| {
            let watch = Watched {
                health: health::assess(w).health(),
                by: w.watched_by(),
                schedule: w.schedule.clone(),
                schedule_tz: w.schedule_tz.clone(),
            };
            (w.target.clone(), watch)
        })
        .collect();
    let mut targets: Vec<(String, Option<TargetStatus>, Option<Watched>)> = leases
        .into_iter()
        .map(|t| {
            let h = health.remove(&t.target);
            (t.target.clone(), Some(t), h)
        })
        .collect();
    targets.extend(health.into_iter().map(|(t, h)| (t, None, Some(h))));
    targets.sort_by(|a, b| a.0.cmp(&b.0));
    let mut queues: BTreeMap<String, Vec<waiters::Listed>> = BTreeMap::new();
    for w in waiters::list(&db.client, &db.schema, args.target.as_deref()).await? {
        queues.entry(w.target.clone()).or_default().push(w);
    }
    let no_waiters = Vec::new();
    let queue_of = |target: &str| queues.get(target).unwrap_or(&no_waiters);
    let mut places: BTreeMap<String, Vec<leases::Place>> = BTreeMap::new();
    for p in leases::holders(&db.client, &db.schema, args.target.as_deref()).await? {
        places.entry(p.target.clone()).or_default().push(p);
    }
    let no_places = Vec::new();
    let places_of = |target: &str| places.get(target).unwrap_or(&no_places);
    let backlog = outbox::backlog(&db.client, &db.schema).await?;
    let (pending, dead, oldest) = (backlog.pending, backlog.dead, backlog.oldest_pending_ms);

    if args.json {
        let targets: Vec<Value> = targets
            .iter()
            .map(|(name, t, health)| {
                let watch = health.as_ref();
                let (health, watched_by) = (
                    watch.map(|w| w.health),
                    watch.map_or(&[][..], |w| w.by.as_slice()),
                );
                let (schedule, schedule_tz) = (
                    watch.and_then(|w| w.schedule.as_deref()),
                    watch.and_then(|w| w.schedule_tz.as_deref()),
                );
                let Some(t) = t else {
                    return json!({
                        "target": name,
                        "state": "free",
                        "holder_host": null,
                        "holder_pid": null,
                        "fence": 0,
                        "heartbeat_age_ms": null,
                        "ttl_ms": null,
                        "last_run": null,
                        "health": health,
                        "watched_by": watched_by,
                        "schedule": schedule,
                        "schedule_tz": schedule_tz,
                        "max_holders": 1,
                        "holders": [],
                        "waiters": [],
                    });
                };
                let holders: Vec<Value> = places_of(name)
                    .iter()
                    .map(|p| {
                        json!({
                            "index": p.index,
                            "host": p.holder.host,
                            "pid": p.holder.pid,
                            "label": p.holder.label,
                            "fence": p.holder.fence,
                            "heartbeat_age_ms": fmt::ms(p.holder.heartbeat_age),
                            "expired": p.expired,
                            "idle": p.idle,
                        })
                    })
                    .collect();
                let waiters: Vec<Value> = queue_of(name)
                    .iter()
                    .map(|w| {
                        json!({
                            "position": w.position,
                            "host": w.who.host,
                            "pid": w.who.pid,
                            "label": w.who.label,
                            "queue": w.queue,
                            "waiting_ms": w.waiting_ms,
                        })
                    })
                    .collect();
                let last_run = t.last_run.as_ref().map(|r| {
                    json!({
                        "run_id": r.id.to_string(),
                        "outcome": r.outcome,
                        "exit_code": r.exit_code,
                        "signal": r.signal,
                        "finished_at": fmt::rfc3339(r.finished_at),
                        "duration_ms": r.duration_ms,
                    })
                });
                json!({
                    "target": t.target,
                    "state": t.state,
                    "holder_host": t.holder_host,
                    "holder_pid": t.holder_pid,
                    "holder_label": t.holder_label,
                    "fence": t.fence,
                    "heartbeat_age_ms": t.heartbeat_age_ms,
                    "ttl_ms": t.ttl_ms,
                    "last_run": last_run,
                    "skipped": t.skipped,
                    "health": health,
                    "watched_by": watched_by,
                    "schedule": schedule,
                    "schedule_tz": schedule_tz,
                    "max_holders": t.max_holders,
                    "holders": holders,
                    "waiters": waiters,
                })
            })
            .collect();
        let doc = json!({
            "targets": targets,
            "outbox": {
                "pending": pending,
                "dead": dead,
                "oldest_pending_age_ms": oldest,
                "retrying": backlog.retrying,
            },
        });
        super::print_json(&doc)?;
        return Ok(Exit::Code(0));
    }

    let rows: Vec<Vec<String>> = targets
        .iter()
        .map(|(name, t, health)| {
            // `ok (expect)`, `missed (--slot)`: the word and what watches the target.
            let health = health.as_ref().map_or("-".to_owned(), |w| {
                format!("{} ({})", w.health, w.by.join(", "))
            });
            let Some(t) = t else {
                // Watched before its first run: free, nobody waiting, fence 0 (as in --json:
                // the first acquisition gets 1), no TTL, no heartbeat, no run.
                let dash = || "-".to_owned();
                return vec![
                    name.clone(),
                    "free".into(),
                    health,
                    dash(),
                    "0".into(),
                    "0".into(),
                    dash(),
                    dash(),
                    dash(),
                ];
            };
            let mut heartbeat = t.heartbeat_age_ms.map_or("-".into(), |ms| {
                format!("{} ago", fmt::duration(fmt::millis(ms)))
            });
            let mut ttl = fmt::duration(fmt::millis(t.ttl_ms));
            let holder = match (&t.holder_host, t.holder_pid, &t.holder_label) {
                (Some(h), Some(p), None) => format!("{h} pid {p}"),
                (Some(h), Some(p), Some(l)) => format!("{h} pid {p} [{l}]"),
                _ => "-".into(),
            };
            // Several holders (--max-holders): the first place's, and how many more.
            let holder = match places_of(&t.target).as_slice() {
                [first, rest @ ..] if t.max_holders > 1 => {
                    heartbeat = format!("{} ago", fmt::duration(first.holder.heartbeat_age));
                    ttl = fmt::duration(first.holder.ttl);
                    let more = match rest.len() {
                        0 => String::new(),
                        n => format!(" (+{n} of {})", t.max_holders),
                    };
                    format!("{}{more}", first.holder.who())
                }
                _ => holder,
            };
            let waiting = queue_of(&t.target).len().to_string();
            let last = match &t.last_run {
                None => "-".into(),
                Some(r) => {
                    let status = match (r.exit_code, r.signal) {
                        (_, Some(sig)) => format!("signal {sig}"),
                        (Some(code), None) => format!("exit {code}"),
                        (None, None) => "no status".into(),
                    };
                    format!(
                        "{}, {status}, {} ago, took {}",
                        r.outcome,
                        fmt::duration(fmt::millis(r.age_ms)),
                        fmt::duration(fmt::millis(r.duration_ms))
                    )
                }
            };
            // `run --slot` callers that found their slot done: a suffix, so the table of a
            // target without --slot is unchanged.
            let last = match t.skipped {
                0 => last,
                n => format!("{last} (+{n} skipped)"),
            };
            vec![
                t.target.clone(),
                t.state.clone(),
                health,
                holder,
                waiting,
                crate::fmt::fence(t.fence),
                heartbeat,
                ttl,
                last,
            ]
        })
        .collect();
    // On a terminal, one long target or label must not make every line wrap: those cells are
    // cut with an ellipsis. A pipe gets them whole (and --json always does).
    let rows = if std::io::stdout().is_terminal() {
        rows.into_iter()
            .map(|mut row| {
                for col in [0, 3] {
                    row[col] = fmt::cut_to_width(&row[col], TERMINAL_CELL_WIDTH);
                }
                row
            })
            .collect()
    } else {
        rows
    };
    let mut out = if rows.is_empty() {
        match &args.target {
            Some(t) => format!("no lease has ever been taken on '{t}'\n"),
            None => "no targets yet\n".to_owned(),
        }
    } else {
        fmt::table(
            &[
                "TARGET",
                "STATE",
                "HEALTH",
                "HOLDER",
                "WAITERS",
                "FENCE",
                "HEARTBEAT",
                "TTL",
                "LAST RUN",
            ],
            &rows,
        )
    };
    let oldest = oldest.map_or(String::new(), |ms| {
        format!(", oldest pending {} old", fmt::duration(fmt::millis(ms)))
    });
    let retrying = match backlog.retrying {
        0 => String::new(),
        n => format!(" ({n} retrying)"),
    };
    out.push_str(&format!(
        "\noutbox: {pending} pending{retrying}, {dead} dead{oldest}\n"
    ));
    super::print(out.as_bytes())?;
    Ok(Exit::Code(0))
}

/// What watches a target, for its row.
struct Watched {
    /// The health word.
    health: &'static str,
    /// `expect`, `--slot`, or both.
    by: Vec<&'static str>,
    /// The schedule its latest `run --slot` stored, and its zone (`None`: UTC).
    schedule: Option<String>,
    schedule_tz: Option<String>,
}
