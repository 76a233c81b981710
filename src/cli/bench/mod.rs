//! `strata bench`: measures every path between tiers on the machine at hand, swept over sizes,
//! and reports the median bandwidth of each (path, size) as a table, CSV, JSON and an SVG plot.
//!
//! The paths, by the name they carry in every output:
//!
//! | path | what one run is | timed with |
//! |---|---|---|
//! | `h2d_pinned`, `d2h_pinned` | `cuMemcpy*Async` from / into pinned host memory | CUDA events |
//! | `h2d_pageable`, `d2h_pageable` | the same from / into pageable memory (`Vec<u8>`) | CUDA events |
//! | `bidir_pinned` | H2D and D2H at once on two streams; bytes of both directions | CUDA events |
//! | `d2d` | device to device; bytes read plus written (as the reference script) | CUDA events |
//! | `kernel_read_hbm`, `kernel_read_mapped` | one float4 streaming-read kernel, over HBM / mapped host memory | CUDA events |
//! | `gather_hbm`, `gather_mapped` | a kernel reading 1% of the 256-byte rows; bytes of the rows read | CUDA events |
//! | `managed_prefetch` | `cuMemPrefetchAsync` of host-resident managed memory to the device | CUDA events |
//! | `managed_faults` | the read kernel over host-resident managed memory (page faults) | CUDA events |
//! | `host_memcpy` | a host memcpy, split over threads as the store's copier does | wall clock |
//! | `disk_write` | `O_DIRECT` write of a file in 16 MiB pieces, then `fdatasync` | wall clock |
//! | `disk_read`, `disk_read_qd4` | cold `O_DIRECT` read of that file, 1 / 4 requests in flight | wall clock |
//! | `disk_to_device` | `O_DIRECT` read into pinned staging, each piece copied to the device | wall clock |
//! | `store_<from>_to_<to>` | [`Store::move_to`](strata::Store::move_to) of the tensor's only copy | wall clock |
//!
//! Each is run once or more untimed (warm-up), then `reps` times; the median is reported. Without
//! a GPU (or with [`Options::host_only`]) only the host, disk and store paths run, the store on its
//! host backend. The raw GPU measurements live in [`strata::probe`] (they need `unsafe`); this
//! module only drives them and the public [`Store`](strata::Store) API. [`Bench::new`] checks
//! the [`Options`], [`Bench::run`] measures and gives the [`Report`] (the test
//! `a_host_only_bench_runs_and_makes_its_table` runs one).

mod disk;
mod report;
mod store_paths;
mod svg;

use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::CudaContext;

use strata::probe::{GpuPath, GpuProbe, Timing};
use strata::{format_size, parse_size, Tier};
use strata::{Error, Result};

use crate::cli::args::DEFAULT_SIZES;
pub use report::{MachineInfo, Measurement, Report, Skip, Timer};
pub use svg::svg_plot;

/// Sizes up to this get [`SMALL_REPS`] timed runs by default, larger ones [`LARGE_REPS`].
pub const SMALL_MAX: u64 = 16 << 20;
/// Default timed runs for sizes up to [`SMALL_MAX`].
pub const SMALL_REPS: usize = 20;
/// Default timed runs for sizes above [`SMALL_MAX`].
pub const LARGE_REPS: usize = 5;
/// Untimed runs before GPU paths are timed (cheap, as in the reference script).
const GPU_WARMUP: usize = 3;
/// Untimed runs before host, disk and store paths are timed.
const WALL_WARMUP: usize = 1;
/// Readers in flight for `disk_read_qd4`.
const QUEUE_DEPTH: usize = 4;

/// What to measure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// Buffer sizes in bytes (sorted and deduplicated before the sweep).
    pub sizes: Vec<u64>,
    /// Timed runs per (path, size); `None`: [`SMALL_REPS`] up to 16 MiB, [`LARGE_REPS`] above.
    pub reps: Option<usize>,
    /// Host and disk paths only, the store on its host backend, even with a GPU present.
    pub host_only: bool,
    /// Where the disk paths write their file and the store its disk tier (default: a fresh
    /// temporary directory).
    pub disk_dir: Option<PathBuf>,
    /// Which paths to run: names or prefixes ending in `*` (default: every path).
    pub paths: Option<Vec<String>>,
    /// Show a progress bar on stderr (where it is a terminal).
    pub progress: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            sizes: parse_sizes(DEFAULT_SIZES).unwrap_or_default(),
            reps: None,
            host_only: false,
            disk_dir: None,
            paths: None,
            progress: false,
        }
    }
}

