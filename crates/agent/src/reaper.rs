//! The one reaper: a thread looping on `waitpid(-1)`. It reaps every child,
//! orphans included (as PID 1, or as a child subreaper in tests), and hands
//! the status of a registered pid to whoever waits for it.
//!
//! Forks happen with the reaper's lock held and register their pid before
//! releasing it, so a child that exits at once cannot be reaped before its
//! waiter exists: the reaper blocks on the same lock to dispatch. The lock
//! also keeps forks away from fds that are not yet close-on-exec.

use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use crate::sys::{errno, lock, log};

#[derive(Default)]
pub(crate) struct State {
    waiters: HashMap<i32, mpsc::Sender<i32>>,
    /// Bumped by every fork, so the reaper does not sleep through a new child.
    generation: u64,
}

pub(crate) struct Reaper {
    state: Mutex<State>,
    forked: Condvar,
}

/// Held across a fork. No other thread forks meanwhile.
pub(crate) struct ForkGuard<'a> {
    reaper: &'a Reaper,
    state: MutexGuard<'a, State>,
}

impl ForkGuard<'_> {
    /// Registers a freshly forked child; its raw wait status arrives on the receiver.
    pub(crate) fn register(&mut self, pid: i32) -> mpsc::Receiver<i32> {
        let (tx, rx) = mpsc::channel();
        self.state.waiters.insert(pid, tx);
        self.state.generation += 1;
        self.reaper.forked.notify_all();
        rx
    }
}

impl Reaper {
    pub(crate) fn start() -> Arc<Reaper> {
        let reaper = Arc::new(Reaper {
            state: Mutex::new(State::default()),
            forked: Condvar::new(),
        });
        loop {
            let r = Arc::clone(&reaper);
            match std::thread::Builder::new()
                .name("reaper".into())
                .spawn(move || r.run())
            {
                Ok(_) => return reaper,
                Err(e) => {
                    log!("cannot start the reaper thread: {e}; retrying");
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
    }

    pub(crate) fn fork_lock(&self) -> ForkGuard<'_> {
        ForkGuard {
            reaper: self,
            state: lock(&self.state),
        }
    }

    fn run(&self) {
        loop {
            let generation = lock(&self.state).generation;
            let mut status = 0;
            // SAFETY: plain syscall with a valid out pointer.
            let pid = unsafe { libc::waitpid(-1, &mut status, 0) };
            if pid > 0 {
                if libc::WIFEXITED(status) || libc::WIFSIGNALED(status) {
                    let waiter = lock(&self.state).waiters.remove(&pid);
                    if let Some(tx) = waiter {
                        // The waiter may have given up (a failed exec): fine.
                        let _ = tx.send(status);
                    }
                }
                continue;
            }
            match errno() {
                libc::EINTR => {}
                libc::ECHILD => {
                    let st = lock(&self.state);
                    if st.generation == generation {
                        let _ = self.forked.wait_timeout(st, Duration::from_secs(1));
                    }
                }
                e => {
                    log!("waitpid failed: errno {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }
}
