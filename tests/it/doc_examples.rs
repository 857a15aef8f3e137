//! Every `leasectl …` command line in a fenced code block of README.md and docs/guide/*.md
//! parses with the binary's own argument parser, as written: a renamed or misspelled flag in
//! the documentation fails here, not in a user's script. `run` and `acquire` lines also pass
//! the checks the binary makes before it connects (heartbeat against TTL, flags that do not go
//! together), since those are usage errors too.
//!
//! A line counts when `leasectl ` starts a command in it: at the start of the line (after a
//! `$ ` prompt, a YAML `- ` or `run: `, environment assignments or a crontab schedule), inside
//! `$(…)`, or after `|`, `&&`, `||` or `;`. Blocks marked ```text hold output and synopses, not
//! commands, and are left out.

use crate::common::expand_vars;
use std::path::{Path, PathBuf};

/// A placeholder id in the documentation (`6f1c2a9e-…`) stands for a real one.
const SOME_UUID: &str = "0b6c5c2e-4f7e-4a8f-9d47-2a1f0e4c9b11";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every page of docs/guide/, by path relative to the checkout.
fn documents() -> Vec<String> {
    let mut docs = vec!["README.md".to_owned()];
    let mut guide: Vec<String> = std::fs::read_dir(root().join("docs/guide"))
        .expect("docs/guide exists")
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/guide/{n}"))
        .collect();
    guide.sort();
    docs.extend(guide);
    docs
}

/// The fenced code blocks of a Markdown text that hold commands: (first line number, lines).
fn code_blocks(text: &str) -> Vec<(usize, Vec<String>)> {
    let mut blocks = Vec::new();
    let mut open: Option<(usize, bool, Vec<String>)> = None;
    for (n, line) in text.lines().enumerate() {
        let fence = line.trim_start().starts_with("```");
        match (&mut open, fence) {
            (None, true) => {
                let lang = line.trim_start().trim_start_matches('`').trim();
                open = Some((n + 2, lang != "text", Vec::new()));
            }
            (Some(_), true) => {
                let (first, commands, lines) = open.take().unwrap();
                if commands {
                    blocks.push((first, lines));
                }
            }
            (Some((_, _, lines)), false) => lines.push(line.to_owned()),
            (None, false) => {}
        }
    }
    assert!(open.is_none(), "an unclosed code block");
    blocks
}

/// Where `leasectl ` starts a command in `line`: byte offsets, and whether it is inside `$(`.
fn command_starts(line: &str) -> Vec<(usize, bool)> {
    let mut starts = Vec::new();
    for (at, _) in line.match_indices("leasectl ") {
        let before = line[..at].trim_end();
        let in_subst = before.ends_with("$(");
        let after_operator = ["|", "&&", "||", ";", "$("]
            .iter()
            .any(|op| before.ends_with(op));
        if after_operator || at_line_start(before) {
            starts.push((at, in_subst));
        }
    }
    starts
}

/// Whether what precedes `leasectl` on its line leaves it in command position: nothing, a
/// prompt, a YAML list item or `run:` key, environment assignments, a crontab schedule.
fn at_line_start(before: &str) -> bool {
    let mut words: Vec<&str> = before.split_whitespace().collect();
    if let Some(first) = words.first() {
        if ["$", "-", "run:", "-run:"].contains(first) {
            words.remove(0);
        }
    }
    if words.first() == Some(&"run:") {
        words.remove(0);
    }
    let schedule =
        |w: &str| w.starts_with('@') || w.chars().all(|c| c.is_ascii_digit() || "*/,-".contains(c));
    if words.len() == 5 && words.iter().all(|w| schedule(w))
        || words.len() == 1 && words[0].starts_with('@')
    {
        return true;
    }
    words
        .iter()
        .all(|w| w.split_once('=').is_some_and(|(name, _)| is_name(name)))
}

fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !s.starts_with(|c: char| c.is_ascii_digit())
}

/// The line as a shell would see it with the documentation's variables set: `${V:-x}` is x,
/// `$LEASECTL_TOKEN` a token, any other `$V` a word (a CI system's or the user's value).
fn expand(line: &str) -> String {
    expand_vars(line, |name, default| match (name, default) {
        ("LEASECTL_TOKEN", _) => SOME_UUID,
        (_, Some(d)) => d,
        _ => "value",
    })
}

/// One documented command: where it is, and its words up to the first shell operator.
struct Example {
    at: String,
    text: String,
    argv: Vec<String>,
}

/// The command starting at `start` of `lines[i]`, joined with the lines after it while its
/// quotes are open (a `sh -c '…'` over several lines), split as the shell would.
fn example_at(lines: &[String], i: usize, start: usize, in_subst: bool) -> Option<Vec<String>> {
    let mut text = lines[i][start..].trim_end().to_owned();
    let mut next = i + 1;
    loop {
        let mut candidate = text.trim_end_matches('\\').to_owned();
        if in_subst {
            // The substitution ends at the line's last `)`.
            if let Some(close) = candidate.rfind(')') {
                candidate.truncate(close);
            }
        }
        if let Some(words) = shlex::split(&expand(&candidate)) {
            return Some(words);
        }
        // A command inside a quoted `sh -c '…'` script closes that quote at its end.
        if let Some(words) = candidate
            .strip_suffix('\'')
            .and_then(|c| shlex::split(&expand(c)))
        {
            return Some(words);
        }
        let more = lines.get(next)?;
        text = format!("{}\n{more}", text.trim_end_matches('\\'));
        next += 1;
    }
}

