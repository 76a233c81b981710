//! The store: the public API, residency (where each tensor's copies are) and placement.
//!
//! A tensor has one or more *replicas*, one per tier at most. Every replica holds the same bytes:
//! a write keeps only the replica it wrote, and a device view marked dirty keeps only the Device
//! replica. The slowest replica is the tensor's home; faster ones are caches that can be dropped
//! for free when room is needed, while a tensor's only replica is demoted (copied one tier down,
//! cascading) instead.
//!
//! All metadata sits behind one mutex. GPU copies are issued under it and complete
//! asynchronously: each replica carries the event after which its bytes are valid, and a tensor
//! carries the events its views' streams recorded when they were dropped; anything that reads a
//! replica waits for the first, anything that frees or overwrites memory waits for both.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use parking_lot::{Mutex, MutexGuard};

use crate::arena::{copier, copy_extent, Extent, MemArena, PinnedStaging, StagingBuf};
use crate::backend::cuda::{self, CudaBackend};
use crate::backend::host::HostBackend;
use crate::backend::sim::{SimClock, Simulation};
use crate::backend::{Backend, RawEvent, RawStream};
use crate::disk::{DiskExtent, DiskTier};
use crate::disk::{DiskReader, ExternalFile};
use crate::engine::{Engine, Fill};
use crate::error::{Error, Result};
use crate::policy::{Policy, PolicyKind};
use crate::stats::{Stats, TierStats};
use crate::trace::{Clock, Span, TimePoint, Timeline, Track};
use crate::types::{format_size, BackendKind, DType, Group, TensorId, Tier};
use crate::view::{DeviceView, HostView, MappedView, Stream};

mod files;
mod hints;
pub use files::LoadOptions;
pub use hints::LayerScope;

/// Default budgets: Device, Pinned, Mapped, Disk.
const DEFAULT_CAPACITY: [u64; 4] = [1 << 30, 1 << 30, 256 << 20, 64 << 30];
/// Pinned staging by default: buffers in flight and their size.
const STAGING_BUFS: usize = 4;
const STAGING_SIZE: usize = 16 << 20;
/// Disk-to-device worker threads by default (each with two staging buffers).
const DISK_WORKERS: usize = 4;

enum BackendChoice {
    Auto,
    Host,
    RequireGpu,
    Simulate(Simulation),
}

/// Configures and builds a [`Store`].
///
/// ```
/// use strata::{Store, Tier};
/// let store = Store::builder()
///     .capacity(Tier::Device, 64 << 20)
///     .capacity(Tier::Mapped, 0) // disable a tier
///     .host_backend()
///     .build()?;
/// assert_eq!(store.stats().capacity(Tier::Mapped), 0);
/// # Ok::<(), strata::Error>(())
/// ```
pub struct StoreBuilder {
    capacity: [u64; 4],
    disk_dir: Option<PathBuf>,
    backend: BackendChoice,
    device: usize,
    context: Option<Arc<cudarc::driver::CudaContext>>,
    policy: Option<Box<dyn Policy>>,
    promote_on_read: bool,
    staging: (usize, usize),
    prefetch_budget: Option<u64>,
    disk_workers: usize,
}

impl Default for StoreBuilder {
    fn default() -> Self {
        StoreBuilder {
            capacity: DEFAULT_CAPACITY,
            disk_dir: None,
            backend: BackendChoice::Auto,
            device: 0,
            context: None,
            policy: None,
            promote_on_read: true,
            staging: (STAGING_BUFS, STAGING_SIZE),
            prefetch_budget: None,
            disk_workers: DISK_WORKERS,
        }
    }
}

impl StoreBuilder {
    /// Sets the budget of `tier` in bytes; 0 disables the tier. Defaults: Device 1 GiB, Pinned
    /// 1 GiB, Mapped 256 MiB, Disk 64 GiB. Memory tiers reserve their whole budget from the
    /// backend when the store is built (pinned memory costs ~0.5 s per GiB to allocate), so no
    /// CUDA allocation happens on the put / read / migrate path; the disk tier's file is sparse.
    pub fn capacity(mut self, tier: Tier, bytes: u64) -> Self {
        self.capacity[tier.index()] = bytes;
        self
    }

    /// Directory of the disk tier's slab file (created if missing). Default: a fresh temporary
    /// directory, removed when the store drops.
    pub fn disk_dir(mut self, dir: impl AsRef<std::path::Path>) -> Self {
        self.disk_dir = Some(dir.as_ref().to_path_buf());
        self
    }

    /// Forces the host backend (tiers emulated in host memory) even when a GPU is present.
    pub fn host_backend(mut self) -> Self {
        self.backend = BackendChoice::Host;
        self
    }

    /// The host backend in simulated time: copies and kernels take the time they would take on
    /// the machine `sim` describes, and the store's timings ([`Stats`], traces, step times read
    /// from events) are simulated ones. For planning an out-of-core run and studying its
    /// pipeline on a machine without a GPU; see [`Simulation`] for what the model leaves out.
    ///
    /// ```
    /// use strata::{DType, Simulation, Store, Tier};
    /// # fn main() -> strata::Result<()> {
    /// // Each simulated byte stands for 1 MiB: a 64 KiB tensor is timed as 64 GiB.
    /// let sim = Simulation::h100().scaled((1 << 20) as f64, 1.0);
    /// let store = Store::builder().simulate(sim).capacity(Tier::Device, 1 << 20).build()?;
    /// let w = store.put("w", DType::U8, &[65536], &[1; 65536])?;
    /// store.move_to(w, Tier::Pinned)?;
    /// let t0 = store.simulated_seconds().unwrap();
    /// store.move_to(w, Tier::Device)?;
    /// let secs = store.simulated_seconds().unwrap() - t0;
    /// assert!((secs - 64.0 * 1.073741824 / 54.3).abs() < 1e-3); // 64 GiB at 54.3 GB/s
    /// # Ok(()) }
    /// ```
    pub fn simulate(mut self, sim: Simulation) -> Self {
        self.backend = BackendChoice::Simulate(sim);
        self
    }

    /// Fails with [`Error::NoGpu`] instead of falling back to the host backend.
    pub fn require_gpu(mut self) -> Self {
        self.backend = BackendChoice::RequireGpu;
        self
    }

    /// The CUDA device to use (default 0).
    pub fn device(mut self, ordinal: usize) -> Self {
        self.device = ordinal;
        self
    }

    /// Shares a CUDA context the caller already has (a trainer's own): the store's memory and
    /// streams are made in it. Implies the CUDA backend.
    pub fn context(mut self, ctx: Arc<cudarc::driver::CudaContext>) -> Self {
        self.context = Some(ctx);
        self
    }

    /// Uses one of the built-in policies (default: [`PolicyKind::Frequency`]).
    pub fn policy(mut self, kind: PolicyKind) -> Self {
        self.policy = Some(kind.build());
        self
    }

    /// Uses a policy of the caller's.
    pub fn custom_policy(mut self, policy: Box<dyn Policy>) -> Self {
        self.policy = Some(policy);
        self
    }

    /// Whether a read that misses the fastest tier may copy the tensor there when the policy
    /// admits it (default on).
    pub fn promote_on_read(mut self, on: bool) -> Self {
        self.promote_on_read = on;
        self
    }

    /// Pinned staging through which pageable data and disk reads reach the device: `buffers`
    /// buffers (at least 2) of `bytes` each (rounded up to 4 KiB), reserved at build. Default 4 x
    /// 16 MiB. More or larger buffers keep more copies in flight.
    pub fn staging(mut self, buffers: usize, bytes: usize) -> Self {
        self.staging = (buffers.max(2), bytes.clamp(1, 1 << 40).div_ceil(4096) * 4096);
        self
    }

    /// Bytes that prefetching may have in flight or resident-but-unused at once (default: half
    /// the Device budget). Prefetches past it wait until earlier ones are used or released, so
    /// prefetching never evicts what is about to be used.
    pub fn prefetch_budget(mut self, bytes: u64) -> Self {
        self.prefetch_budget = Some(bytes);
        self
    }

    /// Worker threads that bring tensors from the Disk tier to the device (default 4; each
    /// reserves two staging buffers of the [`staging`](StoreBuilder::staging) size).
    pub fn disk_workers(mut self, workers: usize) -> Self {
        self.disk_workers = workers.max(1);
        self
    }

