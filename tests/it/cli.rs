//! Bad input: the documented exit code and one line naming the problem, never a panic, never
//! a password.

use assert_cmd::Command;

use crate::common::*;

fn leasectl() -> Command {
    let mut c = Command::new(bin());
    c.env_remove("DATABASE_URL");
    c
}

#[test]
fn bad_targets_durations_and_flags_are_usage_errors() {
    let long = "x".repeat(300);
    let cases: &[(&[&str], &str)] = &[
        (
            &["run", "--target", "", "--", "true"],
            "the target is empty",
        ),
        (
            &["run", "--target", &long, "--", "true"],
            "300 characters long",
        ),
        (
            &["run", "--target", "a\tb", "--", "true"],
            "control character",
        ),
        (
            &["run", "--target", "t", "--ttl", "soon", "--", "true"],
            "'soon' is not a duration",
        ),
        (
            &["run", "--target", "t", "--ttl", "30", "--", "true"],
            "has no unit",
        ),
        (
            &[
                "run",
                "--target",
                "t",
                "--ttl",
                "10s",
                "--heartbeat",
                "5s",
                "--",
                "true",
            ],
            "do not fit in --ttl 10s",
        ),
        (
            &[
                "run",
                "--target",
                "t",
                "--ttl",
                "10s",
                "--kill-after",
                "9s",
                "--",
                "true",
            ],
            "do not fit",
        ),
        (&["run", "--target", "t"], "<COMMAND>"),
        (
            &["run", "--target", "t", "echo", "hi"],
            "unexpected argument 'echo'",
        ),
        (
            &[
                "run",
                "--target",
                "t",
                "--busy-exit-code",
                "300",
                "--",
                "true",
            ],
            "--busy-exit-code",
        ),
        (
            &["run", "--target", "t", "--timeout", "0s", "--", "true"],
            "--timeout must be longer than 0",
        ),
        (
            &["--schema", "bad-name", "status"],
            "not a valid schema name",
        ),
        (
            &["--schema", "x\"; drop table y; --", "status"],
            "not a valid schema name",
        ),
        (&["runs", "--target", "t", "--limit", "0"], "--limit"),
        (&["output", "--target", "t", "--run", "not-a-uuid"], "--run"),
        (&["release", "--target", "t"], "--force"),
        (&["frobnicate"], "unrecognized subcommand"),
    ];
    for (args, needle) in cases {
        // Usage errors are caught before connecting: an unreachable database must not matter.
        let out = leasectl()
            .arg("--database-url")
            .arg("postgres://nobody@127.0.0.1:1/x")
            .args(*args)
            .output()
            .unwrap();
        assert_one_line_error(&out, 2, needle);
    }
}

#[test]
fn an_unreachable_database_exits_69_naming_the_host_without_the_password() {
    let out = leasectl()
        .args([
            "--database-url",
            "postgres://app:s3cret-pw@127.0.0.1:1/appdb",
            "run",
            "--target",
            "t",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    assert_one_line_error(&out, 69, "127.0.0.1:1");
    assert!(!stderr(&out).contains("s3cret-pw"));
    // Same through DATABASE_URL and for a rejected login (wrong database).
    let out = leasectl()
        .env("DATABASE_URL", "postgres://app:s3cret-pw@127.0.0.1:1/appdb")
        .arg("status")
        .output()
        .unwrap();
    assert_one_line_error(&out, 69, "cannot connect to PostgreSQL");
    assert!(!stderr(&out).contains("s3cret-pw"));
    let out = leasectl()
        .args([
            "--database-url",
            "dbname=leasectl_no_such_db password=s3cret-pw",
            "status",
        ])
        .output()
        .unwrap();
    assert_one_line_error(&out, 69, "leasectl_no_such_db");
    assert!(!stderr(&out).contains("s3cret-pw"));
}

#[test]
fn a_malformed_database_url_is_a_usage_error_without_the_password() {
    let out = leasectl()
        .args([
            "--database-url",
            "postgres://u:s3cret@host:notaport/db",
            "status",
        ])
        .output()
        .unwrap();
    assert_one_line_error(&out, 2, "invalid --database-url");
    assert!(!stderr(&out).contains("s3cret"));
}

#[test]
fn the_local_socket_and_current_user_are_the_default() {
    // No URL at all: like psql, the local socket as the OS user. The harness's database is
    // selected through PGDATABASE only.
    let env = Env::new();
    if std::env::var("LEASECTL_TEST_DATABASE_URL").is_ok() {
        return; // a custom test database may not be reachable through the defaults
    }
    let out = leasectl()
        .env_remove("PGHOST")
        .env_remove("PGUSER")
        .env("PGDATABASE", "leasectl_test")
        .args([
            "--schema",
            &env.schema,
            "run",
            "--target",
            "sock",
            "--",
            "echo",
            "via-socket",
        ])
        .output()
        .unwrap();
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(stdout(&out), "via-socket\n");
    assert_eq!(env.scalar("SELECT count(*) FROM runs"), "1");
}

#[test]
fn version_and_help() {
    let out = leasectl().arg("--version").output().unwrap();
    assert_eq!(code(&out), 0);
    assert!(stdout(&out).starts_with("leasectl "));
    let out = leasectl().args(["run", "--help"]).output().unwrap();
    assert_eq!(code(&out), 0);
    for flag in [
        "--ttl",
        "--heartbeat",
        "--wait",
        "--reuse-within",
        "--timeout",
        "--kill-after",
        "--busy-exit-code",
        "--event-type",
        "--no-event",
        "--quiet",
    ] {
        assert!(stdout(&out).contains(flag), "run --help lacks {flag}");
    }
}

#[test]
fn quiet_with_reuse_within_is_a_usage_error_since_every_caller_would_print_nothing() {
    let env = Env::new();
    let o = env.run(&[
        "run",
        "--target",
        "oauth",
        "--wait",
        "--reuse-within",
        "5m",
        "--quiet",
        "--",
        "echo",
        "token",
    ]);
    assert_one_line_error(&o, 2, "--quiet cannot go with --reuse-within");
    assert_eq!(stdout(&o), "");
}

#[test]
fn every_target_flag_is_described_in_help() {
    let env = Env::new();
    for cmd in ["run", "status", "runs", "output", "release"] {
        let out = env.run(&[cmd, "--help"]);
        let help = stdout(&out);
        let line = help
            .lines()
            .find(|l| l.trim_start().starts_with("--target <TARGET>"))
            .unwrap_or_else(|| panic!("{cmd} --help has no --target: {help}"));
        let description = line
            .trim_start()
            .trim_start_matches("--target <TARGET>")
            .trim();
        assert!(
            !description.is_empty(),
            "{cmd} --help: --target has no description"
        );
    }
}

#[test]
fn the_two_common_slips_of_run_get_a_hint() {
    let env = Env::new();
    let o = env.run(&["run", "--target", "x", "echo", "hi"]);
    assert_one_line_error(&o, 2, "the command must follow --");
    let o = env.run(&["run", "--target", "x", "--wait", "10m", "--", "true"]);
    assert_one_line_error(&o, 2, "write --wait=10m");
}
