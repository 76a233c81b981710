//! A Llama-architecture decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP,
//! tied or untied embeddings) whose every op has a gradient, so that candle's autograd can train
//! it. [`block_forward`] runs the fused ops of [`super::fused`] (attention that never builds a
//! `seq × seq` tensor, RMSNorm, RoPE and SwiGLU each one op with its own backward; no mask
//! built on the host); [`Compute::Decomposed`] runs the same block in plain candle ops (the
//! softmax, the norm and the rotation written out: candle-nn's fused `softmax_last_dim`,
//! `rms_norm` and `rotary_emb` have no backward), the fused ops' reference.
//!
//! The model is cut in stages that a trainer runs one at a time: the embedding
//! ([`embed`]), each block ([`block_forward`]), and the head ([`head_logits`] then
//! [`next_token_loss`]). Each stage is a function of its input and its weights only, so the
//! same code runs a whole model in memory ([`LlamaTwin`](super::LlamaTwin)), stage by
//! stage out of core ([`Trainer`](super::Trainer)), and, with a [`KvCache`], one new
//! token at a time for generation.
//!
//! Tensor names are Hugging Face's (`model.layers.3.self_attn.q_proj.weight`, ...):
//! [`LlamaConfig::tensors`] lists them with their shapes.

use std::collections::HashMap;

use candle_core::{DType as CDType, Device, Tensor, D};

use super::fused;
use super::linear::{Adapter, GradBuffer, JointLinear, Weights};
use super::llama_config::LlamaConfig;
pub use super::llama_config::{BLOCK_BIASES, BLOCK_TENSORS, EMBED, LM_HEAD, NORM};

/// A seeded generator (SplitMix64) for initial weights and synthetic tokens: the same seed gives
/// the same numbers on every machine.
#[derive(Clone, Debug)]
pub struct SeededRng(u64);

impl SeededRng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> SeededRng {
        SeededRng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Normal with mean 0 and deviation `std` (Box-Muller).
    pub fn normal(&mut self, std: f64) -> f64 {
        let u1 = 1.0 - self.uniform();
        let u2 = self.uniform();
        std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// Elements per chunk of a random tensor: each chunk has a generator of its own, seeded from
/// the seed, the tensor's place and the chunk's, so chunks fill on parallel threads and the
/// values do not depend on how many there are.
const INIT_CHUNK: usize = 1 << 16;

/// Random values of tensor number `index` of a model (its place in [`LlamaConfig::tensors`]) of
/// `shape`, as Hugging Face initialises a Llama: a matrix normal with deviation 0.02
/// (`initializer_range`; Box-Muller, both values of each pair used), a vector (a norm) ones.
/// Filled on every core; the same seed gives the same values on every machine.
pub fn random_tensor(seed: u64, index: usize, shape: &[usize]) -> Vec<f32> {
    let n: usize = shape.iter().product();
    if shape.len() < 2 {
        return vec![1.0; n];
    }
    let mut v = vec![0f32; n];
    let fill = |c: usize, chunk: &mut [f32]| {
        let mixed = seed ^ (index as u64).wrapping_mul(0xA24B_AED4_963E_E407) ^ ((c as u64) << 1);
        let mut rng = SeededRng::new(SeededRng::new(mixed).next_u64());
        for pair in chunk.chunks_mut(2) {
            let r = 0.02 * (-2.0 * (1.0 - rng.uniform()).ln()).sqrt();
            let a = 2.0 * std::f64::consts::PI * rng.uniform();
            pair[0] = (r * a.cos()) as f32;
            if let Some(x) = pair.get_mut(1) {
                *x = (r * a.sin()) as f32;
            }
        }
    };
    let chunks: Vec<(usize, &mut [f32])> = v.chunks_mut(INIT_CHUNK).enumerate().collect();
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get()).min(chunks.len());
    if threads <= 1 {
        chunks.into_iter().for_each(|(c, chunk)| fill(c, chunk));
    } else {
        let per = chunks.len().div_ceil(threads);
        let mut groups: Vec<Vec<(usize, &mut [f32])>> = Vec::new();
        for (i, ch) in chunks.into_iter().enumerate() {
            if i % per == 0 {
                groups.push(Vec::new());
            }
            groups.last_mut().expect("a group").push(ch);
        }
        std::thread::scope(|s| {
            for g in groups {
                let fill = &fill;
                s.spawn(move || g.into_iter().for_each(|(c, chunk)| fill(c, chunk)));
            }
        });
    }
    v
}

/// Random initial weights of `config` ([`random_tensor`] of each; biases zeros, as Hugging Face
/// initialises them), `(name, shape, values)` in [`LlamaConfig::tensors`]' order, one tensor
/// at a time (a 7B model's f32 values are never all in memory at once).
pub fn random_weights(
    config: &LlamaConfig,
    seed: u64,
) -> impl Iterator<Item = (String, Vec<usize>, Vec<f32>)> {
    random_weights_of(config.tensors(), seed)
}

/// [`random_weights`] of any tensors (a model of a [`Block`](super::block::Block) of your own:
/// [`model_tensors`](super::block::model_tensors)), by their place in `tensors`.
pub fn random_weights_of(
    tensors: Vec<(String, Vec<usize>)>,
    seed: u64,
) -> impl Iterator<Item = (String, Vec<usize>, Vec<f32>)> {
    tensors.into_iter().enumerate().map(move |(i, (name, shape))| {
        let values = match name.ends_with(".bias") {
            true => vec![0.0; shape.iter().product()],
            false => random_tensor(seed, i, &shape),
        };
        (name, shape, values)
    })
}

/// The rotary tables, `cos` and `sin` of `[positions, head_dim]` in f32 (Hugging Face's
/// layout: the frequencies twice over, for `rotate_half`), computed as Hugging Face computes
/// them in f32, from [`LlamaConfig::rope_inverse_frequencies`] (the config's scaling applied).
#[derive(Clone, Debug)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    /// Tables for positions `0..positions` on `device`.
    pub fn new(
        config: &LlamaConfig,
        positions: usize,
        device: &Device,
    ) -> candle_core::Result<Rope> {
        let d = config.head_dim;
        let inv = config.rope_inverse_frequencies();
        let mut cos = Vec::with_capacity(positions * d);
        let mut sin = Vec::with_capacity(positions * d);
        for p in 0..positions {
            for _ in 0..2 {
                for &f in &inv {
                    let a = p as f32 * f;
                    cos.push(a.cos());
                    sin.push(a.sin());
                }
            }
        }
        Ok(Rope {
            cos: Tensor::from_vec(cos, (positions, d), device)?,
            sin: Tensor::from_vec(sin, (positions, d), device)?,
        })
    }

