//! The store's operations, each prepared, executed and committed as the module docs of
//! [`migrate`](super) describe: puts, writes, reads (and the promotions they lead to), moves,
//! removals, making a tensor resident for a view, and the settling of a host view.

use std::sync::Arc;

use super::copy::{self, Src};
use super::room::{self, Got};
use super::{copy_replica, fill_replica, prepare_fill, run_copy};
use super::{Locked, Shared, State};
use crate::backend::{RawEvent, RawStream};
use crate::base::element::Element;
use crate::base::error::{Error, Result};
use crate::base::types::{DType, Group, TensorId, Tier};
use crate::placement::victims::Level;
use crate::residency::Meta;
use crate::tiers::arena::WriteLease;
use crate::tiers::Ext;

/// Bytes of a tensor of `dtype` and `shape` ([`DType::bytes_for`]): `BadShape` when the count
/// overflows or a quantized tensor's rows are not whole blocks.
pub(crate) fn tensor_bytes(dtype: DType, shape: &[usize]) -> Result<u64> {
    dtype.bytes_for(shape)
}

/// The tiers a new tensor of `bytes` could ever go to (`only` restricts to one), fastest first;
/// `TooLarge` / `TierDisabled` when none.
/// A backend that has failed ([`Error::BackendFailed`]) leaves the Device tier out.
fn candidate_tiers(sh: &Shared, st: &State, bytes: u64, only: Option<Tier>) -> Result<Vec<Tier>> {
    if let Some(t) = only {
        if !st.books.enabled(t) {
            return Err(Error::TierDisabled { tier: t });
        }
    }
    let device_failed = only.is_none() && sh.health.check().is_err();
    let fits: Vec<Tier> = Tier::ALL
        .into_iter()
        .filter(|&t| only.is_none_or(|o| o == t))
        .filter(|&t| !(device_failed && t == Tier::Device))
        .filter(|&t| st.books.can_ever_fit(t, bytes))
        .collect();
    if fits.is_empty() {
        let caps = Tier::ALL
            .into_iter()
            .filter(|&t| only.is_none_or(|o| o == t) && st.books.enabled(t))
            .map(|t| st.books.describe(t))
            .collect::<Vec<_>>()
            .join(", ");
        let what = match only {
            Some(_) => format!("tier {caps}"),
            None => format!("every enabled tier ({caps})"),
        };
        return Err(Error::TooLarge { bytes, what });
    }
    Ok(fits)
}

/// Finds a home for `id` (new bytes of `bytes`): the fastest tier with free room; else the
/// fastest the policy admits it to, making room there. `id` is in flight.
pub(crate) fn place_new(
    sh: &Shared,
    st: &mut Locked<'_>,
    id: TensorId,
    bytes: u64,
    only: Option<Tier>,
) -> Result<(Tier, Ext)> {
    let fits = candidate_tiers(sh, st, bytes, only)?;
    for &t in &fits {
        if let Some(ext) = st.books.try_alloc(t, bytes) {
            return room::ready_for_writes(sh, st, t, ext, None).map(|(ext, _)| (t, ext));
        }
    }
    for &t in &fits {
        if !st.admits(t, id, bytes) {
            continue;
        }
        if let Got::Ext(ext) = room::alloc(sh, st, t, bytes, id, Level::Demand, true)? {
            return room::ready_for_writes(sh, st, t, ext, None).map(|(ext, _)| (t, ext));
        }
    }
    Err(Error::OutOfMemory { tier: *fits.last().expect("not empty"), bytes })
}

/// A Device extent for a view's miss (a hinted prefetch is evicted only if nothing else makes
/// room), readied for `writer` (the view's stream for an overwrite, else the copy stream).
/// Returns the extent and the events the writer waits for.
fn alloc_for_view(
    sh: &Shared,
    st: &mut Locked<'_>,
    id: TensorId,
    bytes: u64,
    writer: Option<&RawStream>,
) -> Result<(Ext, smallvec::SmallVec<[RawEvent; 2]>)> {
    for level in [Level::Demand, Level::Urgent] {
        if let Got::Ext(ext) = room::alloc(sh, st, Tier::Device, bytes, id, level, true)? {
            return room::ready_for_writes(sh, st, Tier::Device, ext, writer);
        }
    }
    Err(Error::OutOfMemory { tier: Tier::Device, bytes })
}

/// `Store::put` and `put_in`.
pub(crate) fn put(
    sh: &Shared,
    only: Option<Tier>,
    name: &str,
    group: Group,
    dtype: DType,
    shape: &[usize],
    data: &[u8],
) -> Result<TensorId> {
    if name.is_empty() {
        return Err(Error::InvalidArgument("tensor name is empty".into()));
    }
    let bytes = tensor_bytes(dtype, shape)?;
    if bytes != data.len() as u64 {
        return Err(Error::LengthMismatch {
            expected: bytes,
            got: data.len() as u64,
            what: format!("{dtype} tensor of shape {shape:?}"),
        });
    }
    let mut st = sh.lock();
    let meta = Meta { name: Arc::from(name), dtype, shape: shape.into(), bytes };
    let id = st.res.insert(meta, group)?;
    st.place.policy.on_insert(id, bytes);
    let flight = st.start_flight(id, None);
    // Too large for every tier is `TooLarge` before the write reserve is asked to cover it.
    let res = candidate_tiers(sh, &st, bytes, only)
        .and_then(|_| st.cover(id))
        .and_then(|()| place_new(sh, &mut st, id, bytes, only))
        .and_then(|(tier, ext)| fill_replica(sh, &mut st, id, tier, ext, data, None));
    st.end_flight(id, &flight);
    if let Err(e) = res {
        forget(&mut st, id);
        return Err(e);
    }
    Ok(id)
}

