//! Prefetching: bringing tensors to the device ahead of use, on a hint or on the policy's
//! lookahead, within the prefetch budget; release hints and their write-backs; and the jobs the
//! engine runs for prefetches that need the host (disk reads, spills to make room).
//!
//! A prefetch never blocks the caller: a copy from host memory is issued at once; one from disk,
//! or one that needs victims spilled first, becomes an engine job, and the tensor is in flight
//! until it has run (a view waits for that job only, moved to the front of the queue).

use super::room::{self, Got};
use super::workers::{JobKind, Runner};
use super::{copy_replica, prepare_copy, run_copy};
use super::{Locked, Shared};
use crate::base::error::{Error, Result};
use crate::base::types::{TensorId, Tier};
use crate::placement::victims::Level;
use crate::residency::Source;
use crate::tiers::Ext;

/// What became of one prefetch request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Resident, or its copy issued or queued.
    Started,
    /// Over the prefetch budget or no room now: try again later.
    Wait,
    /// Nothing to do (no Device tier, too large for it, or lent to the CPU).
    Skipped,
}

/// Starts bringing `id` to the device. `force` ignores the prefetch budget (the tensor is needed
/// now: a pin or a scope's own tensors). A hint makes the tensor's protection its own: a later
/// `unpin` no longer ends it.
pub(crate) fn prefetch_one(
    sh: &Shared,
    st: &mut Locked<'_>,
    id: TensorId,
    source: Source,
    force: bool,
) -> Result<Outcome> {
    if !st.books.enabled(Tier::Device) {
        return Ok(Outcome::Skipped);
    }
    if source == Source::Hint {
        st.res.get_mut(id)?.pin_prefetch = false;
    }
    let e = st.res.get(id)?;
    let bytes = e.bytes();
    if e.host_lent || (e.views > 0 && e.view_tier != Some(Tier::Device)) {
        // Lent to the CPU or to zero-copy kernels, which may be writing it: a copy now would be
        // stale.
        return Ok(Outcome::Skipped);
    }
    if e.has(Tier::Device) {
        // Resident or on its way: protect it until used, as a prefetch would. It moves no
        // bytes, so it does not count against the prefetch budget, which limits copies:
        // counting it would keep the copies the hints and the policy's lookahead want next
        // from starting while hinted layers are resident (an idle copy engine).
        let e = st.res.get_mut(id)?;
        e.released = false;
        match e.prefetched {
            None if e.views == 0 => e.prefetched = Some(source),
            Some(Source::Policy) if source == Source::Hint => e.prefetched = Some(source),
            _ => {}
        }
        st.reindex(id);
        return Ok(Outcome::Started);
    }
    if e.job.is_some() {
        // Already on its way (a job that makes room first): protect it as above.
        let e = st.res.get_mut(id)?;
        e.released = false;
        if e.prefetched.is_none() || source == Source::Hint {
            e.prefetched = Some(source);
        }
        st.reindex(id);
        return Ok(Outcome::Started);
    }
    if e.flight.is_some() {
        // Busy with something else (a move, a spill): later.
        return Ok(Outcome::Wait);
    }
    if !st.books.can_ever_fit(Tier::Device, bytes) {
        return Ok(Outcome::Skipped);
    }
    if !force && st.place.inflight + bytes > st.place.prefetch_budget {
        return Ok(Outcome::Wait);
    }
    let level = if source == Source::Hint { Level::Demand } else { Level::Guess };
    if source == Source::Policy
        && st.books.free_bytes(Tier::Device) < st.books.reserved_size(Tier::Device, bytes)
    {
        // A guess evicts only what the policy itself would rather lose: for the schedule
        // policy, tensors used later than this one (Belady's comparison).
        let victims = st.victims_covering(Tier::Device, level, bytes, id);
        if !st.place.policy.admit(Tier::Device, id, &victims) {
            return Ok(Outcome::Wait);
        }
    }
    let ext = match room::alloc_in(sh, st, Tier::Device, bytes, id, level, false)? {
        Got::Ext(x) => x,
        Got::NoRoom => return Ok(Outcome::Wait),
        Got::Slow => {
            // Room needs spills or waits: the engine does it all, without the lock.
            let Some(engine) = sh.workers.get() else { return Ok(Outcome::Wait) };
            let job = engine.submit(JobKind::Bring(id, source));
            st.start_job(id, job);
            st.mark_prefetched(id, source, true);
            st.counters.prefetches += 1;
            return Ok(Outcome::Started);
        }
    };
    let src = st.res.get(id)?.fastest_readable().ok_or(Error::UnknownId(id))?;
    let copy = match prepare_copy(sh, st, id, src, Tier::Device, &ext) {
        Ok(c) => c,
        Err(e) => {
            super::release_failed(sh, st, Tier::Device, ext);
            return Err(e);
        }
    };
    if copy.is_dma(sh) {
        match run_copy(sh, st, copy) {
            Ok(done) => st.commit_copy(id, Some(src), Tier::Device, ext, done),
            Err(e) => {
                super::release_failed(sh, st, Tier::Device, ext);
                return Err(e);
            }
        }
    } else {
        // From disk: the replica is reserved now and filled by a worker without the lock;
        // views wait for its job.
        let Some(engine) = sh.workers.get() else {
            super::release_failed(sh, st, Tier::Device, ext);
            return Ok(Outcome::Wait);
        };
        drop(copy);
        let mut r = crate::residency::Replica::new(ext, None);
        r.filling = true;
        st.res.put_replica(id, Tier::Device, r);
        let job = engine.submit(JobKind::Fill(id));
        st.start_job(id, job);
    }
    st.mark_prefetched(id, source, true);
    st.counters.prefetches += 1;
    Ok(Outcome::Started)
}