    /// Positions the tables cover.
    pub fn positions(&self) -> usize {
        self.cos.dims()[0]
    }

    /// [`Rope::apply`] as one fused op ([`fused::rope`]), for `x` of `[batch, seq, heads,
    /// head_dim]` (any strides: the heads as a linear layer's output reshaped), giving a
    /// contiguous `[batch, seq, heads, head_dim]`.
    pub fn apply_fused(&self, x: &Tensor, offset: usize) -> candle_core::Result<Tensor> {
        fused::rope(x, &self.cos, &self.sin, offset)
    }

    /// `x` (`[batch, heads, seq, head_dim]`) rotated for positions `offset..offset + seq`:
    /// `x · cos + rotate_half(x) · sin`, the tables cast to `x`'s dtype.
    pub fn apply(&self, x: &Tensor, offset: usize) -> candle_core::Result<Tensor> {
        let (_, _, s, d) = x.dims4()?;
        if offset + s > self.positions() {
            candle_core::bail!(
                "positions {offset}..{} past the rotary tables' {} (max_position_embeddings)",
                offset + s,
                self.positions()
            );
        }
        let cos = self.cos.narrow(0, offset, s)?.to_dtype(x.dtype())?;
        let sin = self.sin.narrow(0, offset, s)?.to_dtype(x.dtype())?;
        let x1 = x.narrow(D::Minus1, 0, d / 2)?;
        let x2 = x.narrow(D::Minus1, d / 2, d / 2)?;
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        x.broadcast_mul(&cos)?.add(&rotated.broadcast_mul(&sin)?)
    }
}

/// The block's linears that read one input and run as one GEMM over their weights joined by
/// rows ([`JointLinear`]) under [`Compute::Fused`]: the q, k and v projections (of the first
/// norm's output), and the gate and up projections (of the second's). What
/// [`BlockWeights::join`] joins and [`LlamaBlock`](super::block::LlamaBlock) lists in
/// [`Block::joined_linears`](super::block::Block::joined_linears).
pub const JOINED_LINEARS: [&[&str]; 2] = [
    &[BLOCK_TENSORS[1], BLOCK_TENSORS[2], BLOCK_TENSORS[3]],
    &[BLOCK_TENSORS[6], BLOCK_TENSORS[7]],
];

/// One block's weights (candle tensors, or `Var`s' tensors for training), in the order of
/// [`BLOCK_TENSORS`], and the q/k/v biases of a config with them ([`BLOCK_BIASES`]).
#[derive(Clone, Debug)]
pub struct BlockWeights {
    /// `input_layernorm.weight`.
    pub input_norm: Tensor,
    /// `self_attn.q_proj.weight`.
    pub q: Tensor,
    /// `self_attn.k_proj.weight`.
    pub k: Tensor,
    /// `self_attn.v_proj.weight`.
    pub v: Tensor,
    /// `self_attn.o_proj.weight`.
    pub o: Tensor,
    /// `post_attention_layernorm.weight`.
    pub post_norm: Tensor,
    /// `mlp.gate_proj.weight`.
    pub gate: Tensor,
    /// `mlp.up_proj.weight`.
    pub up: Tensor,
    /// `mlp.down_proj.weight`.
    pub down: Tensor,
    /// `self_attn.q_proj.bias`, `k_proj.bias`, `v_proj.bias` ([`LlamaConfig::qkv_bias`]).
    pub qkv_bias: Option<[Tensor; 3]>,
    /// LoRA adapters on the projections, by their weight's name in [`BLOCK_TENSORS`]
    /// (`self_attn.q_proj.weight`): none unless a run adds them.
    pub adapters: HashMap<String, Adapter>,
    /// Gradient buffers of the projections, by their weight's name in [`BLOCK_TENSORS`]: the
    /// backward of such a projection adds its weight's gradient into the buffer
    /// ([`GradBuffer::linear`]). None unless a trainer adds them.
    pub grad_buffers: HashMap<String, GradBuffer>,
    /// The [`JOINED_LINEARS`] joined ([`BlockWeights::join`]; a trainer joins them when it
    /// stages the block): each one GEMM under [`Compute::Fused`]. None: one GEMM a projection.
    /// A joint is a copy made by [`BlockWeights::join`] and is not checked against the fields
    /// above: after replacing a joined weight or adding a gradient buffer, join again (or clear
    /// this), or the forward keeps using the old copy and the new buffer is never summed into.
    pub joints: Vec<JointLinear>,
}

