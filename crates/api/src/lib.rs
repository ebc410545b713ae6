//! Public HTTP types of the Runtime API: the records the server answers, the
//! one error body, and the error codes. Serde only; depends on no workspace
//! crate. Field names follow the wire contract (`docs/runtime-api.md`):
//! camelCase, ISO 8601 UTC times with `Z`, money in integer microdollars.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The one error body: `{"error": {...}}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ErrorBody {
    pub error: ErrorObject,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ErrorObject {
    pub code: String,
    pub status: u16,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub details: Option<Value>,
    pub request_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retryable: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
}

/// One wrong field of a request (`details.issues[]` of a 400 `invalid_request`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Issue {
    pub field: String,
    pub message: String,
}

/// Error codes the server answers.
pub mod codes {
    pub const UNAUTHORIZED: &str = "unauthorized";
    pub const FORBIDDEN: &str = "forbidden";
    pub const INVALID_REQUEST: &str = "invalid_request";
    pub const ROUTE_NOT_FOUND: &str = "route_not_found";
    pub const METHOD_NOT_ALLOWED: &str = "method_not_allowed";
    pub const NOT_FOUND: &str = "not_found";
    pub const SANDBOX_NOT_FOUND: &str = "sandbox_not_found";
    pub const PROCESS_NOT_FOUND: &str = "process_not_found";
    pub const UPLOAD_NOT_FOUND: &str = "upload_not_found";
    pub const NAME_TAKEN: &str = "name_taken";
    pub const SANDBOX_NOT_RUNNING: &str = "sandbox_not_running";
    pub const SANDBOX_PAUSED: &str = "sandbox_paused";
    pub const IDEMPOTENCY_KEY_REUSED: &str = "idempotency_key_reused";
    pub const PAYLOAD_TOO_LARGE: &str = "payload_too_large";
    pub const FILE_NOT_FOUND: &str = "file_not_found";
    pub const FILE_TOO_LARGE: &str = "file_too_large";
    pub const IS_A_DIRECTORY: &str = "is_a_directory";
    pub const NOT_A_DIRECTORY: &str = "not_a_directory";
    pub const PERMISSION_DENIED: &str = "permission_denied";
    pub const ALREADY_EXISTS: &str = "already_exists";
    pub const DIRECTORY_NOT_EMPTY: &str = "directory_not_empty";
    pub const COMMAND_NOT_FOUND: &str = "command_not_found";
    pub const CHECKSUM_MISMATCH: &str = "checksum_mismatch";
    pub const UPLOAD_INCOMPLETE: &str = "upload_incomplete";
    pub const OFFSET_MISMATCH: &str = "offset_mismatch";
    pub const PROCESS_NOT_RUNNING: &str = "process_not_running";
    /// `GET …/processes/{pid}/files` of a traced process that still runs.
    pub const PROCESS_RUNNING: &str = "process_running";
    pub const OUTPUT_GONE: &str = "output_gone";
    pub const UNSUPPORTED: &str = "unsupported";
    pub const UNAVAILABLE: &str = "unavailable";
    pub const HOST_UNAVAILABLE: &str = "host_unavailable";
    /// The shared store (PostgreSQL) does not answer the node asked.
    pub const STORE_UNAVAILABLE: &str = "store_unavailable";
    pub const NO_CAPACITY: &str = "no_capacity";
    pub const GUEST_ERROR: &str = "guest_error";
    pub const INTERNAL: &str = "internal_error";
    pub const CONNECTION_REFUSED: &str = "connection_refused";
    pub const BUSY: &str = "busy";
    pub const NOT_PERSISTENT: &str = "not_persistent";
    pub const NOT_PAUSABLE: &str = "not_pausable";
    pub const PAUSE_FAILED: &str = "pause_failed";
    pub const WAKE_FAILED: &str = "wake_failed";
    pub const SNAPSHOT_FAILED: &str = "snapshot_failed";
    pub const BUDGET_EXCEEDED: &str = "budget_exceeded";
    pub const SPENDING_LIMIT_REACHED: &str = "spending_limit_reached";
    pub const QUOTA_EXCEEDED: &str = "quota_exceeded";
    pub const SNAPSHOT_NOT_FOUND: &str = "snapshot_not_found";
    pub const SNAPSHOT_NOT_READY: &str = "snapshot_not_ready";
    pub const SNAPSHOT_METADATA_CHANGED: &str = "snapshot_metadata_changed";
    pub const IMAGE_NOT_FOUND: &str = "image_not_found";
    pub const IMAGE_NOT_READY: &str = "image_not_ready";
    pub const IMAGE_IN_USE: &str = "image_in_use";
    pub const IMAGE_BUILDING: &str = "image_building";
    pub const VOLUME_NOT_FOUND: &str = "volume_not_found";
    pub const VOLUME_IN_USE: &str = "volume_in_use";
    pub const VOLUME_ATTACHED: &str = "volume_attached";
    pub const VOLUME_RELEASING: &str = "volume_releasing";
    pub const VOLUME_CREATE_FAILED: &str = "volume_create_failed";
    pub const VOLUME_BACKUP_NOT_FOUND: &str = "volume_backup_not_found";
    pub const VOLUME_BACKUP_NOT_READY: &str = "volume_backup_not_ready";
    pub const VOLUME_BACKUP_FAILED: &str = "volume_backup_failed";
    /// `…/attachments/{id}` that is not one of the volume's.
    pub const VOLUME_ATTACHMENT_NOT_FOUND: &str = "volume_attachment_not_found";
    /// `:attach` of a volume that is not shared.
    pub const VOLUME_NOT_SHARED: &str = "volume_not_shared";
    /// `:detach` of an attachment that has ended (or is ending).
    pub const VOLUME_NOT_ATTACHED: &str = "volume_not_attached";
    /// The guest could not mount a shared volume.
    pub const VOLUME_ATTACH_FAILED: &str = "volume_attach_failed";
    pub const STDIN_CLOSED: &str = "stdin_closed";
    pub const PROCESS_NOT_A_TERMINAL: &str = "process_not_a_terminal";
    /// `GET …/processes/{pid}/files` of a process started without `traceFiles`.
    pub const PROCESS_NOT_TRACED: &str = "process_not_traced";
    pub const RESULT_NOT_FOUND: &str = "result_not_found";
    pub const CONTEXT_NOT_FOUND: &str = "context_not_found";
    pub const CONTEXT_EXISTS: &str = "context_exists";
    pub const INTERPRETER_START_FAILED: &str = "interpreter_start_failed";
    pub const PREVIEW_NOT_FOUND: &str = "preview_not_found";
    pub const PREVIEW_TOKEN_REQUIRED: &str = "preview_token_required";
    pub const PREVIEW_TOKEN_INVALID: &str = "preview_token_invalid";
    pub const PREVIEW_UNREACHABLE: &str = "preview_unreachable";
    pub const SECRET_NOT_FOUND: &str = "secret_not_found";
    pub const REGISTRY_NOT_FOUND: &str = "registry_not_found";
    pub const ENV_TAKEN: &str = "env_taken";
    pub const LOGIN_NOT_FOUND: &str = "login_not_found";
    pub const LINK_NOT_FOUND: &str = "link_not_found";
    pub const LINK_EXPIRED: &str = "link_expired";
    pub const LINK_REVOKED: &str = "link_revoked";
    pub const RANGE_NOT_SATISFIABLE: &str = "range_not_satisfiable";
}

