//! Migration hints (prefetch, release, pin, layer scopes, step marks), the prefetch machinery
//! behind them, the disk workers' side of a fill, and the Chrome trace.

use std::sync::Arc;
use std::time::Instant;

use super::{Entry, Ext, Level, Replica, Shared, Source, State, Store};
use crate::arena::upload_piece;
use crate::backend::{Backend, RawEvent};
use crate::disk::DiskTier;
use crate::engine::{Engine, Fill, FillRunner};
use crate::error::{Error, Result};
use crate::trace::{self, Span, TimePoint, Track};
use crate::types::{TensorId, Tier};

/// What became of one prefetch request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Resident, or its copy issued.
    Started,
    /// Over the prefetch budget or no room now: try again later.
    Wait,
    /// Nothing to do (no Device tier, or too large for it).
    Skipped,
}

impl Store {
    /// Starts bringing these tensors to the Device tier and returns at once. A later
    /// [`device_view`](Store::device_view) waits only for the copy still in flight, by stream
    /// wait. Prefetched tensors are not evicted until used or [`release`](Store::release)d;
    /// prefetches beyond the [prefetch budget](crate::StoreBuilder::prefetch_budget) start once
    /// earlier ones are used. An unknown id is an error and nothing is prefetched.
    pub fn prefetch(&self, ids: &[TensorId]) -> Result<()> {
        let be = &self.shared.backend;
        let engine = self.shared.engine.get();
        let mut st = self.shared.state.lock();
        st.check_ids(ids)?;
        for &id in ids {
            if st.prefetch_one(be, engine, id, Source::Hint, false)? == Outcome::Wait
                && !st.waiting.contains(&id)
            {
                st.waiting.push_back(id);
            }
        }
        Ok(())
    }

    /// Says these tensors are done with for now: they are the first demoted when room is needed,
    /// and a tensor whose only copy is on the device (written there) starts being written back
    /// to a host tier with room, so that evicting it later costs nothing. Returns at once; no
    /// data is dropped.
    pub fn release(&self, ids: &[TensorId]) -> Result<()> {
        let be = &self.shared.backend;
        let mut st = self.shared.state.lock();
        st.check_ids(ids)?;
        for &id in ids {
            st.release_one(be, id)?;
        }
        st.pump_waiting(be, self.shared.engine.get());
        Ok(())
    }

    /// Keeps these tensors on the device until [`unpin`](Store::unpin)ned (bringing them there
    /// first, asynchronously). A pinned tensor is never evicted, moved or removed (`Busy`). The
    /// pin holds the memory, so its copy does not count against the prefetch budget (which
    /// limits what prefetches bring ahead of use) and does not hold back other prefetches.
    pub fn pin(&self, ids: &[TensorId]) -> Result<()> {
        let be = &self.shared.backend;
        let engine = self.shared.engine.get();
        let mut st = self.shared.state.lock();
        st.check_ids(ids)?;
        for (k, &id) in ids.iter().enumerate() {
            let unprotected = st.entries[&id].prefetched.is_none();
            if let Err(e) = st.prefetch_one(be, engine, id, Source::Hint, true) {
                // All or nothing: undo the pins this call made.
                for &done in &ids[..k] {
                    st.unpin_one(done);
                }
                return Err(e);
            }
            let e = st.entries.get_mut(&id).expect("checked");
            e.pins += 1;
            if unprotected && e.prefetched.is_some() {
                e.pin_prefetch = true;
            }
            if std::mem::take(&mut e.prefetch_charged) {
                let bytes = e.bytes;
                st.inflight = st.inflight.saturating_sub(bytes);
            }
        }
        Ok(())
    }

    /// Undoes one [`pin`](Store::pin) of each tensor. Unpinning a tensor that is not pinned is
    /// an `InvalidArgument` error, and nothing is unpinned.
    pub fn unpin(&self, ids: &[TensorId]) -> Result<()> {
        let mut st = self.shared.state.lock();
        st.check_ids(ids)?;
        for &id in ids {
            let pins = st.entries[&id].pins;
            let asked = ids.iter().filter(|&&x| x == id).count() as u32;
            if pins < asked {
                return Err(Error::InvalidArgument(format!(
                    "unpin of tensor {id:?} pinned {pins} time(s), asked {asked}"
                )));
            }
        }
        for &id in ids {
            st.unpin_one(id);
        }
        st.pump_waiting(&self.shared.backend, self.shared.engine.get());
        Ok(())
    }

