//! Fault injection at every failure site (`strata::failpoint`, feature `failpoints`):
//!
//! ```text
//! cargo test --features failpoints --test faults -- --nocapture
//! ```
//! A scripted workload (puts, writes, moves, views that write, prefetches, scopes, evictions
//! under pressure, saves, loads, an optimizer step, removes) runs once to count how often it
//! passes each site; then, for every site and every k up to that count, on a fresh store, the
//! k-th pass fails. After the failing operation, with nothing armed any more, every tensor must
//! read back its last successfully written bytes; the rest of the workload must run; the books
//! must agree (`Stats` against the tensors); and after every tensor is removed the tiers must be
//! empty again. The counts (sites × passes tried, faults injected, tensors checked, tensors lost:
//! the goal is 0) are printed for `docs/reliability.md`.
//!
//! Armed faults are global to a process: the tests sharing the harness's process take turns;
//! the long surveys each run in a child process of their own ([`runs_here`]), at once.

mod common;

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::Arc;

use common::Backend;
use strata::failpoint::{self, Fault, Site};
use strata::optim::{Algorithm, Engine, Optimizer, OptimizerConfig, Sgd};
use strata::{DType, DeviceView, Error, LoadOptions, Store, Stream, TensorId, Tier};

/// What the workload expects of the store: each tensor's name, id and last written bytes.
#[derive(Default)]
struct Shadow {
    tensors: BTreeMap<String, (TensorId, Vec<u8>)>,
    /// The tensors `saved.safetensors` must hold (by name), once a save succeeded: a failed save
    /// leaves the file as it was.
    file: Option<BTreeMap<String, Vec<u8>>>,
}

/// A change that replaces the expected contents of `saved.safetensors`.
const FILE: &str = "file:";

/// How one run went.
#[derive(Default, Debug)]
struct Run {
    /// Operations that returned an error (the injected fault, or a consequence of it).
    errors: Vec<String>,
    /// Tensors checked after the fault, and those that did not read back their bytes.
    checked: usize,
    lost: Vec<String>,
    /// Reads refused with an error while a sticky fault was armed.
    refused: usize,
    /// On CUDA, tensors held only in device memory when the store had declared the GPU failed
    /// (it refuses device work for good, so they cannot be read back: a GPU that failed for
    /// good has lost its memory too). On the host backend the device is host memory and this
    /// stays 0.
    unreachable: usize,
}

