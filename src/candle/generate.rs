//! Generation with the Llama decoder of [`super::llama`]: [`OutOfCoreLlama`] runs it block by
//! block with its weights fetched through [`Layers`] (the next block prefetched) and its KV cache
//! kept in the store ([`StoreKvCache`]); [`InMemoryLlama`] is the same model with every weight
//! a resident candle tensor and the cache in candle tensors, its reference. [`generate`] runs
//! either one token at a time, greedy or sampled ([`Sampling`]).
//!
//! Both do the same candle operations on the same values in the same order (the KV cache's
//! round trip through the store copies bytes), so on one device their logits are equal bit for
//! bit and they generate the same tokens (`tests/candle/generate.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType as CDType, Device, Tensor};

use super::linear::Adapter;
use super::llama::{
    block_forward, embed, head_logits, BlockWeights, KvCache, Rope, SeededRng, EMBED,
};
use super::{strata_err, tensor_from_bytes, wait_for_writer, with_cpu_bytes, Layers, LlamaConfig};
use crate::base::types::{DType, Group, TensorId};
use crate::{DeviceView, Store};

/// How the next token is picked from the logits.
#[derive(Clone, Debug, PartialEq)]
pub enum Sampling {
    /// The most likely token (the lowest id among equal logits).
    Greedy,
    /// A draw from `softmax(logits / temperature)`, after keeping the `top_k` most likely
    /// tokens (all when `None`) and then the fewest most likely ones whose probabilities add up
    /// to `top_p` or more (all when `None`); the generator is seeded by `seed`, so a run repeats.
    Random {
        /// Above 0: below 1 sharpens the distribution, above 1 flattens it.
        temperature: f64,
        /// Keep only this many most likely tokens (at least 1).
        top_k: Option<usize>,
        /// Nucleus: keep the most likely tokens up to this much probability (in (0, 1]).
        top_p: Option<f64>,
        /// The generator's seed.
        seed: u64,
    },
}

impl Sampling {
    /// The sampling a command line asks for, checked: greedy without a temperature or with 0;
    /// sampled with a temperature above 0, `top_k` and `top_p` as [`Sampler::new`] accepts
    /// them. A temperature that is NaN, infinite or below 0 is an error, and so are `top_k` or
    /// `top_p` without a temperature (greedy decoding would ignore them).
    ///
    /// ```
    /// use strata::candle::Sampling;
    /// assert_eq!(Sampling::from_flags(None, None, None, 0)?, Sampling::Greedy);
    /// assert!(Sampling::from_flags(Some(f64::NAN), None, None, 0).is_err());
    /// assert!(Sampling::from_flags(Some(-1.0), None, None, 0).is_err());
    /// assert!(Sampling::from_flags(None, Some(0), None, 0).is_err());
    /// assert!(Sampling::from_flags(Some(0.7), None, Some(0.0), 0).is_err());
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn from_flags(
        temperature: Option<f64>,
        top_k: Option<usize>,
        top_p: Option<f64>,
        seed: u64,
    ) -> candle_core::Result<Sampling> {
        match temperature {
            Some(0.0) => {}
            Some(t) if !(t.is_finite() && t > 0.0) => candle_core::bail!(
                "temperature {t}: above 0 and finite to sample, 0 (or none) for greedy"
            ),
            Some(temperature) => {
                let s = Sampling::Random { temperature, top_k, top_p, seed };
                Sampler::new(s.clone())?;
                return Ok(s);
            }
            None => {}
        }
        if let Some(what) =
            top_k.map(|k| format!("top_k {k}")).or_else(|| top_p.map(|p| format!("top_p {p}")))
        {
            candle_core::bail!(
                "{what} without a temperature: greedy decoding would ignore it; give a \
                 temperature above 0 to sample"
            );
        }
        Ok(Sampling::Greedy)
    }
}

/// Picks tokens from logits as a [`Sampling`] says, one call per token.
///
/// ```
/// use strata::candle::{Sampler, Sampling};
/// let mut greedy = Sampler::new(Sampling::Greedy)?;
/// assert_eq!(greedy.sample(&[0.1, 2.0, -1.0])?, 1);
/// let top1 = Sampling::Random { temperature: 0.7, top_k: Some(1), top_p: None, seed: 3 };
/// assert_eq!(Sampler::new(top1)?.sample(&[0.1, 2.0, -1.0])?, 1);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct Sampler {
    sampling: Sampling,
    rng: SeededRng,
}

impl Sampler {
    /// A sampler; refuses a temperature that is not above 0, a `top_k` of 0 and a `top_p`
    /// outside (0, 1].
    pub fn new(sampling: Sampling) -> candle_core::Result<Sampler> {
        let seed = match &sampling {
            Sampling::Greedy => 0,
            Sampling::Random { temperature, top_k, top_p, seed } => {
                if !(temperature.is_finite() && *temperature > 0.0) {
                    candle_core::bail!(
                        "temperature {temperature}: above 0 (use Sampling::Greedy for 0)"
                    );
                }
                if *top_k == Some(0) {
                    candle_core::bail!("top_k 0: at least 1");
                }
                if let Some(p) = top_p {
                    if !(*p > 0.0 && *p <= 1.0) {
                        candle_core::bail!("top_p {p}: in (0, 1]");
                    }
                }
                *seed
            }
        };
        Ok(Sampler { sampling, rng: SeededRng::new(seed) })
    }

