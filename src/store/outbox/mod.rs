//! The `outbox` table: every SQL statement on it: claiming a batch for the relay, putting back what was not
//! delivered, and the operator's list / retry / discard / backlog.
//!
//! # How a batch is claimed, and why per-aggregate order holds across relays
//!
//! An aggregate's *head* is its oldest event (lowest `seq`). Only heads are ever claimed
//! directly; the events behind a head are taken together with it, as a prefix of its chain, in
//! the same statement. [`claim`] is one `DELETE … RETURNING` run inside the relay's transaction:
//!
//! 1. a window of the oldest events (`--batch` × 2) of aggregates that are not *blocked* — whose
//!    events are neither dead nor waiting out a retry — so a dead aggregate never holds up the
//!    others. The window is an ordered scan of the partial index `outbox_live` (of
//!    `outbox_commit_order` for [`Order::Commit`]), which leaves dead events out
//!    (migrations/0010_live_events.sql), and each event it meets costs one probe of the partial
//!    index `outbox_held` for its aggregate (none while that index is empty): the claim never
//!    reads a dead event, so however many pile up it costs what it costs without them (docs/BENCHMARKS.md,
//!    "Dead heads ahead of live events", has the figures);
//! 2. the first event of each aggregate in that window — its head: an aggregate in the window
//!    has all its older events there too — locked `FOR UPDATE SKIP LOCKED`, `--batch` of them at
//!    most: a head another relay holds is skipped, and with it its whole aggregate;
//! 3. if that gives fewer than `--batch` heads (a burst on one aggregate, say, or aggregates whose
//!    heads other relays hold, or a session of this relay's that it lost and the server still
//!    keeps), a second window just past the first, of the events of the aggregates the first
//!    does not hold, looking up to 100 windows ahead, and its aggregates' heads, locked the same
//!    way, up to `--batch` heads in all: so the claim reaches past a busy or locked aggregate to
//!    the heads of others: a burst on one aggregate must not keep the others waiting or other
//!    relays idle, and a window filled by aggregates a stopped relay held must not leave this
//!    one claiming nothing until that relay's session ends;
//! 4. the windows' events of the aggregates whose head was locked, `--batch` of them: every
//!    head first, then the rest by `seq`. Each window is a `seq`-ordered run of the
//!    unblocked events of its aggregates, so each aggregate's events in it run contiguously
//!    from its head: each aggregate contributes a prefix of its chain, head first;
//! 5. those rows are deleted, which locks them until the transaction ends. (Heads locked but cut
//!    off by `--batch-bytes` stay locked until then too.)
//!
//! A second relay cannot take any event of an aggregate this relay is working on: the head is
//! locked, and every later event has an older event (the head) still visible to it until this
//! relay commits — by which time everything it deleted has been published. Rows are deleted
//! *before* publishing but the deletion is committed only *after* the sink confirmed them, so a
//! relay killed mid-batch leaves them all in place (at-least-once). What was not delivered is
//! put back by `restore` in the same transaction, with its original `seq` and `id`.
//!
//! # No session state
//!
//! Every statement here is unnamed (`query_typed`, or `batch_execute` where there are no
//! parameters), never a named prepared statement (`prepare`, or `query(&str, …)` which
//! prepares "s0", "s1"… behind the scenes): behind a transaction-mode pooler such as pgbouncer
//! each transaction may run on another server connection, where a named statement is missing
//! or already exists. For the same reason the claim's planner settings are `SET LOCAL`, inside
//! its own transaction, and nothing here sets anything for the session. An unnamed statement
//! is also planned afresh with its actual parameters every time (never a generic plan), and
//! `BEGIN` with the claim still go out in one round trip.
//!
//! # Insert order and commit order
//!
//! With [`Order::Insert`] an aggregate's order is `seq`, taken at insert: an event inserted with
//! a lower `seq` that commits after a higher one of the same aggregate is published after it.
//! Applications must serialise the transactions that write one aggregate, as they would any
//! write to it. [`Order::Commit`] (`relay --order commit`) reads everything above in
//! `(xid, seq)` order instead — windows, heads, the reach past them, the batch — over only the
//! events whose transaction is below the horizon of the claim's own snapshot
//! (`pg_snapshot_xmin`): every transaction that can still commit has an id at or past it, so
//! nothing can later appear ahead of an event already published. The index
//! `outbox_commit_order` on `(xid, seq)` (of the events that are not dead) makes the horizon an
//! index condition: the scan stops where the events of open transactions start. Put-backs keep the event's `xid`.
//!
//! # Bytes
//!
//! The batch is also bounded in payload bytes (`--batch-bytes`): the claim takes the longest
//! prefix of its order (heads first) whose payloads fit, and at least one event.
//!
//! # Claiming ahead
//!
//! While one batch is published, the relay claims the next on a second connection, so the
//! sink does not wait for the database between batches (`Relay::batch`). That claim is given
//! the `seq`s of the batch in hand and treats them as gone, although its snapshot still sees
//! them (their deletion is not committed yet): each aggregate's first event past them is its
//! head for this claim, and the prefix taken from there continues the one in hand. The relay
//! keeps the batch claimed ahead only if every event of the batch in hand was delivered, and
//! rolls it back **before** that batch commits otherwise, or when that batch's commit fails:
//! what it holds continues chains that are then not gone after all. So outside this relay's
//! two transactions the rule above is kept — whoever holds an event of an aggregate holds its
//! head: until the batch in hand commits, its events are the heads, held by the first
//! transaction; once it commits, the batch claimed ahead holds the new heads. The two
//! commit in order, and a batch claimed ahead is published only once the one before it was
//! confirmed, so an aggregate's events still leave one after another.

