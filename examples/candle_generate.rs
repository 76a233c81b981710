//! Generates with a Llama-family decoder inside candle, out of core (its blocks streamed
//! through a strata store under a device budget, its KV cache in the store) or in memory: from
//! token ids, or (feature `text`) from text, streamed back as text, with the model's chat
//! template; one prompt or several at once (one pass of the weights per token serves them all).
//!
//! ```text
//! cargo run --release --no-default-features --features candle --example candle_generate -- \
//!     --config examples/configs/tiny-llama.json --init random --prompt-tokens 1,2,3 \
//!     --max-new 16 --device-budget 4MiB
//! cargo run --release --no-default-features --features text --example candle_generate -- \
//!     --model SmolLM2-135M-Instruct --tokenizer SmolLM2-135M-Instruct/tokenizer.json \
//!     --chat --prompt "What is the capital of France?" --device-budget 24MiB
//! ```
//!
//! Flags (sizes take `KiB`, `MiB`, `GiB`):
//! - `--model PATH` (a `.safetensors` file, an index or a directory, Hugging Face names) or
//!   `--init random [--init-seed N]` (random weights, seed 1 by default); `--config FILE`, the
//!   model's `config.json` (Llama, Mistral, Qwen2; default: `config.json` in the model's
//!   directory);
//! - `--adapter DIR`: a PEFT LoRA adapter (`adapter_model.safetensors`, `adapter_config.json`,
//!   as `candle_train --lora-rank R --save DIR` or PEFT writes it) merged into the base weights
//!   in the store before generating (`W + scale · B·A`; the model's files are not touched);
//! - `--save-model DIR`: writes the weights and the config there (`model.safetensors`,
//!   `config.json`) before generating, for a later `--model DIR`;
//! - prompts, one or several (a batch): `--prompt-tokens 1,2,3` (token ids; repeat the flag for
//!   several), or with `--tokenizer FILE` (a `tokenizer.json`; feature `text`) `--prompt TEXT`
//!   (repeatable) or `--prompts FILE` (one prompt a line: text with a tokenizer, token ids
//!   without); `--chat` renders each prompt as a user message with the chat template of the
//!   `tokenizer_config.json` beside the tokenizer (`--system TEXT` adds a system message);
//! - `--max-new N` (16): new tokens at most; with a tokenizer each sequence stops at the
//!   model's end-of-sequence tokens (from `generation_config.json`, `config.json` or
//!   `tokenizer_config.json` beside the tokenizer: the example says which); `--stop-tokens
//!   1,2` sets them (`--stop-tokens none`: never stop early);
//! - `--dtype f32|bf16|f16`: what the model computes in (f32);
//! - `--device-budget SIZE`: the store's Device tier (default: room for the whole model and
//!   its cache); `--resident K|auto`: keep the first K blocks as candle tensors (auto: as
//!   many as fit in the budget beside two streamed blocks and the cache; default 0);
//! - `--temperature T [--top-k K] [--top-p P] [--seed S]`: sampled decoding (greedy without
//!   `--temperature`, or with 0; a NaN or negative temperature, or top-k/top-p without a
//!   temperature, is an error);
//! - `--steps N` (1), `--warmup N` (0): generations timed, after untimed ones;
//! - `--solo`: with several prompts, also generate each alone and check that the batch gave
//!   each sequence the same tokens (tokens/s of both printed);
//! - `--in-memory`: every weight resident in candle and the cache in candle tensors, the
//!   reference (the same tokens as out of core).
//!
//! Prints the store's traffic, the time of the prompt's pass and of each new token (min/median
//! over the timed generations), the tokens/s of the batch; with one text prompt, the text as
//! it is generated. The last line is the new tokens (one line a sequence, `;` between).
//!
//! Flags are parsed here by hand, so the example builds with `--no-default-features --features
//! candle` (no CLI dependencies).

use std::path::{Path, PathBuf};

use candle_core::DType as CDType;
use st::candle::{
    generate_batch, load_weights, put_random_weights, CausalLm, InMemoryLlama, Layers, LlamaConfig,
    OutOfCoreLlama, Sampling,
};
use strata as st;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

