//! Out-of-core training inside candle (CPU candle, host backend): a tiny random Llama (3 blocks,
//! hidden 64, grouped-query attention) trained 5 steps by `strata::candle::Trainer` under a
//! Device budget smaller than two blocks, against its in-memory twin (candle's plain backward
//! over the whole model), bit for bit; its gradients against candle's autograd; save and resume;
//! frozen parameters.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{Device, Tensor, Var};
use strata::candle::block::{Block, LlamaBlock, Weights};
use strata::candle::llama::{
    embed, head_logits, inputs_and_targets, next_token_loss_masked, SeededRng, EMBED,
};
use strata::candle::{
    put_random_weights, LlamaConfig, LlamaTwin, LrSchedule, StepReport, TrainConfig, Trainer,
};
use strata::optim::{AdamW, Engine};
use strata::{Store, Tier};

pub(crate) fn tiny(tied: bool) -> LlamaConfig {
    LlamaConfig::from_json(&format!(
        r#"{{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97,
            "max_position_embeddings": 32, "tie_word_embeddings": {tied}}}"#
    ))
    .unwrap()
}

pub(crate) fn train_config(clip: Option<f64>, engine: Engine, frozen: &[&str]) -> TrainConfig {
    TrainConfig {
        micro_batch: 2,
        seq: 16,
        accum: 2,
        adamw: AdamW { weight_decay: 0.1, ..AdamW::default() },
        schedule: LrSchedule { peak: 3e-3, min: 3e-4, warmup: 2, total: 5 },
        clip,
        engine,
        optimizer_threads: 2,
        speculation_bytes: u64::MAX,
        frozen: frozen.iter().map(|s| s.to_string()).collect(),
        skip_nonfinite: false,
        lora: None,
    }
}

/// Step `step`'s micro-batches of seeded random tokens.
pub(crate) fn batches(step: u64, c: &LlamaConfig, t: &TrainConfig) -> Vec<Tensor> {
    let mut rng = SeededRng::new(1000 + step);
    (0..t.accum)
        .map(|_| {
            let v: Vec<u32> = (0..t.micro_batch * (t.seq + 1))
                .map(|_| rng.below(c.vocab_size as u64) as u32)
                .collect();
            Tensor::from_vec(v, (t.micro_batch, t.seq + 1), &Device::Cpu).unwrap()
        })
        .collect()
}

fn block_bytes(c: &LlamaConfig) -> u64 {
    4 * c.block_parameters()
}

/// A store whose Device tier holds less than two blocks' weights.
pub(crate) fn store(c: &LlamaConfig) -> Arc<Store> {
    let budget = block_bytes(c) * 3 / 2;
    let builder = Store::builder()
        .capacity(Tier::Device, budget)
        .prefetch_budget(budget)
        .capacity(Tier::Pinned, 16 << 20)
        .capacity(Tier::Mapped, 0)
        .staging(2, 64 << 10)
        .disk_workers(2);
    strata::candle::store_for(&Device::Cpu, builder).unwrap()
}

pub(crate) fn trainer(
    c: &LlamaConfig,
    t: &TrainConfig,
    seed: u64,
) -> (Trainer, HashMap<String, Tensor>) {
    let s = store(c);
    let weights = put_random_weights(&s, c, seed, strata::DType::F32).unwrap();
    let init = weights
        .iter()
        .map(|(n, id)| {
            let shape = s.info(*id).unwrap().shape;
            let v = s.read_vec::<f32>(*id).unwrap();
            (n.clone(), Tensor::from_vec(v, shape.as_slice(), &Device::Cpu).unwrap())
        })
        .collect();
    (Trainer::new(s, &Device::Cpu, c.clone(), t.clone(), weights).unwrap(), init)
}

