//! scripts/test, the one test command, leaves nothing of its run behind: the pgbouncer it
//! starts is stopped and its temporary directory removed when the script exits, however it
//! exits (a failing suite, `die`, a signal). The script cannot run here (it runs this suite), so
//! its own cleanup function runs under the trap main() sets, against a stand-in pgbouncer.

use std::path::PathBuf;
use std::process::Command;

fn script() -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/test");
    std::fs::read_to_string(path).unwrap()
}

/// The text of the shell function `name` in scripts/test, from its `name() {` line to the
/// `}` that closes it (on a line of its own, or closing a one-line body).
fn function(script: &str, name: &str) -> String {
    let start = script
        .find(&format!("\n{name}() {{"))
        .unwrap_or_else(|| panic!("scripts/test defines no {name}()"))
        + 1;
    let rest = &script[start..];
    let end = if rest.lines().next().unwrap().trim_end().ends_with('}') {
        rest.find('\n').unwrap()
    } else {
        rest.find("\n}\n").unwrap() + 2
    };
    rest[..end].to_owned()
}

#[test]
fn scripts_test_sets_the_cleanup_trap_before_it_starts_pgbouncer() {
    let s = script();
    let main = function(&s, "main");
    let trap = main
        .find("trap stop_pgbouncer EXIT")
        .expect("main() sets no EXIT trap for stop_pgbouncer");
    let start = main
        .find("ensure_pgbouncer")
        .expect("main() starts no pgbouncer");
    assert!(
        trap < start,
        "main() sets the trap only after starting pgbouncer: a failure in between leaves it"
    );
    // Every pooler directory the script makes is the one the cleanup removes.
    assert_eq!(
        s.matches("mktemp").count(),
        1,
        "scripts/test makes a temporary directory the cleanup does not know about"
    );
    assert!(s.contains("POOLER_DIR=$(mktemp -d /tmp/leasectl-pgbouncer.XXXXXX)"));
}

#[test]
fn scripts_test_cleanup_stops_pgbouncer_and_removes_its_directory_on_any_exit() {
    let s = script();
    let functions = ["warn", "wait_for", "stop_pgbouncer"]
        .map(|f| function(&s, f))
        .join("\n");
    for (how, ending) in [
        ("exit 1 (die, a failed suite)", "exit 1"),
        ("set -e failing command", "set -e; false"),
        ("SIGTERM", "kill -TERM $$; sleep 5"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("leasectl-pgbouncer.test");
        // The stand-in "pgbouncer" removes its pid file on the way out, as pgbouncer does.
        let body = format!(
            r#"{functions}
POOLER_DIR={dir}
mkdir -p "$POOLER_DIR"
echo config > "$POOLER_DIR/pgbouncer.ini"
( trap 'rm -f "$POOLER_DIR/pgbouncer.pid"; exit 0' TERM; while :; do sleep 0.1; done ) &
echo $! > "$POOLER_DIR/pgbouncer.pid"
echo $! > {pidfile}
trap stop_pgbouncer EXIT
{ending}
"#,
            dir = dir.display(),
            pidfile = tmp.path().join("pid").display(),
        );
        let out = Command::new("bash").arg("-c").arg(&body).output().unwrap();
        assert!(!out.status.success(), "{how}: the script did not fail");
        assert!(
            !dir.exists(),
            "{how}: {} is left behind: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let pid: i32 = std::fs::read_to_string(tmp.path().join("pid"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let pid = nix::unistd::Pid::from_raw(pid);
        let alive = nix::sys::signal::kill(pid, None).is_ok();
        if alive {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
        assert!(
            !alive,
            "{how}: the stand-in pgbouncer (pid {pid}) still runs"
        );
    }
}
