//! A step's gradients, as [`Trainer`](super::Trainer) and [`LlamaTwin`](crate::candle::LlamaTwin)
//! both make them (so that they stay equal bit for bit on the CPU): one f32 buffer per parameter
//! for the step, each micro-batch's gradient added into it in place ([`fused::accumulate`]); an
//! embedding's rows added into its buffer in place, in f32, after the head's share when the
//! embeddings are tied ([`fused::index_add_rows`]); and the loss and the global gradient norm
//! summed on the device and read in one host sync a step.

use candle_core::{DType as CDType, Tensor};

use crate::candle::fused;

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
