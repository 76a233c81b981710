//! Tier arenas: memory reserved from the backend in large chunks and sub-allocated per tensor,
//! the pinned staging pool, and the parallel host copier.
//!
//! Backend allocations are expensive (pinned memory costs ~460 ms per GiB, `cuMemAlloc` +
//! `cuMemFree` of 1 MiB ~62 µs on the reference machine), so a tier never allocates per tensor: it
//! reserves chunks of at least `chunk_size` bytes up to its budget and hands out extents from them
//! with [`ExtentAllocator`].
//!
//! ## Safety
//! The CPU reaches chunk memory through slices made from raw pointers. That is sound because an
//! [`Extent`] is a unique, non-`Clone` token for a range that the allocator never hands out twice,
//! the chunk lives as long as the arena, and the store orders device work against CPU access with
//! events (it waits for a copy's event before touching the bytes on the CPU).

use std::sync::Arc;

use crossbeam::channel::{bounded, unbounded, Sender};

use crate::alloc::ExtentAllocator;
use crate::backend::{Addr, Backend, Block, MemKind, RawEvent};
use crate::error::Result;
use crate::types::Tier;

/// One tensor's bytes in a memory arena. Not `Clone`: whoever holds it owns the range.
#[derive(Debug)]
pub(crate) struct Extent {
    chunk: usize,
    offset: u64,
    bytes: u64,
}

impl Extent {
    /// The tensor's size in bytes (the reserved range may be larger, rounded to the alignment).
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }
}

struct Chunk {
    block: Block,
    alloc: ExtentAllocator,
}

/// The arena of one memory tier (Device, Pinned or Mapped).
pub(crate) struct MemArena {
    kind: MemKind,
    capacity: u64,
    chunk_size: u64,
    align: u64,
    chunks: Vec<Option<Chunk>>,
    reserved: u64,
}

impl MemArena {
    /// An arena with a budget of `capacity` bytes, growing in chunks of `chunk_size` (or the size
    /// of a tensor larger than that).
    pub(crate) fn new(tier: Tier, capacity: u64, chunk_size: u64) -> MemArena {
        let kind = match tier {
            Tier::Device => MemKind::Device,
            Tier::Pinned => MemKind::Pinned,
            _ => MemKind::Mapped,
        };
        // 256 B on the device (cuMemAlloc's own alignment); a page on the host so O_DIRECT reads
        // can land in place.
        let align = if tier == Tier::Device { 256 } else { 4096 };
        let chunk_size = chunk_size.clamp(align, capacity.max(align));
        MemArena { kind, capacity, chunk_size, align, chunks: Vec::new(), reserved: 0 }
    }

    /// Bytes an extent for a tensor of `bytes` takes from the budget.
    pub(crate) fn reserved_size(&self, bytes: u64) -> u64 {
        bytes.max(1).div_ceil(self.align) * self.align
    }

    /// Whether a tensor of `bytes` could ever fit (it is not larger than the budget).
    pub(crate) fn can_ever_fit(&self, bytes: u64) -> bool {
        self.reserved_size(bytes) <= self.capacity
    }

    /// Takes an extent of `bytes`, reserving a new chunk from the backend if needed. `Ok(None)`
    /// when there is no room within the budget now (the caller may evict and retry).
    pub(crate) fn alloc(&mut self, backend: &Backend, bytes: u64) -> Result<Option<Extent>> {
        if let Some(e) = self.alloc_in_chunks(bytes) {
            return Ok(Some(e));
        }
        let need = self.reserved_size(bytes);
        if self.reserved + need > self.capacity {
            // Give back chunks that hold nothing, so a large request can get one of its own.
            self.release_empty_chunks();
        }
        if self.reserved + need > self.capacity {
            return Ok(None);
        }
        let size = self.chunk_size.max(need).min(self.capacity - self.reserved);
        let block = backend.alloc(self.kind, size as usize)?;
        let slot = self.chunks.iter().position(Option::is_none).unwrap_or_else(|| {
            self.chunks.push(None);
            self.chunks.len() - 1
        });
        self.chunks[slot] = Some(Chunk { block, alloc: ExtentAllocator::new(size, self.align) });
        self.reserved += size;
        Ok(self.alloc_in_chunks(bytes))
    }