    /// A layer scope: this layer uses `uses`, the next one will use `next`. The tensors in `uses`
    /// are made resident (asynchronously; views wait for the copies) and held until the scope
    /// drops, when they are released; `next` is prefetched. Write one around each layer of a
    /// forward and a backward pass:
    ///
    /// ```
    /// # use strata::{DType, Store, Tier};
    /// # fn main() -> strata::Result<()> {
    /// # let store = Store::builder().host_backend().capacity(Tier::Device, 64 << 10).build()?;
    /// # let w: Vec<_> = (0..4).map(|l| store.put(&format!("w{l}"), DType::U8, &[8192], &[0; 8192])).collect::<Result<_, _>>()?;
    /// let s = store.stream()?;
    /// for l in 0..w.len() {
    ///     let next: &[_] = if l + 1 < w.len() { &w[l + 1..l + 2] } else { &[] };
    ///     let _layer = store.layer(&w[l..l + 1], next)?;
    ///     let view = store.device_view(w[l], &s)?;
    ///     // ... launch this layer's kernels on `s` with view.device_ptr() ...
    /// }
    /// # Ok(()) }
    /// ```
    /// What a scope says outranks the policy's own lookahead: scoped and hinted tensors are
    /// never evicted to make room for a guess.
    pub fn layer(&self, uses: &[TensorId], next: &[TensorId]) -> Result<LayerScope> {
        let be = &self.shared.backend;
        let engine = self.shared.engine.get();
        let mut st = self.shared.state.lock();
        st.check_ids(uses)?;
        st.check_ids(next)?;
        for (k, &id) in uses.iter().enumerate() {
            if let Err(e) = st.prefetch_one(be, engine, id, Source::Hint, true) {
                // No scope is returned, so nothing would undo these: undo them here.
                for &done in &uses[..k] {
                    st.entries.get_mut(&done).expect("checked").scopes -= 1;
                }
                return Err(e);
            }
            st.entries.get_mut(&id).expect("checked").scopes += 1;
        }
        for &id in next {
            if st.prefetch_one(be, engine, id, Source::Hint, false)? == Outcome::Wait
                && !st.waiting.contains(&id)
            {
                st.waiting.push_back(id);
            }
        }
        Ok(LayerScope { shared: self.shared.clone(), uses: uses.to_vec() })
    }

    /// Marks the start of a training step, for the schedule-learning policy (which can also
    /// find the period of the accesses without it).
    pub fn step(&self) {
        self.shared.state.lock().policy.on_step();
    }

    /// Writes a Chrome trace (open it in Perfetto, ui.perfetto.dev, or chrome://tracing) of the
    /// copies on each copy stream, the disk workers' reads and the consumers' waits recorded so
    /// far (the most recent 100,000).
    pub fn trace(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let mut st = self.shared.state.lock();
        st.resolve_probes();
        st.timeline.resolve();
        trace::write_chrome(path.as_ref(), &st.timeline)
    }
}

/// A layer's hold on the tensors it uses (see [`Store::layer`]): dropping it releases them.
#[must_use = "the layer's tensors are released when the scope drops"]
pub struct LayerScope {
    shared: Arc<Shared>,
    uses: Vec<TensorId>,
}

impl std::fmt::Debug for LayerScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerScope").field("uses", &self.uses).finish()
    }
}

impl Drop for LayerScope {
    fn drop(&mut self) {
        let be = &self.shared.backend;
        let mut st = self.shared.state.lock();
        let mut res = Ok(());
        for &id in &self.uses {
            if let Some(e) = st.entries.get_mut(&id) {
                e.scopes = e.scopes.saturating_sub(1);
                if res.is_ok() {
                    res = st.release_one(be, id);
                }
            }
        }
        st.pump_waiting(be, self.shared.engine.get());
        drop(st);
        if let Err(e) = res {
            self.shared.deferred.lock().push(e);
        }
    }
}