/// Removes a tensor whose replicas are gone (or drops them first) from every book.
fn forget(st: &mut State, id: TensorId) {
    for t in Tier::ALL {
        if st.res.get(id).is_ok_and(|e| e.has(t)) {
            st.drop_replica(id, t);
        }
    }
    st.uncover(id);
    st.unindex(id);
    st.res.remove(id);
    st.place.policy.on_remove(id);
}

/// `Store::write`: the new bytes go to a new extent, and the old replicas are dropped only once
/// they are in place, so a failed write leaves the tensor as it was.
pub(crate) fn write(sh: &Shared, id: TensorId, data: &[u8]) -> Result<()> {
    let (mut st, _) = sh.lock_exclusive_now(id)?;
    let e = st.res.get(id)?;
    let bytes = e.bytes();
    if bytes != data.len() as u64 {
        return Err(Error::LengthMismatch {
            expected: bytes,
            got: data.len() as u64,
            what: format!("write to {:?}", e.meta.name),
        });
    }
    if e.held() > 0 || e.host_lent {
        return Err(Error::Busy { id, holders: e.held() });
    }
    let fastest = e.fastest().ok_or(Error::UnknownId(id))?;
    let in_user_file =
        matches!(e.replicas[fastest.index()].as_ref().map(|r| &r.ext), Some(Ext::File { .. }));
    // A failed backend's device takes no new bytes: they get a home in host memory or on disk.
    let avoid_device = fastest == Tier::Device && sh.health.check().is_err();
    let copies = e.count();
    let flight = st.start_flight(id, None);
    let res = (|| -> Result<(Tier, Option<Ext>, copy::Done)> {
        // A new copy in the tier of the fastest (making room there). Without room for a
        // second copy there: the fastest copy is overwritten in place when another copy keeps
        // the old bytes should the write fail halfway; else the new bytes go where a put would
        // put them. A user's file is never written: its tensors' new bytes get a home like a
        // put's.
        let mut dst = None;
        if !in_user_file && !avoid_device {
            match room::alloc_in(sh, &mut st, fastest, bytes, id, Level::Demand, true) {
                Ok(Got::Ext(x)) => dst = Some((fastest, x)),
                Ok(_) => {}
                // Room could not be made there (its victims' spills found the file system
                // full): the write goes on as without room.
                Err(Error::DiskFull { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        let dst = match dst {
            Some(d) => Some(d),
            None if copies > 1 && !in_user_file && !avoid_device => None,
            None => match place_new(sh, &mut st, id, bytes, None) {
                Ok(d) => Some(d),
                // No room anywhere for a second copy of the tensor's only one: the write
                // reserve takes it.
                Err(Error::OutOfMemory { .. }) if !in_user_file => {
                    return write_via_reserve(sh, &mut st, id, fastest, data, &flight);
                }
                Err(e) => return Err(e),
            },
        };
        match dst {
            Some((t, ext)) => {
                let copy = prepare_fill(sh, &st, id, t, &ext, data)?;
                match run_copy(sh, &mut st, copy) {
                    Ok(done) => Ok((t, Some(ext), done)),
                    Err(e) => {
                        super::release_failed(sh, &mut st, t, ext);
                        // The books had room on the Disk tier, the file system had none: the
                        // write reserve's range has its blocks (`SlabBacking`), so the write
                        // goes that way instead.
                        if matches!(e, Error::DiskFull { .. }) && t == Tier::Disk && !in_user_file {
                            return write_via_reserve(sh, &mut st, id, fastest, data, &flight);
                        }
                        Err(e)
                    }
                }
            }
            None => {
                // In place: first wait (without the lock) for the work still touching it.
                let pending = st.res.get(id)?.pending();
                let e = st.res.get(id)?;
                let r = e.replicas[fastest.index()].as_ref().expect("fastest");
                let copy = prepare_fill(sh, &st, id, fastest, &r.ext, data)?;
                let own = flight.done.clone();
                st.unlocked(|| {
                    for p in pending.iter().filter(
                        |p| !matches!(p, crate::backend::Pending::Done(s) if Arc::ptr_eq(s, &own)),
                    ) {
                        p.wait()?;
                    }
                    Ok::<(), Error>(())
                })?;
                match run_copy(sh, &mut st, copy) {
                    Ok(done) => Ok((fastest, None, done)),
                    Err(e) => {
                        // Half the new bytes: drop this copy; the others keep the old bytes.
                        super::drop_torn(sh, &mut st, id, fastest);
                        Err(e)
                    }
                }
            }
        }
    })();
    st.end_flight(id, &flight);
    let (t, ext, done) = res?;
    match ext {
        Some(ext) => {
            for old in Tier::ALL {
                if st.res.get(id).is_ok_and(|e| e.has(old)) {
                    st.drop_replica(id, old);
                }
            }
            st.commit_copy(id, None, t, ext, done);
        }
        None => {
            if let Ok(e) = st.res.get_mut(id) {
                if let Some(r) = e.replicas[t.index()].as_mut() {
                    r.ready = done.ready;
                    // Written in place on disk: its checksum is the new bytes'.
                    if let (Ext::Disk { crc, .. }, Some(c)) = (&mut r.ext, done.crc) {
                        *crc = c;
                    }
                }
            }
            st.counters.bytes_in += bytes;
            st.drop_other_replicas(id, t);
        }
    }
    st.res.get_mut(id)?.discarded = false;
    if in_user_file {
        // Its bytes are the store's now: the write reserve covers it from here on, where there
        // is room for that (a later write in a full store otherwise fails, keeping its bytes).
        if let Err(e) = st.cover(id) {
            tracing::debug!(tensor = %id, error = %e, "no room to cover a written tensor");
        }
    }
    st.touch(id);
    if t != fastest && !in_user_file && !avoid_device {
        // The tier could not hold two copies: the new bytes went elsewhere first. Now that the
        // old copy is gone, they go back where the tensor was (if that fails, they stay where
        // they are, intact).
        drop(st);
        match move_to(sh, id, fastest) {
            Ok(()) => {
                // Only the copy the tensor was written to stays, as for any write (unless
                // another thread has removed or moved it meanwhile).
                if let Ok((mut st, _)) = sh.lock_when_free(id, true) {
                    st.drop_other_replicas(id, fastest);
                }
            }
            Err(e) => {
                tracing::debug!(tensor = %id, error = %e, "a written tensor stays out of its tier")
            }
        }
    }
    Ok(())
}

/// A write of `id`'s only copy (in `fastest`) when no tier has room for a second one: the new
/// bytes go into the write reserve first, then over the old copy in place. Returns what
/// [`write`] commits: done in place; or, when the in-place write failed half-way, the
/// reserve's copy as the tensor's new one (the torn copy is dropped), so the write is done
/// either way. If the first step fails the old bytes are untouched; with no reserve to lend
/// (none kept, or owed after such a failure) it is `OutOfMemory`. `id` is in `flight`.
fn write_via_reserve(
    sh: &Shared,
    st: &mut Locked<'_>,
    id: TensorId,
    fastest: Tier,
    data: &[u8],
    flight: &Arc<crate::residency::Flight>,
) -> Result<(Tier, Option<Ext>, copy::Done)> {
    let bytes = data.len() as u64;
    let (rt, rext) = loop {
        match st.books.lend_reserve(bytes, &flight.done) {
            Ok(Some(r)) => break r,
            Ok(None) => return Err(Error::OutOfMemory { tier: fastest, bytes }),
            // Another write has it: wait for that write (without the lock), then ask again.
            Err(other) => {
                st.unlocked(|| other.wait());
            }
        }
    };
    // 1. The new bytes, whole, in the reserve.
    let first = prepare_fill(sh, st, id, rt, &rext, data).and_then(|c| run_copy(sh, st, c));
    let first = match first {
        Ok(done) => done,
        Err(e) => {
            st.books.return_reserve(None);
            return Err(e);
        }
    };
    if let Some(ev) = &first.ready {
        // The reserve's copy must be complete before the only other copy is overwritten.
        let ev = ev.clone();
        if let Err(e) = st.unlocked(|| ev.synchronize()) {
            st.books.return_reserve(None);
            return Err(e);
        }
    }
    // 2. The same bytes over the old copy, once the work still touching it is done.
    let own = flight.done.clone();
    let pending = st.res.get(id)?.pending();
    let second = (|| -> Result<copy::Done> {
        st.unlocked(|| {
            for p in pending
                .iter()
                .filter(|p| !matches!(p, crate::backend::Pending::Done(s) if Arc::ptr_eq(s, &own)))
            {
                p.wait()?;
            }
            Ok::<(), Error>(())
        })?;
        let e = st.res.get(id)?;
        let r =
            e.replicas[fastest.index()].as_ref().ok_or(Error::NotInTier { id, tier: fastest })?;
        let copy = prepare_fill(sh, st, id, fastest, &r.ext, data)?;
        run_copy(sh, st, copy)
    })();
    match second {
        Ok(done) => {
            st.books.return_reserve(None);
            Ok((fastest, None, done))
        }
        Err(e) => {
            // The old copy is torn, the reserve's is whole: it becomes the tensor's.
            tracing::warn!(tensor = %id, error = %e, "an in-place write failed; the tensor's \
                new bytes stay where the write reserve was");
            super::drop_torn(sh, st, id, fastest);
            st.books.return_reserve(Some(bytes));
            Ok((rt, Some(rext), first))
        }
    }
}

/// The source of a read of `id`'s replica in `tier`, and what it must wait for.
fn read_source(
    sh: &Shared,
    st: &State,
    id: TensorId,
    tier: Tier,
) -> Result<(Src<'static>, Vec<RawEvent>)> {
    let e = st.res.get(id)?;
    let r = e.replicas[tier.index()].as_ref().ok_or(Error::NotInTier { id, tier })?;
    let src = match &r.ext {
        Ext::Mem(x) => {
            Src::Mem(tier, sh.mem.arena(tier).ok_or(Error::TierDisabled { tier })?.read_lease(x))
        }
        Ext::Disk { .. } => {
            let Ext::Disk { crc, .. } = &r.ext else { unreachable!() };
            Src::Disk(r.ext.disk_range().expect("disk"), *crc)
        }
        Ext::File { file, offset, .. } => Src::File(file.clone(), *offset),
    };
    let mut waits: Vec<RawEvent> = r.ready.iter().cloned().collect();
    waits.extend(e.uses.pending().cloned());
    Ok((src, waits))
}

/// What a read is, for the policy and the counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ReadKind {
    /// A workload's access (`Store::read`): counted, heard by the policy, and a miss may
    /// promote the tensor if the store allows.
    Access,
    /// An access that never promotes (state read, updated and written back where it was).
    InPlace,
    /// Not an access at all (a save reading every tensor): no promotion, nothing told to the
    /// policy, no hit or miss counted, so a save leaves the working set where it was.
    Quiet,
}

/// `Store::read`.
pub(crate) fn read(sh: &Shared, id: TensorId, kind: ReadKind) -> Result<Vec<u8>> {
    read_as::<u8>(sh, id, kind, false)
}

/// `Store::read_vec`: [`read`] into a buffer of `T`s (`typed`: the tensor's dtype must be
/// `T`'s).
pub(crate) fn read_as<T: Element>(
    sh: &Shared,
    id: TensorId,
    kind: ReadKind,
    typed: bool,
) -> Result<Vec<T>> {
    let (mut st, _) = sh.lock_when_free(id, false)?;
    let e = st.res.get(id)?;
    if typed && e.meta.dtype != T::DTYPE {
        let dtype = e.meta.dtype;
        return Err(Error::DTypeMismatch { id, dtype, asked: std::any::type_name::<T>() });
    }
    if e.host_lent {
        return Err(Error::Busy { id, holders: e.held() });
    }
    // A live view's memory is its kernels' to write: another copy, the bytes from before the
    // view, is read where there is one. An overwrite view's memory holds no bytes of the tensor
    // until its view drops (the replica is marked filling), so it is never read.
    let other = (e.views > 0)
        .then(|| {
            Tier::ALL
                .into_iter()
                .filter(|&t| Some(t) != e.view_tier)
                .find(|t| e.replicas[t.index()].as_ref().is_some_and(|r| !r.filling))
        })
        .flatten();
    let tier = match other.or_else(|| e.fastest_readable()) {
        Some(t) => t,
        None if e.views > 0 => return Err(Error::Busy { id, holders: e.held() }),
        None => return Err(Error::UnknownId(id)),
    };
    let hit = Some(e.fastest().unwrap_or(tier)) == st.fastest_enabled();
    let (bytes, name) = (e.bytes(), e.meta.name.clone());
    let (src, waits) = read_source(sh, &st, id, tier)?;
    st.start_read(id);
    let n = bytes as usize / std::mem::size_of::<T>();
    let res = st.unlocked(|| match T::zeroed_vec(n) {
        // Read straight into the caller's buffer.
        Some(mut out) => {
            copy::read_into(sh, id, &name, src, &waits, T::bytes_mut(&mut out)).map(|()| out)
        }
        // A bool tensor: every byte is checked to be 0 or 1.
        None => {
            let mut raw = vec![0u8; bytes as usize];
            copy::read_into(sh, id, &name, src, &waits, &mut raw)?;
            T::to_vec(&raw).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "tensor {id} ({name:?}) holds a byte other than 0 and 1: read its bytes"
                ))
            })
        }
    });
    st.end_read(id);
    let out = res?;
    st.counters.bytes_out += bytes;
    if kind == ReadKind::Quiet {
        return Ok(out);
    }
    st.touch(id);
    if hit {
        st.counters.hits += 1;
    } else {
        st.counters.misses += 1;
    }
    if !hit && kind == ReadKind::Access && st.place.promote_on_read {
        // Optional: a promotion that fails leaves the read as it was (and the tensor intact).
        if let Err(e) = promote_after_read(sh, &mut st, id, tier, T::as_bytes(&out)) {
            tracing::debug!(tensor = %id, error = %e, "promotion after a read failed");
        }
    }
    super::prefetch::lookahead(sh, &mut st);
    Ok(out)
}

