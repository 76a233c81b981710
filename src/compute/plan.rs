//! Memory plans for a tensor file: what a model's parameters, gradients and optimizer state
//! take, where each group would live under given tier budgets, and how long the bytes that must
//! cross PCIe (and come from disk) would take per step. `strata inspect` prints one.
//!
//! ```
//! use strata::optim::{AdamW, Algorithm};
//! use strata::plan::{plan, OptimizerStep, PlanConfig, TensorEntry};
//! use strata::{DType, Machine};
//!
//! // Two bf16 weights of 1 MiB each, trained with AdamW, with 4 MiB of device memory.
//! let tensors: Vec<TensorEntry> = (0..2)
//!     .map(|i| TensorEntry::new(format!("w{i}"), DType::BF16, vec![512, 1024]))
//!     .collect();
//! let cfg = PlanConfig {
//!     budgets: [4 << 20, 64 << 20, 0, 1 << 30],
//!     optimizer: OptimizerStep::Optim(Algorithm::AdamW(AdamW::default())),
//!     train: true,
//!     fp32_grads: false,
//! };
//! let p = plan(&tensors, &cfg);
//! // Parameters (2 MiB) and gradients (2 MiB) fill the device; the optimizer state (two fp32
//! // moments and fp32 master weights: 12 bytes per element, 12 MiB) lives in pinned memory.
//! assert_eq!(p.parameters().tiers, [2 << 20, 0, 0, 0]);
//! assert_eq!(p.gradients().tiers, [2 << 20, 0, 0, 0]);
//! assert_eq!(p.optimizer_state().tiers, [0, 12 << 20, 0, 0]);
//! // Per step the optimizer state crosses PCIe in and out.
//! let t = p.traffic();
//! assert_eq!((t.h2d, t.d2h), (12 << 20, 12 << 20));
//! let link = Machine { h2d: Some(25e9), d2h: Some(25e9), ..Machine::unknown("a 25 GB/s link") };
//! let s = p.predict(&link).pcie_s().unwrap();
//! assert!((s - 2.0 * 12.0 * 1048576.0 / 25e9).abs() < 1e-12);
//! ```
//!
//! ## The accounting
//! - **parameters**: every tensor of the checkpoint, in its own dtype.
//! - **gradients** (with `train`): the bytes of the floating-point parameters (f64, f32, f16,
//!   bf16), 2 bytes per element for FP8 parameters (f8e4m3, f8e5m2: FP8 training keeps
//!   gradients in bf16, FP8 having too little range for them), or 4 bytes per element with
//!   `fp32_grads` (accumulation over micro-batches); integer and bool tensors (indices, masks,
//!   counters, packed quantized weights) are not trained.
//! - **optimizer state** (with `train`), per element of the floating-point parameters, as
//!   [`strata::optim`](crate::optim)'s own description counts it
//!   ([`Algorithm::state_bytes`]): `adamw` ([`AdamW`](crate::optim::AdamW)) two fp32 moments
//!   (8 bytes), `sgd` ([`Sgd`](crate::optim::Sgd), without momentum) none, and for 16- and
//!   8-bit parameters (f16, bf16, f8e4m3, f8e5m2) fp32 master weights too (4 bytes: mixed
//!   precision). `sgd-momentum` (torch's SGD with a momentum buffer, which `strata::optim` does
//!   not run) counts `sgd`'s and one fp32 buffer more (4 bytes). `none` keeps nothing
//!   (gradients only: no optimizer step).
//!
//! ## The placement
//! The device is filled first, with parameters, then gradients; then pinned, mapped and disk in
//! the same order. The optimizer state lives in host memory, as the trainer keeps it
//! (`strata::candle::train::TrainPlan`, and `strata::optim`'s default engine, which updates it
//! there): in pinned memory, then on disk where pinned memory is full, never on the device or
//! in the mapped tier. Placement is by whole tensors (a tensor's gradient or optimizer state is
//! one piece), first fit in file order, so a group can split across tiers. Parameters that fit
//! in no memory tier stay **in the file** (as `strata load` leaves them: the disk tier refers to
//! the mapped file, using none of its budget); gradients and optimizer state that fit nowhere
//! are reported as not fitting. The tiers' alignment padding is ignored.
//!
//! ## The transfer formula
//! Let `P`, `G`, `S` be the bytes of parameters, gradients and optimizer state that are not on the
//! device (anything not placed counts as not on the device), and `P_d`, `G_d`, `S_d` the bytes
//! of each on disk (the disk tier, and for `P` the file). The update runs on the GPU (the
//! optimizer state brought to the device and written back, as `strata::optim`'s GpuResident
//! engine moves it). Per step:
//!
//! | | forward only | training, `none` | training, `sgd`/`sgd-momentum`/`adamw` |
//! |---|---|---|---|
//! | host → device | `P` | `2P` | `2P + G + S` |
//! | device → host | 0 | `G` | `P + G + S` |
//! | disk read | `P_d` | `2P_d` | `2P_d + G_d + S_d` |
//! | disk write | 0 | `G_d` | `P_d + G_d + S_d` |
//!
//! (training reads off-device parameters twice, in the forward and the backward pass; gradients
//! go out as the backward pass makes them and come back for the optimizer step; the optimizer
//! state comes in and goes out; the updated parameters go out.) The predicted time is
//! `h2d / H2D bandwidth + d2h / D2H bandwidth` for PCIe plus `disk read / disk read bandwidth +
//! disk write / disk write bandwidth` for the disk: every transfer one after the other, with no
//! overlap, so an upper bound of what the transfers cost a step.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::path::{Path, PathBuf};

use crate::base::error::{Error, Result};
use crate::base::types::{format_size, DType, Group, Tier};
use crate::compute::optim::{AdamW, Algorithm, Sgd};
use crate::{LoadOptions, Machine, Store};

