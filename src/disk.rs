//! The disk tier: one slab file holding spilled tensors.
//!
//! A [`DiskTier`] owns one file, `strata-<pid>-<n>.slab`, sized (sparse) once to the tier's
//! capacity and sub-allocated by an [`ExtentAllocator`] in 4096-byte aligned extents. Writes are
//! `pwrite`s. Where the file system allows it the file is opened a second time with `O_DIRECT`,
//! and reads and writes bypass the page cache, through an aligned bounce buffer when the caller's
//! buffer is not aligned; elsewhere (tmpfs on older kernels, for instance) writes are buffered and
//! reads copy from a read-only mapping of the file. Each extent carries a crc32 of its bytes, set
//! on write and checked on read.
//!
//! ## Safety
//! The file is mapped once with `memmap2::Mmap::map`, which is unsafe because reading a mapping
//! past the end of a file that has shrunk raises `SIGBUS`, and because Rust assumes the bytes
//! behind a `&[u8]` do not change while it lives. Both hold here: the file is created by this
//! module (`create_new`, under a name made of the pid and a counter), is private to the store, is
//! sized once before it is mapped and never truncated while mapped; and slices of the mapping live
//! only inside [`DiskTier::read`], which holds `&mut self`, so no write of this tier runs while
//! one exists. Another process truncating or writing the file would break this; the store does
//! not defend against that.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::Mmap;

use crate::alloc::ExtentAllocator;
use crate::error::{Error, Result};

/// Alignment of extents and of the file length; also what `O_DIRECT` needs of buffer addresses,
/// file offsets and lengths.
const ALIGN: usize = 4096;
/// Largest piece moved through the bounce buffer at once.
const PIECE: usize = 8 << 20;

/// Numbers slab files so that several tiers of one process never share a name.
static NEXT_SLAB: AtomicU64 = AtomicU64::new(0);

/// `n` rounded up to a multiple of [`ALIGN`] (`n` is at most [`PIECE`] or a slice length).
fn round_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// One tensor's bytes in the slab. Not `Clone`: exactly one owner, who gives it back with
/// [`DiskTier::free`].
#[derive(Debug)]
pub(crate) struct DiskExtent {
    /// Byte offset in the slab file (a multiple of 4096).
    pub(crate) offset: u64,
    /// Length of the tensor in bytes (the reserved space is this rounded up to 4096).
    pub(crate) bytes: u64,
    /// crc32 of the bytes last written.
    crc: u32,
}

/// A heap buffer from which a 4096-aligned slice is cut (a `Vec<u8>` is only byte aligned).
#[derive(Default)]
struct Bounce(Vec<u8>);

impl Bounce {
    /// An aligned slice of `len` bytes, growing the buffer when it is too small.
    fn get(&mut self, len: usize) -> &mut [u8] {
        let need = len.saturating_add(ALIGN);
        if self.0.len() < need {
            self.0 = vec![0; need];
        }
        let skip = (ALIGN - self.0.as_ptr() as usize % ALIGN) % ALIGN;
        &mut self.0[skip..skip + len]
    }
}

/// The disk tier: a slab file, its allocator, its mapping and (maybe) an `O_DIRECT` handle.
pub(crate) struct DiskTier {
    /// The slab file.
    path: PathBuf,
    /// Buffered read-write handle.
    file: File,
    /// `O_DIRECT` handle, `None` where the file system refuses it.
    direct: Option<File>,
    /// Read-only mapping of the whole file (see the module's Safety section).
    map: Mmap,
    /// Extents of the file.
    alloc: ExtentAllocator,
    /// Aligned staging buffer for `O_DIRECT` I/O of unaligned buffers.
    bounce: Bounce,
    /// The temporary directory holding the file when none was given; removed on drop (last
    /// field, so it goes after the file handles and the mapping).
    _tmp: Option<tempfile::TempDir>,
}

impl DiskTier {
    /// Opens a new slab file `strata-<pid>-<counter>.slab` in `dir` (created if missing) or, when
    /// `dir` is `None`, in a fresh temporary directory removed on drop; the slab file is removed
    /// on drop too. `capacity` (> 0) is rounded up to 4096. Uses `O_DIRECT` where available.
    pub(crate) fn open(dir: Option<&Path>, capacity: u64) -> Result<DiskTier> {
        Self::open_with(dir, capacity, true)
    }

