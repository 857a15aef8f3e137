//! Keeping a schema current: the embedded migrations and their ledger.
//!
//! `schema_migrations` records each applied file's version, name and a SHA-384 checksum of its
//! text. A database whose ledger names a migration this binary embeds with *different* text is
//! refused (exit 78), as sqlx refuses an edited migration: the schema it has is not the one
//! this binary was tested against. A database newer than the binary is refused too. Ledgers
//! written before checksums existed (versions 1 and 2) get them recorded on the next upgrade.
//!
//! Only a role that may create the schema (or owns it) can apply migrations; any other role
//! needs [`grants`] from the owner and is told, exit 77, to have an operator run `leasectl
//! migrate` when the schema is missing or out of date.

pub mod grants;

use std::sync::OnceLock;

use anyhow::{Context, Result};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, SimpleQueryMessage};

use super::Schema;
use crate::error::Failure;

/// One embedded migration file.
struct Migration {
    /// The file's number.
    version: i32,
    name: &'static str,
    sql: &'static str,
}

/// The migrations embedded in the binary, in order.
const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "init",
        sql: include_str!("../../migrations/0001_init.sql"),
    },
    Migration {
        version: 2,
        name: "relay",
        sql: include_str!("../../migrations/0002_relay.sql"),
    },
    Migration {
        version: 3,
        name: "cron",
        sql: include_str!("../../migrations/0003_cron.sql"),
    },
    Migration {
        version: 4,
        name: "queue",
        sql: include_str!("../../migrations/0004_queue.sql"),
    },
    Migration {
        version: 5,
        name: "max_holders",
        sql: include_str!("../../migrations/0005_max_holders.sql"),
    },
    Migration {
        version: 6,
        name: "relay_faults",
        sql: include_str!("../../migrations/0006_relay_faults.sql"),
    },
    Migration {
        version: 7,
        name: "notify_idle",
        sql: include_str!("../../migrations/0007_notify_idle.sql"),
    },
    Migration {
        version: 8,
        name: "steps_replace",
        sql: include_str!("../../migrations/0008_steps_replace.sql"),
    },
    Migration {
        version: 9,
        name: "commit_order",
        sql: include_str!("../../migrations/0009_commit_order.sql"),
    },
    Migration {
        version: 10,
        name: "live_events",
        sql: include_str!("../../migrations/0010_live_events.sql"),
    },
    Migration {
        version: 11,
        name: "stopping",
        sql: include_str!("../../migrations/0011_stopping.sql"),
    },
    Migration {
        version: 12,
        name: "lease_slot",
        sql: include_str!("../../migrations/0012_lease_slot.sql"),
    },
    Migration {
        version: 13,
        name: "lease_hot",
        sql: include_str!("../../migrations/0013_lease_hot.sql"),
    },
];

/// The newest schema version this binary knows.
pub const SCHEMA_VERSION: i32 = MIGRATIONS[MIGRATIONS.len() - 1].version;

/// The SHA-384 of each `migrations/*.sql` file by name, in version order, computed by build.rs:
/// every start compares them with the ledger, and hashing the files each time cost about a
/// tenth of a `run`'s instructions.
mod sums {
    include!(concat!(env!("OUT_DIR"), "/migration_sums.rs"));
}

impl Migration {
    /// The SHA-384 of [`Migration::sql`], as build.rs computed it from the same file.
    fn checksum(&self) -> &'static [u8] {
        &sums::SUMS[(self.version - 1) as usize].1
    }

    fn by_version(version: i32) -> Option<&'static Migration> {
        MIGRATIONS.iter().find(|m| m.version == version)
    }
}

