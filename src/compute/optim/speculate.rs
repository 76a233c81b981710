//! Speculative updates: an update started before the caller knows it stands (a trainer's, before
//! the step's global gradient norm says whether to clip), which saves what it overwrites first so
//! that it can be undone exactly (SuperOffload's speculation, with the state restored bit for bit
//! rather than recomputed).
//!
//! A parameter's backup is a set of store tensors of the optimizer's own (group
//! [`Group::OptimizerState`], made once in the Pinned tier by [`Optimizer::reserve_backup`] and
//! reused step to step): a copy of the f32 master (or f32 parameter), of the bf16 compute copy
//! when there is a master, and of both moments. The Cpu engine's job copies each block of the
//! state into them in the same pass as it updates the block (a backup spilled out of host memory
//! is written whole before the update changes anything), so a backup is whole before the state
//! it keeps has changed. [`Optimizer::commit_speculative`] lets the updates stand;
//! [`Optimizer::undo_speculative`] waits for them and writes the backups back, leaving the
//! parameters unstepped, to be updated again (with a clipping factor) or not at all.

use half::bf16;

use super::{retry_busy, Backup, Commit, Optimizer, ParamState, Slot};
use crate::base::error::{Error, Result};
use crate::base::types::{DType, Group, TensorId, Tier};

impl Backup {
    /// Its tensors.
    pub(super) fn ids(&self) -> Vec<TensorId> {
        let mut v = vec![self.p];
        v.extend(self.out);
        if let Some((m, s)) = self.moments {
            v.extend([m, s]);
        }
        v
    }

    /// `(backup, state tensor it keeps, dtype)` for each of its tensors.
    fn pairs(&self, st: &ParamState) -> Vec<(TensorId, TensorId, DType)> {
        let mut v = vec![(self.p, st.master.unwrap_or(st.param), DType::F32)];
        if let Some(o) = self.out {
            v.push((o, st.param, st.dtype));
        }
        if let (Some((bm, bv)), Some((m, s))) = (self.moments, st.moments) {
            v.extend([(bm, m, DType::F32), (bv, s, DType::F32)]);
        }
        v
    }
}

/// A backup's tensors opened for a Cpu job: views in host memory, or values read out of the
/// store (a backup spilled to disk).
pub(super) struct BackupSlots {
    p: Slot,
    out: Option<Slot>,
    moments: Option<(Slot, Slot)>,
}

impl BackupSlots {
    pub(super) fn open(store: &crate::Store, b: &Backup) -> Result<BackupSlots> {
        let f32_slot = |id| Slot::open(store, id, DType::F32);
        Ok(BackupSlots {
            p: f32_slot(b.p)?,
            out: b.out.map(|o| Slot::open(store, o, DType::BF16)).transpose()?,
            moments: match b.moments {
                Some((m, v)) => Some((f32_slot(m)?, f32_slot(v)?)),
                None => None,
            },
        })
    }

    /// Every tensor viewed in host memory: written in the update's own pass.
    pub(super) fn in_place(&self) -> bool {
        let view = |s: &Slot| matches!(s, Slot::View(_));
        view(&self.p)
            && self.out.as_ref().is_none_or(view)
            && self.moments.as_ref().is_none_or(|(m, v)| view(m) && view(v))
    }

