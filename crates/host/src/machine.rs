//! [`QemuHost`]: the [`Host`] trait on QEMU microVMs.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use runtime_proto::{Reply, Request};

use crate::artifacts::Artifacts;
use crate::capture::CaptureFailed;
use crate::cgroup::{self, Layout};
use crate::convert::{exec_request, file_op_result, file_request, guest_err, user, watch_request};
use crate::disks::copy_sparse;
use crate::guest_setup::{grow_root_fs, mount_volumes, setup, sync_guest};
use crate::link::{Acceptor, Link};
use crate::network::Networks;
use crate::pump::{self, pump};
use crate::qemu::{self, Accel, VmPaths};
use crate::ram::{self, RamPlan};
use crate::read::{overrun, too_large, Next, Read, READ_PIECES};
use crate::share::{ShareHandle, ShareSpec};
use crate::tunnel::{self, Slot};
use crate::types::*;
use crate::uid;

/// How a [`QemuHost`] runs its machines.
#[derive(Debug, Clone)]
pub struct QemuConfig {
    /// Where each VM gets its directory (overlay, sockets, console log).
    pub state_dir: PathBuf,
    /// Where custom images' disks live: a machine's disk may rest only on
    /// files under it or in the base image's directory.
    pub images_dir: PathBuf,
    pub qemu_binary: PathBuf,
    pub artifacts: Artifacts,
    pub accel: Accel,
    /// From QEMU's start until the agent must have answered.
    pub boot_timeout: Duration,
    /// Start sandboxes by restoring a pre-booted template of their shape
    /// (built in the background after the first boot of that shape).
    pub templates: bool,
    /// Machines restored from a template map its RAM file privately
    /// (copy-on-write: the pages no guest writes are held once, by the
    /// template's file) instead of each getting a copy of their own. Denser
    /// idle machines; their pause, fork and snapshot write the whole memory
    /// through QEMU's migration (docs/memory.md, "Sharing a template's
    /// memory").
    pub share_template_memory: bool,
    /// The egress proxy of this host's guests (its test-only host map among
    /// its settings).
    pub egress: runtime_egress::EgressConfig,
    /// TEST ONLY (`--test-crash-at`): the point of a capture or pause at
    /// which the server kills itself, as a SIGKILL would ([`crash_point`]).
    pub test_crash_at: Option<String>,
}

/// A running machine: its QEMU and the link to its agent.
pub(crate) struct Vm {
    pub(crate) paths: VmPaths,
    pub(crate) pid: u32,
    pub(crate) link: tokio::sync::Mutex<Option<Link>>,
    /// It has volume drives: what the guest wrote to them is flushed before
    /// the machine is paused or ended, so it never lives only in its memory.
    pub(crate) volumes: bool,
    /// Its own RAM file (mapped shared), or `None`: a fork's copy or a
    /// shared template restore (a private mapping of a frozen file) or
    /// anonymous memory. Only a
    /// machine with its own file is captured without its RAM in the state.
    pub(crate) ram: Option<PathBuf>,
}

impl Drop for Vm {
    fn drop(&mut self) {
        // QEMU's socket takes one client at a time: let go of ours so a later
        // host (after a restart) can connect.
        if let Ok(guard) = self.link.try_lock() {
            if let Some(l) = guard.as_ref() {
                l.close();
            }
        }
    }
}

/// One sandbox's shares, by share id.
type Shares = HashMap<String, Arc<ShareHandle>>;

/// Cheap to clone: clones share their machines.
#[derive(Clone)]
pub struct QemuHost {
    pub(crate) cfg: Arc<QemuConfig>,
    /// Guests' RAM files: tmpfs where the host has one (see `ram::choose_dir`).
    pub(crate) ram_dir: Arc<PathBuf>,
    pub(crate) cgroups: Layout,
    pub(crate) vms: Arc<Mutex<HashMap<String, Arc<Vm>>>>,
    /// Template keys being built now.
    pub(crate) building: Arc<Mutex<std::collections::HashSet<String>>>,
    /// Each sandbox's network, as the egress proxy applies it.
    pub(crate) networks: Arc<Networks>,
    /// Receives the guests' outbound connections: the egress proxy
    /// (`networks`), or a stand-in given to [`QemuHost::with_outbound`].
    pub(crate) outbound: Arc<dyn Outbound>,
    /// Open tunnels per sandbox (both directions), for the cap.
    pub(crate) tunnels: Arc<Mutex<HashMap<String, Arc<std::sync::atomic::AtomicUsize>>>>,
    /// Shared volumes mounted per sandbox, by share id.
    pub(crate) shares: Arc<Mutex<HashMap<String, Shares>>>,
    /// Each machine's QEMU uid (as root), persisted under the state dir.
    pub(crate) uids: Arc<uid::UidPool>,
}

