//! Looking past the claim's window (step 2 of [`outbox`]'s claim): when the next claim does,
//! and how far.

use std::time::Duration;

use tokio::time::Instant;

use super::Relay;
use crate::store::outbox::{self, Claimed, Reach};

/// While the claim fills its batches from its window alone, how often it still looks past the
/// window for aggregates waiting behind a burst ([`outbox::claim`]'s `reach`).
const REACH_EVERY: Duration = Duration::from_secs(1);

/// Whether the claim after one that found `claimed` should look past its window
/// ([`Relay::reach_now`]): it came back short, or found something there.
fn reach_next(batch: i64, claimed: &[Claimed]) -> bool {
    (claimed.len() as i64) < batch || claimed.iter().any(|c| c.reached)
}

/// After a claim that looked as far as `reach` (`windows` being what the relay had asked of
/// looks past the window so far): whether the next claim should look past the window, and how
/// much the next look takes in — twice as much after a look that still left the batch short,
/// one window again after a full batch (see `Relay::reach_now`).
pub(super) fn reach_after(
    batch: i64,
    reach: Reach,
    windows: u32,
    claimed: &[Claimed],
) -> (bool, u32) {
    let windows = match reach {
        Reach::Windows(n) if (claimed.len() as i64) < batch => {
            n.saturating_mul(2).min(outbox::REACH_FACTOR)
        }
        Reach::Windows(_) => 1,
        Reach::None => windows,
    };
    (reach_next(batch, claimed), windows)
}

impl Relay {
    /// Whether the next claim should look past its window (step 2 of [`outbox`]'s claim).
    /// Looking past the window costs a scan of up to 100 windows; it is worth it only while it
    /// finds something or the batches come back short (a burst, or heads that other relays
    /// hold). A relay draining one long chain in full batches looks once a second, so others
    /// that queue up behind it wait at most about that long.
    ///
    /// How far it looks grows while it keeps coming back short: the events just past the
    /// window may all belong to aggregates whose heads other sessions hold (a relay's frozen
    /// backends, another relay's batches, while writers add to those aggregates), and a look
    /// of one window would then find them again and again and never the aggregates behind
    /// them. Each short batch doubles it, up to the whole reach; a full one starts over.
    pub(super) fn reach_now(&mut self) -> Reach {
        let reach = self.reach_next || self.reach_at.is_none_or(|t| t.elapsed() >= REACH_EVERY);
        if !reach {
            return Reach::None;
        }
        self.reach_at = Some(Instant::now());
        Reach::Windows(self.reach_windows)
    }

    /// After a claim that looked as far as `reach`: what the next one should do.
    pub(super) fn claimed(&mut self, reach: Reach, claimed: &[Claimed]) {
        (self.reach_next, self.reach_windows) =
            reach_after(self.cfg.batch, reach, self.reach_windows, claimed);
    }
}
