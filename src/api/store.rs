//! [`Store`]: the public surface. Each call takes the lock to decide and record, and leaves the
//! work itself to the migration layer ([`crate::migrate::ops`]), which runs it without the lock.

use std::path::PathBuf;
use std::sync::Arc;

use super::{DeviceView, HostRead, HostView, MappedView, Stats, Stream, TierStats};
use crate::backend::sim::Simulation;
use crate::backend::{Backend, Pending};
use crate::base::element::Element;
use crate::base::error::{Error, Result};
use crate::base::types::{BackendKind, DType, Group, TensorId, Tier};
use crate::migrate::ops;
use crate::migrate::Shared;
use crate::tiers::Ext;

/// A tiered tensor store. `Send + Sync`: share it (`Arc<Store>` or `&Store`) between threads.
///
/// Every method takes `&self`. The store's metadata sits behind one lock, held only to decide
/// and record; disk I/O, host copies and every host wait run without it, so a thread whose
/// tensor is resident is not held up by another thread's miss on a large tensor. An operation on
/// a tensor that another thread is moving waits for that move (without the lock).
///
/// See the [crate docs](crate) for an example.
pub struct Store {
    pub(crate) shared: Arc<Shared>,
}

/// Public facts about one tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Its id.
    pub id: TensorId,
    /// Its name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<usize>,
    /// Size in bytes.
    pub bytes: u64,
    /// Tiers holding a valid copy, fastest first.
    pub tiers: Vec<Tier>,
    /// Times the tensor was copied into the Device tier from another tier (migrations,
    /// prefetches, promotions): how often it had to cross PCIe.
    pub device_loads: u64,
    /// Its group.
    pub group: Group,
}

impl Store {
    /// A builder with default budgets.
    pub fn builder() -> super::StoreBuilder {
        super::StoreBuilder::default()
    }

    /// Which backend runs.
    pub fn backend(&self) -> BackendKind {
        self.shared.backend.kind()
    }

    /// One line on the backend: the GPU's name and memory, or the host backend and why no GPU
    /// was used.
    pub fn backend_description(&self) -> String {
        match &self.shared.note {
            Some(why) => format!("{} ({why})", self.shared.backend.describe()),
            None => self.shared.backend.describe(),
        }
    }

    /// The host's simulated time in seconds, on a [simulated](super::StoreBuilder::simulate)
    /// store.
    pub fn simulated_seconds(&self) -> Option<f64> {
        self.shared.backend.sim().map(|c| c.now())
    }

    /// The simulated clock of a [simulated](super::StoreBuilder::simulate) store, which compute
    /// built on the store charges with the device time its host work stands for.
    pub(crate) fn sim_clock(&self) -> Option<Arc<crate::backend::sim::SimClock>> {
        self.shared.backend.sim().cloned()
    }

    /// The machine a [simulated](super::StoreBuilder::simulate) store simulates.
    pub fn simulation(&self) -> Option<Simulation> {
        self.shared.backend.sim().map(|c| c.spec)
    }

    /// The CUDA context, on the CUDA backend.
    pub fn cuda_context(&self) -> Option<&Arc<cudarc::driver::CudaContext>> {
        match &self.shared.backend {
            Backend::Cuda(b) => Some(&b.ctx),
            Backend::Host(_) => None,
        }
    }

    /// A new stream of this store's backend for the caller's work (kernels, views).
    pub fn stream(&self) -> Result<Stream> {
        Ok(Stream { raw: self.shared.backend.new_stream()? })
    }

    /// Stores a new tensor named `name` and returns its id. `data` holds its bytes
    /// (`dtype.size_of() * shape.iter().product()` of them, native byte order). The tensor goes
    /// to the fastest tier with room; when every tier is full, the policy picks tensors to demote.
    pub fn put(&self, name: &str, dtype: DType, shape: &[usize], data: &[u8]) -> Result<TensorId> {
        self.put_group(name, Group::Other, dtype, shape, data)
    }

