//! Least privilege: a role holding exactly what `migrate --print-grants` prints can use every
//! command; a role without it exits 77 with one line naming the privilege and the object, or
//! telling it to have the owner run `leasectl migrate`.
//!
//! Roles are cluster-wide, so each test makes its own with a unique name and drops it when the
//! test ends, however it ends ([`Role`]'s drop). The schema is migrated by the test's own
//! connection (a superuser), as an operator would as the schema's owner.

use std::process::{Command, Output};

use serde_json::Value;

use crate::common::*;
use crate::events::insert_events;

/// A throwaway LOGIN role, dropped (with every privilege granted to it) on drop.
pub(crate) struct Role {
    pub(crate) name: String,
    /// The test database's connection string, as this role (trust authentication).
    pub(crate) url: String,
}

impl Role {
    pub(crate) fn new(env: &Env) -> Role {
        let name = format!(
            "lc_priv_{}",
            uuid::Uuid::new_v4().simple().to_string().get(..12).unwrap()
        );
        admin(&format!("CREATE ROLE \"{name}\" LOGIN"));
        let url = if env.url.contains("://") {
            let sep = if env.url.contains('?') { '&' } else { '?' };
            format!("{}{sep}user={name}", env.url)
        } else {
            format!("{} user={name}", env.url)
        };
        Role { name, url }
    }

    /// `leasectl --database-url URL-as-this-role --schema … ARGS` for `env`'s schema.
    pub(crate) fn command(&self, env: &Env) -> Command {
        env.command_at(&self.url)
    }

    fn run(&self, env: &Env, args: &[&str]) -> Output {
        self.command(env).args(args).output_in_time()
    }

    /// As [`Role::run`], asserting exit 0; returns stdout.
    fn ok(&self, env: &Env, args: &[&str]) -> String {
        let o = self.run(env, args);
        assert_eq!(code(&o), 0, "{args:?} as the role: {}", stderr(&o));
        stdout(&o)
    }

    /// Applies exactly what `leasectl migrate --print-grants ROLE` prints, as the owner.
    pub(crate) fn grant(&self, env: &Env) {
        // No connection is needed to print: an unreachable database changes nothing.
        let o = env
            .command_at("host=/nonexistent dbname=none")
            .args(["migrate", "--print-grants", &self.name])
            .output_in_time();
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        admin(&stdout(&o));
    }
}

impl Drop for Role {
    fn drop(&mut self) {
        let _ = try_admin(&format!(
            "DROP OWNED BY \"{0}\"; DROP ROLE \"{0}\"",
            self.name
        ));
    }
}

/// Runs SQL on the test database as the test's own (superuser) connection.
pub(crate) fn admin(sql: &str) {
    try_admin(sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
}

fn try_admin(sql: &str) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        let client = leasectl::db::Settings::new(Some(&database_url()))
            .map_err(|e| e.to_string())?
            .open_client()
            .await
            .map_err(|e| e.to_string())?;
        client.batch_execute(sql).await.map_err(|e| e.to_string())
    })
}

/// A migrated schema whose functions PUBLIC may not execute (an operator may have revoked the
/// default), so that nothing works by accident of PUBLIC's privileges.
fn owned_schema() -> Env {
    let env = Env::new();
    assert_eq!(code(&env.run(&["migrate"])), 0);
    env.sql(&format!(
        "REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA \"{}\" FROM PUBLIC",
        env.schema
    ));
    env
}

