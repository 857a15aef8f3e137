//! The commit order's horizon and who holds it back: [`Horizon`] (for `--order commit`), and the
//! `pg_stat_activity` / `pg_prepared_xacts` look-ups that name the backend or prepared
//! transaction behind a held horizon or an old xmin ([`Holder`]), for the relay's and doctor's
//! messages. Only reads.

use anyhow::{Context, Result};
use tokio_postgres::types::Type;
use tokio_postgres::{Client, Row};

use crate::db::Schema;
use crate::store::sql;

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
