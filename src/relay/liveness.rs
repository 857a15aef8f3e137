//! What the relay knows about its connections and its batches' transactions.
//!
//! **Every statement has a deadline** ([`bounded`]): a server that stops answering — a
//! black-holed network path, a frozen host, backends stopped by a debugger — sends no error,
//! and a server-side `statement_timeout` cannot help (it is a server that is silent, and behind
//! a transaction-mode pooler there is none). A statement unanswered after
//! [`RelayConfig::statement_deadline`](super::RelayConfig) fails with [`Lost`]: the relay warns,
//! drops that connection (the server rolls back what was open on it once it notices) and
//! reconnects, or, with `--once`, exits 69.
//!
//! **An event is published only while its batch's transaction is known to be open** ([`Open`]).
//! A batch is claimed inside a transaction that deletes its rows; if the server ends that
//! session before the relay publishes (the relay was paused past the transaction's idle
//! timeout, say), the rows are back in the outbox and another relay may already be publishing
//! the aggregate's newer events: a late copy from the first relay would arrive among them, out of
//! order. So the claim sets the transaction's own `idle_in_transaction_session_timeout`
//! ([`idle_timeout`], `SET LOCAL`, so a pooler is fine; a shorter one the session already has,
//! an operator's for the role or the database, is kept), and the relay knows that the server
//! cannot have ended the transaction by that timeout before it has been idle that long after
//! the last statement the relay sent and the server answered. An event may start out within
//! [`window`] of that statement — the timeout less what an event already under way may
//! still take to reach the sink's consumers (the sink's [`super::sink::Sink::in_flight`]) and a
//! margin; past that (the relay was paused, the sink is slow), the relay first confirms with one
//! round trip that the transaction is alive, and drops the rest of the batch unpublished if it
//! is not. A session the server ended and said so (an operator's `pg_terminate_backend`, the
//! idle timeout while the relay ran) is seen without a round trip: the client knows its
//! connection closed. While a batch is published, the relay also confirms every half window on
//! its own (keeping the transaction from going idle that long), so a sink that takes long does
//! not lose the batch.
//!
//! **The last check is made where the event leaves** ([`Gate`]): an event that passed the check
//! may still wait before its bytes go out — for a connection of the webhook's pool, behind other
//! tasks of the relay's thread, or because the relay was paused right after the check — and
//! would then reach the sink after the transaction may have ended. So every sink is handed the
//! batch's gate, the same deadline as the check's, and looks at it at the last moment before
//! the event is irrevocably out: a webhook's request body when the connection's task writes it,
//! the exec sink's spawn, a broker publication. An event the gate turns away goes back with the
//! batch, uncharged.
//!
//! What remains: a session ended by someone else (an operator's `pg_terminate_backend`, a
//! network fault that ends it on the server's side first) while an event is on its way — after
//! the relay's check, before the sink has it — or while the relay was paused for less than its
//! window, before its client read the end of the session. Such an event is published once
//! more than it needed to be while another relay may already publish the aggregate's next ones.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::Client;

use crate::db;
use crate::fmt;

/// How long one statement of the relay may go unanswered, unless `LEASECTL_STATEMENT_TIMEOUT`
/// says otherwise.
pub const STATEMENT_DEADLINE: Duration = Duration::from_secs(10);

/// How long the relay's own statements on the outbox's VACUUM may take: it reads the whole
/// table and its indexes, which a large backlog makes legitimately slow.
pub const VACUUM_DEADLINE: Duration = Duration::from_secs(60);

/// The part of a batch transaction's idle timeout in which events start out without the relay
/// confirming the transaction first: longer than a batch usually takes, so a healthy relay
/// confirms nothing (the claim and the commit are the batch's only round trips).
const WINDOW: Duration = Duration::from_secs(10);

/// The shortest window worth keeping an event's whole way inside (see [`window`]).
const MIN_WINDOW: Duration = Duration::from_millis(100);

