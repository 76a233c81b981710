//! cuDNN 9's fused scaled-dot-product attention (tensor cores, forward and backward) through
//! `libstrata_attn.so`, strata's own shim over cuDNN's graph API (`cuda/attention/`), loaded
//! at run time with `dlopen`: nothing of cuDNN is needed to build strata, and a missing library
//! is an [`Error::LibraryUnavailable`] saying how to build it (`benches/gpu/build-attention`).
//!
//! The library is looked for at `STRATA_ATTN_LIB` when that is set (and only there), else
//! beside the running program, else on the library path. It needs cuDNN 9 and the CUDA 13
//! runtime on the library path (the GPU lease's probe puts PyTorch's there).
//!
//! [`describe`] turns a call's shape (strata's `[batch, seq, heads, head_dim]` with any strides)
//! into the C interface's `strata_attn_desc` and runs the checks the C side runs before it
//! touches CUDA (sizes, strides, head widths, heads, the window): pure functions, tested without
//! the library or a GPU. [`AttentionLib::forward`] and [`AttentionLib::backward`] then check
//! that every cudarc view holds what the shape reaches, allocate the workspace on the caller's
//! stream and queue cuDNN's kernels there: nothing waits for the device.
//!
//! ## Safety
//! The library's functions are called through pointers read with `dlsym` from a library whose
//! ABI version (`strata_attn_abi_version`) is the one [`Desc`] and the signatures here were
//! written for (`cuda/attention/strata_attn.h`, `STRATA_ATTN_ABI_VERSION` 1). Each call passes
//! a desc the checks accepted, device pointers of cudarc views that hold every element the
//! desc's sizes and strides reach (checked before the call; the views' guards order the call
//! after their last writes on the stream and record it as a use), and the stream of the
//! context that is current on the thread.

// Its one caller is the candle integration's CUDA path (feature `candle-cuda`); every build
// compiles and tests it.
#![cfg_attr(not(feature = "candle-cuda"), allow(dead_code))]

use std::ffi::{c_char, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr,
};
use half::{bf16, f16};

use super::bind;
use crate::base::error::{Error, Result};

/// The library's file name.
pub(crate) const LIB_NAME: &str = "libstrata_attn.so";
/// The variable naming the library's path.
pub(crate) const LIB_ENV: &str = "STRATA_ATTN_LIB";
/// `STRATA_ATTN_ABI_VERSION` of the header this module was written against.
const ABI_VERSION: i32 = 1;
/// What to do when the library does not load.
const HOW: &str = "build it with `bash benches/gpu/build-attention` (g++ and PyPI's cuDNN 9 \
                   wheels; `benches/gpu/run prepare` does it for the GPU lease), then set \
                   STRATA_ATTN_LIB to its path or put it beside the program, with cuDNN 9 and \
                   the CUDA 13 runtime on LD_LIBRARY_PATH";

/// `strata_attn_status`.
const OK: i32 = 0;
const INVALID_ARGUMENT: i32 = 1;
const UNSUPPORTED: i32 = 2;

/// The tensors of a call, as indices of [`SdpaShape::strides`] and of the C desc's strides.
pub(crate) const Q: usize = 0;
pub(crate) const K: usize = 1;
pub(crate) const V: usize = 2;
pub(crate) const O: usize = 3;
pub(crate) const DOUT: usize = 4;
pub(crate) const DQ: usize = 5;
pub(crate) const DK: usize = 6;
pub(crate) const DV: usize = 7;
const NAMES: [&str; 8] = ["q", "k", "v", "o", "dout", "dq", "dk", "dv"];

/// The element types cuDNN's fused SDPA takes (`strata_attn_dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum SdpaDtype {
    Bf16 = 0,
    F16 = 1,
}

/// An element type of the library's calls: bf16 or f16.
pub(crate) trait SdpaElem: DeviceRepr {
    const DTYPE: SdpaDtype;
}

impl SdpaElem for bf16 {
    const DTYPE: SdpaDtype = SdpaDtype::Bf16;
}

impl SdpaElem for f16 {
    const DTYPE: SdpaDtype = SdpaDtype::F16;
}

/// Forward (q, k, v → o, lse) or backward (… → dq, dk, dv).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    Forward,
    Backward,
}

impl Direction {
    /// The tensors the direction names: the forward's q, k, v, o; the backward's eight.
    fn tensors(self) -> usize {
        match self {
            Direction::Forward => 4,
            Direction::Backward => 8,
        }
    }

    fn is_output(self, t: usize) -> bool {
        match self {
            Direction::Forward => t == O,
            Direction::Backward => t >= DQ,
        }
    }

    fn flag(self) -> i32 {
        (self == Direction::Backward) as i32
    }
}

/// One attention call in strata's terms: `q`, `o`, `dout`, `dq` are `[b, sq, nh, d]`, `k`,
/// `v`, `dk`, `dv` `[b, skv, nkv, d]`, each with its four strides in elements, in that order;
/// the queries are the last `sq` of the `skv` positions.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SdpaShape {
    pub(crate) b: usize,
    pub(crate) sq: usize,
    pub(crate) skv: usize,
    pub(crate) nh: usize,
    pub(crate) nkv: usize,
    pub(crate) d: usize,
    /// `[batch, seq, head, head_dim]` strides of q, k, v, o, dout, dq, dk, dv.
    pub(crate) strides: [[usize; 4]; 8],
    pub(crate) scale: f32,
    pub(crate) causal: bool,
    /// A query sees at most this many positions, itself included; `None`: every earlier one.
    pub(crate) window: Option<usize>,
    pub(crate) dtype: SdpaDtype,
}