    /// [`DiskTier::open`], trying `O_DIRECT` only when `try_direct`.
    pub(crate) fn open_with(
        dir: Option<&Path>,
        capacity: u64,
        try_direct: bool,
    ) -> Result<DiskTier> {
        let len = capacity
            .checked_next_multiple_of(ALIGN as u64)
            .filter(|&l| l > 0 && isize::try_from(l).is_ok())
            .ok_or_else(|| Error::InvalidArgument(format!("bad disk tier capacity {capacity}")))?;
        let (tmp, dir) = match dir {
            Some(d) => {
                std::fs::create_dir_all(d).map_err(|e| Error::io(d, e))?;
                (None, d.to_path_buf())
            }
            None => {
                let t = tempfile::Builder::new()
                    .prefix("strata-")
                    .tempdir()
                    .map_err(|e| Error::io(std::env::temp_dir(), e))?;
                let d = t.path().to_path_buf();
                (Some(t), d)
            }
        };
        let n = NEXT_SLAB.fetch_add(1, Ordering::Relaxed);
        let path = dir.join(format!("strata-{}-{n}.slab", std::process::id()));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(|e| Error::io(&path, e))?;
        let sized = file.set_len(len).and_then(|()| {
            // SAFETY: the file was just created by this function under a fresh name, is private
            // to the store, and is never truncated while mapped (module docs, ## Safety).
            unsafe { Mmap::map(&file) }
        });
        let map = match sized {
            Ok(map) => map,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(Error::io(&path, e));
            }
        };
        let mut tier = DiskTier {
            alloc: ExtentAllocator::new(len, ALIGN as u64),
            path,
            file,
            direct: None,
            map,
            bounce: Bounce::default(),
            _tmp: tmp,
        };
        if try_direct {
            tier.direct = tier.open_direct();
        }
        Ok(tier)
    }

    /// A handle that reads the slab from other threads (the engine's disk workers), without the
    /// store's lock.
    pub(crate) fn reader(&self) -> Result<DiskReader> {
        let dup = |f: &File| f.try_clone().map_err(|e| Error::io(&self.path, e));
        Ok(DiskReader {
            buffered: dup(&self.file)?,
            direct: self.direct.as_ref().map(dup).transpose()?,
            path: self.path.clone(),
        })
    }

    /// Opens the slab with `O_DIRECT`; `None` where the file system refuses it.
    fn open_direct(&mut self) -> Option<File> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&self.path)
            .ok()?;
        // Some file systems accept the flag and refuse the I/O: probe with one aligned read.
        f.read_exact_at(self.bounce.get(ALIGN), 0).ok()?;
        Some(f)
    }

    /// Reserves room for `bytes` bytes; `None` when there is no room now.
    pub(crate) fn alloc(&mut self, bytes: u64) -> Option<DiskExtent> {
        let offset = self.alloc.alloc(bytes)?;
        Some(DiskExtent { offset, bytes, crc: crc32fast::hash(&[]) })
    }

    /// Gives an extent back.
    pub(crate) fn free(&mut self, ext: DiskExtent) {
        self.alloc.free(ext.offset, ext.bytes);
    }

    /// Checks that a buffer of `len` bytes fits `ext` and that `ext` lies inside the slab.
    fn check(&self, ext: &DiskExtent, len: usize, what: &str) -> Result<()> {
        if len as u64 != ext.bytes {
            return Err(Error::LengthMismatch {
                expected: ext.bytes,
                got: len as u64,
                what: what.to_string(),
            });
        }
        let end = ext.offset.checked_add(self.alloc.reserved_size(ext.bytes));
        if ext.offset % ALIGN as u64 != 0 || !matches!(end, Some(e) if e <= self.map.len() as u64) {
            return Err(Error::InvalidArgument(format!(
                "disk extent {}+{} lies outside the slab {}",
                ext.offset,
                ext.bytes,
                self.path.display()
            )));
        }
        Ok(())
    }

    /// Whether `e` is `O_DIRECT` refused after all (EINVAL); then I/O goes buffered for good and
    /// the caller retries.
    fn refused(&mut self, e: &io::Error) -> bool {
        let refused = self.direct.is_some() && e.raw_os_error() == Some(libc::EINVAL);
        if refused {
            self.direct = None;
        }
        refused
    }

    /// Writes `data` (`data.len() == ext.bytes`) at the extent and records its crc.
    pub(crate) fn write(&mut self, ext: &mut DiskExtent, data: &[u8]) -> Result<()> {
        self.check(ext, data.len(), "disk tier write")?;
        let res = match &self.direct {
            Some(d) => write_direct(d, &mut self.bounce, ext.offset, data),
            None => self.file.write_all_at(data, ext.offset),
        };
        if let Err(e) = res {
            return if self.refused(&e) {
                self.write(ext, data)
            } else {
                Err(Error::io(&self.path, e))
            };
        }
        ext.crc = crc32fast::hash(data);
        Ok(())
    }

    /// Copies the extent's bytes into `out` (`out.len() == ext.bytes`) and checks the crc:
    /// `Ok(Err(found))` on a mismatch, `Err` on an I/O error.
    pub(crate) fn read(
        &mut self,
        ext: &DiskExtent,
        out: &mut [u8],
    ) -> Result<std::result::Result<(), u32>> {
        self.check(ext, out.len(), "disk tier read")?;
        let res = match &self.direct {
            Some(d) => read_direct(d, &mut self.bounce, ext.offset, out),
            None => {
                let start = ext.offset as usize; // check(): inside the map, so it fits usize
                let src = self.map.get(start..start + out.len());
                src.map(|src| out.copy_from_slice(src)).ok_or(io::ErrorKind::UnexpectedEof.into())
            }
        };
        if let Err(e) = res {
            return if self.refused(&e) {
                self.read(ext, out)
            } else {
                Err(Error::io(&self.path, e))
            };
        }
        let found = crc32fast::hash(out);
        Ok(if found == ext.crc { Ok(()) } else { Err(found) })
    }

    /// Checks that `len` bytes at `off` lie inside `ext` and that `off` is 4096-aligned.
    fn check_range(&self, ext: &DiskExtent, off: u64, len: usize) -> Result<()> {
        let inside = off.checked_add(len as u64).is_some_and(|end| end <= ext.bytes);
        if off % ALIGN as u64 != 0 || !inside {
            return Err(Error::InvalidArgument(format!(
                "range {off}+{len} of a disk extent of {} bytes",
                ext.bytes
            )));
        }
        // The extent itself must lie inside the slab (any length check passes for `ext.bytes`).
        self.check(ext, ext.bytes as usize, "disk tier range")
    }

    /// Reads `out.len()` bytes at `off` (a multiple of 4096) inside the extent, without checking
    /// the crc: a caller reading a tensor piece by piece checks it over the whole.
    pub(crate) fn read_range(&mut self, ext: &DiskExtent, off: u64, out: &mut [u8]) -> Result<()> {
        self.check_range(ext, off, out.len())?;
        let at = ext.offset + off;
        let res = match &self.direct {
            Some(d) => read_direct(d, &mut self.bounce, at, out),
            None => {
                let start = at as usize; // check(): inside the map, so it fits usize
                let src = self.map.get(start..start + out.len());
                src.map(|src| out.copy_from_slice(src)).ok_or(io::ErrorKind::UnexpectedEof.into())
            }
        };
        match res {
            Ok(()) => Ok(()),
            Err(e) if self.refused(&e) => self.read_range(ext, off, out),
            Err(e) => Err(Error::io(&self.path, e)),
        }
    }

    /// Writes `data` at `off` (a multiple of 4096) inside the extent. The caller writes the whole
    /// tensor in order, then records the crc of all of it with [`DiskTier::set_crc`].
    pub(crate) fn write_range(
        &mut self,
        ext: &mut DiskExtent,
        off: u64,
        data: &[u8],
    ) -> Result<()> {
        self.check_range(ext, off, data.len())?;
        let at = ext.offset + off;
        let res = match &self.direct {
            Some(d) => write_direct(d, &mut self.bounce, at, data),
            None => self.file.write_all_at(data, at),
        };
        match res {
            Ok(()) => Ok(()),
            Err(e) if self.refused(&e) => self.write_range(ext, off, data),
            Err(e) => Err(Error::io(&self.path, e)),
        }
    }

    /// Records the crc of an extent written with [`DiskTier::write_range`].
    pub(crate) fn set_crc(ext: &mut DiskExtent, crc: u32) {
        ext.crc = crc;
    }

    /// The crc32 recorded when the extent was last written.
    pub(crate) fn expected_crc(ext: &DiskExtent) -> u32 {
        ext.crc
    }

    /// The slab file.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Whether I/O bypasses the page cache (`O_DIRECT`).
    pub(crate) fn direct_io(&self) -> bool {
        self.direct.is_some()
    }

    /// Bytes the tier can hold: the capacity asked for, rounded up to 4096.
    pub(crate) fn capacity(&self) -> u64 {
        self.alloc.len()
    }

    /// Bytes reserved by live extents (each rounded up to 4096).
    pub(crate) fn used(&self) -> u64 {
        self.alloc.used()
    }

    /// Free ranges of the slab (fragmentation).
    pub(crate) fn free_ranges(&self) -> usize {
        self.alloc.free_ranges()
    }

    /// The largest extent that can be allocated now.
    pub(crate) fn largest_free(&self) -> u64 {
        self.alloc.largest_free()
    }
}

