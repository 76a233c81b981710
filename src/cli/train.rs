//! Out-of-core training with every piece of training state in the store: the model behind
//! `strata train-demo --mode train` and `examples/out_of_core.rs --mode train`.
//!
//! The model is an MLP of `L` square `[H, H]` linear layers without bias: `a0 = x`,
//! `z_i = a_i · W_iᵀ`, `a_{i+1} = relu(z_i)` for `i < L − 1`, output `z_{L−1}`, loss
//! `0.5 · Σ(output − y)² / R`, the same full batch of `R` rows every step. Weights are store
//! tensors of group `Param` named `layers.{i}.weight`; gradients, fp32 master weights and the
//! optimizer's moments are store tensors too ([`strata::optim`]); activations are kept on the
//! device, offloaded through the store, or recomputed from checkpoints (`--activations`).
//!
//! Inputs can come from files, so that a run can be checked against an independent
//! implementation: `--init FILE` (weights `layers.{i}.weight`, `[H, H]`, f32 or bf16; `L` and
//! `H` are taken from it), `--data FILE` (`x` and `y`, `[R, H]`, f32), and `--save FILE` writes
//! the final weights (f32, the same names). Without them the weights and data are seeded random.
//! The tests (`tests.rs`) run it against a plain reference, from `a_short_run_lowers_the_loss`
//! on.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use half::bf16;

use crate::cli::args::{
    check_output, ActivationsArg, DTypeArg, EngineArg, ModeArg, OptimizerArg, TrainDemoArgs,
};
use strata::linalg::{loss_value, Float, Linalg, Matrix, LOSS_PARTIALS};
use strata::optim::{AdamW, Algorithm, Engine, Optimizer, OptimizerConfig, Sgd, StepTraffic};
use strata::plan::{self, PlanConfig, TensorEntry};
use strata::probe::median_after_first;
use strata::{
    format_size, DType, Error, Group, MappedFile, PolicyKind, Result, Store, TensorId, Tier,
};

/// What happens to the activations the backward pass needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activations {
    /// Every layer's input stays on the device (pinned there in the store).
    Keep,
    /// Every layer's input goes to the store (`Activation` tensors): written back during the
    /// forward pass, prefetched in reverse for the backward pass.
    Offload,
    /// Every k-th layer's input is stored (as with `Offload`); the others are recomputed from
    /// it in the backward pass.
    Recompute,
}

/// Which optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerKind {
    /// SGD without momentum.
    Sgd,
    /// AdamW.
    AdamW,
}

/// What to run.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// Layers (from `--init` when given).
    pub layers: usize,
    /// Width (from `--init` when given).
    pub hidden: usize,
    /// Batch rows (from `--data` when given).
    pub rows: usize,
    /// Steps.
    pub steps: usize,
    /// Learning rate.
    pub lr: f64,
    /// SGD or AdamW.
    pub optimizer: OptimizerKind,
    /// AdamW's betas.
    pub betas: (f64, f64),
    /// AdamW's eps.
    pub eps: f64,
    /// Weight decay (decoupled for AdamW, L2 for SGD).
    pub weight_decay: f64,
    /// The optimizer's engine.
    pub engine: Engine,
    /// Run every engine (and `Auto`) one after the other and compare their step times.
    pub all_engines: bool,
    /// Threads of the Cpu engine (0: every core).
    pub threads: usize,
    /// Micro-batches per step (their gradients are accumulated in f32).
    pub accumulate: usize,
    /// Compute dtype (`None`: bf16 on CUDA, f32 on the host backend).
    pub dtype: Option<DType>,
    /// Activation mode.
    pub activations: Activations,
    /// With `Recompute`: store every k-th layer's input.
    pub checkpoint_every: usize,
    /// Initial weights.
    pub init: Option<PathBuf>,
    /// Inputs and targets.
    pub data: Option<PathBuf>,
    /// Where to write the final weights.
    pub save: Option<PathBuf>,
    /// Device tier budget.
    pub device_budget: u64,
    /// Pinned tier budget (`None`: room for everything host-side).
    pub pinned_budget: Option<u64>,
    /// Mapped tier budget (`None`: room for the optimizer state when the engine may use it).
    pub mapped_budget: Option<u64>,
    /// Layers a scope prefetches ahead.
    pub ahead: usize,
    /// Store policy.
    pub policy: PolicyKind,
    /// Seed of the random weights and data.
    pub seed: u64,
    /// Force the host backend.
    pub host: bool,
    /// Also run the forward and backward passes with every weight resident (the compute floor).
    pub compare: bool,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            layers: 32,
            hidden: 8192,
            rows: 2048,
            steps: 5,
            lr: 1e-3,
            optimizer: OptimizerKind::AdamW,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
            engine: Engine::Auto,
            all_engines: false,
            threads: 0,
            accumulate: 1,
            dtype: None,
            activations: Activations::Keep,
            checkpoint_every: 4,
            init: None,
            data: None,
            save: None,
            device_budget: 8 << 30,
            pinned_budget: None,
            mapped_budget: None,
            ahead: 2,
            policy: PolicyKind::Schedule,
            seed: 0,
            host: false,
            compare: true,
        }
    }
}

