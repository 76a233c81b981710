//! Generation with the Llama decoder (CPU candle, host backend): a tiny random Llama out of
//! core (its weights streamed under a Device budget smaller than two blocks, its KV cache in the
//! store) against the same model in memory, bit for bit, and against candle-transformers' own
//! `llama` within a tolerance; sampling; configs of the Llama family.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use strata::candle::llama::random_weights;
use strata::candle::{
    generate, generate_batch, put_random_weights, CausalLm, InMemoryLlama, Layers, LlamaConfig,
    OutOfCoreLlama, Sampler, Sampling,
};
use strata::{Group, Store, Tier};

pub(crate) fn tiny() -> LlamaConfig {
    LlamaConfig::from_json(
        r#"{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97,
            "max_position_embeddings": 64, "rms_norm_eps": 1e-5}"#,
    )
    .unwrap()
}

pub(crate) const SEED: u64 = 11;

/// A store whose Device tier holds less than two blocks' weights, and the tiny model in it.
pub(crate) fn out_of_core(c: &LlamaConfig) -> OutOfCoreLlama {
    let budget = 4 * c.block_parameters() * 3 / 2;
    let builder = Store::builder()
        .capacity(Tier::Device, budget)
        .prefetch_budget(budget)
        .capacity(Tier::Pinned, 4 << 20)
        .capacity(Tier::Mapped, 0);
    let store = strata::candle::store_for(&Device::Cpu, builder).unwrap();
    let weights = put_random_weights(&store, c, SEED, strata::DType::F32).unwrap();
    let layers = Layers::new(store, weights, &Device::Cpu).unwrap();
    OutOfCoreLlama::new(layers, c, DType::F32).unwrap()
}

pub(crate) fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

/// Each forward's logits for `prompt` and then `tokens` fed one at a time.
pub(crate) fn logits_of<M: CausalLm>(m: &M, prompt: &[u32], tokens: &[u32]) -> Vec<Tensor> {
    let mut cache = m.new_cache(1, prompt.len() + tokens.len()).unwrap();
    let dev = m.device();
    let mut out = vec![m
        .forward(&Tensor::new(prompt, dev).unwrap().unsqueeze(0).unwrap(), &mut cache)
        .unwrap()];
    for &t in tokens {
        out.push(m.forward(&Tensor::new(&[[t]], dev).unwrap(), &mut cache).unwrap());
    }
    out
}

const PROMPT: [u32; 5] = [3, 14, 15, 92, 6];

#[test]
fn a_tiny_random_llama_generates_the_same_tokens_in_memory_and_out_of_core() {
    let c = tiny();
    let dev = Device::Cpu;
    let mem = InMemoryLlama::random(&c, SEED, DType::F32, &dev).unwrap();
    let ooc = out_of_core(&c);
    let store = ooc.layers().store().clone();
    let tensors_before = store.ids().len();
    let sampled = Sampling::Random { temperature: 0.9, top_k: Some(40), top_p: Some(0.9), seed: 5 };
    for sampling in [Sampling::Greedy, sampled] {
        let want = generate(&mem, &PROMPT, 16, &sampling).unwrap();
        let got = generate(&ooc, &PROMPT, 16, &sampling).unwrap();
        assert_eq!(got.tokens, want.tokens, "{sampling:?}");
        assert_eq!(got.seconds.len(), 16);
        assert!(want.tokens.iter().all(|&t| (t as usize) < c.vocab_size));
    }
    // The logits of every step, bit for bit.
    let tokens = generate(&mem, &PROMPT, 8, &Sampling::Greedy).unwrap().tokens;
    let want: Vec<_> = logits_of(&mem, &PROMPT, &tokens).iter().map(bits).collect();
    let got: Vec<_> = logits_of(&ooc, &PROMPT, &tokens).iter().map(bits).collect();
    assert_eq!(got, want);
    // The weights were streamed, and the KV caches went away with their generations.
    let s = store.stats();
    assert!(s.evictions > 0 && s.used(Tier::Device) <= store.stats().capacity(Tier::Device));
    assert_eq!(store.ids().len(), tensors_before);
    // With the first block resident: the same logits, and that block is not fetched again.
    let ooc = out_of_core(&c).with_resident(1).unwrap();
    assert_eq!(ooc.resident_blocks(), 1);
    let fetched = ooc.layers().transfers().unwrap().tensors;
    let got: Vec<_> = logits_of(&ooc, &PROMPT, &tokens).iter().map(bits).collect();
    assert_eq!(got, want);
    let per_forward = 2 * 9 + 2; // two streamed blocks and the head
    assert_eq!(ooc.layers().transfers().unwrap().tensors - fetched, 9 * per_forward as u64);
}

