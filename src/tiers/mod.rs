//! The tiers: their memory (arenas, the disk slab, pinned staging), fixed when the store is built
//! and reached by every thread without the store's lock, and their books (which extents are
//! taken, which wait to be freed), kept under the lock.
//!
//! Freeing never blocks the host: an extent that work may still touch (a copy in flight, a
//! kernel of a view, a thread reading it without the lock) is freed once that work is done.
//! Device memory retired while device work still touches it is kept aside, and handed out again
//! only when no other memory fits; then it is reused in stream order: the stream that writes
//! the new extent first (the host-to-device stream, or an overwrite view's stream) waits for the
//! work that touched *that memory* ([`Fences`]), never for anything else.

pub(crate) mod alloc;
pub(crate) mod arena;
pub(crate) mod disk;
pub(crate) mod file;
pub(crate) mod reserve;
pub(crate) mod staging;

use std::collections::BTreeMap;
use std::sync::Arc;

use smallvec::SmallVec;

use crate::backend::{Pending, RawEvent};
use crate::base::sync::Signal;
use crate::base::types::Tier;
use alloc::ExtentAllocator;
use arena::{Extent, MemArena};
use disk::{DiskRange, DiskSlab};
use file::ExternalFile;
use staging::StagingPool;

/// Where one replica's bytes are.
pub(crate) enum Ext {
    /// An extent of a memory arena.
    Mem(Extent),
    /// An extent of the disk slab and the crc32 of the bytes written there.
    Disk { ext: Extent, crc: u32 },
    /// In place in a user's file (Disk tier, read-only): the tensor's bytes at `offset`.
    File { file: Arc<ExternalFile>, offset: u64 },
}

impl Ext {
    /// The extent of an arena or slab allocation (not a user's file).
    fn mem_extent(&self) -> &Extent {
        match self {
            Ext::Mem(e) | Ext::Disk { ext: e, .. } => e,
            Ext::File { .. } => unreachable!("allocations are memory or slab extents"),
        }
    }

    /// [`Ext::mem_extent`], by value.
    fn into_mem_extent(self) -> Extent {
        match self {
            Ext::Mem(e) | Ext::Disk { ext: e, .. } => e,
            Ext::File { .. } => unreachable!("allocations are memory or slab extents"),
        }
    }

    /// The slab range of a Disk extent.
    pub(crate) fn disk_range(&self) -> Option<DiskRange> {
        match self {
            Ext::Disk { ext, .. } => Some(DiskRange { offset: ext.offset(), bytes: ext.bytes() }),
            _ => None,
        }
    }
}

/// The tiers' memory, fixed at build: shared by all threads, never behind the store's lock.
pub(crate) struct TierMem {
    /// Device, Pinned, Mapped (None when disabled).
    pub(crate) arenas: [Option<MemArena>; 3],
    /// The disk tier's slab (None when disabled).
    pub(crate) disk: Option<DiskSlab>,
    /// Staging between pageable memory or disk and the device (None without a Device tier).
    pub(crate) staging: Option<StagingPool>,
}

impl TierMem {
    /// The arena of a memory tier.
    pub(crate) fn arena(&self, t: Tier) -> Option<&MemArena> {
        self.arenas.get(t.index()).and_then(Option::as_ref)
    }
}

/// The largest tensor each tier could ever hold (0 when disabled): where a tensor's only copy
/// could ever be demoted to.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Fits(pub(crate) [u64; 4]);

impl Fits {
    /// Whether a tensor's only copy, of `bytes`, in `t` could ever be demoted (a slower tier
    /// could hold it).
    pub(crate) fn movable_from(&self, t: Tier, bytes: u64) -> bool {
        Tier::ALL.into_iter().any(|s| s > t && self.0[s.index()] >= bytes)
    }
}

/// An extent waiting for the work that may still touch it.
struct Deferred {
    tier: Tier,
    ext: Ext,
    waits: SmallVec<[Pending; 2]>,
}

/// Device memory retired while device work still touches it: out of the allocator until that
/// work completes, or until an allocation finds no other room.
struct Retired {
    ext: Extent,
    waits: SmallVec<[RawEvent; 2]>,
}

