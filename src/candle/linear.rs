//! A block's weights as its forward reads them ([`Weights`]) and its linear layers: `x·Wᵀ`
//! ([`linear`]), plus a LoRA adapter's share ([`Adapter`]), with no gradient computed for a
//! frozen weight ([`frozen_linear`]) and, for a trained weight given an f32 buffer
//! ([`GradBuffer`]), its gradient summed into that buffer by the backward itself
//! ([`fused::accumulating_linear`](super::fused::accumulating_linear)); and linears that read
//! one input applied as one GEMM over their weights joined by rows ([`JointLinear`]). What a
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
    /// A buffer made by [`GradBuffer::split`]: the buffer it is rows of, and its first row.
    whole: Option<(Tensor, usize)>,
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
        Ok(GradBuffer { sum, uses: Arc::new(AtomicUsize::new(0)), whole: None })
    }

    /// Buffers over consecutive rows of this one, `outs[0]` rows, then `outs[1]`, ... (the
    /// rows must add up to this buffer's): the gradients of weights that a [`JointLinear`]
    /// applies as one GEMM, each part a row range of the joint weight's gradient (contiguous:
    /// no copy). Each part counts its own uses; the joint's backward sums into this buffer
    /// once, and every part sees its rows of the sum.
    ///
    /// ```
    /// use candle_core::Device;
    /// use strata::candle::block::GradBuffer;
    /// let whole = GradBuffer::zeros((5, 3), &Device::Cpu)?;
    /// let parts = whole.split(&[2, 3])?;
    /// assert_eq!(parts[1].tensor().dims(), [3, 3]);
    /// assert!(whole.split(&[2, 2]).is_err());
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn split(&self, outs: &[usize]) -> candle_core::Result<Vec<GradBuffer>> {
        let rows = self.sum.dims2()?.0;
        if outs.iter().sum::<usize>() != rows {
            candle_core::bail!(
                "a gradient buffer of {rows} rows split into parts of {outs:?} rows: the parts \
                 must add up to the buffer's rows"
            );
        }
        let mut first = 0;
        let mut parts = Vec::with_capacity(outs.len());
        for &o in outs {
            let sum = self.sum.narrow(0, first, o)?;
            let uses = Arc::new(AtomicUsize::new(0));
            parts.push(GradBuffer { sum, uses, whole: Some((self.sum.clone(), first)) });
            first += o;
        }
        Ok(parts)
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
        self.counted();
        Ok(y)
    }

    /// Counts a forward that applied the weight (through a [`JointLinear`]).
    fn counted(&self) {
        self.uses.fetch_add(1, Ordering::Relaxed);
    }
}

