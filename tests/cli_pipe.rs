//! Every subcommand of the built `strata` binary, its stdout a pipe whose reader has gone (as in
//! `strata inspect model.safetensors | head`): it exits with success, quietly, without a panic.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The `strata` binary: cargo's build of it, or, where the tests were staged to another machine
/// (`.gpu/bin/test-cli_pipe` beside `.gpu/bin/bin-strata`), the staged copy.
fn strata_bin() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_BIN_EXE_strata"));
    if built.exists() {
        return built;
    }
    let exe = std::env::current_exe().expect("test executable path");
    exe.with_file_name("bin-strata")
}

/// A small safetensors file.
fn model(dir: &Path) -> PathBuf {
    use safetensors::tensor::{Dtype, TensorView};
    let path = dir.join("model.safetensors");
    let w = vec![1u8; 64 * 32 * 2];
    let views = vec![("w", TensorView::new(Dtype::BF16, vec![64, 32], &w).unwrap())];
    safetensors::serialize_to_file(views, None, &path).unwrap();
    path
}

/// Runs `args` with stdout a pipe closed before the binary writes to it.
fn closed_stdout(args: &[&str]) {
    let mut child = Command::new(strata_bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take()); // the reader goes away
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?}: {:?}, stderr:\n{stderr}", out.status);
    assert!(!stderr.contains("panicked") && !stderr.contains("Broken pipe"), "{args:?}: {stderr}");
}

#[test]
fn every_subcommand_ends_quietly_when_stdout_closes() {
    let dir = tempfile::tempdir().unwrap();
    let file = model(dir.path());
    let file = file.to_str().unwrap();
    let disk = dir.path().join("disk");
    let small = ["--device-budget", "1MiB", "--pinned-budget", "1MiB", "--mapped-budget", "0"];
    let mut load = vec!["load", file, "--host", "--disk-budget", "4MiB"];
    load.extend(small);
    for args in [
        &["inspect", file][..],
        &load,
        &["demo", "--host", "--layers", "2", "--layer-size", "16KiB", "--passes", "1"],
        &[
            "bench",
            "--host",
            "--sizes",
            "4KiB",
            "--reps",
            "1",
            "--paths",
            "host_memcpy",
            "--disk-dir",
            disk.to_str().unwrap(),
        ],
        &["train-demo", "--mode", "train", "--layers", "2", "--hidden", "16", "--rows", "4"],
        &[
            "train-demo",
            "--layers",
            "2",
            "--hidden",
            "16",
            "--rows",
            "4",
            "--device-budget",
            "1KiB",
        ],
        &["train-demo", "--help"],
        &["--help"],
    ] {
        let mut a = args.to_vec();
        if a[0] == "train-demo" && a.len() > 2 {
            a.extend(["--host", "--steps", "2"]);
        }
        closed_stdout(&a);
    }
}
