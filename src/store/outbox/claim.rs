//! Claiming a batch: the claim statement and its templates for each [`Order`], the limits it
//! takes ([`ClaimLimits`], [`Reach`]), the transaction it opens (the planner settings and the
//! idle timeout, sent with it in one round trip), `EXPLAIN` of it for tests and benchmarks, and
//! `--once`'s cut-off. How and why a batch is claimed this way is the module documentation of
//! [`super`]; the batch is ended by [`super::settle()`] or [`super::rollback`].

use std::borrow::Cow;
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use tokio_postgres::types::{FromSql, ToSql, Type};
use tokio_postgres::{Client, Row};

use super::prepared::{Key, Prepared};
use super::{rollback, Event};
use crate::db::Schema;
use crate::model::order::Order;
use crate::store::{ms, sql};

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

/// The plain claim (the module documentation's "The plain claim"): the first `$1` events, taken
/// whole, or nothing and a reason why not. `$1` = batch size, `$2` = window size,
/// `$3` = the cut-off, `$4` = the batch's payload bytes, `$5` = the `seq`s of a batch this relay
/// holds on another connection (as [`CLAIM`]'s `$6`). The same placeholders as [`CLAIM`].
///
/// It returns the claimed events and leaves its verdict in [`VERDICT`]: `taken N` (N: how many
/// events the `DELETE` must have returned, else the batch is not taken: see [`taken`]), `empty`, or
/// why it took nothing: `held` (an event of some aggregate is
/// dead or waiting out a retry), `packed` (a payload is stored compressed), `bytes` (the events
/// exceed `$4`), `spread` (an aggregate's head lies past the first `$1` events but within the
/// general claim's window, which takes it first), `locked` (another transaction holds or removed
/// one of the heads).
const CLAIM_PLAIN: &str = "
WITH win1 AS MATERIALIZED (
    -- Each row's ctid: the lock of the heads and the DELETE fetch the rows by it (a tid scan)
    -- instead of descending the primary key once per event, about a tenth of the statement.
    SELECT o.ctid, o.seq, o.xid, o.aggregate_type, o.aggregate_id,
           pg_column_size(o.payload) AS size,
           pg_column_compression(o.payload) IS NOT NULL AS packed
      FROM {s}.outbox o
     WHERE {up_to}{eligible} AND o.seq <> ALL ($5) AND o.dead_at IS NULL
     ORDER BY {key:o}
     LIMIT $1
), firsts1 AS MATERIALIZED (
    -- Each aggregate's head among these events (its first: with nothing held, its chain here
    -- runs from it).
    {firsts:win1}
), plain AS MATERIALIZED (
    -- What can be told without locking anything. With no event held anywhere, every event is
    -- due, and each aggregate's events here run from its head.
    SELECT count(*) > 0 AS seen,
           CASE WHEN EXISTS (SELECT 1 FROM {s}.outbox b WHERE {held}) THEN 'held'
                WHEN bool_or(w.packed) THEN 'packed'
                WHEN coalesce(sum(w.size), 0) > $4 THEN 'bytes'
                -- The general claim takes every head of its window ($2 events) first: these
                -- events are what it takes when they are all heads, or when no other
                -- aggregate has an event in the rest of its window — looked at only if some
                -- aggregate has more than one event here (else the condition is false first).
                WHEN (SELECT count(*) FROM firsts1) < count(*) AND EXISTS (
                     SELECT 1
                       FROM (SELECT o.aggregate_type, o.aggregate_id
                               FROM {s}.outbox o
                              WHERE {up_to}{eligible} AND o.dead_at IS NULL AND {past}
                                AND o.seq <> ALL ($5)
                              ORDER BY {key:o}
                              LIMIT $2 - $1) p
                      WHERE (p.aggregate_type, p.aggregate_id) NOT IN (
                            SELECT aggregate_type, aggregate_id FROM win1)) THEN 'spread'
           END AS declined
      FROM win1 w
), locked AS MATERIALIZED (
    -- The heads, as the general claim locks them: whoever holds an aggregate's head holds the
    -- aggregate (the `DELETE` then locks the events behind them).
    SELECT o.seq
      FROM {s}.outbox o
     WHERE o.ctid = ANY (ARRAY(SELECT w.ctid FROM win1 w JOIN firsts1 f ON f.seq = w.seq
                                WHERE (SELECT declined IS NULL FROM plain)))
       FOR UPDATE SKIP LOCKED
), verdict AS MATERIALIZED (
    -- An event skipped by the lock is another transaction's, or gone since the window's
    -- snapshot: the general claim sorts that out (it skips the aggregate). The verdict goes
    -- to the transaction's setting {verdict} (see `PLAIN_VERDICT`).
    SELECT set_config('{verdict}',
                      CASE WHEN NOT (SELECT seen FROM plain) THEN 'empty'
                           WHEN (SELECT declined FROM plain) IS NOT NULL
                           THEN (SELECT declined FROM plain)
                           WHEN (SELECT count(*) FROM locked) < (SELECT count(*) FROM firsts1)
                           THEN 'locked'
                           -- With how many events the DELETE must return: it skips a row
                           -- another transaction changed or removed since the window read it
                           -- (the newer version is not at the ctid read), and a batch without
                           -- that event is not a prefix of its aggregate's chain.
                           ELSE 'taken ' || (SELECT count(*) FROM win1)
                      END, true) AS said
)
DELETE FROM {s}.outbox o
 WHERE o.ctid = ANY (ARRAY(SELECT ctid FROM win1)) AND (SELECT said LIKE 'taken %' FROM verdict)
