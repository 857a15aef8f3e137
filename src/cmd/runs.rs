//! `leasectl runs --target T [--limit N] [--json]`: recorded runs, newest first.

use anyhow::{Context, Result};
use serde_json::json;
use tokio_postgres::types::Type;

use crate::cli::{DbArgs, RunsArgs};
use crate::exit::Exit;
use crate::fmt;

pub async fn run(db: &DbArgs, args: RunsArgs) -> Result<Exit> {
    let db = super::connect(db).await?;
    let sql = db.schema.sql(
        "SELECT id, fence, outcome, exit_code, signal, host, pid,
                {s}.rfc3339(started_at), {s}.rfc3339(finished_at),
                round(extract(epoch FROM finished_at - started_at) * 1000)::int8,
                round(extract(epoch FROM now() - finished_at) * 1000)::int8,
                length(stdout)::int8, stdout_truncated, length(stderr)::int8, stderr_truncated,
                argv, error
           FROM {s}.runs WHERE target = $1
          ORDER BY finished_at DESC LIMIT $2",
    );
    let rows = db
        .client
        .query_typed(
            &sql,
            &[(&args.target, Type::TEXT), (&args.limit, Type::INT8)],
        )
        .await
        .context("cannot list runs")?;

    if args.json {
        let runs: Vec<_> = rows
            .iter()
            .map(|r| {
                json!({
                    "run_id": r.get::<_, uuid::Uuid>(0).to_string(),
                    "fence": r.get::<_, i64>(1),
                    "outcome": r.get::<_, &str>(2),
                    "exit_code": r.get::<_, Option<i32>>(3),
                    "signal": r.get::<_, Option<i32>>(4),
                    "host": r.get::<_, &str>(5),
                    "pid": r.get::<_, i32>(6),
                    "started_at": r.get::<_, &str>(7),
                    "finished_at": r.get::<_, &str>(8),
                    "duration_ms": r.get::<_, i64>(9),
                    "stdout_bytes": r.get::<_, i64>(11),
                    "stdout_truncated": r.get::<_, bool>(12),
                    "stderr_bytes": r.get::<_, i64>(13),
                    "stderr_truncated": r.get::<_, bool>(14),
                    "argv": r.get::<_, Vec<String>>(15),
                    "error": r.get::<_, Option<&str>>(16),
                })
            })
            .collect();
        super::print_json(&json!({ "target": args.target, "runs": runs }))?;
        return Ok(Exit::Code(0));
    }

    if rows.is_empty() {
        eprintln!("leasectl: no runs recorded for '{}'", args.target);
        return Ok(Exit::Code(0));
    }
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let status = match (r.get::<_, Option<i32>>(3), r.get::<_, Option<i32>>(4)) {
                (_, Some(sig)) => format!("signal {sig}"),
                (Some(code), None) => code.to_string(),
                (None, None) => "-".into(),
            };
            vec![
                r.get::<_, uuid::Uuid>(0).to_string(),
                r.get::<_, i64>(1).to_string(),
                r.get::<_, &str>(2).to_owned(),
                status,
                format!("{} ago", fmt::duration(fmt::millis(r.get(10)))),
                fmt::duration(fmt::millis(r.get(9))),
                format!("{} pid {}", r.get::<_, &str>(5), r.get::<_, i32>(6)),
            ]
        })
        .collect();
    let header = [
        "RUN", "FENCE", "OUTCOME", "EXIT", "FINISHED", "TOOK", "HOST",
    ];
    super::print(fmt::table(&header, &table).as_bytes())?;
    Ok(Exit::Code(0))
}
