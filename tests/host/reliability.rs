//! Regression tests for what an adversarial user found: each would have failed before its fix.
//! (Fault injection at every failure site is `tests/faults.rs`; killed processes are
//! `tests/crash.rs`.)

use crate::common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::random_bytes;
use strata::{DType, Error, Policy, Store, TensorId, Tier, VictimKey};

/// A policy that breaks every promise it can without being unsafe: keys that change at random
/// between accesses, NaN scores, lookaheads naming removed, held and made-up tensors, and
/// admission that flips a coin. The store may order evictions badly with it, but must not
/// panic, evict a held tensor, or lose a byte.
struct Hostile {
    tick: AtomicU64,
    seen: Vec<TensorId>,
}

impl Policy for Hostile {
    fn name(&self) -> &'static str {
        "hostile"
    }
    fn on_insert(&mut self, id: TensorId, _bytes: u64) {
        self.seen.push(id);
    }
    fn on_access(&mut self, _id: TensorId) {}
    fn on_remove(&mut self, _id: TensorId) {}
    fn victim_key(&self, _tier: Tier, id: TensorId) -> VictimKey {
        let t = self.tick.fetch_add(1, Ordering::Relaxed);
        let score = if t % 7 == 0 { f64::NAN } else { (t * 2_654_435_761 % 1000) as f64 };
        VictimKey::new((t % 3) as u32, score, id.as_u64() ^ t)
    }
    fn epoch(&self) -> u64 {
        self.tick.load(Ordering::Relaxed) / 5
    }
    fn admit(&mut self, _tier: Tier, _candidate: TensorId, _victims: &[TensorId]) -> bool {
        self.tick.fetch_add(1, Ordering::Relaxed) % 2 == 0
    }
    fn lookahead(
        &mut self,
        _max_bytes: u64,
        _cost: &mut dyn FnMut(TensorId) -> Option<u64>,
        out: &mut Vec<TensorId>,
    ) {
        // Every tensor ever inserted, removed ones included, over any budget.
        out.extend(self.seen.iter().rev().take(8).copied());
    }
}

#[test]
fn a_policy_that_breaks_its_contract_cannot_make_the_store_panic_or_lose_a_byte() {
    common::watch_deadlocks();
    let store = Store::builder()
        .host_backend()
        .custom_policy(Box::new(Hostile { tick: AtomicU64::new(1), seen: Vec::new() }))
        .capacity(Tier::Device, 96 << 10)
        .capacity(Tier::Pinned, 64 << 10)
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, 2 << 20)
        .build()
        .unwrap();
    let s = store.stream().unwrap();
    let mut rng = common::Rng::new(6);
    let mut shadow: Vec<(TensorId, Vec<u8>)> = Vec::new();
    for step in 0..600 {
        match rng.below(6) {
            0 | 1 => {
                let data = random_bytes(1 + rng.below(24_000) as usize, step);
                if let Ok(id) = store.put(&format!("t{step}"), DType::U8, &[data.len()], &data) {
                    shadow.push((id, data));
                }
            }
            2 if !shadow.is_empty() => {
                let (id, data) = shadow[rng.below(shadow.len() as u64) as usize].clone();
                // A held tensor is never evicted, whatever the policy says: view it, then
                // put pressure on the device while the view lives.
                if let Ok(v) = store.device_view(id, &s) {
                    let other = random_bytes(20_000, step + 7);
                    if let Ok(p) = store.put(&format!("p{step}"), DType::U8, &[20_000], &other) {
                        shadow.push((p, other));
                    }
                    assert_eq!(store.tier_of(id).unwrap(), Tier::Device, "a held tensor left");
                    assert!(v.with_host_bytes(|b| b == &data[..]).unwrap());
                }
            }
            3 if !shadow.is_empty() => {
                let (id, _) = shadow[rng.below(shadow.len() as u64) as usize];
                let _ = store.prefetch(&[id]);
                let _ = store.move_to(id, Tier::ALL[rng.below(4) as usize]);
            }
            4 if !shadow.is_empty() => {
                let i = rng.below(shadow.len() as u64) as usize;
                store.remove(shadow[i].0).unwrap();
                shadow.swap_remove(i);
            }
            _ if !shadow.is_empty() => {
                let (id, data) = &shadow[rng.below(shadow.len() as u64) as usize];
                assert!(store.read(*id).unwrap() == *data, "step {step}: bytes lost");
            }
            _ => {}
        }
    }
    s.synchronize().unwrap();
    for (id, data) in &shadow {
        assert!(store.read(*id).unwrap() == *data);
    }
    store.check_err().unwrap();
}

