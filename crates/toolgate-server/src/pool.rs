//! The engine side of the server: a fixed set of plain threads, each owning
//! one [`Engine`] (its own ledger connection and provider connections), fed
//! by one bounded channel; each job answers on a oneshot.
//!
//! Why plain threads and not `spawn_blocking`: the engine is synchronous and
//! one per thread by design, and PostgreSQL's blocking driver must never run on
//! a thread that drives async tasks (it panics: "Cannot start a runtime from
//! within a runtime"). Each engine is opened on the caller's thread before the
//! runtime starts (so a bad database fails the command with its code, before
//! anything listens) and then moved into its own thread, which never enters
//! the runtime. A fixed count also bounds the ledger connections the server
//! holds, and the bounded queue turns overload into a prompt `SERVER_BUSY`
//! instead of an unbounded backlog of blocked tasks.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::engine::Engine;

type Job = Box<dyn FnOnce(&mut Engine) + Send>;

/// Why a job was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Every thread is busy and the queue is full.
    Busy,
    /// The pool is shutting down.
    Closed,
}

/// The engine threads.
pub struct Pool {
    tx: Mutex<Option<SyncSender<Job>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Set at a shutdown that must not start queued work: the threads drop
    /// the jobs still queued (their callers see the answer channel closed).
    discard: Arc<AtomicBool>,
}

impl Pool {
    /// Starts one thread per engine; `queue` jobs may wait beyond those running.
    pub fn start(engines: Vec<Engine>, queue: usize) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::sync_channel::<Job>(queue);
        let rx = Arc::new(Mutex::new(rx));
        let discard = Arc::new(AtomicBool::new(false));
        let threads = engines
            .into_iter()
            .enumerate()
            .map(|(i, engine)| {
                let (rx, discard) = (rx.clone(), discard.clone());
                std::thread::Builder::new().name(format!("toolgate-api-{i}")).spawn(move || run(engine, &rx, &discard))
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Self { tx: Mutex::new(Some(tx)), threads: Mutex::new(threads), discard })
    }

    /// Queues `f` for the next free engine; its answer comes on the receiver.
    pub fn submit<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Engine) -> T + Send + 'static,
    ) -> Result<tokio::sync::oneshot::Receiver<T>, Refused> {
        let (done, answer) = tokio::sync::oneshot::channel();
        let job: Job = Box::new(move |engine: &mut Engine| {
            // The caller may have gone (a closed connection): the work is done
            // and recorded in the ledger either way.
            let _ = done.send(f(engine));
        });
        let guard = self.tx.lock().map_err(|_| Refused::Closed)?;
        let Some(tx) = guard.as_ref() else { return Err(Refused::Closed) };
        match tx.try_send(job) {
            Ok(()) => Ok(answer),
            Err(TrySendError::Full(_)) => Err(Refused::Busy),
            Err(TrySendError::Disconnected(_)) => Err(Refused::Closed),
        }
    }

    /// Stops taking jobs and drops the queued ones unstarted; the running
    /// ones go on (see [`Pool::close_within`]).
    pub fn discard_queued(&self) {
        self.discard.store(true, Ordering::SeqCst);
        if let Ok(mut tx) = self.tx.lock() {
            tx.take();
        }
    }

    /// Stops taking jobs and waits at most `limit` for the threads; `false`
    /// when some job was still running then (its thread is left to the
    /// process's exit).
    pub fn close_within(&self, limit: Duration) -> bool {
        if let Ok(mut tx) = self.tx.lock() {
            tx.take();
        }
        let end = Instant::now() + limit;
        let mut threads = self.threads.lock().map(|mut t| std::mem::take(&mut *t)).unwrap_or_default();
        while !threads.iter().all(JoinHandle::is_finished) {
            if Instant::now() >= end {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        for t in threads.drain(..) {
            let _ = t.join();
        }
        true
    }

    /// Stops taking jobs, lets the queued and running ones finish, and waits
    /// for the threads.
    pub fn close(&self) {
        if let Ok(mut tx) = self.tx.lock() {
            tx.take();
        }
        let threads = self.threads.lock().map(|mut t| std::mem::take(&mut *t)).unwrap_or_default();
        for t in threads {
            let _ = t.join();
        }
    }
}

fn run(mut engine: Engine, rx: &Mutex<Receiver<Job>>, discard: &AtomicBool) {
    loop {
        // The lock is held only while waiting for the next job, never while running it.
        let job = match rx.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => return,
        };
        let Ok(job) = job else { return };
        if discard.load(Ordering::SeqCst) {
            // Shutting down: a job not started is not started now.
            continue;
        }
        // A job that panics (a bug) answers nothing (its caller sees INTERNAL);
        // the thread and its engine keep serving.
        if std::panic::catch_unwind(AssertUnwindSafe(|| job(&mut engine))).is_err() {
            tracing::error!("an API job panicked");
        }
    }
}
