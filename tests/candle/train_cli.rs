//! `strata finetune` as a user runs it, in child processes: flags and inputs refused with an
//! error (never a panic, an abort, a hang or an unbounded read), a run stopped and resumed, a
//! finished run left alone, a diverging run, Ctrl-C (SIGINT and SIGTERM) saving a checkpoint
//! that resumes to the uninterrupted run's losses, and the crash test: the trainer killed at
//! random moments of its saves and resumed each time, ending bit for bit where the
//! uninterrupted run ends. QLoRA over quantized GGUF bases the same way (killed during its steps
//! and saves, diverging), and the adapter it trains applied unmerged by `generate` and `chat`
//! over the quantized base, against the merged export.
//!
//! `cargo test --features text --test candle train_cli -- --nocapture` runs these (and prints
//! the crash test's figures); the sixty-kill crash test is `cargo test --features text --test
//! candle sixty_kills -- --ignored --nocapture`.

use std::collections::BTreeMap;
use std::io::BufRead;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use strata::candle::train::Checkpoint;

fn config() -> String {
    format!("{}/examples/configs/tiny-llama.json", env!("CARGO_MANIFEST_DIR"))
}

/// `strata finetune ARGS`.
fn child(args: &[String]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_strata"));
    c.arg("finetune").args(args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    c
}

/// How a run of `strata finetune` ended.
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs `strata finetune` with `args`; killed (and the test failed) past `deadline`.
fn run(args: &[String], deadline: Duration) -> Ran {
    let mut c = child(args).spawn().unwrap();
    let start = Instant::now();
    while c.try_wait().unwrap().is_none() {
        if start.elapsed() > deadline {
            let _ = c.kill();
            let out = c.wait_with_output().unwrap();
            panic!(
                "strata finetune {args:?} still ran after {deadline:?}:\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let out = c.wait_with_output().unwrap();
    Ran {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// A tiny run's flags: 4 blocks of hidden 64, `steps` steps of one sequence of 8 tokens.
fn tiny_run(steps: u64) -> Vec<String> {
    let mut v = strings(&["--config", &config(), "--seq", "8", "--micro-batch", "1"]);
    v.extend(strings(&["--accum", "1", "--steps", &steps.to_string()]));
    v
}

/// A tiny QLoRA run's flags: rank-4 adapters over `tests/fixtures/tiny-gpt2.gguf` (Q8_0, Q4_1
/// and Q4_0 weights kept quantized, 2 blocks of hidden 64), the synthetic token stream, `steps`
/// steps of one sequence of 8 tokens, the base streamed through a 64 KiB Device tier. The link
/// and host rates are given (not measured: a second a run).
fn qlora_run(steps: u64) -> Vec<String> {
    let gguf = format!("{}/tests/fixtures/tiny-gpt2.gguf", env!("CARGO_MANIFEST_DIR"));
    let mut v = strings(&["--model", &gguf, "--lora-rank", "4", "--seq", "8"]);
    v.extend(strings(&["--micro-batch", "1", "--accum", "1", "--device-budget", "64KiB"]));
    v.extend(strings(&["--pcie", "50", "--host-bandwidth", "20"]));
    v.extend(strings(&["--steps", &steps.to_string()]));
    v
}

/// `step N/M: loss X` lines: step -> the loss as printed.
fn losses(stdout: &str) -> BTreeMap<u64, String> {
    stdout
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("step ")?;
            let (n, rest) = rest.split_once('/')?;
            let loss = rest.split("loss ").nth(1)?.split_whitespace().next()?;
            Some((n.parse().ok()?, loss.to_string()))
        })
        .collect()
}

/// Every tensor of a checkpoint's safetensors files, by file kind and name: its dtype, shape
/// and bytes.
fn tensors(ck: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(ck).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            let bytes = std::fs::read(&p).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (name, t) in st.tensors() {
                out.insert(format!("{name} {:?} {:?}", t.dtype(), t.shape()), t.data().to_vec());
            }
        }
    }
    out
}

#[test]
fn flags_and_inputs_that_cannot_train_are_errors_not_panics_hangs_or_aborts() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let short = dir.path().join("short.bin");
    std::fs::write(&short, [1u32, 2, 3].iter().flat_map(|t| t.to_le_bytes()).collect::<Vec<u8>>())
        .unwrap();
    let save = dir.path().join("out");
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let fifo = fifo.display().to_string();
    let short = short.display().to_string();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--data", "/dev/zero"], "character device"),
        (vec!["--data", &fifo], "FIFO"),
        (vec!["--data", &short], "fewer than one sequence"),
        (vec!["--accum", "100000000"], "host memory"),
        (vec!["--micro-batch", "100000000"], "host memory"),
        (vec!["--accum", "18446744073709551615"], "overflow"),
        (vec!["--lr", "-1"], "learning rate -1"),
        (vec!["--lr", "nan"], "learning rate NaN"),
        (vec!["--lr", "0"], "learning rate 0"),
        (vec!["--weight-decay", "nan"], "weight decay NaN"),
        (vec!["--weight-decay", "-1"], "weight decay -1"),
        (vec!["--clip", "nan"], "'--clip <CLIP>'"),
        (vec!["--clip", "-1"], "'--clip <CLIP>'"),
        (vec!["--min-lr", "-1"], "minimum learning rate"),
        (vec!["--steps", "0"], "'--steps <STEPS>'"),
        (vec!["--save-every", "0"], "'--save-every <N>'"),
        (vec!["--keep", "0"], "'--keep <KEEP>'"),
        (vec!["--stop-after", "0"], "'--stop-after <K>'"),
        (vec!["--resume", empty.to_str().unwrap()], "no checkpoint"),
        (vec!["--resume", dir.path().to_str().unwrap()], "no commit record"),
    ];
    for (extra, want) in cases {
        let mut args = tiny_run(3);
        args.extend(strings(&["--save", save.to_str().unwrap()]));
        args.extend(strings(&extra));
        let r = run(&args, Duration::from_secs(60));
        // Flags clap refuses exit 2 (a usage error), the run's own checks 1.
        let usage = want.starts_with("'--");
        assert_eq!(
            r.code,
            Some(if usage { 2 } else { 1 }),
            "{extra:?}: {}\n{}",
            r.stdout,
            r.stderr
        );
        assert!(
            r.stderr.contains("error: ") && r.stderr.contains(want),
            "{extra:?}: wanted {want:?} in:\n{}",
            r.stderr
        );
        assert!(!r.stderr.contains("panicked"), "{extra:?}: {}", r.stderr);
        assert!(!save.exists(), "{extra:?}: something was saved");
    }
}