#[test]
fn an_id_of_another_store_is_unknown() {
    let a = Store::builder().host_backend().build().unwrap();
    let b = Store::builder().host_backend().build().unwrap();
    let x = a.put("x", DType::U8, &[4], &[1, 2, 3, 4]).unwrap();
    let y = b.put("y", DType::U8, &[4], &[5, 6, 7, 8]).unwrap();
    // Both are the first tensor of their store.
    assert_eq!(x.as_u64(), y.as_u64());
    assert!(matches!(b.read(x), Err(Error::UnknownId(id)) if id == x));
    assert!(matches!(b.remove(x), Err(Error::UnknownId(_))));
    assert!(matches!(a.info(y), Err(Error::UnknownId(_))));
    assert_eq!(b.read(y).unwrap(), [5, 6, 7, 8]);
}

#[test]
fn empty_tensors_take_no_room() {
    let store = Store::builder()
        .host_backend()
        .capacity(Tier::Device, 4096)
        .capacity(Tier::Pinned, 0)
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, 0)
        .write_reserve(false) // the budget is exactly one 4 KiB tensor
        .build()
        .unwrap();
    let ids: Vec<_> =
        (0..1000).map(|i| store.put(&format!("e{i}"), DType::F32, &[0], &[]).unwrap()).collect();
    let full = store.put("full", DType::U8, &[4096], &[9; 4096]).unwrap();
    assert_eq!(store.stats().used(Tier::Device), 4096);
    let s = store.stream().unwrap();
    for &id in &ids {
        let v = store.device_view(id, &s).unwrap();
        assert_eq!(v.len_bytes(), 0);
        assert_eq!(store.read(id).unwrap(), Vec::<u8>::new());
    }
    assert_eq!(store.read(full).unwrap(), vec![9; 4096]);
}

#[test]
fn a_read_never_fails_because_its_promotion_did() {
    // The fastest tier holds one tensor that a view pins there: a read of another tensor misses
    // and its promotion cannot find room; the read still returns the bytes.
    let store = Arc::new(
        Store::builder()
            .host_backend()
            .policy(strata::PolicyKind::Lru)
            .capacity(Tier::Device, 8192)
            .capacity(Tier::Pinned, 0)
            .capacity(Tier::Mapped, 0)
            .capacity(Tier::Disk, 1 << 20)
            .build()
            .unwrap(),
    );
    let a = store.put("a", DType::U8, &[8192], &[1; 8192]).unwrap();
    let b = store.put("b", DType::U8, &[8192], &[2; 8192]).unwrap();
    assert_eq!(store.tier_of(b).unwrap(), Tier::Disk);
    let s = store.stream().unwrap();
    let v = store.device_view(a, &s).unwrap();
    assert_eq!(store.read(b).unwrap(), vec![2; 8192]);
    assert_eq!(store.tier_of(b).unwrap(), Tier::Disk, "no room: not promoted");
    drop(v);
    store.check_err().unwrap();
}

/// A budget reserved in pieces: the bytes of tensors in every piece read back, progress is
/// reported piece by piece, and a tensor larger than a piece is `TooLarge`, naming the pieces.
#[test]
fn a_budget_reserved_in_pieces_holds_tensors_in_every_piece() {
    let reports = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let r = reports.clone();
    let store = Store::builder()
        .host_backend()
        .capacity(Tier::Device, 0)
        .capacity(Tier::Pinned, 256 << 20)
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, 0)
        .reserve_in_pieces(64 << 20)
        .on_reserve(move |t, done, budget| r.lock().unwrap().push((t, done, budget)))
        .write_reserve(false) // every piece is filled to its tail
        .build()
        .unwrap();
    let want: Vec<_> = (1..=4).map(|i| (Tier::Pinned, i * (64 << 20), 256 << 20)).collect();
    assert_eq!(*reports.lock().unwrap(), want);
    assert_eq!(store.stats().capacity(Tier::Pinned), 256 << 20);

    // 60 MiB tensors: one per piece (a piece cannot hold two), all four fit.
    let ids: Vec<_> = (0..4u8)
        .map(|i| store.put(&format!("t{i}"), DType::U8, &[60 << 20], &vec![i; 60 << 20]).unwrap())
        .collect();
    // Small ones fill the pieces' tails.
    let small: Vec<_> = (0..4u8)
        .map(|i| {
            store.put(&format!("s{i}"), DType::U8, &[3 << 20], &vec![100 + i; 3 << 20]).unwrap()
        })
        .collect();
    for (i, id) in ids.iter().enumerate() {
        assert!(store.read(*id).unwrap().iter().all(|&b| b == i as u8), "t{i}");
    }
    for (i, id) in small.iter().enumerate() {
        assert!(store.read(*id).unwrap().iter().all(|&b| b == 100 + i as u8), "s{i}");
    }
    match store.put("big", DType::U8, &[65 << 20], &vec![0; 65 << 20]) {
        Err(Error::TooLarge { what, .. }) => assert!(what.contains("4 pieces"), "{what}"),
        other => panic!("a tensor larger than a piece: {other:?}"),
    }
}