#[test]
fn the_kv_cache_lives_in_the_store_as_activations_and_spills_to_host_memory() {
    let c = tiny();
    let ooc = out_of_core(&c);
    let store = ooc.layers().store().clone();
    let mut cache = ooc.new_cache(1, 40).unwrap();
    let ids = cache.tensor_ids();
    assert_eq!(ids.len(), 2 * c.num_hidden_layers);
    let kv_bytes = ids.len() as u64 * 40 * 2 * 16 * 4;
    let in_host = store.bytes_by_group(Tier::Pinned)[Group::Activation.index()];
    assert_eq!(in_host, kv_bytes, "homed in Pinned");
    let dev = Device::Cpu;
    ooc.forward(&Tensor::new(&[PROMPT], &dev).unwrap(), &mut cache).unwrap();
    ooc.forward(&Tensor::new(&[[7u32]], &dev).unwrap(), &mut cache).unwrap();
    assert_eq!(cache.len(), 6);
    for &id in &ids {
        let info = store.info(id).unwrap();
        assert_eq!(info.group, Group::Activation);
        // Written on the device and released: a host copy holds the positions written.
        assert!(info.tiers.contains(&Tier::Pinned), "{:?}", info.tiers);
    }
    // Past the cache's capacity, and a wrong batch: errors that say so, the cache unchanged.
    let long = Tensor::zeros((1, 35), DType::U32, &dev).unwrap();
    let e = ooc.forward(&long, &mut cache).unwrap_err().to_string();
    assert!(e.contains("a larger cache"), "{e}");
    let two = Tensor::zeros((2, 1), DType::U32, &dev).unwrap();
    assert!(ooc.forward(&two, &mut cache).is_err());
    let e = ooc.forward(&Tensor::new(&[[97u32]], &dev).unwrap(), &mut cache).unwrap_err();
    assert!(e.to_string().contains("token id 97 past the vocabulary of 97"), "{e}");
    assert_eq!(cache.len(), 6);
    let e = ooc.new_cache(1, 65).unwrap_err().to_string();
    assert!(e.contains("max_position_embeddings 64"), "{e}");
    drop(cache);
    for id in ids {
        assert!(store.info(id).is_err(), "removed with the cache");
    }
}

/// candle-transformers' in-memory `llama` on the same weights: its logits are the reference.
/// Its RMSNorm, softmax and RoPE are candle-nn's fused ops where this decoder's are plain ops
/// (they have gradients, for training), so the logits agree to rounding, not bit for bit.
#[test]
fn logits_are_within_tolerance_of_candle_transformers_llama() {
    use candle_transformers::models::llama as ct;
    let c = tiny();
    let dev = Device::Cpu;
    let weights: HashMap<String, Tensor> = random_weights(&c, SEED)
        .map(|(n, s, v)| (n, Tensor::from_vec(v, s, &dev).unwrap()))
        .collect();
    let cfg: ct::LlamaConfig = serde_json::from_str(&c.to_json()).unwrap();
    let cfg = cfg.into_config(false);
    let theirs = ct::Llama::load(
        candle_nn::VarBuilder::from_tensors(weights.clone(), DType::F32, &dev),
        &cfg,
    )
    .unwrap();
    let mut cache = ct::Cache::new(true, DType::F32, &cfg, &dev).unwrap();
    let ooc = out_of_core(&c);
    let tokens = generate(&ooc, &PROMPT, 6, &Sampling::Greedy).unwrap().tokens;
    let ours = logits_of(&ooc, &PROMPT, &tokens[..5]);
    let mut pos = 0;
    let mut worst = 0f32;
    for (k, mine) in ours.iter().enumerate() {
        let input = if k == 0 { PROMPT.to_vec() } else { vec![tokens[k - 1]] };
        let n = input.len();
        let ids = Tensor::new(input.as_slice(), &dev).unwrap().unsqueeze(0).unwrap();
        let want = theirs.forward(&ids, pos, &mut cache).unwrap();
        pos += n;
        let diff = (mine - &want).unwrap().abs().unwrap().max_all().unwrap();
        let scale = want.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        worst = worst.max(diff.to_scalar::<f32>().unwrap() / scale);
        // The same next token.
        let a = mine.argmax(1).unwrap().to_vec1::<u32>().unwrap();
        let b = want.argmax(1).unwrap().to_vec1::<u32>().unwrap();
        assert_eq!(a, b, "step {k}");
    }
    println!("largest logit difference from candle-transformers' llama: {worst:.2e} of the largest logit");
    assert!(worst < 1e-5, "{worst}");
}

