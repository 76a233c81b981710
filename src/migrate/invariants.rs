//! Checks of the books the store keeps incrementally, against what they summarize, after random
//! operations: the victim index against each tensor's state, the per-tier tensor counts and group
//! bytes against the replicas, the tiers' used bytes against the extents held.

use super::State;
use crate::placement::victims::{rank_of, Level};
use crate::tiers::Ext;
use crate::types::Tier;

impl State {
    /// Panics with a description of the first book that disagrees with the tensors.
    pub(crate) fn check_books(&mut self) {
        self.refresh_epoch();
        while self.place.victims.rekey_from.is_some() {
            self.refresh_epoch();
        }
        let fits = self.books.fits();
        let mut indexed = [0usize; 4];
        let mut evictable = [0u64; 4];
        let mut tensors = [0usize; 4];
        let mut groups = [[0u64; 5]; 4];
        let mut held = [0u64; 4];
        for (id, e) in self.res.slab.iter() {
            let slots = self.place.victims.slots(id);
            for t in Tier::ALL {
                let want = rank_of(e, t, &fits);
                let have = slots[t.index()].map(|(r, c, _)| (r, c));
                assert_eq!(have, want, "{id} in {t}: indexed as {have:?}, should be {want:?}");
                if let Some((_, _, key)) = slots[t.index()] {
                    assert_eq!(
                        key,
                        self.place.policy.victim_key(t, id),
                        "{id} in {t}: a stale victim key"
                    );
                    indexed[t.index()] += 1;
                    if want
                        .is_some_and(|(r, _)| r != crate::placement::victims::Rank::HintPrefetched)
                    {
                        evictable[t.index()] += e.bytes();
                    }
                }
                if let Some(r) = &e.replicas[t.index()] {
                    tensors[t.index()] += 1;
                    groups[t.index()][e.group.index()] += e.bytes();
                    if !matches!(r.ext, Ext::File { .. }) {
                        held[t.index()] += self.books.reserved_size(t, e.bytes());
                    }
                }
            }
            assert!(e.readers == 0 && e.read_flight.is_none(), "{id}: a read flight left over");
            assert!(e.flight.is_none(), "{id}: a flight left over");
        }
        for t in Tier::ALL {
            assert_eq!(self.place.victims.len(t), indexed[t.index()], "index size of {t}");
            assert_eq!(
                self.place.victims.evictable_bytes(t, Level::Demand),
                evictable[t.index()],
                "evictable bytes of {t}"
            );
            assert_eq!(self.res.tensors_in(t), tensors[t.index()], "tensors in {t}");
            assert_eq!(self.res.bytes_by_group(t), groups[t.index()], "group bytes of {t}");
            self.books.reap();
            assert_eq!(
                self.books.used(t),
                held[t.index()] + self.books.deferred_bytes(t),
                "used bytes of {t}: extents held plus extents waiting"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::testutil::Rng;
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
                        if let Ok(id) = store.put_group(
                            &format!("t{step}"),
                            group,
                            DType::U8,
                            &[n],
                            &vec![7; n],
                        ) {
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
                    let busy = {
                        let st = store.shared.lock();
                        let busy = st.res.slab.iter().any(|(_, e)| e.in_flight());
                        busy
                    };
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
}
