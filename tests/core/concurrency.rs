//! Eight threads of mixed operations on shared ids and names, over small budgets: no deadlock
//! (a watchdog fails the test after 60 s), no panic, and every read sees a value that was
//! written for that tensor. Each thread owns a set of names (only it puts, writes and removes
//! them); every thread reads, moves and views every tensor.
//!
//! A tensor's bytes are `[name index: u32][length: u32][fill byte...]`, so any reader can check
//! integrity without locks: the header names the tensor, the body is one fill byte, and the fill
//! byte is one its owner has written (a bit set in `written` before the write is issued).

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use common::{assert_budgets, is_space_error, Backend, Rng};
use strata::{DType, DeviceView, Error, Store, TensorId, Tier};

const THREADS: usize = 8;
const NAMES_PER_THREAD: usize = 4;
const NAMES: usize = THREADS * NAMES_PER_THREAD;
const OPS_PER_THREAD: usize = 40_000;
const WATCHDOG: Duration = Duration::from_secs(60);

fn name(idx: usize) -> String {
    format!("n{idx}")
}

/// Fixed size per name: 16 bytes .. 20 KiB.
fn size_of(idx: usize) -> usize {
    16 + (idx * 2749 + 311) % (20 << 10)
}

fn content(idx: usize, fill: u8) -> Vec<u8> {
    let len = size_of(idx);
    let mut v = vec![fill; len];
    v[..4].copy_from_slice(&(idx as u32).to_le_bytes());
    v[4..8].copy_from_slice(&(len as u32).to_le_bytes());
    v
}

struct Shared {
    store: Store,
    /// Per name, a bit per fill byte its owner ever wrote (set before the write).
    written: Vec<[AtomicU64; 4]>,
    /// Which name each id was put under (filled by the owner right after the put).
    id_names: Mutex<HashMap<TensorId, usize>>,
    reads_checked: AtomicUsize,
    ops: AtomicUsize,
    failed: AtomicBool,
}

impl Shared {
    fn mark_written(&self, idx: usize, fill: u8) {
        self.written[idx][fill as usize / 64].fetch_or(1 << (fill % 64), Ordering::SeqCst);
    }

    fn was_written(&self, idx: usize, fill: u8) -> bool {
        self.written[idx][fill as usize / 64].load(Ordering::SeqCst) & (1 << (fill % 64)) != 0
    }

    /// Checks bytes read (or seen through a view) for `id`.
    fn validate(&self, id: TensorId, bytes: &[u8], ctx: &str) {
        assert!(bytes.len() >= 16, "{ctx}: {id:?}: {} bytes", bytes.len());
        let idx = u32::from_le_bytes(bytes[..4].try_into().unwrap()) as usize;
        let len = u32::from_le_bytes(bytes[4..8].try_into().unwrap()) as usize;
        assert!(idx < NAMES, "{ctx}: {id:?}: header names tensor {idx}");
        assert_eq!((len, bytes.len()), (size_of(idx), size_of(idx)), "{ctx}: {id:?}: length");
        if let Some(&owner_idx) = self.id_names.lock().unwrap().get(&id) {
            assert_eq!(idx, owner_idx, "{ctx}: {id:?} holds the bytes of another tensor");
        }
        let fill = bytes[8];
        assert!(
            bytes[8..].iter().all(|&b| b == fill),
            "{ctx}: {id:?} ({}): torn contents",
            name(idx)
        );
        assert!(
            self.was_written(idx, fill),
            "{ctx}: {id:?}: fill {fill} was never written to {}",
            name(idx)
        );
        self.reads_checked.fetch_add(1, Ordering::Relaxed);
    }
}

/// Calls `f` with the bytes seen through a device view: in place on the host backend, copied to
/// the host on the view's stream on the CUDA backend (where the view is device memory).
fn read_view(v: &DeviceView, f: impl FnOnce(&[u8])) {
    let stream = v.stream();
    match (v.cuda_slice(), stream.cuda()) {
        (Some(slice), Some(cs)) => {
            let bytes = cs.clone_dtoh(slice).expect("copy a device view to the host");
            stream.synchronize().unwrap();
            f(&bytes);
        }
        _ => v.with_host_bytes(f).unwrap(),
    }
}

