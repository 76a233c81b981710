//! Schedule learning: a training step repeats the same order of tensor accesses, so record it once
//! and then use it twice — to prefetch along it (lookahead) and to evict the tensor whose next use
//! is furthest away (Belady's MIN rule, optimal for a known future: L. A. Belady, "A study of
//! replacement algorithms for a virtual-storage computer", IBM Systems Journal 5(2), 1966).
//!
//! The schedule is learned in one of two ways: between two calls of
//! [`Store::step`](crate::Store::step), or, without them, by spotting the period of the access
//! sequence (a recorded prefix that starts repeating itself). Replaying costs one comparison per
//! access; an access that differs from the schedule switches back to recording, and the schedule
//! is replaced once the new order is known, so a changed loop is relearned rather than given up
//! on. Until a schedule is known, and for tensors it does not mention, the decisions fall back to
//! a [`FrequencyPolicy`].

use std::collections::HashMap;

use super::{FrequencyPolicy, Policy, VictimKey};
use crate::base::types::{TensorId, Tier};

/// Longest access sequence recorded while looking for a schedule.
const MAX_RECORD: usize = 1 << 20;
/// Longest walk along the schedule per lookahead call.
const MAX_WALK: usize = 512;

/// The schedule-learning policy ([`PolicyKind::Schedule`](super::PolicyKind::Schedule)).
pub struct SchedulePolicy {
    fallback: FrequencyPolicy,
    /// Accesses since recording (re)started.
    rec: Vec<TensorId>,
    /// Periods being checked: (period, how many accesses after it matched so far).
    candidates: Vec<(usize, usize)>,
    /// The learned schedule, one step of accesses.
    schedule: Vec<TensorId>,
    /// Positions of each id in `schedule`, ascending.
    positions: HashMap<TensorId, Vec<usize>>,
    /// Index in `schedule` of the next expected access, while replaying.
    pos: Option<usize>,
    /// Schedules learned so far (a relearn after divergence counts again).
    learned: u64,
    /// Accesses that did not match the schedule.
    divergences: u64,
    /// Accesses so far: the clock next uses are measured on, so a tensor's victim key (its next
    /// use, absolute) stays the same while replaying until the tensor itself is used.
    clock: u64,
    /// Bumped whenever the victim keys may change for many tensors (a schedule adopted, replay
    /// given up), so the store asks for them again.
    epoch: u64,
    /// Generation stamps of the lookahead walk, per schedule position: a tensor already taken in
    /// this walk is skipped without searching the output (see `lookahead`).
    walk_gen: u64,
    walk_seen: HashMap<TensorId, u64>,
}

impl Default for SchedulePolicy {
    fn default() -> Self {
        Self::new()
    }
}

impl SchedulePolicy {
    /// A policy with no schedule yet.
    pub fn new() -> Self {
        SchedulePolicy {
            fallback: FrequencyPolicy::new(),
            rec: Vec::new(),
            candidates: Vec::new(),
            schedule: Vec::new(),
            positions: HashMap::new(),
            pos: None,
            learned: 0,
            divergences: 0,
            clock: 0,
            epoch: 0,
            walk_gen: 0,
            walk_seen: HashMap::new(),
        }
    }

    /// The learned step, if any.
    pub fn schedule(&self) -> &[TensorId] {
        &self.schedule
    }

    /// Whether accesses are being replayed against a learned schedule.
    pub fn replaying(&self) -> bool {
        self.pos.is_some()
    }

    /// How many times a schedule was learned, and how many accesses diverged from one.
    pub fn counts(&self) -> (u64, u64) {
        (self.learned, self.divergences)
    }

    fn adopt(&mut self, schedule: Vec<TensorId>, pos: usize) {
        self.positions.clear();
        for (i, &id) in schedule.iter().enumerate() {
            self.positions.entry(id).or_default().push(i);
        }
        self.schedule = schedule;
        self.pos = Some(pos % self.schedule.len().max(1));
        self.rec.clear();
        self.candidates.clear();
        self.learned += 1;
        self.epoch += 1;
    }

    /// Stops replaying (the keys fall back to the frequency policy's).
    fn give_up(&mut self) {
        self.divergences += 1;
        self.pos = None;
        self.rec.clear();
        self.candidates.clear();
        self.epoch += 1;
    }

