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

mod common;

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::Arc;

use strata::failpoint::{self, Fault, Site};
use strata::optim::{Algorithm, Engine, Optimizer, OptimizerConfig, Sgd};
use strata::{DType, Error, LoadOptions, Store, TensorId, Tier};

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
}

fn bytes(n: usize, seed: u8) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn build(dir: &Path) -> strata::Result<Arc<Store>> {
    Ok(Arc::new(
        Store::builder()
            .host_backend()
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

/// Checks every tensor of the shadow against the store (nothing armed); returns the names lost.
fn verify(store: &Store, sh: &Shadow, dir: &Path, run: &mut Run, ctx: &str) {
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
                v.with_host_bytes_mut(|b| b.copy_from_slice(&d))?;
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
                    if v.with_host_bytes(|b| b.to_vec())? != sh.tensors[n].1 {
                        return Err(Error::InvalidArgument(format!(
                            "a view of {n} saw other bytes"
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

/// One run of the workload on a fresh store; the shadow changes only when a step succeeds.
/// `after` runs after each step (the count run reads the sites' passes there).
fn workload(dir: &Path, mut after: impl FnMut(usize)) -> Run {
    let mut run = Run::default();
    let store = match build(dir) {
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
            Err(e) => run.errors.push(format!("{name}: {e}")),
        }
        // Errors of work that ran elsewhere (workers, drops) are the same fault's.
        while let Err(e) = store.check_err() {
            run.errors.push(format!("{name} (deferred): {e}"));
        }
        after(i);
        if failpoint::fired() {
            // The fault has fired: nothing is armed now. Every tensor must be intact.
            failpoint::disarm();
            drain(&store);
            verify(&store, &sh, dir, &mut run, name);
        }
        i += 1;
    }
    failpoint::disarm();
    drain(&store);
    verify(&store, &sh, dir, &mut run, "end");
    for (name, (id, _)) in std::mem::take(&mut sh.tensors) {
        store.remove(id).unwrap_or_else(|e| panic!("remove {name}: {e}"));
    }
    let stats = store.stats();
    for t in Tier::ALL {
        assert_eq!(
            stats.used(t),
            0,
            "{t} not empty after every tensor was removed ({:?}; errors {:?}):\n{stats}",
            store.ids().iter().map(|&i| store.info(i).map(|x| x.name)).collect::<Vec<_>>(),
            run.errors
        );
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

#[test]
fn every_fault_at_every_site_loses_nothing() {
    let _turn = ARMED.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    // Count the passes through each site.
    failpoint::count();
    let clean = workload(dir.path(), |_| {});
    let passes: Vec<(Site, u64)> = Site::ALL.iter().map(|&s| (s, failpoint::hits(s))).collect();
    failpoint::disarm();
    assert!(clean.errors.is_empty() && clean.lost.is_empty(), "the clean run failed: {clean:?}");
    let (mut tried, mut injected, mut checked, mut lost) = (0u64, 0u64, 0usize, Vec::new());
    let mut never = Vec::new();
    for &(site, n) in &passes {
        if n == 0 {
            never.push(site);
            continue;
        }
        for &fault in faults(site) {
            for k in 1..=n {
                tried += 1;
                let d = tempfile::tempdir().unwrap();
                failpoint::arm(site, k, fault);
                let run = workload(d.path(), |_| {});
                if !run.errors.is_empty() {
                    injected += 1;
                }
                checked += run.checked;
                lost.extend(run.lost.iter().map(|l| format!("{site:?} #{k} {fault:?}: {l}")));
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
        "fault injection: {sites} sites reached ({} passes), {tried} runs with one fault armed, \
         {injected} faults injected, {checked} tensors checked, {} tensors lost; sites the \
         workload does not reach: {never:?}",
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
