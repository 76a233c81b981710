//! Making room in a tier: victims in placement's order are dropped (when a slower tier has a
//! copy), demoted by an issued DMA (device to host memory), or spilled by host work (host memory
//! to the disk, device through staging to the disk) without the lock.
//!
//! Dropping a replica never blocks: its memory is freed once the work still touching it is done
//! (device memory is reused in stream order). Memory whose work is still running is waited for,
//! without the lock. Tensors in another thread's flight are not victims, and their flights are
//! not waited for: the caller holds a flight of its own, and two threads each waiting for the
//! other's flight would wait forever. Memory they hold counts as taken.

use super::copy::HostCopy;
use super::{prepare_copy, run_copy};
use super::{Locked, Shared, State};
use crate::backend::{Pending, RawEvent, RawStream};
use crate::base::error::Result;
use crate::base::types::{TensorId, Tier};
use crate::placement::victims::{Cursor, Level};
use crate::residency::{Flight, Replica};
use crate::tiers::Ext;
use std::sync::Arc;

/// What an allocation got.
pub(crate) enum Got {
    /// The extent.
    Ext(Ext),
    /// No room, even after evicting everything `level` allows.
    NoRoom,
    /// Room needs host work (a spill, or waiting for memory to come free), which the caller
    /// did not allow.
    Slow,
}

/// After allocating `ext` in `t`: a new Device extent is written only after the device work
/// still touching its memory's earlier owners, if any (the writer waits for those events:
/// `writer`, or the host-to-device stream, which writes every copy into the device). Returns
/// the events waited for. On failure the extent is given back.
pub(crate) fn ready_for_writes(
    sh: &Shared,
    st: &mut State,
    t: Tier,
    ext: Ext,
    writer: Option<&RawStream>,
) -> Result<(Ext, smallvec::SmallVec<[RawEvent; 2]>)> {
    if t != Tier::Device {
        return Ok((ext, smallvec::SmallVec::new()));
    }
    let fences = st.books.take_fences(&ext);
    let stream = writer.unwrap_or(sh.backend.h2d());
    for ev in &fences {
        if let Err(e) = stream.wait(ev) {
            // Back to the books with its fence: the next writer must still wait for it.
            let waits = fences.iter().cloned().map(Pending::Ev).collect();
            st.books.retire_device(ext, waits);
            return Err(e);
        }
    }
    Ok((ext, fences))
}

/// Allocates in `t` like [`alloc`], readying a Device extent for copies into it
/// ([`ready_for_writes`]).
pub(crate) fn alloc_in(
    sh: &Shared,
    st: &mut Locked<'_>,
    t: Tier,
    bytes: u64,
    who: TensorId,
    level: Level,
    slow: bool,
) -> Result<Got> {
    match alloc(sh, st, t, bytes, who, level, slow)? {
        Got::Ext(ext) => ready_for_writes(sh, st, t, ext, None).map(|(ext, _)| Got::Ext(ext)),
        other => Ok(other),
    }
}

/// A victim being spilled by host work: planned under the lock, run without it, committed.
struct Spill {
    id: TensorId,
    from: Tier,
    to: Tier,
    dst: Ext,
    copy: HostCopy<'static>,
    flight: Arc<Flight>,
}

/// How a victim was dealt with.
enum Demoted {
    /// Its replica is gone from the tier (dropped, or demoted by an issued DMA).
    Now,
    /// A spill was planned; the memory comes free once it has run.
    Planned,
    /// Room below needs spills that were planned first: try it again after they have run.
    Later,
    /// A spill would take it, but the caller does not allow host work.
    NeedsHost,
    /// Nowhere to put it.
    Cannot,
}

/// What a pass over the victims did.
#[derive(Default)]
struct Freed {
    /// Memory was freed now.
    now: bool,
    /// More could be freed by host work the caller does not allow.
    needs_host: bool,
}

/// Rounds of making room before giving up (other threads may take the room as it is made).
const MAX_ROUNDS: usize = 64;

/// What one allocation has learned of a tier it wanted to demote into.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Below {
    /// Not asked yet, or room was found there.
    Open,
    /// Room there needs host work the caller does not allow.
    NeedsHost,
    /// No room there, and none can be made.
    Full,
}

/// One allocation's walk over the victims, kept across its rounds: where the walk stopped in
/// each tier (so no victim is looked at twice), which tiers below were found full or needing
/// host work (so they are not asked again), and in which tiers sole copies cannot move now (so
/// the walk there takes only victims a slower copy backs). The work of making room is thus
/// O(victims looked at), whatever their state, never a restart from the front.
struct Pass {
    who: TensorId,
    level: Level,
    slow: bool,
    cursor: [Cursor; 4],
    below: [Below; 4],
    sole_stuck: [bool; 4],
}

impl Pass {
    fn new(who: TensorId, level: Level, slow: bool) -> Pass {
        Pass {
            who,
            level,
            slow,
            cursor: Default::default(),
            below: [Below::Open; 4],
            sole_stuck: [false; 4],
        }
    }