    /// The next token for one position's logits (a vocabulary's worth).
    pub fn sample(&mut self, logits: &[f32]) -> candle_core::Result<u32> {
        if logits.is_empty() {
            candle_core::bail!("no logits to sample from");
        }
        if let Some(i) = logits.iter().position(|x| x.is_nan()) {
            candle_core::bail!("logit {i} is NaN");
        }
        let (temperature, top_k, top_p) = match &self.sampling {
            Sampling::Greedy => {
                let mut best = 0;
                for (i, &x) in logits.iter().enumerate() {
                    if x > logits[best] {
                        best = i;
                    }
                }
                return Ok(best as u32);
            }
            Sampling::Random { temperature, top_k, top_p, .. } => (*temperature, *top_k, *top_p),
        };
        // Most likely first; equal logits by id.
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        order.truncate(top_k.unwrap_or(order.len()).min(order.len()));
        let top = f64::from(logits[order[0]]);
        let mut probs: Vec<f64> =
            order.iter().map(|&i| ((f64::from(logits[i]) - top) / temperature).exp()).collect();
        let total: f64 = probs.iter().sum();
        if let Some(p) = top_p {
            let mut cum = 0.0;
            let keep = probs
                .iter()
                .position(|&q| {
                    cum += q / total;
                    cum >= p
                })
                .map_or(probs.len(), |k| k + 1);
            probs.truncate(keep);
        }
        let total: f64 = probs.iter().sum();
        let mut u = self.rng.uniform() * total;
        for (k, &q) in probs.iter().enumerate() {
            if u < q {
                return Ok(order[k] as u32);
            }
            u -= q;
        }
        Ok(order[probs.len() - 1] as u32)
    }
}

/// A causal language model that [`generate`] runs: a forward over new tokens that appends them
/// to a cache and gives the logits of the last one.
pub trait CausalLm {
    /// What the model keeps of the positions it has seen.
    type Cache;

    /// A cache for `batch` sequences of up to `capacity` positions.
    fn new_cache(&self, batch: usize, capacity: usize) -> candle_core::Result<Self::Cache>;

    /// The logits (f32, `[batch, vocab]`) of the last of `ids` (`[batch, seq]`, u32), which
    /// follow the positions `cache` holds; the cache then holds these too.
    fn forward(&self, ids: &Tensor, cache: &mut Self::Cache) -> candle_core::Result<Tensor>;

    /// The forwards of several sequences, each with its own cache, length and positions:
    /// `ids[i]` follows what `caches[i]` holds, and its logits are what [`CausalLm::forward`]
    /// gives it alone. This default runs them one after the other; a model whose weights
    /// cross a slow link ([`OutOfCoreLlama`]) runs them in one pass over its weights.
    fn forward_each(
        &self,
        ids: &[Tensor],
        caches: &mut [Self::Cache],
    ) -> candle_core::Result<Vec<Tensor>> {
        one_cache_each(ids.len(), caches.len())?;
        ids.iter().zip(caches.iter_mut()).map(|(ids, cache)| self.forward(ids, cache)).collect()
    }

    /// The candle device it computes on.
    fn device(&self) -> &Device;
}

/// What [`generate`] made, or one sequence of [`generate_batch`].
#[derive(Clone, Debug, PartialEq)]
pub struct Generated {
    /// The new tokens (ending with the stop token when [`Generated::stopped`]).
    pub tokens: Vec<u32>,
    /// Seconds of each forward this sequence took part in: the first over the whole prompt,
    /// then one per new token but the last (which is not fed back). In a batch, a forward is
    /// the whole batch's pass.
    pub seconds: Vec<f64>,
    /// Ended at one of the stop tokens rather than at `max_new`.
    pub stopped: bool,
}

/// Generates `max_new` tokens after `prompt` (one sequence), one forward per token.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use candle_core::{DType, Device};
/// use strata as st;
/// use st::candle::{generate, InMemoryLlama, LlamaConfig, Sampling};
///
/// let config = LlamaConfig::from_json(r#"{"hidden_size": 32, "intermediate_size": 64,
///     "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 50,
///     "max_position_embeddings": 64}"#)?;
/// let model = InMemoryLlama::random(&config, 1, DType::F32, &Device::Cpu)?;
/// let out = generate(&model, &[1, 2, 3], 5, &Sampling::Greedy)?;
/// assert_eq!(out.tokens.len(), 5);
/// // More positions than the model has: an error, before anything is allocated.
/// assert!(generate(&model, &[1, 2, 3], usize::MAX, &Sampling::Greedy).is_err());
/// # Ok(()) }
/// ```
pub fn generate<M: CausalLm + ?Sized>(
    model: &M,
    prompt: &[u32],
    max_new: usize,
    sampling: &Sampling,
) -> candle_core::Result<Generated> {
    let mut out = generate_batch(model, &[prompt], max_new, sampling, &[], |_, _| Ok(()))?;
    Ok(out.pop().expect("one prompt, one sequence"))
}