/// Parses a comma-separated list of sizes with units (`4KiB,1MiB,1GiB`, see
/// [`parse_size`]). Refuses an empty list and a size of 0.
pub fn parse_sizes(list: &str) -> Result<Vec<u64>> {
    if list.trim().is_empty() {
        return Err(Error::InvalidArgument("empty size list (try 4KiB,1MiB,1GiB)".into()));
    }
    list.split(',')
        .map(|s| {
            let n = parse_size(s)?;
            if n == 0 {
                return Err(Error::InvalidArgument(format!("size {:?} is 0", s.trim())));
            }
            if n > isize::MAX as u64 {
                return Err(Error::InvalidArgument(format!("size {:?} is too large", s.trim())));
            }
            Ok(n)
        })
        .collect()
}

/// Splits a comma-separated list of path names or `prefix*` patterns and checks that each
/// matches at least one path of [`all_paths`].
pub fn parse_paths(list: &str) -> Result<Vec<String>> {
    let names = all_paths();
    let pats: Vec<String> =
        list.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect();
    if pats.is_empty() {
        return Err(Error::InvalidArgument("empty path list".into()));
    }
    for p in &pats {
        if !names.iter().any(|n| matches(p, n)) {
            return Err(Error::InvalidArgument(format!(
                "no path matches {p:?}; the paths are: {}",
                names.join(", ")
            )));
        }
    }
    Ok(pats)
}

/// Whether `name` matches the pattern: equal, or starting with the part before a final `*`.
fn matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => pattern == name,
    }
}

/// What one path is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Gpu(GpuPath),
    HostMemcpy,
    DiskWrite,
    DiskRead { depth: usize },
    DiskToDevice,
    Store { from: Tier, to: Tier },
}

impl Kind {
    fn needs_gpu(self) -> bool {
        matches!(self, Kind::Gpu(_) | Kind::DiskToDevice)
    }

    fn timer(self) -> Timer {
        match self {
            Kind::Gpu(_) => Timer::CudaEvents,
            _ => Timer::WallClock,
        }
    }
}

#[derive(Clone, Debug)]
struct PathSpec {
    name: String,
    kind: Kind,
}

/// The name of the store's path from one tier to another: `store_<from>_to_<to>`.
pub fn store_path_name(from: Tier, to: Tier) -> String {
    format!("store_{from}_to_{to}")
}

fn catalogue() -> Vec<PathSpec> {
    let mut v: Vec<PathSpec> = GpuPath::ALL
        .into_iter()
        .map(|p| PathSpec { name: p.name().to_string(), kind: Kind::Gpu(p) })
        .collect();
    let more = [
        ("host_memcpy", Kind::HostMemcpy),
        ("disk_write", Kind::DiskWrite),
        ("disk_read", Kind::DiskRead { depth: 1 }),
        ("disk_read_qd4", Kind::DiskRead { depth: QUEUE_DEPTH }),
        ("disk_to_device", Kind::DiskToDevice),
    ];
    v.extend(more.into_iter().map(|(n, kind)| PathSpec { name: n.to_string(), kind }));
    for from in Tier::ALL {
        for to in Tier::ALL.into_iter().filter(|&t| t != from) {
            v.push(PathSpec { name: store_path_name(from, to), kind: Kind::Store { from, to } });
        }
    }
    v
}

/// Every path's name, in the order of the reports.
pub fn all_paths() -> Vec<String> {
    catalogue().into_iter().map(|p| p.name).collect()
}

