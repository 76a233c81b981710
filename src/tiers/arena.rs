//! Memory arenas of the Device, Pinned and Mapped tiers, the leases through which their bytes are
//! reached without the store's lock, and the DMA copies between them.
//!
//! Backend allocations are expensive (pinned memory costs ~460 ms per GiB, `cuMemAlloc` +
//! `cuMemFree` of 1 MiB ~62 µs on the reference machine), so a tier never allocates per tensor: it
//! reserves its budget once when the store is built and hands out [`Extent`]s with an
//! [`ExtentAllocator`](super::alloc::ExtentAllocator) (kept under the store's lock, in
//! [`TierBooks`](super::TierBooks)). The memory itself ([`MemArena`]) never changes after the
//! build and is shared by every thread.
//!
//! ## Safety
//! The CPU reaches arena memory through slices made from raw pointers, and copy streams through
//! raw addresses. Both are sound because of three rules the store keeps:
//! 1. An [`Extent`] is a unique, non-`Clone` token for a range that the allocator never hands out
//!    twice, and the block lives as long as the arena.
//! 2. A [`ReadLease`] or [`WriteLease`] is made under the store's lock from an extent of a tensor
//!    that the maker has *in flight* (a shared read flight, or an exclusive flight); the store
//!    defers every free of that extent until the flight has ended, so the range stays allocated
//!    while the lease lives. During an exclusive flight no one else reads or writes the tensor's
//!    bytes on the CPU; during a read flight everyone only reads them.
//! 3. Device work is ordered against CPU access with events: the store waits for a copy's event
//!    before the CPU touches bytes the copy writes or reads.

use crate::backend::{Addr, Backend, Block, MemKind, RawEvent, RawStream};
use crate::base::error::Result;
use crate::base::types::Tier;
use crate::tiers::alloc::ExtentAllocator;

/// The smallest piece a tier's budget is reserved in when the backend cannot give it whole.
pub(crate) const MIN_PIECE: u64 = 64 << 20;

/// One tensor's bytes in a memory arena. Not `Clone`: whoever holds it owns the range.
#[derive(Debug)]
pub(crate) struct Extent {
    offset: u64,
    bytes: u64,
}

impl Extent {
    /// Wraps what an allocator handed out.
    pub(crate) fn new(offset: u64, bytes: u64) -> Extent {
        Extent { offset, bytes }
    }

    /// Byte offset in the arena (or the disk slab).
    pub(crate) fn offset(&self) -> u64 {
        self.offset
    }

