//! The clocks of a step's report: the time candle computed (the compute floor of the step), and
//! the spans the step waited for the optimizer (its exposed time), so that the optimizer's time
//! hidden and exposed are measured on one clock, the step's own.

use std::time::Instant;

use candle_core::Device;

/// Sums the spans of a step in which candle computed: on the CPU the host time of the calls
/// (candle computes as it is called), on CUDA the time between events recorded on candle's
/// stream around them (the kernels' time, not the host's time to issue them). Read once the
/// stream has run past the last span (the trainer reads it after its one sync of the step).
///
/// Beside it, the host's own time inside the spans a block opened ([`ComputeClock::start_block`]):
/// on CUDA the time to issue a block's kernels (its launch work, with any wait a call makes), on
/// the CPU the block's compute itself.
pub(super) struct ComputeClock {
    device: Device,
    host: f64,
    open: Option<Instant>,
    /// Host seconds inside the blocks' spans, and the open block span's start.
    block_host: f64,
    block_open: Option<Instant>,
    #[cfg(feature = "candle-cuda")]
    timers: Vec<crate::candle::cuda::CopyTimer>,
}

impl ComputeClock {
    pub(super) fn new(device: &Device) -> ComputeClock {
        ComputeClock {
            device: device.clone(),
            host: 0.0,
            open: None,
            block_host: 0.0,
            block_open: None,
            #[cfg(feature = "candle-cuda")]
            timers: Vec::new(),
        }
    }

    /// Starts a span (a span already open goes on).
    pub(super) fn start(&mut self) -> candle_core::Result<()> {
        match &self.device {
            #[cfg(feature = "candle-cuda")]
            Device::Cuda(d) => {
                if self.timers.last().is_none_or(|t| t.stopped()) {
                    let t = crate::candle::cuda::CopyTimer::start(&d.cuda_stream())?;
                    self.timers.push(t);
                }
            }
            _ => {
                self.open.get_or_insert_with(Instant::now);
            }
        }
        Ok(())
    }

    /// Starts a span of a block's calls: a span ([`ComputeClock::start`]) whose host time is
    /// also summed apart ([`ComputeClock::block_host_seconds`]).
    pub(super) fn start_block(&mut self) -> candle_core::Result<()> {
        self.block_open.get_or_insert_with(Instant::now);
        self.start()
    }

    /// Host seconds spent inside the blocks' spans so far (an open one not counted).
    pub(super) fn block_host_seconds(&self) -> f64 {
        self.block_host
    }

    /// Ends the open span.
    pub(super) fn stop(&mut self) -> candle_core::Result<()> {
        if let Some(t) = self.block_open.take() {
            self.block_host += t.elapsed().as_secs_f64();
        }
        match &self.device {
            #[cfg(feature = "candle-cuda")]
            Device::Cuda(d) => {
                if let Some(t) = self.timers.last_mut().filter(|t| !t.stopped()) {
                    t.stop(&d.cuda_stream())?;
                }
            }
            _ => {
                if let Some(t) = self.open.take() {
                    self.host += t.elapsed().as_secs_f64();
                }
            }
        }
        Ok(())
    }

    /// The seconds of every span, an open one ended now.
    pub(super) fn seconds(&mut self) -> candle_core::Result<f64> {
        self.stop()?;
        #[cfg(feature = "candle-cuda")]
        for t in &self.timers {
            self.host += t.seconds()?;
        }
        #[cfg(feature = "candle-cuda")]
        self.timers.clear();
        Ok(self.host)
    }
}

/// Seconds of `spans` (each `(start, end)`), summed.
pub(super) fn span_seconds(spans: &[(Instant, Instant)]) -> f64 {
    // From +0 (an empty f64 sum is -0, which prints as "-0.00").
    spans.iter().map(|(a, b)| b.saturating_duration_since(*a).as_secs_f64()).fold(0.0, |a, b| a + b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_clock_sums_its_spans_only() {
        let mut c = ComputeClock::new(&Device::Cpu);
        c.start().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        c.stop().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(100));
        c.start().unwrap();
        c.start().unwrap(); // goes on
        std::thread::sleep(std::time::Duration::from_millis(20));
        let s = c.seconds().unwrap();
        // The 100 ms between the spans is not counted (sleeps may overrun on a loaded machine).
        assert!((0.04..0.12).contains(&s), "{s}");
        let t = Instant::now();
        assert_eq!(span_seconds(&[(t, t)]), 0.0);
        // A block's span is counted apart too; the others are not.
        let mut c = ComputeClock::new(&Device::Cpu);
        c.start().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        c.stop().unwrap();
        c.start_block().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(30));
        c.stop().unwrap();
        let (all, blocks) = (c.seconds().unwrap(), c.block_host_seconds());
        assert!((0.03..0.1).contains(&blocks) && all >= blocks + 0.02, "{blocks} of {all}");
    }
}
