//! Loading a checkpoint's tensors: registering them in place (their home is their byte range of
//! a mapped file) and, when asked, copying each into a tier, all or nothing.

use std::sync::Arc;

use super::room::{self, Got};
use super::{prepare_copy, release_failed, run_copy, Shared};
use crate::base::error::{Error, Result};
use crate::base::types::{DType, Group, TensorId, Tier};
use crate::placement::victims::Level;
use crate::residency::{Meta, Replica};
use crate::tiers::file::ExternalFile;
use crate::tiers::Ext;

/// A tensor of a checked file, to register under `name`.
pub(crate) struct InFile {
    /// The file's position in the files given to [`register`].
    pub(crate) file: usize,
    /// Its name in the store.
    pub(crate) name: String,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    /// Where its bytes start in the file, and how many.
    pub(crate) offset: u64,
    pub(crate) bytes: u64,
}

/// Registers `tensors` (of `files`, checked) in place, in `group`, then copies them into
/// `copy_to` if asked; all or nothing. Returns their ids, in the same order.
pub(crate) fn register(
    sh: &Shared,
    files: &[Arc<ExternalFile>],
    tensors: &[InFile],
    copy_to: Option<Tier>,
    group: Group,
) -> Result<Vec<TensorId>> {
    let mut st = sh.lock();
    // All or nothing: check every name first.
    let mut seen = std::collections::HashSet::new();
    for f in tensors {
        if st.res.names.contains_key(f.name.as_str()) || !seen.insert(&f.name) {
            return Err(Error::DuplicateName(f.name.clone()));
        }
    }
    if let Some(t) = copy_to {
        if !st.books.enabled(t) {
            return Err(Error::TierDisabled { tier: t });
        }
    }
    let mut out = Vec::with_capacity(tensors.len());
    for f in tensors {
        let meta = Meta {
            name: f.name.as_str().into(),
            dtype: f.dtype,
            shape: f.shape.clone().into(),
            bytes: f.bytes,
        };
        let id = st.res.insert(meta, group)?;
        st.place.policy.on_insert(id, f.bytes);
        st.res.put_replica(
            id,
            Tier::Disk,
            Replica::new(Ext::File { file: files[f.file].clone(), offset: f.offset }, None),
        );
        st.reindex(id);
        out.push(id);
    }
    let Some(t) = copy_to else { return Ok(out) };
    // Until every copy is done, nobody else gets these ids (the names stay taken).
    for &id in &out {
        if let Ok(e) = st.res.get_mut(id) {
            e.loading = true;
        }
    }
    // Copy each tensor into `t` and drop the file's copy (straight from the file: pread, or
    // O_DIRECT where aligned); on failure, undo the whole load.
    let res = (|| -> Result<()> {
        for (&id, f) in out.iter().zip(tensors) {
            let bytes = f.bytes;
            let flight = st.start_flight(id, None);
            let r = (|| -> Result<()> {
                // A copied tensor is the store's: the write reserve covers it.
                st.cover(id)?;
                let level = if t == Tier::Disk { Level::Guess } else { Level::Demand };
                let ext = match room::alloc_in(sh, &mut st, t, bytes, id, level, true)? {
                    Got::Ext(x) => x,
                    _ => return Err(Error::OutOfMemory { tier: t, bytes }),
                };
                let copy = match prepare_copy(sh, &st, id, Tier::Disk, t, &ext) {
                    Ok(c) => c,
                    Err(e) => {
                        release_failed(sh, &mut st, t, ext);
                        return Err(e);
                    }
                };
                match run_copy(sh, &mut st, copy) {
                    Ok(done) => {
                        if t == Tier::Disk {
                            // Into the store's own slab: the file's copy goes first.
                            let file_copy = st.res.take_replica(id, Tier::Disk);
                            drop(file_copy);
                        }
                        // Counted as bytes put into the store, as a put would be.
                        st.commit_copy(id, None, t, ext, done);
                        Ok(())
                    }
                    Err(e) => {
                        release_failed(sh, &mut st, t, ext);
                        Err(e)
                    }
                }
            })();
            st.end_flight(id, &flight);
            r?;
            if t != Tier::Disk {
                st.drop_replica(id, Tier::Disk);
            }
        }
        Ok(())
    })();
    if let Err(e) = res {
        for id in &out {
            // Undo everything; the error returned is the load's.
            for tier in Tier::ALL {
                if st.res.get(*id).is_ok_and(|e| e.has(tier)) {
                    st.drop_replica(*id, tier);
                }
            }
            st.uncover(*id);
            st.unindex(*id);
            st.res.remove(*id);
            st.place.policy.on_remove(*id);
        }
        return Err(e);
    }
    for &id in &out {
        if let Ok(e) = st.res.get_mut(id) {
            e.loading = false;
        }
    }
    Ok(out)
}
