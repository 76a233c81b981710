//! Simulated time for the host backend: the clock a simulated store's streams and events share.
//! The model is described on [`Simulation`].

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::base::machine::Machine;

/// A GPU machine to simulate on the host backend: what a run would cost on it, computed on a
/// machine without one.
///
/// A store built with [`StoreBuilder::simulate`](crate::StoreBuilder::simulate) runs on the host
/// backend with streams that have no threads: every copy and every host "kernel" runs at once on
/// the thread that issues it, and is placed on a simulated timeline:
///
/// - a copy on the host-to-device or device-to-host stream starts when its stream is free, the
///   events it waits for have completed and the host has issued it, and moves
///   `bytes × bytes_scale` at the direction's bandwidth, or, while a copy in the other direction
///   is already scheduled, at what that copy leaves of the two-way bandwidth (one copy engine
///   each way, one link);
/// - a kernel issued by [`Linalg`](crate::compute::linalg::Linalg) takes
///   `flops × flops_scale / gemm_flops_per_s` (GEMMs) or `bytes × scale / memory_bytes_per_s`
///   (elementwise work; `scale` is `bytes_scale` for store tensors and weight-shaped operands,
///   `matrix_bytes_scale` for `Linalg` matrices such as activations);
/// - the host's clock advances by `launch_seconds` per operation it issues, and jumps forward
///   when it waits for an event (a `synchronize`), as a host thread blocks.
///
/// Running the operations in issue order is a valid execution, since a stream only ever waits for
/// events recorded before, so the bytes are those a GPU would compute and the timeline is that of
/// the dependency graph the store and its caller built. Runs are deterministic. The scales let a
/// small model stand for a large one: a model whose tensors are `k` times smaller and whose GEMMs
/// do `m` times fewer flops runs with `bytes_scale = k`, `flops_scale = m`, and is timed as the
/// large one (`strata train-demo --simulate h100` does this).
///
/// What the model leaves out: the host's own run time (only `launch_seconds` per operation
/// counts); contention between kernels (each stream is its own lane, so kernels on different
/// streams overlap freely); the time of disk reads (none) and of work a caller runs through
/// [`Stream::launch_host`](crate::Stream::launch_host) or
/// [`DeviceView::with_host_bytes`](crate::DeviceView::with_host_bytes) (none); and fairness
/// between the two directions (a copy already scheduled keeps its time, since its event may have
/// been waited on; the copy scheduled after it takes the whole slowdown, or gets half the two-way
/// bandwidth: see [`LinkSharing`]). A simulated store has
/// no disk-worker threads: disk-to-device copies go through staging on the issuing thread, which
/// waits for each staging buffer to drain (a GPU store's workers would wait instead), so loops
/// fed from the Disk tier are timed as host-bound. It is a model for planning and for finding a
/// pipeline's bubbles, not a measurement.
///
/// Start from a machine ([`Simulation::of`]) and change fields: the struct may gain fields, so it
/// cannot be written as a literal outside strata. The rates are the machine's; the scales and the
/// link sharing are the simulation's own.
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct Simulation {
    /// Host-to-device copy bandwidth, bytes per second.
    pub h2d_bytes_per_s: f64,
    /// Device-to-host copy bandwidth, bytes per second.
    pub d2h_bytes_per_s: f64,
    /// Both directions at once, bytes per second in all.
    pub both_bytes_per_s: f64,
    /// GEMM throughput, flops per second.
    pub gemm_flops_per_s: f64,
    /// Elementwise kernels' memory throughput (bytes read and written), bytes per second.
    pub memory_bytes_per_s: f64,
    /// Host time to issue one copy or kernel, seconds.
    pub launch_seconds: f64,
    /// How a copy scheduled while the other direction copies shares the link.
    pub sharing: LinkSharing,
    /// Bytes each copied byte, or byte of elementwise work on a store tensor, stands for.
    pub bytes_scale: f64,
    /// Bytes each byte of elementwise work on a [`Matrix`](crate::compute::linalg::Matrix) (activations,
    /// gradients in flight) stands for.
    pub matrix_bytes_scale: f64,
    /// Flops each computed flop stands for.
    pub flops_scale: f64,
}

