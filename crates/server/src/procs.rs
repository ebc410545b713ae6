//! Exec and background processes (contract §6).
//!
//! Every exec and spawn is a process in an in-memory table. A pump task
//! moves the host's events into a bounded buffer (1 MiB, with offsets
//! counting stdout and stderr together) that readers follow from a cursor,
//! and into the first 64 KiB per stream for the JSON answer. Offsets are
//! assigned when bytes enter the buffer, after an incomplete UTF-8 tail was
//! held back, so every chunk is whole characters unless the bytes are not
//! UTF-8 at all (then events also carry `base64`).
//!
//! Each process is also a row in the store (its record, the host's token,
//! and how many output bytes it produced, written at most every second and
//! at its end), so a restart of the server takes the processes of recovered
//! sandboxes up again through [`Host::attach`](runtime_host::Host::attach):
//! their offsets go on from the stored count, the bytes produced while no
//! server listened are reported as `truncated`, and what ended stays
//! queryable (without its output).
//!
//! A pause keeps processes: before the host pauses, each running process is
//! marked `Detaching`; its pump moves what the old handle still delivers and,
//! when that handle closes, the process becomes `Detached` (still `running`).
//! Followers then end their stream with `continue {processId, cursor}`; the
//! client resumes through the output endpoint, which auto-wakes the sandbox.
//! Every wake (and a failed pause) takes the detached processes up again
//! through [`Host::attach`](runtime_host::Host::attach), whose events go on
//! exactly where the old handle's ended, so offsets continue with no gap;
//! an attach that fails ends the process as `lost`. An unstreamed exec in
//! flight keeps waiting across the pause and answers after the wake.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue};
use axum::response::Response;
use base64::Engine;
use runtime_api::{codes, ExecResult};
use runtime_host::{ExecControl, ExecEvent, ExecHandle, ExecSpec, ExitStatus, RunAs, TermSize};
use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::domain::lifecycle::SandboxState;
use crate::domain::time::iso;
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{json_object, query_object, Fields};
use crate::http::{Ctx, Reply};
use crate::service::clock::now_ms;
use crate::service::network::secret_env;
use crate::service::sandboxes::{find, find_running};
use crate::store::{ProcEnd, ProcRow, SandboxRow, Store};
use crate::AppState;

/// Kept per stream for the JSON answer of an unstreamed exec.
pub const JSON_KEEP: usize = 64 * 1024;
const DEFAULT_EXEC_TIMEOUT_MS: i64 = 60_000;
const MAX_TIMEOUT_MS: i64 = 86_400_000;

#[derive(Default)]
pub struct Table {
    map: Mutex<HashMap<String, Arc<Proc>>>,
}

impl Table {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Arc<Proc>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn get(&self, sandbox_id: &str, pid: &str) -> ApiResult<Arc<Proc>> {
        match self.lock().get(pid) {
            Some(p) if p.sandbox_id == sandbox_id => Ok(p.clone()),
            _ => Err(ApiError::NotFound {
                code: codes::PROCESS_NOT_FOUND,
                what: "process",
                id: pid.to_string(),
            }),
        }
    }

    /// The sandbox stopped or was deleted: its processes go, records too.
    pub fn sandbox_gone(&self, store: &Store, sandbox_id: &str) {
        for p in self.of(sandbox_id) {
            // Nothing pumps a detached process: end it for its followers.
            let detached = {
                let s = p.state();
                s.exit.is_none() && s.link != Link::Attached
            };
            if detached {
                p.finish(store, p.lost_status(), true);
                p.bump();
            }
        }
        self.lock().retain(|_, p| p.sandbox_id != sandbox_id);
        if let Err(e) = store.delete_processes_of(sandbox_id) {
            tracing::error!(sandbox_id, error = %e, "deleting the process records failed");
        }
    }

    /// Whether a process of the sandbox still runs (it is then not idle).
    pub fn running_in(&self, sandbox_id: &str) -> bool {
        self.lock()
            .values()
            .any(|p| p.sandbox_id == sandbox_id && p.state().exit.is_none())
    }

    fn of(&self, sandbox_id: &str) -> Vec<Arc<Proc>> {
        self.lock()
            .values()
            .filter(|p| p.sandbox_id == sandbox_id)
            .cloned()
            .collect()
    }

    /// The sandbox is about to pause: its running processes detach when
    /// their handles close, instead of ending as `lost`.
    pub fn sandbox_pausing(&self, sandbox_id: &str) {
        for p in self.of(sandbox_id) {
            let mut s = p.state();
            if s.exit.is_none() && s.link == Link::Attached {
                s.link = Link::Detaching;
            }
        }
    }

    /// The pause failed and the machine runs on: handles still open stay
    /// in use; the caller takes up those that closed with [`reattach`].
    pub fn pause_failed(&self, sandbox_id: &str) {
        for p in self.of(sandbox_id) {
            let mut s = p.state();
            if s.link == Link::Detaching {
                s.link = Link::Attached;
            }
        }
    }

    /// Forgets processes that ended longer than `keep` ago, records too.
    pub fn forget_old(&self, store: &Store, keep: Duration) {
        let cutoff = now_ms() - keep.as_millis() as i64;
        let mut gone = Vec::new();
        self.lock().retain(|id, p| {
            let keep = p.state().ended_ms.is_none_or(|t| t > cutoff);
            if !keep {
                gone.push(id.clone());
            }
            keep
        });
        for id in gone {
            if let Err(e) = store.delete_process(&id) {
                tracing::error!(process_id = %id, error = %e, "deleting the process record failed");
            }
        }
    }
}

struct Chunk {
    offset: u64,
    stderr: bool,
    data: Vec<u8>,
}

/// Output with offsets, keeping the last `cap` bytes.
struct OutBuf {
    chunks: VecDeque<Chunk>,
    start: u64,
    end: u64,
    size: usize,
    cap: usize,
}

