//! The out-of-core MLP behind `strata train-demo` and `examples/out_of_core.rs`: `L` square bf16
//! linear layers whose weights live in a store with a device budget smaller than the model,
//! run forward (inference) or as training steps (forward, backward with input and weight
//! gradients, SGD on the device), with a layer scope around each layer, and measured against two
//! floors from the same run: compute (the same GEMMs with every weight resident) and PCIe (the
//! bytes that must cross / raw pinned bandwidth). The tests (`tests.rs`) check it against the
//! all-resident run, `simulated_tests.rs` its pipeline in simulated time.

use std::time::Instant;

use half::bf16;

use crate::cli::args::{check_output, ModeArg, OptimizerArg, SimulateArg, TrainDemoArgs};
use strata::linalg::{Linalg, Matrix};
use strata::probe::{median, median_after_first, raw_pinned_copy, Direction};
use strata::{format_size, DType, Error, PolicyKind, Result, Simulation, Store, TensorId, Tier};

/// Inference or training.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// A forward pass per step.
    Forward,
    /// Forward, backward (input and weight gradients) and an SGD update per step.
    Train,
}

/// What to run.
#[derive(Clone, Debug)]
pub struct MlpConfig {
    /// Layers.
    pub layers: usize,
    /// Width of every layer (weights are `hidden × hidden`).
    pub hidden: usize,
    /// Batch rows.
    pub rows: usize,
    /// The Device tier's budget for the weights.
    pub device_budget: u64,
    /// Forward or train.
    pub mode: Mode,
    /// Layer scopes around each layer (`false`: on-demand migration only).
    pub hints: bool,
    /// How many layers ahead a scope prefetches.
    pub ahead: usize,
    /// The store's prefetch budget (default: `ahead` layers, at least one. One copy queued behind
    /// the one in progress keeps the copy engine busy, since the host issues the whole step
    /// ahead of the GPU; the rest of the device budget keeps layers resident).
    pub prefetch_budget: Option<u64>,
    /// Layers pinned on the device for the whole run (`--keep K`). Default: in training with
    /// hints, half the layers the device budget holds; else none. Every layer is written each
    /// training step, so a layer that stays is never written back, while the other half of the
    /// budget still keeps the layers at each turn of the step resident (see [`MlpConfig::kept`]).
    pub keep: Option<usize>,
    /// The store's policy.
    pub policy: PolicyKind,
    /// Steps to run (the first is a warm-up for the figures).
    pub steps: usize,
    /// SGD learning rate.
    pub lr: f32,
    /// Seed of the weights and inputs.
    pub seed: u64,
    /// Where the weights live off the device: `Pinned` or `Disk`.
    pub weights_in: Tier,
    /// Force the host backend.
    pub host: bool,
    /// Also run every weight resident (the compute floor and the correctness reference).
    pub compare: bool,
    /// Simulate a preset machine on the host backend (`--simulate h100`, `h200`, or `h100-half`
    /// for [`LinkSharing::Half`](strata::LinkSharing::Half)): the loop runs a model
    /// with the same layer count and budget in layers, shrunk to `hidden ≤ 64` and `rows ≤ 8`,
    /// in [simulated time](strata::StoreBuilder::simulate) scaled so that each layer's copies
    /// and GEMMs take the time they would at the configured size.
    pub simulate: Option<SimulateArg>,
    /// Write a Chrome trace of the out-of-core run's copies and waits here (`--trace FILE`).
    pub trace: Option<std::path::PathBuf>,
}

impl Default for MlpConfig {
    fn default() -> Self {
        MlpConfig {
            layers: 32,
            hidden: 8192,
            rows: 2048,
            device_budget: 1 << 30,
            mode: Mode::Forward,
            hints: true,
            ahead: 1,
            prefetch_budget: None,
            keep: None,
            policy: PolicyKind::Schedule,
            steps: 10,
            lr: 1e-3,
            seed: 0,
            weights_in: Tier::Pinned,
            host: false,
            compare: true,
            simulate: None,
            trace: None,
        }
    }
}

