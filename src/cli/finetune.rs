//! `strata finetune`: trains a Llama-family decoder (Llama, Mistral, Qwen2 as Hugging Face ships
//! them) inside candle with strata holding every byte of its state: out of core under a device
//! budget ([`strata::candle::Trainer`]), or in memory (`--in-memory`: [`strata::candle::LlamaTwin`],
//! every weight, gradient and AdamW state resident on the device), or both in one run
//! (`--resident-twin`); full training or LoRA adapters (`--lora-rank R`) in PEFT's format.
//!
//! ```text
//! strata finetune --config examples/configs/tiny-llama.json --init random --seed 1 --steps 5 \
//!     --device-budget 256KiB
//! strata finetune --model HuggingFaceTB/SmolLM2-135M-Instruct --jsonl chats.jsonl \
//!     --lora-rank 8 --steps 50 --save ck --save-every 10
//! ```
//!
//! Prints the memory plan (budgets, where each group lives, a step's traffic and floor),
//! refusing a run that cannot fit; a progress bar on stderr (step, loss, tokens/s, bytes moved,
//! ETA) where stderr is a terminal; and per step the loss, tokens/s, model TFLOPS (with attention,
//! and as 6 × parameters × tokens), bytes moved per tier pair, stall, the optimizer's time (run,
//! hidden, exposed and its share of the step, the stages updated speculatively in the backward
//! and undone) and the step's floor `max(compute + the CPU optimizer's part its schedule
//! cannot hide, PCIe bytes / bandwidth, CPU optimizer time, disk)` with the compute measured
//! ([`strata::candle::train::Floor`]). `--in-memory --recompute` is the resident twin that
//! recomputes each block in the backward as out of core does: the like-for-like baseline.
//! The last line of stdout is the final loss. Ctrl-C (SIGINT) or SIGTERM finishes the step in
//! flight, saves a checkpoint (in `--save DIR`, else `./strata-interrupted`) that `--resume`
//! continues, and exits with status 130 (a second Ctrl-C stops at once, saving nothing).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Tensor};

use crate::cli::args::MachineArg;
use crate::cli::model::{self, ModelArg};
use strata::candle::llama::SeededRng;
use strata::candle::lora::LoraConfig;
use strata::candle::train::{load_tokens, Budgets, Checkpoint, Floor, Overlap, TrainPlan};
use strata::candle::{
    load_weights, put_random_weights, LlamaConfig, LlamaTwin, LrSchedule, StepFlops, StepReport,
    TrainConfig, Trainer,
};
use strata::optim::{AdamW, Engine};
use strata::{format_size, DType, Group, Machine, Store, Tier};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// `strata finetune`'s flags (sizes take `KiB`, `MiB`, `GiB`). A training flag not given is
/// `None`: a new run takes the default, a resumed one the checkpoint's (and one given must agree
/// with the checkpoint's).
#[derive(clap::Args, Debug, Clone)]
pub struct FinetuneArgs {
    /// The model's Hugging Face `config.json` (default: the one beside --model).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The base weights: a `.safetensors` file, a sharded checkpoint's index, a directory, a
    /// GGUF file (its config, tokenizer and chat template from its metadata; quantized weights
    /// kept quantized, a frozen base for LoRA), or a Hugging Face id found in the local Hugging
    /// Face cache (Llama, Mistral or Qwen2 names).
    #[arg(long, value_name = "PATH|ID", conflicts_with = "init")]
    pub model: Option<ModelArg>,
    /// Random weights instead of --model (`random`, seeded by --seed).
    #[arg(long, value_name = "random", value_parser = ["random"])]
    pub init: Option<String>,
    /// The seed of random weights, LoRA's A and the synthetic data (default 1).
    #[arg(long)]
    pub seed: Option<u64>,
    /// The dtype of random weights.
    #[arg(long, value_parser = train_dtype, value_name = "f32|bf16")]
    pub dtype: Option<DType>,
    /// Token ids (u32): a `.safetensors` file's first tensor or a raw little-endian file, read
    /// as one stream in windows of seq + 1 (default: a learnable synthetic stream).
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
    /// Tokens a sequence (default 32).
    #[arg(long, value_parser = at_least_one)]
    pub seq: Option<usize>,
    /// Sequences a micro-batch (default 2).
    #[arg(long, value_parser = at_least_one)]
    pub micro_batch: Option<usize>,
    /// Micro-batches a step (default 2).
    #[arg(long, value_parser = at_least_one)]
    pub accum: Option<usize>,
    /// Optimizer steps of the run: the schedule's horizon (default 5).
    #[arg(long, value_parser = positive)]
    pub steps: Option<u64>,
    /// Peak learning rate (default 1e-3).
    #[arg(long, allow_negative_numbers = true)]
    pub lr: Option<f64>,
    /// Learning rate at the end of the cosine schedule (default lr / 10).
    #[arg(long, allow_negative_numbers = true)]
    pub min_lr: Option<f64>,
    /// Linear warm-up steps (default steps / 5).
    #[arg(long)]
    pub warmup: Option<u64>,
    /// AdamW's decoupled weight decay (default 0).
    #[arg(long, allow_negative_numbers = true)]
    pub weight_decay: Option<f64>,
    /// Global gradient-norm clipping (default 1.0; 0: none).
    #[arg(long, value_parser = clip_norm, allow_negative_numbers = true)]
    pub clip: Option<f64>,
    /// The store's Device tier (default: the memory plan's).
    #[arg(long, value_parser = size, value_name = "SIZE")]
    pub device_budget: Option<u64>,
    /// The store's Pinned tier (default: the memory plan's).
    #[arg(long, value_parser = size, value_name = "SIZE")]
    pub pinned_budget: Option<u64>,
    /// Where AdamW runs: cpu, gpu-mapped, gpu-resident or auto.
    #[arg(long, value_parser = engine)]
    pub engine: Option<Engine>,
    /// Host memory for the backups that let the Cpu engine start a stage's update during the
    /// backward, before the gradient norm is known (0: every update after the step; default:
    /// all the Pinned tier has room for).
    #[arg(long, value_parser = size, value_name = "SIZE")]
    pub speculation_budget: Option<u64>,
    /// Parameters left untrained (`*` matches any run of characters); repeatable.
    #[arg(long, value_name = "PATTERN")]
    pub freeze: Vec<String>,
    /// A checkpoint after the last step (and every --save-every steps) in DIR.
    #[arg(long, value_name = "DIR")]
    pub save: Option<PathBuf>,
    /// Save every N steps.
    #[arg(long, value_parser = positive, value_name = "N")]
    pub save_every: Option<u64>,
    /// Checkpoints kept in --save DIR, the newest.
    #[arg(long, value_parser = at_least_one, default_value_t = 2)]
    pub keep: usize,
    /// Stop after step K (a later --resume continues).
    #[arg(long, value_parser = positive, value_name = "K")]
    pub stop_after: Option<u64>,
    /// A step whose loss or gradient is not finite is skipped instead of ending the run.
    #[arg(long)]
    pub skip_nonfinite: bool,
    /// Continue the run whose checkpoint is DIR (a `step-*` directory).
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Write the initial weights and every step's tokens to DIR (for a reference run elsewhere).
    #[arg(long, value_name = "DIR")]
    pub write_inputs: Option<PathBuf>,
    /// The resident twin instead of the out-of-core trainer.
    #[arg(long)]
    pub in_memory: bool,
    /// The resident twin's steps, then the out-of-core trainer's on the same batches, and their
    /// throughputs' ratio.
    #[arg(long)]
    pub resident_twin: bool,
    /// With --in-memory or --resident-twin: the resident twin recomputes each block from its
    /// input in the backward, as out of core does (the like-for-like baseline: the same FLOPs).
    #[arg(long)]
    pub recompute: bool,
    /// Print the memory plan and exit, allocating nothing.
    #[arg(long)]
    pub plan_only: bool,
    /// Plan for a preset machine's figures (written down, not measured here: h100, the lent
    /// H100; h200, the H200 lent now, its PCIe and GEMM rates assumed to be the H100's) instead
    /// of this machine's.
    #[arg(long, value_enum)]
    pub machine: Option<MachineArg>,
    /// The machine's device memory, for the plan.
    #[arg(long, value_parser = size, value_name = "SIZE")]
    pub hbm: Option<u64>,
    /// The machine's host memory, for the plan.
    #[arg(long, value_parser = size, value_name = "SIZE")]
    pub host_memory: Option<u64>,
    /// The machine's disk, for the plan.
    #[arg(long, value_parser = size, value_name = "SIZE")]
    pub disk: Option<u64>,
    /// PCIe bandwidth, GB/s each way.
    #[arg(long, value_parser = rate, value_name = "GB/s")]
    pub pcie: Option<f64>,
    /// The CPU AdamW's memory traffic rate, GB/s.
    #[arg(long, value_parser = rate, value_name = "GB/s")]
    pub host_bandwidth: Option<f64>,
    /// Disk bandwidth, GB/s.
    #[arg(long, value_parser = rate, value_name = "GB/s")]
    pub disk_bandwidth: Option<f64>,
    /// The device's dense bf16 TFLOPS.
    #[arg(long, value_parser = rate, value_name = "X")]
    pub tflops: Option<f64>,
    /// LoRA adapters of rank R over a frozen base: only they are trained.
    #[arg(long, value_parser = at_least_one, value_name = "R")]
    pub lora_rank: Option<usize>,
    /// LoRA's alpha (default 2R).
    #[arg(long, value_name = "A", allow_negative_numbers = true)]
    pub lora_alpha: Option<f64>,
    /// The linears LoRA adapts (default q_proj,v_proj; any of q_proj, k_proj, v_proj, o_proj,
    /// gate_proj, up_proj, down_proj).
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub lora_targets: Option<Vec<String>>,
    /// rsLoRA's scaling (alpha / sqrt(rank)).
    #[arg(long)]
    pub rslora: bool,
    /// Start from a PEFT adapter directory (its config gives rank, alpha and targets).
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,
    /// After the last step, the model with the adapters merged: a Hugging Face model directory.
    #[arg(long, value_name = "DIR")]
    pub export_merged: Option<PathBuf>,
    /// The merged export's weights: f32 or bf16 (default: the base's dtype; a quantized GGUF
    /// base's in f32).
    #[arg(long, value_parser = train_dtype, value_name = "f32|bf16", requires = "export_merged")]
    pub export_dtype: Option<DType>,
    /// A document: tokenized, packed into rows of seq + 1.
    #[arg(long, value_name = "FILE")]
    pub text: Option<PathBuf>,
    /// One example a line (`{"messages": [...]}`, `{"prompt", "completion"}` or `{"text"}`): the
    /// loss on the responses only.
    #[arg(long, value_name = "FILE")]
    pub jsonl: Option<PathBuf>,
    /// A `tokenizer.json` or a GGUF file (default: a GGUF --model's own, else the one beside
    /// --model).
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
}

