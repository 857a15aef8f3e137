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

/// A negative value is the flag's own usage error, naming the flag and what it accepts — not
/// clap's "use '-- -5'", which would make the value the command.
#[test]
fn negative_values_name_the_flag_and_what_it_accepts() {
    let run = |flags: &[&str]| {
        let mut args = vec!["run", "--target", "t"];
        args.extend(flags);
        args.extend(["--", "true"]);
        leasectl()
            .arg("--database-url")
            .arg("postgres://nobody@127.0.0.1:1/x")
            .args(&args)
            .output()
            .unwrap()
    };
    let cases: &[(&[&str], &[&str])] = &[
        (&["--ttl", "-5s"], &["'--ttl <DUR>'", "'-5s' is negative"]),
        (
            &["--heartbeat", "-1s"],
            &["'--heartbeat <DUR>'", "negative"],
        ),
        (
            &["--slot", "@daily", "--done-exit-code", "-1"],
            &["'--done-exit-code <N>'", "0 to 255"],
        ),
        (
            &["--busy-exit-code", "-1"],
            &["'--busy-exit-code <N>'", "0 to 255"],
        ),
        (
            &["--max-holders", "-1"],
            &["'--max-holders <N>'", "1..=1000"],
        ),
        (&["--wait", "-5s"], &["write --wait=-5s"]),
    ];
    for (flags, needles) in cases {
        let o = run(flags);
        for needle in *needles {
            assert_one_line_error(&o, 2, needle);
        }
        assert!(!stderr(&o).contains("'-- -"), "{flags:?}: {}", stderr(&o));
    }
    // A flag missing its value still says so, also before `--`.
    assert_one_line_error(
        &run(&["--ttl", "--heartbeat", "1s"]),
        2,
        "a value is required for '--ttl <DUR>'",
    );
    // The command's own words after `--` are never touched.
    let o = leasectl()
        .args(["run", "--target", "t", "--", "echo", "--ttl", "-5s"])
        .arg("--database-url")
        .arg("postgres://nobody@127.0.0.1:1/x")
        .output()
        .unwrap();
    assert_ne!(code(&o), 2, "{}", stderr(&o));
    let o = leasectl()
        .args(["runs", "--target", "t", "--limit", "-1"])
        .output()
        .unwrap();
    assert_one_line_error(&o, 2, "'--limit <N>'");
}

/// Durations are explained in the forms the help uses (500ms, 30s, 2m, 1h, 1d, 1h30m), not in
/// the parser library's (`30sec`); a token is explained as what `acquire` printed; a heartbeat
/// below 10ms or TTL/1000 is refused.
#[test]
fn bad_durations_tokens_and_heartbeats_are_explained_in_leasectls_words() {
    let err = |args: &[&str]| {
        let o = leasectl()
            .arg("--database-url")
            .arg("postgres://nobody@127.0.0.1:1/x")
            .args(args)
            .output()
            .unwrap();
        assert_eq!(code(&o), 2, "{args:?}: {}", stderr(&o));
        assert_eq!(stderr(&o).trim_end().lines().count(), 1, "{}", stderr(&o));
        stderr(&o)
    };
    for bad in ["1h30", "5x", "2 hours min", "1h 30"] {
        let e = err(&["run", "--target", "t", "--ttl", bad, "--", "true"]);
        assert!(e.contains("1h30m"), "{bad}: {e}");
        assert!(!e.contains("30sec"), "{bad}: {e}");
    }
    assert!(
        err(&["run", "--target", "t", "--ttl", "1h30", "--", "true"]).contains("30 has no unit")
    );
    for cmd in [
        &["run", "--target", "t", "--token", "", "--", "true"][..],
        &["renew", "--target", "t", "--token", ""],
        &["release", "--target", "t", "--token", ""],
    ] {
        let e = err(cmd);
        assert!(e.contains("the token is empty"), "{e}");
        assert!(e.contains("LEASECTL_TOKEN"), "{e}");
        assert!(!e.contains("invalid length"), "{e}");
    }
    let e = err(&["run", "--target", "t", "--token", "nope", "--", "true"]);
    assert!(e.contains("'nope' is not a token"), "{e}");
    let e = err(&[
        "run",
        "--target",
        "t",
        "--ttl",
        "1h",
        "--heartbeat",
        "1ms",
        "--",
        "true",
    ]);
    assert!(
        e.contains("--heartbeat 1ms is too short for --ttl 1h00m (at least 3.6s"),
        "{e}"
    );
    let e = err(&[
        "run",
        "--target",
        "t",
        "--ttl",
        "1s",
        "--heartbeat",
        "5ms",
        "--",
        "true",
    ]);
    assert!(e.contains("at least 10ms"), "{e}");
    let help = stdout(&leasectl().args(["run", "--help"]).output().unwrap());
    assert!(help.contains("at least 10ms and TTL/1000"), "{help}");
}