impl MlpConfig {
    /// Parses command-line flags ([`TrainDemoArgs`], without a program name) over the defaults
    /// (L=32, H=8192, rows 2048, budget 1 GiB, forward, hints on, 1 ahead, schedule policy, 10
    /// steps). Sizes take units.
    #[cfg(test)] // the binary parses its whole command line (`Cli`)
    pub fn parse<I, S>(args: I) -> Result<MlpConfig>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        MlpConfig::from_args(&TrainDemoArgs::try_parse(args)?)
    }

    /// The configuration parsed flags describe; an error names a flag of the trainer, which
    /// this loop does not take.
    pub fn from_args(a: &TrainDemoArgs) -> Result<MlpConfig> {
        a.refuse_trainer_flags()?;
        if let Some(o @ (OptimizerArg::Sgd | OptimizerArg::Adamw)) = a.optimizer {
            let name = if o == OptimizerArg::Sgd { "sgd" } else { "adamw" };
            return Err(Error::InvalidArgument(format!(
                "--optimizer {name} runs the trainer (--mode train); the bf16 benchmark loop \
                 applies device-sgd"
            )));
        }
        let d = MlpConfig::default();
        let c = MlpConfig {
            layers: a.layers.unwrap_or(d.layers),
            hidden: a.hidden.unwrap_or(d.hidden),
            rows: a.rows.unwrap_or(d.rows),
            device_budget: a.device_budget.unwrap_or(d.device_budget),
            mode: match a.mode {
                Some(ModeArg::Train) => Mode::Train,
                Some(ModeArg::Forward) | None => Mode::Forward,
            },
            hints: a.hints().unwrap_or(d.hints),
            ahead: a.ahead.unwrap_or(d.ahead),
            prefetch_budget: a.prefetch_budget,
            keep: a.keep,
            policy: a.policy.unwrap_or(d.policy),
            steps: a.steps.unwrap_or(d.steps),
            lr: a.lr.map_or(d.lr, |x| x as f32),
            seed: a.seed.unwrap_or(d.seed),
            weights_in: a.weights_in.unwrap_or(d.weights_in),
            host: a.host,
            compare: a.compare(),
            simulate: a.simulate,
            trace: a.trace.clone(),
        };
        c.check()?;
        Ok(c)
    }

    /// Refuses what cannot run: zero sizes or steps, weights kept anywhere but Pinned or Disk,
    /// a non-positive learning rate, a trace file with no directory to go in.
    fn check(&self) -> Result<()> {
        if self.layers == 0 || self.hidden == 0 || self.rows == 0 || self.steps == 0 {
            return Err(Error::InvalidArgument(
                "layers, hidden, rows and steps must be > 0".into(),
            ));
        }
        if !matches!(self.weights_in, Tier::Pinned | Tier::Disk) {
            return Err(Error::InvalidArgument("--weights-in is pinned or disk".into()));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(Error::InvalidArgument(format!(
                "learning rate {} must be a positive finite number",
                self.lr
            )));
        }
        if let Some(t) = &self.trace {
            check_output(t)?;
        }
        Ok(())
    }

    fn layer_bytes(&self) -> u64 {
        (self.hidden * self.hidden * 2) as u64
    }

    /// The layers pinned on the device for the whole run: `keep` of them (by default half of
    /// what the budget holds, in training with hints), just before the last layers the rest of
    /// the budget holds, so that at the turn from forward to backward the whole budget holds the
    /// layers used next. At least `ahead + 1` of the budget's layers stay free for the stream;
    /// none are pinned when the model fits.
    pub fn kept(&self) -> std::ops::Range<usize> {
        let fits = (self.device_budget / self.layer_bytes().max(1)) as usize;
        let default = match (self.mode, self.hints) {
            (Mode::Train, true) => fits / 2,
            _ => 0,
        };
        // The layer in use and those prefetched ahead need room beside the pinned ones.
        let k = self.keep.unwrap_or(default).min(fits.saturating_sub(self.ahead.max(1) + 1));
        if fits >= self.layers || k == 0 {
            return 0..0;
        }
        let start = self.layers - fits;
        start..start + k
    }

    fn model_bytes(&self) -> u64 {
        self.layers as u64 * self.layer_bytes()
    }

    /// The model that runs and the scales of a simulation: with `--simulate`, the same layers,
    /// budgets in layers, shrunk to `hidden ≤ 64` and `rows ≤ 8`, on a simulated store whose
    /// bytes and flops stand for the configured model's; else `self` unchanged.
    fn data_model(&self) -> Result<(MlpConfig, Option<Simulation>)> {
        let Some(sim) = self.simulate else { return Ok((self.clone(), None)) };
        let sim = sim.simulation()?;
        let mut d = self.clone();
        d.hidden = self.hidden.min(64);
        d.rows = self.rows.min(8);
        let wide = self.hidden as f64 / d.hidden as f64;
        let tall = self.rows as f64 / d.rows as f64;
        let bytes = wide * wide;
        let flops = bytes * tall;
        d.device_budget = (self.device_budget as f64 / bytes).round() as u64;
        d.prefetch_budget = self.prefetch_budget.map(|b| (b as f64 / bytes).round() as u64);
        d.simulate = None;
        d.host = true;
        let mut sim = sim.scaled(bytes, flops);
        sim.matrix_bytes_scale = wide * tall; // activations are rows × hidden
        Ok((d, Some(sim)))
    }

    /// Layer order of one step: forward 0..L, then backward L..0 when training.
    fn order(&self) -> Vec<usize> {
        let f = 0..self.layers;
        match self.mode {
            Mode::Forward => f.collect(),
            Mode::Train => f.clone().chain(f.rev()).collect(),
        }
    }
}