#[test]
fn a_run_stopped_and_resumed_ends_where_the_whole_run_ends_and_a_finished_one_is_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let (whole, part) = (dir.path().join("whole"), dir.path().join("part"));
    let mut args = tiny_run(5);
    args.extend(strings(&["--save", whole.to_str().unwrap()]));
    let w = run(&args, Duration::from_secs(120));
    assert_eq!(w.code, Some(0), "{}", w.stderr);
    let want = losses(&w.stdout);
    assert_eq!(want.len(), 5);

    let mut args = tiny_run(5);
    args.extend(strings(&["--save", part.to_str().unwrap(), "--save-every", "2"]));
    args.extend(strings(&["--stop-after", "3"]));
    let r = run(&args, Duration::from_secs(120));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stdout.contains("stopped after step 3 of 5"), "{}", r.stdout);
    let mut got = losses(&r.stdout);
    assert_eq!(Checkpoint::open(&part).unwrap().step, 3);
    // Another horizon is refused, saying so; the run's own goes on.
    let resume = strings(&["--resume", part.to_str().unwrap(), "--save", part.to_str().unwrap()]);
    let mut longer = resume.clone();
    longer.extend(strings(&["--steps", "9"]));
    let r = run(&longer, Duration::from_secs(120));
    assert_eq!(r.code, Some(1));
    assert!(r.stderr.contains("horizon"), "{}", r.stderr);
    let r = run(&resume, Duration::from_secs(120));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stdout.contains("resumed ") && r.stdout.contains(" at step 3"), "{}", r.stdout);
    got.extend(losses(&r.stdout));
    assert_eq!(got, want);
    let (a, b) = (Checkpoint::open(&whole).unwrap(), Checkpoint::open(&part).unwrap());
    assert_eq!((a.step, b.step), (5, 5));
    assert!(tensors(&a.path) == tensors(&b.path), "the resumed run ended elsewhere");

    // Resuming the finished run says so, exits 0, and touches nothing.
    let before: Vec<_> = std::fs::read_dir(&part)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| {
            (p.clone(), std::fs::metadata(p.join("checkpoint.json")).unwrap().modified().unwrap())
        })
        .collect();
    let r = run(&resume, Duration::from_secs(60));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stdout.contains("the run is finished (step 5 of 5)"), "{}", r.stdout);
    let after: Vec<_> = std::fs::read_dir(&part)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| {
            (p.clone(), std::fs::metadata(p.join("checkpoint.json")).unwrap().modified().unwrap())
        })
        .collect();
    assert_eq!(before, after);
}

#[test]
fn a_diverging_run_exits_non_zero_without_a_non_finite_checkpoint() {
    diverging(tiny_run, "1e30");
}

/// QLoRA over a quantized GGUF base diverging: handled as over a safetensors base. (At 1e30
/// the adapters' first step sends the activations to infinity, which the final RMSNorm turns
/// into zeros: a uniform prediction, a finite loss and no gradient. At 1e38 the infinities
/// meet and make a NaN.)
#[test]
fn a_diverging_qlora_run_exits_non_zero_without_a_non_finite_checkpoint() {
    diverging(qlora_run, "1e38");
}

/// A run of `run_args` at learning rate `lr`: it exits 1 saying it diverged, what it saved is
/// whole and finite; with `--skip-nonfinite` it goes on, counting the steps it skipped.
fn diverging(run_args: fn(u64) -> Vec<String>, lr: &str) {
    let dir = tempfile::tempdir().unwrap();
    let save = dir.path().join("out");
    let mut args = run_args(4);
    args.extend(strings(&["--lr", lr, "--save", save.to_str().unwrap(), "--save-every", "1"]));
    let r = run(&args, Duration::from_secs(120));
    assert_eq!(r.code, Some(1), "{}\n{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("not finite")
            || r.stderr.contains(" is NaN")
            || r.stderr.contains(" is inf"),
        "{}",
        r.stderr
    );
    assert!(r.stderr.contains("the run diverged"), "{}", r.stderr);
    // What was saved is whole and finite.
    if let Some(ck) = Checkpoint::newest(&save).unwrap() {
        Checkpoint::open(&ck).unwrap();
        for (name, bytes) in tensors(&ck) {
            assert!(
                bytes
                    .chunks_exact(4)
                    .all(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]).is_finite()),
                "{name} is not finite in {}",
                ck.display()
            );
        }
    }
    // With --skip-nonfinite the run goes on, counting what it skipped.
    let mut args = run_args(4);
    args.extend(strings(&["--lr", lr, "--skip-nonfinite"]));
    let r = run(&args, Duration::from_secs(120));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stdout.contains("(skipped: not finite)"), "{}", r.stdout);
}

