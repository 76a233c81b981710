//! The last use of a tensor per stream: how work on several streams is ordered the way one stream
//! would order it (the problem PyTorch's `record_stream` addresses).
//!
//! Each stream that touched a tensor (a view's stream when the view drops, a copy stream that
//! read it) leaves one event: the latest replaces the earlier, since a stream runs in order. A
//! view for another stream makes that stream wait for every one of them before it reads or
//! overwrites the tensor (writer → reader, reader → overwriter); freeing or reusing the memory
//! waits for all of them.

use smallvec::SmallVec;

use crate::backend::{RawEvent, RawStream};
use crate::base::error::Result;

/// Uses kept before complete ones are pruned.
const PRUNE_AT: usize = 4;

/// Per stream (its [`RawStream::key`]), the event after its last use of a tensor. Each entry
/// holds its stream: a stream destroyed while its work may still run would free its handle for
/// a new stream, which a key made of the handle would then confuse with it. Entries are recorded
/// under the store's lock, in the order of their records, so the latest record is a stream's
/// last use.
#[derive(Default)]
pub(crate) struct Uses(SmallVec<[(u64, RawEvent, RawStream); 2]>);

impl Uses {
    /// Records `ev` (recorded on `stream`, as the stream keyed `key`) as that stream's last use.
    pub(crate) fn record(&mut self, key: u64, stream: &RawStream, ev: RawEvent) {
        if let Some(slot) = self.0.iter_mut().find(|(k, ..)| *k == key) {
            slot.1 = ev;
            slot.2 = stream.clone();
            return;
        }
        if self.0.len() >= PRUNE_AT {
            self.0.retain(|(_, e, _)| !e.is_complete());
        }
        self.0.push((key, ev, stream.clone()));
    }

    /// Makes `stream` wait for the last use of every other stream that is not complete yet,
    /// except `already` (an event it waits for anyway: the copy that brought the bytes, which
    /// the copy stream's use of the tensor usually is).
    pub(crate) fn wait_others(&self, stream: &RawStream, already: Option<&RawEvent>) -> Result<()> {
        let me = stream.key();
        for (k, ev, _) in &self.0 {
            if *k == me || already.is_some_and(|a| a.same(ev)) || ev.is_complete() {
                continue;
            }
            stream.wait(ev)?;
        }
        Ok(())
    }

    /// Every recorded use.
    pub(crate) fn pending(&self) -> impl Iterator<Item = &RawEvent> {
        self.0.iter().map(|(_, e, _)| e)
    }

    /// Number of streams with a recorded use.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::host::HostBackend;

    #[test]
    fn one_event_per_stream_and_others_are_waited_for() {
        let be = HostBackend::new().unwrap();
        let (a, b) =
            (RawStream::Host(be.new_stream().unwrap()), RawStream::Host(be.new_stream().unwrap()));
        let mut u = Uses::default();
        u.record(a.key(), &a, a.record().unwrap());
        u.record(a.key(), &a, a.record().unwrap());
        assert_eq!(u.len(), 1, "a stream's later use replaces its earlier");
        // Stream a is blocked until `gate` is set: a use recorded behind it stays incomplete,
        // and b must not run past it.
        let gate = std::sync::Arc::new(crate::base::sync::Signal::default());
        let g = gate.clone();
        let RawStream::Host(ah) = &a else { unreachable!() };
        ah.launch(Box::new(move || g.wait()));
        u.record(a.key(), &a, a.record().unwrap());
        u.wait_others(&b, None).unwrap();
        let after = b.record().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!after.is_complete(), "b ran before a's last use");
        gate.set();
        after.synchronize().unwrap();
        u.record(b.key(), &b, b.record().unwrap());
        u.record(9, &b, b.record().unwrap());
        u.record(10, &b, b.record().unwrap());
        b.synchronize().unwrap();
        u.record(11, &b, b.record().unwrap());
        assert!(u.len() <= 2, "complete uses are pruned");
    }
}
