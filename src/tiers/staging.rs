//! Pinned staging buffers shared by the threads that move bytes between pageable memory or disk
//! and the Device tier, and the parallel host copier that keeps staging up with PCIe.

use std::sync::Arc;

use crossbeam::channel::{bounded, unbounded, Sender};
use parking_lot::{Condvar, Mutex};

use super::arena::StagingBuf;
use crate::backend::Backend;
use crate::base::error::Result;

/// Pinned staging buffers reserved at build, lent to one operation at a time in sets of a few
/// (one copy in flight per buffer while the CPU fills the next). Taking them waits, without the
/// store's lock, until enough are free; a set is taken whole, so two operations never each hold
/// half of what the other needs.
pub(crate) struct StagingPool {
    /// Free buffers, the longest free first: a buffer is reused as late as possible, so the copy
    /// that last used it has most likely finished and taking it costs no wait.
    free: Mutex<std::collections::VecDeque<StagingBuf>>,
    cv: Condvar,
    total: usize,
    size: usize,
}

impl StagingPool {
    /// `count` buffers (at least 2) of `size` bytes each.
    pub(crate) fn new(backend: &Backend, count: usize, size: usize) -> Result<StagingPool> {
        let count = count.max(2);
        let bufs = (0..count).map(|_| StagingBuf::new(backend, size)).collect::<Result<_>>()?;
        Ok(StagingPool { free: Mutex::new(bufs), cv: Condvar::new(), total: count, size })
    }

    /// Buffers a copy of `bytes` goes through: one for a copy that fits one buffer, else two
    /// (the CPU fills one while the other's DMA runs).
    pub(crate) fn wanted(&self, bytes: usize) -> usize {
        if bytes <= self.size {
            1
        } else {
            2
        }
    }

    /// Takes `n` buffers (at most half the pool, at least one), waiting until they are free.
    /// They go back when the returned set drops. The caller holds no store lock.
    pub(crate) fn take(&self, n: usize) -> StagingSet<'_> {
        crate::base::sync::assert_unlocked("waiting for staging buffers");
        let n = n.clamp(1, (self.total / 2).max(1));
        let mut free = self.free.lock();
        while free.len() < n {
            self.cv.wait(&mut free);
        }
        let bufs = free.drain(..n).collect();
        StagingSet { pool: self, bufs }
    }
}

/// Staging buffers lent by a [`StagingPool`]; returned on drop.
pub(crate) struct StagingSet<'a> {
    pool: &'a StagingPool,
    pub(crate) bufs: Vec<StagingBuf>,
}

impl Drop for StagingSet<'_> {
    fn drop(&mut self) {
        let mut free = self.pool.free.lock();
        free.extend(self.bufs.drain(..));
        self.pool.cv.notify_all();
    }
}

/// Worker threads that split a large host memcpy, so pageable-to-pinned staging keeps up with
/// PCIe (one thread copies ~10 GB/s; a Gen5 link moves ~55 GB/s).
pub(crate) struct ParallelCopier {
    tx: Option<Sender<CopyTask>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

struct CopyTask {
    dst: *mut u8,
    src: *const u8,
    len: usize,
    done: Sender<()>,
}

// SAFETY: `copy` blocks until every task it sent has signalled `done`, so the borrowed slices the
// pointers come from outlive the tasks; tasks cover disjoint parts of the destination.
unsafe impl Send for CopyTask {}

/// Whether large copies use non-temporal (streaming) stores. They skip the read-for-ownership
/// of destination cache lines, a third of a memcpy's memory traffic, which matters when the
/// copy into pinned staging competes with the DMA engine reading it (STRATA_NT_COPY=0 turns
/// them off, to measure the difference).
fn streaming_stores() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("STRATA_NT_COPY").map_or(true, |v| v != "0"))
}

/// Copies `len` bytes, with non-temporal stores on x86-64 when enabled.
///
/// # Safety
/// `src` is valid for reads and `dst` for writes of `len` bytes, and the ranges do not overlap.
unsafe fn copy_streaming(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if streaming_stores() && len >= 4096 {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        // Align the destination to 16 bytes with a plain copy of the head.
        let head = (16 - dst as usize % 16) % 16;
        // SAFETY: head < 16 <= len, inside both ranges (caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        let body = (len - head) / 64 * 64;
        let mut i = head;
        while i < head + body {
            // SAFETY: i + 64 <= len; `dst + i` is 16-byte aligned (head aligned it and i - head
            // is a multiple of 64); unaligned loads are allowed by _mm_loadu_si128; SSE2 is part
            // of the x86-64 baseline.
            unsafe {
                let s = src.add(i) as *const __m128i;
                let d = dst.add(i) as *mut __m128i;
                let (a, b, c, e) = (
                    _mm_loadu_si128(s),
                    _mm_loadu_si128(s.add(1)),
                    _mm_loadu_si128(s.add(2)),
                    _mm_loadu_si128(s.add(3)),
                );
                _mm_stream_si128(d, a);
                _mm_stream_si128(d.add(1), b);
                _mm_stream_si128(d.add(2), c);
                _mm_stream_si128(d.add(3), e);
            }
            i += 64;
        }
        // SAFETY: the tail lies inside both ranges; the fence orders the streaming stores before
        // the completion signal the caller sends after this returns.
        unsafe {
            std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i);
            _mm_sfence();
        }
        return;
    }
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