    /// The level victims of `t` are taken at: the caller's in the tier it allocates in, and a
    /// demand's below it (making room for a demotion).
    fn level_in(&self, t: Tier, top: Tier) -> Level {
        if t == top {
            self.level
        } else {
            Level::Demand
        }
    }
}

/// Allocates `bytes` in `t` for `who`, demoting victims `level` allows (never `who`). With
/// `slow`, host work runs without the lock (the lock is released and taken again, so the caller
/// must have `who` in a flight if anything about it must stay as it was); without, such room
/// is [`Got::Slow`].
pub(crate) fn alloc(
    sh: &Shared,
    st: &mut Locked<'_>,
    t: Tier,
    bytes: u64,
    who: TensorId,
    level: Level,
    slow: bool,
) -> Result<Got> {
    if !st.books.can_ever_fit(t, bytes) {
        return Ok(Got::NoRoom);
    }
    let need = st.books.reserved_size(t, bytes);
    let mut pass = Pass::new(who, level, slow);
    for _ in 0..MAX_ROUNDS {
        if let Some(ext) = st.books.try_alloc(t, bytes) {
            return Ok(Got::Ext(ext));
        }
        st.refresh_epoch();
        let coming = st.books.free_bytes(t)
            + st.place.victims.evictable_bytes(t, level)
            + st.books.deferred_bytes(t);
        if coming < need {
            return Ok(Got::NoRoom);
        }
        let mut spills = Vec::new();
        let freed = match free_up(sh, st, &mut pass, t, t, need, &mut spills) {
            Ok(f) => f,
            Err(e) => {
                // Spills planned before the failure never ran: their victims stay as they were.
                for s in spills {
                    st.books.free(s.to, s.dst);
                    st.end_flight(s.id, &s.flight);
                }
                return Err(e);
            }
        };
        if !spills.is_empty() {
            run_spills(sh, st, spills)?;
            continue;
        }
        if freed.now {
            continue;
        }
        if freed.needs_host {
            return Ok(Got::Slow);
        }
        // Nothing left to evict now: wait for memory whose work is still running.
        let waits = st.books.deferred_waits(t);
        if waits.is_empty() {
            return Ok(Got::NoRoom);
        }
        if !slow {
            return Ok(Got::Slow);
        }
        st.unlocked(|| {
            for w in &waits {
                let _ = w.wait();
            }
        });
        st.books.reap();
    }
    Ok(Got::NoRoom)
}

/// Frees room in `t` toward `need` bytes, continuing the pass's walk there: drops and issued
/// demotions now, spills planned into `spills` (when the pass allows host work). `top` is the
/// tier the allocation is for.
#[allow(clippy::too_many_arguments)]
fn free_up(
    sh: &Shared,
    st: &mut Locked<'_>,
    pass: &mut Pass,
    top: Tier,
    t: Tier,
    need: u64,
    spills: &mut Vec<Spill>,
) -> Result<Freed> {
    let mut planned = 0u64;
    let mut freed = Freed::default();
    let level = pass.level_in(t, top);
    while planned < need {
        let before = pass.cursor[t.index()];
        let mut cur = before;
        let stuck = pass.sole_stuck[t.index()];
        let Some(v) = st.place.victims.next(t, level, &mut cur, stuck, pass.who) else { break };
        pass.cursor[t.index()] = cur;
        let Ok(e) = st.res.get(v) else { continue };
        let reserved = st.books.reserved_size(t, e.bytes());
        match demote(sh, st, pass, top, v, t, need - planned, spills)? {
            Demoted::Now => {
                st.counters.evictions += 1;
                planned += reserved;
                freed.now = true;
            }
            Demoted::Planned => planned += reserved,
            Demoted::Later => {
                // Spills below come first; this victim is taken again after them.
                pass.cursor[t.index()] = before;
                return Ok(freed);
            }
            Demoted::NeedsHost => freed.needs_host = true,
            Demoted::Cannot => {}
        }
    }
    Ok(freed)
}

/// Whether a copy from `from` to `to` is a DMA (issued with no host work).
fn dma_between(sh: &Shared, from: Tier, to: Tier) -> bool {
    let cpu = |t: Tier| sh.mem.arena(t).is_some_and(|a| a.cpu_reachable());
    (from == Tier::Device) != (to == Tier::Device)
        && (cpu(from) || from == Tier::Device)
        && (cpu(to) || to == Tier::Device)
}

