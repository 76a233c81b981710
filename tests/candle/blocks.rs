//! A block of one's own (CPU candle, host backend): a GPT-2-style block (LayerNorm with a bias,
//! one fused QKV projection with a bias, GELU MLP with biases) implementing
//! `strata::candle::block::Block`, trained out of core under a Device budget smaller than two
//! blocks against its in-memory twin, bit for bit: all of its weights, and LoRA adapters on its
//! fused QKV and MLP; saved and resumed.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{Device, Tensor, D};
use strata::candle::block::{model_tensors, Block, Weights};
use strata::candle::lora::LoraConfig;
use strata::candle::{fused, put_random_tensors, LlamaConfig, LlamaTwin, TrainConfig, Trainer};
use strata::optim::Engine;
use strata::{Store, Tier};

use super::train::{batches, bits, train_config};

/// GPT-2's block in `nn.Linear` layout (`[out, in]`): `h = x + attn(ln_1(x))`,
/// `y = h + mlp(ln_2(h))`, causal attention over one fused q/k/v projection, GELU (tanh).
struct Gpt2Block {
    hidden: usize,
    heads: usize,
}

/// LayerNorm with a weight and a bias, in ops that all have a backward.
fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let xc = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
    let inv = (xc.sqr()?.mean_keepdim(D::Minus1)? + 1e-5)?.sqrt()?.recip()?;
    xc.broadcast_mul(&inv)?.broadcast_mul(w)?.broadcast_add(b)
}

impl Block for Gpt2Block {
    fn kind(&self) -> String {
        "gpt2-style".into()
    }

    fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let h = self.hidden;
        [
            ("ln_1.weight", vec![h]),
            ("ln_1.bias", vec![h]),
            ("attn.c_attn.weight", vec![3 * h, h]),
            ("attn.c_attn.bias", vec![3 * h]),
            ("attn.c_proj.weight", vec![h, h]),
            ("attn.c_proj.bias", vec![h]),
            ("ln_2.weight", vec![h]),
            ("ln_2.bias", vec![h]),
            ("mlp.c_fc.weight", vec![4 * h, h]),
            ("mlp.c_fc.bias", vec![4 * h]),
            ("mlp.c_proj.weight", vec![h, 4 * h]),
            ("mlp.c_proj.bias", vec![h]),
        ]
        .into_iter()
        .map(|(n, s)| (n.to_string(), s))
        .collect()
    }

    fn linears(&self) -> Vec<String> {
        ["attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"]
            .map(String::from)
            .to_vec()
    }

    fn forward(&self, _layer: usize, w: &Weights, x: &Tensor) -> candle_core::Result<Tensor> {
        let (b, s, h) = x.dims3()?;
        let (nh, hd) = (self.heads, self.hidden / self.heads);
        let lin = |name: &str, x: &Tensor| {
            w.linear(&format!("{name}.weight"), x)?.broadcast_add(w.get(&format!("{name}.bias"))?)
        };
        let n = layer_norm(x, w.get("ln_1.weight")?, w.get("ln_1.bias")?)?;
        let qkv = lin("attn.c_attn", &n)?;
        let part = |i: usize| qkv.narrow(2, i * h, h)?.reshape((b, s, nh, hd));
        let a = fused::attention(&part(0)?, &part(1)?, &part(2)?, 1.0 / (hd as f64).sqrt(), None)?;
        let x = x.add(&lin("attn.c_proj", &a.reshape((b, s, h))?)?)?;
        let n = layer_norm(&x, w.get("ln_2.weight")?, w.get("ln_2.bias")?)?;
        x.add(&lin("mlp.c_proj", &lin("mlp.c_fc", &n)?.gelu()?)?)
    }
}

fn skeleton() -> LlamaConfig {
    LlamaConfig::from_json(
        r#"{"hidden_size": 48, "intermediate_size": 192, "num_hidden_layers": 3,
            "num_attention_heads": 4, "vocab_size": 97, "max_position_embeddings": 32}"#,
    )
    .unwrap()
}

fn block() -> Arc<Gpt2Block> {
    Arc::new(Gpt2Block { hidden: 48, heads: 4 })
}

