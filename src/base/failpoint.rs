//! Fault injection: make the k-th pass through a failure site fail with a chosen error, to test
//! that every operation fails cleanly and loses nothing.
//!
//! Compiled in only with the `failpoints` cargo feature; without it the internal check at each site is an empty inline
//! function and costs nothing. With it, a site costs one relaxed atomic load until a fault is
//! armed.
//!
//! ```ignore
//! use strata::failpoint::{self, Fault, Site};
//! failpoint::arm(Site::DiskWrite, 3, Fault::NoSpace); // the 3rd disk write from now fails
//! // ... run operations; the one that hits it returns Error::DiskFull ...
//! assert!(failpoint::fired());
//! failpoint::disarm();
//! ```
//! Armed faults are global to the process: tests that arm them run one at a time.

use std::path::Path;

use crate::base::error::Result;

/// A place where the library can fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Site {
    /// A backend memory allocation (tier arenas and staging buffers at build).
    Alloc,
    /// A copy issued to a stream (host-to-device, device-to-host or device-to-device).
    Copy,
    /// A host copy into or out of a host tier or staging buffer.
    HostCopy,
    /// Recording an event on a stream.
    EventRecord,
    /// Making a stream wait for an event.
    StreamWait,
    /// A host thread waiting for an event (synchronize).
    Synchronize,
    /// Opening the disk tier's file.
    DiskOpen,
    /// A read from the disk tier's file.
    DiskRead,
    /// A write to the disk tier's file.
    DiskWrite,
    /// A read of a user's tensor file (safetensors).
    FileRead,
    /// Starting the engine's worker threads.
    WorkerStart,
    /// Writing a file being saved.
    SaveWrite,
    /// Flushing a file being saved to disk.
    SaveSync,
    /// Renaming a saved file into place.
    SaveRename,
    /// A computation of a framework built on the store failing (the candle trainer's stages:
    /// an error candle could return).
    Compute,
}

impl Site {
    /// Every site.
    pub const ALL: [Site; 15] = [
        Site::Alloc,
        Site::Copy,
        Site::HostCopy,
        Site::EventRecord,
        Site::StreamWait,
        Site::Synchronize,
        Site::DiskOpen,
        Site::DiskRead,
        Site::DiskWrite,
        Site::FileRead,
        Site::WorkerStart,
        Site::SaveWrite,
        Site::SaveSync,
        Site::SaveRename,
        Site::Compute,
    ];
}

/// The error an armed site fails with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// An I/O error (`EIO`).
    Io,
    /// The file system is full (`ENOSPC`).
    NoSpace,
    /// A write that stops short (reported as `EIO` after part of the bytes).
    ShortWrite,
    /// A backend error (a failed CUDA call, or its host-backend stand-in).
    Backend,
    /// Out of memory.
    OutOfMemory,
    /// The process ends at the site at once (`std::process::abort`): nothing after it runs,
    /// no destructor, no clean-up, as `kill -9` would leave things. Tests run this in a child
    /// process and look at what it left on disk.
    Kill,
}

#[cfg(feature = "failpoints")]
mod imp {
    use std::sync::atomic::{AtomicBool, Ordering};

    use parking_lot::Mutex;

    use super::{Fault, Site};

    pub(super) static ARMED: AtomicBool = AtomicBool::new(false);
    /// (site, passes left before the fault, fault, whether every later pass fails too), hit
    /// counts per site, whether it fired.
    pub(super) static STATE: Mutex<State> =
        Mutex::new(State { armed: None, fired: false, hits: Vec::new() });

    pub(super) struct State {
        pub(super) armed: Option<(Site, u64, Fault, bool)>,
        pub(super) fired: bool,
        pub(super) hits: Vec<(Site, u64)>,
    }

    pub(super) fn pass(site: Site) -> Option<Fault> {
        if !ARMED.load(Ordering::Relaxed) {
            return None;
        }
        let mut s = STATE.lock();
        match s.hits.iter_mut().find(|(x, _)| *x == site) {
            Some((_, n)) => *n += 1,
            None => s.hits.push((site, 1)),
        }
        match &mut s.armed {
            Some((x, left, fault, sticky)) if *x == site => {
                *left -= 1;
                if *left == 0 {
                    let f = *fault;
                    if *sticky {
                        *left = 1;
                    } else {
                        s.armed = None;
                    }
                    s.fired = true;
                    if std::env::var_os("STRATA_FAILPOINT_BACKTRACE").is_some() {
                        // Where a fault fired, for debugging a test that found a loss.
                        eprintln!(
                            "{site:?} fails here:\n{}",
                            std::backtrace::Backtrace::force_capture()
                        );
                    }
                    return Some(f);
                }
                None
            }
            _ => None,
        }
    }
}