/// Generates after each of `prompts` at once, up to `max_new` tokens each, a sequence ending
/// early at any of the `stop` tokens: every step is one [`CausalLm::forward_each`] over the
/// sequences still going (out of core, one pass over the weights serves them all), and each
/// sequence has its own cache, positions and sampler (seeded alike), so it generates what it
/// would generate alone. `on_token(i, token)` is called for each new token of sequence `i` as
/// it comes (for streaming); its error ends the generation. Each sequence needs
/// `prompt + max_new - 1` positions (its last token is not fed back): more than a cache can
/// hold is an error before anything is allocated.
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use candle_core::{DType, Device};
/// use strata::candle::{generate, generate_batch, InMemoryLlama, LlamaConfig, Sampling};
///
/// let config = LlamaConfig::from_json(r#"{"hidden_size": 32, "intermediate_size": 64,
///     "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 50,
///     "max_position_embeddings": 64}"#)?;
/// let model = InMemoryLlama::random(&config, 1, DType::F32, &Device::Cpu)?;
/// let prompts: [&[u32]; 2] = [&[1, 2, 3], &[7]];
/// let mut streamed = vec![Vec::new(); 2];
/// let out = generate_batch(&model, &prompts, 6, &Sampling::Greedy, &[], |i, t| {
///     streamed[i].push(t);
///     Ok(())
/// })?;
/// assert_eq!(out[1].tokens, generate(&model, &[7], 6, &Sampling::Greedy)?.tokens);
/// assert_eq!(streamed[0], out[0].tokens);
/// # Ok(()) }
/// ```
pub fn generate_batch<M: CausalLm + ?Sized, P: AsRef<[u32]>>(
    model: &M,
    prompts: &[P],
    max_new: usize,
    sampling: &Sampling,
    stop: &[u32],
    mut on_token: impl FnMut(usize, u32) -> candle_core::Result<()>,
) -> candle_core::Result<Vec<Generated>> {
    let mut samplers = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        if p.as_ref().is_empty() {
            candle_core::bail!("prompt {i} is empty: at least one token is needed");
        }
        samplers.push(Sampler::new(sampling.clone())?);
    }
    let mut out: Vec<Generated> = prompts
        .iter()
        .map(|_| Generated { tokens: Vec::new(), seconds: Vec::new(), stopped: false })
        .collect();
    if max_new == 0 || prompts.is_empty() {
        return Ok(out);
    }
    let mut caches = Vec::with_capacity(prompts.len());
    let mut inputs = Vec::with_capacity(prompts.len());
    for p in prompts {
        let p = p.as_ref();
        let capacity = p.len().checked_add(max_new - 1).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "a prompt of {} tokens and max_new {max_new}: more positions than can be counted",
                p.len()
            ))
        })?;
        caches.push(model.new_cache(1, capacity).map_err(|e| {
            e.context(format!("a prompt of {} tokens and max_new {max_new}", p.len()))
        })?);
        inputs.push(Tensor::from_vec(p.to_vec(), (1, p.len()), model.device())?);
    }
    let mut active: Vec<usize> = (0..prompts.len()).collect();
    while !active.is_empty() {
        let t0 = Instant::now();
        let logits = model.forward_each(&inputs, &mut caches)?;
        let dt = t0.elapsed().as_secs_f64();
        let mut keep = Vec::with_capacity(active.len());
        inputs.clear();
        for (&i, logits) in active.iter().zip(&logits) {
            let next = samplers[i].sample(&logits.squeeze(0)?.to_vec1::<f32>()?)?;
            let g = &mut out[i];
            g.seconds.push(dt);
            g.tokens.push(next);
            g.stopped = stop.contains(&next);
            on_token(i, next)?;
            let going = !g.stopped && g.tokens.len() < max_new;
            keep.push(going);
            if going {
                inputs.push(Tensor::from_vec(vec![next], (1, 1), model.device())?);
            }
        }
        // The caches of the sequences that ended are dropped here (out of core: their store
        // tensors removed).
        let mut k = keep.iter();
        caches.retain(|_| *k.next().expect("one flag a cache"));
        let mut k = keep.iter();
        active.retain(|_| *k.next().expect("one flag a sequence"));
    }
    Ok(out)
}

/// Checks that a batch has one cache a sequence.
fn one_cache_each(inputs: usize, caches: usize) -> candle_core::Result<()> {
    if inputs != caches {
        candle_core::bail!("{inputs} inputs for {caches} caches: one cache a sequence");
    }
    Ok(())
}

/// Checks a cache's capacity against the config's rotary tables (a sliding window needs no
/// check: the attention keeps to it whatever the cache holds), and its size: the keys and
/// values of every block (`2 · blocks · capacity · batch · kv_heads · head_dim` elements of
/// `elem` bytes) and the rotary tables, in checked arithmetic (a product that overflows is
/// refused, never wrapped) and against the host memory available.
fn check_capacity(
    config: &LlamaConfig,
    batch: usize,
    capacity: usize,
    elem: usize,
) -> candle_core::Result<()> {
    if capacity == 0 {
        candle_core::bail!("a KV cache of 0 positions");
    }
    if capacity > config.max_position_embeddings {
        candle_core::bail!(
            "{capacity} positions past the model's max_position_embeddings {}",
            config.max_position_embeddings
        );
    }
    let kv = [2, config.num_hidden_layers, capacity, batch.max(1), config.num_key_value_heads]
        .iter()
        .chain([config.head_dim, elem].iter())
        .try_fold(1u64, |a, &x| a.checked_mul(x as u64));
    let rope = (capacity as u64).checked_mul(config.head_dim as u64).and_then(|x| x.checked_mul(8));
    let Some(bytes) = kv.zip(rope).and_then(|(k, r)| k.checked_add(r)) else {
        candle_core::bail!(
            "a KV cache of {capacity} positions for {batch} sequences of {} blocks: its size \
             overflows u64: ask for fewer new tokens (max_new)",
            config.num_hidden_layers
        );
    };
    if let Some(available) = crate::host_memory_available() {
        if bytes > available {
            candle_core::bail!(
                "a KV cache of {capacity} positions for {batch} sequences needs {} and {} of \
                 host memory is available: ask for fewer new tokens (max_new) or a shorter prompt",
                crate::format_size(bytes),
                crate::format_size(available)
            );
        }
    }
    Ok(())
}

