//! Killed processes: a child (this test binary, re-run as one test with an environment
//! variable saying what to do) works in a directory and is killed with SIGKILL at a random
//! moment, many times. Afterwards nothing of it may be left in the directory but the saved file,
//! and that file must be either the old one or the new one, whole: the disk tier is a cache
//! whose slab is unlinked from the start, and `save_safetensors` writes an unnamed file and gives
//! it the target's name only once it is complete (a kill between its link and its rename, a few
//! microseconds, leaves a temporary file that the next save removes).

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use strata::{DType, LoadOptions, Store, Tier};

const CHILD: &str = "STRATA_CRASH_CHILD";
const DIR: &str = "STRATA_CRASH_DIR";

/// The two versions the child saves in turn: tensor `t{k}` of version `v` holds bytes `v + k`.
fn version(v: u8) -> Vec<(String, Vec<u8>)> {
    (0..8u8).map(|k| (format!("t{k}"), vec![v.wrapping_add(k); 256 << 10])).collect()
}

/// The child's side: runs until killed.
#[test]
fn crash_child() {
    let (Ok(what), Ok(dir)) = (std::env::var(CHILD), std::env::var(DIR)) else { return };
    let dir = Path::new(&dir);
    let store = Store::builder()
        .host_backend()
        .capacity(Tier::Device, if what == "fsize" { 0 } else { 1 << 20 })
        .capacity(Tier::Pinned, if what == "fsize" { 0 } else { 1 << 20 })
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, 64 << 20)
        .disk_dir(dir.join("slab"))
        .build()
        .unwrap();
    match what.as_str() {
        "save" => {
            let mut ids = [Vec::new(), Vec::new()];
            for (v, ids) in ids.iter_mut().enumerate() {
                for (name, data) in version(v as u8 * 100) {
                    let id = store.put(&format!("{v}.{name}"), DType::U8, &[data.len()], &data);
                    ids.push((id.unwrap(), name));
                }
            }
            // Ready: the parent may kill from now on.
            println!("ready");
            for round in 0.. {
                store.save_safetensors_as(dir.join("model.safetensors"), &ids[round % 2]).unwrap();
            }
        }
        "spill" => {
            println!("ready");
            let mut ids = std::collections::VecDeque::new();
            for round in 0u64.. {
                let data = vec![round as u8; 128 << 10];
                ids.push_back(
                    store.put(&format!("t{round}"), DType::U8, &[data.len()], &data).unwrap(),
                );
                if ids.len() > 300 {
                    store.remove(ids.pop_front().unwrap()).unwrap();
                }
                if round % 7 == 0 {
                    let id = ids[round as usize % ids.len()];
                    let _ = store.read(id).unwrap();
                }
            }
        }
        "fsize" => {
            // A Disk-only tensor at [0, 16 MiB) of the slab, then a file-size limit of 24 MiB:
            // the write's new extent, [16, 32 MiB), is cut short halfway.
            let old = vec![7u8; 16 << 20];
            let t = store.put("t", DType::U8, &[old.len()], &old).unwrap();
            assert_eq!(store.info(t).unwrap().tiers, [Tier::Disk]);
            let limited = Command::new("prlimit")
                .args(["--pid", &std::process::id().to_string(), "--fsize=25165824:25165824"])
                .status()
                .is_ok_and(|s| s.success());
            if !limited {
                println!("no-prlimit");
                return;
            }
            let res = store.write(t, &vec![9u8; 16 << 20]);
            let back = store.read(t);
            let kept = back.as_ref().is_ok_and(|b| *b == old);
            println!("write: {res:?}; kept the old bytes: {kept}; read: {:?}", back.err());
        }
        "stale" => {
            // Temporary files of an earlier process that had this pid (a container's pid 1
            // after a kill), with the names this process's saves would take first.
            for n in 0..4 {
                let stale =
                    dir.join(format!(".m.safetensors.strata-{}-{n}.tmp", std::process::id()));
                std::fs::write(stale, b"an earlier run's save").unwrap();
            }
            let t = store.put("t", DType::U8, &[4], &[1, 2, 3, 4]).unwrap();
            let res = store.save_safetensors(dir.join("m.safetensors"), &[t]);
            println!("save: {:?}", res.map_err(|e| e.to_string()));
        }
        other => panic!("unknown child mode {other}"),
    }
}

