//! The seam between the control plane and a host.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
pub use tokio::io::DuplexStream;
use tokio::sync::mpsc;

/// The shape of a sandbox's machine, validated by the control plane.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MachineSpec {
    /// The sandbox id (a UUID); names the VM's directory and logs.
    pub id: String,
    pub vcpu: u32,
    pub memory_mib: u32,
    pub disk_mib: u32,
    pub hostname: String,
    /// The sandbox's own certificate authority (PEM, public part only): the
    /// guest trusts it for the TLS the egress proxy terminates to swap
    /// secrets. Installed at every start, wake and restore.
    pub guest_ca_pem: Option<String>,
    /// Volumes attached as extra virtio-blk drives, in this order, and
    /// mounted in the guest at a fresh boot (a wake keeps its mounts). A
    /// machine with volumes never starts from a template.
    pub volumes: Vec<VolumeDrive>,
    /// A custom image: the machine's disk is an overlay on this disk instead
    /// of the base image (a fresh boot), and its templates are its own.
    pub image: Option<ImageDisk>,
    /// Boot, and build no template for this machine's shape (a one-off
    /// machine such as an image build's).
    pub no_template: bool,
}

/// A custom image's root disk: a qcow2 whose backing chain ends at the
/// base image (every file in the chain readable by the VM's uid).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageDisk {
    /// Names the image's content in template keys (a hash, no `/`).
    pub key: String,
    pub disk: std::path::PathBuf,
}

/// A volume as the host attaches it: an ext4 file system in a raw file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeDrive {
    /// The volume's file on the host; never derived from guest input.
    pub file: std::path::PathBuf,
    /// The guest directory it is mounted on (validated by the control plane).
    pub path: String,
    /// `true`: the machine gets its own sparse copy of the file, taken at
    /// boot and removed with the machine; the volume itself is never written.
    pub snapshot: bool,
}

/// Who a command or file operation runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RunAs {
    /// uid 1000 `user`, `HOME=/workspace`.
    #[default]
    Sandbox,
    Root,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TermSize {
    pub cols: u16,
    pub rows: u16,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecSpec {
    /// Program and arguments; a shell command is `["bash", "-c", cmd]`.
    pub argv: Vec<String>,
    pub cwd: Option<String>,
    /// Applied over the guest's base environment, in order.
    pub env: Vec<(String, String)>,
    pub user: RunAs,
    /// The process group is killed after this long.
    pub timeout: Option<Duration>,
    /// Keep stdin open for [`ExecControl::Stdin`]; otherwise it is empty.
    pub stdin: bool,
    pub pty: Option<TermSize>,
    /// Kill what the command left in its process group when it exits.
    pub kill_group_on_exit: bool,
    /// Record the files it (and what it starts) opens: the exit carries
    /// them ([`ExitStatus::files`]). An agent older than that refuses the
    /// exec ([`GuestFailure::Unsupported`]).
    pub trace_files: bool,
}

/// What the control plane sends to a running process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecControl {
    Stdin(Vec<u8>),
    CloseStdin,
    Signal(i32),
    Resize(TermSize),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitStatus {
    /// `None` when killed by a signal or timed out.
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub duration_ms: u64,
    /// How many of its processes the guest's kernel killed for memory.
    pub oom_kills: u32,
    /// What it opened, when it ran with [`ExecSpec::trace_files`].
    pub files: Option<TracedFiles>,
}

/// The files a traced command opened, as the guest reported them (checked:
/// absolute paths, sorted, each list bounded).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TracedFiles {
    /// Every file and directory it opened (directories end in `/`).
    pub read: Vec<String>,
    /// Every file it opened for writing.
    pub written: Vec<String>,
    /// Some paths are missing.
    pub truncated: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExecEvent {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    /// Last event. If the channel closes without it, the link was lost.
    Exited(ExitStatus),
}

/// A started process: its guest pid, its output, its input.
#[derive(Debug)]
pub struct ExecHandle {
    pub pid: u32,
    /// Names the process to [`Host::attach`] after a restart of the server.
    pub token: u64,
    pub events: mpsc::Receiver<ExecEvent>,
    pub control: mpsc::Sender<ExecControl>,
}

/// A kind of change a watch reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChangeKind {
    Create,
    Write,
    Remove,
    Rename,
    Chmod,
}

