//! Extent sub-allocator: bookkeeping of aligned byte ranges over `[0, len)` (or over several
//! spans of one offset space, one per piece of memory), with no memory of its own. Each tier
//! arena (device memory, pinned host memory, a disk file) carves its tensors out of its
//! reservation with it.
//!
//! Free ranges live in two ordered sets: by offset (to find the neighbours to merge with on
//! free) and by `(len, offset)` (to find the best fit on alloc). Both operations are O(log n) in
//! the number of free ranges.
//!
//! Where small tensors may share a page ([`ExtentAllocator::with_small_slots`]: host memory,
//! not the disk slab, whose `O_DIRECT` writes rewrite whole pages), a request of at most half
//! the alignment takes a slot of a page cut into slots of one power-of-two size (64 B to half a
//! page) instead of a page of its own: 100,000 tensors of 2 bytes take 6.1 MiB of pinned memory,
//! not 391 MiB. A page goes back to the free ranges when its last slot is freed.

use std::collections::{BTreeMap, BTreeSet, HashMap};

/// The smallest slot of a shared page.
const MIN_SLOT: u64 = 64;

/// Pages cut into slots: the pages of each slot size that have a free slot, and each page's
/// slot size and used slots.
#[derive(Debug, Default)]
struct Slots {
    /// By class (slot size `MIN_SLOT << class`): pages with at least one free slot.
    open: Vec<BTreeSet<u64>>,
    /// Page offset -> (class, bitmap of used slots; bit i is the slot at `i × slot size`).
    pages: HashMap<u64, (u32, u64)>,
}

/// Best-fit allocator of aligned extents over the range [0, len), with coalescing.
///
/// Every offset handed out and every reserved size is a multiple of `align`, so free ranges
/// always start on an `align` boundary and no padding is ever needed. When `len` is not a
/// multiple of `align`, the tail past the last boundary is never handed out.
///
/// [`ExtentAllocator::with_spans`] lays several spans out in one offset space with a gap of
/// `align` between them: the gap is never free, so no free range (and no extent) crosses from
/// one span into the next.
#[derive(Debug)]
pub(crate) struct ExtentAllocator {
    /// Free ranges: offset -> length. Never two adjacent ones (they are merged on free).
    free: BTreeMap<u64, u64>,
    /// The same ranges as `(length, offset)`, so the smallest fit is one range query away.
    by_size: BTreeSet<(u64, u64)>,
    /// Sum of the reserved sizes of live extents.
    used: u64,
    /// Length given to `new` (the spans' lengths summed).
    len: u64,
    /// The part that can be handed out: each span's length rounded down to `align`, summed.
    usable: u64,
    /// Each span's `[start, usable end)`, by offset.
    spans: Vec<(u64, u64)>,
    align: u64,
    /// Pages shared by small extents, where enabled.
    slots: Option<Slots>,
}

impl ExtentAllocator {
    /// `align` is a power of two (256 for device memory, 4096 for host and disk).
    pub(crate) fn new(len: u64, align: u64) -> Self {
        Self::with_spans(&[len], align).0
    }

    /// An allocator over spans of `lens` bytes (pieces of memory reserved apart), laid out in
    /// one offset space: span `i` starts at the returned offset `starts[i]`, `align` past the
    /// aligned end of the span before it. An extent never crosses spans, so a request larger
    /// than the largest span never succeeds ([`ExtentAllocator::largest_span`]).
    pub(crate) fn with_spans(lens: &[u64], align: u64) -> (Self, Vec<u64>) {
        assert!(align.is_power_of_two(), "alignment {align} is not a power of two");
        let mut a = ExtentAllocator {
            free: BTreeMap::new(),
            by_size: BTreeSet::new(),
            used: 0,
            len: lens.iter().sum(),
            usable: 0,
            spans: Vec::with_capacity(lens.len()),
            align,
            slots: None,
        };
        let mut starts = Vec::with_capacity(lens.len());
        let mut at = 0u64;
        for &len in lens {
            let usable = len & !(align - 1);
            starts.push(at);
            a.spans.push((at, at + usable));
            if usable > 0 {
                a.insert_free(at, usable);
            }
            a.usable += usable;
            at = (at + len).next_multiple_of(align) + align;
        }
        (a, starts)
    }

