//! Measuring a [`Machine`]: its PCIe link and its host's rates on a store's backend, a disk by
//! reading a file, or the rates a `strata bench --json` file holds. The type and its presets
//! live in the bottom layer (`base/machine.rs`), where the simulated backend reads them too;
//! measuring needs a store and the probes, so it lives here.

use std::fs::File;
use std::io::Read as _;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

use crate::base::error::{Error, Result};
use crate::base::types::format_size;
use crate::compute::optim::{host_copy_bandwidth, host_update_bandwidth};
use crate::compute::probe::{median, raw_pinned_copy, Direction};
use crate::{Machine, Store};

/// Bytes of each pinned copy a link measurement on a store times.
const LINK_BYTES: usize = 256 << 20;

impl Machine {
    /// This machine as [`Machine::measure`] finds it with `threads` host threads on `store`'s
    /// backend (CUDA or the host), measured the first time a process asks for that backend and
    /// thread count and reused after: each measurement is about a second of copies, and the
    /// rates do not change between the optimizers and runs of one process.
    /// [`Engine::Auto`](crate::optim::Engine::Auto) chooses from it.
    pub fn measured(store: &Store, threads: usize) -> Result<Machine> {
        type Seen = Vec<((bool, usize), Machine)>;
        static SEEN: std::sync::Mutex<Seen> = std::sync::Mutex::new(Vec::new());
        let key = (store.cuda_context().is_some(), threads);
        let seen = |k: &(bool, usize)| {
            let list = SEEN.lock().unwrap_or_else(|e| e.into_inner());
            list.iter().find(|(have, _)| have == k).map(|(_, m)| m.clone())
        };
        if let Some(m) = seen(&key) {
            return Ok(m);
        }
        let mut m = Machine::unknown("this machine (measured in this process)");
        m.measure(store, threads)?;
        SEEN.lock().unwrap_or_else(|e| e.into_inner()).push((key, m.clone()));
        Ok(m)
    }

    /// Measures what the optimizer's engine choice and the trainer's floor need on `store`'s
    /// backend, in about a second: the link ([`Machine::measure_link`]), the host's copy rate
    /// over `threads` threads (0: every core; a copy of 256 MiB, median of five,
    /// [`host_copy_bandwidth`]) and its AdamW rate (an in-place update of 64 MiB,
    /// [`host_update_bandwidth`]). The figures measured replace the machine's, each with a note
    /// saying so; the rest stay as they were.
    pub fn measure(&mut self, store: &Store, threads: usize) -> Result<()> {
        self.measure_for(store, threads, u64::MAX)
    }

    /// [`Machine::measure`] for a run that moves `step_bytes` a step (across the link and through
    /// the host optimizer): the copies are the run's size where it is smaller than
    /// [`Machine::measure`]'s, down to 16 MiB (the host copy and the link) and 4 MiB (the
    /// update), so that a small model's plan is not kept waiting by copies hundreds of times its
    /// size, and is timed at the sizes it moves (a run whose bytes fit the caches sees the
    /// caches' rates). Each figure's note says the size measured.
    ///
    /// ```
    /// # fn main() -> strata::Result<()> {
    /// use strata::{Machine, Store, Tier};
    /// let store = Store::builder().host_backend().capacity(Tier::Device, 1 << 20).build()?;
    /// let mut m = Machine::unknown("this machine");
    /// m.measure_for(&store, 1, 2 << 20)?; // a run moving 2 MiB a step: 16 MiB copies
    /// assert!(m.source("host_copy").unwrap().contains("16.00 MiB"));
    /// # Ok(()) }
    /// ```
    pub fn measure_for(&mut self, store: &Store, threads: usize, step_bytes: u64) -> Result<()> {
        let sized = |floor: usize, cap: usize| {
            usize::try_from(step_bytes).unwrap_or(usize::MAX).clamp(floor, cap)
        };
        let (copy_bytes, update_bytes) = (sized(16 << 20, 256 << 20), sized(4 << 20, 64 << 20));
        self.measure_link_sized(store, copy_bytes)?;
        let copy = host_copy_bandwidth(threads, copy_bytes)?;
        self.host_copy = Some(copy);
        let threads_said =
            if threads == 0 { "every core".to_string() } else { threads.to_string() };
        self.note(
            "host_copy",
            format!(
                "measured now: a copy of {} on {threads_said} threads",
                format_size(copy_bytes as u64)
            ),
        );
        self.host_update = Some(host_update_bandwidth(threads, update_bytes));
        self.note(
            "host_update",
            format!(
                "measured now: an in-place update of {} on {threads_said} threads",
                format_size(update_bytes as u64)
            ),
        );
        Ok(())
    }