fn bytes(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// A cudarc error of `call` as the store's error type.
fn cuda(call: &'static str) -> impl Fn(strata::cudarc::driver::DriverError) -> Error {
    move |e| Error::Cuda { call, message: e.to_string() }
}

/// No cudarc view of a device view (`call`: the accessor that gave none).
fn no_view(call: &'static str) -> Error {
    Error::Cuda {
        call,
        message: "no cudarc view of the device view (Store::check_err says why)".into(),
    }
}

/// Writes `d` through a device view: in host memory on the host backend, by a copy on the
/// view's stream on CUDA (waited for: `d` is borrowed).
fn view_write(v: &mut DeviceView, s: &Stream, d: &[u8]) -> strata::Result<()> {
    let Some(cs) = s.cuda() else { return v.with_host_bytes_mut(|b| b.copy_from_slice(d)) };
    let mut dst = v.cuda_view_mut::<u8>().ok_or_else(|| no_view("cuda_view_mut"))?;
    cs.memcpy_htod(d, &mut dst).map_err(cuda("cuMemcpyHtoDAsync"))?;
    cs.synchronize().map_err(cuda("cuStreamSynchronize"))
}

/// The bytes a device view sees (see [`view_write`]).
fn view_read(v: &DeviceView, s: &Stream) -> strata::Result<Vec<u8>> {
    let Some(cs) = s.cuda() else { return v.with_host_bytes(|b| b.to_vec()) };
    let src = v.cuda_view::<u8>().ok_or_else(|| no_view("cuda_view"))?;
    let got = cs.clone_dtoh(&src).map_err(cuda("cuMemcpyDtoHAsync"))?;
    cs.synchronize().map_err(cuda("cuStreamSynchronize"))?;
    Ok(got)
}

fn build(dir: &Path, backend: Backend) -> strata::Result<Arc<Store>> {
    Ok(Arc::new(
        backend
            .builder()
            .capacity(Tier::Device, 64 << 10)
            .capacity(Tier::Pinned, 64 << 10)
            .capacity(Tier::Mapped, 32 << 10)
            .capacity(Tier::Disk, 1 << 20)
            .disk_dir(dir.join("slab"))
            .staging(2, 16 << 10)
            .prefetch_budget(32 << 10)
            .disk_workers(2)
            .build()?,
    ))
}

/// Checks every tensor of the shadow against the store; returns the names lost. With
/// `may_fail` (a fault still armed, or a backend declared failed), a read may fail with an
/// error, but one that succeeds must give the last bytes written.
fn verify(store: &Store, sh: &Shadow, dir: &Path, run: &mut Run, ctx: &str, may_fail: bool) {
    let path = dir.join("saved.safetensors");
    match (&sh.file, std::fs::read(&path)) {
        (None, Err(_)) => {}
        (None, Ok(_)) => run.lost.push(format!("{ctx}: a failed save left saved.safetensors")),
        (Some(_), Err(e)) => run.lost.push(format!("{ctx}: saved.safetensors is gone: {e}")),
        (Some(want), Ok(bytes)) => match safetensors::SafeTensors::deserialize(&bytes) {
            Err(e) => run.lost.push(format!("{ctx}: saved.safetensors is broken: {e}")),
            Ok(f) => {
                run.checked += 1;
                let got: BTreeMap<String, Vec<u8>> =
                    f.iter().map(|(n, v)| (n.to_string(), v.data().to_vec())).collect();
                if &got != want {
                    run.lost.push(format!("{ctx}: saved.safetensors holds other tensors"));
                }
            }
        },
    }
    for (name, (id, want)) in &sh.tensors {
        run.checked += 1;
        match store.read(*id) {
            Ok(got) if &got == want => {}
            Ok(_) => run.lost.push(format!("{ctx}: {name} holds other bytes")),
            // While a fault is armed: the backend's error, or an error it leads to.
            Err(
                Error::Cuda { .. }
                | Error::BackendFailed { .. }
                | Error::Io { .. }
                | Error::DiskFull { .. }
                | Error::OutOfMemory { .. },
            ) if may_fail => run.refused += 1,
            Err(Error::BackendFailed { .. })
                if store.backend() == strata::BackendKind::Cuda
                    && store.info(*id).is_ok_and(|i| i.tiers == [Tier::Device]) =>
            {
                run.unreachable += 1
            }
            Err(e) => run.lost.push(format!("{ctx}: {name} does not read: {e}")),
        }
    }
    let stats = store.stats();
    assert_eq!(stats.tensors, store.ids().len(), "{ctx}: Stats counts other tensors");
    for t in Tier::ALL {
        assert!(stats.used(t) <= stats.capacity(t), "{ctx}: {t} over its budget");
    }
}

/// The id of the shadow's tensor `name` (an error when an earlier failure left it out).
fn id(sh: &Shadow, name: &str) -> strata::Result<TensorId> {
    sh.tensors
        .get(name)
        .map(|t| t.0)
        .ok_or_else(|| Error::InvalidArgument(format!("{name} is not in the store")))
}

/// Writes new bytes (of `seed`) into `name`.
fn write(st: &Store, sh: &Shadow, name: &str, seed: u8) -> strata::Result<Change> {
    let (id, old) = sh
        .tensors
        .get(name)
        .cloned()
        .ok_or_else(|| Error::InvalidArgument(format!("{name} is not in the store")))?;
    let d = bytes(old.len(), seed);
    st.write(id, &d)?;
    Ok(vec![(name.into(), Some((id, d)))])
}

/// Puts `name` with `d`.
fn put(st: &Store, name: &str, d: Vec<u8>) -> strata::Result<Change> {
    let id = st.put(name, DType::U8, &[d.len()], &d)?;
    Ok(vec![(name.into(), Some((id, d)))])
}

/// The change of a successful save of `names`: the file holds their current bytes.
fn saved(sh: &Shadow, names: &[&str]) -> Change {
    let mut ch: Change = vec![(FILE.into(), None)];
    for n in names {
        ch.push((format!("{FILE}{n}"), sh.tensors.get(*n).cloned()));
    }
    ch
}

/// The shadow's changes after a step: a tensor's new id and bytes, or `None` when removed.
type Change = Vec<(String, Option<(TensorId, Vec<u8>)>)>;

/// The workload's steps, by number; `None` past the last.
fn step(
    i: usize,
    st: &Arc<Store>,
    sh: &Shadow,
    dir: &Path,
) -> Option<(&'static str, strata::Result<Change>)> {
    let run = |f: &dyn Fn() -> strata::Result<Change>| f();
    Some(match i {
        0..=2 => {
            let n = ["a", "b", "c"][i];
            ("put a, b, c on the device", put(st, n, bytes(20 << 10, i as u8)))
        }
        // Puts past the device's room: earlier tensors are evicted.
        3 => ("put d (evicts from the device)", put(st, "d", bytes(20 << 10, 3))),
        4 => (
            "put e into Pinned",
            run(&|| {
                let d = bytes(30 << 10, 4);
                let e =
                    st.put_in(Tier::Pinned, "e", strata::Group::Other, DType::U8, &[d.len()], &d)?;
                Ok(vec![("e".into(), Some((e, d)))])
            }),
        ),
        5 => (
            "put w (f32)",
            run(&|| {
                let w = f32s(&[1.0, 2.0, 3.0, 4.0]);
                let wid = st.put_group("w", strata::Group::Param, DType::F32, &[4], &w)?;
                Ok(vec![("w".into(), Some((wid, w)))])
            }),
        ),
        6 => ("write a", write(st, sh, "a", 10)),
        7 => (
            "move b to disk, c to mapped",
            run(&|| {
                st.move_to(id(sh, "b")?, Tier::Disk)?;
                st.move_to(id(sh, "c")?, Tier::Mapped)?;
                Ok(Change::new())
            }),
        ),
        8 => (
            "read b (promotes)",
            run(&|| {
                st.read(id(sh, "b")?)?;
                Ok(Change::new())
            }),
        ),
        9 => (
            "write d through a device view",
            run(&|| {
                let s = st.stream()?;
                let d = bytes(20 << 10, 11);
                let mut v = st.device_view(id(sh, "d")?, &s)?;
                view_write(&mut v, &s, &d)?;
                // The bytes are the tensor's once the (dirty) view drops, which cannot fail.
                drop(v);
                Ok(vec![("d".into(), Some((id(sh, "d")?, d)))])
            }),
        ),
        10 => (
            "move e to disk, write it there",
            run(&|| {
                st.move_to(id(sh, "e")?, Tier::Disk)?;
                write(st, sh, "e", 12)
            }),
        ),
        11 => (
            "prefetch b and c, view them",
            run(&|| {
                let s = st.stream()?;
                st.prefetch(&[id(sh, "b")?, id(sh, "c")?])?;
                for n in ["b", "c"] {
                    let v = st.device_view(id(sh, n)?, &s)?;
                    if view_read(&v, &s)? != sh.tensors[n].1 {
                        return Err(Error::InvalidArgument(format!(
                            "{WRONG} a view of {n} saw other bytes"
                        )));
                    }
                }
                Ok(Change::new())
            }),
        ),
        12 => (
            "layer scopes over every tensor",
            run(&|| {
                let s = st.stream()?;
                let ids: Vec<TensorId> = sh.tensors.values().map(|t| t.0).collect();
                for (k, &id) in ids.iter().enumerate() {
                    let next: Vec<TensorId> = ids.get(k + 1).copied().into_iter().collect();
                    let _scope = st.layer(&[id], &next)?;
                    drop(st.device_view(id, &s)?);
                }
                s.synchronize()?;
                Ok(Change::new())
            }),
        ),
        13 => (
            "release a, discard nothing",
            run(&|| {
                st.release(&[id(sh, "a")?])?;
                Ok(Change::new())
            }),
        ),
        14 => (
            "save a, b, c",
            run(&|| {
                let ids: Vec<TensorId> =
                    ["a", "b", "c"].iter().map(|n| id(sh, n)).collect::<strata::Result<_>>()?;
                st.save_safetensors(dir.join("saved.safetensors"), &ids)?;
                Ok(saved(sh, &["a", "b", "c"]))
            }),
        ),
        15 => (
            "load them back as L.*",
            run(&|| {
                let opts = LoadOptions { name_prefix: "L.".into(), ..LoadOptions::default() };
                let loaded = st.load_safetensors(dir.join("saved.safetensors"), opts)?;
                let mut ch = Change::new();
                for (name, id) in loaded {
                    let src = sh.tensors.get(&name["L.".len()..]).map(|t| t.1.clone());
                    // A tensor written after the save would differ: none is.
                    ch.push((name, src.map(|b| (id, b))));
                }
                Ok(ch)
            }),
        ),
        16 => (
            "copy L.* into Pinned, write L.b",
            run(&|| {
                st.move_to(id(sh, "L.a")?, Tier::Device)?;
                st.move_to(id(sh, "L.c")?, Tier::Pinned)?;
                write(st, sh, "L.b", 13)
            }),
        ),
        17 => (
            "an SGD step on the Cpu engine",
            run(&|| {
                let w = id(sh, "w")?;
                let s = st.stream()?;
                let cfg = OptimizerConfig::new(
                    Algorithm::Sgd(Sgd { lr: 0.5, weight_decay: 0.0 }),
                    Engine::Cpu,
                );
                let mut opt = Optimizer::new(st.clone(), &s, &[w], cfg)?;
                st.write(opt.grad(w)?, &f32s(&[2.0; 4]))?;
                opt.update(w)?;
                opt.finish()?;
                // SGD: w - 0.5 * 2.
                Ok(vec![("w".into(), Some((w, f32s(&[0.0, 1.0, 2.0, 3.0]))))])
            }),
        ),
        18 => (
            "remove c",
            run(&|| {
                st.remove(id(sh, "c")?)?;
                Ok(vec![("c".into(), None)])
            }),
        ),
        19 => ("put f", put(st, "f", bytes(8 << 10, 15))),
        20 => (
            "save a, f over the saved file",
            run(&|| {
                let ids = [id(sh, "a")?, id(sh, "f")?];
                st.save_safetensors(dir.join("saved.safetensors"), &ids)?;
                Ok(saved(sh, &["a", "f"]))
            }),
        ),
        _ => return None,
    })
}

/// How an armed fault behaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Its site fails once (`failpoint::arm`): afterwards nothing is armed, and every tensor
    /// must read back its last written bytes.
    Once,
    /// Its site fails from the k-th pass on (`failpoint::arm_from`: a GPU gone bad, memory
    /// that stays short): the rest of the workload runs with it armed. A read, a view or a save
    /// that succeeds must give the right bytes; one that fails must fail with an error.
    Sticky,
}

