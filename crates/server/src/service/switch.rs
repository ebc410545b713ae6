//! `:switch-image`: a sandbox moved to another image, keeping its id, name,
//! `/workspace`, volumes, environment, labels, network rules and previews.
//! Its machine ends (its processes with it; a paused one is woken first so
//! that what it wrote reaches its disk) and it boots twice: once more from its old disk, to
//! copy `/workspace` out as a tar onto the host's disk, then from the new
//! image, where that tar is unpacked into `/workspace` before the sandbox
//! is `running` again and the new image's start command runs. Anything
//! else on the old disk (what `sudo` or apt installed, `/etc`) is gone.
//! If a step fails the switch is undone: the sandbox boots its old disk on
//! its old image (its files as they were; a running or paused one's memory
//! is not kept) and the answer is 409 `switch_undone`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use runtime_api::codes;
use runtime_host::{ExecEvent, RunAs};
use serde_json::json;

use crate::domain::access::KeyInfo;
use crate::domain::lifecycle::{Event, SandboxState};
use crate::domain::time::iso;
use crate::error::{ApiError, ApiResult};
use crate::service::archives;
use crate::service::lifecycle::{self, disk_dir, drive, CaptureDir, Op};
use crate::service::sandboxes::{find, settle, wait_until};
use crate::store::SandboxRow;
use crate::AppState;

use SandboxState::{Paused, Pausing, Resuming, Running, Starting, Stopped, Stopping};

/// The one `keep` a switch takes (and must be told): what it keeps.
pub(crate) const KEEP_WORKSPACE: &str = "workspace";
const SWITCH_UNDONE: &str = "switch_undone";
/// How long copying `/workspace` out or in may take.
const COPY_TIME: Duration = Duration::from_secs(600);

/// `POST /v1/sandboxes/{id}:switch-image {image, keep: "workspace"}`,
/// waiting up to `wait` for the switch to end: the sandbox on its new
/// image, or 409 `switch_undone` with it back on its old one.
pub(crate) async fn switch_image(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    image: &str,
    wait: Option<Duration>,
) -> ApiResult<SandboxRow> {
    let row = settle(st, key, id, &[Starting, Pausing, Resuming, Stopping]).await?;
    let r = &row.record;
    let target = crate::service::images::for_create(st, key, image)?;
    if r.image.as_deref() == Some(target.id.as_str()) {
        return Ok(row);
    }
    if let Some(need) = target.disk_mib.filter(|&m| m > r.disk_mib) {
        return Err(ApiError::invalid(
            "image",
            format!(
                "image {} needs a disk of at least {need} MiB and sandbox {id} has {} MiB: grow it first (:resize with diskMiB)",
                target.id, r.disk_mib
            ),
        ));
    }
    match r.state {
        Running | Paused => {}
        Stopped if r.persistent => {}
        Stopped => {
            return Err(ApiError::Conflict {
                code: codes::NOT_PERSISTENT,
                message: format!(
                    "Sandbox {id} is stopped and not persistent, so it has no /workspace to keep."
                ),
                details: Some(json!({ "sandboxId": id })),
            })
        }
        state => {
            return Err(ApiError::NotRunning {
                id: id.to_string(),
                state,
            })
        }
    }
    if r.state != Running {
        // Its machine runs again for the switch: the key's quotas and the
        // host's room, as for a wake.
        let mut asked = crate::domain::quota::Usage::default();
        asked.add_machine(r.vcpu, r.memory_mib);
        crate::service::quotas::admit(st, &row.key_id, &asked)?;
        crate::service::quotas::admit_room(st, &[(r.vcpu, r.memory_mib)]).await?;
    }
    let from = r.state;
    let old_image = r.image.clone();
    let new_image = target.id.clone();
    {
        let _g = st.inner.create_lock.lock().await;
        if from == Stopped {
            crate::service::sandboxes::name_free_for_restart(st, key, &row)?;
        }
        lifecycle::restart_changed(st, id, from, |r| r.image = Some(new_image.clone()))?;
    }
    let task: lifecycle::SwitchTask =
        Box::new(move |st, row| Box::pin(async move { run(&st, &row, from, old_image).await }));
    drive(st, id, Op::Switch { task })?;
    if let Some(wait) = wait {
        wait_until(st, id, wait, |s| s != Starting).await?;
        let now = find(st, key, id)?;
        if now.record.state != Starting && now.record.image.as_deref() != Some(target.id.as_str()) {
            let why = undone_why(st, id);
            return Err(ApiError::Conflict {
                code: SWITCH_UNDONE,
                message: format!(
                    "Switching sandbox {id} to image {} failed and was undone: {why}. It is on its old image with its files as they were.",
                    target.id
                ),
                details: Some(json!({ "sandboxId": id, "imageId": target.id })),
            });
        }
    }
    find(st, key, id)
}