impl State {
    fn check_ids(&self, ids: &[TensorId]) -> Result<()> {
        match ids.iter().find(|id| !self.entries.contains_key(id)) {
            Some(&id) => Err(Error::UnknownId(id)),
            None => Ok(()),
        }
    }

    /// Undoes one pin of `id`. The last one also ends the prefetch protection the pin gave
    /// (one a `prefetch` or scope hint gave stays until the tensor is used or released).
    fn unpin_one(&mut self, id: TensorId) {
        let Some(e) = self.entries.get_mut(&id) else { return };
        e.pins = e.pins.saturating_sub(1);
        if e.pins == 0 && e.pin_prefetch {
            self.consume_prefetch(id);
        }
    }

    /// Starts bringing `id` to the device. `force` ignores the prefetch budget (the tensor is
    /// needed now: a pin or a scope's own tensors). A hint makes the tensor's protection its
    /// own: a later `unpin` no longer ends it.
    pub(crate) fn prefetch_one(
        &mut self,
        be: &Backend,
        engine: Option<&Engine>,
        id: TensorId,
        source: Source,
        force: bool,
    ) -> Result<Outcome> {
        if !self.enabled(Tier::Device) {
            return Ok(Outcome::Skipped);
        }
        if source == Source::Hint {
            if let Some(e) = self.entries.get_mut(&id) {
                e.pin_prefetch = false;
            }
        }
        let e = self.entry(id)?;
        let bytes = e.bytes;
        if e.views > 0 && e.view_tier != Some(Tier::Device) {
            // Lent to the CPU or to zero-copy kernels, which may be writing it: a copy now
            // would be stale.
            return Ok(Outcome::Skipped);
        }
        if e.replicas[Tier::Device.index()].is_some() {
            // Resident or on its way: protect it until used, as a prefetch would. It moves no
            // bytes, so it does not count against the prefetch budget, which limits copies:
            // counting it would keep the copies the hints and the policy's lookahead want next
            // from starting while hinted layers are resident (an idle copy engine).
            let e = self.entries.get_mut(&id).expect("checked");
            e.released = false;
            match e.prefetched {
                None if e.views == 0 => e.prefetched = Some(source),
                Some(Source::Policy) if source == Source::Hint => e.prefetched = Some(source),
                _ => {}
            }
            return Ok(Outcome::Started);
        }
        if !self.can_ever_fit(Tier::Device, bytes) {
            return Ok(Outcome::Skipped);
        }
        if !force && self.inflight + bytes > self.prefetch_budget {
            return Ok(Outcome::Wait);
        }
        let level = if source == Source::Hint { Level::Demand } else { Level::Guess };
        if source == Source::Policy && self.free_bytes(Tier::Device) < bytes {
            // A guess evicts only what the policy itself would rather lose: for the schedule
            // policy, tensors used later than this one (Belady's comparison).
            let victims = self.victims(Tier::Device, id, level);
            let chosen = super::victims_covering(&victims, bytes, self);
            if !self.policy.admit(Tier::Device, id, &chosen) {
                return Ok(Outcome::Wait);
            }
        }
        let Some(ext) = self.alloc_evicting(be, Tier::Device, bytes, id, level)? else {
            return Ok(Outcome::Wait);
        };
        let src = self.entries[&id].fastest_readable().ok_or(Error::UnknownId(id))?;
        match (src, engine) {
            (Tier::Disk, Some(engine)) => {
                // From disk: a worker reads it without the lock; views wait for its job.
                let fill = Fill::new();
                let mut r = Replica::new(ext, None);
                r.fill = Some(fill.clone());
                self.put_replica(id, Tier::Device, r);
                engine.submit(id, fill);
            }
            _ => self.copy_replica(be, id, src, Tier::Device, ext)?,
        }
        let e = self.entries.get_mut(&id).expect("checked");
        e.prefetched = Some(source);
        e.prefetch_charged = true;
        e.released = false;
        self.inflight += bytes;
        self.counters.prefetches += 1;
        Ok(Outcome::Started)
    }

