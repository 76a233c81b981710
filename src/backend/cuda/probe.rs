//! Raw transfer measurements straight through the driver, without the store: the reference
//! figures the store's own paths are compared with (`strata bench`, the bandwidth example),
//! published as [`strata::probe`](crate::compute::probe).
//!
//! [`GpuProbe`] measures every raw GPU path of `strata bench` ([`GpuPath`]): copies from pinned
//! and pageable host memory, both directions at once, device to device, a streaming kernel read
//! of HBM, mapped (zero-copy) host memory and managed memory, a sparse gather, managed-memory
//! prefetch, and disk to device through pinned staging. GPU work is timed with CUDA events
//! after warm-up, like `../shared/peers/transfer_anchors.py`, whose figures these agree with.
//! It is driver code (raw allocations, copies, prefetches and launches), so it lives in the
//! backend; what it measures against is the store above.
//!
//! ## Safety
//! The probe owns every buffer it measures with (pinned, mapped, device, managed and pageable),
//! each at least as large as the largest size it was made for, and frees them only after both of
//! its streams are synchronized (its `Drop`). Each measurement issues work on its own streams
//! only and waits for it (an event or a stream synchronize) before it returns, so the CPU never
//! touches a buffer while a copy or kernel may still use it.

use std::ffi::c_void;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{
    result, sys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaStream, DriverError,
    LaunchConfig, PushKernelArg,
};

use crate::base::error::{Error, Result};

/// Direction of a raw copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Host (pinned) to device.
    HostToDevice,
    /// Device to host (pinned).
    DeviceToHost,
}

/// Times `iters` copies of `bytes` between a pinned host buffer (`cuMemHostAlloc(PORTABLE)`) and
/// device memory (`cuMemAlloc`) with `cuMemcpy*Async` on a fresh stream, each timed on the wall
/// clock from issue to `cuStreamSynchronize`, after one warm-up copy. Returns the seconds of
/// each copy. The buffers are allocated for the measurement and freed after it.
pub fn raw_pinned_copy(
    ctx: &Arc<CudaContext>,
    bytes: usize,
    dir: Direction,
    iters: usize,
) -> Result<Vec<f64>> {
    let cu = |call: &'static str| move |e| Error::cuda(call, e);
    ctx.bind_to_thread().map_err(cu("cuCtxSetCurrent"))?;
    let stream = ctx.new_stream().map_err(cu("cuStreamCreate"))?;
    // SAFETY: a fresh pinned allocation of `bytes`, freed below after the stream is synchronized.
    let host = unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }
        .map_err(cu("cuMemHostAlloc"))?;
    // SAFETY: a fresh device allocation of `bytes`, freed below.
    let dev = match unsafe { result::malloc_sync(bytes) } {
        Ok(d) => d,
        Err(e) => {
            // SAFETY: allocated just above, not used by any copy.
            let _ = unsafe { result::free_host(host) };
            return Err(Error::cuda("cuMemAlloc", e));
        }
    };
    let run = || -> Result<f64> {
        let t = Instant::now();
        // SAFETY: both buffers are `bytes` long, live until after the synchronize below, and
        // only this function uses them.
        let r = unsafe {
            match dir {
                Direction::HostToDevice => {
                    sys::cuMemcpyHtoDAsync_v2(dev, host as *const c_void, bytes, stream.cu_stream())
                }
                Direction::DeviceToHost => {
                    sys::cuMemcpyDtoHAsync_v2(host, dev, bytes, stream.cu_stream())
                }
            }
        };
        r.result().map_err(cu("cuMemcpyAsync"))?;
        stream.synchronize().map_err(cu("cuStreamSynchronize"))?;
        Ok(t.elapsed().as_secs_f64())
    };
    let out = run().and_then(|_| (0..iters.max(1)).map(|_| run()).collect::<Result<Vec<f64>>>());
    let _ = stream.synchronize();
    // SAFETY: the stream is synchronized: no copy uses the buffers any more.
    unsafe {
        let _ = result::free_sync(dev);
        let _ = result::free_host(host);
    }
    out
}

/// The median of the timings after the first (a warm-up), or the first when it is all there is
/// (0 for none).
pub fn median_after_first(xs: &[f64]) -> f64 {
    match xs {
        [] => 0.0,
        [only] => *only,
        [_, rest @ ..] => median(rest),
    }
}

/// The median of some timings (0 for none).
pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

/// Bytes of one row of the sparse gather ([`GpuPath::GatherHbm`], [`GpuPath::GatherMapped`]).
pub const GATHER_ROW_BYTES: usize = 256;
/// The sparse gather reads one row in this many (1%).
pub const GATHER_ONE_IN: usize = 100;

/// Largest piece of a disk read in [`GpuProbe::disk_to_device`] (like `dd bs=16M`).
pub const DISK_CHUNK: usize = 16 << 20;

/// Alignment `O_DIRECT` needs of offsets, lengths and buffer addresses.
const DIRECT_ALIGN: usize = 4096;

