//! The results of a sweep and their text forms: the aligned table, CSV and JSON.

use std::fmt::Write as _;

use strata::probe::{GpuInfo, Timing, GATHER_ONE_IN};
use strata::{format_size, Tier};

/// How a measurement was timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timer {
    /// CUDA events on the stream (GPU paths).
    CudaEvents,
    /// The host's wall clock, from issue to completion (host, disk and store paths).
    WallClock,
}

impl Timer {
    /// Short name, as in the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Timer::CudaEvents => "cuda_events",
            Timer::WallClock => "wall_clock",
        }
    }
}

/// One (path, size) cell of the sweep.
#[derive(Clone, Debug, PartialEq)]
pub struct Measurement {
    /// The path's name (`h2d_pinned`, `store_disk_to_device`, ...).
    pub path: String,
    /// The buffer size of the sweep, in bytes.
    pub size: u64,
    /// Bytes one run counts (twice the size for `bidir_pinned` and `d2d`, the rows read for
    /// the gathers).
    pub bytes: u64,
    /// Median seconds of the timed runs.
    pub median_s: f64,
    /// `bytes / median_s` in GB/s (10^9 bytes per second).
    pub gbps: f64,
    /// Timed runs.
    pub reps: usize,
    /// How the runs were timed.
    pub timer: Timer,
}

impl Measurement {
    /// A cell from a path's timings.
    pub fn new(path: &str, size: u64, t: &Timing, timer: Timer) -> Measurement {
        Measurement {
            path: path.to_string(),
            size,
            bytes: t.bytes,
            median_s: t.median_s(),
            gbps: t.gbps(),
            reps: t.seconds.len(),
            timer,
        }
    }
}

/// A path not measured (at one size, or at all), and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skip {
    /// The path's name.
    pub path: String,
    /// The size, or `None` when the path was skipped at every size.
    pub size: Option<u64>,
    /// Why.
    pub reason: String,
}

/// A store path's bandwidth over the raw path it is made of, at one size.
#[derive(Clone, Debug, PartialEq)]
pub struct Ratio {
    /// The store path (`store_pinned_to_device`).
    pub store_path: String,
    /// The raw path (`h2d_pinned`).
    pub raw_path: String,
    /// Buffer size in bytes.
    pub size: u64,
    /// Store GB/s over raw GB/s (1.0: the store moves data as fast as the raw copy).
    pub ratio: f64,
}

/// Where the sweep ran.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MachineInfo {
    /// What the bench said before it started (the GPU, or why there is none).
    pub backend: String,
    /// The GPU, when the GPU paths ran.
    pub gpu: Option<GpuInfo>,
    /// Why the GPU paths did not run.
    pub no_gpu_reason: Option<String>,
    /// The host's name.
    pub hostname: String,
    /// The CPU's model name.
    pub cpu: String,
    /// Threads the host offers.
    pub cpu_threads: usize,
    /// When the sweep started, `YYYY-MM-DDTHH:MM:SSZ` (UTC).
    pub date: String,
    /// Directory of the disk paths' file and of the store's disk tier.
    pub disk_dir: String,
    /// Whether the disk paths bypassed the page cache (`O_DIRECT`); `None`: no disk path ran.
    pub disk_direct_io: Option<bool>,
    /// strata's version.
    pub strata_version: String,
}

