//! The fused ops on candle's CUDA device (feature `candle-cuda`): the kernels of
//! `cuda/fused.cu`, compiled with NVRTC once per compute capability, loaded into each device as
//! one of candle's custom modules and launched on candle's stream, each output a new buffer
//! candle owns. Nothing here waits for the device or copies to or from the host.
//!
//! The launches are the only `unsafe` of the fused ops: a kernel's arguments must be what its
//! CUDA signature says, which the compiler cannot check. Each launch function below lists them.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda::{CudaDType, CudaDevice, CudaStorage, WrapErr};
use candle_core::Layout;
use cudarc::driver::{CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg};
use parking_lot::Mutex;

use super::attention::Geometry;
use super::{with_elem, Elem};

const SOURCE: &str = include_str!("../../../cuda/fused.cu");
const BF16_H: &str = include_str!("../../../cuda/bf16.cuh");

/// Query rows per block of the attention forward and of `dq`; keys per tile (`cuda/fused.cu`'s
/// `BQ` and `BK`).
const BQ: usize = 16;
const BK: usize = 32;
/// Shared memory a block may use without opting in.
const DEFAULT_SHARED: usize = 48 << 10;

/// `cuda/fused.cu`'s kernels for element type `elem` (`f32`, `bf16`, `f16`: the source compiles
/// one type per program) as PTX for `dev`'s compute capability, compiled on first use.
fn ptx(dev: &CudaDevice, elem: &'static str) -> candle_core::Result<Arc<str>> {
    type Cache = HashMap<((i32, i32), &'static str), Arc<str>>;
    static PTX: OnceLock<Mutex<Cache>> = OnceLock::new();
    let cc = dev.cuda_stream().context().compute_capability().w()?;
    let mut cache = PTX.get_or_init(Default::default).lock();
    if let Some(p) = cache.get(&(cc, elem)) {
        return Ok(p.clone());
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec![format!("--gpu-architecture=compute_{}{}", cc.0, cc.1)],
        ..Default::default()
    };
    let source = format!("#define STRATA_ELEM_{elem}\n{BF16_H}{SOURCE}");
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts).map_err(|e| {
        candle_core::Error::Msg(format!("compiling cuda/fused.cu ({elem}) with NVRTC: {e}")).bt()
    })?;
    let p: Arc<str> = ptx.to_src().into();
    cache.insert((cc, elem), p.clone());
    Ok(p)
}

/// Kernel `name` of the module of element type `T`, loaded into `dev` once.
fn func<T: Elem>(dev: &CudaDevice, name: &str) -> candle_core::Result<CudaFunction> {
    let module = format!("strata_fused_{}", T::NAME);
    Ok(dev.get_or_load_custom_func(name, &module, &ptx(dev, T::NAME)?)?.into_cuda_function())
}

/// A new buffer of `n` elements (at least one) that the kernel launched next writes whole.
fn output<T: DeviceRepr>(dev: &CudaDevice, n: usize) -> candle_core::Result<CudaSlice<T>> {
    // SAFETY: the memory is uninitialised; every caller launches, next on the same stream, a
    // kernel that writes each of its `n` elements before anything can read them (the buffer is
    // handed to candle only after that launch is queued, and candle's work is on that stream).
    unsafe { dev.alloc::<T>(n.max(1)) }
}

/// The elements of `s` from `l`'s start offset.
fn view<'a, T: CudaDType + DeviceRepr>(
    s: &'a CudaStorage,
    l: &Layout,
) -> candle_core::Result<CudaView<'a, T>> {
    Ok(s.as_cuda_slice::<T>()?.slice(l.start_offset()..))
}

/// [`view`] of a tensor that must be contiguous.
fn dense<'a, T: CudaDType + DeviceRepr>(
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
fn strides(l: &Layout, what: &str) -> candle_core::Result<[i64; 3]> {
    let st = l.stride();
    if st.len() != 4 || st[3] != 1 {
        candle_core::bail!("fused attention on CUDA: {what}'s head dimension needs stride 1");
    }
    Ok([st[0] as i64, st[1] as i64, st[2] as i64])
}

