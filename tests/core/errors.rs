//! Every error a caller can provoke, each with its variant and a check that nothing partial was
//! left behind (names free, stats unchanged, other tensors intact).

use crate::common;

use std::os::unix::fs::FileExt;

use common::{assert_budgets, random_bytes, tiers, used_per_tier, Backend};
use strata::{DType, Error, Store, TensorId, Tier};

fn store(backend: Backend) -> Store {
    backend
        .builder()
        .capacity(Tier::Device, 64 << 10)
        .capacity(Tier::Pinned, 64 << 10)
        .capacity(Tier::Mapped, 64 << 10)
        .capacity(Tier::Disk, 1 << 20)
        .build()
        .expect("build store")
}

fn store_with(backend: Backend, caps: [u64; 4]) -> Store {
    let mut b = backend.builder();
    for t in Tier::ALL {
        b = b.capacity(t, caps[t.index()]);
    }
    // Budgets here are exact arithmetic of the tensors put: no write reserve (tests/host/reliability.rs
    // checks the reserve).
    b.write_reserve(false).build().expect("build store")
}

/// Counters that a refused call must leave as they were.
#[derive(Debug, PartialEq)]
struct Snapshot {
    used: [u64; 4],
    tensors_per_tier: [usize; 4],
    tensors: usize,
    bytes_in: u64,
    ids: Vec<TensorId>,
}

fn snapshot(store: &Store) -> Snapshot {
    let s = store.stats();
    assert_budgets(&s, "snapshot");
    Snapshot {
        used: used_per_tier(store),
        tensors_per_tier: Tier::ALL.map(|t| s.tiers[t.index()].tensors),
        tensors: s.tensors,
        bytes_in: s.bytes_in,
        ids: store.ids(),
    }
}

fn err<T>(res: strata::Result<T>) -> Error {
    match res {
        Ok(_) => panic!("expected an error, got Ok"),
        Err(e) => e,
    }
}

/// An id that `store` never handed out (taken from another store).
fn foreign_id(backend: Backend, store: &Store) -> TensorId {
    let other = store_with(backend, [0, 0, 0, 1 << 20]);
    let mine = store.ids();
    (0..64)
        .map(|k| other.put(&format!("o{k}"), DType::U8, &[1], &[k as u8]).unwrap())
        .find(|id| !mine.contains(id))
        .expect("an id unknown to the store")
}

#[test]
fn put_with_wrong_data_length_is_length_mismatch() {
    common::each_backend("put_with_wrong_data_length_is_length_mismatch", |backend| {
        let store = store(backend);
        let keep = store.put("keep", DType::U8, &[10], &[7; 10]).unwrap();
        let before = snapshot(&store);
        for (dtype, shape, len) in [
            (DType::F32, vec![3, 37], 3 * 37 * 4 - 1),
            (DType::F32, vec![3, 37], 3 * 37 * 4 + 1),
            (DType::F64, vec![5], 5 * 4),
            (DType::Bool, vec![2, 2], 0),
            (DType::I16, vec![0], 2),
            (DType::U8, vec![], 2),
        ] {
            let e = err(store.put("bad", dtype, &shape, &vec![0u8; len]));
            let expected = (dtype.size_of() * shape.iter().product::<usize>()) as u64;
            assert!(
                matches!(e, Error::LengthMismatch { expected: x, got: g, .. } if x == expected && g == len as u64),
                "{dtype} {shape:?} with {len} bytes: {e:?}"
            );
            assert_eq!(store.lookup("bad"), None);
            assert_eq!(snapshot(&store), before, "a refused put changed the store");
        }
        assert_eq!(store.read(keep).unwrap(), vec![7; 10]);
        // The name is free.
        let id = store.put("bad", DType::F32, &[3, 37], &[1; 444]).unwrap();
        assert_eq!(store.read(id).unwrap(), vec![1; 444]);
    });
}

