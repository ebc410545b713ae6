//! Build context chunks (docs/images.md "Build contexts"), kept per key in
//! `data_dir/images/context/<hash of the key's id>/<sha256>`: a chunk is
//! only ever seen by the key that uploaded it (`missing` answers for the
//! caller's own chunks, so it tells no key what another uploaded), checked
//! against its digest on arrival, at most [`CHUNK_BYTES`] each and
//! [`MAX_HELD_BYTES`] per key, and removed a day after its last use (a
//! `PUT`, a `missing` that found it, a build that named it), or with its
//! key.
//!
//! A build's archive is read straight from its chunks, in order, as one
//! stream: checked against its size and SHA-256, unpacked in memory entry
//! by entry (`domain::image::context`), never written out on the host.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use serde_json::json;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;

use crate::domain::access::{sha256_hex, KeyInfo};
use crate::domain::image::context::{
    self, read_archive, valid_digest, ArchiveRef, ContextError, Manifest, CHUNK_BYTES, KEEP_MS,
    MAX_DIGESTS, MAX_HELD_BYTES,
};
use crate::domain::image::steps::CopyPlan;
use crate::error::{ApiError, ApiResult};
use crate::AppState;

/// One at a time: a PUT's check of what its key holds and its write.
static PUTS: Mutex<()> = Mutex::new(());

fn root(st: &AppState) -> PathBuf {
    st.config().data_dir.join("images").join("context")
}

/// The directory of a key's chunks: named by a hash of its id, so no id
/// can name a path.
fn key_dir(st: &AppState, key_id: &str) -> PathBuf {
    root(st).join(&sha256_hex(key_id.as_bytes())[..32])
}

fn io_err(what: &'static str) -> impl Fn(std::io::Error) -> ApiError {
    move |e| ApiError::Internal {
        what: format!("{what}: {e}"),
    }
}

/// Marks a chunk used now (its modification time is its last use).
fn touch(p: &Path) {
    if let Ok(f) = fs::File::options().append(true).open(p) {
        let _ = f.set_modified(SystemTime::now());
    }
}

/// `POST /v1/images/context/missing`: which of `digests` the caller has
/// not uploaded (in the order asked, each once).
pub(crate) fn missing(st: &AppState, key: &KeyInfo, digests: &[String]) -> ApiResult<Vec<String>> {
    if digests.len() > MAX_DIGESTS {
        return Err(ApiError::invalid(
            "digests",
            format!("at most {MAX_DIGESTS} digests"),
        ));
    }
    if let Some(bad) = digests.iter().find(|d| !valid_digest(d)) {
        return Err(ApiError::invalid(
            "digests",
            format!("{bad} is not a SHA-256 (64 lowercase hex digits)"),
        ));
    }
    let dir = key_dir(st, &key.id);
    let mut out: Vec<String> = Vec::new();
    for d in digests {
        let p = dir.join(d);
        if p.is_file() {
            touch(&p);
        } else if !out.contains(d) {
            out.push(d.clone());
        }
    }
    Ok(out)
}

/// `PUT /v1/images/context/{sha256}`: keeps one chunk for the caller.
pub(crate) fn put(
    st: &AppState,
    key: &KeyInfo,
    sha: &str,
    body: &[u8],
) -> ApiResult<serde_json::Value> {
    if !valid_digest(sha) {
        return Err(ApiError::invalid(
            "sha256",
            format!("{sha} is not a SHA-256 (64 lowercase hex digits)"),
        ));
    }
    if body.is_empty() || body.len() > CHUNK_BYTES {
        return Err(ApiError::invalid(
            "body",
            format!("a chunk is 1 to {CHUNK_BYTES} bytes"),
        ));
    }
    let got = sha256_hex(body);
    if got != sha {
        return Err(ApiError::invalid(
            "body",
            format!("the body's SHA-256 is {got}, not {sha}"),
        ));
    }
    let dir = key_dir(st, &key.id);
    let p = dir.join(sha);
    let _g = PUTS.lock().unwrap_or_else(|e| e.into_inner());
    if p.is_file() {
        touch(&p);
    } else {
        let held = held_bytes(&dir);
        if held + body.len() as u64 > MAX_HELD_BYTES {
            return Err(ApiError::Conflict {
                code: runtime_api::codes::QUOTA_EXCEEDED,
                message: format!(
                    "This key holds {held} bytes of build context chunks; the most is {MAX_HELD_BYTES}. Chunks go a day after their last use."
                ),
                details: Some(json!({ "limit": MAX_HELD_BYTES, "held": held })),
            });
        }
        fs::create_dir_all(&dir).map_err(io_err("make the context directory"))?;
        let tmp = dir.join(format!(".{sha}.{}", uuid::Uuid::new_v4()));
        fs::write(&tmp, body).map_err(io_err("write a context chunk"))?;
        fs::rename(&tmp, &p).map_err(io_err("keep a context chunk"))?;
    }
    Ok(json!({ "sha256": sha, "size": body.len() }))
}