/// One tensor of a file, as the file's header describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// Its name in the file.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
    /// Size in bytes (elements times the dtype's size).
    pub bytes: u64,
}

impl TensorEntry {
    /// A tensor of this dtype and shape, its bytes computed (saturating on overflow).
    pub fn new(name: impl Into<String>, dtype: DType, shape: Vec<usize>) -> TensorEntry {
        let elems = shape.iter().fold(1u64, |a, &d| a.saturating_mul(d as u64));
        let bytes = elems.saturating_mul(dtype.size_of() as u64);
        TensorEntry { name: name.into(), dtype, shape, bytes }
    }

    /// Number of elements.
    pub fn elements(&self) -> u64 {
        self.bytes / self.dtype.size_of() as u64
    }

    /// Whether the tensor is trained (a floating-point dtype): it gets gradients and optimizer
    /// state.
    pub fn is_trainable(&self) -> bool {
        self.dtype.is_float()
    }

    /// Bytes of its gradient in training: its own bytes, 2 per element for FP8 (kept in bf16),
    /// or 4 per element with `fp32` (0 when it is not trained).
    fn gradient_bytes(&self, fp32: bool) -> u64 {
        match (self.is_trainable(), fp32, self.dtype) {
            (false, _, _) => 0,
            (true, true, _) => self.elements().saturating_mul(4),
            (true, false, DType::F8E4M3 | DType::F8E5M2) => self.elements().saturating_mul(2),
            (true, false, _) => self.bytes,
        }
    }
}

/// What the headers of a safetensors checkpoint say: its tensors, its files and their
/// `__metadata__` (read without the data: [`read_headers`]). Not to be confused with a
/// training run's checkpoint (`strata::candle::train::Checkpoint`), a directory of state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointHeaders {
    /// Every tensor, file by file, each file in file order.
    pub tensors: Vec<TensorEntry>,
    /// The `.safetensors` files, in that order.
    pub files: Vec<PathBuf>,
    /// The sharded checkpoint's index, when there is one.
    pub index: Option<PathBuf>,
    /// The files' `__metadata__`, merged as [`Loaded::metadata`](crate::Loaded::metadata) does.
    pub metadata: BTreeMap<String, String>,
}

/// The tensors of a checkpoint (one `.safetensors` file, a sharded checkpoint's
/// `*.index.json`, or a directory, as [`Store::load_checkpoint`] takes them), read from the
/// headers without reading the data: the files are mapped read-only into a small host store
/// (nothing is copied) and each tensor's dtype, shape and size are taken from there, so the
/// checkpoint gets the same checks as [`Store::load_checkpoint`] (a missing file is an
/// [`Error::Io`], a bad one an [`Error::BadFile`] naming the file and the tensor).
pub fn read_headers(path: impl AsRef<Path>) -> Result<CheckpointHeaders> {
    let store = Store::builder()
        .host_backend()
        .capacity(Tier::Device, 0)
        .capacity(Tier::Pinned, 4096)
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, 0)
        .build()?;
    let loaded = store.load_checkpoint(path, LoadOptions::default())?;
    let tensors = loaded
        .iter()
        .map(|t| {
            let info = store.info(t.id)?;
            Ok(TensorEntry {
                name: t.name.clone(),
                dtype: info.dtype,
                shape: info.shape,
                bytes: info.bytes,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(CheckpointHeaders {
        tensors,
        files: loaded.files().iter().map(|f| f.path.clone()).collect(),
        index: loaded.index().map(Path::to_path_buf),
        metadata: loaded.metadata().clone(),
    })
}

/// The tensors of a checkpoint: [`read_headers`]'s.
pub fn read_tensors(path: impl AsRef<Path>) -> Result<Vec<TensorEntry>> {
    read_headers(path).map(|c| c.tensors)
}

/// The optimizer step whose state a training plan counts.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum OptimizerStep {
    /// No optimizer step (`none`): gradients only.
    #[default]
    None,
    /// A step of one of [`strata::optim`](crate::optim)'s algorithms (`sgd`: [`Sgd`], without
    /// momentum; `adamw`: [`AdamW`]), its state counted by [`Algorithm::state_bytes`]. Only the
    /// kind counts: the hyperparameters are the algorithm's own and change no byte.
    Optim(Algorithm),
    /// SGD with a momentum buffer (`sgd-momentum`, `torch.optim.SGD` with `momentum > 0`),
    /// which `strata::optim` does not run: planned for comparison, as `sgd`'s state and one
    /// fp32 buffer per element.
    SgdMomentum,
}

impl OptimizerStep {
    /// Lower-case name, as printed and parsed: the names `strata train-demo --optimizer` uses
    /// (`sgd` is [`strata::optim`](crate::optim)'s SGD, without momentum, here as there).
    pub fn name(self) -> &'static str {
        match self {
            OptimizerStep::None => "none",
            OptimizerStep::Optim(a) => a.name(),
            OptimizerStep::SgdMomentum => "sgd-momentum",
        }
    }

    /// Bytes of state per element of a trained parameter of dtype `param`, master weights
    /// included ([`Algorithm::state_bytes`]).
    pub fn state_bytes(self, param: DType) -> u64 {
        match self {
            OptimizerStep::None => 0,
            OptimizerStep::Optim(a) => a.state_bytes(param),
            OptimizerStep::SgdMomentum => {
                Algorithm::Sgd(Sgd::default()).state_bytes(param)
                    + if param.is_float() { 4 } else { 0 }
            }
        }
    }
}

impl fmt::Display for OptimizerStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for OptimizerStep {
    type Err = Error;
    /// `none`, `sgd` (also read as `sgd-plain`), `sgd-momentum` or `adamw` (also read as
    /// `adam`), in any case; `sgd` and `adamw` with [`strata::optim`](crate::optim)'s default
    /// hyperparameters.
    fn from_str(s: &str) -> Result<OptimizerStep> {
        let s = s.trim();
        let is = |names: &[&str]| names.iter().any(|n| s.eq_ignore_ascii_case(n));
        if is(&["none"]) {
            Ok(OptimizerStep::None)
        } else if is(&["sgd", "sgd-plain"]) {
            Ok(OptimizerStep::Optim(Algorithm::Sgd(Sgd::default())))
        } else if is(&["sgd-momentum"]) {
            Ok(OptimizerStep::SgdMomentum)
        } else if is(&["adamw", "adam"]) {
            Ok(OptimizerStep::Optim(Algorithm::AdamW(AdamW::default())))
        } else {
            Err(Error::InvalidArgument(format!(
                "unknown optimizer {s:?} (none, sgd, sgd-momentum or adamw)"
            )))
        }
    }
}

/// What a plan is made for.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanConfig {
    /// Budget of each tier in bytes, indexed by [`Tier::index`] (0: the tier is not used).
    pub budgets: [u64; 4],
    /// The optimizer step whose state is counted (with `train`).
    pub optimizer: OptimizerStep,
    /// Training (gradients and optimizer state) rather than forward passes only.
    pub train: bool,
    /// Gradients kept in fp32 (4 bytes per element, for accumulation over micro-batches)
    /// rather than in the parameter's dtype.
    pub fp32_grads: bool,
}

