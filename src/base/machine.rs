//! The one description of a machine ([`Machine`]): its memories, links and rates, and where each
//! figure comes from. Memory plans, the optimizer's engine choice, the trainer's plan and the
//! simulated backend all read it; measuring one lives above the public API (`compute/machine.rs`),
//! since it needs a store and the probes.

use std::fmt;

use crate::base::error::{Error, Result};
use crate::base::types::format_size;

const GIB: u64 = 1 << 30;

/// A machine strata plans, chooses or simulates for: its memories, its PCIe link, its host's and
/// disk's rates, its device's memory bandwidth and compute, and a note for each figure saying where
/// it comes from (measured, read from a `strata bench --json` file, given, or assumed).
///
/// Units are SI throughout: bytes, bytes per second, FLOP per second, seconds. A figure that is
/// not known is `None` (a prediction without a GPU has no PCIe rate) rather than a number made
/// up; what needs it says so ([`Machine::require`]).
///
/// Where each comes from: the presets [`Machine::h100`] and [`Machine::h200`] (figures written
/// down, each with its source), [`Machine::unknown`] (nothing known yet), `Machine::detect`
/// (this machine's memories, with the `candle` feature), [`Machine::measure`] and its parts
/// (rates measured now on a store's backend), [`Machine::from_bench_json`] (the rates in a
/// `strata bench --json` file). The simulated backend takes its rates from one:
/// [`Simulation::of`](crate::Simulation::of).
///
/// ```
/// use strata::Machine;
///
/// let h200 = Machine::h200();
/// assert_eq!(h200.device_bytes, Some(141_000_000_000));
/// // Its link was never measured: the H100's Gen5 measurement, noted as an assumption.
/// assert_eq!(h200.h2d, Machine::h100().h2d);
/// assert!(h200.source("h2d").unwrap().contains("assumed"));
/// // A machine of which nothing is known says so when a figure is needed.
/// let e = Machine::unknown("a laptop").require("h2d", None).unwrap_err();
/// assert!(e.to_string().contains("a laptop"));
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Machine {
    /// What the machine is, printed with every figure made with it.
    pub name: String,
    /// Device memory (HBM), bytes: the Device tier and a framework's working set.
    pub device_bytes: Option<u64>,
    /// The device's memory is the host's (CPU candle on the host backend): the Device tier and
    /// the working set come out of host memory.
    pub device_is_host: bool,
    /// Host memory, bytes: the Pinned tier, and the system's and the process's own.
    pub host_bytes: Option<u64>,
    /// Free disk where the Disk tier's files go, bytes.
    pub disk_bytes: Option<u64>,
    /// PCIe host (pinned) to device, bytes/s.
    pub h2d: Option<f64>,
    /// PCIe device to host (pinned), bytes/s.
    pub d2h: Option<f64>,
    /// PCIe both directions at once, bytes/s in all: between the faster direction and the sum
    /// of both (one copy engine each way, one link).
    pub both_ways: Option<f64>,
    /// The host's memory traffic in a multi-threaded copy (bytes read plus bytes written per
    /// second).
    pub host_copy: Option<f64>,
    /// The host's AdamW rate: bytes of an update's traffic
    /// ([`update_bytes`](crate::optim::update_bytes)) per second.
    pub host_update: Option<f64>,
    /// Disk read, bytes/s.
    pub disk_read: Option<f64>,
    /// Disk write, bytes/s.
    pub disk_write: Option<f64>,
    /// Device memory bandwidth of elementwise work (bytes read plus bytes written per second).
    pub hbm: Option<f64>,
    /// Dense bf16 GEMM rate, FLOP/s: what the simulated backend times GEMMs at.
    pub gemm_flops: Option<f64>,
    /// The model FLOP/s a training step's compute is figured at where it is not measured (a
    /// whole step, attention and the small kernels included, runs below the GEMM rate).
    pub model_flops: Option<f64>,
    /// Host time to issue one copy or kernel, seconds.
    pub launch_seconds: Option<f64>,
    /// Where each figure comes from: `(figure, source)`, the figure named as its field is
    /// (`"h2d"`, `"device_bytes"`, ...). A figure that is `None` may carry why it is not known.
    pub notes: Vec<(&'static str, String)>,
}

/// Every figure's name, in the order [`Machine`] declares them.
const FIGURES: [&str; 14] = [
    "device_bytes",
    "host_bytes",
    "disk_bytes",
    "h2d",
    "d2h",
    "both_ways",
    "host_copy",
    "host_update",
    "disk_read",
    "disk_write",
    "hbm",
    "gemm_flops",
    "model_flops",
    "launch_seconds",
];

impl Machine {
    /// A machine called `name` of which nothing is known yet: every figure `None`, no notes.
    pub fn unknown(name: impl Into<String>) -> Machine {
        Machine {
            name: name.into(),
            device_bytes: None,
            device_is_host: false,
            host_bytes: None,
            disk_bytes: None,
            h2d: None,
            d2h: None,
            both_ways: None,
            host_copy: None,
            host_update: None,
            disk_read: None,
            disk_write: None,
            hbm: None,
            gemm_flops: None,
            model_flops: None,
            launch_seconds: None,
            notes: Vec::new(),
        }
    }

    /// The lent H100 machine, PCIe Gen5, as measured on it on 2026-11-22 and 2026-11-23
    /// (`docs/benchmarks.md`, `../shared/design.md`):
    /// - 80 GB of HBM, 125 GiB of host memory, 64 GiB of disk (the lease);
    /// - pinned H2D 54.3 GB/s and D2H 55.0 GB/s (`strata bench`, 1 GiB; `design.md`'s rounded
    ///   55 GB/s H2D is the same link: the measured 54.3 is kept), both directions at once
    ///   88 GB/s (`design.md`);
    /// - the virtual disk's 1.5 GB/s, read and write alike (measured: 1.5 to 1.8 GB/s);
    /// - elementwise work at 3 TB/s (a device-to-device copy, read + write, measured); bf16 GEMMs
    ///   at 796 TFLOP/s (the all-resident forward pass of `examples/out_of_core.rs`, 32 layers of
    ///   8192², rows 2048, in 11.05 ms);
    /// - assumed, not measured: a host AdamW of 50 GB/s (the host's memory bandwidth, an
    ///   estimate), a training step's model FLOPs at 400 TFLOP/s (issue 32's target), 5 µs of
    ///   host time per launch or async copy.
    ///
    /// The host's copy rate is not in the preset (`None`): [`Machine::h100`]'s figures are for
    /// plans and simulations; the optimizer's choice measures the machine it runs on.
    pub fn h100() -> Machine {
        let measured = "measured on the lent H100";
        let mut m = Machine {
            name: "the H100 preset (80 GB HBM, 125 GiB host, 64 GiB disk)".into(),
            device_bytes: Some(80_000_000_000),
            device_is_host: false,
            host_bytes: Some(125 * GIB),
            disk_bytes: Some(64 * GIB),
            h2d: Some(54.3e9),
            d2h: Some(55.0e9),
            both_ways: Some(88.0e9),
            host_copy: None,
            host_update: Some(50e9),
            disk_read: Some(1.5e9),
            disk_write: Some(1.5e9),
            hbm: Some(3.0e12),
            gemm_flops: Some(796e12),
            model_flops: Some(400e12),
            launch_seconds: Some(5e-6),
            notes: Vec::new(),
        };
        m.note("device_bytes", "the lease's H100 80GB HBM3");
        m.note("host_bytes", "the lease's host memory");
        m.note("disk_bytes", "the lease's disk");
        m.note(
            "h2d",
            format!(
                "pinned, 1 GiB, {measured} by strata bench on 2026-11-23 (design.md's rounded \
                 55 GB/s is the same link: the measured figure is kept)"
            ),
        );
        m.note("d2h", format!("pinned, 1 GiB, {measured} by strata bench on 2026-11-23"));
        m.note("both_ways", format!("both directions at once, {measured} (design.md)"));
        m.note("host_copy", "not in the preset: measured on the machine that runs");
        m.note("host_update", "assumed: the host's memory bandwidth, an estimate");
        m.note("disk_read", format!("the lease's virtual disk, {measured} (1.5 to 1.8 GB/s)"));
        m.note("disk_write", format!("the lease's virtual disk, {measured} (1.5 to 1.8 GB/s)"));
        m.note("hbm", format!("a device-to-device copy (read + write), {measured}"));
        m.note(
            "gemm_flops",
            format!(
                "bf16 GEMMs of the all-resident out_of_core forward pass (32 layers of 8192², \
                 rows 2048, 11.05 ms), {measured} on 2026-11-23"
            ),
        );
        m.note("model_flops", "assumed: issue 32's target, not a measurement");
        m.note("launch_seconds", "assumed: a launch or an async copy costs a few µs of host time");
        m
    }

    /// The H200 machine lent to the project now (`nvidia-h200`: one H200, 16 cores, 128 GiB of
    /// host memory, 64 GiB of disk, PCIe Gen5):
    /// - 141 GB of HBM3e (the datasheet's; `nvidia-smi` showed 143771 MiB);
    /// - elementwise work at 4.3 TB/s (a device-to-device copy, read + write, measured on such a
    ///   machine by this workplace on 2026-10-28 and 2026-11-04; the datasheet says 4.8 TB/s);
    /// - **assumed**, never measured here: its PCIe link (the H100's Gen5 measurement: 54.3 GB/s
    ///   H2D, 55.0 GB/s D2H, 88 GB/s both ways), its GEMM rate (the H100's 796 TFLOP/s, scaled
    ///   by nothing: the same Hopper SMs; a PyTorch 8192³ bf16 product ran at 769 to 798 TFLOP/s
    ///   on one), and the H100 preset's disk, host AdamW rate, model FLOP rate and launch cost.
    ///
    /// Measure its link (`strata bench`) before quoting a PCIe-bound figure made with it.
    pub fn h200() -> Machine {
        let assumed =
            |what: &str| format!("assumed: the H100 preset's {what}, not measured on an H200");
        let mut m = Machine {
            name: "the H200 preset (141 GB HBM, 128 GiB host, 64 GiB disk)".into(),
            device_bytes: Some(141_000_000_000),
            host_bytes: Some(128 * GIB),
            disk_bytes: Some(64 * GIB),
            hbm: Some(4.3e12),
            notes: Vec::new(),
            ..Machine::h100()
        };
        m.note("device_bytes", "the H200's datasheet (nvidia-smi showed 143771 MiB)");
        m.note("host_bytes", "the nvidia-h200 machine's memory");
        m.note("disk_bytes", "the nvidia-h200 machine's disk");
        m.note("h2d", assumed("PCIe Gen5 measurement"));
        m.note("d2h", assumed("PCIe Gen5 measurement"));
        m.note("both_ways", assumed("PCIe Gen5 measurement"));
        m.note("host_copy", "not in the preset: measured on the machine that runs");
        m.note("host_update", assumed("estimate"));
        m.note("disk_read", assumed("virtual disk"));
        m.note("disk_write", assumed("virtual disk"));
        m.note(
            "hbm",
            "a device-to-device copy (read + write) measured on an H200 of this workplace \
             (2026-10-28, 2026-11-04); the datasheet says 4.8 TB/s",
        );
        m.note(
            "gemm_flops",
            format!(
                "{}, scaled by nothing (the same Hopper SMs; PyTorch's 8192³ bf16 product ran \
                 at 769 to 798 TFLOP/s on one)",
                assumed("GEMM rate")
            ),
        );
        m.note("model_flops", assumed("target (issue 32's)"));
        m.note("launch_seconds", assumed("assumption"));
        m
    }

    /// Records where `figure` (a field's name, as in [`Machine::notes`]) comes from, replacing
    /// what was noted for it before.
    pub fn note(&mut self, figure: &'static str, source: impl Into<String>) {
        let source = source.into();
        match self.notes.iter_mut().find(|(f, _)| *f == figure) {
            Some(n) => n.1 = source,
            None => self.notes.push((figure, source)),
        }
    }

    /// Where `figure` comes from, as noted.
    pub fn source(&self, figure: &str) -> Option<&str> {
        self.notes.iter().find(|(f, _)| *f == figure).map(|(_, s)| s.as_str())
    }

    /// `value`, the figure named `figure`, when it is known and usable (finite and positive);
    /// otherwise an [`Error::InvalidArgument`] naming the machine, the figure and why it is not
    /// known where a note says so.
    pub fn require(&self, figure: &str, value: Option<f64>) -> Result<f64> {
        match value {
            Some(v) if v.is_finite() && v > 0.0 => Ok(v),
            Some(v) => Err(Error::InvalidArgument(format!(
                "{}: {figure} is {v}, not a positive finite figure",
                self.name
            ))),
            None => Err(Error::InvalidArgument(format!(
                "{}: {figure} is not known{}: measure it or give it",
                self.name,
                self.source(figure).map_or(String::new(), |s| format!(" ({s})"))
            ))),
        }
    }

    /// `bytes` over `rate` in seconds: 0 for no bytes, `None` where bytes must move and the rate
    /// is not known (or not positive).
    pub fn seconds(bytes: u64, rate: Option<f64>) -> Option<f64> {
        if bytes == 0 {
            return Some(0.0);
        }
        rate.filter(|r| r.is_finite() && *r > 0.0).map(|r| bytes as f64 / r)
    }

    /// The rates a trainer's floor is made with, on one line (`?` where not known).
    pub fn rates(&self) -> String {
        let gbs = |x: Option<f64>| x.map_or("?".to_string(), |x| format!("{:.1}", x / 1e9));
        let disk = match (self.disk_read, self.disk_write) {
            (r, w) if r == w => gbs(r),
            (r, w) => format!("{}/{}", gbs(r), gbs(w)),
        };
        format!(
            "PCIe at {}/{} GB/s, host AdamW at {} GB/s, disk at {} GB/s{}",
            gbs(self.h2d),
            gbs(self.d2h),
            gbs(self.host_update),
            disk,
            self.model_flops
                .map_or(String::new(), |x| format!(", compute at {:.0} TFLOPS", x / 1e12))
        )
    }

    /// The consistency rules every machine's figures keep: both-ways between the faster
    /// direction and the sum of both; memories and rates positive and finite where known.
    pub fn check(&self) -> Result<()> {
        let bad = |why: String| Err(Error::InvalidArgument(format!("{}: {why}", self.name)));
        let rates = [
            ("h2d", self.h2d),
            ("d2h", self.d2h),
            ("both_ways", self.both_ways),
            ("host_copy", self.host_copy),
            ("host_update", self.host_update),
            ("disk_read", self.disk_read),
            ("disk_write", self.disk_write),
            ("hbm", self.hbm),
            ("gemm_flops", self.gemm_flops),
            ("model_flops", self.model_flops),
        ];
        for (name, r) in rates {
            if let Some(r) = r {
                if !(r.is_finite() && r > 0.0) {
                    return bad(format!("{name} is {r}: rates must be positive and finite"));
                }
            }
        }
        if let Some(l) = self.launch_seconds {
            if !(l.is_finite() && l >= 0.0) {
                return bad(format!("launch_seconds is {l}: it must be finite and not negative"));
            }
        }
        if let (Some(h), Some(d), Some(b)) = (self.h2d, self.d2h, self.both_ways) {
            if b < h.max(d) || b > h + d {
                return bad(format!(
                    "both_ways ({b}) must lie between the faster direction ({}) and the sum of \
                     both ({})",
                    h.max(d),
                    h + d
                ));
            }
        }
        Ok(())
    }
}

impl Machine {
    /// A figure's value in its unit (`80.00 GiB`, `54.30 GB/s`), `None` where it is not known or
    /// `figure` names none.
    pub fn value(&self, figure: &str) -> Option<String> {
        let rate = |r: Option<f64>, unit: f64, u: &str| r.map(|r| format!("{:.2} {u}", r / unit));
        match figure {
            "device_bytes" => self.device_bytes.map(format_size),
            "host_bytes" => self.host_bytes.map(format_size),
            "disk_bytes" => self.disk_bytes.map(format_size),
            "h2d" => rate(self.h2d, 1e9, "GB/s"),
            "d2h" => rate(self.d2h, 1e9, "GB/s"),
            "both_ways" => rate(self.both_ways, 1e9, "GB/s"),
            "host_copy" => rate(self.host_copy, 1e9, "GB/s"),
            "host_update" => rate(self.host_update, 1e9, "GB/s"),
            "disk_read" => rate(self.disk_read, 1e9, "GB/s"),
            "disk_write" => rate(self.disk_write, 1e9, "GB/s"),
            "hbm" => rate(self.hbm, 1e12, "TB/s"),
            "gemm_flops" => rate(self.gemm_flops, 1e12, "TFLOP/s"),
            "model_flops" => rate(self.model_flops, 1e12, "TFLOP/s"),
            "launch_seconds" => self.launch_seconds.map(|s| format!("{:.1} µs", s * 1e6)),
            _ => None,
        }
    }

    /// One line per figure of `figures`: its value and where it comes from, or that it is not
    /// known and why where a note says.
    pub fn describe(&self, figures: &[&str]) -> String {
        let mut out = String::new();
        for &name in figures {
            let line = match (self.value(name), self.source(name)) {
                (Some(v), Some(s)) => format!("{name} {v} ({s})"),
                (Some(v), None) => format!("{name} {v}"),
                (None, Some(s)) => format!("{name} not known ({s})"),
                (None, None) => format!("{name} not known"),
            };
            out.push_str(&line);
            out.push('\n');
        }
        out
    }
}

impl fmt::Display for Machine {
    /// The name, then every figure as [`Machine::describe`] gives it, indented.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}:", self.name)?;
        for line in self.describe(&FIGURES).lines() {
            writeln!(f, "  {line}")?;
        }
        if self.device_is_host {
            writeln!(f, "  the device's memory is the host's")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The presets keep the rules every machine keeps, note a source for every figure they
    /// give, and the H200's link and GEMM rate say that they are assumptions.
    #[test]
    fn presets_are_consistent_and_say_where_each_figure_comes_from() {
        for m in [Machine::h100(), Machine::h200()] {
            m.check().unwrap();
            let (h, d, b) = (m.h2d.unwrap(), m.d2h.unwrap(), m.both_ways.unwrap());
            assert!(b >= h.max(d) && b <= h + d, "{}", m.name);
            assert!(m.device_bytes.unwrap() > 0 && m.host_bytes.unwrap() > 0, "{}", m.name);
            for figure in FIGURES {
                assert!(m.source(figure).is_some(), "{}: no note for {figure}", m.name);
            }
            assert!(m.host_copy.is_none(), "no preset host copy rate: it is measured");
            assert!(m.hbm.unwrap() < 5e12 && m.gemm_flops.unwrap() > m.model_flops.unwrap());
        }
        let (h100, h200) = (Machine::h100(), Machine::h200());
        assert!(h200.device_bytes > h100.device_bytes && h200.hbm > h100.hbm);
        for f in ["h2d", "d2h", "both_ways", "gemm_flops"] {
            assert!(h200.source(f).unwrap().contains("assumed"), "{f}");
            assert!(!h100.source(f).unwrap().contains("assumed"), "{f}");
        }
        assert_eq!((h200.h2d, h200.d2h, h200.gemm_flops), (h100.h2d, h100.d2h, h100.gemm_flops));
        assert!(h200.name.contains("H200") && h200.name.contains("141 GB"));
        let shown = h200.to_string();
        assert!(shown.contains("  h2d 54.30 GB/s (assumed: the H100 preset's PCIe"), "{shown}");
        assert!(shown.contains("host_copy not known (not in the preset"), "{shown}");
    }

    /// A machine whose link breaks the two-way rule, or a rate that is not positive, is refused
    /// naming the machine; a figure not known is refused by `require` with its note.
    #[test]
    fn inconsistent_or_missing_figures_are_refused_by_name() {
        let m = Machine { both_ways: Some(120e9), ..Machine::h100() };
        let e = m.check().unwrap_err().to_string();
        assert!(e.contains("H100 preset") && e.contains("both_ways"), "{e}");
        let m = Machine { both_ways: Some(50e9), ..Machine::h100() };
        assert!(m.check().is_err());
        let m = Machine { hbm: Some(f64::NAN), ..Machine::h100() };
        assert!(m.check().unwrap_err().to_string().contains("hbm"));
        let m = Machine { launch_seconds: Some(-1.0), ..Machine::h100() };
        assert!(m.check().is_err());
        let h = Machine::h100();
        assert_eq!(h.require("h2d", h.h2d).unwrap(), 54.3e9);
        let e = h.require("host_copy", h.host_copy).unwrap_err().to_string();
        assert!(e.contains("host_copy is not known (not in the preset"), "{e}");
        assert!(h.require("d2h", Some(0.0)).is_err());
        let mut u = Machine::unknown("x");
        u.check().unwrap();
        u.note("h2d", "no GPU");
        u.note("h2d", "not measured");
        assert_eq!(u.notes, vec![("h2d", "not measured".to_string())]);
        assert_eq!(Machine::seconds(0, None), Some(0.0));
        assert_eq!(Machine::seconds(10, None), None);
        assert_eq!(Machine::seconds(10, Some(5.0)), Some(2.0));
        assert_eq!(Machine::seconds(10, Some(0.0)), None);
    }
}
