//! The Llama decoder of `strata::candle::llama` (CPU candle): configs, seeded initial weights,
//! a KV-cached forward one token at a time against the whole sequence, the loss.

use candle_core::{DType, Device, Tensor};
use strata::candle::llama::{
    block_forward, next_token_loss, random_tensor, random_weights, BlockWeights, KvCache, Rope,
    SeededRng,
};
use strata::candle::LlamaConfig;

fn tiny() -> LlamaConfig {
    LlamaConfig::from_json(
        r#"{"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 40,
            "max_position_embeddings": 16}"#,
    )
    .unwrap()
}

#[test]
fn configs_are_read_with_defaults_and_refused_with_reasons() {
    let c = tiny();
    assert_eq!((c.head_dim, c.rope_theta, c.tie_word_embeddings), (8, 10000.0, false));
    assert_eq!(LlamaConfig::from_json(&c.to_json()).unwrap(), c);
    let base =
        r#""hidden_size": 32, "intermediate_size": 8, "num_hidden_layers": 1, "vocab_size": 5"#;
    for (json, says) in [
        (r#"{"hidden_size": 32}"#.to_string(), "num_attention_heads is missing"),
        (format!(r#"{{{base}, "num_attention_heads": 5}}"#), "not a multiple of 5 heads"),
        (
            format!(r#"{{{base}, "num_attention_heads": 4, "num_key_value_heads": 3}}"#),
            "key/value heads",
        ),
        (
            format!(
                r#"{{{base}, "num_attention_heads": 4, "rope_scaling": {{"rope_type": "llama3"}}}}"#
            ),
            "rope_scaling",
        ),
        (
            format!(r#"{{{base}, "num_attention_heads": 4, "attention_bias": true}}"#),
            "attention_bias",
        ),
        ("[".to_string(), "not JSON"),
    ] {
        let e = LlamaConfig::from_json(&json).unwrap_err().to_string();
        assert!(e.contains(says), "{json}: {e}");
    }
}

#[test]
fn random_tensors_are_seeded_normal_matrices_and_unit_norms() {
    let shape = [300, 1000]; // several chunks, filled on several threads
    let v = random_tensor(5, 3, &shape);
    assert_eq!(v, random_tensor(5, 3, &shape));
    assert_ne!(v, random_tensor(5, 4, &shape));
    assert_ne!(v, random_tensor(6, 3, &shape));
    let n = v.len() as f64;
    let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
    let sd = (v.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum::<f64>() / n).sqrt();
    assert!(mean.abs() < 2e-4 && (sd - 0.02).abs() < 2e-4, "mean {mean}, sd {sd}");
    assert_eq!(random_tensor(5, 0, &[7]), vec![1.0; 7]);
    let c = tiny();
    let w: Vec<_> = random_weights(&c, 1).collect();
    assert_eq!(w.len(), c.tensors().len());
    assert!(w.iter().zip(c.tensors()).all(|((n, s, v), (n2, s2))| *n == n2
        && *s == s2
        && v.len() == s.iter().product::<usize>()));
}

#[test]
fn a_cached_forward_one_token_at_a_time_matches_the_whole_sequence() {
    let c = tiny();
    let dev = Device::Cpu;
    let w: Vec<_> = random_weights(&c, 7).collect();
    let get = |n: &str| {
        let (_, s, v) = w.iter().find(|(name, _, _)| name == n).unwrap();
        Tensor::from_vec(v.clone(), s.as_slice(), &dev)
    };
    let p = LlamaConfig::block_prefix(0);
    let bw = BlockWeights::from_fn(&c, |s| get(&format!("{p}{s}"))).unwrap();
    let rope = Rope::new(&c, 16, &dev).unwrap();
    let mut rng = SeededRng::new(3);
    let xs: Vec<f32> = (0..5 * 32).map(|_| rng.normal(1.0) as f32).collect();
    let x = Tensor::from_vec(xs, (1, 5, 32), &dev).unwrap();
    let whole = block_forward(&c, &bw, &x, &rope, 0, None).unwrap();
    let mut cache = KvCache::new();
    let mut parts = Vec::new();
    for t in 0..5 {
        let xt = x.narrow(1, t, 1).unwrap();
        parts.push(block_forward(&c, &bw, &xt, &rope, t, Some(&mut cache)).unwrap());
    }
    assert_eq!(cache.len(), 5);
    let stepped = Tensor::cat(&parts, 1).unwrap();
    let diff = (whole - stepped).unwrap().abs().unwrap().max_all().unwrap();
    assert!(diff.to_scalar::<f32>().unwrap() < 1e-5);
    // A cache of another length than the position is refused.
    let xt = x.narrow(1, 0, 1).unwrap();
    assert!(block_forward(&c, &bw, &xt, &rope, 2, Some(&mut cache)).is_err());
}

#[test]
fn the_loss_of_uniform_logits_is_log_vocab() {
    let logits = Tensor::zeros((3, 8), DType::F32, &Device::Cpu).unwrap();
    let targets = Tensor::new(&[1u32, 5, 7], &Device::Cpu).unwrap();
    let l = next_token_loss(&logits, &targets, 1.0 / 3.0).unwrap().to_scalar::<f32>().unwrap();
    assert!((l - 8f32.ln()).abs() < 1e-6);
}