impl BlockWeights {
    /// The weights from `get(suffix)` for each of [`LlamaConfig::block_suffixes`]: the
    /// [`BLOCK_TENSORS`], and the [`BLOCK_BIASES`] when `config` has them.
    ///
    /// ```
    /// use candle_core::{Device, Tensor};
    /// use strata::candle::llama::BlockWeights;
    /// let c = strata::candle::LlamaConfig::from_json(r#"{"model_type": "qwen2",
    ///     "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
    ///     "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10}"#)?;
    /// let shapes: std::collections::HashMap<_, _> = c.tensors().into_iter().collect();
    /// let w = BlockWeights::from_fn(&c, |s| {
    ///     Tensor::zeros(shapes[&format!("model.layers.0.{s}")].as_slice(), candle_core::DType::F32, &Device::Cpu)
    /// })?;
    /// assert!(w.qkv_bias.is_some());
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn from_fn(
        config: &LlamaConfig,
        mut get: impl FnMut(&str) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<BlockWeights> {
        let [input_norm, q, k, v, o, post_norm, gate, up, down] = BLOCK_TENSORS;
        let [qb, kb, vb] = BLOCK_BIASES;
        Ok(BlockWeights {
            input_norm: get(input_norm)?,
            q: get(q)?,
            k: get(k)?,
            v: get(v)?,
            o: get(o)?,
            post_norm: get(post_norm)?,
            gate: get(gate)?,
            up: get(up)?,
            down: get(down)?,
            qkv_bias: match config.qkv_bias {
                true => Some([get(qb)?, get(kb)?, get(vb)?]),
                false => None,
            },
            adapters: HashMap::new(),
            grad_buffers: HashMap::new(),
            joints: Vec::new(),
        })
    }

    /// The weights of a [`Weights`] (a [`Block`](super::block::Block)'s view of them), its
    /// adapters, gradient buffers and joints included.
    pub fn from_weights(config: &LlamaConfig, w: &Weights) -> candle_core::Result<BlockWeights> {
        let mut bw = Self::from_fn(config, |s| w.get(s).cloned())?;
        bw.adapters = w.adapters().clone();
        bw.grad_buffers = w.grad_buffers().clone();
        bw.joints = w.joints().to_vec();
        Ok(bw)
    }

    /// These weights with each of [`JOINED_LINEARS`] joined ([`JointLinear`]: a copy of the
    /// group's weights as one matrix, their gradient buffers joined when they are the parts of
    /// one, [`GradBuffer::split`]), so that the fused forward makes two GEMMs of the normed
    /// inputs where it made five. A group that cannot be joined ([`JointLinear::new`]: weights
    /// of two dtypes, `Var`s, buffers on some only) stays apart. Join after adding gradient
    /// buffers: the joints take the buffers they find.
    pub fn join(mut self) -> candle_core::Result<BlockWeights> {
        let mut joints = Vec::with_capacity(JOINED_LINEARS.len());
        for names in JOINED_LINEARS {
            let mut parts = Vec::with_capacity(names.len());
            for &n in names {
                parts.push((n, self.weight(n)?, self.grad_buffers.get(n)));
            }
            joints.extend(JointLinear::new(&parts)?);
        }
        self.joints = joints;
        Ok(self)
    }

    /// The projection weight named `name` in [`BLOCK_TENSORS`].
    fn weight(&self, name: &str) -> candle_core::Result<&Tensor> {
        let [_, qn, kn, vn, on, _, gn, un, dn] = BLOCK_TENSORS;
        Ok(match name {
            n if n == qn => &self.q,
            n if n == kn => &self.k,
            n if n == vn => &self.v,
            n if n == on => &self.o,
            n if n == gn => &self.gate,
            n if n == un => &self.up,
            n if n == dn => &self.down,
            _ => candle_core::bail!("{name}: not a projection of a Llama block"),
        })
    }

    /// The joint of the projections `names` when `compute` is fused and the block has one.
    fn joint(&self, compute: Compute, names: &[&str]) -> Option<&JointLinear> {
        let same =
            |j: &&JointLinear| j.names().iter().map(String::as_str).eq(names.iter().copied());
        self.joints.iter().find(same).filter(|_| compute == Compute::Fused)
    }

    /// The projection whose weight is `w`, named `name` in [`BLOCK_TENSORS`], of `x`, with its
    /// adapter when it has one; its weight's gradient summed into its buffer when it has one.
    fn project(&self, name: &str, w: &Tensor, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = match self.grad_buffers.get(name) {
            Some(g) => {
                x.dims3()?;
                g.linear(x, w)?
            }
            None => linear(x, w)?,
        };
        self.adapted(name, y, x)
    }

    /// `y`, projection `name`'s output for `x`, with its adapter's share when it has one.
    fn adapted(&self, name: &str, y: Tensor, x: &Tensor) -> candle_core::Result<Tensor> {
        match self.adapters.get(name) {
            Some(a) => a.add_to(y, x),
            None => Ok(y),
        }
    }

    /// The queries, keys and values of `n` (`[batch, seq, hidden]`, the first norm's output):
    /// `[batch, seq, heads, head_dim]` each, with their adapters and biases. Joined, one GEMM
    /// whose output, seen as `[batch, seq, heads + 2 · kv_heads, head_dim]`, is split along the
    /// heads: views with the joint's strides, which the fused RoPE (q, k) and attention (v) read
    /// in place; a part with an adapter or a bias is split by columns and gets them added (into
    /// a new contiguous tensor). Else three GEMMs, each output contiguous.
    fn qkv(
        &self,
        compute: Compute,
        config: &LlamaConfig,
        n: &Tensor,
    ) -> candle_core::Result<[Tensor; 3]> {
        let (b, s, _) = n.dims3()?;
        let (nh, nkv, hd) =
            (config.num_attention_heads, config.num_key_value_heads, config.head_dim);
        let [_, qn, kn, vn, ..] = BLOCK_TENSORS;
        let (names, heads, first) = ([qn, kn, vn], [nh, nkv, nkv], [0, nh, nh + nkv]);
        let Some(j) = self.joint(compute, &names) else {
            let w = [&self.q, &self.k, &self.v];
            let part = |i: usize| {
                let y = self.add_bias(self.project(names[i], w[i], n)?, i)?;
                y.reshape((b, s, heads[i], hd))
            };
            return Ok([part(0)?, part(1)?, part(2)?]);
        };
        if j.outs() != [nh * hd, nkv * hd, nkv * hd] {
            candle_core::bail!(
                "q, k and v projections of {:?} rows for {nh} query heads and {nkv} key/value \
                 heads of {hd}",
                j.outs()
            );
        }
        let y = j.forward(n)?;
        let all = y.reshape((b, s, nh + 2 * nkv, hd))?;
        let part = |i: usize| {
            if !self.adapters.contains_key(names[i]) && self.qkv_bias.is_none() {
                return all.narrow(2, first[i], heads[i]);
            }
            let yi = y.narrow(D::Minus1, first[i] * hd, heads[i] * hd)?;
            self.add_bias(self.adapted(names[i], yi, n)?, i)?.reshape((b, s, heads[i], hd))
        };
        Ok([part(0)?, part(1)?, part(2)?])
    }

    /// SwiGLU's gate of `n` (the second norm's output), `silu(gate(n)) · up(n)`, the gate and
    /// up projections with their adapters. Joined without adapters: one GEMM over their joint
    /// weight and the fused SwiGLU reading its output in place ([`fused::swiglu_joined`]: no
    /// copy of either half, and the backward hands the joint GEMM its gradient whole). Joined
    /// with an adapter on either: the joint's output split by columns (strided views: the fused
    /// SwiGLU copies each into a contiguous tensor, an adapter's add writes a new one). Else two
    /// GEMMs.
    fn gated(&self, compute: Compute, n: &Tensor) -> candle_core::Result<Tensor> {
        let [.., gn, un, _] = BLOCK_TENSORS;
        let [gate, up] = match self.joint(compute, &[gn, un]) {
            Some(j) => {
                let plain = !self.adapters.contains_key(gn) && !self.adapters.contains_key(un);
                if plain && matches!(j.outs(), [g, u] if g == u) {
                    return fused::swiglu_joined(&j.forward(n)?);
                }
                let [g, u]: [Tensor; 2] = j.apply(n)?.try_into().map_err(|_| {
                    candle_core::Error::Msg("a gate/up joint of other than two parts".into())
                })?;
                [self.adapted(gn, g, n)?, self.adapted(un, u, n)?]
            }
            None => [self.project(gn, &self.gate, n)?, self.project(un, &self.up, n)?],
        };
        match compute {
            Compute::Fused => fused::swiglu(&gate, &up),
            Compute::Decomposed => gate.silu()?.mul(&up),
        }
    }

    /// The bias of projection `i` (0: q, 1: k, 2: v) added to `y`, when there is one. In f32
    /// for 16-bit values (the same sums, rounded once), so that the bias's gradient, the sum of
    /// `y`'s over the batch and the positions, is summed in f32.
    fn add_bias(&self, y: Tensor, i: usize) -> candle_core::Result<Tensor> {
        match &self.qkv_bias {
            Some(b) if y.dtype() == CDType::F32 => y.broadcast_add(&b[i]),
            Some(b) => y
                .to_dtype(CDType::F32)?
                .broadcast_add(&b[i].to_dtype(CDType::F32)?)?
                .to_dtype(y.dtype()),
            None => Ok(y),
        }
    }
}

/// The keys and values of the positions a block has seen (after RoPE, before the heads are
/// repeated), for generating one token at a time: [`block_forward`] appends the new positions'
/// and attends over all of them.
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
}

