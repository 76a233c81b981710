//! `strata inspect` and `strata load` end to end on the host: runs the built binary on a small
//! safetensors file written with the `safetensors` crate, and on the same tensors as a sharded
//! checkpoint (by its index and by its directory).

use std::collections::HashMap;
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
    let on = format!("on the machine of {bench_arg} (gpu-box, 2026-11-23T08:30:00Z):");
    assert!(stdout.contains(&on), "{stdout}");
    assert!(stdout.contains(&format!("h2d 50.00 GB/s (h2d_pinned at 1.00 GiB in {bench_arg})")));
    let total = stdout.lines().find(|l| l.starts_with("predicted transfer time")).unwrap();
    assert!(total.ends_with("one after the other)"), "{total}");

    // A preset instead: its figures, named, and not with a bench file.
    let preset = ["inspect", "--device-budget", "0", "--train", "--machine", "h200"];
    let (out, stdout, stderr) = run(&preset, &file);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("on the H200 preset (141 GB HBM"), "{stdout}");
    assert!(stdout.contains("h2d 54.30 GB/s (assumed: the H100 preset's PCIe"), "{stdout}");
    let (out, _, stderr) = run(&[&preset[..], &["--bench", bench_arg]].concat(), &file);
    assert!(!out.status.success() && stderr.contains("cannot be used with"), "{stderr}");
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
    assert!(stdout.contains("copied 3 of 3 tensors") && stdout.contains("into pinned"), "{stdout}");
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

/// A model of every kind of dtype, written as one file (`single/model.safetensors`) and as two
/// shards of the same tensors with their index (`sharded/`), each with `{"format": "pt"}`:
/// (single file, index, sharded directory).
fn write_sharded(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let t = |n: &str, d: Dtype, shape: &[usize]| {
        let len = shape.iter().product::<usize>() * d.bitsize() / 8;
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + n.len()) as u8 & 0x7f).collect();
        (n.to_string(), d, shape.to_vec(), data)
    };
    let ts = [
        t("model.embed.weight", Dtype::BF16, &[8, 4]),
        t("model.layers.0.mlp.weight", Dtype::F8_E4M3, &[4, 8]),
        t("model.layers.0.mlp.weight_scale", Dtype::F32, &[1]),
        t("model.layers.1.mlp.weight", Dtype::F8_E5M2, &[4, 8]),
        t("model.layers.1.norm", Dtype::F16, &[4]),
        t("quant.qweight", Dtype::U32, &[2, 3]),
        t("quant.g_idx", Dtype::U16, &[5]),
        t("quant.offsets", Dtype::U64, &[2]),
        t("position_ids", Dtype::I64, &[3]),
    ];
    let meta = || Some(HashMap::from([("format".to_string(), "pt".to_string())]));
    let write = |path: &Path, part: &[&(String, Dtype, Vec<usize>, Vec<u8>)]| {
        let views: Vec<(String, TensorView<'_>)> = part
            .iter()
            .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, meta(), path).unwrap();
    };
    let single_dir = dir.join("single");
    let sharded = dir.join("sharded");
    std::fs::create_dir_all(&single_dir).unwrap();
    std::fs::create_dir_all(&sharded).unwrap();
    let single = single_dir.join("model.safetensors");
    write(&single, &ts.iter().collect::<Vec<_>>());
    // Two shards of runs of the single file's order: each written in the same order.
    let bytes = std::fs::read(&single).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut order: Vec<(usize, String)> =
        st.iter().map(|(n, v)| (v.data().as_ptr() as usize, n.to_string())).collect();
    order.sort();
    let mut weight_map = serde_json::Map::new();
    for (i, run) in order.chunks(5).enumerate() {
        let shard = format!("model-{:05}-of-00002.safetensors", i + 1);
        let part: Vec<_> =
            run.iter().map(|(_, n)| ts.iter().find(|t| &t.0 == n).unwrap()).collect();
        write(&sharded.join(&shard), &part);
        for (_, n) in run {
            weight_map.insert(n.clone(), shard.clone().into());
        }
    }
    let index = sharded.join("model.safetensors.index.json");
    let json = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(&index, json.to_string()).unwrap();
    (single, index, sharded)
}

/// The block of `stdout` that starts with a line starting with `head`, up to the blank line.
fn block(stdout: &str, head: &str) -> String {
    let lines: Vec<&str> = stdout.lines().skip_while(|l| !l.starts_with(head)).collect();
    assert!(!lines.is_empty(), "no line starting {head:?} in:\n{stdout}");
    lines.iter().take_while(|l| !l.is_empty()).map(|l| format!("{l}\n")).collect()
}

