//! The fused ops on candle's CUDA device (feature `candle-cuda`): candle's storages and layouts
//! turned into the views and sizes that `cuda/fused.cu`'s checked launchers take
//! (`crate::backend::cuda::fused`, which compiles the program once per element type and compute
//! capability, loads it once per context and holds the launches' `unsafe`), each kernel
//! launched on candle's stream, each output a new buffer that the launcher allocates on the
//! stream, uninitialised (the kernel writes it whole), and candle then owns (zeroed first only
//! for cuDNN's kernels, [`output`]), but for the sums made in place into f32 buffers the caller
//! owns (`accumulate`, `index_add_rows`, and a linear layer's weight gradient by cuBLAS with
//! beta = 1). Nothing here waits for the device or copies to or from the host.

use candle_core::backend::BackendStorage;
use candle_core::cuda::{CudaDType, CudaDevice, CudaStorage};
use candle_core::Layout;
use cudarc::driver::{CudaSlice, CudaView, DeviceRepr, ValidAsZeroBits};

use super::{with_elem, Geometry};
use crate::backend::cuda::fused::{AttnShape, FusedKernels};
use crate::backend::cuda::programs::add_at_b_f32;

/// A new zeroed buffer of `n` elements (at least one), for the output of a kernel that strata
/// has not checked writes every element: cuDNN's fused attention (`cudnn.rs`). The kernels of
/// `cuda/fused.cu` write theirs whole, and their launchers allocate them without the memset.
pub(super) fn output<T: DeviceRepr + ValidAsZeroBits>(
    dev: &CudaDevice,
    n: usize,
) -> candle_core::Result<CudaSlice<T>> {
    dev.alloc_zeros::<T>(n.max(1))
}

/// The elements of `s` from `l`'s start offset.
pub(super) fn view<'a, T: CudaDType + DeviceRepr>(
    s: &'a CudaStorage,
    l: &Layout,
) -> candle_core::Result<CudaView<'a, T>> {
    let slice = s.as_cuda_slice::<T>()?;
    slice.try_slice(l.start_offset()..).ok_or_else(|| {
        candle_core::Error::Msg(format!(
            "fused ops on CUDA: a layout starting at {} in a buffer of {} elements",
            l.start_offset(),
            slice.len()
        ))
        .bt()
    })
}

/// [`view`] of a tensor that must be contiguous.
pub(super) fn dense<'a, T: CudaDType + DeviceRepr>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<CudaView<'a, T>> {
    if !l.is_contiguous() {
        candle_core::bail!("{what}: a contiguous tensor is needed");
    }
    view(s, l)
}

/// The strides of `[batch, seq, heads, head_dim]` in elements, the head dimension's 1.
fn strides(l: &Layout, what: &str) -> candle_core::Result<[usize; 3]> {
    let st = l.stride();
    if st.len() != 4 || st[3] != 1 {
        candle_core::bail!("fused attention on CUDA: {what}'s head dimension needs stride 1");
    }
    Ok([st[0], st[1], st[2]])
}

type Arg<'a> = (&'a CudaStorage, &'a Layout);

/// The launchers' shape of one attention call.
fn attn_shape(g: &Geometry, [q, k, v]: [&Layout; 3]) -> candle_core::Result<AttnShape> {
    Ok(AttnShape {
        b: g.b,
        sq: g.sq,
        skv: g.skv,
        nh: g.nh,
        nkv: g.nkv,
        d: g.d,
        strides: [strides(q, "q")?, strides(k, "k")?, strides(v, "v")?],
        scale: g.scale,
        window: (g.window != usize::MAX).then_some(g.window),
    })
}

/// The attention's forward: the output `[b, sq, nh, d]` and the log-sum-exp `[b, sq, nh]`.
pub(super) fn attention_forward(
    g: &Geometry,
    q: Arg,
    k: Arg,
    v: Arg,
) -> candle_core::Result<(CudaStorage, CudaStorage)> {
    let dev = q.0.device().clone();
    let shape = attn_shape(g, [q.1, k.1, v.1])?;
    with_elem!(q.0, "fused attention", |T| {
        let (qv, kv, vv) = (view::<T>(q.0, q.1)?, view::<T>(k.0, k.1)?, view::<T>(v.0, v.1)?);
        let f = FusedKernels::<T>::get(&dev.cuda_stream())?;
        let (o, lse) = f.attn_fwd(&shape, [&qv, &kv, &vv])?;
        Ok((
            CudaStorage::wrap_cuda_slice(o, dev.clone()),
            CudaStorage::wrap_cuda_slice(lse, dev.clone()),
        ))
    })
}