/// A trainer of GPT-2-style blocks under a Device tier of 1.5 blocks, and its twin.
fn pair(t: &TrainConfig, seed: u64) -> (Trainer, LlamaTwin) {
    let c = skeleton();
    let b = block();
    let tensors = model_tensors(&c, b.as_ref());
    let block_bytes: u64 =
        4 * b.tensors().iter().map(|(_, s)| s.iter().product::<usize>() as u64).sum::<u64>();
    let budget = block_bytes * 3 / 2;
    let builder = Store::builder()
        .capacity(Tier::Device, budget)
        .prefetch_budget(budget)
        .capacity(Tier::Pinned, 16 << 20)
        .capacity(Tier::Mapped, 0);
    let store = strata::candle::store_for(&Device::Cpu, builder).unwrap();
    let weights = put_random_tensors(&store, &tensors, seed, strata::DType::F32).unwrap();
    let init: HashMap<String, Tensor> = weights
        .iter()
        .map(|(n, id)| {
            let shape = store.info(*id).unwrap().shape;
            let v = store.read_vec::<f32>(*id).unwrap();
            (n.clone(), Tensor::from_vec(v, shape.as_slice(), &Device::Cpu).unwrap())
        })
        .collect();
    let tr =
        Trainer::with_block(store, &Device::Cpu, c.clone(), b.clone(), t.clone(), weights).unwrap();
    let twin = LlamaTwin::with_block(c, b, t.clone(), init, &Device::Cpu).unwrap();
    (tr, twin)
}

#[test]
fn a_gpt2_style_block_trains_out_of_core_as_its_twin_bit_for_bit() {
    let full = train_config(Some(0.5), Engine::Cpu, &[]);
    let lora = TrainConfig {
        lora: Some(LoraConfig { seed: 3, ..LoraConfig::new(4, 16.0, &["c_attn", "c_fc"]) }),
        ..train_config(None, Engine::Cpu, &[])
    };
    let c = skeleton();
    for t in [full, lora] {
        let what = if t.lora.is_some() { "LoRA" } else { "full" };
        let (mut tr, mut twin) = pair(&t, 21);
        assert_eq!(tr.block_kind(), "gpt2-style");
        let before = tr.read_param("model.layers.1.attn.c_attn.bias").unwrap();
        for step in 0..4 {
            let b = batches(step, &c, &t);
            let r = tr.step(&b).unwrap();
            assert_eq!(r.loss.to_bits(), twin.step(&b).unwrap().to_bits(), "{what}: step {step}");
            // The Device tier held less than two blocks: the blocks were streamed.
            assert!(r.moved[Tier::Pinned.index()][Tier::Device.index()] > 0, "{what}");
        }
        tr.finish().unwrap();
        let mut names: Vec<String> =
            model_tensors(&c, block().as_ref()).into_iter().map(|(n, _)| n).collect();
        names.extend(tr.adapters().iter().flat_map(|s| [s.a.0.clone(), s.b.0.clone()]));
        for n in &names {
            assert_eq!(
                bits(&tr.read_param(n).unwrap()),
                bits(&twin.param(n).unwrap()),
                "{what}: {n}"
            );
        }
        let after = tr.read_param("model.layers.1.attn.c_attn.bias").unwrap();
        assert_eq!(bits(&after) == bits(&before), t.lora.is_some(), "{what}: the QKV bias");
        if t.lora.is_some() {
            assert_eq!(tr.adapters().len(), 2 * c.num_hidden_layers);
            assert_eq!(tr.adapters()[0].a.1, [4, 48]);
            assert_eq!(tr.adapters()[0].b.1, [144, 4]);
        }
    }
}

#[test]
fn a_gpt2_style_run_resumes_as_it_would_have_gone_on() {
    let t = train_config(Some(1.0), Engine::Cpu, &[]);
    let c = skeleton();
    let (mut whole, _) = pair(&t, 22);
    let losses: Vec<f32> = (0..4).map(|s| whole.step(&batches(s, &c, &t)).unwrap().loss).collect();
    let dir = tempfile::tempdir().unwrap();
    let (mut first, _) = pair(&t, 22);
    for step in 0..2 {
        first.step(&batches(step, &c, &t)).unwrap();
    }
    first.save(dir.path()).unwrap();
    let (mut resumed, _) = pair(&t, 99);
    resumed.resume(dir.path()).unwrap();
    for step in 2..4 {
        let l = resumed.step(&batches(step, &c, &t)).unwrap().loss;
        assert_eq!(l.to_bits(), losses[step as usize].to_bits(), "step {step}");
    }
    // A Llama trainer refuses the checkpoint of GPT-2-style blocks, naming them.
    let llama = skeleton();
    let s = super::train::store(&llama);
    let w = strata::candle::put_random_weights(&s, &llama, 1, strata::DType::F32).unwrap();
    let mut other = Trainer::new(s, &Device::Cpu, llama, t, w).unwrap();
    let e = other.resume(dir.path()).unwrap_err().to_string();
    assert!(e.contains("blocks is gpt2-style, this one's llama"), "{e}");
}