/// A wrong-bytes finding a step reports as its error (views compare what they see).
const WRONG: &str = "wrong bytes:";

/// One run of the workload on a fresh store; the shadow changes only when a step succeeds.
/// `after` runs after each step (the count run reads the sites' passes there).
fn workload(dir: &Path, backend: Backend, mode: Mode, mut after: impl FnMut(usize)) -> Run {
    let mut run = Run::default();
    let store = match build(dir, backend) {
        Ok(s) => s,
        Err(e) => {
            run.errors.push(format!("build: {e}"));
            return run;
        }
    };
    let mut sh = Shadow::default();
    let mut i = 0;
    loop {
        let res = std::panic::catch_unwind(AssertUnwindSafe(|| step(i, &store, &sh, dir)));
        let Some((name, res)) = res.unwrap_or_else(|_| panic!("step {i}: the store panicked"))
        else {
            break;
        };
        match res {
            Ok(changes) => {
                for (n, v) in changes {
                    if let Some(t) = n.strip_prefix(FILE) {
                        let file = sh.file.get_or_insert_default();
                        match (t, v) {
                            ("", _) => file.clear(),
                            (t, Some((_, b))) => drop(file.insert(t.into(), b)),
                            (_, None) => {}
                        }
                        continue;
                    }
                    match v {
                        Some(t) => sh.tensors.insert(n, t),
                        None => sh.tensors.remove(&n),
                    };
                }
            }
            Err(e) => {
                let e = e.to_string();
                if e.starts_with(WRONG) {
                    run.lost.push(format!("{name}: {e}"));
                }
                run.errors.push(format!("{name}: {e}"));
            }
        }
        // Errors of work that ran elsewhere (workers, drops) are the same fault's.
        while let Err(e) = store.check_err() {
            run.errors.push(format!("{name} (deferred): {e}"));
        }
        after(i);
        if failpoint::fired() {
            if mode == Mode::Once {
                // The fault has fired: nothing is armed now. Every tensor must be intact.
                failpoint::disarm();
                drain(&store);
                verify(&store, &sh, dir, &mut run, name, false);
            } else {
                // Still armed: what reads must be right, what fails is a typed error.
                verify(&store, &sh, dir, &mut run, name, true);
            }
        }
        i += 1;
    }
    let sticky = mode == Mode::Sticky;
    if sticky {
        verify(&store, &sh, dir, &mut run, "end, still armed", true);
    }
    failpoint::disarm();
    drain(&store);
    // With the fault gone every tensor reads back (a store that declared its backend failed
    // still reads what host memory and disk hold; on the host backend the device is host
    // memory too, on CUDA what only the device holds is `unreachable`).
    verify(&store, &sh, dir, &mut run, if sticky { "end, disarmed" } else { "end" }, false);
    for (name, (id, _)) in std::mem::take(&mut sh.tensors) {
        store.remove(id).unwrap_or_else(|e| panic!("remove {name}: {e}"));
    }
    // Memory whose last copy could not record its event is freed once a later record on its
    // stream completes: a few reaps (each `stats` reaps) after the work is done.
    let t0 = std::time::Instant::now();
    let mut stats = store.stats();
    while Tier::ALL.iter().any(|&t| stats.used(t) != 0)
        && t0.elapsed() < std::time::Duration::from_secs(2)
    {
        std::thread::sleep(std::time::Duration::from_millis(1));
        stats = store.stats();
    }
    for t in Tier::ALL {
        assert_eq!(
            stats.used(t),
            0,
            "{t} not empty after every tensor was removed ({:?}; errors {:?}):\n{stats}",
            store.ids().iter().map(|&i| store.info(i).map(|x| x.name)).collect::<Vec<_>>(),
            run.errors
        );
    }
    if sticky {
        // It drops cleanly: no hang, no panic.
        let dropped = std::thread::spawn(move || drop(store));
        let t = std::time::Instant::now();
        while !dropped.is_finished() {
            assert!(t.elapsed() < std::time::Duration::from_secs(20), "the store's drop hangs");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(dropped.join().is_ok(), "the store's drop panicked");
    }
    run
}

/// A run of the workload on its own thread, under a deadline: a store that hangs after a fault
/// (a flight never ended, a wait for work that cannot finish) fails the test, naming the run,
/// instead of hanging the suite.
fn watched(dir: &Path, backend: Backend, mode: Mode, what: &str) -> Run {
    if std::env::var_os("STRATA_FAULTS_VERBOSE").is_some() {
        eprintln!("run: {what}");
    }
    let dir = dir.to_path_buf();
    let h = std::thread::spawn(move || workload(&dir, backend, mode, |_| {}));
    let t = std::time::Instant::now();
    while !h.is_finished() {
        if t.elapsed() > std::time::Duration::from_secs(60) {
            failpoint::disarm();
            panic!("{what}: the run hangs (60 s)");
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let run = h.join().unwrap_or_else(|_| panic!("{what}: the run panicked"));
    if std::env::var_os("STRATA_FAULTS_VERBOSE").is_some() {
        for e in &run.errors {
            eprintln!("  error: {e}");
        }
    }
    run
}

/// Lets queued work finish and drops its errors.
fn drain(store: &Store) {
    if let Ok(s) = store.stream() {
        let _ = s.synchronize();
    }
    std::thread::sleep(std::time::Duration::from_millis(2));
    while store.check_err().is_err() {}
}

/// The fault each site fails with (a site may be tried with several).
fn faults(site: Site) -> &'static [Fault] {
    match site {
        Site::DiskWrite => &[Fault::NoSpace, Fault::Io],
        Site::DiskRead | Site::FileRead | Site::DiskOpen => &[Fault::Io],
        Site::SaveWrite | Site::SaveSync | Site::SaveRename => &[Fault::Io, Fault::NoSpace],
        Site::Alloc => &[Fault::OutOfMemory],
        _ => &[Fault::Backend],
    }
}

/// Armed faults are global to the process: the tests here take turns.
static ARMED: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The environment variable naming the test a child process of this binary runs alone.
const ALONE: &str = "STRATA_FAULTS_ALONE";

/// Whether the calling test `test` (its path in this binary, `trainer::...` for the trainer's)
/// is to run its body here: `true` in a child process made for it, where it runs alone; in the
/// test harness's process, runs this binary again for that one test (`--exact`, one thread),
/// prints the child's output, fails the test with it when the child failed, and returns `false`.
/// Armed faults are global to a process, so the tests sharing one take turns (`ARMED`); the long
/// surveys each in a process of their own run at once, one per test thread (most of their time
/// is spent waiting on copies and disk, not computing).
fn runs_here(test: &str) -> bool {
    if std::env::var(ALONE).is_ok_and(|t| t == test) {
        return true;
    }
    let exe = std::env::current_exe().expect("this test binary's path");
    let out = std::process::Command::new(exe)
        .args([test, "--exact", "--test-threads=1", "--nocapture"])
        .env(ALONE, test)
        .output()
        .expect("running this test binary again");
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    let ran = String::from_utf8_lossy(&out.stdout).contains("1 passed");
    assert!(out.status.success() && ran, "{test} in a process of its own: {}", out.status);
    false
}

#[test]
fn every_fault_at_every_site_loses_nothing() {
    if !runs_here("every_fault_at_every_site_loses_nothing") {
        return;
    }
    let _turn = ARMED.lock().unwrap_or_else(|e| e.into_inner());
    every_fault_at_every_site(Backend::Host);
}

/// The same on the CUDA backend (device 0), where a GPU is present: the sites are the backend's
/// calls (copies, event records, stream waits, host waits, allocations) as they reach the
/// driver. Prints a SKIP line without a GPU (fails instead with `STRATA_REQUIRE_GPU=1`).
#[test]
fn every_fault_at_every_site_loses_nothing_on_cuda() {
    // (Before the store below is built: a fault another test armed must not reach it.)
    let _turn = ARMED.lock().unwrap_or_else(|e| e.into_inner());
    let Some(_context) = cuda_or_skip("every_fault_at_every_site_loses_nothing_on_cuda") else {
        return;
    };
    every_fault_at_every_site(Backend::Cuda);
}

/// Where a GPU is present, a small CUDA store to hold for the whole test: it keeps the device's
/// primary context alive between the runs' stores (each run's store would otherwise create and
/// destroy it, a tenth of a second each). Without one, prints `SKIP <test>: no GPU (why)` and
/// returns `None`, or panics when `STRATA_REQUIRE_GPU=1`. Call it holding `ARMED`.
fn cuda_or_skip(test: &str) -> Option<Store> {
    let why = match strata::cuda_device_count() {
        Ok(n) if n > 0 => {
            let small = Backend::Cuda
                .builder()
                .capacity(Tier::Device, 4096)
                .capacity(Tier::Pinned, 4096)
                .capacity(Tier::Mapped, 0)
                .capacity(Tier::Disk, 0)
                .staging(1, 4096);
            return Some(small.build().unwrap());
        }
        Ok(_) => "the driver reports no CUDA device".to_string(),
        Err(why) => why,
    };
    assert!(
        std::env::var("STRATA_REQUIRE_GPU").map_or(true, |v| v != "1"),
        "{test}: no GPU ({why}), and STRATA_REQUIRE_GPU=1"
    );
    println!("SKIP {test}: no GPU ({why})");
    None
}

/// The callers hold `ARMED`.
fn every_fault_at_every_site(backend: Backend) {
    let dir = tempfile::tempdir().unwrap();
    // Count the passes through each site.
    if let Ok(us) = std::env::var("STRATA_FAULTS_SLOW_US") {
        failpoint::slow_copies(std::time::Duration::from_micros(us.parse().unwrap_or(0)));
    }
    failpoint::count();
    let clean = workload(dir.path(), backend, Mode::Once, |_| {});
    let passes: Vec<(Site, u64)> = Site::ALL.iter().map(|&s| (s, failpoint::hits(s))).collect();
    failpoint::disarm();
    assert!(clean.errors.is_empty() && clean.lost.is_empty(), "the clean run failed: {clean:?}");
    let (mut tried, mut injected, mut checked, mut lost) = (0u64, 0u64, 0usize, Vec::new());
    let (mut sticky_runs, mut refused, mut declared, mut unreachable) = (0u64, 0usize, 0usize, 0);
    let mut never = Vec::new();
    for &(site, n) in &passes {
        if n == 0 {
            never.push(site);
            continue;
        }
        for (&fault, mode) in faults(site).iter().flat_map(|f| [(f, Mode::Once), (f, Mode::Sticky)])
        {
            for k in 1..=n {
                // STRATA_FAULTS_ONLY="Site:k:Mode" reruns one run (as a hang or a loss names it); a prefix
                // ("Site:") reruns several.
                if let Ok(only) = std::env::var("STRATA_FAULTS_ONLY") {
                    if !format!("{site:?}:{k}:{mode:?}").starts_with(&only) {
                        continue;
                    }
                }
                tried += 1;
                let d = tempfile::tempdir().unwrap();
                match mode {
                    Mode::Once => failpoint::arm(site, k, fault),
                    Mode::Sticky => {
                        sticky_runs += 1;
                        failpoint::arm_from(site, k, fault)
                    }
                }
                let run =
                    watched(d.path(), backend, mode, &format!("{site:?} #{k} {fault:?} {mode:?}"));
                failpoint::disarm();
                if !run.errors.is_empty() {
                    injected += 1;
                }
                checked += run.checked;
                refused += run.refused;
                unreachable += run.unreachable;
                declared +=
                    run.errors.iter().any(|e| e.contains("the backend has failed")) as usize;
                lost.extend(
                    run.lost.iter().map(|l| format!("{site:?} #{k} {fault:?} {mode:?}: {l}")),
                );
                // Nothing of the run is left in its directory but the saved file.
                let left: Vec<String> = std::fs::read_dir(d.path())
                    .unwrap()
                    .chain(std::fs::read_dir(d.path().join("slab")).into_iter().flatten())
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n != "saved.safetensors" && n != "slab")
                    .collect();
                assert!(left.is_empty(), "{site:?} #{k}: files left behind: {left:?}");
            }
        }
    }
    let sites = passes.iter().filter(|p| p.1 > 0).count();
    println!(
        "fault injection ({}): {sites} sites reached ({} passes), {tried} runs with one fault \
         armed ({sticky_runs} of them sticky), {injected} faults injected, {checked} tensors \
         checked ({refused} reads refused with an error while a sticky fault was armed; \
         {declared} runs where the store declared its backend failed, {unreachable} tensors then \
         held only by the failed device), {} tensors lost or wrong; sites the workload does not \
         reach: {never:?}",
        backend.name(),
        passes.iter().map(|p| p.1).sum::<u64>(),
        lost.len()
    );
    assert!(lost.is_empty(), "tensors lost:\n{}", lost.join("\n"));
}

/// Pinned memory that the backend cannot give in one piece is reserved in smaller ones; where
/// no piece can be had at all, the build fails with `OutOfMemory` for the tier.
#[test]
fn a_budget_that_cannot_be_reserved_whole_is_reserved_in_pieces() {
    let _turn = ARMED.lock().unwrap_or_else(|e| e.into_inner());
    let build = || {
        Store::builder()
            .host_backend()
            .capacity(Tier::Device, 0)
            .capacity(Tier::Pinned, 256 << 20)
            .capacity(Tier::Mapped, 0)
            .capacity(Tier::Disk, 0)
            .write_reserve(false) // each piece is filled whole
            .build()
    };
    // The first allocation (the whole 256 MiB) fails: two pieces of 128 MiB.
    failpoint::arm(Site::Alloc, 1, Fault::OutOfMemory);
    let store = build().unwrap();
    assert!(failpoint::fired());
    failpoint::disarm();
    assert_eq!(store.stats().capacity(Tier::Pinned), 256 << 20);
    let a = store.put("a", DType::U8, &[128 << 20], &vec![1; 128 << 20]).unwrap();
    let b = store.put("b", DType::U8, &[128 << 20], &vec![2; 128 << 20]).unwrap();
    assert!(store.read(a).unwrap().iter().all(|&x| x == 1));
    assert!(store.read(b).unwrap().iter().all(|&x| x == 2));
    match store.put("c", DType::U8, &[129 << 20], &vec![0; 129 << 20]) {
        Err(Error::TooLarge { what, .. }) => assert!(what.contains("2 pieces"), "{what}"),
        other => panic!("a tensor larger than a piece: {other:?}"),
    }
    drop(store);

    // Every allocation fails: the build gives up at the smallest piece with OutOfMemory.
    failpoint::arm_from(Site::Alloc, 1, Fault::OutOfMemory);
    let err = build().err();
    let tries = failpoint::hits(Site::Alloc);
    failpoint::disarm();
    assert!(
        matches!(err, Some(Error::OutOfMemory { tier: Tier::Pinned, bytes }) if bytes == 256 << 20),
        "{err:?}"
    );
    assert_eq!(tries, 3, "256, 128 and 64 MiB tried");
}

/// A view's drop whose event cannot be recorded (the backend failed) keeps the tensor held, so
/// its device memory is neither evicted nor given to another tensor under the kernel still
/// queued; the next operation on the tensor records the event and releases it.
#[test]
fn a_view_drop_that_cannot_record_its_event_keeps_the_memory_from_reuse() {
    let _turn = ARMED.lock().unwrap_or_else(|e| e.into_inner());
    const N: usize = 64 << 10;
    let st = Store::builder()
        .host_backend()
        .capacity(Tier::Device, N as u64)
        .capacity(Tier::Pinned, 1 << 20)
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, 0)
        .build()
        .unwrap();
    let (a, s2) = (st.stream().unwrap(), st.stream().unwrap());
    let b = st.put("b", DType::U8, &[N], &vec![1u8; N]).unwrap();
    let c = st.put_in(Tier::Pinned, "c", strata::Group::Other, DType::U8, &[N], &[2u8; N]).unwrap();
    let mut v = st.device_view(b, &a).unwrap();
    v.mark_dirty();
    let (ptr, len) = (v.device_ptr() as usize, v.len_bytes());
    a.launch_host(move || {
        std::thread::sleep(std::time::Duration::from_millis(200));
        // SAFETY: on the host backend a device view's pointer is the host address of `len`
        // bytes the store keeps allocated until this stream's work is done: the rule under test
        // (if broken, the bytes checked below are wrong, the memory itself stays mapped).
        unsafe { std::ptr::write_bytes(ptr as *mut u8, 3, len) };
    })
    .unwrap();
    failpoint::arm(Site::EventRecord, 1, Fault::Backend);
    drop(v); // its event record fails
    failpoint::disarm();
    assert!(st.check_err().is_err(), "the failed record is reported");
    // c wants the device, which only b's memory could give: b is still held.
    assert!(matches!(st.device_view(c, &s2), Err(Error::OutOfMemory { .. })));
    // The next operation on b records the event (the backend works again) and releases it; its
    // reads wait for the kernel.
    assert_eq!(st.read(b).unwrap(), vec![3u8; N], "b lost its kernel's write");
    let vc = st.device_view(c, &s2).unwrap();
    drop(vc);
    s2.synchronize().unwrap();
    assert_eq!(st.read(c).unwrap(), vec![2u8; N], "c was overwritten by b's kernel");
    assert_eq!(st.read(b).unwrap(), vec![3u8; N]);
}

