//! The trainer's resident twin ([`LlamaTwin`]): the same model trained in candle's memory,
//! the out-of-core trainer's reference and baseline.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType as CDType, Device, Tensor, Var};

use super::device_adamw::{DeviceState, Kernels};
use super::grads::{
    add_grad, check_applied, clip_factor, embedding_backward, grad_of, linear_buffers,
    loss_and_norm, staged, sum_of_squares, trained_linears, with_buffers, LinearGrad,
};
use super::{
    block_weights, check_batches, init_values, prepare_masks, run_params, Init, LlamaConfig,
    LoraConfig, TrainConfig,
};
use crate::base::types::DType;
use crate::candle::block::{model_tensors, Block, LlamaBlock, Weights};
use crate::candle::llama::{embed, head_logits, inputs_and_targets, next_token_loss_masked, EMBED};
use crate::candle::lora::{adapter_specs, AdapterSpec};
use crate::compute::optim::AdamW;

/// One parameter of [`LlamaTwin`].
struct TwinParam {
    name: String,
    shape: Vec<usize>,
    /// The `Var` of a trainable parameter: what its update writes.
    var: Option<Var>,
    /// The candle tensor the model computes with: the `Var`'s, or for a trained linear weight
    /// (whose backward sums its gradient into a buffer, [`linear_buffers`]) a plain tensor
    /// over the `Var`'s storage, so that autograd makes no gradient of its own for it.
    tensor: Tensor,
    /// A trained weight of a block's linear: its gradient comes from a buffer, not autograd.
    linear: bool,
    /// The f32 master weights and moments, on the device (trainable parameters).
    state: Option<DeviceState>,
}

/// The in-memory twin of [`Trainer`](super::Trainer), resident on candle's device: the same model
/// code with every weight a resident candle tensor (`Var`s for the trainable ones), each
/// micro-batch's loss run through candle's plain `backward` (no recompute), the gradients summed
/// over micro-batches into one f32 buffer per parameter on the device (the trained linear weights'
/// by their backward itself, as the trainer's:
/// [`fused::accumulating_linear`](crate::candle::fused::accumulating_linear)), and AdamW with fp32
/// masters and moments on the device too, updated in place by strata's optimizer arithmetic (its
/// host loop [`cpu_update_scaled`](crate::compute::optim::cpu_update_scaled) on the CPU, its
/// `strata_adamw` kernel on CUDA): nothing crosses to the host but the loss and the gradient norm,
/// read in one sync a step. It is the trainer's reference (on the CPU its losses and weights are
/// the trainer's, bit for bit: with the Llama block or a [`Block`] of your own
/// ([`LlamaTwin::with_block`]), with LoRA adapters, with loss masks) and its baseline (what out of
/// core is measured against on a GPU).
///
/// **Training and generation.** The twin's Llama weights serve generation too:
/// [`LlamaTwin::generator`] is an [`InMemoryLlama`](crate::candle::InMemoryLlama) over the very
/// same tensors (no copy; each step updates them in place, adapters included), with its KV cache.
/// They stay two types because they hold different things: the twin holds `Var`s, fp32 masters and
/// moments and rotary tables for the training sequence; the generator a KV cache, tables for the
/// cache's positions, and may compute in f16.
pub struct LlamaTwin {
    config: LlamaConfig,
    train: TrainConfig,
    block: Arc<dyn Block>,
    block_tensors: Vec<(String, Vec<usize>)>,
    specs: Vec<AdapterSpec>,
    params: Vec<TwinParam>,
    step: u64,
    kernels: Kernels,
    /// Recompute each block from its input in the backward, as the out-of-core trainer does
    /// ([`LlamaTwin::set_recompute`]).
    recompute: bool,
}

impl std::fmt::Debug for LlamaTwin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaTwin").field("step", &self.step).finish()
    }
}

