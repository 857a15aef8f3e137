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
pub fn instrument(db: &mut Db, schema: &str) {
    let sql = format!(
        r#"
CREATE SCHEMA chaos;
-- The fenced register the children write: only a write with a higher fence is accepted.
CREATE TABLE chaos.register (target text PRIMARY KEY, value bigint NOT NULL, fence bigint NOT NULL);
-- Every committed version of every lease row.
CREATE TABLE chaos.lease_log (
    id bigserial PRIMARY KEY, target text, token uuid, fence bigint, ttl_ms bigint,
    heartbeat_at timestamptz, acquired_at timestamptz);
CREATE FUNCTION chaos.log_lease() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chaos.lease_log (target, token, fence, ttl_ms, heartbeat_at, acquired_at)
    VALUES (NEW.target, NEW.token, NEW.fence, NEW.ttl_ms, NEW.heartbeat_at, NEW.acquired_at);
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_log AFTER INSERT OR UPDATE ON "{schema}".leases
    FOR EACH ROW EXECUTE FUNCTION chaos.log_lease();
-- Every stored run, with the lease row as the saving statement left it.
CREATE TABLE chaos.run_log (
    id bigserial PRIMARY KEY, run_id uuid, target text, fence bigint, token uuid, outcome text,
    pid int, exit_code int, signal int, lease_fence bigint, lease_token uuid);
CREATE FUNCTION chaos.log_run() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chaos.run_log (run_id, target, fence, token, outcome, pid, exit_code, signal,
                               lease_fence, lease_token)
    SELECT NEW.id, NEW.target, NEW.fence, NEW.token, NEW.outcome, NEW.pid, NEW.exit_code,
           NEW.signal,
           (SELECT fence FROM "{schema}".leases WHERE target = NEW.target),
           (SELECT token FROM "{schema}".leases WHERE target = NEW.target);
    RETURN NULL;
END $$;
CREATE TRIGGER chaos_log AFTER INSERT ON "{schema}".runs
    FOR EACH ROW EXECUTE FUNCTION chaos.log_run();
"#
    );
    db.query(&sql);
}
