//! Waking the relay (migration 0007, `src/relay/wake.rs`): the outbox trigger sends its NOTIFY
//! only while a relay holds the idle mark, and no event waits for `--poll` because of that —
//! neither one inserted while no relay was idle, nor one whose transaction was still open when
//! the relay went to sleep, nor one inserted after the relay holding the mark was killed.
//!
//! Every relay here polls once an hour and every delivery is awaited for at most [`PROMPT`], so
//! only a wake-up can explain a delivery.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use crate::events::*;

/// How long a delivery may take: far below the relays' poll, far above a loaded machine's
/// wake-up.
const PROMPT: Duration = Duration::from_secs(15);

/// The mark's advisory lock key space (migration 0007).
const MARK_CLASS: &str = "1818583411";

/// A psql session the test drives statement by statement, to hold a transaction open.
pub(crate) struct Session {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    pub(crate) pid: String,
}

impl Session {
    pub(crate) fn open(env: &Env) -> Session {
        let mut child = Command::new("psql")
            .args(["-qXAt", "-v", "ON_ERROR_STOP=1", &env.direct_url])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let mut s = Session {
            child,
            stdin,
            stdout,
            pid: String::new(),
        };
        s.pid = s.run(&format!(
            "SET search_path = \"{}\"; SELECT pg_backend_pid();",
            env.schema
        ));
        s
    }

    /// Sends `sql` and returns its output once psql has run it.
    pub(crate) fn run(&mut self, sql: &str) -> String {
        writeln!(self.stdin, "{sql}\n\\echo --done--").unwrap();
        let mut out = String::new();
        loop {
            let mut line = String::new();
            assert!(self.stdout.read_line(&mut line).unwrap() > 0, "psql ended");
            if line.trim_end() == "--done--" {
                return out.trim_end().to_owned();
            }
            out.push_str(&line);
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn insert_sql(n: usize) -> String {
    format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         VALUES ('order', '{n}', 'order.paid', '{{\"n\": {n}}}');"
    )
}

/// The advisory locks of the mark's key space on this schema's outbox, as `mode:granted`.
fn mark_locks(env: &Env, pid: Option<&str>) -> Vec<String> {
    let by = pid.map_or(String::new(), |p| format!("AND pid = {p}"));
    env.sql(&format!(
        "SELECT mode || ':' || granted FROM pg_locks
          WHERE locktype = 'advisory' AND classid = {MARK_CLASS}
            AND objid = 'outbox'::regclass::oid {by} ORDER BY 1"
    ))
    .into_iter()
    .map(|r| r[0].clone().unwrap())
    .collect()
}

fn mark_held(env: &Env) -> bool {
    mark_holder(env).is_some()
}

/// The backend pid holding the mark.
fn mark_holder(env: &Env) -> Option<String> {
    env.sql(&format!(
        "SELECT pid FROM pg_locks
          WHERE locktype = 'advisory' AND classid = {MARK_CLASS}
            AND objid = 'outbox'::regclass::oid AND mode = 'ExclusiveLock' AND granted"
    ))
    .into_iter()
    .next()
    .and_then(|r| r[0].clone())
}

fn delivered(env: &Env) -> usize {
    std::fs::read_to_string(env.path("delivered"))
        .unwrap_or_default()
        .lines()
        .count()
}

fn promptly(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < PROMPT,
            "{what}: not within {PROMPT:?} (the relays poll once an hour)"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A continuous relay, polling hourly, appending each event it delivers to `delivered`; each
/// delivery first waits for the gate.
fn relay(env: &Env) -> Watched {
    let command = format!(
        "exec:touch '{}'; {}; cat >> '{}'",
        env.path("started").display(),
        env.gate(),
        env.path("delivered").display()
    );
    Watched::new(
        env.command()
            .args(["-v", "relay", "--sink", &command, "--poll", "1h"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    )
}

#[test]
fn an_application_insert_wakes_an_idle_relay_and_notifies_only_while_one_is_idle() {
    let env = migrated();
    env.open_gate();
    // No relay: the insert's transaction takes the probe's shared lock, so it sends no NOTIFY.
    let mut app = Session::open(&env);
    app.run(&format!("BEGIN; {}", insert_sql(1)));
    assert_eq!(mark_locks(&env, Some(&app.pid)), ["ShareLock:true"]);
    app.run("COMMIT;");

    let relay = relay(&env);
    promptly("the event from before the relay started", || {
        delivered(&env) == 1
    });
    promptly("the idle relay holding the mark", || mark_held(&env));
    // A relay is idle: the probe fails (no lock kept), so the insert notifies.
    app.run(&format!("BEGIN; {}", insert_sql(2)));
    assert_eq!(mark_locks(&env, Some(&app.pid)), Vec::<String>::new());
    app.run("COMMIT;");
    promptly("the event from the open session", || delivered(&env) == 2);
    // Plain autocommit inserts, each after the relay went idle again.
    for n in 3..6 {
        promptly("the relay idle again", || mark_held(&env));
        env.sql(&insert_sql(n));
        promptly("an autocommit insert's event", || delivered(&env) == n);
    }
    kill(relay.child.id(), libc::SIGTERM);
    let o = relay.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(!mark_held(&env), "the mark goes with the relay's session");
}

#[test]
fn a_busy_relay_still_sees_events_inserted_while_it_was_busy() {
    let env = migrated();
    let relay = relay(&env);
    promptly("the idle relay holding the mark", || mark_held(&env));
    env.sql(&insert_sql(1));
    wait_for_file_exists(&env.path("started"));
    // The relay is busy (its delivery waits for the gate) and holds no mark: these inserts
    // send no NOTIFY; one commits at once, the other stays open past the relay's next claim.
    assert!(!mark_held(&env));
    env.sql(&insert_sql(2));
    let mut app = Session::open(&env);
    app.run(&format!("BEGIN; {}", insert_sql(3)));
    assert_eq!(mark_locks(&env, Some(&app.pid)), ["ShareLock:true"]);
    env.open_gate();
    promptly(
        "the committed event inserted while the relay was busy",
        || delivered(&env) == 2,
    );
    // Drained what it can see, the relay waits for the open transaction to take the mark.
    promptly(
        "the relay queued for the mark behind the open transaction",
        || mark_locks(&env, None).contains(&"ExclusiveLock:false".to_owned()),
    );
    // …and, the transaction staying open, claims again and retries rather than sleep.
    relay.wait_for_stderr("keeps this relay from sleeping on LISTEN");
    app.run("COMMIT;");
    promptly(
        "the event whose transaction was open when the relay drained",
        || delivered(&env) == 3,
    );
    promptly("the idle relay holding the mark", || mark_held(&env));
    kill(relay.child.id(), libc::SIGTERM);
    assert_eq!(code(&relay.finish()), 0);
}

#[test]
fn when_the_relay_holding_the_mark_is_killed_another_takes_it_over() {
    let env = migrated();
    env.open_gate();
    let first = relay(&env);
    promptly("the first relay holding the mark", || mark_held(&env));
    let first_holder = mark_holder(&env);
    let second = relay(&env);
    second.wait_for_stderr("relaying schema");
    kill(first.child.id(), libc::SIGKILL);
    first.finish();
    // The killed relay's backend ends, and with it its mark; the survivor takes it over.
    promptly("the second relay holding the mark", || {
        mark_holder(&env).is_some_and(|p| Some(p) != first_holder)
    });
    env.sql(&insert_sql(1));
    promptly("the event, through the surviving relay", || {
        delivered(&env) == 1
    });
    kill(second.child.id(), libc::SIGTERM);
    assert_eq!(code(&second.finish()), 0);
}
