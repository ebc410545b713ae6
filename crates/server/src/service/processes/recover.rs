//! Taking processes up again: after a wake (or a failed pause) through
//! [`reattach`], and after a restart of the server through [`recover`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, watch};

use crate::domain::lifecycle::SandboxState;
use crate::domain::process::Exit;
use crate::service::processes::pump::pump;
use crate::service::processes::table::{run_as, Link, Proc, ProcState};
use crate::store::ProcRow;
use crate::AppState;
use runtime_host::ExecControl;

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
                p.lose(st.store(), st.now_ms());
            }
        }
        p.bump();
    }
}

/// Takes up the processes an earlier server left, after the sandboxes were
/// recovered: those still running in a running sandbox are attached again
/// (`lost` when the host no longer knows them), ended ones stay queryable
/// without their output, and the records of sandboxes that are gone go.
pub(crate) async fn recover(st: &AppState) -> Result<(), crate::ServerError> {
    let mut sandboxes: HashMap<String, Option<(SandboxState, u32)>> = HashMap::new();
    for row in st.store().all_processes()? {
        let state = match sandboxes.get(&row.sandbox_id) {
            Some(s) => *s,
            // Another control plane's sandbox: its processes are that node's.
            None if !st.runs_here(&row.sandbox_id) => {
                sandboxes.insert(row.sandbox_id.clone(), None);
                None
            }
            None => {
                let s = st
                    .store()
                    .get_sandbox(&row.sandbox_id)?
                    .filter(|r| r.deleted.is_none() && r.record.state != SandboxState::Stopped)
                    .map(|r| (r.record.state, r.record.memory_mib));
                if s.is_none() {
                    st.store().delete_processes_of(&row.sandbox_id)?;
                }
                sandboxes.insert(row.sandbox_id.clone(), s);
                s
            }
        };
        let Some((sandbox_state, memory_mib)) = state else {
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
        let proc = from_row(st, row, memory_mib, guest_pid, control, detached);
        st.inner.procs.insert(proc.clone());
        let running = proc.state().exit.is_none();
        match events {
            Some(events) => {
                tracing::info!(sandbox_id = %proc.sandbox_id, process_id = %proc.id, "process taken up");
                pump(st, proc, 0, events);
            }
            None if detached => {}
            None if running => proc.lose(st.store(), st.now_ms()),
            None => {}
        }
    }
    Ok(())
}

/// A process of the table made from its stored `row`: `detached` waits for
/// a wake (or an adoption) to take it up; one the row says ended keeps its
/// end, without its output.
pub(super) fn from_row(
    st: &AppState,
    row: ProcRow,
    memory_mib: u32,
    guest_pid: u32,
    control: mpsc::Sender<ExecControl>,
    detached: bool,
) -> Arc<Proc> {
    let mut state = ProcState::new(st, row.output_bytes, row.stdin_offset, row.stdin_closed);
    if detached {
        state.link = Link::Detached;
    }
    if row.state != "running" {
        state.exit = Some(Exit {
            code: row.exit_code,
            signal: row.signal,
            timed_out: row.timed_out,
            duration_ms: row.duration_ms.unwrap_or(0),
            oom_kills: row.oom_kills,
            lost: row.state == "lost",
            // Traced files are kept in memory only.
            files: None,
        });
        state.ended_ms = Some(row.ended_ms.unwrap_or(row.started_ms));
    }
    Arc::new(Proc {
        id: row.id,
        sandbox_id: row.sandbox_id,
        command: row.command,
        argv: row.argv,
        cwd: row.cwd,
        memory_mib,
        user: run_as(&row.user),
        guest_pid,
        pty: row.pty,
        stdin_pipe: row.stdin_pipe,
        base64_always: row.output_encoding == "base64",
        // Traced files are kept in memory only: a process taken up again
        // (a restart of the server, a copy's) counts as not traced.
        traced: false,
        started_ms: row.started_ms,
        token: row.token,
        state: Mutex::new(state),
        changed: watch::channel(0).0,
        control: Mutex::new(control),
        writes: tokio::sync::Mutex::new(()),
    })
}
