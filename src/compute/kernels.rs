//! Verification kernels: a checksum and a fill pattern computed *on the device* over a view's
//! memory, with host references to compare against.
//!
//! On the CUDA backend they are CUDA C (`cuda/verify.cu`) compiled at run time with NVRTC (which
//! must be installed: `libnvrtc.so`); on the host backend they run over the view's host memory.
//!
//! ```
//! use strata::{kernels::{self, Kernels}, DType, Store, Tier};
//! # fn main() -> strata::Result<()> {
//! let store = Store::builder().host_backend().capacity(Tier::Device, 1 << 20).build()?;
//! let data: Vec<u8> = (0..4096u32).map(|i| i as u8).collect();
//! let id = store.put("t", DType::U8, &[4096], &data)?;
//! let k = Kernels::new(&store)?;
//! let s = store.stream()?;
//! let v = store.device_view(id, &s)?;
//! assert_eq!(k.checksum(&v, 1)?, kernels::checksum_host(&data, 1));
//! # Ok(()) }
//! ```

use std::sync::Arc;

use crate::backend::cuda::programs::Verify;
use crate::base::error::{Error, Result};
use crate::{DeviceView, Store, Stream};

/// A running checksum kept on the device (CUDA) or the host (host backend), summed with wrapping
/// arithmetic across [`Kernels::checksum_into`] calls.
pub struct Checksum {
    dev: Option<(Arc<cudarc::driver::CudaStream>, cudarc::driver::CudaSlice<u64>)>,
    host: u64,
}

impl Checksum {
    /// Waits for the kernels issued so far and returns the sum.
    pub fn value(&self) -> Result<u64> {
        match &self.dev {
            None => Ok(self.host),
            Some((s, d)) => {
                // Wait first: a pageable copy queued behind long kernels would hold up other
                // threads' transfers.
                s.synchronize().map_err(|e| Error::cuda("cuStreamSynchronize", e))?;
                let v = s.clone_dtoh(d).map_err(|e| Error::cuda("cuMemcpyDtoH", e))?;
                Ok(v[0])
            }
        }
    }
}

/// The verification kernels, ready to launch on a store's backend.
pub struct Kernels {
    cuda: Option<Verify>,
}

/// Host reference of the device checksum: `repeats * Σ data[i] * (i % 65521 + 1)` mod 2^64.
pub fn checksum_host(data: &[u8], repeats: u32) -> u64 {
    let one = data
        .iter()
        .enumerate()
        .fold(0u64, |acc, (i, &b)| acc.wrapping_add(b as u64 * (i as u64 % 65521 + 1)));
    one.wrapping_mul(repeats as u64)
}

/// Host reference of the fill kernel: the bytes it writes for `seed`.
pub fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            ((i.wrapping_mul(31).wrapping_add(seed as u64 * 7)) ^ (i >> 8) ^ (seed as u64 >> 3))
                as u8
        })
        .collect()
}

impl Kernels {
    /// Compiles (CUDA: NVRTC, once per call) and loads the kernels for `store`'s backend.
    pub fn new(store: &Store) -> Result<Kernels> {
        let Some(ctx) = store.cuda_context() else { return Ok(Kernels { cuda: None }) };
        Ok(Kernels { cuda: Some(Verify::load(ctx)?) })
    }

    /// Reads the view's bytes on the device (`repeats` passes) on the view's stream and returns
    /// the checksum; equals [`checksum_host`] of the tensor's bytes. Blocks until done.
    pub fn checksum(&self, view: &DeviceView, repeats: u32) -> Result<u64> {
        let stream = view.stream();
        let mut acc = self.accumulator(&stream)?;
        self.checksum_into(view, repeats, &mut acc)?;
        acc.value()
    }

    /// A device-side running checksum for [`Kernels::checksum_into`], on `stream`.
    pub fn accumulator(&self, stream: &Stream) -> Result<Checksum> {
        match stream.cuda() {
            Some(s) if self.cuda.is_some() => {
                let dev = s.alloc_zeros::<u64>(1).map_err(|e| Error::cuda("cuMemAllocAsync", e))?;
                Ok(Checksum { dev: Some((s.clone(), dev)), host: 0 })
            }
            None if self.cuda.is_none() => Ok(Checksum { dev: None, host: 0 }),
            _ => Err(Error::BackendMismatch("stream and kernels of different backends".into())),
        }
    }