impl TrainConfig {
    /// Parses flags ([`TrainDemoArgs`], without a program name) over the defaults (L=32,
    /// H=8192, rows 2048, 5 steps, AdamW lr 1e-3, engine auto, activations keep, device budget
    /// 8 GiB). `--mode train` is accepted and implied.
    #[cfg(test)] // the binary parses its whole command line (`Cli`)
    pub fn parse<I, S>(args: I) -> Result<TrainConfig>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        TrainConfig::from_args(&TrainDemoArgs::try_parse(args)?)
    }

    /// The configuration parsed flags describe; an error names a flag of the bf16 benchmark
    /// loop, which the trainer does not take.
    pub fn from_args(a: &TrainDemoArgs) -> Result<TrainConfig> {
        a.refuse_bench_flags()?;
        match (a.mode, a.optimizer) {
            (Some(ModeArg::Forward), _) => {
                return Err(Error::InvalidArgument(
                    "the trainer runs --mode train; --mode forward is the bf16 benchmark loop"
                        .into(),
                ))
            }
            (_, Some(OptimizerArg::DeviceSgd)) => {
                return Err(Error::InvalidArgument(
                    "--optimizer device-sgd is the bf16 benchmark loop's; the trainer runs sgd \
                     or adamw"
                        .into(),
                ))
            }
            _ => {}
        }
        let d = TrainConfig::default();
        let c = TrainConfig {
            layers: a.layers.unwrap_or(d.layers),
            hidden: a.hidden.unwrap_or(d.hidden),
            rows: a.rows.unwrap_or(d.rows),
            steps: a.steps.unwrap_or(d.steps),
            lr: a.lr.unwrap_or(d.lr),
            optimizer: match a.optimizer {
                Some(OptimizerArg::Sgd) => OptimizerKind::Sgd,
                _ => d.optimizer,
            },
            betas: (a.beta1.unwrap_or(d.betas.0), a.beta2.unwrap_or(d.betas.1)),
            eps: a.eps.unwrap_or(d.eps),
            weight_decay: a.weight_decay.unwrap_or(d.weight_decay),
            engine: a.engine.and_then(EngineArg::engine).unwrap_or(d.engine),
            all_engines: a.engine == Some(EngineArg::All),
            threads: a.threads.unwrap_or(d.threads),
            accumulate: a.accumulate.unwrap_or(d.accumulate),
            dtype: a.dtype.map(DTypeArg::dtype),
            activations: match a.activations {
                Some(ActivationsArg::Keep) | None => Activations::Keep,
                Some(ActivationsArg::Offload) => Activations::Offload,
                Some(ActivationsArg::Recompute) => Activations::Recompute,
            },
            checkpoint_every: a.checkpoint_every.unwrap_or(d.checkpoint_every),
            init: a.init.clone(),
            data: a.data.clone(),
            save: a.save.clone(),
            device_budget: a.device_budget.unwrap_or(d.device_budget),
            pinned_budget: a.pinned_budget,
            mapped_budget: a.mapped_budget,
            ahead: a.ahead.unwrap_or(d.ahead),
            policy: a.policy.unwrap_or(d.policy),
            seed: a.seed.unwrap_or(d.seed),
            host: a.host,
            compare: a.compare(),
        };
        c.check()?;
        Ok(c)
    }

    /// Refuses what cannot run: zero sizes, steps or micro-batches, a learning rate, eps or
    /// betas out of range, an output file with no directory to go in.
    fn check(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidArgument(m));
        if self.layers == 0 || self.hidden == 0 || self.rows == 0 || self.steps == 0 {
            return bad("layers, hidden, rows and steps must be > 0".into());
        }
        if self.accumulate == 0 || self.checkpoint_every == 0 {
            return bad("--accumulate and --checkpoint-every must be > 0".into());
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!("learning rate {} must be a positive finite number", self.lr));
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad(format!("eps {} must be a positive finite number", self.eps));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(format!(
                "weight decay {} must be finite and at least 0",
                self.weight_decay
            ));
        }
        let (b1, b2) = self.betas;
        if !((0.0..1.0).contains(&b1) && (0.0..1.0).contains(&b2)) {
            return bad(format!("betas ({b1}, {b2}) must be in [0, 1)"));
        }
        if let Some(d) = self.dtype.filter(|d| !matches!(d, DType::BF16 | DType::F32)) {
            return bad(format!("the trainer computes in bf16 or f32, not {d}"));
        }
        if let Some(p) = &self.save {
            check_output(p)?;
        }
        Ok(())
    }

    fn algorithm(&self) -> Algorithm {
        match self.optimizer {
            OptimizerKind::Sgd => {
                Algorithm::Sgd(Sgd { lr: self.lr, weight_decay: self.weight_decay })
            }
            OptimizerKind::AdamW => Algorithm::AdamW(AdamW {
                lr: self.lr,
                beta1: self.betas.0,
                beta2: self.betas.1,
                eps: self.eps,
                weight_decay: self.weight_decay,
            }),
        }
    }
}

/// The model's inputs, from files or seeded.
#[derive(Clone, Debug)]
pub struct Inputs {
    /// Layers.
    pub layers: usize,
    /// Width.
    pub hidden: usize,
    /// Rows of the batch.
    pub rows: usize,
    /// Each layer's weights, row-major `[H, H]`, f32.
    pub weights: Vec<Vec<f32>>,
    /// Inputs `[R, H]`.
    pub x: Vec<f32>,
    /// Targets `[R, H]`.
    pub y: Vec<f32>,
}

fn bad_file(path: &Path, tensor: Option<&str>, why: impl Into<String>) -> Error {
    Error::BadFile { path: path.to_path_buf(), tensor: tensor.map(str::to_string), why: why.into() }
}

/// The file mapped read-only ([`MappedFile`], which owns the mapping's safety argument).
fn map_file(path: &Path) -> Result<MappedFile> {
    MappedFile::open(path)
}

/// A tensor's values as f32 (f32 or, where `allow_bf16`, bf16 in the file).
fn tensor_f32(
    path: &Path,
    st: &safetensors::SafeTensors<'_>,
    name: &str,
    allow_bf16: bool,
) -> Result<(Vec<usize>, Vec<f32>)> {
    let t = st.tensor(name).map_err(|_| bad_file(path, Some(name), "missing"))?;
    let shape = t.shape().to_vec();
    let values = match t.dtype() {
        safetensors::Dtype::F32 => {
            t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        }
        safetensors::Dtype::BF16 if allow_bf16 => t
            .data()
            .chunks_exact(2)
            .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        d => {
            let want = if allow_bf16 { "f32 or bf16" } else { "f32" };
            return Err(bad_file(path, Some(name), format!("dtype {d:?}, want {want}")));
        }
    };
    Ok((shape, values))
}

fn deserialize<'a>(path: &Path, bytes: &'a [u8]) -> Result<safetensors::SafeTensors<'a>> {
    safetensors::SafeTensors::deserialize(bytes).map_err(|e| bad_file(path, None, e.to_string()))
}

/// Weights from `--init`: `layers.{i}.weight` for `i` in `0..L`, every one `[H, H]`.
pub fn load_init(path: &Path) -> Result<(usize, Vec<Vec<f32>>)> {
    let map = map_file(path)?;
    let st = deserialize(path, map.bytes())?;
    let mut layers = 0;
    for name in st.names() {
        let idx = name
            .strip_prefix("layers.")
            .and_then(|r| r.strip_suffix(".weight"))
            .and_then(|i| i.parse::<usize>().ok());
        match idx {
            Some(i) => layers = layers.max(i + 1),
            None => return Err(bad_file(path, Some(name), "not a layers.{i}.weight tensor")),
        }
    }
    if layers == 0 {
        return Err(bad_file(path, None, "no layers.{i}.weight tensors"));
    }
    let mut hidden = 0;
    let mut weights = Vec::with_capacity(layers);
    for i in 0..layers {
        let name = format!("layers.{i}.weight");
        let (shape, values) = tensor_f32(path, &st, &name, true)?;
        if i == 0 {
            hidden = shape.first().copied().unwrap_or(0);
        }
        if shape.len() != 2 || shape[0] != shape[1] || shape[0] != hidden || hidden == 0 {
            return Err(bad_file(
                path,
                Some(&name),
                format!("shape {shape:?}, want [{hidden}, {hidden}] (square, as layer 0)"),
            ));
        }
        weights.push(values);
    }
    Ok((hidden, weights))
}