/// The raw path a store path is compared with: the copy it is made of. `gpu`: whether the
/// store runs on the CUDA backend (on the host backend every memory tier is host memory).
pub fn raw_reference(from: Tier, to: Tier, gpu: bool) -> &'static str {
    use Tier::*;
    match (from, to) {
        (_, Disk) => "disk_write",
        (Disk, Device) if gpu => "disk_to_device",
        (Disk, _) => "disk_read",
        (Pinned | Mapped, Device) if gpu => "h2d_pinned",
        (Device, Pinned | Mapped) if gpu => "d2h_pinned",
        _ => "host_memcpy",
    }
}

/// A prepared run: options checked, GPU found (or why not), paths resolved.
pub struct Bench {
    opts: Options,
    sizes: Vec<u64>,
    paths: Vec<PathSpec>,
    gpu: std::result::Result<Arc<CudaContext>, String>,
    /// `--host` was given (the GPU was not looked for).
    host_forced: bool,
}

impl Bench {
    /// Checks the options and looks for a GPU (unless `host_only`).
    pub fn new(opts: Options) -> Result<Bench> {
        let mut sizes = opts.sizes.clone();
        if sizes.is_empty() {
            return Err(Error::InvalidArgument("no sizes to measure".into()));
        }
        if let Some(&bad) = sizes.iter().find(|&&s| s == 0 || s > isize::MAX as u64) {
            return Err(Error::InvalidArgument(format!("bad size {bad}")));
        }
        sizes.sort_unstable();
        sizes.dedup();
        if opts.reps == Some(0) {
            return Err(Error::InvalidArgument("--reps must be at least 1".into()));
        }
        let all = catalogue();
        let paths: Vec<PathSpec> = match &opts.paths {
            None => all,
            Some(pats) => {
                let names = parse_paths(&pats.join(","))?;
                all.into_iter().filter(|p| names.iter().any(|pat| matches(pat, &p.name))).collect()
            }
        };
        let gpu = if opts.host_only {
            Err("--host given".to_string())
        } else {
            strata::cuda_device_count()
                .and_then(|_| CudaContext::new(0).map_err(|e| format!("cannot open device 0: {e}")))
        };
        Ok(Bench { host_forced: opts.host_only, opts, sizes, paths, gpu })
    }

    /// The line to print before the sweep: which device, or plainly that no GPU was found.
    pub fn banner(&self) -> String {
        match &self.gpu {
            Ok(ctx) => format!(
                "GPU: {} (device {}): measuring every path",
                ctx.name().unwrap_or_else(|_| "unknown device".into()),
                ctx.ordinal()
            ),
            Err(_) if self.host_forced => {
                "--host: measuring host and disk paths only (the store on its host backend)"
                    .to_string()
            }
            Err(why) => format!("no GPU found ({why}): measuring host and disk paths only"),
        }
    }

