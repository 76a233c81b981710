//! Configs as Hugging Face writes them: tiny random models saved by transformers 5.24 itself
//! (`benches/peers/make_llama_fixtures.py`), each with the logits transformers computed for a
//! prompt. strata reads each config, loads the weights and computes the same logits (to f32
//! rounding); validation refuses what it cannot compute, naming the field.

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use strata::candle::llama::{block_forward, embed, head_logits, BlockWeights, Rope};
use strata::candle::{LlamaConfig, RopeScaling};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/candle/fixtures").join(name)
}

struct Expected {
    prompt: Vec<u32>,
    inv_freq: Vec<f64>,
    logits: Vec<Vec<f64>>,
}

fn expected(name: &str) -> Expected {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let floats = |x: &serde_json::Value| -> Vec<f64> {
        x.as_array().unwrap().iter().map(|f| f.as_f64().unwrap()).collect()
    };
    Expected {
        prompt: v["prompt"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect(),
        inv_freq: floats(&v["inv_freq"]),
        logits: v["logits"].as_array().unwrap().iter().map(floats).collect(),
    }
}

/// The logits of every position of `prompt`, computed stage by stage from the saved weights.
fn logits(c: &LlamaConfig, dir: &std::path::Path, prompt: &[u32]) -> Vec<Vec<f32>> {
    let dev = Device::Cpu;
    let w = candle_core::safetensors::load(dir.join("model.safetensors"), &dev).unwrap();
    for (name, shape) in c.tensors() {
        assert_eq!(w[&name].dims(), shape.as_slice(), "{name}");
    }
    let ids = Tensor::new(prompt, &dev).unwrap().unsqueeze(0).unwrap();
    let mut x = embed(&w["model.embed_tokens.weight"], &ids).unwrap();
    let rope = Rope::new(c, prompt.len(), &dev).unwrap();
    for l in 0..c.num_hidden_layers {
        let p = LlamaConfig::block_prefix(l);
        let bw = BlockWeights::from_fn(c, |s| Ok(w[&format!("{p}{s}")].clone())).unwrap();
        x = block_forward(c, &bw, &x, &rope, 0, None).unwrap();
    }
    let [norm, head] = c.head_names();
    head_logits(c, &x, &w[norm], &w[head]).unwrap().to_dtype(DType::F32).unwrap().to_vec2().unwrap()
}

/// The largest difference from transformers' logits, over the largest of them.
fn worst(got: &[Vec<f32>], want: &[Vec<f64>]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().flatten().fold(0f64, |m, x| m.max(x.abs()));
    let diff = got
        .iter()
        .flatten()
        .zip(want.iter().flatten())
        .fold(0f64, |m, (a, b)| m.max((f64::from(*a) - b).abs()));
    diff / scale
}

#[test]
fn configs_written_by_transformers_5_give_transformers_logits() {
    for (name, check) in [
        (
            "llama-theta",
            (|c: &LlamaConfig| {
                // transformers 5 writes the theta only in rope_parameters: read, not defaulted.
                assert_eq!((c.rope_theta, c.tie_word_embeddings), (100000.0, true));
            }) as fn(&LlamaConfig),
        ),
        ("llama3-rope", |c| {
            assert_eq!(c.rope_theta, 500000.0);
            assert!(
                matches!(c.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 8.0)
            );
        }),
        ("qwen2-bias", |c| assert!(c.qkv_bias && c.sliding_window.is_none())),
        ("mistral-head-dim", |c| assert_eq!((c.head_dim, c.sliding_window), (12, None))),
    ] {
        let dir = fixture(name);
        let c = LlamaConfig::from_file(dir.join("config.json")).unwrap();
        check(&c);
        assert_eq!(c.dtype, Some(DType::F32), "{name}");
        let e = expected(name);
        let inv = c.rope_inverse_frequencies();
        let inv_diff = inv
            .iter()
            .zip(&e.inv_freq)
            .fold(0f64, |m, (a, b)| m.max((f64::from(*a) - b).abs() / b));
        assert_eq!(inv.len(), e.inv_freq.len());
        assert!(inv_diff < 1e-6, "{name}: inverse frequencies {inv:?} vs {:?}", e.inv_freq);
        let w = worst(&logits(&c, &dir, &e.prompt), &e.logits);
        println!("{name}: logits within {w:.1e} of transformers', inv_freq within {inv_diff:.1e}");
        assert!(w < 1e-5, "{name}: {w}");
        // What strata writes reads back the same.
        assert_eq!(LlamaConfig::from_json(&c.to_json()).unwrap(), c, "{name}");
    }
}

/// Llama 3's rule by hand (in f64) for the fixture's head_dim 8, theta 500000, factor 8,
/// low 1, high 4, original context 256: wavelengths 2π, 167, 4443 and 118,000 positions.
#[test]
fn llama3_rope_scaling_follows_the_published_rule() {
    let c = LlamaConfig::from_file(fixture("llama3-rope/config.json")).unwrap();
    let plain: Vec<f64> = (0..4).map(|i| 500000f64.powf(-(2.0 * i as f64) / 8.0)).collect();
    let wavelen1 = 2.0 * std::f64::consts::PI / plain[1];
    let smooth = (256.0 / wavelen1 - 1.0) / (4.0 - 1.0);
    let by_hand = [
        plain[0],                                            // short: kept
        (1.0 - smooth) * plain[1] / 8.0 + smooth * plain[1], // between: smoothed
        plain[2] / 8.0,                                      // long: divided
        plain[3] / 8.0,
    ];
    for (got, want) in c.rope_inverse_frequencies().iter().zip(by_hand) {
        assert!((f64::from(*got) - want).abs() / want < 1e-6, "{got} vs {want}");
    }
    // transformers 4's form of the same config (a top-level theta and rope_scaling) reads the
    // same.
    let v4 = r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "vocab_size": 32, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
        "torch_dtype": "float32", "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3",
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}}"#;
    assert_eq!(LlamaConfig::from_json(v4).unwrap(), c);
}

