//! Chunked uploads: a file under the data dir's `uploads/` of the declared
//! size, chunks written at their offsets in any order, and at commit the
//! whole checked against its SHA-256 and streamed into the sandbox (read
//! in pieces, never held whole); or an
//! archive, chunks appended in order, and at commit streamed from that file
//! to the guest's tar. Uploads live in memory (a restart forgets them and
//! empties the directory).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use runtime_api::codes;
use runtime_host::RunAs;
use serde_json::json;

use crate::domain::access::KeyInfo;
use crate::domain::files::{
    self, chunk_fits, covered, ArchiveChunk, MAX_ARCHIVE_BYTES, MAX_ARCHIVE_UPLOADS,
};
use crate::error::{ApiError, ApiResult, ServerError};
use crate::service::archives;
use crate::service::files::user_of;
use crate::service::sandboxes::{find, find_running};
use crate::AppState;

struct Upload {
    path: String,
    user: RunAs,
    file: PathBuf,
    what: What,
    /// Committed or aborted: a chunk that waited for the lock finds it gone.
    done: bool,
}

/// A file at any offset and order, or an archive in order.
enum What {
    File {
        size: u64,
        sha256: String,
        mode: Option<u32>,
        /// offset -> length of each chunk received.
        received: BTreeMap<u64, u64>,
    },
    Archive {
        /// What `gzip` said at the start.
        gzip: bool,
        /// The bytes received, without a gap from the start.
        received: u64,
    },
}

/// An upload under way: its sandbox, the key that owns the sandbox (for
/// the quotas), its size (an archive's: the bytes so far), whether it is an
/// archive, when a chunk last came, and the upload.
struct UploadSlot {
    sandbox: String,
    key: String,
    size: u64,
    archive: bool,
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

    /// The upload `upload_id` of the sandbox, of the kind asked (an
    /// archive's id is unknown to the file routes, and the reverse).
    fn get(
        &self,
        sandbox_id: &str,
        upload_id: &str,
        archive: bool,
        now_ms: i64,
    ) -> ApiResult<Arc<tokio::sync::Mutex<Upload>>> {
        match self.lock().get_mut(upload_id) {
            Some(slot) if slot.sandbox == sandbox_id && slot.archive == archive => {
                slot.touched_ms = now_ms;
                Ok(slot.upload.clone())
            }
            _ => Err(not_found(upload_id)),
        }
    }

    /// Forgets one upload and removes its file.
    async fn remove(&self, upload_id: &str, u: &mut Upload) {
        u.done = true;
        self.lock().remove(upload_id);
        let _ = tokio::fs::remove_file(&u.file).await;
    }
}

