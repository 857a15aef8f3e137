//! `leasectl --version` names the commit, and the man pages in `man/` are generated from the
//! clap definitions (plus the exit-code table and the environment, below) and kept identical to
//! them: a CLI change without regenerating fails here, the way `completions/` does. So is the
//! markdown reference in `docs/reference/`, each command's `--help`.
//!
//! The pages are rendered here rather than by the binary, so clap_mangen stays a dev-dependency
//! and out of the shipped binary. To regenerate:
//!   LEASECTL_UPDATE_MAN=1 cargo nextest run --test it manpages

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use clap::CommandFactory;
use leasectl::exit::Exit;
use roff::{bold, roman, Roff};

use crate::common::bin;

const UPDATE_HINT: &str =
    "run `LEASECTL_UPDATE_MAN=1 cargo nextest run --test it manpages` to update man/ and docs/reference/";

/// The exit codes that are not leasectl's own: the command's, success, and "not found".
const EXIT_CODES: &[(&str, &str)] = &[
    ("N", "run: the command's own exit code, or 128+N if signal N killed it; the run is stored"),
    ("0", "success; also a fresh stored result printed by --reuse-within, or a --slot already done or being done"),
    ("1", "check: a watched target is unhealthy; output: no stored run matches; outbox retry/discard: no such event; relay --once: events went dead"),
];

/// leasectl's own exit codes, from src/exit.rs's constants.
fn typed_exit_codes() -> Vec<(u8, &'static str)> {
    vec![
        (Exit::USAGE, "usage error (bad flag, duration, target or schema name; relay: --metrics cannot listen on ADDR)"),
        (Exit::DATA_ERROR, "the command's $LEASECTL_EVENTS held a malformed line or more than --events-limit, or was no longer a regular file; the run was stored without them"),
        (Exit::UNAVAILABLE, "database unreachable, rejected the connection or stopped answering; relay: a batch's transaction ended; relay --once: the sink is unreachable (or stdout closed)"),
        (Exit::INTERNAL, "internal error (a bug); a running command's process group is killed"),
        (Exit::BUSY, "busy: another holder has a live lease, or --wait=DUR ran out (--busy-exit-code overrides it); run --token: another step of the lease is running"),
        (Exit::LEASE_LOST, "the lease was lost during the run (expired, released, or taken by --replace): the command was stopped, the run recorded lost (or preempted); run --token, renew, release --token: the token no longer holds the target"),
        (Exit::NO_PERMISSION, "permission denied: the role lacks a privilege, or may not create or upgrade the schema"),
        (Exit::SCHEMA_TOO_NEW, "the schema is newer than this binary, or a migration differs from this binary's"),
        (Exit::TIMED_OUT, "--timeout expired; the command was stopped and the run stored as timed out"),
        (Exit::NOT_EXECUTABLE, "the command is not executable; the lease was released"),
        (Exit::NOT_FOUND, "the command was not found; the lease was released"),
    ]
}

/// What leasectl itself reads.
const READS: &[(&str, &str)] = &[
    ("DATABASE_URL", "PostgreSQL URL or libpq key=value string, when --database-url is not given"),
    ("PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE", "as in libpq, when neither --database-url nor DATABASE_URL is set; PGHOST may list several hosts, tried in order, and PGPORT one port for all or one per host"),
    ("PGTARGETSESSIONATTRS", "read-write: of several hosts, use the one that accepts writes (the primary), as in libpq; any (default)"),
    ("PGSSLMODE, PGSSLROOTCERT, PGSSLCERT, PGSSLKEY", "TLS settings, as in libpq"),
    ("PGPASSFILE", "the password file (default ~/.pgpass)"),
    ("PGSERVICE, PGSERVICEFILE, PGSYSCONFDIR", "a connection service and where pg_service.conf files are found, as in libpq"),
    ("LEASECTL_POOLER", "auto (default) detects a transaction-mode pooler; transaction forces polling instead of LISTEN; none forces LISTEN"),
    ("LEASECTL_STATEMENT_TIMEOUT", "the deadline for a one-shot command's database work (default 30s), and for each statement of relay (default 10s), e.g. 2m"),
];