/// Linears that read one input, applied as one GEMM over their weights joined by rows: for
/// weights `w_1` (`[out_1, in]`), `w_2`, ... the joint weight `[w_1; w_2; ..]` (`[Σ out_i,
/// in]`, one concatenation along the rows of the row-major weights: a copy on the device,
/// a memcpy on the CPU, made once when a block's weights are staged), whose output's columns
/// `out_1`, then `out_2`, ... are each linear's output. A Llama block's q, k and v projections
/// are one (one GEMM where there were three; in the backward one `dX` GEMM and one `dW` GEMM
/// where there were three of each), its gate and up projections another (one where there were
/// two). The weights' names, the store's tensors and the files stay as they are: only the
/// compute reads the joint copy.
///
/// With gradient buffers ([`GradBuffer::split`] of one buffer, in the parts' order), the
/// backward sums the joint weight's gradient into that one f32 buffer
/// ([`fused::accumulating_linear`](super::fused::accumulating_linear)), so each part's buffer
/// holds its own weight's gradient; without, no weight gradient is computed (a frozen base).
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use candle_core::{Device, Tensor, Var};
/// use strata::candle::block::{GradBuffer, JointLinear};
///
/// let dev = Device::Cpu;
/// let a = Tensor::new(&[[1f32, 0.0], [0.0, 1.0]], &dev)?; // [2, 2]
/// let b = Tensor::new(&[[1f32, 1.0]], &dev)?; // [1, 2]
/// let bufs = GradBuffer::zeros((3, 2), &dev)?.split(&[2, 1])?;
/// let j = JointLinear::new(&[("a", &a, Some(&bufs[0])), ("b", &b, Some(&bufs[1]))])?
///     .expect("joinable");
/// let x = Var::new(&[[2f32, 3.0]], &dev)?;
/// let ys = j.apply(x.as_tensor())?; // one GEMM, its output split by columns
/// assert_eq!((ys[0].to_vec2::<f32>()?, ys[1].to_vec2::<f32>()?), (vec![vec![2.0, 3.0]], vec![vec![5.0]]));
/// ys[0].sum_all()?.add(&ys[1].sum_all()?)?.backward()?;
/// assert_eq!(bufs[1].tensor().to_vec2::<f32>()?, [[2.0, 3.0]]); // b's gradient, in its rows
/// // Weights of two dtypes are not joined: the caller applies them one by one.
/// let c = b.to_dtype(candle_core::DType::BF16)?;
/// assert!(JointLinear::new(&[("a", &a, None), ("c", &c, None)])?.is_none());
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct JointLinear {
    names: Vec<String>,
    outs: Vec<usize>,
    weight: Tensor,
    /// The joint gradient buffer and the parts' buffers (rows of it), when the weights train.
    grads: Option<(Tensor, Vec<GradBuffer>)>,
}

impl JointLinear {
    /// The linears `parts` (each its weight's name, its weight `[out, in]` and its gradient
    /// buffer if it has one) as one, or `None` where they cannot be joined, and the caller
    /// applies them one by one (the same values; see [`Weights::linears`]): fewer than two;
    /// a weight that is not a matrix, or weights of different input widths, dtypes or devices;
    /// a weight in candle's autograd graph (a `Var`: its gradient comes from autograd, which a
    /// joined copy would cut off); or gradient buffers on some of them only, or buffers that are
    /// not the consecutive parts of one buffer ([`GradBuffer::split`] in the same order). An
    /// error only when the joint weight cannot be made (memory).
    pub fn new(
        parts: &[(&str, &Tensor, Option<&GradBuffer>)],
    ) -> candle_core::Result<Option<JointLinear>> {
        Self::new_stacked(parts, None)
    }

    /// [`JointLinear::new`], its weight `stacked` where that holds the parts' rows in order and
    /// the parts are its row ranges (views of its memory, as [`Layers::fetch_joined`] hands them
    /// over: checked), instead of a copy of the parts concatenated.
    ///
    /// [`Layers::fetch_joined`]: crate::candle::Layers::fetch_joined
    pub fn new_stacked(
        parts: &[(&str, &Tensor, Option<&GradBuffer>)],
        stacked: Option<&Tensor>,
    ) -> candle_core::Result<Option<JointLinear>> {
        let Some((_, first, _)) = parts.first() else { return Ok(None) };
        if parts.len() < 2 {
            return Ok(None);
        }
        let Ok((_, inp)) = first.dims2() else { return Ok(None) };
        let mut outs = Vec::with_capacity(parts.len());
        for (_, w, _) in parts {
            match w.dims2() {
                Ok((o, i))
                    if i == inp
                        && w.dtype() == first.dtype()
                        && w.device().same_device(first.device())
                        && !w.track_op() =>
                {
                    outs.push(o)
                }
                _ => return Ok(None),
            }
        }
        let Some(grads) = joint_grads(parts, &outs) else { return Ok(None) };
        let ws: Vec<&Tensor> = parts.iter().map(|(_, w, _)| *w).collect();
        let weight = match stacked {
            Some(s) if rows_of(s, &ws, inp) => s.clone(),
            _ => Tensor::cat(&ws, 0)?,
        };
        Ok(Some(JointLinear {
            names: parts.iter().map(|(n, _, _)| n.to_string()).collect(),
            outs,
            weight,
            grads,
        }))
    }