/// `x` and `y` from `--data`: both `[R, H]` f32.
pub fn load_data(path: &Path, hidden: usize) -> Result<(usize, Vec<f32>, Vec<f32>)> {
    let map = map_file(path)?;
    let st = deserialize(path, map.bytes())?;
    let (xs, x) = tensor_f32(path, &st, "x", false)?;
    let (ys, y) = tensor_f32(path, &st, "y", false)?;
    if xs.len() != 2 || xs[1] != hidden || xs[0] == 0 {
        return Err(bad_file(path, Some("x"), format!("shape {xs:?}, want [R, {hidden}]")));
    }
    if ys != xs {
        return Err(bad_file(path, Some("y"), format!("shape {ys:?} differs from x's {xs:?}")));
    }
    Ok((xs[0], x, y))
}

impl Inputs {
    /// The inputs `cfg` names: files where given, seeded values otherwise.
    pub fn load(cfg: &TrainConfig) -> Result<Inputs> {
        let (hidden, weights) = match &cfg.init {
            Some(p) => load_init(p)?,
            None => {
                let (l, h, r) = (cfg.layers as u128, cfg.hidden as u128, cfg.rows as u128);
                crate::cli::check_host_memory(
                    "generating the model and its data",
                    4 * (l * h * h + 2 * r * h),
                    "use a smaller model (--layers, --hidden, --rows)",
                )?;
                let a = (3.0 / cfg.hidden as f32).sqrt();
                let n = cfg.hidden * cfg.hidden;
                (
                    cfg.hidden,
                    (0..cfg.layers)
                        .map(|l| crate::cli::mlp::uniform(cfg.seed, 1 + l as u64, n, a))
                        .collect(),
                )
            }
        };
        let (rows, x, y) = match &cfg.data {
            Some(p) => load_data(p, hidden)?,
            None => {
                let n = cfg.rows * hidden;
                (
                    cfg.rows,
                    crate::cli::mlp::uniform(cfg.seed, 1 << 32, n, 1.0),
                    crate::cli::mlp::uniform(cfg.seed, 1 << 33, n, 1.0),
                )
            }
        };
        if rows % cfg.accumulate != 0 {
            return Err(Error::InvalidArgument(format!(
                "{rows} rows do not split into {} micro-batches",
                cfg.accumulate
            )));
        }
        Ok(Inputs { layers: weights.len(), hidden, rows, weights, x, y })
    }

    fn layer_bytes(&self, dtype: DType) -> u64 {
        (self.hidden * self.hidden * dtype.size_of()) as u64
    }
}

/// One step of the loop: what the backward pass does at each position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    /// Forward through layer i.
    Fwd(usize),
    /// Recompute layer i's output from its input (recompute mode's backward).
    Re(usize),
    /// Backward through layer i.
    Bwd(usize),
}

/// The order of one micro-batch: forward, then backward (with recomputation by segment).
fn ops(layers: usize, mode: Activations, k: usize) -> Vec<Op> {
    let mut v: Vec<Op> = (0..layers).map(Op::Fwd).collect();
    match mode {
        Activations::Keep | Activations::Offload => v.extend((0..layers).rev().map(Op::Bwd)),
        Activations::Recompute => {
            let mut top = layers;
            while top > 0 {
                let start = ((top - 1) / k) * k;
                v.extend((start..top - 1).map(Op::Re));
                v.extend((start..top).rev().map(Op::Bwd));
                top = start;
            }
        }
    }
    v
}

/// Is layer i's input stored in the store (i ≥ 1)?
fn stored(mode: Activations, k: usize, i: usize) -> bool {
    i >= 1 && (mode != Activations::Recompute || i % k == 0)
}

/// The recompute segment of layer `i`: `[start, top]`.
fn segment(layers: usize, k: usize, i: usize) -> (usize, usize) {
    let start = (i / k) * k;
    (start, (start + k - 1).min(layers - 1))
}

/// Figures of one step.
#[derive(Clone, Debug)]
pub struct StepRecord {
    /// Wall-clock seconds.
    pub seconds: f64,
    /// The loss, summed over the micro-batches (forward of this step, before its update).
    pub loss: f32,
    /// Bytes copied into the Device tier.
    pub h2d_bytes: u64,
    /// Bytes copied out of the Device tier.
    pub d2h_bytes: u64,
    /// Seconds consumers waited for copies.
    pub stall_seconds: f64,
}

/// One engine's run in an `--engine all` comparison.
#[derive(Clone, Debug)]
pub struct EngineRun {
    /// The engine asked for (`Auto` included).
    pub asked: Engine,
    /// The engine that ran.
    pub engine: Engine,
    /// Median step seconds after the first.
    pub step_seconds: f64,
}

/// The outcome of [`run`].
#[derive(Clone, Debug)]
pub struct TrainReport {
    /// The compute dtype.
    pub dtype: DType,
    /// The engine that ran.
    pub engine: Engine,
    /// `Auto`'s reasoning, when it chose.
    pub choice: Option<String>,
    /// Each step's loss.
    pub losses: Vec<f32>,
    /// Median step seconds (after the first step).
    pub step_seconds: f64,
    /// Peak device bytes per group ([`Group::index`]) over the run.
    pub peak_device: [u64; 5],
    /// Bytes per group of the tensors the store held at the end (each tensor once, whatever
    /// its copies).
    pub held: [u64; 5],
    /// Bytes per group `strata inspect`'s accounting predicts (activations: this module's).
    pub predicted: [u64; 5],
    /// Forward and backward with every weight resident, no optimizer (median seconds).
    pub compute_seconds: Option<f64>,
    /// Bytes per step that must cross PCIe `(to device, from device)`, and their time.
    pub pcie: Option<((u64, u64), f64)>,
    /// The optimizer's floor: the faster of the CPU step's host-bandwidth bound and the mapped
    /// state's PCIe bound.
    pub optimizer_floor: Option<f64>,
    /// `step_seconds / max(compute, PCIe, optimizer floor)`.
    pub ratio: Option<f64>,
    /// `--engine all`: each engine's step time.
    pub engines: Vec<EngineRun>,
}

struct RunOut {
    engine: Engine,
    choice: Option<String>,
    steps: Vec<StepRecord>,
    peak: [u64; 5],
    held: [u64; 5],
    /// This machine's rates, measured before the training steps.
    bandwidth: Option<strata::Machine>,
}

