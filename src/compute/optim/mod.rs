//! Optimizers over parameters held in a store: SGD and AdamW with the semantics of PyTorch's
//! `torch.optim.SGD` (no momentum) and `torch.optim.AdamW` (lr, betas, eps, weight decay, bias
//! correction), with fp32 master weights and moments kept as store tensors of group
//! [`Group::OptimizerState`], and gradients as store tensors of group [`Group::Grad`].
//!
//! For each parameter (a bf16 or f32 store tensor, `[out, in]` or any shape) an [`Optimizer`]
//! keeps:
//! - `NAME.grad`: the gradient ([`Group::Grad`]), in the parameter's dtype or, for gradient
//!   accumulation over micro-batches, in f32 ([`OptimizerConfig::grad_dtype`]);
//! - `NAME.master`: fp32 master weights, for bf16 parameters only (an f32 parameter is its own
//!   master);
//! - `NAME.exp_avg`, `NAME.exp_avg_sq`: AdamW's two fp32 moments.
//!
//! After each update the parameter (the compute copy the GEMMs read) is refreshed from the
//! master, rounded to bf16.
//!
//! ## Engines
//! - [`Engine::Cpu`]: the state lives in host memory (Pinned, or Disk when the host budgets are
//!   short). [`Optimizer::update`] releases the gradient (the store starts writing it back) and
//!   queues the update to a worker thread, which runs it over chunks on `threads` threads as
//!   soon as the gradient has reached host memory, while the caller goes on with the backward
//!   pass of the layers before. [`Optimizer::finish`] waits for the queue. An update can start
//!   before the caller knows it stands ([`Optimizer::update_speculative`]: a trainer's, before
//!   the global gradient norm says whether to clip): it saves what it overwrites into a backup
//!   first, and is then committed ([`Optimizer::commit_speculative`]) or undone exactly
//!   ([`Optimizer::undo_speculative`]).
//! - [`Engine::GpuMapped`]: the state lives in the Mapped tier; a kernel (`cuda/optim.cu`)
//!   updates it in place over PCIe, zero-copy, without migrating it.
//! - [`Engine::GpuResident`]: the state is migrated to the device like any tensor (the policy
//!   evicts and writes it back when the device budget is short), and the same kernel runs on it.
//! - [`Engine::Auto`]: picks one of the three from the rates measured on the machine
//!   ([`Machine::measure`]) and the tier budgets ([`AutoChoice`] says which and why).
//!
//! Every engine computes the same f32 operations in the same order (the GPU kernels use
//! round-to-nearest intrinsics, no fused multiply-add), so they give the same bits, and the CPU
//! engine gives the same bits with any number of threads (the update is elementwise). The
//! order and the f32 scalars are those of torch's scalar code; torch's vectorized CPU `lerp`
//! fuses a multiply-add, so bits may differ from torch's in the last place of `exp_avg`.
//!
//! On the host backend the GPU engines run the same arithmetic on the host, through the same
//! store views, so their placement and migration are exercised without a GPU.
//!
//! ```
//! use std::sync::Arc;
//! use strata::optim::{AdamW, Algorithm, Engine, Optimizer, OptimizerConfig};
//! use strata::{DType, Store, Tier};
//!
//! # fn main() -> strata::Result<()> {
//! let store = Arc::new(
//!     Store::builder()
//!         .host_backend()
//!         .capacity(Tier::Device, 1 << 20)
//!         .capacity(Tier::Pinned, 1 << 20)
//!         .build()?,
//! );
//! let w = store.put("w", DType::F32, &[4], &[0u8; 16])?;
//! let cfg = OptimizerConfig::new(Algorithm::AdamW(AdamW { lr: 0.1, ..AdamW::default() }), Engine::Cpu);
//! let s = store.stream()?;
//! let mut opt = Optimizer::new(store.clone(), &s, &[w], cfg)?;
//! // The gradient: all ones (a real loop accumulates it on the device with strata::linalg).
//! store.write(opt.grad(w)?, &[1.0f32; 4].iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<_>>())?;
//! opt.update(w)?;
//! opt.finish()?;
//! // AdamW's first step moves every weight by lr against the gradient's sign.
//! let w1: Vec<f32> = store.read(w)?.chunks(4).map(|c| f32::from_ne_bytes(c.try_into().unwrap())).collect();
//! assert!(w1.iter().all(|&x| (x + 0.1).abs() < 1e-6));
//! # Ok(()) }
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam::channel::{unbounded, Receiver, Sender};
use half::bf16;

use crate::backend::cuda::programs::{AdamArgs, GradView, OptimKernels};
use crate::base::error::{Error, Result};
use crate::base::types::{format_size, DType, Group, TensorId, Tier};
use crate::compute::linalg::Float;
use crate::compute::probe::median;
use crate::{DeviceView, HostView, Machine, Store, Stream};

mod speculate;

/// AdamW's hyperparameters (PyTorch's defaults, but `weight_decay` 0 as the out-of-core
/// example's contract asks; PyTorch's default is 0.01). Held in f64 as PyTorch holds them (Python
/// floats): the scalars of each step are computed in f64 and rounded once to f32, so that
/// `1 - beta1` is f32(0.1), not 1 − f32(0.9).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay (`p *= 1 - lr * weight_decay`).
    pub weight_decay: f64,
}

impl Default for AdamW {
    fn default() -> Self {
        AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 }
    }
}

/// SGD without momentum: `g += weight_decay · p; p -= lr · g`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f64,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
}

impl Default for Sgd {
    /// PyTorch's defaults for `torch.optim.SGD` without momentum, with a learning rate of 0.01
    /// (torch has none: it must be given).
    fn default() -> Self {
        Sgd { lr: 0.01, weight_decay: 0.0 }
    }
}

/// The update rule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Algorithm {
    /// Plain SGD.
    Sgd(Sgd),
    /// AdamW.
    AdamW(AdamW),
}

impl Algorithm {
    /// Lower-case name, as the command line gives it (`strata train-demo --optimizer`,
    /// `strata inspect --optimizer`): `sgd` or `adamw`.
    pub fn name(&self) -> &'static str {
        match self {
            Algorithm::Sgd(_) => "sgd",
            Algorithm::AdamW(_) => "adamw",
        }
    }

    /// fp32 moment tensors per parameter (0 or 2).
    pub fn moments(&self) -> usize {
        match self {
            Algorithm::Sgd(_) => 0,
            Algorithm::AdamW(_) => 2,
        }
    }

    /// Bytes of optimizer state kept per element of a parameter of dtype `param`: 4 for each
    /// fp32 moment ([`Algorithm::moments`]), and 4 of fp32 master weights when the parameter is
    /// a float narrower than f32 (bf16 here; f16 and FP8 too in a plan of such a checkpoint,
    /// as mixed precision keeps them). An f32 (or f64) parameter is its own master, and a
    /// parameter that is not a float is not trained.
    ///
    /// ```
    /// use strata::optim::{AdamW, Algorithm, Sgd};
    /// use strata::DType;
    /// let adamw = Algorithm::AdamW(AdamW::default());
    /// assert_eq!(adamw.state_bytes(DType::BF16), 12); // two moments and a master
    /// assert_eq!(adamw.state_bytes(DType::F32), 8);
    /// assert_eq!(Algorithm::Sgd(Sgd::default()).state_bytes(DType::BF16), 4);
    /// assert_eq!(Algorithm::Sgd(Sgd::default()).state_bytes(DType::F32), 0);
    /// ```
    pub fn state_bytes(&self, param: DType) -> u64 {
        if !param.is_float() {
            return 0;
        }
        let master = if param.size_of() < 4 { 4 } else { 0 };
        4 * self.moments() as u64 + master
    }
}

/// Where and by what the update runs (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    /// Host threads, state in host memory.
    Cpu,
    /// A kernel, state in the Mapped tier, zero-copy.
    GpuMapped,
    /// A kernel, state migrated to the device.
    GpuResident,
    /// The fastest of the three on this machine, under these budgets.
    Auto,
}

impl Engine {
    /// The three concrete engines.
    pub const CONCRETE: [Engine; 3] = [Engine::Cpu, Engine::GpuMapped, Engine::GpuResident];

    /// Lower-case name, as printed and parsed.
    pub fn name(self) -> &'static str {
        match self {
            Engine::Cpu => "cpu",
            Engine::GpuMapped => "gpu-mapped",
            Engine::GpuResident => "gpu-resident",
            Engine::Auto => "auto",
        }
    }
}

impl std::fmt::Display for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Engine {
    type Err = Error;
    fn from_str(s: &str) -> Result<Engine> {
        [Engine::Cpu, Engine::GpuMapped, Engine::GpuResident, Engine::Auto]
            .into_iter()
            .find(|e| e.name() == s)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "unknown optimizer engine {s:?} (cpu, gpu-mapped, gpu-resident or auto)"
                ))
            })
    }
}