use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Row};

use super::{ms, sql};
use crate::db::Schema;
use crate::fmt::rfc3339;
use crate::model::order::Order;

/// One outbox event, ready to publish: what every sink gets.
#[derive(Debug, Clone)]
pub struct Event {
    /// Position in the outbox (creation order).
    pub seq: i64,
    /// The stable id consumers deduplicate on.
    pub id: uuid::Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    /// The event type (AMQP routing key, NATS subject suffix).
    pub event_type: String,
    /// The payload: PostgreSQL's jsonb text (valid JSON on one line).
    pub payload: String,
    pub created_at: SystemTime,
}

/// How many of the oldest events the claim looks at, per event it may return.
const WINDOW_FACTOR: i64 = 2;

/// How far past the window the claim looks for other aggregates' heads when the window gives
/// fewer than `--batch` heads, in windows: a burst of up to this many windows' events on a
/// few aggregates (20,000 events at `--batch 100`) cannot make the others wait for it. The look
/// costs a scan of up to that many rows, so the relay asks for it ([`claim`]'s `reach`) only
/// when it may find something: see `Relay::batch`.
pub const REACH_FACTOR: u32 = 100;

/// How far a claim looks past its window (step 3 of the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// Not at all: the window only.
    None,
    /// Through up to [`REACH_FACTOR`] windows of events, taking in the events of up to this
    /// many windows' worth (at least 1, at most [`REACH_FACTOR`]) of aggregates the first
    /// window does not hold.
    Windows(u32),
}

