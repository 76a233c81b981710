//! The host backend: every tier in host memory, copies on worker threads.
//!
//! A [`HostStream`] is a thread that runs jobs in the order they were issued, which is exactly the
//! ordering a CUDA stream gives; a [`HostEvent`] is a flag set by a job. Waiting a stream on an
//! event issues a job that blocks that stream's thread until the flag is set, so stream-ordering
//! bugs in the layers above show up on this backend as they would on a GPU.
//!
//! With a [`Simulation`] the streams have no threads: each operation runs at once on the calling
//! thread (issue order is a valid order, since a stream only ever waits for events recorded
//! before), and is placed in *simulated* time, where copies take the time the simulated link
//! would need and the host's clock only advances by a launch overhead per operation and by
//! waiting. Events complete at their simulated times. See [`Simulation`] for the model.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam::channel::{unbounded, Sender};
use parking_lot::{Condvar, Mutex};

use super::sim::{Lane, SimClock};
use super::{Addr, Block, BlockOwner, MemKind, RawStream};
use crate::base::error::{Error, Result};

/// Alignment of host-backend blocks: a page, so O_DIRECT reads may land in them.
const HOST_BLOCK_ALIGN: usize = 4096;

/// The host backend: emulated device memory and two copy "streams".
pub(crate) struct HostBackend {
    pub(crate) h2d: RawStream,
    pub(crate) d2h: RawStream,
    /// Simulated time, when the backend simulates a GPU machine.
    pub(crate) sim: Option<Arc<SimClock>>,
}

impl HostBackend {
    pub(crate) fn new() -> Result<HostBackend> {
        Ok(HostBackend {
            h2d: RawStream::Host(HostStream::new("strata-h2d")?),
            d2h: RawStream::Host(HostStream::new("strata-d2h")?),
            sim: None,
        })
    }

    /// A backend whose streams run in simulated time.
    pub(crate) fn simulated(clock: Arc<SimClock>) -> HostBackend {
        HostBackend {
            h2d: RawStream::Host(HostStream::simulated(&clock, Lane::H2d)),
            d2h: RawStream::Host(HostStream::simulated(&clock, Lane::D2h)),
            sim: Some(clock),
        }
    }

    /// A stream for the user's work.
    pub(crate) fn new_stream(&self) -> Result<Arc<HostStream>> {
        match &self.sim {
            Some(clock) => Ok(HostStream::simulated(clock, Lane::Compute)),
            None => HostStream::new("strata-user"),
        }
    }

    pub(crate) fn alloc(&self, kind: MemKind, len: usize) -> Result<Block> {
        // An anonymous private mapping: page-aligned, zeroed, and committed lazily, so a store
        // with large budgets costs nothing until tensors use them (an aligned `alloc_zeroed`
        // would write every page up front).
        let map_len = len.max(1).next_multiple_of(HOST_BLOCK_ALIGN);
        // SAFETY: a fresh anonymous mapping with no address hint; the result is checked below
        // and owned by the returned Block, which unmaps it once (Block's Drop).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::OutOfMemory { tier: kind_tier(kind), bytes: len as u64 });
        }
        let host = p as *mut u8;
        Ok(Block { host, dev: host as u64, len, kind, owner: BlockOwner::Host(map_len) })
    }
}

pub(crate) fn kind_tier(kind: MemKind) -> crate::Tier {
    match kind {
        MemKind::Device => crate::Tier::Device,
        MemKind::Pinned => crate::Tier::Pinned,
        MemKind::Mapped => crate::Tier::Mapped,
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// Counts a stream's job as run when dropped (after the job, panicking or not).
struct DoneGuard<'a>(&'a AtomicU64);

impl Drop for DoneGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Release);
    }
}

/// A worker thread that runs jobs in issue order: the host stand-in for a CUDA stream. A
/// simulated stream has no thread (see the module docs).
pub(crate) struct HostStream {
    tx: Option<Sender<Job>>,
    /// Jobs issued and not yet run: an event recorded while it is 0 is complete at once, and
    /// recording it wakes no thread (a view's drop records one under the store's lock, and
    /// waking the stream's thread there lets the scheduler run it in the lock holder's place).
    pending: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
    sim: Option<SimLane>,
}

/// A simulated stream's place in simulated time.
struct SimLane {
    clock: Arc<SimClock>,
    lane: Lane,
    /// When the work issued so far ends (simulated seconds).
    free_at: Mutex<f64>,
}

/// A raw copy to run on a stream thread.
struct CopyJob {
    dst: *mut u8,
    src: *const u8,
    len: usize,
}

// SAFETY: the issuer of a copy guarantees (RawStream::copy's contract) that both ranges stay valid
// and unaliased until the copy has run; the pointers are only used by whoever runs the job (the
// stream thread, or the issuing thread of a simulated stream).
unsafe impl Send for CopyJob {}