/// What one thread of the concurrent workload expects: its tensors' last bytes, and the bytes
/// its file holds after its last successful save.
#[derive(Default)]
struct Mine {
    tensors: BTreeMap<String, (TensorId, Vec<u8>)>,
    file: Option<BTreeMap<String, Vec<u8>>>,
    wrong: Vec<String>,
}

/// Thread `t`'s part of the concurrent workload: 120 random operations on its own tensors
/// (puts, writes, reads, moves, views that read or write, prefetches, scopes, saves, removes),
/// checking every byte it reads against what it wrote.
fn thread_ops(store: &Store, dir: &Path, t: usize, seed: u64) -> Mine {
    let mut rng = common::Rng::new(seed);
    let mut me = Mine::default();
    let s = match store.stream() {
        Ok(s) => s,
        Err(_) => return me,
    };
    let file = dir.join(format!("t{t}.safetensors"));
    for op in 0..120 {
        let names: Vec<String> = me.tensors.keys().cloned().collect();
        let pick = |rng: &mut common::Rng| {
            names.get(rng.below(names.len().max(1) as u64) as usize).cloned()
        };
        match rng.below(12) {
            0 | 1 => {
                let name = format!("t{t}-{op}");
                let len = rng.range(1, 12 << 10) as usize;
                let d = rng.bytes(len);
                if let Ok(id) = store.put(&name, DType::U8, &[d.len()], &d) {
                    me.tensors.insert(name, (id, d));
                }
            }
            2 | 3 => {
                let Some(n) = pick(&mut rng) else { continue };
                let (id, old) = me.tensors[&n].clone();
                let d = rng.bytes(old.len());
                if store.write(id, &d).is_ok() {
                    me.tensors.insert(n, (id, d));
                }
            }
            4 | 5 => {
                let Some(n) = pick(&mut rng) else { continue };
                let (id, want) = &me.tensors[&n];
                if let Ok(got) = store.read(*id) {
                    if &got != want {
                        me.wrong.push(format!("a read of {n} returned other bytes"));
                    }
                }
            }
            6 => {
                let Some(n) = pick(&mut rng) else { continue };
                let to = *rng.pick(&[Tier::Device, Tier::Pinned, Tier::Mapped, Tier::Disk]);
                let _ = store.move_to(me.tensors[&n].0, to);
            }
            7 => {
                let Some(n) = pick(&mut rng) else { continue };
                let (id, want) = me.tensors[&n].clone();
                let write = rng.chance(1, 2);
                let d = rng.bytes(want.len());
                let Ok(mut v) = store.device_view(id, &s) else { continue };
                if write {
                    if view_write(&mut v, &s, &d).is_ok() {
                        drop(v);
                        me.tensors.insert(n, (id, d));
                    }
                } else if let Ok(seen) = view_read(&v, &s) {
                    if seen != want {
                        me.wrong.push(format!("a view of {n} showed other bytes"));
                    }
                }
            }
            8 => {
                let ids: Vec<TensorId> = me.tensors.values().map(|x| x.0).take(4).collect();
                let _ = store.prefetch(&ids);
            }
            9 => {
                let Some(n) = pick(&mut rng) else { continue };
                if let Ok(scope) = store.layer(&[me.tensors[&n].0], &[]) {
                    let _ = store.device_view(me.tensors[&n].0, &s).map(drop);
                    drop(scope);
                }
            }
            10 => {
                let ids: Vec<TensorId> = me.tensors.values().map(|x| x.0).collect();
                if ids.is_empty() {
                    continue;
                }
                if store.save_safetensors(&file, &ids).is_ok() {
                    me.file =
                        Some(me.tensors.iter().map(|(n, (_, b))| (n.clone(), b.clone())).collect());
                }
            }
            _ => {
                let Some(n) = pick(&mut rng) else { continue };
                if store.remove(me.tensors[&n].0).is_ok() {
                    me.tensors.remove(&n);
                }
            }
        }
    }
    let _ = s.synchronize();
    me
}

