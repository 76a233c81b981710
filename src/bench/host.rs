//! `host_memcpy`: the host copy the store's memory-to-memory paths are made of.

use std::sync::Barrier;
use std::time::Instant;

use crate::error::{Error, Result};

/// Below this one thread copies, as in the store's copier (the hand-off costs more than it
/// saves).
const PARALLEL_MIN: usize = 4 << 20;

/// Threads the store's copier uses on this machine.
fn copier_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).min(16)
}

/// Times a copy of `bytes` between two host buffers, split over as many threads as the store's
/// copier uses (one below 4 MiB). The threads are started once, before the clock runs: each
/// timed run only releases them and waits for them, as the copier's standing threads do.
pub(super) fn memcpy(bytes: usize, warmup: usize, reps: usize) -> Result<crate::probe::Timing> {
    let threads = if bytes >= PARALLEL_MIN { copier_threads() } else { 1 };
    memcpy_on(bytes, threads, warmup, reps)
}

/// [`memcpy`] on exactly `threads` threads (at least one), for bounds that must use the same
/// threads as the work they bound (the optimizer's CPU step).
pub(crate) fn memcpy_on(
    bytes: usize,
    threads: usize,
    warmup: usize,
    reps: usize,
) -> Result<crate::probe::Timing> {
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
    Ok(crate::probe::Timing { seconds, bytes: bytes as u64 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memcpy_times_every_run() {
        for bytes in [1, 4096, PARALLEL_MIN + 3] {
            let t = memcpy(bytes, 1, 3).unwrap();
            assert_eq!(t.seconds.len(), 3);
            assert_eq!(t.bytes, bytes as u64);
            assert!(t.gbps() > 0.0);
        }
        assert!(memcpy(0, 0, 1).is_err());
        assert!(memcpy(10, 0, 0).is_err());
    }
}