impl QemuHost {
    pub fn new(cfg: QemuConfig) -> std::io::Result<QemuHost> {
        let networks = Arc::new(Networks::new(cfg.egress.clone()));
        Self::build(cfg, Arc::clone(&networks) as Arc<dyn Outbound>, networks)
    }

    /// A host whose guests' outbound connections go to `outbound` instead
    /// of the egress proxy: for tests of the tunnels themselves.
    pub fn with_outbound(
        cfg: QemuConfig,
        outbound: Arc<dyn Outbound>,
    ) -> std::io::Result<QemuHost> {
        let networks = Arc::new(Networks::new(cfg.egress.clone()));
        Self::build(cfg, outbound, networks)
    }

    fn build(
        cfg: QemuConfig,
        outbound: Arc<dyn Outbound>,
        networks: Arc<Networks>,
    ) -> std::io::Result<QemuHost> {
        std::fs::create_dir_all(&cfg.state_dir)?;
        uid::let_qemu_reach(&cfg)?;
        let cgroups = cgroup::detect();
        let ram = ram::choose_dir(&cfg.state_dir);
        std::fs::create_dir_all(&ram)?;
        {
            use std::os::unix::fs::PermissionsExt;
            // QEMU opens its RAM file before it drops to its own uid.
            std::fs::set_permissions(&ram, std::fs::Permissions::from_mode(0o700))?;
        }
        tracing::info!(accel = %cfg.accel, cgroups = ?cgroups, templates = cfg.templates, ram_dir = %ram.display(), "qemu host ready");
        let uids = Arc::new(uid::UidPool::open(
            &cfg.state_dir.join(".uids"),
            uid::VM_UIDS,
        )?);
        let host = QemuHost {
            uids,
            ram_dir: Arc::new(ram),
            cfg: Arc::new(cfg),
            cgroups,
            vms: Arc::new(Mutex::new(HashMap::new())),
            building: Arc::new(Mutex::new(std::collections::HashSet::new())),
            networks,
            outbound,
            tunnels: Arc::default(),
            shares: Arc::default(),
        };
        host.drop_stale_templates();
        host.drop_stale_machines();
        host.drop_stale_ram();
        // The uids of machines whose directory is gone go back to the pool.
        host.uids.sweep(|owner| host.paths(owner).dir.is_dir());
        Ok(host)
    }

    /// Ends every share of `id` (its machine stops or is destroyed).
    fn end_shares(&self, id: &str) {
        if let Some(all) = self.shares.lock().ok().and_then(|mut m| m.remove(id)) {
            for h in all.values() {
                h.stop();
            }
        }
    }

    /// After a wake: each share of `id` is joined to a stream of the new
    /// link (the mount stayed in the guest's memory).
    async fn rejoin_shares(&self, id: &str) {
        let all: Vec<Arc<ShareHandle>> = self
            .shares
            .lock()
            .ok()
            .and_then(|m| m.get(id).map(|s| s.values().cloned().collect()))
            .unwrap_or_default();
        if all.is_empty() {
            return;
        }
        let Ok(link) = self.link(id).await else {
            return;
        };
        for h in all {
            let Ok(stream) = link.open() else { return };
            let req = Request::Share {
                id: h.spec.id.clone(),
                path: h.spec.path.clone(),
            };
            if stream.send(&req).is_err() {
                return;
            }
            if let Err(e) = h.join(stream).await {
                tracing::warn!(sandbox = id, share = %h.spec.id, "a share was not joined again after the wake: {e}");
            }
        }
    }

    /// The directory of the guests' RAM files.
    pub fn ram_dir(&self) -> &Path {
        &self.ram_dir
    }

    fn tunnel_count(&self, id: &str) -> Arc<std::sync::atomic::AtomicUsize> {
        let mut m = self.tunnels.lock().unwrap_or_else(|e| e.into_inner());
        Arc::clone(m.entry(id.to_owned()).or_default())
    }

    /// Hands the guest's outbound connections of sandbox `id` to the
    /// [`Outbound`] handler (refused beyond the cap).
    pub(crate) fn acceptor(&self, id: &str) -> Acceptor {
        let outbound = Arc::clone(&self.outbound);
        let count = self.tunnel_count(id);
        let sandbox = id.to_owned();
        Arc::new(
            move |stream: crate::link::Stream| match Slot::take(&count) {
                Some(slot) => outbound.accept(&sandbox, tunnel::start(stream, slot)),
                None => {
                    tracing::warn!(sandbox_id = %sandbox, "too many connections: refusing an outbound one");
                    let _ = stream.send(&Request::Close);
                }
            },
        )
    }

    pub(crate) fn paths(&self, id: &str) -> VmPaths {
        VmPaths::new(self.cfg.state_dir.join(id))
    }

    pub(crate) fn vm(&self, id: &str) -> Result<Arc<Vm>, HostError> {
        self.vms
            .lock()
            .ok()
            .and_then(|m| m.get(id).cloned())
            .ok_or_else(|| HostError::NoSuchMachine { id: id.to_owned() })
    }