impl MachineInfo {
    /// Facts about this machine, now.
    pub fn collect(backend: String) -> MachineInfo {
        let read = |p: &str| std::fs::read_to_string(p).ok().map(|s| s.trim().to_string());
        let hostname = read("/proc/sys/kernel/hostname")
            .or_else(|| read("/etc/hostname"))
            .or_else(|| std::env::var("HOSTNAME").ok())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "unknown".into());
        let cpu = read("/proc/cpuinfo")
            .and_then(|c| {
                c.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        MachineInfo {
            backend,
            hostname,
            cpu,
            cpu_threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            date: utc_now(),
            strata_version: env!("CARGO_PKG_VERSION").to_string(),
            ..Default::default()
        }
    }

    /// The device's name, or "host" without a GPU.
    pub fn device_name(&self) -> String {
        match &self.gpu {
            Some(g) => g.name.clone(),
            None => format!("host only, {}", self.cpu),
        }
    }
}

/// `YYYY-MM-DDTHH:MM:SSZ` of now (UTC), from the system clock.
fn utc_now() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

/// Everything a sweep measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    /// Where it ran.
    pub machine: MachineInfo,
    /// The sizes swept, ascending.
    pub sizes: Vec<u64>,
    /// The paths asked for, in report order.
    pub paths: Vec<String>,
    /// The cells measured.
    pub results: Vec<Measurement>,
    /// What was not measured, and why.
    pub skipped: Vec<Skip>,
    /// Anything else worth saying (a failed check, an error while cleaning up).
    pub notes: Vec<String>,
}

/// GB/s with three significant digits or so: `1312`, `54.9`, `7.81`, `0.052`.
pub(crate) fn fmt_gbps(g: f64) -> String {
    if !g.is_finite() {
        "-".into()
    } else if g >= 100.0 {
        format!("{g:.0}")
    } else if g >= 10.0 {
        format!("{g:.1}")
    } else if g >= 1.0 {
        format!("{g:.2}")
    } else {
        format!("{g:.3}")
    }
}

/// A size as the column headers and plot ticks show it: `4 KiB`, `1 GiB`, `1.50 MiB`.
pub(crate) fn short_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut u = 0;
    let mut whole = bytes;
    while whole >= 1024 && whole % 1024 == 0 && u + 1 < UNITS.len() {
        whole /= 1024;
        u += 1;
    }
    if whole < 1024 || u + 1 == UNITS.len() {
        format!("{whole} {}", UNITS[u])
    } else {
        format_size(bytes)
    }
}

/// One row of the CSV.
#[derive(serde::Serialize)]
struct CsvRow<'a> {
    path: &'a str,
    size_bytes: u64,
    gbps: f64,
    median_s: f64,
    reps: usize,
}

/// The JSON file: its keys and their order are the format `strata inspect --bench` and other
/// readers rely on.
#[derive(serde::Serialize)]
struct JsonReport<'a> {
    tool: &'static str,
    strata_version: &'a str,
    date: &'a str,
    hostname: &'a str,
    backend: &'a str,
    cpu: &'a str,
    cpu_threads: usize,
    gpu: Option<JsonGpu<'a>>,
    no_gpu_reason: Option<&'a str>,
    disk_dir: &'a str,
    disk_direct_io: Option<bool>,
    sizes_bytes: &'a [u64],
    results: Vec<JsonResult<'a>>,
    ratios: Vec<JsonRatio<'a>>,
    skipped: Vec<JsonSkip<'a>>,
    notes: &'a [String],
}

#[derive(serde::Serialize)]
struct JsonGpu<'a> {
    ordinal: usize,
    name: &'a str,
    /// `"9.0"`.
    compute_capability: String,
    sm_count: u32,
    total_mem_bytes: u64,
    free_mem_bytes: u64,
    driver_version: i32,
}

#[derive(serde::Serialize)]
struct JsonResult<'a> {
    path: &'a str,
    size_bytes: u64,
    bytes_per_run: u64,
    /// `null` when not finite (JSON has no NaN).
    gbps: f64,
    median_s: f64,
    reps: usize,
    timer: &'static str,
}

#[derive(serde::Serialize)]
struct JsonRatio<'a> {
    store_path: &'a str,
    raw_path: &'a str,
    size_bytes: u64,
    ratio: f64,
}

#[derive(serde::Serialize)]
struct JsonSkip<'a> {
    path: &'a str,
    size_bytes: Option<u64>,
    reason: &'a str,
}

impl Report {
    /// An empty report for these sizes and paths.
    pub fn new(sizes: Vec<u64>, paths: impl IntoIterator<Item = String>) -> Report {
        Report { sizes, paths: paths.into_iter().collect(), ..Default::default() }
    }