/// Host memory a training run keeps out of its Pinned tier for the system and the process, of
/// `host` bytes of host memory: a sixteenth, at least 8 GiB, at most a quarter. The trainer's
/// plan (`strata::candle::train::TrainPlan`) sizes the Pinned tier by it, and so does
/// `strata inspect --train` when no Pinned budget is given, so that the two keep the optimizer
/// state in the same memory.
///
/// ```
/// let gib = 1u64 << 30;
/// assert_eq!(strata::plan::host_reserve(128 * gib), 8 * gib);
/// assert_eq!(strata::plan::host_reserve(1024 * gib), 64 * gib);
/// assert_eq!(strata::plan::host_reserve(16 * gib), 4 * gib);
/// ```
pub fn host_reserve(host: u64) -> u64 {
    (8u64 << 30).max(host / 16).min(host / 4)
}

/// The groups a plan places, in the order it places them.
const PLANNED: [Group; 3] = [Group::Param, Group::Grad, Group::OptimizerState];

/// A planned group's name in the plan's table.
fn label(group: Group) -> &'static str {
    match group {
        Group::Param => "parameters",
        Group::Grad => "gradients",
        Group::OptimizerState => "optimizer state",
        other => other.name(),
    }
}

/// Where one group's bytes went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupPlan {
    /// The group: [`Group::Param`], [`Group::Grad`] or [`Group::OptimizerState`].
    pub group: Group,
    /// Its bytes in all.
    pub bytes: u64,
    /// Bytes placed in each tier, indexed by [`Tier::index`].
    pub tiers: [u64; 4],
    /// Parameter bytes left in place in the file (0 for the other groups).
    pub in_file: u64,
    /// Bytes that fit in no tier.
    pub unplaced: u64,
}

impl GroupPlan {
    /// Bytes not on the device (in other tiers, in the file, or not placed).
    pub fn off_device(&self) -> u64 {
        self.bytes.saturating_sub(self.tiers[Tier::Device.index()])
    }

    /// Bytes on disk: the disk tier, and the file.
    pub fn on_disk(&self) -> u64 {
        self.tiers[Tier::Disk.index()].saturating_add(self.in_file)
    }
}

/// Where parameters, gradients and optimizer state would live under a [`PlanConfig`].
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryPlan {
    /// What it was made for.
    pub config: PlanConfig,
    /// Parameters, gradients, optimizer state, in that order.
    pub groups: [GroupPlan; 3],
}

/// Bytes that cross PCIe and the disk in one step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Host to device.
    pub h2d: u64,
    /// Device to host.
    pub d2h: u64,
    /// Read from disk (the disk tier or the file).
    pub disk_read: u64,
    /// Written to disk.
    pub disk_write: u64,
}

/// Makes the plan: sizes the groups by the accounting of the module documentation and places
/// them, device first.
pub fn plan(tensors: &[TensorEntry], config: &PlanConfig) -> MemoryPlan {
    // Each group as pieces, one per tensor (a tensor's bytes in that group).
    let pieces: [Vec<u64>; 3] = [
        tensors.iter().map(|t| t.bytes).collect(),
        tensors
            .iter()
            .map(|t| if config.train { t.gradient_bytes(config.fp32_grads) } else { 0 })
            .collect(),
        tensors.iter().map(|t| state_bytes(t, config)).collect(),
    ];
    let mut placed: [Vec<bool>; 3] = pieces.clone().map(|p| p.iter().map(|&b| b == 0).collect());
    let mut groups =
        PLANNED.map(|group| GroupPlan { group, bytes: 0, tiers: [0; 4], in_file: 0, unplaced: 0 });
    for (g, p) in groups.iter_mut().zip(&pieces) {
        g.bytes = p.iter().fold(0u64, |a, &b| a.saturating_add(b));
    }
    for tier in Tier::ALL {
        let mut free = config.budgets[tier.index()];
        for (gi, group) in groups.iter_mut().enumerate() {
            // Parameters stay in the file rather than take the disk tier's budget; the
            // optimizer state lives in host memory (Pinned, then Disk), as the trainer keeps it.
            let skip = match group.group {
                Group::Param => tier == Tier::Disk,
                Group::OptimizerState => matches!(tier, Tier::Device | Tier::Mapped),
                _ => false,
            };
            if skip {
                continue;
            }
            for (done, &bytes) in placed[gi].iter_mut().zip(&pieces[gi]) {
                if !*done && bytes <= free {
                    free -= bytes;
                    group.tiers[tier.index()] += bytes;
                    *done = true;
                }
            }
        }
    }
    for (gi, group) in groups.iter_mut().enumerate() {
        let left = placed[gi]
            .iter()
            .zip(&pieces[gi])
            .filter(|(done, _)| !**done)
            .fold(0u64, |a, (_, &b)| a.saturating_add(b));
        if group.group == Group::Param {
            group.in_file = left;
        } else {
            group.unplaced = left;
        }
    }
    MemoryPlan { config: config.clone(), groups }
}