    /// Lets requests of at most half the alignment share pages, each in a slot of the smallest
    /// power of two from 64 B that holds it (see the module's docs). Only where an extent may
    /// start anywhere a slot does: host memory, not the disk slab.
    pub(crate) fn with_small_slots(mut self) -> Self {
        // A page's slots fit a u64 bitmap.
        if self.align >= 2 * MIN_SLOT && self.align / MIN_SLOT <= 64 {
            let classes = (self.align / 2 / MIN_SLOT).trailing_zeros() as usize + 1;
            self.slots =
                Some(Slots { open: vec![BTreeSet::new(); classes], pages: HashMap::new() });
        }
        self
    }

    /// The slot class and size of a request, when it takes a slot of a shared page.
    fn slot_of(&self, size: u64) -> Option<(u32, u64)> {
        self.slots.as_ref()?;
        if size == 0 || size > self.align / 2 {
            return None;
        }
        let slot = size.next_power_of_two().max(MIN_SLOT);
        Some(((slot / MIN_SLOT).trailing_zeros(), slot))
    }

    /// Reserves round_up(size, align) bytes (or a slot of a shared page: [`Self::with_small_slots`]);
    /// returns the offset (a multiple of align, or of the slot's size), or None when no free range
    /// is big enough. An empty request takes nothing and always succeeds. Best fit (smallest free
    /// range that fits; ties -> lowest offset).
    pub(crate) fn alloc(&mut self, size: u64) -> Option<u64> {
        if size == 0 {
            // An empty tensor takes no room: every empty extent is offset 0, 0 bytes long.
            return Some(0);
        }
        if let Some((class, slot)) = self.slot_of(size) {
            return self.alloc_slot(class, slot);
        }
        let off = self.alloc_range(self.round(size)?)?;
        Some(off)
    }

    /// A slot of `slot` bytes: in a page of its class with a free slot (the lowest), else in a
    /// new page.
    fn alloc_slot(&mut self, class: u32, slot: u64) -> Option<u64> {
        let open = self.slots.as_ref()?.open[class as usize].first().copied();
        let page = match open {
            Some(p) => p,
            None => {
                let p = self.alloc_range(self.align)?;
                // The page's bytes count as used slot by slot.
                self.used -= self.align;
                let slots = self.slots.as_mut()?;
                slots.pages.insert(p, (class, 0));
                slots.open[class as usize].insert(p);
                p
            }
        };
        let per_page = self.align / slot;
        let slots = self.slots.as_mut()?;
        let (_, bits) = slots.pages.get_mut(&page)?;
        let i = u64::from(bits.trailing_ones());
        *bits |= 1 << i;
        let full = if per_page == 64 { *bits == u64::MAX } else { *bits == (1 << per_page) - 1 };
        if full {
            slots.open[class as usize].remove(&page);
        }
        self.used += slot;
        Some(page + i * slot)
    }

    /// Takes `need` bytes (a multiple of the alignment) from the best-fitting free range.
    fn alloc_range(&mut self, need: u64) -> Option<u64> {
        // (len, offset) order: the first entry at or after (need, 0) is the smallest range that
        // fits, and among equal lengths the lowest offset.
        let &(flen, off) = self.by_size.range((need, 0)..).next()?;
        self.remove_free(off, flen);
        if flen > need {
            self.insert_free(off + need, flen - need);
        }
        self.used += need;
        Some(off)
    }