/// Brings `schema` up to [`SCHEMA_VERSION`].
///
/// The common case — already current, every checksum matching — costs one round trip, which
/// also reads back the session's `statement_timeout` (returned: [`super::session`] tells a
/// direct session from a pooled one by it). Otherwise every pending migration runs in one transaction
/// holding an advisory lock keyed on the schema, with its ledger row, so two processes starting
/// on an empty database serialise here and both succeed (sqlx-postgres's `migrate.rs` does the
/// same).
pub async fn migrate(client: &mut Client, schema: &Schema) -> Result<String> {
    // Qualified names as string literals: the quoted schema's single quotes doubled.
    let literal = |name: &str| schema.sql(&format!("{{s}}.{name}")).replace('\'', "''");
    let ledger = literal("schema_migrations");
    let probe = client
        .simple_query(&schema.sql(&format!(
            "SELECT current_setting('statement_timeout') AS statement_timeout,
                    {marked} AS marked,
                    coalesce((SELECT relowner = to_regrole(current_user) FROM pg_class
                               WHERE oid = to_regclass('{ledger}')), false) AS may_mark;
             SELECT version, encode(checksum, 'hex') AS checksum
               FROM {{s}}.schema_migrations ORDER BY version",
            marked = is_marked(schema),
        )))
        .await;
    let found = match probe {
        Ok(msgs) => {
            let rows = || {
                msgs.iter().filter_map(|m| match m {
                    SimpleQueryMessage::Row(r) => Some(r),
                    _ => None,
                })
            };
            let timeout = rows()
                .find_map(|r| r.try_get("statement_timeout").ok().flatten())
                .unwrap_or_default()
                .to_owned();
            let applied: Vec<(i32, Option<Vec<u8>>)> = rows()
                .filter_map(|r| {
                    let version = r.try_get("version").ok()??.parse().ok()?;
                    Some((version, r.try_get("checksum").ok()?.map(from_hex)))
                })
                .collect();
            check_applied(schema, &applied)?;
            let current = applied.last().map(|(v, _)| *v);
            let all_summed = applied.iter().all(|(_, sum)| sum.is_some());
            if current == Some(SCHEMA_VERSION) && all_summed {
                let says = |column| rows().any(|r| r.try_get(column).ok().flatten() == Some("t"));
                if !says("marked") && says("may_mark") {
                    mark(client, schema).await;
                }
                return Ok(timeout);
            }
            current.map_or(Found::NoLedger, Found::Version)
        }
        // No schema or ledger yet (a missing schema is reported either way), or a ledger from
        // before checksums: the locked path creates or upgrades it.
        Err(e)
            if matches!(e.code(), Some(c) if *c == SqlState::UNDEFINED_TABLE
                || *c == SqlState::INVALID_SCHEMA_NAME) =>
        {
            Found::NoLedger
        }
        Err(e) if e.code() == Some(&SqlState::UNDEFINED_COLUMN) => Found::Version(0),
        Err(e) => return Err(e).context("cannot read the schema version"),
    };
    upgrade(client, schema, found).await?;
    let shown = client.simple_query("SHOW statement_timeout").await?;
    Ok(shown
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
        .unwrap_or_default())
}

/// The statement that opens a pipelined first transaction ([`super::first`]): `BEGIN`, then the
/// session's `statement_timeout` (the column `statement_timeout`), and a reference to the
/// schema's ledger marker (a type; see `marker` below) that fails unless the marker of this
/// binary's ledger exists. The error aborts the transaction, so nothing sent after it in the
/// same flight takes effect; the caller then takes [`migrate`]'s path, which creates, upgrades
/// or refuses with its own messages (and marks a current schema that lacks its marker). The
/// check is the database's, so no round trip waits for it.
///
/// A type named by the ledger stands in for reading the ledger: in a fresh server process
/// (every `run` has one) looking a type up by name costs about 0.1 ms, where opening the ledger
/// table, planning and comparing its checksums cost about 1 ms — the largest part of the
/// flight's work before the acquisition.
pub fn begin_if_current(schema: &Schema) -> String {
    schema.sql(&format!(
        "BEGIN;
         SELECT current_setting('statement_timeout') AS statement_timeout,
                NULL::{{s}}.\"{}\" AS current",
        marker()
    ))
}

/// What a marker's name starts with; the rest names the ledger ([`marker`]).
const MARKER_PREFIX: &str = "leasectl_ledger_";

