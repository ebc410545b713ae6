//! Threads kept for reuse by commands (the thread that runs one, and the
//! ones that copy its output). Creating a thread costs about 4 ms in a
//! guest under emulation, and a command used three; a pooled one is handed
//! its work at once.
//!
//! Only work that leaves the thread as it found it runs here: a command's
//! threads never change their credentials (its child does, after the
//! fork). File operations switch their thread's user and keep their own
//! threads (agent.rs).

use std::sync::mpsc;
use std::sync::Mutex;
use std::time::Duration;

use crate::sys::lock;

/// The work, and where to say that it ended (after its thread is idle
/// again, so work given right after the end finds it).
type Job = (Box<dyn FnOnce() + Send + 'static>, mpsc::SyncSender<()>);

/// Most threads kept idle; one more ends after its work.
const MAX_IDLE: usize = 32;
/// An idle thread nobody took for this long ends.
const KEEP: Duration = Duration::from_secs(60);

/// The idle threads, each waiting on its own rendezvous channel (a send
/// succeeds only if that thread takes the work: one that has just given
/// up answers with the work back).
static IDLE: Mutex<Vec<mpsc::SyncSender<Job>>> = Mutex::new(Vec::new());

/// Waits for the end of one piece of work.
pub(crate) struct Done(mpsc::Receiver<()>);

impl Done {
    /// Returns once the work has ended (or its thread died).
    pub(crate) fn join(self) {
        let _ = self.0.recv();
    }
}

/// Runs `f` on an idle thread, or on a new one; `Err` only when no thread
/// could be created.
pub(crate) fn run(f: impl FnOnce() + Send + 'static) -> std::io::Result<Done> {
    let (done_tx, done_rx) = mpsc::sync_channel(1);
    let mut job: Job = (Box::new(f), done_tx);
    loop {
        let Some(worker) = lock(&IDLE).pop() else {
            break;
        };
        match worker.send(job) {
            Ok(()) => return Ok(Done(done_rx)),
            // That thread ended meanwhile: the next one.
            Err(mpsc::SendError(back)) => job = back,
        }
    }
    let (tx, rx) = mpsc::sync_channel::<Job>(0);
    std::thread::Builder::new()
        .name("worker".into())
        .spawn(move || work(job, tx, rx))?;
    Ok(Done(done_rx))
}

fn work(mut job: Job, tx: mpsc::SyncSender<Job>, rx: mpsc::Receiver<Job>) {
    loop {
        let (f, done) = job;
        f();
        let kept = {
            let mut idle = lock(&IDLE);
            let room = idle.len() < MAX_IDLE;
            if room {
                idle.push(tx.clone());
            }
            room
        };
        let _ = done.send(());
        if !kept {
            return;
        }
        match rx.recv_timeout(KEEP) {
            Ok(next) => job = next,
            // Its sender stays in the list until someone tries it and
            // gets the work back.
            Err(_) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[test]
    fn work_runs_once_each_and_threads_are_reused() {
        let count = Arc::new(AtomicUsize::new(0));
        let names = Arc::new(Mutex::new(std::collections::HashSet::new()));
        for _ in 0..50 {
            let (count, names) = (Arc::clone(&count), Arc::clone(&names));
            run(move || {
                count.fetch_add(1, Ordering::SeqCst);
                lock(&names).insert(std::thread::current().id());
            })
            .unwrap()
            .join();
        }
        assert_eq!(count.load(Ordering::SeqCst), 50);
        // One after the other: far fewer threads than pieces of work.
        assert!(lock(&names).len() <= 3, "{}", lock(&names).len());

        // At once: each runs, none is lost.
        let all: Vec<Done> = (0..40)
            .map(|_| {
                let count = Arc::clone(&count);
                run(move || {
                    std::thread::sleep(Duration::from_millis(20));
                    count.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap()
            })
            .collect();
        for d in all {
            d.join();
        }
        assert_eq!(count.load(Ordering::SeqCst), 90);
        assert!(lock(&IDLE).len() <= MAX_IDLE);
    }
}
