//! Connecting: a silent server never hangs a command (connect_timeout covers everything up to a
//! ready session, per host; one-shot commands have a deadline after that), the error shown is
//! the server's when one answered, and service and password files are read as psql reads them.
//!
//! The silent servers are TCP listeners in the test; the tests that need the real server reach
//! it over the local socket, as the default test database does.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;

/// Far above the 2s timeouts the tests set, far below the 30s+ a hang would take.
const BOUND: Duration = Duration::from_secs(15);

/// A TCP server that accepts every connection and never says a word. Returns its port.
fn silent_server() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming().flatten() {
            held.push(conn);
        }
    });
    port
}

/// The local server's socket, where the test database lives.
fn local_socket() -> String {
    ["/var/run/postgresql", "/tmp"]
        .iter()
        .map(|d| format!("{d}/.s.PGSQL.5432"))
        .find(|p| std::path::Path::new(p).exists())
        .expect("a local PostgreSQL socket")
}

/// The test database's URL with more `key=value` parameters (the key=value form only, as the
/// default test database URL is).
fn with_params(env: &Env, params: &str) -> String {
    assert!(
        !env.url.contains("://"),
        "these tests need a key=value test database URL"
    );
    format!("{} {params}", env.url)
}

/// leasectl with none of the libpq environment inherited.
fn bare(env: &Env) -> Command {
    let mut c = Command::new(bin());
    for var in [
        "DATABASE_URL",
        "PGHOST",
        "PGPORT",
        "PGUSER",
        "PGDATABASE",
        "PGPASSWORD",
        "PGSERVICE",
        "PGSERVICEFILE",
        "PGPASSFILE",
        "PGCONNECT_TIMEOUT",
        "LEASECTL_STATEMENT_TIMEOUT",
    ] {
        c.env_remove(var);
    }
    c.args(["--schema", &env.schema])
        .current_dir(env.dir.path());
    c
}

/// Runs `cmd`, failing the test if it outlives twice [`BOUND`]; returns output and duration.
fn timed(cmd: &mut Command) -> (std::process::Output, Duration) {
    let start = Instant::now();
    let out = cmd.output_within(2 * BOUND);
    (out, start.elapsed())
}

#[test]
fn a_server_that_accepts_and_never_answers_fails_within_connect_timeout() {
    let env = Env::new();
    let port = silent_server();
    let at = format!("127.0.0.1:{port}");
    let url = format!("postgres://x@{at}/y");
    let (out, took) =
        timed(
            bare(&env)
                .env("PGCONNECT_TIMEOUT", "2")
                .args(["--database-url", &url, "status"]),
        );
    assert_one_line_error(
        &out,
        69,
        &format!("at {at} as user \"x\", database \"y\": no answer within 2s"),
    );
    assert!(took < BOUND, "PGCONNECT_TIMEOUT=2 took {took:?}");

    let url = format!("postgres://x@{at}/y?connect_timeout=2");
    let (out, took) = timed(bare(&env).args(["--database-url", &url, "status"]));
    assert_one_line_error(&out, 69, &format!("{at} as user \"x\""));
    assert!(took < BOUND, "connect_timeout=2 took {took:?}");
}

#[test]
fn a_silent_host_listed_first_gives_way_to_the_next() {
    let env = Env::new();
    let port = silent_server();
    let socket_dir = local_socket().rsplit_once('/').unwrap().0.to_owned();
    let url = with_params(
        &env,
        &format!("host=127.0.0.1,{socket_dir} port={port},5432 connect_timeout=2"),
    );
    let (out, took) = timed(
        bare(&env)
            .args(["--database-url", &url, "status", "--json"])
            .stdin(std::process::Stdio::null()),
    );
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(took < BOUND, "took {took:?}");

    // Both silent: the line says what happened at each.
    let other = silent_server();
    let url =
        format!("host=127.0.0.1,127.0.0.1 port={port},{other} user=x dbname=y connect_timeout=2");
    let (out, _) = timed(bare(&env).args(["--database-url", &url, "status"]));
    assert_one_line_error(
        &out,
        69,
        &format!("127.0.0.1:{port}: no answer within 2s; 127.0.0.1:{other}: no answer within 2s"),
    );
}