/// Traffic the rest of the training step puts on the links, for [`Engine::Auto`]'s estimate.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTraffic {
    /// Bytes per step copied host to device by everything but the optimizer (streamed weights).
    pub h2d_bytes: u64,
    /// Bytes per step copied device to host by everything but the optimizer.
    pub d2h_bytes: u64,
    /// Device bytes the rest of the step needs for itself (weights kept resident, activations,
    /// prefetch room): what GpuResident cannot use for optimizer state.
    pub device_bytes: u64,
}

/// What an [`Optimizer`] is made with.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimizerConfig {
    /// The update rule.
    pub algorithm: Algorithm,
    /// The engine.
    pub engine: Engine,
    /// Threads of the Cpu engine (0: every core).
    pub threads: usize,
    /// The gradient tensors' dtype: `None` for the parameter's own dtype, `Some(F32)` for
    /// accumulation over micro-batches in f32.
    pub grad_dtype: Option<DType>,
    /// The rest of the step's traffic, for `Auto`.
    pub traffic: StepTraffic,
}

impl OptimizerConfig {
    /// `algorithm` on `engine`, every core, gradients in the parameters' dtype.
    pub fn new(algorithm: Algorithm, engine: Engine) -> OptimizerConfig {
        OptimizerConfig {
            algorithm,
            engine,
            threads: 0,
            grad_dtype: None,
            traffic: StepTraffic::default(),
        }
    }
}

/// Host memory bandwidth of a copy of `bytes` split over `threads` threads (0: every core):
/// (bytes read + bytes written) / seconds, the median of five after a warm-up (`strata bench`'s
/// `host_memcpy`, on these threads).
pub fn host_copy_bandwidth(threads: usize, bytes: usize) -> Result<f64> {
    let t = crate::compute::probe::host_memcpy_on(bytes.max(1), resolve_threads(threads), 1, 5)?;
    Ok(2.0 * t.bytes as f64 / t.median_s())
}

/// Host memory bandwidth of an in-place update of `bytes` of f32s (`x = x · a + b`) split over
/// `threads` threads: (bytes read + bytes written) / seconds, the median of five after a
/// warm-up. Unlike a copy, whose writes to lines it never read cost the memory system a hidden
/// read each (read for ownership), this moves exactly the bytes it counts, as an optimizer
/// step updating its state in place does.
pub fn host_update_bandwidth(threads: usize, bytes: usize) -> f64 {
    let threads = resolve_threads(threads);
    let mut x = vec![1f32; (bytes / 4).max(1)];
    let part = x.len().div_ceil(threads).max(1);
    let mut times = Vec::new();
    for i in 0..6 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for c in x.chunks_mut(part) {
                s.spawn(move || {
                    for v in c.iter_mut() {
                        *v = *v * 0.5 + 0.25;
                    }
                });
            }
        });
        if i > 0 {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    std::hint::black_box(&x);
    2.0 * (x.len() * 4) as f64 / median(&times)
}

/// Why [`Engine::Auto`] chose what it chose: each engine's estimated step cost.
#[derive(Clone, Debug, PartialEq)]
pub struct AutoChoice {
    /// The engine picked.
    pub engine: Engine,
    /// `(engine, estimated seconds per step, or why it cannot run)` for each concrete engine.
    pub estimates: Vec<(Engine, std::result::Result<f64, String>)>,
    /// The machine whose rates the estimates used (`h2d`, `d2h`, `host_copy`).
    pub machine: Machine,
}

impl std::fmt::Display for AutoChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "auto chose {} (", self.engine)?;
        for (i, (e, est)) in self.estimates.iter().enumerate() {
            if i > 0 {
                write!(f, "; ")?;
            }
            match est {
                Ok(s) => write!(f, "{e} {:.2} ms", s * 1e3)?,
                Err(why) => write!(f, "{e}: {why}")?,
            }
        }
        let m = &self.machine;
        let gbs = |x: Option<f64>| x.map_or("?".to_string(), |x| format!("{:.1}", x / 1e9));
        write!(
            f,
            "; from H2D {} GB/s, D2H {} GB/s, host copy {} GB/s on {})",
            gbs(m.h2d),
            gbs(m.d2h),
            gbs(m.host_copy),
            m.name
        )
    }
}

/// Bytes per element an update moves, for estimates: `(state bytes, gradient bytes, parameter
/// bytes)`; the state is read and written, the gradient read, the parameter written.
fn per_elem(alg: &Algorithm, param: DType, grad: DType) -> (u64, u64, u64) {
    let own = if param == DType::F32 { 4 } else { 0 };
    (alg.state_bytes(param) + own, grad.size_of() as u64, param.size_of() as u64)
}

/// Estimates each engine's step (the optimizer's part, and the links it shares with the rest
/// of the step) on `machine` (its `h2d`, `d2h` and `host_copy`) and picks the fastest. An engine
/// whose estimate needs a figure the machine lacks is not picked, and says which figure.
pub fn choose(
    alg: &Algorithm,
    elems: u64,
    param: DType,
    grad: DType,
    traffic: &StepTraffic,
    capacities: [u64; 4],
    machine: &Machine,
) -> AutoChoice {
    let (s, g, p) = per_elem(alg, param, grad);
    let (state, gbytes, pbytes) = (s * elems, g * elems, p * elems);
    let rate = |figure: &str, value: Option<f64>| {
        machine.require(figure, value).map_err(|e| e.to_string())
    };
    let link = |h2d: u64, d2h: u64| -> std::result::Result<f64, String> {
        let (up, down) = (rate("h2d", machine.h2d)?, rate("d2h", machine.d2h)?);
        Ok(((traffic.h2d_bytes + h2d) as f64 / up).max((traffic.d2h_bytes + d2h) as f64 / down))
    };
    let own_state = if param == DType::F32 { 0 } else { pbytes };
    let mut estimates = Vec::new();
    // Cpu: the gradient goes down, the CPU reads state and gradient, writes state and the
    // compute copy; the new compute copy goes up with the streamed weights.
    let host_room = capacities[Tier::Pinned.index()] + capacities[Tier::Disk.index()];
    estimates.push((
        Engine::Cpu,
        if state + gbytes <= host_room {
            rate("host_copy", machine.host_copy).and_then(|host| {
                let cpu_host = (2 * state + gbytes + own_state) as f64 / host;
                Ok(link(0, gbytes)?.max(cpu_host))
            })
        } else {
            Err(format!("needs {} of Pinned + Disk", format_size(state + gbytes)))
        },
    ));
    // GpuMapped: the kernel reads and writes the state over PCIe.
    estimates.push((
        Engine::GpuMapped,
        if state <= capacities[Tier::Mapped.index()] {
            link(state, state)
        } else {
            Err(format!(
                "needs {} of Mapped (budget {})",
                format_size(state),
                format_size(capacities[Tier::Mapped.index()])
            ))
        },
    ));
    // GpuResident: what of the state does not fit next to the rest of the step moves in and out
    // every step.
    let room = capacities[Tier::Device.index()].saturating_sub(traffic.device_bytes + gbytes);
    let swapped = state.saturating_sub(room);
    estimates.push((Engine::GpuResident, link(swapped, swapped)));
    let engine = estimates
        .iter()
        .filter_map(|(e, r)| r.as_ref().ok().map(|s| (*e, *s)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map_or(Engine::Cpu, |(e, _)| e);
    AutoChoice { engine, estimates, machine: machine.clone() }
}

fn resolve_threads(threads: usize) -> usize {
    if threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        threads
    }
}

/// A gradient's values.
#[derive(Clone, Copy, Debug)]
pub enum GradSlice<'a> {
    /// f32 gradients (accumulated).
    F32(&'a [f32]),
    /// bf16 gradients.
    Bf16(&'a [bf16]),
}

impl GradSlice<'_> {
    fn len(&self) -> usize {
        match self {
            GradSlice::F32(g) => g.len(),
            GradSlice::Bf16(g) => g.len(),
        }
    }
}

/// The scalars of AdamW's step `t` (1-based), computed in f64 as PyTorch does with Python floats
/// and rounded once to f32.
#[derive(Clone, Copy, Debug)]
struct AdamScalars {
    decay: f32,
    /// `1 - beta1`: the weight of torch's `exp_avg.lerp_(grad, 1 - beta1)`.
    w: f32,
    /// `1 - w` in f32, and whether lerp takes its second form (`|w| >= 0.5`), as torch's does.
    w_rest: f32,
    w_hi: bool,
    b2: f32,
    one_minus_b2: f32,
    step_size: f32,
    bc2_sqrt: f32,
    eps: f32,
}

impl AdamScalars {
    fn new(h: &AdamW, t: u64) -> AdamScalars {
        let t = t.min(i32::MAX as u64) as i32;
        let bc1 = 1.0 - h.beta1.powi(t);
        let bc2 = 1.0 - h.beta2.powi(t);
        let w = (1.0 - h.beta1) as f32;
        AdamScalars {
            decay: (1.0 - h.lr * h.weight_decay) as f32,
            w,
            w_rest: 1.0 - w,
            w_hi: w.abs() >= 0.5,
            b2: h.beta2 as f32,
            one_minus_b2: (1.0 - h.beta2) as f32,
            step_size: (h.lr / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: h.eps as f32,
        }
    }

    /// torch's `lerp(m, g, w)`: `m + w (g - m)` for `|w| < 0.5`, else `g - (g - m)(1 - w)`.
    #[inline(always)]
    fn lerp(&self, m: f32, g: f32) -> f32 {
        if self.w_hi {
            g - (g - m) * self.w_rest
        } else {
            m + self.w * (g - m)
        }
    }
}

/// AdamW's step `t` (1-based) as `strata_adamw` (`cuda/optim.cu`) takes its scalars: the
/// numbers the host loop uses, rounded to f32 the same way.
pub(crate) fn adam_args(h: &AdamW, t: u64) -> AdamArgs {
    let a = AdamScalars::new(h, t);
    AdamArgs {
        decay: a.decay,
        w: a.w,
        w_rest: a.w_rest,
        w_hi: a.w_hi,
        b2: a.b2,
        one_minus_b2: a.one_minus_b2,
        step_size: a.step_size,
        bc2_sqrt: a.bc2_sqrt,
        eps: a.eps,
    }
}

/// Elements per block of the CPU loops: the update of a block and its bf16 rounding run while
/// the block is in L1.
const BLOCK: usize = 4096;

fn adamw_block<G: Float>(
    k: &AdamScalars,
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[G],
    scale: f32,
) {
    for (((p, m), v), g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
        // `scale` is 1 but where a gradient is clipped: x · 1 is x, so unscaled bits stay.
        let gi = g.to_f32() * scale;
        let pi = *p * k.decay;
        let mi = k.lerp(*m, gi);
        let vi = *v * k.b2 + k.one_minus_b2 * gi * gi;
        let denom = vi.sqrt() / k.bc2_sqrt + k.eps;
        *p = pi - k.step_size * (mi / denom);
        *m = mi;
        *v = vi;
    }
}

fn sgd_block<G: Float>(h: &Sgd, p: &mut [f32], g: &[G], scale: f32) {
    let (lr, wd) = (h.lr as f32, h.weight_decay as f32);
    for (p, g) in p.iter_mut().zip(g) {
        let mut gi = g.to_f32() * scale;
        if wd != 0.0 {
            gi += wd * *p;
        }
        *p -= lr * gi;
    }
}

fn round_block(p: &[f32], out: Option<&mut [bf16]>) {
    if let Some(out) = out {
        for (o, &x) in out.iter_mut().zip(p) {
            *o = <bf16 as Float>::from_f32(x);
        }
    }
}

/// One update on the CPU over slices: AdamW's step `t` (1-based) or SGD's, on `threads`
/// threads (0: every core). `p` is the f32 master (or parameter); `m` and `v` are the moments
/// (empty for SGD); `out`, if given, receives `p` rounded to bf16 (the compute copy). The bits
/// do not depend on `threads`.
#[allow(clippy::too_many_arguments)]
pub fn cpu_update(
    alg: &Algorithm,
    t: u64,
    threads: usize,
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: GradSlice<'_>,
    out: Option<&mut [bf16]>,
) -> Result<()> {
    cpu_update_scaled(alg, t, threads, p, m, v, g, 1.0, out)
}

/// [`cpu_update`] with each gradient value multiplied by `grad_scale` (in f32) as it is read, as
/// `torch.nn.utils.clip_grad_norm_` multiplies the gradients in place before the step: the
/// clipped update without a pass over the gradient. A scale of 1 gives [`cpu_update`]'s bits.
#[allow(clippy::too_many_arguments)]
pub fn cpu_update_scaled(
    alg: &Algorithm,
    t: u64,
    threads: usize,
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: GradSlice<'_>,
    grad_scale: f32,
    out: Option<&mut [bf16]>,
) -> Result<()> {
    update_slices(alg, t, threads, p, m, v, g, grad_scale, out, None)
}

/// Where an update that may be undone keeps what it overwrites (a speculative update's backup):
/// slices as long as the update's, `m` and `v` empty for SGD, `out` for a bf16 compute copy.
pub(crate) struct Saved<'a> {
    pub(crate) p: &'a mut [f32],
    pub(crate) m: &'a mut [f32],
    pub(crate) v: &'a mut [f32],
    pub(crate) out: Option<&'a mut [bf16]>,
}

/// One chunk of an update, for one thread: its part of every slice.
struct Piece<'a> {
    /// Its first element's index.
    base: usize,
    p: &'a mut [f32],
    m: Option<&'a mut [f32]>,
    v: Option<&'a mut [f32]>,
    out: Option<&'a mut [bf16]>,
    saved: Option<SavedPiece<'a>>,
}

