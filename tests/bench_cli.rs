//! `strata bench` end to end on the host: runs the built binary with `--host` and checks what it
//! prints and the CSV, JSON and SVG files it writes.

use std::process::Command;

const HOST_PATHS: [&str; 4] = ["host_memcpy", "disk_write", "disk_read", "disk_read_qd4"];

fn store_paths() -> Vec<String> {
    let tiers = ["device", "pinned", "mapped", "disk"];
    let mut v = Vec::new();
    for from in tiers {
        for to in tiers.iter().filter(|&&t| t != from) {
            v.push(format!("store_{from}_to_{to}"));
        }
    }
    v
}

/// The `strata` binary: cargo's build of it, or, where the tests were staged to another machine
/// (`.gpu/bin/test-bench_cli` beside `.gpu/bin/bin-strata`), the staged copy.
fn strata_bin() -> std::path::PathBuf {
    let built = std::path::PathBuf::from(env!("CARGO_BIN_EXE_strata"));
    if built.exists() {
        return built;
    }
    let exe = std::env::current_exe().expect("test executable path");
    exe.with_file_name("bin-strata")
}

#[test]
fn host_bench_writes_table_csv_json_and_plot() {
    let dir = tempfile::tempdir().unwrap();
    let disk = dir.path().join("disk");
    let (csv, json, svg) =
        (dir.path().join("b.csv"), dir.path().join("b.json"), dir.path().join("b.svg"));
    let out = Command::new(strata_bin())
        .args(["-v", "bench", "--host", "--sizes", "4KiB,1MiB", "--reps", "2"])
        .arg("--csv")
        .arg(&csv)
        .arg("--json")
        .arg(&json)
        .arg("--plot")
        .arg(&svg)
        .arg("--disk-dir")
        .arg(&disk)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout
        .lines()
        .next()
        .unwrap()
        .starts_with("--host: measuring host and disk paths only"));
    assert!(stdout.contains("4 KiB") && stdout.contains("1 MiB"), "{stdout}");
    assert!(stdout.contains("store / raw"), "{stdout}");
    // Not a terminal: no progress bar, but with -v a log event per measurement.
    assert!(stderr.contains("measuring") && stderr.contains("host_memcpy"), "{stderr}");

    let csv = std::fs::read_to_string(&csv).unwrap();
    let mut lines = csv.lines();
    assert_eq!(lines.next(), Some("path,size_bytes,gbps,median_s,reps"));
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    let all: Vec<String> = HOST_PATHS.iter().map(|s| s.to_string()).chain(store_paths()).collect();
    for path in &all {
        for size in ["4096", "1048576"] {
            let row = rows
                .iter()
                .find(|r| r[0] == path && r[1] == size)
                .unwrap_or_else(|| panic!("no CSV row for {path} at {size}:\n{csv}"));
            let gbps: f64 = row[2].parse().unwrap();
            let median: f64 = row[3].parse().unwrap();
            assert!(gbps > 0.0 && median > 0.0, "{row:?}");
            assert_eq!(row[4], "2");
        }
    }
    assert_eq!(rows.len(), all.len() * 2, "{csv}");
    assert!(!rows.iter().any(|r| r[0] == "h2d_pinned"), "no GPU path without a GPU");

    let json = std::fs::read_to_string(&json).unwrap();
    for key in ["\"date\"", "\"hostname\"", "\"backend\"", "\"results\"", "\"ratios\""] {
        assert!(json.contains(key), "{key} in {json}");
    }
    assert!(json.contains("\"gpu\": null"));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["results"].as_array().unwrap().len(), all.len() * 2);

    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
    for path in &all {
        assert!(svg.contains(&format!("\n{path}\n</text>")), "legend entry for {path}");
    }
    // Nothing is left behind in the disk directory.
    assert_eq!(std::fs::read_dir(&disk).unwrap().count(), 0);
}

#[test]
fn bad_arguments_fail_with_a_message() {
    for args in [
        &["bench", "--host", "--sizes", "4KiB,lots"][..],
        &["bench", "--host", "--sizes", "0"],
        &["bench", "--host", "--reps", "0", "--sizes", "4KiB"],
        &["bench", "--host", "--paths", "warp_drive", "--sizes", "4KiB"],
        // A directory no file can be created in (not even by root).
        &["bench", "--host", "--sizes", "4KiB", "--reps", "1", "--disk-dir", "/proc"],
        &["bench", "--host", "--sizes", "4KiB", "--csv", "/nonexistent-dir/b.csv"],
        &["bench", "--host", "--sizes", "4KiB", "--plot", "b.png"],
    ] {
        let out = Command::new(strata_bin()).args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains("error"), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// Whether this process ignores SIGINT (as a job started in the background by a
/// non-interactive shell does): its children then inherit that, and Ctrl-C would not stop them.
fn sigint_ignored() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigIgn:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << (libc::SIGINT - 1)) != 0)
}

/// `strata bench` stopped with Ctrl-C (SIGINT) or killed leaves nothing in its disk directory:
/// the disk paths' files and the store's slab have no names.
#[test]
fn a_stopped_bench_leaves_nothing_in_its_disk_dir() {
    let dir = tempfile::tempdir().unwrap();
    // A test run that ignores SIGINT passes that on to the bench: stop it with SIGTERM instead
    // (the same default action: the process ends without running any handler).
    let stop = if sigint_ignored() {
        println!("SIGINT is ignored in this test run: stopping the bench with SIGTERM instead");
        "-TERM"
    } else {
        "-INT"
    };
    for signal in [stop, "-KILL"] {
        let mut child = Command::new(strata_bin())
            .args(["bench", "--host", "--paths", "disk_*", "--sizes", "64MiB", "--reps", "200"])
            .arg("--disk-dir")
            .arg(dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(700));
        let sent = Command::new("kill").arg(signal).arg(child.id().to_string()).status().unwrap();
        assert!(sent.success(), "kill {signal}");
        let status = child.wait().unwrap();
        assert!(!status.success(), "the bench ended before the signal: make it longer");
        let left: Vec<_> =
            std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.path()).collect();
        assert!(left.is_empty(), "{signal}: left behind {left:?}");
    }
}
