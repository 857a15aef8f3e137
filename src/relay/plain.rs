//! When the relay asks for the plain claim ("The plain claim" in [`outbox`](crate::store::outbox)), and what it
//! tells about the statements that claimed its batches.
//!
//! The plain claim is tried for every batch unless it declined within the last
//! [`PLAIN_RETRY`]: what made it decline (a dead event, an aggregate another relay holds, a
//! burst on a few aggregates, a compressed payload, a batch over `--batch-bytes`) usually
//! lasts a while, and each decline costs the plain statement's work on top of the general
//! claim's. So while those conditions last the relay pays for one plain claim a second, and
//! once they are gone it is back on the plain claim within a second.

use std::time::Duration;

use tokio::time::Instant;

use crate::store::outbox::Via;

/// After the plain claim declined, how long the relay claims with the general statement only.
const PLAIN_RETRY: Duration = Duration::from_secs(1);

/// How many batches each statement claimed (reported with `-v` when the relay ends).
#[derive(Debug, Default)]
pub(super) struct Claims {
    plain: u64,
    general: u64,
    fallback: u64,
    /// Until when the relay does not try the plain claim.
    not_before: Option<Instant>,
}

impl Claims {
    /// One line for `-v`, or None before any batch was claimed.
    pub(super) fn summary(&self) -> Option<String> {
        let all = self.plain + self.general + self.fallback;
        (all > 0).then(|| {
            format!(
                "claims: {all} ({} by the plain claim, {} by the general claim, {} after the plain claim declined)",
                self.plain, self.general, self.fallback
            )
        })
    }
}

impl Claims {
    /// Whether the next claim may try the plain claim first.
    pub(super) fn plain_now(&self) -> bool {
        self.not_before.is_none_or(|t| Instant::now() >= t)
    }

    /// After a claim that `via` claimed: counted, and after a decline the plain claim rests.
    pub(super) fn record(&mut self, via: Via) {
        match via {
            Via::Plain => self.plain += 1,
            Via::General => self.general += 1,
            Via::Fallback(why) => {
                self.fallback += 1;
                info!(
                    "the plain claim declined ({}); the general claim for the next {}",
                    why.describe(),
                    crate::fmt::duration(PLAIN_RETRY)
                );
                self.not_before = Some(Instant::now() + PLAIN_RETRY);
            }
        }
    }
}
