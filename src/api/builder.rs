//! [`StoreBuilder`]: budgets, backend, policy and options, and the build that reserves every
//! tier's memory once.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::Store;
use crate::backend::cuda::{self, CudaBackend};
use crate::backend::host::HostBackend;
use crate::backend::sim::{SimClock, Simulation};
use crate::backend::Backend;
use crate::base::error::{Error, Result};
use crate::base::types::{format_size, BackendKind, Tier};
use crate::migrate::timeline::{Clock, Timeline};
use crate::migrate::workers::Workers;
use crate::migrate::{Counters, Shared, State};
use crate::placement::policy::{Policy, PolicyKind};
use crate::placement::Placement;
use crate::residency::Residency;
use crate::tiers::arena::{MemArena, StagingBuf};
use crate::tiers::disk::DiskSlab;
use crate::tiers::staging::StagingPool;
use crate::tiers::{TierBooks, TierMem};

/// Default budgets: Device, Pinned, Mapped, Disk.
const DEFAULT_CAPACITY: [u64; 4] = [1 << 30, 1 << 30, 256 << 20, 64 << 30];
/// Pinned staging by default: buffers in flight and their size.
const STAGING_BUFS: usize = 4;
const STAGING_SIZE: usize = 16 << 20;
/// Migration worker threads by default.
const DISK_WORKERS: usize = 4;

/// Numbers stores, so an id of one store is unknown to another.
static NEXT_STORE: AtomicU32 = AtomicU32::new(1);

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
    timeline: bool,
    piece: Option<u64>,
    on_reserve: Option<ReserveProgress>,
    write_reserve: bool,
}

/// A callback told of the memory reserved while a store is built.
type ReserveProgress = Box<dyn FnMut(Tier, u64, u64) + Send>;

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
            timeline: false,
            piece: None,
            on_reserve: None,
            write_reserve: true,
        }
    }
}

impl StoreBuilder {
    /// Whether the store keeps a write reserve (default: yes): room for a second copy of the
    /// largest tensor it holds, kept aside in the slowest tier that can hold it (the Disk tier,
    /// where there is one), so that any tensor can be overwritten and a failed write keeps its
    /// old bytes even when every tier is full. It costs that much of that tier's budget: a put
    /// that leaves no room for it fails with [`Error::OutOfMemory`](crate::Error::OutOfMemory).
    /// Without it, a write in a full store may fail with `OutOfMemory` (the tensor keeps its
    /// bytes). `docs/reliability.md` has the details.
    ///
    /// ```
    /// # fn main() -> strata::Result<()> {
    /// use strata::{DType, Store, Tier};
    /// let store = Store::builder()
    ///     .host_backend()
    ///     .capacity(Tier::Device, 8 << 10)
    ///     .capacity(Tier::Pinned, 0)
    ///     .capacity(Tier::Mapped, 0)
    ///     .capacity(Tier::Disk, 0)
    ///     .build()?;
    /// let a = store.put("a", DType::U8, &[4096], &[1; 4096])?;
    /// // The other 4 KiB are the reserve: a second tensor does not fit, ...
    /// assert!(store.put("b", DType::U8, &[4096], &[2; 4096]).is_err());
    /// // ... and `a` can always be overwritten.
    /// store.write(a, &[3; 4096])?;
    /// assert_eq!(store.stats().tiers[0].write_reserve, 4096);
    /// # Ok(()) }
    /// ```
    pub fn write_reserve(mut self, on: bool) -> Self {
        self.write_reserve = on;
        self
    }

    /// Sets the budget of `tier` in bytes; 0 disables the tier. Defaults: Device 1 GiB, Pinned
    /// 1 GiB, Mapped 256 MiB, Disk 64 GiB. Memory tiers reserve their whole budget from the
    /// backend when the store is built (pinned memory costs ~0.5 s per GiB to allocate), so no
    /// CUDA allocation happens on the put / read / migrate path; the disk tier's file is sparse.
    pub fn capacity(mut self, tier: Tier, bytes: u64) -> Self {
        self.capacity[tier.index()] = bytes;
        self
    }

