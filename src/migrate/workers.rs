//! The migration workers: a pool of threads that carry out moves needing the host
//! (reading the disk into pinned staging and on to the device, spilling victims to make room for
//! a prefetch), ordered by when they are needed.
//!
//! A job holds no lock while it reads or copies; it takes the store's lock to plan and to
//! commit. Jobs wait in a priority queue: prefetches in the order they were asked for, and a job
//! someone is waiting for (a view of that tensor) goes to the front.
//!
//! A store without worker threads (a simulated one: one host clock, deterministic) has an
//! *inline* engine: its jobs run on the thread that queued them, as soon as that thread releases
//! the store's lock, and a thread waiting for a job runs it.

use std::cell::Cell;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use crate::base::error::{Error, Result};
use crate::base::types::TensorId;
use crate::residency::Source;

/// What a job does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum JobKind {
    /// Fill the Device replica already allocated for the tensor from its Disk replica.
    Fill(TensorId),
    /// Bring the tensor to the device: make room (spilling victims), then copy it in.
    Bring(TensorId, Source),
}

/// The store's side of a job.
pub(crate) trait Runner: Send + Sync + 'static {
    /// Runs a job; called without locks held. `worker` is the worker thread's index (its own
    /// staging buffers), `None` when the job runs inline.
    fn run_job(&self, worker: Option<usize>, job: JobKind, jobno: u64);
    /// A queued job that will not run (the store is going away): undo what queuing it did.
    fn cancel_job(&self, job: JobKind, jobno: u64);
}

struct Job {
    priority: u64,
    jobno: u64,
}

