//! A child stopped on its way out of leasectl's process group is continued with leasectl.
//!
//! A child leaves leasectl's process group between its start and its exec (`setpgid`, into a
//! group of its own or its watchdog's), and the spawn waits for its `exec`. A stop signal sent
//! to leasectl's group (`kill -STOP -PGID`, a terminal's Ctrl-Z) while the child is still a
//! member is the child's too, and if the child leaves the group before it stops, the SIGCONT
//! that later continues leasectl's group does not reach it. The child then never execs, the
//! spawn never returns, and leasectl (one thread) answers nothing any more, signals included: a
//! relay with an `exec:` sink hung that way after a SIGSTOP and a SIGCONT of its group.
//!
//! So a child names itself in a page it shares with leasectl (a `MAP_SHARED` mapping, shared
//! whether the child was forked or shares leasectl's memory until its exec) before it leaves
//! the group, and leasectl's SIGCONT handler continues every child named there. The name is
//! cleared once the spawn returns: the child has exec'd by then, and leasectl has not reaped it
//! yet, so the pid cannot have been reused.

use std::sync::atomic::{AtomicI32, AtomicPtr, Ordering};
use std::sync::OnceLock;

/// How many spawns may be under way at once (one is, in leasectl; tests spawn in parallel).
const SLOTS: usize = 64;

/// A slot: 0 free, -1 taken by a spawn whose child has not named itself yet, else its pid.
type Cell = AtomicI32;

/// The shared page's slots; null until [`page`] mapped them.
static PAGE: AtomicPtr<Cell> = AtomicPtr::new(std::ptr::null_mut());

/// The slots, mapped and the handler installed on first use; `None` if either failed (the
/// spawn then goes on without: the window is small, and nothing else depends on it).
fn page() -> Option<&'static [Cell]> {
    static READY: OnceLock<bool> = OnceLock::new();
    if !*READY.get_or_init(install) {
        return None;
    }
    let p = PAGE.load(Ordering::Acquire);
    // SAFETY: `install` mapped SLOTS cells, zeroed (free), and never unmaps them.
    Some(unsafe { std::slice::from_raw_parts(p, SLOTS) })
}

fn install() -> bool {
    let len = SLOTS * std::mem::size_of::<Cell>();
    // SAFETY: a fresh anonymous mapping, used only as atomics from here on.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return false;
    }
    PAGE.store(p.cast(), Ordering::Release);
    // SAFETY: the handler makes only async-signal-safe calls (getpid, kill) and atomic loads.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigcont as extern "C" fn(libc::c_int) as libc::sighandler_t;
        action.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGCONT, &action, std::ptr::null_mut()) == 0
    }
}

/// leasectl was continued: so is every child named in the page.
extern "C" fn on_sigcont(_: libc::c_int) {
    let p = PAGE.load(Ordering::Acquire);
    if p.is_null() {
        return;
    }
    // SAFETY: as in `page`; errno is saved and restored around the calls.
    unsafe {
        let errno = *libc::__errno_location();
        let me = libc::getpid();
        for cell in std::slice::from_raw_parts(p, SLOTS) {
            let pid = cell.load(Ordering::Relaxed);
            if pid > 0 && pid != me {
                libc::kill(pid, libc::SIGCONT);
            }
        }
        *libc::__errno_location() = errno;
    }
}

/// One spawn's slot, freed when dropped (once the spawn has returned).
pub struct Slot(Option<&'static Cell>);

impl Slot {
    /// Takes a free slot (none when all are taken, or the page could not be set up).
    pub fn take() -> Slot {
        let cell = page().and_then(|cells| {
            cells.iter().find(|c| {
                c.compare_exchange(0, -1, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            })
        });
        Slot(cell)
    }

    /// For the child, before its exec: [`name_child`] with this slot.
    pub fn cell(&self) -> Option<&'static Cell> {
        self.0
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(cell) = self.0 {
            cell.store(0, Ordering::Release);
        }
    }
}

/// In the child, before its exec and before it leaves leasectl's group: names the child in
/// its slot, and gives SIGCONT its default action back (the handler, inherited with the fork,
/// would continue the child itself, forever). Async-signal-safe.
pub fn name_child(cell: Option<&Cell>) {
    // SAFETY: signal and getpid are async-signal-safe system calls.
    unsafe {
        libc::signal(libc::SIGCONT, libc::SIG_DFL);
        if let Some(cell) = cell {
            cell.store(libc::getpid(), Ordering::Release);
        }
    }
}