/// The attention's backward: `dq` (`[b, sq, nh, d]`), `dk` and `dv` (`[b, skv, nkv, d]`).
/// `inputs` are q, k, v, the output and its gradient (the last two contiguous).
pub(super) fn attention_backward(
    g: &Geometry,
    inputs: [Arg; 5],
    lse: Arg,
) -> candle_core::Result<(CudaStorage, CudaStorage, CudaStorage)> {
    let [q, k, v, o, dout] = inputs;
    let dev = q.0.device().clone();
    let shape = attn_shape(g, [q.1, k.1, v.1])?;
    let rows = g.b * g.sq * g.nh;
    with_elem!(q.0, "fused attention", |T| {
        let (qv, kv, vv) = (view::<T>(q.0, q.1)?, view::<T>(k.0, k.1)?, view::<T>(v.0, v.1)?);
        let ov = dense::<T>(o.0, o.1, "the attention's output")?;
        let dov = dense::<T>(dout.0, dout.1, "the attention's gradient")?;
        let lv = dense::<f32>(lse.0, lse.1, "the log-sum-exp")?;
        let f = FusedKernels::<T>::get(&dev.cuda_stream())?;
        let delta = f.attn_delta([rows, g.d], [&dov, &ov])?;
        let (inputs, saved) = ([&qv, &kv, &vv, &dov], [&lv, &delta.as_view()]);
        let dq = f.attn_dq(&shape, inputs, saved)?;
        let (dk, dv) = f.attn_dkdv(&shape, inputs, saved)?;
        let wrap = |s| CudaStorage::wrap_cuda_slice(s, dev.clone());
        Ok((wrap(dq), wrap(dk), wrap(dv)))
    })
}

/// RMSNorm's forward: the output and each row's inverse root mean square.
pub(super) fn rms_norm_forward(
    x: Arg,
    w: Arg,
    eps: f32,
) -> candle_core::Result<(CudaStorage, CudaStorage)> {
    let dev = x.0.device().clone();
    let hidden = w.1.dims()[0];
    let n = x.1.shape().elem_count();
    let rows = n.checked_div(hidden).unwrap_or(0);
    with_elem!(x.0, "fused rms_norm", |T| {
        let xv = dense::<T>(x.0, x.1, "rms_norm's input")?;
        let wv = dense::<T>(w.0, w.1, "rms_norm's weight")?;
        let f = FusedKernels::<T>::get(&dev.cuda_stream())?;
        let (out, inv) = f.rms_fwd([rows, hidden], eps, [&xv, &wv])?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            CudaStorage::wrap_cuda_slice(inv, dev.clone()),
        ))
    })
}

/// The residual add and RMSNorm in one pass: `h = x + r`, the norm of `h` and each row's
/// inverse root mean square.
pub(super) fn add_rms_norm_forward(
    x: Arg,
    r: Arg,
    w: Arg,
    eps: f32,
) -> candle_core::Result<(CudaStorage, CudaStorage, CudaStorage)> {
    let dev = x.0.device().clone();
    let hidden = w.1.dims()[0];
    let n = x.1.shape().elem_count();
    let rows = n.checked_div(hidden).unwrap_or(0);
    with_elem!(x.0, "fused add_rms_norm", |T| {
        let xv = dense::<T>(x.0, x.1, "add_rms_norm's input")?;
        let rv = dense::<T>(r.0, r.1, "add_rms_norm's residual")?;
        let wv = dense::<T>(w.0, w.1, "add_rms_norm's weight")?;
        let f = FusedKernels::<T>::get(&dev.cuda_stream())?;
        let (h, out, inv) = f.add_rms_fwd([rows, hidden], eps, [&xv, &rv, &wv])?;
        let wrap = |s| CudaStorage::wrap_cuda_slice(s, dev.clone());
        Ok((wrap(h), wrap(out), CudaStorage::wrap_cuda_slice(inv, dev.clone())))
    })
}

/// Rows per partial sum of the weight's gradient.
const DW_ROWS: usize = 64;

