//! Resolving the connection settings, in libpq's order (the connect module's documentation): the connection
//! string, the service it names, the libpq environment, the local socket as the OS user; the
//! password file, read once when no password was given; TLS files.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use tokio_postgres::config::{Host, SslMode, TargetSessionAttrs};
use tokio_postgres::Config;

use super::hosts::{targets, DEFAULT_SOCKET_DIRS};
use super::Settings;
use crate::db::{conninfo, pgpass, service, tls};
use crate::error::Failure;

/// How long connecting to one host may take, when nothing says otherwise.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// libpq's floor for `connect_timeout`: a value of 1 means 2.
const MIN_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// A copy of `c` without hosts, addresses and ports.
fn without_hosts(c: &Config) -> Config {
    let mut b = Config::new();
    if let Some(v) = c.get_user() {
        b.user(v);
    }
    if let Some(v) = c.get_password() {
        b.password(v);
    }
    if let Some(v) = c.get_dbname() {
        b.dbname(v);
    }
    if let Some(v) = c.get_options() {
        b.options(v);
    }
    if let Some(v) = c.get_application_name() {
        b.application_name(v);
    }
    if let Some(v) = c.get_connect_timeout() {
        b.connect_timeout(*v);
    }
    if let Some(v) = c.get_tcp_user_timeout() {
        b.tcp_user_timeout(*v);
    }
    if let Some(v) = c.get_keepalives_interval() {
        b.keepalives_interval(v);
    }
    if let Some(v) = c.get_keepalives_retries() {
        b.keepalives_retries(v);
    }
    b.ssl_mode(c.get_ssl_mode())
        .ssl_negotiation(c.get_ssl_negotiation())
        .keepalives(c.get_keepalives())
        .keepalives_idle(c.get_keepalives_idle())
        .target_session_attrs(c.get_target_session_attrs())
        .channel_binding(c.get_channel_binding())
        .load_balance_hosts(c.get_load_balance_hosts());
    b
}

/// Fills what the connection string left out from service `name`'s `pairs` (libpq: a service
/// beats the environment, the string beats the service).
fn fill_from_service(
    config: &mut Config,
    own: &mut std::collections::BTreeMap<String, String>,
    split: &conninfo::Split,
    name: &str,
    pairs: Vec<(String, String)>,
) -> Result<()> {
    // A URL's user, password, hosts, ports and database are not parameters: look at the config.
    let string_sets = |key: &str| {
        split.sets(key)
            || match key {
                "host" => !config.get_hosts().is_empty(),
                "hostaddr" => !config.get_hostaddrs().is_empty(),
                "port" => !config.get_ports().is_empty(),
                "user" => config.get_user().is_some(),
                "password" => config.get_password().is_some(),
                "dbname" => config.get_dbname().is_some(),
                _ => false,
            }
    };
    let mut fill = Vec::new();
    for (key, value) in pairs {
        if string_sets(&key) {
            continue;
        }
        if conninfo::OWN_KEYS.contains(&key.as_str()) {
            own.insert(key, value);
        } else {
            fill.push((key, value));
        }
    }
    let text: Vec<String> = fill
        .iter()
        .map(|(k, v)| format!("{k}={}", conninfo::quote(v)))
        .collect();
    let from: Config = text
        .join(" ")
        .parse()
        .map_err(|e| Failure::Usage(format!("service \"{name}\": {e}")))?;
    for (key, _) in &fill {
        copy_param(key, &from, config);
    }
    Ok(())
}

