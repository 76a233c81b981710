//! LoRA adapters (Hu et al., 2021) as PEFT makes, names and saves them: [`LoraConfig`] (rank,
//! alpha, the target linears by name, rsLoRA), the adapters a config puts on a block
//! ([`adapter_specs`]), PEFT's initialisation (`A` Kaiming-uniform with `a = sqrt(5)`, `B`
//! zero), PEFT's files (`adapter_model.safetensors` with PEFT's tensor names,
//! `adapter_config.json`: [`write_adapter_config`], [`read_adapter`]), the merge
//! `W + scale · B·A` ([`merge`]; into a store's base weights, for generating from an adapter
//! without a merged copy on disk: [`merge_adapter_into`]), and an adapter read for a model's
//! weights and applied unmerged beside them ([`LoadedAdapter`]: over a quantized base, which
//! cannot take a merge).
//!
//! The trainer ([`Trainer`](super::Trainer)) trains adapters over a frozen base streamed
//! through the store: `TrainConfig::lora`. PEFT's names: the adapter of
//! `model.layers.3.self_attn.q_proj.weight` is `model.layers.3.self_attn.q_proj.lora_A.weight`
//! and `.lora_B.weight` here, and `base_model.model.` before those in PEFT's files
//! ([`peft_name`]).

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use serde_json::Value;

use super::block::Block;
use super::llama::SeededRng;
use super::LlamaConfig;
use crate::{DType, Store, TensorId};

/// The adapters' file in a PEFT adapter directory.
pub const ADAPTER_FILE: &str = "adapter_model.safetensors";
/// The adapters' config in a PEFT adapter directory.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// What PEFT puts before a model's own tensor names in its files.
const PEFT_PREFIX: &str = "base_model.model.";

/// The fields of an `adapter_config.json` that [`LoraConfig::from_peft_json`] reads (or checks).
const PEFT_READ: [&str; 14] = [
    "peft_type",
    "r",
    "lora_alpha",
    "lora_dropout",
    "target_modules",
    "use_rslora",
    "use_dora",
    "fan_in_fan_out",
    "bias",
    "rank_pattern",
    "alpha_pattern",
    "layers_to_transform",
    "modules_to_save",
    "layers_pattern",
];

/// Fields that change nothing of the computation when an adapter is loaded: where it came from,
/// how PEFT initialised it, the PEFT version, and settings of variants that are off.
const PEFT_HARMLESS: [&str; 13] = [
    "base_model_name_or_path",
    "revision",
    "task_type",
    "peft_version",
    "inference_mode",
    "init_lora_weights",
    "auto_mapping",
    "megatron_core",
    "qalora_group_size",
    "loftq_config",
    "corda_config",
    "eva_config",
    "lora_ga_config",
];

/// Which linears get adapters, and their rank and scale. PEFT's `LoraConfig` without dropout
/// (strata trains without it) and without DoRA.
///
/// ```
/// use strata::candle::lora::LoraConfig;
/// let c = LoraConfig::new(8, 16.0, &["q_proj", "v_proj"]);
/// assert_eq!(c.scale(), 2.0);                                  // alpha / rank
/// assert!(c.targets_linear("self_attn.q_proj.weight"));      // PEFT's suffix match
/// assert!(!c.targets_linear("self_attn.k_proj.weight"));
/// assert_eq!(LoraConfig { rslora: true, ..c }.scale(), 16.0 / 8f64.sqrt());
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// The adapters' rank `r` (at least 1).
    pub rank: usize,
    /// `lora_alpha`: the adapters' output is multiplied by `alpha / rank`.
    pub alpha: f64,
    /// Module names, matched as PEFT matches a list of `target_modules`: a linear whose module
    /// (its weight's name without `.weight`) is the name or ends with `.` and the name
    /// (`q_proj` takes every `...self_attn.q_proj`).
    pub targets: Vec<String>,
    /// rsLoRA (`use_rslora`): the scale is `alpha / sqrt(rank)`.
    pub rslora: bool,
    /// The seed of `A`'s initial values.
    pub seed: u64,
}

impl LoraConfig {
    /// Adapters of rank `rank` and `alpha` on `targets`, without rsLoRA, seed 0.
    pub fn new(rank: usize, alpha: f64, targets: &[&str]) -> LoraConfig {
        LoraConfig {
            rank,
            alpha,
            targets: targets.iter().map(|s| s.to_string()).collect(),
            rslora: false,
            seed: 0,
        }
    }