/// What [`Host::watch`] watches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchSpec {
    pub path: String,
    pub recursive: bool,
    /// Empty: every kind.
    pub kinds: Vec<ChangeKind>,
    pub include: Vec<String>,
    pub exclude: Vec<String>,
    pub batch_ms: u32,
    pub max_watches: u32,
    pub user: RunAs,
}

/// One change a watch saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub kind: ChangeKind,
    pub path: String,
    pub old_path: Option<String>,
    pub is_dir: bool,
    /// Writes folded into this one.
    pub count: u32,
}

/// What a watch could not report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchMiss {
    /// Events dropped in the guest (0: how many is unknown).
    Overflow { dropped: u64 },
    /// A directory left unwatched: the watch has `watches` already.
    Limit { watches: u32, path: String },
}

/// What a running watch delivers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchUpdate {
    Batch {
        changes: Vec<Change>,
        misses: Vec<WatchMiss>,
    },
    /// Its last: `stopped`, `root-removed`, `failed`, or `lost` when the
    /// link to the guest went away.
    Ended { reason: String },
}

/// A running watch. Dropping `stop` (or sending on it) ends it in the guest;
/// its [`WatchUpdate::Ended`] still comes.
#[derive(Debug)]
/// A file's bytes as the guest sends them ([`Host::read_file_stream`]): its
/// size first, then the pieces in order; an error ends it early.
pub struct FileStream {
    pub size: u64,
    pub pieces: mpsc::Receiver<Result<Vec<u8>, HostError>>,
}

