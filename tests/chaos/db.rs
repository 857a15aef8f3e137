//! The suite's own view of the database: a synchronous SQL helper that reconnects after the
//! faults, and the instrumentation the invariants are checked against.
//!
//! Triggers record every change of a lease row (acquisition, heartbeat, release) and every
//! inserted run together with the lease row as it was inside the saving transaction. That is
//! what makes "the database's expiry" and "a later fence was granted" exact instead of sampled.

use std::time::{Duration, Instant};

use tokio_postgres::{Client, NoTls, SimpleQueryMessage};

pub type Rows = Vec<Vec<Option<String>>>;

pub struct Db {
    conninfo: String,
    rt: tokio::runtime::Runtime,
    client: Option<Client>,
}

impl Db {
    pub fn new(conninfo: &str) -> Db {
        Db {
            conninfo: format!("{conninfo} connect_timeout=5 application_name=chaos_checker"),
            rt: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap(),
            client: None,
        }
    }

    fn try_query(&mut self, sql: &str) -> Result<Rows, String> {
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            let (client, conn) = self
                .rt
                .block_on(tokio_postgres::connect(&self.conninfo, NoTls))
                .map_err(|e| e.to_string())?;
            self.rt.spawn(conn);
            self.client = Some(client);
        }
        let client = self.client.as_ref().unwrap();
        let msgs = self
            .rt
            .block_on(async {
                tokio::time::timeout(Duration::from_secs(20), client.simple_query(sql)).await
            })
            .map_err(|_| "query timed out".to_owned())?
            .map_err(|e| {
                let msg = format!("{e:?}");
                self.client = None;
                msg
            })?;
        Ok(msgs
            .into_iter()
            .filter_map(|m| match m {
                SimpleQueryMessage::Row(r) => {
                    Some((0..r.len()).map(|i| r.get(i).map(str::to_owned)).collect())
                }
                _ => None,
            })
            .collect())
    }

    /// Runs SQL, reconnecting and retrying for up to a minute (the server may be recovering
    /// from a fault). Panics when it never succeeds: the harness cannot check anything then.
    pub fn query(&mut self, sql: &str) -> Rows {
        let start = Instant::now();
        loop {
            match self.try_query(sql) {
                Ok(rows) => return rows,
                Err(e) if start.elapsed() < Duration::from_secs(60) => {
                    let _ = e;
                    self.client = None;
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!("chaos checker: {sql}: {e}"),
            }
        }
    }

    /// Drops the connection (before faults that would break it anyway).
    pub fn disconnect(&mut self) {
        self.client = None;
    }
}

/// Instrumentation in schema `chaos`, on leasectl's tables in `schema` (which must exist).
///
/// Every log row carries the writing transaction's id (`xid`), so a change of a lease row can be
/// told apart from a save (the same transaction stored a run), and the database clock of the
/// transaction (`at`, its `now()`: what leasectl's own expiry checks compare with).
pub fn instrument(db: &mut Db, schema: &str) {
    let sql = format!(
        r#"
CREATE SCHEMA chaos;
-- The fenced register the children write: only a write with a higher fence is accepted (a step
-- of a lease, which shares its fence with the lease's other steps, may write with an equal one).
CREATE TABLE chaos.register (target text PRIMARY KEY, value bigint NOT NULL, fence bigint NOT NULL);
-- Every committed version of every lease row (every place of it).
CREATE TABLE chaos.lease_log (
    id bigserial PRIMARY KEY, target text, place int, token uuid, fence bigint, ttl_ms bigint,
    heartbeat_at timestamptz, acquired_at timestamptz, holder_pid int, xid bigint,
    at timestamptz);
CREATE FUNCTION chaos.log_lease() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chaos.lease_log (target, place, token, fence, ttl_ms, heartbeat_at, acquired_at,
                                 holder_pid, xid, at)
    VALUES (NEW.target, NEW.place, NEW.token, NEW.fence, NEW.ttl_ms, NEW.heartbeat_at,
            NEW.acquired_at, NEW.holder_pid, txid_current(), now());
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_log AFTER INSERT OR UPDATE ON "{schema}".leases
    FOR EACH ROW EXECUTE FUNCTION chaos.log_lease();
-- Every stored run, with the lease row of its fence as the saving statement left it: the row
-- its token holds, or the row of its fence with no token (released by that same statement).
CREATE TABLE chaos.run_log (
    id bigserial PRIMARY KEY, run_id uuid, target text, fence bigint, token uuid, outcome text,
    pid int, exit_code int, signal int, slot timestamptz, lease_fence bigint, lease_token uuid,
    xid bigint);
CREATE FUNCTION chaos.log_run() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    lf bigint;
    lt uuid;
BEGIN
    SELECT l.fence, l.token INTO lf, lt FROM "{schema}".leases l
     WHERE l.target = NEW.target
       AND (l.token = NEW.token OR (l.token IS NULL AND l.fence = NEW.fence))
     ORDER BY l.token IS NULL LIMIT 1;
    INSERT INTO chaos.run_log (run_id, target, fence, token, outcome, pid, exit_code, signal,
                               slot, lease_fence, lease_token, xid)
    VALUES (NEW.id, NEW.target, NEW.fence, NEW.token, NEW.outcome, NEW.pid, NEW.exit_code,
            NEW.signal, NEW.slot, lf, lt, txid_current());
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_log AFTER INSERT ON "{schema}".runs
    FOR EACH ROW EXECUTE FUNCTION chaos.log_run();
-- Every version of every waiter's row, its deletion included: when each waiter joined, renewed
-- its place and left the queue, on the database clock.
CREATE TABLE chaos.waiter_log (
    id bigserial PRIMARY KEY, op text, ticket bigint, target text, queue text, pid int,
    ttl_ms bigint, heartbeat_at timestamptz, superseded boolean, at timestamptz);
CREATE FUNCTION chaos.log_waiter() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        INSERT INTO chaos.waiter_log (op, ticket, target, queue, pid, ttl_ms, heartbeat_at,
                                      superseded, at)
        VALUES ('delete', OLD.ticket, OLD.target, OLD.queue, OLD.pid, OLD.ttl_ms,
                OLD.heartbeat_at, OLD.superseded_at IS NOT NULL, now());
    ELSE
        INSERT INTO chaos.waiter_log (op, ticket, target, queue, pid, ttl_ms, heartbeat_at,
                                      superseded, at)
        VALUES (lower(TG_OP), NEW.ticket, NEW.target, NEW.queue, NEW.pid, NEW.ttl_ms,
                NEW.heartbeat_at, NEW.superseded_at IS NOT NULL, now());
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_log AFTER INSERT OR UPDATE OR DELETE ON "{schema}".waiters
    FOR EACH ROW EXECUTE FUNCTION chaos.log_waiter();
"#
    );
    db.query(&sql);
}