fn parsed<T: std::str::FromStr>(s: &str, what: &str) -> Result<T, String> {
    s.parse().map_err(|_| format!("{s}: {what} expected"))
}

fn at_least_one(s: &str) -> Result<usize, String> {
    match parsed::<usize>(s, "a whole number ≥ 1") {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{s}: a whole number ≥ 1 expected")),
    }
}

fn positive(s: &str) -> Result<u64, String> {
    match parsed::<u64>(s, "a whole number ≥ 1") {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{s}: a whole number ≥ 1 expected")),
    }
}

fn rate(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("{s}: a finite number > 0 expected")),
    }
}

fn clip_norm(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(c) if c.is_finite() && c >= 0.0 => Ok(c),
        _ => Err(format!(
            "{s}: the gradient norm to clip at must be a finite number ≥ 0 (0: no clipping)"
        )),
    }
}

fn size(s: &str) -> Result<u64, String> {
    strata::parse_size(s).map_err(|e| e.to_string())
}

fn engine(s: &str) -> Result<Engine, String> {
    s.parse::<Engine>().map_err(|e| e.to_string())
}

fn train_dtype(s: &str) -> Result<DType, String> {
    match s {
        "f32" => Ok(DType::F32),
        "bf16" => Ok(DType::BF16),
        _ => Err(format!("{s}: f32 or bf16")),
    }
}

/// The flags, checked against each other, with the machine's figures in their units.
#[derive(Clone)]
struct Args {
    config: Option<PathBuf>,
    model: Option<PathBuf>,
    seed: Option<u64>,
    dtype: Option<DType>,
    data: Option<PathBuf>,
    seq: Option<usize>,
    micro_batch: Option<usize>,
    accum: Option<usize>,
    steps: Option<u64>,
    lr: Option<f64>,
    min_lr: Option<f64>,
    warmup: Option<u64>,
    weight_decay: Option<f64>,
    clip: Option<f64>,
    device_budget: Option<u64>,
    pinned_budget: Option<u64>,
    engine: Option<Engine>,
    speculation_budget: Option<u64>,
    freeze: Vec<String>,
    save: Option<PathBuf>,
    save_every: Option<u64>,
    keep: usize,
    stop_after: Option<u64>,
    skip_nonfinite: bool,
    resume: Option<PathBuf>,
    write_inputs: Option<PathBuf>,
    in_memory: bool,
    resident_twin: bool,
    recompute: bool,
    plan_only: bool,
    machine: Option<MachineArg>,
    hbm: Option<u64>,
    host_memory: Option<u64>,
    disk: Option<u64>,
    pcie: Option<f64>,
    host_bandwidth: Option<f64>,
    disk_bandwidth: Option<f64>,
    tflops: Option<f64>,
    lora_rank: Option<usize>,
    lora_alpha: Option<f64>,
    lora_targets: Option<Vec<String>>,
    rslora: bool,
    adapter: Option<PathBuf>,
    export_merged: Option<PathBuf>,
    export_dtype: Option<DType>,
    text: Option<PathBuf>,
    jsonl: Option<PathBuf>,
    tokenizer: Option<PathBuf>,
}

impl FinetuneArgs {
    /// The flags checked against each other; a Hugging Face id resolved in the local cache.
    fn check(self) -> Res<Args> {
        let model = self.model.as_deref().map(model::resolve).transpose()?;
        // The tokenizer beside the model's weights, where a text run gives none.
        let text_flag = self.text.is_some() || self.jsonl.is_some();
        let tokenizer = match (&self.tokenizer, &model, text_flag) {
            (Some(t), _, _) => Some(t.clone()),
            (None, Some(m), true) => model::tokenizer_path(&m.weights, None),
            _ => None,
        };
        let a = Args {
            config: self.config.or_else(|| model.as_ref().and_then(|m| m.config.clone())),
            model: model.map(|m| m.weights),
            seed: self.seed,
            dtype: self.dtype,
            data: self.data,
            seq: self.seq,
            micro_batch: self.micro_batch,
            accum: self.accum,
            steps: self.steps,
            lr: self.lr,
            min_lr: self.min_lr,
            warmup: self.warmup,
            weight_decay: self.weight_decay,
            clip: self.clip,
            device_budget: self.device_budget,
            pinned_budget: self.pinned_budget,
            engine: self.engine,
            speculation_budget: self.speculation_budget,
            freeze: self.freeze,
            save: self.save,
            save_every: self.save_every,
            keep: self.keep,
            stop_after: self.stop_after,
            skip_nonfinite: self.skip_nonfinite,
            resume: self.resume,
            write_inputs: self.write_inputs,
            in_memory: self.in_memory,
            resident_twin: self.resident_twin,
            recompute: self.recompute,
            plan_only: self.plan_only,
            machine: self.machine,
            hbm: self.hbm,
            host_memory: self.host_memory,
            disk: self.disk,
            pcie: self.pcie.map(|x| x * 1e9),
            host_bandwidth: self.host_bandwidth.map(|x| x * 1e9),
            disk_bandwidth: self.disk_bandwidth.map(|x| x * 1e9),
            tflops: self.tflops.map(|x| x * 1e12),
            lora_rank: self.lora_rank,
            lora_alpha: self.lora_alpha,
            lora_targets: self
                .lora_targets
                .map(|v| v.into_iter().map(|t| t.trim().to_string()).collect()),
            rslora: self.rslora,
            adapter: self.adapter,
            export_merged: self.export_merged,
            export_dtype: self.export_dtype,
            text: self.text,
            jsonl: self.jsonl,
            tokenizer,
        };
        a.checked()
    }
}

impl Args {
    /// A copy to fill in the text flags of a resumed run.
    fn clone_text_flags(&self) -> Args {
        self.clone()
    }

