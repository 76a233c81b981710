//! SwiGLU's gate in one pass: `silu(gate) · up`, in f32, rounded once; of two tensors, or of
//! the joint gate/up GEMM's output read in place.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Shape, Storage, Tensor, WithDType};
use rayon::prelude::*;

use super::{contiguous, cpu_tensor, with_elem, Elem, CHUNK};

/// `silu(gate) · up` (`silu(g) = g / (1 + e^-g)`) for two tensors of one shape and dtype, as
/// one op; its backward gives `dgate = dy · up · σ(g) · (1 + g · (1 - σ(g)))` and `dup = dy ·
/// silu(g)` in one pass.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> candle_core::Result<Tensor> {
    if gate.dims() != up.dims() || gate.dtype() != up.dtype() {
        candle_core::bail!(
            "fused swiglu: gate {:?} {:?} and up {:?} {:?}: one shape and dtype",
            gate.dims(),
            gate.dtype(),
            up.dims(),
            up.dtype()
        );
    }
    gate.contiguous()?.apply_op2_arc(&up.contiguous()?, std::sync::Arc::new(Box::new(SwiGlu)))
}

/// [`swiglu`] of the joint gate/up projection's output `y` (`[.., 2 · inner]`: the gate in each
/// row's first `inner` columns, up in the next, as one GEMM over the joined weights gives them),
/// read in place: no copy of either half. Its backward gives the joint's gradient as one tensor
/// (`[.., 2 · inner]`, the gate's half then up's), which the joint GEMM's backward takes as it
/// is, where two column views would each be padded to the joint's width and summed. The values
/// and gradients are [`swiglu`]'s of the two halves, bit for bit.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use candle_core::{Device, Tensor, D};
/// use strata::candle::fused;
///
/// let y = Tensor::randn(0f32, 1.0, (2, 3, 8), &Device::Cpu)?;
/// let act = fused::swiglu_joined(&y)?;
/// let (gate, up) = (y.narrow(D::Minus1, 0, 4)?, y.narrow(D::Minus1, 4, 4)?);
/// let want = fused::swiglu(&gate, &up)?;
/// assert_eq!(act.flatten_all()?.to_vec1::<f32>()?, want.flatten_all()?.to_vec1::<f32>()?);
/// # Ok(()) }
/// ```
pub fn swiglu_joined(y: &Tensor) -> candle_core::Result<Tensor> {
    let width = y.dims().last().copied().unwrap_or(0);
    if y.rank() == 0 || width % 2 != 0 {
        candle_core::bail!(
            "fused swiglu over a joint gate/up output of shape {:?}: its last dimension holds \
             the gate and up side by side, so it must be even",
            y.dims()
        );
    }
    y.contiguous()?.apply_op1_arc(std::sync::Arc::new(Box::new(SwiGluJoined)))
}

/// The rows and the half width (`inner`) of a joint gate/up output of `shape`.
fn joined_rows(shape: &Shape) -> (usize, usize) {
    let inner = shape.dims().last().copied().unwrap_or(0) / 2;
    (if inner == 0 { 0 } else { shape.elem_count() / (2 * inner) }, inner)
}

/// The shape of the joined swiglu's output: `shape` with its last dimension halved.
fn halved(shape: &Shape) -> Shape {
    let mut dims = shape.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last /= 2;
    }
    Shape::from(dims)
}

struct SwiGluJoined;

impl CustomOp1 for SwiGluJoined {
    fn name(&self) -> &'static str {
        "strata-swiglu-joined"
    }

    fn cpu_fwd(&self, y: &CpuStorage, ly: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (rows, inner) = joined_rows(ly.shape());
        with_elem!(y, "fused swiglu", |T| {
            let y = contiguous::<T>(y, ly, "the joint gate/up output")?;
            let mut out = vec![T::narrow(0.0); rows * inner];
            // Whole rows a work item (about CHUNK elements of output each); none for no columns.
            if let Some(per) = CHUNK.checked_div(inner).map(|p| p.max(1)) {
                out.par_chunks_mut(per * inner).zip(y.par_chunks(per * 2 * inner)).for_each(
                    |(o, y)| {
                        for (o, y) in o.chunks_exact_mut(inner).zip(y.chunks_exact(2 * inner)) {
                            let (g, u) = y.split_at(inner);
                            for (o, (g, u)) in o.iter_mut().zip(g.iter().zip(u)) {
                                *o = T::narrow(silu(g.widen()) * u.widen());
                            }
                        }
                    },
                );
            }
            Ok((T::to_cpu_storage_owned(out), halved(ly.shape())))
        })
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        y: &candle_core::CudaStorage,
        ly: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (rows, inner) = joined_rows(ly.shape());
        Ok((super::cuda::swiglu_joined_forward((y, ly), rows, inner)?, halved(ly.shape())))
    }

    fn bwd(&self, y: &Tensor, _out: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let grad = grad.contiguous()?;
        let (rows, inner) = joined_rows(y.shape());
        let (ys, ly) = y.storage_and_layout();
        let (ds, ld) = grad.storage_and_layout();
        let dy = match (&*ys, &*ds) {
            (Storage::Cpu(y), Storage::Cpu(dy)) => with_elem!(y, "fused swiglu", |T| {
                let y = contiguous::<T>(y, ly, "the joint gate/up output")?;
                let dy = contiguous::<T>(dy, ld, "swiglu's gradient")?;
                let mut dj = vec![T::narrow(0.0); 2 * rows * inner];
                if let Some(per) = CHUNK.checked_div(inner).map(|p| p.max(1)) {
                    dj.par_chunks_mut(per * 2 * inner)
                        .zip(y.par_chunks(per * 2 * inner).zip(dy.par_chunks(per * inner)))
                        .for_each(|(dj, (y, dy))| {
                            for (dj, (y, dy)) in dj
                                .chunks_exact_mut(2 * inner)
                                .zip(y.chunks_exact(2 * inner).zip(dy.chunks_exact(inner)))
                            {
                                let (g, u) = y.split_at(inner);
                                let (dg, du) = dj.split_at_mut(inner);
                                for ((dg, du), ((g, u), dy)) in
                                    dg.iter_mut().zip(du).zip(g.iter().zip(u).zip(dy))
                                {
                                    (*dg, *du) = swiglu_grads(g.widen(), u.widen(), dy.widen());
                                }
                            }
                        });
                }
                Ok(cpu_tensor(dj, ly.shape().clone()))
            })?,
            #[cfg(feature = "candle-cuda")]
            (Storage::Cuda(y), Storage::Cuda(dy)) => super::cuda_tensor(
                super::cuda::swiglu_joined_backward((y, ly), (dy, ld), rows, inner)?,
                ly.shape(),
            ),
            _ => candle_core::bail!(
                "fused swiglu's backward: the tensors are on different devices, or on one it does \
                 not run on (CPU, or CUDA with the candle-cuda feature)"
            ),
        };
        Ok(Some(dy))
    }
}