    /// Frees what `alloc(size)` returned at `offset` (same `size` as given to alloc); merges with
    /// free neighbours. Freeing something not allocated is a bug: it trips a debug assertion, and
    /// in release builds it is ignored so the free lists stay consistent.
    pub(crate) fn free(&mut self, offset: u64, size: u64) {
        if size == 0 {
            return;
        }
        if let Some((class, slot)) = self.slot_of(size) {
            return self.free_slot(offset, class, slot);
        }
        let live = self.is_live(offset, size);
        debug_assert!(
            live,
            "free of an extent that is not allocated: offset {offset}, size {size}"
        );
        if !live {
            return;
        }
        let need = self.reserved_size(size);
        self.used -= need;
        self.release_range(offset, need);
    }

    /// Frees the slot at `offset`; its page goes back to the free ranges when it was the last.
    fn free_slot(&mut self, offset: u64, class: u32, slot: u64) {
        let page = offset & !(self.align - 1);
        let i = (offset - page) / slot;
        let Some(slots) = self.slots.as_mut() else { return };
        let live = offset % slot == 0
            && slots.pages.get(&page).is_some_and(|&(c, bits)| c == class && bits & (1 << i) != 0);
        debug_assert!(live, "free of a slot that is not allocated: offset {offset}, slot {slot}");
        if !live {
            return;
        }
        let Some((_, bits)) = slots.pages.get_mut(&page) else { return };
        *bits &= !(1 << i);
        self.used -= slot;
        if *bits == 0 {
            slots.pages.remove(&page);
            slots.open[class as usize].remove(&page);
            self.release_range(page, self.align);
        } else {
            slots.open[class as usize].insert(page);
        }
    }

    /// The smallest request of at least `size` bytes that takes pages of its own rather than a
    /// slot of a shared page: `size` itself unless it would take a slot.
    pub(crate) fn unshared(&self, size: u64) -> u64 {
        match self.slot_of(size) {
            Some(_) => self.align / 2 + 1,
            None => size,
        }
    }

    /// Whether an extent of `old` bytes can be [shrunk](ExtentAllocator::shrink) to one of
    /// `new`: it reserves no less, and is a range or a slot of the same size.
    pub(crate) fn can_shrink(&self, old: u64, new: u64) -> bool {
        let (have, want) = (self.reserved_size(old), self.reserved_size(new));
        want <= have && (self.slot_of(old).is_none() || have == want)
    }

    /// Shrinks the live extent that `alloc(old)` returned at `offset` to what `alloc(new)` could
    /// have returned there, giving the rest back: afterwards it is freed with `free(offset,
    /// new)`. A range shrinks to a shorter range, or to the first slot of its first page (which
    /// becomes a page of `new`'s slots). False, and nothing changed, where that cannot be (see
    /// [`ExtentAllocator::can_shrink`]: a smaller slot lives in another page) or `offset` is not
    /// where `alloc(old)` put a live extent.
    pub(crate) fn shrink(&mut self, offset: u64, old: u64, new: u64) -> bool {
        if !self.can_shrink(old, new) {
            return false;
        }
        let (have, want) = (self.reserved_size(old), self.reserved_size(new));
        if have == want {
            return true;
        }
        if !self.is_live(offset, old) {
            debug_assert!(false, "shrink of an extent that is not allocated: {offset}, {old}");
            return false;
        }
        match self.slot_of(new) {
            None => {
                // `want` is 0 for an empty extent: all of it goes back.
                self.used -= have - want;
                self.release_range(offset + want, have - want);
            }
            Some((class, slot)) => {
                // The first page stays, cut into slots, the first taken; the rest goes back.
                if have > self.align {
                    self.used -= have - self.align;
                    self.release_range(offset + self.align, have - self.align);
                }
                self.used -= self.align - slot;
                if let Some(slots) = self.slots.as_mut() {
                    slots.pages.insert(offset, (class, 1));
                    slots.open[class as usize].insert(offset);
                }
            }
        }
        true
    }