impl LlamaTwin {
    /// A twin of a model of `config` from its weights (every tensor [`LlamaConfig::tensors`]
    /// names, f32 or bf16, on `device`); with [`TrainConfig::lora`], the adapters the trainer
    /// makes (the same initial values).
    pub fn new(
        config: LlamaConfig,
        train: TrainConfig,
        weights: HashMap<String, Tensor>,
        device: &Device,
    ) -> candle_core::Result<LlamaTwin> {
        let positions = train.seq.min(config.max_position_embeddings);
        let block = Arc::new(LlamaBlock::new(&config, positions, device)?);
        Self::with_block(config, block, train, weights, device)
    }

    /// [`LlamaTwin::new`] for a model whose blocks are `block`
    /// ([`Trainer::with_block`](super::Trainer::with_block)).
    pub fn with_block(
        config: LlamaConfig,
        block: Arc<dyn Block>,
        train: TrainConfig,
        weights: HashMap<String, Tensor>,
        device: &Device,
    ) -> candle_core::Result<LlamaTwin> {
        let first = weights.values().next().map(|t| t.dtype());
        let dtype = if first == Some(CDType::BF16) { DType::BF16 } else { DType::F32 };
        train.validate(&config, dtype, device)?;
        let base = model_tensors(&config, block.as_ref());
        let specs = match &train.lora {
            Some(l) => adapter_specs(&config, block.as_ref(), l)?,
            None => Vec::new(),
        };
        let block_tensors = block.tensors();
        let linears: Vec<String> = (0..config.num_hidden_layers)
            .flat_map(|l| {
                trained_linears(block.as_ref(), &block_tensors, l, |n| train.is_trained(n))
            })
            .map(|(name, _, _)| name)
            .collect();
        let mut params = Vec::new();
        let mut dtype = None;
        for (name, shape, init) in run_params(&base, &specs) {
            let t = match init {
                Init::Given => {
                    let t = weights
                        .get(&name)
                        .ok_or_else(|| {
                            candle_core::Error::CannotFindTensor { path: name.clone() }.bt()
                        })?
                        .to_device(device)?;
                    let d = t.dtype();
                    if *dtype.get_or_insert(d) != d || !matches!(d, CDType::F32 | CDType::BF16) {
                        candle_core::bail!(
                            "{name} is {d:?}: one dtype, f32 or bf16, for every parameter"
                        );
                    }
                    t
                }
                _ => Tensor::from_vec(
                    init_values(init, &shape, train.lora.as_ref()),
                    shape.as_slice(),
                    device,
                )?,
            };
            if t.dims() != shape.as_slice() {
                candle_core::bail!("{name} has shape {:?}, the config says {shape:?}", t.dims());
            }
            let trainable = train.is_trained(&name);
            let linear = linears.contains(&name);
            let (var, tensor, state) = if trainable {
                let v = Var::from_tensor(&t)?;
                let tensor = if linear { v.as_tensor().detach() } else { v.as_tensor().clone() };
                (Some(v), tensor, Some(DeviceState::new(&t)?))
            } else {
                (None, t, None)
            };
            params.push(TwinParam { name, shape, var, tensor, linear, state });
        }
        let kernels = Kernels::for_device(device)?;
        Ok(LlamaTwin {
            config,
            train,
            block,
            block_tensors,
            specs,
            params,
            step: 0,
            kernels,
            recompute: false,
        })
    }

    /// Whether the twin recomputes as the out-of-core trainer does: each micro-batch's forward
    /// keeps only every block's input (no graph), and the backward recomputes each block from
    /// its input, last block first, with the head's backward first (the trainer's arithmetic,
    /// its FLOPs: one forward more than candle's plain backward, which keeps every activation).
    /// The results are the same either way (bit for bit on the CPU); what changes is the work
    /// and the memory. Off by default: the twin is then candle's plain backward, the baseline.
    pub fn set_recompute(&mut self, recompute: bool) {
        self.recompute = recompute;
    }

    /// Whether the twin recomputes ([`LlamaTwin::set_recompute`]).
    pub fn recomputes(&self) -> bool {
        self.recompute
    }

    fn tensor(&self, name: &str) -> Option<&Tensor> {
        self.params.iter().find(|p| p.name == name).map(|p| &p.tensor)
    }

    fn needed(&self, name: &str) -> candle_core::Result<&Tensor> {
        self.tensor(name)
            .ok_or_else(|| candle_core::Error::CannotFindTensor { path: name.to_string() }.bt())
    }

