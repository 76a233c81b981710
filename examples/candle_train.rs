//! Trains a Llama-style decoder inside candle with strata holding every byte of its state:
//! out of core under a device budget (`strata::candle::Trainer`), or in memory
//! (`--in-memory`: `strata::candle::LlamaTwin`, candle's plain backward).
//!
//! ```text
//! cargo run --release --features candle --example candle_train -- \
//!     --config examples/configs/tiny-llama.json --init random --seed 1 --steps 5 --device-budget 256KiB
//! ```
//!
//! Flags (sizes take `KiB`, `MiB`, `GiB`):
//! - `--config FILE`: the model's Hugging Face `config.json`;
//! - `--model PATH` (a `.safetensors` file, an index or a directory, Hugging Face Llama names)
//!   or `--init random --seed N` (the default: seed 1);
//! - `--dtype f32|bf16` of random weights (default f32);
//! - `--data FILE`: token ids (u32), a `.safetensors` file's first tensor or a raw
//!   little-endian file, read as one stream in windows of `seq + 1`; without it a synthetic
//!   stream (each row counts up from a random start by a random stride of 1 to 3, modulo the
//!   vocabulary: learnable), seeded by `--seed`;
//! - `--seq N` (32), `--micro-batch N` (2), `--accum N` (2), `--steps N` (5);
//! - `--lr X` (peak, 1e-3), `--min-lr X` (lr / 10), `--warmup N` (steps / 5), `--weight-decay X`
//!   (0), `--clip X` (global gradient-norm clipping, 1.0; 0 for none);
//! - `--device-budget SIZE` (the Device tier; default: the whole model), `--pinned-budget SIZE`
//!   (default: room for everything host-side), `--engine cpu|gpu-mapped|gpu-resident|auto`;
//! - `--freeze PATTERN` (repeatable; `*` matches any run of characters);
//! - `--save DIR` (a checkpoint after the last step), `--resume DIR` (continue one);
//! - `--write-inputs DIR`: writes the initial weights (`model.safetensors`, `config.json`) and
//!   every step's tokens (`tokens.safetensors`, `[steps · accum, micro_batch, seq + 1]`) there,
//!   for `benches/peers/check_llama_train.py`;
//! - `--in-memory`: the in-memory twin instead of the out-of-core trainer.
//!
//! Prints the memory plan (bytes per group and tier), a progress bar (stderr), and per step the
//! loss, tokens/s, model TFLOPS, bytes moved per tier pair, stall, and optimizer time hidden and
//! exposed. The last line of stdout is the final loss.
//!
//! Flags are parsed here by hand, so the example builds with `--no-default-features --features
//! candle` (no CLI dependencies).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{Device, Tensor};
use strata::candle::llama::SeededRng;
use strata::candle::train::{load_tokens, Checkpoint};
use strata::candle::{
    load_weights, put_random_weights, LlamaConfig, LlamaTwin, LrSchedule, StepReport, TrainConfig,
    Trainer,
};
use strata::optim::{AdamW, Engine};
use strata::{format_size, parse_size, DType, Group, Store, Tier};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The flags. A training flag not given is `None`: a new run takes the default, a resumed one
/// the checkpoint's (and one given must agree with the checkpoint's).
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
    freeze: Vec<String>,
    save: Option<PathBuf>,
    save_every: Option<u64>,
    keep: usize,
    stop_after: Option<u64>,
    skip_nonfinite: bool,
    resume: Option<PathBuf>,
    write_inputs: Option<PathBuf>,
    in_memory: bool,
}

const USAGE: &str = "usage: candle_train --config FILE [--model PATH | --init random --seed N] \
[--dtype f32|bf16] [--data FILE] [--seq N] [--micro-batch N] [--accum N] [--steps N] [--lr X] \
[--min-lr X] [--warmup N] [--weight-decay X] [--clip X] [--device-budget SIZE] \
[--pinned-budget SIZE] [--engine cpu|gpu-mapped|gpu-resident|auto] [--freeze PATTERN]... \
[--save DIR [--save-every N] [--keep N]] [--stop-after K] [--skip-nonfinite] [--resume DIR] \
[--write-inputs DIR] [--in-memory]";