pub(crate) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn out_of_core_training_equals_the_in_memory_twin_bit_for_bit() {
    for (tied, clip, engine) in [
        (false, Some(0.5), Engine::Cpu),
        (true, None, Engine::Cpu),
        (false, None, Engine::GpuResident),
        // Clipping on a GPU engine: the kernels' scale argument, emulated on the host backend.
        (true, Some(0.5), Engine::GpuResident),
    ] {
        let what = format!("tied {tied}, clip {clip:?}, engine {engine}");
        let c = tiny(tied);
        let t = train_config(clip, engine, &[]);
        let (mut tr, init) = trainer(&c, &t, 1);
        let mut twin = LlamaTwin::new(c.clone(), t.clone(), init.clone(), &Device::Cpu).unwrap();
        // The twin that recomputes as out of core does: the same results, bit for bit.
        let mut again = LlamaTwin::new(c.clone(), t.clone(), init, &Device::Cpu).unwrap();
        again.set_recompute(true);
        assert!(again.recomputes() && !twin.recomputes());
        assert!(block_bytes(&c) * 2 > tr.store().stats().capacity(Tier::Device));
        let mut clipped = 0;
        for step in 0..5 {
            let b = batches(step, &c, &t);
            let r = tr.step(&b).unwrap();
            let want = twin.step(&b).unwrap();
            assert_eq!(r.loss.to_bits(), want.to_bits(), "{what}: loss of step {step}");
            let recomputed = again.step(&b).unwrap();
            assert_eq!(recomputed.to_bits(), want.to_bits(), "{what}: recomputed, step {step}");
            assert!(r.loss.is_finite() && r.loss > 3.0, "{what}: {}", r.loss);
            if r.clip_scale < 1.0 {
                clipped += 1;
            }
            // Layer-major: every block's weights cross to the device once for the forward and
            // once for the backward whatever the micro-batches (the last block's may still be
            // there for its backward), beside the checkpoints and the small stages (and, with
            // GpuResident, the optimizer's state).
            let into_device: u64 = (0..4).map(|f| r.moved[f][Tier::Device.index()]).sum();
            let (block, n) = (block_bytes(&c), c.num_hidden_layers as u64);
            assert!(
                into_device >= (2 * n - 1) * block,
                "{what}: {into_device} bytes to the device"
            );
            if engine == Engine::Cpu {
                assert!(into_device < (2 * n + 1) * block, "{what}: {into_device} bytes");
            }
        }
        if clip.is_some() {
            assert!(clipped > 0, "{what}: no step was clipped");
        }
        tr.finish().unwrap();
        for (name, _) in c.tensors() {
            let got = tr.read_param(&name).unwrap();
            let want = twin.param(&name).unwrap();
            assert_eq!(bits(&got), bits(&want), "{what}: {name}");
            assert_eq!(bits(&again.param(&name).unwrap()), bits(&want), "{what}: {name}");
        }
        let s = tr.store().stats();
        assert!(s.group_bytes(strata::Group::Activation, Tier::Pinned) > 0);
        assert!(s.group_bytes(strata::Group::OptimizerState, Tier::Pinned) > 0);
    }
}

/// The forward's embedding: the distinct rows the step's inputs pick, gathered on the host (a
/// vocabulary of 97, 64 inputs a step), or the whole table when every row is picked (a
/// vocabulary of 8): either way the twin's results, bit for bit.
#[test]
fn the_embedding_gathers_the_rows_the_step_picks_or_fetches_the_table_when_all_are() {
    for (vocab, gathers) in [(97, true), (8, false)] {
        let mut c = tiny(true);
        c.vocab_size = vocab;
        let t = train_config(None, Engine::Cpu, &[]);
        let (mut tr, init) = trainer(&c, &t, 1);
        let mut twin = LlamaTwin::new(c.clone(), t.clone(), init, &Device::Cpu).unwrap();
        let mut distinct = 0;
        for step in 0..2 {
            let b = batches(step, &c, &t);
            let mut inputs = std::collections::BTreeSet::new();
            for m in &b {
                for row in m.to_vec2::<u32>().unwrap() {
                    inputs.extend(row[..t.seq].iter().copied());
                }
            }
            distinct += inputs.len() as u64;
            let r = tr.step(&b).unwrap();
            assert_eq!(r.loss.to_bits(), twin.step(&b).unwrap().to_bits(), "vocab {vocab}");
        }
        let row = 64 * 4;
        let gathered = tr.layers().transfers().unwrap().gathered_bytes;
        if gathers {
            // Each step's distinct inputs once (64 inputs a step, some repeated).
            assert!(distinct < 2 * 64, "{distinct}: the batches repeat no id");
            assert_eq!(gathered, distinct * row);
        } else {
            assert_eq!(gathered, 0, "every row picked: the table fetched whole");
        }
        tr.finish().unwrap();
        for (name, _) in c.tensors() {
            let (got, want) = (tr.read_param(&name).unwrap(), twin.param(&name).unwrap());
            assert_eq!(bits(&got), bits(&want), "vocab {vocab}: {name}");
        }
    }
}