/// Below this, one thread copies: the hand-off costs more than it saves.
const PARALLEL_MIN: usize = 4 << 20;

impl ParallelCopier {
    pub(crate) fn new(threads: usize) -> ParallelCopier {
        let (tx, rx) = unbounded::<CopyTask>();
        let threads = (0..threads)
            .filter_map(|i| {
                let rx = rx.clone();
                std::thread::Builder::new()
                    .name(format!("strata-memcpy-{i}"))
                    .spawn(move || {
                        for t in rx {
                            // SAFETY: see CopyTask: the ranges are valid, disjoint, and the
                            // sender waits for `done`.
                            unsafe { copy_streaming(t.dst, t.src, t.len) };
                            let _ = t.done.send(());
                        }
                    })
                    .ok()
            })
            .collect();
        ParallelCopier { tx: Some(tx), threads }
    }

    /// `dst.copy_from_slice(src)`, split across the workers when large. Unequal lengths copy
    /// the shorter prefix (callers pass equal ones).
    pub(crate) fn copy(&self, dst: &mut [u8], src: &[u8]) {
        let len = dst.len().min(src.len());
        let (dst, src) = (&mut dst[..len], &src[..len]);
        let n = self.threads.len();
        let Some(tx) = self.tx.as_ref().filter(|_| n > 1 && len >= PARALLEL_MIN) else {
            dst.copy_from_slice(src);
            return;
        };
        let piece = len.div_ceil(n).next_multiple_of(4096);
        let (done_tx, done_rx) = bounded(n);
        let mut sent = 0;
        for (d, s) in dst.chunks_mut(piece).zip(src.chunks(piece)) {
            let task = CopyTask {
                dst: d.as_mut_ptr(),
                src: s.as_ptr(),
                len: s.len(),
                done: done_tx.clone(),
            };
            match tx.send(task) {
                Ok(()) => sent += 1,
                Err(e) => d.copy_from_slice(&s[..e.into_inner().len]),
            }
        }
        drop(done_tx);
        let mut lost = 0;
        for _ in 0..sent {
            // A worker that panicked drops its sender: its piece may be half copied.
            if done_rx.recv().is_err() {
                lost += 1;
            }
        }
        if lost > 0 {
            // Copy it all again on this thread rather than return half-copied data.
            dst.copy_from_slice(src);
        }
    }
}

impl Drop for ParallelCopier {
    fn drop(&mut self) {
        self.tx.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A shared copier sized to the machine.
pub(crate) fn copier() -> Arc<ParallelCopier> {
    static COPIER: std::sync::OnceLock<Arc<ParallelCopier>> = std::sync::OnceLock::new();
    COPIER
        .get_or_init(|| {
            // STRATA_COPY_THREADS overrides the default (every core, at most 16).
            let n = std::env::var("STRATA_COPY_THREADS")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or_else(|| {
                    std::thread::available_parallelism().map_or(1, |n| n.get()).min(16)
                })
                .max(1);
            Arc::new(ParallelCopier::new(n))
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::host::HostBackend;

    #[test]
    fn parallel_copy_matches() {
        let c = ParallelCopier::new(4);
        let src: Vec<u8> = (0..(9 << 20) + 13).map(|i| (i * 7 % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        c.copy(&mut dst, &src);
        assert_eq!(dst, src);
    }

    #[test]
    fn sets_are_taken_whole_and_given_back() {
        let be = Backend::Host(HostBackend::new().unwrap());
        let pool = StagingPool::new(&be, 4, 4096).unwrap();
        let a = pool.take(2);
        let b = pool.take(9); // clamped to half the pool
        assert_eq!((a.bufs.len(), b.bufs.len()), (2, 2));
        drop(a);
        drop(b);
        assert_eq!(pool.take(2).bufs.len(), 2);
        assert_eq!(pool.free.lock().len(), 4);
        assert_eq!((pool.wanted(4096), pool.wanted(4097)), (1, 2));
    }
}