#[test]
fn fields_that_change_the_computation_are_read_or_refused_by_name() {
    let base = r#""hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 50"#;
    let read = |extra: &str| LlamaConfig::from_json(&format!("{{{base}, {extra}}}"));
    for (extra, says) in [
        (r#""rope_theta": 0"#, "rope_theta is 0: finite and above 0"),
        (r#""rope_theta": -5.0"#, "rope_theta is -5: finite and above 0"),
        (r#""rms_norm_eps": -1"#, "rms_norm_eps is -1: finite and above 0"),
        (r#""rms_norm_eps": 0"#, "rms_norm_eps is 0"),
        (
            r#""rope_parameters": {"rope_theta": 0.0, "rope_type": "default"}"#,
            "rope_parameters.rope_theta is 0",
        ),
        (
            r#""rope_theta": 10000.0, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}"#,
            "differ",
        ),
        (
            r#""rope_parameters": {"rope_type": "yarn", "factor": 4.0}"#,
            "rope_type \"yarn\" is not supported",
        ),
        (r#""rope_scaling": {"type": "dynamic", "factor": 2.0}"#, "rope_type \"dynamic\""),
        (
            r#""rope_parameters": {"rope_theta": 1e4, "rope_type": "default", "partial": 1}"#,
            "rope_parameters.partial",
        ),
        (
            r#""rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0, "original_max_position_embeddings": 8}"#,
            "high_freq_factor 1 is not above",
        ),
        (
            r#""rope_parameters": {"rope_type": "llama3", "factor": 8.0}"#,
            "low_freq_factor is missing",
        ),
        (r#""model_type": "gemma""#, "not of the Llama family"),
        (r#""hidden_act": "gelu""#, "only silu"),
        (r#""attention_bias": true"#, "attention_bias true"),
        (r#""mlp_bias": true"#, "mlp_bias true"),
        (r#""attention_dropout": 0.1"#, "attention_dropout 0.1"),
        (r#""quantization_config": {"bits": 4}"#, "quantization_config"),
        (r#""partial_rotary_factor": 0.5"#, "partial_rotary_factor"),
        (r#""torch_dtype": "int8""#, "dtype \"int8\""),
        (r#""max_position_embeddings": 0"#, "max_position_embeddings is 0"),
        (r#""head_dim": 7"#, "even width"),
        (r#""sliding_window": 16"#, "set model_type mistral"),
        (r#""model_type": "mistral""#, "sliding_window is missing"),
        (
            r#""model_type": "qwen2", "use_sliding_window": true, "sliding_window": 8, "max_window_layers": 1"#,
            "some layers and not others",
        ),
        (
            r#""model_type": "mistral", "sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"]"#,
            "1 of 2 layers slide",
        ),
    ] {
        let e = read(extra).unwrap_err().to_string();
        assert!(e.contains(says), "{extra}: {e}");
    }
    // Read: a linear scaling, Mistral's window, Qwen2's window on every layer, swish.
    let c = read(r#""rope_scaling": {"type": "linear", "factor": 2.0}, "hidden_act": "swish""#)
        .unwrap();
    assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 2.0 }));
    assert_eq!(
        read(r#""model_type": "mistral", "sliding_window": 8"#).unwrap().sliding_window,
        Some(8)
    );
    let q = read(r#""model_type": "qwen2", "use_sliding_window": true, "sliding_window": 8, "max_window_layers": 0"#)
        .unwrap();
    assert_eq!((q.sliding_window, q.qkv_bias), (Some(8), true));
    assert_eq!(LlamaConfig::from_json(&q.to_json()).unwrap(), q);
    // A config that is not a regular file is refused before it is read (/dev/zero never ends).
    let e = LlamaConfig::from_file("/dev/zero").unwrap_err().to_string();
    assert!(e.contains("not a regular file"), "{e}");
}

/// Qwen2's q/k/v biases train out of core as the rest of a block does: the same losses and
/// final weights as the in-memory twin, bit for bit, and the biases (zeros at first, as
/// transformers starts them) move.
#[test]
fn qwen2_biases_train_out_of_core_as_in_memory() {
    use strata::candle::llama::SeededRng;
    use strata::candle::{put_random_weights, LlamaTwin, LrSchedule, TrainConfig, Trainer};
    let c = LlamaConfig::from_json(
        r#"{"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 61, "max_position_embeddings": 32}"#,
    )
    .unwrap();
    let t = TrainConfig {
        micro_batch: 2,
        seq: 8,
        accum: 2,
        schedule: LrSchedule { peak: 3e-3, min: 3e-4, warmup: 1, total: 3 },
        clip: Some(1.0),
        ..TrainConfig::default()
    };
    let dev = Device::Cpu;
    let budget = 4 * c.block_parameters() * 3 / 2;
    let store = strata::candle::store_for(
        &dev,
        strata::Store::builder()
            .capacity(strata::Tier::Device, budget)
            .prefetch_budget(budget)
            .capacity(strata::Tier::Pinned, 8 << 20),
    )
    .unwrap();
    let weights = put_random_weights(&store, &c, 3, strata::DType::F32).unwrap();
    assert_eq!(weights.len(), 1 + 2 * 12 + 2);
    let init = weights
        .iter()
        .map(|(n, id)| {
            let shape = store.info(*id).unwrap().shape;
            (n.clone(), Tensor::from_vec(store.read_vec::<f32>(*id).unwrap(), shape, &dev).unwrap())
        })
        .collect();
    let mut twin = LlamaTwin::new(c.clone(), t.clone(), init, &dev).unwrap();
    let mut tr = Trainer::new(store, &dev, c.clone(), t.clone(), weights).unwrap();
    let mut rng = SeededRng::new(9);
    for step in 0..3 {
        let b: Vec<Tensor> = (0..t.accum)
            .map(|_| {
                let v: Vec<u32> =
                    (0..t.micro_batch * (t.seq + 1)).map(|_| rng.below(61) as u32).collect();
                Tensor::from_vec(v, (t.micro_batch, t.seq + 1), &dev).unwrap()
            })
            .collect();
        let (got, want) = (tr.step(&b).unwrap().loss, twin.step(&b).unwrap());
        assert_eq!(got.to_bits(), want.to_bits(), "step {step}");
    }
    tr.finish().unwrap();
    for (name, _) in c.tensors() {
        let (got, want) = (tr.read_param(&name).unwrap(), twin.param(&name).unwrap());
        assert_eq!(got, want, "{name}");
        if name.ends_with("q_proj.bias") {
            assert!(got.iter().any(|&x| x != 0.0), "{name} did not train");
        }
    }
}
