//! # strata
//!
//! A tiered tensor store: tensors live across GPU HBM ([`Tier::Device`]), page-locked host memory
//! ([`Tier::Pinned`]), zero-copy mapped host memory ([`Tier::Mapped`]) and files on NVMe
//! ([`Tier::Disk`]), each tier within a byte budget, and strata moves them so the GPU finds what
//! it needs on the device when it needs it. Without a GPU the same code runs on the host
//! backend, which emulates the tiers in host memory ([`Store::backend`] says which runs).
//!
//! ## What a program does with it
//!
//! **Put tensors in and read them back.** [`Store::put`] (bytes and a [`DType`]) or
//! [`Store::put_slice`] (typed) gives a [`TensorId`]; [`Store::read`] / [`Store::read_vec`] read
//! it from wherever it is; [`Store::move_to`] moves it explicitly; [`Store::stats`] says where
//! everything is and what moved.
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
//! **Lend tensors to GPU work through views.** [`Store::device_view`] makes a tensor resident
//! on the device for a [`Stream`] (the stream waits for the copy, the host thread does not) and
//! keeps it there while the [`DeviceView`] lives; its pointer goes to your kernels or cuBLAS.
//! [`Store::host_view`] and [`Store::mapped_view`] do the same for host code and zero-copy
//! kernels. A trainer passes its own CUDA context and streams
//! ([`StoreBuilder::context`], [`Stream::from_cuda`]).
//!
//! **Say what comes next.** Hints let strata copy ahead while your kernels run:
//! [`Store::prefetch`], [`Store::release`], [`Store::pin`], and a layer scope,
//! [`Store::layer`]`(uses, next)`, around each layer of a forward or backward pass; without
//! hints, [`PolicyKind::Schedule`] learns a repeating step's order by itself.
//!
//! **Load and save checkpoints.** [`Store::load_checkpoint`] takes a `.safetensors` file, a
//! sharded checkpoint's index or its directory, or a GGUF file, and leaves each tensor in its
//! memory-mapped file until it is used (or copies it into a tier: [`LoadOptions`]);
//! [`Loaded::save`] and [`Store::save_safetensors`] write back atomically. GGUF's
//! block-quantized dtypes ([`DType::Q4K`] and the others) are dtypes like any other, moved as
//! their bytes; [`Gguf`] reads a GGUF file's metadata, [`quant::dequantize`] turns their blocks
//! into `f32`.
//!
//! Every failure is an [`Error`] a caller can act on, and a failed call leaves every tensor as
//! it was. Built on the store: [`optim`] (SGD and AdamW over store tensors), [`linalg`] and
//! [`kernels`] (GEMMs and kernels over views), [`probe`] (raw transfer measurements), [`plan`]
//! (memory plans of a tensor file). [`Machine`] is the one description of a machine (memories,
//! links, rates and where each comes from; presets, detection and measurement) that plans, the
//! optimizer's choice, the trainer's plan and [`Simulation`] read. Behind the `candle` feature
//! (off by default), `strata::candle` serves a store's tensors to candle models
//! (`docs/candle.md`).
//!
//! ## Inside
//! The crate is layered in the order its calls run; each layer is a folder of `src/` (the bottom
//! one, `base/`, holds the types and the error; `compute/` the optimizer, plans and kernels built
//! on the public API) and imports only the layers below it (a test, `tests/layers.rs`, fails on
//! any other import). `docs/architecture.md` says what each layer does and how a device-view miss
//! and a training step go through them. `unsafe` lives only in the backend and the tier arenas.
//! The `strata` binary's commands are modules of the binary (`src/main.rs`, `src/cli/`), built
//! on this crate's public API like any other program, behind the `cli` feature (on by default)
//! with their dependencies (clap, indicatif, plotters, csv; `docs/dependencies.md`); the library
//! builds with `default-features = false`.
//!
#![doc = include_str!("../docs/layers.md")]
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]

// The layers, in call order (docs/layers.md); the command line above them is the binary's
// (src/main.rs, src/cli/).
#[cfg(feature = "candle")]
pub mod candle;

mod compute;
pub use compute::{kernels, linalg, optim, plan, probe};

mod api;

mod migrate;

mod placement;
pub use placement::policy::{
    FrequencyPolicy, LruPolicy, Policy, PolicyKind, SchedulePolicy, VictimKey,
};

mod residency;

mod tiers;

mod backend;
pub use backend::sim::{LinkSharing, Simulation};

mod base;
#[doc(hidden)] // fault injection for strata's own tests (feature `failpoints`); not an API
pub use base::failpoint;
pub use base::quant;

pub use api::{
    host_memory_available, DeviceView, HostRead, HostView, LayerScope, LoadOptions, MappedView,
    Stats, Store, StoreBuilder, Stream, TensorInfo, TierStats,
};
pub use api::{Gguf, GgufTensor, GgufValue, Loaded, LoadedFile, LoadedTensor, MappedFile};
pub use base::element::Element;
pub use base::error::{Error, Result};
pub use base::machine::Machine;
pub use base::types::{format_size, parse_size, BackendKind, DType, Group, TensorId, Tier};

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

/// Bytes an unprivileged process may still write on the file system holding `dir` (`statvfs`'s
/// `f_bavail × f_frsize`), the disk's counterpart of [`host_memory_available`]: what
/// `strata bench` checks its disk paths against, and the candle trainer's plan its Disk tier.
///
/// ```
/// assert!(strata::disk_space_available(&std::env::temp_dir())? > 0);
/// # Ok::<(), std::io::Error>(())
/// ```
pub fn disk_space_available(dir: &std::path::Path) -> std::io::Result<u64> {
    tiers::file::free_space(dir)
}

/// Re-export of the cudarc version strata is built against, so embedders name the same types.
pub use cudarc;
pub use half;

/// The README's example, compiled and run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctest;
