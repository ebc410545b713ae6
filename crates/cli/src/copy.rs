//! `runtime sandbox cp SRC DST`: one side names a sandbox path
//! (`SBX:/path`), the other a local one. Files travel through the files
//! content route (≤ 1 MiB) or chunked uploads (larger), keeping their
//! mode; folders as tar archives (`…/files/archive`), sent in batches that
//! each fit the API's 1 MiB body, with the larger files uploaded on their
//! own. A folder's copy is the folder itself at the destination (made if
//! missing, merged with what is there); a destination ending in `/` gets
//! the source's name appended.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use bytes::Bytes;
use http_body_util::BodyExt;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::client::{enc, Target};
use crate::sandbox::resolve;
use crate::tar::{self, Entry, Kind};

/// The API's largest body.
const MAX_BODY: usize = 1 << 20;

/// One side of a copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Location {
    Local(PathBuf),
    Remote { sandbox: String, path: String },
}

/// `SBX:/path` (a relative path is under `/workspace`), else a local path.
/// A colon after a `/` (`./a:b`) or a first part that is empty is local.
pub(crate) fn parse_location(s: &str) -> Location {
    if let Some((sbx, path)) = s.split_once(':') {
        if !sbx.is_empty() && !sbx.contains('/') && !sbx.starts_with('.') {
            let path = if path.starts_with('/') {
                path.to_string()
            } else if path.is_empty() {
                "/workspace".to_string()
            } else {
                format!("/workspace/{path}")
            };
            return Location::Remote {
                sandbox: sbx.to_string(),
                path,
            };
        }
    }
    Location::Local(PathBuf::from(s))
}

/// The last component of a path, for a destination that is a folder.
fn base_name(p: &str) -> &str {
    p.trim_end_matches('/').rsplit('/').next().unwrap_or("")
}

pub(crate) async fn run(t: &Target, src: &str, dst: &str) -> anyhow::Result<()> {
    match (parse_location(src), parse_location(dst)) {
        (Location::Local(from), Location::Remote { sandbox, path }) => {
            let id = resolve(t, &sandbox).await?;
            upload(t, &id, &from, &path).await
        }
        (Location::Remote { sandbox, path }, Location::Local(to)) => {
            let id = resolve(t, &sandbox).await?;
            download(t, &id, &path, &to).await
        }
        (Location::Local(_), Location::Local(_)) => {
            bail!("neither side names a sandbox: write one as SANDBOX:/path")
        }
        (Location::Remote { .. }, Location::Remote { .. }) => {
            bail!("both sides name a sandbox: copy through this machine in two steps")
        }
    }
}

fn files_path(id: &str, what: &str, path: &str) -> String {
    format!("/v1/sandboxes/{}/files/{what}?path={}", enc(id), enc(path))
}

async fn stat(t: &Target, id: &str, path: &str) -> anyhow::Result<Value> {
    t.json("GET", &files_path(id, "stat", path), None).await
}

async fn upload(t: &Target, id: &str, from: &Path, to: &str) -> anyhow::Result<()> {
    let meta = std::fs::metadata(from).with_context(|| format!("reading {}", from.display()))?;
    let name = from
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("")
        .to_string();
    let mut dest = to.to_string();
    if dest.ends_with('/') {
        dest.push_str(&name);
    } else if meta.is_file() {
        // Into a folder that is there, as cp does.
        let s = stat(t, id, &dest).await?;
        if s["exists"] == true && s["type"] == "directory" {
            dest = format!("{}/{name}", dest.trim_end_matches('/'));
        }
    }
    if meta.is_dir() {
        let n = upload_dir(t, id, from, &dest).await?;
        eprintln!("runtime: copied {n} entries to {id}:{dest}");
    } else {
        let data = std::fs::read(from).with_context(|| format!("reading {}", from.display()))?;
        let mode = meta.permissions().mode() & 0o777;
        upload_file(t, id, &dest, data, mode).await?;
        eprintln!("runtime: copied {} to {id}:{dest}", from.display());
    }
    Ok(())
}

