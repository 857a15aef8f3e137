//! Ending a batch: what the relay decided for each claimed event ([`Settle`]), putting back what
//! was not delivered with its original `seq` and `id` (one statement, or one event at a time when
//! that is refused, so no event takes the others down with it), and the commit that makes the
//! delivered events' deletion final — or why it failed ([`SettleFailed`]).

use std::time::{Duration, SystemTime};

use std::pin::Pin;

use futures_util::StreamExt;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, SimpleQueryStream};

use super::claim::Claimed;
use super::rollback;
use crate::db::Schema;
use crate::store::{ms, sql};

/// Why a batch could not be settled, and whether its transaction may have committed all the
/// same.
#[derive(Debug)]
pub struct SettleFailed {
    pub error: tokio_postgres::Error,
    /// The COMMIT went out and no answer came back (the connection broke): the transaction may
    /// have committed or not, and nobody can tell which. Otherwise it certainly rolled back.
    pub outcome_unknown: bool,
}

/// The batch's commit, without waiting for its WAL to reach the disk (or a synchronous
/// standby). What the commit makes final is only the deletion of events the sink has already
/// confirmed: should a crash or a failover lose it (the last few hundred milliseconds of
/// commits at most; PostgreSQL keeps a prefix of them), those events are back in the outbox
/// and are published again, in order — what at-least-once delivery allows and a relay that
/// dies before its commit causes anyway. Put-backs lose as little: a refused event's attempt
/// may be counted once less. Waiting for the flush cost a tenth of a busy relay's time.
/// `SET LOCAL`: it ends with the transaction, also behind a transaction-mode pooler.
const COMMIT: &str = "SET LOCAL synchronous_commit = off; COMMIT";

/// Ends a batch's transaction: puts back what was not delivered (`restore`) and commits, which
/// makes the delivered events' deletion final. On error the transaction is rolled back.
pub async fn settle(
    client: &Client,
    schema: &Schema,
    claimed: &[Claimed],
    settled: &[Settle],
) -> Result<(), SettleFailed> {
    let failed = match restore(client, schema, claimed, settled).await {
        Err(error) => SettleFailed {
            error,
            outcome_unknown: false,
        },
        Ok(_) => match client.batch_execute(COMMIT).await {
            Ok(()) => return Ok(()),
            Err(error) => SettleFailed {
                // An error answered by the server means it rolled back; anything else (the
                // connection closed, a timeout) may have come after the commit went through.
                outcome_unknown: error.as_db_error().is_none(),
                error,
            },
        },
    };
    let _ = rollback(client).await;
    Err(failed)
}

/// A batch's COMMIT, sent and not answered yet ([`commit_later`]).
pub struct PendingCommit(Pin<Box<SimpleQueryStream>>);

/// Sends the commit of a batch that has nothing to put back, without waiting for its answer:
/// what the relay sends next on the connection (its next claim) goes out right behind it, and
/// the server runs the two without a round trip between them. [`PendingCommit::answer`] tells
/// how it went; the relay asks before it publishes anything more. An error here means the
/// commit was not sent.
pub async fn commit_later(client: &Client) -> Result<PendingCommit, SettleFailed> {
    match client.simple_query_raw(COMMIT).await {
        Ok(answers) => Ok(PendingCommit(Box::pin(answers))),
        Err(error) => Err(SettleFailed {
            outcome_unknown: false,
            error,
        }),
    }
}

impl PendingCommit {
    /// Waits for the answer: `Ok` once the batch committed. An error answered by the server
    /// means it rolled back (or, the `SET LOCAL` refused, that the transaction is left aborted
    /// until the connection is replaced, which the relay does with any failed commit); anything
    /// else (the connection closed) may have come after the commit went through.
    pub async fn answer(mut self) -> Result<(), SettleFailed> {
        while let Some(answer) = self.0.next().await {
            if let Err(error) = answer {
                return Err(SettleFailed {
                    outcome_unknown: error.as_db_error().is_none(),
                    error,
                });
            }
        }
        Ok(())
    }
}

