//! `leasectl outbox list|retry|discard`: the operator's view of undelivered events.

use std::time::SystemTime;

use anyhow::Result;
use serde_json::{json, Value};

use crate::cli::{DbArgs, OutboxCommand, OutboxDiscardArgs, OutboxListArgs, OutboxRetryArgs};
use crate::exit::Exit;
use crate::fmt;
use crate::fmt::rfc3339;
use crate::store::outbox::{self, RetryWhich};

pub async fn run(db: &DbArgs, cmd: OutboxCommand) -> Result<Exit> {
    match cmd {
        OutboxCommand::List(a) => list(db, a).await,
        OutboxCommand::Retry(a) => retry(db, a).await,
        OutboxCommand::Discard(a) => discard(db, a).await,
    }
}

async fn list(db: &DbArgs, args: OutboxListArgs) -> Result<Exit> {
    let db = super::connect(db).await?;
    let (events, total) = outbox::list(&db.client, &db.schema, args.dead, args.limit).await?;
    if args.json {
        let items: Vec<Value> = events
            .iter()
            .map(|e| {
                json!({
                    "id": e.id.to_string(),
                    "seq": e.seq,
                    "aggregate_type": e.aggregate_type,
                    "aggregate_id": e.aggregate_id,
                    "type": e.event_type,
                    "payload": e.payload,
                    "created_at": rfc3339(e.created_at),
                    "state": e.state,
                    "attempts": e.attempts,
                    "next_attempt_at": rfc3339(e.next_attempt_at),
                    "last_error": e.last_error,
                    "dead_at": e.dead_at.map(rfc3339),
                })
            })
            .collect();
        super::print_json(&json!({ "events": items, "total": total }))?;
        return Ok(Exit::Code(0));
    }
    if events.is_empty() {
        let what = if args.dead {
            "no dead events"
        } else {
            "the outbox is empty"
        };
        super::print(format!("{what}\n").as_bytes())?;
        return Ok(Exit::Code(0));
    }
    let now = SystemTime::now();
    let ago = |t: SystemTime| {
        now.duration_since(t)
            .map_or("now".into(), |d| format!("{} ago", fmt::duration(d)))
    };
    let rows: Vec<Vec<String>> = events
        .iter()
        .map(|e| {
            let next = match e.state {
                "retrying" => t_minus(now, e.next_attempt_at),
                _ => "-".into(),
            };
            vec![
                e.id.to_string(),
                format!("{} {}", e.aggregate_type, e.aggregate_id),
                e.event_type.clone(),
                e.state.to_owned(),
                e.attempts.to_string(),
                next,
                ago(e.created_at),
                e.last_error
                    .as_deref()
                    .map_or("-".into(), |m| fmt::one_line(m, 60)),
            ]
        })
        .collect();
    let mut out = fmt::table(
        &[
            "ID",
            "AGGREGATE",
            "TYPE",
            "STATE",
            "ATTEMPTS",
            "NEXT TRY",
            "CREATED",
            "LAST ERROR",
        ],
        &rows,
    );
    if total > events.len() as i64 {
        out.push_str(&format!(
            "… {} more (--limit {total} shows all)\n",
            total - events.len() as i64
        ));
    }
    super::print(out.as_bytes())?;
    Ok(Exit::Code(0))
}

fn t_minus(now: SystemTime, at: SystemTime) -> String {
    match at.duration_since(now) {
        Ok(d) => format!("in {}", fmt::duration(d)),
        Err(_) => "due".into(),
    }
}

async fn retry(db: &DbArgs, args: OutboxRetryArgs) -> Result<Exit> {
    let db = super::connect(db).await?;
    let Some(id) = args.id else {
        let n = outbox::retry(&db.client, &db.schema, RetryWhich::AllDead).await?;
        crate::say!("re-queued {n} dead event{}", if n == 1 { "" } else { "s" });
        return Ok(Exit::Code(0));
    };
    let busy = outbox::in_a_batch(&db.client, &db.schema, id).await?;
    if busy {
        crate::say!(
            "event {id} is being delivered by a relay right now; waiting for its batch to end"
        );
    }
    if outbox::retry_one(&db.client, &db.schema, id).await? {
        crate::say!("event {id} is due now");
        return Ok(Exit::Code(0));
    }
    if busy {
        crate::say!(
            "event {id} is no longer in the outbox: that batch delivered it (or it was discarded)"
        );
    } else {
        crate::say!("no event {id} in the outbox (already delivered or discarded?)");
    }
    Ok(Exit::Code(1))
}

async fn discard(db: &DbArgs, args: OutboxDiscardArgs) -> Result<Exit> {
    let db = super::connect(db).await?;
    match outbox::discard(&db.client, &db.schema, args.id, args.force).await? {
        Ok(d) => {
            super::print(format!("{}\n", d.json).as_bytes())?;
            let state = if d.dead { "dead" } else { "not dead" };
            crate::say!(
                "discarded event {} ({state}, {} attempts); it will never be published",
                args.id,
                d.attempts
            );
            Ok(Exit::Code(0))
        }
        Err(why) => {
            crate::say!("{why}");
            Ok(Exit::Code(1))
        }
    }
}
