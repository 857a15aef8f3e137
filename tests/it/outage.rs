//! Database outages on established connections (a black-holed path, see `netfault.rs`): every
//! exit stays within its documented bound, and a queue keeps its order.

use std::time::{Duration, Instant};

use crate::common::*;
use crate::netfault::Proxy;

/// How many waiters `target` has in the table.
fn queued(env: &Env, target: &str) -> usize {
    env.scalar(&format!(
        "SELECT count(*) FROM waiters WHERE target = '{target}'"
    ))
    .parse()
    .unwrap()
}

/// A holder whose database goes silent exits 76 within its TTL + 1.5 s of the silence, on a
/// connection it has used all along (not a fresh one that fails to connect).
#[test]
fn a_holder_whose_established_connection_goes_silent_exits_within_ttl_and_a_half_second() {
    let env = Env::new();
    let proxy = Proxy::start();
    let url = proxy.url();
    let holders: Vec<(u64, std::process::Child)> = [3u64, 6]
        .into_iter()
        .map(|ttl| {
            let target = format!("t{ttl}");
            let h = env.hold_with(
                env.command_at(&url),
                &target,
                &["--ttl", &format!("{ttl}s")],
                "sleep 60",
            );
            (ttl, h)
        })
        .collect();
    // A couple of heartbeats on the connection first.
    std::thread::sleep(Duration::from_millis(1600));
    let silent = Instant::now();
    proxy.black_hole(true);
    for (ttl, mut h) in holders {
        let bound = Duration::from_secs(ttl) + Duration::from_millis(1500);
        let status = exits_within(&mut h, bound + Duration::from_secs(30), "a silenced holder");
        let took = silent.elapsed();
        let out = h.wait_with_output().unwrap();
        assert_eq!(status.code(), Some(76), "{}", stderr(&out));
        // Measured after the later of the two exits for the second one: still within its own.
        assert!(
            took <= bound,
            "--ttl {ttl}s: exited {took:?} after the silence began (bound {bound:?}): {}",
            stderr(&out)
        );
    }
    proxy.black_hole(false);
}

/// A `--wait=DUR` waiter whose established connection goes silent exits 75 within DUR + 0.5 s
/// of its start, and says it gave up after DUR.
#[test]
fn a_waiter_whose_established_connection_goes_silent_gives_up_on_time() {
    let env = Env::new();
    let proxy = Proxy::start();
    let holder = env.hold("t", &env.gate());
    let started = Instant::now();
    let mut waiter = env
        .command_at(&proxy.url())
        .args(["run", "--target", "t", "--wait=4s", "--", "true"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for("the waiter to queue", || queued(&env, "t") == 1);
    proxy.black_hole(true);
    let status = exits_within(&mut waiter, Duration::from_secs(30), "a silenced waiter");
    let took = started.elapsed();
    let out = waiter.wait_with_output().unwrap();
    assert_eq!(status.code(), Some(75), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("gave up waiting for 't' after 4.0s"),
        "{}",
        stderr(&out)
    );
    // 0.5 s of slack is the promise; a quarter second more for starting the process here.
    assert!(
        took <= Duration::from_millis(4750),
        "exited {took:?} after its start with --wait=4s"
    );
    proxy.black_hole(false);
    env.open_gate();
    assert_eq!(code(&finish(holder)), 0);
}

/// Four `fifo` waiters behind a holder, the waiters' path silent for 2.5 s while the holder
/// (on a path of its own) finishes: the waiters' attempts reach the database late, the first
/// waiter's grant comes back after its stop budget — and the waiters, none of them killed, each
/// within its own waiter TTL (10 s), still start in the order they arrived, and none blames a
/// pause that never happened. In every other round the holder's path goes silent too.
#[test]
fn fifo_waiters_keep_their_order_across_a_short_outage() {
    for round in 0..4 {
        let env = Env::new();
        let proxy = Proxy::start();
        let url = proxy.url();
        let log = env.path("order");
        let holder_path = if round % 2 == 0 {
            env.command()
        } else {
            env.command_at(&url)
        };
        let holder = env.hold_with(holder_path, "q", &["--ttl", "1s"], &env.gate());
        let mut waiters = Vec::new();
        for i in 0..4 {
            let script = format!("echo w{i} >> '{}'; sleep 0.2", log.display());
            let w = env
                .command_at(&url)
                .args(["-v", "run", "--target", "q", "--ttl", "1s", "--wait=60s"])
                .args(["--", "sh", "-c", &script])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            waiters.push(Watched::new(w));
            wait_for(&format!("waiter {i} to queue"), || {
                queued(&env, "q") == i + 1
            });
        }
        proxy.black_hole(true);
        std::thread::sleep(Duration::from_millis(500));
        env.open_gate();
        std::thread::sleep(Duration::from_millis(2000));
        proxy.black_hole(false);
        // Through the silent path, the holder's save (its command ended in the outage) and the
        // waiters' attempts reach the database together: stored (0) or fenced out (76).
        let h = finish(holder);
        let expected: &[i32] = if round % 2 == 0 { &[0] } else { &[0, 76] };
        assert!(expected.contains(&code(&h)), "{}", stderr(&h));
        let mut errs = String::new();
        for (i, w) in waiters.into_iter().enumerate() {
            let o = w.finish();
            assert_eq!(code(&o), 0, "w{i}: {}", stderr(&o));
            errs.push_str(&format!("--- w{i}\n{}", stderr(&o)));
        }
        let order = std::fs::read_to_string(&log).unwrap();
        assert_eq!(
            order.lines().collect::<Vec<_>>(),
            ["w0", "w1", "w2", "w3"],
            "round {round}: the waiters started out of order\n{errs}"
        );
        assert!(!errs.contains("paused"), "round {round}: {errs}");
    }
}
