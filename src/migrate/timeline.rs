//! Timing of copies and waits: spans for `Stats` (copy time, stall time, overlap) and for the
//! Chrome trace `Store::trace` writes (open it in Perfetto or chrome://tracing).
//!
//! A span's ends are host instants or backend events. CUDA events are placed on the host's clock
//! through a base event recorded and waited for when the store was built: an event's time is the
//! base instant plus `cuEventElapsedTime(base, event)`.

use std::collections::VecDeque;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crate::backend::{Backend, RawEvent};
use crate::base::error::{Error, Result};

/// Spans kept for stats and traces; older ones are dropped.
pub(crate) const MAX_SPANS: usize = 100_000;

/// One end of a span.
pub(crate) enum TimePoint {
    Host(Instant),
    Ev(RawEvent),
}

/// The row of the trace a span goes on.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Track {
    /// Host-to-device copies.
    H2d,
    /// Device-to-host copies.
    D2h,
    /// Copies done by the CPU (host tiers, disk writes).
    Host,
    /// Consumers waiting for copies.
    Stall,
    /// A disk worker's reads.
    Disk(usize),
}

impl Track {
    fn tid(self) -> (usize, String) {
        match self {
            Track::H2d => (1, "copy stream host-to-device".into()),
            Track::D2h => (2, "copy stream device-to-host".into()),
            Track::Host => (3, "host copies".into()),
            Track::Stall => (4, "consumer waits".into()),
            Track::Disk(w) => (10 + w, format!("disk worker {w}")),
        }
    }

    /// Whether the span is a transfer (counted in copy time), not a wait.
    pub(crate) fn is_copy(self) -> bool {
        !matches!(self, Track::Stall)
    }
}

/// A copy or a wait.
pub(crate) struct Span {
    pub(crate) track: Track,
    pub(crate) what: &'static str,
    /// The tensor's name (shared with its metadata: a span costs no allocation for it).
    pub(crate) tensor: Arc<str>,
    pub(crate) bytes: u64,
    pub(crate) start: TimePoint,
    pub(crate) end: TimePoint,
}

/// A span whose times are known: seconds since the store's time base.
#[derive(Clone)]
pub(crate) struct Done {
    track: Track,
    what: &'static str,
    tensor: Arc<str>,
    bytes: u64,
    start: f64,
    end: f64,
}

/// Spans waiting for their events, the resolved ones (the most recent [`MAX_SPANS`]), and the
/// total copy time. Resolving is incremental, so `Store::stats` costs the same however long the
/// store has run.
pub(crate) struct Timeline {
    pub(crate) clock: Clock,
    pending: Vec<Span>,
    done: VecDeque<Done>,
    copy_s: f64,
}

/// Unresolved spans kept before resolving them eagerly.
const MAX_PENDING: usize = 4096;

impl Timeline {
    pub(crate) fn new(clock: Clock) -> Timeline {
        Timeline { clock, pending: Vec::new(), done: VecDeque::new(), copy_s: 0.0 }
    }

    /// Adds a span (resolved later, once its events complete).
    pub(crate) fn push(&mut self, span: Span) {
        self.pending.push(span);
        if self.pending.len() > MAX_PENDING {
            self.resolve();
        }
    }

    /// Resolves the spans whose events have completed.
    pub(crate) fn resolve(&mut self) {
        let pending = std::mem::take(&mut self.pending);
        for s in pending {
            match self.clock.span(&s) {
                Some((start, end)) => {
                    if s.track.is_copy() {
                        self.copy_s += end - start;
                    }
                    if self.done.len() >= MAX_SPANS {
                        self.done.pop_front();
                    }
                    let Span { track, what, tensor, bytes, .. } = s;
                    self.done.push_back(Done { track, what, tensor, bytes, start, end });
                }
                None => self.pending.push(s),
            }
        }
    }

    /// The resolved spans, to write without the store's lock (names are shared, so the copy
    /// costs a reference count per span).
    pub(crate) fn snapshot(&self) -> Vec<Done> {
        self.done.iter().cloned().collect()
    }

    /// Seconds spent in copies resolved so far.
    pub(crate) fn copy_seconds(&self) -> f64 {
        self.copy_s
    }
}

/// The store's time base.
pub(crate) struct Clock {
    base: Instant,
    base_ev: Option<RawEvent>,
}

impl Clock {
    /// Takes the base: on CUDA, an event on the host-to-device stream, waited for.
    pub(crate) fn start(backend: &Backend) -> Result<Clock> {
        if let Backend::Cuda(_) = backend {
            let ev = backend.h2d().record_timed()?;
            ev.synchronize()?;
            return Ok(Clock { base: Instant::now(), base_ev: Some(ev) });
        }
        if let Some(sim) = backend.sim() {
            // Simulated events complete at instants after the simulation's base.
            return Ok(Clock { base: sim.base(), base_ev: None });
        }
        Ok(Clock { base: Instant::now(), base_ev: None })
    }

    /// Seconds since the base; `None` for an event not complete yet.
    pub(crate) fn seconds(&self, t: &TimePoint) -> Option<f64> {
        match t {
            TimePoint::Host(i) => Some(i.saturating_duration_since(self.base).as_secs_f64()),
            TimePoint::Ev(ev) => match (ev.host_completed_at(), &self.base_ev) {
                (Some(i), _) => Some(i.saturating_duration_since(self.base).as_secs_f64()),
                (None, Some(base)) => ev.seconds_since(base),
                (None, None) => None,
            },
        }
    }

    /// A span's (start, end) in seconds since the base, once both ends are known.
    pub(crate) fn span(&self, s: &Span) -> Option<(f64, f64)> {
        let (a, b) = (self.seconds(&s.start)?, self.seconds(&s.end)?);
        Some((a, b.max(a)))
    }
}

/// Writes resolved spans as a Chrome trace (JSON object format, times in microseconds). Called
/// without the store's lock, on a [`Timeline::snapshot`].
pub(crate) fn write_chrome(path: &Path, spans: &[Done]) -> Result<()> {
    let io = |e| Error::io(path, e);
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    out.write_all(b"{\"traceEvents\":[\n").map_err(io)?;
    let mut first = true;
    let mut named = std::collections::HashSet::new();
    for s in spans {
        let (tid, tname) = s.track.tid();
        if named.insert(tid) {
            if !std::mem::take(&mut first) {
                out.write_all(b",\n").map_err(io)?;
            }
            write!(
                out,
                "{{\"ph\":\"M\",\"pid\":1,\"tid\":{tid},\"name\":\"thread_name\",\"args\":{{\"name\":\"{tname}\"}}}}"
            )
            .map_err(io)?;
        }
        if !std::mem::take(&mut first) {
            out.write_all(b",\n").map_err(io)?;
        }
        write!(
            out,
            "{{\"ph\":\"X\",\"pid\":1,\"tid\":{tid},\"name\":\"{} {}\",\"cat\":\"{}\",\"ts\":{:.3},\"dur\":{:.3},\"args\":{{\"bytes\":{}}}}}",
            s.what,
            json_escape(&s.tensor),
            s.what,
            s.start * 1e6,
            (s.end - s.start) * 1e6,
            s.bytes
        )
        .map_err(io)?;
    }
    out.write_all(b"\n]}\n").map_err(io)?;
    out.flush().map_err(io)
}

fn json_escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_names() {
        assert_eq!(json_escape("a\"b\\c\n"), "a\\\"b\\\\c\\u000a");
    }
}