/// The crash test: `kills` times, the trainer (`--save-every 1`, the run's flags `run_args(steps)`)
/// is killed with SIGKILL at a random moment of a save (after a random step's line, a random
/// fraction of a save's time later; with `in_steps`, of a save's and the next step's time, so
/// that some kills land in a step), then resumed from its run directory. After each kill the newest checkpoint must
/// verify whole and be the last one the killed run said it saved, or the one after (saved, not
/// yet said); every step's loss, in every run, must be the uninterrupted run's; a run must end
/// by the kill or with status 0 (a resume refused with an error would end with 1: none is
/// expected here); and the run, once finished, must hold the uninterrupted run's tensors bit for
/// bit. A finished run starts again from scratch until there were `kills` kills.
fn crash_test(kills: usize, steps: u64, run_args: fn(u64) -> Vec<String>, in_steps: bool) {
    let dir = tempfile::tempdir().unwrap();
    let whole = dir.path().join("whole");
    let mut args = run_args(steps);
    args.extend(strings(&["--save", whole.to_str().unwrap(), "--save-every", "1"]));
    // The uninterrupted run, timed: how long a save takes (a step's line to its save's), and a
    // step (a save's line to the next step's).
    let mut c = child(&args).spawn().unwrap();
    let lines = lines_of(&mut c);
    let (mut step_at, mut save_time) = (None, Vec::new());
    let (mut saved_at, mut step_time) = (None, Vec::new());
    let mut stdout = String::new();
    while let Ok((at, line)) = lines.recv() {
        if line.starts_with("step ") {
            step_at = Some(at);
            if let Some(s) = saved_at.take() {
                step_time.push(at - s);
            }
        } else if line.starts_with("saved ") {
            save_time.push(at - step_at.take().expect("a save after a step"));
            saved_at = Some(at);
        }
        stdout.push_str(&line);
        stdout.push('\n');
    }
    assert!(c.wait().unwrap().success(), "{stdout}");
    let want = losses(&stdout);
    assert_eq!(want.len() as u64, steps);
    let save_time = save_time.iter().max().copied().unwrap();
    let window = match in_steps {
        true => save_time + step_time.iter().max().copied().unwrap_or_default(),
        false => save_time,
    };
    let want_tensors = tensors(&Checkpoint::newest(&whole).unwrap().unwrap());

    let mut rng = strata::candle::llama::SeededRng::new(31);
    let (mut killed, mut finished, mut attempt) = (0, 0, 0);
    let mut run_dir = dir.path().join("run-0");
    let mut resumed_at = Vec::new();
    while killed < kills {
        attempt += 1;
        assert!(attempt < kills * 4 + 20, "{killed} kills in {attempt} runs");
        let newest = Checkpoint::newest(&run_dir).unwrap();
        let at = newest.as_ref().map_or(0, |p| Checkpoint::open(p).unwrap().step);
        let mut args = run_args(steps);
        args.extend(strings(&["--save", run_dir.to_str().unwrap(), "--save-every", "1"]));
        if newest.is_some() {
            args.extend(strings(&["--resume", run_dir.to_str().unwrap()]));
        }
        let mut c = child(&args).spawn().unwrap();
        let lines = lines_of(&mut c);
        // Kill after the k-th step line of this run, a fraction of a save's time later.
        let k = 1 + rng.below(steps - at);
        let (mut seen, mut out, mut kill_at) = (0, String::new(), None);
        let mut was_killed = false;
        loop {
            let wait = kill_at.map_or(Duration::from_secs(120), |t: Instant| {
                t.saturating_duration_since(Instant::now())
            });
            match lines.recv_timeout(wait) {
                Ok((_, line)) => {
                    if line.starts_with("step ") {
                        seen += 1;
                        if seen == k {
                            // Mostly inside the save (or the next step), sometimes after.
                            let frac = rng.below(1250) as f64 / 1000.0;
                            kill_at = Some(Instant::now() + window.mul_f64(frac));
                        }
                    }
                    out.push_str(&line);
                    out.push('\n');
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    assert!(kill_at.is_some(), "a run hung:\n{out}");
                    was_killed = c.try_wait().unwrap().is_none();
                    let _ = c.kill();
                    break;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        let status = c.wait().unwrap();
        let mut stderr = String::new();
        if let Some(mut e) = c.stderr.take() {
            let _ = std::io::Read::read_to_string(&mut e, &mut stderr);
        }
        if !was_killed {
            assert!(status.success(), "a run failed ({status}):\n{out}\n{stderr}");
        } else {
            killed += 1;
        }
        // Every loss printed is the uninterrupted run's.
        for (step, loss) in losses(&out) {
            assert_eq!(want.get(&step), Some(&loss), "step {step}:\n{out}");
        }
        if let Some(line) = out.lines().find(|l| l.starts_with("resumed ")) {
            let from: u64 = line.rsplit(' ').next().unwrap().parse().unwrap();
            assert!(newest.is_some() && from == at, "resumed at {from}, the newest was {at}");
            resumed_at.push(from);
        }
        // The newest checkpoint is whole: the last one said saved, or the next.
        let said = out
            .lines()
            .filter_map(|l| {
                l.strip_prefix("saved ")?
                    .rsplit_once("(step ")?
                    .1
                    .strip_suffix(')')?
                    .parse::<u64>()
                    .ok()
            })
            .max();
        if let Some(p) = Checkpoint::newest(&run_dir).unwrap() {
            let ck = Checkpoint::open(&p).unwrap_or_else(|e| panic!("after a kill: {e}"));
            if let Some(said) = said {
                assert!(ck.step == said || ck.step == said + 1, "newest {}, said {said}", ck.step);
            }
        } else {
            assert!(said.is_none(), "a save said done is gone");
        }
        let done = Checkpoint::newest(&run_dir)
            .unwrap()
            .is_some_and(|p| Checkpoint::open(&p).unwrap().finished());
        if done {
            let last = Checkpoint::newest(&run_dir).unwrap().unwrap();
            assert!(tensors(&last) == want_tensors, "a resumed run ended elsewhere");
            finished += 1;
            run_dir = dir.path().join(format!("run-{finished}"));
        }
    }
    println!(
        "crash test: {killed} kills in {attempt} runs ({} resumes, from steps {:?}); {finished} runs \
         finished, each equal to the uninterrupted run bit for bit",
        resumed_at.len(),
        resumed_at
    );
}

/// The child's stdout, line by line with the time each came, on a channel that closes at its
/// end.
fn lines_of(c: &mut std::process::Child) -> mpsc::Receiver<(Instant, String)> {
    let out = c.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send((Instant::now(), line)).is_err() {
                break;
            }
        }
    });
    rx
}