/// A [`Piece`]'s part of a [`Saved`].
struct SavedPiece<'a> {
    p: &'a mut [f32],
    m: Option<&'a mut [f32]>,
    v: Option<&'a mut [f32]>,
    out: Option<&'a mut [bf16]>,
}

/// `s` cut at every `part` elements into `n` pieces (`None` past its end, or all `None`).
fn pieces<T>(s: Option<&mut [T]>, part: usize, n: usize) -> Vec<Option<&mut [T]>> {
    let mut v: Vec<Option<&mut [T]>> = match s {
        Some(s) => s.chunks_mut(part).map(Some).collect(),
        None => Vec::new(),
    };
    v.resize_with(n, || None);
    v
}

/// [`cpu_update_scaled`], first copying each block of what it overwrites into `saved` (in the
/// same pass, while the block is in cache), so that the update can be undone exactly.
#[allow(clippy::too_many_arguments)]
pub(crate) fn update_slices(
    alg: &Algorithm,
    t: u64,
    threads: usize,
    p: &mut [f32],
    m: &mut [f32],
    v: &mut [f32],
    g: GradSlice<'_>,
    grad_scale: f32,
    out: Option<&mut [bf16]>,
    saved: Option<Saved<'_>>,
) -> Result<()> {
    let n = p.len();
    let moments = alg.moments() > 0;
    if n == 0 && g.len() == 0 {
        return Ok(());
    }
    let saved_ok = saved.as_ref().is_none_or(|s| {
        s.p.len() == n
            && (!moments || (s.m.len() == n && s.v.len() == n))
            && s.out.as_ref().map(|o| o.len()) == out.as_ref().map(|o| o.len())
    });
    if g.len() != n
        || out.as_ref().is_some_and(|o| o.len() != n)
        || (moments && (m.len() != n || v.len() != n))
        || !saved_ok
    {
        return Err(Error::InvalidArgument(format!(
            "optimizer slices differ in length: p {n}, m {}, v {}, grad {}{}",
            m.len(),
            v.len(),
            g.len(),
            if saved_ok { "" } else { ", or their backup's" }
        )));
    }
    let threads = resolve_threads(threads).min(n.div_ceil(BLOCK)).max(1);
    let part = n.div_ceil(threads).div_ceil(BLOCK) * BLOCK;
    let part = part.max(BLOCK);
    let count = n.div_ceil(part);
    // Every slice cut at the same points; empty moment slices (SGD) into nothing.
    let mut ms = pieces(moments.then_some(m), part, count).into_iter();
    let mut vs = pieces(moments.then_some(v), part, count).into_iter();
    let mut outs = pieces(out, part, count).into_iter();
    let (sp, sm, sv, so, has_saved) = match saved {
        Some(s) => (Some(s.p), moments.then_some(s.m), moments.then_some(s.v), s.out, true),
        None => (None, None, None, None, false),
    };
    let mut sps = pieces(sp, part, count).into_iter();
    let mut sms = pieces(sm, part, count).into_iter();
    let mut svs = pieces(sv, part, count).into_iter();
    let mut sos = pieces(so, part, count).into_iter();
    let jobs: Vec<Piece<'_>> = p
        .chunks_mut(part)
        .enumerate()
        .map(|(c, p)| {
            let (sp, m, v, out) = (
                sps.next().flatten(),
                sms.next().flatten(),
                svs.next().flatten(),
                sos.next().flatten(),
            );
            Piece {
                base: c * part,
                p,
                m: ms.next().flatten(),
                v: vs.next().flatten(),
                out: outs.next().flatten(),
                saved: sp.filter(|_| has_saved).map(|p| SavedPiece { p, m, v, out }),
            }
        })
        .collect();
    let work = |mut j: Piece<'_>| {
        for (b, pb) in j.p.chunks_mut(BLOCK).enumerate() {
            let (off, len) = (j.base + b * BLOCK, pb.len());
            let r = off..off + len;
            let local = b * BLOCK..b * BLOCK + len;
            let mb = j.m.as_deref_mut().map(|m| &mut m[local.clone()]);
            let vb = j.v.as_deref_mut().map(|v| &mut v[local.clone()]);
            let mut ob = j.out.as_deref_mut().map(|o| &mut o[local.clone()]);
            if let Some(s) = j.saved.as_mut() {
                s.p[local.clone()].copy_from_slice(pb);
                if let (Some(sm), Some(mb)) = (s.m.as_deref_mut(), mb.as_deref()) {
                    sm[local.clone()].copy_from_slice(mb);
                }
                if let (Some(sv), Some(vb)) = (s.v.as_deref_mut(), vb.as_deref()) {
                    sv[local.clone()].copy_from_slice(vb);
                }
                if let (Some(so), Some(ob)) = (s.out.as_deref_mut(), ob.as_deref()) {
                    so[local.clone()].copy_from_slice(ob);
                }
            }
            match alg {
                Algorithm::AdamW(h) => {
                    let k = AdamScalars::new(h, t);
                    let (mb, vb) = (mb.expect("moments"), vb.expect("moments"));
                    match g {
                        GradSlice::F32(s) => adamw_block(&k, pb, mb, vb, &s[r], grad_scale),
                        GradSlice::Bf16(s) => adamw_block(&k, pb, mb, vb, &s[r], grad_scale),
                    }
                }
                Algorithm::Sgd(h) => match g {
                    GradSlice::F32(s) => sgd_block(h, pb, &s[r], grad_scale),
                    GradSlice::Bf16(s) => sgd_block(h, pb, &s[r], grad_scale),
                },
            }
            round_block(pb, ob.take());
        }
    };
    if jobs.len() == 1 {
        jobs.into_iter().for_each(work);
    } else {
        std::thread::scope(|s| {
            for j in jobs {
                let work = &work;
                s.spawn(move || work(j));
            }
        });
    }
    Ok(())
}

