//! Raw transfer measurements straight through the driver, without the store: the reference
//! figures the store's own paths are compared with (`strata bench`, the bandwidth example).

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{result, sys, CudaContext};

use crate::error::{Error, Result};

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
