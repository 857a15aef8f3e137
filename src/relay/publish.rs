//! Publishing one claimed batch: the one scheduler, and the rule it encodes once — an
//! aggregate's events go out one after another in `seq` order, and the first one that is not
//! delivered stops its aggregate for the rest of the batch (what follows it stays in the outbox,
//! so order is never broken).
//!
//! The batch is cut into *lanes*, each a list of events in `seq` order; up to `parallel` lanes
//! run at once. With `parallel` = 1 there is one lane holding the whole batch, so events leave
//! in creation order across aggregates too (what the stdout sink promises); otherwise each
//! aggregate is a lane of its own and different aggregates proceed concurrently.
//!
//! An event starts out only while the batch's transaction is known to be open
//! ([`Open::may_publish`]): once it may have ended, the rest of the batch stays unpublished
//! (stdout's buffered lines are dropped, not written), since its events are back in the outbox
//! for any relay to claim.
//!
//! One chain's failure never holds the others back: a refusal stops only its aggregate. An
//! unreachable sink ([`DeliveryError::Unavailable`]) stops the whole batch — and backs the relay
//! off — only while nothing in the batch has got through; once some delivery was answered, an
//! unreachable moment stops only the aggregate it hit (left untouched, no attempt charged). A
//! delivery that got no answer within `--timeout` ([`DeliveryError::NoAnswer`]) stops its
//! aggregate too, and is judged once the lanes are done (`Publisher::judge_silences`): the
//! event's refusal if the sink answered another delivery while it waited, else no fault of the
//! event's.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::time::Instant;

use futures_util::StreamExt;

use super::backoff::retry_delay;
use super::liveness::Open;
use super::sink::{DeliveryError, Sink};
use crate::fmt;
use crate::store::outbox::{Claimed, Settle};

/// The sink and the rules one batch is published with.
pub struct Publisher<'a> {
    pub sink: &'a Sink,
    /// How many lanes run at once (at least 1).
    pub parallel: usize,
    /// Attempts after which a refused event is dead (`--max-attempts`).
    pub max_attempts: i32,
}

