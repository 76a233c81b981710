//! Generates tokens with a Llama-family decoder inside candle, out of core (its blocks streamed
//! through a strata store under a device budget, its KV cache in the store) or in memory.
//!
//! ```text
//! cargo run --release --no-default-features --features candle --example candle_generate -- \
//!     --config examples/configs/tiny-llama.json --init random --prompt-tokens 1,2,3 \
//!     --max-new 16 --device-budget 4MiB
//! ```
//!
//! Flags (sizes take `KiB`, `MiB`, `GiB`):
//! - `--config FILE`: the model's Hugging Face `config.json` (Llama or Mistral);
//! - `--model PATH` (a `.safetensors` file, an index or a directory, Hugging Face names) or
//!   `--init random [--init-seed N]` (random weights, seed 1 by default);
//! - `--save-model DIR`: writes the weights and the config there (`model.safetensors`,
//!   `config.json`) before generating, for a later `--model DIR --config DIR/config.json`;
//! - `--prompt-tokens 1,2,3` (token ids), `--max-new N` (16);
//! - `--dtype f32|bf16|f16`: what the model computes in (f32);
//! - `--device-budget SIZE`: the store's Device tier (default: room for the whole model and
//!   its cache); `--resident K|auto`: keep the first K blocks as candle tensors (auto: as
//!   many as fit in the budget beside two streamed blocks and the cache; default 0);
//! - `--temperature T [--top-k K] [--top-p P] [--seed S]`: sampled decoding (greedy without
//!   `--temperature`, or with 0);
//! - `--steps N` (1), `--warmup N` (0): generations timed, after untimed ones;
//! - `--in-memory`: every weight resident in candle and the cache in candle tensors, the
//!   reference (the same tokens as out of core).
//!
//! Prints the store's traffic, the time of the prompt's forward and of each new token
//! (min/median over the timed generations), and, last, the new tokens.
//!
//! Flags are parsed here by hand, so the example builds with `--no-default-features --features
//! candle` (no CLI dependencies).

use std::path::PathBuf;

use candle_core::{DType as CDType, Device};
use st::candle::{
    generate, load_weights, put_random_weights, CausalLm, InMemoryLlama, Layers, LlamaConfig,
    OutOfCoreLlama, Sampling,
};
use strata as st;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const USAGE: &str = "usage: candle_generate --config FILE (--model PATH | --init random \
[--init-seed N]) --prompt-tokens 1,2,3 [--max-new N] [--dtype f32|bf16|f16] \
[--device-budget SIZE] [--resident K|auto] [--temperature T] [--top-k K] [--top-p P] [--seed S] \
[--steps N] [--warmup N] [--save-model DIR] [--in-memory]";

#[derive(Default)]
struct Args {
    config: PathBuf,
    model: Option<PathBuf>,
    init_seed: u64,
    save_model: Option<PathBuf>,
    prompt: Vec<u32>,
    max_new: usize,
    dtype: Option<CDType>,
    device_budget: Option<u64>,
    resident: Option<Option<usize>>,
    temperature: f64,
    top_k: Option<usize>,
    top_p: Option<f64>,
    seed: u64,
    steps: usize,
    warmup: usize,
    in_memory: bool,
}

fn parse_args() -> Res<Args> {
    let mut a = Args { init_seed: 1, max_new: 16, steps: 1, ..Args::default() };
    let (mut config, mut init) = (None, false);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--in-memory" => {
                a.in_memory = true;
                continue;
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            _ => {}
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        let count = || -> Res<usize> {
            value.parse().map_err(|_| format!("{flag} {value}: a count expected").into())
        };
        let float = || -> Res<f64> {
            value.parse().map_err(|_| format!("{flag} {value}: a number expected").into())
        };
        match flag.as_str() {
            "--config" => config = Some(PathBuf::from(&value)),
            "--model" => a.model = Some(PathBuf::from(&value)),
            "--init" if value == "random" => init = true,
            "--init" => return Err(format!("--init {value}: only `random`").into()),
            "--init-seed" => a.init_seed = count()? as u64,
            "--save-model" => a.save_model = Some(PathBuf::from(&value)),
            "--prompt-tokens" => {
                a.prompt = value
                    .split(',')
                    .map(|t| t.trim().parse::<u32>())
                    .collect::<Result<_, _>>()
                    .map_err(|_| format!("--prompt-tokens {value}: token ids like 1,2,3"))?
            }
            "--max-new" => a.max_new = count()?,
            "--dtype" => {
                a.dtype = Some(match value.as_str() {
                    "f32" => CDType::F32,
                    "bf16" => CDType::BF16,
                    "f16" => CDType::F16,
                    _ => return Err(format!("--dtype {value}: f32, bf16 or f16").into()),
                })
            }
            "--device-budget" => a.device_budget = Some(st::parse_size(&value)?),
            "--resident" if value == "auto" => a.resident = Some(None),
            "--resident" => a.resident = Some(Some(count()?)),
            "--temperature" => a.temperature = float()?,
            "--top-k" => a.top_k = Some(count()?),
            "--top-p" => a.top_p = Some(float()?),
            "--seed" => a.seed = count()? as u64,
            "--steps" => a.steps = count()?.max(1),
            "--warmup" => a.warmup = count()?,
            _ => return Err(format!("unknown flag {flag}\n{USAGE}").into()),
        }
    }
    a.config = config.ok_or_else(|| format!("--config is required\n{USAGE}"))?;
    match (&a.model, init) {
        (Some(_), true) => return Err("--model and --init random: one or the other".into()),
        (None, false) => return Err(format!("--model PATH or --init random\n{USAGE}").into()),
        _ => {}
    }
    if a.prompt.is_empty() {
        return Err(format!("--prompt-tokens is required\n{USAGE}").into());
    }
    if a.in_memory && (a.device_budget.is_some() || a.resident.is_some()) {
        return Err("--device-budget and --resident go with out of core, not --in-memory".into());
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

fn ms(s: f64) -> String {
    format!("{:.3} ms", s * 1e3)
}

/// Min and median of `v` (sorted here).
fn min_median(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => (f64::NAN, f64::NAN),
        n => (v[0], if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }),
    }
}