/// What `run`'s command sees.
const CHILD_SEES: &[(&str, &str)] = &[
    ("LEASECTL_TARGET", "the target whose lease is held"),
    ("LEASECTL_TOKEN", "this acquisition's random lease token"),
    ("LEASECTL_FENCE", "the fencing number, higher on every acquisition of the target: a downstream system can reject writes from an older holder"),
    ("LEASECTL_HOLDER_INDEX", "the holder's place: 0, or 0 to N-1 with --max-holders N"),
    ("LEASECTL_EVENTS", "the path of a fresh file (mode 0600) where the command appends its own events, one JSON object a line; stored with the run in the same transaction (anything but a regular file left there is refused, exit 65)"),
    ("LEASECTL_SLOT", "with --slot: the start of the slot being run (RFC 3339)"),
    ("LEASECTL_SLOT_END", "with --slot: the next instant of the schedule (RFC 3339)"),
];

/// What the relay's `exec:` sink command sees (the event JSON is on its stdin).
const EXEC_SEES: &[(&str, &str)] = &[
    ("LEASECTL_EVENT_ID", "the event's id"),
    ("LEASECTL_EVENT_TYPE", "the event type"),
    ("LEASECTL_AGGREGATE_TYPE", "the event's aggregate type"),
    ("LEASECTL_AGGREGATE_ID", "the event's aggregate id"),
];

fn tagged_list(roff: &mut Roff, heading: &str, intro: &str, items: &[(String, String)]) {
    roff.control("SH", [heading]);
    if !intro.is_empty() {
        roff.text([roman(intro)]);
    }
    for (tag, text) in items {
        roff.control("TP", []);
        roff.text([bold(tag.as_str())]);
        roff.text([roman(text.as_str())]);
    }
}

fn owned(items: &[(&str, &str)]) -> Vec<(String, String)> {
    items
        .iter()
        .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
        .collect()
}

