//! The CUDA C programs strata launches on behalf of the compute above the store (`linalg`,
//! `optim`, `kernels`), each compiled at run time with NVRTC, and one safe launcher per kernel.
//!
//! A launcher takes cudarc views (never raw pointers) and scalars, checks that every buffer
//! holds what the kernel reads or writes, and launches on the given stream. The kernels'
//! signatures are written here once, beside the sources they come from, so a launch is checked
//! against the one place that knows the signature, and the modules above hold no `unsafe`.
//!
//! ## Safety
//! Each launcher's `unsafe` block rests on three facts: the function was loaded from the source
//! named in its program (so its parameter list is the one the `// SAFETY:` comment states); the
//! arguments pushed match that list in order and type; and each buffer is a cudarc view, valid
//! for the launch (cudarc keeps it alive and ordered on its stream), holding at least the
//! elements the kernel touches (checked before the launch, an error otherwise).

use std::sync::Arc;

use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, CudaView, CudaViewMut, DevicePtr,
    DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits,
};
use half::bf16;

use super::{bind, load_kernels};
use crate::base::error::{Error, Result};

/// The bf16 helpers the sources use, prepended before compiling.
const BF16_H: &str = include_str!("../../../cuda/bf16.cuh");
const VERIFY: &str = include_str!("../../../cuda/verify.cu");
const MLP: &str = include_str!("../../../cuda/mlp.cu");
const OPTIM: &str = include_str!("../../../cuda/optim.cu");

/// Every CUDA C source strata compiles, with the helpers it is compiled with: what a compile
/// check (NVRTC without a GPU) goes through.
/// `cuda/fused.cu` (the fused ops' kernels) is compiled once per element type, as it runs.
fn sources() -> Vec<(&'static str, String)> {
    let mut v = vec![
        ("cuda/verify.cu", VERIFY.to_string()),
        ("cuda/mlp.cu", format!("{BF16_H}{MLP}")),
        ("cuda/optim.cu", format!("{BF16_H}{OPTIM}")),
        ("cuda/bench.cu", super::probe::BENCH_SOURCE.to_string()),
    ];
    v.extend(super::fused::sources());
    v
}

/// Compiles every CUDA C source strata launches with NVRTC for `arch` (`compute_90`, say),
/// without a GPU: each source's name and its compiler log on failure. Fails as a whole only when
/// NVRTC itself is missing.
pub(crate) fn compile_sources(
    arch: &str,
) -> Result<Vec<(&'static str, std::result::Result<(), String>)>> {
    if !super::lib_present(super::Lib::Nvrtc) {
        return Err(Error::Cuda {
            call: "nvrtc",
            message: "the NVRTC library (libnvrtc.so) was not found".into(),
        });
    }
    Ok(sources()
        .into_iter()
        .map(|(name, src)| {
            let opts = cudarc::nvrtc::CompileOptions {
                options: vec![format!("--gpu-architecture={arch}")],
                ..Default::default()
            };
            (
                name,
                cudarc::nvrtc::compile_ptx_with_opts(src, opts)
                    .map(drop)
                    .map_err(|e| e.to_string()),
            )
        })
        .collect())
}

/// Blocks of the loss kernel, and so the length of its partial sums.
pub(crate) const LOSS_PARTIALS: usize = 264;

/// A float the kernels and cuBLAS take: `bf16` or `f32`. Public but unreachable outside the
/// crate (the module is private), so only strata implements it.
pub trait GpuFloat: DeviceRepr + ValidAsZeroBits + Copy + Unpin + Send + Sync + 'static {
    /// Index into the per-type kernel tables (0: bf16, 1: f32).
    const INDEX: usize;
    /// 1 and 0 (GEMM's alpha and beta).
    const ONE: Self;
    /// 0.
    const ZERO: Self;

    /// cuBLAS's GEMM for this type.
    ///
    /// # Safety
    /// As cudarc's [`Gemm::gemm`]: the configuration must describe the three buffers.
    #[doc(hidden)]
    unsafe fn raw_gemm(
        blas: &CudaBlas,
        cfg: GemmConfig<Self>,
        a: &CudaView<'_, Self>,
        b: &CudaView<'_, Self>,
        c: &mut CudaViewMut<'_, Self>,
    ) -> std::result::Result<(), cudarc::cublas::result::CublasError>;
}

