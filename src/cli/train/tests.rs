//! `strata train-demo`'s trainer ([`super`]) on the host backend: the loop against a plain reference written here, gradient
//! accumulation, the three activation modes, the three optimizer engines, and bad input files.

use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use strata::{DType, Error};

use super::{load_init, run, Outcome, TrainConfig};
use crate::cli::args::TrainDemoArgs;
use crate::cli::common;

fn write_file(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn le(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Seeded values in [-a, a].
fn values(seed: u64, n: usize, a: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
        })
        .collect()
}

struct Files {
    _dir: tempfile::TempDir,
    init: PathBuf,
    data: PathBuf,
    dir: PathBuf,
}

const L: usize = 3;
const H: usize = 8;
const R: usize = 8;

fn files() -> Files {
    let dir = tempfile::tempdir().unwrap();
    let init = dir.path().join("init.safetensors");
    let data = dir.path().join("data.safetensors");
    let ws: Vec<(String, Vec<f32>)> =
        (0..L).map(|i| (format!("layers.{i}.weight"), values(1 + i as u64, H * H, 0.6))).collect();
    let t: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)> =
        ws.iter().map(|(n, w)| (n.as_str(), Dtype::F32, vec![H, H], le(w))).collect();
    write_file(&init, &t);
    write_file(
        &data,
        &[
            ("x", Dtype::F32, vec![R, H], le(&values(100, R * H, 1.0))),
            ("y", Dtype::F32, vec![R, H], le(&values(200, R * H, 1.0))),
        ],
    );
    let p = dir.path().to_path_buf();
    Files { _dir: dir, init, data, dir: p }
}

fn train(f: &Files, extra: &[&str], out: &str) -> Vec<Vec<f32>> {
    train_on(common::Backend::Host, f, extra, out)
}