#[test]
fn sampling_is_seeded_and_its_limits_hold() {
    let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 50) as f32 / 10.0).collect();
    let best = Sampler::new(Sampling::Greedy).unwrap().sample(&logits).unwrap();
    assert_eq!(logits[best as usize], 4.9);
    let random = |top_k, top_p, seed| Sampling::Random { temperature: 1.0, top_k, top_p, seed };
    let draw = |s: Sampling| {
        let mut sm = Sampler::new(s).unwrap();
        (0..200).map(|_| sm.sample(&logits).unwrap()).collect::<Vec<_>>()
    };
    assert_eq!(draw(random(None, None, 1)), draw(random(None, None, 1)));
    assert_ne!(draw(random(None, None, 1)), draw(random(None, None, 2)));
    assert!(draw(random(Some(1), None, 3)).iter().all(|&t| t == best));
    assert!(draw(random(None, Some(1e-6), 3)).iter().all(|&t| t == best));
    let top3: Vec<u32> = {
        let mut o: Vec<u32> = (0..50).collect();
        o.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        o[..3].to_vec()
    };
    let d = draw(random(Some(3), None, 4));
    assert!(d.iter().all(|t| top3.contains(t)));
    assert!(top3.iter().all(|t| d.contains(t)), "each of the 3 drawn in 200");
    for bad in [
        Sampling::Random { temperature: 0.0, top_k: None, top_p: None, seed: 0 },
        random(Some(0), None, 0),
        random(None, Some(1.5), 0),
    ] {
        assert!(Sampler::new(bad).is_err());
    }
    assert!(Sampler::new(Sampling::Greedy).unwrap().sample(&[1.0, f32::NAN]).is_err());
}

