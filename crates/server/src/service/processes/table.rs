//! The registry of processes, by id (what the server's state holds, and
//! what the lifecycle tells when a sandbox pauses, fails to pause or goes),
//! and its entries: each process with its output, input offset, end and
//! link to the host.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use runtime_api::codes;
use runtime_host::{ExecControl, RunAs, TermSize};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};

use crate::domain::process::{Exit, Output, TracedFiles};
use crate::domain::time::iso;
use crate::error::{ApiError, ApiResult};
use crate::service::clock::Clock;
use crate::store::{ProcEnd, Store};
use crate::AppState;

/// The processes the server knows, running or ended (until forgotten).
pub(crate) struct Table {
    /// By sandbox and process id: the copies of a sandbox carry its
    /// processes under their ids.
    map: Mutex<HashMap<(String, String), Arc<Proc>>>,
    clock: Clock,
}

impl Table {
    /// An empty table that reads the time from `clock`.
    pub(crate) fn new(clock: Clock) -> Self {
        Table {
            map: Mutex::new(HashMap::new()),
            clock,
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<(String, String), Arc<Proc>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn insert(&self, p: Arc<Proc>) {
        self.lock().insert((p.sandbox_id.clone(), p.id.clone()), p);
    }

    /// The process `pid` of the sandbox (404 `process_not_found` otherwise).
    pub(super) fn get(&self, sandbox_id: &str, pid: &str) -> ApiResult<Arc<Proc>> {
        match self.lock().get(&(sandbox_id.to_string(), pid.to_string())) {
            Some(p) => Ok(p.clone()),
            None => Err(ApiError::NotFound {
                code: codes::PROCESS_NOT_FOUND,
                what: "process",
                id: pid.to_string(),
            }),
        }
    }

    pub(super) fn of(&self, sandbox_id: &str) -> Vec<Arc<Proc>> {
        self.lock()
            .values()
            .filter(|p| p.sandbox_id == sandbox_id)
            .cloned()
            .collect()
    }

    /// The sandbox stopped or was deleted: its processes go, records too.
    pub(crate) fn sandbox_gone(&self, store: &Store, sandbox_id: &str) {
        for p in self.of(sandbox_id) {
            // Nothing pumps a detached process: end it for its followers.
            if p.detached() {
                p.lose(store, self.clock.now_ms());
                p.bump();
            }
        }
        self.lock().retain(|_, p| p.sandbox_id != sandbox_id);
        if let Err(e) = store.delete_processes_of(sandbox_id) {
            tracing::error!(sandbox_id, error = %e, "deleting the process records failed");
        }
    }

    /// Whether a process of the sandbox still runs (it is then not idle).
    pub(crate) fn running_in(&self, sandbox_id: &str) -> bool {
        self.lock()
            .values()
            .any(|p| p.sandbox_id == sandbox_id && p.state().exit.is_none())
    }

    /// The sandbox is about to pause: its running processes detach when
    /// their handles close, instead of ending as `lost`.
    pub(crate) fn sandbox_pausing(&self, sandbox_id: &str) {
        for p in self.of(sandbox_id) {
            let mut s = p.state();
            if s.exit.is_none() && s.link == Link::Attached {
                s.link = Link::Detaching;
            }
        }
    }

    /// The pause failed and the machine runs on: handles still open stay
    /// in use; the caller takes up those that closed with
    /// [`reattach`](super::recover::reattach).
    pub(crate) fn pause_failed(&self, sandbox_id: &str) {
        for p in self.of(sandbox_id) {
            let mut s = p.state();
            if s.link == Link::Detaching {
                s.link = Link::Attached;
            }
        }
    }

    /// Makes room for one more process of the sandbox within `max`: the
    /// ended ones go first, oldest first (records too); `Err(running)`
    /// when the running ones alone fill it.
    pub(crate) fn make_room(&self, store: &Store, sandbox_id: &str, max: u64) -> Result<(), u64> {
        let mut gone = Vec::new();
        let full = {
            let mut m = self.lock();
            let mine: Vec<&Arc<Proc>> = m.values().filter(|p| p.sandbox_id == sandbox_id).collect();
            let count = mine.len() as u64;
            let mut ended: Vec<(i64, String)> = mine
                .iter()
                .filter_map(|p| p.state().ended_ms.map(|t| (t, p.id.clone())))
                .collect();
            let key = |id: String| (sandbox_id.to_string(), id);
            let running = count - ended.len() as u64;
            if running >= max {
                Some(running)
            } else {
                ended.sort();
                let excess = (count + 1).saturating_sub(max) as usize;
                for (_, id) in ended.into_iter().take(excess) {
                    m.remove(&key(id.clone()));
                    gone.push(key(id));
                }
                None
            }
        };
        for (sandbox_id, id) in gone {
            if let Err(e) = store.delete_process(&sandbox_id, &id) {
                tracing::error!(process_id = %id, error = %e, "deleting the process record failed");
            }
        }
        full.map_or(Ok(()), Err)
    }

    /// Forgets processes that ended longer than `keep` ago, records too.
    pub(crate) fn forget_old(&self, store: &Store, keep: Duration) {
        let cutoff = self.clock.now_ms() - keep.as_millis() as i64;
        let mut gone = Vec::new();
        self.lock().retain(|key, p| {
            let keep = p.state().ended_ms.is_none_or(|t| t > cutoff);
            if !keep {
                gone.push(key.clone());
            }
            keep
        });
        for (sandbox_id, id) in gone {
            if let Err(e) = store.delete_process(&sandbox_id, &id) {
                tracing::error!(process_id = %id, error = %e, "deleting the process record failed");
            }
        }
    }
}

/// How the server is linked to a running process.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Link {
    /// A pump moves its events.
    Attached,
    /// A pause is under way: when its handle closes it detaches.
    Detaching,
    /// Paused: no handle until a wake takes it up again.
    Detached,
}

/// What changes while a process runs.
pub(super) struct ProcState {
    pub(super) out: Output,
    pub(super) exit: Option<Exit>,
    pub(super) ended_ms: Option<i64>,
    pub(super) stdin_offset: u64,
    pub(super) stdin_closed: bool,
    /// The output count last written to the store.
    pub(super) persisted: u64,
    pub(super) link: Link,
    /// Bumped at every attach: a pump of an older handle stops.
    pub(super) generation: u64,
}

impl ProcState {
    pub(super) fn new(
        st: &AppState,
        output_bytes: u64,
        stdin_offset: u64,
        stdin_closed: bool,
    ) -> Self {
        ProcState {
            out: Output::new(st.config().output_buffer_bytes, output_bytes),
            exit: None,
            ended_ms: None,
            stdin_offset,
            stdin_closed,
            persisted: output_bytes,
            link: Link::Attached,
            generation: 0,
        }
    }
}

/// One process of a sandbox, running or ended.
pub(crate) struct Proc {
    pub(super) id: String,
    pub(super) sandbox_id: String,
    pub(super) command: String,
    pub(super) argv: Vec<String>,
    /// Where it runs.
    pub(super) cwd: String,
    /// Its sandbox's memory, for an out-of-memory report.
    pub(super) memory_mib: u32,
    pub(super) user: RunAs,
    pub(super) guest_pid: u32,
    pub(super) pty: bool,
    pub(super) stdin_pipe: bool,
    pub(super) base64_always: bool,
    /// Started with `traceFiles` (in memory only: a process taken up after
    /// a restart of the server counts as not traced).
    pub(super) traced: bool,
    pub(super) started_ms: i64,
    /// Names the process to the host for [`Host::attach`](runtime_host::Host::attach).
    pub(super) token: u64,
    pub(super) state: Mutex<ProcState>,
    pub(super) changed: watch::Sender<u64>,
    /// Replaced when the process is taken up again after a pause.
    pub(super) control: Mutex<mpsc::Sender<ExecControl>>,
    /// Serializes `:write` calls so offsets stay exact.
    pub(super) writes: tokio::sync::Mutex<()>,
}

impl Proc {
    pub(super) fn state(&self) -> MutexGuard<'_, ProcState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn control(&self) -> mpsc::Sender<ExecControl> {
        self.control
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Detached by a pause (or about to be): no handle delivers its events.
    pub(super) fn detached(&self) -> bool {
        let s = self.state();
        s.exit.is_none() && s.link != Link::Attached
    }

