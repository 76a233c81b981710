//! A Llama from a GGUF file (`tests/fixtures/llama.gguf`, written by `gen_llama.py` with the
//! `gguf` package: quantized weights of every type, q/k rows permuted as llama.cpp's converter
//! permutes them): its config from the metadata, its weights loaded quantized and in place, and
//! its greedy tokens out of core in f32 equal to those of the Hugging Face forward pass the
//! generator ran in numpy; configs of the wrong kind refused by name.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use strata::candle::{generate, load_weights, Layers, LlamaConfig, OutOfCoreLlama, Sampling};
use strata::{Gguf, GgufValue, Tier};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama.gguf")
}

fn tokens(v: &GgufValue) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

#[test]
fn the_config_comes_from_the_metadata() {
    let c = LlamaConfig::from_gguf(&Gguf::open(fixture()).unwrap()).unwrap();
    assert_eq!(
        (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size),
        (256, 128, 2, 64)
    );
    assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (4, 2, 64));
    assert_eq!(
        (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings),
        (10000.0, 1e-5f32 as f64, 128)
    );
    assert!(!c.tie_word_embeddings && !c.qkv_bias && c.rope_scaling.is_none());
}

#[test]
fn greedy_tokens_out_of_core_equal_the_reference() {
    let f = Gguf::open(fixture()).unwrap();
    let config = LlamaConfig::from_gguf(&f).unwrap();
    let device = Device::Cpu;
    // A Device tier of about one block: the weights stream.
    let store = strata::candle::store_for(
        &device,
        strata::Store::builder().capacity(Tier::Device, 160 << 10).prefetch_budget(64 << 10),
    )
    .unwrap();
    let weights = load_weights(&store, &config, fixture()).unwrap();
    assert_eq!(weights.len(), config.tensors().len());
    let (q_name, q) = &weights[2];
    assert_eq!(q_name, "model.layers.0.self_attn.q_proj.weight");
    assert_eq!(store.info(*q).unwrap().dtype, strata::DType::Q2K);
    let (_, v) = weights.iter().find(|(n, _)| n.ends_with("0.self_attn.v_proj.weight")).unwrap();
    assert_eq!(store.tier_of(*v).unwrap(), Tier::Disk, "in place in the file");
    let model = OutOfCoreLlama::new(
        Layers::new(store.clone(), weights, &device).unwrap(),
        &config,
        DType::F32,
    )
    .unwrap();
    let mut checked = 0;
    for i in 0.. {
        let (Some(p), Some(g)) =
            (f.get(&format!("test.prompt.{i}")), f.get(&format!("test.greedy.{i}")))
        else {
            break;
        };
        let want = tokens(g);
        let out = generate(&model, &tokens(p), want.len(), &Sampling::Greedy).unwrap();
        assert_eq!(out.tokens, want, "prompt {i}");
        checked += 1;
    }
    assert_eq!(checked, 4);
    let tr = model.layers().transfers().unwrap();
    assert!(tr.view_copy_bytes > 0);
}

/// The fixture's bytes with its metadata key `key` (a uint32 of the fixture) set to `value`.
fn with_u32(key: &str, value: u32) -> Vec<u8> {
    let mut bytes = std::fs::read(fixture()).unwrap();
    let needle =
        [&(key.len() as u64).to_le_bytes()[..], key.as_bytes(), &4u32.to_le_bytes()].concat();
    let at =
        bytes.windows(needle.len()).position(|w| w == needle).unwrap_or_else(|| panic!("{key}"))
            + needle.len();
    bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
    bytes
}

