//! The candle trainer under every failure site (features `failpoints` and `candle`):
//!
//! ```text
//! cargo test --features failpoints,candle --test faults trainer -- --nocapture
//! ```
//! A tiny Llama trains 3 steps (a save after the second) out of core: a Device
//! tier of about a block, optimizer moments partly on the Disk tier. A clean run gives the
//! losses and the final weights and moments; a counting run gives how often the steps after the
//! first and the save pass each site; then, for every site and passes spread over that count, a
//! fresh run fails that pass, once (transient) or from then on (sticky: through a retry and a
//! second save). A failed call is followed by a save of the trainer as it stands (which must
//! succeed, or, while a sticky fault persists, fail with it or with the store's `BackendFailed`
//! once it declared its backend failed), then the call is retried; a trainer that cannot go on
//! (its store's backend declared failed) is replaced by a new one resumed from the run's
//! newest checkpoint. Every run must end with the clean run's losses, weights and moments, bit
//! for bit. The same survey runs QLoRA over a quantized GGUF base (`tests/fixtures/tiny-gpt2.gguf`,
//! read in place from the file): the adapters and their moments must end as the clean run's.

use std::path::Path;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use strata::candle::train::{Checkpoint, TrainError};
use strata::candle::{put_random_weights, LlamaConfig, LrSchedule, TrainConfig, Trainer};
use strata::failpoint::{self, Fault, Site};
use strata::optim::{AdamW, Engine};
use strata::{Store, Tier};

const STEPS: u64 = 3;

fn config() -> LlamaConfig {
    LlamaConfig::from_json(
        r#"{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
            "max_position_embeddings": 16}"#,
    )
    .unwrap()
}

fn train(engine: Engine) -> TrainConfig {
    TrainConfig {
        micro_batch: 1,
        seq: 8,
        accum: 2,
        adamw: AdamW { weight_decay: 0.1, ..AdamW::default() },
        schedule: LrSchedule { peak: 3e-3, min: 3e-4, warmup: 1, total: STEPS },
        clip: Some(1.0),
        engine,
        optimizer_threads: 1,
        speculation_bytes: u64::MAX,
        frozen: Vec::new(),
        skip_nonfinite: false,
        lora: None,
    }
}

fn batches(step: u64, t: &TrainConfig) -> Vec<Tensor> {
    (0..t.accum as u64)
        .map(|m| {
            let v: Vec<u32> = (0..t.micro_batch * (t.seq + 1))
                .map(|i| ((step * 131 + m * 17 + i as u64 * 7) % 64) as u32)
                .collect();
            Tensor::from_vec(v, (t.micro_batch, t.seq + 1), &Device::Cpu).unwrap()
        })
        .collect()
}

/// A store whose Device tier holds about one block, whose Pinned tier cannot hold every moment
/// (the rest go to the Disk tier).
fn store(dir: &Path, engine: Engine) -> strata::Result<Arc<Store>> {
    store_of(dir, engine, 200 << 10)
}

/// [`store`] with a Pinned tier of `pinned` bytes.
fn store_of(dir: &Path, engine: Engine, pinned: u64) -> strata::Result<Arc<Store>> {
    // GpuResident: room for the moments it brings to the device beside a block's weights.
    let device = if engine == Engine::GpuResident { 256 << 10 } else { 48 << 10 };
    Ok(Arc::new(
        Store::builder()
            .host_backend()
            .capacity(Tier::Device, device)
            .prefetch_budget(48 << 10)
            .capacity(Tier::Pinned, pinned)
            .capacity(Tier::Mapped, 0)
            .capacity(Tier::Disk, 4 << 20)
            .disk_dir(dir.join("slab"))
            .staging(2, 16 << 10)
            .disk_workers(2)
            .build()?,
    ))
}

fn trainer(dir: &Path, engine: Engine) -> candle_core::Result<Trainer> {
    trainer_over(dir, engine, Base::Random)
}

