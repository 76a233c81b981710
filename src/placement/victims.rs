//! The victims of each tier, kept in order as tensors change rather than sorted per eviction.
//!
//! A tensor that could be demoted from a tier sits in one of that tier's ranked sets, ordered
//! by the policy's [`VictimKey`]. Ranks come first, the policy orders within a rank: released
//! tensors, then (on the device) gradients and optimizer state, which a training step touches
//! once, then everything else, then tensors prefetched by the policy's lookahead, then tensors
//! prefetched by a hint (only a view that cannot otherwise get room evicts those). Bytes per set
//! are summed as tensors come and go, so "could evicting make room?" is a sum of a few numbers.
//!
//! Each rank is split in two: *clean* victims, whose replica in the tier is a cache (a slower
//! tier holds the bytes too, so dropping it costs nothing), and *sole* ones, which must be
//! demoted by a copy. An eviction walks both in the policy's order, but once it knows that no
//! slower tier can take a sole copy now (full, or room there needs host work its caller does not
//! allow), it walks the clean ones alone: the cost of making room does not grow with the number
//! of victims that cannot move. A sole replica that can *never* move (no slower tier is enabled
//! that could ever hold it: a device-only store) is not a victim at all, and its bytes do not
//! count as evictable.
//!
//! A walk is a [`Cursor`]: where it stopped, so one allocation never looks at a victim twice.

use std::collections::BTreeSet;
use std::ops::Bound;

use crate::base::types::{Group, TensorId, Tier};
use crate::placement::policy::{Policy, VictimKey};
use crate::residency::{Entry, Source};
use crate::tiers::Fits;

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

/// Whether a victim's replica is a cache of a slower copy (dropped for free) or the tensor's
/// only copy at or below its tier (demoted by a copy).
const CLEAN: usize = 0;
const SOLE: usize = 1;

/// Where a tensor sits in one tier's index: its rank, its class (clean or sole) and its key.
pub(crate) type Slot = Option<(Rank, usize, VictimKey)>;

/// The rank and class `e`'s replica in `t` would have as a victim, or `None` if it cannot be
/// evicted now (no replica, held by views, pins or scopes, or in flight) or ever (a sole copy
/// no slower tier could hold). A device copy of a tensor lent to the CPU or to zero-copy kernels
/// in another tier (with no pin or scope) may go: it is clean, since the viewed replica exists.
pub(crate) fn rank_of(e: &Entry, t: Tier, fits: &Fits) -> Option<(Rank, usize)> {
    let r = e.replicas[t.index()].as_ref()?;
    let lent_elsewhere = t == Tier::Device
        && e.pins == 0
        && e.scopes == 0
        && e.view_tier.is_some_and(|vt| vt != Tier::Device);
    if r.filling || e.in_flight() || (e.held() > 0 && !lent_elsewhere) {
        return None;
    }
    let clean = Tier::ALL
        .into_iter()
        .any(|s| s > t && e.replicas[s.index()].as_ref().is_some_and(|r| !r.filling));
    if !clean && !fits.movable_from(t, e.bytes()) {
        return None;
    }
    let rank = match (t, e.prefetched) {
        (Tier::Device, Some(Source::Hint)) => Rank::HintPrefetched,
        (Tier::Device, Some(Source::Policy)) => Rank::PolicyPrefetched,
        _ if e.released => Rank::Released,
        (Tier::Device, _) if matches!(e.group, Group::Grad | Group::OptimizerState) => Rank::Once,
        _ => Rank::Normal,
    };
    Some((rank, if clean { CLEAN } else { SOLE }))
}

/// A walk through one tier's victims in order: the rank it is in and the last victim it gave.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Cursor {
    rank: usize,
    last: Option<(VictimKey, TensorId)>,
}

/// One rank of one tier: its clean victims and its sole ones, each in key order.
type RankSets = [BTreeSet<(VictimKey, TensorId)>; 2];

/// The ranked, ordered victims of every tier.
pub(crate) struct VictimIndex {
    sets: [[RankSets; RANKS]; 4],
    /// Where each tensor sits in each tier's index, by the tensor's slab slot (a removed
    /// tensor's slots are emptied by [`VictimIndex::forget`] before its slot is reused).
    slots: Vec<[Slot; 4]>,
    bytes: [[u64; RANKS]; 4],
    fits: Fits,
    /// The policy epoch the keys are being brought to.
    pub(crate) epoch: u64,
    /// While keys of an older epoch remain: the next slab slot to re-key.
    pub(crate) rekey_from: Option<usize>,
}

