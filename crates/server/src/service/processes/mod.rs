//! Exec and background processes (contract §6).
//!
//! Every exec and spawn is a process in an in-memory [`Table`]. A pump task
//! ([`pump`]) moves the host's events into its output
//! ([`crate::domain::process::Output`]): a bounded buffer (1 MiB, with
//! offsets counting stdout and stderr together) that readers follow from a
//! cursor ([`follow`]), and the first 64 KiB per stream for the JSON answer.
//! Offsets are assigned when bytes enter the buffer, after an incomplete
//! UTF-8 tail was held back, so every chunk is whole characters unless the
//! bytes are not UTF-8 at all (then events also carry `base64`).
//!
//! Each process is also a row in the store (its record, the host's token,
//! and how many output bytes it produced, written at most every second and
//! at its end), so a restart of the server takes the processes of recovered
//! sandboxes up again through [`Host::attach`](runtime_host::Host::attach)
//! ([`recover()`]): their offsets go on from the stored count, the bytes
//! produced while no server listened are reported as `truncated`, and what
//! ended stays queryable (without its output).
//!
//! A pause keeps processes: before the host pauses, each running process is
//! marked `Detaching`; its pump moves what the old handle still delivers and,
//! when that handle closes, the process becomes `Detached` (still `running`).
//! Followers then end their stream with `continue {processId, cursor}`; the
//! client resumes through the output endpoint, which auto-wakes the sandbox.
//! Every wake (and a failed pause) takes the detached processes up again
//! through [`Host::attach`](runtime_host::Host::attach) ([`recover::reattach`]),
//! whose events go on exactly where the old handle's ended, so offsets
//! continue with no gap; an attach that fails ends the process as `lost`.
//! An unstreamed exec in flight keeps waiting across the pause and answers
//! after the wake.

pub(crate) mod carry;
mod follow;
mod pump;
pub(crate) mod recover;
pub(crate) mod start;
mod table;

use std::sync::Arc;
use std::time::Duration;

use runtime_api::{codes, ExecResult};
use runtime_host::{ExecControl, ExecSpec, RunAs, TermSize};
use serde_json::{json, Value};

use crate::domain::access::KeyInfo;
use crate::domain::process::{
    exec_guard_ms, exec_result, files_json, timeout_ms, SIGKILL, SIGTERM,
};
use crate::error::{ApiError, ApiResult};
use crate::service::processes::start::{env_in, start, start_terminal, Launch};
use crate::service::sandboxes::{find, find_running};
use crate::store::SandboxRow;
use crate::AppState;

pub(crate) use follow::Events;
pub(crate) use recover::recover;
pub(crate) use table::{run_as, Proc, Table};

/// A command as a request gives it, checked; the sandbox completes it (its
/// env and user).
pub(crate) struct Command {
    pub(crate) argv: Vec<String>,
    pub(crate) cwd: Option<String>,
    /// The request's env, over the sandbox's.
    pub(crate) env: Vec<(String, String)>,
    /// The user the request named (else the sandbox's).
    pub(crate) user: Option<RunAs>,
    /// Input sent at the start (then closed).
    pub(crate) stdin: Option<Vec<u8>>,
    pub(crate) timeout_ms: Option<i64>,
    /// Record the files it opens (`traceFiles`).
    pub(crate) trace_files: bool,
}

/// `POST …:exec`.
pub(crate) struct ExecCommand {
    pub(crate) command: Command,
    /// Answer NDJSON events as they come instead of JSON at the end.
    pub(crate) stream: bool,
}

/// `POST …/processes`.
pub(crate) struct SpawnCommand {
    pub(crate) command: Command,
    /// Keep the input open for `:write` (`stdinMode: pipe`).
    pub(crate) stdin_pipe: bool,
    pub(crate) pty: Option<TermSize>,
    /// Every output event also carries `base64` (`outputEncoding: base64`).
    pub(crate) base64_output: bool,
}

/// What an exec answers.
pub(crate) enum Executed {
    /// It ended (or its guard ran out): the JSON answer.
    Finished(ExecResult),
    /// Streamed: the process's events from its start.
    Streaming { process_id: String, events: Events },
}

