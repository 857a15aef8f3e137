//! `leasectl status [--target T] [--json]`: leases, last runs and the outbox backlog.

use anyhow::Result;
use serde_json::{json, Value};

use crate::cli::{DbArgs, StatusArgs};
use crate::exit::Exit;
use crate::fmt;
use crate::store::{leases, outbox};

pub async fn run(db: &DbArgs, args: StatusArgs) -> Result<Exit> {
    let db = super::connect(db).await?;
    let targets = leases::status(&db.client, &db.schema, args.target.as_deref()).await?;
    let backlog = outbox::backlog(&db.client, &db.schema).await?;
    let (pending, dead, oldest) = (backlog.pending, backlog.dead, backlog.oldest_pending_ms);

    if args.json {
        let targets: Vec<Value> = targets
            .iter()
            .map(|t| {
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
                    "fence": t.fence,
                    "heartbeat_age_ms": t.heartbeat_age_ms,
                    "ttl_ms": t.ttl_ms,
                    "last_run": last_run,
                    "skipped": t.skipped,
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
        .map(|t| {
            let holder = match (&t.holder_host, t.holder_pid) {
                (Some(h), Some(p)) => format!("{h} pid {p}"),
                _ => "-".into(),
            };
            let heartbeat = t.heartbeat_age_ms.map_or("-".into(), |ms| {
                format!("{} ago", fmt::duration(fmt::millis(ms)))
            });
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
                holder,
                t.fence.to_string(),
                heartbeat,
                fmt::duration(fmt::millis(t.ttl_ms)),
                last,
            ]
        })
        .collect();
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
                "HOLDER",
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
