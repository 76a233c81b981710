//! The store's shared parts and the one lock over its metadata.

use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, MutexGuard};

use super::timeline::{Span, TimePoint, Timeline, Track};
use super::workers::Workers;
use crate::backend::{Backend, Pending, RawEvent};
use crate::base::error::Error;
use crate::base::types::{TensorId, Tier};
use crate::placement::victims::Level;
use crate::placement::Placement;
use crate::residency::{Flight, Residency, Source};
use crate::tiers::arena::StagingBuf;
use crate::tiers::{TierBooks, TierMem};

/// Counters of what happened, for [`Stats`](crate::Stats).
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) moved: [[u64; 4]; 4],
    pub(crate) bytes_in: u64,
    pub(crate) bytes_out: u64,
    pub(crate) hits: u64,
    pub(crate) misses: u64,
    pub(crate) evictions: u64,
    pub(crate) promotions: u64,
    /// Device views that found the tensor resident or on its way.
    pub(crate) prefetch_hits: u64,
    /// Device views that had to start the copy.
    pub(crate) prefetch_misses: u64,
    /// Prefetch copies started (hints and policy).
    pub(crate) prefetches: u64,
    /// Seconds consumers waited for copies (resolved stalls).
    pub(crate) stall_s: f64,
}

/// Everything behind the store's lock. A call holds it only to decide and record: which
/// replica, which victims, which memory; the tensors involved are marked in flight and the lock
/// is released for the work itself.
pub(crate) struct State {
    pub(crate) res: Residency,
    pub(crate) place: Placement,
    pub(crate) books: TierBooks,
    pub(crate) counters: Counters,
    /// Copies and waits, for stats and traces (when the store keeps a timeline).
    pub(crate) timeline: Option<Timeline>,
    /// Stream waits whose length is known once both events complete: (mark on the consumer's
    /// stream, the copy's event). Only with a timeline.
    pub(crate) probes: Vec<(RawEvent, RawEvent)>,
}

impl State {
    /// Starts an exclusive flight on `id` (it has none).
    pub(crate) fn start_flight(&mut self, id: TensorId, job: Option<u64>) -> Arc<Flight> {
        let f = Flight::new(job);
        if let Ok(e) = self.res.get_mut(id) {
            debug_assert!(e.flight.is_none(), "two exclusive flights on {id}");
            e.flight = Some(f.clone());
        }
        self.reindex(id);
        f
    }

    /// Gives `id` the claim of the engine's job `jobno` (a prefetch; see [`Entry::job`]).
    pub(crate) fn start_job(&mut self, id: TensorId, jobno: u64) -> Arc<Flight> {
        let f = Flight::new(Some(jobno));
        if let Ok(e) = self.res.get_mut(id) {
            debug_assert!(e.job.is_none(), "two prefetch jobs on {id}");
            e.job = Some(f.clone());
        }
        self.reindex(id);
        f
    }

    /// Ends a prefetch job's claim on `id` and wakes whoever waits for it.
    pub(crate) fn end_job(&mut self, id: TensorId, f: &Arc<Flight>) {
        if let Ok(e) = self.res.get_mut(id) {
            if e.job.as_ref().is_some_and(|x| Arc::ptr_eq(x, f)) {
                e.job = None;
            }
        }
        f.finish();
        self.reindex(id);
    }

    /// Counts `id` under the write reserve and makes the reserve fit it: `OutOfMemory` (and
    /// nothing counted) when there is no room to keep a second copy of it aside.
    pub(crate) fn cover(&mut self, id: TensorId) -> crate::base::error::Result<()> {
        let Ok(e) = self.res.get_mut(id) else { return Ok(()) };
        if e.covered || !self.books.reserve.enabled {
            return Ok(());
        }
        e.covered = true;
        let bytes = e.bytes();
        self.books.reserve.note(bytes);
        if let Err((tier, _)) = self.books.fit_reserve() {
            // No room left to keep a second copy of the largest tensor aside: the tensor does
            // not fit (the tier named is the reserve's).
            self.uncover(id);
            return Err(Error::OutOfMemory { tier, bytes });
        }
        Ok(())
    }

