//! The fused attention of [`super::attention`] by cuDNN 9's fused SDPA on the tensor cores,
//! forward and backward, through strata's shim `libstrata_attn.so` (`cuda/attention/`, built
//! by `benches/gpu/build-attention` and loaded at run time: `crate::backend::cuda::attention_lib`).
//! The built-in blocks run it where it takes the call and the library loads
//! ([`AttentionKernel::Auto`](super::AttentionKernel), the default: training's shapes on
//! candle's CUDA device in bf16 or f16), strata's own kernel elsewhere;
//! `examples/fused_attention.rs --kernel cudnn-sdpa` measures it against PyTorch's SDPA on the
//! GPU lease. The backward is cuDNN's deterministic algorithm: the same inputs give the same
//! bits run after run.
//!
//! The same call as [`super::attention`] (causal, grouped-query, an optional sliding window,
//! `[batch, seq, heads, head_dim]` with any strides whose head dimension is contiguous), on
//! candle's CUDA device only (feature `candle-cuda`) and in bf16 or f16 only; head widths that
//! are multiples of 8 up to 256. The forward keeps cuDNN's log-sum-exp (f32 `[batch, heads,
//! q_len]`) for the backward. A missing library is a
//! [`LibraryUnavailable`](crate::Error::LibraryUnavailable) error saying how to build it.
//!
//! ```
//! use strata::candle::fused::cudnn;
//! // Without candle's CUDA build, or without the library, it says why.
//! if let Err(why) = cudnn::available() {
//!     println!("cuDNN attention: {why}");
//! }
//! ```

use std::sync::OnceLock;

use candle_core::{CpuStorage, CustomOp3, Layout, Shape, Tensor};

/// Whether cuDNN's attention can run here: the library's path and cuDNN's version, or why
/// not (no candle CUDA build, or no library: what to do about it).
pub fn available() -> candle_core::Result<String> {
    #[cfg(feature = "candle-cuda")]
    {
        let lib = crate::backend::cuda::attention_lib::AttentionLib::get()?;
        let v = lib.cudnn_version();
        Ok(format!("{} (cuDNN {}.{}.{})", lib.path(), v / 10000, v / 100 % 100, v % 100))
    }
    #[cfg(not(feature = "candle-cuda"))]
    Err(candle_core::Error::Msg(NO_CUDA.into()))
}

#[cfg(not(feature = "candle-cuda"))]
const NO_CUDA: &str = "cuDNN attention runs on candle's CUDA device: strata was built without \
                       the candle-cuda feature";

/// Causal attention of `q` (`[batch, q_len, heads, head_dim]`) over `k` and `v` (`[batch,
/// kv_len, kv_heads, head_dim]`) by cuDNN's fused SDPA: the same result as
/// [`super::attention`] (up to rounding: cuDNN sums in another order), with its backward.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    window: Option<usize>,
) -> candle_core::Result<Tensor> {
    super::attention::check_qkv("cuDNN attention", q, k, v)?;
    // cuDNN reads whole head rows: a head dimension with another stride is copied first.
    use super::attention::head_rows as rows;
    rows(q)?.apply_op3_arc(
        &rows(k)?,
        &rows(v)?,
        std::sync::Arc::new(Box::new(CudnnAttention {
            scale: scale as f32,
            window,
            lse: OnceLock::new(),
        })),
    )
}