impl OutBuf {
    fn push(&mut self, stderr: bool, data: Vec<u8>) {
        let len = data.len();
        self.chunks.push_back(Chunk {
            offset: self.end,
            stderr,
            data,
        });
        self.end += len as u64;
        self.size += len;
        while self.size > self.cap {
            let excess = self.size - self.cap;
            let Some(front) = self.chunks.front_mut() else {
                break;
            };
            if front.data.len() <= excess {
                self.size -= front.data.len();
                self.chunks.pop_front();
            } else {
                front.data.drain(..excess);
                front.offset += excess as u64;
                self.size -= excess;
            }
        }
        self.start = self.chunks.front().map_or(self.end, |c| c.offset);
    }
}

#[derive(Default)]
struct Kept {
    data: Vec<u8>,
    total: u64,
}

impl Kept {
    fn add(&mut self, b: &[u8]) {
        let room = JSON_KEEP.saturating_sub(self.data.len());
        self.data.extend_from_slice(&b[..room.min(b.len())]);
        self.total += b.len() as u64;
    }

    fn truncated(&self) -> bool {
        self.total > self.data.len() as u64
    }

    /// The kept bytes as text, cut at a character boundary when truncated.
    fn text(&self) -> String {
        let mut d = &self.data[..];
        if self.truncated() {
            d = &d[..d.len() - incomplete_tail(d)];
        }
        String::from_utf8_lossy(d).into_owned()
    }
}

/// How the server is linked to a running process.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Link {
    /// A pump moves its events.
    Attached,
    /// A pause is under way: when its handle closes it detaches.
    Detaching,
    /// Paused: no handle until a wake takes it up again.
    Detached,
}

#[derive(Clone)]
struct Exit {
    status: ExitStatus,
    lost: bool,
}

struct ProcState {
    buf: OutBuf,
    carry: [Vec<u8>; 2],
    kept: [Kept; 2],
    exit: Option<Exit>,
    ended_ms: Option<i64>,
    stdin_offset: u64,
    stdin_closed: bool,
    /// The output count last written to the store.
    persisted: u64,
    link: Link,
    /// Bumped at every attach: a pump of an older handle stops.
    generation: u64,
}

pub struct Proc {
    id: String,
    sandbox_id: String,
    command: String,
    argv: Vec<String>,
    user: RunAs,
    guest_pid: u32,
    pty: bool,
    stdin_pipe: bool,
    base64_always: bool,
    started_ms: i64,
    /// Names the process to the host for [`Host::attach`](runtime_host::Host::attach).
    token: u64,
    state: Mutex<ProcState>,
    changed: watch::Sender<u64>,
    /// Replaced when the process is taken up again after a pause.
    control: Mutex<mpsc::Sender<ExecControl>>,
    /// Serializes `:write` calls so offsets stay exact.
    writes: tokio::sync::Mutex<()>,
}

/// Bytes at the end of `d` that start a UTF-8 character not yet complete.
fn incomplete_tail(d: &[u8]) -> usize {
    for k in 1..=3.min(d.len()) {
        let b = d[d.len() - k];
        if b & 0xC0 == 0x80 {
            continue; // continuation byte: look further back
        }
        let need = match b {
            0xC0..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF7 => 4,
            _ => return 0,
        };
        return if need > k { k } else { 0 };
    }
    0
}

impl Proc {
    fn state(&self) -> MutexGuard<'_, ProcState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn control(&self) -> mpsc::Sender<ExecControl> {
        self.control
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Detached by a pause (or about to be): no handle delivers its events.
    fn detached(&self) -> bool {
        let s = self.state();
        s.exit.is_none() && s.link != Link::Attached
    }