RETURNING o.seq, o.xid, o.id, o.aggregate_type, o.aggregate_id, o.type,
          o.payload::text AS payload, o.created_at, o.attempts, o.next_attempt_at, o.last_error,
          o.dead_at, o.dead_at IS NOT NULL OR o.next_attempt_at > now() AS blocked,
          false AS reached";

/// The transaction-local setting the plain claim leaves its verdict in: `taken` (the rows it
/// returned are the batch), `empty` (no event is due), or why it declined. A `DELETE …
/// RETURNING` can only return deleted rows, and wrapping it in a query that could add a row
/// with the verdict made the server copy every returned row once more (a fifth of the plain
/// claim's work); the setting is read in the same round trip, right after the claim
/// ([`PLAIN_VERDICT`]), and ends with the transaction (`set_config(…, true)`, as `SET LOCAL`).
const VERDICT: &str = "leasectl.plain_claim";

/// Reads the plain claim's verdict ([`VERDICT`]).
const PLAIN_VERDICT: &str = "SELECT current_setting('leasectl.plain_claim', true) AS verdict";

impl Order {
    /// A claim statement (`template`: [`CLAIM`] or [`CLAIM_PLAIN`]) for this order, with the shared predicates and the schema spliced in.
    fn claim_sql(self, schema: &Schema, template: &str) -> String {
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
        let mut t = template
            .replace("{verdict}", VERDICT)
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
    /// A claim's row, read by position in the order both `RETURNING` lists give the columns
    /// (the test `both_claims_return_the_same_columns` holds the list): looking a name up
    /// compared it with every column's name, for each of a batch's thousand rows and fourteen
    /// columns.
    fn from_row(r: &Row) -> Claimed {
        Claimed {
            event: Event {
                seq: r.get(0),
                id: r.get(2),
                aggregate_type: r.get(3),
                aggregate_id: r.get(4),
                event_type: r.get(5),
                payload: r.get(6),
                created_at: r.get(7),
            },
            xid: r.get::<_, Xid>(1).0,
            attempts: r.get(8),
            next_attempt_at: r.get(9),
            last_error: r.get(10),
            dead_at: r.get(11),
            blocked: r.get(12),
            reached: r.get(13),
        }
    }
}

/// An event's `xid` as the relay keeps it: the general claim returns it as `int8`, the plain
/// claim as the column's own `xid8` (an unsigned 64-bit number; converting it to text and
/// back on the server cost a few percent of the plain claim).
struct Xid(i64);

impl<'a> FromSql<'a> for Xid {
    fn from_sql(
        ty: &Type,
        raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        let bytes: [u8; 8] = raw.try_into()?;
        if *ty == Type::INT8 {
            return Ok(Xid(i64::from_be_bytes(bytes)));
        }
        Ok(Xid(i64::try_from(u64::from_be_bytes(bytes))?))
    }