const USAGE: &str = "usage: candle_generate (--model PATH [--config FILE] | --config FILE \
--init random [--init-seed N]) (--prompt-tokens 1,2,3 ... | --tokenizer FILE [--chat] \
[--system TEXT] (--prompt TEXT ... | --prompts FILE)) [--max-new N] [--stop-tokens IDS|none] \
[--dtype f32|bf16|f16] [--device-budget SIZE] [--resident K|auto] [--temperature T] [--top-k K] \
[--top-p P] [--seed S] [--steps N] [--warmup N] [--solo] [--adapter DIR] [--save-model DIR] \
[--in-memory]";

#[derive(Default)]
struct Args {
    config: Option<PathBuf>,
    model: Option<PathBuf>,
    init_seed: u64,
    save_model: Option<PathBuf>,
    adapter: Option<PathBuf>,
    prompt_tokens: Vec<Vec<u32>>,
    prompts: Vec<String>,
    prompts_file: Option<PathBuf>,
    tokenizer: Option<PathBuf>,
    chat: bool,
    system: Option<String>,
    stop_tokens: Option<Vec<u32>>,
    max_new: usize,
    dtype: Option<CDType>,
    device_budget: Option<u64>,
    resident: Option<Option<usize>>,
    temperature: Option<f64>,
    top_k: Option<usize>,
    top_p: Option<f64>,
    seed: u64,
    steps: usize,
    warmup: usize,
    solo: bool,
    in_memory: bool,
}

fn token_ids(text: &str, flag: &str) -> Res<Vec<u32>> {
    let ids = text
        .split(',')
        .map(|t| t.trim().parse::<u32>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|_| format!("{flag} {text}: token ids like 1,2,3"))?;
    Ok(ids)
}

fn parse_args() -> Res<Args> {
    let mut a = Args { init_seed: 1, max_new: 16, steps: 1, ..Args::default() };
    let mut init = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--in-memory" => a.in_memory = true,
            "--chat" => a.chat = true,
            "--solo" => a.solo = true,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            _ => {
                let value = it.next().ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
                parse_flag(&mut a, &mut init, &flag, value)?;
            }
        }
    }
    match (&a.model, init) {
        (Some(_), true) => return Err("--model and --init random: one or the other".into()),
        (None, false) => return Err(format!("--model PATH or --init random\n{USAGE}").into()),
        (None, true) if a.config.is_none() => {
            return Err(format!("--init random needs --config\n{USAGE}").into())
        }
        _ => {}
    }
    let text = !a.prompts.is_empty() || a.tokenizer.is_some();
    if text && !a.prompt_tokens.is_empty() {
        return Err("--prompt-tokens, or --tokenizer with --prompt: not both".into());
    }
    if !a.prompts.is_empty() && a.tokenizer.is_none() {
        return Err("--prompt TEXT needs --tokenizer FILE (or give --prompt-tokens)".into());
    }
    if a.chat && a.tokenizer.is_none() {
        return Err("--chat needs --tokenizer FILE (the chat template is beside it)".into());
    }
    if a.system.is_some() && !a.chat {
        return Err("--system goes with --chat".into());
    }
    if a.prompt_tokens.is_empty() && a.prompts.is_empty() && a.prompts_file.is_none() {
        return Err(format!("a prompt is required\n{USAGE}").into());
    }
    if a.in_memory && (a.device_budget.is_some() || a.resident.is_some()) {
        return Err("--device-budget and --resident go with out of core, not --in-memory".into());
    }
    Ok(a)
}

