//! The write reserve: room for one second copy of the largest tensor the store owns, kept aside
//! so that a tensor can always be overwritten, even when every tier is full.
//!
//! A write puts the new bytes in a new extent and drops the old one only once they are in place,
//! so that a failed write leaves the old bytes. When no tier has room for that second copy, the
//! write borrows the reserve: the new bytes go there first, then over the old copy in place; if
//! the in-place write fails half-way, the reserve's copy becomes the tensor's (the write is done
//! all the same) and the reserve is made again from free room as soon as there is some. The
//! reserve lives in the slowest enabled tier that can hold it (the Disk tier, where there is one)
//! and costs its size there; `Stats` shows it.
//!
//! Only bookkeeping lives here (under the store's lock); the copies are the migration layer's.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::arena::Extent;
use super::disk::SlabBacking;
use crate::base::sync::Signal;
use crate::base::types::Tier;

/// The reserve's books.
#[derive(Default)]
pub(crate) struct WriteReserve {
    /// Whether the store keeps one at all (`StoreBuilder::write_reserve`).
    pub(crate) enabled: bool,
    /// Sizes of the tensors the reserve covers (bytes -> how many).
    owned: BTreeMap<u64, u32>,
    /// The reserved extent and its tier, when held (not lent, not owed).
    pub(crate) held: Option<(Tier, Extent)>,
    /// A write has it: later writes that need it wait for the end of that write (its flight's
    /// signal).
    pub(crate) lent: Option<Arc<Signal>>,
    /// While lent: its tier, offset and size, to take it back.
    pub(crate) lent_ext: Option<(Tier, u64, u64)>,
    /// The Disk tier's slab, to give the reserve's range file-system blocks as it is taken
    /// (`None` without a Disk tier).
    pub(crate) backing: Option<SlabBacking>,
}

impl WriteReserve {
    /// Counts a tensor of `bytes` among those the reserve covers.
    pub(crate) fn note(&mut self, bytes: u64) {
        if self.enabled {
            *self.owned.entry(bytes).or_default() += 1;
        }
    }

    /// Stops counting a tensor of `bytes`.
    pub(crate) fn unnote(&mut self, bytes: u64) {
        if let Some(n) = self.owned.get_mut(&bytes) {
            *n -= 1;
            if *n == 0 {
                self.owned.remove(&bytes);
            }
        }
    }

    /// The largest tensor covered (0 for none).
    pub(crate) fn largest(&self) -> u64 {
        self.owned.keys().next_back().copied().unwrap_or(0)
    }

    /// Whether a reserve of `bytes` (its reserved size) at `offset` of `tier` is backed: the
    /// memory tiers' are (their arenas are reserved whole); the Disk tier's range gets its
    /// file-system blocks now, or is refused (the file system is full).
    pub(crate) fn back(&self, tier: Tier, offset: u64, bytes: u64) -> bool {
        match (&self.backing, tier) {
            (Some(b), Tier::Disk) => match b.back(offset, bytes) {
                Ok(()) => true,
                Err(e) => {
                    tracing::debug!(error = %e, "no room on the file system for the write reserve");
                    false
                }
            },
            _ => true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_covered_size_follows_notes_and_unnotes() {
        let mut r = WriteReserve { enabled: true, ..Default::default() };
        assert_eq!(r.largest(), 0);
        r.note(10);
        r.note(30);
        r.note(30);
        r.note(20);
        assert_eq!(r.largest(), 30);
        r.unnote(30);
        assert_eq!(r.largest(), 30);
        r.unnote(30);
        assert_eq!(r.largest(), 20);
        r.unnote(7);
        assert_eq!(r.largest(), 20);
        let mut off = WriteReserve::default();
        off.note(5);
        assert_eq!(off.largest(), 0, "a store without a reserve covers nothing");
    }
}
