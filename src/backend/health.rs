//! Whether the backend still works: a store whose device has failed for good (a CUDA error that
//! corrupts the context, or the same kind of failure again and again) stops issuing device work
//! and refuses it at once with the first error, instead of failing each call slowly or, worse,
//! handing out memory that work it could not track may still write.
//!
//! A failure counts as a strike when it is the driver's (a CUDA driver call, or the fault
//! injection's stand-in for one); compiler (NVRTC) and cuBLAS errors and out-of-memory do not. A
//! device operation that succeeds clears the strikes. The backend is declared failed at
//! [`STRIKES`] strikes in a row, or at once for the errors CUDA documents as sticky (the context
//! is unusable after them, every later call returns them).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

use crate::base::error::{Error, Result};

/// Failures of the driver in a row after which the backend is declared failed.
pub(crate) const STRIKES: u32 = 3;

/// CUDA errors after which the context cannot be used again (the CUDA driver API's
/// documentation: "the process must be terminated and relaunched").
const STICKY: [&str; 9] = [
    "CUDA_ERROR_ILLEGAL_ADDRESS",
    "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_HARDWARE_STACK_ERROR",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_MISALIGNED_ADDRESS",
    "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_ECC_UNCORRECTABLE",
    "CUDA_ERROR_CONTEXT_IS_DESTROYED",
];

/// The backend's health: strikes so far, and the first error once it has failed.
#[derive(Default)]
pub(crate) struct Health {
    strikes: AtomicU32,
    failed: OnceLock<String>,
}

impl Health {
    /// [`Error::BackendFailed`] once the backend has failed: device work is refused.
    pub(crate) fn check(&self) -> Result<()> {
        match self.failed.get() {
            Some(first) => Err(Error::BackendFailed { first: first.clone() }),
            None => Ok(()),
        }
    }

    /// Notes how a device operation ended: a driver failure is a strike (or fails the backend
    /// at once when it is sticky), a success clears the strikes.
    pub(crate) fn note<T>(&self, r: &Result<T>) {
        match r {
            Ok(_) => {
                if self.strikes.load(Ordering::Relaxed) != 0 {
                    self.strikes.store(0, Ordering::Relaxed);
                }
            }
            Err(e) => self.note_err(e),
        }
    }

    /// Notes a failure of device work (an operation's, or one deferred from a worker).
    pub(crate) fn note_err(&self, e: &Error) {
        let Error::Cuda { call, message } = e else { return };
        let driver =
            (call.starts_with("cu") && !call.starts_with("cublas")) || *call == "failpoint";
        if !driver {
            return;
        }
        let sticky = STICKY.iter().any(|s| message.contains(s));
        let strikes = self.strikes.fetch_add(1, Ordering::Relaxed) + 1;
        if sticky || strikes >= STRIKES {
            // The first error to fail it is the one reported from then on.
            let _ = self.failed.set(e.chain());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cuda(call: &'static str, message: &str) -> Error {
        Error::Cuda { call, message: message.into() }
    }

    #[test]
    fn three_driver_failures_in_a_row_fail_the_backend() {
        let h = Health::default();
        for _ in 0..STRIKES - 1 {
            h.note::<()>(&Err(cuda("cuEventSynchronize", "DriverError(CUDA_ERROR_UNKNOWN, \"\")")));
        }
        assert!(h.check().is_ok());
        // A success in between starts the count again.
        h.note(&Ok(()));
        for _ in 0..STRIKES - 1 {
            h.note::<()>(&Err(cuda("cuMemcpyAsync", "x")));
        }
        assert!(h.check().is_ok());
        h.note::<()>(&Err(cuda("cuMemcpyAsync", "the third")));
        let e = h.check().unwrap_err();
        assert!(matches!(&e, Error::BackendFailed { first } if first.contains("the third")), "{e}");
        // Successes do not bring it back.
        h.note(&Ok(()));
        assert!(h.check().is_err());
    }

    #[test]
    fn a_sticky_error_fails_it_at_once_and_others_never_count() {
        let h = Health::default();
        for _ in 0..10 {
            h.note::<()>(&Err(cuda("nvrtcCompileProgram", "syntax")));
            h.note::<()>(&Err(cuda("cublasGemmEx", "x")));
            h.note::<()>(&Err(Error::OutOfMemory { tier: crate::Tier::Device, bytes: 1 }));
        }
        assert!(h.check().is_ok());
        h.note::<()>(&Err(cuda(
            "cuStreamSynchronize",
            "DriverError(CUDA_ERROR_ILLEGAL_ADDRESS, \"an illegal memory access was encountered\")",
        )));
        assert!(h.check().is_err());
    }
}