impl PartialEq for Job {
    fn eq(&self, o: &Job) -> bool {
        (self.priority, self.jobno) == (o.priority, o.jobno)
    }
}
impl Eq for Job {}
impl PartialOrd for Job {
    fn partial_cmp(&self, o: &Job) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Job {
    fn cmp(&self, o: &Job) -> std::cmp::Ordering {
        (self.priority, self.jobno).cmp(&(o.priority, o.jobno))
    }
}

struct Queue {
    heap: BinaryHeap<Reverse<Job>>,
    /// Jobs queued and not yet claimed (an expedited job is in the heap twice, here once).
    pending: HashMap<u64, JobKind>,
    next_priority: u64,
    next_job: u64,
    shutdown: bool,
}

impl Queue {
    /// The next job to run, skipping heap entries of jobs already claimed.
    fn pop(&mut self) -> Option<(u64, JobKind)> {
        while let Some(Reverse(j)) = self.heap.pop() {
            if let Some(kind) = self.pending.remove(&j.jobno) {
                return Some((j.jobno, kind));
            }
        }
        None
    }
}

thread_local! {
    /// Whether this thread is running inline jobs (so a job's own unlock does not recurse).
    static INLINE: Cell<bool> = const { Cell::new(false) };
}

/// The worker pool (or the inline queue).
pub(crate) struct Workers {
    queue: Arc<(Mutex<Queue>, Condvar)>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    stopped: AtomicBool,
    inline: bool,
    /// Jobs queued, for a cheap check before taking the queue's lock.
    queued: Arc<AtomicUsize>,
}

impl Workers {
    fn empty(inline: bool) -> Workers {
        Workers {
            queue: Arc::new((
                Mutex::new(Queue {
                    heap: BinaryHeap::new(),
                    pending: HashMap::new(),
                    next_priority: 1,
                    next_job: 1,
                    shutdown: false,
                }),
                Condvar::new(),
            )),
            workers: Mutex::new(Vec::new()),
            stopped: AtomicBool::new(false),
            inline,
            queued: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// An engine whose jobs run on the threads that queue or wait for them.
    pub(crate) fn inline() -> Workers {
        Workers::empty(true)
    }

    /// Starts `workers` threads that run jobs through `runner` (held weakly: the pool must not
    /// keep the store alive).
    pub(crate) fn start<R: Runner>(workers: usize, runner: Weak<R>) -> Result<Workers> {
        let engine = Workers::empty(false);
        let mut handles = Vec::new();
        for w in 0..workers.max(1) {
            let (q, r, n) = (engine.queue.clone(), runner.clone(), engine.queued.clone());
            crate::base::failpoint::check(
                crate::base::failpoint::Site::WorkerStart,
                "<worker>".as_ref(),
            )
            .inspect_err(|_| stop_threads(&engine.queue, &mut handles))?;
            let h = std::thread::Builder::new()
                .name(format!("strata-mover-{w}"))
                .spawn(move || worker(w, q, r, n))
                .map_err(|e| {
                    stop_threads(&engine.queue, &mut handles);
                    Error::io("<thread spawn>", e)
                })?;
            handles.push(h);
        }
        *engine.workers.lock() = handles;
        Ok(engine)
    }

    /// Queues a job behind the jobs already queued and returns its number.
    pub(crate) fn submit(&self, kind: JobKind) -> u64 {
        let (m, cv) = &*self.queue;
        let mut q = m.lock();
        let (priority, jobno) = (q.next_priority, q.next_job);
        q.next_priority += 1;
        q.next_job += 1;
        q.heap.push(Reverse(Job { priority, jobno }));
        q.pending.insert(jobno, kind);
        self.queued.fetch_add(1, Ordering::Relaxed);
        cv.notify_one();
        jobno
    }

    /// Takes a queued job out of the queue before any worker has taken it: true if it was
    /// still queued (it will not run; the caller undoes what queuing it did).
    pub(crate) fn revoke(&self, jobno: u64) -> bool {
        let mut q = self.queue.0.lock();
        if q.pending.remove(&jobno).is_some() {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            true
        } else {
            false
        }
    }

    /// Moves a queued job to the front (someone is waiting for it now); on an inline engine,
    /// runs the queue on this thread until the job has run.
    pub(crate) fn expedite(&self, jobno: u64, runner: &dyn Runner) {
        let (m, cv) = &*self.queue;
        {
            let mut q = m.lock();
            if !q.pending.contains_key(&jobno) {
                return;
            }
            q.heap.push(Reverse(Job { priority: 0, jobno }));
            cv.notify_one();
        }
        if self.inline {
            self.drain(runner);
        }
    }

    /// Inline engines: runs the queued jobs on this thread (unless it is already running them).
    /// The caller holds no lock.
    pub(crate) fn run_inline(&self, runner: &dyn Runner) {
        if self.inline && self.queued.load(Ordering::Relaxed) > 0 && !INLINE.with(Cell::get) {
            self.drain(runner);
        }
    }

    fn drain(&self, runner: &dyn Runner) {
        if INLINE.with(|c| c.replace(true)) {
            return;
        }
        loop {
            let job = self.queue.0.lock().pop();
            let Some((jobno, kind)) = job else { break };
            self.queued.fetch_sub(1, Ordering::Relaxed);
            runner.run_job(None, kind, jobno);
        }
        INLINE.with(|c| c.set(false));
    }

    /// Stops the workers after the job each is running; queued jobs are cancelled through
    /// `runner`.
    pub(crate) fn stop(&self, runner: &dyn Runner) {
        if self.stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        let left: Vec<(u64, JobKind)> = {
            let mut q = self.queue.0.lock();
            q.shutdown = true;
            q.heap.clear();
            q.pending.drain().collect()
        };
        self.queue.1.notify_all();
        for (jobno, kind) in left {
            runner.cancel_job(kind, jobno);
        }
        let mut handles = std::mem::take(&mut *self.workers.lock());
        stop_threads(&self.queue, &mut handles);
    }
}

fn stop_threads(queue: &Arc<(Mutex<Queue>, Condvar)>, handles: &mut Vec<JoinHandle<()>>) {
    queue.0.lock().shutdown = true;
    queue.1.notify_all();
    for h in handles.drain(..) {
        let _ = h.join();
    }
}

fn worker<R: Runner>(
    w: usize,
    queue: Arc<(Mutex<Queue>, Condvar)>,
    runner: Weak<R>,
    queued: Arc<AtomicUsize>,
) {
    let (m, cv) = &*queue;
    loop {
        let (jobno, kind) = {
            let mut q = m.lock();
            loop {
                if q.shutdown {
                    return;
                }
                if let Some(j) = q.pop() {
                    break j;
                }
                cv.wait(&mut q);
            }
        };
        queued.fetch_sub(1, Ordering::Relaxed);
        match runner.upgrade() {
            Some(r) => {
                // A job that panics must not take the worker (and the jobs behind it) down.
                let run = std::panic::AssertUnwindSafe(|| r.run_job(Some(w), kind, jobno));
                if std::panic::catch_unwind(run).is_err() {
                    r.cancel_job(kind, jobno);
                }
            }
            None => return,
        }
    }
}
