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
use std::path::PathBuf;
use std::time::Instant;

use candle_core::{Device, Tensor};
use strata::candle::llama::SeededRng;
use strata::candle::{
    load_weights, put_random_weights, LlamaConfig, LlamaTwin, LrSchedule, StepReport, TrainConfig,
    Trainer,
};
use strata::optim::{AdamW, Engine};
use strata::{format_size, parse_size, DType, Group, Store, Tier};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

struct Args {
    config: PathBuf,
    model: Option<PathBuf>,
    seed: u64,
    dtype: DType,
    data: Option<PathBuf>,
    seq: usize,
    micro_batch: usize,
    accum: usize,
    steps: u64,
    lr: f64,
    min_lr: Option<f64>,
    warmup: Option<u64>,
    weight_decay: f64,
    clip: f64,
    device_budget: Option<u64>,
    pinned_budget: Option<u64>,
    engine: Engine,
    freeze: Vec<String>,
    save: Option<PathBuf>,
    resume: Option<PathBuf>,
    write_inputs: Option<PathBuf>,
    in_memory: bool,
}

const USAGE: &str = "usage: candle_train --config FILE [--model PATH | --init random --seed N] \
[--dtype f32|bf16] [--data FILE] [--seq N] [--micro-batch N] [--accum N] [--steps N] [--lr X] \
[--min-lr X] [--warmup N] [--weight-decay X] [--clip X] [--device-budget SIZE] \
[--pinned-budget SIZE] [--engine cpu|gpu-mapped|gpu-resident|auto] [--freeze PATTERN]... \
[--save DIR] [--resume DIR] [--write-inputs DIR] [--in-memory]";

