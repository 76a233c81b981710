//! [`FrequencyPolicy`]: least frequently used with aging, and a frequency check on admission.

use lru::LruCache;

use super::{Policy, VictimKey};
use crate::base::types::{TensorId, Tier};

/// Half-life of an access count when none is given, in accesses (to any tensor).
const DEFAULT_HALF_LIFE: u64 = 1024;

/// What is kept per tensor.
#[derive(Clone, Copy, Debug)]
struct Freq {
    /// Access count, decayed up to `last_tick`.
    count: f64,
    /// Global tick of the last access; also its recency rank.
    last_tick: u64,
}

/// Evicts the tensor with the fewest recent accesses, and promotes a tensor only when it is
/// accessed more than the tensors it would push out.
///
/// Each tensor has an access count that halves every `half_life` accesses (to any tensor): LFU
/// with aging, so a tensor that was hot long ago does not stay resident forever. The decay is
/// applied lazily: a tensor keeps `(count, last_tick)` and its score at tick `now` is
/// `count * 0.5^((now - last_tick) / half_life)`, so an access is O(1) and nothing is ever
/// rescanned.
///
/// Victims come in ascending score, ties to the least recently used. Promotion follows the
/// admission rule of TinyLFU (Einziger, Friedman and Manes, "TinyLFU: A Highly Efficient Cache
/// Admission Policy", ACM TOS 2017): a candidate gets in only when its frequency beats that of
/// every victim, so a one-off scan over many tensors cannot push a hot tensor out.
#[derive(Debug)]
pub struct FrequencyPolicy {
    /// Per-tensor counts, in recency order (`get_mut` on access moves an entry to the front).
    entries: LruCache<TensorId, Freq>,
    /// Accesses so far, to any tensor: the clock of the decay.
    tick: u64,
    half_life: f64,
}

impl FrequencyPolicy {
    /// A policy whose counts halve every 1024 accesses.
    pub fn new() -> Self {
        Self::with_half_life(DEFAULT_HALF_LIFE)
    }

    /// A policy whose counts halve every `accesses` accesses (to any tensor). Shorter forgets
    /// old heat sooner; 0 is taken as 1.
    pub fn with_half_life(accesses: u64) -> Self {
        FrequencyPolicy {
            entries: LruCache::unbounded(),
            tick: 0,
            half_life: accesses.max(1) as f64,
        }
    }

    /// Count of `f` decayed to tick `now`.
    fn decayed(&self, f: &Freq, now: u64) -> f64 {
        let age = now.saturating_sub(f.last_tick) as f64;
        f.count * (-age / self.half_life).exp2()
    }

    /// Current score and recency of `id`; `(0, 0)` (coldest, least recent) when unknown.
    fn score(&self, id: TensorId) -> (f64, u64) {
        self.entries.peek(&id).map_or((0.0, 0), |f| (self.decayed(f, self.tick), f.last_tick))
    }
}

impl Default for FrequencyPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl Policy for FrequencyPolicy {
    fn name(&self) -> &'static str {
        "frequency"
    }

    fn on_insert(&mut self, id: TensorId, _bytes: u64) {
        self.tick += 1;
        self.entries.put(id, Freq { count: 1.0, last_tick: self.tick });
    }

    fn on_access(&mut self, id: TensorId) {
        self.tick += 1;
        let now = self.tick;
        let half_life = self.half_life;
        // Unknown ids are ignored rather than inserted: a late access to a removed tensor must
        // not leave an entry that nothing would ever remove.
        if let Some(f) = self.entries.get_mut(&id) {
            let age = now.saturating_sub(f.last_tick) as f64;
            f.count = f.count * (-age / half_life).exp2() + 1.0;
            f.last_tick = now;
        }
    }

    fn on_remove(&mut self, id: TensorId) {
        self.entries.pop(&id);
    }

    fn victim_key(&self, _tier: Tier, id: TensorId) -> VictimKey {
        // The decayed count at any tick `now` is count * 2^((last_tick - now) / half_life): in
        // log2, log2(count) + last_tick / half_life, less a term common to every tensor. So this
        // key orders tensors as their decayed counts do at every tick, and changes only when the
        // tensor is accessed. Ties go to the least recent.
        match self.entries.peek(&id) {
            Some(f) => {
                VictimKey::new(1, f.count.log2() + f.last_tick as f64 / self.half_life, f.last_tick)
            }
            None => VictimKey::COLDEST,
        }
    }

    fn admit(&mut self, _tier: Tier, candidate: TensorId, victims: &[TensorId]) -> bool {
        if victims.is_empty() {
            return true;
        }
        let best_victim = victims.iter().map(|&v| self.score(v).0).fold(0.0, f64::max);
        self.score(candidate).0 > best_victim
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::placement::policy::tests::ordered;

    fn id(n: u32) -> TensorId {
        TensorId::test(n)
    }

    #[test]
    fn counts_decay_by_half_life() {
        let mut p = FrequencyPolicy::with_half_life(10);
        p.on_insert(id(1), 0);
        p.on_insert(id(2), 0);
        for _ in 0..10 {
            p.on_access(id(2));
        }
        // id 1 was last touched at tick 1 and the clock is now at 12.
        let (s, t) = p.score(id(1));
        assert_eq!(t, 1);
        assert!((s - 0.5f64.powf(11.0 / 10.0)).abs() < 1e-12, "{s}");
    }

    #[test]
    fn old_hot_tensor_loses_to_a_new_frequent_one() {
        let mut p = FrequencyPolicy::with_half_life(64);
        let (old, new) = (id(1), id(2));
        p.on_insert(old, 0);
        for _ in 0..200 {
            p.on_access(old);
        }
        p.on_insert(new, 0);
        for _ in 0..5 {
            p.on_access(new);
        }
        // Fresh, `new` is still far colder than `old`.
        assert!(!p.admit(Tier::Device, new, &[old]));
        let mut c = vec![old, new];
        ordered(&p, Tier::Device, &mut c);
        assert_eq!(c, vec![new, old]);
        // Other traffic ages `old` while `new` keeps being used now and then.
        for i in 0..2000u32 {
            p.on_insert(id(100 + i), 0);
            if i % 8 == 0 {
                p.on_access(new);
            }
        }
        assert!(p.admit(Tier::Device, new, &[old]));
        ordered(&p, Tier::Device, &mut c);
        assert_eq!(c, vec![old, new]);
    }

    #[test]
    fn ties_go_to_the_least_recent() {
        let mut p = FrequencyPolicy::with_half_life(u64::MAX);
        for n in [5, 3, 9] {
            p.on_insert(id(n), 0);
        }
        let mut c = vec![id(9), id(3), id(5), id(7)];
        ordered(&p, Tier::Disk, &mut c);
        // 7 is unknown (score 0); the rest tie at one access each.
        assert_eq!(c, vec![id(7), id(5), id(3), id(9)]);
    }

    #[test]
    fn recency_of_the_list_matches_the_ticks() {
        let mut p = FrequencyPolicy::new();
        for n in 0..6 {
            p.on_insert(id(n), 0);
        }
        for n in [3, 0, 5, 3] {
            p.on_access(id(n));
        }
        // LruCache iterates most recent first; ticks must fall along it.
        let ticks: Vec<u64> = p.entries.iter().map(|(_, f)| f.last_tick).collect();
        assert!(ticks.windows(2).all(|w| w[0] > w[1]), "{ticks:?}");
        assert_eq!(p.entries.peek_lru().map(|(k, _)| *k), Some(id(1)));
    }
}