/// A parameter's backup for speculative updates ([`speculate`]): copies of what an update
/// overwrites.
#[derive(Clone, Copy, Debug)]
struct Backup {
    /// The f32 master's (or f32 parameter's) copy.
    p: TensorId,
    /// The bf16 compute copy's, where there is a master.
    out: Option<TensorId>,
    /// The moments'.
    moments: Option<(TensorId, TensorId)>,
}

/// The store tensors of one parameter.
#[derive(Clone, Copy, Debug)]
struct ParamState {
    param: TensorId,
    dtype: DType,
    elems: usize,
    grad: TensorId,
    master: Option<TensorId>,
    moments: Option<(TensorId, TensorId)>,
    /// Where a speculative update keeps what it overwrites ([`Optimizer::reserve_backup`]).
    backup: Option<Backup>,
}

struct CpuJob {
    st: ParamState,
    t: u64,
    /// The rule as it stands when the update is queued (its learning rate may change by step).
    alg: Algorithm,
    grad_scale: f32,
    /// A speculative update: what it overwrites is saved here first.
    save: Option<Backup>,
}

/// When the updates ran: one `(start, end)` a job (`end` `None` while it runs), oldest first,
/// kept until a caller's window has passed them ([`Optimizer::busy_within`]).
type BusyLog = Arc<parking_lot::Mutex<std::collections::VecDeque<(Instant, Option<Instant>)>>>;

struct CpuWorker {
    tx: Option<Sender<CpuJob>>,
    /// Each job's outcome and the seconds it ran, in the order the jobs were queued.
    done: Receiver<(Outcome, f64)>,
    pending: usize,
    handle: Option<std::thread::JoinHandle<()>>,
}

/// How one parameter's update went: done, or failed, with the writes left when the update's
/// arithmetic had been done (so a retry finishes those writes rather than stepping again).
struct Outcome {
    param: TensorId,
    result: Result<()>,
    left: Option<Commit>,
    /// A speculative update's backup is whole (from then on the state may have changed).
    saved: bool,
}

/// The writes that finish an update whose arithmetic is done: each state tensor read out of
/// the store (state on disk) and its new bytes, in order. Writes that succeeded are gone from
/// it; the rest are applied again by a retry, which thus ends in the same state as a clean step.
#[derive(Default)]
struct Commit(Vec<(TensorId, Vec<u8>)>);

impl Commit {
    /// Applies the writes in order; on a failure keeps the ones not done and returns the error.
    fn apply(&mut self, store: &Store) -> Result<()> {
        while let Some((id, bytes)) = self.0.first() {
            retry_busy(|| store.write(*id, bytes))?;
            self.0.remove(0);
        }
        Ok(())
    }
}

/// SGD or AdamW over parameters in a store (see the module docs).
pub struct Optimizer {
    store: Arc<Store>,
    stream: Stream,
    cfg: OptimizerConfig,
    engine: Engine,
    choice: Option<AutoChoice>,
    params: Vec<ParamState>,
    /// Each parameter's place in `params`.
    index: std::collections::HashMap<TensorId, usize>,
    t: u64,
    gpu: Option<OptimKernels>,
    worker: Option<CpuWorker>,
    /// Seconds the updates ran (the Cpu worker's jobs; the GPU engines' host time to issue).
    busy: f64,
    /// When they ran, on the host's clock.
    log: BusyLog,
    /// This step's bookkeeping, so that a step can be retried after a failure.
    step: StepBook,
    /// Speculative updates undone so far.
    undone: u64,
}

/// What the current step has done, per parameter: updated (never twice), queued on the Cpu
/// worker, or failed after its arithmetic with writes left.
#[derive(Default)]
struct StepBook {
    stepped: std::collections::HashSet<TensorId>,
    queued: std::collections::HashSet<TensorId>,
    /// Updates that failed and were not redone yet (with the writes left, where the
    /// arithmetic was done): the step cannot finish while there are any.
    failed: std::collections::HashMap<TensorId, Commit>,
    /// Speculative updates not yet committed or undone, and whether each one's backup is
    /// whole (known once its job has run): the step cannot finish while there are any.
    speculated: std::collections::HashMap<TensorId, bool>,
}

impl std::fmt::Debug for Optimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Optimizer")
            .field("algorithm", &self.cfg.algorithm)
            .field("engine", &self.engine)
            .field("params", &self.params.len())
            .field("steps", &self.t)
            .finish()
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

impl Optimizer {
    /// An optimizer for `params` (bf16 or f32 store tensors). Creates each parameter's gradient,
    /// master weights (bf16 parameters) and moments (AdamW) in the store, placed for the engine,
    /// and, for `Auto`, measures the machine ([`Machine::measure`]) and picks the engine. GPU
    /// work (the GPU engines' kernels, and gradients accumulated by the caller) runs on
    /// `stream`.
    pub fn new(
        store: Arc<Store>,
        stream: &Stream,
        params: &[TensorId],
        cfg: OptimizerConfig,
    ) -> Result<Optimizer> {
        if stream.backend() != store.backend() {
            return Err(Error::BackendMismatch("the optimizer's stream is not the store's".into()));
        }
        let mut infos = Vec::with_capacity(params.len());
        for &id in params {
            let info = store.info(id)?;
            if !matches!(info.dtype, DType::BF16 | DType::F32) {
                return Err(Error::InvalidArgument(format!(
                    "{:?} is {}: the optimizer trains bf16 and f32 parameters",
                    info.name, info.dtype
                )));
            }
            if let Some(g) = cfg.grad_dtype {
                if g != DType::F32 && g != info.dtype {
                    return Err(Error::InvalidArgument(format!(
                        "gradients of {:?} ({}) in {g}: use f32 or the parameter's dtype",
                        info.name, info.dtype
                    )));
                }
            }
            infos.push(info);
        }
        let mut choice = None;
        let engine = match cfg.engine {
            Engine::Auto => {
                let elems: u64 =
                    infos.iter().map(|i| i.shape.iter().product::<usize>() as u64).sum();
                let dtype = infos.first().map_or(DType::F32, |i| i.dtype);
                let grad = cfg.grad_dtype.unwrap_or(dtype);
                let stats = store.stats();
                let caps = [0, 1, 2, 3].map(|t| stats.tiers[t].capacity);
                let machine = Machine::measured(&store, cfg.threads)?;
                let c = choose(&cfg.algorithm, elems, dtype, grad, &cfg.traffic, caps, &machine);
                let e = c.engine;
                choice = Some(c);
                e
            }
            e => e,
        };
        let gpu = match (engine, store.cuda_context()) {
            (Engine::GpuMapped | Engine::GpuResident, Some(ctx)) => Some(OptimKernels::load(ctx)?),
            _ => None,
        };
        let mut opt = Optimizer {
            store,
            stream: stream.clone(),
            cfg,
            engine,
            choice,
            params: Vec::new(),
            index: std::collections::HashMap::new(),
            t: 0,
            gpu,
            worker: None,
            step: StepBook::default(),
            undone: 0,
            busy: 0.0,
            log: BusyLog::default(),
        };
        let mut seen = std::collections::HashSet::new();
        if let Some(twice) = infos.iter().find(|i| !seen.insert(i.id)) {
            return Err(Error::InvalidArgument(format!("{} is given twice", twice.name)));
        }
        // Every gradient first, then the masters and moments: host memory takes the gradients
        // (written and read every step) before the state, which spills to Disk when it is short.
        let mut grads = Vec::with_capacity(infos.len());
        for info in &infos {
            match opt.put_grad(info) {
                Ok(g) => grads.push(g),
                Err(e) => {
                    opt.remove_ids(&grads);
                    return Err(e);
                }
            }
        }
        for (i, info) in infos.into_iter().enumerate() {
            match opt.add(info, grads[i]) {
                Ok(st) => {
                    opt.index.insert(st.param, opt.params.len());
                    opt.params.push(st);
                }
                Err(e) => {
                    opt.remove_ids(&grads[i + 1..]);
                    opt.remove_state();
                    return Err(e);
                }
            }
        }
        if engine == Engine::Cpu {
            opt.worker = Some(spawn_worker(opt.store.clone(), opt.cfg.threads, opt.log.clone()));
        }
        Ok(opt)
    }