/// Takes `v`'s replica out of `from`: dropped when a slower tier has a copy, else demoted to the
/// first slower tier with room (making room there first, in the same pass). `remaining` is what
/// the caller still has to free: room made below is made for that much at once.
#[allow(clippy::too_many_arguments)]
fn demote(
    sh: &Shared,
    st: &mut Locked<'_>,
    pass: &mut Pass,
    top: Tier,
    v: TensorId,
    from: Tier,
    remaining: u64,
    spills: &mut Vec<Spill>,
) -> Result<Demoted> {
    let e = st.res.get(v)?;
    let bytes = e.bytes();
    let discarded = e.discarded;
    let has_slower =
        Tier::ALL.into_iter().any(|t| t > from && e.replicas[t.index()].as_ref().is_some());
    if has_slower {
        st.drop_replica(v, from);
        return Ok(Demoted::Now);
    }
    let mut needs_host = false;
    let mut next = from.slower();
    while let Some(to) = next {
        next = to.slower();
        if !st.books.can_ever_fit(to, bytes) {
            continue;
        }
        match pass.below[to.index()] {
            Below::Full => continue,
            Below::NeedsHost => {
                needs_host = true;
                continue;
            }
            Below::Open => {}
        }
        let free_move = discarded && to != Tier::Disk;
        if !pass.slow && !dma_between(sh, from, to) && !free_move {
            // A spill is host work: not now.
            needs_host = true;
            continue;
        }
        let dst = match st.books.try_alloc(to, bytes) {
            Some(d) => d,
            None => {
                // Make room below first (for what the caller still needs, not just this
                // victim): drops and DMA there now, spills planned.
                let before = spills.len();
                let need = st.books.reserved_size(to, bytes).max(remaining);
                let below = free_up(sh, st, pass, top, to, need, spills)?;
                match st.books.try_alloc(to, bytes) {
                    Some(d) => d,
                    None if spills.len() > before => return Ok(Demoted::Later),
                    None => {
                        if below.needs_host {
                            pass.below[to.index()] = Below::NeedsHost;
                            needs_host = true;
                        } else if !below.now {
                            pass.below[to.index()] = Below::Full;
                        }
                        continue;
                    }
                }
            }
        };
        if free_move {
            // Contents declared dead (`Store::discard`): a home without the write-back. (Disk
            // extents carry a checksum of their bytes, so those are still written.)
            st.res.put_replica(v, to, Replica::new(dst, None));
            st.drop_replica(v, from);
            return Ok(Demoted::Now);
        }
        let copy = prepare_copy(sh, st, v, from, to, &dst)?;
        if copy.is_dma(sh) {
            // Device to host memory: issued now, no host wait; the device memory is reused once
            // the copy has read it (stream order).
            let done = match run_copy(sh, st, copy) {
                Ok(d) => d,
                Err(e) => {
                    super::release_failed(sh, st, to, dst);
                    return Err(e);
                }
            };
            st.commit_copy(v, Some(from), to, dst, done);
            st.drop_replica(v, from);
            return Ok(Demoted::Now);
        }
        if !pass.slow {
            st.books.free(to, dst);
            needs_host = true;
            continue;
        }
        let flight = st.start_flight(v, None);
        spills.push(Spill { id: v, from, to, dst, copy, flight });
        return Ok(Demoted::Planned);
    }
    // No slower tier takes a sole copy from here in this pass: walk only victims a slower copy
    // backs from now on (each of those is a free drop).
    let mut t = from.slower();
    let mut all_shut = true;
    while let Some(to) = t {
        t = to.slower();
        if st.books.enabled(to)
            && pass.below[to.index()] == Below::Open
            && (pass.slow || dma_between(sh, from, to))
        {
            all_shut = false;
        }
    }
    if all_shut {
        pass.sole_stuck[from.index()] = true;
    }
    Ok(if needs_host { Demoted::NeedsHost } else { Demoted::Cannot })
}

/// Runs planned spills without the lock and commits them; the first error is returned after
/// every spill has been committed or undone (a failed spill leaves its tensor where it was).
fn run_spills(sh: &Shared, st: &mut Locked<'_>, spills: Vec<Spill>) -> Result<()> {
    let (plans, copies): (Vec<_>, Vec<_>) =
        spills.into_iter().map(|s| ((s.id, s.from, s.to, s.dst, s.flight), s.copy)).unzip();
    let results: Vec<Result<super::copy::Done>> =
        st.unlocked(|| copies.into_iter().map(|c| c.run(sh, None)).collect());
    let mut first_err = None;
    for ((id, from, to, dst, flight), res) in plans.into_iter().zip(results) {
        match res {
            Ok(done) => {
                st.commit_copy(id, Some(from), to, dst, done);
                st.end_flight(id, &flight);
                // Pinned or taken into a scope while its spill ran (hints do not wait for
                // flights): a held tensor is never evicted, so its faster copy stays (clean
                // now) and the room is found elsewhere (`end_flight` re-indexed it).
                if st.res.get(id).is_ok_and(|e| e.held() == 0) {
                    st.counters.evictions += 1;
                    st.drop_replica(id, from);
                }
            }
            Err(e) => {
                super::release_failed(sh, st, to, dst);
                st.end_flight(id, &flight);
                first_err.get_or_insert(e);
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
