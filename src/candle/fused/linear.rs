//! A linear layer whose backward sums its weight's gradient into an f32 buffer
//! ([`accumulating_linear`]), and that sum on its own ([`add_weight_grad`]).
//!
//! Through candle's autograd a linear `y = x·Wᵀ` costs, per micro-batch, a new `[out, in]`
//! gradient in the compute dtype (bf16-rounded for a bf16 model), a `zeros_like` and an add for
//! its node in the gradient store, another add for the transpose, and then the trainer's add
//! into the step's f32 buffer. Here the backward gives `x` its gradient `dX = dY·W` through
//! candle ops (so the rest of the graph flows as before, with the same bits as candle's own
//! matrix product's) and gives `W` none: it adds `dYᵀ·X` straight into the caller's f32
//! buffer, in place, with beta = 1, as one GEMM of the 16-bit (or f32) inputs into an f32
//! output. No micro-batch's `dW` is ever rounded to bf16 or held on its own.
//!
//! On the CPU the inputs are widened to f32 (exact) and the GEMM is the `gemm` crate's, candle's
//! own CPU matrix product, on candle's thread pool: each sum in a fixed order, whatever the
//! number of threads. On CUDA (feature `candle-cuda`) it is one `cublasGemmEx` on candle's
//! stream: inputs f32, bf16 or f16, output f32, compute type 32F, alpha 1, beta 1. Both take
//! the buffer as row-major `[out, in]`, PyTorch's `nn.Linear` layout.
//!
//! ```
//! # fn main() -> candle_core::Result<()> {
//! use candle_core::{DType, Device, Tensor, Var};
//! use strata::candle::fused;
//!
//! let dev = Device::Cpu;
//! let w = Tensor::new(&[[1f32, 2.0], [3.0, 4.0], [5.0, 6.0]], &dev)?; // [out 3, in 2]
//! let dw = Tensor::zeros((3, 2), DType::F32, &dev)?;
//! let x = Var::new(&[[1f32, 1.0]], &dev)?; // one row
//! for _ in 0..2 {
//!     // Two micro-batches: each backward adds dYᵀ·X into dw.
//!     let y = fused::accumulating_linear(x.as_tensor(), &w, &dw)?;
//!     assert_eq!(y.to_vec2::<f32>()?, [[3.0, 7.0, 11.0]]);
//!     let grads = y.sum_all()?.backward()?;
//!     assert_eq!(grads.get(&x).unwrap().to_vec2::<f32>()?, [[9.0, 12.0]]); // dY·W
//! }
//! assert_eq!(dw.to_vec2::<f32>()?, [[2.0, 2.0]; 3]);
//! # Ok(()) }
//! ```

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, InplaceOp3, Layout, Shape, Tensor};

use super::accumulate::f32s_mut;

/// `x·wᵀ` for `x` of `[.., in]` and `w` of `[out, in]`, whose backward gives `x` its gradient
/// and adds `w`'s into `dw` ([`add_weight_grad`]) instead of returning it: `dw` is an f32
/// tensor of `[out, in]`, contiguous, on `x`'s device, owned by the caller (every tensor
/// sharing its storage sees the sums; the weight's or `x`'s own memory is refused). The forward
/// is candle's matrix product, the same bits as
/// [`linear`](crate::candle::block::linear) gives.
///
/// Each backward of the result adds once, so a graph whose backward runs twice adds twice.
/// `x` must be in candle's autograd graph (a `Var`, or computed from one): otherwise candle
/// would never run this backward and `dw` would silently stay as it is, so that is refused (use
/// [`linear`](crate::candle::block::linear) for a pass without a backward). A `w` that is a
/// `Var` gets no gradient from this op.
pub fn accumulating_linear(x: &Tensor, w: &Tensor, dw: &Tensor) -> candle_core::Result<Tensor> {
    let (out, inp) = w.dims2()?;
    check_sum(dw, (out, inp), "accumulating_linear")?;
    for (other, what) in [(w, "the weight"), (x, "x")] {
        if same_memory(dw, other) {
            // The backward adds into dw before it reads w for x's gradient, and a buffer that
            // is x cannot be written while x is read.
            candle_core::bail!(
                "accumulating_linear: the gradient buffer shares its memory with {what}: give                  it a tensor of its own (Tensor::zeros)"
            );
        }
    }
    if !x.track_op() {
        candle_core::bail!(
            "accumulating_linear: x is not in candle's autograd graph (neither a Var nor computed \
             from one), so its backward would never add to the gradient buffer: make x a Var, or \
             use linear for a pass without a backward"
        );
    }
    let dims = x.dims();
    if dims.last() != Some(&inp) {
        candle_core::bail!("accumulating_linear: x of {dims:?} for a weight of [{out}, {inp}]");
    }
    let rows = x.elem_count() / inp.max(1);
    let mut shape = dims.to_vec();
    if let Some(last) = shape.last_mut() {
        *last = out;
    }
    let op = RowsMatmul { dw: Some(dw.clone()), what: "accumulating_linear:" };
    x.reshape((rows, inp))?.apply_op2_arc(w, Arc::new(Box::new(op)))?.reshape(shape)
}