/// Copies parameter `key` (already parsed into `from`) onto `to`.
fn copy_param(key: &str, from: &Config, to: &mut Config) {
    match key {
        "host" => {
            for h in from.get_hosts() {
                match h {
                    Host::Tcp(name) => to.host(name),
                    Host::Unix(dir) => to.host_path(dir),
                };
            }
        }
        "hostaddr" => from.get_hostaddrs().iter().for_each(|a| {
            to.hostaddr(*a);
        }),
        "port" => from.get_ports().iter().for_each(|p| {
            to.port(*p);
        }),
        "user" => {
            from.get_user().map(|v| to.user(v));
        }
        "password" => {
            from.get_password().map(|v| to.password(v));
        }
        "dbname" => {
            from.get_dbname().map(|v| to.dbname(v));
        }
        "options" => {
            from.get_options().map(|v| to.options(v));
        }
        "application_name" => {
            from.get_application_name().map(|v| to.application_name(v));
        }
        "connect_timeout" => {
            from.get_connect_timeout().map(|v| to.connect_timeout(*v));
        }
        "tcp_user_timeout" => {
            from.get_tcp_user_timeout().map(|v| to.tcp_user_timeout(*v));
        }
        "keepalives" => {
            to.keepalives(from.get_keepalives());
        }
        "keepalives_idle" => {
            to.keepalives_idle(from.get_keepalives_idle());
        }
        "keepalives_interval" => {
            from.get_keepalives_interval()
                .map(|v| to.keepalives_interval(v));
        }
        "keepalives_retries" => {
            from.get_keepalives_retries()
                .map(|v| to.keepalives_retries(v));
        }
        "target_session_attrs" => {
            to.target_session_attrs(from.get_target_session_attrs());
        }
        "channel_binding" => {
            to.channel_binding(from.get_channel_binding());
        }
        "load_balance_hosts" => {
            to.load_balance_hosts(from.get_load_balance_hosts());
        }
        "sslnegotiation" => {
            to.ssl_negotiation(from.get_ssl_negotiation());
        }
        // tokio-postgres parsed `from`, so it knows no other key.
        _ => {}
    }
}

