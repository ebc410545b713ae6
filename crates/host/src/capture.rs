//! Capture and resume through QMP: stopping a machine and writing its
//! state (without its RAM where it has a RAM file of its own), running it
//! on, loading a state into a new QEMU; and the captures of a pause and of
//! [`Host::capture`](crate::Host::capture).

use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use runtime_proto::Request;
use serde_json::json;

use crate::disks::copy_sparse;
use crate::guest_setup::set_clock;
use std::sync::Arc;

use crate::machine::{QemuHost, Vm};
use crate::qemu::{self, VmPaths};
use crate::qmp::{Qmp, QmpError};
use crate::ram::copy_ram;
use crate::types::HostError;

/// A capture that failed: why, and whether it left the machine stopped
/// (`stopped`: it could not be run on again; otherwise it runs).
pub(crate) struct CaptureFailed {
    pub(crate) error: HostError,
    pub(crate) stopped: bool,
}

impl CaptureFailed {
    fn running(error: HostError) -> Self {
        CaptureFailed {
            error,
            stopped: false,
        }
    }
}

impl QemuHost {
    /// Stops the VM's vCPUs and writes its device state to
    /// `<vm dir>/capture.state`; the VM stays stopped (QEMU alive). A
    /// machine with its own RAM file is saved without its RAM (reading it
    /// would allocate every page of the file): the caller copies the file
    /// while the machine is stopped. Any other machine's state holds its
    /// whole memory. On failure the machine runs on when it can.
    pub(crate) async fn capture_stopped(
        &self,
        id: &str,
        vm: &Vm,
    ) -> Result<PathBuf, CaptureFailed> {
        let qerr = |e: QmpError| HostError::Capture {
            id: id.to_owned(),
            reason: e.to_string(),
        };
        let started = Instant::now();
        // The agent finishes writing what it queued and holds the rest, so
        // no frame is half-way through the port when the vCPUs stop.
        let link = vm.link.lock().await.clone();
        if let Some(l) = &link {
            let _ = tokio::time::timeout(Duration::from_secs(5), l.call(&Request::Quiesce)).await;
        }
        let release = || {
            if let Some(l) = &link {
                l.release();
            }
        };
        let mut q = match Qmp::connect(&vm.paths.qmp_sock(), Duration::from_secs(10)).await {
            Ok(q) => q,
            Err(e) => {
                release();
                return Err(CaptureFailed::running(qerr(e)));
            }
        };
        if let Err(e) = q.execute("stop", json!({})).await {
            release();
            return Err(CaptureFailed::running(qerr(e)));
        }
        let file = vm.paths.capture_state();
        let written = async {
            // Set each time: QEMU keeps capabilities from one migration to
            // the next.
            q.execute(
                "migrate-set-capabilities",
                json!({"capabilities": [
                    {"capability": "x-ignore-shared", "state": vm.ram.is_some()}
                ]}),
            )
            .await
            .map_err(qerr)?;
            let _ = std::fs::remove_file(&file);
            // Opened here and handed over: QEMU's own uid may not reach the
            // data directory.
            let out = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&file)
                .map_err(Self::io(id, "create capture file"))?;
            q.send_fd("capture", std::os::fd::AsRawFd::as_raw_fd(&out))
                .await
                .map_err(qerr)?;
            q.execute("migrate", json!({"uri": "fd:capture"}))
                .await
                .map_err(qerr)?;
            q.wait_migration(Duration::from_secs(300))
                .await
                .map_err(qerr)?;
            Ok::<(), HostError>(())
        }
        .await;
        if let Err(error) = written {
            // Nothing is lost: the machine runs on, if it can.
            let stopped = q.execute("cont", json!({})).await.is_err();
            release();
            let _ = std::fs::remove_file(&file);
            return Err(CaptureFailed { error, stopped });
        }
        tracing::info!(
            sandbox_id = id,
            ms = started.elapsed().as_millis() as u64,
            "captured"
        );
        Ok(file)
    }

    pub(crate) async fn resume(&self, id: &str, vm: &Vm) -> Result<(), HostError> {
        let qerr = |e: QmpError| HostError::Capture {
            id: id.to_owned(),
            reason: e.to_string(),
        };
        let mut q = Qmp::connect(&vm.paths.qmp_sock(), Duration::from_secs(10))
            .await
            .map_err(qerr)?;
        q.execute("cont", json!({})).await.map_err(qerr)?;
        let link = vm.link.lock().await.clone();
        if let Some(l) = link {
            l.release();
            // Its clock stood still while it was stopped.
            match tokio::time::timeout(Duration::from_secs(10), set_clock(&l)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(sandbox_id = id, error = %e, "setting the clock after a capture")
                }
                Err(_) => tracing::warn!(
                    sandbox_id = id,
                    "setting the clock after a capture: no answer"
                ),
            }
        }
        Ok(())
    }

    /// A pause's capture: the state and, for a machine with its own RAM
    /// file, a copy of that file as `paused.ram`; the machine stays stopped.
    pub(crate) async fn capture_for_pause(
        &self,
        id: &str,
        vm: &Vm,
    ) -> Result<PathBuf, CaptureFailed> {
        let file = self.capture_stopped(id, vm).await?;
        if let Some(ram) = &vm.ram {
            // Only the pages the guest touched, holes kept: the paused
            // machine's memory takes the room it used.
            if let Err(e) = copy_ram(ram, &vm.paths.paused_ram()).await {
                return Err(CaptureFailed {
                    error: Self::io(id, "keep paused memory")(e),
                    stopped: true,
                });
            }
        }
        Ok(file)
    }

    /// A pause of `vm` that did not keep its state: nothing of it stays,
    /// and the machine runs on, registered again (the error says why the
    /// pause failed), or, when it cannot run on, is ended: then
    /// [`HostError::NoSuchMachine`], the machine is gone.
    pub(crate) async fn pause_failed(
        &self,
        id: &str,
        vm: Arc<Vm>,
        failed: CaptureFailed,
    ) -> Result<(), HostError> {
        let _ = std::fs::remove_file(vm.paths.capture_state());
        let _ = std::fs::remove_file(vm.paths.paused_ram());
        let runs = !failed.stopped
            || {
                match self.resume(id, &vm).await {
                    Ok(()) => true,
                    Err(error) => {
                        tracing::warn!(sandbox_id = id, %error, "cannot run the machine on after a failed pause");
                        false
                    }
                }
            };
        if runs {
            self.insert_vm(id, vm);
            return Err(failed.error);
        }
        tracing::warn!(sandbox_id = id, error = %failed.error, "the pause failed and the machine cannot run on: ending it");
        self.end_vm(id, &vm).await;
        Err(HostError::NoSuchMachine { id: id.to_owned() })
    }

    /// A capture of running machine `id` into `dest`: its disk, and with
    /// `memory` its state (and RAM file); the machine runs on after.
    pub(crate) async fn capture_running(
        &self,
        id: &str,
        vm: &Vm,
        dest: &Path,
        memory: bool,
    ) -> Result<(), HostError> {
        let paths = self.paths(id);
        if !memory {
            // Only the disk is kept: flush the guest's page cache first.
            if let Ok(link) = self.link(id).await {
                let _ =
                    tokio::time::timeout(Duration::from_secs(30), link.call(&Request::Sync)).await;
            }
        }
        // A machine with its own RAM file: the state without the
        // RAM, and a copy of the file (restored as a private
        // mapping shared by every machine started from it).
        let ram = vm.ram.as_ref().filter(|_| memory);
        let file = match self.capture_stopped(id, vm).await {
            Ok(file) => file,
            Err(failed) => {
                if failed.stopped {
                    self.end_stuck(id, vm).await;
                }
                return Err(failed.error);
            }
        };
        let r = async {
            if let Some(ram) = ram {
                copy_ram(ram, &dest.join("memory.ram"))
                    .await
                    .map_err(Self::io(id, "copy memory"))?;
            }
            if memory {
                std::fs::rename(&file, dest.join("memory.state"))
                    .map_err(Self::io(id, "move capture"))?;
            } else {
                let _ = std::fs::remove_file(&file);
            }
            // The machine is stopped and the capture half-made.
            crate::types::crash_point(self.cfg.test_crash_at.as_deref(), "capture_running");
            copy_sparse(&paths.overlay(), &dest.join("disk.qcow2"))
                .await
                .map_err(Self::io(id, "copy disk"))
        }
        .await;
        if let Err(e) = self.resume(id, vm).await {
            self.end_stuck(id, vm).await;
            return Err(e);
        }
        r
    }

    /// A capture of paused machine `id` into `dest`: its disk, and with
    /// `memory` links to its paused state (and RAM). A machine ended keeping
    /// its disk gives its disk.
    pub(crate) async fn capture_paused(
        &self,
        id: &str,
        dest: &Path,
        memory: bool,
    ) -> Result<(), HostError> {
        let paths = self.paths(id);
        let state = paths.paused_state();
        // Without a paused state, only the disk of a machine ended with
        // `stop(id, true)` (its writes flushed) can be taken.
        if !state.exists() && (memory || !paths.overlay().exists()) {
            return Err(HostError::NotPaused { id: id.to_owned() });
        }
        if memory {
            std::fs::hard_link(&state, dest.join("memory.state"))
                .map_err(Self::io(id, "link paused state"))?;
            let ram = paths.paused_ram();
            if ram.exists() {
                std::fs::hard_link(&ram, dest.join("memory.ram"))
                    .map_err(Self::io(id, "link paused memory"))?;
            }
        }
        copy_sparse(&paths.overlay(), &dest.join("disk.qcow2"))
            .await
            .map_err(Self::io(id, "copy disk"))
    }
}