    /// Length of the tensor in bytes.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// The memory of one tier (Device, Pinned or Mapped): its whole budget, reserved from the backend
/// once when the store is built.
///
/// Reserving at build keeps CUDA allocations off the put / read / migrate path entirely, which
/// matters beyond their cost: `cuMemAlloc` and `cuMemHostAlloc` synchronize implicitly with work
/// running on the device, so an allocation in `put` would wait for the user's kernels.
pub(crate) struct MemArena {
    kind: MemKind,
    /// The pieces the budget was reserved in, by offset: each block and the arena offset of its
    /// first byte (the allocator's span for it). Usually one.
    chunks: Vec<(u64, Block)>,
    /// Whether the CPU may reach Device memory through `block.host` (the host backend, where
    /// device memory is emulated): only views use that; the store's own copies go through the
    /// copy streams on every backend.
    views_reach_device: bool,
}

impl MemArena {
    /// Reserves `capacity` bytes of `tier`'s memory kind, and the allocator for them: in one
    /// piece, or in pieces of at most `piece` bytes. When the backend cannot give a piece
    /// (`OutOfMemory`: no contiguous range that large), the pieces halve, down to
    /// [`MIN_PIECE`]; the largest tensor the tier can hold is its largest piece. `progress` is
    /// told the bytes reserved so far after each piece.
    pub(crate) fn new(
        backend: &Backend,
        tier: Tier,
        capacity: u64,
        piece: Option<u64>,
        progress: &mut dyn FnMut(u64),
    ) -> Result<(MemArena, ExtentAllocator)> {
        let kind = match tier {
            Tier::Device => MemKind::Device,
            Tier::Pinned => MemKind::Pinned,
            _ => MemKind::Mapped,
        };
        // 256 B on the device (cuMemAlloc's own alignment); a page on the host so O_DIRECT reads
        // can land in place.
        let align = if tier == Tier::Device { 256 } else { 4096 };
        if usize::try_from(capacity).is_err() {
            return Err(crate::Error::InvalidArgument(format!(
                "{tier} budget of {capacity} bytes"
            )));
        }
        let floor = MIN_PIECE.min(capacity);
        let mut piece = piece.unwrap_or(capacity).clamp(floor, capacity.max(1));
        let mut blocks = Vec::new();
        let mut lens = Vec::new();
        let mut done = 0u64;
        while done < capacity || blocks.is_empty() {
            let want = piece.min(capacity - done);
            match backend.alloc(kind, want as usize) {
                Ok(b) => {
                    blocks.push(b);
                    lens.push(want);
                    done += want;
                    progress(done);
                }
                Err(crate::Error::OutOfMemory { .. }) if want > floor => {
                    piece = (want / 2).next_multiple_of(align).max(floor);
                    tracing::info!(%tier, piece, "no piece of {want} bytes: reserving in smaller pieces");
                }
                Err(crate::Error::OutOfMemory { .. }) => {
                    // What was reserved is freed as `blocks` drops.
                    return Err(crate::Error::OutOfMemory { tier, bytes: capacity });
                }
                Err(e) => return Err(e),
            }
        }
        let (alloc, starts) = ExtentAllocator::with_spans(&lens, align);
        // Small host tensors share pages (a page each would put 100k tiny tensors' 200 KB in
        // 391 MiB); device memory keeps its 256 B alignment.
        let alloc = if tier == Tier::Device { alloc } else { alloc.with_small_slots() };
        let chunks = starts.into_iter().zip(blocks).collect();
        let views_reach_device = backend.kind() == crate::BackendKind::Host;
        Ok((MemArena { kind, chunks, views_reach_device }, alloc))
    }

    /// The piece holding `ext` and the extent's offset in it.
    fn chunk(&self, ext: &Extent) -> (&Block, u64) {
        let i = self.chunks.partition_point(|&(start, _)| start <= ext.offset).max(1) - 1;
        let (start, block) = &self.chunks[i];
        (block, ext.offset - start)
    }

    /// How many pieces the budget was reserved in.
    pub(crate) fn pieces(&self) -> usize {
        self.chunks.len()
    }

    /// Device address of the extent: device memory, or the device mapping of Mapped memory.
    pub(crate) fn dev_ptr(&self, ext: &Extent) -> u64 {
        let (b, off) = self.chunk(ext);
        b.dev + off
    }

    /// Whether the store's CPU code reaches this arena's bytes directly (Pinned and Mapped); the
    /// Device tier is reached through copy streams only, on every backend, so the host backend
    /// exercises the same staging paths as the GPU.
    pub(crate) fn cpu_reachable(&self) -> bool {
        self.kind != MemKind::Device && self.chunks.iter().all(|c| c.1.host_accessible())
    }

    /// A lease for reading the extent's bytes without the lock (module Safety, rule 2).
    pub(crate) fn read_lease(&self, ext: &Extent) -> ReadLease {
        ReadLease(self.lease(ext, false))
    }

    /// A lease for writing the extent's bytes without the lock (module Safety, rule 2): the
    /// caller has the tensor in an exclusive flight, or the extent is fresh and not yet visible.
    pub(crate) fn write_lease(&self, ext: &Extent) -> WriteLease {
        WriteLease(self.lease(ext, false))
    }

