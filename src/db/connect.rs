//! Where the connection settings come from, and opening a connection.
//!
//! libpq's order: `--database-url` / `DATABASE_URL` (a URL or a `key=value` string), then
//! `PGHOST`, `PGPORT`, `PGUSER`, `PGPASSWORD`, `PGDATABASE`, `PGSSLMODE`, then the local socket
//! as the current OS user — what `psql` with no arguments reaches. Fields missing from a URL are
//! filled from the same environment. TLS is set up by [`super::tls`]. Also here: how a
//! tokio-postgres error reads in one line, and whether it means "unreachable" (exit 69).

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use tokio::sync::mpsc;
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, Config, Notification};

use super::tls;
use crate::error::Failure;

/// How long a connection attempt may take before the database counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Server-side limit on every statement, so a stuck lock cannot hold a statement past the
/// client's own deadline. Sent as a startup option (`-c statement_timeout=…`), which costs no
/// round trip and is the session's own state; a pooler that refuses startup options gets none
/// (see [`super::session`]).
pub(super) const STATEMENT_TIMEOUT: &str = "30s";
/// Socket directories tried when nothing names a host: Debian's, then the upstream default.
const DEFAULT_SOCKET_DIRS: [&str; 2] = ["/var/run/postgresql", "/tmp"];

/// Checked connection settings: a tokio-postgres config plus what we need for messages and TLS.
#[derive(Clone)]
pub struct Settings {
    config: Config,
    verify_tls: bool,
}

impl Settings {
    /// Builds the settings from `--database-url`/`DATABASE_URL` (if given) and the libpq
    /// environment. Never includes the password in an error.
    pub fn new(url: Option<&str>) -> Result<Settings> {
        Self::from_env(url, |k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    }

    fn from_env(url: Option<&str>, env: impl Fn(&str) -> Option<String>) -> Result<Settings> {
        let mut verify_tls = false;
        let mut config = match url.filter(|u| !u.trim().is_empty()) {
            Some(u) => {
                // tokio-postgres knows disable/prefer/require only; map libpq's verifying modes
                // onto "require" plus certificate verification done by our TLS connector.
                let (u, verify) = tls::strip_verify_sslmode(u);
                verify_tls = verify;
                u.parse::<Config>().map_err(|e| {
                    // The parse error never echoes the string, so no password can leak here.
                    Failure::Usage(format!("invalid --database-url / DATABASE_URL: {e}"))
                })?
            }
            None => Config::new(),
        };

        if config.get_hosts().is_empty() {
            match env("PGHOST") {
                Some(hosts) => {
                    for h in hosts.split(',').map(str::trim).filter(|h| !h.is_empty()) {
                        if h.starts_with('/') {
                            config.host_path(h);
                        } else {
                            config.host(h);
                        }
                    }
                }
                None => {
                    for dir in DEFAULT_SOCKET_DIRS {
                        if Path::new(dir).exists() {
                            config.host_path(dir);
                        }
                    }
                    if config.get_hosts().is_empty() {
                        config.host("localhost");
                    }
                }
            }
        }
        if config.get_ports().is_empty() {
            if let Some(p) = env("PGPORT") {
                let port = p
                    .parse::<u16>()
                    .map_err(|_| Failure::Usage(format!("PGPORT '{p}' is not a port number")))?;
                config.port(port);
            }
        }
        if config.get_user().is_none() {
            let user = env("PGUSER").or_else(current_os_user).ok_or_else(|| {
                Failure::Usage(
                    "no database user: set PGUSER or put a user in --database-url".into(),
                )
            })?;
            config.user(user);
        }
        if config.get_password().is_none() {
            if let Some(p) = env("PGPASSWORD") {
                config.password(p);
            }
        }
        if config.get_dbname().is_none() {
            if let Some(d) = env("PGDATABASE") {
                config.dbname(d);
            }
        }
        // Like libpq, PGSSLMODE applies unless the connection string names an sslmode itself.
        if !url.is_some_and(|u| u.contains("sslmode")) {
            if let Some(mode) = env("PGSSLMODE") {
                let (m, verify) = tls::parse_sslmode(&mode)?;
                config.ssl_mode(m);
                verify_tls = verify;
            }
        }
        // TLS never applies to Unix sockets (libpq does not even ask); skipping the request
        // saves a round trip on every local connection.
        let all_local = config
            .get_hosts()
            .iter()
            .all(|h| matches!(h, tokio_postgres::config::Host::Unix(_)));
        if all_local && !verify_tls {
            config.ssl_mode(tokio_postgres::config::SslMode::Disable);
        }
        if config.get_connect_timeout().is_none() {
            let t = env("PGCONNECT_TIMEOUT")
                .and_then(|s| s.parse::<u64>().ok())
                .filter(|&s| s > 0);
            config.connect_timeout(t.map_or(CONNECT_TIMEOUT, Duration::from_secs));
        }
        if config.get_application_name().is_none() {
            config.application_name("leasectl");
        }
        // Find a dead peer within ~30s even while idle between heartbeats.
        config
            .keepalives(true)
            .keepalives_idle(Duration::from_secs(15));
        Ok(Settings { config, verify_tls })
    }

    /// These settings plus the startup option that sets the session's `statement_timeout`
    /// (appended to any `options` the connection string already has).
    pub(super) fn with_statement_timeout(&self) -> Settings {
        let mut s = self.clone();
        let own = format!("-c statement_timeout={STATEMENT_TIMEOUT}");
        let options = match self.config.get_options() {
            Some(o) if !o.trim().is_empty() => format!("{o} {own}"),
            _ => own,
        };
        s.config.options(&options);
        s
    }

    /// A plain connection without migrations (for tools and tests that manage databases).
    pub async fn open_client(&self) -> Result<Client> {
        Ok(open(self).await?.0)
    }

    /// "host:port as user, database db" for messages — never the password.
    pub fn describe(&self) -> String {
        let ports = self.config.get_ports();
        let hosts: Vec<String> = self
            .config
            .get_hosts()
            .iter()
            .enumerate()
            .map(|(i, h)| {
                let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
                match h {
                    tokio_postgres::config::Host::Tcp(name) => format!("{name}:{port}"),
                    tokio_postgres::config::Host::Unix(dir) => {
                        format!("{}/.s.PGSQL.{port}", dir.display())
                    }
                }
            })
            .collect();
        let user = self.config.get_user().unwrap_or("?");
        let db = self.config.get_dbname().unwrap_or(user);
        format!("{} as user \"{user}\", database \"{db}\"", hosts.join(", "))
    }
}

fn current_os_user() -> Option<String> {
    nix::unistd::User::from_uid(nix::unistd::getuid())
        .ok()
        .flatten()
        .map(|u| u.name)
}

/// Opens one connection; its socket I/O runs as a task of its own (see [`super::notify`]).
pub(super) async fn open(
    settings: &Settings,
) -> Result<(Client, mpsc::UnboundedReceiver<Notification>)> {
    let tls = tls::connector(settings.verify_tls)?;
    let (client, connection) = settings.config.connect(tls).await.map_err(|e| {
        Failure::Unavailable(format!(
            "cannot connect to PostgreSQL at {}: {}",
            settings.describe(),
            reason(&e)
        ))
    })?;
    Ok((client, super::notify::drive(connection)))
}

/// The most useful one-line reason inside a tokio-postgres error.
pub fn reason(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        return db.message().to_owned();
    }
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg = format!("{msg}: {s}");
        source = s.source();
    }
    msg
}

