//! `leasectl status [--target T] [--json]`: leases, last runs and the outbox backlog.

use anyhow::{Context, Result};
use serde_json::{json, Value};
use tokio_postgres::types::Type;

use crate::cli::{DbArgs, StatusArgs};
use crate::exit::Exit;
use crate::fmt;
use crate::outbox;

pub async fn run(db: &DbArgs, args: StatusArgs) -> Result<Exit> {
    let db = super::connect(db).await?;
    let sql = db.schema.sql(
        "SELECT l.target,
                CASE WHEN l.token IS NULL THEN 'free'
                     WHEN l.heartbeat_at + l.ttl_ms * interval '1 millisecond' < now() THEN 'expired'
                     ELSE 'held' END,
                l.holder_host, l.holder_pid, l.fence,
                CASE WHEN l.token IS NOT NULL
                     THEN greatest(0, round(extract(epoch FROM now() - l.heartbeat_at) * 1000))::int8 END,
                l.ttl_ms,
                r.id, r.outcome, r.exit_code, r.signal, {s}.rfc3339(r.finished_at),
                round(extract(epoch FROM r.finished_at - r.started_at) * 1000)::int8,
                round(extract(epoch FROM now() - r.finished_at) * 1000)::int8
           FROM {s}.leases l
           LEFT JOIN LATERAL (
                SELECT * FROM {s}.runs WHERE runs.target = l.target ORDER BY finished_at DESC LIMIT 1
           ) r ON true
          WHERE $1::text IS NULL OR l.target = $1
          ORDER BY l.target",
    );
    let targets = db
        .client
        .query_typed(&sql, &[(&args.target, Type::TEXT)])
        .await
        .context("cannot read the leases")?;
    let backlog = outbox::backlog(&db.client, &db.schema).await?;
    let (pending, dead, oldest) = (backlog.pending, backlog.dead, backlog.oldest_pending_ms);

    if args.json {
        let targets: Vec<Value> = targets
            .iter()
            .map(|r| {
                let last_run = r.get::<_, Option<uuid::Uuid>>(7).map(|id| {
                    json!({
                        "run_id": id.to_string(),
                        "outcome": r.get::<_, &str>(8),
                        "exit_code": r.get::<_, Option<i32>>(9),
                        "signal": r.get::<_, Option<i32>>(10),
                        "finished_at": r.get::<_, &str>(11),
                        "duration_ms": r.get::<_, i64>(12),
                    })
                });
                json!({
                    "target": r.get::<_, &str>(0),
                    "state": r.get::<_, &str>(1),
                    "holder_host": r.get::<_, Option<&str>>(2),
                    "holder_pid": r.get::<_, Option<i32>>(3),
                    "fence": r.get::<_, i64>(4),
                    "heartbeat_age_ms": r.get::<_, Option<i64>>(5),
                    "ttl_ms": r.get::<_, i64>(6),
                    "last_run": last_run,
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
        .map(|r| {
            let holder = match (r.get::<_, Option<&str>>(2), r.get::<_, Option<i32>>(3)) {
                (Some(h), Some(p)) => format!("{h} pid {p}"),
                _ => "-".into(),
            };
            let heartbeat = r.get::<_, Option<i64>>(5).map_or("-".into(), |ms| {
                format!("{} ago", fmt::duration(fmt::millis(ms)))
            });
            let last = match r.get::<_, Option<&str>>(8) {
                None => "-".into(),
                Some(outcome) => {
                    let status = match (r.get::<_, Option<i32>>(9), r.get::<_, Option<i32>>(10)) {
                        (_, Some(sig)) => format!("signal {sig}"),
                        (Some(code), None) => format!("exit {code}"),
                        (None, None) => "no status".into(),
                    };
                    format!(
                        "{outcome}, {status}, {} ago, took {}",
                        fmt::duration(fmt::millis(r.get(13))),
                        fmt::duration(fmt::millis(r.get(12)))
                    )
                }
            };
            vec![
                r.get::<_, &str>(0).to_owned(),
                r.get::<_, &str>(1).to_owned(),
                holder,
                r.get::<_, i64>(4).to_string(),
                heartbeat,
                fmt::duration(fmt::millis(r.get(6))),
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
