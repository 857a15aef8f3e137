//! Least privilege: what a role that does not own the schema needs, and what to tell it when it
//! lacks some of it.
//!
//! The contract: an operator runs `leasectl migrate` as the schema's owner, then applies
//! [`script`] (`leasectl migrate --print-grants ROLE`); ROLE can then run every command. ROLE
//! cannot create or upgrade the schema, so an upgrade of leasectl starts with the owner's
//! `leasectl migrate` again. [`GRANTS`] lists the privileges object by object; a unit test checks
//! that it covers every table and function the migrations create.
//!
//! PostgreSQL's own refusal says only "permission denied for table leases". [`explain`] asks
//! the catalog which of [`GRANTS`] the role lacks and names them, with the fix (exit 77).

use std::time::Duration;

use anyhow::Result;
use tokio_postgres::types::Type;
use tokio_postgres::Client;

use crate::db::{Schema, Settings};
use crate::error::Failure;

/// `--schema`'s default: the hint leaves the flag out for it.
const DEFAULT_SCHEMA: &str = "leasectl";

/// A schema object leasectl's role needs privileges on.
#[derive(Debug, Clone, Copy)]
pub enum Object {
    /// The schema itself.
    Schema,
    /// A table of the schema.
    Table(&'static str),
}

/// Privileges on one object.
#[derive(Debug)]
pub struct Grant {
    pub privileges: &'static [&'static str],
    pub on: Object,
}

const READ_WRITE: &[&str] = &["SELECT", "INSERT", "UPDATE", "DELETE"];

/// Everything a role needs to run every command but `migrate` of an out-of-date schema.
///
/// Nothing else is needed, even where PUBLIC's default EXECUTE on functions was revoked: the
/// sequences behind `outbox.seq` and `waiters.ticket` need no grant (identity columns'), nor does the trigger
/// function `outbox_notify` (EXECUTE is checked when a trigger is created, not when it fires),
/// and leasectl never calls `rfc3339` (it is there for SQL that reads the outbox).
pub const GRANTS: &[Grant] = &[
    Grant {
        privileges: &["USAGE"],
        on: Object::Schema,
    },
    // Every command reads the ledger to check the schema version; only the owner writes it.
    Grant {
        privileges: &["SELECT"],
        on: Object::Table("schema_migrations"),
    },
    Grant {
        privileges: READ_WRITE,
        on: Object::Table("leases"),
    },
    Grant {
        privileges: READ_WRITE,
        on: Object::Table("runs"),
    },
    Grant {
        privileges: READ_WRITE,
        on: Object::Table("outbox"),
    },
    Grant {
        privileges: READ_WRITE,
        on: Object::Table("expectations"),
    },
    Grant {
        privileges: READ_WRITE,
        on: Object::Table("incidents"),
    },
    Grant {
        privileges: READ_WRITE,
        on: Object::Table("waiters"),
    },
];

impl Object {
    /// The word PostgreSQL uses for the kind, in GRANT and in "permission denied for …".
    fn kind(self) -> &'static str {
        match self {
            Object::Schema => "schema",
            Object::Table(_) => "table",
        }
    }

    /// The unqualified name PostgreSQL's refusal uses.
    fn name(self, schema: &Schema) -> &str {
        match self {
            Object::Schema => schema.name(),
            Object::Table(n) => n,
        }
    }

    /// The object as GRANT names it, quoted: `"s"`, `"s"."t"`.
    fn qualified(self, schema: &Schema) -> String {
        match self {
            Object::Schema => schema.sql("{s}"),
            Object::Table(t) => format!("{}.{}", schema.sql("{s}"), quote_ident(t)),
        }
    }
}

/// `name` as a quoted SQL identifier.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// The SQL an operator runs as the schema's owner so that `role` can use every command
/// (`leasectl migrate --print-grants ROLE`).
pub fn script(schema: &Schema, role: &str) -> String {
    let role_sql = quote_ident(role);
    let mut out = format!(
        "-- Lets role {role_sql} use leasectl's schema {schema_sql} (version {version}) without owning it.
-- Run as the schema's owner, after `leasectl migrate` as that owner, e.g.
--   {hint} | psql -v ON_ERROR_STOP=1
-- and again after every `leasectl migrate` that adds tables (a newer leasectl may need more).
-- The role also needs CONNECT on the database (PUBLIC has it unless revoked); no function or
-- sequence of the schema needs a grant.
-- `leasectl relay` vacuums the outbox after heavy draining; VACUUM needs ownership of the table
-- (PostgreSQL 15 and 16), which no grant gives, so a relay running as this role skips it (one
-- notice per relay) and leaves the outbox to autovacuum.
BEGIN;
",
        schema_sql = schema.sql("{s}"),
        version = super::SCHEMA_VERSION,
        hint = print_grants_command(schema, role),
    );
    for g in GRANTS {
        out.push_str(&format!(
            "GRANT {} ON {} {} TO {role_sql};\n",
            g.privileges.join(", "),
            g.on.kind().to_uppercase(),
            g.on.qualified(schema)
        ));
    }
    out.push_str("COMMIT;\n");
    out
}