    /// The cell of `path` at `size`.
    pub fn get(&self, path: &str, size: u64) -> Option<&Measurement> {
        self.results.iter().find(|m| m.path == path && m.size == size)
    }

    /// The paths that have at least one cell, in report order.
    pub fn measured_paths(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self
            .paths
            .iter()
            .map(String::as_str)
            .filter(|p| self.results.iter().any(|m| m.path == *p))
            .collect();
        // Cells of paths not in the list (a report put together by hand) still count.
        for m in &self.results {
            if !v.contains(&m.path.as_str()) {
                v.push(&m.path);
            }
        }
        v
    }

    /// Every store path beside the raw path it is made of, at each size both were measured.
    pub fn ratios(&self) -> Vec<Ratio> {
        let gpu = self.machine.gpu.is_some();
        let mut out = Vec::new();
        for from in Tier::ALL {
            for to in Tier::ALL.into_iter().filter(|&t| t != from) {
                let store = super::store_path_name(from, to);
                let raw = super::raw_reference(from, to, gpu);
                for &size in &self.sizes {
                    if let (Some(s), Some(r)) = (self.get(&store, size), self.get(raw, size)) {
                        if r.gbps > 0.0 {
                            out.push(Ratio {
                                store_path: store.clone(),
                                raw_path: raw.to_string(),
                                size,
                                ratio: s.gbps / r.gbps,
                            });
                        }
                    }
                }
            }
        }
        out
    }

