//! Out-of-core training of a Llama-style decoder inside candle: [`Trainer`] runs the model stage
//! by stage with every byte of its state in a strata store, and [`LlamaTwin`] is the same model
//! trained resident on candle's device with candle's plain `backward`, its reference and its
//! baseline; [`TrainPlan`] chooses the store's budgets for a machine.
//!
//! A step of [`Trainer::step`] over `accum` micro-batches, **layer-major** (all micro-batches
//! pass a stage before the next stage's weights are fetched, so each block's weights cross to
//! the device once per forward and once per backward per step):
//!
//! 1. *forward*: the embedding, then each block, its weights fetched through device views
//!    ([`Layers::fetch`], the next stage prefetched), each block's input written to the store
//!    as an activation checkpoint (group `Activation`, homed in host memory);
//! 2. *head*: the final norm, the output projection and the cross-entropy over next tokens,
//!    forward and backward at once (candle's autograd, the head's weights as `Var`s);
//! 3. *backward*, from the last block down: each block recomputed from its checkpoint with its
//!    weights as `Var`s, its weight and input gradients from the backward of
//!    `sum(output · grad_output)`; the weight gradients summed over the micro-batches in place,
//!    one f32 buffer a parameter (a tied table's starting as the head's share), and handed to
//!    the store (group `Grad`), where the optimizer takes them;
//! 4. *update*: [`strata::optim`](crate::compute::optim)'s AdamW (fp32 masters and moments in the store,
//!    group `OptimizerState`; the Cpu engine by default). No update starts before the loss and
//!    the global gradient norm, summed on the device and read in one host sync, are known to be
//!    finite (a step that diverged changes nothing:
//!    [`TrainError::NonFinite`], or a skip); the updates are then queued in the order the next
//!    forward needs them and run while that forward goes on with the stages already updated (a
//!    stage's weights are fetched only after its update has run).
//!
//! Frozen parameters (by name pattern) get no gradient and no state. The learning rate follows
//! [`LrSchedule`] (linear warmup, cosine decay).
//!
//! The blocks are a [`Block`] ([`Trainer::with_block`]: a block of your own; [`LlamaBlock`] by
//! default). With [`TrainConfig::lora`] the model is a frozen base and LoRA adapters are
//! trained over it, saved in PEFT's format ([`Trainer::save_adapter`], and every checkpoint),
//! started from PEFT's ([`Trainer::load_adapter`]) and merged into a plain checkpoint
//! ([`Trainer::save_merged`]). [`Trainer::step_masked`] puts the loss on some targets only.
//!
//! **A run you can trust with days of work.** A step that fails (the store, the optimizer,
//! candle) leaves the trainer as it was, and retrying it gives the clean step; updates that
//! fail are done again exactly once by the next call, and the last complete step can be saved
//! as soon as the fault has passed. Hyperparameters and sizes are checked before anything is allocated
//! ([`TrainConfig::validate`]), token files are bounded ([`load_tokens`]). [`Trainer::save`]
//! writes a checkpoint into a run directory that is whole or absent (a hidden directory
//! renamed into place once every file is written, flushed and read back, its commit record
//! last: [`Checkpoint`]), keeping the newest few; [`Trainer::resume`] checks every file against
//! the record and the checkpoint's own config against the trainer's before it uses any, then
//! continues as if the run had not stopped. `docs/reliability.md` lists each promise and the
//! test that holds it.
//!
//! On candle's CPU device the trainer and [`LlamaTwin`] do the same f32 operations in the same
//! order, so their losses and weights are equal bit for bit (`tests/candle/train.rs`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType as CDType, Device, Tensor, Var};

use super::block::{model_tensors, Adapter, Block, LlamaBlock, Weights};
use super::llama::{
    embed, head_logits, inputs_and_targets, next_token_loss_masked, LlamaConfig, EMBED, LM_HEAD,
    NORM,
};
use super::lora::{adapter_specs, init_a, AdapterSpec, LoraConfig};
use super::{strata_err, Layers};

mod adapters;
mod checkpoint;
mod clock;
mod device_adamw;
mod grads;
mod outputs;
mod plan;
use crate::base::types::{DType, Group, TensorId, Tier};
use crate::compute::optim::{AdamW, Algorithm, Engine, Optimizer, OptimizerConfig};
use crate::{LoadOptions, Store, Stream};
pub use checkpoint::{Checkpoint, CheckpointFile};
use clock::{span_seconds, ComputeClock};
use device_adamw::{DeviceState, Kernels};
use grads::{add_grad, clip_factor, embedding_backward, loss_and_norm, sum_of_squares};
pub use outputs::{check_outputs, checkpoint_bytes, OutputPlan};
pub use plan::{trainable_parameters, Budgets, Floor, TrainPlan};

/// The learning rate of each step: linear warmup from `peak / warmup` to `peak` over the first
/// `warmup` steps, then a cosine from `peak` down to `min` at step `total` (and `min` after).
///
/// ```
/// let s = strata::candle::LrSchedule { peak: 1e-3, min: 1e-4, warmup: 2, total: 10 };
/// assert_eq!(s.lr(0), 5e-4);                   // warming up
/// assert_eq!(s.lr(2), 1e-3);                   // the peak, where the cosine starts
/// assert!((s.lr(10) - 1e-4).abs() < 1e-12);    // the floor
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// The learning rate after warmup.
    pub peak: f64,
    /// The learning rate at the end of the cosine.
    pub min: f64,
    /// Steps of linear warmup.
    pub warmup: u64,
    /// The step at which the cosine reaches `min`.
    pub total: u64,
}

impl LrSchedule {
    /// A constant learning rate.
    pub fn constant(lr: f64) -> LrSchedule {
        LrSchedule { peak: lr, min: lr, warmup: 0, total: 0 }
    }

    /// The learning rate of step `step` (0-based).
    pub fn lr(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup);
        if span == 0 {
            return self.peak;
        }
        let progress = ((step - self.warmup) as f64 / span as f64).min(1.0);
        self.min + 0.5 * (self.peak - self.min) * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}