/// [`attention`] where cuDNN takes the call, forward and backward (`Ok(Ok(output))`), else why
/// not, with nothing run (`Ok(Err(why))`): not on candle's CUDA device, neither bf16 nor f16,
/// no library, or a shape whose graphs cuDNN refuses on this GPU. Each shape is asked once:
/// both directions' graphs are built then (the library keeps them), and a refusal is
/// remembered and logged once. What [`AttentionKernel::Auto`](super::AttentionKernel::Auto)
/// runs.
pub(crate) fn attention_if_taken(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    window: Option<usize>,
) -> candle_core::Result<Result<Tensor, String>> {
    #[cfg(not(feature = "candle-cuda"))]
    {
        let _ = (q, k, v, scale, window);
        Ok(Err(NO_CUDA.into()))
    }
    #[cfg(feature = "candle-cuda")]
    {
        use candle_core::DType;
        if !q.device().is_cuda() {
            return Ok(Err("the tensors are not on candle's CUDA device".into()));
        }
        if !matches!(q.dtype(), DType::BF16 | DType::F16) {
            return Ok(Err(format!("cuDNN's SDPA takes bf16 or f16, not {:?}", q.dtype())));
        }
        if let Err(e) = super::attention::check_qkv("cuDNN attention", q, k, v) {
            return Ok(Err(e.to_string()));
        }
        let lib = match crate::backend::cuda::attention_lib::AttentionLib::get() {
            Ok(lib) => lib,
            Err(e) => return Ok(Err(e.to_string())),
        };
        use super::attention::head_rows as rows;
        let (q, k, v) = (rows(q)?, rows(k)?, rows(v)?);
        if let Some(why) = on_cuda::refusal(lib, scale as f32, window, [&q, &k, &v])? {
            return Ok(Err(why));
        }
        let op = CudnnAttention { scale: scale as f32, window, lse: OnceLock::new() };
        Ok(Ok(q.apply_op3_arc(&k, &v, std::sync::Arc::new(Box::new(op)))?))
    }
}

/// What the blocks' attention ran on under [`AttentionKernel::Auto`](super::AttentionKernel::Auto)
/// where it asked cuDNN, in words for a run to print after its first step: the shapes cuDNN's
/// fused SDPA took (with its backward's workspace) and those it refused (why: strata's kernel
/// ran them). `None` where cuDNN was asked nothing: on the CPU, without the library, or calls of
/// a KV cache only.
pub fn asked_so_far() -> Option<String> {
    #[cfg(feature = "candle-cuda")]
    {
        on_cuda::asked_so_far()
    }
    #[cfg(not(feature = "candle-cuda"))]
    None
}

/// The op: its parameters, and cuDNN's log-sum-exp once the forward ran.
// (Without candle's CUDA build the forward refuses before it reads the parameters.)
#[cfg_attr(not(feature = "candle-cuda"), allow(dead_code))]
struct CudnnAttention {
    scale: f32,
    window: Option<usize>,
    /// `[batch, heads, q_len]` f32, on the forward's device.
    lse: OnceLock<Tensor>,
}

impl CustomOp3 for CudnnAttention {
    fn name(&self) -> &'static str {
        "strata-cudnn-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!(
            "cuDNN attention runs on candle's CUDA device; on the CPU use fused::attention"
        )
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        lq: &Layout,
        k: &candle_core::CudaStorage,
        lk: &Layout,
        v: &candle_core::CudaStorage,
        lv: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (b, sq, nh, d) = lq.shape().dims4()?;
        let (o, lse) = on_cuda::forward(self.scale, self.window, (q, lq), (k, lk), (v, lv))?;
        let _ = self.lse.set(super::cuda_tensor(lse, (b, nh, sq)));
        Ok((o, Shape::from((b, sq, nh, d))))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        o: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lse = self.lse.get().ok_or_else(|| {
            candle_core::Error::Msg("cuDNN attention: a backward before its forward".into()).bt()
        })?;
        let grad = grad.contiguous()?;
        let (qs, lq) = q.storage_and_layout();
        let (ks, lk) = k.storage_and_layout();
        let (vs, lv) = v.storage_and_layout();
        let (os, lo) = o.storage_and_layout();
        let (dos, ldo) = grad.storage_and_layout();
        let (ls, ll) = lse.storage_and_layout();
        match (&*qs, &*ks, &*vs, &*os, &*dos, &*ls) {
            #[cfg(feature = "candle-cuda")]
            (
                candle_core::Storage::Cuda(qc),
                candle_core::Storage::Cuda(kc),
                candle_core::Storage::Cuda(vc),
                candle_core::Storage::Cuda(oc),
                candle_core::Storage::Cuda(doc),
                candle_core::Storage::Cuda(lc),
            ) => {
                let (dq, dk, dv) = on_cuda::backward(
                    self.scale,
                    self.window,
                    [(qc, lq), (kc, lk), (vc, lv), (oc, lo), (doc, ldo)],
                    (lc, ll),
                )?;
                Ok((
                    Some(super::cuda_tensor(dq, q.shape())),
                    Some(super::cuda_tensor(dk, k.shape())),
                    Some(super::cuda_tensor(dv, v.shape())),
                ))
            }
            _ => {
                let _ = (lq, lk, lv, lo, ldo, ll);
                candle_core::bail!(
                    "cuDNN attention's backward: the tensors are not all on candle's CUDA \
                     device (feature candle-cuda)"
                )
            }
        }
    }
}

