//! Folders as tar archives (`GET`/`PUT …/files/archive`), packed and
//! unpacked by the sandbox's own tar, as the client documents: a folder
//! goes out as the guest's tar writes it (never held whole), and one comes
//! in through the guest's tar, which keeps every member inside the target
//! (leading `/` and `..` are stripped). Large archives come in as chunked
//! uploads ([`crate::service::uploads`]) and are streamed from the host's
//! disk to the guest's tar at their commit.

use std::time::Duration;

use futures::Stream;
use runtime_api::codes;
use runtime_host::{ExecControl, ExecEvent, ExecSpec, GuestFailure, HostError, RunAs};

use crate::domain::access::KeyInfo;
use crate::error::{ApiError, ApiResult};
use crate::service::files::user_of;
use crate::service::sandboxes::find_running;
use crate::AppState;

/// The longest a pack or an unpack may run.
const TAR_TIMEOUT: Duration = Duration::from_secs(3600);
/// How much of tar's complaints is kept for the error.
const MAX_STDERR: usize = 4096;

/// What `GET …/files/archive` asks.
pub(crate) struct Pack {
    pub(crate) path: String,
    pub(crate) gzip: bool,
    pub(crate) user: Option<String>,
    /// Paths relative to `path`, left out with what is under them.
    pub(crate) exclude: Vec<String>,
}

pub(crate) fn tar_spec(argv: Vec<String>, user: RunAs, stdin: bool) -> ExecSpec {
    ExecSpec {
        argv,
        cwd: None,
        env: Vec::new(),
        user,
        timeout: Some(TAR_TIMEOUT),
        stdin,
        pty: None,
        kill_group_on_exit: true,
        trace_files: false,
    }
}

/// The guest's tar failing on `path`, in the one error shape: a missing
/// folder, a file where a folder should be and a refusal as the file calls
/// answer them; anything else (an archive tar cannot read) names `field`.
fn tar_failed(id: &str, path: &str, stderr: &[u8], field: &'static str) -> ApiError {
    let text = String::from_utf8_lossy(stderr);
    let line = text
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("tar failed")
        .trim()
        .to_string();
    let guest = |failure, message: String| {
        ApiError::Host(HostError::Guest {
            id: id.to_string(),
            failure,
            message,
        })
    };
    if let Some(member) = text
        .lines()
        .find_map(|l| l.strip_prefix("runtime: a member outside the folder: "))
    {
        return ApiError::BadField {
            code: codes::INVALID_REQUEST,
            field,
            message: format!(
                "The archive has a member outside the folder ({member}): nothing was unpacked."
            ),
        };
    }
    if text.contains("No such file or directory") {
        guest(
            GuestFailure::FileNotFound,
            format!("{path} does not exist."),
        )
    } else if text.contains("Not a directory") || text.contains("File exists") {
        guest(
            GuestFailure::NotADirectory,
            format!("{path} is not a folder."),
        )
    } else if text.contains("Permission denied") {
        guest(GuestFailure::PermissionDenied, format!("{path}: {line}"))
    } else {
        ApiError::BadField {
            code: codes::INVALID_REQUEST,
            field,
            message: format!("The sandbox's tar could not use it: {line}"),
        }
    }
}

fn keep_stderr(into: &mut Vec<u8>, b: &[u8]) {
    let room = MAX_STDERR.saturating_sub(into.len());
    into.extend_from_slice(&b[..b.len().min(room)]);
}

/// `GET …/files/archive`: the folder as a tar stream (gzipped when asked),
/// as the guest's tar writes it. A folder that cannot be read fails before
/// the first byte; a pack that fails part way cuts the stream (the client
/// sees it short, never as a whole archive).
pub(crate) async fn pack(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    p: Pack,
) -> ApiResult<impl Stream<Item = Result<Vec<u8>, std::io::Error>>> {
    let row = find_running(st, key, id).await?;
    let mut argv: Vec<String> = ["tar", "-c"].iter().map(|s| s.to_string()).collect();
    if p.gzip {
        argv.push("-z".into());
    }
    argv.extend(["-f", "-", "-C", &p.path, "--no-wildcards", "--anchored"].map(String::from));
    for e in &p.exclude {
        argv.push(format!("--exclude=./{e}"));
    }
    argv.push(".".into());
    let mut h = st
        .host()
        .exec(id, tar_spec(argv, user_of(&row, p.user.as_deref()), false))
        .await?;
    // Up to the first byte: a folder tar cannot read is an error answer.
    let mut stderr = Vec::new();
    let first = loop {
        match h.events.recv().await {
            Some(ExecEvent::Stdout(b)) if !b.is_empty() => break b,
            Some(ExecEvent::Stdout(_)) => {}
            Some(ExecEvent::Stderr(b)) => keep_stderr(&mut stderr, &b),
            Some(ExecEvent::Exited(x)) => {
                tracing::debug!(sandbox_id = id, code = ?x.code, "packing a folder failed");
                return Err(tar_failed(id, &p.path, &stderr, "path"));
            }
            None => {
                return Err(ApiError::Internal {
                    what: "the sandbox's tar ended without an exit".into(),
                })
            }
        }
    };
    let cut = |why: String| Err(std::io::Error::other(why));
    Ok(futures::stream::unfold(
        (Some(first), h, false),
        move |(pending, mut h, done)| async move {
            if let Some(b) = pending {
                return Some((Ok(b), (None, h, false)));
            }
            if done {
                return None;
            }
            loop {
                match h.events.recv().await {
                    Some(ExecEvent::Stdout(b)) => return Some((Ok(b), (None, h, false))),
                    Some(ExecEvent::Stderr(_)) => {}
                    Some(ExecEvent::Exited(x)) if x.code == Some(0) => return None,
                    Some(ExecEvent::Exited(x)) => {
                        return Some((
                            cut(format!("tar exited with {:?}", x.code)),
                            (None, h, true),
                        ))
                    }
                    None => {
                        return Some((cut("the sandbox's tar was lost".into()), (None, h, true)))
                    }
                }
            }
        },
    ))
}

