//! Holds (pins, scopes) against the waiting queue, the prefetch budget and moves in flight, on
//! the host backend: regression tests for defects an independent review found on 2026-11-25.
//! Each test's doc describes the defect as it was; each failed before its fix.

use std::sync::Arc;
use std::time::Duration;

use strata::{DType, Store, TensorId, Tier};

const KIB: u64 = 1024;

fn put(store: &Store, name: &str, len: usize, b: u8) -> TensorId {
    store.put(name, DType::U8, &[len], &vec![b; len]).unwrap()
}

/// A pin that got `Wait` (no room) is queued; `pump_waiting` retries it with `force = false`,
/// so the prefetch budget applies to it: a pinned tensor larger than the budget is never
/// brought, although the device has room once the other pin goes.
#[test]
fn probe_queued_pin_is_held_back_by_the_prefetch_budget() {
    let store = Store::builder()
        .host_backend()
        .capacity(Tier::Device, 64 * KIB)
        .capacity(Tier::Pinned, 256 * KIB)
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, 0)
        .prefetch_budget(16 * KIB)
        .build()
        .unwrap();
    let a = put(&store, "a", 48 * KIB as usize, 1);
    store.move_to(a, Tier::Device).unwrap();
    store.pin(&[a]).unwrap();
    let b = put(&store, "b", 48 * KIB as usize, 2);
    store.move_to(b, Tier::Pinned).unwrap();
    store.pin(&[b]).unwrap(); // no room: queued
    assert_ne!(store.tier_of(b).unwrap(), Tier::Device);
    store.unpin(&[a]).unwrap(); // room now; pump_waiting runs
    store.release(&[a]).unwrap(); // another pump
    println!("a in {:?}, b (pinned) in {:?}", store.tier_of(a).unwrap(), store.tier_of(b).unwrap());
    assert_eq!(store.tier_of(b).unwrap(), Tier::Device, "pinned b never brought (budget)");
}

/// Control: the same pin made when there is room is brought at once (force = true).
#[test]
fn probe_control_pin_with_room_ignores_budget() {
    let store = Store::builder()
        .host_backend()
        .capacity(Tier::Device, 64 * KIB)
        .capacity(Tier::Pinned, 256 * KIB)
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, 0)
        .prefetch_budget(16 * KIB)
        .build()
        .unwrap();
    let b = put(&store, "b", 48 * KIB as usize, 2);
    store.move_to(b, Tier::Pinned).unwrap();
    store.pin(&[b]).unwrap();
    assert_eq!(store.tier_of(b).unwrap(), Tier::Device);
}

/// A pin queued for lack of room, then unpinned: `unpin_one` does not clear `queued`, so a later
/// pump brings the tensor anyway (as a hint prefetch), evicting an unrelated tensor.
#[test]
fn probe_unpinned_tensor_stays_queued_and_is_brought_later() {
    let store = Store::builder()
        .host_backend()
        .capacity(Tier::Device, 64 * KIB)
        .capacity(Tier::Pinned, 256 * KIB)
        .capacity(Tier::Mapped, 0)
        .capacity(Tier::Disk, 0)
        .prefetch_budget(1 << 20)
        .build()
        .unwrap();
    let a = put(&store, "a", 48 * KIB as usize, 1);
    store.move_to(a, Tier::Device).unwrap();
    store.pin(&[a]).unwrap();
    let b = put(&store, "b", 48 * KIB as usize, 2);
    store.move_to(b, Tier::Pinned).unwrap();
    store.pin(&[b]).unwrap(); // queued
    store.unpin(&[b]).unwrap(); // the pin is undone...
    store.unpin(&[a]).unwrap(); // ...but this pump brings b, evicting a
    println!(
        "a in {:?}, b (unpinned) in {:?}",
        store.tier_of(a).unwrap(),
        store.tier_of(b).unwrap()
    );
    assert_eq!(store.tier_of(a).unwrap(), Tier::Device, "a evicted for an undone pin of b");
}

/// A pin that lands while a `move_to` of the tensor to a slower tier runs: the move commits and
/// drops the device replica of the now pinned tensor (room.rs now guards spills, ops.rs
/// move_to does not).
#[test]
fn probe_pin_during_move_to_disk_leaves_pinned_tensor_off_device() {
    let dir = std::env::temp_dir();
    let mut hits = 0;
    for round in 0..20 {
        let store = Arc::new(
            Store::builder()
                .host_backend()
                .capacity(Tier::Device, 64 << 20)
                .capacity(Tier::Pinned, 1 << 20)
                .capacity(Tier::Mapped, 0)
                .capacity(Tier::Disk, 128 << 20)
                .disk_dir(&dir)
                .staging(2, 64 * KIB as usize)
                .build()
                .unwrap(),
        );
        let len = 32 << 20;
        let y = put(&store, "y", len, 3);
        store.move_to(y, Tier::Device).unwrap();
        let s2 = store.clone();
        let mover = std::thread::spawn(move || s2.move_to(y, Tier::Disk));
        std::thread::sleep(Duration::from_millis(2 + round));
        let pinned = store.pin(&[y]);
        let moved = mover.join().unwrap();
        let tier = store.tier_of(y).unwrap();
        println!("round {round}: pin {pinned:?}, move {moved:?}, y in {tier:?}");
        if pinned.is_ok() && moved.is_ok() && tier != Tier::Device {
            hits += 1;
            // and it is Busy for moves although off the device
            println!("  move_to(Device) of pinned y: {:?}", store.move_to(y, Tier::Device));
        }
    }
    assert_eq!(hits, 0, "a pin succeeded and the tensor ended off the device {hits} times");
}

/// A pin that gets `Wait` because the tensor is in another thread's flight (a move from Pinned
/// to Disk): nothing pumps the waiting queue when that flight ends, so the pinned tensor stays
/// off the device although the device is empty.
#[test]
fn probe_pin_waiting_on_a_flight_is_never_pumped() {
    let dir = std::env::temp_dir();
    let mut hits = 0;
    for round in 0..4 {
        let store = Arc::new(
            Store::builder()
                .host_backend()
                .capacity(Tier::Device, 64 << 20)
                .capacity(Tier::Pinned, 64 << 20)
                .capacity(Tier::Mapped, 0)
                .capacity(Tier::Disk, 128 << 20)
                .disk_dir(&dir)
                .build()
                .unwrap(),
        );
        let len = 32 << 20;
        let y = put(&store, "y", len, 3);
        store.move_to(y, Tier::Pinned).unwrap();
        let s2 = store.clone();
        let t0 = std::time::Instant::now();
        let mover = std::thread::spawn(move || {
            let r = s2.move_to(y, Tier::Disk);
            (r, t0.elapsed())
        });
        std::thread::sleep(Duration::from_millis(2 + round));
        let pinned = store.pin(&[y]);
        let pin_at = t0.elapsed();
        let moved = mover.join().unwrap();
        std::thread::sleep(Duration::from_millis(1000));
        let tier = store.tier_of(y).unwrap();
        println!("round {round}: pin {pinned:?} at {pin_at:?}, move {moved:?}, y in {tier:?}");
        let moved = moved.0;
        let _ = moved;
        if pinned.is_ok() && tier != Tier::Device {
            hits += 1;
        }
    }
    assert_eq!(hits, 0, "pinned tensor left off an empty device {hits} times");
}
