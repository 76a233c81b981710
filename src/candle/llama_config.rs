//! A Llama-family model's shape, read from a Hugging Face `config.json` as transformers 4 and 5
//! write it ([`LlamaConfig::from_json`]): Llama (Llama 3's rope scaling included), Mistral
//! (its sliding window) and Qwen2 (its q/k/v biases). A field that changes the computation is
//! read or refused with an error naming it, never defaulted silently.

use std::path::Path;

use candle_core::DType as CDType;
use serde_json::{Map, Value};

// Hugging Face's tensor names, which the config lists with their shapes
// ([`LlamaConfig::tensors`]); `strata::candle::llama` re-exports them.

/// The embedding table's name.
pub const EMBED: &str = "model.embed_tokens.weight";
/// The final norm's weight.
pub const NORM: &str = "model.norm.weight";
/// The output projection (absent when the embeddings are tied).
pub const LM_HEAD: &str = "lm_head.weight";
/// Each block's tensors, after its prefix `model.layers.N.`.
pub const BLOCK_TENSORS: [&str; 9] = [
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
];
/// The q/k/v projections' biases, after a block's prefix, when the config has them
/// ([`LlamaConfig::qkv_bias`], Qwen2): after [`BLOCK_TENSORS`] in a block's list.
pub const BLOCK_BIASES: [&str; 3] =
    ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"];

/// How the rotary frequencies are scaled for contexts longer than the model was trained on
/// (transformers' `rope_type`; `default` is `None` in [`LlamaConfig::rope_scaling`]).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// `linear`: every frequency divided by `factor` (positions interpolated).
    Linear {
        /// Above 0.
        factor: f64,
    },
    /// `llama3` (Llama 3.1 and later): wavelengths longer than
    /// `original_max_position_embeddings / low_freq_factor` divided by `factor`, those shorter
    /// than `original_max_position_embeddings / high_freq_factor` kept, and the ones between
    /// interpolated smoothly (transformers' `_compute_llama3_parameters`).
    Llama3 {
        /// Above 0.
        factor: f64,
        /// Above 0.
        low_freq_factor: f64,
        /// Above `low_freq_factor`.
        high_freq_factor: f64,
        /// The context the model was first trained for.
        original_max_position_embeddings: usize,
    },
}

/// A Llama model's shape, read from a Hugging Face `config.json` ([`LlamaConfig::from_json`]).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the MLP.
    pub intermediate_size: usize,
    /// Decoder blocks.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key and value heads (grouped-query attention when fewer than the query heads).
    pub num_key_value_heads: usize,
    /// Width of a head (`hidden_size / num_attention_heads` unless the config says otherwise).
    pub head_dim: usize,
    /// Tokens.
    pub vocab_size: usize,
    /// RMSNorm's epsilon (finite, above 0).
    pub rms_norm_eps: f64,
    /// RoPE's base (finite, above 0).
    pub rope_theta: f64,
    /// RoPE's frequency scaling (`None`: transformers' `default`).
    pub rope_scaling: Option<RopeScaling>,
    /// Longest sequence the model is made for.
    pub max_position_embeddings: usize,
    /// The output projection is the embedding table (no `lm_head.weight`).
    pub tie_word_embeddings: bool,
    /// The query, key and value projections have biases (Qwen2):
    /// `model.layers.N.self_attn.{q,k,v}_proj.bias`.
    pub qkv_bias: bool,
    /// Mistral's sliding window: each query attends to at most this many positions, itself
    /// included (`None`: every earlier position).
    pub sliding_window: Option<usize>,
    /// The dtype the checkpoint's weights are stored in (`torch_dtype`, or transformers 5's
    /// `dtype`), when the config says: a hint for the compute dtype, which the weights are
    /// converted to in any case.
    pub dtype: Option<CDType>,
}

pub(super) fn bad_config(why: String) -> candle_core::Error {
    candle_core::Error::Msg(format!("Llama config: {why}")).bt()
}

/// The keys a rope dictionary may hold (transformers' names for the supported types).
const ROPE_KEYS: [&str; 7] = [
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
];

/// The config's JSON, with typed getters whose errors name the field.
struct Fields<'a>(&'a Map<String, Value>, &'a str);