    /// Directory of the disk tier's slab file (created if missing). Default: the system's
    /// temporary directory. The file has no name there: it is created unlinked, so nothing is
    /// left behind when the store drops or the process dies.
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
    /// the machine `sim` describes ([`Simulation::of`] a [`Machine`](crate::Machine)), and the
    /// store's timings ([`Stats`](crate::Stats), traces, step times read from events) are
    /// simulated ones. For planning an out-of-core run and studying its
    /// pipeline on a machine without a GPU; see [`Simulation`] for what the model leaves out.
    ///
    /// ```
    /// use strata::{DType, Machine, Simulation, Store, Tier};
    /// # fn main() -> strata::Result<()> {
    /// // The H100 preset, each simulated byte standing for 1 MiB: 64 KiB is timed as 64 GiB.
    /// let sim = Simulation::of(&Machine::h100())?.scaled((1 << 20) as f64, 1.0);
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

    /// Worker threads that carry out moves needing the host: reading the Disk tier into the
    /// device for prefetches, spilling victims to make room for them (default 4; with a Disk
    /// tier, each reserves two staging buffers of the [`staging`](StoreBuilder::staging) size).
    pub fn disk_workers(mut self, workers: usize) -> Self {
        self.disk_workers = workers.max(1);
        self
    }

    /// Keeps a timeline of copies and waits (default off): [`Stats::copy_seconds`](crate::Stats::copy_seconds),
    /// [`Stats::stall_seconds`](crate::Stats::stall_seconds) of device streams and [`Stats::overlap_ratio`](crate::Stats::overlap_ratio) are measured, and
    /// [`Store::trace`] can write it as a Chrome trace. It costs a timing-enabled event per
    /// copy and per stream wait on a copy; without it the store uses pooled events without
    /// timing, the cheapest the driver has.
    pub fn timeline(mut self, on: bool) -> Self {
        self.timeline = on;
        self
    }

    /// Reserves each memory tier's budget in pieces of at most `bytes` (default: in one piece).
    /// Either way, when the backend cannot give a piece that large (no contiguous range of
    /// pinned memory, say), the pieces halve, down to 64 MiB. A tensor must fit in one piece, so
    /// the largest tensor a tier can hold is its largest piece ([`Error::TooLarge`] beyond).
    /// Pieces let [`on_reserve`](StoreBuilder::on_reserve) report progress while a large
    /// budget is reserved (pinned memory takes about half a second per GiB).
    pub fn reserve_in_pieces(mut self, bytes: u64) -> Self {
        self.piece = Some(bytes.max(1));
        self
    }

    /// Calls `f(tier, reserved, budget)` after each piece of a memory tier's budget is reserved
    /// during [`build`](StoreBuilder::build), for progress output during a long start.
    ///
    /// ```
    /// use strata::{Store, Tier};
    /// let store = Store::builder()
    ///     .host_backend()
    ///     .capacity(Tier::Pinned, 256 << 20)
    ///     .reserve_in_pieces(64 << 20)
    ///     .on_reserve(|tier, done, budget| eprintln!("{tier}: {done} of {budget} bytes reserved"))
    ///     .build()?;
    /// assert_eq!(store.stats().capacity(Tier::Pinned), 256 << 20);
    /// # Ok::<(), strata::Error>(())
    /// ```
    pub fn on_reserve(mut self, f: impl FnMut(Tier, u64, u64) + Send + 'static) -> Self {
        self.on_reserve = Some(Box::new(f));
        self
    }