#[test]
fn what_the_model_cannot_compute_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let open = |bytes: Vec<u8>| {
        let p = dir.path().join("m.gguf");
        std::fs::write(&p, bytes).unwrap();
        Gguf::open(&p).unwrap()
    };
    for (key, value, words) in [
        ("llama.rope.dimension_count", 32, "RoPE over part of a head"),
        ("llama.attention.head_count_kv", 3, "not a multiple of 3"),
        ("llama.block_count", 0, "llama.block_count is missing or 0"),
    ] {
        let e = LlamaConfig::from_gguf(&open(with_u32(key, value))).unwrap_err().to_string();
        assert!(e.contains(words), "{key}: {e}");
    }
    // The architecture: "llama" is 5 bytes, so is "gemma" (not of the family).
    let mut bytes = std::fs::read(fixture()).unwrap();
    let at = bytes.windows(5).position(|w| w == b"llama").unwrap();
    bytes[at..at + 5].copy_from_slice(b"gemma");
    let e = LlamaConfig::from_gguf(&open(bytes)).unwrap_err().to_string();
    assert!(e.contains("general.architecture \"gemma\""), "{e}");
    // A float key that is a uint32 here: llama.context_length read as a count is fine, the
    // epsilon is not.
    let mut bytes = std::fs::read(fixture()).unwrap();
    let key = "llama.attention.layer_norm_rms_epsilon";
    let needle = [&(key.len() as u64).to_le_bytes()[..], key.as_bytes()].concat();
    let at = bytes.windows(needle.len()).position(|w| w == needle).unwrap() + needle.len();
    bytes[at..at + 4].copy_from_slice(&4u32.to_le_bytes()); // float32 (6) -> uint32 (4)
    let e = LlamaConfig::from_gguf(&open(bytes)).unwrap_err().to_string();
    assert!(e.contains(key) && e.contains("uint32, not a float"), "{e}");
}

#[test]
fn a_load_that_fails_leaves_nothing_in_the_store() {
    let f = Gguf::open(fixture()).unwrap();
    let mut config = LlamaConfig::from_gguf(&f).unwrap();
    config.intermediate_size = 96; // the file's MLP is 128 wide
    let store = strata::candle::store_for(&Device::Cpu, strata::Store::builder()).unwrap();
    let e = load_weights(&store, &config, fixture()).unwrap_err().to_string();
    assert!(e.contains("shape mismatch for model.layers.0.mlp.gate_proj.weight"), "{e}");
    assert!(store.ids().is_empty());
}

/// A GGUF file of anyone's against transformers' greedy tokens for it: see
/// `benches/peers/gguf_greedy.py`, which writes `STRATA_GGUF_EXPECT`. Out of core (a Device tier
/// of a quarter of the file), f32 compute.
#[test]
#[ignore = "needs STRATA_GGUF and STRATA_GGUF_EXPECT (benches/peers/gguf_greedy.py)"]
fn a_real_gguf_generates_transformers_greedy_tokens() {
    let (Some(path), Some(expect)) =
        (std::env::var_os("STRATA_GGUF"), std::env::var_os("STRATA_GGUF_EXPECT"))
    else {
        println!("SKIP: set STRATA_GGUF and STRATA_GGUF_EXPECT");
        return;
    };
    let want: serde_json::Value = serde_json::from_slice(&std::fs::read(&expect).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
    };
    let f = Gguf::open(&path).unwrap();
    let config = LlamaConfig::from_gguf(&f).unwrap();
    let size = std::fs::metadata(&path).unwrap().len();
    let device = Device::Cpu;
    let store = strata::candle::store_for(
        &device,
        strata::Store::builder().capacity(Tier::Device, size / 4).prefetch_budget(size / 16),
    )
    .unwrap();
    let t0 = std::time::Instant::now();
    let weights = load_weights(&store, &config, &path).unwrap();
    let layers = Layers::new(store.clone(), weights, &device).unwrap();
    let model = OutOfCoreLlama::new(layers, &config, DType::F32).unwrap();
    println!("{config:?}\nloaded in {:.2} s", t0.elapsed().as_secs_f64());
    let prompts = want["prompts"].as_array().unwrap();
    let greedy = want["greedy"].as_array().unwrap();
    let mut same = 0;
    for (p, g) in prompts.iter().zip(greedy) {
        let (p, g) = (ids(p), ids(g));
        let t0 = std::time::Instant::now();
        let out = generate(&model, &p, g.len(), &Sampling::Greedy).unwrap();
        println!(
            "{p:?} -> strata {:?}, transformers {g:?} ({:.2} s): {}",
            out.tokens,
            t0.elapsed().as_secs_f64(),
            if out.tokens == g { "equal" } else { "DIFFERENT" }
        );
        same += usize::from(out.tokens == g);
    }
    let tr = model.layers().transfers().unwrap();
    println!("{tr:?}");
    assert_eq!(same, prompts.len(), "prompts whose greedy tokens equal transformers'");
}