    fn bump(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// `false` when a newer handle took over (the caller stops).
    fn ingest(&self, generation: u64, stderr: bool, bytes: Vec<u8>) -> bool {
        let mut s = self.state();
        if s.generation != generation {
            return false;
        }
        let i = usize::from(stderr);
        s.kept[i].add(&bytes);
        let mut data = std::mem::take(&mut s.carry[i]);
        data.extend_from_slice(&bytes);
        let keep = incomplete_tail(&data);
        s.carry[i] = data.split_off(data.len() - keep);
        if !data.is_empty() {
            s.buf.push(stderr, data);
        }
        true
    }

    /// Records the end, in memory and in the store.
    fn finish(&self, store: &Store, status: ExitStatus, lost: bool) {
        let end = {
            let mut s = self.state();
            if s.exit.is_some() {
                return;
            }
            for i in 0..2 {
                let rest = std::mem::take(&mut s.carry[i]);
                if !rest.is_empty() {
                    s.buf.push(i == 1, rest);
                }
            }
            let ended_ms = now_ms();
            let end = ProcEnd {
                state: if lost { "lost" } else { "exited" },
                exit_code: status.code,
                signal: status.signal,
                timed_out: status.timed_out,
                out_of_memory: status.out_of_memory,
                duration_ms: status.duration_ms,
                ended_ms,
                output_bytes: s.buf.end,
            };
            s.exit = Some(Exit { status, lost });
            s.ended_ms = Some(ended_ms);
            s.persisted = s.buf.end;
            end
        };
        if let Err(e) = store.process_ended(&self.id, &end) {
            tracing::error!(process_id = %self.id, error = %e, "recording the process's end failed");
        }
    }

    /// Writes the output count to the store if it changed since last time.
    fn flush_output(&self, store: &Store) {
        let end = {
            let mut s = self.state();
            if s.exit.is_some() || s.persisted == s.buf.end {
                return;
            }
            s.persisted = s.buf.end;
            s.buf.end
        };
        if let Err(e) = store.process_output(&self.id, end) {
            tracing::error!(process_id = %self.id, error = %e, "recording the process's output count failed");
        }
    }

    fn lost_status(&self) -> ExitStatus {
        ExitStatus {
            code: None,
            signal: None,
            timed_out: false,
            duration_ms: (now_ms() - self.started_ms).max(0) as u64,
            out_of_memory: false,
        }
    }

    /// Events from `cursor` on, the new cursor, and the exit once all output is read.
    fn read_from(&self, mut cursor: u64) -> (Vec<Value>, u64, Option<Exit>) {
        let s = self.state();
        let mut events = Vec::new();
        if cursor < s.buf.start {
            events.push(json!({"type": "truncated", "droppedBytes": s.buf.start - cursor, "resumeAt": s.buf.start}));
            cursor = s.buf.start;
        }
        for c in &s.buf.chunks {
            let end = c.offset + c.data.len() as u64;
            if end <= cursor {
                continue;
            }
            let skip = cursor.saturating_sub(c.offset) as usize;
            let bytes = &c.data[skip..];
            let mut ev = Map::new();
            ev.insert(
                "type".into(),
                json!(if c.stderr { "stderr" } else { "stdout" }),
            );
            ev.insert("offset".into(), json!(c.offset + skip as u64));
            match std::str::from_utf8(bytes) {
                Ok(text) => {
                    ev.insert("data".into(), json!(text));
                    if self.base64_always {
                        ev.insert("base64".into(), json!(b64(bytes)));
                    }
                }
                Err(_) => {
                    ev.insert("data".into(), json!(String::from_utf8_lossy(bytes)));
                    ev.insert("base64".into(), json!(b64(bytes)));
                }
            }
            events.push(Value::Object(ev));
            cursor = end;
        }
        let exit = if cursor >= s.buf.end {
            s.exit.clone()
        } else {
            None
        };
        (events, cursor, exit)
    }

    fn info(&self) -> Value {
        let s = self.state();
        let (state, code, timed_out, duration, signal) = match &s.exit {
            None => ("running", None, false, None, None),
            Some(e) => (
                if e.lost { "lost" } else { "exited" },
                e.status.code,
                e.status.timed_out,
                Some(e.status.duration_ms),
                e.status.signal,
            ),
        };
        json!({
            "id": self.id,
            "sandboxId": self.sandbox_id,
            "command": self.command,
            "argv": self.argv,
            "user": if self.user == RunAs::Root { "root" } else { "sandbox" },
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
            "outputBytes": s.buf.end,
        })
    }
}

fn b64(b: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(b)
}

fn exit_event(e: &Exit) -> Value {
    let mut v = json!({
        "type": "exit",
        "exitCode": e.status.code,
        "state": if e.lost { "lost" } else { "exited" },
        "timedOut": e.status.timed_out,
        "durationMs": e.status.duration_ms,
    });
    if e.status.out_of_memory {
        v["outOfMemory"] = json!({});
    }
    v
}

/// What exec and spawn both take.
/// What a terminal (a WebSocket on a pty process) needs of a process.
impl Proc {
    pub(crate) fn id(&self) -> &str {
        &self.id
    }

    pub(crate) fn is_pty(&self) -> bool {
        self.pty
    }

    /// Output bytes from `cursor` on (stdout and stderr in order), the new
    /// cursor, and the exit code once everything was read (`Some(None)`
    /// when it ended without one).
    pub(crate) fn read_raw(&self, cursor: u64) -> (Vec<u8>, u64, Option<Option<i32>>) {
        let s = self.state();
        let mut cursor = cursor.max(s.buf.start);
        let mut out = Vec::new();
        for c in &s.buf.chunks {
            let end = c.offset + c.data.len() as u64;
            if end <= cursor {
                continue;
            }
            let skip = cursor.saturating_sub(c.offset) as usize;
            out.extend_from_slice(&c.data[skip..]);
            cursor = end;
        }
        let exit = (cursor >= s.buf.end)
            .then(|| s.exit.as_ref().map(|e| e.status.code))
            .flatten();
        (out, cursor, exit)
    }