/// `dw += dyᵀ·x` in f32, in place: `dy` of `[.., out]` (a linear layer's output gradient) and
/// `x` of `[.., in]` (its input), with the same leading dimensions and one dtype (f32, bf16 or
/// f16; made contiguous first if they are not), summed over every leading position into `dw`,
/// an f32 tensor of `[out, in]`, contiguous. 16-bit values are widened to f32 (exactly) and every
/// product and sum is made in f32: nothing is rounded to the inputs' dtype.
pub fn add_weight_grad(dw: &Tensor, dy: &Tensor, x: &Tensor) -> candle_core::Result<()> {
    let (Some(&out), Some(&inp)) = (dy.dims().last(), x.dims().last()) else {
        candle_core::bail!("add_weight_grad: dy of {:?} and x of {:?}", dy.dims(), x.dims());
    };
    check_sum(dw, (out, inp), "add_weight_grad")?;
    let lead = |d: &[usize]| d[..d.len() - 1].to_vec();
    if lead(dy.dims()) != lead(x.dims()) || dy.dtype() != x.dtype() {
        candle_core::bail!(
            "add_weight_grad: dy of {:?} ({:?}) and x of {:?} ({:?}): the same leading dimensions \
             and dtype are needed",
            dy.dims(),
            dy.dtype(),
            x.dims(),
            x.dtype()
        );
    }
    if !matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16) {
        return Err(super::unsupported("add_weight_grad", x.dtype()));
    }
    let rows = x.elem_count() / inp.max(1);
    let dy = dy.reshape((rows, out))?.contiguous()?;
    let x = x.reshape((rows, inp))?.contiguous()?;
    dw.inplace_op3(&dy, &x, &WeightGrad)
}

/// Whether `a` and `b` are views of one storage.
fn same_memory(a: &Tensor, b: &Tensor) -> bool {
    let at = |t: &Tensor| -> *const candle_core::Storage { &*t.storage_and_layout().0 };
    // One read lock at a time: the two may be the same lock.
    let pa = at(a);
    std::ptr::eq(pa, at(b))
}

/// Refuses a gradient buffer that is not a contiguous f32 `[out, in]`.
fn check_sum(dw: &Tensor, (out, inp): (usize, usize), what: &str) -> candle_core::Result<()> {
    if dw.dtype() != DType::F32 || !dw.is_contiguous() || dw.dims() != [out, inp] {
        candle_core::bail!(
            "{what}: the gradient buffer must be a contiguous f32 tensor of [{out}, {inp}] (the \
             weight's shape), not {:?} of {:?} ({})",
            dw.dtype(),
            dw.dims(),
            if dw.is_contiguous() { "contiguous" } else { "strided" }
        );
    }
    Ok(())
}

/// `lhs · rhsᵀ` (rows of inputs times a `[out, in]` weight) whose backward gives the gradient
/// to `lhs` through candle and none to the weight: with `dw`, the weight's gradient is added
/// into that f32 buffer instead ([`accumulating_linear`]); without, it is not computed
/// ([`frozen_linear`](crate::candle::block::frozen_linear)). `what` starts its errors.
pub(crate) struct RowsMatmul {
    pub(crate) dw: Option<Tensor>,
    pub(crate) what: &'static str,
}