/// Optimizer state of one tensor: moments, and fp32 master weights for 16- and 8-bit
/// parameters ([`OptimizerStep::state_bytes`]).
fn state_bytes(t: &TensorEntry, config: &PlanConfig) -> u64 {
    if !config.train || !t.is_trainable() {
        return 0;
    }
    t.elements().saturating_mul(config.optimizer.state_bytes(t.dtype))
}

impl MemoryPlan {
    /// The parameters' placement.
    pub fn parameters(&self) -> &GroupPlan {
        &self.groups[0]
    }

    /// The gradients' placement.
    pub fn gradients(&self) -> &GroupPlan {
        &self.groups[1]
    }

    /// The optimizer state's placement.
    pub fn optimizer_state(&self) -> &GroupPlan {
        &self.groups[2]
    }

    /// Bytes of every group.
    pub fn total(&self) -> u64 {
        self.groups.iter().fold(0u64, |a, g| a.saturating_add(g.bytes))
    }

    /// Bytes that fit nowhere.
    pub fn unplaced(&self) -> u64 {
        self.groups.iter().fold(0u64, |a, g| a.saturating_add(g.unplaced))
    }

    /// Bytes per step across PCIe and the disk, by the formula of the module documentation.
    pub fn traffic(&self) -> Traffic {
        let (p, g, s) = (self.parameters(), self.gradients(), self.optimizer_state());
        let (po, go, so) = (p.off_device(), g.off_device(), s.off_device());
        let (pd, gd, sd) = (p.on_disk(), g.on_disk(), s.on_disk());
        let sum = |xs: &[u64]| xs.iter().fold(0u64, |a, &b| a.saturating_add(b));
        if !self.config.train {
            return Traffic { h2d: po, d2h: 0, disk_read: pd, disk_write: 0 };
        }
        let two = |x: u64| x.saturating_mul(2);
        if self.config.optimizer == OptimizerStep::None {
            return Traffic { h2d: two(po), d2h: go, disk_read: two(pd), disk_write: gd };
        }
        Traffic {
            h2d: sum(&[two(po), go, so]),
            d2h: sum(&[po, go, so]),
            disk_read: sum(&[two(pd), gd, sd]),
            disk_write: sum(&[pd, gd, sd]),
        }
    }

    /// The formula of each of [`MemoryPlan::traffic`]'s figures (host to device, device to
    /// host, disk read, disk write) for this plan's mode.
    pub fn formulas(&self) -> [&'static str; 4] {
        match (self.config.train, self.config.optimizer) {
            (false, _) => ["P", "0", "P_d", "0"],
            (true, OptimizerStep::None) => ["2P", "G", "2P_d", "G_d"],
            (true, _) => ["2P + G + S", "P + G + S", "2P_d + G_d + S_d", "P_d + G_d + S_d"],
        }
    }

    /// The predicted transfer time of one step on `machine` (its `h2d`, `d2h`, `disk_read` and
    /// `disk_write`; D2H at the H2D figure and disk writes at the read figure where those are
    /// missing).
    pub fn predict(&self, machine: &Machine) -> Prediction {
        let t = self.traffic();
        let secs = Machine::seconds;
        let m = machine;
        Prediction {
            traffic: t,
            formulas: self.formulas(),
            secs: [
                secs(t.h2d, m.h2d),
                secs(t.d2h, m.d2h.or(m.h2d)),
                secs(t.disk_read, m.disk_read),
                secs(t.disk_write, m.disk_write.or(m.disk_read)),
            ],
        }
    }
}

impl fmt::Display for MemoryPlan {
    /// The plan as an aligned table, group by tier, with a total row.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        let mode = if c.train {
            format!("training, optimizer {}", c.optimizer)
        } else {
            "forward only (no gradients or optimizer state; --train to count them)".to_string()
        };
        writeln!(f, "memory plan: {mode}")?;
        let budgets: Vec<String> = Tier::ALL
            .iter()
            .map(|t| match c.budgets[t.index()] {
                0 => format!("{t} off"),
                b => format!("{t} {}", format_size(b)),
            })
            .collect();
        writeln!(f, "budgets: {}", budgets.join(", "))?;
        let head = ["group", "total", "device", "pinned", "mapped", "disk", "in file", "no room"];
        let mut rows: Vec<[String; 8]> = Vec::new();
        let cell = |b: u64| if b == 0 { "-".to_string() } else { format_size(b) };
        let mut sum = [0u64; 7];
        for g in &self.groups {
            let vals =
                [g.bytes, g.tiers[0], g.tiers[1], g.tiers[2], g.tiers[3], g.in_file, g.unplaced];
            for (s, v) in sum.iter_mut().zip(vals) {
                *s = s.saturating_add(v);
            }
            rows.push([
                label(g.group).to_string(),
                cell(vals[0]),
                cell(vals[1]),
                cell(vals[2]),
                cell(vals[3]),
                cell(vals[4]),
                cell(vals[5]),
                cell(vals[6]),
            ]);
        }
        rows.push([
            "total".to_string(),
            cell(sum[0]),
            cell(sum[1]),
            cell(sum[2]),
            cell(sum[3]),
            cell(sum[4]),
            cell(sum[5]),
            cell(sum[6]),
        ]);
        let mut w = head.map(str::len);
        for r in &rows {
            for (wi, s) in w.iter_mut().zip(r) {
                *wi = (*wi).max(s.len());
            }
        }
        let line = |f: &mut fmt::Formatter<'_>, r: &[&str]| -> fmt::Result {
            let mut s = String::new();
            for (i, (v, wi)) in r.iter().zip(w).enumerate() {
                if i == 0 {
                    let _ = write!(s, "{v:<wi$}");
                } else {
                    let _ = write!(s, "  {v:>wi$}");
                }
            }
            writeln!(f, "{}", s.trim_end())
        };
        line(f, &head)?;
        for r in &rows {
            let refs: Vec<&str> = r.iter().map(String::as_str).collect();
            line(f, &refs)?;
        }
        if self.unplaced() > 0 {
            writeln!(
                f,
                "does not fit: {} (raise the budgets, --disk-budget first)",
                format_size(self.unplaced())
            )?;
        }
        Ok(())
    }
}

