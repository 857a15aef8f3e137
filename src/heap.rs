//! Big futures built on the heap, so that the stack stays shallow.
//!
//! An `async fn` that awaits a big future builds it in a temporary of its poll function's stack
//! frame before moving it into its own state, and the frame is as big as the biggest such
//! temporary (plus the copies made when a future is moved into `select!`, `join!` or a wrapper
//! like a timeout). Nested, those frames reached hundreds of KiB in `leasectl run`. Every page
//! of a frame is touched on each poll (the stack probe), and every fork while leasectl lives
//! (its watchdog, its command) write-protects what is touched, so each of those pages faulted
//! once more after each fork: about a third of a run's page faults.
//!
//! [`on_heap`] builds a future in a frame of its own that is gone once the future is boxed, and
//! the box is polled through a `dyn` pointer, so its poll function stays a frame of its own
//! instead of being inlined into the caller's. Use it where a big future is awaited on a hot
//! path; a small one (a single statement) gains nothing from the allocation.

use std::future::Future;
use std::pin::Pin;

/// A boxed future, polled through a pointer.
pub type OnHeap<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// Builds the future `make` returns directly in a short-lived frame and moves it to the heap
/// (see the module docs). `make` is a closure, not the future itself: a future passed by value
/// would be built in the caller's frame, which is what this avoids.
#[inline(never)]
pub fn on_heap<'a, F: Future + 'a>(make: impl FnOnce() -> F) -> OnHeap<'a, F::Output> {
    Box::pin(make())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_boxed_future_runs_once_and_gives_its_output() {
        let mut polled = 0;
        let out = on_heap(|| async {
            polled += 1;
            tokio::task::yield_now().await;
            41 + 1
        })
        .await;
        assert_eq!((out, polled), (42, 1));
    }

    #[test]
    fn nothing_runs_before_the_box_is_polled() {
        let mut ran = false;
        let fut = on_heap(|| async {
            ran = true;
        });
        drop(fut);
        assert!(!ran);
    }
}
