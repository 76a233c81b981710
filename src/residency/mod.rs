//! Residency: which tensors exist, where their copies (replicas) are, who holds them, and what
//! work still touches them.
//!
//! A tensor has at most one replica per tier; all its replicas hold the same bytes. The slowest
//! is its home, faster ones are caches that can be dropped for free, while a tensor's only
//! replica is demoted (copied one tier down) instead. A replica carries the event after which its
//! bytes are valid (`ready`); a tensor carries, per stream, the event after the last work that
//! stream did on it (`uses`: views' kernels, and copies reading it), which anything that frees,
//! overwrites or reads it from another stream waits for first.
//!
//! Work that needs the host (disk I/O, host copies, host waits) runs without the store's lock
//! while the tensor is *in flight*: an exclusive [`Flight`] (a fill, a write, a move, a spill) or
//! a shared read. Other operations on that tensor wait for the flight (without the lock); every
//! free of memory a flight touches waits for it too.

mod slab;
mod uses;

use std::collections::HashMap;
use std::sync::Arc;

use smallvec::SmallVec;

pub(crate) use slab::Slab;
pub(crate) use uses::Uses;

use crate::backend::{Pending, RawEvent};
use crate::base::error::{Error, Result};
use crate::base::sync::Signal;
use crate::base::types::{DType, Group, TensorId, Tier};
use crate::tiers::Ext;

/// What never changes about a tensor.
#[derive(Debug)]
pub(crate) struct Meta {
    pub(crate) name: Arc<str>,
    pub(crate) dtype: DType,
    pub(crate) shape: Box<[usize]>,
    pub(crate) bytes: u64,
}

/// One copy of a tensor's bytes.
pub(crate) struct Replica {
    pub(crate) ext: Ext,
    /// Complete once the replica's bytes are valid (the copy that filled it has run).
    pub(crate) ready: Option<RawEvent>,
    /// A flight is still filling it: its bytes are not valid yet, whatever `ready` says.
    pub(crate) filling: bool,
    /// While a live overwrite view fills it: the device work on its memory's earlier owners
    /// that any stream writing it must wait for first (the view's stream did).
    pub(crate) fence: SmallVec<[RawEvent; 2]>,
}

impl Replica {
    pub(crate) fn new(ext: Ext, ready: Option<RawEvent>) -> Replica {
        Replica { ext, ready, filling: false, fence: SmallVec::new() }
    }
}

/// The end of work a thread does on a tensor without the store's lock. Waiters wait for the
/// signal; a flight of the engine's queue can also be sped up (moved to its front).
pub(crate) struct Flight {
    pub(crate) done: Arc<Signal>,
    /// The engine job carrying out the flight, when it is queued there.
    pub(crate) job: Option<u64>,
}

impl Flight {
    pub(crate) fn new(job: Option<u64>) -> Arc<Flight> {
        Arc::new(Flight { done: Arc::new(Signal::default()), job })
    }

    /// Ends the flight: wakes everyone waiting for it.
    pub(crate) fn finish(&self) {
        self.done.set();
    }
}

/// Who asked for a prefetch: what a layer scope or hint says outranks what a policy guesses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Source {
    /// The policy's lookahead.
    Policy,
    /// A hint: `prefetch`, `pin` or a layer scope.
    Hint,
}

