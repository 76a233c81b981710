//! A step's gradients, as [`Trainer`](super::Trainer) and [`LlamaTwin`](crate::candle::LlamaTwin)
//! both make them (so that they stay equal bit for bit on the CPU): one f32 buffer per parameter
//! for the step. A block's trained linear weights (those its [`Block::linears`] lists) have
//! theirs summed by the backward itself: each linear's backward adds `dYᵀ·X` into the buffer in
//! place, one GEMM with beta = 1 over the micro-batch's 16-bit (or f32) values into f32
//! ([`GradBuffer`], [`fused::add_weight_grad`]), so those weights need no `Var` and no
//! micro-batch's weight gradient is made, rounded or added on its own ([`linear_buffers`]); the
//! linears a block joins ([`Block::joined_linears`]: a Llama block's q/k/v and gate/up) get one
//! buffer a group, each weight's buffer a row range of it, so that the joint GEMM's backward
//! sums every part's gradient in one GEMM ([`staged`]). The
//! others' (norms, biases, adapters, the head) come from candle's autograd, each micro-batch's
//! gradient added into the buffer in place ([`fused::accumulate`]); an embedding's rows are
//! added into its buffer in place, in f32, after the head's share when the embeddings are tied
//! ([`fused::index_add_rows`]); and the loss and the global gradient norm are summed on the
//! device and read in one host sync a step.

use candle_core::{DType as CDType, Device, Tensor};

use super::{invalid, LlamaConfig};
use crate::candle::block::{Block, GradBuffer, Weights};
use crate::candle::fused;

/// A trained linear weight of one block and the f32 buffer its backward sums its gradient into.
pub(super) struct LinearGrad {
    /// The parameter's name in the model (`model.layers.3.self_attn.q_proj.weight`).
    pub(super) name: String,
    /// Its name within the block (`self_attn.q_proj.weight`), as [`Weights`] names it.
    pub(super) local: String,
    pub(super) buf: GradBuffer,
}

/// Block `l`'s weights that `block` applies as a linear ([`Block::linears`]), that are matrices
/// among `block_tensors` (names within a block, and shapes) and that `trained` says are
/// trained: the weights whose gradients the block's backward sums itself. Each as its name in
/// the model, its name within the block and its shape `[out, in]`.
pub(super) fn trained_linears(
    block: &dyn Block,
    block_tensors: &[(String, Vec<usize>)],
    l: usize,
    trained: impl Fn(&str) -> bool,
) -> Vec<(String, String, (usize, usize))> {
    let prefix = LlamaConfig::block_prefix(l);
    let mut out = Vec::new();
    for local in block.linears() {
        let Some((_, shape)) = block_tensors.iter().find(|(n, _)| *n == local) else { continue };
        let name = format!("{prefix}{local}");
        if let ([o, i], true) = (shape.as_slice(), trained(&name)) {
            out.push((name, local, (*o, *i)));
        }
    }
    out
}

/// A new f32 buffer of zeros on `device` for each of [`trained_linears`], for a step's
/// backward of block `l` ([`with_buffers`]). The linears of a group the block joins
/// ([`Block::joined_linears`]), when all of them are trained and read inputs of one width, get
/// one buffer of the group's rows, each its own rows of it ([`GradBuffer::split`]): what the
/// joint's backward sums into. The others get a buffer each.
pub(super) fn linear_buffers(
    block: &dyn Block,
    block_tensors: &[(String, Vec<usize>)],
    l: usize,
    trained: impl Fn(&str) -> bool,
    device: &Device,
) -> candle_core::Result<Vec<LinearGrad>> {
    let linears = trained_linears(block, block_tensors, l, trained);
    let mut bufs: Vec<Option<GradBuffer>> = linears.iter().map(|_| None).collect();
    for group in block.joined_linears() {
        let at: Vec<usize> = group
            .iter()
            .filter_map(|g| linears.iter().position(|(_, local, _)| local == g))
            .collect();
        let inp = at.first().map(|&i| linears[i].2 .1);
        if at.len() < 2
            || at.len() != group.len()
            || at.iter().any(|&i| Some(linears[i].2 .1) != inp || bufs[i].is_some())
        {
            continue;
        }
        let outs: Vec<usize> = at.iter().map(|&i| linears[i].2 .0).collect();
        let whole = GradBuffer::zeros((outs.iter().sum(), inp.unwrap_or(0)), device)?;
        for (i, part) in at.into_iter().zip(whole.split(&outs)?) {
            bufs[i] = Some(part);
        }
    }
    linears
        .into_iter()
        .zip(bufs)
        .map(|((name, local, shape), buf)| {
            let buf = match buf {
                Some(b) => b,
                None => GradBuffer::zeros(shape, device)?,
            };
            Ok(LinearGrad { name, local, buf })
        })
        .collect()
}