/// After a read missed the fastest tier: copies the bytes read there if the policy admits it.
fn promote_after_read(
    sh: &Shared,
    st: &mut Locked<'_>,
    id: TensorId,
    from: Tier,
    data: &[u8],
) -> Result<()> {
    let Some(top) = st.fastest_enabled() else { return Ok(()) };
    if top == Tier::Device && sh.health.check().is_err() {
        return Ok(());
    }
    let e = st.res.get(id)?;
    let bytes = e.bytes();
    if e.has(top) || e.in_flight() || e.host_lent || !st.books.can_ever_fit(top, bytes) {
        return Ok(());
    }
    if st.books.free_bytes(top) < st.books.reserved_size(top, bytes)
        && !st.admits_copy(top, id, bytes)
    {
        return Ok(());
    }
    let flight = st.start_flight(id, None);
    let res = (|| -> Result<()> {
        let Got::Ext(ext) = room::alloc_in(sh, st, top, bytes, id, Level::Demand, true)? else {
            return Ok(());
        };
        fill_replica(sh, st, id, top, ext, data, Some(from))?;
        st.counters.promotions += 1;
        Ok(())
    })();
    st.end_flight(id, &flight);
    res
}

/// `Store::move_to`.
pub(crate) fn move_to(sh: &Shared, id: TensorId, tier: Tier) -> Result<()> {
    let (mut st, _) = sh.lock_exclusive_now(id)?;
    let e = st.res.get(id)?;
    let (bytes, holders, fastest) = (e.bytes(), e.held(), e.fastest());
    if !st.books.enabled(tier) {
        return Err(Error::TierDisabled { tier });
    }
    if (holders > 0 || e.host_lent) && fastest != Some(tier) {
        return Err(Error::Busy { id, holders });
    }
    if !st.books.can_ever_fit(tier, bytes) {
        return Err(Error::TooLarge { bytes, what: format!("tier {}", st.books.describe(tier)) });
    }
    st.touch(id);
    let flight = st.start_flight(id, None);
    let res = (|| -> Result<()> {
        let e = st.res.get(id)?;
        if let Some(r) = e.replicas[tier.index()].as_ref() {
            // There already: wait for its copy, so that "returns when done" holds.
            let ready = r.ready.clone();
            if let Some(ev) = ready {
                st.unlocked(|| ev.synchronize())?;
            }
            return Ok(());
        }
        let ext = match room::alloc_in(sh, &mut st, tier, bytes, id, Level::Demand, true)? {
            Got::Ext(x) => x,
            _ => return Err(Error::OutOfMemory { tier, bytes }),
        };
        let src = match st.res.get(id)?.fastest_readable() {
            Some(s) => s,
            None => {
                super::release_failed(sh, &mut st, tier, ext);
                return Err(Error::UnknownId(id));
            }
        };
        // Wait for the copy, so that "returns when done" holds and the faster replicas dropped
        // below are no longer read.
        if let Some(ev) = copy_replica(sh, &mut st, id, src, tier, ext)? {
            st.unlocked(|| ev.synchronize())?;
        }
        Ok(())
    })();
    st.end_flight(id, &flight);
    res?;
    // A tensor pinned or scoped while it moved keeps its faster copies (a hold is never
    // evicted; hints do not wait for flights).
    for t in Tier::ALL.into_iter().filter(|&t| t < tier) {
        if st.res.get(id).is_ok_and(|e| e.has(t) && e.pins == 0 && e.scopes == 0) {
            st.drop_replica(id, t);
        }
    }
    // A pin or scope that came during the move waits in the queue for it: start it now. Not
    // one that was held before: its "move" went where it already was, which changes nothing,
    // and so afterwards `tier_of(id) == tier` still holds; a pin queued for room it was already
    // waiting for is started, as before the move, by the next hint or view.
    if holders == 0 && st.res.get(id).is_ok_and(|e| e.queued && (e.pins > 0 || e.scopes > 0)) {
        super::prefetch::pump_waiting(sh, &mut st);
    }
    Ok(())
}

