//! A user's tensor file (safetensors) that the Disk tier refers to in place.

use std::fs::{File, FileType, OpenOptions};
use std::io::Read as _;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::base::error::{Error, Result};
use crate::tiers::disk::ALIGN;

/// A user's file of tensors (safetensors), mapped read-only so that tensors can live in it in
/// place: the Disk tier refers to the bytes without copying them, and nothing ever writes the
/// file.
///
/// ## Safety
/// Mapping a file the store did not create is sound only while nobody truncates or rewrites it:
/// reading a mapping past the end of a shrunk file raises `SIGBUS`, and Rust assumes the bytes
/// behind the `&[u8]` this type hands out do not change. The store cannot enforce that for a
/// user's file; [`Store::load_safetensors`](crate::Store::load_safetensors) documents it as the
/// caller's side of the contract (the same one every mmap-based loader, such as `safetensors`'
/// own examples, asks for).
pub(crate) struct ExternalFile {
    path: PathBuf,
    /// The whole file, for parsing the header.
    map: Mmap,
    /// Reads of tensor bytes go through `pread`, not the mapping, so that copying a large
    /// file does not leave its pages mapped into the process (and counted in its RSS).
    file: File,
    /// The same file opened with `O_DIRECT` where the file system allows it.
    direct: Option<File>,
}

impl std::fmt::Debug for ExternalFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExternalFile")
            .field("path", &self.path)
            .field("len", &self.map.len())
            .finish()
    }
}

impl ExternalFile {
    /// Opens and maps `path` read-only; anything but a regular file is [`Error::NotAFile`]
    /// ([`open_regular`]).
    pub(crate) fn open(path: &Path) -> Result<ExternalFile> {
        let file = open_regular(path, 0)?;
        // SAFETY: a read-only private mapping of the user's file; see the type's Safety section
        // for the caller's side (the file is not truncated or rewritten while loaded).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        // The same file again (the path could name another by now: then no O_DIRECT handle).
        let direct = open_regular(path, libc::O_DIRECT).ok().filter(|d| same_file(d, &file));
        Ok(ExternalFile { path: path.to_path_buf(), map, file, direct })
    }

    /// The whole file.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.map
    }

    /// The file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Copies `buf.len()` bytes from `offset`: with `O_DIRECT` when the offset, the buffer's
    /// address and its length are 4096-aligned (a staging buffer reading a tensor that starts on
    /// a page), else with a buffered `pread`.
    pub(crate) fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let end = offset.checked_add(buf.len() as u64).filter(|&e| e <= self.map.len() as u64);
        let Some(end) = end else {
            return Err(Error::InvalidArgument(format!(
                "read of {} bytes at {offset} past the end of {}",
                buf.len(),
                self.path.display()
            )));
        };
        crate::base::failpoint::check(crate::base::failpoint::Site::FileRead, &self.path)?;
        let aligned = offset % ALIGN as u64 == 0
            && buf.as_ptr() as usize % ALIGN == 0
            && buf.len() % ALIGN == 0;
        if let (Some(d), true) = (&self.direct, aligned) {
            if d.read_exact_at(buf, offset).is_ok() {
                return Ok(());
            }
        }
        debug_assert!(end <= self.map.len() as u64);
        self.file.read_exact_at(buf, offset).map_err(|e| Error::io(&self.path, e))
    }
}

/// Bytes an unprivileged process may still write on the file system holding `dir`
/// (`statvfs`'s `f_bavail × f_frsize`; [`crate::disk_space_available`]).
pub(crate) fn free_space(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path that lives across the call; `st` is a properly
    // sized and aligned buffer that statvfs fills when it returns 0.
    let rc = unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: statvfs returned 0, so it initialised `st`.
    let st = unsafe { st.assume_init() };
    // Both are u64 on 64-bit Linux, narrower on some 32-bit targets.
    #[allow(clippy::useless_conversion)]
    let (avail, frsize) = (u64::from(st.f_bavail), u64::from(st.f_frsize));
    Ok(avail.saturating_mul(frsize))
}

/// Ignores `SIGXFSZ` in the whole process ([`crate::ignore_file_size_signal`]).
pub(crate) fn ignore_sigxfsz() -> std::io::Result<()> {
    // SAFETY: `signal` with `SIG_IGN` installs no handler code that could run in a signal
    // context; it only sets the process's disposition of SIGXFSZ, which is what the caller
    // asks for.
    let previous = unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    if previous == libc::SIG_ERR {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// What a file of type `t` is, in words, when it is not a regular file.
fn irregular(t: &FileType) -> Option<&'static str> {
    Some(if t.is_file() {
        return None;
    } else if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "not a regular file"
    })
}

/// Refuses `path` unless it names a regular file (following symlinks), without opening it:
/// [`Error::NotAFile`] saying what it is, or [`Error::Io`] when it cannot be looked at.
pub(crate) fn check_regular(path: &Path) -> Result<std::fs::Metadata> {
    let md = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    match irregular(&md.file_type()) {
        None => Ok(md),
        Some(what) => Err(Error::NotAFile { path: path.to_path_buf(), what }),
    }
}

/// Whether two open files are the same file.
fn same_file(a: &File, b: &File) -> bool {
    match (a.metadata(), b.metadata()) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

/// Opens the regular file at `path` for reading (with `flags` added, such as `O_DIRECT`), and
/// refuses anything else before a byte is read: a directory, a FIFO, a socket or a device is
/// [`Error::NotAFile`].
///
/// The path is looked at first, and a path that is not a regular file is never opened (opening
/// a FIFO blocks until a writer comes; a device may have side effects). The open itself is
/// non-blocking, and the opened file must be the regular file that was looked at, so that a
/// path swapped for a FIFO in between cannot block either. (`O_NONBLOCK` does nothing to reads
/// of a regular file.)
pub(crate) fn open_regular(path: &Path, flags: libc::c_int) -> Result<File> {
    let before = check_regular(path)?;
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY | flags)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
    let now = file.metadata().map_err(|e| Error::io(path, e))?;
    if let Some(what) = irregular(&now.file_type()) {
        return Err(Error::NotAFile { path: path.to_path_buf(), what });
    }
    if (now.dev(), now.ino()) != (before.dev(), before.ino()) {
        return Err(Error::io(
            path,
            std::io::Error::other("the file was replaced while it was being opened"),
        ));
    }
    Ok(file)
}

/// The whole of the regular file at `path` ([`open_regular`]).
pub(crate) fn read_regular(path: &Path) -> Result<Vec<u8>> {
    let mut file = open_regular(path, 0)?;
    let mut out = Vec::new();
    file.read_to_end(&mut out).map_err(|e| Error::io(path, e))?;
    Ok(out)
}

/// Gives `file`, opened unnamed (`O_TMPFILE` without `O_EXCL`), the name `at` (which must not
/// exist), on the same file system.
pub(crate) fn link_unnamed(file: &File, at: &Path) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    use std::os::unix::ffi::OsStrExt;
    let from = std::ffi::CString::new(format!("/proc/self/fd/{}", file.as_raw_fd()))?;
    let to = std::ffi::CString::new(at.as_os_str().as_bytes())?;
    // SAFETY: both arguments are NUL-terminated strings that live across the call, which only
    // reads them; `file` stays open (its descriptor valid) for the call's duration.
    let rc = unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