/// Every page, by file name: `leasectl.1` and one per (nested) subcommand.
fn generate() -> BTreeMap<String, Vec<u8>> {
    // The plain package version: the commit would change every page on every commit.
    let mut root = leasectl::cli::Cli::command()
        .version(env!("CARGO_PKG_VERSION"))
        .disable_help_subcommand(true);
    root.build();
    let mut commands = Vec::new();
    fn walk(cmd: &clap::Command, out: &mut Vec<clap::Command>) {
        out.push(cmd.clone());
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            walk(sub, out);
        }
    }
    walk(&root, &mut commands);
    let names: Vec<String> = commands
        .iter()
        .map(|c| c.get_display_name().unwrap_or(c.get_name()).to_owned())
        .collect();

    let mut exits = owned(EXIT_CODES);
    exits.extend(
        typed_exit_codes()
            .into_iter()
            .map(|(code, text)| (code.to_string(), text.to_owned())),
    );
    exits.push((
        "128+N".into(),
        "leasectl received signal N (forwarded to the command); the run is recorded interrupted"
            .into(),
    ));

    let mut pages = BTreeMap::new();
    for (cmd, name) in commands.into_iter().zip(&names) {
        // The page's EXIT STATUS lists every code, so the help's own "Exit codes:" paragraph
        // is left out of NOTES rather than printed twice.
        let cmd = match cmd.get_after_help().map(ToString::to_string) {
            Some(after) => cmd.after_help(without_exit_codes(&after)),
            None => cmd,
        };
        let man = clap_mangen::Man::new(cmd.clone())
            .source(format!("leasectl {}", env!("CARGO_PKG_VERSION")));
        let mut page = Vec::new();
        man.render_title(&mut page).unwrap();
        man.render_name_section(&mut page).unwrap();
        let mut synopsis = Vec::new();
        man.render_synopsis_section(&mut synopsis).unwrap();
        page.extend_from_slice(with_escape(&cmd, String::from_utf8(synopsis).unwrap()).as_bytes());
        man.render_description_section(&mut page).unwrap();
        man.render_options_section(&mut page).unwrap();
        if cmd.get_subcommands().any(|s| !s.is_hide_set()) {
            man.render_subcommands_section(&mut page).unwrap();
        }
        if cmd.get_after_help().is_some() || cmd.get_after_long_help().is_some() {
            let mut extra = Vec::new();
            man.render_extra_section(&mut extra).unwrap();
            let extra = String::from_utf8(extra)
                .unwrap()
                .replacen(".SH EXTRA", ".SH NOTES", 1);
            page.extend_from_slice(extra.as_bytes());
        }
        let mut roff = Roff::new();
        tagged_list(&mut roff, "EXIT STATUS", "", &exits);
        tagged_list(
            &mut roff,
            "ENVIRONMENT",
            "Connection settings are read in libpq's order: --database-url, DATABASE_URL, the PG* \
             variables, then the local socket as the current user.",
            &owned(READS),
        );
        if name == "leasectl" || name == "leasectl-run" {
            tagged_list(
                &mut roff,
                "COMMAND ENVIRONMENT",
                "The command run under the lease inherits leasectl's environment, plus:",
                &owned(CHILD_SEES),
            );
        }
        if name == "leasectl" || name == "leasectl-relay" {
            tagged_list(
                &mut roff,
                "EXEC SINK ENVIRONMENT",
                "An exec:COMMAND sink runs sh -c COMMAND with the event JSON on stdin and:",
                &owned(EXEC_SEES),
            );
        }
        roff.control("SH", ["SEE ALSO"]);
        let see: Vec<String> = if name == "leasectl" {
            names[1..].iter().map(|n| format!("{n}(1)")).collect()
        } else {
            vec!["leasectl(1)".to_owned()]
        };
        roff.text([roman(see.join(", "))]);
        page.extend_from_slice(roff.to_roff().as_bytes());
        pages.insert(format!("{name}.1"), page);
    }
    pages
}

/// The help text without its "Exit codes:" paragraph.
fn without_exit_codes(after_help: &str) -> String {
    after_help
        .split("\n\n")
        .filter(|p| !p.starts_with("Exit codes:"))
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// The synopsis with the `--` an argument taken only after it (`run`'s COMMAND) needs:
/// clap_mangen leaves it out, and `leasectl run --target x echo hi` is a usage error.
fn with_escape(cmd: &clap::Command, synopsis: String) -> String {
    let mut synopsis = synopsis;
    for arg in cmd.get_positionals().filter(|a| a.is_last_set()) {
        let name = arg.get_value_names().unwrap()[0].as_str();
        let plain = format!("<\\fI{name}\\fR>");
        assert!(
            synopsis.contains(&plain),
            "no {plain} in the synopsis of {}: {synopsis}",
            cmd.get_name()
        );
        synopsis = synopsis.replace(&plain, &format!("\\fB\\-\\-\\fR {plain}..."));
    }
    synopsis
}

fn man_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("man")
}

fn checked_in() -> BTreeMap<String, Vec<u8>> {
    let mut pages = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir(man_dir()) else {
        return pages;
    };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".1") {
            pages.insert(name, std::fs::read(entry.path()).unwrap());
        }
    }
    pages
}

#[test]
fn checked_in_man_pages_match_the_cli() {
    let generated = generate();
    if std::env::var_os("LEASECTL_UPDATE_MAN").is_some() {
        std::fs::create_dir_all(man_dir()).unwrap();
        for stale in checked_in().keys().filter(|k| !generated.contains_key(*k)) {
            std::fs::remove_file(man_dir().join(stale)).unwrap();
        }
        for (name, page) in &generated {
            std::fs::write(man_dir().join(name), page).unwrap();
        }
        return;
    }
    let existing = checked_in();
    let names = |m: &BTreeMap<String, Vec<u8>>| m.keys().cloned().collect::<Vec<_>>();
    assert_eq!(
        names(&existing),
        names(&generated),
        "the pages in man/ are not one per command; {UPDATE_HINT}"
    );
    for (name, page) in &generated {
        assert!(
            existing[name] == *page,
            "man/{name} differs from the CLI ({} bytes generated, {} checked in); {UPDATE_HINT}",
            page.len(),
            existing[name].len()
        );
    }
}