/// Runs the training loop `cfg` describes: the all-resident compute floor first (with
/// `compare`), then the run (or one per engine with `--engine all`). `progress` gets a line per
/// phase and per step.
pub fn run(cfg: &TrainConfig, mut progress: impl FnMut(&str) -> Result<()>) -> Result<TrainReport> {
    cfg.check()?;
    let t0 = Instant::now();
    let inputs = Inputs::load(cfg)?;
    let cuda = !cfg.host && strata::cuda_device_count().is_ok_and(|n| n > 0);
    let dtype = cfg.dtype.unwrap_or(if cuda { DType::BF16 } else { DType::F32 });
    let (l, h) = (inputs.layers, inputs.hidden);
    progress(&format!(
        "model: {l} layers of {dtype} [{h}, {h}] = {}, rows {} in {} micro-batches, {:?} with \
         lr {}, activations {:?}; inputs ready in {:.1} s",
        format_size(l as u64 * inputs.layer_bytes(dtype)),
        inputs.rows,
        cfg.accumulate,
        cfg.optimizer,
        cfg.lr,
        cfg.activations,
        t0.elapsed().as_secs_f64()
    ))?;
    match dtype {
        DType::BF16 => run_typed::<bf16>(cfg, &inputs, &mut progress),
        DType::F32 => run_typed::<f32>(cfg, &inputs, &mut progress),
        d => Err(Error::InvalidArgument(format!("the trainer computes in bf16 or f32, not {d}"))),
    }
}

fn run_typed<T: Float>(
    cfg: &TrainConfig,
    inputs: &Inputs,
    progress: &mut impl FnMut(&str) -> Result<()>,
) -> Result<TrainReport> {
    // The plan, before anything is allocated: where the accounting puts each group under this
    // run's budgets (weights and gradients device first, optimizer state in host memory; the
    // store then streams what does not stay).
    let engine = if cfg.all_engines { Engine::Auto } else { cfg.engine };
    let planned = memory_plan(cfg, inputs, T::DTYPE, budgets(cfg, inputs, T::DTYPE, engine));
    progress(planned.to_string().trim_end())?;
    let acts = activation_bytes(cfg, inputs, T::DTYPE);
    progress(&format!(
        "activations: {} stored ({:?}), beside the plan",
        format_size(acts),
        cfg.activations
    ))?;
    let mut compute = None;
    if cfg.compare {
        match train_once::<T>(cfg, inputs, Engine::Cpu, Phase::Floor, progress) {
            Ok(out) => {
                let s = later_median(&out.steps);
                progress(&format!(
                    "all weights resident, no optimizer: {:.2} ms per step (compute floor)",
                    s * 1e3
                ))?;
                compute = Some(s);
            }
            Err(Error::OutOfMemory { .. } | Error::TooLarge { .. } | Error::Cuda { .. }) => {
                progress("all weights resident: does not fit the device, no compute floor")?;
            }
            Err(e) => return Err(e),
        }
    }
    let mut engines = Vec::new();
    let out = if cfg.all_engines {
        let mut last = None;
        for asked in [Engine::Cpu, Engine::GpuMapped, Engine::GpuResident, Engine::Auto] {
            progress(&format!("engine {asked}:"))?;
            match train_once::<T>(cfg, inputs, asked, Phase::Train, progress) {
                Ok(out) => {
                    engines.push(EngineRun {
                        asked,
                        engine: out.engine,
                        step_seconds: later_median(&out.steps),
                    });
                    last = Some(out);
                }
                Err(e) if crate::cli::is_broken_pipe(&e) => return Err(e),
                Err(e) => progress(&format!("engine {asked}: {}", e.chain()))?,
            }
        }
        last.ok_or_else(|| Error::InvalidArgument("no engine could run".into()))?
    } else {
        train_once::<T>(cfg, inputs, cfg.engine, Phase::Train, progress)?
    };
    let step_seconds = later_median(&out.steps);
    let alg = cfg.algorithm();
    let elems = (inputs.layers * inputs.hidden * inputs.hidden) as u64;
    let lb = inputs.layer_bytes(T::DTYPE);
    let model = inputs.layers as u64 * lb;
    let act_bytes = activation_bytes(cfg, inputs, T::DTYPE);
    // Weights that do not fit next to the kept activations cross twice (forward, backward);
    // offloaded activations cross out and back.
    let room = cfg.device_budget.saturating_sub(if cfg.activations == Activations::Keep {
        act_bytes
    } else {
        0
    });
    let must = (model + 2 * lb).saturating_sub(room).min(model);
    let moved_acts = if cfg.activations == Activations::Keep { 0 } else { act_bytes };
    let passes = cfg.accumulate as u64;
    let min_bytes = (passes * (2 * must + moved_acts), passes * moved_acts);
    let rates = out.bandwidth.as_ref().and_then(|m| Some((m.h2d?, m.d2h?, m.host_copy?)));
    let (pcie, optimizer_floor) = match rates {
        Some((h2d, d2h, host)) => {
            let grad = if cfg.accumulate > 1 { DType::F32 } else { T::DTYPE };
            let cpu = strata::optim::update_bytes(&alg, elems, T::DTYPE, grad) as f64 / host;
            let master = if T::DTYPE == DType::F32 { 0 } else { 4 * elems };
            let state = master + 4 * alg.moments() as u64 * elems;
            let mapped = (state as f64 / h2d).max(state as f64 / d2h);
            let p = (min_bytes.0 as f64 / h2d).max(min_bytes.1 as f64 / d2h);
            (Some((min_bytes, p)), Some(cpu.min(mapped)))
        }
        None => (None, None),
    };
    let floor =
        [compute, pcie.map(|p| p.1), optimizer_floor].into_iter().flatten().reduce(f64::max);
    let predicted = predict(cfg, inputs, T::DTYPE, act_bytes);
    if let Some(path) = &cfg.save {
        progress(&format!("final weights written to {}", path.display()))?;
    }
    Ok(TrainReport {
        dtype: T::DTYPE,
        engine: out.engine,
        choice: out.choice,
        losses: out.steps.iter().map(|s| s.loss).collect(),
        step_seconds,
        peak_device: out.peak,
        held: out.held,
        predicted,
        compute_seconds: compute,
        pcie,
        optimizer_floor,
        ratio: floor.map(|f| step_seconds / f),
        engines,
    })
}

fn later_median(steps: &[StepRecord]) -> f64 {
    median_after_first(&steps.iter().map(|s| s.seconds).collect::<Vec<_>>())
}

/// Bytes of the stored activations (one micro-batch's).
fn activation_bytes(cfg: &TrainConfig, inputs: &Inputs, dtype: DType) -> u64 {
    let per = (inputs.rows / cfg.accumulate * inputs.hidden * dtype.size_of()) as u64;
    let k = cfg.checkpoint_every;
    (1..inputs.layers).filter(|&i| stored(cfg.activations, k, i)).count() as u64 * per
}