    /// The joined linears' weight names, in order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Each part's output width (its weight's rows), in order.
    pub fn outs(&self) -> &[usize] {
        &self.outs
    }

    /// The joint weight, `[Σ out, in]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// Whether the backward sums the weights' gradients into buffers.
    pub fn has_grads(&self) -> bool {
        self.grads.is_some()
    }

    /// `x·Wᵀ` with the joint weight, `[.., Σ out]`: one GEMM, its backward one `dX` GEMM and,
    /// with buffers, one `dW` GEMM into the joint buffer (`x` must then be in candle's
    /// autograd graph). Each part counts the use ([`GradBuffer::uses`]).
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match &self.grads {
            Some((sum, parts)) => {
                let y = super::fused::accumulating_linear(x, &self.weight, sum)?;
                parts.iter().for_each(GradBuffer::counted);
                Ok(y)
            }
            None => linear(x, &self.weight),
        }
    }

    /// [`JointLinear::forward`] split by columns: each part's output, `[.., out_i]`, a view of
    /// the joint output (strided: an op that needs contiguous values copies it).
    pub fn apply(&self, x: &Tensor) -> candle_core::Result<Vec<Tensor>> {
        let y = self.forward(x)?;
        let last = y.rank().saturating_sub(1);
        let mut first = 0;
        let mut out = Vec::with_capacity(self.outs.len());
        for &o in &self.outs {
            out.push(y.narrow(last, first, o)?);
            first += o;
        }
        Ok(out)
    }

    /// The same joint without gradient buffers and outside any graph (a forward with no
    /// backward).
    pub fn detached(&self) -> JointLinear {
        JointLinear { weight: self.weight.detach(), grads: None, ..self.clone() }
    }
}

/// Whether `parts` (each `[rows, cols]`) are, in order, the consecutive row ranges of the
/// contiguous `[Σ rows, cols]` matrix `stacked`: views of its storage, starting where it starts.
fn rows_of(stacked: &Tensor, parts: &[&Tensor], cols: usize) -> bool {
    // Where a tensor's elements start: its storage (compared by address, never read through)
    // and its offset there; each storage lock released before the next is taken.
    let at = |t: &Tensor| {
        let (storage, layout) = t.storage_and_layout();
        let start = layout.contiguous_offsets()?.0;
        Some((&*storage as *const candle_core::Storage as usize, start))
    };
    let rows: usize = parts.iter().map(|p| p.dims()[0]).sum();
    let Some((home, mut next)) = at(stacked) else { return false };
    if stacked.dims() != [rows, cols] || stacked.track_op() {
        return false;
    }
    parts.iter().all(|p| {
        let here = at(p) == Some((home, next));
        next += p.elem_count();
        here && p.dtype() == stacked.dtype()
    })
}

/// The joint gradient buffer of `parts` (of `outs` rows each): `Some(None)` when none has a
/// buffer, `Some(Some(..))` when the buffers are the consecutive parts of one, `None` otherwise.
#[allow(clippy::type_complexity)]
fn joint_grads(
    parts: &[(&str, &Tensor, Option<&GradBuffer>)],
    outs: &[usize],
) -> Option<Option<(Tensor, Vec<GradBuffer>)>> {
    let bufs: Vec<&GradBuffer> = parts.iter().filter_map(|(_, _, g)| *g).collect();
    if bufs.is_empty() {
        return Some(None);
    }
    if bufs.len() != parts.len() {
        return None;
    }
    let (whole, _) = bufs[0].whole.as_ref()?;
    let mut first = 0;
    for (g, &o) in bufs.iter().zip(outs) {
        match &g.whole {
            Some((w, f)) if w.id() == whole.id() && *f == first && g.sum.dims()[0] == o => {}
            _ => return None,
        }
        first += o;
    }
    (whole.dims()[0] == first).then(|| Some((whole.clone(), bufs.into_iter().cloned().collect())))
}