/// The name of the type that marks a schema whose ledger is exactly this binary's: every
/// migration applied, each with this binary's checksum. `leasectl_ledger_v13_` and the first 12
/// bytes (hex) of the SHA-384 of the migrations' checksums in order, so a build whose migrations
/// differ in any byte looks for another name.
///
/// [`install_marker`] creates it, with the trigger that drops every marker whenever the ledger
/// changes (an upgrade by another build, an edit by hand): a marker exists only while the
/// ledger is the one it was made for.
fn marker() -> &'static str {
    static NAME: OnceLock<String> = OnceLock::new();
    NAME.get_or_init(|| format!("{MARKER_PREFIX}v{SCHEMA_VERSION}_{}", sums::LEDGER))
}

/// Creates this binary's marker in a schema whose ledger it has just found, or made, exactly
/// its own, in the transaction that holds the migration lock: first the trigger that drops every
/// marker on any change to the ledger (a statement trigger, so also for statements that change
/// no row, and for `TRUNCATE`), then a change of no row that fires it (so another build's
/// marker goes too), then the type. Needs the ledger's owner (`DROP TRIGGER`) and `CREATE` on
/// the schema, as migrating does. Only the ledger's owner installs it ([`OWNS_LEDGER`]), so
/// the function, the trigger and every marker belong to one role, and the function drops the
/// markers as that role (`SECURITY DEFINER`): whoever changes the ledger, the markers go. (A
/// superuser's marker in another role's schema would make the owner's next upgrade fail.)
fn install_marker(schema: &Schema) -> String {
    schema.sql(&format!(
        r#"CREATE OR REPLACE FUNCTION {{s}}.ledger_changed() RETURNS trigger
         LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog AS $fn$
         DECLARE
             marker text;
         BEGIN
             FOR marker IN
                 SELECT format('%I.%I', n.nspname, t.typname)
                   FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
                  WHERE n.nspname = TG_TABLE_SCHEMA AND t.typname LIKE '{prefix}%'
             LOOP
                 EXECUTE 'DROP TYPE ' || marker;
             END LOOP;
             RETURN NULL;
         END
         $fn$;
         DROP TRIGGER IF EXISTS ledger_changed ON {{s}}.schema_migrations;
         CREATE TRIGGER ledger_changed
             AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON {{s}}.schema_migrations
             FOR EACH STATEMENT EXECUTE FUNCTION {{s}}.ledger_changed();
         UPDATE {{s}}.schema_migrations SET version = version WHERE false;
         CREATE TYPE {{s}}."{marker}" AS ENUM ();
         COMMENT ON TYPE {{s}}."{marker}" IS
             'leasectl: this schema''s migration ledger is exactly the one this type names; commands that find it skip reading the ledger. Any change to schema_migrations drops it; leasectl migrate makes it again.';"#,
        prefix = MARKER_PREFIX.replace('_', "\\_"),
        marker = marker(),
    ))
}

/// Whether `schema` has this binary's marker, as an SQL expression. It reads the catalog
/// rather than resolving the name (`to_regtype`): a marker dropped and made again by another
/// session meanwhile would make that fail with "cache lookup failed for type" instead of
/// answering.
fn is_marked(schema: &Schema) -> String {
    format!(
        "EXISTS (SELECT 1 FROM pg_catalog.pg_type t
                   JOIN pg_catalog.pg_namespace n ON n.oid = t.typnamespace
                  WHERE n.nspname = '{}' AND t.typname = '{}')",
        schema.name().replace('\'', "''"),
        marker()
    )
}

/// Marks a current schema that has no marker (migrated by a leasectl from before markers, or
/// its ledger changed since and changed back), when the session's role owns the ledger: in a
/// transaction holding the migration lock, with the ledger read again under it. Best-effort:
/// where it fails, the schema stays unmarked and its commands keep reading the ledger, which
/// costs them time, not correctness.
async fn mark(client: &mut Client, schema: &Schema) {
    let marked = async {
        let tx = client.transaction().await?;
        tx.query_typed(MIGRATION_LOCK, &[(&schema.name(), Type::TEXT)])
            .await?;
        let applied = read_ledger(&tx, schema).await?;
        if is_current(&applied) {
            mark_unless_marked(&tx, schema).await?;
        }
        tx.commit().await?;
        Ok::<(), anyhow::Error>(())
    }
    .await;
    if let Err(e) = marked {
        crate::info!(
            "schema \"{}\" is current but could not be marked as such ({e:#}); its commands read the ledger",
            schema.name()
        );
    }
}

