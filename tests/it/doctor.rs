//! `leasectl doctor`: each check against a real set-up — a fresh and a migrated schema, an
//! edited ledger, roles with exactly, less than and more than the printed grants, the test
//! pgbouncer, a role's idle timeout, dead events, a TTL too short for a failover, an unreachable
//! database and sink, the local RabbitMQ and NATS, a host clock moved by libfaketime. The
//! replication checks run against a real primary and standby in `failover.rs`.

use std::process::{Command, Output};

use serde_json::Value;

use crate::common::*;
use crate::privileges::{admin, Role};

/// Every check doctor makes on a reachable database without `--sink`, in its order.
const CHECKS: &[&str] = &[
    "connection",
    "server",
    "primary",
    "pooler",
    "schema",
    "privileges",
    "replication",
    "fences",
    "statement_timeout",
    "idle_in_transaction_session_timeout",
    "max_connections",
    "notify_queue",
    "clock",
    "outbox",
    "xmin_horizon",
    "failover",
];

/// `doctor --json ARGS` with `cmd`, parsed; the output too, for messages.
fn doctor_json(mut cmd: Command, args: &[&str]) -> (Value, Output) {
    let out = cmd.arg("doctor").arg("--json").args(args).output_in_time();
    let doc: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("doctor --json printed no JSON ({e}): {out:?}"));
    (doc, out)
}

/// The check named `name` of a report.
fn check<'a>(doc: &'a Value, name: &str) -> &'a Value {
    doc["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no check {name} in {doc:#}"))
}

fn status<'a>(doc: &'a Value, name: &str) -> &'a str {
    check(doc, name)["status"].as_str().unwrap()
}

fn detail(doc: &Value, name: &str) -> String {
    let c = check(doc, name);
    format!(
        "{} {}",
        c["detail"].as_str().unwrap(),
        c["fix"].as_str().unwrap_or("")
    )
}

#[test]
fn a_fresh_schema_has_migrations_pending_and_doctor_leaves_it_so_until_migrate() {
    let env = Env::new();
    let (doc, out) = doctor_json(env.command(), &[]);
    assert_eq!(code(&out), 0, "{doc:#}");
    assert_eq!(doc["ok"], true);
    let names: Vec<&str> = doc["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            for key in ["name", "status", "detail", "fix"] {
                assert!(c.get(key).is_some(), "{key} missing in {c}");
            }
            c["name"].as_str().unwrap()
        })
        .collect();
    assert_eq!(names, CHECKS);
    assert_eq!(status(&doc, "schema"), "warn");
    assert!(
        detail(&doc, "schema").contains("13 migrations pending"),
        "{doc:#}"
    );
    // Doctor only looks: the schema is still not there.
    assert_eq!(
        env.scalar(&format!(
            "SELECT count(*) FROM pg_namespace WHERE nspname = '{}'",
            env.schema
        )),
        "0"
    );

    assert_eq!(code(&env.run(&["migrate"])), 0);
    let (doc, out) = doctor_json(env.command(), &[]);
    assert_eq!(code(&out), 0, "{doc:#}");
    assert_eq!(status(&doc, "schema"), "ok", "{doc:#}");
    assert_eq!(status(&doc, "outbox"), "ok", "{doc:#}");
    // The tests run as a superuser: more than a job needs.
    assert_eq!(status(&doc, "privileges"), "warn");
    assert!(detail(&doc, "privileges").contains("superuser"), "{doc:#}");
    assert_eq!(status(&doc, "pooler"), "ok");
    assert_eq!(status(&doc, "primary"), "ok");
    assert_eq!(status(&doc, "clock"), "ok", "{doc:#}");
}

#[test]
fn the_text_report_is_one_aligned_line_per_check() {
    let env = Env::new();
    let out = env.run(&["doctor"]);
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), CHECKS.len(), "{text}");
    for (line, name) in lines.iter().zip(CHECKS) {
        let (head, _) = line.split_once(": ").unwrap();
        let (status, got) = (&head[..4], &head[5..]);
        assert!(["ok  ", "warn", "fail"].contains(&status), "{line}");
        assert_eq!(got, *name, "{line}");
    }
    assert!(text.contains("warn schema: "), "{text}");
    assert_eq!(stderr(&out), "");
}

#[test]
fn an_edited_migration_fails_with_exit_1() {
    let env = Env::new();
    assert_eq!(code(&env.run(&["migrate"])), 0);
    env.sql("UPDATE schema_migrations SET checksum = '\\x00' WHERE version = 3");
    let (doc, out) = doctor_json(env.command(), &[]);
    assert_eq!(code(&out), 1, "{doc:#}");
    assert_eq!(doc["ok"], false);
    assert_eq!(status(&doc, "schema"), "fail");
    assert!(detail(&doc, "schema").contains("0003_cron"), "{doc:#}");
    assert!(
        detail(&doc, "schema").contains("checksum mismatch"),
        "{doc:#}"
    );
}

