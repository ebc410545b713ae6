//! Setting up a guest once its agent answers: the first `Setup` request,
//! mounting its volumes (by a shell script run as root), and flushing its
//! writes to its disks.

use std::time::Duration;

use runtime_proto::{ExecRequest, Reply, Request, User};

use crate::link::{Link, LinkError};
use crate::machine::Vm;
use crate::pump::pump;
use crate::types::{BootStage, ExecEvent, HostError, MachineSpec, VolumeDrive};

/// Finds each volume's device by its serial (`vol<i>`, not by probe order)
/// and mounts it, `nosuid,nodev`. Arguments: pairs of serial and path.
const MOUNT_SCRIPT: &str = include_str!("mount_volumes.sh");

/// Waits (up to 5 s) until the guest's kernel sees `/dev/vda` at its new
/// size of `$1` sectors, then grows the ext4 file system on it, mounted.
const GROW_SCRIPT: &str = r#"i=0
while [ "$(cat /sys/block/vda/size)" -lt "$1" ]; do
  i=$((i+1)); [ "$i" -gt 50 ] && { echo "/dev/vda did not grow"; exit 1; }
  sleep 0.1
done
for t in /sbin/resize2fs /usr/sbin/resize2fs; do [ -x "$t" ] && exec "$t" /dev/vda; done
echo "resize2fs is missing"; exit 1"#;

/// Grows the root file system of the guest behind `link` once its disk has
/// `disk_mib` MiB (run as root, by [`GROW_SCRIPT`]).
pub(crate) async fn grow_root_fs(link: &Link, disk_mib: u32) -> Result<(), String> {
    let sectors = u64::from(disk_mib) * 2048;
    let argv = vec![
        "/bin/sh".to_owned(),
        "-c".to_owned(),
        GROW_SCRIPT.to_owned(),
        "grow-root".to_owned(),
        sectors.to_string(),
    ];
    let (code, output) = run_root(link, argv, Duration::from_secs(120)).await?;
    if code == Some(0) {
        Ok(())
    } else {
        Err(format!(
            "exit {code:?}: {}",
            String::from_utf8_lossy(&output).trim()
        ))
    }
}

/// Mounts the spec's volumes in the guest (none: nothing to do).
pub(crate) async fn mount_volumes(vm: &Vm, spec: &MachineSpec) -> Result<(), HostError> {
    if spec.volumes.is_empty() {
        return Ok(());
    }
    let id = spec.id.as_str();
    let failed = |reason: String| HostError::StartFailed {
        id: id.to_owned(),
        stage: BootStage::Disk,
        reason,
        console_tail: String::new(),
    };
    let link = vm
        .link
        .lock()
        .await
        .clone()
        .ok_or_else(|| HostError::LinkLost { id: id.to_owned() })?;
    let (code, output) = run_root(&link, mount_argv(&spec.volumes), Duration::from_secs(60))
        .await
        .map_err(|e| failed(format!("mounting volumes: {e}")))?;
    if code != Some(0) {
        return Err(failed(format!(
            "mounting volumes failed: {}",
            String::from_utf8_lossy(&output).trim()
        )));
    }
    Ok(())
}

/// The command that mounts `volumes`: [`MOUNT_SCRIPT`] with a serial and a
/// path for each, in order.
fn mount_argv(volumes: &[VolumeDrive]) -> Vec<String> {
    let mut argv = vec![
        "/bin/sh".to_owned(),
        "-c".to_owned(),
        MOUNT_SCRIPT.to_owned(),
        "mount-volumes".to_owned(),
    ];
    for (i, v) in volumes.iter().enumerate() {
        argv.push(format!("vol{i}"));
        argv.push(v.path.clone());
    }
    argv
}

/// Asks the guest to write its dirty pages to its disks (bounded wait).
pub(crate) async fn sync_guest(vm: &Vm) {
    if let Some(l) = vm.link.lock().await.as_ref() {
        let _ = tokio::time::timeout(Duration::from_secs(30), l.call(&Request::Sync)).await;
    }
}

