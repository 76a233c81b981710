//! Eviction and promotion policies.
//!
//! The store asks a [`Policy`] two questions: which tensors to demote when a tier is full
//! ([`Policy::order_victims`]) and whether a tensor from a slower tier is worth promoting at the
//! cost of those victims ([`Policy::admit`]). A policy may also look ahead: the store asks
//! [`Policy::lookahead`] after each access which tensors to prefetch. Three are built in, a file
//! each: [`FrequencyPolicy`] (the default), [`LruPolicy`], and [`SchedulePolicy`], which learns
//! the repeating access order of a training step.

use std::fmt;
use std::str::FromStr;

use crate::types::{TensorId, Tier};

mod frequency;
mod lru;
mod schedule;

pub use frequency::FrequencyPolicy;
pub use lru::LruPolicy;
pub use schedule::SchedulePolicy;

/// Decides which tensors to demote from a full tier and whether a tensor deserves promotion.
///
/// The store calls these under its own lock, so implementations need no locking. `on_access` is
/// on every read/move/view: keep it O(1).
///
/// Ids that were never inserted (or were removed) may reach [`Policy::order_victims`] and
/// [`Policy::admit`]; implementations must not panic on them, and should treat them as the
/// coldest tensors there are.
pub trait Policy: Send + 'static {
    /// Short name, as shown in stats and accepted by [`PolicyKind`]'s `FromStr` for built-ins.
    fn name(&self) -> &'static str;
    /// A tensor was put (counts as its first access).
    fn on_insert(&mut self, id: TensorId, bytes: u64);
    /// A tensor was accessed (read, write, move_to, view).
    fn on_access(&mut self, id: TensorId);
    /// A tensor was removed; forget it.
    fn on_remove(&mut self, id: TensorId);
    /// Sorts `candidates` (tensors of one tier that may be demoted) so the best victim comes
    /// first. `tier` is the tier being made room in.
    fn order_victims(&mut self, tier: Tier, candidates: &mut Vec<TensorId>);
    /// Whether `candidate` (in a slower tier) should be promoted into `tier` at the cost of
    /// demoting `victims` (already chosen by order_victims, possibly empty when there is free
    /// room).
    fn admit(&mut self, tier: Tier, candidate: TensorId, victims: &[TensorId]) -> bool;
    /// A training step begins ([`Store::step`](crate::Store::step)). Default: nothing.
    fn on_step(&mut self) {}
    /// Tensors the policy expects to be used soon, soonest first, to be prefetched to the
    /// device. `cost(id)` is the number of bytes prefetching `id` would move (0 when it is
    /// already resident or in flight; `None` for an unknown id); stop once the costs reach
    /// `max_bytes`. Called after every access, so keep it cheap. Default: nothing.
    fn lookahead(
        &mut self,
        max_bytes: u64,
        cost: &mut dyn FnMut(TensorId) -> Option<u64>,
    ) -> Vec<TensorId> {
        let _ = (max_bytes, cost);
        Vec::new()
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

    fn id(n: u64) -> TensorId {
        TensorId(n)
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
        p.order_victims(Tier::Device, &mut c);
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
            p.order_victims(Tier::Pinned, &mut c);
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
            p.order_victims(Tier::Device, &mut c);
            assert_eq!(c[0], id(0), "{kind}");
            // An access after removal does not bring it back.
            p.on_access(id(0));
            p.order_victims(Tier::Device, &mut c);
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
