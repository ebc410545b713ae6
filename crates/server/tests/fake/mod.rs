//! A fake Host for the server's tests only: in-memory files, scripted exec.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use runtime_host::{
    DuplexStream, EntryKind, ExecControl, ExecEvent, ExecHandle, ExecSpec, ExitStatus, FileEntry,
    FileOp, FileOpResult, GuestFailure, GuestNet, Host, HostError, MachineSpec, Room, RunAs,
    TracedFiles, WatchHandle, WatchSpec, WatchUpdate,
};
use tokio::sync::{mpsc, watch};

#[derive(Debug, Clone)]
pub(crate) enum Step {
    Out(Vec<u8>),
    Err(Vec<u8>),
    Sleep(u64),
    Exit(i32),
}

/// Where a process's events go: the handle listening now, or, after a
/// pause closed its handle, a backlog the next `attach` delivers first (the
/// real host keeps streams across a pause).
#[derive(Default)]
pub(crate) struct Sink {
    pub tx: Option<mpsc::Sender<ExecEvent>>,
    pub held: Option<Vec<ExecEvent>>,
}

/// A process the fake runs, by token: its sandbox, where its events go now
/// (a later server takes it up with `attach`), and how it ended.
#[derive(Clone)]
pub(crate) struct FakeProc {
    pub sandbox: String,
    pub events: Arc<Mutex<Sink>>,
    pub control: mpsc::Sender<ExecControl>,
    pub exited: Arc<Mutex<Option<ExitStatus>>>,
}

/// Sends an event to whoever listens now; held when a pause detached the
/// process; without a listener otherwise it is lost, as a real guest's
/// output is while no server listens.
async fn emit(to: &Arc<Mutex<Sink>>, ev: ExecEvent) {
    let tx = {
        let mut s = to.lock().unwrap();
        if let Some(held) = &mut s.held {
            held.push(ev);
            return;
        }
        s.tx.clone()
    };
    if let Some(tx) = tx {
        if tx.send(ev).await.is_err() {
            to.lock().unwrap().tx.take();
        }
    }
}