/// The claim statement; see the module documentation. `$1` = batch size, `$2` = window size,
/// `$3` = the cut-off (`--once` stops at what existed when it started; see [`ClaimLimits`]), `$4` = how
/// many events past the window to look through for other aggregates' heads, `$5` = the batch's
/// payload bytes (`--batch-bytes`), `$6` = the `seq`s of a batch this relay holds on another
/// connection, to count as gone (a claim ahead; empty otherwise), `$7` = whether the first event
/// is taken whatever its size (not when claiming ahead), `$8` = how many events past the window
/// to take in (see [`Reach`]). Placeholders for the order ([`Order`]): `{up_to}` (the events
/// within the cut-off `$3`), `{eligible}` (the events this order may publish now), `{key:X}` (an aggregate's order, for alias X), `{past}`
/// (past the first window), `{firsts:W}` (each aggregate's first event in window W).
const CLAIM: &str = "
WITH win1 AS MATERIALIZED (
    SELECT o.seq, o.xid, o.aggregate_type, o.aggregate_id,
           pg_column_size(o.payload) AS size, pg_column_compression(o.payload) IS NOT NULL AS packed
      FROM {s}.outbox o
     WHERE {up_to}{eligible}
       AND o.seq <> ALL ($6)
       -- Exactly the predicate of the indexes of migration 0010: the ordered scan reads only
       -- events that are not dead, and probes outbox_held once for each (a dead event's
       -- aggregate is held whole, so leaving dead events out changes nothing else).
       AND o.dead_at IS NULL AND {not_held:o}
     ORDER BY {key:o}
     LIMIT $2
), firsts1 AS (
    {firsts:win1}
), heads1 AS MATERIALIZED (
    SELECT o.seq, o.aggregate_type, o.aggregate_id
      FROM {s}.outbox o
     WHERE o.seq = ANY (ARRAY(SELECT seq FROM firsts1))
     ORDER BY {key:o}
     LIMIT $1
       FOR UPDATE SKIP LOCKED
), win2 AS MATERIALIZED (
    -- Only when the window gives fewer than $1 heads (a burst on a few aggregates, or
    -- aggregates whose heads other relays hold, or a session of this relay's that it lost):
    -- the events just past it of the aggregates it does not hold. The condition refers to
    -- nothing of this scan, so it is a one-time filter: otherwise the scan never runs. An
    -- aggregate absent from the window has all its events past it, so the first of its events
    -- seen here is its head, and its events here a prefix of its chain.
    -- It takes in $8 of those events: one window's worth at first, more while the claims
    -- that looked this far still came back short (their aggregates' heads were locked).
    SELECT p.seq, p.xid, p.aggregate_type, p.aggregate_id, p.size, p.packed
      FROM (SELECT o.seq, o.xid, o.aggregate_type, o.aggregate_id,
                   pg_column_size(o.payload) AS size,
                   pg_column_compression(o.payload) IS NOT NULL AS packed
              FROM {s}.outbox o
             WHERE {up_to}{eligible} AND o.dead_at IS NULL AND {past} AND o.seq <> ALL ($6)
             ORDER BY {key:o}
             LIMIT $4) p
     WHERE $4 > 0
       AND (SELECT count(*) FROM heads1) < $1
       AND (p.aggregate_type, p.aggregate_id) NOT IN (
            SELECT aggregate_type, aggregate_id FROM win1)
       AND {not_held:p}
     ORDER BY {key:p}
     LIMIT $8
), firsts2 AS (
    {firsts:win2}
), heads2 AS (
    SELECT o.seq, o.aggregate_type, o.aggregate_id
      FROM {s}.outbox o
     WHERE o.seq = ANY (ARRAY(SELECT seq FROM firsts2))
     ORDER BY {key:o}
     LIMIT $1 - (SELECT count(*) FROM heads1)
       FOR UPDATE SKIP LOCKED
), heads AS (
    SELECT * FROM heads1 UNION ALL SELECT * FROM heads2
), win AS (
    SELECT * FROM win1 UNION ALL SELECT * FROM win2
), picked AS MATERIALIZED (
    -- Every head first, then the rest in order: one long chain cannot fill the batch while
    -- other aggregates wait, and each aggregate still contributes a prefix of its chain.
    SELECT w.seq, w.xid, w.seq = h.seq AS head, w.size, w.packed
      FROM win w
      JOIN heads h ON h.aggregate_type = w.aggregate_type AND h.aggregate_id = w.aggregate_id
     ORDER BY w.seq = h.seq DESC, {key:w}
     LIMIT $1
), claimed AS (
    -- The longest prefix of that order within $5 payload bytes, and always its first event
    -- (so an event larger than $5 still goes, alone): a prefix of a list where heads come first and each aggregate's events
    -- follow in order still takes a prefix of each aggregate's chain. A payload stored
    -- compressed is measured as the text it will be sent as (one lookup for each of at most
    -- $1 events); any other by its stored size, which costs nothing.
    SELECT c.seq
      FROM (SELECT p.seq,
                   row_number() OVER run AS n,
                   sum(CASE WHEN p.packed
                            THEN (SELECT octet_length(b.payload::text) FROM {s}.outbox b
                                   WHERE b.seq = p.seq)
                            ELSE p.size END) OVER run AS bytes
              FROM picked p
            WINDOW run AS (ORDER BY p.head DESC, {key:p} ROWS UNBOUNDED PRECEDING)) c
     WHERE (c.n = 1 AND $7) OR c.bytes <= $5
)
DELETE FROM {s}.outbox o
 WHERE o.seq = ANY (ARRAY(SELECT seq FROM claimed))
RETURNING o.seq, o.xid::text::int8 AS xid, o.id, o.aggregate_type, o.aggregate_id, o.type,
          o.payload::text AS payload, o.created_at, o.attempts, o.next_attempt_at, o.last_error,
          o.dead_at, o.dead_at IS NOT NULL OR o.next_attempt_at > now() AS blocked,
          o.seq = ANY (ARRAY(SELECT seq FROM win2)) AS reached";

impl Order {
    /// The claim statement for this order, with the shared predicates and the schema spliced in.
    fn claim_sql(self, schema: &Schema) -> String {
        let (up_to, eligible, key, past, firsts) = match self {
            Order::Insert => (
                "o.seq <= $3",
                "",
                "A.seq",
                "o.seq > (SELECT coalesce(max(seq), 0) FROM win1)",
                "SELECT min(seq) AS seq FROM {w} GROUP BY aggregate_type, aggregate_id",
            ),
            // The horizon is an index condition on outbox_commit_order: the scan stops where
            // the events of transactions still in progress begin, however many there are.
            Order::Commit => (
                "o.xid <= ($3::text)::xid8",
                " AND o.xid < pg_snapshot_xmin(pg_current_snapshot())",
                "A.xid, A.seq",
                "(o.xid, o.seq) > ((SELECT max(xid) FROM win1),
                                   (SELECT max(seq) FROM win1
                                     WHERE xid = (SELECT max(xid) FROM win1)))",
                // min() over an array compares element by element; hashed by aggregate, where
                // DISTINCT ON would sort the window by its text keys (a third of the claim).
                "SELECT (min(ARRAY[xid::text::int8, seq]))[2] AS seq FROM {w}
                  GROUP BY aggregate_type, aggregate_id",
            ),
        };
        let mut t = CLAIM
            .replace("{up_to}", up_to)
            .replace("{eligible}", eligible)
            .replace("{past}", past)
            .replace("{firsts:win1}", &firsts.replace("{w}", "win1"))
            .replace("{firsts:win2}", &firsts.replace("{w}", "win2"));
        for alias in ["o", "p", "w"] {
            t = t.replace(
                &format!("{{key:{alias}}}"),
                &key.replace("A.", &format!("{alias}.")),
            );
        }
        sql(schema, &t)
    }
}

/// A claimed event: what the sink gets, plus the bookkeeping needed to put it back unchanged.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub event: Event,
    /// The inserting transaction's id (`xid8`; 0 for events from before migration 0009): the
    /// commit order's key, kept when the event is put back.
    pub xid: i64,
    pub attempts: i32,
    pub next_attempt_at: SystemTime,
    pub last_error: Option<String>,
    pub dead_at: Option<SystemTime>,
    /// Dead or not yet due: claimed only because it sits behind a head that is due (possible
    /// only when commit order differed from `seq` order). Never published in this batch.
    pub blocked: bool,
    /// Found past the window (step 2 of the claim), behind a busy or locked aggregate.
    pub reached: bool,
}

impl Claimed {
    fn from_row(r: &Row) -> Claimed {
        Claimed {
            event: Event {
                seq: r.get("seq"),
                id: r.get("id"),
                aggregate_type: r.get("aggregate_type"),
                aggregate_id: r.get("aggregate_id"),
                event_type: r.get("type"),
                payload: r.get("payload"),
                created_at: r.get("created_at"),
            },
            xid: r.get("xid"),
            attempts: r.get("attempts"),
            next_attempt_at: r.get("next_attempt_at"),
            last_error: r.get("last_error"),
            dead_at: r.get("dead_at"),
            blocked: r.get("blocked"),
            reached: r.get("reached"),
        }
    }
}

