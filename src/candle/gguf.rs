//! Llama-family models from GGUF files (llama.cpp's format): the config from the file's
//! metadata ([`LlamaConfig::from_gguf`]), the tensors under Hugging Face's names
//! ([`hf_name`]), and the weights loaded into a store in place, kept quantized
//! ([`load_gguf_weights`]), with llama.cpp's permutation of the query and key rows undone.
//!
//! llama.cpp's converter (`convert_hf_to_gguf.py`, `LlamaModel.permute`) reorders the rows of
//! each head of `q_proj` and `k_proj` for `llama`-architecture files, from Hugging Face's
//! rotary layout (first half of a head's dimensions, then the second) to GGML's (pairs
//! interleaved). Rows are whole blocks of a quantized tensor, so the loader puts them back in
//! order as bytes, before anything is dequantized: the Hugging Face-layout Llama of
//! [`llama`](super::llama) then computes what the original model computes. `qwen2` files are
//! not permuted.

use std::path::Path;

use super::llama_config::bad_config;
use super::strata_err;
use super::LlamaConfig;
use crate::base::types::{DType, Group, TensorId};
use crate::{Gguf, GgufValue, LoadOptions, Store};

/// The architectures read (`general.architecture`).
const ARCHITECTURES: [&str; 2] = ["llama", "qwen2"];

/// A typed view of a GGUF file's metadata whose errors name the key.
struct Meta<'a> {
    file: &'a Gguf,
    arch: &'a str,
}

impl Meta<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    fn get(&self, k: &str) -> Option<(String, &GgufValue)> {
        let key = self.key(k);
        let v = self.file.get(&key)?;
        Some((key, v))
    }

    fn count(&self, k: &str) -> candle_core::Result<Option<usize>> {
        let Some((key, v)) = self.get(k) else { return Ok(None) };
        let n = v.as_u64().and_then(|n| usize::try_from(n).ok());
        n.map(Some).ok_or_else(|| wrong_kind(&key, v, "an unsigned integer"))
    }

    fn size(&self, k: &str) -> candle_core::Result<usize> {
        self.count(k)?
            .filter(|&n| n > 0)
            .ok_or_else(|| bad_config(format!("{} is missing or 0 in the GGUF file", self.key(k))))
    }

    fn float(&self, k: &str) -> candle_core::Result<Option<f64>> {
        let Some((key, v)) = self.get(k) else { return Ok(None) };
        let x = v.as_f64().ok_or_else(|| wrong_kind(&key, v, "a float"))?;
        if !(x.is_finite() && x > 0.0) {
            return Err(bad_config(format!("{key} is {x}: finite and above 0")));
        }
        Ok(Some(x))
    }

    fn text(&self, k: &str) -> candle_core::Result<Option<&str>> {
        let Some((key, v)) = self.get(k) else { return Ok(None) };
        v.as_str().map(Some).ok_or_else(|| wrong_kind(&key, v, "a string"))
    }
}

fn wrong_kind(key: &str, v: &GgufValue, want: &str) -> candle_core::Error {
    bad_config(format!("{key} is a GGUF {}, not {want}", v.kind()))
}

