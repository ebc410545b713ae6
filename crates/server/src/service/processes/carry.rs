//! A sandbox's running processes carried into its copies (a fork, a create
//! from a memory snapshot). A copy's machine is restored from its source's
//! memory, so its agent runs those processes on under the same stream
//! tokens; their records travel in the capture's directory
//! (`processes.json`, written by [`save`] once the capture is taken) and
//! the copy takes them up under the same process ids ([`adopt`]) before it
//! is `running`. Their offsets go on from the count at the capture; the
//! output before it stays with the source (reads from earlier offsets say
//! `truncated`, as after a restart of the server).

use std::path::Path;

use tokio::sync::mpsc;

use crate::service::processes::recover::{from_row, reattach};
use crate::store::ProcRow;
use crate::AppState;

const FILE: &str = "processes.json";
/// What a capture's records may take: far more than the processes a
/// sandbox may run (its per-sandbox limit) ever need.
const MAX_BYTES: u64 = 8 << 20;

/// Writes the processes of `sandbox_id` that run now into the capture
/// `dir`, with the output and input counts they have reached. A failure is
/// logged: the copies then start without them.
pub(crate) fn save(st: &AppState, sandbox_id: &str, dir: &Path) {
    let rows = match st.store().processes_of(sandbox_id) {
        Ok(rows) => rows,
        Err(e) => {
            tracing::warn!(sandbox_id, error = %e, "listing the processes a capture carries failed");
            return;
        }
    };
    let mut carried: Vec<ProcRow> = Vec::new();
    for mut row in rows {
        let Ok(p) = st.inner.procs.get(sandbox_id, &row.id) else {
            continue;
        };
        let s = p.state();
        if s.exit.is_some() {
            continue;
        }
        row.output_bytes = s.out.end();
        row.stdin_offset = s.stdin_offset;
        row.stdin_closed = s.stdin_closed;
        drop(s);
        carried.push(row);
    }
    if carried.is_empty() {
        return;
    }
    let write = || -> std::io::Result<()> {
        let bytes = serde_json::to_vec(&carried).map_err(std::io::Error::other)?;
        let tmp = dir.join(format!("{FILE}.tmp"));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, dir.join(FILE))
    };
    if let Err(e) = write() {
        tracing::warn!(sandbox_id, error = %e, "writing the processes a capture carries failed");
    }
}

/// The records a capture carries (none when it has none, or they cannot
/// be read).
pub(crate) fn load(dir: &Path) -> Vec<ProcRow> {
    let path = dir.join(FILE);
    match std::fs::metadata(&path) {
        Ok(m) if m.len() <= MAX_BYTES => {}
        Ok(m) => {
            tracing::warn!(
                bytes = m.len(),
                "a capture's process records are too large; ignored"
            );
            return Vec::new();
        }
        Err(_) => return Vec::new(),
    }
    match std::fs::read(&path).map(|b| serde_json::from_slice::<Vec<ProcRow>>(&b)) {
        Ok(Ok(rows)) => rows,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "a capture's process records are unreadable; ignored");
            Vec::new()
        }
        Err(e) => {
            tracing::warn!(error = %e, "reading a capture's process records failed");
            Vec::new()
        }
    }
}

/// The copy `sandbox_id`, just restored from a capture that carried
/// `rows`, takes those processes up: recorded under their ids (in the
/// store too), then attached through the host like after a wake (`lost`
/// when its agent no longer knows one).
pub(crate) async fn adopt(st: &AppState, sandbox_id: &str, memory_mib: u32, rows: Vec<ProcRow>) {
    if rows.is_empty() {
        return;
    }
    for mut row in rows {
        row.sandbox_id = sandbox_id.to_string();
        row.state = "running".into();
        if let Err(e) = st.store().insert_process(&row) {
            tracing::warn!(sandbox_id, process_id = %row.id, error = %e, "recording a carried process failed");
            continue;
        }
        let (pid, control) = (row.guest_pid, mpsc::channel(1).0);
        st.inner
            .procs
            .insert(from_row(st, row, memory_mib, pid, control, true));
    }
    reattach(st, sandbox_id).await;
}