    pub(super) fn bump(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// `false` when a newer handle took over (the caller stops).
    pub(super) fn ingest(&self, generation: u64, stderr: bool, bytes: Vec<u8>) -> bool {
        let mut s = self.state();
        if s.generation != generation {
            return false;
        }
        s.out.ingest(stderr, &bytes);
        true
    }

    /// Records the end at `now`, in memory and in the store. A traced
    /// process whose files were not reported (lost) has an empty,
    /// `truncated` trace.
    pub(super) fn finish(&self, store: &Store, now: i64, mut exit: Exit) {
        if self.traced && exit.files.is_none() {
            exit.files = Some(Arc::new(TracedFiles {
                truncated: true,
                ..TracedFiles::default()
            }));
        }
        let end = {
            let mut s = self.state();
            if s.exit.is_some() {
                return;
            }
            s.out.close();
            let end = ProcEnd {
                state: exit.state(),
                exit_code: exit.code,
                signal: exit.signal,
                timed_out: exit.timed_out,
                oom_kills: exit.oom_kills,
                duration_ms: exit.duration_ms,
                ended_ms: now,
                output_bytes: s.out.end(),
            };
            s.exit = Some(exit);
            s.ended_ms = Some(now);
            s.persisted = s.out.end();
            end
        };
        if let Err(e) = store.process_ended(&self.sandbox_id, &self.id, &end) {
            tracing::error!(process_id = %self.id, error = %e, "recording the process's end failed");
        }
    }

    /// Ends it as `lost` at `now`.
    pub(super) fn lose(&self, store: &Store, now: i64) {
        let ran = (now - self.started_ms).max(0) as u64;
        self.finish(store, now, Exit::lost(ran));
    }

    /// Writes the output count to the store if it changed since last time.
    pub(super) fn flush_output(&self, store: &Store) {
        let end = {
            let mut s = self.state();
            if s.exit.is_some() || s.persisted == s.out.end() {
                return;
            }
            s.persisted = s.out.end();
            s.out.end()
        };
        if let Err(e) = store.process_output(&self.sandbox_id, &self.id, end) {
            tracing::error!(process_id = %self.id, error = %e, "recording the process's output count failed");
        }
    }

    /// Text chunks from `cursor` on, the new cursor, and whether the
    /// process has ended with all its output read.
    pub(super) fn chunks_from(&self, cursor: u64) -> (Vec<Value>, u64, bool) {
        let s = self.state();
        let read = s.out.buf().read(cursor);
        let done = read.cursor >= s.out.end() && s.exit.is_some();
        (read.chunks(), read.cursor, done)
    }

    /// Events from `cursor` on, the new cursor, and the exit once all output is read.
    pub(super) fn read_from(&self, cursor: u64) -> (Vec<Value>, u64, Option<Exit>) {
        let s = self.state();
        let read = s.out.buf().read(cursor);
        let exit = if read.cursor >= s.out.end() {
            s.exit.clone()
        } else {
            None
        };
        (read.events(self.base64_always), read.cursor, exit)
    }

    /// The process as listed.
    pub(crate) fn info(&self) -> Value {
        let s = self.state();
        let (state, code, timed_out, duration, signal) = match &s.exit {
            None => ("running", None, false, None, None),
            Some(e) => (
                e.state(),
                e.code,
                e.timed_out,
                Some(e.duration_ms),
                e.signal,
            ),
        };
        json!({
            "id": self.id,
            "sandboxId": self.sandbox_id,
            "command": self.command,
            "argv": self.argv,
            "cwd": self.cwd,
            "user": user_name(self.user),
            "pid": self.guest_pid,
            "state": state,
            "exitCode": code,
            "signal": signal,
            "timedOut": timed_out,
            "durationMs": duration,
            "startedAt": iso(self.started_ms),
            "endedAt": s.ended_ms.map(iso),
            "stdinOffset": s.stdin_offset,
            "stdinOpen": self.stdin_pipe && !s.stdin_closed && s.exit.is_none(),
            "pty": self.pty,
            "outputEncoding": if self.base64_always { "base64" } else { "utf8" },
            "traceFiles": self.traced,
            "outputBytes": s.out.end(),
        })
    }

    pub(crate) fn id(&self) -> &str {
        &self.id
    }

    pub(crate) fn is_pty(&self) -> bool {
        self.pty
    }

    pub(crate) fn exited(&self) -> bool {
        self.state().exit.is_some()
    }

    /// Output bytes from `cursor` on (stdout and stderr in order), the new
    /// cursor, and the exit code once everything was read (`Some(None)`
    /// when it ended without one).
    pub(crate) fn read_raw(&self, cursor: u64) -> (Vec<u8>, u64, Option<Option<i32>>) {
        let s = self.state();
        let (out, cursor) = s.out.buf().read_raw(cursor);
        let exit = (cursor >= s.out.end())
            .then(|| s.exit.as_ref().map(|e| e.code))
            .flatten();
        (out, cursor, exit)
    }

    /// Where kept output starts (a terminal taking up a process replays
    /// from here).
    pub(crate) fn output_start(&self) -> u64 {
        self.state().out.buf().start()
    }

    /// Changes with every event of the process.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    pub(crate) async fn resize(&self, size: TermSize) {
        let _ = self.control().send(ExecControl::Resize(size)).await;
    }

    /// Sends `sig` to a process still running.
    pub(crate) async fn signal(&self, sig: i32) {
        if self.state().exit.is_none() {
            let _ = self.control().send(ExecControl::Signal(sig)).await;
        }
    }
}

pub(super) fn user_name(user: RunAs) -> &'static str {
    if user == RunAs::Root {
        "root"
    } else {
        "sandbox"
    }
}

/// The user a stored or sandbox `user` names.
pub(crate) fn run_as(user: &str) -> RunAs {
    if user == "root" {
        RunAs::Root
    } else {
        RunAs::Sandbox
    }
}