/// `leasectl [--schema S] ARGS`: `--schema` only when it is not the default. (Schema names are
/// letters, digits and underscores: safe in a shell as they are.)
pub fn leasectl_command(schema: &Schema, args: &str) -> String {
    if schema.name() == DEFAULT_SCHEMA {
        format!("leasectl {args}")
    } else {
        format!("leasectl --schema {} {args}", schema.name())
    }
}

/// `leasectl [--schema S] migrate --print-grants ROLE`, safe to paste into a shell.
fn print_grants_command(schema: &Schema, role: &str) -> String {
    let plain = !role.is_empty()
        && role
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.@".contains(&b));
    let role = if plain {
        role.to_owned()
    } else {
        format!("'{}'", role.replace('\'', "'\\''"))
    };
    leasectl_command(schema, &format!("migrate --print-grants {role}"))
}

/// One object's privileges that the role lacks (or, from [`extra`], holds beyond [`GRANTS`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Missing {
    pub kind: &'static str,
    /// Unqualified, as PostgreSQL's refusal names it.
    pub name: String,
    pub qualified: String,
    pub privileges: Vec<&'static str>,
}

/// How long the look-up behind a "permission denied" may take before the message goes out
/// without it.
const LOOKUP_DEADLINE: Duration = Duration::from_secs(5);

/// Rewrites a "permission denied" in `err` into one line naming the privileges the role lacks
/// and the object, and who can fix it ([`Failure::Permission`], exit 77); any other error is
/// returned as it is.
///
/// The failed statement's connection is gone by now, so this opens one more (only on this
/// path) to ask the catalog. Should that fail, the line carries PostgreSQL's own words.
pub async fn explain(
    database_url: Option<&str>,
    schema: &Schema,
    err: anyhow::Error,
) -> anyhow::Error {
    let Some(denied) = crate::error::permission_denied(&err) else {
        return err;
    };
    let refusal = denied.message().to_owned();
    let lookup = async {
        let client = Settings::new(database_url)?.open_client().await?;
        let role = current_role(&client).await;
        anyhow::Ok((role, missing(&client, schema).await?))
    };
    let (role, missing) = match tokio::time::timeout(LOOKUP_DEADLINE, lookup).await {
        Ok(Ok(found)) => found,
        _ => (None, Vec::new()),
    };
    Failure::Permission(message(schema, &refusal, role.as_deref(), &missing)).into()
}

/// The role this session runs as, for messages; `None` if even that cannot be asked.
pub async fn current_role(client: &Client) -> Option<String> {
    let row = client
        .query_typed_one("SELECT current_user::text", &[])
        .await
        .ok()?;
    row.try_get(0).ok()
}

/// The privileges of [`GRANTS`] the session's role lacks, object by object, in [`GRANTS`]'s
/// order. Objects that do not exist are skipped (that is a migration problem, not a grant). The
/// catalog is read by OID, which needs no privilege on the schema.
pub async fn missing(client: &Client, schema: &Schema) -> Result<Vec<Missing>> {
    let checks = GRANTS
        .iter()
        .enumerate()
        .flat_map(|(i, g)| g.privileges.iter().map(move |&p| (i, p)));
    held_or_not(client, schema, checks, false).await
}

/// Every privilege a table can be granted, and a schema: what [`extra`] looks for beyond
/// [`GRANTS`].
const TABLE_PRIVILEGES: &[&str] = &[
    "SELECT",
    "INSERT",
    "UPDATE",
    "DELETE",
    "TRUNCATE",
    "REFERENCES",
    "TRIGGER",
];
const SCHEMA_PRIVILEGES: &[&str] = &["USAGE", "CREATE"];

