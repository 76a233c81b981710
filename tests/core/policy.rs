//! Eviction order of the built-in policies, seen through the store on crafted access patterns.
//!
//! The Device tier holds exactly two tensors of 4 KiB (capacity 8 KiB).
//! `put` places a tensor in the fastest tier with free room, so the first two go to Device and
//! the rest to Pinned; a read that misses Device promotes (when the policy admits it), demoting
//! Device victims in the policy's order.

use crate::common;

use common::{assert_budgets, random_bytes, Backend};
use strata::{DType, PolicyKind, Store, TensorId, Tier};

const T: usize = 4096;

fn build(backend: Backend, policy: PolicyKind) -> Store {
    backend
        .builder()
        .capacity(Tier::Device, 2 * T as u64)
        .capacity(Tier::Pinned, 1 << 20)
        .capacity(Tier::Mapped, 1 << 20)
        .capacity(Tier::Disk, 4 << 20)
        .promote_on_read(true)
        .policy(policy)
        .build()
        .expect("build store")
}

fn put(store: &Store, name: &str, seed: u64) -> Tensor {
    let data = random_bytes(T, seed);
    (store.put(name, DType::F32, &[T / 4], &data).unwrap(), data)
}

/// A tensor and the bytes it was put with.
type Tensor = (TensorId, Vec<u8>);

/// Puts a hot tensor H, reads it `hot_reads` times, then reads `cold` cold tensors once each.
/// Returns the store, H, and the cold tensors.
fn hot_then_scan(
    backend: Backend,
    policy: PolicyKind,
    hot_reads: usize,
    cold: usize,
) -> (Store, Tensor, Vec<Tensor>) {
    let store = build(backend, policy);
    let h = put(&store, "hot", 1);
    let colds: Vec<_> =
        (0..cold).map(|k| put(&store, &format!("cold{k}"), 100 + k as u64)).collect();
    // Placement: H and the first cold tensor fill Device; the others went to Pinned.
    assert_eq!(store.tier_of(h.0).unwrap(), Tier::Device, "{policy}");
    assert_eq!(store.tier_of(colds[0].0).unwrap(), Tier::Device, "{policy}");
    for c in &colds[1..] {
        assert_eq!(
            store.tier_of(c.0).unwrap(),
            Tier::Pinned,
            "{policy}: put goes to the fastest tier with room"
        );
    }
    for _ in 0..hot_reads {
        assert_eq!(store.read(h.0).unwrap(), h.1);
        assert_eq!(store.tier_of(h.0).unwrap(), Tier::Device, "{policy}: reads of H are hits");
    }
    for (id, data) in &colds {
        assert_eq!(&store.read(*id).unwrap(), data, "{policy}: cold read");
        assert_budgets(&store.stats(), policy.name());
        assert_eq!(store.stats().tiers[0].tensors, 2.min(1 + cold), "{policy}");
    }
    (store, h, colds)
}

#[test]
fn frequency_keeps_the_hot_tensor_through_a_scan() {
    common::each_backend("frequency_keeps_the_hot_tensor_through_a_scan", |backend| {
        let (store, (h, hdata), colds) = hot_then_scan(backend, PolicyKind::Frequency, 32, 16);
        assert_eq!(store.tier_of(h).unwrap(), Tier::Device, "frequency: H is still on the Device");
        let s = store.stats();
        // The scan still used the other Device slot: cold tensors were promoted one after another.
        assert!(s.promotions >= 1, "frequency: no promotion at all: {s}");
        assert!(s.evictions >= 1, "frequency: no eviction at all: {s}");
        let on_device: Vec<_> =
            colds.iter().filter(|c| store.tier_of(c.0).unwrap() == Tier::Device).collect();
        assert_eq!(on_device.len(), 1, "frequency: one cold tensor shares the Device with H");
        assert_eq!(store.read(h).unwrap(), hdata);
        for (id, data) in &colds {
            assert_eq!(&store.read(*id).unwrap(), data, "frequency: demoted contents intact");
        }
    });
}