#[test]
fn write_with_wrong_data_length_is_length_mismatch_in_every_tier() {
    common::each_backend(
        "write_with_wrong_data_length_is_length_mismatch_in_every_tier",
        |backend| {
            let store = store(backend);
            let data = random_bytes(3 * 37 * 2, 1);
            let id = store.put("w", DType::F16, &[3, 37], &data).unwrap();
            for t in Tier::ALL {
                store.move_to(id, t).unwrap();
                let held = tiers(&store, id);
                let before = snapshot(&store);
                for len in [0, 1, data.len() - 1, data.len() + 1, 2 * data.len()] {
                    let e = err(store.write(id, &vec![0xAB; len]));
                    assert!(
                        matches!(e, Error::LengthMismatch { expected, got, .. } if expected == data.len() as u64 && got == len as u64),
                        "write of {len} bytes in {t}: {e:?}"
                    );
                }
                assert_eq!(snapshot(&store), before, "{t}: a refused write changed the store");
                assert_eq!(tiers(&store, id), held, "{t}: a refused write dropped replicas");
                assert_eq!(store.read(id).unwrap(), data, "{t}: contents after a refused write");
            }
        },
    );
}

#[test]
fn overflowing_shape_is_bad_shape() {
    common::each_backend("overflowing_shape_is_bad_shape", |backend| {
        let store = store(backend);
        let before = snapshot(&store);
        for (dtype, shape) in [
            (DType::F32, vec![usize::MAX, 2]),
            (DType::U8, vec![usize::MAX, usize::MAX]),
            (DType::F64, vec![1 << 40, 1 << 40]),
            (DType::I64, vec![usize::MAX]),
            (DType::U8, vec![1 << 32, 1 << 32]),
        ] {
            let e = err(store.put("big", dtype, &shape, &[0u8; 16]));
            assert!(
                matches!(&e, Error::BadShape { shape: s, .. } if *s == shape),
                "{dtype} {shape:?}: {e:?}"
            );
            assert_eq!(store.lookup("big"), None);
        }
        assert_eq!(snapshot(&store), before);
    });
}

#[test]
fn empty_name_is_invalid_argument() {
    common::each_backend("empty_name_is_invalid_argument", |backend| {
        let store = store(backend);
        let before = snapshot(&store);
        let e = err(store.put("", DType::U8, &[4], &[1, 2, 3, 4]));
        assert!(matches!(e, Error::InvalidArgument(_)), "{e:?}");
        assert_eq!(store.lookup(""), None);
        assert_eq!(snapshot(&store), before);
    });
}

#[test]
fn taken_name_is_duplicate_name_and_leaves_the_first_alone() {
    common::each_backend("taken_name_is_duplicate_name_and_leaves_the_first_alone", |backend| {
        let store = store(backend);
        let first = random_bytes(1000, 3);
        let id = store.put("dup", DType::U8, &[1000], &first).unwrap();
        store.move_to(id, Tier::Mapped).unwrap();
        let before = snapshot(&store);
        for (dtype, shape) in
            [(DType::U8, vec![1000]), (DType::F32, vec![7]), (DType::U8, vec![100_000])]
        {
            let len = dtype.size_of() * shape.iter().product::<usize>();
            let e = err(store.put("dup", dtype, &shape, &vec![9u8; len]));
            assert!(matches!(&e, Error::DuplicateName(n) if n == "dup"), "{e:?}");
        }
        assert_eq!(snapshot(&store), before);
        assert_eq!(store.lookup("dup"), Some(id));
        assert_eq!(tiers(&store, id), vec![Tier::Mapped]);
        assert_eq!(store.read(id).unwrap(), first);
        // After a remove the name is free again, under a new id.
        store.remove(id).unwrap();
        let again = store.put("dup", DType::U8, &[3], &[1, 2, 3]).unwrap();
        assert_ne!(again, id, "ids are never reused");
        assert_eq!(store.read(again).unwrap(), vec![1, 2, 3]);
    });
}

fn assert_unknown<T>(res: strata::Result<T>, id: TensorId, what: &str) {
    match res {
        Err(Error::UnknownId(got)) => assert_eq!(got, id, "{what}"),
        Err(e) => panic!("{what}: expected UnknownId, got {e:?}"),
        Ok(_) => panic!("{what}: expected UnknownId, got Ok"),
    }
}

fn assert_unknown_everywhere(store: &Store, id: TensorId) {
    assert_unknown(store.read(id), id, "read");
    assert_unknown(store.write(id, &[0; 4]), id, "write");
    assert_unknown(store.tier_of(id), id, "tier_of");
    assert_unknown(store.info(id), id, "info");
    assert_unknown(store.disk_location(id), id, "disk_location");
    for t in Tier::ALL {
        assert_unknown(store.move_to(id, t), id, "move_to");
    }
    let s = store.stream().unwrap();
    assert_unknown(store.device_view(id, &s), id, "device_view");
    assert_unknown(store.mapped_view(id, &s), id, "mapped_view");
    assert_unknown(store.remove(id), id, "remove");
}