impl Fields<'_> {
    fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|x| !x.is_null())
    }

    fn name(&self, k: &str) -> String {
        if self.1.is_empty() {
            k.to_string()
        } else {
            format!("{}.{k}", self.1)
        }
    }

    fn count(&self, k: &str) -> candle_core::Result<Option<usize>> {
        match self.get(k) {
            None => Ok(None),
            Some(x) => x
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| bad_config(format!("{} is {x}, not a count", self.name(k)))),
        }
    }

    /// A count that must be there and above 0.
    fn size(&self, k: &str) -> candle_core::Result<usize> {
        self.count(k)?
            .filter(|&n| n > 0)
            .ok_or_else(|| bad_config(format!("{} is missing or 0", self.name(k))))
    }

    fn float(&self, k: &str) -> candle_core::Result<Option<f64>> {
        match self.get(k) {
            None => Ok(None),
            Some(x) => x
                .as_f64()
                .map(Some)
                .ok_or_else(|| bad_config(format!("{} is {x}, not a number", self.name(k)))),
        }
    }

    /// A number that must be finite and above 0 (`default` when absent).
    fn positive(&self, k: &str, default: Option<f64>) -> candle_core::Result<f64> {
        match self.float(k)?.or(default) {
            Some(x) if x.is_finite() && x > 0.0 => Ok(x),
            Some(x) => Err(bad_config(format!("{} is {x}: finite and above 0", self.name(k)))),
            None => Err(bad_config(format!("{} is missing", self.name(k)))),
        }
    }

    fn flag(&self, k: &str) -> candle_core::Result<Option<bool>> {
        match self.get(k) {
            None => Ok(None),
            Some(x) => x
                .as_bool()
                .map(Some)
                .ok_or_else(|| bad_config(format!("{} is {x}, not true or false", self.name(k)))),
        }
    }

    fn text(&self, k: &str) -> candle_core::Result<Option<&str>> {
        match self.get(k) {
            None => Ok(None),
            Some(x) => x
                .as_str()
                .map(Some)
                .ok_or_else(|| bad_config(format!("{} is {x}, not a string", self.name(k)))),
        }
    }
}

/// The theta and the scaling of one rope dictionary (`rope_parameters` or `rope_scaling`).
fn rope_dict(
    value: &Value,
    field: &str,
) -> candle_core::Result<(Option<f64>, Option<RopeScaling>)> {
    let Some(map) = value.as_object() else {
        return Err(bad_config(format!("{field} is {value}, not an object")));
    };
    if let Some((k, _)) = map.iter().find(|(_, v)| v.is_object()) {
        return Err(bad_config(format!(
            "{field}.{k}: rope parameters per layer type are not supported (one RoPE for every \
             layer)"
        )));
    }
    if let Some(k) = map.keys().find(|k| !ROPE_KEYS.contains(&k.as_str())) {
        return Err(bad_config(format!(
            "{field}.{k} is not supported (known: {})",
            ROPE_KEYS.join(", ")
        )));
    }
    let f = Fields(map, field);
    let theta = match f.float("rope_theta")? {
        Some(t) if !(t.is_finite() && t > 0.0) => {
            return Err(bad_config(format!("{field}.rope_theta is {t}: finite and above 0")))
        }
        t => t,
    };
    let kind = match (f.text("rope_type")?, f.text("type")?) {
        (Some(a), Some(b)) if a != b => {
            return Err(bad_config(format!("{field}: rope_type {a:?} and type {b:?} differ")))
        }
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => return Err(bad_config(format!("{field}.rope_type is missing"))),
    };
    let scaling = match kind {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor: f.positive("factor", None)? }),
        "llama3" => {
            let (low, high) =
                (f.positive("low_freq_factor", None)?, f.positive("high_freq_factor", None)?);
            if high <= low {
                return Err(bad_config(format!(
                    "{field}: high_freq_factor {high} is not above low_freq_factor {low}"
                )));
            }
            Some(RopeScaling::Llama3 {
                factor: f.positive("factor", None)?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: f.size("original_max_position_embeddings")?,
            })
        }
        other => {
            return Err(bad_config(format!(
                "{field}.rope_type {other:?} is not supported (default, linear and llama3 are)"
            )))
        }
    };
    Ok((theta, scaling))
}