/// `Store::remove`: nothing waits; memory still touched by work is freed once it is done.
pub(crate) fn remove(sh: &Shared, id: TensorId) -> Result<()> {
    let (mut st, _) = sh.lock_exclusive_now(id)?;
    let e = st.res.get(id)?;
    if e.held() > 0 || e.host_lent {
        return Err(Error::Busy { id, holders: e.held() });
    }
    forget(&mut st, id);
    Ok(())
}

/// What a device or mapped view is made of.
pub(crate) struct ViewParts {
    pub(crate) meta: Arc<crate::residency::Meta>,
    pub(crate) ptr: u64,
    /// The bytes for the CPU, where it can reach them (host backend, mapped memory).
    pub(crate) host: Option<WriteLease>,
}

/// `Store::device_view` and `device_view_for_overwrite`: makes the tensor resident on the
/// device, makes `stream` wait for its copy and for other streams' last uses, and holds it.
pub(crate) fn device_view(
    sh: &Shared,
    id: TensorId,
    stream: &RawStream,
    overwrite: bool,
) -> Result<ViewParts> {
    // A read in progress finishes first: the view's kernels may write the bytes it copies.
    let (mut st, waited) = sh.lock_when_free(id, true)?;
    st.counters.stall_s += waited;
    let e = st.res.get(id)?;
    let bytes = e.bytes();
    if e.host_lent || (e.views > 0 && e.view_tier != Some(Tier::Device)) {
        return Err(Error::Busy { id, holders: e.held() });
    }
    if !st.books.enabled(Tier::Device) {
        return Err(Error::TierDisabled { tier: Tier::Device });
    }
    if !st.books.can_ever_fit(Tier::Device, bytes) {
        return Err(Error::TooLarge {
            bytes,
            what: format!("tier {}", st.books.describe(Tier::Device)),
        });
    }
    let hit = e.has(Tier::Device);
    let filling = e.replicas[Tier::Device.index()].as_ref().is_some_and(|r| r.filling);
    if filling && !overwrite {
        // A live overwrite view is filling its memory: it holds no bytes of the tensor until
        // that view drops (reading it would read whatever the memory held before).
        return Err(Error::Busy { id, holders: e.held() });
    }
    if hit {
        st.counters.prefetch_hits += 1;
    } else {
        st.counters.prefetch_misses += 1;
        let flight = st.start_flight(id, None);
        let res = bring_for_view(sh, &mut st, id, bytes, overwrite, stream);
        st.end_flight(id, &flight);
        res?;
    }
    if hit {
        st.counters.hits += 1;
    } else {
        st.counters.misses += 1;
    }
    st.consume_prefetch(id);
    let e = st.res.get(id)?;
    let r = e.replicas[Tier::Device.index()].as_ref().expect("made resident above");
    let Ext::Mem(ext) = &r.ext else { unreachable!("device replicas are memory extents") };
    let arena = sh.mem.arena(Tier::Device).expect("enabled");
    let (ptr, host) = (arena.dev_ptr(ext), arena.view_lease(ext));
    let ready = r.ready.clone();
    // With a timeline, how long the stream waits for the copy is known once both events
    // complete: mark where the stream is before it waits.
    let mark = match &ready {
        Some(ev) if st.timeline.is_some() && !ev.is_complete() => Some(stream.record_timed()?),
        _ => None,
    };
    // The view's work starts after the copy that brought the bytes, and after every other
    // stream's last use (writer → reader, reader → overwriter); a second overwrite view of
    // memory a live one fills, after the work on that memory's earlier owners.
    // On a hit the copy is usually long done: a completed event costs a query, not a wait.
    if let Some(ev) = ready.as_ref().filter(|ev| !ev.is_complete()) {
        stream.wait(ev)?;
    }
    for ev in r.fence.iter().filter(|_| filling) {
        stream.wait(ev)?;
    }
    e.uses.wait_others(stream, ready.as_ref())?;
    let meta = e.meta.clone();
    if let (Some(mark), Some(ev)) = (mark, ready) {
        st.probes.push((mark, ev));
        if st.probes.len() > 4096 {
            st.resolve_probes();
        }
    }
    let e = st.res.get_mut(id)?;
    e.views += 1;
    e.view_tier = Some(Tier::Device);
    e.released = false;
    st.touch(id);
    super::prefetch::pump_waiting(sh, &mut st);
    super::prefetch::lookahead(sh, &mut st);
    Ok(ViewParts { meta, ptr, host })
}