/// candle's CUDA storages and layouts to the library's views and shape.
#[cfg(feature = "candle-cuda")]
mod on_cuda {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::CudaStorage;
    use candle_core::{DType, Layout};
    use half::{bf16, f16};

    use std::collections::HashMap;
    use std::sync::OnceLock;

    use crate::backend::cuda::attention_lib::{
        dense_strides, AttentionLib, SdpaDtype, SdpaElem, SdpaShape, ShapeKey, DK, DOUT, DQ, DV, K,
        O, Q, V,
    };

    type Arg<'a> = (&'a CudaStorage, &'a Layout);

    /// Each device's (ordinal) and shape's answer: the shape in words, and the backward's
    /// workspace bytes where cuDNN took it, else why not.
    type Answers = HashMap<(usize, ShapeKey), (String, Result<usize, String>)>;
    static ASKED: OnceLock<parking_lot::Mutex<Answers>> = OnceLock::new();

    /// Why cuDNN does not take attention calls on `q`, `k`, `v` (bf16 or f16, on candle's CUDA
    /// device, their head dimensions contiguous), or `None` when it does, forward and backward;
    /// asked of the library once per shape and device (it builds both graphs then), a refusal
    /// logged once (two threads asking at once about a new shape may both ask and log).
    pub(super) fn refusal(
        lib: &AttentionLib,
        scale: f32,
        window: Option<usize>,
        [q, k, v]: [&candle_core::Tensor; 3],
    ) -> candle_core::Result<Option<String>> {
        let (qs, lq) = q.storage_and_layout();
        let (lk, lv) = (k.layout().clone(), v.layout().clone());
        let candle_core::Storage::Cuda(qc) = &*qs else {
            return Ok(Some("the tensors are not on candle's CUDA device".into()));
        };
        let stream = qc.device().cuda_stream();
        let s = shape(scale, window, [lq, &lk, &lv], q.dtype())?;
        drop(qs);
        let key = (stream.context().ordinal(), s.key());
        let asked = ASKED.get_or_init(Default::default);
        if let Some((_, answer)) = asked.lock().get(&key) {
            return Ok(answer.as_ref().err().cloned());
        }
        // (Outside the map's lock: building cuDNN's graphs takes a while.)
        let answer = lib.supports(&stream, &s).map(|[_, bwd]| bwd).map_err(|e| e.to_string());
        let what = format!(
            "{} × {} heads over {} of {}, {} queries over {} keys{}, {:?}, GPU {}",
            s.b,
            s.nh,
            s.nkv,
            s.d,
            s.sq,
            s.skv,
            s.window.map_or(String::new(), |w| format!(", a window of {w}")),
            s.dtype,
            key.0
        );
        if let Err(why) = &answer {
            tracing::warn!(
                shape = %what,
                why = %why,
                "cuDNN's attention does not take this shape: strata's kernel runs it"
            );
        }
        let refused = answer.as_ref().err().cloned();
        asked.lock().insert(key, (what, answer));
        Ok(refused)
    }