/// Checks ids against a cache: the batch, the room left, the vocabulary.
fn check_ids(
    ids: &Tensor,
    batch: usize,
    len: usize,
    capacity: usize,
) -> candle_core::Result<(usize, usize)> {
    let (b, s) = ids.dims2()?;
    if b != batch || s == 0 {
        candle_core::bail!("ids of {b} sequences of {s} tokens for a cache of {batch} sequences");
    }
    if len + s > capacity {
        candle_core::bail!(
            "{s} tokens after {len} in a cache of {capacity} positions: make a larger cache"
        );
    }
    if ids.dtype() != CDType::U32 {
        candle_core::bail!("ids of {:?}: u32 token ids expected", ids.dtype());
    }
    Ok((b, s))
}

/// The Llama decoder with every weight a resident candle tensor and its KV cache in candle
/// tensors ([`InMemoryCache`]): the reference of [`OutOfCoreLlama`].
#[derive(Clone, Debug)]
pub struct InMemoryLlama {
    config: LlamaConfig,
    dtype: CDType,
    device: Device,
    embed: Tensor,
    blocks: Vec<BlockWeights>,
    norm: Tensor,
    head: Tensor,
}

/// [`InMemoryLlama`]'s cache: each block's keys and values, and the rotary tables.
#[derive(Clone, Debug)]
pub struct InMemoryCache {
    layers: Vec<KvCache>,
    rope: Rope,
    batch: usize,
    capacity: usize,
}

impl InMemoryCache {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, KvCache::len)
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl InMemoryLlama {
    /// The model of `config` from its weights (every tensor [`LlamaConfig::tensors`] names, by
    /// Hugging Face's name), computing in `dtype` (f32, bf16 or f16) on `device`.
    pub fn new(
        config: &LlamaConfig,
        weights: &std::collections::HashMap<String, Tensor>,
        dtype: CDType,
        device: &Device,
    ) -> candle_core::Result<InMemoryLlama> {
        compute_dtype(dtype)?;
        let get = |name: &str| -> candle_core::Result<Tensor> {
            weights
                .get(name)
                .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.into() }.bt())?
                .to_device(device)?
                .to_dtype(dtype)
        };
        for (name, shape) in config.tensors() {
            let t = get(&name)?;
            if t.dims() != shape.as_slice() {
                candle_core::bail!("{name} has shape {:?}, the config says {shape:?}", t.dims());
            }
        }
        let blocks = (0..config.num_hidden_layers)
            .map(|l| {
                let p = LlamaConfig::block_prefix(l);
                BlockWeights::from_fn(config, |s| get(&format!("{p}{s}")))
            })
            .collect::<candle_core::Result<_>>()?;
        let [norm, head] = config.head_names();
        Ok(InMemoryLlama {
            config: config.clone(),
            dtype,
            device: device.clone(),
            embed: get(EMBED)?,
            blocks,
            norm: get(norm)?,
            head: get(head)?,
        })
    }

    /// The model from its parts, computing in their dtype on their device (the trainer's
    /// in-memory twin hands its own tensors: [`LlamaTwin::generator`](super::LlamaTwin::generator)).
    pub(crate) fn from_parts(
        config: &LlamaConfig,
        embed: Tensor,
        blocks: Vec<BlockWeights>,
        norm: Tensor,
        head: Tensor,
    ) -> candle_core::Result<InMemoryLlama> {
        let dtype = embed.dtype();
        compute_dtype(dtype)?;
        Ok(InMemoryLlama {
            config: config.clone(),
            dtype,
            device: embed.device().clone(),
            embed,
            blocks,
            norm,
            head,
        })
    }

    /// The model of `config` with the random initial weights of
    /// [`random_weights`](super::llama::random_weights) (`seed`).
    pub fn random(
        config: &LlamaConfig,
        seed: u64,
        dtype: CDType,
        device: &Device,
    ) -> candle_core::Result<InMemoryLlama> {
        let weights = super::llama::random_weights(config, seed)
            .map(|(n, s, v)| Ok((n, Tensor::from_vec(v, s, device)?)))
            .collect::<candle_core::Result<_>>()?;
        Self::new(config, &weights, dtype, device)
    }

    /// The config.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The dtype it computes in.
    pub fn dtype(&self) -> CDType {
        self.dtype
    }

    /// Applies the LoRA adapter `adapter` unmerged, as [`OutOfCoreLlama::with_adapter`] does.
    pub fn with_adapter(
        mut self,
        adapter: &super::lora::LoadedAdapter,
    ) -> candle_core::Result<InMemoryLlama> {
        let adapters = block_adapters(&self.config, adapter, &self.device)?;
        for (block, a) in self.blocks.iter_mut().zip(adapters) {
            block.adapters = a;
        }
        Ok(self)
    }
}