/// The trainer's gradients (the optimizer's f32 gradient tensors after one step) against
/// candle's plain autograd over the whole model: every parameter a `Var`, every linear candle's
/// `matmul` (its `dW` in the compute dtype, here f32), the micro-batches' gradients summed in
/// f64. The trainer's linear weights get theirs from the accumulating linear's GEMMs (another
/// order of the same f32 sums), the others from autograd as before: every tensor within 1e-5
/// of its largest gradient (measured on 2026-11-29: 1.1e-7 at worst, the tied table).
#[test]
fn the_trainers_gradients_are_candles_autograd_within_1e_5() {
    for tied in [false, true] {
        let c = tiny(tied);
        let t = train_config(None, Engine::Cpu, &[]);
        let (mut tr, init) = trainer(&c, &t, 1);
        let b = batches(0, &c, &t);
        tr.step(&b).unwrap();
        tr.finish().unwrap();

        let vars: HashMap<String, Var> =
            init.iter().map(|(n, w)| (n.clone(), Var::from_tensor(w).unwrap())).collect();
        let block = LlamaBlock::new(&c, t.seq, &Device::Cpu).unwrap();
        let scale = 1.0 / (t.micro_batch * t.seq * t.accum) as f64;
        let mut want: HashMap<String, Vec<f64>> = HashMap::new();
        for mb in &b {
            let (ids, targets) = inputs_and_targets(mb).unwrap();
            let mut x = embed(vars[EMBED].as_tensor(), &ids).unwrap();
            for l in 0..c.num_hidden_layers {
                let p = LlamaConfig::block_prefix(l);
                let w = block.tensors().into_iter().map(|(s, _)| {
                    let v = vars[&format!("{p}{s}")].as_tensor().clone();
                    (s, v)
                });
                x = block.forward(l, &Weights::new(w.collect()), &x).unwrap();
            }
            let [norm, head] = c.head_names();
            let logits =
                head_logits(&c, &x, vars[norm].as_tensor(), vars[head].as_tensor()).unwrap();
            let loss = next_token_loss_masked(&logits, &targets, None, scale).unwrap();
            let grads = loss.backward().unwrap();
            for (name, v) in &vars {
                let g = grads.get(v).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let sum = want.entry(name.clone()).or_insert_with(|| vec![0.0; g.len()]);
                for (s, g) in sum.iter_mut().zip(g) {
                    *s += f64::from(g);
                }
            }
        }
        let opt = tr.optimizer().unwrap();
        for (name, id) in tr.params() {
            let got = tr.store().read_vec::<f32>(opt.grad(id).unwrap()).unwrap();
            let want = &want[&name];
            let top = want.iter().fold(0f64, |m, v| m.max(v.abs()));
            let err = got.iter().zip(want).fold(0f64, |m, (g, w)| m.max((f64::from(*g) - w).abs()));
            assert!(top > 0.0 && err <= 1e-5 * top, "tied {tied}: {name}: {err} of {top}");
        }
    }
}