/// What the output endpoint answers.
pub(crate) enum OutputRead {
    /// What is kept from the cursor on, with the exit once all was read.
    Now(Vec<Value>),
    /// Following until the exit (or a pause, or the server's shutdown).
    Follow(Events),
}

/// `POST …/processes/{pid}:write`.
pub(crate) struct Write {
    pub(crate) data: Vec<u8>,
    /// Where `data` starts in the input (bytes already received are skipped).
    pub(crate) offset: Option<u64>,
    /// Close the input after `data`.
    pub(crate) eof: bool,
}

impl Command {
    /// The command as it runs in `row`.
    fn launch(self, st: &AppState, row: &SandboxRow, spawn: bool, stream: bool) -> Launch {
        let timeout = timeout_ms(self.timeout_ms, spawn, stream);
        let command = self.argv.join(" ");
        Launch {
            spec: ExecSpec {
                argv: self.argv,
                cwd: self.cwd,
                env: env_in(st, row, self.env),
                user: self.user.unwrap_or_else(|| run_as(&row.record.user)),
                timeout: timeout.map(|t| Duration::from_millis(t as u64)),
                stdin: self.stdin.is_some(),
                pty: None,
                kill_group_on_exit: !spawn,
                trace_files: self.trace_files,
            },
            command,
            stdin_data: self.stdin,
            base64_always: false,
            kind: if spawn { "spawn" } else { "exec" },
            stdin_pipe: false,
        }
    }
}

