//! Tier arenas: memory reserved from the backend once and sub-allocated per tensor, the pinned
//! staging pool, and the parallel host copier.
//!
//! Backend allocations are expensive (pinned memory costs ~460 ms per GiB, `cuMemAlloc` +
//! `cuMemFree` of 1 MiB ~62 µs on the reference machine), so a tier never allocates per tensor: it
//! reserves its budget when the store is built and hands out extents with [`ExtentAllocator`].
//!
//! ## Safety
//! The CPU reaches chunk memory through slices made from raw pointers. That is sound because an
//! [`Extent`] is a unique, non-`Clone` token for a range that the allocator never hands out twice,
//! the block lives as long as the arena, and the store orders device work against CPU access with
//! events (it waits for a copy's event before touching the bytes on the CPU).

use std::sync::Arc;

use crossbeam::channel::{bounded, unbounded, Sender};

use crate::alloc::ExtentAllocator;
use crate::backend::{Addr, Backend, Block, MemKind, RawEvent, RawStream};
use crate::error::Result;
use crate::types::Tier;

/// A tensor's host bytes lent out by [`MemArena::host_region`] to a `HostView`, which the store
/// makes only for a tensor with no other view, whose memory no copy touches, and which can
/// neither be moved, evicted nor freed until the view drops (the view holds the store alive).
pub(crate) struct HostRegion {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the region is plain host memory owned exclusively by its one view (see above).
unsafe impl Send for HostRegion {}
// SAFETY: shared access only reads.
unsafe impl Sync for HostRegion {}

impl HostRegion {
    /// The bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` is live host memory the region's owner holds exclusively
        // (type docs); `&self` rules out a concurrent `&mut`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The bytes, mutably.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`; `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// The bytes as `f32`s, when the length is a whole number of them (the start is page
    /// aligned: host arenas align extents to 4 KiB).
    pub(crate) fn f32s(&self) -> Option<&[f32]> {
        (self.len % 4 == 0 && self.ptr as usize % 4 == 0).then(|| {
            // SAFETY: as in `bytes`, and the pointer is 4-byte aligned and every bit pattern is
            // a valid f32.
            unsafe { std::slice::from_raw_parts(self.ptr.cast::<f32>(), self.len / 4) }
        })
    }

    /// The bytes as `bf16`s, mutably, when the length is a whole number of them.
    pub(crate) fn bf16s_mut(&mut self) -> Option<&mut [half::bf16]> {
        (self.len % 2 == 0 && self.ptr as usize % 2 == 0).then(|| {
            // SAFETY: as in `f32s`: `bf16` is a transparent u16, 2-byte aligned here, and every
            // bit pattern is valid; `&mut self` makes this the only reference.
            unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<half::bf16>(), self.len / 2) }
        })
    }

    /// The bytes as `bf16`s.
    pub(crate) fn bf16s(&self) -> Option<&[half::bf16]> {
        (self.len % 2 == 0 && self.ptr as usize % 2 == 0).then(|| {
            // SAFETY: as in `bf16s_mut`, shared.
            unsafe { std::slice::from_raw_parts(self.ptr.cast::<half::bf16>(), self.len / 2) }
        })
    }

    /// The bytes as `f32`s, mutably.
    pub(crate) fn f32s_mut(&mut self) -> Option<&mut [f32]> {
        (self.len % 4 == 0 && self.ptr as usize % 4 == 0).then(|| {
            // SAFETY: as in `f32s`; `&mut self` makes this the only reference.
            unsafe { std::slice::from_raw_parts_mut(self.ptr.cast::<f32>(), self.len / 4) }
        })
    }
}

/// One tensor's bytes in a memory arena. Not `Clone`: whoever holds it owns the range.
#[derive(Debug)]
pub(crate) struct Extent {
    offset: u64,
    bytes: u64,
}

/// The arena of one memory tier (Device, Pinned or Mapped): the tier's whole budget, reserved
/// from the backend once when the store is built, sub-allocated per tensor.
///
/// Reserving at build keeps CUDA allocations off the put / read / migrate path entirely, which
/// matters beyond their cost: `cuMemAlloc` and `cuMemHostAlloc` synchronize implicitly with work
/// running on the device, so an allocation in `put` would wait for the user's kernels.
pub(crate) struct MemArena {
    kind: MemKind,
    block: Block,
    alloc: ExtentAllocator,
}