    fn accepts(ty: &Type) -> bool {
        *ty == Type::INT8 || *ty == Type::XID8
    }
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
///
/// `plan_cache_mode = force_generic_plan`: a claim prepared once per connection was still
/// planned again at every execution. PostgreSQL plans a prepared statement for its parameters'
/// values until a plan for any values looks no dearer, and a `LIMIT $1` it cannot see made that
/// plan look ten times the rows: the server spent about 0.4 ms of every batch of 1000 planning
/// the claim again (the `bind` lines of a server log: 23–25 ms against 4.5–5 ms per 50 batches).
/// The claim's plan does not depend on the values (index scans and hash joins only, as above),
/// so the plan made once serves every batch. An unnamed statement (behind a pooler, and a claim
/// ahead, whose excluded `seq`s are hashed only when their values are known) is planned for
/// its values whatever this says.
const BEGIN_CLAIM: &str = "BEGIN;
    SET LOCAL enable_seqscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL enable_nestloop = off;
    SET LOCAL jit = off; SET LOCAL hash_mem_multiplier = 1000; SET LOCAL plan_cache_mode = force_generic_plan";

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

/// Which statement claimed a batch ([`Claim::via`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// The plain claim.
    Plain,
    /// The general claim (`CLAIM`), not preceded by the plain one: it was not asked for, or
    /// the claim looks past its window ([`Reach`]), which only the general claim does.
    General,
    /// The general claim, after the plain one declined for this reason (and took nothing).
    Fallback(Declined),
}

/// Why the plain claim took nothing (see `CLAIM_PLAIN`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Declined {
    /// An event of some aggregate is dead or waiting out a retry.
    Held,
    /// A payload among the events is stored compressed (its size as text is not at hand).
    Packed,
    /// The events exceed the batch's payload bytes.
    Bytes,
    /// An aggregate's head lies past the events it would take.
    Spread,
    /// Another transaction holds, changed or removed one of the events.
    Locked,
}

impl Declined {
    fn parse(reason: &str) -> Declined {
        match reason {
            "held" => Declined::Held,
            "packed" => Declined::Packed,
            "bytes" => Declined::Bytes,
            "spread" => Declined::Spread,
            // "locked", a `taken N` whose DELETE returned fewer than N events, or no verdict
            // at all: the general claim decides.
            _ => Declined::Locked,
        }
    }

    /// The reason in a few words, for `-v`.
    pub fn describe(self) -> &'static str {
        match self {
            Declined::Held => "an event is dead or waiting out a retry",
            Declined::Packed => "a payload is stored compressed",
            Declined::Bytes => "the batch exceeds --batch-bytes",
            Declined::Spread => "aggregates' heads lie past the batch",
            Declined::Locked => "another transaction holds, changed or removed some of the events",
        }
    }
}

/// A claimed batch: its events, the idle timeout its transaction has, and which statement
/// claimed it.
#[derive(Debug)]
pub struct Claim {
    pub events: Vec<Claimed>,
    pub idle: Duration,
    pub via: Via,
}

/// The connection a claim goes out on: its client, the schema, and — on a connection that
/// reaches its own server session, never behind a transaction-mode pooler — its cache of
/// prepared claim statements ([`Prepared`]).
#[derive(Clone, Copy)]
pub struct Session<'a> {
    pub client: &'a Client,
    pub schema: &'a Schema,
    pub prepared: Option<&'a Prepared>,
}

/// What one claim asks for besides its [`ClaimLimits`]: how far past its window it may look
/// (`reach`), the batch this relay holds on another connection that it follows (`after`), and
/// whether it may try the plain claim first (`plain`).
#[derive(Clone, Copy)]
pub struct Ask<'a> {
    pub reach: Reach,
    pub after: Option<&'a [Claimed]>,
    pub plain: bool,
}

