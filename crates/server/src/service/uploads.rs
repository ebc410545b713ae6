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

/// The sandbox an upload belongs to, and the upload.
type UploadSlot = (String, Arc<tokio::sync::Mutex<Upload>>);

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
        let gone: Vec<String> = {
            let mut m = self.lock();
            let ids: Vec<String> = m
                .iter()
                .filter(|(_, (s, _))| s == sandbox_id)
                .map(|(k, _)| k.clone())
                .collect();
            for k in &ids {
                m.remove(k);
            }
            ids
        };
        for id in gone {
            let _ = std::fs::remove_file(self.dir.join(&id));
        }
    }

    fn get(&self, sandbox_id: &str, upload_id: &str) -> ApiResult<Arc<tokio::sync::Mutex<Upload>>> {
        match self.lock().get(upload_id) {
            Some((s, u)) if s == sandbox_id => Ok(u.clone()),
            _ => Err(ApiError::NotFound {
                code: codes::UPLOAD_NOT_FOUND,
                what: "upload",
                id: upload_id.to_string(),
            }),
        }
    }
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
    let upload_id = format!("upl_{}", uuid::Uuid::new_v4().simple());
    let dir = st.inner.uploads.dir.clone();
    tokio::fs::create_dir_all(&dir)
        .await
        .map_err(io_err("create uploads dir", &dir))?;
    let file = dir.join(&upload_id);
    let fh = tokio::fs::File::create(&file)
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
    st.inner.uploads.lock().insert(
        upload_id.clone(),
        (id.to_string(), Arc::new(tokio::sync::Mutex::new(up))),
    );
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
    let up = st.inner.uploads.get(id, upload_id)?;
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
    let up = st.inner.uploads.get(id, upload_id)?;
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
    let up = st.inner.uploads.get(id, upload_id)?;
    let u = up.lock().await;
    let _ = tokio::fs::remove_file(&u.file).await;
    st.inner.uploads.lock().remove(upload_id);
    Ok(())
}