/// What happened to one claimed event, decided by the relay.
#[derive(Debug, Clone)]
pub enum Settle {
    /// Confirmed by the sink: stays deleted.
    Delivered,
    /// Not attempted (or the sink was unreachable): put back exactly as it was.
    Untouched,
    /// Refused by the sink: put back with one more attempt, the error, and either the time of
    /// the next attempt (`retry_in` after `refused_at`) or, with `dead`, marked dead.
    Failed {
        error: String,
        retry_in: Duration,
        dead: bool,
        /// When the refusal came: the backoff runs from here, not from the batch's start.
        refused_at: std::time::Instant,
    },
}

/// One event to put back: the claimed row and what to change.
struct PutBack<'a> {
    c: &'a Claimed,
    attempts: i32,
    last_error: Option<String>,
    retry_in_ms: Option<i64>,
    die: bool,
}

impl<'a> PutBack<'a> {
    /// The event as it was claimed: nothing charged.
    fn untouched(c: &'a Claimed) -> PutBack<'a> {
        PutBack {
            c,
            attempts: c.attempts,
            last_error: c.last_error.clone(),
            retry_in_ms: None,
            die: false,
        }
    }
}

/// Puts back every claimed event that was not delivered, inside the claim's transaction, with
/// its original `seq`, `id` and `created_at`. Returns how many were put back.
///
/// No event can take the others down with it: the put-back is one statement
/// inside a savepoint, and should PostgreSQL refuse it (a constraint or index an application
/// added, say), each event is put back on its own, in a savepoint of its own; one that is still
/// refused goes back *as it was claimed* (nothing charged), which the table held a moment ago.
/// Only if even that fails does the batch roll back (an error is returned), so nothing is ever
/// lost.
async fn restore(
    client: &Client,
    schema: &Schema,
    claimed: &[Claimed],
    settled: &[Settle],
) -> Result<u64, tokio_postgres::Error> {
    let mut rows = Vec::new();
    for (c, s) in claimed.iter().zip(settled) {
        rows.push(match s {
            Settle::Delivered => continue,
            Settle::Untouched => PutBack::untouched(c),
            Settle::Failed {
                error,
                retry_in,
                dead,
                refused_at,
            } => PutBack {
                c,
                attempts: c.attempts.saturating_add(1),
                last_error: Some(error.clone()),
                // Measured on the database's clock (clock_timestamp(), the moment of the
                // put-back), less what has passed since the refusal on ours: `now()` is the
                // transaction's start, so a slow refusal or a long batch used up the backoff
                // before it began.
                retry_in_ms: Some(ms(retry_in.saturating_sub(refused_at.elapsed()))),
                die: *dead,
            },
        });
    }
    if rows.is_empty() {
        return Ok(0);
    }
    // Restored events were already announced; skip the NOTIFY trigger for them.
    client
        .batch_execute("SET LOCAL leasectl.outbox_notified = 'on'; SAVEPOINT leasectl_restore")
        .await?;
    let all = match put_back(client, schema, &rows).await {
        Ok(n) => {
            client.batch_execute("RELEASE leasectl_restore").await?;
            return Ok(n);
        }
        Err(e) => e,
    };
    if all.as_db_error().is_none() {
        return Err(all);
    }
    client.batch_execute("ROLLBACK TO leasectl_restore").await?;
    let mut n = 0;
    for row in &rows {
        client
            .batch_execute("SAVEPOINT leasectl_restore_one")
            .await?;
        match put_back(client, schema, std::slice::from_ref(row)).await {
            Ok(k) => n += k,
            Err(refused) if refused.as_db_error().is_some() => {
                client
                    .batch_execute("ROLLBACK TO leasectl_restore_one")
                    .await?;
                let e = &row.c.event;
                warn!(
                    "cannot record the outcome of event {} ({} {}): {}; it goes back as it was, without this attempt",
                    e.id,
                    crate::fmt::one_line(&e.aggregate_type, 60),
                    crate::fmt::one_line(&e.aggregate_id, 60),
                    crate::db::reason(&refused)
                );
                n += put_back(client, schema, &[PutBack::untouched(row.c)]).await?;
            }
            Err(e) => return Err(e),
        }
        client.batch_execute("RELEASE leasectl_restore_one").await?;
    }
    Ok(n)
}

/// One `INSERT … SELECT FROM unnest(…)` of `rows`: the put-back statement.
async fn put_back(
    client: &Client,
    schema: &Schema,
    rows: &[PutBack<'_>],
) -> Result<u64, tokio_postgres::Error> {
    let seq: Vec<i64> = rows.iter().map(|r| r.c.event.seq).collect();
    let xid: Vec<i64> = rows.iter().map(|r| r.c.xid).collect();
    let id: Vec<uuid::Uuid> = rows.iter().map(|r| r.c.event.id).collect();
    let aggregate_type: Vec<&str> = rows
        .iter()
        .map(|r| r.c.event.aggregate_type.as_str())
        .collect();
    let aggregate_id: Vec<&str> = rows
        .iter()
        .map(|r| r.c.event.aggregate_id.as_str())
        .collect();
    let event_type: Vec<&str> = rows.iter().map(|r| r.c.event.event_type.as_str()).collect();
    let payload: Vec<&str> = rows.iter().map(|r| r.c.event.payload.as_str()).collect();
    let created_at: Vec<SystemTime> = rows.iter().map(|r| r.c.event.created_at).collect();
    let attempts: Vec<i32> = rows.iter().map(|r| r.attempts).collect();
    let next_attempt_at: Vec<SystemTime> = rows.iter().map(|r| r.c.next_attempt_at).collect();
    let retry_in_ms: Vec<Option<i64>> = rows.iter().map(|r| r.retry_in_ms).collect();
    let last_error: Vec<Option<&str>> = rows.iter().map(|r| r.last_error.as_deref()).collect();
    let dead_at: Vec<Option<SystemTime>> = rows.iter().map(|r| r.c.dead_at).collect();
    let die: Vec<bool> = rows.iter().map(|r| r.die).collect();
    let sql = sql(
        schema,
        "INSERT INTO {s}.outbox (seq, id, aggregate_type, aggregate_id, type, payload, created_at,
                                 attempts, next_attempt_at, last_error, dead_at, xid)
         OVERRIDING SYSTEM VALUE
         SELECT seq, id, aggregate_type, aggregate_id, type, payload::jsonb, created_at, attempts,
                CASE WHEN retry_in_ms IS NULL THEN next_attempt_at
                     ELSE clock_timestamp() + retry_in_ms * interval '1 millisecond' END,
                last_error,
                CASE WHEN die THEN clock_timestamp() ELSE dead_at END,
                -- The inserting transaction's, not this one's: the commit order's key.
                xid::text::xid8
           FROM unnest($1::int8[], $2::uuid[], $3::text[], $4::text[], $5::text[], $6::text[],
                       $7::timestamptz[], $8::int4[], $9::timestamptz[], $10::int8[], $11::text[],
                       $12::timestamptz[], $13::bool[], $14::int8[])
             AS r(seq, id, aggregate_type, aggregate_id, type, payload, created_at, attempts,
                  next_attempt_at, retry_in_ms, last_error, dead_at, die, xid)",
    );
    client
        .execute_typed(
            &sql,
            &[
                (&seq, Type::INT8_ARRAY),
                (&id, Type::UUID_ARRAY),
                (&aggregate_type, Type::TEXT_ARRAY),
                (&aggregate_id, Type::TEXT_ARRAY),
                (&event_type, Type::TEXT_ARRAY),
                (&payload, Type::TEXT_ARRAY),
                (&created_at, Type::TIMESTAMPTZ_ARRAY),
                (&attempts, Type::INT4_ARRAY),
                (&next_attempt_at, Type::TIMESTAMPTZ_ARRAY),
                (&retry_in_ms, Type::INT8_ARRAY),
                (&last_error, Type::TEXT_ARRAY),
                (&dead_at, Type::TIMESTAMPTZ_ARRAY),
                (&die, Type::BOOL_ARRAY),
                (&xid, Type::INT8_ARRAY),
            ],
        )
        .await
}