    /// Where output now ends (a terminal taking up a process starts here,
    /// less what it replays).
    pub(crate) fn output_start(&self) -> u64 {
        self.state().buf.start
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// Sends input at the current offset; `false` once the process ended.
    pub(crate) async fn type_in(&self, store: &Store, bytes: Vec<u8>) -> bool {
        let _w = self.writes.lock().await;
        if self.state().exit.is_some() || self.state().stdin_closed {
            return false;
        }
        let n = bytes.len() as u64;
        if self
            .control()
            .send(ExecControl::Stdin(bytes))
            .await
            .is_err()
        {
            return false;
        }
        let offset = {
            let mut s = self.state();
            s.stdin_offset += n;
            s.stdin_offset
        };
        if let Err(e) = store.process_stdin(&self.id, offset, false) {
            tracing::error!(process_id = %self.id, error = %e, "recording the process's input failed");
        }
        true
    }

    pub(crate) async fn resize(&self, size: TermSize) {
        let _ = self.control().send(ExecControl::Resize(size)).await;
    }

    pub(crate) async fn signal(&self, sig: i32) {
        if self.state().exit.is_none() {
            let _ = self.control().send(ExecControl::Signal(sig)).await;
        }
    }

    pub(crate) fn exited(&self) -> bool {
        self.state().exit.is_some()
    }
}

/// Starts a process on a pseudo-terminal with its input open, as a terminal
/// WebSocket does; it is listed with the sandbox's processes.
pub(crate) async fn start_terminal(
    st: &AppState,
    row: &SandboxRow,
    argv: Vec<String>,
    cwd: Option<String>,
    user: RunAs,
    size: TermSize,
) -> ApiResult<Arc<Proc>> {
    let mut env = secret_env(st, &row.record.id);
    env.extend(row.env.iter().cloned());
    env.push(("TERM".into(), "xterm-256color".into()));
    let command = argv.join(" ");
    let req = CommandReq {
        spec: ExecSpec {
            argv,
            cwd,
            env,
            user,
            timeout: None,
            stdin: true,
            pty: Some(size),
            kill_group_on_exit: false,
        },
        command,
        stdin_data: None,
        stream: false,
        base64_always: false,
        kind: "spawn",
    };
    start(st, row, req, true).await
}

/// Starts a background process (as `spawn` does, input closed), e.g. an
/// image's `start` command in a new sandbox of that image.
pub(crate) async fn start_background(
    st: &AppState,
    row: &SandboxRow,
    argv: Vec<String>,
    cwd: Option<String>,
    user: RunAs,
) -> ApiResult<Arc<Proc>> {
    let mut env = secret_env(st, &row.record.id);
    env.extend(row.env.iter().cloned());
    let command = argv.join(" ");
    let req = CommandReq {
        spec: ExecSpec {
            argv,
            cwd,
            env,
            user,
            timeout: None,
            stdin: false,
            pty: None,
            kill_group_on_exit: false,
        },
        command,
        stdin_data: None,
        stream: false,
        base64_always: false,
        kind: "spawn",
    };
    start(st, row, req, false).await
}

/// A process of the sandbox by id.
pub(crate) fn process(st: &AppState, sandbox_id: &str, pid: &str) -> ApiResult<Arc<Proc>> {
    st.inner.procs.get(sandbox_id, pid)
}

struct CommandReq {
    spec: ExecSpec,
    command: String,
    stdin_data: Option<Vec<u8>>,
    stream: bool,
    base64_always: bool,
    /// `exec` or `spawn`.
    kind: &'static str,
}

fn parse_command(
    row: &SandboxRow,
    secret_env: Vec<(String, String)>,
    body: &[u8],
    spawn: bool,
) -> ApiResult<CommandReq> {
    let obj = json_object(body)?;
    let mut f = Fields::new(&obj);
    let command = f.string("command");
    let argv = match f.raw("argv") {
        None => None,
        Some(Value::Array(a)) if !a.is_empty() && a.iter().all(Value::is_string) => Some(
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect::<Vec<_>>(),
        ),
        Some(_) => {
            f.issue("argv", "must be a non-empty array of strings");
            None
        }
    };
    let argv = match (command, argv) {
        (Some(c), None) => vec!["bash".to_string(), "-c".to_string(), c],
        (None, Some(a)) => a,
        (Some(_), Some(_)) => {
            f.issue("argv", "give command or argv, not both");
            Vec::new()
        }
        (None, None) => {
            if !f.present("argv") && !f.present("command") {
                f.issue("command", "command or argv is required");
            }
            Vec::new()
        }
    };
    let cwd = f.string("cwd");
    let env = f.string_map("env", 256).unwrap_or_default();
    let stdin_text = f.string("stdin");
    let stdin_b64 = f.string("stdinBase64");
    let mut stdin_data = None;
    match (stdin_text, stdin_b64) {
        (Some(_), Some(_)) => f.issue("stdinBase64", "give stdin or stdinBase64, not both"),
        (Some(t), None) => stdin_data = Some(t.into_bytes()),
        (None, Some(b)) => match base64::engine::general_purpose::STANDARD.decode(b) {
            Ok(d) => stdin_data = Some(d),
            Err(_) => f.issue("stdinBase64", "is not valid base64"),
        },
        (None, None) => {}
    }
    let timeout_ms = f.int("timeoutMs", 1, MAX_TIMEOUT_MS);
    let user = f
        .one_of("user", &["sandbox", "root"])
        .unwrap_or_else(|| row.record.user.clone());
    if f.bool("traceFiles") == Some(true) {
        f.issue(
            "traceFiles",
            "tracing files is not supported by this server yet",
        );
    }
    let mut stream = false;
    let mut stdin_pipe = false;
    let mut pty = None;
    let mut base64_always = false;
    if spawn {
        stdin_pipe = f.one_of("stdinMode", &["pipe"]).is_some();
        if let Some(p) = f.raw("pty") {
            match p {
                Value::Object(m) => {
                    let mut pf = Fields::new(m);
                    let cols = pf.int("cols", 1, 1000).unwrap_or(80) as u16;
                    let rows = pf.int("rows", 1, 1000).unwrap_or(24) as u16;
                    if let Err(ApiError::Invalid { issues }) = pf.finish() {
                        for i in issues {
                            f.issue(&format!("pty.{}", i.field), i.message);
                        }
                    }
                    pty = Some(TermSize { cols, rows });
                }
                _ => f.issue("pty", "must be an object {cols, rows}"),
            }
        }
        base64_always =
            f.one_of("outputEncoding", &["utf8", "base64"]).as_deref() == Some("base64");
    } else {
        stream = f.bool("stream").unwrap_or(false);
    }
    f.finish()?;
    let timeout_ms = match (timeout_ms, spawn, stream) {
        (Some(t), _, _) => Some(t),
        (None, false, false) => Some(DEFAULT_EXEC_TIMEOUT_MS),
        (None, false, true) => Some(MAX_TIMEOUT_MS),
        (None, true, _) => None,
    };
    let mut merged = secret_env;
    merged.extend(row.env.iter().cloned());
    merged.extend(env);
    let command = argv.join(" ");
    let stdin = stdin_pipe || stdin_data.is_some();
    Ok(CommandReq {
        spec: ExecSpec {
            argv,
            cwd,
            env: merged,
            user: if user == "root" {
                RunAs::Root
            } else {
                RunAs::Sandbox
            },
            timeout: timeout_ms.map(|t| Duration::from_millis(t as u64)),
            stdin,
            pty,
            kill_group_on_exit: !spawn,
        },
        command,
        stdin_data,
        stream,
        base64_always,
        kind: if spawn { "spawn" } else { "exec" },
    })
}

fn new_state(st: &AppState, output_bytes: u64, stdin_offset: u64, stdin_closed: bool) -> ProcState {
    ProcState {
        buf: OutBuf {
            chunks: VecDeque::new(),
            start: output_bytes,
            end: output_bytes,
            size: 0,
            cap: st.config().output_buffer_bytes,
        },
        carry: [Vec::new(), Vec::new()],
        kept: [Kept::default(), Kept::default()],
        exit: None,
        ended_ms: None,
        stdin_offset,
        stdin_closed,
        persisted: output_bytes,
        link: Link::Attached,
        generation: 0,
    }
}

async fn start(
    st: &AppState,
    row: &SandboxRow,
    req: CommandReq,
    stdin_pipe: bool,
) -> ApiResult<Arc<Proc>> {
    let user = req.spec.user;
    let argv = req.spec.argv.clone();
    let pty = req.spec.pty.is_some();
    let ExecHandle {
        pid,
        token,
        events,
        control,
    } = st.host().exec(&row.record.id, req.spec).await?;
    let stdin_closed = !stdin_pipe;
    if let Some(data) = req.stdin_data {
        // Sent before the pump starts; a full control channel waits here.
        let _ = control.send(ExecControl::Stdin(data)).await;
    }
    if !stdin_pipe {
        let _ = control.send(ExecControl::CloseStdin).await;
    }
    let proc = Arc::new(Proc {
        id: format!("proc_{}", uuid::Uuid::new_v4().simple()),
        sandbox_id: row.record.id.clone(),
        command: req.command,
        argv,
        user,
        guest_pid: pid,
        pty,
        stdin_pipe,
        base64_always: req.base64_always,
        started_ms: now_ms(),
        token,
        state: Mutex::new(new_state(st, 0, 0, stdin_closed)),
        changed: watch::channel(0).0,
        control: Mutex::new(control),
        writes: tokio::sync::Mutex::new(()),
    });
    let record = ProcRow {
        id: proc.id.clone(),
        sandbox_id: proc.sandbox_id.clone(),
        token,
        guest_pid: pid,
        kind: req.kind.into(),
        command: proc.command.clone(),
        argv: proc.argv.clone(),
        user: if user == RunAs::Root {
            "root"
        } else {
            "sandbox"
        }
        .into(),
        pty,
        stdin_pipe,
        output_encoding: if proc.base64_always { "base64" } else { "utf8" }.into(),
        state: "running".into(),
        exit_code: None,
        signal: None,
        timed_out: false,
        out_of_memory: false,
        duration_ms: None,
        started_ms: proc.started_ms,
        ended_ms: None,
        output_bytes: 0,
        stdin_offset: 0,
        stdin_closed,
    };
    if let Err(e) = st.store().insert_process(&record) {
        // The process runs all the same; only a restart would lose it.
        tracing::error!(process_id = %proc.id, error = %e, "recording the process failed");
    }
    st.inner.procs.lock().insert(proc.id.clone(), proc.clone());
    tracing::debug!(sandbox_id = %proc.sandbox_id, process_id = %proc.id, "process started");
    pump(st, proc.clone(), 0, events);
    Ok(proc)
}

/// Moves the host's events into the process until it ends, or until its
/// handle closes during a pause (it is then `Detached`); writes the output
/// count to the store at most every second, when it detaches and when the
/// server shuts down, so a restart continues the offsets. `generation` is
/// the process's attach count when this handle was taken.
fn pump(st: &AppState, p: Arc<Proc>, generation: u64, mut events: mpsc::Receiver<ExecEvent>) {
    let st2 = st.clone();
    let cancel = st.inner.cancel.clone();
    st.spawn(async move {
        let store = st2.store();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let ev = tokio::select! {
                ev = events.recv() => ev,
                _ = tick.tick() => {
                    p.flush_output(store);
                    continue;
                }
                _ = cancel.cancelled() => {
                    p.flush_output(store);
                    return;
                }
            };
            let current = match ev {
                Some(ExecEvent::Stdout(b)) => p.ingest(generation, false, b),
                Some(ExecEvent::Stderr(b)) => p.ingest(generation, true, b),
                Some(ExecEvent::Exited(status)) => {
                    if p.state().generation == generation {
                        p.finish(store, status, false);
                        p.bump();
                    }
                    return;
                }
                None => {
                    let detached = {
                        let mut s = p.state();
                        if s.generation != generation {
                            return;
                        }
                        if s.link == Link::Detaching {
                            s.link = Link::Detached;
                        }
                        s.link == Link::Detached
                    };
                    if detached {
                        tracing::debug!(process_id = %p.id, "process detached for a pause");
                        p.flush_output(store);
                    } else {
                        tracing::warn!(process_id = %p.id, "lost the process's event stream");
                        p.finish(store, p.lost_status(), true);
                    }
                    p.bump();
                    return;
                }
            };
            if !current {
                return;
            }
            p.bump();
        }
    });
}

/// Takes up the processes of a sandbox that just woke (or whose pause
/// failed) through [`Host::attach`](runtime_host::Host::attach): each one
/// detached (after its old handle was drained, waited for a few seconds)
/// gets a new handle whose events continue its offsets; `lost` when the
/// host no longer knows it. Called under the sandbox's lifecycle lock,
/// before the sandbox is recorded `running`.
pub(crate) async fn reattach(st: &AppState, sandbox_id: &str) {
    for p in st.inner.procs.of(sandbox_id) {
        if !p.detached() {
            continue;
        }
        // Let the old handle deliver what it still has.
        let mut rx = p.changed.subscribe();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let link = p.state().link;
            if link != Link::Detaching {
                break;
            }
            if tokio::time::timeout_at(deadline, rx.changed())
                .await
                .is_err()
            {
                tracing::warn!(process_id = %p.id, "the old handle never closed; taking the process up anyway");
                break;
            }
        }
        let generation = {
            let mut s = p.state();
            if s.exit.is_some() || s.link == Link::Attached {
                continue;
            }
            s.generation += 1;
            s.link = Link::Attached;
            s.generation
        };
        match st.host().attach(sandbox_id, p.token).await {
            Ok(h) => {
                *p.control.lock().unwrap_or_else(|e| e.into_inner()) = h.control;
                tracing::debug!(sandbox_id, process_id = %p.id, "process taken up after a pause");
                pump(st, p.clone(), generation, h.events);
            }
            Err(e) => {
                tracing::warn!(sandbox_id, process_id = %p.id, error = %e, "taking up the process after a pause failed");
                p.finish(st.store(), p.lost_status(), true);
            }
        }
        p.bump();
    }
}