impl SdpaShape {
    /// `[b, s, h, d]` sizes of tensor `t`.
    fn sizes(&self, t: usize) -> [usize; 4] {
        if matches!(t, K | V | DK | DV) {
            [self.b, self.skv, self.nkv, self.d]
        } else {
            [self.b, self.sq, self.nh, self.d]
        }
    }

    /// The elements of the log-sum-exp, f32 `[b, nh, sq, 1]`.
    pub(crate) fn lse_len(&self) -> usize {
        self.b * self.nh * self.sq
    }

    /// Everything the shape holds, as a key (equal keys: calls cuDNN's one graph runs).
    pub(crate) fn key(&self) -> ShapeKey {
        ShapeKey {
            sizes: [self.b, self.sq, self.skv, self.nh, self.nkv, self.d],
            strides: self.strides,
            scale: self.scale.to_bits(),
            causal: self.causal,
            window: self.window,
            dtype: self.dtype,
        }
    }
}

/// [`SdpaShape::key`]: the shape with its scale's bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ShapeKey {
    sizes: [usize; 6],
    strides: [[usize; 4]; 8],
    scale: u32,
    causal: bool,
    window: Option<usize>,
    dtype: SdpaDtype,
}

/// The strides of a contiguous `[b, s, h, d]` tensor.
pub(crate) fn dense_strides([_, s, h, d]: [usize; 4]) -> [usize; 4] {
    [s * h * d, h * d, d, 1]
}

/// `strata_attn_desc`, field for field (`cuda/attention/strata_attn.h`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Desc {
    struct_size: u32,
    dtype: i32,
    batch: i64,
    heads: i64,
    kv_heads: i64,
    q_len: i64,
    kv_len: i64,
    head_dim: i64,
    /// `[batch, head, seq, head_dim]` strides (cuDNN's order).
    strides: [[i64; 4]; 8],
    scale: f32,
    causal: i32,
    window: i64,
}

fn invalid(why: String) -> Error {
    Error::InvalidArgument(format!("cuDNN attention: {why}"))
}

/// The elements tensor `t` spans from its first (largest offset + 1); `None` past `i64`.
fn reach(shape: &SdpaShape, t: usize) -> Option<usize> {
    let n = shape.sizes(t);
    let r = (0..4)
        .try_fold(1usize, |acc, i| (n[i] - 1).checked_mul(shape.strides[t][i])?.checked_add(acc))?;
    (r <= i64::MAX as usize).then_some(r)
}

/// Whether no two elements of tensor `t` share an address (as the C side's `disjoint`).
fn disjoint(shape: &SdpaShape, t: usize) -> bool {
    let n = shape.sizes(t);
    let mut dims: Vec<(usize, usize)> =
        (0..4).filter(|&i| n[i] > 1).map(|i| (shape.strides[t][i], n[i])).collect();
    dims.sort_unstable();
    let mut span = 1usize;
    for (stride, size) in dims {
        if stride < span {
            return false;
        }
        match (size - 1).checked_mul(stride).and_then(|x| x.checked_add(span)) {
            Some(s) => span = s,
            None => return false,
        }
    }
    true
}