/// Four threads run [`thread_ops`] on one store (`None` when the store cannot be built: the
/// fault hit the build).
fn concurrent_run(dir: &Path, backend: Backend, seed: u64) -> Option<(Arc<Store>, Vec<Mine>)> {
    let store = build(dir, backend).ok()?;
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let (st, d) = (store.clone(), dir.to_path_buf());
            std::thread::spawn(move || thread_ops(&st, &d, t, seed * 16 + t as u64))
        })
        .collect();
    let mine = handles.into_iter().map(|h| h.join().expect("a worker panicked")).collect();
    Some((store, mine))
}

/// Every site fails once while four threads share the store: whatever the interleaving, no
/// read, view or save returns or writes other bytes, and once the fault is gone every tensor
/// reads back its last written bytes and every file holds its thread's last successful save.
#[test]
fn a_fault_under_four_threads_returns_no_wrong_bytes() {
    if !runs_here("a_fault_under_four_threads_returns_no_wrong_bytes") {
        return;
    }
    let _turn = ARMED.lock().unwrap_or_else(|e| e.into_inner());
    a_fault_under_four_threads(Backend::Host);
}

/// The same on the CUDA backend, where a GPU is present (a SKIP line without one).
#[test]
fn a_fault_under_four_threads_returns_no_wrong_bytes_on_cuda() {
    let _turn = ARMED.lock().unwrap_or_else(|e| e.into_inner());
    let Some(_context) = cuda_or_skip("a_fault_under_four_threads_returns_no_wrong_bytes_on_cuda")
    else {
        return;
    };
    a_fault_under_four_threads(Backend::Cuda);
}

