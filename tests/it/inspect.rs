//! What operators use to see and fix things: status, runs, output, release, migrate, and the
//! schema handling underneath (isolation, concurrent first use, a newer schema refused).

use crate::common::*;

#[test]
fn status_json_has_the_documented_keys_for_held_and_free_targets() {
    let env = Env::new();
    assert_eq!(
        code(&env.run(&["run", "--target", "done", "--", "sh", "-c", "exit 4"])),
        4
    );
    let holder = env.hold_with(env.command(), "busy", &["--ttl", "1m"], "sleep 30");

    let s = env.status();
    let targets = s["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 2);
    let busy = &targets[0];
    assert_eq!(busy["target"], "busy");
    assert_eq!(busy["state"], "held");
    assert_eq!(busy["holder_pid"], holder.id());
    assert!(busy["holder_host"].is_string());
    assert_eq!(busy["fence"], 1);
    assert!(busy["heartbeat_age_ms"].as_i64().unwrap() >= 0);
    assert_eq!(busy["ttl_ms"], 60000);
    assert!(busy["last_run"].is_null());
    let done = &targets[1];
    assert_eq!(done["state"], "free");
    assert!(done["holder_host"].is_null() && done["heartbeat_age_ms"].is_null());
    let last = &done["last_run"];
    assert_eq!(last["outcome"], "completed");
    assert_eq!(last["exit_code"], 4);
    assert!(last["run_id"].is_string() && last["finished_at"].as_str().unwrap().ends_with('Z'));
    assert!(last["duration_ms"].as_i64().unwrap() >= 0);
    assert_eq!(s["outbox"]["pending"], 1);
    assert_eq!(s["outbox"]["dead"], 0);
    assert!(s["outbox"]["oldest_pending_age_ms"].as_i64().unwrap() >= 0);

    // --target filters; the table names the same things.
    let one = env.run(&["status", "--target", "done", "--json"]);
    let one: serde_json::Value = serde_json::from_slice(&one.stdout).unwrap();
    assert_eq!(one["targets"].as_array().unwrap().len(), 1);
    let table = stdout(&env.run(&["status"]));
    assert!(
        table.contains("busy")
            && table.contains("held")
            && table.contains(&format!("pid {}", holder.id())),
        "{table}"
    );
    assert!(table.contains("outbox: 1 pending, 0 dead"), "{table}");

    env.stop(holder);
    // An expired holder shows as expired, not held.
    env.sql("UPDATE leases SET token = gen_random_uuid(), heartbeat_at = now() - interval '2 minutes', ttl_ms = 1000 WHERE target = 'done'");
    let s = env.run(&["status", "--target", "done", "--json"]);
    let s: serde_json::Value = serde_json::from_slice(&s.stdout).unwrap();
    assert_eq!(s["targets"][0]["state"], "expired");
}

#[test]
fn runs_lists_newest_first_with_outcomes_and_limit() {
    let env = Env::new();
    for script in ["exit 0", "exit 1", "kill -KILL $$"] {
        env.run(&["run", "--target", "r", "--", "sh", "-c", script]);
    }
    env.run(&["run", "--target", "r", "--", "/nonexistent"]);
    let all: serde_json::Value =
        serde_json::from_slice(&env.run(&["runs", "--target", "r", "--json"]).stdout).unwrap();
    let runs = all["runs"].as_array().unwrap();
    let summary: Vec<String> = runs
        .iter()
        .map(|r| format!("{}:{}:{}", r["fence"], r["outcome"], r["exit_code"]))
        .collect();
    assert_eq!(
        summary,
        [
            "4:\"exec_failed\":127",
            "3:\"completed\":null",
            "2:\"completed\":1",
            "1:\"completed\":0"
        ]
    );
    assert_eq!(runs[1]["signal"], 9);
    let limited: serde_json::Value = serde_json::from_slice(
        &env.run(&["runs", "--target", "r", "--limit", "1", "--json"])
            .stdout,
    )
    .unwrap();
    assert_eq!(limited["runs"].as_array().unwrap().len(), 1);
    let table = stdout(&env.run(&["runs", "--target", "r"]));
    assert_eq!(table.lines().count(), 5, "{table}");
    assert!(table.lines().nth(1).unwrap().contains("exec_failed"));
}

#[test]
fn output_of_a_target_without_runs_exits_1() {
    let env = Env::new();
    let o = env.run(&["output", "--target", "nothing"]);
    assert_one_line_error(&o, 1, "no stored run of 'nothing'");
}

#[test]
fn release_of_a_free_target_says_so() {
    let env = Env::new();
    let o = env.run(&["release", "--target", "free", "--force"]);
    assert_eq!(code(&o), 0);
    assert_eq!(stdout(&o), "'free' was not held\n");
}

#[test]
fn no_event_and_custom_event_types() {
    let env = Env::new();
    env.run(&["run", "--target", "ev", "--no-event", "--", "true"]);
    env.run(&[
        "run",
        "--target",
        "ev",
        "--event-type",
        "report.built",
        "--",
        "true",
    ]);
    assert_eq!(
        env.scalar("SELECT string_agg(type, ',') FROM outbox"),
        "report.built"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM runs"), "2");
}

#[test]
fn applications_insert_their_own_events_with_only_the_four_public_columns() {
    let env = Env::new();
    env.run(&["migrate"]);
    env.sql("BEGIN; INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('order', '42', 'order.paid', '{\"total\": 1500}'); COMMIT;");
    let row =
        &env.sql("SELECT id IS NOT NULL, seq > 0, created_at <= now(), attempts FROM outbox")[0];
    assert_eq!(
        row,
        &vec![
            Some("t".into()),
            Some("t".into()),
            Some("t".into()),
            Some("0".into())
        ]
    );
    assert_eq!(env.status()["outbox"]["pending"], 1);
}

#[test]
fn two_schemas_do_not_see_each_other() {
    let a = Env::new();
    let mut b = Env::new();
    b.url = a.url.clone();
    let holder = a.hold("same", "sleep 30");
    // Same target name, other schema: not busy.
    assert_eq!(code(&b.run(&["run", "--target", "same", "--", "true"])), 0);
    assert_eq!(b.status()["targets"][0]["state"], "free");
    assert_eq!(a.status()["targets"][0]["state"], "held");
    assert_eq!(a.status()["outbox"]["pending"], 0);
    assert_eq!(b.status()["outbox"]["pending"], 1);
    a.stop(holder);
}

#[test]
fn concurrent_first_use_of_an_empty_schema_migrates_once_and_all_succeed() {
    let env = Env::new();
    let children: Vec<_> = (0..6)
        .map(|i| env.spawn(&["run", "--target", &format!("m{i}"), "--", "true"]))
        .collect();
    for o in children.into_iter().map(finish) {
        assert_eq!(code(&o), 0, "{}", stderr(&o));
    }
    assert_eq!(
        env.scalar("SELECT string_agg(version::text, ',' ORDER BY version) FROM schema_migrations"),
        "1,2,3,4,5,6,7,8,9,10,11,12,13"
    );
    let o = env.run(&["migrate"]);
    assert_eq!(
        stdout(&o),
        format!("schema \"{}\" is at version 13\n", env.schema)
    );
}

/// Takes a current schema back to version 12 (the index migration 0013 drops, made again).
const UNDO_V13: &str = "DELETE FROM schema_migrations WHERE version = 13;
     CREATE INDEX leases_token ON leases (token) WHERE token IS NOT NULL;";

/// Takes a version 12 schema back to version 2 (what migrations 0012, 0011, 0010, 0009, 0008,
/// 0006, 0005, 0004 and 0003 add, removed; 0007 only recreates the trigger).
const UNDO_V3: &str = "DELETE FROM schema_migrations WHERE version = 12;
     ALTER TABLE leases DROP COLUMN slot_fence, DROP COLUMN slot, DROP COLUMN slot_end,
                        DROP COLUMN slot_schedule, DROP COLUMN slot_tz, DROP COLUMN slot_run;
     ALTER TABLE runs DROP COLUMN done_by_running;
     ALTER TABLE expectations DROP COLUMN schedule_since;
     DELETE FROM schema_migrations WHERE version = 11;
     ALTER TABLE leases DROP COLUMN stopping_token, DROP COLUMN stopping_until,
                        DROP COLUMN stopping_host, DROP COLUMN stopping_pid,
                        DROP COLUMN stopping_fence;
     DELETE FROM schema_migrations WHERE version = 10;
     DROP INDEX outbox_live;
     DELETE FROM schema_migrations WHERE version = 9;
     DROP INDEX outbox_commit_order; ALTER TABLE outbox DROP COLUMN xid;
     DELETE FROM schema_migrations WHERE version = 8;
     ALTER TABLE leases DROP COLUMN preempted_token, DROP COLUMN idle_token;
     ALTER TABLE runs DROP COLUMN preempted_by;
     DELETE FROM schema_migrations WHERE version = 5;
     DROP INDEX leases_token; ALTER TABLE leases DROP CONSTRAINT leases_pkey;
     ALTER TABLE leases DROP COLUMN place, DROP COLUMN max_holders;
     ALTER TABLE leases ADD PRIMARY KEY (target);
     DELETE FROM schema_migrations WHERE version = 4;
     DROP TABLE waiters; ALTER TABLE leases DROP COLUMN holder_label, DROP COLUMN queued_until;
     ALTER TABLE runs DROP COLUMN label;
     DELETE FROM schema_migrations WHERE version IN (3, 6, 7);
     DROP INDEX outbox_held;
     CREATE INDEX outbox_held ON outbox (aggregate_type, aggregate_id)
         WHERE dead_at IS NOT NULL OR next_attempt_at > created_at;
     DROP TABLE expectations, incidents; DROP INDEX runs_target_slot;
     ALTER TABLE runs DROP COLUMN slot, DROP COLUMN slot_end, DROP COLUMN done_by, DROP COLUMN events,
                      DROP CONSTRAINT runs_outcome_check;
     ALTER TABLE runs ADD CONSTRAINT runs_outcome_check
         CHECK (outcome IN ('completed', 'timed_out', 'interrupted', 'lost', 'exec_failed'));";

/// Migration 0012 dates the schedules already stored as the health check did before it: from
/// the earlier of the row's last change and the first slot a run of the target was in.
#[test]
fn migration_12_dates_stored_schedules_as_the_health_check_did() {
    let env = Env::new();
    let o = env.run(&["run", "--target", "a", "--slot", "* * * * *", "--", "true"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = env.run(&["expect", "--target", "b", "--every", "1h"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    env.sql(UNDO_V13);
    env.sql(
        "DELETE FROM schema_migrations WHERE version = 12;
         ALTER TABLE leases DROP COLUMN slot_fence, DROP COLUMN slot, DROP COLUMN slot_end,
                            DROP COLUMN slot_schedule, DROP COLUMN slot_tz, DROP COLUMN slot_run;
         ALTER TABLE runs DROP COLUMN done_by_running;
         ALTER TABLE expectations DROP COLUMN schedule_since;
         UPDATE runs SET slot = slot - interval '1 day';
         UPDATE expectations SET updated_at = now() - interval '1 hour';",
    );
    let o = env.run(&["migrate"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(
        env.scalar(
            "SELECT string_agg(target || ' ' || coalesce((schedule_since = (SELECT slot FROM runs))::text, 'null'), ', ' ORDER BY target)
               FROM expectations"
        ),
        "a true, b null"
    );
}

#[test]
fn a_version_1_schema_is_upgraded_in_place_keeping_its_rows() {
    let env = Env::new();
    assert_eq!(code(&env.run(&["run", "--target", "old", "--", "true"])), 0);
    // Put the schema back to what a version-1 leasectl left behind.
    env.sql(UNDO_V13);
    env.sql(UNDO_V3);
    env.sql(
        "DELETE FROM schema_migrations WHERE version = 2;
         DROP INDEX outbox_held; DROP INDEX runs_finished;
         CREATE INDEX outbox_aggregate_seq ON outbox (aggregate_type, aggregate_id, seq);
         ALTER TABLE outbox RESET (autovacuum_vacuum_scale_factor, autovacuum_vacuum_threshold,
                                   autovacuum_vacuum_cost_delay);",
    );
    let o = env.run(&["migrate"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(
        env.scalar("SELECT string_agg(version::text, ',' ORDER BY version) FROM schema_migrations"),
        "1,2,3,4,5,6,7,8,9,10,11,12,13"
    );
    assert_eq!(
        env.scalar(&format!(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = '{}' AND indexname = 'outbox_held'",
            env.schema
        )),
        "1"
    );
    assert_eq!(
        env.scalar(&format!(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = '{}' AND indexname = 'outbox_aggregate_seq'",
            env.schema
        )),
        "0"
    );
    // Migration 0010: the claim's indexes over live events only.
    assert_eq!(
        env.scalar(&format!(
            "SELECT string_agg(indexname || ' ' || substring(indexdef FROM '\\(.*'), '; ' ORDER BY indexname)
               FROM pg_indexes
              WHERE schemaname = '{}' AND indexname IN ('outbox_live', 'outbox_commit_order')",
            env.schema
        )),
        "outbox_commit_order (xid, seq) WHERE (dead_at IS NULL); outbox_live (seq) WHERE (dead_at IS NULL)"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM outbox"), "1");
    assert_eq!(env.scalar("SELECT count(*) FROM runs"), "1");
}

/// The markers of this schema: types named `leasectl_ledger_…`, comma-separated.
const MARKERS: &str = "SELECT coalesce(string_agg(typname, ',' ORDER BY typname), '') FROM pg_type
     WHERE typnamespace = current_schema()::regnamespace AND typname LIKE 'leasectl\\_ledger\\_%'";

/// A `run` checks the schema by its marker, a type named after this build's ledger, instead of
/// reading the ledger. A schema without it (migrated by a leasectl from before markers) is
/// checked the old way and marked on the way; any change to the ledger drops the marker, so an
/// edited or upgraded ledger is always read again.
#[test]
fn a_current_schema_is_marked_and_loses_its_marker_when_the_ledger_changes() {
    let env = Env::new();
    env.run(&["migrate"]);
    let marker = env.scalar(MARKERS);
    assert!(
        marker.starts_with("leasectl_ledger_v13_") && !marker.contains(','),
        "{marker}"
    );

    // Unmarked, as a schema migrated before markers: the run reads the ledger, and marks it.
    env.sql(&format!("DROP TYPE \"{marker}\""));
    let o = env.run(&["run", "--target", "t", "--", "true"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(env.scalar(MARKERS), marker);

    // Another build's marker is not this one's, and goes when this one's is made.
    env.sql(&format!(
        "DROP TYPE \"{marker}\"; CREATE TYPE leasectl_ledger_v13_000000000000000000000000 AS ENUM ()"
    ));
    let o = env.run(&["run", "--target", "t", "--", "true"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(env.scalar(MARKERS), marker);
    assert_eq!(env.scalar("SELECT count(*) FROM runs"), "2");

    // Any statement on the ledger drops it, even one that changes no row; migrate makes it again.
    env.sql("UPDATE schema_migrations SET name = name WHERE false");
    assert_eq!(env.scalar(MARKERS), "");
    env.run(&["migrate"]);
    assert_eq!(env.scalar(MARKERS), marker);
    env.sql("DELETE FROM schema_migrations WHERE version = 12");
    assert_eq!(env.scalar(MARKERS), "");
}

/// Many commands starting at once on a schema that does not exist yet, or is current but
/// without its marker: one migrates or marks it, and the others neither fail nor make the
/// marker again. (Making it drops every marker first; a command that found the schema unmarked
/// an instant before another marked it made it again, and commands checking for the marker
/// meanwhile failed with "cache lookup failed for type".) Every run succeeds, and the marker
/// is the only one.
#[test]
fn commands_starting_together_on_a_new_or_unmarked_schema_all_run() {
    for round in 0..4 {
        let env = Env::new();
        if round % 2 == 1 {
            env.run(&["migrate"]);
            env.sql("UPDATE schema_migrations SET name = name WHERE false");
            assert_eq!(env.scalar(MARKERS), "");
        }
        let runs: Vec<_> = (0..32)
            .map(|i| {
                // Half of them as --max-holders callers, which check the schema the long way.
                let holders = if i % 2 == 0 { "1" } else { "2" };
                let target = format!("t{i}");
                env.spawn(&[
                    "run",
                    "--target",
                    &target,
                    "--max-holders",
                    holders,
                    "--",
                    "true",
                ])
            })
            .collect();
        for r in runs {
            let o = finish(r);
            assert_eq!(code(&o), 0, "round {round}: {}", stderr(&o));
        }
        let marker = env.scalar(MARKERS);
        assert!(
            marker.starts_with("leasectl_ledger_v13_") && !marker.contains(','),
            "round {round}: {marker}"
        );
        assert_eq!(env.scalar("SELECT count(*) FROM runs"), "32");
    }
}

/// Two commands that both found the schema missing wait for the migration lock; the first
/// migrates and marks it, the second finds it current under the lock and leaves the marker
/// alone. (Making it again dropped it first, and commands checking for it meanwhile failed
/// with "cache lookup failed for type".) The test's sessions queue for the lock too, one
/// between the two commands, so it sees the marker the first one made before the second runs.
#[test]
fn a_command_that_finds_the_schema_migrated_under_the_lock_leaves_the_marker_alone() {
    let env = Env::new();
    let direct = env.direct_conninfo();
    let key = format!("hashtext('leasectl.migrate:{}')", env.schema);
    let waiting = format!(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted
            AND objid::int8 = ({key}::int8 & 4294967295)"
    );
    let marker_oid = format!(
        "SELECT oid::text FROM pg_type WHERE typnamespace = '\"{}\"'::regnamespace
            AND typname LIKE 'leasectl\\_ledger\\_%'",
        env.schema
    );
    // Threads of its own: the session queued between the commands waits while the test does.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let session = || async {
        let (client, connection) = tokio_postgres::connect(&direct, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        client
    };
    let (first, between) = rt.block_on(async { (session().await, session().await) });
    let lock = format!("SELECT pg_advisory_lock({key})");
    rt.block_on(first.batch_execute(&lock)).unwrap();
    let one = env.spawn(&["migrate"]);
    wait_for("the first migration to wait", || {
        env.scalar(&waiting) == "1"
    });
    // Queued after the first command and before the second: granted once the first commits.
    let unlock = format!("SELECT pg_advisory_unlock({key})");
    let unlocked = unlock.clone();
    let seen = rt.spawn(async move {
        between.batch_execute(&lock).await.unwrap();
        let oid = between
            .query_one(&marker_oid, &[])
            .await
            .unwrap()
            .get::<_, String>(0);
        between.batch_execute(&unlocked).await.unwrap();
        oid
    });
    wait_for("the test's session to wait", || env.scalar(&waiting) == "2");
    let two = env.spawn(&["migrate"]);
    wait_for("the second migration to wait", || {
        env.scalar(&waiting) == "3"
    });
    rt.block_on(first.batch_execute(&unlock)).unwrap();
    let made = rt.block_on(seen).unwrap();
    for m in [one, two] {
        let o = finish(m);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
    }
    assert_eq!(
        env.scalar(&format!(
            "SELECT oid::text FROM pg_type WHERE typnamespace = '\"{}\"'::regnamespace
                AND typname LIKE 'leasectl\\_ledger\\_%'",
            env.schema
        )),
        made,
        "the second migration made the marker again"
    );
}

#[test]
fn a_schema_newer_than_the_binary_is_refused_with_78() {
    let env = Env::new();
    env.run(&["migrate"]);
    env.sql("INSERT INTO schema_migrations (version, name) VALUES (999, 'from the future')");
    let o = env.run(&["run", "--target", "t", "--", "true"]);
    assert_one_line_error(&o, 78, "version 999, newer than this leasectl");
    assert_eq!(env.scalar("SELECT count(*) FROM runs"), "0");
}

#[test]
fn an_applied_migration_whose_text_changed_is_refused_with_78() {
    let env = Env::new();
    env.run(&["migrate"]);
    // What the ledger holds when the 0001 file this database ran differs from the binary's.
    env.sql("UPDATE schema_migrations SET checksum = sha384('edited') WHERE version = 1");
    let o = env.run(&["run", "--target", "t", "--", "true"]);
    assert_one_line_error(&o, 78, "migration 0001_init applied to schema");
    assert_eq!(env.scalar("SELECT count(*) FROM runs"), "0");
    let o = env.run(&["migrate"]);
    assert_one_line_error(&o, 78, "checksum mismatch");
}

#[test]
fn a_ledger_from_before_checksums_gets_them_on_upgrade_and_they_are_checked() {
    let env = Env::new();
    env.run(&["migrate"]);
    let sums = "SELECT string_agg(version || ':' || encode(checksum, 'hex'), ',' ORDER BY version) FROM schema_migrations";
    let recorded = env.scalar(sums);
    // A ledger as a leasectl without checksums left it, at version 1.
    env.sql(UNDO_V13);
    env.sql(UNDO_V3);
    env.sql("ALTER TABLE schema_migrations DROP COLUMN checksum; DELETE FROM schema_migrations WHERE version = 2;
             DROP INDEX outbox_held; DROP INDEX runs_finished;
             CREATE INDEX outbox_aggregate_seq ON outbox (aggregate_type, aggregate_id, seq);");
    let o = env.run(&["run", "--target", "t", "--", "true"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(env.scalar(sums), recorded);
    env.sql("UPDATE schema_migrations SET checksum = sha384('edited') WHERE version = 2");
    assert_one_line_error(&env.run(&["status"]), 78, "migration 0002_relay applied");
}

#[test]
fn outbox_inserts_notify_relays_whether_leasectl_or_an_application_wrote_them() {
    let env = Env::new();
    env.run(&["migrate"]);
    let rt = runtime();
    rt.block_on(async {
        let settings = leasectl::db::Settings::new(Some(&env.url)).unwrap();
        let db = leasectl::db::Db::connect(settings, leasectl::db::Schema::new(&env.schema)).await.unwrap();
        let mut notes = db.notifications;
        db.client.batch_execute(&format!("LISTEN \"{}.outbox\"", env.schema)).await.unwrap();
        // leasectl's own save (which sends the NOTIFY itself and skips the trigger).
        let o = env.command().args(["run", "--target", "n", "--", "true"]).output_in_time();
        assert_eq!(code(&o), 0);
        assert_eq!(next(&mut notes).await.channel().to_owned(), format!("{}.outbox", env.schema));
        // An application's own transaction, through the trigger: it notifies while a relay
        // sleeps on LISTEN, i.e. holds the idle mark (migration 0007) — this session plays it,
        // and the application writes from another.
        db.client
            .batch_execute(&format!(
                "SELECT pg_advisory_lock(1818583411, '\"{}\".outbox'::regclass::oid::integer)",
                env.schema
            ))
            .await
            .unwrap();
        std::thread::scope(|t| {
            t.spawn(|| env.sql("INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('order', '1', 'order.paid', '{}')"))
                .join()
                .unwrap()
        });
        assert_eq!(next(&mut notes).await.channel().to_owned(), format!("{}.outbox", env.schema));
    });
}

async fn next(
    notes: &mut tokio::sync::mpsc::UnboundedReceiver<tokio_postgres::Notification>,
) -> tokio_postgres::Notification {
    tokio::time::timeout(PATIENCE, notes.recv())
        .await
        .expect("no NOTIFY arrived")
        .unwrap()
}

/// An idle relay's mark, held by a session of its own until dropped.
struct IdleMark(
    Option<std::sync::mpsc::Sender<()>>,
    Option<std::thread::JoinHandle<()>>,
);

impl IdleMark {
    fn hold(env: &Env) -> IdleMark {
        let (url, schema) = (env.direct_url.clone(), env.schema.clone());
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = runtime();
            rt.block_on(async {
                let client = leasectl::db::Settings::new(Some(&url)).unwrap().open_client().await.unwrap();
                client
                    .batch_execute(&format!(
                        "SELECT pg_advisory_lock(1818583411, '\"{schema}\".outbox'::regclass::oid::integer)"
                    ))
                    .await
                    .unwrap();
                held_tx.send(()).unwrap();
                // Keep the session (and its lock) until the test drops the mark.
                tokio::task::spawn_blocking(move || stop_rx.recv()).await.unwrap().ok();
                drop(client);
            });
        });
        held_rx
            .recv_timeout(PATIENCE)
            .expect("could not take the idle mark");
        IdleMark(Some(stop_tx), Some(thread))
    }
}

impl Drop for IdleMark {
    fn drop(&mut self) {
        drop(self.0.take());
        if let Some(t) = self.1.take() {
            let _ = t.join();
        }
    }
}

/// A run plans its save while the command runs by executing the prepared statement once with
/// every parameter NULL. That execution inserts no event, and it fires no trigger either: the
/// outbox's trigger fires once per INSERT statement whatever its rows, and would wake every
/// sleeping relay and load PL/pgSQL into the run's fresh server process.
#[test]
fn a_runs_save_planned_ahead_fires_no_trigger() {
    let env = Env::new();
    env.run(&["migrate"]);
    // The table named with its schema: the trigger runs in the run's session, whose search
    // path does not have it.
    env.sql(&format!(
        "CREATE TABLE trigger_calls (n int);
         CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN INSERT INTO \"{}\".trigger_calls VALUES (1); RETURN NULL; END $$;",
        env.schema
    ));
    // A relay sleeping on LISTEN, for whom the trigger fires (migration 0007).
    let _mark = IdleMark::hold(&env);
    // Directly, as a session known not to be pooled: the save is planned ahead only there.
    let o = env
        .command_at(&env.direct_url)
        .env("LEASECTL_POOLER", "none")
        .args(["run", "--target", "x", "--no-event", "--", "sleep", "0.3"])
        .output_in_time();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(env.scalar("SELECT count(*) FROM runs"), "1");
    assert_eq!(env.scalar("SELECT count(*) FROM outbox"), "0");
    assert_eq!(env.scalar("SELECT count(*) FROM trigger_calls"), "0");
}

#[test]
fn leasectl_saves_skip_the_plpgsql_trigger_that_application_inserts_fire() {
    let env = Env::new();
    env.run(&["migrate"]);
    // Count the trigger function's calls.
    env.sql(
        "CREATE TABLE trigger_calls (n int);
         CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN INSERT INTO trigger_calls VALUES (1); PERFORM pg_notify(TG_TABLE_SCHEMA || '.outbox', ''); RETURN NULL; END $$;",
    );
    // The trigger fires while a relay sleeps on LISTEN (holds the idle mark, migration 0007):
    // play that relay for the whole test.
    let _mark = IdleMark::hold(&env);
    assert_eq!(code(&env.run(&["run", "--target", "x", "--", "true"])), 0);
    assert_eq!(env.scalar("SELECT count(*) FROM outbox"), "1");
    assert_eq!(env.scalar("SELECT count(*) FROM trigger_calls"), "0");
    env.sql("INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('order', '1', 'order.paid', '{}')");
    assert_eq!(env.scalar("SELECT count(*) FROM trigger_calls"), "1");
    // The flag is transaction-local: the same session's next insert fires the trigger again.
    env.sql(
        "BEGIN; SELECT set_config('leasectl.outbox_notified', 'on', true); COMMIT;
         INSERT INTO outbox (aggregate_type, aggregate_id, type, payload) VALUES ('order', '1', 'order.shipped', '{}');",
    );
    assert_eq!(env.scalar("SELECT count(*) FROM trigger_calls"), "2");
}

/// On a terminal, a 200-character target or label is cut with an ellipsis so the table stays
/// readable; through a pipe (and in --json) every cell is whole.
#[test]
fn status_on_a_terminal_cuts_long_cells_and_a_pipe_gets_them_whole() {
    let env = Env::new();
    let target = format!("t{}", "x".repeat(199));
    let label = format!("l{}", "y".repeat(199));
    let o = env.run(&["run", "--target", &target, "--label", &label, "--", "true"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = env.run(&["run", "--target", "short", "--", "true"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));

    let piped = stdout(&env.run(&["status"]));
    assert!(piped.contains(&target), "{piped}");

    // `script` gives leasectl a pseudo-terminal as its stdout.
    let bin = bin();
    let argv = [
        bin.to_str().unwrap(),
        "--database-url",
        &env.url,
        "--schema",
        &env.schema,
        "status",
    ];
    let line = shlex::try_join(argv).unwrap();
    let o = std::process::Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .stdin(std::process::Stdio::null())
        .output_in_time();
    assert_eq!(code(&o), 0, "script: {}", stderr(&o));
    let shown = stdout(&o).replace('\r', "");
    assert!(shown.contains("TARGET"), "{shown}");
    assert!(!shown.contains(&target), "the target was not cut: {shown}");
    let row = shown
        .lines()
        .find(|l| l.starts_with("txxx"))
        .unwrap_or_else(|| panic!("no row for the long target: {shown}"));
    assert!(row.contains("xxx… "), "{row}");
    for l in shown.lines() {
        assert!(
            unicode_width::UnicodeWidthStr::width(l) < 160,
            "a line {} columns wide: {l}",
            unicode_width::UnicodeWidthStr::width(l)
        );
    }
    assert!(shown.lines().any(|l| l.starts_with("short ")), "{shown}");

    let json = env.status();
    let names: Vec<&str> = json["targets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["target"].as_str().unwrap())
        .collect();
    assert!(names.contains(&target.as_str()), "{names:?}");
}

// The same tests with leasectl behind a transaction-mode pgbouncer (every command
// works through a pooler).
crate::via_pooler!(
    status_json_has_the_documented_keys_for_held_and_free_targets,
    runs_lists_newest_first_with_outcomes_and_limit,
    output_of_a_target_without_runs_exits_1,
    release_of_a_free_target_says_so,
    no_event_and_custom_event_types,
    applications_insert_their_own_events_with_only_the_four_public_columns,
    two_schemas_do_not_see_each_other,
    concurrent_first_use_of_an_empty_schema_migrates_once_and_all_succeed,
    a_version_1_schema_is_upgraded_in_place_keeping_its_rows,
    a_schema_newer_than_the_binary_is_refused_with_78,
    an_applied_migration_whose_text_changed_is_refused_with_78,
    a_ledger_from_before_checksums_gets_them_on_upgrade_and_they_are_checked,
    leasectl_saves_skip_the_plpgsql_trigger_that_application_inserts_fire,
);

/// No index of the lease table covers a column that acquiring or releasing changes, so those
/// updates are heap-only (HOT): the table does not grow by a dead row and index entries per run
/// until a vacuum comes.
#[test]
fn lease_updates_are_heap_only() {
    let env = Env::new();
    for _ in 0..5 {
        let o = env.run(&["run", "--target", "hot", "--", "true"]);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
    }
    assert_eq!(
        env.scalar(
            "SELECT string_agg(DISTINCT a.attname, ',' ORDER BY a.attname)
               FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid
                AND a.attnum = ANY (i.indkey)
              WHERE i.indrelid = 'leases'::regclass"
        ),
        "place,target"
    );
    // Each run updates the row twice (acquire, release); the server counts them once each
    // leasectl's statistics are flushed, as its session ends.
    wait_for("the runs' updates to be counted", || {
        env.scalar("SELECT n_tup_upd FROM pg_stat_user_tables WHERE relid = 'leases'::regclass")
            .parse::<i64>()
            .unwrap()
            >= 9
    });
    assert_eq!(
        env.scalar(
            "SELECT n_tup_upd - n_tup_hot_upd FROM pg_stat_user_tables
              WHERE relid = 'leases'::regclass"
        ),
        "0"
    );
}