impl Simulation {
    /// The simulator's view of `machine`: its `h2d`, `d2h`, `both_ways`, `gemm_flops`, `hbm`
    /// (elementwise work) and `launch_seconds`, copies sharing the link as
    /// [`LinkSharing::Leftover`], scales 1. A figure the machine lacks, or rates that break the
    /// two-way rule, is an [`Error::InvalidArgument`](crate::Error::InvalidArgument) naming it.
    ///
    /// `Simulation::of(&Machine::h100())` is the reference H100 of `docs/benchmarks.md`'s
    /// simulated figures (pinned H2D 54.3 GB/s, D2H 55.0 GB/s, 88 GB/s both ways, bf16 GEMMs at
    /// 796 TFLOP/s, elementwise work at 3 TB/s, 5 µs per launch: see
    /// [`Machine::h100`](crate::Machine::h100) for where each comes from).
    pub fn of(machine: &Machine) -> crate::Result<Simulation> {
        let need = |figure: &str, value: Option<f64>| machine.require(figure, value);
        let launch = machine.launch_seconds.ok_or_else(|| {
            crate::Error::InvalidArgument(format!(
                "{}: launch_seconds is not known: a simulation needs it",
                machine.name
            ))
        })?;
        let sim = Simulation {
            h2d_bytes_per_s: need("h2d", machine.h2d)?,
            d2h_bytes_per_s: need("d2h", machine.d2h)?,
            both_bytes_per_s: need("both_ways", machine.both_ways)?,
            gemm_flops_per_s: need("gemm_flops", machine.gemm_flops)?,
            memory_bytes_per_s: need("hbm", machine.hbm)?,
            launch_seconds: launch,
            sharing: LinkSharing::Leftover,
            bytes_scale: 1.0,
            matrix_bytes_scale: 1.0,
            flops_scale: 1.0,
        };
        sim.check()?;
        Ok(sim)
    }

    /// The same machine with each simulated byte (of copies and of all elementwise work)
    /// standing for `bytes` and each flop for `flops`.
    pub fn scaled(mut self, bytes: f64, flops: f64) -> Simulation {
        self.bytes_scale = bytes;
        self.matrix_bytes_scale = bytes;
        self.flops_scale = flops;
        self
    }

    pub(crate) fn check(&self) -> crate::Result<()> {
        let rates = [
            self.h2d_bytes_per_s,
            self.d2h_bytes_per_s,
            self.both_bytes_per_s,
            self.gemm_flops_per_s,
            self.memory_bytes_per_s,
            self.bytes_scale,
            self.matrix_bytes_scale,
            self.flops_scale,
        ];
        if rates.iter().any(|r| !(r.is_finite() && *r > 0.0))
            || !(self.launch_seconds.is_finite() && self.launch_seconds >= 0.0)
        {
            return Err(crate::Error::InvalidArgument(format!(
                "a simulation needs positive, finite rates and scales: {self:?}"
            )));
        }
        let one_way = self.h2d_bytes_per_s.max(self.d2h_bytes_per_s);
        let two_ways = self.h2d_bytes_per_s + self.d2h_bytes_per_s;
        if self.both_bytes_per_s < one_way || self.both_bytes_per_s > two_ways {
            return Err(crate::Error::InvalidArgument(format!(
                "both_bytes_per_s ({}) must lie between the faster direction ({one_way}) and the \
                 sum of both ({two_ways})",
                self.both_bytes_per_s
            )));
        }
        Ok(())
    }
}

/// How a copy scheduled while a copy in the other direction is running shares the link. The
/// copy already scheduled keeps its rate either way (its end may have been waited on), so the
/// two bracket a fair split: `Leftover` is pessimistic for the later copy, `Half` optimistic.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LinkSharing {
    /// It gets what the other copy leaves of `both_bytes_per_s` (the link never carries more).
    #[default]
    Leftover,
    /// It gets half of `both_bytes_per_s` (the link may carry more than that in all).
    Half,
}

/// Which engine a simulated stream stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lane {
    H2d,
    D2h,
    Compute,
}

/// Copies scheduled per direction, kept for the two-way rule.
const KEEP_INTERVALS: usize = 4096;

/// The simulated clock shared by a backend's streams and events.
pub(crate) struct SimClock {
    pub(crate) spec: Simulation,
    /// The instant simulated time 0 stands for (so events can be given as instants).
    base: Instant,
    /// The host's simulated time, seconds.
    now: Mutex<f64>,
    /// Scheduled copies of each direction: (start, end, bytes per second), in order.
    copies: Mutex<[VecDeque<(f64, f64, f64)>; 2]>,
}

impl SimClock {
    pub(crate) fn new(spec: Simulation) -> Arc<SimClock> {
        Arc::new(SimClock {
            spec,
            base: Instant::now(),
            now: Mutex::new(0.0),
            copies: Mutex::new([VecDeque::new(), VecDeque::new()]),
        })
    }