/// Queues `id` among the hinted prefetches waiting for room (once).
pub(crate) fn queue_waiting(st: &mut Locked<'_>, id: TensorId) {
    if let Ok(e) = st.res.get_mut(id) {
        if !e.queued {
            e.queued = true;
            st.place.waiting.push_back(id);
        }
    }
}

/// Starts the hinted prefetches that were waiting, in order, while they fit.
pub(crate) fn pump_waiting(sh: &Shared, st: &mut Locked<'_>) {
    while let Some(id) = st.place.waiting.pop_front() {
        let held = match st.res.get_mut(id) {
            Ok(e) if e.queued => {
                e.queued = false;
                e.pins > 0 || e.scopes > 0
            }
            _ => continue,
        };
        // A pin's or a scope's copy, like when it was asked for, is outside the budget.
        match prefetch_one(sh, st, id, Source::Hint, held) {
            Ok(Outcome::Wait) => {
                if let Ok(e) = st.res.get_mut(id) {
                    e.queued = true;
                }
                st.place.waiting.push_front(id);
                break;
            }
            Ok(_) => {}
            // A hint's copy failing is not the caller's error: the tensor stays where it is,
            // intact, and a view will try (and report) again.
            Err(e) => tracing::debug!(tensor = %id, error = %e, "a waiting prefetch failed"),
        }
    }
}

/// Prefetches what the policy expects next, within what is left of the prefetch budget.
/// Guesses never evict prefetched or held tensors.
pub(crate) fn lookahead(sh: &Shared, st: &mut Locked<'_>) {
    if !st.books.enabled(Tier::Device) || sh.health.check().is_err() {
        return;
    }
    let room = st.place.prefetch_budget.saturating_sub(st.place.inflight);
    if room == 0 {
        return;
    }
    let mut ids = std::mem::take(&mut st.place.lookahead_buf);
    ids.clear();
    {
        let super::State { place, res, .. } = &mut **st;
        place.policy.lookahead(
            room,
            &mut |id| res.get(id).ok().map(|e| if e.has(Tier::Device) { 0 } else { e.bytes() }),
            &mut ids,
        );
    }
    for &id in &ids {
        // The policy's answer is only a suggestion: ids the store does not know are skipped.
        if st.res.get(id).is_err() {
            continue;
        }
        match prefetch_one(sh, st, id, Source::Policy, false) {
            Ok(Outcome::Started) | Ok(Outcome::Skipped) => {}
            Ok(Outcome::Wait) | Err(_) => break,
        }
    }
    ids.clear();
    st.place.lookahead_buf = ids;
}