/// Writes `data` through a device view (which marks it dirty): in place on the host backend, a
/// host-to-device copy on the view's stream on the CUDA backend.
fn write_view(v: &mut DeviceView, data: &[u8]) {
    let stream = v.stream();
    match (v.cuda_view_mut::<u8>(), stream.cuda()) {
        (Some(mut slice), Some(cs)) => {
            cs.memcpy_htod(data, &mut slice).expect("copy into a device view");
            stream.synchronize().unwrap();
        }
        _ => v.with_host_bytes_mut(|b| b.copy_from_slice(data)).unwrap(),
    }
}

/// What one thread's names hold at the end: per owned name, its id and last written bytes.
type Owned = Vec<(usize, Option<(TensorId, u8)>)>;

fn worker(sh: &Shared, t: usize, seed: u64, deadline: Instant, views: bool) -> Owned {
    let store = &sh.store;
    let mut rng = Rng::new(seed);
    let mut own: Owned = (0..NAMES_PER_THREAD).map(|j| (t * NAMES_PER_THREAD + j, None)).collect();
    let mut version: u8 = 0;
    let stream = store.stream().unwrap();
    for op in 0..OPS_PER_THREAD {
        if Instant::now() >= deadline || sh.failed.load(Ordering::Relaxed) {
            break;
        }
        sh.ops.fetch_add(1, Ordering::Relaxed);
        let ctx = format!("thread {t} (seed {seed}), op {op}");
        let slot = rng.below(NAMES_PER_THREAD as u64) as usize;
        let idx = own[slot].0;
        match rng.below(100) {
            // Own put.
            0..=14 => {
                if own[slot].1.is_some() {
                    continue;
                }
                version = version.wrapping_add(1);
                sh.mark_written(idx, version);
                match store.put(&name(idx), DType::U8, &[size_of(idx)], &content(idx, version)) {
                    Ok(id) => {
                        sh.id_names.lock().unwrap().insert(id, idx);
                        own[slot].1 = Some((id, version));
                    }
                    Err(e) if is_space_error(&e) => {
                        assert_eq!(
                            store.lookup(&name(idx)),
                            None,
                            "{ctx}: failed put left its name"
                        );
                    }
                    Err(e) => panic!("{ctx}: put({}): {e}", name(idx)),
                }
            }
            // Own write, plain or through a device view.
            15..=29 => {
                let Some((id, _)) = own[slot].1 else { continue };
                version = version.wrapping_add(1);
                sh.mark_written(idx, version);
                let data = content(idx, version);
                if views && rng.chance(1, 3) {
                    match store.device_view(id, &stream) {
                        Ok(mut v) => {
                            write_view(&mut v, &data);
                            drop(v);
                            own[slot].1 = Some((id, version));
                        }
                        Err(e) if is_space_error(&e) => {}
                        Err(e) => panic!("{ctx}: device_view of own {id:?}: {e}"),
                    }
                    continue;
                }
                match store.write(id, &data) {
                    Ok(()) => own[slot].1 = Some((id, version)),
                    Err(Error::Busy { .. }) if views => {}
                    Err(e) => panic!("{ctx}: write({id:?}): {e}"),
                }
            }
            // Own remove.
            30..=37 => {
                let Some((id, _)) = own[slot].1 else { continue };
                match store.remove(id) {
                    Ok(()) => {
                        own[slot].1 = None;
                        assert_eq!(
                            store.lookup(&name(idx)),
                            None,
                            "{ctx}: name of a removed tensor"
                        );
                        assert!(
                            matches!(store.read(id), Err(Error::UnknownId(_))),
                            "{ctx}: removed id readable"
                        );
                    }
                    Err(Error::Busy { .. }) if views => {}
                    Err(e) => panic!("{ctx}: remove({id:?}): {e}"),
                }
            }
            // Own read: exactly the last value written.
            38..=49 => {
                let Some((id, fill)) = own[slot].1 else { continue };
                let got = store.read(id).unwrap_or_else(|e| panic!("{ctx}: read own {id:?}: {e}"));
                assert!(
                    got == content(idx, fill),
                    "{ctx}: own {} does not hold its last write",
                    name(idx)
                );
                sh.validate(id, &got, &ctx);
            }
            // Any read, of an id found by name or in the id list.
            50..=69 => {
                let id = if rng.chance(1, 2) {
                    store.lookup(&name(rng.below(NAMES as u64) as usize))
                } else {
                    let ids = store.ids();
                    (!ids.is_empty()).then(|| *rng.pick(&ids))
                };
                let Some(id) = id else { continue };
                if views && rng.chance(1, 3) {
                    match store.device_view(id, &stream) {
                        Ok(v) => {
                            read_view(&v, |b| sh.validate(id, b, &ctx));
                            drop(v);
                        }
                        Err(Error::UnknownId(_)) => {}
                        Err(e) if is_space_error(&e) => {}
                        Err(e) => panic!("{ctx}: device_view({id:?}): {e}"),
                    }
                    continue;
                }
                match store.read(id) {
                    Ok(b) => sh.validate(id, &b, &ctx),
                    Err(Error::UnknownId(_)) => {}
                    Err(e) => panic!("{ctx}: read({id:?}): {e}"),
                }
            }
            // Any move.
            70..=87 => {
                let ids = store.ids();
                if ids.is_empty() {
                    continue;
                }
                let id = *rng.pick(&ids);
                let to = *rng.pick(&Tier::ALL);
                match store.move_to(id, to) {
                    Ok(()) | Err(Error::UnknownId(_)) => {}
                    Err(Error::Busy { .. }) if views => {}
                    Err(e) if is_space_error(&e) => {}
                    Err(e) => panic!("{ctx}: move_to({id:?}, {to}): {e}"),
                }
            }
            // Lookups and metadata.
            88..=96 => {
                let other = rng.below(NAMES as u64) as usize;
                if let Some(id) = store.lookup(&name(other)) {
                    match store.info(id) {
                        Ok(info) => {
                            assert_eq!(info.name, name(other), "{ctx}: info of {id:?}");
                            assert_eq!(info.bytes as usize, size_of(other), "{ctx}");
                            assert!(!info.tiers.is_empty(), "{ctx}: {id:?} has no copy");
                        }
                        Err(Error::UnknownId(_)) => {}
                        Err(e) => panic!("{ctx}: info({id:?}): {e}"),
                    }
                    match store.tier_of(id) {
                        Ok(_) | Err(Error::UnknownId(_)) => {}
                        Err(e) => panic!("{ctx}: tier_of({id:?}): {e}"),
                    }
                }
                let mine = store.lookup(&name(idx));
                assert_eq!(mine, own[slot].1.map(|o| o.0), "{ctx}: lookup of own {}", name(idx));
            }
            _ => assert_budgets(&store.stats(), &ctx),
        }
    }
    store.check_err().unwrap();
    own
}