    /// Builds the store: picks the backend, opens the disk tier, reserves the staging buffers.
    pub fn build(self) -> Result<Store> {
        if self.capacity.iter().all(|&c| c == 0) {
            return Err(Error::NoCapacity);
        }
        let (backend, note) = self.pick_backend()?;
        if backend.kind() == BackendKind::Cuda {
            check_host_lockable(
                self.capacity[Tier::Pinned.index()]
                    .saturating_add(self.capacity[Tier::Mapped.index()]),
            )?;
        }
        let mut arenas: [Option<MemArena>; 3] = Default::default();
        for t in [Tier::Device, Tier::Pinned, Tier::Mapped] {
            let cap = self.capacity[t.index()];
            if cap > 0 {
                arenas[t.index()] = Some(MemArena::new(&backend, t, cap)?);
            }
        }
        let disk_cap = self.capacity[Tier::Disk.index()];
        let disk = if disk_cap > 0 {
            Some(DiskTier::open(self.disk_dir.as_deref(), disk_cap)?)
        } else {
            None
        };
        let staging = if self.capacity[Tier::Device.index()] > 0 {
            Some(PinnedStaging::new(&backend, self.staging.0, self.staging.1)?)
        } else {
            None
        };
        // The engine's disk workers, with their own staging, exist when both ends do. A simulated
        // store has none: its operations run on the thread that issues them, on one host clock,
        // so disk-to-device copies go through the staging on the caller's thread.
        let (disk_reader, worker_staging) = match (&disk, &staging) {
            (Some(d), Some(_)) if backend.sim().is_none() => {
                let bufs = (0..self.disk_workers)
                    .map(|_| {
                        Ok(Mutex::new([
                            StagingBuf::new(&backend, self.staging.1)?,
                            StagingBuf::new(&backend, self.staging.1)?,
                        ]))
                    })
                    .collect::<Result<Vec<_>>>()?;
                (Some(d.reader()?), bufs)
            }
            _ => (None, Vec::new()),
        };
        let device_cap = self.capacity[Tier::Device.index()];
        let policy = self.policy.unwrap_or_else(|| PolicyKind::default().build());
        let state = State {
            arenas,
            disk,
            staging,
            entries: HashMap::new(),
            names: HashMap::new(),
            policy,
            next_id: 1,
            counters: Counters::default(),
            promote_on_read: self.promote_on_read,
            inflight: 0,
            prefetch_budget: self.prefetch_budget.unwrap_or(device_cap / 2),
            waiting: VecDeque::new(),
            timeline: Timeline::new(Clock::start(&backend)?),
            probes: Vec::new(),
            reuse_waits: Vec::new(),
            deferred_frees: Vec::new(),
            copy_start: None,
        };
        let shared = Arc::new(Shared {
            backend,
            state: Mutex::new(state),
            deferred: Mutex::new(Vec::new()),
            note,
            engine: OnceLock::new(),
            disk_reader,
            worker_staging,
        });
        if !shared.worker_staging.is_empty() {
            let engine = Engine::start(shared.worker_staging.len(), Arc::downgrade(&shared))?;
            let _ = shared.engine.set(engine);
        }
        Ok(Store { shared })
    }

    fn pick_backend(&self) -> Result<(Backend, Option<String>)> {
        if let (Some(_), BackendChoice::Simulate(_)) = (&self.context, &self.backend) {
            return Err(Error::InvalidArgument(
                "a CUDA context and a simulation: a simulated store runs on the host backend"
                    .into(),
            ));
        }
        if let Some(ctx) = &self.context {
            return Ok((Backend::Cuda(CudaBackend::from_context(ctx.clone())?), None));
        }
        match self.backend {
            BackendChoice::Host => Ok((Backend::Host(HostBackend::new()?), None)),
            BackendChoice::Simulate(sim) => {
                sim.check()?;
                Ok((Backend::Host(HostBackend::simulated(SimClock::new(sim))), None))
            }
            BackendChoice::RequireGpu => Ok((Backend::Cuda(CudaBackend::new(self.device)?), None)),
            BackendChoice::Auto => match cuda::device_count() {
                Ok(_) => Ok((Backend::Cuda(CudaBackend::new(self.device)?), None)),
                Err(why) => Ok((Backend::Host(HostBackend::new()?), Some(why))),
            },
        }
    }
}

/// Refuses pinned + mapped budgets the host cannot lock: better an error at build than the OOM
/// killer later.
fn check_host_lockable(bytes: u64) -> Result<()> {
    let Ok(meminfo) = std::fs::read_to_string("/proc/meminfo") else { return Ok(()) };
    let avail = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024);
    match avail {
        Some(a) if bytes > a => Err(Error::InvalidArgument(format!(
            "pinned + mapped budgets of {} exceed the {} of host memory available to lock",
            format_size(bytes),
            format_size(a)
        ))),
        _ => Ok(()),
    }
}

/// A tiered tensor store. `Send + Sync`: share it (`Arc<Store>` or `&Store`) between threads.
///
/// See the [crate docs](crate) for an example.
pub struct Store {
    pub(crate) shared: Arc<Shared>,
}

pub(crate) struct Shared {
    pub(crate) backend: Backend,
    pub(crate) state: Mutex<State>,
    /// Errors from `Drop` impls (views) and failed prefetches, returned by the next `check_err`.
    pub(crate) deferred: Mutex<Vec<Error>>,
    note: Option<String>,
    /// Disk-to-device workers (when both tiers are enabled).
    pub(crate) engine: OnceLock<Engine>,
    disk_reader: Option<DiskReader>,
    /// Two staging buffers per disk worker.
    worker_staging: Vec<Mutex<[StagingBuf; 2]>>,
}

/// Where one replica's bytes are.
pub(crate) enum Ext {
    Mem(Extent),
    Disk(DiskExtent),
    /// In place in a user's file (Disk tier, read-only): `len` bytes at `offset`.
    File {
        file: Arc<ExternalFile>,
        offset: u64,
        len: u64,
    },
}

pub(crate) struct Replica {
    pub(crate) ext: Ext,
    /// Complete once the replica's bytes are valid (the copy that filled it has run).
    pub(crate) ready: Option<RawEvent>,
    /// A disk worker is still filling the replica (its `ready` is set when the job ends).
    pub(crate) fill: Option<Arc<Fill>>,
}

impl Replica {
    fn new(ext: Ext, ready: Option<RawEvent>) -> Replica {
        Replica { ext, ready, fill: None }
    }
}

/// Who asked for a prefetch: what a layer scope or hint says outranks what a policy guesses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Source {
    /// The policy's lookahead.
    Policy,
    /// A hint: `prefetch`, `pin` or a layer scope.
    Hint,
}

/// How hard an allocation in the Device tier may push: which prefetched tensors it may evict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Level {
    /// A policy's guess: evicts nothing that was prefetched.
    Guess,
    /// A hint or an explicit operation: may evict what only the policy prefetched.
    Demand,
    /// A view that cannot wait: when nothing else makes room, it may also evict what a hint
    /// prefetched and no one has used yet (wasting that copy rather than failing).
    Urgent,
}

pub(crate) struct Entry {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    bytes: u64,
    pub(crate) replicas: [Option<Replica>; 4],
    /// Live views of the tensor.
    pub(crate) views: u32,
    /// The tier the live views are of (all in one tier: a dirty view drops the other copies,
    /// which must not be memory another live view points at).
    pub(crate) view_tier: Option<Tier>,
    /// A [`HostView`] has the tensor: the CPU may be writing it, so no other view, read or
    /// copy of it may start.
    pub(crate) host_lent: bool,
    /// `Store::discard`ed and not written since: evicting it need not write it back.
    pub(crate) discarded: bool,
    /// Its prefetch protection came from a `pin` (not a `prefetch` or scope hint): the last
    /// `unpin` ends it.
    pub(crate) pin_prefetch: bool,
    /// `pin` hints not yet undone by `unpin`.
    pub(crate) pins: u32,
    /// Live layer scopes that use the tensor.
    pub(crate) scopes: u32,
    /// Prefetched to the device and not yet used by a view (counts against the prefetch budget
    /// and is not evicted meanwhile).
    pub(crate) prefetched: Option<Source>,
    /// The prefetch started a copy, whose bytes count against the prefetch budget until the
    /// tensor is used (a prefetch of a tensor already resident only protects it).
    pub(crate) prefetch_charged: bool,
    /// Released by a hint or a scope's end: the first to go when room is needed.
    pub(crate) released: bool,
    /// Times the tensor was copied into the Device tier from another tier.
    pub(crate) device_loads: u64,
    /// What the tensor is for (memory accounting).
    pub(crate) group: Group,
    /// Events recorded on view streams when views were dropped: the last device work that may
    /// touch the tensor's memory.
    pub(crate) last_use: Vec<RawEvent>,
}

impl Entry {
    fn new(name: &str, dtype: DType, shape: &[usize], bytes: u64) -> Entry {
        Entry {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            bytes,
            replicas: Default::default(),
            views: 0,
            view_tier: None,
            host_lent: false,
            discarded: false,
            pins: 0,
            scopes: 0,
            prefetched: None,
            prefetch_charged: false,
            pin_prefetch: false,
            released: false,
            device_loads: 0,
            group: Group::Other,
            last_use: Vec::new(),
        }
    }

    /// Views, pins and scopes holding the tensor in place.
    pub(crate) fn held(&self) -> u32 {
        self.views + self.pins + self.scopes
    }

    /// A disk worker still filling one of the replicas.
    fn filling(&self) -> Option<Arc<Fill>> {
        self.replicas.iter().flatten().find_map(|r| r.fill.clone())
    }

    fn fastest(&self) -> Option<Tier> {
        Tier::ALL.into_iter().find(|t| self.replicas[t.index()].is_some())
    }

    /// The fastest replica whose bytes can be read now or by waiting on an event (not one a
    /// disk worker is still filling).
    fn fastest_readable(&self) -> Option<Tier> {
        Tier::ALL
            .into_iter()
            .find(|t| self.replicas[t.index()].as_ref().is_some_and(|r| r.fill.is_none()))
    }
}

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