/// What a run trains.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Base {
    /// [`config`]'s model, random f32 weights, every weight trained.
    Random,
    /// [`Base::Random`] without clipping and with a Pinned tier of 1 MiB: room for every
    /// stage's backup, so that each step's updates start speculatively during the backward
    /// (issue 41) and a fault can hit them, or what follows them, at every site.
    Speculating,
    /// QLoRA: rank-2 adapters on `q_proj` and `v_proj` over `tests/fixtures/tiny-gpt2.gguf` (2
    /// blocks of hidden 64, Q8_0, Q4_1 and Q4_0 weights loaded quantized and in place in the
    /// file).
    Gguf,
}

fn gguf_path() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-gpt2.gguf")
}

fn trainer_over(dir: &Path, engine: Engine, base: Base) -> candle_core::Result<Trainer> {
    match base {
        Base::Random | Base::Speculating => {
            let s = if base == Base::Random {
                store(dir, engine)?
            } else {
                store_of(dir, engine, 1 << 20)?
            };
            let c = config();
            let w = put_random_weights(&s, &c, 7, strata::DType::F32)?;
            Trainer::new(s, &Device::Cpu, c, train_over(engine, base), w)
        }
        Base::Gguf => {
            // A Pinned tier smaller than the base: some of its weights are read from the file
            // at each step.
            let s = store_of(dir, engine, 24 << 10)?;
            let c = LlamaConfig::from_gguf(&strata::Gguf::open(gguf_path())?)?;
            let w = strata::candle::load_weights(&s, &c, gguf_path())?;
            Trainer::new(s, &Device::Cpu, c, train_over(engine, base), w)
        }
    }
}

/// [`train`], with LoRA's adapters for a [`Base::Gguf`] run.
fn train_over(engine: Engine, base: Base) -> TrainConfig {
    let lora = match base {
        Base::Random | Base::Speculating => None,
        Base::Gguf => Some(strata::candle::lora::LoraConfig::new(2, 4.0, &["q_proj", "v_proj"])),
    };
    let clip = if base == Base::Speculating { None } else { train(engine).clip };
    TrainConfig { lora, clip, ..train(engine) }
}

/// The weights and moments, after the last updates.
fn state(tr: &mut Trainer) -> candle_core::Result<Vec<Vec<u8>>> {
    tr.finish()?;
    let s = tr.store().clone();
    let mut out = Vec::new();
    for (name, id) in tr.params() {
        out.push(s.read(id)?);
        for suffix in ["exp_avg", "exp_avg_sq"] {
            if let Some(m) = s.lookup(&format!("{name}.{suffix}")) {
                out.push(s.read(m)?);
            }
        }
    }
    Ok(out)
}

/// How one faulted run went.
#[derive(Default)]
struct Tally {
    fired: bool,
    failed_calls: u64,
    saves_ok: u64,
    /// Saves refused while the fault persisted (sticky).
    saves_refused: u64,
    /// Saves refused by a store whose backend was declared failed (`BackendFailed`).
    saves_backend_failed: u64,
    resumed: u64,
    /// Runs begun again from the first step (no checkpoint to resume from).
    restarted: u64,
}

