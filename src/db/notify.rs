//! The NOTIFY side of a connection: the task that drives a connection's socket and forwards its
//! notifications, and the channel names leasectl notifies on.
//!
//! NOTIFY is only ever a hint (delivered at commit, lost while disconnected): every listener
//! also polls.

use futures_util::StreamExt;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;
use tokio_postgres::{AsyncMessage, Connection, Notification};

use super::Schema;

/// Runs `connection` (which does the socket I/O) as its own task and returns the stream of the
/// notifications it receives; the stream ends when the connection does.
pub(super) fn drive<S, T>(connection: Connection<S, T>) -> mpsc::UnboundedReceiver<Notification>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (tx, rx) = mpsc::unbounded_channel();
    let mut connection = connection;
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
    rx
}

impl Schema {
    /// The NOTIFY channel on which releases are announced (payload: the target).
    pub fn lease_channel(&self) -> String {
        format!("{}.leases", self.name())
    }

    /// The NOTIFY channel that wakes relays when outbox events commit.
    pub fn outbox_channel(&self) -> String {
        format!("{}.outbox", self.name())
    }
}

/// Subscribes this connection to `channel` (quoted, so any schema name is safe).
pub async fn listen(
    client: &tokio_postgres::Client,
    channel: &str,
) -> Result<(), tokio_postgres::Error> {
    client
        .batch_execute(&format!("LISTEN \"{}\"", channel.replace('"', "\"\"")))
        .await
}

/// Stops listening on every channel (a run that got its lease no longer needs the releases of
/// other targets queued for it).
pub async fn unlisten_all(client: &tokio_postgres::Client) -> Result<(), tokio_postgres::Error> {
    client.batch_execute("UNLISTEN *").await
}
