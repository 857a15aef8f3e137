//! Database faults during a run: a dropped connection is survived, a database that stops
//! answering makes the holder stop its command before the lease can expire.

use std::time::Duration;

use leasectl::db::Settings;

use crate::common::*;

/// A leasectl whose connections carry an application_name of their own, so a test can cut
/// exactly its connections (the way a network blip or a server restart would).
struct Named {
    name: String,
    url: String,
}

impl Named {
    fn new(env: &Env, prefix: &str) -> Named {
        let name = format!("{prefix}_{}", env.schema);
        let url = if env.url.contains("://") {
            let sep = if env.url.contains('?') { '&' } else { '?' };
            format!("{}{sep}application_name={name}", env.url)
        } else {
            format!("{} application_name={name}", env.url)
        };
        Named { name, url }
    }

    fn command(&self, env: &Env) -> std::process::Command {
        env.command_at(&self.url)
    }

    /// Terminates this leasectl's one database connection.
    fn cut(&self, env: &Env) {
        let sql = format!(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = '{}'",
            self.name
        );
        assert_eq!(
            env.scalar(&sql),
            "1",
            "expected exactly one connection named {}",
            self.name
        );
    }
}

#[test]
fn a_dropped_connection_is_reconnected_and_the_job_keeps_its_lease() {
    let env = Env::new();
    let named = Named::new(&env, "hb");
    let script = format!("{}; echo finished", env.gate());
    let holder = Watched::new(env.hold_with(named.command(&env), "h", &["--ttl", "2s"], &script));
    named.cut(&env);
    holder.wait_for_stderr("recovered after");
    // The lease is still held and being renewed.
    let before = env.scalar("SELECT heartbeat_at FROM leases");
    wait_for("another heartbeat", || {
        env.scalar("SELECT heartbeat_at FROM leases") != before
    });
    env.open_gate();
    let o = holder.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(stdout(&o), "finished\n");
    assert_eq!(env.scalar("SELECT outcome FROM runs"), "completed");
}

#[test]
fn a_database_that_stops_answering_makes_the_holder_stop_its_command_before_the_ttl() {
    let env = Env::new();
    let pidfile = env.path("pid");
    let ttl = Duration::from_secs(2);
    let holder = Watched::new(env.spawn(&[
        "run",
        "--target",
        "d",
        "--ttl",
        "2s",
        "--",
        "sh",
        "-c",
        &format!("echo $$ > '{}'; exec sleep 60", pidfile.display()),
    ]));
    let child: i32 = wait_for_file(&pidfile).parse().unwrap();

    let rt = runtime();
    rt.block_on(async {
        let mut client = Settings::new(Some(&env.url)).unwrap().open_client().await.unwrap();
        let tx = client.transaction().await.unwrap();
        // Holding the lease row's lock makes every heartbeat hang, as a stuck server would.
        let q = format!("SELECT heartbeat_at::text FROM \"{}\".leases WHERE target = 'd' FOR UPDATE", env.schema);
        let last_heartbeat: String = tx.query_one(&q, &[]).await.unwrap().get(0);
        while alive(child) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Both instants on the database clock: the command died before the lease could expire.
        let q = format!("SELECT now()::timestamptz - '{last_heartbeat}'::timestamptz < interval '{} milliseconds', (clock_timestamp() - '{last_heartbeat}'::timestamptz)::text", ttl.as_millis());
        let row = tx.query_one(&q.replace("now()", "clock_timestamp()"), &[]).await.unwrap();
        let (in_time, age): (bool, String) = (row.get(0), row.get(1));
        assert!(in_time, "the command was still alive {age} after the last heartbeat (ttl {ttl:?})");
        tx.rollback().await.unwrap();
    });
    let o = holder.finish();
    assert_eq!(code(&o), 76, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("heartbeat for 'd' failed"),
        "{}",
        stderr(&o)
    );
    assert_eq!(env.scalar("SELECT outcome FROM runs"), "lost");
    assert_eq!(env.scalar("SELECT count(*) FROM outbox"), "0");
}