impl KvCache {
    /// An empty cache.
    pub fn new() -> KvCache {
        KvCache::default()
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.k.as_ref().map_or(0, |k| k.dims()[2])
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The keys and values, `[batch, kv_heads, positions, head_dim]` each.
    pub fn tensors(&self) -> Option<(&Tensor, &Tensor)> {
        Some((self.k.as_ref()?, self.v.as_ref()?))
    }

    /// A cache holding these keys and values (`[batch, kv_heads, positions, head_dim]` each,
    /// of one shape), or an empty one for `None`.
    pub fn from_tensors(kv: Option<(Tensor, Tensor)>) -> candle_core::Result<KvCache> {
        match kv {
            None => Ok(KvCache::new()),
            Some((k, v)) => {
                if k.dims() != v.dims() || k.rank() != 4 {
                    candle_core::bail!(
                        "a KV cache of keys {:?} and values {:?}: one shape of 4 dimensions",
                        k.dims(),
                        v.dims()
                    );
                }
                Ok(KvCache { k: Some(k), v: Some(v) })
            }
        }
    }
}

/// RMSNorm as Hugging Face's `LlamaRMSNorm`: in f32, `x / sqrt(mean(x²) + eps)`, cast back to
/// `x`'s dtype, times the weight.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let dtype = x.dtype();
    let xf = x.to_dtype(CDType::F32)?;
    let inv = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    xf.broadcast_mul(&inv)?.to_dtype(dtype)?.broadcast_mul(weight)
}

