//! The tiers: their memory (arenas, the disk slab, pinned staging), fixed when the store is built
//! and reached by every thread without the store's lock, and their books (which extents are
//! taken, which wait to be freed), kept under the lock.
//!
//! Freeing never blocks the host: an extent that work may still touch (a copy in flight, a
//! kernel of a view, a thread reading it without the lock) is freed once that work is done.
//! Device memory retired while device work still touches it is reused in stream order instead:
//! the host-to-device stream, which writes every new device extent, first waits for that work.

pub(crate) mod alloc;
pub(crate) mod arena;
pub(crate) mod disk;
pub(crate) mod file;
pub(crate) mod staging;

use std::sync::Arc;

use smallvec::SmallVec;

use crate::backend::{Backend, Pending, RawEvent};
use crate::error::Result;
use crate::types::Tier;
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

/// An extent waiting for the work that may still touch it.
struct Deferred {
    tier: Tier,
    ext: Ext,
    waits: SmallVec<[Pending; 2]>,
}

/// What is allocated in each tier, and what waits to be freed: under the store's lock.
pub(crate) struct TierBooks {
    allocs: [Option<ExtentAllocator>; 4],
    deferred: Vec<Deferred>,
    /// Bytes of each tier waiting in `deferred` (reserved sizes).
    deferred_bytes: [u64; 4],
    /// Work still touching retired device memory: the host-to-device stream waits for it before
    /// its next copy.
    reuse_waits: Vec<RawEvent>,
}

impl TierBooks {
    /// Books over the allocators of the enabled tiers (Device, Pinned, Mapped, Disk).
    pub(crate) fn new(allocs: [Option<ExtentAllocator>; 4]) -> TierBooks {
        TierBooks { allocs, deferred: Vec::new(), deferred_bytes: [0; 4], reuse_waits: Vec::new() }
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

    /// The tier's budget as an error message names it: `pinned 8 GiB`, or with the largest
    /// piece when it was reserved in several (`pinned 8 GiB in 4 pieces, the largest 2 GiB`).
    pub(crate) fn describe(&self, t: Tier) -> String {
        let Some(a) = self.alloc_of(t) else { return format!("{t} (disabled)") };
        let cap = crate::types::format_size(a.len());
        match a.spans() {
            1 => format!("{t} {cap}"),
            n => format!(
                "{t} {cap} in {n} pieces, the largest {}",
                crate::types::format_size(a.largest_span())
            ),
        }
    }

    /// Bytes taken, waiting extents included.
    pub(crate) fn used(&self, t: Tier) -> u64 {
        self.alloc_of(t).map_or(0, ExtentAllocator::used)
    }

    /// Free bytes now, ignoring fragmentation.
    pub(crate) fn free_bytes(&self, t: Tier) -> u64 {
        self.alloc_of(t).map_or(0, |a| a.len() - a.used())
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
        if self.deferred_bytes[t.index()] > 0 {
            self.reap();
        }
        let a = self.allocs[t.index()].as_mut()?;
        let offset = a.alloc(bytes)?;
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
        while i < self.deferred.len() {
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

    /// Every wait of every waiting extent (for the store's drop).
    pub(crate) fn all_deferred_waits(&self) -> Vec<Pending> {
        self.deferred.iter().flat_map(|d| d.waits.iter().cloned()).collect()
    }

    /// Retires a Device extent: free now, its reuse ordered after `waits` on the host-to-device
    /// stream. Waits on the host (a thread still reading the memory) defer the free instead.
    pub(crate) fn retire_device(&mut self, ext: Ext, waits: SmallVec<[Pending; 2]>) {
        if waits.iter().any(|p| matches!(p, Pending::Done(_)) && !p.is_complete()) {
            return self.free_after(Tier::Device, ext, waits);
        }
        for p in waits {
            if let Pending::Ev(ev) = p {
                if !ev.is_complete() {
                    self.reuse_waits.push(ev);
                }
            }
        }
        self.free(Tier::Device, ext);
    }

    /// Makes the host-to-device stream wait for the work still touching retired device memory;
    /// called after allocating in the Device tier, before anything writes the new extent.
    pub(crate) fn h2d_ready(&mut self, be: &Backend) -> Result<()> {
        while let Some(ev) = self.reuse_waits.pop() {
            if let Err(e) = be.h2d().wait(&ev) {
                self.reuse_waits.push(ev);
                return Err(e);
            }
        }
        Ok(())
    }
}