/// A block's weights as its forward reads them: candle tensors by their names within the block
/// (`self_attn.q_proj.weight`), the LoRA adapters of the linears that have one, and the
/// gradient buffers of the trained linear weights that have one.
#[derive(Clone, Debug, Default)]
pub struct Weights {
    tensors: HashMap<String, Tensor>,
    adapters: HashMap<String, Adapter>,
    grads: HashMap<String, GradBuffer>,
    joints: Vec<JointLinear>,
}

impl Weights {
    /// Weights of these tensors, without adapters, gradient buffers or joints.
    pub fn new(tensors: HashMap<String, Tensor>) -> Weights {
        Weights { tensors, ..Weights::default() }
    }

    /// Gives the linear whose weight is `name` a gradient buffer: [`Weights::linear`] then
    /// sums the weight's gradient into it in the backward ([`GradBuffer::linear`]). A joint
    /// ([`Weights::join`]) made before, of that weight, is dropped: join after the buffers.
    pub fn with_grad_buffer(mut self, name: impl Into<String>, buf: GradBuffer) -> Weights {
        let name = name.into();
        self.joints.retain(|j| !j.names.contains(&name));
        self.grads.insert(name, buf);
        self
    }

    /// Joins the linears whose weights are `names` ([`JointLinear`], with their gradient
    /// buffers), so that [`Weights::linears`] of those names runs one GEMM; where they cannot
    /// be joined ([`JointLinear::new`] says when), leaves them apart ([`Weights::joint`] tells
    /// which). An error for a name the block does not have, or when the joint weight cannot be
    /// made.
    pub fn join(self, names: &[&str]) -> candle_core::Result<Weights> {
        self.join_stacked(names, None)
    }

    /// [`Weights::join`], the joint weight being `stacked` where the weights `names` are its
    /// row ranges ([`JointLinear::new_stacked`]: a layer fetched by
    /// [`Layers::fetch_joined`](crate::candle::Layers::fetch_joined)), not a new copy.
    pub fn join_stacked(
        mut self,
        names: &[&str],
        stacked: Option<&Tensor>,
    ) -> candle_core::Result<Weights> {
        let mut parts = Vec::with_capacity(names.len());
        for n in names {
            parts.push((*n, self.get(n)?, self.grads.get(*n)));
        }
        if let Some(j) = JointLinear::new_stacked(&parts, stacked)? {
            self.joints.retain(|o| !o.names.iter().any(|n| j.names.contains(n)));
            self.joints.push(j);
        }
        Ok(self)
    }

    /// The joint of exactly the linears `names`, in that order, when [`Weights::join`] made one.
    pub fn joint(&self, names: &[&str]) -> Option<&JointLinear> {
        self.joints.iter().find(|j| j.names.iter().map(String::as_str).eq(names.iter().copied()))
    }

    /// The joints ([`Weights::join`]).
    pub fn joints(&self) -> &[JointLinear] {
        &self.joints
    }