/// One run: the clean one when `arm` arms nothing. The fault is armed once the first step is
/// done (so that its updates are in flight), and disarmed after the first failed call and the
/// save that follows it.
fn run(
    dir: &Path,
    (engine, base): (Engine, Base),
    arm: &dyn Fn(),
    sticky: bool,
    t: &mut Tally,
) -> Result<(Vec<u32>, Vec<Vec<u8>>), String> {
    let err = |what: &str, e: candle_core::Error| format!("{what}: {e}");
    let ckpts = dir.join("run");
    let mut tr = trainer_over(dir, engine, base).map_err(|e| err("the trainer", e))?;
    let mut losses = Vec::new();
    let tc = train_over(engine, base);
    let mut stores = 0;
    let call = |tr: &mut Trainer, t: &mut Tally, what: u8| -> candle_core::Result<Option<f32>> {
        match what {
            0 => tr.step(&batches(tr.steps(), &tc)).map(|r| Some(r.loss)),
            _ => tr.save(&ckpts).map(|_| None),
        }
        .inspect_err(|_| t.failed_calls += 1)
    };
    // The calls: step, step, save, step.
    let script = [0u8, 0, 1, 0];
    let mut i = 0;
    let mut tries = 0;
    while i < script.len() {
        if i == 1 && tries == 0 {
            arm();
        }
        match call(&mut tr, t, script[i]) {
            Ok(loss) => {
                losses.extend(loss.map(f32::to_bits));
                i += 1;
                tries = 0;
            }
            Err(e) => {
                tries += 1;
                if std::env::var_os("STRATA_FAULTS_VERBOSE").is_some() {
                    eprintln!(
                        "  call {i} ({} steps done) failed: {}",
                        tr.steps(),
                        e.to_string().lines().next().unwrap_or("")
                    );
                }
                if failpoint::fired() {
                    t.fired = true;
                }
                // The trainer as it stands saves (the last complete step), or the fault is
                // still there, or the store has declared its backend failed.
                match tr.save(&ckpts) {
                    Ok(_) => t.saves_ok += 1,
                    Err(s) if s.to_string().contains("the backend has failed") => {
                        t.saves_backend_failed += 1
                    }
                    Err(s) if sticky => {
                        if std::env::var_os("STRATA_FAULTS_VERBOSE").is_some() {
                            eprintln!(
                                "  a save refused: {}",
                                s.to_string().lines().next().unwrap_or("")
                            );
                        }
                        t.saves_refused += 1
                    }
                    Err(s) => return Err(format!("after {e}\na save failed: {s}")),
                }
                // A transient fault is gone; a sticky one stays for a retry and a second save
                // (on the backend, enough failures in a row to have it declared failed).
                if !sticky || tries >= 2 {
                    failpoint::disarm();
                }
                if tries > 3 {
                    // This trainer cannot go on: a new store and trainer, resumed from the
                    // run's newest checkpoint (or started again when there is none).
                    stores += 1;
                    if stores > 2 {
                        return Err(format!("no way past: {e}"));
                    }
                    let fresh = dir.join(format!("store-{stores}"));
                    tr = trainer_over(&fresh, engine, base).map_err(|e| err("a new trainer", e))?;
                    if Checkpoint::newest(&ckpts).map_err(|e| err("the run", e))?.is_some() {
                        tr.resume(&ckpts).map_err(|e| err("resuming", e))?;
                        t.resumed += 1;
                    } else {
                        t.restarted += 1;
                    }
                    // The steps the checkpoint holds are not done again; the rest are.
                    let done = tr.steps();
                    losses.truncate(done as usize);
                    let steps_before = |k: usize| script[..k].iter().filter(|&&c| c == 0).count();
                    i = (0..=script.len()).find(|&k| steps_before(k) as u64 >= done).unwrap_or(0);
                    tries = 1;
                }
            }
        }
    }
    // The run is over: the reads below are the test's (and a count stops here).
    t.fired |= failpoint::fired();
    failpoint::disarm();
    let st = state(&mut tr).map_err(|e| err("reading the state", e))?;
    Ok((losses, st))
}