#[test]
fn privileges_exactly_the_printed_grants_are_ok_and_a_missing_one_is_named() {
    let env = Env::new();
    assert_eq!(code(&env.run(&["migrate"])), 0);
    let app = Role::new(&env);
    app.grant(&env);
    let (doc, out) = doctor_json(app.command(&env), &[]);
    assert_eq!(status(&doc, "privileges"), "ok", "{doc:#}");
    assert_eq!(status(&doc, "schema"), "ok", "{doc:#}");
    // Without pg_monitor other roles' sessions are hidden: said, not passed over.
    assert_eq!(status(&doc, "xmin_horizon"), "warn", "{doc:#}");
    assert!(
        detail(&doc, "xmin_horizon").contains("pg_monitor"),
        "{doc:#}"
    );
    assert_eq!(code(&out), 0, "{doc:#}");

    admin(&format!(
        "REVOKE UPDATE ON \"{}\".outbox FROM \"{}\"",
        env.schema, app.name
    ));
    let (doc, out) = doctor_json(app.command(&env), &[]);
    assert_eq!(code(&out), 1, "{doc:#}");
    assert_eq!(status(&doc, "privileges"), "fail");
    let d = detail(&doc, "privileges");
    assert!(d.contains("UPDATE on table"), "{d}");
    assert!(d.contains("\"outbox\""), "{d}");
    assert!(d.contains("--print-grants"), "{d}");

    // More than needed: TRUNCATE is never used.
    app.grant(&env);
    admin(&format!(
        "GRANT TRUNCATE ON \"{}\".outbox TO \"{}\"",
        env.schema, app.name
    ));
    let (doc, _) = doctor_json(app.command(&env), &[]);
    assert_eq!(status(&doc, "privileges"), "warn", "{doc:#}");
    assert!(
        detail(&doc, "privileges").contains("REVOKE TRUNCATE"),
        "{doc:#}"
    );
}

#[test]
fn a_role_idle_timeout_shorter_than_a_relay_batch_needs_is_a_warning() {
    let env = Env::new();
    assert_eq!(code(&env.run(&["migrate"])), 0);
    let app = Role::new(&env);
    app.grant(&env);
    admin(&format!(
        "ALTER ROLE \"{}\" SET idle_in_transaction_session_timeout = '1s'",
        app.name
    ));
    let (doc, _) = doctor_json(app.command(&env), &[]);
    let name = "idle_in_transaction_session_timeout";
    assert_eq!(status(&doc, name), "warn", "{doc:#}");
    let d = detail(&doc, name);
    assert!(d.contains("1s") && d.contains("ALTER ROLE"), "{d}");
    // The superuser's session keeps the default.
    let (doc, _) = doctor_json(env.command(), &[]);
    assert_eq!(status(&doc, name), "ok", "{doc:#}");
}

#[test]
fn dead_events_are_a_warning_with_their_count() {
    let env = Env::new();
    assert_eq!(code(&env.run(&["migrate"])), 0);
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload, dead_at, attempts)
         SELECT 'order', i::text, 'order.paid', '{}', now(), 10 FROM generate_series(1, 3) i",
    );
    let (doc, out) = doctor_json(env.command(), &[]);
    assert_eq!(code(&out), 0, "{doc:#}");
    assert_eq!(status(&doc, "outbox"), "warn");
    let d = detail(&doc, "outbox");
    assert!(d.contains("3 dead"), "{d}");
    assert!(d.contains("outbox list --dead"), "{d}");
}

#[test]
fn a_ttl_shorter_than_the_failover_is_a_warning_with_a_ttl_that_would_do() {
    let env = Env::new();
    let (doc, _) = doctor_json(env.command(), &["--ttl", "1s", "--failover-time", "5s"]);
    assert_eq!(status(&doc, "failover"), "warn", "{doc:#}");
    let d = detail(&doc, "failover");
    assert!(d.contains("--ttl 1.0s") && d.contains("exit 76"), "{d}");
    assert!(d.contains("run with --ttl "), "{d}");
    let (doc, _) = doctor_json(env.command(), &["--ttl", "2m", "--failover-time", "20s"]);
    assert_eq!(status(&doc, "failover"), "ok", "{doc:#}");
    // Durations `run` refuses are refused here too, before anything connects.
    let out = env
        .command_at("host=/nonexistent")
        .args(["doctor", "--ttl", "1s", "--heartbeat", "1s"])
        .output_in_time();
    assert_one_line_error(&out, 2, "do not fit in --ttl");
}

#[test]
fn an_unreachable_database_is_one_failing_line_and_exit_69() {
    let env = Env::new();
    let url = format!(
        "host=127.0.0.1 port={} dbname=x connect_timeout=2",
        spare_port()
    );
    let out = env.command_at(&url).arg("doctor").output_in_time();
    assert_eq!(code(&out), 69, "{out:?}");
    let text = stdout(&out);
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(
        text.starts_with("fail connection: cannot connect"),
        "{text}"
    );
    let (doc, out) = doctor_json(env.command_at(&url), &[]);
    assert_eq!(code(&out), 69);
    assert_eq!(doc["ok"], false);
    assert_eq!(status(&doc, "connection"), "fail");
}

