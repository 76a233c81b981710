//! Counters a store reports: per-tier use, bytes moved between tiers, hits and misses.

use std::fmt;

use crate::base::types::{format_size, BackendKind, Group, Tier};

/// Use of one tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TierStats {
    /// Bytes taken by tensors (rounded up to the tier's alignment), and by copies the store
    /// dropped whose memory waits for work still touching it (a copy in flight, a view's
    /// kernels: [`Store::wait_for_copies`] waits for those).
    ///
    /// [`Store::wait_for_copies`]: crate::Store::wait_for_copies
    pub used: u64,
    /// The tier's budget (0: disabled).
    pub capacity: u64,
    /// Bytes reserved from the backend so far (chunks), at most `capacity`.
    pub reserved: u64,
    /// The largest tensor that would fit now without evicting anything: with `capacity - used`,
    /// a measure of fragmentation.
    pub largest_free: u64,
    /// Tensors with a copy in this tier.
    pub tensors: usize,
    /// Free ranges inside reserved memory: more than one per chunk means fragmentation.
    pub free_ranges: usize,
    /// Bytes kept aside as the write reserve (room for a second copy of the largest tensor, so
    /// that any tensor can be overwritten: [`StoreBuilder::write_reserve`]); not in `used`.
    ///
    /// [`StoreBuilder::write_reserve`]: crate::StoreBuilder::write_reserve
    pub write_reserve: u64,
}

/// A snapshot of a store's counters ([`Store::stats`](crate::Store::stats)).
#[derive(Clone, Debug)]
pub struct Stats {
    /// Per tier, indexed by [`Tier::index`].
    pub tiers: [TierStats; 4],
    /// `moved[from][to]`: bytes copied from one tier to another, indexed by [`Tier::index`].
    pub moved: [[u64; 4]; 4],
    /// Bytes written into the store by `put` and `write`.
    pub bytes_in: u64,
    /// Bytes returned by `read`.
    pub bytes_out: u64,
    /// Accesses (read, device view) that found the tensor in the fastest enabled tier.
    pub hits: u64,
    /// Accesses that did not.
    pub misses: u64,
    /// Tensors that were demoted to make room.
    pub evictions: u64,
    /// Tensors copied into a faster tier by the policy after a miss.
    pub promotions: u64,
    /// Tensors in the store.
    pub tensors: usize,
    /// The backend in use.
    pub backend: BackendKind,
    /// The policy in use.
    pub policy: &'static str,
    /// Device views that found the tensor resident or its copy in flight (a prefetch or an
    /// earlier use paid off).
    pub prefetch_hits: u64,
    /// Device views that had to start the copy themselves.
    pub prefetch_misses: u64,
    /// Prefetch copies started, by hints, layer scopes and the policy's lookahead.
    pub prefetches: u64,
    /// Seconds consumers waited for copies: host threads waiting for moves in flight, plus,
    /// with a timeline, device streams waiting on a copy's event (measured with events once both
    /// complete).
    pub stall_seconds: f64,
    /// Seconds copies took, summed over the recorded copies (the most recent 100,000). Measured
    /// only by a store that keeps a timeline ([`StoreBuilder::timeline`](crate::StoreBuilder::timeline)); 0 otherwise.
    pub copy_seconds: f64,
    /// Whether the store keeps a timeline of copies and waits (so `copy_seconds`, the device
    /// part of `stall_seconds` and the overlap ratio are measured).
    pub timeline: bool,
    /// Bytes whose copies prefetches started and that are not yet used or released (a prefetch
    /// hint of a tensor already on the device protects it without counting here, and a pin's
    /// copy never counts).
    pub prefetch_in_flight: u64,
    /// `groups[group][tier]`: bytes of the tensors of each [`Group`] with a copy in each tier
    /// (a tensor cached in two tiers counts in both; file-backed tensors count in Disk).
    pub groups: [[u64; 4]; 5],
    /// Whether the disk tier bypasses the page cache (`O_DIRECT`); false where the file system
    /// refuses it or the tier is disabled.
    pub disk_direct_io: bool,
}

impl Stats {
    /// Bytes used in `tier`.
    pub fn used(&self, tier: Tier) -> u64 {
        self.tiers[tier.index()].used
    }

    /// Capacity of `tier` in bytes.
    pub fn capacity(&self, tier: Tier) -> u64 {
        self.tiers[tier.index()].capacity
    }

    /// Largest free extent of `tier`.
    pub fn largest_free(&self, tier: Tier) -> u64 {
        self.tiers[tier.index()].largest_free
    }

    /// Bytes of `group`'s tensors with a copy in `tier`.
    pub fn group_bytes(&self, group: Group, tier: Tier) -> u64 {
        self.groups[group.index()][tier.index()]
    }

