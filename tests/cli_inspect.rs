//! `strata inspect` and `strata load` end to end on the host: runs the built binary on a small
//! safetensors file written with the `safetensors` crate.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use safetensors::tensor::{Dtype, TensorView};

/// The `strata` binary: cargo's build of it, or, where the tests were staged to another machine
/// (`.gpu/bin/test-cli_inspect` beside `.gpu/bin/bin-strata`), the staged copy.
fn strata_bin() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_BIN_EXE_strata"));
    if built.exists() {
        return built;
    }
    let exe = std::env::current_exe().expect("test executable path");
    exe.with_file_name("bin-strata")
}

const NAMES: [&str; 3] = ["encoder.layer0.weight", "encoder.layer0.bias", "token_ids"];

/// Small budgets for `load`: the host backend reserves its budgets in host memory.
const SMALL: [&str; 8] = [
    "--device-budget",
    "1MiB",
    "--pinned-budget",
    "1MiB",
    "--mapped-budget",
    "0",
    "--disk-budget",
    "4MiB",
];

/// A file of a bf16 weight [64, 32] (4 KiB), an f32 bias [32] and an i64 vector [4].
fn write_model(dir: &Path) -> PathBuf {
    let path = dir.join("model.safetensors");
    let w: Vec<u8> = (0..64 * 32 * 2).map(|i| i as u8).collect();
    let b = vec![3u8; 32 * 4];
    let ids = vec![0u8; 4 * 8];
    let views = vec![
        (NAMES[0], TensorView::new(Dtype::BF16, vec![64, 32], &w).unwrap()),
        (NAMES[1], TensorView::new(Dtype::F32, vec![32], &b).unwrap()),
        (NAMES[2], TensorView::new(Dtype::I64, vec![4], &ids).unwrap()),
    ];
    safetensors::serialize_to_file(views, None, &path).unwrap();
    path
}

fn run(args: &[&str], file: &Path) -> (Output, String, String) {
    let out =
        Command::new(strata_bin()).args(&args[..1]).arg(file).args(&args[1..]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stdout, stderr)
}

#[test]
fn inspect_lists_every_tensor_and_a_plan() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_model(dir.path());
    let (out, stdout, stderr) = run(&["inspect"], &file);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    for name in NAMES {
        assert!(stdout.contains(name), "{name} missing:\n{stdout}");
    }
    assert!(stdout.contains("[64, 32]") && stdout.contains("bf16"), "{stdout}");
    assert!(stdout.contains("3 tensors"), "{stdout}");
    assert!(stdout.contains("memory plan: forward only"), "{stdout}");
    assert!(
        stdout.contains("parameters") && stdout.contains("predicted transfer time"),
        "{stdout}"
    );
    // Everything fits on the default device budget: nothing to move.
    assert!(stdout.contains("predicted transfer time per step: 0.00 ms"), "{stdout}");
}

#[test]
fn inspect_training_plan_counts_optimizer_state_and_uses_bench_results() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_model(dir.path());
    let bench = dir.path().join("bench.json");
    std::fs::write(
        &bench,
        r#"{"tool": "strata bench", "hostname": "gpu-box", "date": "2026-11-23T08:30:00Z",
        "results": [
          {"path": "h2d_pinned", "size_bytes": 4096, "gbps": 1.0, "median_s": 0.0},
          {"path": "h2d_pinned", "size_bytes": 1073741824, "gbps": 50.0, "median_s": 0.02},
          {"path": "d2h_pinned", "size_bytes": 1073741824, "gbps": 50.0, "median_s": 0.02},
          {"path": "disk_read", "size_bytes": 1073741824, "gbps": 2.0, "median_s": 0.5}
        ]}"#,
    )
    .unwrap();
    let bench_arg = bench.to_str().unwrap();
    let (out, stdout, stderr) = run(
        &[
            "inspect",
            "--device-budget",
            "0",
            "--pinned-budget",
            "64KiB",
            "--train",
            "--optimizer",
            "adam",
            "--bench",
            bench_arg,
        ],
        &file,
    );
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("memory plan: training, optimizer adamw"), "{stdout}");
    // bf16 [64, 32]: 2048 elements x (8 moments + 4 master) = 24 KiB; f32 [32]: 32 x 8 = 256 B.
    let state = stdout.lines().find(|l| l.starts_with("optimizer state")).unwrap();
    assert!(state.contains("24.25 KiB"), "{state}");
    assert!(stdout.contains("2P + G + S"), "{stdout}");
    assert!(stdout.contains("bandwidths from") && stdout.contains("gpu-box"), "{stdout}");
    assert!(stdout.contains("h2d_pinned: 50.00 GB/s at 1.00 GiB"), "{stdout}");
    let total = stdout.lines().find(|l| l.starts_with("predicted transfer time")).unwrap();
    assert!(total.ends_with("one after the other)"), "{total}");
}

#[test]
fn load_on_the_host_ends_with_the_tier_table() {
    let dir = tempfile::tempdir().unwrap();
    let file = write_model(dir.path());
    let (out, stdout, stderr) = run(&[&["load", "--host"][..], &SMALL].concat(), &file);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("backend: host"), "{stdout}");
    assert!(stdout.contains("loaded 3 tensors") && stdout.contains("in place"), "{stdout}");
    assert!(stdout.contains("tier") && stdout.contains("capacity"), "{stdout}");
    assert!(stdout.contains("bytes moved"), "{stdout}");

    let (out, stdout, stderr) =
        run(&[&["load", "--host", "--copy-to", "pinned"][..], &SMALL].concat(), &file);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("copied 3 tensors") && stdout.contains("into pinned"), "{stdout}");
    let pinned = stdout.lines().find(|l| l.starts_with("pinned")).unwrap();
    assert!(pinned.trim_end().ends_with(" 3"), "three tensors in pinned: {pinned}");
}

#[test]
fn a_missing_or_bad_file_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.safetensors");
    for args in [vec!["inspect"], [&["load", "--host"][..], &SMALL].concat()] {
        let (out, stdout, stderr) = run(&args, &missing);
        assert!(!out.status.success(), "{args:?}: stdout:\n{stdout}");
        assert!(stderr.contains("error:") && stderr.contains("missing.safetensors"), "{stderr}");
    }
    let file = write_model(dir.path());
    let bytes = std::fs::read(&file).unwrap();
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() - 100]).unwrap();
    let (out, _, stderr) = run(&["inspect"], &cut);
    assert!(!out.status.success());
    assert!(stderr.starts_with("error: bad tensor file"), "{stderr}");
}
