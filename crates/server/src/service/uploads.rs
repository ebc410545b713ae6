//! Chunked uploads: a file under the data dir's `uploads/` of the declared
//! size, chunks written at their offsets in any order, and at commit the
//! whole checked against its SHA-256 and written into the sandbox. Uploads
//! live in memory (a restart forgets them and empties the directory).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use runtime_api::codes;
use runtime_host::RunAs;
use serde_json::json;

use crate::domain::access::{sha256_hex, KeyInfo};
use crate::domain::files::{chunk_fits, covered};
use crate::error::{ApiError, ApiResult, ServerError};
use crate::service::files::user_of;
use crate::service::sandboxes::{find, find_running};
use crate::AppState;

struct Upload {
    path: String,
    size: u64,
    sha256: String,
    mode: Option<u32>,
    user: RunAs,
    file: PathBuf,
    /// offset -> length of each chunk received.
    received: BTreeMap<u64, u64>,
}

/// An upload under way: its sandbox, the key that owns the sandbox (for
/// the quotas), its size, when a chunk last came, and the upload.
struct UploadSlot {
    sandbox: String,
    key: String,
    size: u64,
    touched_ms: i64,
    upload: Arc<tokio::sync::Mutex<Upload>>,
}

/// An upload no chunk reached for this long is forgotten, its file removed.
const UPLOAD_IDLE_MS: i64 = 3600 * 1000;

/// The uploads under way, and the directory their bytes wait in.
pub(crate) struct Uploads {
    dir: PathBuf,
    map: Mutex<HashMap<String, UploadSlot>>,
}