impl GpuFloat for bf16 {
    const INDEX: usize = 0;
    const ONE: bf16 = bf16::ONE;
    const ZERO: bf16 = bf16::ZERO;
    unsafe fn raw_gemm(
        blas: &CudaBlas,
        cfg: GemmConfig<bf16>,
        a: &CudaView<'_, bf16>,
        b: &CudaView<'_, bf16>,
        c: &mut CudaViewMut<'_, bf16>,
    ) -> std::result::Result<(), cudarc::cublas::result::CublasError> {
        // SAFETY: the caller's contract is cudarc's.
        unsafe { blas.gemm(cfg, a, b, c) }
    }
}

impl GpuFloat for f32 {
    const INDEX: usize = 1;
    const ONE: f32 = 1.0;
    const ZERO: f32 = 0.0;
    unsafe fn raw_gemm(
        blas: &CudaBlas,
        cfg: GemmConfig<f32>,
        a: &CudaView<'_, f32>,
        b: &CudaView<'_, f32>,
        c: &mut CudaViewMut<'_, f32>,
    ) -> std::result::Result<(), cudarc::cublas::result::CublasError> {
        // SAFETY: the caller's contract is cudarc's.
        unsafe { blas.gemm(cfg, a, b, c) }
    }
}

/// A transpose flag of [`gemm`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Op {
    /// As stored.
    N,
    /// Transposed.
    T,
}

/// Elements a column-major `rows × cols` operand with leading dimension `ld` spans.
fn span(rows: usize, cols: usize, ld: usize) -> Option<usize> {
    if rows == 0 || cols == 0 {
        return Some(0);
    }
    ld.checked_mul(cols - 1)?.checked_add(rows)
}

/// `c = op(a) · op(b)` in cuBLAS's column-major terms (`c` is `m × n`, the inner dimension `k`,
/// leading dimensions `ld = [lda, ldb, ldc]`), alpha 1 and beta 0, on the handle's stream.
/// Every operand is checked to hold what its dimensions span, and each leading dimension to be
/// no less than its operand's rows, before cuBLAS runs.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm<T: GpuFloat>(
    blas: &CudaBlas,
    ops: [Op; 2],
    [m, n, k]: [usize; 3],
    [lda, ldb, ldc]: [usize; 3],
    a: &CudaView<'_, T>,
    b: &CudaView<'_, T>,
    c: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    let dims = |what: &str| Error::InvalidArgument(format!("GEMM operands do not fit: {what}"));
    let (ar, ac) = if ops[0] == Op::N { (m, k) } else { (k, m) };
    let (br, bc) = if ops[1] == Op::N { (k, n) } else { (n, k) };
    for (name, rows, cols, ld, len) in
        [("A", ar, ac, lda, a.len()), ("B", br, bc, ldb, b.len()), ("C", m, n, ldc, c.len())]
    {
        if ld < rows.max(1) {
            return Err(dims(&format!("{name}'s leading dimension {ld} < its {rows} rows")));
        }
        match span(rows, cols, ld) {
            Some(need) if need <= len => {}
            _ => return Err(dims(&format!("{name} spans more than its {len} elements"))),
        }
    }
    let int = |v: usize| i32::try_from(v).map_err(|_| dims("a dimension past i32"));
    let op = |o: Op| match o {
        Op::N => cublasOperation_t::CUBLAS_OP_N,
        Op::T => cublasOperation_t::CUBLAS_OP_T,
    };
    let cfg = GemmConfig {
        transa: op(ops[0]),
        transb: op(ops[1]),
        m: int(m)?,
        n: int(n)?,
        k: int(k)?,
        alpha: T::ONE,
        lda: int(lda)?,
        ldb: int(ldb)?,
        beta: T::ZERO,
        ldc: int(ldc)?,
    };
    // SAFETY: the dimensions and leading dimensions were checked above to describe memory
    // inside the three views, which cudarc keeps valid and ordered on their stream.
    unsafe { T::raw_gemm(blas, cfg, a, b, c) }
        .map_err(|e| Error::Cuda { call: "cublasGemmEx", message: e.to_string() })
}