/// The run's tier budgets `[device, pinned, mapped, disk]` for `engine`: the ones given, or room
/// for everything host-side (GpuMapped keeps the optimizer state in Mapped only; every other
/// engine may put it in Pinned).
fn budgets(cfg: &TrainConfig, inputs: &Inputs, dtype: DType, engine: Engine) -> [u64; 4] {
    let elems = (inputs.layers * inputs.hidden * inputs.hidden) as u64;
    let model = inputs.layers as u64 * inputs.layer_bytes(dtype);
    let grad_dtype = if cfg.accumulate > 1 { DType::F32 } else { dtype };
    let grads = elems * grad_dtype.size_of() as u64;
    let state = cfg.algorithm().state_bytes(dtype) * elems;
    let acts = activation_bytes(cfg, inputs, dtype);
    let slack = 1 << 20;
    let host_state = if engine == Engine::GpuMapped { 0 } else { state };
    let pinned = cfg.pinned_budget.unwrap_or(model + grads + acts + host_state + slack);
    let mapped = match (engine, cfg.mapped_budget) {
        (_, Some(m)) => m,
        (Engine::GpuMapped | Engine::Auto, None) => state + slack,
        _ => 0,
    };
    [cfg.device_budget, pinned, mapped, model + grads + acts + state + slack]
}

/// `strata::plan`'s plan of this model's parameters, gradients and optimizer state under
/// `budgets` (the same accounting `strata inspect --train` prints).
fn memory_plan(
    cfg: &TrainConfig,
    inputs: &Inputs,
    dtype: DType,
    budgets: [u64; 4],
) -> plan::MemoryPlan {
    let tensors: Vec<TensorEntry> = (0..inputs.layers)
        .map(|i| {
            TensorEntry::new(
                format!("layers.{i}.weight"),
                dtype,
                vec![inputs.hidden, inputs.hidden],
            )
        })
        .collect();
    plan::plan(
        &tensors,
        &PlanConfig {
            budgets,
            optimizer: plan::OptimizerStep::Optim(cfg.algorithm()),
            train: true,
            fp32_grads: cfg.accumulate > 1,
        },
    )
}

/// Bytes per group `strata inspect`'s accounting predicts for this model (parameters,
/// gradients, optimizer state); activations by this module's count.
fn predict(cfg: &TrainConfig, inputs: &Inputs, dtype: DType, acts: u64) -> [u64; 5] {
    let p = memory_plan(cfg, inputs, dtype, [u64::MAX / 8; 4]);
    let mut out = [0u64; 5];
    out[Group::Param.index()] = p.parameters().bytes;
    out[Group::Grad.index()] = p.gradients().bytes;
    out[Group::OptimizerState.index()] = p.optimizer_state().bytes;
    out[Group::Activation.index()] = acts;
    out
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Every weight resident, no optimizer: the compute floor.
    Floor,
    /// The real run.
    Train,
}

/// Scratch matrices of one run (outside the store).
struct Scratch<T: Float> {
    x: Vec<Matrix<T>>,
    y: Vec<Matrix<T>>,
    cur: Matrix<T>,
    next: Matrix<T>,
    g: Matrix<T>,
    g2: Matrix<T>,
    dw: Matrix<T>,
    ain: Matrix<T>,
    seg: Vec<Matrix<T>>,
    partials: Matrix<f32>,
}

fn to_t<T: Float>(v: &[f32]) -> Vec<T> {
    v.iter().map(|&x| T::from_f32(x)).collect()
}

fn t_bytes<T: Float>(v: &[T]) -> Vec<u8> {
    let mut b = vec![0u8; std::mem::size_of_val(v)];
    T::write_ne_bytes(v, &mut b);
    b
}

/// The progress bar of putting `n` layers into the store (hidden where stderr is not a
/// terminal).
fn putting_bar(n: usize, floor: bool) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(n as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{msg} [{bar:30}] {pos}/{len} layers ({elapsed}, eta {eta})",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(if floor { "all-resident copy" } else { "putting the model" });
    bar
}

/// The bar of the store's memory reservation (on stderr where it is a terminal).
fn reserving_bar(bytes: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(bytes);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "reserving tier memory [{bar:30}] {bytes}/{total_bytes} ({elapsed}, eta {eta})",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}