    /// The VM's link, reconnecting if it dropped (QEMU keeps the socket).
    pub(crate) async fn link(&self, id: &str) -> Result<Link, HostError> {
        let vm = self.vm(id)?;
        let mut guard = vm.link.lock().await;
        if let Some(l) = guard.as_ref() {
            if !l.is_closed() {
                return Ok(l.clone());
            }
        }
        if !qemu::is_our_qemu_async(vm.pid, &vm.paths.dir).await {
            return Err(HostError::LinkLost { id: id.to_owned() });
        }
        let (l, _) = Link::connect(
            &vm.paths.agent_sock(),
            Duration::from_secs(10),
            Some(self.acceptor(id)),
        )
        .await
        .map_err(|_| HostError::LinkLost { id: id.to_owned() })?;
        *guard = Some(l.clone());
        Ok(l)
    }

    pub(crate) fn io<'a>(
        id: &'a str,
        op: &'static str,
    ) -> impl FnOnce(std::io::Error) -> HostError + 'a {
        move |source| HostError::Io {
            id: id.to_owned(),
            op,
            source,
        }
    }

    pub(crate) fn start_failed(&self, id: &str, stage: BootStage, reason: String) -> HostError {
        let paths = self.paths(id);
        let mut tail = qemu::console_tail(&paths, 4096);
        if let Ok(q) = std::fs::read_to_string(paths.qemu_log()) {
            if !q.trim().is_empty() {
                tail.push_str("\n--- qemu ---\n");
                tail.push_str(q.trim());
            }
        }
        HostError::StartFailed {
            id: id.to_owned(),
            stage,
            reason,
            console_tail: tail,
        }
    }

    pub(crate) fn take_vm(&self, id: &str) -> Option<Arc<Vm>> {
        self.vms.lock().ok().and_then(|mut m| m.remove(id))
    }

    pub(crate) fn insert_vm(&self, id: &str, vm: Arc<Vm>) {
        if let Ok(mut m) = self.vms.lock() {
            m.insert(id.to_owned(), vm);
        }
    }

    /// Keeps a pause's capture `file` as the machine's paused state, made
    /// durable (with its memory copy) before the pause is reported: a
    /// `paused` record always has a whole state to wake from.
    async fn keep_paused(
        &self,
        id: &str,
        vm: &Vm,
        file: &Path,
    ) -> Result<(), crate::capture::CaptureFailed> {
        let failed = |op| {
            move |e| CaptureFailed {
                error: Self::io(id, op)(e),
                stopped: true,
            }
        };
        let (state, ram) = (vm.paths.paused_state(), vm.paths.paused_ram());
        crate::disks::sync_files(vec![file.to_owned(), ram], &vm.paths.dir)
            .await
            .map_err(failed("sync paused state"))?;
        std::fs::rename(file, &state).map_err(failed("keep paused state"))?;
        let synced = crate::disks::sync_files(Vec::new(), &vm.paths.dir).await;
        if synced.is_err() {
            // The machine runs on: no state to wake from may be left beside it.
            let _ = std::fs::remove_file(&state);
        }
        synced.map_err(failed("sync paused state"))
    }

    /// Registers a machine that is up (set up, its volumes mounted): from
    /// now on a crash of the server leaves it to be adopted, not ended.
    pub(crate) fn register(&self, id: &str, vm: Arc<Vm>) {
        let starting = vm.paths.starting();
        self.insert_vm(id, vm);
        if let Err(error) = std::fs::remove_file(&starting) {
            if error.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(sandbox_id = id, %error, "could not mark the machine started");
            }
        }
    }
}

#[async_trait]
impl Host for QemuHost {
    fn egress_traffic(&self) -> Option<runtime_egress::Traffic> {
        Some(self.networks.traffic())
    }

    fn take_egress_outbound(&self) -> Vec<(String, u64)> {
        self.networks.take_outbound()
    }

    async fn room(&self) -> Option<crate::Room> {
        let (ram, state) = (self.ram_dir.to_path_buf(), self.cfg.state_dir.clone());
        tokio::task::spawn_blocking(move || ram::room(&ram, &state))
            .await
            .ok()
            .flatten()
    }

    async fn start(&self, spec: &MachineSpec) -> Result<(), HostError> {
        if self.start_from_template(spec).await {
            return Ok(());
        }
        self.boot(spec).await?.register();
        Ok(())
    }

    async fn start_warm(&self, spec: &MachineSpec) -> Result<bool, HostError> {
        self.start_warm_machine(spec).await
    }