/// `adapter`'s adapters, block by block, on `device`; one of a weight that is not a block's
/// projection (`model.layers.N.self_attn.q_proj.weight` ... `mlp.down_proj.weight`) is refused.
fn block_adapters(
    config: &LlamaConfig,
    adapter: &super::lora::LoadedAdapter,
    device: &Device,
) -> candle_core::Result<Vec<HashMap<String, Adapter>>> {
    let projection = |n: &str| {
        super::llama_config::BLOCK_TENSORS.iter().any(|t| t.ends_with("_proj.weight") && *t == n)
    };
    for name in adapter.linears() {
        let placed = (0..config.num_hidden_layers)
            .any(|l| name.strip_prefix(&LlamaConfig::block_prefix(l)).is_some_and(&projection));
        if !placed {
            candle_core::bail!(
                "a LoRA adapter of {name}: adapters apply to the projections of the model's {} \
                 blocks",
                config.num_hidden_layers
            );
        }
    }
    (0..config.num_hidden_layers).map(|l| adapter.block(l, device)).collect()
}

impl CausalLm for InMemoryLlama {
    type Cache = InMemoryCache;

    fn new_cache(&self, batch: usize, capacity: usize) -> candle_core::Result<InMemoryCache> {
        check_capacity(&self.config, batch, capacity, self.dtype.size_in_bytes())?;
        Ok(InMemoryCache {
            layers: vec![KvCache::new(); self.config.num_hidden_layers],
            rope: Rope::new(&self.config, capacity, &self.device)?,
            batch,
            capacity,
        })
    }

    fn forward(&self, ids: &Tensor, cache: &mut InMemoryCache) -> candle_core::Result<Tensor> {
        let offset = cache.len();
        let (_, s) = check_ids(ids, cache.batch, offset, cache.capacity)?;
        let mut x = embed(&self.embed, ids)?;
        for (w, kv) in self.blocks.iter().zip(cache.layers.iter_mut()) {
            x = block_forward(&self.config, w, &x, &cache.rope, offset, Some(kv))?;
        }
        let last = x.narrow(1, s - 1, 1)?;
        head_logits(&self.config, &last, &self.norm, &self.head)
    }

    fn device(&self) -> &Device {
        &self.device
    }
}

/// The dtypes the decoder computes in (and its KV cache holds).
fn compute_dtype(dtype: CDType) -> candle_core::Result<DType> {
    Ok(match dtype {
        CDType::F32 => DType::F32,
        CDType::BF16 => DType::BF16,
        CDType::F16 => DType::F16,
        other => candle_core::bail!("computing in {other:?}: f32, bf16 or f16"),
    })
}

/// Bytes per element of a compute dtype.
fn compute_size(dtype: CDType) -> u64 {
    dtype.size_in_bytes() as u64
}

/// A KV cache kept in a store: for each block, its keys and its values as two store tensors of
/// group `Activation`, `[capacity, batch, kv_heads, head_dim]` (position-major, so the
/// positions held are the tensor's first bytes), homed in host memory. [`OutOfCoreLlama`]
/// brings a block's pair to the device with the block's weights (prefetched with them), reads
/// the positions held, appends the new ones in place and releases the pair, so that a cache
/// the Device tier cannot hold is written back to host memory and brought in again when its
/// block runs. Dropping it removes its tensors from the store.
pub struct StoreKvCache {
    store: Arc<Store>,
    /// Each block's keys and values, and their names.
    ids: Vec<[(TensorId, String); 2]>,
    batch: usize,
    capacity: usize,
    len: usize,
    dtype: CDType,
    /// `[capacity, batch, kv_heads, head_dim]`.
    shape: [usize; 4],
    rope: Rope,
}

impl std::fmt::Debug for StoreKvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreKvCache")
            .field("layers", &self.ids.len())
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl StoreKvCache {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The store tensors, keys then values of each block.
    pub fn tensor_ids(&self) -> Vec<TensorId> {
        self.ids.iter().flat_map(|kv| kv.iter().map(|(id, _)| *id)).collect()
    }
}

impl Drop for StoreKvCache {
    fn drop(&mut self) {
        for (id, name) in self.ids.iter().flatten() {
            if let Err(e) = wait_for_writer(|| self.store.remove(*id)) {
                tracing::warn!(tensor = %name, error = %e.chain(), "a KV cache tensor stays");
            }
        }
    }
}

static CACHES: AtomicU64 = AtomicU64::new(0);

/// The Llama decoder run out of core for inference: each block's weights fetched through
/// [`Layers`] just before it runs (the next block's weights and KV cache prefetched meanwhile)
/// and dropped after it, unless the block is resident ([`OutOfCoreLlama::with_resident`]); the
/// KV cache in the store ([`StoreKvCache`]); the embedding rows the input uses gathered on the
/// host. It takes `&self` everywhere, so many threads can share one (each with its own cache;
/// on CUDA, on a device made with `Device::new_cuda_with_stream`, see
/// [`store_for`](super::store_for)).
///
/// ```
/// # fn main() -> candle_core::Result<()> {
/// use candle_core::{DType, Device};
/// use strata as st;
/// use st::candle::{generate, put_random_weights, Layers, LlamaConfig, OutOfCoreLlama, Sampling};
///
/// let config = LlamaConfig::from_json(r#"{"hidden_size": 32, "intermediate_size": 64,
///     "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 50,
///     "max_position_embeddings": 64}"#)?;
/// let device = Device::Cpu;
/// // A Device tier of about one block and a half.
/// let store = st::candle::store_for(&device,
///     st::Store::builder().capacity(st::Tier::Device, 48 << 10).prefetch_budget(48 << 10))?;
/// let weights = put_random_weights(&store, &config, 1, st::DType::F32)?;
/// let model = OutOfCoreLlama::new(Layers::new(store, weights, &device)?, &config, DType::F32)?;
/// let sampling = Sampling::Random { temperature: 0.8, top_k: Some(20), top_p: Some(0.95), seed: 7 };
/// let out = generate(&model, &[1, 2, 3], 5, &sampling)?;
/// assert_eq!(out.tokens.len(), 5);
/// # Ok(()) }
/// ```
pub struct OutOfCoreLlama {
    layers: Layers,
    config: LlamaConfig,
    dtype: CDType,
    /// The blocks kept as candle tensors (the first ones), converted to `dtype`.
    resident: Vec<BlockWeights>,
    /// Each block's tensors' names, and the head's.
    blocks: Vec<Vec<String>>,
    head: Vec<String>,
    /// Each block's LoRA adapters, applied unmerged ([`OutOfCoreLlama::with_adapter`]); empty
    /// maps without them.
    adapters: Vec<HashMap<String, Adapter>>,
}

