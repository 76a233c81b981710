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
use crate::error::Result;

/// Uses kept before complete ones are pruned.
const PRUNE_AT: usize = 4;

/// Per stream (its [`RawStream::key`]), the event after its last use of a tensor.
#[derive(Default)]
pub(crate) struct Uses(SmallVec<[(u64, RawEvent); 2]>);

impl Uses {
    /// Records `ev` as stream `key`'s last use.
    pub(crate) fn record(&mut self, key: u64, ev: RawEvent) {
        if let Some(slot) = self.0.iter_mut().find(|(k, _)| *k == key) {
            slot.1 = ev;
            return;
        }
        if self.0.len() >= PRUNE_AT {
            self.0.retain(|(_, e)| !e.is_complete());
        }
        self.0.push((key, ev));
    }

    /// Makes `stream` wait for the last use of every other stream.
    pub(crate) fn wait_others(&self, stream: &RawStream) -> Result<()> {
        let me = stream.key();
        for (k, ev) in &self.0 {
            if *k != me {
                stream.wait(ev)?;
            }
        }
        Ok(())
    }

    /// Every recorded use.
    pub(crate) fn pending(&self) -> impl Iterator<Item = &RawEvent> {
        self.0.iter().map(|(_, e)| e)
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
        u.record(a.key(), a.record().unwrap());
        u.record(a.key(), a.record().unwrap());
        assert_eq!(u.len(), 1, "a stream's later use replaces its earlier");
        // Stream a is blocked until `gate` is set: a use recorded behind it stays incomplete,
        // and b must not run past it.
        let gate = std::sync::Arc::new(crate::backend::Signal::default());
        let g = gate.clone();
        let RawStream::Host(ah) = &a else { unreachable!() };
        ah.launch(Box::new(move || g.wait()));
        u.record(a.key(), a.record().unwrap());
        u.wait_others(&b).unwrap();
        let after = b.record().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!after.is_complete(), "b ran before a's last use");
        gate.set();
        after.synchronize().unwrap();
        u.record(b.key(), b.record().unwrap());
        u.record(9, b.record().unwrap());
        u.record(10, b.record().unwrap());
        b.synchronize().unwrap();
        u.record(11, b.record().unwrap());
        assert!(u.len() <= 2, "complete uses are pruned");
    }
}
