//! Migration: carrying out what placement decided, in three steps, under the one lock this
//! layer owns ([`State`], [`Shared`], [`Locked`]).
//!
//! 1. **Prepare**, under the store's lock: pick the replica to copy from, allocate the
//!    destination (making room, see [`room`]), and mark the tensors involved in flight
//!    ([`prepare_copy`], [`prepare_fill`]).
//! 2. **Execute**, without the lock: disk reads and writes, host copies, staging through pinned
//!    buffers, and every host wait ([`copy::HostCopy::run`]). DMA between host memory and the
//!    device is only issued, asynchronously, so it needs no execute step: it is prepared and
//!    issued in one go, and whoever uses the bytes waits for its event (a stream by stream wait).
//! 3. **Commit**, under the lock again: the new replica is recorded (or, on failure, the
//!    destination freed, leaving the tensor as it was), the flight ends, waiters wake.
//!
//! Other tensors' operations proceed during step 2; an operation on a tensor in flight waits
//! for that flight, without the lock.

pub(crate) mod copy;
#[cfg(test)]
mod invariants;
pub(crate) mod load;
pub(crate) mod ops;
pub(crate) mod prefetch;
pub(crate) mod room;
mod state;
pub(crate) mod timeline;
pub(crate) mod workers;

pub(crate) use state::{Counters, Locked, Shared, State};

use std::sync::Arc;
use std::time::Instant;

use smallvec::SmallVec;

use crate::backend::{Pending, RawEvent};
use crate::base::error::{Error, Result};
use crate::base::types::{TensorId, Tier};
use crate::residency::{Flight, Replica};
use crate::tiers::Ext;
use copy::{Done, Dst, HostCopy, Src};

impl Shared {
    /// Waits, without the lock, for a flight to end; a queued engine job is moved to the front
    /// (or, on an inline engine, run here). Returns the seconds waited.
    pub(crate) fn wait_flight(&self, f: &Arc<Flight>) -> f64 {
        let t = Instant::now();
        if let (Some(job), Some(engine)) = (f.job, self.workers.get()) {
            engine.expedite(job, self);
        }
        f.done.wait();
        t.elapsed().as_secs_f64()
    }

    /// Takes the lock once `id` has no exclusive flight (and, when `exclusive`, no readers
    /// either), waiting for those flights without the lock. Errors for an unknown id. The second
    /// value is the seconds spent waiting.
    pub(crate) fn lock_when_free(
        &self,
        id: TensorId,
        exclusive: bool,
    ) -> Result<(Locked<'_>, f64)> {
        let mut waited = 0.0;
        // Whether this thread counts among the tensor's writers waiting for its readers.
        let mut counted = false;
        let uncount = |st: &mut Locked<'_>, counted: bool| {
            if counted {
                if let Ok(e) = st.res.get_mut(id) {
                    e.writers_waiting -= 1;
                }
            }
        };
        loop {
            let mut st = self.lock();
            // (A tensor removed meanwhile is an error here; its count went with it.)
            if !st.res.get(id)?.unsettled.is_empty() {
                st.settle(id);
                // An event still cannot be recorded after a view's work (the backend keeps
                // failing): wait for that work on the host instead, without the lock, so that
                // nothing reads, frees or overwrites the tensor under it. If the backend cannot
                // even do that, the operation fails with its error (never a wrong byte).
                let left = st.res.get(id)?.unsettled.clone();
                if !left.is_empty() {
                    drop(st);
                    for (stream, key) in &left {
                        if let Err(e) = stream.synchronize_as(*key) {
                            uncount(&mut self.lock(), counted);
                            return Err(e);
                        }
                    }
                    self.lock().settled_by_sync(id, &left);
                    continue;
                }
            }
            let e = st.res.get(id)?;
            let f = if exclusive { e.any_flight() } else { e.flight.clone() };
            let Some(f) = f else {
                uncount(&mut st, counted);
                return Ok((st, waited));
            };
            let readers =
                e.flight.is_none() && e.read_flight.as_ref().is_some_and(|r| Arc::ptr_eq(r, &f));
            if exclusive && readers && !counted {
                st.res.get_mut(id)?.writers_waiting += 1;
                counted = true;
            }
            drop(st);
            waited += self.wait_flight(&f);
        }
    }

    /// [`Shared::lock_when_free`] for a new shared host view, a read claim held for long: it
    /// also waits while a writer waits for the readers before it (without that, readers whose
    /// views overlap would keep a writer waiting for ever).
    pub(crate) fn lock_for_shared_view(&self, id: TensorId) -> Result<Locked<'_>> {
        loop {
            let (st, _) = self.lock_when_free(id, false)?;
            let e = st.res.get(id)?;
            if e.writers_waiting == 0 {
                return Ok(st);
            }
            match e.read_flight.clone() {
                // The readers before this one finish, then the writer takes its flight.
                Some(f) => {
                    drop(st);
                    self.wait_flight(&f);
                }
                // The readers are done and the writer is about to take the tensor.
                None => {
                    drop(st);
                    std::thread::yield_now();
                }
            }
        }
    }
}