    fn checked(self) -> Res<Args> {
        let a = self;
        let gguf = a.model.as_deref().is_some_and(model::is_gguf);
        if a.config.is_none() && a.resume.is_none() && !gguf {
            return Err(
                "--config is required (or --model DIR with its config.json, or --resume DIR)"
                    .into(),
            );
        }
        let lora_flag = a.lora_alpha.is_some() || a.lora_targets.is_some() || a.rslora;
        if lora_flag && a.lora_rank.is_none() && a.adapter.is_none() {
            return Err("--lora-alpha, --lora-targets and --rslora go with --lora-rank R".into());
        }
        if a.export_merged.is_some()
            && a.lora_rank.is_none()
            && a.adapter.is_none()
            && a.resume.is_none()
        {
            return Err(
                "--export-merged DIR merges LoRA adapters: it goes with --lora-rank R".into()
            );
        }
        if a.in_memory && (a.export_merged.is_some() || a.adapter.is_some()) {
            return Err(
                "--export-merged and --adapter go with the out-of-core trainer, not --in-memory"
                    .into(),
            );
        }
        let texts = [a.text.is_some(), a.jsonl.is_some(), a.data.is_some()];
        if texts.iter().filter(|&&x| x).count() > 1 {
            return Err("--data, --text and --jsonl: one of them".into());
        }
        // A resumed run finds its tokenizer from its base model, as a new run does.
        let text = a.text.is_some() || a.jsonl.is_some();
        if (text && a.tokenizer.is_none() && a.resume.is_none()) || (!text && a.tokenizer.is_some())
        {
            return Err(
                "--text FILE and --jsonl FILE go with --tokenizer FILE (a tokenizer.json; \
                        a GGUF model's own is taken)"
                    .into(),
            );
        }
        if a.recompute && !(a.in_memory || a.resident_twin) {
            return Err("--recompute is the resident twin's (out of core always recomputes): it \
                        goes with --in-memory or --resident-twin"
                .into());
        }
        if a.in_memory && a.resident_twin {
            return Err(
                "--in-memory runs the resident twin alone, --resident-twin both: one of them"
                    .into(),
            );
        }
        if (a.in_memory || a.resident_twin)
            && (a.save.is_some()
                || a.resume.is_some()
                || a.save_every.is_some()
                || a.stop_after.is_some()
                || a.skip_nonfinite)
        {
            return Err(
                "--save, --save-every, --resume, --stop-after and --skip-nonfinite go with \
                        the out-of-core trainer alone, not --in-memory or --resident-twin"
                    .into(),
            );
        }
        if a.save_every.is_some() && a.save.is_none() {
            return Err("--save-every N needs --save DIR".into());
        }
        if a.resume.is_some() && (a.write_inputs.is_some() || a.adapter.is_some()) {
            return Err("--resume DIR continues a run from its checkpoint: --write-inputs and \
                        --adapter go with a new run"
                .into());
        }
        Ok(a)
    }
}

/// The run's training config: the flags over the checkpoint's (a resumed run) or the defaults.
fn train_config(a: &Args, saved: Option<&TrainConfig>) -> TrainConfig {
    let base = saved.cloned().unwrap_or_else(|| {
        let steps = a.steps.unwrap_or(5);
        let lr = a.lr.unwrap_or(1e-3);
        TrainConfig {
            micro_batch: 2,
            seq: 32,
            accum: 2,
            adamw: AdamW { lr, weight_decay: 0.0, ..AdamW::default() },
            schedule: LrSchedule {
                peak: lr,
                min: a.min_lr.unwrap_or(lr / 10.0),
                warmup: a.warmup.unwrap_or(steps / 5),
                total: steps,
            },
            clip: Some(1.0),
            engine: Engine::Cpu,
            optimizer_threads: 0,
            speculation_bytes: TrainConfig::default().speculation_bytes,
            frozen: Vec::new(),
            skip_nonfinite: false,
            lora: None,
        }
    });
    let mut t = base;
    t.micro_batch = a.micro_batch.unwrap_or(t.micro_batch);
    t.seq = a.seq.unwrap_or(t.seq);
    t.accum = a.accum.unwrap_or(t.accum);
    t.schedule.total = a.steps.unwrap_or(t.schedule.total);
    t.schedule.peak = a.lr.unwrap_or(t.schedule.peak);
    t.adamw.lr = t.schedule.peak;
    t.schedule.min = a.min_lr.unwrap_or(t.schedule.min);
    t.schedule.warmup = a.warmup.unwrap_or(t.schedule.warmup);
    t.adamw.weight_decay = a.weight_decay.unwrap_or(t.adamw.weight_decay);
    if let Some(c) = a.clip {
        t.clip = (c > 0.0).then_some(c);
    }
    t.engine = a.engine.unwrap_or(t.engine);
    t.speculation_bytes = a.speculation_budget.unwrap_or(t.speculation_bytes);
    if !a.freeze.is_empty() {
        t.frozen = a.freeze.clone();
    }
    t.skip_nonfinite = a.skip_nonfinite || (saved.is_some() && t.skip_nonfinite);
    t
}

/// The LoRA config the flags ask for: `--adapter`'s (the flags given must agree), the flags',
/// or none; a resumed run keeps its own (flags given must agree).
fn lora_config(a: &Args, saved: Option<&TrainConfig>) -> Res<Option<LoraConfig>> {
    let from_adapter = a.adapter.as_ref().map(LoraConfig::from_peft).transpose()?;
    let base = match (saved, from_adapter) {
        (Some(t), _) => t.lora.clone(),
        (None, Some(c)) => Some(c),
        (None, None) => a.lora_rank.map(|r| LoraConfig {
            seed: a.seed.unwrap_or(1),
            ..LoraConfig::new(r, 2.0 * r as f64, &["q_proj", "v_proj"])
        }),
    };
    let Some(mut c) = base else {
        if a.lora_rank.is_some() {
            return Err(
                "--lora-rank: the run being resumed trains every weight, not adapters".into()
            );
        }
        return Ok(None);
    };
    let source = if saved.is_some() { "the run's" } else { "the adapter's" };
    let fixed = saved.is_some() || a.adapter.is_some();
    if let Some(r) = a.lora_rank.filter(|&r| r != c.rank) {
        if fixed {
            return Err(format!("--lora-rank {r}: {source} rank is {}", c.rank).into());
        }
    }
    match a.lora_alpha {
        Some(x) if fixed && x != c.alpha => {
            return Err(format!("--lora-alpha {x}: {source} alpha is {}", c.alpha).into())
        }
        Some(x) => c.alpha = x,
        None => {}
    }
    if let Some(t) = &a.lora_targets {
        let (mut want, mut have) = (t.clone(), c.targets.clone());
        want.sort();
        have.sort();
        if fixed && want != have {
            return Err(
                format!("--lora-targets {}: {source} are {}", t.join(","), have.join(",")).into()
            );
        }
        c.targets = t.clone();
    }
    if a.rslora && fixed && !c.rslora {
        return Err(format!("--rslora: {source} adapters are not rsLoRA").into());
    }
    c.rslora |= a.rslora;
    Ok(Some(c))
}

/// The step's micro-batches: windows of a token stream, rows of tokenized text (with their
/// loss masks), or the synthetic stream.
struct Data {
    stream: Option<Vec<u32>>,
    /// Rows of `seq + 1` tokens and `seq` loss flags (`--text`, `--jsonl`).
    rows: Option<Vec<(Vec<u32>, Vec<bool>)>>,
    seed: u64,
    vocab: usize,
    /// What a checkpoint's notes say of it (the file, its size and crc32, or the seed).
    notes: BTreeMap<String, String>,
}

impl Data {
    fn load(path: Option<&PathBuf>, seed: u64, vocab: usize, seq: usize) -> Res<Data> {
        let mut notes = BTreeMap::new();
        let stream = match path {
            None => {
                notes.insert("data".to_string(), "synthetic".to_string());
                notes.insert("seed".to_string(), seed.to_string());
                None
            }
            Some(p) => {
                let ids = load_tokens(p, vocab, seq)?;
                let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
                notes.insert("data".to_string(), p.display().to_string());
                notes.insert("data_tokens".to_string(), ids.len().to_string());
                notes.insert("data_crc32".to_string(), format!("{:08x}", crc32fast::hash(&bytes)));
                Some(ids)
            }
        };
        Ok(Data { stream, rows: None, seed, vocab, notes })
    }