/// One file, whole or in chunks.
async fn upload_file(
    t: &Target,
    id: &str,
    path: &str,
    data: Vec<u8>,
    mode: u32,
) -> anyhow::Result<()> {
    let mode = format!("{mode:03o}");
    if data.len() <= MAX_BODY {
        let q = format!(
            "/v1/sandboxes/{}/files/content?path={}&mode={mode}",
            enc(id),
            enc(path)
        );
        t.put_bytes(&q, Bytes::from(data)).await?;
        return Ok(());
    }
    let sha = hex::encode(Sha256::digest(&data));
    let begin = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{}/uploads", enc(id)),
            Some(&json!({"path": path, "size": data.len(), "sha256": sha, "mode": mode})),
        )
        .await?;
    let up = begin["uploadId"]
        .as_str()
        .context("the upload has no id")?
        .to_string();
    let chunk = begin["chunkBytes"]
        .as_u64()
        .filter(|c| *c > 0)
        .unwrap_or(MAX_BODY as u64) as usize;
    let data = Bytes::from(data);
    let base = format!("/v1/sandboxes/{}/uploads/{}", enc(id), enc(&up));
    let mut offset = 0;
    let result = async {
        while offset < data.len() {
            let end = (offset + chunk).min(data.len());
            t.put_bytes(&format!("{base}?offset={offset}"), data.slice(offset..end))
                .await?;
            offset = end;
        }
        t.json("POST", &format!("{base}:commit"), Some(&json!({})))
            .await
    }
    .await;
    if let Err(e) = result {
        let _ = t
            .json("POST", &format!("{base}:abort"), Some(&json!({})))
            .await;
        return Err(e);
    }
    Ok(())
}

/// A folder: its small members in tar batches, its large files one by one.
async fn upload_dir(t: &Target, id: &str, from: &Path, to: &str) -> anyhow::Result<usize> {
    // Room for the end blocks in every batch.
    let limit = MAX_BODY - 2048;
    let mut batch = Vec::new();
    let mut large = Vec::new();
    let mut count = 0;
    let send = |batch: Vec<u8>| async move {
        let mut b = batch;
        tar::finish(&mut b);
        t.put_bytes(&files_path(id, "archive", to), Bytes::from(b))
            .await
    };
    // The folder itself first, so an empty one is made too.
    let root_mode = std::fs::metadata(from)?.permissions().mode() & 0o7777;
    tar::append(
        &mut batch,
        &Entry {
            name: ".".into(),
            mode: root_mode,
            kind: Kind::Dir,
        },
    );
    for (rel, path, meta) in tar::walk(from)? {
        let mode = meta.permissions().mode() & 0o7777;
        let kind = if meta.file_type().is_symlink() {
            let target = std::fs::read_link(&path)?;
            Kind::Symlink(target.to_string_lossy().into_owned())
        } else if meta.is_dir() {
            Kind::Dir
        } else if meta.is_file() {
            if meta.len() as usize > limit / 2 {
                large.push((rel, path, mode));
                count += 1;
                continue;
            }
            Kind::File(std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?)
        } else {
            eprintln!(
                "runtime: skipping {} (not a file, folder or link)",
                path.display()
            );
            continue;
        };
        let e = Entry {
            name: rel,
            mode,
            kind,
        };
        if batch.len() + tar::size_of(&e) > limit {
            send(std::mem::take(&mut batch)).await?;
        }
        tar::append(&mut batch, &e);
        count += 1;
    }
    send(batch).await?;
    for (rel, path, mode) in large {
        let data = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        let dest = format!("{}/{rel}", to.trim_end_matches('/'));
        crate::output::progress(&format!(
            "uploading {} ({} bytes)",
            path.display(),
            data.len()
        ));
        upload_file(t, id, &dest, data, mode & 0o777).await?;
    }
    Ok(count)
}

