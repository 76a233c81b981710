//! The trainer's unit: a block of your own ([`Block`]). The trainer and its in-memory twin run
//! a decoder made of an embedding table, `num_hidden_layers` blocks and a head (the final
//! RMSNorm and the output projection, tied or not); the blocks are whatever implements
//! [`Block`]: a forward from the block's named weights and its input, and the weights it has,
//! with their shapes. Out of core, recompute, gradients, LoRA adapters, save and resume then
//! work for it as they work for the built-in Llama block ([`LlamaBlock`]).
//!
//! A block calls [`Weights::linear`] for each of its linear layers: that is where a LoRA
//! adapter, when the run has one on that layer, adds its `scale · B·A·x` (PEFT's arithmetic),
//! where a frozen weight's gradient is left uncomputed ([`frozen_linear`]), and where a trained
//! weight's gradient is summed by the backward straight into the step's f32 buffer
//! ([`GradBuffer`]). The linears a block lists in [`Block::linears`] are those LoRA may adapt
//! and those the trainer gives a buffer (so a block must apply them through
//! [`Weights::linear`] only: the trainer refuses a step whose forward did not).
//!
//! A block of your own, copied from here (a pre-norm MLP block: LayerNorm with a bias, then a
//! GELU MLP, added to its input), trained out of core under a Device tier smaller than two
//! blocks:
//!
//! ```
//! # fn main() -> candle_core::Result<()> {
//! use std::sync::Arc;
//! use candle_core::{Device, Tensor, D};
//! use strata as st;
//! use st::candle::{put_random_tensors, LlamaConfig, TrainConfig, Trainer};
//! use st::candle::block::{model_tensors, Block, Weights};
//!
//! struct MlpBlock { hidden: usize, inner: usize }
//!
//! impl Block for MlpBlock {
//!     fn kind(&self) -> String { "mlp-block".into() }
//!     fn tensors(&self) -> Vec<(String, Vec<usize>)> {
//!         let (h, i) = (self.hidden, self.inner);
//!         vec![("ln.weight".into(), vec![h]), ("ln.bias".into(), vec![h]),
//!              ("fc.weight".into(), vec![i, h]), ("proj.weight".into(), vec![h, i])]
//!     }
//!     fn linears(&self) -> Vec<String> { vec!["fc.weight".into(), "proj.weight".into()] }
//!     fn forward(&self, _layer: usize, w: &Weights, x: &Tensor) -> candle_core::Result<Tensor> {
//!         // LayerNorm in ops that all have a backward.
//!         let mean = x.mean_keepdim(D::Minus1)?;
//!         let xc = x.broadcast_sub(&mean)?;
//!         let inv = (xc.sqr()?.mean_keepdim(D::Minus1)? + 1e-5)?.sqrt()?.recip()?;
//!         let n = xc.broadcast_mul(&inv)?.broadcast_mul(w.get("ln.weight")?)?.broadcast_add(w.get("ln.bias")?)?;
//!         x.add(&w.linear("proj.weight", &w.linear("fc.weight", &n)?.gelu()?)?)
//!     }
//! }
//!
//! // The skeleton around the blocks: vocabulary, width, number of blocks, tied embeddings.
//! let config = LlamaConfig::from_json(r#"{"hidden_size": 32, "intermediate_size": 64,
//!     "num_hidden_layers": 3, "num_attention_heads": 4, "vocab_size": 50}"#)?;
//! let block = Arc::new(MlpBlock { hidden: 32, inner: 64 });
//! let device = Device::Cpu;
//! let store = st::candle::store_for(&device,
//!     st::Store::builder().capacity(st::Tier::Device, 24 << 10).prefetch_budget(24 << 10))?;
//! let tensors = model_tensors(&config, block.as_ref());
//! let weights = put_random_tensors(&store, &tensors, 1, st::DType::F32)?;
//! let train = TrainConfig { micro_batch: 2, seq: 8, ..TrainConfig::default() };
//! let mut trainer = Trainer::with_block(store, &device, config, block, train, weights)?;
//! let tokens = Tensor::new(&[[1u32, 2, 3, 4, 5, 6, 7, 8, 9]; 2], &device)?;
//! let first = trainer.step(&[tokens.clone()])?.loss;
//! for _ in 0..5 {
//!     trainer.step(&[tokens.clone()])?;
//! }
//! assert!(trainer.step(&[tokens])?.loss < first);
//! # Ok(()) }
//! ```

use candle_core::Tensor;

pub use super::linear::{frozen_linear, linear, Adapter, GradBuffer, JointLinear, Weights};

/// A block a trainer can train: its weights by name and shape, its forward from them, and the
/// linears LoRA may adapt. The [module docs](self) have one to copy.
pub trait Block: Send + Sync {
    /// What kind of block it is (`"llama"` for [`LlamaBlock`]): a checkpoint records it, and
    /// resumes only on a trainer of the same kind.
    fn kind(&self) -> String;