/// The kernels' suffix for a head width, and its shared memory need.
fn width(d: usize) -> candle_core::Result<&'static str> {
    Ok(match d {
        0..=64 => "d64",
        65..=128 => "d128",
        129..=256 => "d256",
        _ => candle_core::bail!(
            "fused attention on CUDA takes heads of at most 256 elements, not {d}: use \
             llama::Compute::Decomposed"
        ),
    })
}

fn int(x: usize, what: &str) -> candle_core::Result<i32> {
    i32::try_from(x).map_err(|_| {
        candle_core::Error::Msg(format!("fused ops on CUDA: {what} of {x} is past 2^31")).bt()
    })
}

/// A launch of `grid` blocks of `threads` with `shared` bytes of dynamic shared memory, opted
/// into past the default 48 KiB where a kernel needs it.
fn config(
    f: &CudaFunction,
    grid: (usize, usize, usize),
    threads: u32,
    shared: usize,
) -> candle_core::Result<LaunchConfig> {
    if grid.1 > 65535 || grid.2 > 65535 || grid.0 > i32::MAX as usize {
        candle_core::bail!("fused ops on CUDA: a grid of {grid:?} blocks is past CUDA's limits");
    }
    if shared > DEFAULT_SHARED {
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared as i32,
        )
        .w()?;
    }
    Ok(LaunchConfig {
        grid_dim: (grid.0 as u32, grid.1 as u32, grid.2 as u32),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared as u32,
    })
}

type Arg<'a> = (&'a CudaStorage, &'a Layout);

/// The attention's forward: the output `[b, sq, nh, d]` and the log-sum-exp `[b, sq, nh]`.
pub(super) fn attention_forward(
    g: &Geometry,
    q: Arg,
    k: Arg,
    v: Arg,
) -> candle_core::Result<(CudaStorage, CudaStorage)> {
    let dev = q.0.device().clone();
    let w = width(g.d)?;
    let shape = Shapes::new(g)?;
    with_elem!(q.0, "fused attention", |T| {
        let (qv, kv, vv) = (view::<T>(q.0, q.1)?, view::<T>(k.0, k.1)?, view::<T>(v.0, v.1)?);
        let st = [strides(q.1, "q")?, strides(k.1, "k")?, strides(v.1, "v")?];
        let mut o = output::<T>(&dev, g.b * g.sq * g.nh * g.d)?;
        let mut lse = output::<f32>(&dev, g.b * g.sq * g.nh)?;
        if g.b * g.sq * g.nh > 0 {
            let f = func::<T>(&dev, &format!("strata_attn_fwd_{}_{w}", T::NAME))?;
            let smem = 4 * (BQ * g.d + 2 * BK * (g.d + 1));
            let cfg = config(&f, (g.sq.div_ceil(BQ), g.nh, g.b), 128, smem)?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&qv).arg(&kv).arg(&vv).arg(&mut o).arg(&mut lse);
            shape.push(&mut b, &st);
            // SAFETY: strata_attn_fwd_*(const T* q, const T* k, const T* v, T* o, float* lse,
            // int sq, skv, nh, nkv, d, long long ×9 strides, float scale, long long window):
            // q, k, v are views of T from their layouts' offsets, read at the strides given
            // (the layouts' own, within their storage); o holds b·sq·nh·d elements and lse
            // b·sq·nh, which the kernel writes at most.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok((
            CudaStorage::wrap_cuda_slice(o, dev.clone()),
            CudaStorage::wrap_cuda_slice(lse, dev.clone()),
        ))
    })
}

/// The scalars every attention kernel takes after its pointers, kept alive for the launch.
struct Shapes {
    ints: [i32; 5],
    scale: f32,
    window: i64,
}

impl Shapes {
    fn new(g: &Geometry) -> candle_core::Result<Shapes> {
        Ok(Shapes {
            ints: [
                int(g.sq, "a query length")?,
                int(g.skv, "a key length")?,
                int(g.nh, "heads")?,
                int(g.nkv, "key/value heads")?,
                int(g.d, "a head width")?,
            ],
            scale: g.scale,
            window: if g.window == usize::MAX { 0 } else { g.window as i64 },
        })
    }

