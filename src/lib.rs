//! # strata
//!
//! A tiered tensor store: tensors live across GPU HBM ([`Tier::Device`]), page-locked host memory
//! ([`Tier::Pinned`]), zero-copy mapped host memory ([`Tier::Mapped`]) and files on NVMe
//! ([`Tier::Disk`]), and strata moves them so the GPU finds what it needs on the device.
//!
//! ```
//! use strata::{DType, Store, Tier};
//!
//! # fn main() -> strata::Result<()> {
//! let store = Store::builder()
//!     .host_backend() // or leave out: the GPU when there is one
//!     .capacity(Tier::Device, 1 << 20)
//!     .capacity(Tier::Pinned, 4 << 20)
//!     .build()?;
//! let w = store.put("layer0.weight", DType::F32, &[256, 256], &vec![0u8; 256 * 256 * 4])?;
//! store.move_to(w, Tier::Disk)?;
//! assert_eq!(store.tier_of(w)?, Tier::Disk);
//! assert_eq!(store.read(w)?.len(), 256 * 256 * 4);
//! # Ok(()) }
//! ```
//!
//! ## Map of the crate
//! The store is layered; each layer is a folder (`docs/architecture.md` has the whole picture):
//!
//! | layer | what | where |
//! |---|---|---|
//! | public API | [`Store`], [`StoreBuilder`], views, [`Stream`], hints, files, [`Stats`] | `api/` |
//! | residency | tensors (a slab by [`TensorId`]), replicas, holds, flights, per-stream uses; the lock | `residency/` |
//! | placement | victim ranks and order, policies, admission, the prefetch budget | `placement/` |
//! | migration | plan, execute (without the lock), commit; the engine's workers; prefetching | `migrate/` |
//! | tiers | arenas and their leases, the extent allocator, staging, the disk slab, user files | `tiers/` |
//! | backend | host emulation (optionally in simulated time) or CUDA; events, streams | `backend/` |
//!
//! Built on the store, in the library: [`optim`] (SGD and AdamW over store tensors), [`linalg`]
//! and [`kernels`] (GEMMs and kernels over views), [`probe`] (raw transfer measurements),
//! [`plan`] (memory plans of a tensor file). Behind the `cli` feature (on by default):
//! `strata::apps`, what the `strata` binary runs (the bench, the MLP and trainer demos), with
//! their dependencies (clap, indicatif, plotters, csv; `docs/dependencies.md`). Everything else
//! builds with `default-features = false`. Behind the `candle` feature (off by default):
//! `strata::candle`, a candle-nn `VarBuilder` backend over a store and out-of-core layers for
//! candle models (`docs/candle.md`).

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod api;
#[cfg(feature = "cli")]
pub mod apps;
mod backend;
#[cfg(feature = "candle")]
pub mod candle;
mod element;
mod error;
pub mod failpoint;
mod migrate;
mod placement;
mod residency;
#[cfg(test)]
mod testutil;
mod tiers;
mod trace;
mod types;
pub use backend::sim::{LinkSharing, Simulation};
pub use backend::{kernels, linalg, optim, probe};
pub mod plan;
pub use placement::policy;

pub use api::{
    host_memory_available, DeviceView, HostView, LayerScope, LoadOptions, MappedView, Stats, Store,
    StoreBuilder, Stream, TensorInfo, TierStats,
};
pub use api::{Loaded, LoadedFile, LoadedTensor};
pub use element::Element;
pub use error::{Error, Result};
pub use policy::{FrequencyPolicy, LruPolicy, Policy, PolicyKind, SchedulePolicy, VictimKey};
pub use types::{format_size, parse_size, BackendKind, DType, Group, TensorId, Tier};

/// Number of CUDA devices the driver reports, or why there is no usable GPU (no driver library,
/// `cuInit` failed, no device). Never panics, also on machines without CUDA.
pub fn cuda_device_count() -> std::result::Result<usize, String> {
    backend::cuda::device_count()
}

/// Makes a write past the process's file-size limit (`ulimit -f`, `RLIMIT_FSIZE`) fail with an
/// error instead of killing the process: sets `SIGXFSZ`, whose default action ends the process
/// at such a write, to ignored, for the whole process. A write that crosses the limit then
/// fails with `EFBIG`, which strata returns as an [`Error::Io`] naming the file ("File too
/// large"), leaving every tensor as it was, and the process goes on.
///
/// strata never changes signal dispositions by itself: a program embedding it that may run
/// under a file-size limit calls this once at start, as the `strata` binary does, or handles
/// `SIGXFSZ` its own way.
///
/// ```
/// strata::ignore_file_size_signal()?;
/// # Ok::<(), std::io::Error>(())
/// ```
pub fn ignore_file_size_signal() -> std::io::Result<()> {
    tiers::file::ignore_sigxfsz()
}

/// Re-export of the cudarc version strata is built against, so embedders name the same types.
pub use cudarc;
pub use half;

/// The README's example, compiled and run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctest;
