//! The trainer's memory plan on a given machine ([`TrainPlan`]).

use std::fmt;

use super::{TrainConfig, TrainError};
use crate::base::types::{format_size, DType, Group, Tier};
use crate::candle::LlamaConfig;
use crate::compute::optim::{update_bytes, AdamW, Algorithm, Engine};
use crate::Machine;

const GIB: u64 = 1 << 30;

impl Machine {
    /// This machine's memories (feature `candle`): the device's (a CUDA device's total memory;
    /// for the CPU, host memory, which the Device tier then shares), the host memory available
    /// now (`MemAvailable`), the free disk under the temporary directory (where the Disk tier's
    /// files go), each noted, and what cannot be read left unknown with a note. The rates are not
    /// known until [`Machine::measure`] measures them; the compute rate is left unknown (a run
    /// measures its compute).
    pub fn detect(device: &candle_core::Device) -> Machine {
        let host = crate::host_memory_available();
        let tmp = std::env::temp_dir();
        let disk = crate::disk_space_available(&tmp).ok();
        let (device_bytes, device_is_host, device_note) = match device {
            #[cfg(feature = "candle-cuda")]
            candle_core::Device::Cuda(d) => (
                d.cuda_stream().context().total_mem().ok().map(|b| b as u64),
                false,
                "the CUDA device's total memory",
            ),
            _ => (host, true, "host memory: candle computes on the CPU, the Device tier shares it"),
        };
        let size = |b: Option<u64>| b.map_or("unknown".to_string(), format_size);
        let mut m = Machine::unknown(format!(
            "this machine ({} device memory{}, {} host memory available, {} free disk)",
            size(device_bytes),
            if device_is_host { " shared with the host" } else { "" },
            size(host),
            size(disk)
        ));
        (m.device_bytes, m.device_is_host, m.host_bytes, m.disk_bytes) =
            (device_bytes, device_is_host, host, disk);
        m.note("device_bytes", device_note);
        m.note("host_bytes", "MemAvailable, read now");
        m.note("disk_bytes", format!("free under {}, read now", tmp.display()));
        for f in ["h2d", "d2h", "host_update", "disk_read", "disk_write"] {
            m.note(f, "not measured (Machine::measure, or give it)");
        }
        m.note("model_flops", "not known: a run measures its compute");
        m
    }
}

/// Budgets given by the caller; those left `None` the plan chooses.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Budgets {
    /// The Device tier.
    pub device: Option<u64>,
    /// The Pinned tier.
    pub pinned: Option<u64>,
}

/// Bytes of one group by tier (Device, Pinned, Mapped, Disk).
type ByTier = [u64; 4];

/// A memory plan for [`Trainer`](super::Trainer) on a given machine: the store's budgets, where
/// each group of the run's state lands (in the order the trainer makes it, as the store places
/// it), the bytes a step moves, and the step's floor ([`Floor`]): `max(compute + the CPU
/// optimizer's part that cannot overlap it, PCIe bytes / bandwidth, CPU optimizer time, disk
/// time)`. Made before anything is allocated, so a run that cannot fit is refused rather than
/// left to thrash.
///
/// ```
/// use strata::candle::train::TrainPlan;
/// use strata::candle::{LlamaConfig, TrainConfig};
/// use strata::Machine;
///
/// let c = LlamaConfig::from_file("examples/configs/llama2-7b.json").unwrap();
/// let t = TrainConfig { micro_batch: 1, seq: 2048, accum: 32, ..TrainConfig::default() };
/// let plan = TrainPlan::new(&c, &t, strata::DType::BF16, &Machine::h100(), Default::default()).unwrap();
/// // The weights, gradients and optimizer state in pinned memory, the checkpoints past it on
/// // the device, nothing on disk.
/// assert_eq!(plan.on_disk(), 0);
/// // A host of 32 GiB cannot hold the weights and gradients: refused, saying why.
/// let small = Machine { host_bytes: Some(32 << 30), ..Machine::h100() };
/// assert!(TrainPlan::new(&c, &t, strata::DType::BF16, &small, Default::default()).is_err());
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct TrainPlan {
    machine: Machine,
    /// The store's budgets: Device, Pinned, Mapped, Disk.
    pub budgets: [u64; 4],
    /// Bytes of each group ([`Group::ALL`]'s order) by tier.
    pub placed: [ByTier; 5],
    /// candle's own device memory for a step (outside the store), estimated.
    pub working_set: u64,
    /// Host memory kept out of the Pinned tier for the system and the process.
    pub host_reserve: u64,
    /// Bytes a step moves host to device and device to host.
    pub pcie: (u64, u64),
    /// Bytes a step reads and writes on disk.
    pub disk_io: u64,
    /// Bytes of the CPU optimizer's traffic a step (0 for the GPU engines).
    pub optimizer_bytes: u64,
    /// A step's FLOPs, counted each way.
    pub flops: crate::candle::StepFlops,
    /// How the CPU optimizer's updates overlap the compute.
    pub overlap: Overlap,
}

/// What the trainer makes, in order, for the placement: `(group, bytes, where it may go)`.
#[derive(Clone, Copy, PartialEq)]
enum Home {
    /// Pinned, else the error (weights and gradients must be in host memory).
    PinnedOnly,
    /// Pinned, else Disk (the Cpu and GpuResident engines' state).
    PinnedThenDisk,
    /// Mapped only (the GpuMapped engine's state).
    Mapped,
}

/// The element counts of what trains in a run of `config` with `train`: every parameter no
/// frozen pattern names, or with LoRA the adapters alone (A `[r, in]` and B `[out, r]` of each
/// targeted 2-D weight of a block, matched as the trainer matches them,
/// [`LoraConfig::targets_linear`](crate::candle::lora::LoraConfig::targets_linear) on the full
/// name). A product that overflows is [`TrainError::Invalid`] naming the rank.
pub(super) fn trainable_sizes(
    config: &LlamaConfig,
    train: &TrainConfig,
) -> candle_core::Result<Vec<u64>> {
    let numel = |s: &[usize]| s.iter().try_fold(1u64, |a, &d| a.checked_mul(d as u64));
    let overflow = |what: String| TrainError::Invalid(what).into_candle();
    let tensors = config.tensors();
    match &train.lora {
        None => tensors
            .iter()
            .filter(|(n, _)| !train.is_frozen(n))
            .map(|(n, s)| {
                numel(s).ok_or_else(|| overflow(format!("{n} {s:?}: its size overflows")))
            })
            .collect(),
        Some(l) => {
            l.validate()?;
            let mut out = Vec::new();
            for (n, s) in &tensors {
                if !(s.len() == 2 && n.contains(".layers.") && l.targets_linear(n)) {
                    continue;
                }
                for dim in [s[1], s[0]] {
                    let elems = (l.rank as u64).checked_mul(dim as u64).ok_or_else(|| {
                        overflow(format!(
                            "LoRA rank {}: the adapter of {n} ({} × {dim}) overflows u64: a rank \
                             at most the weight's sides ({} and {}) is useful",
                            l.rank, l.rank, s[0], s[1]
                        ))
                    })?;
                    out.push(elems);
                }
            }
            Ok(out)
        }
    }
}