    /// What the adapters' output is multiplied by: `alpha / rank`, or `alpha / sqrt(rank)`
    /// with rsLoRA (PEFT's `scaling`).
    pub fn scale(&self) -> f64 {
        match self.rslora {
            true => self.alpha / (self.rank as f64).sqrt(),
            false => self.alpha / self.rank as f64,
        }
    }

    /// Whether the linear whose weight is `name` (within a block, or whole) is a target.
    pub fn targets_linear(&self, name: &str) -> bool {
        let module = name.strip_suffix(".weight").unwrap_or(name);
        self.targets.iter().any(|t| module == t || module.ends_with(&format!(".{t}")))
    }

    /// Checks the config: a rank of at least 1, an alpha finite and above 0, at least one
    /// target, none empty.
    pub fn validate(&self) -> candle_core::Result<()> {
        if self.rank == 0 {
            candle_core::bail!("LoRA rank 0: at least 1");
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            candle_core::bail!("LoRA alpha {}: a finite number above 0", self.alpha);
        }
        if self.targets.is_empty() || self.targets.iter().any(|t| t.is_empty()) {
            candle_core::bail!(
                "LoRA targets {:?}: one module name or more (q_proj, v_proj, ...)",
                self.targets
            );
        }
        Ok(())
    }

    /// The config of a PEFT adapter directory (its `adapter_config.json`). What would change
    /// the computation and is not supported is refused, naming the field: another
    /// `peft_type`, `use_dora`, `fan_in_fan_out` (GPT-2's Conv1D layout), `bias` other than
    /// `none`, per-module `rank_pattern` or `alpha_pattern`, `layers_to_transform`,
    /// `modules_to_save`, `target_modules` as a regular expression, and a `lora_dropout`
    /// above 0 (strata trains without dropout; set it to 0 to train on without it: merging
    /// and generating do not use it).
    pub fn from_peft(dir: impl AsRef<Path>) -> candle_core::Result<LoraConfig> {
        let path = dir.as_ref().join(ADAPTER_CONFIG);
        let text = super::read_text_file_needed(&path)?;
        Self::from_peft_json(&text).map_err(|e| e.context(format!("in {}", path.display())))
    }