/// `shape` as the library's desc for `dir`, after the checks the C side makes before any CUDA
/// call (`check_desc` in `cuda/attention/strata_attn.cpp`), so that a refusal is strata's typed
/// error whether or not the library is there.
pub(crate) fn describe(shape: &SdpaShape, dir: Direction) -> Result<Desc> {
    let s = shape;
    for (name, v) in
        [("batch", s.b), ("heads", s.nh), ("kv heads", s.nkv), ("queries", s.sq), ("keys", s.skv)]
    {
        if v == 0 || v > i32::MAX as usize {
            return Err(invalid(format!("{v} {name}: from 1 to 2^31 - 1")));
        }
    }
    if s.d == 0 || s.d % 8 != 0 || s.d > 256 {
        return Err(invalid(format!(
            "a head width of {}: cuDNN's fused SDPA takes multiples of 8 up to 256 (64 and 128 \
             on every GPU it runs on)",
            s.d
        )));
    }
    if s.nh % s.nkv != 0 {
        return Err(invalid(format!(
            "{} query heads are not a multiple of {} key/value heads",
            s.nh, s.nkv
        )));
    }
    if !s.scale.is_finite() || s.scale <= 0.0 {
        return Err(invalid(format!("scale {}: a finite number above 0", s.scale)));
    }
    if s.causal && s.sq > s.skv {
        return Err(invalid(format!(
            "{} queries over {} keys with a causal mask: the queries are the last positions \
             of the keys, so there are at least as many keys",
            s.sq, s.skv
        )));
    }
    if s.window == Some(0) {
        return Err(invalid("a sliding window of 0 positions sees nothing".into()));
    }
    if s.window.is_some() && !s.causal {
        return Err(invalid(
            "a sliding window without the causal mask: cuDNN's SDPA bounds the window on the \
             causal diagonal only"
                .into(),
        ));
    }
    if dir == Direction::Backward && s.sq == 1 && s.skv == 1 {
        return Err(invalid("cuDNN's SDPA backward does not take one query over one key".into()));
    }
    let mut strides = [[0i64; 4]; 8];
    for t in 0..dir.tensors() {
        let (n, st) = (s.sizes(t), s.strides[t]);
        if st[3] != 1 {
            return Err(invalid(format!(
                "{}'s head dimension has stride {}: cuDNN's SDPA reads whole head rows (stride \
                 1); make it contiguous first",
                NAMES[t], st[3]
            )));
        }
        if let Some(i) = (0..3).find(|&i| n[i] > 1 && st[i] % 8 != 0) {
            return Err(invalid(format!(
                "{}'s stride {i} is {} elements: cuDNN's SDPA loads rows of 16 bytes, so \
                 strides are multiples of 8 elements",
                NAMES[t], st[i]
            )));
        }
        if reach(s, t).is_none() {
            return Err(invalid(format!(
                "{}'s sizes and strides reach past 2^63 elements",
                NAMES[t]
            )));
        }
        if dir.is_output(t) && !disjoint(s, t) {
            return Err(invalid(format!(
                "{}'s strides make two of its elements share an address: an output is written \
                 once per element",
                NAMES[t]
            )));
        }
        // strata's [b, s, h, d] to cuDNN's [b, h, s, d]; each below 2^63 (the reach is).
        strides[t] = [st[0] as i64, st[2] as i64, st[1] as i64, st[3] as i64];
    }
    Ok(Desc {
        struct_size: std::mem::size_of::<Desc>() as u32,
        dtype: s.dtype as i32,
        batch: s.b as i64,
        heads: s.nh as i64,
        kv_heads: s.nkv as i64,
        q_len: s.sq as i64,
        kv_len: s.skv as i64,
        head_dim: s.d as i64,
        strides,
        scale: s.scale,
        causal: s.causal as i32,
        // A window as wide as the keys hides nothing.
        window: s.window.filter(|&w| w < s.skv).map_or(0, |w| w as i64),
    })
}

/// Fails unless the view of tensor `name` (`len` elements) holds the `need` its shape reaches.
fn holds(name: &str, len: usize, need: usize) -> Result<()> {
    if len < need {
        return Err(invalid(format!("{name} holds {len} elements, its shape reaches {need}")));
    }
    Ok(())
}

type CheckFn = unsafe extern "C" fn(*const Desc, i32) -> i32;
type WorkspaceFn = unsafe extern "C" fn(*const Desc, i32, *mut usize) -> i32;
type ForwardFn = unsafe extern "C" fn(
    *const Desc,
    *const c_void,
    *const c_void,
    *const c_void,
    *mut c_void,
    *mut f32,
    usize,
    *mut c_void,
    usize,
    *mut c_void,
) -> i32;
type BackwardFn = unsafe extern "C" fn(
    *const Desc,
    *const c_void,
    *const c_void,
    *const c_void,
    *const c_void,
    *const c_void,
    *const f32,
    usize,
    *mut c_void,
    *mut c_void,
    *mut c_void,
    *mut c_void,
    usize,
    *mut c_void,
) -> i32;

/// `libstrata_attn.so`, loaded (for the life of the process: it is never closed).
pub(crate) struct AttentionLib {
    path: String,
    cudnn_version: usize,
    check: CheckFn,
    workspace_size: WorkspaceFn,
    forward: ForwardFn,
    backward: BackwardFn,
    last_error: unsafe extern "C" fn() -> *const c_char,
}

/// Where the library is looked for: `STRATA_ATTN_LIB` alone when set; else beside the running
/// program, then by name on the library path.
fn candidates() -> Vec<String> {
    if let Some(p) = std::env::var_os(LIB_ENV) {
        return vec![p.to_string_lossy().into_owned()];
    }
    let mut v = Vec::new();
    if let Some(dir) = std::env::current_exe().ok().as_deref().and_then(Path::parent) {
        let beside: PathBuf = dir.join(LIB_NAME);
        if beside.exists() {
            v.push(beside.to_string_lossy().into_owned());
        }
    }
    v.push(LIB_NAME.to_string());
    v
}

fn unavailable(why: String) -> Error {
    Error::LibraryUnavailable { library: LIB_NAME, why, how: HOW }
}