impl RowsMatmul {
    fn dims(&self, l1: &Layout, l2: &Layout) -> candle_core::Result<(usize, usize, usize, Layout)> {
        let (m, k) = l1.shape().dims2()?;
        let (n, k2) = l2.shape().dims2()?;
        if k != k2 {
            candle_core::bail!("{} {m}x{k} inputs and a {n}x{k2} weight", self.what);
        }
        Ok((m, n, k, l2.transpose(0, 1)?))
    }
}

impl candle_core::CustomOp2 for RowsMatmul {
    fn name(&self) -> &'static str {
        "strata-rows-matmul"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, n, k, t) = self.dims(l1, l2)?;
        Ok((s1.matmul(s2, (1, m, n, k), l1, &t)?, Shape::from((m, n))))
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (m, n, k, t) = self.dims(l1, l2)?;
        Ok((s1.matmul(s2, (1, m, n, k), l1, &t)?, Shape::from((m, n))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        if let Some(dw) = &self.dw {
            add_weight_grad(dw, grad, x)?;
        }
        Ok((Some(grad.matmul(w)?), None))
    }
}

/// [`add_weight_grad`]'s in-place op on the buffer, given `dy` (`[rows, out]`) and `x`
/// (`[rows, in]`), both contiguous.
struct WeightGrad;

impl InplaceOp3 for WeightGrad {
    fn name(&self) -> &'static str {
        "strata-add-weight-grad"
    }

    fn cpu_fwd(
        &self,
        acc: &mut CpuStorage,
        la: &Layout,
        dy: &CpuStorage,
        ldy: &Layout,
        x: &CpuStorage,
        lx: &Layout,
    ) -> candle_core::Result<()> {
        let (rows, out) = ldy.shape().dims2()?;
        let inp = lx.shape().dims2()?.1;
        let acc = f32s_mut(acc, la, "add_weight_grad")?;
        let (mut dy_wide, mut x_wide) = (Vec::new(), Vec::new());
        let dy = widened(dy, ldy, &mut dy_wide, "add_weight_grad's dy")?;
        let x = widened(x, lx, &mut x_wide, "add_weight_grad's x")?;
        crate::backend::gemm::add_at_b(acc, [rows, out, inp], dy, x)?;
        Ok(())
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        acc: &mut candle_core::CudaStorage,
        la: &Layout,
        dy: &candle_core::CudaStorage,
        ldy: &Layout,
        x: &candle_core::CudaStorage,
        lx: &Layout,
    ) -> candle_core::Result<()> {
        super::cuda::add_weight_grad((acc, la), (dy, ldy), (x, lx))
    }
}