    /// Returns `[offset, offset + need)` to the free ranges, merged with its free neighbours.
    fn release_range(&mut self, offset: u64, need: u64) {
        let (mut start, mut end) = (offset, offset + need);
        if let Some((&poff, &plen)) = self.free.range(..start).next_back() {
            if poff + plen == start {
                self.remove_free(poff, plen);
                start = poff;
            }
        }
        if let Some(&nlen) = self.free.get(&end) {
            self.remove_free(end, nlen);
            end += nlen;
        }
        self.insert_free(start, end - start);
    }

    /// Reserved size for a request of `size`: round_up(size, align), 0 for an empty one.
    /// Saturates at `u64::MAX` (which no allocator can satisfy) when the rounding overflows.
    pub(crate) fn reserved_size(&self, size: u64) -> u64 {
        if size == 0 {
            return 0;
        }
        if let Some((_, slot)) = self.slot_of(size) {
            return slot;
        }
        self.round(size).unwrap_or(u64::MAX)
    }

    /// Sum of the reserved sizes of the live extents.
    pub(crate) fn used(&self) -> u64 {
        self.used
    }

    /// The length given to [`ExtentAllocator::new`].
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// How many spans (pieces of memory) the allocator covers.
    pub(crate) fn spans(&self) -> usize {
        self.spans.len()
    }

    /// The largest extent the allocator could ever hand out (its largest span, aligned).
    pub(crate) fn largest_span(&self) -> u64 {
        self.spans.iter().map(|&(s, e)| e - s).max().unwrap_or(0)
    }

    /// Largest free range, 0 if none. A request of at most this many bytes succeeds.
    pub(crate) fn largest_free(&self) -> u64 {
        self.by_size.last().map_or(0, |&(l, _)| l)
    }

    /// Number of free ranges (a measure of fragmentation).
    pub(crate) fn free_ranges(&self) -> usize {
        self.free.len()
    }

    fn round(&self, size: u64) -> Option<u64> {
        size.max(1).checked_next_multiple_of(self.align)
    }

    /// Whether `[offset, offset + reserved_size(size))` could be a live extent: aligned, inside
    /// the usable range, and overlapping no free range. Checking this before a free is what
    /// keeps a bad free from corrupting the free lists.
    fn is_live(&self, offset: u64, size: u64) -> bool {
        let Some(need) = self.round(size) else {
            return false;
        };
        let Some(end) = offset.checked_add(need) else {
            return false;
        };
        if offset & (self.align - 1) != 0 || need > self.used {
            return false;
        }
        // Inside one span: the last one starting at or before `offset`.
        let i = self.spans.partition_point(|&(start, _)| start <= offset);
        if i == 0 || end > self.spans[i - 1].1 {
            return false;
        }
        // Free ranges are disjoint and sorted, so only the last one starting before `end` can
        // reach into the extent.
        match self.free.range(..end).next_back() {
            Some((&foff, &flen)) => foff + flen <= offset,
            None => true,
        }
    }

    fn insert_free(&mut self, off: u64, len: u64) {
        self.free.insert(off, len);
        self.by_size.insert((len, off));
    }

    fn remove_free(&mut self, off: u64, len: u64) {
        self.free.remove(&off);
        self.by_size.remove(&(len, off));
    }