impl MemArena {
    /// Reserves `capacity` bytes of `tier`'s memory kind.
    pub(crate) fn new(backend: &Backend, tier: Tier, capacity: u64) -> Result<MemArena> {
        let kind = match tier {
            Tier::Device => MemKind::Device,
            Tier::Pinned => MemKind::Pinned,
            _ => MemKind::Mapped,
        };
        // 256 B on the device (cuMemAlloc's own alignment); a page on the host so O_DIRECT reads
        // can land in place.
        let align = if tier == Tier::Device { 256 } else { 4096 };
        let len = usize::try_from(capacity).map_err(|_| {
            crate::Error::InvalidArgument(format!("{tier} budget of {capacity} bytes"))
        })?;
        let block = backend.alloc(kind, len)?;
        Ok(MemArena { kind, block, alloc: ExtentAllocator::new(capacity, align) })
    }

    /// Bytes an extent for a tensor of `bytes` takes from the budget.
    pub(crate) fn reserved_size(&self, bytes: u64) -> u64 {
        self.alloc.reserved_size(bytes)
    }

    /// Whether a tensor of `bytes` could ever fit (it is not larger than the budget).
    pub(crate) fn can_ever_fit(&self, bytes: u64) -> bool {
        self.reserved_size(bytes) <= self.alloc.len()
    }

    /// Takes an extent of `bytes`; `None` when there is no room now (the caller may evict and
    /// retry).
    pub(crate) fn alloc(&mut self, bytes: u64) -> Option<Extent> {
        self.alloc.alloc(bytes).map(|offset| Extent { offset, bytes })
    }

    /// Returns an extent's range to the arena. The caller has waited for every copy and view
    /// touching it.
    pub(crate) fn free(&mut self, ext: Extent) {
        self.alloc.free(ext.offset, ext.bytes);
    }

    /// Address of the extent (plus `offset`) for a stream copy.
    pub(crate) fn copy_addr(&self, ext: &Extent, offset: u64) -> Addr {
        self.block.copy_addr((ext.offset + offset) as usize)
    }

    /// Device address of the extent: device memory, or the device mapping of Mapped memory.
    pub(crate) fn dev_ptr(&self, ext: &Extent) -> u64 {
        self.block.dev + ext.offset
    }

    /// The extent's bytes for the CPU. `None` for the Device tier, which the store reaches only
    /// through copy streams on every backend (so the host backend exercises the same paths).
    pub(crate) fn host_slice<'a>(&'a self, ext: &'a Extent) -> Option<&'a [u8]> {
        if self.kind == MemKind::Device || !self.block.host_accessible() {
            return None;
        }
        // SAFETY: the range lies inside the block (the allocator only hands out ranges within
        // its length, which is the block's), the block lives as long as `self`, and `ext` is the
        // range's unique owner, borrowed shared here (module docs).
        Some(unsafe {
            std::slice::from_raw_parts(self.block.host.add(ext.offset as usize), ext.bytes as usize)
        })
    }

    /// The extent's bytes for the CPU, mutably. `None` for the Device tier.
    pub(crate) fn host_slice_mut<'a>(&'a self, ext: &'a mut Extent) -> Option<&'a mut [u8]> {
        if self.kind == MemKind::Device {
            return None;
        }
        self.view_bytes(ext, false)
    }

    /// The extent's bytes for a view's holder on the CPU: like `host_slice_mut`, but the Device
    /// tier too where it is host memory (the host backend, `host_backend == true`).
    pub(crate) fn view_bytes<'a>(
        &'a self,
        ext: &'a mut Extent,
        host_backend: bool,
    ) -> Option<&'a mut [u8]> {
        let b = &self.block;
        if !b.host_accessible() || (self.kind == MemKind::Device && !host_backend) {
            return None;
        }
        // SAFETY: as in host_slice; `ext` is borrowed mutably, so this is the only reference to
        // the range. On the host backend device blocks are host allocations (`host` is their
        // address), so the range is ordinary memory.
        Some(unsafe {
            std::slice::from_raw_parts_mut(b.host.add(ext.offset as usize), ext.bytes as usize)
        })
    }

    /// The extent's bytes as a region the CPU may use without the store's lock, for a
    /// [`HostView`](crate::HostView). `None` for memory the CPU cannot reach (the CUDA Device
    /// tier).
    pub(crate) fn host_region(&self, ext: &Extent, host_backend: bool) -> Option<HostRegion> {
        let b = &self.block;
        if !b.host_accessible() || (self.kind == MemKind::Device && !host_backend) {
            return None;
        }
        // SAFETY: the offset lies inside the block (the allocator hands out ranges within it).
        let ptr = unsafe { b.host.add(ext.offset as usize) };
        Some(HostRegion { ptr, len: ext.bytes as usize })
    }

    /// The budget in bytes.
    pub(crate) fn capacity(&self) -> u64 {
        self.alloc.len()
    }

    /// Bytes taken by extents.
    pub(crate) fn used(&self) -> u64 {
        self.alloc.used()
    }

    /// The largest extent that could be taken now without evicting anything.
    pub(crate) fn largest_free(&self) -> u64 {
        self.alloc.largest_free()
    }

    /// Free ranges (1 when unfragmented).
    pub(crate) fn free_ranges(&self) -> usize {
        self.alloc.free_ranges()
    }

    /// Free bytes within the budget, ignoring fragmentation.
    pub(crate) fn free_bytes(&self) -> u64 {
        self.alloc.len() - self.alloc.used()
    }
}