/// Installs this binary's marker ([`install_marker`]) unless it stands already, under the
/// migration lock. Installing drops every marker before it makes its own, so making it again
/// where it stands — another session migrated or marked the schema while this one waited for
/// the lock, as when many commands start at once on a new schema — would fail the commands
/// checking for it meanwhile with "cache lookup failed for type". A ledger changed in this
/// transaction has lost its marker already (the trigger).
async fn mark_unless_marked(
    tx: &tokio_postgres::Transaction<'_>,
    schema: &Schema,
) -> Result<(), tokio_postgres::Error> {
    let marked = tx
        .query_typed(&format!("SELECT {}", is_marked(schema)), &[])
        .await?
        .first()
        .is_some_and(|r| r.get::<_, bool>(0));
    if !marked {
        tx.batch_execute(&install_marker(schema)).await?;
    }
    Ok(())
}

/// Whether the session's role itself owns the ledger `$1` (qualified): the only role that
/// installs a marker (see [`install_marker`]).
const OWNS_LEDGER: &str = "SELECT coalesce((SELECT relowner = to_regrole(current_user)
                                     FROM pg_class WHERE oid = to_regclass($1)), false)";

/// Serialises everything that changes a schema's ledger or its marker.
const MIGRATION_LOCK: &str =
    "SELECT pg_advisory_xact_lock(hashtext('leasectl.migrate:' || $1::text))";

/// The ledger's versions and checksums, in version order.
async fn read_ledger(
    tx: &tokio_postgres::Transaction<'_>,
    schema: &Schema,
) -> Result<Vec<(i32, Option<Vec<u8>>)>> {
    Ok(tx
        .query_typed(
            &schema.sql("SELECT version, checksum FROM {s}.schema_migrations ORDER BY version"),
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get("version"), r.get("checksum")))
        .collect())
}

/// Whether a ledger is exactly this binary's: every migration, in order, each with its checksum.
fn is_current(applied: &[(i32, Option<Vec<u8>>)]) -> bool {
    applied.len() == MIGRATIONS.len()
        && applied.iter().zip(MIGRATIONS).all(|((version, sum), m)| {
            *version == m.version && sum.as_deref() == Some(m.checksum())
        })
}

/// What a schema's ledger says, read without changing anything (for `leasectl doctor`, which
/// must never migrate).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ledger {
    /// No such schema.
    NoSchema,
    /// The schema exists but has no ledger table.
    NoLedger,
    /// The ledger, judged against this binary's migrations.
    Found(LedgerState),
}

/// A ledger's rows judged against the embedded migrations.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LedgerState {
    /// The newest version applied (0 when the ledger is empty).
    pub newest: i32,
    /// Applied migrations whose text differs from this binary's (`0003_cron`).
    pub mismatched: Vec<String>,
    /// Migrations of this binary not yet applied (`0013_lease_hot`).
    pub pending: Vec<String>,
    /// Applied versions recorded without a checksum (a ledger from before checksums): the next
    /// `migrate` records them.
    pub unsummed: usize,
}

impl LedgerState {
    /// Whether the ledger names a version this binary does not know.
    pub fn too_new(&self) -> bool {
        self.newest > SCHEMA_VERSION
    }
}