    /// The slices the update copies each block into before it writes the block.
    pub(super) fn slices(&mut self) -> Result<super::Saved<'_>> {
        let (m, v): (&mut [f32], &mut [f32]) = match self.moments.as_mut() {
            Some((m, v)) => (m.f32s()?, v.f32s()?),
            None => (&mut [], &mut []),
        };
        let out = match self.out.as_mut() {
            Some(o) => Some(o.bf16s()?),
            None => None,
        };
        Ok(super::Saved { p: self.p.f32s()?, m, v, out })
    }

    /// Copies the state into the backup and writes what was read out back into the store,
    /// before the update changes anything (a backup not all in host memory).
    pub(super) fn save_whole(
        mut self,
        store: &crate::Store,
        p: &mut Slot,
        moments: Option<&mut (Slot, Slot)>,
        out: Option<&mut Slot>,
    ) -> Result<()> {
        self.p.f32s()?.copy_from_slice(p.f32s()?);
        if let (Some((bm, bv)), Some((m, v))) = (self.moments.as_mut(), moments) {
            bm.f32s()?.copy_from_slice(m.f32s()?);
            bv.f32s()?.copy_from_slice(v.f32s()?);
        }
        if let (Some(bo), Some(o)) = (self.out.as_mut(), out) {
            bo.bf16s()?.copy_from_slice(o.bf16s()?);
        }
        let mut slots = vec![self.p];
        slots.extend(self.out);
        if let Some((m, v)) = self.moments {
            slots.extend([m, v]);
        }
        Commit(slots.into_iter().filter_map(Slot::into_write).collect()).apply(store)
    }
}

/// Writes backup `from` back into the state tensor `to` (of `dtype`), in place where it is in
/// host memory.
fn restore(store: &crate::Store, from: TensorId, to: TensorId, dtype: DType) -> Result<()> {
    let mut src = Slot::open(store, from, dtype)?;
    let mut dst = Slot::open(store, to, dtype)?;
    match dtype {
        DType::F32 => dst.f32s()?.copy_from_slice(src.f32s()?),
        _ => {
            let s: &[bf16] = src.bf16s()?;
            dst.bf16s()?.copy_from_slice(s);
        }
    }
    drop(src);
    if let Some((id, bytes)) = dst.into_write() {
        retry_busy(|| store.write(id, &bytes))?;
    }
    Ok(())
}

impl Optimizer {
    /// Bytes a backup of parameter `param` takes ([`Optimizer::reserve_backup`]): its f32
    /// master (or f32 parameter), its bf16 compute copy when it has a master, its moments.
    pub fn backup_bytes(&self, param: TensorId) -> Result<u64> {
        let st = self.state_of(param)?;
        let per = 4
            + if st.master.is_some() { st.dtype.size_of() as u64 } else { 0 }
            + 4 * self.cfg.algorithm.moments() as u64;
        Ok(per * st.elems as u64)
    }

    /// Makes parameter `param`'s backup for speculative updates
    /// ([`Optimizer::update_speculative`]): store tensors of group [`Group::OptimizerState`]
    /// in the Pinned tier (named after the state they keep, `.backup` added), kept until the
    /// optimizer is dropped. `Ok(false)` when the Pinned tier has no room for them (nothing is
    /// made: a backup on disk would cost more than the speculation hides). The Cpu engine only
    /// ([`Error::InvalidArgument`] on the others, whose updates run on the caller's thread).
    pub fn reserve_backup(&mut self, param: TensorId) -> Result<bool> {
        let i = *self.index.get(&param).ok_or_else(|| {
            Error::InvalidArgument(format!("{param} is not a parameter of this optimizer"))
        })?;
        if self.engine != super::Engine::Cpu {
            return Err(Error::InvalidArgument(format!(
                "speculative updates run on the Cpu engine, not {}",
                self.engine
            )));
        }
        let st = self.params[i];
        if st.backup.is_some() {
            return Ok(true);
        }
        let s = &self.store;
        let info = s.info(param)?;
        let mut made = Vec::new();
        let mut make = |name: String, dtype: DType| -> Result<Option<TensorId>> {
            let zeros = vec![0u8; st.elems * dtype.size_of()];
            match s.put_in(Tier::Pinned, &name, Group::OptimizerState, dtype, &info.shape, &zeros) {
                Ok(id) => {
                    made.push(id);
                    Ok(Some(id))
                }
                Err(
                    Error::OutOfMemory { .. } | Error::TooLarge { .. } | Error::TierDisabled { .. },
                ) => Ok(None),
                Err(e) => Err(e),
            }
        };
        let name = &info.name;
        let r = (|| -> Result<Option<Backup>> {
            let p_name = if st.master.is_some() { format!("{name}.master") } else { name.clone() };
            let Some(p) = make(format!("{p_name}.backup"), DType::F32)? else { return Ok(None) };
            let out = match st.master {
                Some(_) => match make(format!("{name}.backup"), st.dtype)? {
                    Some(o) => Some(o),
                    None => return Ok(None),
                },
                None => None,
            };
            let moments = match st.moments {
                Some(_) => {
                    let m = make(format!("{name}.exp_avg.backup"), DType::F32)?;
                    let v = make(format!("{name}.exp_avg_sq.backup"), DType::F32)?;
                    match (m, v) {
                        (Some(m), Some(v)) => Some((m, v)),
                        _ => return Ok(None),
                    }
                }
                None => None,
            };
            Ok(Some(Backup { p, out, moments }))
        })();
        match r {
            Ok(Some(b)) => {
                self.params[i].backup = Some(b);
                Ok(true)
            }
            other => {
                // Nothing half made stays.
                for id in made {
                    if let Err(e) = s.remove(id) {
                        s.shared.defer_err(e);
                    }
                }
                other.map(|_| false)
            }
        }
    }