fn train_once<T: Float>(
    cfg: &TrainConfig,
    inputs: &Inputs,
    engine: Engine,
    phase: Phase,
    progress: &mut impl FnMut(&str) -> Result<()>,
) -> Result<RunOut> {
    let (layers, h) = (inputs.layers, inputs.hidden);
    let mb_rows = inputs.rows / cfg.accumulate;
    let lb = inputs.layer_bytes(T::DTYPE);
    let model = layers as u64 * lb;
    let alg = cfg.algorithm();
    let acts = activation_bytes(cfg, inputs, T::DTYPE);
    let grad_dtype = if cfg.accumulate > 1 { DType::F32 } else { T::DTYPE };
    let slack = 1 << 20;
    let floor = phase == Phase::Floor;
    // Prefetches ahead of the scopes, but never so many that the layer in use, its gradient and
    // an activation could not fit beside them.
    let act_mb = (mb_rows * h * T::DTYPE.size_of()) as u64;
    let grad_layer = (h * h * grad_dtype.size_of()) as u64;
    let prefetch = ((cfg.ahead as u64 + 1) * lb)
        .min(cfg.device_budget.saturating_sub(lb + grad_layer + act_mb))
        .max(lb);
    // Its step lines report the stall the device streams saw: the store keeps a timeline.
    let mut b = Store::builder().policy(cfg.policy).timeline(true);
    if cfg.host {
        b = b.host_backend();
    }
    let [budget, pinned, mapped, disk] = budgets(cfg, inputs, T::DTYPE, engine);
    let device = if floor { model + acts + 2 * lb + slack } else { budget };
    let mapped = if floor && cfg.mapped_budget.is_none() { 0 } else { mapped };
    b = b
        .capacity(Tier::Device, device)
        .capacity(Tier::Pinned, if floor { 0 } else { pinned })
        .capacity(Tier::Mapped, mapped)
        .capacity(Tier::Disk, if floor { 0 } else { disk })
        .prefetch_budget(prefetch)
        .staging(4, (lb as usize).clamp(4096, 16 << 20));
    // Reserving tens of GiB of pinned memory takes seconds (about half a second per GiB): in
    // pieces of a GiB (or of the largest tensor, an f32 layer or micro-batch), with a bar.
    let largest = (h * h.max(mb_rows) * 4) as u64;
    let budgets = [device, if floor { 0 } else { pinned }, mapped];
    let bar = reserving_bar(budgets.iter().sum());
    let b2 = bar.clone();
    b = b.reserve_in_pieces(largest.max(1 << 30)).on_reserve(move |t, done, _| {
        let before: u64 = budgets[..t.index().min(3)].iter().sum();
        b2.set_position(before + done);
    });
    let store = Arc::new(b.build()?);
    bar.finish_and_clear();
    let s = store.stream()?;
    let la = Linalg::new(&store, &s)?;

    // Weights: the compute copy in the store, f32 masters set from the exact inputs. Putting a
    // large model takes a while: a bar on stderr (where it is a terminal) counts the layers.
    let masters = !floor && T::DTYPE != DType::F32;
    let bar = putting_bar(layers * if masters { 2 } else { 1 }, floor);
    let mut ids = Vec::with_capacity(layers);
    for (i, w) in inputs.weights.iter().enumerate() {
        bar.inc(1);
        let bytes = t_bytes(&to_t::<T>(w));
        let name = format!("layers.{i}.weight");
        let id = if floor {
            store.put_in(Tier::Device, &name, Group::Param, T::DTYPE, &[h, h], &bytes)?
        } else {
            match store.put_in(Tier::Pinned, &name, Group::Param, T::DTYPE, &[h, h], &bytes) {
                Ok(id) => id,
                Err(
                    Error::OutOfMemory { .. } | Error::TooLarge { .. } | Error::TierDisabled { .. },
                ) => store.put_in(Tier::Disk, &name, Group::Param, T::DTYPE, &[h, h], &bytes)?,
                Err(e) => return Err(e),
            }
        };
        ids.push(id);
    }
    if floor {
        store.pin(&ids)?;
    }
    let mut opt = if floor {
        None
    } else {
        let mut oc = OptimizerConfig::new(alg, engine);
        oc.threads = cfg.threads;
        oc.grad_dtype = Some(grad_dtype);
        let resident = cfg.device_budget.min(model);
        oc.traffic = StepTraffic {
            h2d_bytes: 2 * (model - resident.min(model)) * cfg.accumulate as u64,
            d2h_bytes: 0,
            device_bytes: resident + if cfg.activations == Activations::Keep { acts } else { 0 },
        };
        let mut o = Optimizer::new(store.clone(), &s, &ids, oc)?;
        if masters {
            bar.set_message("fp32 master weights");
            for (i, w) in inputs.weights.iter().enumerate() {
                bar.inc(1);
                o.load_master(ids[i], w)?;
            }
        }
        Some(o)
    };
    bar.finish_and_clear();
    tracing::info!(layers, floor, seconds = bar.elapsed().as_secs_f64(), "model in the store");
    let engine_used = opt.as_ref().map_or(engine, Optimizer::engine);
    let choice = opt.as_ref().and_then(|o| o.choice()).map(|c| {
        // Auto prices engines with a GPU's costs (a kernel over state already on the device
        // is nearly free; PCIe is what costs). On the host backend there is no GPU: every
        // engine's update runs on host threads, so say what ran rather than a GPU's name alone.
        if store.backend() == strata::BackendKind::Host && c.engine != Engine::Cpu {
            format!(
                "{c}; on the host backend (no GPU) the {} engine's update runs on host threads \
                 over the host memory that stands for its tier",
                c.engine
            )
        } else {
            c.to_string()
        }
    });
    if let Some(c) = &choice {
        progress(c)?;
    }

    // Activations in the store.
    let k = cfg.checkpoint_every;
    let grad_lb = grad_layer;
    if !floor && cfg.activations == Activations::Keep && acts + 2 * lb + grad_lb > device {
        return Err(Error::InvalidArgument(format!(
            "--activations keep: the activations take {} of the device and the step needs {} more \
             (a layer in use, one on its way, its gradient), over the device budget of {}; use \
             --activations offload or recompute, or a larger --device-budget",
            format_size(acts),
            format_size(2 * lb + grad_lb),
            format_size(device)
        )));
    }
    // Offloaded or recomputed activations still pass through the device: the layer in hand
    // needs its weights, the next layer's on their way, the gradient, and the activation it
    // reads with the one being brought back for the next.
    let working = 2 * lb + grad_lb + 2 * act_mb;
    if !floor && cfg.activations != Activations::Keep && working > device {
        return Err(Error::InvalidArgument(format!(
            "--activations {}: the step needs {} of the device at once (a layer in use, one on \
             its way, its gradient, and two activations of {} rows), over the device budget of \
             {}; use a --device-budget of at least {}, or fewer --rows per micro-batch \
             (--accumulate)",
            if cfg.activations == Activations::Offload { "offload" } else { "recompute" },
            format_size(working),
            mb_rows,
            format_size(device),
            format_size(working)
        )));
    }
    let mut act: Vec<Option<TensorId>> = vec![None; layers];
    let zeros = vec![0u8; mb_rows * h * T::DTYPE.size_of()];
    for (i, slot) in act.iter_mut().enumerate() {
        if stored(cfg.activations, k, i) {
            let name = format!("activations.{i}");
            let tier = if floor || cfg.activations == Activations::Keep {
                Tier::Device
            } else {
                Tier::Pinned
            };
            let id = match store.put_in(tier, &name, Group::Activation, T::DTYPE, &[mb_rows, h], &zeros) {
                Ok(id) => id,
                Err(Error::OutOfMemory { .. } | Error::TooLarge { .. }) if tier == Tier::Device => {
                    return Err(Error::InvalidArgument(format!(
                        "--activations keep: {} activations of {} need {} of the device budget ({}), \
                         which also streams the weights; use --activations offload or recompute, \
                         or a larger --device-budget",
                        (1..layers).filter(|&j| stored(cfg.activations, k, j)).count(),
                        format_size(zeros.len() as u64),
                        format_size(acts),
                        format_size(device)
                    )))
                }
                Err(Error::OutOfMemory { .. } | Error::TooLarge { .. } | Error::TierDisabled { .. }) => {
                    store.put_in(Tier::Disk, &name, Group::Activation, T::DTYPE, &[mb_rows, h], &zeros)?
                }
                Err(e) => return Err(e),
            };
            *slot = Some(id);
        }
    }
    let kept: Vec<TensorId> = act.iter().flatten().copied().collect();
    if floor || cfg.activations == Activations::Keep {
        store.pin(&kept).map_err(|e| {
            Error::InvalidArgument(format!(
                "--activations keep: the activations do not stay on the device ({e})"
            ))
        })?;
    }

    // Scratch.
    let mut x = Vec::new();
    let mut y = Vec::new();
    for m in 0..cfg.accumulate {
        let r = m * mb_rows * h..(m + 1) * mb_rows * h;
        let mut xm = la.matrix::<T>(mb_rows, h)?;
        la.upload(&mut xm, &to_t::<T>(&inputs.x[r.clone()]))?;
        let mut ym = la.matrix::<T>(mb_rows, h)?;
        la.upload(&mut ym, &to_t::<T>(&inputs.y[r]))?;
        x.push(xm);
        y.push(ym);
    }
    let segs = if cfg.activations == Activations::Recompute { k } else { 0 };
    let mut sc = Scratch {
        x,
        y,
        cur: la.matrix(mb_rows, h)?,
        next: la.matrix(mb_rows, h)?,
        g: la.matrix(mb_rows, h)?,
        g2: la.matrix(mb_rows, h)?,
        dw: la.matrix(h, h)?,
        ain: la.matrix(mb_rows, h)?,
        seg: (0..segs).map(|_| la.matrix(mb_rows, h)).collect::<Result<Vec<_>>>()?,
        partials: la.matrix(1, LOSS_PARTIALS)?,
    };
    la.synchronize()?;

    let order = ops(layers, cfg.activations, k);
    let bandwidth = match (&opt, phase) {
        (Some(_), Phase::Train) => Some(strata::Machine::measured(&store, cfg.threads)?),
        _ => None,
    };
    let mut peak = [0u64; 5];
    let mut steps = Vec::with_capacity(cfg.steps);
    let ctx = Ctx {
        cfg,
        la: &la,
        store: &store,
        ids: &ids,
        act: &act,
        order: &order,
        layers,
        floor,
        wrap: engine_used != Engine::Cpu,
        layer_bytes: lb,
        act_bytes: act_mb,
        prefetch,
    };
    for step in 0..cfg.steps {
        let before = store.stats();
        let t = Instant::now();
        store.step();
        la.fill(&mut sc.partials, 0.0)?;
        for mb in 0..cfg.accumulate {
            ctx.micro_batch(&mut sc, mb, opt.as_mut(), &mut peak)?;
        }
        if let Some(o) = opt.as_mut() {
            o.finish()?;
        }
        la.synchronize()?;
        let seconds = t.elapsed().as_secs_f64();
        let after = store.stats();
        let loss = loss_value(&la.download(&sc.partials)?, 1.0 / inputs.rows as f32);
        let r = StepRecord {
            seconds,
            loss,
            h2d_bytes: after.moved_into(Tier::Device) - before.moved_into(Tier::Device),
            d2h_bytes: after.moved_out_of(Tier::Device) - before.moved_out_of(Tier::Device),
            stall_seconds: after.stall_seconds - before.stall_seconds,
        };
        if !floor {
            // What each group holds on the device now, beside the plan printed at the start.
            let dev = store.bytes_by_group(Tier::Device);
            let on_device: Vec<String> =
                [Group::Param, Group::Grad, Group::OptimizerState, Group::Activation]
                    .into_iter()
                    .map(|g| format!("{} {}", g.name(), format_size(dev[g.index()])))
                    .collect();
            progress(&format!(
                "step {:>3}: {:>9.2} ms  loss {:<12.6e} h2d {:>10}  d2h {:>10}  stall {:>8.2} ms  \
                 on device: {}",
                step + 1,
                seconds * 1e3,
                loss,
                format_size(r.h2d_bytes),
                format_size(r.d2h_bytes),
                r.stall_seconds * 1e3,
                on_device.join(", ")
            ))?;
        }
        steps.push(r);
    }
    store.check_err()?;
    let mut held = [0u64; 5];
    for id in store.ids() {
        let info = store.info(id)?;
        held[info.group.index()] += info.bytes;
    }
    if let (Some(path), Phase::Train, Some(o)) = (&cfg.save, phase, &opt) {
        let named: Vec<(TensorId, String)> = (0..layers)
            .map(|i| Ok((o.master(ids[i])?.unwrap_or(ids[i]), format!("layers.{i}.weight"))))
            .collect::<Result<_>>()?;
        store.save_safetensors_as(path, &named)?;
    }
    drop(opt);
    Ok(RunOut { engine: engine_used, choice, steps, peak, held, bandwidth })
}