    /// Starts the hinted prefetches that were waiting, in order, while they fit.
    pub(crate) fn pump_waiting(&mut self, be: &Backend, engine: Option<&Engine>) {
        while let Some(id) = self.waiting.pop_front() {
            if !self.entries.contains_key(&id) {
                continue;
            }
            match self.prefetch_one(be, engine, id, Source::Hint, false) {
                Ok(Outcome::Wait) => {
                    self.waiting.push_front(id);
                    break;
                }
                Ok(_) => {}
                // A hint's copy failing is not the caller's error: the tensor stays where it
                // is, intact, and a view will try (and report) again.
                Err(_) => {}
            }
        }
    }

    /// Prefetches what the policy expects next, within what is left of the prefetch budget.
    /// Guesses never evict prefetched or held tensors.
    pub(crate) fn lookahead(&mut self, be: &Backend, engine: Option<&Engine>) {
        if !self.enabled(Tier::Device) {
            return;
        }
        let room = self.prefetch_budget.saturating_sub(self.inflight);
        if room == 0 {
            return;
        }
        let State { policy, entries, .. } = self;
        let ids = policy.lookahead(room, &mut |id| {
            entries.get(&id).map(|e| {
                if e.replicas[Tier::Device.index()].is_some() {
                    0
                } else {
                    e.bytes
                }
            })
        });
        for id in ids {
            match self.prefetch_one(be, engine, id, Source::Policy, false) {
                Ok(Outcome::Started) | Ok(Outcome::Skipped) => {}
                Ok(Outcome::Wait) | Err(_) => break,
            }
        }
    }

    /// A release hint for one tensor.
    pub(crate) fn release_one(&mut self, be: &Backend, id: TensorId) -> Result<()> {
        self.consume_prefetch(id);
        self.waiting.retain(|&w| w != id);
        let e = self.entries.get_mut(&id).ok_or(Error::UnknownId(id))?;
        if e.replicas[Tier::Device.index()].is_none() {
            return Ok(());
        }
        e.released = true;
        // Written on the device and held nowhere else: start the write-back now, into a host
        // tier with free room (no eviction for a hint), so that dropping it later is free.
        if e.held() == 0 && e.filling().is_none() && e.count() == 1 && !e.discarded {
            let bytes = e.bytes;
            for t in [Tier::Pinned, Tier::Mapped] {
                if self.enabled(t) {
                    if let Some(ext) = self.try_alloc(t, bytes)? {
                        self.copy_replica(be, id, Tier::Device, t, ext)?;
                        break;
                    }
                }
            }
        }
        Ok(())
    }

    /// Adds the stream waits whose events have both completed to the stall time and the trace.
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
                let span = Span {
                    track: Track::Stall,
                    what: "wait",
                    tensor: String::new(),
                    bytes: 0,
                    start: TimePoint::Ev(mark),
                    end: TimePoint::Ev(ready),
                };
                self.timeline.push(span);
            }
        }
    }
}

impl Entry {
    pub(crate) fn count(&self) -> usize {
        self.replicas.iter().flatten().count()
    }
}

impl FillRunner for Shared {
    fn run_fill(&self, worker: usize, id: TensorId, fill: &Arc<Fill>) {
        let res = self.fill_pieces(worker, id);
        let mut st = self.state.lock();
        let outcome = match res {
            Ok((ready, bytes)) => {
                if let Some(e) = st.entries.get_mut(&id) {
                    e.device_loads += 1;
                    if let Some(r) = e.replicas[Tier::Device.index()].as_mut() {
                        r.ready = ready.clone();
                        r.fill = None;
                    }
                }
                st.counters.moved[Tier::Disk.index()][Tier::Device.index()] += bytes;
                Ok(ready)
            }
            Err(err) => {
                // Drop the half-filled replica once no copy into it is in flight; the disk copy
                // is untouched, so nothing is lost.
                if let Some(bufs) = self.worker_staging.get(worker) {
                    for b in bufs.lock().iter_mut() {
                        let _ = b.wait();
                    }
                }
                if st.entries.get(&id).is_some_and(|e| e.replicas[0].is_some()) {
                    let r = st.take_replica(id, Tier::Device);
                    st.free_ext(Tier::Device, r.ext);
                }
                let msg = err.to_string();
                self.deferred.lock().push(err);
                Err(msg)
            }
        };
        drop(st);
        fill.finish(outcome);
    }
}