/// `w` as a block's forward reads it once staged: each group of linears the block joins
/// ([`Block::joined_linears`]) joined ([`Weights::join`]: one copy of the group's weights a
/// stage, reused by every micro-batch; with their buffers, so call it after [`with_buffers`]).
pub(super) fn staged(w: Weights, block: &dyn Block) -> candle_core::Result<Weights> {
    staged_from(w, block, |_| None)
}

/// [`staged`], each group's joint weight the tensor `stacked` gives for the group's names where
/// it gives one holding their rows (a layer fetched with [`Layers::fetch_joined`]), not a copy.
///
/// [`Layers::fetch_joined`]: crate::candle::Layers::fetch_joined
pub(super) fn staged_from(
    w: Weights,
    block: &dyn Block,
    stacked: impl Fn(&[&str]) -> Option<Tensor>,
) -> candle_core::Result<Weights> {
    block.joined_linears().iter().try_fold(w, |w, group| {
        let names: Vec<&str> = group.iter().map(String::as_str).collect();
        let s = stacked(&names);
        w.join_stacked(&names, s.as_ref())
    })
}

/// `w` with the buffers `bufs` on their linears.
pub(super) fn with_buffers(w: Weights, bufs: &[LinearGrad]) -> Weights {
    bufs.iter().fold(w, |w, g| w.with_grad_buffer(g.local.clone(), g.buf.clone()))
}

/// Refuses buffers that no forward applied: a block that did not apply a weight it lists in
/// [`Block::linears`] through [`Weights::linear`] would leave its gradient at zero.
pub(super) fn check_applied(bufs: &[LinearGrad], kind: &str) -> candle_core::Result<()> {
    match bufs.iter().find(|g| g.buf.uses() == 0) {
        None => Ok(()),
        Some(g) => Err(invalid(format!(
            "{}: the {kind} block's forward did not apply it with Weights::linear, though \
             Block::linears lists it, so its gradient would be lost: apply each weight \
             Block::linears names through Weights::linear (and only so), or leave it out of \
             Block::linears",
            g.name
        ))),
    }
}

/// Adds a micro-batch's gradient `g` into the parameter's buffer: the first one becomes the
/// buffer (an f32 copy of its own, so that nothing else sees the sums), the others are added in
/// place in f32.
pub(super) fn add_grad(buf: &mut Option<Tensor>, g: &Tensor) -> candle_core::Result<()> {
    match buf {
        Some(b) => fused::accumulate(b, g),
        None => {
            let owned = if g.dtype() == CDType::F32 { g.copy()? } else { g.to_dtype(CDType::F32)? };
            *buf = Some(owned.contiguous()?);
            Ok(())
        }
    }
}

/// The embedding's backward into its f32 buffer `table` (`[vocab, hidden]`): for each
/// micro-batch in order, the gradient at the embedding's output (`[batch, seq, hidden]`) added
/// to the rows its ids (`[batch, seq]`) picked, as candle's `index_select` backward adds them,
/// in f32.
pub(super) fn embedding_backward(
    table: &Tensor,
    micro_batches: &[(&Tensor, &Tensor)],
) -> candle_core::Result<()> {
    let hidden = table.dims2()?.1;
    for (ids, gy) in micro_batches {
        let ids = ids.flatten_all()?;
        let n = ids.dims1()?;
        fused::index_add_rows(table, &ids, &gy.reshape((n, hidden))?)?;
    }
    Ok(())
}

/// A buffer's sum of squares (f32, on its device), for the global norm.
pub(super) fn sum_of_squares(buf: &Tensor) -> candle_core::Result<Tensor> {
    buf.sqr()?.sum_all()
}

/// The step's loss (the micro-batches' losses summed in f32) and the global gradient norm (the
/// square root of the parameters' sums of squares summed in f64, in the order given), summed on
/// their device and read back in one host sync.
pub(super) fn loss_and_norm(losses: &[Tensor], sums: &[Tensor]) -> candle_core::Result<(f32, f64)> {
    let Some(first) = losses.first() else { candle_core::bail!("a step of no micro-batch") };
    let loss = Tensor::stack(losses, 0)?.sum_all()?.to_dtype(CDType::F64)?.reshape(1)?;
    let squares = if sums.is_empty() {
        Tensor::zeros(1, CDType::F64, first.device())?
    } else {
        Tensor::stack(sums, 0)?.to_dtype(CDType::F64)?.sum_all()?.reshape(1)?
    };
    let both = Tensor::cat(&[&loss, &squares], 0)?.to_vec1::<f64>()?;
    // The loss was an f32 widened: narrowing it back is exact.
    Ok((both[0] as f32, both[1].sqrt()))
}

