//! Keeping a schema current: the embedded migrations and their ledger.
//!
//! `schema_migrations` records each applied file's version, name and a SHA-384 checksum of its
//! text. A database whose ledger names a migration this binary embeds with *different* text is
//! refused (exit 78), as sqlx refuses an edited migration: the schema it has is not the one
//! this binary was tested against. A database newer than the binary is refused too. Ledgers
//! written before checksums existed (versions 1 and 2) get them recorded on the next upgrade.

use anyhow::{Context, Result};
use sha2::{Digest, Sha384};
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
];

/// The newest schema version this binary knows.
pub const SCHEMA_VERSION: i32 = MIGRATIONS[MIGRATIONS.len() - 1].version;

impl Migration {
    fn checksum(&self) -> Vec<u8> {
        Sha384::digest(self.sql.as_bytes()).to_vec()
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
    let probe = client
        .simple_query(&schema.sql(
            "SELECT current_setting('statement_timeout') AS statement_timeout;
             SELECT version, encode(checksum, 'hex') AS checksum
               FROM {s}.schema_migrations ORDER BY version",
        ))
        .await;
    match probe {
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
                return Ok(timeout);
            }
        }
        // No schema or ledger yet, or a ledger from before checksums: the locked path below
        // creates or upgrades it.
        Err(e)
            if matches!(e.code(), Some(c) if *c == SqlState::UNDEFINED_TABLE
                || *c == SqlState::INVALID_SCHEMA_NAME
                || *c == SqlState::UNDEFINED_COLUMN) => {}
        Err(e) => return Err(e).context("cannot read the schema version"),
    }
    // Two first users of a schema serialise on the advisory lock, but the second may still
    // trip over the first's `CREATE SCHEMA IF NOT EXISTS` (seen behind pgbouncer: the waiting
    // backend's catalog cache predates the other's commit). A fresh transaction sees it.
    let mut attempt = 1;
    while let Err(e) = apply_migrations(client, schema).await {
        if attempt == 3 || !created_concurrently(&e) {
            return Err(e);
        }
        attempt += 1;
    }
    let shown = client.simple_query("SHOW statement_timeout").await?;
    Ok(shown
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
        .unwrap_or_default())
}

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
    tx.query_typed(
        "SELECT pg_advisory_xact_lock(hashtext('leasectl.migrate:' || $1::text))",
        &[(&schema.name(), Type::TEXT)],
    )
    .await
    .context("cannot take the migration lock")?;
    tx.batch_execute(&schema.sql(
        "CREATE SCHEMA IF NOT EXISTS {s};
         CREATE TABLE IF NOT EXISTS {s}.schema_migrations (
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
    .with_context(|| format!("cannot create schema \"{}\"", schema.name()))?;
    let applied: Vec<(i32, Option<Vec<u8>>)> = tx
        .query_typed(
            "SELECT version, checksum FROM schema_migrations ORDER BY version",
            &[],
        )
        .await?
        .iter()
        .map(|r| (r.get("version"), r.get("checksum")))
        .collect();
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
}
