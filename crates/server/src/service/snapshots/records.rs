//! Finding the snapshots a key may see, and where their captures live.

use runtime_api::codes;
use std::path::PathBuf;

use serde_json::json;

use crate::domain::access::KeyInfo;
use crate::error::{ApiError, ApiResult};
use crate::store::SnapshotRow;
use crate::AppState;

pub(crate) fn visible(key: &KeyInfo, row: &SnapshotRow) -> bool {
    key.account_wide || row.key_id == key.id
}

pub(crate) fn not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        code: codes::SNAPSHOT_NOT_FOUND,
        what: "snapshot",
        id: id.to_string(),
    }
}

pub(crate) fn dir(st: &AppState, id: &str) -> PathBuf {
    st.config().data_dir.join("snapshots").join(id)
}

pub(crate) fn find(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<SnapshotRow> {
    match st.store().get_snapshot(id)? {
        Some(r) if r.deleted.is_none() && visible(key, &r) => Ok(r),
        _ => Err(not_found(id)),
    }
}

/// A snapshot this key may start a sandbox from.
pub(crate) fn find_ready(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<SnapshotRow> {
    let row = find(st, key, id)
        .map_err(|_| ApiError::invalid("snapshot", format!("there is no snapshot {id}")))?;
    if row.record.state != "ready" {
        return Err(ApiError::Conflict {
            code: codes::SNAPSHOT_NOT_READY,
            message: format!("Snapshot {id} is {}, not ready.", row.record.state),
            details: Some(json!({ "snapshotId": id, "state": row.record.state })),
        });
    }
    Ok(row)
}