#[test]
fn unknown_and_removed_ids_are_unknown_id() {
    common::each_backend("unknown_and_removed_ids_are_unknown_id", |backend| {
        let store = store(backend);
        let keep_data = random_bytes(4096, 5);
        let keep = store.put("keep", DType::U8, &[4096], &keep_data).unwrap();
        let gone = store.put("gone", DType::I32, &[4], &[1; 16]).unwrap();
        for t in Tier::ALL {
            // A removed tensor is unknown whichever tier it was in.
            let id = store
                .put(&format!("gone-{t}"), DType::U8, &[5000], &random_bytes(5000, 9))
                .unwrap();
            store.move_to(id, t).unwrap();
            store.remove(id).unwrap();
            assert_eq!(store.lookup(&format!("gone-{t}")), None);
            assert_unknown_everywhere(&store, id);
        }
        store.remove(gone).unwrap();
        assert_eq!(store.lookup("gone"), None);
        let before = snapshot(&store);
        assert_unknown_everywhere(&store, gone);
        let foreign = foreign_id(backend, &store);
        assert_unknown_everywhere(&store, foreign);
        assert_eq!(snapshot(&store), before);
        assert_eq!(store.ids(), vec![keep]);
        assert_eq!(store.read(keep).unwrap(), keep_data);
        let s = store.stats();
        assert_eq!(s.used(Tier::Disk) + s.used(Tier::Mapped) + s.used(Tier::Pinned), 0);
    });
}

#[test]
fn move_into_a_disabled_tier_is_tier_disabled() {
    common::each_backend("move_into_a_disabled_tier_is_tier_disabled", |backend| {
        for off in Tier::ALL {
            let mut caps = [64 << 10, 64 << 10, 64 << 10, 1 << 20];
            caps[off.index()] = 0;
            let store = store_with(backend, caps);
            assert_eq!(store.stats().capacity(off), 0);
            let data = random_bytes(3000, 11);
            let id = store.put("t", DType::U8, &[3000], &data).unwrap();
            let held = tiers(&store, id);
            assert!(!held.contains(&off));
            let before = snapshot(&store);
            let e = err(store.move_to(id, off));
            assert!(
                matches!(e, Error::TierDisabled { tier } if tier == off),
                "move_to({off}): {e:?}"
            );
            assert_eq!(snapshot(&store), before);
            assert_eq!(tiers(&store, id), held);
            assert_eq!(store.read(id).unwrap(), data);
            if off == Tier::Device {
                let s = store.stream().unwrap();
                let e = err(store.device_view(id, &s));
                assert!(
                    matches!(e, Error::TierDisabled { tier: Tier::Device }),
                    "device_view: {e:?}"
                );
            }
        }
    });
}

#[test]
fn every_tier_disabled_is_no_capacity() {
    common::each_backend("every_tier_disabled_is_no_capacity", |backend| {
        let mut b = backend.builder();
        for t in Tier::ALL {
            b = b.capacity(t, 0);
        }
        assert!(matches!(b.build(), Err(Error::NoCapacity)));
    });
}

/// A builder with small memory tiers (their budgets are reserved when the store is built).
fn small_mem(backend: Backend) -> strata::StoreBuilder {
    backend
        .builder()
        .capacity(Tier::Device, 64 << 10)
        .capacity(Tier::Pinned, 64 << 10)
        .capacity(Tier::Mapped, 64 << 10)
}

#[test]
fn unwritable_disk_dir_is_io() {
    common::each_backend("unwritable_disk_dir_is_io", |backend| {
        let file = tempfile::NamedTempFile::new().unwrap();
        let under_file = file.path().join("slabs");
        for dir in [under_file.clone(), file.path().to_path_buf()] {
            match small_mem(backend).capacity(Tier::Disk, 1 << 20).disk_dir(&dir).build() {
                Err(Error::Io { path, .. }) => {
                    assert!(path.starts_with(file.path()), "Io names {path:?}, not under {dir:?}")
                }
                Err(e) => panic!("disk_dir {dir:?}: expected Io, got {e:?}"),
                Ok(_) => panic!("disk_dir {dir:?}: a store was built"),
            }
        }
        assert!(std::fs::metadata(file.path()).unwrap().is_file());
        assert!(!under_file.exists());
        // Without a disk tier the directory is not used at all.
        let store = small_mem(backend).capacity(Tier::Disk, 0).disk_dir(&under_file).build();
        assert!(store.is_ok());
    });
}