/// A raw GPU path that [`GpuProbe::measure`] times.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GpuPath {
    /// `cuMemcpyHtoDAsync` from pinned host memory.
    H2dPinned,
    /// `cuMemcpyDtoHAsync` into pinned host memory.
    D2hPinned,
    /// `cuMemcpyHtoDAsync` from pageable memory (a `Vec<u8>`): the driver stages it.
    H2dPageable,
    /// `cuMemcpyDtoHAsync` into pageable memory.
    D2hPageable,
    /// Host to device and device to host at once on two streams (pinned); counts both ways.
    BidirPinned,
    /// `cuMemcpyDtoDAsync`; counts bytes read plus bytes written, like the reference script.
    D2d,
    /// The streaming float4 read kernel over device memory.
    KernelReadHbm,
    /// The same kernel over mapped (zero-copy) host memory, read in place over PCIe.
    KernelReadMapped,
    /// The sparse gather (1% of 256-byte rows) from device memory; counts the rows read.
    GatherHbm,
    /// The sparse gather from mapped host memory: only the rows read cross PCIe.
    GatherMapped,
    /// `cuMemPrefetchAsync` of host-resident managed memory to the device.
    ManagedPrefetch,
    /// The streaming read kernel over host-resident managed memory (on-demand page faults).
    ManagedFaults,
}

impl GpuPath {
    /// Every raw GPU path, in the order `strata bench` reports them.
    pub const ALL: [GpuPath; 12] = [
        GpuPath::H2dPinned,
        GpuPath::D2hPinned,
        GpuPath::H2dPageable,
        GpuPath::D2hPageable,
        GpuPath::BidirPinned,
        GpuPath::D2d,
        GpuPath::KernelReadHbm,
        GpuPath::KernelReadMapped,
        GpuPath::GatherHbm,
        GpuPath::GatherMapped,
        GpuPath::ManagedPrefetch,
        GpuPath::ManagedFaults,
    ];

    /// The path's name, as in `strata bench`'s table and CSV.
    pub const fn name(self) -> &'static str {
        match self {
            GpuPath::H2dPinned => "h2d_pinned",
            GpuPath::D2hPinned => "d2h_pinned",
            GpuPath::H2dPageable => "h2d_pageable",
            GpuPath::D2hPageable => "d2h_pageable",
            GpuPath::BidirPinned => "bidir_pinned",
            GpuPath::D2d => "d2d",
            GpuPath::KernelReadHbm => "kernel_read_hbm",
            GpuPath::KernelReadMapped => "kernel_read_mapped",
            GpuPath::GatherHbm => "gather_hbm",
            GpuPath::GatherMapped => "gather_mapped",
            GpuPath::ManagedPrefetch => "managed_prefetch",
            GpuPath::ManagedFaults => "managed_faults",
        }
    }

    /// Bytes one run of the path counts for a buffer of `bytes` (what GB/s is computed from):
    /// both directions for [`GpuPath::BidirPinned`], read plus write for [`GpuPath::D2d`], the
    /// rows read for the gathers, the float4s read for the read kernels.
    pub fn counted_bytes(self, bytes: usize) -> u64 {
        let b = bytes as u64;
        match self {
            GpuPath::BidirPinned | GpuPath::D2d => 2 * b,
            GpuPath::KernelReadHbm | GpuPath::KernelReadMapped | GpuPath::ManagedFaults => {
                b / 16 * 16
            }
            GpuPath::GatherHbm | GpuPath::GatherMapped => {
                let (_, nsel) = gather_shape(bytes);
                nsel as u64 * GATHER_ROW_BYTES as u64
            }
            _ => b,
        }
    }
}

/// `(group, picks)` of the sparse gather over `bytes`: one 256-byte row is read out of each
/// `group` consecutive rows, `picks` rows in all (at least one when there is a whole row).
pub fn gather_shape(bytes: usize) -> (usize, usize) {
    let rows = bytes / GATHER_ROW_BYTES;
    if rows == 0 {
        return (1, 0);
    }
    let picks = (rows / GATHER_ONE_IN).max(1);
    (rows / picks, picks)
}

/// Timings of one path at one size.
#[derive(Clone, Debug, PartialEq)]
pub struct Timing {
    /// Seconds of each timed run (warm-up runs excluded).
    pub seconds: Vec<f64>,
    /// Bytes each run counts (see [`GpuPath::counted_bytes`]).
    pub bytes: u64,
}

impl Timing {
    /// Median seconds of the runs.
    pub fn median_s(&self) -> f64 {
        median(&self.seconds)
    }

    /// Bandwidth of the median run in GB/s (10^9 bytes per second); 0 when nothing was timed.
    pub fn gbps(&self) -> f64 {
        let t = self.median_s();
        if t > 0.0 {
            self.bytes as f64 / t / 1e9
        } else {
            0.0
        }
    }
}

/// Facts about the GPU a [`GpuProbe`] runs on, for reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    /// Device ordinal.
    pub ordinal: usize,
    /// The device's name.
    pub name: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// Device memory in bytes.
    pub total_mem: u64,
    /// Free device memory in bytes when the probe was made.
    pub free_mem: u64,
    /// The CUDA driver's version (12080 for 12.8).
    pub driver_version: i32,
}

fn cu(call: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::cuda(call, e)
}