    /// Where state goes: the engine's tier, else (Cpu) Disk.
    fn put_state(
        &self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        data: &[u8],
    ) -> Result<TensorId> {
        let s = &self.store;
        let tier = match self.engine {
            Engine::GpuMapped => Tier::Mapped,
            _ => Tier::Pinned,
        };
        match s.put_in(tier, name, Group::OptimizerState, dtype, shape, data) {
            Ok(id) => Ok(id),
            Err(
                Error::OutOfMemory { .. } | Error::TooLarge { .. } | Error::TierDisabled { .. },
            ) if self.engine != Engine::GpuMapped => {
                s.put_in(Tier::Disk, name, Group::OptimizerState, dtype, shape, data)
            }
            Err(e) => Err(e),
        }
    }

    /// A parameter's gradient: in Pinned, else wherever `put` places it.
    fn put_grad(&self, info: &crate::TensorInfo) -> Result<TensorId> {
        let s = &self.store;
        let elems: usize = info.shape.iter().product();
        let grad_dtype = self.cfg.grad_dtype.unwrap_or(info.dtype);
        let zeros = vec![0u8; elems * grad_dtype.size_of()];
        let gname = format!("{}.grad", info.name);
        match s.put_in(Tier::Pinned, &gname, Group::Grad, grad_dtype, &info.shape, &zeros) {
            Ok(g) => Ok(g),
            Err(
                Error::OutOfMemory { .. } | Error::TooLarge { .. } | Error::TierDisabled { .. },
            ) => s.put_group(&gname, Group::Grad, grad_dtype, &info.shape, &zeros),
            Err(e) => Err(e),
        }
    }

    /// Removes tensors made for parameters not yet added (a failed `new`).
    fn remove_ids(&self, ids: &[TensorId]) {
        for &id in ids {
            if let Err(e) = self.store.remove(id) {
                self.store.shared.defer_err(e);
            }
        }
    }

    /// A parameter's master weights (bf16 parameters) and moments, beside its gradient `grad`.
    fn add(&self, info: crate::TensorInfo, grad: TensorId) -> Result<ParamState> {
        let s = &self.store;
        let elems: usize = info.shape.iter().product();
        let id = s.lookup(&info.name).ok_or_else(|| Error::InvalidArgument(info.name.clone()))?;
        let mut st = ParamState {
            param: id,
            dtype: info.dtype,
            elems,
            grad,
            master: None,
            moments: None,
            backup: None,
        };
        let r = (|| -> Result<()> {
            if info.dtype == DType::BF16 {
                let values: Vec<f32> = <bf16 as Float>::from_ne_bytes(&s.read(id)?)
                    .iter()
                    .map(|b| b.to_f32())
                    .collect();
                let name = format!("{}.master", info.name);
                st.master =
                    Some(self.put_state(&name, DType::F32, &info.shape, &f32_bytes(&values))?);
            }
            if self.cfg.algorithm.moments() > 0 {
                let z = vec![0u8; elems * 4];
                let m =
                    self.put_state(&format!("{}.exp_avg", info.name), DType::F32, &info.shape, &z)?;
                let v = match self.put_state(
                    &format!("{}.exp_avg_sq", info.name),
                    DType::F32,
                    &info.shape,
                    &z,
                ) {
                    Ok(v) => v,
                    Err(e) => {
                        let _ = s.remove(m);
                        return Err(e);
                    }
                };
                st.moments = Some((m, v));
            }
            Ok(())
        })();
        if let Err(e) = r {
            for id in [Some(st.grad), st.master].into_iter().flatten() {
                let _ = s.remove(id);
            }
            return Err(e);
        }
        Ok(st)
    }

    /// Removes the state tensors made so far; a removal that fails (a view still holds the
    /// tensor) is reported through the store's `check_err`.
    fn remove_state(&mut self) {
        self.index.clear();
        for st in self.params.drain(..) {
            let ids = [Some(st.grad), st.master, st.moments.map(|m| m.0), st.moments.map(|m| m.1)];
            let backups = st.backup.map_or_else(Vec::new, |b| b.ids());
            for id in ids.into_iter().flatten().chain(backups) {
                if let Err(e) = self.store.remove(id) {
                    self.store.shared.defer_err(e);
                }
            }
        }
    }

    /// The engine in use (what `Auto` resolved to).
    pub fn engine(&self) -> Engine {
        self.engine
    }

    /// `Auto`'s decision and its estimates; `None` when an engine was named.
    pub fn choice(&self) -> Option<&AutoChoice> {
        self.choice.as_ref()
    }

    /// Parameters.
    pub fn len(&self) -> usize {
        self.params.len()
    }

    /// No parameters.
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// Steps completed ([`Optimizer::finish`] calls).
    pub fn steps(&self) -> u64 {
        self.t
    }

    /// The state of parameter `param`, or an error naming it when the optimizer does not train
    /// it.
    fn state_of(&self, param: TensorId) -> Result<ParamState> {
        self.index.get(&param).map(|&i| self.params[i]).ok_or_else(|| {
            Error::InvalidArgument(format!("{param} is not a parameter of this optimizer"))
        })
    }