    /// [`super::asked_so_far`]'s words, `None` before any shape was asked.
    pub(super) fn asked_so_far() -> Option<String> {
        let asked = ASKED.get()?.lock();
        if asked.is_empty() {
            return None;
        }
        let mut took = Vec::new();
        let mut refused = Vec::new();
        for (what, answer) in asked.values() {
            match answer {
                Ok(bytes) => took.push(format!(
                    "{what} (backward workspace {:.1} MiB)",
                    *bytes as f64 / (1 << 20) as f64
                )),
                Err(why) => refused.push(format!("{what}: {why}")),
            }
        }
        took.sort();
        refused.sort();
        let mut said = Vec::new();
        if !took.is_empty() {
            said.push(format!("cuDNN's fused SDPA for {}", took.join("; ")));
        }
        if !refused.is_empty() {
            said.push(format!("strata's kernel where cuDNN refused {}", refused.join("; ")));
        }
        Some(said.join("; "))
    }

    /// The shape of a call on `q`, `k`, `v` (any strides, `[b, s, h, d]`), its other tensors
    /// contiguous.
    fn shape(
        scale: f32,
        window: Option<usize>,
        [lq, lk, lv]: [&Layout; 3],
        dtype: DType,
    ) -> candle_core::Result<SdpaShape> {
        let (b, sq, nh, d) = lq.shape().dims4()?;
        let (_, skv, nkv, _) = lk.shape().dims4()?;
        let st = |l: &Layout| -> candle_core::Result<[usize; 4]> {
            <[usize; 4]>::try_from(l.stride()).map_err(|_| {
                candle_core::Error::Msg("cuDNN attention: a tensor of four dimensions".into())
            })
        };
        let (qd, kd) = (dense_strides([b, sq, nh, d]), dense_strides([b, skv, nkv, d]));
        let dtype = match dtype {
            DType::BF16 => SdpaDtype::Bf16,
            DType::F16 => SdpaDtype::F16,
            other => candle_core::bail!(
                "cuDNN attention takes bf16 or f16, not {other:?}: convert with to_dtype, or \
                 use fused::attention"
            ),
        };
        let mut strides = [[0; 4]; 8];
        (strides[Q], strides[K], strides[V]) = (st(lq)?, st(lk)?, st(lv)?);
        (strides[O], strides[DOUT], strides[DQ]) = (qd, qd, qd);
        (strides[DK], strides[DV]) = (kd, kd);
        Ok(SdpaShape { b, sq, skv, nh, nkv, d, strides, scale, causal: true, window, dtype })
    }

    /// The forward: the output `[b, sq, nh, d]` and the log-sum-exp `[b, nh, sq]`.
    pub(super) fn forward(
        scale: f32,
        window: Option<usize>,
        q: Arg,
        k: Arg,
        v: Arg,
    ) -> candle_core::Result<(CudaStorage, CudaStorage)> {
        let s = shape(scale, window, [q.1, k.1, v.1], q.0.dtype())?;
        match s.dtype {
            SdpaDtype::Bf16 => forward_as::<bf16>(&s, q, k, v),
            SdpaDtype::F16 => forward_as::<f16>(&s, q, k, v),
        }
    }

    fn forward_as<T: SdpaElem + candle_core::cuda::CudaDType + cudarc::driver::ValidAsZeroBits>(
        s: &SdpaShape,
        q: Arg,
        k: Arg,
        v: Arg,
    ) -> candle_core::Result<(CudaStorage, CudaStorage)> {
        let lib = AttentionLib::get()?;
        let dev = q.0.device().clone();
        let (qv, kv, vv) = (
            crate::candle::fused::cuda::view::<T>(q.0, q.1)?,
            crate::candle::fused::cuda::view::<T>(k.0, k.1)?,
            crate::candle::fused::cuda::view::<T>(v.0, v.1)?,
        );
        let mut o = crate::candle::fused::cuda::output::<T>(&dev, s.b * s.sq * s.nh * s.d)?;
        let mut lse = crate::candle::fused::cuda::output::<f32>(&dev, s.lse_len())?;
        lib.forward(
            &dev.cuda_stream(),
            s,
            [&qv, &kv, &vv],
            &mut o.as_view_mut(),
            &mut lse.as_view_mut(),
        )?;
        Ok((CudaStorage::wrap_cuda_slice(o, dev.clone()), CudaStorage::wrap_cuda_slice(lse, dev)))
    }