fn spawn(what: &str, dir: &Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_child", "--nocapture", "--test-threads", "1"])
        .env(CHILD, what)
        .env(DIR, dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Waits for the child's "ready", lets it run `ms` more, then kills it with SIGKILL.
fn kill_after(mut child: Child, ms: u64) {
    use std::io::BufRead;
    let out = child.stdout.take().unwrap();
    let mut lines = std::io::BufReader::new(out).lines();
    loop {
        match lines.next() {
            Some(Ok(l)) if l.contains("ready") => break,
            Some(_) => {}
            None => panic!("the child ended before it was ready: {:?}", child.wait()),
        }
    }
    std::thread::sleep(Duration::from_millis(ms));
    child.kill().unwrap();
    child.wait().unwrap();
}

/// Files left in `dir` (recursively), but `keep`.
fn left(dir: &Path, keep: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if e.path().is_dir() {
            out.extend(left(&e.path(), keep).into_iter().map(|n| format!("{name}/{n}")));
        } else if !keep.contains(&name.as_str()) {
            out.push(name);
        }
    }
    out
}

#[test]
fn a_killed_save_leaves_the_old_file_or_the_new_one_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("model.safetensors");
    let mut rng = common::Rng::new(17);
    let mut seen = [0usize; 2];
    // A save killed in the microseconds between its link and its rename leaves its temporary
    // file; the next save (the next round's child) must remove it.
    let mut pending: Vec<String> = Vec::new();
    for round in 0..24 {
        kill_after(spawn("save", dir.path()), 5 + rng.below(120));
        let stray = left(dir.path(), &["model.safetensors"]);
        let still: Vec<&String> = stray.iter().filter(|s| pending.contains(s)).collect();
        assert!(still.is_empty(), "round {round}: a later save left {still:?}");
        pending = stray
            .iter()
            .filter(|s| s.starts_with(".model.safetensors.strata-") && s.ends_with(".tmp"))
            .cloned()
            .collect();
        let other: Vec<&String> = stray.iter().filter(|s| !pending.contains(s)).collect();
        assert!(other.is_empty(), "round {round}: left behind: {other:?}");
        if !target.exists() {
            continue; // killed before the first save completed
        }
        let store = Store::builder().host_backend().build().unwrap();
        let loaded = store
            .load_safetensors(&target, LoadOptions::default())
            .unwrap_or_else(|e| panic!("round {round}: the saved file is broken: {e}"));
        assert_eq!(loaded.len(), 8, "round {round}");
        let first = store.read(loaded[0].1).unwrap()[0];
        let v = if first == 0 { 0 } else { 100 };
        for ((name, id), (want_name, want)) in loaded.iter().zip(version(v)) {
            assert_eq!(name, &want_name, "round {round}");
            assert!(store.read(*id).unwrap() == want, "round {round}: {name} mixes versions");
        }
        seen[(v / 100) as usize] += 1;
    }
    println!("the saved file survived as version 0 {} times, version 1 {} times", seen[0], seen[1]);
    assert!(seen[0] + seen[1] > 0, "no save completed before a kill");
}

#[test]
fn a_killed_spilling_store_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = common::Rng::new(18);
    for round in 0..12 {
        kill_after(spawn("spill", dir.path()), 5 + rng.below(150));
        let stray = left(dir.path(), &[]);
        assert!(stray.is_empty(), "round {round}: left behind: {stray:?}");
    }
}

/// A write that fails partway (the file-size limit cuts the slab write short, then refuses it:
/// `EFBIG`) leaves the tensor's old bytes readable: the new bytes go to a new extent, and the
/// only good copy is never overwritten.
#[test]
fn a_write_cut_short_by_the_file_size_limit_keeps_the_old_bytes() {
    let dir = tempfile::tempdir().unwrap();
    // SIGXFSZ ignored (inherited through exec), so the limit gives EFBIG instead of a kill.
    let out = Command::new("sh")
        .arg("-c")
        .arg("trap '' XFSZ; exec \"$0\" --exact crash_child --nocapture --test-threads 1")
        .arg(std::env::current_exe().unwrap())
        .env(CHILD, "fsize")
        .env(DIR, dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    if stdout.contains("no-prlimit") {
        println!("SKIP a_write_cut_short_by_the_file_size_limit_keeps_the_old_bytes: no prlimit");
        return;
    }
    assert!(
        out.status.success(),
        "the child failed: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| l.find("write:").map(|i| &l[i..]))
        .unwrap_or_else(|| panic!("{stdout}"));
    assert!(line.contains("write: Err("), "the write should fail: {line}");
    assert!(line.contains("kept the old bytes: true"), "{line}");
}

/// A process whose pid repeats (a container's pid 1 after a kill) saves beside temporary files
/// that an earlier process with that pid left: the first save succeeds all the same.
#[test]
fn a_save_succeeds_beside_temporary_files_of_an_earlier_process_with_its_pid() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "crash_child", "--nocapture", "--test-threads", "1"])
        .env(CHILD, "stale")
        .env(DIR, dir.path())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("save: Ok(())"), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let store = Store::builder().host_backend().build().unwrap();
    let loaded = store.load_safetensors(dir.path().join("m.safetensors"), LoadOptions::default());
    assert_eq!(store.read(loaded.unwrap()[0].1).unwrap(), [1, 2, 3, 4]);
}
