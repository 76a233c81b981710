//! The CUDA backend, over cudarc's driver API (loaded at run time).
//!
//! Device memory comes from `cuMemAlloc`, pinned memory from `cuMemHostAlloc(PORTABLE)` (not
//! write-combined: the CPU reads it back, and write-combined memory is slow to read), mapped memory
//! from `cuMemHostAlloc(DEVICEMAP | PORTABLE)` with its device address from
//! `cuMemHostGetDevicePointer`. cudarc has no safe wrapper for the last two, so they are wrapped
//! here. Copies are `cuMemcpy*Async` on two dedicated streams (host-to-device, device-to-host) so
//! that both copy engines can run at once.

pub(crate) mod attention_lib;
pub(crate) mod fused;
pub(crate) mod kernel_cache;
pub(crate) mod probe;
pub(crate) mod programs;

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream, DriverError};

use super::{Addr, Block, BlockOwner, MemKind, RawStream};
use crate::base::error::{Error, Result};
use crate::base::types::Tier;

/// A CUDA library strata calls through cudarc.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Lib {
    Driver,
    Nvrtc,
    Cublas,
}

/// Whether `lib` can be loaded on this machine: checked before the first cudarc call into it,
/// which would panic without it (cudarc loads its libraries on first use).
///
/// cudarc's own check (`sys::is_culib_present`) exists only when cudarc loads its libraries
/// dynamically; a crate that links them (candle's CUDA build enables `dynamic-linking`, and cargo
/// unifies features) would not compile against it. So the check is made here, with `dlopen`,
/// over file names cudarc's loader also tries (where the libraries are linked, they are loaded
/// already and found at once).
pub(crate) fn lib_present(lib: Lib) -> bool {
    let names: &[&str] = match lib {
        Lib::Driver => &["libcuda.so", "libcuda.so.1", "libcuda.so.12", "libcuda.so.11"],
        Lib::Nvrtc => &["libnvrtc.so", "libnvrtc.so.12", "libnvrtc.so.11", "libnvrtc.so.1"],
        Lib::Cublas => &["libcublas.so", "libcublas.so.12", "libcublas.so.11", "libcublas.so.1"],
    };
    names.iter().any(|name| {
        let Ok(c) = std::ffi::CString::new(*name) else { return false };
        // SAFETY: `c` is a NUL-terminated file name; dlopen either fails (null, nothing to
        // release) or returns a handle that is closed right away. Loading a CUDA library runs
        // no code of ours.
        unsafe {
            let h = libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
            if h.is_null() {
                false
            } else {
                libc::dlclose(h);
                true
            }
        }
    })
}

/// Whether the CUDA driver library can be loaded on this machine.
pub(crate) fn driver_present() -> bool {
    lib_present(Lib::Driver)
}

/// Number of CUDA devices, or why there are none.
pub(crate) fn device_count() -> std::result::Result<usize, String> {
    if !driver_present() {
        return Err("the CUDA driver library (libcuda.so) was not found".into());
    }
    result::init().map_err(|e| format!("cuInit failed: {e}"))?;
    match result::device::get_count() {
        Ok(0) => Err("the CUDA driver reports no devices".into()),
        Ok(n) => Ok(n as usize),
        Err(e) => Err(format!("cuDeviceGetCount failed: {e}")),
    }
}

/// The CUDA backend: a context and the two copy streams.
pub(crate) struct CudaBackend {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) h2d: RawStream,
    pub(crate) d2h: RawStream,
}

fn cu(call: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::cuda(call, e)
}

/// The store's context made current on the calling thread for a call into the driver, and the
/// caller's own put back when this drops: a trainer's thread keeps the context it had (on a
/// machine with several GPUs, its next runtime call still goes to its device). Costs one
/// `cuCtxGetCurrent` when the caller's context is the store's already.
#[must_use = "the caller's context is put back when the guard drops"]
pub(crate) struct Bound {
    prev: Option<sys::CUcontext>,
}