    /// Rows of tokenized text: `--text FILE` (one document, every target counted) or `--jsonl
    /// FILE` (examples with their loss masks), packed into rows of `seq + 1`; rows with no
    /// target counted are left out.
    #[cfg(feature = "text")]
    fn text(a: &Args, vocab: usize, seq: usize) -> Res<Data> {
        use strata::candle::text::{pack, read_jsonl_file, read_text_input, Tokens};
        let tok_path = a.tokenizer.as_ref().ok_or("--tokenizer FILE is needed")?;
        let side = model::text_side(tok_path, vocab)?;
        let tokenizer = &side.tokenizer;
        let eos = side.eos.first().copied();
        let (path, examples) = match (&a.text, &a.jsonl) {
            (Some(p), _) => {
                let text = read_text_input(p)?;
                (p, vec![Tokens::document(tokenizer, &text, eos)?])
            }
            (None, Some(p)) => {
                let text = read_text_input(p)?;
                (p, read_jsonl_file(p, &text, tokenizer, side.template.as_ref(), eos)?)
            }
            _ => return Err("--text FILE or --jsonl FILE".into()),
        };
        let (rows, left) = pack(&examples, seq)?;
        let all = rows.len();
        let rows: Vec<(Vec<u32>, Vec<bool>)> = rows
            .into_iter()
            .filter(|r| r.loss.iter().any(|&l| l))
            .map(|r| (r.tokens, r.loss))
            .collect();
        if rows.is_empty() {
            return Err(format!("{}: no row has a target in the loss", path.display()).into());
        }
        if let Some(bad) = rows.iter().flat_map(|r| r.0.iter()).find(|&&t| t as usize >= vocab) {
            return Err(format!(
                "the tokenizer gave id {bad}, past the model's vocabulary of {vocab}"
            )
            .into());
        }
        let tokens: usize = examples.iter().map(|e| e.ids.len()).sum();
        let counted: usize = rows.iter().map(|r| r.1.iter().filter(|&&l| l).count()).sum();
        out!(
            "data: {} ({} examples), {tokens} tokens in {all} rows of {} ({left} left over), {} rows with targets in the loss, {counted} targets counted",
            path.display(),
            examples.len(),
            seq + 1,
            rows.len()
        )?;
        let bytes: Vec<u8> = rows
            .iter()
            .flat_map(|(t, l)| {
                t.iter().flat_map(|x| x.to_le_bytes()).chain(l.iter().map(|&b| b as u8))
            })
            .collect();
        let notes = BTreeMap::from([
            ("data".to_string(), path.display().to_string()),
            ("data_tokens".to_string(), tokens.to_string()),
            ("data_crc32".to_string(), format!("{:08x}", crc32fast::hash(&bytes))),
            (
                "data_format".to_string(),
                if a.text.is_some() { "text" } else { "jsonl" }.to_string(),
            ),
        ]);
        Ok(Data { stream: None, rows: Some(rows), seed: 0, vocab, notes })
    }

    #[cfg(not(feature = "text"))]
    fn text(_: &Args, _: usize, _: usize) -> Res<Data> {
        Err("--text and --jsonl need the example built with --features text".into())
    }

    /// The step's loss masks (`None`: every target counts).
    fn masks(&self, step: u64, t: &TrainConfig, device: &Device) -> Res<Option<Vec<Tensor>>> {
        let Some(rows) = &self.rows else { return Ok(None) };
        if rows.iter().all(|r| r.1.iter().all(|&l| l)) {
            return Ok(None);
        }
        let mut out = Vec::with_capacity(t.accum);
        for m in 0..t.accum {
            let mut v = Vec::with_capacity(t.micro_batch * t.seq);
            for r in 0..t.micro_batch {
                let row = &rows[self.row(step, t, m, r) % rows.len()];
                v.extend(row.1.iter().map(|&l| if l { 1f32 } else { 0.0 }));
            }
            out.push(Tensor::from_vec(v, (t.micro_batch, t.seq), device)?);
        }
        Ok(Some(out))
    }

    /// Sequence number k of the run (micro-batch `m`, row `r` of step `step`).
    fn row(&self, step: u64, t: &TrainConfig, m: usize, r: usize) -> usize {
        let k =
            (u128::from(step) * t.accum as u128 + m as u128) * t.micro_batch as u128 + r as u128;
        match &self.rows {
            Some(rows) => (k % rows.len() as u128) as usize,
            None => k as usize,
        }
    }

    fn batches(&self, step: u64, t: &TrainConfig, device: &Device) -> Res<Vec<Tensor>> {
        let row = t.seq + 1;
        let mut out = Vec::with_capacity(t.accum);
        for m in 0..t.accum {
            let mut v = Vec::with_capacity(t.micro_batch * row);
            for r in 0..t.micro_batch {
                // Sequence number k of the run, in u128: no step number overflows it.
                let k = (u128::from(step) * t.accum as u128 + m as u128) * t.micro_batch as u128
                    + r as u128;
                if let Some(rows) = &self.rows {
                    v.extend_from_slice(&rows[self.row(step, t, m, r)].0);
                    continue;
                }
                match &self.stream {
                    Some(s) => {
                        let n = s.len() as u128;
                        let start = k * t.seq as u128 % n;
                        v.extend((0..row).map(|i| s[((start + i as u128) % n) as usize]));
                    }
                    None => {
                        let mut rng = SeededRng::new(self.seed ^ 0xDA7A_0000 ^ (k as u64) << 20);
                        let start = rng.below(self.vocab as u64);
                        let stride = 1 + rng.below(3);
                        v.extend(
                            (0..row as u64)
                                .map(|i| ((start + i * stride) % self.vocab as u64) as u32),
                        );
                    }
                }
            }
            out.push(Tensor::from_vec(v, (t.micro_batch, row), device)?);
        }
        Ok(out)
    }
}

/// How a `strata finetune` run ended (an error aside).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Every step asked for ran (or there was nothing to do).
    Done,
    /// Ctrl-C or SIGTERM: the step in flight finished and a checkpoint was saved.
    Interrupted,
}

/// Ctrl-C (SIGINT) and SIGTERM as a flag the run reads between steps; a second one of either
/// ends the process at once with status 130.
fn interrupt_flag() -> Res<Arc<AtomicBool>> {
    let flag = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        // The order matters: the conditional shutdown sees the flag before this signal sets it.
        signal_hook::flag::register_conditional_shutdown(sig, 130, Arc::clone(&flag))?;
        signal_hook::flag::register(sig, Arc::clone(&flag))?;
    }
    Ok(flag)
}

/// The checkpoint `--resume` names, and the run's settings from it: a flag given must agree.
fn resumed(a: &Args) -> Res<Option<Checkpoint>> {
    let Some(dir) = &a.resume else { return Ok(None) };
    let ck = Checkpoint::open(dir)?;
    if let Some(d) = a.dtype.filter(|&d| d != ck.dtype) {
        return Err(format!("--dtype {d}: the run's weights are {}", ck.dtype).into());
    }
    if let Some(steps) = a.steps.filter(|&s| s != ck.train.schedule.total) {
        return Err(format!(
            "--steps {steps}: the run in {} was planned for {} steps (its schedule's horizon); \
             a run is continued to the horizon it planned: leave --steps out, or start a new \
             run from its weights ({})",
            ck.path.display(),
            ck.train.schedule.total,
            ck.start_from()
        )
        .into());
    }
    Ok(Some(ck))
}