/// The trainer's own errors. They reach the caller inside a `candle_core::Error` (an
/// `std::io::Error` of kind `Other` carrying this, in `candle_core::Error::Io`):
/// [`TrainError::find`] gets them back, to act on a diverged run or a refused checkpoint.
///
/// ```
/// use strata::candle::train::TrainError;
/// let e = TrainError::NonFinite { step: 3, what: "the loss".into(), value: f64::NAN }.into_candle();
/// assert!(matches!(TrainError::find(&e), Some(TrainError::NonFinite { step: 3, .. })));
/// assert!(e.to_string().starts_with("step 3: the loss is NaN"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// A hyperparameter, size or flag that cannot train: NaN, negative, zero, or a product of
    /// sizes that overflows. The message names it and says what is allowed.
    #[error("{0}")]
    Invalid(String),
    /// A step (or a file) needs more host memory than the machine has available.
    #[error(
        "{what} needs about {} of host memory and {} is available: {hint}",
        crate::format_size(*asked),
        crate::format_size(*available)
    )]
    TooLarge {
        /// What was asked for.
        what: String,
        /// Bytes it needs.
        asked: u64,
        /// Bytes available (`MemAvailable`).
        available: u64,
        /// What to change.
        hint: String,
    },
    /// A step whose loss or gradient norm is not finite: nothing was updated, and the trainer
    /// is still at step `step` (it can be saved). Also a save that found a non-finite value in
    /// the state it would write (nothing is written then).
    #[error(
        "step {step}: {what} is {value}: the run diverged; nothing was updated or written, and \
         the trainer is still at step {step} (save it, or lower the learning rate, clip the \
         gradients, or skip such steps with TrainConfig::skip_nonfinite / --skip-nonfinite)"
    )]
    NonFinite {
        /// The step (0-based) that diverged.
        step: u64,
        /// What was not finite: `the loss`, `the gradient norm (first at NAME)`, ...
        what: String,
        /// Its value.
        value: f64,
    },
    /// A checkpoint that cannot be used as it is: no commit record, a file missing, of another
    /// size or content than the record says, of another run or step. Names the file.
    #[error("checkpoint {}: {why}", path.display())]
    BadCheckpoint {
        /// The file (or directory) at fault.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// A checkpoint of another run than the trainer's: another architecture, dtype, frozen set,
    /// schedule or batch, or a run directory holding another run's checkpoints.
    #[error("{}: the saved run's {what} is {saved}, this one's {here}: {hint}", path.display())]
    Mismatch {
        /// The checkpoint (or run directory).
        path: PathBuf,
        /// What differs.
        what: String,
        /// The checkpoint's value.
        saved: String,
        /// The trainer's.
        here: String,
        /// What to do.
        hint: String,
    },
    /// A token file that cannot be trained on (not a regular file, not whole u32s, too short,
    /// ids past the vocabulary, too large for the host).
    #[error("data {}: {why}", path.display())]
    BadData {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// An output a run would write that it cannot ([`check_outputs`]): a file where a
    /// directory goes, a directory holding another run's checkpoints or other files, one that
    /// cannot be written, a file system without room. Found before the first step.
    #[error("{flag} {}: {why}", path.display())]
    BadOutput {
        /// What names it (`--save`, `--export-merged`, ...).
        flag: String,
        /// The path.
        path: PathBuf,
        /// What is wrong, and what to do.
        why: String,
    },
}

impl TrainError {
    /// This error as a `candle_core::Error` (what the trainer's functions return).
    pub fn into_candle(self) -> candle_core::Error {
        candle_core::Error::Io(std::io::Error::other(self))
    }

    /// The [`TrainError`] inside `e`, if it is one (under any backtrace or context candle
    /// added).
    pub fn find(e: &candle_core::Error) -> Option<&TrainError> {
        super::find_carried(e)
    }
}

fn invalid(why: String) -> candle_core::Error {
    TrainError::Invalid(why).into_candle()
}

/// How [`Trainer`] (and [`LlamaTwin`]) train.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainConfig {
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Tokens per sequence (a micro-batch's tokens are `[micro_batch, seq + 1]`: the inputs and,
    /// shifted by one, the targets).
    pub seq: usize,
    /// Micro-batches per step (gradient accumulation).
    pub accum: usize,
    /// AdamW's hyperparameters (its `lr` is replaced by the schedule's).
    pub adamw: AdamW,
    /// The learning rate by step. Its `total` is the run's horizon: a checkpoint resumes only
    /// on a trainer of the same schedule.
    pub schedule: LrSchedule,
    /// Global gradient-norm clipping (`torch.nn.utils.clip_grad_norm_`'s `max_norm`, finite
    /// and > 0); `None` for none.
    pub clip: Option<f64>,
    /// Where the optimizer runs ([`Engine::Cpu`] by default).
    pub engine: Engine,
    /// Threads of the Cpu engine (0: every core).
    pub optimizer_threads: usize,
    /// Name patterns of frozen parameters (`*` matches any run of characters): no gradient,
    /// no optimizer state, never changed.
    pub frozen: Vec<String>,
    /// A step whose loss or gradient norm is not finite is skipped (no update, counted by
    /// [`Trainer::skipped`] and [`StepReport::skipped`]) instead of failing with
    /// [`TrainError::NonFinite`], as torch's `GradScaler` skips them.
    pub skip_nonfinite: bool,
    /// LoRA: adapters on the linears it names, trained over a frozen base (every parameter of
    /// the model frozen: no gradient, no optimizer state; the adapters f32, with their own
    /// gradients and AdamW state in the store). `None`: the parameters are trained.
    pub lora: Option<LoraConfig>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            micro_batch: 1,
            seq: 16,
            accum: 1,
            adamw: AdamW { lr: 1e-3, weight_decay: 0.0, ..AdamW::default() },
            schedule: LrSchedule::constant(1e-3),
            clip: None,
            engine: Engine::Cpu,
            optimizer_threads: 0,
            frozen: Vec::new(),
            skip_nonfinite: false,
            lora: None,
        }
    }
}

impl TrainConfig {
    /// Whether `name` matches a frozen pattern.
    pub fn is_frozen(&self, name: &str) -> bool {
        self.frozen.iter().any(|p| glob(p, name))
    }

    /// Whether parameter `name` of the model is trained: with LoRA only the adapters are (and
    /// not those a frozen pattern names), else every parameter no frozen pattern names.
    pub fn is_trained(&self, name: &str) -> bool {
        let adapter = name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight");
        !self.is_frozen(name) && (self.lora.is_none() || adapter)
    }

    /// Checks that this config can train a model of `config` with `dtype` weights on
    /// `device`, before anything is allocated: sizes at least 1, `seq` within the model's
    /// positions, a peak learning rate finite and > 0 and a floor finite and ≥ 0, AdamW's betas
    /// in [0, 1), its eps finite and > 0, its weight decay finite and ≥ 0, a clip finite
    /// and > 0; every product of sizes (micro-batch × seq × accum, and what a step computes from
    /// them) in checked arithmetic, and what a step holds in host memory (on the CPU: candle's
    /// activations too) no more than the host has available. Errors are
    /// [`TrainError::Invalid`] or [`TrainError::TooLarge`], naming what was asked and what
    /// is allowed or there. [`Trainer::new`] and [`LlamaTwin::new`] call it.
    ///
    /// ```
    /// # use strata::candle::{LlamaConfig, TrainConfig, LrSchedule};
    /// # let c = LlamaConfig::from_json(r#"{"hidden_size": 32, "intermediate_size": 64,
    /// #     "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 50}"#).unwrap();
    /// let cpu = candle_core::Device::Cpu;
    /// let ok = TrainConfig::default();
    /// assert!(ok.validate(&c, strata::DType::F32, &cpu).is_ok());
    /// let nan = TrainConfig { schedule: LrSchedule::constant(f64::NAN), ..ok.clone() };
    /// assert!(nan.validate(&c, strata::DType::F32, &cpu).unwrap_err().to_string().contains("learning rate"));
    /// let huge = TrainConfig { accum: usize::MAX, ..ok };
    /// assert!(huge.validate(&c, strata::DType::F32, &cpu).is_err());
    /// ```
    pub fn validate(
        &self,
        config: &LlamaConfig,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<()> {
        if self.micro_batch == 0 || self.seq == 0 || self.accum == 0 {
            return Err(invalid(format!(
                "micro_batch {}, seq {} and accum {}: each must be at least 1",
                self.micro_batch, self.seq, self.accum
            )));
        }
        if self.seq > config.max_position_embeddings {
            return Err(invalid(format!(
                "seq {} is past the model's max_position_embeddings {}",
                self.seq, config.max_position_embeddings
            )));
        }
        let s = &self.schedule;
        if !(s.peak.is_finite() && s.peak > 0.0) {
            return Err(invalid(format!(
                "learning rate {}: it must be a finite number > 0 (a negative one ascends the \
                 loss)",
                s.peak
            )));
        }
        if !(s.min.is_finite() && s.min >= 0.0) {
            return Err(invalid(format!(
                "minimum learning rate {}: it must be a finite number ≥ 0",
                s.min
            )));
        }
        let a = &self.adamw;
        for (what, v) in [("beta1", a.beta1), ("beta2", a.beta2)] {
            if !(0.0..1.0).contains(&v) {
                return Err(invalid(format!("AdamW's {what} {v}: it must be in [0, 1)")));
            }
        }
        if !(a.eps.is_finite() && a.eps > 0.0) {
            return Err(invalid(format!("AdamW's eps {}: it must be a finite number > 0", a.eps)));
        }
        if !(a.weight_decay.is_finite() && a.weight_decay >= 0.0) {
            return Err(invalid(format!(
                "weight decay {}: it must be a finite number ≥ 0",
                a.weight_decay
            )));
        }
        if let Some(c) = self.clip {
            if !(c.is_finite() && c > 0.0) {
                return Err(invalid(format!(
                    "gradient clipping at {c}: the norm must be a finite number > 0 (no \
                     clipping is None)"
                )));
            }
        }
        if let Some(l) = &self.lora {
            l.validate().map_err(|e| invalid(e.to_string()))?;
        }
        let (host, compute) = self.step_bytes(config, dtype).ok_or_else(|| {
            invalid(format!(
                "a step of {} micro-batches of {} × {} tokens: the sizes' products overflow",
                self.accum, self.micro_batch, self.seq
            ))
        })?;
        let asked = match device {
            Device::Cpu => host.checked_add(compute),
            _ => Some(host),
        };
        let asked = asked.ok_or_else(|| invalid("a step's memory overflows u64".into()))?;
        if let Some(available) = crate::host_memory_available() {
            if asked > available {
                return Err(TrainError::TooLarge {
                    what: format!(
                        "a step of {} micro-batches of {} × {} tokens",
                        self.accum, self.micro_batch, self.seq
                    ),
                    asked,
                    available,
                    hint: "lower the micro-batch, the accumulation or the sequence".into(),
                }
                .into_candle());
            }
        }
        Ok(())
    }

    /// An upper estimate of the bytes a step holds outside the store: in host memory whatever
    /// the device (the token batches, the buffers the trainer fills the store from), and on
    /// candle's device (every micro-batch's hidden state and its gradient, one block's forward
    /// and backward for one micro-batch, the head's logits, a stage's gradients). `None` when
    /// a product overflows.
    fn step_bytes(&self, c: &LlamaConfig, dtype: DType) -> Option<(u64, u64)> {
        let u = |x: usize| x as u64;
        let (mb, seq, acc) = (u(self.micro_batch), u(self.seq), u(self.accum));
        let (h, i, v, heads) =
            (u(c.hidden_size), u(c.intermediate_size), u(c.vocab_size), u(c.num_attention_heads));
        let elem = dtype.size_of() as u64;
        let tokens = mb.checked_mul(seq.checked_add(1)?)?.checked_mul(acc)?;
        let mb_tokens = mb.checked_mul(seq)?;
        // Batches, their inputs and targets (u32).
        let batches = tokens.checked_mul(12)?;
        // The zeros a checkpoint and a tied head's share are made from.
        let zeros = mb_tokens.checked_mul(h)?.checked_add(v.checked_mul(h)?)?.checked_mul(elem)?;
        let host = batches.checked_add(zeros)?;
        // Every micro-batch's hidden state and its gradient (f32 at most).
        let hidden = tokens.checked_mul(h)?.checked_mul(8)?;
        // One block for one micro-batch: about 12 hidden-wide and 6 MLP-wide f32 activations a
        // token through the forward and the backward, and 4 score-sized ones for attention.
        let widths = h.checked_mul(12)?.checked_add(i.checked_mul(6)?)?;
        let block = mb_tokens.checked_mul(widths)?.checked_mul(4)?.checked_add(
            mb.checked_mul(heads)?.checked_mul(seq)?.checked_mul(seq)?.checked_mul(16)?,
        )?;
        // The head's logits, their softmax and gradients.
        let head = mb_tokens.checked_mul(v)?.checked_mul(16)?;
        // A stage's gradients summed in f32, twice.
        let grads = c.block_parameters().max(v.checked_mul(h)?).checked_mul(8)?;
        let compute = hidden.checked_add(block)?.checked_add(head)?.checked_add(grads)?;
        Some((host, compute))
    }
}

/// `*` matches any run of characters, everything else itself.
fn glob(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, rest)) => {
            let Some(tail) = name.strip_prefix(head) else { return false };
            (0..=tail.len()).any(|i| tail.is_char_boundary(i) && glob(rest, &tail[i..]))
        }
    }
}

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
    /// The step's loss or gradient norm was not finite and [`TrainConfig::skip_nonfinite`]
    /// skipped it: no parameter or moment changed.
    pub skipped: bool,
    /// An update of the step failed when it was queued (a fault): the step is done, and the
    /// next [`Trainer::step`], [`Trainer::finish`] or [`Trainer::save`] does that update
    /// again (and returns the error if it fails again). The error, as it read.
    pub update_error: Option<String>,
}

