//! The residual add and the RMSNorm after it in one pass: `h = x + r`, rounded once to the
//! dtype as candle's `add` rounds it, and `n = rms_norm(h)` as [`rms_norm`](super::rms_norm)
//! computes it, the same bits as the two ops one after the other.
//!
//! Two candle ops sharing one forward, because a candle op has one output and both `h` (the
//! block's residual stream) and `n` (the MLP's input) carry gradients: the first, of `x`, `r`
//! and the weight, computes `h`, `n` and each row's inverse root mean square in one pass and
//! returns `h`; the second is [`rms_norm`](super::rms_norm)'s own op applied to that `h`, which
//! takes the `n` computed ahead instead of computing it again. So the backward is the unfused
//! pair's: the norm's (`dx` of `h` and the weight's gradient, from the saved rows) and the add's
//! (`dx = dr = dh`, where candle's autograd has summed into `dh` the norm's gradient and the
//! gradient of `h`'s other use), and the gradients have the unfused pair's bits too. A single op
//! returning `h` and `n` concatenated was the other way: candle's backward of the two slices
//! taken from it would zero-pad and add a whole `[2, ...]` gradient, more work than it saves.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Storage, Tensor, WithDType};
use rayon::prelude::*;

use super::norm::{check_weight, norm_row, RmsNorm, Saved};
use super::{contiguous, cpu_tensor, with_elem, Elem};

/// `h = x + r` and `n = rms_norm(h, weight, eps)` in one pass over `x` and `r` (`[...,
/// hidden]`, one shape and dtype) and `weight` (`[hidden]`): the values and the gradients of
/// `x.add(r)` followed by [`rms_norm`](super::rms_norm), bit for bit. A block's residual add and
/// the norm that reads its result (`Compute::Fused` in
/// [`block_forward_with`](super::super::llama::block_forward_with)).
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use candle_core::{Device, Tensor};
/// use strata::candle::fused;
///
/// let dev = Device::Cpu;
/// let x = Tensor::randn(0f32, 1.0, (2, 3, 8), &dev)?;
/// let r = Tensor::randn(0f32, 1.0, (2, 3, 8), &dev)?;
/// let w = Tensor::ones(8, candle_core::DType::F32, &dev)?;
/// let (h, n) = fused::add_rms_norm(&x, &r, &w, 1e-6)?;
/// assert_eq!(h.to_vec3::<f32>()?, x.add(&r)?.to_vec3::<f32>()?);
/// assert_eq!(n.to_vec3::<f32>()?, fused::rms_norm(&h, &w, 1e-6)?.to_vec3::<f32>()?);
/// # Ok(()) }
/// ```
pub fn add_rms_norm(
    x: &Tensor,
    r: &Tensor,
    weight: &Tensor,
    eps: f64,
) -> candle_core::Result<(Tensor, Tensor)> {
    let what = "fused add_rms_norm";
    if x.dims() != r.dims() {
        candle_core::bail!("{what}: a residual of {:?} for {:?}: one shape", r.dims(), x.dims());
    }
    if x.dtype() != r.dtype() {
        candle_core::bail!("{what}: {:?} and {:?} values: one dtype", x.dtype(), r.dtype());
    }
    check_weight(what, x, weight)?;
    let (eps, saved) = (eps as f32, Arc::new(Saved::default()));
    let weight = weight.contiguous()?;
    let add = AddNorm { eps, saved: saved.clone() };
    let h = x.contiguous()?.apply_op3_arc(&r.contiguous()?, &weight, Arc::new(Box::new(add)))?;
    let n = h.apply_op2_arc(&weight, Arc::new(Box::new(RmsNorm { eps, saved })))?;
    Ok((h, n))
}

/// The first op: `x`, `r` and the weight in, `h` out; `n` and the saved rows left in `saved` for
/// the norm's op.
struct AddNorm {
    eps: f32,
    saved: Arc<Saved>,
}