impl std::fmt::Debug for OutOfCoreLlama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OutOfCoreLlama")
            .field("blocks", &self.blocks.len())
            .field("resident", &self.resident.len())
            .field("dtype", &self.dtype)
            .finish()
    }
}

impl OutOfCoreLlama {
    /// The decoder of `config` over the tensors `layers` serves (Hugging Face's names:
    /// [`load_weights`](super::load_weights) or [`put_random_weights`](super::put_random_weights)
    /// put them there), computing in `dtype` (f32, bf16 or f16). Every tensor the config names
    /// must be served, in its shape.
    pub fn new(
        layers: Layers,
        config: &LlamaConfig,
        dtype: CDType,
    ) -> candle_core::Result<OutOfCoreLlama> {
        compute_dtype(dtype)?;
        for (name, shape) in config.tensors() {
            let id = layers
                .id(&name)
                .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.clone() }.bt())?;
            let info = layers.store().info(id).map_err(|e| strata_err(&name, e))?;
            if info.shape != shape {
                return Err(super::shape_mismatch(&name, &shape, &info.shape));
            }
        }
        Ok(OutOfCoreLlama {
            layers,
            config: config.clone(),
            dtype,
            resident: Vec::new(),
            blocks: (0..config.num_hidden_layers).map(|l| config.block_names(l)).collect(),
            head: config.head_names().iter().map(|s| s.to_string()).collect(),
            adapters: vec![HashMap::new(); config.num_hidden_layers],
        })
    }

    /// Applies the LoRA adapter `adapter` unmerged: each adapted projection computes
    /// `W·x + scale · B·(A·x)` (PEFT's arithmetic, `A` and `B` in f32 on the candle device),
    /// `W` as it is fetched (a quantized weight dequantized where its block is fetched, its
    /// bytes in the store unchanged). For a quantized base, whose weights cannot take a merge;
    /// over f32 or bf16 weights [`LoadedAdapter::merge_into`](super::lora::LoadedAdapter::merge_into)
    /// computes the same without the adapter's matrix products. An adapter of a weight that is
    /// not one of a block's projections is refused, naming it.
    pub fn with_adapter(
        mut self,
        adapter: &super::lora::LoadedAdapter,
    ) -> candle_core::Result<OutOfCoreLlama> {
        self.adapters = block_adapters(&self.config, adapter, self.layers.device())?;
        Ok(self)
    }

    /// The config.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The [`Layers`] it fetches through.
    pub fn layers(&self) -> &Layers {
        &self.layers
    }

    /// Blocks kept resident.
    pub fn resident_blocks(&self) -> usize {
        self.resident.len()
    }

    /// Keeps the first `k` blocks (all if fewer) resident as candle tensors on the candle
    /// device, converted to the compute dtype, for every later forward: fetched once here, never
    /// again; the others are streamed. Their memory is candle's, beside the store's Device tier:
    /// on a GPU, budget the two together ([`OutOfCoreLlama::blocks_within`] counts what fits).
    pub fn with_resident(mut self, k: usize) -> candle_core::Result<OutOfCoreLlama> {
        let k = k.min(self.blocks.len());
        let mut resident = Vec::with_capacity(k);
        for l in 0..k {
            resident.push(self.block(l, &[])?);
        }
        self.resident = resident;
        Ok(self)
    }

    /// How many first blocks' weights, in the compute dtype, fit in `bytes`: the `k` for
    /// [`OutOfCoreLlama::with_resident`] that a device budget allows.
    pub fn blocks_within(&self, bytes: u64) -> usize {
        let per_block = self.config.block_parameters() * compute_size(self.dtype);
        if per_block == 0 {
            return self.blocks.len();
        }
        ((bytes / per_block) as usize).min(self.blocks.len())
    }

    fn refs(names: &[String]) -> Vec<&str> {
        names.iter().map(String::as_str).collect()
    }

    /// Block `l`'s weights in the compute dtype, with its adapters: resident, or fetched
    /// (`next` prefetched).
    fn block(&self, l: usize, next: &[&str]) -> candle_core::Result<BlockWeights> {
        let mut bw = match self.resident.get(l) {
            Some(w) => {
                self.layers.prefetch(next)?;
                w.clone()
            }
            None => {
                let w = self.layers.fetch(&Self::refs(&self.blocks[l]), next)?;
                let p = LlamaConfig::block_prefix(l);
                BlockWeights::from_fn(&self.config, |s| {
                    let name = format!("{p}{s}");
                    w.get(&name)
                        .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name }.bt())?
                        .to_dtype(self.dtype)
                })?
            }
        };
        if let Some(a) = self.adapters.get(l).filter(|a| !a.is_empty()) {
            bw.adapters = a.clone();
        }
        Ok(bw)
    }

    /// The names prefetched after stage `s` (0..blocks: block `s`; `blocks`: the head): the
    /// next stage's, and after the head the first block's (for the next call).
    fn next_names(&self, s: usize) -> Vec<&str> {
        let n = self.blocks.len();
        match s {
            s if s + 1 < n => Self::refs(&self.blocks[s + 1]),
            s if s + 1 == n => Self::refs(&self.head),
            _ => self.blocks.first().map(|b| Self::refs(b)).unwrap_or_default(),
        }
    }

    /// A device view of a KV tensor; `None` when the Device tier cannot hold it now.
    fn kv_view(&self, id: TensorId, name: &str) -> candle_core::Result<Option<DeviceView>> {
        let store = self.layers.store();
        match wait_for_writer(|| store.device_view(id, self.layers.stream())) {
            Ok(v) => Ok(Some(v)),
            Err(crate::Error::TooLarge { .. } | crate::Error::OutOfMemory { .. }) => Ok(None),
            Err(e) => Err(strata_err(name, e)),
        }
    }

    /// The positions `0..len` of a KV tensor, `[batch, kv_heads, len, head_dim]`.
    fn read_kv(
        &self,
        cache: &StoreKvCache,
        id: TensorId,
        name: &str,
    ) -> candle_core::Result<Tensor> {
        let [_, b, h, d] = cache.shape;
        let len = cache.len;
        let sdtype = compute_dtype(cache.dtype)?;
        let n = len * b * h * d * sdtype.size_of();
        let dev = self.layers.device();
        let t = match (self.kv_view(id, name)?, dev) {
            #[cfg(feature = "candle-cuda")]
            // Only the filled positions are copied (the first bytes: position-major).
            (Some(view), Device::Cuda(cuda)) => {
                super::cuda::view_to_candle(&view, cuda, cache.dtype, &[len, b, h, d], false)?
            }
            (Some(view), _) => view
                .with_host_bytes(|bytes| {
                    tensor_from_bytes(name, &bytes[..n], sdtype, &[len, b, h, d], dev, false)
                })
                .map_err(|e| strata_err(name, e))??,
            (None, _) => {
                let bytes = wait_for_writer(|| self.layers.store().read_in_place(id))
                    .map_err(|e| strata_err(name, e))?;
                tensor_from_bytes(name, &bytes[..n], sdtype, &[len, b, h, d], dev, false)?
            }
        };
        t.permute((1, 2, 0, 3))?.contiguous()
    }

    /// Writes `new` (`[batch, kv_heads, seq, head_dim]`) at positions `len..len + seq` of a KV
    /// tensor, in place.
    fn write_kv(
        &self,
        cache: &StoreKvCache,
        id: TensorId,
        name: &str,
        new: &Tensor,
    ) -> candle_core::Result<()> {
        let [_, b, h, d] = cache.shape;
        let new = new.permute((2, 0, 1, 3))?.contiguous()?; // [seq, batch, kv_heads, head_dim]
        let start = cache.len * b * h * d;
        let esize = compute_dtype(cache.dtype)?.size_of();
        let store = self.layers.store();
        match self.kv_view(id, name)? {
            Some(mut view) => {
                match self.layers.device() {
                    #[cfg(feature = "candle-cuda")]
                    Device::Cuda(cuda) => {
                        super::cuda::candle_into_view(&new, &mut view, start, cuda)
                            .map_err(|e| e.context(format!("writing tensor {name}")))?
                    }
                    _ => with_cpu_bytes(name, &new, |bytes| {
                        view.with_host_bytes_mut(|all| {
                            all[start * esize..start * esize + bytes.len()].copy_from_slice(bytes)
                        })
                    })?
                    .map_err(|e| strata_err(name, e))?,
                }
                view.mark_dirty();
            }
            None => {
                let mut all =
                    wait_for_writer(|| store.read_in_place(id)).map_err(|e| strata_err(name, e))?;
                // (a CUDA tensor's values come to the host first: the tier has no room for a view)
                let host = new.to_device(&Device::Cpu)?;
                with_cpu_bytes(name, &host, |bytes| {
                    all[start * esize..start * esize + bytes.len()].copy_from_slice(bytes)
                })?;
                wait_for_writer(|| store.write(id, &all)).map_err(|e| strata_err(name, e))?;
            }
        }
        Ok(())
    }
}