    async fn assume(&self, spec: &MachineSpec) -> Result<(), HostError> {
        let id = spec.id.as_str();
        let began = std::time::Instant::now();
        let vm = self.vm(id)?;
        // Until it is set up: a crash of the server meanwhile leaves a
        // machine the next one ends rather than adopts with another's setup.
        let starting = vm.paths.starting();
        std::fs::write(&starting, b"").map_err(Self::io(id, "mark the machine starting"))?;
        let link = self.link(id).await?;
        setup(
            &link,
            &spec.id,
            &spec.hostname,
            spec.guest_ca_pem.as_deref(),
        )
        .await
        .map_err(|e| self.start_failed(id, BootStage::Agent, e.to_string()))?;
        std::fs::remove_file(&starting).map_err(Self::io(id, "mark the machine started"))?;
        tracing::info!(
            sandbox_id = id,
            ms = began.elapsed().as_millis() as u64,
            "warm machine set up"
        );
        Ok(())
    }

    async fn recover(&self, spec: &MachineSpec) -> Result<bool, HostError> {
        let id = spec.id.as_str();
        if self.vm(id).is_ok() {
            return Ok(true);
        }
        let paths = self.paths(id);
        let found = match qemu::read_pid(&paths) {
            Some(pid) if qemu::is_our_qemu_async(pid, &paths.dir).await => Some(pid),
            _ => None,
        };
        let Some(pid) = found else {
            // It ended under the earlier server: what it left goes too.
            self.end_untracked(id).await;
            return Ok(false);
        };
        if let Err(why) = self.settle_found(&paths).await {
            tracing::warn!(
                sandbox_id = id,
                pid,
                why,
                "machine found but not adopted: ending it"
            );
            self.end_untracked(id).await;
            return Ok(false);
        }
        match Link::connect(
            &paths.agent_sock(),
            Duration::from_secs(10),
            Some(self.acceptor(id)),
        )
        .await
        {
            Ok((link, _)) => {
                qemu::keep_console_bounded(pid, &paths);
                let own = self.own_ram(id);
                let vm = Arc::new(Vm {
                    paths,
                    pid,
                    link: tokio::sync::Mutex::new(Some(link)),
                    volumes: !spec.volumes.is_empty(),
                    ram: own.exists().then_some(own),
                });
                self.insert_vm(id, vm);
                tracing::info!(sandbox_id = id, pid, "recovered running machine");
                Ok(true)
            }
            Err(error) => {
                tracing::warn!(sandbox_id = id, %error, "machine found but its agent does not answer: ending it");
                self.end_untracked(id).await;
                Ok(false)
            }
        }
    }

    fn has_paused_state(&self, id: &str) -> bool {
        self.paths(id).paused_state().is_file()
    }

    async fn sweep(&self, owned: &std::collections::HashSet<String>) -> Vec<String> {
        let mut ended = Vec::new();
        for id in self.machine_dirs() {
            if owned.contains(&id) {
                continue;
            }
            tracing::info!(sandbox_id = %id, "no record owns this machine: ending it");
            self.networks.forget(&id);
            let _ = self.stop(&id, false).await;
            ended.push(id);
        }
        ended
    }

    async fn grow_disk(&self, id: &str, disk_mib: u32) -> Result<(), HostError> {
        let vm = self.vm(id)?;
        let failed = |reason: String| HostError::Grow {
            id: id.to_owned(),
            reason,
        };
        let mut q = crate::qmp::Qmp::connect(&vm.paths.qmp_sock(), Duration::from_secs(10))
            .await
            .map_err(|e| failed(e.to_string()))?;
        q.execute(
            "block_resize",
            serde_json::json!({"device": "root", "size": u64::from(disk_mib) << 20}),
        )
        .await
        .map_err(|e| failed(e.to_string()))?;
        drop(q);
        let link = self.link(id).await?;
        grow_root_fs(&link, disk_mib).await.map_err(failed)
    }

    async fn stop(&self, id: &str, keep_disk: bool) -> Result<(), HostError> {
        self.end_shares(id);
        match self.take_vm(id) {
            Some(vm) => {
                if keep_disk || vm.volumes {
                    sync_guest(&vm).await;
                }
                self.end_vm(id, &vm).await;
            }
            None => self.end_untracked(id).await,
        }
        if !keep_disk {
            let _ = std::fs::remove_dir_all(self.paths(id).dir);
            self.uids.release(id);
            // Its tunnels end with the link; their slots go with their pumps.
            if let Ok(mut t) = self.tunnels.lock() {
                t.remove(id);
            }
        }
        Ok(())
    }

    async fn destroy(&self, id: &str) -> Result<(), HostError> {
        self.networks.forget(id);
        self.stop(id, false).await
    }

    async fn cpu_time(&self, id: &str) -> Option<Duration> {
        let vm = self.vm(id).ok()?;
        crate::cpu_time::vcpu_time(vm.pid)
    }

    async fn memory_bytes(&self, id: &str) -> Option<u64> {
        let vm = self.vm(id).ok()?;
        crate::cpu_time::resident_bytes(vm.pid)
    }