impl Publisher<'_> {
    /// Publishes a claimed batch, whose transaction is `open`. Returns each event's fate and,
    /// if the sink was unreachable, why (everything not yet confirmed is then left untouched).
    /// Once the transaction may have ended ([`Open::lost`]), nothing more is published.
    pub async fn publish(
        &self,
        claimed: &[Claimed],
        open: &Open<'_>,
    ) -> (Vec<Settle>, Option<String>) {
        let down: RefCell<Option<String>> = RefCell::new(None);
        let answered = Cell::new(None);
        let silent = RefCell::new(Vec::new());
        let mut settled = vec![Settle::Untouched; claimed.len()];
        let lanes = if self.parallel == 1 {
            vec![(0..claimed.len()).collect()]
        } else {
            chains(claimed)
        };
        let results: Vec<Vec<(usize, Settle)>> = futures_util::stream::iter(lanes)
            .map(|lane| self.run_lane(lane, claimed, open, &down, &answered, &silent))
            .buffer_unordered(self.parallel.max(1))
            .collect()
            .await;
        for (i, s) in results.into_iter().flatten() {
            settled[i] = s;
        }
        self.judge_silences(claimed, &mut settled, silent.into_inner(), &answered, &down);
        // Stdout writes its buffered lines here: the transaction must still be open then.
        if !open.may_publish().await {
            self.sink.discard();
            for s in settled.iter_mut() {
                if matches!(s, Settle::Delivered) {
                    *s = Settle::Untouched;
                }
            }
            return (settled, down.into_inner());
        }
        if let Err(e) = self.sink.flush().await {
            // Nothing is confirmed until the batch's flush is.
            for s in settled.iter_mut() {
                if matches!(s, Settle::Delivered) {
                    *s = Settle::Untouched;
                }
            }
            down.borrow_mut().get_or_insert(e.to_string());
        }
        (settled, down.into_inner())
    }

    /// Delivers a lane's events one at a time, skipping every later event of an aggregate after
    /// its first one that was not delivered, and stopping altogether once the sink is down.
    async fn run_lane(
        &self,
        lane: Vec<usize>,
        claimed: &[Claimed],
        open: &Open<'_>,
        down: &RefCell<Option<String>>,
        answered: &Cell<Option<Instant>>,
        silent: &RefCell<Vec<Silence>>,
    ) -> Vec<(usize, Settle)> {
        let mut stopped: HashSet<(&str, &str)> = HashSet::new();
        let mut out = Vec::with_capacity(lane.len());
        // A sink that only buffers publishes nothing here: `publish` checks the transaction
        // once, before the flush, and its events need no look at the clock each.
        let buffered = self.sink.buffers_until_flush();
        for i in lane {
            if down.borrow().is_some() {
                break;
            }
            let c = &claimed[i];
            let key = (
                c.event.aggregate_type.as_str(),
                c.event.aggregate_id.as_str(),
            );
            if stopped.contains(&key) {
                continue;
            }
            // One look at the clock an event, where asking the transaction's state took two
            // (a thousand events a batch).
            let started = if buffered {
                None
            } else {
                let now = tokio::time::Instant::now();
                if !c.blocked && !open.known_open_at(now) && !open.may_publish().await {
                    break;
                }
                Some(now.into_std())
            };
            let s = match self.deliver_one(c, open, down, answered, buffered).await {
                Ok(s) => s,
                Err(msg) => {
                    let started = started.unwrap_or_else(Instant::now);
                    silent.borrow_mut().push(Silence { i, started, msg });
                    Settle::Untouched
                }
            };
            if !matches!(s, Settle::Delivered) {
                stopped.insert(key);
            }
            out.push((i, s));
        }
        out
    }

    /// Delivers one event. `answered` records when a delivery of the batch last got an answer
    /// (delivered or refused): from the first one on, an unreachable sink stops only this
    /// aggregate. No answer at all is returned as `Err`, for [`Publisher::judge_silences`].
    /// A `buffered` delivery is no answer of the sink's: it leaves `answered` alone.
    async fn deliver_one(
        &self,
        c: &Claimed,
        open: &Open<'_>,
        down: &RefCell<Option<String>>,
        answered: &Cell<Option<Instant>>,
        buffered: bool,
    ) -> Result<Settle, String> {
        if c.blocked {
            return Ok(Settle::Untouched);
        }
        Ok(match self.sink.deliver(&c.event, open.gate()).await {
            Ok(()) => {
                if !buffered {
                    answered.set(Some(Instant::now()));
                }
                Settle::Delivered
            }
            Err(DeliveryError::Late(msg)) => {
                info!(
                    "event {} ({} {}): {msg}; left for a later batch, no attempt charged",
                    c.event.id, c.event.aggregate_type, c.event.aggregate_id
                );
                Settle::Untouched
            }
            Err(DeliveryError::NoAnswer(msg)) => return Err(msg),
            Err(DeliveryError::Unavailable(msg)) => {
                if answered.get().is_some() {
                    info!(
                        "event {} ({} {}): {msg}; left for the next batch, no attempt charged",
                        c.event.id, c.event.aggregate_type, c.event.aggregate_id
                    );
                } else {
                    down.borrow_mut().get_or_insert(msg);
                }
                Settle::Untouched
            }
            Err(DeliveryError::Rejected(error)) => {
                answered.set(Some(Instant::now()));
                self.refused(c, error)
            }
        })
    }

    /// An event the sink refused: one more attempt, the backoff, and dead after
    /// `--max-attempts`.
    fn refused(&self, c: &Claimed, error: String) -> Settle {
        let attempt = c.attempts.saturating_add(1);
        Settle::Failed {
            error,
            retry_in: retry_delay(attempt, fastrand::f64()),
            dead: attempt >= self.max_attempts,
            refused_at: Instant::now(),
        }
    }

    /// The deliveries that got no answer within `--timeout`: the event's refusal when the sink
    /// answered another delivery while it waited (the sink is alive, this event is its
    /// problem); otherwise not the event's fault. Then, if anything of the batch was answered
    /// before, only its aggregate stops for this batch (nothing charged); if nothing was, the
    /// sink is down: the relay backs off (`--once` exits 69) and nothing is charged — a sink
    /// that answers nobody, a broker black-holed for minutes, must not turn healthy events dead.
    fn judge_silences(
        &self,
        claimed: &[Claimed],
        settled: &mut [Settle],
        silences: Vec<Silence>,
        answered: &Cell<Option<Instant>>,
        down: &RefCell<Option<String>>,
    ) {
        for Silence { i, started, msg } in silences {
            let c = &claimed[i];
            match answered.get() {
                Some(last) if last > started => settled[i] = self.refused(c, msg),
                Some(_) => info!(
                    "event {} ({} {}): {msg}, and nothing else was answered since; left for the next batch, no attempt charged",
                    c.event.id, c.event.aggregate_type, c.event.aggregate_id
                ),
                None => {
                    down.borrow_mut().get_or_insert(msg);
                }
            }
        }
    }

    /// Warns about each refused event: when it is retried, or that it is dead and what to do.
    pub fn report_failures(&self, claimed: &[Claimed], settled: &[Settle]) {
        for (c, s) in claimed.iter().zip(settled) {
            let Settle::Failed {
                error,
                retry_in,
                dead,
                ..
            } = s
            else {
                continue;
            };
            let e = &c.event;
            let what = format!(
                "event {} ({} {}, {})",
                e.id, e.aggregate_type, e.aggregate_id, e.event_type
            );
            let attempt = c.attempts.saturating_add(1);
            if *dead {
                warn!(
                    "{what} is dead after {attempt} attempts: {error}; later events of its aggregate wait until `leasectl outbox retry {}` or `outbox discard {}`",
                    e.id, e.id
                );
            } else {
                warn!(
                    "{what} failed (attempt {attempt} of {}): {error}; retrying in {}",
                    self.max_attempts,
                    fmt::duration(*retry_in)
                );
            }
        }
    }
}

/// A delivery that got no answer: which event, when it started, and what the sink said.
struct Silence {
    i: usize,
    started: Instant,
    msg: String,
}

/// The claimed events grouped by aggregate, each group in `seq` order, groups in the order of
/// their first event.
fn chains(claimed: &[Claimed]) -> Vec<Vec<usize>> {
    let mut index: HashMap<(&str, &str), usize> = HashMap::new();
    let mut chains: Vec<Vec<usize>> = Vec::new();
    for (i, c) in claimed.iter().enumerate() {
        let key = (
            c.event.aggregate_type.as_str(),
            c.event.aggregate_id.as_str(),
        );
        let n = *index.entry(key).or_insert_with(|| {
            chains.push(Vec::new());
            chains.len() - 1
        });
        chains[n].push(i);
    }
    chains
}