fn held_bytes(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter_map(|e| e.metadata().ok())
                .filter(|m| m.is_file())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// Reads the chunks of an archive, in order, as one stream.
struct Chunks {
    files: Vec<PathBuf>,
    at: usize,
    cur: Option<fs::File>,
}

impl Read for Chunks {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            if self.cur.is_none() {
                let Some(p) = self.files.get(self.at) else {
                    return Ok(0);
                };
                self.cur = Some(fs::File::open(p)?);
                self.at += 1;
            }
            if let Some(f) = self.cur.as_mut() {
                let n = f.read(buf)?;
                if n > 0 {
                    return Ok(n);
                }
            }
            self.cur = None;
        }
    }
}

/// Hashes and counts what passes through.
struct Hashing<R> {
    inner: R,
    hash: Sha256,
    len: u64,
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        self.len += n as u64;
        Ok(n)
    }
}

/// The chunk files of `a`, each there (refreshed), or the 400 naming every
/// one missing.
fn chunk_files(st: &AppState, key_id: &str, a: &ArchiveRef) -> Result<Vec<PathBuf>, ContextError> {
    let dir = key_dir(st, key_id);
    let files: Vec<PathBuf> = a.chunks.iter().map(|c| dir.join(c)).collect();
    let mut missing: Vec<String> = Vec::new();
    for (c, p) in a.chunks.iter().zip(&files) {
        if p.is_file() {
            touch(p);
        } else if !missing.contains(c) {
            missing.push(c.clone());
        }
    }
    if !missing.is_empty() {
        return Err(ContextError::Missing(missing));
    }
    Ok(files)
}

/// Reads the archive a build names, checks it (chunks there, size and
/// SHA-256, every entry), and answers what it holds. Runs off the async
/// threads: it reads and unpacks up to the context's limits.
pub(crate) async fn manifest(
    st: &AppState,
    key_id: &str,
    a: &ArchiveRef,
) -> Result<Manifest, ContextError> {
    let files = chunk_files(st, key_id, a)?;
    let a = a.clone();
    let r = tokio::task::spawn_blocking(move || {
        let mut h = Hashing {
            inner: Chunks {
                files,
                at: 0,
                cur: None,
            },
            hash: Sha256::new(),
            len: 0,
        };
        let m = read_archive(&mut h);
        // Read to the end, so the hash covers every chunk.
        let mut sink = [0u8; 64 << 10];
        while let Ok(n) = h.read(&mut sink) {
            if n == 0 {
                break;
            }
            if h.len > a.size {
                break;
            }
        }
        let sha = hex::encode(h.hash.finalize());
        if h.len != a.size || sha != a.sha256 {
            return Err(ContextError::ArchiveMismatch {
                got: h.len,
                sha256: sha,
            });
        }
        m
    })
    .await;
    r.unwrap_or_else(|e| Err(ContextError::NotAnArchive(e.to_string())))
}

/// The most bytes one piece written into a build machine has.
const PIECE_BYTES: usize = 8 << 20;

/// Cuts what is written into pieces sent on.
struct Pieces {
    buf: Vec<u8>,
    tx: mpsc::Sender<Vec<u8>>,
}