    /// Measures the link between the store's tiers: on a CUDA store, pinned copies of 256 MiB
    /// each way (median of five after a warm-up); on the host backend, where "PCIe" is a memcpy,
    /// a copy of 64 MiB on one thread, its read and its write (half the copy's traffic) each
    /// way. Replaces `h2d` and `d2h`, noting how they were measured.
    pub fn measure_link(&mut self, store: &Store) -> Result<()> {
        self.measure_link_sized(store, LINK_BYTES)
    }

    /// [`Machine::measure_link`] for a pass that moves `pass_bytes` across the link: copies of
    /// that size where it is under 256 MiB, down to 16 MiB (as [`Machine::measure_for`]).
    pub fn measure_link_for(&mut self, store: &Store, pass_bytes: u64) -> Result<()> {
        let bytes = usize::try_from(pass_bytes).unwrap_or(usize::MAX).clamp(16 << 20, LINK_BYTES);
        self.measure_link_sized(store, bytes)
    }

    /// [`Machine::measure_link`] with copies of `bytes` on CUDA (a quarter of that on the host
    /// backend, at least 4 MiB).
    fn measure_link_sized(&mut self, store: &Store, bytes: usize) -> Result<()> {
        match store.cuda_context() {
            Some(ctx) => {
                let h = median(&raw_pinned_copy(ctx, bytes, Direction::HostToDevice, 5)?);
                let d = median(&raw_pinned_copy(ctx, bytes, Direction::DeviceToHost, 5)?);
                self.h2d = Some(bytes as f64 / h);
                self.d2h = Some(bytes as f64 / d);
                let how = format!(
                    "measured now: pinned copies of {}, median of 5",
                    format_size(bytes as u64)
                );
                self.note("h2d", how.clone());
                self.note("d2h", how);
            }
            None => {
                let host = (bytes / 4).max(4 << 20);
                let one = host_copy_bandwidth(1, host)? / 2.0;
                self.h2d = Some(one);
                self.d2h = Some(one);
                let how = format!(
                    "measured now on the host backend: a memcpy of {} on one thread",
                    format_size(host as u64)
                );
                self.note("h2d", how.clone());
                self.note("d2h", how);
            }
        }
        Ok(())
    }

    /// Measures the pinned H2D and D2H rates of GPU 0 without a store (pinned copies of 64 MiB,
    /// median of five after a warm-up, [`raw_pinned_copy`]), when there is a GPU. Never fails:
    /// without a GPU, or when a copy fails, `h2d` and `d2h` stay as they were and a note says why.
    pub fn measure_gpu_link(&mut self) {
        let why = match crate::cuda_device_count() {
            Ok(n) if n > 0 => match gpu_link() {
                Ok((h2d, d2h)) => {
                    self.h2d = Some(h2d);
                    self.d2h = Some(d2h);
                    let how = "measured now: pinned copies of 64 MiB on GPU 0, median of 5";
                    self.note("h2d", how);
                    self.note("d2h", how);
                    return;
                }
                Err(e) => format!("not measured: {e}"),
            },
            Ok(_) => "not measured: no GPU".to_string(),
            Err(why) => format!("not measured: no GPU ({why})"),
        };
        if self.h2d.is_none() {
            self.note("h2d", why.clone());
        }
        if self.d2h.is_none() {
            self.note("d2h", why);
        }
    }

    /// Measures the disk's read rate by reading up to 64 MiB of `file` in 16 MiB pieces,
    /// bypassing the page cache (`O_DIRECT`) where the file system allows; writes are taken as
    /// fast (`disk_write` set to the same figure). Never fails: a file that cannot be read or
    /// timed (under 1 MiB) leaves both as they were, with a note saying why.
    pub fn measure_disk(&mut self, file: &Path) {
        match disk_read(file) {
            Ok((rate, bytes, direct)) => {
                self.disk_read = Some(rate);
                self.disk_write = Some(rate);
                let how = if direct { "O_DIRECT" } else { "buffered: may be the page cache" };
                self.note(
                    "disk_read",
                    format!("measured now: {} of {} ({how})", format_size(bytes), file.display()),
                );
                self.note("disk_write", "assumed as fast as the read measured now");
            }
            Err(e) => {
                let why = format!("not measured: {}", e.chain());
                if self.disk_read.is_none() {
                    self.note("disk_read", why.clone());
                }
                if self.disk_write.is_none() {
                    self.note("disk_write", why);
                }
            }
        }
    }