/// One step's figures.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// Wall-clock seconds, issue to completion (simulated seconds with `--simulate`).
    pub seconds: f64,
    /// Seconds the host took to issue the step's work, before it waited for the device: near
    /// `seconds`, the host (not the GPU or the link) is what limits the step.
    pub issue_seconds: f64,
    /// Bytes copied into the Device tier.
    pub h2d_bytes: u64,
    /// Bytes copied out of the Device tier (write-backs).
    pub d2h_bytes: u64,
    /// Seconds consumers waited for copies.
    pub stall_seconds: f64,
    /// Views that found their layer resident or in flight.
    pub prefetch_hits: u64,
    /// Views that had to start the copy.
    pub prefetch_misses: u64,
}

/// The outcome of [`run`].
#[derive(Clone, Debug)]
pub struct MlpReport {
    /// Every step of the out-of-core run.
    #[cfg_attr(not(test), allow(dead_code))] // the tests read each step
    pub steps: Vec<StepReport>,
    /// Median step seconds with every weight resident (steps after the first).
    pub compute_seconds: Option<f64>,
    /// Raw pinned host-to-device bandwidth (bytes/s), CUDA only.
    pub h2d_bandwidth: Option<f64>,
    /// The least bytes that must cross PCIe per step, each direction: `(to device, from
    /// device)`: the weights that do not fit the Device tier, once a pass (Belady's optimum).
    pub min_bytes: (u64, u64),
    /// `max(min_bytes) / h2d_bandwidth`.
    pub pcie_seconds: Option<f64>,
    /// Median step seconds of the out-of-core run (steps after the first).
    pub step_seconds: f64,
    /// `step_seconds / max(compute, pcie)`.
    pub ratio: Option<f64>,
    /// Bytes the run moved per step, each direction (medians of the steps after the first):
    /// `min_bytes` and up to a layer in flight a pass.
    pub moved_bytes: (u64, u64),
    /// Whether the final weights (train) or outputs (forward) equal the all-resident run's,
    /// bit for bit; `None` when the resident run did not run.
    pub matches_resident: Option<bool>,
    /// Largest absolute difference from the resident run.
    pub max_abs_diff: f32,
    /// Whether the times are simulated ([`MlpConfig::simulate`]).
    pub simulated: bool,
    /// The machine the figures are for: the simulated preset ("the H100 preset"), or "this
    /// machine".
    pub machine: &'static str,
}

/// Deterministic values uniform in `[-a, a]` (xorshift64 from `seed` and `stream`).
pub(crate) fn uniform(seed: u64, stream: u64, n: usize, a: f32) -> Vec<f32> {
    let mut x =
        (seed ^ stream.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_add(0x2545_F491_4F6C_DD1D) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            (2.0 * u - 1.0) * a
        })
        .collect()
}

/// [`uniform`] values as bf16 bytes.
fn values(seed: u64, stream: u64, n: usize, a: f32) -> Vec<u8> {
    uniform(seed, stream, n, a)
        .into_iter()
        .flat_map(|v| bf16::from_f32(v).to_bits().to_ne_bytes())
        .collect()
}