/// Ranges of device memory handed back to the allocator while device work may still touch them,
/// each with the events of that work: whoever writes an extent there first waits for them. The
/// ranges never overlap (a newer fence over old memory implies the older one: the memory's next
/// owner was written only after it).
#[derive(Default)]
pub(crate) struct Fences(BTreeMap<u64, (u64, SmallVec<[RawEvent; 2]>)>);

impl Fences {
    /// Fences `[start, end)` with `waits`, replacing what older fences said of that range.
    fn insert(&mut self, start: u64, end: u64, waits: SmallVec<[RawEvent; 2]>) {
        self.take(start, end);
        self.0.insert(start, (end, waits));
    }

    /// The events fencing `[start, end)`, incomplete ones only, taken out of the fences (the
    /// caller's writer waits for them; later writers of the range wait for its new owner).
    fn take(&mut self, start: u64, end: u64) -> SmallVec<[RawEvent; 2]> {
        let mut out = SmallVec::new();
        if start >= end {
            return out;
        }
        let hits: SmallVec<[u64; 4]> = self
            .0
            .range(..end)
            .rev()
            .take_while(|(_, (e, _))| *e > start)
            .map(|(&s, _)| s)
            .collect();
        for s in hits {
            let (e, waits) = self.0.remove(&s).expect("listed above");
            for ev in &waits {
                if !ev.is_complete() && !out.iter().any(|o: &RawEvent| o.same(ev)) {
                    out.push(ev.clone());
                }
            }
            if s < start {
                self.0.insert(s, (start, waits.clone()));
            }
            if e > end {
                self.0.insert(end, (e, waits));
            }
        }
        out
    }

    /// Drops the fences whose work has completed.
    fn prune(&mut self) {
        self.0.retain(|_, (_, w)| w.iter().any(|ev| !ev.is_complete()));
    }

    fn len(&self) -> usize {
        self.0.len()
    }
}

/// What is allocated in each tier, and what waits to be freed: under the store's lock.
pub(crate) struct TierBooks {
    allocs: [Option<ExtentAllocator>; 4],
    deferred: Vec<Deferred>,
    /// Bytes of each tier waiting in `deferred` (reserved sizes).
    deferred_bytes: [u64; 4],
    /// Device memory retired while device work still touches it: free as far as the budget
    /// goes (reusable without a host wait), out of the allocator until needed.
    retired: Vec<Retired>,
    retired_bytes: u64,
    /// Device memory back in the allocator that device work may still touch.
    fences: Fences,
    /// Room kept aside so that a tensor can always be overwritten ([`reserve`]).
    pub(crate) reserve: reserve::WriteReserve,
}

/// Fences kept before complete ones are pruned.
const PRUNE_FENCES_AT: usize = 64;

impl TierBooks {
    /// Books over the allocators of the enabled tiers (Device, Pinned, Mapped, Disk).
    pub(crate) fn new(allocs: [Option<ExtentAllocator>; 4]) -> TierBooks {
        TierBooks {
            allocs,
            deferred: Vec::new(),
            deferred_bytes: [0; 4],
            retired: Vec::new(),
            retired_bytes: 0,
            fences: Fences::default(),
            reserve: reserve::WriteReserve::default(),
        }
    }

    fn alloc_of(&self, t: Tier) -> Option<&ExtentAllocator> {
        self.allocs[t.index()].as_ref()
    }

    /// Whether the tier has a budget.
    pub(crate) fn enabled(&self, t: Tier) -> bool {
        self.alloc_of(t).is_some()
    }

    /// The tier's budget (0 when disabled).
    pub(crate) fn capacity(&self, t: Tier) -> u64 {
        self.alloc_of(t).map_or(0, ExtentAllocator::len)
    }

    /// Bytes an extent for a tensor of `bytes` takes from the tier's budget.
    pub(crate) fn reserved_size(&self, t: Tier, bytes: u64) -> u64 {
        self.alloc_of(t).map_or(bytes, |a| a.reserved_size(bytes))
    }

    /// Whether a tensor of `bytes` could ever fit the tier.
    pub(crate) fn can_ever_fit(&self, t: Tier, bytes: u64) -> bool {
        self.alloc_of(t).is_some_and(|a| a.reserved_size(bytes) <= a.largest_span())
    }