#[test]
fn the_servers_refusal_is_reported_not_a_later_socket_dirs_io_error() {
    let env = Env::new();
    let ghost = format!("ghost_{}", env.schema);
    let out = bare(&env)
        .env("PGUSER", &ghost)
        .arg("status")
        .output_in_time();
    assert_one_line_error(&out, 69, &format!("role \"{ghost}\" does not exist"));
    assert!(!stderr(&out).contains("No such file"), "{}", stderr(&out));

    let nodb = format!("nosuchdb_{}", env.schema);
    let out = bare(&env)
        .env("PGDATABASE", &nodb)
        .arg("status")
        .output_in_time();
    assert_one_line_error(&out, 69, &format!("database \"{nodb}\" does not exist"));
}

/// A TCP proxy to the local server that relays the startup and, once the server says it is
/// ready for queries, relays nothing more (a server, or the path to it, gone silent). Returns
/// its port.
fn proxy_going_silent_after_startup() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let socket = local_socket();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for client in listener.incoming().flatten() {
            let server = UnixStream::connect(&socket).unwrap();
            let cut = Arc::new(AtomicBool::new(false));
            let (mut c_in, mut s_out) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            let up_cut = cut.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 8192];
                while let Ok(n) = c_in.read(&mut buf) {
                    if n == 0
                        || up_cut.load(Ordering::SeqCst)
                        || s_out.write_all(&buf[..n]).is_err()
                    {
                        break;
                    }
                }
            });
            let (mut s_in, mut c_out) = (server.try_clone().unwrap(), client.try_clone().unwrap());
            std::thread::spawn(move || {
                let (mut seen, mut buf) = (Vec::new(), [0u8; 8192]);
                while let Ok(n) = s_in.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    seen.extend_from_slice(&buf[..n]);
                    // ReadyForQuery: 'Z', length 5. Cut before the client can send a query.
                    let ready = seen.windows(5).any(|w| w == b"Z\0\0\0\x05");
                    if ready {
                        cut.store(true, Ordering::SeqCst);
                    }
                    if c_out.write_all(&buf[..n]).is_err() || ready {
                        break;
                    }
                }
            });
            held.push((client, server));
        }
    });
    port
}

#[test]
fn a_one_shot_command_on_a_server_gone_silent_after_startup_exits_69() {
    let env = Env::new();
    let port = proxy_going_silent_after_startup();
    let url = with_params(
        &env,
        &format!("host=127.0.0.1 port={port} connect_timeout=2"),
    );
    let (out, took) = timed(bare(&env).env("LEASECTL_STATEMENT_TIMEOUT", "2s").args([
        "--database-url",
        &url,
        "status",
    ]));
    assert_one_line_error(
        &out,
        69,
        &format!("no answer from PostgreSQL at 127.0.0.1:{port}"),
    );
    assert!(took < BOUND, "took {took:?}");
    // The session was ready: it is the statement deadline, not connecting, that ended it.
    assert!(
        stderr(&out).contains("LEASECTL_STATEMENT_TIMEOUT"),
        "{}",
        stderr(&out)
    );

    // run and relay bound their own statements, and their connection and schema check too.
    for args in [
        &["run", "--target", "t", "--", "true"][..],
        &["relay", "--once", "--sink", "stdout"][..],
    ] {
        let (out, took) = timed(
            bare(&env)
                .env("LEASECTL_STATEMENT_TIMEOUT", "2s")
                .args(["--database-url", &url])
                .args(args),
        );
        assert_one_line_error(
            &out,
            69,
            &format!("no answer from PostgreSQL at 127.0.0.1:{port}"),
        );
        assert!(took < BOUND, "{args:?} took {took:?}");
    }

    let out = bare(&env)
        .env("LEASECTL_STATEMENT_TIMEOUT", "soon")
        .args(["--database-url", &url, "status"])
        .output_in_time();
    assert_one_line_error(&out, 2, "LEASECTL_STATEMENT_TIMEOUT");
}