/// Puts random initial weights of `config` ([`super::llama::random_weights`]) into `store`
/// as `Param` tensors of `dtype` (`F32` or `BF16`) under Hugging Face's names, in host memory
/// (Pinned, else wherever there is room).
pub fn put_random_weights(
    store: &Store,
    config: &LlamaConfig,
    seed: u64,
    dtype: DType,
) -> candle_core::Result<Vec<(String, TensorId)>> {
    put_random_tensors(store, &config.tensors(), seed, dtype)
}

/// [`put_random_weights`] of any tensors, `(name, shape)`: a model of a [`Block`] of your own
/// ([`model_tensors`]). A matrix gets normal values of deviation 0.02, a vector ones, a name
/// ending `.bias` zeros ([`super::llama::random_weights_of`]).
pub fn put_random_tensors(
    store: &Store,
    tensors: &[(String, Vec<usize>)],
    seed: u64,
    dtype: DType,
) -> candle_core::Result<Vec<(String, TensorId)>> {
    super::llama::random_weights_of(tensors.to_vec(), seed)
        .map(|(name, shape, values)| {
            let bytes = match dtype {
                DType::F32 => bytemuck::cast_slice::<f32, u8>(&values).to_vec(),
                DType::BF16 => {
                    let b: Vec<half::bf16> =
                        values.iter().map(|&x| half::bf16::from_f32(x)).collect();
                    bytemuck::cast_slice::<half::bf16, u8>(&b).to_vec()
                }
                other => candle_core::bail!("weights in {other}: f32 or bf16 are trained"),
            };
            let id = put_host(store, &name, Group::Param, dtype, &shape, &bytes)
                .map_err(|e| strata_err(&name, e))?;
            Ok((name, id))
        })
        .collect()
}

/// Loads a Hugging Face Llama checkpoint of `config` into `store` (a `.safetensors` file, a
/// sharded checkpoint's `*.index.json` or a directory; in place, group `Param`), and checks
/// that it has every tensor `config` names, in the shape it says, in f32 or bf16. Tensors the
/// model does not use are left out (and removed from the store).
///
/// A GGUF file (named `*.gguf`) is loaded by [`load_gguf_weights`](super::load_gguf_weights)
/// instead: its tensors under Hugging Face's names, in the file's dtypes (block-quantized
/// ones included: generation dequantizes them where a layer is fetched, and the trainer takes
/// them as a frozen base under LoRA adapters, QLoRA, refusing to train them by name).
pub fn load_weights(
    store: &Store,
    config: &LlamaConfig,
    path: impl AsRef<Path>,
) -> candle_core::Result<Vec<(String, TensorId)>> {
    let path = path.as_ref();
    if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
        return super::load_gguf_weights(store, config, path);
    }
    load_tensors(store, &config.tensors(), path)
}

/// [`load_weights`] of any tensors, `(name, shape)`: a model of a [`Block`] of your own
/// ([`model_tensors`]).
pub fn load_tensors(
    store: &Store,
    tensors: &[(String, Vec<usize>)],
    path: impl AsRef<Path>,
) -> candle_core::Result<Vec<(String, TensorId)>> {
    let opts = LoadOptions { group: Group::Param, ..LoadOptions::default() };
    let path = path.as_ref();
    let loaded = store.load_checkpoint(path, opts).map_err(candle_core::Error::from)?;
    // A file with more blocks than the config says is another model (or a config cut short):
    // refused, not trained or run on its first blocks.
    let blocks = tensors.iter().filter_map(|(n, _)| layer_of(n)).max().map_or(0, |l| l + 1);
    let in_file = loaded.iter().filter_map(|t| layer_of(&t.name)).max().map_or(0, |l| l + 1);
    if in_file > blocks {
        for t in loaded.iter() {
            let _ = store.remove(t.id);
        }
        return Err(TrainError::Mismatch {
            path: path.to_path_buf(),
            what: "number of blocks (num_hidden_layers)".into(),
            saved: in_file.to_string(),
            here: format!("{blocks} (the config's)"),
            hint: "the config is of another model, or cut short: use the config.json that \
                   came with the weights"
                .into(),
        }
        .into_candle());
    }
    let mut out = Vec::new();
    for (name, shape) in tensors.iter().cloned() {
        let id = loaded
            .get(&name)
            .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.clone() }.bt())?;
        let info = store.info(id).map_err(|e| strata_err(&name, e))?;
        if info.shape != shape {
            return Err(super::shape_mismatch(&name, &shape, &info.shape));
        }
        if !matches!(info.dtype, DType::F32 | DType::BF16) {
            candle_core::bail!("{name} is {}: f32 or bf16 weights are trained", info.dtype);
        }
        out.push((name, id));
    }
    for t in loaded.iter() {
        if !out.iter().any(|(n, _)| *n == t.name) {
            store.remove(t.id).map_err(|e| strata_err(&t.name, e))?;
        }
    }
    Ok(out)
}

/// How a parameter of a run gets its first value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Init {
    /// The model's weights, given.
    Given,
    /// A LoRA `A`: [`init_a`] of this adapter's number.
    LoraA(usize),
    /// Zeros (a LoRA `B`).
    Zero,
}

/// The block a parameter's name is in (`model.layers.N.`).
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?.split('.').next()?.parse().ok()
}

