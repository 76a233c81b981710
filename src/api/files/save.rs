//! Saving tensors to a safetensors file, atomically.
//!
//! The file is written unnamed (`O_TMPFILE`) in the target's directory, flushed to disk, given a
//! temporary name beside the target and renamed over it, then the directory is flushed. A
//! process killed while writing leaves nothing (the unnamed file dies with it); one killed in the
//! microseconds between the link and the rename leaves `.NAME.strata-PID-N.tmp`, which the next
//! save to that directory removes once process PID is gone. Where the file system has no
//! `O_TMPFILE` the file is written under that temporary name from the start, with the same clean
//! up. A reader of the target sees the old file or the new one, whole, never a mix.

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use safetensors::tensor::{Dtype as StDtype, Metadata, TensorInfo};

use super::{bad, to_st};
use crate::api::Store;
use crate::base::error::{Error, Result};
use crate::base::failpoint::{self, Site};
use crate::base::types::TensorId;
use crate::tiers::file::{check_regular, link_unnamed};

/// The `safetensors` readers' limit on a header.
const MAX_HEADER: usize = 100_000_000;

/// Temporary names of this process's saves: `.NAME.strata-PID-N.tmp`.
static SAVES: AtomicU64 = AtomicU64::new(0);

/// One tensor of the file, in file order.
struct Entry {
    id: TensorId,
    name: String,
    dtype: StDtype,
    bytes: usize,
}

/// Writes `tensors` (with their names in the file) and `metadata` to a new file at `path`.
pub(super) fn save(
    store: &Store,
    path: &Path,
    tensors: &[(TensorId, String)],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    // A symlink is followed: the file it names is replaced, and the link keeps naming it.
    let resolved;
    let path = match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            resolved = std::fs::canonicalize(path).map_err(|e| Error::io(path, e))?;
            resolved.as_path()
        }
        _ => path,
    };
    // A directory, device, FIFO or socket at `path` is refused (anything else that exists is
    // replaced); a path that does not exist yet is the common case.
    if path.exists() {
        check_regular(path)?;
    }
    let file_name = path
        .file_name()
        .ok_or_else(|| Error::InvalidArgument(format!("{} names no file", path.display())))?
        .to_string_lossy()
        .into_owned();
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));

    // The header first: a bad name or tensor fails before anything is written.
    let mut entries = Vec::with_capacity(tensors.len());
    let mut infos = Vec::with_capacity(tensors.len());
    let mut names = std::collections::HashSet::new();
    for (id, name) in tensors {
        let info = store.info(*id)?;
        if !names.insert(name.as_str()) {
            return Err(Error::DuplicateName(name.clone()));
        }
        if name == "__metadata__" {
            return Err(Error::InvalidArgument(format!(
                "tensor {id} is named __metadata__, which safetensors files reserve for their \
                 metadata: save it under another name (save_safetensors_as)"
            )));
        }
        let Some(dtype) = to_st(info.dtype) else {
            return Err(Error::InvalidArgument(format!(
                "tensor {id} ({name}) is {}, block-quantized, which safetensors cannot hold: \
                 dequantize it (strata::quant::dequantize) and save the f32 values, or keep the \
                 GGUF file it came from",
                info.dtype
            )));
        };
        entries.push(Entry { id: *id, name: name.clone(), dtype, bytes: info.bytes as usize });
        infos.push(info);
    }
    // The order the `safetensors` writers use: larger alignment first, then by name.
    let mut order: Vec<usize> = (0..entries.len()).collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (&entries[a], &entries[b]);
        b.dtype.cmp(&a.dtype).then_with(|| a.name.cmp(&b.name))
    });
    let mut offset = 0usize;
    let mut header = Vec::with_capacity(entries.len());
    for &i in &order {
        let e = &entries[i];
        header.push((
            e.name.clone(),
            TensorInfo {
                dtype: e.dtype,
                shape: infos[i].shape.clone(),
                data_offsets: (offset, offset + e.bytes),
            },
        ));
        offset += e.bytes;
    }
    let meta: Option<HashMap<String, String>> =
        (!metadata.is_empty()).then(|| metadata.clone().into_iter().collect());
    let header = Metadata::new(meta, header).map_err(|e| bad(path, None, e.to_string()))?;
    let mut header = serde_json::to_vec(&header).map_err(|e| bad(path, None, e.to_string()))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    if header.len() > MAX_HEADER {
        return Err(Error::InvalidArgument(format!(
            "{}: the header of {} tensors would take {} bytes, over the {} that safetensors \
             readers accept; save them in several files",
            path.display(),
            entries.len(),
            header.len(),
            MAX_HEADER
        )));
    }

    remove_stale(dir, &file_name);
    let mode = match std::fs::metadata(path) {
        Ok(m) => Some(m.permissions().mode() & 0o7777),
        Err(_) => None,
    };
    let temp_name = || {
        dir.join(format!(
            ".{file_name}.strata-{}-{}.tmp",
            std::process::id(),
            SAVES.fetch_add(1, Ordering::Relaxed)
        ))
    };
    let mut temp = temp_name();
    let (file, named) = create(dir, &mut temp, &temp_name, mode).map_err(|e| Error::io(path, e))?;
    let done = write(store, path, &file, &header, order.iter().map(|&i| &entries[i]))
        .and_then(|()| {
            failpoint::check(Site::SaveSync, path)?;
            file.sync_all().map_err(|e| Error::io(path, e))
        })
        .and_then(|()| {
            failpoint::check(Site::SaveRename, path)?;
            if !named {
                // A name taken by a file of an earlier process with our pid (a container
                // restarted as pid 1): the next name.
                let mut tries = 0;
                while let Err(e) = link_unnamed(&file, &temp) {
                    tries += 1;
                    if e.kind() != std::io::ErrorKind::AlreadyExists || tries == 100 {
                        return Err(Error::io(path, e));
                    }
                    temp = temp_name();
                }
            }
            std::fs::rename(&temp, path).map_err(|e| Error::io(path, e))
        });
    if let Err(e) = done {
        let _ = std::fs::remove_file(&temp);
        return Err(e);
    }
    // The rename is durable once the directory is.
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| Error::io(dir, e))
}