/// True when an error means "the database is unreachable or refused us" (exit 69) rather than
/// a bug or bad data (exit 70).
pub fn is_unavailable(e: &tokio_postgres::Error) -> bool {
    if let Some(code) = e.code() {
        let c = code.code();
        return c.starts_with("08") // connection exception
            || c.starts_with("28") // invalid authorization
            || c.starts_with("53") // insufficient resources (too many connections, disk full)
            || c.starts_with("57") // operator intervention: shutdown, statement timeout
            || *code == SqlState::UNDEFINED_DATABASE;
    }
    if e.is_closed() {
        return true;
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if s.is::<std::io::Error>() {
            return true;
        }
        source = s.source();
    }
    let text = e.to_string();
    text.starts_with("error connecting")
        || text.starts_with("timeout")
        || text.starts_with("error communicating")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn libpq_environment_fills_the_gaps() {
        let s = Settings::from_env(
            None,
            env_of(&[
                ("PGHOST", "db.example,/run/pg"),
                ("PGPORT", "6543"),
                ("PGUSER", "app"),
                ("PGDATABASE", "prod"),
            ]),
        )
        .unwrap();
        assert_eq!(s.config.get_user(), Some("app"));
        assert_eq!(s.config.get_dbname(), Some("prod"));
        assert_eq!(s.config.get_ports(), &[6543]);
        assert_eq!(s.config.get_hosts().len(), 2);
        assert!(s
            .describe()
            .starts_with("db.example:6543, /run/pg/.s.PGSQL.6543"));
    }

    #[test]
    fn pgsslmode_applies_unless_the_url_names_one() {
        let env = env_of(&[("PGSSLMODE", "require")]);
        let s = Settings::from_env(Some("postgres://u@db.example/x"), &env).unwrap();
        assert_eq!(
            s.config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Require
        );
        let s =
            Settings::from_env(Some("postgres://u@db.example/x?sslmode=disable"), &env).unwrap();
        assert_eq!(
            s.config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Disable
        );
        let s =
            Settings::from_env(None, env_of(&[("PGHOST", "/run/pg"), ("PGUSER", "a")])).unwrap();
        assert_eq!(
            s.config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Disable,
            "no TLS over a Unix socket"
        );
    }

    #[test]
    fn url_wins_and_password_never_shows() {
        let s = Settings::from_env(
            Some("postgres://u:s3cret@10.0.0.1:5433/x"),
            env_of(&[("PGUSER", "other")]),
        )
        .unwrap();
        assert_eq!(s.config.get_user(), Some("u"));
        assert!(!s.describe().contains("s3cret"));
        let err = Settings::from_env(Some("postgres://u:s3cret@host:notaport/x"), env_of(&[]))
            .err()
            .unwrap();
        assert!(!format!("{err:#}").contains("s3cret"));
    }
}
