//! What a plain `run` costs in round trips, counted on the wire ([`crate::flights`]): one flight
//! that checks the schema, acquires and LISTENs, one that saves (and releases), nothing else on
//! the way — and, as the command starts, one that plans the save ahead, whose answer nothing
//! waits for.

use crate::common::*;
use crate::events::migrated;
use crate::flights::{errors, has_statement, statements, Recorder};

/// The flights with statements of the one connection a `run` makes through the recorder.
fn statement_flights(
    env: &Env,
    rec: &Recorder,
    pooler: Option<&str>,
    command: &str,
) -> Vec<Vec<String>> {
    let mut c = env.command_at(&rec.url());
    if let Some(p) = pooler {
        c.env("LEASECTL_POOLER", p);
    }
    let o = c
        .args(["run", "--target", "t", "--", "sh", "-c", command])
        .output_in_time();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let conns = rec.flights();
    assert_eq!(conns.len(), 1, "one connection: {conns:?}");
    conns[0]
        .iter()
        .filter(|f| has_statement(f))
        .map(|f| {
            statements(f)
                .into_iter()
                .map(|s| s.trim_end_matches('\0').to_owned())
                .collect()
        })
        .collect()
}

/// A `run` on a current schema, with the session known to be direct (`LEASECTL_POOLER=none`):
/// the schema check, the acquisition and the LISTEN go in one flight, the fenced save in a
/// last one. (Before, the check, the acquisition, the LISTEN and the save each waited for the
/// answer before them: four.) As the command starts, the save is prepared (its lock waits
/// bounded, the plan cache told to keep a generic plan); while the command runs, it is planned
/// by executing it once with every parameter NULL — two flights whose answers nothing on the
/// path from the command's exit to leasectl's waits for — and the save only executes the plan.
#[test]
fn a_plain_run_makes_two_flights_of_statements() {
    let env = Env::new();
    // The schema's first use migrates it, on a path of its own.
    let o = env.run(&["run", "--target", "t", "--", "true"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let rec = Recorder::start();
    let flights = statement_flights(&env, &rec, Some("none"), "sleep 0.3");
    assert_eq!(flights.len(), 4, "{flights:#?}");
    let first = flights[0].join("\n");
    // The schema is checked by its marker: the ledger itself is not read.
    assert!(!first.contains("schema_migrations"), "{first}");
    for part in [
        "BEGIN",
        "leasectl_ledger_v",
        "INSERT INTO",
        "LISTEN",
        "COMMIT",
    ] {
        assert!(
            first.contains(part),
            "{part} is not in the first flight: {first}"
        );
    }
    // Waiting for a lock on a table it names no longer than 10 ms, the session's own
    // lock_timeout restored after the plan.
    assert!(
        flights[1].len() == 2
            && flights[1][0]
                == "SET lock_timeout = '10ms'; SET plan_cache_mode = force_generic_plan"
            && flights[1][1].starts_with("WITH owner AS"),
        "the save is prepared as the command starts: {flights:#?}"
    );
    // The plain save: it reads none of the command's own events and renews no step's lease.
    for full_only in ["jsonb_array_elements", "$26", "$27"] {
        assert!(!flights[1][1].contains(full_only), "{}", flights[1][1]);
    }
    let planned = &flights[2];
    assert!(
        planned.len() == 3
            && planned[0] == "SET leasectl.outbox_notified = 'on'"
            && planned[1].starts_with("BIND s")
            && planned[2] == "RESET lock_timeout; RESET leasectl.outbox_notified",
        "the save is planned while the command runs: {flights:#?}"
    );
    // The save executes the statement planned ahead, and resets the plan cache mode.
    assert_eq!(
        flights[3],
        vec![planned[1].clone(), "RESET plan_cache_mode".to_owned()],
        "{flights:#?}"
    );
    // The plan was made, not refused: the server answered nothing on this connection with an
    // error (a plan that fails would only cost, and say so nowhere else).
    let answers = rec.answers();
    assert_eq!(answers.len(), 1);
    assert!(
        answers[0].iter().any(|(k, _)| *k == b'T'),
        "no rows described"
    );
    assert_eq!(errors(&answers[0]), Vec::<String>::new());
    // And the lease was released: the next run gets it at once.
    let o = env.run(&["run", "--target", "t", "--", "true"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

/// A command that is over before the save's preparation is answered is saved at once: the save
/// plans itself as it executes, one flight sooner than a plan of its own would leave it.
#[test]
fn a_command_over_at_once_is_saved_without_a_plan_ahead() {
    let env = migrated();
    // The command writes its pid and exits; the answers to the save's preparation (sent with
    // `plan_cache_mode`) reach leasectl only once the command has exited — whatever the
    // machine's speed, the order a command of a millisecond or two would usually see.
    let pid_file = env.path("pid");
    let watched = pid_file.clone();
    let rec = Recorder::holding("force_generic_plan", move || {
        let Some(pid) = std::fs::read_to_string(&watched)
            .ok()
            .and_then(|p| p.trim().parse::<u32>().ok())
        else {
            return false;
        };
        // Exited: a zombie not yet reaped, or gone.
        std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
            stat.rsplit_once(") ")
                .is_some_and(|(_, r)| r.starts_with('Z'))
        })
    });
    let command = format!("echo $$ > '{}'; exit 0", pid_file.display());
    let flights = statement_flights(&env, &rec, Some("none"), &command);
    let sent: Vec<&String> = flights.iter().flatten().collect();
    assert!(
        !sent
            .iter()
            .any(|s| s.starts_with("SET leasectl.outbox_notified")),
        "no plan by execution: {flights:#?}"
    );
    // The save is the last flight, or ends it: the reset of the lock timeout, whose answer
    // nothing waits for, may still be in the same one.
    let last = &flights[flights.len() - 1];
    let save = &last[last.len().saturating_sub(2)..];
    assert!(
        save.len() == 2
            && save[0].starts_with("BIND s")
            && save[1] == "RESET plan_cache_mode"
            && last[..last.len() - 2]
                .iter()
                .all(|s| s == "RESET lock_timeout"),
        "the save executes the prepared statement: {flights:#?}"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM runs"), "1");
}

/// A command that writes events of its own: the plain save planned ahead stores the run and
/// releases the lease, and the command's events follow in the same transaction — `BEGIN`, the
/// plan, the events' `INSERT`, `COMMIT` and the plan cache mode's reset in one flight, not the
/// full text sent unplanned, whose parse and plan a fresh server process would pay after the
/// command. The events are stored after the run's, in the file's order, and nothing is
/// answered with an error.
#[test]
fn a_command_with_events_of_its_own_is_saved_by_the_plan_and_one_insert_in_one_transaction() {
    let env = migrated();
    let rec = Recorder::start();
    let emit = |id: &str| {
        format!(
            "printf '%s\\n' '{{\"aggregate_type\":\"export\",\"aggregate_id\":\"{id}\",\"type\":\"export.ready\",\"payload\":1}}' >> \"$LEASECTL_EVENTS\""
        )
    };
    let command = format!("{} && {} && sleep 0.3", emit("a"), emit("b"));
    let flights = statement_flights(&env, &rec, Some("none"), &command);
    let planned = &flights[1][1];
    assert!(
        planned.starts_with("WITH owner AS") && !planned.contains("jsonb_array_elements"),
        "the plain save is planned ahead: {flights:#?}"
    );
    let last = &flights[flights.len() - 1];
    assert!(
        last.len() == 5
            && last[0] == "BEGIN"
            && last[1].starts_with("BIND s")
            && last[2].starts_with("INSERT INTO")
            && last[2].contains("jsonb_array_elements")
            && last[3] == "COMMIT"
            && last[4] == "RESET plan_cache_mode",
        "the plan, then the events, in one transaction: {flights:#?}"
    );
    let answers = rec.answers();
    for answer in &answers {
        assert_eq!(errors(answer), Vec::<String>::new());
    }
    assert_eq!(
        env.scalar("SELECT string_agg(aggregate_id, ' ' ORDER BY seq) FROM outbox"),
        "t a b"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM runs"), "1");
    assert_eq!(
        env.scalar("SELECT count(*) FROM leases WHERE token IS NULL"),
        "1"
    );
}

/// The busy answer of a caller that does not wait: after the acquisition's flight, one more
/// with two plain statements (the target's lease rows, the count of its waiters) and not the
/// queue's full statement, whose planning a fresh server process pays about 3 ms for.
#[test]
fn a_busy_answer_reads_the_lease_and_the_queue_in_one_flight_of_two_plain_statements() {
    let env = migrated();
    let holder = env.spawn(&["run", "--target", "t", "--", "sleep", "30"]);
    wait_for("the holder to hold", || {
        env.scalar("SELECT count(*) FROM leases WHERE token IS NOT NULL") == "1"
    });
    let rec = Recorder::start();
    let o = env
        .command_at(&rec.url())
        .env("LEASECTL_POOLER", "none")
        .args(["run", "--target", "t", "--", "true"])
        .output_in_time();
    assert_eq!(code(&o), 75, "{}", stderr(&o));
    assert!(
        stderr(&o).contains(&format!("pid {}", holder.id())),
        "{}",
        stderr(&o)
    );
    let conns = rec.flights();
    assert_eq!(conns.len(), 1, "one connection: {conns:?}");
    let flights: Vec<Vec<String>> = conns[0]
        .iter()
        .filter(|f| has_statement(f))
        .map(|f| statements(f))
        .collect();
    assert_eq!(flights.len(), 2, "{flights:#?}");
    let answer = &flights[1];
    assert!(
        answer.len() == 2
            && answer[0].starts_with("SELECT l.token IS NOT NULL AS held")
            && answer[1].starts_with("SELECT count(*) AS waiting"),
        "{flights:#?}"
    );
    for answers in rec.answers() {
        assert_eq!(errors(&answers), Vec::<String>::new());
    }
    kill(holder.id(), libc::SIGTERM);
    let _ = finish(holder);
}

/// Where the pooler is detected (the default), the first flight's check tells whether the
/// session is direct, so the LISTEN cannot go with it unless the database decides — a DO
/// block, whose PL/pgSQL costs a fresh server process more than the rest of the flight. The
/// flight has the check, the acquisition and COMMIT and no DO; the heartbeat LISTENs while
/// the command runs.
#[test]
fn a_detecting_run_listens_while_the_command_runs() {
    let env = migrated();
    let rec = Recorder::start();
    let flights = statement_flights(&env, &rec, None, "sleep 0.5");
    let first = flights[0].join("\n");
    for part in ["BEGIN", "leasectl_ledger_v", "INSERT INTO", "COMMIT"] {
        assert!(
            first.contains(part),
            "{part} is not in the first flight: {first}"
        );
    }
    assert!(
        !first.contains("LISTEN") && !first.contains("DO $"),
        "{first}"
    );
    // The save's preparation goes first, as the command starts, then its plan; the LISTEN
    // while the command runs; the save last.
    let (during, save) = (&flights[1..flights.len() - 1], &flights[flights.len() - 1]);
    let during: Vec<&String> = during.iter().flatten().collect();
    assert!(
        during.len() == 6
            && during[0].starts_with("SET lock_timeout")
            && during[1].starts_with("WITH owner AS")
            && during[2].starts_with("SET leasectl.outbox_notified")
            && during[3].starts_with("BIND s")
            && during[4].starts_with("RESET lock_timeout")
            && during[5].starts_with("LISTEN"),
        "no plan and LISTEN while the command ran: {flights:#?}"
    );
    assert_eq!(save[0], *during[3], "{flights:#?}");
}

/// Behind a transaction-mode pooler (here: said so with `LEASECTL_POOLER`) no LISTEN is sent,
/// in the first flight or later, and the save is not planned ahead: two flights.
#[test]
fn a_pooled_run_sends_no_listen() {
    let env = migrated();
    let rec = Recorder::start();
    let flights = statement_flights(&env, &rec, Some("transaction"), "sleep 0.3");
    assert_eq!(flights.len(), 2, "{flights:#?}");
    // Nor a plan of the save: the pooler may hand the next statement to another server
    // process.
    assert!(
        !flights.iter().flatten().any(|s| s.contains("LISTEN")
            || s.starts_with("BIND")
            || s.contains("plan_cache_mode")),
        "{flights:#?}"
    );
}

/// On a schema that is not current (here: not there at all), the first flight takes nothing:
/// the check fails, the transaction rolls back, and the run migrates and acquires on the old
/// path — and succeeds.
#[test]
fn a_run_on_a_missing_schema_migrates_then_acquires() {
    let env = Env::new();
    let rec = Recorder::start();
    let flights = statement_flights(&env, &rec, None, "true");
    assert!(flights.len() > 2, "{flights:#?}");
    let o = env.run(&["run", "--target", "t", "--", "true"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
}

/// `n` events of 5 aggregates in a migrated schema, drained by `relay --once --batch 10` to
/// stdout through the recorder: the schema, the recorder and the relay's output (exit 0).
fn drain_recorded(n: usize) -> (Env, Recorder, std::process::Output) {
    let env = migrated();
    crate::events::insert_events(&env, n, 5, 1);
    let rec = Recorder::start();
    let o = rec.relay_once(&env);
    (env, rec, o)
}

/// Every statement a relay sent through `rec`, in order.
fn sent(rec: &Recorder) -> Vec<String> {
    rec.flights()
        .iter()
        .flatten()
        .flat_map(|f| statements(f))
        .collect()
}

/// A relay's batch commits without waiting for the WAL flush: the flight that ends each
/// batch is `SET LOCAL synchronous_commit = off` and `COMMIT` together (the deletion of
/// delivered events is all a lost commit could undo, and that only republishes them), and
/// every event still comes out once.
#[test]
fn a_relay_commits_its_batches_without_waiting_for_the_flush() {
    let (env, rec, o) = drain_recorded(25);
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().count(), 25);
    // Each batch's claim flight (BEGIN with the planner settings) is followed by its commit.
    let statements = sent(&rec);
    let batches = statements
        .iter()
        .filter(|s| s.contains("SET LOCAL enable_seqscan = off"))
        .count();
    let unflushed = statements
        .iter()
        .filter(|s| s.contains("SET LOCAL synchronous_commit = off; COMMIT"))
        .count();
    assert!(batches >= 3, "batches of 10 of 25 events: {statements:#?}");
    assert!(
        unflushed >= 3,
        "{unflushed} of the batches committed without waiting for the flush: {statements:#?}"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM outbox"), "0");
}

/// A full batch whose events were all delivered does not wait for its COMMIT's answer: the
/// COMMIT and the next batch's claim (its BEGIN with the planner settings) go out in one
/// flight, and every event still comes out once.
#[test]
fn a_full_batchs_commit_goes_out_with_the_next_claim() {
    let (env, rec, o) = drain_recorded(60);
    let lines: Vec<String> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(str::to_owned)
        .collect();
    let unique: std::collections::HashSet<&String> = lines.iter().collect();
    assert_eq!((lines.len(), unique.len()), (60, 60));
    let conns = rec.flights();
    let together = conns
        .iter()
        .flatten()
        .map(|f| statements(f).join("\n"))
        .filter(|f| {
            f.contains("SET LOCAL synchronous_commit = off; COMMIT")
                && f.contains("SET LOCAL enable_seqscan = off")
        })
        .count();
    // Six full batches, one connection (stdout never claims ahead). The upkeep after the
    // first batch goes out with its commit; from the second on, each commit goes out with
    // the next claim, the last one's with the claim that finds the outbox empty: five. (One
    // fewer where a health evaluation, due once a second, comes between two batches.)
    assert!(
        together >= 4,
        "{together} commits went out with the next claim: {conns:#?}"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM outbox"), "0");
}

/// With no expectation and no open incident there is nothing for the relay's health evaluation
/// to look at: the statement that takes its lock (in one flight with its BEGIN) says so, and the
/// evaluation itself (a statement whose planning in a fresh server process is the dearest part of
/// a relay's start) is not sent. Once a target is watched, it is.
#[test]
fn a_relay_with_nothing_watched_skips_the_health_evaluation() {
    let (env, rec, o) = drain_recorded(5);
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().count(), 5);
    let evaluation = |s: &String| s.contains("schedule_tz");
    let flights: Vec<Vec<String>> = rec
        .flights()
        .iter()
        .flatten()
        .map(|f| statements(f))
        .collect();
    let begun_and_locked = flights.iter().any(|f| {
        f.first().is_some_and(|s| s.starts_with("BEGIN"))
            && f.iter().any(|s| s.contains("leasectl.health:"))
    });
    assert!(
        begun_and_locked,
        "the evaluation's BEGIN and lock in one flight: {flights:#?}"
    );
    let statements = sent(&rec);
    assert!(
        !statements.iter().any(evaluation),
        "nothing is watched: {statements:#?}"
    );

    let o = env.run(&["expect", "--target", "nightly", "--every", "1h"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let rec = Recorder::start();
    rec.relay_once(&env);
    let statements = sent(&rec);
    assert!(
        statements.iter().any(evaluation),
        "'nightly' is watched: {statements:#?}"
    );
}

/// A relay's claim statements are prepared once per connection, and those a claim needs that
/// are not prepared yet go out together: the first claim's (the general claim and the idle
/// timeout's) in one flight, the first plain claim's (the claim and the read of its verdict) in
/// another, instead of a round trip each.
#[test]
fn a_relays_claim_statements_are_prepared_together() {
    let (_env, rec, _) = drain_recorded(30);
    let flights: Vec<String> = rec
        .flights()
        .iter()
        .flatten()
        .map(|f| statements(f).join("\n"))
        .collect();
    let with = |parts: &[&str]| flights.iter().any(|f| parts.iter().all(|p| f.contains(p)));
    let claim = "WITH win1 AS MATERIALIZED";
    assert!(
        with(&[claim, "set_config('idle_in_transaction_session_timeout'"]),
        "the general claim and the idle timeout's statement: {flights:#?}"
    );
    assert!(
        with(&[claim, "o.ctid", "current_setting('leasectl.plain_claim'"]),
        "the plain claim and the read of its verdict: {flights:#?}"
    );
}