impl Shared {
    /// [`Shared::lock_when_free`] for an exclusive operation that needs the tensor now: a
    /// prefetch job of it that is still queued is revoked rather than waited for (a view, which
    /// wants that prefetch's copy, waits for it instead).
    pub(crate) fn lock_exclusive_now(&self, id: TensorId) -> Result<(Locked<'_>, f64)> {
        let mut st = self.lock();
        prefetch::revoke_queued(self, &mut st, id);
        drop(st);
        self.lock_when_free(id, true)
    }

    /// Takes the lock once `id` is past its put: a tensor whose first copy is still being
    /// written has a name and an id but no bytes yet.
    pub(crate) fn lock_when_put(&self, id: TensorId) -> Result<Locked<'_>> {
        loop {
            let st = self.lock();
            let e = st.res.get(id)?;
            let f = match &e.flight {
                Some(f) if e.count() == 0 => f.clone(),
                _ => return Ok(st),
            };
            drop(st);
            self.wait_flight(&f);
        }
    }
}

impl Locked<'_> {
    /// Releases the lock while `f` runs (the work of a flight), then takes it again.
    pub(crate) fn unlocked<R>(&mut self, f: impl FnOnce() -> R) -> R {
        self.release();
        let r = f();
        self.retake();
        r
    }
}

/// Plans a copy of `id`'s replica in `from` into `dst` (an extent of `to`), under the lock.
pub(crate) fn prepare_copy(
    sh: &Shared,
    st: &State,
    id: TensorId,
    from: Tier,
    to: Tier,
    dst: &Ext,
) -> Result<HostCopy<'static>> {
    prepare_copy_into(sh, st, id, from, dst_of(sh, to, dst)?)
}

/// The destination of a copy into `ext`, an extent of `to`.
pub(crate) fn dst_of(sh: &Shared, to: Tier, ext: &Ext) -> Result<Dst> {
    Ok(match ext {
        Ext::Mem(x) => {
            Dst::Mem(to, sh.mem.arena(to).ok_or(Error::TierDisabled { tier: to })?.write_lease(x))
        }
        Ext::Disk { .. } => Dst::Disk(ext.disk_range().expect("a disk extent")),
        Ext::File { file, .. } => {
            return Err(Error::InvalidArgument(format!(
                "{} is read-only to the store",
                file.path().display()
            )))
        }
    })
}

/// Plans a copy of `id`'s replica in `from` into `dst`, under the lock.
pub(crate) fn prepare_copy_into(
    sh: &Shared,
    st: &State,
    id: TensorId,
    from: Tier,
    dst: Dst,
) -> Result<HostCopy<'static>> {
    let e = st.res.get(id)?;
    let r = e.replicas[from.index()].as_ref().ok_or(Error::NotInTier { id, tier: from })?;
    let src = match &r.ext {
        Ext::Mem(x) => Src::Mem(
            from,
            sh.mem.arena(from).ok_or(Error::TierDisabled { tier: from })?.read_lease(x),
        ),
        Ext::Disk { crc, .. } => Src::Disk(r.ext.disk_range().expect("a disk extent"), *crc),
        Ext::File { file, offset, .. } => Src::File(file.clone(), *offset),
    };
    // The source's bytes are valid after `ready`, and device work through views (and copies
    // reading it) may still touch it.
    let mut waits: SmallVec<[RawEvent; 2]> = r.ready.iter().cloned().collect();
    waits.extend(e.uses.pending().cloned());
    Ok(HostCopy { id, name: e.meta.name.clone(), src, dst, waits, lane: 0 })
}

