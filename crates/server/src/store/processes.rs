//! Processes, so a restart of the server can take them up again.

use super::db::params;

use super::{corrupt, store_err, Store};
use crate::error::ServerError;

/// A process as stored (contract §6): what its record shows, plus the
/// host's `token` to take it up again after a restart.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ProcRow {
    pub id: String,
    pub sandbox_id: String,
    pub token: u64,
    pub guest_pid: u32,
    /// `exec` or `spawn`.
    pub kind: String,
    pub command: String,
    pub argv: Vec<String>,
    /// Where it runs.
    pub cwd: String,
    /// `sandbox` or `root`.
    pub user: String,
    pub pty: bool,
    pub stdin_pipe: bool,
    /// `utf8` or `base64`.
    pub output_encoding: String,
    /// `running`, `exited` or `lost`.
    pub state: String,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    /// Processes the kernel killed for memory (0: none).
    pub oom_kills: u32,
    pub duration_ms: Option<u64>,
    pub started_ms: i64,
    pub ended_ms: Option<i64>,
    /// Output bytes produced so far: the offset the next byte gets.
    pub output_bytes: u64,
    pub stdin_offset: u64,
    pub stdin_closed: bool,
}

/// How a process ended, as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcEnd {
    pub state: &'static str,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    /// Processes the kernel killed for memory (0: none).
    pub oom_kills: u32,
    pub duration_ms: u64,
    pub ended_ms: i64,
    pub output_bytes: u64,
}

const PROC_COLUMNS: &str =
    "id, sandbox_id, token, guest_pid, kind, command, argv, run_as, pty, stdin_pipe, \
     output_encoding, state, exit_code, signal, timed_out, out_of_memory, duration_ms, started_ms, \
     ended_ms, output_bytes, stdin_offset, stdin_closed, cwd";

fn proc_row(r: &super::db::Row) -> super::db::DbResult<(ProcRow, String)> {
    let token: i64 = r.get(2)?;
    let duration: Option<i64> = r.get(16)?;
    let output_bytes: i64 = r.get(19)?;
    let stdin_offset: i64 = r.get(20)?;
    Ok((
        ProcRow {
            id: r.get(0)?,
            sandbox_id: r.get(1)?,
            token: token as u64,
            guest_pid: r.get(3)?,
            kind: r.get(4)?,
            command: r.get(5)?,
            argv: Vec::new(),
            user: r.get(7)?,
            pty: r.get(8)?,
            stdin_pipe: r.get(9)?,
            output_encoding: r.get(10)?,
            state: r.get(11)?,
            exit_code: r.get(12)?,
            signal: r.get(13)?,
            timed_out: r.get(14)?,
            oom_kills: r.get(15)?,
            duration_ms: duration.map(|d| d.max(0) as u64),
            started_ms: r.get(17)?,
            ended_ms: r.get(18)?,
            output_bytes: output_bytes.max(0) as u64,
            stdin_offset: stdin_offset.max(0) as u64,
            stdin_closed: r.get(21)?,
            cwd: r.get(22)?,
        },
        r.get(6)?,
    ))
}

impl Store {
    pub fn insert_process(&self, p: &ProcRow) -> Result<(), ServerError> {
        let argv = serde_json::to_string(&p.argv).map_err(|e| corrupt(e.to_string()))?;
        self.conn()
            .execute(
                &format!(
                    "INSERT INTO processes ({PROC_COLUMNS}) VALUES \
                     (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21, ?22, ?23)"
                ),
                params![
                    p.id,
                    p.sandbox_id,
                    p.token as i64,
                    p.guest_pid,
                    p.kind,
                    p.command,
                    argv,
                    p.user,
                    p.pty,
                    p.stdin_pipe,
                    p.output_encoding,
                    p.state,
                    p.exit_code,
                    p.signal,
                    p.timed_out,
                    p.oom_kills,
                    p.duration_ms.map(|d| d as i64),
                    p.started_ms,
                    p.ended_ms,
                    p.output_bytes as i64,
                    p.stdin_offset as i64,
                    p.stdin_closed,
                    p.cwd,
                ],
            )
            .map(|_| ())
            .map_err(store_err("insert process"))
    }