/// A device view's miss: room on the device (unused hinted prefetches go only if nothing else
/// makes room), then the copy in (none for an overwrite). `id` is in flight.
fn bring_for_view(
    sh: &Shared,
    st: &mut Locked<'_>,
    id: TensorId,
    bytes: u64,
    overwrite: bool,
    stream: &RawStream,
) -> Result<()> {
    if overwrite {
        // No copy in: the view's stream itself waits for the device work still touching the
        // memory's earlier owners (nothing else: not the copies queued on the copy stream).
        let (ext, fence) = alloc_for_view(sh, st, id, bytes, Some(stream))?;
        // Its bytes are the view's to write: nothing reads them until the view drops.
        let mut r = crate::residency::Replica::new(ext, None);
        r.filling = true;
        r.fence = fence;
        st.res.put_replica(id, Tier::Device, r);
        st.reindex(id);
        return Ok(());
    }
    let (ext, _) = alloc_for_view(sh, st, id, bytes, None)?;
    let src = match st.res.get(id)?.fastest_readable() {
        Some(s) => s,
        None => {
            super::release_failed(sh, st, Tier::Device, ext);
            return Err(Error::UnknownId(id));
        }
    };
    copy_replica(sh, st, id, src, Tier::Device, ext).map(drop)
}

/// `Store::mapped_view`.
pub(crate) fn mapped_view(sh: &Shared, id: TensorId, stream: &RawStream) -> Result<ViewParts> {
    let (mut st, _) = sh.lock_when_free(id, true)?;
    let e = st.res.get(id)?;
    if e.host_lent || (e.views > 0 && e.view_tier != Some(Tier::Mapped)) {
        return Err(Error::Busy { id, holders: e.held() });
    }
    let Some(r) = e.replicas[Tier::Mapped.index()].as_ref() else {
        return Err(Error::NotInTier { id, tier: Tier::Mapped });
    };
    let Ext::Mem(ext) = &r.ext else { unreachable!("mapped replicas are memory extents") };
    let arena = sh.mem.arena(Tier::Mapped).ok_or(Error::TierDisabled { tier: Tier::Mapped })?;
    let (ptr, host) = (arena.dev_ptr(ext), arena.view_lease(ext));
    if let Some(ev) = r.ready.as_ref().filter(|ev| !ev.is_complete()) {
        stream.wait(ev)?;
    }
    e.uses.wait_others(stream, r.ready.as_ref())?;
    let meta = e.meta.clone();
    let e = st.res.get_mut(id)?;
    e.views += 1;
    e.view_tier = Some(Tier::Mapped);
    st.touch(id);
    Ok(ViewParts { meta, ptr, host })
}

