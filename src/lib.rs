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
//! | layer | file |
//! |---|---|
//! | public API: [`Store`], [`StoreBuilder`], [`Stats`] | `store.rs`, `stats.rs` |
//! | device and mapped views, streams | `view.rs` |
//! | residency: where each tensor's copies are | `store.rs` (`Entry`) |
//! | policy: victims and promotions | `policy/` (a file per policy) |
//! | tier arenas and the extent allocator | `arena.rs`, `alloc.rs`, `disk.rs` |
//! | backend: host emulation (optionally in simulated time) or CUDA | `backend/` |
//! | the optimizer, GEMMs and kernels over store tensors: [`optim`], [`linalg`], [`kernels`] | `backend/{optim,linalg,kernels}.rs` |
//! | raw transfer measurements: [`probe`] | `backend/probe.rs` |
//! | memory plans of a tensor file: [`plan`] | `plan.rs` |
//! | *feature `cli`*: what the `strata` binary runs, built on the store: the bench, the MLP and trainer demos | `apps/` |
//!
//! Everything above the last row builds with `default-features = false`; the `cli` feature (on
//! by default) adds `strata::apps` and the binary, with their dependencies (clap, indicatif,
//! plotters, csv; `docs/dependencies.md`). See `docs/architecture.md` for the whole picture.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod alloc;
#[cfg(feature = "cli")]
pub mod apps;
mod arena;
mod backend;
mod disk;
mod engine;
mod error;
pub use backend::sim::{LinkSharing, Simulation};
pub use backend::{kernels, linalg, optim, probe};
pub mod plan;
pub mod policy;
mod stats;
mod store;
mod trace;
mod types;
mod view;

pub use error::{Error, Result};
pub use policy::{FrequencyPolicy, LruPolicy, Policy, PolicyKind, SchedulePolicy};
pub use stats::{Stats, TierStats};
pub use store::{LayerScope, LoadOptions, Store, StoreBuilder, TensorInfo};
pub use types::{format_size, parse_size, BackendKind, DType, Group, TensorId, Tier};
pub use view::{DeviceView, HostView, MappedView, Stream};

/// Number of CUDA devices the driver reports, or why there is no usable GPU (no driver library,
/// `cuInit` failed, no device). Never panics, also on machines without CUDA.
pub fn cuda_device_count() -> std::result::Result<usize, String> {
    backend::cuda::device_count()
}

/// Re-export of the cudarc version strata is built against, so embedders name the same types.
pub use cudarc;

/// The README's example, compiled and run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctest;