    /// The f32 logits (`[batch · seq, vocab]`) of `ids` (`[batch, seq]`, u32), each projection
    /// its own GEMM (not joined, as [`Trainer::logits`](super::Trainer::logits)).
    pub fn logits(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        self.logits_from(&embed(self.needed(EMBED)?, ids)?, None)
    }

    /// The f32 logits from the embedding's output `x` (`[batch, seq, hidden]`): the blocks, the
    /// final norm and the head; each block's weights as `blocks` has them staged (a step's
    /// forward: [`LlamaTwin::staged`]), else as they are.
    fn logits_from(&self, x: &Tensor, blocks: Option<&[Weights]>) -> candle_core::Result<Tensor> {
        let cfg = &self.config;
        let scale = self.train.lora.as_ref().map_or(1.0, LoraConfig::scale);
        let mut x = x.clone();
        for l in 0..cfg.num_hidden_layers {
            x = match blocks.and_then(|b| b.get(l)) {
                Some(w) => self.block.forward(l, w, &x)?,
                None => {
                    let w = block_weights(&self.block_tensors, &self.specs, scale, l, |n| {
                        self.tensor(n).cloned()
                    })?;
                    self.block.forward(l, &w, &x)?
                }
            };
        }
        let [norm, head] = cfg.head_names();
        head_logits(cfg, &x, self.needed(norm)?, self.needed(head)?)
    }

    /// Each block's weights for a step, staged as the trainer stages them: with its trained
    /// linears' gradient buffers (`bufs[l]`) and its joined linears joined (one copy of their
    /// weights a step, for every micro-batch: each micro-batch runs the whole model, so every
    /// block's joints are held for the step, where the trainer holds one block's).
    fn staged(&self, bufs: &[Vec<LinearGrad>]) -> candle_core::Result<Vec<Weights>> {
        let scale = self.train.lora.as_ref().map_or(1.0, LoraConfig::scale);
        (0..self.config.num_hidden_layers)
            .map(|l| {
                let w = block_weights(&self.block_tensors, &self.specs, scale, l, |n| {
                    self.tensor(n).cloned()
                })?;
                staged(with_buffers(w, &bufs[l]), self.block.as_ref())
            })
            .collect()
    }

    /// One step over `batches`, as [`Trainer::step`](super::Trainer::step); returns the loss.
    ///
    /// Each micro-batch runs through candle's plain backward over the whole model, from the
    /// embedding's output on: the gradients are summed into one f32 buffer per parameter in
    /// place (the trained linear weights' by their backward), and the embedding's rows added
    /// into its buffer (after the head's share when the embeddings are tied) in f32, as the
    /// trainer makes them.
    pub fn step(&mut self, batches: &[Tensor]) -> candle_core::Result<f32> {
        self.step_masked(batches, None)
    }

