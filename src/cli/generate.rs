//! `strata generate`: generates with a Llama-family decoder (Llama, Mistral, Qwen2 as Hugging
//! Face ships them) inside candle, out of core (its blocks streamed through a strata store under
//! a device budget, its KV cache in the store) or in memory: from token ids, or from text,
//! streamed back as text, with the model's chat template; one prompt or several at once (one
//! pass of the weights per token serves them all).
//!
//! ```text
//! strata generate --config examples/configs/tiny-llama.json --init random --prompt-tokens 1,2,3 \
//!     --max-new 16 --device-budget 4MiB
//! strata generate --model HuggingFaceTB/SmolLM2-135M-Instruct --chat \
//!     --prompt "What is the capital of France?" --device-budget 24MiB
//! ```
//!
//! Prints the store's traffic, the time of the prompt's pass and of each new token (min/median
//! over the timed generations), the tokens/s of the batch; with one text prompt, the text as
//! it is generated; why each sequence stopped. The last line is the new tokens (one line a
//! sequence, `;` between).

use std::path::{Path, PathBuf};

use candle_core::DType as CDType;

use crate::cli::model::{self, compute_dtype, ModelArg};
use strata::candle::{
    generate_batch, load_weights, put_random_weights, CausalLm, InMemoryLlama, Layers, LlamaConfig,
    OutOfCoreLlama, Sampling,
};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// `strata generate`'s flags (sizes take `KiB`, `MiB`, `GiB`).
#[derive(clap::Args, Debug, Clone)]
pub struct GenerateArgs {
    /// The model: a `.safetensors` file, a sharded checkpoint's index, a directory, or a
    /// Hugging Face id found in the local Hugging Face cache.
    #[arg(long, value_name = "PATH|ID", conflicts_with = "init")]
    pub model: Option<ModelArg>,
    /// The model's config.json (Llama, Mistral, Qwen2; default: the one beside the weights).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Random weights instead of --model (`random`; needs --config).
    #[arg(long, value_name = "random", value_parser = ["random"])]
    pub init: Option<String>,
    /// The seed of random weights.
    #[arg(long, default_value_t = 1)]
    pub init_seed: u64,
    /// Writes the weights and config there (model.safetensors, config.json) before generating.
    #[arg(long, value_name = "DIR")]
    pub save_model: Option<PathBuf>,
    /// A PEFT LoRA adapter: merged into the base weights in the store before generating, or
    /// applied unmerged over a quantized GGUF base.
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,
    /// A prompt as token ids (`1,2,3`); repeat for a batch.
    #[arg(long, value_name = "IDS", value_parser = token_list)]
    pub prompt_tokens: Vec<Vec<u32>>,
    /// A prompt as text (needs a tokenizer); repeat for a batch.
    #[arg(long, value_name = "TEXT")]
    pub prompt: Vec<String>,
    /// One prompt a line: text with a tokenizer, token ids without.
    #[arg(long, value_name = "FILE")]
    pub prompts: Option<PathBuf>,
    /// A tokenizer.json or a GGUF file (default with --prompt or --chat: a GGUF model's own,
    /// else the one beside the weights; without one, --prompts FILE holds token ids).
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// Render each prompt as a user message with the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// A system message (with --chat).
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// Token ids that end a sequence (`none`: never early; default: the model's end of
    /// sequence).
    #[arg(long, value_name = "IDS|none", value_parser = stop_list)]
    pub stop_tokens: Option<TokenIds>,
    /// New tokens at most.
    #[arg(long, default_value_t = 16)]
    pub max_new: usize,
    /// What the model computes in.
    #[arg(long, value_parser = compute_dtype, value_name = "f32|bf16|f16")]
    pub dtype: Option<CDType>,
    /// The store's Device tier (default: room for the whole model and its cache).
    #[arg(long, value_parser = size, value_name = "SIZE")]
    pub device_budget: Option<u64>,
    /// Keep the first K blocks as candle tensors (auto: as many as fit beside two streamed
    /// blocks and the cache).
    #[arg(long, value_name = "K|auto", value_parser = resident_blocks)]
    pub resident: Option<Resident>,
    /// Sampled decoding at this temperature (greedy without it, or with 0).
    #[arg(long, allow_negative_numbers = true)]
    pub temperature: Option<f64>,
    /// Sample among the K likeliest tokens.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sample among the likeliest tokens whose probabilities add up to P.
    #[arg(long, allow_negative_numbers = true)]
    pub top_p: Option<f64>,
    /// The sampler's seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Generations timed.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    pub steps: u64,
    /// Untimed generations before them.
    #[arg(long, default_value_t = 0)]
    pub warmup: usize,
    /// With several prompts, also generate each alone and check the batch gave each the same
    /// tokens.
    #[arg(long)]
    pub solo: bool,
    /// Every weight resident in candle (the reference: the same tokens as out of core).
    #[arg(long)]
    pub in_memory: bool,
}