/// Runs `strata finetune` with these flags.
pub fn run(args: FinetuneArgs) -> Res<Ended> {
    let a = args.check()?;
    let stop = interrupt_flag()?;
    let ck = resumed(&a)?;
    if let Some(ck) = &ck {
        if ck.finished() {
            if let Some(dir) = &a.export_merged {
                return Err(format!(
                    "--export-merged {}: the run in {} is finished (step {} of {}), and a \
                     finished run is not trained again: merge its adapter with `strata \
                     generate --model BASE --adapter {}`, or export from a run that has steps \
                     left",
                    dir.display(),
                    ck.path.display(),
                    ck.step,
                    ck.train.schedule.total,
                    ck.path.display()
                )
                .into());
            }
            out!(
                "{}: the run is finished (step {} of {}): nothing to do",
                ck.path.display(),
                ck.step,
                ck.train.schedule.total
            )?;
            return Ok(Ended::Done);
        }
    }
    let config = match (&a.config, &ck, &a.model) {
        (Some(p), _, _) => LlamaConfig::from_file(p)?,
        (None, Some(ck), _) => ck.config.clone(),
        (None, None, Some(m)) if model::is_gguf(m) => {
            LlamaConfig::from_gguf(&strata::Gguf::open(m)?)?
        }
        (None, None, Some(m)) => LlamaConfig::from_file(m.join("config.json"))?,
        (None, None, None) => return Err("--config is required".into()),
    };
    let device = strata::candle::default_device()?;
    let mut train = train_config(&a, ck.as_ref().map(|c| &c.train));
    train.lora = lora_config(&a, ck.as_ref().map(|c| &c.train))?;
    let dtype = ck.as_ref().map_or(a.dtype.unwrap_or(DType::F32), |c| c.dtype);
    // The blocks' attention kernel (STRATA_ATTENTION), refused here when it cannot run: before
    // anything is planned or allocated. (The blocks compute in the weights' dtype: f32 or bf16,
    // or f16 from a checkpoint.)
    let compute_dtype = match dtype {
        DType::BF16 => candle_core::DType::BF16,
        DType::F16 => candle_core::DType::F16,
        _ => candle_core::DType::F32,
    };
    let attention =
        strata::candle::fused::attention_kernel_for(&device, compute_dtype, config.head_dim)?;
    // The memory plan for the machine (this one, or the figures given), made before anything is
    // allocated: a run that cannot fit is refused here.
    let mut machine = a.machine.map_or_else(|| Machine::detect(&device), MachineArg::machine);
    let given = [&a.hbm, &a.host_memory, &a.disk].iter().any(|x| x.is_some());
    given_figures(&mut machine, &a);
    if given {
        let size = |b: Option<u64>| b.map_or("unknown".to_string(), format_size);
        machine.name = format!(
            "{} with {} of device memory, {} of host memory, {} of disk",
            a.machine.map_or("this machine", MachineArg::label),
            size(machine.device_bytes),
            size(machine.host_bytes),
            size(machine.disk_bytes)
        );
    }
    let budgets = Budgets { device: a.device_budget, pinned: a.pinned_budget };
    // The base the run trains over: --model, or the one a resumed run's checkpoint names.
    let base = a
        .model
        .clone()
        .or_else(|| ck.as_ref().and_then(|c| c.notes.get("base_model")).map(PathBuf::from));
    if a.plan_only {
        let plan = plan_for(&config, &train, dtype, &machine, budgets, base.as_deref())?;
        out!(
            "{plan}\nplan's {} ({} on {})",
            plan.floor(&machine, None),
            machine.rates(),
            machine.name
        )?;
        return Ok(Ended::Done);
    }
    // Every size and hyperparameter checked before anything is allocated.
    train.validate(&config, dtype, &device)?;
    let total = train.schedule.total;
    if let Some(k) = a.stop_after {
        let at = ck.as_ref().map_or(0, |c| c.step);
        if k <= at {
            out!("--stop-after {k}: the run is at step {at} already: nothing to do")?;
            return Ok(Ended::Done);
        }
    }
    let saved_notes = ck.as_ref().map(|c| c.notes.clone()).unwrap_or_default();
    let data_path = a
        .data
        .clone()
        .or_else(|| saved_notes.get("data").filter(|d| *d != "synthetic").map(PathBuf::from));
    let seed = a.seed.or_else(|| saved_notes.get("seed").and_then(|s| s.parse().ok())).unwrap_or(1);
    let text_run = a.text.is_some()
        || a.jsonl.is_some()
        || saved_notes.get("data_format").is_some_and(|f| f == "text" || f == "jsonl");
    let data = if text_run {
        // A resumed text run: the tokenizer beside its base model, unless given.
        let mut a = a.clone_text_flags();
        if a.tokenizer.is_none() {
            a.tokenizer = saved_notes
                .get("base_model")
                .and_then(|m| model::tokenizer_path(Path::new(m), None));
        }
        if a.tokenizer.is_none() || (a.text.is_none() && a.jsonl.is_none()) {
            return Err("the run trains on text: give its --text or --jsonl FILE again (and \
                        --tokenizer FILE where its base model has none beside it)"
                .into());
        }
        Data::text(&a, config.vocab_size, train.seq)?
    } else {
        Data::load(data_path.as_ref(), seed, config.vocab_size, train.seq)?
    };
    if ck.is_some() {
        // The same tokens (a file's may have moved: its content is what counts).
        for k in ["seed", "data_tokens", "data_crc32"] {
            let (was, is) = (saved_notes.get(k), data.notes.get(k));
            if was.is_some() && was != is {
                return Err(format!(
                    "the run was trained on {} ({k} {}), this is {} ({k} {}): resume with the \
                     run's data",
                    saved_notes.get("data").map_or("?", String::as_str),
                    was.map_or("none", String::as_str),
                    data.notes["data"],
                    is.map_or("none", String::as_str),
                )
                .into());
            }
        }
    }
    let params = config.parameters();
    let mut notes = data.notes.clone();
    // A LoRA run's checkpoints hold the adapters only: its base is named here.
    let base_model = a.model.clone().or_else(|| saved_notes.get("base_model").map(PathBuf::from));
    match &base_model {
        Some(m) => notes.insert("base_model".into(), m.display().to_string()),
        None => notes.insert("base_seed".into(), seed.to_string()),
    };
    out!(
        "model: {} blocks, hidden {}, {} heads ({} key/value), intermediate {}, vocab {}{}: {:.2} M parameters",
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.intermediate_size,
        config.vocab_size,
        if config.tie_word_embeddings { ", tied embeddings" } else { "" },
        params as f64 / 1e6
    )?;
    out!(
        "training: {} steps of {} micro-batches of {} x {} tokens; lr {} (min {}, warmup {}), clip {}, engine {}",
        total, train.accum, train.micro_batch, train.seq, train.schedule.peak, train.schedule.min,
        train.schedule.warmup,
        train.clip.map_or("none".to_string(), |c| c.to_string()),
        train.engine
    )?;
    if let Some(l) = &train.lora {
        let trained = strata::candle::train::trainable_parameters(&config, &train)
            .map_err(|e| format!("--lora-rank {}: {e}", l.rank))?;
        out!(
            "LoRA: rank {}, alpha {} (scale {}), targets {}{}: {} trainable parameters ({:.3}% of the model), the base frozen",
            l.rank, l.alpha, l.scale(), l.targets.join(","),
            if l.rslora { ", rsLoRA" } else { "" },
            trained,
            100.0 * trained as f64 / params as f64
        )?;
    }

    // A merged export of a GGUF base carries the file's tokenizer as Hugging Face's files:
    // one strata cannot read is refused now, not after the run.
    if a.export_merged.is_some() {
        let tokenizer = a
            .tokenizer
            .clone()
            .or_else(|| base_model.as_deref().and_then(|m| model::tokenizer_path(m, None)));
        if let Some(t) = tokenizer.filter(|t| model::is_gguf(t)) {
            strata::candle::text::GgufText::read(&strata::Gguf::open(&t)?).map_err(|e| {
                format!("--export-merged: the tokenizer of {} for the export: {e}", t.display())
            })?;
        }
    }
    // Every output the run will write, checked before anything is allocated or trained: a bad
    // target must not cost the whole run.
    let export_dtype = a.export_dtype.unwrap_or(dtype);
    let params_bytes = config.parameters().saturating_mul(export_dtype.size_of() as u64);
    strata::candle::train::check_outputs(&strata::candle::train::OutputPlan {
        save: a.save.clone(),
        resuming: ck.as_ref().map(|c| c.run),
        checkpoint_bytes: strata::candle::train::checkpoint_bytes(&config, &train, dtype)?,
        export_merged: a.export_merged.clone(),
        export_bytes: params_bytes,
        write_inputs: a.write_inputs.clone(),
    })?;

    // The store at the plan's budgets: the Device tier, host memory for the weights, the
    // optimizer's gradients, masters and moments and the checkpoints, Disk for what memory
    // cannot hold.
    let out_of_core = !a.in_memory;
    let plan = if out_of_core {
        let plan = plan_for(&config, &train, dtype, &machine, budgets, base.as_deref())?;
        out!("{plan}")?;
        Some(plan)
    } else {
        None
    };
    let [device_budget, pinned, mapped, disk] = if let Some(plan) = &plan {
        plan.budgets
    } else {
        // The twin computes outside the store, which only holds the initial weights.
        let weights = params.checked_mul(dtype.size_of() as u64).ok_or("a model past u64")?;
        [16 << 20, weights + (64 << 20), 0, 0]
    };
    let mut builder = Store::builder()
        .capacity(Tier::Device, device_budget)
        .prefetch_budget(device_budget)
        .capacity(Tier::Pinned, pinned)
        // Mapped holds the GpuMapped engine's state: its bytes, and room for each tensor's pages.
        .capacity(Tier::Mapped, if mapped > 0 { mapped + mapped / 64 + (1 << 20) } else { 0 });
    if disk > (48 << 30) {
        builder = builder.capacity(Tier::Disk, disk + (1 << 30));
    }
    let store = strata::candle::store_for(&device, builder)?;
    out!("candle device: {device:?}; strata: {}", store.backend_description())?;
    out!("attention: {attention}")?;
    if out_of_core && (a.pcie.is_none() || a.host_bandwidth.is_none()) {
        // This machine's link and host, measured: the figures a preset gave for them are
        // another machine's.
        // (At the run's size: a small model is not kept waiting by copies of hundreds of MiB.)
        let step_bytes = plan
            .as_ref()
            .map_or(u64::MAX, |p| (p.pcie.0 + p.pcie.1).max(p.optimizer_bytes).max(p.disk_io));
        machine.measure_for(&store, train.optimizer_threads, step_bytes)?;
        given_figures(&mut machine, &a);
        if a.machine.is_some() {
            machine.name.push_str(", its link and host rates measured on this machine");
        }
    }
    if let Some(plan) = &plan {
        out!(
            "plan's {} ({} on {}{}; the steps below measure their compute)",
            plan.floor(&machine, None),
            machine.rates(),
            machine.name,
            if store.cuda_context().is_none() {
                "; host backend: \"PCIe\" is a memcpy"
            } else {
                ""
            }
        )?;
    }
    // A LoRA run's checkpoint holds no base: the base is the run's --model (or its seed).
    let lora_resume = ck.as_ref().is_some_and(|c| c.train.lora.is_some());
    let weights = match (&base_model, &ck) {
        // A GGUF base's f16 and bf16 weights beside others, widened to f32 for the trainer.
        (Some(p), _) if (ck.is_none() || lora_resume) && model::is_gguf(p) => {
            strata::candle::widen_for_training(&store, load_weights(&store, &config, p)?)?
        }
        (Some(p), _) if ck.is_none() || lora_resume => load_weights(&store, &config, p)?,
        (_, Some(ck)) if !lora_resume => {
            load_weights(&store, &config, ck.path.join("model.safetensors.index.json"))?
        }
        _ => put_random_weights(&store, &config, seed, dtype)?,
    };
    if let Some(dir) = &a.write_inputs {
        write_inputs(dir, &store, &config, &weights, &data, &train, total)?;
    }
    let first_ids = data.batches(0, &train, &device)?[0].narrow(1, 0, train.seq)?;
    let step_tokens = (train.micro_batch * train.seq * train.accum) as u64;
    let flops = config.step_flops(step_tokens, train.seq, train.lora.is_some());
    out!(
        "model FLOPs a step: {:.3e} with attention (the TFLOPS below), {:.3e} as 6 × parameters \
         × tokens (MegaTrain's count{}), {:.3e} executed with the recomputed forward",
        flops.with_attention,
        flops.parameter_count,
        if train.lora.is_some() { "; 4 × with the base frozen" } else { "" },
        flops.executed
    )?;
    let tokens = step_tokens as f64;

    let mut losses = Vec::new();
    let mut twin_times = Vec::new();
    if a.in_memory || a.resident_twin {
        let mut init = HashMap::new();
        for (name, id) in &weights {
            let info = store.info(*id)?;
            if info.dtype.is_quantized() && train.is_trained(name) {
                return Err(format!(
                    "{name} is {}: a quantized weight is not trained; train LoRA adapters over \
                     it (--lora-rank R) or --freeze it",
                    info.dtype
                )
                .into());
            }
            let t = match info.dtype {
                DType::BF16 => Tensor::from_vec(
                    store.read_vec::<half::bf16>(*id)?,
                    info.shape.as_slice(),
                    &device,
                )?,
                // A GGUF base's quantized weights, dequantized as the out-of-core trainer does.
                q if q.is_quantized() => Tensor::from_vec(
                    strata::quant::dequantize(q, &store.read(*id)?)?,
                    info.shape.as_slice(),
                    &device,
                )?,
                _ => Tensor::from_vec(store.read_vec::<f32>(*id)?, info.shape.as_slice(), &device)?,
            };
            init.insert(name.clone(), t);
        }
        let mut twin = LlamaTwin::new(config.clone(), train.clone(), init, &device)?;
        twin.set_recompute(a.recompute);
        out!(
            "resident twin: every weight, gradient and AdamW state on the device, {}",
            if a.recompute {
                "each block recomputed from its input in the backward, as out of core does"
            } else {
                "candle's backward without recompute"
            }
        )?;
        let mut bar = Progress::new(0, total);
        for step in 0..total {
            let b = data.batches(step, &train, &device)?;
            let m = data.masks(step, &train, &device)?;
            let t = Instant::now();
            let loss = twin.step_masked(&b, m.as_deref())?;
            device.synchronize()?;
            let s = t.elapsed().as_secs_f64();
            bar.println(&format!(
                "step {}/{total}: loss {loss:.6}  {:.0} tokens/s  {:.4} TFLOPS ({:.4} as 6 × \
                 parameters × tokens)  ({:.1} ms)",
                step + 1,
                tokens / s,
                flops.with_attention / s / 1e12,
                flops.parameter_count / s / 1e12,
                s * 1e3
            ))?;
            bar.step(step + 1, loss, tokens / s, 0);
            if step == 0 {
                attention_ran(&bar)?;
            }
            losses.push(loss);
            if stop.load(Ordering::SeqCst) {
                bar.finish();
                out!(
                    "interrupted after step {} of {total} (the resident twin saves nothing)",
                    step + 1
                )?;
                return Ok(Ended::Interrupted);
            }
            twin_times.push(s);
        }
    }
    if out_of_core {
        let prefix = if a.resident_twin { "out of core " } else { "" };
        let mut trainer =
            Trainer::new(store.clone(), &device, config.clone(), train.clone(), weights)?;
        if let Some(ck) = &ck {
            trainer.resume(&ck.path)?;
            out!("resumed {} at step {}", ck.path.display(), trainer.steps())?;
        }
        trainer.set_notes(notes);
        if let Some(dir) = &a.adapter {
            trainer.load_adapter(dir)?;
            out!("adapters from {}", dir.display())?;
        }
        if let Some(dir) = &a.write_inputs {
            if train.lora.is_some() {
                trainer.save_adapter(dir.join("adapter"))?;
                out!("wrote the initial adapters to {}", dir.join("adapter").display())?;
            }
        }
        store_now(&store)?;
        let end = a.stop_after.map_or(total, |k| k.min(total));
        let mut saved = trainer.steps();
        let save = |trainer: &mut Trainer, dir: &Path| -> Res<()> {
            let p = trainer.save_keeping(dir, a.keep)?;
            out!("saved {} (step {})", p.display(), trainer.steps())?;
            Ok(())
        };
        let cpu_optimizer = trainer.optimizer().is_some_and(|o| o.engine() == Engine::Cpu);
        let overlap = Overlap::of(&config, &train);
        let mut ooc_times = Vec::new();
        if stop.load(Ordering::SeqCst) {
            out!("interrupted before step {}: nothing new to save", trainer.steps() + 1)?;
            return Ok(Ended::Interrupted);
        }
        let mut bar = Progress::new(trainer.steps(), end);
        let mut interrupted = false;
        let first = trainer.steps();
        for step in trainer.steps()..end {
            let b = data.batches(step, &train, &device)?;
            let m = data.masks(step, &train, &device)?;
            let r = trainer.step_masked(&b, m.as_deref())?;
            // The step's updates all started during the backward, or all after it.
            let mut overlap = overlap.clone();
            overlap.during_backward =
                trainer.speculates_every_stage() && r.speculated > 0 && r.undone == 0;
            let floor = Floor::measured(&r, &machine, cpu_optimizer, &overlap);
            bar.println(&report(prefix, &r, total, &flops, &floor))?;
            let moved: u64 = r.moved.iter().flatten().sum();
            bar.step(step + 1, r.loss, r.tokens as f64 / r.seconds, moved);
            if step == first {
                attention_ran(&bar)?;
            }
            ooc_times.push(r.seconds);
            if !a.resident_twin {
                losses.push(r.loss);
            }
            if let (Some(dir), Some(n)) = (&a.save, a.save_every) {
                if trainer.steps() % n == 0 {
                    save(&mut trainer, dir)?;
                    saved = trainer.steps();
                }
            }
            if stop.load(Ordering::SeqCst) {
                interrupted = true;
                break;
            }
        }
        bar.finish();
        let t = Instant::now();
        let waited = trainer.finish()?;
        out!(
            "the last step's updates: waited {:.1} ms for them after the loop ({:.1} ms)",
            waited * 1e3,
            t.elapsed().as_secs_f64() * 1e3
        )?;
        if interrupted {
            let dir = a.save.clone().unwrap_or_else(|| PathBuf::from("strata-interrupted"));
            let p = if saved == trainer.steps() && a.save.is_some() {
                Checkpoint::newest(&dir)?.unwrap_or(dir.clone())
            } else {
                trainer.save_keeping(&dir, a.keep)?
            };
            out!(
                "interrupted after step {} of {total}: saved {}; continue with: strata finetune \
                 --resume {} (and the run's --model, --text/--jsonl and --tokenizer flags)",
                trainer.steps(),
                p.display(),
                p.display()
            )?;
            return Ok(Ended::Interrupted);
        }
        if let Some(dir) = &a.save {
            if saved != trainer.steps() {
                save(&mut trainer, dir)?;
            }
        }
        if trainer.skipped() > 0 {
            out!("skipped {} steps whose loss or gradient was not finite", trainer.skipped())?;
        }
        if let (Some(first), true, None) = (losses.first(), trainer.steps() == total, &ck) {
            // The first step's batch again, through the trained model: what the run learnt.
            let t = Instant::now();
            let b = data.batches(0, &train, &device)?;
            let m = data.masks(0, &train, &device)?;
            let counted = m.as_ref().map_or(Ok(b.len() * train.micro_batch * train.seq), |m| {
                m.iter().try_fold(0usize, |n, x| {
                    Ok::<_, candle_core::Error>(n + x.sum_all()?.to_scalar::<f32>()? as usize)
                })
            })?;
            let mut after = 0f32;
            for (i, tokens) in b.iter().enumerate() {
                let (ids, targets) = strata::candle::llama::inputs_and_targets(tokens)?;
                let mask = m.as_ref().map(|m| m[i].flatten_all()).transpose()?;
                let l = strata::candle::llama::next_token_loss_masked(
                    &trainer.logits(&ids)?,
                    &targets,
                    mask.as_ref(),
                    1.0 / counted as f64,
                )?;
                after += l.to_scalar::<f32>()?;
            }
            out!(
                "the first step's batch through the trained model: loss {after:.6} (it was {first:.6} at step 1; {:.1} s)",
                t.elapsed().as_secs_f64()
            )?;
        }
        if let Some(dir) = &a.export_merged {
            let t = Instant::now();
            trainer.save_merged_as(dir, a.export_dtype)?;
            // A model directory a user can run or upload: the base's tokenizer, chat template
            // and generation config beside the merged weights.
            let tokenizer = a
                .tokenizer
                .clone()
                .or_else(|| base_model.as_deref().and_then(|m| model::tokenizer_path(m, None)));
            match tokenizer {
                // A GGUF base's tokenizer, chat template and special tokens, written as Hugging
                // Face's files.
                Some(t) if model::is_gguf(&t) => {
                    strata::candle::text::GgufText::read(&strata::Gguf::open(&t)?)?
                        .write_hf_files(dir)?;
                }
                t => {
                    let base_dir = base_model
                        .as_deref()
                        .filter(|m| !model::is_gguf(m))
                        .or(t.as_deref().and_then(Path::parent));
                    for f in TEXT_FILES {
                        if let Some(src) = base_dir.and_then(|b| model::beside(b, f)) {
                            copy_whole(&src, &dir.join(f))?;
                        }
                    }
                }
            }
            out!(
                "merged the adapters into the base: {} ({:.1} s)",
                dir.display(),
                t.elapsed().as_secs_f64()
            )?;
        }
        if let (Some(dir), true) = (&a.write_inputs, train.lora.is_some()) {
            // The trained model's logits of the first micro-batch's inputs, for the PEFT check.
            let logits = trainer.logits(&first_ids)?;
            let v = logits.flatten_all()?.to_vec1::<f32>()?;
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                logits.dims().to_vec(),
                &bytes,
            )?;
            safetensors::serialize_to_file(
                [("logits", view)],
                None,
                &dir.join("final_logits.safetensors"),
            )?;
        }
        if end < total {
            out!("stopped after step {end} of {total} (--stop-after)")?;
        }
        let tr = trainer.layers().transfers()?;
        out!(
            "handed to candle: {} tensors, {} through device views, {} from host replicas",
            tr.tensors,
            format_size(tr.view_copy_bytes),
            format_size(tr.host_copy_bytes)
        )?;
        out!("{}", store.stats())?;
        if a.resident_twin {
            against_twin(&config, &train, &twin_times, &ooc_times, a.recompute)?;
        }
    }
    let last = losses.last().ok_or("no step ran")?;
    out!("{last}")?;
    Ok(Ended::Done)
}