    fn capture_estimate(&self, id: &str, memory: bool) -> Option<u64> {
        use std::os::unix::fs::MetadataExt;
        // Allocated bytes: disks and RAM files are sparse, as captures are.
        let allocated = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.blocks() * 512);
        let paths = self.paths(id);
        if !paths.dir.is_dir() {
            return None;
        }
        let mut bytes = allocated(&paths.overlay());
        if memory {
            bytes += match self.vm(id) {
                // The RAM file it holds, or its QEMU's resident memory.
                Ok(vm) => vm.ram.as_deref().map_or_else(
                    || crate::cpu_time::resident_bytes(vm.pid).unwrap_or(0),
                    allocated,
                ),
                Err(_) => allocated(&paths.paused_ram()) + allocated(&paths.paused_state()),
            };
        }
        Some(bytes)
    }

    async fn console_tail(&self, id: &str, max_bytes: usize) -> Option<String> {
        let paths = self.paths(id);
        if !paths.dir.is_dir() {
            return None;
        }
        tokio::task::spawn_blocking(move || qemu::console_tail(&paths, max_bytes))
            .await
            .ok()
    }

    async fn connect(&self, id: &str, port: u16) -> Result<DuplexStream, HostError> {
        let link = self.link(id).await?;
        let lost = || HostError::LinkLost { id: id.to_owned() };
        let slot = Slot::take(&self.tunnel_count(id)).ok_or_else(|| HostError::Guest {
            id: id.to_owned(),
            failure: GuestFailure::Io,
            message: format!("too many connections (at most {})", tunnel::MAX_TUNNELS),
        })?;
        let mut stream = link.open().map_err(|_| lost())?;
        stream
            .send(&Request::Connect { port })
            .map_err(|_| lost())?;
        // Given up before the answer (the caller went away, or a timeout):
        // the agent may connect anyway, so reset what it opens.
        struct Abandon(Option<crate::link::StreamSender>);
        impl Drop for Abandon {
            fn drop(&mut self) {
                if let Some(s) = self.0.take() {
                    let _ = s.send(&Request::Close);
                    s.ended();
                }
            }
        }
        let mut abandon = Abandon(Some(stream.sender()));
        let reply = tokio::time::timeout(Duration::from_secs(30), stream.reply())
            .await
            .map_err(|_| HostError::Timeout {
                id: id.to_owned(),
                what: "a connection into the guest",
            })?
            .map_err(|_| lost())?;
        abandon.0 = None;
        match reply {
            Reply::Done => Ok(tunnel::start(stream, slot)),
            other => Err(guest_err(id, other)),
        }
    }

    fn scratch_dir(&self) -> Option<PathBuf> {
        Some(self.forks_dir())
    }

    fn set_network(&self, id: &str, net: GuestNet) {
        self.networks.set(id, net);
    }

    fn egress_connection(&self, id: &str) -> Result<crate::EgressConnection, HostError> {
        self.networks
            .connection(id)
            .ok_or_else(|| HostError::NoSuchMachine { id: id.to_owned() })
    }

    fn forget_network(&self, id: &str) {
        self.networks.forget(id);
    }

    fn serve_api(&self, api: Option<Arc<dyn runtime_egress::InternalApi>>) {
        self.networks.serve_api(api);
    }

    async fn pause(&self, id: &str) -> Result<(), HostError> {
        let vm = self
            .take_vm(id)
            .ok_or_else(|| HostError::NoSuchMachine { id: id.to_owned() })?;
        if vm.volumes {
            // A paused machine may be deleted without waking: its writes to
            // volumes must not stay in its saved memory only.
            sync_guest(&vm).await;
        }
        let _ = std::fs::remove_file(vm.paths.paused_ram());
        let kept = match self.capture_for_pause(id, &vm).await {
            Ok(file) => {
                crash_point(self.cfg.test_crash_at.as_deref(), "pause_capture");
                self.keep_paused(id, &vm, &file).await
            }
            Err(failed) => Err(failed),
        };
        if kept.is_ok() {
            crash_point(self.cfg.test_crash_at.as_deref(), "pause_kept");
        }
        match kept {
            Ok(()) => {
                self.end_vm(id, &vm).await;
                tracing::info!(sandbox_id = id, "paused");
                Ok(())
            }
            Err(failed) => self.pause_failed(id, vm, failed).await,
        }
    }

    async fn wake(&self, spec: &MachineSpec) -> Result<(), HostError> {
        let id = spec.id.as_str();
        let paths = self.paths(id);
        let state = paths.paused_state();
        let file =
            std::fs::File::open(&state).map_err(|_| HostError::NotPaused { id: id.to_owned() })?;
        let ram = paths.paused_ram();
        let plan = RamPlan::waking(ram.exists().then_some(ram.as_path()));
        let vm = self.launch(spec, paths.clone(), Some(file), plan).await?;
        // Registered first: a crash between the two leaves a machine that
        // is adopted (and its old state dropped), never a paused record
        // without a state to wake from.
        vm.register();
        crash_point(self.cfg.test_crash_at.as_deref(), "wake_running");
        // The machine has moved on from that state; keep only the newest.
        let _ = std::fs::remove_file(&state);
        let _ = std::fs::remove_file(&ram);
        self.rejoin_shares(id).await;
        Ok(())
    }

    async fn share(&self, id: &str, spec: ShareSpec) -> Result<(), HostError> {
        let served = self
            .shares
            .lock()
            .ok()
            .is_some_and(|m| m.get(id).is_some_and(|s| s.contains_key(&spec.id)));
        if served {
            return Ok(());
        }
        let link = self.link(id).await?;
        if link.peer_version() < runtime_proto::SHARE_VERSION {
            return Err(HostError::Guest {
                id: id.to_owned(),
                failure: GuestFailure::Io,
                message: format!(
                    "the guest agent (protocol {}) is older than shared volumes; restart the sandbox",
                    link.peer_version()
                ),
            });
        }
        let exe = std::env::current_exe().map_err(Self::io(id, "find the server binary"))?;
        let share_id = spec.id.clone();
        let path = spec.path.clone();
        let handle =
            Arc::new(crate::share::start(spec, &exe).map_err(Self::io(id, "start a 9P server"))?);
        let lost = || HostError::LinkLost { id: id.to_owned() };
        let stream = link.open().map_err(|_| lost())?;
        stream
            .send(&Request::Share {
                id: share_id.clone(),
                path,
            })
            .map_err(|_| lost())?;
        if let Err(message) = handle.join(stream).await {
            handle.stop();
            return Err(HostError::Guest {
                id: id.to_owned(),
                failure: GuestFailure::Io,
                message,
            });
        }
        if let Ok(mut m) = self.shares.lock() {
            if let Some(old) = m.entry(id.to_owned()).or_default().insert(share_id, handle) {
                old.stop();
            }
        }
        Ok(())
    }

    async fn unshare(&self, id: &str, share_id: &str) -> Result<(), HostError> {
        let handle = self
            .shares
            .lock()
            .ok()
            .and_then(|mut m| m.get_mut(id).and_then(|s| s.remove(share_id)));
        if let Ok(link) = self.link(id).await {
            let _ = tokio::time::timeout(
                Duration::from_secs(30),
                link.call(&Request::Unshare {
                    id: share_id.to_owned(),
                }),
            )
            .await;
        }
        if let Some(h) = handle {
            h.stop();
        }
        Ok(())
    }

    async fn capture(&self, id: &str, dest: &Path, memory: bool) -> Result<(), HostError> {
        std::fs::create_dir_all(dest).map_err(Self::io(id, "create capture dir"))?;
        let running = self.vm(id).ok();
        let result = match &running {
            Some(vm) => self.capture_running(id, vm, dest, memory).await,
            None => self.capture_paused(id, dest, memory).await,
        };
        let result = match result {
            Ok(()) => crate::disks::sync_dir_async(dest)
                .await
                .map_err(Self::io(id, "sync capture")),
            Err(e) => Err(e),
        };
        if result.is_err() {
            let _ = std::fs::remove_dir_all(dest);
        }
        result
    }

    async fn restore(&self, spec: &MachineSpec, from: &Path) -> Result<(), HostError> {
        let id = spec.id.as_str();
        let disk = from.join("disk.qcow2");
        if !disk.exists() {
            return Err(HostError::BadCapture {
                path: from.to_owned(),
                reason: "no disk.qcow2".into(),
            });
        }
        let memory = from.join("memory.state");
        if memory.exists() && !spec.volumes.is_empty() {
            // Its devices would not match the captured machine's.
            return Err(HostError::BadCapture {
                path: from.to_owned(),
                reason: "a machine with volumes starts only by booting, not from memory".into(),
            });
        }
        let paths = self.fresh_dir(spec).await?;
        copy_sparse(&disk, &paths.overlay())
            .await
            .map_err(Self::io(id, "copy disk"))?;
        let incoming = if memory.exists() {
            Some(std::fs::File::open(&memory).map_err(Self::io(id, "open capture"))?)
        } else {
            // A boot: its disk at the spec's size when that is larger (a
            // resize, a create from a snapshot asking for more); the agent
            // grows the file system as it boots.
            crate::disks::grow_to(&paths.overlay(), spec.disk_mib)
                .await
                .map_err(|e| self.start_failed(id, BootStage::Disk, e))?;
            self.copy_snapshot_volumes(spec, &paths).await?;
            None
        };
        // A capture of a machine with its own RAM file: a fork's copies (and,
        // when the host shares templates' memory, a template's restores)
        // map it privately, sharing the pages none of them writes; anything
        // else started from it gets a file of its own.
        let ram = from.join("memory.ram");
        let shared = from.starts_with(self.forks_dir())
            || (self.cfg.share_template_memory && from.starts_with(self.templates_dir()));
        let plan = RamPlan::restoring(
            incoming.is_some(),
            ram.exists().then_some(ram.as_path()),
            shared,
        );
        let vm = self.launch(spec, paths, incoming, plan).await?;
        if let Err(e) = mount_volumes(vm.vm(), spec).await {
            vm.end().await;
            return Err(e);
        }
        vm.register();
        Ok(())
    }

    async fn exec(&self, id: &str, spec: ExecSpec) -> Result<ExecHandle, HostError> {
        let link = self.link(id).await?;
        if spec.trace_files && link.peer_version() < runtime_proto::TRACE_VERSION {
            return Err(HostError::Guest {
                id: id.to_owned(),
                failure: GuestFailure::Unsupported,
                message: format!(
                    "this sandbox's agent speaks protocol {}, older than traced files: stop and start the sandbox (or create a new one) to trace a command's files",
                    link.peer_version()
                ),
            });
        }
        let lost = || HostError::LinkLost { id: id.to_owned() };
        let mut stream = link.open().map_err(|_| lost())?;
        stream
            .send(&Request::Exec(exec_request(spec)))
            .map_err(|_| lost())?;
        let pid = match stream.reply().await.map_err(|_| lost())? {
            Reply::Started { pid } => pid,
            other => return Err(guest_err(id, other)),
        };
        Ok(pump(stream, pid))
    }

    async fn attach(&self, id: &str, token: u64) -> Result<ExecHandle, HostError> {
        let link = self.link(id).await?;
        let lost = || HostError::LinkLost { id: id.to_owned() };
        let sid = u32::try_from(token).map_err(|_| HostError::Guest {
            id: id.to_owned(),
            failure: GuestFailure::BadRequest,
            message: format!("no process {token}"),
        })?;
        let mut stream = link.open_at(sid).map_err(|_| lost())?;
        stream.send(&Request::Attach).map_err(|_| lost())?;
        // Output the agent held across a pause may come before the answer.
        let (reply, early) = pump::reply_after_output(&mut stream)
            .await
            .ok_or_else(lost)?;
        match reply {
            Reply::Started { pid } => Ok(pump::pump_after(stream, pid, early)),
            r @ Reply::Exited { .. } => match crate::convert::exit_status(r.clone()) {
                Some(status) => Ok(pump::exited(token, status)),
                None => Err(guest_err(id, r)),
            },
            other => Err(guest_err(id, other)),
        }
    }

    async fn read_file(&self, id: &str, path: &str, u: RunAs) -> Result<Vec<u8>, HostError> {
        let link = self.link(id).await?;
        let lost = || HostError::LinkLost { id: id.to_owned() };
        let mut r = Read::start(&link, path, user(u)).map_err(|_| lost())?;
        let mut data = Vec::new();
        loop {
            match r.next().await {
                // The guest's word is not trusted: the size it announces is
                // checked, and so is what it sends.
                Next::Start(size) if size > MAX_READ_BYTES => return Err(too_large(id, path)),
                Next::Start(size) => data.reserve(size as usize),
                Next::Bytes(bytes) => {
                    if (data.len() + bytes.len()) as u64 > MAX_READ_BYTES {
                        return Err(too_large(id, path));
                    }
                    data.extend_from_slice(&bytes);
                    r.taken(bytes.len());
                }
                Next::Done => return Ok(data),
                Next::Reply(other) => return Err(guest_err(id, other)),
                Next::Overrun => return Err(overrun(id)),
                Next::Lost => return Err(lost()),
            }
        }
    }

    async fn read_file_stream(
        &self,
        id: &str,
        path: &str,
        u: RunAs,
    ) -> Result<FileStream, HostError> {
        let link = self.link(id).await?;
        let lost = || HostError::LinkLost { id: id.to_owned() };
        let mut r = Read::start(&link, path, user(u)).map_err(|_| lost())?;
        let size = match r.next().await {
            Next::Start(size) if size > MAX_READ_BYTES => return Err(too_large(id, path)),
            Next::Start(size) => size,
            Next::Reply(other) => return Err(guest_err(id, other)),
            Next::Lost => return Err(lost()),
            Next::Bytes(_) | Next::Done | Next::Overrun => {
                return Err(HostError::Guest {
                    id: id.to_owned(),
                    failure: GuestFailure::BadRequest,
                    message: "the guest sent a file's bytes before its size".into(),
                })
            }
        };
        // The guest's word is not trusted: what it sends is checked against
        // the size it announced. Its window is credited as the reader takes
        // the pieces (the channel is full while the reader is slow), so it
        // holds at most a window and the channel's pieces here.
        let (tx, rx) = tokio::sync::mpsc::channel(READ_PIECES);
        let id = id.to_owned();
        tokio::spawn(async move {
            let mut got = 0u64;
            loop {
                let next = match r.next().await {
                    Next::Lost => Err(HostError::LinkLost { id: id.clone() }),
                    Next::Bytes(bytes) => {
                        got += bytes.len() as u64;
                        if got > size {
                            Err(HostError::Guest {
                                id: id.clone(),
                                failure: GuestFailure::Io,
                                message: format!(
                                    "the guest sent more than the {size} bytes it announced"
                                ),
                            })
                        } else {
                            Ok(Some(bytes))
                        }
                    }
                    Next::Done if got == size => Ok(None),
                    Next::Done => Err(HostError::Guest {
                        id: id.clone(),
                        failure: GuestFailure::Io,
                        message: format!(
                            "the file changed while it was read ({got} of {size} bytes)"
                        ),
                    }),
                    Next::Overrun => Err(overrun(&id)),
                    Next::Start(_) => Err(HostError::Guest {
                        id: id.clone(),
                        failure: GuestFailure::Io,
                        message: "the guest announced a file's size twice".into(),
                    }),
                    Next::Reply(other) => Err(guest_err(&id, other)),
                };
                match next {
                    Ok(Some(bytes)) => {
                        let n = bytes.len();
                        if tx.send(Ok(bytes)).await.is_err() {
                            // The reader went away: dropping `r` ends the
                            // read in the guest.
                            return;
                        }
                        r.taken(n);
                    }
                    Ok(None) => return,
                    Err(e) => {
                        r.reset();
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                }
            }
        });
        Ok(FileStream { size, pieces: rx })
    }

    async fn write_file(
        &self,
        id: &str,
        path: &str,
        mode: Option<u32>,
        u: RunAs,
        data: Vec<u8>,
    ) -> Result<(), HostError> {
        // One piece of a stream.
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let _ = tx.send(Ok(data)).await;
        drop(tx);
        self.write_file_stream(id, path, mode, u, rx).await
    }

    async fn write_file_stream(
        &self,
        id: &str,
        path: &str,
        mode: Option<u32>,
        u: RunAs,
        mut pieces: tokio::sync::mpsc::Receiver<std::io::Result<Vec<u8>>>,
    ) -> Result<(), HostError> {
        let link = self.link(id).await?;
        let lost = || HostError::LinkLost { id: id.to_owned() };
        let mut s = link.open().map_err(|_| lost())?;
        s.send(&Request::WriteFile {
            path: path.to_owned(),
            mode,
            user: user(u),
        })
        .map_err(|_| lost())?;
        // Each piece waits for room in the link's bounded write queue, so
        // what is held here is a piece and the queue, whatever the size.
        while let Some(piece) = pieces.recv().await {
            match piece {
                Ok(bytes) => s.send_data(&bytes).await.map_err(|_| lost())?,
                Err(source) => {
                    // Nothing is placed: the agent drops its temporary file.
                    let _ = s.send(&Request::Close);
                    s.ended();
                    return Err(HostError::Io {
                        id: id.to_owned(),
                        op: "reading the bytes of a write",
                        source,
                    });
                }
            }
        }
        s.send(&Request::EndWrite).map_err(|_| lost())?;
        match s.reply().await.map_err(|_| lost())? {
            Reply::Done => Ok(()),
            other => Err(guest_err(id, other)),
        }
    }

    async fn file_op(&self, id: &str, op: FileOp, u: RunAs) -> Result<FileOpResult, HostError> {
        let link = self.link(id).await?;
        let req = file_request(op, user(u));
        let reply = link
            .call(&req)
            .await
            .map_err(|_| HostError::LinkLost { id: id.to_owned() })?;
        file_op_result(id, reply)
    }

    async fn watch(&self, id: &str, spec: WatchSpec) -> Result<WatchHandle, HostError> {
        let link = self.link(id).await?;
        if link.peer_version() < runtime_proto::WATCH_VERSION {
            return Err(HostError::Guest {
                id: id.to_owned(),
                failure: GuestFailure::Unsupported,
                message: format!(
                    "this sandbox's agent speaks protocol {}, older than watches: stop and start the sandbox (or create a new one) to watch files",
                    link.peer_version()
                ),
            });
        }
        let lost = || HostError::LinkLost { id: id.to_owned() };
        let mut stream = link.open().map_err(|_| lost())?;
        stream
            .send(&Request::Watch(watch_request(spec)))
            .map_err(|_| lost())?;
        // A large tree takes a while to walk; the guest answers once it has.
        let reply = tokio::time::timeout(Duration::from_secs(60), stream.reply())
            .await
            .map_err(|_| {
                let _ = stream.send(&Request::Unwatch);
                HostError::Timeout {
                    id: id.to_owned(),
                    what: "the start of a watch",
                }
            })?
            .map_err(|_| lost())?;
        match reply {
            Reply::Watching { watches } => Ok(pump::watch_pump(stream, watches)),
            other => Err(guest_err(id, other)),
        }
    }
}