/// The callers hold `ARMED`.
fn a_fault_under_four_threads(backend: Backend) {
    // Eight interleavings a site (CI's minutes and the lease's two on the GPU machine);
    // `STRATA_FAULT_ROUNDS=N` runs more (20 a site on the host took 57 s on the 2-core VM).
    let rounds: u64 =
        std::env::var("STRATA_FAULT_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(8);
    let (mut runs, mut fired, mut checked, mut wrong) = (0u64, 0u64, 0usize, Vec::new());
    // Copies that take a while, as on a GPU: memory reused under a copy in flight shows.
    failpoint::slow_copies(std::time::Duration::from_micros(300));
    for (si, &site) in Site::ALL.iter().enumerate() {
        // How often a clean run passes the site (it varies with the threads' interleaving).
        let d = tempfile::tempdir().unwrap();
        failpoint::count();
        let _ = concurrent_run(d.path(), backend, 1);
        let passes = failpoint::hits(site);
        failpoint::disarm();
        if passes == 0 {
            continue;
        }
        for round in 0..rounds {
            runs += 1;
            let seed = 1000 + si as u64 * 100 + round;
            let k = 1 + common::Rng::new(seed).below(passes);
            let d = tempfile::tempdir().unwrap();
            failpoint::arm(site, k, faults(site)[0]);
            let Some((store, mine)) = concurrent_run(d.path(), backend, seed) else {
                failpoint::disarm();
                continue;
            };
            if failpoint::fired() {
                fired += 1;
            }
            failpoint::disarm();
            drain(&store);
            let ctx = format!("{site:?} #{k} (round {round})");
            for (t, m) in mine.iter().enumerate() {
                wrong.extend(m.wrong.iter().map(|w| format!("{ctx}, thread {t}: {w}")));
                for (n, (id, want)) in &m.tensors {
                    checked += 1;
                    match store.read(*id) {
                        Ok(got) if &got == want => {}
                        Ok(_) => wrong.push(format!("{ctx}: {n} holds other bytes")),
                        Err(e) => wrong.push(format!("{ctx}: {n} does not read: {e}")),
                    }
                }
                let path = d.path().join(format!("t{t}.safetensors"));
                if let (Some(want), Ok(bytes)) = (&m.file, std::fs::read(&path)) {
                    checked += 1;
                    let got: Option<BTreeMap<String, Vec<u8>>> =
                        safetensors::SafeTensors::deserialize(&bytes).ok().map(|f| {
                            f.iter().map(|(n, v)| (n.to_string(), v.data().to_vec())).collect()
                        });
                    if got.as_ref() != Some(want) {
                        wrong.push(format!("{ctx}: thread {t}'s saved file holds other bytes"));
                    }
                }
            }
        }
    }
    failpoint::slow_copies(std::time::Duration::ZERO);
    println!(
        "concurrent faults ({}): {runs} runs of 4 threads x 120 operations, one fault armed \
         each ({fired} fired), {checked} tensors and files checked, {} wrong or lost",
        backend.name(),
        wrong.len()
    );
    assert!(wrong.is_empty(), "wrong bytes:\n{}", wrong.join("\n"));
}

/// One optimizer run for [`a_failed_update_can_be_retried_to_the_clean_result`]: two f32
/// parameters, two steps; the second step's updates are made under `arm` (which arms a fault,
/// or nothing) and retried until the step finishes. Returns every parameter's and state
/// tensor's bytes, and whether the fault fired.
fn optim_run(
    engine: strata::optim::Engine,
    alg: Algorithm,
    state_tier: Option<Tier>,
    grads_on_device: bool,
    arm: &dyn Fn(),
) -> strata::Result<(Vec<Vec<u8>>, bool)> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let st = build(dir.path(), Backend::Host)?;
    let s = st.stream()?;
    let ws: Vec<TensorId> = (0..2)
        .map(|i| {
            let w = f32s(&(0..512).map(|k| (k as f32 * 0.01) - i as f32).collect::<Vec<_>>());
            st.put_group(&format!("w{i}"), strata::Group::Param, DType::F32, &[512], &w)
        })
        .collect::<strata::Result<_>>()?;
    let mut opt = Optimizer::new(st.clone(), &s, &ws, OptimizerConfig::new(alg, engine))?;
    if let Some(t) = state_tier {
        for id in opt.state_tensors() {
            st.move_to(id, t)?;
        }
    }
    let mut fired = false;
    for step in 0..2u8 {
        for (i, &w) in ws.iter().enumerate() {
            let g = f32s(
                &(0..512).map(|k| ((k + i) as f32).sin() * (step + 1) as f32).collect::<Vec<_>>(),
            );
            if grads_on_device {
                // As a trainer's backward writes them: the Cpu engine's update starts their
                // write-back.
                let mut v = st.device_view_for_overwrite(opt.grad(w)?, &s)?;
                common::view_write(&mut v, &g);
            } else {
                st.write(opt.grad(w)?, &g)?;
            }
        }
        if step == 1 {
            arm();
        }
        let mut tries = 0;
        loop {
            tries += 1;
            for w in opt.unstepped() {
                let r = opt.update(w);
                if std::env::var_os("STRATA_FAULTS_VERBOSE").is_some() {
                    eprintln!("  update {w} (try {tries}): {r:?}");
                }
            }
            let done = opt.finish();
            if std::env::var_os("STRATA_FAULTS_VERBOSE").is_some() {
                eprintln!("  finish (try {tries}): {done:?}");
            }
            if failpoint::fired() {
                fired = true;
                failpoint::disarm();
            }
            match done {
                Ok(()) => break,
                Err(_) if tries < 5 => continue,
                Err(e) => return Err(e),
            }
        }
    }
    // The step is over: nothing fails the reads below (and a count stops here).
    failpoint::disarm();
    let mut out = Vec::new();
    for &w in &ws {
        out.push(st.read(w)?);
    }
    for id in opt.state_tensors() {
        out.push(st.read(id)?);
    }
    Ok((out, fired))
}

