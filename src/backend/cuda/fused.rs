//! `cuda/fused.cu`, the kernels of the fused ops (`strata::candle::fused`: attention, RMSNorm
//! (alone or after the residual add), RoPE, SwiGLU and their backwards, and gradients summed in
//! place in f32), compiled at run time with NVRTC, and one safe launcher per kernel. Compiled
//! in every build and written over cudarc alone: the candle side (`src/candle/fused/cuda.rs`)
//! turns candle's storages and layouts into the views and plain numbers these launchers take,
//! and holds no `unsafe`.
//!
//! The source compiles one element type per program (`#define STRATA_ELEM_f32`, `_bf16`,
//! `_f16`, with `cuda/bf16.cuh` prepended): [`FusedKernels::get`] compiles it once per element
//! type and compute capability (the PTX is kept for the life of the process) and loads it once
//! per CUDA context (the module, and so the context, also stay for the life of the process:
//! a later device on the same GPU's primary context finds them loaded).
//!
//! Each launcher takes the geometry (sizes, strides in elements, window, scale) as numbers and
//! its inputs as cudarc views, and before launching checks, with checked arithmetic, that the
//! largest element offset the kernel can reach through those sizes and strides lies inside each
//! view (for a strided tensor `Σ (size − 1) · stride + 1`, for a dense one the product of its
//! sizes), that every size fits the `int` the kernel holds it in (with room for a tile or a
//! block past it), that the grid is within CUDA's limits, and that the head width is one the
//! attention kernels were compiled for. A violated check is an [`Error::InvalidArgument`]
//! saying what did not fit; nothing is launched. Work with no element launches nothing.
//!
//! Each launcher allocates the buffers its kernel writes (outputs, and the backwards' scratch
//! rows), on its stream, and returns them: uninitialised (cudarc's `alloc`, `unsafe`;
//! [`FusedKernels`]' private `uninit` states the contract), since every kernel here writes each
//! element of what it outputs (its grid or its grid-stride loop covers them all; each
//! launcher's `// SAFETY:` says how), so no memset pass precedes it. Only the sums made in
//! place are written into buffers the caller owns and has initialised (`grad_acc`,
//! `grad_index_add`).
//!
//! ## Safety
//! Each launch's `unsafe` block rests on three facts: the function was loaded from the
//! program of the launcher's element type (the type parameter of [`FusedKernels`], which only
//! [`FusedKernels::get`] makes), by a name whose signature the `// SAFETY:` comment states; the
//! arguments pushed match that list in order and type; and every buffer is cudarc's, valid
//! for the launch (cudarc keeps it alive and ordered on its stream), holding at least the
//! elements the kernel can touch (checked before the launch, or allocated so by the
//! launcher). Each allocation's `unsafe` block rests on the kernel launched after it writing
//! every element before anything reads one.

// The launchers' one caller is the candle integration's CUDA path; every build compiles them.
#![cfg_attr(not(feature = "candle-cuda"), allow(dead_code))]

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr, LaunchArgs,
    LaunchConfig, PushKernelArg,
};
use half::{bf16, f16};
use parking_lot::Mutex;

use super::{bind, lib_present, Lib};
use crate::base::error::{Error, Result};
use crate::base::types::DType;

const SOURCE: &str = include_str!("../../../cuda/fused.cu");
/// The bf16 helpers the source uses, prepended before compiling.
const BF16_H: &str = include_str!("../../../cuda/bf16.cuh");

/// Query rows per block of the attention forward and of `dq`; keys per tile (`cuda/fused.cu`'s
/// `BQ` and `BK`). Both kernels run blocks of 4 warps.
const BQ: usize = 16;
const BK: usize = 32;
const ATTN_THREADS: u32 = 128;
/// Shared memory a block may use without opting in.
const DEFAULT_SHARED: usize = 48 << 10;
/// The head widths the attention kernels are compiled for (`_d64`, `_d128`, `_d256`): each
/// keeps `width / 32` elements of a head per lane.
const WIDTHS: [usize; 3] = [64, 128, 256];
/// The largest head the attention kernels take.
pub(crate) const MAX_HEAD: usize = 256;
/// What a size the kernels hold in an `int` must leave below `i32::MAX`: they add a tile (32
/// keys) or a block's threads (up to 1024) to it in `int` arithmetic.
const INT_ROOM: usize = 1024;

/// An element type of `cuda/fused.cu`'s programs. Only strata implements it (the module is
/// private), for f32, bf16 and f16.
pub(crate) trait FusedElem: DeviceRepr + Copy + Send + Sync + Unpin + 'static {
    /// The kernels' suffix and `STRATA_ELEM_` define.
    const NAME: &'static str;
}

impl FusedElem for f32 {
    const NAME: &'static str = "f32";
}

impl FusedElem for bf16 {
    const NAME: &'static str = "bf16";
}

impl FusedElem for f16 {
    const NAME: &'static str = "f16";
}

/// `cuda/fused.cu` as NVRTC compiles it for element type `elem`.
fn source(elem: &str) -> String {
    format!("#define STRATA_ELEM_{elem}\n{BF16_H}{SOURCE}")
}