/// Every layer's weights, generated on all cores.
fn weights(cfg: &MlpConfig) -> Vec<Vec<u8>> {
    let a = (3.0 / cfg.hidden as f32).sqrt();
    let n = cfg.hidden * cfg.hidden;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(cfg.layers);
    let mut out: Vec<Vec<u8>> = vec![Vec::new(); cfg.layers];
    std::thread::scope(|s| {
        for (t, chunk) in out.chunks_mut(cfg.layers.div_ceil(threads)).enumerate() {
            let first = t * cfg.layers.div_ceil(threads);
            s.spawn(move || {
                for (k, w) in chunk.iter_mut().enumerate() {
                    *w = values(cfg.seed, 1 + (first + k) as u64, n, a);
                }
            });
        }
    });
    out
}

struct Net {
    store: Store,
    la: Linalg,
    ids: Vec<TensorId>,
    x: Matrix,
    acts: Vec<Matrix>,
    g: [Matrix; 2],
    dw: Option<Matrix>,
}

fn build(
    cfg: &MlpConfig,
    sim: Option<Simulation>,
    resident: bool,
    w: &[Vec<u8>],
    x: &[bf16],
) -> Result<Net> {
    let model = cfg.model_bytes();
    let slack = 1 << 20;
    // Its step lines report the stall and --trace writes the timeline: the store keeps one.
    let mut b = Store::builder().capacity(Tier::Mapped, 0).policy(cfg.policy).timeline(true);
    b = if resident {
        b.capacity(Tier::Device, model + slack).capacity(Tier::Pinned, 0).capacity(Tier::Disk, 0)
    } else {
        let prefetch = cfg.prefetch_budget.unwrap_or(cfg.ahead.max(1) as u64 * cfg.layer_bytes());
        let b = b.capacity(Tier::Device, cfg.device_budget).prefetch_budget(prefetch);
        match cfg.weights_in {
            Tier::Disk => b.capacity(Tier::Pinned, 0).capacity(Tier::Disk, model + slack),
            _ => b.capacity(Tier::Pinned, model + slack).capacity(Tier::Disk, 0),
        }
    };
    if let Some(sim) = sim {
        b = b.simulate(sim);
    } else if cfg.host {
        b = b.host_backend();
    }
    // Staging pieces no larger than a layer keep small models' pipelines honest.
    let piece = (cfg.layer_bytes() as usize).clamp(4096, 16 << 20);
    let store = b.staging(4, piece).build()?;
    let s = store.stream()?;
    let la = Linalg::new(&store, &s)?;
    let h = cfg.hidden;
    let ids = w
        .iter()
        .enumerate()
        .map(|(l, bytes)| store.put(&format!("layer{l}.weight"), DType::BF16, &[h, h], bytes))
        .collect::<Result<Vec<_>>>()?;
    if !resident {
        for &id in &ids {
            store.move_to(id, cfg.weights_in)?;
        }
        store.pin(&ids[cfg.kept()])?;
    }
    let mut xm = la.matrix(cfg.rows, h)?;
    la.upload(&mut xm, x)?;
    let n_acts = match cfg.mode {
        Mode::Forward => 2,
        Mode::Train => cfg.layers,
    };
    let acts = (0..n_acts).map(|_| la.matrix(cfg.rows, h)).collect::<Result<Vec<_>>>()?;
    let g = [la.matrix(cfg.rows, h)?, la.matrix(cfg.rows, h)?];
    let dw = if cfg.mode == Mode::Train { Some(la.matrix(h, h)?) } else { None };
    la.synchronize()?;
    Ok(Net { store, la, ids, x: xm, acts, g, dw })
}

/// Seconds on a store's clock: simulated on a simulated store, the host's otherwise.
struct StepClock(Option<f64>, Instant);

impl StepClock {
    fn start(store: &Store) -> StepClock {
        StepClock(store.simulated_seconds(), Instant::now())
    }
    fn elapsed(&self, store: &Store) -> f64 {
        match (self.0, store.simulated_seconds()) {
            (Some(t0), Some(t)) => t - t0,
            _ => self.1.elapsed().as_secs_f64(),
        }
    }
}

