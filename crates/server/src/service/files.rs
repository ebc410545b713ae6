//! Files in a running sandbox (contract §7): content, list, stat and the
//! file actions (mkdir, remove, rename, chmod), each done by the `Host` as
//! the sandbox's user or root. Chunked uploads are in
//! [`crate::service::uploads`].

use runtime_host::{FileEntry, FileOp, FileOpResult, RunAs};

use crate::domain::access::{sha256_hex, KeyInfo};
use crate::domain::files::listed;
use crate::error::{ApiError, ApiResult};
use crate::service::sandboxes::find_running;
use crate::store::SandboxRow;
use crate::AppState;

/// Who a file call acts as: the `user` it asked for (`sandbox` or `root`),
/// else the sandbox's own.
pub(crate) fn user_of(row: &SandboxRow, asked: Option<&str>) -> RunAs {
    match asked.unwrap_or(row.record.user.as_str()) {
        "root" => RunAs::Root,
        _ => RunAs::Sandbox,
    }
}

/// `GET …/files/content`: the file's bytes.
pub(crate) async fn read(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    path: &str,
    user: Option<&str>,
) -> ApiResult<Vec<u8>> {
    let row = find_running(st, key, id).await?;
    Ok(st.host().read_file(id, path, user_of(&row, user)).await?)
}

/// `GET …/files/content`, streamed: the file's size, then its bytes in
/// pieces as the guest sends them.
pub(crate) async fn read_stream(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    path: &str,
    user: Option<&str>,
) -> ApiResult<runtime_host::FileStream> {
    let row = find_running(st, key, id).await?;
    Ok(st
        .host()
        .read_file_stream(id, path, user_of(&row, user))
        .await?)
}

/// A file as written: its path, size and SHA-256.
pub(crate) struct Written {
    pub(crate) path: String,
    pub(crate) size: usize,
    pub(crate) sha256: String,
}

/// What `PUT …/files/content` asks.
pub(crate) struct Write {
    pub(crate) path: String,
    pub(crate) mode: Option<u32>,
    pub(crate) user: Option<String>,
    pub(crate) data: Vec<u8>,
}

/// `PUT …/files/content`: writes the whole file.
pub(crate) async fn write(st: &AppState, key: &KeyInfo, id: &str, w: Write) -> ApiResult<Written> {
    let row = find_running(st, key, id).await?;
    let size = w.data.len();
    let sha256 = sha256_hex(&w.data);
    st.host()
        .write_file(
            id,
            &w.path,
            w.mode,
            user_of(&row, w.user.as_deref()),
            w.data,
        )
        .await?;
    Ok(Written {
        path: w.path,
        size,
        sha256,
    })
}

/// What `GET …/files/list` asks.
pub(crate) struct List {
    pub(crate) path: String,
    pub(crate) depth: u32,
    pub(crate) glob: Option<String>,
    pub(crate) hidden: bool,
    pub(crate) limit: u32,
    pub(crate) user: Option<String>,
}

/// `GET …/files/list`: the entries under a path that match the glob (at
/// most `limit`), and whether the host stopped early.
pub(crate) async fn list(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    l: List,
) -> ApiResult<(Vec<FileEntry>, bool)> {
    let row = find_running(st, key, id).await?;
    let op = FileOp::List {
        path: l.path.clone(),
        depth: l.depth,
        hidden: l.hidden,
        // A glob filters here, so the host lists all it may.
        limit: if l.glob.is_some() { 100_000 } else { l.limit },
    };
    let (entries, truncated) = match st
        .host()
        .file_op(id, op, user_of(&row, l.user.as_deref()))
        .await?
    {
        FileOpResult::Listing { entries, truncated } => (entries, truncated),
        other => {
            return Err(ApiError::Internal {
                what: format!("list answered {other:?}"),
            })
        }
    };
    let kept = entries
        .into_iter()
        .filter(|e| listed(l.glob.as_deref(), &l.path, &e.path, &e.name))
        .take(l.limit as usize)
        .collect();
    Ok((kept, truncated))
}

/// `GET …/files/stat`: the entry, or `None` when nothing is there.
pub(crate) async fn stat(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    path: String,
    user: Option<&str>,
) -> ApiResult<Option<FileEntry>> {
    let row = find_running(st, key, id).await?;
    match st
        .host()
        .file_op(id, FileOp::Stat { path }, user_of(&row, user))
        .await?
    {
        FileOpResult::Stat(e) => Ok(e),
        other => Err(ApiError::Internal {
            what: format!("stat answered {other:?}"),
        }),
    }
}

/// `POST …/files:{mkdir,remove,rename,chmod}`: does `op`. Answers whether
/// something was removed (a remove the host did not say about counts as
/// removed); `None` for the other actions.
pub(crate) async fn act(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    op: FileOp,
    user: Option<&str>,
) -> ApiResult<Option<bool>> {
    let row = find_running(st, key, id).await?;
    let remove = matches!(op, FileOp::Remove { .. });
    let result = st.host().file_op(id, op, user_of(&row, user)).await?;
    Ok(match result {
        FileOpResult::Removed(r) => Some(r),
        _ if remove => Some(true),
        _ => None,
    })
}
