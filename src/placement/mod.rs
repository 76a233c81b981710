//! Placement: where a tensor goes, which tensors make room for it, and what is worth
//! prefetching.
//!
//! Decisions only: the victims of each tier are kept ranked and ordered
//! ([`victims::VictimIndex`], updated as tensors change), policies order them and judge
//! promotions ([`policy`]), and the prefetch budget says how many bytes prefetches may bring
//! ahead of use. Carrying a decision out (copies, spills, fills) is the migration layer's.

pub mod policy;
pub(crate) mod victims;

use std::collections::VecDeque;

use crate::base::types::{TensorId, Tier};
use crate::residency::{Residency, Source};
use crate::tiers::TierBooks;
use policy::Policy;
use victims::{Level, VictimIndex};

/// Slab slots re-keyed per call while the victim index catches up with a new policy epoch.
pub(crate) const REKEY_SLICE: usize = 256;

/// The placement state, under the store's lock.
pub(crate) struct Placement {
    pub(crate) policy: Box<dyn Policy>,
    pub(crate) victims: VictimIndex,
    /// Bytes whose copies prefetches started and that are not yet used or released.
    pub(crate) inflight: u64,
    pub(crate) prefetch_budget: u64,
    /// Hinted prefetches waiting for room in the prefetch budget, in order (entries whose
    /// `queued` flag was cleared are skipped).
    pub(crate) waiting: VecDeque<TensorId>,
    /// Whether a read that misses the fastest tier may promote the tensor.
    pub(crate) promote_on_read: bool,
    /// Reused by the policy's lookahead, so an access allocates nothing.
    pub(crate) lookahead_buf: Vec<TensorId>,
}

impl Placement {
    pub(crate) fn new(policy: Box<dyn Policy>, prefetch_budget: u64, promote: bool) -> Placement {
        let epoch = policy.epoch();
        Placement {
            policy,
            victims: VictimIndex::new(epoch),
            inflight: 0,
            prefetch_budget,
            waiting: VecDeque::new(),
            promote_on_read: promote,
            lookahead_buf: Vec::new(),
        }
    }
}

impl Placement {
    /// Puts `id` where it now belongs in the victim index (after any change to its replicas,
    /// holds, flights, flags or policy key). Unknown ids are ignored.
    pub(crate) fn reindex(&mut self, res: &Residency, id: TensorId) {
        let Some(e) = res.slab.get(id) else { return };
        self.victims.place(&*self.policy, id, e);
    }

    /// Takes `id` out of the victim index before it is removed.
    pub(crate) fn unindex(&mut self, res: &Residency, id: TensorId) {
        let Some(e) = res.slab.get(id) else { return };
        self.victims.forget(id, e.bytes());
    }

    /// Brings the victim index's keys to the policy's epoch, a slice at a time: when the
    /// policy's keys changed wholesale (its epoch moved), the tensors are re-keyed
    /// [`REKEY_SLICE`] slab slots per call (the calls that make room), never all at once under
    /// the lock. Until it is done the order mixes old keys with new; a tensor accessed meanwhile
    /// gets its new key at once.
    pub(crate) fn refresh_epoch(&mut self, res: &Residency) {
        let epoch = self.policy.epoch();
        if epoch != self.victims.epoch {
            self.victims.epoch = epoch;
            self.victims.rekey_from = Some(0);
        }
        let Some(from) = self.victims.rekey_from else { return };
        let end = (from + REKEY_SLICE).min(res.slab.slots());
        for slot in from..end {
            if let Some(id) = res.slab.id_at(slot) {
                self.reindex(res, id);
            }
        }
        self.victims.rekey_from = (end < res.slab.slots()).then_some(end);
    }

    /// An access of `id`: the policy hears of it and its victim key is refreshed.
    pub(crate) fn touch(&mut self, res: &Residency, id: TensorId) {
        self.policy.on_access(id);
        self.reindex(res, id);
    }

    /// The first victims of `t` (for `level`, never `exclude`) that together free at least
    /// `bytes`, in order (all of them if they cannot).
    pub(crate) fn victims_covering(
        &mut self,
        res: &Residency,
        t: Tier,
        level: Level,
        bytes: u64,
        exclude: TensorId,
    ) -> Vec<TensorId> {
        self.refresh_epoch(res);
        let mut freed = 0;
        let mut out = Vec::new();
        for v in self.victims.iter(t, level, exclude) {
            if freed >= bytes {
                break;
            }
            freed += res.get(v).map_or(0, |e| e.bytes());
            out.push(v);
        }
        out
    }

    /// Whether the policy admits `id` into `t` at the cost of the victims that would make room
    /// for `bytes` there (none needed when there is free room).
    pub(crate) fn admits(
        &mut self,
        res: &Residency,
        books: &TierBooks,
        t: Tier,
        id: TensorId,
        bytes: u64,
    ) -> bool {
        let need = books.reserved_size(t, bytes).saturating_sub(books.free_bytes(t));
        let victims = if need == 0 {
            Vec::new()
        } else {
            self.victims_covering(res, t, Level::Demand, need, id)
        };
        self.policy.admit(t, id, &victims)
    }

    /// [`Placement::admits`] for an optional copy (a promotion after a read, a policy's
    /// prefetch): also refused when the victims that would make room hold more than twice the
    /// bytes the copy brings, so a small promotion never pushes a large tensor out (and down to
    /// disk).
    pub(crate) fn admits_copy(
        &mut self,
        res: &Residency,
        books: &TierBooks,
        t: Tier,
        id: TensorId,
        bytes: u64,
    ) -> bool {
        let need = books.reserved_size(t, bytes).saturating_sub(books.free_bytes(t));
        if need == 0 {
            return self.policy.admit(t, id, &[]);
        }
        let victims = self.victims_covering(res, t, Level::Demand, need, id);
        let evicted: u64 = victims.iter().filter_map(|&v| res.get(v).ok()).map(|e| e.bytes()).sum();
        if evicted > 2 * books.reserved_size(t, bytes).max(1) {
            return false;
        }
        self.policy.admit(t, id, &victims)
    }

    /// The tensor was used by a view (or left the device): it no longer counts as prefetched.
    /// The caller reindexes the tensor afterwards (every caller changes more about it).
    pub(crate) fn consume_prefetch(&mut self, res: &mut Residency, id: TensorId) {
        let Ok(e) = res.get_mut(id) else { return };
        e.pin_prefetch = false;
        if e.prefetched.take().is_some() && std::mem::take(&mut e.prefetch_charged) {
            self.inflight = self.inflight.saturating_sub(e.bytes());
        }
    }

    /// Marks `id` prefetched by `source` (protected from eviction until used), charging the
    /// prefetch budget when the prefetch started a copy.
    pub(crate) fn mark_prefetched(
        &mut self,
        res: &mut Residency,
        id: TensorId,
        source: Source,
        charged: bool,
    ) {
        let Ok(e) = res.get_mut(id) else { return };
        e.prefetched = Some(source);
        e.released = false;
        if charged && !e.prefetch_charged {
            e.prefetch_charged = true;
            self.inflight += e.bytes();
        }
        self.reindex(res, id);
    }
}