/// The bytes of an archive to unpack: a body in memory (a one-shot `PUT`,
/// at most 1 MiB) or an upload's file on the host's disk, read in pieces.
pub(crate) enum Source {
    Memory(Vec<u8>),
    File {
        path: std::path::PathBuf,
        size: u64,
        /// What the upload said; checked against the first bytes.
        gzip: Option<bool>,
    },
}

/// Why an unpack did not happen.
pub(crate) enum UnpackError {
    /// Nothing reached the sandbox's tar (not running, no link, a host
    /// file that could not be read): it may be tried again.
    NotStarted(ApiError),
    /// The sandbox's tar refused the archive, or it stopped part way:
    /// nothing of it was unpacked.
    Refused(ApiError),
}

/// How many bytes the guest takes per acknowledgement, and how far the
/// host may run ahead of the last one: what is in flight between the two
/// (in the link's queues and the agent's) never passes `ACK_WINDOW`.
const ACK_BLOCK: u64 = 1 << 20;
const ACK_WINDOW: u64 = 8 << 20;
/// The pieces the host reads an upload's file in.
const PIECE: usize = 256 << 10;

/// The guest's side of an unpack: takes `$3` bytes from stdin into a file
/// on its disk (`/var/tmp`, not the memory-backed `/tmp`), saying how many
/// are left after each block of `$4`, so the host sends no faster than it
/// is taken; then checks the archive whole before anything is written (a
/// member that names a parent (`..`) refuses it, so nothing is half
/// unpacked) and unpacks it into `$1`, made if missing.
const UNPACK_SCRIPT: &str = r#"set -e
t=$(mktemp -p /var/tmp 2>/dev/null || mktemp)
trap 'rm -f "$t"' EXIT
left=$3
while [ "$left" -gt 0 ]; do
  n=$4
  if [ "$left" -lt "$n" ]; then n=$left; fi
  head -c "$n" >> "$t"
  left=$((left - n))
  if [ "$(stat -c %s "$t")" -ne $(($3 - left)) ]; then
    echo "runtime: the archive ended early" >&2
    exit 4
  fi
  echo "$left"
done
names=$(tar -t $2 -f "$t")
bad=$(printf '%s\n' "$names" | grep -E '(^|/)\.\.(/|$)' | head -n 1) || true
if [ -n "$bad" ]; then
  echo "runtime: a member outside the folder: $bad" >&2
  exit 3
fi
mkdir -p -- "$1"
tar -x $2 -f "$t" -C "$1" --no-same-owner"#;

/// `PUT …/files/archive`: unpacks `data` (a tar, gzipped or not) into the
/// folder `path`, made if missing, merging with what is there. Answers the
/// bytes unpacked from.
pub(crate) async fn unpack(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    path: &str,
    user: Option<&str>,
    data: Vec<u8>,
) -> ApiResult<usize> {
    let row = find_running(st, key, id).await?;
    let size = data.len();
    match unpack_into(st, id, path, user_of(&row, user), Source::Memory(data)).await {
        Ok(()) => Ok(size),
        Err(UnpackError::NotStarted(e) | UnpackError::Refused(e)) => Err(e),
    }
}

/// Reads up to `PIECE` bytes of `file` (`None` at its end).
async fn next_piece(
    file: &mut tokio::fs::File,
    left: &mut u64,
) -> std::io::Result<Option<Vec<u8>>> {
    use tokio::io::AsyncReadExt;
    if *left == 0 {
        return Ok(None);
    }
    let want = (*left).min(PIECE as u64) as usize;
    let mut buf = vec![0u8; want];
    file.read_exact(&mut buf).await?;
    *left -= want as u64;
    Ok(Some(buf))
}