/// `[micro_batch, seq]` masks counting only the last target of each row: a step whose loss is
/// the mean over a few targets, whose gradient norm is larger than a full step's.
fn last_target_only(t: &TrainConfig) -> Vec<Tensor> {
    let row: Vec<f32> = (0..t.seq).map(|i| if i + 1 == t.seq { 1.0 } else { 0.0 }).collect();
    let v: Vec<f32> = (0..t.micro_batch).flat_map(|_| row.clone()).collect();
    (0..t.accum)
        .map(|_| Tensor::from_vec(v.clone(), (t.micro_batch, t.seq), &Device::Cpu).unwrap())
        .collect()
}

/// Trains `steps` steps out of core and in memory (step 2's loss on [`last_target_only`]),
/// checking every loss, the final weights and the moments bit for bit against the twin; returns
/// the reports.
fn against_the_twin(c: &LlamaConfig, t: &TrainConfig, steps: u64, what: &str) -> Vec<StepReport> {
    let (mut tr, init) = trainer(c, t, 1);
    let mut twin = LlamaTwin::new(c.clone(), t.clone(), init, &Device::Cpu).unwrap();
    let mut reports = Vec::new();
    for step in 0..steps {
        let b = batches(step, c, t);
        let m = (step == 2).then(|| last_target_only(t));
        let r = tr.step_masked(&b, m.as_deref()).unwrap();
        let want = twin.step_masked(&b, m.as_deref()).unwrap();
        assert_eq!(r.loss.to_bits(), want.to_bits(), "{what}: loss of step {step}");
        reports.push(r);
    }
    tr.finish().unwrap();
    for (name, _) in c.tensors() {
        let got = tr.read_param(&name).unwrap();
        assert_eq!(bits(&got), bits(&twin.param(&name).unwrap()), "{what}: {name}");
    }
    reports
}

/// Issue 41: a stage's update starts during the backward, as soon as its gradients are final,
/// speculatively (its state backed up), and is undone when the global norm says to clip. With
/// clipping off, clipping that never clips, clipping every step, clipping some steps only (a
/// step after an unclipped one clips: its speculative updates are undone and redone clipped), a
/// budget for the head alone, and none: every loss and weight is the twin's, bit for bit (the
/// twin updates after the whole backward). The optimizer runs during the backward (its time
/// there is seen by the step's clock) only when it speculates.
#[test]
fn speculative_updates_start_in_the_backward_and_keep_the_twin_s_bits() {
    let stages = 5; // the embedding, 3 blocks, the head
    let untied = tiny(false);
    let t = |clip: Option<f64>, budget: u64| TrainConfig {
        speculation_bytes: budget,
        ..train_config(clip, Engine::Cpu, &[])
    };
    // Clipping off: every stage speculated, every one committed, the optimizer busy during
    // the backward.
    let off = against_the_twin(&untied, &t(None, u64::MAX), 3, "clip off");
    for r in &off {
        assert_eq!((r.speculated, r.undone, r.clip_scale), (stages, 0, 1.0), "clip off: {r:?}");
    }
    let in_backward: f64 = off.iter().map(|r| r.optimizer_backward_seconds).sum();
    assert!(in_backward > 0.0, "no update ran during a backward: {off:?}");
    // Step 2's gradient (the loss on a few targets) is larger than those before it.
    let norms: Vec<f64> = off.iter().map(|r| r.grad_norm).collect();
    assert!(norms[2] > norms[0].max(norms[1]), "{norms:?}");

    // Clipping between the first steps' norms and step 2's: steps 0 and 1 speculate and stand,
    // step 2 speculates (step 1 did not clip), clips, and is undone; step 3 does not speculate.
    let between = (norms[0].max(norms[1]) + norms[2]) / 2.0;
    let some = against_the_twin(&untied, &t(Some(between), u64::MAX), 4, "clip some");
    let seen: Vec<(usize, usize, bool)> =
        some.iter().map(|r| (r.speculated, r.undone, r.clip_scale < 1.0)).collect();
    assert_eq!(seen[..3], [(stages, 0, false), (stages, 0, false), (stages, stages, true)]);
    assert_eq!(seen[3].0, 0, "step 3 speculated after a clipped step: {seen:?}");

    // Clipping every step: the first step speculates and is undone, the others do not.
    let every = against_the_twin(&untied, &t(Some(1e-4), u64::MAX), 2, "clip every step");
    let seen: Vec<(usize, usize)> = every.iter().map(|r| (r.speculated, r.undone)).collect();
    assert_eq!(seen, [(stages, stages), (0, 0)]);
    assert!(every.iter().all(|r| r.clip_scale < 1.0));

    // Clipping that never clips, tied embeddings, a budget for the head's backup alone (its norm
    // and, tied, no output projection: 12 bytes a parameter): the head speculates, the rest
    // update after the step.
    let tied = tiny(true);
    let head = 12 * tied.hidden_size as u64;
    let never = against_the_twin(&tied, &t(Some(1e9), head), 2, "never clips, head only");
    assert!(never.iter().all(|r| (r.speculated, r.undone) == (1, 0)), "{never:?}");

    // No budget: no speculation, the optimizer idle during the backward.
    let none = against_the_twin(&untied, &t(None, 0), 2, "no speculation");
    for r in &none {
        assert_eq!((r.speculated, r.optimizer_backward_seconds), (0, 0.0), "{r:?}");
    }
}

