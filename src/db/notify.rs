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
/// notifications it receives (it ends when the connection does) and the task's handle, to close
/// the socket at once ([`super::Db::close_now`]).
pub(super) fn drive<S, T>(
    connection: Connection<S, T>,
) -> (
    mpsc::UnboundedReceiver<Notification>,
    tokio::task::AbortHandle,
)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (tx, rx) = mpsc::unbounded_channel();
    let mut connection = connection;
    let task = tokio::spawn(async move {
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
    (rx, task.abort_handle())
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

/// Resolves when a notification with `payload` (a release of that target, on the lease
/// channel) arrives, discarding the others. If the stream ended (the connection is gone), never
/// resolves: polling takes over. Cancel-safe.
pub async fn announced(rx: &mut mpsc::UnboundedReceiver<Notification>, payload: &str) {
    while let Some(n) = rx.recv().await {
        if n.payload() == payload {
            return;
        }
    }
    std::future::pending::<()>().await
}