/// A lock held elsewhere on the outbox for longer than the TTL (an application's migration, a
/// `VACUUM FULL`) holds up the save, as it must, but not the heartbeats: the command runs to
/// its end and its result is stored once the lock is gone. Before, the save's plan, sent as
/// the command started, waited for that lock with the heartbeats queued behind it on the same
/// connection, and the command was stopped when the lease expired (exit 76).
#[test]
fn a_lock_held_on_the_outbox_holds_up_the_save_not_the_heartbeats() {
    let env = Env::new();
    assert_eq!(code(&env.run(&["migrate"])), 0);
    let done = env.path("done");
    let rt = runtime();
    rt.block_on(async {
        let mut client = Settings::new(Some(&env.direct_url))
            .unwrap()
            .open_client()
            .await
            .unwrap();
        let tx = client.transaction().await.unwrap();
        let lock = format!(
            "LOCK TABLE \"{}\".outbox IN ACCESS EXCLUSIVE MODE",
            env.schema
        );
        tx.batch_execute(&lock).await.unwrap();
        // Three seconds of command against a two-second TTL: heartbeats must get through.
        let mut holder = env.spawn(&[
            "run",
            "--target",
            "locked",
            "--ttl",
            "2s",
            "--",
            "sh",
            "-c",
            &format!("sleep 3; touch '{}'", done.display()),
        ]);
        let started = std::time::Instant::now();
        while !done.exists() && holder.try_wait().unwrap().is_none() {
            assert!(
                started.elapsed() < PATIENCE,
                "the command neither ended nor was stopped"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // The save waits for the lock until it is given up.
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            holder.try_wait().unwrap().is_none(),
            "leasectl exited while the outbox was locked"
        );
        tx.rollback().await.unwrap();
        let o = holder.wait_with_output().unwrap();
        assert_eq!(code(&o), 0, "{}", stderr(&o));
        assert!(done.exists(), "the command was stopped: {}", stderr(&o));
    });
    assert_eq!(env.scalar("SELECT outcome FROM runs"), "completed");
    assert_eq!(env.scalar("SELECT count(*) FROM outbox"), "1");
}

#[test]
fn a_waiter_survives_losing_its_connection_and_still_gets_the_lease() {
    let env = Env::new();
    let named = Named::new(&env, "w");
    let holder = env.hold("wl", &env.gate());
    let waiter = Watched::new(
        named
            .command(&env)
            .args([
                "run",
                "-v",
                "--target",
                "wl",
                "--wait",
                "--",
                "sh",
                "-c",
                "echo waited-$LEASECTL_FENCE",
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    waiter.wait_for_stderr("waiting for 'wl'");
    named.cut(&env);
    waiter.wait_for_stderr("lost the database while waiting");
    env.open_gate();
    assert_eq!(code(&finish(holder)), 0);
    let o = waiter.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(stdout(&o), "waited-2\n");
}

#[test]
fn a_connection_lost_before_the_save_is_reconnected_and_the_result_stored_once() {
    let env = Env::new();
    let named = Named::new(&env, "s");
    // A long TTL: no heartbeat happens during the run, so the save is the first to notice.
    let script = format!("{}; echo result", env.gate());
    let holder = Watched::new(env.hold_with(named.command(&env), "sv", &["--ttl", "1m"], &script));
    named.cut(&env);
    env.open_gate();
    let o = holder.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(stderr(&o).contains("retrying"), "{}", stderr(&o));
    assert_eq!(
        env.scalar("SELECT outcome || ':' || convert_from(stdout, 'UTF8') FROM runs"),
        "completed:result\n"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM outbox"), "1");
    assert_eq!(env.status()["targets"][0]["state"], "free");
}

/// TLS against the real server over TCP. Needs `ssl = on` (Debian's default, with its
/// snakeoil certificate) and password-less TCP login for the current user; a server without
/// either is reported on stderr and the test ends early — a server setting, not a service.
#[test]
fn tls_is_used_when_required_and_an_unverifiable_certificate_is_refused() {
    let env = Env::new();
    if env.url.contains("://") || env.url.contains("host=") {
        eprintln!("TLS test skipped: LEASECTL_TEST_DATABASE_URL names its own host");
        return;
    }
    let tcp = format!("{} host=127.0.0.1", env.url);
    let probe = env
        .command_at(&format!("{tcp} sslmode=require"))
        .args(["migrate"])
        .output_in_time();
    if code(&probe) != 0 {
        eprintln!("TLS test skipped: no TLS over TCP here: {}", stderr(&probe));
        return;
    }
    let named = format!("tls_{}", env.schema);
    let holder = env.hold_with(
        env.command_at(&format!("{tcp} sslmode=require application_name={named}")),
        "tls",
        &[],
        &env.gate(),
    );
    let ssl = env.scalar(&format!(
        "SELECT bool_and(s.ssl)::text FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) WHERE a.application_name = '{named}'"
    ));
    assert_eq!(ssl, "true", "the holder's connection is not encrypted");
    env.open_gate();
    assert_eq!(code(&finish(holder)), 0);

    // verify-full checks the certificate against the system roots and the host name; a
    // self-signed certificate for "localhost" passes neither.
    let refused = env
        .command_at(&format!("{tcp} sslmode=verify-full"))
        .args(["status"])
        .output_in_time();
    assert_one_line_error(&refused, 69, "certificate");
}

#[test]
fn a_relay_whose_connection_is_cut_reconnects_and_keeps_delivering() {
    let env = Env::new();
    assert_eq!(code(&env.run(&["migrate"])), 0);
    let named = Named::new(&env, "relay");
    let out = env.path("out.jsonl");
    let child = named
        .command(&env)
        .args(["-v", "relay", "--sink", "stdout", "--poll", "1h"])
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let relay = Watched::new(child);
    relay.wait_for_stderr("relaying schema");
    let insert = |n: i32| {
        env.sql(&format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, type, payload)
             VALUES ('order', '1', 'order.paid', '{{\"n\": {n}}}')"
        ));
    };
    insert(1);
    let lines = || {
        std::fs::read_to_string(&out)
            .unwrap_or_default()
            .lines()
            .count()
    };
    wait_for("the first event", || lines() == 1);
    named.cut(&env);
    insert(2);
    relay.wait_for_stderr("reconnected to the database");
    insert(3);
    wait_for("the events inserted around the cut", || lines() == 3);
    kill(relay.child.id(), libc::SIGTERM);
    let o = relay.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert!(
        stderr(&o).contains("database connection failed"),
        "{}",
        stderr(&o)
    );
    assert_eq!(env.scalar("SELECT count(*) FROM outbox"), "0");
}
