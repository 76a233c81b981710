//! Device-to-device copies from a store's device view into memory candle owns (feature
//! `candle-cuda`), and their timing. candle frees a tensor's buffer when the tensor's last clone
//! drops, so it cannot be handed the store's memory: it gets a copy, made on its own stream.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::cuda::CudaStorage;
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, Storage, Tensor};
use cudarc::driver::{sys, CudaEvent, CudaStream, DeviceRepr};

use crate::DeviceView;

/// A pair of timing events around copies on a stream; the elapsed time is read later.
pub(crate) struct CopyTimer {
    start: CudaEvent,
    end: Option<CudaEvent>,
}

impl CopyTimer {
    /// Records the start event on `stream`.
    pub(crate) fn start(stream: &Arc<CudaStream>) -> candle_core::Result<CopyTimer> {
        let ev = stream
            .context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(candle_core::Error::wrap)?;
        ev.record(stream).map_err(candle_core::Error::wrap)?;
        Ok(CopyTimer { start: ev, end: None })
    }

    /// Records the end event on `stream`.
    pub(crate) fn stop(&mut self, stream: &Arc<CudaStream>) -> candle_core::Result<()> {
        let ev = stream
            .context()
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(candle_core::Error::wrap)?;
        ev.record(stream).map_err(candle_core::Error::wrap)?;
        self.end = Some(ev);
        Ok(())
    }

    /// Whether the end event was recorded.
    pub(crate) fn stopped(&self) -> bool {
        self.end.is_some()
    }

    /// Seconds between the two events if the end event has completed, without waiting.
    pub(crate) fn seconds_if_done(&self) -> Option<f64> {
        let end = self.end.as_ref()?;
        if !end.is_complete() {
            return None;
        }
        self.start.elapsed_ms(end).ok().map(|ms| f64::from(ms) / 1e3)
    }

    /// Seconds between the two events, once the end event completed (this waits for it).
    pub(crate) fn seconds(&self) -> candle_core::Result<f64> {
        let Some(end) = &self.end else { return Ok(0.0) };
        end.synchronize().map_err(candle_core::Error::wrap)?;
        let ms = self.start.elapsed_ms(end).map_err(candle_core::Error::wrap)?;
        Ok(f64::from(ms) / 1e3)
    }
}

/// A candle tensor on `dev` holding a copy of the view's bytes, made device to device on
/// `dev`'s stream (which must be the view's stream: it waited for the copy that brought the
/// bytes, and the view's drop records that stream's use, so the store reuses the memory only
/// after this copy ran). `dtype` and `shape` describe the tensor; its bytes must be a whole
/// number of `dtype`'s elements (the caller checked). A `shape` of fewer elements than the
/// view holds copies only the view's first ones (a KV cache's filled positions). With `var`,
/// the tensor is a candle variable (a `Var` of it shares its storage, no copy).
pub(crate) fn view_to_candle(
    view: &DeviceView,
    dev: &CudaDevice,
    dtype: candle_core::DType,
    shape: &[usize],
    var: bool,
) -> candle_core::Result<Tensor> {
    use candle_core::DType as C;
    let n = shape.iter().product();
    let storage = match dtype {
        C::U8 => copy::<u8>(view, n, dev)?,
        C::U32 => copy::<u32>(view, n, dev)?,
        C::I16 => copy::<i16>(view, n, dev)?,
        C::I32 => copy::<i32>(view, n, dev)?,
        C::I64 => copy::<i64>(view, n, dev)?,
        C::F16 => copy::<half::f16>(view, n, dev)?,
        C::BF16 => copy::<half::bf16>(view, n, dev)?,
        C::F32 => copy::<f32>(view, n, dev)?,
        C::F64 => copy::<f64>(view, n, dev)?,
        other => {
            return Err(candle_core::Error::Msg(format!(
                "no device-to-device copy into candle for dtype {other:?}"
            )))
        }
    };
    debug_assert_eq!(storage.dtype(), dtype);
    Ok(Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), var))
}

