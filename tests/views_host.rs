//! Device and mapped views on the host backend: contents, dirty write-back, holds, kernels.

mod common;

use common::{random_bytes, tiers};
use strata::kernels::{self, Kernels};
use strata::{BackendKind, DType, Error, Store, Tier};

fn store() -> Store {
    Store::builder()
        .host_backend()
        .capacity(Tier::Device, 256 << 10)
        .capacity(Tier::Pinned, 256 << 10)
        .capacity(Tier::Mapped, 256 << 10)
        .capacity(Tier::Disk, 4 << 20)
        .build()
        .expect("build store")
}

const LEN: usize = 3 * 37 * 4 * 25; // 11100 bytes: not a multiple of a page

#[test]
fn device_view_sees_the_tensors_bytes_from_every_tier() {
    let store = store();
    assert_eq!(store.backend(), BackendKind::Host);
    let s = store.stream().unwrap();
    assert_eq!(s.backend(), BackendKind::Host);
    for (k, from) in Tier::ALL.into_iter().enumerate() {
        let data = random_bytes(LEN, k as u64);
        let id = store.put(&format!("t{k}"), DType::F32, &[75, 37], &data).unwrap();
        store.move_to(id, from).unwrap();
        let view = store.device_view(id, &s).unwrap();
        assert_eq!(view.id(), id);
        assert_eq!(view.tier(), Tier::Device);
        assert_eq!(view.len_bytes(), LEN);
        assert_eq!((view.dtype(), view.shape()), (DType::F32, &[75usize, 37][..]));
        assert_eq!(store.tier_of(id).unwrap(), Tier::Device, "a view makes the tensor resident");
        let seen = view.with_host_bytes(|b| b.to_vec()).unwrap();
        assert!(seen == data, "view of a tensor from {from} sees other bytes");
        drop(view);
        store.check_err().unwrap();
        if from != Tier::Device {
            assert_eq!(
                tiers(&store, id),
                vec![Tier::Device, from],
                "a clean view keeps the {from} copy"
            );
        }
        assert_eq!(store.read(id).unwrap(), data);
    }
}

#[test]
fn writing_through_a_view_keeps_only_the_device_copy() {
    let store = store();
    let s = store.stream().unwrap();
    let data = random_bytes(LEN, 1);
    let id = store.put("w", DType::U8, &[LEN], &data).unwrap();
    store.move_to(id, Tier::Disk).unwrap();
    let mut view = store.device_view(id, &s).unwrap();
    assert_eq!(tiers(&store, id), vec![Tier::Device, Tier::Disk]);
    let new = random_bytes(LEN, 2);
    view.with_host_bytes_mut(|b| b.copy_from_slice(&new)).unwrap();
    assert_eq!(view.with_host_bytes(|b| b.to_vec()).unwrap(), new);
    drop(view);
    store.check_err().unwrap();
    assert_eq!(tiers(&store, id), vec![Tier::Device], "the stale Disk copy is dropped");
    // Its extent is freed once the view's last work is done (the event its drop recorded).
    s.synchronize().unwrap();
    assert_eq!(store.stats().used(Tier::Disk), 0);
    assert_eq!(store.read(id).unwrap(), new);
    // The new bytes survive the trip down and back.
    for t in [Tier::Disk, Tier::Mapped, Tier::Pinned, Tier::Device] {
        store.move_to(id, t).unwrap();
        assert_eq!(store.read(id).unwrap(), new, "after move_to({t})");
    }
}

#[test]
fn mark_dirty_without_writing_still_drops_other_copies() {
    let store = store();
    let s = store.stream().unwrap();
    let data = random_bytes(LEN, 3);
    let id = store.put("d", DType::U8, &[LEN], &data).unwrap();
    store.move_to(id, Tier::Pinned).unwrap();
    let mut view = store.device_view(id, &s).unwrap();
    view.mark_dirty();
    drop(view);
    store.check_err().unwrap();
    assert_eq!(tiers(&store, id), vec![Tier::Device]);
    assert_eq!(store.read(id).unwrap(), data);
}

#[test]
fn a_live_view_holds_the_tensor_in_place() {
    let store = store();
    let s = store.stream().unwrap();
    let data = random_bytes(LEN, 4);
    let id = store.put("h", DType::U8, &[LEN], &data).unwrap();
    store.move_to(id, Tier::Mapped).unwrap();
    let view = store.device_view(id, &s).unwrap();
    let busy = |e: Error| matches!(e, Error::Busy { id: i, holders: 1 } if i == id);
    assert!(busy(store.remove(id).unwrap_err()));
    for t in [Tier::Pinned, Tier::Mapped, Tier::Disk] {
        let e = store.move_to(id, t).unwrap_err();
        assert!(busy(e), "move_to({t}) under a view");
    }
    assert_eq!(store.lookup("h"), Some(id));
    assert_eq!(store.read(id).unwrap(), data, "reads are fine under a view");
    drop(view);
    store.check_err().unwrap();
    store.move_to(id, Tier::Disk).unwrap();
    assert_eq!(tiers(&store, id), vec![Tier::Disk]);
    store.remove(id).unwrap();
    assert_eq!(store.lookup("h"), None);
}