/// The test database's name, from its key=value URL.
fn test_dbname(env: &Env) -> String {
    leasectl::db::conninfo::parse_key_values(&env.url)
        .unwrap()
        .into_iter()
        .find(|(k, _)| k == "dbname")
        .map(|(_, v)| v)
        .expect("a dbname in the test database URL")
}

#[test]
fn a_service_file_names_the_database_and_beats_the_environment() {
    let env = Env::new();
    let file = env.path("services.conf");
    std::fs::write(
        &file,
        format!("# test\n[leasectl_it]\ndbname={}\n", test_dbname(&env)),
    )
    .unwrap();
    // PGDATABASE alone would fail: the service's dbname wins over it, as in libpq.
    let nodb = format!("nosuchdb_{}", env.schema);
    let out = bare(&env)
        .env("PGSERVICEFILE", &file)
        .env("PGSERVICE", "leasectl_it")
        .env("PGDATABASE", &nodb)
        .args(["status", "--json"])
        .output_in_time();
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert_eq!(
        env.scalar("SELECT count(*) > 0 FROM schema_migrations"),
        "t"
    );

    let out = bare(&env)
        .env("PGSERVICEFILE", &file)
        .env("PGDATABASE", &nodb)
        .args(["--database-url", "service=leasectl_it", "status"])
        .output_in_time();
    assert_eq!(code(&out), 0, "{}", stderr(&out));

    let out = bare(&env)
        .env("PGSERVICEFILE", &file)
        .args(["--database-url", "service=nope", "status"])
        .output_in_time();
    assert_one_line_error(&out, 2, "definition of service \"nope\" not found");
}

#[test]
fn a_password_file_others_can_read_is_ignored_with_libpqs_warning() {
    use std::os::unix::fs::PermissionsExt;
    let env = Env::new();
    let file = env.path("pgpass");
    std::fs::write(&file, "*:*:*:*:unused\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = bare(&env)
        .env("PGPASSFILE", &file)
        .args(["--database-url", &env.url, "status"])
        .output_in_time();
    assert_eq!(code(&out), 0, "{}", stderr(&out));
    assert!(
        stderr(&out).contains("has group or world access"),
        "{}",
        stderr(&out)
    );
}

/// A session the server ended — for sitting idle in a transaction — or a write refused as
/// read-only (a demoted primary) means "reconnect", not a bug: the relay reconnects on these
/// and a one-shot command exits 69, never 70.
#[test]
fn a_session_ended_for_idling_in_a_transaction_and_a_read_only_refusal_count_as_unavailable() {
    let env = Env::new();
    let direct = env.direct_conninfo();
    crate::common::runtime().block_on(async {
        // The server sends its idle-in-transaction FATAL unasked; a relay stopped in a batch
        // reads it as the answer to its next statement. The same error, raised on purpose:
        let (client, connection) = tokio_postgres::connect(&direct, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        let err = client
            .batch_execute(
                "DO $$ BEGIN RAISE EXCEPTION 'terminating connection due to idle-in-transaction timeout'
                              USING ERRCODE = 'idle_in_transaction_session_timeout'; END $$",
            )
            .await
            .expect_err("raised");
        assert_eq!(
            err.code(),
            Some(&tokio_postgres::error::SqlState::IDLE_IN_TRANSACTION_SESSION_TIMEOUT),
            "{err}"
        );
        assert!(leasectl::db::is_unavailable(&err), "{err:?}");

        // What a write meets on a demoted primary, as a read-only session meets it here.
        client
            .batch_execute("SET default_transaction_read_only = on")
            .await
            .unwrap();
        let err = client
            .batch_execute("CREATE TABLE public.leasectl_read_only_probe (x int)")
            .await
            .expect_err("a write in a read-only transaction");
        assert_eq!(
            err.code(),
            Some(&tokio_postgres::error::SqlState::READ_ONLY_SQL_TRANSACTION)
        );
        assert!(leasectl::db::is_unavailable(&err), "{err:?}");
    });
}
