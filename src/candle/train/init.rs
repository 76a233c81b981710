//! A run's parameters and their first values: the model's weights put into a store at random
//! ([`put_random_weights`]) or loaded from a checkpoint ([`load_weights`]), and the order and
//! initial values of every parameter of a run, LoRA adapters included, as the trainer and its
//! twin both make them.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType as CDType, Tensor};

use super::{put_host, strata_err, LlamaConfig, LoraConfig, TrainError};
use crate::base::types::{DType, Group, TensorId};
use crate::candle::block::{Adapter, Weights};
use crate::candle::lora::{init_a, AdapterSpec};
use crate::{LoadOptions, Store};

/// Puts random initial weights of `config` ([`crate::candle::llama::random_weights`]) into `store`
/// as `Param` tensors of `dtype` (`F32` or `BF16`) under Hugging Face's names, in host memory
/// (Pinned, else wherever there is room).
pub fn put_random_weights(
    store: &Store,
    config: &LlamaConfig,
    seed: u64,
    dtype: DType,
) -> candle_core::Result<Vec<(String, TensorId)>> {
    put_random_tensors(store, &config.tensors(), seed, dtype)
}

/// [`put_random_weights`] of any tensors, `(name, shape)`: a model of a
/// [`Block`](crate::candle::block::Block) of your own
/// ([`model_tensors`](crate::candle::block::model_tensors)). A matrix gets normal values of
/// deviation 0.02, a vector ones, a name ending `.bias` zeros
/// ([`crate::candle::llama::random_weights_of`]).
pub fn put_random_tensors(
    store: &Store,
    tensors: &[(String, Vec<usize>)],
    seed: u64,
    dtype: DType,
) -> candle_core::Result<Vec<(String, TensorId)>> {
    crate::candle::llama::random_weights_of(tensors.to_vec(), seed)
        .map(|(name, shape, values)| {
            let bytes = match dtype {
                DType::F32 => bytemuck::cast_slice::<f32, u8>(&values).to_vec(),
                DType::BF16 => {
                    let b: Vec<half::bf16> =
                        values.iter().map(|&x| half::bf16::from_f32(x)).collect();
                    bytemuck::cast_slice::<half::bf16, u8>(&b).to_vec()
                }
                other => candle_core::bail!("weights in {other}: f32 or bf16 are trained"),
            };
            let id = put_host(store, &name, Group::Param, dtype, &shape, &bytes)
                .map_err(|e| strata_err(&name, e))?;
            Ok((name, id))
        })
        .collect()
}

/// Loads a Hugging Face Llama checkpoint of `config` into `store` (a `.safetensors` file, a
/// sharded checkpoint's `*.index.json` or a directory; in place, group `Param`), and checks
/// that it has every tensor `config` names, in the shape it says, in f32 or bf16. Tensors the
/// model does not use are left out (and removed from the store).
///
/// A GGUF file (named `*.gguf`) is loaded by
/// [`load_gguf_weights`](crate::candle::load_gguf_weights) instead: its tensors under Hugging
/// Face's names, in the file's dtypes (block-quantized ones included: generation dequantizes them
/// where a layer is fetched, and the trainer takes them as a frozen base under LoRA adapters,
/// QLoRA, refusing to train them by name).
pub fn load_weights(
    store: &Store,
    config: &LlamaConfig,
    path: impl AsRef<Path>,
) -> candle_core::Result<Vec<(String, TensorId)>> {
    let path = path.as_ref();
    if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
        return crate::candle::load_gguf_weights(store, config, path);
    }
    load_tensors(store, &config.tensors(), path)
}