/// Makes `ctx` current for the guard's life (see [`Bound`]).
pub(crate) fn bind(ctx: &CudaContext) -> Result<Bound> {
    let mut cur: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: cuCtxGetCurrent writes one handle into `cur`, a valid place for it.
    unsafe { sys::cuCtxGetCurrent(&mut cur) }.result().map_err(cu("cuCtxGetCurrent"))?;
    if cur == ctx.cu_ctx() {
        return Ok(Bound { prev: None });
    }
    // SAFETY: `ctx` is a live context (its Arc is borrowed); setting it current affects only
    // this thread, and the guard restores the previous one.
    unsafe { sys::cuCtxSetCurrent(ctx.cu_ctx()) }.result().map_err(cu("cuCtxSetCurrent"))?;
    Ok(Bound { prev: Some(cur) })
}

impl Drop for Bound {
    fn drop(&mut self) {
        if let Some(prev) = self.prev {
            // SAFETY: `prev` was current on this thread when the guard was made (null: none
            // was, and setting null unbinds); a failure leaves the store's current, no worse.
            let _ = unsafe { sys::cuCtxSetCurrent(prev) };
        }
    }
}

/// Errors of the store's CUDA calls made where none can be returned (a drop, a completion
/// check), per context, until `Store::check_err` takes them. They are kept here, not in the
/// context's own error slot: that slot is the caller's (their next cudarc call would return
/// our error, and cudarc's `upgrade_device_ptr` panics on one).
///
/// Kept with a `Weak` of the `CudaContext` they were made in, matched by the driver handle of
/// a live one: a stream the caller made from another `CudaContext` value of the same primary
/// context (candle's device beside a store on device 0) defers into the store's errors, while
/// the errors of a dead context (released by its last holder, its handle maybe given again to
/// a new retain) are dropped, never a new store's. A context whose `Weak` still upgrades is
/// held, so the primary context stays retained and its handle cannot name another while it
/// matches.
static DEFERRED: parking_lot::Mutex<Vec<(std::sync::Weak<CudaContext>, Error)>> =
    parking_lot::Mutex::new(Vec::new());
/// Deferred errors kept per process (the oldest are kept: they say what went wrong first).
const MAX_DEFERRED: usize = 64;

/// Keeps an error of `call` in `ctx` for the next `check_err`.
pub(crate) fn defer(ctx: &Arc<CudaContext>, call: &'static str, e: DriverError) {
    let mut d = DEFERRED.lock();
    d.retain(|(c, _)| c.strong_count() > 0);
    if d.len() < MAX_DEFERRED {
        d.push((Arc::downgrade(ctx), Error::cuda(call, e)));
    }
}

/// The oldest error deferred in `ctx`, taken.
pub(crate) fn take_deferred(ctx: &Arc<CudaContext>) -> Option<Error> {
    let mut d = DEFERRED.lock();
    d.retain(|(c, _)| c.strong_count() > 0);
    let i = d.iter().position(|(c, _)| c.upgrade().is_some_and(|c| c.cu_ctx() == ctx.cu_ctx()))?;
    Some(d.remove(i).1)
}

/// Whether `w` is `ctx` (the same live `CudaContext` value; a held `Weak` keeps its address
/// from being reused, so a dead one never matches a new one).
fn same_context(w: &std::sync::Weak<CudaContext>, ctx: &Arc<CudaContext>) -> bool {
    std::ptr::eq(w.as_ptr(), Arc::as_ptr(ctx)) && w.strong_count() > 0
}