#[test]
fn bf16_parameters_train_with_fp32_masters_as_the_twin_does() {
    let c = tiny(false);
    let t = train_config(Some(1.0), Engine::Cpu, &[]);
    let s = store(&c);
    let weights = put_random_weights(&s, &c, 2, strata::DType::BF16).unwrap();
    let init = weights
        .iter()
        .map(|(n, id)| {
            let shape = s.info(*id).unwrap().shape;
            let v = s.read_vec::<half::bf16>(*id).unwrap();
            (n.clone(), Tensor::from_vec(v, shape.as_slice(), &Device::Cpu).unwrap())
        })
        .collect();
    let mut tr = Trainer::new(s, &Device::Cpu, c.clone(), t.clone(), weights).unwrap();
    let mut twin = LlamaTwin::new(c.clone(), t.clone(), init, &Device::Cpu).unwrap();
    for step in 0..3 {
        let b = batches(step, &c, &t);
        assert_eq!(tr.step(&b).unwrap().loss.to_bits(), twin.step(&b).unwrap().to_bits());
    }
    tr.finish().unwrap();
    for (name, _) in c.tensors() {
        assert_eq!(bits(&tr.read_param(&name).unwrap()), bits(&twin.param(&name).unwrap()));
        let master = tr.store().lookup(&format!("{name}.master")).expect("a master");
        let got = tr.store().read_vec::<f32>(master).unwrap();
        assert_eq!(bits(&got), bits(&twin.master(&name).unwrap().unwrap()), "{name}.master");
    }
}

