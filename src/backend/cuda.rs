//! The CUDA backend, over cudarc's driver API (loaded at run time).
//!
//! Device memory comes from `cuMemAlloc`, pinned memory from `cuMemHostAlloc(PORTABLE)` (not
//! write-combined: the CPU reads it back, and write-combined memory is slow to read), mapped memory
//! from `cuMemHostAlloc(DEVICEMAP | PORTABLE)` with its device address from
//! `cuMemHostGetDevicePointer`. cudarc has no safe wrapper for the last two, so they are wrapped
//! here. Copies are `cuMemcpy*Async` on two dedicated streams (host-to-device, device-to-host) so
//! that both copy engines can run at once.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream, DriverError};

use super::{Addr, Block, BlockOwner, MemKind, RawStream};
use crate::error::{Error, Result};
use crate::types::Tier;

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
        let h2d = ctx.new_stream().map_err(cu("cuStreamCreate"))?;
        let d2h = ctx.new_stream().map_err(cu("cuStreamCreate"))?;
        Ok(CudaBackend { ctx, h2d: RawStream::Cuda(h2d), d2h: RawStream::Cuda(d2h) })
    }

    pub(crate) fn alloc(&self, kind: MemKind, len: usize) -> Result<Block> {
        let len = len.max(1);
        self.ctx.bind_to_thread().map_err(cu("cuCtxSetCurrent"))?;
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
        let s = self.ctx.new_stream().map_err(cu("cuStreamCreate"))?;
        Ok(RawStream::Cuda(s))
    }

    pub(crate) fn describe(&self) -> String {
        let name = self.ctx.name().unwrap_or_else(|_| "unknown device".into());
        let total = self.ctx.total_mem().map(|b| b as u64).unwrap_or(0);
        format!(
            "cuda: device {} ({name}, {} HBM)",
            self.ctx.ordinal(),
            crate::types::format_size(total)
        )
    }
}

/// Frees a block allocated by [`CudaBackend::alloc`]. Errors are recorded in the context (cudarc's
/// Drop-error slot) and surface through `Store::check_err`.
pub(crate) fn free_block(ctx: &Arc<CudaContext>, b: &Block) {
    ctx.record_err(ctx.bind_to_thread());
    match b.kind {
        // SAFETY: `dev` came from cuMemAlloc in `alloc`, is freed once (Block's Drop), and the
        // store has waited for every copy and view touching it before dropping its arena.
        MemKind::Device => ctx.record_err(unsafe { result::free_sync(b.dev) }),
        // SAFETY: `host` came from cuMemHostAlloc in `alloc` and is freed once, after all use.
        MemKind::Pinned | MemKind::Mapped => {
            ctx.record_err(unsafe { result::free_host(b.host as *mut c_void) })
        }
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
    s.context().bind_to_thread().map_err(cu("cuCtxSetCurrent"))?;
    let cs = s.cu_stream();
    // SAFETY (all three): the caller guarantees the ranges are valid, pinned where host, and
    // untouched until the copy completes; the stream belongs to the current context.
    let r = match (dst, src) {
        (Addr::Dev(d), Addr::Host(h)) => unsafe {
            (sys::cuMemcpyHtoDAsync_v2(d, h as *const c_void, len, cs), "cuMemcpyHtoDAsync")
        },
        (Addr::Host(h), Addr::Dev(d)) => unsafe {
            (sys::cuMemcpyDtoHAsync_v2(h as *mut c_void, d, len, cs), "cuMemcpyDtoHAsync")
        },
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

    /// Whether the work recorded has completed. An error other than "not ready" counts as
    /// complete (it is kept for `check_err`), so nothing waits forever on a broken event.
    pub(crate) fn is_complete(&self) -> bool {
        // SAFETY: the event is live (owned by this value's Arc) and was created in its context.
        match unsafe { result::event::query(self.raw()) } {
            Ok(()) => true,
            Err(e) if e.0 == sys::cudaError_enum::CUDA_ERROR_NOT_READY => false,
            Err(e) => {
                self.ctx().record_err(Err::<(), _>(e));
                true
            }
        }
    }

    /// Blocks until the work recorded has completed.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.ctx().bind_to_thread().map_err(cu("cuCtxSetCurrent"))?;
        // SAFETY: as in `is_complete`.
        unsafe { result::event::synchronize(self.raw()) }.map_err(cu("cuEventSynchronize"))
    }
}

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
}