/// Reads `schema`'s ledger in one or two statements and judges it ([`Ledger`]); writes nothing.
pub async fn inspect(client: &Client, schema: &Schema) -> Result<Ledger> {
    let exists: bool = client
        .query_typed_one(SCHEMA_EXISTS, &[(&schema.name(), Type::TEXT)])
        .await?
        .try_get(0)?;
    if !exists {
        return Ok(Ledger::NoSchema);
    }
    let with_sums = client
        .query_typed(
            &schema.sql("SELECT version, checksum FROM {s}.schema_migrations ORDER BY version"),
            &[],
        )
        .await;
    let applied: Vec<(i32, Option<Vec<u8>>)> = match with_sums {
        Ok(rows) => rows
            .iter()
            .map(|r| Ok((r.try_get("version")?, r.try_get("checksum")?)))
            .collect::<Result<_, tokio_postgres::Error>>()?,
        Err(e) if e.code() == Some(&SqlState::UNDEFINED_TABLE) => return Ok(Ledger::NoLedger),
        // A ledger from before checksums: versions only.
        Err(e) if e.code() == Some(&SqlState::UNDEFINED_COLUMN) => client
            .query_typed(
                &schema.sql("SELECT version FROM {s}.schema_migrations ORDER BY version"),
                &[],
            )
            .await?
            .iter()
            .map(|r| Ok((r.try_get("version")?, None)))
            .collect::<Result<_, tokio_postgres::Error>>()?,
        Err(e) => return Err(e).context("cannot read the schema's migration ledger"),
    };
    Ok(Ledger::Found(judge_ledger(&applied)))
}

/// [`LedgerState`] of the ledger rows `applied`.
fn judge_ledger(applied: &[(i32, Option<Vec<u8>>)]) -> LedgerState {
    let label = |m: &Migration| format!("{:04}_{}", m.version, m.name);
    let mut state = LedgerState {
        newest: applied.iter().map(|(v, _)| *v).max().unwrap_or(0),
        ..LedgerState::default()
    };
    for (version, sum) in applied {
        match (Migration::by_version(*version), sum) {
            (Some(m), Some(sum)) if *sum != m.checksum() => state.mismatched.push(label(m)),
            (Some(_), None) => state.unsummed += 1,
            _ => {}
        }
    }
    state.pending = MIGRATIONS
        .iter()
        .filter(|m| !applied.iter().any(|(v, _)| *v == m.version))
        .map(label)
        .collect();
    state
}

/// [`apply_migrations`], again when it lost a race it cannot lose twice: two first users of a
/// schema serialise on the advisory lock, but the second may still trip over the first's
/// `CREATE SCHEMA`/`CREATE TABLE` (seen behind pgbouncer: the waiting backend's catalog cache
/// predates the other's commit). A fresh transaction sees what the other created.
async fn apply_retrying(client: &mut Client, schema: &Schema) -> Result<()> {
    let mut attempt = 1;
    loop {
        match apply_migrations(client, schema).await {
            Err(e) if attempt < 3 && created_concurrently(&e) => attempt += 1,
            done => return done,
        }
    }
}

/// What the version probe found when the schema needs creating or upgrading.
#[derive(Debug, Clone, Copy)]
enum Found {
    /// No ledger, perhaps no schema.
    NoLedger,
    /// The ledger's newest version; 0 for a ledger from before checksums.
    Version(i32),
}

/// Applies the pending migrations. A role that may not (it neither owns the schema nor may
/// create it) is told, in one line and exit 77, to have the owner run `leasectl migrate`.
async fn upgrade(client: &mut Client, schema: &Schema, found: Found) -> Result<()> {
    let err = match apply_retrying(client, schema).await {
        Err(e) if crate::error::permission_denied(&e).is_some() => e,
        done => return done,
    };
    let why = crate::error::permission_denied(&err)
        .map_or_else(String::new, |d| format!(" ({})", d.message()));
    // The transaction is rolled back; the session still answers.
    let role = grants::current_role(client).await.map_or_else(
        || "this role".to_owned(),
        |r| format!("role {}", grants::quote_ident(&r)),
    );
    let name = schema.name();
    let state = match found {
        Found::NoLedger if !schema_exists(client, schema).await => {
            format!("schema \"{name}\" does not exist and {role} may not create it")
        }
        Found::NoLedger => {
            format!("schema \"{name}\" has no leasectl tables and {role} may not create them")
        }
        Found::Version(v) if v > 0 && v < SCHEMA_VERSION => format!(
            "schema \"{name}\" is at version {v}, older than this leasectl ({SCHEMA_VERSION}), and {role} may not upgrade it"
        ),
        Found::Version(_) => format!(
            "schema \"{name}\" needs its migration ledger upgraded and {role} may not do it"
        ),
    };
    Err(Failure::Permission(format!(
        "{state}{why}: ask an operator to run `{}` as the schema owner",
        grants::leasectl_command(schema, "migrate")
    ))
    .into())
}