/// The tiers a host view may lend, in the order they are tried: Pinned and Mapped, and on the
/// host backend the Device tier too (emulated in host memory).
fn host_tiers(host_backend: bool) -> &'static [Tier] {
    if host_backend {
        &[Tier::Pinned, Tier::Mapped, Tier::Device]
    } else {
        &[Tier::Pinned, Tier::Mapped]
    }
}

/// The tier of `id`'s replica a host view can lend (in host memory, not being filled).
fn host_replica(e: &crate::residency::Entry, host_backend: bool) -> Option<Tier> {
    host_replica_but(e, host_backend, None)
}

/// [`host_replica`] in another tier than `but`.
fn host_replica_but(
    e: &crate::residency::Entry,
    host_backend: bool,
    but: Option<Tier>,
) -> Option<Tier> {
    host_tiers(host_backend).iter().copied().find(|&t| {
        Some(t) != but
            && e.replicas[t.index()]
                .as_ref()
                .is_some_and(|r| matches!(r.ext, Ext::Mem(_)) && !r.filling)
    })
}

/// A lease on the bytes of `r`, a replica in host memory found by [`host_replica`].
fn host_lease(sh: &Shared, r: &crate::residency::Replica, tier: Tier) -> Result<WriteLease> {
    let Ext::Mem(ext) = &r.ext else { unreachable!("host_replica finds replicas in memory") };
    sh.mem
        .arena(tier)
        .and_then(|a| a.view_lease(ext))
        .ok_or_else(|| Error::BackendMismatch(format!("the {tier} tier is not host memory here")))
}

