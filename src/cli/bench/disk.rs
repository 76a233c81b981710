//! Disk paths: `disk_write`, `disk_read` and `disk_read_qd4` over one file of the sweep's size,
//! with `O_DIRECT` so that reads are cold (the page cache is bypassed), falling back to buffered
//! I/O where the file system refuses it (tmpfs, for instance), which the report then says.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use strata::probe::DISK_CHUNK;
use strata::{Error, Result};

/// What `O_DIRECT` needs of offsets, lengths and buffer addresses.
const ALIGN: usize = 4096;

/// Numbers the bench files of this process.
static NEXT_FILE: AtomicU64 = AtomicU64::new(0);

fn round_up(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

/// A 4096-aligned piece of `len` bytes cut from `buf` (which has `len + 4096` bytes or more).
fn aligned(buf: &mut [u8], len: usize) -> &mut [u8] {
    let skip = (ALIGN - buf.as_ptr() as usize % ALIGN) % ALIGN;
    &mut buf[skip..skip + len]
}

/// Whether an error says the file system refuses `O_DIRECT` I/O.
fn refused(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL)
}

/// Opens `path` with `O_DIRECT` (when `direct`) or buffered.
fn open(path: &Path, write: bool, direct: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).write(write);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

/// The file the disk paths of one size use: unnamed (`O_TMPFILE`, or created and unlinked at
/// once), so nothing of it outlives the process, also one stopped with Ctrl-C or killed; it is
/// reopened (with `O_DIRECT`) through `/proc/self/fd`.
pub(super) struct BenchFile {
    /// Keeps the file alive.
    _file: File,
    /// `/proc/self/fd/N` of `_file`.
    path: PathBuf,
    /// The directory it is in, for errors.
    dir: PathBuf,
    /// Whether the writes went around the page cache.
    pub(super) direct_write: bool,
}

impl BenchFile {
    /// Writes a new file of `size` bytes (padded with zeros to a multiple of 4096) in `dir`:
    /// `warmup` untimed writes, then `reps` timed ones (at least one write in all), each in
    /// pieces of up to 16 MiB followed by `fdatasync`. Returns the file and the timed seconds.
    pub(super) fn create(
        dir: &Path,
        size: usize,
        warmup: usize,
        reps: usize,
    ) -> Result<(BenchFile, Vec<f64>)> {
        if size == 0 {
            return Err(Error::InvalidArgument("a bench file of 0 bytes".into()));
        }
        let n = NEXT_FILE.fetch_add(1, Ordering::Relaxed);
        let unnamed = tempfile::tempfile_in(dir).map_err(|e| Error::io(dir, e))?;
        let path = PathBuf::from(format!("/proc/self/fd/{}", unnamed.as_raw_fd()));
        let mut file =
            BenchFile { _file: unnamed, path, dir: dir.to_path_buf(), direct_write: true };
        let padded = round_up(size);
        let piece = DISK_CHUNK.min(padded);
        let mut buf = vec![0u8; piece + ALIGN];
        fill(aligned(&mut buf, piece), n);
        let runs = (warmup + reps).max(1);
        let mut f = match open(&file.path, true, true) {
            Ok(f) => f,
            Err(_) => {
                file.direct_write = false;
                open(&file.path, true, false).map_err(|e| Error::io(&file.dir, e))?
            }
        };
        let mut seconds = Vec::with_capacity(reps);
        for run in 0..runs {
            let t = Instant::now();
            let mut res = write_all(&f, aligned(&mut buf, piece), padded);
            if matches!(&res, Err(e) if file.direct_write && refused(e)) {
                file.direct_write = false;
                f = open(&file.path, true, false).map_err(|e| Error::io(&file.dir, e))?;
                res = write_all(&f, aligned(&mut buf, piece), padded);
            }
            res.map_err(|e| Error::io(&file.dir, e))?;
            if run >= runs - reps.min(runs) {
                seconds.push(t.elapsed().as_secs_f64());
            }
        }
        Ok((file, seconds))
    }