#[test]
fn checksum_kernel_matches_the_host_reference() {
    let store = store();
    let k = Kernels::new(&store).unwrap();
    let s = store.stream().unwrap();
    for (n, len) in [1usize, 255, 4096, LEN, 70_000].into_iter().enumerate() {
        let data = random_bytes(len, 10 + n as u64);
        let id = store.put(&format!("c{n}"), DType::U8, &[len], &data).unwrap();
        store.move_to(id, Tier::Disk).unwrap();
        let view = store.device_view(id, &s).unwrap();
        for repeats in [1, 3] {
            assert_eq!(
                k.checksum(&view, repeats).unwrap(),
                kernels::checksum_host(&data, repeats),
                "{len} bytes"
            );
        }
    }
}

#[test]
fn fill_kernel_writes_the_pattern_that_reaches_disk() {
    let store = store();
    let k = Kernels::new(&store).unwrap();
    let s = store.stream().unwrap();
    for (n, seed) in [0u32, 1, 77, u32::MAX].into_iter().enumerate() {
        let id = store
            .put(&format!("f{n}"), DType::I16, &[LEN / 2], &random_bytes(LEN, 20 + n as u64))
            .unwrap();
        store.move_to(id, Tier::Pinned).unwrap();
        let mut view = store.device_view(id, &s).unwrap();
        k.fill(&mut view, seed).unwrap();
        assert_eq!(
            k.checksum(&view, 1).unwrap(),
            kernels::checksum_host(&kernels::pattern(LEN, seed), 1)
        );
        drop(view);
        store.check_err().unwrap();
        assert_eq!(tiers(&store, id), vec![Tier::Device], "fill marks the view dirty");
        store.move_to(id, Tier::Disk).unwrap();
        assert_eq!(tiers(&store, id), vec![Tier::Disk]);
        assert_eq!(store.read(id).unwrap(), kernels::pattern(LEN, seed), "seed {seed}");
    }
}

#[test]
fn mapped_view_needs_a_mapped_copy() {
    let store = store();
    let s = store.stream().unwrap();
    let data = random_bytes(LEN, 30);
    let id = store.put("m", DType::U8, &[LEN], &data).unwrap();
    for t in [Tier::Device, Tier::Pinned, Tier::Disk] {
        store.move_to(id, t).unwrap();
        match store.mapped_view(id, &s) {
            Err(Error::NotInTier { id: i, tier: Tier::Mapped }) => assert_eq!(i, id),
            Err(e) => panic!("mapped_view of a tensor in {t}: {e:?}"),
            Ok(_) => panic!("mapped_view of a tensor in {t} succeeded"),
        }
        assert_eq!(tiers(&store, id)[0], t, "a refused mapped_view moved the tensor");
    }
    store.move_to(id, Tier::Mapped).unwrap();
    let view = store.mapped_view(id, &s).unwrap();
    assert_eq!(view.tier(), Tier::Mapped);
    assert_eq!(view.len_bytes(), LEN);
    assert_eq!(view.with_host_bytes(|b| b.to_vec()).unwrap(), data);
    let k = Kernels::new(&store).unwrap();
    assert_eq!(k.checksum(&view, 2).unwrap(), kernels::checksum_host(&data, 2));
    // Held: no move away from Mapped, no remove.
    for t in [Tier::Device, Tier::Pinned, Tier::Disk] {
        let e = store.move_to(id, t).unwrap_err();
        assert!(matches!(e, Error::Busy { .. }), "move_to({t}) under a mapped view: {e:?}");
    }
    assert!(matches!(store.remove(id).unwrap_err(), Error::Busy { .. }));
    drop(view);
    store.check_err().unwrap();
    store.move_to(id, Tier::Device).unwrap();
    assert_eq!(store.read(id).unwrap(), data);
}

#[test]
fn writing_through_a_mapped_view_keeps_only_the_mapped_copy() {
    let store = store();
    let s = store.stream().unwrap();
    let data = random_bytes(LEN, 40);
    let id = store.put("mw", DType::U8, &[LEN], &data).unwrap();
    store.move_to(id, Tier::Disk).unwrap();
    store.move_to(id, Tier::Mapped).unwrap();
    assert_eq!(tiers(&store, id), vec![Tier::Mapped, Tier::Disk]);
    let mut view = store.mapped_view(id, &s).unwrap();
    let new = random_bytes(LEN, 41);
    view.with_host_bytes_mut(|b| b.copy_from_slice(&new)).unwrap();
    drop(view);
    store.check_err().unwrap();
    assert_eq!(tiers(&store, id), vec![Tier::Mapped]);
    assert_eq!(store.read(id).unwrap(), new);
}

#[test]
fn host_kernels_run_in_stream_order() {
    let store = store();
    let s = store.stream().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    for k in 0..16 {
        let tx = tx.clone();
        s.launch_host(move || tx.send(k).unwrap()).unwrap();
    }
    s.synchronize().unwrap();
    let got: Vec<i32> = rx.try_iter().collect();
    assert_eq!(got, (0..16).collect::<Vec<_>>());
}
