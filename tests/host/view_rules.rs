//! Rules that keep views sound, each found by review and fixed: views of one tensor are all of
//! one tier; dropping a dirty view never blocks (so dropping it on its own stream's thread cannot
//! deadlock); a failed hint leaves nothing held; GEMMs only take views of their own stream.

use std::sync::mpsc;
use std::time::Duration;

use strata::linalg::Linalg;
use strata::{DType, Error, LoadOptions, Store, Tier};

fn store() -> Store {
    Store::builder()
        .host_backend()
        .capacity(Tier::Device, 1 << 20)
        .capacity(Tier::Pinned, 1 << 20)
        .capacity(Tier::Mapped, 1 << 20)
        .capacity(Tier::Disk, 4 << 20)
        .build()
        .unwrap()
}

#[test]
fn views_of_one_tensor_stay_in_one_tier() {
    let store = store();
    let s = store.stream().unwrap();
    let id = store.put("a", DType::U8, &[4096], &[1; 4096]).unwrap();
    store.move_to(id, Tier::Mapped).unwrap();
    let dv = store.device_view(id, &s).unwrap();
    assert!(matches!(store.mapped_view(id, &s), Err(Error::Busy { .. })));
    let dv2 = store.device_view(id, &s).unwrap(); // same tier: fine
    drop((dv, dv2));
    let mv = store.mapped_view(id, &s).unwrap();
    assert!(matches!(store.device_view(id, &s), Err(Error::Busy { .. })));
    drop(mv);
    drop(store.device_view(id, &s).unwrap());
}

#[test]
fn dropping_a_dirty_view_on_its_own_stream_does_not_deadlock() {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let store = store();
        let s = store.stream().unwrap();
        let id = store.put("a", DType::U8, &[4096], &[1; 4096]).unwrap();
        store.move_to(id, Tier::Pinned).unwrap();
        let mut v = store.device_view(id, &s).unwrap();
        v.with_host_bytes_mut(|b| b.fill(7)).unwrap();
        s.launch_host(move || drop(v)).unwrap();
        s.synchronize().unwrap();
        let _ = tx.send(store.read(id).unwrap());
    });
    let got = rx.recv_timeout(Duration::from_secs(20)).expect("deadlock: no answer in 20 s");
    assert_eq!(got, vec![7; 4096]);
}

#[test]
fn a_failed_scope_or_pin_holds_nothing() {
    // A file-backed tensor whose file shrank after loading: promoting it fails with an I/O error.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    let src = store();
    let w = src.put("w", DType::U8, &[64 << 10], &vec![3; 64 << 10]).unwrap();
    src.save_safetensors(&path, &[w]).unwrap();
    let store = Store::builder()
        .host_backend()
        .capacity(Tier::Device, 1 << 20)
        .capacity(Tier::Pinned, 0)
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, 0)
        .build()
        .unwrap();
    let (_, id) = store.load_safetensors(&path, LoadOptions::default()).unwrap().remove(0);
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(100).unwrap();
    // A copy from a file is read by a migration worker: the hint returns at once, and the
    // failure reaches the view that needs the bytes (and `check_err`).
    let s = store.stream().unwrap();
    if let Ok(scope) = store.layer(&[id], &[]) {
        assert!(store.device_view(id, &s).is_err(), "a view of a tensor whose fill failed");
        assert!(store.check_err().is_err(), "the failed fill is reported");
        drop(scope);
    }
    if store.pin(&[id]).is_ok() {
        assert!(store.device_view(id, &s).is_err());
        store.unpin(&[id]).unwrap();
    }
    let _ = store.check_err();
    // Nothing is left held or half-filled: the tensor is where it was, and can be removed.
    assert_eq!(store.info(id).unwrap().tiers, vec![Tier::Disk]);
    store.remove(id).unwrap();
}

