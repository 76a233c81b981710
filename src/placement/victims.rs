//! The victims of each tier, kept in order as tensors change rather than sorted per eviction.
//!
//! A tensor that could be demoted from a tier sits in one of that tier's ranked sets, ordered
//! by the policy's [`VictimKey`]. Ranks come first, the policy orders within a rank: released
//! tensors, then (on the device) gradients and optimizer state, which a training step touches
//! once, then everything else, then tensors prefetched by the policy's lookahead, then tensors
//! prefetched by a hint (only a view that cannot otherwise get room evicts those). Bytes per set
//! are summed as tensors come and go, so "could evicting make room?" is a sum of a few numbers.

use std::collections::BTreeSet;

use crate::placement::policy::{Policy, VictimKey};
use crate::residency::{Entry, Source};
use crate::types::{Group, TensorId, Tier};

/// A victim's rank: every tensor of a lower rank goes before any of a higher one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Rank {
    Released,
    Once,
    Normal,
    PolicyPrefetched,
    HintPrefetched,
}

const RANKS: usize = 5;

/// How hard an allocation may push: which ranks it may evict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Level {
    /// A policy's guess: evicts nothing that was prefetched.
    Guess,
    /// A hint or an explicit operation: may evict what only the policy prefetched.
    Demand,
    /// A view that cannot wait: when nothing else makes room, it may also evict what a hint
    /// prefetched and no one has used yet (wasting that copy rather than failing).
    Urgent,
}

impl Level {
    /// Ranks this level may evict, in the order they go.
    fn ranks(self) -> &'static [Rank] {
        use Rank::*;
        match self {
            Level::Guess => &[Released, Once, Normal],
            Level::Demand => &[Released, Once, Normal, PolicyPrefetched],
            Level::Urgent => &[Released, Once, Normal, PolicyPrefetched, HintPrefetched],
        }
    }
}

/// Where a tensor sits in one tier's index.
pub(crate) type Slot = Option<(Rank, VictimKey)>;

/// The rank `e`'s replica in `t` would have as a victim, or `None` if it cannot be evicted now:
/// no replica, held (views, pins, scopes), or in flight. A device copy of a tensor lent to the
/// CPU or to zero-copy kernels in another tier (with no pin or scope) may go: it is clean,
/// since the viewed replica exists.
pub(crate) fn rank_of(e: &Entry, t: Tier) -> Option<Rank> {
    let r = e.replicas[t.index()].as_ref()?;
    let lent_elsewhere = t == Tier::Device
        && e.pins == 0
        && e.scopes == 0
        && e.view_tier.is_some_and(|vt| vt != Tier::Device);
    if r.filling || e.in_flight() || (e.held() > 0 && !lent_elsewhere) {
        return None;
    }
    Some(match (t, e.prefetched) {
        (Tier::Device, Some(Source::Hint)) => Rank::HintPrefetched,
        (Tier::Device, Some(Source::Policy)) => Rank::PolicyPrefetched,
        _ if e.released => Rank::Released,
        (Tier::Device, _) if matches!(e.group, Group::Grad | Group::OptimizerState) => Rank::Once,
        _ => Rank::Normal,
    })
}

/// The ranked, ordered victims of every tier.
pub(crate) struct VictimIndex {
    sets: [[BTreeSet<(VictimKey, TensorId)>; RANKS]; 4],
    bytes: [[u64; RANKS]; 4],
    /// The policy epoch the keys were taken in.
    pub(crate) epoch: u64,
}

impl VictimIndex {
    pub(crate) fn new(epoch: u64) -> VictimIndex {
        VictimIndex { sets: Default::default(), bytes: [[0; RANKS]; 4], epoch }
    }

    /// Puts `id` where it belongs in every tier (`slots` is where it is now, updated).
    pub(crate) fn place(
        &mut self,
        policy: &dyn Policy,
        id: TensorId,
        e: &Entry,
        slots: &mut [Slot; 4],
    ) {
        for t in Tier::ALL {
            let want = rank_of(e, t).map(|r| (r, policy.victim_key(t, id)));
            let have = slots[t.index()];
            if want == have {
                continue;
            }
            let ti = t.index();
            if let Some((r, k)) = have {
                self.sets[ti][r as usize].remove(&(k, id));
                self.bytes[ti][r as usize] -= e.bytes();
            }
            if let Some((r, k)) = want {
                self.sets[ti][r as usize].insert((k, id));
                self.bytes[ti][r as usize] += e.bytes();
            }
            slots[ti] = want;
        }
    }

    /// Takes `id` out of every tier (it is being removed; `bytes` is its size).
    pub(crate) fn forget(&mut self, id: TensorId, bytes: u64, slots: &mut [Slot; 4]) {
        for t in Tier::ALL {
            if let Some((r, k)) = slots[t.index()].take() {
                self.sets[t.index()][r as usize].remove(&(k, id));
                self.bytes[t.index()][r as usize] -= bytes;
            }
        }
    }

    /// Empties the index (before rebuilding it under a new policy epoch).
    pub(crate) fn clear(&mut self, epoch: u64) {
        *self = VictimIndex::new(epoch);
    }

    /// Bytes that `level` may evict from `t`.
    pub(crate) fn evictable_bytes(&self, t: Tier, level: Level) -> u64 {
        level.ranks().iter().map(|&r| self.bytes[t.index()][r as usize]).sum()
    }

    /// Victims of `t` for `level` in order, never `exclude`.
    pub(crate) fn iter(
        &self,
        t: Tier,
        level: Level,
        exclude: TensorId,
    ) -> impl Iterator<Item = TensorId> + '_ {
        level
            .ranks()
            .iter()
            .flat_map(move |&r| self.sets[t.index()][r as usize].iter().map(|&(_, id)| id))
            .filter(move |&id| id != exclude)
    }

    /// Tensors indexed in `t` (all ranks), for consistency checks.
    #[cfg(test)]
    pub(crate) fn len(&self, t: Tier) -> usize {
        self.sets[t.index()].iter().map(BTreeSet::len).sum()
    }
}
