//! Eviction and promotion policies.
//!
//! The store asks a [`Policy`] two questions: in what order to demote tensors when a tier is full
//! ([`Policy::victim_key`]) and whether a tensor from a slower tier is worth promoting at the
//! cost of those victims ([`Policy::admit`]). A policy may also look ahead: the store asks
//! [`Policy::lookahead`] after each access which tensors to prefetch. Three are built in, a file
//! each: [`FrequencyPolicy`] (the default), [`LruPolicy`], and [`SchedulePolicy`], which learns
//! the repeating access order of a training step.
//!
//! The eviction order is kept by the store, not recomputed per eviction: each tensor that could
//! be evicted sits in an ordered index under the key the policy gave it, and the store asks for a
//! tensor's key again only when the policy may have changed it (after `on_insert` and
//! `on_access` of that tensor, or for every tensor when [`Policy::epoch`] changes). An eviction
//! therefore costs the same with a thousand tensors as with a hundred thousand.

use std::cmp::Ordering;
use std::fmt;
use std::str::FromStr;

use crate::base::types::{TensorId, Tier};

mod frequency;
mod lru;
mod schedule;

pub use frequency::FrequencyPolicy;
pub use lru::LruPolicy;
pub use schedule::SchedulePolicy;

/// A tensor's place in a policy's eviction order: the lowest key is demoted first. Compared by
/// `class`, then `score` (total order: NaN above everything), then `tick`.
#[derive(Clone, Copy, Debug)]
pub struct VictimKey {
    /// Coarse order: every tensor of a lower class goes before any of a higher one.
    pub class: u32,
    /// Order within a class.
    pub score: f64,
    /// Tie-break (a recency tick, for example).
    pub tick: u64,
}

impl VictimKey {
    /// A key from its parts.
    pub const fn new(class: u32, score: f64, tick: u64) -> VictimKey {
        VictimKey { class, score, tick }
    }

    /// The key of a tensor a policy knows nothing of: before every other.
    pub const COLDEST: VictimKey = VictimKey { class: 0, score: f64::NEG_INFINITY, tick: 0 };
}

impl PartialEq for VictimKey {
    fn eq(&self, o: &VictimKey) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for VictimKey {}
impl PartialOrd for VictimKey {
    fn partial_cmp(&self, o: &VictimKey) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for VictimKey {
    fn cmp(&self, o: &VictimKey) -> Ordering {
        self.class.cmp(&o.class).then(self.score.total_cmp(&o.score)).then(self.tick.cmp(&o.tick))
    }
}

/// Decides in what order tensors are demoted from a full tier and whether a tensor deserves
/// promotion. Three are built in ([`PolicyKind`]): [`FrequencyPolicy`] (the default),
/// [`LruPolicy`], and [`SchedulePolicy`], which learns the repeating access order of a training
/// step.
///
/// The store keeps the eviction order itself rather than recomputing it per eviction: each
/// tensor that could be evicted sits in an ordered index under the key the policy gave it, and
/// the store asks for a tensor's key again only when the policy may have changed it (after
/// `on_insert` and `on_access` of that tensor, or for every tensor when [`Policy::epoch`]
/// changes), so an eviction costs the same with a thousand tensors as with a hundred thousand.
///
/// The store calls these under its own lock, so implementations need no locking. `on_access`
/// is on every read, move and view, and `victim_key` after it: keep both O(1) or O(log n).
///
/// The store trusts nothing a policy says beyond its type: ids it never inserted (or removed)
/// may reach [`Policy::victim_key`] and [`Policy::admit`], and must not make it panic (treat
/// them as the coldest tensors there are); ids a policy returns from [`Policy::lookahead`] that
/// are unknown are skipped.
pub trait Policy: Send + 'static {
    /// Short name, as shown in stats and accepted by [`PolicyKind`]'s `FromStr` for built-ins.
    fn name(&self) -> &'static str;
    /// A tensor was put (counts as its first access).
    fn on_insert(&mut self, id: TensorId, bytes: u64);
    /// A tensor was accessed (read, write, move_to, view).
    fn on_access(&mut self, id: TensorId);
    /// A tensor was removed; forget it.
    fn on_remove(&mut self, id: TensorId);
    /// Where `id` stands in the order of victims of `tier`: the lowest key goes first. A key
    /// may change only with an `on_insert` or `on_access` of `id`, or when [`Policy::epoch`]
    /// changes (the store keeps the keys it was given in an index until then).
    fn victim_key(&self, tier: Tier, id: TensorId) -> VictimKey;
    /// Changes whenever keys may have changed for many tensors at once (a schedule learned or
    /// given up): the store then asks for every key again. Default: never.
    fn epoch(&self) -> u64 {
        0
    }
    /// Whether `candidate` (in a slower tier) should be promoted into `tier` at the cost of
    /// demoting `victims` (the first in the victim order, possibly none when there is room).
    fn admit(&mut self, tier: Tier, candidate: TensorId, victims: &[TensorId]) -> bool;
    /// A training step begins ([`Store::step`](crate::Store::step)). Default: nothing.
    fn on_step(&mut self) {}
    /// Tensors the policy expects to be used soon, soonest first, to be prefetched to the
    /// device: pushed onto `out` (empty on entry). `cost(id)` is the number of bytes
    /// prefetching `id` would move (0 when it is already resident or in flight; `None` for an
    /// unknown id); stop once the costs reach `max_bytes`. Called after every access, so keep it
    /// cheap. Default: nothing.
    fn lookahead(
        &mut self,
        max_bytes: u64,
        cost: &mut dyn FnMut(TensorId) -> Option<u64>,
        out: &mut Vec<TensorId>,
    ) {
        let _ = (max_bytes, cost, out);
    }
}

/// The built-in policies, by name (for the builder and the CLI: "frequency", "lru").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum PolicyKind {
    /// [`FrequencyPolicy`]: decayed access counts, with an admission check on promotion.
    #[default]
    Frequency,
    /// [`LruPolicy`]: least recently used first, always admits.
    Lru,
    /// [`SchedulePolicy`]: records the access order of a step, then prefetches along it and
    /// evicts the tensor whose next use is furthest away.
    Schedule,
}