impl LlamaConfig {
    /// The config of a `llama` or `qwen2` GGUF file, from its metadata (`{arch}.*` keys):
    /// `embedding_length`, `feed_forward_length`, `block_count`, `attention.head_count`,
    /// `attention.head_count_kv`, `attention.key_length` / `value_length`,
    /// `rope.dimension_count`, `rope.freq_base`, `rope.scaling.*`,
    /// `attention.layer_norm_rms_epsilon`, `context_length`, `vocab_size` (else the length of
    /// `tokenizer.ggml.tokens`, else the embedding table's rows); tied embeddings when there is
    /// no `output.weight`, q/k/v biases for `qwen2`. What changes the computation and is not
    /// supported is refused by name: another architecture, experts, RoPE over part of a head,
    /// `yarn` or other scaling, a `rope_freqs.weight` tensor (Llama 3.1's scaling as factors),
    /// keys and values of different widths, and a value of the wrong kind.
    ///
    /// ```
    /// # fn main() -> candle_core::Result<()> {
    /// // A GGUF the `gguf` Python package wrote (tests/fixtures/llama.gguf, by gen_llama.py).
    /// let f = strata::Gguf::open("tests/fixtures/llama.gguf")?;
    /// let c = strata::candle::LlamaConfig::from_gguf(&f)?;
    /// assert_eq!((c.hidden_size, c.num_attention_heads, c.num_key_value_heads), (256, 4, 2));
    /// # Ok(()) }
    /// ```
    pub fn from_gguf(file: &Gguf) -> candle_core::Result<LlamaConfig> {
        let arch = match file.get("general.architecture") {
            Some(GgufValue::String(a)) => a.as_str(),
            Some(v) => return Err(wrong_kind("general.architecture", v, "a string")),
            None => return Err(bad_config("general.architecture is missing".into())),
        };
        if !ARCHITECTURES.contains(&arch) {
            return Err(bad_config(format!(
                "general.architecture {arch:?}: llama (Llama, Mistral) and qwen2 GGUF files are \
                 supported"
            )));
        }
        let m = Meta { file, arch };
        if let Some(n) = m.count("expert_count")?.filter(|&n| n > 0) {
            return Err(bad_config(format!(
                "{} is {n}: mixtures of experts are not supported",
                m.key("expert_count")
            )));
        }
        if file.tensor("rope_freqs.weight").is_some() {
            return Err(bad_config(
                "the file has rope_freqs.weight (RoPE frequency factors, as Llama 3.1's \
                 conversion writes them): not supported"
                    .into(),
            ));
        }
        let hidden_size = m.size("embedding_length")?;
        let num_attention_heads = m.size("attention.head_count")?;
        let num_key_value_heads =
            m.count("attention.head_count_kv")?.unwrap_or(num_attention_heads);
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(bad_config(format!(
                "{num_attention_heads} query heads are not a multiple of {num_key_value_heads} \
                 key/value heads"
            )));
        }
        let head_dim = match (m.count("attention.key_length")?, m.count("attention.value_length")?)
        {
            (Some(k), Some(v)) if k != v => {
                return Err(bad_config(format!(
                    "{} {k} and {} {v} differ: keys and values of one width are supported",
                    m.key("attention.key_length"),
                    m.key("attention.value_length")
                )))
            }
            (Some(d), _) | (None, Some(d)) => d,
            (None, None) if hidden_size % num_attention_heads == 0 => {
                hidden_size / num_attention_heads
            }
            (None, None) => {
                return Err(bad_config(format!(
                    "embedding_length {hidden_size} is not a multiple of {num_attention_heads} \
                     heads"
                )))
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(bad_config(format!("head width {head_dim}: RoPE needs an even width")));
        }
        if let Some(r) = m.count("rope.dimension_count")?.filter(|&r| r != head_dim) {
            return Err(bad_config(format!(
                "{} is {r}, not the head width {head_dim}: RoPE over part of a head is not \
                 supported",
                m.key("rope.dimension_count")
            )));
        }
        let rope_scaling = match m.text("rope.scaling.type")? {
            None | Some("none") => None,
            Some("linear") => {
                let factor = m.float("rope.scaling.factor")?.ok_or_else(|| {
                    bad_config(format!("{} is missing", m.key("rope.scaling.factor")))
                })?;
                (factor != 1.0).then_some(super::RopeScaling::Linear { factor })
            }
            Some(other) => {
                return Err(bad_config(format!(
                    "{} {other:?}: linear or none is supported",
                    m.key("rope.scaling.type")
                )))
            }
        };
        let embed = file.tensor("token_embd.weight");
        let vocab_size = match m.count("vocab_size")? {
            Some(n) => n,
            None => match file.get("tokenizer.ggml.tokens").and_then(GgufValue::as_array) {
                Some(t) => t.len(),
                None => embed.map(|t| t.shape[0]).ok_or_else(|| {
                    bad_config("no vocab_size, tokenizer.ggml.tokens or token_embd.weight".into())
                })?,
            },
        };
        let max_position_embeddings = match m.count("context_length")? {
            Some(0) => return Err(bad_config(format!("{} is 0", m.key("context_length")))),
            n => n.unwrap_or(2048),
        };
        let sliding_window = match m.count("attention.sliding_window")? {
            Some(0) | None => None,
            Some(w) => Some(w),
        };
        Ok(LlamaConfig {
            hidden_size,
            intermediate_size: m.size("feed_forward_length")?,
            num_hidden_layers: m.size("block_count")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size,
            rms_norm_eps: m.float("attention.layer_norm_rms_epsilon")?.ok_or_else(|| {
                bad_config(format!("{} is missing", m.key("attention.layer_norm_rms_epsilon")))
            })?,
            rope_theta: m.float("rope.freq_base")?.unwrap_or(10_000.0),
            rope_scaling,
            max_position_embeddings,
            tie_word_embeddings: file.tensor("output.weight").is_none(),
            qkv_bias: arch == "qwen2",
            sliding_window,
            dtype: None,
        })
    }
}