/// RoPE's theta and scaling from the top-level `rope_theta`, transformers 4's `rope_scaling`
/// and transformers 5's `rope_parameters`; where two say something, they must agree.
fn rope(f: &Fields) -> candle_core::Result<(f64, Option<RopeScaling>)> {
    let top = match f.float("rope_theta")? {
        Some(t) if !(t.is_finite() && t > 0.0) => {
            return Err(bad_config(format!("rope_theta is {t}: finite and above 0")))
        }
        t => t,
    };
    let (p_theta, p_scaling) = match f.get("rope_parameters") {
        Some(v) => {
            let (t, s) = rope_dict(v, "rope_parameters")?;
            (t, Some(s))
        }
        None => (None, None),
    };
    let legacy = match f.get("rope_scaling") {
        Some(v) => {
            let (t, s) = rope_dict(v, "rope_scaling")?;
            Some((t, s))
        }
        None => None,
    };
    let mut theta = None;
    for (t, from) in [
        (top, "rope_theta"),
        (p_theta, "rope_parameters.rope_theta"),
        (legacy.as_ref().and_then(|l| l.0), "rope_scaling.rope_theta"),
    ] {
        match (theta, t) {
            (Some((a, was)), Some(b)) if a != b => {
                return Err(bad_config(format!("{was} {a} and {from} {b} differ")))
            }
            (None, Some(b)) => theta = Some((b, from)),
            _ => {}
        }
    }
    let scaling = match (p_scaling, legacy.map(|l| l.1)) {
        (Some(a), Some(b)) if a != b => {
            return Err(bad_config(format!(
                "rope_parameters ({a:?}) and rope_scaling ({b:?}) differ"
            )))
        }
        (Some(s), _) | (None, Some(s)) => s,
        (None, None) => None,
    };
    Ok((theta.map_or(10000.0, |t| t.0), scaling))
}

/// The sliding window, from `layer_types` where the config has it, else from the model type's
/// own fields; a window on some layers and not others is refused.
fn window(f: &Fields, model_type: &str, layers: usize) -> candle_core::Result<Option<usize>> {
    let declared = match model_type {
        "mistral" => match f.0.get("sliding_window") {
            None => {
                return Err(bad_config(
                    "sliding_window is missing (transformers' default for mistral is 4096): \
                     write it, or null for none"
                        .into(),
                ))
            }
            Some(_) => f.count("sliding_window")?,
        },
        "qwen2" => match f.flag("use_sliding_window")? {
            Some(true) => {
                let w = f.size("sliding_window")?;
                // Qwen2 slides on the layers from max_window_layers on.
                match f.count("max_window_layers")? {
                    Some(m) if m >= layers => None,
                    Some(0) => Some(w),
                    m => {
                        return Err(bad_config(format!(
                            "use_sliding_window with max_window_layers {}: a window on some \
                             layers and not others is not supported",
                            m.map_or("missing".into(), |m| m.to_string())
                        )))
                    }
                }
            }
            _ => None,
        },
        _ => match f.count("sliding_window")? {
            Some(w) => {
                return Err(bad_config(format!(
                    "sliding_window {w} in a llama config (transformers' Llama attends to every \
                     position): set model_type mistral for a windowed model, or remove it"
                )))
            }
            None => None,
        },
    };
    if declared == Some(0) {
        return Err(bad_config("sliding_window is 0".into()));
    }
    let Some(types) = f.get("layer_types") else { return Ok(declared) };
    let types = types
        .as_array()
        .ok_or_else(|| bad_config(format!("layer_types is {types}, not a list")))?;
    let sliding = types.iter().filter(|t| t.as_str() == Some("sliding_attention")).count();
    if let Some(t) =
        types.iter().find(|t| !matches!(t.as_str(), Some("full_attention" | "sliding_attention")))
    {
        return Err(bad_config(format!(
            "layer_types holds {t}: full_attention or sliding_attention"
        )));
    }
    if types.len() != layers {
        return Err(bad_config(format!("layer_types lists {} layers of {layers}", types.len())));
    }
    match (sliding, declared) {
        (0, _) => Ok(None),
        (n, Some(w)) if n == layers => Ok(Some(w)),
        (n, None) if n == layers => {
            Err(bad_config("layer_types slides, with no sliding_window".into()))
        }
        (n, _) => Err(bad_config(format!(
            "layer_types: {n} of {layers} layers slide; a window on some layers and not others \
             is not supported"
        ))),
    }
}