#[test]
fn llama_family_configs_are_read_or_refused_with_the_reason() {
    let base = r#""hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 50,
        "max_position_embeddings": 64"#;
    let mistral = LlamaConfig::from_json(&format!(
        r#"{{{base}, "model_type": "mistral", "sliding_window": 16, "hidden_act": "silu"}}"#
    ))
    .unwrap();
    assert_eq!(mistral.sliding_window, Some(16));
    assert_eq!(LlamaConfig::from_json(&mistral.to_json()).unwrap(), mistral);
    let m = InMemoryLlama::random(&mistral, 1, DType::F32, &Device::Cpu).unwrap();
    assert!(m.new_cache(1, 40).is_ok(), "a cache longer than the window");
    // A window that is off is no window.
    let off = LlamaConfig::from_json(&format!(
        r#"{{{base}, "model_type": "qwen2", "sliding_window": 16, "use_sliding_window": false}}"#
    ))
    .unwrap();
    assert_eq!(off.sliding_window, None);
    for (extra, says) in [
        (r#""model_type": "gemma""#, "not of the Llama family"),
        (r#""hidden_act": "gelu""#, "only silu"),
    ] {
        let e = LlamaConfig::from_json(&format!("{{{base}, {extra}}}")).unwrap_err().to_string();
        assert!(e.contains(says), "{extra}: {e}");
    }
}

/// The example's path: a checkpoint written to a file and loaded back generates what the
/// random weights it was made from generate.
#[test]
fn a_saved_checkpoint_loads_and_generates_the_same_tokens() {
    let c = tiny();
    let dir = tempfile::tempdir().unwrap();
    let ooc = out_of_core(&c);
    let store = ooc.layers().store().clone();
    let ids: Vec<_> = c.tensors().into_iter().map(|(n, _)| store.lookup(&n).unwrap()).collect();
    let file = dir.path().join("model.safetensors");
    store.save_safetensors(&file, &ids).unwrap();
    let want = generate(&ooc, &PROMPT, 8, &Sampling::Greedy).unwrap().tokens;
    let store2 = strata::candle::store_for(&Device::Cpu, Store::builder()).unwrap();
    let weights = strata::candle::load_weights(&store2, &c, &file).unwrap();
    let layers = Layers::new(store2, weights, &Device::Cpu).unwrap();
    let loaded = OutOfCoreLlama::new(layers, &c, DType::F32).unwrap();
    assert_eq!(generate(&loaded, &PROMPT, 8, &Sampling::Greedy).unwrap().tokens, want);
    let _ = Arc::new(loaded);
}

/// Three prompts of different lengths, generated at once: each sequence gets the tokens it gets
/// alone (greedy and sampled, in memory and out of core), each forward's logits are its solo
/// logits bit for bit, and out of core one pass of the weights serves the whole batch.
#[test]
fn batched_generation_gives_each_sequence_its_solo_tokens() {
    let c = tiny();
    let dev = Device::Cpu;
    let mem = InMemoryLlama::random(&c, SEED, DType::F32, &dev).unwrap();
    let ooc = out_of_core(&c);
    let prompts: [&[u32]; 3] = [&PROMPT, &[42], &[1, 2, 3, 4, 5, 6, 7, 8, 9]];
    let sampled = Sampling::Random { temperature: 0.9, top_k: Some(40), top_p: None, seed: 5 };
    for sampling in [Sampling::Greedy, sampled] {
        let solo: Vec<Vec<u32>> =
            prompts.iter().map(|p| generate(&mem, p, 12, &sampling).unwrap().tokens).collect();
        let mut streamed = vec![Vec::new(); 3];
        let got = generate_batch(&ooc, &prompts, 12, &sampling, &[], |i, t| {
            streamed[i].push(t);
            Ok(())
        })
        .unwrap();
        let got: Vec<Vec<u32>> = got.into_iter().map(|g| g.tokens).collect();
        assert_eq!(got, solo, "out of core, {sampling:?}");
        assert_eq!(streamed, solo);
        let got: Vec<Vec<u32>> = generate_batch(&mem, &prompts, 12, &sampling, &[], |_, _| Ok(()))
            .unwrap()
            .into_iter()
            .map(|g| g.tokens)
            .collect();
        assert_eq!(got, solo, "in memory, {sampling:?}");
        // A stop token ends the sequence that draws it; the others go on as alone.
        let stop = solo[1][3];
        let first = |s: &[u32]| s.iter().position(|&t| t == stop).map_or(s.len(), |k| k + 1);
        let got = generate_batch(&ooc, &prompts, 12, &sampling, &[stop], |_, _| Ok(())).unwrap();
        for (g, s) in got.iter().zip(&solo) {
            assert_eq!(g.tokens, s[..first(s)]);
            assert_eq!(g.stopped, first(s) < s.len() || s.last() == Some(&stop));
        }
    }
    // The logits of one batched forward are each sequence's own, bit for bit; and the batch
    // fetches each block's weights once.
    let mut solo_caches: Vec<_> =
        prompts.iter().map(|p| ooc.new_cache(1, p.len() + 1).unwrap()).collect();
    let ids: Vec<Tensor> =
        prompts.iter().map(|p| Tensor::new(*p, &dev).unwrap().unsqueeze(0).unwrap()).collect();
    let fetched = || ooc.layers().transfers().unwrap().tensors;
    let before = fetched();
    let want: Vec<_> = ids
        .iter()
        .zip(solo_caches.iter_mut())
        .map(|(x, k)| bits(&ooc.forward(x, k).unwrap()))
        .collect();
    let per_sequence = (fetched() - before) / 3;
    let mut caches: Vec<_> =
        prompts.iter().map(|p| ooc.new_cache(1, p.len() + 1).unwrap()).collect();
    let before = fetched();
    let got: Vec<_> = ooc.forward_each(&ids, &mut caches).unwrap().iter().map(bits).collect();
    assert_eq!(got, want);
    assert_eq!(fetched() - before, per_sequence, "one pass of the weights for the batch");
    assert!(caches.iter().zip(&prompts).all(|(k, p)| k.len() == p.len()));
    // Mismatched inputs and caches: an error, the caches unchanged.
    assert!(ooc.forward_each(&ids[..2], &mut caches).is_err());
    assert!(caches.iter().zip(&prompts).all(|(k, p)| k.len() == p.len()));
}

/// Generation's inputs are checked before anything is allocated (issue 31: `--max-new
/// 18446744073709551615` panicked with `capacity overflow`; a NaN or negative temperature
/// decoded greedily; top-k and top-p without a temperature were ignored).
#[test]
fn generation_inputs_are_checked_with_errors_that_say_what() {
    let c = tiny();
    let mem = InMemoryLlama::random(&c, SEED, DType::F32, &Device::Cpu).unwrap();
    let ooc = out_of_core(&c);
    for max_new in [usize::MAX, usize::MAX / 2, 61] {
        let e = generate(&mem, &PROMPT, max_new, &Sampling::Greedy).unwrap_err().to_string();
        assert!(e.contains("max_position_embeddings 64") || e.contains("more positions"), "{e}");
        let e = generate(&ooc, &PROMPT, max_new, &Sampling::Greedy).unwrap_err().to_string();
        assert!(e.contains(&format!("max_new {max_new}")), "{e}");
    }
    assert!(
        generate(&ooc, &PROMPT, 60, &Sampling::Greedy).is_ok(),
        "5 + 60 - 1 positions fit in 64"
    );
    assert!(generate(&mem, &[], 4, &Sampling::Greedy).is_err());
    for (t, k, p, says) in [
        (Some(f64::NAN), None, None, "temperature NaN"),
        (Some(-1.0), None, None, "temperature -1"),
        (Some(f64::INFINITY), None, None, "temperature inf"),
        (None, Some(0), None, "top_k 0 without a temperature"),
        (None, None, Some(0.0), "top_p 0 without a temperature"),
        (Some(0.0), Some(5), None, "top_k 5 without a temperature"),
        (Some(0.7), Some(0), None, "top_k 0"),
        (Some(0.7), None, Some(0.0), "top_p 0"),
        (Some(0.7), None, Some(1.5), "top_p 1.5"),
    ] {
        let e = Sampling::from_flags(t, k, p, 0).unwrap_err().to_string();
        assert!(e.contains(says), "{t:?} {k:?} {p:?}: {e}");
    }
    assert_eq!(Sampling::from_flags(Some(0.0), None, None, 0).unwrap(), Sampling::Greedy);
    assert!(matches!(
        Sampling::from_flags(Some(0.7), Some(3), Some(0.9), 1).unwrap(),
        Sampling::Random { top_k: Some(3), .. }
    ));
}

/// Mistral's sliding window in generation: past the window the logits are not those of full
/// attention (the window is applied, also through a KV cache longer than it), within it they are,
/// and out of core equals in memory bit for bit.
#[test]
fn a_sliding_window_is_kept_through_a_long_cache() {
    let mut windowed = tiny();
    windowed.sliding_window = Some(4);
    let full = tiny();
    let tokens: Vec<u32> = (0..12).map(|i| (i * 7 + 1) % 97).collect();
    let a = logits_of(
        &InMemoryLlama::random(&windowed, SEED, DType::F32, &Device::Cpu).unwrap(),
        &PROMPT,
        &tokens,
    );
    let b = logits_of(
        &InMemoryLlama::random(&full, SEED, DType::F32, &Device::Cpu).unwrap(),
        &PROMPT,
        &tokens,
    );
    // The prompt's last position sees 5 positions, one more than the window: it differs already.
    assert_ne!(bits(&a[0]), bits(&b[0]), "the window changed nothing");
    let short: Vec<Tensor> = logits_of(
        &InMemoryLlama::random(&windowed, SEED, DType::F32, &Device::Cpu).unwrap(),
        &PROMPT[..3],
        &[],
    );
    let short_full = logits_of(
        &InMemoryLlama::random(&full, SEED, DType::F32, &Device::Cpu).unwrap(),
        &PROMPT[..3],
        &[],
    );
    assert_eq!(bits(&short[0]), bits(&short_full[0]), "within the window nothing changes");
    let ooc = logits_of(&out_of_core(&windowed), &PROMPT, &tokens);
    for (x, y) in a.iter().zip(&ooc) {
        assert_eq!(bits(x), bits(y), "out of core differs from in memory");
    }
}

/// Issue 40, finding 6: an absurd `max_position_embeddings` with a huge `max_new` made a KV
/// cache whose size wrapped to 0 and aborted; it is refused, in and out of core, naming the
/// cache's positions.
#[test]
fn a_kv_cache_whose_size_overflows_or_exceeds_memory_is_refused() {
    let mut c = tiny();
    c.max_position_embeddings = usize::MAX;
    let mem = InMemoryLlama::random(&c, SEED, DType::F32, &Device::Cpu).unwrap();
    let ooc = out_of_core(&c);
    for max_new in [usize::MAX / 2, 1 << 60, 1 << 40] {
        for e in [
            generate(&mem, &PROMPT, max_new, &Sampling::Greedy).unwrap_err().to_string(),
            generate(&ooc, &PROMPT, max_new, &Sampling::Greedy).unwrap_err().to_string(),
        ] {
            assert!(e.contains("KV cache of") && e.contains("positions"), "{max_new}: {e}");
            assert!(e.contains("overflows") || e.contains("host memory"), "{max_new}: {e}");
        }
    }
}