/// Runs a command in the sandbox: streamed, its events from the start;
/// otherwise the JSON answer once it ended. A pause while it runs does not
/// end the wait: the answer comes after the wake.
pub(crate) async fn exec(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    cmd: ExecCommand,
) -> ApiResult<Executed> {
    let row = find_running(st, key, id).await?;
    let launch = cmd.command.launch(st, &row, false, cmd.stream);
    let guard_ms = exec_guard_ms(launch.spec.timeout.map(|t| t.as_millis() as u64));
    let proc = start(st, &row, launch).await?;
    if cmd.stream {
        return Ok(Executed::Streaming {
            process_id: proc.id.clone(),
            events: follow::events(st, proc, 0, true),
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
            let _ = proc.control().send(ExecControl::Signal(SIGKILL)).await;
            killed = true;
        }
    }
    let s = proc.state();
    Ok(Executed::Finished(exec_result(
        &s.out,
        s.exit.as_ref(),
        guard_ms,
        proc.id.clone(),
        proc.memory_mib,
        proc.traced,
    )))
}

/// Starts a process that runs on by itself.
pub(crate) async fn spawn(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    cmd: SpawnCommand,
) -> ApiResult<Arc<Proc>> {
    let row = find_running(st, key, id).await?;
    let has_data = cmd.command.stdin.is_some();
    let mut launch = cmd.command.launch(st, &row, true, false);
    launch.spec.stdin = cmd.stdin_pipe || has_data;
    launch.spec.pty = cmd.pty;
    launch.base64_always = cmd.base64_output;
    // Input given up front is all the input.
    launch.stdin_pipe = cmd.stdin_pipe && !has_data;
    start(st, &row, launch).await
}

/// The sandbox's processes, oldest first.
pub(crate) fn list(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<Vec<Arc<Proc>>> {
    find(st, key, id)?;
    let mut procs = st.inner.procs.of(id);
    procs.sort_by_key(|p| p.started_ms);
    Ok(procs)
}

/// One process of a sandbox the key may see.
pub(crate) fn get(st: &AppState, key: &KeyInfo, id: &str, pid: &str) -> ApiResult<Arc<Proc>> {
    find(st, key, id)?;
    st.inner.procs.get(id, pid)
}

/// A process a call acts on: a detached one wakes its sandbox (auto-wake),
/// which takes it up again.
async fn awake(st: &AppState, key: &KeyInfo, id: &str, pid: &str) -> ApiResult<Arc<Proc>> {
    let proc = get(st, key, id, pid)?;
    if !proc.detached() {
        return Ok(proc);
    }
    find_running(st, key, id).await?;
    st.inner.procs.get(id, pid)
}

/// The output from `cursor` on: what is kept now, or followed until the
/// process exits (a detached one wakes its sandbox first).
pub(crate) async fn output(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    pid: &str,
    cursor: u64,
    follow: bool,
) -> ApiResult<OutputRead> {
    if follow {
        let proc = awake(st, key, id, pid).await?;
        return Ok(OutputRead::Follow(follow::events(st, proc, cursor, false)));
    }
    let proc = get(st, key, id, pid)?;
    let (mut events, _, exit) = proc.read_from(cursor);
    if let Some(e) = exit {
        events.push(e.event(proc.memory_mib));
    }
    Ok(OutputRead::Now(events))
}

/// The output after `cursor` in the JSON polling form
/// (`{process, chunks, nextCursor}`, as Blaxel's layer reads it), waiting
/// up to `wait` for some output or the end. A paused sandbox is not woken:
/// what it wrote before the pause is there to read.
pub(crate) async fn output_polled(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    pid: &str,
    cursor: u64,
    wait: Duration,
) -> ApiResult<Value> {
    let proc = get(st, key, id, pid)?;
    let deadline = tokio::time::Instant::now() + wait;
    // Subscribed before the first read, so no change between them is missed.
    let mut changed = proc.changed.subscribe();
    loop {
        let (chunks, next, done) = proc.chunks_from(cursor);
        let waited = chunks.is_empty()
            && !done
            && matches!(
                tokio::time::timeout_at(deadline, changed.changed()).await,
                Ok(Ok(()))
            );
        if !waited {
            return Ok(json!({ "process": proc.info(), "chunks": chunks, "nextCursor": next }));
        }
    }
}

/// What a traced process opened, once it ended: 409 `process_running`
/// before, 409 `process_not_traced` for a process started without
/// `traceFiles`.
pub(crate) fn files(st: &AppState, key: &KeyInfo, id: &str, pid: &str) -> ApiResult<Value> {
    let proc = get(st, key, id, pid)?;
    let s = proc.state();
    if let Some(files) = s.exit.as_ref().and_then(|e| e.files.as_ref()) {
        return Ok(files_json(files));
    }
    if !proc.traced {
        return Err(ApiError::Conflict {
            code: codes::PROCESS_NOT_TRACED,
            message: format!(
                "Process {pid} was not started with traceFiles: true, so its files were not recorded."
            ),
            details: Some(json!({"processId": pid})),
        });
    }
    Err(ApiError::Conflict {
        code: codes::PROCESS_RUNNING,
        message: format!("Process {pid} is still running; its files are known once it ends."),
        details: Some(json!({"processId": pid})),
    })
}

/// Writes input at `offset` (bytes already received are skipped, so a
/// retried write is harmless); answers the input offset after it.
pub(crate) async fn write(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    pid: &str,
    w: Write,
) -> ApiResult<u64> {
    find_running(st, key, id).await?;
    let proc = st.inner.procs.get(id, pid)?;
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
    let offset = w.offset.unwrap_or(current);
    if offset > current {
        return Err(ApiError::Conflict {
            code: codes::OFFSET_MISMATCH,
            message: format!("Input offset {offset} is past the {current} bytes received."),
            details: Some(json!({"offset": current})),
        });
    }
    let skip = (current - offset) as usize;
    let fresh = w.data.get(skip..).unwrap_or(&[]);
    if !fresh.is_empty() {
        if closed {
            return Err(ApiError::Conflict {
                code: codes::STDIN_CLOSED,
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
        if w.eof && !s.stdin_closed {
            s.stdin_closed = true;
            close = true;
        }
        s.stdin_closed
    };
    if new_offset != current || close {
        if let Err(e) = st
            .store()
            .process_stdin(&proc.sandbox_id, pid, new_offset, closed)
        {
            tracing::error!(process_id = %pid, error = %e, "recording the process's input failed");
        }
    }
    if close {
        let _ = proc.control().send(ExecControl::CloseStdin).await;
    }
    Ok(new_offset)
}

/// Sends `sig` (SIGTERM when `None`); answers whether it was delivered (a
/// process that ended takes none).
pub(crate) async fn signal(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    pid: &str,
    sig: Option<i32>,
) -> ApiResult<bool> {
    let proc = awake(st, key, id, pid).await?;
    Ok(proc.state().exit.is_none()
        && proc
            .control()
            .send(ExecControl::Signal(sig.unwrap_or(SIGTERM)))
            .await
            .is_ok())
}

/// Resizes the process's terminal.
pub(crate) async fn resize(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    pid: &str,
    size: TermSize,
) -> ApiResult<()> {
    awake(st, key, id, pid).await?.resize(size).await;
    Ok(())
}

/// Sends terminal input at the current offset; `false` once the process
/// ended or its input closed.
pub(crate) async fn type_in(st: &AppState, proc: &Proc, bytes: Vec<u8>) -> bool {
    let _w = proc.writes.lock().await;
    if proc.state().exit.is_some() || proc.state().stdin_closed {
        return false;
    }
    let n = bytes.len() as u64;
    if proc
        .control()
        .send(ExecControl::Stdin(bytes))
        .await
        .is_err()
    {
        return false;
    }
    let offset = {
        let mut s = proc.state();
        s.stdin_offset += n;
        s.stdin_offset
    };
    if let Err(e) = st
        .store()
        .process_stdin(&proc.sandbox_id, &proc.id, offset, false)
    {
        tracing::error!(process_id = %proc.id, error = %e, "recording the process's input failed");
    }
    true
}

/// A duplicate of a streamed exec follows the same process from the start.
pub(crate) fn replay(st: &AppState, sandbox_id: &str, pid: &str) -> ApiResult<Events> {
    match st.inner.procs.get(sandbox_id, pid) {
        Ok(p) => Ok(follow::events(st, p, 0, true)),
        Err(_) => Err(ApiError::Conflict {
            code: codes::OUTPUT_GONE,
            message: format!("The output of process {pid} is no longer kept; run the command again with a new key."),
            details: Some(json!({"processId": pid})),
        }),
    }
}

/// What a terminal WebSocket opens.
pub(crate) struct TerminalCommand {
    pub(crate) size: TermSize,
    /// Run `bash -c` this (else a login shell).
    pub(crate) command: Option<String>,
    pub(crate) cwd: Option<String>,
    pub(crate) user: Option<RunAs>,
    /// Take up this running pty process instead of starting one.
    pub(crate) process_id: Option<String>,
}

/// A terminal's process, and whether the terminal started it (then it
/// hangs up the process when it closes).
pub(crate) struct Terminal {
    pub(crate) proc: Arc<Proc>,
    pub(crate) owned: bool,
}

/// The process of a terminal: a running pty process taken up (resized to
/// the terminal), or a new shell.
pub(crate) async fn open_terminal(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    cmd: TerminalCommand,
) -> ApiResult<Terminal> {
    let row = find_running(st, key, id).await?;
    if let Some(pid) = cmd.process_id {
        let p = process(st, id, &pid)?;
        if !p.is_pty() || p.exited() {
            return Err(ApiError::Conflict {
                code: codes::PROCESS_NOT_A_TERMINAL,
                message: format!("Process {pid} is not a running terminal process."),
                details: Some(json!({"processId": pid})),
            });
        }
        p.resize(cmd.size).await;
        return Ok(Terminal {
            proc: p,
            owned: false,
        });
    }
    let argv = match cmd.command {
        Some(c) => vec!["bash".into(), "-c".into(), c],
        None => vec!["bash".into(), "-l".into()],
    };
    let user = cmd.user.unwrap_or_else(|| run_as(&row.record.user));
    let proc = start_terminal(st, &row, argv, cmd.cwd, user, cmd.size).await?;
    Ok(Terminal { proc, owned: true })
}

/// A process of the sandbox by id.
pub(crate) fn process(st: &AppState, sandbox_id: &str, pid: &str) -> ApiResult<Arc<Proc>> {
    st.inner.procs.get(sandbox_id, pid)
}