    /// [`Store::put`] with the tensor's [`Group`], for the per-group accounting of [`Stats`].
    pub fn put_group(
        &self,
        name: &str,
        group: Group,
        dtype: DType,
        shape: &[usize],
        data: &[u8],
    ) -> Result<TensorId> {
        ops::put(&self.shared, None, name, group, dtype, shape, data)
    }

    /// [`Store::put_group`] into one tier: the tensor goes to `tier` (the policy demotes
    /// tensors there to make room) or the call fails with [`Error::OutOfMemory`] or
    /// [`Error::TooLarge`], leaving the other tiers alone. For state whose home is known, such
    /// as an optimizer's moments in Pinned memory.
    pub fn put_in(
        &self,
        tier: Tier,
        name: &str,
        group: Group,
        dtype: DType,
        shape: &[usize],
        data: &[u8],
    ) -> Result<TensorId> {
        let put = || ops::put(&self.shared, Some(tier), name, group, dtype, shape, data);
        match tier {
            Tier::Device => self.shared.device_work(put),
            _ => put(),
        }
    }

    /// The tensor's bytes, from its fastest replica. Counts as an access; on a miss the policy
    /// may promote the tensor to the fastest tier (a promotion that fails does not fail the
    /// read). While a device or mapped view of the tensor lives, its kernels may be writing the
    /// view's memory: the read takes another copy where there is one (the bytes from before the
    /// view); else it reads the view's memory, and ordering it against the view's writes is the
    /// caller's (see [`DeviceView`]'s ordering rules).
    pub fn read(&self, id: TensorId) -> Result<Vec<u8>> {
        ops::read(&self.shared, id, ops::ReadKind::Access)
    }

    /// Stores a new tensor of `T`s (dtype [`Element::DTYPE`]) named `name`: the typed
    /// [`Store::put`]. `data` holds `shape.iter().product()` values.
    ///
    /// ```
    /// # fn main() -> strata::Result<()> {
    /// let store = strata::Store::builder().host_backend().build()?;
    /// let bias = store.put_slice("bias", &[3], &[half::bf16::from_f32(0.5); 3])?;
    /// assert_eq!(store.info(bias)?.dtype, strata::DType::BF16);
    /// assert_eq!(store.read_vec::<half::bf16>(bias)?[2].to_f32(), 0.5);
    /// # Ok(()) }
    /// ```
    pub fn put_slice<T: Element>(
        &self,
        name: &str,
        shape: &[usize],
        data: &[T],
    ) -> Result<TensorId> {
        self.put(name, T::DTYPE, shape, T::as_bytes(data))
    }

    /// The tensor's values as `T`s: the typed [`Store::read`] (the bytes are read straight into
    /// the returned vector). A tensor of another dtype than `T`'s is
    /// [`Error::DTypeMismatch`]; a `bool` tensor holding a byte other than 0 and 1 is
    /// [`Error::InvalidArgument`].
    pub fn read_vec<T: Element>(&self, id: TensorId) -> Result<Vec<T>> {
        ops::read_as(&self.shared, id, ops::ReadKind::Access, true)
    }

    /// Replaces the tensor's values with `data`: the typed [`Store::write`] (a tensor of another
    /// dtype than `T`'s is [`Error::DTypeMismatch`]).
    pub fn write_slice<T: Element>(&self, id: TensorId, data: &[T]) -> Result<()> {
        let dtype = self.info(id)?.dtype;
        if dtype != T::DTYPE {
            return Err(Error::DTypeMismatch { id, dtype, asked: std::any::type_name::<T>() });
        }
        self.write(id, T::as_bytes(data))
    }

    /// `read` that never promotes: for state the caller reads, updates and writes back where
    /// it was (an optimizer's moments on disk).
    pub(crate) fn read_in_place(&self, id: TensorId) -> Result<Vec<u8>> {
        ops::read(&self.shared, id, ops::ReadKind::InPlace)
    }