fn examples() -> Vec<Example> {
    let mut out = Vec::new();
    for doc in documents() {
        let text = std::fs::read_to_string(root().join(&doc)).unwrap();
        for (first, lines) in code_blocks(&text) {
            for (i, line) in lines.iter().enumerate() {
                for (start, in_subst) in command_starts(line) {
                    let at = format!("{doc}:{}", first + i);
                    let words = example_at(&lines, i, start, in_subst)
                        .unwrap_or_else(|| panic!("{at}: unbalanced quotes in {line:?}"));
                    let mut words = words;
                    let end = words
                        .iter()
                        .position(|w| {
                            ["|", "||", "&&", ";", ">", ">>", "<", "2>", "2>&1", "&", "#"]
                                .contains(&w.as_str())
                        })
                        .unwrap_or(words.len());
                    words.truncate(end);
                    // `…; fi`: a `;` that ends a word ends the command.
                    if let Some(semi) = words.iter().position(|w| w.ends_with(';')) {
                        words.truncate(semi + 1);
                        let last = words.last_mut().unwrap();
                        last.pop();
                    }
                    let argv = words
                        .iter()
                        .map(|w| {
                            // `6f1c2a9e-…`, `5b0e…-4c1f`: a run or event id to fill in.
                            let id = w.contains('…')
                                && w.chars()
                                    .all(|c| c.is_ascii_hexdigit() || c == '-' || c == '…');
                            if id {
                                SOME_UUID.to_owned()
                            } else {
                                w.clone()
                            }
                        })
                        .collect();
                    out.push(Example {
                        at,
                        text: line[start..].trim().to_owned(),
                        argv,
                    });
                }
            }
        }
    }
    out
}

/// Why `argv` is not a command leasectl accepts, if it is not.
fn refusal(argv: &[String]) -> Option<String> {
    use clap::Parser;
    use leasectl::cli::{Cli, Command};
    let args = leasectl::cli::attach_negative_values(argv.iter().map(Into::into).collect());
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => return Some(e.to_string()),
    };
    let checked = match cli.command {
        Command::Run(run) => leasectl::config::RunConfig::new(*run).map(drop),
        Command::Acquire(a) => leasectl::config::RunConfig::acquire(a.lease).map(drop),
        _ => Ok(()),
    };
    checked.err().map(|e| format!("{e:#}"))
}

#[test]
fn every_documented_leasectl_line_parses() {
    let examples = examples();
    let mut failures = Vec::new();
    for ex in &examples {
        if let Some(why) = refusal(&ex.argv) {
            failures.push(format!("{}: {}\n  {why}", ex.at, ex.text));
        }
    }
    assert!(
        failures.is_empty(),
        "{} documented command line(s) do not parse:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // The extraction finds what it must: over 80 lines, every command among them.
    assert!(examples.len() > 80, "only {} lines found", examples.len());
    for cmd in [
        "run",
        "acquire",
        "renew",
        "release",
        "status",
        "runs",
        "output",
        "expect",
        "check",
        "relay",
        "outbox",
        "prune",
        "migrate",
        "completions",
        "emit",
        "doctor",
    ] {
        assert!(
            examples
                .iter()
                .any(|e| e.argv.get(1).map(String::as_str) == Some(cmd)
                    || e.argv.get(1).is_some_and(|a| a.starts_with('-'))
                        && e.argv.iter().any(|w| w == cmd)),
            "no documented `leasectl {cmd}` line was found"
        );
    }
}

/// The checker refuses what the binary refuses: a misspelled flag, a flag of another command,
/// a heartbeat too long for the TTL; and takes the shell forms the documentation uses.
#[test]
fn the_documentation_checker_can_fail() {
    let words = |s: &str| shlex::split(s).unwrap();
    for bad in [
        "leasectl run --taget hello -- echo hello",
        "leasectl relay --once --snk stdout",
        "leasectl status --limit 5",
        "leasectl run --target t --ttl 10s --heartbeat 6s -- true",
    ] {
        assert!(refusal(&words(bad)).is_some(), "{bad} was accepted");
    }
    let lines: Vec<String> = [
        "0 2 * * *  leasectl run --target nightly --slot '0 2 * * *' -- ./nightly.sh",
        "TOKEN=$(leasectl run --target oauth --ttl 20s --wait=30s --reuse-within 5m -- ./r)",
        "eval \"$(leasectl acquire --target deploy --ttl 30m --wait=10m)\"   # exports",
        "leasectl run --target invoices -- sh -c '",
        "  ./send-invoices &&",
        "  leasectl emit --aggregate-type invoice --aggregate-id \"$BATCH\" --type sent'",
        "$ leasectl outbox retry 5b0e…-4c1f          # due now",
        "DATABASE_URL=postgres://app@db/app leasectl run --target x -- ./report.sh",
        "        run: leasectl release --target deploy --token \"$LEASECTL_TOKEN\"",
        "echo leasectl is not a command here",
    ]
    .map(String::from)
    .into();
    let mut found = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        for (start, in_subst) in command_starts(line) {
            let argv = example_at(&lines, i, start, in_subst).unwrap();
            found.push(argv[1].clone());
        }
    }
    assert_eq!(
        found,
        ["run", "run", "acquire", "run", "emit", "outbox", "run", "release"],
        "the lines found in {lines:#?}"
    );
    assert!(Path::new(&root()).join("docs/guide").is_dir());
}