async fn download(t: &Target, id: &str, from: &str, to: &Path) -> anyhow::Result<()> {
    let s = stat(t, id, from).await?;
    if s["exists"] == false {
        bail!("{id}:{from} does not exist");
    }
    let mut dest = to.to_path_buf();
    let ends_slash = to.to_string_lossy().ends_with('/');
    if ends_slash || (s["type"] != "directory" && to.is_dir()) {
        dest = dest.join(base_name(from));
    }
    if s["type"] == "directory" {
        let n = download_dir(t, id, from, &dest).await?;
        eprintln!("runtime: copied {n} entries to {}", dest.display());
        return Ok(());
    }
    let resp = t
        .get_stream(&files_path(id, "content", from), "application/octet-stream")
        .await?;
    let want: Option<u64> = resp
        .headers()
        .get("x-content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let sha: Option<String> = resp
        .headers()
        .get("x-content-sha256")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let data = resp.into_body().collect().await?.to_bytes();
    if let Some(n) = want {
        if n != data.len() as u64 {
            bail!(
                "download_incomplete: {from} is {n} bytes but {} arrived",
                data.len()
            );
        }
    }
    if let Some(h) = sha {
        if hex::encode(Sha256::digest(&data)) != h.to_ascii_lowercase() {
            bail!("download_incomplete: {from} arrived with other bytes than its checksum says");
        }
    }
    let mode = s["mode"]
        .as_str()
        .and_then(|m| u32::from_str_radix(m, 8).ok())
        .unwrap_or(0o644);
    write_file(&dest, &data, mode)?;
    eprintln!("runtime: copied {id}:{from} to {}", dest.display());
    Ok(())
}

/// Writes a whole file under a temporary name, then renames it, so a copy
/// cut short never leaves a short file under the name given.
fn write_file(dest: &Path, data: &[u8], mode: u32) -> anyhow::Result<()> {
    let dir = dest.parent().filter(|p| !p.as_os_str().is_empty());
    let name = dest
        .file_name()
        .context("the destination has no file name")?;
    let tmp = dir.unwrap_or(Path::new(".")).join(format!(
        ".{}.runtime-cp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    std::fs::write(&tmp, data).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode & 0o7777))?;
    std::fs::rename(&tmp, dest).with_context(|| format!("writing {}", dest.display()))?;
    Ok(())
}

async fn download_dir(t: &Target, id: &str, from: &str, to: &Path) -> anyhow::Result<usize> {
    let resp = t
        .get_stream(
            &format!("{}&gzip=false", files_path(id, "archive", from)),
            "application/x-tar",
        )
        .await?;
    let data = resp.into_body().collect().await?.to_bytes();
    let members = tar::read(&data).with_context(|| format!("unpacking {id}:{from}"))?;
    std::fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    let mut n = 0;
    let mut dirs = Vec::new();
    for m in members {
        let path = to.join(&m.path);
        no_link_between(to, &m.path)?;
        match m.kind {
            Kind::Dir => {
                std::fs::create_dir_all(&path)
                    .with_context(|| format!("creating {}", path.display()))?;
                dirs.push((path, m.mode));
            }
            Kind::File(data) => {
                if let Some(p) = path.parent() {
                    std::fs::create_dir_all(p)?;
                }
                write_file(&path, &data, m.mode)?;
            }
            Kind::Symlink(target) => {
                if let Some(p) = path.parent() {
                    std::fs::create_dir_all(p)?;
                }
                let _ = std::fs::remove_file(&path);
                std::os::unix::fs::symlink(&target, &path)
                    .with_context(|| format!("linking {}", path.display()))?;
            }
        }
        n += 1;
    }
    // Modes of folders last, so a read-only one was still written into.
    for (path, mode) in dirs.into_iter().rev() {
        let _ = std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode | 0o700));
    }
    Ok(n)
}

/// Refuses a member whose way down from `root` passes a symbolic link (an
/// archive's link could otherwise carry later members out of the folder).
fn no_link_between(root: &Path, rel: &Path) -> anyhow::Result<()> {
    let mut at = root.to_path_buf();
    let parts: Vec<_> = rel.components().collect();
    for c in parts.iter().take(parts.len().saturating_sub(1)) {
        at.push(c);
        if let Ok(m) = std::fs::symlink_metadata(&at) {
            if m.file_type().is_symlink() {
                bail!(
                    "the archive writes through the link {}; refused",
                    at.display()
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn remote(s: &str, p: &str) -> Location {
        Location::Remote {
            sandbox: s.into(),
            path: p.into(),
        }
    }

    #[test]
    fn locations() {
        assert_eq!(
            parse_location("sbx:/workspace/a"),
            remote("sbx", "/workspace/a")
        );
        assert_eq!(
            parse_location("0b8f3c52-6d8e-4b1f-9c67-2f4e6c1d9a10:/tmp/x"),
            remote("0b8f3c52-6d8e-4b1f-9c67-2f4e6c1d9a10", "/tmp/x")
        );
        assert_eq!(
            parse_location("demo:notes.txt"),
            remote("demo", "/workspace/notes.txt")
        );
        assert_eq!(parse_location("demo:"), remote("demo", "/workspace"));
        assert_eq!(parse_location("./a:b"), Location::Local("./a:b".into()));
        assert_eq!(parse_location("dir/a:b"), Location::Local("dir/a:b".into()));
        assert_eq!(parse_location(":x"), Location::Local(":x".into()));
        assert_eq!(
            parse_location("local.txt"),
            Location::Local("local.txt".into())
        );
        assert_eq!(parse_location("/abs/p"), Location::Local("/abs/p".into()));
    }

    #[test]
    fn base_names() {
        assert_eq!(base_name("/workspace/dir/"), "dir");
        assert_eq!(base_name("/a/b.txt"), "b.txt");
    }

    #[test]
    fn links_inside_the_folder_are_refused() {
        let root = std::env::temp_dir().join(format!("runtime-cp-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("real")).unwrap();
        std::os::unix::fs::symlink("/etc", root.join("link")).unwrap();
        assert!(no_link_between(&root, Path::new("real/file")).is_ok());
        assert!(no_link_between(&root, Path::new("link/passwd")).is_err());
        // The link itself may be replaced.
        assert!(no_link_between(&root, Path::new("link")).is_ok());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
