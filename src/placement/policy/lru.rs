//! [`LruPolicy`]: least recently used first.

use lru::LruCache;

use super::{Policy, VictimKey};
use crate::base::types::{TensorId, Tier};

/// Evicts the least recently used tensor first and always admits a promotion.
///
/// The classic baseline: cheap and good for workloads with recency locality, but a single scan
/// over many tensors flushes every hot one (see [`FrequencyPolicy`](super::FrequencyPolicy) for
/// the remedy).
#[derive(Debug)]
pub struct LruPolicy {
    /// Recency list; each entry holds the tick of its last access, so a subset of tensors can
    /// be put in list order by sorting instead of by walking the whole list.
    entries: LruCache<TensorId, u64>,
    /// Accesses so far, to any tensor.
    tick: u64,
}

impl LruPolicy {
    /// An empty policy.
    pub fn new() -> Self {
        LruPolicy { entries: LruCache::unbounded(), tick: 0 }
    }
}

impl Default for LruPolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl Policy for LruPolicy {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn on_insert(&mut self, id: TensorId, _bytes: u64) {
        self.tick += 1;
        self.entries.put(id, self.tick);
    }

    fn on_access(&mut self, id: TensorId) {
        self.tick += 1;
        // Unknown ids are ignored so that a late access cannot resurrect a removed tensor.
        if let Some(t) = self.entries.get_mut(&id) {
            *t = self.tick;
        }
    }

    fn on_remove(&mut self, id: TensorId) {
        self.entries.pop(&id);
    }

    fn victim_key(&self, _tier: Tier, id: TensorId) -> VictimKey {
        // Unknown ids get tick 0: least recent of all.
        let tick = self.entries.peek(&id).copied().unwrap_or(0);
        VictimKey::new(0, 0.0, tick)
    }

    fn admit(&mut self, _tier: Tier, _candidate: TensorId, _victims: &[TensorId]) -> bool {
        true
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
    fn least_recent_first() {
        let mut p = LruPolicy::new();
        for n in 0..4 {
            p.on_insert(id(n), 0);
        }
        p.on_access(id(0));
        p.on_access(id(2));
        let mut c = vec![id(0), id(1), id(2), id(3)];
        ordered(&p, Tier::Device, &mut c);
        assert_eq!(c, vec![id(1), id(3), id(0), id(2)]);
        assert_eq!(p.entries.peek_lru().map(|(k, _)| *k), Some(id(1)));
        assert!(p.admit(Tier::Device, id(1), &[id(2)]));
    }
}
