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