fn size(s: &str) -> Result<u64, String> {
    strata::parse_size(s).map_err(|e| e.to_string())
}

fn token_list(s: &str) -> Result<Vec<u32>, String> {
    token_ids(s, "token ids").map_err(|e| e.to_string())
}

/// Token ids as one flag's value (clap reads an `Option<Vec<_>>` as several values).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenIds(pub Vec<u32>);

fn stop_list(s: &str) -> Result<TokenIds, String> {
    if s == "none" {
        return Ok(TokenIds(Vec::new()));
    }
    token_list(s).map(TokenIds)
}

/// `--resident`'s value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resident {
    /// The first K blocks.
    Blocks(usize),
    /// As many as fit.
    Auto,
}

fn resident_blocks(s: &str) -> Result<Resident, String> {
    if s == "auto" {
        return Ok(Resident::Auto);
    }
    s.parse().map(Resident::Blocks).map_err(|_| format!("{s}: a count of blocks or `auto`"))
}

/// The flags, checked against each other.
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

impl GenerateArgs {
    fn check(self) -> Res<Args> {
        let resolved = self.model.as_deref().map(model::resolve).transpose()?;
        let text = !self.prompt.is_empty() || self.tokenizer.is_some() || self.chat;
        // With text prompts and no --tokenizer: a GGUF model's own, or the one beside the
        // weights.
        let tokenizer = match (&self.tokenizer, &resolved) {
            (Some(t), _) => Some(t.clone()),
            (None, Some(m)) if text => Some(
                model::tokenizer_path(&m.weights, None)
                    .ok_or_else(|| model::no_tokenizer(&m.weights, "--prompt and --chat need"))?,
            ),
            _ => None,
        };
        let a = Args {
            config: self.config.or_else(|| resolved.as_ref().and_then(|m| m.config.clone())),
            model: resolved.map(|m| m.weights),
            init_seed: self.init_seed,
            save_model: self.save_model,
            adapter: self.adapter,
            prompt_tokens: self.prompt_tokens,
            prompts: self.prompt,
            prompts_file: self.prompts,
            tokenizer,
            chat: self.chat,
            system: self.system,
            stop_tokens: self.stop_tokens.map(|t| t.0),
            max_new: self.max_new,
            dtype: self.dtype,
            device_budget: self.device_budget,
            resident: self.resident.map(|r| match r {
                Resident::Blocks(k) => Some(k),
                Resident::Auto => None,
            }),
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
            steps: usize::try_from(self.steps).unwrap_or(usize::MAX),
            warmup: self.warmup,
            solo: self.solo,
            in_memory: self.in_memory,
        };
        let init = self.init.is_some();
        match (&a.model, init) {
            (None, false) => return Err("--model PATH|ID or --init random".into()),
            (None, true) if a.config.is_none() => return Err("--init random needs --config".into()),
            _ => {}
        }
        if a.model.as_deref().is_some_and(|m| !model::is_gguf(m)) && a.config.is_none() {
            return Err("no config.json beside the model: give its --config FILE".into());
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
            return Err("a prompt is required: --prompt-tokens, --prompt or --prompts".into());
        }
        if a.in_memory && (a.device_budget.is_some() || a.resident.is_some()) {
            return Err(
                "--device-budget and --resident go with out of core, not --in-memory".into()
            );
        }
        Ok(a)
    }
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
    tokenizer: Option<strata::candle::text::Tokenizer>,
}