    /// [`LoraConfig::from_peft`] from the text of an `adapter_config.json`.
    pub fn from_peft_json(text: &str) -> candle_core::Result<LoraConfig> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| candle_core::Error::Msg(format!("not JSON: {e}")).bt())?;
        let refuse = |field: &str, why: &str| -> candle_core::Result<LoraConfig> {
            candle_core::bail!("{field} {}: {why}", v[field])
        };
        if v["peft_type"].as_str() != Some("LORA") {
            return refuse("peft_type", "only LoRA adapters are read");
        }
        let truthy = |k: &str| v[k].as_bool().unwrap_or(false);
        if truthy("use_dora") {
            return refuse("use_dora", "DoRA is not supported");
        }
        if truthy("fan_in_fan_out") {
            return refuse("fan_in_fan_out", "weights of [in, out] (Conv1D) are not supported");
        }
        if !matches!(v["bias"].as_str(), None | Some("none")) {
            return refuse("bias", "adapters with biases are not supported");
        }
        for k in ["rank_pattern", "alpha_pattern"] {
            if v[k].as_object().is_some_and(|m| !m.is_empty()) {
                return refuse(k, "per-module ranks and alphas are not supported");
            }
        }
        for k in ["layers_to_transform", "modules_to_save", "layers_pattern"] {
            let empty = match &v[k] {
                Value::Null => true,
                Value::Array(a) => a.is_empty(),
                _ => false,
            };
            if !empty {
                return refuse(k, "not supported: every layer's targets get adapters here");
            }
        }
        // Any other field that is set may change the computation (PEFT adds variants often):
        // refused, naming it, unless it is known to change nothing here.
        if let Some(map) = v.as_object() {
            for (k, x) in map {
                let set = match x {
                    Value::Null | Value::Bool(false) => false,
                    Value::Array(a) => !a.is_empty(),
                    Value::Object(o) => !o.is_empty(),
                    _ => true,
                };
                if set && !PEFT_READ.contains(&k.as_str()) && !PEFT_HARMLESS.contains(&k.as_str()) {
                    return refuse(k, "not supported: it may change the computation");
                }
            }
        }
        let dropout = v["lora_dropout"].as_f64().unwrap_or(0.0);
        if dropout != 0.0 {
            return refuse(
                "lora_dropout",
                "strata trains LoRA without dropout, so training on from this adapter would \
                 not be PEFT's computation: set it to 0 in adapter_config.json (merging and \
                 generation do not use it)",
            );
        }
        let targets = match &v["target_modules"] {
            Value::Array(a) => a
                .iter()
                .map(|t| t.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| candle_core::Error::Msg("target_modules: names".into()))?,
            Value::String(_) => {
                return refuse(
                    "target_modules",
                    "a regular expression; a list of module names is read",
                )
            }
            _ => return refuse("target_modules", "a list of module names is needed"),
        };
        let rank = v["r"].as_u64().and_then(|r| usize::try_from(r).ok());
        let Some(rank) = rank else { return refuse("r", "a whole number is needed") };
        let Some(alpha) = v["lora_alpha"].as_f64() else {
            return refuse("lora_alpha", "a number is needed");
        };
        let mut targets = targets;
        targets.sort();
        let c = LoraConfig { rank, alpha, targets, rslora: truthy("use_rslora"), seed: 0 };
        c.validate()?;
        Ok(c)
    }

    /// This config as PEFT's `adapter_config.json` (`base`: the base model's path or name,
    /// PEFT's `base_model_name_or_path`), which `PeftModel.from_pretrained` reads.
    pub fn to_peft_json(&self, base: Option<&str>) -> String {
        let mut targets = self.targets.clone();
        targets.sort();
        let alpha: Value = if self.alpha.fract() == 0.0 && self.alpha.abs() < 1e15 {
            (self.alpha as i64).into()
        } else {
            self.alpha.into()
        };
        let v = serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base,
            "r": self.rank,
            "lora_alpha": alpha,
            "lora_dropout": 0.0,
            "target_modules": targets,
            "bias": "none",
            "fan_in_fan_out": false,
            "use_rslora": self.rslora,
            "use_dora": false,
            "init_lora_weights": true,
            "inference_mode": true,
            "modules_to_save": null,
            "layers_to_transform": null,
            "layers_pattern": null,
            "rank_pattern": {},
            "alpha_pattern": {},
        });
        serde_json::to_string_pretty(&v).unwrap_or_default()
    }
}

/// One adapter a [`LoraConfig`] puts on a model: on block `layer`'s linear `linear` (its
/// weight's name within the block), `A` and `B` under their names and shapes.
#[derive(Clone, Debug, PartialEq)]
pub struct AdapterSpec {
    /// The block.
    pub layer: usize,
    /// The linear's weight, within the block (`self_attn.q_proj.weight`).
    pub linear: String,
    /// `lora_A`'s name (`model.layers.N.self_attn.q_proj.lora_A.weight`) and shape `[rank, in]`.
    pub a: (String, Vec<usize>),
    /// `lora_B`'s name and shape `[out, rank]`.
    pub b: (String, Vec<usize>),
}

