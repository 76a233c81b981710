//! Checks of the books the store keeps incrementally, against what they summarize, after random
//! operations: the victim index against each tensor's state, the per-tier tensor counts and group
//! bytes against the replicas, the tiers' used bytes against the extents held.

use super::State;
use crate::base::types::Tier;
use crate::placement::victims::{rank_of, Level};
use crate::tiers::Ext;

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