impl VictimIndex {
    pub(crate) fn new(epoch: u64) -> VictimIndex {
        VictimIndex {
            sets: Default::default(),
            slots: Vec::new(),
            bytes: [[0; RANKS]; 4],
            fits: Fits::default(),
            epoch,
            rekey_from: None,
        }
    }

    /// Sets what each tier could ever hold (at build, before any tensor).
    pub(crate) fn set_fits(&mut self, fits: Fits) {
        self.fits = fits;
    }

    /// Where `id` sits in each tier's index now (all `None` when it is in none).
    #[cfg(test)]
    pub(crate) fn slots(&self, id: TensorId) -> [Slot; 4] {
        self.slots.get(id.slot() as usize).copied().unwrap_or_default()
    }

    /// Puts `id`, whose entry is `e`, where it belongs in every tier.
    pub(crate) fn place(&mut self, policy: &dyn Policy, id: TensorId, e: &Entry) {
        let i = id.slot() as usize;
        if i >= self.slots.len() {
            self.slots.resize(i + 1, [None; 4]);
        }
        for t in Tier::ALL {
            let want = rank_of(e, t, &self.fits).map(|(r, c)| (r, c, policy.victim_key(t, id)));
            let ti = t.index();
            let have = self.slots[i][ti];
            if want == have {
                continue;
            }
            if let Some((r, c, k)) = have {
                self.sets[ti][r as usize][c].remove(&(k, id));
                self.bytes[ti][r as usize] -= e.bytes();
            }
            if let Some((r, c, k)) = want {
                self.sets[ti][r as usize][c].insert((k, id));
                self.bytes[ti][r as usize] += e.bytes();
            }
            self.slots[i][ti] = want;
        }
    }

    /// Takes `id` out of every tier (it is being removed; `bytes` is its size).
    pub(crate) fn forget(&mut self, id: TensorId, bytes: u64) {
        let Some(slots) = self.slots.get_mut(id.slot() as usize) else { return };
        for t in Tier::ALL {
            if let Some((r, c, k)) = slots[t.index()].take() {
                self.sets[t.index()][r as usize][c].remove(&(k, id));
                self.bytes[t.index()][r as usize] -= bytes;
            }
        }
    }

    /// Bytes that `level` may evict from `t`.
    pub(crate) fn evictable_bytes(&self, t: Tier, level: Level) -> u64 {
        level.ranks().iter().map(|&r| self.bytes[t.index()][r as usize]).sum()
    }

    /// The next victim of `t` for `level` after `cur` (advanced past it), never `exclude`;
    /// with `clean_only`, only victims whose replica a slower copy backs. O(log n) a step.
    pub(crate) fn next(
        &self,
        t: Tier,
        level: Level,
        cur: &mut Cursor,
        clean_only: bool,
        exclude: TensorId,
    ) -> Option<TensorId> {
        let ranks = level.ranks();
        while let Some(&r) = ranks.get(cur.rank) {
            let sets = &self.sets[t.index()][r as usize];
            let from = match cur.last {
                Some(k) => Bound::Excluded(k),
                None => Bound::Unbounded,
            };
            let clean = sets[CLEAN].range((from, Bound::Unbounded)).next();
            let sole =
                if clean_only { None } else { sets[SOLE].range((from, Bound::Unbounded)).next() };
            let pick = match (clean, sole) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            match pick {
                Some(&(k, id)) => {
                    cur.last = Some((k, id));
                    if id != exclude {
                        return Some(id);
                    }
                }
                None => {
                    cur.rank += 1;
                    cur.last = None;
                }
            }
        }
        None
    }

    /// Victims of `t` for `level` in order, never `exclude`.
    pub(crate) fn iter(
        &self,
        t: Tier,
        level: Level,
        exclude: TensorId,
    ) -> impl Iterator<Item = TensorId> + '_ {
        let mut cur = Cursor::default();
        std::iter::from_fn(move || self.next(t, level, &mut cur, false, exclude))
    }

    /// Tensors indexed in `t` (all ranks), for consistency checks.
    #[cfg(test)]
    pub(crate) fn len(&self, t: Tier) -> usize {
        self.sets[t.index()].iter().flatten().map(BTreeSet::len).sum()
    }
}