/// The published form: `{"id","aggregate_type","aggregate_id","type","payload","created_at"}`
/// (`relay --format json`, `outbox discard`; [`crate::relay::sink::format`] builds what sinks send)
/// on one line. `payload` is PostgreSQL's own jsonb text, spliced in as it is (valid JSON, never
/// a raw newline), which spares a parse and re-serialisation per event.
pub fn published_json(
    id: &uuid::Uuid,
    aggregate_type: &str,
    aggregate_id: &str,
    event_type: &str,
    payload: &str,
    created_at: SystemTime,
) -> String {
    let string = |s: &str| serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into());
    let mut out = String::with_capacity(payload.len() + 160);
    out.push_str("{\"id\":\"");
    out.push_str(&id.hyphenated().to_string());
    out.push_str("\",\"aggregate_type\":");
    out.push_str(&string(aggregate_type));
    out.push_str(",\"aggregate_id\":");
    out.push_str(&string(aggregate_id));
    out.push_str(",\"type\":");
    out.push_str(&string(event_type));
    out.push_str(",\"payload\":");
    out.push_str(payload);
    out.push_str(",\"created_at\":\"");
    out.push_str(&rfc3339(created_at));
    out.push_str("\"}");
    out
}

/// Opens a batch's transaction with the planner steered for the claim (see [`claim`]), so that
/// the claim's plan, and its cost, do not depend on the outbox's statistics.
///
/// A queue table is often empty, and a VACUUM of an empty outbox (the relay's or autovacuum's)
/// leaves statistics that say "no rows" until the next ANALYZE. Planned with those, the claim
/// joined its steps with nested loops that rescanned the table or the window once per row: a
/// burst after a quiet spell took seconds per batch instead of milliseconds. So the claim
/// reaches the table only through index conditions (`seq = ANY (…)`, the window's ordered scan,
/// the `outbox_held` probes), never through a join, and its transaction takes sequential and
/// bitmap scans and nested loops off the table: what is left are index scans and hash joins of
/// the window with itself, whatever the statistics say.
///
/// An outbox that was never analyzed (a bulk insert that autovacuum has not caught up with)
/// has no column statistics at all, and the planner then guesses that almost every row is dead
/// or waiting out a retry (`dead_at IS NOT NULL` defaults to 99.5%). Two things followed from
/// that guess, and the two settings below undo them:
///
/// * `jit = off`: the estimated cost went into the millions, past `jit_above_cost`, and every
///   claim was JIT-compiled with inlining and optimisation — about a second per batch for a
///   statement that runs in milliseconds, until someone ran ANALYZE. The claim touches at most `--batch` × 2 rows plus the blocked
///   ones; compiling it never pays.
/// * `hash_mem_multiplier = 1000` (its maximum): a `NOT IN` lookup is hashed only if the planner
///   *expects* it to fit in hash memory, and "almost every row" did not, so the blocked
///   aggregates' lookup (a `NOT IN` up to migration 0010, a probe per row since) became a rescan
///   of the blocked rows for every row of the window — quadratic once a few thousand events
///   were dead. The claim's hashes (the second window's lookup of the first, the joins of the
///   window with itself) hold at most the windows, so allowing more hash memory costs nothing
///   real; it only stops a guess from un-hashing them.
///
/// Why not ANALYZE the outbox when its statistics are missing: it needs the table's owner (a
/// relay often runs as a less privileged role), it would be stale again after the next bulk
/// insert, and the statistics only ever mattered through the two guesses above. `SET LOCAL`
/// keeps all of this to the batch's transaction (also behind a transaction-mode pooler); the
/// relay's other statements are planned normally.
const BEGIN_CLAIM: &str = "BEGIN;
    SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL enable_nestloop = off;
    SET LOCAL jit = off; SET LOCAL hash_mem_multiplier = 1000";

/// Sets a batch transaction's `idle_in_transaction_session_timeout` to `$1` milliseconds, unless
/// the session's own is shorter (an operator's, for the role or the database: the relay never
/// lengthens it), and returns the one now in force. `SET LOCAL` (`set_config(…, true)`): it ends
/// with the transaction, so a transaction-mode pooler is fine. The relay counts on it to know
/// how long the server may leave the transaction open while the relay publishes
/// ([`crate::relay::liveness`]).
const SET_IDLE: &str = "SELECT ms, set_config('idle_in_transaction_session_timeout', ms || 'ms', true) AS set
  FROM (SELECT least(nullif((extract(epoch FROM current_setting('idle_in_transaction_session_timeout')::interval)
                             * 1000)::int8, 0), $1) AS ms) t";

/// What one claim may take.
#[derive(Debug, Clone, Copy)]
pub struct ClaimLimits {
    /// Events (`--batch`).
    pub batch: i64,
    /// Payload bytes (`--batch-bytes`); the first event is taken whatever its size, except when
    /// claiming ahead.
    pub bytes: i64,
    /// The cut-off (`--once` stops at what existed when it started, [`cut_off`]): the highest
    /// `seq` to consider in [`Order::Insert`], the highest `xid` in [`Order::Commit`].
    pub up_to: i64,
    pub order: Order,
}

