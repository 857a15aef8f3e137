//! PostgreSQL: connecting ([`connect`], with [`tls`]), keeping the schema current ([`migrate()`])
//! and the NOTIFY stream ([`notify`]).
//!
//! Every command calls [`Db::connect`], which applies pending migrations under an advisory lock
//! before anything else touches the tables. The SQL on the tables themselves is in
//! [`crate::store`].

pub mod connect;
pub mod conninfo;
pub mod deadline;
pub mod first;
pub mod migrate;
pub mod notify;
pub mod pgpass;
pub mod service;
pub mod session;
pub mod tls;

use std::future::Future;
use std::sync::Arc;

use anyhow::Result;
use tokio::sync::mpsc;
use tokio_postgres::{Client, Notification};

pub use connect::{is_unavailable, reason, Settings};
pub use migrate::{migrate, SCHEMA_VERSION};
pub use session::{Detected, Pooling};

/// The validated schema name and its quoted form for SQL.
#[derive(Debug, Clone)]
pub struct Schema {
    name: String,
    quoted: String,
}

impl Schema {
    /// `name` must already have passed [`crate::model::flags::parse_schema`]; quoting is still applied,
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
}

/// One open connection, its notification stream and the settings to open another.
pub struct Db {
    pub client: Client,
    pub notifications: mpsc::UnboundedReceiver<Notification>,
    pub schema: Schema,
    settings: Arc<Settings>,
    pooling: Pooling,
    /// The task that drives the connection's socket.
    driver: tokio::task::AbortHandle,
    /// Opened by [`Db::unchecked`] and the schema not checked yet: what the connection told
    /// about pooling so far (`pooling` is then `Pooled`, the assumption that never LISTENs).
    unchecked: Option<Option<Pooling>>,
}

impl Db {
    /// Connects and brings the schema up to date.
    pub async fn connect(settings: Settings, schema: Schema) -> Result<Db> {
        let settings = Arc::new(settings);
        let (mut client, (notifications, driver), known) = session::open(&settings, None).await?;
        let statement_timeout = migrate(&mut client, &schema).await?;
        Ok(Db {
            client,
            notifications,
            schema,
            settings,
            pooling: session::judge(known, &statement_timeout),
            driver,
            unchecked: None,
        })
    }

    /// Connects without checking the schema yet: the check goes with the first transaction
    /// ([`Db::first`]), or [`Db::check_schema`] makes it. Nothing may touch the tables before.
    pub async fn unchecked(settings: Settings, schema: Schema) -> Result<Db> {
        let settings = Arc::new(settings);
        let (client, (notifications, driver), known) = session::open(&settings, None).await?;
        Ok(Db {
            client,
            notifications,
            schema,
            settings,
            pooling: Pooling::Pooled,
            driver,
            unchecked: Some(known),
        })
    }

    /// Brings the schema up to date, as [`Db::connect`] does, if that is still to be done.
    pub async fn check_schema(&mut self) -> Result<()> {
        let Some(known) = self.unchecked else {
            return Ok(());
        };
        let statement_timeout = migrate(&mut self.client, &self.schema).await?;
        self.settle(session::judge(known, &statement_timeout));
        Ok(())
    }

    /// Whether the schema was checked on this connection (see [`Db::unchecked`]).
    pub fn schema_checked(&self) -> bool {
        self.unchecked.is_none()
    }

    /// The schema was found current; `pooling` is how the session reaches its server.
    pub(super) fn settle(&mut self, pooling: Pooling) {
        self.pooling = pooling;
        self.unchecked = None;
    }

    /// Connects without touching the schema (no migration, no ledger read), for `leasectl
    /// doctor`, which only looks; also says how the session was found direct or pooled.
    pub async fn inspect(settings: Settings, schema: Schema) -> Result<(Db, Detected)> {
        let settings = Arc::new(settings);
        let (client, (notifications, driver), pooling, detected) =
            session::inspect(&settings).await?;
        let db = Db {
            client,
            notifications,
            schema,
            settings,
            pooling,
            driver,
            unchecked: None,
        };
        Ok((db, detected))
    }

    /// Whether this connection reaches its own server session or goes through a pooler.
    pub fn pooling(&self) -> Pooling {
        self.pooling
    }

    /// Opens a fresh connection with the same settings (the schema is already migrated, and
    /// whether a pooler is in between is known, unless the schema is still unchecked).
    pub async fn reconnect(&mut self) -> Result<()> {
        let known = self.unchecked.unwrap_or(Some(self.pooling));
        let (client, (notifications, driver), known) = session::open(&self.settings, known).await?;
        if self.unchecked.is_some() {
            self.unchecked = Some(known);
        }
        self.client = client;
        self.notifications = notifications;
        self.driver = driver;
        Ok(())
    }

    /// Opens a second connection with the same settings, for work beside this one's: a future
    /// that owns what it needs, so that it can also run in a task of its own. The relay claims
    /// its next batch on one while it publishes a batch ([`crate::store::outbox::claim`]), and
    /// vacuums the outbox on another while it goes on claiming.
    pub fn another(&self) -> impl Future<Output = Result<Db>> + Send + 'static {
        let (settings, schema) = (self.settings.clone(), self.schema.clone());
        let (pooling, unchecked) = (self.pooling, self.unchecked);
        async move {
            let (client, (notifications, driver), _) =
                session::open(&settings, Some(pooling)).await?;
            Ok(Db {
                client,
                notifications,
                schema,
                settings,
                pooling,
                driver,
                unchecked,
            })
        }
    }

    /// Closes the connection's socket now, without a goodbye and without waiting for answers
    /// still owed: for a connection whose server stopped answering. Dropping the client alone
    /// would leave the socket open until the server answered or TCP gave up, and a server that
    /// resumes would find its session's client still there; with the socket closed it ends the
    /// session (rolling back what was open) as soon as it runs again. Every later statement on
    /// this connection fails at once; [`Db::reconnect`] replaces it.
    pub fn close_now(&self) {
        self.driver.abort();
    }

    /// Whether LISTEN works on this connection (not behind a transaction-mode pooler); where it
    /// does not, waiters poll.
    pub fn can_listen(&self) -> bool {
        self.pooling == Pooling::Direct
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