/// A prediction of one step's transfer time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Prediction {
    /// The bytes it is made of.
    pub traffic: Traffic,
    /// The formula of each figure: host to device, device to host, disk read, disk write.
    pub formulas: [&'static str; 4],
    /// Seconds of each, in the same order (`None`: bytes to move and no bandwidth known).
    pub secs: [Option<f64>; 4],
}

impl Prediction {
    /// Seconds of PCIe transfers (both directions, one after the other).
    pub fn pcie_s(&self) -> Option<f64> {
        Some(self.secs[0]? + self.secs[1]?)
    }

    /// Seconds of disk reads and writes.
    pub fn disk_s(&self) -> Option<f64> {
        Some(self.secs[2]? + self.secs[3]?)
    }

    /// PCIe plus disk seconds, when both are known.
    pub fn total_s(&self) -> Option<f64> {
        Some(self.pcie_s()? + self.disk_s()?)
    }
}

fn fmt_secs(s: Option<f64>) -> String {
    match s {
        None => "?".into(),
        Some(s) if s >= 1.0 => format!("{s:.2} s"),
        Some(s) => format!("{:.2} ms", s * 1e3),
    }
}

impl fmt::Display for Prediction {
    /// A table of the bytes per step, their formula and time, then the total.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = &self.traffic;
        writeln!(f, "transfers per step (P, G, S: bytes of parameters, gradients, optimizer")?;
        writeln!(f, "state not on the device; P_d, G_d, S_d: of them on disk or in the file):")?;
        let labels = ["host -> device", "device -> host", "disk read", "disk write"];
        let bytes = [t.h2d, t.d2h, t.disk_read, t.disk_write].map(format_size);
        let times = self.secs.map(fmt_secs);
        let fw = self.formulas.iter().map(|s| s.len()).max().unwrap_or(0).max(7);
        let bw = bytes.iter().map(String::len).max().unwrap_or(0).max(5);
        let tw = times.iter().map(String::len).max().unwrap_or(0).max(4);
        writeln!(f, "  {:<14}  {:<fw$}  {:>bw$}  {:>tw$}", "", "formula", "bytes", "time")?;
        for i in 0..4 {
            writeln!(
                f,
                "  {:<14}  {:<fw$}  {:>bw$}  {:>tw$}",
                labels[i], self.formulas[i], bytes[i], times[i]
            )?;
        }
        let line = match (self.pcie_s(), self.disk_s()) {
            (Some(p), Some(d)) => format!(
                "{} (PCIe {} + disk {}, one after the other)",
                fmt_secs(Some(p + d)),
                fmt_secs(Some(p)),
                fmt_secs(Some(d))
            ),
            (None, Some(d)) => {
                format!("at least {} (disk only: PCIe time not predicted)", fmt_secs(Some(d)))
            }
            (Some(p), None) => {
                format!("at least {} (PCIe only: disk time not predicted)", fmt_secs(Some(p)))
            }
            (None, None) => "not predicted".into(),
        };
        writeln!(f, "predicted transfer time per step: {line}")
    }
}

/// The tensors as an aligned table: name, dtype, shape, bytes; one line each, in file order.
pub fn tensor_table(tensors: &[TensorEntry]) -> String {
    // Names in the order a person counts: `layers.2` before `layers.10`.
    let mut tensors: Vec<&TensorEntry> = tensors.iter().collect();
    tensors.sort_by(|a, b| natural_cmp(&a.name, &b.name));
    let shapes: Vec<String> = tensors.iter().map(|t| shape_str(&t.shape)).collect();
    let sizes: Vec<String> = tensors.iter().map(|t| format_size(t.bytes)).collect();
    let name_w = tensors.iter().map(|t| t.name.chars().count()).max().unwrap_or(0).clamp(4, 60);
    let shape_w = shapes.iter().map(String::len).max().unwrap_or(0).max(5);
    let size_w = sizes.iter().map(String::len).max().unwrap_or(0).max(5);
    let dtype_w = tensors.iter().map(|t| t.dtype.name().len()).max().unwrap_or(0).max(5);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<name_w$}  {:<dtype_w$}  {:<shape_w$}  {:>size_w$}",
        "name", "dtype", "shape", "bytes"
    );
    for ((t, shape), size) in tensors.iter().zip(&shapes).zip(&sizes) {
        let _ = writeln!(
            s,
            "{:<name_w$}  {:<dtype_w$}  {shape:<shape_w$}  {size:>size_w$}",
            t.name,
            t.dtype.name()
        );
    }
    s
}

/// Compares names with their runs of digits as numbers (`layers.2` < `layers.10`), the rest
/// byte by byte; equal numbers with more leading zeros sort after.
fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    let (mut a, mut b) = (a.as_bytes(), b.as_bytes());
    let digits = |s: &[u8]| s.iter().take_while(|c| c.is_ascii_digit()).count();
    loop {
        match (a.first(), b.first()) {
            (None, None) => return Ordering::Equal,
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(x), Some(y)) if x.is_ascii_digit() && y.is_ascii_digit() => {
                let (na, nb) = (digits(a), digits(b));
                let (ra, rb) = (&a[..na], &b[..nb]);
                let trim = |r: &[u8]| {
                    let z = r.iter().take_while(|&&c| c == b'0').count();
                    r[z..].to_vec()
                };
                let (ta, tb) = (trim(ra), trim(rb));
                let by_value = ta.len().cmp(&tb.len()).then_with(|| ta.cmp(&tb));
                match by_value.then_with(|| na.cmp(&nb)) {
                    Ordering::Equal => (a, b) = (&a[na..], &b[nb..]),
                    o => return o,
                }
            }
            (Some(x), Some(y)) if x != y => return x.cmp(y),
            _ => (a, b) = (&a[1..], &b[1..]),
        }
    }
}