    /// A read that is not an access (a save): never promotes, not counted, not told to the
    /// policy.
    pub(crate) fn read_quiet(&self, id: TensorId) -> Result<Vec<u8>> {
        ops::read(&self.shared, id, ops::ReadKind::Quiet)
    }

    /// `read_vec` that never promotes (`read_in_place` read straight into a vector of `T`s).
    #[cfg(feature = "candle")]
    pub(crate) fn read_in_place_as<T: Element>(&self, id: TensorId) -> Result<Vec<T>> {
        ops::read_as(&self.shared, id, ops::ReadKind::InPlace, true)
    }

    /// Replaces the tensor's bytes (`data` must be as long as the tensor). The new bytes go to
    /// a new copy in the tier of the fastest one (or, without room there, wherever a `put`
    /// would put them), and the old copies are dropped once it is in place: a write that fails
    /// leaves the tensor as it was. Only when there is no room for a second copy anywhere is
    /// the fastest copy overwritten in place, and only if another copy keeps the old bytes.
    pub fn write(&self, id: TensorId, data: &[u8]) -> Result<()> {
        ops::write(&self.shared, id, data)
    }

    /// Removes the tensor and frees its memory (once work still touching it is done). Its id
    /// stays invalid.
    pub fn remove(&self, id: TensorId) -> Result<()> {
        ops::remove(&self.shared, id)
    }

    /// Bytes of the tensors of each [`Group`] (indexed by [`Group::index`]) with a copy in
    /// `tier`: `Stats::groups` for one tier, without the rest of a stats snapshot (cheap enough
    /// to sample after every layer).
    pub fn bytes_by_group(&self, tier: Tier) -> [u64; 5] {
        self.shared.lock().res.bytes_by_group(tier)
    }

    /// Declares the tensor's contents dead until it is next written (a gradient the optimizer
    /// has consumed, an activation the backward pass is done with): when the policy evicts its
    /// device copy, the copy is dropped without being written back to a memory tier, saving
    /// the device-to-host traffic. Reads before the next write return unspecified bytes.
    /// Work already issued on the device copy is unaffected.
    pub fn discard(&self, id: TensorId) -> Result<()> {
        self.shared.lock().res.get_mut(id)?.discarded = true;
        Ok(())
    }

    /// Changes a tensor's [`Group`].
    pub fn set_group(&self, id: TensorId, group: Group) -> Result<()> {
        let mut st = self.shared.lock();
        st.res.set_group(id, group)?;
        st.reindex(id);
        Ok(())
    }

    /// The id of the tensor named `name`.
    pub fn lookup(&self, name: &str) -> Option<TensorId> {
        let st = self.shared.lock();
        let id = *st.res.names.get(name)?;
        st.res.get(id).is_ok_and(|e| !e.loading).then_some(id)
    }

    /// The fastest tier holding a valid copy of the tensor (or one being filled by a prefetch).
    pub fn tier_of(&self, id: TensorId) -> Result<Tier> {
        self.shared.lock_when_put(id)?.res.get(id)?.fastest().ok_or(Error::UnknownId(id))
    }

    /// Name, dtype, shape, size and tiers of a tensor.
    pub fn info(&self, id: TensorId) -> Result<TensorInfo> {
        let st = self.shared.lock_when_put(id)?;
        let e = st.res.get(id)?;
        Ok(TensorInfo {
            id,
            name: e.meta.name.to_string(),
            dtype: e.meta.dtype,
            shape: e.meta.shape.to_vec(),
            bytes: e.bytes(),
            tiers: Tier::ALL.into_iter().filter(|&t| e.has(t)).collect(),
            device_loads: e.device_loads,
            group: e.group,
        })
    }

    /// Every tensor's id, in the order they were put.
    pub fn ids(&self) -> Vec<TensorId> {
        let st = self.shared.lock();
        let mut ids: Vec<TensorId> =
            st.res.slab.iter().filter(|(_, e)| !e.loading).map(|(id, _)| id).collect();
        ids.sort_unstable();
        ids
    }