#[derive(Default)]
pub(crate) struct FakeHost {
    /// (sandbox, path) -> (bytes, mode); directories are in `dirs`.
    pub files: Mutex<HashMap<(String, String), (Vec<u8>, u32)>>,
    pub dirs: Mutex<HashSet<(String, String)>>,
    /// Keyed by the command (last argv element).
    pub scripts: Mutex<HashMap<String, Vec<Step>>>,
    pub start_delay_ms: Mutex<u64>,
    /// How long each capture takes.
    pub capture_delay_ms: Mutex<u64>,
    pub recoverable: Mutex<HashSet<String>>,
    pub started: Mutex<Vec<String>>,
    pub stopped: Mutex<Vec<(String, bool)>>,
    pub destroyed: Mutex<Vec<String>>,
    /// Everything `cat` received on stdin, per process.
    pub stdin_seen: Arc<Mutex<Vec<u8>>>,
    pub last_exec: Mutex<Option<ExecSpec>>,
    pub paused: Mutex<Vec<String>>,
    /// Sandboxes whose paused state is kept (a pause adds, a wake takes).
    pub saved: Mutex<HashSet<String>>,
    /// Machines the fake has on "disk" after a restart, for the sweep; the
    /// ids it ended are in `swept`.
    pub machines: Mutex<HashSet<String>>,
    pub swept: Mutex<Vec<String>>,
    pub woken: Mutex<Vec<String>>,
    pub wake_delay_ms: Mutex<u64>,
    /// (source, dest, memory) per capture.
    pub captures: Mutex<Vec<(String, std::path::PathBuf, bool)>>,
    /// (new sandbox, capture dir) per restore.
    pub restored: Mutex<Vec<(String, std::path::PathBuf)>>,
    /// Every process started, by token; remove one to make `attach` fail.
    pub procs: Mutex<HashMap<u64, FakeProc>>,
    /// The processes copies took up: their channels, kept open.
    #[allow(clippy::type_complexity)]
    pub copied: Mutex<Vec<(mpsc::Sender<ExecEvent>, mpsc::Receiver<ExecControl>)>>,
    pub next_token: Mutex<u64>,
    /// Per sandbox: `true` while paused (scripts wait between steps).
    pub gates: Mutex<HashMap<String, watch::Sender<bool>>>,
    /// The guest's loopback: guest port -> a TCP address on the host that
    /// stands for it ([`Host::connect`]).
    pub guest_ports: Mutex<HashMap<u16, std::net::SocketAddr>>,
    /// The network each sandbox has now ([`Host::set_network`]), and every
    /// id whose network was forgotten, in order.
    pub networks: Mutex<HashMap<String, GuestNet>>,
    pub forgotten: Mutex<Vec<String>>,
    /// The vCPU time `cpu_time` reports per sandbox (none: unknown).
    pub cpu: Mutex<HashMap<String, Duration>>,
    /// Outbound bytes per sandbox not yet taken by
    /// [`Host::take_egress_outbound`]; tests add to it.
    pub outbound: Mutex<HashMap<String, u64>>,
    /// Every spec `start` was given, in order.
    pub specs: Mutex<Vec<MachineSpec>>,
    /// Interpreter drivers the fake plays, by their last argv element
    /// (`python`): each run's output is its code.
    pub drivers: Mutex<HashSet<String>>,
    /// Running watches: (sandbox, root, updates). A written file under a
    /// root is reported to it as created.
    pub watches: Arc<Mutex<Vec<(String, String, mpsc::Sender<WatchUpdate>)>>>,
    /// What [`Host::room`] answers (none: the host cannot tell).
    pub room: Mutex<Option<Room>>,
    /// What [`Host::capture_estimate`] answers (none: it cannot tell).
    pub capture_bytes: Mutex<Option<u64>>,
    /// Warm machines started ([`Host::start_warm`]), by id.
    pub warm: Mutex<Vec<String>>,
    /// Every spec [`Host::assume`] was given, in order.
    pub assumed: Mutex<Vec<MachineSpec>>,
    /// `assume` fails (the warm machine cannot take on its sandbox).
    pub assume_fails: Mutex<bool>,
    /// The guest's agent predates traced files: a traced exec is refused.
    pub old_agent: Mutex<bool>,
    /// Shares served: (sandbox, share spec) in order; `unshared` the
    /// (sandbox, share id) of each unshare; `share_fails` refuses them.
    pub shared: Mutex<Vec<(String, runtime_host::ShareSpec)>>,
    pub unshared: Mutex<Vec<(String, String)>>,
    pub share_fails: Mutex<bool>,
}

impl FakeHost {
    /// The network `id` has now, if any.
    #[allow(dead_code)]
    pub(crate) fn network(&self, id: &str) -> Option<GuestNet> {
        self.networks.lock().unwrap().get(id).cloned()
    }
}

fn guest(id: &str, failure: GuestFailure, message: &str) -> HostError {
    HostError::Guest {
        id: id.into(),
        failure,
        message: message.into(),
    }
}

fn parent(p: &str) -> String {
    match p.rfind('/') {
        Some(0) | None => "/".into(),
        Some(i) => p[..i].into(),
    }
}

impl FakeHost {
    fn gate(&self, id: &str) -> watch::Receiver<bool> {
        self.gates
            .lock()
            .unwrap()
            .entry(id.to_string())
            .or_insert_with(|| watch::channel(false).0)
            .subscribe()
    }

    fn set_paused(&self, id: &str, paused: bool) {
        let _ = self.gate(id);
        if let Some(g) = self.gates.lock().unwrap().get(id) {
            g.send_replace(paused);
        }
    }

    pub(crate) fn script(&self, command: &str, steps: Vec<Step>) {
        self.scripts.lock().unwrap().insert(command.into(), steps);
    }