/// Parameters a run of `config` with `train` trains: every parameter no frozen pattern names,
/// or with LoRA the adapters' (counted as the trainer makes them: fully qualified targets such
/// as `self_attn.q_proj` count as `q_proj` does). What a front end prints as "trainable
/// parameters"; sizes that overflow are [`TrainError::Invalid`].
///
/// ```
/// use strata::candle::train::trainable_parameters;
/// use strata::candle::{LlamaConfig, TrainConfig};
/// use strata::candle::lora::LoraConfig;
/// let c = LlamaConfig::from_json(
///     r#"{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
///         "num_attention_heads": 4, "vocab_size": 97}"#,
/// )?;
/// let mut t = TrainConfig::default();
/// t.lora = Some(LoraConfig::new(4, 8.0, &["q_proj"]));
/// let short = trainable_parameters(&c, &t)?;
/// t.lora = Some(LoraConfig::new(4, 8.0, &["self_attn.q_proj"]));
/// assert_eq!(trainable_parameters(&c, &t)?, short);
/// assert!(short > 0);
/// t.lora = Some(LoraConfig::new(1 << 62, 8.0, &["q_proj"]));
/// assert!(trainable_parameters(&c, &t).is_err());
/// # Ok::<(), candle_core::Error>(())
/// ```
pub fn trainable_parameters(config: &LlamaConfig, train: &TrainConfig) -> candle_core::Result<u64> {
    trainable_sizes(config, train)?.iter().try_fold(0u64, |a, &n| a.checked_add(n)).ok_or_else(
        || TrainError::Invalid("the trainable parameters overflow u64".into()).into_candle(),
    )
}

impl TrainPlan {
    /// The plan for training a model of `config` with `train` and `dtype` weights on `machine`,
    /// with the budgets `given` (the others chosen). Errors ([`TrainError::Invalid`]) say what
    /// cannot fit and what to change: a Device tier smaller than one block's weights (every
    /// block read from host memory at every pass); with a GPU engine, one that cannot hold the
    /// streaming stages beside the largest tensor's update (its buffers on the device: a
    /// conservative bound, the worst case of a stage in use and the next in flight, with the
    /// least that satisfies it named); the weights and gradients past the Pinned tier, what
    /// spills past the free disk; a memory the machine does not know (its host memory, free
    /// disk, and device memory where no Device budget is given). (A tensor larger than the
    /// Device tier, such as a large embedding table, is read from host memory: slower, not
    /// refused.)
    pub fn new(
        config: &LlamaConfig,
        train: &TrainConfig,
        dtype: DType,
        machine: &Machine,
        given: Budgets,
    ) -> candle_core::Result<TrainPlan> {
        let elem = dtype.size_of() as u64;
        let dense = |_: &str, s: &[usize]| s.iter().product::<usize>() as u64 * elem;
        Self::with_weight_bytes(config, train, dtype, machine, given, &dense)
    }

    /// [`TrainPlan::new`] for weights stored in other sizes than `dtype`'s: `stored(name,
    /// shape)` is the bytes of the model's tensor `name` in the store (a GGUF base's
    /// block-quantized weights: their blocks' bytes). The Device tier, the host memory and the
    /// step's traffic are sized by them; candle's working set by `dtype`, which the weights are
    /// dequantized to where a stage fetches them.
    pub fn with_weight_bytes(
        config: &LlamaConfig,
        train: &TrainConfig,
        dtype: DType,
        machine: &Machine,
        given: Budgets,
        stored: &dyn Fn(&str, &[usize]) -> u64,
    ) -> candle_core::Result<TrainPlan> {
        let refuse = |why: String| TrainError::Invalid(why).into_candle();
        let elem = dtype.size_of() as u64;
        let (mb, seq, accum) = (train.micro_batch as u64, train.seq as u64, train.accum as u64);
        let (h, v) = (config.hidden_size as u64, config.vocab_size as u64);
        let (layers, inter) = (config.num_hidden_layers as u64, config.intermediate_size as u64);
        // The largest products below, checked once: past them plain arithmetic cannot overflow.
        let widths = [12, 6, 4]
            .iter()
            .zip([h, inter, v])
            .try_fold(0u64, |a, (k, x)| x.checked_mul(*k).and_then(|x| a.checked_add(x)));
        let heads = config.num_attention_heads as u64;
        // cuDNN's deterministic attention backward (the blocks' attention on CUDA in bf16 or
        // f16, `fused::block_attention`) takes a dP workspace of a micro-batch's heads × queries
        // × keys, each rounded up to 64, in 2-byte elements: 256 MiB at a 7B's 32 heads and seq
        // 2048 (1 GiB at 4096). Counted wherever it may run: CUDA, 16-bit weights.
        let seq64 = seq.div_ceil(64) * 64;
        let dp_workspace =
            [mb, heads, seq64, seq64, 2].iter().try_fold(1u64, |a, &x| a.checked_mul(x));
        let fits = [mb, seq, accum, layers.max(1), h, 16]
            .iter()
            .try_fold(1u64, |a, &x| a.checked_mul(x))
            .zip(widths.and_then(|w| w.checked_mul(mb)?.checked_mul(seq)?.checked_mul(16)))
            .zip(dp_workspace)
            .is_some();
        if !fits || elem == 0 {
            return Err(refuse(format!(
                "a step of {accum} micro-batches of {mb} × {seq} tokens: the sizes' products                  overflow"
            )));
        }
        let tokens_mb = mb * seq;
        let tensors = config.tensors();
        let bytes: Vec<u64> = tensors.iter().map(|(n, s)| stored(n, s)).collect();
        // The largest block's weights as stored, and the largest stage's (a block, or the
        // embedding or the head).
        let mut per_block = vec![0u64; config.num_hidden_layers];
        let mut outside = 0u64;
        for ((name, _), &b) in tensors.iter().zip(&bytes) {
            match super::layer_of(name).and_then(|l| per_block.get_mut(l)) {
                Some(sum) => *sum += b,
                None => outside = outside.max(b),
            }
        }
        let block = per_block.iter().copied().max().unwrap_or(0);
        let stage_max = block.max(outside);
        // A stage as candle holds it: in `dtype`.
        let stage_compute = (config.block_parameters()).max(v * h) * elem;
        let block_ck = accum * tokens_mb * h * elem;
        let checkpoint = tokens_mb * h * elem;

        // candle's working set on the device: a stage's weights twice (fetched, and as Vars),
        // its f32 gradients, every micro-batch's hidden state and its gradient, one block's
        // forward and backward for a micro-batch (fused attention: no seq × seq tensor of
        // candle's; on CUDA in 16 bits cuDNN's backward workspace above), the head's logits
        // and their softmax and gradients, the embedding's f32 gradient.
        let cudnn_workspace =
            if !machine.device_is_host && elem == 2 { dp_workspace.unwrap_or(0) } else { 0 };
        let working_set = 2 * stage_compute
            + stage_compute / elem * 4
            + 2 * accum * tokens_mb * h * elem
            + tokens_mb * (12 * h + 6 * inter) * 4
            + tokens_mb * v * 16
            + v * h * 4
            + cudnn_workspace;
        // The memories the plan is made from; one it needs and the machine lacks is refused.
        let memory = |figure: &'static str, value: Option<u64>, flag: &str| {
            value.ok_or_else(|| {
                refuse(format!(
                    "{}: {figure} is not known{}: set the machine's {figure} (`strata finetune \
                     {flag}`)",
                    machine.name,
                    machine.source(figure).map_or(String::new(), |s| format!(" ({s})"))
                ))
            })
        };
        let host_bytes = memory("host_bytes", machine.host_bytes, "--host-memory")?;
        let disk_bytes = memory("disk_bytes", machine.disk_bytes, "--disk")?;
        let cuda_reserve = if machine.device_is_host { 0 } else { GIB };
        let streaming = 2 * stage_max + 2 * block_ck;
        let params: u64 = bytes.iter().sum();
        let ck_total = layers * block_ck;
        let device_budget = match given.device {
            Some(d) => d,
            None => {
                let device = memory("device_bytes", machine.device_bytes, "--hbm")?;
                let room = device.saturating_sub(working_set + cuda_reserve);
                // No more than the model's weights, its checkpoints and a stage to spare.
                room.min(params + ck_total + stage_max + (64 << 20))
            }
        };
        if device_budget < block {
            return Err(refuse(format!(
                "a Device tier of {} cannot hold one block's weights ({}): every block would be \
                 read from host memory at every pass; give it at least that much ({} holds two \
                 stages and a block's checkpoints, so that the next streams in while one computes)",
                format_size(device_budget),
                format_size(block),
                format_size(streaming)
            )));
        }
        let host_reserve = crate::compute::plan::host_reserve(host_bytes);
        let host_left = host_bytes
            .saturating_sub(host_reserve)
            .saturating_sub(if machine.device_is_host { device_budget + working_set } else { 0 });