    /// Moves the tensor to `tier` and returns when the copy is done: afterwards
    /// `tier_of(id) == tier` and no faster tier holds a copy. Room is made in `tier` by demoting
    /// other tensors if needed. A tensor held by a view, pin or layer scope can only be "moved"
    /// where it already is, which changes nothing (a pin still waiting for Device room stays
    /// waiting: the next hint or view starts it).
    pub fn move_to(&self, id: TensorId, tier: Tier) -> Result<()> {
        let moved = || ops::move_to(&self.shared, id, tier);
        match tier {
            Tier::Device | Tier::Mapped => self.shared.device_work(moved),
            _ => moved(),
        }
    }

    /// Bytes of `tier`'s budget a tensor of `bytes` takes there: its size rounded up to what
    /// the tier's allocator hands out (256 B on the device; a page on the disk tier; a page in
    /// host memory, small tensors sharing pages), 0 for an empty tensor, and `bytes` itself for
    /// a disabled tier. For planning how many tensors fit before putting them.
    ///
    /// ```
    /// # use strata::{Store, Tier};
    /// # fn main() -> strata::Result<()> {
    /// let store = Store::builder().host_backend().build()?;
    /// assert_eq!(store.footprint(Tier::Disk, 10), 4096);
    /// assert_eq!(store.footprint(Tier::Device, 300), 512);
    /// assert_eq!(store.footprint(Tier::Disk, 0), 0);
    /// # Ok(()) }
    /// ```
    pub fn footprint(&self, tier: Tier, bytes: u64) -> u64 {
        self.shared.lock().books.reserved_size(tier, bytes)
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        let mut st = self.shared.lock();
        // Extents waiting for finished work are free: count them so.
        st.books.reap();
        let mut tiers = [TierStats::default(); 4];
        for t in Tier::ALL {
            if st.books.enabled(t) {
                tiers[t.index()] = TierStats {
                    used: st.books.used(t),
                    capacity: st.books.capacity(t),
                    reserved: st.books.capacity(t),
                    largest_free: st.books.largest_free(t),
                    tensors: st.res.tensors_in(t),
                    free_ranges: st.books.free_ranges(t),
                    write_reserve: st.books.reserve_bytes(t),
                };
            } else {
                tiers[t.index()].tensors = st.res.tensors_in(t);
            }
        }
        st.resolve_probes();
        let copy_seconds = match st.timeline.as_mut() {
            Some(tl) => {
                tl.resolve();
                tl.copy_seconds()
            }
            None => 0.0,
        };
        let mut groups = [[0u64; 4]; 5];
        for t in Tier::ALL {
            for (g, b) in st.res.bytes_by_group(t).into_iter().enumerate() {
                groups[g][t.index()] = b;
            }
        }
        let c = &st.counters;
        Stats {
            groups,
            prefetch_hits: c.prefetch_hits,
            prefetch_misses: c.prefetch_misses,
            prefetches: c.prefetches,
            stall_seconds: c.stall_s,
            copy_seconds,
            timeline: st.timeline.is_some(),
            prefetch_in_flight: st.place.inflight,
            tiers,
            moved: c.moved,
            bytes_in: c.bytes_in,
            bytes_out: c.bytes_out,
            hits: c.hits,
            misses: c.misses,
            evictions: c.evictions,
            promotions: c.promotions,
            tensors: st.res.slab.len(),
            backend: self.backend(),
            policy: st.place.policy.name(),
            disk_direct_io: self.shared.mem.disk.as_ref().is_some_and(|d| d.direct_io()),
        }
    }

