//! The boot and restore sequence: QEMU started on a machine's disks and
//! RAM, its sockets awaited, a state loaded (a restore), the agent's link
//! made and the guest set up, in named steps.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::net::UnixStream;

use crate::capture::{load_without_ram, resume_loaded};
use crate::cgroup;
use crate::disks::{self, drive_files};
use crate::guest_setup::{mount_volumes, setup};
use crate::jail;
use crate::link::Link;
use crate::machine::{QemuHost, Vm};
use crate::qemu::{self, VmConfig, VmPaths};
use crate::ram::{copy_ram, RamPlan, StartingRam};
use crate::teardown::Pending;
use crate::types::{BootStage, HostError, MachineSpec};

impl QemuHost {
    /// Boots a new machine of `spec`: a fresh directory, an overlay, its
    /// volumes' copies, QEMU, then its volumes mounted. Not registered yet.
    pub(crate) async fn boot(&self, spec: &MachineSpec) -> Result<Pending, HostError> {
        let paths = self.fresh_dir(spec).await?;
        self.new_overlay(spec, &paths).await?;
        self.copy_snapshot_volumes(spec, &paths).await?;
        let vm = self
            .launch(spec, paths, None, RamPlan::Own { fill: None })
            .await?;
        if let Err(e) = mount_volumes(vm.vm(), spec).await {
            vm.end().await;
            return Err(e);
        }
        Ok(vm)
    }

    /// Starts QEMU in `paths` (its disk already there), either booting or
    /// loading the state in `incoming`, and returns once the agent answered
    /// and the guest is set up: a machine not registered yet. `ram` says
    /// where its RAM lives; with a file, `incoming` holds no RAM. Whatever
    /// fails once QEMU is spawned ends the machine.
    pub(crate) async fn launch(
        &self,
        spec: &MachineSpec,
        paths: VmPaths,
        incoming: Option<std::fs::File>,
        plan: RamPlan<'_>,
    ) -> Result<Pending, HostError> {
        let id = spec.id.as_str();
        let own = self.own_ram(id);
        // A file left by an earlier QEMU of this id (before a pause) would
        // hand its old contents to a new boot.
        let _ = std::fs::remove_file(&own);
        // Whatever fails before QEMU runs, the RAM file goes.
        let own_file = StartingRam::new(matches!(plan, RamPlan::Own { .. }).then(|| own.clone()));
        let ram = self.prepare_ram(id, &own, plan).await?;
        disks::hand_to_qemu(spec, &paths, self.vm_uid(&spec.id)?)?;
        // Until the machine is registered: a crash of the server meanwhile
        // leaves a machine the next one ends rather than adopts.
        std::fs::write(paths.starting(), b"").map_err(Self::io(id, "mark the machine starting"))?;
        let restore = incoming.is_some();
        let file_backed = ram.file_backed();
        let (pid, started) = self.spawn_qemu(spec, &paths, incoming, ram)?;
        let vm = Pending::new(
            self,
            id,
            Vm {
                paths,
                pid,
                link: tokio::sync::Mutex::new(None),
                volumes: !spec.volumes.is_empty(),
                ram: own_file.file().cloned(),
            },
        );
        // From here the machine owns its RAM file.
        own_file.keep();
        match self
            .bring_up(spec, vm.vm(), restore, file_backed, started)
            .await
        {
            Ok(()) => Ok(vm),
            Err(e) => {
                vm.end().await;
                Err(e)
            }
        }
    }

    /// QEMU's sockets, a restore's state loaded, the agent's link, the
    /// guest's setup.
    async fn bring_up(
        &self,
        spec: &MachineSpec,
        vm: &Vm,
        restore: bool,
        file_backed: bool,
        started: Instant,
    ) -> Result<(), HostError> {
        let (id, pid, paths) = (spec.id.as_str(), vm.pid, &vm.paths);
        self.wait_for_sockets(id, pid, paths, started).await?;
        let early = if restore {
            Some(self.load_state(id, paths, file_backed, started).await?)
        } else {
            None
        };
        let link = self.connect_agent(id, pid, paths, early, started).await?;
        tracing::info!(
            sandbox_id = id,
            ms = started.elapsed().as_millis() as u64,
            "agent ready"
        );
        *vm.link.lock().await = Some(link.clone());
        setup(
            &link,
            &spec.id,
            &spec.hostname,
            spec.guest_ca_pem.as_deref(),
        )
        .await
        .map_err(|e| self.start_failed(id, BootStage::Agent, e.to_string()))?;
        tracing::info!(
            sandbox_id = id,
            ms = started.elapsed().as_millis() as u64,
            "set up"
        );
        Ok(())
    }