/// The survey at `per_site` passes of each site (spread over its count), for each of `kinds`
/// (an engine and what it trains).
fn survey(per_site: u64, kinds: &[(Engine, Base)]) {
    let _turn = super::ARMED.lock().unwrap_or_else(|e| e.into_inner());
    let sites: Vec<Site> = Site::ALL
        .into_iter()
        .filter(|s| !matches!(s, Site::Alloc | Site::DiskOpen | Site::WorkerStart))
        .collect();
    let (mut runs, mut faults, mut failed_calls, mut wrong, mut lost) =
        (0u64, 0u64, 0u64, Vec::new(), Vec::new());
    let (mut saves_ok, mut saves_refused, mut resumed, mut restarted) = (0u64, 0u64, 0u64, 0u64);
    let mut saves_backend_failed = 0u64;
    for &(engine, base) in kinds {
        let kind = (engine, base);
        let dir = tempfile::tempdir().unwrap();
        let clean = run(&dir.path().join("clean"), kind, &|| {}, false, &mut Tally::default())
            .unwrap_or_else(|e| panic!("{engine}, {base:?}: the clean run failed: {e}"));
        assert_eq!(clean.0.len() as u64, STEPS);
        let _ =
            run(&dir.path().join("count"), kind, &failpoint::count, false, &mut Tally::default());
        let passes: Vec<(Site, u64)> = sites.iter().map(|&s| (s, failpoint::hits(s))).collect();
        failpoint::disarm();
        for (site, n) in passes {
            // Up to `per_site` passes, spread over the count (its middle for one).
            let ks: Vec<u64> = match (n, per_site) {
                (0, _) => Vec::new(),
                (_, 1) => vec![n.div_ceil(2)],
                (n, p) if n <= p => (1..=n).collect(),
                (n, p) => (0..p).map(|j| 1 + j * (n - 1) / (p - 1)).collect(),
            };
            for k in ks {
                for sticky in [false, true] {
                    runs += 1;
                    let fault = match site {
                        Site::DiskWrite | Site::SaveWrite => Fault::NoSpace,
                        Site::DiskRead | Site::FileRead | Site::SaveSync | Site::SaveRename => {
                            Fault::Io
                        }
                        _ => Fault::Backend,
                    };
                    let ctx = format!(
                        "{engine}, {base:?}, {site:?} #{k} of {n}, {}",
                        if sticky { "sticky" } else { "transient" }
                    );
                    let arm = move || {
                        if sticky {
                            failpoint::arm_from(site, k, fault)
                        } else {
                            failpoint::arm(site, k, fault)
                        }
                    };
                    if let Ok(only) = std::env::var("STRATA_FAULTS_ONLY") {
                        if !ctx.starts_with(&only) {
                            continue;
                        }
                        eprintln!("run: {ctx}");
                    }
                    let d = tempfile::tempdir().unwrap();
                    let mut t = Tally::default();
                    let r = run(d.path(), kind, &arm, sticky, &mut t);
                    failpoint::disarm();
                    faults += u64::from(t.fired);
                    failed_calls += t.failed_calls;
                    saves_ok += t.saves_ok;
                    saves_refused += t.saves_refused;
                    saves_backend_failed += t.saves_backend_failed;
                    resumed += t.resumed;
                    restarted += t.restarted;
                    match r {
                        Ok(got) if got == clean => {}
                        Ok(got) => wrong.push(format!(
                            "{ctx}: ended other than the clean run (losses {:?}, clean {:?}; \
                             state tensors differing: {:?})",
                            got.0.iter().map(|b| f32::from_bits(*b)).collect::<Vec<_>>(),
                            clean.0.iter().map(|b| f32::from_bits(*b)).collect::<Vec<_>>(),
                            (0..got.1.len())
                                .filter(|&i| got.1[i] != clean.1[i])
                                .collect::<Vec<_>>()
                        )),
                        Err(e) => lost.push(format!("{ctx}: {e}")),
                    }
                }
            }
        }
    }
    println!(
        "trainer under faults: {runs} runs, {faults} faults injected, {failed_calls} calls failed; \
         lost {}, wrong {}; saves after a failure: {saves_ok} succeeded, {saves_refused} failed \
         with the sticky fault still there, {saves_backend_failed} refused with BackendFailed; \
         {resumed} runs resumed \
         from a checkpoint in a new store, {restarted} begun again (no checkpoint yet)",
        lost.len(),
        wrong.len()
    );
    assert!(wrong.is_empty(), "wrong:\n{}", wrong.join("\n"));
    assert!(lost.is_empty(), "lost:\n{}", lost.join("\n"));
    assert!(faults > 0);
}

/// Every site at the middle of its passes, transient and sticky, both engines (in CI).
#[test]
fn the_trainer_survives_a_fault_at_every_site() {
    if !super::runs_here("trainer::the_trainer_survives_a_fault_at_every_site") {
        return;
    }
    survey(1, &[(Engine::Cpu, Base::Random), (Engine::GpuResident, Base::Random)]);
}