    fn alloc_in_chunks(&mut self, bytes: u64) -> Option<Extent> {
        // Best fit across chunks: the chunk whose allocator has the smallest largest-free range
        // that still fits keeps big ranges free for big tensors.
        let need = self.reserved_size(bytes);
        let best = self
            .chunks
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.as_ref().map(|c| (i, c.alloc.largest_free())))
            .filter(|&(_, free)| free >= need)
            .min_by_key(|&(_, free)| free)?
            .0;
        let chunk = self.chunks[best].as_mut()?;
        let offset = chunk.alloc.alloc(bytes)?;
        Some(Extent { chunk: best, offset, bytes })
    }

    fn release_empty_chunks(&mut self) {
        for slot in &mut self.chunks {
            if slot.as_ref().is_some_and(|c| c.alloc.used() == 0) {
                let c = slot.take().expect("checked just above");
                self.reserved -= c.alloc.len();
            }
        }
    }

    /// Returns an extent's range to the arena. The caller has waited for every copy and view
    /// touching it.
    pub(crate) fn free(&mut self, ext: Extent) {
        if let Some(Some(c)) = self.chunks.get_mut(ext.chunk) {
            c.alloc.free(ext.offset, ext.bytes);
        } else {
            debug_assert!(false, "extent of a chunk that is gone: {ext:?}");
        }
    }

    fn block(&self, ext: &Extent) -> &Block {
        &self.chunks[ext.chunk].as_ref().expect("extent outlived its chunk").block
    }

    /// Address of the extent (plus `offset`) for a stream copy.
    pub(crate) fn copy_addr(&self, ext: &Extent, offset: u64) -> Addr {
        self.block(ext).copy_addr((ext.offset + offset) as usize)
    }

    /// Device address of the extent: device memory, or the device mapping of Mapped memory.
    pub(crate) fn dev_ptr(&self, ext: &Extent) -> u64 {
        self.block(ext).dev + ext.offset
    }

    /// The extent's bytes for the CPU. `None` for the Device tier, which the store reaches only
    /// through copy streams on every backend (so the host backend exercises the same paths).
    pub(crate) fn host_slice<'a>(&'a self, ext: &'a Extent) -> Option<&'a [u8]> {
        let b = self.block(ext);
        if self.kind == MemKind::Device || !b.host_accessible() {
            return None;
        }
        // SAFETY: the range lies inside the chunk's block (the allocator only hands out ranges
        // within its length), the block lives as long as `self`, and `ext` is the range's unique
        // owner, borrowed shared here (module docs).
        Some(unsafe {
            std::slice::from_raw_parts(b.host.add(ext.offset as usize), ext.bytes as usize)
        })
    }

    /// The extent's bytes for the CPU, mutably. `None` for the Device tier.
    pub(crate) fn host_slice_mut<'a>(&'a self, ext: &'a mut Extent) -> Option<&'a mut [u8]> {
        let b = self.block(ext);
        if self.kind == MemKind::Device || !b.host_accessible() {
            return None;
        }
        // SAFETY: as in host_slice; `ext` is borrowed mutably, so this is the only reference to
        // the range.
        Some(unsafe {
            std::slice::from_raw_parts_mut(b.host.add(ext.offset as usize), ext.bytes as usize)
        })
    }

    /// The extent's bytes for a view's holder on the CPU: like `host_slice_mut`, but the Device
    /// tier too where it is host memory (the host backend, `host_backend == true`).
    pub(crate) fn view_bytes<'a>(
        &'a self,
        ext: &'a mut Extent,
        host_backend: bool,
    ) -> Option<&'a mut [u8]> {
        let b = self.block(ext);
        if !b.host_accessible() || (self.kind == MemKind::Device && !host_backend) {
            return None;
        }
        // SAFETY: as in host_slice_mut. On the host backend device blocks are host allocations
        // (`host` is their address), so the range is ordinary memory.
        Some(unsafe {
            std::slice::from_raw_parts_mut(b.host.add(ext.offset as usize), ext.bytes as usize)
        })
    }

    /// The budget in bytes.
    pub(crate) fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes taken by extents.
    pub(crate) fn used(&self) -> u64 {
        self.chunks.iter().flatten().map(|c| c.alloc.used()).sum()
    }

    /// Bytes reserved from the backend.
    pub(crate) fn reserved(&self) -> u64 {
        self.reserved
    }

    /// The largest extent that could be taken now without evicting anything.
    pub(crate) fn largest_free(&self) -> u64 {
        let in_chunks = self.chunks.iter().flatten().map(|c| c.alloc.largest_free()).max();
        in_chunks.unwrap_or(0).max((self.capacity - self.reserved) / self.align * self.align)
    }

    /// Free ranges inside reserved chunks (1 per chunk when unfragmented).
    pub(crate) fn free_ranges(&self) -> usize {
        self.chunks.iter().flatten().map(|c| c.alloc.free_ranges()).sum()
    }

    /// Free bytes within the budget (reserved or not), ignoring fragmentation.
    pub(crate) fn free_bytes(&self) -> u64 {
        self.capacity - self.used()
    }
}