impl CudaBackend {
    /// Opens device `ordinal` (its primary context, which other libraries share).
    pub(crate) fn new(ordinal: usize) -> Result<CudaBackend> {
        let count = device_count().map_err(Error::NoGpu)?;
        if ordinal >= count {
            return Err(Error::NoGpu(format!(
                "device {ordinal} asked for, but the driver reports {count} device(s)"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(cu("cuDevicePrimaryCtxRetain"))?;
        Self::from_context(ctx)
    }

    /// Uses a context the caller already has (a trainer sharing its own).
    pub(crate) fn from_context(ctx: Arc<CudaContext>) -> Result<CudaBackend> {
        let _bound = bind(&ctx)?;
        let h2d = ctx.new_stream().map_err(cu("cuStreamCreate"))?;
        let d2h = ctx.new_stream().map_err(cu("cuStreamCreate"))?;
        Ok(CudaBackend { ctx, h2d: RawStream::Cuda(h2d), d2h: RawStream::Cuda(d2h) })
    }

    pub(crate) fn alloc(&self, kind: MemKind, len: usize) -> Result<Block> {
        let len = len.max(1);
        let _bound = bind(&self.ctx)?;
        let oom = |tier: Tier, e: DriverError, call: &'static str| {
            if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
                Error::OutOfMemory { tier, bytes: len as u64 }
            } else {
                Error::cuda(call, e)
            }
        };
        let owner = BlockOwner::Cuda(self.ctx.clone());
        match kind {
            MemKind::Device => {
                // SAFETY: the context is current; the memory is owned by the returned Block and
                // freed once in its Drop (free_block).
                let dev = unsafe { result::malloc_sync(len) }
                    .map_err(|e| oom(Tier::Device, e, "cuMemAlloc"))?;
                Ok(Block { host: std::ptr::null_mut(), dev, len, kind, owner })
            }
            MemKind::Pinned => {
                // SAFETY: the context is current; PORTABLE makes the memory pinned for every
                // context; the pointer is owned by the returned Block and freed in its Drop.
                let host = unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }
                    .map_err(|e| oom(Tier::Pinned, e, "cuMemHostAlloc"))?;
                Ok(Block { host: host as *mut u8, dev: 0, len, kind, owner })
            }
            MemKind::Mapped => {
                let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
                // SAFETY: as for Pinned; DEVICEMAP also maps it into the device address space.
                let host = unsafe { result::malloc_host(len, flags) }
                    .map_err(|e| oom(Tier::Mapped, e, "cuMemHostAlloc"))?;
                let mut block = Block { host: host as *mut u8, dev: 0, len, kind, owner };
                let mut dev: sys::CUdeviceptr = 0;
                // SAFETY: `host` was allocated with DEVICEMAP just above, in the current context;
                // flags must be 0 (CUDA docs of cuMemHostGetDevicePointer).
                unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) }
                    .result()
                    .map_err(cu("cuMemHostGetDevicePointer"))?;
                block.dev = dev;
                Ok(block)
            }
        }
    }

    pub(crate) fn new_stream(&self) -> Result<RawStream> {
        let _bound = bind(&self.ctx)?;
        let s = self.ctx.new_stream().map_err(cu("cuStreamCreate"))?;
        Ok(RawStream::Cuda(s))
    }

    pub(crate) fn describe(&self) -> String {
        let _bound = bind(&self.ctx);
        let name = self.ctx.name().unwrap_or_else(|_| "unknown device".into());
        let total = self.ctx.total_mem().map(|b| b as u64).unwrap_or(0);
        format!(
            "cuda: device {} ({name}, {} HBM)",
            self.ctx.ordinal(),
            crate::base::types::format_size(total)
        )
    }
}

