//! A training run you can trust with days of work (issue 31): checkpoints whole or absent and
//! checked file by file before use, a resume that refuses another run, divergence stopped
//! before it lands, hyperparameters and token files refused up front.

use std::path::{Path, PathBuf};

use candle_core::Device;
use strata::candle::train::{load_tokens, Checkpoint, TrainError};
use strata::candle::{put_random_weights, LlamaConfig, LrSchedule, TrainConfig, Trainer};
use strata::optim::Engine;

use super::train::{batches, bits, store, tiny, train_config, trainer};

/// Every parameter's and optimizer-state tensor's bits, after the queued updates.
fn state(tr: &mut Trainer) -> Vec<(String, Vec<u32>)> {
    tr.finish().unwrap();
    let store = tr.store().clone();
    let mut out = Vec::new();
    for (name, _) in tr.config().tensors() {
        out.push((name.clone(), bits(&tr.read_param(&name).unwrap())));
        for suffix in ["exp_avg", "exp_avg_sq"] {
            let n = format!("{name}.{suffix}");
            if let Some(id) = store.lookup(&n) {
                out.push((n, bits(&store.read_vec::<f32>(id).unwrap())));
            }
        }
    }
    out
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// The checkpoint error inside `e`, with the file it names.
fn bad_file(e: &candle_core::Error) -> PathBuf {
    match TrainError::find(e) {
        Some(TrainError::BadCheckpoint { path, .. }) => path.clone(),
        _ => panic!("not a BadCheckpoint error: {e}"),
    }
}

/// A run of `steps` steps saved into `dir`: the checkpoint's path.
fn saved_run(dir: &Path, c: &LlamaConfig, t: &TrainConfig, seed: u64, steps: u64) -> PathBuf {
    let (mut tr, _) = trainer(c, t, seed);
    for step in 0..steps {
        tr.step(&batches(step, c, t)).unwrap();
    }
    tr.save(dir).unwrap()
}

#[test]
fn a_checkpoint_is_checked_file_by_file_before_anything_is_used() {
    let c = tiny(false);
    let t = train_config(Some(1.0), Engine::Cpu, &[]);
    let runs = tempfile::tempdir().unwrap();
    let good = saved_run(&runs.path().join("a"), &c, &t, 1, 2);
    // Another run of the same shapes: its optimizer files fit the trainer's tensors.
    let other = saved_run(&runs.path().join("b"), &c, &t, 2, 2);

    let opt2 = "optimizer-00002-of-00005.safetensors";
    type Tamper = Box<dyn Fn(&Path)>;
    let cases: Vec<(&str, &str, Tamper)> = vec![
        (
            "a byte flipped in a shard",
            "model-00003-of-00005.safetensors",
            Box::new(|d| {
                let p = d.join("model-00003-of-00005.safetensors");
                let mut b = std::fs::read(&p).unwrap();
                let n = b.len();
                b[n - 7] ^= 0x10;
                std::fs::write(&p, b).unwrap();
            }),
        ),
        (
            "a shard cut short",
            opt2,
            Box::new(move |d| {
                let p = d.join(opt2);
                let b = std::fs::read(&p).unwrap();
                std::fs::write(&p, &b[..b.len() / 2]).unwrap();
            }),
        ),
        (
            "a shard missing",
            "model-00002-of-00005.safetensors",
            Box::new(|d| std::fs::remove_file(d.join("model-00002-of-00005.safetensors")).unwrap()),
        ),
        (
            "another run's optimizer file",
            opt2,
            Box::new({
                let other = other.clone();
                move |d| {
                    std::fs::copy(other.join(opt2), d.join(opt2)).unwrap();
                }
            }),
        ),
        (
            "an index edited to optimizer_steps=18446744073709551615",
            "optimizer.safetensors.index.json",
            Box::new(|d| {
                let p = d.join("optimizer.safetensors.index.json");
                let text = std::fs::read_to_string(&p).unwrap();
                let edited = text.replace(
                    "\"optimizer_steps\":\"2\"",
                    "\"optimizer_steps\":\"18446744073709551615\"",
                );
                assert_ne!(text, edited);
                std::fs::write(&p, edited).unwrap();
            }),
        ),
        (
            "no commit record (a save cut short)",
            "checkpoint.json",
            Box::new(|d| std::fs::remove_file(d.join("checkpoint.json")).unwrap()),
        ),
        (
            "a commit record edited to 99 steps",
            "checkpoint.json",
            Box::new(|d| {
                let p = d.join("checkpoint.json");
                let text = std::fs::read_to_string(&p).unwrap();
                let edited = text.replace("\"step\": 2", "\"step\": 99");
                assert_ne!(text, edited);
                std::fs::write(&p, edited).unwrap();
            }),
        ),
    ];
    for (what, file, tamper) in cases {
        let d = runs.path().join("tampered");
        let _ = std::fs::remove_dir_all(&d);
        copy_dir(&good, &d);
        tamper(&d);
        let (mut tr, _) = trainer(&c, &t, 9);
        let before = state(&mut tr);
        let e = tr.resume(&d).unwrap_err();
        assert_eq!(bad_file(&e).file_name().unwrap(), file, "{what}: {e}");
        assert_eq!(tr.steps(), 0, "{what}");
        assert!(state(&mut tr) == before, "{what}: the trainer changed");
        // And the trainer goes on.
        tr.step(&batches(0, &c, &t)).unwrap();
    }
    // The checkpoint itself resumes.
    let (mut tr, _) = trainer(&c, &t, 9);
    tr.resume(&good).unwrap();
    assert_eq!(tr.steps(), 2);
}

#[test]
fn resume_refuses_another_architecture_dtype_frozen_set_batch_or_horizon() {
    let c = tiny(false);
    let t = train_config(Some(1.0), Engine::Cpu, &[]);
    let runs = tempfile::tempdir().unwrap();
    let ck = saved_run(runs.path(), &c, &t, 1, 2);
    let two_layers = LlamaConfig { num_hidden_layers: 2, ..c.clone() };
    let frozen = train_config(Some(1.0), Engine::Cpu, &["*.input_layernorm.weight"]);
    let longer = TrainConfig { schedule: LrSchedule { total: 50, ..t.schedule }, ..t.clone() };
    let batch = TrainConfig { accum: 1, ..t.clone() };
    let cases: Vec<(&str, LlamaConfig, TrainConfig, strata::DType)> = vec![
        ("num_hidden_layers", two_layers, t.clone(), strata::DType::F32),
        ("frozen parameters", c.clone(), frozen, strata::DType::F32),
        ("dtype", c.clone(), t.clone(), strata::DType::BF16),
        ("horizon", c.clone(), longer, strata::DType::F32),
        ("accum", c.clone(), batch, strata::DType::F32),
    ];
    for (what, config, train, dtype) in cases {
        let s = store(&config);
        let w = put_random_weights(&s, &config, 9, dtype).unwrap();
        let mut tr = Trainer::new(s, &Device::Cpu, config, train, w).unwrap();
        let before = state(&mut tr);
        let e = tr.resume(&ck).unwrap_err();
        match TrainError::find(&e) {
            Some(TrainError::Mismatch { what: w, .. }) => assert!(w.contains(what), "{w}: {e}"),
            _ => panic!("{what}: not a Mismatch: {e}"),
        }
        assert!(e.to_string().contains(what), "{e}");
        assert_eq!(tr.steps(), 0);
        assert!(state(&mut tr) == before, "{what}: the trainer changed");
    }
    // The checkpoint's own config, read back exactly.
    let opened = Checkpoint::open(runs.path()).unwrap();
    assert_eq!((opened.config, opened.train, opened.step), (c, t, 2));
}

#[test]
fn saves_keep_the_newest_checkpoints_of_one_run_and_clean_up_after_dead_saves() {
    let c = tiny(false);
    let t = train_config(None, Engine::Cpu, &[]);
    let dir = tempfile::tempdir().unwrap();
    let (mut tr, _) = trainer(&c, &t, 1);
    // What a save killed half-way leaves: a hidden directory of a process that is gone.
    let dead = dir.path().join(".tmp-4000000000-00000000000000aa-step-00000001");
    std::fs::create_dir_all(&dead).unwrap();
    std::fs::write(dead.join("model-00001-of-00005.safetensors"), b"half").unwrap();
    for step in 0..4 {
        tr.step(&batches(step, &c, &t)).unwrap();
        tr.save(dir.path()).unwrap();
    }
    let names = |d: &Path| {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    assert_eq!(names(dir.path()), ["step-00000003", "step-00000004"]);
    assert!(tr.save_keeping(dir.path(), 0).is_err());
    tr.save_keeping(dir.path(), 1).unwrap();
    assert_eq!(names(dir.path()), ["step-00000004"]);

    // Another run's trainer does not save into this run's directory.
    let (mut other, _) = trainer(&c, &t, 2);
    other.step(&batches(0, &c, &t)).unwrap();
    let e = other.save(dir.path()).unwrap_err();
    assert!(
        matches!(TrainError::find(&e), Some(TrainError::Mismatch { what, .. }) if what.contains("run")),
        "{e}"
    );
    assert_eq!(names(dir.path()), ["step-00000004"]);

    // Resumed from an older checkpoint, the run's later ones are replaced by its new history.
    let older = dir.path().join("older");
    let (mut tr2, _) = trainer(&c, &t, 1);
    let first = tr2.save(&older).unwrap();
    tr2.step(&batches(0, &c, &t)).unwrap();
    tr2.save(&older).unwrap();
    tr2.step(&batches(1, &c, &t)).unwrap();
    tr2.save_keeping(&older, 5).unwrap();
    let (mut back, _) = trainer(&c, &t, 1);
    back.resume(older.join("step-00000001")).unwrap();
    assert_eq!(back.run_id(), tr2.run_id());
    back.save_keeping(&older, 5).unwrap();
    assert_eq!(names(&older), ["step-00000000", "step-00000001"]);
    assert_eq!(first, older.join("step-00000000"));
}

/// A learning rate of 1e30 (issue 31's case): the first step's update throws the weights to
/// about ±1e30, and the second step's loss is not finite.
fn diverging(skip: bool) -> TrainConfig {
    TrainConfig {
        schedule: LrSchedule::constant(1e30),
        skip_nonfinite: skip,
        ..train_config(None, Engine::Cpu, &[])
    }
}

#[test]
fn a_diverged_step_fails_before_anything_changes_and_the_run_can_be_saved() {
    let c = tiny(false);
    let t = diverging(false);
    let (mut tr, _) = trainer(&c, &t, 1);
    assert!(tr.step(&batches(0, &c, &t)).unwrap().loss.is_finite());
    let before = state(&mut tr);
    let undone = |tr: &Trainer| tr.optimizer().unwrap().undone();
    for attempt in 1..=2 {
        let e = tr.step(&batches(1, &c, &t)).unwrap_err();
        // The step's updates had started during the backward: undone before the error.
        assert!(undone(&tr) >= attempt, "attempt {attempt}: nothing was undone");
        assert!(
            matches!(TrainError::find(&e), Some(TrainError::NonFinite { step: 1, .. })),
            "not NonFinite at step 1: {e}"
        );
        assert!(e.to_string().contains("the run diverged"), "{e}");
        assert_eq!(tr.steps(), 1);
        assert!(state(&mut tr) == before, "the failed step changed the trainer");
    }
    // The last complete step saves (its values are finite), and resumes.
    let dir = tempfile::tempdir().unwrap();
    let ck = tr.save(dir.path()).unwrap();
    let (mut again, _) = trainer(&c, &t, 5);
    again.resume(&ck).unwrap();
    assert!(state(&mut again) == before);

    // Skipped instead: counted, nothing updated, the step number moves on.
    let t = diverging(true);
    let (mut tr, _) = trainer(&c, &t, 1);
    tr.step(&batches(0, &c, &t)).unwrap();
    let before = state(&mut tr);
    let r = tr.step(&batches(1, &c, &t)).unwrap();
    assert!(r.skipped && r.step == 1);
    // Its updates had started during the backward (no clipping): all undone from their backups.
    assert!(r.speculated > 0 && r.undone == r.speculated, "{r:?}");
    assert_eq!((tr.steps(), tr.skipped()), (2, 1));
    assert!(state(&mut tr) == before);
    let ck = tr.save(dir.path().join("skipping")).unwrap();
    let opened = Checkpoint::open(&ck).unwrap();
    assert_eq!((opened.step, opened.optimizer_steps, opened.skipped), (2, 1, 1));
}

#[test]
fn a_nan_loss_fails_the_step_and_a_non_finite_state_is_never_saved() {
    let c = tiny(false);
    let t = train_config(None, Engine::Cpu, &[]);
    let (mut tr, _) = trainer(&c, &t, 1);
    let store = tr.store().clone();
    let norm = store.lookup("model.norm.weight").unwrap();
    let mut w = store.read_vec::<f32>(norm).unwrap();
    w[3] = f32::NAN;
    store.write(norm, bytemuck_f32(&w).as_slice()).unwrap();
    let before = state(&mut tr);
    let e = tr.step(&batches(0, &c, &t)).unwrap_err();
    match TrainError::find(&e) {
        Some(TrainError::NonFinite { step: 0, what, value }) => {
            assert_eq!(what, "the loss");
            assert!(value.is_nan());
        }
        _ => panic!("not NonFinite: {e}"),
    }
    assert!(e.to_string().starts_with("step 0: the loss is NaN"), "{e}");
    assert_eq!(tr.steps(), 0);
    assert!(state(&mut tr) == before);
    let dir = tempfile::tempdir().unwrap();
    let e = tr.save(dir.path()).unwrap_err();
    match TrainError::find(&e) {
        Some(TrainError::NonFinite { what, .. }) => {
            assert!(what.starts_with("model.norm.weight"), "{e}")
        }
        _ => panic!("not NonFinite: {e}"),
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "something was left");
}

#[test]
fn a_non_finite_gradient_fails_the_step_naming_it() {
    // A final-norm weight of 1e20 keeps the loss finite (about 1e17) but the output
    // projection's gradient, about 1e20, has a sum of squares past f32.
    let c = tiny(false);
    let t = train_config(None, Engine::Cpu, &[]);
    let (mut tr, _) = trainer(&c, &t, 1);
    let store = tr.store().clone();
    let norm = store.lookup("model.norm.weight").unwrap();
    let mut w = store.read_vec::<f32>(norm).unwrap();
    w[0] = 1e20;
    store.write(norm, bytemuck_f32(&w).as_slice()).unwrap();
    let before = state(&mut tr);
    let e = tr.step(&batches(0, &c, &t)).unwrap_err();
    match TrainError::find(&e) {
        Some(TrainError::NonFinite { step: 0, what, value }) => {
            assert!(what.starts_with("the gradient norm (first at "), "{what}");
            assert!(value.is_infinite());
        }
        _ => panic!("not NonFinite: {e}"),
    }
    assert_eq!(tr.steps(), 0);
    assert!(state(&mut tr) == before);
}

fn bytemuck_f32(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

#[test]
fn hyperparameters_that_cannot_train_are_refused_up_front() {
    let c = tiny(false);
    let t = train_config(Some(1.0), Engine::Cpu, &[]);
    let sched = |peak: f64, min: f64| LrSchedule { peak, min, ..t.schedule };
    let cases: Vec<(&str, TrainConfig)> = vec![
        ("learning rate NaN", TrainConfig { schedule: sched(f64::NAN, 0.0), ..t.clone() }),
        ("learning rate -1", TrainConfig { schedule: sched(-1.0, 0.0), ..t.clone() }),
        ("learning rate 0", TrainConfig { schedule: sched(0.0, 0.0), ..t.clone() }),
        ("learning rate inf", TrainConfig { schedule: sched(f64::INFINITY, 0.0), ..t.clone() }),
        ("minimum learning rate NaN", TrainConfig { schedule: sched(1e-3, f64::NAN), ..t.clone() }),
        ("minimum learning rate -1", TrainConfig { schedule: sched(1e-3, -1.0), ..t.clone() }),
        (
            "weight decay NaN",
            TrainConfig {
                adamw: strata::optim::AdamW { weight_decay: f64::NAN, ..t.adamw },
                ..t.clone()
            },
        ),
        (
            "weight decay -1",
            TrainConfig {
                adamw: strata::optim::AdamW { weight_decay: -1.0, ..t.adamw },
                ..t.clone()
            },
        ),
        ("eps 0", TrainConfig { adamw: strata::optim::AdamW { eps: 0.0, ..t.adamw }, ..t.clone() }),
        (
            "beta1 1",
            TrainConfig { adamw: strata::optim::AdamW { beta1: 1.0, ..t.adamw }, ..t.clone() },
        ),
        (
            "beta2 -0.5",
            TrainConfig { adamw: strata::optim::AdamW { beta2: -0.5, ..t.adamw }, ..t.clone() },
        ),
        ("clipping at NaN", TrainConfig { clip: Some(f64::NAN), ..t.clone() }),
        ("clipping at -1", TrainConfig { clip: Some(-1.0), ..t.clone() }),
        ("accum 18446744073709551615", TrainConfig { accum: usize::MAX, ..t.clone() }),
        ("micro-batch 100000000", TrainConfig { micro_batch: 100_000_000, ..t.clone() }),
        ("accum 100000000", TrainConfig { accum: 100_000_000, ..t.clone() }),
    ];
    for (what, train) in cases {
        let s = store(&c);
        let w = put_random_weights(&s, &c, 1, strata::DType::F32).unwrap();
        let e = Trainer::new(s.clone(), &Device::Cpu, c.clone(), train, w).unwrap_err();
        assert!(
            matches!(
                TrainError::find(&e),
                Some(TrainError::Invalid(_) | TrainError::TooLarge { .. })
            ),
            "{what}: {e}"
        );
        // Nothing was made: no gradient, no state, no checkpoint tensor.
        assert!(s.lookup("model.norm.weight.grad").is_none(), "{what}");
        assert!(s.lookup("checkpoint.layers.0.micro_batch.0").is_none(), "{what}");
    }
}

#[test]
fn token_files_are_regular_sized_and_long_enough() {
    let dir = tempfile::tempdir().unwrap();
    let ids = |v: &[u32]| v.iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>();
    let write = |name: &str, bytes: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    };
    let ok = write("ok.bin", &ids(&(0..20).collect::<Vec<u32>>()));
    assert_eq!(load_tokens(&ok, 97, 16).unwrap().len(), 20);
    let fifo = dir.path().join("fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let cases: Vec<(PathBuf, usize, &str)> = vec![
        (PathBuf::from("/dev/zero"), 16, "character device"),
        (fifo, 16, "FIFO"),
        (dir.path().to_path_buf(), 16, "directory"),
        (ok.clone(), 20, "fewer than one sequence"),
        (write("short.bin", &ids(&[1, 2, 3])), 16, "fewer than one sequence"),
        (write("odd.bin", &[1, 2, 3, 4, 5]), 1, "not a whole number"),
        (write("big.bin", &ids(&[1, 2, 300, 4])), 2, "past the vocabulary"),
    ];
    // On another thread: a FIFO opened for reading would block it.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for (p, seq, _) in cases {
            tx.send(load_tokens(&p, 97, seq).map(|_| ()).map_err(|e| e.to_string())).unwrap();
        }
    });
    for want in [
        "character device",
        "FIFO",
        "directory",
        "fewer than one sequence",
        "fewer than one sequence",
        "not a whole number",
        "past the vocabulary",
    ] {
        let got = rx.recv_timeout(std::time::Duration::from_secs(20)).expect("a load hung");
        let e = got.expect_err(want);
        assert!(e.starts_with("data ") && e.contains(want), "{want}: {e}");
    }
}