fn parse_flag(a: &mut Args, init: &mut bool, flag: &str, value: String) -> Res<()> {
    let count = || -> Res<usize> {
        value.parse().map_err(|_| format!("{flag} {value}: a count expected").into())
    };
    let float = || -> Res<f64> {
        value.parse().map_err(|_| format!("{flag} {value}: a number expected").into())
    };
    match flag {
        "--config" => a.config = Some(PathBuf::from(&value)),
        "--model" => a.model = Some(PathBuf::from(&value)),
        "--init" if value == "random" => *init = true,
        "--init" => return Err(format!("--init {value}: only `random`").into()),
        "--init-seed" => a.init_seed = count()? as u64,
        "--save-model" => a.save_model = Some(PathBuf::from(&value)),
        "--adapter" => a.adapter = Some(PathBuf::from(&value)),
        "--prompt-tokens" => a.prompt_tokens.push(token_ids(&value, flag)?),
        "--prompt" => a.prompts.push(value),
        "--prompts" => a.prompts_file = Some(PathBuf::from(&value)),
        "--tokenizer" => a.tokenizer = Some(PathBuf::from(&value)),
        "--system" => a.system = Some(value),
        "--stop-tokens" if value == "none" => a.stop_tokens = Some(Vec::new()),
        "--stop-tokens" => a.stop_tokens = Some(token_ids(&value, flag)?),
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
        "--temperature" => a.temperature = Some(float()?),
        "--top-k" => a.top_k = Some(count()?),
        "--top-p" => a.top_p = Some(float()?),
        "--seed" => a.seed = count()? as u64,
        "--steps" => a.steps = count()?.max(1),
        "--warmup" => a.warmup = count()?,
        _ => return Err(format!("unknown flag {flag}\n{USAGE}").into()),
    }
    Ok(())
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

/// What the prompts are, once tokenized, and how to show what is generated.
struct Prompts {
    ids: Vec<Vec<u32>>,
    stop: Vec<u32>,
    #[cfg(feature = "text")]
    tokenizer: Option<st::candle::text::Tokenizer>,
}

impl Prompts {
    /// Streams sequence `i`'s new token (one text prompt: printed as it comes).
    fn streamer(&self) -> Box<dyn FnMut(usize, u32) -> candle_core::Result<()> + '_> {
        #[cfg(feature = "text")]
        if let (Some(t), 1) = (&self.tokenizer, self.ids.len()) {
            let mut stream = st::candle::text::TextStream::new(t);
            return Box::new(move |_, token| {
                if let Some(piece) = stream.push(token)? {
                    print!("{piece}");
                    std::io::Write::flush(&mut std::io::stdout())
                        .map_err(candle_core::Error::wrap)?;
                }
                Ok(())
            });
        }
        Box::new(|_, _| Ok(()))
    }

    /// Sequence `i`'s text, when there is a tokenizer.
    fn text(&self, tokens: &[u32]) -> Res<Option<String>> {
        #[cfg(feature = "text")]
        if let Some(t) = &self.tokenizer {
            return Ok(Some(t.decode(tokens, true)?));
        }
        let _ = tokens;
        Ok(None)
    }
}

/// The prompts as token ids: given as ids, or text tokenized (with the chat template).
fn prompts(a: &Args) -> Res<Prompts> {
    let mut lines = a.prompts.clone();
    if let Some(file) = &a.prompts_file {
        // A regular file, sized before it is read (a FIFO or /dev/zero would never end).
        let meta =
            std::fs::metadata(file).map_err(|e| format!("--prompts {}: {e}", file.display()))?;
        if !meta.is_file() || meta.len() > 64 << 20 {
            return Err(
                format!("--prompts {}: a regular file of at most 64 MiB", file.display()).into()
            );
        }
        let text = std::fs::read_to_string(file)
            .map_err(|e| format!("--prompts {}: {e}", file.display()))?;
        lines.extend(text.lines().filter(|l| !l.trim().is_empty()).map(str::to_string));
        if lines.is_empty() {
            return Err(format!("--prompts {}: no prompt in it", file.display()).into());
        }
    }
    match &a.tokenizer {
        None => {
            let mut ids = a.prompt_tokens.clone();
            for l in &lines {
                ids.push(token_ids(l, "--prompts")?);
            }
            Ok(Prompts {
                ids,
                stop: a.stop_tokens.clone().unwrap_or_default(),
                #[cfg(feature = "text")]
                tokenizer: None,
            })
        }
        #[cfg(feature = "text")]
        Some(path) => text_prompts(a, path, &lines),
        #[cfg(not(feature = "text"))]
        Some(_) => Err("--tokenizer needs the example built with --features text".into()),
    }
}

#[cfg(feature = "text")]
fn text_prompts(a: &Args, path: &Path, lines: &[String]) -> Res<Prompts> {
    use st::candle::text::{eos_tokens, ChatTemplate, Message, Tokenizer};
    let tokenizer = Tokenizer::from_file(path)?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let template = match a.chat {
        true => Some(ChatTemplate::from_file(dir.join("tokenizer_config.json"))?),
        false => None,
    };
    let mut ids = Vec::with_capacity(lines.len());
    for line in lines {
        let tokens = match &template {
            Some(t) => {
                let mut chat = Vec::new();
                if let Some(s) = &a.system {
                    chat.push(Message::new("system", s));
                }
                chat.push(Message::new("user", line));
                // The template writes the special tokens (a BOS where it wants one).
                tokenizer.encode(&t.render(&chat, true)?, false)?
            }
            None => tokenizer.encode(line, true)?,
        };
        ids.push(tokens);
    }
    let stop = match &a.stop_tokens {
        Some(s) => s.clone(),
        None => match eos_tokens(&dir, &tokenizer)? {
            Some(eos) => {
                println!("stops at {:?} ({})", eos.ids, eos.from);
                eos.ids
            }
            None => {
                println!(
                    "no end-of-sequence token beside the tokenizer: {} new tokens each",
                    a.max_new
                );
                Vec::new()
            }
        },
    };
    Ok(Prompts { ids, stop, tokenizer: Some(tokenizer) })
}