#[test]
fn man_pages_carry_exit_codes_and_environment() {
    let pages = generate();
    for sub in [
        "leasectl.1",
        "leasectl-run.1",
        "leasectl-relay.1",
        "leasectl-outbox-list.1",
    ] {
        assert!(pages.contains_key(sub), "no {sub}: {:?}", pages.keys());
    }
    for (name, page) in &pages {
        let text = String::from_utf8_lossy(page);
        for needle in [
            "EXIT STATUS",
            "ENVIRONMENT",
            "DATABASE_URL",
            "LEASECTL_POOLER",
            "SEE ALSO",
        ] {
            assert!(text.contains(needle), "{name} lacks {needle}");
        }
        for (code, _) in typed_exit_codes() {
            assert!(
                text.contains(&format!("\\fB{code}\\fR")),
                "{name} lacks exit code {code}"
            );
        }
    }
    let run = String::from_utf8_lossy(&pages["leasectl-run.1"]);
    for (var, _) in CHILD_SEES {
        assert!(run.contains(var), "leasectl-run.1 lacks {var}");
    }
    // Every variable the help says the command sees is in the page's COMMAND ENVIRONMENT.
    let help = leasectl::cli::Cli::command()
        .find_subcommand("run")
        .unwrap()
        .get_after_help()
        .unwrap()
        .to_string();
    let mut seen: Vec<&str> = help
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("LEASECTL_") && w.len() > "LEASECTL_".len())
        .collect();
    seen.sort_unstable();
    seen.dedup();
    let environment = &run[run
        .find(".SH \"COMMAND ENVIRONMENT\"")
        .expect("no COMMAND ENVIRONMENT")..];
    let environment = &environment[..environment.find(".SH \"SEE ALSO\"").unwrap()];
    for var in seen {
        assert!(
            environment.contains(&format!("\\fB{var}\\fR")),
            "leasectl-run.1's COMMAND ENVIRONMENT lacks {var}, which run --help names"
        );
    }
    // The synopsis says the command comes after `--`, as it must.
    let synopsis = &run[run.find(".SH SYNOPSIS").unwrap()..run.find(".SH DESCRIPTION").unwrap()];
    assert!(
        synopsis.contains("\\fB\\-\\-\\fR <\\fICOMMAND\\fR>..."),
        "leasectl-run.1's synopsis lacks the -- before COMMAND: {synopsis}"
    );
    // Exit codes once per page: in EXIT STATUS, not again in NOTES.
    for (name, page) in &pages {
        let text = String::from_utf8_lossy(page);
        assert!(
            !text.contains("Exit codes:"),
            "{name} lists its exit codes in NOTES as well as in EXIT STATUS"
        );
    }
}