/// An input type of [`add_at_b_f32`]: f32, bf16 or f16, as cuBLAS names it.
// Its one caller is the candle integration's CUDA path (`fused::add_weight_grad`); every build
// compiles it.
#[cfg_attr(not(feature = "candle-cuda"), allow(dead_code))]
pub(crate) trait GemmInput: DeviceRepr {
    /// cuBLAS's name of the type.
    const CUDA_TYPE: cudaDataType_t;
}

impl GemmInput for f32 {
    const CUDA_TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_32F;
}

impl GemmInput for bf16 {
    const CUDA_TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_16BF;
}

impl GemmInput for half::f16 {
    const CUDA_TYPE: cudaDataType_t = cudaDataType_t::CUDA_R_16F;
}

/// `c += aᵀ · b` with `c` in f32, all three row-major and dense (`a` `[k, m]`, `b` `[k, n]`, `c`
/// `[m, n]`), on `stream` (the handle's: the one it was created or last set with): one `cublasGemmEx` with inputs of `T`, an f32 output,
/// compute type 32F (every product and sum in f32, 16-bit inputs widened exactly), alpha 1 and
/// beta 1. The same layout and arithmetic as the host's `backend::gemm::add_at_b`
/// (the sums' order is cuBLAS's). For a linear layer `y = x·Wᵀ`: `a` is `dY` (`[rows, out]`),
/// `b` is `X` (`[rows, in]`), `c` the weight's f32 gradient (`[out, in]`). Each view is checked
/// to hold what its dimensions span and each dimension to fit an `int` before cuBLAS runs.
#[cfg_attr(not(feature = "candle-cuda"), allow(dead_code))]
pub(crate) fn add_at_b_f32<T: GemmInput>(
    blas: &CudaBlas,
    stream: &CudaStream,
    [k, m, n]: [usize; 3],
    a: &CudaView<'_, T>,
    b: &CudaView<'_, T>,
    c: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    let dims = |what: &str| Error::InvalidArgument(format!("c += aᵀ·b does not fit: {what}"));
    for (name, rows, cols, len) in
        [("a", k, m, a.len()), ("b", k, n, b.len()), ("c", m, n, c.len())]
    {
        match rows.checked_mul(cols) {
            Some(need) if need <= len => {}
            _ => return Err(dims(&format!("{name} holds {len} elements, not {rows} × {cols}"))),
        }
    }
    if k == 0 || m == 0 || n == 0 {
        return Ok(());
    }
    let int = |v: usize| i32::try_from(v).map_err(|_| dims("a dimension past i32"));
    let (k32, m32, n32) = (int(k)?, int(m)?, int(n)?);
    let (alpha, beta) = (1f32, 1f32);
    // In cuBLAS's column-major terms the row-major `c` is `cᵀ` (`n × m`, leading dimension
    // `n`) = `bᵀ` (`b` as stored: `n × k`, leading dimension `n`, not transposed) times `a`
    // (`a` as stored is `m × k` with leading dimension `m`, so transposed to `k × m`).
    let (bp, _b_record) = b.device_ptr(stream);
    let (ap, _a_record) = a.device_ptr(stream);
    let (cp, _c_record) = c.device_ptr_mut(stream);
    // SAFETY: cublasGemmEx reads `n·k` elements of type `T` from `bp` (leading dimension `n`),
    // `m·k` from `ap` (leading dimension `m`) and reads and writes `n·m` f32 from `cp` (leading
    // dimension `n`); the views were checked above to hold at least that many, and cudarc keeps
    // them alive and ordered on `stream`, the handle's (the records above, dropped after the call,
    // mark their use). The types passed are the views' (`T::CUDA_TYPE`, `CUDA_R_32F`), and
    // alpha and beta point to f32s, as compute type 32F requires.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            cublasOperation_t::CUBLAS_OP_N,
            cublasOperation_t::CUBLAS_OP_T,
            n32,
            m32,
            k32,
            (&alpha) as *const f32 as *const _,
            bp as *const _,
            T::CUDA_TYPE,
            n32,
            ap as *const _,
            T::CUDA_TYPE,
            m32,
            (&beta) as *const f32 as *const _,
            cp as *mut _,
            cudaDataType_t::CUDA_R_32F,
            n32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| Error::Cuda { call: "cublasGemmEx", message: e.to_string() })
}