/// One timed run's figures.
#[derive(Default)]
struct Timing {
    prompt_s: Vec<f64>,
    token_s: Vec<f64>,
    /// Wall seconds and new tokens of each timed generation.
    runs: Vec<(f64, usize)>,
    /// Passes over the weights of every generation, timed or not (a batch's sequences share
    /// each pass): what the store's traffic is divided by.
    passes: usize,
}

/// Runs `warmup + steps` generations of every prompt at once; returns the tokens and the timed
/// figures.
fn run<M: CausalLm>(
    m: &M,
    a: &Args,
    p: &Prompts,
    prompts: &[Vec<u32>],
    sampling: &Sampling,
    stream: bool,
) -> Res<(Vec<Vec<u32>>, Timing)> {
    let (mut t, mut tokens) = (Timing::default(), None::<Vec<Vec<u32>>>);
    for i in 0..a.warmup + a.steps {
        let show = stream && i + 1 == a.warmup + a.steps;
        let mut on_token = if show { p.streamer() } else { Box::new(|_, _| Ok(())) };
        let t0 = std::time::Instant::now();
        let g = generate_batch(m, prompts, a.max_new, sampling, &p.stop, &mut on_token)?;
        let wall = t0.elapsed().as_secs_f64();
        drop(on_token);
        if show && p.ids.len() == 1 {
            println!();
        }
        let now: Vec<Vec<u32>> = g.iter().map(|s| s.tokens.clone()).collect();
        // The prompt's pass and one per new token but the last; the longest sequence's count.
        t.passes += g.iter().map(|s| s.seconds.len()).max().unwrap_or(0);
        if tokens.as_ref().is_some_and(|t| *t != now) {
            return Err("two generations of the same prompts differ".into());
        }
        if i >= a.warmup {
            for s in &g {
                if let Some((&first, rest)) = s.seconds.split_first() {
                    t.prompt_s.push(first);
                    t.token_s.extend_from_slice(rest);
                }
            }
            t.runs.push((wall, now.iter().map(Vec::len).sum()));
        }
        tokens = Some(now);
    }
    Ok((tokens.unwrap_or_default(), t))
}

/// Prints the batch's figures; returns the median new token's pass in seconds.
fn report(label: &str, batch: usize, p: &Prompts, t: &mut Timing) -> f64 {
    let label = if batch == 1 && label == "batched" { "generated" } else { label };
    let (pmin, pmed) = min_median(&mut t.prompt_s);
    let (tmin, tmed) = min_median(&mut t.token_s);
    let (wall, new): (f64, usize) =
        t.runs.iter().fold((0.0, 0), |(w, n), &(w1, n1)| (w + w1, n + n1));
    let prompt_tokens: usize = p.ids.iter().map(Vec::len).sum();
    println!(
        "{label}, batch {batch}: {new} new tokens in {wall:.3} s, {:.1} tokens/s (prompt \
         passes {prompt_tokens} tokens: min {}, median {}; per new token's pass: min {}, \
         median {})",
        new as f64 / wall,
        ms(pmin),
        ms(pmed),
        ms(tmin),
        ms(tmed),
    );
    tmed
}

/// What generation yields: the batch's tokens, the passes over the weights of every
/// generation, and the batch's median new-token pass in seconds.
struct Generated {
    tokens: Vec<Vec<u32>>,
    passes: usize,
    token_pass_s: f64,
}

