//! The crate's error type.
//!
//! Variants are split by what a caller can do about them, after cubecl: a request that can never
//! fit ([`Error::TooLarge`]) is different from memory that is short right now
//! ([`Error::OutOfMemory`]), which a caller may fix by removing or demoting tensors and retrying.

use std::path::PathBuf;

use crate::base::types::{TensorId, Tier};

/// Everything that can go wrong in strata.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The tensor is larger than the capacity of every enabled tier (or of the tier asked for):
    /// it can never be stored, whatever is evicted.
    #[error("a tensor of {} is larger than {what}", crate::base::types::format_size(*bytes))]
    TooLarge {
        /// Size of the tensor in bytes.
        bytes: u64,
        /// What it does not fit into (a tier and its capacity, or every tier).
        what: String,
    },
    /// No room in `tier` now, even after demoting every tensor that may be demoted.
    #[error("out of memory in tier {tier}: {} requested", crate::base::types::format_size(*bytes))]
    OutOfMemory {
        /// The tier that ran out.
        tier: Tier,
        /// Bytes that were asked for.
        bytes: u64,
    },
    /// A tier was asked for that has capacity 0 (disabled) or that this backend lacks.
    #[error("tier {tier} is disabled (capacity 0)")]
    TierDisabled {
        /// The disabled tier.
        tier: Tier,
    },
    /// Every tier has capacity 0: the store could hold nothing.
    #[error("every tier has capacity 0: the store could hold nothing")]
    NoCapacity,
    /// A checksum mismatch: the copy of tensor `id` at `path` does not hold what was written.
    #[error("tensor {id:?} ({name}) is corrupt in {path}: checksum {found:#010x}, expected {expected:#010x}")]
    Corrupt {
        /// The tensor.
        id: TensorId,
        /// Its name.
        name: String,
        /// The file holding the corrupt copy.
        path: PathBuf,
        /// Checksum recorded when the copy was written.
        expected: u32,
        /// Checksum of what was read back.
        found: u32,
    },
    /// The id does not name a tensor of this store (never existed, or removed).
    #[error("unknown tensor id {0:?}")]
    UnknownId(TensorId),
    /// `put` with a name that is already in use.
    #[error("a tensor named {0:?} already exists")]
    DuplicateName(String),
    /// Data length does not match `dtype.size_of() * shape.product()`.
    #[error("data length {got} does not match the tensor's {expected} bytes ({what})")]
    LengthMismatch {
        /// Bytes expected.
        expected: u64,
        /// Bytes given.
        got: u64,
        /// What was being checked.
        what: String,
    },
    /// A typed access ([`Store::read_vec`](crate::Store::read_vec), a typed view) asked for a
    /// Rust type that is not the tensor's dtype.
    #[error("tensor {id} is {dtype}: {}, not as {asked}", crate::base::element::how_to_read(*dtype))]
    DTypeMismatch {
        /// The tensor.
        id: TensorId,
        /// Its dtype.
        dtype: crate::base::types::DType,
        /// The Rust type asked for.
        asked: &'static str,
    },
    /// The shape is not valid (its element count overflows, or a name is empty).
    #[error("bad shape {shape:?}: {why}")]
    BadShape {
        /// The shape given.
        shape: Vec<usize>,
        /// Why it was refused.
        why: String,
    },
    /// An argument was refused (empty name, bad size string, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The tensor is held by a view or a pin and cannot be moved or removed now.
    #[error("tensor {id:?} is in use by {holders} view(s) or pin(s)")]
    Busy {
        /// The tensor.
        id: TensorId,
        /// How many views or pins hold it.
        holders: u32,
    },
    /// The operation needs a copy in a tier the tensor is not in (for example `mapped_view` of a
    /// tensor that is not in `Mapped`).
    #[error("tensor {id:?} is not in tier {tier}")]
    NotInTier {
        /// The tensor.
        id: TensorId,
        /// The tier asked for.
        tier: Tier,
    },
    /// An I/O error on a file: one of the store's, or a user's file it reads or writes.
    ///
    /// Its message names the file; the OS's reason is its [`source`](std::error::Error::source)
    /// (so that a report of the chain, such as `anyhow`'s `{:#}`, prints it once):
    /// [`Error::chain`] gives both in one line.
    #[error("I/O error on {}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A tensor file (safetensors) that cannot be loaded as it is: truncated, a malformed or
    /// oversized header, offsets out of range or overlapping, an unknown dtype, a shape that does
    /// not match the data.
    #[error("bad tensor file {path}{}: {why}", tensor.as_ref().map(|t| format!(" (tensor {t:?})")).unwrap_or_default())]
    BadFile {
        /// The file.
        path: PathBuf,
        /// The tensor concerned, when the problem is one tensor's.
        tensor: Option<String>,
        /// What is wrong.
        why: String,
    },
    /// A path where strata reads or writes a file names something else: a directory, a FIFO, a
    /// socket or a device. Refused before anything is read from it or written to it (a FIFO
    /// would block a read forever; a device could be read without end).
    #[error("{} is {what}, not a regular file: give the path of a file", path.display())]
    NotAFile {
        /// The path given (or found in an index or a directory).
        path: PathBuf,
        /// What it is instead: "a directory", "a FIFO", "a socket", "a character device", ...
        what: &'static str,
    },
    /// The file system holding the disk tier is full.
    #[error("disk full writing {path}")]
    DiskFull {
        /// The file being written.
        path: PathBuf,
    },
    /// A GPU was required (`require_gpu`) but none was found.
    #[error("no GPU: {0}")]
    NoGpu(String),
    /// A CUDA call failed.
    #[error("CUDA call {call} failed: {message}")]
    Cuda {
        /// The call that failed (driver or NVRTC function).
        call: &'static str,
        /// The driver's description of the error.
        message: String,
    },
    /// The backend has failed for good (a CUDA error that leaves the context unusable, or
    /// driver calls failing again and again): the store refuses device work from then on with
    /// the error that failed it. What host memory and disk hold can still be read and saved;
    /// device-only tensors are lost with the device. Save what you need and build a new store
    /// (on CUDA, in a new process: the driver keeps the failure until the process ends).
    #[error(
        "the backend has failed ({first}); device work is refused: save what the store still \
         reads and start a new store"
    )]
    BackendFailed {
        /// The error that failed it, with its causes.
        first: String,
    },
    /// The operation needs the other backend (for example a cudarc stream handed to a host
    /// store).
    #[error("backend mismatch: {0}")]
    BackendMismatch(String),
    /// A library strata loads at run time and builds apart from cargo (the cuDNN attention
    /// shim, `libstrata_attn.so`) is not there or does not load; `how` says how to build it or
    /// point to it. What does not need it goes on working.
    #[error("{library} is not available ({why}): {how}")]
    LibraryUnavailable {
        /// The library's file name.
        library: &'static str,
        /// Why it did not load: each place looked at, with the loader's message.
        why: String,
        /// How to build it, or where to put it.
        how: &'static str,
    },
}