/// One page-locked staging buffer, reserved once. It remembers the copy using it and waits for
/// that copy before handing its bytes to the CPU again (and before it is freed).
pub(crate) struct StagingBuf {
    block: Block,
    busy: Option<RawEvent>,
}

impl StagingBuf {
    /// A buffer of `size` bytes of pinned memory.
    pub(crate) fn new(backend: &Backend, size: usize) -> Result<StagingBuf> {
        Ok(StagingBuf { block: backend.alloc(MemKind::Pinned, size)?, busy: None })
    }

    /// Size in bytes.
    pub(crate) fn len(&self) -> usize {
        self.block.len
    }

    /// Waits for the copy using the buffer, if any.
    pub(crate) fn wait(&mut self) -> Result<()> {
        if let Some(ev) = self.busy.take() {
            ev.synchronize()?;
        }
        Ok(())
    }

    /// The buffer for the CPU, once the copy that last used it is complete.
    pub(crate) fn bytes_mut(&mut self) -> Result<&mut [u8]> {
        if let Some(ev) = self.busy.take() {
            ev.synchronize()?;
        }
        // SAFETY: pinned host memory of `len` bytes owned by this buffer; the last copy using it
        // has completed (just above) and `&mut self` makes this the only reference.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.block.host, self.block.len) })
    }
}

impl Drop for StagingBuf {
    fn drop(&mut self) {
        // The block must outlive the DMA reading or writing it.
        if let Some(ev) = self.busy.take() {
            let _ = ev.synchronize();
        }
    }
}

/// Issues a copy of `n` bytes from `buf` into `ext` at `offset` on `h2d`; the buffer stays busy
/// until the returned event completes.
///
/// The store keeps `ext` allocated until the replica's `ready` event (this copy's event or a
/// later one) completes, which is what makes issuing the copy sound.
pub(crate) fn upload_piece(
    h2d: &RawStream,
    arena: &MemArena,
    ext: &Extent,
    offset: u64,
    buf: &mut StagingBuf,
    n: usize,
) -> Result<RawEvent> {
    check_range(ext, offset, n, buf.len())?;
    if let Some(ev) = buf.busy.take() {
        ev.synchronize()?;
    }
    // SAFETY: the source is `n <= len` bytes of the pinned buffer, reserved until the event
    // recorded below completes (`busy`); the destination lies inside `ext` (checked above), which
    // the store keeps allocated until the copy's event completes (see above).
    unsafe { h2d.copy(arena.copy_addr(ext, offset), buf.block.copy_addr(0), n)? };
    let ev = h2d.record()?;
    buf.busy = Some(ev.clone());
    Ok(ev)
}

/// Issues a copy of `n` bytes of `ext` at `offset` into `buf` on `d2h`; `buf.bytes_mut()` waits
/// for it.
pub(crate) fn download_piece(
    d2h: &RawStream,
    arena: &MemArena,
    ext: &Extent,
    offset: u64,
    buf: &mut StagingBuf,
    n: usize,
) -> Result<RawEvent> {
    check_range(ext, offset, n, buf.len())?;
    if let Some(ev) = buf.busy.take() {
        ev.synchronize()?;
    }
    // SAFETY: as in upload_piece, with the roles of buffer and extent swapped; the store does not
    // free `ext` while a copy out of it is in flight (the caller waits for this event).
    unsafe { d2h.copy(buf.block.copy_addr(0), arena.copy_addr(ext, offset), n)? };
    let ev = d2h.record()?;
    buf.busy = Some(ev.clone());
    Ok(ev)
}

/// Issues a DMA copy of a whole extent between two arenas (one of them the Device tier) on
/// `stream`.
pub(crate) fn copy_extent(
    stream: &RawStream,
    dst_arena: &MemArena,
    dst: &Extent,
    src_arena: &MemArena,
    src: &Extent,
) -> Result<RawEvent> {
    if dst.bytes != src.bytes {
        return Err(crate::Error::LengthMismatch {
            expected: dst.bytes,
            got: src.bytes,
            what: "extent copy".into(),
        });
    }
    // SAFETY: both extents are live (borrowed) ranges of their arenas, of equal length; host
    // memory of the Pinned and Mapped arenas is page-locked; the store keeps both allocated
    // until the returned event completes (the source's free waits for the copy's event, the
    // destination's replica is `ready` only then).
    unsafe {
        stream.copy(dst_arena.copy_addr(dst, 0), src_arena.copy_addr(src, 0), dst.bytes as usize)?
    };
    stream.record()
}