    /// The file's path.
    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the first `size` bytes (rounded up to 4096) with `depth` readers in flight, each
    /// reading its own pieces (up to 16 MiB; smaller when that leaves a reader idle) one at a
    /// time: `warmup` untimed passes, then `reps` timed ones. Returns the seconds and whether
    /// `O_DIRECT` was used.
    pub(super) fn read(
        &self,
        size: usize,
        depth: usize,
        warmup: usize,
        reps: usize,
    ) -> Result<(Vec<f64>, bool)> {
        if size == 0 || depth == 0 || reps == 0 {
            return Err(Error::InvalidArgument("a read of 0 bytes, readers or runs".into()));
        }
        let padded = round_up(size);
        let piece = if depth == 1 {
            DISK_CHUNK.min(padded)
        } else {
            round_up(padded.div_ceil(depth)).clamp(ALIGN, DISK_CHUNK)
        };
        let readers = depth.min(padded.div_ceil(piece));
        let mut bufs: Vec<Vec<u8>> = (0..readers).map(|_| vec![0u8; piece + ALIGN]).collect();
        let mut direct = true;
        let mut f = match open(&self.path, false, true) {
            Ok(f) => f,
            Err(_) => {
                direct = false;
                open(&self.path, false, false).map_err(|e| Error::io(&self.dir, e))?
            }
        };
        let mut seconds = Vec::with_capacity(reps);
        for run in 0..warmup + reps {
            let t = Instant::now();
            let mut res = read_pass(&f, &mut bufs, piece, padded);
            if matches!(&res, Err(e) if direct && refused(e)) {
                direct = false;
                f = open(&self.path, false, false).map_err(|e| Error::io(&self.dir, e))?;
                res = read_pass(&f, &mut bufs, piece, padded);
            }
            res.map_err(|e| Error::io(&self.dir, e))?;
            if run >= warmup {
                seconds.push(t.elapsed().as_secs_f64());
            }
        }
        Ok((seconds, direct))
    }
}

/// Pseudo-random bytes (xorshift64), so that no layer below can compress or skip zeros.
fn fill(buf: &mut [u8], seed: u64) {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for c in buf.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
}

/// Writes `len` bytes (a multiple of 4096) as copies of `piece`, then `fdatasync`.
fn write_all(f: &File, piece: &[u8], len: usize) -> io::Result<()> {
    let mut off = 0;
    while off < len {
        let n = piece.len().min(len - off);
        f.write_all_at(&piece[..n], off as u64)?;
        off += n;
    }
    f.sync_data()
}

/// One pass over `len` bytes: reader `r` of `bufs.len()` reads pieces `r`, `r + readers`, ...
fn read_pass(f: &File, bufs: &mut [Vec<u8>], piece: usize, len: usize) -> io::Result<()> {
    let readers = bufs.len();
    let read_some = |r: usize, buf: &mut Vec<u8>| -> io::Result<()> {
        let mut k = r;
        while k * piece < len {
            let off = k * piece;
            let n = piece.min(len - off);
            f.read_exact_at(aligned(buf, n), off as u64)?;
            k += readers;
        }
        Ok(())
    };
    if readers == 1 {
        return read_some(0, &mut bufs[0]);
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = bufs
            .iter_mut()
            .enumerate()
            .map(|(r, buf)| s.spawn(move || read_some(r, buf)))
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join().unwrap_or_else(|_| Err(io::Error::other("a disk reader panicked")))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_is_written_read_and_unnamed() {
        let dir = tempfile::tempdir().unwrap();
        let size = 3 * 4096 + 100;
        let (file, secs) = BenchFile::create(dir.path(), size, 1, 2).unwrap();
        assert_eq!(secs.len(), 2);
        let len = std::fs::metadata(file.path()).unwrap().len();
        assert_eq!(len, round_up(size) as u64);
        for depth in [1, 4] {
            let (secs, _direct) = file.read(size, depth, 0, 3).unwrap();
            assert_eq!(secs.len(), 3);
        }
        // The untimed form (no disk_write asked for) still writes the file once.
        let (other, secs) = BenchFile::create(dir.path(), 4096, 0, 0).unwrap();
        assert!(secs.is_empty());
        assert_eq!(std::fs::metadata(other.path()).unwrap().len(), 4096);
        // Nothing of them has a name in the directory.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        drop(file);
        assert!(BenchFile::create(dir.path(), 0, 0, 1).is_err());
        assert!(BenchFile::create(&dir.path().join("missing/dir"), 4096, 0, 1).is_err());
    }

    #[test]
    fn aligned_pieces_are_aligned() {
        let mut v = vec![0u8; 3 * ALIGN];
        let a = aligned(&mut v, 2 * ALIGN);
        assert_eq!(a.as_ptr() as usize % ALIGN, 0);
        assert_eq!(a.len(), 2 * ALIGN);
        let mut b = [0u8; 13];
        fill(&mut b, 1);
        assert_ne!(b, [0u8; 13]);
    }
}