/// A failed optimizer update can be retried: for every engine (the GPU ones emulated on the host
/// backend) with its state in every tier it can use, AdamW and SGD, a fault at each pass of each
/// site the second step's updates go through; the parameters left are updated again until the
/// step finishes, and every parameter and state tensor then equals a clean run's, bit for bit.
/// (A failure after the arithmetic, while the results were written back, left a parameter
/// half-stepped, and its retry stepped it again.)
#[test]
fn a_failed_update_can_be_retried_to_the_clean_result() {
    use strata::optim::{AdamW, Engine as E};
    let _turn = ARMED.lock().unwrap_or_else(|e| e.into_inner());
    let adamw =
        Algorithm::AdamW(AdamW { lr: 0.01, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.1 });
    let sgd = Algorithm::Sgd(Sgd { lr: 0.5, weight_decay: 0.01 });
    // (engine, where its state is moved, gradients written on the device)
    let cases: Vec<(E, Option<Tier>, bool)> = vec![
        (E::Cpu, None, false),
        (E::Cpu, None, true),
        (E::Cpu, Some(Tier::Device), false),
        (E::Cpu, Some(Tier::Mapped), false),
        (E::Cpu, Some(Tier::Disk), true),
        (E::GpuResident, None, false),
        (E::GpuResident, Some(Tier::Pinned), false),
        (E::GpuResident, Some(Tier::Disk), true),
        (E::GpuMapped, None, false),
    ];
    let sites = [
        Site::Copy,
        Site::HostCopy,
        Site::EventRecord,
        Site::StreamWait,
        Site::Synchronize,
        Site::DiskRead,
        Site::DiskWrite,
    ];
    let (mut runs, mut fired, mut differ) = (0u64, 0u64, Vec::new());
    for (engine, tier, on_dev) in cases {
        for alg in [adamw, sgd] {
            let clean = optim_run(engine, alg, tier, on_dev, &|| {})
                .unwrap_or_else(|e| panic!("{engine:?} {tier:?}: the clean run failed: {e}"));
            // How often the second step passes each site.
            let mut passes = Vec::new();
            let _ = optim_run(engine, alg, tier, on_dev, &|| failpoint::count());
            for &site in &sites {
                passes.push((site, failpoint::hits(site)));
            }
            for (site, n) in passes {
                for k in 1..=n.min(12) {
                    runs += 1;
                    let fault = faults(site)[0];
                    let ctx = format!("{engine:?}, state {tier:?}, grads on device {on_dev}, {alg:?}, {site:?} #{k}");
                    if let Ok(only) = std::env::var("STRATA_FAULTS_ONLY") {
                        if !ctx.starts_with(&only) {
                            continue;
                        }
                        eprintln!("run: {ctx}");
                    }
                    match optim_run(engine, alg, tier, on_dev, &|| failpoint::arm(site, k, fault)) {
                        Ok((state, f)) => {
                            fired += u64::from(f);
                            if state != clean.0 {
                                let which: Vec<usize> =
                                    (0..state.len()).filter(|&i| state[i] != clean.0[i]).collect();
                                differ.push(format!(
                                    "{ctx}: the retried step differs from a clean one (tensors \
                                     {which:?}: the parameters, then the state)"
                                ));
                            }
                        }
                        Err(e) => {
                            differ.push(format!("{ctx}: the step could not be finished: {e}"))
                        }
                    }
                    failpoint::disarm();
                }
            }
        }
    }
    println!(
        "optimizer retries: {runs} runs with a fault in the second step's updates ({fired} fired), \
         {} ended other than a clean step",
        differ.len()
    );
    assert!(differ.is_empty(), "{}", differ.join("\n"));
}

/// The tensors of parameter `name`'s backup for speculative updates, by the names
/// `Optimizer::reserve_backup` gives them.
fn backup_ids(st: &Store, name: &str) -> Vec<TensorId> {
    [".backup", ".master.backup", ".exp_avg.backup", ".exp_avg_sq.backup"]
        .iter()
        .filter_map(|s| st.lookup(&format!("{name}{s}")))
        .collect()
}

/// One speculative run for [`a_fault_in_the_middle_of_an_undo_leaves_it_to_undo_again`]: an f32
/// and a bf16 parameter (with its f32 master), AdamW; step 0 plain; step 1's updates
/// speculative, waited for, then undone under `arm` (a fault, a count, or nothing), the undo
/// called again until it succeeds (at most 5 times; while it has not, `finish` must refuse),
/// then the step redone clipped by 0.5. The optimizer's state lives in `state_tier` and the
/// backups in `backup_tier` (moved there). Returns the parameters' and state's bytes after
/// step 0, after the undo and after step 1, and whether the fault fired.
#[allow(clippy::type_complexity)]
fn undo_run(
    state_tier: Tier,
    backup_tier: Tier,
    arm: &dyn Fn(),
) -> strata::Result<([Vec<Vec<u8>>; 3], bool)> {
    use half::bf16;
    use strata::optim::AdamW;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let st = build(dir.path(), Backend::Host)?;
    let s = st.stream()?;
    let init: Vec<f32> = (0..512).map(|k| (k as f32 * 0.01).cos()).collect();
    let w0 = st.put_group("w0", strata::Group::Param, DType::F32, &[512], &f32s(&init))?;
    let halves: Vec<u8> =
        init.iter().flat_map(|&x| bf16::from_f32(x * 0.5).to_le_bytes()).collect();
    let w1 = st.put_group("w1", strata::Group::Param, DType::BF16, &[512], &halves)?;
    let ws = [w0, w1];
    let alg = Algorithm::AdamW(AdamW { lr: 0.01, weight_decay: 0.1, ..AdamW::default() });
    let mut cfg = OptimizerConfig::new(alg, Engine::Cpu);
    cfg.grad_dtype = Some(DType::F32);
    let mut opt = Optimizer::new(st.clone(), &s, &ws, cfg)?;
    for &w in &ws {
        assert!(opt.reserve_backup(w)?, "no room for {w}'s backup");
    }
    // Where the undo finds them (the updates' writes may have moved them back).
    let place = |opt: &Optimizer| -> strata::Result<()> {
        for id in opt.state_tensors() {
            st.move_to(id, state_tier)?;
        }
        for name in ["w0", "w1"] {
            for id in backup_ids(&st, name) {
                st.move_to(id, backup_tier)?;
            }
        }
        Ok(())
    };
    place(&opt)?;
    let state = |opt: &Optimizer| -> strata::Result<Vec<Vec<u8>>> {
        let mut out = Vec::new();
        for &w in &ws {
            out.push(st.read(w)?);
        }
        for id in opt.state_tensors() {
            out.push(st.read(id)?);
        }
        Ok(out)
    };
    let grads = |opt: &Optimizer, step: usize| -> strata::Result<()> {
        for (i, &w) in ws.iter().enumerate() {
            let g: Vec<f32> =
                (0..512).map(|k| ((k * (i + 2)) as f32).sin() * (step + 1) as f32).collect();
            st.write(opt.grad(w)?, &f32s(&g))?;
        }
        Ok(())
    };
    grads(&opt, 0)?;
    for &w in &ws {
        opt.update(w)?;
    }
    opt.finish()?;
    let first = state(&opt)?;
    grads(&opt, 1)?;
    for &w in &ws {
        opt.update_speculative(w)?;
    }
    // The updates are done (their backups whole) before the fault is armed: it hits the undo.
    opt.wait_pending(0)?;
    assert_eq!(opt.speculated(), 2);
    place(&opt)?;
    arm();
    let mut fired = false;
    let mut tries = 0;
    loop {
        tries += 1;
        let r = opt.undo_speculative();
        if failpoint::fired() {
            fired = true;
        }
        failpoint::disarm();
        match r {
            Ok(_) => break,
            Err(e) if tries < 5 => {
                // Not undone: the step cannot end with the updates half written back.
                assert!(opt.speculated() > 0, "an undo failed ({e}) yet nothing is left to undo");
                assert!(opt.finish().is_err(), "finish took a step whose undo failed ({e})");
            }
            Err(e) => return Err(e),
        }
    }
    assert_eq!((opt.speculated(), opt.unstepped().len()), (0, 2));
    let undone = state(&opt)?;
    for w in opt.unstepped() {
        opt.update_scaled(w, 0.5)?;
    }
    opt.finish()?;
    Ok(([first, undone, state(&opt)?], fired))
}