    /// Pushes `sq, skv, nh, nkv, d`, the strides, `scale`, `window`.
    fn push<'a>(&'a self, b: &mut cudarc::driver::LaunchArgs<'a>, st: &'a [[i64; 3]; 3]) {
        for x in &self.ints {
            b.arg(x);
        }
        for s in st.iter().flatten() {
            b.arg(s);
        }
        b.arg(&self.scale).arg(&self.window);
    }
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
    let w = width(g.d)?;
    let shape = Shapes::new(g)?;
    with_elem!(q.0, "fused attention", |T| {
        let (qv, kv, vv) = (view::<T>(q.0, q.1)?, view::<T>(k.0, k.1)?, view::<T>(v.0, v.1)?);
        let st = [strides(q.1, "q")?, strides(k.1, "k")?, strides(v.1, "v")?];
        let ov = dense::<T>(o.0, o.1, "the attention's output")?;
        let dov = dense::<T>(dout.0, dout.1, "the attention's gradient")?;
        let lv = dense::<f32>(lse.0, lse.1, "the log-sum-exp")?;
        let rows = g.b * g.sq * g.nh;
        let mut delta = output::<f32>(&dev, rows)?;
        let mut dq = output::<T>(&dev, rows * g.d)?;
        let mut dk = output::<T>(&dev, g.b * g.skv * g.nkv * g.d)?;
        let mut dv = output::<T>(&dev, g.b * g.skv * g.nkv * g.d)?;
        if rows > 0 {
            let f = func::<T>(&dev, &format!("strata_attn_delta_{}", T::NAME))?;
            let cfg = config(&f, (rows.div_ceil(4), 1, 1), 128, 0)?;
            let (n, d) = (rows as i64, shape.ints[4]);
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&dov).arg(&ov).arg(&mut delta).arg(&n).arg(&d);
            // SAFETY: strata_attn_delta_*(const T* dout, const T* o, float* delta, long long
            // rows, int d): dout and o hold rows·d contiguous elements, delta rows; one warp
            // per row, rows.div_ceil(4) blocks of 4 warps.
            unsafe { b.launch(cfg) }.w()?;

            let f = func::<T>(&dev, &format!("strata_attn_dq_{}_{w}", T::NAME))?;
            let smem = 4 * (2 * BQ * g.d + 2 * BK * (g.d + 1));
            let cfg = config(&f, (g.sq.div_ceil(BQ), g.nh, g.b), 128, smem)?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&qv).arg(&kv).arg(&vv).arg(&dov).arg(&lv).arg(&delta).arg(&mut dq);
            shape.push(&mut b, &st);
            // SAFETY: strata_attn_dq_*(const T* q, k, v, dout, const float* lse, delta, T* dq,
            // int ×5, long long ×9 strides, float scale, long long window): q, k, v as in the
            // forward; dout, lse, delta contiguous of rows·d, rows and rows elements; dq holds
            // rows·d.
            unsafe { b.launch(cfg) }.w()?;
        }
        if g.b * g.skv * g.nkv > 0 {
            let f = func::<T>(&dev, &format!("strata_attn_dkdv_{}_{w}", T::NAME))?;
            let smem = 4 * (2 * BK * (g.d + 1) + 2 * 4 * g.d + 2 * 4 * BK);
            let cfg = config(&f, (g.skv.div_ceil(BK), g.nkv, g.b), 128, smem)?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&qv).arg(&kv).arg(&vv).arg(&dov).arg(&lv).arg(&delta).arg(&mut dk).arg(&mut dv);
            shape.push(&mut b, &st);
            // SAFETY: strata_attn_dkdv_*(const T* q, k, v, dout, const float* lse, delta, T* dk,
            // T* dv, int ×5, long long ×9 strides, float scale, long long window): as for dq;
            // dk and dv hold b·skv·nkv·d elements each. With no query row (sq 0) delta was not
            // written, and no block reads it: every row range is empty.
            unsafe { b.launch(cfg) }.w()?;
        }
        let wrap = |s| CudaStorage::wrap_cuda_slice(s, dev.clone());
        Ok((wrap(dq), wrap(dk), wrap(dv)))
    })
}