    fn record(&mut self, id: TensorId) {
        if self.rec.len() >= MAX_RECORD {
            self.rec.clear();
            self.candidates.clear();
        }
        let n = self.rec.len();
        // Check the open candidates: with period p, access n must equal access n - p.
        let rec = &self.rec;
        self.candidates.retain_mut(|(p, matched)| {
            if rec[n - *p] == id {
                *matched += 1;
                true
            } else {
                false
            }
        });
        self.rec.push(id);
        // A period is confirmed once a whole period has repeated.
        if let Some(&(p, _)) = self.candidates.iter().find(|&&(p, m)| m >= p) {
            let sched = self.rec[..p].to_vec();
            // The next access is the one after the repeat: position (n + 1) mod p.
            self.adopt(sched, n + 1);
            return;
        }
        // The first access reappearing opens a candidate period.
        if n > 0 && self.rec[0] == id {
            self.candidates.push((n, 1));
        }
    }

    /// Accesses until `id` is next used, from the current position (cyclic); `None` if the
    /// schedule does not mention it.
    fn next_use(&self, id: TensorId) -> Option<usize> {
        let pos = self.pos?;
        let ps = self.positions.get(&id)?;
        let len = self.schedule.len();
        Some(match ps.binary_search(&pos) {
            Ok(_) => 0,
            Err(i) if i < ps.len() => ps[i] - pos,
            Err(_) => ps[0] + len - pos,
        })
    }
}