/// Gives `id` a copy in host memory (Pinned, else Mapped) when it has none, making room there
/// like any move: how a host view absorbs a move of the tensor by another thread, or a tensor
/// on disk or (on CUDA) on the device only. The copy's bytes are valid once its `ready` event
/// completes (the view waits for it).
fn ensure_host(sh: &Shared, id: TensorId, host_backend: bool) -> Result<()> {
    let (mut st, _) = sh.lock_exclusive_now(id)?;
    let e = st.res.get(id)?;
    if host_replica(e, host_backend).is_some() {
        return Ok(());
    }
    if e.held() > 0 || e.host_lent {
        return Err(Error::Busy { id, holders: e.held() });
    }
    let bytes = e.bytes();
    let flight = st.start_flight(id, None);
    let res = (|| -> Result<()> {
        for t in [Tier::Pinned, Tier::Mapped] {
            if !st.books.enabled(t) || !st.books.can_ever_fit(t, bytes) {
                continue;
            }
            let Got::Ext(ext) = room::alloc_in(sh, &mut st, t, bytes, id, Level::Demand, true)?
            else {
                continue;
            };
            let Some(src) = st.res.get(id)?.fastest_readable() else {
                super::release_failed(sh, &mut st, t, ext);
                return Err(Error::UnknownId(id));
            };
            return copy_replica(sh, &mut st, id, src, t, ext).map(drop);
        }
        Err(match Tier::ALL[1..3].iter().any(|&t| st.books.enabled(t)) {
            true => Error::OutOfMemory { tier: Tier::Pinned, bytes },
            false => Error::TierDisabled { tier: Tier::Pinned },
        })
    })();
    st.end_flight(id, &flight);
    res
}

/// `Store::host_view`: lends the tensor's host replica to the CPU once the work touching the
/// tensor is done (waited for without the lock). Returns the tier and the lease. With `bring`,
/// a tensor with no copy in host memory gets one first ([`ensure_host`]); without, that is
/// `NotInTier`.
pub(crate) fn host_view(
    sh: &Shared,
    id: TensorId,
    host_backend: bool,
    bring: bool,
) -> Result<(Tier, WriteLease, DType)> {
    loop {
        let (mut st, _) = sh.lock_exclusive_now(id)?;
        let e = st.res.get(id)?;
        if e.held() > 0 || e.host_lent {
            return Err(Error::Busy { id, holders: e.held() });
        }
        let Some(tier) = host_replica(e, host_backend) else {
            if !bring {
                return Err(Error::NotInTier { id, tier: Tier::Pinned });
            }
            drop(st);
            ensure_host(sh, id, host_backend)?;
            continue;
        };
        let r = e.replicas[tier.index()].as_ref().expect("found above");
        let lease = host_lease(sh, r, tier)?;
        let (dtype, pending) = (e.meta.dtype, e.pending());
        let e = st.res.get_mut(id)?;
        e.views += 1;
        e.view_tier = Some(tier);
        e.host_lent = true;
        st.touch(id);
        drop(st);
        // Copies into or out of the tensor's replicas and device work through earlier views
        // finish before the CPU touches the bytes; meanwhile the tensor is lent, so nothing new
        // starts.
        for p in &pending {
            if let Err(err) = p.wait() {
                release_view(sh, id, tier, None, false);
                return Err(err);
            }
        }
        return Ok((tier, lease, dtype));
    }
}