#[test]
fn a_sink_at_a_closed_port_fails() {
    let env = Env::new();
    for sink in [
        format!("http://127.0.0.1:{}/hook", spare_port()),
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", spare_port()),
        format!("nats://127.0.0.1:{}", spare_port()),
    ] {
        let (doc, out) = doctor_json(env.command(), &["--sink", &sink, "--sink-timeout", "5s"]);
        assert_eq!(code(&out), 1, "{sink}: {doc:#}");
        assert_eq!(status(&doc, "sink"), "fail", "{sink}: {doc:#}");
        assert!(!detail(&doc, "sink").contains("guest:guest"), "{doc:#}");
    }
}

#[test]
fn the_local_rabbitmq_and_nats_are_reached_without_publishing() {
    let env = Env::new();
    let amqp = format!("{}?exchange=amq.topic", crate::sink_brokers::amqp_url());
    let (doc, out) = doctor_json(env.command(), &["--sink", &amqp]);
    assert_eq!(status(&doc, "sink"), "ok", "{doc:#}");
    assert!(
        detail(&doc, "sink").contains("rabbitmqctl list_bindings"),
        "{doc:#}"
    );
    assert_eq!(code(&out), 0, "{doc:#}");
    // A deployment's own exchange that nobody declared yet: nothing would route.
    let (doc, _) = doctor_json(env.command(), &["--sink", &crate::sink_brokers::amqp_url()]);
    assert_eq!(status(&doc, "sink"), "warn", "{doc:#}");
    assert!(detail(&doc, "sink").contains(&format!("leasectl.leasectl_test.{}", env.schema)));
    // Nothing was declared by looking.
    let (doc, _) = doctor_json(env.command(), &["--sink", &crate::sink_brokers::amqp_url()]);
    assert_eq!(status(&doc, "sink"), "warn", "{doc:#}");

    let subject = format!("doctor_{}", env.schema);
    let nats = format!("{}?subject={subject}", crate::sink_brokers::nats_url());
    let (doc, out) = doctor_json(env.command(), &["--sink", &nats]);
    assert_eq!(status(&doc, "sink"), "ok", "{doc:#}");
    assert!(detail(&doc, "sink").contains(&format!("no stream captures {subject}.>")));
    assert_eq!(code(&out), 0, "{doc:#}");
}

#[test]
fn through_the_test_pgbouncer_the_pooler_is_reported_in_transaction_mode() {
    let env = Env::new();
    let (doc, _) = doctor_json(env.command_at(&pooler_url("leasectl_test_single")), &[]);
    assert_eq!(status(&doc, "pooler"), "ok", "{doc:#}");
    let d = detail(&doc, "pooler");
    assert!(
        d.contains("pgbouncer") && d.contains("transaction mode"),
        "{d}"
    );
    assert!(d.contains("polls instead of LISTEN"), "{d}");
    // Behind the pooler the server's statement_timeout applies, not leasectl's own.
    assert!(
        detail(&doc, "statement_timeout").contains("behind the pooler"),
        "{doc:#}"
    );
}

/// libfaketime's preload library (Debian package `faketime`; scripts/test installs it).
fn libfaketime() -> String {
    ["x86_64-linux-gnu", "aarch64-linux-gnu"]
        .iter()
        .map(|arch| format!("/usr/lib/{arch}/faketime/libfaketime.so.1"))
        .find(|p| std::path::Path::new(p).exists())
        .expect("libfaketime is not installed: apt-get install faketime (scripts/test does)")
}

#[test]
fn a_host_clock_two_minutes_ahead_is_a_warning() {
    let env = Env::new();
    let mut cmd = env.command();
    cmd.env("LD_PRELOAD", libfaketime())
        .env("FAKETIME", "+2m")
        .env("FAKETIME_NO_CACHE", "1");
    let (doc, out) = doctor_json(cmd, &[]);
    assert_eq!(code(&out), 0, "{doc:#}");
    assert_eq!(status(&doc, "clock"), "warn", "{doc:#}");
    let d = detail(&doc, "clock");
    assert!(
        d.contains("ahead of the database's") && d.contains("NTP"),
        "{d}"
    );
    // Two minutes, give or take the round trip (durations are shown truncated).
    assert!(d.contains("1m59s") || d.contains("2m00s"), "{d}");
}

#[test]
fn fences_name_the_servers_timeline_and_off_is_a_warning_where_it_could_be_on() {
    let env = Env::new();
    let (doc, _) = doctor_json(env.command(), &[]);
    assert_eq!(status(&doc, "fences"), "ok", "{doc:#}");
    let d = detail(&doc, "fences");
    assert!(d.contains("timeline 1: fences from 1 on"), "{d}");
    let mut off = env.command();
    off.env("LEASECTL_FENCE_TIMELINE", "off");
    let (doc, _) = doctor_json(off, &[]);
    assert_eq!(status(&doc, "fences"), "warn", "{doc:#}");
    let d = detail(&doc, "fences");
    assert!(d.contains("unset LEASECTL_FENCE_TIMELINE"), "{d}");
}