/// QLoRA over a quantized GGUF base (its weights read in place from the file, the adapters
/// and their moments trained): every site at the middle of its passes, transient and sticky.
/// The adapters, their moments and the checkpoints end as the clean run's, bit for bit.
#[test]
fn qlora_over_a_gguf_base_survives_a_fault_at_every_site() {
    if !super::runs_here("trainer::qlora_over_a_gguf_base_survives_a_fault_at_every_site") {
        return;
    }
    survey(1, &[(Engine::Cpu, Base::Gguf)]);
}

/// Six passes of every site (about two minutes on two cores).
#[test]
#[ignore = "minutes: cargo test --features failpoints,candle --test faults every_site_six -- --ignored --nocapture"]
fn the_trainer_survives_faults_at_every_site_six_passes_each() {
    survey(
        6,
        &[
            (Engine::Cpu, Base::Random),
            (Engine::GpuResident, Base::Random),
            (Engine::Cpu, Base::Gguf),
            (Engine::Cpu, Base::Speculating),
        ],
    );
}

/// Speculative updates (no clipping, room for every backup) under a fault at every site, at the
/// middle of its passes, transient and sticky: every run ends as the clean run, bit for bit.
#[test]
#[ignore = "half a minute: cargo test --features failpoints,candle --test faults speculative_updates_survive -- --ignored --nocapture"]
fn speculative_updates_survive_a_fault_at_every_site() {
    survey(1, &[(Engine::Cpu, Base::Speculating)]);
}

/// A step retried after a transient fault is the clean step, and the last complete step can be
/// saved after it: checked directly on the trainer the fault hit, for a fault in the
/// computation itself (an error candle returns).
#[test]
fn a_step_that_fails_in_its_computation_leaves_the_trainer_as_it_was() {
    let _turn = super::ARMED.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let tc = train(Engine::Cpu);
    let mut tr = trainer(&dir.path().join("a"), Engine::Cpu).unwrap();
    let mut clean = trainer(&dir.path().join("b"), Engine::Cpu).unwrap();
    for step in 0..2 {
        clean.step(&batches(step, &tc)).unwrap();
    }
    tr.step(&batches(0, &tc)).unwrap();
    failpoint::arm(Site::Compute, 2, Fault::Backend);
    let e = tr.step(&batches(1, &tc)).unwrap_err();
    failpoint::disarm();
    assert!(e.to_string().contains("injected"), "{e}");
    assert!(TrainError::find(&e).is_none());
    assert_eq!(tr.steps(), 1);
    let saved = tr.save(dir.path().join("ck")).unwrap();
    assert_eq!(Checkpoint::open(&saved).unwrap().step, 1);
    tr.step(&batches(1, &tc)).unwrap();
    assert!(state(&mut tr).unwrap() == state(&mut clean).unwrap());
}

/// A fault in the backward after some of the step's updates started speculatively (clipping
/// off: the head's and the last block's, queued as their gradients were final): the step fails,
/// those updates are undone from their backups (the trainer is as before the step, and saves),
/// and the step retried is the clean step, bit for bit.
#[test]
fn a_fault_after_speculative_updates_undoes_them() {
    let _turn = super::ARMED.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let tc = TrainConfig { clip: None, ..train(Engine::Cpu) };
    let make = |name: &str| {
        // A Pinned tier with room for the backups beside the state.
        let s = store_of(&dir.path().join(name), Engine::Cpu, 1 << 20).unwrap();
        let c = config();
        let w = put_random_weights(&s, &c, 7, strata::DType::F32).unwrap();
        Trainer::new(s, &Device::Cpu, c, tc.clone(), w).unwrap()
    };
    let (mut tr, mut clean, mut before) = (make("a"), make("b"), make("c"));
    for step in 0..2 {
        assert!(clean.step(&batches(step, &tc)).unwrap().speculated > 0);
    }
    tr.step(&batches(0, &tc)).unwrap();
    before.step(&batches(0, &tc)).unwrap();
    // The computation's passes: the forward (1), then after each block's backward (2, 3): the
    // third comes after the head's and block 1's updates were queued.
    failpoint::arm(Site::Compute, 3, Fault::Backend);
    let e = tr.step(&batches(1, &tc)).unwrap_err();
    failpoint::disarm();
    assert!(e.to_string().contains("injected"), "{e}");
    assert!(tr.optimizer().unwrap().undone() > 0, "no update had started: nothing undone");
    assert_eq!(tr.steps(), 1);
    assert!(
        state(&mut tr).unwrap() == state(&mut before).unwrap(),
        "the failed step changed state"
    );
    let saved = tr.save(dir.path().join("ck")).unwrap();
    assert_eq!(Checkpoint::open(&saved).unwrap().step, 1);
    tr.step(&batches(1, &tc)).unwrap();
    assert!(state(&mut tr).unwrap() == state(&mut clean).unwrap());
}

