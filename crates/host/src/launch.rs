//! The boot and restore sequence: QEMU started on a machine's disks and
//! RAM, its sockets awaited, a state loaded (a restore), the agent's link
//! made and the guest set up, in named steps.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::UnixStream;

use crate::capture::{load_without_ram, resume_loaded};
use crate::cgroup;
use crate::disks::{self, drive_files};
use crate::guest_setup::{mount_volumes, setup};
use crate::link::Link;
use crate::machine::{QemuHost, Vm};
use crate::qemu::{self, VmConfig, VmPaths};
use crate::ram::{copy_ram, RamPlan, StartingRam};
use crate::types::{BootStage, HostError, MachineSpec};
use crate::uid;

impl QemuHost {
    /// Boots a new machine of `spec`: a fresh directory, an overlay, its
    /// volumes' copies, QEMU, then its volumes mounted.
    pub(crate) async fn boot(&self, spec: &MachineSpec) -> Result<Arc<Vm>, HostError> {
        let paths = self.fresh_dir(spec).await?;
        self.new_overlay(spec, &paths).await?;
        self.copy_snapshot_volumes(spec, &paths).await?;
        let vm = self
            .launch(spec, paths, None, RamPlan::Own { fill: None })
            .await?;
        if let Err(e) = mount_volumes(&vm, spec).await {
            self.end_vm(&spec.id, &vm).await;
            return Err(e);
        }
        Ok(vm)
    }

    /// Starts QEMU in `paths` (its disk already there), either booting or
    /// loading the state in `incoming`, and returns once the agent answered.
    /// `ram` says where its RAM lives; with a file, `incoming` holds no RAM.
    pub(crate) async fn launch(
        &self,
        spec: &MachineSpec,
        paths: VmPaths,
        incoming: Option<std::fs::File>,
        plan: RamPlan<'_>,
    ) -> Result<Arc<Vm>, HostError> {
        let id = spec.id.as_str();
        let own = self.own_ram(id);
        // A file left by an earlier QEMU of this id (before a pause) would
        // hand its old contents to a new boot.
        let _ = std::fs::remove_file(&own);
        // Whatever fails from here, the RAM file goes with the machine.
        let own_file = StartingRam::new(matches!(plan, RamPlan::Own { .. }).then(|| own.clone()));
        let ram = self.prepare_ram(id, &own, plan).await?;
        disks::hand_to_qemu(spec, &paths)?;
        let restore = incoming.is_some();
        let file_backed = ram.file_backed();
        let (pid, started) = self.spawn_qemu(spec, &paths, incoming, ram)?;
        self.wait_for_sockets(id, pid, &paths, started).await?;
        let early = if restore {
            Some(
                self.load_state(id, pid, &paths, file_backed, started)
                    .await?,
            )
        } else {
            None
        };
        let link = self.connect_agent(id, pid, &paths, early, started).await?;
        tracing::info!(
            sandbox_id = id,
            ms = started.elapsed().as_millis() as u64,
            "agent ready"
        );
        let vm = Arc::new(Vm {
            paths,
            pid,
            link: tokio::sync::Mutex::new(Some(link.clone())),
            volumes: !spec.volumes.is_empty(),
            ram: own_file.file().cloned(),
        });
        if let Err(e) = setup(&link, &spec.hostname, spec.guest_ca_pem.as_deref()).await {
            qemu::kill(pid).await;
            return Err(self.start_failed(id, BootStage::Agent, e.to_string()));
        }
        own_file.keep();
        tracing::info!(
            sandbox_id = id,
            ms = started.elapsed().as_millis() as u64,
            "set up"
        );
        Ok(vm)
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
        let cfg = VmConfig {
            qemu: &self.cfg.qemu_binary,
            kernel: &self.cfg.artifacts.kernel,
            initrd: &self.cfg.artifacts.initrd,
            accel: self.cfg.accel,
            vcpu: spec.vcpu,
            memory_mib: spec.memory_mib,
            paths,
            run_as: uid::vm_uid(id),
            incoming: incoming.as_ref().map(|f| f.as_raw_fd()),
            volumes: &volumes,
            ram,
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
            if !qemu::is_our_qemu(pid, &paths.dir) {
                return Err(self.start_failed(
                    id,
                    BootStage::Spawn,
                    "QEMU exited during start-up".into(),
                ));
            }
            if started.elapsed() > Duration::from_secs(10) {
                qemu::kill(pid).await;
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
        pid: u32,
        paths: &VmPaths,
        file_backed: bool,
        started: Instant,
    ) -> Result<UnixStream, HostError> {
        // Connected while the vCPUs are stopped: whatever the agent
        // sends right after the restore has somewhere to go.
        let early = UnixStream::connect(paths.agent_sock())
            .await
            .map_err(|e| self.start_failed(id, BootStage::Restore, e.to_string()))?;
        if file_backed {
            if let Err(e) = load_without_ram(paths).await {
                qemu::kill(pid).await;
                return Err(self.start_failed(id, BootStage::Restore, e.to_string()));
            }
        }
        if let Err(e) = resume_loaded(paths).await {
            qemu::kill(pid).await;
            return Err(self.start_failed(id, BootStage::Restore, e.to_string()));
        }
        tracing::info!(
            sandbox_id = id,
            ms = started.elapsed().as_millis() as u64,
            "state loaded"
        );
        Ok(early)
    }

    /// The link to the agent (over `early` when a restore connected
    /// already), within what is left of the boot timeout; QEMU ended when
    /// it never comes.
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
                        qemu::kill(pid).await;
                        let stage = if qemu::console_tail(paths, 1 << 20).contains("agent: ") {
                            BootStage::Agent
                        } else {
                            BootStage::Kernel
                        };
                        return Err(self.start_failed(id, stage, format!("no answer from the agent: {e}")));
                    }
                },
                _ = tokio::time::sleep(Duration::from_millis(100)) => {
                    if !qemu::is_our_qemu(pid, &paths.dir) {
                        return Err(self.start_failed(id, BootStage::Kernel, "QEMU exited before the agent answered".into()));
                    }
                }
            }
        }
    }
}