/// What a template runs once before it is captured, so that its page cache
/// (which every machine started from it shares) already holds what a
/// sandbox's first commands read: the shell, Python and their libraries.
/// An image without one of them skips it.
const WARM_UP: &str = "bash -c true; command -v python3 >/dev/null && python3 -c 'import json, os, subprocess, sys'; true";

/// Runs [`WARM_UP`] in a template's machine (bounded; a failure only costs
/// the warm cache).
pub(crate) async fn warm_up(vm: &Vm) {
    let link = vm.link.lock().await.clone();
    let Some(link) = link else { return };
    run_warm_up(&link).await;
}

/// Runs [`WARM_UP`] over `link`: in a template (the guest's page cache) or
/// in a warm machine (under TCG, QEMU's cache of translated code, which no
/// capture keeps).
pub(crate) async fn run_warm_up(link: &Link) {
    let argv = vec!["/bin/sh".into(), "-c".into(), WARM_UP.into()];
    match run_root(link, argv, Duration::from_secs(60)).await {
        Ok((Some(0), _)) => {}
        Ok((code, out)) => tracing::warn!(
            ?code,
            output = %String::from_utf8_lossy(&out),
            "a template's warm-up failed"
        ),
        Err(e) => tracing::warn!(error = %e, "a template's warm-up failed"),
    }
}

/// Most output [`run_root`] keeps.
const ROOT_OUTPUT_BYTES: usize = 64 * 1024;

/// Runs a command as root over `link` and collects its exit code and output
/// (the first [`ROOT_OUTPUT_BYTES`]).
async fn run_root(
    link: &Link,
    argv: Vec<String>,
    timeout: Duration,
) -> Result<(Option<i32>, Vec<u8>), String> {
    let mut stream = link.open().map_err(|e| e.to_string())?;
    let req = ExecRequest {
        argv,
        cwd: None,
        env: Vec::new(),
        user: User::Root,
        timeout_ms: Some(timeout.as_millis() as u64),
        stdin: false,
        pty: None,
        kill_group_on_exit: true,
        trace_files: false,
    };
    stream
        .send(&Request::Exec(req))
        .map_err(|e| e.to_string())?;
    let pid = match stream.reply().await.map_err(|e| e.to_string())? {
        Reply::Started { pid } => pid,
        other => return Err(format!("unexpected reply {other:?}")),
    };
    let mut handle = pump(stream, pid);
    let mut output = Vec::new();
    while let Some(ev) = handle.events.recv().await {
        match ev {
            // The guest disk's shell may be anyone's: its output is kept
            // up to a bound (what a mount failure says fits).
            ExecEvent::Stdout(b) | ExecEvent::Stderr(b) => {
                let room = ROOT_OUTPUT_BYTES.saturating_sub(output.len());
                output.extend_from_slice(&b[..b.len().min(room)]);
            }
            ExecEvent::Exited(st) => return Ok((st.code, output)),
        }
    }
    Err("lost the link".into())
}

/// The guest's first request: its hostname, clock, entropy, CA and
/// environment file (naming sandbox `id`).
pub(crate) async fn setup(
    link: &Link,
    id: &str,
    hostname: &str,
    ca_pem: Option<&str>,
) -> Result<(), LinkError> {
    link.call(&Request::Setup {
        hostname: hostname.to_owned(),
        unix_time_ms: now_ms(),
        entropy: fresh_entropy(),
        ca_pem: ca_pem.map(str::to_owned),
        environment: Some(crate::types::guest_environment(id).to_string()),
    })
    .await?;
    Ok(())
}