/// The adapters `lora` puts on a decoder of `config`'s skeleton with blocks `block`: on each
/// block, each of [`Block::linears`] that a target names, in that order. A target that names
/// none of them is an error (as PEFT refuses targets it does not find), and so is a linear
/// that is not a 2-D weight named `*.weight`.
pub fn adapter_specs(
    config: &LlamaConfig,
    block: &dyn Block,
    lora: &LoraConfig,
) -> candle_core::Result<Vec<AdapterSpec>> {
    lora.validate()?;
    let shapes: HashMap<String, Vec<usize>> = block.tensors().into_iter().collect();
    let linears = block.linears();
    let mut chosen = Vec::new();
    for name in &linears {
        if !lora.targets_linear(name) {
            continue;
        }
        let module = name.strip_suffix(".weight").ok_or_else(|| {
            candle_core::Error::Msg(format!("linear {name}: a weight's name ends in .weight"))
        })?;
        let shape = shapes.get(name).ok_or_else(|| {
            candle_core::Error::Msg(format!("linear {name} is not one of the block's tensors"))
        })?;
        let [out, inp] = shape[..] else {
            candle_core::bail!("linear {name} has shape {shape:?}: [out, in] is needed");
        };
        chosen.push((name.clone(), module.to_string(), out, inp));
    }
    for t in &lora.targets {
        if !linears
            .iter()
            .any(|n| LoraConfig { targets: vec![t.clone()], ..lora.clone() }.targets_linear(n))
        {
            candle_core::bail!(
                "LoRA target {t} names none of the block's linears ({})",
                linears.join(", ")
            );
        }
    }
    // The adapters' sizes, in checked arithmetic: a rank past the weights' sides gains nothing
    // and an absurd one would overflow the sizes or the allocation of `A`'s initial values.
    let per_block = chosen.iter().try_fold(0u64, |acc, (name, _, o, i)| {
        let a = (lora.rank as u64).checked_mul(*i as u64);
        let b = (lora.rank as u64).checked_mul(*o as u64);
        let fits = |n: u64| n.checked_mul(4).is_some_and(|b| b <= isize::MAX as u64);
        match a.zip(b).filter(|&(a, b)| fits(a) && fits(b)) {
            Some((a, b)) => Ok(acc.saturating_add(a).saturating_add(b)),
            None => Err(candle_core::Error::Msg(format!(
                "LoRA rank {}: the adapter of {name} ([{}, {i}] and [{o}, {}]) is too large to \
                 be made: a rank up to the weight's sides ({o} and {i}) is useful",
                lora.rank, lora.rank, lora.rank
            ))),
        }
    })?;
    // Each adapter's values, gradient and two moments, f32.
    let bytes = per_block.saturating_mul(config.num_hidden_layers as u64).saturating_mul(16);
    if let Some(available) = crate::host_memory_available() {
        if bytes > available {
            candle_core::bail!(
                "LoRA rank {}: the adapters, their gradients and moments need {} and {} of host \
                 memory is available: a smaller rank",
                lora.rank,
                crate::format_size(bytes),
                crate::format_size(available)
            );
        }
    }
    let mut out = Vec::new();
    for layer in 0..config.num_hidden_layers {
        let p = LlamaConfig::block_prefix(layer);
        for (name, module, o, i) in &chosen {
            out.push(AdapterSpec {
                layer,
                linear: name.clone(),
                a: (format!("{p}{module}.lora_A.weight"), vec![lora.rank, *i]),
                b: (format!("{p}{module}.lora_B.weight"), vec![*o, lora.rank]),
            });
        }
    }
    Ok(out)
}

