//! The out-of-core trainer ([`Trainer`]): its construction, a step stage by stage (forward,
//! head, backward from a checkpoint per block with each stage's update started speculatively as
//! its gradients are final, the rest behind the next forward), and what it reports
//! ([`StepReport`]). The module docs of [`train`](super) walk through a step.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType as CDType, Device, Tensor, Var};

use super::clock::{span_seconds, ComputeClock};
use super::grads::{
    add_grad, check_applied, clip_factor, embedding_backward, grad_of, linear_buffers,
    loss_and_norm, staged_from, sum_of_squares, with_buffers,
};
use super::{
    block_weights, candle_to_store, check_batches, checkpoint, compute_dtype, init_values,
    layer_of, prepare_masks, put_checkpoint, put_host, read_f32, run_params, strata_err, Init,
    LlamaConfig, LoraConfig, TrainConfig, TrainError,
};
use crate::base::types::{DType, Group, TensorId, Tier};
use crate::candle::block::{model_tensors, Block, LlamaBlock, Weights};
use crate::candle::llama::{
    embed, head_logits, inputs_and_targets, next_token_loss_masked, EMBED, LM_HEAD, NORM,
};
use crate::candle::lora::{adapter_specs, AdapterSpec};
use crate::candle::Layers;
use crate::compute::optim::{AdamW, Algorithm, Engine, Optimizer, OptimizerConfig};
use crate::Store;

/// What one training step did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepReport {
    /// The step (0-based).
    pub step: u64,
    /// The mean next-token cross-entropy over the step's tokens (the micro-batches' losses
    /// added in f32).
    pub loss: f32,
    /// The learning rate the step's update used.
    pub lr: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    /// The factor the gradients were multiplied by (1 unless clipped).
    pub clip_scale: f32,
    /// Tokens trained on (inputs).
    pub tokens: u64,
    /// Wall-clock seconds of the step.
    pub seconds: f64,
    /// Seconds candle computed during the step (its blocks, head and embedding, forward,
    /// recompute and backward, with the gradients' in-place sums): on the CPU the host time of
    /// those calls, on CUDA the time between events on candle's stream around them. The step's
    /// compute floor: what it would take with no copy, stall or optimizer wait.
    pub compute_seconds: f64,
    /// Host seconds of a block's micro-batch: the time on the step's thread inside the calls
    /// of the blocks' forward, recompute and backward, over blocks × micro-batches. On CUDA the
    /// host's work to issue a block's kernels (launches, and any wait a call makes): what bounds
    /// the step once the kernels are faster than it (the target: ≤ 1 ms at the 7B shape). On the
    /// CPU, where candle computes as it is called, the block's compute itself.
    pub block_host_seconds: f64,
    /// Bytes moved between the store's tiers during the step, `moved[from][to]` by
    /// [`Tier::index`].
    pub moved: [[u64; 4]; 4],
    /// Seconds consumers waited for the store's copies during the step ([`crate::Stats`]).
    pub stall_seconds: f64,
    /// Seconds the optimizer's updates ran within the step's window (from the step's start to
    /// its end, on the step's clock): the Cpu engine's jobs (the last step's updates, which run
    /// behind this step's forward), the GPU engines' time to issue theirs.
    pub optimizer_seconds: f64,
    /// Seconds of the step spent waiting for the optimizer or running it on the step's thread
    /// (the GPU engines): the step's critical path with these spans less the path without them.
    pub optimizer_exposed_seconds: f64,
    /// Seconds the optimizer ran within the step's window while the step was not waiting for
    /// it: `optimizer_seconds` less the optimizer's run time inside the exposed spans. On one
    /// clock with the others, so hidden + (run time while waited for) = `optimizer_seconds`.
    pub optimizer_hidden_seconds: f64,
    /// Seconds the optimizer ran during the step's backward (from the head's hand-over to the
    /// read of the gradient norm): its speculative updates, hidden behind the blocks' backward
    /// (a part of `optimizer_hidden_seconds`).
    pub optimizer_backward_seconds: f64,
    /// Stages whose updates started during the backward, speculatively, as soon as their
    /// gradients were final ([`TrainConfig::speculation_bytes`]).
    pub speculated: usize,
    /// Of those, the stages undone from their backups because the gradient norm said to clip
    /// (their updates then queued again, clipped) or was not finite (dropped); the rest were
    /// committed as they ran.
    pub undone: usize,
    /// The step's loss or gradient norm was not finite and [`TrainConfig::skip_nonfinite`]
    /// skipped it: no parameter or moment changed.
    pub skipped: bool,
    /// An update of the step failed when it was queued (a fault): the step is done, and the
    /// next [`Trainer::step`], [`Trainer::finish`] or [`Trainer::save`] does that update
    /// again (and returns the error if it fails again). The error, as it read.
    pub update_error: Option<String>,
}

/// A parameter of the model, where it is and who updates it.
#[derive(Clone, Debug)]
pub(super) struct Param {
    pub(super) name: String,
    pub(super) id: TensorId,
    /// The stage whose update writes it (embedding 0, block `l` at `l + 1`, head last).
    pub(super) stage: usize,
    pub(super) trainable: bool,
}

/// Trains a Llama-style decoder out of core: parameters, gradients, fp32 masters, AdamW moments
/// and activation checkpoints all in a strata store, one stage's weights on the device at a
/// time (see the [module docs](super)).
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use candle_core::{Device, Tensor};
/// use strata as st;
/// use st::candle::{put_random_weights, LlamaConfig, TrainConfig, Trainer};
///
/// let config = LlamaConfig::from_json(r#"{"hidden_size": 32, "intermediate_size": 64,
///     "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 50}"#)?;
/// let device = Device::Cpu;
/// // A Device tier smaller than one block's weights and the next.
/// let store = st::candle::store_for(&device,
///     st::Store::builder().capacity(st::Tier::Device, 64 << 10).prefetch_budget(64 << 10))?;
/// let weights = put_random_weights(&store, &config, 1, st::DType::F32)?;
/// let train = TrainConfig { micro_batch: 2, seq: 8, accum: 2, ..TrainConfig::default() };
/// let mut trainer = Trainer::new(store, &device, config, train, weights)?;
/// let tokens = Tensor::new(&[[1u32, 2, 3, 4, 5, 6, 7, 8, 9]; 2], &device)?;
/// let report = trainer.step(&[tokens.clone(), tokens])?;
/// assert!(report.loss > 3.0 && report.loss < 5.0); // about ln(50) at random init
/// # Ok(()) }
/// ```
pub struct Trainer {
    pub(super) config: LlamaConfig,
    pub(super) train: TrainConfig,
    pub(super) store: Arc<Store>,
    pub(super) layers: Layers,
    /// The blocks' code, and their tensors (names within a block).
    pub(super) block: Arc<dyn Block>,
    block_tensors: Vec<(String, Vec<usize>)>,
    /// The LoRA adapters (none without LoRA).
    pub(super) specs: Vec<AdapterSpec>,
    /// Each stage's parameters' names (a block's: its tensors, then its adapters).
    stages: Vec<Vec<String>>,
    /// A LoRA run's frozen base: the crc32 of its values (computed once; its checkpoints
    /// record it, and a resume checks it).
    pub(super) base_crc: Option<u32>,
    pub(super) dtype: CDType,
    pub(super) params: Vec<Param>,
    /// The trainable parameters' ids, for the optimizer (`None` when all are frozen).
    pub(super) opt: Option<Optimizer>,
    /// Activation checkpoints: `[block][micro-batch]` names.
    checkpoints: Vec<Vec<String>>,
    /// Steps done: the next step's number.
    pub(super) step: u64,
    /// Steps skipped for a non-finite loss or gradient ([`TrainConfig::skip_nonfinite`]).
    pub(super) skipped: u64,
    /// The run's identity, carried by every file of its checkpoints.
    pub(super) run: u64,
    /// The updates of the last step, until `Optimizer::finish` ended them (or this step's
    /// speculative ones, until the gradient norm says whether they stand).
    updates: Option<Updates>,
    /// By stage: the optimizer keeps backups for its parameters, so its update may start
    /// during the backward ([`TrainConfig::speculation_bytes`]).
    speculative: Vec<bool>,
    /// The last finite step was clipped: the next one probably is too, so it does not
    /// speculate (the work would be undone).
    clipped_last: bool,
    /// The spans the current step waited for the optimizer (or ran it, the GPU engines).
    waits: Vec<(Instant, Instant)>,
    /// A resume that failed after it began writing the trainer's tensors: steps and saves are
    /// refused until a resume succeeds.
    pub(super) torn: Option<PathBuf>,
    /// The caller's notes on the run, kept in its checkpoints.
    pub(super) notes: BTreeMap<String, String>,
}