    /// The block's tensors, `(name, shape)`, the names within the block (each block's are
    /// `model.layers.N.` and these). The same for every block.
    fn tensors(&self) -> Vec<(String, Vec<usize>)>;

    /// The block's output for `x` (`[batch, seq, hidden]`, positions `0..seq`, causal) from
    /// its weights, for block number `layer`. Every op must have a gradient (candle's autograd
    /// runs the backward, recomputing the block from its input), and the same values must give
    /// the same result (a block is recomputed for its backward). Linear layers should be
    /// [`Weights::linear`], so that LoRA can adapt them.
    fn forward(&self, layer: usize, w: &Weights, x: &Tensor) -> candle_core::Result<Tensor>;

    /// The names of the weights (`[out, in]`) that [`Block::forward`] applies with
    /// [`Weights::linear`], and in no other way: the layers LoRA may adapt, and those whose
    /// gradient the trainer sums straight into an f32 buffer ([`GradBuffer`]) rather than
    /// through a `Var`. None by default.
    fn linears(&self) -> Vec<String> {
        Vec::new()
    }

    /// Groups of [`Block::linears`] that read one input and that [`Block::forward`] applies
    /// together with [`Weights::linears`] (a group's names in that order): the trainer and its
    /// twin join each group's weights by rows once when they stage the block
    /// ([`Weights::join`]), so each group is one GEMM forward and one `dX` and one `dW` GEMM
    /// backward, its gradients still each weight's own. None by default (each linear its own
    /// GEMM); a group that cannot be joined ([`JointLinear::new`]) runs as separate linears.
    fn joined_linears(&self) -> Vec<Vec<String>> {
        Vec::new()
    }
}

/// Every tensor of a decoder of `config`'s skeleton with blocks `block`: the embedding table,
/// each block's tensors under `model.layers.N.`, the final norm, and `lm_head.weight` when
/// the embeddings are not tied. For [`LlamaBlock`] this is [`LlamaConfig::tensors`].
///
/// [`LlamaConfig::tensors`]: super::LlamaConfig::tensors
pub fn model_tensors(config: &super::LlamaConfig, block: &dyn Block) -> Vec<(String, Vec<usize>)> {
    use super::llama_config::{EMBED, LM_HEAD, NORM};
    let h = config.hidden_size;
    let mut v = vec![(EMBED.to_string(), vec![config.vocab_size, h])];
    let mine = block.tensors();
    for l in 0..config.num_hidden_layers {
        let p = super::LlamaConfig::block_prefix(l);
        v.extend(mine.iter().map(|(n, s)| (format!("{p}{n}"), s.clone())));
    }
    v.push((NORM.to_string(), vec![h]));
    if !config.tie_word_embeddings {
        v.push((LM_HEAD.to_string(), vec![config.vocab_size, h]));
    }
    v
}

/// The built-in Llama block ([`block_forward`](super::llama::block_forward): RMSNorm, rotary
/// embeddings, grouped-query attention, SwiGLU; the fused ops) as a [`Block`]: its linears are
/// the seven projections (`self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`), q, k and v
/// joined into one GEMM and gate and up into another ([`Block::joined_linears`]).
#[derive(Clone, Debug)]
pub struct LlamaBlock {
    config: super::LlamaConfig,
    rope: super::llama::Rope,
}

impl LlamaBlock {
    /// The block of `config`, with rotary tables for `positions` positions on `device` (the
    /// training sequence's length).
    pub fn new(
        config: &super::LlamaConfig,
        positions: usize,
        device: &candle_core::Device,
    ) -> candle_core::Result<LlamaBlock> {
        Ok(LlamaBlock {
            config: config.clone(),
            rope: super::llama::Rope::new(config, positions, device)?,
        })
    }
}

impl Block for LlamaBlock {
    fn kind(&self) -> String {
        "llama".into()
    }

    fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let p = super::LlamaConfig::block_prefix(0);
        self.config
            .tensors()
            .into_iter()
            .filter_map(|(n, s)| n.strip_prefix(&p).map(|n| (n.to_string(), s)))
            .collect()
    }

    fn forward(&self, _layer: usize, w: &Weights, x: &Tensor) -> candle_core::Result<Tensor> {
        let bw = super::llama::BlockWeights::from_weights(&self.config, w)?;
        super::llama::block_forward(&self.config, &bw, x, &self.rope, 0, None)
    }

    fn linears(&self) -> Vec<String> {
        super::llama_config::BLOCK_TENSORS
            .iter()
            .filter(|s| s.ends_with("_proj.weight"))
            .map(|s| s.to_string())
            .collect()
    }

    fn joined_linears(&self) -> Vec<Vec<String>> {
        let names = |g: &[&str]| g.iter().map(|s| s.to_string()).collect();
        super::llama::JOINED_LINEARS.iter().map(|g| names(g)).collect()
    }
}
