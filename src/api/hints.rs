//! Migration hints: prefetch, release, pin, layer scopes, step marks, and the Chrome trace.

use std::sync::Arc;

use super::Store;
use crate::base::error::{Error, Result};
use crate::base::types::TensorId;
use crate::migrate::prefetch::{self, Outcome};
use crate::migrate::timeline;
use crate::migrate::{Locked, Shared};
use crate::residency::Source;

impl Store {
    /// Starts bringing these tensors to the Device tier and returns at once. A later
    /// [`device_view`](Store::device_view) waits only for the copy still in flight, by stream
    /// wait. Prefetched tensors are not evicted until used or [`release`](Store::release)d;
    /// prefetches beyond the [prefetch budget](crate::StoreBuilder::prefetch_budget) start once
    /// earlier ones are used. An unknown id is an error and nothing is prefetched.
    pub fn prefetch(&self, ids: &[TensorId]) -> Result<()> {
        self.shared.device_work(|| {
            let sh = &*self.shared;
            let mut st = sh.lock();
            check_ids(&st, ids)?;
            for &id in ids {
                if prefetch::prefetch_one(sh, &mut st, id, Source::Hint, false)? == Outcome::Wait {
                    prefetch::queue_waiting(&mut st, id);
                }
            }
            Ok(())
        })
    }

    /// Says these tensors are done with for now: they are the first demoted when room is needed,
    /// and a tensor whose only copy is on the device (written there) starts being written back
    /// to a host tier with room, so that evicting it later costs nothing. Returns at once; no
    /// data is dropped.
    pub fn release(&self, ids: &[TensorId]) -> Result<()> {
        let sh = &*self.shared;
        let mut st = sh.lock();
        check_ids(&st, ids)?;
        for &id in ids {
            prefetch::release_one(sh, &mut st, id)?;
        }
        prefetch::pump_waiting(sh, &mut st);
        Ok(())
    }

    /// Keeps these tensors on the device until [`unpin`](Store::unpin)ned (bringing them there
    /// first, asynchronously; once room frees if the device has none now). A pinned tensor is
    /// never evicted, moved or removed (`Busy`), not even by a spill that had begun. The
    /// pin holds the memory, so its copy does not count against the prefetch budget (which
    /// limits what prefetches bring ahead of use) and does not hold back other prefetches.
    pub fn pin(&self, ids: &[TensorId]) -> Result<()> {
        self.shared.device_work(|| {
            let sh = &*self.shared;
            let mut st = sh.lock();
            check_ids(&st, ids)?;
            for (k, &id) in ids.iter().enumerate() {
                let unprotected = st.res.get(id)?.prefetched.is_none();
                match prefetch::prefetch_one(sh, &mut st, id, Source::Hint, true) {
                    // No room now, or busy with a move: brought once room frees.
                    Ok(Outcome::Wait) => prefetch::queue_waiting(&mut st, id),
                    Ok(_) => {}
                    Err(e) => {
                        // All or nothing: undo the pins this call made.
                        for &done in &ids[..k] {
                            unpin_one(&mut st, done);
                        }
                        return Err(e);
                    }
                }
                let e = st.res.get_mut(id)?;
                e.pins += 1;
                if unprotected && e.prefetched.is_some() {
                    e.pin_prefetch = true;
                }
                if std::mem::take(&mut e.prefetch_charged) {
                    let bytes = e.bytes();
                    st.place.inflight = st.place.inflight.saturating_sub(bytes);
                }
                st.reindex(id);
            }
            Ok(())
        })
    }

    /// Undoes one [`pin`](Store::pin) of each tensor. Unpinning a tensor that is not pinned is
    /// an `InvalidArgument` error, and nothing is unpinned.
    pub fn unpin(&self, ids: &[TensorId]) -> Result<()> {
        let sh = &*self.shared;
        let mut st = sh.lock();
        check_ids(&st, ids)?;
        for &id in ids {
            let pins = st.res.get(id)?.pins;
            let asked = ids.iter().filter(|&&x| x == id).count() as u32;
            if pins < asked {
                return Err(Error::InvalidArgument(format!(
                    "unpin of tensor {id:?} pinned {pins} time(s), asked {asked}"
                )));
            }
        }
        for &id in ids {
            unpin_one(&mut st, id);
        }
        prefetch::pump_waiting(sh, &mut st);
        Ok(())
    }