#[test]
fn a_run_saved_after_step_3_and_resumed_equals_the_uninterrupted_run() {
    let c = tiny(true);
    let t = train_config(Some(1.0), Engine::Cpu, &["*.post_attention_layernorm.weight"]);
    let (mut whole, _) = trainer(&c, &t, 3);
    let mut losses = Vec::new();
    for step in 0..5 {
        losses.push(whole.step(&batches(step, &c, &t)).unwrap().loss);
    }
    whole.finish().unwrap();

    let dir = tempfile::tempdir().unwrap();
    let (mut first, _) = trainer(&c, &t, 3);
    for step in 0..3 {
        assert_eq!(first.step(&batches(step, &c, &t)).unwrap().loss, losses[step as usize]);
    }
    let saved = first.save(dir.path()).unwrap();
    assert_eq!(saved, dir.path().join("step-00000003"));
    drop(first);
    for f in [
        "model.safetensors.index.json",
        "optimizer.safetensors.index.json",
        "config.json",
        "checkpoint.json",
    ] {
        assert!(saved.join(f).is_file(), "{f}");
    }
    // Another initialisation: resuming replaces every value.
    let (mut resumed, _) = trainer(&c, &t, 99);
    resumed.resume(dir.path()).unwrap();
    assert_eq!(resumed.steps(), 3);
    for step in 3..5 {
        let l = resumed.step(&batches(step, &c, &t)).unwrap().loss;
        assert_eq!(l.to_bits(), losses[step as usize].to_bits(), "step {step}");
    }
    resumed.finish().unwrap();
    for (name, _) in c.tensors() {
        assert_eq!(
            bits(&whole.read_param(&name).unwrap()),
            bits(&resumed.read_param(&name).unwrap()),
            "{name}"
        );
        for suffix in ["exp_avg", "exp_avg_sq"] {
            let n = format!("{name}.{suffix}");
            let (a, b) = (whole.store().lookup(&n), resumed.store().lookup(&n));
            assert_eq!(a.is_some(), b.is_some(), "{n}");
            if let (Some(a), Some(b)) = (a, b) {
                let a = whole.store().read_vec::<f32>(a).unwrap();
                let b = resumed.store().read_vec::<f32>(b).unwrap();
                assert_eq!(bits(&a), bits(&b), "{n}");
            }
        }
    }

    // A trainer of another schedule refuses the checkpoint, naming what differs.
    let mut other = train_config(Some(1.0), Engine::Cpu, &["*.post_attention_layernorm.weight"]);
    other.schedule.total = 50;
    let (mut tr, _) = trainer(&c, &other, 3);
    let e = tr.resume(dir.path()).unwrap_err().to_string();
    assert!(e.contains("horizon"), "{e}");
}

#[test]
fn frozen_parameters_stay_unchanged_and_have_no_state() {
    let c = tiny(false);
    let frozen = ["model.embed_tokens.weight", "*.input_layernorm.weight"];
    let t = train_config(None, Engine::Cpu, &frozen);
    let (mut tr, init) = trainer(&c, &t, 4);
    let mut twin = LlamaTwin::new(c.clone(), t.clone(), init.clone(), &Device::Cpu).unwrap();
    for step in 0..2 {
        let b = batches(step, &c, &t);
        assert_eq!(tr.step(&b).unwrap().loss.to_bits(), twin.step(&b).unwrap().to_bits());
    }
    tr.finish().unwrap();
    let store = tr.store().clone();
    for (name, _) in c.tensors() {
        let got = tr.read_param(&name).unwrap();
        let before = init[&name].flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(bits(&got), bits(&twin.param(&name).unwrap()), "{name}");
        let is_frozen = t.is_frozen(&name);
        assert_eq!(bits(&got) == bits(&before), is_frozen, "{name} changed: {}", !is_frozen);
        for suffix in ["grad", "exp_avg", "exp_avg_sq"] {
            let n = format!("{name}.{suffix}");
            assert_eq!(store.lookup(&n).is_some(), !is_frozen, "{n}");
        }
    }
}

#[test]
fn bad_batches_and_configs_are_errors_that_say_what_is_wrong() {
    let c = tiny(false);
    let t = train_config(None, Engine::Cpu, &[]);
    let (mut tr, _) = trainer(&c, &t, 5);
    let mut b = batches(0, &c, &t);
    b.pop();
    assert!(tr.step(&b).unwrap_err().to_string().contains("1 micro-batches for a step of 2"));
    let big = Tensor::from_vec(vec![500u32; 2 * 17], (2, 17), &Device::Cpu).unwrap();
    let e = tr.step(&[big.clone(), big]).unwrap_err().to_string();
    assert!(e.contains("token id 500 in a vocabulary of 97"), "{e}");
    let long = TrainConfig { seq: 64, ..t.clone() };
    let s = store(&c);
    let w = put_random_weights(&s, &c, 1, strata::DType::F32).unwrap();
    let e = Trainer::new(s, &Device::Cpu, c.clone(), long, w).unwrap_err().to_string();
    assert!(e.contains("max_position_embeddings"), "{e}");
}

