//! The backend: where tier memory comes from and how bytes move between host and device.
//!
//! Two implementations behind one enum, after candle's device backends:
//! - [`host`]: Device, Pinned and Mapped emulated in host memory; "streams" are worker threads
//!   that run copies in order, "events" are completion flags. Every layer above runs and is tested
//!   on machines without a GPU.
//! - [`cuda`]: the CUDA driver API through cudarc (loaded dynamically at run time, so the crate
//!   builds with no CUDA toolkit).
//!
//! Beside them, `gemm` (feature `candle`): a checked host matrix product for the compute above.
//!
//! This module and the tier arenas are the only places with `unsafe` code.

pub(crate) mod cuda;
#[cfg(feature = "candle")]
pub(crate) mod gemm;
pub(crate) mod health;
pub(crate) mod host;
pub(crate) mod sim;

use std::sync::Arc;

use crate::base::error::Result;
use crate::base::sync::Signal;
use crate::base::types::BackendKind;

/// What kind of memory a [`Block`] is.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum MemKind {
    /// Device memory (HBM). On the host backend: plain host memory.
    Device,
    /// Page-locked host memory (`cuMemHostAlloc(PORTABLE)`), readable by the CPU at full speed.
    Pinned,
    /// Page-locked host memory mapped into the device address space (`DEVICEMAP | PORTABLE`).
    Mapped,
}

/// One address that a copy reads or writes.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Addr {
    /// A host address (pinned, mapped, staging or, on the host backend, emulated device memory
    /// reached through its host pointer).
    Host(*mut u8),
    /// A device address (`CUdeviceptr`). On the host backend it is a host address as an integer.
    Dev(u64),
}

impl Addr {
    /// The address `bytes` further on.
    pub(crate) fn offset(self, bytes: u64) -> Addr {
        match self {
            Addr::Host(p) => Addr::Host(p.wrapping_add(bytes as usize)),
            Addr::Dev(d) => Addr::Dev(d + bytes),
        }
    }
}

/// A block of backend memory, freed on drop.
///
/// `host` is the CPU address of the block (null for CUDA device memory), `dev` its device address
/// (0 for pinned host memory that is not mapped; on the host backend, the host address again).
pub(crate) struct Block {
    pub(crate) host: *mut u8,
    pub(crate) dev: u64,
    pub(crate) len: usize,
    pub(crate) kind: MemKind,
    pub(crate) owner: BlockOwner,
}

/// Who frees a [`Block`].
pub(crate) enum BlockOwner {
    /// An anonymous mapping of this many bytes (host backend).
    Host(usize),
    /// The CUDA driver, in this context.
    Cuda(Arc<cudarc::driver::CudaContext>),
    /// No one: the memory was given up (a copy that may still use it could not be waited for),
    /// and is never freed.
    Leaked,
}

// SAFETY: a Block is an owned allocation; the raw pointer is only an address. Access to the bytes
// is synchronized by the store (one owner per extent, events ordering device work).
unsafe impl Send for Block {}
// SAFETY: as above; `&Block` gives only the addresses, never a reference into the bytes.
unsafe impl Sync for Block {}

impl Block {
    /// Address of byte `offset` for a copy: the device address when the block has one that copies
    /// should use (CUDA device memory), the host address otherwise.
    pub(crate) fn copy_addr(&self, offset: usize) -> Addr {
        debug_assert!(offset <= self.len);
        match (&self.owner, self.kind) {
            (BlockOwner::Cuda(_), MemKind::Device) => Addr::Dev(self.dev + offset as u64),
            (BlockOwner::Host(_), MemKind::Device) => Addr::Dev(self.host as u64 + offset as u64),
            _ => Addr::Host(self.host.wrapping_add(offset)),
        }
    }