/// RMSNorm's backward: `dx` and `dw`, the weight's gradient summed over the rows in f32, per
/// [`DW_ROWS`] rows and then over those partial sums in order.
pub(super) fn rms_norm_backward(
    x: Arg,
    w: Arg,
    dy: Arg,
    inv: Arg,
) -> candle_core::Result<(CudaStorage, CudaStorage)> {
    let dev = x.0.device().clone();
    let hidden = w.1.dims()[0];
    let n = x.1.shape().elem_count();
    let rows = n.checked_div(hidden).unwrap_or(0);
    let chunks = rows.div_ceil(DW_ROWS);
    with_elem!(x.0, "fused rms_norm", |T| {
        let xv = dense::<T>(x.0, x.1, "rms_norm's input")?;
        let wv = dense::<T>(w.0, w.1, "rms_norm's weight")?;
        let dyv = dense::<T>(dy.0, dy.1, "rms_norm's gradient")?;
        let iv = dense::<f32>(inv.0, inv.1, "rms_norm's saved rows")?;
        let f = FusedKernels::<T>::get(&dev.cuda_stream())?;
        let dx = f.rms_dx([rows, hidden], [&xv, &wv, &dyv], &iv)?;
        let partial = f.rms_dw_partial([rows, hidden, DW_ROWS], [&xv, &dyv], &iv)?;
        // With no row, chunks is 0: dw is the empty sum, written as zeros.
        let dw = f.rms_dw_sum([chunks, hidden], &partial.as_view())?;
        Ok((
            CudaStorage::wrap_cuda_slice(dx, dev.clone()),
            CudaStorage::wrap_cuda_slice(dw, dev.clone()),
        ))
    })
}

/// RoPE of `x` (`[b, s, h, d]`, any strides) at positions `offset..`, or its transpose.
pub(super) fn rope(
    x: Arg,
    cos: Arg,
    sin: Arg,
    offset: usize,
    inverse: bool,
) -> candle_core::Result<CudaStorage> {
    let dev = x.0.device().clone();
    let (Ok(dims), Ok(strides)) =
        (<[usize; 4]>::try_from(x.1.dims()), <[usize; 4]>::try_from(x.1.stride()))
    else {
        candle_core::bail!("fused rope on CUDA: x is [batch, seq, heads, head_dim]");
    };
    with_elem!(x.0, "fused rope", |T| {
        let xv = view::<T>(x.0, x.1)?;
        let cv = dense::<f32>(cos.0, cos.1, "rope's cos")?;
        let sv = dense::<f32>(sin.0, sin.1, "rope's sin")?;
        let f = FusedKernels::<T>::get(&dev.cuda_stream())?;
        let out = f.rope([dims, strides], (offset, inverse), &xv, [&cv, &sv])?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    })
}

/// SwiGLU's forward.
pub(super) fn swiglu_forward(g: Arg, u: Arg) -> candle_core::Result<CudaStorage> {
    let dev = g.0.device().clone();
    let n = g.1.shape().elem_count();
    with_elem!(g.0, "fused swiglu", |T| {
        let gv = dense::<T>(g.0, g.1, "swiglu's gate")?;
        let uv = dense::<T>(u.0, u.1, "swiglu's up")?;
        let f = FusedKernels::<T>::get(&dev.cuda_stream())?;
        let out = f.swiglu_fwd(n, [&gv, &uv])?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    })
}

/// SwiGLU's backward: the gradients of the gate and of up.
pub(super) fn swiglu_backward(
    g: Arg,
    u: Arg,
    dy: Arg,
) -> candle_core::Result<(CudaStorage, CudaStorage)> {
    let dev = g.0.device().clone();
    let n = g.1.shape().elem_count();
    with_elem!(g.0, "fused swiglu", |T| {
        let gv = dense::<T>(g.0, g.1, "swiglu's gate")?;
        let uv = dense::<T>(u.0, u.1, "swiglu's up")?;
        let dyv = dense::<T>(dy.0, dy.1, "swiglu's gradient")?;
        let f = FusedKernels::<T>::get(&dev.cuda_stream())?;
        let (dg, du) = f.swiglu_bwd(n, [&gv, &uv, &dyv])?;
        let wrap = |s| CudaStorage::wrap_cuda_slice(s, dev.clone());
        Ok((wrap(dg), wrap(du)))
    })
}

/// SwiGLU's forward over the joint gate/up output (`rows` rows of `2 · inner`).
pub(super) fn swiglu_joined_forward(
    y: Arg,
    rows: usize,
    inner: usize,
) -> candle_core::Result<CudaStorage> {
    let dev = y.0.device().clone();
    with_elem!(y.0, "fused swiglu", |T| {
        let yv = dense::<T>(y.0, y.1, "the joint gate/up output")?;
        let f = FusedKernels::<T>::get(&dev.cuda_stream())?;
        let out = f.swiglu_joined_fwd(rows, inner, &yv)?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    })
}