    /// Runs the sweep. Paths that fail at some size (out of memory, no NVRTC, a file system
    /// refusing the file) are reported as skipped with the reason; the sweep goes on.
    pub fn run(self) -> Result<Report> {
        // The disk paths' files and the store's slab are unnamed: nothing is left in the
        // directory, whatever ends the command.
        let dir = match &self.opts.disk_dir {
            Some(d) => {
                std::fs::create_dir_all(d).map_err(|e| Error::io(d, e))?;
                d.clone()
            }
            None => std::env::temp_dir(),
        };
        // A directory the disk paths cannot write in fails the command now, rather than every
        // disk and store path being skipped and the sweep ending as if it had succeeded.
        tempfile::tempfile_in(&dir).map_err(|e| Error::io(&dir, e))?;
        let max = *self.sizes.last().unwrap_or(&1);
        let mut probe = None;
        let mut report = Report::new(self.sizes.clone(), self.paths.iter().map(|p| p.name.clone()));
        report.machine = MachineInfo::collect(self.banner());
        report.machine.disk_dir = dir.display().to_string();
        let no_gpu = match &self.gpu {
            Ok(ctx) => match GpuProbe::new(ctx, max as usize) {
                Ok(p) => {
                    report.machine.gpu = Some(p.info().clone());
                    probe = Some(p);
                    None
                }
                Err(e) => Some(format!("the GPU probe failed: {e}")),
            },
            Err(why) => {
                report.machine.no_gpu_reason = Some(why.clone());
                Some("needs a GPU".to_string())
            }
        };
        if let Some(reason) = no_gpu {
            for p in self.paths.iter().filter(|p| p.kind.needs_gpu()) {
                report.skipped.push(Skip {
                    path: p.name.clone(),
                    size: None,
                    reason: reason.clone(),
                });
            }
        }
        let runnable: Vec<&PathSpec> =
            self.paths.iter().filter(|p| probe.is_some() || !p.kind.needs_gpu()).collect();
        let total = runnable.len() * self.sizes.len();
        let mut progress = Progress::new(self.opts.progress, total);
        let ctx = self.gpu.as_ref().ok();
        let mut direct_seen = None;
        for &size in &self.sizes {
            let reps =
                self.opts.reps.unwrap_or(if size <= SMALL_MAX { SMALL_REPS } else { LARGE_REPS });
            let mut sweep = SizeSweep {
                size,
                reps,
                dir: &dir,
                ctx,
                probe: probe.as_mut(),
                report: &mut report,
                progress: &mut progress,
                file: None,
                store: None,
                direct_seen: &mut direct_seen,
            };
            for p in &runnable {
                sweep.one(p);
            }
            sweep.finish();
        }
        progress.done();
        // Path by path (in catalogue order), each by size: the order of the CSV and JSON.
        let order = |name: &str| self.paths.iter().position(|p| p.name == name);
        report.results.sort_by_key(|m| (order(&m.path), m.size));
        report.machine.disk_direct_io = direct_seen;
        drop(probe);
        if let Some(ctx) = ctx {
            if let Err(e) = ctx.check_err() {
                report.notes.push(format!("CUDA error while freeing bench buffers: {e}"));
            }
        }
        Ok(report)
    }
}

/// The measurements at one size, with what they share: the disk file and the store.
struct SizeSweep<'a> {
    size: u64,
    reps: usize,
    dir: &'a std::path::Path,
    ctx: Option<&'a Arc<CudaContext>>,
    probe: Option<&'a mut GpuProbe>,
    report: &'a mut Report,
    progress: &'a mut Progress,
    file: Option<std::result::Result<disk::BenchFile, String>>,
    store: Option<std::result::Result<store_paths::StorePaths, String>>,
    direct_seen: &'a mut Option<bool>,
}

/// What a path needs of this machine at one size, beyond a few buffers: `(host memory, disk
/// space in the bench directory)`. The store's paths build a store with room for the tensor in
/// every tier (on the host backend all four tiers' arenas are host memory) and hold its
/// contents and a read-back copy.
fn needs(kind: Kind, size: u64, gpu: bool) -> (u128, u128) {
    let size = u128::from(size);
    let page = size.div_ceil(4096) * 4096;
    match kind {
        Kind::Gpu(_) => (2 * size, 0),
        Kind::HostMemcpy => (2 * size, 0),
        Kind::DiskWrite | Kind::DiskRead { .. } | Kind::DiskToDevice => (0, page),
        Kind::Store { .. } => (if gpu { 4 } else { 5 } * page, page),
    }
}

