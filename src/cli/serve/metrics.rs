//! What `/metrics` reports, in Prometheus' text format: requests by endpoint and status, tokens,
//! token passes and their batch sizes, the queue, and the bytes a pass moves into the Device
//! tier against the PCIe floor.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use strata::{Store, Tier};

/// The server's counters and gauges.
pub struct Metrics {
    /// Requests, by endpoint and HTTP status (499: the client went away before the answer).
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    /// Jobs waiting for a slot in the batch.
    pub queued: AtomicU64,
    /// Sequences in the batch now.
    pub batch: AtomicU64,
    /// Tokens generated.
    pub tokens: AtomicU64,
    /// Prompt tokens admitted.
    pub prompt_tokens: AtomicU64,
    /// Requests dropped because their client went away (in the batch or still queued).
    pub cancelled: AtomicU64,
    /// Token passes that failed.
    pub failed: AtomicU64,
    passes: Mutex<Passes>,
    store: Arc<Store>,
    /// Pinned-to-device bandwidth measured at start, bytes/s.
    h2d: f64,
}

#[derive(Default)]
struct Passes {
    count: u64,
    seconds: f64,
    sequences: u64,
    last_tokens_per_s: f64,
}

impl Metrics {
    /// Counters at zero, over the model's store; `h2d` the pinned-to-device bandwidth.
    pub fn new(store: Arc<Store>, h2d: f64) -> Metrics {
        Metrics {
            requests: Mutex::new(BTreeMap::new()),
            queued: AtomicU64::new(0),
            batch: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            passes: Mutex::new(Passes::default()),
            store,
            h2d,
        }
    }

    /// Counts a request by the status it was answered with.
    pub fn request(&self, endpoint: &'static str, status: u16) {
        *self.requests.lock().entry((endpoint, status)).or_default() += 1;
    }

    /// Counts a token pass over `sequences` sequences that took `seconds`.
    pub fn pass(&self, sequences: usize, seconds: f64) {
        let mut p = self.passes.lock();
        p.count += 1;
        p.seconds += seconds;
        p.sequences += sequences as u64;
        if seconds > 0.0 {
            p.last_tokens_per_s = sequences as f64 / seconds;
        }
    }

    /// The text `/metrics` answers.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, rows: &[(String, f64)]| {
            let _ = writeln!(out, "# HELP strata_{name} {help}\n# TYPE strata_{name} {kind}");
            for (labels, v) in rows {
                let _ = writeln!(out, "strata_{name}{labels} {v}");
            }
        };
        let requests: Vec<(String, f64)> = self
            .requests
            .lock()
            .iter()
            .map(|((e, s), n)| (format!("{{endpoint=\"{e}\",status=\"{s}\"}}"), *n as f64))
            .collect();
        metric(
            "requests_total",
            "counter",
            "Requests, by endpoint and status (499: the client went away before the answer).",
            &requests,
        );
        let get = |a: &AtomicU64| vec![(String::new(), a.load(Ordering::Relaxed) as f64)];
        metric(
            "queue_depth",
            "gauge",
            "Requests waiting for a slot in the batch.",
            &get(&self.queued),
        );
        metric("batch_size", "gauge", "Sequences decoding now.", &get(&self.batch));
        metric("generated_tokens_total", "counter", "Tokens generated.", &get(&self.tokens));
        metric(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens admitted.",
            &get(&self.prompt_tokens),
        );
        metric(
            "cancelled_total",
            "counter",
            "Requests dropped because their client went away (in the batch or still queued).",
            &get(&self.cancelled),
        );
        metric("failed_passes_total", "counter", "Token passes that failed.", &get(&self.failed));
        let p = self.passes.lock();
        let one = |v: f64| vec![(String::new(), v)];
        metric("passes_total", "counter", "Token passes over the weights.", &one(p.count as f64));
        metric("pass_seconds_total", "counter", "Seconds spent in token passes.", &one(p.seconds));
        let mean_batch = if p.count > 0 { p.sequences as f64 / p.count as f64 } else { 0.0 };
        metric("mean_batch_size", "gauge", "Sequences a pass, on average.", &one(mean_batch));
        metric(
            "tokens_per_second",
            "gauge",
            "Tokens the last pass made a second.",
            &one(p.last_tokens_per_s),
        );
        let moved = self.store.stats().moved_into(Tier::Device) as f64;
        metric(
            "device_bytes_in_total",
            "counter",
            "Bytes moved into the Device tier (weights streamed, caches).",
            &one(moved),
        );
        if p.count > 0 && self.h2d > 0.0 {
            let per_pass = moved / p.count as f64;
            let floor = per_pass / self.h2d;
            let mean = p.seconds / p.count as f64;
            metric("bytes_per_pass", "gauge", "Bytes into the Device tier a pass.", &one(per_pass));
            metric(
                "pass_floor_seconds",
                "gauge",
                "A pass's PCIe floor: its bytes at the pinned-to-device bandwidth measured at start.",
                &one(floor),
            );
            metric(
                "pass_over_floor",
                "gauge",
                "The mean pass against its PCIe floor.",
                &one(if floor > 0.0 { mean / floor } else { 0.0 }),
            );
        }
        out
    }
}