/// A step's updates not yet ended: queued behind the next step's forward, failed (to be done
/// again), or not all queued; or, during the backward, its speculative updates.
#[derive(Debug)]
struct Updates {
    /// The gradients' clipping factor: what a retried update is scaled by.
    scale: f32,
    /// The stage of each update queued, in order (the forward waits for a stage's).
    stages: Vec<usize>,
    /// Queued before the gradient norm was known, not yet committed: undone unless the norm
    /// is finite and clips nothing.
    speculative: bool,
}

/// What [`Trainer::report`] makes a [`StepReport`] of.
struct Reported<'a> {
    t0: Instant,
    stats0: &'a crate::Stats,
    loss: f32,
    lr: f64,
    grad_norm: f64,
    clip: f32,
    compute: f64,
    /// Host seconds of a block's micro-batch.
    block_host: f64,
    skipped: bool,
    /// The backward's window, for the optimizer's time within it.
    backward: (Instant, Instant),
    speculated: usize,
    undone: usize,
}

/// A new run's identity: 64 random bits (the standard library's per-process random hash keys,
/// over the time and the process id).
pub(super) fn new_run_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    h.write_u128(now.map_or(0, |d| d.as_nanos()));
    h.write_u32(std::process::id());
    h.finish()
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("layers", &self.config.num_hidden_layers)
            .field("hidden", &self.config.hidden_size)
            .field("step", &self.step)
            .finish()
    }
}

/// Stages: 0 the embedding, `1..=layers` the blocks, `layers + 1` the head.
fn block_stage(l: usize) -> usize {
    l + 1
}

/// Makes the optimizer's backups for the stages whose updates may start during the backward:
/// from the head down (the order in which their gradients are final), while `budget` bytes and
/// the Pinned tier's room last (the Cpu engine only), leaving the tier a sixteenth of its
/// budget free, 64 MiB at most (the memory plan's spare room: the store moves tensors through
/// it during the steps). Returns, by stage (of `stages`), whether it has them.
fn reserve_backups(
    store: &Store,
    opt: Option<&mut Optimizer>,
    params: &[Param],
    stages: usize,
    budget: u64,
) -> candle_core::Result<Vec<bool>> {
    let mut backed = vec![false; stages];
    let Some(opt) = opt.filter(|o| o.engine() == Engine::Cpu) else { return Ok(backed) };
    let mut left = budget;
    for stage in (0..stages).rev() {
        let ps: Vec<&Param> = params.iter().filter(|p| p.stage == stage && p.trainable).collect();
        if ps.is_empty() {
            continue;
        }
        let mut bytes = 0u64;
        for p in &ps {
            bytes =
                bytes.saturating_add(opt.backup_bytes(p.id).map_err(|e| strata_err(&p.name, e))?);
        }
        let stats = store.stats();
        let capacity = stats.capacity(Tier::Pinned);
        let taken = stats.used(Tier::Pinned) + stats.tiers[Tier::Pinned.index()].write_reserve;
        let spare = super::plan::backup_spare(capacity);
        if bytes > left || bytes.saturating_add(spare) > capacity.saturating_sub(taken) {
            break;
        }
        let mut made = Vec::with_capacity(ps.len());
        for p in &ps {
            match opt.reserve_backup(p.id) {
                Ok(true) => made.push(p),
                Ok(false) => break,
                Err(e) => return Err(strata_err(&p.name, e)),
            }
        }
        if made.len() < ps.len() {
            // No room for the whole stage: what it took goes back to the Pinned tier.
            for p in made {
                opt.remove_backup(p.id).map_err(|e| strata_err(&p.name, e))?;
            }
            break;
        }
        left -= bytes;
        backed[stage] = true;
    }
    Ok(backed)
}

impl Trainer {
    /// A trainer for a model of `config` whose parameters are the store tensors `weights` (Hugging
    /// Face's names: [`load_weights`](crate::candle::load_weights) or
    /// [`put_random_weights`](crate::candle::put_random_weights) make them), on candle device
    /// `device` (the store must go with it: [`store_for`](crate::candle::store_for)). Moves the
    /// parameters to host memory (Pinned, where there is room), creates the optimizer's state for
    /// the trainable ones (gradients in f32) and the activation checkpoints; with
    /// [`TrainConfig::lora`], the adapters (f32, `A` as PEFT initialises it, `B` zero) and their
    /// state, the model's own parameters all frozen.
    pub fn new(
        store: Arc<Store>,
        device: &Device,
        config: LlamaConfig,
        train: TrainConfig,
        weights: Vec<(String, TensorId)>,
    ) -> candle_core::Result<Trainer> {
        // Tables for the sequence (a seq past the model's positions is refused by validate).
        let positions = train.seq.min(config.max_position_embeddings);
        let block = Arc::new(LlamaBlock::new(&config, positions, device)?);
        Self::with_block(store, device, config, block, train, weights)
    }

