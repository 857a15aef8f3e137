//! The server's version, the schema's migrations and checksums, and the role's privileges.

use anyhow::Result;

use super::{could_not, read_only, Check, Ctx};
use crate::db::migrate::{self, grants, Ledger};
use crate::db::SCHEMA_VERSION;

/// The oldest PostgreSQL leasectl works with (the relay's claim sets `hash_mem_multiplier`).
const MIN_SERVER_VERSION: i32 = 130_000;

/// `server`: the version, against `MIN_SERVER_VERSION`.
pub async fn version(ctx: &Ctx) -> Result<Check> {
    let row = ctx
        .client()
        .query_typed_one(
            "SELECT current_setting('server_version_num')::int4 AS num,
                    current_setting('server_version') AS version",
            &[],
        )
        .await?;
    let num: i32 = row.try_get("num")?;
    let version: String = row.try_get("version")?;
    let who = format!(
        "PostgreSQL {version}, database \"{}\" as role \"{}\"",
        ctx.database, ctx.role
    );
    Ok(if num < MIN_SERVER_VERSION {
        Check::fail(
            "server",
            format!("{who}: older than 13, which leasectl needs"),
            "upgrade PostgreSQL to 13 or newer",
        )
    } else {
        Check::ok("server", who)
    })
}

/// `schema`: the migration ledger against this binary's migrations, read without migrating.
/// Also returns what it found, for the checks that need the tables.
pub async fn schema(ctx: &Ctx) -> Result<(Check, Option<Ledger>)> {
    let schema = &ctx.db.schema;
    let found = read_only(ctx.client(), migrate::inspect(ctx.client(), schema)).await;
    let ledger = match found {
        Ok(l) => l,
        Err(e) => {
            return Ok((
                could_not(ctx, "schema", "read the migration ledger", e)?,
                None,
            ))
        }
    };
    let name = schema.name();
    let migrate = format!(
        "run `{}` as the role that owns the schema (or may create it)",
        grants::leasectl_command(schema, "migrate")
    );
    let check = match &ledger {
        Ledger::NoSchema => Check::warn(
            "schema",
            format!(
                "schema \"{name}\" does not exist: all {SCHEMA_VERSION} migrations pending (the first leasectl command whose role may create it applies them)"
            ),
            migrate,
        ),
        Ledger::NoLedger => Check::warn(
            "schema",
            format!(
                "schema \"{name}\" has no leasectl tables: all {SCHEMA_VERSION} migrations pending"
            ),
            migrate,
        ),
        Ledger::Found(s) if s.too_new() => Check::fail(
            "schema",
            format!(
                "schema \"{name}\" is at version {}, newer than this leasectl ({SCHEMA_VERSION}): every command refuses it (exit 78)",
                s.newest
            ),
            "upgrade leasectl to the version that migrated it",
        ),
        Ledger::Found(s) if !s.mismatched.is_empty() => Check::fail(
            "schema",
            format!(
                "migration {} applied to schema \"{name}\" differs from this leasectl's (checksum mismatch): the schema was changed by hand or by another build, and every command refuses it (exit 78)",
                s.mismatched.join(", ")
            ),
            "use the leasectl build that migrated this schema, or restore the schema from that build's migrations",
        ),
        Ledger::Found(s) if !s.pending.is_empty() => Check::warn(
            "schema",
            format!(
                "schema \"{name}\" is at version {} of {SCHEMA_VERSION}: pending {}",
                s.newest,
                s.pending.join(", ")
            ),
            migrate,
        ),
        Ledger::Found(s) if s.unsummed > 0 => Check::warn(
            "schema",
            format!(
                "schema \"{name}\" is at version {SCHEMA_VERSION}, but {} applied migration(s) have no checksum yet (a ledger from before checksums)",
                s.unsummed
            ),
            migrate,
        ),
        Ledger::Found(_) => Check::ok(
            "schema",
            format!(
                "schema \"{name}\" is at version {SCHEMA_VERSION}: every migration applied, checksums match"
            ),
        ),
    };
    Ok((check, Some(ledger)))
}

/// `privileges`: what the role lacks of [`grants::GRANTS`] (fail), and what it holds beyond
/// them — superuser, the schema's or a table's owner, other privileges (warn: a job or relay
/// role should hold exactly the printed grants).
pub async fn privileges(ctx: &Ctx, ledger: Option<&Ledger>) -> Result<Check> {
    let schema = &ctx.db.schema;
    let hint = grants::print_grants_hint(schema, &ctx.role);
    if !super::tables_exist(ledger) {
        return Ok(Check::warn(
            "privileges",
            "not checked: the schema has no leasectl tables yet",
            format!(
                "after `{}` as the owner, have it apply `{hint}`",
                grants::leasectl_command(schema, "migrate")
            ),
        ));
    }
    let look = async {
        let standing = grants::standing(ctx.client(), schema).await?;
        let missing = grants::missing(ctx.client(), schema).await?;
        let extra = grants::extra(ctx.client(), schema).await?;
        anyhow::Ok((standing, missing, extra))
    };
    let (standing, missing, extra) = match read_only(ctx.client(), look).await {
        Ok(found) => found,
        Err(e) => return could_not(ctx, "privileges", "read the role's privileges", e),
    };
    let role = grants::quote_ident(&standing.role);
    let list = |ms: &[grants::Missing]| {
        ms.iter()
            .map(|m| format!("{} on {} {}", m.privileges.join(", "), m.kind, m.qualified))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let least = format!(
        "run jobs and relays as a role that owns nothing and holds only what `{hint}` prints (the owner or a superuser is right for `migrate` itself)"
    );
    Ok(if !missing.is_empty() {
        Check::fail(
            "privileges",
            format!(
                "role {role} lacks {}: commands that touch them exit 77",
                list(&missing)
            ),
            format!("have the schema's owner apply `{hint}`"),
        )
    } else if standing.superuser {
        Check::warn(
            "privileges",
            format!("role {role} is a superuser: more than leasectl needs"),
            least,
        )
    } else if let Some(owner) = &standing.owns_schema {
        Check::warn(
            "privileges",
            format!(
                "role {role} owns schema \"{}\" (as {}): more than leasectl needs to run jobs",
                schema.name(),
                grants::quote_ident(owner)
            ),
            least,
        )
    } else if !standing.owns_tables.is_empty() {
        Check::warn(
            "privileges",
            format!(
                "role {role} owns table(s) {}: more than leasectl needs to run jobs",
                standing.owns_tables.join(", ")
            ),
            least,
        )
    } else if !extra.is_empty() {
        let revoke = extra
            .iter()
            .map(|m| {
                format!(
                    "REVOKE {} ON {} {} FROM {role};",
                    m.privileges.join(", "),
                    m.kind.to_uppercase(),
                    m.qualified
                )
            })
            .collect::<Vec<_>>()
            .join(" ");
        Check::warn(
            "privileges",
            format!(
                "role {role} has every privilege leasectl needs, and more: {}",
                list(&extra)
            ),
            format!("as the owner: {revoke}"),
        )
    } else {
        Check::ok(
            "privileges",
            format!("role {role} holds exactly the privileges of `{hint}`"),
        )
    })
}
