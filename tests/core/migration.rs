//! Migration: random data of every dtype through every ordered pair of tiers, byte for byte, on
//! each backend; a tensor larger than the 16 MiB staging buffers through the chunked paths;
//! writes in every tier.

use crate::common;

use common::{assert_budgets, random_bytes, tiers, Backend};
use strata::{DType, Store, TensorId, Tier};

/// Every ordered pair of tiers (self-pairs included) exactly once, as a walk: the cyclic de
/// Bruijn sequence B(4, 2) = 0010203112132233, closed with its first tier.
const TOUR: [usize; 17] = [0, 0, 1, 0, 2, 0, 3, 1, 1, 2, 1, 3, 2, 2, 3, 3, 0];

fn store(backend: Backend, mem: u64, disk: u64, promote: bool) -> Store {
    backend
        .builder()
        .capacity(Tier::Device, mem)
        .capacity(Tier::Pinned, mem)
        .capacity(Tier::Mapped, mem)
        .capacity(Tier::Disk, disk)
        .promote_on_read(promote)
        .build()
        .expect("build store")
}

fn shape_bytes(dtype: DType, shape: &[usize]) -> usize {
    dtype.bytes_for(shape).unwrap() as usize
}

/// `shape` with its innermost dimension rounded up to whole blocks of a quantized `dtype`
/// (as is for the others).
fn blocks_of(dtype: DType, shape: &[usize]) -> Vec<usize> {
    let mut s = shape.to_vec();
    if let (Some((elems, _)), Some(last)) = (dtype.block(), s.last_mut()) {
        *last = last.div_ceil(elems) * elems;
    }
    s
}

/// Moves `id` to `to` and checks the residency rules and the contents.
fn move_and_check(store: &Store, id: TensorId, to: Tier, want: &[u8], ctx: &str) {
    store.move_to(id, to).unwrap_or_else(|e| panic!("{ctx}: move_to({to}) failed: {e}"));
    assert_eq!(store.tier_of(id).unwrap(), to, "{ctx}: tier_of after move_to({to})");
    let held = tiers(store, id);
    assert_eq!(held.first(), Some(&to), "{ctx}: tiers {held:?} after move_to({to})");
    assert!(held.iter().all(|&t| t >= to), "{ctx}: a faster tier than {to} holds a copy: {held:?}");
    let got = store.read(id).unwrap_or_else(|e| panic!("{ctx}: read after move_to({to}): {e}"));
    assert!(got == want, "{ctx}: contents differ after move_to({to})");
    assert_budgets(&store.stats(), ctx);
}

#[test]
fn every_dtype_walks_every_ordered_tier_pair() {
    common::each_backend("every_dtype_walks_every_ordered_tier_pair", |backend| {
        let store = store(backend, 1 << 20, 4 << 20, false);
        let shapes: [&[usize]; 4] = [&[3, 37], &[1], &[4097], &[5, 7, 11]];
        let mut seed = 1;
        for dtype in DType::ALL {
            for shape in shapes {
                let shape = &blocks_of(dtype, shape)[..];
                seed += 1;
                let data = random_bytes(shape_bytes(dtype, shape), seed);
                let name = format!("{dtype}-{shape:?}");
                let id = store.put(&name, dtype, shape, &data).unwrap();
                let info = store.info(id).unwrap();
                assert_eq!((info.dtype, info.shape.as_slice()), (dtype, shape));
                assert_eq!(info.bytes as usize, data.len());
                assert_eq!(store.read(id).unwrap(), data, "{name}: right after put");
                for (step, w) in TOUR.windows(2).enumerate() {
                    let (from, to) = (Tier::ALL[w[0]], Tier::ALL[w[1]]);
                    let ctx = format!("{name}, step {step}: {from} -> {to}");
                    store.move_to(id, from).unwrap();
                    move_and_check(&store, id, to, &data, &ctx);
                }
                store.remove(id).unwrap();
            }
        }
        let s = store.stats();
        assert_eq!(s.tensors, 0);
        for t in Tier::ALL {
            assert_eq!(s.used(t), 0, "tier {t} still used after every tensor was removed");
        }
    });
}

