//! leasectl behind a transaction-mode pgbouncer: every command works, and nothing
//! of a leasectl session — a named prepared statement, a setting, a LISTEN — is left on the
//! server connection for the pool's next client.
//!
//! The suite's ordinary tests also run through the pooler (their `via_pooler` copies); these
//! tests use the pooler's `leasectl_test_single` database, whose pool has ONE server
//! connection, so consecutive clients surely share it.

use crate::common::*;

/// Runs SQL through `url` and returns the first column of every row.
fn column(url: &str, sql: &str) -> Vec<String> {
    let rt = runtime();
    rt.block_on(async {
        let client = leasectl::db::Settings::new(Some(url))
            .unwrap()
            .open_client()
            .await
            .unwrap();
        client
            .simple_query(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
            .into_iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
                _ => None,
            })
            .collect()
    })
}

#[test]
fn every_command_works_through_one_pooled_server_connection_and_leaves_it_clean() {
    let env = Env::new();
    let single = pooler_url("leasectl_test_single");
    let default_timeout = column(&env.direct_url, "SHOW statement_timeout");
    let commands: &[&[&str]] = &[
        &["migrate"],
        &["run", "--target", "p", "--", "echo", "pooled"],
        &[
            "run",
            "--target",
            "p",
            "--wait=5s",
            "--reuse-within",
            "1m",
            "--",
            "echo",
            "again",
        ],
        &["status"],
        &["status", "--json"],
        &["runs", "--target", "p"],
        &["output", "--target", "p"],
        &["release", "--target", "p", "--force"],
        &["outbox", "list"],
        &["relay", "--once", "--sink", "stdout"],
        &["prune", "--older-than", "1d"],
    ];
    // Twice over: the second client of the server connection meets whatever the first left.
    for round in 0..2 {
        for args in commands {
            let o = env.command_at(&single).args(*args).output_in_time();
            assert_eq!(
                code(&o),
                0,
                "round {round}: leasectl {} through the pooler: {}",
                args.join(" "),
                stderr(&o)
            );
        }
    }
    assert_eq!(
        env.scalar("SELECT count(*) FROM runs WHERE outcome = 'completed'"),
        "2",
        "one run per round: the --reuse-within run reused it"
    );
    // A waiter: without LISTEN it polls, and takes the lease once the holder is done.
    let holder = env.hold_with(env.command_at(&single), "w", &[], &env.gate());
    let waiter = env
        .command_at(&single)
        .args([
            "run",
            "--target",
            "w",
            "--wait=60s",
            "-v",
            "--",
            "echo",
            "mine",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let waiter = Watched::new(waiter);
    waiter.wait_for_stderr("waiting for 'w'");
    env.open_gate();
    assert_eq!(code(&finish(holder)), 0);
    let o = waiter.finish();
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    assert_eq!(stdout(&o), "mine\n");
    // What the pool's next client finds on the same server connection.
    let left = column(
        &single,
        "SELECT current_setting('statement_timeout') || ' ' ||
                (SELECT count(*) FROM pg_prepared_statements) || ' ' ||
                (SELECT count(*) FROM pg_listening_channels())",
    );
    assert_eq!(
        left,
        vec![format!("{} 0 0", default_timeout[0])],
        "statement_timeout, prepared statements and LISTENs left on the pooled server connection"
    );
}