/// Plans a copy of the caller's bytes into `dst` (an extent of `to`).
pub(crate) fn prepare_fill<'a>(
    sh: &Shared,
    st: &State,
    id: TensorId,
    to: Tier,
    dst: &Ext,
    data: &'a [u8],
) -> Result<HostCopy<'a>> {
    let name = st.res.get(id)?.meta.name.clone();
    let dst = dst_of(sh, to, dst)?;
    Ok(HostCopy { id, name, src: Src::User(data), dst, waits: SmallVec::new(), lane: 0 })
}

impl State {
    /// Records a finished or issued copy of `id` from `from` (`None`: the caller's bytes) into
    /// `ext` in `to`: the new replica, the counters, the copy's spans and its use of the source.
    pub(crate) fn commit_copy(
        &mut self,
        id: TensorId,
        from: Option<Tier>,
        to: Tier,
        mut ext: Ext,
        done: Done,
    ) {
        if let (Ext::Disk { crc, .. }, Some(c)) = (&mut ext, done.crc) {
            *crc = c;
        }
        if !self.res.get(id).is_ok_and(|e| !e.has(to)) {
            // Removed meanwhile, or already there (neither can happen to a tensor in flight):
            // give the memory back rather than lose it, once the copy into it is done.
            let waits = done.ready.into_iter().map(Pending::Ev).collect();
            match to {
                Tier::Device => self.books.retire_device(ext, waits),
                t => self.books.free_after(t, ext, waits),
            }
            return;
        }
        let ready = self.note_copy(id, from, to, done);
        self.res.put_replica(id, to, Replica::new(ext, ready));
        self.reindex(id);
    }

    /// Records a fill of `id`'s replica in `to` made in place (the replica was put, marked
    /// filling, before the copy ran).
    pub(crate) fn commit_fill(&mut self, id: TensorId, from: Tier, to: Tier, done: Done) {
        let ready = self.note_copy(id, Some(from), to, done);
        if let Some(r) = self.res.get_mut(id).ok().and_then(|e| e.replicas[to.index()].as_mut()) {
            r.ready = ready;
            r.filling = false;
        }
        self.reindex(id);
    }

    /// The counters, spans and uses of a copy; returns its `ready` event.
    fn note_copy(
        &mut self,
        id: TensorId,
        from: Option<Tier>,
        to: Tier,
        done: Done,
    ) -> Option<RawEvent> {
        let Done { ready, spans, use_by, .. } = done;
        if let Ok(e) = self.res.get_mut(id) {
            let bytes = e.bytes();
            if let Some((stream, ev)) = use_by {
                e.uses.record(stream.key(), &stream, ev);
            }
            if to == Tier::Device && from.is_some() {
                e.device_loads += 1;
            }
            match from {
                Some(f) => self.counters.moved[f.index()][to.index()] += bytes,
                None => self.counters.bytes_in += bytes,
            }
        }
        if let Some(tl) = self.timeline.as_mut() {
            for s in spans {
                tl.push(s);
            }
        }
        ready
    }
}

/// Copies `id`'s replica in `from` into `ext`, a new extent of `to`, and records the new replica
/// (the copy counted as moved from `from`). On failure `ext` is freed and the tensor is as it
/// was. Returns the new replica's `ready` event. `id` must be in flight if the copy needs the
/// host.
pub(crate) fn copy_replica(
    sh: &Shared,
    st: &mut Locked<'_>,
    id: TensorId,
    from: Tier,
    to: Tier,
    ext: Ext,
) -> Result<Option<RawEvent>> {
    let prepared = prepare_copy(sh, st, id, from, to, &ext);
    finish_copy(sh, st, id, Some(from), to, ext, prepared)
}