/// [`load_weights`] of any tensors, `(name, shape)`: a model of a
/// [`Block`](crate::candle::block::Block) of your own
/// ([`model_tensors`](crate::candle::block::model_tensors)).
pub fn load_tensors(
    store: &Store,
    tensors: &[(String, Vec<usize>)],
    path: impl AsRef<Path>,
) -> candle_core::Result<Vec<(String, TensorId)>> {
    let opts = LoadOptions { group: Group::Param, ..LoadOptions::default() };
    let path = path.as_ref();
    let loaded = store.load_checkpoint(path, opts).map_err(candle_core::Error::from)?;
    // A file with more blocks than the config says is another model (or a config cut short):
    // refused, not trained or run on its first blocks.
    let blocks = tensors.iter().filter_map(|(n, _)| layer_of(n)).max().map_or(0, |l| l + 1);
    let in_file = loaded.iter().filter_map(|t| layer_of(&t.name)).max().map_or(0, |l| l + 1);
    if in_file > blocks {
        for t in loaded.iter() {
            let _ = store.remove(t.id);
        }
        return Err(TrainError::Mismatch {
            path: path.to_path_buf(),
            what: "number of blocks (num_hidden_layers)".into(),
            saved: in_file.to_string(),
            here: format!("{blocks} (the config's)"),
            hint: "the config is of another model, or cut short: use the config.json that \
                   came with the weights"
                .into(),
        }
        .into_candle());
    }
    let mut out = Vec::new();
    for (name, shape) in tensors.iter().cloned() {
        let id = loaded
            .get(&name)
            .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.clone() }.bt())?;
        let info = store.info(id).map_err(|e| strata_err(&name, e))?;
        if info.shape != shape {
            return Err(crate::candle::shape_mismatch(&name, &shape, &info.shape));
        }
        if !matches!(info.dtype, DType::F32 | DType::BF16) {
            candle_core::bail!("{name} is {}: f32 or bf16 weights are trained", info.dtype);
        }
        out.push((name, id));
    }
    for t in loaded.iter() {
        if !out.iter().any(|(n, _)| *n == t.name) {
            store.remove(t.id).map_err(|e| strata_err(&t.name, e))?;
        }
    }
    Ok(out)
}

/// How a parameter of a run gets its first value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Init {
    /// The model's weights, given.
    Given,
    /// A LoRA `A`: [`init_a`] of this adapter's number.
    LoraA(usize),
    /// Zeros (a LoRA `B`).
    Zero,
}

/// The block a parameter's name is in (`model.layers.N.`).
pub(super) fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?.split('.').next()?.parse().ok()
}

/// Every parameter of a run, `(name, shape, first value)`: the model's tensors (`base`, in
/// stage order), each block's LoRA adapters (`A` then `B`, in `specs`' order) after its own
/// tensors. The trainer and its twin order their parameters (and so the gradient norm's sum)
/// alike.
pub(super) fn run_params(
    base: &[(String, Vec<usize>)],
    specs: &[AdapterSpec],
) -> Vec<(String, Vec<usize>, Init)> {
    let mut out = Vec::with_capacity(base.len() + 2 * specs.len());
    for (k, (name, shape)) in base.iter().enumerate() {
        out.push((name.clone(), shape.clone(), Init::Given));
        let l = layer_of(name);
        if l.is_some() && base.get(k + 1).map(|(n, _)| layer_of(n)) != Some(l) {
            for (i, s) in specs.iter().enumerate().filter(|(_, s)| Some(s.layer) == l) {
                out.push((s.a.0.clone(), s.a.1.clone(), Init::LoraA(i)));
                out.push((s.b.0.clone(), s.b.1.clone(), Init::Zero));
            }
        }
    }
    out
}

/// The f32 values a parameter starts from when it is not given (a LoRA adapter's).
pub(super) fn init_values(init: Init, shape: &[usize], lora: Option<&LoraConfig>) -> Vec<f32> {
    match init {
        Init::LoraA(i) => init_a(lora.map_or(0, |l| l.seed), i, shape),
        _ => vec![0.0; shape.iter().product()],
    }
}

/// Block `l`'s [`Weights`]: its tensors (`names`, within the block) and its adapters, from
/// `get(full name)`.
pub(super) fn block_weights(
    names: &[(String, Vec<usize>)],
    specs: &[AdapterSpec],
    scale: f64,
    l: usize,
    get: impl Fn(&str) -> Option<Tensor>,
) -> candle_core::Result<Weights> {
    let p = LlamaConfig::block_prefix(l);
    let find = |n: &str| {
        get(n).ok_or_else(|| candle_core::Error::CannotFindTensor { path: n.to_string() }.bt())
    };
    let mut t = HashMap::with_capacity(names.len());
    for (s, _) in names {
        t.insert(s.clone(), find(&format!("{p}{s}"))?);
    }
    let mut w = Weights::new(t);
    for s in specs.iter().filter(|s| s.layer == l) {
        let adapter = Adapter { a: find(&s.a.0)?, b: find(&s.b.0)?, scale };
        w = w.with_adapter(s.linear.clone(), adapter);
    }
    Ok(w)
}

/// The candle dtype of a trained parameter's store dtype.
pub(super) fn compute_dtype(d: DType) -> candle_core::Result<CDType> {
    match d {
        DType::F32 => Ok(CDType::F32),
        DType::BF16 => Ok(CDType::BF16),
        other => candle_core::bail!("{other} parameters: f32 or bf16 are trained"),
    }
}