    fn entry(&self, id: &str, path: &str) -> Option<FileEntry> {
        let name = path.rsplit('/').next().unwrap_or("").to_string();
        if self
            .dirs
            .lock()
            .unwrap()
            .contains(&(id.into(), path.into()))
        {
            return Some(FileEntry {
                name,
                path: path.into(),
                kind: EntryKind::Directory,
                size: 4096,
                mode: 0o755,
                modified: 1_700_000_000,
            });
        }
        self.files
            .lock()
            .unwrap()
            .get(&(id.into(), path.into()))
            .map(|(d, m)| FileEntry {
                name,
                path: path.into(),
                kind: EntryKind::File,
                size: d.len() as u64,
                mode: *m,
                modified: 1_700_000_000,
            })
    }
}

#[async_trait]
impl Host for FakeHost {
    fn take_egress_outbound(&self) -> Vec<(String, u64)> {
        std::mem::take(&mut *self.outbound.lock().unwrap())
            .into_iter()
            .collect()
    }

    async fn start(&self, spec: &MachineSpec) -> Result<(), HostError> {
        let delay = *self.start_delay_ms.lock().unwrap();
        tokio::time::sleep(Duration::from_millis(delay)).await;
        if spec.memory_mib == 128 {
            return Err(HostError::StartFailed {
                id: spec.id.clone(),
                stage: runtime_host::BootStage::Kernel,
                reason: "too little memory".into(),
                console_tail: "panic".into(),
            });
        }
        self.started.lock().unwrap().push(spec.id.clone());
        self.specs.lock().unwrap().push(spec.clone());
        for d in ["/", "/workspace"] {
            self.dirs
                .lock()
                .unwrap()
                .insert((spec.id.clone(), d.into()));
        }
        Ok(())
    }

    async fn start_warm(&self, spec: &MachineSpec) -> Result<bool, HostError> {
        self.warm.lock().unwrap().push(spec.id.clone());
        Ok(true)
    }

    async fn assume(&self, spec: &MachineSpec) -> Result<(), HostError> {
        let known = self.warm.lock().unwrap().contains(&spec.id);
        if !known || *self.assume_fails.lock().unwrap() {
            return Err(HostError::NoSuchMachine {
                id: spec.id.clone(),
            });
        }
        self.assumed.lock().unwrap().push(spec.clone());
        for d in ["/", "/workspace"] {
            self.dirs
                .lock()
                .unwrap()
                .insert((spec.id.clone(), d.into()));
        }
        Ok(())
    }

    async fn recover(&self, spec: &MachineSpec) -> Result<bool, HostError> {
        Ok(self.recoverable.lock().unwrap().contains(&spec.id))
    }

    fn has_paused_state(&self, id: &str) -> bool {
        self.saved.lock().unwrap().contains(id)
    }

    async fn sweep(&self, owned: &HashSet<String>) -> Vec<String> {
        let mut machines = self.machines.lock().unwrap();
        let ended: Vec<String> = machines.difference(owned).cloned().collect();
        machines.retain(|m| owned.contains(m));
        self.swept.lock().unwrap().extend(ended.iter().cloned());
        ended
    }

    async fn stop(&self, id: &str, keep_disk: bool) -> Result<(), HostError> {
        self.stopped.lock().unwrap().push((id.into(), keep_disk));
        Ok(())
    }

    async fn destroy(&self, id: &str) -> Result<(), HostError> {
        self.destroyed.lock().unwrap().push(id.into());
        Ok(())
    }

    /// Scripts stop between steps; every handle closes after what it
    /// still carries, and later events are held for the next `attach`.
    async fn cpu_time(&self, id: &str) -> Option<Duration> {
        self.cpu.lock().unwrap().get(id).copied()
    }

    async fn room(&self) -> Option<Room> {
        *self.room.lock().unwrap()
    }

    fn capture_estimate(&self, _id: &str, _memory: bool) -> Option<u64> {
        *self.capture_bytes.lock().unwrap()
    }

