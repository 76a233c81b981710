//! Device and mapped views on the host backend: contents, dirty write-back, holds, kernels.

use crate::common;

use common::{random_bytes, tiers};
use strata::kernels::{self, Kernels};
use strata::{BackendKind, DType, Error, Group, Store, Tier};

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

/// A host view of a tensor another thread keeps moving between the Device, Pinned and Disk
/// tiers always finds it: the view waits for a move in progress and brings the tensor into host
/// memory when the move left it elsewhere. (It failed with `NotInTier` when it lost the race:
/// an error meant for a caller's own mistake.)
#[test]
fn a_host_view_absorbs_another_threads_moves() {
    common::watch_deadlocks();
    let store = std::sync::Arc::new(store());
    let x = store.put("x", DType::U32, &[1024], &[0u8; 4096]).unwrap();
    let moves = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (st, stp, mv) = (store.clone(), stop.clone(), moves.clone());
    let mover = std::thread::spawn(move || {
        let mut k = 0usize;
        while !stp.load(std::sync::atomic::Ordering::Relaxed) {
            k += 1;
            match st.move_to(x, [Tier::Device, Tier::Pinned, Tier::Disk][k % 3]) {
                Ok(()) => drop(mv.fetch_add(1, std::sync::atomic::Ordering::Relaxed)),
                Err(Error::Busy { .. }) => {}
                Err(e) => panic!("move: {e}"),
            }
        }
    });
    // Views until the other thread has moved the tensor 300 times meanwhile.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut n = 0u32;
    while moves.load(std::sync::atomic::Ordering::Relaxed) < 300 {
        assert!(
            std::time::Instant::now() < deadline,
            "the other thread moved the tensor too rarely"
        );
        n += 1;
        let mut v = store.host_view(x).unwrap_or_else(|e| panic!("host view {n}: {e}"));
        let vals = v.values_mut::<u32>().unwrap();
        assert!(vals.iter().all(|&c| c == n - 1), "view {n} saw another count");
        vals.iter_mut().for_each(|c| *c = n);
        drop(v);
        std::thread::yield_now();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    mover.join().unwrap();
    assert!(store.read_vec::<u32>(x).unwrap().iter().all(|&c| c == n));
}

/// Shared host views: eight threads read one tensor at once, each through its own view, and a
/// write waits until they have all dropped theirs (a host view was exclusive: a second reader
/// failed with `Busy`).
#[test]
fn shared_host_views_read_together_and_a_write_waits_for_them() {
    common::watch_deadlocks();
    let store = std::sync::Arc::new(store());
    let x = store.put_slice("x", &[1024], &[7u32; 1024]).unwrap();
    store.move_to(x, Tier::Disk).unwrap();
    let all_in = std::sync::Arc::new(std::sync::Barrier::new(9));
    let readers: Vec<_> = (0..8)
        .map(|_| {
            let (st, b) = (store.clone(), all_in.clone());
            std::thread::spawn(move || {
                let v = st.host_view_shared(x).unwrap();
                // Every reader holds its view at once.
                b.wait();
                std::thread::sleep(std::time::Duration::from_millis(50));
                let sum: u64 = v.values::<u32>().unwrap().iter().map(|&c| u64::from(c)).sum();
                drop(v);
                sum
            })
        })
        .collect();
    all_in.wait();
    let t = std::time::Instant::now();
    store.write_slice(x, &[9u32; 1024]).unwrap();
    let waited = t.elapsed();
    for r in readers {
        assert_eq!(r.join().unwrap(), 7 * 1024, "a reader saw the write");
    }
    assert!(waited >= std::time::Duration::from_millis(30), "the write did not wait: {waited:?}");
    assert_eq!(store.read_vec::<u32>(x).unwrap(), vec![9u32; 1024]);
}

/// A shared host view may outlive its store, as other views may: dropping the store does not
/// wait for it (it waited for ever), and the view still reads the tensor's bytes.
#[test]
fn a_shared_host_view_may_outlive_its_store() {
    let store = store();
    let x = store.put("x", DType::U8, &[4096], &[7u8; 4096]).unwrap();
    let v = store.host_view_shared(x).unwrap();
    let dropped = std::thread::spawn(move || drop(store));
    let t = std::time::Instant::now();
    while !dropped.is_finished() {
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "the store's drop waits for the view"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    dropped.join().unwrap();
    assert_eq!(v.bytes(), &[7u8; 4096][..]);
    drop(v);
}

/// Runs `f` on its own thread and fails if it has not returned within 10 s.
fn within_10s(what: &str, f: impl FnOnce() + Send + 'static) {
    let h = std::thread::spawn(f);
    let t = std::time::Instant::now();
    while !h.is_finished() {
        assert!(t.elapsed() < std::time::Duration::from_secs(10), "{what} hangs");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    h.join().unwrap();
}

/// A device view moved into its stream's own work, dropped there after the store was: the last
/// holder of the store's state goes on the stream's thread, which must not wait for the event
/// its own job holds back.
#[test]
fn a_view_outliving_its_store_drops_inside_its_streams_work() {
    let store = store();
    let x = store.put("x", DType::U8, &[4096], &[3u8; 4096]).unwrap();
    let s = store.stream().unwrap();
    let v = store.device_view(x, &s).unwrap();
    let (go, gate) = std::sync::mpsc::channel::<()>();
    let (done, finished) = std::sync::mpsc::channel::<()>();
    s.launch_host(move || {
        gate.recv().unwrap();
        drop(v);
        done.send(()).unwrap();
    })
    .unwrap();
    drop(store);
    go.send(()).unwrap();
    within_10s("the view's drop inside its stream's work", move || finished.recv().unwrap());
}

/// Layer scopes that outlive their store, one of them waiting for room when the store went:
/// the prefetch it starts as the other drops is never run (the workers stopped with the
/// store), and the last drop must not wait for it.
#[test]
fn layer_scopes_outliving_their_store_drop_without_waiting_for_stopped_workers() {
    let store = Store::builder()
        .host_backend()
        .capacity(Tier::Device, 64 << 10)
        .capacity(Tier::Pinned, 0)
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, 1 << 20)
        .build()
        .unwrap();
    let put = |n: &str| {
        store.put_in(Tier::Disk, n, Group::Other, DType::U8, &[48 << 10], &[5u8; 48 << 10]).unwrap()
    };
    let (a, b) = (put("a"), put("b"));
    let s = store.stream().unwrap();
    let scope_a = store.layer(&[a], &[]).unwrap();
    drop(store.device_view(a, &s).unwrap());
    // No room for b beside a, held by its scope: b's fetch waits for room.
    let scope_b = store.layer(&[b], &[]).unwrap();
    within_10s("dropping the store and then the scopes", move || {
        drop(store);
        drop(scope_a);
        drop(scope_b);
    });
}

/// Readers whose shared views overlap do not keep a writer waiting for ever: once a writer
/// waits, new shared views wait for it.
#[test]
fn overlapping_shared_views_do_not_starve_a_writer() {
    common::watch_deadlocks();
    let store = std::sync::Arc::new(store());
    let x = store.put("x", DType::U8, &[4096], &[1u8; 4096]).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let readers: Vec<_> = (0..4)
        .map(|_| {
            let (store, stop) = (store.clone(), stop.clone());
            std::thread::spawn(move || {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while !stop.load(std::sync::atomic::Ordering::Relaxed)
                    && std::time::Instant::now() < deadline
                {
                    let v = store.host_view_shared(x).unwrap();
                    let b = v.bytes()[0];
                    assert!(v.bytes().iter().all(|&c| c == b), "a torn view");
                    std::thread::sleep(std::time::Duration::from_millis(2));
                    drop(v);
                }
            })
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(50));
    let t = std::time::Instant::now();
    store.write(x, &[2u8; 4096]).unwrap();
    let took = t.elapsed();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for r in readers {
        r.join().unwrap();
    }
    assert!(took < std::time::Duration::from_secs(2), "the write waited {took:?}");
    assert_eq!(store.read(x).unwrap(), vec![2u8; 4096]);
}

/// A shared view is not lent the bytes a live mapped view's kernels may be writing: it takes
/// another host copy, or is `Busy` when there is none.
#[test]
fn a_shared_view_avoids_the_replica_a_mapped_view_may_write() {
    let store = store();
    let s = store.stream().unwrap();
    let x = store.put_in(Tier::Mapped, "x", Group::Other, DType::U8, &[4096], &[3; 4096]).unwrap();
    let mv = store.mapped_view(x, &s).unwrap();
    assert!(matches!(store.host_view_shared(x), Err(Error::Busy { .. })));
    drop(mv);
    // A second copy in host memory (on the host backend the Device tier is host memory too).
    drop(store.device_view(x, &s).unwrap());
    assert_eq!(tiers(&store, x), [Tier::Device, Tier::Mapped]);
    let mv = store.mapped_view(x, &s).unwrap();
    let v = store.host_view_shared(x).unwrap();
    assert_eq!(v.tier(), Tier::Device);
    assert_eq!(v.bytes(), &[3u8; 4096][..]);
    drop(v);
    drop(mv);
}