/// A restarted process whose pid repeats (a container's pid 1 after `kill -9`) builds its store
/// beside whatever an earlier one left: the slab has no name to collide with, and the store
/// leaves other files in its directory alone.
#[test]
fn a_store_builds_beside_stale_files_and_adds_none() {
    let dir = tempfile::tempdir().unwrap();
    let stale = dir.path().join(format!("strata-{}-0.slab", std::process::id()));
    std::fs::write(&stale, b"an earlier run's slab").unwrap();
    for _ in 0..2 {
        let store = Store::builder().host_backend().disk_dir(dir.path()).build().unwrap();
        let id = store.put("x", DType::U8, &[4096], &[5; 4096]).unwrap();
        store.move_to(id, Tier::Disk).unwrap();
        assert_eq!(store.read(id).unwrap(), [5; 4096]);
        let names: Vec<_> =
            std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.path()).collect();
        assert_eq!(names, std::slice::from_ref(&stale), "the store named a file in its directory");
    }
    assert_eq!(std::fs::read(&stale).unwrap(), b"an earlier run's slab");
}

/// A user's host-backend "kernel" (`launch_host`) that panics does not stop its stream: work
/// queued behind it runs and the store's waits on the stream complete.
#[test]
fn a_panicking_host_kernel_does_not_hang_the_store() {
    let store = std::sync::Arc::new(Store::builder().host_backend().build().unwrap());
    let s = store.stream().unwrap();
    let id = store.put("x", DType::U8, &[4096], &[1; 4096]).unwrap();
    let v = store.device_view(id, &s).unwrap();
    s.launch_host(|| panic!("a kernel's fault (this panic is expected)")).unwrap();
    drop(v);
    let (tx, rx) = std::sync::mpsc::channel();
    let s2 = store.clone();
    std::thread::spawn(move || {
        let _ = tx.send(s2.read(id).map(|b| b[0]));
    });
    match rx.recv_timeout(std::time::Duration::from_secs(20)) {
        Ok(r) => assert_eq!(r.unwrap(), 1),
        Err(_) => panic!("a read after a panicking kernel hung"),
    }
    s.synchronize().unwrap();
}

/// A tensor the store accepted can always be overwritten, even when every tier is full: a
/// seeded run puts tensors of random sizes until the budgets refuse them, then mixes writes,
/// reads, moves, removes and more puts; every write of a tensor the store holds succeeds, and
/// every read returns the last bytes written. (Since a write puts its bytes in a second copy
/// before dropping the first, a full store refused writes: 576 `OutOfMemory` in 20,000
/// operations. The write reserve keeps room for that copy.)
#[test]
fn a_full_store_can_always_overwrite_its_tensors() {
    let mut rng = common::Rng::new(23);
    let store = Store::builder()
        .host_backend()
        .capacity(Tier::Device, 64 << 10)
        .capacity(Tier::Pinned, 64 << 10)
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, 256 << 10)
        .build()
        .unwrap();
    let mut shadow: Vec<(TensorId, Vec<u8>)> = Vec::new();
    let mut next = 0;
    let mut put = |store: &Store, rng: &mut common::Rng, shadow: &mut Vec<(TensorId, Vec<u8>)>| {
        let len = rng.range(1, 16 << 10) as usize;
        let data = rng.bytes(len);
        next += 1;
        match store.put(&format!("t{next}"), DType::U8, &[len], &data) {
            Ok(id) => shadow.push((id, data)),
            Err(e) => assert!(common::is_space_error(&e), "put: {e}"),
        }
    };
    // Fill: until ten puts in a row are refused.
    let mut refused = 0;
    while refused < 10 {
        let before = shadow.len();
        put(&store, &mut rng, &mut shadow);
        refused = if shadow.len() == before { refused + 1 } else { 0 };
    }
    let reserve: u64 = store.stats().tiers.iter().map(|t| t.write_reserve).sum();
    assert!(reserve > 0, "no write reserve kept");
    println!("full with {} tensors:\n{}", shadow.len(), store.stats());
    let (mut writes, mut ops) = (0, 0);
    for _ in 0..4000 {
        ops += 1;
        if shadow.is_empty() {
            put(&store, &mut rng, &mut shadow);
            continue;
        }
        let k = rng.below(shadow.len() as u64) as usize;
        match rng.below(10) {
            0..=4 => {
                let data = rng.bytes(shadow[k].1.len());
                store
                    .write(shadow[k].0, &data)
                    .unwrap_or_else(|e| panic!("op {ops}: a write in a full store failed: {e}"));
                shadow[k].1 = data;
                writes += 1;
            }
            5 | 6 => assert_eq!(store.read(shadow[k].0).unwrap(), shadow[k].1, "op {ops}"),
            7 => {
                let to = *rng.pick(&[Tier::Device, Tier::Pinned, Tier::Disk]);
                if let Err(e) = store.move_to(shadow[k].0, to) {
                    assert!(common::is_space_error(&e), "move: {e}");
                }
            }
            8 => {
                store.remove(shadow.swap_remove(k).0).unwrap();
            }
            _ => put(&store, &mut rng, &mut shadow),
        }
    }
    for (id, data) in &shadow {
        assert_eq!(&store.read(*id).unwrap(), data);
    }
    println!(
        "{writes} writes in a full store of {} tensors, {reserve} bytes reserved",
        shadow.len()
    );
}