impl CustomOp3 for AddNorm {
    fn name(&self) -> &'static str {
        "strata-add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        r: &CpuStorage,
        lr: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let hidden = lw.dims()[0];
        with_elem!(x, "fused add_rms_norm", |T| {
            let xs = contiguous::<T>(x, lx, "add_rms_norm's input")?;
            let rs = contiguous::<T>(r, lr, "add_rms_norm's residual")?;
            let w: Vec<f32> = contiguous::<T>(w, lw, "add_rms_norm's weight")?
                .iter()
                .map(|v| v.widen())
                .collect();
            let rows = xs.len().checked_div(hidden).unwrap_or(0);
            let mut h = vec![T::narrow(0.0); xs.len()];
            let mut out = vec![T::narrow(0.0); xs.len()];
            let mut inv = vec![0f32; rows];
            if hidden > 0 {
                h.par_chunks_mut(hidden)
                    .zip(out.par_chunks_mut(hidden))
                    .zip(inv.par_iter_mut())
                    .zip(xs.par_chunks(hidden).zip(rs.par_chunks(hidden)))
                    .for_each(|(((h, out), inv), (x, r))| {
                        // candle's add: widened, added in f32, rounded once.
                        for ((h, x), r) in h.iter_mut().zip(x).zip(r) {
                            *h = T::narrow(x.widen() + r.widen());
                        }
                        let hf: Vec<f32> = h.iter().map(|v| v.widen()).collect();
                        *inv = norm_row(&hf, &w, self.eps, out);
                    });
            }
            let _ = self.saved.inv.set(cpu_tensor(inv, rows));
            *self.saved.ahead.lock() = Some(Storage::Cpu(T::to_cpu_storage_owned(out)));
            Ok((T::to_cpu_storage_owned(h), lx.shape().clone()))
        })
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        r: &candle_core::CudaStorage,
        lr: &Layout,
        w: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (h, out, inv) = super::cuda::add_rms_norm_forward((x, lx), (r, lr), (w, lw), self.eps)?;
        let rows = lx.shape().elem_count().checked_div(lw.dims()[0]).unwrap_or(0);
        let _ = self.saved.inv.set(super::cuda_tensor(inv, rows));
        *self.saved.ahead.lock() = Some(Storage::Cuda(out));
        Ok((h, lx.shape().clone()))
    }

    /// The add's backward: `h`'s gradient to `x` and to `r` (the norm's op, a use of `h`, sends
    /// its part through `h`'s gradient); none to the weight from here.
    fn bwd(
        &self,
        _x: &Tensor,
        _r: &Tensor,
        _w: &Tensor,
        _h: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.clone()), Some(grad.clone()), None))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::*;
    use crate::candle::fused::rms_norm;
    use crate::candle::llama::SeededRng;

    fn randn(rng: &mut SeededRng, shape: &[usize], dtype: DType) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.normal(1.0) as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        let v: Vec<f32> = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap();
        v.into_iter().map(f32::to_bits).collect()
    }

    /// `h`, `n` and the gradients of `x`, `r` and the weight for `sum(h · a) + sum(n · b)`, with
    /// `fused` choosing the one op or the add then the norm.
    fn run(inputs: &[Tensor; 3], [a, b]: &[Tensor; 2], fused: bool) -> Vec<Vec<u32>> {
        let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
        let [x, r, w] = [0, 1, 2].map(|i| vars[i].as_tensor().clone());
        let (h, n) = if fused {
            add_rms_norm(&x, &r, &w, 1e-5).unwrap()
        } else {
            let h = x.add(&r).unwrap();
            let n = rms_norm(&h, &w, 1e-5).unwrap();
            (h, n)
        };
        let loss =
            (h.mul(a).unwrap().sum_all().unwrap() + n.mul(b).unwrap().sum_all().unwrap()).unwrap();
        let grads = loss.backward().unwrap();
        let mut out = vec![bits(&h), bits(&n)];
        out.extend(vars.iter().map(|v| bits(grads.get(v.as_tensor()).expect("a gradient"))));
        out
    }

    #[test]
    fn values_and_gradients_are_the_add_then_the_norm_bit_for_bit() {
        let mut rng = SeededRng::new(21);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for shape in [&[1, 8][..], &[70, 33], &[2, 5, 48]] {
                let hidden = shape[shape.len() - 1];
                let inputs = [
                    randn(&mut rng, shape, dtype),
                    randn(&mut rng, shape, dtype),
                    randn(&mut rng, &[hidden], dtype).affine(0.1, 1.0).unwrap(),
                ];
                let upstream = [randn(&mut rng, shape, dtype), randn(&mut rng, shape, dtype)];
                let (one, two) = (run(&inputs, &upstream, true), run(&inputs, &upstream, false));
                for (i, (a, b)) in one.iter().zip(&two).enumerate() {
                    assert!(a == b, "{dtype:?} {shape:?}: output {i} differs");
                }
            }
        }
    }

    #[test]
    fn n_is_the_norm_of_h_and_bad_operands_are_errors() {
        let mut rng = SeededRng::new(3);
        let (x, r) = (randn(&mut rng, &[4, 16], DType::F32), randn(&mut rng, &[4, 16], DType::F32));
        let w = randn(&mut rng, &[16], DType::F32);
        let (h, n) = add_rms_norm(&x, &r, &w, 1e-6).unwrap();
        assert_eq!(bits(&n), bits(&rms_norm(&h, &w, 1e-6).unwrap()));
        let empty = randn(&mut rng, &[3, 0], DType::F32);
        let (h, n) =
            add_rms_norm(&empty, &empty, &randn(&mut rng, &[0], DType::F32), 1e-6).unwrap();
        assert_eq!((h.dims(), n.dims()), (&[3, 0][..], &[3, 0][..]));
        let e = add_rms_norm(&x, &r.narrow(1, 0, 8).unwrap(), &w, 1e-6).unwrap_err();
        assert!(e.to_string().contains("one shape"), "{e}");
        let e = add_rms_norm(&x, &r.to_dtype(DType::BF16).unwrap(), &w, 1e-6).unwrap_err();
        assert!(e.to_string().contains("one dtype"), "{e}");
        let e = add_rms_norm(&x, &r, &w.narrow(0, 0, 8).unwrap(), 1e-6).unwrap_err();
        assert!(e.to_string().contains("a weight of [8] for rows of 16"), "{e}");
    }
}