fn parse_args() -> Res<Args> {
    let mut a = Args {
        config: PathBuf::new(),
        model: None,
        seed: 1,
        dtype: DType::F32,
        data: None,
        seq: 32,
        micro_batch: 2,
        accum: 2,
        steps: 5,
        lr: 1e-3,
        min_lr: None,
        warmup: None,
        weight_decay: 0.0,
        clip: 1.0,
        device_budget: None,
        pinned_budget: None,
        engine: Engine::Cpu,
        freeze: Vec::new(),
        save: None,
        resume: None,
        write_inputs: None,
        in_memory: false,
    };
    let mut config = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--in-memory" {
            a.in_memory = true;
            continue;
        }
        if flag == "-h" || flag == "--help" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let num = |what: &str| -> Res<u64> {
            value.parse().map_err(|_| format!("{flag} {value}: {what} expected").into())
        };
        let float = || -> Res<f64> {
            value.parse().map_err(|_| format!("{flag} {value}: a number expected").into())
        };
        match flag.as_str() {
            "--config" => config = Some(PathBuf::from(&value)),
            "--model" => a.model = Some(PathBuf::from(&value)),
            "--init" if value == "random" => a.model = None,
            "--init" => return Err(format!("--init {value}: only `random`").into()),
            "--seed" => a.seed = num("a count")?,
            "--dtype" => {
                a.dtype = match value.as_str() {
                    "f32" => DType::F32,
                    "bf16" => DType::BF16,
                    _ => return Err(format!("--dtype {value}: f32 or bf16").into()),
                }
            }
            "--data" => a.data = Some(PathBuf::from(&value)),
            "--seq" => a.seq = num("a count")? as usize,
            "--micro-batch" => a.micro_batch = num("a count")? as usize,
            "--accum" => a.accum = num("a count")? as usize,
            "--steps" => a.steps = num("a count")?,
            "--lr" => a.lr = float()?,
            "--min-lr" => a.min_lr = Some(float()?),
            "--warmup" => a.warmup = Some(num("a count")?),
            "--weight-decay" => a.weight_decay = float()?,
            "--clip" => a.clip = float()?,
            "--device-budget" => a.device_budget = Some(parse_size(&value)?),
            "--pinned-budget" => a.pinned_budget = Some(parse_size(&value)?),
            "--engine" => a.engine = value.parse()?,
            "--freeze" => a.freeze.push(value),
            "--save" => a.save = Some(PathBuf::from(&value)),
            "--resume" => a.resume = Some(PathBuf::from(&value)),
            "--write-inputs" => a.write_inputs = Some(PathBuf::from(&value)),
            _ => return Err(format!("unknown flag {flag}\n{USAGE}").into()),
        }
    }
    a.config = config.ok_or_else(|| format!("--config is required\n{USAGE}"))?;
    if a.in_memory && (a.save.is_some() || a.resume.is_some()) {
        return Err("--save and --resume go with the out-of-core trainer, not --in-memory".into());
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

/// The step's micro-batches: windows of a token stream, or the synthetic stream.
struct Data {
    stream: Option<Vec<u32>>,
    seed: u64,
    vocab: usize,
}

impl Data {
    fn load(path: Option<&PathBuf>, seed: u64, vocab: usize) -> Res<Data> {
        let stream = match path {
            None => None,
            Some(p) => {
                let bytes =
                    std::fs::read(p).map_err(|e| format!("reading {}: {e}", p.display()))?;
                let raw = match safetensors::SafeTensors::deserialize(&bytes) {
                    Ok(st) => {
                        let mut names = st.names();
                        names.sort();
                        let name = names.first().ok_or("the data file holds no tensor")?;
                        let t = st.tensor(name)?;
                        if t.dtype() != safetensors::Dtype::U32 {
                            return Err(format!(
                                "{}: {name} is {:?}, u32 token ids expected",
                                p.display(),
                                t.dtype()
                            )
                            .into());
                        }
                        t.data().to_vec()
                    }
                    Err(_) => bytes,
                };
                if raw.len() % 4 != 0 || raw.is_empty() {
                    return Err(
                        format!("{}: not a whole number of u32 token ids", p.display()).into()
                    );
                }
                let ids: Vec<u32> = raw
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                    return Err(format!(
                        "{}: token id {bad} in a vocabulary of {vocab}",
                        p.display()
                    )
                    .into());
                }
                Some(ids)
            }
        };
        Ok(Data { stream, seed, vocab })
    }

    fn batches(&self, step: u64, t: &TrainConfig, device: &Device) -> Res<Vec<Tensor>> {
        let row = t.seq + 1;
        let mut out = Vec::with_capacity(t.accum);
        for m in 0..t.accum {
            let mut v = Vec::with_capacity(t.micro_batch * row);
            for r in 0..t.micro_batch {
                let k = (step as usize * t.accum + m) * t.micro_batch + r;
                match &self.stream {
                    Some(s) => v.extend((0..row).map(|i| s[(k * t.seq + i) % s.len()])),
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
    if let Err(e) = run() {
        eprintln!("candle_train: {e}");
        std::process::exit(1);
    }
}

fn run() -> Res<()> {
    let a = parse_args()?;
    let config = LlamaConfig::from_file(&a.config)?;
    let device = candle_device();
    let total = a.steps;
    let train = TrainConfig {
        micro_batch: a.micro_batch,
        seq: a.seq,
        accum: a.accum,
        adamw: AdamW { lr: a.lr, weight_decay: a.weight_decay, ..AdamW::default() },
        schedule: LrSchedule {
            peak: a.lr,
            min: a.min_lr.unwrap_or(a.lr / 10.0),
            warmup: a.warmup.unwrap_or(total / 5),
            total,
        },
        clip: (a.clip > 0.0).then_some(a.clip),
        engine: a.engine,
        optimizer_threads: 0,
        frozen: a.freeze.clone(),
    };
    let data = Data::load(a.data.as_ref(), a.seed, config.vocab_size)?;
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
    let elem = a.dtype.size_of() as u64;
    let model_bytes = params * elem;
    let host_need = params * (elem + 4 + 4 * 3)
        + 4 * params
        + (config.num_hidden_layers
            * train.accum
            * train.micro_batch
            * train.seq
            * config.hidden_size) as u64
            * elem
        + (64 << 20);
    let device_budget = a.device_budget.unwrap_or(model_bytes + (16 << 20));
    let builder = Store::builder()
        .capacity(Tier::Device, device_budget)
        .prefetch_budget(device_budget)
        .capacity(Tier::Pinned, a.pinned_budget.unwrap_or(host_need))
        .capacity(
            Tier::Mapped,
            if a.engine == Engine::GpuMapped { 4 * params * 3 + (1 << 20) } else { 0 },
        );
    let store = strata::candle::store_for(&device, builder)?;
    println!("candle device: {device:?}; strata: {}", store.backend_description());
    let weights = match &a.model {
        Some(p) => load_weights(&store, &config, p)?,
        None => put_random_weights(&store, &config, a.seed, a.dtype)?,
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
        if let Some(dir) = &a.resume {
            trainer.resume(dir)?;
            println!("resumed {} at step {}", dir.display(), trainer.steps());
        }
        plan(&store);
        let first = trainer.steps();
        for step in first..total {
            let b = data.batches(step, &train, &device)?;
            let r = trainer.step(&b)?;
            report(&r, total, flops_per_step);
            progress(step + 1, total);
            losses.push(r.loss);
        }
        let t = Instant::now();
        let waited = trainer.finish()?;
        println!(
            "the last step's updates: waited {:.1} ms for them after the loop ({:.1} ms)",
            waited * 1e3,
            t.elapsed().as_secs_f64() * 1e3
        );
        if let Some(dir) = &a.save {
            trainer.save(dir)?;
            println!("saved {} (step {})", dir.display(), trainer.steps());
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
        "step {}/{total}: loss {:.6}  lr {:.3e}  grad norm {:.4}{}  {:.0} tokens/s  {:.4} TFLOPS  \
         ({:.1} ms)  moved [{}]  stall {:.2} ms  optimizer {:.2} ms (hidden {:.2}, exposed {:.2})",
        r.step + 1,
        r.loss,
        r.lr,
        r.grad_norm,
        if r.clip_scale < 1.0 { format!(" (clipped x{:.4})", r.clip_scale) } else { String::new() },
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
    let shape = [steps as usize * train.accum, train.micro_batch, train.seq + 1];
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::U32, shape.to_vec(), &bytes)?;
    safetensors::serialize_to_file([("tokens", view)], None, &dir.join("tokens.safetensors"))?;
    println!("wrote the initial weights and {} steps' tokens to {}", steps, dir.display());
    Ok(())
}
