//! The relay keeps the memory a batch freed for the next batch instead of handing it back to
//! the kernel after every batch.
//!
//! A batch's rows arrive in buffers of a few hundred KiB (a thousand 200-byte events are about
//! 400 KiB of rows, kept until the batch is settled), freed together when the batch ends. glibc's
//! malloc gives the top of its heap back to the kernel as soon as more than `M_TRIM_THRESHOLD`
//! (128 KiB by default) of it is free, so each batch shrank the heap by what it had used and the
//! next one grew it again, page by page: about 100 page faults a batch, a third of the relay's
//! own CPU time in a drain of 50 batches to stdout. With up to [`KEEP`] kept free, the heap grows
//! to what the largest batch needs and stays there: the relay's resident size is its
//! high-water mark, which is what its peak was anyway. Allocations above the mmap threshold
//! (128 KiB: setting this one option keeps malloc from raising it) are still mapped and unmapped
//! on their own, so an event of many MiB is still handed back once published.

/// Free memory the heap keeps at its top before malloc trims it.
const KEEP: libc::c_int = 32 << 20;

/// Sets the trim threshold to [`KEEP`] for this process. A no-op where the C library is not
/// glibc; if glibc refuses the option, the relay only runs as it did before.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets a tunable of malloc; it is called before the relay allocates
    // its batches, and glibc serialises it with allocations on other threads.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, KEEP);
    }
}