/// Opens a batch's transaction and claims up to `limits.batch` events in it, sorted in
/// `limits.order` (by `seq`, or by `(xid, seq)`); the transaction's idle timeout is set to
/// `idle` unless the session's own is shorter (`SET_IDLE`); all of it goes out together (one
/// round trip). With `reach`, the claim may look past its window for other aggregates' heads
/// (step 3 of the module documentation), taking in as much as [`Reach`] says. With `after`, it claims the batch that follows that
/// one, which this relay holds uncommitted on another connection ("Claiming ahead" in the module
/// documentation): its events count as gone, and the first event is taken only if it fits
/// `limits.bytes` too, so the two batches together stay within it. Returns the events and the
/// idle timeout in force. On error the transaction is rolled back. The caller ends it with
/// [`settle`] or [`rollback`].
pub async fn claim(
    client: &Client,
    schema: &Schema,
    limits: ClaimLimits,
    reach: Reach,
    after: Option<&[Claimed]>,
    idle: Duration,
) -> Result<(Vec<Claimed>, Duration), tokio_postgres::Error> {
    let (rows, idle) =
        begin_and_claim(client, schema, limits, reach, after, Some(idle), "").await?;
    let mut claimed: Vec<Claimed> = rows.iter().map(Claimed::from_row).collect();
    match limits.order {
        Order::Insert => claimed.sort_unstable_by_key(|c| c.event.seq),
        Order::Commit => claimed.sort_unstable_by_key(|c| (c.xid, c.event.seq)),
    }
    Ok((claimed, idle.unwrap_or_default()))
}

/// What [`claim`] does, as `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)` shows it: the same
/// statement with the same parameters in a transaction opened the same way, run and then rolled
/// back, so nothing is claimed. For tests and benchmarks: which plan the claim gets, and how many
/// rows and buffers it touches (`[0]["Plan"]` counts those of the whole statement).
pub async fn explain_claim(
    client: &Client,
    schema: &Schema,
    limits: ClaimLimits,
    reach: bool,
) -> Result<serde_json::Value, tokio_postgres::Error> {
    let reach = if reach {
        Reach::Windows(1)
    } else {
        Reach::None
    };
    let (rows, _) = begin_and_claim(
        client,
        schema,
        limits,
        reach,
        None,
        None,
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ",
    )
    .await?;
    rollback(client).await?;
    Ok(rows.first().map(|r| r.get(0)).unwrap_or_default())
}

/// [`BEGIN_CLAIM`], [`SET_IDLE`] (with `idle`) and the claim statement (after `prefix`), in one
/// round trip; returns the claim's rows and the idle timeout in force. On error the transaction
/// is rolled back.
async fn begin_and_claim(
    client: &Client,
    schema: &Schema,
    limits: ClaimLimits,
    reach: Reach,
    after: Option<&[Claimed]>,
    idle: Option<Duration>,
    prefix: &str,
) -> Result<(Vec<Row>, Option<Duration>), tokio_postgres::Error> {
    let ClaimLimits {
        batch,
        bytes,
        up_to,
        order,
    } = limits;
    let window = batch.saturating_mul(WINDOW_FACTOR);
    let (reach, taken_in) = match reach {
        Reach::None => (0, window),
        Reach::Windows(n) => (
            window.saturating_mul(i64::from(REACH_FACTOR)),
            window.saturating_mul(i64::from(n.clamp(1, REACH_FACTOR))),
        ),
    };
    let claim = format!("{prefix}{}", order.claim_sql(schema));
    let gone: Vec<i64> = after
        .unwrap_or_default()
        .iter()
        .map(|c| c.event.seq)
        .collect();
    let first_always = after.is_none();
    let params: [(&(dyn ToSql + Sync), Type); 8] = [
        (&batch, Type::INT8),
        (&window, Type::INT8),
        (&up_to, Type::INT8),
        (&reach, Type::INT8),
        (&bytes, Type::INT8),
        (&gone, Type::INT8_ARRAY),
        (&first_always, Type::BOOL),
        (&taken_in, Type::INT8),
    ];
    let idle_ms = idle.map(ms);
    let set_idle = async {
        match idle_ms {
            Some(idle_ms) => client
                .query_typed_one(SET_IDLE, &[(&idle_ms, Type::INT8)])
                .await
                .map(|r| Some(r.get::<_, i64>("ms"))),
            None => Ok(None),
        }
    };
    let (begun, set, rows) = tokio::join!(
        client.batch_execute(BEGIN_CLAIM),
        set_idle,
        client.query_typed(&claim, &params)
    );
    let done = begun.and(set).and_then(|set| Ok((rows?, set)));
    match done {
        Ok((rows, set)) => Ok((
            rows,
            set.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
        )),
        Err(e) => {
            let _ = rollback(client).await;
            Err(e)
        }
    }
}

/// Ends a batch's transaction without changing anything: every claimed event is back.
pub async fn rollback(client: &Client) -> Result<(), tokio_postgres::Error> {
    client.batch_execute("ROLLBACK").await
}