/// SwiGLU's gradients of one element, rounded once: `(dgate, dup)` for the gate `g`, up `u` and
/// the output's gradient `dy`.
fn swiglu_grads<T: Elem>(g: f32, u: f32, dy: f32) -> (T, T) {
    let sig = 1.0 / (1.0 + (-g).exp());
    (T::narrow(dy * u * sig * (1.0 + g * (1.0 - sig))), T::narrow(dy * g * sig))
}

struct SwiGlu;

fn silu(g: f32) -> f32 {
    g / (1.0 + (-g).exp())
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "strata-swiglu"
    }

    fn cpu_fwd(
        &self,
        g: &CpuStorage,
        lg: &Layout,
        u: &CpuStorage,
        lu: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        with_elem!(g, "fused swiglu", |T| {
            let (g, u) = (contiguous::<T>(g, lg, "swiglu's gate")?, contiguous::<T>(u, lu, "up")?);
            let mut out = vec![T::narrow(0.0); g.len()];
            out.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK))).for_each(
                |(o, (g, u))| {
                    for (o, (g, u)) in o.iter_mut().zip(g.iter().zip(u)) {
                        *o = T::narrow(silu(g.widen()) * u.widen());
                    }
                },
            );
            Ok((T::to_cpu_storage_owned(out), lg.shape().clone()))
        })
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        g: &candle_core::CudaStorage,
        lg: &Layout,
        u: &candle_core::CudaStorage,
        lu: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        Ok((super::cuda::swiglu_forward((g, lg), (u, lu))?, lg.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let (gs, lg) = gate.storage_and_layout();
        let (us, lu) = up.storage_and_layout();
        let (ds, ld) = grad.storage_and_layout();
        let (dg, du) = match (&*gs, &*us, &*ds) {
            (Storage::Cpu(g), Storage::Cpu(u), Storage::Cpu(dy)) => {
                with_elem!(g, "fused swiglu", |T| {
                    let g = contiguous::<T>(g, lg, "swiglu's gate")?;
                    let u = contiguous::<T>(u, lu, "swiglu's up")?;
                    let dy = contiguous::<T>(dy, ld, "swiglu's gradient")?;
                    let mut dg = vec![T::narrow(0.0); g.len()];
                    let mut du = vec![T::narrow(0.0); g.len()];
                    dg.par_chunks_mut(CHUNK)
                        .zip(du.par_chunks_mut(CHUNK))
                        .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)).zip(dy.par_chunks(CHUNK)))
                        .for_each(|((dg, du), ((g, u), dy))| {
                            for ((dg, du), ((g, u), dy)) in
                                dg.iter_mut().zip(du).zip(g.iter().zip(u).zip(dy))
                            {
                                (*dg, *du) = swiglu_grads(g.widen(), u.widen(), dy.widen());
                            }
                        });
                    Ok((cpu_tensor(dg, lg.shape().clone()), cpu_tensor(du, lu.shape().clone())))
                })?
            }
            #[cfg(feature = "candle-cuda")]
            (Storage::Cuda(g), Storage::Cuda(u), Storage::Cuda(dy)) => {
                let (dg, du) = super::cuda::swiglu_backward((g, lg), (u, lu), (dy, ld))?;
                (super::cuda_tensor(dg, lg.shape()), super::cuda_tensor(du, lu.shape()))
            }
            _ => candle_core::bail!(
                "fused swiglu's backward: the tensors are on different devices, or on one it does \
                 not run on (CPU, or CUDA with the candle-cuda feature)"
            ),
        };
        Ok((Some(dg), Some(du)))
    }
}