/// The machine's figures the flags give (`--hbm`, `--pcie`, ...), each noted as given.
fn given_figures(m: &mut Machine, a: &Args) {
    let mut noted = Vec::new();
    let sizes = [
        (&mut m.device_bytes, a.hbm, "device_bytes"),
        (&mut m.host_bytes, a.host_memory, "host_bytes"),
        (&mut m.disk_bytes, a.disk, "disk_bytes"),
    ];
    for (slot, value, name) in sizes {
        if value.is_some() {
            *slot = value;
            noted.push(name);
        }
    }
    let rates = [
        (&mut m.h2d, a.pcie, "h2d"),
        (&mut m.d2h, a.pcie, "d2h"),
        (&mut m.host_update, a.host_bandwidth, "host_update"),
        (&mut m.disk_read, a.disk_bandwidth, "disk_read"),
        (&mut m.disk_write, a.disk_bandwidth, "disk_write"),
        (&mut m.model_flops, a.tflops, "model_flops"),
    ];
    for (slot, value, name) in rates {
        if value.is_some() {
            *slot = value;
            noted.push(name);
        }
    }
    for figure in noted {
        m.note(figure, "given on the command line");
    }
}

/// The run's memory plan; a GGUF base's weights are planned at the bytes they are stored in
/// (quantized blocks; f16 and bf16 ones widened to f32 beside others at 4 bytes an element),
/// the others at `dtype`'s.
fn plan_for(
    config: &LlamaConfig,
    train: &TrainConfig,
    dtype: DType,
    machine: &Machine,
    budgets: Budgets,
    base: Option<&Path>,
) -> Res<TrainPlan> {
    let Some(path) = base.filter(|p| model::is_gguf(p)) else {
        return Ok(TrainPlan::new(config, train, dtype, machine, budgets)?);
    };
    let file = strata::Gguf::open(path)?;
    let tensors: Vec<(String, &strata::GgufTensor)> = file
        .tensors()
        .iter()
        .filter_map(|t| Some((strata::candle::hf_name(&t.name)?, t)))
        .collect();
    // f16 and bf16 weights beside others are trained widened to f32 (`widen_for_training`).
    let widen = strata::candle::needs_widening(tensors.iter().map(|(_, t)| t.dtype));
    let sizes: HashMap<String, u64> = tensors
        .iter()
        .map(|(name, t)| match t.dtype {
            DType::F16 | DType::BF16 if widen => (name.clone(), 2 * t.bytes),
            _ => (name.clone(), t.bytes),
        })
        .collect();
    let elem = dtype.size_of() as u64;
    let stored = |name: &str, shape: &[usize]| {
        sizes.get(name).copied().unwrap_or(shape.iter().product::<usize>() as u64 * elem)
    };
    Ok(TrainPlan::with_weight_bytes(config, train, dtype, machine, budgets, &stored)?)
}