/// The step's gradients are the optimizer's, one f32 tensor a parameter, whatever the number
/// of micro-batches: a tied table's head share is summed into its one gradient, where it was
/// once kept per micro-batch (16 MiB more per micro-batch on the 30M model).
#[test]
fn the_gradients_take_one_buffer_a_parameter_whatever_the_micro_batches() {
    for tied in [true, false] {
        let c = tiny(tied);
        let grads = |accum: usize| {
            let t = TrainConfig { accum, ..train_config(Some(1.0), Engine::Cpu, &[]) };
            let (mut tr, _) = trainer(&c, &t, 1);
            tr.step(&batches(0, &c, &t)).unwrap();
            tr.finish().unwrap();
            let s = tr.store().stats();
            (
                s.group_bytes(strata::Group::Grad, Tier::Pinned),
                s.group_bytes(strata::Group::Grad, Tier::Disk),
            )
        };
        let one = grads(1);
        assert_eq!(one, (4 * c.parameters(), 0), "tied {tied}: f32 gradients only");
        assert_eq!(grads(4), one, "tied {tied}: 4 micro-batches");
    }
}

/// Trains `steps` steps of bf16 weights (seed 6) out of core; returns the reports and the bytes
/// of every trained tensor, its master and its moments, by name.
fn bf16_run(
    c: &LlamaConfig,
    t: &TrainConfig,
    steps: u64,
) -> (Vec<StepReport>, Vec<(String, Vec<u8>)>) {
    let s = store(c);
    let weights = put_random_weights(&s, c, 6, strata::DType::BF16).unwrap();
    let mut tr = Trainer::new(s.clone(), &Device::Cpu, c.clone(), t.clone(), weights).unwrap();
    let reports = (0..steps).map(|step| tr.step(&batches(step, c, t)).unwrap()).collect();
    tr.finish().unwrap();
    let mut state = Vec::new();
    for (name, id) in tr.params() {
        state.push((name.clone(), s.read(id).unwrap()));
        for suffix in ["master", "exp_avg", "exp_avg_sq"] {
            if let Some(id) = s.lookup(&format!("{name}.{suffix}")) {
                state.push((format!("{name}.{suffix}"), s.read(id).unwrap()));
            }
        }
    }
    (reports, state)
}

/// Issue 41's speculative updates against the same run without them (a budget of 0), bit for
/// bit: bf16 weights (the backups keep their f32 masters and bf16 copies), some parameters
/// frozen, two micro-batches; clipping off (every stage's update stands), on every step (all
/// undone, then redone clipped), and on every step with a budget for the head's backup alone
/// (its update undone, then every stage's queued clipped).
#[test]
fn a_speculative_run_is_the_run_without_speculation_bit_for_bit() {
    let c = tiny(false);
    let frozen = ["*.input_layernorm.weight", "model.layers.1.mlp.*"];
    // The head: the final norm and the output projection, 14 bytes a bf16 parameter.
    let head = 14 * (c.hidden_size * (1 + c.vocab_size)) as u64;
    for (clip, budget) in [(None, u64::MAX), (Some(1e-4), u64::MAX), (Some(1e-4), head)] {
        let what = format!("clip {clip:?}, budget {budget}");
        let t =
            TrainConfig { speculation_bytes: budget, ..train_config(clip, Engine::Cpu, &frozen) };
        let (spec, got) = bf16_run(&c, &t, 2);
        let (plain, want) = bf16_run(&c, &TrainConfig { speculation_bytes: 0, ..t.clone() }, 2);
        let stages = if budget == head { 1 } else { 5 };
        assert_eq!(spec[0].speculated, stages, "{what}: {:?}", spec[0]);
        let undone = if clip.is_some() { stages } else { 0 };
        assert_eq!(spec[0].undone, undone, "{what}: {:?}", spec[0]);
        assert!(plain.iter().all(|r| r.speculated == 0), "{what}");
        for (s, p) in spec.iter().zip(&plain) {
            assert_eq!(s.loss.to_bits(), p.loss.to_bits(), "{what}: loss of step {}", s.step);
        }
        assert_eq!(got.len(), want.len(), "{what}");
        for ((n, a), (_, b)) in got.iter().zip(&want) {
            assert!(a == b, "{what}: {n} differs");
        }
    }
}