/// `x · wᵀ` for `x` of `[batch, seq, in]` and a weight of `[out, in]`; a weight without a
/// gradient gets none computed ([`super::block::linear`]).
pub fn linear(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    x.dims3()?;
    super::linear::linear(x, w)
}

/// Softmax over the last dimension in f32, with the row maximum taken out first (detached: the
/// softmax does not depend on it, so no gradient flows through it).
pub fn softmax_last_dim(x: &Tensor) -> candle_core::Result<Tensor> {
    let dtype = x.dtype();
    let xf = x.to_dtype(CDType::F32)?;
    let max = xf.max_keepdim(D::Minus1)?.detach();
    let e = xf.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?.to_dtype(dtype)
}

/// `[batch, heads, seq, d]` with each key/value head repeated `n` times, as Hugging Face's
/// `repeat_kv` orders them (the decomposed attention's; the fused one reads each key/value head
/// in place for its group of query heads).
fn repeat_kv(x: &Tensor, n: usize) -> candle_core::Result<Tensor> {
    if n == 1 {
        return Ok(x.clone());
    }
    let (b, h, s, d) = x.dims4()?;
    Tensor::cat(&vec![x; n], 2)?.reshape((b, h * n, s, d))
}

/// The additive causal mask of `seq` queries at positions `offset..offset + seq` over
/// `offset + seq` keys: 0 where a query may look, -inf after it and, with a `window`, `window`
/// or more positions before it. Built on the host: the decomposed attention's (the reference);
/// the fused attention applies the mask inside its tiles.
fn causal_mask(
    seq: usize,
    offset: usize,
    window: Option<usize>,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let keys = offset + seq;
    let w = window.unwrap_or(usize::MAX);
    let m: Vec<f32> = (0..seq)
        .flat_map(|i| {
            let p = offset + i;
            (0..keys).map(move |j| if j > p || p - j >= w { f32::NEG_INFINITY } else { 0.0 })
        })
        .collect();
    Tensor::from_vec(m, (seq, keys), device)
}

/// How [`block_forward_with`] computes a block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compute {
    /// The fused ops of [`super::fused`]: attention FlashAttention-style (no `seq × seq`
    /// tensor, the causal mask inside its tiles, the key/value heads read in place for their
    /// query heads), RMSNorm (the post-attention one with the residual add before it), RoPE and
    /// SwiGLU each one op with its own backward; and, with the block's joints
    /// ([`BlockWeights::joints`]), q/k/v one GEMM and gate/up one GEMM. What the trainer, its
    /// in-memory twin and generation run.
    #[default]
    Fused,
    /// Plain candle ops (the scores and the softmax materialized, the mask built on the host,
    /// the key/value heads repeated, one GEMM a projection whatever the joints): the fused ops'
    /// reference in the tests.
    Decomposed,
}

/// One decoder block: `h = x + attention(rms_norm(x))`, `y = h + mlp(rms_norm(h))`, for `x` of
/// `[batch, seq, hidden]` at positions `offset..offset + seq`. With a cache, the block attends
/// over the cached positions too and appends these (`offset` must then be the cache's length);
/// without, over these positions only (training: `offset` 0). A query attends to the positions
/// up to its own, within the config's sliding window if it has one. Every op has a gradient.
/// The fused ops ([`Compute::Fused`]); [`block_forward_with`] chooses.
pub fn block_forward(
    config: &LlamaConfig,
    w: &BlockWeights,
    x: &Tensor,
    rope: &Rope,
    offset: usize,
    cache: Option<&mut KvCache>,
) -> candle_core::Result<Tensor> {
    block_forward_with(Compute::Fused, config, w, x, rope, offset, cache)
}