/// Reads the slab file from any thread: `O_DIRECT` into aligned buffers where the tier uses it,
/// buffered otherwise.
pub(crate) struct DiskReader {
    buffered: File,
    direct: Option<File>,
    path: PathBuf,
}

impl DiskReader {
    /// Fills `buf` from byte `offset` of the file. With `O_DIRECT`, `offset`, `buf`'s address and
    /// its length must be multiples of 4096 (the engine's staging buffers and piece sizes are);
    /// otherwise the read goes through the page cache.
    pub(crate) fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        let aligned = offset % ALIGN as u64 == 0
            && buf.as_ptr() as usize % ALIGN == 0
            && buf.len() % ALIGN == 0;
        let f = match &self.direct {
            Some(d) if aligned => d,
            _ => &self.buffered,
        };
        match f.read_exact_at(buf, offset) {
            Ok(()) => Ok(()),
            // A file system that took the flag but refuses this read: go through the cache.
            Err(e)
                if e.raw_os_error() == Some(libc::EINVAL) && !std::ptr::eq(f, &self.buffered) =>
            {
                self.buffered.read_exact_at(buf, offset).map_err(|e| Error::io(&self.path, e))
            }
            Err(e) => Err(Error::io(&self.path, e)),
        }
    }

    /// The slab file.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }
}