impl SizeSweep<'_> {
    /// Why `p` cannot run at this size on this machine (host memory, disk space), if it cannot:
    /// checked before anything is allocated, so that a size too large is a skip with the reason,
    /// not an aborted process or a disk filled to the last byte.
    fn lacks(&self, p: &PathSpec) -> Option<String> {
        let (host, disk) = needs(p.kind, self.size, self.ctx.is_some());
        if let Some(avail) = strata::host_memory_available() {
            if host > u128::from(avail) {
                return Some(format!(
                    "needs {} of host memory, {} available",
                    format_size(u64::try_from(host).unwrap_or(u64::MAX)),
                    format_size(avail)
                ));
            }
        }
        if disk > 0 {
            if let Ok(free) = strata::disk_space_available(self.dir) {
                if disk > u128::from(free) {
                    return Some(format!(
                        "needs {} free in {}, {} free",
                        format_size(u64::try_from(disk).unwrap_or(u64::MAX)),
                        self.dir.display(),
                        format_size(free)
                    ));
                }
            }
        }
        None
    }

    fn one(&mut self, p: &PathSpec) {
        self.progress.step(&p.name, self.size, self.reps);
        if let Some(why) = self.lacks(p) {
            self.report.skipped.push(Skip {
                path: p.name.clone(),
                size: Some(self.size),
                reason: why,
            });
            return;
        }
        match self.measure(p) {
            Ok(t) => {
                self.report.results.push(Measurement::new(&p.name, self.size, &t, p.kind.timer()))
            }
            Err(why) => self.report.skipped.push(Skip {
                path: p.name.clone(),
                size: Some(self.size),
                reason: why,
            }),
        }
    }

    fn note_direct(&mut self, direct: bool) {
        // Reported as direct only if every disk measurement was.
        *self.direct_seen = Some(self.direct_seen.unwrap_or(true) && direct);
    }

    fn measure(&mut self, p: &PathSpec) -> std::result::Result<Timing, String> {
        let size = self.size as usize;
        let reps = self.reps;
        let err = |e: Error| e.chain();
        match p.kind {
            Kind::Gpu(path) => {
                let probe = self.probe.as_deref_mut().ok_or("needs a GPU")?;
                probe.measure(path, size, GPU_WARMUP, reps).map_err(err)
            }
            Kind::HostMemcpy => strata::probe::host_memcpy(size, WALL_WARMUP, reps).map_err(err),
            Kind::DiskWrite => {
                // Writing the file is the measurement; a later disk path reuses the file.
                self.file = None;
                let (file, secs) =
                    disk::BenchFile::create(self.dir, size, WALL_WARMUP, reps).map_err(err)?;
                self.note_direct(file.direct_write);
                self.file = Some(Ok(file));
                Ok(Timing { seconds: secs, bytes: self.size })
            }
            Kind::DiskRead { depth } => {
                let file = self.file()?;
                let (secs, direct) = file.read(size, depth, WALL_WARMUP, reps).map_err(err)?;
                self.note_direct(direct);
                Ok(Timing { seconds: secs, bytes: self.size })
            }
            Kind::DiskToDevice => {
                let path = self.file()?.path().to_path_buf();
                let probe = self.probe.as_deref_mut().ok_or("needs a GPU")?;
                let (t, direct) =
                    probe.disk_to_device(&path, size, WALL_WARMUP, reps).map_err(err)?;
                self.note_direct(direct);
                Ok(t)
            }
            Kind::Store { from, to } => {
                if self.store.is_none() {
                    let s = store_paths::StorePaths::new(self.ctx, self.size, self.dir);
                    self.store = Some(s.map_err(err));
                }
                let store = match self.store.as_mut() {
                    Some(Ok(s)) => s,
                    Some(Err(why)) => return Err(format!("store not built: {why}")),
                    None => return Err("store not built".into()),
                };
                let secs = store.measure(from, to, WALL_WARMUP, reps).map_err(err)?;
                Ok(Timing { seconds: secs, bytes: self.size })
            }
        }
    }

    /// The disk file of this size, written untimed if `disk_write` did not write it.
    fn file(&mut self) -> std::result::Result<&disk::BenchFile, String> {
        if self.file.is_none() {
            let made = disk::BenchFile::create(self.dir, self.size as usize, 0, 0);
            self.file = Some(made.map(|(f, _)| f).map_err(|e| e.chain()));
        }
        match self.file.as_ref() {
            Some(Ok(f)) => Ok(f),
            Some(Err(why)) => Err(format!("bench file not written: {why}")),
            None => Err("bench file not written".into()),
        }
    }

    /// Checks the store's tensor after every store path ran, and removes the file.
    fn finish(self) {
        if let Some(Ok(store)) = &self.store {
            if let Err(e) = store.verify() {
                self.report.notes.push(format!(
                    "store paths at {}: the tensor's contents were WRONG after the moves: {e}",
                    format_size(self.size)
                ));
            }
        }
    }
}

/// The progress bar on stderr (`[12/80] h2d_pinned 256 MiB`), drawn by indicatif where stderr
/// is a terminal; each step is also a `tracing` event (`strata -v bench` shows them anywhere).
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    total: usize,
    done: usize,
}

