//! The disk tier: one slab file holding spilled tensors.
//!
//! A [`DiskSlab`] owns one file, created unlinked in the tier's directory (`O_TMPFILE`, or created
//! and removed at once where the file system lacks it), so it cannot outlive the process: a crash
//! or `kill -9` leaves nothing behind, and no name can collide with a stale file of an earlier
//! run. It is sized (sparse) to the tier's capacity and sub-allocated in 4096-byte aligned
//! extents by an allocator kept under the store's lock. Reads and writes are `pread` / `pwrite`,
//! which any thread may issue at once on different extents; where the file system allows it the
//! file is reopened with `O_DIRECT` (through `/proc/self/fd`) and I/O bypasses the page cache,
//! through an aligned per-thread bounce buffer when the caller's buffer is not aligned. Each
//! extent carries a crc32 of its bytes, set on write and checked on read.

use std::cell::RefCell;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::base::error::{Error, Result};
use crate::tiers::alloc::ExtentAllocator;

/// Alignment of extents and of the file length; also what `O_DIRECT` needs of buffer addresses,
/// file offsets and lengths.
pub(crate) const ALIGN: usize = 4096;
/// Largest piece moved through the bounce buffer at once.
const PIECE: usize = 8 << 20;

/// `n` rounded up to a multiple of [`ALIGN`].
fn round_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// A heap buffer from which a 4096-aligned slice is cut (a `Vec<u8>` is only byte aligned).
#[derive(Default)]
pub(crate) struct Bounce(Vec<u8>);

impl Bounce {
    /// An aligned slice of `len` bytes, growing the buffer when it is too small.
    pub(crate) fn get(&mut self, len: usize) -> &mut [u8] {
        let need = len.saturating_add(ALIGN);
        if self.0.len() < need {
            self.0 = vec![0; need];
        }
        let skip = (ALIGN - self.0.as_ptr() as usize % ALIGN) % ALIGN;
        &mut self.0[skip..skip + len]
    }
}

thread_local! {
    /// Each thread's bounce buffer for `O_DIRECT` I/O of unaligned buffers.
    static BOUNCE: RefCell<Bounce> = RefCell::new(Bounce::default());
}

/// Where one tensor's bytes are in the slab, as a plain value for I/O without the store's lock
/// (the extent itself, the ownership token, stays with the tensor).
#[derive(Clone, Copy, Debug)]
pub(crate) struct DiskRange {
    /// Byte offset in the slab (a multiple of 4096).
    pub(crate) offset: u64,
    /// Length of the tensor in bytes.
    pub(crate) bytes: u64,
}

/// The disk tier's file: an unlinked slab, its length, and (maybe) an `O_DIRECT` handle.
pub(crate) struct DiskSlab {
    /// The directory asked for; errors name it, since the file itself has no name.
    dir: PathBuf,
    /// Buffered read-write handle.
    file: File,
    /// `O_DIRECT` handle, `None` where the file system refuses it.
    direct: Option<File>,
    /// Cleared when the file system turns out to refuse `O_DIRECT` I/O after all.
    direct_ok: AtomicBool,
    len: u64,
}

impl std::fmt::Debug for DiskSlab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskSlab").field("dir", &self.dir).field("len", &self.len).finish()
    }
}

impl DiskSlab {
    /// Creates an unlinked slab file of `capacity` (> 0, rounded up to 4096) bytes in `dir`
    /// (created if missing; the system's temporary directory when `None`), and the allocator of
    /// its extents. Uses `O_DIRECT` where available when `try_direct`.
    pub(crate) fn open(
        dir: Option<&Path>,
        capacity: u64,
        try_direct: bool,
    ) -> Result<(DiskSlab, ExtentAllocator)> {
        let len = capacity
            .checked_next_multiple_of(ALIGN as u64)
            .filter(|&l| l > 0 && i64::try_from(l).is_ok())
            .ok_or_else(|| Error::InvalidArgument(format!("bad disk tier capacity {capacity}")))?;
        let dir = match dir {
            Some(d) => {
                if d.exists() && !d.is_dir() {
                    return Err(Error::io(
                        d,
                        io::Error::new(io::ErrorKind::NotADirectory, "not a directory"),
                    ));
                }
                std::fs::create_dir_all(d).map_err(|e| Error::io(d, e))?;
                d.to_path_buf()
            }
            None => std::env::temp_dir(),
        };
        let file = tempfile::tempfile_in(&dir).map_err(|e| Error::io(&dir, e))?;
        file.set_len(len).map_err(|e| Error::io(&dir, e))?;
        let mut slab = DiskSlab { dir, file, direct: None, direct_ok: AtomicBool::new(false), len };
        if try_direct {
            slab.direct = slab.open_direct();
            slab.direct_ok.store(slab.direct.is_some(), Ordering::Relaxed);
        }
        Ok((slab, ExtentAllocator::new(len, ALIGN as u64)))
    }

