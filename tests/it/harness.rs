//! The harness itself: a command that never finishes fails its test, with its output, instead
//! of hanging the suite.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::*;

#[test]
fn a_command_past_its_deadline_is_killed_and_the_test_fails_with_its_output() {
    let started = Instant::now();
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "echo begun; echo complaint >&2; exec sleep 60"]);
    let panic = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        cmd.output_within(Duration::from_secs(1))
    }))
    .expect_err("a command that runs past its deadline must fail the test");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "took {:?}",
        started.elapsed()
    );
    let msg = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("did not finish within 1s"), "{msg}");
    assert!(msg.contains("begun") && msg.contains("complaint"), "{msg}");
    let pid: i32 = msg
        .split("(pid ")
        .nth(1)
        .and_then(|rest| rest.split(')').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no pid in {msg}"));
    assert!(!alive(pid), "the command was left running");
}

#[test]
fn a_command_within_its_deadline_returns_its_output() {
    let o = Command::new("sh")
        .args(["-c", "echo out; echo err >&2; exit 3"])
        .output_within(Duration::from_secs(30));
    assert_eq!(
        (code(&o), stdout(&o), stderr(&o)),
        (3, "out\n".into(), "err\n".into())
    );
}