/// Takes up the processes an earlier server left, after the sandboxes were
/// recovered: those still running in a running sandbox are attached again
/// (`lost` when the host no longer knows them), ended ones stay queryable
/// without their output, and the records of sandboxes that are gone go.
pub async fn recover(st: &AppState) -> Result<(), crate::ServerError> {
    let mut sandboxes: HashMap<String, Option<SandboxState>> = HashMap::new();
    for row in st.store().all_processes()? {
        let state = match sandboxes.get(&row.sandbox_id) {
            Some(s) => *s,
            None => {
                let s = st
                    .store()
                    .get_sandbox(&row.sandbox_id)?
                    .filter(|r| r.deleted.is_none() && r.record.state != SandboxState::Stopped)
                    .map(|r| r.record.state);
                if s.is_none() {
                    st.store().delete_processes_of(&row.sandbox_id)?;
                }
                sandboxes.insert(row.sandbox_id.clone(), s.clone());
                s
            }
        };
        let Some(sandbox_state) = state else {
            continue;
        };
        let mut handle = None;
        if row.state == "running" && sandbox_state == SandboxState::Running {
            match st.host().attach(&row.sandbox_id, row.token).await {
                Ok(h) => handle = Some(h),
                Err(e) => {
                    tracing::warn!(sandbox_id = %row.sandbox_id, process_id = %row.id, error = %e, "taking up the process failed");
                }
            }
        }
        let detached = handle.is_none()
            && row.state == "running"
            && matches!(sandbox_state, SandboxState::Paused | SandboxState::Pausing);
        let (guest_pid, control, events) = match handle {
            Some(h) => (
                if h.pid != 0 { h.pid } else { row.guest_pid },
                h.control,
                Some(h.events),
            ),
            None => (row.guest_pid, mpsc::channel(1).0, None),
        };
        let mut state = new_state(st, row.output_bytes, row.stdin_offset, row.stdin_closed);
        if detached {
            // Taken up by the next wake.
            state.link = Link::Detached;
        }
        if row.state != "running" {
            state.exit = Some(Exit {
                status: ExitStatus {
                    code: row.exit_code,
                    signal: row.signal,
                    timed_out: row.timed_out,
                    duration_ms: row.duration_ms.unwrap_or(0),
                    out_of_memory: row.out_of_memory,
                },
                lost: row.state == "lost",
            });
            state.ended_ms = Some(row.ended_ms.unwrap_or(row.started_ms));
        }
        let proc = Arc::new(Proc {
            id: row.id.clone(),
            sandbox_id: row.sandbox_id.clone(),
            command: row.command,
            argv: row.argv,
            user: if row.user == "root" {
                RunAs::Root
            } else {
                RunAs::Sandbox
            },
            guest_pid,
            pty: row.pty,
            stdin_pipe: row.stdin_pipe,
            base64_always: row.output_encoding == "base64",
            started_ms: row.started_ms,
            token: row.token,
            state: Mutex::new(state),
            changed: watch::channel(0).0,
            control: Mutex::new(control),
            writes: tokio::sync::Mutex::new(()),
        });
        st.inner.procs.lock().insert(proc.id.clone(), proc.clone());
        match events {
            Some(events) => {
                tracing::info!(sandbox_id = %proc.sandbox_id, process_id = %proc.id, "process taken up");
                pump(st, proc, 0, events);
            }
            None if detached => {}
            None if row.state == "running" => proc.finish(st.store(), proc.lost_status(), true),
            None => {}
        }
    }
    Ok(())
}