        // What the trainer makes, in its order: the weights (moved to Pinned), the optimizer's
        // gradients then its masters and moments, then the activation checkpoints.
        let mut made: Vec<(Group, u64, Home)> = Vec::new();
        for &b in &bytes {
            made.push((Group::Param, b, Home::PinnedOnly));
        }
        let trainable = trainable_sizes(config, train)?;
        let total = trainable.iter().try_fold(0u64, |a, &n| a.checked_add(n));
        if total.and_then(|t| t.checked_mul(16 * 4)).is_none() {
            return Err(refuse(format!(
                "{} trainable tensors whose sizes overflow u64 (a LoRA rank of {}?)",
                trainable.len(),
                train.lora.as_ref().map_or(0, |l| l.rank)
            )));
        }
        for &n in &trainable {
            made.push((Group::Grad, 4 * n, Home::PinnedOnly));
        }
        let state_home = match train.engine {
            Engine::GpuMapped => Home::Mapped,
            _ => Home::PinnedThenDisk,
        };
        // The moments, and a master where the trained weights are not f32 (adapters are).
        let per_state: u64 = if dtype == DType::F32 || train.lora.is_some() { 2 } else { 3 };
        for &n in &trainable {
            for _ in 0..per_state {
                made.push((Group::OptimizerState, 4 * n, state_home));
            }
        }
        let state_bytes: u64 =
            made.iter().filter(|m| m.0 == Group::OptimizerState).map(|m| m.1).sum();
        // The GPU engines update a tensor on the device and hold its buffers there while the
        // stages stream beside it (one in use, the next in flight, a block's checkpoints): a
        // smaller tier runs out of room mid-step. GpuResident brings the weights, the f32
        // gradient and the f32 state (moments, a master for bf16 weights); GpuMapped the
        // weights and the gradient (its state stays in mapped host memory).
        let weight = |n: u64| if train.lora.is_some() { 4 * n } else { elem * n };
        let on_device = match train.engine {
            Engine::GpuResident => {
                Some(("GpuResident", "weights, gradient and optimizer state", per_state))
            }
            Engine::GpuMapped => Some(("GpuMapped", "weights and gradient", 0)),
            _ => None,
        };
        if let Some((engine, what, states)) = on_device {
            let update = trainable.iter().map(|&n| weight(n) + 4 * n + states * 4 * n).max();
            let need = streaming + update.unwrap_or(0);
            if device_budget < need {
                return Err(refuse(format!(
                    "with the {engine} engine a Device tier of {} cannot hold two stages and a \
                     block's checkpoints streaming ({}) beside the largest tensor's update (its \
                     {what} on the device: {}): give it at least {}, or train with the Cpu \
                     engine (updates in host memory)",
                    format_size(device_budget),
                    format_size(streaming),
                    format_size(update.unwrap_or(0)),
                    format_size(need)
                )));
            }
        }
        let mapped = if state_home == Home::Mapped { state_bytes } else { 0 };
        // The Cpu engine's backups for speculative updates (made last, in Pinned only, while
        // there is room): a copy of each trained tensor's f32 master or weights, its bf16 copy
        // beside a master, and its moments, up to the config's budget.
        // (`Optimizer::backup_bytes`: 4 + 8 bytes an element, and the compute copy's beside a
        // master.)
        let backup_per_element = 4 + 8 + if per_state == 3 { elem } else { 0 };
        let all_backups = match train.engine {
            Engine::Cpu => trainable.iter().map(|&n| n * backup_per_element).sum::<u64>(),
            _ => 0,
        };
        let backups = all_backups.min(train.speculation_bytes);
        let pinned_budget = given.pinned.unwrap_or_else(|| {
            let need: u64 = made.iter().filter(|m| m.2 != Home::Mapped).map(|m| m.1).sum();
            host_left.saturating_sub(mapped).min(need + ck_total + backups + (64 << 20))
        });

