//! The trainer's own errors ([`TrainError`]).

use std::path::PathBuf;

/// The trainer's own errors. They reach the caller inside a `candle_core::Error` (an
/// `std::io::Error` of kind `Other` carrying this, in `candle_core::Error::Io`):
/// [`TrainError::find`] gets them back, to act on a diverged run or a refused checkpoint.
///
/// ```
/// use strata::candle::train::TrainError;
/// let e = TrainError::NonFinite { step: 3, what: "the loss".into(), value: f64::NAN }.into_candle();
/// assert!(matches!(TrainError::find(&e), Some(TrainError::NonFinite { step: 3, .. })));
/// assert!(e.to_string().starts_with("step 3: the loss is NaN"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// A hyperparameter, size or flag that cannot train: NaN, negative, zero, or a product of
    /// sizes that overflows. The message names it and says what is allowed.
    #[error("{0}")]
    Invalid(String),
    /// A step (or a file) needs more host memory than the machine has available.
    #[error(
        "{what} needs about {} of host memory and {} is available: {hint}",
        crate::format_size(*asked),
        crate::format_size(*available)
    )]
    TooLarge {
        /// What was asked for.
        what: String,
        /// Bytes it needs.
        asked: u64,
        /// Bytes available (`MemAvailable`).
        available: u64,
        /// What to change.
        hint: String,
    },
    /// A step whose loss or gradient norm is not finite: nothing was updated, and the trainer
    /// is still at step `step` (it can be saved). Also a save that found a non-finite value in
    /// the state it would write (nothing is written then).
    #[error(
        "step {step}: {what} is {value}: the run diverged; nothing was updated or written, and \
         the trainer is still at step {step} (save it, or lower the learning rate, clip the \
         gradients, or skip such steps with TrainConfig::skip_nonfinite / --skip-nonfinite)"
    )]
    NonFinite {
        /// The step (0-based) that diverged.
        step: u64,
        /// What was not finite: `the loss`, `the gradient norm (first at NAME)`, ...
        what: String,
        /// Its value.
        value: f64,
    },
    /// A checkpoint that cannot be used as it is: no commit record, a file missing, of another
    /// size or content than the record says, of another run or step. Names the file.
    #[error("checkpoint {}: {why}", path.display())]
    BadCheckpoint {
        /// The file (or directory) at fault.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// A checkpoint of another run than the trainer's: another architecture, dtype, frozen set,
    /// schedule or batch, or a run directory holding another run's checkpoints.
    #[error("{}: the saved run's {what} is {saved}, this one's {here}: {hint}", path.display())]
    Mismatch {
        /// The checkpoint (or run directory).
        path: PathBuf,
        /// What differs.
        what: String,
        /// The checkpoint's value.
        saved: String,
        /// The trainer's.
        here: String,
        /// What to do.
        hint: String,
    },
    /// A token file that cannot be trained on (not a regular file, not whole u32s, too short,
    /// ids past the vocabulary, too large for the host).
    #[error("data {}: {why}", path.display())]
    BadData {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// An output a run would write that it cannot ([`check_outputs`](super::check_outputs)): a file
    /// where a directory goes, a directory holding another run's checkpoints or other files, one
    /// that cannot be written, a file system without room. Found before the first step.
    #[error("{flag} {}: {why}", path.display())]
    BadOutput {
        /// What names it (`--save`, `--export-merged`, ...).
        flag: String,
        /// The path.
        path: PathBuf,
        /// What is wrong, and what to do.
        why: String,
    },
}

impl TrainError {
    /// This error as a `candle_core::Error` (what the trainer's functions return).
    pub fn into_candle(self) -> candle_core::Error {
        candle_core::Error::Io(std::io::Error::other(self))
    }

    /// The [`TrainError`] inside `e`, if it is one (under any backtrace or context candle
    /// added).
    pub fn find(e: &candle_core::Error) -> Option<&TrainError> {
        crate::candle::find_carried(e)
    }
}

pub(super) fn invalid(why: String) -> candle_core::Error {
    TrainError::Invalid(why).into_candle()
}
