//! [`LlamaTwin`](crate::candle::LlamaTwin)'s optimizer, resident on candle's device: each
//! parameter's f32 master weights and AdamW moments in one candle tensor beside its weights,
//! updated in place from the step's f32 gradient buffer. On the CPU by `strata::optim`'s own loop
//! ([`cpu_update_scaled`]), on CUDA by its kernel (`cuda/optim.cu`'s `strata_adamw`, which the GPU
//! engines run): the trainer's arithmetic, with nothing crossing to the host.

use candle_core::{CpuStorage, DType as CDType, Device, InplaceOp2, Layout, Tensor};

use crate::compute::optim::{cpu_update_scaled, AdamW, Algorithm, GradSlice};

/// One parameter's state on the device: `[3, n]` f32, the master weights, `exp_avg` and
/// `exp_avg_sq` (rows 0, 1, 2).
pub(super) struct DeviceState {
    state: Tensor,
    n: usize,
}

impl DeviceState {
    /// The state of a parameter whose values are `t` (any dtype): its master weights the values
    /// in f32, its moments zero.
    pub(super) fn new(t: &Tensor) -> candle_core::Result<DeviceState> {
        let n = t.elem_count();
        let master = t.flatten_all()?.to_dtype(CDType::F32)?.reshape((1, n))?;
        let zeros = Tensor::zeros((2, n), CDType::F32, t.device())?;
        Ok(DeviceState { state: Tensor::cat(&[&master, &zeros], 0)?.contiguous()?, n })
    }

    /// The master weights, `[n]` f32 (a view of the state).
    pub(super) fn master(&self) -> candle_core::Result<Tensor> {
        self.state.get(0)
    }

    /// AdamW's step `t` (1-based) of `h` from `grad` (f32, `n` elements, contiguous) times
    /// `scale`, in place; `kernels` are the optimizer's CUDA kernels on a CUDA device.
    pub(super) fn step(
        &self,
        grad: &Tensor,
        h: &AdamW,
        t: u64,
        scale: f32,
        kernels: &Kernels,
    ) -> candle_core::Result<()> {
        if grad.dtype() != CDType::F32 || grad.elem_count() != self.n {
            candle_core::bail!(
                "AdamW on the device: an f32 gradient of {} elements is needed, not {:?} {:?}",
                self.n,
                grad.dtype(),
                grad.dims()
            );
        }
        let op = AdamStep { h: *h, t, scale, n: self.n, kernels };
        self.state.inplace_op2(&grad.flatten_all()?.contiguous()?, &op)
    }
}

/// The optimizer's CUDA kernels for a CUDA device (loaded once per twin), nothing on the CPU.
pub(super) struct Kernels {
    #[cfg(feature = "candle-cuda")]
    cuda: Option<crate::backend::cuda::programs::OptimKernels>,
}

impl Kernels {
    pub(super) fn for_device(device: &Device) -> candle_core::Result<Kernels> {
        match device {
            #[cfg(feature = "candle-cuda")]
            Device::Cuda(d) => {
                let ctx = d.cuda_stream().context().clone();
                let k = crate::backend::cuda::programs::OptimKernels::load(&ctx)?;
                Ok(Kernels { cuda: Some(k) })
            }
            _ => Ok(Kernels {
                #[cfg(feature = "candle-cuda")]
                cuda: None,
            }),
        }
    }
}

struct AdamStep<'a> {
    h: AdamW,
    t: u64,
    scale: f32,
    n: usize,
    #[cfg_attr(not(feature = "candle-cuda"), allow(dead_code))]
    kernels: &'a Kernels,
}

impl InplaceOp2 for AdamStep<'_> {
    fn name(&self) -> &'static str {
        "strata-adamw"
    }

    fn cpu_fwd(
        &self,
        state: &mut CpuStorage,
        ls: &Layout,
        grad: &CpuStorage,
        lg: &Layout,
    ) -> candle_core::Result<()> {
        let (start, _) = ls.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg("AdamW on the device: a contiguous state is needed".into())
        })?;
        let CpuStorage::F32(s) = state else {
            candle_core::bail!("AdamW on the device: f32 state is needed")
        };
        let (gs, ge) = lg.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg("AdamW on the device: a contiguous gradient is needed".into())
        })?;
        let g = &grad.as_slice::<f32>()?[gs..ge];
        let n = self.n;
        let (p, rest) = s[start..start + 3 * n].split_at_mut(n);
        let (m, v) = rest.split_at_mut(n);
        let alg = Algorithm::AdamW(self.h);
        cpu_update_scaled(&alg, self.t, 1, p, m, v, GradSlice::F32(g), self.scale, None)
            .map_err(candle_core::Error::from)
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        state: &mut candle_core::CudaStorage,
        ls: &Layout,
        grad: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> candle_core::Result<()> {
        use crate::backend::cuda::programs::GradView;
        use candle_core::backend::BackendStorage;
        let Some(k) = &self.kernels.cuda else {
            candle_core::bail!("AdamW on the device: no CUDA kernels were loaded for it")
        };
        let stream = grad.device().cuda_stream();
        let (start, _) = ls.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg("AdamW on the device: a contiguous state is needed".into())
        })?;
        let (gs, ge) = lg.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg("AdamW on the device: a contiguous gradient is needed".into())
        })?;
        let out_of = |what: &str| {
            candle_core::Error::Msg(format!("AdamW on the device: {what} past its buffer")).bt()
        };
        let g =
            grad.as_cuda_slice::<f32>()?.try_slice(gs..ge).ok_or_else(|| out_of("a gradient"))?;
        let n = self.n;
        let mut s = state
            .as_cuda_slice_mut::<f32>()?
            .try_slice_mut(start..start + 3 * n)
            .ok_or_else(|| out_of("a state"))?;
        let (mut p, mut rest) = s.split_at_mut(n);
        let (mut m, mut v) = rest.split_at_mut(n);
        let args = crate::compute::optim::adam_args(&self.h, self.t);
        k.adamw(&stream, [&mut p, &mut m, &mut v], GradView::F32(&g), self.scale, None, args)
            .map_err(candle_core::Error::from)
    }
}