    /// The largest tensor each tier could ever hold (0 for a disabled tier).
    pub(crate) fn fits(&self) -> Fits {
        Fits(Tier::ALL.map(|t| self.alloc_of(t).map_or(0, ExtentAllocator::largest_span)))
    }

    /// The tier's budget as an error message names it: `pinned 8 GiB`, or with the largest
    /// piece when it was reserved in several (`pinned 8 GiB in 4 pieces, the largest 2 GiB`).
    pub(crate) fn describe(&self, t: Tier) -> String {
        let Some(a) = self.alloc_of(t) else { return format!("{t} (disabled)") };
        let cap = crate::base::types::format_size(a.len());
        match a.spans() {
            1 => format!("{t} {cap}"),
            n => format!(
                "{t} {cap} in {n} pieces, the largest {}",
                crate::base::types::format_size(a.largest_span())
            ),
        }
    }

    /// Bytes taken by tensors, extents waiting to be freed included; retired device memory,
    /// which is reused without a host wait, counts as free, and the write reserve apart
    /// ([`TierBooks::reserve_bytes`]).
    pub(crate) fn used(&self, t: Tier) -> u64 {
        let retired = if t == Tier::Device { self.retired_bytes } else { 0 };
        self.alloc_of(t).map_or(0, ExtentAllocator::used) - retired - self.reserve_bytes(t)
    }

    /// Bytes of `t` kept aside as the write reserve (lent to a write or not).
    pub(crate) fn reserve_bytes(&self, t: Tier) -> u64 {
        let r = &self.reserve;
        match (&r.held, &r.lent_ext) {
            (Some((rt, e)), _) if *rt == t => self.reserved_size(t, e.bytes()),
            (_, Some((rt, _, bytes))) if *rt == t => self.reserved_size(t, *bytes),
            _ => 0,
        }
    }

    /// Makes the write reserve fit the largest tensor it covers, in the slowest tier that can
    /// hold it (a no-op when it does; it shrinks when that tensor went). Fails, naming the tier
    /// and the bytes, when there is no room for it now. While a write has it, nothing changes
    /// (the write fits it when it gives it back).
    pub(crate) fn fit_reserve(&mut self) -> std::result::Result<(), (Tier, u64)> {
        let largest = self.reserve.largest();
        if self.reserve.lent.is_some() {
            return Ok(());
        }
        if largest == 0 {
            if let Some((t, e)) = self.reserve.held.take() {
                self.free(t, Ext::Mem(e));
            }
            return Ok(());
        }
        let Some(tier) = Tier::ALL.into_iter().rev().find(|&t| self.can_ever_fit(t, largest))
        else {
            return Err((Tier::Disk, largest));
        };
        // Pages of its own, never a slot of a shared page, so that a write of any covered size
        // can keep its copy there (`return_reserve`: a slot is not cut into a smaller one).
        let size = self.alloc_of(tier).map_or(largest, |a| a.unshared(largest));
        let want = self.reserved_size(tier, size);
        let old = self.reserve.held.take();
        if let Some((t, e)) = &old {
            let have = self.reserved_size(*t, e.bytes());
            // Shrink in place (the tail goes back to the tier), or keep it as it is.
            let shrunk = *t == tier
                && have >= want
                && self.allocs[t.index()]
                    .as_mut()
                    .is_some_and(|a| a.shrink(e.offset(), e.bytes(), size));
            if shrunk {
                self.reserve.held = Some((tier, Extent::new(e.offset(), size)));
                return Ok(());
            }
        }
        // A new extent. An old one in the same tier is freed first: its room may be part of
        // the new one (if the new one does not fit, the old size is taken back: it was just
        // freed, so it fits).
        let mut other_tier = None;
        if let Some((t, e)) = old {
            if t == tier {
                let old_size = e.bytes();
                self.free(t, Ext::Mem(e));
                let got = self.take_backed(tier, size).or_else(|| self.take_backed(t, old_size));
                let fitted = got.as_ref().is_some_and(|x| x.mem_extent().bytes() == size);
                self.reserve.held = got.map(|x| (t, x.into_mem_extent()));
                return if fitted { Ok(()) } else { Err((tier, largest)) };
            }
            other_tier = Some((t, e));
        }
        match self.take_backed(tier, size) {
            Some(x) => {
                if let Some((t, e)) = other_tier {
                    self.free(t, Ext::Mem(e));
                }
                self.reserve.held = Some((tier, x.into_mem_extent()));
                Ok(())
            }
            None => {
                self.reserve.held = other_tier;
                Err((tier, largest))
            }
        }
    }