/// The file to write: unnamed where the file system allows it (`named` false), else `temp`
/// itself. Its permissions are `mode` (the target's, when it exists), or what a new file gets.
fn create(
    dir: &Path,
    temp: &mut PathBuf,
    next: &dyn Fn() -> PathBuf,
    mode: Option<u32>,
) -> std::io::Result<(File, bool)> {
    let unnamed = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_TMPFILE)
        .mode(0o666)
        .open(dir)
        .ok()
        // Linking it needs /proc (where a container has none, use a name).
        .filter(|_| Path::new("/proc/self/fd").is_dir());
    let (file, named) = match unnamed {
        Some(f) => (f, false),
        None => {
            let mut tries = 0;
            loop {
                match OpenOptions::new().write(true).create_new(true).mode(0o666).open(&*temp) {
                    Ok(f) => break (f, true),
                    Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && tries < 100 => {
                        tries += 1;
                        *temp = next();
                    }
                    Err(e) => return Err(e),
                }
            }
        }
    };
    if let Some(mode) = mode {
        file.set_permissions(std::fs::Permissions::from_mode(mode))?;
    }
    Ok((file, named))
}

/// Writes the file's bytes: the header's length, the header, then each tensor read from the
/// store (one at a time in memory).
fn write<'a>(
    store: &Store,
    path: &Path,
    file: &File,
    header: &[u8],
    entries: impl Iterator<Item = &'a Entry>,
) -> Result<()> {
    let io = |e| Error::io(path, e);
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    failpoint::check(Site::SaveWrite, path)?;
    out.write_all(&(header.len() as u64).to_le_bytes()).map_err(io)?;
    out.write_all(header).map_err(io)?;
    for e in entries {
        // Not an access: a save neither promotes tensors nor reorders the working set.
        let bytes = store.read_quiet(e.id)?;
        if bytes.len() != e.bytes {
            return Err(Error::InvalidArgument(format!(
                "tensor {} changed size while it was saved to {}",
                e.id,
                path.display()
            )));
        }
        failpoint::check(Site::SaveWrite, path)?;
        out.write_all(&bytes).map_err(io)?;
    }
    out.flush().map_err(io)
}

/// Removes temporary files of `name`'s saves whose process is gone (killed between the link and
/// the rename).
fn remove_stale(dir: &Path, name: &str) {
    // Without /proc no process can be told gone: leave everything.
    if !Path::new("/proc/self").is_dir() {
        return;
    }
    let prefix = format!(".{name}.strata-");
    let Ok(list) = std::fs::read_dir(dir) else { return };
    for e in list.flatten() {
        let file = e.file_name();
        let Some(rest) = file.to_str().and_then(|f| f.strip_prefix(&prefix)) else { continue };
        let Some(pid) = rest.strip_suffix(".tmp").and_then(|r| r.split('-').next()) else {
            continue;
        };
        let Ok(pid) = pid.parse::<u32>() else { continue };
        if pid != std::process::id() && !PathBuf::from(format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}