    /// These weights for a forward with no backward: every tensor detached from candle's
    /// graph, no gradient buffers, the joints kept (detached).
    pub fn detached(&self) -> Weights {
        let detach = |m: &HashMap<String, Tensor>| {
            m.iter().map(|(n, t)| (n.clone(), t.detach())).collect::<HashMap<_, _>>()
        };
        Weights {
            tensors: detach(&self.tensors),
            adapters: self
                .adapters
                .iter()
                .map(|(n, a)| (n.clone(), Adapter { a: a.a.detach(), b: a.b.detach(), ..*a }))
                .collect(),
            grads: HashMap::new(),
            joints: self.joints.iter().map(JointLinear::detached).collect(),
        }
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

    /// The linears whose weights are `names`, all of the same `x`: one GEMM over their joined
    /// weights when [`Weights::join`] joined exactly these, its output split by columns (strided
    /// views), else [`Weights::linear`] of each. Either way each output gets its adapter's share
    /// and each trained weight its gradient.
    pub fn linears(&self, names: &[&str], x: &Tensor) -> candle_core::Result<Vec<Tensor>> {
        let Some(j) = self.joint(names) else {
            return names.iter().map(|n| self.linear(n, x)).collect();
        };
        let ys = j.apply(x)?;
        names
            .iter()
            .zip(ys)
            .map(|(n, y)| match self.adapters.get(*n) {
                Some(a) => a.add_to(y, x),
                None => Ok(y),
            })
            .collect()
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
    fn a_stacked_weight_is_taken_only_when_the_parts_are_its_rows() {
        let dev = Device::Cpu;
        let stacked = Tensor::arange(0f32, 12.0, &dev).unwrap().reshape((6, 2)).unwrap();
        let (q, kv) = (stacked.narrow(0, 0, 4).unwrap(), stacked.narrow(0, 4, 2).unwrap());
        let parts = [("q", &q, None), ("kv", &kv, None)];
        let j = JointLinear::new_stacked(&parts, Some(&stacked)).unwrap().unwrap();
        assert!(rows_of(j.weight(), &[&q, &kv], 2), "the stacked tensor itself, no copy");
        assert_eq!(j.outs(), [4, 2]);
        // Not its rows: the parts' values in another tensor, the parts in another order, a part
        // that is not a view of it; each time the parts concatenated, the same values.
        let copy = stacked.copy().unwrap();
        let other = kv.copy().unwrap();
        for (parts, s) in [
            ([("q", &q, None), ("kv", &kv, None)], &copy),
            ([("kv", &kv, None), ("q", &q, None)], &stacked),
            ([("q", &q, None), ("kv", &other, None)], &stacked),
        ] {
            let j = JointLinear::new_stacked(&parts, Some(s)).unwrap().unwrap();
            let ws: Vec<&Tensor> = parts.iter().map(|(_, w, _)| *w).collect();
            assert!(!rows_of(s, &ws, 2) && !rows_of(j.weight(), &[&q, &kv], 2));
            let cat = Tensor::cat(&ws, 0).unwrap().to_vec2::<f32>().unwrap();
            assert_eq!(j.weight().to_vec2::<f32>().unwrap(), cat);
        }
        // A stacked tensor that is itself a view starting past its storage's first element.
        let big = Tensor::arange(0f32, 16.0, &dev).unwrap().reshape((8, 2)).unwrap();
        let inner = big.narrow(0, 1, 6).unwrap();
        let (a, b) = (inner.narrow(0, 0, 4).unwrap(), inner.narrow(0, 4, 2).unwrap());
        assert!(rows_of(&inner, &[&a, &b], 2));
        assert!(!rows_of(&inner, &[&big.narrow(0, 0, 4).unwrap(), &b], 2));
        // A stacked tensor of the wrong shape is not taken either.
        let wide = Tensor::zeros((6, 3), DType::F32, &dev).unwrap();
        let j = JointLinear::new_stacked(&parts, Some(&wide)).unwrap().unwrap();
        assert_eq!(j.weight().dims(), [6, 2]);
    }

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

    /// A tiny generator (xorshift), so that these tests need nothing from the modules above.
    struct Rng(u64);

    /// Uniform values in [-1, 1) of `shape`.
    fn uniform(rng: &mut Rng, shape: &[usize]) -> Tensor {
        let mut next = || {
            rng.0 ^= rng.0 << 13;
            rng.0 ^= rng.0 >> 7;
            rng.0 ^= rng.0 << 17;
            (rng.0 >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        };
        let v: Vec<f32> = (0..shape.iter().product()).map(|_| next()).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// The largest `|a − b|` over the largest `|b|`.
    fn rel(a: &Tensor, b: &Tensor) -> f32 {
        let (a, b) = (a.flatten_all().unwrap(), b.flatten_all().unwrap());
        let top = b.abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
        a.sub(&b).unwrap().abs().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap() / top
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        let v = t.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        v.into_iter().map(f32::to_bits).collect()
    }

    /// `(outputs, dx, weight gradients)` of `sum(Σ y_i · r_i)` for the linears `outs` of one
    /// `x`: joined (one GEMM, one buffer split by rows) or apart (a GEMM and a buffer each).
    fn run(
        x: &Tensor,
        ws: &[Tensor],
        rs: &[Tensor],
        joined: bool,
    ) -> (Vec<Tensor>, Tensor, Vec<Tensor>) {
        let dev = Device::Cpu;
        let names: Vec<String> = (0..ws.len()).map(|i| format!("w{i}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let inp = ws[0].dims2().unwrap().1;
        let outs: Vec<usize> = ws.iter().map(|w| w.dims2().unwrap().0).collect();
        let bufs = match joined {
            true => {
                GradBuffer::zeros((outs.iter().sum(), inp), &dev).unwrap().split(&outs).unwrap()
            }
            false => outs.iter().map(|&o| GradBuffer::zeros((o, inp), &dev).unwrap()).collect(),
        };
        let tensors = names.iter().zip(ws).map(|(n, w)| (n.to_string(), w.clone())).collect();
        let mut w = Weights::new(tensors);
        for (n, b) in names.iter().zip(&bufs) {
            w = w.with_grad_buffer(*n, b.clone());
        }
        let w = w.join(&names).unwrap();
        assert_eq!(w.joint(&names).is_some(), joined, "joined when the buffers are one's parts");
        let xv = Var::from_tensor(x).unwrap();
        let ys = w.linears(&names, xv.as_tensor()).unwrap();
        let mut loss = Tensor::zeros((), DType::F32, &dev).unwrap();
        for (y, r) in ys.iter().zip(rs) {
            loss = loss.add(&y.mul(r).unwrap().sum_all().unwrap()).unwrap();
        }
        let g = loss.backward().unwrap();
        assert!(bufs.iter().all(|b| b.uses() == 1), "every part counts its use");
        (ys, g.get(&xv).unwrap().clone(), bufs.iter().map(|b| b.tensor().clone()).collect())
    }

    #[test]
    fn joined_linears_give_the_separate_outputs_and_each_weight_its_gradient_within_1e6() {
        let mut rng = Rng(41);
        // Widths of a Llama block's q/k/v (grouped) and gate/up; one row (a token) and many.
        for (rows, inp, outs) in [
            (1, 16, vec![16, 8, 8]),
            (7, 32, vec![32, 16, 16]),
            (74, 96, vec![96, 32, 32]),
            (40, 64, vec![176, 176]),
        ] {
            let x = uniform(&mut rng, &[1, rows, inp]);
            let ws: Vec<Tensor> = outs.iter().map(|&o| uniform(&mut rng, &[o, inp])).collect();
            let rs: Vec<Tensor> = outs.iter().map(|&o| uniform(&mut rng, &[1, rows, o])).collect();
            let (jy, jdx, jdw) = run(&x, &ws, &rs, true);
            let (sy, sdx, sdw) = run(&x, &ws, &rs, false);
            // Each output and each weight's gradient is the same sum over the same values as its
            // own GEMM's; the `gemm` crate picks its kernels by shape, and some shapes round
            // differently (7 rows of 32 inputs: about a third of the outputs by an ulp or two),
            // so within 1e-6 of the largest, not bit for bit. dX is one sum over Σ out where
            // the separate GEMMs' sums were added: f32 rounding apart too.
            for (i, (a, b)) in jy.iter().zip(&sy).enumerate() {
                assert!(rel(a, b) < 1e-6, "{rows}x{inp}: output {i}: {}", rel(a, b));
            }
            for (i, (a, b)) in jdw.iter().zip(&sdw).enumerate() {
                assert!(rel(a, b) < 1e-6, "{rows}x{inp}: weight {i}'s gradient: {}", rel(a, b));
            }
            assert!(rel(&jdx, &sdx) < 1e-6, "{rows}x{inp}: dx: {}", rel(&jdx, &sdx));
        }
    }

    #[test]
    fn linears_that_cannot_be_joined_stay_apart_and_give_the_same_values() {
        let dev = Device::Cpu;
        let mut rng = Rng(7);
        let (a, b) = (uniform(&mut rng, &[4, 6]), uniform(&mut rng, &[2, 6]));
        let bf = b.to_dtype(DType::BF16).unwrap();
        let var = Var::from_tensor(&b).unwrap();
        let whole = GradBuffer::zeros((6, 6), &dev).unwrap().split(&[4, 2]).unwrap();
        let other = GradBuffer::zeros((2, 6), &dev).unwrap();
        let reversed = GradBuffer::zeros((6, 6), &dev).unwrap().split(&[2, 4]).unwrap();
        let cases: [(&str, &Tensor, [Option<&GradBuffer>; 2]); 6] = [
            ("mixed dtypes", &bf, [None, None]),
            ("a Var", var.as_tensor(), [None, None]),
            ("a buffer on one only", &b, [Some(&whole[0]), None]),
            ("buffers of two wholes", &b, [Some(&whole[0]), Some(&other)]),
            ("parts out of order", &b, [Some(&reversed[1]), Some(&reversed[0])]),
            ("another input width", &uniform(&mut rng, &[2, 5]), [None, None]),
        ];
        for (what, second, [ga, gb]) in cases {
            let parts = [("a", &a, ga), ("b", second, gb)];
            assert!(JointLinear::new(&parts).unwrap().is_none(), "{what}: joined");
        }
        assert!(JointLinear::new(&[("a", &a, None)]).unwrap().is_none(), "one alone");
        // Weights::join falls back: no joint, each linear on its own (its own GEMM, its own
        // buffer), the same values.
        let x = uniform(&mut rng, &[1, 3, 6]);
        let apart = Weights::new(HashMap::from([("a".into(), a.clone()), ("b".into(), b.clone())]))
            .with_grad_buffer("a", whole[0].clone())
            .with_grad_buffer("b", other.clone())
            .join(&["a", "b"])
            .unwrap();
        assert!(apart.joint(&["a", "b"]).is_none() && apart.joints().is_empty());
        let xv = Var::from_tensor(&x).unwrap();
        let ys = apart.linears(&["a", "b"], xv.as_tensor()).unwrap();
        assert_eq!(bits(&ys[1]), bits(&apart.linear("b", xv.as_tensor()).unwrap()));
        ys[1].sum_all().unwrap().backward().unwrap();
        assert_eq!((whole[0].uses(), other.uses()), (1, 2));
        assert!(other.tensor().abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() > 0.0);
        assert!(Weights::default().join(&["a", "b"]).is_err(), "a name the block lacks");
        // Frozen weights join without buffers; a buffer added after drops the joint.
        let plain = Weights::new(HashMap::from([("a".into(), a), ("b".into(), b)]));
        let frozen = plain.join(&["a", "b"]).unwrap();
        let j = frozen.joint(&["a", "b"]).expect("joined");
        assert!(!j.has_grads() && j.outs() == [4, 2] && j.weight().dims() == [6, 6]);
        assert!(frozen.joint(&["b", "a"]).is_none(), "a joint is of its names in order");
        let ys = frozen.linears(&["a", "b"], &x).unwrap();
        assert!(rel(&ys[1], &frozen.linear("b", &x).unwrap()) < 1e-6);
        let rebuffered = frozen.with_grad_buffer("a", whole[0].clone());
        assert!(rebuffered.joints().is_empty());
    }
}