/// Turns cudarc's event tracking off in `ctx` if no cudarc stream was made in it yet; returns
/// whether tracking is off. For candle's CUDA device, before a store makes its copy streams in
/// candle's context (`strata::candle::store_for`); no other caller.
///
/// cudarc (0.19) tracks each buffer's uses with two events made at its allocation, and, once
/// a context holds a stream made by `new_stream`, waits for and records them around every
/// launch and copy that takes the buffer and waits for them before freeing it: host work on
/// every op, there to order a buffer used on several streams. candle's `Device::new_cuda` runs
/// on CUDA's per-thread default stream, which makes no such stream, so cudarc orders nothing
/// for candle's buffers; the store's two copy streams would switch that on for every one of
/// them, though the store's streams never take a cudarc buffer of candle's. With tracking off
/// the context stays as candle runs alone: its work in stream order on candle's stream (per
/// host thread, as the per-thread stream is), no event per allocation, launch or free.
///
/// A context that already has a stream of cudarc's is left alone (tracking stays as it is):
/// its owner may share buffers between that stream and another and count on cudarc's events.
///
/// The caller's contract (the reason this function is safe to call): from here on, every cudarc
/// buffer of `ctx` is used only on the stream that allocated it, or across streams in an order
/// strata's own events give. strata's candle integration keeps it: candle's tensors and every
/// buffer strata allocates for candle (the fused ops' outputs, cuDNN's and the attention
/// library's workspaces, dequantized weights, copies out of views, the device AdamW's state)
/// are allocated and used on candle's stream; the store's streams (its copy streams, the
/// streams `Store::stream` makes) touch only the store's own memory (`cuMemAlloc` and
/// `cuMemHostAlloc` blocks, no cudarc buffers), ordered against candle's stream by the store's
/// pooled events (a view's stream waits for the copy that brought the tensor, a view's drop
/// records its stream's last use, and a copy, eviction or overwrite of the memory waits for
/// it); and the store's memory lent to candle's stream as a cudarc slice ([`BorrowedSlice`])
/// is never freed by cudarc. Work the caller issues on another stream of this context with
/// candle's tensors, or with a view's memory, is theirs to order (`DeviceView::record_use`).
///
/// Where this is not sound: candle's per-thread stream is a different stream on each host
/// thread, so a candle tensor made on one thread and used on another (a model's resident
/// blocks, built on one thread and shared in an `Arc` by several) is used on two streams, and
/// one dropped on another thread is freed on that thread's stream, no longer after the work of
/// the thread that used it. cudarc's events ordered that while the store's streams kept tracking on; with it off nothing
/// does, as nothing does in candle without a store. strata's own programs run a model's GPU
/// work on one thread; a caller sharing a model between threads makes the device with
/// `Device::new_cuda_with_stream` (one stream for every thread, tracking left on), as
/// docs/candle.md says.
#[cfg_attr(not(feature = "candle-cuda"), allow(dead_code))]
pub(crate) fn untrack_single_stream(ctx: &Arc<CudaContext>) -> bool {
    if ctx.is_in_multi_stream_mode() {
        return !ctx.is_event_tracking();
    }
    // SAFETY: cudarc's conditions for tracking off are about buffers used on several streams:
    // none freed while another stream still uses it, none used on another stream before its
    // allocation there completed, no two streams writing one at once. The context has one
    // stream of work (no `new_stream` yet), where cudarc ordered nothing; the caller's contract
    // above keeps every cudarc buffer of the context on its own stream from here on, or
    // ordered across streams by the store's events, and the buffers made before this call
    // with their events (while tracking was on) are used the same way.
    unsafe { ctx.disable_event_tracking() };
    true
}

/// Frees a block allocated by [`CudaBackend::alloc`]. Errors are recorded in the context (cudarc's
/// Drop-error slot) and surface through `Store::check_err`.
pub(crate) fn free_block(ctx: &Arc<CudaContext>, b: &Block) {
    let _bound = match bind(ctx) {
        Ok(g) => g,
        Err(_) => {
            return defer(
                ctx,
                "cuCtxSetCurrent",
                DriverError(sys::cudaError_enum::CUDA_ERROR_INVALID_CONTEXT),
            )
        }
    };
    let res = match b.kind {
        // SAFETY: `dev` came from cuMemAlloc in `alloc`, is freed once (Block's Drop), and the
        // store has waited for every copy and view touching it before dropping its arena.
        MemKind::Device => unsafe { result::free_sync(b.dev) }.map_err(|e| ("cuMemFree", e)),
        MemKind::Pinned | MemKind::Mapped => {
            // SAFETY: `host` came from cuMemHostAlloc in `alloc` and is freed once, after all
            // use.
            unsafe { result::free_host(b.host as *mut c_void) }.map_err(|e| ("cuMemFreeHost", e))
        }
    };
    if let Err((call, e)) = res {
        defer(ctx, call, e);
    }
}

