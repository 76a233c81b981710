//! LoRA out of core (CPU candle, host backend): adapters over a frozen base trained by
//! `strata::candle::Trainer` under a Device budget smaller than two blocks, against the
//! in-memory twin bit for bit; the base unchanged; PEFT's adapter files written, read back and
//! refused where they would change the computation; a LoRA run saved and resumed; the merged
//! export; the loss on some targets only (masks), against a hand computation.

use std::collections::HashMap;

use candle_core::{Device, Tensor};
use strata::candle::lora::LoraConfig;
use strata::candle::lora::{merge_adapter_into, read_adapter, ADAPTER_CONFIG, ADAPTER_FILE};
use strata::candle::{
    load_weights, put_random_weights, CausalLm, InMemoryLlama, LlamaConfig, LlamaTwin, TrainConfig,
    Trainer,
};
use strata::optim::Engine;
use strata::{DType, Tier};

use super::train::{batches, bits, store, tiny, train_config, trainer};

const ALL: [&str; 7] =
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];

fn lora_config(clip: Option<f64>, targets: &[&str]) -> TrainConfig {
    TrainConfig {
        lora: Some(LoraConfig { seed: 7, ..LoraConfig::new(4, 8.0, targets) }),
        ..train_config(clip, Engine::Cpu, &[])
    }
}

/// A trainer and its twin over the same base of `dtype`.
fn pair(c: &LlamaConfig, t: &TrainConfig, seed: u64, dtype: DType) -> (Trainer, LlamaTwin) {
    let s = store(c);
    let weights = put_random_weights(&s, c, seed, dtype).unwrap();
    let init: HashMap<String, Tensor> = weights
        .iter()
        .map(|(n, id)| {
            let shape = s.info(*id).unwrap().shape;
            let t = match dtype {
                DType::BF16 => Tensor::from_vec(
                    s.read_vec::<half::bf16>(*id).unwrap(),
                    shape.as_slice(),
                    &Device::Cpu,
                ),
                _ => Tensor::from_vec(
                    s.read_vec::<f32>(*id).unwrap(),
                    shape.as_slice(),
                    &Device::Cpu,
                ),
            };
            (n.clone(), t.unwrap())
        })
        .collect();
    let tr = Trainer::new(s, &Device::Cpu, c.clone(), t.clone(), weights).unwrap();
    let twin = LlamaTwin::new(c.clone(), t.clone(), init, &Device::Cpu).unwrap();
    (tr, twin)
}

fn adapter_names(tr: &Trainer) -> Vec<String> {
    tr.adapters().iter().flat_map(|s| [s.a.0.clone(), s.b.0.clone()]).collect()
}

#[test]
fn lora_out_of_core_equals_lora_in_memory_bit_for_bit_and_leaves_the_base_alone() {
    for (tied, dtype, targets, clip) in [
        (false, DType::F32, &ALL[..], Some(0.5)),
        (true, DType::F32, &["q_proj", "v_proj"][..], None),
        (false, DType::BF16, &["q_proj", "down_proj"][..], Some(1.0)),
    ] {
        let what = format!("tied {tied}, {dtype}, targets {targets:?}, clip {clip:?}");
        let c = tiny(tied);
        let t = lora_config(clip, targets);
        let (mut tr, mut twin) = pair(&c, &t, 11, dtype);
        // The bf16 case against the twin that recomputes as out of core does.
        twin.set_recompute(dtype == DType::BF16);
        let base: Vec<(String, Vec<f32>)> =
            c.tensors().into_iter().map(|(n, _)| (n.clone(), tr.read_param(&n).unwrap())).collect();
        assert_eq!(tr.adapters().len(), c.num_hidden_layers * targets.len(), "{what}");
        for step in 0..5 {
            let b = batches(step, &c, &t);
            let r = tr.step(&b).unwrap();
            let want = twin.step(&b).unwrap();
            assert_eq!(r.loss.to_bits(), want.to_bits(), "{what}: loss of step {step}");
            assert!(r.grad_norm > 0.0, "{what}: the adapters got no gradient");
        }
        tr.finish().unwrap();
        let store = tr.store().clone();
        for n in adapter_names(&tr) {
            assert_eq!(
                bits(&tr.read_param(&n).unwrap()),
                bits(&twin.param(&n).unwrap()),
                "{what}: {n}"
            );
            for suffix in ["grad", "exp_avg", "exp_avg_sq"] {
                assert!(store.lookup(&format!("{n}.{suffix}")).is_some(), "{what}: {n}.{suffix}");
            }
        }
        // B starts at zero (the model starts as the base) and is trained.
        let b0 = &tr.adapters()[0].b.0;
        assert!(tr.read_param(b0).unwrap().iter().any(|&x| x != 0.0), "{what}: {b0} stayed zero");
        // The base: the same bits, no gradient, no optimizer state.
        for (n, before) in base {
            assert_eq!(
                bits(&tr.read_param(&n).unwrap()),
                bits(&before),
                "{what}: base {n} changed"
            );
            assert_eq!(bits(&twin.param(&n).unwrap()), bits(&before), "{what}: twin's {n} changed");
            for suffix in ["grad", "master", "exp_avg", "exp_avg_sq"] {
                assert!(store.lookup(&format!("{n}.{suffix}")).is_none(), "{what}: {n}.{suffix}");
            }
        }
        let s = store.stats();
        let grads = s.group_bytes(strata::Group::Grad, Tier::Pinned);
        let adapter_params: u64 = tr
            .adapters()
            .iter()
            .map(|s| (s.a.1.iter().product::<usize>() + s.b.1.iter().product::<usize>()) as u64)
            .sum();
        assert_eq!(grads, 4 * adapter_params, "{what}: gradients only for the adapters");
    }
}