/// [`block_forward`] computed as `compute` says.
///
/// The block's GEMMs: seven linears, each one GEMM forward and, in the backward, one `dX` GEMM
/// and (a trained weight) one `dW` GEMM. Under [`Compute::Fused`] with the block's joints
/// ([`BlockWeights::join`]; the trainer and its twin join when they stage a block), the five
/// projections of the normed inputs are two GEMMs, `[Wq; Wk; Wv]` and `[Wgate; Wup]`: 7 → 4
/// forward GEMMs (launches) per block and micro-batch, and as many `dX` and `dW` GEMMs
/// backward (each part's gradient a row range of the joint buffer). Q, k and v are split by
/// views ([`BlockWeights`]' `qkv`), and candle's autograd pads each part's output gradient back
/// to the joint's width (a zeros, a concatenation and an add per part, element-wise work on the
/// joint output's size) where three separate `dX`s were added instead; gate and up are read in
/// place by [`fused::swiglu_joined`], whose backward gives the joint's gradient whole (split by
/// columns, as q, k and v are, where either has an adapter).
pub fn block_forward_with(
    compute: Compute,
    config: &LlamaConfig,
    w: &BlockWeights,
    x: &Tensor,
    rope: &Rope,
    offset: usize,
    cache: Option<&mut KvCache>,
) -> candle_core::Result<Tensor> {
    let (b, s, _) = x.dims3()?;
    let (nh, hd) = (config.num_attention_heads, config.head_dim);
    let eps = config.rms_norm_eps;
    let norm = |x: &Tensor, w: &Tensor| match compute {
        Compute::Fused => fused::rms_norm(x, w, eps),
        Compute::Decomposed => rms_norm(x, w, eps),
    };

    let [.., on, _, _, _, dn] = BLOCK_TENSORS;
    let n = norm(x, &w.input_norm)?;
    let [q, k, v] = w.qkv(compute, config, &n)?;
    let attn = match compute {
        Compute::Fused => fused_attention(config, rope, &q, &k, &v, offset, cache)?,
        Compute::Decomposed => decomposed_attention(config, rope, &q, &k, &v, offset, cache)?,
    };
    let o = w.project(on, &w.o, &attn.reshape((b, s, nh * hd))?)?;
    // The residual add and the norm that reads its result: one pass when fused.
    let (h, n) = match compute {
        Compute::Fused => fused::add_rms_norm(x, &o, &w.post_norm, eps)?,
        Compute::Decomposed => {
            let h = x.add(&o)?;
            let n = rms_norm(&h, &w.post_norm, eps)?;
            (h, n)
        }
    };
    let act = w.gated(compute, &n)?;
    h.add(&w.project(dn, &w.down, &act)?)
}

/// Appends keys and values (`[batch, kv_heads, seq, head_dim]`) to `cache` when there is one
/// (checking that it holds `offset` positions), giving those to attend over.
fn cached(
    cache: Option<&mut KvCache>,
    offset: usize,
    k: Tensor,
    v: Tensor,
) -> candle_core::Result<(Tensor, Tensor)> {
    let Some(c) = cache else { return Ok((k, v)) };
    if c.len() != offset {
        candle_core::bail!(
            "a KV cache of {} positions for a forward at position {offset}",
            c.len()
        );
    }
    let (k, v) = match (&c.k, &c.v) {
        (Some(pk), Some(pv)) => (Tensor::cat(&[pk, &k], 2)?, Tensor::cat(&[pv, &v], 2)?),
        _ => (k.contiguous()?, v.contiguous()?),
    };
    c.k = Some(k.clone());
    c.v = Some(v.clone());
    Ok((k, v))
}

/// The attention of `[batch, seq, heads, head_dim]` projections with the fused ops: RoPE, then
/// [`fused::block_attention`] (strata's kernel, or cuDNN's on CUDA where it applies: the
/// process's [`fused::attention_kernel`]) reading the keys and values (the cache's included) in
/// place. Gives `[batch, seq, heads, head_dim]`.
fn fused_attention(
    config: &LlamaConfig,
    rope: &Rope,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    offset: usize,
    cache: Option<&mut KvCache>,
) -> candle_core::Result<Tensor> {
    let q = rope.apply_fused(q, offset)?;
    let k = rope.apply_fused(k, offset)?;
    let with_cache = cache.is_some();
    let (k, v) = match cache {
        None => (k, v.clone()),
        Some(c) => {
            let (k, v) = cached(Some(c), offset, k.transpose(1, 2)?, v.transpose(1, 2)?)?;
            (k.transpose(1, 2)?, v.transpose(1, 2)?)
        }
    };
    let scale = 1.0 / (config.head_dim as f64).sqrt();
    fused::block_attention(&q, &k, &v, scale, config.sliding_window, with_cache)
}

/// The same attention in plain candle ops: the heads transposed and made contiguous, RoPE
/// written out, the key/value heads repeated, the `seq × seq` scores masked and softmaxed.
fn decomposed_attention(
    config: &LlamaConfig,
    rope: &Rope,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    offset: usize,
    cache: Option<&mut KvCache>,
) -> candle_core::Result<Tensor> {
    let (nh, nkv, hd) = (config.num_attention_heads, config.num_key_value_heads, config.head_dim);
    let s = q.dims()[1];
    let heads = |t: &Tensor| t.transpose(1, 2)?.contiguous();
    let q = rope.apply(&heads(q)?, offset)?;
    let k = rope.apply(&heads(k)?, offset)?;
    let (k, v) = cached(cache, offset, k, heads(v)?)?;
    let k = repeat_kv(&k, nh / nkv)?;
    let v = repeat_kv(&v, nh / nkv)?;
    let scores = (q.matmul(&k.t()?)? * (1.0 / (hd as f64).sqrt()))?;
    let window = config.sliding_window.filter(|&w| offset + s > w);
    let scores = if s > 1 || window.is_some() {
        let mask = causal_mask(s, offset, window, q.device())?.to_dtype(scores.dtype())?;
        scores.broadcast_add(&mask)?
    } else {
        scores // one query at the newest position sees every key
    };
    softmax_last_dim(&scores)?.matmul(&v)?.transpose(1, 2)
}

/// The embedding of `ids` (`[batch, seq]`, u32): rows of `table`, `[batch, seq, hidden]`.
pub fn embed(table: &Tensor, ids: &Tensor) -> candle_core::Result<Tensor> {
    let (b, s) = ids.dims2()?;
    let h = table.dims2()?.1;
    table.index_select(&ids.flatten_all()?, 0)?.reshape((b, s, h))
}