/// Why the last switch of `id` was undone, as its task said.
fn undone_why(st: &AppState, id: &str) -> String {
    st.inner
        .switch_failures
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(id)
        .unwrap_or_else(|| "its new machine did not start".into())
}

fn note_undone(st: &AppState, id: &str, why: String) {
    tracing::warn!(sandbox_id = id, why, "switching the image failed: undone");
    let mut m = st
        .inner
        .switch_failures
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    // Bounded by the sandboxes: one entry each, taken by the answer.
    m.insert(id.to_string(), why);
}

/// The switch's task (under the sandbox's lifecycle lock): see the module.
pub(crate) async fn run(
    st: &AppState,
    row: &SandboxRow,
    from: SandboxState,
    old_image: Option<String>,
) {
    let id = row.record.id.clone();
    let persistent = row.record.persistent;
    let mut old = row.clone();
    old.record.image = old_image.clone();
    // A paused one is woken first: what it wrote may still be only in its
    // memory, and a stop flushes it to the disk that is then kept.
    let from = if from == Paused {
        if let Err(e) = st
            .host()
            .wake(&lifecycle::machine_spec(st, &old.record))
            .await
        {
            note_undone(st, &id, format!("it did not wake: {e}"));
            fail(st, &id, old_image);
            return;
        }
        Running
    } else {
        from
    };
    // The old disk: a stopped persistent sandbox's kept one, else one kept
    // now from its machine (running: ended first, its writes flushed).
    let dir = if from == Stopped {
        disk_dir(st, &id)
    } else {
        let dir = disk_dir(st, &id).with_extension("switch");
        if from == Running {
            if let Err(e) = st.host().stop(&id, true).await {
                tracing::warn!(error = %e, "ending the machine for the switch failed");
            }
        }
        let kept = lifecycle::keep_disk(st, &id, &dir).await;
        if let Err(e) = st.host().stop(&id, false).await {
            tracing::warn!(error = %e, "ending the machine for the switch failed");
        }
        if !kept {
            note_undone(st, &id, "its disk could not be kept".into());
            fail(st, &id, old_image);
            return;
        }
        dir
    };
    let tar = st
        .config()
        .data_dir
        .join("uploads")
        .join(format!("switch-{id}.tar"));
    match move_workspace(st, row, &old, &dir, &tar).await {
        Ok(()) => {
            let now = st.now_ms();
            let out = lifecycle::record(st, &id, Starting, Event::Booted, |r| {
                r.ready_at = Some(iso(now));
                r.last_active_at = Some(iso(now));
            });
            remove_file_quietly(&tar);
            // The old disk is the old image's: a persistent sandbox's next
            // stop keeps its new one.
            lifecycle::remove_dir_quietly(&dir);
            match out {
                Ok((Some(row), _)) => {
                    tracing::info!(image = ?row.record.image, "sandbox switched to its new image");
                    lifecycle::start_image_command(st, &row, false).await;
                }
                Ok((None, _)) => {}
                Err(e) => tracing::error!(error = %e, "recording the switch failed"),
            }
        }
        Err(why) => {
            remove_file_quietly(&tar);
            if let Err(e) = st.host().stop(&id, false).await {
                tracing::warn!(error = %e, "ending the new machine of a failed switch failed");
            }
            note_undone(st, &id, why);
            // Back on its old image, booted from its old disk (kept, for a
            // persistent sandbox, where a stop keeps it).
            match st.store().update_sandbox(&id, |r| {
                r.record.image = old_image.clone();
                true
            }) {
                Ok(Some(back)) => {
                    let from = Arc::new(CaptureDir {
                        path: dir,
                        temporary: !(persistent && from == Stopped),
                    });
                    lifecycle::boot(st, &back, Some(from), false).await;
                }
                Ok(None) => {}
                Err(e) => tracing::error!(error = %e, "undoing the switch failed"),
            }
        }
    }
    st.notify_change();
}