/// Why a batch could not be settled, and whether its transaction may have committed all the
/// same.
#[derive(Debug)]
pub struct SettleFailed {
    pub error: tokio_postgres::Error,
    /// The COMMIT went out and no answer came back (the connection broke): the transaction may
    /// have committed or not, and nobody can tell which. Otherwise it certainly rolled back.
    pub outcome_unknown: bool,
}

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
        Ok(_) => match client.batch_execute("COMMIT").await {
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

/// Vacuums the outbox so it and its indexes stay small after heavy draining. Returns `false`,
/// without vacuuming, when the role may not: VACUUM needs the table's (or the database's)
/// owner, or from PostgreSQL 17 the MAINTAIN privilege, and without it only warns and skips the
/// table — a warning the relay would never see.
pub async fn vacuum(client: &Client, schema: &Schema) -> Result<bool, tokio_postgres::Error> {
    let may = client
        .query_typed_one(
            &sql(
                schema,
                "SELECT pg_has_role(c.relowner, 'USAGE') OR pg_has_role(d.datdba, 'USAGE')
                        OR CASE WHEN current_setting('server_version_num')::int >= 170000
                                THEN has_table_privilege(c.oid, 'MAINTAIN') ELSE false END
                   FROM pg_class c, pg_database d
                  WHERE c.oid = '{s}.outbox'::regclass AND d.datname = current_database()",
            ),
            &[],
        )
        .await?
        .try_get(0)?;
    if may {
        client
            .batch_execute(&sql(schema, "VACUUM (SKIP_LOCKED) {s}.outbox"))
            .await?;
    }
    Ok(may)
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

/// Where `--once` stops: a cut through the outbox as it is now that takes a prefix of every
/// aggregate's order, so that what it leaves for a later relay only ever follows what it
/// publishes (0 when empty).
///
/// In [`Order::Insert`] that is the highest `seq`. In [`Order::Commit`] it is the highest `xid`
/// of a live event: a transaction older than that one may still be open and insert more
/// events, whose `seq`s come after every one seen now but whose place in the aggregate's
/// order is before that newest transaction's events. A cut on `seq` published an aggregate's
/// events 1 and 3 and left 2, of the older transaction, to the next relay. (Dead events are
/// never claimed, so they do not count; the partial index `outbox_commit_order` answers it.)
pub async fn cut_off(client: &Client, schema: &Schema, order: Order) -> Result<i64> {
    let query = match order {
        Order::Insert => "SELECT coalesce(max(seq), 0) AS up_to FROM {s}.outbox",
        Order::Commit => {
            "SELECT coalesce((SELECT xid::text::int8 FROM {s}.outbox WHERE dead_at IS NULL
                               ORDER BY xid DESC, seq DESC LIMIT 1), 0) AS up_to"
        }
    };
    let row = client
        .query_typed_one(&sql(schema, query), &[])
        .await
        .context("cannot read the outbox")?;
    Ok(row.get("up_to"))
}

/// The commit order's horizon now: `pg_snapshot_xmin` of a fresh snapshot (the oldest
/// transaction still in progress), and whether committed events wait behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Horizon {
    pub xmin: i64,
    /// Some visible (so committed) event that is not dead has an `xid` at or past the horizon:
    /// `--order commit` may not publish it yet.
    pub held: bool,
}

/// Reads the [`Horizon`]: one probe of `outbox_commit_order` (live events only: a dead one is
/// not waiting for the horizon, and the index leaves it out) from the horizon on.
pub async fn commit_horizon(client: &Client, schema: &Schema) -> Result<Horizon> {
    let row = client
        .query_typed_one(
            &sql(
                schema,
                "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::int8 AS xmin,
                        EXISTS (SELECT 1 FROM {s}.outbox o
                                 WHERE o.xid >= pg_snapshot_xmin(pg_current_snapshot())
                                   AND o.dead_at IS NULL) AS held",
            ),
            &[],
        )
        .await
        .context("cannot read the outbox")?;
    Ok(Horizon {
        xmin: row.get("xmin"),
        held: row.get("held"),
    })
}

/// A backend (or prepared transaction) that holds the relay back, as `pg_stat_activity` shows
/// it; fields another role's session hides are `None`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// `None` for a prepared transaction (it has no backend).
    pub pid: Option<i32>,
    pub state: Option<String>,
    pub application_name: Option<String>,
    /// How long its transaction has been open.
    pub xact_ms: Option<i64>,
    /// How many transactions old its snapshot is (`age(backend_xmin)`), for a horizon holder.
    pub xmin_age: Option<i32>,
    /// The prepared transaction's gid.
    pub gid: Option<String>,
}

impl Holder {
    fn from_row(r: &Row) -> Holder {
        Holder {
            pid: r.get("pid"),
            state: r.get("state"),
            application_name: r.get("application_name"),
            xact_ms: r.get("xact_ms"),
            xmin_age: r.get("xmin_age"),
            gid: r.get("gid"),
        }
    }
}

/// The backend whose transaction has id `xid` (the commit order's horizon), or the prepared
/// transaction that has it. 32-bit `backend_xid` is compared with the low half of the `xid8`.
pub async fn xid_holder(client: &Client, xid: i64) -> Result<Option<Holder>> {
    let row = client
        .query_typed_opt(
            "SELECT a.pid, a.state, a.application_name,
                    round(extract(epoch FROM clock_timestamp() - a.xact_start) * 1000)::int8 AS xact_ms,
                    NULL::int4 AS xmin_age, NULL::text AS gid
               FROM pg_stat_activity a
              WHERE a.backend_xid::text::int8 = $1 % 4294967296
             UNION ALL
             SELECT NULL, 'prepared', NULL,
                    round(extract(epoch FROM clock_timestamp() - p.prepared) * 1000)::int8,
                    NULL, p.gid
               FROM pg_prepared_xacts p
              WHERE p.transaction::text::int8 = $1 % 4294967296
             LIMIT 1",
            &[(&xid, Type::INT8)],
        )
        .await
        .context("cannot read pg_stat_activity")?;
    Ok(row.as_ref().map(Holder::from_row))
}

