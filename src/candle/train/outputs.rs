//! Every output a run will write, checked before its first step ([`check_outputs`]): a run
//! that cannot save, export or write its inputs is refused while nothing has been spent on it,
//! not after its last step.

use std::path::{Path, PathBuf};

use super::checkpoint::{list as steps_in, run_of};
use super::{plan::trainable_sizes, LlamaConfig, TrainConfig, TrainError};
use crate::base::types::DType;
use crate::format_size;

/// What a run will write, for [`check_outputs`].
#[derive(Clone, Debug, Default)]
pub struct OutputPlan {
    /// The run directory checkpoints are saved into (`--save DIR`).
    pub save: Option<PathBuf>,
    /// The run being resumed ([`Checkpoint::run`](super::Checkpoint::run)): its own
    /// checkpoints may be in `save`; `None` for a new run, whose `save` must hold no run's.
    pub resuming: Option<u64>,
    /// Bytes of one checkpoint ([`checkpoint_bytes`]): `save`'s file system must have them.
    pub checkpoint_bytes: u64,
    /// The directory a merged model is exported into (`--export-merged DIR`): new or empty.
    pub export_merged: Option<PathBuf>,
    /// Bytes of the merged export (the model's weights).
    pub export_bytes: u64,
    /// The directory the run's inputs are written into (`--write-inputs DIR`): new or empty.
    pub write_inputs: Option<PathBuf>,
}

fn refuse(flag: &str, path: &Path, why: String) -> candle_core::Error {
    TrainError::BadOutput { flag: flag.into(), path: path.to_path_buf(), why }.into_candle()
}

/// Checks every output of `plan` before a run's first step, changing nothing on disk:
/// - `save`: a directory or nothing yet (a file there is refused, naming it); holding no
///   checkpoint of another run than the one being resumed (a new run's directory holds none);
///   writable (a file is created in it, or in the directory that would hold it, and removed);
///   with room on its file system for one checkpoint (`checkpoint_bytes`; the error says how
///   much is needed and how much is free).
/// - `export_merged`, `write_inputs`: a new or empty directory (a file, or a directory holding
///   anything, is refused: an export or the inputs do not mix with other files), writable,
///   `export_merged` with room for `export_bytes`.
///
/// Errors are [`TrainError::BadOutput`] (or [`TrainError::Mismatch`] for another run's
/// checkpoints), naming the flag and the path and saying what to do.
///
/// ```
/// use strata::candle::train::{check_outputs, OutputPlan};
/// let dir = tempfile::tempdir().unwrap();
/// let file = dir.path().join("f");
/// std::fs::write(&file, b"x").unwrap();
/// let plan = OutputPlan { save: Some(file.clone()), ..OutputPlan::default() };
/// let e = check_outputs(&plan).unwrap_err().to_string();
/// assert!(e.contains(&file.display().to_string()) && e.contains("is a file"), "{e}");
/// let plan = OutputPlan { save: Some(dir.path().join("run")), ..OutputPlan::default() };
/// check_outputs(&plan).unwrap();
/// assert!(!dir.path().join("run").exists()); // nothing made
/// ```
pub fn check_outputs(plan: &OutputPlan) -> candle_core::Result<()> {
    if let Some(dir) = &plan.save {
        let flag = "--save";
        directory(flag, dir)?;
        for (step, p) in steps_in(dir)? {
            let Some(run) = run_of(&p) else { continue };
            if plan.resuming != Some(run) {
                return Err(TrainError::Mismatch {
                    path: p,
                    what: format!("run (step {step})"),
                    saved: format!("{run:016x}"),
                    here: plan.resuming.map_or("a new run".into(), |r| format!("{r:016x}")),
                    hint: "a run directory holds one run's checkpoints: save elsewhere, or \
                           resume that run from it (--resume DIR)"
                        .into(),
                }
                .into_candle());
            }
        }
        writable_with_room(flag, dir, plan.checkpoint_bytes, "one checkpoint")?;
    }
    for (flag, dir, bytes, what) in [
        ("--export-merged", &plan.export_merged, plan.export_bytes, "the merged model"),
        ("--write-inputs", &plan.write_inputs, 0, "the inputs"),
    ] {
        let Some(dir) = dir else { continue };
        directory(flag, dir)?;
        let holds = std::fs::read_dir(dir).is_ok_and(|mut d| d.next().is_some());
        if holds {
            return Err(refuse(
                flag,
                dir,
                format!(
                    "a directory that is not empty: {what} goes into a new or empty directory \
                     (name another, or empty it)"
                ),
            ));
        }
        writable_with_room(flag, dir, bytes, what)?;
    }
    Ok(())
}