/// Page-locked host memory from `cuMemHostAlloc`, mapped into the device when `dev != 0`.
struct HostMem {
    ptr: *mut u8,
    len: usize,
    dev: u64,
    ctx: Arc<CudaContext>,
}

impl HostMem {
    /// `len` bytes of pinned host memory (`PORTABLE`, and `DEVICEMAP` when `mapped`), zeroed.
    fn alloc(ctx: &Arc<CudaContext>, len: usize, mapped: bool) -> Result<HostMem> {
        ctx.bind_to_thread().map_err(cu("cuCtxSetCurrent"))?;
        let mut flags = sys::CU_MEMHOSTALLOC_PORTABLE;
        if mapped {
            flags |= sys::CU_MEMHOSTALLOC_DEVICEMAP;
        }
        // SAFETY: the context is current; the allocation is owned by the returned value and freed
        // once, in its Drop.
        let ptr = unsafe { result::malloc_host(len, flags) }.map_err(cu("cuMemHostAlloc"))?;
        let mut mem = HostMem { ptr: ptr as *mut u8, len, dev: 0, ctx: ctx.clone() };
        // SAFETY: `ptr` points to `len` bytes just allocated, which nothing else uses yet.
        unsafe { std::ptr::write_bytes(mem.ptr, 0, len) };
        if mapped {
            let mut dev: sys::CUdeviceptr = 0;
            // SAFETY: `ptr` was allocated with DEVICEMAP just above in the current context;
            // flags must be 0 (CUDA docs of cuMemHostGetDevicePointer).
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, ptr, 0) }
                .result()
                .map_err(cu("cuMemHostGetDevicePointer"))?;
            mem.dev = dev;
        }
        Ok(mem)
    }

    /// The first `len` bytes, for the CPU.
    ///
    /// # Safety
    /// No copy or kernel that uses the buffer may be in flight, and `len <= self.len`.
    unsafe fn slice_mut(&mut self, len: usize) -> &mut [u8] {
        debug_assert!(len <= self.len);
        // SAFETY: the caller guarantees no device work uses the buffer and `len` is in bounds;
        // `&mut self` makes this the only CPU reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, len) }
    }
}

impl Drop for HostMem {
    fn drop(&mut self) {
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: `ptr` came from cuMemHostAlloc and is freed once, here; the probe synchronized
        // its streams before dropping its buffers (module docs, ## Safety).
        self.ctx.record_err(unsafe { result::free_host(self.ptr as *mut c_void) });
    }
}

/// Device (`cuMemAlloc`) or managed (`cuMemAllocManaged`) memory; both are freed by `cuMemFree`.
struct DevMem {
    ptr: u64,
    len: usize,
    ctx: Arc<CudaContext>,
}

impl DevMem {
    /// `len` bytes of device memory, zeroed.
    fn alloc(ctx: &Arc<CudaContext>, len: usize) -> Result<DevMem> {
        ctx.bind_to_thread().map_err(cu("cuCtxSetCurrent"))?;
        // SAFETY: the context is current; owned by the returned value, freed in its Drop.
        let ptr = unsafe { result::malloc_sync(len) }.map_err(cu("cuMemAlloc"))?;
        let mem = DevMem { ptr, len, ctx: ctx.clone() };
        // SAFETY: `ptr` is `len` bytes of device memory just allocated.
        unsafe { result::memset_d8_sync(ptr, 0, len) }.map_err(cu("cuMemsetD8"))?;
        Ok(mem)
    }

    /// `len` bytes of managed memory (`CU_MEM_ATTACH_GLOBAL`), written once by the CPU so that
    /// every page starts out resident on the host.
    fn alloc_managed(ctx: &Arc<CudaContext>, len: usize) -> Result<DevMem> {
        ctx.bind_to_thread().map_err(cu("cuCtxSetCurrent"))?;
        // SAFETY: the context is current; owned by the returned value, freed in its Drop.
        let ptr =
            unsafe { result::malloc_managed(len, sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL) }
                .map_err(cu("cuMemAllocManaged"))?;
        let mem = DevMem { ptr, len, ctx: ctx.clone() };
        // SAFETY: managed memory is addressable by the CPU at its device address (unified
        // addressing, 64-bit Linux); `len` bytes were just allocated and no GPU work uses them.
        unsafe { std::ptr::write_bytes(ptr as usize as *mut u8, 1, len) };
        Ok(mem)
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: `ptr` came from cuMemAlloc or cuMemAllocManaged and is freed once, here, after
        // the probe synchronized its streams.
        self.ctx.record_err(unsafe { result::free_sync(self.ptr) });
    }
}

/// The bench kernels (`cuda/bench.cu`), compiled with NVRTC.
struct BenchKernels {
    _module: Arc<CudaModule>,
    rsum: CudaFunction,
    gather: CudaFunction,
}

pub(crate) const BENCH_SOURCE: &str = include_str!("../../../cuda/bench.cu");

fn compile_kernels(ctx: &Arc<CudaContext>) -> Result<BenchKernels> {
    let (module, [rsum, gather]) =
        super::load_kernels(ctx, BENCH_SOURCE, ["strata_bench_rsum", "strata_bench_gather"])?;
    Ok(BenchKernels { _module: module, rsum, gather })
}