/// The backends of this database (and walsenders) that hold back the xmin horizon, oldest
/// first, at most three, each with its transaction open at least `min_ms`: an open snapshot
/// (`backend_xmin`) or an open transaction with an id (`backend_xid`, which every later
/// snapshot's xmin then carries). VACUUM cannot remove the rows the relay deleted since, and
/// every claim wades through them, and a drain slows down by as much.
/// Among backends whose xmin is equally old, the one whose own transaction id it is comes
/// first: the others only inherited it.
pub async fn horizon_holders(client: &Client, min_ms: i64) -> Result<Vec<Holder>> {
    let rows = client
        .query_typed(
            "SELECT pid, state, application_name, xact_ms, xmin_age, NULL::text AS gid
               FROM (SELECT pid, state, application_name,
                            greatest(age(backend_xid), age(backend_xmin)) AS xmin_age,
                            age(backend_xid) AS xid_age,
                            round(extract(epoch FROM clock_timestamp()
                                  - coalesce(xact_start, query_start, backend_start)) * 1000)::int8 AS xact_ms
                       FROM pg_stat_activity
                      WHERE (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
                        AND pid <> pg_backend_pid()
                        AND coalesce(datname = current_database(), true)) a
              WHERE xact_ms >= $1
              ORDER BY xmin_age DESC, xid_age DESC NULLS LAST, xact_ms DESC
              LIMIT 3",
            &[(&min_ms, Type::INT8)],
        )
        .await
        .context("cannot read pg_stat_activity")?;
    Ok(rows.iter().map(Holder::from_row).collect())
}

/// When the earliest retry falls due, if any event is waiting out a backoff.
pub async fn next_retry_in(client: &Client, schema: &Schema) -> Result<Option<Duration>> {
    let row = client
        .query_typed_one(
            &sql(
                schema,
                "SELECT round(extract(epoch FROM min(next_attempt_at) - now()) * 1000)::int8 AS ms
                   FROM {s}.outbox
                  WHERE {held} AND {held_now} AND dead_at IS NULL",
            ),
            &[],
        )
        .await
        .context("cannot read the outbox")?;
    Ok(row
        .get::<_, Option<i64>>("ms")
        .map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0))))
}

/// The backlog `status` and the relay's progress line show.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backlog {
    /// Not yet delivered and not dead (includes events waiting out a retry).
    pub pending: i64,
    /// Of those, waiting out a retry after a failed attempt.
    pub retrying: i64,
    pub dead: i64,
    /// Age of the oldest pending event.
    pub oldest_pending_ms: Option<i64>,
}

pub async fn backlog(client: &Client, schema: &Schema) -> Result<Backlog> {
    let row = client
        .query_typed_one(
            &sql(
                schema,
                "SELECT count(*) FILTER (WHERE dead_at IS NULL) AS pending,
                        count(*) FILTER (WHERE dead_at IS NULL AND attempts > 0) AS retrying,
                        count(*) FILTER (WHERE dead_at IS NOT NULL) AS dead,
                        round(extract(epoch FROM now() - min(created_at) FILTER (WHERE dead_at IS NULL)) * 1000)::int8
                          AS oldest_pending_ms
                   FROM {s}.outbox",
            ),
            &[],
        )
        .await
        .context("cannot read the outbox backlog")?;
    Ok(Backlog {
        pending: row.get("pending"),
        retrying: row.get("retrying"),
        dead: row.get("dead"),
        oldest_pending_ms: row.get("oldest_pending_ms"),
    })
}

/// One row of `outbox list`.
#[derive(Debug, Clone)]
pub struct Listed {
    pub seq: i64,
    pub id: uuid::Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub payload: serde_json::Value,
    pub created_at: SystemTime,
    pub attempts: i32,
    pub next_attempt_at: SystemTime,
    pub last_error: Option<String>,
    pub dead_at: Option<SystemTime>,
    /// `pending`, `retrying` (waiting out a backoff), `scheduled` (inserted with a future
    /// `next_attempt_at`), `blocked` (behind a dead or not yet due event) or `dead`.
    pub state: &'static str,
}

/// Undelivered events in `seq` order (only dead ones with `dead_only`), at most `limit`, and
/// how many matched in all.
pub async fn list(
    client: &Client,
    schema: &Schema,
    dead_only: bool,
    limit: i64,
) -> Result<(Vec<Listed>, i64)> {
    let sql = sql(
        schema,
        "SELECT o.seq, o.id, o.aggregate_type, o.aggregate_id, o.type, o.payload, o.created_at,
                o.attempts, o.next_attempt_at, o.last_error, o.dead_at,
                EXISTS (SELECT 1 FROM {s}.outbox b
                         WHERE {held}
                           AND {agg_key:b} = {agg_key:o}
                           AND b.seq < o.seq
                           AND b.aggregate_type = o.aggregate_type
                           AND b.aggregate_id = o.aggregate_id
                           AND {held_now}) AS blocked,
                count(*) OVER () AS total,
                o.next_attempt_at > now() AS scheduled
           FROM {s}.outbox o
          WHERE NOT $1 OR o.dead_at IS NOT NULL
          ORDER BY o.seq
          LIMIT $2",
    );
    let rows = client
        .query_typed(&sql, &[(&dead_only, Type::BOOL), (&limit, Type::INT8)])
        .await
        .context("cannot read the outbox")?;
    let total = rows.first().map_or(0, |r| r.get::<_, i64>("total"));
    let listed = rows
        .iter()
        .map(|r| {
            let attempts: i32 = r.get("attempts");
            let dead_at: Option<SystemTime> = r.get("dead_at");
            let blocked: bool = r.get("blocked");
            let state = if dead_at.is_some() {
                "dead"
            } else if blocked {
                "blocked"
            } else if attempts > 0 {
                "retrying"
            } else if r.get::<_, bool>("scheduled") {
                "scheduled"
            } else {
                "pending"
            };
            Listed {
                seq: r.get("seq"),
                id: r.get("id"),
                aggregate_type: r.get("aggregate_type"),
                aggregate_id: r.get("aggregate_id"),
                event_type: r.get("type"),
                payload: r.get("payload"),
                created_at: r.get("created_at"),
                attempts,
                next_attempt_at: r.get("next_attempt_at"),
                last_error: r.get("last_error"),
                dead_at,
                state,
            }
        })
        .collect();
    Ok((listed, total))
}