    /// A second handle on the slab for the write reserve's books ([`SlabBacking`]).
    pub(crate) fn backing(&self) -> io::Result<SlabBacking> {
        Ok(SlabBacking { file: self.file.try_clone()?, name: self.name() })
    }

    /// Reopens the slab with `O_DIRECT`; `None` where the file system refuses it.
    fn open_direct(&self) -> Option<File> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(self.fd_path())
            .ok()?;
        // Some file systems accept the flag and refuse the I/O: probe with one aligned read.
        BOUNCE.with(|b| f.read_exact_at(b.borrow_mut().get(ALIGN), 0)).ok()?;
        Some(f)
    }

    /// A path that names the open (unlinked) file from this process: `/proc/self/fd/N`. For
    /// diagnostics and tests that look at the bytes on disk.
    pub(crate) fn fd_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
    }

    /// What errors name: the directory and that the file is the store's unlinked slab.
    pub(crate) fn name(&self) -> PathBuf {
        self.dir.join("<strata disk tier slab, unlinked>")
    }

    /// Whether I/O bypasses the page cache (`O_DIRECT`).
    pub(crate) fn direct_io(&self) -> bool {
        self.direct_ok.load(Ordering::Relaxed)
    }

    fn direct(&self) -> Option<&File> {
        self.direct.as_ref().filter(|_| self.direct_io())
    }

    /// Whether `e` is `O_DIRECT` refused after all (EINVAL); then I/O goes buffered for good and
    /// the caller retries.
    fn refused(&self, e: &io::Error) -> bool {
        let refused = self.direct_io() && e.raw_os_error() == Some(libc::EINVAL);
        if refused {
            self.direct_ok.store(false, Ordering::Relaxed);
        }
        refused
    }

    /// Checks that `len` bytes at `off` inside `r` lie inside the slab, `off` aligned.
    fn check(&self, r: DiskRange, off: u64, len: usize) -> Result<u64> {
        let inside = off.checked_add(len as u64).is_some_and(|end| end <= r.bytes);
        let reserved = r.bytes.max(1).next_multiple_of(ALIGN as u64);
        let in_slab = r.offset.checked_add(reserved).is_some_and(|e| e <= self.len);
        if !inside || !in_slab || r.offset % ALIGN as u64 != 0 || off % ALIGN as u64 != 0 {
            return Err(Error::InvalidArgument(format!(
                "range {off}+{len} of disk extent {}+{} outside the slab of {} bytes",
                r.offset, r.bytes, self.len
            )));
        }
        Ok(r.offset + off)
    }

    /// Writes `data` at `off` (a multiple of 4096) inside extent `r`.
    pub(crate) fn write_range(&self, r: DiskRange, off: u64, data: &[u8]) -> Result<()> {
        let at = self.check(r, off, data.len())?;
        crate::base::failpoint::check(crate::base::failpoint::Site::DiskWrite, &self.name())?;
        let res = match self.direct() {
            Some(d) => write_direct(d, at, data),
            None => self.file.write_all_at(data, at),
        };
        match res {
            Ok(()) => Ok(()),
            Err(e) if self.refused(&e) => self.write_range(r, off, data),
            Err(e) => Err(Error::io(self.name(), e)),
        }
    }

    /// Writes a whole extent and returns the crc32 of `data` (`data.len() == r.bytes`).
    pub(crate) fn write(&self, r: DiskRange, data: &[u8]) -> Result<u32> {
        if data.len() as u64 != r.bytes {
            return Err(Error::LengthMismatch {
                expected: r.bytes,
                got: data.len() as u64,
                what: "disk tier write".into(),
            });
        }
        self.write_range(r, 0, data)?;
        Ok(crc32fast::hash(data))
    }

    /// Reads `out.len()` bytes at `off` (a multiple of 4096) inside extent `r`, without checking
    /// the crc: a caller reading a tensor piece by piece checks it over the whole.
    pub(crate) fn read_range(&self, r: DiskRange, off: u64, out: &mut [u8]) -> Result<()> {
        let at = self.check(r, off, out.len())?;
        crate::base::failpoint::check(crate::base::failpoint::Site::DiskRead, &self.name())?;
        let res = match self.direct() {
            Some(d) => read_direct(d, at, out),
            None => self.file.read_exact_at(out, at),
        };
        match res {
            Ok(()) => Ok(()),
            Err(e) if self.refused(&e) => self.read_range(r, off, out),
            Err(e) => Err(Error::io(self.name(), e)),
        }
    }

    /// Reads a whole extent into `out` (`out.len() == r.bytes`) and returns the crc32 of what
    /// was read (the caller compares it with the one recorded at write).
    pub(crate) fn read(&self, r: DiskRange, out: &mut [u8]) -> Result<u32> {
        if out.len() as u64 != r.bytes {
            return Err(Error::LengthMismatch {
                expected: r.bytes,
                got: out.len() as u64,
                what: "disk tier read".into(),
            });
        }
        self.read_range(r, 0, out)?;
        Ok(crc32fast::hash(out))
    }
}