/// One step; returns when the device has finished it, with the seconds the host took to issue
/// it (before it waited for the device).
fn step(cfg: &MlpConfig, net: &mut Net, hints: bool) -> Result<f64> {
    let clock = StepClock::start(&net.store);
    let order = cfg.order();
    let Net { store, la, ids, x, acts, g, dw } = net;
    let s = la.stream().clone();
    store.step();
    for (k, &l) in order.iter().enumerate() {
        let next: Vec<TensorId> =
            (1..=cfg.ahead).map(|d| ids[order[(k + d) % order.len()]]).collect();
        let _scope = if hints { Some(store.layer(&ids[l..l + 1], &next)?) } else { None };
        let mut v = store.device_view(ids[l], &s)?;
        let backward = cfg.mode == Mode::Train && k >= cfg.layers;
        if !backward {
            // Forward: training keeps every layer's input for the backward pass.
            let (input, out) = match cfg.mode {
                Mode::Forward => (if l == 0 { None } else { Some((l + 1) % 2) }, l % 2),
                Mode::Train => (if l == 0 { None } else { Some(l - 1) }, l),
            };
            match input {
                None => la.linear(x, &v, &mut acts[out])?,
                Some(i) => {
                    let (xin, y) = pair(acts, i, out);
                    la.linear(xin, &v, y)?;
                }
            }
        } else {
            if l == cfg.layers - 1 {
                la.fill(&mut g[0], 1.0)?; // d(loss)/d(output): ones, as the peers do
            }
            let input = if l == 0 { &*x } else { &acts[l - 1] };
            let dw = dw.as_mut().ok_or_else(|| Error::InvalidArgument("no dW buffer".into()))?;
            let (g0, g1) = g.split_at_mut(1);
            la.linear_grad_weight(&g0[0], input, dw)?;
            la.linear_grad_input(&g0[0], &v, &mut g1[0])?;
            la.sgd(&mut v, dw, cfg.lr)?;
            g.swap(0, 1);
        }
    }
    let issued = clock.elapsed(store);
    la.synchronize()?;
    Ok(issued)
}

/// `(&v[i], &mut v[o])` for `i != o`.
fn pair(v: &mut [Matrix], i: usize, o: usize) -> (&Matrix, &mut Matrix) {
    if i < o {
        let (lo, hi) = v.split_at_mut(o);
        (&lo[i], &mut hi[0])
    } else {
        let (lo, hi) = v.split_at_mut(i);
        (&hi[0], &mut lo[o])
    }
}

/// What the run produced, to compare with the resident run.
fn result(cfg: &MlpConfig, net: &Net) -> Result<Vec<bf16>> {
    match cfg.mode {
        Mode::Forward => net.la.download(&net.acts[(cfg.layers - 1) % 2]),
        Mode::Train => {
            let mut out = Vec::new();
            for &id in &net.ids {
                let b = net.store.read(id)?;
                out.extend(
                    b.chunks_exact(2).map(|c| bf16::from_bits(u16::from_ne_bytes([c[0], c[1]]))),
                );
            }
            Ok(out)
        }
    }
}