impl OutOfCoreLlama {
    /// The forward of each `ids[i]` after what `caches[i]` holds, in one pass over the
    /// weights: each block is fetched once (the next block's weights and every sequence's
    /// next KV tensors prefetched), run on every sequence, released. Each sequence's ops are
    /// the ones a forward of it alone runs, on the same values: its logits are the same, bit
    /// for bit.
    fn pass(
        &self,
        ids: &[Tensor],
        caches: &mut [StoreKvCache],
    ) -> candle_core::Result<Vec<Tensor>> {
        one_cache_each(ids.len(), caches.len())?;
        let c = &self.config;
        let mut shapes = Vec::with_capacity(ids.len());
        let mut rows: Vec<usize> = Vec::new();
        for (ids, cache) in ids.iter().zip(caches.iter()) {
            if !Arc::ptr_eq(&cache.store, self.layers.store()) {
                candle_core::bail!("a KV cache of another store");
            }
            shapes.push(check_ids(ids, cache.batch, cache.len, cache.capacity)?);
            rows.extend(ids.flatten_all()?.to_vec1::<u32>()?.iter().map(|&i| i as usize));
        }
        if let Some(bad) = rows.iter().find(|&&r| r >= c.vocab_size) {
            candle_core::bail!("token id {bad} past the vocabulary of {}", c.vocab_size);
        }
        // The embedding: the rows every sequence uses, gathered on the host at once.
        let table = self.layers.gather_rows(EMBED, &rows)?.to_dtype(self.dtype)?;
        let mut xs = Vec::with_capacity(ids.len());
        let mut at = 0;
        for &(b, s) in &shapes {
            xs.push(table.narrow(0, at, b * s)?.reshape((b, s, c.hidden_size))?);
            at += b * s;
        }
        drop(table);
        for l in 0..self.blocks.len() {
            let next = self.next_names(l);
            let w = self.block(l, &next)?;
            let next_kv: Vec<TensorId> = caches
                .iter()
                .filter_map(|k| k.ids.get(l + 1))
                .flat_map(|kv| [kv[0].0, kv[1].0])
                .collect();
            self.layers.prefetch_ids(&next_kv)?;
            for ((x, cache), &(_, s)) in xs.iter_mut().zip(caches.iter()).zip(&shapes) {
                let offset = cache.len;
                let [(k_id, k_name), (v_id, v_name)] = &cache.ids[l];
                let held = match offset {
                    0 => None,
                    _ => Some((
                        self.read_kv(cache, *k_id, k_name)?,
                        self.read_kv(cache, *v_id, v_name)?,
                    )),
                };
                let mut kv = KvCache::from_tensors(held)?;
                *x = block_forward(c, &w, x, &cache.rope, offset, Some(&mut kv))?;
                let (k, v) = kv.tensors().expect("filled by the forward");
                self.write_kv(cache, *k_id, k_name, &k.narrow(2, offset, s)?)?;
                self.write_kv(cache, *v_id, v_name, &v.narrow(2, offset, s)?)?;
                let store = self.layers.store();
                store.release(&[*k_id, *v_id]).map_err(|e| strata_err(k_name, e))?;
            }
        }
        let next = self.next_names(self.blocks.len());
        let w = self.layers.fetch(&Self::refs(&self.head), &next)?;
        let get = |name: &str| -> candle_core::Result<Tensor> {
            w.get(name)
                .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.into() }.bt())?
                .to_dtype(self.dtype)
        };
        let (norm, head) = (get(&self.head[0])?, get(&self.head[1])?);
        let logits = xs
            .iter()
            .zip(&shapes)
            .map(|(x, &(_, s))| head_logits(c, &x.narrow(1, s - 1, 1)?, &norm, &head))
            .collect::<candle_core::Result<Vec<_>>>()?;
        // Every cache holds its new positions only once the whole pass has succeeded.
        for (cache, &(_, s)) in caches.iter_mut().zip(&shapes) {
            cache.len += s;
        }
        Ok(logits)
    }
}