#[test]
fn a_target_that_names_no_linear_is_refused() {
    let c = tiny(false);
    let s = store(&c);
    let w = put_random_weights(&s, &c, 1, DType::F32).unwrap();
    let e = Trainer::new(s, &Device::Cpu, c.clone(), lora_config(None, &["q_proj", "qkv"]), w)
        .unwrap_err()
        .to_string();
    assert!(e.contains("LoRA target qkv names none"), "{e}");
    let bad = TrainConfig {
        lora: Some(LoraConfig::new(0, 8.0, &["q_proj"])),
        ..train_config(None, Engine::Cpu, &[])
    };
    let s = store(&c);
    let w = put_random_weights(&s, &c, 1, DType::F32).unwrap();
    let e = Trainer::new(s, &Device::Cpu, c, bad, w).unwrap_err().to_string();
    assert!(e.contains("LoRA rank 0"), "{e}");
}

#[test]
fn a_peft_adapter_written_here_reads_back_and_a_merged_export_computes_the_same_model() {
    let c = tiny(false);
    let t = lora_config(None, &["q_proj", "v_proj", "up_proj"]);
    let (mut tr, mut twin) = pair(&c, &t, 12, DType::F32);
    for step in 0..2 {
        let b = batches(step, &c, &t);
        tr.step(&b).unwrap();
        twin.step(&b).unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    tr.set_notes([("base_model".to_string(), "/models/tiny".to_string())].into());
    tr.save_adapter(dir.path()).unwrap();

    // PEFT's names and config.
    let bytes = std::fs::read(dir.path().join(ADAPTER_FILE)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names = st.names();
    names.sort();
    assert_eq!(names.len(), 3 * 3 * 2);
    assert_eq!(names[0], "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight");
    assert!(names.contains(&"base_model.model.model.layers.2.self_attn.q_proj.lora_B.weight"));
    let a = st.tensor("base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight").unwrap();
    assert_eq!((a.dtype(), a.shape()), (safetensors::Dtype::F32, &[4, 64][..]));
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join(ADAPTER_CONFIG)).unwrap())
            .unwrap();
    assert_eq!(cfg["peft_type"], "LORA");
    assert_eq!((cfg["r"].as_u64(), cfg["lora_alpha"].as_u64()), (Some(4), Some(8)));
    assert_eq!(cfg["target_modules"], serde_json::json!(["q_proj", "up_proj", "v_proj"]));
    assert_eq!(cfg["base_model_name_or_path"], "/models/tiny");
    let (read, tensors) = read_adapter(dir.path()).unwrap();
    assert_eq!(
        read,
        LoraConfig {
            targets: vec!["q_proj".into(), "up_proj".into(), "v_proj".into()],
            seed: 0,
            ..t.lora.clone().unwrap()
        }
    );
    assert_eq!(tensors.len(), 18);

    // Loaded into a new run (other initial adapters): the same values, bit for bit.
    let (mut other, _) = pair(
        &c,
        &TrainConfig {
            lora: Some(LoraConfig { seed: 99, ..t.lora.clone().unwrap() }),
            ..t.clone()
        },
        12,
        DType::F32,
    );
    let n0 = &tr.adapters()[0].a.0;
    assert_ne!(bits(&other.read_param(n0).unwrap()), bits(&tr.read_param(n0).unwrap()));
    other.load_adapter(dir.path()).unwrap();
    for n in adapter_names(&tr) {
        assert_eq!(bits(&other.read_param(&n).unwrap()), bits(&tr.read_param(&n).unwrap()), "{n}");
    }
    // Another rank is refused, naming it; nothing is written.
    let (mut r8, _) = pair(
        &c,
        &TrainConfig {
            lora: Some(LoraConfig::new(8, 8.0, &["q_proj", "v_proj", "up_proj"])),
            ..t.clone()
        },
        12,
        DType::F32,
    );
    let before = r8.read_param(n0).unwrap();
    let e = r8.load_adapter(dir.path()).unwrap_err().to_string();
    assert!(e.contains("LoRA rank is 4, this one's 8"), "{e}");
    assert_eq!(bits(&r8.read_param(n0).unwrap()), bits(&before));

    // The merged export is a plain checkpoint computing the adapted model.
    let merged = dir.path().join("merged");
    tr.save_merged(&merged).unwrap();
    let s = store(&c);
    let w = load_weights(&s, &c, merged.join("model.safetensors.index.json")).unwrap();
    let weights: HashMap<String, Tensor> = w
        .iter()
        .map(|(n, id)| {
            let shape = s.info(*id).unwrap().shape;
            (
                n.clone(),
                Tensor::from_vec(s.read_vec::<f32>(*id).unwrap(), shape.as_slice(), &Device::Cpu)
                    .unwrap(),
            )
        })
        .collect();
    let model = InMemoryLlama::new(&c, &weights, candle_core::DType::F32, &Device::Cpu).unwrap();
    let ids = Tensor::new(&[[3u32, 14, 15, 92, 65, 35, 89, 79]], &Device::Cpu).unwrap();
    let got = model.forward(&ids, &mut model.new_cache(1, 8).unwrap()).unwrap();
    // The twin's own model generates with the adapters unmerged, on its very tensors.
    let generator = twin.generator().unwrap();
    let want = generator.forward(&ids, &mut generator.new_cache(1, 8).unwrap()).unwrap();
    let (g, w) = (
        got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
    );
    let top = w.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = g.iter().zip(&w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(diff <= 1e-5 * top, "merged against unmerged: {diff} of {top}");
    // And the adapters matter: the base alone computes other logits.
    let base_twin = LlamaTwin::new(
        c.clone(),
        train_config(None, Engine::Cpu, &[]),
        weights_of(&tr, &c),
        &Device::Cpu,
    )
    .unwrap();
    let bg = base_twin.generator().unwrap();
    let base = bg
        .forward(&ids, &mut bg.new_cache(1, 8).unwrap())
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert!(base.iter().zip(&w).any(|(a, b)| (a - b).abs() > 100.0 * diff.max(1e-7)));
}

/// Every tensor's bytes, by name.
fn bytes_of(s: &strata::Store, w: &[(String, strata::TensorId)]) -> HashMap<String, Vec<u8>> {
    w.iter().map(|(n, id)| (n.clone(), s.read(*id).unwrap())).collect()
}

#[test]
fn an_adapter_merged_into_the_store_is_the_merged_export_bit_for_bit_and_a_wrong_one_changes_nothing(
) {
    let c = tiny(false);
    let t = lora_config(None, &["q_proj", "v_proj", "up_proj"]);
    for dtype in [DType::BF16, DType::F32] {
        let (mut tr, _) = pair(&c, &t, 12, dtype);
        for step in 0..2 {
            tr.step(&batches(step, &c, &t)).unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        tr.save_adapter(dir.path().join("adapter")).unwrap();
        tr.save_merged(dir.path().join("merged")).unwrap();

        // The base, loaded in place from a file: merged in the store, the file untouched.
        let base = dir.path().join("base.safetensors");
        let s0 = store(&c);
        let w0 = put_random_weights(&s0, &c, 12, dtype).unwrap();
        s0.save_safetensors(&base, &w0.iter().map(|(_, id)| *id).collect::<Vec<_>>()).unwrap();
        let file_before = std::fs::read(&base).unwrap();
        let s = store(&c);
        let w = load_weights(&s, &c, &base).unwrap();
        let before = bytes_of(&s, &w);
        let m = merge_adapter_into(&s, &w, dir.path().join("adapter")).unwrap();
        assert_eq!((m.config.rank, m.config.alpha), (4, 8.0));
        assert_eq!(m.linears.len(), 3 * 3, "{:?}", m.linears);
        assert_eq!(m.linears[0], "model.layers.0.self_attn.q_proj.weight");
        assert_eq!(std::fs::read(&base).unwrap(), file_before, "the base's file was written");
        let sm = store(&c);
        let wm = load_weights(&sm, &c, dir.path().join("merged")).unwrap();
        let (got, want) = (bytes_of(&s, &w), bytes_of(&sm, &wm));
        for (name, bytes) in &want {
            assert!(got[name] == *bytes, "{name} ({dtype:?}): not the merged export's bytes");
            let adapted = m.linears.contains(name);
            assert_eq!(got[name] != before[name], adapted, "{name}: changed {}", !adapted);
        }

        // An adapter for another model's shapes is refused before anything is written.
        let other = LlamaConfig::from_json(
            r#"{"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97,
                "max_position_embeddings": 32, "tie_word_embeddings": false}"#,
        )
        .unwrap();
        let so = store(&other);
        let wo = put_random_weights(&so, &other, 3, dtype).unwrap();
        let kept = bytes_of(&so, &wo);
        let e = merge_adapter_into(&so, &wo, dir.path().join("adapter")).unwrap_err().to_string();
        assert!(e.contains("up_proj.lora_A.weight is [4, 64] and its B [128, 4]"), "{e}");
        assert!(e.contains("up_proj.weight is [96, 64]"), "{e}");
        assert!(bytes_of(&so, &wo) == kept, "a refused adapter changed a tensor");
        // A model without the adapted linears: named.
        let kept = bytes_of(&s0, &w0);
        let no_v: Vec<_> = w0.iter().filter(|(n, _)| !n.contains("v_proj")).cloned().collect();
        let e = merge_adapter_into(&s0, &no_v, dir.path().join("adapter")).unwrap_err();
        assert!(e.to_string().contains("v_proj.weight, which the model does not have"), "{e}");
        assert!(bytes_of(&s0, &w0) == kept, "a refused adapter changed a tensor");

        // An A without its B, a B without its A, a pair the config does not target: refused.
        let bytes = std::fs::read(dir.path().join("adapter").join(ADAPTER_FILE)).unwrap();
        let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let pre = "base_model.model.model.layers.1.self_attn.";
        let cfg = std::fs::read_to_string(dir.path().join("adapter").join(ADAPTER_CONFIG)).unwrap();
        for (drop, config, want) in [
            (
                Some(format!("{pre}v_proj.lora_B.weight")),
                cfg.clone(),
                "v_proj.lora_A.weight has no model.layers.1.self_attn.v_proj.lora_B.weight",
            ),
            (
                Some(format!("{pre}q_proj.lora_A.weight")),
                cfg.clone(),
                "q_proj.lora_B.weight has no model.layers.1.self_attn.q_proj.lora_A.weight",
            ),
            (
                None,
                {
                    let mut v: serde_json::Value = serde_json::from_str(&cfg).unwrap();
                    v["target_modules"] = serde_json::json!(["up_proj", "v_proj"]);
                    v.to_string()
                },
                "q_proj.weight, which the adapter's target_modules",
            ),
        ] {
            let bad = dir.path().join("bad");
            let _ = std::fs::remove_dir_all(&bad);
            std::fs::create_dir_all(&bad).unwrap();
            let keep: Vec<(String, safetensors::tensor::TensorView)> =
                file.tensors().into_iter().filter(|(n, _)| Some(n) != drop.as_ref()).collect();
            safetensors::serialize_to_file(keep, None, &bad.join(ADAPTER_FILE)).unwrap();
            std::fs::write(bad.join(ADAPTER_CONFIG), &config).unwrap();
            let e = merge_adapter_into(&s0, &w0, &bad).unwrap_err().to_string();
            assert!(e.contains(want), "{want}: {e}");
            assert!(bytes_of(&s0, &w0) == kept, "a refused adapter changed a tensor");
        }
        // A NaN (a diverged run's adapter): refused, naming the tensor.
        let bad = dir.path().join("nan");
        std::fs::create_dir_all(&bad).unwrap();
        let nan = vec![f32::NAN; 4 * 64];
        let name = format!("{pre}v_proj.lora_A.weight");
        let views: Vec<(String, safetensors::tensor::TensorView)> = file
            .tensors()
            .into_iter()
            .map(|(n, v)| match n == name {
                true => (
                    n,
                    safetensors::tensor::TensorView::new(
                        safetensors::Dtype::F32,
                        vec![4, 64],
                        bytemuck::cast_slice(&nan),
                    )
                    .unwrap(),
                ),
                false => (n, v),
            })
            .collect();
        safetensors::serialize_to_file(views, None, &bad.join(ADAPTER_FILE)).unwrap();
        std::fs::write(bad.join(ADAPTER_CONFIG), &cfg).unwrap();
        let e = merge_adapter_into(&s0, &w0, &bad).unwrap_err().to_string();
        assert!(e.contains("v_proj.lora_A.weight holds a NaN or an infinity"), "{e}");
        assert!(bytes_of(&s0, &w0) == kept, "a refused adapter changed a tensor");
    }
}

/// The trainer's base weights, as candle tensors.
fn weights_of(tr: &Trainer, c: &LlamaConfig) -> HashMap<String, Tensor> {
    c.tensors()
        .into_iter()
        .map(|(n, s)| {
            let t =
                Tensor::from_vec(tr.read_param(&n).unwrap(), s.as_slice(), &Device::Cpu).unwrap();
            (n, t)
        })
        .collect()
}

#[test]
fn peft_configs_that_change_the_computation_are_refused_naming_the_field() {
    let ok = r#"{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": ["v_proj", "q_proj"], "bias": "none", "use_rslora": true}"#;
    let c = LoraConfig::from_peft_json(ok).unwrap();
    assert_eq!((c.rank, c.alpha, c.rslora), (8, 16.0, true));
    assert_eq!(c.targets, ["q_proj", "v_proj"]);
    // What peft 0.21.2's save_pretrained wrote (tiny Llama, r 4, q_proj and v_proj) reads.
    let saved = r#"{"alora_invocation_tokens": null, "alpha_pattern": {}, "arrow_config": null, "auto_mapping": null, "base_model_name_or_path": null, "bias": "none", "corda_config": null, "ensure_weight_tying": false, "eva_config": null, "exclude_modules": null, "fan_in_fan_out": false, "inference_mode": true, "init_lora_weights": true, "kasa_config": null, "layer_replication": null, "layers_pattern": null, "layers_to_transform": null, "loftq_config": {}, "lora_alpha": 8, "lora_bias": false, "lora_dropout": 0.0, "lora_ga_config": null, "megatron_config": null, "megatron_core": "megatron.core", "modules_to_save": null, "monteclora_config": null, "peft_type": "LORA", "peft_version": "0.21.2", "qalora_group_size": 16, "r": 4, "rank_pattern": {}, "revision": null, "target_modules": ["q_proj", "v_proj"], "target_parameters": null, "task_type": "CAUSAL_LM", "trainable_token_indices": null, "use_bdlora": null, "use_dora": false, "use_qalora": false, "use_rslora": false, "velora_config": null}"#;
    let c = LoraConfig::from_peft_json(saved).unwrap();
    assert_eq!(
        (c.rank, c.alpha, c.rslora, c.targets.join(",")),
        (4, 8.0, false, "q_proj,v_proj".into())
    );
    for (field, value) in [
        ("lora_dropout", "0.05"),
        ("use_dora", "true"),
        ("fan_in_fan_out", "true"),
        ("bias", "\"all\""),
        ("target_modules", "\".*proj\""),
        ("rank_pattern", "{\"q_proj\": 4}"),
        ("modules_to_save", "[\"lm_head\"]"),
        ("peft_type", "\"IA3\""),
        ("lora_bias", "true"),
        ("exclude_modules", "[\"q_proj\"]"),
        ("layer_replication", "[[0, 2]]"),
        ("some_future_variant", "{\"on\": true}"),
    ] {
        let mut v: serde_json::Value = serde_json::from_str(ok).unwrap();
        v[field] = serde_json::from_str(value).unwrap();
        let e = LoraConfig::from_peft_json(&v.to_string()).unwrap_err().to_string();
        assert!(e.starts_with(field), "{field}: {e}");
    }
}

#[test]
fn a_lora_run_saved_and_resumed_equals_the_uninterrupted_run() {
    let c = tiny(true);
    let t = lora_config(Some(1.0), &["q_proj", "v_proj", "gate_proj"]);
    let (mut whole, _) = trainer(&c, &t, 13);
    let losses: Vec<f32> = (0..5).map(|s| whole.step(&batches(s, &c, &t)).unwrap().loss).collect();
    whole.finish().unwrap();

    let dir = tempfile::tempdir().unwrap();
    let (mut first, _) = trainer(&c, &t, 13);
    for step in 0..3 {
        first.step(&batches(step, &c, &t)).unwrap();
    }
    let saved = first.save(dir.path()).unwrap();
    drop(first);
    // The adapters in PEFT's format and their state; not the frozen base.
    assert!(saved.join(ADAPTER_FILE).is_file() && saved.join(ADAPTER_CONFIG).is_file());
    assert!(saved.join("optimizer.safetensors.index.json").is_file());
    let models: Vec<_> = std::fs::read_dir(&saved)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("model-"))
        .collect();
    assert!(models.is_empty(), "a LoRA checkpoint wrote the base");

    // Other initial adapters over the same base: resuming replaces them.
    let other =
        TrainConfig { lora: Some(LoraConfig { seed: 5, ..t.lora.clone().unwrap() }), ..t.clone() };
    let (mut resumed, _) = trainer(&c, &other, 13);
    resumed.resume(dir.path()).unwrap();
    for step in 3..5 {
        let l = resumed.step(&batches(step, &c, &t)).unwrap().loss;
        assert_eq!(l.to_bits(), losses[step as usize].to_bits(), "step {step}");
    }
    resumed.finish().unwrap();
    for n in adapter_names(&whole) {
        assert_eq!(
            bits(&whole.read_param(&n).unwrap()),
            bits(&resumed.read_param(&n).unwrap()),
            "{n}"
        );
    }
    // Over another base it is refused, naming it; so is a run without LoRA.
    let (mut wrong, _) = trainer(&c, &t, 14);
    let e = wrong.resume(dir.path()).unwrap_err().to_string();
    assert!(e.contains("frozen base"), "{e}");
    let (mut full, _) = trainer(&c, &train_config(Some(1.0), Engine::Cpu, &[]), 13);
    let e = full.resume(dir.path()).unwrap_err().to_string();
    assert!(e.contains("LoRA"), "{e}");
}