    /// An extent for the write reserve: taken from the tier's books and, on the Disk tier,
    /// given its file-system blocks (`None` when either is short).
    fn take_backed(&mut self, t: Tier, bytes: u64) -> Option<Ext> {
        let x = self.try_alloc(t, bytes)?;
        let e = x.mem_extent();
        let (off, size) = (e.offset(), self.reserved_size(t, bytes));
        if self.reserve.back(t, off, size) {
            Some(x)
        } else {
            self.free(t, x);
            None
        }
    }

    /// Lends the write reserve to a write of `bytes` (the extent for its second copy), whose end
    /// `done` signals: `Ok(None)` when the store keeps none or it is owed or too small,
    /// `Err(signal)` when another write has it (wait for that signal, then ask again).
    pub(crate) fn lend_reserve(
        &mut self,
        bytes: u64,
        done: &Arc<Signal>,
    ) -> std::result::Result<Option<(Tier, Ext)>, Arc<Signal>> {
        if let Some(f) = &self.reserve.lent {
            return Err(f.clone());
        }
        // Only a reserve the write's copy can be cut from, should the write keep it there
        // (`return_reserve`; the reserve takes pages of its own, so any covered size can).
        let fits = match &self.reserve.held {
            Some((t, e)) => self.alloc_of(*t).is_some_and(|a| a.can_shrink(e.bytes(), bytes)),
            None => false,
        };
        if !fits {
            return Ok(None);
        }
        let (t, e) = self.reserve.held.take().expect("checked");
        self.reserve.lent_ext = Some((t, e.offset(), e.bytes()));
        self.reserve.lent = Some(done.clone());
        let part = Extent::new(e.offset(), bytes);
        Ok(Some((
            t,
            if t == Tier::Disk { Ext::Disk { ext: part, crc: 0 } } else { Ext::Mem(part) },
        )))
    }

    /// The write reserve back from its write: `kept` when the write made its copy there the
    /// tensor's (only the part past it is returned to the tier, and the reserve is made again
    /// from free room if there is some).
    pub(crate) fn return_reserve(&mut self, kept: Option<u64>) {
        let Some((t, off, full)) = self.reserve.lent_ext.take() else { return };
        if let Some(done) = self.reserve.lent.take() {
            done.set();
        }
        match kept {
            None => self.reserve.held = Some((t, Extent::new(off, full))),
            Some(bytes) => {
                // The reserve's extent becomes the tensor's, of its size (the rest back to the
                // tier): freed later as an extent of `bytes`.
                let shrunk =
                    self.allocs[t.index()].as_mut().is_none_or(|a| a.shrink(off, full, bytes));
                debug_assert!(shrunk, "a write reserve of {full} bytes kept for {bytes}");
            }
        }
        let _ = self.fit_reserve();
    }

    /// Free bytes now (retired device memory included, the write reserve not), ignoring
    /// fragmentation.
    pub(crate) fn free_bytes(&self, t: Tier) -> u64 {
        let taken = self.used(t) + self.reserve_bytes(t);
        self.alloc_of(t).map_or(0, |a| a.len() - taken.min(a.len()))
    }

    /// Bytes of extents that wait for work before they are free.
    pub(crate) fn deferred_bytes(&self, t: Tier) -> u64 {
        self.deferred_bytes[t.index()]
    }

    /// The largest extent that could be taken now.
    pub(crate) fn largest_free(&self, t: Tier) -> u64 {
        self.alloc_of(t).map_or(0, ExtentAllocator::largest_free)
    }

    /// Free ranges (fragmentation).
    pub(crate) fn free_ranges(&self, t: Tier) -> usize {
        self.alloc_of(t).map_or(0, ExtentAllocator::free_ranges)
    }