fn not_found(upload_id: &str) -> ApiError {
    ApiError::NotFound {
        code: codes::UPLOAD_NOT_FOUND,
        what: "upload",
        id: upload_id.to_string(),
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

/// Makes the file an upload's bytes wait in, of `size` bytes: readable by
/// the server alone (the bytes are the tenant's).
async fn stage(st: &AppState, upload_id: &str, size: u64) -> ApiResult<PathBuf> {
    let dir = st.inner.uploads.dir.clone();
    tokio::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .await
        .map_err(io_err("create uploads dir", &dir))?;
    let file = dir.join(upload_id);
    let fh = tokio::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&file)
        .await
        .map_err(io_err("create upload file", &file))?;
    fh.set_len(size)
        .await
        .map_err(io_err("size upload file", &file))?;
    Ok(file)
}

/// Keeps a new upload if the key's quotas (and, for an archive, the
/// sandbox's bound on open archive uploads) let it; else removes its file.
async fn keep(
    st: &AppState,
    key_id: &str,
    sandbox_id: &str,
    upload_id: &str,
    size: u64,
    up: Upload,
) -> ApiResult<()> {
    let file = up.file.clone();
    let archive = matches!(up.what, What::Archive { .. });
    // Counted and kept under one lock: two begins at once cannot both pass.
    let limits = crate::service::quotas::limits(st, key_id);
    let kept = limits.and_then(|limits| {
        let mut m = st.inner.uploads.lock();
        let open_here = m
            .values()
            .filter(|s| s.archive && s.sandbox == sandbox_id)
            .count();
        if archive && open_here >= MAX_ARCHIVE_UPLOADS {
            Err(ApiError::quota(
                format!(
                    "This sandbox has {open_here} archive uploads open, the most it may: commit or abort one first."
                ),
                MAX_ARCHIVE_UPLOADS,
            ))
        } else {
            let fits = crate::service::quotas::admit_upload(&limits, under_way(&m, key_id), size);
            fits.map(|()| {
                let slot = UploadSlot {
                    sandbox: sandbox_id.to_string(),
                    key: key_id.to_string(),
                    size,
                    archive,
                    touched_ms: st.now_ms(),
                    upload: Arc::new(tokio::sync::Mutex::new(up)),
                };
                m.insert(upload_id.to_string(), slot);
            })
        }
    });
    if let Err(e) = kept {
        let _ = tokio::fs::remove_file(&file).await;
        return Err(e);
    }
    Ok(())
}

/// `POST …/uploads`: makes room for the file and answers the upload's id.
pub(crate) async fn begin(st: &AppState, key: &KeyInfo, id: &str, b: Begin) -> ApiResult<String> {
    let row = find_running(st, key, id).await?;
    st.inner.uploads.expire(st.now_ms());
    let upload_id = format!("upl_{}", uuid::Uuid::new_v4().simple());
    let file = stage(st, &upload_id, b.size).await?;
    let up = Upload {
        path: b.path,
        user: user_of(&row, b.user.as_deref()),
        file,
        what: What::File {
            size: b.size,
            sha256: b.sha256,
            mode: b.mode,
            received: BTreeMap::new(),
        },
        done: false,
    };
    keep(st, &row.key_id, id, &upload_id, b.size, up).await?;
    Ok(upload_id)
}

/// What `POST …/files/archive/uploads` asks: the folder it unpacks into,
/// whether it is gzipped, and as whom.
pub(crate) struct BeginArchive {
    pub(crate) path: String,
    pub(crate) gzip: bool,
    pub(crate) user: Option<String>,
}

/// `POST …/files/archive/uploads`: an empty archive upload; its id.
pub(crate) async fn begin_archive(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    b: BeginArchive,
) -> ApiResult<String> {
    let row = find_running(st, key, id).await?;
    st.inner.uploads.expire(st.now_ms());
    let upload_id = format!("upa_{}", uuid::Uuid::new_v4().simple());
    let file = stage(st, &upload_id, 0).await?;
    let up = Upload {
        path: b.path,
        user: user_of(&row, b.user.as_deref()),
        file,
        what: What::Archive {
            gzip: b.gzip,
            received: 0,
        },
        done: false,
    };
    keep(st, &row.key_id, id, &upload_id, 0, up).await?;
    Ok(upload_id)
}

/// Writes `data` at `offset` of the upload's file.
async fn write_at(file: &Path, offset: u64, data: Vec<u8>) -> ApiResult<()> {
    let path = file.to_path_buf();
    tokio::task::spawn_blocking(move || {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&path)?;
        f.write_all_at(&data, offset)
    })
    .await
    .map_err(|e| ApiError::Internal {
        what: format!("upload write task: {e}"),
    })?
    .map_err(io_err("write upload chunk", file))
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
    let up = st.inner.uploads.get(id, upload_id, false, st.now_ms())?;
    let mut u = up.lock().await;
    if u.done {
        return Err(not_found(upload_id));
    }
    let file = u.file.clone();
    let What::File { size, received, .. } = &mut u.what else {
        return Err(not_found(upload_id));
    };
    let len = data.len() as u64;
    if !chunk_fits(offset, len, *size) {
        return Err(ApiError::invalid(
            "offset",
            format!("offset + chunk length is past the size ({size})"),
        ));
    }
    write_at(&file, offset, data).await?;
    received.insert(offset, len);
    Ok(())
}