/// The sandbox record (create, get, list items, lifecycle verbs).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Sandbox {
    pub id: String,
    pub kind: String,
    pub name: Option<String>,
    pub labels: BTreeMap<String, String>,
    /// `pending|active|paused|stopping|stopped`, derived from `state`.
    pub status: String,
    pub state: SandboxState,
    pub region: String,
    pub funding: String,
    pub vcpu: u32,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u32,
    #[serde(rename = "diskMiB")]
    pub disk_mib: u32,
    pub cpu: String,
    pub cpu_floor_millis: u32,
    pub pausable: bool,
    pub timeout_seconds: Option<u32>,
    pub idle_pause_seconds: u32,
    pub auto_wake: bool,
    pub persistent: bool,
    pub on_lease_end: String,
    pub user: String,
    pub created_at: String,
    pub ready_at: Option<String>,
    pub expires_at: Option<String>,
    pub ends_at: Option<String>,
    pub ended_at: Option<String>,
    pub stop_reason: Option<String>,
    pub paused_at: Option<String>,
    pub paused_expires_at: Option<String>,
    /// Days a paused sandbox is kept before it is deleted (`:retention`);
    /// `None`: kept until deleted.
    #[serde(default)]
    pub retention_days: Option<u32>,
    pub last_active_at: Option<String>,
    pub charged_micros: i64,
    pub held_micros: i64,
    pub max_total_cost_micros: Option<i64>,
    pub max_cost_micros: Option<i64>,
    pub env_names: Vec<String>,
    pub image: Option<String>,
    /// The snapshot it was created from.
    #[serde(default)]
    pub snapshot: Option<String>,
    /// The egress secrets it may use, by name; `None`: every one that
    /// reaches it. Fixed for its life.
    #[serde(default)]
    pub secrets: Option<Vec<String>>,
}