    /// The host's simulated time.
    pub(crate) fn now(&self) -> f64 {
        *self.now.lock()
    }

    /// The host issues an operation: its clock advances by the launch cost; returns the time
    /// the operation reaches its stream.
    pub(crate) fn issue(&self) -> f64 {
        let mut now = self.now.lock();
        *now += self.spec.launch_seconds;
        *now
    }

    /// The host waits until simulated time `t`.
    pub(crate) fn wait_until(&self, t: f64) {
        let mut now = self.now.lock();
        *now = now.max(t);
    }

    /// Simulated time `t` as an instant.
    pub(crate) fn instant(&self, t: f64) -> Instant {
        self.base + Duration::from_secs_f64(t.max(0.0))
    }

    /// The instant simulated time 0 stands for.
    pub(crate) fn base(&self) -> Instant {
        self.base
    }

    /// Seconds of device work for `flops` of GEMM, `bytes` of elementwise memory traffic on store
    /// tensors (and weight-shaped operands) and `matrix_bytes` on `Linalg` matrices.
    pub(crate) fn kernel_seconds(&self, flops: f64, bytes: f64, matrix_bytes: f64) -> f64 {
        let s = &self.spec;
        flops * s.flops_scale / s.gemm_flops_per_s
            + (bytes * s.bytes_scale + matrix_bytes * s.matrix_bytes_scale) / s.memory_bytes_per_s
    }