        let mut placed = [[0u64; 4]; 5];
        let mut used = [0u64; 4];
        let caps = [device_budget.saturating_sub(streaming), pinned_budget, mapped, disk_bytes];
        for &(group, bytes, home) in &made {
            let fits = |t: Tier, used: &[u64; 4]| used[t.index()] + bytes <= caps[t.index()];
            let order: &[Tier] = match home {
                Home::PinnedOnly => &[Tier::Pinned],
                Home::PinnedThenDisk => &[Tier::Pinned, Tier::Disk],
                Home::Mapped => &[Tier::Mapped],
            };
            let Some(&t) = order.iter().find(|&&t| fits(t, &used)) else {
                let what = match group {
                    Group::Param | Group::Grad => format!(
                        "the weights and gradients ({}) do not fit the Pinned tier of {}: they \
                         cross PCIe every step, so they are kept in host memory",
                        format_size(
                            made.iter()
                                .filter(|m| matches!(m.0, Group::Param | Group::Grad))
                                .map(|m| m.1)
                                .sum()
                        ),
                        format_size(pinned_budget)
                    ),
                    _ => format!(
                        "the {} that host memory cannot hold do not fit the {} of free disk",
                        group.name(),
                        format_size(disk_bytes)
                    ),
                };
                return Err(refuse(format!(
                    "{} cannot train on {}: {what} (host memory {}, of which {} is kept for the \
                     system and the process)",
                    config_name(config),
                    machine.name,
                    format_size(host_bytes),
                    format_size(host_reserve)
                )));
            };
            used[t.index()] += bytes;
            placed[group.index()][t.index()] += bytes;
        }
        // Then the activation checkpoints, all of one size: as many as fit in Pinned, then on
        // the device beside the streaming set, then on Disk.
        let mut left = layers * accum;
        for t in [Tier::Pinned, Tier::Device, Tier::Disk] {
            let i = t.index();
            let n = (caps[i].saturating_sub(used[i]) / checkpoint.max(1)).min(left);
            used[i] += n * checkpoint;
            placed[Group::Activation.index()][i] += n * checkpoint;
            left -= n;
        }
        if left > 0 {
            return Err(refuse(format!(
                "{} cannot train on {}: {} of activation checkpoints do not fit in memory beside                  the rest, nor on the {} of free disk: lower the micro-batches or the sequence",
                config_name(config),
                machine.name,
                format_size(left * checkpoint),
                format_size(disk_bytes)
            )));
        }

        // A step's traffic: each block's weights cross twice (the forward, then the recompute
        // and backward), the head's once (its forward and backward at once); of the embedding
        // table only the rows the step's inputs pick, at most the table (a tied table also
        // crosses whole as the head); checkpoints homed in host memory go out in the forward
        // and back in the backward; the gradients go out once (the Cpu engine reads them in
        // host memory; a tied table's head share waits in candle's memory for the embedding's
        // rows, the working set's f32 embedding gradient); the GpuResident engine brings its
        // state in and out.
        let ck = &placed[Group::Activation.index()];
        let ck_host = ck[Tier::Pinned.index()] + ck[Tier::Disk.index()];
        let grads: u64 = placed[Group::Grad.index()].iter().sum();
        let embedding = tensors
            .iter()
            .zip(&bytes)
            .find(|((n, _), _)| n == crate::candle::llama_config::EMBED)
            .map_or(0, |(_, &b)| b);
        // (a quantized table's rows cross dequantized, f32; at most the table as stored)
        let row = if embedding < v * h * 2 { h * 4 } else { embedding / v.max(1) };
        let rows = (accum * tokens_mb * row).min(embedding);
        let blocks: u64 = per_block.iter().sum();
        let head =
            params - blocks - embedding + if config.tie_word_embeddings { embedding } else { 0 };
        let weights = 2 * blocks + head + rows;
        let (mut h2d, mut d2h) = (weights + ck_host, grads + ck_host);
        if train.engine == Engine::GpuResident {
            h2d += state_bytes + grads;
            d2h += state_bytes;
        }
        let st = &placed[Group::OptimizerState.index()];
        let disk_io = 2 * (st[Tier::Disk.index()] + ck[Tier::Disk.index()]);
        let alg = Algorithm::AdamW(AdamW::default());
        let optimizer_bytes = match train.engine {
            Engine::Cpu => trainable
                .iter()
                .map(|&n| {
                    update_bytes(
                        &alg,
                        n,
                        if train.lora.is_some() { DType::F32 } else { dtype },
                        DType::F32,
                    )
                })
                .sum(),
            _ => 0,
        };
        let flops = config.step_flops(accum * tokens_mb, train.seq, train.lora.is_some());
        let mut overlap = Overlap::of(config, train);
        // Every stage's update starts during the backward when all the backups fit beside the
        // rest in Pinned, leaving the room the trainer leaves (while the steps do not clip).
        let pinned = caps[Tier::Pinned.index()];
        let pinned_left = pinned.saturating_sub(used[Tier::Pinned.index()]);
        overlap.during_backward = all_backups > 0
            && backups == all_backups
            && backups.saturating_add(backup_spare(pinned)) <= pinned_left;
        let mut budgets = [device_budget, pinned_budget, mapped, 0];
        budgets[Tier::Disk.index()] = used[Tier::Disk.index()];
        Ok(TrainPlan {
            machine: machine.clone(),
            budgets,
            placed,
            working_set,
            host_reserve,
            pcie: (h2d, d2h),
            disk_io,
            optimizer_bytes,
            flops,
            overlap,
        })
    }

    /// Bytes the plan puts on disk.
    pub fn on_disk(&self) -> u64 {
        self.placed.iter().map(|g| g[Tier::Disk.index()]).sum()
    }

    /// The step's floor from `m`'s figures (the plan's machine, or the same one with measured
    /// rates), and what bounds it: seconds of compute (`compute`, measured, or the machine's
    /// `model_flops`), PCIe, the CPU optimizer (with the state it reads from disk) and the
    /// checkpoints' disk I/O; a part whose rate the machine does not know is `None`.
    pub fn floor(&self, m: &Machine, compute: Option<f64>) -> Floor {
        let compute = compute.or_else(|| m.model_flops.map(|f| self.flops.with_attention / f));
        let st_disk = self.placed[Group::OptimizerState.index()][Tier::Disk.index()];
        let optimizer = Machine::seconds(self.optimizer_bytes, m.host_update)
            .zip(disk_both_ways(m, st_disk, st_disk))
            .map(|(a, b)| a + b);
        let ck = self.disk_io.saturating_sub(2 * st_disk) / 2;
        Floor {
            compute,
            pcie: pcie_seconds(m, self.pcie.0, self.pcie.1),
            optimizer,
            optimizer_exposed: compute.zip(optimizer).map(|(c, o)| self.overlap.exposed(c, o)),
            during_backward: self.overlap.during_backward,
            disk: disk_both_ways(m, ck, ck),
        }
    }
}

/// The room the speculative updates' backups leave free in a Pinned tier of `capacity` bytes: a
/// sixteenth of it, 64 MiB at most (the plan's spare room: the store moves tensors through it
/// during the steps).
pub(super) fn backup_spare(capacity: u64) -> u64 {
    (capacity / 16).min(64 << 20)
}

/// How a step's CPU optimizer overlaps its compute, for the floor ([`Overlap::exposed`]): the
/// step's stages in the forward's order (the embedding, the blocks, the head), each with its
/// shares of the forward's and the backward's compute (FLOPs, the recomputed forward in the
/// backward's) and of the optimizer's work (its trainable parameters), and when the updates
/// start.
#[derive(Clone, Debug, PartialEq)]
pub struct Overlap {
    forward: Vec<f64>,
    backward: Vec<f64>,
    update: Vec<f64>,
    /// The updates start during the backward (a stage's as soon as its gradient is final),
    /// else after it (behind the next step's forward).
    pub during_backward: bool,
}