/// Fills the gaps from `PGHOST`, `PGPORT`, `PGUSER`, `PGPASSWORD`, `PGDATABASE`, and the
/// local socket as the OS user.
fn fill_from_env(config: &mut Config, env: &impl Fn(&str) -> Option<String>) -> Result<()> {
    if config.get_hosts().is_empty() && config.get_hostaddrs().is_empty() {
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
        // A list, one port per host, as in libpq: `PGHOST=db1,db2 PGPORT=5432,5433`.
        if let Some(p) = env("PGPORT") {
            for one in p.split(',').map(str::trim) {
                let port = one
                    .parse::<u16>()
                    .map_err(|_| Failure::Usage(format!("PGPORT '{p}' is not a port number")))?;
                config.port(port);
            }
        }
    }
    if config.get_user().is_none() {
        let user = env("PGUSER").or_else(current_os_user).ok_or_else(|| {
            Failure::Usage("no database user: set PGUSER or put a user in --database-url".into())
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
    Ok(())
}

/// `PGTARGETSESSIONATTRS`, unless the connection string or its service chose already:
/// `read-write` makes a list of hosts find the primary, as in libpq. tokio-postgres knows only
/// `any` and `read-write`, so libpq's other values are a usage error rather than ignored.
fn session_attrs_from_env(
    config: &mut Config,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<()> {
    if config.get_target_session_attrs() != TargetSessionAttrs::Any {
        return Ok(());
    }
    match env("PGTARGETSESSIONATTRS").as_deref().map(str::trim) {
        None | Some("any") => Ok(()),
        Some("read-write") => {
            config.target_session_attrs(TargetSessionAttrs::ReadWrite);
            Ok(())
        }
        Some(other) => Err(Failure::Usage(format!(
            "PGTARGETSESSIONATTRS '{other}' is not supported: use any or read-write"
        ))
        .into()),
    }
}

fn current_os_user() -> Option<String> {
    nix::unistd::User::from_uid(nix::unistd::getuid())
        .ok()
        .flatten()
        .map(|u| u.name)
}

/// The OS user's home directory, when `HOME` is not set (libpq's fallback).
fn os_home() -> Option<PathBuf> {
    nix::unistd::User::from_uid(nix::unistd::getuid())
        .ok()
        .flatten()
        .map(|u| u.dir)
}

impl Settings {
    /// Builds the settings from `--database-url`/`DATABASE_URL` (if given), the service file
    /// it names and the libpq environment. Never includes the password in an error.
    pub fn new(url: Option<&str>) -> Result<Settings> {
        Self::from_env(url, |k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    }

    fn from_env(url: Option<&str>, env: impl Fn(&str) -> Option<String>) -> Result<Settings> {
        let invalid =
            |e: String| Failure::Usage(format!("invalid --database-url / DATABASE_URL: {e}"));
        let split = conninfo::split(url.unwrap_or("")).map_err(invalid)?;
        let mut own = split.own.clone();
        let mut config = if split.rest.trim().is_empty() {
            Config::new()
        } else {
            // The parse error never echoes the string, so no password can leak here.
            split
                .rest
                .parse::<Config>()
                .map_err(|e| invalid(e.to_string()))?
        };
        let home = env("HOME").map(PathBuf::from).or_else(os_home);

        if let Some(name) = own.get("service").cloned().or_else(|| env("PGSERVICE")) {
            let pairs = service::find(&name, &env, home.as_deref()).map_err(Failure::Usage)?;
            fill_from_service(&mut config, &mut own, &split, &name, pairs)?;
        }
        fill_from_env(&mut config, &env)?;
        if !split.sets("target_session_attrs") {
            session_attrs_from_env(&mut config, &env)?;
        }

        let (mode, verify_tls) = match own.get("sslmode").cloned().or_else(|| env("PGSSLMODE")) {
            Some(m) => tls::parse_sslmode(&m)?,
            None => (SslMode::Prefer, false),
        };
        config.ssl_mode(mode);
        let connect_timeout = config
            .get_connect_timeout()
            .copied()
            .or_else(|| {
                env("PGCONNECT_TIMEOUT")
                    .and_then(|s| s.trim().parse::<u64>().ok())
                    .filter(|&s| s > 0)
                    .map(Duration::from_secs)
            })
            .unwrap_or(CONNECT_TIMEOUT)
            .clamp(MIN_CONNECT_TIMEOUT, crate::model::time::MAX_DURATION);
        config.connect_timeout(connect_timeout);
        if config.get_application_name().is_none() {
            config.application_name("leasectl");
        }
        // Find a dead peer within ~30s even while idle between heartbeats.
        config
            .keepalives(true)
            .keepalives_idle(Duration::from_secs(15));

        let passfile = match config.get_password() {
            Some(_) => None,
            None => {
                let path = own
                    .get("passfile")
                    .cloned()
                    .or_else(|| env("PGPASSFILE"))
                    .map(PathBuf::from)
                    .or_else(|| home.as_ref().map(|h| h.join(".pgpass")));
                match path.map(|p| pgpass::read(&p)) {
                    Some(Ok(file)) => file.map(Arc::new),
                    Some(Err(warning)) => {
                        crate::warn!("{warning}");
                        None
                    }
                    None => None,
                }
            }
        };
        let tls_files = tls::Files::resolve(
            |key, var| own.get(key).cloned().or_else(|| env(var)),
            home.as_deref(),
        );
        Ok(Settings {
            targets: targets(&config)?,
            base: without_hosts(&config),
            connect_timeout,
            verify_tls,
            tls_files,
            passfile,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::connect::hosts::{Attempt, Target};

    /// An environment of `pairs`, with a HOME where no ~/.pgpass or service file exists.
    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| n == k)
                .map(|(_, v)| v.clone())
                .or_else(|| (k == "HOME").then(|| "/nonexistent".into()))
        }
    }

    fn hosts(s: &Settings) -> Vec<String> {
        s.targets.iter().map(Target::label).collect()
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
        assert_eq!(s.base.get_user(), Some("app"));
        assert_eq!(s.base.get_dbname(), Some("prod"));
        assert_eq!(hosts(&s), ["db.example:6543", "/run/pg/.s.PGSQL.6543"]);
        assert!(s
            .describe()
            .starts_with("db.example:6543, /run/pg/.s.PGSQL.6543 as user \"app\""));
        assert_eq!(s.connect_timeout, CONNECT_TIMEOUT);
        assert_eq!(s.connect_budget(), 2 * CONNECT_TIMEOUT);
    }

    #[test]
    fn pghost_and_pgport_lists_pair_up_and_pgtargetsessionattrs_applies() {
        let env = env_of(&[
            ("PGHOST", "db1,db2"),
            ("PGPORT", "5432, 5433"),
            ("PGUSER", "u"),
            ("PGTARGETSESSIONATTRS", "read-write"),
        ]);
        let s = Settings::from_env(None, &env).unwrap();
        assert_eq!(hosts(&s), ["db1:5432", "db2:5433"]);
        assert_eq!(
            s.base.get_target_session_attrs(),
            TargetSessionAttrs::ReadWrite
        );
        // The string's own setting wins, as everywhere.
        let s = Settings::from_env(Some("host=h port=1 target_session_attrs=any"), &env).unwrap();
        assert_eq!(s.base.get_target_session_attrs(), TargetSessionAttrs::Any);
        let err = Settings::from_env(
            None,
            env_of(&[("PGUSER", "u"), ("PGTARGETSESSIONATTRS", "standby")]),
        )
        .err()
        .unwrap();
        assert!(format!("{err}").contains("use any or read-write"), "{err}");
        let err = Settings::from_env(None, env_of(&[("PGUSER", "u"), ("PGPORT", "1,x")]))
            .err()
            .unwrap();
        assert!(format!("{err}").contains("PGPORT '1,x'"), "{err}");
        // Three hosts and two ports cannot pair up.
        let env = env_of(&[("PGHOST", "a,b,c"), ("PGPORT", "1,2"), ("PGUSER", "u")]);
        assert!(Settings::from_env(None, &env).is_err());
    }

    #[test]
    fn pgsslmode_applies_unless_the_url_names_one() {
        let env = env_of(&[("PGSSLMODE", "require")]);
        let s = Settings::from_env(Some("postgres://u@db.example/x"), &env).unwrap();
        assert_eq!(s.base.get_ssl_mode(), SslMode::Require);
        let s =
            Settings::from_env(Some("postgres://u@db.example/x?sslmode=disable"), &env).unwrap();
        assert_eq!(s.base.get_ssl_mode(), SslMode::Disable);
        let s = Settings::from_env(Some("host=h user=u sslmode=verify-full"), &env).unwrap();
        assert!(s.verify_tls && s.base.get_ssl_mode() == SslMode::Require);
        let s =
            Settings::from_env(None, env_of(&[("PGHOST", "/run/pg"), ("PGUSER", "a")])).unwrap();
        assert_eq!(
            s.config_for(&s.targets[0]).get_ssl_mode(),
            SslMode::Disable,
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
        assert_eq!(s.base.get_user(), Some("u"));
        assert!(!s.describe().contains("s3cret"));
        for bad in [
            "postgres://u:s3cret@host:notaport/x",
            "host=h password=s3cret stray s3cret",
            "host=h password='s3cret",
            "postgres://u:s3cret@h/x?s3cret",
        ] {
            let err = Settings::from_env(Some(bad), env_of(&[])).err().unwrap();
            assert!(!format!("{err:#}").contains("s3cret"), "{err:#}");
        }
    }

    #[test]
    fn connect_timeout_from_the_string_or_pgconnect_timeout_with_libpqs_floor() {
        let env = env_of(&[("PGCONNECT_TIMEOUT", "7"), ("PGUSER", "u")]);
        let t = |url: &str| Settings::from_env(Some(url), &env).unwrap().connect_timeout;
        assert_eq!(
            t("postgres://h/db?connect_timeout=3"),
            Duration::from_secs(3)
        );
        assert_eq!(t("host=h connect_timeout=1"), Duration::from_secs(2));
        assert_eq!(t("host=h"), Duration::from_secs(7));
        assert_eq!(t("host=h connect_timeout=0"), Duration::from_secs(7));
    }

    #[test]
    fn hosts_ports_and_hostaddrs_pair_up() {
        let s = Settings::from_env(
            Some("host=a,b hostaddr=10.0.0.1,10.0.0.2 port=1,2 user=u"),
            env_of(&[]),
        )
        .unwrap();
        assert_eq!(hosts(&s), ["a:1", "b:2"]);
        assert_eq!(s.targets[1].hostaddr, Some("10.0.0.2".parse().unwrap()));
        let s = Settings::from_env(Some("hostaddr=::1 user=u"), env_of(&[])).unwrap();
        assert_eq!(hosts(&s), ["[::1]:5432"]);
        assert!(Settings::from_env(Some("host=a,b,c port=1,2 user=u"), env_of(&[])).is_err());
    }

    #[test]
    fn a_service_fills_what_the_string_left_out_and_beats_the_environment() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("services.conf");
        std::fs::write(
            &file,
            "[svc]\nhost=svc-host\nport=6000\ndbname=svc-db\nuser=svc-user\nsslmode=require\nconnect_timeout=4\n",
        )
        .unwrap();
        let file = file.display().to_string();
        let env = env_of(&[
            ("PGSERVICEFILE", &file),
            ("PGHOST", "env-host"),
            ("PGDATABASE", "env-db"),
            ("PGSSLMODE", "disable"),
        ]);
        let s = Settings::from_env(Some("service=svc user=mine"), &env).unwrap();
        assert_eq!(hosts(&s), ["svc-host:6000"]);
        assert_eq!(s.base.get_dbname(), Some("svc-db"));
        assert_eq!(s.base.get_user(), Some("mine"), "the string wins");
        assert_eq!(s.base.get_ssl_mode(), SslMode::Require);
        assert_eq!(s.connect_timeout, Duration::from_secs(4));
        let s = Settings::from_env(Some("postgres://url-host/url-db?service=svc"), &env).unwrap();
        assert_eq!(hosts(&s), ["url-host:5432"]);
        assert_eq!(s.base.get_dbname(), Some("url-db"));
        let env = env_of(&[("PGSERVICEFILE", &file), ("PGSERVICE", "svc")]);
        assert_eq!(
            Settings::from_env(None, &env).unwrap().base.get_dbname(),
            Some("svc-db")
        );
        let env = env_of(&[("PGSERVICEFILE", &file), ("PGSERVICE", "nope")]);
        let err = Settings::from_env(None, &env).err().unwrap();
        assert!(
            format!("{err}").contains("service \"nope\" not found"),
            "{err}"
        );
    }

    #[test]
    fn the_password_file_is_matched_per_host_only_without_a_password() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pgpass");
        std::fs::write(
            &file,
            "localhost:5432:*:u:socket-pw\nb:5432:db:u:b-pw\n*:*:*:other:nope\n",
        )
        .unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        let file = file.display().to_string();
        let env = env_of(&[("PGPASSFILE", &file)]);
        let s = Settings::from_env(Some("host=/var/run/postgresql,a,b user=u dbname=db"), &env)
            .unwrap();
        let pw = |i: usize| {
            s.config_for(&s.targets[i])
                .get_password()
                .map(|p| String::from_utf8_lossy(p).into_owned())
        };
        assert_eq!(
            pw(0).as_deref(),
            Some("socket-pw"),
            "localhost means the socket"
        );
        assert_eq!(pw(1), None);
        assert_eq!(pw(2).as_deref(), Some("b-pw"));
        let s = Settings::from_env(Some("host=b user=u dbname=db password=given"), &env).unwrap();
        assert_eq!(
            s.config_for(&s.targets[0]).get_password(),
            Some(&b"given"[..])
        );
        let s = Settings::from_env(
            Some(&format!("host=b user=u dbname=db passfile={file}")),
            env_of(&[]),
        )
        .unwrap();
        assert_eq!(
            s.config_for(&s.targets[0]).get_password(),
            Some(&b"b-pw"[..])
        );
    }

    #[test]
    fn the_failure_line_names_every_host_and_leads_with_a_servers_answer() {
        let s = Settings::from_env(
            Some("host=a,b user=u dbname=d connect_timeout=3"),
            env_of(&[]),
        )
        .unwrap();
        let one = s.failure(&[(s.targets[0].clone(), Attempt::Silent)]);
        assert_eq!(
            one,
            "cannot connect to PostgreSQL at a:5432 as user \"u\", database \"d\": no answer within 3s"
        );
        let both = s.failure(&[
            (s.targets[0].clone(), Attempt::Silent),
            (s.targets[1].clone(), Attempt::Silent),
        ]);
        assert_eq!(
            both,
            "cannot connect to PostgreSQL as user \"u\", database \"d\": a:5432: no answer within 3s; b:5432: no answer within 3s"
        );
    }
}