    /// Stops counting `id` under the write reserve (it is being removed), shrinking the
    /// reserve if it was the largest.
    pub(crate) fn uncover(&mut self, id: TensorId) {
        let Ok(e) = self.res.get_mut(id) else { return };
        if !std::mem::take(&mut e.covered) {
            return;
        }
        let bytes = e.bytes();
        self.books.reserve.unnote(bytes);
        let _ = self.books.fit_reserve();
    }

    /// Retries the event a view's drop could not record ([`Entry::unsettled`]): once one is
    /// recorded on that stream (after the view's work), it is the stream's last use and the
    /// view's hold is released. Another failure leaves the tensor held.
    pub(crate) fn settle(&mut self, id: TensorId) {
        let Ok(e) = self.res.get_mut(id) else { return };
        let mut i = 0;
        while i < e.unsettled.len() {
            let (stream, key) = &e.unsettled[i];
            let Ok(ev) = stream.record_as(*key) else {
                i += 1;
                continue;
            };
            let (stream, key) = e.unsettled.swap_remove(i);
            e.uses.record(key, &stream, ev);
            e.views = e.views.saturating_sub(1);
            if e.views == 0 {
                e.view_tier = None;
            }
        }
        self.reindex(id);
    }

    /// Releases the holds of `id`'s views whose drop could not record an event, on `streams`
    /// (stream, key): their streams have since been synchronized, so the work they named is done
    /// and needs no event.
    pub(crate) fn settled_by_sync(
        &mut self,
        id: TensorId,
        streams: &[(crate::backend::RawStream, u64)],
    ) {
        let Ok(e) = self.res.get_mut(id) else { return };
        for (_, key) in streams {
            if let Some(i) = e.unsettled.iter().position(|(_, k)| k == key) {
                e.unsettled.swap_remove(i);
                e.views = e.views.saturating_sub(1);
                if e.views == 0 {
                    e.view_tier = None;
                }
            }
        }
        self.reindex(id);
    }

    /// Ends `id`'s exclusive flight and wakes whoever waits for it.
    pub(crate) fn end_flight(&mut self, id: TensorId, f: &Arc<Flight>) {
        if let Ok(e) = self.res.get_mut(id) {
            if e.flight.as_ref().is_some_and(|x| Arc::ptr_eq(x, f)) {
                e.flight = None;
            }
        }
        f.finish();
        self.reindex(id);
    }

    /// Joins (or starts) the shared read flight of `id`.
    pub(crate) fn start_read(&mut self, id: TensorId) {
        if let Ok(e) = self.res.get_mut(id) {
            e.readers += 1;
            if e.read_flight.is_none() {
                e.read_flight = Some(Flight::new(None));
            }
        }
        self.reindex(id);
    }

    /// Leaves `id`'s read flight; the last reader ends it.
    pub(crate) fn end_read(&mut self, id: TensorId) {
        if let Ok(e) = self.res.get_mut(id) {
            e.readers = e.readers.saturating_sub(1);
            if e.readers == 0 {
                if let Some(f) = e.read_flight.take() {
                    f.finish();
                }
            }
        }
        self.reindex(id);
    }

    /// Drops `id`'s replica in `t` without blocking the host: the memory is freed once the work
    /// still touching the tensor is done (device memory by stream order).
    pub(crate) fn drop_replica(&mut self, id: TensorId, t: Tier) {
        let Ok(e) = self.res.get(id) else { return };
        let pending = e.pending();
        if t == Tier::Device {
            // Off the device: no longer prefetched nor a release candidate.
            self.consume_prefetch(id);
            if let Ok(e) = self.res.get_mut(id) {
                e.released = false;
            }
        }
        let Some(r) = self.res.take_replica(id, t) else { return };
        if t == Tier::Device {
            self.books.retire_device(r.ext, pending);
        } else {
            self.books.free_after(t, r.ext, pending);
        }
        self.reindex(id);
    }