/// The privileges on the objects of [`GRANTS`] that the session's role holds but leasectl never
/// uses (least privilege: `TRUNCATE` on the outbox, `CREATE` on the schema, …), object by object
/// in [`GRANTS`]'s order. A superuser or an owner holds them all; [`standing`] says so instead.
pub async fn extra(client: &Client, schema: &Schema) -> Result<Vec<Missing>> {
    let checks = GRANTS.iter().enumerate().flat_map(|(i, g)| {
        let all = match g.on {
            Object::Schema => SCHEMA_PRIVILEGES,
            Object::Table(_) => TABLE_PRIVILEGES,
        };
        all.iter()
            .filter(|p| !g.privileges.contains(p))
            .map(move |&p| (i, p))
    });
    held_or_not(client, schema, checks, true).await
}

/// Of `checks` (a privilege on the object of [`GRANTS`]`[i]`), those the session's role holds
/// (`held`) or lacks (not `held`), grouped by object in [`GRANTS`]'s order. An object that does
/// not exist (a table of a schema not yet migrated) is in neither list.
async fn held_or_not(
    client: &Client,
    schema: &Schema,
    checks: impl Iterator<Item = (usize, &'static str)>,
    held: bool,
) -> Result<Vec<Missing>> {
    let checks: Vec<(usize, &'static str)> = checks.collect();
    if checks.is_empty() {
        return Ok(Vec::new());
    }
    let values: Vec<String> = checks
        .iter()
        .map(|&(i, p)| {
            let g = &GRANTS[i];
            let name = match g.on {
                Object::Schema => "",
                Object::Table(t) => t,
            };
            format!("({i}, '{}', '{name}', '{p}')", g.on.kind())
        })
        .collect();
    let sql = format!(
        "SELECT g.i, g.privilege
           FROM (VALUES {}) AS g(i, kind, name, privilege)
           JOIN pg_namespace n ON n.nspname = $1
          WHERE CASE g.kind
                WHEN 'schema' THEN has_schema_privilege(n.oid, g.privilege)
                ELSE has_table_privilege(
                    (SELECT c.oid FROM pg_class c
                      WHERE c.relnamespace = n.oid AND c.relname = g.name), g.privilege)
                END = $2
          ORDER BY g.i",
        values.join(", ")
    );
    let rows = client
        .query_typed(&sql, &[(&schema.name(), Type::TEXT), (&held, Type::BOOL)])
        .await?;
    let mut out: Vec<(usize, Missing)> = Vec::new();
    for row in rows {
        let i = usize::try_from(row.try_get::<_, i32>(0)?)?;
        let privilege: String = row.try_get(1)?;
        let Some(&(_, p)) = checks.iter().find(|&&(j, p)| j == i && p == privilege) else {
            continue;
        };
        let g = &GRANTS[i];
        match out.last_mut() {
            Some((j, m)) if *j == i => m.privileges.push(p),
            _ => out.push((
                i,
                Missing {
                    kind: g.on.kind(),
                    name: g.on.name(schema).to_owned(),
                    qualified: g.on.qualified(schema),
                    privileges: vec![p],
                },
            )),
        }
    }
    Ok(out.into_iter().map(|(_, m)| m).collect())
}

/// What the session's role is beyond its grants: a superuser, or the owner (or a member of the
/// owning role) of the schema or of one of its tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Standing {
    pub role: String,
    pub superuser: bool,
    /// The schema's owner, when the role is it or a member of it.
    pub owns_schema: Option<String>,
    /// Tables of [`GRANTS`] the role owns (directly or through membership).
    pub owns_tables: Vec<String>,
}

/// Reads the role's [`Standing`]; the catalog needs no privilege to read.
pub async fn standing(client: &Client, schema: &Schema) -> Result<Standing> {
    let tables: Vec<String> = GRANTS
        .iter()
        .filter_map(|g| match g.on {
            Object::Table(t) => Some(t.to_owned()),
            Object::Schema => None,
        })
        .collect();
    let row = client
        .query_typed_one(
            "SELECT current_user::text AS role,
                    (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) AS superuser,
                    (SELECT pg_get_userbyid(n.nspowner)::text FROM pg_namespace n
                      WHERE n.nspname = $1 AND pg_has_role(n.nspowner, 'USAGE')) AS owns_schema,
                    ARRAY(SELECT c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                           WHERE n.nspname = $1 AND c.relname = ANY($2)
                             AND pg_has_role(c.relowner, 'USAGE')
                           ORDER BY c.relname) AS owns_tables",
            &[(&schema.name(), Type::TEXT), (&tables, Type::TEXT_ARRAY)],
        )
        .await?;
    Ok(Standing {
        role: row.try_get("role")?,
        superuser: row
            .try_get::<_, Option<bool>>("superuser")?
            .unwrap_or(false),
        owns_schema: row.try_get("owns_schema")?,
        owns_tables: row.try_get("owns_tables")?,
    })
}

/// `leasectl [--schema S] migrate --print-grants ROLE`, for a fix line.
pub fn print_grants_hint(schema: &Schema, role: &str) -> String {
    print_grants_command(schema, role)
}

/// The one line for a refusal: the object PostgreSQL named if the role lacks privileges on it,
/// else the first object it lacks privileges on, else PostgreSQL's words.
fn message(schema: &Schema, refusal: &str, role: Option<&str>, missing: &[Missing]) -> String {
    let fix = format!(
        "ask an operator to run: {}",
        print_grants_command(schema, role.unwrap_or("ROLE"))
    );
    let named = missing
        .iter()
        .find(|m| refusal == format!("permission denied for {} {}", m.kind, m.name));
    match (named.or(missing.first()), role) {
        (Some(m), Some(role)) => format!(
            "permission denied: role {} needs {} on {} {} ({fix})",
            quote_ident(role),
            m.privileges.join(", "),
            m.kind,
            m.qualified
        ),
        _ => format!("{refusal} ({fix})"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Functions the migrations create, none of which needs a grant (see [`GRANTS`]).
    const UNGRANTED_FUNCTIONS: &[&str] = &["outbox_notify", "rfc3339"];

    #[test]
    fn the_grants_cover_every_table_and_function_the_migrations_create() {
        let granted = |table: &str| {
            GRANTS
                .iter()
                .any(|g| matches!(g.on, Object::Table(t) if t == table))
        };
        for m in super::super::MIGRATIONS {
            let words: Vec<&str> = m.sql.split_whitespace().collect();
            for w in words.windows(3) {
                if w[0] != "CREATE" {
                    continue;
                }
                let name = w[2].split('(').next().unwrap_or_default();
                match w[1] {
                    "TABLE" => assert!(granted(name), "no grant for table {name}"),
                    "FUNCTION" => assert!(
                        UNGRANTED_FUNCTIONS.contains(&name),
                        "function {name}: does the role need EXECUTE on it?"
                    ),
                    "SEQUENCE" | "VIEW" | "TYPE" => {
                        panic!(
                            "migration {} creates a {} {name}: add its grant",
                            m.name, w[1]
                        )
                    }
                    _ => {}
                }
            }
        }
    }

    #[test]
    fn the_script_quotes_schema_and_role() {
        let s = script(&Schema::new("lc_1"), "we\"ird role");
        assert!(
            s.contains("GRANT USAGE ON SCHEMA \"lc_1\" TO \"we\"\"ird role\";"),
            "{s}"
        );
        assert!(s.contains(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE \"lc_1\".\"leases\" TO \"we\"\"ird role\";"
        ));
        assert!(s.contains("--print-grants 'we\"ird role' | psql"), "{s}");
        assert!(s.starts_with("--") && s.ends_with("COMMIT;\n"));
    }

    #[test]
    fn the_message_names_what_postgres_refused() {
        let schema = Schema::new("leasectl");
        let m = |kind, name: &str, qualified: &str, privileges| Missing {
            kind,
            name: name.into(),
            qualified: qualified.into(),
            privileges,
        };
        let missing = [
            m("table", "leases", "\"leasectl\".\"leases\"", vec!["UPDATE"]),
            m(
                "table",
                "runs",
                "\"leasectl\".\"runs\"",
                vec!["INSERT", "DELETE"],
            ),
        ];
        assert_eq!(
            message(&schema, "permission denied for table runs", Some("app"), &missing),
            "permission denied: role \"app\" needs INSERT, DELETE on table \"leasectl\".\"runs\" (ask an operator to run: leasectl migrate --print-grants app)"
        );
        assert!(message(
            &schema,
            "permission denied for sequence x",
            Some("app"),
            &missing
        )
        .contains("needs UPDATE on table \"leasectl\".\"leases\""));
        assert_eq!(
            message(&Schema::new("s2"), "permission denied for table x", None, &[]),
            "permission denied for table x (ask an operator to run: leasectl --schema s2 migrate --print-grants ROLE)"
        );
    }
}
