//! Out-of-core training of a Llama-style decoder inside candle: [`Trainer`] runs the model stage by
//! stage with every byte of its state in a strata store, and [`LlamaTwin`](super::LlamaTwin) is the
//! same model trained resident on candle's device with candle's plain `backward`, its reference and
//! its baseline; [`TrainPlan`] chooses the store's budgets for a machine.
//!
//! A step of [`Trainer::step`] over `accum` micro-batches, **layer-major** (all micro-batches
//! pass a stage before the next stage's weights are fetched, so each block's weights cross to
//! the device once per forward and once per backward per step):
//!
//! 1. *forward*: the embedding (the distinct rows the step's inputs pick, gathered on the host
//!    by [`Layers::gather_rows`](super::Layers::gather_rows); the whole table where those would
//!    be no fewer bytes or the device holds it), then each
//!    block, its weights fetched through device views ([`Layers::fetch`](super::Layers::fetch),
//!    the next stage prefetched), each block's input written to the store as an activation
//!    checkpoint (group `Activation`, homed in host memory);
//! 2. *head*: the final norm, the output projection and the cross-entropy over next tokens,
//!    forward and backward at once (candle's autograd, the head's weights as `Var`s, fetched as
//!    variables: [`Layers::fetch_vars`](super::Layers::fetch_vars));
//! 3. *backward*, from the last block down: each block recomputed from its checkpoint, its
//!    weight and input gradients from the backward of `sum(output · grad_output)`; the weight
//!    gradients summed over the micro-batches in place, one f32 buffer a parameter (a tied
//!    table's starting as the head's share), and handed to the store (group `Grad`), where the
//!    optimizer takes them. The trained linear weights need no `Var`: each linear's backward
//!    adds `dYᵀ·X` straight into the weight's f32 buffer, one GEMM with beta = 1
//!    ([`fused::accumulating_linear`](super::fused::accumulating_linear)); the block's other
//!    trained tensors are `Var`s, each micro-batch's gradient added into its buffer. A stage's
//!    gradients are then final, and (the Cpu engine) its update starts at once,
//!    *speculatively*, on the optimizer's thread while the backward goes on with the stages
//!    below: the update first copies what it overwrites (the weights or fp32 masters, the
//!    compute copies, both moments) into a backup of the optimizer's own in the Pinned tier,
//!    reused step to step ([`TrainConfig::speculation_bytes`] bounds them; the stages past it
//!    update after the step). A step after one that clipped does not speculate (it probably
//!    clips too);
//! 4. *update*: [`strata::optim`](crate::compute::optim)'s AdamW (fp32 masters and moments in the
//!    store, group `OptimizerState`; the Cpu engine by default). The loss and the global
//!    gradient norm are summed on the device and read in one host sync. If they are finite and
//!    clip nothing, the speculative updates stand; otherwise they are waited for and undone from
//!    their backups, bit for bit, and the step goes on as if they had never started: the updates
//!    are queued clipped, or (a step that diverged changes nothing: [`TrainError::NonFinite`], or a
//!    skip) not at all. The updates not started yet are queued in the order the next forward
//!    needs them and run while that forward goes on with the stages already updated (a stage's
//!    weights are fetched only after its update has run). [`StepReport`] counts the stages
//!    speculated and undone, and the optimizer's time hidden in the backward, hidden in all and
//!    exposed.
//!
//! Frozen parameters (by name pattern) get no gradient and no state. The learning rate follows
//! [`LrSchedule`] (linear warmup, cosine decay).
//!
//! The blocks are a [`Block`](super::block::Block) ([`Trainer::with_block`]: a block of your own;
//! [`LlamaBlock`](super::block::LlamaBlock) by default). With [`TrainConfig::lora`] the model is a
//! frozen base and LoRA adapters are trained over it, saved in PEFT's format
//! ([`Trainer::save_adapter`], and every checkpoint), started from PEFT's
//! ([`Trainer::load_adapter`]) and merged into a plain checkpoint ([`Trainer::save_merged`]).
//! [`Trainer::step_masked`] puts the loss on some targets only.
//!
//! **A run you can trust with days of work.** A step that fails (the store, the optimizer, candle)
//! leaves the trainer as it was (its speculative updates undone), and retrying it gives the clean
//! step; updates that fail are done
//! again exactly once by the next call, and the last complete step can be saved as soon as the
//! fault has passed. Hyperparameters and sizes are checked before anything is allocated
//! ([`TrainConfig::validate`]), token files are bounded ([`load_tokens`]). [`Trainer::save`] writes
//! a checkpoint into a run directory that is whole or absent (a hidden directory renamed into place
//! once every file is written, flushed and read back, its commit record last: [`Checkpoint`]),
//! keeping the newest few; [`Trainer::resume`] checks every file against the record and the
//! checkpoint's own config against the trainer's before it uses any, then continues as if the run
//! had not stopped. `docs/reliability.md` lists each promise and the test that holds it.
//!
//! On candle's CPU device the trainer and [`LlamaTwin`](super::LlamaTwin) do the same f32
//! operations in the same order, so their losses and weights are equal bit for bit
//! (`tests/candle/train.rs`).

mod adapters;
mod checkpoint;
mod clock;
pub(super) mod config;
mod data;
mod device_adamw;
mod error;
mod grads;
mod homes;
pub(super) mod init;
mod outputs;
mod plan;
pub(super) mod schedule;
pub(super) mod trainer;
pub(super) mod twin;

pub use checkpoint::{Checkpoint, CheckpointFile};
pub use data::{load_tokens, read_input};
pub use error::TrainError;
pub(super) use homes::{candle_to_store, put_host};
pub use outputs::{check_outputs, checkpoint_bytes, OutputPlan};
pub use plan::{trainable_parameters, Budgets, Floor, Overlap, TrainPlan};

// The parts name one another's items through these (`super::TrainConfig`). `TrainConfig`,
// `Trainer`, `LlamaTwin`, `LrSchedule`, `StepReport` and the weight loaders are public at
// `strata::candle::` alone (`candle/mod.rs` re-exports them from their parts).
use super::lora::LoraConfig;
use super::strata_err;
use super::LlamaConfig;
use config::TrainConfig;
use data::{check_batches, prepare_masks};
use error::invalid;
use homes::{put_checkpoint, read_f32};
use init::{block_weights, compute_dtype, init_values, layer_of, run_params, Init};
use schedule::LrSchedule;
use trainer::{new_run_id, refs, Param, StepReport, Trainer};