/// A release hint for one tensor: it goes first when room is needed, and a tensor written on
/// the device and held nowhere else starts being written back into a host tier with free room
/// (no eviction for a hint), so that dropping it later is free.
pub(crate) fn release_one(sh: &Shared, st: &mut Locked<'_>, id: TensorId) -> Result<()> {
    st.consume_prefetch(id);
    let e = st.res.get_mut(id)?;
    e.queued = false;
    if !e.has(Tier::Device) {
        st.reindex(id);
        return Ok(());
    }
    e.released = true;
    let writeback = e.held() == 0 && !e.in_flight() && e.count() == 1 && !e.discarded;
    let bytes = e.bytes();
    st.reindex(id);
    if !writeback {
        return Ok(());
    }
    for t in [Tier::Pinned, Tier::Mapped] {
        let Some(ext) = st.books.try_alloc(t, bytes) else { continue };
        let copy = match prepare_copy(sh, st, id, Tier::Device, t, &ext) {
            Ok(c) if c.is_dma(sh) => c,
            Ok(_) | Err(_) => {
                st.books.free(t, ext);
                continue;
            }
        };
        match run_copy(sh, st, copy) {
            Ok(done) => st.commit_copy(id, Some(Tier::Device), t, ext, done),
            Err(e) => {
                super::release_failed(sh, st, t, ext);
                return Err(e);
            }
        }
        break;
    }
    Ok(())
}

impl Runner for Shared {
    fn run_job(&self, worker: Option<usize>, job: JobKind, jobno: u64) {
        let res = match job {
            JobKind::Fill(id) => self.run_fill(worker, id, jobno),
            JobKind::Bring(id, source) => self.run_bring(worker, id, source, jobno),
        };
        if let Err(e) = res {
            self.defer_err(e);
        }
    }

    fn cancel_job(&self, job: JobKind, jobno: u64) {
        let (JobKind::Fill(id) | JobKind::Bring(id, _)) = job;
        let mut st = self.lock();
        undo_job(self, &mut st, id, jobno);
    }
}

/// Undoes what queuing the prefetch job `jobno` of `id` did (a job that will not run): the
/// device replica it reserved, the prefetch mark, its claim.
pub(crate) fn undo_job(sh: &Shared, st: &mut Locked<'_>, id: TensorId, jobno: u64) {
    let Some(f) = st.res.get(id).ok().and_then(|e| e.job.clone()) else { return };
    if f.job != Some(jobno) {
        return;
    }
    if st.res.get(id).is_ok_and(|e| e.replicas[0].as_ref().is_some_and(|r| r.filling)) {
        let r = st.res.take_replica(id, Tier::Device).expect("checked");
        super::release_failed(sh, st, Tier::Device, r.ext);
    }
    st.consume_prefetch(id);
    st.end_job(id, &f);
}

/// Revokes `id`'s prefetch job if it is still queued (a worker has not taken it): the caller
/// needs the tensor exclusively now and would otherwise wait behind the whole queue. True if
/// there was one to revoke. A held tensor's job stays: a pin or a scope was promised the
/// tensor on the device (and the caller is refused `Busy`, or waits, as with a running job).
pub(crate) fn revoke_queued(sh: &Shared, st: &mut Locked<'_>, id: TensorId) -> bool {
    let Some(jobno) = st
        .res
        .get(id)
        .ok()
        .filter(|e| e.held() == 0)
        .and_then(|e| e.job.as_ref().and_then(|f| f.job))
    else {
        return false;
    };
    match sh.workers.get() {
        Some(engine) if engine.revoke(jobno) => {
            undo_job(sh, st, id, jobno);
            true
        }
        _ => false,
    }
}