/// Issues an async copy on `s`.
///
/// # Safety
/// See [`RawStream::copy`](super::RawStream::copy): both ranges valid for `len` bytes until the
/// copy completes, host addresses page-locked, no host-to-host copy.
pub(crate) unsafe fn copy_async(
    s: &Arc<CudaStream>,
    dst: Addr,
    src: Addr,
    len: usize,
) -> Result<()> {
    if len == 0 {
        return Ok(());
    }
    let _bound = bind(s.context())?;
    let cs = s.cu_stream();
    // The caller guarantees the ranges are valid, pinned where host, and untouched until the
    // copy completes; the stream belongs to the current context.
    let r = match (dst, src) {
        // SAFETY: as above.
        (Addr::Dev(d), Addr::Host(h)) => unsafe {
            (sys::cuMemcpyHtoDAsync_v2(d, h as *const c_void, len, cs), "cuMemcpyHtoDAsync")
        },
        // SAFETY: as above.
        (Addr::Host(h), Addr::Dev(d)) => unsafe {
            (sys::cuMemcpyDtoHAsync_v2(h as *mut c_void, d, len, cs), "cuMemcpyDtoHAsync")
        },
        // SAFETY: as above.
        (Addr::Dev(d), Addr::Dev(sr)) => unsafe {
            (sys::cuMemcpyDtoDAsync_v2(d, sr, len, cs), "cuMemcpyDtoDAsync")
        },
        (Addr::Host(_), Addr::Host(_)) => {
            return Err(Error::InvalidArgument(
                "host-to-host copies are done on the CPU, not on a CUDA stream".into(),
            ))
        }
    };
    r.0.result().map_err(cu(r.1))
}

/// A CUDA event: a timed one made by cudarc (for the timeline), or one of a context's pool of
/// `DISABLE_TIMING` events (every other use: stream ordering, completion checks).
#[derive(Clone)]
pub(crate) enum CudaEv {
    Timed(Arc<CudaEvent>),
    Pooled(Arc<PooledEvent>),
}

impl CudaEv {
    fn raw(&self) -> sys::CUevent {
        match self {
            CudaEv::Timed(e) => e.cu_event(),
            CudaEv::Pooled(e) => e.ev.0,
        }
    }

    /// Whether two handles are the same event (a pooled handle is reused only after every
    /// holder of it has dropped, so equal live handles are one event).
    pub(crate) fn same(&self, other: &CudaEv) -> bool {
        self.raw() == other.raw()
    }

    fn ctx(&self) -> &Arc<CudaContext> {
        match self {
            CudaEv::Timed(e) => e.context(),
            CudaEv::Pooled(e) => &e.ctx,
        }
    }

    /// Whether the work recorded has completed. An error is *not* completion: work that may
    /// still run must not look finished (its memory would be reused under it). The error is kept
    /// for `check_err`, and a host wait on the event returns it.
    pub(crate) fn is_complete(&self) -> bool {
        let Ok(_bound) = bind(self.ctx()) else { return false };
        // SAFETY: the event is live (owned by this value's Arc) and was created in its context,
        // which is current.
        match unsafe { result::event::query(self.raw()) } {
            Ok(()) => true,
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NOT_READY => false,
            Err(e) => {
                defer(self.ctx(), "cuEventQuery", e);
                false
            }
        }
    }

    /// Blocks until the work recorded has completed: a short spin on the event (a copy about to
    /// finish costs no sleep), then a blocking wait (pooled events are `BLOCKING_SYNC`: the
    /// thread sleeps instead of burning a core the CPU optimizer needs).
    pub(crate) fn synchronize(&self) -> Result<()> {
        let _bound = bind(self.ctx())?;
        let spin_until = std::time::Instant::now() + SPIN;
        loop {
            // SAFETY: as in `is_complete`.
            match unsafe { result::event::query(self.raw()) } {
                Ok(()) => return Ok(()),
                Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NOT_READY => {}
                Err(e) => return Err(Error::cuda("cuEventQuery", e)),
            }
            if std::time::Instant::now() >= spin_until {
                break;
            }
            std::hint::spin_loop();
        }
        // SAFETY: as in `is_complete`.
        unsafe { result::event::synchronize(self.raw()) }.map_err(cu("cuEventSynchronize"))
    }
}