fn run(backend: Backend, views: bool, seconds: f64, seed: u64) {
    let store = backend
        .builder()
        .capacity(Tier::Device, 64 << 10)
        .capacity(Tier::Pinned, 64 << 10)
        .capacity(Tier::Mapped, 64 << 10)
        .capacity(Tier::Disk, 1 << 20)
        .build()
        .expect("build store");
    let sh = Arc::new(Shared {
        store,
        written: (0..NAMES).map(|_| Default::default()).collect(),
        id_names: Mutex::new(HashMap::new()),
        reads_checked: AtomicUsize::new(0),
        ops: AtomicUsize::new(0),
        failed: AtomicBool::new(false),
    });
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let sh = sh.clone();
            let seed = seed * 1000 + t as u64;
            std::thread::spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    worker(&sh, t, seed, deadline, views)
                }));
                if r.is_err() {
                    sh.failed.store(true, Ordering::Relaxed);
                }
                r
            })
        })
        .collect();
    let mut owned = Vec::new();
    let mut panic = None;
    for h in handles {
        match h.join().expect("worker thread") {
            Ok(o) => owned.extend(o),
            Err(p) => panic = panic.or(Some(p)),
        }
    }
    if let Some(p) = panic {
        std::panic::resume_unwind(p);
    }
    // Every tensor reads back its last written value; names and counts agree.
    let store = &sh.store;
    store.check_err().unwrap();
    let mut present = Vec::new();
    for (idx, state) in owned {
        assert_eq!(store.lookup(&name(idx)), state.map(|s| s.0), "end: lookup({})", name(idx));
        if let Some((id, fill)) = state {
            assert_eq!(
                store.read(id).unwrap(),
                content(idx, fill),
                "end: {} holds its last write",
                name(idx)
            );
            present.push(id);
        }
    }
    present.sort();
    assert_eq!(store.ids(), present, "end: ids()");
    let stats = store.stats();
    assert_eq!(stats.tensors, present.len());
    assert_budgets(&stats, "end");
    let ops = sh.ops.load(Ordering::Relaxed);
    eprintln!(
        "{}, views {views}: {ops} operations, {} reads checked, {} tensors at the end, {} evictions",
        backend.name(),
        sh.reads_checked.load(Ordering::Relaxed),
        present.len(),
        stats.evictions
    );
    assert!(ops >= THREADS * 100, "only {ops} operations ran");
    for id in present {
        store.remove(id).unwrap();
    }
    // A removed tensor's memory is freed once the work still touching it has run (an upload a
    // read's promotion issued, a demotion): under load some may still be queued.
    let early = store.stats();
    store.wait_for_copies().unwrap();
    let stats = store.stats();
    for t in Tier::ALL {
        if early.used(t) != 0 {
            eprintln!("end: {t} held {} bytes for copies still in flight", early.used(t));
        }
        assert_eq!(stats.used(t), 0, "end: {t} still used after removing everything");
    }
}