impl std::io::Write for Pieces {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let room = PIECE_BYTES - self.buf.len();
        let n = data.len().min(room);
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() >= PIECE_BYTES {
            self.flush_piece()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Pieces {
    fn flush_piece(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let piece = std::mem::replace(&mut self.buf, Vec::with_capacity(PIECE_BYTES));
        self.tx
            .blocking_send(piece)
            .map_err(|_| std::io::Error::other("the build stopped taking pieces"))
    }
}

/// Why the files of a COPY could not be placed.
#[derive(Debug, thiserror::Error)]
pub(super) enum PlaceError {
    #[error("the build context is gone: {0}")]
    Context(#[from] ContextError),
    #[error("reading the build context failed: {0}")]
    Read(std::io::Error),
    #[error("writing into the build machine failed: {0}")]
    Write(runtime_host::HostError),
}

/// Writes a tar of `plan`'s entries, read from the archive, into machine
/// `vm` as pieces `plan.dir/part-000000`, … (root's, 0600): the step's
/// script unpacks them. Memory stays within a few pieces.
pub(super) async fn place(
    st: &AppState,
    key_id: &str,
    archive: &ArchiveRef,
    plan: &CopyPlan,
    vm: &str,
) -> Result<(), PlaceError> {
    let files = chunk_files(st, key_id, archive)?;
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(2);
    let plan2 = plan.clone();
    let producer = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        let mut by_src: std::collections::HashMap<
            &str,
            Vec<&crate::domain::image::steps::CopyEntry>,
        > = std::collections::HashMap::new();
        for e in plan2.entries.iter().filter(|e| !e.dir) {
            by_src.entry(e.src.as_str()).or_default().push(e);
        }
        let mut out = tar::Builder::new(Pieces {
            buf: Vec::with_capacity(PIECE_BYTES),
            tx,
        });
        // Directories first, so files land in them with their owner.
        for e in plan2.entries.iter().filter(|e| e.dir) {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Directory);
            h.set_size(0);
            h.set_mode(e.mode);
            h.set_uid(u64::from(e.uid));
            h.set_gid(u64::from(e.gid));
            h.set_mtime(0);
            out.append_data(&mut h, format!("{}/", e.dst), std::io::empty())?;
        }
        let mut ar = tar::Archive::new(flate2::read::GzDecoder::new(Chunks {
            files,
            at: 0,
            cur: None,
        }));
        for entry in ar.entries()? {
            let mut entry = entry?;
            let raw = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
            let Some(path) = context::clean_path(&raw) else {
                continue;
            };
            let Some(targets) = by_src.get(path.as_str()) else {
                continue;
            };
            let size = entry.header().size()?;
            if targets.len() == 1 {
                let e = targets[0];
                let mut h = file_header(e, size);
                out.append_data(&mut h, &e.dst, &mut entry)?;
            } else {
                // The same file in several places (bounded by the context's size).
                let mut data = Vec::new();
                entry.read_to_end(&mut data)?;
                for e in targets {
                    let mut h = file_header(e, size);
                    out.append_data(&mut h, &e.dst, &data[..])?;
                }
            }
        }
        let mut w = out.into_inner()?;
        w.flush_piece()
    });
    let mut n = 0usize;
    let mut write_err = None;
    while let Some(piece) = rx.recv().await {
        let path = format!("{}/part-{n:06}", plan.dir);
        n += 1;
        if let Err(e) = st
            .host()
            .write_file(vm, &path, Some(0o600), runtime_host::RunAs::Root, piece)
            .await
        {
            write_err = Some(e);
            break;
        }
    }
    drop(rx);
    let produced = producer
        .await
        .unwrap_or_else(|e| Err(std::io::Error::other(e.to_string())));
    if let Some(e) = write_err {
        return Err(PlaceError::Write(e));
    }
    produced.map_err(PlaceError::Read)
}

fn file_header(e: &crate::domain::image::steps::CopyEntry, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(tar::EntryType::Regular);
    h.set_size(size);
    h.set_mode(e.mode);
    h.set_uid(u64::from(e.uid));
    h.set_gid(u64::from(e.gid));
    h.set_mtime(0);
    h
}

/// Removes chunks unused for [`KEEP_MS`], and every chunk of a key that is
/// no more.
pub(crate) fn prune(st: &AppState) {
    let Ok(keys) = st.store().live_key_ids() else {
        return;
    };
    let live: std::collections::HashSet<String> = keys
        .iter()
        .map(|k| sha256_hex(k.as_bytes())[..32].to_string())
        .collect();
    let Ok(rd) = fs::read_dir(root(st)) else {
        return;
    };
    let cutoff = SystemTime::now()
        .checked_sub(Duration::from_millis(KEEP_MS as u64))
        .unwrap_or(SystemTime::UNIX_EPOCH);
    let _g = PUTS.lock().unwrap_or_else(|e| e.into_inner());
    for d in rd.filter_map(Result::ok) {
        let name = d.file_name().to_string_lossy().into_owned();
        if !live.contains(&name) {
            if let Err(e) = fs::remove_dir_all(d.path()) {
                tracing::warn!(error = %e, "removing a gone key's context chunks failed");
            }
            continue;
        }
        let Ok(chunks) = fs::read_dir(d.path()) else {
            continue;
        };
        for c in chunks.filter_map(Result::ok) {
            let old = c
                .metadata()
                .and_then(|m| m.modified())
                .map(|t| t < cutoff)
                .unwrap_or(false);
            if old {
                if let Err(e) = fs::remove_file(c.path()) {
                    tracing::warn!(error = %e, "removing an old context chunk failed");
                }
            }
        }
    }
}