pub async fn exec(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let row = find_running(&st, &ctx.key, &id).await?;
    let req = parse_command(&row, secret_env(&st, &id), &body, false)?;
    let stream = req.stream;
    let guard_ms = req
        .spec
        .timeout
        .map_or(MAX_TIMEOUT_MS as u64, |t| t.as_millis() as u64)
        + 30_000;
    let proc = start(&st, &row, req, false).await?;
    if stream {
        let replay = json!({"sandboxId": id, "processId": proc.id});
        return Ok(Reply::Stream {
            response: follow_response(&st, proc, 0, true),
            replay,
        });
    }
    let mut rx = proc.changed.subscribe();
    let mut deadline = tokio::time::Instant::now() + Duration::from_millis(guard_ms);
    let mut killed = false;
    loop {
        if proc.state().exit.is_some() {
            break;
        }
        if tokio::time::timeout_at(deadline, rx.changed())
            .await
            .is_err()
        {
            if proc.detached() {
                // Paused: the process goes on after the wake; wait for it.
                deadline = tokio::time::Instant::now() + Duration::from_millis(guard_ms);
                continue;
            }
            if killed {
                break;
            }
            // The host missed its own timeout; end the group ourselves.
            let _ = proc
                .control()
                .send(ExecControl::Signal(libc_sigkill()))
                .await;
            killed = true;
        }
    }
    let s = proc.state();
    let (code, timed_out, duration, oom) = match &s.exit {
        Some(e) => (
            e.status.code,
            e.status.timed_out,
            e.status.duration_ms,
            e.status.out_of_memory,
        ),
        None => (None, true, guard_ms, false),
    };
    let result = ExecResult {
        exit_code: code,
        stdout: s.kept[0].text(),
        stderr: s.kept[1].text(),
        timed_out,
        stdout_truncated: s.kept[0].truncated(),
        stderr_truncated: s.kept[1].truncated(),
        duration_ms: duration,
        process_id: proc.id.clone(),
        out_of_memory: oom.then(|| json!({})),
    };
    Reply::ok(serde_json::to_value(result).unwrap_or(Value::Null))
}