/// `PUT …/files/archive/uploads/{u}?offset=`: appends one chunk (or takes
/// a resend of bytes already there, if they are the same). Answers the
/// bytes received so far. The sandbox need not be running: the bytes wait
/// on the host's disk until the commit.
pub(crate) async fn archive_chunk(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    upload_id: &str,
    offset: u64,
    data: Vec<u8>,
) -> ApiResult<u64> {
    let row = find(st, key, id)?;
    let up = st.inner.uploads.get(id, upload_id, true, st.now_ms())?;
    let mut u = up.lock().await;
    if u.done {
        return Err(not_found(upload_id));
    }
    let file = u.file.clone();
    let What::Archive { received, .. } = &mut u.what else {
        return Err(not_found(upload_id));
    };
    let len = data.len() as u64;
    match files::archive_chunk(*received, offset, len, MAX_ARCHIVE_BYTES) {
        Err(why) => Err(ApiError::invalid("offset", why)),
        Ok(ArchiveChunk::Resend) => {
            let path = file.clone();
            let same = tokio::task::spawn_blocking(move || {
                use std::os::unix::fs::FileExt;
                let f = std::fs::File::open(&path)?;
                let mut have = vec![0u8; data.len()];
                f.read_exact_at(&mut have, offset)?;
                Ok::<bool, std::io::Error>(have == data)
            })
            .await
            .map_err(|e| ApiError::Internal {
                what: format!("upload read task: {e}"),
            })?
            .map_err(io_err("read upload chunk", &file))?;
            if !same {
                return Err(ApiError::invalid(
                    "offset",
                    format!(
                        "must be {received}, the bytes received so far: the bytes at {offset} differ from those sent before"
                    ),
                ));
            }
            Ok(*received)
        }
        Ok(ArchiveChunk::Append) => {
            let grown = *received + len;
            // The key's upload space counts the bytes so far.
            let limits = crate::service::quotas::limits(st, &row.key_id)?;
            {
                let m = st.inner.uploads.lock();
                crate::service::quotas::admit_upload_growth(
                    &limits,
                    under_way(&m, &row.key_id),
                    len,
                )?;
            }
            write_at(&file, offset, data).await?;
            *received = grown;
            if let Some(slot) = st.inner.uploads.lock().get_mut(upload_id) {
                slot.size = grown;
            }
            Ok(grown)
        }
    }
}

/// The pieces a commit reads its staged file in, and how many wait for the
/// host at most.
const COMMIT_PIECE: usize = 256 * 1024;
const COMMIT_PIECES: usize = 8;