/// Every parameter of a run, `(name, shape, first value)`: the model's tensors (`base`, in
/// stage order), each block's LoRA adapters (`A` then `B`, in `specs`' order) after its own
/// tensors. The trainer and its twin order their parameters (and so the gradient norm's sum)
/// alike.
fn run_params(
    base: &[(String, Vec<usize>)],
    specs: &[AdapterSpec],
) -> Vec<(String, Vec<usize>, Init)> {
    let mut out = Vec::with_capacity(base.len() + 2 * specs.len());
    for (k, (name, shape)) in base.iter().enumerate() {
        out.push((name.clone(), shape.clone(), Init::Given));
        let l = layer_of(name);
        if l.is_some() && base.get(k + 1).map(|(n, _)| layer_of(n)) != Some(l) {
            for (i, s) in specs.iter().enumerate().filter(|(_, s)| Some(s.layer) == l) {
                out.push((s.a.0.clone(), s.a.1.clone(), Init::LoraA(i)));
                out.push((s.b.0.clone(), s.b.1.clone(), Init::Zero));
            }
        }
    }
    out
}

/// The f32 values a parameter starts from when it is not given (a LoRA adapter's).
fn init_values(init: Init, shape: &[usize], lora: Option<&LoraConfig>) -> Vec<f32> {
    match init {
        Init::LoraA(i) => init_a(lora.map_or(0, |l| l.seed), i, shape),
        _ => vec![0.0; shape.iter().product()],
    }
}

/// Block `l`'s [`Weights`]: its tensors (`names`, within the block) and its adapters, from
/// `get(full name)`.
fn block_weights(
    names: &[(String, Vec<usize>)],
    specs: &[AdapterSpec],
    scale: f64,
    l: usize,
    get: impl Fn(&str) -> Option<Tensor>,
) -> candle_core::Result<Weights> {
    let p = LlamaConfig::block_prefix(l);
    let find = |n: &str| {
        get(n).ok_or_else(|| candle_core::Error::CannotFindTensor { path: n.to_string() }.bt())
    };
    let mut t = HashMap::with_capacity(names.len());
    for (s, _) in names {
        t.insert(s.clone(), find(&format!("{p}{s}"))?);
    }
    let mut w = Weights::new(t);
    for s in specs.iter().filter(|s| s.layer == l) {
        let adapter = Adapter { a: find(&s.a.0)?, b: find(&s.b.0)?, scale };
        w = w.with_adapter(s.linear.clone(), adapter);
    }
    Ok(w)
}

/// A tensor homed in host memory: Pinned when it has room, else wherever `put` places it.
pub(super) fn put_host(
    store: &Store,
    name: &str,
    group: Group,
    dtype: DType,
    shape: &[usize],
    bytes: &[u8],
) -> crate::Result<TensorId> {
    match store.put_in(Tier::Pinned, name, group, dtype, shape, bytes) {
        Ok(id) => Ok(id),
        Err(
            crate::Error::OutOfMemory { .. }
            | crate::Error::TooLarge { .. }
            | crate::Error::TierDisabled { .. },
        ) => store.put_group(name, group, dtype, shape, bytes),
        Err(e) => Err(e),
    }
}

/// An activation checkpoint's home: Pinned when it has room, else the Device tier while that
/// keeps `keep` bytes free, else Disk (never a Device tier filled with checkpoints, which would
/// leave the stages no room to stream through).
fn put_checkpoint(
    store: &Store,
    name: &str,
    dtype: DType,
    shape: &[usize],
    bytes: &[u8],
    keep: u64,
) -> crate::Result<TensorId> {
    let group = Group::Activation;
    let short = |e: &crate::Error| {
        matches!(
            e,
            crate::Error::OutOfMemory { .. }
                | crate::Error::TooLarge { .. }
                | crate::Error::TierDisabled { .. }
        )
    };
    match store.put_in(Tier::Pinned, name, group, dtype, shape, bytes) {
        Err(e) if short(&e) => {}
        r => return r,
    }
    let s = store.stats();
    let free = s.capacity(Tier::Device).saturating_sub(s.used(Tier::Device));
    if free >= keep + store.footprint(Tier::Device, bytes.len() as u64) {
        match store.put_in(Tier::Device, name, group, dtype, shape, bytes) {
            Err(e) if short(&e) => {}
            r => return r,
        }
    }
    store.put_in(Tier::Disk, name, group, dtype, shape, bytes)
}

/// The candle dtype of a trained parameter's store dtype.
fn compute_dtype(d: DType) -> candle_core::Result<CDType> {
    match d {
        DType::F32 => Ok(CDType::F32),
        DType::BF16 => Ok(CDType::BF16),
        other => candle_core::bail!("{other} parameters: f32 or bf16 are trained"),
    }
}

/// A candle tensor's values written into the store tensor `id` (same dtype and element count).
/// CPU: through the host (`Store::write`). CUDA: device to device into a
/// `device_view_for_overwrite` on candle's stream, then released (written back to host memory
/// when the Device tier needs the room).
pub(crate) fn candle_to_store(
    store: &Store,
    stream: &Stream,
    name: &str,
    id: TensorId,
    t: &Tensor,
) -> candle_core::Result<()> {
    let t = t.flatten_all()?.contiguous()?;
    match t.device() {
        #[cfg(feature = "candle-cuda")]
        Device::Cuda(dev) => {
            use candle_core::Storage;
            let mut view =
                store.device_view_for_overwrite(id, stream).map_err(|e| strata_err(name, e))?;
            {
                let (storage, layout) = t.storage_and_layout();
                let Storage::Cuda(cs) = &*storage else {
                    candle_core::bail!("{name}: a CUDA tensor without CUDA storage")
                };
                let (start, end) = layout
                    .contiguous_offsets()
                    .ok_or_else(|| candle_core::Error::Msg(format!("{name}: not contiguous")))?;
                let cuda = dev.cuda_stream();
                macro_rules! dtod {
                    ($t:ty) => {{
                        if (end - start) * std::mem::size_of::<$t>() != view.len_bytes() {
                            candle_core::bail!(
                                "{name}: {} elements for a tensor of {} bytes",
                                end - start,
                                view.len_bytes()
                            );
                        }
                        let src = cs.as_cuda_slice::<$t>()?.slice(start..end);
                        let mut dst =
                            view.typed_cuda_view_mut::<$t>().map_err(|e| strata_err(name, e))?;
                        cuda.memcpy_dtod(&src, &mut dst).map_err(candle_core::Error::wrap)?;
                    }};
                }
                match t.dtype() {
                    CDType::F32 => dtod!(f32),
                    CDType::BF16 => dtod!(half::bf16),
                    other => candle_core::bail!("{name}: no copy into the store for {other:?}"),
                }
            }
            drop(view);
            store.release(&[id]).map_err(|e| strata_err(name, e))
        }
        _ => {
            let _ = stream;
            let bytes: Vec<u8> = match t.dtype() {
                CDType::F32 => bytemuck::cast_slice(&t.to_vec1::<f32>()?).to_vec(),
                CDType::BF16 => bytemuck::cast_slice(&t.to_vec1::<half::bf16>()?).to_vec(),
                other => candle_core::bail!("{name}: no copy into the store for {other:?}"),
            };
            store.write(id, &bytes).map_err(|e| strata_err(name, e))
        }
    }
}

/// A parameter of the model, where it is and who updates it.
#[derive(Clone, Debug)]
struct Param {
    name: String,
    id: TensorId,
    /// The stage whose update writes it (embedding 0, block `l` at `l + 1`, head last).
    stage: usize,
    trainable: bool,
}

/// Trains a Llama-style decoder out of core: parameters, gradients, fp32 masters, AdamW moments
/// and activation checkpoints all in a strata store, one stage's weights on the device at a
/// time (see the [module docs](self)).
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
    config: LlamaConfig,
    train: TrainConfig,
    store: Arc<Store>,
    layers: Layers,
    /// The blocks' code, and their tensors (names within a block).
    block: Arc<dyn Block>,
    block_tensors: Vec<(String, Vec<usize>)>,
    /// The LoRA adapters (none without LoRA).
    specs: Vec<AdapterSpec>,
    /// Each stage's parameters' names (a block's: its tensors, then its adapters).
    stages: Vec<Vec<String>>,
    /// A LoRA run's frozen base: the crc32 of its values (computed once; its checkpoints
    /// record it, and a resume checks it).
    base_crc: Option<u32>,
    dtype: CDType,
    params: Vec<Param>,
    /// The trainable parameters' ids, for the optimizer (`None` when all are frozen).
    opt: Option<Optimizer>,
    /// Activation checkpoints: `[block][micro-batch]` names.
    checkpoints: Vec<Vec<String>>,
    /// Tied embeddings being trained: the name under which `layers` serves the table's
    /// gradient (the optimizer's, f32), which holds the head's share (summed over the
    /// micro-batches) from the head's backward until the embedding's backward adds its rows.
    embed_grad: Option<String>,
    /// Steps done: the next step's number.
    step: u64,
    /// Steps skipped for a non-finite loss or gradient ([`TrainConfig::skip_nonfinite`]).
    skipped: u64,
    /// The run's identity, carried by every file of its checkpoints.
    run: u64,
    /// The updates of the last step, until `Optimizer::finish` ended them.
    updates: Option<Updates>,
    /// The spans the current step waited for the optimizer (or ran it, the GPU engines).
    waits: Vec<(Instant, Instant)>,
    /// A resume that failed after it began writing the trainer's tensors: steps and saves are
    /// refused until a resume succeeds.
    torn: Option<PathBuf>,
    /// The caller's notes on the run, kept in its checkpoints.
    notes: BTreeMap<String, String>,
}