/// SwiGLU's backward over the joint gate/up output: the joint's gradient.
pub(super) fn swiglu_joined_backward(
    y: Arg,
    dy: Arg,
    rows: usize,
    inner: usize,
) -> candle_core::Result<CudaStorage> {
    let dev = y.0.device().clone();
    with_elem!(y.0, "fused swiglu", |T| {
        let yv = dense::<T>(y.0, y.1, "the joint gate/up output")?;
        let dyv = dense::<T>(dy.0, dy.1, "swiglu's gradient")?;
        let f = FusedKernels::<T>::get(&dev.cuda_stream())?;
        let dj = f.swiglu_joined_bwd(rows, inner, [&yv, &dyv])?;
        Ok(CudaStorage::wrap_cuda_slice(dj, dev.clone()))
    })
}

type ArgMut<'a> = (&'a mut CudaStorage, &'a Layout);

/// The f32 elements of a contiguous sum, writable, from its layout's start.
fn sum_view<'a>(
    acc: &'a mut CudaStorage,
    l: &Layout,
    what: &str,
) -> candle_core::Result<cudarc::driver::CudaViewMut<'a, f32>> {
    let (start, end) = l.contiguous_offsets().ok_or_else(|| {
        candle_core::Error::Msg(format!("{what}: a contiguous sum is needed")).bt()
    })?;
    let slice = acc.as_cuda_slice_mut::<f32>()?;
    let len = slice.len();
    slice.try_slice_mut(start..end).ok_or_else(|| {
        candle_core::Error::Msg(format!("{what}: a layout of {start}..{end} in {len} elements"))
            .bt()
    })
}

/// `acc += g` in f32, in place (`fused::accumulate`).
pub(super) fn grad_accumulate(acc: ArgMut, g: Arg) -> candle_core::Result<()> {
    let dev = g.0.device().clone();
    let n = g.1.shape().elem_count();
    if acc.1.shape().elem_count() != n {
        candle_core::bail!("accumulate: {n} elements into a sum of {:?}", acc.1.dims());
    }
    with_elem!(g.0, "accumulate", |T| {
        let gv = dense::<T>(g.0, g.1, "accumulate's gradient")?;
        let mut av = sum_view(acc.0, acc.1, "accumulate")?;
        let f = FusedKernels::<T>::get(&dev.cuda_stream())?;
        f.grad_acc(n, &mut av, &gv)?;
        Ok(())
    })
}

/// `acc[ids[i]] += rows[i]` in f32 for `i` in order, in place (`fused::index_add_rows`).
pub(super) fn grad_index_add(acc: ArgMut, ids: Arg, rows: Arg) -> candle_core::Result<()> {
    let dev = rows.0.device().clone();
    let (vocab, hidden) = acc.1.shape().dims2()?;
    let n = ids.1.shape().elem_count();
    with_elem!(rows.0, "index_add_rows", |T| {
        let iv = dense::<u32>(ids.0, ids.1, "index_add_rows' ids")?;
        let rv = dense::<T>(rows.0, rows.1, "index_add_rows' rows")?;
        let mut av = sum_view(acc.0, acc.1, "index_add_rows")?;
        let f = FusedKernels::<T>::get(&dev.cuda_stream())?;
        f.grad_index_add([n, hidden, vocab], &mut av, &iv, &rv)?;
        Ok(())
    })
}

/// `acc += dyᵀ·x` in f32, in place (`fused::add_weight_grad`): one cuBLAS GEMM on candle's
/// stream, `dy` (`[rows, out]`) and `x` (`[rows, in]`) read in their dtype, `acc` (`[out, in]`)
/// read and written in f32.
pub(super) fn add_weight_grad(acc: ArgMut, dy: Arg, x: Arg) -> candle_core::Result<()> {
    let dev = dy.0.device().clone();
    let (rows, out) = dy.1.shape().dims2()?;
    let inp = x.1.shape().dims2()?.1;
    let blas = dev.cublas_handle();
    let stream = dev.cuda_stream();
    with_elem!(dy.0, "add_weight_grad", |T| {
        let dyv = dense::<T>(dy.0, dy.1, "add_weight_grad's dy")?;
        let xv = dense::<T>(x.0, x.1, "add_weight_grad's x")?;
        let mut av = sum_view(acc.0, acc.1, "add_weight_grad")?;
        add_at_b_f32(&blas, &stream, [rows, out, inp], &dyv, &xv, &mut av)?;
        Ok(())
    })
}