    /// The backward: `dq` (`[b, sq, nh, d]`), `dk` and `dv` (`[b, skv, nkv, d]`). `inputs` are
    /// q, k, v, the output and its gradient (the last two contiguous).
    pub(super) fn backward(
        scale: f32,
        window: Option<usize>,
        inputs: [Arg; 5],
        lse: Arg,
    ) -> candle_core::Result<(CudaStorage, CudaStorage, CudaStorage)> {
        let [q, k, v, _, _] = inputs;
        let s = shape(scale, window, [q.1, k.1, v.1], q.0.dtype())?;
        match s.dtype {
            SdpaDtype::Bf16 => backward_as::<bf16>(&s, inputs, lse),
            SdpaDtype::F16 => backward_as::<f16>(&s, inputs, lse),
        }
    }

    fn backward_as<T: SdpaElem + candle_core::cuda::CudaDType + cudarc::driver::ValidAsZeroBits>(
        s: &SdpaShape,
        [q, k, v, o, dout]: [Arg; 5],
        lse: Arg,
    ) -> candle_core::Result<(CudaStorage, CudaStorage, CudaStorage)> {
        use crate::candle::fused::cuda::{dense, output, view};
        let lib = AttentionLib::get()?;
        let dev = q.0.device().clone();
        let (qv, kv, vv) = (view::<T>(q.0, q.1)?, view::<T>(k.0, k.1)?, view::<T>(v.0, v.1)?);
        let ov = dense::<T>(o.0, o.1, "the attention's output")?;
        let dov = dense::<T>(dout.0, dout.1, "the attention's gradient")?;
        let lv = dense::<f32>(lse.0, lse.1, "the log-sum-exp")?;
        let kv_elems = s.b * s.skv * s.nkv * s.d;
        let mut dq = output::<T>(&dev, s.b * s.sq * s.nh * s.d)?;
        let mut dk = output::<T>(&dev, kv_elems)?;
        let mut dv = output::<T>(&dev, kv_elems)?;
        lib.backward(
            &dev.cuda_stream(),
            s,
            [&qv, &kv, &vv, &ov, &dov],
            &lv,
            [&mut dq.as_view_mut(), &mut dk.as_view_mut(), &mut dv.as_view_mut()],
        )?;
        let wrap = |x| CudaStorage::wrap_cuda_slice(x, dev.clone());
        Ok((wrap(dq), wrap(dk), wrap(dv)))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};

    fn t(shape: (usize, usize, usize, usize)) -> Tensor {
        Tensor::zeros(shape, DType::BF16, &Device::Cpu).unwrap()
    }

    #[test]
    fn on_the_cpu_it_says_where_it_runs() {
        let (q, k) = (t((1, 4, 2, 64)), t((1, 4, 1, 64)));
        let e = super::attention(&q, &k, &k, 0.125, None).unwrap_err().to_string();
        assert!(e.contains("CUDA device") && e.contains("fused::attention"), "{e}");
        #[cfg(not(feature = "candle-cuda"))]
        assert!(super::available().unwrap_err().to_string().contains("candle-cuda"));
    }

    #[test]
    fn shapes_it_cannot_take_are_refused_before_any_device_work() {
        let q = t((1, 4, 3, 64));
        let e = super::attention(&q, &t((1, 4, 2, 64)), &t((1, 4, 2, 64)), 0.125, None);
        assert!(e.unwrap_err().to_string().contains("not a multiple of 2"));
        let e = super::attention(&q, &t((1, 4, 3, 32)), &t((1, 4, 3, 32)), 0.125, None);
        assert!(e.unwrap_err().to_string().contains("share the batch and the head width"));
        let f = Tensor::zeros((1, 4, 3, 64), DType::F32, &Device::Cpu).unwrap();
        let e = super::attention(&q, &f, &f, 0.125, None);
        assert!(e.unwrap_err().to_string().contains("one dtype"));
    }
}