fn mixed() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mixed.gguf")
}

/// The dtype in `store` of the weight named `name`.
fn dtype_of(
    store: &strata::Store,
    weights: &[(String, strata::TensorId)],
    name: &str,
) -> strata::DType {
    let id = weights.iter().find(|(n, _)| n == name).unwrap_or_else(|| panic!("{name}")).1;
    store.info(id).unwrap().dtype
}

/// Greedy tokens of `model` for each `test.prompt.N` of `f` (as many as `test.greedy.N` holds).
fn greedy_of(model: &OutOfCoreLlama, f: &Gguf) -> Vec<(Vec<u32>, Vec<u32>)> {
    let mut out = Vec::new();
    for i in 0.. {
        let (Some(p), Some(g)) =
            (f.get(&format!("test.prompt.{i}")), f.get(&format!("test.greedy.{i}")))
        else {
            break;
        };
        let got = generate(model, &tokens(p), tokens(g).len(), &Sampling::Greedy).unwrap();
        out.push((got.tokens, tokens(g)));
    }
    out
}

/// A file whose tensors are of several types, as real ones are (`tests/fixtures/mixed.gguf`,
/// `gen_mixed.py`: an F16 embedding table tied to the output, Q4_K, Q6_K and Q8_0 blocks, F32
/// norms and one BF16): each tensor loaded in its own type, and greedy tokens out of core (f32
/// compute, a Device tier of about a block) equal the reference's.
#[test]
fn a_file_of_mixed_types_generates_the_reference_tokens() {
    let f = Gguf::open(mixed()).unwrap();
    let config = LlamaConfig::from_gguf(&f).unwrap();
    assert!(config.tie_word_embeddings);
    let device = Device::Cpu;
    let store = strata::candle::store_for(
        &device,
        strata::Store::builder().capacity(Tier::Device, 200 << 10).prefetch_budget(64 << 10),
    )
    .unwrap();
    let weights = load_weights(&store, &config, mixed()).unwrap();
    for (name, dtype) in [
        ("model.embed_tokens.weight", strata::DType::F16),
        ("model.layers.0.self_attn.q_proj.weight", strata::DType::Q4K),
        ("model.layers.1.self_attn.v_proj.weight", strata::DType::Q6K),
        ("model.layers.0.mlp.down_proj.weight", strata::DType::Q8_0),
        ("model.layers.0.input_layernorm.weight", strata::DType::F32),
        ("model.layers.1.post_attention_layernorm.weight", strata::DType::BF16),
    ] {
        assert_eq!(dtype_of(&store, &weights, name), dtype, "{name}");
    }
    let layers = Layers::new(store.clone(), weights, &device).unwrap();
    let model = OutOfCoreLlama::new(layers, &config, DType::F32).unwrap();
    let runs = greedy_of(&model, &f);
    assert_eq!(runs.len(), 4);
    for (i, (got, want)) in runs.iter().enumerate() {
        assert_eq!(got, want, "prompt {i}");
    }
}

