//! The migration engine's disk side: a pool of worker threads that bring tensors from the Disk
//! tier to the Device tier, ordered by when they are needed.
//!
//! A job reads its tensor's bytes from the slab file into the worker's own pinned staging
//! buffers (O_DIRECT where the file system allows) *without* the store's lock, and takes the
//! lock only to issue each piece's host-to-device copy, so disk reads, PCIe transfers and the
//! user's kernels overlap. Jobs wait in a priority queue: prefetches in the order they were asked
//! for, and a job someone is waiting on (a view of that tensor) goes to the front.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use crate::backend::RawEvent;
use crate::error::{Error, Result};
use crate::types::TensorId;

const QUEUED: u8 = 0;
const RUNNING: u8 = 1;
const DONE: u8 = 2;

/// The progress of one disk-to-device fill, shared by the job and whoever waits for it.
pub(crate) struct Fill {
    state: AtomicU8,
    result: Mutex<Option<std::result::Result<Option<RawEvent>, String>>>,
    cv: Condvar,
}

impl Fill {
    pub(crate) fn new() -> Arc<Fill> {
        Arc::new(Fill {
            state: AtomicU8::new(QUEUED),
            result: Mutex::new(None),
            cv: Condvar::new(),
        })
    }

    /// Claims a queued job for a worker; false if it already ran (a duplicate queue entry).
    pub(crate) fn start(&self) -> bool {
        self.state.compare_exchange(QUEUED, RUNNING, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }

    /// Records the outcome and wakes the waiters.
    pub(crate) fn finish(&self, r: std::result::Result<Option<RawEvent>, String>) {
        *self.result.lock() = Some(r);
        self.state.store(DONE, Ordering::Release);
        self.cv.notify_all();
    }

    pub(crate) fn is_done(&self) -> bool {
        self.state.load(Ordering::Acquire) == DONE
    }

    /// Blocks until the job has finished. The caller must not hold the store's lock.
    pub(crate) fn wait(&self) {
        let mut r = self.result.lock();
        while r.is_none() {
            self.cv.wait(&mut r);
        }
    }
}

struct Job {
    priority: u64,
    id: TensorId,
    fill: Arc<Fill>,
}

impl PartialEq for Job {
    fn eq(&self, o: &Job) -> bool {
        self.priority == o.priority
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
        self.priority.cmp(&o.priority)
    }
}

/// What the engine calls to run a job: the store's side of it.
pub(crate) trait FillRunner: Send + Sync + 'static {
    /// Runs the fill of `id`'s Device replica; called on a worker thread, without locks held.
    fn run_fill(&self, worker: usize, id: TensorId, fill: &Arc<Fill>);
}

struct Queue {
    heap: BinaryHeap<Reverse<Job>>,
    next_priority: u64,
    shutdown: bool,
}

/// The worker pool.
pub(crate) struct Engine {
    queue: Arc<(Mutex<Queue>, Condvar)>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    stopped: AtomicBool,
}

impl Engine {
    /// Starts `workers` threads that run jobs through `runner` (held weakly: the pool must not
    /// keep the store alive).
    pub(crate) fn start<R: FillRunner>(workers: usize, runner: Weak<R>) -> Result<Engine> {
        let queue = Arc::new((
            Mutex::new(Queue { heap: BinaryHeap::new(), next_priority: 1, shutdown: false }),
            Condvar::new(),
        ));
        let mut handles = Vec::new();
        for w in 0..workers.max(1) {
            let (q, r) = (queue.clone(), runner.clone());
            let h = std::thread::Builder::new()
                .name(format!("strata-disk-{w}"))
                .spawn(move || worker(w, q, r))
                .map_err(|e| Error::io("<thread spawn>", e))?;
            handles.push(h);
        }
        Ok(Engine { queue, workers: Mutex::new(handles), stopped: AtomicBool::new(false) })
    }

    /// Queues the fill of `id` behind the jobs already queued.
    pub(crate) fn submit(&self, id: TensorId, fill: Arc<Fill>) {
        let (m, cv) = &*self.queue;
        let mut q = m.lock();
        let priority = q.next_priority;
        q.next_priority += 1;
        q.heap.push(Reverse(Job { priority, id, fill }));
        cv.notify_one();
    }

    /// Moves a queued job to the front (someone is waiting for it now).
    pub(crate) fn expedite(&self, id: TensorId, fill: &Arc<Fill>) {
        if fill.is_done() {
            return;
        }
        let (m, cv) = &*self.queue;
        m.lock().heap.push(Reverse(Job { priority: 0, id, fill: fill.clone() }));
        cv.notify_one();
    }

    /// Stops the workers after the job each is running; queued jobs finish with an error.
    pub(crate) fn stop(&self) {
        if self.stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        let (m, cv) = &*self.queue;
        let left: Vec<Job> = {
            let mut q = m.lock();
            q.shutdown = true;
            std::mem::take(&mut q.heap).into_iter().map(|r| r.0).collect()
        };
        cv.notify_all();
        for j in left {
            if j.fill.start() {
                j.fill.finish(Err("the store was dropped before the prefetch ran".into()));
            }
        }
        let handles = std::mem::take(&mut *self.workers.lock());
        for h in handles {
            let _ = h.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

fn worker<R: FillRunner>(w: usize, queue: Arc<(Mutex<Queue>, Condvar)>, runner: Weak<R>) {
    let (m, cv) = &*queue;
    loop {
        let job = {
            let mut q = m.lock();
            loop {
                if q.shutdown {
                    return;
                }
                if let Some(Reverse(j)) = q.heap.pop() {
                    break j;
                }
                cv.wait(&mut q);
            }
        };
        if !job.fill.start() {
            continue; // a duplicate entry of a job that already ran
        }
        match runner.upgrade() {
            Some(r) => r.run_fill(w, job.id, &job.fill),
            None => {
                job.fill.finish(Err("the store was dropped before the prefetch ran".into()));
                return;
            }
        }
    }
}