impl Drop for PooledEvent {
    fn drop(&mut self) {
        let mut pools = POOLS.lock();
        match pools.iter_mut().find(|(c, _)| std::ptr::eq(c.as_ptr(), Arc::as_ptr(&self.ctx))) {
            Some((_, free)) => free.push(RawCuEvent(self.ev.0)),
            None => destroy(&self.ctx, self.ev.0),
        }
    }
}

fn destroy(ctx: &Arc<CudaContext>, ev: sys::CUevent) {
    ctx.record_err(ctx.bind_to_thread());
    // SAFETY: the event was created in `ctx` and is destroyed once (it left the pool or was never
    // in one); destroying an incomplete event is allowed (its resources go at completion).
    ctx.record_err(unsafe { result::event::destroy(ev) });
}

/// Free pooled events per context. A context that went away leaves a dead `Weak`: its events
/// went with it, and its slot is dropped at the next lookup.
type Pools = Vec<(std::sync::Weak<CudaContext>, Vec<RawCuEvent>)>;
static POOLS: parking_lot::Mutex<Pools> = parking_lot::Mutex::new(Vec::new());

/// Records an event from the pool of `s`'s context after the work issued so far on `s`.
pub(crate) fn record_pooled(s: &Arc<CudaStream>) -> Result<CudaEv> {
    let ctx = s.context().clone();
    let reused = {
        let mut pools = POOLS.lock();
        pools.retain(|(c, _)| c.strong_count() > 0);
        match pools.iter_mut().find(|(c, _)| std::ptr::eq(c.as_ptr(), Arc::as_ptr(&ctx))) {
            Some((_, free)) => free.pop(),
            None => {
                pools.push((Arc::downgrade(&ctx), Vec::new()));
                None
            }
        }
    };
    ctx.bind_to_thread().map_err(cu("cuCtxSetCurrent"))?;
    let ev = match reused {
        Some(e) => e,
        None => RawCuEvent(
            result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(cu("cuEventCreate"))?,
        ),
    };
    let pooled = PooledEvent { ev, ctx };
    // SAFETY: the event and the stream belong to the same context, which is current.
    unsafe { result::event::record(pooled.ev.0, s.cu_stream()) }.map_err(cu("cuEventRecord"))?;
    Ok(CudaEv::Pooled(Arc::new(pooled)))
}

/// Records a timing-enabled event after the work issued so far on `s` (a new one each time).
pub(crate) fn record_timed(s: &Arc<CudaStream>) -> Result<CudaEv> {
    s.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map(|e| CudaEv::Timed(Arc::new(e)))
        .map_err(cu("cuEventRecord"))
}

/// Makes later work on `s` wait for `ev`.
pub(crate) fn wait(s: &Arc<CudaStream>, ev: &CudaEv) -> Result<()> {
    s.context().bind_to_thread().map_err(cu("cuCtxSetCurrent"))?;
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
    pub(crate) fn new(stream: &Arc<CudaStream>, ptr: u64, len: usize) -> BorrowedSlice {
        // SAFETY: `ptr..ptr + len` is device-accessible memory of the store (a Device extent or
        // the device mapping of a Mapped extent) that the view holding this value keeps alive;
        // the slice is leaked, never freed by cudarc (Drop below).
        BorrowedSlice(Some(unsafe { stream.upgrade_device_ptr::<u8>(ptr, len) }))
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
    fn drop(&mut self) {
        if let Some(s) = self.0.take() {
            s.leak();
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
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec![format!("--gpu-architecture=compute_{major}{minor}")],
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts)
        .map_err(|e| Error::Cuda { call: "nvrtcCompileProgram", message: e.to_string() })?;
    let module = ctx.load_module(ptx).map_err(cu("cuModuleLoadData"))?;
    let mut funcs = Vec::with_capacity(N);
    for name in names {
        funcs.push(module.load_function(name).map_err(cu("cuModuleGetFunction"))?);
    }
    let funcs: [cudarc::driver::CudaFunction; N] =
        funcs.try_into().unwrap_or_else(|_| unreachable!("one function per name"));
    Ok((module, funcs))
}
