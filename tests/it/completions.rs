//! The pre-generated completions in `completions/` match what the binary prints, and every
//! subcommand's `--help` carries an example. Neither needs a database.

use std::path::Path;

use assert_cmd::Command;

use crate::common::bin;

/// Each shell leasectl ships completions for, and the checked-in file holding them.
const SHELLS: [(&str, &str); 3] = [
    ("bash", "completions/leasectl.bash"),
    ("zsh", "completions/_leasectl"),
    ("fish", "completions/leasectl.fish"),
];

fn regenerate_hint() -> String {
    let lines: Vec<String> = SHELLS
        .iter()
        .map(|(shell, file)| format!("  target/debug/leasectl completions {shell} > {file}"))
        .collect();
    format!(
        "regenerate the checked-in completions after changing the CLI:\n  cargo build\n{}",
        lines.join("\n")
    )
}

#[test]
fn checked_in_completions_match_the_binary() {
    for (shell, file) in SHELLS {
        let out = Command::new(bin())
            .args(["completions", shell])
            .env_remove("DATABASE_URL")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "leasectl completions {shell} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.stderr.is_empty(),
            "leasectl completions {shell} wrote to stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
        let checked_in = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("cannot read {file}: {e}\n{}", regenerate_hint()));
        assert!(
            out.stdout == checked_in,
            "{file} differs from `leasectl completions {shell}` ({} bytes generated, {} checked in); {}",
            out.stdout.len(),
            checked_in.len(),
            regenerate_hint()
        );
    }
}

#[test]
fn completions_for_an_unknown_shell_are_a_usage_error() {
    let out = Command::new(bin())
        .args(["completions", "tcsh"])
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Every command path of the CLI (`run`, `outbox list`, …), from clap's own model, so a new
/// subcommand is covered without editing this test.
fn command_paths() -> Vec<Vec<String>> {
    fn walk(cmd: &clap::Command, prefix: &[String], out: &mut Vec<Vec<String>>) {
        for sub in cmd.get_subcommands().filter(|c| c.get_name() != "help") {
            let mut path = prefix.to_vec();
            path.push(sub.get_name().to_owned());
            out.push(path.clone());
            walk(sub, &path, out);
        }
    }
    // Built, so that the commands' deferred arguments and subcommands (`outbox list`) are there.
    let mut root = <leasectl::cli::Cli as clap::CommandFactory>::command();
    root.build();
    let mut out = Vec::new();
    walk(&root, &[], &mut out);
    out
}

#[test]
fn every_subcommand_has_help_with_an_example() {
    let paths = command_paths();
    assert!(
        paths.iter().any(|p| p == &["outbox", "discard"]),
        "{paths:?}"
    );
    for path in paths {
        let out = Command::new(bin())
            .args(&path)
            .arg("--help")
            .env_remove("DATABASE_URL")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let sub = path.join(" ");
        assert_eq!(
            out.status.code(),
            Some(0),
            "leasectl {sub} --help: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.contains("Example"),
            "leasectl {sub} --help shows no example:\n{text}"
        );
    }
    let top = Command::new(bin()).arg("--help").output().unwrap();
    assert_eq!(top.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&top.stdout).contains("Example"));
}