/// The programs of `cuda/fused.cu` for the compile check (NVRTC without a GPU), one per
/// element type, named as the check reports them.
pub(crate) fn sources() -> [(&'static str, String); 3] {
    [
        ("cuda/fused.cu (f32)", source("f32")),
        ("cuda/fused.cu (bf16)", source("bf16")),
        ("cuda/fused.cu (f16)", source("f16")),
    ]
}

/// The attention kernels (each once per width of [`WIDTHS`]) and the others, in the order
/// [`kernel_names`] lists them and [`Program`] holds them.
const ATTENTION: [&str; 3] = ["attn_fwd", "attn_dq", "attn_dkdv"];
const POINTWISE: [&str; 14] = [
    "attn_delta",
    "rms_fwd",
    "rms_dx",
    "rms_dw_partial",
    "rms_dw_sum",
    "rope",
    "swiglu_fwd",
    "swiglu_bwd",
    "grad_acc",
    "grad_index_add",
    "dequant",
    "add_rms_fwd",
    "swiglu_joined_fwd",
    "swiglu_joined_bwd",
];
/// Indices into [`Program::kernels`].
const FWD: usize = 0;
const DQ: usize = 1;
const DKDV: usize = 2;
const DELTA: usize = 9;
const RMS_FWD: usize = 10;
const RMS_DX: usize = 11;
const RMS_DW_PARTIAL: usize = 12;
const RMS_DW_SUM: usize = 13;
const ROPE: usize = 14;
const SWIGLU_FWD: usize = 15;
const SWIGLU_BWD: usize = 16;
const GRAD_ACC: usize = 17;
const GRAD_INDEX_ADD: usize = 18;
const DEQUANT: usize = 19;
const ADD_RMS_FWD: usize = 20;
const SWIGLU_JOINED_FWD: usize = 21;
const SWIGLU_JOINED_BWD: usize = 22;

/// The `type` index `strata_dequant_<T>` takes for `dtype` (`cuda/fused.cu`'s `dequant_one`):
/// its place among [`DType::ALL`]'s block-quantized dtypes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K …
/// Q6_K, Q8_K).
fn quant_index(dtype: DType) -> Option<usize> {
    DType::ALL.iter().filter(|d| d.is_quantized()).position(|&d| d == dtype)
}

/// What `strata_dequant_<T>` is given for `len` bytes of `dtype`: `(type, block elements, block
/// bytes, elements)`; refused when `dtype` is not one it reads or `len` is not whole blocks.
fn dequant_args(dtype: DType, len: usize) -> Result<(i32, i32, i32, usize)> {
    let what = "dequantize on CUDA";
    let index = quant_index(dtype).ok_or_else(|| {
        Error::InvalidArgument(format!("{what}: {dtype} is not a block-quantized dtype"))
    })?;
    let (elems, size) = dtype.block().expect("a quantized dtype has blocks");
    if len % size != 0 {
        return Err(Error::LengthMismatch {
            got: len as u64,
            expected: (len / size * size) as u64,
            what: format!("{what}: {dtype} data is whole blocks of {size} bytes"),
        });
    }
    let n = (len / size).checked_mul(elems).ok_or_else(|| {
        Error::InvalidArgument(format!("{what}: {len} bytes of {dtype} overflow the elements"))
    })?;
    Ok((index as i32, elems as i32, size as i32, n))
}

/// Every kernel the launchers load from the program of `elem`: `strata_attn_fwd_f32_d64`, ...
fn kernel_names(elem: &str) -> Vec<String> {
    let mut v = Vec::with_capacity(ATTENTION.len() * WIDTHS.len() + POINTWISE.len());
    for k in ATTENTION {
        for w in WIDTHS {
            v.push(format!("strata_{k}_{elem}_d{w}"));
        }
    }
    v.extend(POINTWISE.iter().map(|k| format!("strata_{k}_{elem}")));
    v
}

/// The error for NVRTC missing.
fn no_nvrtc() -> Error {
    Error::Cuda {
        call: "nvrtc",
        message: "the NVRTC library (libnvrtc.so) was not found: install the CUDA runtime \
                  compiler or put its lib directory on LD_LIBRARY_PATH"
            .into(),
    }
}

/// `cuda/fused.cu` for `elem` compiled to PTX for virtual architecture `arch` (`compute_90`),
/// read from the kernel cache where one is set and holds it.
fn compile(elem: &str, arch: &str) -> Result<String> {
    if !lib_present(Lib::Nvrtc) {
        return Err(no_nvrtc());
    }
    // Through the on-disk cache when STRATA_KERNEL_CACHE names one (super::kernel_cache): the
    // processes of one GPU run compile each element type once.
    let (ptx, _) =
        super::kernel_cache::compile_ptx(&source(elem), arch).map_err(|e| Error::Cuda {
            call: "nvrtcCompileProgram",
            message: format!("compiling cuda/fused.cu ({elem}): {e}"),
        })?;
    Ok(ptx)
}

/// The PTX of `elem` for compute capability `cc`, compiled on first use (under the lock: one
/// compile per program, the others wait for it).
fn ptx(cc: (i32, i32), elem: &'static str) -> Result<Arc<str>> {
    type Cache = Vec<(((i32, i32), &'static str), Arc<str>)>;
    static PTX: Mutex<Cache> = Mutex::new(Vec::new());
    let mut cache = PTX.lock();
    if let Some((_, p)) = cache.iter().find(|(key, _)| *key == (cc, elem)) {
        return Ok(p.clone());
    }
    let p: Arc<str> = compile(elem, &format!("compute_{}{}", cc.0, cc.1))?.into();
    cache.push(((cc, elem), p.clone()));
    Ok(p)
}

/// A loaded kernel, and the dynamic shared memory it was opted into (only ever raised, so a
/// launch that asked for less still fits while another thread raises it).
struct Kernel {
    f: CudaFunction,
    shared: Mutex<usize>,
}

impl Kernel {
    /// A launch of `grid` blocks of `threads` with `shared` bytes of dynamic shared memory
    /// (opted into where past the default 48 KiB); `None` for a grid with no block.
    fn config(
        &self,
        what: &str,
        grid: [usize; 3],
        threads: u32,
        shared: usize,
    ) -> Result<Option<LaunchConfig>> {
        if grid.contains(&0) {
            return Ok(None);
        }
        if grid[0] > i32::MAX as usize || grid[1] > 65535 || grid[2] > 65535 {
            return Err(Error::InvalidArgument(format!(
                "{what}: a grid of {grid:?} blocks is past CUDA's limits (2^31 - 1, 65535, \
                 65535)"
            )));
        }
        let bytes = u32::try_from(shared).map_err(|_| {
            Error::InvalidArgument(format!("{what}: {shared} bytes of shared memory"))
        })?;
        if shared > DEFAULT_SHARED {
            let mut set = self.shared.lock();
            if *set < shared {
                self.f
                    .set_attribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
                    .map_err(|e| Error::cuda("cuFuncSetAttribute", e))?;
                *set = shared;
            }
        }
        Ok(Some(LaunchConfig {
            grid_dim: (grid[0] as u32, grid[1] as u32, grid[2] as u32),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: bytes,
        }))
    }
}

/// `cuda/fused.cu` loaded in one context for one element type.
struct Program {
    _module: Arc<CudaModule>,
    /// In [`kernel_names`]' order.
    kernels: Vec<Kernel>,
}

/// The loaded programs: (context, element type).
type Loaded = Vec<((usize, &'static str), Arc<Program>)>;
static LOADED: Mutex<Loaded> = Mutex::new(Vec::new());

/// The kernels of `cuda/fused.cu` for element type `T`, loaded in a stream's context, launched
/// on that stream.
pub(crate) struct FusedKernels<T: FusedElem> {
    program: Arc<Program>,
    stream: Arc<CudaStream>,
    _elem: PhantomData<fn() -> T>,
}

/// Fails unless `len` holds `need` elements (`None`: the extent overflowed).
fn holds(what: &str, buffer: &str, len: usize, need: Option<usize>) -> Result<()> {
    match need {
        Some(n) if n <= len => Ok(()),
        Some(n) => Err(Error::InvalidArgument(format!(
            "{what}: {buffer} holds {len} elements, the kernel reaches {n}"
        ))),
        None => Err(Error::InvalidArgument(format!(
            "{what}: {buffer}'s sizes and strides reach past the address space"
        ))),
    }
}

/// The elements a tensor of `(size, stride)` dimensions spans from its first: the largest
/// offset plus one, 0 when a size is 0; `None` past `usize`.
fn reach(dims: &[(usize, usize)]) -> Option<usize> {
    if dims.iter().any(|&(n, _)| n == 0) {
        return Some(0);
    }
    dims.iter().try_fold(1usize, |acc, &(n, stride)| (n - 1).checked_mul(stride)?.checked_add(acc))
}

/// The product of `sizes`, `None` past `usize`.
fn product(sizes: &[usize]) -> Option<usize> {
    sizes.iter().try_fold(1usize, |acc, &n| acc.checked_mul(n))
}

/// The elements of a buffer a launcher allocates (`None`: its sizes overflowed `usize`).
fn elems(what: &str, buffer: &str, n: Option<usize>) -> Result<usize> {
    n.ok_or_else(|| {
        Error::InvalidArgument(format!("{what}: {buffer}'s sizes overflow the address space"))
    })
}

/// `x` as the `int` a kernel takes, with [`INT_ROOM`] to spare.
fn int(what: &str, name: &str, x: usize) -> Result<i32> {
    match i32::try_from(x) {
        Ok(v) if x <= i32::MAX as usize - INT_ROOM => Ok(v),
        _ => Err(Error::InvalidArgument(format!(
            "{what}: {name} of {x} is past what the kernel's int holds (2^31 - {})",
            INT_ROOM + 1
        ))),
    }
}

/// `x` as the `long long` a kernel takes.
fn long(what: &str, name: &str, x: usize) -> Result<i64> {
    i64::try_from(x)
        .map_err(|_| Error::InvalidArgument(format!("{what}: {name} of {x} is past 2^63")))
}

/// Blocks for a grid-stride loop over `n` elements, 256 threads each.
fn stride_blocks(n: usize) -> usize {
    n.div_ceil(256).clamp(1, 1 << 16)
}

/// The joined SwiGLU's output elements (`rows · inner`, the joint twice that, both checked
/// against overflow) and its grid: columns along x (256 a block, grid-stride), rows along y
/// (at most 65535 blocks, grid-stride); no blocks for no elements.
fn joined_grid(what: &str, rows: usize, inner: usize) -> Result<(usize, [usize; 3])> {
    let n = rows.checked_mul(inner).filter(|n| n.checked_mul(2).is_some()).ok_or_else(|| {
        Error::InvalidArgument(format!("{what}: {rows} rows of {inner} overflow"))
    })?;
    if n == 0 {
        return Ok((0, [0, 1, 1]));
    }
    Ok((n, [inner.div_ceil(256).clamp(1, 1 << 16), rows.min(65535), 1]))
}

/// Threads per block for rows of `hidden`: a multiple of 32, at most 1024 (`block_sum`'s
/// needs).
fn row_threads(hidden: usize) -> u32 {
    hidden.next_multiple_of(32).clamp(32, 1024) as u32
}

/// The shapes of one attention call: `q` is `[b, sq, nh, d]`, `k` and `v` `[b, skv, nkv, d]`,
/// each with the strides of its batch, sequence and head dimensions in elements (the head
/// dimension's stride is 1); the outputs and the saved rows (`o`, `dq`, `lse`, `delta`,
/// `dout`, `dk`, `dv`) are contiguous.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttnShape {
    pub(crate) b: usize,
    pub(crate) sq: usize,
    pub(crate) skv: usize,
    pub(crate) nh: usize,
    pub(crate) nkv: usize,
    pub(crate) d: usize,
    /// `[batch, seq, head]` strides of q, k and v.
    pub(crate) strides: [[usize; 3]; 3],
    pub(crate) scale: f32,
    /// A query sees at most this many positions, itself included; `None`: every earlier one.
    pub(crate) window: Option<usize>,
}

/// An [`AttnShape`] checked, as the attention kernels take it.
struct AttnArgs {
    /// sq, skv, nh, nkv, d.
    ints: [i32; 5],
    /// q's, k's, v's batch, sequence and head strides.
    strides: [i64; 9],
    scale: f32,
    /// 0 for none.
    window: i64,
    /// Index into [`WIDTHS`].
    width: usize,
    /// The elements of q, k and v the kernels reach.
    reach: [Option<usize>; 3],
    /// b · sq · nh (the rows of o, lse, delta, dout, dq) and b · skv · nkv (of dk, dv).
    rows: Option<usize>,
    kv_rows: Option<usize>,
}

impl AttnShape {
    fn check(&self, what: &str) -> Result<AttnArgs> {
        let bad = |why: String| Error::InvalidArgument(format!("{what}: {why}"));
        if self.nkv == 0 || self.nh % self.nkv != 0 {
            return Err(bad(format!(
                "{} query heads are not a multiple of {} key/value heads",
                self.nh, self.nkv
            )));
        }
        if self.sq > self.skv {
            return Err(bad(format!(
                "{} queries over {} keys (the queries are the last positions of the keys)",
                self.sq, self.skv
            )));
        }
        let width = WIDTHS.iter().position(|&w| self.d <= w).ok_or_else(|| {
            bad(format!(
                "the kernels are compiled for heads of at most {MAX_HEAD} elements, not {}: use \
                 llama::Compute::Decomposed",
                self.d
            ))
        })?;
        let window = match self.window {
            None => 0,
            Some(0) => return Err(bad("a sliding window of 0 positions sees nothing".into())),
            // A window past i64 sees every earlier key, as none does.
            Some(w) => i64::try_from(w).unwrap_or(0),
        };
        let mut strides = [0i64; 9];
        for (i, s) in self.strides.iter().flatten().enumerate() {
            strides[i] = long(what, "a stride", *s)?;
        }
        let [q, k, v] = self.strides;
        let qkv = |[sb, ss, sh]: [usize; 3], seq: usize, heads: usize| {
            reach(&[(self.b, sb), (seq, ss), (heads, sh), (self.d, 1)])
        };
        Ok(AttnArgs {
            ints: [
                int(what, "a query length", self.sq)?,
                int(what, "a key length", self.skv)?,
                int(what, "heads", self.nh)?,
                int(what, "key/value heads", self.nkv)?,
                int(what, "a head width", self.d)?,
            ],
            strides,
            scale: self.scale,
            window,
            width,
            reach: [
                qkv(q, self.sq, self.nh),
                qkv(k, self.skv, self.nkv),
                qkv(v, self.skv, self.nkv),
            ],
            rows: product(&[self.b, self.sq, self.nh]),
            kv_rows: product(&[self.b, self.skv, self.nkv]),
        })
    }
}

impl AttnArgs {
    /// Checks q, k and v against what the kernels read of them.
    fn check_qkv<T>(&self, what: &str, [q, k, v]: [&CudaView<'_, T>; 3]) -> Result<()> {
        holds(what, "q", q.len(), self.reach[0])?;
        holds(what, "k", k.len(), self.reach[1])?;
        holds(what, "v", v.len(), self.reach[2])
    }

    /// Pushes `sq, skv, nh, nkv, d`, the nine strides, `scale`, `window`.
    fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        for x in &self.ints {
            b.arg(x);
        }
        for s in &self.strides {
            b.arg(s);
        }
        b.arg(&self.scale).arg(&self.window);
    }

    fn d(&self) -> usize {
        self.ints[4] as usize
    }
}

fn launch_err(e: cudarc::driver::DriverError) -> Error {
    Error::cuda("cuLaunchKernel", e)
}

impl<T: FusedElem> FusedKernels<T> {
    /// The kernels of `T`'s program in `stream`'s context, compiled (NVRTC, for the device's
    /// compute capability) and loaded on first use, launched on `stream`.
    pub(crate) fn get(stream: &Arc<CudaStream>) -> Result<FusedKernels<T>> {
        let ctx = stream.context();
        let key = (ctx.cu_ctx() as usize, T::NAME);
        let found = LOADED.lock().iter().find(|(k, _)| *k == key).map(|(_, p)| p.clone());
        let program = match found {
            Some(p) => p,
            None => {
                let _bound = bind(ctx)?;
                let cc =
                    ctx.compute_capability().map_err(|e| Error::cuda("cuDeviceGetAttribute", e))?;
                let ptx = ptx(cc, T::NAME)?;
                let module = ctx
                    .load_module(cudarc::nvrtc::Ptx::from_src(ptx.to_string()))
                    .map_err(|e| Error::cuda("cuModuleLoadData", e))?;
                let kernels = kernel_names(T::NAME)
                    .iter()
                    .map(|name| {
                        let f = module
                            .load_function(name)
                            .map_err(|e| Error::cuda("cuModuleGetFunction", e))?;
                        Ok(Kernel { f, shared: Mutex::new(0) })
                    })
                    .collect::<Result<Vec<_>>>()?;
                let p = Arc::new(Program { _module: module, kernels });
                let mut loaded = LOADED.lock();
                // Another thread may have loaded it meanwhile: keep the first.
                match loaded.iter().find(|(k, _)| *k == key) {
                    Some((_, first)) => first.clone(),
                    None => {
                        loaded.push((key, p.clone()));
                        p
                    }
                }
            }
        };
        Ok(FusedKernels { program, stream: stream.clone(), _elem: PhantomData })
    }

    fn kernel(&self, index: usize) -> &Kernel {
        &self.program.kernels[index]
    }

    /// A new buffer of `n` elements of `U` (at least one: no empty allocation) on the
    /// launchers' stream, not initialised: no memset pass before the kernel that fills it.
    ///
    /// # Safety
    /// Before anything reads the buffer, the caller launches on this stream a kernel that writes
    /// each of its `n` elements (when `n` is 0, the one element allocated is part of no tensor,
    /// and nothing reads it). A launch refused or failed drops the buffer unread.
    unsafe fn uninit<U: DeviceRepr>(&self, n: usize) -> Result<CudaSlice<U>> {
        let _bound = bind(self.stream.context())?;
        // SAFETY: forwarded from this function's contract: every element is written before it
        // is read.
        unsafe { self.stream.alloc::<U>(n.max(1)) }.map_err(|e| Error::cuda("cuMemAllocAsync", e))
    }

    /// The attention's forward: `o` (`[b, sq, nh, d]`) and each query row's log-sum-exp `lse`
    /// (`[b, sq, nh]`) of `q`, `k`, `v` as `shape` lays them out, in new buffers.
    pub(crate) fn attn_fwd(
        &self,
        shape: &AttnShape,
        [q, k, v]: [&CudaView<'_, T>; 3],
    ) -> Result<(CudaSlice<T>, CudaSlice<f32>)> {
        let what = "fused attention's forward on CUDA";
        let a = shape.check(what)?;
        a.check_qkv(what, [q, k, v])?;
        let rows = elems(what, "o's rows", a.rows)?;
        let n = elems(what, "o", rows.checked_mul(a.d()))?;
        // SAFETY: strata_attn_fwd writes every element of both, launched below: its grid is
        // (sq / BQ rounded up, nh, b), each block's 4 warps hold BQ = 16 query rows (RPW = 4
        // each) and write, for each row below sq, o's d elements (lane + 32·c for c below W /
        // 32, W >= d) and lse (lane 0). A grid with a 0 has rows = b·sq·nh = 0: nothing to write.
        let (mut o, mut lse) = unsafe { (self.uninit::<T>(n)?, self.uninit::<f32>(rows)?) };
        let kernel = self.kernel(FWD * WIDTHS.len() + a.width);
        let smem = 4 * (BQ * a.d() + 2 * BK * (a.d() + 1));
        let grid = [shape.sq.div_ceil(BQ), shape.nh, shape.b];
        let _bound = bind(self.stream.context())?;
        let Some(cfg) = kernel.config(what, grid, ATTN_THREADS, smem)? else { return Ok((o, lse)) };
        let mut b = self.stream.launch_builder(&kernel.f);
        b.arg(q).arg(k).arg(v).arg(&mut o).arg(&mut lse);
        a.push(&mut b);
        // SAFETY: strata_attn_fwd_<T>_d<W>(const T* q, const T* k, const T* v, T* o, float*
        // lse, int sq, int skv, int nh, int nkv, int d, long long ×9 strides, float scale, long
        // long window), W >= d: q read at its strides for b × sq × nh × d, k and v for b × skv
        // × nkv × d (nkv divides nh), each checked to reach inside its view; o holds b·sq·nh·d,
        // lse b·sq·nh (allocated so); shared memory as the kernel lays it out for d.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        Ok((o, lse))
    }

    /// `delta[row] = dout[row] · o[row]` over `rows` contiguous rows of `d`, in a new buffer.
    pub(crate) fn attn_delta(
        &self,
        [rows, d]: [usize; 2],
        [dout, o]: [&CudaView<'_, T>; 2],
    ) -> Result<CudaSlice<f32>> {
        let what = "fused attention's backward (delta) on CUDA";
        let n = product(&[rows, d]);
        holds(what, "the output's gradient", dout.len(), n)?;
        holds(what, "the output", o.len(), n)?;
        let (r, dd) = (long(what, "rows", rows)?, int(what, "a head width", d)?);
        // SAFETY: strata_attn_delta writes delta[row] for every row below rows (lane 0 of warp
        // row: rows.div_ceil(4) blocks of 4 warps), launched below; no row, no block.
        let mut delta = unsafe { self.uninit::<f32>(rows)? };
        let kernel = self.kernel(DELTA);
        let _bound = bind(self.stream.context())?;
        let Some(cfg) = kernel.config(what, [rows.div_ceil(4), 1, 1], ATTN_THREADS, 0)? else {
            return Ok(delta);
        };
        let mut b = self.stream.launch_builder(&kernel.f);
        b.arg(dout).arg(o).arg(&mut delta).arg(&r).arg(&dd);
        // SAFETY: strata_attn_delta_<T>(const T* dout, const T* o, float* delta, long long
        // rows, int d): one warp per row, rows.div_ceil(4) blocks of 4 warps; dout and o hold
        // rows·d elements (checked), delta rows (allocated so).
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        Ok(delta)
    }

    /// The attention's `dq` (`[b, sq, nh, d]`, a new buffer), from q, k, v, the output's
    /// gradient `dout`, the forward's `lse` and [`FusedKernels::attn_delta`]'s `delta`.
    pub(crate) fn attn_dq(
        &self,
        shape: &AttnShape,
        [q, k, v, dout]: [&CudaView<'_, T>; 4],
        [lse, delta]: [&CudaView<'_, f32>; 2],
    ) -> Result<CudaSlice<T>> {
        let what = "fused attention's backward (dq) on CUDA";
        let a = shape.check(what)?;
        a.check_qkv(what, [q, k, v])?;
        let n = a.rows.and_then(|r| r.checked_mul(a.d()));
        holds(what, "the output's gradient", dout.len(), n)?;
        holds(what, "lse", lse.len(), a.rows)?;
        holds(what, "delta", delta.len(), a.rows)?;
        let n = elems(what, "dq", n)?;
        // SAFETY: strata_attn_dq writes every element, launched below: the forward's grid and
        // rows (each row below sq writes its d elements), so a grid with a 0 has none.
        let mut dq = unsafe { self.uninit::<T>(n)? };
        let kernel = self.kernel(DQ * WIDTHS.len() + a.width);
        let smem = 4 * (2 * BQ * a.d() + 2 * BK * (a.d() + 1));
        let grid = [shape.sq.div_ceil(BQ), shape.nh, shape.b];
        let _bound = bind(self.stream.context())?;
        let Some(cfg) = kernel.config(what, grid, ATTN_THREADS, smem)? else { return Ok(dq) };
        let mut b = self.stream.launch_builder(&kernel.f);
        b.arg(q).arg(k).arg(v).arg(dout).arg(lse).arg(delta).arg(&mut dq);
        a.push(&mut b);
        // SAFETY: strata_attn_dq_<T>_d<W>(const T* q, k, v, dout, const float* lse, delta, T*
        // dq, int ×5, long long ×9 strides, float scale, long long window), W >= d: q, k, v as
        // in the forward (checked); dout holds b·sq·nh·d, lse and delta b·sq·nh (checked), dq
        // b·sq·nh·d (allocated so).
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        Ok(dq)
    }

    /// The attention's `dk` and `dv` (`[b, skv, nkv, d]`, new buffers), summed over each
    /// key/value head's query heads; inputs as [`FusedKernels::attn_dq`]'s.
    pub(crate) fn attn_dkdv(
        &self,
        shape: &AttnShape,
        [q, k, v, dout]: [&CudaView<'_, T>; 4],
        [lse, delta]: [&CudaView<'_, f32>; 2],
    ) -> Result<(CudaSlice<T>, CudaSlice<T>)> {
        let what = "fused attention's backward (dk, dv) on CUDA";
        let a = shape.check(what)?;
        a.check_qkv(what, [q, k, v])?;
        holds(
            what,
            "the output's gradient",
            dout.len(),
            a.rows.and_then(|r| r.checked_mul(a.d())),
        )?;
        holds(what, "lse", lse.len(), a.rows)?;
        holds(what, "delta", delta.len(), a.rows)?;
        let n = elems(what, "dk", a.kv_rows.and_then(|r| r.checked_mul(a.d())))?;
        // SAFETY: strata_attn_dkdv writes every element of both, launched below: its grid is
        // (skv / BK rounded up, nkv, b), each block's 4 warps of 8 keys cover BK = 32 keys and
        // write, for each key below skv, its d elements of dk and dv, zeros where no query sees
        // the key (sq 0 included). A grid with a 0 has b·skv·nkv = 0 rows.
        let (mut dk, mut dv) = unsafe { (self.uninit::<T>(n)?, self.uninit::<T>(n)?) };
        let kernel = self.kernel(DKDV * WIDTHS.len() + a.width);
        let smem = 4 * (2 * BK * (a.d() + 1) + 2 * 4 * a.d() + 2 * 4 * BK);
        let grid = [shape.skv.div_ceil(BK), shape.nkv, shape.b];
        let _bound = bind(self.stream.context())?;
        let Some(cfg) = kernel.config(what, grid, ATTN_THREADS, smem)? else { return Ok((dk, dv)) };
        let mut b = self.stream.launch_builder(&kernel.f);
        b.arg(q).arg(k).arg(v).arg(dout).arg(lse).arg(delta).arg(&mut dk).arg(&mut dv);
        a.push(&mut b);
        // SAFETY: strata_attn_dkdv_<T>_d<W>(const T* q, k, v, dout, const float* lse, delta,
        // T* dk, T* dv, int ×5, long long ×9 strides, float scale, long long window), W >= d:
        // q, k, v, dout, lse, delta as for dq (checked; with sq 0 no row is read); dk and dv
        // hold b·skv·nkv·d (allocated so).
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        Ok((dk, dv))
    }

    /// RMSNorm's forward over `rows` contiguous rows of `hidden`: the output and each row's
    /// inverse root mean square, in new buffers.
    pub(crate) fn rms_fwd(
        &self,
        [rows, hidden]: [usize; 2],
        eps: f32,
        [x, w]: [&CudaView<'_, T>; 2],
    ) -> Result<(CudaSlice<T>, CudaSlice<f32>)> {
        let what = "fused rms_norm's forward on CUDA";
        let n = product(&[rows, hidden]);
        holds(what, "the input", x.len(), n)?;
        holds(what, "the weight", w.len(), Some(hidden))?;
        let h = int(what, "a row", hidden)?;
        let n = elems(what, "the output", n)?;
        // SAFETY: strata_rms_fwd writes every element of both, launched below: one block per
        // row (grid rows), its threads striding over the row's hidden elements of out, thread 0
        // writing inv[row]; no row, nothing to write.
        let (mut out, mut inv) = unsafe { (self.uninit::<T>(n)?, self.uninit::<f32>(rows)?) };
        let kernel = self.kernel(RMS_FWD);
        let _bound = bind(self.stream.context())?;
        let Some(cfg) = kernel.config(what, [rows, 1, 1], row_threads(hidden), 0)? else {
            return Ok((out, inv));
        };
        let mut b = self.stream.launch_builder(&kernel.f);
        b.arg(x).arg(w).arg(&mut out).arg(&mut inv).arg(&h).arg(&eps);
        // SAFETY: strata_rms_fwd_<T>(const T* x, const T* w, T* out, float* inv, int hidden,
        // float eps): one block per row of a multiple of 32 threads up to 1024; x holds
        // rows·hidden elements, w hidden (checked), out rows·hidden, inv rows (allocated so).
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        Ok((out, inv))
    }

    /// The residual add and RMSNorm over `rows` contiguous rows of `hidden`, in one pass: `h =
    /// x + r` (rounded once to `T`), the norm of `h` as [`FusedKernels::rms_fwd`] computes it,
    /// and each row's inverse root mean square, in new buffers.
    pub(crate) fn add_rms_fwd(
        &self,
        [rows, hidden]: [usize; 2],
        eps: f32,
        [x, r, w]: [&CudaView<'_, T>; 3],
    ) -> Result<(CudaSlice<T>, CudaSlice<T>, CudaSlice<f32>)> {
        let what = "fused add_rms_norm's forward on CUDA";
        let n = product(&[rows, hidden]);
        holds(what, "the input", x.len(), n)?;
        holds(what, "the residual", r.len(), n)?;
        holds(what, "the weight", w.len(), Some(hidden))?;
        let hd = int(what, "a row", hidden)?;
        let n = elems(what, "the output", n)?;
        // SAFETY: strata_add_rms_fwd writes every element of the three, launched below: one
        // block per row (grid rows), its threads striding over the row's hidden elements of h
        // (the first pass) and of out (the second), thread 0 writing inv[row]; no row, nothing
        // to write.
        let (mut h, mut out, mut inv) =
            unsafe { (self.uninit::<T>(n)?, self.uninit::<T>(n)?, self.uninit::<f32>(rows)?) };
        let kernel = self.kernel(ADD_RMS_FWD);
        let _bound = bind(self.stream.context())?;
        let Some(cfg) = kernel.config(what, [rows, 1, 1], row_threads(hidden), 0)? else {
            return Ok((h, out, inv));
        };
        let mut b = self.stream.launch_builder(&kernel.f);
        b.arg(x).arg(r).arg(w).arg(&mut h).arg(&mut out).arg(&mut inv).arg(&hd).arg(&eps);
        // SAFETY: strata_add_rms_fwd_<T>(const T* x, const T* r, const T* w, T* h, T* out,
        // float* inv, int hidden, float eps): one block per row of a multiple of 32 threads up
        // to 1024; x and r hold rows·hidden elements, w hidden (checked), h and out
        // rows·hidden, inv rows (allocated so).
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        Ok((h, out, inv))
    }

    /// RMSNorm's `dx` over `rows` contiguous rows of `hidden`, in a new buffer.
    pub(crate) fn rms_dx(
        &self,
        [rows, hidden]: [usize; 2],
        [x, w, dy]: [&CudaView<'_, T>; 3],
        inv: &CudaView<'_, f32>,
    ) -> Result<CudaSlice<T>> {
        let what = "fused rms_norm's backward (dx) on CUDA";
        let n = product(&[rows, hidden]);
        holds(what, "the input", x.len(), n)?;
        holds(what, "the weight", w.len(), Some(hidden))?;
        holds(what, "the gradient", dy.len(), n)?;
        holds(what, "the saved rows", inv.len(), Some(rows))?;
        let h = int(what, "a row", hidden)?;
        let n = elems(what, "dx", n)?;
        // SAFETY: strata_rms_dx writes every element, launched below: one block per row, its
        // threads striding over the row's hidden elements; no row, nothing to write.
        let mut dx = unsafe { self.uninit::<T>(n)? };
        let kernel = self.kernel(RMS_DX);
        let _bound = bind(self.stream.context())?;
        let Some(cfg) = kernel.config(what, [rows, 1, 1], row_threads(hidden), 0)? else {
            return Ok(dx);
        };
        let mut b = self.stream.launch_builder(&kernel.f);
        b.arg(x).arg(w).arg(dy).arg(inv).arg(&mut dx).arg(&h);
        // SAFETY: strata_rms_dx_<T>(const T* x, const T* w, const T* dy, const float* inv, T*
        // dx, int hidden): one block per row of a multiple of 32 threads up to 1024; x, dy hold
        // rows·hidden elements, w hidden, inv rows (checked), dx rows·hidden (allocated so).
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        Ok(dx)
    }

    /// The partial sums of RMSNorm's weight gradient, in a new buffer: `partial[c][col]` over
    /// the `chunk_rows` rows of chunk `c`, for `rows.div_ceil(chunk_rows)` chunks.
    pub(crate) fn rms_dw_partial(
        &self,
        [rows, hidden, chunk_rows]: [usize; 3],
        [x, dy]: [&CudaView<'_, T>; 2],
        inv: &CudaView<'_, f32>,
    ) -> Result<CudaSlice<f32>> {
        let what = "fused rms_norm's backward (dw) on CUDA";
        if chunk_rows == 0 {
            return Err(Error::InvalidArgument(format!("{what}: chunks of 0 rows")));
        }
        let chunks = rows.div_ceil(chunk_rows);
        let n = product(&[rows, hidden]);
        holds(what, "the input", x.len(), n)?;
        holds(what, "the gradient", dy.len(), n)?;
        holds(what, "the saved rows", inv.len(), Some(rows))?;
        let (r, h) = (long(what, "rows", rows)?, int(what, "a row", hidden)?);
        let c = int(what, "rows per chunk", chunk_rows)?;
        let n = elems(what, "the partial sums", product(&[chunks, hidden]))?;
        // SAFETY: strata_rms_dw_partial writes every element, launched below: one thread per
        // (column below hidden: hidden / 256 blocks rounded up; chunk: the grid's y, chunks of
        // them), each writing its partial sum; a grid with a 0 has chunks·hidden = 0.
        let mut partial = unsafe { self.uninit::<f32>(n)? };
        let kernel = self.kernel(RMS_DW_PARTIAL);
        let _bound = bind(self.stream.context())?;
        let Some(cfg) = kernel.config(what, [hidden.div_ceil(256), chunks, 1], 256, 0)? else {
            return Ok(partial);
        };
        let mut b = self.stream.launch_builder(&kernel.f);
        b.arg(x).arg(dy).arg(inv).arg(&mut partial).arg(&r).arg(&h).arg(&c);
        // SAFETY: strata_rms_dw_partial_<T>(const T* x, const T* dy, const float* inv, float*
        // partial, long long rows, int hidden, int chunk_rows): one thread per (column below
        // hidden, chunk of the grid's y), reading rows below `rows`; x and dy hold rows·hidden
        // elements, inv rows (checked), partial chunks·hidden (allocated so).
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        Ok(partial)
    }

    /// RMSNorm's weight gradient `dw` (`hidden`, a new buffer): the `chunks` partial sums added
    /// in order (none: zeros).
    pub(crate) fn rms_dw_sum(
        &self,
        [chunks, hidden]: [usize; 2],
        partial: &CudaView<'_, f32>,
    ) -> Result<CudaSlice<T>> {
        let what = "fused rms_norm's backward (dw) on CUDA";
        holds(what, "the partial sums", partial.len(), product(&[chunks, hidden]))?;
        let (c, h) = (int(what, "chunks", chunks)?, int(what, "a row", hidden)?);
        // SAFETY: strata_rms_dw_sum writes every element, launched below: one thread per column
        // below hidden (hidden / 256 blocks rounded up), the sum of 0 chunks included.
        let mut dw = unsafe { self.uninit::<T>(hidden)? };
        let kernel = self.kernel(RMS_DW_SUM);
        let _bound = bind(self.stream.context())?;
        let Some(cfg) = kernel.config(what, [hidden.div_ceil(256), 1, 1], 256, 0)? else {
            return Ok(dw);
        };
        let mut b = self.stream.launch_builder(&kernel.f);
        b.arg(partial).arg(&mut dw).arg(&c).arg(&h);
        // SAFETY: strata_rms_dw_sum_<T>(const float* partial, T* dw, int chunks, int hidden):
        // one thread per column below hidden; partial holds chunks·hidden (checked), dw hidden
        // (allocated so).
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        Ok(dw)
    }

    /// RoPE of `x` (`dims` `[b, s, h, d]`, `strides` in elements) at positions `offset..offset
    /// + s`, or its transpose (`inverse`), into a new contiguous buffer; `cos` and `sin` are
    /// `[positions, d]`.
    pub(crate) fn rope(
        &self,
        [dims, strides]: [[usize; 4]; 2],
        (offset, inverse): (usize, bool),
        x: &CudaView<'_, T>,
        [cos, sin]: [&CudaView<'_, f32>; 2],
    ) -> Result<CudaSlice<T>> {
        let what = "fused rope on CUDA";
        let [_, s, h, d] = dims;
        if d % 2 != 0 {
            return Err(Error::InvalidArgument(format!("{what}: heads of {d}, not an even width")));
        }
        let dense = elems(what, "the output", product(&dims))?;
        // One thread per pair (e, e + d/2) of each head: the output holds 2·pairs.
        let pairs = dense / 2;
        let x_reach = reach(&std::array::from_fn::<_, 4, _>(|i| (dims[i], strides[i])));
        holds(what, "x", x.len(), x_reach)?;
        // No pair, no read of the tables.
        let table =
            if pairs == 0 { Some(0) } else { offset.checked_add(s).and_then(|p| p.checked_mul(d)) };
        holds(what, "cos", cos.len(), table)?;
        holds(what, "sin", sin.len(), table)?;
        let ints =
            [int(what, "a length", s)?, int(what, "heads", h)?, int(what, "a head width", d)?];
        let mut st = [0i64; 4];
        for (i, v) in strides.iter().enumerate() {
            st[i] = long(what, "a stride", *v)?;
        }
        let (off, inv) = (long(what, "an offset", offset)?, i32::from(inverse));
        let n = long(what, "pairs", pairs)?;
        // SAFETY: strata_rope writes every element, launched below: a grid-stride loop over
        // the pairs (every pair whatever the grid), pair (row, e) writing elements e and e + d/2
        // of its row for e below d/2, d even (checked); no pair, no element.
        let mut out = unsafe { self.uninit::<T>(dense)? };
        let kernel = self.kernel(ROPE);
        let grid = [if pairs == 0 { 0 } else { stride_blocks(pairs) }, 1, 1];
        let _bound = bind(self.stream.context())?;
        let Some(cfg) = kernel.config(what, grid, 256, 0)? else { return Ok(out) };
        let mut b = self.stream.launch_builder(&kernel.f);
        b.arg(x).arg(&mut out).arg(cos).arg(sin);
        for v in &ints {
            b.arg(v);
        }
        for v in &st {
            b.arg(v);
        }
        b.arg(&off).arg(&inv).arg(&n);
        // SAFETY: strata_rope_<T>(const T* x, T* out, const float* cos, const float* sin, int
        // s, int h, int d, long long ×4 strides, long long offset, int inverse, long long
        // pairs), pairs = b·s·h·(d/2), d even: x read at its 4 strides for [b, s, h, d] (its
        // reach checked); out holds b·s·h·d elements (allocated so), cos and sin (offset + s)·d
        // (checked).
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        Ok(out)
    }

    /// SwiGLU's forward over `n` contiguous elements: `silu(g) · u`, in a new buffer.
    pub(crate) fn swiglu_fwd(
        &self,
        n: usize,
        [g, u]: [&CudaView<'_, T>; 2],
    ) -> Result<CudaSlice<T>> {
        let what = "fused swiglu's forward on CUDA";
        holds(what, "the gate", g.len(), Some(n))?;
        holds(what, "up", u.len(), Some(n))?;
        let len = long(what, "a length", n)?;
        // SAFETY: strata_swiglu_fwd writes every element, launched below: a grid-stride loop
        // over the n elements (all of them whatever the grid); none, no launch.
        let mut out = unsafe { self.uninit::<T>(n)? };
        let kernel = self.kernel(SWIGLU_FWD);
        let grid = [if n == 0 { 0 } else { stride_blocks(n) }, 1, 1];
        let _bound = bind(self.stream.context())?;
        let Some(cfg) = kernel.config(what, grid, 256, 0)? else { return Ok(out) };
        let mut b = self.stream.launch_builder(&kernel.f);
        b.arg(g).arg(u).arg(&mut out).arg(&len);
        // SAFETY: strata_swiglu_fwd_<T>(const T* g, const T* u, T* out, long long n): a
        // grid-stride loop over n elements of each (checked; out allocated so).
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        Ok(out)
    }

    /// SwiGLU's backward over `n` contiguous elements: the gradients of the gate and of up, in
    /// new buffers.
    pub(crate) fn swiglu_bwd(
        &self,
        n: usize,
        [g, u, dy]: [&CudaView<'_, T>; 3],
    ) -> Result<(CudaSlice<T>, CudaSlice<T>)> {
        let what = "fused swiglu's backward on CUDA";
        holds(what, "the gate", g.len(), Some(n))?;
        holds(what, "up", u.len(), Some(n))?;
        holds(what, "the gradient", dy.len(), Some(n))?;
        let len = long(what, "a length", n)?;
        // SAFETY: strata_swiglu_bwd writes every element of both, launched below: a
        // grid-stride loop over the n elements; none, no launch.
        let (mut dg, mut du) = unsafe { (self.uninit::<T>(n)?, self.uninit::<T>(n)?) };
        let kernel = self.kernel(SWIGLU_BWD);
        let grid = [if n == 0 { 0 } else { stride_blocks(n) }, 1, 1];
        let _bound = bind(self.stream.context())?;
        let Some(cfg) = kernel.config(what, grid, 256, 0)? else { return Ok((dg, du)) };
        let mut b = self.stream.launch_builder(&kernel.f);
        b.arg(g).arg(u).arg(dy).arg(&mut dg).arg(&mut du).arg(&len);
        // SAFETY: strata_swiglu_bwd_<T>(const T* g, const T* u, const T* dy, T* dg, T* du,
        // long long n): a grid-stride loop over n elements of each (checked; dg and du
        // allocated so).
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        Ok((dg, du))
    }

    /// SwiGLU's forward over the joint gate/up GEMM's output `y`, `rows` rows of `2 · inner`
    /// contiguous elements (the gate in the first `inner` columns, up in the next): `silu(gate)
    /// · up`, `rows · inner` elements in a new buffer.
    pub(crate) fn swiglu_joined_fwd(
        &self,
        rows: usize,
        inner: usize,
        y: &CudaView<'_, T>,
    ) -> Result<CudaSlice<T>> {
        let what = "fused swiglu's forward over the joint gate/up on CUDA";
        let (n, grid) = joined_grid(what, rows, inner)?;
        holds(what, "the joint output", y.len(), Some(2 * n))?;
        let (r, i) = (long(what, "rows", rows)?, long(what, "a width", inner)?);
        // SAFETY: strata_swiglu_joined_fwd writes every element, launched below: each row
        // (grid-stride along y) and each column of it (grid-stride along x); none, no launch.
        let mut out = unsafe { self.uninit::<T>(n)? };
        let kernel = self.kernel(SWIGLU_JOINED_FWD);
        let _bound = bind(self.stream.context())?;
        let Some(cfg) = kernel.config(what, grid, 256, 0)? else { return Ok(out) };
        let mut b = self.stream.launch_builder(&kernel.f);
        b.arg(y).arg(&mut out).arg(&r).arg(&i);
        // SAFETY: strata_swiglu_joined_fwd_<T>(const T* y, T* out, long long rows, long long
        // inner): y read over rows · 2·inner elements (checked), out written over rows · inner
        // (allocated so).
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        Ok(out)
    }

    /// SwiGLU's backward over the joint gate/up output `y` (`rows` rows of `2 · inner`) and
    /// the output's gradient `dy` (`rows · inner`): the joint's gradient, `rows · 2 · inner`
    /// elements in a new buffer (the gate's in each row's first `inner` columns, up's in the
    /// next), ready for the joint GEMM's backward.
    pub(crate) fn swiglu_joined_bwd(
        &self,
        rows: usize,
        inner: usize,
        [y, dy]: [&CudaView<'_, T>; 2],
    ) -> Result<CudaSlice<T>> {
        let what = "fused swiglu's backward over the joint gate/up on CUDA";
        let (n, grid) = joined_grid(what, rows, inner)?;
        holds(what, "the joint output", y.len(), Some(2 * n))?;
        holds(what, "the gradient", dy.len(), Some(n))?;
        let (r, i) = (long(what, "rows", rows)?, long(what, "a width", inner)?);
        // SAFETY: strata_swiglu_joined_bwd writes every element, launched below: both halves of
        // each row (grid-stride along y) at each column (grid-stride along x); none, no launch.
        let mut dyj = unsafe { self.uninit::<T>(2 * n)? };
        let kernel = self.kernel(SWIGLU_JOINED_BWD);
        let _bound = bind(self.stream.context())?;
        let Some(cfg) = kernel.config(what, grid, 256, 0)? else { return Ok(dyj) };
        let mut b = self.stream.launch_builder(&kernel.f);
        b.arg(y).arg(dy).arg(&mut dyj).arg(&r).arg(&i);
        // SAFETY: strata_swiglu_joined_bwd_<T>(const T* y, const T* dy, T* dyj, long long rows,
        // long long inner): y read over rows · 2·inner elements and dy over rows · inner
        // (checked), dyj written over rows · 2·inner (allocated so).
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        Ok(dyj)
    }

    /// `acc += g` over `n` contiguous elements, `g` widened to f32: a gradient added in place
    /// into its f32 sum.
    pub(crate) fn grad_acc(
        &self,
        n: usize,
        acc: &mut CudaViewMut<'_, f32>,
        g: &CudaView<'_, T>,
    ) -> Result<()> {
        let what = "accumulate on CUDA";
        holds(what, "the sum", acc.len(), Some(n))?;
        holds(what, "the gradient", g.len(), Some(n))?;
        let len = long(what, "a length", n)?;
        let kernel = self.kernel(GRAD_ACC);
        let grid = [if n == 0 { 0 } else { stride_blocks(n) }, 1, 1];
        let _bound = bind(self.stream.context())?;
        let Some(cfg) = kernel.config(what, grid, 256, 0)? else { return Ok(()) };
        let mut b = self.stream.launch_builder(&kernel.f);
        b.arg(acc).arg(g).arg(&len);
        // SAFETY: strata_grad_acc_<T>(float* acc, const T* g, long long n): a grid-stride loop
        // over n elements of each (checked).
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        Ok(())
    }

    /// `acc[ids[i], :] += rows[i, :]` in f32 for `i` in `0..n` in order: an embedding's rows
    /// added into its f32 gradient (`[vocab, hidden]`), one thread per column. A row whose id
    /// is past `vocab` is left out (the kernel cannot report it; the caller checks the ids).
    pub(crate) fn grad_index_add(
        &self,
        [n, hidden, vocab]: [usize; 3],
        acc: &mut CudaViewMut<'_, f32>,
        ids: &CudaView<'_, u32>,
        rows: &CudaView<'_, T>,
    ) -> Result<()> {
        let what = "index_add_rows on CUDA";
        holds(what, "the table", acc.len(), product(&[vocab, hidden]))?;
        holds(what, "the ids", ids.len(), Some(n))?;
        holds(what, "the rows", rows.len(), product(&[n, hidden]))?;
        let h = int(what, "a row", hidden)?;
        let (len, v) = (long(what, "the ids", n)?, long(what, "the table's rows", vocab)?);
        let kernel = self.kernel(GRAD_INDEX_ADD);
        let grid = [if n == 0 || hidden == 0 { 0 } else { hidden.div_ceil(128) }, 1, 1];
        let _bound = bind(self.stream.context())?;
        let Some(cfg) = kernel.config(what, grid, 128, 0)? else { return Ok(()) };
        let mut b = self.stream.launch_builder(&kernel.f);
        b.arg(acc).arg(ids).arg(rows).arg(&len).arg(&h).arg(&v);
        // SAFETY: strata_grad_index_add_<T>(float* acc, const unsigned int* ids, const T* rows,
        // long long n, int hidden, long long vocab): acc holds vocab·hidden elements, ids n,
        // rows n·hidden (checked); the kernel writes acc only at rows below vocab.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        Ok(())
    }

    /// `src`, whole blocks of the block-quantized `dtype` (GGUF's `Q4_0` … `Q8_K`, as stored),
    /// dequantized into a new buffer, rounded once to `T`, with the arithmetic of
    /// [`quant::dequantize`](crate::base::quant::dequantize) (the same f32 values, bit for bit);
    /// returns it and the elements it holds. Refused, nothing launched: a dtype that is not
    /// block-quantized, bytes that are not whole blocks.
    pub(crate) fn dequantize(
        &self,
        dtype: DType,
        src: &CudaView<'_, u8>,
    ) -> Result<(CudaSlice<T>, usize)> {
        let what = "dequantize on CUDA";
        let (ty, belems, bsize, n) = dequant_args(dtype, src.len())?;
        let len = long(what, "the elements", n)?;
        // SAFETY: strata_dequant writes every element, launched below: a grid-stride loop over
        // the n elements (all of them whatever the grid); none, no launch.
        let mut out = unsafe { self.uninit::<T>(n)? };
        let kernel = self.kernel(DEQUANT);
        let grid = [if n == 0 { 0 } else { stride_blocks(n) }, 1, 1];
        let _bound = bind(self.stream.context())?;
        let Some(cfg) = kernel.config(what, grid, 256, 0)? else { return Ok((out, 0)) };
        let mut b = self.stream.launch_builder(&kernel.f);
        b.arg(src).arg(&mut out).arg(&len).arg(&ty).arg(&belems).arg(&bsize);
        // SAFETY: strata_dequant_<T>(const unsigned char* src, T* out, long long n, int type,
        // int belems, int bsize): a grid-stride loop over the n = blocks · belems elements of
        // out (allocated so), element e reading bytes of block e / belems, all within src's
        // blocks · bsize bytes (src is whole blocks, checked); type is quant_index's.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
        Ok((out, n))
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;

    /// The element types the source compiles for.
    const ELEMS: [&str; 3] = [f32::NAME, bf16::NAME, f16::NAME];

    fn shape() -> AttnShape {
        AttnShape {
            b: 2,
            sq: 3,
            skv: 5,
            nh: 4,
            nkv: 2,
            d: 8,
            strides: [[3 * 4 * 8, 4 * 8, 8], [5 * 2 * 8, 2 * 8, 8], [5 * 2 * 8, 2 * 8, 8]],
            scale: 0.5,
            window: None,
        }
    }

    #[test]
    fn reach_is_the_largest_offset_plus_one() {
        assert_eq!(reach(&[(2, 12), (3, 4), (4, 1)]), Some(24), "dense");
        assert_eq!(reach(&[(2, 1), (3, 2)]), Some(6), "transposed");
        assert_eq!(reach(&[(2, 100), (3, 4), (4, 1)]), Some(112), "padded rows");
        assert_eq!(reach(&[(5, 0), (4, 1)]), Some(4), "broadcast");
        assert_eq!(reach(&[(3, 7), (0, 1)]), Some(0), "empty");
        assert_eq!(reach(&[(1, usize::MAX), (4, 1)]), Some(4), "a size 1 never moves");
        assert_eq!(reach(&[(3, usize::MAX / 2 + 1), (2, 1)]), None, "past usize");
        assert_eq!(product(&[usize::MAX, 2]), None);
        assert_eq!(product(&[3, 0, usize::MAX]), Some(0));
    }

    #[test]
    fn ints_leave_room_for_a_block() {
        assert_eq!(int("t", "x", 5).unwrap(), 5);
        let top = i32::MAX as usize - INT_ROOM;
        assert_eq!(int("t", "x", top).unwrap() as usize, top);
        let e = int("t", "a row", top + 1).unwrap_err().to_string();
        assert!(e.contains("a row of 2147482624"), "{e}");
        assert!(long("t", "a stride", usize::MAX).is_err());
    }

    #[test]
    fn attention_shapes_are_checked_before_a_launch() {
        let a = shape().check("t").unwrap();
        assert_eq!(a.ints, [3, 5, 4, 2, 8]);
        assert_eq!(a.width, 0);
        assert_eq!(a.reach, [Some(2 * 3 * 4 * 8), Some(2 * 5 * 2 * 8), Some(2 * 5 * 2 * 8)]);
        assert_eq!((a.rows, a.kv_rows), (Some(24), Some(20)));
        assert_eq!(a.window, 0);
        let err = |s: AttnShape| s.check("t").err().map(|e| e.to_string()).unwrap_or_default();
        for (d, w) in [(1, 0), (64, 0), (65, 1), (128, 1), (129, 2), (256, 2)] {
            assert_eq!(AttnShape { d, ..shape() }.check("t").unwrap().width, w, "d {d}");
        }
        assert!(err(AttnShape { d: 257, ..shape() }).contains("at most 256 elements, not 257"));
        assert!(err(AttnShape { nkv: 3, ..shape() }).contains("not a multiple of 3"));
        assert!(err(AttnShape { nkv: 0, nh: 0, ..shape() }).contains("not a multiple of 0"));
        assert!(err(AttnShape { sq: 6, ..shape() }).contains("6 queries over 5 keys"));
        assert!(err(AttnShape { window: Some(0), ..shape() }).contains("window of 0"));
        let w = AttnShape { window: Some(3), ..shape() }.check("t").unwrap();
        assert_eq!(w.window, 3);
        let far = AttnShape { window: Some(usize::MAX), ..shape() }.check("t").unwrap();
        assert_eq!(far.window, 0, "a window past every key is none");
        let mut s = shape();
        s.strides[1][0] = usize::MAX;
        assert!(err(s).contains("a stride of"));
        s.strides[1] = [i64::MAX as usize, i64::MAX as usize, 8];
        assert_eq!(s.check("t").unwrap().reach[1], None, "k's reach overflows");
        let e = holds("t", "k", 10, None).unwrap_err().to_string();
        assert!(e.contains("k's sizes and strides reach past"), "{e}");
        let e = holds("t", "q", 10, Some(11)).unwrap_err().to_string();
        assert!(e.contains("q holds 10 elements, the kernel reaches 11"), "{e}");
    }

    #[test]
    fn kernel_indices_follow_the_names() {
        let names = kernel_names("bf16");
        assert_eq!(names.len(), 23);
        for (i, name) in [
            (FWD * 3, "strata_attn_fwd_bf16_d64"),
            (DQ * 3 + 1, "strata_attn_dq_bf16_d128"),
            (DKDV * 3 + 2, "strata_attn_dkdv_bf16_d256"),
            (DELTA, "strata_attn_delta_bf16"),
            (RMS_FWD, "strata_rms_fwd_bf16"),
            (RMS_DX, "strata_rms_dx_bf16"),
            (RMS_DW_PARTIAL, "strata_rms_dw_partial_bf16"),
            (RMS_DW_SUM, "strata_rms_dw_sum_bf16"),
            (ROPE, "strata_rope_bf16"),
            (SWIGLU_FWD, "strata_swiglu_fwd_bf16"),
            (SWIGLU_BWD, "strata_swiglu_bwd_bf16"),
            (GRAD_ACC, "strata_grad_acc_bf16"),
            (GRAD_INDEX_ADD, "strata_grad_index_add_bf16"),
            (DEQUANT, "strata_dequant_bf16"),
            (ADD_RMS_FWD, "strata_add_rms_fwd_bf16"),
            (SWIGLU_JOINED_FWD, "strata_swiglu_joined_fwd_bf16"),
            (SWIGLU_JOINED_BWD, "strata_swiglu_joined_bwd_bf16"),
        ] {
            assert_eq!(names[i], name);
        }
    }

    /// The joined SwiGLU's grid: columns along x, rows along y within CUDA's limits, no
    /// blocks for nothing, sizes that overflow refused before a launch.
    #[test]
    fn the_joined_swiglu_grid_covers_rows_along_y_within_the_limits() {
        assert_eq!(joined_grid("t", 2048, 11008).unwrap(), (2048 * 11008, [43, 2048, 1]));
        assert_eq!(joined_grid("t", 1, 1).unwrap(), (1, [1, 1, 1]));
        assert_eq!(joined_grid("t", 100_000, 300).unwrap(), (30_000_000, [2, 65535, 1]));
        assert_eq!(joined_grid("t", 0, 64).unwrap().0, 0);
        assert!(joined_grid("t", 7, 0).unwrap().1.contains(&0));
        let e = joined_grid("t", usize::MAX / 2, 2).unwrap_err().to_string();
        assert!(e.contains("overflow"), "{e}");
    }

    /// The dequantization's arguments: each block-quantized dtype by its index, whole blocks
    /// counted in elements; anything else refused before a launch.
    #[test]
    fn dequantization_takes_whole_blocks_of_a_quantized_dtype() {
        assert_eq!(dequant_args(DType::Q4_0, 36).unwrap(), (0, 32, 18, 64));
        assert_eq!(dequant_args(DType::Q4K, 144 * 3).unwrap(), (7, 256, 144, 768));
        assert_eq!(dequant_args(DType::Q8K, 0).unwrap(), (10, 256, 292, 0));
        // The kernel's switch: Q4_0 0, Q4_1 1, Q5_0 2, Q5_1 3, Q8_0 4, Q2_K 5 ... Q6_K 9, Q8_K 10.
        let order = [DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::Q2K];
        let k = [DType::Q3K, DType::Q4K, DType::Q5K, DType::Q6K, DType::Q8K];
        for (i, d) in order.iter().chain(&k).enumerate() {
            let (elems, size) = d.block().unwrap();
            assert_eq!(
                dequant_args(*d, size).unwrap(),
                (i as i32, elems as i32, size as i32, elems)
            );
        }
        assert_eq!(DType::ALL.iter().filter(|d| d.is_quantized()).count(), 11);
        let e = dequant_args(DType::Q6K, 211).unwrap_err();
        assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");
        let e = dequant_args(DType::F32, 8).unwrap_err();
        assert!(e.to_string().contains("f32 is not a block-quantized dtype"), "{e}");
    }

    /// Every kernel the launchers load is in the PTX of its element type's program (NVRTC, no
    /// GPU). Without NVRTC a SKIP line, or a failure under `STRATA_REQUIRE_NVRTC=1`.
    #[test]
    fn every_kernel_the_launchers_load_is_in_the_ptx() {
        if !lib_present(Lib::Nvrtc) {
            assert!(
                std::env::var("STRATA_REQUIRE_NVRTC").as_deref() != Ok("1"),
                "STRATA_REQUIRE_NVRTC=1 but no libnvrtc.so loads"
            );
            // Past the test harness's capture, so the line shows in a passing run.
            let _ = writeln!(
                std::io::stderr(),
                "SKIP every_kernel_the_launchers_load_is_in_the_ptx: no libnvrtc.so"
            );
            return;
        }
        std::thread::scope(|s| {
            let runs: Vec<_> =
                ELEMS.map(|elem| s.spawn(move || (elem, compile(elem, "compute_90")))).into();
            for r in runs {
                let (elem, ptx) = r.join().expect("a compile thread");
                let ptx = ptx.unwrap_or_else(|e| panic!("{elem}: {e}"));
                for name in kernel_names(elem) {
                    assert!(ptx.contains(&format!(".entry {name}(")), "no {name} in the PTX");
                }
                // Only this type's kernels: the define picked one.
                let other = ELEMS.iter().find(|&&o| o != elem).expect("three types");
                assert!(!ptx.contains(&format!("strata_rope_{other}(")), "{elem}: {other}'s too");
            }
        });
    }
}