/// [`run`] many times over, for races too rare for one run: `STRATA_STRESS_RUNS` runs (10) of
/// `STRATA_STRESS_SECONDS` (1) each from seed `STRATA_STRESS_SEED` (100) on, every host copy
/// taking `STRATA_STRESS_SLOW_US` µs (0) more ([`strata::failpoint::slow_copies`]), e.g.
/// `STRATA_STRESS_RUNS=50 STRATA_STRESS_SLOW_US=300 cargo test --features text,failpoints
/// --test core concurrency::many_runs -- --ignored --nocapture`.
#[cfg(feature = "failpoints")]
#[test]
#[ignore = "minutes; run by hand when hunting a race"]
fn many_runs_of_mixed_operations_from_8_threads() {
    let var = |name: &str, default: f64| {
        std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
    };
    let runs = var("STRATA_STRESS_RUNS", 10.0) as u64;
    let seconds = var("STRATA_STRESS_SECONDS", 1.0);
    let seed = var("STRATA_STRESS_SEED", 100.0) as u64;
    let slow = Duration::from_micros(var("STRATA_STRESS_SLOW_US", 0.0) as u64);
    strata::failpoint::slow_copies(slow);
    for i in 0..runs {
        run(Backend::Host, i % 2 == 1, seconds, seed + i);
    }
    strata::failpoint::slow_copies(Duration::ZERO);
}

/// Runs `f` on a thread and fails if it is not done within the watchdog's time.
fn with_watchdog(f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        f();
        let _ = tx.send(());
    });
    match rx.recv_timeout(WATCHDOG) {
        Ok(()) => h.join().unwrap(),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(p) = h.join() {
                std::panic::resume_unwind(p);
            }
        }
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("deadlock: not done within {WATCHDOG:?}"),
    }
}

#[test]
fn mixed_operations_from_8_threads() {
    common::each_backend("mixed_operations_from_8_threads", |backend| {
        with_watchdog(move || run(backend, false, 2.0, 1));
    });
}

#[test]
fn mixed_operations_with_device_views_from_8_threads() {
    common::each_backend("mixed_operations_with_device_views_from_8_threads", |backend| {
        with_watchdog(move || run(backend, true, 1.0, 2));
    });
}
