//! The store's own paths, `store_<from>_to_<to>`: one tensor of the sweep's size in a store
//! with room for exactly one such tensor in each tier, moved with [`Store::move_to`] on the wall
//! clock. Written against the public API only.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::CudaContext;

use strata::Store;
use strata::Stream;
use strata::{DType, TensorId, Tier};
use strata::{Error, Result};

/// A store holding one tensor, for timing its moves.
pub(super) struct StorePaths {
    store: Store,
    id: TensorId,
    data: Vec<u8>,
    stream: Stream,
}

/// Deterministic, non-constant bytes (so that a wrong copy shows).
fn contents(len: usize) -> Vec<u8> {
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

impl StorePaths {
    /// A store on the CUDA backend in `ctx` (or the host backend without one), each tier sized
    /// for one tensor of `size` bytes, its disk tier in `dir`, holding that tensor.
    pub(super) fn new(ctx: Option<&Arc<CudaContext>>, size: u64, dir: &Path) -> Result<StorePaths> {
        let room = size.div_ceil(4096) * 4096;
        // Moves only, no overwrites: no write reserve, so one tensor's room per tier suffices.
        let mut b = Store::builder().disk_dir(dir).promote_on_read(false).write_reserve(false);
        for t in Tier::ALL {
            b = b.capacity(t, room);
        }
        b = match ctx {
            Some(ctx) => b.context(ctx.clone()),
            None => b.host_backend(),
        };
        let store = b.build()?;
        let len = usize::try_from(size)
            .map_err(|_| Error::InvalidArgument(format!("size {size} too large")))?;
        let data = contents(len);
        let id = store.put("strata-bench", DType::U8, &[len], &data)?;
        let stream = store.stream()?;
        Ok(StorePaths { store, id, data, stream })
    }

    /// Makes `from` the tensor's fastest copy and leaves no copy in `to`, so that
    /// `move_to(to)` copies from `from` to `to`.
    fn prepare(&self, from: Tier, to: Tier) -> Result<()> {
        // Afterwards `from` is the fastest copy; slower copies may remain.
        self.store.move_to(self.id, from)?;
        if to > from && self.store.info(self.id)?.tiers.contains(&to) {
            // Keep only the copy in `from`: a dirty device view keeps only the Device copy, a
            // write only the fastest.
            if from == Tier::Device {
                let mut v = self.store.device_view(self.id, &self.stream)?;
                v.mark_dirty();
                drop(v);
                self.stream.synchronize()?;
                self.store.check_err()?;
            } else {
                self.store.write(self.id, &self.data)?;
            }
        }
        let tiers = self.store.info(self.id)?.tiers;
        if tiers.first() != Some(&from) || tiers.contains(&to) {
            return Err(Error::InvalidArgument(format!(
                "could not set up a move from {from} to {to}: copies in {tiers:?}"
            )));
        }
        Ok(())
    }

    /// Times `move_to(to)` of the tensor whose only copy (or fastest copy, when moving up) is in
    /// `from`: `warmup` untimed moves, then `reps` timed ones. Checks after each that the store
    /// counted exactly one copy of the tensor from `from` to `to`.
    pub(super) fn measure(
        &mut self,
        from: Tier,
        to: Tier,
        warmup: usize,
        reps: usize,
    ) -> Result<Vec<f64>> {
        if from == to || reps == 0 {
            return Err(Error::InvalidArgument(format!("a move from {from} to {to}, {reps} runs")));
        }
        let bytes = self.data.len() as u64;
        let mut seconds = Vec::with_capacity(reps);
        for run in 0..warmup + reps {
            self.prepare(from, to)?;
            let before = self.store.stats().moved(from, to);
            let t = Instant::now();
            self.store.move_to(self.id, to)?;
            let secs = t.elapsed().as_secs_f64();
            let moved = self.store.stats().moved(from, to) - before;
            if moved != bytes {
                return Err(Error::InvalidArgument(format!(
                    "move_to({to}) moved {moved} bytes from {from}, expected {bytes}"
                )));
            }
            if run >= warmup {
                seconds.push(secs);
            }
        }
        self.store.check_err()?;
        Ok(seconds)
    }

    /// Checks that the tensor still holds the bytes it was put with.
    pub(super) fn verify(&self) -> Result<()> {
        let got = self.store.read(self.id)?;
        if got != self.data {
            let at = got.iter().zip(&self.data).position(|(a, b)| a != b).unwrap_or(0);
            return Err(Error::InvalidArgument(format!("first differing byte at offset {at}")));
        }
        self.store.check_err()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_pair_moves_once_and_keeps_the_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = StorePaths::new(None, 10_000, dir.path()).unwrap();
        for from in Tier::ALL {
            for to in Tier::ALL.into_iter().filter(|&t| t != from) {
                let secs = s.measure(from, to, 1, 2).unwrap();
                assert_eq!(secs.len(), 2, "{from} -> {to}");
                assert_eq!(s.store.tier_of(s.id).unwrap(), to);
            }
        }
        s.verify().unwrap();
        assert!(s.measure(Tier::Disk, Tier::Disk, 0, 1).is_err());
    }
}