const fn libc_sigkill() -> i32 {
    9
}

struct Follow {
    proc: Arc<Proc>,
    cursor: u64,
    rx: watch::Receiver<u64>,
    send_start: bool,
    done: bool,
    heartbeat: Duration,
    cancel: CancellationToken,
}

fn lines(events: &[Value]) -> Bytes {
    let mut out = Vec::new();
    for e in events {
        if serde_json::to_writer(&mut out, e).is_ok() {
            out.push(b'\n');
        }
    }
    Bytes::from(out)
}

/// An NDJSON answer following `proc` from `cursor` until it exits.
fn follow_response(st: &AppState, proc: Arc<Proc>, cursor: u64, send_start: bool) -> Response {
    let f = Follow {
        rx: proc.changed.subscribe(),
        proc,
        cursor,
        send_start,
        done: false,
        heartbeat: st.config().heartbeat,
        cancel: st.inner.cancel.clone(),
    };
    let stream = futures::stream::unfold(f, |mut f| async move {
        if f.done {
            return None;
        }
        if f.send_start {
            f.send_start = false;
            let start = json!({"type": "start", "processId": f.proc.id});
            return Some((Ok::<_, std::convert::Infallible>(lines(&[start])), f));
        }
        loop {
            let (mut events, cursor, exit) = f.proc.read_from(f.cursor);
            f.cursor = cursor;
            if let Some(e) = exit {
                events.push(exit_event(&e));
                f.done = true;
            }
            if !events.is_empty() {
                return Some((Ok(lines(&events)), f));
            }
            let detached = {
                let s = f.proc.state();
                s.link == Link::Detached && s.exit.is_none()
            };
            if detached {
                // Paused: all it delivered was sent; resume from here after the wake.
                f.done = true;
                let c = json!({"type": "continue", "processId": f.proc.id, "cursor": f.cursor});
                return Some((Ok(lines(&[c])), f));
            }
            tokio::select! {
                r = tokio::time::timeout(f.heartbeat, f.rx.changed()) => match r {
                    Ok(_) => continue,
                    Err(_) => return Some((Ok(Bytes::from_static(b"\n")), f)),
                },
                _ = f.cancel.cancelled() => {
                    // The server is shutting down: tell the reader where to resume.
                    f.done = true;
                    let c = json!({"type": "continue", "processId": f.proc.id, "cursor": f.cursor});
                    return Some((Ok(lines(&[c])), f));
                }
            }
        }
    });
    let mut resp = Response::new(Body::from_stream(stream));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// A duplicate of a streamed exec follows the same process from the start.
pub fn replay_stream(st: &AppState, sandbox_id: &str, pid: &str) -> ApiResult<Response> {
    match st.inner.procs.get(sandbox_id, pid) {
        Ok(p) => Ok(follow_response(st, p, 0, true)),
        Err(_) => Err(ApiError::Conflict {
            code: codes::OUTPUT_GONE,
            message: format!("The output of process {pid} is no longer kept; run the command again with a new key."),
            details: Some(json!({"processId": pid})),
        }),
    }
}

pub async fn spawn(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let row = find_running(&st, &ctx.key, &id).await?;
    let req = parse_command(&row, secret_env(&st, &id), &body, true)?;
    let pipe = req.spec.stdin && req.stdin_data.is_none();
    let proc = start(&st, &row, req, pipe).await?;
    Ok(Reply::Json(axum::http::StatusCode::CREATED, proc.info()))
}

pub async fn list(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    find(&st, &ctx.key, &id)?;
    let mut procs: Vec<Arc<Proc>> = st
        .inner
        .procs
        .lock()
        .values()
        .filter(|p| p.sandbox_id == id)
        .cloned()
        .collect();
    procs.sort_by_key(|p| p.started_ms);
    let data: Vec<Value> = procs.iter().map(|p| p.info()).collect();
    Reply::ok(json!({ "data": data }))
}

pub async fn get(st: AppState, ctx: Ctx, id: String, pid: String) -> ApiResult<Reply> {
    find(&st, &ctx.key, &id)?;
    Reply::ok(st.inner.procs.get(&id, &pid)?.info())
}

pub async fn output(st: AppState, ctx: Ctx, id: String, pid: String) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let cursor = f.q_int("cursor", 0, i64::MAX).unwrap_or(0) as u64;
    let follow = f.q_bool("follow").unwrap_or(false);
    f.finish()?;
    find(&st, &ctx.key, &id)?;
    let mut proc = st.inner.procs.get(&id, &pid)?;
    if follow && proc.detached() {
        // A process call on a paused sandbox: wake it (auto-wake), which
        // takes the process up again.
        find_running(&st, &ctx.key, &id).await?;
        proc = st.inner.procs.get(&id, &pid)?;
    }
    if follow {
        return Ok(Reply::Raw(follow_response(&st, proc, cursor, false)));
    }
    let (mut events, _, exit) = proc.read_from(cursor);
    if let Some(e) = exit {
        events.push(exit_event(&e));
    }
    let mut resp = Response::new(Body::from(lines(&events)));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    Ok(Reply::Raw(resp))
}

fn signal_number(v: &Value) -> Option<i32> {
    if let Some(n) = v.as_i64() {
        return (1..=64).contains(&n).then_some(n as i32);
    }
    let s = v.as_str()?;
    let name = s.strip_prefix("SIG").unwrap_or(s);
    Some(match name {
        "HUP" => 1,
        "INT" => 2,
        "QUIT" => 3,
        "KILL" => 9,
        "USR1" => 10,
        "USR2" => 12,
        "TERM" => 15,
        "CONT" => 18,
        "STOP" => 19,
        "TSTP" => 20,
        "WINCH" => 28,
        _ => return None,
    })
}