/// `lora_A`'s initial values, as PEFT initialises them (`nn.init.kaiming_uniform_(a =
/// sqrt(5))`: uniform in `±1/sqrt(in)` for a `[rank, in]` matrix), from `seed` and the
/// adapter's number: the same on every machine. (PEFT draws from torch's generator: the
/// distribution is the same, not the values.)
pub fn init_a(seed: u64, index: usize, shape: &[usize]) -> Vec<f32> {
    let n: usize = shape.iter().product();
    let fan_in = shape.get(1).copied().unwrap_or(1).max(1);
    let bound = 1.0 / (fan_in as f64).sqrt();
    let mut rng = SeededRng::new(seed ^ (index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    (0..n).map(|_| ((2.0 * rng.uniform() - 1.0) * bound) as f32).collect()
}

/// A model's tensor name as PEFT writes it in `adapter_model.safetensors`.
pub fn peft_name(name: &str) -> String {
    format!("{PEFT_PREFIX}{name}")
}

/// Whether `name` is a LoRA adapter's (`...lora_A.weight`, `...lora_B.weight`).
pub(crate) fn is_adapter(name: &str) -> bool {
    name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight")
}

/// `W + scale · B·A` in f32 (PEFT's merge, `get_delta_weight`), for `w` of `[out, in]`.
pub fn merge(w: &Tensor, a: &Tensor, b: &Tensor, scale: f64) -> candle_core::Result<Tensor> {
    let f = candle_core::DType::F32;
    w.to_dtype(f)?.add(&(b.to_dtype(f)?.matmul(&a.to_dtype(f)?)? * scale)?)
}

/// Writes `adapter_config.json` for `lora` into `dir`.
pub fn write_adapter_config(
    dir: &Path,
    lora: &LoraConfig,
    base: Option<&str>,
) -> candle_core::Result<()> {
    let p = dir.join(ADAPTER_CONFIG);
    std::fs::write(&p, lora.to_peft_json(base)).map_err(|e| crate::Error::io(&p, e).into())
}

/// A PEFT adapter directory: its config ([`LoraConfig::from_peft`]) and its tensors
/// (`adapter_model.safetensors`, f32, bf16 or f16, as f32 candle tensors on the CPU) under
/// this crate's names (PEFT's `base_model.model.` taken off). A tensor that is not a LoRA
/// `A` or `B` of a linear (an embedding's adapter, a DoRA magnitude) is refused, naming it.
pub fn read_adapter(
    dir: impl AsRef<Path>,
) -> candle_core::Result<(LoraConfig, HashMap<String, Tensor>)> {
    let dir = dir.as_ref();
    let config = LoraConfig::from_peft(dir)?;
    let path = dir.join(ADAPTER_FILE);
    let bytes = crate::tiers::file::read_regular(&path)?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
        candle_core::Error::Msg(format!("{}: not a safetensors file ({e})", path.display())).bt()
    })?;
    let mut out = HashMap::new();
    for (name, view) in st.tensors() {
        let ours = name.strip_prefix(PEFT_PREFIX).unwrap_or(&name).to_string();
        if !is_adapter(&ours) {
            candle_core::bail!(
                "{}: tensor {name} is not a LoRA A or B of a linear (lora_A.weight, \
                 lora_B.weight): not supported",
                path.display()
            );
        }
        let dtype = match view.dtype() {
            safetensors::Dtype::F32 => candle_core::DType::F32,
            safetensors::Dtype::BF16 => candle_core::DType::BF16,
            safetensors::Dtype::F16 => candle_core::DType::F16,
            other => candle_core::bail!("{}: tensor {name} is {other:?}", path.display()),
        };
        let t = Tensor::from_raw_buffer(view.data(), dtype, view.shape(), &Device::Cpu)?
            .to_dtype(candle_core::DType::F32)?;
        out.insert(ours, t);
    }
    Ok((config, out))
}

/// What [`merge_adapter_into`] merged.
#[derive(Clone, Debug, PartialEq)]
pub struct MergedAdapter {
    /// The adapter's config (rank, alpha, targets, rsLoRA), from its `adapter_config.json`.
    pub config: LoraConfig,
    /// The base weights changed, in the model's order of `weights`.
    pub linears: Vec<String>,
}

/// A PEFT adapter directory read for a model whose weights are in a store, and checked against
/// them ([`LoadedAdapter::read`]): to merge into those weights ([`LoadedAdapter::merge_into`],
/// for f32 and bf16 weights) or to apply unmerged, `y = W·x + scale · B·(A·x)` beside each
/// adapted linear (`OutOfCoreLlama::with_adapter`, `InMemoryLlama::with_adapter`: over a
/// quantized GGUF base, whose weights stay quantized in the store and are dequantized where a
/// block is fetched).
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use strata::candle::{load_weights, lora::LoadedAdapter, store_for, Layers, LlamaConfig, OutOfCoreLlama};
/// use candle_core::{DType, Device};
/// let path = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// let config = LlamaConfig::from_gguf(&strata::Gguf::open(path)?)?;
/// let store = store_for(&Device::Cpu, strata::Store::builder())?;
/// let weights = load_weights(&store, &config, path)?; // quantized, in place
/// let adapter = LoadedAdapter::read(&store, &weights, "my-adapter")?;
/// let layers = Layers::new(store, weights, &Device::Cpu)?;
/// let model = OutOfCoreLlama::new(layers, &config, DType::F32)?.with_adapter(&adapter)?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct LoadedAdapter {
    /// The adapter's config (rank, alpha, targets, rsLoRA), from its `adapter_config.json`.
    pub config: LoraConfig,
    /// `(weight, A, B)` for each adapted linear, in the model's order of the `weights` it was
    /// read for: the weight's name (`model.layers.3.self_attn.q_proj.weight`), `A` of `[rank,
    /// in]` and `B` of `[out, rank]`, f32 on the CPU.
    pub pairs: Vec<(String, Tensor, Tensor)>,
}

