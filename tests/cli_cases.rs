//! The `strata` binary on inputs it must refuse or survive: sizes beyond the host or the
//! budgets (they aborted with SIGABRT on a failed allocation), a model of more tensors than
//! the tiers hold (it ran on with no end in sight), numbers with white space (`' 3'` was taken
//! for 3), an output path that cannot be written, a file-size limit (the process died by
//! SIGXFSZ), a copy into a tier too small for some tensors (it stopped at the first), and the
//! help and report conventions. Every child runs under a virtual memory limit, so that a
//! regression fails instead of exhausting the machine, and under a deadline.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The `strata` binary: cargo's build of it, or the staged copy beside the test executable.
fn strata_bin() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_BIN_EXE_strata"));
    if built.exists() {
        return built;
    }
    std::env::current_exe().expect("test executable path").with_file_name("bin-strata")
}

/// Runs `strata ARGS` through `sh` after `limits` (more `ulimit` commands) and a virtual memory
/// cap of 8 GiB, killed after `deadline`.
fn run_limited(args: &[&str], limits: &str, dir: &Path, deadline: Duration) -> Output {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -v 8388608; {limits} exec \"$0\" \"$@\""))
        .arg(strata_bin())
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > deadline {
            child.kill().unwrap();
            panic!("strata {args:?} still running after {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn run(args: &[&str]) -> (Output, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let out = run_limited(args, "", dir.path(), Duration::from_secs(120));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stdout, stderr)
}

/// Asserts a clean failure: exit code 1 (not a signal), an `error:` line containing `want`.
fn fails_with(args: &[&str], want: &str) -> String {
    let (out, stdout, stderr) = run(args);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {:?}\n{stdout}\n{stderr}", out.status);
    assert!(stderr.contains("error: ") && stderr.contains(want), "{args:?}: {stderr}");
    assert!(!stderr.contains("panicked") && !stderr.contains("memory allocation"), "{stderr}");
    stderr
}

#[test]
fn demo_sizes_beyond_the_budgets_or_the_host_are_refused_before_allocating() {
    fails_with(&["demo", "--host", "--layer-size", "1TiB"], "larger than every tier");
    fails_with(&["demo", "--host", "--layers", "2", "--layer-size", "64GiB"], "every tier");
    fails_with(
        &["demo", "--host", "--layers", "2", "--layer-size", "64GiB", "--disk-budget", "1TiB"],
        "of host memory",
    );
    // Two million tensors of 4 bytes: each takes a page of the disk tier.
    let e = fails_with(
        &["demo", "--host", "--layers", "1000000", "--layer-size", "4"],
        "do not fit these budgets",
    );
    assert!(e.contains("--disk-budget"), "{e}");
}

#[test]
fn bench_sizes_beyond_the_host_are_skipped_with_the_reason() {
    let e = fails_with(&["bench", "--host", "--sizes", "1TiB"], "nothing was measured");
    let (_, stdout, _) = run(&["bench", "--host", "--sizes", "1TiB"]);
    assert!(stdout.contains("host_memcpy at 1 TiB: needs 2.00 TiB of host memory"), "{stdout}");
    assert!(e.contains("--sizes"), "{e}");
}

#[test]
fn numbers_with_white_space_are_refused() {
    for args in [
        &["demo", "--layers", " 3"][..],
        &["demo", "--layer-size", "1 MiB"],
        &["bench", "--reps", "3 "],
        &["train-demo", "--steps", "\t2"],
    ] {
        let (out, _, stderr) = run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("white space"), "{args:?}: {stderr}");
    }
}

#[test]
fn an_output_that_cannot_be_written_fails_before_the_run() {
    for save in ["/nonexistent/dir/x.safetensors", "/proc/x.safetensors"] {
        let (out, stdout, stderr) = run(&[
            "train-demo",
            "--mode",
            "train",
            "--host",
            "--layers",
            "2",
            "--hidden",
            "8",
            "--rows",
            "4",
            "--steps",
            "1",
            "--save",
            save,
        ]);
        assert!(!out.status.success(), "{save}: {stdout}\n{stderr}");
        assert!(stderr.contains("cannot write"), "{save}: {stderr}");
        assert!(!stdout.contains("step "), "{save}: ran before refusing\n{stdout}");
    }
}

/// Under `ulimit -f` a write past the limit fails with EFBIG, reported as an error naming the
/// file: the process used to die by SIGXFSZ.
#[test]
fn a_file_size_limit_is_an_error_not_a_signal() {
    let dir = tempfile::tempdir().unwrap();
    let save = dir.path().join("w.safetensors");
    let out = run_limited(
        &[
            "train-demo",
            "--mode",
            "train",
            "--host",
            "--layers",
            "2",
            "--hidden",
            "128",
            "--rows",
            "4",
            "--steps",
            "1",
            "--no-compare",
            "--device-budget",
            "1MiB",
            "--save",
            save.to_str().unwrap(),
        ],
        "ulimit -f 16;",
        dir.path(),
        Duration::from_secs(120),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{:?}: {stderr}", out.status);
    assert!(stderr.contains("File too large"), "{stderr}");
    assert!(!save.exists(), "a partial file was left");
}

#[test]
fn a_copy_into_a_small_tier_goes_past_a_tensor_it_cannot_hold() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    let store = strata::Store::builder().host_backend().build().unwrap();
    let mut ids = Vec::new();
    for (name, mib) in [("a", 1usize), ("big", 12), ("c", 1)] {
        ids.push(store.put(name, strata::DType::U8, &[mib << 20], &vec![7u8; mib << 20]).unwrap());
    }
    store.save_safetensors(&path, &ids).unwrap();
    let p = path.to_str().unwrap();
    let (out, stdout, stderr) =
        run(&["load", p, "--host", "--copy-to", "device", "--device-budget", "8MiB"]);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("copied 2 of 3 tensors (2.00 MiB of 14.00 MiB) into device"),
        "{stdout}"
    );
    assert!(
        stdout.contains("1 tensor (12.00 MiB) did not fit in device (budget 8.00 MiB)")
            && stdout.contains("the largest big (12.00 MiB)"),
        "{stdout}"
    );
    // Nothing was read back: no access, no ratio (not "0.0%").
    assert!(stdout.contains("(hit ratio -)"), "{stdout}");
}

#[test]
fn help_lists_one_line_per_subcommand_and_size_values_are_named_size() {
    let (out, stdout, _) = run(&["--help"]);
    assert!(out.status.success());
    let commands: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .collect();
    // demo, bench, train-demo, inspect, load, generate, chat, finetune, serve, help.
    assert_eq!(commands.len(), 10, "{stdout}");
    for line in commands {
        assert!(line.len() < 100, "more than a one-line summary: {line}");
    }
    for sub in ["demo", "load", "inspect", "bench", "train-demo"] {
        let (_, help, _) = run(&[sub, "--help"]);
        for line in help.lines().filter(|l| l.contains("-budget") || l.contains("-size")) {
            if let Some(v) = line.split('<').nth(1) {
                assert!(v.starts_with("SIZE"), "{sub}: {line}");
            }
        }
    }
    let (_, help, _) = run(&["train-demo", "--help"]);
    assert!(help.contains("--no-compare") && help.contains("--no-hints"), "{help}");
    let (_, help, _) = run(&["demo", "--help"]);
    assert!(help.contains("[default: schedule]"), "{help}");
}