/// A handle on the slab that gives ranges of it blocks of the file system (`fallocate`), so
/// that a write there cannot fail for want of space: the slab is sparse, and without this a
/// full file system refuses writes into ranges the books count as free. The write reserve backs
/// its range with it as it is taken, so that the overwrite it promises succeeds on a full file
/// system (ext4, XFS, tmpfs: blocks allocated stay allocated, and writing over them needs no
/// new ones; a copy-on-write file system such as btrfs gives no such promise).
pub(crate) struct SlabBacking {
    file: File,
    name: PathBuf,
}

impl SlabBacking {
    /// Allocates file-system blocks for `len` bytes at `offset` of the slab (already allocated
    /// ones stay as they are, their bytes too). Where the file system has no `fallocate`, the
    /// range is written with zeros instead: the caller's range holds no tensor's bytes.
    pub(crate) fn back(&self, offset: u64, len: u64) -> Result<()> {
        let (Ok(off), Ok(n)) = (i64::try_from(offset), i64::try_from(len)) else {
            return Err(Error::InvalidArgument(format!("slab range {offset}+{len}")));
        };
        crate::base::failpoint::check(crate::base::failpoint::Site::DiskWrite, &self.name)?;
        // SAFETY: `fallocate` only reads its integer arguments; the descriptor is the open
        // slab file's, valid while `self.file` lives (across the call).
        let rc = unsafe { libc::fallocate(self.file.as_raw_fd(), 0, off, n) };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EOPNOTSUPP) {
            return Err(Error::io(&self.name, e));
        }
        let zeros = vec![0u8; PIECE.min(len as usize)];
        let mut at = 0u64;
        while at < len {
            let k = (len - at).min(zeros.len() as u64) as usize;
            self.file
                .write_all_at(&zeros[..k], offset + at)
                .map_err(|e| Error::io(&self.name, e))?;
            at += k as u64;
        }
        Ok(())
    }

    /// Blocks of the file system the slab holds, in bytes (`st_blocks`).
    #[cfg(test)]
    pub(crate) fn allocated(&self) -> u64 {
        use std::os::unix::fs::MetadataExt;
        self.file.metadata().map_or(0, |m| m.blocks() * 512)
    }
}

/// `O_DIRECT` write of `data` at `offset` (aligned) through the bounce buffer, in pieces of at
/// most [`PIECE`] bytes, the last padded with zeros to 4096 (inside the extent's reserved size).
fn write_direct(f: &File, offset: u64, data: &[u8]) -> io::Result<()> {
    BOUNCE.with(|b| {
        let mut bounce = b.borrow_mut();
        for (i, piece) in data.chunks(PIECE).enumerate() {
            let buf = bounce.get(round_up(piece.len()));
            let (head, tail) = buf.split_at_mut(piece.len());
            head.copy_from_slice(piece);
            tail.fill(0);
            f.write_all_at(buf, offset + (i * PIECE) as u64)?;
        }
        Ok(())
    })
}