    /// Adds the view's checksum (`repeats` passes over its bytes) into `acc` on the view's
    /// stream, without waiting: a kernel that reads a layer, for pipelines that keep copies and
    /// compute overlapped. [`Checksum::value`] waits and reads the sum.
    pub fn checksum_into(&self, view: &DeviceView, repeats: u32, acc: &mut Checksum) -> Result<()> {
        self.checksum_into_on(view, &view.stream(), repeats, acc)
    }

    /// [`Kernels::checksum_into`] on `stream` rather than the view's: work on another stream
    /// over the view's memory, which the caller orders after the view's stream (an event) and
    /// reports with [`DeviceView::record_use`]. `acc` must be an accumulator of `stream`. On the
    /// host backend it reads the bytes at once, after the view's stream.
    pub fn checksum_into_on(
        &self,
        view: &DeviceView,
        stream: &Stream,
        repeats: u32,
        acc: &mut Checksum,
    ) -> Result<()> {
        let repeats = repeats.max(1);
        let Some(k) = &self.cuda else {
            acc.host = acc.host.wrapping_add(view.with_host_bytes(|b| checksum_host(b, repeats))?);
            return Ok(());
        };
        let s = stream
            .cuda()
            .ok_or_else(|| Error::BackendMismatch("host stream, CUDA kernels".into()))?;
        let data = view
            .cuda_view::<u8>()
            .ok_or_else(|| Error::BackendMismatch("view without device memory".into()))?;
        let (_, out) = acc
            .dev
            .as_mut()
            .ok_or_else(|| Error::BackendMismatch("host accumulator, CUDA kernels".into()))?;
        k.checksum(s, &data, repeats, &mut out.as_view_mut())
    }

    /// Writes [`pattern`]`(len, seed)` into the view's memory on the device, on the view's
    /// stream, and marks the view dirty. Returns once issued.
    pub fn fill(&self, view: &mut DeviceView, seed: u32) -> Result<()> {
        let Some(k) = &self.cuda else {
            return view.with_host_bytes_mut(|b| b.copy_from_slice(&pattern(b.len(), seed)));
        };
        let stream = view.stream();
        let s = stream
            .cuda()
            .ok_or_else(|| Error::BackendMismatch("host stream, CUDA kernels".into()))?
            .clone();
        let mut data = view
            .cuda_view_mut::<u8>()
            .ok_or_else(|| Error::BackendMismatch("view without device memory".into()))?;
        k.fill(&s, &mut data, seed)
    }
}

/// Compiles every CUDA C source strata launches (`cuda/*.cu`: these kernels, the linear
/// algebra's, the optimizer's, the bench's) with NVRTC for the virtual architecture `arch`
/// (`"compute_90"` for an H100), without a GPU: each source's name and, where it failed, the
/// compiler's log. An error only when NVRTC itself cannot be loaded (`libnvrtc.so` not found).
///
/// ```
/// match strata::kernels::compile_sources("compute_90") {
///     Ok(results) => {
///         for (name, r) in results {
///             assert!(r.is_ok(), "{name}: {r:?}");
///         }
///     }
///     Err(e) => println!("SKIP: {e}"), // no NVRTC on this machine
/// }
/// ```
pub fn compile_sources(arch: &str) -> Result<Vec<(&'static str, std::result::Result<(), String>)>> {
    crate::backend::cuda::programs::compile_sources(arch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_are_stable() {
        assert_eq!(checksum_host(&[1, 2, 3], 1), 1 + 2 * 2 + 3 * 3);
        assert_eq!(checksum_host(&[1, 2, 3], 3), 3 * 14);
        let p = pattern(300, 5);
        assert_eq!(p.len(), 300);
        assert_ne!(p, pattern(300, 6));
    }
}