/// Ten kills of a six-step run (16 s alone on the 2-core VM, the tests' strata built at
/// opt-level 0; twenty took 38 s). `sixty_kills_during_saves_resume_from_whole_checkpoints` (ignored,
/// below) runs more.
#[test]
fn a_run_killed_during_its_saves_resumes_from_a_whole_checkpoint() {
    crash_test(10, 6, tiny_run, false);
}

/// QLoRA over a quantized GGUF base killed during its steps and its saves (a LoRA checkpoint:
/// the adapters and their moments, the base named by its path and crc32), resumed each time.
#[test]
fn a_qlora_run_killed_during_its_steps_and_saves_resumes_from_a_whole_checkpoint() {
    crash_test(8, 4, qlora_run, true);
}

/// [`tiny_run`] without clipping: every step's updates start during the backward
/// (speculatively, issue 41) and stand.
fn speculating_run(steps: u64) -> Vec<String> {
    let mut v = tiny_run(steps);
    v.extend(strings(&["--clip", "0"]));
    v
}

/// A run whose every step updates speculatively during its backward (its state backed up),
/// killed during its steps and its saves: each resume starts from a whole checkpoint, never
/// from a mix of a step's speculative updates, and the run ends as the uninterrupted one. (The
/// backups live in the store's memory tiers only, and a save ends a step's updates first.)
#[test]
#[ignore = "a minute or more: cargo test --features candle --test candle speculating_run_killed -- --ignored --nocapture"]
fn a_speculating_run_killed_during_its_steps_and_saves_resumes_from_a_whole_checkpoint() {
    let r = run(&speculating_run(2), Duration::from_secs(60));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    // Each step line says its stages updated in the backward, none undone.
    let steps: Vec<&str> = r.stdout.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(steps.len(), 2, "{}", r.stdout);
    assert!(steps.iter().all(|l| l.contains("stages updated in the backward)")), "{}", r.stdout);
    crash_test(10, 6, speculating_run, true);
}

/// Sixty kills (12 to 25 s on two cores, with the load).
#[test]
#[ignore = "up to half a minute: cargo test --features candle --test candle sixty_kills -- --ignored --nocapture"]
fn sixty_kills_during_saves_resume_from_whole_checkpoints() {
    crash_test(60, 6, tiny_run, false);
}

/// The memory plan for Llama 2 7B on the lent H100, printed without running (nothing is
/// allocated: this machine has neither the memory nor the device): every byte in memory, the
/// checkpoints past the Pinned tier on the device, and the floor bound by compute; a host too
/// small for the weights and gradients is refused, saying so; a Pinned tier of 100 GiB (the
/// plan the lease once gave) sends optimizer state to disk, and the plan says how much.
/// `strata finetune`'s flags for Llama 2 7B's memory plan on a preset machine (bf16, seq 2048,
/// micro-batch 1, accum 32, `--plan-only`).
fn plan_7b(machine: &str) -> Vec<String> {
    let c = format!("{}/examples/configs/llama2-7b.json", env!("CARGO_MANIFEST_DIR"));
    let flags = ["--dtype", "bf16", "--seq", "2048", "--micro-batch", "1", "--accum", "32"];
    let mut args = strings(&["--config", &c]);
    args.extend(strings(&flags));
    args.extend(strings(&["--plan-only", "--machine", machine]));
    args
}

#[test]
fn the_plan_for_7b_on_the_h100_fits_and_one_that_cannot_is_refused() {
    let base = plan_7b("h100");
    let r = run(&base, Duration::from_secs(60));
    assert_eq!(r.code, Some(0), "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("disk: nothing (everything fits in memory)"), "{}", r.stdout);
    assert!(r.stdout.contains("bound by compute"), "{}", r.stdout);
    let row = |name: &str| {
        r.stdout
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name}"))
            .to_string()
    };
    // The checkpoints (16 GiB) do not all fit beside the state in pinned memory: the rest live
    // on the device. A row: the group, then (value, unit) for device, pinned, mapped, disk.
    let ck: Vec<String> = row("activation").split_whitespace().map(str::to_string).collect();
    assert!(ck[1] != "0" && ck[3] != "0" && ck[7] == "0", "{}", r.stdout);

    let mut small = base.clone();
    small.extend(strings(&["--host-memory", "32GiB"]));
    let r = run(&small, Duration::from_secs(60));
    assert_eq!(r.code, Some(1), "{}", r.stdout);
    assert!(r.stderr.contains("do not fit the Pinned tier"), "{}", r.stderr);

    // LoRA over the same base: only the adapters' gradients and state, so the host that could
    // not hold a full fine-tune holds it.
    let mut lora = small.clone();
    lora.extend(strings(&["--lora-rank", "16"]));
    let r = run(&lora, Duration::from_secs(60));
    assert_eq!(r.code, Some(0), "{}{}", r.stdout, r.stderr);
    assert!(r.stdout.contains("disk: nothing"), "{}", r.stdout);

    let mut pinned = base;
    pinned.extend(strings(&["--pinned-budget", "100GiB"]));
    let r = run(&pinned, Duration::from_secs(60));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert!(r.stdout.contains("disk: ") && !r.stdout.contains("disk: nothing"), "{}", r.stdout);
}

