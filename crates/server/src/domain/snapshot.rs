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
    /// The image the source sandbox ran (absent in records made before it
    /// was kept).
    #[serde(default)]
    pub source_image_id: Option<String>,
}

impl Snapshot {
    /// The record as answered: the stored fields, and the names the client
    /// reads (`sourceSandboxId`, `shape`, `storedBytes`, `meteredBytes`,
    /// `sourceImageId`).
    pub fn wire(&self) -> serde_json::Value {
        let mut v = serde_json::to_value(self).unwrap_or(serde_json::Value::Null);
        if let Some(o) = v.as_object_mut() {
            o.insert("sourceSandboxId".into(), self.sandbox_id.clone().into());
            o.insert(
                "shape".into(),
                serde_json::json!({
                    "vcpu": self.vcpu,
                    "memoryMiB": self.memory_mib,
                    "diskMiB": self.disk_mib,
                }),
            );
            // What the capture holds on disk is what is kept, and billed.
            o.insert("storedBytes".into(), self.size_bytes.into());
            o.insert("meteredBytes".into(), self.size_bytes.into());
            o.insert("sourceImageId".into(), self.source_image_id.clone().into());
        }
        v
    }
}