impl LoadedAdapter {
    /// Reads the PEFT adapter in `dir` ([`read_adapter`]) for the model whose weights are
    /// `weights` in `store`. Everything is checked: each `lora_A` has its `lora_B` and the
    /// other way round, every value finite; each pair adapts a linear that the config's
    /// `target_modules` names and `weights` holds (`model.layers.3.self_attn.q_proj.weight`
    /// for `...q_proj.lora_A.weight`), with `A` of `[rank, in]` and `B` of `[out, rank]`
    /// against `W`'s `[out, in]` and the config's rank; and every linear of the model's blocks
    /// that the targets name has its pair (an adapter of some layers only is refused, as the
    /// trainer refuses it). Nothing in the store changes.
    pub fn read(
        store: &Store,
        weights: &[(String, TensorId)],
        dir: impl AsRef<Path>,
    ) -> candle_core::Result<LoadedAdapter> {
        let dir = dir.as_ref();
        let (config, mut tensors) = read_adapter(dir)?;
        config.validate()?;
        let file = dir.join(ADAPTER_FILE);
        // Pair each A with its B, and both with the weight they adapt.
        let mut pairs: Vec<(usize, Tensor, Tensor)> = Vec::new();
        let mut names: Vec<String> = tensors.keys().cloned().collect();
        names.sort();
        for name in &names {
            let Some(linear) = name.strip_suffix(".lora_A.weight") else {
                if let Some(linear) = name.strip_suffix(".lora_B.weight") {
                    if !names.contains(&format!("{linear}.lora_A.weight")) {
                        candle_core::bail!(
                            "{}: {name} has no {linear}.lora_A.weight beside it",
                            file.display()
                        );
                    }
                }
                continue;
            };
            let base = format!("{linear}.weight");
            if !config.targets_linear(&base) {
                candle_core::bail!(
                    "{}: {name} adapts {base}, which the adapter's target_modules {:?} do not \
                     name",
                    file.display(),
                    config.targets
                );
            }
            let Some(index) = weights.iter().position(|(n, _)| *n == base) else {
                candle_core::bail!(
                    "{}: {name} adapts {base}, which the model does not have (another \
                     architecture's adapter?)",
                    file.display()
                );
            };
            let a = tensors.remove(name).expect("listed");
            let Some(b) = tensors.remove(&format!("{linear}.lora_B.weight")) else {
                candle_core::bail!(
                    "{}: {name} has no {linear}.lora_B.weight beside it",
                    file.display()
                );
            };
            let info = store.info(weights[index].1).map_err(|e| super::strata_err(&base, e))?;
            let w = info.shape.as_slice();
            let ok =
                w.len() == 2 && a.dims() == [config.rank, w[1]] && b.dims() == [w[0], config.rank];
            if !ok {
                candle_core::bail!(
                    "{}: {name} is {:?} and its B {:?}; {base} is {w:?} and the adapter's rank \
                     {}: A must be [rank, in], B [out, rank]",
                    file.display(),
                    a.dims(),
                    b.dims(),
                    config.rank
                );
            }
            for (t, which) in [(&a, name.clone()), (&b, format!("{linear}.lora_B.weight"))] {
                let finite = t.flatten_all()?.to_vec1::<f32>()?.iter().all(|x| x.is_finite());
                if !finite {
                    candle_core::bail!(
                        "{}: {which} holds a NaN or an infinity: applied, it would make {base} \
                         so (a diverged run's adapter?)",
                        file.display()
                    );
                }
            }
            pairs.push((index, a, b));
        }
        if pairs.is_empty() {
            candle_core::bail!("{}: no LoRA adapter in it", file.display());
        }
        // Every linear of the model's blocks that the adapter's targets name must have its
        // adapter, as the trainer refuses an adapter that does not hold each of the run's: one
        // for some layers only would run a model that is neither the base nor the fine-tune.
        let missing: Vec<&str> = weights
            .iter()
            .enumerate()
            .filter(|(i, (n, id))| {
                n.contains(".layers.")
                    && config.targets_linear(n)
                    && store.info(*id).is_ok_and(|t| t.shape.len() == 2)
                    && !pairs.iter().any(|p| p.0 == *i)
            })
            .map(|(_, (n, _))| n.as_str())
            .collect();
        if let Some(first) = missing.first() {
            candle_core::bail!(
                "{}: the adapter's target_modules {:?} name {} linears of the model and it \
                 holds adapters of {}: none for {first}{}: an adapter of some layers only (of a \
                 smaller model?) is refused, as the trainer refuses it",
                file.display(),
                config.targets,
                missing.len() + pairs.len(),
                pairs.len(),
                if missing.len() > 1 {
                    format!(" and {} more", missing.len() - 1)
                } else {
                    String::new()
                }
            );
        }
        pairs.sort_by_key(|p| p.0);
        let pairs = pairs.into_iter().map(|(i, a, b)| (weights[i].0.clone(), a, b)).collect();
        Ok(LoadedAdapter { config, pairs })
    }