    /// The parameters, in the order given to [`Optimizer::new`].
    pub fn params(&self) -> impl Iterator<Item = TensorId> + '_ {
        self.params.iter().map(|st| st.param)
    }

    /// The gradient tensor of parameter `param`. [`Optimizer::update`] consumes it: its contents
    /// are unspecified afterwards until it is written again (the GPU engines
    /// [`Store::discard`] it, so evicting it costs no write-back). Accumulate into it on the
    /// optimizer's stream, for example with
    /// [`Linalg::accumulate`](crate::compute::linalg::Linalg::accumulate) on a
    /// [`Store::device_view_for_overwrite`] (first micro-batch) or [`Store::device_view`]
    /// (later ones) view.
    pub fn grad(&self, param: TensorId) -> Result<TensorId> {
        Ok(self.state_of(param)?.grad)
    }

    /// The fp32 master weights of parameter `param`; `None` for an f32 parameter (its own
    /// master).
    pub fn master(&self, param: TensorId) -> Result<Option<TensorId>> {
        Ok(self.state_of(param)?.master)
    }

    /// Sets parameter `param`'s fp32 master weights to `values` (for example the f32 values a
    /// bf16 model was initialised from, which its bf16 copy only approximates) and the
    /// parameter to their bf16 rounding. For an f32 parameter, sets the parameter.
    pub fn load_master(&mut self, param: TensorId, values: &[f32]) -> Result<()> {
        let st = self.state_of(param)?;
        if values.len() != st.elems {
            return Err(Error::LengthMismatch {
                expected: st.elems as u64 * 4,
                got: values.len() as u64 * 4,
                what: "master weights".into(),
            });
        }
        match st.master {
            Some(m) => {
                self.store.write(m, &f32_bytes(values))?;
                let rounded: Vec<bf16> =
                    values.iter().map(|&x| <bf16 as Float>::from_f32(x)).collect();
                let mut b = vec![0u8; st.elems * 2];
                bf16::write_ne_bytes(&rounded, &mut b);
                self.store.write(st.param, &b)
            }
            None => self.store.write(st.param, &f32_bytes(values)),
        }
    }

    /// Every optimizer-state tensor (masters and moments), for accounting.
    pub fn state_tensors(&self) -> Vec<TensorId> {
        self.params
            .iter()
            .flat_map(|st| [st.master, st.moments.map(|m| m.0), st.moments.map(|m| m.1)])
            .flatten()
            .collect()
    }

    /// Updates parameter `param` from its gradient, which must be complete (every view of it
    /// dropped) and is consumed (see [`Optimizer::grad`]). Cpu: queues the update (it runs once
    /// the gradient has reached host memory); GPU engines: issues the kernel on the optimizer's
    /// stream. The parameter's compute copy is refreshed. Call [`Optimizer::finish`] once every
    /// parameter of the step was updated.
    pub fn update(&mut self, param: TensorId) -> Result<()> {
        self.update_scaled(param, 1.0)
    }

    /// [`Optimizer::update`] with the gradient multiplied by `grad_scale` (global gradient-norm
    /// clipping's coefficient, as `torch.nn.utils.clip_grad_norm_` applies it): every engine
    /// scales each value as it reads it (the Cpu engine in its loop, the GPU kernels by their
    /// `grad_scale` argument, their emulation on the host backend as the Cpu engine), so
    /// clipping costs no pass over the gradient and no host round trip. A scale of 1 is
    /// [`Optimizer::update`].
    ///
    /// A step can be retried after a failure: a parameter whose update failed is not stepped,
    /// and updating it again gives what a clean update gives (where the failure came after the
    /// arithmetic, the retry finishes its writes instead of stepping twice). A parameter already
    /// updated (or queued) in this step is refused with [`Error::InvalidArgument`];
    /// [`Optimizer::unstepped`] lists the parameters left to update.
    pub fn update_scaled(&mut self, param: TensorId, grad_scale: f32) -> Result<()> {
        let st = self.state_of(param)?;
        if self.step.stepped.contains(&param) || self.step.queued.contains(&param) {
            return Err(Error::InvalidArgument(format!(
                "{param} was updated in this step already: retry only the parameters \
                 Optimizer::unstepped lists, then call finish"
            )));
        }
        // A failed update is redone; where its arithmetic was done, only its writes are left.
        if let Some(mut left) = self.step.failed.remove(&param).filter(|c| !c.0.is_empty()) {
            return match left.apply(&self.store) {
                Ok(()) => {
                    self.step.stepped.insert(param);
                    Ok(())
                }
                Err(e) => {
                    self.step.failed.insert(param, left);
                    Err(e)
                }
            };
        }
        let t = self.t + 1;
        match self.engine {
            Engine::Cpu => self.queue_cpu(st, grad_scale, None),
            _ => {
                let t0 = Instant::now();
                let mut left = Commit::default();
                let r = self.gpu_update(&st, t, grad_scale, &mut left);
                self.busy += t0.elapsed().as_secs_f64();
                self.log.lock().push_back((t0, Some(Instant::now())));
                match r {
                    Ok(()) => {
                        self.step.stepped.insert(param);
                    }
                    Err(_) => {
                        self.step.failed.insert(param, left);
                    }
                }
                r
            }
        }
    }

    /// Queues a Cpu update of `st` (speculative with `save`: what it overwrites is saved there
    /// first).
    fn queue_cpu(&mut self, st: ParamState, grad_scale: f32, save: Option<Backup>) -> Result<()> {
        let (param, t, alg) = (st.param, self.t + 1, self.cfg.algorithm);
        // Start the write-back of a gradient made on the device now.
        let queued = self.store.release(&[st.grad]).and_then(|()| {
            let w = self.worker.as_mut().expect("Cpu engine has a worker");
            let job = CpuJob { st, t, alg, grad_scale, save };
            w.tx.as_ref().expect("open").send(job).map_err(|_| {
                Error::InvalidArgument("the optimizer's worker thread has stopped".into())
            })?;
            w.pending += 1;
            Ok(())
        });
        match queued {
            Ok(()) => drop(self.step.queued.insert(param)),
            // Not queued: the step cannot finish until it is retried.
            Err(_) => drop(self.step.failed.insert(param, Commit::default())),
        }
        queued
    }

    /// The parameters not updated yet in this step (neither done nor queued): after a failed
    /// step, the ones to update again before [`Optimizer::finish`].
    pub fn unstepped(&self) -> Vec<TensorId> {
        self.params
            .iter()
            .map(|st| st.param)
            .filter(|p| !self.step.stepped.contains(p) && !self.step.queued.contains(p))
            .collect()
    }

    /// Sets the learning rate of the updates queued from now on (a schedule's value for the
    /// coming step); updates already queued keep theirs.
    pub fn set_lr(&mut self, lr: f64) {
        match &mut self.cfg.algorithm {
            Algorithm::AdamW(h) => h.lr = lr,
            Algorithm::Sgd(h) => h.lr = lr,
        }
    }

    /// The update rule as it stands (its learning rate the last [`Optimizer::set_lr`]'s).
    pub fn algorithm(&self) -> Algorithm {
        self.cfg.algorithm
    }

    /// Sets the number of steps completed (what [`Optimizer::steps`] returns, and AdamW's bias
    /// correction counts from): for resuming from a checkpoint saved after that many steps,
    /// with the state tensors written back. Between steps only (no update queued).
    pub fn set_steps(&mut self, steps: u64) -> Result<()> {
        if self.pending() > 0 || !self.step.speculated.is_empty() {
            return Err(Error::InvalidArgument(
                "set_steps with updates still queued: call finish first".into(),
            ));
        }
        self.t = steps;
        Ok(())
    }

    /// Updates queued on the Cpu engine's worker and not yet done (0 on the GPU engines).
    pub fn pending(&self) -> usize {
        self.worker.as_ref().map_or(0, |w| w.pending)
    }

    /// Waits until at most `left` queued updates are still pending. The Cpu engine's worker
    /// runs the updates in the order they were queued, so this waits for all but the last
    /// `left` queued: a trainer that queued layer after layer waits for one layer's update
    /// without waiting for the layers queued after it. The step still ends with
    /// [`Optimizer::finish`]. Returns the first error of the updates waited for.
    pub fn wait_pending(&mut self, left: usize) -> Result<()> {
        let mut first = None;
        if let Some(w) = self.worker.as_mut() {
            while w.pending > left {
                let Ok((out, secs)) = w.done.recv() else {
                    w.pending = 0;
                    first.get_or_insert(Error::InvalidArgument(
                        "the optimizer's worker thread has stopped".into(),
                    ));
                    // Their outcomes are unknown: failed, so the step cannot finish.
                    for p in std::mem::take(&mut self.step.queued) {
                        self.step.failed.entry(p).or_default();
                    }
                    break;
                };
                w.pending -= 1;
                self.busy += secs;
                self.step.queued.remove(&out.param);
                if let Some(saved) = self.step.speculated.get_mut(&out.param) {
                    *saved = out.saved;
                }
                match out.result {
                    Ok(()) => {
                        self.step.stepped.insert(out.param);
                    }
                    Err(e) => {
                        self.step.failed.insert(out.param, out.left.unwrap_or_default());
                        first.get_or_insert(e);
                    }
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Seconds the updates have run so far, summed: the Cpu engine's worker, from each job's
    /// start to its end (counted once [`Optimizer::wait_pending`] or [`Optimizer::finish`] has
    /// seen the job done), and the GPU engines' host time to issue theirs. Beside the time a
    /// caller spent waiting for them, it says how much of the optimizer ran hidden.
    pub fn update_seconds(&self) -> f64 {
        self.busy
    }

    /// Seconds the updates ran within each of `spans` (`(start, end)` on the host's clock), on
    /// the one clock of the caller's own: the Cpu engine's jobs from their start to their end
    /// (one still running counts up to now), the GPU engines' host time to issue theirs. Spans
    /// only move forward: what ended before the earliest span's start is forgotten.
    ///
    /// A trainer measures its step's window and the spans it waited for the optimizer: the run
    /// time within the window less the run time within its waits is the optimizer's time
    /// hidden behind the step's own work, and the waits are its time exposed.
    pub fn busy_within(&self, spans: &[(Instant, Instant)]) -> Vec<f64> {
        let now = Instant::now();
        let mut log = self.log.lock();
        if let Some(first) = spans.iter().map(|s| s.0).min() {
            while log.front().is_some_and(|(_, end)| end.is_some_and(|e| e < first)) {
                log.pop_front();
            }
        }
        spans
            .iter()
            .map(|&(a, b)| {
                log.iter()
                    .map(|&(s, e)| {
                        let (s, e) = (s.max(a), e.unwrap_or(now).min(b));
                        e.saturating_duration_since(s).as_secs_f64()
                    })
                    .fold(0.0, |a, b| a + b)
            })
            .collect()
    }

    /// Ends the step: waits for queued updates (Cpu) and returns the first error. A step with
    /// a failed update does not end: update the parameters [`Optimizer::unstepped`] lists again
    /// (a transient fault), then call `finish` again.
    pub fn finish(&mut self) -> Result<()> {
        self.wait_pending(0)?;
        if !self.step.speculated.is_empty() {
            return Err(Error::InvalidArgument(
                "speculative updates of this step are neither committed nor undone: call \
                 Optimizer::commit_speculative or Optimizer::undo_speculative before finish"
                    .into(),
            ));
        }
        if !self.step.failed.is_empty() {
            return Err(Error::InvalidArgument(
                "an update failed in this step: update the parameters Optimizer::unstepped \
                 lists again before finish"
                    .into(),
            ));
        }
        self.step = StepBook::default();
        self.t += 1;
        Ok(())
    }

    fn gpu_update(
        &mut self,
        st: &ParamState,
        t: u64,
        grad_scale: f32,
        left: &mut Commit,
    ) -> Result<()> {
        let s = &self.store;
        let stream = &self.stream;
        let state_view = |id: TensorId| -> Result<DeviceView> {
            match self.engine {
                Engine::GpuMapped => s.mapped_view(id, stream).map(|v| v.into_inner()),
                _ => s.device_view(id, stream),
            }
        };
        let grad = s.device_view(st.grad, stream)?;
        let mut p = match st.master {
            Some(m) => state_view(m)?,
            None => s.device_view(st.param, stream)?,
        };
        let mut out = match st.master {
            Some(_) => Some(s.device_view(st.param, stream)?),
            None => None,
        };
        let mut mv = match st.moments {
            Some((m, v)) => Some((state_view(m)?, state_view(v)?)),
            None => None,
        };
        p.mark_dirty();
        if let Some(o) = out.as_mut() {
            o.mark_dirty();
        }
        if let Some((m, v)) = mv.as_mut() {
            m.mark_dirty();
            v.mark_dirty();
        }
        let r = match &self.gpu {
            Some(k) => self.launch(k, t, grad_scale, &grad, &mut p, out.as_mut(), mv.as_mut()),
            None => self.emulate(st, t, grad_scale, &grad, &mut p, out.as_mut(), mv.as_mut(), left),
        };
        drop((grad, p, out, mv));
        r?;
        // The gradient is consumed: evicting it later must not write it back. (Only a hint: the
        // update is done, so a failure here must not make it look failed, and retried.)
        if let Err(e) = s.discard(st.grad) {
            s.shared.defer_err(e);
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        k: &OptimKernels,
        t: u64,
        grad_scale: f32,
        grad: &DeviceView,
        p: &mut DeviceView,
        out: Option<&mut DeviceView>,
        mv: Option<&mut (DeviceView, DeviceView)>,
    ) -> Result<()> {
        let cs =
            self.stream.cuda().ok_or_else(|| Error::BackendMismatch("no CUDA stream".into()))?;
        let not_cuda = || Error::BackendMismatch("a view without device memory".into());
        let (gf, gb);
        let grad = if grad.dtype() == DType::BF16 {
            gb = grad.cuda_view::<bf16>().ok_or_else(not_cuda)?;
            GradView::Bf16(&gb)
        } else {
            gf = grad.cuda_view::<f32>().ok_or_else(not_cuda)?;
            GradView::F32(&gf)
        };
        let mut pv = p.cuda_view_mut::<f32>().ok_or_else(not_cuda)?;
        let mut ov = match out {
            Some(o) => Some(o.cuda_view_mut::<bf16>().ok_or_else(not_cuda)?),
            None => None,
        };
        match (&self.cfg.algorithm, mv) {
            (Algorithm::AdamW(h), Some((m, v))) => {
                let mut mv = m.cuda_view_mut::<f32>().ok_or_else(not_cuda)?;
                let mut vv = v.cuda_view_mut::<f32>().ok_or_else(not_cuda)?;
                let args = adam_args(h, t);
                k.adamw(cs, [&mut pv, &mut mv, &mut vv], grad, grad_scale, ov.as_mut(), args)
            }
            (Algorithm::Sgd(h), _) => k.sgd(
                cs,
                &mut pv,
                grad,
                grad_scale,
                ov.as_mut(),
                h.lr as f32,
                h.weight_decay as f32,
            ),
            (Algorithm::AdamW(_), None) => Err(Error::InvalidArgument(
                "an AdamW parameter without its moments (internal error)".into(),
            )),
        }
    }

    /// The GPU engines on the host backend: the same arithmetic over the views' bytes.
    #[allow(clippy::too_many_arguments)]
    fn emulate(
        &self,
        st: &ParamState,
        t: u64,
        grad_scale: f32,
        grad: &DeviceView,
        p: &mut DeviceView,
        out: Option<&mut DeviceView>,
        mv: Option<&mut (DeviceView, DeviceView)>,
        left: &mut Commit,
    ) -> Result<()> {
        let f32s = |b: &[u8]| <f32 as Float>::from_ne_bytes(b);
        let g_f32;
        let g_bf16;
        let g = if grad.dtype() == DType::F32 {
            g_f32 = grad.with_host_bytes(f32s)?;
            GradSlice::F32(&g_f32)
        } else {
            g_bf16 = grad.with_host_bytes(<bf16 as Float>::from_ne_bytes)?;
            GradSlice::Bf16(&g_bf16)
        };
        let mut pv = p.with_host_bytes(f32s)?;
        let (mut m, mut v) = match &mv {
            Some((m, v)) => (m.with_host_bytes(f32s)?, v.with_host_bytes(f32s)?),
            None => (Vec::new(), Vec::new()),
        };
        let mut o = out.as_ref().map(|_| vec![bf16::ZERO; st.elems]);
        let alg = &self.cfg.algorithm;
        cpu_update_scaled(alg, t, 1, &mut pv, &mut m, &mut v, g, grad_scale, o.as_deref_mut())?;
        // The arithmetic is done: its results are written through the views, and whatever a
        // failure leaves unwritten is kept for a retry to write (never to step again).
        let mut writes: Vec<(&mut DeviceView, Vec<u8>)> = vec![(p, f32_bytes(&pv))];
        if let Some((mview, vview)) = mv {
            writes.push((mview, f32_bytes(&m)));
            writes.push((vview, f32_bytes(&v)));
        }
        if let (Some(view), Some(o)) = (out, o) {
            let mut b = vec![0u8; o.len() * 2];
            bf16::write_ne_bytes(&o, &mut b);
            writes.push((view, b));
        }
        let mut failed = None;
        for (view, bytes) in writes {
            if failed.is_none() {
                match view.with_host_bytes_mut(|b| b.copy_from_slice(&bytes)) {
                    Ok(()) => continue,
                    Err(e) => failed = Some(e),
                }
            }
            left.0.push((view.id(), bytes));
        }
        failed.map_or(Ok(()), Err)
    }
}

impl Drop for Optimizer {
    /// Waits for queued updates (their errors go to the store's [`Store::check_err`]), then
    /// removes the optimizer's state from the store: gradients, fp32 master weights, moments.
    /// Save what is needed first (for example the masters with
    /// [`Store::save_safetensors_as`]).
    fn drop(&mut self) {
        if let Some(mut w) = self.worker.take() {
            w.tx.take();
            while w.pending > 0 {
                match w.done.recv() {
                    Ok((Outcome { result: Err(e), .. }, _)) => {
                        self.store.shared.deferred.lock().push(e)
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
                w.pending -= 1;
            }
            if let Some(h) = w.handle.take() {
                let _ = h.join();
            }
        }
        self.remove_state();
    }
}

fn spawn_worker(store: Arc<Store>, threads: usize, log: BusyLog) -> CpuWorker {
    let (tx, rx) = unbounded::<CpuJob>();
    let (done_tx, done) = unbounded();
    let handle = std::thread::Builder::new()
        .name("strata-optim".into())
        .spawn(move || {
            for job in rx {
                let t0 = Instant::now();
                log.lock().push_back((t0, None));
                // A panic in a job (a bug) is reported as an error; the worker lives on.
                let mut left = Commit::default();
                let mut saved = false;
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    cpu_job(&store, &job.alg, threads, &job, &mut left, &mut saved)
                }))
                .unwrap_or_else(|_| {
                    Err(Error::InvalidArgument("the optimizer's update panicked".into()))
                });
                let (param, left) = (job.st.param, r.is_err().then_some(left));
                let out = Outcome { param, left, result: r, saved };
                if let Some(last) = log.lock().back_mut() {
                    last.1 = Some(Instant::now());
                }
                if done_tx.send((out, t0.elapsed().as_secs_f64())).is_err() {
                    break;
                }
            }
        })
        .ok();
    CpuWorker { tx: Some(tx), done, pending: 0, handle }
}

/// A tensor's values for the CPU: in place through a host view, or (state on disk) read out
/// and written back.
enum Slot {
    View(HostView),
    F32(TensorId, Vec<f32>),
    Bf16(TensorId, Vec<bf16>),
}

impl Slot {
    fn open(store: &Store, id: TensorId, dtype: DType) -> Result<Slot> {
        match retry_busy(|| store.host_view_in_place(id)) {
            Ok(v) => return Ok(Slot::View(v)),
            Err(Error::NotInTier { .. }) => {}
            Err(e) => return Err(e),
        }
        let bytes = retry_busy(|| store.read_in_place(id))?;
        Ok(match dtype {
            DType::F32 => Slot::F32(id, <f32 as Float>::from_ne_bytes(&bytes)),
            _ => Slot::Bf16(id, <bf16 as Float>::from_ne_bytes(&bytes)),
        })
    }

    fn f32s(&mut self) -> Result<&mut [f32]> {
        match self {
            Slot::View(v) => {
                let id = v.id();
                v.f32s_mut().ok_or_else(|| dtype_err(id))
            }
            Slot::F32(_, v) => Ok(v),
            Slot::Bf16(id, _) => Err(dtype_err(*id)),
        }
    }

    fn bf16s(&mut self) -> Result<&mut [bf16]> {
        match self {
            Slot::View(v) => {
                let id = v.id();
                v.bf16s_mut().ok_or_else(|| dtype_err(id))
            }
            Slot::Bf16(_, v) => Ok(v),
            Slot::F32(id, _) => Err(dtype_err(*id)),
        }
    }

    fn grad(&self) -> Result<GradSlice<'_>> {
        Ok(match self {
            Slot::View(v) => match (v.f32s(), v.bf16s()) {
                (Some(f), _) => GradSlice::F32(f),
                (_, Some(b)) => GradSlice::Bf16(b),
                _ => return Err(dtype_err(v.id())),
            },
            Slot::F32(_, v) => GradSlice::F32(v),
            Slot::Bf16(_, v) => GradSlice::Bf16(v),
        })
    }

    /// What writing values read out back into the store takes (`None` for a view, which wrote
    /// in place and commits as it drops).
    fn into_write(self) -> Option<(TensorId, Vec<u8>)> {
        match self {
            Slot::View(_) => None,
            Slot::F32(id, v) => Some((id, f32_bytes(&v))),
            Slot::Bf16(id, v) => {
                let mut b = vec![0u8; v.len() * 2];
                bf16::write_ne_bytes(&v, &mut b);
                Some((id, b))
            }
        }
    }
}

/// Runs `f` until it is not [`Error::Busy`], for up to a minute: the caller's views and scopes
/// of a tensor end moments after it queued the update. A tensor held longer (a `pin` on a
/// parameter the Cpu engine updates) gives the `Busy` error.
fn retry_busy<T>(mut f: impl FnMut() -> Result<T>) -> Result<T> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match f() {
            Err(Error::Busy { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_micros(50));
            }
            r => return r,
        }
    }
}