/// How long a host wait spins on an event before it sleeps.
const SPIN: std::time::Duration = std::time::Duration::from_micros(20);

/// A pooled event's handle; `Send` because CUDA events may be used from any thread.
struct RawCuEvent(sys::CUevent);
// SAFETY: a CUevent is an opaque driver handle that the driver lets any thread use.
unsafe impl Send for RawCuEvent {}
// SAFETY: as above; the driver synchronizes its own use of the handle.
unsafe impl Sync for RawCuEvent {}

/// An event of a context's pool: returned to the pool when the last handle drops (re-recording
/// it later does not affect waits already issued on it: CUDA captures the event's state when
/// `cuStreamWaitEvent` is called).
pub(crate) struct PooledEvent {
    ev: RawCuEvent,
    ctx: Arc<CudaContext>,
    pool: Arc<EventPool>,
}

impl Drop for PooledEvent {
    fn drop(&mut self) {
        // Lock-free: a view's drop that releases its last event takes no lock.
        self.pool.free.push(RawCuEvent(self.ev.0));
    }
}

/// A context's free events (`DISABLE_TIMING | BLOCKING_SYNC`), reused rather than created per
/// record. The events die with their context (CUDA destroys them with it).
pub(crate) struct EventPool {
    free: crossbeam::queue::SegQueue<RawCuEvent>,
}

/// Each context's pool. Looked up under a lock only when a thread records in a context other
/// than the one it recorded in last (each thread keeps its last pool), so recording an event
/// on the hot path takes no shared lock.
type Pools = Vec<(std::sync::Weak<CudaContext>, Arc<EventPool>)>;
static POOLS: parking_lot::Mutex<Pools> = parking_lot::Mutex::new(Vec::new());

thread_local! {
    /// The pool this thread used last, and its context. Matched by the `CudaContext` value,
    /// never by its driver handle: a primary context released by its last holder is destroyed
    /// with its events, and retained again it comes back with the same handle, so a pool found
    /// by the handle would hand out destroyed events.
    static LAST_POOL: std::cell::RefCell<Option<(std::sync::Weak<CudaContext>, Arc<EventPool>)>> =
        const { std::cell::RefCell::new(None) };
}

/// The event pool of `ctx`.
fn pool_of(ctx: &Arc<CudaContext>) -> Arc<EventPool> {
    if let Some(p) = LAST_POOL
        .with(|l| l.borrow().as_ref().filter(|(c, _)| same_context(c, ctx)).map(|(_, p)| p.clone()))
    {
        return p;
    }
    let p = {
        let mut pools = POOLS.lock();
        pools.retain(|(c, _)| c.strong_count() > 0);
        match pools.iter().find(|(c, _)| same_context(c, ctx)) {
            Some((_, p)) => p.clone(),
            None => {
                let p = Arc::new(EventPool { free: crossbeam::queue::SegQueue::new() });
                pools.push((Arc::downgrade(ctx), p.clone()));
                p
            }
        }
    };
    LAST_POOL.with(|l| *l.borrow_mut() = Some((Arc::downgrade(ctx), p.clone())));
    p
}

/// Records an event from the pool of `s`'s context after the work issued so far on `s`.
pub(crate) fn record_pooled(s: &Arc<CudaStream>) -> Result<CudaEv> {
    record_pooled_on(s.context(), s.cu_stream())
}