    /// The machine a `strata bench --json` results file describes, named after the file and the
    /// host and date it records: for `h2d_pinned`, `d2h_pinned`, `disk_read` and `disk_write`
    /// (`h2d`, `d2h`, `disk_read`, `disk_write`), the cell of the largest size measured, noted
    /// with its size. A path the file lacks stays `None`, noted so; the other figures are not
    /// known. An unreadable file is an [`Error::Io`]; a file that is not such JSON an
    /// [`Error::InvalidArgument`] naming it.
    pub fn from_bench_json(path: impl AsRef<Path>) -> Result<Machine> {
        let path = path.as_ref();
        let bytes = crate::tiers::file::read_regular(path)?;
        let text = String::from_utf8(bytes).map_err(|_| {
            Error::InvalidArgument(format!("{} is not a text file", path.display()))
        })?;
        Machine::from_bench_json_str(&text, &path.display().to_string())
    }

    /// [`Machine::from_bench_json`] of the file's text; `name` names it in errors and notes.
    pub fn from_bench_json_str(text: &str, name: &str) -> Result<Machine> {
        let bad = |why: String| {
            Error::InvalidArgument(format!("{name} is not a `strata bench --json` file: {why}"))
        };
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        let results =
            v.get("results").and_then(|r| r.as_array()).ok_or_else(|| bad("no results".into()))?;
        let host = v.get("hostname").and_then(|h| h.as_str()).unwrap_or("unknown host");
        let date = v.get("date").and_then(|d| d.as_str()).unwrap_or("unknown date");
        let mut m = Machine::unknown(format!("the machine of {name} ({host}, {date})"));
        for (path, figure) in [
            ("h2d_pinned", "h2d"),
            ("d2h_pinned", "d2h"),
            ("disk_read", "disk_read"),
            ("disk_write", "disk_write"),
        ] {
            let best = results
                .iter()
                .filter(|r| r.get("path").and_then(|p| p.as_str()) == Some(path))
                .filter_map(|r| {
                    let size = r.get("size_bytes")?.as_u64()?;
                    let gbps = r.get("gbps")?.as_f64().filter(|g| g.is_finite() && *g > 0.0)?;
                    Some((size, gbps))
                })
                .max_by_key(|&(size, _)| size);
            let Some((size, gbps)) = best else {
                m.note(figure, format!("{path}: not in {name}"));
                continue;
            };
            let slot = match figure {
                "h2d" => &mut m.h2d,
                "d2h" => &mut m.d2h,
                "disk_read" => &mut m.disk_read,
                _ => &mut m.disk_write,
            };
            *slot = Some(gbps * 1e9);
            m.note(figure, format!("{path} at {} in {name}", format_size(size)));
        }
        Ok(m)
    }
}

/// Median pinned H2D and D2H bytes/s of 64 MiB copies on GPU 0.
fn gpu_link() -> Result<(f64, f64)> {
    const BYTES: usize = 64 << 20;
    let ctx = cudarc::driver::CudaContext::new(0)
        .map_err(|e| Error::Cuda { call: "cuDevicePrimaryCtxRetain", message: e.to_string() })?;
    let mut rates = [0.0f64; 2];
    for (r, dir) in rates.iter_mut().zip([Direction::HostToDevice, Direction::DeviceToHost]) {
        let secs = median(&raw_pinned_copy(&ctx, BYTES, dir, 5)?);
        if secs <= 0.0 {
            return Err(Error::InvalidArgument("a copy took no measurable time".into()));
        }
        *r = BYTES as f64 / secs;
    }
    Ok((rates[0], rates[1]))
}

/// Reads up to 64 MiB of `path` in 16 MiB pieces: (bytes/s, bytes read, whether `O_DIRECT`).
fn disk_read(path: &Path) -> Result<(f64, u64, bool)> {
    const PIECE: usize = 16 << 20;
    const MAX: u64 = 64 << 20;
    const ALIGN: usize = 4096;
    let io = |e| Error::io(path, e);
    let len = crate::tiers::file::check_regular(path)?.len();
    if len < (1 << 20) {
        return Err(Error::InvalidArgument(format!(
            "{} is under 1 MiB, too small to time (give --bench)",
            path.display()
        )));
    }
    let want = len.min(MAX);
    let mut buf = vec![0u8; PIECE + ALIGN];
    let off = buf.as_ptr().align_offset(ALIGN).min(ALIGN);
    let piece = buf
        .get_mut(off..off + PIECE)
        .ok_or_else(|| Error::InvalidArgument("could not align a read buffer".into()))?;
    // O_DIRECT first; if the file system refuses it, a buffered read.
    if let Ok(f) = crate::tiers::file::open_regular(path, libc::O_DIRECT) {
        if let Ok(r) = timed_read(&f, piece, want) {
            return Ok((r.0, r.1, true));
        }
    }
    let mut f = crate::tiers::file::open_regular(path, 0)?;
    let t = Instant::now();
    let mut done = 0u64;
    while done < want {
        let n = (want - done).min(PIECE as u64) as usize;
        let dst = piece.get_mut(..n).unwrap_or_default();
        f.read_exact(dst).map_err(io)?;
        done += n as u64;
    }
    let secs = t.elapsed().as_secs_f64().max(1e-9);
    Ok((done as f64 / secs, done, false))
}