    /// One step over `batches` with loss masks, as
    /// [`Trainer::step_masked`](super::Trainer::step_masked); returns the loss.
    pub fn step_masked(
        &mut self,
        batches: &[Tensor],
        masks: Option<&[Tensor]>,
    ) -> candle_core::Result<f32> {
        let t = &self.train;
        check_batches(t, &self.config, batches)?;
        let masks = masks.map(|m| prepare_masks(t, m)).transpose()?;
        let counted = masks.as_ref().map_or(t.micro_batch * t.seq * t.accum, |m| m.1);
        let mut acc: Vec<Option<Tensor>> = self.params.iter().map(|_| None).collect();
        // Each block's trained linear weights: their gradients summed by the backward itself.
        let dev = self.needed(EMBED)?.device().clone();
        let trained = |n: &str| self.params.iter().any(|p| p.name == n && p.linear);
        let bufs = (0..self.config.num_hidden_layers)
            .map(|l| linear_buffers(self.block.as_ref(), &self.block_tensors, l, trained, &dev))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let blocks = self.staged(&bufs)?;
        let mut losses = Vec::with_capacity(batches.len());
        let mut rows = Vec::with_capacity(batches.len());
        for (m, b) in batches.iter().enumerate() {
            let (ids, targets) = inputs_and_targets(b)?;
            let mask = masks.as_ref().map(|ms| &ms.0[m]);
            // The embedding's backward is the trainer's (below), so its output is a leaf here.
            let x = Var::from_tensor(&embed(&self.needed(EMBED)?.detach(), &ids)?)?;
            let scale = 1.0 / counted as f64;
            let gx = if self.recompute {
                self.recomputed_backward(
                    x.as_tensor(),
                    &targets,
                    mask,
                    scale,
                    &blocks,
                    &mut acc,
                    &mut losses,
                )?
            } else {
                let logits = self.logits_from(x.as_tensor(), Some(&blocks))?;
                let l = next_token_loss_masked(&logits, &targets, mask, scale)?;
                let grads = l.backward()?;
                losses.push(l);
                for (p, a) in self.params.iter().zip(acc.iter_mut()) {
                    let Some(v) = p.var.as_ref().filter(|_| !p.linear) else { continue };
                    match grads.get(v) {
                        Some(g) => add_grad(a, g)?,
                        // An untied embedding: no gradient but its rows' (below).
                        None if p.name == EMBED => {}
                        None => candle_core::bail!("no gradient reached {}", p.name),
                    }
                }
                grad_of(&grads, x.as_tensor(), "the embedding's output")?
            };
            rows.push((ids, gx));
        }
        drop(blocks);
        let kind = self.block.kind();
        for g in bufs.into_iter().flatten() {
            check_applied(std::slice::from_ref(&g), &kind)?;
            if let Some(i) = self.params.iter().position(|p| p.name == g.name) {
                acc[i] = Some(g.buf.tensor().clone());
            }
        }
        if let Some((p, a)) = self.params.iter().zip(acc.iter_mut()).find(|(p, _)| p.name == EMBED)
        {
            if p.var.is_some() {
                let (v, h) = (self.config.vocab_size, self.config.hidden_size);
                let dev = p.tensor.device();
                let table = match a.take() {
                    Some(t) => t,
                    None => Tensor::zeros((v, h), CDType::F32, dev)?,
                };
                let mb: Vec<(&Tensor, &Tensor)> = rows.iter().map(|(i, g)| (i, g)).collect();
                embedding_backward(&table, &mb)?;
                *a = Some(table);
            }
        }
        drop(rows);
        let ss: Vec<Tensor> =
            acc.iter().flatten().map(sum_of_squares).collect::<candle_core::Result<_>>()?;
        let (loss, norm) = loss_and_norm(&losses, &ss)?;
        let scale = clip_factor(norm, self.train.clip);
        let lr = self.train.schedule.lr(self.step);
        let h = AdamW { lr, ..self.train.adamw };
        let t = self.step + 1;
        for (p, a) in self.params.iter().zip(acc) {
            let (Some(var), Some(state), Some(g)) = (&p.var, &p.state, a) else { continue };
            state.step(&g, &h, t, scale, &self.kernels)?;
            // The compute copy: the master rounded to the parameter's dtype (to nearest, ties
            // to even, as the trainer's optimizer rounds it).
            let master = state.master()?.reshape(p.shape.as_slice())?;
            var.set(&master.to_dtype(p.tensor.dtype())?)?;
        }
        self.step += 1;
        Ok(loss)
    }