/// A step's updates not yet ended: queued behind the next step's forward, failed (to be done
/// again), or not all queued.
#[derive(Debug)]
struct Updates {
    /// The gradients' clipping factor: what a retried update is scaled by.
    scale: f32,
    /// The stage of each update queued, in order (the forward waits for a stage's).
    stages: Vec<usize>,
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
    skipped: bool,
}

/// A new run's identity: 64 random bits (the standard library's per-process random hash keys,
/// over the time and the process id).
fn new_run_id() -> u64 {
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

impl Trainer {
    /// A trainer for a model of `config` whose parameters are the store tensors `weights`
    /// (Hugging Face's names: [`load_weights`] or [`put_random_weights`] make them), on candle
    /// device `device` (the store must go with it: [`store_for`](super::store_for)). Moves the
    /// parameters to host memory (Pinned, where there is room), creates the optimizer's state
    /// for the trainable ones (gradients in f32) and the activation checkpoints; with
    /// [`TrainConfig::lora`], the adapters (f32, `A` as PEFT initialises it, `B` zero) and
    /// their state, the model's own parameters all frozen.
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
    /// tensors are [`model_tensors`]). The [`block`](super::block) module has an example.
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
        let opt = if trainable.is_empty() {
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
        let embed = params.iter().find(|p| p.name == EMBED && p.trainable);
        let embed_grad = match (embed, &opt) {
            (Some(p), Some(o)) if config.tie_word_embeddings => {
                let name = format!("{EMBED}.grad");
                layers.serve(name.clone(), o.grad(p.id).map_err(|e| strata_err(&name, e))?);
                Some(name)
            }
            _ => None,
        };
        let block_tensors = block.tensors();
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
            embed_grad,
            step: 0,
            skipped: 0,
            run: new_run_id(),
            updates: None,
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
    /// checkpoint's commit record ([`Checkpoint::notes`]) and set back by [`Trainer::resume`].
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
    fn stage_names(&self, stage: usize) -> Vec<String> {
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
    fn weights_of(
        &self,
        l: usize,
        get: impl Fn(&str) -> Option<Tensor>,
    ) -> candle_core::Result<Weights> {
        let scale = self.train.lora.as_ref().map_or(1.0, LoraConfig::scale);
        block_weights(&self.block_tensors, &self.specs, scale, l, get)
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
    fn settle(&mut self) -> candle_core::Result<f64> {
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
    /// forward) and ends the optimizer's step; returns the seconds waited. After a failed
    /// step it does the updates left (a fault that has passed); an error leaves them for the
    /// next call. [`Trainer::save`] calls it; call it after the last step before reading the
    /// weights.
    pub fn finish(&mut self) -> candle_core::Result<f64> {
        self.settle()
    }

    /// Queues the updates of the trainable parameters of `stage`, scaled by `scale`.
    fn queue(&mut self, stage: usize, scale: f32) -> candle_core::Result<()> {
        let Some(opt) = self.opt.as_mut() else { return Ok(()) };
        let u = self.updates.get_or_insert_with(|| Updates { scale, stages: Vec::new() });
        for p in self.params.iter().filter(|p| p.stage == stage && p.trainable) {
            opt.update_scaled(p.id, scale).map_err(|e| strata_err(&p.name, e))?;
            u.stages.push(stage);
        }
        Ok(())
    }

    /// Refuses to go on from a resume that failed half-way.
    fn check_whole(&self) -> candle_core::Result<()> {
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

    /// Candle `Var`s of the trainable tensors among `w` (frozen ones stay plain tensors).
    fn as_vars(
        &self,
        w: &HashMap<String, Tensor>,
        names: &[String],
    ) -> candle_core::Result<HashMap<String, (Tensor, Option<Var>)>> {
        let mut out = HashMap::new();
        for n in names {
            let t = w
                .get(n)
                .ok_or_else(|| candle_core::Error::CannotFindTensor { path: n.clone() }.bt())?;
            let trainable = self.params.iter().any(|p| p.name == *n && p.trainable);
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
    /// token ids (u32) on the trainer's device. See the [module docs](self).
    ///
    /// A step that fails (an error from the store, the optimizer or candle) leaves the trainer
    /// as it was before it: no parameter or moment has changed, [`Trainer::steps`] is the same,
    /// and calling `step` again with the same batches gives what a clean step gives (bit for
    /// bit on the CPU). A step is done once its gradients are whole and finite: its updates
    /// then run behind the next step's forward (the Cpu engine) or as they are queued (the GPU
    /// engines), and one that fails is done again, exactly once, by the next `step`,
    /// [`Trainer::finish`] or [`Trainer::save`] (which return its error while it keeps
    /// failing; [`StepReport::update_error`] tells of one that failed as it was queued). A
    /// loss or gradient norm that is not finite fails the step with [`TrainError::NonFinite`]
    /// before anything is updated (or skips it: [`TrainConfig::skip_nonfinite`]).
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
        self.check_whole()?;
        let t0 = Instant::now();
        self.waits.clear();
        if self.updates.is_some() && self.opt.as_ref().is_some_and(|o| !o.unstepped().is_empty()) {
            // The last step's updates failed: done again before a weight is read.
            self.settle()?;
        }
        let stats0 = self.store.stats();
        let (tc, cfg) = (self.train.clone(), self.config.clone());
        check_batches(&tc, &cfg, batches)?;
        let masks = masks.map(|m| prepare_masks(&tc, m)).transpose()?;
        let n_layers = cfg.num_hidden_layers;
        let head = n_layers + 1;
        let mut clock = ComputeClock::new(self.layers.device());
        let io: Vec<(Tensor, Tensor)> =
            batches.iter().map(inputs_and_targets).collect::<candle_core::Result<_>>()?;
        let names = |s: &Self, stage: usize| s.stage_names(stage);

        // Forward, stage by stage, every micro-batch through a stage before the next.
        self.wait_for(&[0, 1])?;
        let next = names(self, 1);
        let w = self.layers.fetch(&[EMBED], &refs(&next))?;
        let table = w.get(EMBED).expect("fetched").clone();
        drop(w);
        clock.start()?;
        let mut xs: Vec<Tensor> =
            io.iter().map(|(ids, _)| embed(&table, ids)).collect::<candle_core::Result<_>>()?;
        clock.stop()?;
        drop(table);
        crate::base::failpoint::check(crate::base::failpoint::Site::Compute, Path::new("forward"))?;
        for l in 0..n_layers {
            let stage = block_stage(l);
            self.wait_for(&[stage, stage + 1])?;
            let (this, next) = (names(self, stage), names(self, stage + 1));
            let w = self.layers.fetch(&refs(&this), &refs(&next))?;
            let bw = self.weights_of(l, |n| w.get(n).cloned())?;
            for (m, x) in xs.iter_mut().enumerate() {
                let ck = &self.checkpoints[l][m];
                let id = self.layers.id(ck).expect("checkpoint");
                candle_to_store(&self.store, self.layers.stream(), ck, id, x)?;
                clock.start()?;
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
        let w = self.layers.fetch(&refs(&head_names), &refs(&next))?.into_tensors();
        let vars = self.as_vars(&w, &head_names)?;
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
        if let Some(share) = acc.remove(EMBED).flatten() {
            // Tied: parked in the embedding's gradient until its own backward.
            self.hand_over(EMBED, &share)?;
        }
        self.hand_over_all(&mut acc, &mut ss)?;

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
                self.embed_grad.iter().cloned().collect()
            };
            let w = self.layers.fetch(&refs(&this), &refs(&next))?.into_tensors();
            let vars = self.as_vars(&w, &this[..weights_n])?;
            let bw = self.weights_of(l, |n| vars.get(n).map(|v| v.0.clone()))?;
            clock.start()?;
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
            drop((w, vars, bw));
            crate::base::failpoint::check(
                crate::base::failpoint::Site::Compute,
                Path::new("backward"),
            )?;
            self.hand_over_all(&mut acc, &mut ss)?;
        }

        // The embedding's backward: the rows each token picked get its gradient (candle's
        // index_select backward), in f32, into one buffer: the head's share when tied.
        if self.params.iter().any(|p| p.name == EMBED && p.trainable) {
            let table = match &self.embed_grad {
                Some(name) => {
                    let mut w = self.layers.fetch(&[name.as_str()], &[])?.into_tensors();
                    w.remove(name).expect("fetched")
                }
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
        }
        drop(grads_in);

        // The loss and the global norm (in the model's tensor order): one host sync, before any
        // update; then the updates, in the order the next forward needs them, run behind it.
        let ordered: Vec<(&str, Tensor)> = self
            .params
            .iter()
            .filter_map(|p| ss.get(&p.name).map(|t| (p.name.as_str(), t.clone())))
            .collect();
        let sums: Vec<Tensor> = ordered.iter().map(|(_, t)| t.clone()).collect();
        let (loss, grad_norm) = loss_and_norm(&losses, &sums)?;
        let compute = clock.seconds()?;
        let report = |s: &Self, grad_norm: f64, clip: f32, skipped: bool| {
            s.report(Reported { t0, stats0: &stats0, loss, lr, grad_norm, clip, compute, skipped })
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
        let clip = clip_factor(grad_norm, tc.clip);
        // From here the step is done: its gradients are whole and finite, and its updates are
        // owed. One that fails to be queued (the GPU engines run theirs here) is done again by
        // the next step, finish or save, as one that fails on the optimizer's thread is.
        self.updates = Some(Updates { scale: clip, stages: Vec::new() });
        let mut update_error = None;
        let queued = Instant::now();
        for stage in 0..=head {
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
    /// else [`TrainError::NonFinite`]. Nothing of the step has been queued.
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
        let busy =
            self.opt.as_ref().map_or_else(|| vec![0.0; spans.len()], |o| o.busy_within(&spans));
        let during_waits = busy[1..].iter().fold(0.0, |a, b| a + b);
        StepReport {
            step: self.step,
            loss: r.loss,
            lr: r.lr,
            grad_norm: r.grad_norm,
            clip_scale: r.clip,
            tokens: (tc.micro_batch * tc.seq * tc.accum) as u64,
            seconds: (t1 - r.t0).as_secs_f64(),
            compute_seconds: r.compute,
            moved,
            stall_seconds: stats.stall_seconds - r.stats0.stall_seconds,
            optimizer_seconds: busy[0],
            optimizer_exposed_seconds: span_seconds(&self.waits),
            optimizer_hidden_seconds: (busy[0] - during_waits).max(0.0),
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
    /// A checkpoint is a Hugging Face checkpoint of the parameters (`model-*.safetensors`, one
    /// file a stage, `model.safetensors.index.json` and `config.json`: loadable by
    /// [`load_weights`] and `LlamaForCausalLM.from_pretrained`), the optimizer's state
    /// (`NAME.master` for bf16 parameters, `NAME.exp_avg`, `NAME.exp_avg_sq`:
    /// `optimizer-*.safetensors` and `optimizer.safetensors.index.json`), and its commit record
    /// `checkpoint.json` ([`Checkpoint`]). It is **whole or absent**: written into a hidden
    /// directory, every file flushed and read back (its crc32 recorded; a value that is not
    /// finite refuses the save with [`TrainError::NonFinite`]), the record written last, then
    /// renamed into place; a process killed at any moment leaves the checkpoints before it as
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
    /// directory: its newest), so that the next [`Trainer::step`] does what the saved run's
    /// next step would have done (bit for bit on the CPU). Before anything of the trainer is
    /// touched, every file is checked against the commit record ([`Checkpoint::open`]; a
    /// mismatch is [`TrainError::BadCheckpoint`] naming the file), each file's identity (run,
    /// step) against the record's, the optimizer's step count against the step, and the
    /// checkpoint's own model config, dtype, frozen parameters, batch, optimizer and schedule
    /// against the trainer's ([`TrainError::Mismatch`] names what differs). The trainer takes
    /// the run's identity. A store fault while the tensors are copied leaves the trainer
    /// refusing to step or save until a resume succeeds.
    pub fn resume(&mut self, path: impl AsRef<Path>) -> candle_core::Result<()> {
        self.settle()?;
        checkpoint::resume(self, path.as_ref())
    }
}

/// Reads a token stream from `path` for a model of `vocab` tokens trained on sequences of
/// `seq` tokens: u32 ids, the first tensor (by name) of a `.safetensors` file (u32), or else
/// the whole file as raw little-endian u32s. Bounded before a byte is read: the path must be a
/// regular file (a FIFO, a device such as `/dev/zero`, a socket or a directory is refused
/// without being opened for reading, so nothing blocks or reads without end), sized first and
/// read to that size, and no larger than the host memory available. Fewer than `seq + 1`
/// tokens (one sequence and its last target), a size that is not whole u32s, and ids past the
/// vocabulary are [`TrainError::BadData`] too.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// let dir = tempfile::tempdir().unwrap();
/// let p = dir.path().join("tokens.bin");
/// std::fs::write(&p, [1u32, 2, 3, 4, 5].iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
/// assert_eq!(strata::candle::train::load_tokens(&p, 10, 4)?, vec![1, 2, 3, 4, 5]);
/// // One sequence of 8 needs 9 tokens; /dev/zero is not a regular file.
/// assert!(strata::candle::train::load_tokens(&p, 10, 8).is_err());
/// assert!(strata::candle::train::load_tokens("/dev/zero", 10, 4).is_err());
/// # Ok(()) }
/// ```
pub fn load_tokens(
    path: impl AsRef<Path>,
    vocab: usize,
    seq: usize,
) -> candle_core::Result<Vec<u32>> {
    let path = path.as_ref();
    let bad = |why: String| TrainError::BadData { path: path.to_path_buf(), why }.into_candle();
    // The bytes and the ids decoded from them.
    let bytes = read_input(path, "the token file", u64::MAX, 2, "train on a smaller file")?;
    let ids: Vec<u32> = match safetensors::SafeTensors::deserialize(&bytes) {
        Ok(st) => {
            let mut names = st.names();
            names.sort();
            let name =
                names.first().ok_or_else(|| bad("a safetensors file with no tensor".into()))?;
            let t = st.tensor(name).map_err(|e| bad(e.to_string()))?;
            if t.dtype() != safetensors::Dtype::U32 {
                return Err(bad(format!("{name} is {:?}: u32 token ids are read", t.dtype())));
            }
            t.data().chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        }
        Err(_) => {
            if bytes.len() % 4 != 0 {
                return Err(bad(format!(
                    "{} bytes: not a whole number of u32 token ids",
                    bytes.len()
                )));
            }
            bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
        }
    };
    let need = seq.saturating_add(1);
    if ids.len() < need {
        return Err(bad(format!(
            "{} tokens, fewer than one sequence of {seq} and its last target ({need})",
            ids.len()
        )));
    }
    if let Some((i, bad_id)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
        return Err(bad(format!("token {i} is {bad_id}, past the vocabulary of {vocab}")));
    }
    Ok(ids)
}

/// The whole of an input file (`--data`, `--text`, `--jsonl`), bounded before a byte is read:
/// `path` must be a regular file (a FIFO, a device such as `/dev/zero`, a socket or a
/// directory is [`TrainError::BadData`] naming it, never opened for reading, so nothing blocks
/// or reads without end), of at most `limit` bytes, and `copies` times its size must fit the
/// host memory available ([`TrainError::TooLarge`], with `hint`). Read to the size it had when
/// looked at; a file that changed meanwhile is refused.
///
/// ```
/// use strata::candle::train::read_input;
/// assert!(read_input("/dev/zero".as_ref(), "text", 1 << 30, 1, "").is_err());
/// let dir = tempfile::tempdir().unwrap();
/// assert!(read_input(dir.path(), "text", 1 << 30, 1, "").is_err());
/// ```
pub fn read_input(
    path: &Path,
    what: &str,
    limit: u64,
    copies: u64,
    hint: &str,
) -> candle_core::Result<Vec<u8>> {
    use std::io::Read;
    let bad = |why: String| TrainError::BadData { path: path.to_path_buf(), why }.into_candle();
    let file = crate::tiers::file::open_regular(path, 0).map_err(|e| bad(e.chain()))?;
    let size = file.metadata().map_err(|e| bad(e.to_string()))?.len();
    if size > limit {
        return Err(bad(format!(
            "{} ({size} bytes): {what} may be at most {}",
            crate::format_size(size),
            crate::format_size(limit)
        )));
    }
    let asked = size.saturating_mul(copies.max(1));
    if let Some(available) = crate::host_memory_available() {
        if asked > available {
            return Err(TrainError::TooLarge {
                what: format!("{what} {} ({})", path.display(), crate::format_size(size)),
                asked,
                available,
                hint: hint.into(),
            }
            .into_candle());
        }
    }
    let len = usize::try_from(size).map_err(|_| bad(format!("{size} bytes")))?;
    let mut bytes = Vec::new();
    bytes.try_reserve_exact(len).map_err(|_| bad(format!("{size} bytes: no memory for them")))?;
    file.take(size).read_to_end(&mut bytes).map_err(|e| bad(e.to_string()))?;
    if bytes.len() != len {
        return Err(bad(format!("{} bytes read of {size}: it changed while read", bytes.len())));
    }
    Ok(bytes)
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn grad_of(
    grads: &candle_core::backprop::GradStore,
    t: &Tensor,
    what: &str,
) -> candle_core::Result<Tensor> {
    grads
        .get(t)
        .cloned()
        .ok_or_else(|| candle_core::Error::Msg(format!("no gradient reached {what}")).bt())
}

fn check_batches(
    tc: &TrainConfig,
    cfg: &LlamaConfig,
    batches: &[Tensor],
) -> candle_core::Result<()> {
    if batches.len() != tc.accum {
        candle_core::bail!("{} micro-batches for a step of {}", batches.len(), tc.accum);
    }
    let mut maxes = Vec::with_capacity(batches.len());
    for b in batches {
        if b.dims() != [tc.micro_batch, tc.seq + 1] || b.dtype() != CDType::U32 {
            candle_core::bail!(
                "a micro-batch of {:?} {:?}: [{}, {}] u32 token ids are needed",
                b.dims(),
                b.dtype(),
                tc.micro_batch,
                tc.seq + 1
            );
        }
        maxes.push(b.max_all()?);
    }
    // Read in one go: one host sync for the step's tokens, before any of them is used.
    let max = Tensor::stack(&maxes, 0)?.max_all()?.to_scalar::<u32>()?;
    if max as usize >= cfg.vocab_size {
        candle_core::bail!("token id {max} in a vocabulary of {}", cfg.vocab_size);
    }
    Ok(())
}

/// A step's loss masks, checked: one `[micro_batch, seq]` a micro-batch, every value 0 (the
/// target does not count) or 1, at least one target counted in the step. Gives them as f32
/// `[micro_batch · seq]` (what the loss multiplies by) and how many targets count.
fn prepare_masks(tc: &TrainConfig, masks: &[Tensor]) -> candle_core::Result<(Vec<Tensor>, usize)> {
    if masks.len() != tc.accum {
        candle_core::bail!("{} loss masks for a step of {} micro-batches", masks.len(), tc.accum);
    }
    let mut out = Vec::with_capacity(masks.len());
    let mut count = 0usize;
    for m in masks {
        if m.dims() != [tc.micro_batch, tc.seq] {
            candle_core::bail!(
                "a loss mask of {:?}: [{}, {}] (one flag a target) is needed",
                m.dims(),
                tc.micro_batch,
                tc.seq
            );
        }
        let f = m.to_dtype(CDType::F32)?.flatten_all()?.contiguous()?;
        let v = f.to_vec1::<f32>()?;
        if let Some(x) = v.iter().find(|&&x| x != 0.0 && x != 1.0) {
            candle_core::bail!("a loss mask holds {x}: 0 (not counted) or 1 (counted)");
        }
        count += v.iter().filter(|&&x| x == 1.0).count();
        out.push(f);
    }
    if count == 0 {
        return Err(invalid(
            "no target of the step counts in the loss (every mask is 0): leave such rows out"
                .into(),
        ));
    }
    Ok((out, count))
}

/// A parameter's values in f32 (a quantized one dequantized, as the `gguf` package does).
fn read_f32(store: &Store, name: &str, id: TensorId) -> candle_core::Result<Vec<f32>> {
    let info = store.info(id).map_err(|e| strata_err(name, e))?;
    Ok(match info.dtype {
        q if q.is_quantized() => {
            let bytes = store.read(id).map_err(|e| strata_err(name, e))?;
            crate::quant::dequantize(q, &bytes).map_err(|e| strata_err(name, e))?
        }
        DType::F32 => store.read_vec::<f32>(id).map_err(|e| strata_err(name, e))?,
        DType::BF16 => store
            .read_vec::<half::bf16>(id)
            .map_err(|e| strata_err(name, e))?
            .into_iter()
            .map(f32::from)
            .collect(),
        other => candle_core::bail!("{name} is {other}"),
    })
}

/// One parameter of [`LlamaTwin`].
struct TwinParam {
    name: String,
    shape: Vec<usize>,
    /// The candle tensor the model computes with, a `Var` when trainable.
    var: Option<Var>,
    tensor: Tensor,
    /// The f32 master weights and moments, on the device (trainable parameters).
    state: Option<DeviceState>,
}

/// The in-memory twin of [`Trainer`], resident on candle's device: the same model code with
/// every weight a resident candle tensor (`Var`s for the trainable ones), each micro-batch's
/// loss run through candle's plain `backward` (no recompute), the gradients summed over
/// micro-batches into one f32 buffer per parameter on the device, and AdamW with fp32 masters
/// and moments on the device too, updated in place by strata's optimizer arithmetic (its host
/// loop [`cpu_update_scaled`](crate::compute::optim::cpu_update_scaled) on the CPU, its `strata_adamw`
/// kernel on CUDA): nothing crosses to the host but the loss and the gradient norm, read in one
/// sync a step. It is the trainer's reference (on the CPU its losses and weights are the
/// trainer's, bit for bit: with the Llama block or a [`Block`] of your own
/// ([`LlamaTwin::with_block`]), with LoRA adapters, with loss masks) and its baseline (what out
/// of core is measured against on a GPU).
///
/// **Training and generation.** The twin's Llama weights serve generation too:
/// [`LlamaTwin::generator`] is an [`InMemoryLlama`](super::InMemoryLlama) over the very same
/// tensors (no copy; each step updates them in place, adapters included), with its KV cache.
/// They stay two types because they hold different things: the twin holds `Var`s, fp32 masters
/// and moments and rotary tables for the training sequence; the generator a KV cache, tables
/// for the cache's positions, and may compute in f16.
pub struct LlamaTwin {
    config: LlamaConfig,
    train: TrainConfig,
    block: Arc<dyn Block>,
    block_tensors: Vec<(String, Vec<usize>)>,
    specs: Vec<AdapterSpec>,
    params: Vec<TwinParam>,
    step: u64,
    kernels: Kernels,
}

impl std::fmt::Debug for LlamaTwin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaTwin").field("step", &self.step).finish()
    }
}

impl LlamaTwin {
    /// A twin of a model of `config` from its weights (every tensor [`LlamaConfig::tensors`]
    /// names, f32 or bf16, on `device`); with [`TrainConfig::lora`], the adapters the trainer
    /// makes (the same initial values).
    pub fn new(
        config: LlamaConfig,
        train: TrainConfig,
        weights: HashMap<String, Tensor>,
        device: &Device,
    ) -> candle_core::Result<LlamaTwin> {
        let positions = train.seq.min(config.max_position_embeddings);
        let block = Arc::new(LlamaBlock::new(&config, positions, device)?);
        Self::with_block(config, block, train, weights, device)
    }

    /// [`LlamaTwin::new`] for a model whose blocks are `block` ([`Trainer::with_block`]).
    pub fn with_block(
        config: LlamaConfig,
        block: Arc<dyn Block>,
        train: TrainConfig,
        weights: HashMap<String, Tensor>,
        device: &Device,
    ) -> candle_core::Result<LlamaTwin> {
        let first = weights.values().next().map(|t| t.dtype());
        let dtype = if first == Some(CDType::BF16) { DType::BF16 } else { DType::F32 };
        train.validate(&config, dtype, device)?;
        let base = model_tensors(&config, block.as_ref());
        let specs = match &train.lora {
            Some(l) => adapter_specs(&config, block.as_ref(), l)?,
            None => Vec::new(),
        };
        let mut params = Vec::new();
        let mut dtype = None;
        for (name, shape, init) in run_params(&base, &specs) {
            let t = match init {
                Init::Given => {
                    let t = weights
                        .get(&name)
                        .ok_or_else(|| {
                            candle_core::Error::CannotFindTensor { path: name.clone() }.bt()
                        })?
                        .to_device(device)?;
                    let d = t.dtype();
                    if *dtype.get_or_insert(d) != d || !matches!(d, CDType::F32 | CDType::BF16) {
                        candle_core::bail!(
                            "{name} is {d:?}: one dtype, f32 or bf16, for every parameter"
                        );
                    }
                    t
                }
                _ => Tensor::from_vec(
                    init_values(init, &shape, train.lora.as_ref()),
                    shape.as_slice(),
                    device,
                )?,
            };
            if t.dims() != shape.as_slice() {
                candle_core::bail!("{name} has shape {:?}, the config says {shape:?}", t.dims());
            }
            let trainable = train.is_trained(&name);
            let (var, tensor, state) = if trainable {
                let v = Var::from_tensor(&t)?;
                let tensor = v.as_tensor().clone();
                (Some(v), tensor, Some(DeviceState::new(&t)?))
            } else {
                (None, t, None)
            };
            params.push(TwinParam { name, shape, var, tensor, state });
        }
        let kernels = Kernels::for_device(device)?;
        let block_tensors = block.tensors();
        Ok(LlamaTwin { config, train, block, block_tensors, specs, params, step: 0, kernels })
    }

    fn tensor(&self, name: &str) -> Option<&Tensor> {
        self.params.iter().find(|p| p.name == name).map(|p| &p.tensor)
    }

    fn needed(&self, name: &str) -> candle_core::Result<&Tensor> {
        self.tensor(name)
            .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.to_string() }.bt())
    }

    /// The f32 logits (`[batch · seq, vocab]`) of `ids` (`[batch, seq]`, u32).
    pub fn logits(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        self.logits_from(&embed(self.needed(EMBED)?, ids)?)
    }

    /// The f32 logits from the embedding's output `x` (`[batch, seq, hidden]`): the blocks, the
    /// final norm and the head.
    fn logits_from(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let cfg = &self.config;
        let scale = self.train.lora.as_ref().map_or(1.0, LoraConfig::scale);
        let mut x = x.clone();
        for l in 0..cfg.num_hidden_layers {
            let w = block_weights(&self.block_tensors, &self.specs, scale, l, |n| {
                self.tensor(n).cloned()
            })?;
            x = self.block.forward(l, &w, &x)?;
        }
        let [norm, head] = cfg.head_names();
        head_logits(cfg, &x, self.needed(norm)?, self.needed(head)?)
    }

    /// One step over `batches`, as [`Trainer::step`]; returns the loss.
    ///
    /// Each micro-batch runs through candle's plain backward over the whole model, from the
    /// embedding's output on: the gradients are summed into one f32 buffer per parameter in
    /// place, and the embedding's rows added into its buffer (after the head's share when the
    /// embeddings are tied) in f32, as the trainer makes them.
    pub fn step(&mut self, batches: &[Tensor]) -> candle_core::Result<f32> {
        self.step_masked(batches, None)
    }

    /// One step over `batches` with loss masks, as [`Trainer::step_masked`]; returns the loss.
    pub fn step_masked(
        &mut self,
        batches: &[Tensor],
        masks: Option<&[Tensor]>,
    ) -> candle_core::Result<f32> {
        let t = &self.train;
        check_batches(t, &self.config, batches)?;
        let masks = masks.map(|m| prepare_masks(t, m)).transpose()?;
        let counted = masks.as_ref().map_or(t.micro_batch * t.seq * t.accum, |m| m.1);
        let mut acc: Vec<Option<Tensor>> = self.params.iter().map(|_| None).collect();
        let mut losses = Vec::with_capacity(batches.len());
        let mut rows = Vec::with_capacity(batches.len());
        for (m, b) in batches.iter().enumerate() {
            let (ids, targets) = inputs_and_targets(b)?;
            let mask = masks.as_ref().map(|ms| &ms.0[m]);
            // The embedding's backward is the trainer's (below), so its output is a leaf here.
            let x = Var::from_tensor(&embed(&self.needed(EMBED)?.detach(), &ids)?)?;
            let logits = self.logits_from(x.as_tensor())?;
            let l = next_token_loss_masked(&logits, &targets, mask, 1.0 / counted as f64)?;
            let grads = l.backward()?;
            losses.push(l);
            for (p, a) in self.params.iter().zip(acc.iter_mut()) {
                let Some(v) = &p.var else { continue };
                match grads.get(v) {
                    Some(g) => add_grad(a, g)?,
                    // An untied embedding: no gradient but its rows' (below).
                    None if p.name == EMBED => {}
                    None => candle_core::bail!("no gradient reached {}", p.name),
                }
            }
            rows.push((ids, grad_of(&grads, x.as_tensor(), "the embedding's output")?));
        }
        if let Some((p, a)) = self.params.iter().zip(acc.iter_mut()).find(|(p, _)| p.name == EMBED)
        {
            if p.var.is_some() {
                let (v, h) = (self.config.vocab_size, self.config.hidden_size);
                let dev = p.tensor.device();
                let table = match a.take() {
                    Some(t) => t,
                    None => Tensor::zeros((v, h), CDType::F32, dev)?,
                };
                let mb: Vec<(&Tensor, &Tensor)> = rows.iter().map(|(i, g)| (i, g)).collect();
                embedding_backward(&table, &mb)?;
                *a = Some(table);
            }
        }
        drop(rows);
        let ss: Vec<Tensor> =
            acc.iter().flatten().map(sum_of_squares).collect::<candle_core::Result<_>>()?;
        let (loss, norm) = loss_and_norm(&losses, &ss)?;
        let scale = clip_factor(norm, self.train.clip);
        let lr = self.train.schedule.lr(self.step);
        let h = AdamW { lr, ..self.train.adamw };
        let t = self.step + 1;
        for (p, a) in self.params.iter().zip(acc) {
            let (Some(var), Some(state), Some(g)) = (&p.var, &p.state, a) else { continue };
            state.step(&g, &h, t, scale, &self.kernels)?;
            // The compute copy: the master rounded to the parameter's dtype (to nearest, ties
            // to even, as the trainer's optimizer rounds it).
            let master = state.master()?.reshape(p.shape.as_slice())?;
            var.set(&master.to_dtype(p.tensor.dtype())?)?;
        }
        self.step += 1;
        Ok(loss)
    }

    /// A parameter's values (f32): the model's, or a LoRA adapter's.
    pub fn param(&self, name: &str) -> candle_core::Result<Vec<f32>> {
        self.needed(name)?.flatten_all()?.to_dtype(CDType::F32)?.to_vec1::<f32>()
    }

    /// A trainable parameter's fp32 master weights (`None` for a frozen one), read from the
    /// device.
    pub fn master(&self, name: &str) -> candle_core::Result<Option<Vec<f32>>> {
        match self.params.iter().find(|p| p.name == name).and_then(|p| p.state.as_ref()) {
            Some(s) => Ok(Some(s.master()?.to_vec1::<f32>()?)),
            None => Ok(None),
        }
    }

    /// The twin's model as an [`InMemoryLlama`](super::InMemoryLlama) that generates: the
    /// twin's own tensors (no copy: what later steps change, it sees), its adapters applied
    /// unmerged, computing in the weights' dtype. Only for the Llama block (a [`Block`] of your
    /// own has no KV cache to generate with).
    pub fn generator(&self) -> candle_core::Result<super::InMemoryLlama> {
        if self.block.kind() != "llama" {
            candle_core::bail!(
                "a twin of {} blocks: generation runs the Llama block only",
                self.block.kind()
            );
        }
        let scale = self.train.lora.as_ref().map_or(1.0, LoraConfig::scale);
        let mut blocks = Vec::with_capacity(self.config.num_hidden_layers);
        for l in 0..self.config.num_hidden_layers {
            let w = block_weights(&self.block_tensors, &self.specs, scale, l, |n| {
                self.tensor(n).cloned()
            })?;
            blocks.push(super::llama::BlockWeights::from_weights(&self.config, &w)?);
        }
        let [norm, head] = self.config.head_names();
        super::InMemoryLlama::from_parts(
            &self.config,
            self.needed(EMBED)?.clone(),
            blocks,
            self.needed(norm)?.clone(),
            self.needed(head)?.clone(),
        )
    }
}