/// Opens a batch's transaction and claims up to `limits.batch` events in it, sorted in
/// `limits.order` (by `seq`, or by `(xid, seq)`); the transaction's idle timeout is set to
/// `idle` unless the session's own is shorter (`SET_IDLE`); all of it goes out together (one
/// round trip). With `ask.reach`, the claim may look past its window for other aggregates'
/// heads (step 3 of the module documentation), taking in as much as [`Reach`] says. With
/// `ask.after`, it claims the batch that follows that one, which this relay holds uncommitted
/// on another connection ("Claiming ahead" in the module documentation): its events count as
/// gone, and the first event is taken only if it fits `limits.bytes` too, so the two batches
/// together stay within it.
///
/// With `ask.plain` and no reach, the plain claim goes first ("The plain claim" in the module
/// documentation); should it decline, its transaction is rolled back (with whatever it
/// locked) and the general claim is sent in a new one, in the same round trip as the
/// rollback. Returns the events, the idle timeout in force and which statement claimed them.
/// On error the transaction is rolled back. The caller ends it with [`settle`] or
/// [`rollback`].
///
/// [`settle`]: super::settle()
pub async fn claim(
    on: Session<'_>,
    limits: ClaimLimits,
    ask: Ask<'_>,
    idle: Duration,
) -> Result<Claim, tokio_postgres::Error> {
    match claim_once(on, limits, ask, idle).await {
        // A statement the server does not know: the cache outlived its session (see
        // `Prepared`). Forgotten, and the claim goes out unnamed (its transaction was rolled
        // back with the error).
        Err(e)
            if on.prepared.is_some()
                && e.code()
                    == Some(&tokio_postgres::error::SqlState::INVALID_SQL_STATEMENT_NAME) =>
        {
            if let Some(prepared) = on.prepared {
                prepared.forget();
            }
            let unnamed = Session {
                prepared: None,
                ..on
            };
            claim_once(unnamed, limits, ask, idle).await
        }
        done => done,
    }
}

async fn claim_once(
    on: Session<'_>,
    limits: ClaimLimits,
    ask: Ask<'_>,
    idle: Duration,
) -> Result<Claim, tokio_postgres::Error> {
    let mut restart = false;
    let mut declined = None;
    if ask.plain && ask.reach == Reach::None {
        let (rows, set, verdict) =
            begin_and_claim(on, limits, &ask, Some(idle), false, "", true).await?;
        match verdict.as_deref() {
            Some(v) if v == "empty" || taken(v) == Some(rows.len()) => {
                return Ok(Claim {
                    events: sorted(&rows, limits.order),
                    idle: set.unwrap_or_default(),
                    via: Via::Plain,
                })
            }
            reason => {
                declined = Some(Declined::parse(reason.unwrap_or_default()));
                restart = true;
            }
        }
    }
    let (rows, set, _) = begin_and_claim(on, limits, &ask, Some(idle), restart, "", false).await?;
    Ok(Claim {
        events: sorted(&rows, limits.order),
        idle: set.unwrap_or_default(),
        via: declined.map_or(Via::General, Via::Fallback),
    })
}

/// How many events the plain claim's `DELETE` must have returned when its verdict says it took
/// them (`taken N`). Fewer came back when an event of the window was changed or removed by
/// another transaction after the window was read: the `DELETE` fetches rows by the ctid the
/// window saw, and a row that moved is skipped. Its aggregate's later events would then go
/// without it, so the batch is declined (as [`Declined::Locked`]: another transaction had the
/// row) and the general claim, which finds rows by `seq`, takes the batch in a new transaction.
fn taken(verdict: &str) -> Option<usize> {
    verdict.strip_prefix("taken ")?.parse().ok()
}

/// The claimed rows as events, in `order`.
fn sorted(rows: &[Row], order: Order) -> Vec<Claimed> {
    let mut claimed: Vec<Claimed> = rows.iter().map(Claimed::from_row).collect();
    match order {
        Order::Insert => claimed.sort_unstable_by_key(|c| c.event.seq),
        Order::Commit => claimed.sort_unstable_by_key(|c| (c.xid, c.event.seq)),
    }
    claimed
}

/// What [`claim`]'s general statement does, as `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)` shows
/// it: the same statement with the same parameters in a transaction opened the same way, run
/// and then rolled back, so nothing is claimed. For tests and benchmarks: which plan the claim
/// gets, and how many rows and buffers it touches (`[0]["Plan"]` counts those of the whole
/// statement).
pub async fn explain_claim(
    client: &Client,
    schema: &Schema,
    limits: ClaimLimits,
    reach: bool,
) -> Result<serde_json::Value, tokio_postgres::Error> {
    explain(client, schema, limits, reach, false).await
}

/// The same for the plain claim ("The plain claim" in the module documentation).
pub async fn explain_plain_claim(
    client: &Client,
    schema: &Schema,
    limits: ClaimLimits,
) -> Result<serde_json::Value, tokio_postgres::Error> {
    explain(client, schema, limits, false, true).await
}

