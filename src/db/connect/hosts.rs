//! The hosts to try and trying them: one [`Target`] per host of the settings, in their order
//! (`load_balance_hosts`), each attempt's single-host config (TLS, the password file's entry),
//! how an attempt ended, and the one line saying why no host gave us a session.

use std::net::IpAddr;
use std::path::Path;

use anyhow::Result;
use tokio_postgres::config::{Host, LoadBalanceHosts, SslMode};
use tokio_postgres::error::SqlState;
use tokio_postgres::Config;

use super::errors::brief_reason;
use super::Settings;
use crate::db::{pgpass, tls};
use crate::error::Failure;

/// Socket directories tried when nothing names a host: Debian's, then the upstream default.
pub(super) const DEFAULT_SOCKET_DIRS: [&str; 2] = ["/var/run/postgresql", "/tmp"];

/// One host to try: a host name or socket directory, its address if `hostaddr` gave one, and
/// its port.
#[derive(Clone, Debug)]
pub(super) struct Target {
    pub(super) host: Host,
    pub(super) hostaddr: Option<IpAddr>,
    pub(super) port: u16,
}

impl Target {
    /// `host:port`, or the socket's path, for messages.
    pub(super) fn label(&self) -> String {
        match &self.host {
            Host::Tcp(name) if name.contains(':') => format!("[{name}]:{}", self.port),
            Host::Tcp(name) => format!("{name}:{}", self.port),
            Host::Unix(dir) => format!("{}/.s.PGSQL.{}", dir.display(), self.port),
        }
    }

    /// The host name the password file is matched on: libpq's `localhost` for the default
    /// socket directories.
    fn pgpass_host(&self) -> String {
        match &self.host {
            Host::Tcp(name) => name.clone(),
            Host::Unix(dir) if DEFAULT_SOCKET_DIRS.iter().any(|d| dir == Path::new(d)) => {
                "localhost".into()
            }
            Host::Unix(dir) => dir.display().to_string(),
        }
    }
}

/// The hosts to try, from the hosts, `hostaddr`s and ports of `config`.
pub(super) fn targets(config: &Config) -> Result<Vec<Target>> {
    let (hosts, addrs, ports) = (
        config.get_hosts(),
        config.get_hostaddrs(),
        config.get_ports(),
    );
    let n = hosts.len().max(addrs.len());
    if !hosts.is_empty() && !addrs.is_empty() && hosts.len() != addrs.len() {
        return Err(Failure::Usage(format!(
            "{} hosts but {} hostaddrs: give one address per host",
            hosts.len(),
            addrs.len()
        ))
        .into());
    }
    if ports.len() > 1 && ports.len() != n {
        return Err(Failure::Usage(format!(
            "{} ports for {n} hosts: give one port, or one per host",
            ports.len()
        ))
        .into());
    }
    Ok((0..n)
        .map(|i| Target {
            host: hosts
                .get(i)
                .cloned()
                .unwrap_or_else(|| Host::Tcp(addrs[i].to_string())),
            hostaddr: addrs.get(i).copied(),
            port: ports.get(i).or(ports.first()).copied().unwrap_or(5432),
        })
        .collect())
}

/// How one host's attempt ended.
pub(super) enum Attempt {
    /// Nothing within `connect_timeout`.
    Silent,
    Failed(tokio_postgres::Error),
}

impl Attempt {
    /// The server itself answered with an error.
    fn answered(&self) -> bool {
        matches!(self, Attempt::Failed(e) if e.as_db_error().is_some())
    }

    /// The server refused *us* (authentication, role, database): another host of the same
    /// cluster would say the same, so libpq stops here, and so do we.
    pub(super) fn ends_search(&self) -> bool {
        match self {
            Attempt::Failed(e) => e
                .code()
                .is_some_and(|c| c.code().starts_with("28") || *c == SqlState::UNDEFINED_DATABASE),
            Attempt::Silent => false,
        }
    }
}

impl Settings {
    /// The hosts in the order they are tried (shuffled for `load_balance_hosts=random`).
    pub(super) fn order(&self) -> Vec<Target> {
        let mut targets = self.targets.clone();
        if self.base.get_load_balance_hosts() == LoadBalanceHosts::Random {
            fastrand::shuffle(&mut targets);
        }
        targets
    }

    /// The single-host config of one attempt: never TLS over a Unix socket (libpq does not
    /// even ask), and the password file's entry for this host when no password was given.
    pub(super) fn config_for(&self, target: &Target) -> Config {
        let mut config = self.base.clone();
        match &target.host {
            Host::Tcp(name) => {
                config.host(name);
            }
            Host::Unix(dir) => {
                config.host_path(dir).ssl_mode(SslMode::Disable);
            }
        }
        if let Some(addr) = target.hostaddr {
            config.hostaddr(addr);
        }
        config.port(target.port);
        if let Some(file) = &self.passfile {
            let user = self.base.get_user().unwrap_or_default();
            let host = target.pgpass_host();
            let key = pgpass::Key {
                host: &host,
                port: target.port,
                dbname: self.base.get_dbname().unwrap_or(user),
                user,
            };
            if let Some(password) = file.lookup(&key) {
                config.password(password);
            }
        }
        config
    }

    /// The TLS connector, reading certificate files only if some host may use TLS.
    pub(super) fn connector(&self) -> Result<tokio_postgres_rustls::MakeRustlsConnect> {
        let tls_possible = self.base.get_ssl_mode() != SslMode::Disable
            && self.targets.iter().any(|t| matches!(t.host, Host::Tcp(_)));
        if tls_possible {
            tls::connector(self.verify_tls, &self.tls_files)
        } else {
            tls::connector(false, &tls::Files::default())
        }
    }

    /// The one line saying why no host gave us a session. The first host that answered (a
    /// server's error) leads, since it is the one that says what is wrong; the others follow
    /// briefly.
    pub(super) fn failure(&self, tried: &[(Target, Attempt)]) -> String {
        let what = |a: &Attempt| match a {
            Attempt::Silent => format!("no answer within {}s", self.connect_timeout.as_secs()),
            Attempt::Failed(e) => brief_reason(e),
        };
        let listed = |skip: Option<usize>| -> Vec<String> {
            tried
                .iter()
                .enumerate()
                .filter(|(i, _)| Some(*i) != skip)
                .map(|(_, (t, a))| format!("{}: {}", t.label(), what(a)))
                .collect()
        };
        let who = self.who();
        match (tried, tried.iter().position(|(_, a)| a.answered())) {
            ([(t, a)], _) => format!(
                "cannot connect to PostgreSQL at {} {who}: {}",
                t.label(),
                what(a)
            ),
            (_, Some(i)) => format!(
                "cannot connect to PostgreSQL at {} {who}: {} (also tried {})",
                tried[i].0.label(),
                what(&tried[i].1),
                listed(Some(i)).join(", ")
            ),
            (_, None) => format!(
                "cannot connect to PostgreSQL {who}: {}",
                listed(None).join("; ")
            ),
        }
    }
}
