//! How a run trains ([`TrainConfig`]), and the checks a config passes before anything is
//! allocated ([`TrainConfig::validate`]).

use candle_core::Device;

use super::{invalid, LlamaConfig, LoraConfig, LrSchedule, TrainError};
use crate::base::types::DType;
use crate::compute::optim::{AdamW, Engine};

/// How [`Trainer`](crate::candle::Trainer) (and [`LlamaTwin`](crate::candle::LlamaTwin)) train.
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
    /// Host memory (bytes) the Cpu engine may keep in backups so that it can start a stage's
    /// update during the backward, as soon as the stage's gradients are final, before the global
    /// gradient norm is known (a *speculative* update, undone exactly from its backup when the
    /// norm says to clip or is not finite; see [`Trainer::step`](crate::candle::Trainer::step)).
    /// A stage's backup is a copy of what its update overwrites (fp32 masters or f32 weights,
    /// bf16 compute copies, both moments: 12–14 bytes a parameter), made once in the Pinned tier
    /// from the head down while this budget and the Pinned tier's free room last (a sixteenth
    /// of the tier, 64 MiB at most, is left free); the stages past them update after the step,
    /// behind the next forward. Default `u64::MAX`: every stage the Pinned tier has room for
    /// (the memory plan's default Pinned tier adds room for them where the host has it). 0: no
    /// speculation (every update after the step).
    pub speculation_bytes: u64,
    /// Name patterns of frozen parameters (`*` matches any run of characters): no gradient,
    /// no optimizer state, never changed.
    pub frozen: Vec<String>,
    /// A step whose loss or gradient norm is not finite is skipped (no update, counted by
    /// [`Trainer::skipped`](crate::candle::Trainer::skipped) and
    /// [`StepReport::skipped`](crate::candle::StepReport::skipped)) instead of failing with
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
            speculation_bytes: u64::MAX,
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

    /// Checks that this config can train a model of `config` with `dtype` weights on `device`,
    /// before anything is allocated: sizes at least 1, `seq` within the model's positions, a peak
    /// learning rate finite and > 0 and a floor finite and ≥ 0, AdamW's betas in [0, 1), its eps
    /// finite and > 0, its weight decay finite and ≥ 0, a clip finite and > 0; every product of
    /// sizes (micro-batch × seq × accum, and what a step computes from them) in checked arithmetic,
    /// and what a step holds in host memory (on the CPU: candle's activations too) no more than the
    /// host has available. Errors are [`TrainError::Invalid`] or [`TrainError::TooLarge`], naming
    /// what was asked and what is allowed or there. [`Trainer::new`](crate::candle::Trainer::new)
    /// and [`LlamaTwin::new`](crate::candle::LlamaTwin::new) call it.
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