/// `O_DIRECT` read into `out` from `offset` (aligned): straight into `out` when it is aligned in
/// address and length, else through the bounce buffer in pieces of at most [`PIECE`] bytes.
fn read_direct(f: &File, offset: u64, out: &mut [u8]) -> io::Result<()> {
    if out.as_ptr() as usize % ALIGN == 0 && out.len() % ALIGN == 0 {
        return f.read_exact_at(out, offset);
    }
    BOUNCE.with(|b| {
        let mut bounce = b.borrow_mut();
        for (i, piece) in out.chunks_mut(PIECE).enumerate() {
            let buf = bounce.get(round_up(piece.len()));
            f.read_exact_at(buf, offset + (i * PIECE) as u64)?;
            piece.copy_from_slice(&buf[..piece.len()]);
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(len: usize, seed: u64) -> Vec<u8> {
        crate::base::testutil::Rng::new(seed).bytes(len)
    }

    /// One slab trying O_DIRECT (it succeeds unless the temp dir refuses it) and one buffered.
    fn both(capacity: u64) -> [(DiskSlab, ExtentAllocator); 2] {
        let buffered = DiskSlab::open(None, capacity, false).unwrap();
        assert!(!buffered.0.direct_io());
        [DiskSlab::open(None, capacity, true).unwrap(), buffered]
    }

    fn range(a: &mut ExtentAllocator, n: u64) -> DiskRange {
        DiskRange { offset: a.alloc(n).unwrap(), bytes: n }
    }

    #[test]
    fn round_trips_odd_sizes() {
        for (t, mut a) in both(64 << 20) {
            let sizes = [1, 4095, 4096, 4097, (3 << 20) + 5, (17 << 20) + 3, 0];
            let mut exts = Vec::new();
            for (i, &n) in sizes.iter().enumerate() {
                let data = random(n, i as u64);
                let r = range(&mut a, n as u64);
                let crc = t.write(r, &data).unwrap();
                assert_eq!(crc, crc32fast::hash(&data));
                exts.push((r, data));
            }
            for (r, data) in &exts {
                let mut out = vec![0; data.len()];
                assert_eq!(t.read(*r, &mut out).unwrap(), crc32fast::hash(data));
                assert_eq!(&out, data);
            }
            // An aligned buffer of aligned length: read straight into it under O_DIRECT.
            let (r, data) = &exts[2];
            let mut big = Bounce::default();
            let out = big.get(4096);
            t.read(*r, out).unwrap();
            assert_eq!(out, &data[..]);
            let r = exts[0].0;
            assert!(matches!(t.write(r, &[0; 2]), Err(Error::LengthMismatch { .. })));
            assert!(matches!(t.read(r, &mut [0; 2]), Err(Error::LengthMismatch { .. })));
            let bogus = DiskRange { offset: u64::MAX - 4095, bytes: 1 };
            assert!(matches!(t.read(bogus, &mut [0]), Err(Error::InvalidArgument(_))));
        }
    }

    #[test]
    fn a_flipped_byte_changes_the_crc() {
        for (t, mut a) in both(1 << 20) {
            let d = random(10_000, 1);
            let r = range(&mut a, 10_000);
            let crc = t.write(r, &d).unwrap();
            let mut flipped = d.clone();
            flipped[1234] ^= 1;
            std::fs::OpenOptions::new()
                .write(true)
                .open(t.fd_path())
                .unwrap()
                .write_all_at(&flipped[1234..1235], r.offset + 1234)
                .unwrap();
            let mut out = vec![0; d.len()];
            assert_ne!(t.read(r, &mut out).unwrap(), crc);
        }
    }

    #[test]
    fn a_backed_range_holds_blocks_and_keeps_its_bytes() {
        let (t, mut a) = DiskSlab::open(None, 8 << 20, false).unwrap();
        let b = t.backing().unwrap();
        let before = b.allocated();
        let r = range(&mut a, 1 << 20);
        b.back(r.offset, 1 << 20).unwrap();
        assert!(b.allocated() >= before + (1 << 20), "{} -> {}", before, b.allocated());
        let d = random(1 << 20, 3);
        t.write(r, &d).unwrap();
        // Backing it again (the reserve made again in place) keeps what it holds.
        b.back(r.offset, 1 << 20).unwrap();
        let mut out = vec![0; d.len()];
        t.read(r, &mut out).unwrap();
        assert_eq!(out, d);
        assert!(b.back(u64::MAX, 1).is_err());
    }

    #[test]
    fn capacity_is_rounded_and_bad_ones_refused() {
        let (_, a) = DiskSlab::open(None, 5 * 4096 - 100, true).unwrap();
        assert_eq!(a.len(), 5 * 4096);
        assert!(DiskSlab::open(None, 0, true).is_err());
        assert!(DiskSlab::open(None, u64::MAX, true).is_err());
    }

    #[test]
    fn the_slab_has_no_name_and_errors_name_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("plain");
        std::fs::write(&plain, b"x").unwrap();
        match DiskSlab::open(Some(&plain), 4096, true) {
            Err(Error::Io { path, source }) => {
                assert_eq!(path, plain);
                assert!(source.to_string().contains("not a directory"), "{source}");
            }
            other => panic!("opened over a regular file: {other:?}"),
        }
        let user = dir.path().join("a/b");
        let (t, _) = DiskSlab::open(Some(&user), 1 << 20, true).unwrap();
        // Nothing in the directory: the file is unlinked from the start.
        assert_eq!(std::fs::read_dir(&user).unwrap().count(), 0);
        assert!(t.fd_path().exists());
        assert!(t.name().starts_with(&user));
    }
}