    /// A lease for a view's holder to reach the bytes on the CPU: like [`MemArena::write_lease`],
    /// but the Device tier too where it is host memory (the host backend). `None` where the CPU
    /// cannot reach the memory (CUDA device memory).
    pub(crate) fn view_lease(&self, ext: &Extent) -> Option<WriteLease> {
        let l = self.lease(ext, self.views_reach_device);
        (!l.cpu.is_null()).then_some(WriteLease(l))
    }

    fn lease(&self, ext: &Extent, device_cpu: bool) -> Lease {
        let (b, off) = self.chunk(ext);
        let cpu_ok = b.host_accessible() && (self.kind != MemKind::Device || device_cpu);
        let cpu = if cpu_ok {
            // `wrapping_add` keeps this free of unsafe; the offset lies inside the block (the
            // allocator hands out ranges within one span, whose length is its block's).
            b.host.wrapping_add(off as usize)
        } else {
            std::ptr::null_mut()
        };
        Lease { cpu, dma: b.copy_addr(off as usize), len: ext.bytes as usize }
    }
}

/// Where a range of tier memory is, for the CPU (null where it cannot reach it) and for copy
/// streams.
#[derive(Debug)]
struct Lease {
    cpu: *mut u8,
    dma: Addr,
    len: usize,
}

/// Shared access to an extent's bytes without the store's lock (module Safety, rule 2).
#[derive(Debug)]
pub(crate) struct ReadLease(Lease);

/// Exclusive access to an extent's bytes without the store's lock (module Safety, rule 2).
#[derive(Debug)]
pub(crate) struct WriteLease(Lease);

// SAFETY: a lease is an address range the store keeps allocated for the lease's lifetime (module
// Safety, rule 2); moving it to another thread changes nothing about who may touch the bytes.
unsafe impl Send for ReadLease {}
// SAFETY: `&ReadLease` only reads.
unsafe impl Sync for ReadLease {}
// SAFETY: as for ReadLease; a WriteLease is the only access to its range while it lives.
unsafe impl Send for WriteLease {}
// SAFETY: `&WriteLease` only reads; writing needs `&mut`.
unsafe impl Sync for WriteLease {}

impl ReadLease {
    /// The bytes, when the CPU can reach them (Pinned and Mapped memory).
    pub(crate) fn bytes(&self) -> Option<&[u8]> {
        if self.0.cpu.is_null() {
            return None;
        }
        // SAFETY: `cpu..cpu+len` lies in a live block and stays allocated while the lease lives;
        // during a read flight every other user only reads it (module Safety, rule 2).
        Some(unsafe { std::slice::from_raw_parts(self.0.cpu, self.0.len) })
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.0.len
    }
}

impl WriteLease {
    /// The bytes, when the CPU can reach them.
    pub(crate) fn bytes(&self) -> Option<&[u8]> {
        if self.0.cpu.is_null() {
            return None;
        }
        // SAFETY: as in `ReadLease::bytes`; the lease is the only access to the range, and
        // `&self` rules out a concurrent `&mut`.
        Some(unsafe { std::slice::from_raw_parts(self.0.cpu, self.0.len) })
    }

    /// The bytes, mutably, when the CPU can reach them.
    pub(crate) fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        if self.0.cpu.is_null() {
            return None;
        }
        // SAFETY: as in `bytes`; `&mut self` makes this the only reference.
        Some(unsafe { std::slice::from_raw_parts_mut(self.0.cpu, self.0.len) })
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.0.len
    }

    /// The bytes as `f32`s, when the length is a whole number of them (host extents are page
    /// aligned, device ones 256 B).
    pub(crate) fn f32s(&self) -> Option<&[f32]> {
        let l = &self.0;
        (!l.cpu.is_null() && l.len % 4 == 0 && l.cpu as usize % 4 == 0).then(|| {
            // SAFETY: as in `bytes`; the pointer is 4-byte aligned and every bit pattern is a
            // valid f32.
            unsafe { std::slice::from_raw_parts(l.cpu.cast::<f32>(), l.len / 4) }
        })
    }