/// Where a sandbox is in its lifecycle: the same lowercase strings on the
/// wire and in the store. Which state may follow which is the server's rule
/// (its `domain::lifecycle`); this is only the name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    Starting,
    Running,
    Pausing,
    Paused,
    Resuming,
    Stopping,
    Stopped,
}

impl SandboxState {
    /// Every state, in lifecycle order.
    pub const ALL: [SandboxState; 7] = [
        SandboxState::Starting,
        SandboxState::Running,
        SandboxState::Pausing,
        SandboxState::Paused,
        SandboxState::Resuming,
        SandboxState::Stopping,
        SandboxState::Stopped,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            SandboxState::Starting => "starting",
            SandboxState::Running => "running",
            SandboxState::Pausing => "pausing",
            SandboxState::Paused => "paused",
            SandboxState::Resuming => "resuming",
            SandboxState::Stopping => "stopping",
            SandboxState::Stopped => "stopped",
        }
    }

    /// The state named `s` on the wire, if any.
    pub fn parse(s: &str) -> Option<SandboxState> {
        SandboxState::ALL.into_iter().find(|x| x.as_str() == s)
    }

    /// The coarser `status` of the record: `pending|active|paused|stopping|stopped`.
    pub const fn status(self) -> &'static str {
        match self {
            SandboxState::Starting => "pending",
            SandboxState::Running => "active",
            SandboxState::Pausing | SandboxState::Paused | SandboxState::Resuming => "paused",
            SandboxState::Stopping => "stopping",
            SandboxState::Stopped => "stopped",
        }
    }
}

impl std::fmt::Display for SandboxState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The answer of `DELETE /v1/sandboxes/{id}`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct DeletedSandbox {
    pub id: String,
    pub kind: String,
    pub name: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub status: String,
    pub state: SandboxState,
    pub deleted_at: String,
    pub ended_at: Option<String>,
}

/// The JSON answer of an unstreamed `:exec`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ExecResult {
    pub exit_code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub timed_out: bool,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    pub duration_ms: u64,
    pub process_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub out_of_memory: Option<Value>,
    /// What a command run with `traceFiles: true` opened:
    /// `{read, written, truncated}`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub files: Option<Value>,
}

/// One entry of `GET …/files/list` and `…/files/stat`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FileEntry {
    pub name: String,
    pub path: String,
    /// `file|directory|symlink|other`.
    #[serde(rename = "type")]
    pub kind: String,
    pub size: u64,
    /// Permission bits as octal digits, e.g. `"644"` (what the SDK's adapters parse).
    pub mode: String,
    pub modified_at: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states_keep_their_wire_strings() {
        for s in SandboxState::ALL {
            let wire = serde_json::to_value(s).unwrap_or_default();
            assert_eq!(wire, Value::String(s.as_str().to_string()));
            assert_eq!(SandboxState::parse(s.as_str()), Some(s));
            assert_eq!(serde_json::from_value::<SandboxState>(wire).ok(), Some(s));
        }
        let names: Vec<&str> = SandboxState::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(
            names,
            ["starting", "running", "pausing", "paused", "resuming", "stopping", "stopped"]
        );
        assert_eq!(SandboxState::parse("deleted"), None);
        let statuses: Vec<&str> = SandboxState::ALL.iter().map(|s| s.status()).collect();
        assert_eq!(
            statuses,
            ["pending", "active", "paused", "paused", "paused", "stopping", "stopped"]
        );
    }

    #[test]
    fn error_body_omits_absent_fields() {
        let body = ErrorBody {
            error: ErrorObject {
                code: "x".into(),
                status: 400,
                message: "m".into(),
                hint: None,
                details: None,
                request_id: "r".into(),
                retryable: None,
                retry_after_ms: None,
            },
        };
        let v = serde_json::to_value(&body).unwrap_or_default();
        assert_eq!(
            v,
            serde_json::json!({"error":{"code":"x","status":400,"message":"m","requestId":"r"}})
        );
    }
}