impl PolicyKind {
    /// Every built-in policy, the default first.
    pub const ALL: [PolicyKind; 3] = [PolicyKind::Frequency, PolicyKind::Lru, PolicyKind::Schedule];

    /// A fresh policy of this kind, with its default settings.
    pub fn build(self) -> Box<dyn Policy> {
        match self {
            PolicyKind::Frequency => Box::new(FrequencyPolicy::new()),
            PolicyKind::Lru => Box::new(LruPolicy::new()),
            PolicyKind::Schedule => Box::new(SchedulePolicy::new()),
        }
    }

    /// Lower-case name, as printed and as accepted by [`str::parse`].
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Frequency => "frequency",
            PolicyKind::Lru => "lru",
            PolicyKind::Schedule => "schedule",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<PolicyKind> {
        PolicyKind::ALL.into_iter().find(|k| k.name().eq_ignore_ascii_case(s.trim())).ok_or_else(
            || {
                crate::Error::InvalidArgument(format!(
                    "unknown policy {s:?} (try frequency, lru, schedule)"
                ))
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u32) -> TensorId {
        TensorId::test(n)
    }

    /// `candidates` in the policy's victim order.
    pub(crate) fn ordered(p: &dyn Policy, tier: Tier, candidates: &mut [TensorId]) {
        candidates.sort_by_key(|&id| (p.victim_key(tier, id), id));
    }

    /// Inserts A..E (ids 0..5), reads A ten times, then scans B, C, D, E once each.
    fn hot_then_scan(p: &mut dyn Policy) {
        for n in 0..5 {
            p.on_insert(id(n), 1 << 20);
        }
        for _ in 0..10 {
            p.on_access(id(0));
        }
        for n in 1..5 {
            p.on_access(id(n));
        }
    }

    fn victims_after_scan(kind: PolicyKind) -> Vec<TensorId> {
        let mut p = kind.build();
        hot_then_scan(&mut *p);
        let mut c: Vec<TensorId> = (0..5).map(id).collect();
        ordered(&*p, Tier::Device, &mut c);
        c
    }

    #[test]
    fn frequency_keeps_the_hot_tensor_lru_evicts_it() {
        let f = victims_after_scan(PolicyKind::Frequency);
        assert_eq!(f.last(), Some(&id(0)), "frequency demotes A last: {f:?}");
        // The scanned ones all have two accesses; least recent first breaks the ties.
        assert_eq!(f, vec![id(1), id(2), id(3), id(4), id(0)]);
        let l = victims_after_scan(PolicyKind::Lru);
        assert_eq!(l, vec![id(0), id(1), id(2), id(3), id(4)], "LRU demotes A first");
    }

    #[test]
    fn frequency_refuses_a_one_off_over_a_hot_victim_lru_admits() {
        for kind in [PolicyKind::Frequency, PolicyKind::Lru] {
            let mut p = kind.build();
            hot_then_scan(&mut *p);
            p.on_insert(id(9), 1 << 20);
            let admitted = p.admit(Tier::Device, id(9), &[id(0)]);
            assert_eq!(admitted, kind == PolicyKind::Lru, "{kind}");
            // With room to spare every policy admits.
            assert!(p.admit(Tier::Device, id(9), &[]), "{kind}");
        }
    }

    #[test]
    fn unknown_ids_do_not_panic_and_go_first() {
        for kind in PolicyKind::ALL {
            let mut p = kind.build();
            p.on_insert(id(1), 8);
            p.on_access(id(77)); // never inserted: ignored
            let mut c = vec![id(1), id(42)];
            ordered(&*p, Tier::Pinned, &mut c);
            assert_eq!(c, vec![id(42), id(1)], "{kind}");
            let _ = p.admit(Tier::Pinned, id(42), &[id(43)]);
            p.on_remove(id(42));
        }
    }

    #[test]
    fn removed_tensors_are_forgotten() {
        for kind in PolicyKind::ALL {
            let mut p = kind.build();
            hot_then_scan(&mut *p);
            p.on_remove(id(0));
            // A is now unknown: coldest and least recent, so first in line again.
            let mut c: Vec<TensorId> = (0..5).map(id).collect();
            ordered(&*p, Tier::Device, &mut c);
            assert_eq!(c[0], id(0), "{kind}");
            // An access after removal does not bring it back.
            p.on_access(id(0));
            ordered(&*p, Tier::Device, &mut c);
            assert_eq!(c[0], id(0), "{kind}");
        }
    }

    #[test]
    fn kinds_parse_and_print() {
        assert_eq!(PolicyKind::default(), PolicyKind::Frequency);
        for k in PolicyKind::ALL {
            assert_eq!(k.to_string().parse::<PolicyKind>().unwrap(), k);
            assert_eq!(k.build().name(), k.name());
        }
        assert_eq!("LRU".parse::<PolicyKind>().unwrap(), PolicyKind::Lru);
        assert!(matches!("arc".parse::<PolicyKind>(), Err(crate::Error::InvalidArgument(_))));
    }
}