/// Which events `outbox retry` re-queues.
#[derive(Debug, Clone, Copy)]
pub enum RetryWhich {
    One(uuid::Uuid),
    AllDead,
}

/// Makes events due now with a fresh attempt budget (dead ones come back to life), wakes the
/// relays, and returns how many were re-queued.
pub async fn retry(client: &Client, schema: &Schema, which: RetryWhich) -> Result<u64> {
    let (filter, id) = match which {
        RetryWhich::One(id) => ("id = $1", Some(id)),
        RetryWhich::AllDead => ("dead_at IS NOT NULL AND $1::uuid IS NULL", None),
    };
    let sql = sql(
        schema,
        &format!(
            "WITH requeued AS (
             UPDATE {{s}}.outbox SET attempts = 0, next_attempt_at = now(), dead_at = NULL
              WHERE {filter}
             RETURNING 1)
         SELECT count(*) AS n, pg_notify($2, '') FROM requeued"
        ),
    );
    let row = client
        .query_typed_one(
            &sql,
            &[(&id, Type::UUID), (&schema.outbox_channel(), Type::TEXT)],
        )
        .await
        .context("cannot re-queue the events")?;
    Ok(u64::try_from(row.get::<_, i64>("n")).unwrap_or(0))
}

/// True when a relay's batch holds the event right now (it is being delivered: its row is
/// locked by the batch's transaction), so that `outbox retry` can say so before waiting for it.
pub async fn in_a_batch(client: &Client, schema: &Schema, id: uuid::Uuid) -> Result<bool> {
    let probe = client
        .query_typed(
            &sql(
                schema,
                "SELECT 1 FROM {s}.outbox WHERE id = $1 FOR UPDATE NOWAIT",
            ),
            &[(&id, Type::UUID)],
        )
        .await;
    match probe {
        Ok(_) => Ok(false),
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) => {
            Ok(true)
        }
        Err(e) => Err(e).context("cannot read the outbox"),
    }
}

/// Whether the outbox still holds event `id`, in whatever state.
async fn exists(client: &Client, schema: &Schema, id: uuid::Uuid) -> Result<bool> {
    let row = client
        .query_typed_opt(
            &sql(schema, "SELECT 1 FROM {s}.outbox WHERE id = $1"),
            &[(&id, Type::UUID)],
        )
        .await
        .context("cannot read the outbox")?;
    Ok(row.is_some())
}

/// [`retry`] of one event, also when a relay's batch holds it: the UPDATE then waits for the
/// batch, and if the batch put the event back (refused, or not reached) the row it waited for
/// is gone and the put-back one is new to the statement's snapshot — so it is looked up again,
/// a few times, rather than reporting "no event" for an event that is still there, retrying.
/// Returns whether it was re-queued; `false` means it is gone (delivered or
/// discarded).
pub async fn retry_one(client: &Client, schema: &Schema, id: uuid::Uuid) -> Result<bool> {
    for _ in 0..5 {
        if retry(client, schema, RetryWhich::One(id)).await? > 0 {
            return Ok(true);
        }
        if !exists(client, schema, id).await? {
            return Ok(false);
        }
    }
    Ok(false)
}

/// A discarded event, in its published form, and whether it was dead.
pub struct Discarded {
    pub json: String,
    pub dead: bool,
    pub attempts: i32,
}

/// Deletes one event. Unless `any_state`, only a dead one: discarding a live event would skip
/// it silently. Returns `Err` naming the reason when nothing was discarded.
pub async fn discard(
    client: &Client,
    schema: &Schema,
    id: uuid::Uuid,
    any_state: bool,
) -> Result<Result<Discarded, String>> {
    let delete = sql(
        schema,
        "DELETE FROM {s}.outbox
          WHERE id = $1 AND ($2 OR dead_at IS NOT NULL)
         RETURNING id, aggregate_type, aggregate_id, type, payload::text AS payload, created_at,
                   dead_at IS NOT NULL AS dead, attempts",
    );
    let rows = client
        .query_typed(&delete, &[(&id, Type::UUID), (&any_state, Type::BOOL)])
        .await
        .context("cannot discard the event")?;
    if let Some(r) = rows.first() {
        let json = published_json(
            &r.get("id"),
            r.get("aggregate_type"),
            r.get("aggregate_id"),
            r.get("type"),
            r.get("payload"),
            r.get("created_at"),
        );
        return Ok(Ok(Discarded {
            json,
            dead: r.get("dead"),
            attempts: r.get("attempts"),
        }));
    }
    Ok(Err(match exists(client, schema, id).await? {
        true => format!(
            "event {id} is not dead; discarding it would skip it silently (use --force to discard it anyway)"
        ),
        false => format!("no event {id} in the outbox (already delivered or discarded?)"),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_json_is_one_valid_line_with_spec_keys() {
        let id = uuid::Uuid::nil();
        let t = SystemTime::UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456);
        let s = published_json(
            &id,
            "order",
            "4\"2\n",
            "order.paid",
            r#"{"total": 1500}"#,
            t,
        );
        assert!(!s.contains('\n'));
        let v: serde_json::Value = serde_json::from_str(&s).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "id",
                "aggregate_type",
                "aggregate_id",
                "type",
                "payload",
                "created_at"
            ]
        );
        assert_eq!(v["aggregate_id"], "4\"2\n");
        assert_eq!(v["payload"]["total"], 1500);
        assert_eq!(v["created_at"], "2023-11-14T22:13:20.123456Z");
        assert_eq!(v["id"], "00000000-0000-0000-0000-000000000000");
    }
}
