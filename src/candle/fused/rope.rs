//! The rotary embedding in one pass: `x · cos + rotate_half(x) · sin` for each position, with
//! Hugging Face's `rotate_half` (the first half of each head against the second), reading the
//! f32 tables in place and writing the heads in the layout the attention reads.

use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Storage, Tensor, WithDType};
use rayon::prelude::*;

use super::{contiguous, cpu_tensor, with_elem, Elem, CHUNK};

/// `x` (`[batch, seq, heads, head_dim]`, any strides) rotated for positions `offset..offset +
/// seq`: `x · cos + rotate_half(x) · sin` with `cos` and `sin` (`[positions, head_dim]`, f32)
/// read at those positions, computed in f32 and rounded once to `x`'s dtype. Gives a
/// contiguous `[batch, seq, heads, head_dim]`. The backward (of `x` only: the tables are
/// constants) is the rotation by the opposite angles.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, offset: usize) -> candle_core::Result<Tensor> {
    let (_, s, _, d) = x.dims4()?;
    let (positions, dc) = cos.dims2()?;
    if sin.dims() != cos.dims() || dc != d || d % 2 != 0 {
        candle_core::bail!(
            "fused rope: tables {:?} and {:?} for heads of {d} (an even width, one shape \
             [positions, head_dim])",
            cos.dims(),
            sin.dims()
        );
    }
    if offset + s > positions {
        candle_core::bail!(
            "positions {offset}..{} past the rotary tables' {positions} \
             (max_position_embeddings)",
            offset + s
        );
    }
    let table = |t: &Tensor| t.to_dtype(DType::F32)?.contiguous();
    x.apply_op3_arc(&table(cos)?, &table(sin)?, std::sync::Arc::new(Box::new(Rope { offset })))
}

struct Rope {
    offset: usize,
}

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "strata-rope"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        cos: &CpuStorage,
        lc: &Layout,
        sin: &CpuStorage,
        ls: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (cos, sin) =
            (contiguous::<f32>(cos, lc, "rope's cos")?, contiguous::<f32>(sin, ls, "rope's sin")?);
        with_elem!(x, "fused rope", |T| {
            let out = rotate_cpu::<T>(x.as_slice::<T>()?, lx, cos, sin, self.offset, false);
            Ok((T::to_cpu_storage_owned(out), lx.shape().clone()))
        })
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        cos: &candle_core::CudaStorage,
        lc: &Layout,
        sin: &candle_core::CudaStorage,
        ls: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let out = super::cuda::rope((x, lx), (cos, lc), (sin, ls), self.offset, false)?;
        Ok((out, lx.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (gs, lg) = grad.storage_and_layout();
        let (cs, lc) = cos.storage_and_layout();
        let (ss, ls) = sin.storage_and_layout();
        let dx = match (&*gs, &*cs, &*ss) {
            (Storage::Cpu(g), Storage::Cpu(cos), Storage::Cpu(sin)) => {
                let (cos, sin) = (
                    contiguous::<f32>(cos, lc, "rope's cos")?,
                    contiguous::<f32>(sin, ls, "rope's sin")?,
                );
                with_elem!(g, "fused rope", |T| {
                    let dx = rotate_cpu::<T>(g.as_slice::<T>()?, lg, cos, sin, self.offset, true);
                    Ok(cpu_tensor(dx, lg.shape().clone()))
                })?
            }
            #[cfg(feature = "candle-cuda")]
            (Storage::Cuda(g), Storage::Cuda(cos), Storage::Cuda(sin)) => super::cuda_tensor(
                super::cuda::rope((g, lg), (cos, lc), (sin, ls), self.offset, true)?,
                lg.shape(),
            ),
            _ => candle_core::bail!(
                "fused rope's backward: the tensors are on different devices, or on one it does \
                 not run on (CPU, or CUDA with the candle-cuda feature)"
            ),
        };
        Ok((Some(dx), None, None))
    }
}

/// `x` (`[batch, seq, heads, head_dim]` as `l` lays it out) rotated, contiguous: the forward,
/// `out₁ = x₁ cos₁ - x₂ sin₁`, `out₂ = x₂ cos₂ + x₁ sin₂` (the halves of each head), or with
/// `inverse` its transpose, the backward, `dx₁ = g₁ cos₁ + g₂ sin₂`, `dx₂ = g₂ cos₂ - g₁ sin₁`.
fn rotate_cpu<T: Elem>(
    x: &[T],
    l: &Layout,
    cos: &[f32],
    sin: &[f32],
    offset: usize,
    inverse: bool,
) -> Vec<T> {
    let (dims, st, start) = (l.dims(), l.stride(), l.start_offset());
    let (s, h, d) = (dims[1], dims[2], dims[3]);
    let half = d / 2;
    let mut out = vec![T::narrow(0.0); l.shape().elem_count()];
    let row = (h * d).max(1);
    let rows_per_item = (CHUNK / row).max(1);
    out.par_chunks_mut(rows_per_item * row).enumerate().for_each(|(item, out)| {
        for (r, out) in out.chunks_mut(row).enumerate() {
            let idx = item * rows_per_item + r;
            let (bi, si) = (idx / s, idx % s);
            let p = (offset + si) * d;
            let (c, sn) = (&cos[p..p + d], &sin[p..p + d]);
            for (hi, out) in out.chunks_mut(d).enumerate() {
                let base = start + bi * st[0] + si * st[1] + hi * st[2];
                for e in 0..half {
                    let x1 = x[base + e * st[3]].widen();
                    let x2 = x[base + (e + half) * st[3]].widen();
                    let (o1, o2) = if !inverse {
                        (x1 * c[e] - x2 * sn[e], x2 * c[e + half] + x1 * sn[e + half])
                    } else {
                        (x1 * c[e] + x2 * sn[e + half], x2 * c[e + half] - x1 * sn[e])
                    };
                    out[e] = T::narrow(o1);
                    out[e + half] = T::narrow(o2);
                }
            }
        }
    });
    out
}
