//! The relay and the sessions its batches live in: it publishes an event only while it knows the
//! batch's transaction is still open, so a batch whose session the server ended (a relay paused
//! past the transaction's idle timeout) is never published after another relay took it over.
//!
//! What a consumer sees is checked with `assert_redeliveries_complete` (events.rs): per aggregate, every
//! event is the one after the event before it, or a redelivery that starts again at or before
//! it — an event from further ahead may never come in the middle of a redelivered run.

use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::common::*;
use crate::events::*;

/// A relay A whose batch's session the server ends while A is paused mid-batch; a relay B then
/// takes the aggregate over and publishes its newer events. Once A runs again, it must not
/// publish the rest of its stale batch: those copies would arrive among B's newer events
/// (the fault campaign saw `15466, 15467, 15468, 4610*, 15469, 4611*, …`).
#[test]
fn a_relay_paused_past_its_sessions_end_never_publishes_its_stale_batch() {
    let env = migrated();
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', 'a', 'order.paid', jsonb_build_object('n', g)
           FROM generate_series(1, 100) g",
    );
    // A's sessions end after 2 s idle in a transaction: the server's idle timeout, as an
    // operator may have set it for the role or the database.
    let name = format!("stale_{}", env.schema);
    let url = format!(
        "{} application_name={name} options='-c idle_in_transaction_session_timeout=2000'",
        env.url
    );
    let a = Watched::new(
        env.command_at(&url)
            .args(["-v", "relay", "--batch", "10", "--sink"])
            // Appends, then takes a while: A is stopped while it waits for a command that has
            // its event already, not while it hands an event over (a window of its own).
            .arg(format!(
                "exec:printf 'A %s\\n' \"$(cat)\" >> '{}'; sleep 0.2",
                env.path("log").display()
            ))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_for("A to deliver two events", || tagged_log(&env).len() >= 2);
    let mut paused = Stopped::stop(vec![a.child.id()]);
    wait_for("the server to end A's sessions", || {
        env.scalar(&format!(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = '{name}'"
        )) == "0"
    });
    let b = Watched::new(
        env.command()
            .args(["-v", "relay", "--batch", "10", "--poll", "100ms", "--sink"])
            .arg(tagged_sink(&env, "B", "0.05"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_for("B to be 20 events into the aggregate", || {
        tagged_log(&env).iter().filter(|(w, _, _)| w == "B").count() >= 20
    });
    paused.resume();
    wait_for("B to drain the outbox", || {
        outbox_count(&env) == 0
            && tagged_log(&env)
                .iter()
                .any(|(w, _, n)| w == "B" && *n == 100)
    });
    a.wait_for_stderr("reconnected to the database");
    let mut outputs = Vec::new();
    for relay in [a, b] {
        kill(relay.child.id(), libc::SIGTERM);
        let o = relay.finish();
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        outputs.push(stderr(&o));
    }
    let log = tagged_log(&env);
    assert_redeliveries_complete(&log);
    assert!(outputs[0].contains("left unpublished"), "{}", outputs[0]);
    let mut seen: Vec<u64> = log.iter().map(|(_, _, n)| *n).collect();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen, (1..=100).collect::<Vec<_>>(), "at least once");
}

/// How long a test's relay statements may go unanswered (`LEASECTL_STATEMENT_TIMEOUT`).
const DEADLINE: Duration = Duration::from_secs(2);

/// How long after its deadline a statement that a batch under way sends at the latest: half the
/// window of the batch's transaction (10 s), which the relay confirms that often.
const NEXT_STATEMENT: Duration = Duration::from_secs(5);

/// What a loaded machine may add to a bound.
const SLACK: Duration = Duration::from_secs(3);

/// The pids of the backends whose application_name is `name`, with their states.
fn backends(env: &Env, name: &str) -> Vec<(u32, String)> {
    env.sql(&format!(
        "SELECT pid, coalesce(state, '') FROM pg_stat_activity WHERE application_name = '{name}'"
    ))
    .into_iter()
    .map(|r| {
        (
            r[0].as_deref().unwrap().parse().unwrap(),
            r[1].clone().unwrap_or_default(),
        )
    })
    .collect()
}

/// `relay --once` whose database goes silent a second into a drain (a black-holed network
/// path): before, it hung with no output (still running after 90 s, 935 s in one run); now its
/// next statement goes unanswered past its deadline and it exits 69, within the deadline plus
/// half a window of the silence. Nothing is lost: a later pass publishes the rest, and what was
/// published twice comes as a complete redelivered run.
#[test]
fn relay_once_on_a_database_gone_silent_mid_drain_exits_69_within_its_bound() {
    let env = migrated();
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', (g % 50)::text, 'order.paid', jsonb_build_object('n', (g - 1) / 50 + 1)
           FROM generate_series(1, 2000) g",
    );
    let proxy = crate::proxy::Proxy::start("127.0.0.1:5432".parse().unwrap());
    let name = format!("silent_{}", env.schema);
    let url = format!(
        "{} host=127.0.0.1 port={} application_name={name}",
        env.url, proxy.port
    );
    let mut relay = env
        .command_at(&url)
        .env("LEASECTL_STATEMENT_TIMEOUT", "2s")
        .args(["relay", "--once", "--batch", "10", "--sink"])
        .arg(tagged_sink(&env, "A", "0.05"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the drain to be under way", || tagged_log(&env).len() >= 20);
    std::thread::sleep(Duration::from_secs(1));
    proxy.set_black_hole(true);
    let silent = Instant::now();
    let status = exits_within(
        &mut relay,
        DEADLINE + NEXT_STATEMENT + SLACK,
        "relay --once on a silent database",
    );
    let took = silent.elapsed();
    let err = {
        use std::io::Read;
        let mut s = String::new();
        relay.stderr.take().unwrap().read_to_string(&mut s).unwrap();
        s
    };
    assert_eq!(status.code(), Some(69), "{err}");
    assert!(
        err.contains("did not answer") && err.contains("within 2.0s"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert!(took >= DEADLINE, "exited {took:?} into the silence: {err}");

    // The path heals; the sessions left behind end, and a later pass delivers the rest.
    proxy.set_black_hole(false);
    wait_for("the silent relay's sessions to end", || {
        backends(&env, &name).is_empty()
    });
    let o = env
        .command()
        .args(["relay", "--once", "--batch", "100", "--sink"])
        .arg(tagged_sink(&env, "B", "0"))
        .output_in_time();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(outbox_count(&env), 0);
    let log = tagged_log(&env);
    assert_redeliveries_complete(&log);
    let mut seen: Vec<(String, u64)> = log.into_iter().map(|(_, a, n)| (a, n)).collect();
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 2000, "at least once");
}

/// A service relay whose backends are stopped (SIGSTOP; new connections still work): before,
/// its backlog froze with no warning and no reconnect. Now the statement it waits for goes
/// unanswered past its deadline: it warns once, drops those connections and reconnects, and the
/// aggregates the stopped backends do not hold drain meanwhile; once they run again they find
/// their client gone and give the rest back.
#[test]
fn a_relay_whose_backends_are_stopped_reconnects_and_drains_the_rest() {
    let env = migrated();
    env.sql(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', (g % 100)::text, 'order.paid', jsonb_build_object('n', (g - 1) / 100 + 1)
           FROM generate_series(1, 600) g",
    );
    let name = format!("frozen_{}", env.schema);
    let url = format!("{} application_name={name}", env.url);
    let relay = Watched::new(
        env.command_at(&url)
            .env("LEASECTL_STATEMENT_TIMEOUT", "2s")
            .args(["-v", "relay", "--batch", "10", "--poll", "200ms", "--sink"])
            .arg(tagged_sink(&env, "A", "0.02"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_for("the drain to be under way", || tagged_log(&env).len() >= 30);
    // Stopped while idle in their transactions: a backend stopped in the middle of a statement
    // may hold a buffer lock every other session would wait for, which is another fault.
    let mut frozen = Stopped(Vec::new());
    wait_for("the relay's backends stopped between statements", || {
        let pids: Vec<u32> = backends(&env, &name).into_iter().map(|(p, _)| p).collect();
        frozen = Stopped::stop(pids);
        let states = backends(&env, &name);
        if !states.is_empty() && states.iter().all(|(_, s)| s == "idle in transaction") {
            return true;
        }
        frozen.resume();
        false
    });
    let stopped_at = Instant::now();
    let before = tagged_log(&env).len();
    relay.wait_for_stderr("reconnected to the database");
    // The deadline after the next statement, and the first reconnect's backoff (1 s ± 20%).
    let bound = DEADLINE + NEXT_STATEMENT + Duration::from_millis(1200) + SLACK;
    assert!(stopped_at.elapsed() < bound, "{}", relay.stderr());
    wait_for(
        "other aggregates to drain past the stopped backends",
        || tagged_log(&env).len() >= before + 100,
    );
    // Still stopped: what they hold waits for them.
    assert!(frozen.0.iter().all(|&pid| alive(pid as i32)));
    frozen.resume();
    wait_for("the outbox to drain", || outbox_count(&env) == 0);
    kill(relay.child.id(), libc::SIGTERM);
    let o = relay.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let err = stderr(&o);
    let warned: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("warning") && l.contains("did not answer"))
        .collect();
    assert_eq!(warned.len(), 1, "{err}");
    let log = tagged_log(&env);
    assert_redeliveries_complete(&log);
    let mut seen: Vec<(String, u64)> = log.into_iter().map(|(_, a, n)| (a, n)).collect();
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 600, "at least once");
}
