//! Gradients summed in place in f32: `acc += g` ([`accumulate`]) over a micro-batch's gradient,
//! and an embedding's rows added where the token ids say ([`index_add_rows`]). Each widens f32,
//! bf16 or f16 values to f32 and adds them into an f32 buffer the caller owns, in place: one
//! buffer per parameter for a whole step, never a new tensor per micro-batch, and every sum of
//! bf16 values made in f32 (as PyTorch's autocast accumulates them).
//!
//! Both run in a fixed order (element by element; the rows of [`index_add_rows`] in the order
//! of the ids), so the CPU and CUDA give the same sums as each other and from run to run.
//!
//! ```
//! # fn main() -> candle_core::Result<()> {
//! use candle_core::{DType, Device, Tensor};
//! use strata::candle::fused;
//!
//! let dev = Device::Cpu;
//! let acc = Tensor::zeros((2, 3), DType::F32, &dev)?;
//! // 1000 micro-batches of a bf16 gradient of ones: in bf16 the sum would stop at 256.
//! let one = Tensor::ones((2, 3), DType::BF16, &dev)?;
//! for _ in 0..1000 {
//!     fused::accumulate(&acc, &one)?;
//! }
//! assert_eq!(acc.to_vec2::<f32>()?, [[1000.0; 3]; 2]);
//! // Rows of a gradient added to rows 1, 0, 1 of an embedding's gradient.
//! let table = Tensor::zeros((2, 3), DType::F32, &dev)?;
//! let ids = Tensor::new(&[1u32, 0, 1], &dev)?;
//! let rows = Tensor::ones((3, 3), DType::BF16, &dev)?;
//! fused::index_add_rows(&table, &ids, &rows)?;
//! assert_eq!(table.to_vec2::<f32>()?, [[1.0; 3], [2.0; 3]]);
//! # Ok(()) }
//! ```

use candle_core::{CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Tensor};
use rayon::prelude::*;

use super::{contiguous, with_elem, Elem, CHUNK};

/// `acc += g`, element by element in f32, in place: `acc` an f32 tensor (contiguous) and `g` a
/// tensor of the same shape in f32, bf16 or f16 (made contiguous first if it is not). `acc`
/// must not share its storage with another tensor that should keep its values (a clone of it
/// sees the sum too).
pub fn accumulate(acc: &Tensor, g: &Tensor) -> candle_core::Result<()> {
    if acc.dtype() != DType::F32 || !acc.is_contiguous() {
        candle_core::bail!(
            "accumulate: the sum must be a contiguous f32 tensor, not {:?} ({})",
            acc.dtype(),
            if acc.is_contiguous() { "contiguous" } else { "strided" }
        );
    }
    if acc.dims() != g.dims() {
        candle_core::bail!(
            "accumulate: a gradient of {:?} into a sum of {:?}",
            g.dims(),
            acc.dims()
        );
    }
    acc.inplace_op2(&g.contiguous()?, &Accumulate)
}

/// `acc[ids[i], :] += rows[i, :]` in f32 for `i` in order, in place: `acc` an f32 table
/// (`[vocab, hidden]`, contiguous), `ids` `[n]` u32 and `rows` `[n, hidden]` in f32, bf16 or
/// f16: the backward of an embedding's `index_select`, summed into one buffer. On the CPU an id
/// past the table is an error; on CUDA (which cannot report it without waiting for the device)
/// its row is left out: check the ids first, as [`Trainer::step`](crate::candle::Trainer::step)
/// does.
pub fn index_add_rows(acc: &Tensor, ids: &Tensor, rows: &Tensor) -> candle_core::Result<()> {
    let (vocab, hidden) = acc.dims2()?;
    if acc.dtype() != DType::F32 || !acc.is_contiguous() {
        candle_core::bail!(
            "index_add_rows: the table must be a contiguous f32 tensor, not {:?}",
            acc.dtype()
        );
    }
    let n = ids.dims1()?;
    if ids.dtype() != DType::U32 || rows.dims() != [n, hidden] {
        candle_core::bail!(
            "index_add_rows: {n} ids ({:?}) and rows of {:?} for a table of [{vocab}, {hidden}]: u32 \
             ids and [{n}, {hidden}] rows are needed",
            ids.dtype(),
            rows.dims()
        );
    }
    acc.inplace_op3(&ids.contiguous()?, &rows.contiguous()?, &IndexAdd)
}

