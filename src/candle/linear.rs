//! A block's weights as its forward reads them ([`Weights`]) and its linear layers: `x·Wᵀ`
//! ([`linear`]), plus a LoRA adapter's share ([`Adapter`]), with no gradient computed for a
//! frozen weight ([`frozen_linear`]). What a [`Block`](super::block::Block) and the built-in Llama
//! block ([`super::llama`]) both use; `strata::candle::block` re-exports it.

use std::collections::HashMap;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Shape, Tensor};

/// A LoRA adapter on one linear layer: `y = x·Wᵀ + scale · (x·Aᵀ)·Bᵀ` with `A` of `[rank, in]`
/// and `B` of `[out, rank]` (PEFT's `lora_A` and `lora_B`), computed as PEFT computes it: the
/// input cast to the adapter's dtype, `B(A(x))` times the scale, cast back to the base's
/// output dtype and added.
#[derive(Clone, Debug)]
pub struct Adapter {
    /// `lora_A`, `[rank, in]`.
    pub a: Tensor,
    /// `lora_B`, `[out, rank]`.
    pub b: Tensor,
    /// `alpha / rank` (or `alpha / sqrt(rank)` for rsLoRA).
    pub scale: f64,
}

impl Adapter {
    /// `y` (the base layer's output for `x`) plus the adapter's share.
    pub fn add_to(&self, y: Tensor, x: &Tensor) -> candle_core::Result<Tensor> {
        let xa = x.to_dtype(self.a.dtype())?;
        let d = (plain_linear(&plain_linear(&xa, &self.a)?, &self.b)? * self.scale)?;
        y.add(&d.to_dtype(y.dtype())?)
    }
}

/// A block's weights as its forward reads them: candle tensors by their names within the block
/// (`self_attn.q_proj.weight`), and the LoRA adapters of the linears that have one.
#[derive(Clone, Debug, Default)]
pub struct Weights {
    tensors: HashMap<String, Tensor>,
    adapters: HashMap<String, Adapter>,
}

impl Weights {
    /// Weights of these tensors, without adapters.
    pub fn new(tensors: HashMap<String, Tensor>) -> Weights {
        Weights { tensors, adapters: HashMap::new() }
    }

    /// Adds an adapter on the linear whose weight is `name`.
    pub fn with_adapter(mut self, name: impl Into<String>, adapter: Adapter) -> Weights {
        self.adapters.insert(name.into(), adapter);
        self
    }

    /// The tensor `name`; candle's `CannotFindTensor` naming it when the block has none.
    pub fn get(&self, name: &str) -> candle_core::Result<&Tensor> {
        self.tensors
            .get(name)
            .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.to_string() }.bt())
    }

    /// The adapter on the linear whose weight is `name`, if the run has one there.
    pub fn adapter(&self, name: &str) -> Option<&Adapter> {
        self.adapters.get(name)
    }

    /// The adapters, by their linear's weight name.
    pub fn adapters(&self) -> &HashMap<String, Adapter> {
        &self.adapters
    }

    /// The linear layer whose weight (`[out, in]`, PyTorch's `nn.Linear` layout) is `name`:
    /// `x·Wᵀ` for `x` of `[.., in]`, plus its adapter's share when it has one. A weight that
    /// is not being trained gets no gradient ([`frozen_linear`]); `x` still does.
    pub fn linear(&self, name: &str, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = linear(x, self.get(name)?)?;
        match self.adapters.get(name) {
            Some(a) => a.add_to(y, x),
            None => Ok(y),
        }
    }
}

/// `x·wᵀ` for `x` of `[.., in]` and a weight of `[out, in]`: [`frozen_linear`] when `x`
/// carries a gradient and `w` cannot get one, else candle's matrix product.
pub fn linear(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    if x.track_op() && !w.track_op() {
        return frozen_linear(x, w);
    }
    plain_linear(x, w)
}

/// `x·wᵀ` in candle ops, over `x`'s last dimension.
fn plain_linear(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let (rows, shape) = as_rows(x, w)?;
    rows.matmul(&w.t()?)?.reshape(shape)
}

/// `x` as a matrix of its last dimension's rows, and the shape `x·wᵀ` takes back (`x`'s, its
/// last dimension `w`'s rows).
fn as_rows(x: &Tensor, w: &Tensor) -> candle_core::Result<(Tensor, Vec<usize>)> {
    let dims = x.dims();
    let i = *dims.last().unwrap_or(&0);
    let rows = x.elem_count() / i.max(1);
    let mut shape = dims.to_vec();
    if let Some(last) = shape.last_mut() {
        *last = w.dims2()?.0;
    }
    Ok((x.reshape((rows, i))?, shape))
}

/// `x·wᵀ` whose backward gives `x` its gradient and `w` none: candle's matrix product
/// computes both of its operands' gradients whatever they are (a frozen weight's full
/// `[out, in]` gradient, thrown away), so a frozen base (LoRA) would cost a full fine-tune's
/// backward. The forward is candle's own matrix product on the same operands, and the input's
/// gradient is candle's own (`grad · w`): the same bits as [`linear`] gives without it.
pub fn frozen_linear(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let (rows, shape) = as_rows(x, w)?;
    rows.apply_op2_arc(w, std::sync::Arc::new(Box::new(FrozenMatmul)))?.reshape(shape)
}

/// [`frozen_linear`]'s op: `lhs · rhsᵀ`, the gradient to `lhs` only.
struct FrozenMatmul;

impl FrozenMatmul {
    fn dims(l1: &Layout, l2: &Layout) -> candle_core::Result<(usize, usize, usize, Layout)> {
        let (m, k) = l1.shape().dims2()?;
        let (n, k2) = l2.shape().dims2()?;
        if k != k2 {
            candle_core::bail!("a frozen linear of {m}x{k} inputs and a {n}x{k2} weight");
        }
        Ok((m, n, k, l2.transpose(0, 1)?))
    }
}

impl candle_core::CustomOp2 for FrozenMatmul {
    fn name(&self) -> &'static str {
        "frozen-linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, n, k, t) = Self::dims(l1, l2)?;
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
        let (m, n, k, t) = Self::dims(l1, l2)?;
        Ok((s1.matmul(s2, (1, m, n, k), l1, &t)?, Shape::from((m, n))))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(grad.matmul(w)?), None))
    }
}