/// One tensor.
pub(crate) struct Entry {
    pub(crate) meta: Arc<Meta>,
    pub(crate) replicas: [Option<Replica>; 4],
    /// Live views of the tensor.
    pub(crate) views: u32,
    /// The tier the live views are of (all in one tier: a dirty view drops the other copies,
    /// which must not be memory another live view points at).
    pub(crate) view_tier: Option<Tier>,
    /// A host view has the tensor: the CPU may be writing it, so no other view, read or copy of
    /// it may start.
    pub(crate) host_lent: bool,
    /// `Store::discard`ed and not written since: evicting it need not write it back.
    pub(crate) discarded: bool,
    /// `pin` hints not yet undone by `unpin`.
    pub(crate) pins: u32,
    /// Live layer scopes that use the tensor.
    pub(crate) scopes: u32,
    /// Prefetched to the device and not yet used by a view (not evicted meanwhile).
    pub(crate) prefetched: Option<Source>,
    /// The prefetch started a copy, whose bytes count against the prefetch budget until the
    /// tensor is used (a prefetch of a tensor already resident only protects it).
    pub(crate) prefetch_charged: bool,
    /// Its prefetch protection came from a `pin`: the last `unpin` ends it.
    pub(crate) pin_prefetch: bool,
    /// Released by a hint or a scope's end: the first to go when room is needed.
    pub(crate) released: bool,
    /// Queued among the prefetches waiting for room in the prefetch budget.
    pub(crate) queued: bool,
    /// Times the tensor was copied into the Device tier from another tier.
    pub(crate) device_loads: u64,
    /// What the tensor is for (memory accounting, victim ranks).
    pub(crate) group: Group,
    /// An exclusive flight (see the module docs).
    pub(crate) flight: Option<Arc<Flight>>,
    /// Threads reading the tensor without the lock, and the flight they share.
    pub(crate) readers: u32,
    pub(crate) read_flight: Option<Arc<Flight>>,
    /// Threads waiting for the readers to finish so that they can write, move or remove the
    /// tensor: new shared host views wait for them (readers that overlap would starve them).
    pub(crate) writers_waiting: u32,
    /// A prefetch job of the engine's, queued or running, that brings the tensor to the device:
    /// a claim shared with readers (it only reads the tensor's bytes and fills a replica nobody
    /// reads yet), exclusive for everything else. A queued one can be revoked.
    pub(crate) job: Option<Arc<Flight>>,
    /// Per stream, the last work that may touch the tensor's memory.
    pub(crate) uses: Uses,
    /// A view dropped, but the event after its stream's work could not be recorded (the
    /// backend failed): its hold stays, so nothing frees or reuses memory that work may touch,
    /// until an event recorded later on this stream (`State::settle` in migration).
    pub(crate) unsettled: Vec<(crate::backend::RawStream, u64)>,
    /// Counted by the write reserve (a tensor the store owns the bytes of).
    pub(crate) covered: bool,
    /// Registered by a load that copies and has not finished: its name is taken, but
    /// `lookup` and `ids` do not give it out, so a load that fails removes tensors nobody
    /// else can hold.
    pub(crate) loading: bool,
}

impl Entry {
    pub(crate) fn new(meta: Arc<Meta>, group: Group) -> Entry {
        Entry {
            meta,
            replicas: Default::default(),
            views: 0,
            view_tier: None,
            host_lent: false,
            discarded: false,
            pins: 0,
            scopes: 0,
            prefetched: None,
            prefetch_charged: false,
            pin_prefetch: false,
            released: false,
            queued: false,
            device_loads: 0,
            group,
            flight: None,
            readers: 0,
            read_flight: None,
            writers_waiting: 0,
            job: None,
            uses: Uses::default(),
            unsettled: Vec::new(),
            covered: false,
            loading: false,
        }
    }

    /// Size in bytes.
    pub(crate) fn bytes(&self) -> u64 {
        self.meta.bytes
    }

    /// Views, pins and scopes holding the tensor in place.
    pub(crate) fn held(&self) -> u32 {
        self.views + self.pins + self.scopes
    }

    /// Replicas present.
    pub(crate) fn count(&self) -> usize {
        self.replicas.iter().flatten().count()
    }

    /// Whether it has a replica in `t`.
    pub(crate) fn has(&self, t: Tier) -> bool {
        self.replicas[t.index()].is_some()
    }

    /// The fastest tier with a replica (one being filled included).
    pub(crate) fn fastest(&self) -> Option<Tier> {
        Tier::ALL.into_iter().find(|&t| self.has(t))
    }

    /// The fastest replica whose bytes can be read now or by waiting on an event (not one a
    /// flight is still filling).
    pub(crate) fn fastest_readable(&self) -> Option<Tier> {
        Tier::ALL
            .into_iter()
            .find(|t| self.replicas[t.index()].as_ref().is_some_and(|r| !r.filling))
    }

    /// Whether a flight, exclusive or shared (readers, a prefetch job), has the tensor.
    pub(crate) fn in_flight(&self) -> bool {
        self.flight.is_some() || self.readers > 0 || self.job.is_some()
    }

    /// The flight to wait for before an exclusive operation: the exclusive one, else the
    /// readers', else a prefetch job's.
    pub(crate) fn any_flight(&self) -> Option<Arc<Flight>> {
        self.flight.clone().or_else(|| self.read_flight.clone()).or_else(|| self.job.clone())
    }