/// Clipping's factor for a global norm `norm` and `clip` (torch's `clip_grad_norm_`:
/// `min(1, max_norm / (norm + 1e-6))`, in f32), 1 without clipping.
pub(super) fn clip_factor(norm: f64, clip: Option<f64>) -> f32 {
    match clip {
        Some(max) => (max / (norm + 1e-6)).min(1.0) as f32,
        None => 1.0,
    }
}

/// The gradient `grads` holds for `t`, or an error naming `what` when none reached it.
pub(super) fn grad_of(
    grads: &candle_core::backprop::GradStore,
    t: &Tensor,
    what: &str,
) -> candle_core::Result<Tensor> {
    grads
        .get(t)
        .cloned()
        .ok_or_else(|| candle_core::Error::Msg(format!("no gradient reached {what}")).bt())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn the_first_gradient_is_copied_and_the_others_added_in_place() {
        let dev = Device::Cpu;
        let g = Tensor::new(&[1f32, 2.0], &dev).unwrap();
        let mut buf = None;
        add_grad(&mut buf, &g).unwrap();
        add_grad(&mut buf, &g.to_dtype(CDType::BF16).unwrap()).unwrap();
        assert_eq!(buf.unwrap().to_vec1::<f32>().unwrap(), [2.0, 4.0]);
        assert_eq!(g.to_vec1::<f32>().unwrap(), [1.0, 2.0], "the first gradient is not changed");
    }

    #[test]
    fn a_listed_linear_the_forward_did_not_apply_is_refused() {
        let dev = Device::Cpu;
        let buf = GradBuffer::zeros((2, 3), &dev).unwrap();
        let g =
            LinearGrad { name: "model.layers.0.fc.weight".into(), local: "fc.weight".into(), buf };
        let e = check_applied(std::slice::from_ref(&g), "mlp").unwrap_err().to_string();
        assert!(e.contains("model.layers.0.fc.weight") && e.contains("Weights::linear"), "{e}");
        let w = with_buffers(Weights::default(), std::slice::from_ref(&g));
        let x = candle_core::Var::zeros((1, 3), CDType::F32, &dev).unwrap();
        let weight = Tensor::zeros((2, 3), CDType::F32, &dev).unwrap();
        w.grad_buffer("fc.weight").unwrap().linear(x.as_tensor(), &weight).unwrap();
        check_applied(&[g], "mlp").unwrap();
    }

    #[test]
    fn a_joined_group_gets_one_buffer_its_parts_rows_of_it_unless_part_of_it_is_frozen() {
        let dev = Device::Cpu;
        let c = LlamaConfig::from_json(
            r#"{"hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 1,
                "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10}"#,
        )
        .unwrap();
        let block = crate::candle::block::LlamaBlock::new(&c, 4, &dev).unwrap();
        let tensors = block.tensors();
        let weights = || {
            let t = tensors
                .iter()
                .map(|(n, s)| (n.clone(), Tensor::zeros(s.as_slice(), CDType::F32, &dev).unwrap()));
            Weights::new(t.collect())
        };
        let joints = |trained: &dyn Fn(&str) -> bool| {
            let bufs = linear_buffers(&block, &tensors, 0, trained, &dev).unwrap();
            let w = staged(with_buffers(weights(), &bufs), &block).unwrap();
            let names: Vec<Vec<String>> = w.joints().iter().map(|j| j.names().to_vec()).collect();
            assert!(w.joints().iter().all(|j| j.has_grads()));
            (bufs.len(), names)
        };
        // All trained: q/k/v and gate/up each one buffer ([8 + 4 + 4, 8], [12 + 12, 8]).
        let (n, names) = joints(&|_| true);
        assert_eq!((n, names), (7, block.joined_linears()));
        // v frozen: q and k keep a buffer each and are not joined; gate/up still are.
        let (n, names) = joints(&|name| !name.contains("v_proj"));
        assert_eq!((n, names), (6, vec![block.joined_linears()[1].clone()]));
    }

    #[test]
    fn loss_and_norm_read_both_in_one_go() {
        let dev = Device::Cpu;
        let losses = [Tensor::new(1.5f32, &dev).unwrap(), Tensor::new(0.25f32, &dev).unwrap()];
        let sums = [Tensor::new(9f32, &dev).unwrap(), Tensor::new(16f32, &dev).unwrap()];
        assert_eq!(loss_and_norm(&losses, &sums).unwrap(), (1.75, 5.0));
        assert_eq!(loss_and_norm(&losses, &[]).unwrap(), (1.75, 0.0));
        assert_eq!(clip_factor(5.0, Some(1.0)), (1.0 / (5.0 + 1e-6)) as f32);
        assert_eq!(clip_factor(0.5, Some(1.0)), 1.0);
        assert_eq!(clip_factor(5.0, None), 1.0);
    }
}