    /// Allocates `bytes` in `t` without evicting; `None` when there is no room now (or the tier
    /// is disabled). Extents whose work has finished are freed first.
    pub(crate) fn try_alloc(&mut self, t: Tier, bytes: u64) -> Option<Ext> {
        if self.deferred_bytes[t.index()] > 0 || (t == Tier::Device && self.retired_bytes > 0) {
            self.reap();
        }
        let a = self.allocs[t.index()].as_mut()?;
        let offset = match a.alloc(bytes) {
            Some(o) => o,
            None if t == Tier::Device && !self.retired.is_empty() => {
                // No other room: retired memory is handed out again, fenced.
                self.reclaim_retired();
                self.allocs[t.index()].as_mut()?.alloc(bytes)?
            }
            None => return None,
        };
        let ext = Extent::new(offset, bytes);
        Some(match t {
            Tier::Disk => Ext::Disk { ext, crc: crc32fast::hash(&[]) },
            _ => Ext::Mem(ext),
        })
    }

    /// Returns an extent to its tier now. The caller knows nothing touches it any more.
    pub(crate) fn free(&mut self, t: Tier, ext: Ext) {
        let (Ext::Mem(e) | Ext::Disk { ext: e, .. }) = ext else {
            // The user's file is not ours to free; dropping the handle is all.
            return;
        };
        if let Some(a) = self.allocs[t.index()].as_mut() {
            a.free(e.offset(), e.bytes());
        }
    }

    /// Frees an extent once `waits` have completed (at once when they have).
    pub(crate) fn free_after(&mut self, t: Tier, ext: Ext, waits: SmallVec<[Pending; 2]>) {
        if waits.iter().all(Pending::is_complete) {
            return self.free(t, ext);
        }
        if let Ext::Mem(e) | Ext::Disk { ext: e, .. } = &ext {
            self.deferred_bytes[t.index()] += self.reserved_size(t, e.bytes());
        }
        self.deferred.push(Deferred { tier: t, ext, waits });
    }