/// Flips the byte at `k` of `id`'s copy in the disk slab file.
fn flip_on_disk(store: &Store, id: TensorId, k: u64) {
    let (path, offset) = store.disk_location(id).unwrap().expect("a copy on disk");
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset + k).unwrap();
    b[0] ^= 0x5A;
    f.write_all_at(&b, offset + k).unwrap();
    f.sync_all().unwrap();
}

fn assert_corrupt<T>(
    res: strata::Result<T>,
    id: TensorId,
    name: &str,
    path: &std::path::Path,
    what: &str,
) {
    match res {
        Err(Error::Corrupt { id: i, name: n, path: p, expected, found }) => {
            // The slab has no name of its own (it is unlinked): the error names its directory.
            assert_eq!((i, n.as_str()), (id, name), "{what}");
            assert!(p.starts_with(path), "{what}: {p:?} is not in {path:?}");
            assert_ne!(expected, found, "{what}");
        }
        Err(e) => panic!("{what}: expected Corrupt, got {e:?}"),
        Ok(_) => panic!("{what}: expected Corrupt, got Ok"),
    }
}

#[test]
fn flipped_byte_on_disk_is_corrupt() {
    common::each_backend("flipped_byte_on_disk_is_corrupt", |backend| {
        let dir = tempfile::tempdir().unwrap();
        let store = backend
            .builder()
            .capacity(Tier::Device, 64 << 10)
            .capacity(Tier::Pinned, 64 << 10)
            .capacity(Tier::Mapped, 64 << 10)
            .capacity(Tier::Disk, 1 << 20)
            .disk_dir(dir.path())
            .build()
            .unwrap();
        let (la, lb, lc) = (10_001usize, 8192usize, 4096usize);
        let (da, db, dc) = (random_bytes(la, 1), random_bytes(lb, 2), random_bytes(lc, 3));
        let a = store.put("a", DType::U8, &[la], &da).unwrap();
        let b = store.put("b", DType::U8, &[lb], &db).unwrap();
        let c = store.put("c", DType::U8, &[lc], &dc).unwrap();
        for id in [a, b, c] {
            assert_eq!(store.disk_location(id).unwrap(), None, "no disk copy before the move");
            store.move_to(id, Tier::Disk).unwrap();
            assert_eq!(tiers(&store, id), vec![Tier::Disk]);
        }
        // The slab is unlinked: nothing of the store's is in disk_dir, even while it lives.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "a file left in disk_dir");
        let path = dir.path().to_path_buf();
        // The last byte of a (odd length), the first of c.
        flip_on_disk(&store, a, la as u64 - 1);
        flip_on_disk(&store, c, 0);
        let before = snapshot(&store);
        assert_corrupt(store.read(a), a, "a", &path, "read a");
        assert_corrupt(store.read(c), c, "c", &path, "read c");
        // Other disk-resident tensors are fine.
        assert_eq!(store.read(b).unwrap(), db);
        assert_eq!(tiers(&store, b), vec![Tier::Device, Tier::Disk], "b promoted by its read");
        // Copies out of the corrupt replica fail and leave nothing behind.
        let before_a = snapshot(&store);
        for t in [Tier::Device, Tier::Pinned, Tier::Mapped] {
            assert_corrupt(store.move_to(a, t), a, "a", &path, &format!("move_to({t})"));
            assert_eq!(tiers(&store, a), vec![Tier::Disk], "after a failed move_to({t})");
        }
        let s = store.stream().unwrap();
        assert_corrupt(store.device_view(a, &s), a, "a", &path, "device_view");
        assert_eq!(tiers(&store, a), vec![Tier::Disk]);
        assert_eq!(
            snapshot(&store),
            before_a,
            "failed copies of a corrupt tensor changed the store"
        );
        assert_eq!(before.tensors, 3);
        // Moving it where it is needs no copy; removing frees it.
        store.move_to(a, Tier::Disk).unwrap();
        // A write replaces the corrupt bytes.
        let fresh = random_bytes(lc, 4);
        store.write(c, &fresh).unwrap();
        assert_eq!(store.read(c).unwrap(), fresh);
        store.remove(a).unwrap();
        assert_unknown(store.read(a), a, "read of removed a");
        assert_eq!(store.read(b).unwrap(), db);
        assert_budgets(&store.stats(), "corrupt");
    });
}