/// Threads per block for rows of `hidden`: a multiple of 32, at most 1024.
fn row_threads(hidden: usize) -> u32 {
    hidden.next_multiple_of(32).clamp(32, 1024) as u32
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
        let mut out = output::<T>(&dev, n)?;
        let mut inv = output::<f32>(&dev, rows)?;
        if rows > 0 {
            let f = func::<T>(&dev, &format!("strata_rms_fwd_{}", T::NAME))?;
            let cfg = config(&f, (rows, 1, 1), row_threads(hidden), 0)?;
            let h = int(hidden, "a row")?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&xv).arg(&wv).arg(&mut out).arg(&mut inv).arg(&h).arg(&eps);
            // SAFETY: strata_rms_fwd_*(const T* x, const T* w, T* out, float* inv, int hidden,
            // float eps): x and out hold rows·hidden elements, w hidden, inv rows; one block
            // per row.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            CudaStorage::wrap_cuda_slice(inv, dev.clone()),
        ))
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
        let mut dx = output::<T>(&dev, n)?;
        let mut dw = output::<T>(&dev, hidden)?;
        let mut partial = output::<f32>(&dev, chunks * hidden)?;
        let h = int(hidden, "a row")?;
        if rows > 0 {
            let f = func::<T>(&dev, &format!("strata_rms_dx_{}", T::NAME))?;
            let cfg = config(&f, (rows, 1, 1), row_threads(hidden), 0)?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&xv).arg(&wv).arg(&dyv).arg(&iv).arg(&mut dx).arg(&h);
            // SAFETY: strata_rms_dx_*(const T* x, const T* w, const T* dy, const float* inv,
            // T* dx, int hidden): x, dy, dx of rows·hidden, w of hidden, inv of rows; one block
            // per row.
            unsafe { b.launch(cfg) }.w()?;

            let f = func::<T>(&dev, &format!("strata_rms_dw_partial_{}", T::NAME))?;
            let cfg = config(&f, (hidden.div_ceil(256), chunks, 1), 256, 0)?;
            let (r, c) = (rows as i64, DW_ROWS as i32);
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&xv).arg(&dyv).arg(&iv).arg(&mut partial).arg(&r).arg(&h).arg(&c);
            // SAFETY: strata_rms_dw_partial_*(const T* x, const T* dy, const float* inv, float*
            // partial, long long rows, int hidden, int chunk_rows): partial holds
            // chunks·hidden, one thread per (column, chunk).
            unsafe { b.launch(cfg) }.w()?;
        }
        if hidden > 0 {
            let f = func::<T>(&dev, &format!("strata_rms_dw_sum_{}", T::NAME))?;
            let cfg = config(&f, (hidden.div_ceil(256), 1, 1), 256, 0)?;
            let c = int(chunks, "row chunks")?;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&partial).arg(&mut dw).arg(&c).arg(&h);
            // SAFETY: strata_rms_dw_sum_*(const float* partial, T* dw, int chunks, int hidden):
            // partial of chunks·hidden (written above; with no row, chunks is 0 and it is not
            // read), dw of hidden.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok((
            CudaStorage::wrap_cuda_slice(dx, dev.clone()),
            CudaStorage::wrap_cuda_slice(dw, dev.clone()),
        ))
    })
}