pub(crate) struct State {
    arenas: [Option<MemArena>; 3],
    disk: Option<DiskTier>,
    staging: Option<PinnedStaging>,
    pub(crate) entries: HashMap<TensorId, Entry>,
    names: HashMap<String, TensorId>,
    policy: Box<dyn Policy>,
    next_id: u64,
    pub(crate) counters: Counters,
    promote_on_read: bool,
    /// Bytes whose copies prefetches started and that are not yet used or released.
    pub(crate) inflight: u64,
    pub(crate) prefetch_budget: u64,
    /// Hinted prefetches waiting for room in the prefetch budget, in order.
    waiting: VecDeque<TensorId>,
    /// Copies and waits, for stats and traces.
    pub(crate) timeline: Timeline,
    /// Work still touching retired device memory; the host-to-device stream waits for it before
    /// its next copy.
    reuse_waits: Vec<RawEvent>,
    /// Host-tier and disk extents dropped while work may still touch them, with that work's
    /// events: freed once those complete.
    deferred_frees: Vec<(Tier, Ext, Vec<RawEvent>)>,
    /// Stream waits whose length is known once both events complete: (mark on the consumer's
    /// stream, the copy's event).
    pub(crate) probes: Vec<(RawEvent, RawEvent)>,
    /// Set by `copy_into` for a copy on a copy stream, after the stream's waits: where its span
    /// starts.
    copy_start: Option<RawEvent>,
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

fn e_bytes(st: &State, id: TensorId) -> u64 {
    st.entries.get(&id).map_or(0, |e| e.bytes)
}

fn tensor_bytes(dtype: DType, shape: &[usize]) -> Result<u64> {
    shape.iter().try_fold(dtype.size_of() as u64, |acc, &d| acc.checked_mul(d as u64)).ok_or_else(
        || Error::BadShape { shape: shape.to_vec(), why: "element count overflows".into() },
    )
}

impl Store {
    /// A builder with default budgets.
    pub fn builder() -> StoreBuilder {
        StoreBuilder::default()
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

    /// The host's simulated time in seconds, on a [simulated](StoreBuilder::simulate) store.
    pub fn simulated_seconds(&self) -> Option<f64> {
        self.shared.backend.sim().map(|c| c.now())
    }

    /// The machine a [simulated](StoreBuilder::simulate) store simulates.
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
        self.put_inner(None, name, group, dtype, shape, data)
    }

    fn put_inner(
        &self,
        only: Option<Tier>,
        name: &str,
        group: Group,
        dtype: DType,
        shape: &[usize],
        data: &[u8],
    ) -> Result<TensorId> {
        if name.is_empty() {
            return Err(Error::InvalidArgument("tensor name is empty".into()));
        }
        let bytes = tensor_bytes(dtype, shape)?;
        if bytes != data.len() as u64 {
            return Err(Error::LengthMismatch {
                expected: bytes,
                got: data.len() as u64,
                what: format!("{dtype} tensor of shape {shape:?}"),
            });
        }
        let be = &self.shared.backend;
        let mut st = self.shared.state.lock();
        if st.names.contains_key(name) {
            return Err(Error::DuplicateName(name.to_string()));
        }
        let id = TensorId(st.next_id);
        st.next_id += 1;
        st.policy.on_insert(id, bytes);
        let placed = st.place_new_in(be, id, bytes, only).and_then(|(tier, mut ext)| {
            match st.fill_from_host(be, tier, &mut ext, data) {
                Ok(ready) => Ok((tier, ext, ready)),
                Err(e) => {
                    st.free_ext(tier, ext);
                    Err(e)
                }
            }
        });
        let (tier, ext, ready) = match placed {
            Ok(p) => p,
            Err(e) => {
                st.policy.on_remove(id);
                return Err(e);
            }
        };
        let mut entry = Entry::new(name, dtype, shape, bytes);
        entry.group = group;
        entry.replicas[tier.index()] = Some(Replica::new(ext, ready));
        st.entries.insert(id, entry);
        st.names.insert(name.to_string(), id);
        st.counters.bytes_in += bytes;
        Ok(id)
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
        self.put_inner(Some(tier), name, group, dtype, shape, data)
    }

    /// The tensor's bytes, from its fastest replica. Counts as an access; on a miss the policy
    /// may promote the tensor to the fastest tier.
    pub fn read(&self, id: TensorId) -> Result<Vec<u8>> {
        self.read_inner(id, true)
    }

    /// `read` that never promotes: for state the caller reads, updates and writes back where
    /// it was (an optimizer's moments on disk).
    pub(crate) fn read_in_place(&self, id: TensorId) -> Result<Vec<u8>> {
        self.read_inner(id, false)
    }

    fn read_inner(&self, id: TensorId, promote: bool) -> Result<Vec<u8>> {
        let be = &self.shared.backend;
        let mut st = self.shared.state.lock();
        let e = st.entry(id)?;
        if e.host_lent {
            return Err(Error::Busy { id, holders: e.held() });
        }
        let tier = e.fastest_readable().ok_or(Error::UnknownId(id))?;
        let hit = Some(e.fastest().unwrap_or(tier)) == st.fastest_enabled();
        let mut out = vec![0u8; e.bytes as usize];
        st.read_replica(be, id, tier, &mut out)?;
        st.policy.on_access(id);
        st.count_access(hit);
        st.counters.bytes_out += out.len() as u64;
        if !hit && promote && st.promote_on_read {
            st.maybe_promote(be, id, &out)?;
        }
        st.lookahead(be, self.shared.engine.get());
        Ok(out)
    }

    /// Replaces the tensor's bytes (`data` must be as long as the tensor). The write goes to the
    /// fastest replica; the others are dropped, as they no longer hold the tensor's contents.
    pub fn write(&self, id: TensorId, data: &[u8]) -> Result<()> {
        let be = &self.shared.backend;
        let mut st = self.shared.lock_idle(id)?;
        let e = st.entry(id)?;
        if e.bytes != data.len() as u64 {
            return Err(Error::LengthMismatch {
                expected: e.bytes,
                got: data.len() as u64,
                what: format!("write to {:?}", e.name),
            });
        }
        if e.held() > 0 {
            return Err(Error::Busy { id, holders: e.held() });
        }
        let tier = e.fastest().ok_or(Error::UnknownId(id))?;
        st.settle(id)?;
        st.entries.get_mut(&id).expect("checked above").discarded = false;
        if matches!(
            st.entries[&id].replicas[tier.index()].as_ref().map(|r| &r.ext),
            Some(Ext::File { .. })
        ) {
            // Only in the user's file, which the store never writes: the new bytes get a new
            // home, placed like a put, and the file's copy is dropped.
            let bytes = e_bytes(&st, id);
            let (t, mut ext) = st.place_new(be, id, bytes)?;
            let ready = match st.fill_from_host(be, t, &mut ext, data) {
                Ok(r) => r,
                Err(err) => {
                    st.free_ext(t, ext);
                    return Err(err);
                }
            };
            let file = st.take_replica(id, tier);
            st.free_ext(tier, file.ext);
            st.put_replica(id, t, Replica::new(ext, ready));
            st.drop_other_replicas(id, t)?;
            st.policy.on_access(id);
            st.counters.bytes_in += data.len() as u64;
            return Ok(());
        }
        let mut rep = st.take_replica(id, tier);
        let res = st.fill_from_host(be, tier, &mut rep.ext, data);
        match res {
            Ok(ready) => {
                rep.ready = ready;
                st.put_replica(id, tier, rep);
                st.drop_other_replicas(id, tier)?;
                st.policy.on_access(id);
                st.counters.bytes_in += data.len() as u64;
                Ok(())
            }
            Err(err) => {
                // The replica may hold half the new bytes: keep the others if there are any.
                if st.entries[&id].count() > 0 {
                    st.free_ext(tier, rep.ext);
                } else {
                    st.put_replica(id, tier, rep);
                }
                Err(err)
            }
        }
    }

    /// Removes the tensor and frees its memory. Its id stays invalid.
    pub fn remove(&self, id: TensorId) -> Result<()> {
        let mut st = self.shared.lock_idle(id)?;
        let e = st.entry(id)?;
        if e.held() > 0 {
            return Err(Error::Busy { id, holders: e.held() });
        }
        st.settle(id)?;
        for t in Tier::ALL {
            if st.entries[&id].replicas[t.index()].is_some() {
                let r = st.take_replica(id, t);
                st.free_ext(t, r.ext);
            }
        }
        let e = st.entries.remove(&id).expect("checked above");
        st.names.remove(&e.name);
        st.policy.on_remove(id);
        Ok(())
    }

    /// Bytes of the tensors of each [`Group`] (indexed by [`Group::index`]) with a copy in
    /// `tier`: `Stats::groups` for one tier, without the rest of a stats snapshot (cheap enough
    /// to sample after every layer).
    pub fn bytes_by_group(&self, tier: Tier) -> [u64; 5] {
        self.shared.state.lock().bytes_by_group(tier)
    }

    /// Declares the tensor's contents dead until it is next written (a gradient the optimizer
    /// has consumed, an activation the backward pass is done with): when the policy evicts its
    /// device copy, the copy is dropped without being written back to a memory tier, saving
    /// the device-to-host traffic. Reads before the next write return unspecified bytes.
    /// Work already issued on the device copy is unaffected.
    pub fn discard(&self, id: TensorId) -> Result<()> {
        let mut st = self.shared.state.lock();
        st.entries.get_mut(&id).ok_or(Error::UnknownId(id))?.discarded = true;
        Ok(())
    }

    /// Changes a tensor's [`Group`].
    pub fn set_group(&self, id: TensorId, group: Group) -> Result<()> {
        let mut st = self.shared.state.lock();
        st.entries.get_mut(&id).ok_or(Error::UnknownId(id))?.group = group;
        Ok(())
    }