/// Fills `slot` with `make()` if empty and returns what it holds.
fn lazy<T>(slot: &mut Option<T>, make: impl FnOnce() -> Result<T>) -> Result<&mut T> {
    Ok(match slot {
        Some(v) => v,
        empty => empty.insert(make()?),
    })
}

/// Raw GPU measurements for `strata bench`: owns its streams, timing events and buffers (made
/// on first use, sized for the largest size asked for, kept for the following measurements).
///
/// ```no_run
/// use strata::probe::{GpuPath, GpuProbe};
/// # fn main() -> strata::Result<()> {
/// let ctx = strata::cudarc::driver::CudaContext::new(0).expect("a GPU");
/// let mut probe = GpuProbe::new(&ctx, 1 << 30)?;
/// let t = probe.measure(GpuPath::H2dPinned, 1 << 30, 3, 5)?;
/// println!("pinned H2D: {:.1} GB/s", t.gbps());
/// # Ok(()) }
/// ```
pub struct GpuProbe {
    ctx: Arc<CudaContext>,
    s1: Arc<CudaStream>,
    s2: Arc<CudaStream>,
    start: CudaEvent,
    end: CudaEvent,
    /// Timing-free event: where the second stream is (both directions at once).
    mid: CudaEvent,
    /// Timing-free events: when each staging buffer's copy is done (disk to device).
    staged: [CudaEvent; 2],
    max: usize,
    sm_count: u32,
    info: GpuInfo,
    pinned_a: Option<HostMem>,
    pinned_b: Option<HostMem>,
    mapped: Option<HostMem>,
    staging: [Option<HostMem>; 2],
    pageable: Vec<u8>,
    dev_a: Option<DevMem>,
    dev_b: Option<DevMem>,
    out: Option<DevMem>,
    managed: Option<DevMem>,
    /// The compiled kernels, or why compiling failed (not retried).
    kernels: Option<std::result::Result<BenchKernels, String>>,
}