impl Prompts {
    /// Streams sequence `i`'s new token (one text prompt: printed as it comes).
    fn streamer(&self) -> Box<dyn FnMut(usize, u32) -> candle_core::Result<()> + '_> {
        #[cfg(feature = "text")]
        if let (Some(t), 1) = (&self.tokenizer, self.ids.len()) {
            let mut stream = strata::candle::text::TextStream::new(t);
            let vocab = t.vocab_size();
            return Box::new(move |_, token| {
                // An id the model has and its tokenizer lacks (a vocabulary padded past the
                // tokenizer's, as Qwen2's is) has no text.
                if token as usize >= vocab {
                    return Ok(());
                }
                if let Some(piece) = stream.push(token)? {
                    out_raw!("{piece}")?;
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
            let known: Vec<u32> =
                tokens.iter().copied().filter(|&x| (x as usize) < t.vocab_size()).collect();
            return Ok(Some(t.decode(&known, true)?));
        }
        let _ = tokens;
        Ok(None)
    }
}

/// The prompts as token ids: given as ids, or text tokenized (with the chat template).
fn prompts(a: &Args, vocab: usize) -> Res<Prompts> {
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
        Some(path) => text_prompts(a, path, &lines, vocab),
        #[cfg(not(feature = "text"))]
        Some(_) => Err("--tokenizer needs the example built with --features text".into()),
    }
}

#[cfg(feature = "text")]
fn text_prompts(a: &Args, path: &Path, lines: &[String], vocab: usize) -> Res<Prompts> {
    use strata::candle::text::Message;
    let side = model::text_side(path, vocab)?;
    let tokenizer = side.tokenizer;
    let template = match (a.chat, side.template) {
        (true, Some(t)) => Some(t),
        (true, None) => {
            return Err(format!(
                "--chat: the model has no chat template (none beside {}, or in its GGUF \
                 metadata): prompt it without --chat",
                path.display()
            )
            .into())
        }
        (false, _) => None,
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
        None => match side.eos.is_empty() {
            false => {
                out!("stops at {:?} ({})", side.eos, side.eos_from)?;
                side.eos
            }
            true => {
                out!(
                    "no end-of-sequence token beside the tokenizer: {} new tokens each",
                    a.max_new
                )?;
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
fn run_timed<M: CausalLm>(
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
            out!()?;
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
fn report(label: &str, batch: usize, p: &Prompts, t: &mut Timing) -> Res<f64> {
    let label = if batch == 1 && label == "batched" { "generated" } else { label };
    let (pmin, pmed) = min_median(&mut t.prompt_s);
    let (tmin, tmed) = min_median(&mut t.token_s);
    let (wall, new): (f64, usize) =
        t.runs.iter().fold((0.0, 0), |(w, n), &(w1, n1)| (w + w1, n + n1));
    let prompt_tokens: usize = p.ids.iter().map(Vec::len).sum();
    out!(
        "{label}, batch {batch}: {new} new tokens in {wall:.3} s, {:.1} tokens/s (prompt \
         passes {prompt_tokens} tokens: min {}, median {}; per new token's pass: min {}, \
         median {})",
        new as f64 / wall,
        ms(pmin),
        ms(pmed),
        ms(tmin),
        ms(tmed),
    )?;
    Ok(tmed)
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
    let (tokens, mut t) = run_timed(m, a, p, &p.ids, sampling, true)?;
    let token_pass_s = report("batched", p.ids.len(), p, &mut t)?;
    let mut passes = t.passes;
    if a.solo && p.ids.len() > 1 {
        let mut solo = Timing::default();
        for (i, prompt) in p.ids.iter().enumerate() {
            let (alone, t) = run_timed(m, a, p, std::slice::from_ref(prompt), sampling, false)?;
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
        report("each alone, one after the other", 1, p, &mut solo)?;
        out!("each sequence's tokens in the batch are its tokens alone")?;
    }
    Ok(Generated { tokens, passes, token_pass_s })
}

/// The PCIe floor of a token pass: the bytes that crossed into the Device tier per pass over
/// the weights (every generation's, warm-up and `--solo` included), at the pinned-to-device
/// bandwidth measured now, against the batch's median new-token pass; and the least a pass
/// must move: the weights neither resident (`--resident`, kept beside the Device tier) nor
/// within the Device tier.
fn pcie_floor(
    store: &strata::Store,
    stored: u64,
    resident: u64,
    budget: u64,
    moved: u64,
    g: &Generated,
) -> Res<()> {
    if g.passes == 0 || moved == 0 || !g.token_pass_s.is_finite() {
        out!(
            "PCIe floor of a token pass: not figured ({})",
            if moved == 0 {
                "nothing crossed into the Device tier"
            } else {
                "no new token's pass timed"
            }
        )?;
        return Ok(());
    }
    let per_pass = moved / g.passes as u64;
    let mut machine = strata::Machine::unknown("this machine");
    machine.measure_link_for(store, per_pass)?;
    let h2d = machine.require("h2d", machine.h2d)?;
    let floor = per_pass as f64 / h2d;
    out!(
        "PCIe floor of a token pass: {} into the Device tier a pass ({} passes), at {:.1} GB/s \
         (pinned to device, measured now{}): {}; the median new token's pass {}: pass / floor \
         = {:.2}; weights {}, {} of them resident beside the Device tier, beyond both {} (the \
         least a pass moves)",
        strata::format_size(per_pass),
        g.passes,
        h2d / 1e9,
        if store.cuda_context().is_some() { "" } else { "; host backend: a memcpy" },
        ms(floor),
        ms(g.token_pass_s),
        g.token_pass_s / floor,
        strata::format_size(stored),
        strata::format_size(resident),
        strata::format_size(stored.saturating_sub(resident).saturating_sub(budget)),
    )?;
    Ok(())
}

/// Runs `strata generate` with these flags.
pub fn run(args: GenerateArgs) -> Res<()> {
    let a = args.check()?;
    let config = match (&a.config, &a.model) {
        (Some(file), _) => LlamaConfig::from_file(file)?,
        (None, Some(m)) if model::is_gguf(m) => LlamaConfig::from_gguf(&strata::Gguf::open(m)?)?,
        (None, _) => return Err("--config FILE is needed".into()),
    };
    let sampling = Sampling::from_flags(a.temperature, a.top_k, a.top_p, a.seed)?;
    let p = prompts(&a, config.vocab_size)?;
    let device = strata::candle::default_device()?;
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
        CDType::BF16 => strata::DType::BF16,
        _ => strata::DType::F32,
    };
    let weight_bytes = match (&a.model, init_dtype) {
        (None, strata::DType::BF16) => 2u64.saturating_mul(config.parameters()),
        _ => 4u64.saturating_mul(config.parameters()),
    };
    let kv_bytes = [
        2,
        config.num_hidden_layers as u64,
        config.num_key_value_heads as u64,
        config.head_dim as u64,
        dtype.size_in_bytes() as u64,
        positions as u64,
    ]
    .iter()
    .try_fold(1u64, |a, &b| a.checked_mul(b))
    .ok_or_else(|| {
        format!(
            "the KV caches of {positions} positions overflow: fewer prompts or a smaller --max-new"
        )
    })?;
    // Weights and caches, twice (the store's host copy and room to move), checked.
    let room = weight_bytes
        .checked_add(kv_bytes)
        .and_then(|b| b.checked_mul(2))
        .ok_or("the model and its KV caches overflow: a smaller --max-new")?;
    crate::cli::check_host_memory(
        "the model and its KV caches",
        u128::from(room) / 2,
        "fewer or shorter prompts, a smaller --max-new, or a smaller model",
    )?;
    // The store: a Device tier of the budget (or room for everything), host memory for the rest.
    let budget = a.device_budget.unwrap_or(room.saturating_add(1 << 20));
    let builder = strata::Store::builder()
        .capacity(strata::Tier::Device, budget)
        .prefetch_budget(budget)
        .capacity(strata::Tier::Pinned, room.saturating_add(64 << 20));
    let store = strata::candle::store_for(&device, builder)?;
    let weights = match &a.model {
        Some(path) => load_weights(&store, &config, path)?,
        None => put_random_weights(&store, &config, a.init_seed, init_dtype)?,
    };
    let mut unmerged = None;
    if let Some(dir) = &a.adapter {
        let (adapter, line) = model::adapter(&store, &weights, dir)?;
        out!("{line}")?;
        unmerged = adapter;
    }
    if let Some(dir) = &a.save_model {
        if unmerged.is_some() {
            return Err(format!(
                "--save-model {}: the adapter is applied unmerged over a quantized base, which \
                 a safetensors file cannot hold: export the merged model with strata finetune \
                 --export-merged DIR --export-dtype f32|bf16",
                dir.display()
            )
            .into());
        }
        std::fs::create_dir_all(dir)?;
        let ids: Vec<_> = weights.iter().map(|(_, id)| *id).collect();
        store.save_safetensors(dir.join("model.safetensors"), &ids)?;
        std::fs::write(dir.join("config.json"), config.to_json())?;
        out!("wrote {} and config.json", dir.join("model.safetensors").display())?;
    }
    out!(
        "model: {} parameters ({} blocks), device {:?}, {dtype:?}; device budget {}; {} \
         prompt(s) of {:?} tokens",
        config.parameters(),
        config.num_hidden_layers,
        device.location(),
        if a.in_memory { "none (in memory)".to_string() } else { strata::format_size(budget) },
        p.ids.len(),
        p.ids.iter().map(Vec::len).collect::<Vec<_>>(),
    )?;
    let tokens = if a.in_memory {
        // Every weight read once into candle (StoreBackend is candle-nn's VarBuilder backend).
        use candle_nn::var_builder::SimpleBackend;
        let backend = strata::candle::StoreBackend::new(store.clone(), weights.clone());
        let mut map = std::collections::HashMap::new();
        for (name, _) in &weights {
            map.insert(name.clone(), backend.get_unchecked(name, dtype, &device)?);
        }
        let mut model = InMemoryLlama::new(&config, &map, dtype, &device)?;
        drop(map);
        if let Some(adapter) = &unmerged {
            model = model.with_adapter(adapter)?;
        }
        generate_all(&model, &a, &p, &sampling)?.tokens
    } else {
        let mut sizes = Vec::with_capacity(weights.len());
        for (name, id) in &weights {
            sizes.push((name.clone(), store.info(*id)?.bytes));
        }
        let stored: u64 = sizes.iter().map(|s| s.1).sum();
        let layers = Layers::new(store.clone(), weights, &device)?;
        let mut model = OutOfCoreLlama::new(layers, &config, dtype)?;
        if let Some(adapter) = &unmerged {
            model = model.with_adapter(adapter)?;
        }
        let k = match a.resident {
            None => 0,
            Some(Some(k)) => k,
            Some(None) => {
                let block = config.block_parameters() * dtype.size_in_bytes() as u64;
                model.blocks_within(budget.saturating_sub(2 * block + kv_bytes))
            }
        };
        if k > config.num_hidden_layers {
            return Err(format!(
                "--resident {k}: the model has {} blocks",
                config.num_hidden_layers
            )
            .into());
        }
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
        let moved = s.moved_into(strata::Tier::Device) - before.moved_into(strata::Tier::Device);
        out!(
            "out of core: {k} of {} blocks resident; {} into the Device tier, {} evictions; \
             KV cache up to {}",
            config.num_hidden_layers,
            strata::format_size(moved),
            s.evictions - before.evictions,
            strata::format_size(kv_bytes),
        )?;
        pcie_floor(&store, stored, resident, budget, moved, &out)?;
        out.tokens
    };
    for (i, t) in tokens.iter().enumerate() {
        let why = match t.last() {
            Some(last) if p.stop.contains(last) => format!("end of sequence (token {last})"),
            _ => format!("--max-new {}", a.max_new),
        };
        match tokens.len() {
            1 => out!("stopped: {why}")?,
            _ => out!("[{i}] stopped: {why}")?,
        }
    }
    if p.ids.len() > 1 {
        for (i, t) in tokens.iter().enumerate() {
            if let Some(text) = p.text(t)? {
                out!("[{i}] {text:?}")?;
            }
        }
    }
    let lines: Vec<String> =
        tokens.iter().map(|t| t.iter().map(u32::to_string).collect::<Vec<_>>().join(",")).collect();
    out!("{}", lines.join(";"))?;
    Ok(())
}