    /// What freeing this tensor's memory must wait for: device work on it (incomplete events)
    /// and threads reading it or filling it without the lock.
    pub(crate) fn pending(&self) -> smallvec::SmallVec<[Pending; 2]> {
        let mut out: smallvec::SmallVec<[Pending; 2]> = self
            .uses
            .pending()
            .chain(self.replicas.iter().flatten().filter_map(|r| r.ready.as_ref()))
            .filter(|ev| !ev.is_complete())
            .map(|ev| Pending::Ev(ev.clone()))
            .collect();
        for f in [&self.flight, &self.read_flight, &self.job].into_iter().flatten() {
            out.push(Pending::Done(f.done.clone()));
        }
        out
    }
}

/// Every tensor of a store: the slab, the names, and totals kept as replicas come and go.
pub(crate) struct Residency {
    pub(crate) slab: Slab<Entry>,
    pub(crate) names: HashMap<Arc<str>, TensorId>,
    /// Bytes per tier and group (a tensor with copies in two tiers counts in both).
    group_bytes: [[u64; 5]; 4],
    /// Tensors with a replica per tier.
    tier_tensors: [usize; 4],
}

impl Residency {
    /// An empty residency for the store numbered `store`.
    pub(crate) fn new(store: u32) -> Residency {
        Residency {
            slab: Slab::new(store),
            names: HashMap::new(),
            group_bytes: [[0; 5]; 4],
            tier_tensors: [0; 4],
        }
    }

    /// The tensor `id`.
    pub(crate) fn get(&self, id: TensorId) -> Result<&Entry> {
        self.slab.get(id).ok_or(Error::UnknownId(id))
    }

    /// The tensor `id`, mutably.
    pub(crate) fn get_mut(&mut self, id: TensorId) -> Result<&mut Entry> {
        self.slab.get_mut(id).ok_or(Error::UnknownId(id))
    }

    /// Adds a tensor with no replica. Fails on a taken name or a full slab.
    pub(crate) fn insert(&mut self, meta: Meta, group: Group) -> Result<TensorId> {
        if self.names.contains_key(&meta.name) {
            return Err(Error::DuplicateName(meta.name.to_string()));
        }
        let name = meta.name.clone();
        let id = self
            .slab
            .insert(Entry::new(Arc::new(meta), group))
            .ok_or_else(|| Error::InvalidArgument("the store holds 2^32 tensors".into()))?;
        self.names.insert(name, id);
        Ok(id)
    }

    /// Removes a tensor whose replicas were taken out.
    pub(crate) fn remove(&mut self, id: TensorId) -> Option<Entry> {
        let e = self.slab.remove(id)?;
        debug_assert_eq!(e.count(), 0, "a removed tensor kept replicas");
        self.names.remove(&e.meta.name);
        Some(e)
    }

    /// Gives `id` a replica in `t` (replacing none).
    pub(crate) fn put_replica(&mut self, id: TensorId, t: Tier, r: Replica) {
        let Some(e) = self.slab.get_mut(id) else { return };
        debug_assert!(e.replicas[t.index()].is_none(), "a second replica in {t}");
        if e.replicas[t.index()].replace(r).is_none() {
            self.group_bytes[t.index()][e.group.index()] += e.meta.bytes;
            self.tier_tensors[t.index()] += 1;
        }
    }

    /// Takes `id`'s replica out of `t`.
    pub(crate) fn take_replica(&mut self, id: TensorId, t: Tier) -> Option<Replica> {
        let e = self.slab.get_mut(id)?;
        let r = e.replicas[t.index()].take()?;
        self.group_bytes[t.index()][e.group.index()] -= e.meta.bytes;
        self.tier_tensors[t.index()] -= 1;
        Some(r)
    }

    /// Changes a tensor's group.
    pub(crate) fn set_group(&mut self, id: TensorId, group: Group) -> Result<()> {
        let e = self.slab.get_mut(id).ok_or(Error::UnknownId(id))?;
        let old = std::mem::replace(&mut e.group, group);
        for t in Tier::ALL {
            if e.replicas[t.index()].is_some() {
                self.group_bytes[t.index()][old.index()] -= e.meta.bytes;
                self.group_bytes[t.index()][group.index()] += e.meta.bytes;
            }
        }
        Ok(())
    }

    /// Bytes of each group with a copy in `t`.
    pub(crate) fn bytes_by_group(&self, t: Tier) -> [u64; 5] {
        self.group_bytes[t.index()]
    }

    /// Tensors with a copy in `t`.
    pub(crate) fn tensors_in(&self, t: Tier) -> usize {
        self.tier_tensors[t.index()]
    }
}