struct Ctx<'a> {
    cfg: &'a TrainConfig,
    la: &'a Linalg,
    store: &'a Store,
    ids: &'a [TensorId],
    act: &'a [Option<TensorId>],
    order: &'a [Op],
    layers: usize,
    floor: bool,
    /// Scopes may prefetch the next step's first layers (not while the Cpu engine updates
    /// them on the host).
    wrap: bool,
    /// Bytes of a layer's weights, of a stored activation, and the store's prefetch budget.
    layer_bytes: u64,
    act_bytes: u64,
    prefetch: u64,
}

impl Ctx<'_> {
    /// Tensors op `k` reads from the store.
    fn uses(&self, k: usize) -> Vec<TensorId> {
        let (cfg, layers) = (self.cfg, self.layers);
        let ck = cfg.checkpoint_every;
        match self.order[k] {
            Op::Fwd(i) => vec![self.ids[i]],
            Op::Re(i) => {
                let mut v = vec![self.ids[i]];
                if segment(layers, ck, i).0 == i {
                    v.extend(self.act[i]);
                }
                v
            }
            Op::Bwd(i) => {
                let mut v = vec![self.ids[i]];
                let (start, top) = segment(layers, ck, i);
                let loads = match cfg.activations {
                    Activations::Recompute => i == start && start == top,
                    _ => true,
                };
                if loads {
                    v.extend(self.act[i]);
                }
                v
            }
        }
    }

    /// What the next `ahead` ops read, as far as the prefetch budget goes (a scope protects
    /// what it names until used, so naming more than fits would starve the work in hand).
    fn scope_next(&self, k: usize) -> Vec<TensorId> {
        let n = self.order.len();
        let mut next = Vec::new();
        let mut bytes = 0;
        for d in 1..=self.cfg.ahead {
            if k + d >= n && !self.wrap {
                break;
            }
            for id in self.uses((k + d) % n) {
                let b = if self.ids.contains(&id) { self.layer_bytes } else { self.act_bytes };
                if next.contains(&id) {
                    continue;
                }
                if !next.is_empty() && bytes + b > self.prefetch {
                    return next;
                }
                bytes += b;
                next.push(id);
            }
        }
        next
    }

    fn track(&self, peak: &mut [u64; 5]) {
        for (p, b) in peak.iter_mut().zip(self.store.bytes_by_group(Tier::Device)) {
            *p = (*p).max(b);
        }
    }

    fn micro_batch<T: Float>(
        &self,
        sc: &mut Scratch<T>,
        mb: usize,
        mut opt: Option<&mut Optimizer>,
        peak: &mut [u64; 5],
    ) -> Result<()> {
        let (cfg, la, store, layers) = (self.cfg, self.la, self.store, self.layers);
        let s = la.stream();
        let ck = cfg.checkpoint_every;
        let hints = !self.floor;
        let last_mb = mb + 1 == cfg.accumulate;
        let scale = 1.0 / (sc.x[mb].rows() * cfg.accumulate) as f32;
        for (k, &op) in self.order.iter().enumerate() {
            let scope =
                if hints { Some(store.layer(&self.uses(k), &self.scope_next(k))?) } else { None };
            let w = store.device_view(self.ids[op_layer(op)], s)?;
            match op {
                Op::Fwd(i) => {
                    let input = if i == 0 { &sc.x[mb] } else { &sc.cur };
                    la.linear(input, &w, &mut sc.next)?;
                    if i + 1 < layers {
                        la.relu(&mut sc.next)?;
                        if let Some(a) = self.act[i + 1] {
                            let mut v = store.device_view_for_overwrite(a, s)?;
                            la.copy_to_view(&sc.next, &mut v)?;
                            drop(v);
                            if cfg.activations != Activations::Keep && !self.floor {
                                store.release(&[a])?;
                            }
                        }
                    }
                    std::mem::swap(&mut sc.cur, &mut sc.next);
                    if i + 1 == layers {
                        la.loss_grad(&sc.cur, &sc.y[mb], scale, &mut sc.g, &mut sc.partials)?;
                    }
                }
                Op::Re(i) => {
                    // seg[m] holds a_{start+m}; layer 0's input is x itself.
                    let (start, _) = segment(layers, ck, i);
                    if i == start {
                        self.load_segment(sc, i)?;
                    }
                    let (lo, hi) = sc.seg.split_at_mut(i - start + 1);
                    let input = if i == 0 { &sc.x[mb] } else { &lo[i - start] };
                    la.linear(input, &w, &mut hi[0])?;
                    la.relu(&mut hi[0])?;
                }
                Op::Bwd(i) => {
                    let input: &Matrix<T> = match cfg.activations {
                        _ if i == 0 => &sc.x[mb],
                        Activations::Recompute => {
                            let (start, top) = segment(layers, ck, i);
                            if i == start && start == top {
                                self.load_segment(sc, i)?;
                            }
                            &sc.seg[i - start]
                        }
                        Activations::Keep | Activations::Offload => {
                            self.load(i, &mut sc.ain)?;
                            &sc.ain
                        }
                    };
                    la.linear_grad_weight(&sc.g, input, &mut sc.dw)?;
                    if i > 0 {
                        la.linear_grad_input(&sc.g, &w, &mut sc.g2)?;
                        la.relu_mask(&mut sc.g2, input)?;
                        std::mem::swap(&mut sc.g, &mut sc.g2);
                    }
                    if let Some(o) = opt.as_deref_mut() {
                        let gid = o.grad(w.id())?;
                        let mut gv = if mb == 0 {
                            store.device_view_for_overwrite(gid, s)?
                        } else {
                            store.device_view(gid, s)?
                        };
                        la.accumulate(&mut gv, &sc.dw, mb == 0)?;
                        drop(gv);
                        if last_mb {
                            // The GPU engines' kernel is issued while the weight's view lives.
                            o.update(w.id())?;
                        }
                    }
                }
            }
            drop(w);
            drop(scope);
            self.track(peak);
        }
        Ok(())
    }

    /// Copies the stored input of layer `i` (`i ≥ 1`) into `dst`.
    fn load<T: Float>(&self, i: usize, dst: &mut Matrix<T>) -> Result<()> {
        let a = self.act[i]
            .ok_or_else(|| Error::InvalidArgument(format!("activation {i} is not stored")))?;
        let v = self.store.device_view(a, self.la.stream())?;
        self.la.copy_from_view(&v, dst)
    }

    /// Enters the recompute segment starting at layer `i`: its input into `seg[0]` (layer 0
    /// reads `x` directly).
    fn load_segment<T: Float>(&self, sc: &mut Scratch<T>, i: usize) -> Result<()> {
        if i == 0 {
            return Ok(());
        }
        self.load(i, &mut sc.seg[0])
    }
}

