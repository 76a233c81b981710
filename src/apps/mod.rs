//! What the `strata` binary runs, built on the store's public API (feature `cli`, on by
//! default): [`bench`](mod@bench) (`strata bench`), [`mlp`] (the bf16 out-of-core benchmark loop) and
//! [`train`] (the out-of-core trainer) behind `strata train-demo` and
//! `examples/out_of_core.rs`. A library user who wants the store alone turns the feature off
//! (`default-features = false`) and compiles none of this, nor its dependencies.

pub mod args;
pub mod bench;
pub mod mlp;
pub mod train;

use std::io::Write as _;

use crate::{Error, Result};

/// Writes `text` to stdout as it is. A failed write comes back as [`Error::Io`] on `<stdout>`:
/// a reader that went away (`strata inspect model.safetensors | head`) ends the command there,
/// and the binary exits quietly with success on it ([`is_broken_pipe`]) rather than panic as
/// `print!` does.
pub fn print(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|source| Error::Io { path: "<stdout>".into(), source })
}

/// [`print`](fn@print) of `line` and a line break: the `progress` callback the demos take.
pub fn println(line: &str) -> Result<()> {
    print(&format!("{line}\n"))
}

/// Refuses to allocate `bytes` of host memory for `what` when the machine has less available
/// (`MemAvailable`): a model too large for this host is an error that says so, not an
/// allocation failure that aborts the process.
pub(crate) fn check_host_memory(what: &str, bytes: u128) -> Result<()> {
    let Some(avail) = crate::host_memory_available() else { return Ok(()) };
    if bytes > avail as u128 {
        return Err(Error::InvalidArgument(format!(
            "{what} needs {} of host memory and {} is available: use a smaller model \
             (--layers, --hidden, --rows)",
            crate::format_size(u64::try_from(bytes).unwrap_or(u64::MAX)),
            crate::format_size(avail)
        )));
    }
    Ok(())
}

/// Whether `e`, or an error it was caused by, is a write to a pipe whose reader has gone.
pub fn is_broken_pipe(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
        {
            return true;
        }
        cur = err.source();
    }
    false
}