/// Issue 40, finding 1: every output a run writes is checked before its first step, and the
/// check changes nothing on disk.
#[test]
fn outputs_are_checked_before_the_first_step() {
    use strata::candle::train::{check_outputs, checkpoint_bytes, OutputPlan};
    let c = tiny(false);
    let t = train_config(None, Engine::Cpu, &[]);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let run = saved_run(&d.join("run"), &c, &t, 1, 1);
    let ck = Checkpoint::open(&run).unwrap();
    let file = d.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let full = d.join("full");
    std::fs::create_dir(&full).unwrap();
    std::fs::write(full.join("keep.txt"), b"mine").unwrap();
    let bytes = checkpoint_bytes(&c, &t, strata::DType::F32).unwrap();
    assert!(bytes > 4 * c.parameters(), "{bytes}");
    let plan = |f: &dyn Fn(&mut OutputPlan)| {
        let mut p = OutputPlan { checkpoint_bytes: bytes, ..OutputPlan::default() };
        f(&mut p);
        check_outputs(&p).map_err(|e| e.to_string())
    };
    type Case<'a> = (&'a str, Box<dyn Fn(&mut OutputPlan) + 'a>, Vec<String>);
    let refused: Vec<Case> = vec![
        (
            "--save on a file",
            Box::new(|p| p.save = Some(file.clone())),
            vec!["--save".into(), file.display().to_string(), "is a file".into()],
        ),
        (
            "--save into another run's directory",
            Box::new(|p| p.save = Some(d.join("run"))),
            vec!["run (step 1)".into(), "a new run".into(), "save elsewhere".into()],
        ),
        (
            "--save where nothing can be written",
            Box::new(|p| p.save = Some("/proc/strata-issue-40/run".into())),
            vec!["cannot be written".into(), "/proc".into()],
        ),
        (
            "--save on a file system without room",
            Box::new(|p| {
                p.save = Some(d.join("new"));
                p.checkpoint_bytes = u64::MAX / 2;
            }),
            vec!["one checkpoint needs about".into(), "free".into()],
        ),
        (
            "--export-merged on a file",
            Box::new(|p| p.export_merged = Some(file.clone())),
            vec!["--export-merged".into(), "is a file".into()],
        ),
        (
            "--export-merged into a directory holding files",
            Box::new(|p| p.export_merged = Some(full.clone())),
            vec!["--export-merged".into(), "not empty".into()],
        ),
        (
            "--write-inputs into a directory holding files",
            Box::new(|p| p.write_inputs = Some(full.clone())),
            vec!["--write-inputs".into(), "not empty".into()],
        ),
        (
            "--write-inputs under a file",
            Box::new(|p| p.write_inputs = Some(file.join("inputs"))),
            vec!["--write-inputs".into(), "is a file".into()],
        ),
    ];
    for (what, f, words) in &refused {
        let e = plan(f.as_ref()).expect_err(what);
        for w in words {
            assert!(e.contains(w.as_str()), "{what}: no {w:?} in {e}");
        }
    }
    // The run's own directory, when it is the run being resumed; new directories.
    plan(&|p| {
        p.save = Some(d.join("run"));
        p.resuming = Some(ck.run);
        p.export_merged = Some(d.join("merged"));
        p.write_inputs = Some(d.join("inputs"));
    })
    .unwrap();
    assert!(!d.join("merged").exists() && !d.join("inputs").exists());
    assert_eq!(std::fs::read_dir(d).unwrap().count(), 3, "the check made nothing");
}