/// `O_DIRECT` write of `data` at `offset` (aligned) through the bounce buffer, in pieces of at
/// most [`PIECE`] bytes, the last padded with zeros to 4096 (inside the extent's reserved size).
fn write_direct(f: &File, bounce: &mut Bounce, offset: u64, data: &[u8]) -> io::Result<()> {
    for (i, piece) in data.chunks(PIECE).enumerate() {
        let buf = bounce.get(round_up(piece.len()));
        let (head, tail) = buf.split_at_mut(piece.len());
        head.copy_from_slice(piece);
        tail.fill(0);
        f.write_all_at(buf, offset + (i * PIECE) as u64)?;
    }
    Ok(())
}

/// `O_DIRECT` read into `out` from `offset` (aligned): straight into `out` when it is aligned in
/// address and length, else through the bounce buffer in pieces of at most [`PIECE`] bytes.
fn read_direct(f: &File, bounce: &mut Bounce, offset: u64, out: &mut [u8]) -> io::Result<()> {
    if out.as_ptr() as usize % ALIGN == 0 && out.len() % ALIGN == 0 {
        return f.read_exact_at(out, offset);
    }
    for (i, piece) in out.chunks_mut(PIECE).enumerate() {
        let buf = bounce.get(round_up(piece.len()));
        f.read_exact_at(buf, offset + (i * PIECE) as u64)?;
        piece.copy_from_slice(&buf[..piece.len()]);
    }
    Ok(())
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

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
    /// Opens and maps `path` read-only.
    pub(crate) fn open(path: &Path) -> Result<ExternalFile> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: a read-only private mapping of the user's file; see the type's Safety section
        // for the caller's side (the file is not truncated or rewritten while loaded).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let direct = OpenOptions::new().read(true).custom_flags(libc::O_DIRECT).open(path).ok();
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `len` pseudo-random bytes (xorshift).
    fn random(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// One tier trying O_DIRECT (it succeeds unless the temp dir refuses it) and one buffered.
    fn both(capacity: u64) -> [DiskTier; 2] {
        let buffered = DiskTier::open_with(None, capacity, false).unwrap();
        assert!(!buffered.direct_io());
        [DiskTier::open(None, capacity).unwrap(), buffered]
    }

    #[test]
    fn round_trips_odd_sizes() {
        for mut t in both(64 << 20) {
            let sizes = [1, 4095, 4096, 4097, (3 << 20) + 5, (17 << 20) + 3, 0];
            let mut exts = Vec::new();
            for (i, &n) in sizes.iter().enumerate() {
                let data = random(n, i as u64);
                let mut e = t.alloc(n as u64).unwrap();
                t.write(&mut e, &data).unwrap();
                exts.push((e, data));
            }
            for (e, data) in &exts {
                let mut out = vec![0; data.len()];
                assert_eq!(t.read(e, &mut out).unwrap(), Ok(()));
                assert_eq!(&out, data);
            }
            // An aligned buffer of aligned length: read straight into it under O_DIRECT.
            let (e, data) = &exts[2];
            let mut big = Bounce::default();
            let out = big.get(4096);
            assert_eq!(t.read(e, out).unwrap(), Ok(()));
            assert_eq!(out, &data[..]);
            let e = &mut exts[0].0;
            assert!(matches!(t.write(e, &[0; 2]), Err(Error::LengthMismatch { .. })));
            assert!(matches!(t.read(e, &mut [0; 2]), Err(Error::LengthMismatch { .. })));
            let bogus = DiskExtent { offset: u64::MAX - 4095, bytes: 1, crc: 0 };
            assert!(matches!(t.read(&bogus, &mut [0]), Err(Error::InvalidArgument(_))));
            for (e, _) in exts {
                t.free(e);
            }
            assert_eq!(t.used(), 0);
        }
    }

    #[test]
    fn flipped_byte_is_caught() {
        for mut t in both(1 << 20) {
            let (da, db) = (random(10_000, 1), random(5_000, 2));
            let (mut a, mut b) = (t.alloc(10_000).unwrap(), t.alloc(5_000).unwrap());
            t.write(&mut a, &da).unwrap();
            t.write(&mut b, &db).unwrap();
            assert_eq!(DiskTier::expected_crc(&a), crc32fast::hash(&da));
            let f = OpenOptions::new().read(true).write(true).open(t.path()).unwrap();
            let mut byte = [0u8];
            f.read_exact_at(&mut byte, a.offset + 7777).unwrap();
            f.write_all_at(&[byte[0] ^ 0x10], a.offset + 7777).unwrap();
            let mut out = vec![0; 10_000];
            let found = t.read(&a, &mut out).unwrap().unwrap_err();
            assert_ne!(found, DiskTier::expected_crc(&a));
            let mut out = vec![0; 5_000];
            assert_eq!(t.read(&b, &mut out).unwrap(), Ok(()));
            assert_eq!(out, db);
        }
    }

    #[test]
    fn free_reuses_space_and_capacity_runs_out() {
        for mut t in both(5 * 4096 - 100) {
            assert_eq!(t.capacity(), 5 * 4096);
            let a = t.alloc(3 * 4096).unwrap();
            let b = t.alloc(2 * 4096).unwrap();
            assert!(t.alloc(1).is_none());
            assert_eq!(t.largest_free(), 0);
            let off = a.offset;
            t.free(a);
            assert_eq!(t.used(), 2 * 4096);
            let mut c = t.alloc(3 * 4096 - 7).unwrap();
            assert_eq!(c.offset, off);
            assert!(t.alloc(1).is_none());
            let data = random(3 * 4096 - 7, 3);
            t.write(&mut c, &data).unwrap();
            let mut out = vec![0; data.len()];
            assert_eq!(t.read(&c, &mut out).unwrap(), Ok(()));
            assert_eq!(out, data);
            t.free(b);
            t.free(c);
            assert_eq!((t.used(), t.largest_free()), (0, 5 * 4096));
        }
        assert!(DiskTier::open(None, 0).is_err());
        assert!(DiskTier::open(None, u64::MAX).is_err());
    }

    #[test]
    fn open_errors_name_the_path_and_drop_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("plain");
        std::fs::write(&plain, b"x").unwrap();
        let bad = plain.join("x");
        match DiskTier::open(Some(&bad), 4096) {
            Err(Error::Io { path, .. }) => assert_eq!(path, bad),
            Err(e) => panic!("wrong error {e}"),
            Ok(_) => panic!("opened under a regular file"),
        }
        let user = dir.path().join("a/b");
        let t = DiskTier::open(Some(&user), 4096).unwrap();
        let slab = t.path().to_path_buf();
        let name = slab.file_name().unwrap().to_str().unwrap();
        assert!(name.starts_with(&format!("strata-{}-", std::process::id())));
        assert!(name.ends_with(".slab") && slab.starts_with(&user) && slab.exists());
        drop(t);
        assert!(!slab.exists() && user.exists());
        let t = DiskTier::open(None, 4096).unwrap();
        let tmp = t.path().parent().unwrap().to_path_buf();
        assert!(tmp.exists());
        drop(t);
        assert!(!tmp.exists());
    }
}