/// `widen_for_training`: a mixed file's f16 and bf16 weights become f32 copies of the same
/// values under the same names, the originals leave the store, the quantized and f32 weights
/// stay as they are; a file without f16 or bf16 weights comes back as it is.
#[test]
fn a_mixed_base_is_widened_to_f32_for_the_trainer_exactly() {
    use strata::candle::{needs_widening, widen_for_training};
    let config = LlamaConfig::from_gguf(&Gguf::open(mixed()).unwrap()).unwrap();
    let store = strata::candle::store_for(&Device::Cpu, strata::Store::builder()).unwrap();
    let weights = load_weights(&store, &config, mixed()).unwrap();
    let before: Vec<(strata::DType, Vec<f32>)> = weights
        .iter()
        .map(|(_, id)| {
            let d = store.info(*id).unwrap().dtype;
            let v = match d {
                strata::DType::F16 => {
                    store.read_vec::<half::f16>(*id).unwrap().into_iter().map(f32::from).collect()
                }
                strata::DType::BF16 => {
                    store.read_vec::<half::bf16>(*id).unwrap().into_iter().map(f32::from).collect()
                }
                _ => Vec::new(),
            };
            (d, v)
        })
        .collect();
    assert!(needs_widening(before.iter().map(|b| b.0)));
    let widened = widen_for_training(&store, weights.clone()).unwrap();
    assert_eq!(store.ids().len(), widened.len(), "the originals are gone");
    let mut copies = 0;
    for (((name, old), (name2, new)), (dtype, values)) in weights.iter().zip(&widened).zip(&before)
    {
        assert_eq!(name, name2);
        match dtype {
            strata::DType::F16 | strata::DType::BF16 => {
                assert_eq!(store.info(*new).unwrap().dtype, strata::DType::F32, "{name}");
                assert_eq!(&store.read_vec::<f32>(*new).unwrap(), values, "{name}");
                copies += 1;
            }
            _ => assert_eq!(old, new, "{name}"),
        }
    }
    assert_eq!(copies, 2, "the embedding table and block 1's ffn_norm");
    // Every quantized weight with f32 ones: nothing to do.
    let c = LlamaConfig::from_gguf(&Gguf::open(fixture()).unwrap()).unwrap();
    let s = strata::candle::store_for(&Device::Cpu, strata::Store::builder()).unwrap();
    let w = load_weights(&s, &c, fixture()).unwrap();
    assert_eq!(widen_for_training(&s, w.clone()).unwrap(), w);
    assert!(!needs_widening([strata::DType::BF16, strata::DType::BF16]));
    assert!(needs_widening([strata::DType::BF16, strata::DType::Q4K]));
}