/// Records a pooled event of `ctx` on the raw stream handle `stream` (a stream of `ctx`, or a
/// special handle: the legacy default stream).
pub(crate) fn record_pooled_on(ctx: &Arc<CudaContext>, stream: sys::CUstream) -> Result<CudaEv> {
    let _bound = bind(ctx)?;
    let pool = pool_of(ctx);
    let ev = match pool.free.pop() {
        Some(e) => e,
        None => {
            let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
                | sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32;
            let mut ev: sys::CUevent = std::ptr::null_mut();
            // SAFETY: cuEventCreate writes one handle into `ev`; the context is current.
            unsafe { sys::cuEventCreate(&mut ev, flags) }.result().map_err(cu("cuEventCreate"))?;
            RawCuEvent(ev)
        }
    };
    let pooled = PooledEvent { ev, ctx: ctx.clone(), pool };
    // SAFETY: the event and the stream belong to the same context, which is current.
    unsafe { result::event::record(pooled.ev.0, stream) }.map_err(cu("cuEventRecord"))?;
    Ok(CudaEv::Pooled(Arc::new(pooled)))
}

/// Records a timing-enabled event after the work issued so far on `s` (a new one each time).
pub(crate) fn record_timed(s: &Arc<CudaStream>) -> Result<CudaEv> {
    let _bound = bind(s.context())?;
    s.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map(|e| CudaEv::Timed(Arc::new(e)))
        .map_err(cu("cuEventRecord"))
}

/// Makes later work on `s` wait for `ev`.
pub(crate) fn wait(s: &Arc<CudaStream>, ev: &CudaEv) -> Result<()> {
    let _bound = bind(s.context())?;
    // SAFETY: the stream is live (borrowed), the event too (borrowed through its Arc).
    unsafe {
        result::stream::wait_event(
            s.cu_stream(),
            ev.raw(),
            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
        )
    }
    .map_err(cu("cuStreamWaitEvent"))
}

/// Seconds from `earlier` to `later`, both complete and timed; `None` otherwise.
pub(crate) fn seconds_between(earlier: &CudaEv, later: &CudaEv) -> Option<f64> {
    match (earlier, later) {
        (CudaEv::Timed(a), CudaEv::Timed(b)) if a.is_complete() && b.is_complete() => {
            let _bound = bind(a.context()).ok()?;
            a.elapsed_ms(b).ok().map(|ms| ms as f64 / 1e3)
        }
        _ => None,
    }
}

/// Store memory lent to cudarc as a `CudaSlice<u8>` that cudarc never frees: dropping it leaks the
/// slice (cudarc's `leak`), which only makes the slice's stream wait for cudarc's events on it.
pub(crate) struct BorrowedSlice(Option<cudarc::driver::CudaSlice<u8>>);