/// What the relay keeps back from the idle timeout for an event's way to the sink, scheduling
/// and the two clocks' rates; at most a quarter of the timeout.
const MARGIN: Duration = Duration::from_secs(1);

/// A connection the relay can no longer use: it did not answer a statement in time, or the
/// batch's transaction on it may have ended. The relay drops the connection and reconnects
/// (`--once` exits 69).
#[derive(Debug)]
pub struct Lost(pub String);

impl std::fmt::Display for Lost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Lost {}

/// Runs `work` (one or a few statements) under `deadline`: an answer that has not come by then
/// is a [`Lost`] connection, saying what was asked (`what`, e.g. "the claim").
pub async fn bounded<T, E: Into<anyhow::Error>>(
    deadline: Duration,
    what: &str,
    work: impl Future<Output = Result<T, E>>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(deadline, work).await {
        Ok(done) => done.map_err(Into::into),
        Err(_) => Err(silent(what, deadline).into()),
    }
}

/// [`bounded`] for a statement whose failure the relay can do without (a warning's lookup, a
/// figure for the progress line): a failure is `None`, but no answer by the deadline is still a
/// [`Lost`] connection.
pub async fn best_effort<T, E>(
    deadline: Duration,
    what: &str,
    work: impl Future<Output = Result<T, E>>,
) -> Result<Option<T>, Lost> {
    match tokio::time::timeout(deadline, work).await {
        Ok(done) => Ok(done.ok()),
        Err(_) => Err(silent(what, deadline)),
    }
}

fn silent(what: &str, deadline: Duration) -> Lost {
    Lost(format!(
        "the database did not answer {what} within {}",
        fmt::duration(deadline)
    ))
}

/// The idle timeout a batch's claim sets for its transaction: the window, the margin, and how
/// long an event under way may still take to reach the sink's consumers (`in_flight`), so that
/// an event that started out within the window reaches them before the server may end the
/// transaction, even when the relay is paused meanwhile.
pub fn idle_timeout(in_flight: Duration) -> Duration {
    WINDOW + MARGIN + in_flight
}

/// How long after a confirmed statement events may start out without confirming again, for a
/// transaction whose idle timeout is `idle`: `idle` less the margin and `in_flight`. When the
/// session's own timeout (an operator's) leaves less than `MIN_WINDOW` for that, half of what
/// the margin leaves: an event under way can then outlast the transaction if the relay is
/// paused meanwhile, but while it runs it confirms every half window.
pub fn window(idle: Duration, in_flight: Duration) -> Duration {
    let margin = MARGIN.min(idle / 4);
    let left = idle.saturating_sub(margin);
    let full = left.saturating_sub(in_flight);
    if full >= MIN_WINDOW {
        full
    } else {
        left / 2
    }
}

/// Until when an event of a batch may start out: the deadline [`Open::may_publish`] checks,
/// shared (across threads, as a webhook connection's task may run elsewhere) with the code that
/// writes the event, so that the last look at it is taken just before the bytes leave. It
/// moves on with every confirmation of the transaction and closes for good once the transaction
/// may have ended.
#[derive(Clone, Debug)]
pub struct Gate(Arc<AtomicU64>);

/// A [`Gate`]'s value for "closed": no event may start out any more.
const CLOSED: u64 = 0;
/// A [`Gate`]'s value for "always open": an event not bound to a transaction.
const ALWAYS: u64 = u64::MAX;

impl Gate {
    /// A gate that never closes: for an event published outside a batch's transaction (tests,
    /// tools).
    pub fn always() -> Gate {
        Gate(Arc::new(AtomicU64::new(ALWAYS)))
    }

    /// A gate that lets events start out until `until`.
    pub fn until(until: Instant) -> Gate {
        Gate(Arc::new(AtomicU64::new(since_start(until))))
    }

    /// A gate that lets nothing out.
    pub fn closed() -> Gate {
        Gate(Arc::new(AtomicU64::new(CLOSED)))
    }

