//! Timing of copies and waits: spans for `Stats` (copy time, stall time, overlap) and for the
//! Chrome trace `Store::trace` writes (open it in Perfetto or chrome://tracing).
//!
//! A span's ends are host instants or backend events. CUDA events are placed on the host's clock
//! through a base event recorded and waited for when the store was built: an event's time is the
//! base instant plus `cuEventElapsedTime(base, event)`.

use std::collections::VecDeque;
use std::io::Write;
use std::path::Path;
use std::time::Instant;

use crate::backend::{Backend, RawEvent};
use crate::error::{Error, Result};

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
    pub(crate) tensor: String,
    pub(crate) bytes: u64,
    pub(crate) start: TimePoint,
    pub(crate) end: TimePoint,
}

/// Adds a span, dropping the oldest beyond [`MAX_SPANS`].
pub(crate) fn push(spans: &mut VecDeque<Span>, span: Span) {
    if spans.len() >= MAX_SPANS {
        spans.pop_front();
    }
    spans.push_back(span);
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
            let ev = backend.h2d().record()?;
            ev.synchronize()?;
            return Ok(Clock { base: Instant::now(), base_ev: Some(ev) });
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

/// Writes `spans` as a Chrome trace (JSON array format, times in microseconds).
pub(crate) fn write_chrome(path: &Path, spans: &VecDeque<Span>, clock: &Clock) -> Result<()> {
    let io = |e| Error::io(path, e);
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).map_err(io)?);
    let mut first = true;
    let mut sep = |out: &mut std::io::BufWriter<std::fs::File>| -> std::io::Result<()> {
        if !std::mem::take(&mut first) {
            out.write_all(b",\n")?;
        }
        Ok(())
    };
    out.write_all(b"{\"traceEvents\":[\n").map_err(io)?;
    let mut named = std::collections::HashSet::new();
    for s in spans {
        let Some((a, b)) = clock.span(s) else { continue };
        let (tid, tname) = s.track.tid();
        if named.insert(tid) {
            sep(&mut out).map_err(io)?;
            write!(
                out,
                "{{\"ph\":\"M\",\"pid\":1,\"tid\":{tid},\"name\":\"thread_name\",\"args\":{{\"name\":\"{tname}\"}}}}"
            )
            .map_err(io)?;
        }
        sep(&mut out).map_err(io)?;
        write!(
            out,
            "{{\"ph\":\"X\",\"pid\":1,\"tid\":{tid},\"name\":\"{} {}\",\"cat\":\"{}\",\"ts\":{:.3},\"dur\":{:.3},\"args\":{{\"bytes\":{}}}}}",
            s.what,
            json_escape(&s.tensor),
            s.what,
            a * 1e6,
            (b - a) * 1e6,
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