/// A fault at the first, middle and last pass of each site an undo of speculative updates goes
/// through (issue 41's backups), with the optimizer's state and the backups in host memory (an
/// undo there passes none) or on the Disk tier: the undo fails, leaving the updates to undo (and
/// `finish` refusing the step), and undone again the state is bit for bit what it was before
/// the step; redone clipped, the step is a clean one.
#[test]
fn a_fault_in_the_middle_of_an_undo_leaves_it_to_undo_again() {
    let _turn = ARMED.lock().unwrap_or_else(|e| e.into_inner());
    let sites = [Site::Copy, Site::HostCopy, Site::DiskRead, Site::DiskWrite];
    let (mut runs, mut fired, mut differ) = (0u64, 0u64, Vec::new());
    for (state_tier, backup_tier) in
        [(Tier::Pinned, Tier::Pinned), (Tier::Disk, Tier::Pinned), (Tier::Disk, Tier::Disk)]
    {
        let what = format!("state in {state_tier:?}, backups in {backup_tier:?}");
        let ([first, undone, clean], _) = undo_run(state_tier, backup_tier, &|| {})
            .unwrap_or_else(|e| panic!("{what}: the clean run failed: {e}"));
        assert!(undone == first, "{what}: the undo did not restore the state");
        let _ = undo_run(state_tier, backup_tier, &failpoint::count);
        let passes: Vec<(Site, u64)> = sites.iter().map(|&s| (s, failpoint::hits(s))).collect();
        failpoint::disarm();
        println!("{what}: an undo passes {passes:?}");
        for (site, n) in passes {
            // The first pass, the middle one and the last.
            let mut ks = vec![1, n.div_ceil(2), n];
            ks.dedup();
            for k in ks.into_iter().filter(|&k| (1..=n).contains(&k)) {
                runs += 1;
                let ctx = format!("{what}, {site:?} #{k}");
                match undo_run(state_tier, backup_tier, &|| {
                    failpoint::arm(site, k, faults(site)[0])
                }) {
                    Ok(([_, u, end], f)) => {
                        fired += u64::from(f);
                        if u != first {
                            differ.push(format!("{ctx}: undone, the state is not step 0's"));
                        }
                        if end != clean {
                            differ.push(format!("{ctx}: the step redone differs from a clean one"));
                        }
                    }
                    Err(e) => differ.push(format!("{ctx}: {e}")),
                }
                failpoint::disarm();
            }
        }
    }
    println!("undo under faults: {runs} runs ({fired} fired), {} wrong", differ.len());
    assert!(fired > 0, "no fault hit an undo");
    assert!(differ.is_empty(), "{}", differ.join("\n"));
}

/// A backend whose driver calls keep failing (a GPU gone bad) is declared failed after a few
/// failures in a row: device work is then refused at once with the first error, without
/// another call into the driver, and stays refused after the fault is gone; what host memory
/// holds still reads and saves.
#[test]
fn a_backend_that_keeps_failing_refuses_device_work_at_once() {
    let _turn = ARMED.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let st = Store::builder()
        .host_backend()
        .capacity(Tier::Device, 1 << 20)
        .capacity(Tier::Pinned, 1 << 20)
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, 0)
        .build()
        .unwrap();
    let s = st.stream().unwrap();
    let ids: Vec<_> = (0..6u8)
        .map(|i| {
            let name = format!("t{i}");
            st.put_in(Tier::Pinned, &name, strata::Group::Other, DType::U8, &[4096], &[i; 4096])
                .unwrap()
        })
        .collect();
    // A tensor with a copy on the device beside its Pinned one.
    let cached = st
        .put_in(Tier::Pinned, "cached", strata::Group::Other, DType::U8, &[4096], &[6; 4096])
        .unwrap();
    drop(st.device_view(cached, &s).unwrap());
    assert!(st.info(cached).unwrap().tiers.contains(&Tier::Device));
    failpoint::arm_from(Site::Copy, 1, Fault::Backend);
    for &id in &ids[..3] {
        let e = st.move_to(id, Tier::Device).unwrap_err();
        assert!(matches!(e, Error::Cuda { .. }), "{e}");
    }
    let tried = failpoint::hits(Site::Copy);
    let refused = |e: Error| {
        assert!(
            matches!(&e, Error::BackendFailed { first } if first.contains("injected backend failure")),
            "{e}"
        )
    };
    refused(st.move_to(ids[3], Tier::Device).unwrap_err());
    refused(st.device_view(ids[3], &s).map(drop).unwrap_err());
    refused(st.device_view_for_overwrite(ids[4], &s).map(drop).unwrap_err());
    refused(st.prefetch(&ids[3..5]).unwrap_err());
    refused(st.layer(&ids[3..4], &ids[4..5]).map(drop).unwrap_err());
    refused(st.pin(&ids[5..]).unwrap_err());
    refused(
        st.put_in(Tier::Device, "new", strata::Group::Other, DType::U8, &[16], &[9; 16])
            .unwrap_err(),
    );
    // Work that can do without the device does: a put finds a home in host memory, a write
    // of a tensor cached on the device puts its bytes there, reads promote nothing.
    let p = st.put("new", DType::U8, &[4096], &[8; 4096]).unwrap();
    assert_ne!(st.tier_of(p).unwrap(), Tier::Device);
    st.write(cached, &[9; 4096]).unwrap();
    assert_eq!(st.read(cached).unwrap(), vec![9u8; 4096]);
    assert_eq!(st.read(p).unwrap(), vec![8u8; 4096]);
    assert!(!st.info(p).unwrap().tiers.contains(&Tier::Device));
    assert_eq!(failpoint::hits(Site::Copy), tried, "a refused operation called the driver");
    failpoint::disarm();
    // Failed for good: the fault going away does not bring the device back.
    refused(st.move_to(ids[3], Tier::Device).unwrap_err());
    // Host memory still serves every tensor, and saves.
    for (i, &id) in ids.iter().enumerate() {
        assert_eq!(st.read(id).unwrap(), vec![i as u8; 4096]);
    }
    let path = dir.path().join("rescued.safetensors");
    st.save_safetensors(&path, &ids).unwrap();
    drop(st);
    let back = Store::builder().host_backend().build().unwrap();
    let loaded = back.load_safetensors(&path, LoadOptions::default()).unwrap();
    assert_eq!(loaded.len(), 6);
    for (name, id) in loaded {
        let i: u8 = name[1..].parse().unwrap();
        assert_eq!(back.read(id).unwrap(), vec![i; 4096]);
    }
}

/// The candle trainer under every failure site (with the `candle` feature too).
#[cfg(feature = "candle")]
#[path = "faults/train.rs"]
mod trainer;