/// Issue 40, finding 9: the settings a resume takes from the commit record (`seq`, the
/// schedule's length, the data's seed in the notes) cannot be edited unseen.
#[test]
fn an_edited_commit_record_is_refused() {
    let c = tiny(false);
    let t = train_config(None, Engine::Cpu, &[]);
    let dir = tempfile::tempdir().unwrap();
    let (mut tr, _) = trainer(&c, &t, 1);
    tr.set_notes([("data_seed".to_string(), "7".to_string())].into());
    tr.step(&batches(0, &c, &t)).unwrap();
    let ck = tr.save(dir.path()).unwrap();
    let record = ck.join("checkpoint.json");
    let text = std::fs::read_to_string(&record).unwrap();
    Checkpoint::open(&ck).unwrap();
    for (from, to) in [
        ("\"seq\": 16", "\"seq\": 8"),
        ("\"lr_total\": 5", "\"lr_total\": 50"),
        ("\"data_seed\": \"7\"", "\"data_seed\": \"8\""),
    ] {
        assert!(text.contains(from), "{from} in {text}");
        std::fs::write(&record, text.replace(from, to)).unwrap();
        let e = Checkpoint::open(&ck).unwrap_err();
        assert_eq!(bad_file(&e), record, "{from}: {e}");
        assert!(e.to_string().contains("edited or damaged"), "{e}");
    }
    std::fs::write(&record, &text).unwrap();
    Checkpoint::open(&ck).unwrap();
}

