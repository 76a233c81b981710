//! The tensors of a store in a slab indexed by [`TensorId`]: an id carries its slot, so a lookup
//! is an index and a comparison of the id's number with the slot's (numbers are never reused,
//! so an id outlives its tensor harmlessly, and a reused slot does not answer to an old id).

use crate::base::types::TensorId;

struct Slot<T> {
    /// The number of the id the value answers to.
    seq: u64,
    value: Option<T>,
}

/// Values addressed by [`TensorId`]s of one store.
pub(crate) struct Slab<T> {
    store: u32,
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
    len: usize,
    next_seq: u64,
}

impl<T> Slab<T> {
    /// An empty slab for the store numbered `store`.
    pub(crate) fn new(store: u32) -> Slab<T> {
        Slab { store, slots: Vec::new(), free: Vec::new(), len: 0, next_seq: 0 }
    }

    /// Values in the slab.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Stores `value` and returns its id. `None` when the slab is full (2^32 live values).
    pub(crate) fn insert(&mut self, value: T) -> Option<TensorId> {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                let s = u32::try_from(self.slots.len()).ok()?;
                self.slots.push(Slot { seq: 0, value: None });
                s
            }
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        let s = &mut self.slots[slot as usize];
        s.seq = seq;
        s.value = Some(value);
        self.len += 1;
        Some(TensorId::new(self.store, seq, slot))
    }

    fn slot(&self, id: TensorId) -> Option<&Slot<T>> {
        (id.store() == self.store)
            .then(|| self.slots.get(id.slot() as usize))
            .flatten()
            .filter(|s| s.seq == id.seq() && s.value.is_some())
    }

    /// The value of `id`, if it is live.
    pub(crate) fn get(&self, id: TensorId) -> Option<&T> {
        self.slot(id).and_then(|s| s.value.as_ref())
    }

    /// The value of `id`, mutably.
    pub(crate) fn get_mut(&mut self, id: TensorId) -> Option<&mut T> {
        self.slot(id)?;
        self.slots[id.slot() as usize].value.as_mut()
    }

    /// Removes and returns the value of `id`; the id never matches again.
    pub(crate) fn remove(&mut self, id: TensorId) -> Option<T> {
        self.slot(id)?;
        let v = self.slots[id.slot() as usize].value.take()?;
        self.free.push(id.slot());
        self.len -= 1;
        Some(v)
    }

    /// Slots in the slab, live or free (the bound of [`Slab::id_at`]).
    pub(crate) fn slots(&self) -> usize {
        self.slots.len()
    }

    /// The id of the value in slot `slot`, if one lives there.
    pub(crate) fn id_at(&self, slot: usize) -> Option<TensorId> {
        let s = self.slots.get(slot)?;
        s.value.as_ref().map(|_| TensorId::new(self.store, s.seq, slot as u32))
    }

    /// Every live id and value, in slot order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (TensorId, &T)> {
        let store = self.store;
        self.slots.iter().enumerate().filter_map(move |(i, s)| {
            s.value.as_ref().map(|v| (TensorId::new(store, s.seq, i as u32), v))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removed_ids_never_match_again_and_slots_are_reused() {
        let mut s = Slab::new(7);
        let a = s.insert("a").unwrap();
        let b = s.insert("b").unwrap();
        assert_eq!(s.get(a), Some(&"a"));
        assert_eq!(s.remove(a), Some("a"));
        assert!(s.get(a).is_none() && s.remove(a).is_none());
        let c = s.insert("c").unwrap();
        assert_eq!(c.slot(), a.slot());
        assert_ne!(c, a);
        assert!(c > b, "ids compare in creation order");
        assert!(s.get(a).is_none());
        assert_eq!(s.get(c), Some(&"c"));
        assert_eq!(s.len(), 2);
        assert_eq!(s.iter().map(|(_, v)| *v).collect::<Vec<_>>(), ["c", "b"]);
        assert!(s.get(b).is_some());
    }

    #[test]
    fn ids_of_another_store_are_unknown() {
        let mut mine = Slab::new(1);
        let mut other = Slab::new(2);
        let id = other.insert(5).unwrap();
        mine.insert(9).unwrap();
        assert!(mine.get(id).is_none());
        assert!(mine.remove(id).is_none());
    }
}