    /// Bytes moved from `from` to `to`.
    pub fn moved(&self, from: Tier, to: Tier) -> u64 {
        self.moved[from.index()][to.index()]
    }

    /// Bytes copied into `tier` from every other tier.
    pub fn moved_into(&self, tier: Tier) -> u64 {
        Tier::ALL.iter().filter(|&&t| t != tier).map(|&t| self.moved(t, tier)).sum()
    }

    /// Bytes copied out of `tier` into every other tier.
    pub fn moved_out_of(&self, tier: Tier) -> u64 {
        Tier::ALL.iter().filter(|&&t| t != tier).map(|&t| self.moved(tier, t)).sum()
    }

    /// The share of copy time that consumers did not wait for: 1 when every copy overlapped
    /// other work, 0 when consumers waited for all of it (1 when nothing was copied).
    pub fn overlap_ratio(&self) -> f64 {
        if self.copy_seconds <= 0.0 {
            1.0
        } else {
            (1.0 - self.stall_seconds / self.copy_seconds).clamp(0.0, 1.0)
        }
    }

    /// Fraction of accesses that were hits (0 when there were none).
    pub fn hit_ratio(&self) -> f64 {
        let all = self.hits + self.misses;
        if all == 0 {
            0.0
        } else {
            self.hits as f64 / all as f64
        }
    }
}

impl fmt::Display for Stats {
    /// An aligned table: tiers, then bytes moved per tier pair, then counters.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "backend: {}   policy: {}   tensors: {}",
            self.backend, self.policy, self.tensors
        )?;
        writeln!(
            f,
            "{:<8} {:>12} {:>12} {:>7} {:>14} {:>8}",
            "tier", "used", "capacity", "use%", "largest free", "tensors"
        )?;
        for t in Tier::ALL {
            let s = &self.tiers[t.index()];
            if s.capacity == 0 {
                writeln!(f, "{:<8} {:>12}", t.name(), "disabled")?;
                continue;
            }
            writeln!(
                f,
                "{:<8} {:>12} {:>12} {:>6.1}% {:>14} {:>8}",
                t.name(),
                format_size(s.used),
                format_size(s.capacity),
                100.0 * s.used as f64 / s.capacity as f64,
                format_size(s.largest_free),
                s.tensors
            )?;
        }
        for t in Tier::ALL {
            let r = self.tiers[t.index()].write_reserve;
            if r > 0 {
                writeln!(f, "write reserve: {} in {} (not in used)", format_size(r), t.name())?;
            }
        }
        writeln!(f, "bytes moved (row: from, column: to)")?;
        write!(f, "{:<8}", "")?;
        for t in Tier::ALL {
            write!(f, " {:>12}", t.name())?;
        }
        writeln!(f)?;
        for from in Tier::ALL {
            write!(f, "{:<8}", from.name())?;
            for to in Tier::ALL {
                let b = self.moved(from, to);
                let cell = if from == to { "-".to_string() } else { format_size(b) };
                write!(f, " {cell:>12}")?;
            }
            writeln!(f)?;
        }
        write!(
            f,
            "hits {}  misses {}  (hit ratio {})  evictions {}  promotions {}  in {}  out {}",
            self.hits,
            self.misses,
            // No access at all has no ratio (0.0% would read as every access missing).
            if self.hits + self.misses == 0 {
                "-".to_string()
            } else {
                format!("{:.1}%", 100.0 * self.hit_ratio())
            },
            self.evictions,
            self.promotions,
            format_size(self.bytes_in),
            format_size(self.bytes_out)
        )?;
        if self.groups.iter().take(4).any(|g| g.iter().any(|&b| b > 0)) {
            write!(f, "\nbytes per group (row) and tier (column)\n{:<11}", "")?;
            for t in Tier::ALL {
                write!(f, " {:>12}", t.name())?;
            }
            for g in Group::ALL {
                if self.groups[g.index()].iter().all(|&b| b == 0) {
                    continue;
                }
                write!(f, "\n{:<11}", g.name())?;
                for t in Tier::ALL {
                    write!(f, " {:>12}", format_size(self.group_bytes(g, t)))?;
                }
            }
        }
        if self.prefetch_hits + self.prefetch_misses + self.prefetches > 0 {
            write!(
                f,
                "\nviews: prefetch hits {}  misses {}  prefetches {}  stall {:.3} ms",
                self.prefetch_hits,
                self.prefetch_misses,
                self.prefetches,
                self.stall_seconds * 1e3,
            )?;
            if self.timeline {
                write!(
                    f,
                    "  copies {:.3} ms  overlap {:.1}%",
                    self.copy_seconds * 1e3,
                    100.0 * self.overlap_ratio()
                )?;
            }
        }
        Ok(())
    }
}