    /// Drops every replica of `id` but `keep`'s (nothing when there is none in `keep`: a
    /// tensor never loses its last copy this way).
    pub(crate) fn drop_other_replicas(&mut self, id: TensorId, keep: Tier) {
        if !self.res.get(id).is_ok_and(|e| e.has(keep)) {
            return;
        }
        for t in Tier::ALL.into_iter().filter(|&t| t != keep) {
            if self.res.get(id).is_ok_and(|e| e.has(t)) {
                self.drop_replica(id, t);
            }
        }
    }

    /// Everything pending on every tensor and waiting extent (for the store's drop).
    /// Not the readers' flights: when the store drops, those are shared host views that
    /// outlive it (nothing else reads without a `&Store`), which write nothing, and whose
    /// memory their hold on the shared state keeps.
    pub(crate) fn all_pending(&self) -> Vec<Pending> {
        let mut out = self.books.all_deferred_waits();
        for (_, e) in self.res.slab.iter() {
            let readers = e.read_flight.as_ref().map(|f| f.done.clone());
            out.extend(e.pending().into_iter().filter(|p| match (p, &readers) {
                (Pending::Done(d), Some(r)) => !Arc::ptr_eq(d, r),
                _ => true,
            }));
        }
        out
    }
}

impl State {
    /// Adds the stream waits whose events have both completed to the stall time and the
    /// timeline.
    pub(crate) fn resolve_probes(&mut self) {
        let mut i = 0;
        while i < self.probes.len() {
            let (mark, ready) = &self.probes[i];
            if !(mark.is_complete() && ready.is_complete()) {
                i += 1;
                continue;
            }
            let (mark, ready) = self.probes.swap_remove(i);
            if let Some(wait) = ready.seconds_since(&mark).filter(|w| *w > 0.0) {
                self.counters.stall_s += wait;
                if let Some(tl) = self.timeline.as_mut() {
                    tl.push(Span {
                        track: Track::Stall,
                        what: "wait",
                        tensor: Arc::from(""),
                        bytes: 0,
                        start: TimePoint::Ev(mark),
                        end: TimePoint::Ev(ready),
                    });
                }
            }
        }
    }
}

/// The placement layer's decisions over the locked state: each takes the parts it reads.
impl State {
    /// [`Placement::reindex`]: after any change to `id`'s replicas, holds, flights or flags.
    pub(crate) fn reindex(&mut self, id: TensorId) {
        self.place.reindex(&self.res, id);
    }

    /// [`Placement::unindex`]: before `id` is removed.
    pub(crate) fn unindex(&mut self, id: TensorId) {
        self.place.unindex(&self.res, id);
    }

    /// [`Placement::touch`]: an access of `id`.
    pub(crate) fn touch(&mut self, id: TensorId) {
        self.place.touch(&self.res, id);
    }

    /// [`Placement::refresh_epoch`].
    pub(crate) fn refresh_epoch(&mut self) {
        self.place.refresh_epoch(&self.res);
    }

    /// [`Placement::victims_covering`].
    pub(crate) fn victims_covering(
        &mut self,
        t: Tier,
        level: Level,
        bytes: u64,
        exclude: TensorId,
    ) -> Vec<TensorId> {
        self.place.victims_covering(&self.res, t, level, bytes, exclude)
    }

    /// [`Placement::admits`].
    pub(crate) fn admits(&mut self, t: Tier, id: TensorId, bytes: u64) -> bool {
        self.place.admits(&self.res, &self.books, t, id, bytes)
    }

    /// [`Placement::admits_copy`].
    pub(crate) fn admits_copy(&mut self, t: Tier, id: TensorId, bytes: u64) -> bool {
        self.place.admits_copy(&self.res, &self.books, t, id, bytes)
    }

    /// [`Placement::consume_prefetch`].
    pub(crate) fn consume_prefetch(&mut self, id: TensorId) {
        self.place.consume_prefetch(&mut self.res, id);
    }

    /// [`Placement::mark_prefetched`].
    pub(crate) fn mark_prefetched(&mut self, id: TensorId, source: Source, charged: bool) {
        self.place.mark_prefetched(&mut self.res, id, source, charged);
    }

    /// The fastest enabled tier.
    pub(crate) fn fastest_enabled(&self) -> Option<Tier> {
        Tier::ALL.into_iter().find(|&t| self.books.enabled(t))
    }
}