/// `[micro_batch, seq]` masks: the first `prompt` targets of each row do not count.
fn masks(t: &TrainConfig, prompt: usize) -> Vec<Tensor> {
    let row: Vec<f32> = (0..t.seq).map(|i| if i < prompt { 0.0 } else { 1.0 }).collect();
    let v: Vec<f32> = (0..t.micro_batch).flat_map(|_| row.clone()).collect();
    (0..t.accum)
        .map(|_| Tensor::from_vec(v.clone(), (t.micro_batch, t.seq), &Device::Cpu).unwrap())
        .collect()
}

#[test]
fn the_loss_on_responses_only_matches_a_hand_computation_and_the_twin() {
    let c = tiny(false);
    for t in [train_config(Some(1.0), Engine::Cpu, &[]), lora_config(None, &["q_proj", "v_proj"])] {
        let (mut tr, mut twin) = pair(&c, &t, 15, DType::F32);
        let prompt = 6;
        let m = masks(&t, prompt);
        // By hand, in f64, from the twin's logits before the step: the mean over the counted
        // targets of -log softmax(logits)[target].
        let b = batches(0, &c, &t);
        let (mut sum, mut n) = (0f64, 0usize);
        for mb in &b {
            let v = mb.to_vec2::<u32>().unwrap();
            let ids = mb.narrow(1, 0, t.seq).unwrap();
            let logits = twin.logits(&ids).unwrap().to_vec2::<f32>().unwrap();
            for (r, row) in v.iter().enumerate() {
                for i in prompt..t.seq {
                    let l = &logits[r * t.seq + i];
                    let max = l.iter().fold(f64::MIN, |a, &x| a.max(f64::from(x)));
                    let lse = max + l.iter().map(|&x| (f64::from(x) - max).exp()).sum::<f64>().ln();
                    sum += lse - f64::from(l[row[i + 1] as usize]);
                    n += 1;
                }
            }
        }
        let hand = sum / n as f64;
        // The trainer's logits are the twin's.
        let ids = b[0].narrow(1, 0, t.seq).unwrap();
        assert_eq!(
            bits(&tr.logits(&ids).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()),
            bits(&twin.logits(&ids).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap())
        );
        for step in 0..3 {
            let b = batches(step, &c, &t);
            let r = tr.step_masked(&b, Some(&m)).unwrap();
            let want = twin.step_masked(&b, Some(&m)).unwrap();
            assert_eq!(r.loss.to_bits(), want.to_bits(), "step {step}");
            if step == 0 {
                let rel = (f64::from(r.loss) - hand).abs() / hand;
                assert!(rel < 1e-6, "loss {} against {hand} by hand ({rel:e})", r.loss);
                // Every target counted: another loss.
                let all = twin_loss(&c, &t, &b, None);
                assert_ne!(all.to_bits(), r.loss.to_bits());
            }
        }
        // A target that does not count changes nothing: with the last target of row 0 left
        // out, another last token (a target, never an input) gives the same loss, bit for bit.
        let b = batches(9, &c, &t);
        let mut last = masks(&t, 0);
        let mut lv = last[0].to_vec2::<f32>().unwrap();
        lv[0][t.seq - 1] = 0.0;
        last[0] = Tensor::new(lv, &Device::Cpu).unwrap();
        let mut changed = b.clone();
        let mut v = changed[0].to_vec2::<u32>().unwrap();
        v[0][t.seq] = (v[0][t.seq] + 1) % c.vocab_size as u32;
        changed[0] = Tensor::new(v, &Device::Cpu).unwrap();
        let same = twin_loss(&c, &t, &b, Some(&last));
        assert_eq!(same.to_bits(), twin_loss(&c, &t, &changed, Some(&last)).to_bits());
        assert_ne!(same.to_bits(), twin_loss(&c, &t, &changed, Some(&masks(&t, 0))).to_bits());
        let e = tr.step_masked(&b, Some(&masks(&t, t.seq))).unwrap_err().to_string();
        assert!(e.contains("no target of the step counts"), "{e}");
    }
}