impl GpuProbe {
    /// A probe on `ctx` for sizes up to `max_bytes`. Allocates nothing yet.
    pub fn new(ctx: &Arc<CudaContext>, max_bytes: usize) -> Result<GpuProbe> {
        if max_bytes == 0 {
            return Err(Error::InvalidArgument("a probe for 0 bytes".into()));
        }
        ctx.bind_to_thread().map_err(cu("cuCtxSetCurrent"))?;
        let s1 = ctx.new_stream().map_err(cu("cuStreamCreate"))?;
        let s2 = ctx.new_stream().map_err(cu("cuStreamCreate"))?;
        let timing = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = ctx.new_event(timing).map_err(cu("cuEventCreate"))?;
        let end = ctx.new_event(timing).map_err(cu("cuEventCreate"))?;
        let mid = ctx.new_event(None).map_err(cu("cuEventCreate"))?;
        let staged = [
            ctx.new_event(None).map_err(cu("cuEventCreate"))?,
            ctx.new_event(None).map_err(cu("cuEventCreate"))?,
        ];
        let sm = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cu("cuDeviceGetAttribute"))?;
        let mut driver_version = 0;
        // SAFETY: writes one int; the driver is loaded (the context exists).
        unsafe { sys::cuDriverGetVersion(&mut driver_version) }
            .result()
            .map_err(cu("cuDriverGetVersion"))?;
        let (free, total) = ctx.mem_get_info().map_err(cu("cuMemGetInfo"))?;
        let info = GpuInfo {
            ordinal: ctx.ordinal(),
            name: ctx.name().unwrap_or_else(|_| "unknown device".into()),
            compute_capability: ctx.compute_capability().map_err(cu("cuDeviceGetAttribute"))?,
            sm_count: sm.max(1) as u32,
            total_mem: total as u64,
            free_mem: free as u64,
            driver_version,
        };
        Ok(GpuProbe {
            ctx: ctx.clone(),
            s1,
            s2,
            start,
            end,
            mid,
            staged,
            max: max_bytes,
            sm_count: info.sm_count,
            info,
            pinned_a: None,
            pinned_b: None,
            mapped: None,
            staging: [None, None],
            pageable: Vec::new(),
            dev_a: None,
            dev_b: None,
            out: None,
            managed: None,
            kernels: None,
        })
    }

    /// The GPU measured.
    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    /// Largest size the managed-memory paths measure: the probe's largest size, at most half of
    /// the device memory free now (managed memory is never oversubscribed here), in whole pages.
    pub fn managed_limit(&self) -> Result<usize> {
        if let Some(m) = &self.managed {
            return Ok(m.len);
        }
        let (free, _) = self.ctx.mem_get_info().map_err(cu("cuMemGetInfo"))?;
        Ok(self.max.min(free / 2) / DIRECT_ALIGN * DIRECT_ALIGN)
    }

    /// Times `path` on a buffer of `bytes`: `warmup` untimed runs, then `reps` runs, each timed
    /// with CUDA events on the probe's stream.
    pub fn measure(
        &mut self,
        path: GpuPath,
        bytes: usize,
        warmup: usize,
        reps: usize,
    ) -> Result<Timing> {
        if bytes == 0 || bytes > self.max {
            return Err(Error::InvalidArgument(format!(
                "size {bytes} outside 1..={} of this probe",
                self.max
            )));
        }
        if reps == 0 {
            return Err(Error::InvalidArgument("0 timed runs".into()));
        }
        if matches!(path, GpuPath::GatherHbm | GpuPath::GatherMapped) && bytes < GATHER_ROW_BYTES {
            return Err(Error::InvalidArgument(format!(
                "the gather reads {GATHER_ROW_BYTES}-byte rows: {bytes} bytes hold none"
            )));
        }
        self.ctx.bind_to_thread().map_err(cu("cuCtxSetCurrent"))?;
        self.prepare(path, bytes)?;
        for _ in 0..warmup {
            self.run_once(path, bytes)?;
        }
        let seconds =
            (0..reps).map(|_| self.run_once(path, bytes)).collect::<Result<Vec<f64>>>()?;
        Ok(Timing { seconds, bytes: path.counted_bytes(bytes) })
    }

    /// Makes the buffers (and kernels) `path` needs.
    fn prepare(&mut self, path: GpuPath, bytes: usize) -> Result<()> {
        let (ctx, max) = (&self.ctx, self.max);
        let need_kernels = matches!(
            path,
            GpuPath::KernelReadHbm
                | GpuPath::KernelReadMapped
                | GpuPath::GatherHbm
                | GpuPath::GatherMapped
                | GpuPath::ManagedFaults
        );
        if need_kernels {
            let k =
                self.kernels.get_or_insert_with(|| compile_kernels(ctx).map_err(|e| e.to_string()));
            if let Err(why) = k {
                return Err(Error::Cuda { call: "nvrtc", message: why.clone() });
            }
            lazy(&mut self.out, || DevMem::alloc(ctx, 256))?;
        }
        match path {
            GpuPath::H2dPinned | GpuPath::D2hPinned => {
                lazy(&mut self.pinned_a, || HostMem::alloc(ctx, max, false))?;
                lazy(&mut self.dev_a, || DevMem::alloc(ctx, max))?;
            }
            GpuPath::H2dPageable | GpuPath::D2hPageable => {
                if self.pageable.len() < max {
                    // Written, so that every page exists before the copies time it.
                    self.pageable = vec![1u8; max];
                }
                lazy(&mut self.dev_a, || DevMem::alloc(ctx, max))?;
            }
            GpuPath::BidirPinned => {
                lazy(&mut self.pinned_a, || HostMem::alloc(ctx, max, false))?;
                lazy(&mut self.pinned_b, || HostMem::alloc(ctx, max, false))?;
                lazy(&mut self.dev_a, || DevMem::alloc(ctx, max))?;
                lazy(&mut self.dev_b, || DevMem::alloc(ctx, max))?;
            }
            GpuPath::D2d => {
                lazy(&mut self.dev_a, || DevMem::alloc(ctx, max))?;
                lazy(&mut self.dev_b, || DevMem::alloc(ctx, max))?;
            }
            GpuPath::KernelReadHbm | GpuPath::GatherHbm => {
                lazy(&mut self.dev_a, || DevMem::alloc(ctx, max))?;
            }
            GpuPath::KernelReadMapped | GpuPath::GatherMapped => {
                lazy(&mut self.mapped, || HostMem::alloc(ctx, max, true))?;
            }
            GpuPath::ManagedPrefetch | GpuPath::ManagedFaults => {
                if self.info.driver_version < 12020 {
                    return Err(Error::Cuda {
                        call: "cuMemPrefetchAsync_v2",
                        message: format!(
                            "needs a CUDA 12.2 driver or newer, this one is {}",
                            self.info.driver_version
                        ),
                    });
                }
                let concurrent = self
                    .ctx
                    .attribute(
                        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS,
                    )
                    .map_err(cu("cuDeviceGetAttribute"))?;
                if concurrent == 0 {
                    return Err(Error::InvalidArgument(
                        "the device has no concurrent managed access (no on-demand paging)".into(),
                    ));
                }
                let limit = self.managed_limit()?;
                if bytes > limit {
                    return Err(Error::InvalidArgument(format!(
                        "{} of managed memory is more than half the free device memory \
                         (limit {})",
                        crate::base::types::format_size(bytes as u64),
                        crate::base::types::format_size(limit as u64)
                    )));
                }
                lazy(&mut self.managed, || DevMem::alloc_managed(ctx, limit))?;
            }
        }
        Ok(())
    }

    /// Records `start` on the first stream, runs `issue` (which issues work on the streams, the
    /// first one last), records `end` and returns the seconds between the two events.
    fn timed(&self, issue: impl FnOnce() -> Result<()>) -> Result<f64> {
        self.start.record(&self.s1).map_err(cu("cuEventRecord"))?;
        issue()?;
        self.end.record(&self.s1).map_err(cu("cuEventRecord"))?;
        let ms = self.start.elapsed_ms(&self.end).map_err(cu("cuEventElapsedTime"))?;
        Ok(ms as f64 / 1e3)
    }

    fn kernels(&self) -> Result<&BenchKernels> {
        match &self.kernels {
            Some(Ok(k)) => Ok(k),
            Some(Err(why)) => Err(Error::Cuda { call: "nvrtc", message: why.clone() }),
            None => Err(Error::InvalidArgument("kernels not compiled".into())),
        }
    }

    fn out_ptr(&self) -> Result<u64> {
        self.out.as_ref().map(|m| m.ptr).ok_or_else(missing)
    }

    /// Launches the streaming read over `n4` float4s at device address `ptr` on the first stream.
    fn launch_rsum(&self, ptr: u64, n4: u64) -> Result<()> {
        let k = self.kernels()?;
        let out = self.out_ptr()?;
        // The reference script's launch: 8 blocks of 256 threads per SM, grid-stride loop.
        let cfg = LaunchConfig {
            grid_dim: (self.sm_count * 8, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.s1.launch_builder(&k.rsum);
        b.arg(&ptr).arg(&n4).arg(&out);
        // SAFETY: strata_bench_rsum(const float4*, u64, float*): `ptr` is device-accessible
        // memory (device, mapped or managed) of at least `n4 * 16` bytes owned by the probe,
        // `out` a 256-byte device buffer of the probe; both outlive the launch (the caller
        // waits for the end event).
        unsafe { b.launch(cfg) }.map_err(cu("cuLaunchKernel"))?;
        Ok(())
    }

    /// Launches the sparse gather over the `bytes` at device address `ptr` on the first stream.
    fn launch_gather(&self, ptr: u64, bytes: usize) -> Result<()> {
        let k = self.kernels()?;
        let out = self.out_ptr()?;
        let (group, picks) = gather_shape(bytes);
        let threads = picks as u64 * 16;
        let blocks = threads.div_ceil(256).clamp(1, self.sm_count as u64 * 32) as u32;
        let cfg =
            LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let (group, picks) = (group as u64, picks as u64);
        let mut b = self.s1.launch_builder(&k.gather);
        b.arg(&ptr).arg(&group).arg(&picks).arg(&out);
        // SAFETY: strata_bench_gather(const float4*, u64, u64, float*): it reads rows below
        // `group * picks <= bytes / 256` of the `bytes` at `ptr`, device-accessible memory owned
        // by the probe; `out` is the probe's device buffer; both outlive the launch.
        unsafe { b.launch(cfg) }.map_err(cu("cuLaunchKernel"))?;
        Ok(())
    }

    /// Makes the first `bytes` of the managed buffer resident on the host again, as the reference
    /// script does before each managed-memory measurement: the CPU writes every page.
    fn managed_to_host(&mut self, bytes: usize) -> Result<u64> {
        self.s1.synchronize().map_err(cu("cuStreamSynchronize"))?;
        let m = self.managed.as_ref().ok_or_else(missing)?;
        let ptr = m.ptr;
        if bytes > m.len {
            return Err(missing());
        }
        let host =
            sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST, id: 0 };
        // A prefetch to the host first only makes the CPU's writes below cheaper (no page fault
        // per page); if the driver refuses it, the writes alone migrate the pages.
        // SAFETY: `ptr..ptr + bytes` lies inside the probe's managed allocation; the stream is the
        // probe's and is synchronized right after.
        let _ = unsafe { sys::cuMemPrefetchAsync_v2(ptr, bytes, host, 0, self.s1.cu_stream()) };
        self.s1.synchronize().map_err(cu("cuStreamSynchronize"))?;
        // SAFETY: managed memory is addressable by the CPU at its device address; the range is
        // inside the allocation and no GPU work is in flight (the stream is synchronized and only
        // the probe's first stream ever uses this buffer).
        unsafe { std::ptr::write_bytes(ptr as usize as *mut u8, 2, bytes) };
        Ok(ptr)
    }

    /// One run of `path` over `bytes` (buffers made by `prepare`); returns its seconds.
    fn run_once(&mut self, path: GpuPath, bytes: usize) -> Result<f64> {
        let s1 = self.s1.cu_stream();
        let s2 = self.s2.cu_stream();
        let dev_a = self.dev_a.as_ref().map(|m| m.ptr);
        let dev_b = self.dev_b.as_ref().map(|m| m.ptr);
        let pin_a = self.pinned_a.as_ref().map(|m| m.ptr);
        let pin_b = self.pinned_b.as_ref().map(|m| m.ptr);
        match path {
            GpuPath::H2dPinned => {
                let (d, h) = (dev_a.ok_or_else(missing)?, pin_a.ok_or_else(missing)?);
                self.timed(|| {
                    // SAFETY: `h` (pinned) and `d` are probe buffers of at least `bytes` (<= max);
                    // the copy is complete when `timed` returns (it waits for the end event).
                    unsafe { sys::cuMemcpyHtoDAsync_v2(d, h as *const c_void, bytes, s1) }
                        .result()
                        .map_err(cu("cuMemcpyHtoDAsync"))
                })
            }
            GpuPath::D2hPinned => {
                let (d, h) = (dev_a.ok_or_else(missing)?, pin_a.ok_or_else(missing)?);
                self.timed(|| {
                    // SAFETY: `h` (pinned) and `d` are probe buffers of at least `bytes` (<= max);
                    // the copy is complete when `timed` returns (it waits for the end event).
                    unsafe { sys::cuMemcpyDtoHAsync_v2(h as *mut c_void, d, bytes, s1) }
                        .result()
                        .map_err(cu("cuMemcpyDtoHAsync"))
                })
            }
            GpuPath::H2dPageable => {
                let d = dev_a.ok_or_else(missing)?;
                let h = self.pageable.get(..bytes).ok_or_else(missing)?.as_ptr();
                self.timed(|| {
                    // SAFETY: `h` is `bytes` of the probe's pageable buffer, neither moved nor
                    // written while the copy runs (`timed` waits for the end event).
                    unsafe { sys::cuMemcpyHtoDAsync_v2(d, h as *const c_void, bytes, s1) }
                        .result()
                        .map_err(cu("cuMemcpyHtoDAsync"))
                })
            }
            GpuPath::D2hPageable => {
                let d = dev_a.ok_or_else(missing)?;
                let h = self.pageable.get_mut(..bytes).ok_or_else(missing)?.as_mut_ptr();
                self.timed(|| {
                    // SAFETY: `h` is `bytes` of the probe's pageable buffer, not otherwise touched
                    // until `timed` has waited for the copy to complete.
                    unsafe { sys::cuMemcpyDtoHAsync_v2(h as *mut c_void, d, bytes, s1) }
                        .result()
                        .map_err(cu("cuMemcpyDtoHAsync"))
                })
            }
            GpuPath::BidirPinned => {
                let (da, db) = (dev_a.ok_or_else(missing)?, dev_b.ok_or_else(missing)?);
                let (ha, hb) = (pin_a.ok_or_else(missing)?, pin_b.ok_or_else(missing)?);
                self.timed(|| {
                    // The second stream starts with the first (after `start`), and the first
                    // records `end` only after the second is done: the time covers both.
                    self.s2.wait(&self.start).map_err(cu("cuStreamWaitEvent"))?;
                    // SAFETY: four distinct probe buffers of at least `bytes`, pinned on the host
                    // side; both copies are complete once the end event is (joined below).
                    unsafe { sys::cuMemcpyHtoDAsync_v2(da, ha as *const c_void, bytes, s1) }
                        .result()
                        .map_err(cu("cuMemcpyHtoDAsync"))?;
                    // SAFETY: as above.
                    unsafe { sys::cuMemcpyDtoHAsync_v2(hb as *mut c_void, db, bytes, s2) }
                        .result()
                        .map_err(cu("cuMemcpyDtoHAsync"))?;
                    self.mid.record(&self.s2).map_err(cu("cuEventRecord"))?;
                    self.s1.wait(&self.mid).map_err(cu("cuStreamWaitEvent"))
                })
            }
            GpuPath::D2d => {
                let (da, db) = (dev_a.ok_or_else(missing)?, dev_b.ok_or_else(missing)?);
                self.timed(|| {
                    // SAFETY: two distinct device buffers of the probe of at least `bytes`,
                    // complete when `timed` returns.
                    unsafe { sys::cuMemcpyDtoDAsync_v2(db, da, bytes, s1) }
                        .result()
                        .map_err(cu("cuMemcpyDtoDAsync"))
                })
            }
            GpuPath::KernelReadHbm => {
                let d = dev_a.ok_or_else(missing)?;
                self.timed(|| self.launch_rsum(d, (bytes / 16) as u64))
            }
            GpuPath::KernelReadMapped => {
                let d = self.mapped.as_ref().map(|m| m.dev).ok_or_else(missing)?;
                self.timed(|| self.launch_rsum(d, (bytes / 16) as u64))
            }
            GpuPath::GatherHbm => {
                let d = dev_a.ok_or_else(missing)?;
                self.timed(|| self.launch_gather(d, bytes))
            }
            GpuPath::GatherMapped => {
                let d = self.mapped.as_ref().map(|m| m.dev).ok_or_else(missing)?;
                self.timed(|| self.launch_gather(d, bytes))
            }
            GpuPath::ManagedPrefetch => {
                let ptr = self.managed_to_host(bytes)?;
                let dev = sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: self.info.ordinal as i32,
                };
                self.timed(|| {
                    // SAFETY: `ptr..ptr + bytes` lies inside the probe's managed allocation;
                    // the prefetch runs on the probe's stream and `timed` waits for it.
                    unsafe { sys::cuMemPrefetchAsync_v2(ptr, bytes, dev, 0, s1) }
                        .result()
                        .map_err(cu("cuMemPrefetchAsync"))
                })
            }
            GpuPath::ManagedFaults => {
                let ptr = self.managed_to_host(bytes)?;
                self.timed(|| self.launch_rsum(ptr, (bytes / 16) as u64))
            }
        }
    }

    /// Times disk to device without the store: the file read with `O_DIRECT` (one request at a
    /// time, [`DISK_CHUNK`] bytes each) into two pinned staging buffers in turn, each piece
    /// copied to the device while the next is read; wall clock from the first read to the last
    /// copy's completion. `file` must hold at least `bytes` rounded up to 4096. Returns the
    /// timings and whether `O_DIRECT` was used (the file system may refuse it: then the reads
    /// are buffered, and the page cache may serve them).
    pub fn disk_to_device(
        &mut self,
        file: &Path,
        bytes: usize,
        warmup: usize,
        reps: usize,
    ) -> Result<(Timing, bool)> {
        if bytes == 0 || bytes > self.max || reps == 0 {
            return Err(Error::InvalidArgument(format!(
                "disk to device of {bytes} bytes, {reps} runs (probe made for {})",
                self.max
            )));
        }
        let padded = bytes.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        let len = std::fs::metadata(file).map_err(|e| Error::io(file, e))?.len();
        if len < padded as u64 {
            return Err(Error::InvalidArgument(format!(
                "{} holds {len} bytes, fewer than the {padded} to read",
                file.display()
            )));
        }
        self.ctx.bind_to_thread().map_err(cu("cuCtxSetCurrent"))?;
        // Nothing may still read a staging buffer that is about to be replaced.
        self.s1.synchronize().map_err(cu("cuStreamSynchronize"))?;
        let (ctx, max) = (&self.ctx, self.max);
        lazy(&mut self.dev_a, || DevMem::alloc(ctx, max))?;
        let stage = DISK_CHUNK.min(padded);
        for slot in &mut self.staging {
            if slot.as_ref().is_some_and(|s| s.len < stage) {
                *slot = None;
            }
            lazy(slot, || HostMem::alloc(ctx, stage, false))?;
        }
        let (mut f, mut direct) = match open_direct(file) {
            Some(f) => (f, true),
            None => (File::open(file).map_err(|e| Error::io(file, e))?, false),
        };
        let mut times = Vec::with_capacity(reps);
        for run in 0..warmup + reps {
            let t = Instant::now();
            let res = self.disk_pass(&f, bytes);
            let res = match res {
                // Some file systems accept O_DIRECT at open and refuse the I/O (EINVAL).
                Err(Error::Io { source, .. })
                    if direct && source.raw_os_error() == Some(libc::EINVAL) =>
                {
                    direct = false;
                    f = File::open(file).map_err(|e| Error::io(file, e))?;
                    self.disk_pass(&f, bytes)
                }
                r => r,
            };
            res.map_err(|e| match e {
                Error::Io { source, .. } => Error::io(file, source),
                e => e,
            })?;
            if run >= warmup {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        Ok((Timing { seconds: times, bytes: bytes as u64 }, direct))
    }

    /// One pass of [`GpuProbe::disk_to_device`].
    fn disk_pass(&mut self, f: &File, bytes: usize) -> Result<()> {
        let d = self.dev_a.as_ref().map(|m| m.ptr).ok_or_else(missing)?;
        // A pass that failed half-way may have left copies from the staging buffers in flight.
        self.s1.synchronize().map_err(cu("cuStreamSynchronize"))?;
        let s1 = self.s1.cu_stream();
        let mut used = [false; 2];
        let mut off = 0;
        let mut k = 0;
        while off < bytes {
            let i = k % 2;
            if used[i] {
                self.staged[i].synchronize().map_err(cu("cuEventSynchronize"))?;
            }
            let buf = self.staging[i].as_mut().ok_or_else(missing)?;
            let n = buf.len.min(bytes - off);
            let padded = n.div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
            // SAFETY: the copy that last used this staging buffer is complete (its event was
            // synchronized above, or it was never used), and `padded <= buf.len` (the buffer is
            // a multiple of 4096 no smaller than any piece).
            let dst = unsafe { buf.slice_mut(padded.min(buf.len)) };
            f.read_exact_at(dst, off as u64).map_err(|e| Error::io("", e))?;
            let src = buf.ptr as *const c_void;
            // SAFETY: `src` is `n` bytes of a pinned staging buffer not written again before
            // the event recorded after this copy completes; `d + off .. d + off + n` lies in the
            // probe's device buffer (off + n <= bytes <= max).
            unsafe { sys::cuMemcpyHtoDAsync_v2(d + off as u64, src, n, s1) }
                .result()
                .map_err(cu("cuMemcpyHtoDAsync"))?;
            self.staged[i].record(&self.s1).map_err(cu("cuEventRecord"))?;
            used[i] = true;
            off += n;
            k += 1;
        }
        self.s1.synchronize().map_err(cu("cuStreamSynchronize"))
    }
}

impl Drop for GpuProbe {
    fn drop(&mut self) {
        // Nothing may still use a buffer when the fields (the buffers among them) are freed.
        self.ctx.record_err(self.s1.synchronize());
        self.ctx.record_err(self.s2.synchronize());
    }
}

/// The error for a buffer that `prepare` should have made (never expected).
fn missing() -> Error {
    Error::InvalidArgument("bench buffer missing (internal error)".into())
}

/// Opens `file` for reading with `O_DIRECT`; `None` where that is refused.
fn open_direct(file: &Path) -> Option<File> {
    OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(file).ok()
}