    /// Blocks the calling thread (without the store's lock) until every copy the store has
    /// issued so far between host memory and the device has run, and the work that memory the
    /// store let go of still waits for is done (a view's kernels on the caller's stream that
    /// used a tensor since removed), then frees that memory.
    ///
    /// Nothing else waits for it: `remove`, `move_to`, a write or an eviction that drops a
    /// copy of a tensor hands its memory back once the work still touching the tensor is done
    /// (an upload a read's promotion started, a demotion), and until a later call finds that
    /// work done, [`Stats::used`] still counts it. Call this first where the books must show
    /// the tensors alone (a test that empties the store and expects every tier at 0). Memory a
    /// running operation of another thread holds (a read in progress, a shared host view) is
    /// not waited for, nor are copies a prefetch starts later.
    pub fn wait_for_copies(&self) -> Result<()> {
        let backend = &self.shared.backend;
        for stream in [backend.h2d(), backend.d2h()] {
            stream.synchronize()?;
        }
        let waits: Vec<Pending> = {
            let st = self.shared.lock();
            Tier::ALL.into_iter().flat_map(|t| st.books.deferred_waits(t)).collect()
        };
        for w in waits.iter().filter(|w| !matches!(w, Pending::Done(_))) {
            w.wait()?;
        }
        self.shared.lock().books.reap();
        Ok(())
    }

    /// Where the disk tier keeps the tensor's bytes, if the tensor has a copy on disk: a path
    /// that opens the file from this process (the store's slab has no name of its own:
    /// `/proc/self/fd/N`; a loaded tensor file's path) and the byte offset. For diagnostics and
    /// tests.
    pub fn disk_location(&self, id: TensorId) -> Result<Option<(PathBuf, u64)>> {
        let st = self.shared.lock();
        let e = st.res.get(id)?;
        Ok(match e.replicas[Tier::Disk.index()].as_ref().map(|r| &r.ext) {
            Some(Ext::Disk { ext, .. }) => {
                self.shared.mem.disk.as_ref().map(|d| (d.fd_path(), ext.offset()))
            }
            Some(Ext::File { file, offset, .. }) => Some((file.path().to_path_buf(), *offset)),
            _ => None,
        })
    }

    /// Returns (and clears) the first error that happened where it could not be returned: in a
    /// view's `Drop`, in a prefetch run by a worker, or in a CUDA call made while freeing
    /// memory.
    pub fn check_err(&self) -> Result<()> {
        let mut d = self.shared.deferred.lock();
        if !d.is_empty() {
            let e = d.remove(0);
            self.shared.health.note_err(&e);
            return Err(e);
        }
        drop(d);
        // The store's own CUDA errors from drops and completion checks (never the caller's, in
        // the context's slot: those are theirs to take).
        if let Backend::Cuda(b) = &self.shared.backend {
            if let Some(e) = crate::backend::cuda::take_deferred(&b.ctx) {
                self.shared.health.note_err(&e);
                return Err(e);
            }
        }
        Ok(())
    }

    /// Makes the tensor resident on the Device and returns a view of it for work on `stream`.
    ///
    /// If a copy is needed it is issued on the host-to-device copy stream and `stream` is made to
    /// wait for it: the calling thread does not block on the copy (a copy from disk is read by
    /// this thread, without the store's lock). `stream` also waits for the last work other
    /// streams did on the tensor (see [`DeviceView`]'s ordering rules). While the view lives the
    /// tensor is neither evicted nor moved; dropping it records an event on `stream` that
    /// anything later reusing the memory waits for. Call [`DeviceView::mark_dirty`] after
    /// writing through it.
    pub fn device_view(&self, id: TensorId, stream: &Stream) -> Result<DeviceView> {
        self.check_stream(stream)?;
        let parts =
            self.shared.device_work(|| ops::device_view(&self.shared, id, &stream.raw, false))?;
        Ok(DeviceView::new(self.shared.clone(), id, Tier::Device, stream.raw.clone(), parts))
    }