impl Policy for SchedulePolicy {
    fn name(&self) -> &'static str {
        "schedule"
    }

    fn on_insert(&mut self, id: TensorId, bytes: u64) {
        self.fallback.on_insert(id, bytes);
    }

    fn on_access(&mut self, id: TensorId) {
        self.fallback.on_access(id);
        self.clock += 1;
        match self.pos {
            Some(p) if self.schedule.get(p) == Some(&id) => {
                self.pos = Some((p + 1) % self.schedule.len());
            }
            Some(_) => {
                // Diverged: keep the old schedule for eviction order until a new one is known,
                // but stop trusting the position for lookahead.
                self.give_up();
                self.record(id);
            }
            None => self.record(id),
        }
    }

    fn on_remove(&mut self, id: TensorId) {
        self.fallback.on_remove(id);
    }

    fn on_step(&mut self) {
        match self.pos {
            // A step boundary while replaying: the step must have ended where it began.
            Some(0) => {}
            Some(_) => self.give_up(),
            // While recording, the accesses since the last boundary are one step.
            None if !self.rec.is_empty() => {
                let step = std::mem::take(&mut self.rec);
                self.adopt(step, 0);
            }
            None => {}
        }
    }

    fn victim_key(&self, tier: Tier, id: TensorId) -> VictimKey {
        let fallback = self.fallback.victim_key(tier, id);
        match self.next_use(id) {
            // Belady: the furthest next use first. Measured from the start of the clock, the
            // next use of a tensor stays put while the replay advances, until the tensor is used.
            Some(d) => VictimKey::new(2, -((self.clock + d as u64) as f64), 0),
            // Tensors the schedule never uses go before all of them, in the fallback's order
            // (and every tensor does while nothing is replayed).
            None => fallback,
        }
    }

    fn epoch(&self) -> u64 {
        self.epoch
    }

    fn admit(&mut self, tier: Tier, candidate: TensorId, victims: &[TensorId]) -> bool {
        if self.pos.is_none() || victims.is_empty() {
            return self.fallback.admit(tier, candidate, victims);
        }
        let mine = self.next_use(candidate).unwrap_or(usize::MAX);
        victims.iter().all(|&v| self.next_use(v).unwrap_or(usize::MAX) > mine)
    }

    fn lookahead(
        &mut self,
        max_bytes: u64,
        cost: &mut dyn FnMut(TensorId) -> Option<u64>,
        out: &mut Vec<TensorId>,
    ) {
        let Some(pos) = self.pos else { return };
        let len = self.schedule.len();
        // A tensor can appear several times in the walk: a generation stamp per tensor says
        // whether this walk took it already, without searching `out` (which made the walk
        // quadratic in its length).
        self.walk_gen += 1;
        if self.walk_seen.len() > 4 * MAX_WALK {
            self.walk_seen.clear();
        }
        let mut bytes = 0u64;
        for k in 0..len.min(MAX_WALK) {
            let id = self.schedule[(pos + k) % len];
            let Some(c) = cost(id) else { continue };
            if c == 0 || self.walk_seen.get(&id) == Some(&self.walk_gen) {
                continue;
            }
            if bytes + c > max_bytes {
                break;
            }
            bytes += c;
            self.walk_seen.insert(id, self.walk_gen);
            out.push(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::placement::policy::tests::ordered;

    fn id(n: u32) -> TensorId {
        TensorId::test(n)
    }

    fn ahead(
        p: &mut SchedulePolicy,
        max: u64,
        cost: &mut dyn FnMut(TensorId) -> Option<u64>,
    ) -> Vec<TensorId> {
        let mut out = Vec::new();
        p.lookahead(max, cost, &mut out);
        out
    }

    /// Forward 0..l then backward l..0, as a layered training step accesses weights.
    fn step(l: u32) -> Vec<TensorId> {
        (0..l).chain((0..l).rev()).map(id).collect()
    }

    #[test]
    fn learns_a_forward_backward_step_without_markers() {
        let mut p = SchedulePolicy::new();
        for n in 0..6 {
            p.on_insert(id(n), 1);
        }
        for _ in 0..2 {
            for a in step(6) {
                p.on_access(a);
            }
        }
        assert!(p.replaying(), "schedule learned after two steps");
        assert_eq!(p.schedule(), &step(6)[..]);
        // Next expected access is layer 0 of the next forward pass: lookahead says 0, 1, ...
        let got = ahead(&mut p, 3, &mut |_| Some(1));
        assert_eq!(got, vec![id(0), id(1), id(2)]);
    }

    #[test]
    fn step_markers_define_the_schedule() {
        let mut p = SchedulePolicy::new();
        p.on_step();
        for a in [3, 1, 2].map(id) {
            p.on_access(a);
        }
        p.on_step();
        assert!(p.replaying());
        assert_eq!(p.schedule(), &[id(3), id(1), id(2)]);
        // Belady: right at the start of a step, 2 is used last, so it goes first.
        let mut c = vec![id(3), id(1), id(2)];
        ordered(&p, Tier::Device, &mut c);
        assert_eq!(c, vec![id(2), id(1), id(3)]);
        // Keys stay put while the replay advances: after using 3, it is the furthest.
        let e = p.epoch();
        p.on_access(id(3));
        assert_eq!(p.epoch(), e, "a matching access changes no other key");
        ordered(&p, Tier::Device, &mut c);
        assert_eq!(c, vec![id(3), id(2), id(1)]);
    }

    #[test]
    fn divergence_relearns() {
        let mut p = SchedulePolicy::new();
        for _ in 0..2 {
            for a in [1, 2, 3].map(id) {
                p.on_access(a);
            }
        }
        assert!(p.replaying());
        // The loop changes to 1, 4, 3.
        for _ in 0..3 {
            for a in [1, 4, 3].map(id) {
                p.on_access(a);
            }
        }
        assert!(p.replaying());
        assert_eq!(p.counts().1, 1, "one divergence");
        let mut s = p.schedule().to_vec();
        s.sort();
        assert_eq!(s, vec![id(1), id(3), id(4)], "a rotation of the new step");
    }

    #[test]
    fn lookahead_skips_resident_and_stops_at_the_budget() {
        let mut p = SchedulePolicy::new();
        p.on_step();
        for a in (0..5).map(id) {
            p.on_access(a);
        }
        p.on_step();
        let got = ahead(&mut p, 25, &mut |t| Some(if t == id(1) { 0 } else { 10 }));
        assert_eq!(got, vec![id(0), id(2)], "1 is resident, 3 would pass 25 bytes");
        assert!(ahead(&mut SchedulePolicy::new(), 100, &mut |_| Some(1)).is_empty());
        // A tensor used twice in the step is taken once.
        let mut p = SchedulePolicy::new();
        p.on_step();
        for a in [0, 1, 1, 0, 2].map(id) {
            p.on_access(a);
        }
        p.on_step();
        assert_eq!(ahead(&mut p, 100, &mut |_| Some(1)), vec![id(0), id(1), id(2)]);
    }
}