/// Refuses `path` when something other than a directory is there.
fn directory(flag: &str, path: &Path) -> candle_core::Result<()> {
    match std::fs::metadata(path) {
        Ok(md) if md.is_dir() => Ok(()),
        Ok(_) => Err(refuse(
            flag,
            path,
            "is a file (or not a directory): it names a directory to write into; name another"
                .into(),
        )),
        // Not there, or under a file ([`nearest_dir`] names it).
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => Ok(()),
        Err(e) => Err(refuse(flag, path, format!("cannot be looked at: {e}"))),
    }
}

/// The directory `dir` is, or the nearest one above it that exists (where it would be made).
fn nearest_dir(flag: &str, dir: &Path) -> candle_core::Result<PathBuf> {
    let mut p = dir.to_path_buf();
    loop {
        match std::fs::metadata(&p) {
            Ok(md) if md.is_dir() => return Ok(p),
            Ok(_) => {
                return Err(refuse(
                    flag,
                    dir,
                    format!("{} is a file: the directory cannot be made there", p.display()),
                ))
            }
            Err(_) => {}
        }
        p = match p.parent() {
            Some(q) if !q.as_os_str().is_empty() => q.to_path_buf(),
            _ => PathBuf::from("."),
        };
    }
}

/// Refuses `dir` unless a file can be made where it is (or would be), and its file system has
/// `bytes` free.
fn writable_with_room(flag: &str, dir: &Path, bytes: u64, what: &str) -> candle_core::Result<()> {
    let at = nearest_dir(flag, dir)?;
    if let Err(e) = tempfile::Builder::new().prefix(".strata-probe-").tempfile_in(&at) {
        return Err(refuse(
            flag,
            dir,
            format!("cannot be written ({} refuses a new file: {e})", at.display()),
        ));
    }
    if let Ok(free) = crate::disk_space_available(&at) {
        if free < bytes {
            return Err(refuse(
                flag,
                dir,
                format!(
                    "{what} needs about {} and its file system has {} free: free some, or \
                     write elsewhere",
                    format_size(bytes),
                    format_size(free)
                ),
            ));
        }
    }
    Ok(())
}

/// Bytes of one checkpoint of a run of `config` trained with `train` in `dtype`: the weights
/// (a LoRA run's adapters only) and the optimizer's state (two f32 moments of each trained
/// tensor, and an f32 master of bf16 ones). An estimate for [`OutputPlan::checkpoint_bytes`];
/// sizes that overflow are [`TrainError::Invalid`].
pub fn checkpoint_bytes(
    config: &LlamaConfig,
    train: &TrainConfig,
    dtype: DType,
) -> candle_core::Result<u64> {
    let overflow = || TrainError::Invalid("a checkpoint's size overflows u64".into()).into_candle();
    let elem = dtype.size_of() as u64;
    let trained: u64 = trainable_sizes(config, train)?
        .iter()
        .try_fold(0u64, |a, &n| a.checked_add(n))
        .ok_or_else(overflow)?;
    let (weights, per) = match &train.lora {
        Some(_) => (0, 3 * 4),
        None => {
            let all = config
                .tensors()
                .iter()
                .try_fold(0u64, |a, (_, s)| {
                    s.iter().try_fold(1u64, |p, &d| p.checked_mul(d as u64))?.checked_add(a)
                })
                .ok_or_else(overflow)?;
            let per = if dtype == DType::F32 { 2 * 4 } else { 3 * 4 };
            (all.checked_mul(elem).ok_or_else(overflow)?, per)
        }
    };
    trained.checked_mul(per).and_then(|s| s.checked_add(weights)).ok_or_else(overflow)
}