    /// The bytes as `f32`s, mutably.
    pub(crate) fn f32s_mut(&mut self) -> Option<&mut [f32]> {
        let l = &self.0;
        (!l.cpu.is_null() && l.len % 4 == 0 && l.cpu as usize % 4 == 0).then(|| {
            // SAFETY: as in `f32s`; `&mut self` makes this the only reference.
            unsafe { std::slice::from_raw_parts_mut(l.cpu.cast::<f32>(), l.len / 4) }
        })
    }

    /// The bytes as `bf16`s.
    pub(crate) fn bf16s(&self) -> Option<&[half::bf16]> {
        let l = &self.0;
        (!l.cpu.is_null() && l.len % 2 == 0 && l.cpu as usize % 2 == 0).then(|| {
            // SAFETY: as in `f32s`: `bf16` is a transparent u16, 2-byte aligned here, and every
            // bit pattern is valid.
            unsafe { std::slice::from_raw_parts(l.cpu.cast::<half::bf16>(), l.len / 2) }
        })
    }

    /// The bytes as `bf16`s, mutably.
    pub(crate) fn bf16s_mut(&mut self) -> Option<&mut [half::bf16]> {
        let l = &self.0;
        (!l.cpu.is_null() && l.len % 2 == 0 && l.cpu as usize % 2 == 0).then(|| {
            // SAFETY: as in `bf16s`; `&mut self` makes this the only reference.
            unsafe { std::slice::from_raw_parts_mut(l.cpu.cast::<half::bf16>(), l.len / 2) }
        })
    }
}

/// Issues a DMA copy of a whole extent into another (one of them in the Device tier) on
/// `stream`, and returns the event after it.
pub(crate) fn dma_copy(stream: &RawStream, dst: &WriteLease, src: &ReadLease) -> Result<()> {
    if dst.0.len != src.0.len {
        return Err(crate::Error::LengthMismatch {
            expected: dst.0.len as u64,
            got: src.0.len as u64,
            what: "extent copy".into(),
        });
    }
    // SAFETY: both leases are live ranges of their arenas, of equal length (module Safety, rule
    // 2); host memory of the Pinned and Mapped arenas is page-locked; the store keeps both
    // allocated until an event recorded after this copy completes (the source's free waits for
    // the copy's use event, the destination's replica is valid only after its `ready` event).
    unsafe { stream.copy(dst.0.dma, src.0.dma, dst.0.len) }
}

/// One page-locked staging buffer, reserved once. It remembers the copy using it and waits for
/// that copy before handing its bytes to the CPU again (and before it is freed).
pub(crate) struct StagingBuf {
    block: Block,
    busy: Option<Busy>,
}

/// What a staging buffer's last copy is known by.
enum Busy {
    /// The event recorded after it.
    Event(RawEvent),
    /// Its stream only: the copy was issued, but the event after it could not be recorded. The
    /// buffer is the CPU's again only once that stream has been waited for whole.
    Stream(RawStream),
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

    /// Waits for the copy using the buffer, if any. The caller holds no store lock.
    pub(crate) fn wait(&mut self) -> Result<()> {
        // The buffer is free only once the wait has succeeded: a failed wait leaves it busy (a
        // copy may still be reading or writing it).
        match &self.busy {
            None => {}
            Some(Busy::Event(ev)) => ev.synchronize()?,
            Some(Busy::Stream(s)) => s.synchronize()?,
        }
        self.busy = None;
        Ok(())
    }

    /// Marks the buffer used by the copy just issued on `stream`, known by the event `recorded`
    /// after it, or by the stream alone when that event could not be recorded.
    fn used_by(&mut self, stream: &RawStream, recorded: Result<RawEvent>) -> Result<RawEvent> {
        match recorded {
            Ok(ev) => {
                self.busy = Some(Busy::Event(ev.clone()));
                Ok(ev)
            }
            Err(e) => {
                self.busy = Some(Busy::Stream(stream.clone()));
                Err(e)
            }
        }
    }