    /// The id of the tensor named `name`.
    pub fn lookup(&self, name: &str) -> Option<TensorId> {
        self.shared.state.lock().names.get(name).copied()
    }

    /// The fastest tier holding a valid copy of the tensor (or one being filled by a prefetch).
    pub fn tier_of(&self, id: TensorId) -> Result<Tier> {
        let st = self.shared.state.lock();
        st.entry(id)?.fastest().ok_or(Error::UnknownId(id))
    }

    /// Name, dtype, shape, size and tiers of a tensor.
    pub fn info(&self, id: TensorId) -> Result<TensorInfo> {
        let st = self.shared.state.lock();
        let e = st.entry(id)?;
        Ok(TensorInfo {
            id,
            name: e.name.clone(),
            dtype: e.dtype,
            shape: e.shape.clone(),
            bytes: e.bytes,
            tiers: Tier::ALL.into_iter().filter(|t| e.replicas[t.index()].is_some()).collect(),
            device_loads: e.device_loads,
            group: e.group,
        })
    }

    /// Every tensor's id, in the order they were put.
    pub fn ids(&self) -> Vec<TensorId> {
        let st = self.shared.state.lock();
        let mut ids: Vec<TensorId> = st.entries.keys().copied().collect();
        ids.sort();
        ids
    }

    /// Moves the tensor to `tier` and returns when the copy is done: afterwards
    /// `tier_of(id) == tier` and no faster tier holds a copy. Room is made in `tier` by demoting
    /// other tensors if needed. A tensor held by a view, pin or layer scope can only be "moved"
    /// where it already is.
    pub fn move_to(&self, id: TensorId, tier: Tier) -> Result<()> {
        let be = &self.shared.backend;
        let mut st = self.shared.lock_idle(id)?;
        let e = st.entry(id)?;
        let (bytes, holders, fastest) = (e.bytes, e.held(), e.fastest());
        if !st.enabled(tier) {
            return Err(Error::TierDisabled { tier });
        }
        if holders > 0 && fastest != Some(tier) {
            return Err(Error::Busy { id, holders });
        }
        if !st.can_ever_fit(tier, bytes) {
            return Err(Error::TooLarge {
                bytes,
                what: format!("tier {tier} ({})", format_size(st.capacity(tier))),
            });
        }
        st.policy.on_access(id);
        if st.entries[&id].replicas[tier.index()].is_none() {
            let ext = st
                .alloc_evicting(be, tier, bytes, id, Level::Demand)?
                .ok_or(Error::OutOfMemory { tier, bytes })?;
            let src = st.entries[&id].fastest().ok_or(Error::UnknownId(id))?;
            st.copy_replica(be, id, src, tier, ext)?;
        }
        // Wait for the copy, so that "returns when done" holds and the dropped faster replicas
        // are no longer read.
        st.sync_replica(id, tier)?;
        for t in Tier::ALL.into_iter().filter(|&t| t < tier) {
            if t == Tier::Device && st.entries[&id].replicas[t.index()].is_some() {
                st.retire_device(id);
            } else if st.entries[&id].replicas[t.index()].is_some() {
                st.settle(id)?;
                let r = st.take_replica(id, t);
                st.free_ext(t, r.ext);
            }
        }
        // No waiting prefetches are started here: their evictions could cascade into `tier`
        // and undo this move before it returns.
        Ok(())
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> Stats {
        let mut st = self.shared.state.lock();
        // Extents waiting for finished work are free: count them so.
        let _ = st.reap(false);
        let mut tiers = [TierStats::default(); 4];
        for t in Tier::ALL {
            let s = &mut tiers[t.index()];
            if let Some(a) = st.arena(t) {
                *s = TierStats {
                    used: a.used(),
                    capacity: a.capacity(),
                    reserved: a.capacity(),
                    largest_free: a.largest_free(),
                    tensors: 0,
                    free_ranges: a.free_ranges(),
                };
            } else if let (Tier::Disk, Some(d)) = (t, &st.disk) {
                *s = TierStats {
                    used: d.used(),
                    capacity: d.capacity(),
                    reserved: d.capacity(),
                    largest_free: d.largest_free(),
                    tensors: 0,
                    free_ranges: d.free_ranges(),
                };
            }
            s.tensors = st.entries.values().filter(|e| e.replicas[t.index()].is_some()).count();
        }
        st.resolve_probes();
        st.timeline.resolve();
        let copy_s = st.timeline.copy_seconds();
        let mut groups = [[0u64; 4]; 5];
        for t in Tier::ALL {
            for (g, b) in st.bytes_by_group(t).into_iter().enumerate() {
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
            copy_seconds: copy_s,
            prefetch_in_flight: st.inflight,
            tiers,
            moved: c.moved,
            bytes_in: c.bytes_in,
            bytes_out: c.bytes_out,
            hits: c.hits,
            misses: c.misses,
            evictions: c.evictions,
            promotions: c.promotions,
            tensors: st.entries.len(),
            backend: self.backend(),
            policy: st.policy.name(),
            disk_direct_io: st.disk.as_ref().is_some_and(|d| d.direct_io()),
        }
    }

    /// Where the disk tier keeps the tensor's bytes: the slab file and the byte offset, if the
    /// tensor has a copy on disk. For diagnostics and tests.
    pub fn disk_location(&self, id: TensorId) -> Result<Option<(PathBuf, u64)>> {
        let st = self.shared.state.lock();
        let e = st.entry(id)?;
        Ok(match (&e.replicas[Tier::Disk.index()], &st.disk) {
            (Some(Replica { ext: Ext::Disk(d), .. }), Some(disk)) => {
                Some((disk.path().to_path_buf(), d.offset))
            }
            (Some(Replica { ext: Ext::File { file, offset, .. }, .. }), _) => {
                Some((file.path().to_path_buf(), *offset))
            }
            _ => None,
        })
    }

    /// Returns (and clears) the first error that happened where it could not be returned: in a
    /// view's `Drop`, or in a CUDA call made while freeing memory.
    pub fn check_err(&self) -> Result<()> {
        let mut d = self.shared.deferred.lock();
        if !d.is_empty() {
            return Err(d.remove(0));
        }
        if let Backend::Cuda(b) = &self.shared.backend {
            b.ctx.check_err().map_err(|e| Error::cuda("(deferred)", e))?;
        }
        Ok(())
    }

    /// Makes the tensor resident on the Device and returns a view of it for work on `stream`.
    ///
    /// If a copy is needed it is issued on the host-to-device copy stream and `stream` is made to
    /// wait for it: the calling thread does not block on the copy. While the view lives the tensor
    /// is neither evicted nor moved; dropping it records an event on `stream` that anything later
    /// reusing the memory waits for. Call [`DeviceView::mark_dirty`] after writing through it.
    pub fn device_view(&self, id: TensorId, stream: &Stream) -> Result<DeviceView> {
        self.device_view_inner(id, stream, false)
    }

    /// A device view for work that overwrites every byte of the tensor (an output: an
    /// activation, a gradient): like [`Store::device_view`], but a tensor not on the device gets
    /// its device memory without the copy in, and the view starts dirty, so the copies in other
    /// tiers are dropped when it drops. Reading the memory before writing it gives stale bytes.
    pub fn device_view_for_overwrite(&self, id: TensorId, stream: &Stream) -> Result<DeviceView> {
        self.device_view_inner(id, stream, true)
    }

    fn device_view_inner(
        &self,
        id: TensorId,
        stream: &Stream,
        overwrite: bool,
    ) -> Result<DeviceView> {
        self.check_stream(stream)?;
        let be = &self.shared.backend;
        let engine = self.shared.engine.get();
        // A prefetch from disk still running: wait for its job (moved to the front of the queue)
        // without holding the lock, then take the copy's event like any other.
        let mut st = loop {
            let st = self.shared.state.lock();
            let fill =
                st.entry(id)?.replicas[Tier::Device.index()].as_ref().and_then(|r| r.fill.clone());
            let Some(fill) = fill else { break st };
            drop(st);
            if let Some(engine) = engine {
                engine.expedite(id, &fill);
            }
            let t = Instant::now();
            fill.wait();
            self.shared.state.lock().counters.stall_s += t.elapsed().as_secs_f64();
        };
        let e = st.entry(id)?;
        let bytes = e.bytes;
        if e.host_lent || (e.views > 0 && e.view_tier != Some(Tier::Device)) {
            return Err(Error::Busy { id, holders: e.held() });
        }
        if !st.enabled(Tier::Device) {
            return Err(Error::TierDisabled { tier: Tier::Device });
        }
        if !st.can_ever_fit(Tier::Device, bytes) {
            return Err(Error::TooLarge {
                bytes,
                what: format!("the Device tier ({})", format_size(st.capacity(Tier::Device))),
            });
        }
        st.policy.on_access(id);
        let hit = st.entries[&id].replicas[Tier::Device.index()].is_some();
        st.count_access(hit);
        if hit {
            st.counters.prefetch_hits += 1;
        } else {
            st.counters.prefetch_misses += 1;
            // Unused hinted prefetches go only if nothing else makes room (more prefetched
            // ahead than the device holds beside the view's tensor, pins and other views).
            let ext = match st.alloc_evicting(be, Tier::Device, bytes, id, Level::Demand)? {
                Some(ext) => Some(ext),
                None => st.alloc_evicting(be, Tier::Device, bytes, id, Level::Urgent)?,
            }
            .ok_or(Error::OutOfMemory { tier: Tier::Device, bytes })?;
            if overwrite {
                // No copy in; the view's work must still wait for work touching the memory's
                // previous owner, which the host-to-device stream is ordered after.
                st.h2d_ready(be)?;
                stream.raw.wait(&be.h2d().record()?)?;
                st.put_replica(id, Tier::Device, Replica::new(ext, None));
            } else {
                let src = st.entries[&id].fastest().ok_or(Error::UnknownId(id))?;
                st.copy_replica(be, id, src, Tier::Device, ext)?;
            }
        }
        st.consume_prefetch(id);
        let rep =
            st.entries[&id].replicas[Tier::Device.index()].as_ref().expect("made resident above");
        let ready = rep.ready.clone();
        let Ext::Mem(ext) = &rep.ext else { unreachable!("device replicas are memory extents") };
        let ptr = st.arena(Tier::Device).expect("enabled").dev_ptr(ext);
        if let Some(ev) = ready.filter(|ev| !ev.is_complete()) {
            // The stream waits for the copy; how long is known once both events complete.
            let mark = stream.raw.record()?;
            stream.raw.wait(&ev)?;
            st.probes.push((mark, ev));
            if st.probes.len() > 4096 {
                st.resolve_probes();
            }
        }
        // Copies still reading this replica (a write-back started by `release`) finish before
        // the view's work may write it.
        st.wait_for_readers(id, Tier::Device, &stream.raw)?;
        let e = st.entries.get_mut(&id).expect("checked above");
        e.views += 1;
        e.view_tier = Some(Tier::Device);
        e.released = false;
        let (dtype, shape) = (e.dtype, e.shape.clone());
        st.pump_waiting(be, engine);
        st.lookahead(be, engine);
        drop(st);
        let mut view = DeviceView::new(
            self.shared.clone(),
            id,
            Tier::Device,
            stream.raw.clone(),
            ptr,
            bytes,
            dtype,
            shape,
        );
        if overwrite {
            view.mark_dirty();
        }
        Ok(view)
    }

    /// A view of the tensor's Mapped replica for zero-copy kernel access: its device pointer
    /// reads host memory in place over PCIe. Fails with [`Error::NotInTier`] if the tensor has no
    /// copy in Mapped (`move_to(id, Tier::Mapped)` first). `stream` waits for any copy still
    /// filling the replica.
    pub fn mapped_view(&self, id: TensorId, stream: &Stream) -> Result<MappedView> {
        self.check_stream(stream)?;
        let mut st = self.shared.state.lock();
        let e = st.entry(id)?;
        let (bytes, dtype, shape) = (e.bytes, e.dtype, e.shape.clone());
        if e.host_lent || (e.views > 0 && e.view_tier != Some(Tier::Mapped)) {
            return Err(Error::Busy { id, holders: e.held() });
        }
        let Some(rep) = e.replicas[Tier::Mapped.index()].as_ref() else {
            return Err(Error::NotInTier { id, tier: Tier::Mapped });
        };
        if let Some(ev) = &rep.ready {
            stream.raw.wait(ev)?;
        }
        let Ext::Mem(ext) = &rep.ext else { unreachable!("mapped replicas are memory extents") };
        let ptr = st.arena(Tier::Mapped).expect("replica exists").dev_ptr(ext);
        st.policy.on_access(id);
        st.wait_for_readers(id, Tier::Mapped, &stream.raw)?;
        let e = st.entries.get_mut(&id).expect("checked above");
        e.views += 1;
        e.view_tier = Some(Tier::Mapped);
        drop(st);
        Ok(MappedView::new(DeviceView::new(
            self.shared.clone(),
            id,
            Tier::Mapped,
            stream.raw.clone(),
            ptr,
            bytes,
            dtype,
            shape,
        )))
    }

    /// Exclusive CPU access, in place, to the tensor's copy in host memory: its Pinned or
    /// Mapped replica (on the host backend, its fastest memory replica), without the store's
    /// lock. Waits for copies and device work still touching the tensor. Fails with
    /// [`Error::Busy`] if the tensor has another view, a pin or a scope, and with
    /// [`Error::NotInTier`] if no such copy exists (`move_to(id, Tier::Pinned)` first).
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
        let mut st = self.shared.lock_idle(id)?;
        let host_backend = self.backend() == BackendKind::Host;
        let e = st.entry(id)?;
        if e.held() > 0 {
            return Err(Error::Busy { id, holders: e.held() });
        }
        let dtype = e.dtype;
        let candidates: &[Tier] = if host_backend {
            &[Tier::Pinned, Tier::Mapped, Tier::Device]
        } else {
            &[Tier::Pinned, Tier::Mapped]
        };
        let tier = candidates
            .iter()
            .copied()
            .find(|t| matches!(e.replicas[t.index()].as_ref().map(|r| &r.ext), Some(Ext::Mem(_))))
            .ok_or(Error::NotInTier { id, tier: Tier::Pinned })?;
        // Copies into or out of the tensor's replicas and device work through earlier views
        // finish before the CPU touches the bytes.
        st.settle(id)?;
        let rep = st.entries[&id].replicas[tier.index()].as_ref().expect("found above");
        let Ext::Mem(ext) = &rep.ext else { unreachable!("checked above") };
        let region =
            st.arena(tier).and_then(|a| a.host_region(ext, host_backend)).ok_or_else(|| {
                Error::BackendMismatch(format!("the {tier} tier is not host memory here"))
            })?;
        let e = st.entries.get_mut(&id).expect("checked above");
        e.views += 1;
        e.view_tier = Some(tier);
        e.host_lent = true;
        st.policy.on_access(id);
        drop(st);
        Ok(HostView::new(self.shared.clone(), id, tier, region, dtype))
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
        // The disk workers first: a running job finishes, queued ones are cancelled.
        if let Some(engine) = self.shared.engine.get() {
            engine.stop();
        }
        // Views hold the shared state alive; when the last goes, memory is freed after the
        // copies in flight. Waiting here keeps a plain `drop(store)` from freeing memory a copy
        // still uses.
        let mut st = self.shared.state.lock();
        for e in st.entries.values() {
            for ev in
                e.replicas.iter().flatten().filter_map(|r| r.ready.as_ref()).chain(&e.last_use)
            {
                let _ = ev.synchronize();
            }
        }
        let _ = st.reap(true);
    }
}

impl Shared {
    /// Locks the state once no disk worker is filling a replica of `id` (waiting for such a job
    /// without holding the lock). Errors for an unknown id.
    pub(crate) fn lock_idle(&self, id: TensorId) -> Result<MutexGuard<'_, State>> {
        loop {
            let st = self.state.lock();
            let Some(fill) = st.entry(id)?.filling() else { return Ok(st) };
            drop(st);
            if let Some(engine) = self.engine.get() {
                engine.expedite(id, &fill);
            }
            fill.wait();
        }
    }