#[test]
fn inspect_and_load_give_the_same_tensors_for_a_sharded_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let (single, index, sharded) = write_sharded(dir.path());
    let mut tables = Vec::new();
    for path in [&single, &index, &sharded] {
        let (out, stdout, stderr) = run(&["inspect"], path);
        assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
        // The tensor table, then the totals.
        let table = block(&stdout, "name ");
        let totals = block(&stdout, "9 tensors");
        for d in ["f8e4m3", "f8e5m2", "u16", "u32", "u64", "bf16"] {
            assert!(table.contains(&format!(" {d} ")), "{d}:\n{table}");
            assert!(totals.contains(&format!("{d} ")), "{d}:\n{totals}");
        }
        assert!(stdout.contains("metadata: {\"format\":\"pt\"}"), "{stdout}");
        let files = stdout.lines().find(|l| l.starts_with("files: "));
        if path == &single {
            assert_eq!(files, None, "{stdout}");
        } else {
            let files = files.unwrap_or_else(|| panic!("no files line:\n{stdout}"));
            assert!(files.contains("2 files named by") && files.contains("index.json"), "{files}");
            assert!(files.contains("model-00001-of-00002.safetensors, model-00002"), "{files}");
        }

        let args = [&["load", "--host", "--checksums"][..], &SMALL].concat();
        let (out, stdout, stderr) = run(&args, path);
        assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
        assert!(stdout.contains("loaded 9 tensors") && stdout.contains("in place"), "{stdout}");
        let sums = block(&stdout, "name ");
        assert!(sums.lines().next().unwrap().ends_with("crc32"), "{sums}");
        assert_eq!(sums.lines().count(), 10, "{sums}");
        tables.push((path.clone(), table, totals, sums));
    }
    let (_, table, totals, sums) = &tables[0];
    for (path, t, tot, s) in &tables[1..] {
        assert_eq!(t, table, "{}: tensor table", path.display());
        assert_eq!(tot, totals, "{}: totals", path.display());
        assert_eq!(s, sums, "{}: checksums", path.display());
    }

    // Copied into pinned, the same bytes.
    let args = [&["load", "--host", "--checksums", "--copy-to", "pinned"][..], &SMALL].concat();
    let (out, stdout, stderr) = run(&args, &index);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("copied 9 of 9 tensors") && stdout.contains("into pinned"), "{stdout}");
    assert_eq!(&block(&stdout, "name "), sums);
}

#[test]
fn help_names_the_three_forms_of_a_checkpoint() {
    for cmd in ["inspect", "load"] {
        let out = Command::new(strata_bin()).args([cmd, "--help"]).output().unwrap();
        let help = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{help}");
        assert!(help.contains("<CHECKPOINT>"), "{cmd}:\n{help}");
        for form in [".safetensors file", "model.safetensors.index.json", "directory"] {
            assert!(help.contains(form), "{cmd} --help does not name {form:?}:\n{help}");
        }
    }
}

#[test]
fn a_broken_sharded_checkpoint_is_an_error_naming_the_shard() {
    let dir = tempfile::tempdir().unwrap();
    let (_, index, sharded) = write_sharded(dir.path());
    let second = sharded.join("model-00002-of-00002.safetensors");
    std::fs::rename(&second, dir.path().join("elsewhere.safetensors")).unwrap();
    for path in [&index, &sharded] {
        for args in [vec!["inspect"], [&["load", "--host"][..], &SMALL].concat()] {
            let (out, stdout, stderr) = run(&args, path);
            assert!(!out.status.success(), "{args:?}: stdout:\n{stdout}");
            assert!(stderr.starts_with("error: I/O error on "), "{stderr}");
            assert!(stderr.contains("model-00002-of-00002.safetensors"), "{stderr}");
            assert!(!stdout.contains("loaded"), "{stdout}");
        }
    }
    // A tensor of the index that its shard lacks.
    std::fs::rename(dir.path().join("elsewhere.safetensors"), &second).unwrap();
    let mut json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index).unwrap()).unwrap();
    json["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors".into();
    std::fs::write(&index, json.to_string()).unwrap();
    let (out, _, stderr) = run(&["inspect"], &index);
    assert!(!out.status.success());
    assert!(stderr.starts_with("error: bad tensor file"), "{stderr}");
    assert!(stderr.contains("model-00002-of-00002.safetensors"), "{stderr}");
    assert!(stderr.contains("\"lm_head.weight\""), "{stderr}");
}

/// `strata inspect` and `strata load` of a FIFO (or through an index naming one) exit with an
/// error saying what the path is, at once: they used to block forever reading it. Run under a
/// deadline so that a regression fails instead of hanging.
#[test]
fn inspect_and_load_refuse_a_fifo_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("model.safetensors");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that outlives the call, which only reads it.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let index = dir.path().join("model.safetensors.index.json");
    std::fs::write(&index, r#"{"weight_map": {"w": "model.safetensors"}}"#).unwrap();
    for (cmd, path) in [("inspect", &fifo), ("load", &fifo), ("inspect", &index), ("load", &index)]
    {
        let host: &[&str] = if cmd == "load" { &["--host"] } else { &[] };
        let mut child = Command::new(strata_bin())
            .arg(cmd)
            .arg(path)
            .args(host)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let start = std::time::Instant::now();
        while child.try_wait().unwrap().is_none() {
            if start.elapsed() > std::time::Duration::from_secs(30) {
                child.kill().unwrap();
                panic!("strata {cmd} {}: still blocked after 30 s", path.display());
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "strata {cmd} {}: {stderr}", path.display());
        assert!(
            stderr.contains("is a FIFO, not a regular file")
                && stderr.contains("model.safetensors"),
            "strata {cmd} {}: {stderr}",
            path.display()
        );
    }
}