    /// The buffer for the CPU, once the copy that last used it is complete.
    pub(crate) fn bytes_mut(&mut self) -> Result<&mut [u8]> {
        self.wait()?;
        // SAFETY: pinned host memory of `len` bytes owned by this buffer; the last copy using it
        // has completed (just above) and `&mut self` makes this the only reference.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.block.host, self.block.len) })
    }
}

impl Drop for StagingBuf {
    fn drop(&mut self) {
        // The block must outlive the DMA reading or writing it (if even that wait fails, the
        // block is leaked rather than freed under the copy).
        if self.wait().is_err() {
            self.block.owner = crate::backend::BlockOwner::Leaked;
        }
    }
}

/// Issues a copy of `n` bytes from `buf` into `dst` at `offset` on `h2d` and records the event
/// after it (the buffer stays busy until it completes).
pub(crate) fn upload_piece(
    h2d: &RawStream,
    dst: &WriteLease,
    offset: u64,
    buf: &mut StagingBuf,
    n: usize,
) -> Result<RawEvent> {
    check_range(dst.0.len, offset, n, buf.len())?;
    buf.wait()?;
    // SAFETY: the source is `n <= len` bytes of the pinned buffer, reserved until the event
    // recorded below completes (`busy`); the destination lies inside the lease (checked above),
    // which the store keeps allocated until the copy's event completes (module Safety).
    unsafe { h2d.copy(dst.0.dma.offset(offset), buf.block.copy_addr(0), n)? };
    buf.used_by(h2d, h2d.record())
}

/// Issues a copy of `n` bytes of `src` at `offset` into `buf` on `d2h`; `buf.bytes_mut()` waits
/// for it.
pub(crate) fn download_piece(
    d2h: &RawStream,
    src: &ReadLease,
    offset: u64,
    buf: &mut StagingBuf,
    n: usize,
) -> Result<RawEvent> {
    check_range(src.0.len, offset, n, buf.len())?;
    buf.wait()?;
    // SAFETY: as in upload_piece, with the roles of buffer and lease swapped.
    unsafe { d2h.copy(buf.block.copy_addr(0), src.0.dma.offset(offset), n)? };
    buf.used_by(d2h, d2h.record())
}

fn check_range(len: usize, offset: u64, n: usize, buf_len: usize) -> Result<()> {
    if n > buf_len || offset.checked_add(n as u64).is_none_or(|end| end > len as u64) {
        return Err(crate::Error::InvalidArgument(format!(
            "staging copy of {n} bytes at {offset} of a {len}-byte extent"
        )));
    }
    Ok(())
}

/// Writes all of `dst` on `h2d`, piece by piece through `bufs` used in turn: `fill(offset,
/// piece)` fills each buffer on the CPU while the DMA of the previous pieces runs. Returns the
/// last copy's event (`None` for an empty extent).
pub(crate) fn upload(
    h2d: &RawStream,
    dst: &WriteLease,
    bufs: &mut [StagingBuf],
    mut fill: impl FnMut(usize, &mut [u8]) -> Result<()>,
) -> Result<Option<RawEvent>> {
    let total = dst.0.len;
    let Some(step) = bufs.first().map(StagingBuf::len) else {
        return Err(crate::Error::InvalidArgument("an upload without staging buffers".into()));
    };
    let mut last = None;
    let (mut off, mut k) = (0, 0);
    while off < total {
        let n = step.min(total - off);
        let buf = &mut bufs[k % bufs.len()];
        k += 1;
        fill(off, &mut buf.bytes_mut()?[..n])?;
        last = Some(upload_piece(h2d, dst, off as u64, buf, n)?);
        off += n;
    }
    Ok(last)
}