fn dtype_err(id: TensorId) -> Error {
    Error::InvalidArgument(format!("optimizer tensor {id:?} has an unexpected dtype"))
}

/// A Cpu update: the arithmetic over host views (in place) and over state read out of the store
/// (state on disk), then the writes of what was read out. A failure after the arithmetic leaves
/// the writes not done in `left`, for a retry to finish.
fn cpu_job(
    store: &Store,
    alg: &Algorithm,
    threads: usize,
    job: &CpuJob,
    left: &mut Commit,
    saved: &mut bool,
) -> Result<()> {
    let st = &job.st;
    let grad = Slot::open(store, st.grad, store.info(st.grad)?.dtype)?;
    let mut p = Slot::open(store, st.master.unwrap_or(st.param), DType::F32)?;
    let mut mv = match st.moments {
        Some((m, v)) => {
            Some((Slot::open(store, m, DType::F32)?, Slot::open(store, v, DType::F32)?))
        }
        None => None,
    };
    let mut out = match st.master {
        Some(_) => Some(Slot::open(store, st.param, st.dtype)?),
        None => None,
    };
    // A speculative update saves what it overwrites: in the update's own pass into a backup in
    // host memory, else (a backup spilled to disk) whole, written, before anything changes.
    let mut backup = job.save.map(|b| speculate::BackupSlots::open(store, &b)).transpose()?;
    if let Some(b) = backup.take_if(|b| !b.in_place()) {
        b.save_whole(store, &mut p, mv.as_mut(), out.as_mut())?;
        *saved = true;
    }
    {
        let g = grad.grad()?;
        let (m, v): (&mut [f32], &mut [f32]) = match mv.as_mut() {
            Some((m, v)) => (m.f32s()?, v.f32s()?),
            None => (&mut [], &mut []),
        };
        let o = match out.as_mut() {
            Some(o) => Some(o.bf16s()?),
            None => None,
        };
        let into = backup.as_mut().map(|b| b.slices()).transpose()?;
        let whole = into.is_some();
        update_slices(alg, job.t, threads, p.f32s()?, m, v, g, job.grad_scale, o, into)?;
        *saved |= whole;
    }
    // The backup's views commit as they drop, before the state's writes.
    drop((grad, backup));
    let mut slots = vec![p];
    if let Some((m, v)) = mv {
        slots.push(m);
        slots.push(v);
    }
    slots.extend(out);
    // Host views wrote in place (they commit as they drop); read-out state is written back.
    left.0 = slots.into_iter().filter_map(Slot::into_write).collect();
    left.apply(store)
}