    /// The RAM the new QEMU maps as `plan` says: a file of its own is `own`,
    /// first filled with a copy of the plan's file, if any.
    async fn prepare_ram<'a>(
        &self,
        id: &str,
        own: &'a Path,
        plan: RamPlan<'a>,
    ) -> Result<qemu::Ram<'a>, HostError> {
        Ok(match plan {
            RamPlan::Own { fill } => {
                if let Some(from) = fill {
                    copy_ram(from, own).await.map_err(|e| {
                        self.start_failed(id, BootStage::Restore, format!("copy of memory: {e}"))
                    })?;
                }
                qemu::Ram::Own(own)
            }
            RamPlan::CopyOf(file) => qemu::Ram::CopyOf(file),
            RamPlan::Anon => qemu::Ram::Anon,
        })
    }

    /// Spawns QEMU on the machine's disks and `ram` (loading `incoming`, if
    /// any) and places it in its cgroup: its pid and when it started.
    fn spawn_qemu(
        &self,
        spec: &MachineSpec,
        paths: &VmPaths,
        incoming: Option<std::fs::File>,
        ram: qemu::Ram<'_>,
    ) -> Result<(u32, Instant), HostError> {
        use std::os::fd::AsRawFd;
        let id = spec.id.as_str();
        let volumes = drive_files(spec, paths);
        let disk_roots = self.disk_roots();
        let cfg = VmConfig {
            qemu: &self.cfg.qemu_binary,
            kernel: &self.cfg.artifacts.kernel,
            initrd: &self.cfg.artifacts.initrd,
            accel: self.cfg.accel,
            vcpu: spec.vcpu,
            memory_mib: spec.memory_mib,
            paths,
            run_as: self.vm_uid(id)?,
            incoming: incoming.as_ref().map(|f| f.as_raw_fd()),
            volumes: &volumes,
            ram,
            disk_roots: &disk_roots,
        };
        // Sockets of an earlier QEMU (before a pause) must not pass for ours.
        let _ = std::fs::remove_file(paths.agent_sock());
        let _ = std::fs::remove_file(paths.qmp_sock());
        let started = Instant::now();
        let pid = qemu::spawn(&cfg)
            .map_err(|e| self.start_failed(id, BootStage::Spawn, e.to_string()))?;
        drop(incoming);
        let limits = cgroup::Limits {
            memory_mib: spec.memory_mib,
            vcpu: spec.vcpu,
        };
        if let Err(error) = cgroup::place(self.cgroups, id, pid, &limits) {
            tracing::warn!(sandbox_id = id, %error, "could not place QEMU in a cgroup");
        }
        tracing::info!(
            sandbox_id = id,
            pid,
            restore = cfg.incoming.is_some(),
            "launching"
        );
        Ok((pid, started))
    }

    /// Where the files a disk rests on may be: the images' directory and
    /// the base images' directory.
    fn disk_roots(&self) -> Vec<PathBuf> {
        let mut roots = vec![jail::normal(&self.cfg.images_dir)];
        if let Some(cache) = self.cfg.artifacts.base.parent() {
            roots.push(jail::normal(cache));
        }
        roots
    }

    /// Waits for QEMU's agent and QMP sockets: they appear once QEMU has
    /// parsed its options.
    async fn wait_for_sockets(
        &self,
        id: &str,
        pid: u32,
        paths: &VmPaths,
        started: Instant,
    ) -> Result<(), HostError> {
        let sock = paths.agent_sock();
        while !sock.exists() || !paths.qmp_sock().exists() {
            if !qemu::is_our_qemu_async(pid, &paths.dir).await {
                return Err(self.start_failed(
                    id,
                    BootStage::Spawn,
                    "QEMU exited during start-up".into(),
                ));
            }
            if started.elapsed() > Duration::from_secs(10) {
                return Err(self.start_failed(
                    id,
                    BootStage::Spawn,
                    "QEMU did not open its sockets".into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        Ok(())
    }

    /// A restore: loads the state (without the RAM when `file_backed`: the
    /// file holds it) and runs the vCPUs; the agent's socket, connected
    /// before they run.
    async fn load_state(
        &self,
        id: &str,
        paths: &VmPaths,
        file_backed: bool,
        started: Instant,
    ) -> Result<UnixStream, HostError> {
        let failed =
            |e: &dyn std::fmt::Display| self.start_failed(id, BootStage::Restore, e.to_string());
        // Connected while the vCPUs are stopped: whatever the agent
        // sends right after the restore has somewhere to go.
        let early = UnixStream::connect(paths.agent_sock())
            .await
            .map_err(|e| failed(&e))?;
        if file_backed {
            load_without_ram(paths).await.map_err(|e| failed(&e))?;
        }
        resume_loaded(paths).await.map_err(|e| failed(&e))?;
        tracing::info!(
            sandbox_id = id,
            ms = started.elapsed().as_millis() as u64,
            "state loaded"
        );
        Ok(early)
    }

    /// The link to the agent (over `early` when a restore connected
    /// already), within what is left of the boot timeout.
    async fn connect_agent(
        &self,
        id: &str,
        pid: u32,
        paths: &VmPaths,
        early: Option<UnixStream>,
        started: Instant,
    ) -> Result<Link, HostError> {
        let sock = paths.agent_sock();
        let remaining = self.cfg.boot_timeout.saturating_sub(started.elapsed());
        let connect = async {
            let acceptor = Some(self.acceptor(id));
            match early {
                Some(stream) => Link::over(stream, remaining, acceptor).await,
                None => Link::connect(&sock, remaining, acceptor).await,
            }
        };
        tokio::pin!(connect);
        loop {
            tokio::select! {
                r = &mut connect => match r {
                    Ok((link, _hello)) => return Ok(link),
                    Err(e) => {
                        let stage = if qemu::console_tail(paths, 1 << 20).contains("agent: ") {
                            BootStage::Agent
                        } else {
                            BootStage::Kernel
                        };
                        return Err(self.start_failed(id, stage, format!("no answer from the agent: {e}")));
                    }
                },
                _ = tokio::time::sleep(Duration::from_millis(100)) => {
                    if !qemu::is_our_qemu_async(pid, &paths.dir).await {
                        return Err(self.start_failed(id, BootStage::Kernel, "QEMU exited before the agent answered".into()));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use crate::fake_qemu::{gone, gone_soon, Fake, FakeHost};
    use crate::types::{BootStage, Host, HostError};

    #[tokio::test]
    async fn a_restore_whose_agent_socket_cannot_be_reached_ends_its_qemu() {
        let f = FakeHost::new("restore-connect");
        f.set(Fake::Sockets);
        let id = f.id("m");
        // A paused machine: its disk and a state to wake from.
        let paths = f.paths(&id);
        std::fs::create_dir_all(&paths.dir).unwrap();
        std::fs::write(paths.overlay(), b"").unwrap();
        std::fs::write(paths.paused_state(), b"").unwrap();
        let e = f.host.wake(&f.spec(&id)).await.unwrap_err();
        assert!(
            matches!(
                e,
                HostError::StartFailed {
                    stage: BootStage::Restore,
                    ..
                }
            ),
            "{e:?}"
        );
        let pid = f.pid_of(&id);
        assert!(gone(pid), "QEMU {pid} still runs");
        assert!(!f.has_cgroup(&id), "its cgroup is left");
        assert!(f.host.qemu_pid(&id).is_none());
        assert!(
            paths.paused_state().exists(),
            "the state to wake from stays"
        );
    }

    #[tokio::test]
    async fn a_start_that_fails_after_spawning_leaves_no_cgroup() {
        let f = FakeHost::new("start-fails");
        // Its agent never answers; it exits during start-up.
        for (n, fake) in [Fake::Sockets, Fake::Exits].into_iter().enumerate() {
            f.set(fake);
            let id = f.id(&format!("m{n}"));
            let e = f.host.start(&f.spec(&id)).await.unwrap_err();
            assert!(matches!(e, HostError::StartFailed { .. }), "{e:?}");
            let pid = f.pid_of(&id);
            // One that exits by itself may still be on its way out (its
            // command line already gone, so not killed as ours): a moment.
            assert!(gone_soon(pid).await, "{fake:?}: QEMU {pid} still runs");
            assert!(!f.has_cgroup(&id), "{fake:?}: its cgroup is left");
            assert!(
                !f.host.own_ram(&id).exists(),
                "{fake:?}: its RAM file is left"
            );
            assert!(f.host.qemu_pid(&id).is_none());
        }
    }

    #[tokio::test]
    async fn a_start_given_up_half_way_ends_its_qemu() {
        let f = FakeHost::new("start-dropped");
        f.set(Fake::Silent);
        let id = f.id("m");
        let spec = f.spec(&id);
        let pidfile = f.paths(&id).pidfile();
        let spawned = async {
            // The whole pid: the file exists before it is written.
            while !std::fs::read_to_string(&pidfile).is_ok_and(|p| p.ends_with('\n')) {
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        };
        // Given up (the caller went away) while it waits for QEMU's sockets.
        tokio::select! {
            r = f.host.start(&spec) => panic!("the fake never opens its sockets: {r:?}"),
            () = spawned => {}
        }
        let pid = f.pid_of(&id);
        assert!(gone_soon(pid).await, "QEMU {pid} still runs");
        for _ in 0..500 {
            if !f.has_cgroup(&id) {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(!f.has_cgroup(&id), "its cgroup is left");
        assert!(!f.host.own_ram(&id).exists(), "its RAM file is left");
        assert!(f.host.qemu_pid(&id).is_none());
    }
}