/// The values of contiguous storage `s` as f32: f32 in place, bf16 and f16 widened into `wide`.
fn widened<'a>(
    s: &'a CpuStorage,
    l: &Layout,
    wide: &'a mut Vec<f32>,
    what: &str,
) -> candle_core::Result<&'a [f32]> {
    let (start, end) = l.contiguous_offsets().ok_or_else(|| {
        candle_core::Error::Msg(format!("{what}: a contiguous tensor is needed")).bt()
    })?;
    match s {
        CpuStorage::F32(v) => return Ok(&v[start..end]),
        CpuStorage::BF16(v) => wide.extend(v[start..end].iter().map(|h| h.to_f32())),
        CpuStorage::F16(v) => wide.extend(v[start..end].iter().map(|h| h.to_f32())),
        other => return Err(super::unsupported("add_weight_grad", other.dtype())),
    }
    Ok(wide)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::candle::llama::SeededRng;
    use candle_core::{Device, Var};

    fn ramp(n: usize, shape: &[usize], scale: f32) -> Tensor {
        let v: Vec<f32> = (0..n).map(|i| ((i * 37) % 23) as f32 * scale - 1.0).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn randn(rng: &mut SeededRng, shape: &[usize], dtype: DType) -> Tensor {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.normal(1.0) as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
    }

    fn f64s(t: &Tensor) -> Vec<f64> {
        let v = t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        v.into_iter().map(f64::from).collect()
    }

    /// `Σ_r dy[r, o] · x[r, i]` in f64, over the rows of every `(dy, x)` given.
    fn reference(pairs: &[(&Tensor, &Tensor)], out: usize, inp: usize) -> Vec<f64> {
        let mut s = vec![0f64; out * inp];
        for (dy, x) in pairs {
            let (dy, x) = (f64s(dy), f64s(x));
            for r in 0..dy.len() / out {
                for o in 0..out {
                    for i in 0..inp {
                        s[o * inp + i] += dy[r * out + o] * x[r * inp + i];
                    }
                }
            }
        }
        s
    }

    /// The largest `|a − b|` over the largest `|b|`.
    fn rel(a: &[f64], b: &[f64]) -> f64 {
        let top = b.iter().fold(0f64, |m, v| m.max(v.abs()));
        a.iter().zip(b).fold(0f64, |m, (a, b)| m.max((a - b).abs())) / top
    }

    /// `(y, dx, dw)` of `sum(y · r)` for `y = x·wᵀ`: candle's autograd (`matmul` with `w` a
    /// `Var`), or the accumulating op.
    fn run(x: &Tensor, w: &Tensor, r: &Tensor, ours: bool) -> (Tensor, Tensor, Tensor) {
        let xv = Var::from_tensor(x).unwrap();
        let (o, i) = w.dims2().unwrap();
        let rows = x.elem_count() / i;
        let mut shape = x.dims().to_vec();
        *shape.last_mut().unwrap() = o;
        if ours {
            let dw = Tensor::zeros((o, i), DType::F32, &Device::Cpu).unwrap();
            let y = accumulating_linear(xv.as_tensor(), w, &dw).unwrap();
            let g = y.mul(r).unwrap().sum_all().unwrap().backward().unwrap();
            (y, g.get(&xv).unwrap().clone(), dw)
        } else {
            let wv = Var::from_tensor(w).unwrap();
            let x2 = xv.as_tensor().reshape((rows, i)).unwrap();
            let y = x2.matmul(&wv.as_tensor().t().unwrap()).unwrap().reshape(shape).unwrap();
            let g = y.mul(r).unwrap().sum_all().unwrap().backward().unwrap();
            (y, g.get(&xv).unwrap().clone(), g.get(&wv).unwrap().clone())
        }
    }

    #[test]
    fn f32_values_and_gradients_are_candles_within_1e6() {
        let mut rng = SeededRng::new(3);
        // A 3-D x, as a block's linears take it.
        let x = randn(&mut rng, &[2, 5, 7], DType::F32);
        let w = randn(&mut rng, &[6, 7], DType::F32);
        let r = randn(&mut rng, &[2, 5, 6], DType::F32);
        let (y, dx, dw) = run(&x, &w, &r, true);
        let (ry, rdx, rdw) = run(&x, &w, &r, false);
        assert_eq!(y.dims(), [2, 5, 6]);
        // The forward and dX are candle's own matrix products: the same bits.
        assert_eq!(f64s(&y), f64s(&ry));
        assert_eq!(f64s(&dx), f64s(&rdx));
        // dW: another GEMM's order of the same f32 sums.
        let want = reference(&[(&r, &x)], 6, 7);
        assert!(rel(&f64s(&dw), &f64s(&rdw)) < 1e-6, "{}", rel(&f64s(&dw), &f64s(&rdw)));
        assert!(rel(&f64s(&dw), &want) < 1e-6);
    }

    #[test]
    fn bf16_weight_gradients_are_summed_in_f32_closer_than_candles_bf16() {
        let mut rng = SeededRng::new(5);
        let x = randn(&mut rng, &[3, 40, 24], DType::BF16);
        let w = randn(&mut rng, &[16, 24], DType::BF16);
        let r = randn(&mut rng, &[3, 40, 16], DType::BF16);
        let (y, dx, dw) = run(&x, &w, &r, true);
        let (ry, rdx, rdw) = run(&x, &w, &r, false);
        assert_eq!((y.dtype(), dx.dtype(), dw.dtype()), (DType::BF16, DType::BF16, DType::F32));
        assert_eq!(f64s(&y), f64s(&ry));
        assert_eq!(f64s(&dx), f64s(&rdx));
        // dY is `r`: the f64 sums of the very bf16 values both read.
        let want = reference(&[(&r, &x)], 16, 24);
        let (ours, candle) = (rel(&f64s(&dw), &want), rel(&f64s(&rdw), &want));
        assert!(ours < 1e-6, "f32 sums: {ours}");
        assert!(candle > 1e-4 && ours * 100.0 < candle, "ours {ours}, candle's bf16 {candle}");
    }

    #[test]
    fn micro_batches_add_into_one_buffer_and_strided_inputs_are_read_as_they_are() {
        let mut rng = SeededRng::new(8);
        let w = randn(&mut rng, &[5, 9], DType::F32);
        let dw = Tensor::zeros((5, 9), DType::F32, &Device::Cpu).unwrap();
        let direct = dw.zeros_like().unwrap();
        let mut pairs = Vec::new();
        for m in 0..3 {
            // A transposed (strided) x: [4, 9] over a [9, 4] tensor.
            let xv = Var::from_tensor(&randn(&mut rng, &[9, 4], DType::F32)).unwrap();
            let x = xv.as_tensor().t().unwrap();
            assert!(!x.is_contiguous());
            let r = randn(&mut rng, &[4, 5], DType::F32);
            let y = accumulating_linear(&x, &w, &dw).unwrap();
            let g = y.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
            // Made contiguous as rows first, as candle's linear does.
            let ry = x.contiguous().unwrap().matmul(&w.t().unwrap()).unwrap();
            assert_eq!(f64s(&y), f64s(&ry), "micro-batch {m}");
            let dx = r.matmul(&w).unwrap().t().unwrap();
            assert_eq!(f64s(g.get(&xv).unwrap()), f64s(&dx), "micro-batch {m}");
            let x = x.detach();
            add_weight_grad(&direct, &r, &x).unwrap();
            pairs.push((r, x));
        }
        let refs: Vec<(&Tensor, &Tensor)> = pairs.iter().map(|(r, x)| (r, x)).collect();
        assert!(rel(&f64s(&dw), &reference(&refs, 5, 9)) < 1e-6);
        // The op's backward is add_weight_grad: the same bits, micro-batch after micro-batch.
        assert_eq!(f64s(&dw), f64s(&direct));
    }

    /// `(dx, dw)` of `sum(f(y) · r)` with `y = x·wᵀ` and `x = make(base)` (any layout: a
    /// broadcast, say), `base` a `Var`: through the accumulating op (`dw` summed into a fresh
    /// buffer) and through candle's autograd (`w` a `Var`), `dx` being `base`'s gradient.
    fn both(
        base: &Tensor,
        make: impl Fn(&Tensor) -> Tensor,
        w: &Tensor,
        r: &Tensor,
        f: impl Fn(Tensor) -> Tensor,
    ) -> [(Vec<f64>, Vec<f64>); 2] {
        let (o, i) = w.dims2().unwrap();
        let run = |ours: bool| {
            let base = Var::from_tensor(base).unwrap();
            let xs = make(base.as_tensor());
            let dw = Tensor::zeros((o, i), DType::F32, &Device::Cpu).unwrap();
            let wv = Var::from_tensor(w).unwrap();
            let y = if ours {
                accumulating_linear(&xs, w, &dw).unwrap()
            } else {
                let rows = xs.elem_count() / i.max(1);
                let mut shape = xs.dims().to_vec();
                *shape.last_mut().unwrap() = o;
                xs.reshape((rows, i))
                    .unwrap()
                    .matmul(&wv.as_tensor().t().unwrap())
                    .unwrap()
                    .reshape(shape)
                    .unwrap()
            };
            let g = f(y).mul(r).unwrap().sum_all().unwrap().backward().unwrap();
            let dx = f64s(g.get(&base).unwrap());
            let dw = if ours { f64s(&dw) } else { f64s(g.get(&wv).unwrap()) };
            (dx, dw)
        };
        [run(true), run(false)]
    }

    #[test]
    fn broadcast_inputs_strided_output_gradients_and_a_single_row_give_candles_gradients() {
        let mut rng = SeededRng::new(11);
        let w = randn(&mut rng, &[6, 5], DType::F32);
        let same = |t: &Tensor| t.clone();
        // A broadcast x: one row seen as [3, 4, 5] (strides 0): dW sums its 12 uses.
        let base = randn(&mut rng, &[1, 1, 5], DType::F32);
        let wide = |t: &Tensor| t.broadcast_as((3, 4, 5)).unwrap();
        assert!(!wide(&base).is_contiguous());
        let r = randn(&mut rng, &[3, 4, 6], DType::F32);
        let [(dx, dw), (rdx, rdw)] = both(&base, wide, &w, &r, |y| y);
        assert_eq!(dx, rdx);
        assert!(rel(&dw, &rdw) < 1e-6, "{}", rel(&dw, &rdw));
        // dY strided: the linear's output transposed before the loss.
        let x = randn(&mut rng, &[7, 5], DType::F32);
        let r = randn(&mut rng, &[6, 7], DType::F32);
        let [(dx, dw), (rdx, rdw)] = both(&x, same, &w, &r, |y| y.t().unwrap());
        assert_eq!(dx, rdx);
        assert!(rel(&dw, &rdw) < 1e-6, "{}", rel(&dw, &rdw));
        // x of rank 1: one row.
        let x = randn(&mut rng, &[5], DType::F32);
        let r = randn(&mut rng, &[6], DType::F32);
        let [(dx, dw), (rdx, rdw)] = both(&x, same, &w, &r, |y| y);
        assert_eq!(dx, rdx);
        assert!(rel(&dw, &rdw) < 1e-6, "{}", rel(&dw, &rdw));
    }

    #[test]
    fn a_weight_applied_twice_sums_both_and_a_backward_run_twice_adds_twice() {
        let mut rng = SeededRng::new(12);
        let w = randn(&mut rng, &[4, 3], DType::F32);
        let x = Var::from_tensor(&randn(&mut rng, &[2, 5, 3], DType::F32)).unwrap();
        let r = randn(&mut rng, &[2, 5, 4], DType::F32);
        // Tied: one weight and its buffer in two linears of one graph (over x and x²).
        let x2 = x.as_tensor().sqr().unwrap();
        let dw = Tensor::zeros((4, 3), DType::F32, &Device::Cpu).unwrap();
        let y = accumulating_linear(x.as_tensor(), &w, &dw)
            .unwrap()
            .add(&accumulating_linear(&x2, &w, &dw).unwrap())
            .unwrap();
        let loss = y.mul(&r).unwrap().sum_all().unwrap();
        let g = loss.backward().unwrap();
        let wv = Var::from_tensor(&w).unwrap();
        let lin = |x: &Tensor| x.broadcast_matmul(&wv.as_tensor().t().unwrap()).unwrap();
        let ry = lin(x.as_tensor()).add(&lin(&x2)).unwrap();
        let rg = ry.mul(&r).unwrap().sum_all().unwrap().backward().unwrap();
        let want = f64s(rg.get(&wv).unwrap());
        assert!(rel(&f64s(&dw), &want) < 1e-6, "{}", rel(&f64s(&dw), &want));
        let dx = f64s(g.get(&x).unwrap());
        let rdx = f64s(rg.get(&x).unwrap());
        assert!(rel(&dx, &rdx) < 1e-6);
        // The same graph's backward again: added once more (documented), not replaced.
        loss.backward().unwrap();
        let twice: Vec<f64> = want.iter().map(|v| 2.0 * v).collect();
        assert!(rel(&f64s(&dw), &twice) < 1e-6, "{}", rel(&f64s(&dw), &twice));
    }

    #[test]
    fn f16_sums_in_f32_and_a_buffer_inside_a_larger_tensor_is_added_in_its_place() {
        let mut rng = SeededRng::new(13);
        let x = randn(&mut rng, &[2, 30, 16], DType::F16);
        let w = randn(&mut rng, &[8, 16], DType::F16);
        let r = randn(&mut rng, &[2, 30, 8], DType::F16);
        let (y, _, dw) = run(&x, &w, &r, true);
        assert_eq!((y.dtype(), dw.dtype()), (DType::F16, DType::F32));
        let want = reference(&[(&r, &x)], 8, 16);
        assert!(rel(&f64s(&dw), &want) < 1e-6, "{}", rel(&f64s(&dw), &want));
        // A buffer that is rows 1..3 of a [4, 2] tensor (contiguous, at an offset): only those
        // rows change.
        let all = Tensor::zeros((4, 2), DType::F32, &Device::Cpu).unwrap();
        let dw = all.narrow(0, 1, 2).unwrap();
        assert!(dw.is_contiguous());
        let x = Var::new(&[[1f32, 2.0]], &Device::Cpu).unwrap();
        let w = Tensor::new(&[[1f32, 1.0], [1.0, 1.0]], &Device::Cpu).unwrap();
        let y = accumulating_linear(x.as_tensor(), &w, &dw).unwrap();
        y.sum_all().unwrap().backward().unwrap();
        assert_eq!(all.to_vec2::<f32>().unwrap(), [[0.0, 0.0], [1.0, 2.0], [1.0, 2.0], [0.0, 0.0]]);
    }

    #[test]
    fn no_rows_give_an_empty_output_and_add_nothing() {
        let w = ramp(6, &[3, 2], 0.1);
        let dw = Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap();
        for dims in [vec![0, 2], vec![2, 0, 2]] {
            let x = Var::zeros(dims.as_slice(), DType::F32, &Device::Cpu).unwrap();
            let y = accumulating_linear(x.as_tensor(), &w, &dw).unwrap();
            let mut want = dims.clone();
            *want.last_mut().unwrap() = 3;
            assert_eq!(y.dims(), want.as_slice());
            let g = y.sum_all().unwrap().backward().unwrap();
            assert_eq!(g.get(&x).unwrap().dims(), dims.as_slice());
        }
        assert_eq!(dw.sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    }

    #[test]
    fn a_buffer_of_the_wrong_dtype_shape_or_layout_is_refused() {
        let w = ramp(6, &[3, 2], 0.1);
        let x = Var::from_tensor(&ramp(4, &[2, 2], 0.1)).unwrap();
        let x = x.as_tensor();
        let bad = [
            Tensor::zeros((3, 2), DType::BF16, &Device::Cpu).unwrap(),
            Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap(),
            Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap().t().unwrap(),
        ];
        for dw in &bad {
            let e = accumulating_linear(x, &w, dw).unwrap_err().to_string();
            assert!(e.contains("contiguous f32 tensor of [3, 2]"), "{e}");
            assert!(add_weight_grad(dw, &ramp(6, &[2, 3], 0.1), x).is_err());
        }
        let dw = Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap();
        let e = accumulating_linear(&x.detach(), &w, &dw).unwrap_err().to_string();
        assert!(e.contains("not in candle's autograd graph"), "{e}");
        // The weight itself, or x, as the buffer: the backward would add into the weight
        // before reading it for x's gradient (or write x while reading it).
        let square = ramp(4, &[2, 2], 0.1);
        for (dw, what) in [(&square, "the weight"), (x, "x")] {
            let e = accumulating_linear(x, &square, dw).unwrap_err().to_string();
            assert!(e.contains(&format!("shares its memory with {what}")), "{e}");
        }
        let e = accumulating_linear(x, &square, &square.narrow(0, 0, 2).unwrap());
        assert!(e.unwrap_err().to_string().contains("with the weight"));
        let wide = Var::from_tensor(&ramp(6, &[2, 3], 0.1)).unwrap();
        let e = accumulating_linear(wide.as_tensor(), &w, &dw).unwrap_err().to_string();
        assert!(e.contains("x of [2, 3] for a weight of [3, 2]"), "{e}");
        let e = add_weight_grad(&dw, &ramp(9, &[3, 3], 0.1), x).unwrap_err().to_string();
        assert!(e.contains("[3, 3]"), "{e}");
        let e = add_weight_grad(&dw, &ramp(6, &[2, 3], 0.1), &x.to_dtype(DType::BF16).unwrap());
        assert!(e.unwrap_err().to_string().contains("dtype"));
        let ints = Tensor::zeros((2, 3), DType::U32, &Device::Cpu).unwrap();
        let e =
            add_weight_grad(&dw, &ints, &Tensor::zeros((2, 2), DType::U32, &Device::Cpu).unwrap());
        assert!(e.unwrap_err().to_string().contains("f32, bf16 or f16"));
        assert_eq!(dw.sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0, "nothing was added");
    }
}