fn parse_args(args: Vec<String>) -> Res<Args> {
    let mut a = Args {
        config: None,
        model: None,
        seed: None,
        dtype: None,
        data: None,
        seq: None,
        micro_batch: None,
        accum: None,
        steps: None,
        lr: None,
        min_lr: None,
        warmup: None,
        weight_decay: None,
        clip: None,
        device_budget: None,
        pinned_budget: None,
        engine: None,
        freeze: Vec::new(),
        save: None,
        save_every: None,
        keep: 2,
        stop_after: None,
        skip_nonfinite: false,
        resume: None,
        write_inputs: None,
        in_memory: false,
    };
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--in-memory" => {
                a.in_memory = true;
                continue;
            }
            "--skip-nonfinite" => {
                a.skip_nonfinite = true;
                continue;
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            _ => {}
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let num = || -> Res<u64> {
            value.parse().map_err(|_| format!("{flag} {value}: a whole number expected").into())
        };
        let count = || -> Res<usize> {
            match num().map(usize::try_from) {
                Ok(Ok(n)) if n > 0 => Ok(n),
                _ => Err(format!("{flag} {value}: a whole number ≥ 1 expected").into()),
            }
        };
        let positive = || -> Res<u64> {
            match num() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(format!("{flag} {value}: a whole number ≥ 1 expected").into()),
            }
        };
        let float = || -> Res<f64> {
            value.parse().map_err(|_| format!("{flag} {value}: a number expected").into())
        };
        match flag.as_str() {
            "--config" => a.config = Some(PathBuf::from(&value)),
            "--model" => a.model = Some(PathBuf::from(&value)),
            "--init" if value == "random" => a.model = None,
            "--init" => return Err(format!("--init {value}: only `random`").into()),
            "--seed" => a.seed = Some(num()?),
            "--dtype" => {
                a.dtype = Some(match value.as_str() {
                    "f32" => DType::F32,
                    "bf16" => DType::BF16,
                    _ => return Err(format!("--dtype {value}: f32 or bf16").into()),
                })
            }
            "--data" => a.data = Some(PathBuf::from(&value)),
            "--seq" => a.seq = Some(count()?),
            "--micro-batch" => a.micro_batch = Some(count()?),
            "--accum" => a.accum = Some(count()?),
            "--steps" => a.steps = Some(positive()?),
            "--lr" => a.lr = Some(float()?),
            "--min-lr" => a.min_lr = Some(float()?),
            "--warmup" => a.warmup = Some(num()?),
            "--weight-decay" => a.weight_decay = Some(float()?),
            "--clip" => {
                let c = float()?;
                if !(c.is_finite() && c >= 0.0) {
                    return Err(format!(
                        "--clip {value}: the gradient norm to clip at must be a finite number \
                         ≥ 0 (0: no clipping)"
                    )
                    .into());
                }
                a.clip = Some(c);
            }
            "--device-budget" => a.device_budget = Some(parse_size(&value)?),
            "--pinned-budget" => a.pinned_budget = Some(parse_size(&value)?),
            "--engine" => a.engine = Some(value.parse()?),
            "--freeze" => a.freeze.push(value),
            "--save" => a.save = Some(PathBuf::from(&value)),
            "--save-every" => a.save_every = Some(positive()?),
            "--keep" => a.keep = count()?,
            "--stop-after" => a.stop_after = Some(positive()?),
            "--resume" => a.resume = Some(PathBuf::from(&value)),
            "--write-inputs" => a.write_inputs = Some(PathBuf::from(&value)),
            _ => return Err(format!("unknown flag {flag}\n{USAGE}").into()),
        }
    }
    if a.config.is_none() && a.resume.is_none() {
        return Err(format!("--config is required (or --resume DIR)\n{USAGE}").into());
    }
    if a.in_memory
        && (a.save.is_some()
            || a.resume.is_some()
            || a.save_every.is_some()
            || a.stop_after.is_some()
            || a.skip_nonfinite)
    {
        return Err("--save, --save-every, --resume, --stop-after and --skip-nonfinite go with \
                    the out-of-core trainer, not --in-memory"
            .into());
    }
    if a.save_every.is_some() && a.save.is_none() {
        return Err("--save-every N needs --save DIR".into());
    }
    if a.resume.is_some() && (a.model.is_some() || a.write_inputs.is_some()) {
        return Err("--resume DIR continues a run from its checkpoint's weights: --model and \
                    --write-inputs go with a new run"
            .into());
    }
    Ok(a)
}