/// The out-of-core steps' throughput against the resident twin's, in one run: the medians of
/// the steps after the first, and the share of the model's FLOPs in its blocks (what makes the
/// ratio a per-block one).
fn against_twin(
    config: &LlamaConfig,
    train: &TrainConfig,
    twin: &[f64],
    ooc: &[f64],
    recompute: bool,
) -> Res<()> {
    let median = |v: &[f64]| {
        let mut v: Vec<f64> = if v.len() > 1 { v[1..].to_vec() } else { v.to_vec() };
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let (t, o) = (median(twin), median(ooc));
    let tokens = (train.micro_batch * train.seq * train.accum) as f64;
    let blocks = config.num_hidden_layers as f64;
    let per_block = |s: f64| tokens * blocks / s;
    let all = config.step_flops(tokens as u64, train.seq, false).with_attention;
    let head = 6.0 * tokens * (config.vocab_size * config.hidden_size) as f64;
    out!(
        "per block (same run, medians of steps 2 on): resident twin{} {:.0} tokens/s through each \
         block, out of core {:.0}: out of core / resident = {:.3} (the blocks are {:.1}% of the \
         model's FLOPs)",
        if recompute { " (recomputing)" } else { "" },
        per_block(t),
        per_block(o),
        t / o,
        100.0 * (all - head) / all
    )?;
    Ok(())
}

/// Bytes per group and tier, as the store holds them before the first step.
fn store_now(store: &Store) -> Res<()> {
    let s = store.stats();
    out!("the store before the first step (bytes per group and tier):")?;
    out!("{:<12}{:>14}{:>14}{:>14}{:>14}", "group", "device", "pinned", "mapped", "disk")?;
    for g in Group::ALL {
        let row: Vec<String> =
            Tier::ALL.iter().map(|&t| format_size(s.group_bytes(g, t))).collect();
        out!("{:<12}{:>14}{:>14}{:>14}{:>14}", g.name(), row[0], row[1], row[2], row[3])?;
    }
    let caps: Vec<String> = Tier::ALL.iter().map(|&t| format_size(s.capacity(t))).collect();
    out!("{:<12}{:>14}{:>14}{:>14}{:>14}", "budget", caps[0], caps[1], caps[2], caps[3])?;
    Ok(())
}

/// A step's line.
fn report(prefix: &str, r: &StepReport, total: u64, flops: &StepFlops, floor: &Floor) -> String {
    let mut moved = Vec::new();
    for f in Tier::ALL {
        for t in Tier::ALL {
            let b = r.moved[f.index()][t.index()];
            if b > 0 {
                moved.push(format!("{}->{} {}", f.name(), t.name(), format_size(b)));
            }
        }
    }
    // The updates that started during the backward (speculatively), and those undone because
    // the norm said to clip.
    let speculated = match (r.speculated, r.undone) {
        (0, _) => String::new(),
        (s, 0) => format!("; {s} stages updated in the backward"),
        (s, u) => format!("; {s} stages updated in the backward, {u} undone"),
    };
    format!(
        "{prefix}step {}/{total}: loss {:.6}  lr {:.3e}  grad norm {:.4}{}{}  {:.0} tokens/s  {:.4} TFLOPS \
         ({:.4} as 6 × parameters × tokens)  ({:.1} ms)  moved [{}]  stall {:.2} ms  optimizer {:.2} ms \
         (hidden {:.2}, exposed {:.2} = {:.1}% of the step{speculated})  host {:.3} ms a block's \
         micro-batch  {}: step / floor {:.2}",
        r.step + 1,
        r.loss,
        r.lr,
        r.grad_norm,
        if r.clip_scale < 1.0 { format!(" (clipped x{:.4})", r.clip_scale) } else { String::new() },
        if r.skipped { " (skipped: not finite)" } else { "" },
        r.tokens as f64 / r.seconds,
        flops.with_attention / r.seconds / 1e12,
        flops.parameter_count / r.seconds / 1e12,
        r.seconds * 1e3,
        moved.join(", "),
        r.stall_seconds * 1e3,
        r.optimizer_seconds * 1e3,
        r.optimizer_hidden_seconds * 1e3,
        r.optimizer_exposed_seconds * 1e3,
        100.0 * r.optimizer_exposed_seconds / r.seconds.max(f64::MIN_POSITIVE),
        r.block_host_seconds * 1e3,
        floor,
        r.seconds / floor.seconds()
    )
}

/// The files of a model directory beside its weights and config.json that a merged export
/// carries over from its base.
const TEXT_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
];