/// `' deploy'` would be another target than `deploy` looking the same everywhere: white space
/// at either end is refused by every command that takes a target.
#[test]
fn a_target_with_surrounding_white_space_is_refused_everywhere() {
    let token = "0b6c5c2e-4f7e-4a8f-9d47-2a1f0e4c9b11";
    for target in [" leading", "trailing ", "\u{a0}nbsp", "   "] {
        let commands: &[&[&str]] = &[
            &["run", "--target", target, "--", "true"],
            &["acquire", "--target", target],
            &["renew", "--target", target, "--token", token],
            &["release", "--target", target, "--force"],
            &["status", "--target", target],
            &["runs", "--target", target],
            &["output", "--target", target],
            &["expect", "--target", target, "--every", "1d"],
            &["check", "--target", target],
        ];
        for args in commands {
            let o = leasectl()
                .arg("--database-url")
                .arg("postgres://nobody@127.0.0.1:1/x")
                .args(*args)
                .output()
                .unwrap();
            assert_one_line_error(&o, 2, "white space");
        }
    }
}

/// A command's own options come first in its --help; the options every command takes are
/// under a heading of their own after them.
#[test]
fn global_options_are_listed_after_a_commands_own() {
    for (cmd, own) in [("run", "--ttl"), ("status", "--json"), ("relay", "--sink")] {
        let help = stdout(&leasectl().args([cmd, "--help"]).output().unwrap());
        let lines: Vec<&str> = help.lines().collect();
        // The line listing an option (its name first on the line), or the heading.
        let at = |name: &str| {
            lines
                .iter()
                .position(|l| {
                    let l = l.trim_start();
                    l.starts_with(name)
                        || l.strip_prefix("-v, ").is_some_and(|l| l.starts_with(name))
                })
                .unwrap_or_else(|| panic!("{cmd} --help lacks {name}: {help}"))
        };
        let global = at("Global options:");
        assert!(
            at(own) < global,
            "{cmd} --help: {own} is not before the global options"
        );
        for flag in ["--database-url", "--schema", "--verbose"] {
            assert!(
                at(flag) > global,
                "{cmd} --help: {flag} is among the command's own options: {help}"
            );
        }
    }
}

/// Every `leasectl …` example in every --help parses as written when pasted into a shell
/// outside CI (unset variables expand to nothing; LEASECTL_* ones are set by the `acquire` the
/// examples start with), and a singleflight example (--wait with --reuse-within) has a --ttl
/// below its wait, as the README explains it must.
#[test]
fn every_help_example_parses_as_pasted() {
    use clap::{CommandFactory, Parser};
    let mut helps = Vec::new();
    fn walk(cmd: &clap::Command, out: &mut Vec<String>) {
        if let Some(h) = cmd.get_after_help() {
            out.push(h.to_string());
        }
        for sub in cmd.get_subcommands() {
            walk(sub, out);
        }
    }
    // Built, so that the commands' deferred arguments and texts are all there.
    let mut root = leasectl::cli::Cli::command();
    root.build();
    walk(&root, &mut helps);
    let mut checked = 0;
    for help in &helps {
        for line in help.lines() {
            let Some(at) = line.find("leasectl ") else {
                continue;
            };
            let line = &line[at..];
            // An example line, not prose: it starts the line or a `$(…)`.
            let before = help_line_prefix(help, line);
            if !(before.trim().is_empty() || before.ends_with("$(") || before.ends_with("\"$(")) {
                continue;
            }
            // `TOKEN=$(leasectl …)`, `eval "$(leasectl …)"`: the command substitution's text.
            let line = if before.ends_with("$(") {
                line.trim_end()
                    .strip_suffix(")\"")
                    .or_else(|| line.trim_end().strip_suffix(')'))
                    .unwrap_or(line)
            } else {
                line
            };
            if line.contains('…') {
                continue; // a placeholder to fill in (a run id)
            }
            let expanded = expand_unset(line);
            let words = shlex::split(&expanded).unwrap_or_else(|| panic!("unbalanced: {line}"));
            let end = words
                .iter()
                .position(|w| ["|", ">", ">>", "&&", "#"].contains(&w.as_str()))
                .unwrap_or(words.len());
            let argv = &words[..end];
            let parsed = leasectl::cli::Cli::try_parse_from(argv)
                .unwrap_or_else(|e| panic!("the example {line:?} does not parse: {e}"));
            checked += 1;
            if let leasectl::cli::Command::Run(run) = parsed.command {
                if let (Some(leasectl::model::flags::Wait::Upto(wait)), Some(_)) =
                    (run.lease.wait, run.reuse_within)
                {
                    assert!(
                        run.lease.ttl < wait,
                        "{line:?}: a singleflight example needs a --ttl below its --wait"
                    );
                }
            }
        }
    }
    assert!(checked > 30, "only {checked} examples found");
}

/// What precedes `line` on its line of `help`.
fn help_line_prefix<'a>(help: &'a str, line: &str) -> &'a str {
    let full = help.lines().find(|l| l.ends_with(line)).unwrap();
    &full[..full.len() - line.len()]
}

/// The line as a shell expands it with only LEASECTL_* variables set: `${V:-x}` is x, `$V`
/// and `${V}` are empty.
fn expand_unset(line: &str) -> String {
    expand_vars(line, |name, default| match name {
        "LEASECTL_TOKEN" => "0b6c5c2e-4f7e-4a8f-9d47-2a1f0e4c9b11",
        n if n.starts_with("LEASECTL_") => "x",
        _ => default.unwrap_or(""),
    })
}