/// Unpacks `source` into the folder `path` of the running sandbox `id`
/// as `user`: the bytes go to the guest's tar as it takes them, never more
/// than [`ACK_WINDOW`] ahead, so neither side holds a large archive in
/// memory.
pub(crate) async fn unpack_into(
    st: &AppState,
    id: &str,
    path: &str,
    user: RunAs,
    source: Source,
) -> Result<(), UnpackError> {
    let not_started = UnpackError::NotStarted;
    let refused = UnpackError::Refused;
    let io = |op: &'static str, p: &std::path::Path| {
        let path = p.display().to_string();
        move |source| {
            UnpackError::NotStarted(ApiError::Server(crate::error::ServerError::Io {
                op,
                path,
                source,
            }))
        }
    };
    // The first bytes say whether it is gzipped.
    let (size, gzip, mut bytes, mut file) = match source {
        Source::Memory(data) => {
            let gzip = data.starts_with(&[0x1f, 0x8b]);
            (data.len() as u64, gzip, Some(data), None)
        }
        Source::File {
            path: p,
            size,
            gzip,
        } => {
            use tokio::io::{AsyncReadExt, AsyncSeekExt};
            let mut f = tokio::fs::File::open(&p)
                .await
                .map_err(io("open upload file", &p))?;
            let mut magic = [0u8; 2];
            let n = f
                .read(&mut magic)
                .await
                .map_err(io("read upload file", &p))?;
            f.seek(std::io::SeekFrom::Start(0))
                .await
                .map_err(io("read upload file", &p))?;
            let is_gzip = n == 2 && magic == [0x1f, 0x8b];
            if let Some(said) = gzip.filter(|&said| said != is_gzip) {
                return Err(refused(ApiError::invalid(
                    "gzip",
                    format!(
                        "was {said}, but the archive's first bytes say it is {}gzipped",
                        if is_gzip { "" } else { "not " }
                    ),
                )));
            }
            (size, is_gzip, None, Some(f))
        }
    };
    let argv = [
        "sh",
        "-c",
        UNPACK_SCRIPT,
        "unpack",
        path,
        if gzip { "-z" } else { "" },
        &size.to_string(),
        &ACK_BLOCK.to_string(),
    ]
    .map(String::from)
    .to_vec();
    let mut h = st
        .host()
        .exec(id, tar_spec(argv, user, true))
        .await
        .map_err(|e| not_started(e.into()))?;
    let mut stderr = Vec::new();
    let (mut sent, mut acked) = (0u64, 0u64);
    let mut file_left = size;
    let mut stdout_line = Vec::new();
    let mut closed = false;
    loop {
        // Send while the guest is less than a window behind.
        while !closed && sent < acked + ACK_WINDOW {
            let piece = if let Some(data) = bytes.take() {
                Some(data)
            } else if let Some(f) = file.as_mut() {
                match next_piece(f, &mut file_left).await {
                    Ok(p) => p,
                    Err(e) => {
                        // The guest's tar sees the archive end early and
                        // unpacks nothing.
                        let _ = h.control.send(ExecControl::CloseStdin).await;
                        return Err(refused(ApiError::Server(crate::error::ServerError::Io {
                            op: "read upload file",
                            path: "the upload's file".into(),
                            source: e,
                        })));
                    }
                }
            } else {
                None
            };
            match piece {
                Some(p) if !p.is_empty() => {
                    sent += p.len() as u64;
                    // The receiver gone means tar ended; its exit says why.
                    let _ = h.control.send(ExecControl::Stdin(p)).await;
                }
                _ => {
                    let _ = h.control.send(ExecControl::CloseStdin).await;
                    closed = true;
                }
            }
        }
        match h.events.recv().await {
            Some(ExecEvent::Stderr(b)) => keep_stderr(&mut stderr, &b),
            Some(ExecEvent::Stdout(b)) => {
                // Each line: the bytes the guest still waits for.
                stdout_line.extend_from_slice(&b);
                while let Some(nl) = stdout_line.iter().position(|&c| c == b'\n') {
                    let line: Vec<u8> = stdout_line.drain(..=nl).collect();
                    if let Some(left) = std::str::from_utf8(&line)
                        .ok()
                        .and_then(|l| l.trim().parse::<u64>().ok())
                    {
                        acked = acked.max(size.saturating_sub(left));
                    }
                }
                stdout_line.truncate(64);
            }
            Some(ExecEvent::Exited(x)) if x.code == Some(0) => return Ok(()),
            Some(ExecEvent::Exited(_)) => {
                return Err(refused(tar_failed(id, path, &stderr, "body")))
            }
            None => {
                return Err(refused(ApiError::Internal {
                    what: "the sandbox's tar ended without an exit".into(),
                }))
            }
        }
    }
}
