//! `run --max-holders N`: up to N holders at once, each in its own place, one fence sequence per
//! target; a caller with another N is a usage error while any place is held.

use std::collections::BTreeSet;

use crate::common::*;

/// 30 contenders with --max-holders 6 and --wait: their commands append `+ INDEX FENCE` when
/// they start and `- INDEX FENCE` when they end to one O_APPEND file (a line each, atomically, in
/// the order they happened). Replaying it, never more than 6 run at once, never two in the same
/// place, every fence is distinct, and the runs are stored with those fences.
#[test]
fn thirty_contenders_with_max_holders_6_never_exceed_6_concurrent_children() {
    let env = Env::new();
    let log = env.path("log");
    let script = format!(
        "echo \"+ $LEASECTL_HOLDER_INDEX $LEASECTL_FENCE\" >> '{0}'; sleep 0.3; \
         echo \"- $LEASECTL_HOLDER_INDEX $LEASECTL_FENCE\" >> '{0}'",
        log.display()
    );
    let contenders: Vec<_> = (0..30)
        .map(|_| {
            env.spawn(&[
                "run",
                "--target",
                "pool",
                "--max-holders",
                "6",
                "--wait",
                "--",
                "sh",
                "-c",
                &script,
            ])
        })
        .collect();
    for c in contenders {
        let o = finish(c);
        assert_eq!(code(&o), 0, "{}", stderr(&o));
    }
    let text = std::fs::read_to_string(&log).unwrap();
    let mut running: BTreeSet<u32> = BTreeSet::new();
    let mut most = 0;
    let mut fences = Vec::new();
    for line in text.lines() {
        let parts: Vec<&str> = line.split(' ').collect();
        let (index, fence): (u32, i64) = (parts[1].parse().unwrap(), parts[2].parse().unwrap());
        match parts[0] {
            "+" => {
                assert!(index < 6, "index {index} in {text}");
                assert!(running.insert(index), "place {index} taken twice:\n{text}");
                fences.push(fence);
            }
            _ => assert!(running.remove(&index), "{text}"),
        }
        most = most.max(running.len());
    }
    assert_eq!(fences.len(), 30);
    assert!(most <= 6, "{most} at once:\n{text}");
    assert!(most >= 2, "the holders never overlapped:\n{text}");
    let distinct: BTreeSet<i64> = fences.iter().copied().collect();
    assert_eq!(distinct.len(), 30, "fences repeat: {fences:?}");
    // Fences increase with each acquisition: each place's holders start in fence order, and
    // the stored runs carry exactly these fences.
    assert_eq!(
        env.scalar("SELECT string_agg(fence::text, ',' ORDER BY fence) FROM runs WHERE outcome = 'completed'"),
        distinct.iter().map(i64::to_string).collect::<Vec<_>>().join(",")
    );
    let mut per_place: std::collections::BTreeMap<&str, Vec<i64>> = Default::default();
    for line in text.lines().filter(|l| l.starts_with('+')) {
        let parts: Vec<&str> = line.split(' ').collect();
        per_place
            .entry(parts[1])
            .or_default()
            .push(parts[2].parse().unwrap());
    }
    for (place, f) in &per_place {
        assert!(f.windows(2).all(|w| w[0] < w[1]), "place {place}: {f:?}");
    }
    assert_eq!(env.held_leases(), "0");
}

#[test]
fn a_caller_with_another_n_is_a_usage_error_naming_the_n_in_force_until_the_target_is_idle() {
    let env = Env::new();
    let holder = env.hold_with(
        env.command(),
        "lic",
        &["--max-holders", "6", "--label", "a"],
        &env.gate(),
    );
    for other in [
        &["--max-holders", "3"][..],
        &[][..],
        &["--max-holders", "3", "--wait"][..],
    ] {
        let o = env.run(&[&["run", "--target", "lic"][..], other, &["--", "true"]].concat());
        assert_one_line_error(&o, 2, "'lic' is held with --max-holders 6");
        assert!(
            stderr(&o).contains("this caller asked for"),
            "{}",
            stderr(&o)
        );
    }
    // The same N takes another place, alongside.
    let o = env.run(&[
        "run",
        "--target",
        "lic",
        "--max-holders",
        "6",
        "--",
        "sh",
        "-c",
        "echo $LEASECTL_HOLDER_INDEX $LEASECTL_FENCE",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(stdout(&o), "1 2\n");
    let doc = env.status();
    let t = &doc["targets"][0];
    assert_eq!(t["state"], "held", "{doc}");
    assert_eq!(t["max_holders"], 6);
    assert_eq!(t["holders"][0]["index"], 0);
    assert_eq!(t["holders"][0]["label"], "a");
    assert_eq!(t["holders"][0]["pid"], holder.id());
    env.open_gate();
    assert_eq!(code(&finish(holder)), 0);
    // Idle: a single holder (N = 1) takes it, with the next fence, then N = 3 may.
    let o = env.run(&[
        "run",
        "--target",
        "lic",
        "--",
        "sh",
        "-c",
        "echo $LEASECTL_HOLDER_INDEX $LEASECTL_FENCE",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(stdout(&o), "0 3\n");
    let o = env.run(&[
        "run",
        "--target",
        "lic",
        "--max-holders",
        "3",
        "--",
        "sh",
        "-c",
        "echo $LEASECTL_HOLDER_INDEX $LEASECTL_FENCE",
    ]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(stdout(&o), "0 4\n");
    let o = env.run(&["run", "--target", "lic", "--max-holders", "0", "--", "true"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    let o = env.run(&[
        "run",
        "--target",
        "lic",
        "--max-holders",
        "2",
        "--slot",
        "@daily",
        "--",
        "true",
    ]);
    assert_one_line_error(&o, 2, "--max-holders cannot go with --slot");
}

#[test]
fn with_all_places_held_a_caller_is_busy_and_release_force_frees_every_place() {
    let env = Env::new();
    let pids = env.path("pids");
    let script = format!("echo $$ >> '{}'; sleep 300", pids.display());
    let holders: Vec<_> = (0..2)
        .map(|_| {
            env.spawn(&[
                "run",
                "--target",
                "two",
                "--max-holders",
                "2",
                "--",
                "sh",
                "-c",
                &script,
            ])
        })
        .collect();
    wait_for("both places to be held", || {
        std::fs::read_to_string(&pids)
            .unwrap_or_default()
            .lines()
            .count()
            == 2
    });
    let o = env.run(&["run", "--target", "two", "--max-holders", "2", "--", "true"]);
    assert_one_line_error(&o, 75, "2 of 2 places held; the first to expire is held by");
    let o = env.run(&["release", "--target", "two", "--force"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(stdout(&o).lines().count(), 2, "{}", stdout(&o));
    assert!(
        stdout(&o).lines().all(|l| l.contains("recorded run")),
        "{}",
        stdout(&o)
    );
    for h in holders {
        assert_eq!(code(&finish(h)), 76);
    }
    assert_eq!(env.held_leases(), "0");
}