/// Page-locked buffers reserved once, through which pageable data and disk reads reach the
/// device (and device data reaches them), a buffer per copy in flight.
pub(crate) struct PinnedStaging {
    bufs: Vec<(Block, Option<RawEvent>)>,
    next: usize,
}

impl PinnedStaging {
    /// `count` buffers of `size` bytes each.
    pub(crate) fn new(backend: &Backend, count: usize, size: usize) -> Result<PinnedStaging> {
        let bufs = (0..count.max(2))
            .map(|_| backend.alloc(MemKind::Pinned, size).map(|b| (b, None)))
            .collect::<Result<_>>()?;
        Ok(PinnedStaging { bufs, next: 0 })
    }

    /// Size of each buffer.
    pub(crate) fn buf_size(&self) -> usize {
        self.bufs[0].0.len
    }

    /// The next buffer in turn, once the copy that last used it is complete. Returns its index.
    pub(crate) fn acquire(&mut self) -> Result<usize> {
        let i = self.next;
        self.next = (self.next + 1) % self.bufs.len();
        if let Some(ev) = self.bufs[i].1.take() {
            ev.synchronize()?;
        }
        Ok(i)
    }

    /// Notes that buffer `i` is in use until `ev` completes.
    pub(crate) fn release(&mut self, i: usize, ev: RawEvent) {
        self.bufs[i].1 = Some(ev);
    }

    /// Address of buffer `i` for a stream copy.
    pub(crate) fn addr(&self, i: usize) -> Addr {
        self.bufs[i].0.copy_addr(0)
    }

    /// Buffer `i` for the CPU. The caller acquired it, so no copy is using it.
    pub(crate) fn slice_mut(&mut self, i: usize) -> &mut [u8] {
        let b = &self.bufs[i].0;
        // SAFETY: the block is pinned host memory of `len` bytes owned by this pool; `acquire`
        // waited for the last copy using it, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(b.host, b.len) }
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
                            unsafe { std::ptr::copy_nonoverlapping(t.src, t.dst, t.len) };
                            let _ = t.done.send(());
                        }
                    })
                    .ok()
            })
            .collect();
        ParallelCopier { tx: Some(tx), threads }
    }

    /// `dst.copy_from_slice(src)`, split across the workers when large.
    pub(crate) fn copy(&self, dst: &mut [u8], src: &[u8]) {
        assert_eq!(dst.len(), src.len(), "ParallelCopier::copy needs equal lengths");
        let n = self.threads.len();
        let Some(tx) = self.tx.as_ref().filter(|_| n > 1 && src.len() >= PARALLEL_MIN) else {
            dst.copy_from_slice(src);
            return;
        };
        let piece = src.len().div_ceil(n).next_multiple_of(4096);
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
        for _ in 0..sent {
            // A worker that panicked drops its sender; the copy it held would be lost, so fail
            // loudly rather than return half-copied data.
            done_rx.recv().expect("a memcpy worker died");
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
    fn arena_grows_in_chunks_within_budget() {
        let be = Backend::Host(HostBackend::new().unwrap());
        let mut a = MemArena::new(Tier::Pinned, 64 << 10, 16 << 10);
        let x = a.alloc(&be, 10_000).unwrap().unwrap();
        assert_eq!(a.reserved(), 16 << 10);
        assert_eq!(a.used(), 12288);
        let big = a.alloc(&be, 40 << 10).unwrap().unwrap();
        assert_eq!(a.reserved(), 56 << 10);
        assert!(a.alloc(&be, 16 << 10).unwrap().is_none(), "over budget");
        a.free(big);
        a.free(x);
        assert_eq!(a.used(), 0);
        // Empty chunks are given back so one tensor of the whole budget fits.
        let all = a.alloc(&be, 64 << 10).unwrap().unwrap();
        assert_eq!(a.used(), 64 << 10);
        let mut all = all;
        a.host_slice_mut(&mut all).unwrap().fill(3);
        assert!(a.host_slice(&all).unwrap().iter().all(|&b| b == 3));
    }

    #[test]
    fn device_tier_is_not_cpu_accessible() {
        let be = Backend::Host(HostBackend::new().unwrap());
        let mut a = MemArena::new(Tier::Device, 4096, 4096);
        let e = a.alloc(&be, 100).unwrap().unwrap();
        assert!(a.host_slice(&e).is_none());
    }

    #[test]
    fn parallel_copy_matches() {
        let c = ParallelCopier::new(4);
        let src: Vec<u8> = (0..(9 << 20) + 13).map(|i| (i * 7 % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        c.copy(&mut dst, &src);
        assert_eq!(dst, src);
    }
}