#[test]
fn lru_loses_the_hot_tensor_to_a_scan() {
    common::each_backend("lru_loses_the_hot_tensor_to_a_scan", |backend| {
        let (store, (h, hdata), colds) = hot_then_scan(backend, PolicyKind::Lru, 32, 16);
        assert_ne!(
            store.tier_of(h).unwrap(),
            Tier::Device,
            "lru: the scan flushed H from the Device"
        );
        assert!(!store.info(h).unwrap().tiers.contains(&Tier::Device));
        // The last two tensors scanned are the ones on the Device.
        let last_two: Vec<TensorId> = colds[colds.len() - 2..].iter().map(|c| c.0).collect();
        for id in &last_two {
            assert_eq!(store.tier_of(*id).unwrap(), Tier::Device, "lru: most recent on the Device");
        }
        let s = store.stats();
        assert_eq!(s.promotions as usize, colds.len() - 1, "lru admits every promotion: {s}");
        for (id, data) in colds.iter().rev() {
            assert_eq!(&store.read(*id).unwrap(), data, "lru: demoted contents intact");
        }
        assert_eq!(store.read(h).unwrap(), hdata);
    });
}

/// Two hot tensors fill the Device: frequency refuses to promote one-off reads over them, LRU
/// lets the scan flush both.
#[test]
fn frequency_refuses_one_off_promotions_over_hot_tensors() {
    common::each_backend("frequency_refuses_one_off_promotions_over_hot_tensors", |backend| {
        for policy in [PolicyKind::Frequency, PolicyKind::Lru] {
            let store = build(backend, policy);
            let (h1, d1) = put(&store, "hot1", 1);
            let (h2, d2) = put(&store, "hot2", 2);
            let colds: Vec<_> = (0..8).map(|k| put(&store, &format!("cold{k}"), 10 + k)).collect();
            for _ in 0..20 {
                assert_eq!(store.read(h1).unwrap(), d1);
                assert_eq!(store.read(h2).unwrap(), d2);
            }
            for (id, data) in &colds {
                assert_eq!(&store.read(*id).unwrap(), data);
            }
            let s = store.stats();
            let hot_on_device =
                [h1, h2].iter().filter(|&&h| store.tier_of(h).unwrap() == Tier::Device).count();
            match policy {
                PolicyKind::Frequency => {
                    assert_eq!(hot_on_device, 2, "frequency: both hot tensors stay");
                    assert_eq!(
                        s.promotions, 0,
                        "frequency admitted a one-off read over a hot tensor"
                    );
                    for (id, _) in &colds {
                        assert_eq!(
                            store.tier_of(*id).unwrap(),
                            Tier::Pinned,
                            "frequency: cold stays in Pinned"
                        );
                    }
                }
                PolicyKind::Lru => {
                    assert_eq!(hot_on_device, 0, "lru: the scan flushes both hot tensors");
                    assert_eq!(s.promotions, colds.len() as u64);
                }
                PolicyKind::Schedule => unreachable!("not in this test"),
            }
            assert_budgets(&s, policy.name());
        }
    });
}

/// `move_to(Device)` of a third tensor into a full Device demotes the policy's first victim:
/// the least recently used (LRU) or the least frequently used (frequency).
#[test]
fn move_to_a_full_tier_demotes_the_policys_victim() {
    common::each_backend("move_to_a_full_tier_demotes_the_policys_victim", |backend| {
        for policy in [PolicyKind::Frequency, PolicyKind::Lru] {
            let store = build(backend, policy);
            let (hot, _) = put(&store, "hot", 1);
            let (recent, _) = put(&store, "recent", 2);
            let (third, data) = put(&store, "third", 3);
            assert_eq!(store.tier_of(third).unwrap(), Tier::Pinned);
            for _ in 0..10 {
                store.read(hot).unwrap();
            }
            store.read(recent).unwrap(); // most recent, but read only twice (put + this)
            store.move_to(third, Tier::Device).unwrap();
            assert_eq!(store.tier_of(third).unwrap(), Tier::Device);
            assert_eq!(store.read(third).unwrap(), data);
            let (kept, demoted) = match policy {
                PolicyKind::Lru => (recent, hot),
                PolicyKind::Frequency => (hot, recent),
                PolicyKind::Schedule => unreachable!("not in this test"),
            };
            assert_eq!(store.tier_of(kept).unwrap(), Tier::Device, "{policy}: wrong victim");
            assert_eq!(
                store.tier_of(demoted).unwrap(),
                Tier::Pinned,
                "{policy}: victim demoted one tier"
            );
            assert_eq!(store.stats().evictions, 1, "{policy}");
        }
    });
}