/// Arms `site` to fail with `fault` on its `nth` pass from now (1 = the next one). Replaces any
/// fault armed before and resets the pass counts. With the `failpoints` feature only.
#[cfg(feature = "failpoints")]
pub fn arm(site: Site, nth: u64, fault: Fault) {
    arm_with(site, nth, fault, false);
}

/// Like [`arm`], but every pass from the `nth` on fails (a disk that stays full, memory that
/// stays short) until [`disarm`]. With the `failpoints` feature only.
#[cfg(feature = "failpoints")]
pub fn arm_from(site: Site, nth: u64, fault: Fault) {
    arm_with(site, nth, fault, true);
}

#[cfg(feature = "failpoints")]
fn arm_with(site: Site, nth: u64, fault: Fault, sticky: bool) {
    let mut s = imp::STATE.lock();
    s.armed = Some((site, nth.max(1), fault, sticky));
    s.fired = false;
    s.hits.clear();
    imp::ARMED.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Counts passes through every site without failing any (to learn how often a workload reaches
/// each). With the `failpoints` feature only.
#[cfg(feature = "failpoints")]
pub fn count() {
    let mut s = imp::STATE.lock();
    s.armed = None;
    s.fired = false;
    s.hits.clear();
    imp::ARMED.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Passes through `site` since the last [`arm`] or [`count`].
#[cfg(feature = "failpoints")]
pub fn hits(site: Site) -> u64 {
    imp::STATE.lock().hits.iter().find(|(x, _)| *x == site).map_or(0, |(_, n)| *n)
}

/// Whether the armed fault has fired.
#[cfg(feature = "failpoints")]
pub fn fired() -> bool {
    imp::STATE.lock().fired
}

/// Disarms every site and stops counting.
#[cfg(feature = "failpoints")]
pub fn disarm() {
    imp::ARMED.store(false, std::sync::atomic::Ordering::Relaxed);
    let mut s = imp::STATE.lock();
    s.armed = None;
}

#[cfg(feature = "failpoints")]
static COPY_DELAY_US: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Makes every copy the host backend's streams run take `delay` first (zero: none). A GPU's
/// copies take time; on the host they take microseconds, which hides races between a copy in
/// flight and the reuse of the memory it touches: tests widen that window with this. With the
/// `failpoints` feature only.
#[cfg(feature = "failpoints")]
pub fn slow_copies(delay: std::time::Duration) {
    let us = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
    COPY_DELAY_US.store(us, std::sync::atomic::Ordering::Relaxed);
}

/// The delay [`slow_copies`] set, if any (never without the `failpoints` feature).
#[inline(always)]
pub(crate) fn copy_delay() -> Option<std::time::Duration> {
    #[cfg(feature = "failpoints")]
    {
        let us = COPY_DELAY_US.load(std::sync::atomic::Ordering::Relaxed);
        if us > 0 {
            return Some(std::time::Duration::from_micros(us));
        }
    }
    None
}

/// Fails if a fault is armed at `site` and this is its pass. `what` names the file or object the
/// error is about.
#[inline(always)]
pub(crate) fn check(site: Site, what: &Path) -> Result<()> {
    #[cfg(feature = "failpoints")]
    if let Some(f) = imp::pass(site) {
        return Err(fault_error(site, f, what));
    }
    let _ = (site, what);
    Ok(())
}

#[cfg(feature = "failpoints")]
fn fault_error(site: Site, f: Fault, what: &Path) -> crate::Error {
    use crate::Error;
    let io = |code: i32| Error::io(what, std::io::Error::from_raw_os_error(code));
    match f {
        Fault::Io | Fault::ShortWrite => io(libc::EIO),
        Fault::NoSpace => io(libc::ENOSPC),
        Fault::Backend => Error::Cuda {
            call: "failpoint",
            message: format!("injected backend failure at {site:?}"),
        },
        Fault::OutOfMemory => Error::OutOfMemory { tier: crate::Tier::Device, bytes: 0 },
        Fault::Kill => std::process::abort(),
    }
}