    /// Called by a view's Drop: records where the view's stream is, releases the hold, and if
    /// the view wrote, keeps only the replica it wrote.
    pub(crate) fn release_view(&self, id: TensorId, tier: Tier, stream: &RawStream, dirty: bool) {
        let ev = stream.record();
        self.unhold(id, tier, dirty, Some(ev));
    }

    /// Called by a host view's Drop: as `release_view`, with no device work to record.
    pub(crate) fn release_host_view(&self, id: TensorId, tier: Tier, dirty: bool) {
        self.unhold(id, tier, dirty, None);
    }

    /// Releases a view's hold; `ev: None` for a host view, whose lending ends under the same
    /// lock as its dirty copies are dropped.
    fn unhold(&self, id: TensorId, tier: Tier, dirty: bool, ev: Option<Result<RawEvent>>) {
        let mut st = self.state.lock();
        let res = (|| -> Result<()> {
            let e = st.entries.get_mut(&id).ok_or(Error::UnknownId(id))?;
            if ev.is_none() {
                e.host_lent = false;
            }
            e.views = e.views.saturating_sub(1);
            if e.views == 0 {
                e.view_tier = None;
            }
            if let Some(ev) = ev {
                e.last_use.retain(|ev| !ev.is_complete());
                e.last_use.push(ev?);
            }
            if dirty {
                st.entries.get_mut(&id).expect("checked above").discarded = false;
                st.drop_other_replicas(id, tier)?;
            }
            // Waiting prefetches start at the next hint or view, not here: a Drop that could
            // evict (and wait on other tensors' work) is a Drop that could deadlock when it runs
            // on a host stream's own thread.
            Ok(())
        })();
        drop(st);
        if let Err(e) = res {
            self.deferred.lock().push(e);
        }
    }

    /// Runs `f` over the host bytes of a view's replica (host backend: every tier is host
    /// memory; CUDA: the Mapped tier).
    pub(crate) fn with_view_bytes<R>(
        &self,
        id: TensorId,
        tier: Tier,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R> {
        let mut st = self.state.lock();
        let host_backend = self.backend.kind() == BackendKind::Host;
        let State { arenas, entries, .. } = &mut *st;
        let rep = entries.get_mut(&id).ok_or(Error::UnknownId(id))?.replicas[tier.index()]
            .as_mut()
            .ok_or(Error::NotInTier { id, tier })?;
        let Ext::Mem(ext) = &mut rep.ext else { return Err(Error::NotInTier { id, tier }) };
        let arena = arenas[tier.index()].as_ref().ok_or(Error::TierDisabled { tier })?;
        let bytes = arena.view_bytes(ext, host_backend).ok_or_else(|| {
            Error::BackendMismatch(format!("the {tier} tier is not host memory on this backend"))
        })?;
        Ok(f(bytes))
    }
}

impl State {
    fn bytes_by_group(&self, tier: Tier) -> [u64; 5] {
        let mut out = [0u64; 5];
        for e in self.entries.values().filter(|e| e.replicas[tier.index()].is_some()) {
            out[e.group.index()] += e.bytes;
        }
        out
    }