    /// The names of the weights adapted, in the model's order.
    pub fn linears(&self) -> Vec<String> {
        self.pairs.iter().map(|(n, ..)| n.clone()).collect()
    }

    /// Whether [`LoadedAdapter::merge_into`] can merge it: every weight adapted is f32 or bf16
    /// in `store` (a quantized or f16 one is applied unmerged instead).
    pub fn mergeable(
        &self,
        store: &Store,
        weights: &[(String, TensorId)],
    ) -> candle_core::Result<bool> {
        for (name, ..) in &self.pairs {
            let id =
                weights.iter().find(|(n, _)| n == name).map(|(_, id)| *id).ok_or_else(|| {
                    candle_core::Error::CannotFindTensor { path: name.clone() }.bt()
                })?;
            let info = store.info(id).map_err(|e| super::strata_err(name, e))?;
            if !matches!(info.dtype, DType::F32 | DType::BF16) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// The adapters of block `layer` as a block's forward applies them
    /// ([`Adapter`](super::block::Adapter), by their weight's name within the block:
    /// `self_attn.q_proj.weight`), `A` and `B` on `device` in f32 (PEFT's arithmetic: the input
    /// cast to the adapter's dtype).
    pub fn block(
        &self,
        layer: usize,
        device: &Device,
    ) -> candle_core::Result<HashMap<String, super::linear::Adapter>> {
        let prefix = LlamaConfig::block_prefix(layer);
        let scale = self.config.scale();
        let mut out = HashMap::new();
        for (name, a, b) in &self.pairs {
            if let Some(within) = name.strip_prefix(&prefix) {
                let adapter = super::linear::Adapter {
                    a: a.to_device(device)?,
                    b: b.to_device(device)?,
                    scale,
                };
                out.insert(within.to_string(), adapter);
            }
        }
        Ok(out)
    }

    /// Merges it into the base weights `weights` names in `store` (those it was read for):
    /// each adapted linear's `W` becomes `W + scale · B·A`, computed in f32 and written back in
    /// `W`'s dtype (f32 or bf16; a quantized or f16 weight is refused, naming it, before
    /// anything is written: apply the adapter unmerged over it). [`merge_adapter_into`] says
    /// how a failure leaves the weights.
    pub fn merge_into(
        &self,
        store: &Store,
        weights: &[(String, TensorId)],
    ) -> candle_core::Result<MergedAdapter> {
        let mut pairs: Vec<(usize, &Tensor, &Tensor)> = Vec::with_capacity(self.pairs.len());
        for (name, a, b) in &self.pairs {
            let index = weights
                .iter()
                .position(|(n, _)| n == name)
                .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.clone() }.bt())?;
            let info = store.info(weights[index].1).map_err(|e| super::strata_err(name, e))?;
            if !matches!(info.dtype, DType::F32 | DType::BF16) {
                candle_core::bail!(
                    "{name} is {}: adapters merge into f32 or bf16 weights (over a quantized \
                     GGUF base the adapter is applied unmerged: LoadedAdapter with \
                     OutOfCoreLlama::with_adapter, or strata generate --adapter DIR)",
                    info.dtype
                );
            }
            pairs.push((index, a, b));
        }
        let scale = self.config.scale();
        // The weights merged so far, with a copy of their bytes before in the store: put back
        // if a later write fails.
        let mut done: Vec<(usize, TensorId)> = Vec::with_capacity(pairs.len());
        let mut run = || -> candle_core::Result<()> {
            for &(index, a, b) in &pairs {
                let (name, id) = &weights[index];
                let info = store.info(*id).map_err(|e| super::strata_err(name, e))?;
                let (before, w) = match info.dtype {
                    DType::BF16 => {
                        let v = store
                            .read_vec::<half::bf16>(*id)
                            .map_err(|e| super::strata_err(name, e))?;
                        let w: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
                        (bytemuck::cast_slice::<half::bf16, u8>(&v).to_vec(), w)
                    }
                    _ => {
                        let v =
                            store.read_vec::<f32>(*id).map_err(|e| super::strata_err(name, e))?;
                        (bytemuck::cast_slice::<f32, u8>(&v).to_vec(), v)
                    }
                };
                let w = Tensor::from_vec(w, info.shape.as_slice(), &Device::Cpu)?;
                let m = merge(&w, a, b, scale)?.flatten_all()?.to_vec1::<f32>()?;
                let bytes = match info.dtype {
                    DType::BF16 => {
                        let v: Vec<half::bf16> =
                            m.iter().map(|&x| half::bf16::from_f32(x)).collect();
                        bytemuck::cast_slice::<half::bf16, u8>(&v).to_vec()
                    }
                    _ => bytemuck::cast_slice::<f32, u8>(&m).to_vec(),
                };
                let backup = store
                    .put_group(
                        &format!("{name}.before-lora-merge"),
                        crate::Group::Other,
                        info.dtype,
                        &info.shape,
                        &before,
                    )
                    .map_err(|e| super::strata_err(name, e))?;
                drop(before);
                if let Err(e) = store.write(*id, &bytes) {
                    if let Err(r) = store.remove(backup) {
                        store.shared.defer_err(r);
                    }
                    return Err(super::strata_err(name, e));
                }
                done.push((index, backup));
            }
            Ok(())
        };
        let result = run();
        let mut kept = Vec::new();
        for (index, backup) in done.iter().rev() {
            if result.is_err() {
                let (name, id) = &weights[*index];
                if store.read(*backup).and_then(|b| store.write(*id, &b)).is_err() {
                    // Its bytes before stay in the backup, which the error names.
                    kept.push(format!("{name} (its weights before in {name}.before-lora-merge)"));
                    continue;
                }
            }
            if let Err(r) = store.remove(*backup) {
                store.shared.defer_err(r);
            }
        }
        if let Err(e) = result {
            if kept.is_empty() {
                return Err(e);
            }
            candle_core::bail!(
                "{e}; and putting back the weights merged before it failed: {} still merged \
                 (load the base again)",
                kept.join(", ")
            );
        }
        Ok(MergedAdapter { config: self.config.clone(), linears: self.linears() })
    }
}