/// A PEFT adapter of rank 2 on `q_proj` and `down_proj` of `config()`'s blocks (B not zero).
fn adapter(dir: &Path) {
    use strata::candle::lora::LoraConfig;
    use strata::candle::lora::{peft_name, write_adapter_config, ADAPTER_FILE};
    let c = config();
    let (h, i) = (c.hidden_size, c.intermediate_size);
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    for l in 0..c.num_hidden_layers {
        for (linear, out, inp) in [("self_attn.q_proj", h, h), ("mlp.down_proj", h, i)] {
            let base = format!("model.layers.{l}.{linear}");
            let a: Vec<f32> = (0..2 * inp).map(|k| ((k * 7 + l) % 13) as f32 * 0.01).collect();
            let b: Vec<f32> = (0..out * 2).map(|k| ((k * 5 + l) % 11) as f32 * -0.02).collect();
            tensors.push((peft_name(&format!("{base}.lora_A.weight")), vec![2, inp], a));
            tensors.push((peft_name(&format!("{base}.lora_B.weight")), vec![out, 2], b));
        }
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, shape, v)| {
            let bytes: &[u8] = bytemuck::cast_slice(v);
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                    .unwrap(),
            )
        })
        .collect();
    std::fs::create_dir_all(dir).unwrap();
    safetensors::serialize_to_file(views, None, &dir.join(ADAPTER_FILE)).unwrap();
    write_adapter_config(dir, &LoraConfig::new(2, 4.0, &["q_proj", "down_proj"]), None).unwrap();
}

/// Merging an adapter into the store's weights (`candle_generate --adapter`) with a fault at
/// each pass of every site: it succeeds with the clean merge's weights, or fails with every
/// weight as it was.
#[test]
fn a_merge_that_fails_at_any_pass_of_any_site_leaves_every_weight_as_it_was() {
    use strata::candle::lora::merge_adapter_into;
    let _turn = super::ARMED.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    adapter(&dir.path().join("adapter"));
    let c = config();
    let fresh = |sub: &str| {
        let s = store(&dir.path().join(sub), Engine::Cpu).unwrap();
        let w = put_random_weights(&s, &c, 7, strata::DType::F32).unwrap();
        (s, w)
    };
    let read_all = |s: &Store, w: &[(String, strata::TensorId)]| -> Vec<Vec<u8>> {
        w.iter().map(|(_, id)| s.read(*id).unwrap()).collect()
    };
    let (s, w) = fresh("clean");
    let base = read_all(&s, &w);
    let m = merge_adapter_into(&s, &w, dir.path().join("adapter")).unwrap();
    assert_eq!(m.linears.len(), 4);
    let merged = read_all(&s, &w);
    assert_ne!(merged, base);
    let (mut failed, mut runs) = (0, 0);
    for (n, site) in Site::ALL.into_iter().enumerate() {
        let fault = match site {
            Site::DiskWrite => Fault::NoSpace,
            Site::Alloc => Fault::OutOfMemory,
            Site::FileRead | Site::DiskRead | Site::SaveWrite => Fault::Io,
            _ => Fault::Backend,
        };
        for k in 1.. {
            let (s, w) = fresh(&format!("{n}-{k}"));
            failpoint::arm(site, k, fault);
            let r = merge_adapter_into(&s, &w, dir.path().join("adapter"));
            let fired = failpoint::fired();
            failpoint::disarm();
            runs += 1;
            let now = read_all(&s, &w);
            assert_eq!(s.ids().len(), w.len(), "{site:?} pass {k}: a backup was left behind");
            match r {
                Ok(_) => assert!(now == merged, "{site:?} pass {k}: merged, but not as clean"),
                Err(e) => {
                    assert!(fired, "{site:?} pass {k}: {e} with no fault");
                    assert!(now == base, "{site:?} pass {k}: failed ({e}) and changed weights");
                    failed += 1;
                }
            }
            if !fired || k >= 200 {
                break;
            }
        }
    }
    println!("merge under faults: {runs} runs, {failed} failed cleanly, the rest merged as clean");
    assert!(failed > 0, "no fault reached the merge");
}