impl Overlap {
    /// The stages of a run of `config` with `train`, the updates after the backward (set
    /// [`Overlap::during_backward`] for a trainer that starts them during it).
    pub fn of(config: &LlamaConfig, train: &TrainConfig) -> Overlap {
        let (l, h, v) = (config.num_hidden_layers, config.hidden_size, config.vocab_size);
        let frozen = train.lora.is_some();
        let block = config.block_parameters() as f64;
        let head = (v * h) as f64;
        let attn = 4.0 * (config.num_attention_heads * config.head_dim * train.seq) as f64;
        let dw = if frozen { 0.0 } else { 2.0 };
        // Per token: a block's forward, and its backward with the recomputed forward.
        let (bf, bb) = (2.0 * block + attn, (2.0 * block + attn) + (2.0 + dw) * block + 2.0 * attn);
        let mut forward = vec![0.0];
        let mut backward = vec![0.0];
        forward.extend(std::iter::repeat_n(bf, l));
        backward.extend(std::iter::repeat_n(bb, l));
        forward.push(2.0 * head);
        backward.push((2.0 + dw) * head);
        // The updates' work: each stage's trainable parameters (a LoRA run's adapters spread
        // evenly over the blocks); a tied head's is the embedding's.
        let trained = |n: &str| !frozen && !train.is_frozen(n);
        let mut update = vec![0.0; l + 2];
        for (n, shape) in config.tensors() {
            let numel = shape.iter().product::<usize>() as f64;
            let stage = if n == crate::candle::llama_config::EMBED {
                0
            } else if let Some(b) = (0..l).find(|&b| n.starts_with(&LlamaConfig::block_prefix(b))) {
                b + 1
            } else {
                l + 1
            };
            if trained(&n) {
                update[stage] += numel;
            }
        }
        if frozen && l > 0 {
            let adapters = trainable_parameters(config, train).unwrap_or(0) as f64;
            for u in &mut update[1..=l] {
                *u = adapters / l as f64;
            }
        }
        let norm = |v: &mut Vec<f64>| {
            let sum: f64 = v.iter().sum();
            if sum > 0.0 {
                v.iter_mut().for_each(|x| *x /= sum);
            }
        };
        let (mut fb_total, mut update) = (forward.iter().sum::<f64>(), update);
        fb_total += backward.iter().sum::<f64>();
        if fb_total > 0.0 {
            forward.iter_mut().chain(backward.iter_mut()).for_each(|x| *x /= fb_total);
        }
        norm(&mut update);
        Overlap { forward, backward, update, during_backward: false }
    }

    /// Seconds a step of `compute` seconds (forward and backward) waits for a CPU optimizer
    /// whose updates take `optimizer` seconds, one at a time in the order they are queued: the
    /// part of the optimizer that cannot overlap the compute. After the backward, every update
    /// is queued in the forward's order and the next forward waits for each stage's; during
    /// the backward, a stage's update is queued as its backward ends (the head's first, the
    /// embedding's last), so only what is left when the backward ends can delay the next
    /// forward.
    ///
    /// ```
    /// use strata::candle::train::Overlap;
    /// use strata::candle::{LlamaConfig, TrainConfig};
    /// let c = LlamaConfig::from_file("examples/configs/llama2-7b.json").unwrap();
    /// let t = TrainConfig { seq: 2048, ..TrainConfig::default() };
    /// let after = Overlap::of(&c, &t);
    /// let mut during = after.clone();
    /// during.during_backward = true;
    /// // A 7 s step, a 4 s CPU AdamW: behind the forward alone (a quarter of the compute with
    /// // the recompute), about 2.3 s of it waits; during the backward, only the last block's
    /// // update and the embedding's, queued as the backward ends.
    /// assert!((after.exposed(7.0, 4.0) - 2.3).abs() < 0.2);
    /// assert!(during.exposed(7.0, 4.0) < 0.3);
    /// ```
    pub fn exposed(&self, compute: f64, optimizer: f64) -> f64 {
        let n = self.forward.len();
        if optimizer <= 0.0 || n == 0 {
            return 0.0;
        }
        let f: Vec<f64> = self.forward.iter().map(|x| x * compute).collect();
        let u: Vec<f64> = self.update.iter().map(|x| x * optimizer).collect();
        let backward: f64 = self.backward.iter().sum::<f64>() * compute;
        let mut done = vec![0.0; n];
        let mut free = 0.0f64;
        if self.during_backward {
            let mut t = 0.0;
            for i in (0..n).rev() {
                t += self.backward[i] * compute;
                free = free.max(t) + u[i];
                done[i] = free;
            }
        } else {
            free = backward;
            for i in 0..n {
                free += u[i];
                done[i] = free;
            }
        }
        let mut t = backward;
        for i in 0..n {
            t = t.max(done[i]) + f[i];
        }
        (t - backward - f.iter().sum::<f64>()).max(0.0)
    }
}

/// Seconds of `h2d` and `d2h` bytes over `m`'s link, the busier direction.
fn pcie_seconds(m: &Machine, h2d: u64, d2h: u64) -> Option<f64> {
    Some(Machine::seconds(h2d, m.h2d)?.max(Machine::seconds(d2h, m.d2h)?))
}

/// Seconds of reading `read` and writing `write` bytes on `m`'s disk, one after the other.
fn disk_both_ways(m: &Machine, read: u64, write: u64) -> Option<f64> {
    Some(Machine::seconds(read, m.disk_read)? + Machine::seconds(write, m.disk_write)?)
}

/// A step's floor, in seconds, by what bounds it; `None` where a part's rate is not known. The
/// floor is `max(compute + optimizer_exposed, PCIe, optimizer, disk)`: the CPU optimizer runs
/// beside the compute, but the part of it the compute cannot hide ([`Overlap::exposed`]) adds
/// to it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Floor {
    /// Candle's compute (`None` where neither measured nor given a rate).
    pub compute: Option<f64>,
    /// The PCIe bytes over the link's rate, the busier direction.
    pub pcie: Option<f64>,
    /// The CPU optimizer: its traffic over the host's rate, plus the state it reads from and
    /// writes to disk.
    pub optimizer: Option<f64>,
    /// The part of `optimizer` the compute cannot hide, by the step's schedule
    /// ([`Overlap::exposed`]): added to the compute.
    pub optimizer_exposed: Option<f64>,
    /// Whether the schedule starts the updates during the backward (else after it).
    pub during_backward: bool,
    /// The checkpoints' disk I/O.
    pub disk: Option<f64>,
}