    fn set(&self, until: Instant) {
        // Never reopens a closed gate: once the transaction may have ended, it stays so.
        let _ = self
            .0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |old| {
                (old != CLOSED).then(|| since_start(until).max(old))
            });
    }

    fn close(&self) {
        self.0.store(CLOSED, Ordering::SeqCst);
    }

    /// Whether an event may start out now.
    pub fn allows_now(&self) -> bool {
        match self.0.load(Ordering::SeqCst) {
            CLOSED => false,
            ALWAYS => true,
            until => since_start(Instant::now()) <= until,
        }
    }
}

/// `t` in nanoseconds since the process first asked (at least 1, so never [`CLOSED`]).
fn since_start(t: Instant) -> u64 {
    static START: OnceLock<std::time::Instant> = OnceLock::new();
    let start = *START.get_or_init(std::time::Instant::now);
    let nanos = t.into_std().saturating_duration_since(start).as_nanos();
    u64::try_from(nanos)
        .unwrap_or(ALWAYS - 1)
        .clamp(1, ALWAYS - 1)
}

/// One batch's transaction, as far as the relay knows it: see the module documentation.
pub struct Open<'a> {
    client: &'a Client,
    deadline: Duration,
    window: Duration,
    /// When the last statement of the transaction that the server answered was sent: the
    /// server cannot have ended the transaction by its idle timeout before `idle` after it.
    confirmed: Cell<Instant>,
    /// Why the transaction may be gone, once the relay knows or fears so.
    lost: RefCell<Option<String>>,
    /// `confirmed` + `window`, for the sinks; closed once `lost` is set.
    gate: Gate,
    /// Wakes [`Open::keep_alive`] when `lost` is set by a check.
    lost_now: tokio::sync::Notify,
    /// One confirmation at a time; those who waited for it share its answer.
    confirming: tokio::sync::Mutex<()>,
}