/// Merges the PEFT adapter in `dir` into the base weights that `weights` names in `store`
/// ([`LoadedAdapter::read`], then [`LoadedAdapter::merge_into`]): each adapted linear's `W`
/// becomes `W + scale · B·A`, computed in f32 and written back in `W`'s dtype (f32 or bf16),
/// as [`Trainer::save_merged`](super::Trainer::save_merged) and PEFT's `merge_and_unload`
/// compute it. Then the model computes the fine-tuned weights with no adapter code: generation
/// from a LoRA fine-tune without writing a merged copy (`strata generate --adapter DIR`). A
/// quantized or f16 weight is refused by name (apply the adapter unmerged over it:
/// [`LoadedAdapter`]).
///
/// Everything [`LoadedAdapter::read`] checks is checked before anything is written. Each
/// weight's bytes before the merge are kept in the store (group `Other`, where the store has
/// room: host memory, else its Disk tier) until every merge is written; a write that fails puts
/// back the weights merged before it, so that on an error every tensor is as it was, unless
/// putting one back fails too (the error then names the weights left merged). The store's
/// tensors change, never a file they were loaded from ([`Store::write`] writes a new copy).
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use strata::candle::{load_weights, lora::merge_adapter_into, store_for, LlamaConfig};
/// use candle_core::Device;
/// let config = LlamaConfig::from_file("SmolLM2-135M/config.json")?;
/// let store = store_for(&Device::Cpu, strata::Store::builder())?;
/// let weights = load_weights(&store, &config, "SmolLM2-135M")?;
/// let merged = merge_adapter_into(&store, &weights, "my-adapter")?;
/// println!("rank {}: {} linears merged", merged.config.rank, merged.linears.len());
/// # Ok(()) }
/// ```
pub fn merge_adapter_into(
    store: &Store,
    weights: &[(String, TensorId)],
    dir: impl AsRef<Path>,
) -> candle_core::Result<MergedAdapter> {
    LoadedAdapter::read(store, weights, dir)?.merge_into(store, weights)
}
