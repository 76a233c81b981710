//! Fused operations of the Llama block, each one candle op with its own backward: attention
//! ([`attention`], FlashAttention-2's algorithm: causal, grouped-query, an optional sliding
//! window, never a `seq × seq` tensor), RMSNorm ([`rms_norm`], and with the residual add before
//! it, [`add_rms_norm`]), the rotary embedding ([`rope`]) and SwiGLU's gate ([`swiglu`], and
//! over the joint gate/up output in place, [`swiglu_joined`]);
//! gradients summed in place in f32 ([`accumulate`], [`index_add_rows`]); and a linear layer
//! whose backward sums its weight's gradient straight into an f32 buffer
//! ([`accumulating_linear`], [`add_weight_grad`]). The built-in blocks' attention
//! ([`block_attention`]) runs strata's kernel or, on CUDA where it applies, cuDNN's fused SDPA on
//! the tensor cores ([`cudnn`]), as [`AttentionKernel`] and `STRATA_ATTENTION` choose.
//!
//! Each is a candle `CustomOp` (`Tensor::apply_op*`), so candle's autograd runs its backward:
//! the forward saves what the backward needs (attention: the log-sum-exp of each query row;
//! RMSNorm: each row's inverse root mean square), and the backward is a fused pass of its own
//! rather than candle ops. On the CPU each runs on candle's thread pool (rayon), over work
//! items whose outputs do not overlap and whose sums run in a fixed order, so a result has the
//! same bits whatever the number of threads. On candle's CUDA device (feature `candle-cuda`)
//! each is a kernel of `cuda/fused.cu`, compiled once per device with
//! NVRTC and launched on candle's stream: nothing is built on the host per call and nothing
//! waits for the device.
//!
//! Every op takes f32, bf16 or f16 and computes in f32: values are read, widened, combined and
//! rounded once into the input's dtype (RMSNorm also rounds where Hugging Face's `LlamaRMSNorm`
//! does, before the weight). The decomposed candle ops of [`super::llama`]
//! ([`Compute::Decomposed`](super::llama::Compute)) are their reference: `tests/candle/fused.rs`
//! compares values and gradients, and the gradients with finite differences.
//!
//! ```
//! # fn main() -> candle_core::Result<()> {
//! use candle_core::{Device, Tensor};
//! use strata::candle::fused;
//!
//! let dev = Device::Cpu;
//! // 1 sequence of 5 tokens, 4 query heads over 2 key/value heads of width 8.
//! let q = Tensor::randn(0f32, 1.0, (1, 5, 4, 8), &dev)?;
//! let k = Tensor::randn(0f32, 1.0, (1, 5, 2, 8), &dev)?;
//! let v = Tensor::randn(0f32, 1.0, (1, 5, 2, 8), &dev)?;
//! let o = fused::attention(&q, &k, &v, 1.0 / 8f64.sqrt(), None)?;
//! assert_eq!(o.dims(), &[1, 5, 4, 8]);
//! # Ok(()) }
//! ```

mod accumulate;
mod add_norm;
mod attention;
mod choice;
#[cfg(feature = "candle-cuda")]
mod cuda;
pub mod cudnn;
mod linear;
mod norm;
mod rope;
mod swiglu;

pub use accumulate::{accumulate, index_add_rows};
pub use add_norm::add_rms_norm;
pub use attention::attention;
pub use choice::{
    attention_kernel, attention_kernel_for, attention_with, block_attention, set_attention_kernel,
    AttentionKernel, ATTENTION_ENV,
};
pub(crate) use linear::RowsMatmul;
pub use linear::{accumulating_linear, add_weight_grad};
pub use norm::rms_norm;
pub use rope::rope;
pub use swiglu::{swiglu, swiglu_joined};

use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, DType, Layout, Shape, Storage, Tensor};
use half::{bf16, f16};

/// An element type the fused ops read and write: widened to f32 to compute, rounded back (to
/// nearest, ties to even, as candle's `to_dtype` rounds) to store.
pub(crate) trait Elem: candle_core::WithDType {
    /// The value as f32.
    fn widen(self) -> f32;
    /// `x` rounded to this type.
    fn narrow(x: f32) -> Self;
}

impl Elem for f32 {
    fn widen(self) -> f32 {
        self
    }
    fn narrow(x: f32) -> f32 {
        x
    }
}

impl Elem for bf16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    fn narrow(x: f32) -> bf16 {
        bf16::from_f32(x)
    }
}

impl Elem for f16 {
    fn widen(self) -> f32 {
        self.to_f32()
    }
    fn narrow(x: f32) -> f16 {
        f16::from_f32(x)
    }
}

/// Runs `$body` with `$t` the element type of CPU storage `$s` (f32, bf16 or f16), or returns
/// an error naming `$op` for another dtype.
macro_rules! with_elem {
    ($s:expr, $op:expr, |$t:ident| $body:expr) => {
        match candle_core::backend::BackendStorage::dtype($s) {
            candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            candle_core::DType::BF16 => {
                type $t = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $t = half::f16;
                $body
            }
            other => Err($crate::candle::fused::unsupported($op, other)),
        }
    };
}
pub(crate) use with_elem;