pub struct WatchHandle {
    /// The inotify watches it holds (directories).
    pub watches: u32,
    pub updates: mpsc::Receiver<WatchUpdate>,
    pub stop: mpsc::Sender<()>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    File,
    Directory,
    Symlink,
    Other,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileEntry {
    pub name: String,
    pub path: String,
    pub kind: EntryKind,
    pub size: u64,
    pub mode: u32,
    /// Seconds since the epoch.
    pub modified: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileOp {
    Stat {
        path: String,
    },
    List {
        path: String,
        depth: u32,
        hidden: bool,
        limit: u32,
    },
    Mkdir {
        path: String,
        parents: bool,
    },
    Remove {
        path: String,
        recursive: bool,
    },
    Rename {
        from: String,
        to: String,
        overwrite: bool,
    },
    Chmod {
        path: String,
        mode: u32,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileOpResult {
    Stat(Option<FileEntry>),
    Listing {
        entries: Vec<FileEntry>,
        truncated: bool,
    },
    Removed(bool),
    Done,
}

/// A guest-side refusal of a file operation or exec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestFailure {
    FileNotFound,
    IsADirectory,
    NotADirectory,
    PermissionDenied,
    AlreadyExists,
    DirectoryNotEmpty,
    InvalidPath,
    CommandNotFound,
    BadRequest,
    Io,
    /// Nothing listens on the guest port a connection asked for.
    ConnectionRefused,
    /// A file larger than [`Host::read_file`] takes ([`MAX_READ_BYTES`]).
    TooLarge,
    /// The guest's agent is older than what the request needs.
    Unsupported,
}

pub use runtime_proto::MAX_READ_BYTES;

/// Where a VM failed to come up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootStage {
    Artifacts,
    Disk,
    Spawn,
    Kernel,
    Agent,
    Restore,
}

impl std::fmt::Display for BootStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BootStage::Artifacts => "artifacts",
            BootStage::Disk => "disk",
            BootStage::Spawn => "spawn",
            BootStage::Kernel => "kernel",
            BootStage::Agent => "agent",
            BootStage::Restore => "restore",
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("sandbox {id} has no machine on this host")]
    NoSuchMachine { id: String },
    #[error("sandbox {id} failed to start at stage {stage}: {reason}")]
    StartFailed {
        id: String,
        stage: BootStage,
        reason: String,
        /// The last lines of the serial console.
        console_tail: String,
    },
    #[error("the agent of sandbox {id} refused: {message}")]
    Guest {
        id: String,
        failure: GuestFailure,
        message: String,
    },
    #[error("capturing the state of sandbox {id} failed: {reason}")]
    Capture { id: String, reason: String },
    #[error("sandbox {id} has no paused state on this host")]
    NotPaused { id: String },
    #[error("capture {path} cannot be used: {reason}")]
    BadCapture {
        path: std::path::PathBuf,
        reason: String,
    },
    #[error("lost the link to the agent of sandbox {id}")]
    LinkLost { id: String },
    #[error("timed out waiting for {what} of sandbox {id}")]
    Timeout { id: String, what: &'static str },
    #[error("growing the disk of sandbox {id} failed: {reason}")]
    Grow { id: String, reason: String },
    #[error("host I/O failed during {op} for sandbox {id}")]
    Io {
        id: String,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// A connection into the egress proxy ([`Host::egress_connection`]).
pub struct EgressConnection {
    pub stream: DuplexStream,
    /// The system's roots plus the operator's test roots; `None` when the
    /// host has no TLS client.
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

/// A host's free memory and space, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Room {
    /// MemTotal and MemAvailable.
    pub memory_total: u64,
    pub memory_available: u64,
    /// The guests' RAM files' file system (tmpfs, usually): size and free.
    pub ram_dir_total: u64,
    pub ram_dir_free: u64,
    /// Free space of the state directory's file system (disks, captures).
    pub disk_free: u64,
}

/// One machine's sandboxes, as the control plane drives them.
#[async_trait]
pub trait Host: Send + Sync + 'static {
    /// Boots a machine and returns once its agent answers.
    async fn start(&self, spec: &MachineSpec) -> Result<(), HostError>;
    /// A warm machine for a pool (docs/memory.md, "Warm machines"): starts
    /// `spec` only by restoring its shape's pre-booted template, never by
    /// booting. `Ok(false)` when that cannot be done now (no template yet,
    /// one is being built; templates off; a spec with volumes): nothing was
    /// started.
    async fn start_warm(&self, _spec: &MachineSpec) -> Result<bool, HostError> {
        Ok(false)
    }
    /// Gives a running warm machine (started by [`Host::start_warm`] under
    /// `spec.id`) its sandbox's identity: hostname, clock, fresh entropy
    /// with a reseed of the guest's CRNG, and the sandbox's CA, as a restore
    /// does. A crash of the server meanwhile leaves a machine that is ended,
    /// not adopted.
    async fn assume(&self, spec: &MachineSpec) -> Result<(), HostError> {
        Err(HostError::NoSuchMachine {
            id: spec.id.clone(),
        })
    }
    /// Finds a machine left running by an earlier process of the server and
    /// reattaches to it; `false` if it is gone.
    async fn recover(&self, spec: &MachineSpec) -> Result<bool, HostError>;
    /// Whether a whole paused state of `id` is kept on this host (what
    /// [`Host::wake`] starts from). After a crash mid-pause only a partial
    /// capture may be left: then the sandbox has nothing to wake from.
    fn has_paused_state(&self, id: &str) -> bool;
    /// After a restart, before anything new starts: ends every machine this
    /// host finds (running, or left on disk) whose id is not in `owned` (the
    /// sandboxes still on record), with its directory, RAM file and cgroup,
    /// so nothing runs that no record owns. Answers the ids it ended.
    async fn sweep(&self, owned: &std::collections::HashSet<String>) -> Vec<String>;
    /// Ends the machine; `keep_disk` keeps its disk (its guest's writes
    /// flushed first) for a later start or a [`Host::capture`] without memory.
    async fn stop(&self, id: &str, keep_disk: bool) -> Result<(), HostError>;
    /// Grows the running machine's disk to `disk_mib` and its root file
    /// system with it, every program left running. By default: not
    /// possible here (the caller restarts it at the new size instead).
    async fn grow_disk(&self, id: &str, _disk_mib: u32) -> Result<(), HostError> {
        Err(HostError::Grow {
            id: id.to_owned(),
            reason: "this host cannot grow a running machine's disk".into(),
        })
    }
    /// Ends the machine and removes everything it had on this host.
    async fn destroy(&self, id: &str) -> Result<(), HostError>;
    /// Stops the vCPUs, writes memory and device state beside the disk and
    /// ends QEMU: nothing runs until [`Host::wake`], which restores processes,
    /// memory and `/tmp` as they were.
    async fn pause(&self, id: &str) -> Result<(), HostError>;
    /// Starts a paused machine again from its saved state.
    async fn wake(&self, spec: &MachineSpec) -> Result<(), HostError>;
    /// Writes the machine's disk, and its memory when `memory`, into the new
    /// directory `dest`. A running machine stops for the copy and goes on; a
    /// paused one stays paused.
    async fn capture(
        &self,
        id: &str,
        dest: &std::path::Path,
        memory: bool,
    ) -> Result<(), HostError>;
    /// Where a fork's temporary capture should go (its memory is read by
    /// the copies as they start): the host's memory file system where it
    /// has one. `None`: beside the server's data.
    fn scratch_dir(&self) -> Option<std::path::PathBuf> {
        None
    }
    /// Starts a new machine from a capture: from its memory when it has one
    /// (processes and all), otherwise by booting its disk.
    async fn restore(&self, spec: &MachineSpec, from: &std::path::Path) -> Result<(), HostError>;
    async fn exec(&self, id: &str, spec: ExecSpec) -> Result<ExecHandle, HostError>;
    /// Takes up a process started by an earlier server process (after a
    /// restart) by its `token`: a handle whose events continue from now on
    /// (output written while no server listened is lost), or only its
    /// `Exited` if it ended meanwhile.
    async fn attach(&self, id: &str, token: u64) -> Result<ExecHandle, HostError>;
    async fn read_file(&self, id: &str, path: &str, user: RunAs) -> Result<Vec<u8>, HostError>;
    /// A file's bytes in pieces as the guest sends them, never collected
    /// whole: its size once the guest opened it (a file that cannot be read
    /// fails here, as [`Host::read_file`] does). By default, a whole read.
    async fn read_file_stream(
        &self,
        id: &str,
        path: &str,
        user: RunAs,
    ) -> Result<FileStream, HostError> {
        let data = self.read_file(id, path, user).await?;
        let (tx, rx) = mpsc::channel(1);
        let size = data.len() as u64;
        let _ = tx.try_send(Ok(data));
        Ok(FileStream { size, pieces: rx })
    }
    async fn write_file(
        &self,
        id: &str,
        path: &str,
        mode: Option<u32>,
        user: RunAs,
        data: Vec<u8>,
    ) -> Result<(), HostError>;
    /// Writes a file from pieces as they come, never held whole (an
    /// upload's commit streamed from the host's disk): placed atomically
    /// once `pieces` ends; an `Err` piece abandons the write (nothing is
    /// placed; [`HostError::Io`]). By default, collected and written whole.
    async fn write_file_stream(
        &self,
        id: &str,
        path: &str,
        mode: Option<u32>,
        user: RunAs,
        mut pieces: mpsc::Receiver<std::io::Result<Vec<u8>>>,
    ) -> Result<(), HostError> {
        let mut data = Vec::new();
        while let Some(piece) = pieces.recv().await {
            data.extend(piece.map_err(|source| HostError::Io {
                id: id.to_owned(),
                op: "reading the bytes of a write",
                source,
            })?);
        }
        self.write_file(id, path, mode, user, data).await
    }
    async fn file_op(&self, id: &str, op: FileOp, user: RunAs) -> Result<FileOpResult, HostError>;
    /// Watches a path in the guest: answers once the guest watches it (a
    /// missing path fails as a file operation does).
    async fn watch(&self, id: &str, spec: WatchSpec) -> Result<WatchHandle, HostError>;
    /// CPU time the machine's vCPUs have used since it started (or was last
    /// restored), for metering; `None` when it has no running machine.
    async fn cpu_time(&self, id: &str) -> Option<Duration>;
    /// Host memory the machine holds (its QEMU's resident set), for
    /// metrics; `None` when it has no running machine or cannot be read.
    async fn memory_bytes(&self, _id: &str) -> Option<u64> {
        None
    }
    /// About how many bytes a capture of the machine would take now (its
    /// disk as written, and with `memory` the memory it holds), for the
    /// snapshot quota before the capture; `None` when it cannot tell.
    fn capture_estimate(&self, _id: &str, _memory: bool) -> Option<u64> {
        None
    }
    /// What the host has free for new machines now, for admission; `None`
    /// when it cannot tell (then nothing is refused for room).
    async fn room(&self) -> Option<Room> {
        None
    }
    /// What this host's egress proxy carried for its guests since it
    /// started, for the operator's metrics; `None` when it has no proxy.
    fn egress_traffic(&self) -> Option<runtime_egress::Traffic> {
        None
    }
    /// The bytes each machine's guest sent out through the egress proxy
    /// since the last call, by machine id, each byte answered once (the
    /// server keeps them as the sandbox's outbound usage); empty without a
    /// proxy.
    fn take_egress_outbound(&self) -> Vec<(String, u64)> {
        Vec::new()
    }
    /// The last `max_bytes` of the machine's serial console (the guest
    /// kernel's messages and what its agent logs there), as text; kept
    /// until the machine is destroyed. `None` when the host keeps none.
    async fn console_tail(&self, _id: &str, _max_bytes: usize) -> Option<String> {
        None
    }
    /// Opens a TCP connection to `127.0.0.1:port` inside the guest (previews,
    /// port forwarding), carried over the agent channel with flow control.
    /// The stream ends when either side closes or the machine stops.
    async fn connect(&self, id: &str, port: u16) -> Result<DuplexStream, HostError>;
    /// Mounts a shared volume's directory in the running guest of `id` at
    /// `share.path` (docs/volumes.md, "Shared volumes"), served as 9P by a
    /// process of the volume's own uid. Kept across a pause and wake; ended
    /// by [`Host::unshare`], a stop or a destroy.
    async fn share(&self, id: &str, _share: crate::ShareSpec) -> Result<(), HostError> {
        Err(HostError::Guest {
            id: id.to_owned(),
            failure: GuestFailure::Io,
            message: "this host does not share volumes".into(),
        })
    }
    /// Unmounts a share in the guest (lazily if busy) and ends its server.
    /// Ok when there is no such share (any more).
    async fn unshare(&self, _id: &str, _share_id: &str) -> Result<(), HostError> {
        Ok(())
    }
    /// What the host's egress proxy applies to the connections the guest of
    /// `id` opens through the agent's proxy (`127.0.0.1:10800` in the
    /// guest): set before its machine starts, and again on each change,
    /// which open connections follow at once. Until it is set, the guest's
    /// connections are closed.
    fn set_network(&self, id: &str, net: GuestNet);
    /// A connection to this host's egress proxy as if network `id`'s guest
    /// had opened it (its rules, the test mapping, byte counting apply), for
    /// work the host does on the guest's behalf, such as pulling a registry
    /// image for a build ([`crate::oci`]). The stream speaks the proxy's
    /// protocols (`CONNECT`, absolute-URI requests); `tls` verifies the far
    /// end of a `CONNECT` as the proxy itself would.
    fn egress_connection(&self, id: &str) -> Result<EgressConnection, HostError> {
        Err(HostError::NoSuchMachine { id: id.to_owned() })
    }
    /// Forgets `id`'s network: its open connections end, new ones close.
    fn forget_network(&self, id: &str);
    /// Serves `http://runtime.internal` to this host's guests with `api`
    /// (the server's own API, in its process), under each sandbox's rules;
    /// `None` stops it. A host without guests ignores it.
    fn serve_api(&self, _api: Option<Arc<dyn runtime_egress::InternalApi>>) {}
}

/// What a guest finds in `/run/runtime/environment.json` (written by its
/// agent at every boot, wake, restore and warm-machine take) and what
/// `GET http://runtime.internal/v1/environment` answers it: facts about the
/// sandbox, nothing secret. The official client takes the file's presence
/// as "in a sandbox" and sends its calls to `runtime.internal`.
pub fn guest_environment(sandbox_id: &str) -> serde_json::Value {
    serde_json::json!({
        "RUNTIME_SANDBOX_ID": sandbox_id,
        "RUNTIME_API_URL": format!("http://{}", runtime_egress::API_HOST),
    })
}

/// One sandbox's network as its host's egress proxy applies it
/// ([`Host::set_network`]).
#[derive(Debug, Clone)]
pub struct GuestNet {
    /// What may be reached.
    pub policy: runtime_egress::Policy,
    /// The secrets the proxy puts into the requests to their hosts.
    pub secrets: Vec<runtime_egress::Secret>,
    /// Signs the certificates shown for those hosts; the guest trusts it
    /// ([`MachineSpec::guest_ca_pem`]).
    pub ca: Arc<runtime_egress::SandboxCa>,
}

/// Receives each outbound connection of a guest, once the host's tunnel
/// has it: the host's egress proxy, or a stand-in in the tunnel's tests
/// ([`QemuHost::with_outbound`](crate::QemuHost::with_outbound)).
pub trait Outbound: Send + Sync + 'static {
    /// Called once per connection, for the sandbox `sandbox_id`; must not
    /// block (spawn the work).
    fn accept(&self, sandbox_id: &str, conn: DuplexStream);
}

/// TEST ONLY (`runtime serve --test-crash-at POINT`): when `at` names
/// `point`, the whole server dies here at once by SIGKILL, so the crash
/// tests stop it at an exact step of a capture, a pause, a wake, a delete,
/// a create, a build or a volume's attach instead of racing a timer. Never set in production.
pub fn crash_point(at: Option<&str>, point: &str) {
    if at != Some(point) {
        return;
    }
    tracing::warn!(point, "test crash point reached: the server kills itself");
    // SAFETY: kill(2) on our own pid has no memory preconditions.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    std::process::abort();
}