/// Runs the resident reference (if asked and it fits), then the out-of-core loop. `progress`
/// gets a line per phase and per step.
pub fn run(cfg: &MlpConfig, mut progress: impl FnMut(&str) -> Result<()>) -> Result<MlpReport> {
    cfg.check()?;
    let t0 = Instant::now();
    // With --simulate a small model runs, timed (and its bytes counted) as `cfg`'s; every line
    // says so.
    let (data, sim) = cfg.data_model()?;
    let mut progress = |line: &str| match sim {
        Some(_) => progress(&simulated(line)),
        None => progress(line),
    };
    let scale = sim.map_or(1.0, |s| s.bytes_scale);
    let big = |b: u64| (b as f64 * scale).round() as u64;
    let (l, h) = (data.layers as u128, data.hidden as u128);
    super::check_host_memory(
        "generating the model's weights",
        l * h * h * 2 + h * h * 4,
        "use a smaller model (--layers, --hidden, --rows)",
    )?;
    let w = weights(&data);
    let x: Vec<bf16> = values(data.seed, 0, data.rows * data.hidden, 1.0)
        .chunks_exact(2)
        .map(|c| bf16::from_bits(u16::from_ne_bytes([c[0], c[1]])))
        .collect();
    progress(&format!(
        "model: {} layers of bf16 [{h}, {h}] = {}, rows {}, {:?}; generated in {:.1} s",
        cfg.layers,
        format_size(cfg.model_bytes()),
        cfg.rows,
        cfg.mode,
        t0.elapsed().as_secs_f64(),
        h = cfg.hidden
    ))?;
    if sim.is_some() {
        progress(&format!(
            "runs [{h}, {h}] layers with {} rows, timed as the model above on {}, simulated \
             (strata::Simulation): times are not measurements",
            data.rows,
            cfg.simulate.map_or_else(String::new, |s| s.machine().name),
            h = data.hidden
        ))?;
    }

    let mut compute = None;
    let mut reference = None;
    if cfg.compare {
        match build(&data, sim, true, &w, &x) {
            Ok(mut net) => {
                let mut times = Vec::new();
                for i in 0..cfg.steps {
                    let t = StepClock::start(&net.store);
                    step(&data, &mut net, false)?;
                    if i > 0 || cfg.steps == 1 {
                        times.push(t.elapsed(&net.store));
                    }
                }
                compute = Some(median(&times));
                reference = Some(result(&data, &net)?);
                progress(&format!(
                    "all weights resident ({}): {:.2} ms per step (compute floor)",
                    net.store.backend_description(),
                    median(&times) * 1e3
                ))?;
            }
            Err(Error::OutOfMemory { .. }) | Err(Error::Cuda { .. }) => {
                progress("all weights resident: does not fit the device, no compute floor")?;
            }
            Err(e) => return Err(e),
        }
    }

    let mut net = build(&data, sim, false, &w, &x)?;
    drop(w);
    let backend = net.store.backend_description();
    let h2d_bandwidth = match (net.store.cuda_context(), sim) {
        (Some(ctx), _) => {
            let t = median(&raw_pinned_copy(
                ctx,
                cfg.layer_bytes() as usize,
                Direction::HostToDevice,
                10,
            )?);
            Some(cfg.layer_bytes() as f64 / t)
        }
        (None, Some(s)) => Some(s.h2d_bytes_per_s),
        (None, None) => None,
    };
    let kept = data.kept();
    progress(&format!(
        "out of core ({backend}): device budget {}, weights in {}, hints {}, policy {}, {}",
        format_size(cfg.device_budget),
        cfg.weights_in,
        if cfg.hints { format!("on ({} ahead)", cfg.ahead) } else { "off".into() },
        cfg.policy,
        if kept.is_empty() {
            "no layers pinned".to_string()
        } else {
            format!("layers {}..{} pinned", kept.start, kept.end)
        }
    ))?;
    let mut steps = Vec::new();
    for i in 0..cfg.steps {
        let before = net.store.stats();
        let t = StepClock::start(&net.store);
        let issue_seconds = step(&data, &mut net, data.hints)?;
        let seconds = t.elapsed(&net.store);
        let after = net.store.stats();
        let r = StepReport {
            seconds,
            issue_seconds,
            h2d_bytes: big(after.moved_into(Tier::Device) - before.moved_into(Tier::Device)),
            d2h_bytes: big(after.moved_out_of(Tier::Device) - before.moved_out_of(Tier::Device)),
            stall_seconds: after.stall_seconds - before.stall_seconds,
            prefetch_hits: after.prefetch_hits - before.prefetch_hits,
            prefetch_misses: after.prefetch_misses - before.prefetch_misses,
        };
        progress(&format!(
            "step {:>3}: {:>9.2} ms  h2d {:>10}  d2h {:>10}  stall {:>8.2} ms  prefetch hits {:>4} misses {:>4}  issued in {:.2} ms",
            i + 1,
            seconds * 1e3,
            format_size(r.h2d_bytes),
            format_size(r.d2h_bytes),
            r.stall_seconds * 1e3,
            r.prefetch_hits,
            r.prefetch_misses,
            r.issue_seconds * 1e3
        ))?;
        steps.push(r);
    }
    net.store.check_err()?;
    if let Some(path) = &cfg.trace {
        net.store.trace(path)?;
        progress(&format!("trace of the copies and waits: {}", path.display()))?;
    }

    let (matches_resident, max_abs_diff) = match &reference {
        Some(want) => {
            let got = result(&data, &net)?;
            let diff = got
                .iter()
                .zip(want)
                .map(|(a, b)| (a.to_f32() - b.to_f32()).abs())
                .fold(0f32, f32::max);
            // Bits, not values: NaNs (a diverging model) compare equal when they are the same.
            let same = got.len() == want.len()
                && got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
            (Some(same), diff)
        }
        None => (None, 0.0),
    };
    // Bytes that must cross per step, at best (Belady's optimum for the step's order of
    // layers): the device keeps `device_budget` bytes of weights from one pass to the next and
    // every other byte crosses once a pass. Forward: M - B in. Training, forward then backward:
    // 2(M - B) in (the turn keeps the budget's layers) and the M - B updated bytes that cannot
    // stay, out. (This floor used to add two layers in flight, which the pipeline does not
    // need: a run printed a step at 0.967x "its floor".) The pipeline keeps room for one layer
    // in flight, so it moves up to a layer more than this a pass.
    let must = cfg.model_bytes().saturating_sub(cfg.device_budget);
    let min_bytes = match cfg.mode {
        Mode::Forward => (must, 0),
        Mode::Train => (2 * must, must),
    };
    let pcie_seconds = h2d_bandwidth.map(|bw| min_bytes.0.max(min_bytes.1) as f64 / bw);
    let step_seconds = median_after_first(&steps.iter().map(|s| s.seconds).collect::<Vec<_>>());
    let moved = |f: fn(&StepReport) -> u64| {
        median_after_first(&steps.iter().map(|s| f(s) as f64).collect::<Vec<_>>()) as u64
    };
    let moved_bytes = (moved(|s| s.h2d_bytes), moved(|s| s.d2h_bytes));
    let floor = match (compute, pcie_seconds) {
        (Some(c), Some(p)) => Some(c.max(p)),
        (Some(c), None) => Some(c),
        (None, Some(p)) => Some(p),
        (None, None) => None,
    };
    Ok(MlpReport {
        steps,
        compute_seconds: compute,
        h2d_bandwidth,
        min_bytes,
        pcie_seconds,
        step_seconds,
        ratio: floor.map(|f| step_seconds / f),
        moved_bytes,
        matches_resident,
        max_abs_diff,
        simulated: sim.is_some(),
        machine: cfg.simulate.map_or("this machine", SimulateArg::label),
    })
}