    /// A device view for work that overwrites every byte of the tensor (an output: an
    /// activation, a gradient): like [`Store::device_view`], but a tensor not on the device gets
    /// its device memory without the copy in, and the view starts dirty, so the copies in other
    /// tiers are dropped when it drops. Reading the memory before writing it gives stale bytes.
    /// The stream still waits for every other stream's last use of the tensor before it writes.
    pub fn device_view_for_overwrite(&self, id: TensorId, stream: &Stream) -> Result<DeviceView> {
        self.check_stream(stream)?;
        let parts =
            self.shared.device_work(|| ops::device_view(&self.shared, id, &stream.raw, true))?;
        let mut view =
            DeviceView::new(self.shared.clone(), id, Tier::Device, stream.raw.clone(), parts);
        view.mark_dirty();
        Ok(view)
    }

    /// A view of the tensor's Mapped replica for zero-copy kernel access: its device pointer
    /// reads host memory in place over PCIe. Fails with [`Error::NotInTier`] if the tensor has no
    /// copy in Mapped (`move_to(id, Tier::Mapped)` first). `stream` waits for any copy still
    /// filling the replica and for other streams' last uses.
    pub fn mapped_view(&self, id: TensorId, stream: &Stream) -> Result<MappedView> {
        self.check_stream(stream)?;
        let parts = self.shared.device_work(|| ops::mapped_view(&self.shared, id, &stream.raw))?;
        Ok(MappedView::new(DeviceView::new(
            self.shared.clone(),
            id,
            Tier::Mapped,
            stream.raw.clone(),
            parts,
        )))
    }

    /// Exclusive CPU access, in place, to the tensor's copy in host memory: its Pinned or
    /// Mapped replica (on the host backend, any memory replica), without the store's lock.
    /// A tensor with no copy in host memory (on disk, or on the device only, or moved out of
    /// host memory by another thread meanwhile) first gets one in Pinned (else Mapped), made
    /// room for like any move. Waits (without the lock) for copies and device work still
    /// touching the tensor. Fails with [`Error::Busy`] if the tensor has another view, a pin or
    /// a scope, and with `OutOfMemory` / `TierDisabled` when no host tier can take it. For
    /// reading from several threads at once, take [`Store::host_view_shared`].
    ///
    /// ```
    /// use strata::{DType, Store, Tier};
    /// # fn main() -> strata::Result<()> {
    /// let store = Store::builder().host_backend().capacity(Tier::Pinned, 1 << 20).build()?;
    /// let id = store.put("m", DType::F32, &[4], &[0u8; 16])?;
    /// let mut v = store.host_view(id)?;
    /// for x in v.f32s_mut().unwrap() {
    ///     *x += 1.5;
    /// }
    /// drop(v);
    /// assert_eq!(store.read(id)?, [1.5f32; 4].iter().flat_map(|x| x.to_ne_bytes()).collect::<Vec<_>>());
    /// # Ok(()) }
    /// ```
    pub fn host_view(&self, id: TensorId) -> Result<HostView> {
        let host_backend = self.backend() == BackendKind::Host;
        let (tier, lease, dtype) = ops::host_view(&self.shared, id, host_backend, true)?;
        Ok(HostView::new(self.shared.clone(), id, tier, lease, dtype))
    }

    /// [`Store::host_view`] without bringing the tensor into host memory: [`Error::NotInTier`]
    /// when it has no copy there (the optimizer's state kept on disk is read out instead).
    pub(crate) fn host_view_in_place(&self, id: TensorId) -> Result<HostView> {
        let host_backend = self.backend() == BackendKind::Host;
        let (tier, lease, dtype) = ops::host_view(&self.shared, id, host_backend, false)?;
        Ok(HostView::new(self.shared.clone(), id, tier, lease, dtype))
    }

