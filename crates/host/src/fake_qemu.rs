//! For unit tests: a [`QemuHost`] whose QEMU is a script (it writes its pid
//! file, may create its sockets as plain files nothing answers on, and
//! waits; its command line names its machine's directory as QEMU's does),
//! machines left "running" by hand as an earlier server would leave them,
//! and a fake QMP server.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::artifacts::Artifacts;
use crate::cgroup;
use crate::machine::{QemuConfig, QemuHost};
use crate::qemu::{Accel, VmPaths};
use crate::types::MachineSpec;

/// What the fake QEMU does once spawned (it ignores its arguments).
const SCRIPT: &str = r#"#!/bin/bash
# A fake qemu-system for the host's unit tests: bash builtins only, so it
# is one process (as QEMU is) and nothing else lands in its cgroup.
here=${0%/*}
echo $$ > qemu.pid
if [ -e "$here/exit" ]; then exit 1; fi
if [ -e "$here/sockets" ]; then : > agent.sock; : > qmp.sock; fi
read -t 300 <> "$here/fifo"
"#;

/// How the fake QEMU behaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fake {
    /// Creates its agent and QMP sockets as plain files: they are there,
    /// but a connect to them fails.
    Sockets,
    /// Opens nothing and waits.
    Silent,
    /// Exits at once.
    Exits,
}

pub(crate) struct FakeHost {
    pub(crate) host: QemuHost,
    root: PathBuf,
    pub(crate) state: PathBuf,
    name: String,
}

impl FakeHost {
    pub(crate) fn new(name: &str) -> FakeHost {
        FakeHost::with(name, false)
    }

    /// With templates on.
    pub(crate) fn with(name: &str, templates: bool) -> FakeHost {
        let name = format!("{name}-{}", std::process::id());
        let root = std::env::temp_dir().join(format!("rt-host-fake-{name}"));
        let _ = std::fs::remove_dir_all(&root);
        for dir in [root.clone(), root.join("idle")] {
            std::fs::create_dir_all(&dir).unwrap();
            let script = dir.join("fake-qemu-system-x86_64");
            std::fs::write(&script, SCRIPT).unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
            let st = Command::new("mkfifo")
                .arg(dir.join("fifo"))
                .status()
                .unwrap();
            assert!(st.success());
        }
        let base = root.join("base.qcow2");
        let out = Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&base)
            .arg("64M")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        for f in ["kernel", "initrd"] {
            std::fs::write(root.join(f), b"").unwrap();
        }
        let state = root.join("vms");
        FakeHost {
            host: FakeHost::host_on(&root, &state, &name, templates),
            root,
            state,
            name,
        }
    }

    fn host_on(root: &Path, state: &Path, name: &str, templates: bool) -> QemuHost {
        QemuHost::new(QemuConfig {
            state_dir: state.to_owned(),
            images_dir: state.join("images"),
            qemu_binary: root.join("fake-qemu-system-x86_64"),
            artifacts: Artifacts {
                kernel: root.join("kernel"),
                base: root.join("base.qcow2"),
                initrd: root.join("initrd"),
                key: format!("fake{}", name.replace('-', "")),
            },
            accel: Accel::Tcg,
            boot_timeout: Duration::from_secs(5),
            templates,
            share_template_memory: false,
            egress: Default::default(),
            test_crash_at: None,
        })
        .unwrap()
    }

    /// Another host on the same state directory, as after a restart of the
    /// server.
    pub(crate) fn restart(&self) -> QemuHost {
        FakeHost::host_on(&self.root, &self.state, &self.name, false)
    }

    /// From now on, the fake QEMU behaves so.
    pub(crate) fn set(&self, fake: Fake) {
        for (flag, on) in [
            ("sockets", fake == Fake::Sockets),
            ("exit", fake == Fake::Exits),
        ] {
            let f = self.root.join(flag);
            if on {
                std::fs::write(f, b"").unwrap();
            } else {
                let _ = std::fs::remove_file(f);
            }
        }
    }

    /// A machine id of this test (cgroups are shared by the whole host).
    pub(crate) fn id(&self, machine: &str) -> String {
        format!("{machine}-{}", self.name)
    }

    pub(crate) fn spec(&self, id: &str) -> MachineSpec {
        MachineSpec {
            id: id.to_owned(),
            vcpu: 1,
            memory_mib: 64,
            disk_mib: 64,
            hostname: "fake".into(),
            ..MachineSpec::default()
        }
    }

    pub(crate) fn paths(&self, id: &str) -> VmPaths {
        VmPaths::new(self.state.join(id))
    }

    /// A QEMU of machine `id` started by hand, as an earlier server would
    /// have left it (its directory, its pid file; no sockets), placed in
    /// its cgroup: its pid.
    pub(crate) fn leave_qemu(&self, id: &str) -> u32 {
        let dir = self.state.join(id);
        std::fs::create_dir_all(&dir).unwrap();
        let _ = std::fs::remove_file(dir.join("qemu.pid"));
        let child = Command::new(self.root.join("idle/fake-qemu-system-x86_64"))
            .arg("-chardev")
            .arg(format!(
                "socket,id=agent,path={}",
                dir.join("agent.sock").display()
            ))
            .current_dir(&dir)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let pid = child.id();
        std::thread::spawn(move || {
            let mut child = child;
            let _ = child.wait();
        });
        for _ in 0..500 {
            if std::fs::read_to_string(dir.join("qemu.pid"))
                .is_ok_and(|p| p.trim() == pid.to_string())
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            crate::qemu::is_our_qemu(pid, &dir),
            "the fake passes for the machine's QEMU"
        );
        let limits = cgroup::Limits {
            memory_mib: 64,
            vcpu: 1,
        };
        cgroup::place(self.host.cgroups, id, pid, &limits).unwrap();
        pid
    }

    /// Whether machine `id` has a cgroup directory left.
    pub(crate) fn has_cgroup(&self, id: &str) -> bool {
        cgroup::dirs(self.host.cgroups, id)
            .iter()
            .any(|d| d.exists())
    }

    /// The pid in machine `id`'s pid file.
    pub(crate) fn pid_of(&self, id: &str) -> u32 {
        std::fs::read_to_string(self.state.join(id).join("qemu.pid"))
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    }
}

impl Drop for FakeHost {
    fn drop(&mut self) {
        if let Ok(dirs) = std::fs::read_dir(&self.state) {
            for d in dirs.flatten() {
                if let Ok(pid) = std::fs::read_to_string(d.path().join("qemu.pid")) {
                    if let Ok(pid) = pid.trim().parse::<u32>() {
                        end(pid);
                    }
                }
                let _ = cgroup::remove(self.host.cgroups, &d.file_name().to_string_lossy());
            }
        }
        let _ = std::fs::remove_dir_all(self.host.ram_dir());
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Kills process `pid` and waits (bounded) until it is [`gone`].
pub(crate) fn end(pid: u32) {
    let Ok(pid_t) = i32::try_from(pid) else {
        return;
    };
    if pid_t <= 0 {
        return;
    }
    // SAFETY: kill has no memory-safety preconditions; the pid is positive,
    // so it names one process, not a group.
    unsafe {
        libc::kill(pid_t, libc::SIGKILL);
    }
    for _ in 0..200 {
        if gone(pid) {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether process `pid` is gone (or a zombie nobody reaped yet).
pub(crate) fn gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|s| s.trim_start().starts_with('Z')),
    }
}

/// Waits (bounded) for process `pid` to be [`gone`].
pub(crate) async fn gone_soon(pid: u32) -> bool {
    for _ in 0..500 {
        if gone(pid) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

/// A fake QMP server on `sock`: every command succeeds (`query-status`
/// answers `status`, `query-migrate` "completed") except those in
/// `refused`. Records the commands it was sent.
pub(crate) struct FakeQmp {
    seen: Arc<Mutex<Vec<String>>>,
}

impl FakeQmp {
    pub(crate) fn serve(
        sock: &Path,
        status: &'static str,
        refused: &'static [&'static str],
    ) -> FakeQmp {
        let _ = std::fs::remove_file(sock);
        let listener = tokio::net::UnixListener::bind(sock).unwrap();
        let seen: Arc<Mutex<Vec<String>>> = Arc::default();
        let log = Arc::clone(&seen);
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                let log = Arc::clone(&log);
                tokio::spawn(async move {
                    let (rd, mut wr) = conn.into_split();
                    let greeting = json!({"QMP": {"version": {}, "capabilities": []}});
                    wr.write_all(format!("{greeting}\n").as_bytes())
                        .await
                        .unwrap();
                    let mut lines = BufReader::new(rd).lines();
                    while let Ok(Some(line)) = lines.next_line().await {
                        let msg: Value = serde_json::from_str(&line).unwrap();
                        let cmd = msg["execute"].as_str().unwrap_or_default().to_owned();
                        log.lock().unwrap().push(cmd.clone());
                        let answer = if refused.contains(&cmd.as_str()) {
                            json!({"error": {"class": "GenericError", "desc": format!("{cmd} refused")}})
                        } else {
                            match cmd.as_str() {
                                "query-status" => {
                                    json!({"return": {"status": status, "running": status == "running"}})
                                }
                                "query-migrate" => json!({"return": {"status": "completed"}}),
                                _ => json!({"return": {}}),
                            }
                        };
                        if wr
                            .write_all(format!("{answer}\n").as_bytes())
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                });
            }
        });
        FakeQmp { seen }
    }

    /// The commands sent so far, in order.
    pub(crate) fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}