impl Floor {
    /// The floor of a step that ran: its compute as measured
    /// ([`StepReport::compute_seconds`](super::StepReport::compute_seconds)), the bytes it moved
    /// between the Device tier and the others over `machine`'s PCIe rates, the optimizer's run
    /// time in the step (the Cpu engine's,
    /// [`StepReport::optimizer_seconds`](super::StepReport::optimizer_seconds); the GPU engines'
    /// runs on the device, inside the compute) and the part of it `overlap` says the compute
    /// cannot hide, and what it read from and wrote to Disk over the disk's rates.
    pub fn measured(
        r: &super::StepReport,
        machine: &Machine,
        cpu_optimizer: bool,
        overlap: &Overlap,
    ) -> Floor {
        let (d, k) = (Tier::Device.index(), Tier::Disk.index());
        let (mut h2d, mut d2h, mut read, mut write) = (0u64, 0u64, 0u64, 0u64);
        for t in Tier::ALL {
            let i = t.index();
            if i != d {
                h2d += r.moved[i][d];
                d2h += r.moved[d][i];
            }
            if i != k {
                write += r.moved[i][k];
                read += r.moved[k][i];
            }
        }
        let optimizer = if cpu_optimizer { r.optimizer_seconds } else { 0.0 };
        Floor {
            compute: Some(r.compute_seconds),
            pcie: pcie_seconds(machine, h2d, d2h),
            optimizer: Some(optimizer),
            optimizer_exposed: Some(overlap.exposed(r.compute_seconds, optimizer)),
            during_backward: overlap.during_backward,
            disk: disk_both_ways(machine, read, write),
        }
    }

    /// The compute and the optimizer's part it cannot hide (`None` where the compute is not
    /// known).
    fn compute_path(&self) -> Option<f64> {
        self.compute.map(|c| c + self.optimizer_exposed.unwrap_or(0.0))
    }

    /// The floor: the largest of the parts known (0 where none is).
    pub fn seconds(&self) -> f64 {
        [self.compute_path(), self.pcie, self.optimizer, self.disk]
            .into_iter()
            .flatten()
            .fold(0.0, f64::max)
    }

    /// What bounds the step: `compute`, `compute and the CPU optimizer's exposed part` (where
    /// that part is more than 1% of the compute), `PCIe`, `the CPU optimizer` or `disk` (of the
    /// parts known), or `no part known` where some are not known and those known take no time.
    pub fn bound(&self) -> &'static str {
        let parts = [self.compute_path(), self.pcie, self.optimizer, self.disk];
        if parts.iter().any(Option::is_none) && parts.iter().flatten().all(|&x| x == 0.0) {
            // Nothing known takes any time: no part bounds the step.
            return "no part known";
        }
        let s = Some(self.seconds());
        if self.compute_path() == s {
            let (c, e) = (self.compute.unwrap_or(0.0), self.optimizer_exposed.unwrap_or(0.0));
            if e > 0.01 * c {
                "compute and the CPU optimizer's exposed part"
            } else {
                "compute"
            }
        } else if self.pcie == s {
            "PCIe"
        } else if self.optimizer == s {
            "the CPU optimizer"
        } else {
            "disk"
        }
    }
}

impl fmt::Display for Floor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let part = |x: Option<f64>| {
            x.map_or("not known, left out".into(), |x| format!("{:.1} ms", x * 1e3))
        };
        let when = if self.during_backward { "during the backward" } else { "after the backward" };
        let optimizer = match (self.optimizer, self.optimizer_exposed) {
            (None, _) => part(None),
            (Some(o), Some(x)) => format!(
                "{:.1} ms of which {:.1} ms cannot hide behind the compute (updates {when})",
                o * 1e3,
                x * 1e3
            ),
            (Some(o), None) => format!(
                "{:.1} ms, the part that cannot hide behind the compute not known (updates \
                 {when})",
                o * 1e3
            ),
        };
        write!(
            f,
            "floor {:.1} ms, bound by {} (compute {}, CPU optimizer {optimizer}, PCIe {}, disk {})",
            self.seconds() * 1e3,
            self.bound(),
            part(self.compute),
            part(self.pcie),
            part(self.disk)
        )
    }
}

fn config_name(c: &LlamaConfig) -> String {
    format!(
        "a model of {:.2} B parameters ({} blocks of hidden {})",
        c.parameters() as f64 / 1e9,
        c.num_hidden_layers,
        c.hidden_size
    )
}