impl CopyJob {
    fn run(self) {
        // SAFETY: RawStream::copy's contract: both ranges are live, `len` long, and not touched
        // by anyone else until this job has completed. Extents of one arena never overlap, and
        // a copy never has the same extent as source and destination, so the ranges are disjoint.
        unsafe { std::ptr::copy_nonoverlapping(self.src, self.dst, self.len) }
    }
}

fn host_ptr(a: Addr) -> *mut u8 {
    match a {
        Addr::Host(p) => p,
        Addr::Dev(d) => d as usize as *mut u8,
    }
}

impl HostStream {
    pub(crate) fn new(name: &str) -> Result<Arc<HostStream>> {
        let (tx, rx) = unbounded::<Job>();
        let pending = Arc::new(AtomicU64::new(0));
        let left = pending.clone();
        let thread = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                for job in rx {
                    let _done = DoneGuard(&left);
                    // A panicking job (a user's `launch_host` closure) must not stop the
                    // stream: the events queued behind it would never complete, and every wait
                    // on them would hang. The panic is reported (the hook printed it) and the
                    // stream goes on, as a GPU stream goes on after a kernel's fault is caught.
                    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                        tracing::error!(
                            "a job on a host-backend stream panicked; the stream goes on"
                        );
                    }
                }
            })
            .map_err(|e| Error::io("<thread spawn>", e))?;
        Ok(Arc::new(HostStream { tx: Some(tx), pending, thread: Some(thread), sim: None }))
    }

    /// A stream that runs its work at once and places it in `clock`'s simulated time.
    pub(crate) fn simulated(clock: &Arc<SimClock>, lane: Lane) -> Arc<HostStream> {
        Arc::new(HostStream {
            tx: None,
            pending: Arc::new(AtomicU64::new(0)),
            thread: None,
            sim: Some(SimLane { clock: clock.clone(), lane, free_at: Mutex::new(0.0) }),
        })
    }

    /// The simulated clock, for a simulated stream.
    pub(crate) fn sim_clock(&self) -> Option<&Arc<SimClock>> {
        self.sim.as_ref().map(|l| &l.clock)
    }

    /// Simulated: places an operation of `seconds` (or, for a copy, of `copy_bytes` over the
    /// lane's link) after the stream's earlier work and after the host issued it.
    fn sim_issue(lane: &SimLane, seconds: f64, copy_bytes: Option<usize>) {
        let issued = lane.clock.issue();
        let mut free = lane.free_at.lock();
        let start = free.max(issued);
        *free = match copy_bytes {
            Some(n) => lane.clock.copy_end(lane.lane, start, n),
            None => start + seconds,
        };
    }

    fn submit(&self, job: Job) {
        // The receiver lives until this stream is dropped, so send cannot fail while `self` is
        // alive; if the thread died (a job panicked), run the job here rather than lose it.
        if let Some(tx) = &self.tx {
            self.pending.fetch_add(1, Ordering::AcqRel);
            if let Err(e) = tx.send(job) {
                self.pending.fetch_sub(1, Ordering::AcqRel);
                (e.into_inner())();
            }
        }
    }

    /// Issues a copy.
    ///
    /// # Safety
    /// See [`RawStream::copy`](super::RawStream::copy).
    pub(crate) unsafe fn copy(&self, dst: Addr, src: Addr, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let job = CopyJob { dst: host_ptr(dst), src: host_ptr(src), len };
        match &self.sim {
            Some(lane) => {
                // Issue order is a valid order (module docs): copy now, account for it in
                // simulated time.
                job.run();
                Self::sim_issue(lane, 0.0, Some(len));
            }
            None => self.submit(Box::new(move || {
                if let Some(d) = crate::base::failpoint::copy_delay() {
                    std::thread::sleep(d);
                }
                job.run()
            })),
        }
        Ok(())
    }

    /// An event set once every job issued before it has run.
    pub(crate) fn record(&self) -> Arc<HostEvent> {
        if let Some(lane) = &self.sim {
            let at = lane.free_at.lock().max(lane.clock.now());
            return Arc::new(HostEvent::simulated(lane.clock.clone(), at));
        }
        let ev = Arc::new(HostEvent::default());
        if self.pending.load(Ordering::Acquire) == 0 {
            // Everything issued so far has run: complete now, no job, no thread woken.
            ev.set();
            return ev;
        }
        let e = ev.clone();
        self.submit(Box::new(move || e.set()));
        ev
    }

    /// Later jobs on this stream wait until `ev` is set.
    pub(crate) fn wait(&self, ev: Arc<HostEvent>) {
        if let Some(lane) = &self.sim {
            match ev.sim_time() {
                Some(at) => {
                    let mut free = lane.free_at.lock();
                    *free = free.max(at);
                }
                // A threaded stream's event (stores are not meant to mix, and refuse to): this
                // stream's work runs as it is issued, so it must not start before that event.
                None => ev.synchronize(),
            }
            return;
        }
        if ev.is_complete() {
            return;
        }
        self.submit(Box::new(move || ev.synchronize()));
    }

    /// Runs `f` on the stream thread after everything issued before: how host-backend users run
    /// their "kernels" in stream order. Simulated: runs `f` now, taking no simulated time.
    pub(crate) fn launch(&self, f: Box<dyn FnOnce() + Send>) {
        self.launch_timed(f, 0.0);
    }

    /// [`HostStream::launch`] of work that takes `seconds` of simulated time (ignored by a
    /// threaded stream).
    pub(crate) fn launch_timed(&self, f: Box<dyn FnOnce() + Send>, seconds: f64) {
        match &self.sim {
            Some(lane) => {
                f();
                Self::sim_issue(lane, seconds, None);
            }
            None => self.submit(f),
        }
    }

    /// Simulated: `seconds` more of device work on this stream, issued now (the work itself has
    /// been done by the caller). Nothing on a threaded stream.
    pub(crate) fn advance(&self, seconds: f64) {
        if let Some(lane) = &self.sim {
            Self::sim_issue(lane, seconds, None);
        }
    }
}