/// The candle device: CUDA's first GPU when built with `candle-cuda` and one is present.
fn candle_device() -> Device {
    #[cfg(feature = "candle-cuda")]
    if let Ok(d) = Device::new_cuda(0) {
        return d;
    }
    Device::Cpu
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
    if !a.freeze.is_empty() {
        t.frozen = a.freeze.clone();
    }
    t.skip_nonfinite = a.skip_nonfinite || (saved.is_some() && t.skip_nonfinite);
    t
}

/// The step's micro-batches: windows of a token stream, or the synthetic stream.
struct Data {
    stream: Option<Vec<u32>>,
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
        Ok(Data { stream, seed, vocab, notes })
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

fn main() {
    std::process::exit(candle_train_main(std::env::args().skip(1).collect()));
}

/// The example with these arguments: 0 when it ran (or had nothing to do), 1 on an error.
pub fn candle_train_main(args: Vec<String>) -> i32 {
    match run(args) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("candle_train: {e}");
            1
        }
    }
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
             run from its weights (--model {})",
            ck.path.display(),
            ck.train.schedule.total,
            ck.path.join("model.safetensors.index.json").display()
        )
        .into());
    }
    Ok(Some(ck))
}

fn run(args: Vec<String>) -> Res<()> {
    let a = parse_args(args)?;
    let ck = resumed(&a)?;
    if let Some(ck) = &ck {
        if ck.finished() {
            println!(
                "{}: the run is finished (step {} of {}): nothing to do",
                ck.path.display(),
                ck.step,
                ck.train.schedule.total
            );
            return Ok(());
        }
    }
    let config = match (&a.config, &ck) {
        (Some(p), _) => LlamaConfig::from_file(p)?,
        (None, Some(ck)) => ck.config.clone(),
        (None, None) => return Err("--config is required".into()),
    };
    let device = candle_device();
    let train = train_config(&a, ck.as_ref().map(|c| &c.train));
    let dtype = ck.as_ref().map_or(a.dtype.unwrap_or(DType::F32), |c| c.dtype);
    // Every size and hyperparameter checked before anything is allocated.
    train.validate(&config, dtype, &device)?;
    let total = train.schedule.total;
    if let Some(k) = a.stop_after {
        let at = ck.as_ref().map_or(0, |c| c.step);
        if k <= at {
            println!("--stop-after {k}: the run is at step {at} already: nothing to do");
            return Ok(());
        }
    }
    let saved_notes = ck.as_ref().map(|c| c.notes.clone()).unwrap_or_default();
    let data_path = a
        .data
        .clone()
        .or_else(|| saved_notes.get("data").filter(|d| *d != "synthetic").map(PathBuf::from));
    let seed = a.seed.or_else(|| saved_notes.get("seed").and_then(|s| s.parse().ok())).unwrap_or(1);
    let data = Data::load(data_path.as_ref(), seed, config.vocab_size, train.seq)?;
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
    println!(
        "model: {} blocks, hidden {}, {} heads ({} key/value), intermediate {}, vocab {}{}: {:.2} M parameters",
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.intermediate_size,
        config.vocab_size,
        if config.tie_word_embeddings { ", tied embeddings" } else { "" },
        params as f64 / 1e6
    );
    println!(
        "training: {} steps of {} micro-batches of {} x {} tokens; lr {} (min {}, warmup {}), clip {}, engine {}",
        total, train.accum, train.micro_batch, train.seq, train.schedule.peak, train.schedule.min,
        train.schedule.warmup,
        train.clip.map_or("none".to_string(), |c| c.to_string()),
        train.engine
    );

    // The store: the Device tier at the budget asked for (default: the whole model), host
    // memory for the rest (weights, fp32 masters and moments, gradients, checkpoints).
    let elem = dtype.size_of() as u64;
    let overflow = || format!("a store for {params} parameters overflows u64");
    let model_bytes = params.checked_mul(elem).ok_or_else(overflow)?;
    let checkpoints = [config.num_hidden_layers, train.accum, train.micro_batch, train.seq]
        .iter()
        .try_fold(config.hidden_size as u64 * elem, |acc, &x| acc.checked_mul(x as u64));
    let host_need = params
        .checked_mul(elem + 4 + 4 * 3 + 4)
        .and_then(|b| b.checked_add(checkpoints?))
        .and_then(|b| b.checked_add(64 << 20))
        .ok_or_else(overflow)?;
    let device_budget = a.device_budget.unwrap_or(model_bytes.saturating_add(16 << 20));
    let engine = train.engine;
    let builder = Store::builder()
        .capacity(Tier::Device, device_budget)
        .prefetch_budget(device_budget)
        .capacity(Tier::Pinned, a.pinned_budget.unwrap_or(host_need))
        .capacity(
            Tier::Mapped,
            if engine == Engine::GpuMapped {
                params.checked_mul(12).and_then(|b| b.checked_add(1 << 20)).ok_or_else(overflow)?
            } else {
                0
            },
        );
    let store = strata::candle::store_for(&device, builder)?;
    println!("candle device: {device:?}; strata: {}", store.backend_description());
    let weights = match (&a.model, &ck) {
        (Some(p), _) => load_weights(&store, &config, p)?,
        (None, Some(ck)) => {
            load_weights(&store, &config, ck.path.join("model.safetensors.index.json"))?
        }
        (None, None) => put_random_weights(&store, &config, seed, dtype)?,
    };
    if let Some(dir) = &a.write_inputs {
        write_inputs(dir, &store, &config, &weights, &data, &train, total)?;
    }
    let flops_per_step =
        config.training_flops((train.micro_batch * train.seq * train.accum) as u64, train.seq);

    let mut losses = Vec::new();
    if a.in_memory {
        let mut init = HashMap::new();
        for (name, id) in &weights {
            let info = store.info(*id)?;
            let t = match info.dtype {
                DType::BF16 => Tensor::from_vec(
                    store.read_vec::<half::bf16>(*id)?,
                    info.shape.as_slice(),
                    &device,
                )?,
                _ => Tensor::from_vec(store.read_vec::<f32>(*id)?, info.shape.as_slice(), &device)?,
            };
            init.insert(name.clone(), t);
        }
        drop(store);
        let mut twin = LlamaTwin::new(config.clone(), train.clone(), init, &device)?;
        println!("in memory: every weight resident, candle's backward, AdamW in host memory");
        for step in 0..total {
            let b = data.batches(step, &train, &device)?;
            let t = Instant::now();
            let loss = twin.step(&b)?;
            device.synchronize()?;
            let s = t.elapsed().as_secs_f64();
            println!(
                "step {}/{total}: loss {loss:.6}  {:.0} tokens/s  {:.4} TFLOPS  ({:.1} ms)",
                step + 1,
                (train.micro_batch * train.seq * train.accum) as f64 / s,
                flops_per_step / s / 1e12,
                s * 1e3
            );
            progress(step + 1, total);
            losses.push(loss);
        }
    } else {
        let mut trainer =
            Trainer::new(store.clone(), &device, config.clone(), train.clone(), weights)?;
        if let Some(ck) = &ck {
            trainer.resume(&ck.path)?;
            println!("resumed {} at step {}", ck.path.display(), trainer.steps());
        }
        trainer.set_notes(data.notes.clone());
        plan(&store);
        let end = a.stop_after.map_or(total, |k| k.min(total));
        let mut saved = trainer.steps();
        let save = |trainer: &mut Trainer, dir: &Path| -> Res<()> {
            let p = trainer.save_keeping(dir, a.keep)?;
            println!("saved {} (step {})", p.display(), trainer.steps());
            Ok(())
        };
        for step in trainer.steps()..end {
            let b = data.batches(step, &train, &device)?;
            let r = trainer.step(&b)?;
            report(&r, total, flops_per_step);
            progress(step + 1, total);
            losses.push(r.loss);
            if let (Some(dir), Some(n)) = (&a.save, a.save_every) {
                if trainer.steps() % n == 0 {
                    save(&mut trainer, dir)?;
                    saved = trainer.steps();
                }
            }
        }
        let t = Instant::now();
        let waited = trainer.finish()?;
        println!(
            "the last step's updates: waited {:.1} ms for them after the loop ({:.1} ms)",
            waited * 1e3,
            t.elapsed().as_secs_f64() * 1e3
        );
        if let Some(dir) = &a.save {
            if saved != trainer.steps() {
                save(&mut trainer, dir)?;
            }
        }
        if trainer.skipped() > 0 {
            println!("skipped {} steps whose loss or gradient was not finite", trainer.skipped());
        }
        if end < total {
            println!("stopped after step {end} of {total} (--stop-after)");
        }
        let tr = trainer.layers().transfers()?;
        println!(
            "handed to candle: {} tensors, {} through device views, {} from host replicas",
            tr.tensors,
            format_size(tr.view_copy_bytes),
            format_size(tr.host_copy_bytes)
        );
        println!("{}", store.stats());
    }
    let last = losses.last().ok_or("no step ran")?;
    println!("{last}");
    Ok(())
}