impl Progress {
    fn new(on: bool, total: usize) -> Progress {
        let bar = on.then(|| {
            let bar = indicatif::ProgressBar::new(total as u64);
            if let Ok(style) =
                indicatif::ProgressStyle::with_template("[{pos}/{len}] {bar:30} {msg} ({elapsed})")
            {
                bar.set_style(style.progress_chars("=> "));
            }
            bar
        });
        Progress { bar, total, done: 0 }
    }

    fn step(&mut self, path: &str, size: u64, reps: usize) {
        self.done += 1;
        tracing::info!(step = self.done, of = self.total, path, size, "measuring");
        if let Some(bar) = &self.bar {
            // The runs a step makes, so that a large size's long step says why it is long.
            bar.set_message(format!("{path} {}, {reps} timed runs", format_size(size)));
            bar.set_position(self.done as u64);
        }
    }

    fn done(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

/// What `strata bench` does: prints the banner, runs the sweep with a progress line, prints the
/// table, and writes the files asked for.
#[derive(Clone, Debug, Default)]
pub struct Command {
    /// What to measure.
    pub options: Options,
    /// Write the results as CSV here.
    pub csv: Option<PathBuf>,
    /// Write the results and the machine's description as JSON here.
    pub json: Option<PathBuf>,
    /// Write the SVG plot here.
    pub plot: Option<PathBuf>,
}

impl Command {
    /// Runs the command, printing to stdout (an error where stdout is closed:
    /// [`crate::cli::print`]).
    pub fn run(&self) -> Result<Report> {
        let bench = Bench::new(self.options.clone())?;
        crate::cli::println(&bench.banner())?;
        let report = bench.run()?;
        crate::cli::print(&report.table())?;
        if report.results.is_empty() {
            return Err(Error::InvalidArgument(
                "nothing was measured: every path was skipped at every size (the reasons are \
                 listed above); give smaller --sizes or other --paths"
                    .into(),
            ));
        }
        let write = |path: &PathBuf, text: String| -> Result<()> {
            std::fs::write(path, text).map_err(|e| Error::io(path, e))?;
            crate::cli::println(&format!("wrote {}", path.display()))
        };
        if let Some(p) = &self.csv {
            write(p, report.to_csv())?;
        }
        if let Some(p) = &self.json {
            write(p, report.to_json())?;
        }
        if let Some(p) = &self.plot {
            write(p, svg_plot(&report)?)?;
        }
        Ok(report)
    }
}

/// Runs `strata bench`.
pub fn run(a: crate::cli::args::BenchArgs) -> anyhow::Result<()> {
    let options = Options {
        sizes: parse_sizes(&a.sizes)?,
        reps: a.reps,
        host_only: a.host,
        disk_dir: a.disk_dir,
        paths: a.paths.as_deref().map(parse_paths).transpose()?,
        progress: true,
    };
    let cmd = Command { options, csv: a.csv, json: a.json, plot: a.plot };
    cmd.run()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_only_bench_runs_and_makes_its_table() -> Result<()> {
        let opts =
            Options { sizes: parse_sizes("4KiB,1MiB")?, host_only: true, ..Default::default() };
        let report = Bench::new(opts)?.run()?;
        assert!(!report.table().is_empty());
        Ok(())
    }

    #[test]
    fn a_size_list_parses_and_an_empty_item_is_refused() {
        assert_eq!(parse_sizes("4KiB, 1MiB").unwrap(), vec![4096, 1 << 20]);
        assert!(parse_sizes("4KiB,,1MiB").is_err());
    }

    #[test]
    fn a_path_list_parses_and_a_misspelt_path_is_refused() {
        let p = parse_paths("h2d_pinned,store_*").unwrap();
        assert_eq!(p, vec!["h2d_pinned".to_string(), "store_*".to_string()]);
        assert!(parse_paths("h2d_pinnd").is_err());
    }

    #[test]
    fn size_lists_parse_with_units() {
        assert_eq!(
            parse_sizes(DEFAULT_SIZES).unwrap(),
            vec![4096, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30]
        );
        assert_eq!(parse_sizes(" 1GB ,4096").unwrap(), vec![1_000_000_000, 4096]);
        for bad in ["", " ", "4KiB,", "0", "4 apples", "1KiB,0B", "99999999TiB"] {
            assert!(
                matches!(parse_sizes(bad), Err(Error::InvalidArgument(_))),
                "{bad:?} was accepted"
            );
        }
    }

    #[test]
    fn path_patterns_select_paths() {
        let names = all_paths();
        assert_eq!(names.len(), 12 + 5 + 12);
        assert!(names.contains(&"store_disk_to_device".to_string()));
        assert!(matches("store_*", "store_pinned_to_mapped"));
        assert!(!matches("store_*", "disk_read"));
        assert!(matches("disk_read", "disk_read"));
        assert!(!matches("disk_read", "disk_read_qd4"));
        assert!(parse_paths("nope,h2d_pinned").is_err());
        assert!(parse_paths(" , ").is_err());
        let opts = Options {
            paths: Some(vec!["disk_*".into(), "host_memcpy".into()]),
            host_only: true,
            ..Default::default()
        };
        let b = Bench::new(opts).unwrap();
        let chosen: Vec<_> = b.paths.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            chosen,
            ["host_memcpy", "disk_write", "disk_read", "disk_read_qd4", "disk_to_device"]
        );
        assert!(b.banner().starts_with("--host"));
    }

    #[test]
    fn bad_options_are_errors_not_panics() {
        let no_sizes = Options { sizes: vec![], host_only: true, ..Default::default() };
        assert!(matches!(Bench::new(no_sizes), Err(Error::InvalidArgument(_))));
        let zero_reps = Options { reps: Some(0), host_only: true, ..Default::default() };
        assert!(matches!(Bench::new(zero_reps), Err(Error::InvalidArgument(_))));
        let bad_path =
            Options { paths: Some(vec!["x".into()]), host_only: true, ..Default::default() };
        assert!(matches!(Bench::new(bad_path), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn store_paths_compare_with_their_raw_copy() {
        assert_eq!(raw_reference(Tier::Pinned, Tier::Device, true), "h2d_pinned");
        assert_eq!(raw_reference(Tier::Device, Tier::Mapped, true), "d2h_pinned");
        assert_eq!(raw_reference(Tier::Disk, Tier::Device, true), "disk_to_device");
        assert_eq!(raw_reference(Tier::Disk, Tier::Device, false), "disk_read");
        assert_eq!(raw_reference(Tier::Pinned, Tier::Device, false), "host_memcpy");
        assert_eq!(raw_reference(Tier::Mapped, Tier::Pinned, true), "host_memcpy");
        assert_eq!(raw_reference(Tier::Device, Tier::Disk, true), "disk_write");
        assert_eq!(store_path_name(Tier::Disk, Tier::Device), "store_disk_to_device");
        let names = all_paths();
        for from in Tier::ALL {
            for to in Tier::ALL.into_iter().filter(|&t| t != from) {
                for gpu in [false, true] {
                    assert!(names.iter().any(|n| n == raw_reference(from, to, gpu)));
                }
            }
        }
    }

    #[test]
    fn host_sweep_measures_host_disk_and_store_paths() {
        let dir = tempfile::tempdir().unwrap();
        let opts = Options {
            sizes: vec![4096, 64 << 10],
            reps: Some(2),
            host_only: true,
            disk_dir: Some(dir.path().to_path_buf()),
            ..Default::default()
        };
        let report = Bench::new(opts).unwrap().run().unwrap();
        for name in ["host_memcpy", "disk_write", "disk_read", "disk_read_qd4"] {
            for size in [4096, 64 << 10] {
                let m = report.get(name, size).unwrap_or_else(|| panic!("{name} {size}"));
                assert!(m.gbps > 0.0 && m.reps == 2, "{m:?}");
            }
        }
        for from in Tier::ALL {
            for to in Tier::ALL.into_iter().filter(|&t| t != from) {
                let name = store_path_name(from, to);
                assert!(report.get(&name, 4096).is_some(), "{name}: {:?}", report.skipped);
            }
        }
        assert!(report.skipped.iter().any(|s| s.path == "h2d_pinned" && s.size.is_none()));
        assert!(report.notes.is_empty(), "{:?}", report.notes);
        assert!(!report.ratios().is_empty());
        // The bench leaves nothing behind in the directory it was given.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