fn train_on(backend: common::Backend, f: &Files, extra: &[&str], out: &str) -> Vec<Vec<f32>> {
    let save = f.dir.join(out);
    let mut args: Vec<String> = [
        "--init",
        f.init.to_str().unwrap(),
        "--data",
        f.data.to_str().unwrap(),
        "--steps",
        "4",
        "--device-budget",
        "64KiB",
        "--compare",
        "off",
        "--save",
        save.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    if backend == common::Backend::Host {
        args.push("--host".into());
    }
    let cfg = TrainConfig::parse(&args).unwrap();
    let report = run(&cfg, |_| Ok(())).unwrap();
    assert_eq!(report.losses.len(), 4);
    load_init(&save).unwrap().1
}

/// The model and optimizers of the contract, written out plainly: f32 everywhere, sums in
/// index order (as the host backend's GEMMs).
fn reference(f: &Files, adamw: bool, lr: f32, steps: usize) -> Vec<Vec<f32>> {
    let (_, mut w) = load_init(&f.init).unwrap();
    let x = values(100, R * H, 1.0);
    let y = values(200, R * H, 1.0);
    let mut m = vec![vec![0f32; H * H]; L];
    let mut v = vec![vec![0f32; H * H]; L];
    // z = a · Wᵀ
    let lin = |a: &[f32], w: &[f32]| -> Vec<f32> {
        let mut z = vec![0f32; R * H];
        for r in 0..R {
            for o in 0..H {
                let mut acc = 0f32;
                for i in 0..H {
                    acc += a[r * H + i] * w[o * H + i];
                }
                z[r * H + o] = acc;
            }
        }
        z
    };
    for t in 1..=steps {
        let mut acts = vec![x.clone()];
        for (l, wl) in w.iter().enumerate() {
            let mut z = lin(acts.last().unwrap(), wl);
            if l + 1 < L {
                for e in &mut z {
                    if *e <= 0.0 {
                        *e = 0.0;
                    }
                }
            }
            acts.push(z);
        }
        let out = acts.pop().unwrap();
        let mut g: Vec<f32> = out.iter().zip(&y).map(|(o, y)| (o - y) * (1.0 / R as f32)).collect();
        for l in (0..L).rev() {
            let a = &acts[l];
            // dW[o][i] = Σ_r g[r][o] a[r][i]
            let mut dw = vec![0f32; H * H];
            for o in 0..H {
                for i in 0..H {
                    let mut acc = 0f32;
                    for r in 0..R {
                        acc += g[r * H + o] * a[r * H + i];
                    }
                    dw[o * H + i] = acc;
                }
            }
            if l > 0 {
                // da[r][i] = Σ_o g[r][o] W[o][i], through the relu whose output is a
                let mut da = vec![0f32; R * H];
                for r in 0..R {
                    for i in 0..H {
                        let mut acc = 0f32;
                        for o in 0..H {
                            acc += g[r * H + o] * w[l][o * H + i];
                        }
                        da[r * H + i] = if a[r * H + i] > 0.0 { acc } else { 0.0 };
                    }
                }
                g = da;
            }
            let p = &mut w[l];
            if adamw {
                let (b1, b2, eps) = (0.9f64, 0.999f64, 1e-8f32);
                let bc1 = 1.0 - b1.powi(t as i32);
                let bc2 = (1.0 - b2.powi(t as i32)).sqrt() as f32;
                let step = (lr as f64 / bc1) as f32;
                for k in 0..H * H {
                    m[l][k] += 0.1 * (dw[k] - m[l][k]);
                    v[l][k] = v[l][k] * 0.999 + (1.0 - 0.999f64) as f32 * dw[k] * dw[k];
                    p[k] -= step * (m[l][k] / (v[l][k].sqrt() / bc2 + eps));
                }
            } else {
                for k in 0..H * H {
                    p[k] -= lr * dw[k];
                }
            }
        }
    }
    w
}

fn assert_close(got: &[Vec<f32>], want: &[Vec<f32>], tol: f32, what: &str) {
    for (l, (g, w)) in got.iter().zip(want).enumerate() {
        for (k, (a, b)) in g.iter().zip(w).enumerate() {
            assert!(
                (a - b).abs() <= tol * b.abs().max(1e-2),
                "{what}: layer {l} element {k}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn a_short_run_lowers_the_loss() -> strata::Result<()> {
    let cfg = TrainConfig::parse([
        "--layers",
        "3",
        "--hidden",
        "16",
        "--rows",
        "8",
        "--steps",
        "3",
        "--optimizer",
        "adamw",
        "--activations",
        "recompute",
        "--checkpoint-every",
        "2",
        "--host",
    ])?;
    let report = run(&cfg, |_| Ok(()))?;
    assert_eq!(report.losses.len(), 3);
    assert!(report.losses[2] < report.losses[0], "the loss goes down: {:?}", report.losses);
    Ok(())
}

#[test]
fn sgd_and_adamw_match_a_plain_reference() {
    let f = files();
    for (opt, adamw, lr) in [("sgd", false, "0.05"), ("adamw", true, "0.01")] {
        let got = train(&f, &["--optimizer", opt, "--lr", lr], &format!("{opt}.safetensors"));
        let want = reference(&f, adamw, lr.parse().unwrap(), 4);
        assert_close(&got, &want, 1e-5, opt);
    }
}

#[test]
fn activation_modes_and_engines_give_the_same_weights() {
    let f = files();
    let keep = train(&f, &["--activations", "keep", "--engine", "cpu"], "keep.safetensors");
    for (extra, name) in [
        (&["--activations", "offload", "--engine", "cpu"][..], "offload"),
        (
            &["--activations", "recompute", "--checkpoint-every", "2", "--engine", "cpu"][..],
            "recompute2",
        ),
        (
            &["--activations", "recompute", "--checkpoint-every", "1", "--engine", "cpu"][..],
            "recompute1",
        ),
        (&["--activations", "offload", "--engine", "gpu-mapped"][..], "mapped"),
        (
            &["--activations", "keep", "--engine", "gpu-resident", "--device-budget", "1MiB"][..],
            "resident",
        ),
        (&["--activations", "keep", "--engine", "cpu", "--threads", "3"][..], "threads"),
        (&["--activations", "offload", "--engine", "cpu", "--pinned-budget", "8KiB"][..], "disk"),
    ] {
        let got = train(&f, extra, &format!("{name}.safetensors"));
        assert_eq!(got, keep, "{name} gives the same bits as keep");
    }
}

#[test]
fn four_micro_batches_equal_one_batch() {
    let f = files();
    for opt in ["sgd", "adamw"] {
        let one = train(&f, &["--optimizer", opt], &format!("one-{opt}.safetensors"));
        let four = train(
            &f,
            &["--optimizer", opt, "--accumulate", "4"],
            &format!("four-{opt}.safetensors"),
        );
        assert_close(&four, &one, 1e-5, opt);
    }
}

#[test]
fn bf16_compute_trains_and_saves_f32_masters() {
    let f = files();
    let got =
        train(&f, &["--dtype", "bf16", "--optimizer", "sgd", "--lr", "0.05"], "bf16.safetensors");
    let want = reference(&f, false, 0.05, 4);
    // bf16 GEMM inputs: close to the f32 run, not equal.
    assert_close(&got, &want, 5e-2, "bf16");
    assert_ne!(got, want);
}

fn expect_bad(args: &[&str], tensor: Option<&str>) {
    let cfg = TrainConfig::parse(args).unwrap();
    match run(&cfg, |_| Ok(())) {
        Err(Error::BadFile { tensor: t, .. }) => assert_eq!(t.as_deref(), tensor, "{args:?}"),
        other => panic!("{args:?}: want BadFile naming {tensor:?}, got {other:?}"),
    }
}

#[test]
fn bad_inputs_are_typed_errors_naming_the_tensor() {
    let f = files();
    let p = |n: &str| f.dir.join(n);
    let w = le(&values(1, H * H, 0.5));
    // Layers 0 and 2: layer 1 is missing.
    write_file(
        &p("gap.safetensors"),
        &[
            ("layers.0.weight", Dtype::F32, vec![H, H], w.clone()),
            ("layers.2.weight", Dtype::F32, vec![H, H], w.clone()),
        ],
    );
    let shape = le(&values(1, H * (H + 1), 0.5));
    write_file(
        &p("shape.safetensors"),
        &[
            ("layers.0.weight", Dtype::F32, vec![H, H], w.clone()),
            ("layers.1.weight", Dtype::F32, vec![H, H + 1], shape),
        ],
    );
    write_file(&p("dtype.safetensors"), &[("layers.0.weight", Dtype::I32, vec![H, H], w.clone())]);
    let x = le(&values(3, R * H, 1.0));
    let y_short = le(&values(4, (R - 1) * H, 1.0));
    write_file(
        &p("xy.safetensors"),
        &[("x", Dtype::F32, vec![R, H], x.clone()), ("y", Dtype::F32, vec![R - 1, H], y_short)],
    );
    write_file(&p("noy.safetensors"), &[("x", Dtype::F32, vec![R, H], x.clone())]);
    let xw = le(&values(3, R * (H + 2), 1.0));
    write_file(
        &p("width.safetensors"),
        &[("x", Dtype::F32, vec![R, H + 2], xw.clone()), ("y", Dtype::F32, vec![R, H + 2], xw)],
    );
    let s = |n: &str| p(n).to_str().unwrap().to_string();
    let init = f.init.to_str().unwrap().to_string();
    expect_bad(&["--init", &s("gap.safetensors"), "--host"], Some("layers.1.weight"));
    expect_bad(&["--init", &s("shape.safetensors"), "--host"], Some("layers.1.weight"));
    expect_bad(&["--init", &s("dtype.safetensors"), "--host"], Some("layers.0.weight"));
    expect_bad(&["--init", &init, "--data", &s("xy.safetensors"), "--host"], Some("y"));
    expect_bad(&["--init", &init, "--data", &s("noy.safetensors"), "--host"], Some("y"));
    expect_bad(&["--init", &init, "--data", &s("width.safetensors"), "--host"], Some("x"));
    // Not a safetensors file at all.
    std::fs::write(p("junk.safetensors"), b"not a tensor file").unwrap();
    expect_bad(&["--init", &s("junk.safetensors"), "--host"], None);
    // A missing file is an I/O error naming the path.
    let cfg = TrainConfig::parse(["--init", "/nonexistent/w.safetensors", "--host"]).unwrap();
    assert!(matches!(run(&cfg, |_| Ok(())), Err(Error::Io { .. })));
}

#[test]
fn keep_that_cannot_fit_says_so() {
    let cfg = TrainConfig::parse([
        "--layers",
        "4",
        "--hidden",
        "64",
        "--rows",
        "8",
        "--device-budget",
        "53KiB",
        "--activations",
        "keep",
        "--host",
        "--compare",
        "off",
    ])
    .unwrap();
    match run(&cfg, |_| Ok(())) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("--activations keep"), "{m}"),
        other => panic!("want a clear error, got {other:?}"),
    }
    // Offload trains in the same budget (it needs two layers, a gradient and two
    // activations on the device: 52 KiB here; keep needs 54 KiB).
    let cfg = TrainConfig::parse([
        "--layers",
        "4",
        "--hidden",
        "64",
        "--rows",
        "8",
        "--device-budget",
        "53KiB",
        "--activations",
        "offload",
        "--host",
        "--compare",
        "off",
        "--steps",
        "2",
    ])
    .unwrap();
    run(&cfg, |_| Ok(())).unwrap();
}

#[test]
fn offload_and_recompute_that_cannot_fit_say_so_up_front() {
    // The step's working set (two layers, a gradient, two activations): 52 KiB here.
    for (budget, fits) in [("24KiB", false), ("51KiB", false), ("52KiB", true)] {
        for mode in ["offload", "recompute"] {
            let args = [
                "--layers",
                "4",
                "--hidden",
                "64",
                "--rows",
                "8",
                "--device-budget",
                budget,
                "--activations",
                mode,
                "--host",
                "--compare",
                "off",
                "--steps",
                "2",
            ];
            let cfg = TrainConfig::parse(args).unwrap();
            match run(&cfg, |_| Ok(())) {
                Ok(_) => assert!(fits, "{mode} in {budget} ran"),
                Err(Error::InvalidArgument(m)) if !fits => {
                    assert!(m.contains(&format!("--activations {mode}")), "{m}");
                    assert!(m.contains("at least 52.00 KiB"), "{m}");
                }
                Err(e) => panic!("{mode} in {budget}: {e}"),
            }
        }
    }
}

#[test]
fn the_example_entry_point_dispatches_by_mode() {
    let args = |s: &str| TrainDemoArgs::try_parse(s.split_whitespace()).unwrap();
    let t = super::dispatch(
        &args("--mode train --layers 2 --hidden 16 --rows 4 --steps 2 --device-budget 1MiB --host"),
        |_| Ok(()),
    )
    .unwrap();
    assert!(matches!(t, Outcome::Train(_)));
    let m = super::dispatch(
        &args("--mode train --optimizer device-sgd --layers 2 --hidden 16 --rows 4 --steps 2 --device-budget 24KiB --host"),
        |_| Ok(()),
    )
    .unwrap();
    assert!(matches!(m, Outcome::Mlp(ref r) if r.matches_resident == Some(true)));
}

#[test]
fn engines_and_activation_modes_agree_on_each_backend() {
    // On CUDA: cuBLAS GEMMs, the update kernels and the CPU engine must give the same bits
    // as each other (the same GEMM calls, the same rounding in every update).
    let f = files();
    common::each_backend("engines_and_activation_modes_agree_on_each_backend", |backend| {
        for dtype in ["f32", "bf16"] {
            let base = ["--dtype", dtype, "--device-budget", "1MiB"];
            let run = |extra: &[&str], name: &str| {
                let mut a = base.to_vec();
                a.extend_from_slice(extra);
                train_on(backend, &f, &a, &format!("{}-{dtype}-{name}.safetensors", backend.name()))
            };
            let cpu = run(&["--engine", "cpu", "--activations", "keep"], "cpu");
            for (extra, name) in [
                (&["--engine", "gpu-mapped", "--activations", "offload"][..], "mapped"),
                (&["--engine", "gpu-resident", "--activations", "recompute"][..], "resident"),
                (
                    &["--engine", "cpu", "--activations", "offload", "--device-budget", "16KiB"][..],
                    "tight",
                ),
            ] {
                assert_eq!(run(extra, name), cpu, "{} {dtype} {name}", backend.name());
            }
        }
    });
}

#[test]
fn a_directory_given_as_a_file_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let cfg = TrainConfig::parse(["--init", d, "--host"]).unwrap();
    match run(&cfg, |_| Ok(())) {
        Err(e @ Error::NotAFile { what: "a directory", .. }) => {
            let Error::NotAFile { path, .. } = &e else { unreachable!() };
            assert_eq!(path, dir.path());
            assert!(e.to_string().contains("is a directory, not a regular file"), "{e}");
        }
        other => panic!("want an error naming the directory, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn a_model_too_large_for_the_host_is_an_error_not_an_abort() {
    let cfg = TrainConfig::parse(["--layers", "4", "--hidden", "2000000", "--rows", "8", "--host"])
        .unwrap();
    match run(&cfg, |_| Ok(())) {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("of host memory"), "{m}"),
        other => panic!("want a clear error, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn train_demo_refuses_dtypes_it_does_not_run() {
    // The dtypes the optimizer refuses (tests/checkpoints.rs,
    // `compute_refuses_dtypes_it_does_not_run`): fp8 and the unsigned integers.
    for d in [DType::F8E4M3, DType::F8E5M2, DType::U16, DType::U32, DType::U64] {
        let cfg = TrainConfig { dtype: Some(d), host: true, ..Default::default() };
        match run(&cfg, |_| Ok(())) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains(&d.to_string()), "{m}"),
            other => panic!("train-demo in {d}: {:?}", other.map(|_| ())),
        }
    }
}
