//! The learning rate by step ([`LrSchedule`]).

/// The learning rate of each step: linear warmup from `peak / warmup` to `peak` over the first
/// `warmup` steps, then a cosine from `peak` down to `min` at step `total` (and `min` after).
///
/// ```
/// let s = strata::candle::LrSchedule { peak: 1e-3, min: 1e-4, warmup: 2, total: 10 };
/// assert_eq!(s.lr(0), 5e-4);                   // warming up
/// assert_eq!(s.lr(2), 1e-3);                   // the peak, where the cosine starts
/// assert!((s.lr(10) - 1e-4).abs() < 1e-12);    // the floor
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// The learning rate after warmup.
    pub peak: f64,
    /// The learning rate at the end of the cosine.
    pub min: f64,
    /// Steps of linear warmup.
    pub warmup: u64,
    /// The step at which the cosine reaches `min`.
    pub total: u64,
}

impl LrSchedule {
    /// A constant learning rate.
    pub fn constant(lr: f64) -> LrSchedule {
        LrSchedule { peak: lr, min: lr, warmup: 0, total: 0 }
    }

    /// The learning rate of step `step` (0-based).
    pub fn lr(&self, step: u64) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup);
        if span == 0 {
            return self.peak;
        }
        let progress = ((step - self.warmup) as f64 / span as f64).min(1.0);
        self.min + 0.5 * (self.peak - self.min) * (1.0 + (std::f64::consts::PI * progress).cos())
    }
}