impl fmt::Display for TrainPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "memory plan on {}:", self.machine.name)?;
        writeln!(
            f,
            "{:<12}{:>14}{:>14}{:>14}{:>14}",
            "group", "device", "pinned", "mapped", "disk"
        )?;
        for g in Group::ALL {
            let row = self.placed[g.index()];
            if row.iter().all(|&b| b == 0) {
                continue;
            }
            let r: Vec<String> = row.iter().map(|&b| format_size(b)).collect();
            writeln!(f, "{:<12}{:>14}{:>14}{:>14}{:>14}", g.name(), r[0], r[1], r[2], r[3])?;
        }
        let b: Vec<String> = self.budgets.iter().map(|&b| format_size(b)).collect();
        writeln!(f, "{:<12}{:>14}{:>14}{:>14}{:>14}", "budget", b[0], b[1], b[2], b[3])?;
        writeln!(
            f,
            "device: candle's working set about {} beside the Device tier; host: {} kept for the \
             system and the process",
            format_size(self.working_set),
            format_size(self.host_reserve)
        )?;
        let disk = self.on_disk();
        if disk == 0 {
            writeln!(f, "disk: nothing (everything fits in memory)")?;
        } else {
            writeln!(
                f,
                "disk: {} that memory cannot hold, {} of disk I/O a step",
                format_size(disk),
                format_size(self.disk_io)
            )?;
        }
        write!(
            f,
            "per step: PCIe {} in, {} out; CPU optimizer {} of host traffic; {:.3e} model FLOP \
             with attention ({:.3e} as 6 × parameters × tokens, MegaTrain's count; {:.3e} \
             executed with the recomputed forward)",
            format_size(self.pcie.0),
            format_size(self.pcie.1),
            format_size(self.optimizer_bytes),
            self.flops.with_attention,
            self.flops.parameter_count,
            self.flops.executed
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> LlamaConfig {
        LlamaConfig::from_file("examples/configs/tiny-llama.json").unwrap()
    }

    /// A host of 16 GiB whose device is its memory (CPU candle), as `detect` makes it.
    fn host_machine() -> Machine {
        Machine {
            device_bytes: Some(16 << 30),
            device_is_host: true,
            host_bytes: Some(16 << 30),
            model_flops: None,
            ..Machine::h100()
        }
    }

    fn budgets(device: u64) -> Budgets {
        Budgets { device: Some(device), ..Budgets::default() }
    }

    /// The GpuResident engine brings each tensor's update to the device beside the streaming
    /// stages: a Device tier without room for both is refused up front, naming the least that
    /// works (found on the host backend: 300 KiB failed mid-step with `out of memory in tier
    /// device`, 340 KiB once at the end of a run), where the Cpu engine trains in it.
    #[test]
    fn a_device_tier_too_small_for_a_resident_update_is_refused_naming_the_least() {
        let c = tiny();
        let t = TrainConfig { micro_batch: 1, seq: 32, accum: 1, ..TrainConfig::default() };
        let m = host_machine();
        let resident = TrainConfig { engine: Engine::GpuResident, ..t.clone() };
        let e = TrainPlan::new(&c, &resident, DType::F32, &m, budgets(300 << 10))
            .unwrap_err()
            .to_string();
        assert!(e.contains("the largest tensor's update"), "{e}");
        // The embedding, 256 x 64 f32: weights, gradient and two moments.
        assert!(e.contains("(its weights, gradient and optimizer state on the device: 256.00 KiB)"));
        let least = e.split("give it at least ").nth(1).unwrap().split(',').next().unwrap();
        let least = crate::parse_size(least).unwrap();
        assert!(TrainPlan::new(&c, &resident, DType::F32, &m, budgets(least)).is_ok());
        assert!(TrainPlan::new(&c, &resident, DType::F32, &m, budgets(least - 1)).is_err());
        assert!(TrainPlan::new(&c, &t, DType::F32, &m, budgets(300 << 10)).is_ok());
        // GpuMapped: the weights and gradient only (150 KiB failed mid-step at step 4).
        let mapped = TrainConfig { engine: Engine::GpuMapped, ..t.clone() };
        let e = TrainPlan::new(&c, &mapped, DType::F32, &m, budgets(150 << 10))
            .unwrap_err()
            .to_string();
        assert!(e.contains("(its weights and gradient on the device: 128.00 KiB)"), "{e}");
    }

    /// On CUDA in 16 bits candle's working set holds cuDNN's deterministic attention backward's
    /// dP workspace (a micro-batch's heads × queries × keys, each rounded up to 64, 2 bytes);
    /// in f32 or on the host it does not.
    #[test]
    fn the_working_set_holds_cudnns_attention_workspace_on_cuda_in_16_bits() {
        let c = tiny();
        let t = TrainConfig { micro_batch: 2, seq: 100, accum: 1, ..TrainConfig::default() };
        let ws = |dtype, m: &Machine| {
            TrainPlan::new(&c, &t, dtype, m, Budgets::default()).unwrap().working_set
        };
        let dp = 2 * c.num_attention_heads as u64 * 128 * 128 * 2;
        let (gpu, host) = (Machine::h100(), host_machine());
        let f32_on_gpu = ws(DType::F32, &gpu);
        let bf16_on_gpu = ws(DType::BF16, &gpu);
        let bf16_on_host = ws(DType::BF16, &host);
        // The same run on a GPU and on the host: the workspace is all that differs.
        assert_eq!(bf16_on_gpu - bf16_on_host, dp);
        assert!(f32_on_gpu > 0 && ws(DType::F32, &host) == f32_on_gpu);
    }

    /// `strata inspect --train`'s plan (`strata::plan`) keeps the optimizer state where this
    /// plan does: given the budgets this plan chooses, all of it in the Pinned tier in both.
    /// (That plan used to fill the Device tier's room with it first, then the Mapped tier's,
    /// and so showed state on the device or on disk that the trainer keeps in host memory.)
    #[test]
    fn the_inspect_plan_keeps_the_optimizer_state_where_the_trainer_does() {
        use crate::compute::plan::{plan, OptimizerStep, PlanConfig, TensorEntry};
        let c = tiny();
        let t = TrainConfig { micro_batch: 1, seq: 32, accum: 1, ..TrainConfig::default() };
        for dtype in [DType::F32, DType::BF16] {
            let trainer =
                TrainPlan::new(&c, &t, dtype, &host_machine(), Budgets::default()).unwrap();
            let tensors: Vec<TensorEntry> =
                c.tensors().into_iter().map(|(n, s)| TensorEntry::new(n, dtype, s)).collect();
            let cfg = PlanConfig {
                budgets: trainer.budgets,
                optimizer: OptimizerStep::Optim(Algorithm::AdamW(AdamW::default())),
                train: true,
                fp32_grads: true,
            };
            let inspect = plan(&tensors, &cfg);
            let state = trainer.placed[Group::OptimizerState.index()];
            assert!(state[Tier::Pinned.index()] > 0 && state.iter().sum::<u64>() == state[1]);
            assert_eq!(inspect.optimizer_state().tiers, state, "{dtype}:\n{inspect}\n{trainer}");
            assert_eq!(inspect.unplaced(), 0);
        }
    }

    /// A quantized base (a GGUF file's weights, a quarter of their f32 bytes here) is planned
    /// by its stored bytes: a Device tier smaller than an f32 block but as large as a stored one
    /// is taken, and a step's PCIe traffic is the stored bytes' (blocks twice, the head once;
    /// the embedding's rows the step picks cross dequantized).
    #[test]
    fn a_quantized_base_is_planned_by_its_stored_bytes() {
        let c = tiny();
        let lora = crate::candle::lora::LoraConfig::new(4, 8.0, &["q_proj", "v_proj"]);
        let t = TrainConfig {
            micro_batch: 1,
            seq: 32,
            accum: 1,
            lora: Some(lora),
            ..TrainConfig::default()
        };
        let m = host_machine();
        let f32_block = c.block_parameters() * 4;
        let quarter = |_: &str, s: &[usize]| s.iter().product::<usize>() as u64;
        let small = budgets(f32_block / 2);
        let e = TrainPlan::new(&c, &t, DType::F32, &m, small).unwrap_err().to_string();
        assert!(e.contains("cannot hold one block's weights"), "{e}");
        let q = TrainPlan::with_weight_bytes(&c, &t, DType::F32, &m, small, &quarter).unwrap();
        let f = TrainPlan::new(&c, &t, DType::F32, &m, budgets(f32_block * 4)).unwrap();
        let weights = |p: &TrainPlan| p.placed[Group::Param.index()].iter().sum::<u64>();
        assert_eq!(weights(&f), 4 * weights(&q));
        // Each block crosses twice and the head once, at a quarter of its f32 bytes; the
        // embedding as the rows the step's 32 inputs pick, dequantized (f32) either way.
        let (h, v) = (c.hidden_size as u64, c.vocab_size as u64);
        let blocks = c.block_parameters() * 4 * c.num_hidden_layers as u64;
        let table = v * h * 4;
        let head = weights(&f) - blocks - if c.tie_word_embeddings { 0 } else { table };
        let scaled = 2 * blocks + head;
        assert_eq!(f.pcie.0 - q.pcie.0, scaled - scaled / 4);
    }

    /// The floor adds the optimizer's part the schedule cannot hide: none when the optimizer
    /// is short, the excess over the forward when it runs after the backward, about one stage's
    /// update when it runs during the backward; a LoRA run's updates are its adapters', in the
    /// blocks.
    #[test]
    fn the_floor_adds_the_optimizer_part_that_cannot_overlap() {
        let c = tiny();
        let t = TrainConfig { seq: 32, ..TrainConfig::default() };
        let after = Overlap::of(&c, &t);
        assert!(!after.during_backward);
        let mut during = after.clone();
        during.during_backward = true;
        assert_eq!(after.exposed(1.0, 0.0), 0.0);
        // A short optimizer hides during the backward; after it, only behind the forward.
        assert!(during.exposed(1.0, 0.05) < 0.05 / 2.0, "{}", during.exposed(1.0, 0.05));
        let forward: f64 = after.forward.iter().sum();
        assert!((0.15..0.35).contains(&forward), "{forward}");
        let long = after.exposed(1.0, 2.0);
        assert!((long - (2.0 - forward)).abs() < 0.1, "{long} against {}", 2.0 - forward);
        assert!(during.exposed(1.0, 2.0) < long);
        let floor = Floor {
            compute: Some(1.0),
            pcie: Some(0.5),
            optimizer: Some(2.0),
            optimizer_exposed: Some(long),
            during_backward: false,
            disk: None,
        };
        assert_eq!(floor.seconds(), 1.0 + long);
        assert_eq!(floor.bound(), "compute and the CPU optimizer's exposed part");
        // LoRA: the adapters are in the blocks, the embedding and head frozen.
        let lora = TrainConfig {
            lora: Some(crate::candle::lora::LoraConfig::new(4, 8.0, &["q_proj"])),
            ..t
        };
        let o = Overlap::of(&c, &lora);
        assert_eq!((o.update[0], o.update[o.update.len() - 1]), (0.0, 0.0));
        assert!((o.update.iter().sum::<f64>() - 1.0).abs() < 1e-9);
    }

    /// Odd runs and machines: one block, one micro-batch, no speculation or all of it, LoRA on
    /// one block, no free disk. Each plan's floor is finite, its exposed optimizer part within
    /// the optimizer's time (all of it with no compute to hide behind); a machine whose rates
    /// are not known has no part bounding its floor (it said `disk`, whose 0 bytes took 0 s);
    /// an unknown disk is refused saying which flag gives it.
    #[test]
    fn odd_runs_and_machines_give_sane_floors() {
        let one = LlamaConfig::from_json(
            r#"{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
                "num_attention_heads": 4, "vocab_size": 97}"#,
        )
        .unwrap();
        let t = TrainConfig { micro_batch: 1, seq: 16, accum: 1, ..TrainConfig::default() };
        let lora = TrainConfig {
            lora: Some(crate::candle::lora::LoraConfig::new(2, 4.0, &["q_proj"])),
            ..t.clone()
        };
        let m = Machine { disk_bytes: Some(0), ..host_machine() };
        for (what, train) in [
            ("one block, one micro-batch", t.clone()),
            ("no speculation", TrainConfig { speculation_bytes: 0, ..t.clone() }),
            ("a budget of one byte", TrainConfig { speculation_bytes: 1, ..t.clone() }),
            ("LoRA on one block", lora),
        ] {
            let plan = TrainPlan::new(&one, &train, DType::F32, &m, Budgets::default()).unwrap();
            assert_eq!(plan.on_disk(), 0, "{what}: no free disk, nothing on it");
            assert_eq!(plan.overlap.during_backward, train.speculation_bytes > 1, "{what}");
            for compute in [0.0, 1e-3, 1.0] {
                let f = plan.floor(&m, Some(compute));
                let (o, e) = (f.optimizer.unwrap(), f.optimizer_exposed.unwrap());
                assert!(f.seconds().is_finite() && f.seconds() > 0.0, "{what}: {f}");
                assert!((0.0..=o * (1.0 + 1e-9)).contains(&e), "{what}, compute {compute}: {f}");
                if compute == 0.0 {
                    assert!((e - o).abs() <= 1e-12 * o, "{what}: {f}");
                }
            }
        }
        let plan = TrainPlan::new(&one, &t, DType::F32, &m, Budgets::default()).unwrap();
        let unknown = Machine {
            h2d: None,
            d2h: None,
            host_update: None,
            disk_read: None,
            disk_write: None,
            model_flops: None,
            ..m.clone()
        };
        let f = plan.floor(&unknown, None);
        assert_eq!((f.seconds(), f.bound()), (0.0, "no part known"), "{f}");
        let e = TrainPlan::new(
            &one,
            &t,
            DType::F32,
            &Machine { disk_bytes: None, ..m },
            Budgets::default(),
        );
        assert!(e.unwrap_err().to_string().contains("--disk"));
    }

    /// The bytes a backup of one trained element takes, as the optimizer makes it
    /// ([`Optimizer::backup_bytes`](crate::optim::Optimizer::backup_bytes)) for a parameter
    /// of `dtype`.
    fn backup_bytes_per_element(dtype: DType) -> u64 {
        use crate::compute::optim::{Optimizer, OptimizerConfig};
        let s = std::sync::Arc::new(crate::Store::builder().host_backend().build().unwrap());
        let w = s.put(&format!("w.{dtype}"), dtype, &[10], &vec![0u8; 10 * dtype.size_of()]);
        let w = w.unwrap();
        let cfg = OptimizerConfig::new(Algorithm::AdamW(AdamW::default()), Engine::Cpu);
        let opt = Optimizer::new(s.clone(), &s.stream().unwrap(), &[w], cfg).unwrap();
        opt.backup_bytes(w).unwrap() / 10
    }

    /// The default Pinned tier makes room for every backup the trainer makes for speculative
    /// updates: a copy of the f32 master or weights, the 16-bit copy beside a master, and both
    /// moments (12 bytes an f32 parameter or a LoRA adapter, 14 a bf16 one). (It counted 8 for
    /// the f32 ones: a run with a Pinned tier of 1 GiB or more, whose backups must leave 64
    /// MiB of it free, had no room for the last stage's, and the plan said every update
    /// started during the backward.)
    #[test]
    fn the_pinned_tier_has_room_for_every_backup_the_optimizer_makes() {
        let c = tiny();
        let t = TrainConfig { micro_batch: 1, seq: 32, accum: 1, ..TrainConfig::default() };
        let lora = TrainConfig {
            lora: Some(crate::candle::lora::LoraConfig::new(4, 8.0, &["q_proj"])),
            ..t.clone()
        };
        for (train, dtype, param) in [
            (&t, DType::F32, DType::F32),
            (&t, DType::BF16, DType::BF16),
            // Adapters are f32 over any base.
            (&lora, DType::F32, DType::F32),
            (&lora, DType::BF16, DType::F32),
        ] {
            let plan = |bytes: u64| {
                let tc = TrainConfig { speculation_bytes: bytes, ..train.clone() };
                TrainPlan::new(&c, &tc, dtype, &host_machine(), Budgets::default()).unwrap()
            };
            let (all, none) = (plan(u64::MAX), plan(0));
            let n = trainable_parameters(&c, train).unwrap();
            let room = all.budgets[Tier::Pinned.index()] - none.budgets[Tier::Pinned.index()];
            let what = format!("{dtype}, LoRA {}", train.lora.is_some());
            assert_eq!(room, n * backup_bytes_per_element(param), "{what}");
            assert!(all.overlap.during_backward && !none.overlap.during_backward, "{what}");
        }
    }
}
