//! The snapshot record as stored and answered.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The snapshot record (create, get, list items).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Snapshot {
    pub id: String,
    pub kind: String,
    pub sandbox_id: String,
    pub name: Option<String>,
    pub labels: BTreeMap<String, String>,
    /// `memory` or `disk`.
    pub mode: String,
    /// `capturing|ready|failed`.
    pub state: String,
    pub size_bytes: u64,
    pub vcpu: u32,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: u32,
    #[serde(rename = "diskMiB")]
    pub disk_mib: u32,
    pub retention_days: u32,
    pub created_at: String,
    pub ready_at: Option<String>,
    pub expires_at: Option<String>,
    pub error: Option<String>,
}