/// Generates the batch, and with `--solo` each prompt alone; checks they agree.
fn generate_all<M: CausalLm>(m: &M, a: &Args, p: &Prompts, sampling: &Sampling) -> Res<Generated> {
    let (tokens, mut t) = run(m, a, p, &p.ids, sampling, true)?;
    let token_pass_s = report("batched", p.ids.len(), p, &mut t);
    let mut passes = t.passes;
    if a.solo && p.ids.len() > 1 {
        let mut solo = Timing::default();
        for (i, prompt) in p.ids.iter().enumerate() {
            let (alone, t) = run(m, a, p, std::slice::from_ref(prompt), sampling, false)?;
            if alone[0] != tokens[i] {
                return Err(format!(
                    "sequence {i} generated {:?} in the batch and {:?} alone",
                    tokens[i], alone[0]
                )
                .into());
            }
            passes += t.passes;
            solo.prompt_s.extend(t.prompt_s);
            solo.token_s.extend(t.token_s);
            solo.runs.extend(t.runs);
        }
        report("each alone, one after the other", 1, p, &mut solo);
        println!("each sequence's tokens in the batch are its tokens alone");
    }
    Ok(Generated { tokens, passes, token_pass_s })
}

/// The PCIe floor of a token pass: the bytes that crossed into the Device tier per pass over
/// the weights (every generation's, warm-up and `--solo` included), at the pinned-to-device
/// bandwidth measured now, against the batch's median new-token pass; and the least a pass
/// must move: the weights neither resident (`--resident`, kept beside the Device tier) nor
/// within the Device tier.
fn pcie_floor(
    store: &st::Store,
    stored: u64,
    resident: u64,
    budget: u64,
    moved: u64,
    g: &Generated,
) -> Res<()> {
    if g.passes == 0 || moved == 0 || !g.token_pass_s.is_finite() {
        println!(
            "PCIe floor of a token pass: not figured ({})",
            if moved == 0 {
                "nothing crossed into the Device tier"
            } else {
                "no new token's pass timed"
            }
        );
        return Ok(());
    }
    let h2d = st::optim::Bandwidths::measure(store, 0)?.h2d;
    let per_pass = moved / g.passes as u64;
    let floor = per_pass as f64 / h2d;
    println!(
        "PCIe floor of a token pass: {} into the Device tier a pass ({} passes), at {:.1} GB/s \
         (pinned to device, measured now{}): {}; the median new token's pass {}: pass / floor \
         = {:.2}; weights {}, {} of them resident beside the Device tier, beyond both {} (the \
         least a pass moves)",
        st::format_size(per_pass),
        g.passes,
        h2d / 1e9,
        if store.cuda_context().is_some() { "" } else { "; host backend: a memcpy" },
        ms(floor),
        ms(g.token_pass_s),
        g.token_pass_s / floor,
        st::format_size(stored),
        st::format_size(resident),
        st::format_size(stored.saturating_sub(resident).saturating_sub(budget)),
    );
    Ok(())
}

fn main() {
    if let Err(e) = real_main() {
        eprintln!("candle_generate: {e}");
        std::process::exit(1);
    }
}

fn config_path(a: &Args) -> Res<PathBuf> {
    if let Some(c) = &a.config {
        return Ok(c.clone());
    }
    let model = a.model.as_deref().unwrap_or(Path::new("."));
    let dir = if model.is_dir() { model.to_path_buf() } else { model.with_file_name("") };
    Ok(dir.join("config.json"))
}