fn check_range(ext: &Extent, offset: u64, n: usize, buf_len: usize) -> Result<()> {
    if n > buf_len || offset.checked_add(n as u64).is_none_or(|end| end > ext.bytes) {
        return Err(crate::Error::InvalidArgument(format!(
            "staging copy of {n} bytes at {offset} of a {}-byte extent",
            ext.bytes
        )));
    }
    Ok(())
}

/// Staging buffers used in turn, a copy in flight per buffer.
pub(crate) struct PinnedStaging {
    bufs: Vec<StagingBuf>,
    next: usize,
}

impl PinnedStaging {
    /// `count` buffers (at least 2) of `size` bytes each.
    pub(crate) fn new(backend: &Backend, count: usize, size: usize) -> Result<PinnedStaging> {
        let bufs =
            (0..count.max(2)).map(|_| StagingBuf::new(backend, size)).collect::<Result<_>>()?;
        Ok(PinnedStaging { bufs, next: 0 })
    }

    /// Size of each buffer.
    pub(crate) fn buf_size(&self) -> usize {
        self.bufs[0].len()
    }

    /// Writes `total` bytes into `ext` on `h2d`, piece by piece: `fill(offset, piece)` fills each
    /// buffer on the CPU while the DMA of the previous pieces runs. Returns the last copy's event.
    pub(crate) fn upload(
        &mut self,
        h2d: &RawStream,
        arena: &MemArena,
        ext: &Extent,
        mut fill: impl FnMut(usize, &mut [u8]) -> Result<()>,
    ) -> Result<Option<RawEvent>> {
        let total = ext.bytes as usize;
        let step = self.buf_size();
        let mut last = None;
        let mut off = 0;
        while off < total {
            let n = step.min(total - off);
            let i = self.next;
            self.next = (i + 1) % self.bufs.len();
            let buf = &mut self.bufs[i];
            fill(off, &mut buf.bytes_mut()?[..n])?;
            last = Some(upload_piece(h2d, arena, ext, off as u64, buf, n)?);
            off += n;
        }
        Ok(last)
    }

    /// Reads `ext` back on `d2h`, two pieces in flight, handing each to `sink(offset, piece)` in
    /// order.
    pub(crate) fn download(
        &mut self,
        d2h: &RawStream,
        arena: &MemArena,
        ext: &Extent,
        mut sink: impl FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<()> {
        let total = ext.bytes as usize;
        let step = self.buf_size();
        let count = self.bufs.len();
        let mut pending = std::collections::VecDeque::new();
        let mut off = 0;
        let issue = |this: &mut PinnedStaging, off: usize| -> Result<(usize, usize, usize)> {
            let n = step.min(total - off);
            let i = this.next;
            this.next = (this.next + 1) % count;
            download_piece(d2h, arena, ext, off as u64, &mut this.bufs[i], n)?;
            Ok((i, off, n))
        };
        while off < total && pending.len() < 2 {
            let p = issue(self, off)?;
            off += p.2;
            pending.push_back(p);
        }
        while let Some((i, at, n)) = pending.pop_front() {
            sink(at, &self.bufs[i].bytes_mut()?[..n])?;
            if off < total {
                let p = issue(self, off)?;
                off += p.2;
                pending.push_back(p);
            }
        }
        Ok(())
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
        drop(done_tx);
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
    fn arena_suballocates_its_budget() {
        let be = Backend::Host(HostBackend::new().unwrap());
        let mut a = MemArena::new(&be, Tier::Pinned, 64 << 10).unwrap();
        let x = a.alloc(10_000).unwrap();
        assert_eq!(a.used(), 12288);
        let big = a.alloc(40 << 10).unwrap();
        assert!(a.alloc(16 << 10).is_none(), "over budget");
        a.free(big);
        a.free(x);
        assert_eq!(a.used(), 0);
        let mut all = a.alloc(64 << 10).unwrap();
        assert_eq!(a.used(), 64 << 10);
        a.host_slice_mut(&mut all).unwrap().fill(3);
        assert!(a.host_slice(&all).unwrap().iter().all(|&b| b == 3));
    }

    #[test]
    fn device_tier_is_not_cpu_accessible() {
        let be = Backend::Host(HostBackend::new().unwrap());
        let mut a = MemArena::new(&be, Tier::Device, 4096).unwrap();
        let mut e = a.alloc(100).unwrap();
        assert!(a.host_slice(&e).is_none());
        assert!(a.view_bytes(&mut e, true).is_some(), "host backend views reach it");
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