/// `dlerror()`'s message, or `fallback`.
fn dl_error(fallback: &str) -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string owned by libc, valid until the
    // next dl* call on this thread; it is copied at once.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        fallback.to_string()
    } else {
        // SAFETY: as above, non-null and NUL-terminated.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

impl AttentionLib {
    /// The library, loaded on first use; every later call gets the same one, or the same
    /// error.
    pub(crate) fn get() -> Result<&'static AttentionLib> {
        static LIB: OnceLock<std::result::Result<AttentionLib, String>> = OnceLock::new();
        LIB.get_or_init(|| {
            let mut tried = Vec::new();
            for path in candidates() {
                match Self::open(&path) {
                    Ok(lib) => return Ok(lib),
                    Err(why) => tried.push(format!("{path}: {why}")),
                }
            }
            Err(tried.join("; "))
        })
        .as_ref()
        .map_err(|why| unavailable(why.clone()))
    }

    /// Loads `path` and reads its functions, or says why not.
    fn open(path: &str) -> std::result::Result<AttentionLib, String> {
        let c = CString::new(path).map_err(|_| "a path with a NUL byte".to_string())?;
        // SAFETY: `c` is a NUL-terminated path; loading the library runs its static
        // initialisers (cudnn_frontend's and the C++ runtime's), which take no input of ours.
        // The handle is never closed, so the function pointers below stay valid.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            return Err(dl_error("dlopen failed"));
        }
        let sym = |name: &str| -> std::result::Result<*mut c_void, String> {
            let n = CString::new(name).map_err(|_| "a symbol name with a NUL byte".to_string())?;
            // SAFETY: `h` is a live handle from dlopen and `n` a NUL-terminated name.
            let p = unsafe { libc::dlsym(h, n.as_ptr()) };
            if p.is_null() {
                Err(format!("no symbol {name} (another library of that name?)"))
            } else {
                Ok(p)
            }
        };
        // SAFETY: `strata_attn_abi_version` is `int (void)` in every version of the header.
        let abi = unsafe {
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> i32>(sym(
                "strata_attn_abi_version",
            )?)()
        };
        if abi != ABI_VERSION {
            return Err(format!(
                "its interface is version {abi}, this strata speaks version {ABI_VERSION}: \
                 rebuild it from this checkout"
            ));
        }
        // SAFETY: each transmute reads a symbol that is the function of `strata_attn.h` version
        // ABI_VERSION (checked just above) whose C signature its type spells.
        let lib = unsafe {
            AttentionLib {
                path: path.to_string(),
                cudnn_version: 0,
                check: std::mem::transmute::<*mut c_void, CheckFn>(sym("strata_attn_check")?),
                workspace_size: std::mem::transmute::<*mut c_void, WorkspaceFn>(sym(
                    "strata_attn_workspace_size",
                )?),
                forward: std::mem::transmute::<*mut c_void, ForwardFn>(sym(
                    "strata_attn_sdpa_forward",
                )?),
                backward: std::mem::transmute::<*mut c_void, BackwardFn>(sym(
                    "strata_attn_sdpa_backward",
                )?),
                last_error: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn() -> *const c_char,
                >(sym("strata_attn_last_error")?),
            }
        };
        // SAFETY: `size_t (void)`, of the checked version; it returns 0 rather than let
        // libcudnn abort when cuDNN's parts are missing.
        let version = unsafe {
            std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> usize>(sym(
                "strata_attn_cudnn_version",
            )?)()
        };
        if version == 0 {
            return Err("it loaded, but cuDNN 9's parts (libcudnn_graph.so.9 and the others \
                        beside libcudnn.so.9) do not: put cuDNN's whole lib folder on \
                        LD_LIBRARY_PATH"
                .into());
        }
        Ok(AttentionLib { cudnn_version: version, ..lib })
    }

    /// Where it was loaded from.
    pub(crate) fn path(&self) -> &str {
        &self.path
    }

    /// cuDNN's version as loaded (`91900` for 9.19.0).
    pub(crate) fn cudnn_version(&self) -> usize {
        self.cudnn_version
    }

    /// The library's last message on this thread, as a strata error for `status` of `call`.
    fn error(&self, call: &'static str, status: i32) -> Error {
        // SAFETY: `strata_attn_last_error` returns a NUL-terminated string owned by the library
        // (thread-local), valid until this thread's next call into it; it is copied at once.
        let msg = unsafe {
            let p = (self.last_error)();
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        match status {
            INVALID_ARGUMENT | UNSUPPORTED => invalid(msg),
            _ => Error::Cuda { call, message: format!("status {status}: {msg}") },
        }
    }

    /// The library's own checks of `desc` (the ones [`describe`] mirrors); no GPU needed.
    pub(crate) fn check(&self, desc: &Desc, dir: Direction) -> Result<()> {
        // SAFETY: `desc` is a valid `strata_attn_desc` for the call's duration.
        let st = unsafe { (self.check)(desc, dir.flag()) };
        if st == OK {
            Ok(())
        } else {
            Err(self.error("strata_attn_check", st))
        }
    }

    /// The bytes of workspace a call of `desc` needs (the library builds and caches cuDNN's
    /// graph on the current device: `stream`'s context is made current for it).
    fn workspace_bytes(
        &self,
        stream: &Arc<CudaStream>,
        desc: &Desc,
        dir: Direction,
    ) -> Result<usize> {
        let _bound = bind(stream.context())?;
        let mut bytes = 0usize;
        // SAFETY: `desc` passed the checks; `bytes` is a valid place for the answer.
        let st = unsafe { (self.workspace_size)(desc, dir.flag(), &mut bytes) };
        if st != OK {
            return Err(self.error("strata_attn_workspace_size", st));
        }
        Ok(bytes)
    }

    /// Whether the library takes calls of `shape`, forward and backward: strata's and the
    /// library's checks, then cuDNN's graphs of both directions built on `stream`'s device
    /// (cached by the library, so the calls that follow build nothing). Gives the workspace
    /// bytes of the forward and of the backward; the error says why not (a shape cuDNN's SDPA
    /// does not take on this GPU is a refusal of its graph).
    pub(crate) fn supports(
        &self,
        stream: &Arc<CudaStream>,
        shape: &SdpaShape,
    ) -> Result<[usize; 2]> {
        let mut bytes = [0; 2];
        for (i, dir) in [Direction::Forward, Direction::Backward].into_iter().enumerate() {
            let desc = describe(shape, dir)?;
            self.check(&desc, dir)?;
            bytes[i] = self.workspace_bytes(stream, &desc, dir)?;
        }
        Ok(bytes)
    }

    /// A workspace of the bytes a call of `desc` needs (and that count), on `stream`,
    /// uninitialised ([`Self::workspace_bytes`]).
    fn workspace(
        &self,
        stream: &Arc<CudaStream>,
        desc: &Desc,
        dir: Direction,
    ) -> Result<(CudaSlice<u8>, usize)> {
        let bytes = self.workspace_bytes(stream, desc, dir)?;
        // SAFETY: the workspace is scratch cuDNN writes before it reads; nothing reads its
        // first contents, so no initialisation is needed.
        let ws = unsafe { stream.alloc::<u8>(bytes.max(1)) }
            .map_err(|e| Error::cuda("cuMemAllocAsync", e))?;
        Ok((ws, bytes))
    }

    /// `o = softmax(scale · q kᵀ + mask) v` and each query row's log-sum-exp (`lse`, f32
    /// `[b, nh, sq]`), queued on `stream`.
    pub(crate) fn forward<T: SdpaElem>(
        &self,
        stream: &Arc<CudaStream>,
        shape: &SdpaShape,
        [q, k, v]: [&CudaView<T>; 3],
        o: &mut CudaViewMut<T>,
        lse: &mut CudaViewMut<f32>,
    ) -> Result<()> {
        let desc = self.prepare::<T>(shape, Direction::Forward)?;
        for (t, len) in [(Q, q.len()), (K, k.len()), (V, v.len()), (O, o.len())] {
            holds(NAMES[t], len, reach(shape, t).unwrap_or(usize::MAX))?;
        }
        holds("the log-sum-exp ([b, heads, q_len])", lse.len(), shape.lse_len())?;
        let (mut ws, bytes) = self.workspace(stream, &desc, Direction::Forward)?;
        let _bound = bind(stream.context())?;
        let (qp, _gq) = q.device_ptr(stream);
        let (kp, _gk) = k.device_ptr(stream);
        let (vp, _gv) = v.device_ptr(stream);
        let (op, _go) = o.device_ptr_mut(stream);
        let (lp, _gl) = lse.device_ptr_mut(stream);
        let (wp, _gw) = ws.device_ptr_mut(stream);
        // SAFETY: see the module's Safety: the desc passed the checks, each view holds what
        // the desc reaches (checked above), the workspace holds the bytes asked for, and the
        // stream's context is current; the guards order the call on `stream`.
        let st = unsafe {
            (self.forward)(
                &desc,
                qp as *const c_void,
                kp as *const c_void,
                vp as *const c_void,
                op as *mut c_void,
                lp as *mut f32,
                shape.lse_len(),
                wp as *mut c_void,
                bytes,
                stream.cu_stream() as *mut c_void,
            )
        };
        if st == OK {
            Ok(())
        } else {
            Err(self.error("strata_attn_sdpa_forward", st))
        }
    }

    /// `dq`, `dk`, `dv` of the forward that gave `o` and `lse`, for the output's gradient
    /// `dout`, queued on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward<T: SdpaElem>(
        &self,
        stream: &Arc<CudaStream>,
        shape: &SdpaShape,
        [q, k, v, o, dout]: [&CudaView<T>; 5],
        lse: &CudaView<f32>,
        [dq, dk, dv]: [&mut CudaViewMut<T>; 3],
    ) -> Result<()> {
        let desc = self.prepare::<T>(shape, Direction::Backward)?;
        for (t, len) in [
            (Q, q.len()),
            (K, k.len()),
            (V, v.len()),
            (O, o.len()),
            (DOUT, dout.len()),
            (DQ, dq.len()),
            (DK, dk.len()),
            (DV, dv.len()),
        ] {
            holds(NAMES[t], len, reach(shape, t).unwrap_or(usize::MAX))?;
        }
        holds("the log-sum-exp ([b, heads, q_len])", lse.len(), shape.lse_len())?;
        let (mut ws, bytes) = self.workspace(stream, &desc, Direction::Backward)?;
        let _bound = bind(stream.context())?;
        let (qp, _gq) = q.device_ptr(stream);
        let (kp, _gk) = k.device_ptr(stream);
        let (vp, _gv) = v.device_ptr(stream);
        let (op, _go) = o.device_ptr(stream);
        let (dop, _gdo) = dout.device_ptr(stream);
        let (lp, _gl) = lse.device_ptr(stream);
        let (dqp, _gdq) = dq.device_ptr_mut(stream);
        let (dkp, _gdk) = dk.device_ptr_mut(stream);
        let (dvp, _gdv) = dv.device_ptr_mut(stream);
        let (wp, _gw) = ws.device_ptr_mut(stream);
        // SAFETY: as the forward's, for the backward's eight tensors and the log-sum-exp.
        let st = unsafe {
            (self.backward)(
                &desc,
                qp as *const c_void,
                kp as *const c_void,
                vp as *const c_void,
                op as *const c_void,
                dop as *const c_void,
                lp as *const f32,
                shape.lse_len(),
                dqp as *mut c_void,
                dkp as *mut c_void,
                dvp as *mut c_void,
                wp as *mut c_void,
                bytes,
                stream.cu_stream() as *mut c_void,
            )
        };
        if st == OK {
            Ok(())
        } else {
            Err(self.error("strata_attn_sdpa_backward", st))
        }
    }

    /// The desc of `shape` for element type `T`, checked by strata and by the library.
    fn prepare<T: SdpaElem>(&self, shape: &SdpaShape, dir: Direction) -> Result<Desc> {
        if shape.dtype != T::DTYPE {
            return Err(invalid(format!("a {:?} shape with {:?} buffers", shape.dtype, T::DTYPE)));
        }
        let desc = describe(shape, dir)?;
        self.check(&desc, dir)?;
        Ok(desc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama-like: 2 batches, 8 heads over 2, 64 queries over 128 keys, head 64, dense
    /// `[b, s, h, d]`, causal, bf16.
    fn shape() -> SdpaShape {
        shape_of(64, 128)
    }

    /// [`shape`] with `sq` queries over `skv` keys, every tensor dense.
    fn shape_of(sq: usize, skv: usize) -> SdpaShape {
        let (b, nh, nkv, d) = (2, 8, 2, 64);
        let mut strides = [[0; 4]; 8];
        for (t, st) in strides.iter_mut().enumerate() {
            let kv = matches!(t, K | V | DK | DV);
            *st = dense_strides([b, if kv { skv } else { sq }, if kv { nkv } else { nh }, d]);
        }
        SdpaShape {
            b,
            sq,
            skv,
            nh,
            nkv,
            d,
            strides,
            scale: 0.125,
            causal: true,
            window: None,
            dtype: SdpaDtype::Bf16,
        }
    }

    fn refused(s: &SdpaShape, dir: Direction, needle: &str) {
        match describe(s, dir) {
            Err(Error::InvalidArgument(m)) => {
                assert!(m.contains(needle), "{m:?} should say {needle:?}")
            }
            other => panic!("{needle}: expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn a_shapes_key_holds_all_of_it() {
        let base = shape();
        assert_eq!(base.key(), shape().key());
        let mut strided = base;
        strided.strides[K][1] += 64;
        let mut scaled = base;
        scaled.scale = 0.25;
        let mut windowed = base;
        windowed.window = Some(16);
        let mut half = base;
        half.dtype = SdpaDtype::F16;
        for (what, s) in [
            ("strides", strided),
            ("scale", scaled),
            ("window", windowed),
            ("dtype", half),
            ("keys", shape_of(64, 192)),
        ] {
            assert_ne!(s.key(), base.key(), "{what}");
        }
    }

    #[test]
    fn the_desc_is_the_headers_layout() {
        // strata_attn.h: u32, i32, six i64, 8 × 4 i64, f32, i32, i64 (the C test prints 328).
        assert_eq!(std::mem::size_of::<Desc>(), 328);
        assert_eq!(std::mem::offset_of!(Desc, strides), 56);
        assert_eq!(std::mem::offset_of!(Desc, scale), 312);
        assert_eq!(std::mem::offset_of!(Desc, window), 320);
    }

    #[test]
    fn the_desc_has_cudnns_order_of_strides() {
        let d = describe(&shape(), Direction::Backward).unwrap();
        assert_eq!(d.struct_size, 328);
        assert_eq!(
            (d.batch, d.heads, d.kv_heads, d.q_len, d.kv_len, d.head_dim),
            (2, 8, 2, 64, 128, 64)
        );
        // q: [b, s, h, d] dense is 64·8·64, 8·64, 64, 1; cuDNN's order swaps seq and heads.
        assert_eq!(d.strides[Q], [32768, 64, 512, 1]);
        assert_eq!(d.strides[DK], [16384, 64, 128, 1]);
        assert_eq!((d.causal, d.window, d.dtype), (1, 0, 0));
        // A KV cache read in place ([b, h, s, d] memory seen as [b, s, h, d]) keeps its strides.
        let mut s = shape();
        s.strides[K] = [2 * 128 * 64, 64, 128 * 64, 1];
        assert_eq!(describe(&s, Direction::Forward).unwrap().strides[K], [16384, 8192, 64, 1]);
    }

    #[test]
    fn a_window_as_wide_as_the_keys_is_none() {
        let mut s = shape();
        s.window = Some(32);
        assert_eq!(describe(&s, Direction::Forward).unwrap().window, 32);
        s.window = Some(128);
        assert_eq!(describe(&s, Direction::Forward).unwrap().window, 0);
    }

    #[test]
    fn bad_shapes_are_refused_with_what_to_do() {
        let mut s = shape();
        s.nkv = 3;
        refused(&s, Direction::Forward, "not a multiple of 3 key/value heads");
        let mut s = shape();
        s.b = 0;
        refused(&s, Direction::Forward, "0 batch");
        for d in [0, 60, 264, 512] {
            let mut s = shape();
            s.d = d;
            refused(&s, Direction::Forward, "multiples of 8 up to 256");
        }
        let mut s = shape_of(256, 128);
        refused(&s, Direction::Forward, "at least as many keys");
        s.causal = false;
        assert!(describe(&s, Direction::Forward).is_ok(), "without the mask, any lengths");
        let mut s = shape();
        s.window = Some(0);
        refused(&s, Direction::Forward, "sees nothing");
        s.window = Some(16);
        s.causal = false;
        refused(&s, Direction::Forward, "without the causal mask");
        let mut s = shape();
        s.scale = f32::NAN;
        refused(&s, Direction::Forward, "scale");
        let s = shape_of(1, 1);
        assert!(describe(&s, Direction::Forward).is_ok());
        refused(&s, Direction::Backward, "one query over one key");
    }

    #[test]
    fn bad_strides_are_refused_and_only_for_the_tensors_a_direction_reads() {
        let mut s = shape();
        s.strides[V][3] = 2;
        refused(&s, Direction::Forward, "v's head dimension has stride 2");
        let mut s = shape();
        s.strides[Q][1] = 100;
        refused(&s, Direction::Forward, "multiples of 8 elements");
        let mut s = shape();
        s.strides[O][1] = 8; // o's rows on one another
        refused(&s, Direction::Forward, "o's strides make two of its elements share");
        let mut s = shape();
        s.strides[DK][0] = 0;
        refused(&s, Direction::Backward, "dk's strides");
        assert!(describe(&s, Direction::Forward).is_ok(), "the forward has no dk");
        let mut s = shape();
        s.strides[K][0] = 0; // an input read twice is fine
        assert!(describe(&s, Direction::Forward).is_ok());
        let mut s = shape();
        s.b = 3;
        s.strides[Q][0] = (usize::MAX / 2) & !7;
        refused(&s, Direction::Forward, "past 2^63");
    }

    #[test]
    fn the_checks_agree_with_the_c_sides_on_its_cases() {
        // Strides of a size-1 dimension are free (cuDNN ignores them): one query, odd stride.
        let mut s = shape();
        s.sq = 1;
        s.strides[Q][1] = 3;
        assert!(describe(&s, Direction::Forward).is_ok());
        assert!(disjoint(&s, O));
        assert_eq!(reach(&shape(), Q), Some(2 * 64 * 8 * 64));
        assert_eq!(shape().lse_len(), 2 * 8 * 64);
    }

    /// With the library built (`bash benches/gpu/build-attention`; then
    /// `STRATA_ATTN_LIB=.attn-build/out/libstrata_attn.so LD_LIBRARY_PATH=.attn-build/sdk/lib`),
    /// its own checks take every desc `describe` makes and refuse what it refuses: the two sides
    /// agree, and the desc crosses the C interface field for field. No GPU needed. Skipped
    /// (saying so) where the variable is not set, as in CI.
    #[test]
    fn the_librarys_checks_agree_with_describe() {
        if std::env::var_os(LIB_ENV).is_none() {
            println!("SKIP: {LIB_ENV} is not set (bash benches/gpu/build-attention builds it)");
            return;
        }
        let lib = AttentionLib::get().expect("the library named by STRATA_ATTN_LIB loads");
        assert!(lib.cudnn_version() >= 90000, "cuDNN 9: {}", lib.cudnn_version());
        for dir in [Direction::Forward, Direction::Backward] {
            let mut s = shape();
            lib.check(&describe(&s, dir).unwrap(), dir).unwrap();
            s.window = Some(32);
            s.dtype = SdpaDtype::F16;
            lib.check(&describe(&s, dir).unwrap(), dir).unwrap();
            // What describe refuses, the library refuses too, with the same words.
            let mut bad = describe(&shape(), dir).unwrap();
            bad.heads = 7;
            let e = lib.check(&bad, dir).unwrap_err().to_string();
            assert!(e.contains("not a multiple of 2 key/value heads"), "{e}");
            let mut bad = describe(&shape(), dir).unwrap();
            bad.strides[Q][2] = 100;
            let e = lib.check(&bad, dir).unwrap_err().to_string();
            assert!(e.contains("multiples of 8 elements"), "{e}");
            let mut bad = describe(&shape(), dir).unwrap();
            bad.head_dim = 60;
            let e = lib.check(&bad, dir).unwrap_err().to_string();
            assert!(e.contains("head_dim 60"), "{e}");
            let mut bad = describe(&shape(), dir).unwrap();
            (bad.window, bad.causal) = (16, 0);
            let e = lib.check(&bad, dir).unwrap_err().to_string();
            assert!(e.contains("without the causal mask"), "{e}");
        }
        // The last field: a window the library reads as negative is refused by name.
        let mut bad = describe(&shape(), Direction::Forward).unwrap();
        bad.window = -1;
        let e = lib.check(&bad, Direction::Forward).unwrap_err().to_string();
        assert!(e.contains("window -1"), "{e}");
    }

    /// A stand-in `libstrata_attn.so` built from `body` (C) with the system's C compiler into
    /// `dir`, or `None` (saying so) where there is none.
    fn fake_lib(dir: &Path, name: &str, body: &str) -> Option<String> {
        let src = dir.join(format!("{name}.c"));
        let lib = dir.join(format!("{name}.so"));
        std::fs::write(&src, body).unwrap();
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        match std::process::Command::new(&cc)
            .args(["-shared", "-fPIC", "-o"])
            .arg(&lib)
            .arg(&src)
            .status()
        {
            Ok(s) if s.success() => Some(lib.to_string_lossy().into_owned()),
            Ok(s) => panic!("{cc} failed on {name}.c: {s}"),
            Err(e) => {
                println!("SKIP: no C compiler ({cc}: {e}) to build a stand-in library");
                None
            }
        }
    }

    /// The functions of `strata_attn.h` version `abi`, but `missing`; cuDNN's version
    /// `cudnn`; `strata_attn_check` answers `status` with the message `why` (NULL when empty).
    fn fake_source(abi: i32, missing: &str, cudnn: usize, status: i32, why: &str) -> String {
        let why = if why.is_empty() { "0".to_string() } else { format!("\"{why}\"") };
        [
            format!("int strata_attn_abi_version(void) {{ return {abi}; }}"),
            format!("unsigned long strata_attn_cudnn_version(void) {{ return {cudnn}; }}"),
            format!("int strata_attn_check(const void *d, int b) {{ return {status}; }}"),
            "int strata_attn_workspace_size(const void *d, int b, unsigned long *n) { return 2; }"
                .into(),
            "int strata_attn_sdpa_forward(void) { return 2; }".into(),
            "int strata_attn_sdpa_backward(void) { return 2; }".into(),
            format!("const char *strata_attn_last_error(void) {{ return {why}; }}"),
        ]
        .into_iter()
        .filter(|f| missing.is_empty() || !f.contains(&format!("{missing}(")))
        .collect::<Vec<_>>()
        .join("\n")
    }

    /// Libraries that are not the one strata speaks to: one without the shim's symbols (another
    /// library of that name), another version of its interface, one that lacks a function, one
    /// whose cuDNN does not load: each a reason, never a crash; and a library that loads gives
    /// its checks' refusals as typed errors (a refusal as `InvalidArgument` with the library's
    /// message, anything else as a CUDA error naming the call).
    #[test]
    fn a_library_that_is_not_the_shim_it_expects_is_refused_with_why() {
        let dir = tempfile::tempdir().unwrap();
        let Some(empty) = fake_lib(dir.path(), "empty", "int unrelated(void) { return 0; }") else {
            return;
        };
        let why = AttentionLib::open(&empty).err().unwrap();
        assert!(why.contains("no symbol strata_attn_abi_version"), "{why}");
        let cases = [
            ("v2", fake_source(2, "", 91900, 0, ""), "interface is version 2"),
            (
                "nobackward",
                fake_source(1, "strata_attn_sdpa_backward", 91900, 0, ""),
                "no symbol strata_attn_sdpa_backward",
            ),
            (
                "noerror",
                fake_source(1, "strata_attn_last_error", 91900, 0, ""),
                "no symbol strata_attn_last_error",
            ),
            ("nocudnn", fake_source(1, "", 0, 0, ""), "cuDNN 9's parts"),
        ];
        for (name, body, needle) in cases {
            let lib = fake_lib(dir.path(), name, &body).unwrap();
            let why = AttentionLib::open(&lib).err().unwrap_or_else(|| panic!("{name} loaded"));
            assert!(why.contains(needle), "{name}: {why}");
        }
        assert!(AttentionLib::open("a\0b").err().unwrap().contains("NUL"));
        let desc = describe(&shape(), Direction::Forward).unwrap();
        for (name, status, msg) in [
            ("ok", 0, ""),
            ("refuses", INVALID_ARGUMENT, "head_dim 60 is not a multiple of 8"),
            ("unsupported", UNSUPPORTED, ""),
            ("broken", 7, "cudnnCreate failed"),
        ] {
            let lib = fake_lib(dir.path(), name, &fake_source(1, "", 91900, status, msg)).unwrap();
            let lib = AttentionLib::open(&lib).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(lib.cudnn_version(), 91900);
            match (status, lib.check(&desc, Direction::Forward)) {
                (OK, Ok(())) => {}
                (INVALID_ARGUMENT | UNSUPPORTED, Err(Error::InvalidArgument(m))) => {
                    assert!(m.contains(msg), "{name}: {m}")
                }
                (_, Err(Error::Cuda { call: "strata_attn_check", message })) => {
                    assert!(message.contains("status 7") && message.contains(msg), "{message}")
                }
                (_, other) => panic!("{name}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_missing_library_is_a_typed_error_saying_how_to_build_it() {
        let e = unavailable("/nowhere/libstrata_attn.so: cannot open shared object file".into());
        let text = e.to_string();
        assert!(matches!(e, Error::LibraryUnavailable { library: LIB_NAME, .. }));
        assert!(text.contains("benches/gpu/build-attention"), "{text}");
        assert!(text.contains("STRATA_ATTN_LIB"), "{text}");
        // And a path that is not a library is a load error, not a crash.
        let why = AttentionLib::open("/nonexistent/libstrata_attn.so").err().unwrap();
        assert!(why.contains("libstrata_attn.so"), "{why}");
    }
}