/// For each ordered pair (a, b): make `a` the only copy (a write keeps only the replica it wrote),
/// then move to `b`, so that every copy path a -> b really runs.
fn pairs_from_single_copies(store: &Store, id: TensorId, len: usize, seed: u64, name: &str) {
    let mut seed = seed;
    for a in Tier::ALL {
        for b in Tier::ALL {
            seed += 1;
            let ctx = format!("{name}: {a} -> {b}");
            store.move_to(id, a).unwrap_or_else(|e| panic!("{ctx}: move_to({a}): {e}"));
            let data = random_bytes(len, seed);
            store.write(id, &data).unwrap_or_else(|e| panic!("{ctx}: write: {e}"));
            assert_eq!(tiers(store, id), vec![a], "{ctx}: a write keeps only the replica it wrote");
            let before = store.stats().moved(a, b);
            move_and_check(store, id, b, &data, &ctx);
            if a != b {
                let moved = store.stats().moved(a, b) - before;
                assert_eq!(moved, len as u64, "{ctx}: bytes counted as moved {a} -> {b}");
            } else {
                assert_eq!(tiers(store, id), vec![a], "{ctx}: move_to where it is copies nothing");
            }
        }
    }
}

#[test]
fn every_dtype_copies_along_every_tier_pair() {
    common::each_backend("every_dtype_copies_along_every_tier_pair", |backend| {
        let store = store(backend, 1 << 20, 4 << 20, false);
        for (k, dtype) in DType::ALL.into_iter().enumerate() {
            let shape = blocks_of(dtype, &[3, 37]);
            let len = shape_bytes(dtype, &shape);
            let data = random_bytes(len, 100 + k as u64);
            let name = format!("pairs-{dtype}");
            let id = store.put(&name, dtype, &shape, &data).unwrap();
            pairs_from_single_copies(&store, id, len, 1000 * k as u64, &name);
        }
    });
}

#[test]
fn write_then_read_in_each_tier() {
    common::each_backend("write_then_read_in_each_tier", |backend| {
        let store = store(backend, 1 << 20, 4 << 20, false);
        for dtype in DType::ALL {
            let shape = blocks_of(dtype, &[3, 37]);
            let len = shape_bytes(dtype, &shape);
            let id =
                store.put(&format!("w-{dtype}"), dtype, &shape, &random_bytes(len, 7)).unwrap();
            for (k, t) in Tier::ALL.into_iter().enumerate() {
                store.move_to(id, t).unwrap();
                let data = random_bytes(len, 50 + k as u64);
                store.write(id, &data).unwrap();
                assert_eq!(
                    store.tier_of(id).unwrap(),
                    t,
                    "{dtype}: a write does not move the tensor"
                );
                assert_eq!(tiers(&store, id), vec![t], "{dtype}: only the written replica is kept");
                assert_eq!(store.read(id).unwrap(), data, "{dtype}: read after write in {t}");
                // And the written bytes survive a trip through the other tiers.
                for u in Tier::ALL {
                    move_and_check(
                        &store,
                        id,
                        u,
                        &data,
                        &format!("{dtype}: written in {t}, moved"),
                    );
                }
            }
        }
    });
}

/// 20 MiB + 3 bytes: more than one 16 MiB staging buffer, not a multiple of the page size.
const BIG: usize = (20 << 20) + 3;

