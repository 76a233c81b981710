//! What every layer may use to wait and to check how it waits: [`Signal`], a one-shot completion
//! flag, and the held-lock check (debug builds) that no host wait happens under a store's lock.
//!
//! Under the store's lock a call only decides and records; disk I/O, host copies and every host
//! wait run outside it. The lock's guard counts itself here ([`note_locked`], [`note_unlocked`]),
//! and every blocking wait in the crate calls [`assert_unlocked`] first.

use std::cell::Cell;

thread_local! {
    /// Store locks this thread holds (debug check that no host wait happens under one).
    static HELD: Cell<u32> = const { Cell::new(0) };
}

/// Counts a store lock taken by this thread (the lock guard calls it).
pub(crate) fn note_locked() {
    HELD.with(|h| h.set(h.get() + 1));
}

/// Counts a store lock released by this thread.
pub(crate) fn note_unlocked() {
    HELD.with(|h| h.set(h.get().saturating_sub(1)));
}

/// Debug builds: panics if this thread holds a store's lock while about to block the host on
/// `what`. Under the lock a call only decides and records; every host wait happens outside it.
#[inline]
pub(crate) fn assert_unlocked(what: &str) {
    if cfg!(debug_assertions) {
        let held = HELD.with(Cell::get);
        assert!(held == 0, "host wait under the store's lock: {what}");
    }
}

/// A one-shot completion flag set by a host thread (the end of work a thread does without the
/// store's lock), waited for by others.
#[derive(Default)]
pub(crate) struct Signal {
    done: parking_lot::Mutex<bool>,
    cv: parking_lot::Condvar,
}

impl Signal {
    /// Sets the flag and wakes the waiters.
    pub(crate) fn set(&self) {
        *self.done.lock() = true;
        self.cv.notify_all();
    }

    /// Whether the flag is set.
    pub(crate) fn is_set(&self) -> bool {
        *self.done.lock()
    }

    /// Blocks until the flag is set. The caller holds no store lock.
    pub(crate) fn wait(&self) {
        assert_unlocked("waiting for a thread's work");
        let mut d = self.done.lock();
        while !*d {
            self.cv.wait(&mut d);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signal_wakes_its_waiters_once_set() {
        let s = std::sync::Arc::new(Signal::default());
        let w = {
            let s = s.clone();
            std::thread::spawn(move || s.wait())
        };
        assert!(!s.is_set());
        s.set();
        w.join().unwrap();
        assert!(s.is_set());
        s.wait(); // set already: returns at once
    }

    #[test]
    #[cfg(debug_assertions)]
    fn a_host_wait_under_a_lock_is_caught() {
        note_locked();
        let r = std::panic::catch_unwind(|| assert_unlocked("a test wait"));
        note_unlocked();
        assert!(r.is_err(), "a wait under the lock went unnoticed");
        assert_unlocked("after the lock");
    }
}
