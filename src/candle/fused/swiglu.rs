//! SwiGLU's gate in one pass: `silu(gate) · up`, in f32, rounded once.

use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Storage, Tensor, WithDType};
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
                                let (g, u, dy) = (g.widen(), u.widen(), dy.widen());
                                let sig = 1.0 / (1.0 + (-g).exp());
                                *dg = T::narrow(dy * u * sig * (1.0 + g * (1.0 - sig)));
                                *du = T::narrow(dy * g * sig);
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