    /// Frees the waiting extents whose work has completed; true if any was.
    pub(crate) fn reap(&mut self) -> bool {
        let mut freed = false;
        let mut i = 0;
        while i < self.retired.len() {
            if self.retired[i].waits.iter().all(RawEvent::is_complete) {
                let r = self.retired.swap_remove(i);
                self.retired_bytes -= self.reserved_size(Tier::Device, r.ext.bytes());
                self.free(Tier::Device, Ext::Mem(r.ext));
                freed = true;
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.deferred.len() {
            self.deferred[i].waits.iter_mut().for_each(Pending::settle);
            if self.deferred[i].waits.iter().all(Pending::is_complete) {
                let d = self.deferred.swap_remove(i);
                if let Ext::Mem(e) | Ext::Disk { ext: e, .. } = &d.ext {
                    let r = self.reserved_size(d.tier, e.bytes());
                    self.deferred_bytes[d.tier.index()] -= r;
                }
                self.free(d.tier, d.ext);
                freed = true;
            } else {
                i += 1;
            }
        }
        freed
    }

    /// What the waiting extents of `t` wait for, to wait for it without the lock.
    pub(crate) fn deferred_waits(&self, t: Tier) -> Vec<Pending> {
        self.deferred
            .iter()
            .filter(|d| d.tier == t)
            .flat_map(|d| d.waits.iter().filter(|p| !p.is_complete()).cloned())
            .collect()
    }

    /// Every wait of every waiting extent and of the fenced memory (for the store's drop).
    pub(crate) fn all_deferred_waits(&self) -> Vec<Pending> {
        let retired = self.retired.iter().flat_map(|r| r.waits.iter());
        let fenced = self.fences.0.values().flat_map(|(_, w)| w.iter());
        self.deferred
            .iter()
            .flat_map(|d| d.waits.iter().cloned())
            .chain(retired.chain(fenced).map(|ev| Pending::Ev(ev.clone())))
            .collect()
    }

    /// Retires a Device extent. Free now when nothing touches it; kept aside while device work
    /// does (reused before that work is done only when no other memory fits, and then in
    /// stream order: see [`TierBooks::take_fences`]); freed later when a thread still reads it
    /// without the lock.
    pub(crate) fn retire_device(&mut self, ext: Ext, waits: SmallVec<[Pending; 2]>) {
        if waits.iter().any(|p| !matches!(p, Pending::Ev(_)) && !p.is_complete()) {
            return self.free_after(Tier::Device, ext, waits);
        }
        let events: SmallVec<[RawEvent; 2]> = waits
            .into_iter()
            .filter_map(|p| match p {
                Pending::Ev(ev) if !ev.is_complete() => Some(ev),
                _ => None,
            })
            .collect();
        match ext {
            Ext::Mem(e) if !events.is_empty() => {
                self.retired_bytes += self.reserved_size(Tier::Device, e.bytes());
                self.retired.push(Retired { ext: e, waits: events });
            }
            ext => self.free(Tier::Device, ext),
        }
    }

    /// Hands every retired device extent back to the allocator, each fenced by its work.
    fn reclaim_retired(&mut self) {
        if self.fences.len() >= PRUNE_FENCES_AT {
            self.fences.prune();
        }
        for r in std::mem::take(&mut self.retired) {
            let reserved = self.reserved_size(Tier::Device, r.ext.bytes());
            self.retired_bytes -= reserved;
            let start = r.ext.offset();
            self.fences.insert(start, start + reserved, r.waits);
            self.free(Tier::Device, Ext::Mem(r.ext));
        }
    }

    /// The events a writer of the new Device extent `ext` must wait for first: the device work
    /// still touching its memory's earlier owners (none for memory that was free). Taken: the
    /// next writer of that memory waits for this extent's owner instead.
    pub(crate) fn take_fences(&mut self, ext: &Ext) -> SmallVec<[RawEvent; 2]> {
        match ext {
            Ext::Mem(e) if self.fences.len() > 0 => {
                let start = e.offset();
                self.fences.take(start, start + self.reserved_size(Tier::Device, e.bytes()))
            }
            _ => SmallVec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Books with only a Pinned tier of 64 KiB, whose small extents share pages.
    fn pinned_books() -> TierBooks {
        let pinned = ExtentAllocator::new(64 << 10, 4096).with_small_slots();
        let mut books = TierBooks::new([None, Some(pinned), None, None]);
        books.reserve.enabled = true;
        books
    }

    /// A write kept its copy in the write reserve (its in-place write failed): the reserve's
    /// extent, a page, becomes the small tensor's slot, freed later as that.
    #[test]
    fn a_write_reserve_kept_by_a_small_tensor_is_freed_as_its_slot() {
        let mut books = pinned_books();
        books.reserve.note(3000);
        books.fit_reserve().unwrap();
        let done = Arc::new(Signal::default());
        let Ok(Some((t, ext))) = books.lend_reserve(100, &done) else { panic!("not lent") };
        assert_eq!(t, Tier::Pinned);
        books.return_reserve(Some(100));
        assert!(done.is_set());
        books.reserve.unnote(3000);
        books.fit_reserve().unwrap();
        assert_eq!(books.used(Tier::Pinned), 128, "the tensor's slot");
        books.free(Tier::Pinned, ext);
        assert_eq!((books.used(Tier::Pinned), books.largest_free(Tier::Pinned)), (0, 64 << 10));
    }

    /// A reserve covering only tensors of at most half a page takes a page of its own, not a
    /// slot: it is lent to a write of any covered size, whose copy it can become.
    #[test]
    fn a_reserve_for_small_tensors_is_a_page_lent_to_any_of_them() {
        let mut books = pinned_books();
        books.reserve.note(1000);
        books.fit_reserve().unwrap();
        assert_eq!(books.reserve_bytes(Tier::Pinned), 4096);
        let done = Arc::new(Signal::default());
        let Ok(Some((_, ext))) = books.lend_reserve(100, &done) else { panic!("not lent") };
        books.return_reserve(Some(100));
        books.reserve.unnote(1000);
        books.fit_reserve().unwrap();
        assert_eq!(books.used(Tier::Pinned), 128, "the tensor's slot");
        books.free(Tier::Pinned, ext);
        assert_eq!((books.used(Tier::Pinned), books.largest_free(Tier::Pinned)), (0, 64 << 10));
    }
}
