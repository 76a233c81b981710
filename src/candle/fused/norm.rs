//! RMSNorm as Hugging Face's `LlamaRMSNorm`, one pass per row: `x / sqrt(mean(x²) + eps)` in
//! f32, rounded to `x`'s dtype, times the weight (rounded again). The forward keeps each row's
//! inverse root mean square for the backward.

use std::sync::{Arc, OnceLock};

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Storage, Tensor, WithDType};
use parking_lot::Mutex;
use rayon::prelude::*;

use super::{contiguous, cpu_tensor, dot, with_elem, Elem};

/// RMSNorm of `x` (`[..., hidden]`) with `weight` (`[hidden]`, `x`'s dtype) over the last
/// dimension: what [`llama::rms_norm`](super::super::llama::rms_norm) computes, as one op with a
/// fused backward (the gradients of `x` and of the weight, the weight's summed over the rows in
/// f32).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    check_weight("fused rms_norm", x, weight)?;
    let op = RmsNorm { eps: eps as f32, saved: Arc::default() };
    x.contiguous()?.apply_op2_arc(&weight.contiguous()?, Arc::new(Box::new(op)))
}

/// Fails unless `weight` is `[hidden]` for rows of `x`'s last dimension, in `x`'s dtype.
pub(super) fn check_weight(what: &str, x: &Tensor, weight: &Tensor) -> candle_core::Result<()> {
    let hidden = x.dims().last().copied().unwrap_or(0);
    if weight.dims() != [hidden] {
        candle_core::bail!(
            "{what}: a weight of {:?} for rows of {hidden} ({:?})",
            weight.dims(),
            x.dims()
        );
    }
    if weight.dtype() != x.dtype() {
        candle_core::bail!(
            "{what}: a {:?} weight for {:?} values: one dtype",
            weight.dtype(),
            x.dtype()
        );
    }
    Ok(())
}

/// The op: `x` and the weight in, the normalized rows out.
pub(super) struct RmsNorm {
    pub(super) eps: f32,
    pub(super) saved: Arc<Saved>,
}

/// What an [`RmsNorm`]'s forward leaves for its backward, and the output when another op
/// computed it ahead ([`super::add_norm`]: the residual add and the norm in one pass).
#[derive(Default)]
pub(super) struct Saved {
    /// Each row's `1 / sqrt(mean(x²) + eps)`, f32, once the forward ran.
    pub(super) inv: OnceLock<Tensor>,
    /// The output, computed from this op's input with this op's arithmetic by the op that made
    /// the input: the forward takes it instead of computing it again (and computes it when it
    /// is not there).
    pub(super) ahead: Mutex<Option<Storage>>,
}

/// Rows per work item on the CPU; the weight's gradient is summed per item, then over the
/// items in order.
const ROWS: usize = 32;

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "strata-rms-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        if let Some(Storage::Cpu(out)) = self.saved.ahead.lock().take() {
            return Ok((out, lx.shape().clone()));
        }
        let hidden = lw.dims()[0];
        with_elem!(x, "fused rms_norm", |T| {
            let xs = contiguous::<T>(x, lx, "rms_norm's input")?;
            let w: Vec<f32> =
                contiguous::<T>(w, lw, "rms_norm's weight")?.iter().map(|v| v.widen()).collect();
            let rows = xs.len().checked_div(hidden).unwrap_or(0);
            let mut out = vec![T::narrow(0.0); xs.len()];
            let mut inv = vec![0f32; rows];
            if hidden > 0 {
                out.par_chunks_mut(hidden)
                    .zip(inv.par_iter_mut())
                    .zip(xs.par_chunks(hidden))
                    .for_each(|((out, inv), x)| {
                        let xf: Vec<f32> = x.iter().map(|v| v.widen()).collect();
                        *inv = norm_row(&xf, &w, self.eps, out);
                    });
            }
            let _ = self.saved.inv.set(cpu_tensor(inv, rows));
            Ok((T::to_cpu_storage_owned(out), lx.shape().clone()))
        })
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        if let Some(Storage::Cuda(out)) = self.saved.ahead.lock().take() {
            return Ok((out, lx.shape().clone()));
        }
        let (out, inv) = super::cuda::rms_norm_forward((x, lx), (w, lw), self.eps)?;
        let rows = lx.shape().elem_count().checked_div(lw.dims()[0]).unwrap_or(0);
        let _ = self.saved.inv.set(super::cuda_tensor(inv, rows));
        Ok((out, lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let inv = self.saved.inv.get().ok_or_else(|| {
            candle_core::Error::Msg("fused rms_norm: a backward before its forward".into()).bt()
        })?;
        let grad = grad.contiguous()?;
        let (xs, lx) = x.storage_and_layout();
        let (ws, lw) = w.storage_and_layout();
        let (gs, lg) = grad.storage_and_layout();
        let (is, li) = inv.storage_and_layout();
        let (dx, dw) = match (&*xs, &*ws, &*gs, &*is) {
            (Storage::Cpu(x), Storage::Cpu(w), Storage::Cpu(g), Storage::Cpu(inv)) => {
                with_elem!(x, "fused rms_norm", |T| {
                    let (dx, dw) = backward_cpu::<T>(
                        contiguous::<T>(x, lx, "rms_norm's input")?,
                        contiguous::<T>(w, lw, "rms_norm's weight")?,
                        contiguous::<T>(g, lg, "rms_norm's gradient")?,
                        contiguous::<f32>(inv, li, "rms_norm's saved rows")?,
                    );
                    Ok((cpu_tensor(dx, lx.shape().clone()), cpu_tensor(dw, lw.shape().clone())))
                })?
            }
            #[cfg(feature = "candle-cuda")]
            (Storage::Cuda(x), Storage::Cuda(w), Storage::Cuda(g), Storage::Cuda(inv)) => {
                let (dx, dw) =
                    super::cuda::rms_norm_backward((x, lx), (w, lw), (g, lg), (inv, li))?;
                (super::cuda_tensor(dx, lx.shape()), super::cuda_tensor(dw, lw.shape()))
            }
            _ => candle_core::bail!(
                "fused rms_norm's backward: the tensors are on different devices, or on one it \
                 does not run on (CPU, or CUDA with the candle-cuda feature)"
            ),
        };
        Ok((Some(dx), Some(dw)))
    }
}