/// Reads `want` bytes (whole aligned pieces) with positioned reads: (bytes/s, bytes read).
fn timed_read(f: &File, piece: &mut [u8], want: u64) -> std::io::Result<(f64, u64)> {
    let t = Instant::now();
    let mut done = 0u64;
    while done < want {
        let n = f.read_at(piece, done)?;
        if n == 0 {
            break;
        }
        done += n as u64;
    }
    let secs = t.elapsed().as_secs_f64().max(1e-9);
    if done == 0 {
        return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
    }
    Ok((done as f64 / secs, done))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tier;

    /// A bench file's largest cell of each path, in bytes/s, each noted with its size; a null
    /// cell is skipped, a missing path stays unknown and says so, and what is not such a file is
    /// refused naming it.
    #[test]
    fn a_bench_file_gives_its_largest_cells() {
        let json = r#"{"hostname": "vm", "date": "2026-11-23", "results": [
          {"path": "h2d_pinned", "size_bytes": 4096, "gbps": 2.5, "median_s": 1e-6},
          {"path": "h2d_pinned", "size_bytes": 1073741824, "gbps": 54.45, "median_s": 0.02},
          {"path": "h2d_pinned", "size_bytes": 1048576, "gbps": 40.0, "median_s": 0.0},
          {"path": "d2h_pinned", "size_bytes": 1073741824, "gbps": 55.05, "median_s": 0.02},
          {"path": "disk_read", "size_bytes": 1073741824, "gbps": null, "median_s": 0.5},
          {"path": "disk_read", "size_bytes": 16777216, "gbps": 2.1, "median_s": 0.008}
        ]}"#;
        let m = Machine::from_bench_json_str(json, "b.json").unwrap();
        assert_eq!(m.h2d, Some(54.45e9));
        assert_eq!(m.d2h, Some(55.05e9));
        assert_eq!(m.disk_read, Some(2.1e9), "a null cell is skipped");
        assert_eq!(m.disk_write, None);
        assert_eq!(m.name, "the machine of b.json (vm, 2026-11-23)");
        assert_eq!(m.source("h2d"), Some("h2d_pinned at 1.00 GiB in b.json"));
        assert_eq!(m.source("disk_write"), Some("disk_write: not in b.json"));
        assert_eq!((m.device_bytes, m.gemm_flops), (None, None));
        assert!(Machine::from_bench_json_str("{}", "x.json").is_err());
        assert!(Machine::from_bench_json_str("not json", "x.json").is_err());
        let missing = Machine::from_bench_json("/nonexistent/strata-bench.json");
        assert!(matches!(missing, Err(Error::Io { .. })), "{missing:?}");
    }

    /// The disk is measured from a file of at least 1 MiB (writes taken as fast); a smaller one
    /// leaves the figures unknown with a note saying why.
    #[test]
    fn a_disk_is_measured_from_a_file_large_enough_to_time() {
        let dir = tempfile::tempdir().unwrap();
        let small = dir.path().join("small");
        std::fs::write(&small, [0u8; 4096]).unwrap();
        let mut m = Machine::unknown("this machine");
        m.measure_disk(&small);
        assert_eq!(m.disk_read, None);
        assert!(m.source("disk_read").unwrap().contains("under 1 MiB"), "{:?}", m.notes);
        let big = dir.path().join("big");
        std::fs::write(&big, vec![1u8; 2 << 20]).unwrap();
        m.measure_disk(&big);
        assert!(m.disk_read.is_some_and(|r| r > 0.0), "{:?}", m.notes);
        assert_eq!(m.disk_write, m.disk_read);
        assert!(m.source("disk_read").unwrap().starts_with("measured now"));
    }

    /// On the host backend the link is a memcpy and the host's rates are measured, each noted;
    /// what is not measured keeps the preset's figure and note.
    #[test]
    fn measuring_on_the_host_backend_notes_each_figure() {
        let store = Store::builder()
            .host_backend()
            .capacity(Tier::Device, 1 << 20)
            .capacity(Tier::Pinned, 1 << 20)
            .build()
            .unwrap();
        let mut m = Machine::h200();
        m.measure(&store, 1).unwrap();
        for f in ["h2d", "d2h", "host_copy", "host_update"] {
            assert!(m.source(f).unwrap().starts_with("measured now"), "{f}: {:?}", m.notes);
        }
        assert!(m.h2d.is_some_and(|r| r > 0.0) && m.host_copy.is_some_and(|r| r > 0.0));
        assert_eq!(m.gemm_flops, Machine::h200().gemm_flops);
        assert!(m.source("gemm_flops").unwrap().contains("assumed"));
    }
}