/// Whether `schema` exists (for messages; `true` when it cannot be told).
async fn schema_exists(client: &Client, schema: &Schema) -> bool {
    client
        .query_typed_one(SCHEMA_EXISTS, &[(&schema.name(), Type::TEXT)])
        .await
        .and_then(|r| r.try_get(0))
        .unwrap_or(true)
}

const SCHEMA_EXISTS: &str = "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)";

/// Refuses a ledger that is newer than this binary or names a migration whose text changed.
/// `None` checksums (recorded before checksums existed) pass; the upgrade fills them in.
fn check_applied(schema: &Schema, applied: &[(i32, Option<Vec<u8>>)]) -> Result<()> {
    if let Some(&(newest, _)) = applied.last() {
        if newest > SCHEMA_VERSION {
            return Err(too_new(schema, newest));
        }
    }
    for (version, sum) in applied {
        let Some(m) = Migration::by_version(*version) else {
            continue;
        };
        if sum.as_ref().is_some_and(|s| *s != m.checksum()) {
            return Err(Failure::SchemaTooNew(format!(
                "migration {version:04}_{} applied to schema \"{}\" differs from the one in this leasectl (checksum mismatch); the schema was changed by hand or by another build",
                m.name,
                schema.name()
            ))
            .into());
        }
    }
    Ok(())
}

/// Whether a migration failed because another process created the same object at the same
/// moment (a unique violation on a catalog, or "already exists").
fn created_concurrently(e: &anyhow::Error) -> bool {
    e.chain()
        .filter_map(|c| c.downcast_ref::<tokio_postgres::Error>())
        .filter_map(|c| c.code())
        .any(|c| {
            *c == SqlState::UNIQUE_VIOLATION
                || *c == SqlState::DUPLICATE_SCHEMA
                || *c == SqlState::DUPLICATE_TABLE
                || *c == SqlState::DUPLICATE_OBJECT
        })
}

fn from_hex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .filter_map(|i| u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok())
        .collect()
}