    fn entry(&self, id: TensorId) -> Result<&Entry> {
        self.entries.get(&id).ok_or(Error::UnknownId(id))
    }

    fn arena(&self, t: Tier) -> Option<&MemArena> {
        self.arenas.get(t.index()).and_then(Option::as_ref)
    }

    fn enabled(&self, t: Tier) -> bool {
        match t {
            Tier::Disk => self.disk.is_some(),
            _ => self.arena(t).is_some(),
        }
    }

    fn capacity(&self, t: Tier) -> u64 {
        match t {
            Tier::Disk => self.disk.as_ref().map_or(0, |d| d.capacity()),
            _ => self.arena(t).map_or(0, |a| a.capacity()),
        }
    }

    fn can_ever_fit(&self, t: Tier, bytes: u64) -> bool {
        match t {
            Tier::Disk => self
                .disk
                .as_ref()
                .is_some_and(|d| bytes.max(1).div_ceil(4096) * 4096 <= d.capacity()),
            _ => self.arena(t).is_some_and(|a| a.can_ever_fit(bytes)),
        }
    }

    fn fastest_enabled(&self) -> Option<Tier> {
        Tier::ALL.into_iter().find(|&t| self.enabled(t))
    }

    fn count_access(&mut self, hit: bool) {
        if hit {
            self.counters.hits += 1;
        } else {
            self.counters.misses += 1;
        }
    }

    fn take_replica(&mut self, id: TensorId, t: Tier) -> Replica {
        if t == Tier::Device {
            // Off the device: no longer prefetched nor a release candidate.
            self.consume_prefetch(id);
            if let Some(e) = self.entries.get_mut(&id) {
                e.released = false;
            }
        }
        self.entries
            .get_mut(&id)
            .and_then(|e| e.replicas[t.index()].take())
            .expect("replica present")
    }

    /// Whether `e`'s replica in `t` may be demoted or dropped now by an allocation of `level`.
    fn evictable(e: &Entry, t: Tier, level: Level) -> bool {
        // Views of a slower replica (the CPU or a zero-copy kernel using it) leave the device
        // copy free to go: it is clean, since the viewed replica exists.
        let lent_elsewhere = t == Tier::Device
            && e.pins == 0
            && e.scopes == 0
            && e.view_tier.is_some_and(|vt| vt != Tier::Device);
        (e.held() == 0 || lent_elsewhere)
            && e.filling().is_none()
            && e.replicas[t.index()].is_some()
            && match (t, e.prefetched) {
                (Tier::Device, Some(Source::Hint)) => level == Level::Urgent,
                (Tier::Device, Some(Source::Policy)) => level != Level::Guess,
                _ => true,
            }
    }

    /// The tensor was used by a view (or left the device): it no longer counts as prefetched.
    fn consume_prefetch(&mut self, id: TensorId) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.pin_prefetch = false;
            if e.prefetched.take().is_some() && std::mem::take(&mut e.prefetch_charged) {
                self.inflight = self.inflight.saturating_sub(e.bytes);
            }
        }
    }