impl BorrowedSlice {
    /// Lends `len` bytes at `ptr`. The caller (a view) keeps that memory allocated and unmoved for
    /// as long as this value lives.
    ///
    /// cudarc's `upgrade_device_ptr` unwraps the creation of the slice's events, and creating an
    /// event first returns (and clears) an error the context's slot holds. So a pending error
    /// there is taken out first and put back for its owner (the slice is refused with it), and a
    /// failure left (the driver refusing an event) is caught: an error, never a panic.
    pub(crate) fn new(stream: &Arc<CudaStream>, ptr: u64, len: usize) -> Result<BorrowedSlice> {
        let ctx = stream.context();
        let _bound = bind(ctx)?;
        if let Err(e) = ctx.check_err() {
            ctx.record_err(Err::<(), _>(e));
            return Err(Error::cuda("a cudarc call of the caller's (pending in the context)", e));
        }
        let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: `ptr..ptr + len` is device-accessible memory of the store (a Device
            // extent or the device mapping of a Mapped extent) that the view holding this value
            // keeps alive; the slice is leaked, never freed by cudarc (Drop below).
            unsafe { stream.upgrade_device_ptr::<u8>(ptr, len) }
        }));
        match made {
            Ok(slice) => Ok(BorrowedSlice(Some(slice))),
            Err(_) => Err(Error::Cuda {
                call: "cuEventCreate",
                message: "cudarc could not create the borrowed slice's events".into(),
            }),
        }
    }

    pub(crate) fn get(&self) -> &cudarc::driver::CudaSlice<u8> {
        self.0.as_ref().expect("present until drop")
    }

    /// The bytes as a typed view: `None` unless the length is a whole number of `T`s.
    pub(crate) fn typed<T: cudarc::driver::DeviceRepr>(
        &self,
    ) -> Option<cudarc::driver::CudaView<'_, T>> {
        let s = self.get();
        let size = std::mem::size_of::<T>();
        if size == 0 || s.len() % size != 0 {
            return None;
        }
        // SAFETY: the slice is `len` bytes of device memory aligned to at least 256 bytes
        // (arena alignment), so `len / size` values of `T` fit and are aligned; `T: DeviceRepr`
        // is plain data the device reads as such, and the view borrows `self`, so the memory
        // outlives it.
        unsafe { s.transmute::<T>(s.len() / size) }
    }

    /// The bytes as a typed mutable view: `None` unless the length is a whole number of `T`s.
    pub(crate) fn typed_mut<T: cudarc::driver::DeviceRepr>(
        &mut self,
    ) -> Option<cudarc::driver::CudaViewMut<'_, T>> {
        let s = self.0.as_mut().expect("present until drop");
        let size = std::mem::size_of::<T>();
        if size == 0 || s.len() % size != 0 {
            return None;
        }
        let n = s.len() / size;
        // SAFETY: as in `typed`; the mutable view borrows `self` mutably.
        unsafe { s.transmute_mut::<T>(n) }
    }
}

impl Drop for BorrowedSlice {
    /// cudarc's `leak` makes the slice's stream wait for its events, but its waits return at
    /// once, issuing nothing, while the context's error slot holds an error (every cudarc call
    /// checks the slot first). So the caller's pending error is taken out for the waits and put
    /// back after; an error of the waits themselves is the store's (`Store::check_err`).
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            let ctx = s.context().clone();
            // (cudarc binds the context for the waits and leaves it bound: the guard puts the
            // thread's own back.)
            let _bound = bind(&ctx).ok();
            let callers = ctx.check_err();
            s.leak();
            if let Err(e) = ctx.check_err() {
                defer(&ctx, "cuStreamWaitEvent", e);
            }
            ctx.record_err(callers);
        }
    }
}

/// Compiles CUDA C `source` with NVRTC for the context's device and loads `names` from it: the
/// one way strata's kernels (`cuda/*.cu`) reach the GPU. A missing NVRTC library is a typed
/// error, not a panic.
pub(crate) fn load_kernels<const N: usize>(
    ctx: &Arc<CudaContext>,
    source: &str,
    names: [&str; N],
) -> Result<(Arc<cudarc::driver::CudaModule>, [cudarc::driver::CudaFunction; N])> {
    if !lib_present(Lib::Nvrtc) {
        return Err(Error::Cuda {
            call: "nvrtc",
            message: "the NVRTC library (libnvrtc.so) was not found: install the CUDA runtime \
                      compiler or put its lib directory on LD_LIBRARY_PATH"
                .into(),
        });
    }
    let (major, minor) = ctx.compute_capability().map_err(cu("cuDeviceGetAttribute"))?;
    // (Through the on-disk cache when STRATA_KERNEL_CACHE names one: kernel_cache.)
    let (ptx, _) = kernel_cache::compile_ptx(source, &format!("compute_{major}{minor}"))
        .map_err(|message| Error::Cuda { call: "nvrtcCompileProgram", message })?;
    let module =
        ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)).map_err(cu("cuModuleLoadData"))?;
    let mut funcs = Vec::with_capacity(N);
    for name in names {
        funcs.push(module.load_function(name).map_err(cu("cuModuleGetFunction"))?);
    }
    let funcs: [cudarc::driver::CudaFunction; N] =
        funcs.try_into().unwrap_or_else(|_| unreachable!("one function per name"));
    Ok((module, funcs))
}