/// Blocks for a grid-stride loop over `n` elements, 256 threads each.
fn stride_blocks(n: usize) -> usize {
    n.div_ceil(256).clamp(1, 1 << 16)
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
    let dims = x.1.dims();
    let (s, h, d) = (dims[1], dims[2], dims[3]);
    let pairs = x.1.shape().elem_count() / 2;
    with_elem!(x.0, "fused rope", |T| {
        let xv = view::<T>(x.0, x.1)?;
        let cv = dense::<f32>(cos.0, cos.1, "rope's cos")?;
        let sv = dense::<f32>(sin.0, sin.1, "rope's sin")?;
        let mut out = output::<T>(&dev, 2 * pairs)?;
        if pairs > 0 {
            let f = func::<T>(&dev, &format!("strata_rope_{}", T::NAME))?;
            let cfg = config(&f, (stride_blocks(pairs), 1, 1), 256, 0)?;
            let ints = [int(s, "a length")?, int(h, "heads")?, int(d, "a head width")?];
            let st: Vec<i64> = x.1.stride().iter().map(|&v| v as i64).collect();
            let (off, inv, n) = (offset as i64, i32::from(inverse), pairs as i64);
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&xv).arg(&mut out).arg(&cv).arg(&sv);
            for v in &ints {
                b.arg(v);
            }
            for v in &st {
                b.arg(v);
            }
            b.arg(&off).arg(&inv).arg(&n);
            // SAFETY: strata_rope_*(const T* x, T* out, const float* cos, const float* sin,
            // int s, int h, int d, long long ×4 strides, long long offset, int inverse, long
            // long pairs): x read at its layout's 4 strides from its offset; out holds 2·pairs
            // elements; cos and sin hold [positions, d] with offset + s <= positions (checked
            // by fused::rope).
            unsafe { b.launch(cfg) }.w()?;
        }
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
        let mut out = output::<T>(&dev, n)?;
        if n > 0 {
            let f = func::<T>(&dev, &format!("strata_swiglu_fwd_{}", T::NAME))?;
            let cfg = config(&f, (stride_blocks(n), 1, 1), 256, 0)?;
            let len = n as i64;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&gv).arg(&uv).arg(&mut out).arg(&len);
            // SAFETY: strata_swiglu_fwd_*(const T* g, const T* u, T* out, long long n): three
            // buffers of n elements.
            unsafe { b.launch(cfg) }.w()?;
        }
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
        let mut dg = output::<T>(&dev, n)?;
        let mut du = output::<T>(&dev, n)?;
        if n > 0 {
            let f = func::<T>(&dev, &format!("strata_swiglu_bwd_{}", T::NAME))?;
            let cfg = config(&f, (stride_blocks(n), 1, 1), 256, 0)?;
            let len = n as i64;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&gv).arg(&uv).arg(&dyv).arg(&mut dg).arg(&mut du).arg(&len);
            // SAFETY: strata_swiglu_bwd_*(const T* g, const T* u, const T* dy, T* dg, T* du,
            // long long n): five buffers of n elements.
            unsafe { b.launch(cfg) }.w()?;
        }
        let wrap = |s| CudaStorage::wrap_cuda_slice(s, dev.clone());
        Ok((wrap(dg), wrap(du)))
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
    Ok(acc.as_cuda_slice_mut::<f32>()?.slice_mut(start..end))
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
        if n > 0 {
            let f = func::<T>(&dev, &format!("strata_grad_acc_{}", T::NAME))?;
            let cfg = config(&f, (stride_blocks(n), 1, 1), 256, 0)?;
            let len = n as i64;
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&mut av).arg(&gv).arg(&len);
            // SAFETY: strata_grad_acc_*(float* acc, const T* g, long long n): acc holds n f32
            // elements from its offset (its layout is contiguous of n elements, checked above),
            // g n elements of T.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(())
    })
}

/// `acc[ids[i]] += rows[i]` in f32 for `i` in order, in place (`fused::index_add_rows`).
pub(super) fn grad_index_add(acc: ArgMut, ids: Arg, rows: Arg) -> candle_core::Result<()> {
    let dev = rows.0.device().clone();
    let (vocab, hidden) = acc.1.shape().dims2()?;
    let n = ids.1.shape().elem_count();
    if rows.1.shape().elem_count() != n * hidden {
        candle_core::bail!("index_add_rows: rows of {:?} for {n} ids", rows.1.dims());
    }
    with_elem!(rows.0, "index_add_rows", |T| {
        let iv = dense::<u32>(ids.0, ids.1, "index_add_rows' ids")?;
        let rv = dense::<T>(rows.0, rows.1, "index_add_rows' rows")?;
        let mut av = sum_view(acc.0, acc.1, "index_add_rows")?;
        if n > 0 && hidden > 0 {
            let f = func::<T>(&dev, &format!("strata_grad_index_add_{}", T::NAME))?;
            let cfg = config(&f, (hidden.div_ceil(128), 1, 1), 128, 0)?;
            let (len, h, v) = (n as i64, int(hidden, "a row")?, vocab as i64);
            let stream = dev.cuda_stream();
            let mut b = stream.launch_builder(&f);
            b.arg(&mut av).arg(&iv).arg(&rv).arg(&len).arg(&h).arg(&v);
            // SAFETY: strata_grad_index_add_*(float* acc, const unsigned int* ids, const T*
            // rows, long long n, int hidden, long long vocab): acc holds vocab·hidden f32
            // elements (its contiguous layout's), ids n u32, rows n·hidden elements of T (both
            // checked above); rows whose id is past vocab are not written.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok(())
    })
}