    /// Shared CPU access for reading, in place, to the tensor's copy in host memory: any number
    /// of threads may hold one of the same tensor at once (each reads the same bytes), while
    /// what may write the tensor (`write`, `move_to`, `remove`, device views, an exclusive
    /// [`Store::host_view`]) waits until they drop; a new shared view waits for a writer in
    /// progress or already waiting for the readers (so overlapping readers cannot keep a writer
    /// out for ever). A tensor with no copy in host memory first gets one, as for `host_view`.
    /// Fails with [`Error::Busy`] while an exclusive `host_view` of the tensor lives, and when
    /// its only host copy is the memory of a live mapped view (whose kernels may write it; on
    /// the host backend, of a live device view too).
    ///
    /// Like a read-write lock's read guard, a shared view must be dropped before its thread
    /// does anything that writes the tensor (`write`, `move_to`, `remove`, a device view, an
    /// exclusive host view: each would wait for that view), or takes another shared view of it
    /// while a writer may be waiting.
    ///
    /// ```
    /// use strata::{Store, Tier};
    /// # fn main() -> strata::Result<()> {
    /// let store = std::sync::Arc::new(Store::builder().host_backend().build()?);
    /// let table = store.put_slice("embeddings", &[4, 2], &[0.5f32; 8])?;
    /// let readers: Vec<_> = (0..4)
    ///     .map(|_| {
    ///         let store = store.clone();
    ///         std::thread::spawn(move || -> strata::Result<f32> {
    ///             let v = store.host_view_shared(table)?;
    ///             Ok(v.values::<f32>()?.iter().sum())
    ///         })
    ///     })
    ///     .collect();
    /// for r in readers {
    ///     assert_eq!(r.join().unwrap()?, 4.0);
    /// }
    /// # Ok(()) }
    /// ```
    pub fn host_view_shared(&self, id: TensorId) -> Result<HostRead> {
        let host_backend = self.backend() == BackendKind::Host;
        let (tier, lease, dtype) = ops::host_view_shared(&self.shared, id, host_backend)?;
        Ok(HostRead::new(self.shared.clone(), id, tier, lease, dtype))
    }