    /// Every stored process, oldest first.
    pub fn all_processes(&self) -> Result<Vec<ProcRow>, ServerError> {
        self.list_processes("", None)
    }

    /// The stored processes of one sandbox, oldest first.
    pub fn processes_of(&self, sandbox_id: &str) -> Result<Vec<ProcRow>, ServerError> {
        self.list_processes("WHERE sandbox_id = ?1", Some(sandbox_id))
    }

    /// The processes `filter` (binding `sandbox_id` as `?1`) selects, oldest first.
    fn list_processes(
        &self,
        filter: &str,
        sandbox_id: Option<&str>,
    ) -> Result<Vec<ProcRow>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(&format!(
                "SELECT {PROC_COLUMNS} FROM processes {filter} ORDER BY started_ms, id"
            ))
            .map_err(store_err("list processes"))?;
        let rows = match sandbox_id {
            Some(id) => stmt.query_map(params![id], proc_row),
            None => stmt.query_map([], proc_row),
        }
        .map_err(store_err("list processes"))?;
        let mut out = Vec::new();
        for r in rows {
            let (mut p, argv) = r.map_err(store_err("list processes"))?;
            p.argv =
                serde_json::from_str(&argv).map_err(|e| corrupt(format!("process argv: {e}")))?;
            out.push(p);
        }
        Ok(out)
    }

    /// Records how many output bytes a running process has produced.
    pub fn process_output(
        &self,
        sandbox_id: &str,
        id: &str,
        output_bytes: u64,
    ) -> Result<(), ServerError> {
        self.conn()
            .execute(
                "UPDATE processes SET output_bytes = ?2 WHERE id = ?1 AND sandbox_id = ?3",
                params![id, output_bytes as i64, sandbox_id],
            )
            .map(|_| ())
            .map_err(store_err("update process output"))
    }

    pub fn process_stdin(
        &self,
        sandbox_id: &str,
        id: &str,
        offset: u64,
        closed: bool,
    ) -> Result<(), ServerError> {
        self.conn()
            .execute(
                "UPDATE processes SET stdin_offset = ?2, stdin_closed = ?3 \
                 WHERE id = ?1 AND sandbox_id = ?4",
                params![id, offset as i64, closed, sandbox_id],
            )
            .map(|_| ())
            .map_err(store_err("update process stdin"))
    }

    pub fn process_ended(
        &self,
        sandbox_id: &str,
        id: &str,
        e: &ProcEnd,
    ) -> Result<(), ServerError> {
        self.conn()
            .execute(
                "UPDATE processes SET state = ?2, exit_code = ?3, signal = ?4, timed_out = ?5, \
                 out_of_memory = ?6, duration_ms = ?7, ended_ms = ?8, output_bytes = ?9 \
                 WHERE id = ?1 AND sandbox_id = ?10",
                params![
                    id,
                    e.state,
                    e.exit_code,
                    e.signal,
                    e.timed_out,
                    e.oom_kills,
                    e.duration_ms as i64,
                    e.ended_ms,
                    e.output_bytes as i64,
                    sandbox_id,
                ],
            )
            .map(|_| ())
            .map_err(store_err("update process end"))
    }

    pub fn delete_processes_of(&self, sandbox_id: &str) -> Result<usize, ServerError> {
        self.conn()
            .execute(
                "DELETE FROM processes WHERE sandbox_id = ?1",
                params![sandbox_id],
            )
            .map_err(store_err("delete processes"))
    }

    pub fn delete_process(&self, sandbox_id: &str, id: &str) -> Result<(), ServerError> {
        self.conn()
            .execute(
                "DELETE FROM processes WHERE id = ?1 AND sandbox_id = ?2",
                params![id, sandbox_id],
            )
            .map(|_| ())
            .map_err(store_err("delete process"))
    }
}