struct Accumulate;

impl InplaceOp2 for Accumulate {
    fn name(&self) -> &'static str {
        "strata-accumulate"
    }

    fn cpu_fwd(
        &self,
        acc: &mut CpuStorage,
        la: &Layout,
        g: &CpuStorage,
        lg: &Layout,
    ) -> candle_core::Result<()> {
        let acc = f32s_mut(acc, la, "accumulate")?;
        with_elem!(g, "accumulate", |T| {
            let g = contiguous::<T>(g, lg, "accumulate's gradient")?;
            acc.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).for_each(|(a, g)| {
                for (a, g) in a.iter_mut().zip(g) {
                    *a += g.widen();
                }
            });
            Ok(())
        })
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        acc: &mut candle_core::CudaStorage,
        la: &Layout,
        g: &candle_core::CudaStorage,
        lg: &Layout,
    ) -> candle_core::Result<()> {
        super::cuda::grad_accumulate((acc, la), (g, lg))
    }
}

struct IndexAdd;

impl InplaceOp3 for IndexAdd {
    fn name(&self) -> &'static str {
        "strata-index-add-rows"
    }

    fn cpu_fwd(
        &self,
        acc: &mut CpuStorage,
        la: &Layout,
        ids: &CpuStorage,
        li: &Layout,
        rows: &CpuStorage,
        lr: &Layout,
    ) -> candle_core::Result<()> {
        let (vocab, hidden) = la.shape().dims2()?;
        let acc = f32s_mut(acc, la, "index_add_rows")?;
        let (start, end) = li.contiguous_offsets().ok_or_else(|| {
            candle_core::Error::Msg("index_add_rows: contiguous ids are needed".into()).bt()
        })?;
        let ids = &ids.as_slice::<u32>()?[start..end];
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
            candle_core::bail!("index_add_rows: id {bad} in a table of {vocab} rows");
        }
        with_elem!(rows, "index_add_rows", |T| {
            let rows = contiguous::<T>(rows, lr, "index_add_rows' rows")?;
            if hidden > 0 {
                for (&id, row) in ids.iter().zip(rows.chunks_exact(hidden)) {
                    let dst = &mut acc[id as usize * hidden..(id as usize + 1) * hidden];
                    for (a, r) in dst.iter_mut().zip(row) {
                        *a += r.widen();
                    }
                }
            }
            Ok(())
        })
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        acc: &mut candle_core::CudaStorage,
        la: &Layout,
        ids: &candle_core::CudaStorage,
        li: &Layout,
        rows: &candle_core::CudaStorage,
        lr: &Layout,
    ) -> candle_core::Result<()> {
        super::cuda::grad_index_add((acc, la), (ids, li), (rows, lr))
    }
}

/// The f32 elements of a contiguous sum `acc` (its layout's range).
pub(super) fn f32s_mut<'a>(
    acc: &'a mut CpuStorage,
    layout: &Layout,
    what: &str,
) -> candle_core::Result<&'a mut [f32]> {
    let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
        candle_core::Error::Msg(format!("{what}: a contiguous sum is needed")).bt()
    })?;
    match acc {
        CpuStorage::F32(v) => Ok(&mut v[start..end]),
        other => candle_core::bail!(
            "{what}: an f32 sum is needed, not {:?}",
            candle_core::backend::BackendStorage::dtype(other)
        ),
    }
}