/// The store's shared parts: what never changes after the build, and the lock.
pub(crate) struct Shared {
    pub(crate) backend: Backend,
    /// The tiers' memory: reached without the lock.
    pub(crate) mem: TierMem,
    pub(crate) state: Mutex<State>,
    /// Errors from `Drop` impls (views) and failed prefetches, returned by the next `check_err`.
    pub(crate) deferred: Mutex<Vec<Error>>,
    /// Why the host backend runs where a GPU was not found.
    pub(crate) note: Option<String>,
    /// The migration engine's workers.
    pub(crate) workers: OnceLock<Workers>,
    /// Each worker's own staging buffers.
    pub(crate) worker_staging: Vec<Mutex<Vec<StagingBuf>>>,
    /// Whether copies and waits are timed (the store keeps a timeline).
    pub(crate) timing: bool,
    /// Whether the backend still works (device work is refused once it has failed for good).
    pub(crate) health: crate::backend::health::Health,
}

impl Drop for Shared {
    /// The last holder gone (the store, or a view that outlived it): on CUDA, the GPU work still
    /// in flight on the tiers' memory (the last uses views recorded, copies) is waited for
    /// before that memory is freed under it (`Store::drop` waits for everything, but a view
    /// dropped after the store records its last use after that wait). Only GPU events: a host
    /// stream's event may sit behind the very job dropping the view (the wait would never end),
    /// and a job's claim may belong to a worker already stopped; on the host backend a view's
    /// memory is used only by work that holds the view, so none can be running now.
    fn drop(&mut self) {
        if let crate::backend::Backend::Cuda(_) = &self.backend {
            for p in self.state.get_mut().all_pending() {
                if let Pending::Ev(RawEvent::Cuda(_))
                | Pending::Stream(crate::backend::RawStream::Cuda(_)) = &p
                {
                    let _ = p.wait();
                }
            }
        }
    }
}

impl Shared {
    /// Takes the lock. Work queued for the calling thread (a store without worker threads runs
    /// its jobs inline) runs when the guard drops, after the lock is released.
    pub(crate) fn lock(&self) -> Locked<'_> {
        let g = self.state.lock();
        crate::base::sync::note_locked();
        Locked { guard: Some(g), shared: self }
    }

    /// Defers an error to the next `check_err`.
    pub(crate) fn defer_err(&self, e: Error) {
        self.deferred.lock().push(e);
    }

    /// Runs a device operation: refused at once with [`Error::BackendFailed`] once the backend
    /// has failed for good; its outcome is noted in the backend's health otherwise.
    pub(crate) fn device_work<T>(
        &self,
        f: impl FnOnce() -> crate::base::error::Result<T>,
    ) -> crate::base::error::Result<T> {
        self.health.check()?;
        let r = f();
        self.health.note(&r);
        r
    }
}

/// The store's lock, held. Dropping it releases the lock and then runs the jobs an inline
/// engine queued meanwhile.
pub(crate) struct Locked<'a> {
    guard: Option<MutexGuard<'a, State>>,
    shared: &'a Shared,
}

impl std::ops::Deref for Locked<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        self.guard.as_ref().expect("held until drop")
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut State {
        self.guard.as_mut().expect("held until drop")
    }
}

impl Locked<'_> {
    /// Releases the lock (and runs the jobs an inline engine queued meanwhile).
    pub(crate) fn release(&mut self) {
        if let Some(g) = self.guard.take() {
            drop(g);
            crate::base::sync::note_unlocked();
        }
        if let Some(e) = self.shared.workers.get() {
            e.run_inline(self.shared);
        }
    }

    /// Takes the lock again after [`Locked::release`].
    pub(crate) fn retake(&mut self) {
        if self.guard.is_none() {
            self.guard = Some(self.shared.state.lock());
            crate::base::sync::note_locked();
        }
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        if let Some(g) = self.guard.take() {
            drop(g);
            crate::base::sync::note_unlocked();
        }
        if let Some(e) = self.shared.workers.get() {
            e.run_inline(self.shared);
        }
    }
}