/// Copies `src` to `dst` whole or not at all: a temporary file beside `dst`, synced, renamed.
fn copy_whole(src: &Path, dst: &Path) -> Res<()> {
    let tmp = dst.with_extension(format!("tmp-{}", std::process::id()));
    let done = std::fs::copy(src, &tmp)
        .and_then(|_| std::fs::File::open(&tmp)?.sync_all())
        .and_then(|()| std::fs::rename(&tmp, dst));
    if let Err(e) = done {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!("copying {} to {}: {e}", src.display(), dst.display()).into());
    }
    Ok(())
}

/// The run's progress bar on stderr (drawn only where stderr is a terminal): step, loss,
/// tokens/s, bytes moved and the time left; step lines go to stdout above it.
/// After a run's first step: what the blocks' attention ran on where cuDNN was asked (the
/// shapes it took, those it refused and why), beside the `attention:` line's expectation.
fn attention_ran(bar: &Progress) -> Res<()> {
    if let Some(ran) = strata::candle::fused::cudnn::asked_so_far() {
        bar.println(&format!("attention ran: {ran}"))?;
    }
    Ok(())
}

struct Progress {
    bar: indicatif::ProgressBar,
    moved: u64,
}

impl Progress {
    fn new(done: u64, total: u64) -> Progress {
        let bar = indicatif::ProgressBar::new(total);
        if let Ok(style) =
            indicatif::ProgressStyle::with_template("step {pos}/{len} [{bar:25}] {msg} eta {eta}")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_position(done);
        Progress { bar, moved: 0 }
    }

    /// Writes `line` to stdout without tearing the bar.
    fn println(&self, line: &str) -> Res<()> {
        self.bar.suspend(|| out!("{line}"))?;
        Ok(())
    }

    fn step(&mut self, done: u64, loss: f32, tokens_per_s: f64, moved: u64) {
        self.moved += moved;
        self.bar.set_message(format!(
            "loss {loss:.4}  {tokens_per_s:.0} tokens/s  moved {}",
            format_size(self.moved)
        ));
        self.bar.set_position(done);
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// The initial weights and every step's tokens, for a run elsewhere (the PyTorch check).
fn write_inputs(
    dir: &PathBuf,
    store: &Store,
    config: &LlamaConfig,
    weights: &[(String, strata::TensorId)],
    data: &Data,
    train: &TrainConfig,
    steps: u64,
) -> Res<()> {
    // Every step's tokens, twice (as ids and as bytes): bounded before anything is made.
    let micro_batches = usize::try_from(steps).ok().and_then(|s| s.checked_mul(train.accum));
    let bytes = micro_batches
        .and_then(|n| n.checked_mul(train.micro_batch * (train.seq + 1)))
        .and_then(|n| n.checked_mul(8))
        .ok_or_else(|| format!("--write-inputs: {steps} steps' tokens overflow"))?;
    if let Some(avail) = strata::host_memory_available() {
        if bytes as u64 > avail {
            return Err(format!(
                "--write-inputs: {steps} steps' tokens need {} of host memory and {} is available",
                format_size(bytes as u64),
                format_size(avail)
            )
            .into());
        }
    }
    std::fs::create_dir_all(dir)?;
    let named: Vec<(strata::TensorId, String)> =
        weights.iter().map(|(n, id)| (*id, n.clone())).collect();
    let quantized =
        weights.iter().any(|(_, id)| store.info(*id).is_ok_and(|i| i.dtype.is_quantized()));
    if quantized {
        // Safetensors cannot hold block-quantized weights: the checker reads the GGUF file.
        out!(
            "--write-inputs: the base is quantized (a GGUF file): its weights are not written \
             (benches/peers/check_lora.py --gguf FILE reads them from the file)"
        )?;
    } else {
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        store.save_safetensors_with(dir.join("model.safetensors"), &named, &meta)?;
    }
    std::fs::write(dir.join("config.json"), config.to_json())?;
    let mut tokens = Vec::new();
    for step in 0..steps {
        for b in data.batches(step, train, &Device::Cpu)? {
            tokens.extend(b.flatten_all()?.to_vec1::<u32>()?);
        }
    }
    let shape = [micro_batches.unwrap_or(0), train.micro_batch, train.seq + 1];
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::U32, shape.to_vec(), &bytes)?;
    safetensors::serialize_to_file([("tokens", view)], None, &dir.join("tokens.safetensors"))?;
    if data.masks(0, train, &Device::Cpu)?.is_some() {
        let mut masks = Vec::new();
        for step in 0..steps {
            for m in data.masks(step, train, &Device::Cpu)?.unwrap_or_default() {
                masks.extend(m.flatten_all()?.to_vec1::<f32>()?);
            }
        }
        let shape = [micro_batches.unwrap_or(0), train.micro_batch, train.seq];
        let bytes: Vec<u8> = masks.iter().flat_map(|t| t.to_le_bytes()).collect();
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.to_vec(), &bytes)?;
        safetensors::serialize_to_file([("masks", view)], None, &dir.join("masks.safetensors"))?;
    }
    out!("wrote the initial weights and {} steps' tokens to {}", steps, dir.display())?;
    Ok(())
}