/// `line` marked as simulated: `simulated: ` before each of its lines.
fn simulated(line: &str) -> String {
    line.lines().map(|l| format!("simulated: {l}")).collect::<Vec<_>>().join("\n")
}

impl std::fmt::Display for MlpReport {
    /// The closing lines: floors, the ratio, and the check against the resident run (each
    /// marked `simulated: ` when the times are).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut text = String::new();
        self.write_lines(&mut text)?;
        if self.simulated {
            text = simulated(&text);
        }
        f.write_str(&text)
    }
}

impl MlpReport {
    fn write_lines(&self, f: &mut impl std::fmt::Write) -> std::fmt::Result {
        if let Some(c) = self.compute_seconds {
            writeln!(f, "compute floor (all resident): {:.2} ms", c * 1e3)?;
        }
        if let (Some(bw), Some(p)) = (self.h2d_bandwidth, self.pcie_seconds) {
            writeln!(
                f,
                "PCIe floor: {} in, {} out per step at {:.2} GB/s ({} of {}) = {:.2} ms",
                format_size(self.min_bytes.0),
                format_size(self.min_bytes.1),
                bw / 1e9,
                if self.simulated { "simulated H2D" } else { "raw pinned H2D" },
                self.machine,
                p * 1e3
            )?;
        }
        if let Some(bw) = self.h2d_bandwidth {
            let (i, o) = self.moved_bytes;
            let t = i.max(o) as f64 / bw;
            if t > 0.0 {
                writeln!(
                    f,
                    "bytes it moved: {} in, {} out per step (median) = {:.2} ms at that \
                     bandwidth; step time {:.3}x that",
                    format_size(i),
                    format_size(o),
                    t * 1e3,
                    self.step_seconds / t
                )?;
            }
        }
        match self.matches_resident {
            Some(true) => writeln!(f, "results equal the all-resident run bit for bit")?,
            Some(false) => writeln!(
                f,
                "results differ from the all-resident run: max |diff| {}",
                self.max_abs_diff
            )?,
            None => writeln!(f, "(no all-resident run to compare with)")?,
        }
        match self.ratio {
            Some(r) => write!(
                f,
                "step time {:.2} ms = {r:.3}x max(compute, PCIe)",
                self.step_seconds * 1e3
            ),
            None => write!(f, "step time {:.2} ms", self.step_seconds * 1e3),
        }
    }
}

#[cfg(test)]
mod simulated_tests;
#[cfg(test)]
mod tests;