fn real_main() -> Res<()> {
    let a = parse_args()?;
    let config = LlamaConfig::from_file(config_path(&a)?)?;
    let sampling = Sampling::from_flags(a.temperature, a.top_k, a.top_p, a.seed)?;
    let p = prompts(&a)?;
    let device = st::candle::default_device()?;
    let dtype = a.dtype.unwrap_or(CDType::F32);
    // Every sequence's positions, checked before anything is sized from them.
    let mut positions = 0usize;
    for (i, ids) in p.ids.iter().enumerate() {
        // The last new token is not fed back: prompt + max_new - 1 positions.
        let need = ids
            .len()
            .checked_add(a.max_new.saturating_sub(1))
            .filter(|&n| n <= config.max_position_embeddings);
        positions = positions.saturating_add(need.ok_or_else(|| {
            format!(
                "prompt {i} of {} tokens and --max-new {}: more than the model's \
                 max_position_embeddings {}",
                ids.len(),
                a.max_new,
                config.max_position_embeddings
            )
        })?);
    }
    // Random weights are stored as a checkpoint of the compute dtype would hold them: bf16 for
    // --dtype bf16 (what crosses PCIe at each pass), f32 otherwise.
    let init_dtype = match dtype {
        CDType::BF16 => st::DType::BF16,
        _ => st::DType::F32,
    };
    let weight_bytes = match (&a.model, init_dtype) {
        (None, st::DType::BF16) => 2 * config.parameters(),
        _ => 4 * config.parameters(),
    };
    let kv_bytes = (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim)
        as u64
        * dtype.size_in_bytes() as u64
        * positions as u64;
    // The store: a Device tier of the budget (or room for everything), host memory for the rest.
    let budget = a.device_budget.unwrap_or(2 * (weight_bytes + kv_bytes) + (1 << 20));
    let builder = st::Store::builder()
        .capacity(st::Tier::Device, budget)
        .prefetch_budget(budget)
        .capacity(st::Tier::Pinned, 2 * (weight_bytes + kv_bytes) + (64 << 20));
    let store = st::candle::store_for(&device, builder)?;
    let weights = match &a.model {
        Some(path) => load_weights(&store, &config, path)?,
        None => put_random_weights(&store, &config, a.init_seed, init_dtype)?,
    };
    if let Some(dir) = &a.adapter {
        let m = st::candle::lora::merge_adapter_into(&store, &weights, dir)?;
        println!(
            "merged the LoRA adapter {} (rank {}, alpha {}{}) into {} linears",
            dir.display(),
            m.config.rank,
            m.config.alpha,
            if m.config.rslora { ", rsLoRA" } else { "" },
            m.linears.len()
        );
    }
    if let Some(dir) = &a.save_model {
        std::fs::create_dir_all(dir)?;
        let ids: Vec<_> = weights.iter().map(|(_, id)| *id).collect();
        store.save_safetensors(dir.join("model.safetensors"), &ids)?;
        std::fs::write(dir.join("config.json"), config.to_json())?;
        println!("wrote {} and config.json", dir.join("model.safetensors").display());
    }
    println!(
        "model: {} parameters ({} blocks), device {:?}, {dtype:?}; device budget {}; {} \
         prompt(s) of {:?} tokens",
        config.parameters(),
        config.num_hidden_layers,
        device.location(),
        if a.in_memory { "none (in memory)".to_string() } else { st::format_size(budget) },
        p.ids.len(),
        p.ids.iter().map(Vec::len).collect::<Vec<_>>(),
    );
    let tokens = if a.in_memory {
        // Every weight read once into candle (StoreBackend is candle-nn's VarBuilder backend).
        use candle_nn::var_builder::SimpleBackend;
        let backend = st::candle::StoreBackend::new(store.clone(), weights.clone());
        let mut map = std::collections::HashMap::new();
        for (name, _) in &weights {
            map.insert(name.clone(), backend.get_unchecked(name, dtype, &device)?);
        }
        let model = InMemoryLlama::new(&config, &map, dtype, &device)?;
        drop(map);
        generate_all(&model, &a, &p, &sampling)?.tokens
    } else {
        let mut sizes = Vec::with_capacity(weights.len());
        for (name, id) in &weights {
            sizes.push((name.clone(), store.info(*id)?.bytes));
        }
        let stored: u64 = sizes.iter().map(|s| s.1).sum();
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
        // What the first k blocks hold in the store: kept as candle tensors, they never cross.
        let resident: u64 = sizes
            .iter()
            .filter(|(n, _)| (0..k).any(|l| n.starts_with(&format!("model.layers.{l}."))))
            .map(|s| s.1)
            .sum();
        let before = store.stats();
        let out = generate_all(&model, &a, &p, &sampling)?;
        let s = store.stats();
        let moved = s.moved_into(st::Tier::Device) - before.moved_into(st::Tier::Device);
        println!(
            "out of core: {k} of {} blocks resident; {} into the Device tier, {} evictions; \
             KV cache up to {}",
            config.num_hidden_layers,
            st::format_size(moved),
            s.evictions - before.evictions,
            st::format_size(kv_bytes),
        );
        pcie_floor(&store, stored, resident, budget, moved, &out)?;
        out.tokens
    };
    if p.ids.len() > 1 {
        for (i, t) in tokens.iter().enumerate() {
            if let Some(text) = p.text(t)? {
                println!("[{i}] {text:?}");
            }
        }
    }
    let lines: Vec<String> =
        tokens.iter().map(|t| t.iter().map(u32::to_string).collect::<Vec<_>>().join(",")).collect();
    println!("{}", lines.join(";"));
    Ok(())
}