/// `man` renders every checked-in page without a warning (bad roff shows up here).
#[test]
fn man_pages_render_cleanly() {
    if Command::new("man").arg("--version").output().is_err() {
        eprintln!("no man(1) on this machine; skipping the rendering check");
        return;
    }
    for name in checked_in().keys() {
        let out = Command::new("man")
            .args(["--warnings", "-l"])
            .arg(man_dir().join(name))
            .env("MANWIDTH", "100")
            .env("MANPAGER", "cat")
            .env("PAGER", "cat")
            .output()
            .unwrap();
        assert!(out.status.success(), "man -l man/{name} failed");
        assert!(
            out.stderr.is_empty(),
            "man -l man/{name} warned: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).contains("EXIT STATUS"));
    }
}

/// Built from this checkout, `--version` names the commit it was built from.
#[test]
fn version_names_the_commit() {
    let out = Command::new(bin()).arg("--version").output().unwrap();
    assert!(out.status.success());
    let line = String::from_utf8(out.stdout).unwrap();
    let line = line.trim_end();
    let head = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output();
    let Some(head) = head.ok().filter(|h| h.status.success()) else {
        // Not a checkout (a source tarball): the version alone.
        assert_eq!(line, concat!("leasectl ", env!("CARGO_PKG_VERSION")));
        return;
    };
    let head = String::from_utf8(head.stdout).unwrap();
    let head = head.trim();
    assert_eq!(head.len(), 12, "{head}");
    assert!(head.bytes().all(|b| b.is_ascii_hexdigit()), "{head}");
    let clean = format!("leasectl {} ({head})", env!("CARGO_PKG_VERSION"));
    let dirty = format!("leasectl {} ({head}, dirty)", env!("CARGO_PKG_VERSION"));
    assert!(
        line == clean || line == dirty,
        "--version printed {line:?}, expected {clean:?} (or with \", dirty\")"
    );
}

/// The command reference in markdown, beside the man pages and from the same definitions:
/// `docs/reference/<page>.md` holds each command's `--help` as the binary prints it (wrapped
/// at 100 columns), and `docs/reference/README.md` lists them. Regenerated with the man pages.
fn reference() -> BTreeMap<String, String> {
    let mut root = leasectl::cli::Cli::command()
        .version(env!("CARGO_PKG_VERSION"))
        .disable_help_subcommand(true)
        .term_width(100)
        .max_term_width(100);
    root.build();
    fn walk(cmd: &clap::Command, out: &mut Vec<clap::Command>) {
        out.push(cmd.clone());
        for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
            walk(sub, out);
        }
    }
    let mut commands = Vec::new();
    walk(&root, &mut commands);
    let mut pages = BTreeMap::new();
    let mut index = String::from(
        "# Command reference\n\nEach command's `--help`, generated from the same definitions as \
         the man pages in [man/](../../man/) (`man leasectl-run` once they are installed). The \
         user guide ([docs/guide/](../guide/)) explains when to use what.\n\n",
    );
    for mut cmd in commands {
        let page = cmd.get_display_name().unwrap_or(cmd.get_name()).to_owned();
        let title = page.replace('-', " ");
        let about = cmd.get_about().map(ToString::to_string).unwrap_or_default();
        let help = cmd.render_long_help().to_string();
        let help: String = help
            .lines()
            .map(|l| format!("{}\n", l.trim_end()))
            .collect();
        index.push_str(&format!("- [`{title}`]({page}.md): {about}\n"));
        pages.insert(
            format!("{page}.md"),
            format!("# {title}\n\n```text\n{}```\n", help),
        );
    }
    pages.insert("README.md".into(), index);
    pages
}

fn reference_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/reference")
}

#[test]
fn the_markdown_reference_matches_the_cli() {
    let generated = reference();
    let existing: BTreeMap<String, String> = std::fs::read_dir(reference_dir())
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| {
            let text = std::fs::read_to_string(reference_dir().join(&n)).unwrap();
            (n, text)
        })
        .collect();
    if std::env::var_os("LEASECTL_UPDATE_MAN").is_some() {
        std::fs::create_dir_all(reference_dir()).unwrap();
        for stale in existing.keys().filter(|k| !generated.contains_key(*k)) {
            std::fs::remove_file(reference_dir().join(stale)).unwrap();
        }
        for (name, text) in &generated {
            std::fs::write(reference_dir().join(name), text).unwrap();
        }
        return;
    }
    assert_eq!(
        existing.keys().collect::<Vec<_>>(),
        generated.keys().collect::<Vec<_>>(),
        "docs/reference/ is not one page per command; {UPDATE_HINT}"
    );
    for (name, text) in &generated {
        assert!(
            existing[name] == *text,
            "docs/reference/{name} differs from the CLI; {UPDATE_HINT}"
        );
    }
    assert!(
        generated["leasectl-run.md"].contains("Usage: leasectl run [OPTIONS]"),
        "{}",
        generated["leasectl-run.md"]
    );
}