/// A fork's copy (`-incoming defer`): loads the state, which was saved
/// without the RAM its file already holds.
pub(crate) async fn load_without_ram(paths: &VmPaths) -> Result<(), QmpError> {
    let mut q = Qmp::connect(&paths.qmp_sock(), Duration::from_secs(10)).await?;
    q.execute(
        "migrate-set-capabilities",
        json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]}),
    )
    .await?;
    q.execute("migrate-incoming", json!({"uri": qemu::INCOMING_URI}))
        .await?;
    Ok(())
}

/// After `-incoming`: waits for the state to load, then runs the vCPUs.
pub(crate) async fn resume_loaded(paths: &VmPaths) -> Result<(), QmpError> {
    let mut q = Qmp::connect(&paths.qmp_sock(), Duration::from_secs(10)).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    loop {
        let st = q.execute("query-status", json!({})).await?;
        match st.get("status").and_then(|s| s.as_str()) {
            Some("inmigrate") => {}
            Some("running") => return Ok(()),
            Some(_) => {
                q.execute("cont", json!({})).await?;
                return Ok(());
            }
            None => {}
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(QmpError::Timeout {
                command: "incoming migration".into(),
            });
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use crate::fake_qemu::{gone, FakeHost, FakeQmp};
    use crate::types::Host;

    /// Machine `id` registered as running on a fake QEMU whose QMP refuses
    /// `refused`, with a RAM file of its own: its pid and its QMP.
    fn running(f: &FakeHost, id: &str, refused: &'static [&'static str]) -> (u32, FakeQmp) {
        let pid = f.leave_qemu(id);
        let paths = f.paths(id);
        let qmp = FakeQmp::serve(&paths.qmp_sock(), "running", refused);
        std::fs::write(paths.overlay(), b"disk").unwrap();
        let ram = f.host.own_ram(id);
        std::fs::write(&ram, b"guest memory").unwrap();
        let vm = Vm {
            paths,
            pid,
            link: tokio::sync::Mutex::new(None),
            volumes: false,
            ram: Some(ram),
        };
        f.host
            .vms
            .lock()
            .unwrap()
            .insert(id.to_owned(), Arc::new(vm));
        (pid, qmp)
    }

    #[tokio::test]
    async fn a_pause_that_cannot_keep_its_state_leaves_the_machine_running() {
        let f = FakeHost::new("pause-rename");
        let id = f.id("m");
        let (pid, qmp) = running(&f, &id, &[]);
        let paths = f.paths(&id);
        // In the way of the rename.
        std::fs::create_dir_all(paths.paused_state().join("x")).unwrap();
        let e = f.host.pause(&id).await.unwrap_err();
        assert!(
            matches!(
                e,
                HostError::Io {
                    op: "keep paused state",
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(
            f.host.qemu_pid(&id),
            Some(pid),
            "the machine is no longer tracked"
        );
        assert!(!gone(pid));
        let seen = qmp.seen();
        let stopped = seen.iter().position(|c| c == "stop");
        let resumed = seen.iter().rposition(|c| c == "cont");
        assert!(
            stopped.is_some() && resumed > stopped,
            "not run on: {seen:?}"
        );
        assert!(!paths.capture_state().exists(), "the capture is left");
        assert!(
            !paths.paused_ram().exists(),
            "the copy of its memory is left"
        );
        assert!(f.host.own_ram(&id).exists(), "its memory");
    }

    #[tokio::test]
    async fn a_pause_that_can_neither_finish_nor_run_on_ends_the_machine() {
        let f = FakeHost::new("pause-stuck");
        let id = f.id("m");
        let (pid, _qmp) = running(&f, &id, &["cont"]);
        let paths = f.paths(&id);
        std::fs::create_dir_all(paths.paused_state().join("x")).unwrap();
        let e = f.host.pause(&id).await.unwrap_err();
        assert!(matches!(e, HostError::NoSuchMachine { .. }), "{e:?}");
        assert!(f.host.qemu_pid(&id).is_none());
        assert!(gone(pid), "a stopped QEMU {pid} is left");
        assert!(!f.has_cgroup(&id));
        assert!(!f.host.own_ram(&id).exists());
        assert!(!paths.capture_state().exists());
        assert!(!paths.paused_ram().exists());
    }

    #[tokio::test]
    async fn a_capture_after_which_the_machine_cannot_run_on_ends_it() {
        let f = FakeHost::new("capture-stuck");
        let id = f.id("m");
        let (pid, _qmp) = running(&f, &id, &["cont"]);
        let dest = f.state.join(".capture");
        assert!(f.host.capture(&id, &dest, false).await.is_err());
        assert!(
            f.host.qemu_pid(&id).is_none(),
            "a stopped machine is tracked as running"
        );
        assert!(gone(pid), "a stopped QEMU {pid} is left");
        assert!(!f.has_cgroup(&id));
        assert!(!dest.exists());
    }
}