/// QLoRA over the mixed file (widened for the trainer): its merged exports in f32 and bf16
/// (`save_merged_as`) hold the same merge, the bf16 one rounded once, each `config.json`
/// naming its dtype; and the adapter applied unmerged over the quantized base
/// (`LoadedAdapter`, `OutOfCoreLlama::with_adapter`) generates the f32 export's greedy tokens,
/// which are not the base's.
#[test]
fn qlora_over_a_mixed_file_exports_in_f32_and_bf16_and_applies_unmerged_as_merged() {
    use strata::candle::lora::LoadedAdapter;
    use strata::candle::lora::LoraConfig;
    use strata::candle::{widen_for_training, LrSchedule, TrainConfig, Trainer};
    let f = Gguf::open(mixed()).unwrap();
    let config = LlamaConfig::from_gguf(&f).unwrap();
    let device = Device::Cpu;
    let small = || {
        strata::candle::store_for(
            &device,
            strata::Store::builder().capacity(Tier::Device, 200 << 10).prefetch_budget(64 << 10),
        )
        .unwrap()
    };
    let store = small();
    let weights = widen_for_training(&store, load_weights(&store, &config, mixed()).unwrap());
    let train = TrainConfig {
        seq: 8,
        adamw: strata::optim::AdamW { lr: 5e-2, ..TrainConfig::default().adamw },
        schedule: LrSchedule::constant(5e-2),
        lora: Some(LoraConfig::new(4, 8.0, &["q_proj", "v_proj", "down_proj"])),
        ..TrainConfig::default()
    };
    let mut tr = Trainer::new(store, &device, config.clone(), train, weights.unwrap()).unwrap();
    for step in 0..3u32 {
        let ids: Vec<u32> = (0..9).map(|i| (step * 7 + i * 5 + 1) % 64).collect();
        tr.step(&[candle_core::Tensor::from_vec(ids, (1, 9), &device).unwrap()]).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let (f32_dir, bf16_dir, adapter) =
        (dir.path().join("f32"), dir.path().join("bf16"), dir.path().join("adapter"));
    tr.save_merged_as(&f32_dir, Some(strata::DType::F32)).unwrap();
    tr.save_merged_as(&bf16_dir, Some(strata::DType::BF16)).unwrap();
    tr.save_adapter(&adapter).unwrap();
    let e = tr.save_merged_as(dir.path().join("f16"), Some(strata::DType::F16)).unwrap_err();
    assert!(e.to_string().contains("f32 or bf16"), "{e}");
    assert!(!dir.path().join("f16").exists());
    drop(tr);
    let read = |d: &Path| -> std::collections::BTreeMap<String, (safetensors::Dtype, Vec<u8>)> {
        let mut out = std::collections::BTreeMap::new();
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "safetensors") {
                let bytes = std::fs::read(&p).unwrap();
                let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
                for (n, t) in st.tensors() {
                    out.insert(n.to_string(), (t.dtype(), t.data().to_vec()));
                }
            }
        }
        out
    };
    let (a, b) = (read(&f32_dir), read(&bf16_dir));
    assert_eq!(a.len(), 2 + 2 * 9, "the embedding, the final norm and 2 blocks of 9");
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (name, (da, va)) in &a {
        let (db, vb) = &b[name];
        assert_eq!((*da, *db), (safetensors::Dtype::F32, safetensors::Dtype::BF16), "{name}");
        let rounded: Vec<half::bf16> =
            bytemuck::cast_slice::<u8, f32>(va).iter().map(|&x| half::bf16::from_f32(x)).collect();
        assert_eq!(bytemuck::cast_slice::<half::bf16, u8>(&rounded), vb.as_slice(), "{name}");
    }
    for (d, want) in [(&f32_dir, "float32"), (&bf16_dir, "bfloat16")] {
        let c: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
        assert_eq!(c["torch_dtype"], want, "{}", d.display());
    }

    // The adapter unmerged over the quantized base, and the f32 export, generate alike.
    let store = small();
    let weights = load_weights(&store, &config, mixed()).unwrap();
    let loaded = LoadedAdapter::read(&store, &weights, &adapter).unwrap();
    assert_eq!(loaded.pairs.len(), 6);
    assert!(!loaded.mergeable(&store, &weights).unwrap());
    let e = loaded.merge_into(&store, &weights).unwrap_err().to_string();
    assert!(e.contains("applied unmerged"), "{e}");
    let layers = Layers::new(store.clone(), weights, &device).unwrap();
    let unmerged = OutOfCoreLlama::new(layers, &config, DType::F32)
        .unwrap()
        .with_resident(1)
        .unwrap()
        .with_adapter(&loaded)
        .unwrap();
    let store = small();
    let exported = LlamaConfig::from_file(f32_dir.join("config.json")).unwrap();
    let weights = load_weights(&store, &exported, &f32_dir).unwrap();
    let layers = Layers::new(store.clone(), weights, &device).unwrap();
    let merged = OutOfCoreLlama::new(layers, &exported, DType::F32).unwrap();
    let (u, m) = (greedy_of(&unmerged, &f), greedy_of(&merged, &f));
    assert_eq!(
        u.iter().map(|r| &r.0).collect::<Vec<_>>(),
        m.iter().map(|r| &r.0).collect::<Vec<_>>()
    );
    assert!(u.iter().any(|(got, base)| got != base), "the adapter changed no token: {u:?}");
}