/// RMSNorm of one row `x` (widened to f32) with the weight `w` (widened) into `out`, rounded
/// where `LlamaRMSNorm` rounds; returns the row's `1 / sqrt(mean(x²) + eps)`.
pub(super) fn norm_row<T: Elem>(x: &[f32], w: &[f32], eps: f32, out: &mut [T]) -> f32 {
    let inv = 1.0 / (dot(x, x) / x.len() as f32 + eps).sqrt();
    for ((o, x), w) in out.iter_mut().zip(x).zip(w) {
        *o = T::narrow(T::narrow(x * inv).widen() * w);
    }
    inv
}

/// `dx` and `dw` on the CPU: for each row, with `n = x · inv` and `dn = dy · w`,
/// `dx = inv · dn - x · inv³ · mean(dn · x)`; `dw` is the sum over the rows of `dy · n` (`n`
/// rounded as the forward rounded it), in f32, per [`ROWS`] rows and then over those sums in
/// order.
fn backward_cpu<T: Elem>(x: &[T], w: &[T], dy: &[T], inv: &[f32]) -> (Vec<T>, Vec<T>) {
    let hidden = w.len();
    let mut dx = vec![T::narrow(0.0); x.len()];
    if hidden == 0 {
        return (dx, Vec::new());
    }
    let w: Vec<f32> = w.iter().map(|v| v.widen()).collect();
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(ROWS * hidden)
        .zip(x.par_chunks(ROWS * hidden))
        .zip(dy.par_chunks(ROWS * hidden))
        .zip(inv.par_chunks(ROWS))
        .map(|(((dx, x), dy), inv)| {
            let mut dw = vec![0f32; hidden];
            let (mut xf, mut dn) = (vec![0f32; hidden], vec![0f32; hidden]);
            for (r, &inv) in inv.iter().enumerate() {
                let span = r * hidden..(r + 1) * hidden;
                for (((xf, dn), (x, dy)), (w, dw)) in xf
                    .iter_mut()
                    .zip(dn.iter_mut())
                    .zip(x[span.clone()].iter().zip(&dy[span.clone()]))
                    .zip(w.iter().zip(dw.iter_mut()))
                {
                    *xf = x.widen();
                    let dy = dy.widen();
                    *dn = dy * w;
                    *dw += dy * T::narrow(*xf * inv).widen();
                }
                let k = dot(&dn, &xf) / hidden as f32 * inv * inv * inv;
                for ((dx, dn), xf) in dx[span].iter_mut().zip(&dn).zip(&xf) {
                    *dx = T::narrow(inv * dn - k * xf);
                }
            }
            dw
        })
        .collect();
    let mut dw = vec![0f32; hidden];
    for p in &partials {
        for (a, b) in dw.iter_mut().zip(p) {
            *a += b;
        }
    }
    (dx, dw.into_iter().map(T::narrow).collect())
}