/// The head: the final norm and the output projection (`head`: `lm_head.weight`, or the
/// embedding table when tied), giving f32 logits of `[batch · seq, vocab]`.
pub fn head_logits(
    config: &LlamaConfig,
    x: &Tensor,
    norm: &Tensor,
    head: &Tensor,
) -> candle_core::Result<Tensor> {
    let (b, s, _) = x.dims3()?;
    // Fused: one pass, and the weight's gradient summed over the positions in f32.
    let n = fused::rms_norm(x, norm, config.rms_norm_eps)?;
    linear(&n, head)?.reshape((b * s, head.dims2()?.0))?.to_dtype(CDType::F32)
}

/// Cross-entropy of `logits` (`[n, vocab]`, f32) against `targets` (`[n]`, u32), summed over
/// the rows and multiplied by `scale` (`1 / (n · micro-batches)`: the mean over a step's
/// tokens when the micro-batches' losses are added). A scalar with a gradient.
pub fn next_token_loss(
    logits: &Tensor,
    targets: &Tensor,
    scale: f64,
) -> candle_core::Result<Tensor> {
    next_token_loss_masked(logits, targets, None, scale)
}

/// [`next_token_loss`] counting only the targets whose `mask` (`[n]`, f32, each 0 or 1) is 1:
/// the others' log-probabilities are multiplied by 0, so they add nothing to the loss and get
/// no gradient. `scale` is then `1 / (targets counted over the step)`: instruction data with
/// the loss on the responses only. Without a mask, every target counts.
pub fn next_token_loss_masked(
    logits: &Tensor,
    targets: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
) -> candle_core::Result<Tensor> {
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let logp = shifted.broadcast_sub(&lse)?;
    let picked = logp.gather(&targets.unsqueeze(1)?.contiguous()?, 1)?;
    let picked = match mask {
        Some(m) => picked.squeeze(1)?.mul(m)?,
        None => picked,
    };
    picked.sum_all()?.neg()?.affine(scale, 0.0)
}