impl LlamaConfig {
    /// Reads a Hugging Face `config.json` of the Llama family, as transformers 4 or 5 writes it:
    /// `model_type` `llama` (or none), `mistral` or `qwen2`.
    ///
    /// - RoPE: `rope_theta` (top level, or in transformers 5's `rope_parameters`), and its
    ///   scaling from `rope_parameters` or transformers 4's `rope_scaling`: `default`, `linear`
    ///   and `llama3` ([`RopeScaling`]); other types are refused. Where two fields give a value
    ///   they must agree.
    /// - Defaults, as transformers' `LlamaConfig` has them: `num_key_value_heads` the query
    ///   heads (for llama only: mistral and qwen2 must say), `head_dim`
    ///   `hidden_size / num_attention_heads`, `rope_theta` 10000, `rms_norm_eps` 1e-6,
    ///   `max_position_embeddings` 2048, `tie_word_embeddings` false.
    /// - Qwen2's q/k/v biases ([`LlamaConfig::qkv_bias`]); its sliding window when
    ///   `use_sliding_window` is on for every layer; Mistral's `sliding_window` (a number or
    ///   null; missing is refused, as transformers would take 4096); `layer_types`.
    /// - Refused, naming the field: another `model_type`; `hidden_act` other than `silu`;
    ///   `attention_bias` or `mlp_bias` true (o_proj and MLP biases); `attention_dropout` above
    ///   0; `partial_rotary_factor` other than 1; a `quantization_config`; a window on some
    ///   layers only; a `torch_dtype`/`dtype` other than float32, bfloat16, float16.
    /// - Validated: sizes above 0, the heads a multiple of the key/value heads, `head_dim`
    ///   even, `rope_theta` and `rms_norm_eps` finite and above 0.
    ///
    /// ```
    /// let c = strata::candle::LlamaConfig::from_json(r#"{"hidden_size": 64,
    ///     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    ///     "num_key_value_heads": 2, "vocab_size": 100,
    ///     "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}"#).unwrap();
    /// assert_eq!((c.head_dim, c.rope_theta, c.tensors().len()), (16, 100000.0, 2 * 9 + 3));
    /// ```
    pub fn from_json(text: &str) -> candle_core::Result<LlamaConfig> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| bad_config(format!("not JSON ({e})")))?;
        let map = v.as_object().ok_or_else(|| bad_config("not a JSON object".to_string()))?.clone();
        let f = Fields(&map, "");
        let model_type = f.text("model_type")?.unwrap_or("llama");
        if !matches!(model_type, "llama" | "mistral" | "qwen2") {
            return Err(bad_config(format!(
                "model_type {model_type:?} is not of the Llama family (llama, mistral and qwen2 \
                 are supported)"
            )));
        }
        if let Some(act) = f.text("hidden_act")? {
            if !matches!(act, "silu" | "swish") {
                return Err(bad_config(format!(
                    "hidden_act {act:?}: only silu (SwiGLU) is supported"
                )));
            }
        }
        for (k, what) in [("attention_bias", "o_proj's bias"), ("mlp_bias", "the MLP's biases")] {
            if f.flag(k)? == Some(true) {
                return Err(bad_config(format!(
                    "{k} true: {what} are not supported (q/k/v biases are, as Qwen2 has them)"
                )));
            }
        }
        if let Some(p) = f.float("attention_dropout")?.filter(|&p| p != 0.0) {
            return Err(bad_config(format!(
                "attention_dropout {p}: dropout is not supported (0 or absent)"
            )));
        }
        if let Some(p) = f.float("partial_rotary_factor")?.filter(|&p| p != 1.0) {
            return Err(bad_config(format!(
                "partial_rotary_factor {p}: RoPE over part of a head is not supported"
            )));
        }
        if f.get("quantization_config").is_some() {
            return Err(bad_config(
                "quantization_config: quantized checkpoints are not supported (dequantize to \
                 float32, bfloat16 or float16 first)"
                    .into(),
            ));
        }
        let dtype = match (f.text("dtype")?, f.text("torch_dtype")?) {
            (Some(a), Some(b)) if a != b => {
                return Err(bad_config(format!("dtype {a:?} and torch_dtype {b:?} differ")))
            }
            (Some(d), _) | (None, Some(d)) => Some(match d {
                "float32" => CDType::F32,
                "bfloat16" => CDType::BF16,
                "float16" => CDType::F16,
                other => {
                    return Err(bad_config(format!(
                        "dtype {other:?}: float32, bfloat16 or float16"
                    )))
                }
            }),
            (None, None) => None,
        };
        let hidden_size = f.size("hidden_size")?;
        let num_attention_heads = f.size("num_attention_heads")?;
        let num_hidden_layers = f.size("num_hidden_layers")?;
        let num_key_value_heads = match (f.count("num_key_value_heads")?, model_type) {
            (Some(n), _) => n,
            (None, "llama") => num_attention_heads,
            (None, t) => {
                return Err(bad_config(format!(
                    "num_key_value_heads is missing (transformers' {t} default differs from \
                     llama's): write it"
                )))
            }
        };
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(bad_config(format!(
                "{num_attention_heads} query heads are not a multiple of {num_key_value_heads} \
                 key/value heads"
            )));
        }
        let head_dim = match f.count("head_dim")? {
            Some(d) => d,
            None if hidden_size % num_attention_heads == 0 => hidden_size / num_attention_heads,
            None => {
                return Err(bad_config(format!(
                    "hidden_size {hidden_size} is not a multiple of {num_attention_heads} heads"
                )))
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(bad_config(format!("head_dim {head_dim}: RoPE needs an even width")));
        }
        let (rope_theta, rope_scaling) = rope(&f)?;
        let max_position_embeddings = match f.count("max_position_embeddings")? {
            Some(0) => return Err(bad_config("max_position_embeddings is 0".into())),
            n => n.unwrap_or(2048),
        };
        Ok(LlamaConfig {
            hidden_size,
            intermediate_size: f.size("intermediate_size")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size: f.size("vocab_size")?,
            rms_norm_eps: f.positive("rms_norm_eps", Some(1e-6))?,
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings: f.flag("tie_word_embeddings")? == Some(true),
            qkv_bias: model_type == "qwen2",
            sliding_window: window(&f, model_type, num_hidden_layers)?,
            dtype,
        })
    }

    /// [`LlamaConfig::from_json`] of a file.
    pub fn from_file(path: impl AsRef<Path>) -> candle_core::Result<LlamaConfig> {
        let path = path.as_ref();
        let text =
            super::read_text_file_needed(path).map_err(|e| bad_config(format!("reading {e}")))?;
        Self::from_json(&text).map_err(|e| e.context(format!("in {}", path.display())))
    }

    /// The config as Hugging Face writes it, readable by transformers 4 and 5 and by
    /// [`LlamaConfig::from_json`]: `model_type` `qwen2` with q/k/v biases, else `mistral` with a
    /// sliding window, else `llama`; RoPE as a top-level `rope_theta` and transformers 4's
    /// `rope_scaling`.
    ///
    /// ```
    /// use strata::candle::LlamaConfig;
    /// let c = LlamaConfig::from_json(r#"{"model_type": "qwen2", "hidden_size": 64,
    ///     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    ///     "num_key_value_heads": 2, "vocab_size": 100}"#).unwrap();
    /// assert!(c.qkv_bias && c.to_json().contains("Qwen2ForCausalLM"));
    /// assert_eq!(LlamaConfig::from_json(&c.to_json()).unwrap(), c);
    /// ```
    pub fn to_json(&self) -> String {
        let (model_type, arch) = if self.qkv_bias {
            ("qwen2", "Qwen2ForCausalLM")
        } else if self.sliding_window.is_some() {
            ("mistral", "MistralForCausalLM")
        } else {
            ("llama", "LlamaForCausalLM")
        };
        let mut j = serde_json::json!({
            "architectures": [arch],
            "model_type": model_type,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
        });
        let o = j.as_object_mut().expect("an object");
        if !self.qkv_bias {
            o.insert("attention_bias".into(), false.into());
            o.insert("mlp_bias".into(), false.into());
        }
        match (model_type, self.sliding_window) {
            ("qwen2", w) => {
                o.insert("use_sliding_window".into(), w.is_some().into());
                o.insert("sliding_window".into(), w.into());
                o.insert("max_window_layers".into(), 0.into());
            }
            ("mistral", w) => {
                o.insert("sliding_window".into(), w.into());
            }
            _ => {}
        }
        o.insert(
            "rope_scaling".into(),
            match &self.rope_scaling {
                None => Value::Null,
                Some(RopeScaling::Linear { factor }) => {
                    serde_json::json!({"rope_type": "linear", "factor": factor})
                }
                Some(RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                }) => serde_json::json!({
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low_freq_factor,
                    "high_freq_factor": high_freq_factor,
                    "original_max_position_embeddings": original_max_position_embeddings,
                }),
            },
        );
        if let Some(d) = self.dtype {
            let name = match d {
                CDType::BF16 => "bfloat16",
                CDType::F16 => "float16",
                _ => "float32",
            };
            o.insert("torch_dtype".into(), name.into());
        }
        j.to_string()
    }

    /// RoPE's inverse frequencies, `head_dim / 2` of them, in f32 as transformers computes them
    /// (`1 / theta^(2i / head_dim)`, then [`LlamaConfig::rope_scaling`]'s rule).
    ///
    /// ```
    /// let c = strata::candle::LlamaConfig::from_json(r#"{"hidden_size": 16,
    ///     "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
    ///     "vocab_size": 10, "rope_theta": 10000.0,
    ///     "rope_scaling": {"rope_type": "linear", "factor": 4.0}}"#).unwrap();
    /// assert_eq!(c.rope_inverse_frequencies(), vec![0.25, 0.025, 0.0025, 0.00025]);
    /// ```
    pub fn rope_inverse_frequencies(&self) -> Vec<f32> {
        let d = self.head_dim;
        let base = self.rope_theta as f32;
        let inv = (0..d / 2).map(|i| 1.0 / base.powf((2 * i) as f32 / d as f32));
        match self.rope_scaling {
            None => inv.collect(),
            Some(RopeScaling::Linear { factor }) => inv.map(|f| f / factor as f32).collect(),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                // transformers' _compute_llama3_parameters, op for op in f32.
                let (factor, low, high) =
                    (factor as f32, low_freq_factor as f32, high_freq_factor as f32);
                let old = original_max_position_embeddings as f32;
                let (low_wavelen, high_wavelen) = (old / low, old / high);
                inv.map(|f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    let scaled = if wavelen > low_wavelen { f / factor } else { f };
                    if wavelen < high_wavelen || wavelen > low_wavelen {
                        return scaled;
                    }
                    let smooth = (old / wavelen - low) / (high - low);
                    (1.0 - smooth) * scaled / factor + smooth * scaled
                })
                .collect()
            }
        }
    }

    /// Block `l`'s name prefix, `model.layers.{l}.`.
    pub fn block_prefix(l: usize) -> String {
        format!("model.layers.{l}.")
    }

    /// The suffixes of a block's tensors: [`BLOCK_TENSORS`], then [`BLOCK_BIASES`] when the
    /// config has q/k/v biases.
    pub fn block_suffixes(&self) -> Vec<&'static str> {
        let biases: &[&str] = if self.qkv_bias { &BLOCK_BIASES } else { &[] };
        BLOCK_TENSORS.iter().chain(biases).copied().collect()
    }

    /// Block `l`'s tensors' names, in [`LlamaConfig::block_suffixes`]' order.
    pub fn block_names(&self, l: usize) -> Vec<String> {
        let p = Self::block_prefix(l);
        self.block_suffixes().iter().map(|n| format!("{p}{n}")).collect()
    }

    /// The head's tensors: the final norm, and the output projection (the embedding table when
    /// tied).
    pub fn head_names(&self) -> [&'static str; 2] {
        [NORM, if self.tie_word_embeddings { EMBED } else { LM_HEAD }]
    }

    /// The shapes of a block's tensors, in [`LlamaConfig::block_suffixes`]' order.
    fn block_shapes(&self) -> Vec<Vec<usize>> {
        let (h, i) = (self.hidden_size, self.intermediate_size);
        let (q, kv) =
            (self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim);
        let mut v = vec![
            vec![h],
            vec![q, h],
            vec![kv, h],
            vec![kv, h],
            vec![h, q],
            vec![h],
            vec![i, h],
            vec![i, h],
            vec![h, i],
        ];
        if self.qkv_bias {
            v.extend([vec![q], vec![kv], vec![kv]]);
        }
        v
    }

    /// Every tensor of the model, Hugging Face's names and shapes, in stage order: the
    /// embedding table, the blocks, the final norm, `lm_head.weight` (untied only).
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let mut v = vec![(EMBED.to_string(), vec![self.vocab_size, self.hidden_size])];
        for l in 0..self.num_hidden_layers {
            v.extend(self.block_names(l).into_iter().zip(self.block_shapes()));
        }
        v.push((NORM.to_string(), vec![self.hidden_size]));
        if !self.tie_word_embeddings {
            v.push((LM_HEAD.to_string(), vec![self.vocab_size, self.hidden_size]));
        }
        v
    }

    /// Parameters in all.
    pub fn parameters(&self) -> u64 {
        let embed = (self.vocab_size * self.hidden_size) as u64;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        embed
            + self.block_parameters() * self.num_hidden_layers as u64
            + self.hidden_size as u64
            + head
    }

    /// Parameters one block holds.
    pub fn block_parameters(&self) -> u64 {
        self.block_shapes().iter().map(|s| s.iter().product::<usize>() as u64).sum()
    }

    /// A training step's FLOPs over `tokens` tokens in sequences of `seq`, counted the three
    /// ways a figure is quoted ([`StepFlops`]); `frozen_base` for a run whose base weights get
    /// no gradient (LoRA: their weight gradients, 2 of the 6 FLOPs a parameter and token, are
    /// not computed).
    ///
    /// ```
    /// use strata::candle::LlamaConfig;
    /// let c = LlamaConfig::from_file("examples/configs/llama2-7b.json").unwrap();
    /// let f = c.step_flops(32 * 2048, 2048, false);
    /// // MegaTrain's count: 6 × 6.74 B parameters × 65,536 tokens.
    /// assert!((f.parameter_count / 2.65e15 - 1.0).abs() < 0.01);
    /// // Attention's products add more at seq 2048 than the embedding lookup's 6 FLOPs a
    /// // parameter count (6 % in all); the recomputed forward adds a third.
    /// assert!(f.with_attention > 1.05 * f.parameter_count);
    /// assert!(f.executed > 1.3 * f.with_attention);
    /// ```
    pub fn step_flops(&self, tokens: u64, seq: usize, frozen_base: bool) -> StepFlops {
        let t = tokens as f64;
        let blocks = (self.block_parameters() * self.num_hidden_layers as u64) as f64;
        let head = (self.vocab_size * self.hidden_size) as f64;
        // Per token and matrix parameter: the forward 2, the backward 4 (dX and dW), 2 with a
        // frozen base (dX only).
        let per_param = if frozen_base { 4.0 } else { 6.0 };
        // Attention's two products: 4 · hidden · seq a layer and token forward, 8 backward.
        let attention_forward = 4.0
            * self.num_hidden_layers as f64
            * (self.num_attention_heads * self.head_dim) as f64
            * seq as f64;
        let with_attention = t * (per_param * (blocks + head) + 3.0 * attention_forward);
        StepFlops {
            parameter_count: t * per_param * self.parameters() as f64,
            with_attention,
            executed: with_attention + t * (2.0 * blocks + attention_forward),
        }
    }
}

/// A training step's FLOPs, counted the ways figures are quoted
/// ([`LlamaConfig::step_flops`]): a TFLOPS figure is only comparable with one of the same count.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepFlops {
    /// 6 × parameters × tokens (4 × with a frozen base): every parameter, the embedding
    /// table's included, and no attention — MegaTrain's count (its 272 TFLOPS on one H100).
    pub parameter_count: f64,
    /// The matrix products' 6 per parameter and token (the blocks and the output projection;
    /// the embedding lookup is not a product) plus attention's `12 · layers · hidden · seq` per
    /// token (PaLM's count, the causal mask not halving it): model FLOPs as model-FLOPs
    /// utilisation counts them, the recomputed forward not counted.
    pub with_attention: f64,
    /// What the out-of-core trainer (and the twin that recomputes) executes: `with_attention`
    /// plus the blocks' forward again (each block recomputed from its input in the backward).
    pub executed: f64,
}
