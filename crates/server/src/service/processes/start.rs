//! Starting processes on the host: exec, spawn, a terminal's shell, an
//! image's `start` command. Each is recorded in the store and the table,
//! and its pump started.

use std::sync::{Arc, Mutex};

use runtime_host::{ExecControl, ExecHandle, ExecSpec, RunAs, TermSize};
use tokio::sync::watch;

use crate::error::ApiResult;
use crate::service::processes::pump::pump;
use crate::service::processes::table::{user_name, Proc, ProcState};
use crate::store::{ProcRow, SandboxRow};
use crate::AppState;

/// What [`start`] runs.
pub(super) struct Launch {
    pub(super) spec: ExecSpec,
    pub(super) command: String,
    pub(super) stdin_data: Option<Vec<u8>>,
    pub(super) base64_always: bool,
    /// `exec` or `spawn`.
    pub(super) kind: &'static str,
    /// Input stays open for writes.
    pub(super) stdin_pipe: bool,
}

/// The env of a command in `row`: the secrets' placeholders, then the
/// sandbox's env, then `own`.
pub(super) fn env_in(
    st: &AppState,
    row: &SandboxRow,
    own: Vec<(String, String)>,
) -> Vec<(String, String)> {
    let mut env = crate::service::network::secret_env(st, &row.record.id);
    env.extend(row.env.iter().cloned());
    env.extend(own);
    env
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
    let env = env_in(st, row, vec![("TERM".into(), "xterm-256color".into())]);
    let command = argv.join(" ");
    let launch = Launch {
        spec: ExecSpec {
            argv,
            cwd,
            env,
            user,
            timeout: None,
            stdin: true,
            pty: Some(size),
            kill_group_on_exit: false,
            trace_files: false,
        },
        command,
        stdin_data: None,
        base64_always: false,
        kind: "spawn",
        stdin_pipe: true,
    };
    start(st, row, launch).await
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
    let env = env_in(st, row, Vec::new());
    let command = argv.join(" ");
    let launch = Launch {
        spec: ExecSpec {
            argv,
            cwd,
            env,
            user,
            timeout: None,
            stdin: false,
            pty: None,
            kill_group_on_exit: false,
            trace_files: false,
        },
        command,
        stdin_data: None,
        base64_always: false,
        kind: "spawn",
        stdin_pipe: false,
    };
    start(st, row, launch).await
}

/// Starts the process on the host, records it and starts its pump.
pub(super) async fn start(st: &AppState, row: &SandboxRow, launch: Launch) -> ApiResult<Arc<Proc>> {
    let user = launch.spec.user;
    let argv = launch.spec.argv.clone();
    let cwd = launch
        .spec
        .cwd
        .clone()
        .unwrap_or_else(|| crate::domain::process::DEFAULT_CWD.into());
    let pty = launch.spec.pty.is_some();
    let traced = launch.spec.trace_files;
    let stdin_pipe = launch.stdin_pipe;
    crate::service::quotas::admit_process(st, &row.key_id, &row.record.id)?;
    st.inner.telemetry.process_started(launch.kind);
    let ExecHandle {
        pid,
        token,
        events,
        control,
    } = st.host().exec(&row.record.id, launch.spec).await?;
    let stdin_closed = !stdin_pipe;
    if let Some(data) = launch.stdin_data {
        // Sent before the pump starts; a full control channel waits here.
        let _ = control.send(ExecControl::Stdin(data)).await;
    }
    if !stdin_pipe {
        let _ = control.send(ExecControl::CloseStdin).await;
    }
    let proc = Arc::new(Proc {
        id: format!("proc_{}", uuid::Uuid::new_v4().simple()),
        sandbox_id: row.record.id.clone(),
        command: launch.command,
        argv,
        cwd,
        memory_mib: row.record.memory_mib,
        user,
        guest_pid: pid,
        pty,
        stdin_pipe,
        base64_always: launch.base64_always,
        traced,
        started_ms: st.now_ms(),
        token,
        state: Mutex::new(ProcState::new(st, 0, 0, stdin_closed)),
        changed: watch::channel(0).0,
        control: Mutex::new(control),
        writes: tokio::sync::Mutex::new(()),
    });
    let record = ProcRow {
        id: proc.id.clone(),
        sandbox_id: proc.sandbox_id.clone(),
        token,
        guest_pid: pid,
        kind: launch.kind.into(),
        command: proc.command.clone(),
        argv: proc.argv.clone(),
        cwd: proc.cwd.clone(),
        user: user_name(user).into(),
        pty,
        stdin_pipe,
        output_encoding: if proc.base64_always { "base64" } else { "utf8" }.into(),
        state: "running".into(),
        exit_code: None,
        signal: None,
        timed_out: false,
        oom_kills: 0,
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
    st.inner.procs.insert(proc.clone());
    tracing::debug!(sandbox_id = %proc.sandbox_id, process_id = %proc.id, "process started");
    pump(st, proc.clone(), 0, events);
    Ok(proc)
}
