//! Continuous batching: one thread owns the model and runs token passes over every active
//! sequence; a request waiting in the queue joins at the next pass (its prompt's pass is part of
//! that pass), a finished or abandoned one leaves. Each sequence has its own KV cache, positions
//! and seeded sampler, and [`CausalLm::forward_each`] gives each the logits it would get alone,
//! so a sequence's tokens are what it would generate alone.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Tensor;
use crossbeam::channel::{Receiver, RecvTimeoutError, TryRecvError};
use tokio::sync::mpsc::UnboundedSender;

use super::metrics::Metrics;
use strata::candle::text::{TextStream, Tokenizer};
use strata::candle::{CausalLm, Sampler, Sampling};

/// A request, tokenized and checked, waiting for a slot in the batch.
pub struct Job {
    /// The prompt's token ids (at least one).
    pub prompt: Vec<u32>,
    /// New tokens at most (at least one).
    pub max_new: usize,
    /// How tokens are picked.
    pub sampling: Sampling,
    /// Token ids that end the sequence (the model's end of sequence).
    pub stop_tokens: Vec<u32>,
    /// Strings that end the sequence; the text stops before the first one.
    pub stop_strings: Vec<String>,
    /// Where the sequence's text goes, piece by piece; closed by the client: the job is dropped.
    pub events: UnboundedSender<Event>,
}

/// Why a sequence ended (OpenAI's `finish_reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The model's end of sequence, or a stop string.
    Stop,
    /// `max_tokens`.
    Length,
}

impl Finish {
    /// OpenAI's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
        }
    }
}

/// What a sequence sends back.
#[derive(Debug)]
pub enum Event {
    /// Text the sequence added.
    Text(String),
    /// The end: why, and the token counts.
    Done {
        /// Why it ended.
        finish: Finish,
        /// Tokens of the prompt.
        prompt_tokens: usize,
        /// Tokens generated (the end-of-sequence token included).
        completion_tokens: usize,
    },
    /// It failed (the model's error); nothing more follows.
    Failed(String),
}

/// A sequence in the batch.
struct Seq<'t> {
    job: Job,
    sampler: Sampler,
    /// The next pass's input: the prompt first, then the last token.
    input: Tensor,
    generated: usize,
    stream: TextStream<'t>,
    /// The tokenizer's vocabulary: ids past it have no text.
    vocab: usize,
    /// Text decoded but held back: it could be the start of a stop string.
    held: String,
}

impl Seq<'_> {
    /// Adds `token`'s text; sends what cannot be part of a stop string. Returns whether a stop
    /// string ended the sequence.
    fn push_text(&mut self, piece: &str) -> bool {
        self.held.push_str(piece);
        if let Some(at) =
            self.job.stop_strings.iter().filter_map(|s| self.held.find(s.as_str())).min()
        {
            self.held.truncate(at);
            self.flush();
            return true;
        }
        // Hold back the longest tail that could still begin a stop string.
        let keep = self
            .job
            .stop_strings
            .iter()
            .flat_map(|s| {
                let held = &self.held;
                (1..s.len()).filter(move |&n| s.is_char_boundary(n) && held.ends_with(&s[..n]))
            })
            .max()
            .unwrap_or(0);
        let send = self.held.len() - keep;
        if send > 0 {
            let rest = self.held.split_off(send);
            let text = std::mem::replace(&mut self.held, rest);
            let _ = self.job.events.send(Event::Text(text));
        }
        false
    }

    fn flush(&mut self) {
        if !self.held.is_empty() {
            let _ = self.job.events.send(Event::Text(std::mem::take(&mut self.held)));
        }
    }
}

/// The engine's settings.
pub struct Settings {
    /// Sequences decoding at once.
    pub max_batch: usize,
}