async fn explain(
    client: &Client,
    schema: &Schema,
    limits: ClaimLimits,
    reach: bool,
    plain: bool,
) -> Result<serde_json::Value, tokio_postgres::Error> {
    let reach = if reach {
        Reach::Windows(1)
    } else {
        Reach::None
    };
    let ask = Ask {
        reach,
        after: None,
        plain,
    };
    let on = Session {
        client,
        schema,
        prepared: None,
    };
    let (rows, _, _) = begin_and_claim(
        on,
        limits,
        &ask,
        None,
        false,
        "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ",
        plain,
    )
    .await?;
    rollback(client).await?;
    Ok(rows.first().map(|r| r.get(0)).unwrap_or_default())
}

/// [`BEGIN_CLAIM`] (after a `ROLLBACK` of the transaction open, with `restart`), [`SET_IDLE`]
/// (with `idle`) and a claim statement — the plain one with `plain`, followed by the read of its
/// verdict ([`PLAIN_VERDICT`]), else the general one — (after `prefix`), in one round trip;
/// returns the claim's rows, the idle timeout in force and the plain claim's verdict. On error
/// the transaction is rolled back.
async fn begin_and_claim(
    on: Session<'_>,
    limits: ClaimLimits,
    ask: &Ask<'_>,
    idle: Option<Duration>,
    restart: bool,
    prefix: &str,
    plain: bool,
) -> Result<(Vec<Row>, Option<Duration>, Option<String>), tokio_postgres::Error> {
    let Session {
        client,
        schema,
        prepared,
    } = on;
    let ClaimLimits {
        batch,
        bytes,
        up_to,
        order,
    } = limits;
    let window = batch.saturating_mul(WINDOW_FACTOR);
    let (reach, taken_in) = match ask.reach {
        Reach::None => (0, window),
        Reach::Windows(n) => (
            window.saturating_mul(i64::from(REACH_FACTOR)),
            window.saturating_mul(i64::from(n.clamp(1, REACH_FACTOR))),
        ),
    };
    let gone: Vec<i64> = ask
        .after
        .unwrap_or_default()
        .iter()
        .map(|c| c.event.seq)
        .collect();
    let first_always = ask.after.is_none();
    let general: [(&(dyn ToSql + Sync), Type); 8] = [
        (&batch, Type::INT8),
        (&window, Type::INT8),
        (&up_to, Type::INT8),
        (&reach, Type::INT8),
        (&bytes, Type::INT8),
        (&gone, Type::INT8_ARRAY),
        (&first_always, Type::BOOL),
        (&taken_in, Type::INT8),
    ];
    let plain_params: [(&(dyn ToSql + Sync), Type); 5] = [
        (&batch, Type::INT8),
        (&window, Type::INT8),
        (&up_to, Type::INT8),
        (&bytes, Type::INT8),
        (&gone, Type::INT8_ARRAY),
    ];
    let (template, params): (&str, &[(&(dyn ToSql + Sync), Type)]) = if plain {
        (CLAIM_PLAIN, &plain_params)
    } else {
        (CLAIM, &general)
    };
    // Spliced only when it is sent unnamed or prepared: a prepared claim needs no text.
    let sql = || format!("{prefix}{}", order.claim_sql(schema, template));
    // Prepared only as the relay sends it (no EXPLAIN), and not for a claim ahead: a generic
    // plan compares each event of the window with every `seq` of the batch in hand one by one
    // (`<> ALL` is hashed only for an array known when the statement is planned), 20 times
    // what the unnamed statement's custom plan costs at `--batch 1000`.
    let prepared = prepared.filter(|_| prefix.is_empty() && ask.after.is_none());
    let idle_ms = idle.map(ms);
    // Prepared (the first time) before anything goes out, so that the executions are sent in
    // order with the rest below: the verdict is read after the claim. The two small statements
    // around the claim too: unnamed, each was parsed and planned again for every batch. Those
    // not prepared yet are prepared together, in one round trip.
    let (statement, set_idle_statement, verdict_statement) = match prepared {
        Some(prepared) => {
            let types: Vec<Type> = params.iter().map(|(_, t)| t.clone()).collect();
            let all = async {
                let claim = prepared.statement(client, Key::Claim { order, plain }, sql, &types);
                let set_idle = async {
                    match idle_ms {
                        Some(_) => prepared
                            .statement(client, Key::SetIdle, || SET_IDLE.into(), &[Type::INT8])
                            .await
                            .map(Some),
                        None => Ok(None),
                    }
                };
                let verdict = async {
                    match plain {
                        true => prepared
                            .statement(client, Key::Verdict, || PLAIN_VERDICT.into(), &[])
                            .await
                            .map(Some),
                        false => Ok(None),
                    }
                };
                let (claim, set_idle, verdict) = tokio::try_join!(claim, set_idle, verdict)?;
                Ok((Some(claim), set_idle, verdict))
            };
            match all.await {
                Ok(statements) => statements,
                Err(e) => {
                    let _ = rollback(client).await;
                    return Err(e);
                }
            }
        }
        None => (None, None, None),
    };
    // Named statements only ever on a direct connection (a `Session` behind a pooler has no
    // `prepared`; see `Prepared`).
    let set_idle = async {
        let row = match (idle_ms, &set_idle_statement) {
            (None, _) => return Ok(None),
            #[allow(clippy::disallowed_methods)]
            (Some(idle_ms), Some(statement)) => client.query_one(statement, &[&idle_ms]).await?,
            (Some(idle_ms), None) => {
                client
                    .query_typed_one(SET_IDLE, &[(&idle_ms, Type::INT8)])
                    .await?
            }
        };
        Ok(Some(row.get::<_, i64>("ms")))
    };
    let unnamed = statement.is_none().then(sql);
    let rows = async {
        match &statement {
            Some(statement) => {
                let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
                #[allow(clippy::disallowed_methods)]
                client.query(statement, &values).await
            }
            None => {
                let sql = unnamed.as_deref().unwrap_or_default();
                client.query_typed(sql, params).await
            }
        }
    };
    // The plain claim's transaction ends in the same round trip as the general claim's begins.
    let begin = if restart {
        format!("ROLLBACK; {BEGIN_CLAIM}").into()
    } else {
        Cow::Borrowed(BEGIN_CLAIM)
    };
    let verdict = async {
        if !plain {
            return Ok(None);
        }
        let row = match &verdict_statement {
            #[allow(clippy::disallowed_methods)]
            Some(statement) => client.query_one(statement, &[]).await?,
            None => client.query_typed_one(PLAIN_VERDICT, &[]).await?,
        };
        Ok(row.get::<_, Option<String>>("verdict"))
    };
    let (begun, set, rows, verdict) =
        tokio::join!(client.batch_execute(&begin), set_idle, rows, verdict);
    let done = begun.and(set).and_then(|set| Ok((rows?, set, verdict?)));
    match done {
        Ok((rows, set, verdict)) => Ok((
            rows,
            set.map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
            verdict,
        )),
        Err(e) => {
            let _ = rollback(client).await;
            Err(e)
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_plain_claims_verdict_is_read_from_the_setting_it_is_left_in() {
        assert!(PLAIN_VERDICT.contains(&format!("'{VERDICT}'")));
        assert!(CLAIM_PLAIN.contains("set_config('{verdict}'"));
    }

    /// The claims' columns, in the order `Claimed::from_row` reads them.
    const COLUMNS: [&str; 14] = [
        "seq",
        "xid",
        "id",
        "aggregate_type",
        "aggregate_id",
        "type",
        "payload",
        "created_at",
        "attempts",
        "next_attempt_at",
        "last_error",
        "dead_at",
        "blocked",
        "reached",
    ];

    #[test]
    fn both_claims_return_the_same_columns() {
        let columns = |sql: &str| -> Vec<String> {
            let list = &sql[sql.rfind("RETURNING").unwrap() + "RETURNING".len()..];
            let mut names: Vec<String> = list
                .split(',')
                .filter_map(|c| {
                    let c = c.trim();
                    let name = c.rsplit(" AS ").next()?;
                    Some(name.trim_start_matches("o.").trim().to_owned())
                })
                .collect();
            names.dedup();
            names
        };
        let general = columns(CLAIM);
        assert_eq!(general, columns(CLAIM_PLAIN));
        // `Claimed::from_row` reads them by position.
        assert_eq!(general, COLUMNS);
    }
}