/// Reads all of `src` back on `d2h` through `bufs`, up to one piece in flight per buffer,
/// handing each piece to `sink(offset, piece)` in order.
pub(crate) fn download(
    d2h: &RawStream,
    src: &ReadLease,
    bufs: &mut [StagingBuf],
    mut sink: impl FnMut(usize, &[u8]) -> Result<()>,
) -> Result<()> {
    let total = src.0.len;
    let count = bufs.len();
    let Some(step) = bufs.first().map(StagingBuf::len) else {
        return Err(crate::Error::InvalidArgument("a download without staging buffers".into()));
    };
    let mut pending = std::collections::VecDeque::new();
    let (mut off, mut k) = (0, 0);
    let issue = |bufs: &mut [StagingBuf], off: usize, k: &mut usize| -> Result<_> {
        let n = step.min(total - off);
        let i = *k % count;
        *k += 1;
        download_piece(d2h, src, off as u64, &mut bufs[i], n)?;
        Ok((i, off, n))
    };
    while off < total && pending.len() < count {
        let p = issue(bufs, off, &mut k)?;
        off += p.2;
        pending.push_back(p);
    }
    while let Some((i, at, n)) = pending.pop_front() {
        sink(at, &bufs[i].bytes_mut()?[..n])?;
        if off < total {
            let p = issue(bufs, off, &mut k)?;
            off += p.2;
            pending.push_back(p);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::host::HostBackend;

    #[test]
    fn arena_suballocates_its_budget() {
        let be = Backend::Host(HostBackend::new().unwrap());
        let (a, mut alloc) = MemArena::new(&be, Tier::Pinned, 64 << 10, None, &mut |_| {}).unwrap();
        let x = alloc.alloc(10_000).map(|o| Extent::new(o, 10_000)).unwrap();
        assert_eq!(alloc.used(), 12288);
        let big = alloc.alloc(40 << 10).unwrap();
        assert!(alloc.alloc(16 << 10).is_none(), "over budget");
        alloc.free(big, 40 << 10);
        alloc.free(x.offset(), x.bytes());
        assert_eq!(alloc.used(), 0);
        let all = Extent::new(alloc.alloc(64 << 10).unwrap(), 64 << 10);
        let mut w = a.write_lease(&all);
        w.bytes_mut().unwrap().fill(3);
        assert!(a.read_lease(&all).bytes().unwrap().iter().all(|&b| b == 3));
    }

    #[test]
    fn device_tier_is_reached_by_views_only_on_the_host_backend() {
        let be = Backend::Host(HostBackend::new().unwrap());
        let (a, mut alloc) = MemArena::new(&be, Tier::Device, 4096, None, &mut |_| {}).unwrap();
        let e = Extent::new(alloc.alloc(100).unwrap(), 100);
        assert!(!a.cpu_reachable());
        assert!(a.read_lease(&e).bytes().is_none());
        assert!(a.view_lease(&e).is_some(), "host backend views reach it");
    }

    #[test]
    fn staged_upload_and_download_round_trip_in_pieces() {
        let be = Backend::Host(HostBackend::new().unwrap());
        let (dev, mut alloc) =
            MemArena::new(&be, Tier::Device, 1 << 20, None, &mut |_| {}).unwrap();
        let n = 300_000;
        let e = Extent::new(alloc.alloc(n as u64).unwrap(), n as u64);
        let mut bufs: Vec<StagingBuf> =
            (0..2).map(|_| StagingBuf::new(&be, 64 << 10).unwrap()).collect();
        let src: Vec<u8> = (0..n).map(|i| (i * 31 % 251) as u8).collect();
        let ev = upload(be.h2d(), &dev.write_lease(&e), &mut bufs, |off, b| {
            b.copy_from_slice(&src[off..off + b.len()]);
            Ok(())
        })
        .unwrap();
        be.d2h().wait(&ev.unwrap()).unwrap();
        let mut out = vec![0u8; n];
        download(be.d2h(), &dev.read_lease(&e), &mut bufs, |off, p| {
            out[off..off + p.len()].copy_from_slice(p);
            Ok(())
        })
        .unwrap();
        assert_eq!(out, src);
    }
}
