//! A block's weights as its forward reads them ([`Weights`]) and its linear layers: `x·Wᵀ`
//! ([`linear`]), plus a LoRA adapter's share ([`Adapter`]), with no gradient computed for a
//! frozen weight ([`frozen_linear`]) and, for a trained weight given an f32 buffer
//! ([`GradBuffer`]), its gradient summed into that buffer by the backward itself
//! ([`fused::accumulating_linear`](super::fused::accumulating_linear)). What a
//! [`Block`](super::block::Block) and the built-in Llama block ([`super::llama`]) both use;
//! `strata::candle::block` re-exports it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::Tensor;

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

/// A linear layer's weight gradient buffer: an f32 tensor of the weight's shape (`[out, in]`,
/// contiguous) that the backward of each forward through [`GradBuffer::linear`] adds `dYᵀ·X`
/// into, in place ([`fused::accumulating_linear`](super::fused::accumulating_linear)): the
/// weight needs no `Var`, and no micro-batch's gradient is made on its own. Clones share the
/// buffer and the count of forwards ([`GradBuffer::uses`]), which tells a trainer that a block
/// applied the weight through it (a weight used otherwise would get no gradient).
#[derive(Clone, Debug)]
pub struct GradBuffer {
    sum: Tensor,
    uses: Arc<AtomicUsize>,
}

impl GradBuffer {
    /// A buffer of zeros for a weight of `[out, in]`, on `device`.
    pub fn zeros(
        (out, inp): (usize, usize),
        device: &candle_core::Device,
    ) -> candle_core::Result<GradBuffer> {
        GradBuffer::new(Tensor::zeros((out, inp), candle_core::DType::F32, device)?)
    }

    /// A buffer over `sum`, which the backward adds into (it must be a contiguous f32 matrix:
    /// an error otherwise).
    pub fn new(sum: Tensor) -> candle_core::Result<GradBuffer> {
        if sum.dtype() != candle_core::DType::F32 || !sum.is_contiguous() || sum.rank() != 2 {
            candle_core::bail!(
                "a gradient buffer must be a contiguous f32 matrix, not {:?} of {:?}",
                sum.dtype(),
                sum.dims()
            );
        }
        Ok(GradBuffer { sum, uses: Arc::new(AtomicUsize::new(0)) })
    }

    /// The f32 sum so far.
    pub fn tensor(&self) -> &Tensor {
        &self.sum
    }

    /// How many forwards applied the weight through this buffer ([`GradBuffer::linear`]).
    pub fn uses(&self) -> usize {
        self.uses.load(Ordering::Relaxed)
    }

    /// `x·wᵀ` for `x` of `[.., in]`, its backward adding `w`'s gradient into the buffer
    /// ([`fused::accumulating_linear`](super::fused::accumulating_linear): `x` must be in
    /// candle's autograd graph).
    pub fn linear(&self, x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
        let y = super::fused::accumulating_linear(x, w, &self.sum)?;
        self.uses.fetch_add(1, Ordering::Relaxed);
        Ok(y)
    }
}

/// A block's weights as its forward reads them: candle tensors by their names within the block
/// (`self_attn.q_proj.weight`), the LoRA adapters of the linears that have one, and the
/// gradient buffers of the trained linear weights that have one.
#[derive(Clone, Debug, Default)]
pub struct Weights {
    tensors: HashMap<String, Tensor>,
    adapters: HashMap<String, Adapter>,
    grads: HashMap<String, GradBuffer>,
}

impl Weights {
    /// Weights of these tensors, without adapters or gradient buffers.
    pub fn new(tensors: HashMap<String, Tensor>) -> Weights {
        Weights { tensors, adapters: HashMap::new(), grads: HashMap::new() }
    }

    /// Gives the linear whose weight is `name` a gradient buffer: [`Weights::linear`] then
    /// sums the weight's gradient into it in the backward ([`GradBuffer::linear`]).
    pub fn with_grad_buffer(mut self, name: impl Into<String>, buf: GradBuffer) -> Weights {
        self.grads.insert(name.into(), buf);
        self
    }

    /// The gradient buffer of the linear whose weight is `name`, if it has one.
    pub fn grad_buffer(&self, name: &str) -> Option<&GradBuffer> {
        self.grads.get(name)
    }

    /// The gradient buffers, by their linear's weight name.
    pub fn grad_buffers(&self) -> &HashMap<String, GradBuffer> {
        &self.grads
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
    /// `x·Wᵀ` for `x` of `[.., in]`, plus its adapter's share when it has one. A weight with a
    /// gradient buffer ([`Weights::with_grad_buffer`]) has its gradient added into it by the
    /// backward ([`GradBuffer::linear`]); one that is not being trained gets no gradient
    /// ([`frozen_linear`]); `x` gets its gradient either way.
    pub fn linear(&self, name: &str, x: &Tensor) -> candle_core::Result<Tensor> {
        let w = self.get(name)?;
        let y = match self.grads.get(name) {
            Some(g) => g.linear(x, w)?,
            None => linear(x, w)?,
        };
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
    let op = super::fused::RowsMatmul { dw: None, what: "a frozen linear of" };
    rows.apply_op2_arc(w, std::sync::Arc::new(Box::new(op)))?.reshape(shape)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    #[test]
    fn a_weight_with_a_buffer_sums_its_gradient_there_and_the_others_go_on_as_before() {
        let dev = Device::Cpu;
        let w = Tensor::new(&[[1f32, 2.0], [3.0, 4.0]], &dev).unwrap();
        let tensors = HashMap::from([("a".to_string(), w.clone()), ("b".to_string(), w)]);
        let buf = GradBuffer::zeros((2, 2), &dev).unwrap();
        let weights = Weights::new(tensors).with_grad_buffer("a", buf.clone());
        assert!(weights.grad_buffer("a").is_some() && weights.grad_buffer("b").is_none());
        let x = Var::new(&[[[1f32, 1.0]]], &dev).unwrap();
        let ya = weights.linear("a", x.as_tensor()).unwrap();
        let yb = weights.linear("b", x.as_tensor()).unwrap();
        assert_eq!(ya.to_vec3::<f32>().unwrap(), yb.to_vec3::<f32>().unwrap());
        assert_eq!((buf.uses(), weights.grad_buffer("a").unwrap().uses()), (1, 1));
        let g = ya.add(&yb).unwrap().sum_all().unwrap().backward().unwrap();
        // x's gradient from both linears; a's weight gradient in its buffer.
        assert_eq!(g.get(&x).unwrap().to_vec3::<f32>().unwrap(), [[[8.0, 12.0]]]);
        assert_eq!(buf.tensor().to_vec2::<f32>().unwrap(), [[1.0, 1.0], [1.0, 1.0]]);
        for bad in [
            Tensor::zeros((2, 2), DType::BF16, &dev).unwrap(),
            Tensor::zeros(4, DType::F32, &dev).unwrap(),
            Tensor::zeros((2, 2), DType::F32, &dev).unwrap().t().unwrap(),
        ] {
            assert!(GradBuffer::new(bad).is_err());
        }
    }
}