/// Writes the caller's bytes into `ext`, a new extent of `to`, and records the new replica
/// (counted as moved from `counted_from`, or as bytes put into the store). On failure `ext` is
/// freed and the tensor is as it was. `id` must be in flight.
pub(crate) fn fill_replica(
    sh: &Shared,
    st: &mut Locked<'_>,
    id: TensorId,
    to: Tier,
    ext: Ext,
    data: &[u8],
    counted_from: Option<Tier>,
) -> Result<Option<RawEvent>> {
    let prepared = prepare_fill(sh, st, id, to, &ext, data);
    finish_copy(sh, st, id, counted_from, to, ext, prepared)
}

fn finish_copy(
    sh: &Shared,
    st: &mut Locked<'_>,
    id: TensorId,
    from: Option<Tier>,
    to: Tier,
    ext: Ext,
    prepared: Result<HostCopy<'_>>,
) -> Result<Option<RawEvent>> {
    // A copy into host memory that the CPU carries out (not a DMA) is over when `run_copy`
    // returns: nothing else writes `ext`, so a failure frees it at once (a failed move leaves
    // the tiers' usage as it was, not waiting on a stream).
    let mut by_host = to != Tier::Device;
    let done = prepared.and_then(|copy| {
        by_host &= !copy.is_dma(sh);
        run_copy(sh, st, copy)
    });
    match done {
        Ok(done) => {
            let ready = done.ready.clone();
            st.commit_copy(id, from, to, ext, done);
            Ok(ready)
        }
        Err(e) if by_host => {
            st.books.free(to, ext);
            Err(e)
        }
        Err(e) => {
            release_failed(sh, st, to, ext);
            Err(e)
        }
    }
}

/// Gives back `ext`, an extent of `t` allocated for a copy that failed or was given up. A DMA
/// into it may have been issued before the failure (its event never recorded), and a Device
/// extent's writer waited for its memory's earlier owners: so the memory is freed only after
/// the copy stream that writes `t` has run what it was given (an event recorded now, which
/// follows both), or, if even that event cannot be recorded, once that stream is known to be
/// done ([`Pending::Stream`]). Disk extents are written by the host alone: freed now.
pub(crate) fn release_failed(sh: &Shared, st: &mut State, t: Tier, ext: Ext) {
    let stream = match t {
        Tier::Device => sh.backend.h2d(),
        Tier::Pinned | Tier::Mapped => sh.backend.d2h(),
        Tier::Disk => return st.books.free(t, ext),
    };
    let pending = match stream.record() {
        Ok(ev) => Pending::Ev(ev),
        Err(_) => Pending::Stream(stream.clone()),
    };
    let waits = smallvec::smallvec![pending];
    match t {
        Tier::Device => st.books.retire_device(ext, waits),
        t => st.books.free_after(t, ext, waits),
    }
}

/// Drops `id`'s replica in `t` after a write into it failed half-way: like
/// [`State::drop_replica`], but its memory also waits for the copy stream that may still be
/// writing it (see [`release_failed`]).
pub(crate) fn drop_torn(sh: &Shared, st: &mut State, id: TensorId, t: Tier) {
    let Ok(e) = st.res.get(id) else { return };
    let mut pending = e.pending();
    let stream = match t {
        Tier::Device => Some(sh.backend.h2d()),
        Tier::Pinned | Tier::Mapped => Some(sh.backend.d2h()),
        Tier::Disk => None,
    };
    if let Some(s) = stream {
        pending.push(match s.record() {
            Ok(ev) => Pending::Ev(ev),
            Err(_) => Pending::Stream(s.clone()),
        });
    }
    if t == Tier::Device {
        st.consume_prefetch(id);
    }
    let Some(r) = st.res.take_replica(id, t) else { return };
    match t {
        Tier::Device => st.books.retire_device(r.ext, pending),
        t => st.books.free_after(t, r.ext, pending),
    }
    st.reindex(id);
}

/// Runs a prepared copy: issued at once when it is a DMA (under the lock), else carried out
/// without the lock. `id` must be in flight when the copy needs the host.
pub(crate) fn run_copy(sh: &Shared, st: &mut Locked<'_>, copy: HostCopy<'_>) -> Result<Done> {
    if copy.is_dma(sh) {
        copy.issue(sh)
    } else {
        st.unlocked(|| copy.run(sh, None))
    }
}