/// The bytes an update must read and write per step, for bandwidth bounds: state read and
/// written, gradient read, compute copy written.
pub fn update_bytes(alg: &Algorithm, elems: u64, param: DType, grad: DType) -> u64 {
    let (s, g, p) = per_elem(alg, param, grad);
    let written_copy = if param == DType::F32 { 0 } else { p };
    elems * (2 * s + g + written_copy)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> Arc<Store> {
        Arc::new(
            Store::builder()
                .host_backend()
                .capacity(Tier::Device, 1 << 20)
                .capacity(Tier::Pinned, 1 << 20)
                .build()
                .unwrap(),
        )
    }

    /// Auto's estimates on a machine: the H200 preset has no host copy rate, so the Cpu engine
    /// is not estimated there and says which figure it lacks; with one, the CPU step of a large
    /// model against a short Mapped tier wins, and the choice names the machine.
    #[test]
    fn auto_estimates_on_a_machine_and_names_what_it_lacks() {
        let alg = Algorithm::AdamW(AdamW::default());
        let traffic = StepTraffic { h2d_bytes: 1 << 30, d2h_bytes: 0, device_bytes: 1 << 30 };
        let caps = [2 << 30, 64 << 30, 1 << 20, 0];
        let (f, b) = (DType::F32, DType::BF16);
        let preset = Machine::h200();
        let c = choose(&alg, 1 << 30, b, f, &traffic, caps, &preset);
        let cpu = &c.estimates[0];
        assert_eq!(cpu.0, Engine::Cpu);
        assert!(cpu.1.as_ref().unwrap_err().contains("host_copy is not known"), "{c}");
        assert_eq!(c.engine, Engine::GpuResident, "{c}");
        let measured = Machine { host_copy: Some(200e9), ..Machine::h200() };
        let c = choose(&alg, 1 << 30, b, f, &traffic, caps, &measured);
        assert_eq!(c.engine, Engine::Cpu, "{c}");
        assert!(c.to_string().contains("host copy 200.0 GB/s on the H200 preset"), "{c}");
        // The CPU step: state read and written, the gradient read, the bf16 copy written.
        let want = (2 * 12 + 4 + 2) as f64 * (1u64 << 30) as f64 / 200e9;
        assert!((c.estimates[0].1.as_ref().unwrap() - want).abs() < 1e-9, "{c}");
    }

    /// Two steps of AdamW on one f32 parameter from `grad`: the first at lr 0.1 with the gradient
    /// given to `update_scaled(scale)`, the second after `set_lr(0.05)`.
    fn two_steps(engine: Engine, grad: &[f32], scale: f32) -> Vec<f32> {
        let s = store();
        let w = s.put_slice("w", &[grad.len()], &vec![0.5f32; grad.len()]).unwrap();
        let alg = Algorithm::AdamW(AdamW { lr: 0.1, weight_decay: 0.01, ..AdamW::default() });
        let mut opt = Optimizer::new(
            s.clone(),
            &s.stream().unwrap(),
            &[w],
            OptimizerConfig::new(alg, engine),
        )
        .unwrap();
        for lr in [None, Some(0.05)] {
            if let Some(lr) = lr {
                opt.set_lr(lr);
            }
            s.write_slice(opt.grad(w).unwrap(), grad).unwrap();
            opt.update_scaled(w, scale).unwrap();
            opt.finish().unwrap();
        }
        s.read_vec::<f32>(w).unwrap()
    }

    #[test]
    fn a_scaled_update_is_the_update_of_the_scaled_gradient_and_set_lr_applies_to_the_next() {
        let g: Vec<f32> = (0..5000).map(|i| (i as f32 * 0.37).sin()).collect();
        let scaled: Vec<f32> = g.iter().map(|x| x * 0.3).collect();
        for engine in [Engine::Cpu, Engine::GpuResident] {
            let a = two_steps(engine, &g, 0.3);
            let b = two_steps(engine, &scaled, 1.0);
            assert_eq!(a, b, "{engine}");
            // The same two steps by hand, the second at the new learning rate.
            let (mut p, mut m, mut v) =
                (vec![0.5f32; g.len()], vec![0.0; g.len()], vec![0.0; g.len()]);
            for (t, lr) in [(1, 0.1), (2, 0.05)] {
                let alg = Algorithm::AdamW(AdamW { lr, weight_decay: 0.01, ..AdamW::default() });
                cpu_update(&alg, t, 1, &mut p, &mut m, &mut v, GradSlice::F32(&scaled), None)
                    .unwrap();
            }
            assert_eq!(a, p, "{engine}");
        }
    }

    #[test]
    fn wait_pending_waits_for_the_updates_queued_first_and_set_steps_resumes_the_count() {
        let s = store();
        let ids: Vec<TensorId> = (0..3)
            .map(|i| s.put_slice(&format!("w{i}"), &[4096], &[1.0f32; 4096]).unwrap())
            .collect();
        let cfg = OptimizerConfig::new(Algorithm::AdamW(AdamW::default()), Engine::Cpu);
        let mut opt = Optimizer::new(s.clone(), &s.stream().unwrap(), &ids, cfg).unwrap();
        for &id in &ids {
            s.write_slice(opt.grad(id).unwrap(), &[1.0f32; 4096]).unwrap();
            opt.update(id).unwrap();
        }
        assert_eq!(opt.pending(), 3);
        opt.wait_pending(1).unwrap();
        assert_eq!(opt.pending(), 1);
        assert!(opt.set_steps(5).is_err(), "an update is still queued");
        opt.finish().unwrap();
        assert_eq!((opt.pending(), opt.steps()), (0, 1));
        assert!(opt.update_seconds() > 0.0);
        opt.set_steps(5).unwrap();
        assert_eq!(opt.steps(), 5);
    }
}