/// Every statement here is unnamed (`query_typed`) or simple, and every setting `SET LOCAL`, so
/// a transaction-mode pooler can run the whole transaction on any server connection.
async fn apply_migrations(client: &mut Client, schema: &Schema) -> Result<()> {
    let tx = client.transaction().await?;
    tx.query_typed(MIGRATION_LOCK, &[(&schema.name(), Type::TEXT)])
        .await
        .context("cannot take the migration lock")?;
    // CREATE SCHEMA, even with IF NOT EXISTS, needs CREATE on the database: only when the
    // schema is missing, so a role that owns a schema an operator made for it can migrate it.
    let exists: bool = tx
        .query_typed_one(SCHEMA_EXISTS, &[(&schema.name(), Type::TEXT)])
        .await?
        .try_get(0)?;
    if !exists {
        tx.batch_execute(&schema.sql("CREATE SCHEMA IF NOT EXISTS {s}"))
            .await
            .with_context(|| format!("cannot create schema \"{}\"", schema.name()))?;
    }
    tx.batch_execute(&schema.sql(
        "CREATE TABLE IF NOT EXISTS {s}.schema_migrations (
             version    integer     PRIMARY KEY,
             name       text        NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now()
         );
         -- SHA-384 of the applied file; NULL only in ledgers from before checksums, filled in
         -- below.
         ALTER TABLE {s}.schema_migrations ADD COLUMN IF NOT EXISTS checksum bytea;
         SET LOCAL search_path = {s};",
    ))
    .await
    .with_context(|| format!("cannot create the ledger in schema \"{}\"", schema.name()))?;
    let applied = read_ledger(&tx, schema).await?;
    check_applied(schema, &applied)?;
    for (version, sum) in &applied {
        if let (None, Some(m)) = (sum, Migration::by_version(*version)) {
            // Applied by a leasectl that kept no checksums: this binary's file is the best
            // record of what ran (a version's file never changes once released).
            tx.execute_typed(
                "UPDATE schema_migrations SET checksum = $2 WHERE version = $1",
                &[(version, Type::INT4), (&m.checksum(), Type::BYTEA)],
            )
            .await?;
        }
    }
    let current = applied.last().map_or(0, |(v, _)| *v);
    for m in MIGRATIONS.iter().filter(|m| m.version > current) {
        tx.batch_execute(m.sql).await.with_context(|| {
            format!(
                "migration {:04}_{} failed in schema \"{}\"",
                m.version,
                m.name,
                schema.name()
            )
        })?;
        tx.execute_typed(
            "INSERT INTO schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
            &[
                (&m.version, Type::INT4),
                (&m.name, Type::TEXT),
                (&m.checksum(), Type::BYTEA),
            ],
        )
        .await?;
    }
    // Only by the ledger's owner, and best-effort, like [`mark`]: a schema whose marker function
    // another role made stays unmarked rather than un-migrated.
    let ledger = schema.sql("{s}.schema_migrations");
    let owner: bool = tx
        .query_typed_one(OWNS_LEDGER, &[(&ledger, Type::TEXT)])
        .await?
        .try_get(0)?;
    if owner {
        tx.batch_execute("SAVEPOINT marker").await?;
        match mark_unless_marked(&tx, schema).await {
            Ok(()) => tx.batch_execute("RELEASE SAVEPOINT marker").await?,
            Err(e) => {
                crate::info!(
                    "schema \"{}\" could not be marked as current ({}); its commands read the ledger",
                    schema.name(),
                    super::reason(&e)
                );
                tx.batch_execute("ROLLBACK TO SAVEPOINT marker").await?;
            }
        }
    }
    tx.commit().await.context("cannot commit the migrations")?;
    Ok(())
}

fn too_new(schema: &Schema, found: i32) -> anyhow::Error {
    Failure::SchemaTooNew(format!(
        "schema \"{}\" is at version {found}, newer than this leasectl understands ({SCHEMA_VERSION}); upgrade leasectl",
        schema.name()
    ))
    .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_consecutive_and_checksums_distinct() {
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(m.version, i32::try_from(i).unwrap() + 1);
            assert_eq!(m.checksum().len(), 48);
        }
        assert_ne!(MIGRATIONS[0].checksum(), MIGRATIONS[1].checksum());
        assert_eq!(from_hex("00ff10"), vec![0, 255, 16]);
    }

    /// build.rs hashed the very files the binary embeds, one per migration, in version order.
    #[test]
    fn the_build_time_checksums_are_those_of_the_embedded_text() {
        use sha2::{Digest, Sha384};
        assert_eq!(
            sums::SUMS.len(),
            MIGRATIONS.len(),
            "a file in migrations/ is not embedded"
        );
        for (m, (file, sum)) in MIGRATIONS.iter().zip(sums::SUMS) {
            assert_eq!(*file, format!("{:04}_{}.sql", m.version, m.name));
            assert_eq!(sum[..], Sha384::digest(m.sql.as_bytes())[..], "{file}");
        }
    }

    #[test]
    fn the_ledger_is_judged_against_the_embedded_migrations() {
        let all: Vec<(i32, Option<Vec<u8>>)> = MIGRATIONS
            .iter()
            .map(|m| (m.version, Some(m.checksum().to_vec())))
            .collect();
        assert_eq!(
            judge_ledger(&all),
            LedgerState {
                newest: SCHEMA_VERSION,
                ..LedgerState::default()
            }
        );
        let mut edited = all.clone();
        edited[2].1 = Some(vec![0; 48]);
        edited[0].1 = None;
        edited.pop();
        let state = judge_ledger(&edited);
        assert_eq!(state.mismatched, vec!["0003_cron".to_owned()]);
        assert_eq!(state.unsummed, 1);
        assert_eq!(state.pending.len(), 1);
        assert!(!state.too_new());
        assert!(judge_ledger(&[(SCHEMA_VERSION + 1, None)]).too_new());
    }
}