    /// A layer scope: this layer uses `uses`, the next one will use `next`. The tensors in `uses`
    /// are made resident (asynchronously; views wait for the copies) and held until the scope
    /// drops, when they are released; `next` is prefetched. Write one around each layer of a
    /// forward and a backward pass:
    ///
    /// ```
    /// # use strata::{DType, Store, Tier};
    /// # fn main() -> strata::Result<()> {
    /// # let store = Store::builder().host_backend().capacity(Tier::Device, 64 << 10).build()?;
    /// # let w: Vec<_> = (0..4).map(|l| store.put(&format!("w{l}"), DType::U8, &[8192], &[0; 8192])).collect::<Result<_, _>>()?;
    /// let s = store.stream()?;
    /// for l in 0..w.len() {
    ///     let next: &[_] = if l + 1 < w.len() { &w[l + 1..l + 2] } else { &[] };
    ///     let _layer = store.layer(&w[l..l + 1], next)?;
    ///     let view = store.device_view(w[l], &s)?;
    ///     // ... launch this layer's kernels on `s` with view.device_ptr() ...
    /// }
    /// # Ok(()) }
    /// ```
    /// What a scope says outranks the policy's own lookahead: scoped and hinted tensors are
    /// never evicted to make room for a guess.
    pub fn layer(&self, uses: &[TensorId], next: &[TensorId]) -> Result<LayerScope> {
        self.shared.device_work(|| {
            let sh = &*self.shared;
            let mut st = sh.lock();
            check_ids(&st, uses)?;
            check_ids(&st, next)?;
            for (k, &id) in uses.iter().enumerate() {
                match prefetch::prefetch_one(sh, &mut st, id, Source::Hint, true) {
                    Ok(Outcome::Wait) => prefetch::queue_waiting(&mut st, id),
                    Ok(_) => {}
                    Err(e) => {
                        // No scope is returned, so nothing would undo these: undo them here.
                        for &done in &uses[..k] {
                            if let Ok(e) = st.res.get_mut(done) {
                                e.scopes -= 1;
                            }
                            st.reindex(done);
                        }
                        return Err(e);
                    }
                }
                st.res.get_mut(id)?.scopes += 1;
                st.reindex(id);
            }
            for &id in next {
                // What comes next is a hint: its copy failing is not this call's error (the scope
                // is made; the tensor stays where it is, and a view will try, and report, again).
                match prefetch::prefetch_one(sh, &mut st, id, Source::Hint, false) {
                    Ok(Outcome::Wait) => prefetch::queue_waiting(&mut st, id),
                    Ok(_) => {}
                    Err(e) => sh.defer_err(e),
                }
            }
            Ok(LayerScope { shared: self.shared.clone(), uses: uses.to_vec() })
        })
    }

    /// Marks the start of a training step, for the schedule-learning policy (which can also
    /// find the period of the accesses without it).
    pub fn step(&self) {
        self.shared.lock().place.policy.on_step();
    }

    /// Writes a Chrome trace (open it in Perfetto, ui.perfetto.dev, or chrome://tracing) of the
    /// copies on each copy stream, the disk workers' reads and the consumers' waits recorded so
    /// far (the most recent 100,000).
    ///
    /// Fails with [`Error::InvalidArgument`] unless the store keeps a timeline
    /// ([`StoreBuilder::timeline`](crate::StoreBuilder::timeline)).
    pub fn trace(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let mut st = self.shared.lock();
        st.resolve_probes();
        let Some(tl) = st.timeline.as_mut() else {
            return Err(Error::InvalidArgument(
                "the store keeps no timeline: build it with StoreBuilder::timeline(true)".into(),
            ));
        };
        tl.resolve();
        let spans = tl.snapshot();
        // The file is written without the lock: a large trace takes long to write.
        drop(st);
        timeline::write_chrome(path.as_ref(), &spans)
    }
}

/// A layer's hold on the tensors it uses (see [`Store::layer`]): dropping it releases them.
#[must_use = "the layer's tensors are released when the scope drops"]
pub struct LayerScope {
    shared: Arc<Shared>,
    uses: Vec<TensorId>,
}

impl std::fmt::Debug for LayerScope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerScope").field("uses", &self.uses).finish()
    }
}

impl Drop for LayerScope {
    fn drop(&mut self) {
        let sh = &*self.shared;
        let mut st = sh.lock();
        let mut res = Ok(());
        for &id in &self.uses {
            if let Ok(e) = st.res.get_mut(id) {
                e.scopes = e.scopes.saturating_sub(1);
                st.reindex(id);
                if res.is_ok() {
                    res = prefetch::release_one(sh, &mut st, id);
                }
            }
        }
        prefetch::pump_waiting(sh, &mut st);
        drop(st);
        if let Err(e) = res {
            sh.defer_err(e);
        }
    }
}

fn check_ids(st: &Locked<'_>, ids: &[TensorId]) -> Result<()> {
    match ids.iter().find(|&&id| st.res.get(id).is_err()) {
        Some(&id) => Err(Error::UnknownId(id)),
        None => Ok(()),
    }
}

/// Undoes one pin of `id`. The last one also ends the prefetch protection the pin gave (one a
/// `prefetch` or scope hint gave stays until the tensor is used or released).
fn unpin_one(st: &mut Locked<'_>, id: TensorId) {
    let Ok(e) = st.res.get_mut(id) else { return };
    e.pins = e.pins.saturating_sub(1);
    if e.pins == 0 && e.scopes == 0 {
        // A pin still waiting for room is no longer wanted on the device.
        e.queued = false;
    }
    if e.pins == 0 && e.pin_prefetch {
        st.consume_prefetch(id);
    }
    st.reindex(id);
}