/// A micro-batch's inputs and next-token targets from `tokens` (`[batch, seq + 1]`, u32):
/// `tokens[:, :seq]` and `tokens[:, 1:]` flattened.
pub fn inputs_and_targets(tokens: &Tensor) -> candle_core::Result<(Tensor, Tensor)> {
    let (_, n) = tokens.dims2()?;
    if n < 2 {
        candle_core::bail!("a micro-batch of {n} tokens per row: at least 2 are needed");
    }
    let ids = tokens.narrow(1, 0, n - 1)?.contiguous()?;
    let targets = tokens.narrow(1, 1, n - 1)?.flatten_all()?.contiguous()?;
    Ok((ids, targets))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    fn randn(rng: &mut SeededRng, shape: &[usize], std: f64, mean: f32) -> Tensor {
        let v: Vec<f32> =
            (0..shape.iter().product()).map(|_| rng.normal(std) as f32 + mean).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// Block 0 of `config` with random weights (norms near 1, biases random too).
    fn block(config: &LlamaConfig, seed: u64) -> BlockWeights {
        let mut rng = SeededRng::new(seed);
        let shapes: HashMap<String, Vec<usize>> = config.tensors().into_iter().collect();
        let p = LlamaConfig::block_prefix(0);
        BlockWeights::from_fn(config, |s| {
            let shape = &shapes[&format!("{p}{s}")];
            let mean = if s.contains("norm") { 1.0 } else { 0.0 };
            Ok(randn(&mut rng, shape, 0.3, mean))
        })
        .unwrap()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
    }

    /// The largest `|a − b|` over the largest `|b|`.
    fn rel(a: &Tensor, b: &Tensor) -> f32 {
        let top = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
        let d = a.sub(b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap();
        d.to_scalar::<f32>().unwrap() / top.to_scalar::<f32>().unwrap()
    }

    fn config(json: &str) -> LlamaConfig {
        LlamaConfig::from_json(json).unwrap()
    }

    /// The projections' names, in [`BLOCK_TENSORS`]' order.
    fn projections() -> Vec<&'static str> {
        BLOCK_TENSORS.into_iter().filter(|n| n.ends_with("_proj.weight")).collect()
    }

    /// `(y, dx, the projections' weight gradients)` of `sum(y · r)` for the fused block, its
    /// projections trained through gradient buffers: one buffer a joined group when `joined`,
    /// else one a weight (and then [`BlockWeights::join`] must leave them apart).
    fn trained(
        c: &LlamaConfig,
        bw: &BlockWeights,
        x: &Tensor,
        r: &Tensor,
        joined: bool,
    ) -> (Tensor, Tensor, Vec<Tensor>) {
        let dev = Device::Cpu;
        let mut bw = bw.clone();
        let mut bufs: HashMap<String, GradBuffer> = HashMap::new();
        if joined {
            for group in JOINED_LINEARS {
                let shapes: Vec<(usize, usize)> =
                    group.iter().map(|n| bw.weight(n).unwrap().dims2().unwrap()).collect();
                let rows = shapes.iter().map(|s| s.0).sum();
                let outs: Vec<usize> = shapes.iter().map(|s| s.0).collect();
                let parts =
                    GradBuffer::zeros((rows, shapes[0].1), &dev).unwrap().split(&outs).unwrap();
                bufs.extend(group.iter().map(|n| n.to_string()).zip(parts));
            }
        }
        for n in projections() {
            if !bufs.contains_key(n) {
                let shape = bw.weight(n).unwrap().dims2().unwrap();
                bufs.insert(n.to_string(), GradBuffer::zeros(shape, &dev).unwrap());
            }
        }
        bw.grad_buffers = bufs.clone();
        let bw = bw.join().unwrap();
        assert_eq!(bw.joints.len(), if joined { 2 } else { 0 }, "separate buffers stay apart");
        let rope = Rope::new(c, x.dims()[1], &dev).unwrap();
        let xv = Var::from_tensor(x).unwrap();
        let y = block_forward(c, &bw, xv.as_tensor(), &rope, 0, None).unwrap();
        let g = y.mul(r).unwrap().sum_all().unwrap().backward().unwrap();
        let dw = projections().iter().map(|n| bufs[*n].tensor().clone()).collect();
        (y, g.get(&xv).unwrap().clone(), dw)
    }

    #[test]
    fn a_block_with_joined_projections_gives_the_separate_values_and_gradients() {
        let c = config(
            r#"{"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 10}"#,
        );
        let bw = block(&c, 3);
        let mut rng = SeededRng::new(4);
        let x = randn(&mut rng, &[2, 9, 32], 1.0, 0.0);
        let r = randn(&mut rng, &[2, 9, 32], 1.0, 0.0);
        let (jy, jdx, jdw) = trained(&c, &bw, &x, &r, true);
        let (sy, sdx, sdw) = trained(&c, &bw, &x, &r, false);
        // Two GEMMs where there were five: each output the same sum over the same inputs, but
        // the `gemm` crate picks its kernels by shape, and for some shapes (7 or 9 rows of 32
        // inputs) the joined and the separate GEMMs round differently: f32 rounding apart.
        assert!(rel(&jy, &sy) < 1e-5, "y: {}", rel(&jy, &sy));
        // The backward's dX of the joined GEMMs is one sum where two or three were added: f32
        // rounding apart, and so is everything upstream of it.
        assert!(rel(&jdx, &sdx) < 1e-5, "dx: {}", rel(&jdx, &sdx));
        for ((n, a), b) in projections().iter().zip(&jdw).zip(&sdw) {
            assert!(rel(a, b) < 1e-5, "{n}: {}", rel(a, b));
        }
        // The decomposed block (the reference) runs a GEMM a projection, joints or not.
        let rope = Rope::new(&c, 9, &Device::Cpu).unwrap();
        let decomposed = |w: &BlockWeights| {
            block_forward_with(Compute::Decomposed, &c, w, &x, &rope, 0, None).unwrap()
        };
        let joined = bw.clone().join().unwrap();
        assert_eq!(joined.joints.len(), 2);
        assert_eq!(bits(&decomposed(&joined)), bits(&decomposed(&bw)));
    }

    #[test]
    fn biases_and_adapters_are_added_to_each_part_after_the_split() {
        // Qwen2: q/k/v biases; LoRA adapters on q and up over a frozen base.
        let c = config(
            r#"{"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 48,
                "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 10}"#,
        );
        let mut rng = SeededRng::new(9);
        let mut vars = Vec::new();
        let mut var = |shape: &[usize]| {
            let v = Var::from_tensor(&randn(&mut rng, shape, 0.3, 0.0)).unwrap();
            vars.push(v.clone());
            v.as_tensor().clone()
        };
        let mut bw = block(&c, 8);
        let [_, qn, kn, vn, ..] = BLOCK_TENSORS;
        bw.qkv_bias = Some([var(&[32]), var(&[16]), var(&[16])]);
        for (n, out) in [(qn, 32), (BLOCK_TENSORS[7], 48)] {
            let adapter = Adapter { a: var(&[4, 32]), b: var(&[out, 4]), scale: 2.0 };
            bw.adapters.insert(n.to_string(), adapter);
        }
        let x = randn(&mut SeededRng::new(10), &[1, 7, 32], 1.0, 0.0);
        let rope = Rope::new(&c, 7, &Device::Cpu).unwrap();
        let run = |w: &BlockWeights| {
            let xv = Var::from_tensor(&x).unwrap();
            let y = block_forward(&c, w, xv.as_tensor(), &rope, 0, None).unwrap();
            let g = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
            let mut grads = vec![g.get(&xv).unwrap().clone()];
            grads.extend(vars.iter().map(|v| g.get(v).unwrap().clone()));
            (y, grads)
        };
        let joined = bw.clone().join().unwrap();
        let names: Vec<Vec<&str>> =
            joined.joints.iter().map(|j| j.names().iter().map(String::as_str).collect()).collect();
        assert_eq!(names, [vec![qn, kn, vn], vec![BLOCK_TENSORS[6], BLOCK_TENSORS[7]]]);
        assert!(joined.joints.iter().all(|j| !j.has_grads()), "a frozen base has no buffer");
        let ((jy, jg), (sy, sg)) = (run(&joined), run(&bw));
        assert!(rel(&jy, &sy) < 1e-5, "y: {}", rel(&jy, &sy));
        for (i, (a, b)) in jg.iter().zip(&sg).enumerate() {
            assert!(rel(a, b) < 1e-5, "gradient {i}: {}", rel(a, b));
        }
        // A bf16 v among f32 q and k: not joined, the block runs as before.
        let mut mixed = bw.clone();
        mixed.v = mixed.v.to_dtype(CDType::BF16).unwrap();
        assert_eq!(mixed.join().unwrap().joints.len(), 1, "gate/up joined, q/k/v apart");
    }
}