    /// Refuses a stream of another backend, or of another simulated clock.
    pub(crate) fn check_stream(&self, stream: &Stream) -> Result<()> {
        if stream.raw.kind() != self.backend() {
            return Err(Error::BackendMismatch(format!(
                "a {:?} stream used with a {:?} store",
                stream.raw.kind(),
                self.backend()
            )));
        }
        if let (Backend::Cuda(b), Some(s)) = (&self.shared.backend, stream.cuda()) {
            // A trainer's stream (`Stream::from_cuda`) must be of the store's context: a copy
            // or wait across contexts is an error of the driver at best.
            if s.context().cu_ctx() != b.ctx.cu_ctx() {
                return Err(Error::BackendMismatch(format!(
                    "a stream of CUDA device {} (another context) used with a store on device {}: \
                     build the store with StoreBuilder::context(the stream's context)",
                    s.context().ordinal(),
                    b.ctx.ordinal()
                )));
            }
        }
        let mine = self.shared.backend.sim();
        match (mine, stream.raw.sim_clock()) {
            (None, None) => Ok(()),
            (Some(a), Some(b)) if Arc::ptr_eq(a, b) => Ok(()),
            (Some(_), Some(_)) => Err(Error::BackendMismatch(
                "a stream of another simulated store (each has its own clock: use store.stream())"
                    .into(),
            )),
            (Some(_), None) => Err(Error::BackendMismatch(
                "a stream in real time used with a simulated store (use its store.stream())".into(),
            )),
            (None, Some(_)) => Err(Error::BackendMismatch(
                "a simulated stream used with a store in real time".into(),
            )),
        }
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // The workers first: a running job finishes, queued ones are cancelled.
        if let Some(engine) = self.shared.workers.get() {
            engine.stop(&*self.shared);
        }
        // Views hold the shared state alive; when the last goes, memory is freed after the
        // copies in flight. Waiting here (without the lock) keeps a plain `drop(store)` from
        // freeing memory a copy still uses.
        let pending = self.shared.lock().all_pending();
        for p in pending {
            let _ = p.wait();
        }
        self.shared.lock().books.reap();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::backend::host::HostEvent;
    use crate::backend::RawEvent;
    use crate::{DType, Store, Tier};

    /// A tensor removed while the copy that demoted it is still queued: its Pinned memory is
    /// the copy's destination, so it is freed only once that copy has run, and until then
    /// `Stats::used` counts it; `wait_for_copies` waits for the copy and frees the memory. The
    /// device-to-host stream is held by a gate so the copy is still queued when the tensor goes,
    /// as a busy machine can leave it (how the 8-thread test once saw 16 KiB of Pinned still
    /// used after removing everything).
    #[test]
    fn memory_a_removed_tensor_left_to_a_copy_is_freed_once_the_copy_has_run() {
        let store = Store::builder()
            .host_backend()
            .capacity(Tier::Device, 16 << 10)
            .capacity(Tier::Pinned, 64 << 10)
            .capacity(Tier::Mapped, 0)
            .capacity(Tier::Disk, 0)
            .build()
            .unwrap();
        let (a_bytes, b_bytes) = (vec![1u8; 12 << 10], vec![2u8; 12 << 10]);
        let a = store.put("a", DType::U8, &[a_bytes.len()], &a_bytes).unwrap();
        let b = store.put("b", DType::U8, &[b_bytes.len()], &b_bytes).unwrap();
        assert_eq!(store.info(a).unwrap().tiers, [Tier::Device]);
        assert_eq!(store.info(b).unwrap().tiers, [Tier::Pinned]);
        // Hold the device-to-host stream: what is issued there from now on waits for the gate.
        let gate = Arc::new(HostEvent::default());
        store.shared.backend.d2h().wait(&RawEvent::Host(gate.clone())).unwrap();
        // A miss on `b`: its promotion makes room by demoting `a`, its only copy, to Pinned by a
        // copy queued behind the gate.
        assert_eq!(store.read(b).unwrap(), b_bytes);
        assert_eq!(store.info(a).unwrap().tiers, [Tier::Pinned]);
        assert_eq!(store.info(b).unwrap().tiers, [Tier::Device, Tier::Pinned]);
        store.remove(a).unwrap();
        store.remove(b).unwrap();
        let held = store.footprint(Tier::Pinned, a_bytes.len() as u64);
        assert_eq!(store.stats().used(Tier::Pinned), held, "freed under the copy into it");
        gate.set();
        store.wait_for_copies().unwrap();
        let stats = store.stats();
        for t in Tier::ALL {
            assert_eq!(stats.used(t), 0, "{t} still used once the copies have run");
        }
    }

    /// A store whose write reserve sits in host memory (no Disk tier), where tensors of at
    /// most half a page share pages: the reserve shrinks from a two-page tensor's size to one
    /// page for a small one, then goes with it, and every tier is empty again.
    #[test]
    fn a_write_reserve_in_shared_pages_is_freed_whole() {
        let store = Store::builder()
            .host_backend()
            .capacity(Tier::Device, 0)
            .capacity(Tier::Pinned, 64 << 10)
            .capacity(Tier::Mapped, 0)
            .capacity(Tier::Disk, 0)
            .build()
            .unwrap();
        let big = store.put("big", DType::U8, &[8192], &[1; 8192]).unwrap();
        let small = store.put("small", DType::U8, &[100], &[2; 100]).unwrap();
        assert_eq!(store.stats().tiers[1].write_reserve, 8192);
        store.remove(big).unwrap();
        // Pages of its own, never a slot of a shared page.
        assert_eq!(store.stats().tiers[1].write_reserve, 4096);
        store.write(small, &[3; 100]).unwrap();
        assert_eq!(store.read(small).unwrap(), [3; 100]);
        store.remove(small).unwrap();
        let stats = store.stats();
        assert_eq!((stats.used(Tier::Pinned), stats.tiers[1].write_reserve), (0, 0));
        assert_eq!(stats.tiers[1].largest_free, 64 << 10, "every page back in one range");
    }
}