/// The SHA-256 (lower-case hex) of a staged file, read in pieces.
async fn file_sha256(file: &Path) -> ApiResult<String> {
    let path = file.to_path_buf();
    tokio::task::spawn_blocking(move || {
        use sha2::{Digest, Sha256};
        use std::io::Read;
        let mut f = std::fs::File::open(&path)?;
        let mut h = Sha256::new();
        let mut buf = vec![0u8; COMMIT_PIECE];
        loop {
            match f.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => h.update(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(hex::encode(h.finalize()))
    })
    .await
    .map_err(|e| ApiError::Internal {
        what: format!("upload hash task: {e}"),
    })?
    .map_err(io_err("read upload file", file))
}

/// Reads a staged file in pieces into `tx` (waiting while the host is
/// behind); a read error is the last piece.
fn send_pieces(
    path: PathBuf,
    tx: tokio::sync::mpsc::Sender<std::io::Result<Vec<u8>>>,
) -> tokio::task::JoinHandle<()> {
    tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let mut f = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) => {
                let _ = tx.blocking_send(Err(e));
                return;
            }
        };
        loop {
            let mut buf = vec![0u8; COMMIT_PIECE];
            let piece = match f.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    buf.truncate(n);
                    Ok(buf)
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => Err(e),
            };
            let failed = piece.is_err();
            if tx.blocking_send(piece).is_err() || failed {
                return;
            }
        }
    })
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
    let up = st.inner.uploads.get(id, upload_id, false, st.now_ms())?;
    let mut u = up.lock().await;
    if u.done {
        return Err(not_found(upload_id));
    }
    let What::File {
        size,
        sha256,
        mode,
        received,
    } = &u.what
    else {
        return Err(not_found(upload_id));
    };
    let (size, sha256, mode) = (*size, sha256.clone(), *mode);
    let have = covered(received);
    if have < size {
        return Err(ApiError::Conflict {
            code: codes::UPLOAD_INCOMPLETE,
            message: format!("The upload has bytes up to {have} of {size}."),
            details: Some(json!({ "receivedThrough": have, "size": size })),
        });
    }
    // Streamed from the staged file twice (checked, then sent), never held
    // whole: what the commit holds is a few pieces and the link's queue.
    let got = file_sha256(&u.file).await?;
    if got != sha256 {
        return Err(ApiError::Unprocessable {
            code: codes::CHECKSUM_MISMATCH,
            message: "The uploaded bytes do not match the sha256 given at the start.".into(),
            details: Some(json!({ "expected": sha256, "actual": got })),
        });
    }
    let (tx, rx) = tokio::sync::mpsc::channel(COMMIT_PIECES);
    let reader = send_pieces(u.file.clone(), tx);
    st.host()
        .write_file_stream(id, &u.path, mode, u.user, rx)
        .await?;
    // The host took every piece; a read error would have ended the write.
    let _ = reader.await;
    st.inner.uploads.remove(upload_id, &mut u).await;
    Ok(Committed {
        path: u.path.clone(),
        size,
        sha256,
    })
}

/// `POST …/files/archive/uploads/{u}:commit`: unpacks the archive into its
/// folder with the checks of `PUT …/files/archive`, streamed from the
/// host's disk. The upload is gone afterwards whether the guest's tar took
/// it or refused it (a refused archive never becomes good); one that could
/// not reach the sandbox stays for another try. Answers the folder and the
/// archive's size.
pub(crate) async fn commit_archive(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    upload_id: &str,
) -> ApiResult<(String, u64)> {
    find_running(st, key, id).await?;
    let up = st.inner.uploads.get(id, upload_id, true, st.now_ms())?;
    let mut u = up.lock().await;
    if u.done {
        return Err(not_found(upload_id));
    }
    let What::Archive { gzip, received } = u.what else {
        return Err(not_found(upload_id));
    };
    if received == 0 {
        return Err(ApiError::Conflict {
            code: codes::UPLOAD_INCOMPLETE,
            message: "The archive upload has no bytes yet.".into(),
            details: Some(json!({ "receivedThrough": 0 })),
        });
    }
    let source = archives::Source::File {
        path: u.file.clone(),
        size: received,
        gzip: Some(gzip),
    };
    let res = archives::unpack_into(st, id, &u.path, u.user, source).await;
    match res {
        Err(archives::UnpackError::NotStarted(e)) => Err(e),
        Err(archives::UnpackError::Refused(e)) => {
            st.inner.uploads.remove(upload_id, &mut u).await;
            Err(e)
        }
        Ok(()) => {
            st.inner.uploads.remove(upload_id, &mut u).await;
            Ok((u.path.clone(), received))
        }
    }
}

/// `POST …/uploads/{u}:abort` (and the archive one): forgets the upload
/// and removes its bytes (the sandbox need not be running).
pub(crate) async fn abort(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    upload_id: &str,
    archive: bool,
) -> ApiResult<()> {
    find(st, key, id)?;
    let up = st.inner.uploads.get(id, upload_id, archive, st.now_ms())?;
    let mut u = up.lock().await;
    if u.done {
        return Err(not_found(upload_id));
    }
    st.inner.uploads.remove(upload_id, &mut u).await;
    Ok(())
}