/// The same plan on the H200 preset: printed for the H200 by name with its 141 GB of HBM, every
/// byte in memory, its floor's figures named as the preset's; an unknown preset is refused by
/// the flag's parser, naming the presets.
#[test]
fn the_plan_for_7b_on_the_h200_names_the_machine_and_its_memory() {
    let mut args = plan_7b("h200");
    let r = run(&args, Duration::from_secs(60));
    assert_eq!(r.code, Some(0), "{}{}", r.stdout, r.stderr);
    let first = r.stdout.lines().find(|l| l.starts_with("memory plan on")).unwrap_or_default();
    assert!(first.contains("the H200 preset (141 GB HBM"), "{}", r.stdout);
    assert!(r.stdout.contains("disk: nothing (everything fits in memory)"), "{}", r.stdout);
    let floor = r.stdout.lines().find(|l| l.starts_with("plan's floor")).unwrap_or_default();
    assert!(floor.contains("PCIe at 54.3/55.0 GB/s") && floor.contains("on the H200 preset"));
    // The honest floor: the CPU AdamW (about 4 s at 50 GB/s) hides behind the next forward
    // only (a quarter of the 7.0 s of compute at 400 TFLOPS), so about 2.3 s adds to it: not
    // `max(compute, optimizer)`, which said 7.0 s.
    let ms = |after: &str| -> f64 {
        let rest =
            &floor[floor.find(after).unwrap_or_else(|| panic!("{after}: {floor}")) + after.len()..];
        rest.split(" ms").next().unwrap().trim().parse().unwrap()
    };
    let (total, compute, exposed) = (ms("plan's floor"), ms("(compute"), ms("of which"));
    assert!((6900.0..7100.0).contains(&compute), "{floor}");
    assert!((2100.0..2500.0).contains(&exposed), "{floor}");
    assert!((total - compute - exposed).abs() < 0.2, "{floor}");
    assert!(floor.contains("bound by compute and the CPU optimizer's exposed part"), "{floor}");
    // Model FLOPs both ways, each labelled.
    assert!(
        r.stdout.contains("2.650e15 as 6 × parameters × tokens, MegaTrain's count"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("2.809e15 model FLOP with attention"), "{}", r.stdout);
    args.pop();
    args.push("a100".into());
    let r = run(&args, Duration::from_secs(60));
    assert_eq!(r.code, Some(2), "{}", r.stderr);
    assert!(r.stderr.contains("[possible values: h100, h200]"), "{}", r.stderr);
}

/// A LoRA run stopped and resumed (its base found again from the run's notes:
/// the seed) ends where the whole run ends, adapters and their state bit for bit; its
/// checkpoints are PEFT adapter directories; LoRA flags that disagree with the run, or come
/// without a rank, are refused.
#[test]
fn a_lora_run_stopped_and_resumed_ends_where_the_whole_run_ends() {
    let dir = tempfile::tempdir().unwrap();
    let (whole, part, merged) =
        (dir.path().join("whole"), dir.path().join("part"), dir.path().join("merged"));
    let mut lora = tiny_run(4);
    lora.extend(strings(&["--lora-rank", "4", "--lora-targets", "q_proj,o_proj,down_proj"]));
    let mut args = lora.clone();
    args.extend(strings(&["--save", whole.to_str().unwrap(), "--export-merged"]));
    args.push(merged.to_str().unwrap().to_string());
    let w = run(&args, Duration::from_secs(120));
    assert_eq!(w.code, Some(0), "{}", w.stderr);
    assert!(w.stdout.contains("LoRA: rank 4, alpha 8 (scale 2)"), "{}", w.stdout);
    assert!(merged.join("model.safetensors.index.json").is_file());
    let want = losses(&w.stdout);
    assert_eq!(want.len(), 4, "{}", w.stdout);
    let mut args = lora.clone();
    args.extend(strings(&["--save", part.to_str().unwrap(), "--stop-after", "2"]));
    let r = run(&args, Duration::from_secs(120));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let mut got = losses(&r.stdout);
    let resume = strings(&["--resume", part.to_str().unwrap(), "--save", part.to_str().unwrap()]);
    let mut other = resume.clone();
    other.extend(strings(&["--lora-rank", "8"]));
    let r = run(&other, Duration::from_secs(60));
    assert_eq!(r.code, Some(1));
    assert!(r.stderr.contains("--lora-rank 8: the run's rank is 4"), "{}", r.stderr);
    let r = run(&resume, Duration::from_secs(120));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    got.extend(losses(&r.stdout));
    assert_eq!(got, want);
    let (a, b) = (Checkpoint::open(&whole).unwrap(), Checkpoint::open(&part).unwrap());
    assert!(a.path.join("adapter_config.json").is_file() && a.base_crc32.is_some());
    assert!(tensors(&a.path) == tensors(&b.path), "the resumed run ended elsewhere");

    let mut alone = tiny_run(2);
    alone.extend(strings(&["--lora-alpha", "16"]));
    let r = run(&alone, Duration::from_secs(60));
    assert_eq!(r.code, Some(1));
    assert!(r.stderr.contains("go with --lora-rank R"), "{}", r.stderr);
}

/// Ctrl-C (SIGINT) and SIGTERM: the step in flight finishes, a checkpoint is saved, the process
/// exits 130; `--resume` from that checkpoint ends with the uninterrupted run's losses.
#[test]
fn an_interrupted_run_saves_a_checkpoint_that_resumes_to_the_whole_runs_losses() {
    // Long enough that the signal lands mid-run.
    let steps = 30;
    let whole = run(&tiny_run(steps), Duration::from_secs(120));
    assert_eq!(whole.code, Some(0), "{}", whole.stderr);
    let want = losses(&whole.stdout);
    for signal in ["INT", "TERM"] {
        let dir = tempfile::tempdir().unwrap();
        let save = dir.path().join("ck");
        let mut args = tiny_run(steps);
        args.extend(strings(&["--save", save.to_str().unwrap()]));
        let mut c = child(&args).spawn().unwrap();
        let lines = lines_of(&mut c);
        let mut stdout = String::new();
        let mut sent = false;
        while let Ok((_, line)) = lines.recv() {
            if line.starts_with("step 2/") && !sent {
                let pid = c.id().to_string();
                assert!(Command::new("kill")
                    .args([&format!("-{signal}"), &pid])
                    .status()
                    .unwrap()
                    .success());
                sent = true;
            }
            stdout.push_str(&line);
            stdout.push('\n');
        }
        let status = c.wait().unwrap();
        assert_eq!(status.code(), Some(130), "SIG{signal}: {stdout}");
        assert!(stdout.contains("interrupted after step"), "SIG{signal}: {stdout}");
        let ck = Checkpoint::newest(&save).unwrap().expect("a checkpoint was saved");
        let at = Checkpoint::open(&ck).unwrap().step;
        assert!((2..steps).contains(&at), "SIG{signal}: saved at step {at}");
        let mut got = losses(&stdout);
        let r = run(
            &strings(&["--resume", ck.to_str().unwrap(), "--save", save.to_str().unwrap()]),
            Duration::from_secs(120),
        );
        assert_eq!(r.code, Some(0), "{}", r.stderr);
        got.extend(losses(&r.stdout));
        assert_eq!(got, want, "SIG{signal}: the interrupted and resumed run's losses");
    }
}

/// Issue 40's front-end findings through the binary: every output and input checked before the
/// first step (a bad target never costs the run), and arguments the OS allows but UTF-8 does
/// not refused by name, never a panic.
#[test]
fn outputs_and_inputs_are_refused_before_the_first_step() {
    use std::os::unix::ffi::OsStrExt;
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    std::fs::write(p("a-file"), "x").unwrap();
    std::fs::create_dir(p("full")).unwrap();
    std::fs::write(p("full/keep.txt"), "mine").unwrap();
    // A tokenizer for the tiny model's 256 ids would not do (the byte tokenizer has 260): a
    // config of 260.
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(config()).unwrap()).unwrap();
    cfg["vocab_size"] = 260.into();
    std::fs::write(p("config.json"), cfg.to_string()).unwrap();
    std::fs::write(p("tokenizer.json"), super::text::byte_tokenizer_json()).unwrap();
    let fifo = p("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    // Another run's checkpoints in a directory.
    let other = p("other");
    let mut args = tiny_run(1);
    args.extend(strings(&["--save", &other]));
    assert_eq!(run(&args, Duration::from_secs(60)).code, Some(0));
    let text = |extra: &[&str]| {
        let mut v = strings(&["--config", &p("config.json"), "--tokenizer", &p("tokenizer.json")]);
        v.extend(strings(&["--seq", "8", "--micro-batch", "1", "--accum", "1", "--steps", "2"]));
        v.extend(strings(extra));
        v
    };
    // A JSONL file whose second line is not JSON: the error names the file and the line, the
    // reason on the same line.
    std::fs::write(p("bad.jsonl"), "{\"text\": \"hello there\"}\nnope\n").unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (text(&["--jsonl", &p("bad.jsonl")]), "bad.jsonl:2: not a JSON object"),
        ([tiny_run(2), strings(&["--save", &p("a-file")])].concat(), "a-file"),
        ([tiny_run(2), strings(&["--save", &other])].concat(), "one run's checkpoints"),
        (
            [tiny_run(2), strings(&["--lora-rank", "2", "--export-merged", &p("full")])].concat(),
            "not empty",
        ),
        (
            [tiny_run(2), strings(&["--lora-rank", "2", "--export-merged", &p("a-file")])].concat(),
            "a-file",
        ),
        (text(&["--text", "/dev/zero"]), "/dev/zero"),
        (text(&["--jsonl", &fifo]), "fifo"),
        ([tiny_run(2), strings(&["--lora-rank", "72057594037927936"])].concat(), "--lora-rank"),
    ];
    for (args, want) in cases {
        let r = run(&args, Duration::from_secs(60));
        assert_ne!(r.code, Some(0), "{args:?}: {}", r.stdout);
        assert!(r.stderr.contains(want), "{args:?}: wanted {want:?} in {}", r.stderr);
        assert!(!r.stderr.contains("panicked"), "{args:?}: {}", r.stderr);
        assert!(!r.stdout.lines().any(|l| l.starts_with("step ")), "{args:?}: a step ran");
    }
    assert_eq!(std::fs::read_to_string(p("full/keep.txt")).unwrap(), "mine");
    // Not UTF-8: a path is taken as it is (and not found), text is refused by name.
    let bad = std::ffi::OsStr::from_bytes(b"/tmp/\xffno-such-model");
    for (cmd, extra) in [("finetune", &[][..]), ("generate", &["--prompt-tokens", "1"][..])] {
        let out = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args([cmd, "--model"])
            .arg(bad)
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{cmd}: {err}");
        assert!(err.contains("no such file"), "{cmd}: {err}");
    }
    // --resident takes a count or `auto`; past the model's blocks it is refused.
    for (k, code) in [("auto", 0), ("2", 0), ("99", 1)] {
        let out = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["generate", "--config", &config(), "--init", "random", "--prompt-tokens"])
            .args(["1,2", "--max-new", "2", "--resident", k, "--stop-tokens", "none"])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "--resident {k}: {err}");
        assert!(!err.contains("panicked"), "--resident {k}: {err}");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["generate", "--config", &config(), "--init", "random", "--prompt"])
        .arg(std::ffi::OsStr::from_bytes(b"\xff"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("UTF-8") && !err.contains("panicked"), "{err}");
}

