//! Groups: every tensor has one (put gives `Other`), `Stats` reports bytes per group and tier,
//! and the accounting follows the tensors as they move.

use crate::common;

use strata::{DType, Group, LoadOptions, PolicyKind, Store, Tier};

#[test]
fn stats_count_bytes_per_group_and_tier() {
    common::each_backend("stats_count_bytes_per_group_and_tier", |backend| {
        let store = backend
            .builder()
            .capacity(Tier::Device, 64 << 10)
            .capacity(Tier::Pinned, 64 << 10)
            .capacity(Tier::Mapped, 0)
            .capacity(Tier::Disk, 1 << 20)
            .build()
            .unwrap();
        let w = store.put_group("w", Group::Param, DType::F32, &[1024], &[0; 4096]).unwrap();
        let g = store.put_group("g", Group::Grad, DType::F32, &[1024], &[1; 4096]).unwrap();
        let m =
            store.put_group("m", Group::OptimizerState, DType::F32, &[2048], &[2; 8192]).unwrap();
        let o = store.put("o", DType::U8, &[100], &[3; 100]).unwrap();
        assert_eq!(store.info(o).unwrap().group, Group::Other);
        store.move_to(m, Tier::Disk).unwrap();
        store.move_to(g, Tier::Pinned).unwrap();
        let s = store.stats();
        assert_eq!(s.group_bytes(Group::Param, store.tier_of(w).unwrap()), 4096);
        assert_eq!(s.group_bytes(Group::Grad, Tier::Pinned), 4096);
        assert_eq!(s.group_bytes(Group::OptimizerState, Tier::Disk), 8192);
        assert_eq!(s.group_bytes(Group::OptimizerState, Tier::Device), 0);
        assert_eq!(s.group_bytes(Group::Other, store.tier_of(o).unwrap()), 100);
        assert!(s.to_string().contains("bytes per group"), "{s}");
        // Regrouping moves the bytes between rows.
        store.set_group(o, Group::Activation).unwrap();
        let s = store.stats();
        assert_eq!(s.group_bytes(Group::Activation, store.tier_of(o).unwrap()), 100);
        assert_eq!(Tier::ALL.iter().map(|&t| s.group_bytes(Group::Other, t)).sum::<u64>(), 0);
        store.remove(w).unwrap();
        assert_eq!(
            Tier::ALL.iter().map(|&t| store.stats().group_bytes(Group::Param, t)).sum::<u64>(),
            0
        );
        assert!(matches!(store.set_group(w, Group::Grad), Err(strata::Error::UnknownId(_))));
    });
}

#[test]
fn loaded_tensors_take_the_group_asked_for() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    let src =
        strata::Store::builder().host_backend().capacity(Tier::Device, 1 << 20).build().unwrap();
    let a = src.put("a", DType::F32, &[4], &[0; 16]).unwrap();
    src.save_safetensors(&path, &[a]).unwrap();
    let store =
        strata::Store::builder().host_backend().capacity(Tier::Device, 1 << 20).build().unwrap();
    let opts = LoadOptions { group: Group::Param, ..Default::default() };
    let (_, id) = store.load_safetensors(&path, opts).unwrap().remove(0);
    assert_eq!(store.info(id).unwrap().group, Group::Param);
    assert_eq!(store.stats().group_bytes(Group::Param, Tier::Disk), 16);
}

#[test]
fn device_evictions_take_once_per_step_state_before_weights() {
    let store = Store::builder()
        .host_backend()
        .policy(PolicyKind::Lru)
        .capacity(Tier::Device, 8 << 10)
        .capacity(Tier::Pinned, 1 << 20)
        .build()
        .unwrap();
    let s = store.stream().unwrap();
    let w = store.put_group("w", Group::Param, DType::U8, &[4096], &[1; 4096]).unwrap();
    let m = store.put_group("m", Group::OptimizerState, DType::U8, &[4096], &[2; 4096]).unwrap();
    assert_eq!(
        (store.tier_of(w).unwrap(), store.tier_of(m).unwrap()),
        (Tier::Device, Tier::Device)
    );
    store.read(m).unwrap(); // w is now the least recently used
    let x = store.put("x", DType::U8, &[4096], &[3; 4096]).unwrap(); // Pinned: the device is full
    drop(store.device_view(x, &s).unwrap());
    assert_eq!(store.tier_of(w).unwrap(), Tier::Device, "the weight stays");
    assert_eq!(store.tier_of(m).unwrap(), Tier::Pinned, "the optimizer state made room");
}