impl Uploads {
    pub(crate) fn new(dir: PathBuf) -> Self {
        Uploads {
            dir,
            map: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, UploadSlot>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets a deleted sandbox's uploads and their files.
    pub(crate) fn sandbox_gone(&self, sandbox_id: &str) {
        self.forget(|slot| slot.sandbox == sandbox_id);
    }

    /// Forgets the uploads idle for an hour, and removes their files.
    fn expire(&self, now_ms: i64) {
        self.forget(|slot| now_ms - slot.touched_ms > UPLOAD_IDLE_MS);
    }

    /// Forgets the uploads `gone` picks, and removes their files.
    fn forget(&self, gone: impl Fn(&UploadSlot) -> bool) {
        let ids: Vec<String> = {
            let mut m = self.lock();
            let ids: Vec<String> = m
                .iter()
                .filter(|(_, slot)| gone(slot))
                .map(|(k, _)| k.clone())
                .collect();
            for k in &ids {
                m.remove(k);
            }
            ids
        };
        for id in ids {
            let _ = std::fs::remove_file(self.dir.join(&id));
        }
    }

    /// How many uploads `key_id`'s sandboxes have under way, and their bytes.
    pub(crate) fn under_way(&self, key_id: &str) -> (u64, u64) {
        under_way(&self.lock(), key_id)
    }

    fn get(
        &self,
        sandbox_id: &str,
        upload_id: &str,
        now_ms: i64,
    ) -> ApiResult<Arc<tokio::sync::Mutex<Upload>>> {
        match self.lock().get_mut(upload_id) {
            Some(slot) if slot.sandbox == sandbox_id => {
                slot.touched_ms = now_ms;
                Ok(slot.upload.clone())
            }
            _ => Err(ApiError::NotFound {
                code: codes::UPLOAD_NOT_FOUND,
                what: "upload",
                id: upload_id.to_string(),
            }),
        }
    }
}

fn under_way(m: &HashMap<String, UploadSlot>, key_id: &str) -> (u64, u64) {
    m.values()
        .filter(|slot| slot.key == key_id)
        .fold((0, 0), |(n, bytes), slot| (n + 1, bytes + slot.size))
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> ApiError {
    let path = path.display().to_string();
    move |source| ApiError::Server(ServerError::Io { op, path, source })
}

/// The largest upload this server takes.
pub(crate) fn max_bytes(st: &AppState) -> u64 {
    st.config().max_upload_bytes
}

/// What `POST …/uploads` asks: where the file goes, its size and SHA-256
/// (lower-case hex).
pub(crate) struct Begin {
    pub(crate) path: String,
    pub(crate) size: u64,
    pub(crate) sha256: String,
    pub(crate) mode: Option<u32>,
    pub(crate) user: Option<String>,
}

/// `POST …/uploads`: makes room for the file and answers the upload's id.
pub(crate) async fn begin(st: &AppState, key: &KeyInfo, id: &str, b: Begin) -> ApiResult<String> {
    let row = find_running(st, key, id).await?;
    let now = st.now_ms();
    st.inner.uploads.expire(now);
    let upload_id = format!("upl_{}", uuid::Uuid::new_v4().simple());
    let dir = st.inner.uploads.dir.clone();
    tokio::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .await
        .map_err(io_err("create uploads dir", &dir))?;
    let file = dir.join(&upload_id);
    // The bytes are the tenant's: readable by the server alone.
    let fh = tokio::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&file)
        .await
        .map_err(io_err("create upload file", &file))?;
    fh.set_len(b.size)
        .await
        .map_err(io_err("size upload file", &file))?;
    let up = Upload {
        path: b.path,
        size: b.size,
        sha256: b.sha256,
        mode: b.mode,
        user: user_of(&row, b.user.as_deref()),
        file,
        received: BTreeMap::new(),
    };
    let file = up.file.clone();
    // Counted and kept under one lock: two begins at once cannot both pass.
    let limits = crate::service::quotas::limits(st, &row.key_id);
    let kept = limits.and_then(|limits| {
        let mut m = st.inner.uploads.lock();
        let fits =
            crate::service::quotas::admit_upload(&limits, under_way(&m, &row.key_id), b.size);
        fits.map(|()| {
            let slot = UploadSlot {
                sandbox: id.to_string(),
                key: row.key_id.clone(),
                size: b.size,
                touched_ms: now,
                upload: Arc::new(tokio::sync::Mutex::new(up)),
            };
            m.insert(upload_id.clone(), slot);
        })
    });
    if let Err(e) = kept {
        let _ = tokio::fs::remove_file(&file).await;
        return Err(e);
    }
    Ok(upload_id)
}

/// `PUT …/uploads/{u}?offset=`: writes one chunk at its offset.
pub(crate) async fn chunk(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    upload_id: &str,
    offset: u64,
    data: Vec<u8>,
) -> ApiResult<()> {
    find_running(st, key, id).await?;
    let up = st.inner.uploads.get(id, upload_id, st.now_ms())?;
    let mut u = up.lock().await;
    let len = data.len() as u64;
    if !chunk_fits(offset, len, u.size) {
        return Err(ApiError::invalid(
            "offset",
            format!("offset + chunk length is past the size ({})", u.size),
        ));
    }
    let file = u.file.clone();
    tokio::task::spawn_blocking(move || {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&file)?;
        f.write_all_at(&data, offset)
    })
    .await
    .map_err(|e| ApiError::Internal {
        what: format!("upload write task: {e}"),
    })?
    .map_err(io_err("write upload chunk", &u.file))?;
    u.received.insert(offset, len);
    Ok(())
}

/// An upload written into the sandbox.
pub(crate) struct Committed {
    pub(crate) path: String,
    pub(crate) size: u64,
    pub(crate) sha256: String,
}

/// `POST …/uploads/{u}:commit`: checks that every byte arrived and matches
/// the SHA-256, then writes the file into the sandbox.
pub(crate) async fn commit(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    upload_id: &str,
) -> ApiResult<Committed> {
    find_running(st, key, id).await?;
    let up = st.inner.uploads.get(id, upload_id, st.now_ms())?;
    let u = up.lock().await;
    let have = covered(&u.received);
    if have < u.size {
        return Err(ApiError::Conflict {
            code: codes::UPLOAD_INCOMPLETE,
            message: format!("The upload has bytes up to {have} of {}.", u.size),
            details: Some(json!({ "receivedThrough": have, "size": u.size })),
        });
    }
    let data = tokio::fs::read(&u.file)
        .await
        .map_err(io_err("read upload file", &u.file))?;
    let got = sha256_hex(&data);
    if got != u.sha256 {
        return Err(ApiError::Unprocessable {
            code: codes::CHECKSUM_MISMATCH,
            message: "The uploaded bytes do not match the sha256 given at the start.".into(),
            details: Some(json!({ "expected": u.sha256, "actual": got })),
        });
    }
    st.host()
        .write_file(id, &u.path, u.mode, u.user, data)
        .await?;
    let _ = tokio::fs::remove_file(&u.file).await;
    st.inner.uploads.lock().remove(upload_id);
    Ok(Committed {
        path: u.path.clone(),
        size: u.size,
        sha256: u.sha256.clone(),
    })
}

/// `POST …/uploads/{u}:abort`: forgets the upload (the sandbox need not
/// be running).
pub(crate) async fn abort(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    upload_id: &str,
) -> ApiResult<()> {
    find(st, key, id)?;
    let up = st.inner.uploads.get(id, upload_id, st.now_ms())?;
    let u = up.lock().await;
    let _ = tokio::fs::remove_file(&u.file).await;
    st.inner.uploads.lock().remove(upload_id);
    Ok(())
}