    /// The aligned table of GB/s (rows: paths, columns: sizes), the store/raw ratios, the
    /// zero-copy comparison, and what was skipped.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let m = &self.machine;
        let _ = writeln!(s, "strata bench on {} ({}), {}", m.hostname, m.device_name(), m.date);
        let reps: Vec<String> = {
            let mut r: Vec<usize> = self.results.iter().map(|m| m.reps).collect();
            r.sort_unstable();
            r.dedup();
            r.iter().map(|n| n.to_string()).collect()
        };
        let _ = writeln!(
            s,
            "GB/s (10^9 bytes/s), median of {} timed runs after warm-up; GPU paths timed with \
             CUDA events, host, disk and store paths with the wall clock",
            if reps.is_empty() { "0".to_string() } else { reps.join("/") }
        );
        let paths = self.measured_paths();
        let name_w = paths.iter().map(|p| p.len()).max().unwrap_or(4).max(4);
        let cols: Vec<String> = self.sizes.iter().map(|&b| short_size(b)).collect();
        let col_w = cols.iter().map(|c| c.len()).max().unwrap_or(0).max(8);
        let _ = write!(s, "\n{:<name_w$}", "path");
        for c in &cols {
            let _ = write!(s, "  {c:>col_w$}");
        }
        s.push('\n');
        for p in &paths {
            let _ = write!(s, "{p:<name_w$}");
            for &size in &self.sizes {
                let cell = self.get(p, size).map_or("-".to_string(), |m| fmt_gbps(m.gbps));
                let _ = write!(s, "  {cell:>col_w$}");
            }
            s.push('\n');
        }
        let ratios = self.ratios();
        if !ratios.is_empty() {
            let _ = writeln!(s, "\nstore / raw (ratio of GB/s; 1.00 = as fast as the raw copy)");
            let mut rows: Vec<(String, String)> = Vec::new();
            for r in &ratios {
                let row = (r.store_path.clone(), r.raw_path.clone());
                if !rows.contains(&row) {
                    rows.push(row);
                }
            }
            let label_w = rows.iter().map(|(a, b)| a.len() + b.len() + 3).max().unwrap_or(4);
            let _ = write!(s, "{:<label_w$}", "store path / raw path");
            for c in &cols {
                let _ = write!(s, "  {c:>col_w$}");
            }
            s.push('\n');
            for (store, raw) in &rows {
                let _ = write!(s, "{:<label_w$}", format!("{store} / {raw}"));
                for &size in &self.sizes {
                    let cell = ratios
                        .iter()
                        .find(|r| &r.store_path == store && r.size == size)
                        .map_or("-".to_string(), |r| format!("{:.2}", r.ratio));
                    let _ = write!(s, "  {cell:>col_w$}");
                }
                s.push('\n');
            }
        }
        if ratios.iter().any(|r| r.raw_path == "disk_write" && r.ratio > 1.0) {
            let _ = writeln!(
                s,
                "store_*_to_disk above 1: disk_write ends every run with fdatasync (the bytes are \
                 on the disk when it stops the clock); the store's disk tier is a cache that \
                 nothing reads after the process, so its writes are not synced, and at small \
                 sizes the sync is most of disk_write's time"
            );
        }
        let zc = self.zero_copy_lines();
        if !zc.is_empty() {
            let _ = writeln!(
                s,
                "\nsparse gather of 1 row in {GATHER_ONE_IN} (256-byte rows): zero-copy read of \
                 mapped memory vs copying the whole buffer to the device first"
            );
            for l in zc {
                let _ = writeln!(s, "  {l}");
            }
        }
        if !self.skipped.is_empty() {
            let _ = writeln!(s, "\nnot measured:");
            let mut whole: Vec<&Skip> = Vec::new();
            let mut seen: Vec<(&str, &str)> = Vec::new();
            for k in &self.skipped {
                if k.size.is_none() {
                    whole.push(k);
                } else if !seen.contains(&(k.path.as_str(), k.reason.as_str())) {
                    seen.push((&k.path, &k.reason));
                }
            }
            let mut reasons: Vec<&str> = whole.iter().map(|k| k.reason.as_str()).collect();
            reasons.dedup();
            for r in reasons {
                let names: Vec<&str> =
                    whole.iter().filter(|k| k.reason == r).map(|k| k.path.as_str()).collect();
                let _ = writeln!(s, "  {} ({r})", names.join(", "));
            }
            for (path, reason) in seen {
                let sizes: Vec<String> = self
                    .skipped
                    .iter()
                    .filter(|k| k.path == path && k.reason == reason)
                    .filter_map(|k| k.size.map(short_size))
                    .collect();
                let _ = writeln!(s, "  {path} at {}: {reason}", sizes.join(", "));
            }
        }
        if let Some(direct) = m.disk_direct_io {
            let _ = writeln!(
                s,
                "\ndisk paths in {}: {}",
                m.disk_dir,
                if direct {
                    "O_DIRECT (cold reads, the page cache bypassed)"
                } else {
                    "buffered: the file system refused O_DIRECT, so reads may come from the page \
                     cache"
                }
            );
        }
        for n in &self.notes {
            let _ = writeln!(s, "note: {n}");
        }
        s
    }

    /// For each size with the gathers and the pinned copy measured: the time of the zero-copy
    /// gather against copying the whole buffer first and gathering in HBM.
    fn zero_copy_lines(&self) -> Vec<String> {
        let mut out = Vec::new();
        for &size in &self.sizes {
            let (Some(zc), Some(h2d), Some(hbm)) = (
                self.get("gather_mapped", size),
                self.get("h2d_pinned", size),
                self.get("gather_hbm", size),
            ) else {
                continue;
            };
            let copy_first = h2d.median_s + hbm.median_s;
            if zc.median_s <= 0.0 {
                continue;
            }
            let speedup = copy_first / zc.median_s;
            out.push(format!(
                "{:>8}: zero-copy {:.3} ms, copy first {:.3} ms ({:.3} + {:.3}): {}",
                short_size(size),
                zc.median_s * 1e3,
                copy_first * 1e3,
                h2d.median_s * 1e3,
                hbm.median_s * 1e3,
                if speedup >= 1.0 {
                    format!("zero-copy {speedup:.1}x faster")
                } else {
                    format!("copy first {:.1}x faster", 1.0 / speedup)
                }
            ));
        }
        out
    }

    /// The cells as CSV: `path,size_bytes,gbps,median_s,reps`, one row per cell.
    pub fn to_csv(&self) -> String {
        let mut w = csv::Writer::from_writer(Vec::new());
        for p in self.measured_paths() {
            for m in self.results.iter().filter(|m| m.path == p) {
                let row = CsvRow {
                    path: &m.path,
                    size_bytes: m.size,
                    gbps: m.gbps,
                    median_s: m.median_s,
                    reps: m.reps,
                };
                // Into a Vec, serializing plain fields: cannot fail.
                let _ = w.serialize(row);
            }
        }
        let mut bytes = w.into_inner().unwrap_or_default();
        if bytes.is_empty() {
            bytes = b"path,size_bytes,gbps,median_s,reps\n".to_vec();
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The cells, ratios, skips and notes as JSON, with the machine's description.
    pub fn to_json(&self) -> String {
        let m = &self.machine;
        let ratios = self.ratios();
        let doc = JsonReport {
            tool: "strata bench",
            strata_version: &m.strata_version,
            date: &m.date,
            hostname: &m.hostname,
            backend: &m.backend,
            cpu: &m.cpu,
            cpu_threads: m.cpu_threads,
            gpu: m.gpu.as_ref().map(|g| JsonGpu {
                ordinal: g.ordinal,
                name: &g.name,
                compute_capability: format!(
                    "{}.{}",
                    g.compute_capability.0, g.compute_capability.1
                ),
                sm_count: g.sm_count,
                total_mem_bytes: g.total_mem,
                free_mem_bytes: g.free_mem,
                driver_version: g.driver_version,
            }),
            no_gpu_reason: m.no_gpu_reason.as_deref(),
            disk_dir: &m.disk_dir,
            disk_direct_io: m.disk_direct_io,
            sizes_bytes: &self.sizes,
            results: self
                .results
                .iter()
                .map(|r| JsonResult {
                    path: &r.path,
                    size_bytes: r.size,
                    bytes_per_run: r.bytes,
                    gbps: r.gbps,
                    median_s: r.median_s,
                    reps: r.reps,
                    timer: r.timer.name(),
                })
                .collect(),
            ratios: ratios
                .iter()
                .map(|r| JsonRatio {
                    store_path: &r.store_path,
                    raw_path: &r.raw_path,
                    size_bytes: r.size,
                    ratio: r.ratio,
                })
                .collect(),
            skipped: self
                .skipped
                .iter()
                .map(|k| JsonSkip { path: &k.path, size_bytes: k.size, reason: &k.reason })
                .collect(),
            notes: &self.notes,
        };
        // Strings, numbers and options only: serializing cannot fail.
        let mut text = serde_json::to_string_pretty(&doc).unwrap_or_default();
        text.push('\n');
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(path: &str, size: u64, secs: f64) -> Measurement {
        let t = Timing { seconds: vec![secs, secs * 2.0, secs / 2.0], bytes: size };
        Measurement::new(path, size, &t, Timer::WallClock)
    }

    pub(crate) fn sample() -> Report {
        let mut r = Report::new(
            vec![4096, 1 << 20],
            ["host_memcpy", "disk_read", "store_pinned_to_device", "store_disk_to_pinned"]
                .map(String::from),
        );
        r.machine = MachineInfo {
            backend: "host".into(),
            hostname: "box \"1\"".into(),
            date: "2026-11-23T10:00:00Z".into(),
            cpu: "cpu".into(),
            ..Default::default()
        };
        r.results = vec![
            cell("host_memcpy", 4096, 1e-6),
            cell("host_memcpy", 1 << 20, 1e-4),
            cell("disk_read", 1 << 20, 1e-3),
            cell("store_pinned_to_device", 4096, 2e-6),
            cell("store_pinned_to_device", 1 << 20, 1e-4),
            cell("store_disk_to_pinned", 1 << 20, 2e-3),
        ];
        r.skipped = vec![
            Skip { path: "h2d_pinned".into(), size: None, reason: "needs a GPU".into() },
            Skip { path: "disk_read".into(), size: Some(4096), reason: "refused, \"x\"".into() },
        ];
        r
    }

    #[test]
    fn measurement_uses_the_median() {
        let m = cell("p", 1_000_000_000, 2.0);
        assert_eq!(m.median_s, 2.0);
        assert_eq!(m.gbps, 0.5);
        assert_eq!(m.reps, 3);
    }

    #[test]
    fn csv_has_the_header_and_a_row_per_cell() {
        let csv = sample().to_csv();
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines[0], "path,size_bytes,gbps,median_s,reps");
        assert_eq!(lines.len(), 1 + 6);
        assert_eq!(lines[1], "host_memcpy,4096,4.096,1e-6,3");
        assert!(lines.iter().any(|l| l.starts_with("store_disk_to_pinned,1048576,0.524288,")));
        for l in &lines[1..] {
            assert_eq!(l.split(',').count(), 5, "{l}");
        }
        let mut r = sample();
        r.results[0].path = "a,\"b\"".into();
        r.paths[0] = r.results[0].path.clone();
        let quoted = r.to_csv();
        assert!(quoted.contains("\n\"a,\"\"b\"\"\",4096,"), "{quoted}");
        assert_eq!(Report::default().to_csv(), "path,size_bytes,gbps,median_s,reps\n");
    }

    #[test]
    fn json_is_well_formed_and_complete() {
        let mut r = sample();
        r.results[0].gbps = f64::NAN;
        let j = r.to_json();
        let v: serde_json::Value = serde_json::from_str(&j).unwrap();
        assert_eq!(v["tool"], "strata bench");
        assert_eq!(v["hostname"], "box \"1\"");
        assert_eq!(v["date"], "2026-11-23T10:00:00Z");
        assert!(v["gpu"].is_null());
        assert_eq!(v["sizes_bytes"], serde_json::json!([4096, 1048576]));
        let results = v["results"].as_array().unwrap();
        assert_eq!(results.len(), 6);
        assert!(results[0]["gbps"].is_null(), "NaN is written as null");
        assert_eq!(results[5]["path"], "store_disk_to_pinned");
        assert_eq!(results[5]["size_bytes"], 1048576);
        assert_eq!(results[5]["timer"], "wall_clock");
        assert_eq!(v["skipped"][1]["reason"], "refused, \"x\"");
        assert!(v["skipped"][0]["size_bytes"].is_null());
        assert_eq!(v["notes"], serde_json::json!([]));
        // (host_memcpy at 4 KiB has no bandwidth now: one ratio fewer than the table test's.)
        assert_eq!(v["ratios"].as_array().unwrap().len(), 2);
        // The key order of the format.
        let keys =
            ["\"tool\"", "\"strata_version\"", "\"date\"", "\"gpu\"", "\"results\"", "\"notes\""];
        let at: Vec<usize> = keys.iter().map(|k| j.find(k).unwrap()).collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{j}");
    }

    #[test]
    fn table_aligns_cells_and_lists_ratios_and_skips() {
        let r = sample();
        let t = r.table();
        assert!(t.contains("   4 KiB     1 MiB"), "{t}");
        let row = t.lines().find(|l| l.starts_with("host_memcpy")).unwrap();
        let header = t.lines().find(|l| l.starts_with("path")).unwrap();
        assert_eq!(row.len(), header.len(), "{t}");
        assert!(t.contains("store_pinned_to_device / host_memcpy"), "{t}");
        assert!(t.contains("store_disk_to_pinned / disk_read"), "{t}");
        assert!(t.contains("h2d_pinned (needs a GPU)"), "{t}");
        assert!(t.contains("disk_read at 4 KiB: refused"), "{t}");
        let ratios = r.ratios();
        assert_eq!(ratios.len(), 3);
        let one = ratios.iter().find(|x| x.size == 1 << 20 && x.raw_path == "host_memcpy").unwrap();
        assert!((one.ratio - 1.0).abs() < 1e-12);
    }

    #[test]
    fn gpu_tables_show_ratios_against_the_copies_and_the_zero_copy_win() {
        let sizes = [1u64 << 20, 1 << 30];
        let mut r = Report::new(sizes.to_vec(), std::iter::empty());
        r.machine.gpu = Some(GpuInfo {
            ordinal: 0,
            name: "NVIDIA H100".into(),
            compute_capability: (9, 0),
            sm_count: 132,
            total_mem: 80 << 30,
            free_mem: 79 << 30,
            driver_version: 12080,
        });
        // (path, GB/s at each size, bytes counted per GB/s of size)
        let cells: [(&str, [f64; 2], f64); 5] = [
            ("h2d_pinned", [20.0, 54.9], 1.0),
            ("gather_hbm", [0.5, 500.0], 0.01),
            ("gather_mapped", [0.4, 40.0], 0.01),
            ("store_pinned_to_device", [18.0, 53.0], 1.0),
            ("store_disk_to_device", [0.9, 1.4], 1.0),
        ];
        for (path, gbps, frac) in cells {
            r.paths.push(path.to_string());
            for (i, &size) in sizes.iter().enumerate() {
                let bytes = (size as f64 * frac) as u64;
                let t = Timing { seconds: vec![bytes as f64 / (gbps[i] * 1e9)], bytes };
                r.results.push(Measurement::new(path, size, &t, Timer::CudaEvents));
            }
        }
        let t = r.table();
        assert!(t.contains("store_pinned_to_device / h2d_pinned"), "{t}");
        // No raw disk_to_device measured: no ratio row for it.
        assert!(!t.contains("store_disk_to_device /"), "{t}");
        let zc =
            t.lines().find(|l| l.contains("1 GiB: zero-copy")).unwrap_or_else(|| panic!("{t}"));
        assert!(zc.contains("zero-copy") && zc.ends_with("x faster"), "{zc}");
        let small = t.lines().find(|l| l.contains("1 MiB: zero-copy")).unwrap();
        assert!(small.contains("copy first") || small.contains("zero-copy"), "{small}");
        assert!(t.contains("NVIDIA H100"), "{t}");
    }

    #[test]
    fn numbers_and_sizes_print_compactly() {
        assert_eq!(fmt_gbps(1312.4), "1312");
        assert_eq!(fmt_gbps(54.93), "54.9");
        assert_eq!(fmt_gbps(7.812), "7.81");
        assert_eq!(fmt_gbps(0.0521), "0.052");
        assert_eq!(short_size(4096), "4 KiB");
        assert_eq!(short_size(1 << 30), "1 GiB");
        assert_eq!(short_size(1000), "1000 B");
        assert_eq!(short_size(1536 << 10), "1.50 MiB");
        assert_eq!(short_size(1_000_000), format_size(1_000_000));
    }

    #[test]
    fn json_parses_as_bench_results_for_inspect() {
        let mut r = Report::new(vec![1 << 20, 64 << 20], ["h2d_pinned".to_string()]);
        for (size, secs) in [(1u64 << 20, 1e-4), (64 << 20, 2e-3)] {
            let timing = Timing { seconds: vec![secs; 3], bytes: size };
            r.results.push(Measurement::new("h2d_pinned", size, &timing, Timer::CudaEvents));
        }
        let m = strata::Machine::from_bench_json_str(&r.to_json(), "r.json").unwrap();
        let want = (64u64 << 20) as f64 / 2e-3;
        assert!((m.h2d.unwrap() - want).abs() < 1e-6 * want, "{m:?}");
    }

    #[test]
    fn dates_are_utc_to_the_second() {
        let d = utc_now();
        assert_eq!(d.len(), 20, "{d}");
        assert!(d.ends_with('Z') && d.as_bytes()[10] == b'T', "{d}");
    }
}