fn op_layer(op: Op) -> usize {
    match op {
        Op::Fwd(i) | Op::Re(i) | Op::Bwd(i) => i,
    }
}

impl std::fmt::Display for TrainReport {
    /// The closing lines: memory per group (predicted, held, peak on the device), floors, the
    /// ratio, the engines.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{:<12} {:>14} {:>14} {:>16}", "group", "predicted", "held", "peak on device")?;
        for g in [Group::Param, Group::Grad, Group::OptimizerState, Group::Activation] {
            let i = g.index();
            writeln!(
                f,
                "{:<12} {:>14} {:>14} {:>16}",
                g.name(),
                format_size(self.predicted[i]),
                format_size(self.held[i]),
                format_size(self.peak_device[i])
            )?;
        }
        if let Some(c) = &self.choice {
            writeln!(f, "{c}")?;
        }
        for e in &self.engines {
            writeln!(
                f,
                "engine {:<13} ran {:<13} {:>9.2} ms per step",
                e.asked.name(),
                e.engine.name(),
                e.step_seconds * 1e3
            )?;
        }
        if let Some(c) = self.compute_seconds {
            writeln!(f, "compute floor (all resident, no optimizer): {:.2} ms", c * 1e3)?;
        }
        if let Some(((i, o), p)) = self.pcie {
            writeln!(
                f,
                "PCIe floor: {} in, {} out per step = {:.2} ms",
                format_size(i),
                format_size(o),
                p * 1e3
            )?;
        }
        if let Some(o) = self.optimizer_floor {
            writeln!(f, "optimizer floor: {:.2} ms", o * 1e3)?;
        }
        let losses: Vec<String> = self.losses.iter().map(|l| format!("{l:.6e}")).collect();
        writeln!(f, "loss per step: {}", losses.join(" "))?;
        match self.ratio {
            Some(r) => write!(
                f,
                "step time {:.2} ms ({} engine, {}) = {r:.3}x max(compute, PCIe, optimizer)",
                self.step_seconds * 1e3,
                self.engine,
                self.dtype
            ),
            None => {
                write!(f, "step time {:.2} ms ({} engine)", self.step_seconds * 1e3, self.engine)
            }
        }
    }
}

/// What [`dispatch`] ran.
#[derive(Clone, Debug)]
pub enum Outcome {
    /// `--mode forward`, or `--mode train --optimizer device-sgd`: [`crate::cli::mlp`]'s loop.
    Mlp(crate::cli::mlp::MlpReport),
    /// `--mode train`: this module's loop.
    Train(TrainReport),
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Mlp(r) => r.fmt(f),
            Outcome::Train(r) => r.fmt(f),
        }
    }
}

/// The out-of-core example's entry point (`strata train-demo`, `examples/out_of_core.rs`):
/// `--mode train` runs this module's training loop; `--mode forward` (the default) and `--mode
/// train --optimizer device-sgd` run [`crate::cli::mlp`]'s benchmark loop (bf16, SGD applied on
/// the device to the weights themselves, ones as the output gradient). The flags:
/// [`TrainDemoArgs`].
pub fn dispatch(args: &TrainDemoArgs, progress: impl FnMut(&str) -> Result<()>) -> Result<Outcome> {
    if args.runs_trainer() {
        return run(&TrainConfig::from_args(args)?, progress).map(Outcome::Train);
    }
    let cfg = crate::cli::mlp::MlpConfig::from_args(args)?;
    crate::cli::mlp::run(&cfg, progress).map(Outcome::Mlp)
}

/// Runs `strata train-demo`.
pub fn run_demo(args: &TrainDemoArgs) -> anyhow::Result<()> {
    out!("strata train-demo")?;
    let outcome = crate::cli::train::dispatch(args, crate::cli::println)?;
    out!("{outcome}")?;
    if let crate::cli::train::Outcome::Mlp(r) = &outcome {
        if r.matches_resident == Some(false) {
            anyhow::bail!("the out-of-core run differs from the all-resident run");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