/// The Hugging Face name of a llama.cpp tensor name: `token_embd.weight` →
/// `model.embed_tokens.weight`, `blk.N.attn_q.weight` → `model.layers.N.self_attn.q_proj.weight`,
/// `output.weight` → `lm_head.weight`, and so on for the Llama family's tensors; `None` for a
/// name outside it.
///
/// ```
/// use strata::candle::hf_name;
/// let down = hf_name("blk.3.ffn_down.weight");
/// assert_eq!(down.as_deref(), Some("model.layers.3.mlp.down_proj.weight"));
/// let bias = hf_name("blk.0.attn_k.bias");
/// assert_eq!(bias.as_deref(), Some("model.layers.0.self_attn.k_proj.bias"));
/// assert_eq!(hf_name("rope_freqs.weight"), None);
/// ```
pub fn hf_name(gguf: &str) -> Option<String> {
    let top = match gguf {
        "token_embd.weight" => Some(super::llama::EMBED),
        "output_norm.weight" => Some(super::llama::NORM),
        "output.weight" => Some(super::llama::LM_HEAD),
        _ => None,
    };
    if let Some(t) = top {
        return Some(t.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (what, kind) = rest.rsplit_once('.')?;
    if !matches!(kind, "weight" | "bias") {
        return None;
    }
    let hf = match what {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{kind}"))
}

/// Rows of `bytes` (`rows` rows, each `row_bytes`) reordered from llama.cpp's rotary layout
/// back to Hugging Face's, `heads` heads of `rows / heads` rows each: the inverse of
/// `convert_hf_to_gguf.py`'s `permute`, which sends row `i * d/2 + j` of a head (half `i`,
/// position `j`) to row `2j + i`.
fn unpermute_rows(bytes: &[u8], rows: usize, row_bytes: usize, heads: usize) -> Vec<u8> {
    let d = rows / heads;
    let mut out = vec![0u8; bytes.len()];
    for h in 0..heads {
        for i in 0..2 {
            for j in 0..d / 2 {
                let to = h * d + i * (d / 2) + j;
                let from = h * d + 2 * j + i;
                out[to * row_bytes..(to + 1) * row_bytes]
                    .copy_from_slice(&bytes[from * row_bytes..(from + 1) * row_bytes]);
            }
        }
    }
    out
}

/// Loads the weights of a `llama` or `qwen2` GGUF file of `config` ([`LlamaConfig::from_gguf`])
/// into `store`, group `Param`, under Hugging Face's names: `(name, id)` for every tensor
/// `config` names, in [`LlamaConfig::tensors`]' order, to hand to
/// [`Layers::new`](super::Layers::new). Each tensor keeps the file's dtype, block-quantized ones
/// included (candle is handed them dequantized to f32, exactly, when a layer is fetched): in
/// place in the mapped file, except a `llama` file's `attn_q` and `attn_k`, whose rows are put
/// back in Hugging Face's order (module docs) in a copy the store holds. Tensors the model does
/// not use are left out. A tensor missing, of another shape, or not of the Llama family's names
/// is an error naming it; on any error nothing of the file is left in the store.
pub fn load_gguf_weights(
    store: &Store,
    config: &LlamaConfig,
    path: impl AsRef<Path>,
) -> candle_core::Result<Vec<(String, TensorId)>> {
    let path = path.as_ref();
    let file = Gguf::open(path)?;
    let permuted =
        matches!(file.get("general.architecture"), Some(GgufValue::String(a)) if a == "llama");
    let opts = LoadOptions { group: Group::Param, ..LoadOptions::default() };
    let loaded = store.load_checkpoint(path, opts)?;
    let mut put: Vec<TensorId> = Vec::new();
    let res = (|| -> candle_core::Result<Vec<(String, TensorId)>> {
        let by_hf: std::collections::HashMap<String, &crate::LoadedTensor> =
            loaded.iter().filter_map(|t| Some((hf_name(&t.name)?, t))).collect();
        let mut out = Vec::new();
        for (name, shape) in config.tensors() {
            let t = by_hf.get(&name).ok_or_else(|| {
                candle_core::Error::CannotFindTensor { path: name.clone() }
                    .bt()
                    .context(format!("in {}", path.display()))
            })?;
            let info = store.info(t.id).map_err(|e| strata_err(&t.name, e))?;
            if info.shape != shape {
                return Err(super::shape_mismatch(&name, &shape, &info.shape));
            }
            let heads = if name.ends_with("self_attn.q_proj.weight") {
                Some(config.num_attention_heads)
            } else if name.ends_with("self_attn.k_proj.weight") {
                Some(config.num_key_value_heads)
            } else {
                None
            };
            let id = match heads.filter(|_| permuted) {
                None => t.id,
                Some(heads) => {
                    let bytes = store.read(t.id).map_err(|e| strata_err(&t.name, e))?;
                    let rows = shape[0];
                    let fixed = unpermute_rows(&bytes, rows, bytes.len() / rows, heads);
                    let id = store
                        .put_group(&name, Group::Param, info.dtype, &shape, &fixed)
                        .map_err(|e| strata_err(&name, e))?;
                    put.push(id);
                    id
                }
            };
            out.push((name, id));
        }
        Ok(out)
    })();
    let keep: Vec<TensorId> = match &res {
        Ok(out) => out.iter().map(|(_, id)| *id).collect(),
        Err(_) => Vec::new(),
    };
    for id in loaded.iter().map(|t| t.id).chain(put.iter().copied()) {
        if !keep.contains(&id) {
            store.remove(id).map_err(|e| strata_err("a tensor of the GGUF file", e))?;
        }
    }
    res
}

/// Whether a base of weights of `dtypes` needs [`widen_for_training`]: the trainer computes a
/// base in one float dtype, f32 or bf16, counting quantized weights as f32 (it dequantizes them
/// to f32); f16 is not one of them, and bf16 beside f32 or quantized weights is another. So:
/// any f16 weight, or bf16 weights beside others.
pub fn needs_widening(dtypes: impl IntoIterator<Item = DType>) -> bool {
    let (mut f16, mut bf16, mut other) = (false, false, false);
    for d in dtypes {
        match d {
            DType::F16 => f16 = true,
            DType::BF16 => bf16 = true,
            _ => other = true,
        }
    }
    f16 || (bf16 && other)
}

/// A GGUF base's weights (`weights`, as [`load_gguf_weights`] loads them) as the trainer takes
/// them: real files mix types (norms in F32, an embedding table in F16, blocks in Q4_K and
/// Q6_K), and the trainer computes a base in one float dtype, counting quantized weights as
/// f32. When [`needs_widening`] says so, each f16 and bf16 weight is replaced in `store` by an
/// f32 copy (exact: every f16 and bf16 value is an f32 value), group `Param`, under its Hugging
/// Face name (`NAME.f32` where the store has a tensor of that name); the replaced tensors are
/// removed (their bytes stay in the file). The copies cost 2 more bytes an element in host
/// memory and through the Device tier; quantized weights stay quantized. Otherwise `weights`
/// comes back as it is. On an error every copy made is removed and the store holds `weights`
/// as they were.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use strata::candle::{load_weights, widen_for_training, LlamaConfig};
/// // Q4_K and Q6_K blocks, F32 norms, an F16 embedding table (tests/fixtures/gen_mixed.py).
/// let path = "tests/fixtures/mixed.gguf";
/// let config = LlamaConfig::from_gguf(&strata::Gguf::open(path)?)?;
/// let store = strata::candle::store_for(&candle_core::Device::Cpu, strata::Store::builder())?;
/// let weights = widen_for_training(&store, load_weights(&store, &config, path)?)?;
/// let embed = weights.iter().find(|(n, _)| n == "model.embed_tokens.weight").unwrap().1;
/// assert_eq!(store.info(embed)?.dtype, strata::DType::F32);
/// # Ok(()) }
/// ```
pub fn widen_for_training(
    store: &Store,
    weights: Vec<(String, TensorId)>,
) -> candle_core::Result<Vec<(String, TensorId)>> {
    let mut infos = Vec::with_capacity(weights.len());
    for (name, id) in &weights {
        infos.push(store.info(*id).map_err(|e| strata_err(name, e))?);
    }
    if !needs_widening(infos.iter().map(|i| i.dtype)) {
        return Ok(weights);
    }
    // (the copy, the tensor it replaces)
    let mut made: Vec<(TensorId, TensorId)> = Vec::new();
    let res = (|| -> candle_core::Result<Vec<(String, TensorId)>> {
        let mut out = Vec::with_capacity(weights.len());
        for ((name, id), info) in weights.iter().zip(&infos) {
            let values: Vec<f32> = match info.dtype {
                DType::F16 => {
                    let v = store.read_vec::<half::f16>(*id).map_err(|e| strata_err(name, e))?;
                    v.into_iter().map(f32::from).collect()
                }
                DType::BF16 => {
                    let v = store.read_vec::<half::bf16>(*id).map_err(|e| strata_err(name, e))?;
                    v.into_iter().map(f32::from).collect()
                }
                _ => {
                    out.push((name.clone(), *id));
                    continue;
                }
            };
            let as_named = match store.lookup(name) {
                None => name.clone(),
                Some(_) => format!("{name}.f32"),
            };
            let bytes = bytemuck::cast_slice::<f32, u8>(&values);
            let copy = store
                .put_group(&as_named, Group::Param, DType::F32, &info.shape, bytes)
                .map_err(|e| strata_err(name, e))?;
            made.push((copy, *id));
            out.push((name.clone(), copy));
        }
        Ok(out)
    })();
    match res {
        Ok(out) => {
            for (_, old) in &made {
                store.remove(*old).map_err(|e| strata_err("a widened weight's original", e))?;
            }
            Ok(out)
        }
        Err(e) => {
            for (copy, _) in &made {
                if let Err(r) = store.remove(*copy) {
                    store.shared.defer_err(r);
                }
            }
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermuting_inverts_llama_cpp_permutation() {
        // convert_hf_to_gguf's permute: reshape(heads, 2, d/2, cols).swapaxes(1, 2).
        let (heads, d) = (3, 8);
        let rows = heads * d;
        let permute = |hf: &[u8]| -> Vec<u8> {
            let mut out = vec![0u8; rows];
            for h in 0..heads {
                for j in 0..d / 2 {
                    for i in 0..2 {
                        out[h * d + j * 2 + i] = hf[h * d + i * (d / 2) + j];
                    }
                }
            }
            out
        };
        let hf: Vec<u8> = (0..rows as u8).collect();
        let file = permute(&hf);
        assert_ne!(file, hf);
        assert_eq!(&file[..4], &[0, 4, 1, 5]);
        assert_eq!(unpermute_rows(&file, rows, 1, heads), hf);
        // Rows of several bytes move whole.
        let wide: Vec<u8> = file.iter().flat_map(|&r| [r, r]).collect();
        let back = unpermute_rows(&wide, rows, 2, heads);
        assert_eq!(back, hf.iter().flat_map(|&r| [r, r]).collect::<Vec<u8>>());
    }

    #[test]
    fn names_map_to_hugging_face_names() {
        assert_eq!(hf_name("token_embd.weight").as_deref(), Some(super::super::llama::EMBED));
        assert_eq!(hf_name("output.weight").as_deref(), Some("lm_head.weight"));
        assert_eq!(
            hf_name("blk.11.attn_output.weight").as_deref(),
            Some("model.layers.11.self_attn.o_proj.weight")
        );
        for bad in ["blk.x.attn_q.weight", "blk.1.attn_q.scale", "blk.1.ffn_gate_exps.weight", ""] {
            assert_eq!(hf_name(bad), None, "{bad}");
        }
    }
}