#[test]
fn tensor_larger_than_staging_buffers_moves_in_chunks() {
    common::each_backend("tensor_larger_than_staging_buffers_moves_in_chunks", |backend| {
        // The disk tier also keeps the write reserve: room for a second copy.
        let store = store(backend, 24 << 20, 48 << 20, false);
        let data = random_bytes(BIG, 4242);
        let id = store.put("big", DType::U8, &[BIG], &data).unwrap();
        assert_eq!(store.tier_of(id).unwrap(), Tier::Device);
        assert_eq!(store.read(id).unwrap(), data);
        // Device <-> Disk <-> Pinned <-> Mapped, each as the only copy before the move.
        let path = [
            Tier::Device,
            Tier::Disk,
            Tier::Pinned,
            Tier::Mapped,
            Tier::Pinned,
            Tier::Disk,
            Tier::Device,
            Tier::Mapped,
            Tier::Device,
            Tier::Pinned,
            Tier::Device,
        ];
        let mut cur = data;
        for (k, w) in path.windows(2).enumerate() {
            let (a, b) = (w[0], w[1]);
            assert_eq!(store.tier_of(id).unwrap(), a);
            if k % 2 == 1 {
                // Fresh bytes written into `a` so a stale copy elsewhere could not pass.
                cur = random_bytes(BIG, 9000 + k as u64);
                store.write(id, &cur).unwrap();
                assert_eq!(tiers(&store, id), vec![a]);
            }
            move_and_check(&store, id, b, &cur, &format!("big: {a} -> {b}"));
        }
        // And the tour over replicas that stay behind in slower tiers.
        for w in TOUR.windows(2) {
            let (a, b) = (Tier::ALL[w[0]], Tier::ALL[w[1]]);
            store.move_to(id, a).unwrap();
            move_and_check(&store, id, b, &cur, &format!("big tour: {a} -> {b}"));
        }
    });
}

#[test]
fn read_promotes_to_the_fastest_tier_unless_turned_off() {
    common::each_backend("read_promotes_to_the_fastest_tier_unless_turned_off", |backend| {
        for promote in [true, false] {
            let store = store(backend, 1 << 20, 4 << 20, promote);
            let data = random_bytes(3 * 37 * 4, 77);
            let id = store.put("p", DType::F32, &[3, 37], &data).unwrap();
            assert_eq!(
                store.tier_of(id).unwrap(),
                Tier::Device,
                "put goes to the fastest tier with room"
            );
            for t in [Tier::Pinned, Tier::Mapped, Tier::Disk] {
                store.move_to(id, t).unwrap();
                assert_eq!(tiers(&store, id), vec![t]);
                let before = store.stats();
                assert_eq!(store.read(id).unwrap(), data);
                let after = store.stats();
                assert_eq!(after.misses, before.misses + 1, "a read from {t} is a miss");
                if promote {
                    assert_eq!(store.tier_of(id).unwrap(), Tier::Device, "promoted from {t}");
                    assert_eq!(
                        tiers(&store, id),
                        vec![Tier::Device, t],
                        "promotion keeps the {t} copy"
                    );
                    assert_eq!(after.promotions, before.promotions + 1);
                    // Now a hit.
                    assert_eq!(store.read(id).unwrap(), data);
                    assert_eq!(store.stats().hits, after.hits + 1);
                } else {
                    assert_eq!(
                        tiers(&store, id),
                        vec![t],
                        "promote_on_read(false) keeps it in {t}"
                    );
                    assert_eq!(after.promotions, before.promotions);
                }
                assert_budgets(&store.stats(), "promotion");
            }
        }
    });
}

#[test]
fn empty_tensors_move_through_every_tier() {
    common::each_backend("empty_tensors_move_through_every_tier", |backend| {
        let store = store(backend, 1 << 20, 4 << 20, true);
        for (k, shape) in [&[0usize][..], &[3, 0], &[0, 5, 7]].into_iter().enumerate() {
            let id = store.put(&format!("empty{k}"), DType::F32, shape, &[]).unwrap();
            assert_eq!(store.info(id).unwrap().bytes, 0);
            assert_eq!(store.read(id).unwrap(), Vec::<u8>::new());
            for w in TOUR.windows(2) {
                let (a, b) = (Tier::ALL[w[0]], Tier::ALL[w[1]]);
                store.move_to(id, a).unwrap();
                store.write(id, &[]).unwrap();
                move_and_check(&store, id, b, &[], &format!("empty {shape:?}: {a} -> {b}"));
            }
            store.remove(id).unwrap();
        }
        let s = store.stats();
        for t in Tier::ALL {
            assert_eq!(s.used(t), 0, "{t} still used after removing the empty tensors");
        }
    });
}