pub async fn action(
    st: AppState,
    ctx: Ctx,
    id: String,
    pid: String,
    verb: String,
    body: Bytes,
) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    match verb.as_str() {
        "write" => {
            let data = match f.string("base64") {
                Some(b) => match base64::engine::general_purpose::STANDARD.decode(b) {
                    Ok(d) => d,
                    Err(_) => {
                        f.issue("base64", "is not valid base64");
                        Vec::new()
                    }
                },
                None => Vec::new(),
            };
            let offset = f.int("offset", 0, i64::MAX).map(|o| o as u64);
            let eof = f.bool("eof").unwrap_or(false);
            f.finish()?;
            find_running(&st, &ctx.key, &id).await?;
            let proc = st.inner.procs.get(&id, &pid)?;
            let _w = proc.writes.lock().await;
            let (current, closed, exited) = {
                let s = proc.state();
                (s.stdin_offset, s.stdin_closed, s.exit.is_some())
            };
            if exited {
                return Err(ApiError::Conflict {
                    code: codes::PROCESS_NOT_RUNNING,
                    message: format!("Process {pid} has exited."),
                    details: Some(json!({"processId": pid, "offset": current})),
                });
            }
            let offset = offset.unwrap_or(current);
            if offset > current {
                return Err(ApiError::Conflict {
                    code: codes::OFFSET_MISMATCH,
                    message: format!("Input offset {offset} is past the {current} bytes received."),
                    details: Some(json!({"offset": current})),
                });
            }
            let skip = (current - offset) as usize;
            let fresh = data.get(skip..).unwrap_or(&[]);
            if !fresh.is_empty() {
                if closed {
                    return Err(ApiError::Conflict {
                        code: "stdin_closed",
                        message: format!("The input of process {pid} is closed."),
                        details: Some(json!({"offset": current})),
                    });
                }
                proc.control()
                    .send(ExecControl::Stdin(fresh.to_vec()))
                    .await
                    .map_err(|_| ApiError::Conflict {
                        code: codes::PROCESS_NOT_RUNNING,
                        message: format!("Process {pid} has exited."),
                        details: None,
                    })?;
            }
            let new_offset = current + fresh.len() as u64;
            let mut close = false;
            let closed = {
                let mut s = proc.state();
                s.stdin_offset = new_offset;
                if eof && !s.stdin_closed {
                    s.stdin_closed = true;
                    close = true;
                }
                s.stdin_closed
            };
            if new_offset != current || close {
                if let Err(e) = st.store().process_stdin(&pid, new_offset, closed) {
                    tracing::error!(process_id = %pid, error = %e, "recording the process's input failed");
                }
            }
            if close {
                let _ = proc.control().send(ExecControl::CloseStdin).await;
            }
            Reply::ok(json!({ "offset": new_offset }))
        }
        "signal" => {
            let sig = match f.raw("signal") {
                None => Some(15),
                Some(v) => {
                    let n = signal_number(v);
                    if n.is_none() {
                        f.issue(
                            "signal",
                            "must be a signal name such as SIGTERM, or its number",
                        );
                    }
                    n
                }
            };
            f.finish()?;
            find(&st, &ctx.key, &id)?;
            let mut proc = st.inner.procs.get(&id, &pid)?;
            if proc.detached() {
                find_running(&st, &ctx.key, &id).await?;
                proc = st.inner.procs.get(&id, &pid)?;
            }
            let delivered = proc.state().exit.is_none()
                && proc
                    .control()
                    .send(ExecControl::Signal(sig.unwrap_or(15)))
                    .await
                    .is_ok();
            Reply::ok(json!({ "id": pid, "signal": sig, "delivered": delivered }))
        }
        "resize" => {
            let cols = f.int("cols", 1, 1000);
            let rows = f.int("rows", 1, 1000);
            if !f.present("cols") {
                f.issue("cols", "is required");
            }
            if !f.present("rows") {
                f.issue("rows", "is required");
            }
            f.finish()?;
            find(&st, &ctx.key, &id)?;
            let mut proc = st.inner.procs.get(&id, &pid)?;
            if proc.detached() {
                find_running(&st, &ctx.key, &id).await?;
                proc = st.inner.procs.get(&id, &pid)?;
            }
            let size = TermSize {
                cols: cols.unwrap_or(80) as u16,
                rows: rows.unwrap_or(24) as u16,
            };
            let _ = proc.control().send(ExecControl::Resize(size)).await;
            Reply::ok(json!({ "id": pid, "cols": size.cols, "rows": size.rows }))
        }
        _ => Err(ApiError::RouteNotFound {
            method: "POST".into(),
            path: format!("/v1/sandboxes/{id}/processes/{pid}:{verb}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incomplete_utf8_tails() {
        assert_eq!(incomplete_tail(b"abc"), 0);
        assert_eq!(incomplete_tail("é".as_bytes()), 0);
        assert_eq!(incomplete_tail(&"é".as_bytes()[..1]), 1);
        assert_eq!(incomplete_tail(&"€".as_bytes()[..2]), 2);
        assert_eq!(incomplete_tail(&"😀".as_bytes()[..3]), 3);
        assert_eq!(incomplete_tail(b"\xff"), 0);
    }

    #[test]
    fn buffer_keeps_the_last_bytes() {
        let mut b = OutBuf {
            chunks: VecDeque::new(),
            start: 0,
            end: 0,
            size: 0,
            cap: 10,
        };
        b.push(false, vec![1; 6]);
        b.push(true, vec![2; 6]);
        assert_eq!((b.start, b.end, b.size), (2, 12, 10));
        assert_eq!(
            b.chunks.front().map(|c| (c.offset, c.data.len())),
            Some((2, 4))
        );
    }
}