/// Set in a child process of a kill test: what it is to do before it is killed (the test's
/// own body runs as the child).
const KILL_CHILD: &str = "STRATA_KILL_CHILD";

/// Runs test `name` of this binary in a child process with [`KILL_CHILD`] set to `what`;
/// whether the child was killed (by the armed [`Fault::Kill`]: `SIGABRT`).
fn killed_child(name: &str, what: &str) -> bool {
    use std::os::unix::process::ExitStatusExt;
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env(KILL_CHILD, what)
        .output()
        .unwrap();
    let killed = out.status.signal() == Some(libc::SIGABRT);
    if !killed && !out.status.success() {
        panic!("the child failed:\n{}", String::from_utf8_lossy(&out.stderr));
    }
    killed
}

/// The entries of `dir`, sorted.
fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// A checkpoint saved again at the same step (a run resumed from an older one and saving every
/// step: issue 40's lost checkpoint) with the process killed at each step of the replacement:
/// the last file renamed inside the new hidden directory, the old one moved aside, the new one
/// moved into place, the old one removed. After each kill the run's newest checkpoint is whole
/// and of that step (the old one or the new, bit for bit the same save), and the next save
/// leaves exactly it: nothing of the killed process stays.
#[test]
fn a_resave_killed_at_each_point_of_the_replacement_leaves_the_step_whole() {
    let name = "trainer::a_resave_killed_at_each_point_of_the_replacement_leaves_the_step_whole";
    if let Ok(what) = std::env::var(KILL_CHILD) {
        let (dir, k) = what.rsplit_once('|').unwrap();
        let dir = Path::new(dir);
        let mut tr = trainer(&dir.join(format!("slab-child-{k}")), Engine::Cpu).unwrap();
        tr.resume(dir.join("run")).unwrap();
        failpoint::arm(Site::SaveRename, k.parse().unwrap(), Fault::Kill);
        tr.save(dir.join("run")).unwrap();
        return;
    }
    let _turn = super::ARMED.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let t = train(Engine::Cpu);
    let mut tr = trainer(&dir.path().join("slab"), Engine::Cpu).unwrap();
    for step in 0..2 {
        tr.step(&batches(step, &t)).unwrap();
    }
    tr.save(&run).unwrap();
    failpoint::count();
    tr.save(&run).unwrap();
    let passes = failpoint::hits(Site::SaveRename);
    failpoint::disarm();
    let clean_state = state(&mut tr).unwrap();
    drop(tr);
    // Two saves of one state differ in their files' bytes (the order of a header's metadata),
    // not in their files' names and sizes, nor in the state a resume reads back.
    let shape = |ck: &Checkpoint| -> Vec<(String, u64)> {
        ck.files.iter().map(|f| (f.name.clone(), f.bytes)).collect()
    };
    let clean = shape(&Checkpoint::open(&run).unwrap());
    assert!(passes >= 4, "{passes} renames in a save");
    for k in passes - 3..=passes {
        let what = format!("{}|{k}", dir.path().display());
        assert!(killed_child(name, &what), "pass {k} of {passes}: not killed");
        let newest = Checkpoint::newest(&run).unwrap().expect("a checkpoint after the kill");
        let ck = Checkpoint::open(&newest).unwrap_or_else(|e| panic!("pass {k}: {e}"));
        assert_eq!((ck.step, shape(&ck)), (2, clean.clone()), "pass {k}: {}", newest.display());
        let mut tr = trainer(&dir.path().join(format!("slab-{k}")), Engine::Cpu).unwrap();
        tr.resume(&run).unwrap();
        assert!(state(&mut tr).unwrap() == clean_state, "pass {k}: another state");
        tr.save(&run).unwrap();
        assert_eq!(entries(&run), ["step-00000002"], "pass {k}");
    }
    // A failure (not a kill) at each step of the replacement: the step stays whole.
    for k in passes - 2..=passes {
        let mut tr = trainer(&dir.path().join(format!("slab-f{k}")), Engine::Cpu).unwrap();
        tr.resume(&run).unwrap();
        failpoint::arm(Site::SaveRename, k, Fault::Io);
        let r = tr.save(&run);
        failpoint::disarm();
        assert_eq!(r.is_ok(), k == passes, "pass {k}: {r:?}");
        assert_eq!(shape(&Checkpoint::open(&run).unwrap()), clean, "pass {k}");
        tr.save(&run).unwrap();
        assert_eq!(entries(&run), ["step-00000002"], "pass {k}");
    }
}