/// `Store::host_view_shared`: lends the tensor's host replica to the CPU for reading, shared
/// with every other reader (a read claim held for the view's life, as a `read` holds one while
/// it copies): writes, moves, removes and views that may write wait for the readers, and
/// readers wait only for a writer. A tensor with no copy in host memory gets one first.
pub(crate) fn host_view_shared(
    sh: &Shared,
    id: TensorId,
    host_backend: bool,
) -> Result<(Tier, WriteLease, DType)> {
    loop {
        let mut st = sh.lock_for_shared_view(id)?;
        let e = st.res.get(id)?;
        if e.host_lent {
            return Err(Error::Busy { id, holders: e.held() });
        }
        let Some(tier) = host_replica(e, host_backend) else {
            drop(st);
            ensure_host(sh, id, host_backend)?;
            continue;
        };
        // Live views' kernels may be writing their replica in place (a mapped view's, or on
        // the host backend a device view's): another host copy, if there is one, else Busy.
        let tier = if e.views > 0 && e.view_tier == Some(tier) {
            match host_replica_but(e, host_backend, Some(tier)) {
                Some(t) => t,
                None => return Err(Error::Busy { id, holders: e.held() }),
            }
        } else {
            tier
        };
        let r = e.replicas[tier.index()].as_ref().expect("found above");
        let lease = host_lease(sh, r, tier)?;
        // What may still write the replica: the copy that filled it, and device work on the
        // tensor (kernels through a mapped view write it in place). Other readers are no wait.
        let waits: Vec<RawEvent> = r
            .ready
            .iter()
            .chain(e.uses.pending())
            .filter(|ev| !ev.is_complete())
            .cloned()
            .collect();
        let dtype = e.meta.dtype;
        st.start_read(id);
        st.touch(id);
        drop(st);
        for ev in &waits {
            if let Err(err) = ev.synchronize() {
                sh.lock().end_read(id);
                return Err(err);
            }
        }
        return Ok((tier, lease, dtype));
    }
}

/// The end of a shared host view: its read claim.
pub(crate) fn release_shared(sh: &Shared, id: TensorId) {
    sh.lock().end_read(id);
}

/// A view's drop: records where its stream is, releases the hold, and if the view wrote, keeps
/// only the replica it wrote. Never waits: a view may be dropped inside work queued on a stream.
///
/// The event is recorded under the lock, so the order in which uses are recorded is the order
/// of the records themselves: two threads dropping views on one stream leave the later event
/// as that stream's last use, never the earlier.
pub(crate) fn release_view(
    sh: &Shared,
    id: TensorId,
    tier: Tier,
    stream: Option<(&RawStream, u64)>,
    dirty: bool,
) {
    let mut st = sh.lock();
    let ev = stream.map(|(s, key)| s.record_as(key).map(|ev| (key, ev)));
    let mut failed = None;
    match st.res.get_mut(id) {
        Ok(e) => {
            if stream.is_none() {
                e.host_lent = false;
            }
            // A use that could not be recorded (the backend failed) is reported, and the hold
            // stays until an event can be recorded on that stream (`State::settle`, at the
            // tensor's next operation): nothing may free or reuse memory the view's work may
            // still touch. The view's writes are applied all the same.
            let keep_hold = match (ev, stream) {
                (Some(Ok((k, ev))), Some((s, _))) => {
                    e.uses.record(k, s, ev);
                    false
                }
                (Some(Err(err)), Some((s, key))) => {
                    failed = Some(err);
                    e.unsettled.push((s.clone(), key));
                    true
                }
                _ => false,
            };
            if !keep_hold {
                e.views = e.views.saturating_sub(1);
                if e.views == 0 {
                    e.view_tier = None;
                }
            }
            if dirty {
                e.discarded = false;
                st.drop_other_replicas(id, tier);
                // An overwrite view's memory holds the tensor's bytes now.
                if let Some(r) =
                    st.res.get_mut(id).ok().and_then(|e| e.replicas[tier.index()].as_mut())
                {
                    r.filling = false;
                    r.fence.clear();
                }
            }
            st.reindex(id);
            // Waiting prefetches start at the next hint or view, not here: a drop that could
            // evict is a drop that could block, and a view may drop inside queued work.
        }
        Err(err) => failed = Some(err),
    }
    drop(st);
    if let Some(e) = failed {
        sh.defer_err(e);
    }
}

/// `DeviceView::record_use`: records an event on `stream` now, under the lock, as that
/// stream's last use of `id` (so a later record always wins over an earlier one).
pub(crate) fn record_use(sh: &Shared, id: TensorId, stream: &RawStream) -> Result<()> {
    let mut st = sh.lock();
    let ev = stream.record()?;
    st.res.get_mut(id)?.uses.record(stream.key(), stream, ev);
    Ok(())
}

/// Runs `f` (a view's CPU access to its bytes: host backend, or mapped memory) with the tensor
/// in an exclusive flight, so that no read or other CPU access of it runs meanwhile (the view's
/// hold keeps the memory allocated; the flight makes the access its own).
pub(crate) fn with_flight<R>(sh: &Shared, id: TensorId, f: impl FnOnce() -> R) -> Result<R> {
    let (mut st, _) = sh.lock_when_free(id, true)?;
    let flight = st.start_flight(id, None);
    let r = st.unlocked(f);
    st.end_flight(id, &flight);
    Ok(r)
}