/// Saving tensors is not an access: with LRU, saving 64 tensors that live on disk leaves the 16
/// tensors of the working set on the device. (A save read each tensor as an access and promoted
/// it, pushing the whole working set off the device.)
#[test]
fn a_save_leaves_the_working_set_on_the_device() {
    let store = Backend::Host
        .builder()
        .capacity(Tier::Device, 16 * T as u64)
        .capacity(Tier::Pinned, 0)
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, 4 << 20)
        .policy(PolicyKind::Lru)
        .build()
        .unwrap();
    let hot: Vec<Tensor> = (0..16).map(|i| put(&store, &format!("hot{i}"), i)).collect();
    let cold: Vec<TensorId> = (0..64)
        .map(|i| {
            let data = random_bytes(T, 100 + i);
            store
                .put_in(
                    Tier::Disk,
                    &format!("cold{i}"),
                    strata::Group::Other,
                    DType::F32,
                    &[T / 4],
                    &data,
                )
                .unwrap()
        })
        .collect();
    for (id, _) in &hot {
        assert_eq!(common::tiers(&store, *id)[0], Tier::Device);
    }
    let dir = tempfile::tempdir().unwrap();
    store.save_safetensors(dir.path().join("cold.safetensors"), &cold).unwrap();
    for (id, data) in &hot {
        assert_eq!(common::tiers(&store, *id)[0], Tier::Device, "the save evicted a hot tensor");
        assert_eq!(&store.read(*id).unwrap(), data);
    }
    let st = store.stats();
    assert_eq!((st.promotions, st.evictions), (0, 0), "{st}");
}

/// A promotion weighs the bytes it would evict: a 4 KiB tensor read again and again is not
/// promoted if that would push a 256 KiB tensor (the Device tier's only other tenant) down.
/// (Admission compared access counts alone: one small promotion spilled a large tensor.)
#[test]
fn a_small_promotion_does_not_push_out_a_large_tensor() {
    const BIG: usize = 256 << 10;
    let store = Backend::Host
        .builder()
        .capacity(Tier::Device, BIG as u64)
        .capacity(Tier::Pinned, 0)
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, 4 << 20)
        .policy(PolicyKind::Lru)
        .build()
        .unwrap();
    let big = store.put("big", DType::U8, &[BIG], &vec![9; BIG]).unwrap();
    let small =
        store.put_in(Tier::Disk, "small", strata::Group::Other, DType::U8, &[T], &[3; T]).unwrap();
    for _ in 0..8 {
        assert_eq!(store.read(small).unwrap(), vec![3; T]);
    }
    assert_eq!(common::tiers(&store, big), [Tier::Device], "the big tensor was pushed out");
    assert_eq!(common::tiers(&store, small), [Tier::Disk]);
    // Where the victims are no larger than twice the copy, the promotion goes ahead.
    store.remove(big).unwrap();
    let mid = store.put("mid", DType::U8, &[BIG - 2 * T], &vec![1; BIG - 2 * T]).unwrap();
    let other = store.put("other", DType::U8, &[T * 2], &[2; 2 * T]).unwrap();
    assert_eq!(common::tiers(&store, other), [Tier::Device]);
    store.read(mid).unwrap(); // `other` is now the least recently used
    store.read(small).unwrap();
    assert_eq!(common::tiers(&store, small)[0], Tier::Device, "not promoted");
    assert_eq!(common::tiers(&store, mid), [Tier::Device]);
    assert_eq!(store.read(other).unwrap(), vec![2; 2 * T]);
}