/// A switch that could not even keep the old disk: its old image, stopped
/// (`switch_failed`), as a failed start.
fn fail(st: &AppState, id: &str, old_image: Option<String>) {
    let now = st.now_ms();
    let out = lifecycle::record(st, id, Starting, Event::BootFailed, |r| {
        r.image = old_image;
        r.stop_reason = Some("switch_failed".into());
        r.ended_at = Some(iso(now));
    });
    if let Err(e) = out {
        tracing::error!(error = %e, "recording the failed switch failed");
    }
    st.notify_change();
}

/// Boots the old disk in `dir` (on the old image), copies `/workspace` out
/// into `tar`, ends that machine, boots the new image and unpacks `tar`
/// into its `/workspace`. `Err`: why it failed (the caller undoes).
async fn move_workspace(
    st: &AppState,
    new: &SandboxRow,
    old: &SandboxRow,
    dir: &Path,
    tar: &Path,
) -> Result<(), String> {
    let id = new.record.id.as_str();
    let spec = lifecycle::machine_spec(st, &old.record);
    st.host()
        .restore(&spec, dir)
        .await
        .map_err(|e| format!("its old disk did not boot: {e}"))?;
    // Room for the copy on the new disk, beside its unpacked self.
    let max = u64::from(new.record.disk_mib) * (1 << 20) / 2;
    let copied = tokio::time::timeout(COPY_TIME, pack_workspace(st, id, tar, max)).await;
    if let Err(e) = st.host().stop(id, false).await {
        tracing::warn!(error = %e, "ending the old disk's machine failed");
    }
    let size = match copied {
        Ok(r) => r?,
        Err(_) => return Err(format!("copying /workspace out took over {COPY_TIME:?}")),
    };
    st.host()
        .start(&lifecycle::machine_spec(st, &new.record))
        .await
        .map_err(|e| format!("the new image did not boot: {e}"))?;
    let source = archives::Source::File {
        path: tar.to_path_buf(),
        size,
        gzip: Some(false),
    };
    let unpacked = tokio::time::timeout(
        COPY_TIME,
        archives::unpack_into(st, id, "/workspace", RunAs::Sandbox, source),
    )
    .await;
    match unpacked {
        Ok(Ok(())) => Ok(()),
        Ok(Err(archives::UnpackError::NotStarted(e) | archives::UnpackError::Refused(e))) => {
            Err(format!("copying /workspace in failed: {e}"))
        }
        Err(_) => Err(format!("copying /workspace in took over {COPY_TIME:?}")),
    }
}

/// Writes a tar of the running machine's `/workspace` (read as root) into
/// `dest`, at most `max` bytes; answers its size.
async fn pack_workspace(st: &AppState, id: &str, dest: &Path, max: u64) -> Result<u64, String> {
    use tokio::io::AsyncWriteExt;
    if let Some(parent) = dest.parent() {
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(|e| format!("the host could not keep the copy: {e}"))?;
    }
    let mut file = tokio::fs::File::create(dest)
        .await
        .map_err(|e| format!("the host could not keep the copy: {e}"))?;
    let argv: Vec<String> = ["tar", "-c", "-f", "-", "-C", "/workspace", "."]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let spec = archives::tar_spec(argv, RunAs::Root, false);
    let mut h = st
        .host()
        .exec(id, spec)
        .await
        .map_err(|e| format!("copying /workspace out did not start: {e}"))?;
    let mut size = 0u64;
    let mut stderr = Vec::new();
    loop {
        match h.events.recv().await {
            Some(ExecEvent::Stdout(b)) => {
                size += b.len() as u64;
                if size > max {
                    return Err(format!(
                        "/workspace is over {} MiB, more than its disk holds twice",
                        max >> 20
                    ));
                }
                file.write_all(&b)
                    .await
                    .map_err(|e| format!("the host could not keep the copy: {e}"))?;
            }
            Some(ExecEvent::Stderr(b)) => {
                let room = 4096usize.saturating_sub(stderr.len());
                stderr.extend_from_slice(&b[..b.len().min(room)]);
            }
            Some(ExecEvent::Exited(x)) if x.code == Some(0) => break,
            Some(ExecEvent::Exited(x)) => {
                return Err(format!(
                    "tar of /workspace exited with {:?}: {}",
                    x.code,
                    String::from_utf8_lossy(&stderr).trim()
                ))
            }
            None => return Err("the old disk's machine was lost".into()),
        }
    }
    file.sync_all()
        .await
        .map_err(|e| format!("the host could not keep the copy: {e}"))?;
    Ok(size)
}

fn remove_file_quietly(p: &Path) {
    if let Err(e) = std::fs::remove_file(p) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(path = %p.display(), error = %e, "removing a file failed");
        }
    }
}