/// Sets the guest's clock to the host's (and stirs its entropy), keeping
/// its hostname and CA: for a machine that ran on after its vCPUs were
/// stopped (a capture), whose clock stood still meanwhile.
pub(crate) async fn set_clock(link: &Link) -> Result<(), LinkError> {
    link.call(&Request::Setup {
        hostname: String::new(),
        unix_time_ms: now_ms(),
        entropy: fresh_entropy(),
        ca_pem: None,
        environment: None,
    })
    .await?;
    Ok(())
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn fresh_entropy() -> Vec<u8> {
    let mut entropy = vec![0u8; 64];
    if let Ok(mut f) = std::fs::File::open("/dev/urandom") {
        use std::io::Read;
        let _ = f.read_exact(&mut entropy);
    }
    entropy
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use runtime_proto::channel;

    use super::*;
    use crate::fake_guest::Guest;

    #[test]
    fn the_mount_command_names_each_volume_by_its_serial() {
        let vol = |path: &str| VolumeDrive {
            file: "/vols/x.ext4".into(),
            path: path.into(),
            snapshot: false,
        };
        let argv = mount_argv(&[vol("/data"), vol("/home/user/cache")]);
        assert_eq!(
            argv,
            [
                "/bin/sh",
                "-c",
                MOUNT_SCRIPT,
                "mount-volumes",
                "vol0",
                "/data",
                "vol1",
                "/home/user/cache"
            ]
        );
    }

    #[test]
    fn the_mount_script_is_valid_shell() {
        let out = std::process::Command::new("sh")
            .args(["-n", "-c", MOUNT_SCRIPT])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(MOUNT_SCRIPT.starts_with("set -eu\n"));
        assert!(MOUNT_SCRIPT.contains("mount -t ext4 -o nosuid,nodev"));
    }

    #[tokio::test]
    async fn run_root_collects_the_exit_code_and_all_output() {
        let (link, mut guest) = Guest::linked().await;
        let run = tokio::spawn(async move {
            run_root(&link, vec!["true".into()], Duration::from_secs(60)).await
        });
        let (sid, req) = guest.request().await.unwrap();
        let Request::Exec(req) = req else {
            panic!("{req:?}")
        };
        assert_eq!(req.argv, ["true"]);
        assert_eq!(req.user, User::Root);
        assert_eq!(req.timeout_ms, Some(60_000));
        assert!(!req.stdin && req.pty.is_none() && req.kill_group_on_exit);
        guest.reply(sid, &Reply::Started { pid: 5 }).await;
        guest.output(sid, channel::STDOUT, b"out ").await;
        guest.output(sid, channel::STDERR, b"err").await;
        guest
            .reply(
                sid,
                &Reply::Exited {
                    exit_code: Some(32),
                    signal: None,
                    timed_out: false,
                    duration_ms: 3,
                    out_of_memory: false,
                    oom_kills: 0,
                    files: None,
                },
            )
            .await;
        assert_eq!(run.await.unwrap(), Ok((Some(32), b"out err".to_vec())));
    }

    #[tokio::test]
    async fn run_root_reports_a_refused_command() {
        let (link, mut guest) = Guest::linked().await;
        let run =
            tokio::spawn(
                async move { run_root(&link, vec!["x".into()], Duration::from_secs(1)).await },
            );
        let (sid, _) = guest.request().await.unwrap();
        guest
            .reply(
                sid,
                &Reply::Failed {
                    code: runtime_proto::FailCode::CommandNotFound,
                    message: "x".into(),
                },
            )
            .await;
        let e = run.await.unwrap().unwrap_err();
        assert!(e.starts_with("unexpected reply Failed"), "{e}");
    }

    #[tokio::test]
    async fn setup_sends_the_hostname_clock_entropy_and_ca() {
        let (link, mut guest) = Guest::linked().await;
        let before = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let done =
            tokio::spawn(async move { setup(&link, "sbx-1", "sbx-host", Some("PEM")).await });
        let (sid, req) = guest.request().await.unwrap();
        let Request::Setup {
            hostname,
            unix_time_ms,
            entropy,
            ca_pem,
            environment,
        } = req
        else {
            panic!("{req:?}")
        };
        assert_eq!(hostname, "sbx-host");
        assert!(unix_time_ms >= before);
        assert_eq!(entropy.len(), 64);
        assert!(entropy.iter().any(|&b| b != 0));
        assert_eq!(ca_pem.as_deref(), Some("PEM"));
        let env: serde_json::Value = serde_json::from_str(&environment.unwrap()).unwrap();
        assert_eq!(env["RUNTIME_SANDBOX_ID"], "sbx-1");
        assert_eq!(env["RUNTIME_API_URL"], "http://runtime.internal");
        guest.reply(sid, &Reply::Done).await;
        done.await.unwrap().unwrap();
    }
}