/// Bytes per group and tier, as the store holds them before the first step.
fn plan(store: &Store) {
    let s = store.stats();
    println!("memory plan (bytes per group and tier):");
    println!("{:<12}{:>14}{:>14}{:>14}{:>14}", "group", "device", "pinned", "mapped", "disk");
    for g in Group::ALL {
        let row: Vec<String> =
            Tier::ALL.iter().map(|&t| format_size(s.group_bytes(g, t))).collect();
        println!("{:<12}{:>14}{:>14}{:>14}{:>14}", g.name(), row[0], row[1], row[2], row[3]);
    }
    let caps: Vec<String> = Tier::ALL.iter().map(|&t| format_size(s.capacity(t))).collect();
    println!("{:<12}{:>14}{:>14}{:>14}{:>14}", "budget", caps[0], caps[1], caps[2], caps[3]);
}

fn report(r: &StepReport, total: u64, flops: f64) {
    let mut moved = Vec::new();
    for f in Tier::ALL {
        for t in Tier::ALL {
            let b = r.moved[f.index()][t.index()];
            if b > 0 {
                moved.push(format!("{}->{} {}", f.name(), t.name(), format_size(b)));
            }
        }
    }
    println!(
        "step {}/{total}: loss {:.6}  lr {:.3e}  grad norm {:.4}{}{}  {:.0} tokens/s  {:.4} TFLOPS  \
         ({:.1} ms)  moved [{}]  stall {:.2} ms  optimizer {:.2} ms (hidden {:.2}, exposed {:.2})",
        r.step + 1,
        r.loss,
        r.lr,
        r.grad_norm,
        if r.clip_scale < 1.0 { format!(" (clipped x{:.4})", r.clip_scale) } else { String::new() },
        if r.skipped { " (skipped: not finite)" } else { "" },
        r.tokens as f64 / r.seconds,
        flops / r.seconds / 1e12,
        r.seconds * 1e3,
        moved.join(", "),
        r.stall_seconds * 1e3,
        r.optimizer_seconds * 1e3,
        r.optimizer_hidden_seconds() * 1e3,
        r.optimizer_exposed_seconds * 1e3
    );
}

/// A progress bar on stderr, where stderr is a terminal (redrawn under each step's line).
fn progress(done: u64, total: u64) {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return;
    }
    let width = 30;
    let filled = (done * width / total.max(1)) as usize;
    eprint!("[{}{}] {done}/{total}\r", "#".repeat(filled), ".".repeat(width as usize - filled));
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
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    store.save_safetensors_with(dir.join("model.safetensors"), &named, &meta)?;
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
    println!("wrote the initial weights and {} steps' tokens to {}", steps, dir.display());
    Ok(())
}