/// A small file system for [`overwrites_succeed_on_a_full_file_system`]: a tmpfs mounted on a
/// temporary directory, unmounted when dropped. `None` where this process may not mount one
/// (it takes root).
struct SmallFs {
    dir: tempfile::TempDir,
}

impl SmallFs {
    fn mount(bytes: u64) -> Option<SmallFs> {
        let dir = tempfile::tempdir().ok()?;
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(dir.path())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(SmallFs { dir })
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(self.dir.path()).status();
    }
}

/// The write reserve is backed by the file system: with the Disk tier's directory on a 16 MiB
/// file system that other files then fill to the last byte, every overwrite of every tensor
/// the store holds (on the Device tier, in Pinned memory, on disk) succeeds and reads back.
/// Before the fix the reserve lived only in the books: once the slab's sparse file could not
/// grow, every overwrite whose second copy went to the Disk tier failed with `DiskFull` (issue
/// 31: 84 of 84). Needs a tmpfs mounted for it (root); elsewhere it says so and checks nothing.
#[test]
fn overwrites_succeed_on_a_full_file_system() {
    let Some(fs) = SmallFs::mount(16 << 20) else {
        eprintln!("skipped: no small file system (mounting a tmpfs needs root)");
        return;
    };
    let store = Store::builder()
        .host_backend()
        .capacity(Tier::Device, 512 << 10)
        .prefetch_budget(0)
        .capacity(Tier::Pinned, 512 << 10)
        .capacity(Tier::Mapped, 0)
        // More than the file system holds: the books think there is room.
        .capacity(Tier::Disk, 64 << 20)
        .disk_dir(fs.dir.path().join("slab"))
        .build()
        .unwrap();
    let mut rng = common::Rng::new(31);
    let mut tensors = Vec::new();
    let mut on = [0usize; 4];
    for i in 0.. {
        let n = (16 + rng.below(48) as usize) << 10;
        let tier = Tier::ALL[i % 3];
        let tier = if tier == Tier::Mapped { Tier::Disk } else { tier };
        let bytes = random_bytes(n, i as u64);
        match store.put_in(tier, &format!("t{i}"), strata::Group::Other, DType::U8, &[n], &bytes) {
            Ok(id) => {
                on[tier.index()] += 1;
                tensors.push((id, bytes));
            }
            Err(Error::OutOfMemory { .. }) if on[tier.index()] > 0 => {}
            Err(e) => panic!("put {i}: {e}"),
        }
        if tensors.len() >= 40 || i > 400 {
            break;
        }
    }
    assert!(on.iter().filter(|&&n| n > 0).count() == 3, "{on:?}");
    // Fill the file system.
    let mut filler = std::fs::File::create(fs.dir.path().join("filler")).unwrap();
    let chunk = vec![7u8; 64 << 10];
    loop {
        use std::io::Write;
        if filler.write_all(&chunk).and_then(|()| filler.flush()).is_err() {
            break;
        }
    }
    for k in 0..64u64 {
        if std::io::Write::write_all(&mut filler, &chunk[..(4096 >> (k % 12)).max(1)]).is_err() {
            break;
        }
    }
    let mut failed = Vec::new();
    for round in 0..300u64 {
        let i = rng.below(tensors.len() as u64) as usize;
        let (id, ref mut bytes) = tensors[i];
        let new = random_bytes(bytes.len(), 1000 + round);
        match store.write(id, &new) {
            Ok(()) => *bytes = new,
            Err(e) => failed.push(format!("write {round} of t{i} ({:?}): {e}", store.tier_of(id))),
        }
    }
    for (i, (id, bytes)) in tensors.iter().enumerate() {
        assert!(store.read(*id).unwrap() == *bytes, "t{i} lost its bytes");
    }
    assert!(failed.is_empty(), "{} of 300 overwrites failed:\n{}", failed.len(), failed.join("\n"));
}