    fn put_replica(&mut self, id: TensorId, t: Tier, r: Replica) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.replicas[t.index()] = Some(r);
        }
    }

    /// Waits (on the host) for every copy and view still touching the tensor's memory.
    fn settle(&mut self, id: TensorId) -> Result<()> {
        let e = self.entries.get_mut(&id).ok_or(Error::UnknownId(id))?;
        for ev in e.last_use.drain(..) {
            ev.synchronize()?;
        }
        for r in e.replicas.iter_mut().flatten() {
            if let Some(ev) = r.ready.take() {
                ev.synchronize()?;
            }
        }
        Ok(())
    }

    fn sync_replica(&mut self, id: TensorId, t: Tier) -> Result<()> {
        if let Some(r) = self.entries.get_mut(&id).and_then(|e| e.replicas[t.index()].as_mut()) {
            if let Some(ev) = r.ready.take() {
                ev.synchronize()?;
            }
        }
        Ok(())
    }

    /// Drops every replica but `keep`'s, without blocking the host: memory still touched by
    /// copies or view work is freed once that work is done (device memory by stream order,
    /// host and disk extents when their events complete).
    fn drop_other_replicas(&mut self, id: TensorId, keep: Tier) -> Result<()> {
        for t in Tier::ALL.into_iter().filter(|&t| t != keep) {
            if self.entries[&id].replicas[t.index()].is_none() {
                continue;
            }
            if t == Tier::Device {
                self.retire_device(id);
                continue;
            }
            let pending = self.pending_events(id);
            let r = self.take_replica(id, t);
            if pending.is_empty() {
                self.free_ext(t, r.ext);
            } else {
                self.deferred_frees.push((t, r.ext, pending));
            }
        }
        Ok(())
    }

    /// Incomplete events of work that may still touch `id`'s memory: views' last work and
    /// copies into or out of its replicas.
    fn pending_events(&self, id: TensorId) -> Vec<RawEvent> {
        let Some(e) = self.entries.get(&id) else { return Vec::new() };
        e.last_use
            .iter()
            .chain(e.replicas.iter().flatten().filter_map(|r| r.ready.as_ref()))
            .filter(|ev| !ev.is_complete())
            .cloned()
            .collect()
    }

    /// Frees the deferred extents whose work has completed; with `block`, waits for all.
    fn reap(&mut self, block: bool) -> Result<()> {
        let mut i = 0;
        while i < self.deferred_frees.len() {
            let done = self.deferred_frees[i].2.iter().all(RawEvent::is_complete);
            if done || block {
                let (t, ext, evs) = self.deferred_frees.swap_remove(i);
                for ev in &evs {
                    ev.synchronize()?;
                }
                self.free_ext(t, ext);
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    /// Makes `stream` wait for copies still reading `id`'s replica in `tier` (their events are
    /// the `ready` events of the other replicas they fill).
    fn wait_for_readers(&self, id: TensorId, tier: Tier, stream: &RawStream) -> Result<()> {
        let Some(e) = self.entries.get(&id) else { return Ok(()) };
        for (t, r) in Tier::ALL.iter().zip(&e.replicas) {
            if *t == tier {
                continue;
            }
            if let Some(ev) =
                r.as_ref().and_then(|r| r.ready.as_ref()).filter(|ev| !ev.is_complete())
            {
                stream.wait(ev)?;
            }
        }
        Ok(())
    }

    /// Allocates in `t` without evicting. The caller has checked the tier is enabled.
    fn try_alloc(&mut self, t: Tier, bytes: u64) -> Result<Option<Ext>> {
        if !self.deferred_frees.is_empty() {
            self.reap(false)?;
        }
        Ok(match t {
            Tier::Disk => self.disk.as_mut().and_then(|d| d.alloc(bytes)).map(Ext::Disk),
            _ => match self.arenas[t.index()].as_mut() {
                Some(a) => a.alloc(bytes).map(Ext::Mem),
                None => None,
            },
        })
    }

    /// Returns an extent to its tier. The caller has settled the tensor's pending work.
    fn free_ext(&mut self, t: Tier, ext: Ext) {
        match ext {
            Ext::Mem(e) => {
                if let Some(a) = self.arenas[t.index()].as_mut() {
                    a.free(e);
                }
            }
            Ext::Disk(d) => {
                if let Some(disk) = self.disk.as_mut() {
                    disk.free(d);
                }
            }
            // The user's file is not ours to free; dropping the handle is all.
            Ext::File { .. } => {}
        }
    }

    /// Bytes that dropping or demoting tensors could free in `t` (for a quick "can this ever
    /// succeed" check before evicting anything).
    fn evictable_bytes(&self, t: Tier, exclude: TensorId, level: Level) -> u64 {
        self.entries
            .iter()
            .filter(|(&id, e)| id != exclude && Self::evictable(e, t, level))
            .map(|(_, e)| e.bytes)
            .sum()
    }

    fn free_bytes(&self, t: Tier) -> u64 {
        match t {
            Tier::Disk => self.disk.as_ref().map_or(0, |d| d.capacity() - d.used()),
            _ => self.arena(t).map_or(0, |a| a.free_bytes()),
        }
    }

    /// Victims of `t` for an allocation of `level`: released tensors first, then the policy's
    /// order, tensors only the policy prefetched last.
    fn victims(&mut self, t: Tier, exclude: TensorId, level: Level) -> Vec<TensorId> {
        let mut c: Vec<TensorId> = self
            .entries
            .iter()
            .filter(|(&id, e)| id != exclude && Self::evictable(e, t, level))
            .map(|(&id, _)| id)
            .collect();
        c.sort();
        self.policy.order_victims(t, &mut c);
        // Released tensors go first; then, on the device, training state touched once per step
        // (gradients, optimizer state) before what is used every pass; prefetched ones last.
        let rank = |id: &TensorId| {
            let e = &self.entries[id];
            let once = t == Tier::Device && matches!(e.group, Group::Grad | Group::OptimizerState);
            match (e.released, e.prefetched, once) {
                (true, _, _) => 0,
                (false, None, true) => 1,
                (false, None, false) => 2,
                (false, Some(_), _) => 3,
            }
        };
        c.sort_by_key(rank); // stable: keeps the policy's order within each rank
        c
    }

    /// Allocates `bytes` in `t`, demoting tensors (never `exclude`) to make room. `Ok(None)` when
    /// even that cannot make room.
    fn alloc_evicting(
        &mut self,
        be: &Backend,
        t: Tier,
        bytes: u64,
        exclude: TensorId,
        level: Level,
    ) -> Result<Option<Ext>> {
        if let Some(e) = self.try_alloc(t, bytes)? {
            return Ok(Some(e));
        }
        if self.free_bytes(t) + self.evictable_bytes(t, exclude, level) < bytes {
            return Ok(None);
        }
        for victim in self.victims(t, exclude, level) {
            if self.demote(be, victim, t)? {
                self.counters.evictions += 1;
                if let Some(e) = self.try_alloc(t, bytes)? {
                    return Ok(Some(e));
                }
            }
        }
        // Last resort: memory waiting for in-flight work to finish.
        if !self.deferred_frees.is_empty() {
            self.reap(true)?;
            return self.try_alloc(t, bytes);
        }
        Ok(None)
    }

    /// Removes `id`'s replica from `from`, first copying it to a slower tier if it is the
    /// tensor's only replica there or below. `Ok(false)` if there is nowhere to put it.
    fn demote(&mut self, be: &Backend, id: TensorId, from: Tier) -> Result<bool> {
        let e = &self.entries[&id];
        let bytes = e.bytes;
        let has_slower = Tier::ALL.into_iter().any(|t| t > from && e.replicas[t.index()].is_some());
        if !has_slower {
            let mut placed = None;
            let mut next = from.slower();
            while let Some(t) = next {
                if self.enabled(t) && self.can_ever_fit(t, bytes) {
                    if let Some(ext) = self.alloc_evicting(be, t, bytes, id, Level::Demand)? {
                        placed = Some((t, ext));
                        break;
                    }
                }
                next = t.slower();
            }
            let Some((to, ext)) = placed else { return Ok(false) };
            if self.entries[&id].discarded && to != Tier::Disk {
                // Contents declared dead (`Store::discard`): a home without the write-back. (Disk
                // extents carry a checksum of their bytes, so those are still written.)
                self.put_replica(id, to, Replica::new(ext, None));
            } else {
                self.copy_replica(be, id, from, to, ext)?;
            }
            if from != Tier::Device {
                self.sync_replica(id, to)?;
            }
        }
        if from == Tier::Device {
            // No host wait: the write-back (if any) and the views' last kernels are handed to
            // the host-to-device stream, which waits for them before reusing the memory.
            self.retire_device(id);
        } else {
            self.settle(id)?;
            let r = self.take_replica(id, from);
            self.free_ext(from, r.ext);
        }
        Ok(true)
    }

    /// Drops `id`'s Device replica without blocking the host. Device memory is only ever
    /// written by copies on the host-to-device stream (and by kernels through views of replicas
    /// those copies filled), so it is enough that this stream waits, before its next copy, for
    /// what still touches the memory: the views' last work and copies reading the replica.
    fn retire_device(&mut self, id: TensorId) {
        // A prefetched copy going away no longer counts against the prefetch budget.
        self.consume_prefetch(id);
        let Some(e) = self.entries.get(&id) else { return };
        let mut waits: Vec<RawEvent> =
            e.last_use.iter().filter(|ev| !ev.is_complete()).cloned().collect();
        for r in e.replicas.iter().flatten() {
            if let Some(ev) = r.ready.as_ref().filter(|ev| !ev.is_complete()) {
                waits.push(ev.clone());
            }
        }
        self.reuse_waits.extend(waits);
        if e.replicas[Tier::Device.index()].is_some() {
            let r = self.take_replica(id, Tier::Device);
            self.free_ext(Tier::Device, r.ext);
        }
    }

    /// Makes the host-to-device stream wait for the work still touching device memory that was
    /// retired; called before every copy into the Device tier.
    pub(crate) fn h2d_ready(&mut self, be: &Backend) -> Result<()> {
        for ev in self.reuse_waits.drain(..) {
            if !ev.is_complete() {
                be.h2d().wait(&ev)?;
            }
        }
        Ok(())
    }

    /// Finds a home for a new tensor: the fastest tier with free room; else the fastest tier the
    /// policy admits it to, making room there by demoting.
    fn place_new(&mut self, be: &Backend, id: TensorId, bytes: u64) -> Result<(Tier, Ext)> {
        self.place_new_in(be, id, bytes, None)
    }

    /// `place_new`, restricted to one tier when `only` names one.
    fn place_new_in(
        &mut self,
        be: &Backend,
        id: TensorId,
        bytes: u64,
        only: Option<Tier>,
    ) -> Result<(Tier, Ext)> {
        if let Some(t) = only {
            if !self.enabled(t) {
                return Err(Error::TierDisabled { tier: t });
            }
        }
        let fits: Vec<Tier> = Tier::ALL
            .into_iter()
            .filter(|&t| only.is_none_or(|o| o == t))
            .filter(|&t| self.enabled(t) && self.can_ever_fit(t, bytes))
            .collect();
        if fits.is_empty() {
            let caps = Tier::ALL
                .into_iter()
                .filter(|&t| self.enabled(t))
                .map(|t| format!("{t} {}", format_size(self.capacity(t))))
                .collect::<Vec<_>>()
                .join(", ");
            return Err(Error::TooLarge { bytes, what: format!("every enabled tier ({caps})") });
        }
        for &t in &fits {
            if let Some(ext) = self.try_alloc(t, bytes)? {
                return Ok((t, ext));
            }
        }
        for &t in &fits {
            let victims = self.victims(t, id, Level::Demand);
            if !self.policy.admit(t, id, &victims_covering(&victims, bytes, self)) {
                continue;
            }
            if let Some(ext) = self.alloc_evicting(be, t, bytes, id, Level::Demand)? {
                return Ok((t, ext));
            }
        }
        Err(Error::OutOfMemory { tier: *fits.last().expect("not empty"), bytes })
    }

    /// After a read missed the fastest tier: copies the tensor there if the policy admits it.
    fn maybe_promote(&mut self, be: &Backend, id: TensorId, data: &[u8]) -> Result<()> {
        let Some(top) = self.fastest_enabled() else { return Ok(()) };
        let bytes = data.len() as u64;
        if !self.can_ever_fit(top, bytes) || self.entries[&id].replicas[top.index()].is_some() {
            return Ok(());
        }
        let ext = match self.try_alloc(top, bytes)? {
            Some(ext) => ext,
            None => {
                let victims = self.victims(top, id, Level::Demand);
                let chosen = victims_covering(&victims, bytes, self);
                if !self.policy.admit(top, id, &chosen) {
                    return Ok(());
                }
                match self.alloc_evicting(be, top, bytes, id, Level::Demand)? {
                    Some(ext) => ext,
                    None => return Ok(()),
                }
            }
        };
        let mut ext = ext;
        let from = self.entries[&id].fastest().expect("tensor has a replica");
        match self.fill_from_host(be, top, &mut ext, data) {
            Ok(ready) => {
                self.put_replica(id, top, Replica::new(ext, ready));
                if top == Tier::Device {
                    if let Some(e) = self.entries.get_mut(&id) {
                        e.device_loads += 1;
                    }
                }
                self.counters.moved[from.index()][top.index()] += bytes;
                self.counters.promotions += 1;
                Ok(())
            }
            Err(e) => {
                self.free_ext(top, ext);
                Err(e)
            }
        }
    }

    /// Writes host bytes into a replica's extent in tier `t`. Returns the event after which they
    /// are in place (`None` when done already).
    fn fill_from_host(
        &mut self,
        be: &Backend,
        t: Tier,
        ext: &mut Ext,
        data: &[u8],
    ) -> Result<Option<RawEvent>> {
        match ext {
            Ext::Disk(d) => {
                self.disk.as_mut().ok_or(Error::TierDisabled { tier: t })?.write(d, data)?;
                Ok(None)
            }
            Ext::File { file, .. } => Err(Error::InvalidArgument(format!(
                "{} is read-only to the store",
                file.path().display()
            ))),
            Ext::Mem(m) => {
                if t == Tier::Device {
                    self.h2d_ready(be)?;
                }
                let arena =
                    self.arenas[t.index()].as_ref().ok_or(Error::TierDisabled { tier: t })?;
                if let Some(dst) = arena.host_slice_mut(m) {
                    copier().copy(dst, data);
                    return Ok(None);
                }
                // Device memory: through pinned staging, piece by piece, so the CPU copy of
                // piece k+1 overlaps the DMA of piece k.
                let staging =
                    self.staging.as_mut().ok_or(Error::TierDisabled { tier: Tier::Device })?;
                staging.upload(be.h2d(), arena, m, |off, buf| {
                    copier().copy(buf, &data[off..off + buf.len()]);
                    Ok(())
                })
            }
        }
    }

    /// Copies replica `tier` of `id` into `out` (exactly the tensor's length).
    fn read_replica(
        &mut self,
        be: &Backend,
        id: TensorId,
        tier: Tier,
        out: &mut [u8],
    ) -> Result<()> {
        self.sync_replica(id, tier)?;
        let State { arenas, disk, staging, entries, .. } = self;
        let e = entries.get_mut(&id).ok_or(Error::UnknownId(id))?;
        let rep = e.replicas[tier.index()].as_ref().ok_or(Error::NotInTier { id, tier })?;
        match &rep.ext {
            Ext::Disk(d) => {
                let disk = disk.as_mut().ok_or(Error::TierDisabled { tier })?;
                if let Err(found) = disk.read(d, out)? {
                    return Err(Error::Corrupt {
                        id,
                        name: e.name.clone(),
                        path: disk.path().to_path_buf(),
                        expected: DiskTier::expected_crc(d),
                        found,
                    });
                }
                Ok(())
            }
            Ext::File { file, offset, .. } => file.read_at(*offset, out),
            Ext::Mem(m) => {
                let arena = arenas[tier.index()].as_ref().ok_or(Error::TierDisabled { tier })?;
                if let Some(src) = arena.host_slice(m) {
                    copier().copy(out, src);
                    return Ok(());
                }
                let staging = staging.as_mut().ok_or(Error::TierDisabled { tier })?;
                let d2h = be.d2h();
                for ev in &e.last_use {
                    d2h.wait(ev)?;
                }
                staging.download(d2h, arena, m, |off, piece| {
                    copier().copy(&mut out[off..off + piece.len()], piece);
                    Ok(())
                })
            }
        }
    }

    /// Copies replica `from` of `id` into a new replica at `to` held in `dst`, and records it.
    /// GPU copies are issued, not awaited: the new replica's `ready` event says when it is
    /// valid.
    fn copy_replica(
        &mut self,
        be: &Backend,
        id: TensorId,
        from: Tier,
        to: Tier,
        mut dst: Ext,
    ) -> Result<()> {
        // Time the copy on the stream that carries it (`copy_into` records where it starts,
        // after the stream's waits), or on the host clock.
        let track = match (from, to) {
            (_, Tier::Device) => Track::H2d,
            (Tier::Device, _) => Track::D2h,
            _ => Track::Host,
        };
        let host_start = Instant::now();
        self.copy_start = None;
        let res = self.copy_into(be, id, from, to, &mut dst);
        let start = self.copy_start.take().map_or(TimePoint::Host(host_start), TimePoint::Ev);
        match res {
            Ok(ready) => {
                let (bytes, name) = (self.entries[&id].bytes, self.entries[&id].name.clone());
                let end = match &ready {
                    Some(ev) => TimePoint::Ev(ev.clone()),
                    None => TimePoint::Host(Instant::now()),
                };
                let what = match track {
                    Track::H2d => "h2d",
                    Track::D2h => "d2h",
                    _ => "host copy",
                };
                self.timeline.push(Span { track, what, tensor: name, bytes, start, end });
                self.put_replica(id, to, Replica::new(dst, ready));
                self.counters.moved[from.index()][to.index()] += bytes;
                if to == Tier::Device {
                    if let Some(e) = self.entries.get_mut(&id) {
                        e.device_loads += 1;
                    }
                }
                Ok(())
            }
            Err(e) => {
                self.free_ext(to, dst);
                Err(e)
            }
        }
    }

    fn copy_into(
        &mut self,
        be: &Backend,
        id: TensorId,
        from: Tier,
        to: Tier,
        dst: &mut Ext,
    ) -> Result<Option<RawEvent>> {
        // CPU paths read the source on the host: its bytes must be in place first.
        if from != Tier::Device && to != Tier::Device {
            self.sync_replica(id, from)?;
        }
        if to == Tier::Device {
            self.h2d_ready(be)?;
        }
        let State { arenas, disk, staging, entries, copy_start, .. } = self;
        let e = entries.get_mut(&id).ok_or(Error::UnknownId(id))?;
        let name = &e.name;
        let src = e.replicas[from.index()].as_ref().ok_or(Error::NotInTier { id, tier: from })?;
        let corrupt = |disk: &DiskTier, d: &DiskExtent, found: u32| Error::Corrupt {
            id,
            name: name.clone(),
            path: disk.path().to_path_buf(),
            expected: DiskTier::expected_crc(d),
            found,
        };
        match (&src.ext, dst) {
            (Ext::Mem(s), Ext::Mem(d)) => {
                let sa = arenas[from.index()].as_ref().ok_or(Error::TierDisabled { tier: from })?;
                let da = arenas[to.index()].as_ref().ok_or(Error::TierDisabled { tier: to })?;
                if let (Some(sb), Some(db)) = (sa.host_slice(s), da.host_slice_mut(d)) {
                    copier().copy(db, sb);
                    return Ok(None);
                }
                // One side is device memory: a DMA copy on the stream of its direction.
                let stream = if to == Tier::Device { be.h2d() } else { be.d2h() };
                if let Some(ev) = &src.ready {
                    stream.wait(ev)?;
                }
                for ev in &e.last_use {
                    stream.wait(ev)?;
                }
                // The copy's span starts after the waits, so a trace shows them as idle time.
                *copy_start = Some(stream.record()?);
                Ok(Some(copy_extent(stream, da, d, sa, s)?))
            }
            (Ext::Mem(s), Ext::Disk(d)) => {
                let sa = arenas[from.index()].as_ref().ok_or(Error::TierDisabled { tier: from })?;
                let disk = disk.as_mut().ok_or(Error::TierDisabled { tier: to })?;
                if let Some(sb) = sa.host_slice(s) {
                    disk.write(d, sb)?;
                    return Ok(None);
                }
                let staging = staging.as_mut().ok_or(Error::TierDisabled { tier: from })?;
                let d2h = be.d2h();
                if let Some(ev) = &src.ready {
                    d2h.wait(ev)?;
                }
                for ev in &e.last_use {
                    d2h.wait(ev)?;
                }
                let mut crc = crc32fast::Hasher::new();
                *copy_start = Some(d2h.record()?);
                staging.download(d2h, sa, s, |off, piece| {
                    crc.update(piece);
                    disk.write_range(d, off as u64, piece)
                })?;
                DiskTier::set_crc(d, crc.finalize());
                Ok(None)
            }
            (Ext::Disk(s), Ext::Mem(d)) => {
                let da = arenas[to.index()].as_ref().ok_or(Error::TierDisabled { tier: to })?;
                let disk = disk.as_mut().ok_or(Error::TierDisabled { tier: from })?;
                if let Some(db) = da.host_slice_mut(d) {
                    return match disk.read(s, db)? {
                        Ok(()) => Ok(None),
                        Err(found) => Err(corrupt(disk, s, found)),
                    };
                }
                // Disk to device: read into pinned staging, then DMA, chunk by chunk; the
                // checksum is verified over the whole tensor before the replica is kept.
                let staging = staging.as_mut().ok_or(Error::TierDisabled { tier: to })?;
                let mut crc = crc32fast::Hasher::new();
                *copy_start = Some(be.h2d().record()?);
                let last = staging.upload(be.h2d(), da, d, |off, buf| {
                    disk.read_range(s, off as u64, buf)?;
                    crc.update(buf);
                    Ok(())
                })?;
                let found = crc.finalize();
                if found != DiskTier::expected_crc(s) {
                    if let Some(ev) = &last {
                        ev.synchronize()?;
                    }
                    return Err(corrupt(disk, s, found));
                }
                Ok(last)
            }
            (Ext::File { file, offset, len }, Ext::Mem(d)) => {
                let da = arenas[to.index()].as_ref().ok_or(Error::TierDisabled { tier: to })?;
                let (file, offset, len) = (file.clone(), *offset, *len);
                if let Some(db) = da.host_slice_mut(d) {
                    file.read_at(offset, db)?;
                    return Ok(None);
                }
                let staging = staging.as_mut().ok_or(Error::TierDisabled { tier: to })?;
                debug_assert_eq!(len, e.bytes);
                *copy_start = Some(be.h2d().record()?);
                staging.upload(be.h2d(), da, d, |off, buf| file.read_at(offset + off as u64, buf))
            }
            (Ext::File { file, offset, len }, Ext::Disk(d)) => {
                let disk = disk.as_mut().ok_or(Error::TierDisabled { tier: to })?;
                const PIECE: u64 = 8 << 20;
                let mut buf = vec![0u8; PIECE.min(*len) as usize];
                let mut crc = crc32fast::Hasher::new();
                let mut off = 0;
                while off < *len {
                    let n = PIECE.min(*len - off) as usize;
                    file.read_at(*offset + off, &mut buf[..n])?;
                    crc.update(&buf[..n]);
                    disk.write_range(d, off, &buf[..n])?;
                    off += n as u64;
                }
                DiskTier::set_crc(d, crc.finalize());
                Ok(None)
            }
            (_, Ext::File { .. }) | (Ext::Disk(_), Ext::Disk(_)) => {
                Err(Error::InvalidArgument("copy into the Disk tier's own slot".into()))
            }
        }
    }
}

/// The victims, in order, that together free at least `bytes` of `t` (all of them if they
/// cannot).
pub(crate) fn victims_covering(victims: &[TensorId], bytes: u64, st: &State) -> Vec<TensorId> {
    let mut freed = 0;
    let mut out = Vec::new();
    for &v in victims {
        if freed >= bytes {
            break;
        }
        freed += st.entries[&v].bytes;
        out.push(v);
    }
    out
}