/// `Result` with strata's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An [`Error::Io`] for `path`, or [`Error::DiskFull`] when the OS said the device is full
    /// (`ENOSPC`, `EDQUOT`): how strata reports a failed file operation, for a program that
    /// reports its own the same way (the `strata` binary's `bench` does).
    ///
    /// ```
    /// let full = std::io::Error::from_raw_os_error(libc::ENOSPC);
    /// assert!(matches!(strata::Error::io("/tmp/x", full), strata::Error::DiskFull { .. }));
    /// ```
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        if source.raw_os_error() == Some(libc::ENOSPC)
            || source.raw_os_error() == Some(libc::EDQUOT)
        {
            Error::DiskFull { path }
        } else {
            Error::Io { path, source }
        }
    }

    /// This error and every cause under it, joined by `": "` (what `anyhow` prints for `{:#}`):
    /// `I/O error on model.safetensors: Permission denied (os error 13)`.
    ///
    /// ```
    /// let e = strata::Error::Io {
    ///     path: "model.safetensors".into(),
    ///     source: std::io::Error::from_raw_os_error(13),
    /// };
    /// assert_eq!(e.to_string(), "I/O error on model.safetensors");
    /// assert!(e.chain().starts_with("I/O error on model.safetensors: Permission denied"));
    /// ```
    pub fn chain(&self) -> String {
        chain(self)
    }

    /// An [`Error::Cuda`] from a cudarc driver error.
    pub(crate) fn cuda(call: &'static str, e: cudarc::driver::DriverError) -> Self {
        Error::Cuda { call, message: e.to_string() }
    }
}

/// `e` and every cause under it, joined by `": "`.
pub(crate) fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cur = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An I/O error prints its OS reason once in a report of its chain (it printed it twice:
    /// in its own message and again as its source).
    #[test]
    fn an_io_error_prints_its_cause_once() {
        let e = Error::Io {
            path: "/x/m.safetensors".into(),
            source: std::io::Error::from_raw_os_error(2),
        };
        let full = e.chain();
        assert_eq!(full.matches("No such file or directory").count(), 1, "{full}");
        assert!(full.starts_with("I/O error on /x/m.safetensors: "), "{full}");
        assert!(std::error::Error::source(&e).is_some());
    }
}