/// Issue 40, finding 10: the way to start a new run from a checkpoint names files that exist.
#[test]
fn the_hint_to_start_from_a_checkpoint_names_files_that_exist() {
    use strata::candle::lora::LoraConfig;
    let c = tiny(false);
    let mut t = train_config(None, Engine::Cpu, &[]);
    let dir = tempfile::tempdir().unwrap();
    let full = Checkpoint::open(saved_run(&dir.path().join("full"), &c, &t, 1, 1)).unwrap();
    t.lora = Some(LoraConfig::new(2, 4.0, &["q_proj"]));
    let lora = Checkpoint::open(saved_run(&dir.path().join("lora"), &c, &t, 1, 1)).unwrap();
    for ck in [full, lora] {
        let hint = ck.start_from();
        let paths: Vec<&str> = hint.split(' ').filter(|w| w.starts_with('/')).collect();
        assert!(!paths.is_empty(), "{hint}");
        for p in paths {
            assert!(Path::new(p).exists(), "{hint}: {p} does not exist");
        }
    }
}

/// Issue 40, finding 9: a config with fewer blocks than the weights file is refused, naming
/// both counts, and leaves the store as it was.
#[test]
fn a_config_with_fewer_blocks_than_the_file_is_refused() {
    use strata::candle::load_weights;
    let c = tiny(false);
    let t = train_config(None, Engine::Cpu, &[]);
    let dir = tempfile::tempdir().unwrap();
    let ck = saved_run(dir.path(), &c, &t, 1, 0);
    let mut fewer = c.clone();
    fewer.num_hidden_layers = 2;
    let s = store(&c);
    let index = ck.join("model.safetensors.index.json");
    let e = load_weights(&s, &fewer, &index).unwrap_err().to_string();
    assert!(
        e.contains("num_hidden_layers") && e.contains(" 3,") && e.contains("2 (the config"),
        "{e}"
    );
    assert!(s.ids().is_empty(), "the store holds what the refused load put");
    assert_eq!(load_weights(&s, &c, &index).unwrap().len(), c.tensors().len());
}