/// The loss of a fresh twin's first step.
fn twin_loss(c: &LlamaConfig, t: &TrainConfig, b: &[Tensor], m: Option<&[Tensor]>) -> f32 {
    let (_, mut twin) = pair(c, t, 15, DType::F32);
    twin.step_masked(b, m).unwrap()
}

/// The frozen base's linears compute the input's gradient as candle's matrix product does, bit
/// for bit, and no gradient for the weight (which candle's product computes and throws away).
#[test]
fn a_frozen_linear_gives_the_inputs_gradient_of_candles_product_and_none_to_its_weight() {
    use candle_core::Var;
    use strata::candle::block::{frozen_linear, linear};
    let mut rng = strata::candle::llama::SeededRng::new(3);
    let mut randn = |shape: &[usize]| {
        let v: Vec<f32> = (0..shape.iter().product()).map(|_| rng.normal(1.0) as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    };
    let (x, w, gy) = (randn(&[2, 5, 24]), randn(&[40, 24]), randn(&[2, 5, 40]));
    for dtype in [candle_core::DType::F32, candle_core::DType::BF16] {
        let (x, w, gy) =
            (x.to_dtype(dtype).unwrap(), w.to_dtype(dtype).unwrap(), gy.to_dtype(dtype).unwrap());
        let plain = |x: &Tensor| {
            x.reshape((10, 24))
                .unwrap()
                .matmul(&w.t().unwrap())
                .unwrap()
                .reshape((2, 5, 40))
                .unwrap()
        };
        let xa = Var::from_tensor(&x).unwrap();
        let ya = plain(xa.as_tensor());
        let ga = ya.mul(&gy).unwrap().sum_all().unwrap().backward().unwrap();
        let xb = Var::from_tensor(&x).unwrap();
        let yb = frozen_linear(xb.as_tensor(), &w).unwrap();
        let gb = yb.mul(&gy).unwrap().sum_all().unwrap().backward().unwrap();
        let f = |t: &Tensor| {
            bits(
                &t.to_dtype(candle_core::DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap(),
            )
        };
        assert_eq!(f(&ya), f(&yb), "{dtype:?}: values");
        assert_eq!(f(&linear(xb.as_tensor(), &w).unwrap()), f(&yb), "{dtype:?}: linear");
        assert_eq!(
            f(ga.get(xa.as_tensor()).unwrap()),
            f(gb.get(xb.as_tensor()).unwrap()),
            "{dtype:?}: dx"
        );
        assert!(ga.get(&w).is_none() && gb.get(&w).is_none());
        // candle's product computed a gradient for the weight's side too; the frozen one did not.
        let n = |g: &candle_core::backprop::GradStore| g.get_ids().count();
        assert!(n(&gb) < n(&ga), "{} gradients against {}", n(&gb), n(&ga));
    }
}

/// Issue 40, findings 6 and 10: an absurd LoRA rank is refused by name (not a panic in
/// `init_a`, not 16 EiB shown as fitting), and the trainable parameters counted for fully
/// qualified targets (`self_attn.q_proj`) are the adapters the trainer makes.
#[test]
fn absurd_ranks_are_refused_and_qualified_targets_count_what_trains() {
    use strata::candle::train::{trainable_parameters, TrainPlan};
    use strata::Machine;
    let c = tiny(false);
    for rank in [1usize << 56, usize::MAX, 1 << 40] {
        let t = TrainConfig {
            lora: Some(LoraConfig::new(rank, 8.0, &["q_proj"])),
            ..train_config(None, Engine::Cpu, &[])
        };
        let s = store(&c);
        let w = put_random_weights(&s, &c, 1, DType::F32).unwrap();
        let e = Trainer::new(s, &Device::Cpu, c.clone(), t.clone(), w).unwrap_err().to_string();
        assert!(e.contains(&format!("LoRA rank {rank}")), "{rank}: {e}");
        let plan = TrainPlan::new(
            &c,
            &t,
            DType::F32,
            &Machine::h100(),
            strata::candle::train::Budgets::default(),
        );
        let e = plan.expect_err("an absurd rank fits no plan").to_string();
        assert!(e.contains("overflow") || e.contains("cannot"), "{rank}: {e}");
        if rank >= 1 << 56 {
            assert!(trainable_parameters(&c, &t).is_err());
        }
    }
    let qualified = lora_config(None, &["self_attn.q_proj", "mlp.down_proj"]);
    let (tr, _) = pair(&c, &qualified, 1, DType::F32);
    let made: u64 = tr
        .adapters()
        .iter()
        .map(|s| (s.a.1.iter().product::<usize>() + s.b.1.iter().product::<usize>()) as u64)
        .sum();
    assert_eq!(tr.adapters().len(), 2 * c.num_hidden_layers);
    assert_eq!(trainable_parameters(&c, &qualified).unwrap(), made);
    let short = lora_config(None, &["q_proj", "down_proj"]);
    assert_eq!(trainable_parameters(&c, &short).unwrap(), made);
}

/// Issue 40, finding 9: an adapter holding some of the linears its targets name (one layer of
/// three) is refused by generation's merge, as the trainer refuses it, and changes nothing.
#[test]
fn an_adapter_of_some_layers_only_is_refused_by_the_merge() {
    let c = tiny(false);
    let t = lora_config(None, &["q_proj"]);
    let (mut tr, _) = pair(&c, &t, 3, DType::F32);
    tr.step(&batches(0, &c, &t)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let full = dir.path().join("adapter");
    tr.save_adapter(&full).unwrap();
    // The same adapter cut to layer 0.
    let part = dir.path().join("part");
    std::fs::create_dir(&part).unwrap();
    std::fs::copy(full.join(ADAPTER_CONFIG), part.join(ADAPTER_CONFIG)).unwrap();
    let bytes = std::fs::read(full.join(ADAPTER_FILE)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView)> =
        st.tensors().into_iter().filter(|(n, _)| n.contains(".layers.0.")).collect();
    assert_eq!(kept.len(), 2);
    safetensors::serialize_to_file(kept, None, &part.join(ADAPTER_FILE)).unwrap();
    let s = store(&c);
    let w = put_random_weights(&s, &c, 3, DType::F32).unwrap();
    let before: Vec<Vec<u8>> = w.iter().map(|(_, id)| s.read(*id).unwrap()).collect();
    let e = merge_adapter_into(&s, &w, &part).unwrap_err().to_string();
    assert!(e.contains("layers.1.self_attn.q_proj") && e.contains("some layers only"), "{e}");
    let after: Vec<Vec<u8>> = w.iter().map(|(_, id)| s.read(*id).unwrap()).collect();
    assert!(after == before, "a refused merge changed weights");
    assert_eq!(merge_adapter_into(&s, &w, &full).unwrap().linears.len(), 3);
}