/// Runs the batch until `jobs` is closed and every sequence has ended: each iteration admits
/// waiting jobs up to `max_batch`, drops the sequences whose client went away, and runs one
/// pass over all of them.
pub fn run<M: CausalLm>(
    model: &M,
    tokenizer: &Tokenizer,
    jobs: &Receiver<Job>,
    settings: &Settings,
    metrics: &Arc<Metrics>,
) {
    let mut seqs: Vec<Seq<'_>> = Vec::new();
    let mut caches: Vec<M::Cache> = Vec::new();
    let mut open = true;
    loop {
        // Admit: without blocking while others decode, else wait for the next job.
        while open && seqs.len() < settings.max_batch {
            let job = if seqs.is_empty() {
                match jobs.recv_timeout(Duration::from_millis(100)) {
                    Ok(j) => j,
                    Err(RecvTimeoutError::Timeout) => break,
                    Err(RecvTimeoutError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            } else {
                match jobs.try_recv() {
                    Ok(j) => j,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        open = false;
                        break;
                    }
                }
            };
            metrics.queued.store(jobs.len() as u64, Ordering::Relaxed);
            if job.events.is_closed() {
                // Its client went away while it waited.
                metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            match admit(model, tokenizer, job) {
                Ok((seq, cache)) => {
                    seqs.push(seq);
                    caches.push(cache);
                }
                Err((job, e)) => {
                    let _ = job.events.send(Event::Failed(e));
                }
            }
        }
        metrics.queued.store(jobs.len() as u64, Ordering::Relaxed);
        // A client that went away frees its slot (and its cache) now.
        let gone: Vec<bool> = seqs.iter().map(|s| s.job.events.is_closed()).collect();
        if gone.iter().any(|&g| g) {
            metrics
                .cancelled
                .fetch_add(gone.iter().filter(|&&g| g).count() as u64, Ordering::Relaxed);
            retain(&mut seqs, &mut caches, &gone.iter().map(|g| !g).collect::<Vec<_>>());
        }
        metrics.batch.store(seqs.len() as u64, Ordering::Relaxed);
        if seqs.is_empty() {
            if !open {
                return;
            }
            continue;
        }
        let inputs: Vec<Tensor> = seqs.iter().map(|s| s.input.clone()).collect();
        let t0 = Instant::now();
        let logits = model.forward_each(&inputs, &mut caches);
        let seconds = t0.elapsed().as_secs_f64();
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                // The pass failed for every sequence in it: each is told, none continues.
                for s in seqs.drain(..) {
                    let _ = s
                        .job
                        .events
                        .send(Event::Failed(format!("the model failed: {}", first_line(&e))));
                }
                caches.clear();
                metrics.failed.fetch_add(1, Ordering::Relaxed);
                continue;
            }
        };
        metrics.pass(seqs.len(), seconds);
        let mut keep = Vec::with_capacity(seqs.len());
        for (s, logits) in seqs.iter_mut().zip(&logits) {
            keep.push(step(model, s, logits).unwrap_or_else(|e| {
                let _ = s
                    .job
                    .events
                    .send(Event::Failed(format!("sampling failed: {}", first_line(&e))));
                false
            }));
        }
        metrics.tokens.fetch_add(seqs.len() as u64, Ordering::Relaxed);
        retain(&mut seqs, &mut caches, &keep);
    }
}

/// A new sequence: its cache and sampler, its prompt as the next pass's input.
#[allow(clippy::result_large_err)]
fn admit<'t, M: CausalLm>(
    model: &M,
    tokenizer: &'t Tokenizer,
    job: Job,
) -> Result<(Seq<'t>, M::Cache), (Job, String)> {
    let made = (|| {
        let sampler = Sampler::new(job.sampling.clone())?;
        let capacity = job.prompt.len() + job.max_new - 1;
        let cache = model.new_cache(1, capacity)?;
        let input = Tensor::from_vec(job.prompt.clone(), (1, job.prompt.len()), model.device())?;
        Ok::<_, candle_core::Error>((sampler, cache, input))
    })();
    match made {
        Ok((sampler, cache, input)) => Ok((
            Seq {
                job,
                sampler,
                input,
                generated: 0,
                stream: TextStream::new(tokenizer),
                vocab: tokenizer.vocab_size(),
                held: String::new(),
            },
            cache,
        )),
        Err(e) => Err((job, format!("cannot start the sequence: {}", first_line(&e)))),
    }
}

/// Samples a sequence's next token and sends its text; returns whether the sequence goes on.
fn step<M: CausalLm>(model: &M, s: &mut Seq<'_>, logits: &Tensor) -> candle_core::Result<bool> {
    let token = s.sampler.sample(&logits.squeeze(0)?.to_vec1::<f32>()?)?;
    s.generated += 1;
    let mut finish = None;
    let end_token = s.job.stop_tokens.contains(&token);
    if end_token {
        finish = Some(Finish::Stop);
    } else if token as usize >= s.vocab {
        // An id the model has and its tokenizer lacks (a vocabulary padded past the
        // tokenizer's): it has no text.
    } else if let Some(piece) = s.stream.push(token)? {
        if s.push_text(&piece) {
            finish = Some(Finish::Stop);
        }
    }
    if finish.is_none() && s.generated >= s.job.max_new {
        finish = Some(Finish::Length);
    }
    let Some(mut finish) = finish else {
        s.input = Tensor::from_vec(vec![token], (1, 1), model.device())?;
        return Ok(true);
    };
    if finish == Finish::Length || end_token {
        // The rest of a partial character, then whatever was held back.
        let rest = s.stream.finish()?;
        if s.push_text(&rest) {
            finish = Finish::Stop;
        } else {
            s.flush();
        }
    }
    let _ = s.job.events.send(Event::Done {
        finish,
        prompt_tokens: s.job.prompt.len(),
        completion_tokens: s.generated,
    });
    Ok(false)
}

fn retain<T, C>(seqs: &mut Vec<T>, caches: &mut Vec<C>, keep: &[bool]) {
    let mut k = keep.iter();
    seqs.retain(|_| *k.next().unwrap_or(&false));
    let mut k = keep.iter();
    caches.retain(|_| *k.next().unwrap_or(&false));
}

/// An error's first line: what a client is told (a backtrace candle attached stays in the log).
fn first_line(e: &candle_core::Error) -> String {
    tracing::warn!("{e}");
    e.to_string().lines().next().unwrap_or_default().to_string()
}