/// A candle f32 tensor of `shape` on `dev`: the view's bytes, whole blocks of the
/// block-quantized `dtype` (GGUF's `Q4_0` … `Q8_K`, as the store holds them), dequantized on the
/// device by `strata_dequant_f32` on `dev`'s stream (the view's stream, so it runs after the
/// copy that brought the bytes and before the view's drop is recorded), with the host's
/// arithmetic ([`quant::dequantize`](crate::base::quant::dequantize): the same values, bit for
/// bit). Only the quantized bytes cross PCIe; the f32 values are made where they are used. With
/// `var`, the tensor is a candle variable.
pub(crate) fn dequantize_view(
    view: &DeviceView,
    dev: &CudaDevice,
    dtype: crate::DType,
    shape: &[usize],
    var: bool,
) -> candle_core::Result<Tensor> {
    let (elems, size) = dtype.block().ok_or_else(|| {
        candle_core::Error::Msg(format!("{dtype} is not block-quantized: nothing to dequantize"))
    })?;
    let n: usize = shape.iter().product();
    if n % elems != 0 {
        candle_core::bail!("{n} elements of {dtype} are not whole blocks of {elems}");
    }
    let bytes = n / elems * size;
    let all = view.cuda_view::<u8>().ok_or_else(|| {
        candle_core::Error::Msg(format!("a view of {} bytes is not a CUDA view", view.len_bytes()))
    })?;
    if bytes > all.len() {
        candle_core::bail!("{bytes} bytes of {dtype} asked of a view of {}", all.len());
    }
    // A new buffer the kernel writes whole (allocated by the launcher, not zeroed first).
    let kernels = crate::backend::cuda::fused::FusedKernels::<f32>::get(&dev.cuda_stream())?;
    let (out, written) = kernels.dequantize(dtype, &all.slice(0..bytes))?;
    debug_assert_eq!(written, n);
    let storage = CudaStorage::wrap_cuda_slice(out, dev.clone());
    Ok(Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), var))
}

/// The view's first `n` elements of `T`, copied into a new candle storage.
fn copy<T>(view: &DeviceView, n: usize, dev: &CudaDevice) -> candle_core::Result<CudaStorage>
where
    T: DeviceRepr + candle_core::cuda::CudaDType,
{
    let all = view.cuda_view::<T>().ok_or_else(|| {
        candle_core::Error::Msg(format!(
            "a view of {} bytes is not a CUDA view of whole {}-byte elements",
            view.len_bytes(),
            std::mem::size_of::<T>()
        ))
    })?;
    if n > all.len() {
        return Err(candle_core::Error::Msg(format!(
            "{n} elements asked of a view of {}",
            all.len()
        )));
    }
    let src = all.slice(0..n);
    // A new allocation filled by one device-to-device copy on candle's stream (cudarc's
    // `clone_dtod`: the slice is reachable by no one before the copy is issued).
    let dst = dev.cuda_stream().clone_dtod(&src).map_err(candle_core::Error::wrap)?;
    Ok(CudaStorage::wrap_cuda_slice(dst, dev.clone()))
}

/// Copies the candle tensor `t` (contiguous, on `dev`) into the view's memory from element
/// `offset` on, device to device on `dev`'s stream (the view's stream, so the copy is ordered
/// after the copy that brought the view's bytes and before the view's drop is recorded). Mark
/// the view dirty after.
pub(crate) fn candle_into_view(
    t: &Tensor,
    view: &mut DeviceView,
    offset: usize,
    dev: &CudaDevice,
) -> candle_core::Result<()> {
    use candle_core::DType as C;
    match t.dtype() {
        C::F32 => copy_into::<f32>(t, view, offset, dev),
        C::BF16 => copy_into::<half::bf16>(t, view, offset, dev),
        C::F16 => copy_into::<half::f16>(t, view, offset, dev),
        other => Err(candle_core::Error::Msg(format!(
            "no device-to-device copy out of candle for dtype {other:?}"
        ))),
    }
}

fn copy_into<T>(
    t: &Tensor,
    view: &mut DeviceView,
    offset: usize,
    dev: &CudaDevice,
) -> candle_core::Result<()>
where
    T: DeviceRepr + candle_core::cuda::CudaDType + crate::Element,
{
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return Err(candle_core::Error::Msg("a CUDA tensor without CUDA storage".into()));
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("a tensor that is not contiguous".into()))?;
    let room = view.len_bytes() / std::mem::size_of::<T>();
    if offset + (end - start) > room {
        return Err(candle_core::Error::Msg(format!(
            "{} elements at {offset} into a tensor of {room}",
            end - start
        )));
    }
    let src = cs.as_cuda_slice::<T>()?.slice(start..end);
    let mut dst = view.typed_cuda_view_mut::<T>().map_err(candle_core::Error::from)?;
    let mut dst = dst.slice_mut(offset..offset + (end - start));
    dev.cuda_stream().memcpy_dtod(&src, &mut dst).map_err(candle_core::Error::wrap)
}
