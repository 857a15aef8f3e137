//! `release --force`: the holder is told at once, stops its command and records
//! a `lost` run; `release` waits for that record, or for the old lease to expire, and says
//! which happened — so the next holder cannot overlap with the old command.

use std::time::Duration;

use crate::common::*;

/// Starts a holder whose heartbeats are far apart (so only the announcement can stop it soon),
/// running `sleep 300` under the lease on `target`.
fn slow_heartbeat_holder(env: &Env, target: &str, heartbeat: &str) -> std::process::Child {
    env.hold_with(
        env.command(),
        target,
        &[
            "--ttl",
            "10m",
            "--heartbeat",
            heartbeat,
            "--kill-after",
            "2s",
        ],
        "exec sleep 300",
    )
}

#[test]
fn a_forced_release_stops_the_holder_at_once_and_waits_for_its_lost_record() {
    let env = Env::new();
    let holder = slow_heartbeat_holder(&env, "r", "3m");
    let mut holder = holder;
    let o = env.run(&["release", "--target", "r", "--force"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    // The holder stopped long before its next heartbeat (3 minutes away) would have told it.
    let what = "the forced-out holder (next heartbeat in 3m)";
    assert_eq!(
        exits_within(&mut holder, Duration::from_secs(60), what).code(),
        Some(76)
    );
    // release returned only after the holder had recorded its stop, and says so.
    let out = stdout(&o);
    assert!(
        out.contains("the holder stopped and recorded run") && out.contains("as lost"),
        "{out}"
    );
    let lost = env.scalar("SELECT count(*) FROM runs WHERE target = 'r' AND outcome = 'lost'");
    assert_eq!(lost, "1");
}

#[test]
fn no_wait_returns_without_waiting_for_the_holder() {
    let env = Env::new();
    let holder = slow_heartbeat_holder(&env, "n", "3m");
    let o = env.run(&["release", "--target", "n", "--force", "--no-wait"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stdout(&o).contains("not waiting for the holder to stop"));
    let mut holder = holder;
    let what = "the forced-out holder (next heartbeat in 3m)";
    assert_eq!(
        exits_within(&mut holder, Duration::from_secs(60), what).code(),
        Some(76)
    );
}

#[test]
fn behind_a_pooler_the_holder_stops_at_its_next_heartbeat_and_release_waits_for_it() {
    use_pooler();
    let env = Env::new();
    let holder = slow_heartbeat_holder(&env, "p", "1s");
    let o = env.run(&["release", "--target", "p", "--force"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stdout(&o).contains("the holder stopped and recorded run"),
        "{}",
        stdout(&o)
    );
    assert_eq!(code(&finish(holder)), 76);
}

#[test]
fn a_holder_that_records_nothing_is_waited_for_until_its_lease_expires() {
    let env = Env::new();
    // A stopped (SIGSTOP) holder cannot record anything: release waits out its TTL.
    let holder = env.hold_with(
        env.command(),
        "s",
        &["--ttl", "4s", "--heartbeat", "1s", "--kill-after", "1s"],
        "exec sleep 300",
    );
    kill(holder.id(), libc::SIGSTOP);
    let o = env.run(&["release", "--target", "s", "--force"]);
    kill(holder.id(), libc::SIGCONT);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stdout(&o).contains("its lease has expired by now"),
        "{}",
        stdout(&o)
    );
    let _ = finish(holder);
}