impl CausalLm for OutOfCoreLlama {
    type Cache = StoreKvCache;

    /// A cache in the model's store: `2 · blocks` tensors of
    /// `capacity · batch · kv_heads · head_dim` elements of the compute dtype, zeros, homed in
    /// host memory (Pinned when it has room).
    fn new_cache(&self, batch: usize, capacity: usize) -> candle_core::Result<StoreKvCache> {
        if batch == 0 {
            candle_core::bail!("a KV cache of 0 sequences");
        }
        let sdtype = compute_dtype(self.dtype)?;
        check_capacity(&self.config, batch, capacity, sdtype.size_of())?;
        let c = &self.config;
        let shape = [capacity, batch, c.num_key_value_heads, c.head_dim];
        let zeros = vec![0u8; shape.iter().product::<usize>() * sdtype.size_of()];
        let serial = CACHES.fetch_add(1, Ordering::Relaxed);
        let store = self.layers.store().clone();
        let mut cache = StoreKvCache {
            store: store.clone(),
            ids: Vec::with_capacity(c.num_hidden_layers),
            batch,
            capacity,
            len: 0,
            dtype: self.dtype,
            shape,
            rope: Rope::new(c, capacity, self.layers.device())?,
        };
        for l in 0..c.num_hidden_layers {
            let mut pair = Vec::with_capacity(2);
            for part in ["keys", "values"] {
                let name = format!("kv-cache.{serial}.layers.{l}.{part}");
                let id = super::train::put_host(
                    &store,
                    &name,
                    Group::Activation,
                    sdtype,
                    &shape,
                    &zeros,
                )
                .map_err(|e| strata_err(&name, e))?;
                pair.push((id, name));
            }
            let [k, v]: [(TensorId, String); 2] = pair.try_into().expect("two");
            cache.ids.push([k, v]); // on a failure, the drop removes what was put
        }
        Ok(cache)
    }

    fn forward(&self, ids: &Tensor, cache: &mut StoreKvCache) -> candle_core::Result<Tensor> {
        let mut logits = self.pass(std::slice::from_ref(ids), std::slice::from_mut(cache))?;
        Ok(logits.pop().expect("one sequence, one logits"))
    }

    /// One pass over the weights for every sequence: each block's weights are fetched once
    /// and run on each sequence in turn (with its own cache and positions), then released.
    fn forward_each(
        &self,
        ids: &[Tensor],
        caches: &mut [StoreKvCache],
    ) -> candle_core::Result<Vec<Tensor>> {
        self.pass(ids, caches)
    }

    fn device(&self) -> &Device {
        self.layers.device()
    }
}