/// A merged export (`Trainer::save_merged`) killed half-way leaves its hidden directory, which
/// the next export beside it removes; one that fails removes its own; every file is flushed
/// (a `SaveSync` pass each) and gets the mode a new file gets, as a checkpoint's do.
#[test]
fn a_merged_export_killed_or_failing_leaves_nothing_behind() {
    use std::os::unix::fs::PermissionsExt;
    let name = "trainer::a_merged_export_killed_or_failing_leaves_nothing_behind";
    if let Ok(dir) = std::env::var(KILL_CHILD) {
        let dir = Path::new(&dir);
        let mut tr = trainer(&dir.join("slab-child"), Engine::Cpu).unwrap();
        failpoint::arm(Site::SaveWrite, 2, Fault::Kill);
        tr.save_merged(dir.join("exports").join("killed")).unwrap();
        return;
    }
    let _turn = super::ARMED.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let exports = dir.path().join("exports");
    let mut tr = trainer(&dir.path().join("slab"), Engine::Cpu).unwrap();
    failpoint::count();
    tr.save_merged(exports.join("a")).unwrap();
    let (writes, syncs) = (failpoint::hits(Site::SaveWrite), failpoint::hits(Site::SaveSync));
    failpoint::disarm();
    let files = entries(&exports.join("a"));
    assert_eq!(syncs as usize, files.len(), "every file flushed: {files:?}");
    assert!(writes >= 3);
    // The modes a new file and directory get here (0666 and 0777 less the umask).
    let probe = dir.path().join("probe");
    std::fs::create_dir(&probe).unwrap();
    std::fs::write(probe.join("f"), b"").unwrap();
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&exports.join("a")), mode(&probe));
    for f in &files {
        assert_eq!(mode(&exports.join("a").join(f)), mode(&probe.join("f")), "{f}");
    }

    assert!(killed_child(name, &dir.path().display().to_string()));
    let left = entries(&exports);
    assert!(left.iter().any(|n| n.starts_with(".tmp-merged-")), "{left:?}");
    tr.save_merged(exports.join("b")).unwrap();
    assert_eq!(entries(&exports), ["a", "b"]);

    for k in 1..=writes {
        failpoint::arm(Site::SaveWrite, k, Fault::Io);
        let r = tr.save_merged(exports.join("c"));
        failpoint::disarm();
        assert!(r.is_err(), "pass {k}");
        assert_eq!(entries(&exports), ["a", "b"], "pass {k}");
    }
}