/// The error for a dtype the fused ops do not take.
pub(crate) fn unsupported(op: &str, dtype: DType) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "{op} takes f32, bf16 or f16 tensors, not {dtype:?}: convert with to_dtype, or use \
         llama::Compute::Decomposed"
    ))
    .bt()
}

/// The elements of a contiguous tensor's storage, `layout`'s range of `s`.
pub(crate) fn contiguous<'a, T: Elem>(
    s: &'a CpuStorage,
    layout: &Layout,
    what: &str,
) -> candle_core::Result<&'a [T]> {
    let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
        candle_core::Error::Msg(format!("{what}: a contiguous tensor is needed")).bt()
    })?;
    Ok(&s.as_slice::<T>()?[start..end])
}

/// A candle tensor of `values` on the CPU, with no gradient of its own.
pub(crate) fn cpu_tensor<T: Elem>(values: Vec<T>, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(
        Storage::Cpu(T::to_cpu_storage_owned(values)),
        shape,
        BackpropOp::none(),
        false,
    )
}

/// A candle tensor of a CUDA buffer (`storage`, contiguous, of `shape`), with no gradient of
/// its own.
#[cfg(feature = "candle-cuda")]
pub(crate) fn cuda_tensor(storage: candle_core::CudaStorage, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
}

/// `Σ a[i] · b[i]` in f32, in eight interleaved partial sums (so the compiler can vectorize
/// it): a fixed order, so the same inputs give the same bits.
#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `y += a · x`.
#[inline]
pub(crate) fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// Elements per work item of the element-wise ops on the CPU.
pub(crate) const CHUNK: usize = 1 << 14;

/// The shapes of one attention call ([`attention`]), read by its CPU kernels (`attention.rs`) and
/// its CUDA launch (`cuda.rs`).
#[derive(Clone, Copy, Debug)]
struct Geometry {
    b: usize,
    sq: usize,
    skv: usize,
    nh: usize,
    nkv: usize,
    d: usize,
    scale: f32,
    /// `usize::MAX` for none.
    window: usize,
}

impl Geometry {
    fn new(q: &Layout, k: &Layout, scale: f32, window: Option<usize>) -> Geometry {
        let (qd, kd) = (q.dims(), k.dims());
        Geometry {
            b: qd[0],
            sq: qd[1],
            nh: qd[2],
            d: qd[3],
            skv: kd[1],
            nkv: kd[2],
            scale,
            window: window.unwrap_or(usize::MAX),
        }
    }

    fn offset(&self) -> usize {
        self.skv - self.sq
    }

    fn group(&self) -> usize {
        self.nh / self.nkv
    }

    /// The keys query `i` sees: `lo..hi`.
    fn keys(&self, i: usize) -> (usize, usize) {
        let hi = self.offset() + i + 1;
        (hi.saturating_sub(self.window), hi)
    }

    /// The queries that see key `j`: `lo..hi` (empty when none does).
    fn queries(&self, j: usize) -> (usize, usize) {
        let lo = j.saturating_sub(self.offset()).min(self.sq);
        let hi = j.saturating_add(self.window).saturating_sub(self.offset()).min(self.sq);
        (lo, hi.max(lo))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry(sq: usize, skv: usize, window: Option<usize>) -> Geometry {
        Geometry {
            b: 1,
            sq,
            skv,
            nh: 2,
            nkv: 1,
            d: 4,
            scale: 0.5,
            window: window.unwrap_or(usize::MAX),
        }
    }

    #[test]
    fn keys_and_queries_are_the_two_readings_of_one_mask() {
        for (sq, skv, w) in
            [(5, 5, None), (3, 7, None), (6, 6, Some(2)), (4, 9, Some(3)), (1, 4, Some(1))]
        {
            let g = geometry(sq, skv, w);
            for i in 0..sq {
                let (lo, hi) = g.keys(i);
                for j in 0..skv {
                    let sees = j >= lo && j < hi;
                    let pos = skv - sq + i;
                    assert_eq!(sees, j <= pos && w.is_none_or(|w| pos - j < w), "{i} {j}");
                    let (qlo, qhi) = g.queries(j);
                    assert_eq!(sees, i >= qlo && i < qhi, "{i} {j} {w:?}");
                }
            }
        }
    }

    #[test]
    fn dot_sums_every_element_in_a_fixed_order() {
        let a: Vec<f32> = (0..21).map(|i| i as f32).collect();
        let b = vec![2f32; 21];
        assert_eq!(dot(&a, &b), 420.0);
        assert_eq!(dot(&a[..3], &b[..3]), 6.0);
        let mut y = vec![1f32; 3];
        axpy(&mut y, 2.0, &[1.0, 2.0, 3.0]);
        assert_eq!(y, [3.0, 5.0, 7.0]);
        assert_eq!(bf16::narrow(1.0 + 1.0 / 256.0).widen(), 1.0); // a tie, to even
        assert_eq!(f16::narrow(0.5).widen(), 0.5);
    }
}