#[test]
fn a_role_with_only_the_printed_grants_can_use_every_command() {
    let env = owned_schema();
    let app = Role::new(&env);
    app.grant(&env);

    // A schema without its marker (migrated by a leasectl from before markers): the role, which
    // may not mark it, runs all the same, reading the ledger.
    let markers = "SELECT count(*) FROM pg_type WHERE typnamespace = current_schema()::regnamespace
                     AND typname LIKE 'leasectl\\_ledger\\_%'";
    assert_eq!(env.scalar(markers), "1");
    env.sql("UPDATE schema_migrations SET name = name WHERE false");
    assert_eq!(env.scalar(markers), "0");
    assert_eq!(
        app.ok(&env, &["run", "--target", "unmarked", "--", "true"]),
        ""
    );
    assert_eq!(env.scalar(markers), "0");
    env.sql("DELETE FROM runs; DELETE FROM outbox; DELETE FROM leases");
    let o = env.run(&["migrate"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(env.scalar(markers), "1");

    // run: a stored run and its outbox event.
    assert_eq!(
        app.ok(&env, &["run", "--target", "t", "--", "echo", "first"]),
        "first\n"
    );
    // --reuse-within shares that result instead of running again.
    let reused = app.ok(
        &env,
        &[
            "run",
            "--target",
            "t",
            "--reuse-within",
            "5m",
            "--",
            "echo",
            "second",
        ],
    );
    assert_eq!(reused, "first\n");

    // --wait behind a holder (both as the role): it waits, then runs once the holder is gone.
    let holder = env.hold_with(app.command(&env), "w", &["--ttl", "2s"], "sleep 30");
    let waiter = Watched::new(
        app.command(&env)
            .args([
                "-v",
                "run",
                "--target",
                "w",
                "--wait=60s",
                "--",
                "echo",
                "waited",
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    waiter.wait_for_stderr("waiting for 'w'");
    env.stop(holder);
    let o = waiter.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(stdout(&o), "waited\n");

    // release --force breaks a live lease: its holder stops and exits 76.
    let holder = env.hold_with(app.command(&env), "r", &["--ttl", "2s"], "sleep 30");
    let released = app.ok(&env, &["release", "--target", "r", "--force"]);
    assert!(released.starts_with("released 'r'"), "{released}");
    assert_eq!(code(&finish(holder)), 76);

    // status, runs and output read it all back.
    assert!(app.ok(&env, &["status"]).contains("outbox: "));
    let status: Value = serde_json::from_str(&app.ok(&env, &["status", "--json"])).unwrap();
    let targets = status["targets"].as_array().unwrap();
    let mut names: Vec<&str> = targets
        .iter()
        .map(|t| t["target"].as_str().unwrap())
        .collect();
    names.sort_unstable();
    assert_eq!(names, ["r", "t", "w"]);
    let t = targets.iter().find(|t| t["target"] == "t").unwrap();
    assert!(t["last_run"]["finished_at"]
        .as_str()
        .unwrap()
        .ends_with('Z'));
    let runs: Value =
        serde_json::from_str(&app.ok(&env, &["runs", "--target", "t", "--json"])).unwrap();
    assert_eq!(runs["runs"].as_array().unwrap().len(), 1);
    assert_eq!(app.ok(&env, &["output", "--target", "t"]), "first\n");

    // The outbox operator commands: list, retry (one and all dead), discard.
    let list: Value = serde_json::from_str(&app.ok(&env, &["outbox", "list", "--json"])).unwrap();
    let events = list["events"].as_array().unwrap();
    assert!(events.len() >= 3, "{list}");
    let id = |i: usize| events[i]["id"].as_str().unwrap().to_owned();
    env.sql("UPDATE outbox SET attempts = 10, dead_at = now(), last_error = 'x'");
    app.ok(&env, &["outbox", "retry", &id(0)]);
    app.ok(&env, &["outbox", "retry", "--all-dead"]);
    assert_eq!(
        env.scalar("SELECT count(*) FROM outbox WHERE dead_at IS NOT NULL"),
        "0"
    );
    let discarded: Value =
        serde_json::from_str(&app.ok(&env, &["outbox", "discard", "--force", &id(0)])).unwrap();
    assert_eq!(discarded["id"], id(0).as_str());

    // The relay delivers the rest and deletes them.
    let pending: usize = env.scalar("SELECT count(*) FROM outbox").parse().unwrap();
    let published = app.ok(&env, &["relay", "--once", "--sink", "stdout"]);
    assert_eq!(published.lines().count(), pending, "{published}");
    assert!(published.contains("leasectl.run.finished"), "{published}");
    assert_eq!(env.scalar("SELECT count(*) FROM outbox"), "0");

    // prune deletes an old run (each target keeps its newest).
    assert_eq!(app.ok(&env, &["run", "--target", "t", "--", "true"]), "");
    env.sql("UPDATE runs SET finished_at = finished_at - interval '2 days' WHERE target = 't' AND fence = 1");
    let o = app.run(&env, &["prune", "--older-than", "1d"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stderr(&o).contains("deleted 1 run "), "{}", stderr(&o));

    // An out-of-date schema is the owner's to upgrade: the role is told so, exit 77.
    env.sql("DELETE FROM schema_migrations WHERE version >= 2");
    let o = app.run(&env, &["status"]);
    assert_one_line_error(&o, 77, "is at version 1, older than this leasectl");
    assert!(
        stderr(&o).contains(&format!(
            "ask an operator to run `leasectl --schema {} migrate` as the schema owner",
            env.schema
        )),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_role_without_grants_exits_77_naming_the_privilege_and_the_object() {
    let env = owned_schema();
    let none = Role::new(&env);
    let fix = format!(
        "(ask an operator to run: leasectl --schema {} migrate --print-grants {})",
        env.schema, none.name
    );

    let o = none.run(&env, &["status"]);
    assert_one_line_error(
        &o,
        77,
        &format!(
            "leasectl: permission denied: role \"{}\" needs USAGE on schema \"{}\" {fix}",
            none.name, env.schema
        ),
    );

    // With some of the grants, the line names what is still missing on the refused table.
    env.sql(&format!(
        "GRANT USAGE ON SCHEMA \"{0}\" TO \"{1}\";
         GRANT SELECT ON ALL TABLES IN SCHEMA \"{0}\" TO \"{1}\"",
        env.schema, none.name
    ));
    let o = none.run(&env, &["run", "--target", "t", "--", "echo", "never"]);
    assert_one_line_error(
        &o,
        77,
        &format!(
            "needs INSERT, UPDATE, DELETE on table \"{}\".\"leases\" {fix}",
            env.schema
        ),
    );
    assert_eq!(stdout(&o), "", "the command must not have run");

    // A schema that does not exist yet, which the role may not create.
    let fresh = Env::new();
    let o = none.run(&fresh, &["status"]);
    assert_one_line_error(
        &o,
        77,
        &format!(
            "schema \"{0}\" does not exist and role \"{1}\" may not create it",
            fresh.schema, none.name
        ),
    );
    assert!(
        stderr(&o).contains(&format!(
            "ask an operator to run `leasectl --schema {} migrate` as the schema owner",
            fresh.schema
        )),
        "{}",
        stderr(&o)
    );
}

#[test]
fn a_relay_that_may_not_vacuum_says_so_once_and_delivers_everything() {
    let env = owned_schema();
    let app = Role::new(&env);
    app.grant(&env);
    // The relay vacuums after every 20 000 deliveries: twice the chance to repeat itself.
    insert_events(&env, 40_000, 50, 1);
    let o = app.run(&env, &["relay", "--once", "--sink", "stdout"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(stdout(&o).lines().count(), 40_000);
    assert_eq!(env.scalar("SELECT count(*) FROM outbox"), "0");
    let err = stderr(&o);
    assert_eq!(
        err.lines().collect::<Vec<_>>(),
        ["leasectl: notice: this role may not VACUUM the outbox (it needs the table's ownership); leaving it to autovacuum"],
        "{err}"
    );
}

#[test]
fn print_grants_refuses_public_and_needs_no_database() {
    let env = Env::new();
    let o = env
        .command_at("host=/nonexistent dbname=none")
        .args(["migrate", "--print-grants", "public"])
        .output_in_time();
    assert_one_line_error(&o, 2, "would grant to every role");
    let o = env
        .command_at("host=/nonexistent dbname=none")
        .args(["migrate", "--print-grants", "App"])
        .output_in_time();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let sql = stdout(&o);
    assert!(
        sql.contains(&format!(
            "GRANT USAGE ON SCHEMA \"{}\" TO \"App\";",
            env.schema
        )),
        "{sql}"
    );
    assert!(sql.contains("VACUUM"), "the VACUUM note: {sql}");
}

#[test]
fn a_waiter_waits_out_a_database_that_has_no_connection_for_it_yet_but_not_a_refusal() {
    // A hundred callers waiting at once can exhaust max_connections; a role's CONNECTION LIMIT
    // shows the same: `too many connections`. A waiter (--wait) retries within its limit.
    let env = owned_schema();
    let app = Role::new(&env);
    app.grant(&env);
    admin(&format!("ALTER ROLE \"{}\" CONNECTION LIMIT 1", app.name));
    let rt = runtime();
    let held = rt.block_on(async {
        leasectl::db::Settings::new(Some(&app.url))
            .unwrap()
            .open_client()
            .await
            .unwrap()
    });
    let waiter = app
        .command(&env)
        .args(["run", "--target", "c", "--wait=60s", "--", "echo", "ran"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let waiter = Watched::new(waiter);
    waiter.wait_for_stderr("retrying while waiting for 'c'");
    drop(held);
    drop(rt);
    let o = waiter.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(stdout(&o), "ran\n");

    // A refusal of the caller itself does not go away by waiting: one line, exit 69, at once.
    let ghost = env
        .command_at(&format!("{} user=lc_no_such_role", database_url()))
        .args(["run", "--target", "c", "--wait=60s", "--", "true"])
        .output_within(std::time::Duration::from_secs(20));
    assert_one_line_error(&ghost, 69, "lc_no_such_role");
}

/// Only the ledger's owner marks a schema (the check `run` makes by the marker's name: see
/// tests/it/inspect.rs). A superuser's marker in another role's schema would be one the owner's
/// trigger could not drop, and the owner's next upgrade would fail on it.
#[test]
fn only_the_ledgers_owner_marks_the_schema_and_any_ledger_change_drops_the_marker() {
    let env = Env::new();
    assert_eq!(code(&env.run(&["migrate"])), 0);
    let owner = Role::new(&env);
    let (s, o) = (&env.schema, &owner.name);
    let markers = format!(
        "SELECT coalesce(string_agg(typowner::regrole::text, ','), '') FROM pg_type
          WHERE typnamespace = '\"{s}\"'::regnamespace AND typname LIKE 'leasectl\\_ledger\\_%'"
    );
    assert_eq!(env.scalar(&markers), env.scalar("SELECT current_user"));
    // The schema handed over to the role, unmarked.
    admin(&format!(
        "DROP TYPE \"{s}\".\"{}\";
         ALTER SCHEMA \"{s}\" OWNER TO \"{o}\";
         ALTER TABLE \"{s}\".schema_migrations OWNER TO \"{o}\";
         ALTER FUNCTION \"{s}\".ledger_changed() OWNER TO \"{o}\"",
        env.scalar(&markers.replace("typowner::regrole::text", "typname"))
    ));
    assert_eq!(env.scalar(&markers), "");

    // A superuser's run reads the ledger and leaves the schema unmarked.
    let out = env.run(&["run", "--target", "t", "--", "true"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(env.scalar(&markers), "");

    // The owner's migrate marks it, with a marker of its own.
    let out = owner.run(&env, &["migrate"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(&env.scalar(&markers), o);

    // Whoever changes the ledger, the owner's trigger drops the owner's marker.
    admin(&format!(
        "UPDATE \"{s}\".schema_migrations SET name = name WHERE false"
    ));
    assert_eq!(env.scalar(&markers), "");
}
