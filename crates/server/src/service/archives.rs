//! Folders as tar archives (`GET`/`PUT …/files/archive`), packed and
//! unpacked by the sandbox's own tar, as the client documents: a folder
//! goes out as the guest's tar writes it (never held whole), and one comes
//! in through the guest's tar, which keeps every member inside the target
//! (leading `/` and `..` are stripped).

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

fn tar_spec(argv: Vec<String>, user: RunAs, stdin: bool) -> ExecSpec {
    ExecSpec {
        argv,
        cwd: None,
        env: Vec::new(),
        user,
        timeout: Some(TAR_TIMEOUT),
        stdin,
        pty: None,
        kill_group_on_exit: true,
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
    let gzip = data.starts_with(&[0x1f, 0x8b]);
    // Checked whole before anything is written: a member that names a
    // parent (`..`) refuses the archive, so nothing is half unpacked.
    let script = r#"set -e
t=$(mktemp)
trap 'rm -f "$t"' EXIT
cat > "$t"
names=$(tar -t $2 -f "$t")
bad=$(printf '%s\n' "$names" | grep -E '(^|/)\.\.(/|$)' | head -n 1) || true
if [ -n "$bad" ]; then
  echo "runtime: a member outside the folder: $bad" >&2
  exit 3
fi
mkdir -p -- "$1"
tar -x $2 -f "$t" -C "$1" --no-same-owner"#;
    let argv = [
        "sh",
        "-c",
        script,
        "unpack",
        path,
        if gzip { "-z" } else { "" },
    ]
    .map(String::from)
    .to_vec();
    let mut h = st
        .host()
        .exec(id, tar_spec(argv, user_of(&row, user), true))
        .await?;
    let size = data.len();
    // The receiver gone means tar ended; its exit says why.
    let _ = h.control.send(ExecControl::Stdin(data)).await;
    let _ = h.control.send(ExecControl::CloseStdin).await;
    let mut stderr = Vec::new();
    loop {
        match h.events.recv().await {
            Some(ExecEvent::Stderr(b)) => keep_stderr(&mut stderr, &b),
            Some(ExecEvent::Stdout(_)) => {}
            Some(ExecEvent::Exited(x)) if x.code == Some(0) => return Ok(size),
            Some(ExecEvent::Exited(_)) => return Err(tar_failed(id, path, &stderr, "body")),
            None => {
                return Err(ApiError::Internal {
                    what: "the sandbox's tar ended without an exit".into(),
                })
            }
        }
    }
}
