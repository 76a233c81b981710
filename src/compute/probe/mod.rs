//! Raw transfer measurements without the store: the reference figures the store's own paths
//! are compared with (`strata bench`, the bandwidth example, the optimizer's engine choice).
//!
//! [`GpuProbe`] measures every raw GPU path of `strata bench` ([`GpuPath`]) straight through the
//! driver: copies from pinned and pageable host memory, both directions at once, device to
//! device, a streaming kernel read of HBM, mapped (zero-copy) host memory and managed memory, a
//! sparse gather, managed-memory prefetch, and disk to device through pinned staging, timed with
//! CUDA events after warm-up like `../shared/peers/transfer_anchors.py`. Being driver code it is
//! the CUDA backend's (`backend/cuda/probe.rs`); this module publishes it and adds the host's own
//! figure, [`host_memcpy`].

use std::sync::Barrier;
use std::time::Instant;

use crate::base::error::{Error, Result};

pub use crate::backend::cuda::probe::{
    gather_shape, median, median_after_first, raw_pinned_copy, Direction, GpuInfo, GpuPath,
    GpuProbe, Timing, DISK_CHUNK, GATHER_ONE_IN, GATHER_ROW_BYTES,
};

/// Below this one thread copies, as in the store's copier (the hand-off costs more than it
/// saves).
const PARALLEL_MIN: usize = 4 << 20;

/// Threads the store's copier uses on this machine.
fn copier_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).min(16)
}

/// `host_memcpy` of `strata bench`: the host copy the store's memory-to-memory paths are made
/// of. Times a copy of `bytes` between two host buffers, split over as many threads as the store's
/// copier uses (one below 4 MiB). The threads are started once, before the clock runs: each
/// timed run only releases them and waits for them, as the copier's standing threads do.
pub fn host_memcpy(bytes: usize, warmup: usize, reps: usize) -> Result<Timing> {
    let threads = if bytes >= PARALLEL_MIN { copier_threads() } else { 1 };
    host_memcpy_on(bytes, threads, warmup, reps)
}

/// [`host_memcpy`] on exactly `threads` threads (at least one), for bounds that must use the same
/// threads as the work they bound (the optimizer's CPU step).
pub fn host_memcpy_on(bytes: usize, threads: usize, warmup: usize, reps: usize) -> Result<Timing> {
    if bytes == 0 || reps == 0 {
        return Err(Error::InvalidArgument("host_memcpy of 0 bytes or 0 runs".into()));
    }
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let runs = warmup + reps;
    let threads = threads.max(1);
    let mut seconds = Vec::with_capacity(reps);
    if threads == 1 {
        for run in 0..runs {
            let t = Instant::now();
            dst.copy_from_slice(&src);
            std::hint::black_box(&mut dst);
            if run >= warmup {
                seconds.push(t.elapsed().as_secs_f64());
            }
        }
    } else {
        let piece = bytes.div_ceil(threads);
        let workers = bytes.div_ceil(piece);
        let start = Barrier::new(workers + 1);
        let end = Barrier::new(workers + 1);
        std::thread::scope(|s| {
            for (d, sr) in dst.chunks_mut(piece).zip(src.chunks(piece)) {
                let (start, end) = (&start, &end);
                s.spawn(move || {
                    for _ in 0..runs {
                        start.wait();
                        d.copy_from_slice(sr);
                        std::hint::black_box(&mut *d);
                        end.wait();
                    }
                });
            }
            for run in 0..runs {
                let t = Instant::now();
                start.wait();
                end.wait();
                if run >= warmup {
                    seconds.push(t.elapsed().as_secs_f64());
                }
            }
        });
    }
    if dst[bytes - 1] != 1 {
        return Err(Error::InvalidArgument("host_memcpy copied wrong bytes".into()));
    }
    Ok(Timing { seconds, bytes: bytes as u64 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_shape_reads_one_row_in_a_hundred() {
        assert_eq!(gather_shape(0), (1, 0));
        assert_eq!(gather_shape(255), (1, 0));
        // 4 KiB: 16 rows, fewer than 100: one pick over the whole buffer.
        assert_eq!(gather_shape(4096), (16, 1));
        let (group, picks) = gather_shape(1 << 30);
        assert_eq!(picks, (1 << 30) / 256 / 100);
        assert!(group >= 100 && group * picks <= (1 << 30) / 256);
        assert_eq!(GpuPath::GatherHbm.counted_bytes(1 << 30), picks as u64 * 256);
    }

    #[test]
    fn counted_bytes_follow_the_reference_script() {
        assert_eq!(GpuPath::D2d.counted_bytes(1000), 2000);
        assert_eq!(GpuPath::BidirPinned.counted_bytes(1000), 2000);
        assert_eq!(GpuPath::H2dPinned.counted_bytes(1000), 1000);
        assert_eq!(GpuPath::KernelReadHbm.counted_bytes(1000), 992);
        let names: std::collections::HashSet<_> = GpuPath::ALL.iter().map(|p| p.name()).collect();
        assert_eq!(names.len(), GpuPath::ALL.len());
    }

    #[test]
    fn timing_reports_the_median() {
        let t = Timing { seconds: vec![3.0, 1.0, 2.0], bytes: 4_000_000_000 };
        assert_eq!(t.median_s(), 2.0);
        assert_eq!(t.gbps(), 2.0);
        assert_eq!(Timing { seconds: vec![], bytes: 1 }.gbps(), 0.0);
    }

    #[test]
    fn memcpy_times_every_run() {
        for bytes in [1, 4096, PARALLEL_MIN + 3] {
            let t = host_memcpy(bytes, 1, 3).unwrap();
            assert_eq!(t.seconds.len(), 3);
            assert_eq!(t.bytes, bytes as u64);
            assert!(t.gbps() > 0.0);
        }
        assert!(host_memcpy(0, 0, 1).is_err());
        assert!(host_memcpy(10, 0, 0).is_err());
    }
}