/// `[4096, 4096]`; `[]` for a scalar.
fn shape_str(shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    format!("[{}]", dims.join(", "))
}

/// Totals: tensor count, elements, bytes per dtype, and the total.
pub fn totals(tensors: &[TensorEntry]) -> String {
    let mut by: Vec<(DType, usize, u64)> = Vec::new();
    for t in tensors {
        match by.iter_mut().find(|(d, _, _)| *d == t.dtype) {
            Some(e) => {
                e.1 += 1;
                e.2 = e.2.saturating_add(t.bytes);
            }
            None => by.push((t.dtype, 1, t.bytes)),
        }
    }
    by.sort_by_key(|&(_, _, b)| std::cmp::Reverse(b));
    let total = tensors.iter().fold(0u64, |a, t| a.saturating_add(t.bytes));
    let elems = tensors.iter().fold(0u64, |a, t| a.saturating_add(t.elements()));
    let mut s = String::new();
    let parts: Vec<String> = by
        .iter()
        .map(|(d, n, b)| {
            format!("{d} {} ({n} tensor{})", format_size(*b), if *n == 1 { "" } else { "s" })
        })
        .collect();
    let _ = writeln!(
        s,
        "{} tensors, {} elements, {} ({total} bytes)",
        tensors.len(),
        elems,
        format_size(total)
    );
    if !parts.is_empty() {
        let _ = writeln!(s, "by dtype: {}", parts.join(", "));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(budgets: [u64; 4], optimizer: OptimizerStep, train: bool) -> PlanConfig {
        PlanConfig { budgets, optimizer, train, fp32_grads: false }
    }

    fn adamw() -> OptimizerStep {
        OptimizerStep::Optim(Algorithm::AdamW(AdamW::default()))
    }

    fn sgd() -> OptimizerStep {
        OptimizerStep::Optim(Algorithm::Sgd(Sgd::default()))
    }

    fn t(name: &str, dtype: DType, shape: &[usize]) -> TensorEntry {
        TensorEntry::new(name, dtype, shape.to_vec())
    }

    const MIB: u64 = 1 << 20;

    #[test]
    fn names_sort_as_a_person_counts() {
        let mut names = vec![
            "model.layers.10.mlp",
            "model.layers.2.mlp",
            "model.layers.1.mlp",
            "model.layers.02.mlp",
            "lm_head",
            "model.layers.1.attn",
            "model.layers.1",
        ];
        names.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(
            names,
            [
                "lm_head",
                "model.layers.1",
                "model.layers.1.attn",
                "model.layers.1.mlp",
                "model.layers.2.mlp",
                "model.layers.02.mlp",
                "model.layers.10.mlp",
            ]
        );
        let table = tensor_table(&[t("b.10", DType::F32, &[1]), t("b.9", DType::F32, &[1])]);
        assert!(table.find("b.9").unwrap() < table.find("b.10").unwrap(), "{table}");
    }

    #[test]
    fn optimizer_parses_and_prints() {
        // train-demo's names, and the old ones as aliases; `sgd` is strata::optim's SGD.
        let parse = |s: &str| s.parse::<OptimizerStep>().unwrap();
        assert_eq!(parse("adamw"), adamw());
        assert_eq!(parse("ADAM"), adamw());
        assert_eq!(parse("sgd"), sgd());
        assert_eq!(parse("sgd-plain"), sgd());
        assert_eq!(parse("sgd-momentum"), OptimizerStep::SgdMomentum);
        assert_eq!(parse("none"), OptimizerStep::None);
        assert!("lion".parse::<OptimizerStep>().is_err());
        assert_eq!(adamw().to_string(), "adamw");
        assert_eq!(sgd().to_string(), "sgd");
        assert_eq!(OptimizerStep::SgdMomentum.to_string(), "sgd-momentum");
        // The state per element is the optimizer's own count.
        for d in [DType::F32, DType::BF16, DType::F8E4M3, DType::I64] {
            let a = Algorithm::AdamW(AdamW::default());
            assert_eq!(adamw().state_bytes(d), a.state_bytes(d), "{d}");
            assert_eq!(sgd().state_bytes(d), Algorithm::Sgd(Sgd::default()).state_bytes(d));
        }
        assert_eq!(OptimizerStep::SgdMomentum.state_bytes(DType::BF16), 8);
        assert_eq!(OptimizerStep::SgdMomentum.state_bytes(DType::F32), 4);
    }

    #[test]
    fn accounting_follows_dtype_optimizer_and_mode() {
        // 1 Mi elements of bf16 (2 MiB) and 1 Mi elements of f32 (4 MiB), plus an i64 index.
        let ts = [
            t("h", DType::BF16, &[1024, 1024]),
            t("f", DType::F32, &[1 << 20]),
            t("i", DType::I64, &[8]),
        ];
        let big = [u64::MAX / 8; 4];
        let forward = plan(&ts, &cfg(big, adamw(), false));
        assert_eq!(forward.parameters().bytes, 6 * MIB + 64);
        assert_eq!((forward.gradients().bytes, forward.optimizer_state().bytes), (0, 0));

        let none = plan(&ts, &cfg(big, OptimizerStep::None, true));
        assert_eq!(none.gradients().bytes, 6 * MIB, "integers get no gradient");
        assert_eq!(none.optimizer_state().bytes, 0);

        let sgd = plan(&ts, &cfg(big, OptimizerStep::SgdMomentum, true));
        // momentum 4 B/elem for both, master weights 4 B/elem for the bf16 one.
        assert_eq!(sgd.optimizer_state().bytes, 4 * MIB + 4 * MIB + 4 * MIB);

        let adam = plan(&ts, &cfg(big, adamw(), true));
        // bf16: 8 + 4 per element; f32: 8 per element.
        assert_eq!(adam.optimizer_state().bytes, 12 * MIB + 8 * MIB);
        assert_eq!(adam.total(), (6 * MIB + 64) + 6 * MIB + 20 * MIB);
        assert_eq!(adam.unplaced(), 0);
    }

    #[test]
    fn fp8_trains_with_bf16_gradients_and_master_weights_unsigned_does_not() {
        // 1 Mi elements of each FP8 type (1 MiB each), 1 MiB of u32, and small u16 and u64.
        let ts = [
            t("q", DType::F8E4M3, &[1 << 20]),
            t("k", DType::F8E5M2, &[1024, 1024]),
            t("u", DType::U32, &[1 << 18]),
            t("v", DType::U16, &[8]),
            t("w", DType::U64, &[8]),
        ];
        let big = [u64::MAX / 8; 4];
        let adam = plan(&ts, &cfg(big, adamw(), true));
        assert_eq!(adam.parameters().bytes, 3 * MIB + 16 + 64);
        assert_eq!(adam.gradients().bytes, 2 * 2 * MIB, "bf16 gradients of the FP8 ones only");
        // Two fp32 moments and fp32 master weights per FP8 element.
        assert_eq!(adam.optimizer_state().bytes, 2 * 12 * MIB);
        let fp32 =
            plan(&ts, &PlanConfig { fp32_grads: true, ..cfg(big, OptimizerStep::None, true) });
        assert_eq!(fp32.gradients().bytes, 2 * 4 * MIB);
        assert_eq!(fp32.optimizer_state().bytes, 0);
        let table = tensor_table(&ts);
        let rows: Vec<&str> = table.lines().collect();
        // (Rows in name order: k, q, u, v, w.)
        assert!(rows[1].starts_with("k ") && rows[1].contains(" f8e5m2 "), "{table}");
        assert!(rows[2].starts_with("q ") && rows[2].contains(" f8e4m3 "), "{table}");
        // The columns stay aligned with a dtype name longer than the header.
        let col = |r: &str| r.find('[').unwrap();
        assert!(rows[1..].iter().all(|r| col(r) == col(rows[1])), "{table}");
        assert_eq!(rows[0].find("shape"), Some(col(rows[1])), "{table}");
        let tot = totals(&ts);
        assert!(tot.contains("f8e4m3 1.00 MiB (1 tensor)") && tot.contains("u64 64 B"), "{tot}");
    }

    #[test]
    fn placement_fills_device_first_in_group_order() {
        // Four f32 tensors of 1 MiB; Adam: grads 4 MiB, state 8 MiB.
        let ts: Vec<_> = (0..4).map(|i| t(&format!("w{i}"), DType::F32, &[1 << 18])).collect();
        let p = plan(&ts, &cfg([6 * MIB, 4 * MIB, 0, 3 * MIB], adamw(), true));
        assert_eq!(p.parameters().tiers, [4 * MIB, 0, 0, 0]);
        assert_eq!(p.gradients().tiers, [2 * MIB, 2 * MIB, 0, 0], "gradients split");
        // Each tensor's state is 2 MiB: one in the 2 MiB left in pinned, one on disk (3 MiB).
        assert_eq!(p.optimizer_state().tiers, [0, 2 * MIB, 0, 2 * MIB]);
        assert_eq!(p.optimizer_state().unplaced, 4 * MIB);
        assert_eq!(p.unplaced(), 4 * MIB);
        let shown = p.to_string();
        assert!(shown.contains("optimizer state") && shown.contains("does not fit"), "{shown}");
    }

    /// The optimizer state lives in host memory, as the trainer keeps it: pinned, then disk,
    /// never on the device or in the mapped tier, however much room they have (the plan used to
    /// fill the device with it, then mapped memory, and `strata inspect --train` then showed
    /// state on disk that the trainer's plan keeps in host memory).
    #[test]
    fn optimizer_state_lives_in_host_memory_as_the_trainer_keeps_it() {
        // Four f32 tensors of 1 MiB; AdamW: state 2 MiB each.
        let ts: Vec<_> = (0..4).map(|i| t(&format!("w{i}"), DType::F32, &[1 << 18])).collect();
        let p = plan(&ts, &cfg([64 * MIB, 5 * MIB, 64 * MIB, 64 * MIB], adamw(), true));
        assert_eq!(p.parameters().tiers, [4 * MIB, 0, 0, 0]);
        assert_eq!(p.gradients().tiers, [4 * MIB, 0, 0, 0]);
        assert_eq!(p.optimizer_state().tiers, [0, 4 * MIB, 0, 4 * MIB]);
        assert_eq!(p.unplaced(), 0);
        // Without a disk budget what pinned memory cannot hold does not fit.
        let p = plan(&ts, &cfg([64 * MIB, 5 * MIB, 64 * MIB, 0], adamw(), true));
        assert_eq!(p.optimizer_state().tiers, [0, 4 * MIB, 0, 0]);
        assert_eq!(p.optimizer_state().unplaced, 4 * MIB);
    }

    #[test]
    fn parameters_that_fit_nowhere_stay_in_the_file() {
        let ts: Vec<_> = (0..4).map(|i| t(&format!("w{i}"), DType::F32, &[1 << 18])).collect();
        let p = plan(&ts, &cfg([MIB, MIB, 0, 64 * MIB], OptimizerStep::None, false));
        let params = p.parameters();
        assert_eq!(params.tiers, [MIB, MIB, 0, 0], "the disk budget is not used for them");
        assert_eq!((params.in_file, params.unplaced), (2 * MIB, 0));
        assert_eq!(params.on_disk(), 2 * MIB);
        assert_eq!(params.off_device(), 3 * MIB);
    }

    #[test]
    fn first_fit_places_smaller_tensors_past_a_large_one() {
        let ts = [
            t("small", DType::U8, &[100]),
            t("big", DType::U8, &[1000]),
            t("s2", DType::U8, &[50]),
        ];
        let p = plan(&ts, &cfg([200, 0, 0, 0], OptimizerStep::None, false));
        assert_eq!(p.parameters().tiers[0], 150);
        assert_eq!(p.parameters().in_file, 1000);
    }

    #[test]
    fn traffic_follows_the_formula() {
        let ts: Vec<_> = (0..4).map(|i| t(&format!("w{i}"), DType::F32, &[1 << 18])).collect();
        // Forward: 1 MiB of 4 on device, 1 pinned, 2 in the file.
        let p = plan(&ts, &cfg([MIB, MIB, 0, 0], OptimizerStep::None, false));
        assert_eq!(
            p.traffic(),
            Traffic { h2d: 3 * MIB, d2h: 0, disk_read: 2 * MIB, disk_write: 0 }
        );
        // Training without optimizer: params twice, gradients out.
        let p = plan(&ts, &cfg([4 * MIB, 4 * MIB, 0, 0], OptimizerStep::None, true));
        assert_eq!(p.gradients().tiers, [0, 4 * MIB, 0, 0]);
        assert_eq!(p.traffic(), Traffic { h2d: 0, d2h: 4 * MIB, disk_read: 0, disk_write: 0 });
        // SGD: P = 0 (all on device), G = 4 MiB pinned, S = 4 MiB: 2 pinned... none left: disk.
        let p = plan(&ts, &cfg([4 * MIB, 6 * MIB, 0, 8 * MIB], OptimizerStep::SgdMomentum, true));
        assert_eq!(p.optimizer_state().tiers, [0, 2 * MIB, 0, 2 * MIB]);
        let tr = p.traffic();
        assert_eq!(tr.h2d, 4 * MIB + 4 * MIB);
        assert_eq!(tr.d2h, 4 * MIB + 4 * MIB);
        assert_eq!((tr.disk_read, tr.disk_write), (2 * MIB, 2 * MIB));
        // Parameters off the device: read twice, written back once.
        let p = plan(&ts, &cfg([0, 16 * MIB, 0, 0], OptimizerStep::SgdMomentum, true));
        let tr = p.traffic();
        assert_eq!(
            (tr.h2d, tr.d2h),
            (2 * 4 * MIB + 4 * MIB + 4 * MIB, 4 * MIB + 4 * MIB + 4 * MIB)
        );
        assert_eq!(p.formulas()[0], "2P + G + S");
    }

    #[test]
    fn prediction_divides_by_bandwidth_and_says_when_it_cannot() {
        let ts: Vec<_> = (0..4).map(|i| t(&format!("w{i}"), DType::F32, &[1 << 18])).collect();
        let p = plan(&ts, &cfg([MIB, MIB, 0, 0], OptimizerStep::None, false));
        let m = Machine { h2d: Some(10e9), disk_read: Some(1e9), ..Machine::unknown("m") };
        let pr = p.predict(&m);
        let want_pcie = (3 * MIB) as f64 / 10e9;
        let want_disk = (2 * MIB) as f64 / 1e9;
        assert!((pr.pcie_s().unwrap() - want_pcie).abs() < 1e-15);
        assert!((pr.disk_s().unwrap() - want_disk).abs() < 1e-15);
        assert!((pr.total_s().unwrap() - want_pcie - want_disk).abs() < 1e-15);
        let none = p.predict(&Machine::unknown("m"));
        assert_eq!((none.pcie_s(), none.disk_s()), (None, None));
        assert!(none.to_string().contains("not predicted"), "{none}");
        // Everything on the device: nothing to move, zero without any bandwidth.
        let all = plan(&ts, &cfg([4 * MIB, 0, 0, 0], OptimizerStep::None, false));
        assert_eq!(all.predict(&Machine::unknown("m")).total_s(), Some(0.0));
    }

    #[test]
    fn reads_tensors_of_a_file_and_prints_them() {
        use safetensors::tensor::{Dtype, TensorView};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let a = vec![0u8; 2 * 3 * 4];
        let b = vec![1u8; 5 * 2];
        let views = vec![
            ("layer.weight", TensorView::new(Dtype::F32, vec![2, 3], &a).unwrap()),
            ("layer.bias", TensorView::new(Dtype::BF16, vec![5], &b).unwrap()),
        ];
        safetensors::serialize_to_file(views, None, &path).unwrap();
        let ts = read_tensors(&path).unwrap();
        assert_eq!(ts.len(), 2);
        let w = ts.iter().find(|t| t.name == "layer.weight").unwrap();
        assert_eq!((w.dtype, w.shape.clone(), w.bytes), (DType::F32, vec![2, 3], 24));
        let table = tensor_table(&ts);
        assert!(table.contains("layer.weight") && table.contains("[2, 3]"), "{table}");
        assert!(table.lines().next().unwrap().starts_with("name"));
        let tot = totals(&ts);
        assert!(tot.starts_with("2 tensors, 11 elements, 34 B (34 bytes)"), "{tot}");
        assert!(tot.contains("f32 24 B (1 tensor)"), "{tot}");

        assert!(matches!(read_tensors(dir.path().join("none.safetensors")), Err(Error::Io { .. })));
        let junk = dir.path().join("junk.safetensors");
        std::fs::write(&junk, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all").unwrap();
        assert!(matches!(read_tensors(&junk), Err(Error::BadFile { .. })));
    }
}