    async fn share(&self, id: &str, spec: runtime_host::ShareSpec) -> Result<(), HostError> {
        if *self.share_fails.lock().unwrap() {
            return Err(guest(id, GuestFailure::Io, "mount failed"));
        }
        self.shared.lock().unwrap().push((id.to_string(), spec));
        Ok(())
    }

    async fn unshare(&self, id: &str, share_id: &str) -> Result<(), HostError> {
        self.unshared
            .lock()
            .unwrap()
            .push((id.to_string(), share_id.to_string()));
        Ok(())
    }

    async fn connect(&self, id: &str, port: u16) -> Result<DuplexStream, HostError> {
        let addr = self.guest_ports.lock().unwrap().get(&port).copied();
        let Some(addr) = addr else {
            return Err(guest(
                id,
                GuestFailure::ConnectionRefused,
                "connection refused",
            ));
        };
        let mut tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|_| guest(id, GuestFailure::ConnectionRefused, "connection refused"))?;
        let (ours, mut theirs) = tokio::io::duplex(64 << 10);
        tokio::spawn(async move {
            let _ = tokio::io::copy_bidirectional(&mut tcp, &mut theirs).await;
        });
        Ok(ours)
    }

    fn set_network(&self, id: &str, net: GuestNet) {
        self.networks.lock().unwrap().insert(id.into(), net);
    }

    fn forget_network(&self, id: &str) {
        self.networks.lock().unwrap().remove(id);
        self.forgotten.lock().unwrap().push(id.into());
    }

    async fn pause(&self, id: &str) -> Result<(), HostError> {
        self.set_paused(id, true);
        for p in self.procs.lock().unwrap().values() {
            if p.sandbox == id {
                let mut s = p.events.lock().unwrap();
                s.tx = None;
                s.held.get_or_insert_with(Vec::new);
            }
        }
        self.paused.lock().unwrap().push(id.into());
        self.saved.lock().unwrap().insert(id.into());
        Ok(())
    }

    async fn wake(&self, spec: &MachineSpec) -> Result<(), HostError> {
        let delay = *self.wake_delay_ms.lock().unwrap();
        tokio::time::sleep(Duration::from_millis(delay)).await;
        self.woken.lock().unwrap().push(spec.id.clone());
        self.saved.lock().unwrap().remove(&spec.id);
        self.set_paused(&spec.id, false);
        Ok(())
    }

    /// Writes the capture files, plus `source` naming the sandbox whose
    /// files a restore copies.
    async fn capture(
        &self,
        id: &str,
        dest: &std::path::Path,
        memory: bool,
    ) -> Result<(), HostError> {
        let delay = *self.capture_delay_ms.lock().unwrap();
        tokio::time::sleep(Duration::from_millis(delay)).await;
        std::fs::create_dir_all(dest).unwrap();
        // A real (empty) qcow2 where qemu-img is there, so that a build
        // may copy a layer out of it (COPY --from).
        let disk = dest.join("disk.qcow2");
        let made = std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&disk)
            .arg("1M")
            .status()
            .is_ok_and(|s| s.success());
        if !made {
            std::fs::write(&disk, b"disk").unwrap();
        }
        if memory {
            std::fs::write(dest.join("memory.state"), b"memory").unwrap();
        }
        std::fs::write(dest.join("source"), id).unwrap();
        self.captures
            .lock()
            .unwrap()
            .push((id.into(), dest.to_path_buf(), memory));
        Ok(())
    }

    async fn restore(&self, spec: &MachineSpec, from: &std::path::Path) -> Result<(), HostError> {
        let source =
            std::fs::read_to_string(from.join("source")).map_err(|_| HostError::BadCapture {
                path: from.to_path_buf(),
                reason: "no capture".into(),
            })?;
        let mut files = self.files.lock().unwrap();
        let copied: Vec<_> = files
            .iter()
            .filter(|((sid, _), _)| *sid == source)
            .map(|((_, p), v)| ((spec.id.clone(), p.clone()), v.clone()))
            .collect();
        files.extend(copied);
        self.specs.lock().unwrap().push(spec.clone());
        self.restored
            .lock()
            .unwrap()
            .push((spec.id.clone(), from.to_path_buf()));
        Ok(())
    }

    async fn exec(&self, _id: &str, spec: ExecSpec) -> Result<ExecHandle, HostError> {
        *self.last_exec.lock().unwrap() = Some(spec.clone());
        if spec.trace_files && *self.old_agent.lock().unwrap() {
            return Err(guest(
                _id,
                GuestFailure::Unsupported,
                "this sandbox's agent is older than traced files",
            ));
        }
        let traced = spec.trace_files;
        let (etx, erx) = mpsc::channel(16);
        let (ctx, mut crx) = mpsc::channel::<ExecControl>(16);
        let cmd = spec.argv.last().cloned().unwrap_or_default();
        let token = {
            let mut n = self.next_token.lock().unwrap();
            *n += 1;
            *n
        };
        let sink = Arc::new(Mutex::new(Sink {
            tx: Some(etx),
            held: None,
        }));
        let exited = Arc::new(Mutex::new(None));
        let mut gate = self.gate(_id);
        self.procs.lock().unwrap().insert(
            token,
            FakeProc {
                sandbox: _id.to_string(),
                events: sink.clone(),
                control: ctx.clone(),
                exited: exited.clone(),
            },
        );
        if cmd == "slowfail" {
            tokio::time::sleep(Duration::from_millis(300)).await;
            return Err(guest(
                _id,
                GuestFailure::CommandNotFound,
                "slowfail: not found",
            ));
        }
        if self.drivers.lock().unwrap().contains(&cmd) {
            tokio::spawn(async move {
                // The first line is the nonce; then one run per line.
                let mut nonce = None::<String>;
                while let Some(c) = crx.recv().await {
                    let ExecControl::Stdin(b) = c else { continue };
                    let line = String::from_utf8_lossy(&b).trim_end().to_string();
                    let Some(n) = nonce.clone() else {
                        let ready = format!("{line} {{\"k\":\"ready\"}}\n");
                        emit(&sink, ExecEvent::Stdout(ready.into_bytes())).await;
                        nonce = Some(line);
                        continue;
                    };
                    let run: serde_json::Value = serde_json::from_str(&line).unwrap_or_default();
                    let out = serde_json::json!({"k": "stdout", "text": run["code"]});
                    let end = serde_json::json!({"k": "end", "id": run["id"]});
                    let said = format!("{n} {out}\n{n} {end}\n");
                    emit(&sink, ExecEvent::Stdout(said.into_bytes())).await;
                }
            });
        } else if cmd == "cat" {
            let seen = self.stdin_seen.clone();
            tokio::spawn(async move {
                while let Some(c) = crx.recv().await {
                    match c {
                        ExecControl::Stdin(b) => {
                            seen.lock().unwrap().extend_from_slice(&b);
                            emit(&sink, ExecEvent::Stdout(b)).await;
                        }
                        ExecControl::CloseStdin | ExecControl::Signal(_) => break,
                        ExecControl::Resize(_) => {}
                    }
                }
                *exited.lock().unwrap() = Some(exit(Some(0)));
                emit(&sink, ExecEvent::Exited(exit(Some(0)))).await;
            });
        } else {
            let scripts = self.scripts.lock().unwrap().clone();
            // A script ending in `*` stands for every command it starts.
            let steps = scripts
                .get(&cmd)
                .or_else(|| {
                    scripts.iter().find_map(|(k, v)| {
                        k.strip_suffix('*')
                            .filter(|p| cmd.starts_with(p))
                            .map(|_| v)
                    })
                })
                .cloned()
                .unwrap_or(vec![
                    Step::Err(format!("bash: {cmd}: command not found\n").into_bytes()),
                    Step::Exit(127),
                ]);
            tokio::spawn(async move {
                let _keep = &mut crx;
                for s in steps {
                    let _ = gate.wait_for(|paused| !*paused).await;
                    let ev = match s {
                        Step::Out(b) => ExecEvent::Stdout(b),
                        Step::Err(b) => ExecEvent::Stderr(b),
                        Step::Sleep(ms) => {
                            tokio::time::sleep(Duration::from_millis(ms)).await;
                            continue;
                        }
                        Step::Exit(c) => {
                            // A traced command "opened" what its name says.
                            let status = ExitStatus {
                                files: traced.then(|| TracedFiles {
                                    read: vec!["/etc/".into(), format!("/usr/bin/{cmd}")],
                                    written: vec![format!("/workspace/{cmd}.out")],
                                    truncated: false,
                                }),
                                ..exit(Some(c))
                            };
                            *exited.lock().unwrap() = Some(status.clone());
                            ExecEvent::Exited(status)
                        }
                    };
                    emit(&sink, ev).await;
                }
            });
        }
        Ok(ExecHandle {
            pid: 42,
            token,
            events: erx,
            control: ctx,
        })
    }

    async fn attach(&self, id: &str, token: u64) -> Result<ExecHandle, HostError> {
        let p = self
            .procs
            .lock()
            .unwrap()
            .get(&token)
            .cloned()
            .ok_or_else(|| guest(id, GuestFailure::BadRequest, "no such process"))?;
        let (etx, erx) = mpsc::channel(1024);
        if p.sandbox != id {
            // A copy restored from its source's memory: the same process,
            // its own from now on (it runs on, silent, until the copy goes).
            let (ctx, crx) = mpsc::channel(16);
            self.copied.lock().unwrap().push((etx, crx));
            return Ok(ExecHandle {
                pid: 42,
                token,
                events: erx,
                control: ctx,
            });
        }
        let mut sink = p.events.lock().unwrap();
        if let Some(held) = sink.held.take() {
            // After a pause: what came meanwhile, then on as before.
            for ev in held {
                let _ = etx.try_send(ev);
            }
            if p.exited.lock().unwrap().is_none() {
                sink.tx = Some(etx);
            }
        } else {
            let ended = p.exited.lock().unwrap().clone();
            match ended {
                Some(status) => {
                    let _ = etx.try_send(ExecEvent::Exited(status));
                }
                None => sink.tx = Some(etx),
            }
        }
        drop(sink);
        Ok(ExecHandle {
            pid: 42,
            token,
            events: erx,
            control: p.control,
        })
    }

    async fn read_file(&self, id: &str, path: &str, _user: RunAs) -> Result<Vec<u8>, HostError> {
        if path.starts_with("/root") {
            return Err(guest(
                id,
                GuestFailure::PermissionDenied,
                "permission denied",
            ));
        }
        if self
            .dirs
            .lock()
            .unwrap()
            .contains(&(id.into(), path.into()))
        {
            return Err(guest(id, GuestFailure::IsADirectory, "is a directory"));
        }
        self.files
            .lock()
            .unwrap()
            .get(&(id.into(), path.into()))
            .map(|(d, _)| d.clone())
            .ok_or_else(|| guest(id, GuestFailure::FileNotFound, "no such file"))
    }

    async fn write_file(
        &self,
        id: &str,
        path: &str,
        mode: Option<u32>,
        _user: RunAs,
        data: Vec<u8>,
    ) -> Result<(), HostError> {
        self.files
            .lock()
            .unwrap()
            .insert((id.into(), path.into()), (data, mode.unwrap_or(0o644)));
        let to: Vec<_> = self
            .watches
            .lock()
            .unwrap()
            .iter()
            .filter(|(s, root, _)| s == id && path.starts_with(&format!("{root}/")))
            .map(|(_, _, tx)| tx.clone())
            .collect();
        for tx in to {
            let change = runtime_host::Change {
                kind: runtime_host::ChangeKind::Create,
                path: path.into(),
                old_path: None,
                is_dir: false,
                count: 1,
            };
            let _ = tx
                .send(WatchUpdate::Batch {
                    changes: vec![change],
                    misses: vec![],
                })
                .await;
        }
        Ok(())
    }

    async fn watch(&self, id: &str, spec: WatchSpec) -> Result<WatchHandle, HostError> {
        if self.entry(id, &spec.path).is_none() {
            return Err(guest(
                id,
                GuestFailure::FileNotFound,
                &format!("watch {}: No such file or directory", spec.path),
            ));
        }
        let (tx, rx) = mpsc::channel(16);
        let (stop_tx, mut stop_rx) = mpsc::channel::<()>(1);
        let root = spec.path.trim_end_matches('/').to_string();
        self.watches
            .lock()
            .unwrap()
            .push((id.into(), root.clone(), tx.clone()));
        let all = Arc::clone(&self.watches);
        let sandbox = id.to_string();
        tokio::spawn(async move {
            let _ = stop_rx.recv().await;
            all.lock()
                .unwrap()
                .retain(|(s, r, _)| !(s == &sandbox && r == &root));
            let _ = tx
                .send(WatchUpdate::Ended {
                    reason: "stopped".into(),
                })
                .await;
        });
        Ok(WatchHandle {
            watches: 1,
            updates: rx,
            stop: stop_tx,
        })
    }

    async fn file_op(&self, id: &str, op: FileOp, _user: RunAs) -> Result<FileOpResult, HostError> {
        match op {
            FileOp::Stat { path } => Ok(FileOpResult::Stat(self.entry(id, &path))),
            FileOp::List { path, .. } => {
                let mut out = BTreeMap::new();
                let prefix = format!("{}/", path.trim_end_matches('/'));
                for (sid, p) in self.files.lock().unwrap().keys() {
                    if sid == id && p.starts_with(&prefix) {
                        out.insert(p.clone(), ());
                    }
                }
                let entries = out.keys().filter_map(|p| self.entry(id, p)).collect();
                Ok(FileOpResult::Listing {
                    entries,
                    truncated: false,
                })
            }
            FileOp::Mkdir { path, parents } => {
                if self.entry(id, &path).is_some() && !parents {
                    return Err(guest(id, GuestFailure::AlreadyExists, "exists"));
                }
                if !parents && self.entry(id, &parent(&path)).is_none() {
                    return Err(guest(id, GuestFailure::FileNotFound, "no parent"));
                }
                self.dirs.lock().unwrap().insert((id.into(), path));
                Ok(FileOpResult::Done)
            }
            FileOp::Remove { path, .. } => {
                let f = self
                    .files
                    .lock()
                    .unwrap()
                    .remove(&(id.into(), path.clone()))
                    .is_some();
                let d = self.dirs.lock().unwrap().remove(&(id.into(), path));
                Ok(FileOpResult::Removed(f || d))
            }
            FileOp::Rename {
                from,
                to,
                overwrite,
            } => {
                let mut files = self.files.lock().unwrap();
                if files.contains_key(&(id.into(), to.clone())) && !overwrite {
                    return Err(guest(id, GuestFailure::AlreadyExists, "exists"));
                }
                let v = files
                    .remove(&(id.into(), from))
                    .ok_or_else(|| guest(id, GuestFailure::FileNotFound, "no such file"))?;
                files.insert((id.into(), to), v);
                Ok(FileOpResult::Done)
            }
            FileOp::Chmod { path, mode } => {
                let mut files = self.files.lock().unwrap();
                let f = files
                    .get_mut(&(id.into(), path))
                    .ok_or_else(|| guest(id, GuestFailure::FileNotFound, "no such file"))?;
                f.1 = mode;
                Ok(FileOpResult::Done)
            }
        }
    }
}

fn exit(code: Option<i32>) -> ExitStatus {
    ExitStatus {
        code,
        signal: None,
        timed_out: false,
        duration_ms: 5,
        oom_kills: 0,
        files: None,
    }
}