    /// Builds the store: picks the backend, reserves each tier's memory, opens the disk tier,
    /// reserves the staging buffers and starts the migration workers.
    pub fn build(mut self) -> Result<Store> {
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
        let mut allocs: [Option<_>; 4] = Default::default();
        for t in [Tier::Device, Tier::Pinned, Tier::Mapped] {
            let cap = self.capacity[t.index()];
            if cap > 0 {
                let started = std::time::Instant::now();
                let mut progress = |done: u64| {
                    if let Some(f) = self.on_reserve.as_mut() {
                        f(t, done, cap);
                    }
                };
                let (arena, alloc) = MemArena::new(&backend, t, cap, self.piece, &mut progress)?;
                tracing::info!(
                    tier = %t,
                    bytes = cap,
                    pieces = arena.pieces(),
                    seconds = started.elapsed().as_secs_f64(),
                    "tier memory reserved"
                );
                arenas[t.index()] = Some(arena);
                allocs[t.index()] = Some(alloc);
            }
        }
        let disk_cap = self.capacity[Tier::Disk.index()];
        let disk = if disk_cap > 0 {
            let dir = self.disk_dir.as_deref();
            crate::base::failpoint::check(
                crate::base::failpoint::Site::DiskOpen,
                dir.unwrap_or(std::path::Path::new("<temp dir>")),
            )?;
            let (slab, alloc) = DiskSlab::open(dir, disk_cap, true)?;
            allocs[Tier::Disk.index()] = Some(alloc);
            Some(slab)
        } else {
            None
        };
        let device = self.capacity[Tier::Device.index()] > 0;
        let staging = if device {
            Some(StagingPool::new(&backend, self.staging.0, self.staging.1)?)
        } else {
            None
        };
        // Migration workers, with their own staging when they read the disk. A store whose
        // backend runs no threads of its own (simulated time: one host clock) runs its jobs
        // inline instead.
        let threads = device && backend.runs_threads();
        let worker_staging = if threads && disk.is_some() {
            (0..self.disk_workers)
                .map(|_| {
                    Ok(Mutex::new(vec![
                        StagingBuf::new(&backend, self.staging.1)?,
                        StagingBuf::new(&backend, self.staging.1)?,
                    ]))
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        let device_cap = self.capacity[Tier::Device.index()];
        let policy = self.policy.unwrap_or_else(|| PolicyKind::default().build());
        let timeline =
            if self.timeline { Some(Timeline::new(Clock::start(&backend)?)) } else { None };
        let store_no = NEXT_STORE.fetch_add(1, Ordering::Relaxed);
        let mut state = State {
            res: Residency::new(store_no),
            place: Placement::new(
                policy,
                self.prefetch_budget.unwrap_or(device_cap / 2),
                self.promote_on_read,
            ),
            books: TierBooks::new(allocs),
            counters: Counters::default(),
            timeline,
            probes: Vec::new(),
        };
        let fits = state.books.fits();
        state.place.victims.set_fits(fits);
        state.books.reserve.enabled = self.write_reserve;
        // The reserve's range on the Disk tier gets file-system blocks as it is taken.
        state.books.reserve.backing = disk.as_ref().and_then(|d| d.backing().ok());
        let shared = Arc::new(Shared {
            backend,
            mem: TierMem { arenas, disk, staging },
            state: parking_lot::Mutex::new(state),
            deferred: Mutex::new(Vec::new()),
            note,
            workers: OnceLock::new(),
            worker_staging,
            timing: self.timeline,
            health: Default::default(),
        });
        let engine = if threads {
            Workers::start(self.disk_workers, Arc::downgrade(&shared))?
        } else {
            Workers::inline()
        };
        let _ = shared.workers.set(engine);
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
    match host_memory_available() {
        Some(a) if bytes > a => Err(Error::InvalidArgument(format!(
            "pinned + mapped budgets of {} exceed the {} of host memory available to lock",
            format_size(bytes),
            format_size(a)
        ))),
        _ => Ok(()),
    }
}

/// The host memory available to allocate (Linux's `MemAvailable`), if the system says.
pub fn host_memory_available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
}