impl<'a> Open<'a> {
    /// The transaction on `client` that a claim sent at `sent` opened, with idle timeout `idle`
    /// (what the claim set), for a sink whose events may take `in_flight` to arrive.
    pub fn new(
        client: &'a Client,
        sent: Instant,
        idle: Duration,
        in_flight: Duration,
        deadline: Duration,
    ) -> Open<'a> {
        let window = window(idle, in_flight);
        Open {
            client,
            deadline,
            window,
            gate: Gate::until(sent + window),
            confirmed: Cell::new(sent),
            lost: RefCell::new(None),
            lost_now: tokio::sync::Notify::new(),
            confirming: tokio::sync::Mutex::new(()),
        }
    }

    /// When the last statement of the transaction that the server answered was sent.
    pub fn confirmed(&self) -> Instant {
        self.confirmed.get()
    }

    /// The gate every event of the batch passes where it leaves for the sink.
    pub fn gate(&self) -> &Gate {
        &self.gate
    }

    /// Why the transaction may have ended, if the relay knows or fears it did.
    pub fn lost(&self) -> Option<String> {
        self.lost.borrow().clone()
    }

    fn lose(&self, why: String) {
        let mut lost = self.lost.borrow_mut();
        if lost.is_none() {
            self.gate.close();
            *lost = Some(why);
            self.lost_now.notify_waiters();
        }
    }

    /// Whether the transaction is known to be open at `now` without asking the server: not
    /// lost, its session not closed, and `now` within the window since the last answered
    /// statement. When this says no, [`Open::may_publish`] decides.
    pub fn known_open_at(&self, now: Instant) -> bool {
        self.lost.borrow().is_none()
            && !self.client.is_closed()
            && now <= self.confirmed.get() + self.window
    }

    /// Whether an event may start out now: the transaction is known to be open (confirming it
    /// with a round trip when the window since the last answered statement has passed). Once
    /// it says no, it always does.
    pub async fn may_publish(&self) -> bool {
        let started = Instant::now();
        loop {
            if self.lost.borrow().is_some() {
                return false;
            }
            if self.client.is_closed() {
                self.lose("its session ended".into());
                return false;
            }
            if Instant::now() <= self.confirmed.get() + self.window {
                return true;
            }
            if started.elapsed() > self.deadline {
                // Each round trip came back, but too late to publish on.
                self.lose(format!(
                    "the database took longer than {} to confirm it",
                    fmt::duration(self.window)
                ));
                return false;
            }
            self.confirm().await;
        }
    }

    /// One round trip on the transaction (shared with whoever asks meanwhile): its answer moves
    /// `confirmed`; an error or no answer within the deadline loses the transaction.
    async fn confirm(&self) {
        let asked = Instant::now();
        let _turn = self.confirming.lock().await;
        if self.lost.borrow().is_some() || self.confirmed.get() >= asked {
            return;
        }
        let sent = Instant::now();
        match tokio::time::timeout(self.deadline, self.client.batch_execute("SELECT 1")).await {
            Ok(Ok(())) => {
                self.confirmed.set(sent);
                self.gate.set(sent + self.window);
            }
            Ok(Err(e)) => self.lose(format!("its session ended ({})", db::reason(&e))),
            Err(_) => self.lose(
                silent(
                    "a check that the batch's transaction is open",
                    self.deadline,
                )
                .0,
            ),
        }
    }

    /// Confirms the transaction every half window while the batch is published, so that a sink
    /// that takes long does not leave it idle until the server ends it. Returns once the
    /// transaction is lost (the caller then abandons the publication); runs until then.
    pub async fn keep_alive(&self) {
        loop {
            let lost = self.lost_now.notified();
            tokio::pin!(lost);
            lost.as_mut().enable();
            if self.lost.borrow().is_some() {
                return;
            }
            let due = self.confirmed.get() + self.window / 2;
            tokio::select! {
                _ = tokio::time::sleep_until(due) => {
                    if Instant::now() >= self.confirmed.get() + self.window / 2 {
                        self.confirm().await;
                    }
                }
                _ = &mut lost => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gate_lets_events_out_until_its_deadline_and_never_reopens_once_closed() {
        let now = Instant::now();
        assert!(Gate::always().allows_now());
        assert!(!Gate::closed().allows_now());
        let gate = Gate::until(now + Duration::from_secs(60));
        assert!(gate.allows_now());
        // A confirmation moves it on, never back.
        gate.set(now);
        assert!(gate.allows_now(), "a later deadline stays");
        let past = Gate::until(now);
        std::thread::sleep(Duration::from_millis(2));
        assert!(!past.allows_now(), "its deadline has passed");
        past.set(Instant::now() + Duration::from_secs(60));
        assert!(
            past.allows_now(),
            "a confirmation reopens a gate whose deadline passed"
        );
        // Once the transaction may have ended, nothing reopens it.
        gate.close();
        assert!(!gate.allows_now());
        gate.set(Instant::now() + Duration::from_secs(60));
        assert!(!gate.allows_now(), "a closed gate stays closed");
        // Shared: what the sink holds is the same gate.
        let held = past.clone();
        past.close();
        assert!(!held.allows_now());
    }

    #[test]
    fn the_window_leaves_room_for_an_event_under_way_and_a_margin() {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        // The relay's own timeout: the window whatever the sink.
        assert_eq!(window(idle_timeout(s(0)), s(0)), WINDOW);
        assert_eq!(window(idle_timeout(s(30)), s(30)), WINDOW);
        // An operator's shorter timeout: what is left after the margin and the event under way…
        assert_eq!(window(s(5), s(0)), s(4));
        assert_eq!(window(s(8), s(2)), s(5));
        assert_eq!(window(ms(400), s(0)), ms(300));
        // …and when that is too short to be of use, half of what the margin leaves (the margin
        // at most a quarter).
        assert_eq!(window(s(2), s(30)), ms(750));
        assert_eq!(window(s(31), s(30)), s(15));
        assert_eq!(window(Duration::ZERO, s(0)), Duration::ZERO);
    }
}