/// A model whose vocabulary is padded past its tokenizer's (as Qwen2's is) generates text: the
/// ids the tokenizer lacks have no text, and the generation is not thrown away at the end.
#[test]
fn ids_past_the_tokenizers_vocabulary_have_no_text() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(config()).unwrap()).unwrap();
    cfg["vocab_size"] = 400.into();
    std::fs::write(p("config.json"), cfg.to_string()).unwrap();
    std::fs::write(p("tokenizer.json"), super::text::byte_tokenizer_json()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["generate", "--config", &p("config.json"), "--init", "random", "--tokenizer"])
        .args([&p("tokenizer.json"), "--prompt", "hello", "--max-new", "40"])
        .output()
        .unwrap();
    let (stdout, stderr) =
        (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    let last = stdout.lines().last().unwrap();
    let ids: Vec<u32> = last.split(',').map(|t| t.parse().unwrap()).collect();
    assert_eq!(ids.len(), 40, "{stdout}");
    assert!(ids.iter().any(|&t| t >= 260), "no id past the tokenizer's 260 to test: {ids:?}");
}

/// QLoRA over a quantized GGUF base (`tests/fixtures/tiny-gpt2.gguf`: Q8_0, Q4_1 and Q4_0
/// weights, its tokenizer and chat template in its metadata, no --config, no --tokenizer): the
/// base comes quantized through the Device tier, the loss on the first batch goes down,
/// a run stopped and resumed ends with the whole run's losses, and the merged export is a
/// Hugging Face directory (f32 weights, config, the GGUF's tokenizer and chat template as
/// files) that `strata generate --chat` runs.
#[test]
fn qlora_over_a_gguf_base_trains_resumes_and_exports_a_dequantized_merged_model() {
    let gguf = format!("{}/tests/fixtures/tiny-gpt2.gguf", env!("CARGO_MANIFEST_DIR"));
    let data = format!("{}/examples/data/strata-faq.jsonl", env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    let (whole, part, merged) =
        (dir.path().join("whole"), dir.path().join("part"), dir.path().join("merged"));
    let mut lora = strings(&["--model", &gguf, "--jsonl", &data, "--lora-rank", "4"]);
    lora.extend(strings(&["--seq", "16", "--micro-batch", "1", "--accum", "2", "--steps", "6"]));
    lora.extend(strings(&["--lr", "2e-2", "--device-budget", "64KiB"]));
    // The link and host rates given, not measured (a second a run).
    lora.extend(strings(&["--pcie", "50", "--host-bandwidth", "20"]));
    let mut args = lora.clone();
    args.extend(strings(&["--save", whole.to_str().unwrap(), "--export-merged"]));
    args.push(merged.to_str().unwrap().to_string());
    let w = run(&args, Duration::from_secs(300));
    assert_eq!(w.code, Some(0), "{}", w.stderr);
    let want = losses(&w.stdout);
    assert_eq!(want.len(), 6, "{}", w.stdout);
    // The first batch through the trained model: "loss A (it was B at step 1".
    let line = w.stdout.lines().find(|l| l.contains("the first step's batch")).unwrap();
    let nums: Vec<f64> = line
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter_map(|s| s.parse().ok())
        .collect();
    assert!(nums[0] < nums[1] - 0.05, "the loss did not go down: {line}");
    // The quantized base came through the Device tier.
    assert!(w.stdout.contains("moved [pinned->device"), "{}", w.stdout);

    let mut args = lora.clone();
    args.extend(strings(&["--save", part.to_str().unwrap(), "--stop-after", "3"]));
    let r = run(&args, Duration::from_secs(300));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let mut got = losses(&r.stdout);
    // Resumed without --model, --tokenizer or --config: the checkpoint names its GGUF base.
    let resume = strings(&["--resume", part.to_str().unwrap(), "--save", part.to_str().unwrap()]);
    let mut resume = resume;
    resume.extend(strings(&["--jsonl", &data]));
    let r = run(&resume, Duration::from_secs(300));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    got.extend(losses(&r.stdout));
    assert_eq!(got, want);

    for f in ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        assert!(merged.join(f).is_file(), "{f}");
    }
    let mut st = 0;
    for e in std::fs::read_dir(&merged).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            let bytes = std::fs::read(&p).unwrap();
            let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (name, t) in file.tensors() {
                assert_eq!(t.dtype(), safetensors::Dtype::F32, "{name}");
                st += 1;
            }
        }
    }
    assert_eq!(st, 2 + 2 * 9, "the embedding, the final norm and 2 blocks of 9 tensors");
    // The merged model and the GGUF base chat, each with its own tokenizer and template; the
    // base with the run's adapter applied unmerged (`--adapter`, a checkpoint of the run: a PEFT
    // adapter directory) says what the merged model says.
    let adapter = Checkpoint::newest(&whole).unwrap().unwrap();
    let adapter = adapter.to_str().unwrap();
    let mut said = Vec::new();
    for (model, extra) in [
        (merged.to_str().unwrap(), &[][..]),
        (gguf.as_str(), &[][..]),
        (gguf.as_str(), &["--adapter", adapter][..]),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["generate", "--model", model, "--chat", "--prompt", "What is strata?"])
            .args(["--max-new", "6", "--device-budget", "64KiB"])
            .args(extra)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let (o, e) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{model} {extra:?}: {e}");
        assert!(o.contains("stops at [2]"), "{model}: {o}");
        if !extra.is_empty() {
            assert!(o.contains("applied the LoRA adapter") && o.contains("unmerged"), "{o}");
        }
        said.push(o.lines().last().unwrap_or_default().to_string());
    }
    assert_eq!(said[2], said[0], "the adapter unmerged and the merged export");
    // `strata chat` (and `serve`, which loads the model as chat does) takes it too.
    let mut answers = Vec::new();
    for (model, extra) in
        [(merged.to_str().unwrap(), &[][..]), (gguf.as_str(), &["--adapter", adapter][..])]
    {
        let mut c = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["chat", "--model", model, "--max-new", "6", "--device-budget", "64KiB"])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        c.stdin.take().unwrap().write_all(b"What is strata?\n").unwrap();
        let out = c.wait_with_output().unwrap();
        let (o, e) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "chat {model} {extra:?}: {e}");
        if !extra.is_empty() {
            assert!(e.contains("applied the LoRA adapter"), "{e}");
        }
        answers.push(o.into_owned());
    }
    assert_eq!(answers[0], answers[1], "chat: the adapter unmerged and the merged export");
}