    /// One micro-batch's loss and gradients the out-of-core trainer's way: the blocks' forward
    /// without a graph, keeping each block's input; the head's forward and backward; then each
    /// block recomputed from its input and run backward, last first, with its staged weights
    /// `blocks[l]` ([`LlamaTwin::staged`]). Each parameter's gradient is added into its buffer
    /// in `acc` (a trained linear weight's into its buffer in the staged weights, by the
    /// recomputed block's backward); returns the gradient at the embedding's output.
    #[allow(clippy::too_many_arguments)]
    fn recomputed_backward(
        &self,
        x: &Tensor,
        targets: &Tensor,
        mask: Option<&Tensor>,
        scale: f64,
        blocks: &[Weights],
        acc: &mut [Option<Tensor>],
        losses: &mut Vec<Tensor>,
    ) -> candle_core::Result<Tensor> {
        let cfg = &self.config;
        // The forward: no graph, every block's input kept (the trainer's checkpoints).
        let mut inputs = Vec::with_capacity(cfg.num_hidden_layers);
        let mut h = x.detach();
        for (l, w) in blocks.iter().enumerate() {
            let y = self.block.forward(l, &w.detached(), &h)?;
            inputs.push(std::mem::replace(&mut h, y));
        }
        // The head, forward and backward, from the last block's output.
        let add_all = |grads: &candle_core::backprop::GradStore,
                       acc: &mut [Option<Tensor>]|
         -> candle_core::Result<()> {
            for (p, a) in self.params.iter().zip(acc.iter_mut()) {
                if let Some(g) = p.var.as_ref().and_then(|v| grads.get(v)) {
                    add_grad(a, g)?;
                }
            }
            Ok(())
        };
        let hv = Var::from_tensor(&h)?;
        let [norm, head] = cfg.head_names();
        let logits = head_logits(cfg, hv.as_tensor(), self.needed(norm)?, self.needed(head)?)?;
        let l = next_token_loss_masked(&logits, targets, mask, scale)?;
        let grads = l.backward()?;
        losses.push(l);
        add_all(&grads, acc)?;
        let mut gy = grad_of(&grads, hv.as_tensor(), "the head's input")?;
        drop(grads);
        // Each block recomputed from its input, its backward from the gradient at its output.
        for (l, input) in inputs.into_iter().enumerate().rev() {
            let xv = Var::from_tensor(&input)?;
            let y = self.block.forward(l, &blocks[l], xv.as_tensor())?;
            let grads = y.mul(&gy)?.sum_all()?.backward()?;
            add_all(&grads, acc)?;
            gy = grad_of(&grads, xv.as_tensor(), "a block's input")?;
        }
        for (p, a) in self.params.iter().zip(acc.iter()) {
            // An untied embedding's gradient is its rows' (added after the micro-batches).
            if p.var.is_some() && a.is_none() && p.name != EMBED && !p.linear {
                candle_core::bail!("no gradient reached {}", p.name);
            }
        }
        Ok(gy)
    }

    /// A parameter's values (f32): the model's, or a LoRA adapter's.
    pub fn param(&self, name: &str) -> candle_core::Result<Vec<f32>> {
        self.needed(name)?.flatten_all()?.to_dtype(CDType::F32)?.to_vec1::<f32>()
    }

    /// A trainable parameter's fp32 master weights (`None` for a frozen one), read from the
    /// device.
    pub fn master(&self, name: &str) -> candle_core::Result<Option<Vec<f32>>> {
        match self.params.iter().find(|p| p.name == name).and_then(|p| p.state.as_ref()) {
            Some(s) => Ok(Some(s.master()?.to_vec1::<f32>()?)),
            None => Ok(None),
        }
    }

    /// The twin's model as an [`InMemoryLlama`](crate::candle::InMemoryLlama) that generates: the
    /// twin's own tensors (no copy: what later steps change, it sees), its adapters applied
    /// unmerged, computing in the weights' dtype. Only for the Llama block (a [`Block`] of your
    /// own has no KV cache to generate with).
    pub fn generator(&self) -> candle_core::Result<crate::candle::InMemoryLlama> {
        if self.block.kind() != "llama" {
            candle_core::bail!(
                "a twin of {} blocks: generation runs the Llama block only",
                self.block.kind()
            );
        }
        let scale = self.train.lora.as_ref().map_or(1.0, LoraConfig::scale);
        let mut blocks = Vec::with_capacity(self.config.num_hidden_layers);
        for l in 0..self.config.num_hidden_layers {
            let w = block_weights(&self.block_tensors, &self.specs, scale, l, |n| {
                self.tensor(n).cloned()
            })?;
            blocks.push(crate::candle::llama::BlockWeights::from_weights(&self.config, &w)?);
        }
        let [norm, head] = self.config.head_names();
        crate::candle::InMemoryLlama::from_parts(
            &self.config,
            self.needed(EMBED)?.clone(),
            blocks,
            self.needed(norm)?.clone(),
            self.needed(head)?.clone(),
        )
    }
}