    /// When a copy of `bytes` on `lane` that starts at `start` ends, and records it.
    ///
    /// While a copy in the other direction is scheduled, this one gets what that copy leaves of
    /// the two-way bandwidth (at most its own direction's): the link never carries more than
    /// `both_bytes_per_s` in all. Copies already scheduled keep their times (their events may
    /// have been waited on), so the newcomer takes the whole slowdown.
    pub(crate) fn copy_end(&self, lane: Lane, start: f64, bytes: usize) -> f64 {
        let s = &self.spec;
        let mut left = bytes as f64 * s.bytes_scale;
        let (mine, own) = match lane {
            Lane::H2d => (0, s.h2d_bytes_per_s),
            Lane::D2h => (1, s.d2h_bytes_per_s),
            Lane::Compute => return start + left / s.memory_bytes_per_s,
        };
        let mut copies = self.copies.lock();
        // The link's share for this copy from `start` on: (until when, bytes per second).
        let mut shares = Vec::new();
        let mut t = start;
        for &(a, b, other) in copies[1 - mine].iter().filter(|c| c.1 > start) {
            if a > t {
                shares.push((a, own)); // alone until the other direction's copy starts
            }
            let rate = match s.sharing {
                LinkSharing::Leftover => s.both_bytes_per_s - other,
                LinkSharing::Half => s.both_bytes_per_s / 2.0,
            };
            shares.push((b, rate.min(own).max(own * 1e-3)));
            t = b;
        }
        shares.push((f64::INFINITY, own));
        let mut segments = Vec::new();
        let mut t = start;
        for (until, rate) in shares {
            if until <= t {
                continue;
            }
            let end = (t + left / rate).min(until);
            segments.push((t, end, rate));
            left -= (end - t) * rate;
            t = end;
            if end < until || left <= 0.0 {
                break;
            }
        }
        let q = &mut copies[mine];
        q.extend(segments.into_iter().filter(|(a, b, _)| b > a));
        while q.len() > KEEP_INTERVALS {
            q.pop_front();
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> Simulation {
        Simulation {
            h2d_bytes_per_s: 100.0,
            d2h_bytes_per_s: 100.0,
            both_bytes_per_s: 120.0,
            gemm_flops_per_s: 1000.0,
            memory_bytes_per_s: 500.0,
            launch_seconds: 0.0,
            sharing: LinkSharing::Leftover,
            bytes_scale: 1.0,
            matrix_bytes_scale: 1.0,
            flops_scale: 1.0,
        }
    }

    #[test]
    fn a_copy_alone_runs_at_its_direction_bandwidth() {
        let c = SimClock::new(spec());
        assert_eq!(c.copy_end(Lane::H2d, 1.0, 200), 3.0);
        // Back to back on the same direction: no sharing.
        assert_eq!(c.copy_end(Lane::H2d, 3.0, 100), 4.0);
    }

    #[test]
    fn overlapping_directions_share_the_link() {
        let c = SimClock::new(spec().scaled(2.0, 1.0));
        // 100 bytes stand for 200: H2D alone takes [0, 2).
        assert_eq!(c.copy_end(Lane::H2d, 0.0, 100), 2.0);
        // D2H from 1: the link has 120 - 100 = 20/s left over [1, 2) (20 moved), then it is
        // alone: 180 more at 100/s.
        let end = c.copy_end(Lane::D2h, 1.0, 100);
        assert!((end - 3.8).abs() < 1e-12, "{end}");
        // An H2D copy from 2.5 overlaps that D2H's second part (at 100/s): it gets 20/s until
        // 3.8 (26 moved), then 174 at 100/s.
        let end = c.copy_end(Lane::H2d, 2.5, 100);
        assert!((end - 5.54).abs() < 1e-9, "{end}");

        // Half: the D2H copy gets 60/s while the H2D one runs (60 moved over [1, 2)), then 140
        // more alone at 100/s.
        let mut half = spec().scaled(2.0, 1.0);
        half.sharing = LinkSharing::Half;
        let c = SimClock::new(half);
        assert_eq!(c.copy_end(Lane::H2d, 0.0, 100), 2.0);
        let end = c.copy_end(Lane::D2h, 1.0, 100);
        assert!((end - 3.4).abs() < 1e-12, "{end}");
    }

    #[test]
    fn host_time_advances_by_launches_and_waits() {
        let mut s = spec();
        s.launch_seconds = 0.5;
        let c = SimClock::new(s);
        assert_eq!(c.issue(), 0.5);
        c.wait_until(0.2);
        assert_eq!(c.now(), 0.5, "waiting for the past costs nothing");
        c.wait_until(2.0);
        assert_eq!(c.issue(), 2.5);
        assert_eq!(c.kernel_seconds(1000.0, 250.0, 250.0), 2.0);
    }

    fn h100() -> Simulation {
        Simulation::of(&Machine::h100()).unwrap()
    }

    #[test]
    fn bad_specs_are_refused() {
        assert!(h100().check().is_ok());
        let mut s = h100();
        s.both_bytes_per_s = 0.0;
        assert!(s.check().is_err());
        let mut s = h100();
        s.launch_seconds = f64::NAN;
        assert!(s.check().is_err());
        // The two-way bandwidth lies between one direction's and the sum of both.
        for both in [50e9, 120e9] {
            let mut s = h100();
            s.both_bytes_per_s = both;
            assert!(s.check().is_err(), "{both}");
        }
    }

    /// The H100 preset's simulation is, number for number, the reference machine the simulated
    /// figures of `docs/benchmarks.md` were made on (what `Simulation::h100()` gave before the
    /// machine model had one home), so those figures stay true.
    #[test]
    fn the_h100_preset_simulates_the_reference_machine_of_the_benchmarks() {
        let s = h100();
        assert_eq!(
            (s.h2d_bytes_per_s, s.d2h_bytes_per_s, s.both_bytes_per_s),
            (54.3e9, 55.0e9, 88.0e9)
        );
        assert_eq!((s.gemm_flops_per_s, s.memory_bytes_per_s), (796e12, 3.0e12));
        assert_eq!(s.launch_seconds, 5e-6);
        assert_eq!(s.sharing, LinkSharing::Leftover);
        assert_eq!((s.bytes_scale, s.matrix_bytes_scale, s.flops_scale), (1.0, 1.0, 1.0));
        // The H200's: the same link and GEMMs (assumed), its own memory bandwidth.
        let h200 = Simulation::of(&Machine::h200()).unwrap();
        assert_eq!(h200, Simulation { memory_bytes_per_s: 4.3e12, ..s });
    }

    /// A machine without a figure the simulation needs, or whose link breaks the two-way rule,
    /// gives no simulation, and the error names the figure and the machine.
    #[test]
    fn a_machine_missing_a_rate_is_refused_naming_it() {
        let m = Machine { gemm_flops: None, ..Machine::h100() };
        let e = Simulation::of(&m).unwrap_err().to_string();
        assert!(e.contains("gemm_flops is not known") && e.contains("H100 preset"), "{e}");
        let m = Machine { launch_seconds: None, ..Machine::h100() };
        assert!(Simulation::of(&m).unwrap_err().to_string().contains("launch_seconds"));
        let m = Machine { both_ways: Some(200e9), ..Machine::h100() };
        assert!(Simulation::of(&m).unwrap_err().to_string().contains("both_bytes_per_s"));
        assert!(Simulation::of(&Machine::unknown("x")).is_err());
    }
}