    /// Removes parameter `param`'s backup (none is fine). Refused while a speculative update of
    /// it is neither committed nor undone.
    pub fn remove_backup(&mut self, param: TensorId) -> Result<()> {
        let i = *self.index.get(&param).ok_or_else(|| {
            Error::InvalidArgument(format!("{param} is not a parameter of this optimizer"))
        })?;
        if self.step.speculated.contains_key(&param) {
            return Err(Error::InvalidArgument(format!(
                "{param}'s backup holds a speculative update not yet committed or undone"
            )));
        }
        let mut first = None;
        for id in self.params[i].backup.take().map_or_else(Vec::new, |b| b.ids()) {
            if let Err(e) = self.store.remove(id) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Whether parameter `param` has a backup ([`Optimizer::reserve_backup`]).
    pub fn has_backup(&self, param: TensorId) -> bool {
        self.state_of(param).is_ok_and(|st| st.backup.is_some())
    }

    /// [`Optimizer::update`] (unscaled) started before the caller knows it stands: the Cpu
    /// engine's job first saves what it overwrites (the master or parameter, the compute copy,
    /// the moments) into the parameter's backup ([`Optimizer::reserve_backup`]), then updates
    /// as [`Optimizer::update`] does. The step cannot finish until the caller either commits
    /// the speculative updates ([`Optimizer::commit_speculative`]) or undoes them
    /// ([`Optimizer::undo_speculative`]). Refused ([`Error::InvalidArgument`]) for a parameter
    /// without a backup or already updated, queued or failed in this step.
    pub fn update_speculative(&mut self, param: TensorId) -> Result<()> {
        let st = self.state_of(param)?;
        let Some(b) = st.backup else {
            return Err(Error::InvalidArgument(format!(
                "{param} has no backup for a speculative update: Optimizer::reserve_backup first"
            )));
        };
        let book = &self.step;
        if [&book.stepped, &book.queued].iter().any(|s| s.contains(&param))
            || book.failed.contains_key(&param)
        {
            return Err(Error::InvalidArgument(format!(
                "{param} was updated in this step already: a speculative update starts a \
                 parameter's step"
            )));
        }
        // Not whole until its job says so: an update that fails to be queued changed nothing.
        self.step.speculated.insert(param, false);
        self.queue_cpu(st, 1.0, Some(b))
    }

    /// Speculative updates of this step neither committed nor undone yet.
    pub fn speculated(&self) -> usize {
        self.step.speculated.len()
    }

    /// Lets this step's speculative updates stand: they are the step's plain updates from now
    /// on (one that failed is redone by [`Optimizer::update_scaled`] as any failed update is).
    /// Returns how many there were.
    pub fn commit_speculative(&mut self) -> usize {
        let n = self.step.speculated.len();
        self.step.speculated.clear();
        n
    }

    /// Undoes this step's speculative updates: waits for them, then writes each whole backup
    /// back over the state it keeps (in place where it is in host memory), so the parameters,
    /// masters and moments are bit for bit what they were before; the parameters are then
    /// unstepped ([`Optimizer::unstepped`]), to be updated again (clipped, say) or not at all.
    /// An update that failed before its backup was whole had changed nothing. Returns how many
    /// were undone; on an error, those not undone yet stay speculative, for a later call.
    pub fn undo_speculative(&mut self) -> Result<usize> {
        if self.step.speculated.is_empty() {
            return Ok(0);
        }
        // The jobs' outcomes say which backups are whole; a job's error does not matter here
        // (its update is undone like the others).
        let _ = self.wait_pending(0);
        let mut list: Vec<(usize, TensorId, bool)> = self
            .step
            .speculated
            .iter()
            .map(|(&p, &saved)| (self.index.get(&p).copied().unwrap_or(usize::MAX), p, saved))
            .collect();
        list.sort_unstable();
        let mut undone = 0;
        for (_, param, saved) in list {
            if saved {
                let st = self.state_of(param)?;
                let b = st.backup.ok_or_else(|| {
                    Error::InvalidArgument(format!("{param} was speculated without a backup"))
                })?;
                for (from, to, dtype) in b.pairs(&st) {
                    restore(&self.store, from, to, dtype)?;
                }
            }
            let book = &mut self.step;
            book.speculated.remove(&param);
            book.stepped.remove(&param);
            book.queued.remove(&param);
            book.failed.remove(&param);
            self.undone += 1;
            undone += 1;
        }
        Ok(undone)
    }

    /// Speculative updates undone since the optimizer was made ([`Optimizer::undo_speculative`]).
    pub fn undone(&self) -> u64 {
        self.undone
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::compute::optim::{AdamW, Algorithm, Engine, OptimizerConfig};
    use crate::Store;

    /// A parameter of `dtype` trained 3 steps by AdamW (lr 0.1, weight decay 0.01) on every
    /// core: step 1 plain; step 2 speculative then undone (its backup in the Pinned tier, or
    /// moved to the Disk tier when `spilled`) and redone clipped by 0.3; step 3 speculative and
    /// committed. Returns the bytes of the parameter, its master and its moments after each step,
    /// and those seen right after the undo.
    fn three_steps(dtype: DType, speculate: bool, spilled: bool) -> (Vec<Vec<u8>>, Vec<u8>) {
        let dir = tempfile::tempdir().unwrap();
        let s = Arc::new(
            Store::builder()
                .host_backend()
                .capacity(Tier::Device, 1 << 20)
                .capacity(Tier::Pinned, 4 << 20)
                .capacity(Tier::Disk, 4 << 20)
                .disk_dir(dir.path())
                .build()
                .unwrap(),
        );
        let n = 9000; // two chunks of the update on two threads and more
        let init: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
        let w = match dtype {
            DType::F32 => s.put_slice("w", &[n], &init).unwrap(),
            _ => {
                let b: Vec<bf16> = init.iter().map(|&x| bf16::from_f32(x)).collect();
                s.put_slice("w", &[n], &b).unwrap()
            }
        };
        let alg = Algorithm::AdamW(AdamW { lr: 0.1, weight_decay: 0.01, ..AdamW::default() });
        let mut cfg = OptimizerConfig::new(alg, Engine::Cpu);
        cfg.grad_dtype = Some(DType::F32);
        let mut opt = Optimizer::new(s.clone(), &s.stream().unwrap(), &[w], cfg).unwrap();
        assert!(opt.reserve_backup(w).unwrap());
        let b = opt.params[0].backup.unwrap();
        let st = opt.params[0];
        if spilled {
            for id in b.ids() {
                s.move_to(id, Tier::Disk).unwrap();
            }
        }
        let state = |opt: &Optimizer| -> Vec<u8> {
            let st = opt.params[0];
            let mut ids = vec![st.param];
            ids.extend(st.master);
            ids.extend(st.moments.map_or_else(Vec::new, |(m, v)| vec![m, v]));
            ids.iter().flat_map(|&id| s.read(id).unwrap()).collect()
        };
        let grad = |k: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * k).sin()).collect() };
        let mut after = Vec::new();
        s.write_slice(st.grad, &grad(0.37)).unwrap();
        opt.update(w).unwrap();
        opt.finish().unwrap();
        after.push(state(&opt));
        s.write_slice(st.grad, &grad(0.53)).unwrap();
        let mut undone = Vec::new();
        if speculate {
            opt.update_speculative(w).unwrap();
            assert_eq!(opt.speculated(), 1);
            assert!(opt.finish().is_err(), "finish before the speculation is settled");
            assert_eq!(opt.undo_speculative().unwrap(), 1);
            assert_eq!((opt.speculated(), opt.undone()), (0, 1));
            undone = state(&opt);
            assert_eq!(opt.unstepped(), [w]);
        }
        opt.update_scaled(w, 0.3).unwrap();
        opt.finish().unwrap();
        after.push(state(&opt));
        s.write_slice(st.grad, &grad(0.71)).unwrap();
        if speculate {
            opt.update_speculative(w).unwrap();
            assert_eq!(opt.commit_speculative(), 1);
        } else {
            opt.update(w).unwrap();
        }
        opt.finish().unwrap();
        after.push(state(&opt));
        if spilled {
            assert!(b.ids().iter().all(|&id| s.tier_of(id).unwrap() == Tier::Disk));
        }
        (after, undone)
    }

