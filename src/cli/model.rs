//! A model as the commands take it (`--model PATH|ID`): a checkpoint on disk or a Hugging Face
//! id found in the local Hugging Face cache, with its `config.json`, `tokenizer.json` and chat
//! template found beside the weights; and the out-of-core language model `strata chat` and
//! `strata serve` run ([`Llm`]).

use std::path::{Path, PathBuf};

use candle_core::DType as CDType;

use strata::candle::lora::LoadedAdapter;
use strata::candle::text::{eos_tokens, ChatTemplate, Tokenizer};
use strata::candle::{load_weights, CausalLm, Layers, LlamaConfig, OutOfCoreLlama};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// What `--model` names: a path, or a Hugging Face id (`HuggingFaceTB/SmolLM2-135M-Instruct`).
/// Any path the OS allows is taken as it is.
pub type ModelArg = PathBuf;

/// A model's files, found.
#[derive(Clone, Debug)]
pub struct Resolved {
    /// What `load_weights` reads: a `.safetensors` file, an index or a directory.
    pub weights: PathBuf,
    /// `config.json` beside the weights, when there is one.
    pub config: Option<PathBuf>,
}

/// `file` in the directory of `weights` (the directory itself when `weights` is one), if it
/// exists.
pub fn beside(weights: &Path, file: &str) -> Option<PathBuf> {
    let p = dir_of(weights).join(file);
    p.exists().then_some(p)
}