#[test]
fn removing_or_moving_under_a_device_view_is_busy() {
    common::each_backend("removing_or_moving_under_a_device_view_is_busy", |backend| {
        let store = store(backend);
        let data = random_bytes(5000, 8);
        let id = store.put("v", DType::U8, &[5000], &data).unwrap();
        store.move_to(id, Tier::Pinned).unwrap();
        let s = store.stream().unwrap();
        let view = store.device_view(id, &s).unwrap();
        assert_eq!(store.tier_of(id).unwrap(), Tier::Device);
        let before = snapshot(&store);
        let e = err(store.remove(id));
        assert!(matches!(e, Error::Busy { id: i, holders: 1 } if i == id), "remove: {e:?}");
        for t in [Tier::Pinned, Tier::Mapped, Tier::Disk] {
            let e = err(store.move_to(id, t));
            assert!(
                matches!(e, Error::Busy { id: i, holders: 1 } if i == id),
                "move_to({t}): {e:?}"
            );
        }
        // A second view: two holders.
        let view2 = store.device_view(id, &s).unwrap();
        let e = err(store.remove(id));
        assert!(matches!(e, Error::Busy { holders: 2, .. }), "{e:?}");
        drop(view2);
        assert_eq!(snapshot(&store), before, "refused calls changed the store");
        assert_eq!(store.lookup("v"), Some(id));
        // Where it already is, a move is fine.
        store.move_to(id, Tier::Device).unwrap();
        assert_eq!(store.read(id).unwrap(), data);
        drop(view);
        store.check_err().unwrap();
        store.move_to(id, Tier::Disk).unwrap();
        assert_eq!(tiers(&store, id), vec![Tier::Disk]);
        assert_eq!(store.read(id).unwrap(), data);
        store.remove(id).unwrap();
        assert_eq!(store.lookup("v"), None);
    });
}

#[test]
fn larger_than_every_tier_is_too_large() {
    common::each_backend("larger_than_every_tier_is_too_large", |backend| {
        let store = store_with(backend, [8 << 10, 16 << 10, 0, 32 << 10]);
        let small = store.put("small", DType::U8, &[100], &[3; 100]).unwrap();
        let before = snapshot(&store);
        let len = (32 << 10) + 1;
        let e = err(store.put("huge", DType::U8, &[len], &vec![0; len]));
        assert!(matches!(e, Error::TooLarge { bytes, .. } if bytes == len as u64), "{e:?}");
        assert_eq!(store.lookup("huge"), None);
        assert_eq!(snapshot(&store), before);
        // Into one tier too small for it: TooLarge, and it stays where it was.
        let len = 12 << 10;
        let data = random_bytes(len, 12);
        let mid = store.put("mid", DType::U8, &[len], &data).unwrap();
        let held = tiers(&store, mid);
        let before = snapshot(&store);
        let e = err(store.move_to(mid, Tier::Device));
        assert!(
            matches!(e, Error::TooLarge { bytes, .. } if bytes == len as u64),
            "move_to: {e:?}"
        );
        let s = store.stream().unwrap();
        let e = err(store.device_view(mid, &s));
        assert!(matches!(e, Error::TooLarge { .. }), "device_view: {e:?}");
        assert_eq!(snapshot(&store), before);
        assert_eq!(tiers(&store, mid), held);
        assert_eq!(store.read(mid).unwrap(), data);
        assert_eq!(store.read(small).unwrap(), vec![3; 100]);
        // The name is free: a smaller tensor of that name fits.
        let id = store.put("huge", DType::U8, &[10], &[1; 10]).unwrap();
        assert_eq!(store.read(id).unwrap(), vec![1; 10]);
    });
}