    #[test]
    fn a_speculative_update_undone_is_bit_for_bit_as_before_and_redone_clipped_as_a_clean_step() {
        for dtype in [DType::F32, DType::BF16] {
            let (clean, _) = three_steps(dtype, false, false);
            for spilled in [false, true] {
                let what = format!("{dtype}, backup spilled {spilled}");
                let (got, undone) = three_steps(dtype, true, spilled);
                assert_eq!(undone, clean[0], "{what}: the undo did not restore step 1's state");
                assert_eq!(got, clean, "{what}");
            }
        }
    }

    #[test]
    fn speculation_is_refused_without_a_backup_or_on_the_gpu_engines() {
        let s = Arc::new(
            Store::builder()
                .host_backend()
                .capacity(Tier::Device, 1 << 20)
                .capacity(Tier::Pinned, 1 << 20)
                .build()
                .unwrap(),
        );
        let w = s.put_slice("w", &[16], &[1.0f32; 16]).unwrap();
        let alg = Algorithm::AdamW(AdamW::default());
        let mut opt = Optimizer::new(
            s.clone(),
            &s.stream().unwrap(),
            &[w],
            OptimizerConfig::new(alg, Engine::Cpu),
        )
        .unwrap();
        assert_eq!(opt.backup_bytes(w).unwrap(), 16 * 12);
        let e = opt.update_speculative(w).unwrap_err().to_string();
        assert!(e.contains("reserve_backup first"), "{e}");
        assert!(opt.reserve_backup(w).unwrap() && opt.has_backup(w));
        opt.remove_backup(w).unwrap();
        assert!(!opt.has_backup(w));
        let mut gpu = Optimizer::new(
            s.clone(),
            &s.stream().unwrap(),
            &[s.put_slice("u", &[16], &[1.0f32; 16]).unwrap()],
            OptimizerConfig::new(alg, Engine::GpuResident),
        )
        .unwrap();
        let u = s.lookup("u").unwrap();
        assert!(gpu.reserve_backup(u).unwrap_err().to_string().contains("Cpu engine"));
    }
}