    /// The free ranges as `(offset, len)`, by offset.
    #[cfg(test)]
    fn ranges(&self) -> Vec<(u64, u64)> {
        self.free.iter().map(|(&o, &l)| (o, l)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::testutil::Rng;

    #[test]
    fn shrink_gives_the_tail_back_and_frees_as_the_smaller_size() {
        let mut a = ExtentAllocator::new(8 * 4096, 4096).with_small_slots();
        // A range to a shorter range.
        let x = a.alloc(3 * 4096).unwrap();
        assert!(a.shrink(x, 3 * 4096, 5000));
        assert_eq!(a.used(), 2 * 4096);
        a.free(x, 5000);
        assert_eq!((a.used(), a.ranges()), (0, vec![(0, 8 * 4096)]));
        // A range to a slot: its first page becomes a page of slots, shared with a later slot.
        let x = a.alloc(2 * 4096).unwrap();
        assert!(a.shrink(x, 2 * 4096, 100));
        assert_eq!(a.used(), 128);
        let y = a.alloc(100).unwrap();
        assert_eq!(y, x + 128, "the next slot of that page");
        a.free(x, 100);
        a.free(y, 100);
        assert_eq!((a.used(), a.ranges()), (0, vec![(0, 8 * 4096)]));
        // To nothing.
        let x = a.alloc(4096).unwrap();
        assert!(a.shrink(x, 4096, 0));
        assert_eq!((a.used(), a.ranges()), (0, vec![(0, 8 * 4096)]));
        // A slot shrinks only within its slot size.
        let x = a.alloc(1000).unwrap();
        assert!(a.shrink(x, 1000, 600));
        assert!(!a.shrink(x, 600, 100));
        assert_eq!(a.used(), 1024);
        a.free(x, 600);
        assert_eq!((a.used(), a.ranges()), (0, vec![(0, 8 * 4096)]));
    }

    #[test]
    fn alloc_free_coalesce() {
        let mut a = ExtentAllocator::new(4096, 256);
        let x = a.alloc(256).unwrap();
        let y = a.alloc(256).unwrap();
        let z = a.alloc(256).unwrap();
        assert_eq!((x, y, z), (0, 256, 512));
        assert_eq!(a.used(), 768);
        assert_eq!(a.free_ranges(), 1);
        a.free(y, 256);
        assert_eq!(a.free_ranges(), 2);
        a.free(x, 256);
        // x and y merged into one hole before z.
        assert_eq!(a.ranges(), vec![(0, 512), (768, 4096 - 768)]);
        a.free(z, 256);
        assert_eq!(a.ranges(), vec![(0, 4096)]);
        assert_eq!(a.used(), 0);
        assert_eq!(a.largest_free(), 4096);
    }

    #[test]
    fn sizes_round_up_to_alignment() {
        let mut a = ExtentAllocator::new(1 << 20, 4096);
        assert_eq!(a.reserved_size(0), 0, "an empty tensor takes no room");
        assert_eq!(a.reserved_size(1), 4096);
        assert_eq!(a.reserved_size(4096), 4096);
        assert_eq!(a.reserved_size(4097), 8192);
        assert_eq!(a.reserved_size(u64::MAX), u64::MAX);
        let x = a.alloc(1).unwrap();
        let y = a.alloc(5000).unwrap();
        let z = a.alloc(0).unwrap();
        assert_eq!((x, y, z), (0, 4096, 0));
        assert_eq!(a.used(), 3 * 4096);
        a.free(z, 0);
        a.free(y, 5000);
        assert_eq!(a.used(), 4096);
        // Even a full allocator has room for an empty tensor.
        let mut full = ExtentAllocator::new(4096, 4096);
        assert_eq!(full.alloc(4096), Some(0));
        assert_eq!(full.alloc(0), Some(0));
        assert_eq!(a.alloc(u64::MAX), None);
    }

    #[test]
    fn unaligned_length_leaves_tail_unused() {
        let mut a = ExtentAllocator::new(1000, 256);
        assert_eq!(a.len(), 1000);
        assert_eq!(a.largest_free(), 768);
        assert_eq!(a.alloc(769), None);
        assert_eq!(a.alloc(768), Some(0));
        assert_eq!(a.largest_free(), 0);
        assert_eq!(a.free_ranges(), 0);
        assert_eq!(a.alloc(1), None);
        let empty = ExtentAllocator::new(100, 256);
        assert_eq!((empty.largest_free(), empty.free_ranges()), (0, 0));
    }

    #[test]
    fn exhaustion_and_reuse() {
        let mut a = ExtentAllocator::new(1024, 256);
        let offs: Vec<u64> = (0..4).map(|_| a.alloc(200).unwrap()).collect();
        assert_eq!(a.alloc(1), None);
        assert_eq!(a.used(), 1024);
        a.free(offs[2], 200);
        assert_eq!(a.alloc(300), None, "one hole of 256 cannot hold 512");
        assert_eq!(a.alloc(256), Some(offs[2]));
    }

    #[test]
    fn best_fit_picks_smallest_hole_then_lowest_offset() {
        let mut a = ExtentAllocator::new(16 * 256, 256);
        // Extents, in 256-byte units: [0,3) [3,4) [4,5) [5,6) [6,8) [8,9) [9,12), then [12,16) free.
        let sizes = [3, 1, 1, 1, 2, 1, 3];
        let offs: Vec<u64> = sizes.iter().map(|s| a.alloc(s * 256).unwrap()).collect();
        a.free(offs[0], 3 * 256);
        a.free(offs[4], 2 * 256);
        a.free(offs[6], 3 * 256);
        // Holes of 3 units @0, 2 @6, and 7 @9 ([9,12) merged with the free tail).
        assert_eq!(a.ranges(), vec![(0, 768), (6 * 256, 512), (9 * 256, 7 * 256)]);
        assert_eq!(a.alloc(256), Some(6 * 256), "smallest hole that fits");
        assert_eq!(a.alloc(512), Some(0), "the hole of 3 beats the hole of 7");
        assert_eq!(a.alloc(512), Some(9 * 256));
        // Holes now: 1 @2, 1 @7, 5 @11. Ties go to the lowest offset.
        assert_eq!(a.alloc(100), Some(2 * 256));
        assert_eq!(a.alloc(100), Some(7 * 256));
        assert_eq!(a.largest_free(), 5 * 256);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "not allocated")]
    fn double_free_is_caught_in_debug() {
        let mut a = ExtentAllocator::new(4096, 256);
        let x = a.alloc(256).unwrap();
        a.free(x, 256);
        a.free(x, 256);
    }

    #[test]
    #[cfg(not(debug_assertions))]
    fn double_free_is_ignored_in_release() {
        let mut a = ExtentAllocator::new(4096, 256);
        let x = a.alloc(256).unwrap();
        let y = a.alloc(256).unwrap();
        a.free(x, 256);
        a.free(x, 256);
        a.free(x + 1, 256);
        assert_eq!(a.used(), 256);
        assert_eq!(a.ranges(), vec![(0, 256), (512, 4096 - 512)]);
        a.free(y, 256);
        assert_eq!(a.ranges(), vec![(0, 4096)]);
    }

    #[test]
    fn bad_free_checks_hold() {
        let mut a = ExtentAllocator::new(4096, 256);
        let x = a.alloc(512).unwrap();
        assert!(a.is_live(x, 512));
        assert!(!a.is_live(x + 1, 256), "unaligned");
        assert!(!a.is_live(512, 256), "free range");
        assert!(!a.is_live(4096, 256), "out of range");
        assert!(!a.is_live(0, 1024), "reaches into a free range");
        assert!(!a.is_live(!255, 256), "overflow");
    }

    /// Checks every invariant of `a` against `live` (offset -> requested size of live extents).
    fn check(a: &ExtentAllocator, live: &BTreeMap<u64, u64>) {
        let ranges = a.ranges();
        let mut by_size: Vec<(u64, u64)> = ranges.iter().map(|&(o, l)| (l, o)).collect();
        by_size.sort_unstable();
        assert_eq!(by_size, a.by_size.iter().copied().collect::<Vec<_>>(), "index out of sync");
        let used: u64 = live.values().map(|&s| a.reserved_size(s)).sum();
        assert_eq!(a.used(), used);
        let free: u64 = ranges.iter().map(|r| r.1).sum();
        assert_eq!(used + free, a.usable);
        assert_eq!(a.largest_free(), ranges.iter().map(|r| r.1).max().unwrap_or(0));
        assert_eq!(a.free_ranges(), ranges.len());
        for w in ranges.windows(2) {
            assert!(w[0].0 + w[0].1 < w[1].0, "free ranges overlap or touch: {w:?}");
        }
        // Live extents and free ranges together tile each span with no overlap.
        let mut all: Vec<(u64, u64)> = ranges.clone();
        all.extend(live.iter().map(|(&o, &s)| (o, a.reserved_size(s))));
        all.sort_unstable();
        let mut all = all.into_iter().peekable();
        for &(start, end) in &a.spans {
            let mut at = start;
            while let Some(&(o, l)) = all.peek().filter(|r| r.0 < end) {
                assert_eq!(o % a.align, 0);
                assert_eq!(o, at, "gap or overlap at {o}");
                at = o + l;
                all.next();
            }
            assert_eq!(at, end, "span [{start}, {end}) not tiled");
        }
        assert!(all.next().is_none(), "a range outside every span");
    }

    #[test]
    fn spans_never_merge_and_extents_stay_inside_one() {
        let (mut a, starts) = ExtentAllocator::with_spans(&[1024, 1000, 2048], 256);
        assert_eq!(starts, [0, 1280, 2560]);
        assert_eq!((a.len(), a.largest_span(), a.largest_free()), (4072, 2048, 2048));
        assert_eq!(a.alloc(2049), None, "larger than every span");
        // Fill the first two spans: their ranges stay apart even when both are free.
        let x = a.alloc(1024).unwrap();
        let y = a.alloc(768).unwrap();
        assert_eq!((x, y), (0, 1280));
        a.free(x, 1024);
        a.free(y, 768);
        assert_eq!(a.ranges(), vec![(0, 1024), (1280, 768), (2560, 2048)]);
        assert!(!a.is_live(1024, 256), "the gap is never an extent");
        let z = a.alloc(2048).unwrap();
        assert_eq!(z, 2560);
        assert!(a.is_live(z, 2048));
        assert!(!a.is_live(1280, 1536), "crosses out of its span");
    }

    #[test]
    fn small_requests_share_pages_and_give_them_back() {
        let mut a = ExtentAllocator::new(1 << 20, 4096).with_small_slots();
        assert_eq!(a.reserved_size(1), 64);
        assert_eq!(a.reserved_size(65), 128);
        assert_eq!(a.reserved_size(2048), 2048);
        assert_eq!(a.reserved_size(2049), 4096, "over half a page: a page of its own");
        // 64 tensors of 2 bytes: one page, not 64.
        let offs: Vec<u64> = (0..64).map(|_| a.alloc(2).unwrap()).collect();
        assert_eq!(offs, (0..64).map(|i| i * 64).collect::<Vec<_>>());
        assert_eq!(a.used(), 64 * 64);
        assert_eq!(a.largest_free(), (1 << 20) - 4096);
        // The 65th opens a second page; another class takes a page of its own.
        assert_eq!(a.alloc(2), Some(4096));
        assert_eq!(a.alloc(1000), Some(8192));
        assert_eq!(a.alloc(5000), Some(12288), "large requests keep taking whole pages");
        // A freed slot is reused first (the lowest free slot of the lowest open page).
        a.free(offs[5], 2);
        assert_eq!(a.alloc(60), Some(offs[5]));
        // Freeing every slot of a page gives the page back, merged with its neighbours.
        for &o in &offs {
            a.free(o, 2);
        }
        a.free(4096, 2);
        a.free(8192, 1000);
        a.free(12288, 5000);
        assert_eq!(a.used(), 0);
        assert_eq!(a.ranges(), vec![(0, 1 << 20)]);
        // A tier of one page: small tensors fill it slot by slot.
        let mut one = ExtentAllocator::new(4096, 4096).with_small_slots();
        assert!((0..32).all(|_| one.alloc(100).is_some()));
        assert_eq!(one.alloc(100), None);
        // The disk slab's alignment rules are untouched without slots.
        assert_eq!(ExtentAllocator::new(1 << 20, 4096).reserved_size(2), 4096);
    }

    #[test]
    fn small_slots_never_overlap_under_random_use() {
        let mut rng = Rng::new(9);
        let len = 256 << 10;
        let mut a = ExtentAllocator::new(len, 4096).with_small_slots();
        let mut live: BTreeMap<u64, u64> = BTreeMap::new();
        let mut fails = 0;
        for _ in 0..20_000 {
            if live.is_empty() || rng.below(100) < 60 {
                let size = match rng.below(10) {
                    0 => rng.below(5 * 4096),
                    _ => rng.below(2100),
                }
                .max(1);
                match a.alloc(size) {
                    Some(off) => assert!(live.insert(off, size).is_none(), "{off} handed twice"),
                    None => fails += 1,
                }
            } else {
                let i = rng.below(live.len() as u64) as usize;
                let (&off, &size) = live.iter().nth(i).unwrap();
                live.remove(&off);
                a.free(off, size);
            }
            let used: u64 = live.values().map(|&s| a.reserved_size(s)).sum();
            assert_eq!(a.used(), used);
        }
        // Live extents never overlap one another, nor a free range.
        let mut all: Vec<(u64, u64)> =
            live.iter().map(|(&o, &s)| (o, o + a.reserved_size(s))).collect();
        all.extend(a.ranges().into_iter().map(|(o, l)| (o, o + l)));
        all.sort_unstable();
        for w in all.windows(2) {
            assert!(w[0].1 <= w[1].0, "overlap: {w:?}");
        }
        assert!(fails > 0, "the test never filled the allocator");
        for (off, size) in std::mem::take(&mut live) {
            a.free(off, size);
        }
        assert_eq!((a.used(), a.ranges()), (0, vec![(0, len)]));
    }

    #[test]
    fn randomized_against_shadow() {
        for (seed, align, len) in
            [(1u64, 256u64, 1 << 20), (7, 4096, (1 << 22) + 123), (42, 256, 300_000)]
        {
            let mut rng = Rng::new(seed);
            // The same lengths as one span and as three of unequal size.
            let lens = [len / 2, len / 3, len - len / 2 - len / 3];
            for mut a in
                [ExtentAllocator::new(len, align), ExtentAllocator::with_spans(&lens, align).0]
            {
                let mut live: BTreeMap<u64, u64> = BTreeMap::new();
                let mut fails = 0;
                for _ in 0..5000 {
                    if live.is_empty() || rng.below(100) < 55 {
                        // Mostly small requests, some large ones, to force splits and failures.
                        let size = match rng.below(10) {
                            0 => rng.below(len / 4),
                            1..=3 => rng.below(8 * align),
                            _ => rng.below(2 * align),
                        }
                        .max(1);
                        let need = a.reserved_size(size);
                        let before = a.ranges();
                        let expect =
                            before.iter().filter(|r| r.1 >= need).min_by_key(|r| (r.1, r.0));
                        match a.alloc(size) {
                            Some(off) => {
                                assert_eq!(Some(off), expect.map(|r| r.0), "not the best fit");
                                assert!(live.insert(off, size).is_none());
                            }
                            None => {
                                assert!(expect.is_none(), "alloc failed with a fitting hole");
                                fails += 1;
                            }
                        }
                    } else {
                        let i = rng.below(live.len() as u64) as usize;
                        let (&off, &size) = live.iter().nth(i).unwrap();
                        live.remove(&off);
                        a.free(off, size);
                    }
                    check(&a, &live);
                }
                assert!(fails > 0, "the test never exhausted the allocator");
                for (off, size) in std::mem::take(&mut live) {
                    a.free(off, size);
                }
                check(&a, &live);
                assert_eq!(a.free_ranges(), a.spans.iter().filter(|s| s.1 > s.0).count());
            }
        }
    }
}
