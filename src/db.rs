//! Connecting to PostgreSQL and keeping the schema current.
//!
//! Where the connection settings come from, in libpq's order: `--database-url` / `DATABASE_URL`
//! (a URL or a `key=value` string), then `PGHOST`, `PGPORT`, `PGUSER`, `PGPASSWORD`,
//! `PGDATABASE`, `PGSSLMODE`, then the local socket as the current OS user — what `psql` with no
//! arguments reaches. Fields missing from a URL are filled from the same environment.
//!
//! Every command calls [`Db::connect`], which applies pending migrations under an advisory lock
//! (see [`migrate`]) before anything else touches the tables.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use futures_util::StreamExt;
use tokio::sync::mpsc;
use tokio_postgres::error::SqlState;
use tokio_postgres::{AsyncMessage, Client, Config, Notification, SimpleQueryMessage};

use crate::exit::Failure;
use crate::tls;

/// How long a connection attempt may take before the database counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Server-side limit on every statement, so a stuck lock or server cannot hang leasectl; sent
/// first on every connection.
const SET_STATEMENT_TIMEOUT: &str = "SET statement_timeout = '30s'";
/// Socket directories tried when nothing names a host: Debian's, then the upstream default.
const DEFAULT_SOCKET_DIRS: [&str; 2] = ["/var/run/postgresql", "/tmp"];

/// The migrations embedded in the binary, in order. The version is the file's number.
const MIGRATIONS: &[(i32, &str, &str)] = &[
    (1, "init", include_str!("../migrations/0001_init.sql")),
    (2, "relay", include_str!("../migrations/0002_relay.sql")),
];

/// The newest schema version this binary knows.
pub const SCHEMA_VERSION: i32 = MIGRATIONS[MIGRATIONS.len() - 1].0;

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

/// The validated schema name and its quoted form for SQL.
#[derive(Debug, Clone)]
pub struct Schema {
    name: String,
    quoted: String,
}