/// Blocks of 256 threads for a grid-stride loop over `n` elements (at most 16 per SM of the
/// largest GPU strata is tuned for).
pub(crate) fn grid(n: u64) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 132 * 16) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

fn launch_err(e: cudarc::driver::DriverError) -> Error {
    Error::cuda("cuLaunchKernel", e)
}

/// Fails unless `len >= need`: a buffer too short for the kernel.
fn holds(what: &str, len: usize, need: usize) -> Result<()> {
    if len < need {
        return Err(Error::InvalidArgument(format!(
            "kernel buffer too short: {what} holds {len} elements, the kernel touches {need}"
        )));
    }
    Ok(())
}

/// `cuda/verify.cu`: a checksum and a fill pattern over a byte buffer.
pub(crate) struct Verify {
    _module: Arc<CudaModule>,
    checksum: CudaFunction,
    fill: CudaFunction,
}

/// The grid of the verification kernels.
const VERIFY_GRID: LaunchConfig =
    LaunchConfig { grid_dim: (264, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };

impl Verify {
    /// Compiles and loads the program in `ctx`.
    pub(crate) fn load(ctx: &Arc<CudaContext>) -> Result<Verify> {
        let (module, [checksum, fill]) =
            load_kernels(ctx, VERIFY, ["strata_checksum", "strata_fill"])?;
        Ok(Verify { _module: module, checksum, fill })
    }

    /// Adds `repeats` passes of the checksum over `data` into `out[0]`, on `s`.
    pub(crate) fn checksum(
        &self,
        s: &Arc<CudaStream>,
        data: &CudaView<'_, u8>,
        repeats: u32,
        out: &mut CudaViewMut<'_, u64>,
    ) -> Result<()> {
        holds("the checksum's output", out.len(), 1)?;
        let n = data.len() as u64;
        let _bound = bind(s.context())?;
        let mut b = s.launch_builder(&self.checksum);
        b.arg(data).arg(&n).arg(&repeats).arg(out);
        // SAFETY: strata_checksum(const u8*, u64 n, u32, u64*): reads the `n` bytes of `data`,
        // writes out[0] (checked to exist).
        unsafe { b.launch(VERIFY_GRID) }.map_err(launch_err)?;
        Ok(())
    }

    /// Writes the fill pattern of `seed` over `data`, on `s`.
    pub(crate) fn fill(
        &self,
        s: &Arc<CudaStream>,
        data: &mut CudaViewMut<'_, u8>,
        seed: u32,
    ) -> Result<()> {
        let n = data.len() as u64;
        let _bound = bind(s.context())?;
        let mut b = s.launch_builder(&self.fill);
        b.arg(data).arg(&n).arg(&seed);
        // SAFETY: strata_fill(u8*, u64 n, u32): writes the `n` bytes of `data`.
        unsafe { b.launch(VERIFY_GRID) }.map_err(launch_err)?;
        Ok(())
    }
}

/// `cuda/mlp.cu`: the elementwise kernels of `linalg` (per type where it says `[2]`, indexed
/// by [`GpuFloat::INDEX`]).
pub(crate) struct Mlp {
    _module: Arc<CudaModule>,
    sgd: CudaFunction,
    fill: [CudaFunction; 2],
    relu: [CudaFunction; 2],
    relu_mask: [CudaFunction; 2],
    loss_grad: [CudaFunction; 2],
    accumulate: [CudaFunction; 2],
}

impl Mlp {
    /// Compiles and loads the program in `ctx`.
    pub(crate) fn load(ctx: &Arc<CudaContext>) -> Result<Mlp> {
        let (module, f) = load_kernels(
            ctx,
            &format!("{BF16_H}{MLP}"),
            [
                "strata_sgd_bf16",
                "strata_fill_bf16",
                "strata_fill_f32",
                "strata_relu_bf16",
                "strata_relu_f32",
                "strata_relu_mask_bf16",
                "strata_relu_mask_f32",
                "strata_loss_grad_bf16",
                "strata_loss_grad_f32",
                "strata_accumulate_bf16",
                "strata_accumulate_f32",
            ],
        )?;
        let [sgd, fill0, fill1, relu0, relu1, mask0, mask1, loss0, loss1, acc0, acc1] = f;
        Ok(Mlp {
            _module: module,
            sgd,
            fill: [fill0, fill1],
            relu: [relu0, relu1],
            relu_mask: [mask0, mask1],
            loss_grad: [loss0, loss1],
            accumulate: [acc0, acc1],
        })
    }

    /// `x[i] = v` for every element.
    pub(crate) fn fill<T: GpuFloat>(
        &self,
        s: &Arc<CudaStream>,
        x: &mut CudaViewMut<'_, T>,
        v: T,
    ) -> Result<()> {
        let n = x.len() as u64;
        let _bound = bind(s.context())?;
        let mut b = s.launch_builder(&self.fill[T::INDEX]);
        b.arg(x).arg(&v).arg(&n);
        // SAFETY: strata_fill_{bf16,f32}(T*, T, u64 n): writes the `n` elements of `x`.
        unsafe { b.launch(grid(n)) }.map_err(launch_err)?;
        Ok(())
    }

    /// `w -= lr · g` in f32, rounded once to bf16, over every element of `w`.
    pub(crate) fn sgd_bf16(
        &self,
        s: &Arc<CudaStream>,
        w: &mut CudaViewMut<'_, bf16>,
        g: &CudaView<'_, bf16>,
        lr: f32,
    ) -> Result<()> {
        holds("the gradient", g.len(), w.len())?;
        let n = w.len() as u64;
        let _bound = bind(s.context())?;
        let mut b = s.launch_builder(&self.sgd);
        b.arg(w).arg(g).arg(&lr).arg(&n);
        // SAFETY: strata_sgd_bf16(u16*, const u16*, f32, u64 n): `n` elements of `w` and of
        // `g` (checked), bf16 being a u16 in memory.
        unsafe { b.launch(grid(n)) }.map_err(launch_err)?;
        Ok(())
    }

    /// `x = max(x, 0)` for every element.
    pub(crate) fn relu<T: GpuFloat>(
        &self,
        s: &Arc<CudaStream>,
        x: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        let n = x.len() as u64;
        let _bound = bind(s.context())?;
        let mut b = s.launch_builder(&self.relu[T::INDEX]);
        b.arg(x).arg(&n);
        // SAFETY: strata_relu_{bf16,f32}(T*, u64 n): the `n` elements of `x`.
        unsafe { b.launch(grid(n)) }.map_err(launch_err)?;
        Ok(())
    }

    /// `g[i] = 0` where `a[i] <= 0`, for every element of `g`.
    pub(crate) fn relu_mask<T: GpuFloat>(
        &self,
        s: &Arc<CudaStream>,
        g: &mut CudaViewMut<'_, T>,
        a: &CudaView<'_, T>,
    ) -> Result<()> {
        holds("the activations", a.len(), g.len())?;
        let n = g.len() as u64;
        let _bound = bind(s.context())?;
        let mut b = s.launch_builder(&self.relu_mask[T::INDEX]);
        b.arg(g).arg(a).arg(&n);
        // SAFETY: strata_relu_mask_{bf16,f32}(T*, const T*, u64 n): `n` elements of each
        // (checked).
        unsafe { b.launch(grid(n)) }.map_err(launch_err)?;
        Ok(())
    }

    /// `g = (out − y) · scale` over every element of `g`, and the squared differences summed
    /// per block into `partials` (one per block, [`LOSS_PARTIALS`] blocks).
    pub(crate) fn loss_grad<T: GpuFloat>(
        &self,
        s: &Arc<CudaStream>,
        out: &CudaView<'_, T>,
        y: &CudaView<'_, T>,
        g: &mut CudaViewMut<'_, T>,
        scale: f32,
        partials: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        holds("the outputs", out.len(), g.len())?;
        holds("the targets", y.len(), g.len())?;
        holds("the loss partials", partials.len(), LOSS_PARTIALS)?;
        let n = g.len() as u64;
        let _bound = bind(s.context())?;
        let mut b = s.launch_builder(&self.loss_grad[T::INDEX]);
        b.arg(out).arg(y).arg(g).arg(&scale).arg(partials).arg(&n);
        let cfg = LaunchConfig {
            grid_dim: (LOSS_PARTIALS as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: strata_loss_grad_{bf16,f32}(const T*, const T*, T*, f32, f32*, u64 n): `n`
        // elements of out, y and g (checked), one partial per block of the LOSS_PARTIALS-block
        // grid (checked).
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        Ok(())
    }

    /// `acc = (first ? 0 : acc) + g` in f32, over every element of `acc`.
    pub(crate) fn accumulate<T: GpuFloat>(
        &self,
        s: &Arc<CudaStream>,
        acc: &mut CudaViewMut<'_, f32>,
        g: &CudaView<'_, T>,
        first: bool,
    ) -> Result<()> {
        holds("the gradient", g.len(), acc.len())?;
        let n = acc.len() as u64;
        let first = i32::from(first);
        let _bound = bind(s.context())?;
        let mut b = s.launch_builder(&self.accumulate[T::INDEX]);
        b.arg(acc).arg(g).arg(&first).arg(&n);
        // SAFETY: strata_accumulate_{bf16,f32}(f32*, const T*, i32, u64 n): `n` elements of
        // each (checked).
        unsafe { b.launch(grid(n)) }.map_err(launch_err)?;
        Ok(())
    }
}

/// A gradient the optimizer kernels read: f32 or bf16.
pub(crate) enum GradView<'a, 'b> {
    F32(&'a CudaView<'b, f32>),
    Bf16(&'a CudaView<'b, bf16>),
}

impl GradView<'_, '_> {
    fn len(&self) -> usize {
        match self {
            GradView::F32(g) => g.len(),
            GradView::Bf16(g) => g.len(),
        }
    }
}

/// AdamW's scalars for one step, as `strata_adamw` takes them (`cuda/optim.cu`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamArgs {
    pub(crate) decay: f32,
    pub(crate) w: f32,
    pub(crate) w_rest: f32,
    pub(crate) w_hi: bool,
    pub(crate) b2: f32,
    pub(crate) one_minus_b2: f32,
    pub(crate) step_size: f32,
    pub(crate) bc2_sqrt: f32,
    pub(crate) eps: f32,
}

/// `cuda/optim.cu`: the optimizer's updates over f32 masters (and AdamW's moments), reading an
/// f32 or bf16 gradient and writing the bf16 weights when there are any.
pub(crate) struct OptimKernels {
    _module: Arc<CudaModule>,
    adamw: CudaFunction,
    sgd: CudaFunction,
}

impl OptimKernels {
    /// Compiles and loads the program in `ctx`.
    pub(crate) fn load(ctx: &Arc<CudaContext>) -> Result<OptimKernels> {
        let (module, [adamw, sgd]) =
            load_kernels(ctx, &format!("{BF16_H}{OPTIM}"), ["strata_adamw", "strata_sgd"])?;
        Ok(OptimKernels { _module: module, adamw, sgd })
    }

    /// Checks the operands of an update over `p.len()` elements; returns that length.
    fn check(p: usize, grad: &GradView<'_, '_>, out: Option<usize>) -> Result<u64> {
        holds("the gradient", grad.len(), p)?;
        if let Some(o) = out {
            holds("the bf16 weights", o, p)?;
        }
        Ok(p as u64)
    }

    /// One AdamW step over every element of `p` (f32 masters), `m`, `v` (its moments), reading
    /// `grad` (each value times `grad_scale`: clipping's factor, 1 for none) and writing `out`
    /// (the bf16 weights) when given.
    pub(crate) fn adamw(
        &self,
        s: &Arc<CudaStream>,
        [p, m, v]: [&mut CudaViewMut<'_, f32>; 3],
        grad: GradView<'_, '_>,
        grad_scale: f32,
        out: Option<&mut CudaViewMut<'_, bf16>>,
        a: AdamArgs,
    ) -> Result<()> {
        let n = Self::check(p.len(), &grad, out.as_ref().map(|o| o.len()))?;
        holds("the first moment", m.len(), p.len())?;
        holds("the second moment", v.len(), p.len())?;
        let _bound = bind(s.context())?;
        let mut b = s.launch_builder(&self.adamw);
        b.arg(p).arg(m).arg(v);
        let grad_bf16 = i32::from(matches!(grad, GradView::Bf16(_)));
        match grad {
            GradView::F32(g) => b.arg(g),
            GradView::Bf16(g) => b.arg(g),
        };
        b.arg(&grad_bf16).arg(&grad_scale);
        let null = 0u64;
        match out {
            Some(o) => b.arg(o),
            None => b.arg(&null),
        };
        let w_hi = i32::from(a.w_hi);
        b.arg(&n).arg(&a.decay).arg(&a.w).arg(&a.w_rest).arg(&w_hi).arg(&a.b2);
        b.arg(&a.one_minus_b2).arg(&a.step_size).arg(&a.bc2_sqrt).arg(&a.eps);
        // SAFETY: strata_adamw(float* p, float* m, float* v, const void* grad, int grad_bf16,
        // float grad_scale, u16* out, u64 n, float x3, int, float x5): `n` elements of p, m, v,
        // grad (of the type grad_bf16 says) and out or a null pointer (all checked above).
        unsafe { b.launch(grid(n)) }.map_err(launch_err)?;
        Ok(())
    }

    /// One SGD step (`p -= lr · (grad · grad_scale + weight_decay · p)` as `strata_sgd` does)
    /// over every element of `p`, writing `out` when given.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn sgd(
        &self,
        s: &Arc<CudaStream>,
        p: &mut CudaViewMut<'_, f32>,
        grad: GradView<'_, '_>,
        grad_scale: f32,
        out: Option<&mut CudaViewMut<'_, bf16>>,
        lr: f32,
        weight_decay: f32,
    ) -> Result<()> {
        let n = Self::check(p.len(), &grad, out.as_ref().map(|o| o.len()))?;
        let _bound = bind(s.context())?;
        let mut b = s.launch_builder(&self.sgd);
        b.arg(p);
        let grad_bf16 = i32::from(matches!(grad, GradView::Bf16(_)));
        match grad {
            GradView::F32(g) => b.arg(g),
            GradView::Bf16(g) => b.arg(g),
        };
        b.arg(&grad_bf16).arg(&grad_scale);
        let null = 0u64;
        match out {
            Some(o) => b.arg(o),
            None => b.arg(&null),
        };
        b.arg(&n).arg(&lr).arg(&weight_decay);
        // SAFETY: strata_sgd(float* p, const void* grad, int grad_bf16, float grad_scale, u16*
        // out, u64 n, float, float): `n` elements of p, grad and out or a null pointer (checked
        // above).
        unsafe { b.launch(grid(n)) }.map_err(launch_err)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operand_spans_follow_the_leading_dimension() {
        assert_eq!(span(3, 2, 3), Some(6));
        assert_eq!(span(3, 2, 5), Some(8), "the last column needs only its rows");
        assert_eq!(span(0, 7, 1), Some(0));
        assert_eq!(span(1, usize::MAX, usize::MAX), None);
    }

    #[test]
    fn every_source_is_listed_for_the_compile_check() {
        let names: Vec<_> = sources().into_iter().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            [
                "cuda/verify.cu",
                "cuda/mlp.cu",
                "cuda/optim.cu",
                "cuda/bench.cu",
                "cuda/fused.cu (f32)",
                "cuda/fused.cu (bf16)",
                "cuda/fused.cu (f16)"
            ]
        );
    }
}
