//! Where a run's tensors live in the store and how they get there: parameters homed in host
//! memory ([`put_host`]), activation checkpoints placed so that the stages keep room to stream
//! ([`put_checkpoint`]), candle tensors written into store tensors ([`candle_to_store`]), and
//! parameters read back in f32 ([`read_f32`]).

use candle_core::{DType as CDType, Device, Tensor};

use super::strata_err;
use crate::base::types::{DType, Group, TensorId, Tier};
use crate::{Store, Stream};

/// A tensor homed in host memory: Pinned when it has room, else wherever `put` places it.
pub(crate) fn put_host(
    store: &Store,
    name: &str,
    group: Group,
    dtype: DType,
    shape: &[usize],
    bytes: &[u8],
) -> crate::Result<TensorId> {
    match store.put_in(Tier::Pinned, name, group, dtype, shape, bytes) {
        Ok(id) => Ok(id),
        Err(
            crate::Error::OutOfMemory { .. }
            | crate::Error::TooLarge { .. }
            | crate::Error::TierDisabled { .. },
        ) => store.put_group(name, group, dtype, shape, bytes),
        Err(e) => Err(e),
    }
}

/// An activation checkpoint's home: Pinned when it has room, else the Device tier while that
/// keeps `keep` bytes free, else Disk (never a Device tier filled with checkpoints, which would
/// leave the stages no room to stream through).
pub(super) fn put_checkpoint(
    store: &Store,
    name: &str,
    dtype: DType,
    shape: &[usize],
    bytes: &[u8],
    keep: u64,
) -> crate::Result<TensorId> {
    let group = Group::Activation;
    let short = |e: &crate::Error| {
        matches!(
            e,
            crate::Error::OutOfMemory { .. }
                | crate::Error::TooLarge { .. }
                | crate::Error::TierDisabled { .. }
        )
    };
    match store.put_in(Tier::Pinned, name, group, dtype, shape, bytes) {
        Err(e) if short(&e) => {}
        r => return r,
    }
    let s = store.stats();
    let free = s.capacity(Tier::Device).saturating_sub(s.used(Tier::Device));
    if free >= keep + store.footprint(Tier::Device, bytes.len() as u64) {
        match store.put_in(Tier::Device, name, group, dtype, shape, bytes) {
            Err(e) if short(&e) => {}
            r => return r,
        }
    }
    store.put_in(Tier::Disk, name, group, dtype, shape, bytes)
}

/// A candle tensor's values written into the store tensor `id` (same dtype and element count).
/// CPU: through the host (`Store::write`). CUDA: device to device into a
/// `device_view_for_overwrite` on candle's stream, then released (written back to host memory
/// when the Device tier needs the room).
pub(crate) fn candle_to_store(
    store: &Store,
    stream: &Stream,
    name: &str,
    id: TensorId,
    t: &Tensor,
) -> candle_core::Result<()> {
    let t = t.flatten_all()?.contiguous()?;
    match t.device() {
        #[cfg(feature = "candle-cuda")]
        Device::Cuda(dev) => {
            use candle_core::Storage;
            let mut view =
                store.device_view_for_overwrite(id, stream).map_err(|e| strata_err(name, e))?;
            {
                let (storage, layout) = t.storage_and_layout();
                let Storage::Cuda(cs) = &*storage else {
                    candle_core::bail!("{name}: a CUDA tensor without CUDA storage")
                };
                let (start, end) = layout
                    .contiguous_offsets()
                    .ok_or_else(|| candle_core::Error::Msg(format!("{name}: not contiguous")))?;
                let cuda = dev.cuda_stream();
                macro_rules! dtod {
                    ($t:ty) => {{
                        if (end - start) * std::mem::size_of::<$t>() != view.len_bytes() {
                            candle_core::bail!(
                                "{name}: {} elements for a tensor of {} bytes",
                                end - start,
                                view.len_bytes()
                            );
                        }
                        let src = cs.as_cuda_slice::<$t>()?.slice(start..end);
                        let mut dst =
                            view.typed_cuda_view_mut::<$t>().map_err(|e| strata_err(name, e))?;
                        cuda.memcpy_dtod(&src, &mut dst).map_err(candle_core::Error::wrap)?;
                    }};
                }
                match t.dtype() {
                    CDType::F32 => dtod!(f32),
                    CDType::BF16 => dtod!(half::bf16),
                    other => candle_core::bail!("{name}: no copy into the store for {other:?}"),
                }
            }
            drop(view);
            store.release(&[id]).map_err(|e| strata_err(name, e))
        }
        Device::Cpu => {
            let _ = stream;
            // Straight from candle's storage into the store: one copy (through `to_vec1` it
            // was three, each into a fresh allocation).
            if !matches!(t.dtype(), CDType::F32 | CDType::BF16) {
                candle_core::bail!("{name}: no copy into the store for {:?}", t.dtype())
            }
            super::super::with_cpu_bytes(name, &t, |bytes| store.write(id, bytes))?
                .map_err(|e| strata_err(name, e))
        }
        _ => {
            let _ = stream;
            let bytes: Vec<u8> = match t.dtype() {
                CDType::F32 => bytemuck::cast_slice(&t.to_vec1::<f32>()?).to_vec(),
                CDType::BF16 => bytemuck::cast_slice(&t.to_vec1::<half::bf16>()?).to_vec(),
                other => candle_core::bail!("{name}: no copy into the store for {other:?}"),
            };
            store.write(id, &bytes).map_err(|e| strata_err(name, e))
        }
    }
}

/// A parameter's values in f32 (a quantized one dequantized, as the `gguf` package does).
pub(super) fn read_f32(store: &Store, name: &str, id: TensorId) -> candle_core::Result<Vec<f32>> {
    let info = store.info(id).map_err(|e| strata_err(name, e))?;
    Ok(match info.dtype {
        q if q.is_quantized() => {
            let bytes = store.read(id).map_err(|e| strata_err(name, e))?;
            crate::quant::dequantize(q, &bytes).map_err(|e| strata_err(name, e))?
        }
        DType::F32 => store.read_vec::<f32>(id).map_err(|e| strata_err(name, e))?,
        DType::BF16 => store
            .read_vec::<half::bf16>(id)
            .map_err(|e| strata_err(name, e))?
            .into_iter()
            .map(f32::from)
            .collect(),
        other => candle_core::bail!("{name} is {other}"),
    })
}