fn dir_of(weights: &Path) -> PathBuf {
    if weights.is_dir() {
        return weights.to_path_buf();
    }
    match weights.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Whether `s` reads as a Hugging Face repository id: `owner/name`, of the characters the Hub
/// allows.
fn is_hub_id(s: &str) -> bool {
    let ok = |part: &str| {
        !part.is_empty()
            && !part.starts_with(['.', '-'])
            && part.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    matches!(s.split_once('/'), Some((owner, name)) if ok(owner) && ok(name))
}

/// The Hugging Face cache's root: `HF_HUB_CACHE`, else `HF_HOME/hub`, else
/// `~/.cache/huggingface/hub`, as `huggingface_hub` lays it out.
pub fn hub_cache() -> hf_hub::Cache {
    match std::env::var_os("HF_HUB_CACHE") {
        Some(p) if !p.is_empty() => hf_hub::Cache::new(PathBuf::from(p)),
        _ => hf_hub::Cache::from_env(),
    }
}

/// Finds the model `--model` names: a path as it is; else a Hugging Face id in the local cache
/// (the snapshot `refs/main` points to).
pub fn resolve(arg: &Path) -> Res<Resolved> {
    if arg.exists() {
        // A GGUF file carries its config in its metadata ([`Resolved::llama_config`]).
        let config = Some(dir_of(arg).join("config.json")).filter(|p| p.is_file() && !is_gguf(arg));
        return Ok(Resolved { weights: arg.to_path_buf(), config });
    }
    let Some(id) = arg.to_str().filter(|s| is_hub_id(s)) else {
        return Err(format!("--model {}: no such file or directory", arg.display()).into());
    };
    let cache = hub_cache();
    let repo = cache.model(id.to_string());
    let Some(config) = repo.get("config.json") else {
        return Err(format!(
            "--model {id}: not a path here, and not in the Hugging Face cache ({}): download \
             it first (`huggingface-cli download {id}` with Python's huggingface_hub, which \
             fills that cache), or give the model's directory",
            cache.path().display()
        )
        .into());
    };
    Ok(Resolved { weights: dir_of(&config), config: Some(config) })
}

/// Whether `path` names a GGUF file (llama.cpp's format), by its extension.
pub fn is_gguf(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

impl Resolved {
    /// The model's config: `--config FILE`, else the one beside the weights, else a GGUF file's
    /// own metadata.
    pub fn llama_config(&self, config: Option<&Path>) -> Res<LlamaConfig> {
        let path = match (config, &self.config) {
            (Some(p), _) => p.to_path_buf(),
            (None, Some(p)) => p.clone(),
            (None, None) if is_gguf(&self.weights) => {
                return Ok(LlamaConfig::from_gguf(&strata::Gguf::open(&self.weights)?)?);
            }
            (None, None) => {
                return Err(format!(
                    "no config.json beside {}: give the model's --config FILE",
                    self.weights.display()
                )
                .into())
            }
        };
        Ok(LlamaConfig::from_file(path)?)
    }
}

/// The text side of a model: its tokenizer, chat template and end-of-sequence tokens.
pub struct TextSide {
    /// `tokenizer.json`'s, or a GGUF file's.
    pub tokenizer: Tokenizer,
    /// The chat template of `tokenizer_config.json` (or a GGUF file's), when the model has one.
    pub template: Option<ChatTemplate>,
    /// The tokens that end a generation (empty: none known).
    pub eos: Vec<u32>,
    /// Where they were read from.
    pub eos_from: String,
}

/// Where a model's tokenizer is: `--tokenizer FILE` (a `tokenizer.json`, or a GGUF file whose
/// metadata has one), else a GGUF model's own metadata, else the `tokenizer.json` beside the
/// weights; `None` when there is none of these.
pub fn tokenizer_path(weights: &Path, flag: Option<&Path>) -> Option<PathBuf> {
    match flag {
        Some(t) => Some(t.to_path_buf()),
        None if is_gguf(weights) => Some(weights.to_path_buf()),
        None => beside(weights, "tokenizer.json"),
    }
}

/// The error of a model with no tokenizer found ([`tokenizer_path`]).
pub fn no_tokenizer(weights: &Path, what: &str) -> String {
    format!(
        "{what} a tokenizer: no tokenizer.json beside {}: give the model's --tokenizer FILE",
        weights.display()
    )
}

/// The tokenizer at `path` ([`tokenizer_path`]: a `tokenizer.json`, with the chat template and
/// end-of-sequence tokens of the files beside it; or a GGUF file, with its metadata's), checked
/// against the model's vocabulary of `vocab`: a tokenizer whose ids run past it is refused
/// here, before anything is generated or trained.
pub fn text_side(path: &Path, vocab: usize) -> Res<TextSide> {
    if is_gguf(path) {
        let file = strata::Gguf::open(path)?;
        let g = strata::candle::text::GgufText::read(&file)?;
        let tok = g.tokenizer()?;
        strata::candle::text::check_vocab(&tok, vocab)?;
        let eos = g.stop_tokens();
        let eos_from = if eos.is_empty() {
            "none known".to_string()
        } else {
            format!("{}: tokenizer.ggml.eos_token_id", path.display())
        };
        let template = g.chat_template()?;
        return Ok(TextSide { tokenizer: tok, template, eos, eos_from });
    }
    let tok = Tokenizer::from_file(path)?;
    strata::candle::text::check_vocab(&tok, vocab)?;
    // None for a base model (no chat template); a template that does not parse is an error.
    let template = ChatTemplate::beside(path)?;
    let (eos, eos_from) = match eos_tokens(&dir_of(path), &tok)? {
        Some(e) => (e.ids, e.from),
        None => (Vec::new(), "none known".to_string()),
    };
    Ok(TextSide { tokenizer: tok, template, eos, eos_from })
}

/// `--adapter DIR` over the model's weights in `store`: merged into them where they are f32 or
/// bf16 ([`LoadedAdapter::merge_into`](strata::candle::lora::LoadedAdapter::merge_into)), else
/// (a quantized GGUF base) returned to be applied unmerged beside them
/// (`OutOfCoreLlama::with_adapter`); with a phrase that says which.
pub fn adapter(
    store: &strata::Store,
    weights: &[(String, strata::TensorId)],
    dir: &Path,
) -> Res<(Option<LoadedAdapter>, String)> {
    let a = LoadedAdapter::read(store, weights, dir)?;
    let c = &a.config;
    let what = format!(
        "the LoRA adapter {} (rank {}, alpha {}{})",
        dir.display(),
        c.rank,
        c.alpha,
        if c.rslora { ", rsLoRA" } else { "" }
    );
    if a.mergeable(store, weights)? {
        let m = a.merge_into(store, weights)?;
        return Ok((None, format!("merged {what} into {} linears", m.linears.len())));
    }
    let line = format!(
        "applied {what} unmerged over {} linears of a quantized base (W dequantized as each \
         block is fetched, plus scale·B·A·x)",
        a.pairs.len()
    );
    Ok((Some(a), line))
}

/// How the model is loaded: the flags `chat` and `serve` share.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelFlags {
    /// The model: a `.safetensors` file, a sharded checkpoint's index, a directory (Llama,
    /// Mistral or Qwen2 as Hugging Face ships them), a GGUF file (its config, tokenizer and chat
    /// template from its metadata), or a Hugging Face id found in the local Hugging Face cache.
    #[arg(long, value_name = "PATH|ID")]
    pub model: ModelArg,
    /// The model's config.json (default: the one beside the weights).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// A tokenizer.json (default: a GGUF model's own, else the one beside the weights; its
    /// tokenizer_config.json gives the chat template), or a GGUF file's.
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// A PEFT LoRA adapter directory: merged into the weights in the store (the model's files
    /// are not touched), or applied unmerged over a quantized GGUF base.
    #[arg(long, value_name = "DIR")]
    pub adapter: Option<PathBuf>,
    /// What the model computes in: f32, bf16 or f16.
    #[arg(long, value_parser = compute_dtype, default_value = "f32")]
    pub dtype: CDType,
    /// The store's Device tier (default: room for the whole model and its caches).
    #[arg(long, value_parser = size, value_name = "SIZE")]
    pub device_budget: Option<u64>,
    /// Keep the first K blocks as candle tensors beside the Device tier.
    #[arg(long, default_value_t = 0, value_name = "K")]
    pub resident: usize,
}

fn size(s: &str) -> Result<u64, String> {
    strata::parse_size(s).map_err(|e| e.to_string())
}

/// `--dtype`'s values.
pub fn compute_dtype(s: &str) -> Result<CDType, String> {
    match s {
        "f32" => Ok(CDType::F32),
        "bf16" => Ok(CDType::BF16),
        "f16" => Ok(CDType::F16),
        _ => Err(format!("{s}: f32, bf16 or f16")),
    }
}

/// An out-of-core language model with its text side, ready to generate.
pub struct Llm {
    /// The model: its blocks streamed through a store, its KV caches in the store.
    pub model: OutOfCoreLlama,
    /// Its tokenizer, chat template and end-of-sequence tokens.
    pub text: TextSide,
    /// A line that says what was loaded.
    pub summary: String,
}

impl Llm {
    /// Loads the model `flags` name, with room in its store for `positions` cached positions
    /// in all (the KV caches of every sequence at once); `positions_from` names the command's
    /// flags that set them (said when they do not fit).
    pub fn load(flags: &ModelFlags, positions: usize, positions_from: &str) -> Res<Llm> {
        let m = resolve(&flags.model)?;
        let config = m.llama_config(flags.config.as_deref())?;
        let tokenizer = tokenizer_path(&m.weights, flags.tokenizer.as_deref())
            .ok_or_else(|| no_tokenizer(&m.weights, "the model needs"))?;
        let text = text_side(&tokenizer, config.vocab_size)?;
        let device = strata::candle::default_device()?;
        let dtype = flags.dtype;
        let kv_bytes = (2 * config.num_hidden_layers * config.num_key_value_heads)
            .checked_mul(config.head_dim)
            .and_then(|n| n.checked_mul(dtype.size_in_bytes()))
            .and_then(|n| n.checked_mul(positions))
            .map(|n| n as u64)
            .ok_or_else(|| {
                format!("the KV caches' size overflows: fewer positions ({positions_from})")
            })?;
        let weight_bytes = 4u64.saturating_mul(config.parameters());
        let room =
            weight_bytes.checked_add(kv_bytes).and_then(|b| b.checked_mul(2)).ok_or_else(|| {
                format!("the model and its KV caches overflow: fewer positions ({positions_from})")
            })?;
        let budget = flags.device_budget.unwrap_or(room.saturating_add(1 << 20));
        crate::cli::check_host_memory(
            &format!("the model and the KV caches of {positions} positions"),
            u128::from(weight_bytes) + u128::from(kv_bytes),
            &format!("fewer positions ({positions_from}), or a smaller model"),
        )?;
        let builder = strata::Store::builder()
            .capacity(strata::Tier::Device, budget)
            .prefetch_budget(budget)
            .capacity(strata::Tier::Pinned, room.saturating_add(64 << 20));
        let store = strata::candle::store_for(&device, builder)?;
        let weights = load_weights(&store, &config, &m.weights)?;
        let (mut merged, mut unmerged) = (String::new(), None);
        if let Some(dir) = &flags.adapter {
            let (a, line) = adapter(&store, &weights, dir)?;
            merged = format!("; {line}");
            unmerged = a;
        }
        if flags.resident > config.num_hidden_layers {
            return Err(format!(
                "--resident {}: the model has {} blocks",
                flags.resident, config.num_hidden_layers
            )
            .into());
        }
        let layers = Layers::new(store, weights, &device)?;
        let mut model =
            OutOfCoreLlama::new(layers, &config, dtype)?.with_resident(flags.resident)?;
        if let Some(a) = &unmerged {
            model = model.with_adapter(a)?;
        }
        let summary = format!(
            "{}: {:.1} M parameters, {} blocks ({} resident), {dtype:?} on {:?}, device budget \
             {}{merged}",
            m.weights.display(),
            config.parameters() as f64 / 1e6,
            config.num_hidden_layers,
            flags.resident,
            model.device().location(),
            strata::format_size(budget),
        );
        Ok(Llm { model, text, summary })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_are_owner_and_name() {
        assert!(is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct"));
        assert!(is_hub_id("meta-llama/Llama-3.2-1B"));
        for bad in ["model", "/abs/path", "a/b/c", "./x/y", "../x", "a/", "/b", "a b/c"] {
            assert!(!is_hub_id(bad), "{bad}");
        }
    }

    #[test]
    fn a_hub_id_is_found_in_a_cache_laid_out_as_huggingface_hub_lays_it() {
        let root = tempfile::tempdir().unwrap();
        let snap = root.path().join("models--owner--tiny/snapshots/abc123");
        std::fs::create_dir_all(&snap).unwrap();
        std::fs::create_dir_all(root.path().join("models--owner--tiny/refs")).unwrap();
        std::fs::write(root.path().join("models--owner--tiny/refs/main"), "abc123").unwrap();
        std::fs::write(snap.join("config.json"), "{}").unwrap();
        let cache = hf_hub::Cache::new(root.path().to_path_buf());
        let found = cache.model("owner/tiny".into()).get("config.json").unwrap();
        assert_eq!(found, snap.join("config.json"));
    }

    #[test]
    fn a_missing_model_says_where_it_looked() {
        let e = resolve(Path::new("/nonexistent/model.safetensors")).unwrap_err().to_string();
        assert!(e.contains("no such file"), "{e}");
        let e = resolve(Path::new("nobody-here/no-model-xyz")).unwrap_err().to_string();
        assert!(e.contains("Hugging Face cache"), "{e}");
    }
}