impl Shared {
    /// The flight of `id` if it is the job `jobno`'s (the job was not cancelled meanwhile).
    fn job_flight(
        st: &Locked<'_>,
        id: TensorId,
        jobno: u64,
    ) -> Option<std::sync::Arc<crate::residency::Flight>> {
        st.res.get(id).ok()?.job.clone().filter(|f| f.job == Some(jobno))
    }

    /// Fills `id`'s Device replica (reserved and marked filling when the job was queued) from
    /// its Disk replica: read into pinned staging and copied in, piece by piece, without the
    /// lock.
    fn run_fill(&self, worker: Option<usize>, id: TensorId, jobno: u64) -> Result<()> {
        let mut st = self.lock();
        let Some(flight) = Self::job_flight(&st, id, jobno) else { return Ok(()) };
        let planned = (|| -> Result<_> {
            let e = st.res.get(id)?;
            let r = e.replicas[Tier::Device.index()]
                .as_ref()
                .ok_or(Error::NotInTier { id, tier: Tier::Device })?;
            let Ext::Mem(x) = &r.ext else { unreachable!("device replicas are memory extents") };
            let lease = self
                .mem
                .arena(Tier::Device)
                .ok_or(Error::TierDisabled { tier: Tier::Device })?
                .write_lease(x);
            let from = e.fastest_readable().ok_or(Error::UnknownId(id))?;
            Ok((from, lease))
        })();
        let (from, lease) = match planned {
            Ok(p) => p,
            Err(e) => {
                self.undo_fill(&mut st, id, &flight);
                return Err(e);
            }
        };
        let copy = match super::prepare_copy_into(
            self,
            &st,
            id,
            from,
            super::copy::Dst::Mem(Tier::Device, lease),
        ) {
            Ok(mut c) => {
                c.lane = worker.unwrap_or(0);
                c
            }
            Err(e) => {
                self.undo_fill(&mut st, id, &flight);
                return Err(e);
            }
        };
        let res = st.unlocked(|| match worker.and_then(|w| self.worker_staging.get(w)) {
            Some(bufs) => copy.run(self, Some(&mut bufs.lock()[..])),
            None => copy.run(self, None),
        });
        match res {
            Ok(done) => {
                st.commit_fill(id, from, Tier::Device, done);
                st.end_job(id, &flight);
                Ok(())
            }
            Err(e) => {
                self.undo_fill(&mut st, id, &flight);
                Err(e)
            }
        }
    }

    /// A fill that failed: the half-filled replica goes (later copies into its memory are
    /// ordered after the ones issued, on the same stream); the disk copy is untouched.
    fn undo_fill(
        &self,
        st: &mut Locked<'_>,
        id: TensorId,
        flight: &std::sync::Arc<crate::residency::Flight>,
    ) {
        if let Some(r) = st.res.take_replica(id, Tier::Device) {
            super::release_failed(self, st, Tier::Device, r.ext);
        }
        st.consume_prefetch(id);
        st.end_job(id, flight);
    }

    /// Brings `id` to the device for a prefetch whose room needed host work.
    fn run_bring(
        &self,
        _worker: Option<usize>,
        id: TensorId,
        source: Source,
        jobno: u64,
    ) -> Result<()> {
        let mut st = self.lock();
        let Some(flight) = Self::job_flight(&st, id, jobno) else { return Ok(()) };
        let level = if source == Source::Hint { Level::Demand } else { Level::Guess };
        let res = (|| -> Result<()> {
            let bytes = st.res.get(id)?.bytes();
            let Got::Ext(ext) =
                room::alloc_in(self, &mut st, Tier::Device, bytes, id, level, true)?
            else {
                return Ok(());
            };
            match st.res.get(id)?.fastest_readable() {
                Some(src) => copy_replica(self, &mut st, id, src, Tier::Device, ext).map(drop),
                None => {
                    super::release_failed(self, &mut st, Tier::Device, ext);
                    Err(Error::UnknownId(id))
                }
            }
        })();
        let brought = st.res.get(id).is_ok_and(|e| e.has(Tier::Device));
        if !brought {
            st.consume_prefetch(id);
        }
        st.end_job(id, &flight);
        res
    }
}