#[test]
fn gemms_take_only_views_of_their_own_stream() {
    let store = store();
    let (s1, s2) = (store.stream().unwrap(), store.stream().unwrap());
    let la = Linalg::new(&store, &s1).unwrap();
    let w = store.put("w", DType::BF16, &[2, 2], &[0; 8]).unwrap();
    let x = la.matrix::<half::bf16>(1, 2).unwrap();
    let mut y = la.matrix(1, 2).unwrap();
    let other = store.device_view(w, &s2).unwrap();
    assert!(matches!(la.linear(&x, &other, &mut y), Err(Error::InvalidArgument(_))));
    drop(other);
    let mine = store.device_view(w, &s1).unwrap();
    la.linear(&x, &mine, &mut y).unwrap();
}

#[test]
fn a_host_view_excludes_every_other_access() {
    let store = store();
    let s = store.stream().unwrap();
    for tier in [Tier::Pinned, Tier::Mapped, Tier::Device] {
        let name = format!("h{tier}");
        let id = store.put(&name, DType::F32, &[1024], &[0u8; 4096]).unwrap();
        store.move_to(id, tier).unwrap();
        let mut hv = store.host_view(id).unwrap();
        assert!(matches!(store.device_view(id, &s), Err(Error::Busy { .. })), "{tier}");
        assert!(matches!(store.mapped_view(id, &s), Err(Error::Busy { .. })), "{tier}");
        assert!(matches!(store.host_view(id), Err(Error::Busy { .. })), "{tier}");
        assert!(matches!(store.read(id), Err(Error::Busy { .. })), "{tier}");
        assert!(matches!(store.write(id, &[0u8; 4096]), Err(Error::Busy { .. })), "{tier}");
        assert!(matches!(store.move_to(id, Tier::Disk), Err(Error::Busy { .. })), "{tier}");
        hv.f32s_mut().unwrap().fill(2.0);
        drop(hv);
        let back = store.read(id).unwrap();
        assert!(back.chunks(4).all(|c| f32::from_ne_bytes(c.try_into().unwrap()) == 2.0));
        drop(store.device_view(id, &s).unwrap());
    }
}

#[test]
fn a_discarded_tensor_is_evicted_without_a_write_back() {
    for discard in [false, true] {
        let store = two_page_device();
        let a = store.put("a", DType::U8, &[4096], &[1; 4096]).unwrap();
        assert_eq!(store.tier_of(a).unwrap(), Tier::Device, "a's only copy is on the device");
        if discard {
            store.discard(a).unwrap();
        }
        let s = store.stream().unwrap();
        let b = store.put("b", DType::U8, &[4096], &[2; 4096]).unwrap(); // fills the device
        let c = store.put("c", DType::U8, &[4096], &[3; 4096]).unwrap(); // in Pinned
        let held = store.device_view(b, &s).unwrap();
        drop(store.device_view(c, &s).unwrap()); // needs a's room
        drop(held);
        let back = store.stats().moved(Tier::Device, Tier::Pinned);
        assert_eq!(back, if discard { 0 } else { 4096 }, "discard {discard}");
        assert_eq!(store.tier_of(a).unwrap(), Tier::Pinned);
        // Written again, it is live again.
        store.write(a, &[9; 4096]).unwrap();
        assert_eq!(store.read(a).unwrap(), vec![9; 4096]);
    }
}

#[test]
fn releasing_a_discarded_tensor_starts_no_write_back() {
    let store = two_page_device();
    let a = store.put("a", DType::U8, &[4096], &[1; 4096]).unwrap();
    store.discard(a).unwrap();
    store.release(&[a]).unwrap();
    assert_eq!(store.stats().moved(Tier::Device, Tier::Pinned), 0);
    let b = store.put("b", DType::U8, &[4096], &[1; 4096]).unwrap();
    store.release(&[b]).unwrap(); // not discarded: written back at once
    assert_eq!(store.stats().moved(Tier::Device, Tier::Pinned), 4096);
}

/// A host store whose Device tier holds two 4 KiB tensors.
fn two_page_device() -> Store {
    Store::builder()
        .host_backend()
        .capacity(Tier::Device, 8 << 10)
        .capacity(Tier::Pinned, 1 << 20)
        .build()
        .unwrap()
}