#[test]
fn no_room_anywhere_is_out_of_memory() {
    common::each_backend("no_room_anywhere_is_out_of_memory", |backend| {
        // Device and Pinned hold one 8 KiB tensor each; nothing slower to demote to.
        let store = store_with(backend, [8 << 10, 8 << 10, 0, 0]);
        let (da, db) = (random_bytes(8 << 10, 1), random_bytes(8 << 10, 2));
        let a = store.put("a", DType::U8, &[8 << 10], &da).unwrap();
        let b = store.put("b", DType::U8, &[8 << 10], &db).unwrap();
        assert_eq!(
            (store.tier_of(a).unwrap(), store.tier_of(b).unwrap()),
            (Tier::Device, Tier::Pinned)
        );
        let before = snapshot(&store);
        for len in [1usize, 4096, 8 << 10] {
            let e = err(store.put("c", DType::U8, &[len], &vec![5; len]));
            assert!(matches!(e, Error::OutOfMemory { .. }), "put of {len} bytes: {e:?}");
            if let Error::OutOfMemory { tier, bytes } = e {
                assert!(
                    matches!(tier, Tier::Device | Tier::Pinned),
                    "OutOfMemory names disabled tier {tier}"
                );
                assert_eq!(bytes, len as u64);
            }
            assert_eq!(store.lookup("c"), None, "a failed put left its name");
            assert_eq!(snapshot(&store), before, "a failed put changed the store");
        }
        assert_eq!(store.read(a).unwrap(), da);
        assert_eq!(store.read(b).unwrap(), db);
        assert_eq!(snapshot(&store).used, before.used);
        // Room again after a remove: the name is free.
        store.remove(b).unwrap();
        let c = store.put("c", DType::U8, &[4096], &[5; 4096]).unwrap();
        assert_eq!(store.read(c).unwrap(), vec![5; 4096]);
        assert_budgets(&store.stats(), "oom");
    });
}

#[test]
fn full_disk_only_store_is_out_of_memory() {
    common::each_backend("full_disk_only_store_is_out_of_memory", |backend| {
        let store = store_with(backend, [0, 0, 0, 16 << 10]);
        let a = store.put("a", DType::U8, &[12 << 10], &[1; 12 << 10]).unwrap();
        let before = snapshot(&store);
        let e = err(store.put("b", DType::U8, &[8 << 10], &[2; 8 << 10]));
        assert!(
            matches!(e, Error::OutOfMemory { tier: Tier::Disk, bytes } if bytes == 8 << 10),
            "{e:?}"
        );
        assert_eq!(store.lookup("b"), None);
        assert_eq!(snapshot(&store), before);
        assert_eq!(store.read(a).unwrap(), vec![1; 12 << 10]);
    });
}

#[test]
fn move_into_a_tier_full_of_held_tensors_is_out_of_memory() {
    common::each_backend("move_into_a_tier_full_of_held_tensors_is_out_of_memory", |backend| {
        let store = store_with(backend, [8 << 10, 64 << 10, 64 << 10, 1 << 20]);
        let s = store.stream().unwrap();
        let a = store.put("a", DType::U8, &[4096], &[1; 4096]).unwrap();
        let b = store.put("b", DType::U8, &[4096], &[2; 4096]).unwrap();
        let c = store.put("c", DType::U8, &[4096], &[3; 4096]).unwrap();
        assert_eq!(store.tier_of(c).unwrap(), Tier::Pinned);
        let va = store.device_view(a, &s).unwrap();
        let vb = store.device_view(b, &s).unwrap();
        let before = snapshot(&store);
        let e = err(store.move_to(c, Tier::Device));
        assert!(
            matches!(e, Error::OutOfMemory { tier: Tier::Device, bytes: 4096 }),
            "move_to: {e:?}"
        );
        let e = err(store.device_view(c, &s));
        assert!(matches!(e, Error::OutOfMemory { tier: Tier::Device, .. }), "device_view: {e:?}");
        assert_eq!(snapshot(&store), before);
        assert_eq!(tiers(&store, c), vec![Tier::Pinned]);
        drop((va, vb));
        store.check_err().unwrap();
        // Now the views are gone, room is made by demoting.
        store.move_to(c, Tier::Device).unwrap();
        assert_eq!(store.read(c).unwrap(), vec![3; 4096]);
        assert_eq!(store.read(a).unwrap(), vec![1; 4096]);
        assert_eq!(store.read(b).unwrap(), vec![2; 4096]);
        assert_budgets(&store.stats(), "held");
    });
}
