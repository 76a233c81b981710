//! The store's incrementally kept books (the victim index, per-tier counts, group bytes, the
//! tiers' used bytes) checked against the tensors after random operations through the public
//! API (`State::check_books`, in migration, does the checking).

use crate::base::testutil::Rng;
use crate::{DType, Group, PolicyKind, Store, Tier};

#[test]
fn books_agree_with_the_tensors_after_random_operations() {
    for policy in PolicyKind::ALL {
        let store = Store::builder()
            .host_backend()
            .policy(policy)
            .capacity(Tier::Device, 96 << 10)
            .capacity(Tier::Pinned, 64 << 10)
            .capacity(Tier::Mapped, 48 << 10)
            .capacity(Tier::Disk, 512 << 10)
            .staging(2, 16 << 10)
            .prefetch_budget(32 << 10)
            .build()
            .unwrap();
        let s = store.stream().unwrap();
        let mut rng = Rng::new(policy as u64);
        let mut ids = Vec::new();
        for step in 0..1500 {
            let pick = |rng: &mut Rng, ids: &Vec<crate::TensorId>| {
                (!ids.is_empty()).then(|| ids[rng.below(ids.len() as u64) as usize])
            };
            match rng.below(12) {
                0..=2 => {
                    let n = 1 + rng.below(20_000) as usize;
                    let group = crate::Group::ALL[rng.below(5) as usize];
                    if let Ok(id) =
                        store.put_group(&format!("t{step}"), group, DType::U8, &[n], &vec![7; n])
                    {
                        ids.push(id);
                    }
                }
                3 => {
                    if let Some(id) = pick(&mut rng, &ids) {
                        let _ = store.read(id);
                    }
                }
                4 => {
                    if let Some(id) = pick(&mut rng, &ids) {
                        let n = store.info(id).unwrap().bytes as usize;
                        let _ = store.write(id, &vec![9; n]);
                    }
                }
                5 => {
                    if let Some(id) = pick(&mut rng, &ids) {
                        let _ = store.move_to(id, Tier::ALL[rng.below(4) as usize]);
                    }
                }
                6 => {
                    if let Some(id) = pick(&mut rng, &ids) {
                        if let Ok(mut v) = store.device_view(id, &s) {
                            if rng.below(2) == 0 {
                                v.mark_dirty();
                            }
                        }
                    }
                }
                7 => {
                    if let Some(id) = pick(&mut rng, &ids) {
                        let _ = store.prefetch(&[id]);
                    }
                }
                8 => {
                    if let Some(id) = pick(&mut rng, &ids) {
                        let _ = store.release(&[id]);
                        let _ = store.discard(id);
                    }
                }
                9 => {
                    if let Some(id) = pick(&mut rng, &ids) {
                        if store.pin(&[id]).is_ok() {
                            let _ = store.unpin(&[id]);
                        }
                    }
                }
                10 => {
                    if let Some(id) = pick(&mut rng, &ids) {
                        let _ = store.set_group(id, Group::ALL[rng.below(5) as usize]);
                        let _ = store.host_view(id);
                    }
                }
                _ => {
                    if let Some(i) = (!ids.is_empty()).then(|| rng.below(ids.len() as u64)) {
                        if store.remove(ids[i as usize]).is_ok() {
                            ids.swap_remove(i as usize);
                        }
                    }
                }
            }
            s.synchronize().unwrap();
            // Prefetch jobs may still run on the workers: let them end first.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            loop {
                // (Edition 2024: the guard, a temporary of the tail expression, drops at its end.)
                let busy = store.shared.lock().res.slab.iter().any(|(_, e)| e.in_flight());
                if !busy || std::time::Instant::now() > deadline {
                    break;
                }
                std::thread::yield_now();
            }
            store.shared.lock().check_books();
        }
        let _ = store.check_err();
    }
}