    /// [`Trainer::new`] for a model whose blocks are `block`, a [`Block`] of your own
    /// (`config` then gives the skeleton around them: the vocabulary, the width, the number of
    /// blocks, the final RMSNorm's epsilon, tied embeddings, the positions; the model's
    /// tensors are [`model_tensors`]). The [`block`](crate::candle::block) module has an example.
    pub fn with_block(
        store: Arc<Store>,
        device: &Device,
        config: LlamaConfig,
        block: Arc<dyn Block>,
        train: TrainConfig,
        weights: Vec<(String, TensorId)>,
    ) -> candle_core::Result<Trainer> {
        let by_name: HashMap<String, TensorId> = weights.into_iter().collect();
        let layers_n = config.num_hidden_layers;
        let base = model_tensors(&config, block.as_ref());
        // Every weight checked, and the config with them, before anything moves or is made.
        let mut infos = Vec::new();
        let mut dtype = None;
        for (name, shape) in base.iter().cloned() {
            let id = *by_name
                .get(&name)
                .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.clone() }.bt())?;
            let info = store.info(id).map_err(|e| strata_err(&name, e))?;
            if info.shape != shape {
                candle_core::bail!("{name} has shape {:?}, the config says {shape:?}", info.shape);
            }
            // A block-quantized weight (a GGUF base) is frozen: it is dequantized to f32
            // where a stage fetches it, and never written.
            let d = match info.dtype {
                q if q.is_quantized() && train.is_trained(&name) => {
                    return Err(TrainError::Invalid(format!(
                        "{name} is {q}: a quantized weight is not trained; train LoRA \
                         adapters over it (TrainConfig::lora, --lora-rank R) or freeze it"
                    ))
                    .into_candle())
                }
                q if q.is_quantized() => CDType::F32,
                d => compute_dtype(d)?,
            };
            if *dtype.get_or_insert(d) != d {
                candle_core::bail!("{name} is {:?}: every parameter must have one dtype", d);
            }
            infos.push((name, id, info));
        }
        let dtype = dtype.unwrap_or(CDType::F32);
        let sd = if dtype == CDType::BF16 { DType::BF16 } else { DType::F32 };
        train.validate(&config, sd, device)?;
        let specs = match &train.lora {
            Some(l) => adapter_specs(&config, block.as_ref(), l)?,
            None => Vec::new(),
        };
        // The adapters, f32 in host memory, placed among the parameters after their block's.
        let mut infos: HashMap<String, (TensorId, crate::TensorInfo)> =
            infos.into_iter().map(|(n, id, info)| (n, (id, info))).collect();
        let mut ordered = Vec::new();
        let mut made: Vec<TensorId> = Vec::new();
        for (name, shape, init) in run_params(&base, &specs) {
            if init == Init::Given {
                let (id, info) = infos.remove(&name).expect("checked above");
                ordered.push((name, id, info));
                continue;
            }
            let values = init_values(init, &shape, train.lora.as_ref());
            let bytes = bytemuck::cast_slice::<f32, u8>(&values);
            let made_id = put_host(&store, &name, Group::Param, DType::F32, &shape, bytes);
            let id = match made_id {
                Ok(id) => id,
                Err(e) => {
                    for id in made {
                        let _ = store.remove(id);
                    }
                    return Err(strata_err(&name, e));
                }
            };
            made.push(id);
            let info = store.info(id).map_err(|e| strata_err(&name, e))?;
            ordered.push((name, id, info));
        }
        let mut params = Vec::new();
        let mut stages = vec![Vec::new(); layers_n + 2];
        for (name, id, info) in ordered {
            let stage = if name == EMBED {
                0
            } else if name == NORM || name == LM_HEAD {
                layers_n + 1
            } else {
                block_stage(layer_of(&name).unwrap_or(0))
            };
            stages[stage].push(name.clone());
            // Home in host memory: the Cpu engine updates it there, and the device tier only
            // caches what a stage uses.
            if !info.tiers.iter().any(|t| matches!(t, Tier::Pinned | Tier::Mapped)) {
                match store.move_to(id, Tier::Pinned) {
                    Ok(())
                    | Err(
                        crate::Error::OutOfMemory { .. }
                        | crate::Error::TooLarge { .. }
                        | crate::Error::TierDisabled { .. },
                    ) => {}
                    Err(e) => return Err(strata_err(&name, e)),
                }
            }
            store.set_group(id, Group::Param).map_err(|e| strata_err(&name, e))?;
            params.push(Param { trainable: train.is_trained(&name), name, id, stage });
        }

        let names: Vec<(String, TensorId)> =
            params.iter().map(|p| (p.name.clone(), p.id)).collect();
        let mut layers = Layers::new(store.clone(), names, device)?;
        // The optimizer's state first, then the checkpoints: host memory holds the state, which
        // every step reads and writes, before the checkpoints, which can live on the device.
        let trainable: Vec<TensorId> =
            params.iter().filter(|p| p.trainable).map(|p| p.id).collect();
        let mut opt = if trainable.is_empty() {
            None
        } else {
            let alg = Algorithm::AdamW(AdamW { lr: train.schedule.lr(0), ..train.adamw });
            let mut cfg = OptimizerConfig::new(alg, train.engine);
            cfg.threads = train.optimizer_threads;
            cfg.grad_dtype = Some(DType::F32);
            Some(
                Optimizer::new(store.clone(), layers.stream(), &trainable, cfg)
                    .map_err(candle_core::Error::from)?,
            )
        };
        let act = [train.micro_batch, train.seq, config.hidden_size];
        let act_bytes = vec![0u8; act.iter().product::<usize>() * sd.size_of()];
        // Where the host has no room for a checkpoint, the Device tier takes it while it keeps
        // room for two stages' weights and a block's checkpoints (what a step streams).
        let stage = config.block_parameters().max((config.vocab_size * config.hidden_size) as u64);
        let keep = 2 * (stage * sd.size_of() as u64 + (act_bytes.len() * train.accum) as u64);
        let mut checkpoints = Vec::with_capacity(layers_n);
        for l in 0..layers_n {
            let mut per = Vec::with_capacity(train.accum);
            for m in 0..train.accum {
                let name = format!("checkpoint.layers.{l}.micro_batch.{m}");
                let id = put_checkpoint(&store, &name, sd, &act, &act_bytes, keep)
                    .map_err(|e| strata_err(&name, e))?;
                layers.serve(name.clone(), id);
                per.push(name);
            }
            checkpoints.push(per);
        }
        let block_tensors = block.tensors();
        let speculative =
            reserve_backups(&store, opt.as_mut(), &params, layers_n + 2, train.speculation_bytes)?;
        Ok(Trainer {
            config,
            train,
            store,
            layers,
            block,
            block_tensors,
            specs,
            stages,
            base_crc: None,
            dtype,
            params,
            opt,
            checkpoints,
            step: 0,
            skipped: 0,
            run: new_run_id(),
            updates: None,
            speculative,
            clipped_last: false,
            waits: Vec::new(),
            torn: None,
            notes: BTreeMap::new(),
        })
    }

    /// The store.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// The model's config.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The training config.
    pub fn train_config(&self) -> &TrainConfig {
        &self.train
    }

    /// Steps done (the next step's number), skipped ones included.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// Steps skipped because their loss or gradient norm was not finite
    /// ([`TrainConfig::skip_nonfinite`]).
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// The run's identity: random for a new trainer, the checkpoint's after
    /// [`Trainer::resume`]. Every file of its checkpoints carries it.
    pub fn run_id(&self) -> u64 {
        self.run
    }

    /// Sets the caller's notes on the run (what it trains on, for example), kept in every
    /// checkpoint's commit record ([`Checkpoint::notes`](super::Checkpoint::notes)) and set back by
    /// [`Trainer::resume`].
    pub fn set_notes(&mut self, notes: BTreeMap<String, String>) {
        self.notes = notes;
    }

    /// The caller's notes on the run ([`Trainer::set_notes`]).
    pub fn notes(&self) -> &BTreeMap<String, String> {
        &self.notes
    }

    /// The optimizer (`None` when every parameter is frozen): its engine, its state tensors.
    pub fn optimizer(&self) -> Option<&Optimizer> {
        self.opt.as_ref()
    }

    /// Whether every stage with trainable parameters has backups, so that its update can start
    /// during the backward ([`TrainConfig::speculation_bytes`]; a step after a clipped one
    /// does not speculate).
    pub fn speculates_every_stage(&self) -> bool {
        let trained = |s: usize| self.params.iter().any(|p| p.stage == s && p.trainable);
        let stages = self.speculative.len();
        (0..stages).any(trained) && (0..stages).all(|s| !trained(s) || self.speculative[s])
    }

    /// The [`Layers`] the stages are fetched through (its transfers into candle).
    pub fn layers(&self) -> &Layers {
        &self.layers
    }

    /// The parameters, `(name, tensor)`, in the model's order.
    pub fn params(&self) -> Vec<(String, TensorId)> {
        self.params.iter().map(|p| (p.name.clone(), p.id)).collect()
    }

    /// The tensors stage `stage` reads: a block's, its adapters', the head's (the embedding
    /// table's when tied).
    pub(super) fn stage_names(&self, stage: usize) -> Vec<String> {
        match stage {
            s if s <= self.config.num_hidden_layers => self.stages[s].clone(),
            _ => self.config.head_names().iter().map(|s| s.to_string()).collect(),
        }
    }

    /// The block's kind ([`Block::kind`]).
    pub fn block_kind(&self) -> String {
        self.block.kind()
    }

    /// The LoRA adapters (none without [`TrainConfig::lora`]).
    pub fn adapters(&self) -> &[AdapterSpec] {
        &self.specs
    }

    /// Block `l`'s weights for its forward, from `get(name)`.
    pub(super) fn weights_of(
        &self,
        l: usize,
        get: impl Fn(&str) -> Option<Tensor>,
    ) -> candle_core::Result<Weights> {
        let scale = self.train.lora.as_ref().map_or(1.0, LoraConfig::scale);
        block_weights(&self.block_tensors, &self.specs, scale, l, get)
    }

    /// The groups of block `l`'s linears the block joins ([`Block::joined_linears`]), under
    /// their names in the store: what [`Layers::fetch_joined`] stacks.
    fn joined_groups(&self, l: usize) -> Vec<Vec<String>> {
        self.block.joined_linears().iter().map(|g| in_block(l, g)).collect()
    }

    /// Waits until the updates writing what stages `stages` read have run; returns the seconds
    /// waited.
    fn wait_for(&mut self, stages: &[usize]) -> candle_core::Result<f64> {
        let mut writers = Vec::new();
        for &s in stages {
            let names = self.stage_names(s);
            writers.extend(self.params.iter().filter(|p| names.contains(&p.name)).map(|p| p.stage));
        }
        let (Some(opt), Some(u)) = (self.opt.as_mut(), self.updates.as_ref()) else {
            return Ok(0.0);
        };
        let Some(last) = u.stages.iter().rposition(|s| writers.contains(s)) else {
            return Ok(0.0);
        };
        let left = u.stages.len() - (last + 1);
        if opt.pending() <= left {
            return Ok(0.0);
        }
        let t = Instant::now();
        opt.wait_pending(left).map_err(candle_core::Error::from)?;
        let end = Instant::now();
        self.waits.push((t, end));
        Ok((end - t).as_secs_f64())
    }

    /// Ends the last step's updates: waits for those queued, does again those that failed or
    /// were never queued (the optimizer finishes a half-done update's writes instead of
    /// stepping it twice, so the result is a clean step's), and ends the optimizer's step.
    /// Returns the seconds it waited; on an error the updates stay owed, for the next call.
    pub(super) fn settle(&mut self) -> candle_core::Result<f64> {
        if self.updates.as_ref().is_some_and(|u| u.speculative) {
            // A step failed after its speculative updates started, and undoing them failed
            // then: undone now (the step never happened).
            self.undo_speculation()?;
        }
        let Some(scale) = self.updates.as_ref().map(|u| u.scale) else { return Ok(0.0) };
        let t = Instant::now();
        let mut waited = false;
        if let Some(opt) = self.opt.as_mut() {
            waited = opt.pending() > 0 || !opt.unstepped().is_empty();
            // Failures are kept by the optimizer: `unstepped` lists them once nothing is queued.
            let _ = opt.wait_pending(0);
            for id in opt.unstepped() {
                let name = self.params.iter().find(|p| p.id == id).map_or("?", |p| &p.name);
                opt.update_scaled(id, scale).map_err(|e| strata_err(name, e))?;
            }
            opt.finish().map_err(candle_core::Error::from)?;
        }
        self.updates = None;
        if !waited {
            return Ok(0.0);
        }
        let end = Instant::now();
        self.waits.push((t, end));
        Ok((end - t).as_secs_f64())
    }

    /// Waits for every queued update (the last step's, which run behind the next step's
    /// forward) and ends the optimizer's step; returns the seconds waited. (Speculative updates
    /// a failed step could not undo are undone first.) After a failed
    /// step it does the updates left (a fault that has passed); an error leaves them for the
    /// next call. [`Trainer::save`] calls it; call it after the last step before reading the
    /// weights.
    pub fn finish(&mut self) -> candle_core::Result<f64> {
        self.settle()
    }

    /// Queues the updates of the trainable parameters of `stage`, scaled by `scale`.
    fn queue(&mut self, stage: usize, scale: f32) -> candle_core::Result<()> {
        let Some(opt) = self.opt.as_mut() else { return Ok(()) };
        let u = self.updates.get_or_insert_with(|| Updates {
            scale,
            stages: Vec::new(),
            speculative: false,
        });
        for p in self.params.iter().filter(|p| p.stage == stage && p.trainable) {
            opt.update_scaled(p.id, scale).map_err(|e| strata_err(&p.name, e))?;
            u.stages.push(stage);
        }
        Ok(())
    }

    /// Whether this step's updates start during the backward: with backups, and unless the
    /// last step clipped (then this one probably clips too, and the work would be undone).
    fn speculates(&self) -> bool {
        self.speculative.iter().any(|&s| s) && (self.train.clip.is_none() || !self.clipped_last)
    }

    /// Starts the updates of stage `stage` speculatively, its gradients being final (where it
    /// has backups); returns whether it did.
    fn speculate(&mut self, stage: usize) -> candle_core::Result<bool> {
        let Some(opt) = self.opt.as_mut() else { return Ok(false) };
        if !self.speculative.get(stage).copied().unwrap_or(false) {
            return Ok(false);
        }
        let u = self.updates.get_or_insert_with(|| Updates {
            scale: 1.0,
            stages: Vec::new(),
            speculative: true,
        });
        for p in self.params.iter().filter(|p| p.stage == stage && p.trainable) {
            opt.update_speculative(p.id).map_err(|e| strata_err(&p.name, e))?;
            u.stages.push(stage);
        }
        Ok(true)
    }

    /// Undoes this step's speculative updates (waiting for them), leaving every parameter and
    /// moment as before the step; returns the stages undone. On an error they stay to undo, by
    /// the next step, save or finish.
    fn undo_speculation(&mut self) -> candle_core::Result<usize> {
        let Some(u) = self.updates.as_ref().filter(|u| u.speculative) else { return Ok(0) };
        let mut stages = u.stages.clone();
        stages.dedup();
        let t = Instant::now();
        if let Some(opt) = self.opt.as_mut() {
            opt.undo_speculative().map_err(candle_core::Error::from)?;
        }
        self.waits.push((t, Instant::now()));
        self.updates = None;
        Ok(stages.len())
    }

    /// Refuses to go on from a resume that failed half-way.
    pub(super) fn check_whole(&self) -> candle_core::Result<()> {
        match &self.torn {
            None => Ok(()),
            Some(dir) => Err(TrainError::BadCheckpoint {
                path: dir.clone(),
                why: "resuming from it failed after some of the trainer's tensors were written: \
                      resume again (the trainer holds a mix until then)"
                    .into(),
            }
            .into_candle()),
        }
    }

    /// The forward's embedding of each micro-batch's inputs (`io`'s ids; `tokens` the same ids
    /// on the host, as `check_batches` read them, the last of each row a target only). Only the
    /// table's rows the step's inputs pick cross to the device (each once, gathered on the host:
    /// [`Layers::gather_rows`]), and each micro-batch's embedding is candle's `index_select` of
    /// that sub-table with its ids renumbered: the values `index_select` of the whole table
    /// gives. The whole table is fetched instead where the rows would be no fewer bytes than
    /// the table as stored (every row picked; a quantized table's rows are dequantized on the
    /// host, f32, where the table crosses as its blocks), or where a CUDA device holds a valid
    /// copy (copied device to device; one a GPU engine updated there would otherwise be copied
    /// to the host whole first).
    fn embed_inputs(
        &self,
        io: &[(Tensor, Tensor)],
        tokens: &[Vec<u32>],
    ) -> candle_core::Result<Vec<Tensor>> {
        let seq = self.train.seq;
        let inputs = |t: &'_ Vec<u32>| -> Vec<u32> {
            t.chunks(seq + 1).flat_map(|row| row[..seq].iter().copied()).collect()
        };
        let mut rows: Vec<u32> = tokens.iter().flat_map(inputs).collect();
        rows.sort_unstable();
        rows.dedup();
        let id = self
            .layers
            .id(EMBED)
            .ok_or_else(|| candle_core::Error::CannotFindTensor { path: EMBED.to_string() }.bt())?;
        let info = self.store.info(id).map_err(|e| strata_err(EMBED, e))?;
        // The bytes the gathered rows make (a quantized table's dequantized to f32 on the host,
        // where the whole table crosses as its blocks and is dequantized on the device).
        let cols = self.config.hidden_size;
        let row_bytes = if info.dtype.is_quantized() {
            cols * 4
        } else {
            info.dtype.bytes_for(&[cols]).map_err(|e| strata_err(EMBED, e))? as usize
        };
        let on_device = !self.layers.device().is_cpu() && info.tiers.contains(&Tier::Device);
        if on_device || (rows.len() * row_bytes) as u64 >= info.bytes {
            let w = self.layers.fetch(&[EMBED], &[])?;
            let table = w.get(EMBED).expect("fetched");
            return io.iter().map(|(ids, _)| embed(table, ids)).collect();
        }
        let picked: Vec<usize> = rows.iter().map(|&r| r as usize).collect();
        let table = self.layers.gather_rows(EMBED, &picked)?;
        let (mb, dev) = (self.train.micro_batch, self.layers.device());
        tokens
            .iter()
            .map(|t| {
                // Each input's row in the sub-table: its place among the sorted distinct ids.
                let at: Vec<u32> = inputs(t)
                    .iter()
                    .map(|id| rows.binary_search(id).expect("a row of the step") as u32)
                    .collect();
                embed(&table, &Tensor::from_vec(at, (mb, seq), dev)?)
            })
            .collect()
    }

    /// Candle `Var`s of the trainable tensors among `w` but those in `plain` (frozen ones, and
    /// those whose gradient is summed without a `Var`, stay plain tensors). A tensor fetched as
    /// a variable ([`Layers::fetch_vars`]) is taken as it is; another is copied.
    fn as_vars(
        &self,
        w: &HashMap<String, Tensor>,
        names: &[String],
        plain: &[&str],
    ) -> candle_core::Result<HashMap<String, (Tensor, Option<Var>)>> {
        let mut out = HashMap::new();
        for n in names {
            let t = w
                .get(n)
                .ok_or_else(|| candle_core::Error::CannotFindTensor { path: n.clone() }.bt())?;
            let trainable = self.params.iter().any(|p| p.name == *n && p.trainable)
                && !plain.contains(&n.as_str());
            let entry = if trainable {
                let v = Var::from_tensor(t)?;
                (v.as_tensor().clone(), Some(v))
            } else {
                (t.clone(), None)
            };
            out.insert(n.clone(), entry);
        }
        Ok(out)
    }

    /// Writes a parameter's gradient buffer (f32) into the optimizer's gradient tensor.
    fn hand_over(&self, name: &str, grad: &Tensor) -> candle_core::Result<()> {
        let p = self.params.iter().find(|p| p.name == name).expect("a parameter");
        let opt = self.opt.as_ref().expect("trainable parameters have an optimizer");
        let gid = opt.grad(p.id).map_err(|e| strata_err(name, e))?;
        candle_to_store(&self.store, self.layers.stream(), &format!("{name}.grad"), gid, grad)
    }

    /// One training step over `batches`: `accum` micro-batches of `[micro_batch, seq + 1]`
    /// token ids (u32) on the trainer's device. See the [module docs](super).
    ///
    /// A step that fails (an error from the store, the optimizer or candle) leaves the trainer
    /// as it was before it: no parameter or moment has changed, [`Trainer::steps`] is the same,
    /// and calling `step` again with the same batches gives what a clean step gives (bit for
    /// bit on the CPU; updates that had started speculatively are undone from their backups
    /// first). A step is done once its gradients are whole and finite: its updates then stand
    /// (those started during the backward, when the norm clips nothing) or run behind the next
    /// step's forward (the Cpu engine) or as they are queued (the GPU engines), and one that
    /// fails is done again, exactly once, by the next `step`, [`Trainer::finish`] or
    /// [`Trainer::save`] (which return its error while it keeps failing;
    /// [`StepReport::update_error`] tells of one that failed as it was queued). A loss or
    /// gradient norm that is not finite fails the step with [`TrainError::NonFinite`] with
    /// nothing updated (or skips it: [`TrainConfig::skip_nonfinite`]).
    pub fn step(&mut self, batches: &[Tensor]) -> candle_core::Result<StepReport> {
        self.step_masked(batches, None)
    }

    /// [`Trainer::step`] with the loss on some targets only: `masks` has one `[micro_batch,
    /// seq]` tensor a micro-batch, 1 where the target (the next token) counts and 0 where it
    /// does not (a prompt, for instruction data whose loss is on the responses). The loss is
    /// the mean over the step's counted targets; a step with none is refused.
    pub fn step_masked(
        &mut self,
        batches: &[Tensor],
        masks: Option<&[Tensor]>,
    ) -> candle_core::Result<StepReport> {
        let r = self.run_step(batches, masks);
        if r.is_err() && self.updates.as_ref().is_some_and(|u| u.speculative) {
            // The step failed after some of its updates started: undone, the trainer is as it
            // was before the step.
            if let Err(e) = self.undo_speculation() {
                tracing::warn!(step = self.step, error = %e, "undoing a failed step's speculative updates failed; the next call undoes them");
            }
        }
        r
    }

    fn run_step(
        &mut self,
        batches: &[Tensor],
        masks: Option<&[Tensor]>,
    ) -> candle_core::Result<StepReport> {
        self.check_whole()?;
        let t0 = Instant::now();
        self.waits.clear();
        if self.updates.as_ref().is_some_and(|u| u.speculative) {
            // A failed step's speculative updates, not undone then: undone before a weight is
            // read.
            self.undo_speculation()?;
        }
        if self.updates.is_some() && self.opt.as_ref().is_some_and(|o| !o.unstepped().is_empty()) {
            // The last step's updates failed: done again before a weight is read.
            self.settle()?;
        }
        let stats0 = self.store.stats();
        let (tc, cfg) = (self.train.clone(), self.config.clone());
        let tokens = check_batches(&tc, &cfg, batches)?;
        let masks = masks.map(|m| prepare_masks(&tc, m)).transpose()?;
        let n_layers = cfg.num_hidden_layers;
        let head = n_layers + 1;
        let mut clock = ComputeClock::new(self.layers.device());
        let io: Vec<(Tensor, Tensor)> =
            batches.iter().map(inputs_and_targets).collect::<candle_core::Result<_>>()?;
        let names = |s: &Self, stage: usize| s.stage_names(stage);

        // Forward, stage by stage, every micro-batch through a stage before the next.
        self.wait_for(&[0, 1])?;
        self.layers.prefetch(&refs(&names(self, 1)))?;
        let mut xs = self.embed_inputs(&io, &tokens)?;
        crate::base::failpoint::check(crate::base::failpoint::Site::Compute, Path::new("forward"))?;
        for l in 0..n_layers {
            let stage = block_stage(l);
            self.wait_for(&[stage, stage + 1])?;
            let (this, next) = (names(self, stage), names(self, stage + 1));
            // The joined linears' weights copied into one tensor each as they are fetched
            // (stacked; on the CPU), and staged once for the micro-batches.
            let groups = self.joined_groups(l);
            let w = self.layers.fetch_joined(&refs(&this), &refs(&next), &groups)?;
            let bw = staged_from(
                self.weights_of(l, |n| w.get(n).cloned())?,
                self.block.as_ref(),
                |names| w.joined(&in_block(l, names)).cloned(),
            )?;
            for (m, x) in xs.iter_mut().enumerate() {
                let ck = &self.checkpoints[l][m];
                let id = self.layers.id(ck).expect("checkpoint");
                candle_to_store(&self.store, self.layers.stream(), ck, id, x)?;
                clock.start_block()?;
                *x = self.block.forward(l, &bw, x)?;
                clock.stop()?;
            }
        }

        // The head: forward and backward at once; its losses stay on the device until the
        // step's one sync.
        self.wait_for(&[head])?;
        let head_names: Vec<String> = cfg.head_names().iter().map(|s| s.to_string()).collect();
        let mut next = if n_layers > 0 { names(self, n_layers) } else { Vec::new() };
        if let Some(last) = self.checkpoints.last() {
            next.extend(last.iter().cloned());
        }
        // The trained ones made candle variables as they are copied in (`as_vars` then copies
        // none of them: the tied embedding table is the largest tensor of a small model).
        let trained: Vec<&str> = head_names
            .iter()
            .map(String::as_str)
            .filter(|n| self.params.iter().any(|p| p.name == *n && p.trainable))
            .collect();
        let w = self.layers.fetch_vars(&refs(&head_names), &refs(&next), &trained)?.into_tensors();
        let vars = self.as_vars(&w, &head_names, &[])?;
        drop(w);
        let counted = masks.as_ref().map_or(tc.micro_batch * tc.seq * tc.accum, |m| m.1);
        let scale = 1.0 / counted as f64;
        let mut losses = Vec::with_capacity(tc.accum);
        // One f32 buffer per parameter of the stage, each micro-batch's gradient added in place
        // (a tied embedding's: the head's share, until the embedding's backward adds its rows).
        let mut acc: BTreeMap<String, Option<Tensor>> = BTreeMap::new();
        let mut grads_in: Vec<Tensor> = Vec::with_capacity(tc.accum);
        clock.start()?;
        for (m, x) in xs.drain(..).enumerate() {
            let xv = Var::from_tensor(&x)?;
            let logits =
                head_logits(&cfg, xv.as_tensor(), &vars[NORM].0, &vars[head_names[1].as_str()].0)?;
            let mask = masks.as_ref().map(|ms| &ms.0[m]);
            let l = next_token_loss_masked(&logits, &io[m].1, mask, scale)?;
            let grads = l.backward()?;
            losses.push(l);
            grads_in.push(grad_of(&grads, &xv, "the head's input")?);
            for (name, (_, var)) in &vars {
                if let Some(v) = var {
                    add_grad(acc.entry(name.clone()).or_default(), &grad_of(&grads, v, name)?)?;
                }
            }
        }
        clock.stop()?;
        drop(vars);
        let lr = tc.schedule.lr(self.step);
        let mut ss: BTreeMap<String, Tensor> = BTreeMap::new();
        // This step's gradients overwrite the last step's, which its updates read: those end
        // first.
        self.settle()?;
        if let Some(o) = self.opt.as_mut() {
            o.set_lr(lr);
        }
        // Tied: the head's share of the table's gradient (f32, summed over the micro-batches)
        // kept in candle's memory until the embedding's backward adds its rows, then handed over
        // once (the plan's working set counts it; parked in the store, it crossed out and back).
        let mut head_share = acc.remove(EMBED).flatten();
        let backward0 = Instant::now();
        self.hand_over_all(&mut acc, &mut ss)?;
        // A stage's gradients are final once handed over: its update starts now, speculatively
        // (backed up, undone if the norm says to clip), unless the last step clipped.
        let speculating = self.speculates();
        let mut speculated = 0;
        if speculating {
            speculated += usize::from(self.speculate(head)?);
        }

        // Backward, from the last block down.
        for l in (0..n_layers).rev() {
            let stage = block_stage(l);
            let mut this = names(self, stage);
            let weights_n = this.len();
            this.extend(self.checkpoints[l].iter().cloned());
            let next: Vec<String> = if l > 0 {
                let mut v = names(self, stage - 1);
                v.extend(self.checkpoints[l - 1].iter().cloned());
                v
            } else {
                Vec::new()
            };
            let groups = self.joined_groups(l);
            let mut fetched = self.layers.fetch_joined(&refs(&this), &refs(&next), &groups)?;
            let stacks = fetched.take_joined();
            let w = fetched.into_tensors();
            // The trained linear weights' gradients are summed by the backward itself, into
            // these f32 buffers; the block's other trained tensors are `Var`s.
            let trained = |n: &str| self.params.iter().any(|p| p.name == n && p.trainable);
            let dev = self.layers.device();
            let bufs = linear_buffers(self.block.as_ref(), &self.block_tensors, l, trained, dev)?;
            let plain: Vec<&str> = bufs.iter().map(|g| g.name.as_str()).collect();
            let vars = self.as_vars(&w, &this[..weights_n], &plain)?;
            let bw = self.weights_of(l, |n| vars.get(n).map(|v| v.0.clone()))?;
            let bw = staged_from(with_buffers(bw, &bufs), self.block.as_ref(), |names| {
                let names = in_block(l, names);
                stacks.iter().find(|(g, _)| *g == names).map(|(_, t)| t.clone())
            })?;
            clock.start_block()?;
            for (m, gy) in grads_in.iter_mut().enumerate() {
                let xv = Var::from_tensor(&w[&self.checkpoints[l][m]])?;
                let y = self.block.forward(l, &bw, xv.as_tensor())?;
                let grads = y.mul(gy)?.sum_all()?.backward()?;
                for (name, (_, var)) in &vars {
                    if let Some(v) = var {
                        add_grad(acc.entry(name.clone()).or_default(), &grad_of(&grads, v, name)?)?;
                    }
                }
                *gy = grad_of(&grads, &xv, "a block's input")?;
            }
            clock.stop()?;
            drop((w, vars, bw, stacks));
            check_applied(&bufs, &self.block.kind())?;
            for g in bufs {
                acc.insert(g.name, Some(g.buf.tensor().clone()));
            }
            crate::base::failpoint::check(
                crate::base::failpoint::Site::Compute,
                Path::new("backward"),
            )?;
            self.hand_over_all(&mut acc, &mut ss)?;
            if speculating {
                speculated += usize::from(self.speculate(stage)?);
            }
        }

        // The embedding's backward: the rows each token picked get its gradient (candle's
        // index_select backward), in f32, into one buffer: the head's share when tied.
        if self.params.iter().any(|p| p.name == EMBED && p.trainable) {
            let table = match head_share.take() {
                Some(share) => share,
                None => Tensor::zeros(
                    (cfg.vocab_size, cfg.hidden_size),
                    CDType::F32,
                    self.layers.device(),
                )?,
            };
            clock.start()?;
            let mb: Vec<(&Tensor, &Tensor)> =
                io.iter().map(|(ids, _)| ids).zip(&grads_in).collect();
            embedding_backward(&table, &mb)?;
            clock.stop()?;
            acc.insert(EMBED.to_string(), Some(table));
            self.hand_over_all(&mut acc, &mut ss)?;
            if speculating {
                speculated += usize::from(self.speculate(0)?);
            }
        }
        drop(grads_in);

        // The loss and the global norm (in the model's tensor order): one host sync, before any
        // update; then the updates, in the order the next forward needs them, run behind it.
        let ordered: Vec<(String, Tensor)> = self
            .params
            .iter()
            .filter_map(|p| ss.get(&p.name).map(|t| (p.name.clone(), t.clone())))
            .collect();
        let sums: Vec<Tensor> = ordered.iter().map(|(_, t)| t.clone()).collect();
        let (loss, grad_norm) = loss_and_norm(&losses, &sums)?;
        let backward = (backward0, Instant::now());
        let compute = clock.seconds()?;
        let block_host = clock.block_host_seconds() / (n_layers * tc.accum).max(1) as f64;
        // The speculative updates stand if the norm is finite and clips nothing; else they are
        // undone (waited for, then every state tensor written back from its backup), and the
        // step goes on as if they had never started.
        let clip = clip_factor(grad_norm, tc.clip);
        let finite = loss.is_finite() && grad_norm.is_finite();
        let mut undone = 0;
        if self.updates.as_ref().is_some_and(|u| u.speculative) {
            if finite && clip == 1.0 {
                if let Some(o) = self.opt.as_mut() {
                    o.commit_speculative();
                }
                if let Some(u) = self.updates.as_mut() {
                    u.speculative = false;
                }
            } else {
                undone = self.undo_speculation()?;
            }
        }
        if finite {
            self.clipped_last = clip < 1.0;
        }
        let report = |s: &Self, grad_norm: f64, clip: f32, skipped: bool| {
            s.report(Reported {
                t0,
                stats0: &stats0,
                loss,
                lr,
                grad_norm,
                clip,
                compute,
                block_host,
                skipped,
                backward,
                speculated,
                undone,
            })
        };
        if !loss.is_finite() {
            let r = report(self, grad_norm, 1.0, true);
            return self.diverged("the loss".into(), f64::from(loss), r);
        }
        if !grad_norm.is_finite() {
            let mut first = "?";
            for (name, t) in &ordered {
                if !t.to_scalar::<f32>()?.is_finite() {
                    first = name;
                    break;
                }
            }
            let what = format!("the gradient norm (first at {first})");
            return self.diverged(what, grad_norm, report(self, grad_norm, 1.0, true));
        }
        // From here the step is done: its gradients are whole and finite, and its updates are
        // owed (those that started speculatively, committed, among them). One that fails to be
        // queued (the GPU engines run theirs here) is done again by the next step, finish or
        // save, as one that fails on the optimizer's thread is.
        let u = self.updates.get_or_insert_with(|| Updates {
            scale: clip,
            stages: Vec::new(),
            speculative: false,
        });
        let started: Vec<usize> = u.stages.clone();
        let mut update_error = None;
        let queued = Instant::now();
        for stage in (0..=head).filter(|s| !started.contains(s)) {
            if let Err(e) = self.queue(stage, clip) {
                tracing::warn!(step = self.step, error = %e, "an update failed; it is done again by the next call");
                update_error = Some(e.to_string());
                break;
            }
        }
        if self.opt.as_ref().is_some_and(|o| o.engine() != Engine::Cpu) {
            // The GPU engines run their updates as they are queued, on the step's thread.
            self.waits.push((queued, Instant::now()));
        }
        let mut r = report(self, grad_norm, clip, false);
        r.update_error = update_error;
        self.step += 1;
        Ok(r)
    }

    /// A step whose `what` is `value`, not finite: skipped (counted) when the config says so,
    /// else [`TrainError::NonFinite`]. Nothing of the step is queued (its speculative updates
    /// were undone).
    fn diverged(
        &mut self,
        what: String,
        value: f64,
        report: StepReport,
    ) -> candle_core::Result<StepReport> {
        if !self.train.skip_nonfinite {
            return Err(TrainError::NonFinite { step: self.step, what, value }.into_candle());
        }
        self.step += 1;
        self.skipped += 1;
        Ok(report)
    }

    fn report(&self, r: Reported<'_>) -> StepReport {
        let stats = self.store.stats();
        let mut moved = [[0u64; 4]; 4];
        for (f, row) in moved.iter_mut().enumerate() {
            for (t, v) in row.iter_mut().enumerate() {
                *v = stats.moved[f][t] - r.stats0.moved[f][t];
            }
        }
        let tc = &self.train;
        let t1 = Instant::now();
        // One clock, the step's: the optimizer's run time within the step's window, and within
        // the spans the step waited for it.
        let mut spans = vec![(r.t0, t1)];
        spans.extend(self.waits.iter().copied());
        spans.push(r.backward);
        let busy =
            self.opt.as_ref().map_or_else(|| vec![0.0; spans.len()], |o| o.busy_within(&spans));
        let during_waits = busy[1..busy.len() - 1].iter().fold(0.0, |a, b| a + b);
        StepReport {
            step: self.step,
            loss: r.loss,
            lr: r.lr,
            grad_norm: r.grad_norm,
            clip_scale: r.clip,
            tokens: (tc.micro_batch * tc.seq * tc.accum) as u64,
            seconds: (t1 - r.t0).as_secs_f64(),
            compute_seconds: r.compute,
            block_host_seconds: r.block_host,
            moved,
            stall_seconds: stats.stall_seconds - r.stats0.stall_seconds,
            optimizer_seconds: busy[0],
            optimizer_exposed_seconds: span_seconds(&self.waits),
            optimizer_hidden_seconds: (busy[0] - during_waits).max(0.0),
            optimizer_backward_seconds: busy[busy.len() - 1],
            speculated: r.speculated,
            undone: r.undone,
            skipped: r.skipped,
            update_error: None,
        }
    }

    /// Hands every gradient in `acc` to the store (emptying it), their sums of squares into
    /// `ss`.
    fn hand_over_all(
        &self,
        acc: &mut BTreeMap<String, Option<Tensor>>,
        ss: &mut BTreeMap<String, Tensor>,
    ) -> candle_core::Result<()> {
        for (name, g) in std::mem::take(acc) {
            if let Some(g) = g {
                self.hand_over(&name, &g)?;
                ss.insert(name, sum_of_squares(&g)?);
            }
        }
        Ok(())
    }

    /// Reads a parameter's values (f32), from wherever the store has it.
    pub fn read_param(&self, name: &str) -> candle_core::Result<Vec<f32>> {
        let p =
            self.params.iter().find(|p| p.name == name).ok_or_else(|| {
                candle_core::Error::CannotFindTensor { path: name.to_string() }.bt()
            })?;
        read_f32(&self.store, name, p.id)
    }

    /// Saves the run as a checkpoint in run directory `dir`: `dir/step-NNNNNNNN` (the steps
    /// done), keeping the newest two ([`Trainer::save_keeping`] says how it is written);
    /// returns its path. Ends the last step's updates first (retrying those a fault failed),
    /// so the last complete step can be saved after a failed one.
    pub fn save(&mut self, dir: impl AsRef<Path>) -> candle_core::Result<PathBuf> {
        self.save_keeping(dir, 2)
    }

    /// [`Trainer::save`], keeping the newest `keep` (≥ 1) checkpoints of the run in `dir`
    /// (and none of a later step: a run resumed from an earlier checkpoint replaces them).
    ///
    /// A checkpoint is a Hugging Face checkpoint of the parameters (`model-*.safetensors`, one file
    /// a stage, `model.safetensors.index.json` and `config.json`: loadable by
    /// [`load_weights`](crate::candle::load_weights) and `LlamaForCausalLM.from_pretrained`), the
    /// optimizer's state (`NAME.master` for bf16 parameters, `NAME.exp_avg`, `NAME.exp_avg_sq`:
    /// `optimizer-*.safetensors` and `optimizer.safetensors.index.json`), and its commit record
    /// `checkpoint.json` ([`Checkpoint`](super::Checkpoint)). It is **whole or absent**: written
    /// into a hidden directory, every file flushed and read back (its crc32 recorded; a value that
    /// is not finite refuses the save with [`TrainError::NonFinite`]), the record written last,
    /// then renamed into place; a process killed at any moment leaves the checkpoints before it as
    /// they were (what a dead save left is removed by the next). Every file carries the run's
    /// identity and the step. A directory holding another run's checkpoints is refused
    /// ([`TrainError::Mismatch`]).
    pub fn save_keeping(
        &mut self,
        dir: impl AsRef<Path>,
        keep: usize,
    ) -> candle_core::Result<PathBuf> {
        self.check_whole()?;
        self.settle()?;
        if self.train.lora.is_some() {
            self.base_crc()?;
        }
        checkpoint::save(self, dir.as_ref(), keep)
    }

    /// Continues from a checkpoint [`Trainer::save`] wrote (`path`: the checkpoint, or a run
    /// directory: its newest), so that the next [`Trainer::step`] does what the saved run's next
    /// step would have done (bit for bit on the CPU). Before anything of the trainer is touched,
    /// every file is checked against the commit record
    /// ([`Checkpoint::open`](super::Checkpoint::open); a mismatch is [`TrainError::BadCheckpoint`]
    /// naming the file), each file's identity (run, step) against the record's, the optimizer's
    /// step count against the step, and the checkpoint's own model config, dtype, frozen
    /// parameters, batch, optimizer and schedule against the trainer's ([`TrainError::Mismatch`]
    /// names what differs). The trainer takes the run's identity. A store fault while the tensors
    /// are copied leaves the trainer refusing to step or save until a resume succeeds.
    pub fn resume(&mut self, path: impl AsRef<Path>) -> candle_core::Result<()> {
        self.settle()?;
        checkpoint::resume(self, path.as_ref())
    }
}

pub(super) fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Block `l`'s tensor names as the store serves them (`model.layers.L.` before each).
fn in_block(l: usize, names: &[impl AsRef<str>]) -> Vec<String> {
    let p = LlamaConfig::block_prefix(l);
    names.iter().map(|n| format!("{p}{}", n.as_ref())).collect()
}
