//! `leasectl runs --target T [--limit N] [--json]`: recorded runs, newest first.

use anyhow::Result;
use serde_json::json;

use crate::cli::{DbArgs, RunsArgs};
use crate::exit::Exit;
use crate::fmt;
use crate::store::runs;

pub async fn run(db: &DbArgs, args: RunsArgs) -> Result<Exit> {
    let db = super::connect(db).await?;
    let rows = runs::list(&db.client, &db.schema, &args.target, args.limit).await?;

    if args.json {
        let runs: Vec<_> = rows
            .iter()
            .map(|r| {
                json!({
                    "run_id": r.id.to_string(),
                    "fence": r.fence,
                    "outcome": r.outcome,
                    "exit_code": r.exit_code,
                    "signal": r.signal,
                    "host": r.host,
                    "pid": r.pid,
                    "started_at": fmt::rfc3339(r.started_at),
                    "finished_at": fmt::rfc3339(r.finished_at),
                    "duration_ms": r.duration_ms,
                    "stdout_bytes": r.stdout_bytes,
                    "stdout_truncated": r.stdout_truncated,
                    "stderr_bytes": r.stderr_bytes,
                    "stderr_truncated": r.stderr_truncated,
                    "argv": r.argv,
                    "error": r.error,
                    "slot": r.slot.map(fmt::rfc3339),
                    "slot_end": r.slot_end.map(fmt::rfc3339),
                    "done_by": r.done_by.map(|id| id.to_string()),
                    "done_by_running": (r.outcome == "skipped").then_some(r.done_by_running),
                    "label": r.label,
                    "preempted_by": r.preempted_by,
                })
            })
            .collect();
        super::print_json(&json!({ "target": args.target, "runs": runs }))?;
        return Ok(Exit::Code(0));
    }

    if rows.is_empty() {
        crate::say!("no runs recorded for '{}'", args.target);
        return Ok(Exit::Code(0));
    }
    // A SLOT column only for a target run with --slot, so other tables stay as they were.
    let slots = rows.iter().any(|r| r.slot.is_some());
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let status = match (r.exit_code, r.signal) {
                (_, Some(sig)) => format!("signal {sig}"),
                (Some(code), None) => code.to_string(),
                (None, None) => "-".into(),
            };
            let mut row = vec![
                r.id.to_string(),
                fmt::fence(r.fence),
                match r.preempted_by {
                    Some(fence) => format!("{} by {}", r.outcome, fmt::fence(fence)),
                    None => r.outcome.clone(),
                },
                status,
                format!("{} ago", fmt::duration(fmt::millis(r.age_ms))),
                fmt::duration(fmt::millis(r.duration_ms)),
                match &r.label {
                    Some(l) => format!("{} pid {} [{l}]", r.host, r.pid),
                    None => format!("{} pid {}", r.host, r.pid),
                },
            ];
            if slots {
                row.push(r.slot.map_or("-".into(), |t| {
                    humantime::format_rfc3339_seconds(t).to_string()
                }));
            }
            row
        })
        .collect();
    let mut header = vec![
        "RUN", "FENCE", "OUTCOME", "EXIT", "FINISHED", "TOOK", "HOST",
    ];
    if slots {
        header.push("SLOT");
    }
    super::print(fmt::table(&header, &table).as_bytes())?;
    Ok(Exit::Code(0))
}