    /// Whether the CPU can read and write the block through `host`.
    pub(crate) fn host_accessible(&self) -> bool {
        !self.host.is_null()
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        match &self.owner {
            BlockOwner::Host(map_len) => {
                // SAFETY: `host` is the start of an anonymous mapping of `map_len` bytes made by
                // `host::HostBackend::alloc`, unmapped exactly once, here.
                unsafe { libc::munmap(self.host as *mut libc::c_void, *map_len) };
            }
            BlockOwner::Cuda(ctx) => cuda::free_block(ctx, self),
            BlockOwner::Leaked => {}
        }
    }
}

/// `CU_STREAM_PER_THREAD`: the handle of the calling thread's per-thread default stream.
const PER_THREAD_STREAM: u64 = 0x2;
/// `CU_STREAM_LEGACY`: the legacy default stream, ordered after the work of every blocking
/// stream of its context (the per-thread default streams included).
const LEGACY_STREAM: u64 = 0x1;

static NEXT_THREAD_KEY: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

thread_local! {
    /// A number for this host thread, for the keys of the per-thread default stream.
    static THREAD_KEY: u64 = NEXT_THREAD_KEY.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// A stream: copies and waits issued to it run in order, asynchronously to the caller.
#[derive(Clone)]
pub(crate) enum RawStream {
    Host(Arc<host::HostStream>),
    Cuda(Arc<cudarc::driver::CudaStream>),
}

/// A point in a stream's work; complete once everything issued before it has run.
#[derive(Clone)]
pub(crate) enum RawEvent {
    Host(Arc<host::HostEvent>),
    Cuda(cuda::CudaEv),
}

/// Something that memory waits for before it is freed or reused: device work (an event) or a
/// host thread's work (a signal).
#[derive(Clone)]
pub(crate) enum Pending {
    Ev(RawEvent),
    Done(Arc<Signal>),
    /// Everything issued so far on a stream: a copy was issued there but the event after it
    /// could not be recorded. Never complete by itself; a later record on the stream replaces
    /// it with an event ([`Pending::settle`]), and a host wait synchronizes the stream.
    Stream(RawStream),
}

impl Pending {
    /// Whether it has completed, without blocking.
    pub(crate) fn is_complete(&self) -> bool {
        match self {
            Pending::Ev(e) => e.is_complete(),
            Pending::Done(s) => s.is_set(),
            Pending::Stream(_) => false,
        }
    }

    /// Blocks until it has completed. The caller holds no store lock.
    pub(crate) fn wait(&self) -> Result<()> {
        match self {
            Pending::Ev(e) => e.synchronize(),
            Pending::Done(s) => {
                s.wait();
                Ok(())
            }
            Pending::Stream(s) => s.synchronize(),
        }
    }

    /// A [`Pending::Stream`] becomes the event of a record on its stream, when one can be made
    /// now (that event follows the copy it stands for).
    pub(crate) fn settle(&mut self) {
        if let Pending::Stream(s) = self {
            if let Ok(ev) = s.record() {
                *self = Pending::Ev(ev);
            }
        }
    }
}

impl RawStream {
    /// Issues a copy of `len` bytes from `src` to `dst` and returns at once.
    ///
    /// # Safety
    /// 1. `src` and `dst` each point to `len` bytes inside live backend memory of this stream's
    ///    backend (a [`Block`], or a caller buffer that is page-locked on the CUDA backend when
    ///    the address is `Addr::Host`), and stay valid until the copy has completed (an event
    ///    recorded after it on this stream is complete).
    /// 2. No one else writes `dst` or `src`, or reads `dst`, until then.
    /// 3. Host-to-host copies are not issued to a stream (`Addr::Host` to `Addr::Host`); the store
    ///    copies those on the CPU.
    pub(crate) unsafe fn copy(&self, dst: Addr, src: Addr, len: usize) -> Result<()> {
        crate::base::failpoint::check(
            crate::base::failpoint::Site::Copy,
            std::path::Path::new("<copy>"),
        )?;
        match self {
            // SAFETY: forwarded from this function's contract.
            RawStream::Host(s) => unsafe { s.copy(dst, src, len) },
            // SAFETY: forwarded from this function's contract.
            RawStream::Cuda(s) => unsafe { cuda::copy_async(s, dst, src, len) },
        }
    }

    /// Records an event after everything issued so far: without timing (on CUDA, from the
    /// context's pool of `DISABLE_TIMING` events).
    pub(crate) fn record(&self) -> Result<RawEvent> {
        crate::base::failpoint::check(
            crate::base::failpoint::Site::EventRecord,
            std::path::Path::new("<event>"),
        )?;
        match self {
            RawStream::Host(s) => Ok(RawEvent::Host(s.record())),
            RawStream::Cuda(s) => cuda::record_pooled(s).map(RawEvent::Cuda),
        }
    }

    /// [`RawStream::record`] for the stream keyed `key` (a view's, keyed on the thread that
    /// made it). Only CUDA's per-thread default stream differs: used from a thread other than
    /// the one `key` names, its handle means this thread's stream, not that one's, so the event
    /// goes on the legacy default stream instead, which is ordered after the work of every
    /// blocking stream, that thread's per-thread stream included.
    pub(crate) fn record_as(&self, key: u64) -> Result<RawEvent> {
        match self {
            RawStream::Cuda(s)
                if s.cu_stream() as usize as u64 == PER_THREAD_STREAM && self.key() != key =>
            {
                crate::base::failpoint::check(
                    crate::base::failpoint::Site::EventRecord,
                    std::path::Path::new("<event>"),
                )?;
                let legacy = LEGACY_STREAM as usize as cudarc::driver::sys::CUstream;
                cuda::record_pooled_on(s.context(), legacy).map(RawEvent::Cuda)
            }
            _ => self.record(),
        }
    }

    /// Records an event that can be timed against another ([`RawEvent::seconds_since`]): for
    /// the timeline of copies and waits, when a store keeps one.
    pub(crate) fn record_timed(&self) -> Result<RawEvent> {
        match self {
            RawStream::Host(s) => Ok(RawEvent::Host(s.record())),
            RawStream::Cuda(s) => cuda::record_timed(s).map(RawEvent::Cuda),
        }
    }

    /// A number naming the stream (the same for every handle of one stream). CUDA's per-thread
    /// default stream has one handle (`CU_STREAM_PER_THREAD`) for a different stream on each
    /// host thread (candle's `Device::new_cuda` uses it), so its key also names the calling
    /// thread: two threads' uses of it are two streams' uses.
    pub(crate) fn key(&self) -> u64 {
        match self {
            RawStream::Host(s) => Arc::as_ptr(s) as usize as u64,
            RawStream::Cuda(s) => {
                let handle = s.cu_stream() as usize as u64;
                if handle == PER_THREAD_STREAM {
                    // Heap addresses (other streams' handles) never have the top bit set.
                    (1 << 63) | (THREAD_KEY.with(|k| *k) << 2) | PER_THREAD_STREAM
                } else {
                    handle
                }
            }
        }
    }

    /// Makes later work on this stream wait for `ev`, without blocking the calling thread.
    pub(crate) fn wait(&self, ev: &RawEvent) -> Result<()> {
        crate::base::failpoint::check(
            crate::base::failpoint::Site::StreamWait,
            std::path::Path::new("<stream>"),
        )?;
        match (self, ev) {
            (RawStream::Host(s), RawEvent::Host(e)) => {
                s.wait(e.clone());
                Ok(())
            }
            (RawStream::Cuda(s), RawEvent::Cuda(e)) => cuda::wait(s, e),
            _ => Err(crate::Error::BackendMismatch(
                "an event of one backend waited on by a stream of the other".into(),
            )),
        }
    }

    /// Blocks until everything issued to this stream has run. The caller holds no store lock.
    pub(crate) fn synchronize(&self) -> Result<()> {
        crate::base::sync::assert_unlocked("synchronizing a stream");
        match self {
            RawStream::Host(s) => {
                s.record().synchronize();
                Ok(())
            }
            RawStream::Cuda(s) => {
                let _bound = cuda::bind(s.context())?;
                s.synchronize().map_err(|e| crate::Error::cuda("cuStreamSynchronize", e))
            }
        }
    }

    /// [`RawStream::synchronize`] for the stream keyed `key` (see [`RawStream::record_as`]): on
    /// another thread than the one `key` names, CUDA's per-thread default stream is waited for
    /// through the legacy default stream, which is ordered after it.
    pub(crate) fn synchronize_as(&self, key: u64) -> Result<()> {
        match self {
            RawStream::Cuda(s)
                if s.cu_stream() as usize as u64 == PER_THREAD_STREAM && self.key() != key =>
            {
                crate::base::sync::assert_unlocked("synchronizing a stream");
                let _bound = cuda::bind(s.context())?;
                let legacy = LEGACY_STREAM as usize as cudarc::driver::sys::CUstream;
                // SAFETY: the legacy default stream's handle is valid in every context; the
                // store's context is current.
                unsafe { cudarc::driver::sys::cuStreamSynchronize(legacy) }
                    .result()
                    .map_err(|e| crate::Error::cuda("cuStreamSynchronize", e))
            }
            _ => self.synchronize(),
        }
    }

    /// Waits until the CPU may touch what the work issued so far wrote: synchronizes the
    /// stream, except in simulated time, where that work has run already (and waiting would
    /// advance the simulated clock as a host stall).
    pub(crate) fn settle_for_cpu(&self) -> Result<()> {
        if self.is_simulated() {
            Ok(())
        } else {
            self.synchronize()
        }
    }

    /// Whether the stream runs in simulated time (its work is done when issued).
    pub(crate) fn is_simulated(&self) -> bool {
        self.sim_clock().is_some()
    }

    /// The simulated clock the stream runs on, if it is simulated.
    pub(crate) fn sim_clock(&self) -> Option<&Arc<sim::SimClock>> {
        match self {
            RawStream::Host(s) => s.sim_clock(),
            RawStream::Cuda(_) => None,
        }
    }

    /// Simulated: `seconds` of device work issued now on this stream (the caller did the work).
    /// Nothing on other streams.
    pub(crate) fn advance(&self, seconds: f64) {
        if let RawStream::Host(s) = self {
            s.advance(seconds);
        }
    }

    /// Which backend this stream belongs to.
    pub(crate) fn kind(&self) -> BackendKind {
        match self {
            RawStream::Host(_) => BackendKind::Host,
            RawStream::Cuda(_) => BackendKind::Cuda,
        }
    }
}

impl RawEvent {
    /// Whether two handles are the same event.
    pub(crate) fn same(&self, other: &RawEvent) -> bool {
        match (self, other) {
            (RawEvent::Host(a), RawEvent::Host(b)) => Arc::ptr_eq(a, b),
            (RawEvent::Cuda(a), RawEvent::Cuda(b)) => a.same(b),
            _ => false,
        }
    }

    /// Blocks the calling thread until the event is complete. The caller holds no store lock.
    pub(crate) fn synchronize(&self) -> Result<()> {
        crate::base::sync::assert_unlocked("waiting for an event");
        crate::base::failpoint::check(
            crate::base::failpoint::Site::Synchronize,
            std::path::Path::new("<event>"),
        )?;
        match self {
            RawEvent::Host(e) => {
                e.synchronize();
                Ok(())
            }
            RawEvent::Cuda(e) => e.synchronize(),
        }
    }

    /// Whether the event is complete, without blocking.
    pub(crate) fn is_complete(&self) -> bool {
        match self {
            RawEvent::Host(e) => e.is_complete(),
            RawEvent::Cuda(e) => e.is_complete(),
        }
    }

    /// Seconds from `earlier` to `self`, both complete and of the same backend (negative when
    /// `self` completed first). `None` while either is incomplete or on a mismatch.
    pub(crate) fn seconds_since(&self, earlier: &RawEvent) -> Option<f64> {
        match (self, earlier) {
            (RawEvent::Host(a), RawEvent::Host(b)) => {
                let (a, b) = (a.completed_at()?, b.completed_at()?);
                Some(if a >= b { (a - b).as_secs_f64() } else { -(b - a).as_secs_f64() })
            }
            (RawEvent::Cuda(a), RawEvent::Cuda(b)) => cuda::seconds_between(b, a),
            _ => None,
        }
    }

    /// When a host-backend event completed (None for CUDA events and incomplete ones).
    pub(crate) fn host_completed_at(&self) -> Option<std::time::Instant> {
        match self {
            RawEvent::Host(e) => e.completed_at(),
            RawEvent::Cuda(_) => None,
        }
    }
}

/// The backend a store runs on.
pub(crate) enum Backend {
    Host(host::HostBackend),
    Cuda(cuda::CudaBackend),
}

impl Backend {
    /// Which backend this is.
    pub(crate) fn kind(&self) -> BackendKind {
        match self {
            Backend::Host(_) => BackendKind::Host,
            Backend::Cuda(_) => BackendKind::Cuda,
        }
    }

    /// Allocates a block of `len` bytes of `kind`. Called when an arena reserves a chunk or a
    /// staging pool is made, never per tensor.
    pub(crate) fn alloc(&self, kind: MemKind, len: usize) -> Result<Block> {
        if let Err(e) = crate::base::failpoint::check(
            crate::base::failpoint::Site::Alloc,
            std::path::Path::new("<alloc>"),
        ) {
            return Err(match e {
                crate::Error::OutOfMemory { .. } => {
                    crate::Error::OutOfMemory { tier: host::kind_tier(kind), bytes: len as u64 }
                }
                e => e,
            });
        }
        match self {
            Backend::Host(b) => b.alloc(kind, len),
            Backend::Cuda(b) => b.alloc(kind, len),
        }
    }

    /// The stream for host-to-device copies.
    pub(crate) fn h2d(&self) -> &RawStream {
        match self {
            Backend::Host(b) => &b.h2d,
            Backend::Cuda(b) => &b.h2d,
        }
    }

    /// The stream for device-to-host (and device-to-device) copies.
    pub(crate) fn d2h(&self) -> &RawStream {
        match self {
            Backend::Host(b) => &b.d2h,
            Backend::Cuda(b) => &b.d2h,
        }
    }

    /// A new stream for the user's work (`Store::stream`).
    pub(crate) fn new_stream(&self) -> Result<RawStream> {
        match self {
            Backend::Host(b) => Ok(RawStream::Host(b.new_stream()?)),
            Backend::Cuda(b) => b.new_stream(),
        }
    }

    /// Whether the backend may run work on threads of its own (migration workers). A simulated
    /// backend runs everything on the threads that issue it, on one host clock.
    pub(crate) fn runs_threads(&self) -> bool {
        self.sim().is_none()
    }

    /// The simulated clock, when the host backend simulates a GPU machine.
    pub(crate) fn sim(&self) -> Option<&Arc<sim::SimClock>> {
        match self {
            Backend::Host(b) => b.sim.as_ref(),
            Backend::Cuda(_) => None,
        }
    }

    /// A one-line description: the device's name and memory, or the host backend.
    pub(crate) fn describe(&self) -> String {
        match self {
            Backend::Host(b) if b.sim.is_some() => {
                format!("{} (simulated time)", BackendKind::Host)
            }
            Backend::Host(_) => BackendKind::Host.to_string(),
            Backend::Cuda(b) => b.describe(),
        }
    }
}