impl Drop for HostStream {
    fn drop(&mut self) {
        // Closing the channel ends the thread after it has run what was issued.
        self.tx.take();
        if let Some(t) = self.thread.take() {
            // The last handle may go inside one of the stream's own jobs (a view dropped in
            // queued work): the thread cannot join itself, and it ends on its own once that job
            // returns, the channel being closed.
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

/// A completion flag: the host stand-in for a CUDA event. A simulated event completes at a
/// known simulated time.
#[derive(Default)]
pub(crate) struct HostEvent {
    /// When the event completed, once it has.
    done: Mutex<Option<std::time::Instant>>,
    cv: Condvar,
    sim: Option<(Arc<SimClock>, f64)>,
}

impl HostEvent {
    fn simulated(clock: Arc<SimClock>, at: f64) -> HostEvent {
        HostEvent { sim: Some((clock, at)), ..HostEvent::default() }
    }

    /// A simulated event's completion time.
    fn sim_time(&self) -> Option<f64> {
        self.sim.as_ref().map(|(_, at)| *at)
    }

    pub(crate) fn set(&self) {
        let mut d = self.done.lock();
        if d.is_none() {
            *d = Some(std::time::Instant::now());
        }
        self.cv.notify_all();
    }

    pub(crate) fn synchronize(&self) {
        if let Some((clock, at)) = &self.sim {
            clock.wait_until(*at);
            return;
        }
        let mut d = self.done.lock();
        while d.is_none() {
            self.cv.wait(&mut d);
        }
    }

    pub(crate) fn is_complete(&self) -> bool {
        match &self.sim {
            Some((clock, at)) => clock.now() >= *at,
            None => self.done.lock().is_some(),
        }
    }

    /// When the event completed (None while it has not); for a simulated event, the simulated
    /// time as an instant after the clock's base.
    pub(crate) fn completed_at(&self) -> Option<std::time::Instant> {
        match &self.sim {
            Some((clock, at)) => (clock.now() >= *at).then(|| clock.instant(*at)),
            None => *self.done.lock(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_run_in_order_and_events_complete() {
        let b = HostBackend::new().unwrap();
        let src = b.alloc(MemKind::Pinned, 8192).unwrap();
        let dst = b.alloc(MemKind::Device, 8192).unwrap();
        // SAFETY: (test) fresh blocks of 8192 bytes, nothing else touches them.
        unsafe { std::ptr::write_bytes(src.host, 7, 8192) };
        // SAFETY: (test) both blocks live until after the event below completes.
        unsafe { b.h2d.copy(dst.copy_addr(0), src.copy_addr(0), 8192).unwrap() };
        let ev = b.h2d.record().unwrap();
        ev.synchronize().unwrap();
        assert!(ev.is_complete());
        // SAFETY: (test) the copy has completed.
        let out = unsafe { std::slice::from_raw_parts(dst.host, 8192) };
        assert!(out.iter().all(|&x| x == 7));
    }

    #[test]
    fn a_stream_waits_for_another_streams_event() {
        let b = HostBackend::new().unwrap();
        let gate = Arc::new(HostEvent::default());
        let RawStream::Host(s) = &b.d2h else { unreachable!() };
        s.wait(gate.clone());
        let after = s.record();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!after.is_complete(), "the stream ran past an unset event");
        gate.set();
        after.synchronize();
    }
}