impl Schema {
    /// `name` must already have passed [`crate::config::parse_schema`]; quoting is still applied,
    /// so even a name that slipped through could not break out of the identifier.
    pub fn new(name: &str) -> Schema {
        Schema {
            name: name.to_owned(),
            quoted: format!("\"{}\"", name.replace('"', "\"\"")),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Replaces `{s}` in a SQL template with the quoted schema name.
    pub fn sql(&self, template: &str) -> String {
        template.replace("{s}", &self.quoted)
    }

    /// The NOTIFY channel on which releases are announced (payload: the target).
    pub fn lease_channel(&self) -> String {
        format!("{}.leases", self.name)
    }

    /// The NOTIFY channel that wakes relays when outbox events commit.
    pub fn outbox_channel(&self) -> String {
        format!("{}.outbox", self.name)
    }
}

/// One open connection, its notification stream and the settings to open another.
pub struct Db {
    pub client: Client,
    pub notifications: mpsc::UnboundedReceiver<Notification>,
    pub schema: Schema,
    settings: Arc<Settings>,
}

impl Db {
    /// Connects and brings the schema up to date.
    pub async fn connect(settings: Settings, schema: Schema) -> Result<Db> {
        let settings = Arc::new(settings);
        let (client, notifications) = open(&settings).await?;
        let mut db = Db {
            client,
            notifications,
            schema,
            settings,
        };
        migrate(&mut db.client, &db.schema).await?;
        Ok(db)
    }

    /// Opens a fresh connection with the same settings (the schema is already migrated).
    pub async fn reconnect(&mut self) -> Result<()> {
        let (client, notifications) = open(&self.settings).await?;
        client.batch_execute(SET_STATEMENT_TIMEOUT).await?;
        self.client = client;
        self.notifications = notifications;
        Ok(())
    }
}

async fn open(settings: &Settings) -> Result<(Client, mpsc::UnboundedReceiver<Notification>)> {
    let tls = tls::connector(settings.verify_tls)?;
    let (client, mut connection) = settings.config.connect(tls).await.map_err(|e| {
        Failure::Unavailable(format!(
            "cannot connect to PostgreSQL at {}: {}",
            settings.describe(),
            reason(&e)
        ))
    })?;
    // The connection object does the socket I/O; it runs as its own task and forwards
    // NOTIFY messages (lease releases) to whoever listens.
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(msg) = messages.next().await {
            match msg {
                Ok(AsyncMessage::Notification(n)) => {
                    let _ = tx.send(n);
                }
                Ok(_) => {}
                Err(_) => break,
            }
        }
    });
    Ok((client, rx))
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

/// Brings `schema` up to [`SCHEMA_VERSION`].
///
/// The common case — already current — costs one round trip, which also sets the statement
/// timeout. Otherwise every pending migration runs in one transaction holding an advisory lock
/// keyed on the schema, with its ledger row, so two processes starting on an empty database
/// serialise here and both succeed (sqlx-postgres's `migrate.rs` does the same).
pub async fn migrate(client: &mut Client, schema: &Schema) -> Result<()> {
    let probe = client
        .simple_query(&schema.sql(&format!(
            "{SET_STATEMENT_TIMEOUT}; SELECT max(version) FROM {{s}}.schema_migrations"
        )))
        .await;
    match probe {
        Ok(msgs) => {
            let current = msgs.iter().find_map(|m| match m {
                SimpleQueryMessage::Row(r) => r.get(0).and_then(|v| v.parse::<i32>().ok()),
                _ => None,
            });
            match current {
                Some(v) if v == SCHEMA_VERSION => return Ok(()),
                Some(v) if v > SCHEMA_VERSION => return Err(too_new(schema, v)),
                _ => {}
            }
        }
        Err(e) if matches!(e.code(), Some(c) if *c == SqlState::UNDEFINED_TABLE || *c == SqlState::INVALID_SCHEMA_NAME) =>
            {}
        Err(e) => return Err(e).context("cannot read the schema version"),
    }
    apply_migrations(client, schema).await
}

async fn apply_migrations(client: &mut Client, schema: &Schema) -> Result<()> {
    // The failed probe rolled back its SET; repeat it outside the transaction.
    client.batch_execute(SET_STATEMENT_TIMEOUT).await?;
    let tx = client.transaction().await?;
    tx.execute(
        "SELECT pg_advisory_xact_lock(hashtext('leasectl.migrate:' || $1::text))",
        &[&schema.name()],
    )
    .await
    .context("cannot take the migration lock")?;
    tx.batch_execute(&schema.sql(
        "CREATE SCHEMA IF NOT EXISTS {s};
         CREATE TABLE IF NOT EXISTS {s}.schema_migrations (
             version    integer     PRIMARY KEY,
             name       text        NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now()
         );
         SET LOCAL search_path = {s};",
    ))
    .await
    .with_context(|| format!("cannot create schema \"{}\"", schema.name()))?;
    let row = tx
        .query_one(
            "SELECT coalesce(max(version), 0) FROM schema_migrations",
            &[],
        )
        .await?;
    let current: i32 = row.get(0);
    if current > SCHEMA_VERSION {
        return Err(too_new(schema, current));
    }
    for (version, name, sql) in MIGRATIONS.iter().filter(|(v, _, _)| *v > current) {
        tx.batch_execute(sql).await.with_context(|| {
            format!(
                "migration {version:04}_{name} failed in schema \"{}\"",
                schema.name()
            )
        })?;
        tx.execute(
            "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)",
            &[version, name],
        )
        .await?;
    }
    tx.commit().await.context("cannot commit the migrations")?;
    Ok(())
}

fn too_new(schema: &Schema, found: i32) -> anyhow::Error {
    Failure::SchemaTooNew(format!(
        "schema \"{}\" is at version {found}, newer than this leasectl understands ({SCHEMA_VERSION}); upgrade leasectl",
        schema.name()
    ))
    .into()
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

    #[test]
    fn schema_quoting() {
        let s = Schema::new("My_s");
        assert_eq!(
            s.sql("SELECT 1 FROM {s}.leases"),
            "SELECT 1 FROM \"My_s\".leases"
        );
        assert_eq!(s.lease_channel(), "My_s.leases");
    }
}
