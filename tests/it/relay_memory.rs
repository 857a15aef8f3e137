//! What the relay holds in memory: README's bound, about 6 × the payload bytes in flight (the
//! larger of `--batch-bytes` and the largest event) beyond what an idle relay holds. Measured as
//! the relay process's own high-water mark (VmHWM in /proc/PID/status), which only grows: read
//! once it is idle on an empty outbox, and again once it drained events much larger than
//! `--batch-bytes` (each goes alone).

use std::process::Stdio;

use crate::common::*;
use crate::events::*;

/// The documented factor: bytes held per payload byte in flight.
const FACTOR: u64 = 6;

/// VmHWM of `pid`, in KiB.
fn high_water_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .expect("VmHWM in /proc/PID/status");
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// `relay -v ARGS --sink stdout` over `env`, its stdout thrown away, once it is relaying.
fn relay_to_null(env: &Env, args: &[&str]) -> Watched {
    let relay = Watched::new(
        env.command()
            .args(["-v", "relay"])
            .args(args)
            .args(["--sink", "stdout"])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    relay.wait_for_stderr("relaying schema");
    relay
}

#[test]
fn a_relay_draining_events_larger_than_batch_bytes_stays_within_the_documented_bound() {
    let env = migrated();
    let relay = relay_to_null(&env, &["--batch-bytes", "4MiB"]);
    // Idle on the empty outbox: what it holds without events.
    std::thread::sleep(std::time::Duration::from_millis(300));
    let idle = high_water_kib(relay.child.id());
    // 20 events of 5 MiB each (hex text: what the relay receives is that large).
    let mib = 5;
    env.sql(&format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', 'a' || g, 'order.paid',
                jsonb_build_object('n', g, 'pad', (SELECT string_agg(md5(i::text || g::text), '')
                                                     FROM generate_series(1, {mib} * 1024 * 1024 / 32) i))
           FROM generate_series(1, 20) g"
    ));
    wait_for("the outbox to drain", || outbox_count(&env) == 0);
    let peak = high_water_kib(relay.child.id());
    kill(relay.child.id(), libc::SIGTERM);
    let o = relay.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let in_flight_kib = mib * 1024;
    assert!(
        peak.saturating_sub(idle) <= FACTOR * in_flight_kib,
        "peak {peak} KiB, idle {idle} KiB: {} KiB for {in_flight_kib} KiB in flight, over {FACTOR} ×",
        peak - idle
    );
}

/// Minor page faults of `pid` so far: field 10 of /proc/PID/stat (after the command's name,
/// which is in parentheses and may hold spaces).
fn minor_faults(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    fields[7].parse().unwrap()
}

/// Inserts `n` events of about 200 bytes over 100 aggregates, as the benchmarks do.
fn insert_batches(env: &Env, n: usize) {
    env.sql(&format!(
        "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
         SELECT 'order', (g % 100)::text, 'order.paid',
                jsonb_build_object('n', g, 'pad', repeat('x', 150))
           FROM generate_series(1, {n}) g"
    ));
}

/// The memory a batch frees is kept for the next one: glibc's malloc handed the top of the
/// heap back after every batch and the next batch faulted it in again, about 100 faults a
/// batch of 1000 events (a third of the relay's CPU time in a drain). Once a first drain has
/// grown the heap to a batch's size, a second drain of 15 full batches must fault in almost
/// nothing: fewer than 5 pages a batch. (19,000 events in all: the VACUUM after every 20,000
/// deliveries opens a connection of its own, whose memory is not a batch's.)
#[test]
fn a_relay_keeps_the_memory_a_batch_freed_for_the_next() {
    let env = migrated();
    let relay = relay_to_null(&env, &["--batch", "1000"]);
    insert_batches(&env, 4000);
    wait_for("the first drain", || outbox_count(&env) == 0);
    let before = minor_faults(relay.child.id());
    insert_batches(&env, 15_000);
    wait_for("the second drain", || outbox_count(&env) == 0);
    let faults = minor_faults(relay.child.id()) - before;
    kill(relay.child.id(), libc::SIGTERM);
    let o = relay.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        faults < 15 * 5,
        "{faults} page faults for 15 batches of 1000 events drained with the heap already grown"
    );
}