impl Shared {
    /// Reads `id` from the slab piece by piece into the worker's staging buffers (no lock held)
    /// and issues each piece's host-to-device copy (under the lock). Returns the last copy's
    /// event and the bytes moved; checks the whole tensor's crc.
    fn fill_pieces(&self, worker: usize, id: TensorId) -> Result<(Option<RawEvent>, u64)> {
        let mut bufs = self
            .worker_staging
            .get(worker)
            .ok_or_else(|| Error::InvalidArgument(format!("no staging for disk worker {worker}")))?
            .lock();
        // The slab (crc-checked) or a user's file in place (no checksum of ours).
        let (offset, bytes, expected, name, file) = {
            let st = self.state.lock();
            let e = st.entry(id)?;
            match e.replicas[Tier::Disk.index()].as_ref().map(|r| &r.ext) {
                Some(Ext::Disk(d)) => {
                    (d.offset, e.bytes, Some(DiskTier::expected_crc(d)), e.name.clone(), None)
                }
                Some(Ext::File { file, offset, .. }) => {
                    (*offset, e.bytes, None, e.name.clone(), Some(file.clone()))
                }
                _ => return Err(Error::NotInTier { id, tier: Tier::Disk }),
            }
        };
        let reader = match &file {
            Some(_) => None,
            None => {
                Some(self.disk_reader.as_ref().ok_or(Error::TierDisabled { tier: Tier::Disk })?)
            }
        };
        let step = bufs[0].len();
        let mut crc = crc32fast::Hasher::new();
        let mut last = None;
        let mut off = 0u64;
        let mut k = 0;
        while off < bytes {
            let n = (step as u64).min(bytes - off) as usize;
            let buf = &mut bufs[k % 2];
            k += 1;
            let t0 = Instant::now();
            {
                let b = buf.bytes_mut()?;
                // Whole 4 KiB blocks, so O_DIRECT applies: the extent's reserved size is rounded
                // up to 4 KiB, so the tail read stays inside it.
                match &file {
                    Some(f) => f.read_at(offset + off, &mut b[..n])?,
                    None => {
                        let len = n.next_multiple_of(4096).min(b.len());
                        reader
                            .expect("slab reads have a reader")
                            .read_at(offset + off, &mut b[..len])?;
                        crc.update(&b[..n]);
                    }
                }
            }
            let t1 = Instant::now();
            let mut st = self.state.lock();
            st.h2d_ready(&self.backend)?;
            let State { arenas, entries, timeline, .. } = &mut *st;
            let e = entries.get(&id).ok_or(Error::UnknownId(id))?;
            let Some(Replica { ext: Ext::Mem(dst), .. }) =
                e.replicas[Tier::Device.index()].as_ref()
            else {
                return Err(Error::NotInTier { id, tier: Tier::Device });
            };
            let arena = arenas[Tier::Device.index()]
                .as_ref()
                .ok_or(Error::TierDisabled { tier: Tier::Device })?;
            let start = self.backend.h2d().record()?;
            let ev = upload_piece(self.backend.h2d(), arena, dst, off, buf, n)?;
            timeline.push(Span {
                track: Track::Disk(worker),
                what: "disk read",
                tensor: name.clone(),
                bytes: n as u64,
                start: TimePoint::Host(t0),
                end: TimePoint::Host(t1),
            });
            timeline.push(Span {
                track: Track::H2d,
                what: "h2d",
                tensor: name.clone(),
                bytes: n as u64,
                start: TimePoint::Ev(start),
                end: TimePoint::Ev(ev.clone()),
            });
            last = Some(ev);
            off += n as u64;
        }
        let found = crc.finalize();
        if let Some(expected) = expected.filter(|&x| x != found) {
            if let Some(ev) = &last {
                ev.synchronize()?;
            }
            return Err(Error::Corrupt {
                id,
                name,
                path: reader.map_or_else(Default::default, |r| r.path().to_path_buf()),
                expected,
                found,
            });
        }
        Ok((last, bytes))
    }
}