/// QLoRA over a GGUF file whose tensors are of several types (`tests/fixtures/mixed.gguf`: an
/// F16 embedding table tied to the output, Q4_K, Q6_K and Q8_0 blocks, F32 norms and a BF16
/// one; the f16 and bf16 weights widened to f32 for the trainer, the quantized ones kept
/// quantized): it trains, its merged export (`--export-dtype f32`) is f32 with a `config.json`
/// saying so, and `strata generate --adapter` over the quantized base (the adapter unmerged)
/// gives the export's greedy tokens, which are not the base's; the base alone gives the
/// file's reference tokens.
#[test]
fn qlora_over_a_gguf_of_mixed_types_and_its_adapter_unmerged_generate_as_the_merged_export() {
    let gguf = format!("{}/tests/fixtures/mixed.gguf", env!("CARGO_MANIFEST_DIR"));
    let dir = tempfile::tempdir().unwrap();
    let (ck, merged) = (dir.path().join("ck"), dir.path().join("merged"));
    let mut args = strings(&["--model", &gguf, "--lora-rank", "4", "--seq", "8", "--accum", "1"]);
    args.extend(strings(&["--lora-targets", "q_proj,v_proj,down_proj", "--micro-batch", "1"]));
    args.extend(strings(&["--steps", "3", "--lr", "5e-2", "--device-budget", "256KiB"]));
    args.extend(strings(&["--pcie", "50", "--host-bandwidth", "20"]));
    args.extend(strings(&["--save", ck.to_str().unwrap(), "--export-merged"]));
    args.extend(strings(&[merged.to_str().unwrap(), "--export-dtype", "f32"]));
    let r = run(&args, Duration::from_secs(300));
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    assert_eq!(losses(&r.stdout).len(), 3, "{}", r.stdout);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(merged.join("config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["torch_dtype"], "float32");
    for (name, bytes) in tensors(&merged) {
        assert!(name.contains(" F32 "), "{name}");
        assert!(!bytes.is_empty());
    }
    let adapter = Checkpoint::newest(&ck).unwrap().unwrap();
    let generate = |model: &str, extra: &[&str]| -> String {
        let out = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["generate", "--model", model, "--prompt-tokens", "1,5,9", "--max-new", "8"])
            .args(["--stop-tokens", "none", "--device-budget", "256KiB"])
            .args(extra)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let (o, e) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{model} {extra:?}: {e}");
        if !extra.is_empty() {
            assert!(o.contains("unmerged over 6 linears of a quantized base"), "{o}");
        }
        o.lines().last().unwrap_or_default().to_string()
    };
    let base = generate(&gguf, &[]);
    // The file's reference tokens for this prompt (`test.greedy.0`, gen_mixed.py).
    assert_eq!(base, "28,13,24,55,55,55,55,55");
    let unmerged = generate(&gguf, &["--adapter", adapter.to_str().unwrap()]);
    let exported = generate(merged.to_str().unwrap(), &[]);
    assert_eq!(unmerged, exported, "the adapter unmerged and the merged export");
    assert_ne!(unmerged, base, "the adapter changed nothing");
}

/// The resident twin (`--in-memory`) over a quantized GGUF base: its weights dequantized once,
/// LoRA trains over them, and its losses are the out-of-core trainer's to float32 rounding
/// (the twin computes without recompute), bit for bit with `--recompute`; training the quantized weights themselves is refused,
/// naming one.
#[test]
fn the_resident_twin_trains_lora_over_a_quantized_base_and_refuses_to_train_it() {
    let out = run(&qlora_run(2), Duration::from_secs(120));
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let mut args = qlora_run(2);
    args.push("--in-memory".into());
    let twin = run(&args, Duration::from_secs(120));
    assert_eq!(twin.code, Some(0), "{}", twin.stderr);
    let (a, b) = (losses(&out.stdout), losses(&twin.stdout));
    assert_eq!(a.len(), 2);
    for (step, loss) in &a {
        let (x, y): (f64, f64) = (loss.parse().unwrap(), b[step].parse().unwrap());
        assert!((x - y).abs() <= 1e-4 * x.abs(), "step {step}: {x} out of core, {y} in memory");
    }
    // The twin that recomputes as out of core does: the same losses, to the last digit.
    args.push("--recompute".into());
    let again = run(&args, Duration::from_secs(120));
    assert_eq!(again.code, Some(0), "{}", again.stderr);
    assert!(again.stdout.contains("each block recomputed from its input"), "{}", again.stdout);
    assert_eq!(losses(&again.stdout), a, "--in-memory --recompute against out of core");
    // Out of core always recomputes: the flag alone is refused.
    let mut alone = qlora_run(1);
    alone.push("--recompute".into());
    let r = run(&alone, Duration::from_secs(60));
    assert_eq!(r.code, Some(1), "{}", r.stdout);
    assert!(r.stderr.contains("goes with --in-memory or --resident-twin"), "{}", r.stderr);
    let gguf = format!("{}/tests/fixtures/tiny-gpt2.gguf", env!("CARGO_MANIFEST_DIR"));
    let full = strings(&["--model", &gguf, "--seq", "8", "--steps", "1", "--in-memory"]);
    let r = run(&full, Duration::from_secs(60));
    assert_eq!(r.code, Some(1), "{}", r.stdout);
    assert!(r.stderr.contains("a quantized weight is not trained"), "{}", r.stderr);
}

/// A merged export of a GGUF base whose tokenizer strata cannot read (`tokenizer.ggml.model`
/// `bert`, made by editing tiny-gpt2.gguf's `gpt2`) is refused before the first step, naming
/// the key: the export would be a directory without a tokenizer.
#[test]
fn an_export_of_a_gguf_base_whose_tokenizer_cannot_be_written_is_refused_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = format!("{}/tests/fixtures/tiny-gpt2.gguf", env!("CARGO_MANIFEST_DIR"));
    let mut bytes = std::fs::read(&gguf).unwrap();
    let key = b"tokenizer.ggml.model";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    // The value: a string (type 8, 4 bytes), its length (8 bytes), then "gpt2".
    assert_eq!(&bytes[at + 12..at + 16], b"gpt2");
    bytes[at + 12..at + 16].copy_from_slice(b"bert");
    let bert = dir.path().join("bert.gguf");
    std::fs::write(&bert, bytes).unwrap();
    let mut args = qlora_run(2);
    args[1] = bert.to_str().unwrap().to_string();
    let merged = dir.path().join("merged");
    args.extend(strings(&["--export-merged", merged.to_str().unwrap()]));
    let r = run(&args, Duration::from_secs(60));
    assert_eq!(r.code, Some(1), "{}", r.stdout);
    assert!(r.stderr.contains("tokenizer.ggml.model"), "{}", r.stderr);
    assert!(!r.stdout.lines().any(|l| l.starts_with("step ")), "a step ran: {}", r.stdout);
    assert!(!merged.exists());
    // Without the export the run trains: the tokenizer is not needed for token ids.
    let mut args = qlora_run(1);
    args[1] = bert.to_str().unwrap().to_string();
    assert_eq!(run(&args, Duration::from_secs(60)).code, Some(0));
}