/// Runs `warmup + steps` generations; returns the tokens and the timed forwards' seconds (the
/// prompt's, and the new tokens').
fn run<M: CausalLm>(m: &M, a: &Args, sampling: &Sampling) -> Res<(Vec<u32>, Vec<f64>, Vec<f64>)> {
    let (mut prompt_s, mut token_s, mut tokens) = (Vec::new(), Vec::new(), None);
    for i in 0..a.warmup + a.steps {
        let g = generate(m, &a.prompt, a.max_new, sampling)?;
        if let Some(t) = &tokens {
            if *t != g.tokens {
                return Err("two generations of the same prompt differ".into());
            }
        }
        if i >= a.warmup {
            if let Some((&first, rest)) = g.seconds.split_first() {
                prompt_s.push(first);
                token_s.extend_from_slice(rest);
            }
        }
        tokens = Some(g.tokens);
    }
    Ok((tokens.unwrap_or_default(), prompt_s, token_s))
}

fn main() {
    if let Err(e) = real_main() {
        eprintln!("candle_generate: {e}");
        std::process::exit(1);
    }
}

fn real_main() -> Res<()> {
    let a = parse_args()?;
    let config = LlamaConfig::from_file(&a.config)?;
    let device = candle_device();
    let dtype = a.dtype.unwrap_or(CDType::F32);
    let sampling = if a.temperature > 0.0 {
        Sampling::Random {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            seed: a.seed,
        }
    } else {
        Sampling::Greedy
    };
    let weight_bytes = 4 * config.parameters();
    let kv_bytes = (2
        * config.num_hidden_layers
        * (a.prompt.len() + a.max_new)
        * config.num_key_value_heads
        * config.head_dim
        * dtype.size_in_bytes()) as u64;
    // The store: a Device tier of the budget (or room for everything), host memory for the rest.
    let budget = a.device_budget.unwrap_or(2 * (weight_bytes + kv_bytes) + (1 << 20));
    let builder = st::Store::builder()
        .capacity(st::Tier::Device, budget)
        .prefetch_budget(budget)
        .capacity(st::Tier::Pinned, 2 * (weight_bytes + kv_bytes) + (64 << 20));
    let store = st::candle::store_for(&device, builder)?;
    let weights = match &a.model {
        Some(path) => load_weights(&store, &config, path)?,
        None => put_random_weights(&store, &config, a.init_seed, st::DType::F32)?,
    };
    if let Some(dir) = &a.save_model {
        std::fs::create_dir_all(dir)?;
        let ids: Vec<_> = weights.iter().map(|(_, id)| *id).collect();
        store.save_safetensors(dir.join("model.safetensors"), &ids)?;
        std::fs::write(dir.join("config.json"), config.to_json())?;
        println!("wrote {} and config.json", dir.join("model.safetensors").display());
    }
    println!(
        "model: {} parameters ({} blocks), device {:?}, {dtype:?}; device budget {}",
        config.parameters(),
        config.num_hidden_layers,
        device.location(),
        if a.in_memory { "none (in memory)".to_string() } else { st::format_size(budget) }
    );
    let (tokens, mut prompt_s, mut token_s) = if a.in_memory {
        // Every weight read once into candle (StoreBackend is candle-nn's VarBuilder backend).
        use candle_nn::var_builder::SimpleBackend;
        let backend = st::candle::StoreBackend::new(store.clone(), weights.clone());
        let mut map = std::collections::HashMap::new();
        for (name, _) in &weights {
            map.insert(name.clone(), backend.get_unchecked(name, dtype, &device)?);
        }
        let model = InMemoryLlama::new(&config, &map, dtype, &device)?;
        drop(map);
        run(&model, &a, &sampling)?
    } else {
        let layers = Layers::new(store.clone(), weights, &device)?;
        let model = OutOfCoreLlama::new(layers, &config, dtype)?;
        let k = match a.resident {
            None => 0,
            Some(Some(k)) => k,
            Some(None) => {
                let block = config.block_parameters() * dtype.size_in_bytes() as u64;
                model.blocks_within(budget.saturating_sub(2 * block + kv_bytes))
            }
        };
        let model = model.with_resident(k)?;
        let before = store.stats();
        let out = run(&model, &a, &sampling)?;
        let s = store.stats();
        println!(
            "out of core: {k} of {} blocks resident; {} into the Device tier, {} evictions, \
             {} of KV cache per generation",
            config.num_hidden_layers,
            st::format_size(s.moved_into(st::Tier::Device) - before.moved_into(st::Tier::Device)),
            s.evictions - before.evictions,
            st::format_size(kv_bytes),
        );
        out
    };
    let (pmin, pmed) = min_median(&mut prompt_s);
    let (tmin, tmed) = min_median(&mut token_s);
    println!(
        "prompt ({} tokens): min {}, median {}; per new token: min {}, median {} ({} timed)",
        a.prompt.len(),
        ms(pmin),
        ms(pmed),
        ms(tmin),
        ms(tmed),
        token_s.len()
    );
    let list: Vec<String> = tokens.iter().map(u32::to_string).collect();
    println!("{}", list.join(","));
    Ok(())
}
