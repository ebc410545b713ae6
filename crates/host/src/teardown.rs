//! Ending machines, and what a crash of the server left behind: the one
//! teardown every end of a machine goes through, machines not registered
//! yet ([`Pending`]: ended when given up), and, at start and on recovery,
//! the QEMUs, RAM files and cgroups nothing owns any more.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};

use crate::cgroup;
use crate::link::Link;
use crate::machine::{QemuHost, Vm};
use crate::qemu::{self, VmPaths};
use crate::qmp::Qmp;
use crate::templates::is_template_machine;

impl QemuHost {
    /// The one way a machine ends: its QEMU killed (while the pid is still
    /// the machine's), what QEMU had passed on read from the link before it
    /// closes (so output written just before the end is not lost), then its
    /// RAM file and its cgroup removed.
    async fn end_machine(
        &self,
        id: &str,
        dir: &Path,
        pid: Option<u32>,
        link: Option<Link>,
        ram: Option<&Path>,
    ) {
        if let Some(pid) = pid {
            if qemu::may_be_ours_async(pid, dir).await {
                qemu::kill(pid).await;
            }
        }
        if let Some(l) = link {
            l.drained(Duration::from_secs(2)).await;
            l.close();
        }
        if let Some(ram) = ram {
            let _ = std::fs::remove_file(ram);
        }
        cgroup::remove_soon(self.cgroups, id).await;
    }

    /// What outlives a machine's QEMU: its RAM file and its cgroup (removed
    /// once the QEMU is gone), where no runtime runs the wait.
    fn release_blocking(&self, id: &str, ram: Option<&Path>) {
        if let Some(ram) = ram {
            let _ = std::fs::remove_file(ram);
        }
        cgroup::remove_soon_blocking(self.cgroups, id);
    }

    /// Ends machine `vm` of `id` (out of the registry already, or never in).
    pub(crate) async fn end_vm(&self, id: &str, vm: &Vm) {
        let link = vm.link.lock().await.take();
        self.end_machine(id, &vm.paths.dir, Some(vm.pid), link, vm.ram.as_deref())
            .await;
    }

    /// Ends machine `id` where this host holds none: the QEMU its pid file
    /// names (an earlier server's, or a start cut short), its own RAM file,
    /// its cgroup.
    pub(crate) async fn end_untracked(&self, id: &str) {
        let paths = self.paths(id);
        let pid = qemu::read_pid(&paths);
        let ram = self.own_ram(id);
        self.end_machine(id, &paths.dir, pid, None, Some(&ram))
            .await;
    }

    /// Ends whatever machine has `id`, registered or not: before its
    /// directory is made afresh, which would leave a QEMU still in it
    /// running with nothing left to find it by.
    pub(crate) async fn end_any(&self, id: &str) {
        if let Some(vm) = self.take_vm(id) {
            self.end_vm(id, &vm).await;
        }
        self.end_untracked(id).await;
    }

    /// A registered machine `vm` of `id` that a capture left stopped and
    /// that cannot run on: of no use, and holding its memory. Out of the
    /// registry and ended; later calls find no machine.
    pub(crate) async fn end_stuck(&self, id: &str, vm: &Vm) {
        tracing::warn!(
            sandbox_id = id,
            "the machine cannot run on after a capture: ending it"
        );
        if let Ok(mut m) = self.vms.lock() {
            if m.get(id).is_some_and(|r| std::ptr::eq(Arc::as_ptr(r), vm)) {
                m.remove(id);
            }
        }
        self.end_vm(id, vm).await;
    }

    /// At start, what an earlier server left that nothing will claim: the
    /// machine of a template whose build was cut short (ended, its directory
    /// removed), and the cgroups of machines whose QEMU is gone (their RAM
    /// files: [`QemuHost::drop_stale_ram`]).
    pub(crate) fn drop_stale_machines(&self) {
        let Ok(entries) = std::fs::read_dir(&self.cfg.state_dir) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') || !e.path().is_dir() {
                continue;
            }
            let paths = self.paths(&name);
            let pid = qemu::read_pid(&paths).filter(|&p| qemu::is_our_qemu(p, &paths.dir));
            if is_template_machine(&name) {
                if let Some(pid) = pid {
                    tracing::info!(machine = %name, pid, "ending the machine of a template build cut short");
                    qemu::kill_blocking(pid);
                }
                self.release_blocking(&name, Some(&self.own_ram(&name)));
                let _ = std::fs::remove_dir_all(&paths.dir);
            } else if pid.is_none() {
                let _ = cgroup::remove(self.cgroups, &name);
            }
        }
    }

    /// The ids of the sandbox machines with a directory here (running or
    /// not); templates' machines are not among them.
    pub(crate) fn machine_dirs(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(&self.cfg.state_dir) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter(|e| e.path().is_dir())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with('.') && !is_template_machine(n))
            .collect()
    }

    /// A QEMU an earlier server left running in `paths`: made fit to be
    /// adopted (`Ok`), or why it must end instead. One that never finished
    /// starting ends; one stopped for a capture runs on, unless it was
    /// stopped for a pause whose state was kept (then the pause is
    /// finished: it ends, its state stays); a saved state a wake got past
    /// goes.
    pub(crate) async fn settle_found(&self, paths: &VmPaths) -> Result<(), String> {
        if paths.starting().exists() {
            return Err("it never finished starting".into());
        }
        // No capture of the earlier server goes on.
        let _ = std::fs::remove_file(paths.capture_state());
        if !paths.qmp_sock().exists() {
            return Ok(());
        }
        let Ok(mut q) = Qmp::connect(&paths.qmp_sock(), Duration::from_secs(5)).await else {
            // Its agent tells whether it can be adopted.
            return Ok(());
        };
        let status = q
            .execute("query-status", json!({}))
            .await
            .ok()
            .and_then(|s| s.get("status").and_then(Value::as_str).map(str::to_owned));
        let saved = paths.paused_state().exists();
        match status.as_deref() {
            Some("paused" | "postmigrate" | "finish-migrate") if saved => {
                Err("its pause was saved: finishing the pause".into())
            }
            Some("paused" | "postmigrate" | "finish-migrate") => {
                // Stopped for a capture the earlier server did not finish.
                let _ = std::fs::remove_file(paths.paused_ram());
                let _ = q.execute("migrate_cancel", json!({})).await;
                for _ in 0..100 {
                    let st = q.execute("query-migrate", json!({})).await;
                    let active = st.ok().is_some_and(|m| {
                        matches!(
                            m.get("status").and_then(Value::as_str),
                            Some("setup" | "active" | "cancelling" | "device")
                        )
                    });
                    if !active {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                q.execute("cont", json!({}))
                    .await
                    .map(|_| ())
                    .map_err(|e| format!("it was left stopped and cannot run on: {e}"))
            }
            Some("running") if saved => {
                // A wake that got through: the machine has moved on.
                let _ = std::fs::remove_file(paths.paused_state());
                let _ = std::fs::remove_file(paths.paused_ram());
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

/// A machine up, or coming up, but not in the registry: ended if dropped
/// before it is [registered](Pending::register) or [ended](Pending::end)
/// (a caller that gave up half-way), so no QEMU is left that nothing holds.
pub(crate) struct Pending {
    host: QemuHost,
    id: String,
    vm: Arc<Vm>,
    armed: bool,
}

impl Pending {
    pub(crate) fn new(host: &QemuHost, id: &str, vm: Vm) -> Pending {
        Pending {
            host: host.clone(),
            id: id.to_owned(),
            vm: Arc::new(vm),
            armed: true,
        }
    }

    pub(crate) fn vm(&self) -> &Arc<Vm> {
        &self.vm
    }

    /// The machine is up: into the registry.
    pub(crate) fn register(mut self) {
        self.armed = false;
        self.host.register(&self.id, Arc::clone(&self.vm));
    }

    /// Ends the machine (it failed to come up, or served its purpose).
    pub(crate) async fn end(mut self) {
        self.host.end_vm(&self.id, &self.vm).await;
        self.armed = false;
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        tracing::warn!(sandbox_id = %self.id, "a machine given up before it was registered: ending it");
        // Killed now, whether or not a runtime is left to wait for it.
        if qemu::is_our_qemu(self.vm.pid, &self.vm.paths.dir) {
            qemu::sigkill(self.vm.pid);
        }
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                let (host, id, vm) = (self.host.clone(), self.id.clone(), Arc::clone(&self.vm));
                rt.spawn(async move { host.end_vm(&id, &vm).await });
            }
            Err(_) => self.host.release_blocking(&self.id, self.vm.ram.as_deref()),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use runtime_proto::{channel, Request, MAX_PAYLOAD};

    use crate::fake_guest::Guest;
    use crate::fake_qemu::{gone, FakeHost, FakeQmp};
    use crate::link::Incoming;
    use crate::machine::Vm;
    use crate::types::Host;

    /// Machine `id` registered on a QEMU of its own (a fake), linked to
    /// `link`.
    fn running(f: &FakeHost, id: &str, link: Option<crate::link::Link>) -> u32 {
        let pid = f.leave_qemu(id);
        let vm = Vm {
            paths: f.paths(id),
            pid,
            link: tokio::sync::Mutex::new(link),
            volumes: false,
            ram: None,
        };
        f.host
            .vms
            .lock()
            .unwrap()
            .insert(id.to_owned(), std::sync::Arc::new(vm));
        pid
    }

    #[tokio::test]
    async fn stop_delivers_what_the_guest_sent_before_its_end() {
        let f = FakeHost::new("stop-drains");
        let id = f.id("m");
        let (link, mut guest) = Guest::linked().await;
        let pid = running(&f, &id, Some(link.clone()));
        let mut stream = link.open().unwrap();
        stream.send(&Request::Ping).unwrap();
        let (sid, _) = guest.request().await.unwrap();
        // The guest's last output, then its end (as QEMU's when killed).
        let total = 1 << 20;
        let talk = tokio::spawn(async move {
            for piece in vec![b'o'; total].chunks(MAX_PAYLOAD) {
                guest.output(sid, channel::STDOUT, piece).await;
            }
        });
        f.host.stop(&id, false).await.unwrap();
        let _ = talk.await;
        let mut got = 0;
        while let Some(Incoming::Data { bytes, .. }) = stream.recv().await {
            got += bytes.len();
        }
        assert_eq!(got, total, "output lost at the stop");
        assert!(gone(pid));
        assert!(!f.has_cgroup(&id));
        assert!(!f.state.join(&id).exists());
    }

    #[tokio::test]
    async fn recover_ends_what_it_cannot_adopt_with_its_ram_and_cgroup() {
        let f = FakeHost::new("recover-ends");
        let id = f.id("m");
        // Its agent's socket is gone: nothing answers.
        let pid = f.leave_qemu(&id);
        let ram = f.host.own_ram(&id);
        std::fs::write(&ram, b"guest memory").unwrap();
        let host = f.restart();
        assert!(!host.recover(&f.spec(&id)).await.unwrap());
        assert!(gone(pid), "QEMU {pid} still runs");
        assert!(!ram.exists(), "its RAM file is left");
        assert!(!f.has_cgroup(&id), "its cgroup is left");
    }

    #[tokio::test]
    async fn recover_ends_a_machine_that_never_finished_starting() {
        let f = FakeHost::new("recover-starting");
        let id = f.id("m");
        let pid = f.leave_qemu(&id);
        let paths = f.paths(&id);
        let _guest = Guest::serving(tokio::net::UnixListener::bind(paths.agent_sock()).unwrap());
        // A crash of the server between QEMU's spawn and the machine's
        // registration: never set up, its volumes never mounted.
        std::fs::write(paths.dir.join("starting"), b"").unwrap();
        let host = f.restart();
        assert!(!host.recover(&f.spec(&id)).await.unwrap());
        assert!(gone(pid), "QEMU {pid} still runs");
        assert!(host.qemu_pid(&id).is_none());
    }

    #[tokio::test]
    async fn recover_runs_on_a_machine_left_stopped_by_a_capture() {
        let f = FakeHost::new("recover-stopped");
        let id = f.id("m");
        let pid = f.leave_qemu(&id);
        let paths = f.paths(&id);
        let qmp = FakeQmp::serve(&paths.qmp_sock(), "postmigrate", &[]);
        let _guest = Guest::serving(tokio::net::UnixListener::bind(paths.agent_sock()).unwrap());
        // The crash came during a pause's capture, before its state was kept.
        std::fs::write(paths.capture_state(), b"half").unwrap();
        std::fs::write(paths.paused_ram(), b"half").unwrap();
        let host = f.restart();
        assert!(host.recover(&f.spec(&id)).await.unwrap());
        assert_eq!(host.qemu_pid(&id), Some(pid));
        assert!(qmp.seen().contains(&"cont".to_owned()), "{:?}", qmp.seen());
        assert!(!paths.capture_state().exists());
        assert!(!paths.paused_ram().exists());
    }

    #[tokio::test]
    async fn recover_finishes_a_pause_whose_state_was_kept() {
        let f = FakeHost::new("recover-paused");
        let id = f.id("m");
        let pid = f.leave_qemu(&id);
        let paths = f.paths(&id);
        let qmp = FakeQmp::serve(&paths.qmp_sock(), "postmigrate", &[]);
        let _guest = Guest::serving(tokio::net::UnixListener::bind(paths.agent_sock()).unwrap());
        // The crash came after the state was kept, before QEMU ended.
        std::fs::write(paths.paused_state(), b"state").unwrap();
        let host = f.restart();
        assert!(!host.recover(&f.spec(&id)).await.unwrap());
        assert!(gone(pid), "QEMU {pid} still runs");
        assert!(
            paths.paused_state().exists(),
            "the state to wake from stays"
        );
        assert!(!qmp.seen().contains(&"cont".to_owned()), "{:?}", qmp.seen());
        assert!(!f.has_cgroup(&id));
    }

    #[tokio::test]
    async fn recover_drops_the_state_a_wake_got_past() {
        let f = FakeHost::new("recover-woken");
        let id = f.id("m");
        let pid = f.leave_qemu(&id);
        let paths = f.paths(&id);
        let _qmp = FakeQmp::serve(&paths.qmp_sock(), "running", &[]);
        let _guest = Guest::serving(tokio::net::UnixListener::bind(paths.agent_sock()).unwrap());
        // The crash came after the wake, before its state was removed.
        std::fs::write(paths.paused_state(), b"state").unwrap();
        std::fs::write(paths.paused_ram(), b"memory").unwrap();
        let host = f.restart();
        assert!(host.recover(&f.spec(&id)).await.unwrap());
        assert_eq!(host.qemu_pid(&id), Some(pid));
        assert!(
            !paths.paused_state().exists(),
            "a running machine with a state to wake from"
        );
        assert!(!paths.paused_ram().exists());
    }

    #[tokio::test]
    async fn a_new_host_ends_the_machine_of_a_template_build_cut_short() {
        let f = FakeHost::new("template-left");
        let id = format!("template-{}", f.id("m"));
        let pid = f.leave_qemu(&id);
        let ram = f.host.own_ram(&id);
        std::fs::write(&ram, b"guest memory").unwrap();
        let _host = f.restart();
        assert!(gone(pid), "QEMU {pid} still runs");
        assert!(!f.state.join(&id).exists());
        assert!(!ram.exists());
        assert!(!f.has_cgroup(&id));
    }

    #[tokio::test]
    async fn a_new_host_removes_the_cgroups_of_machines_gone() {
        let f = FakeHost::new("cgroup-left");
        let id = f.id("m");
        let pid = f.leave_qemu(&id);
        // QEMU died with the server; its directory and cgroup stayed.
        crate::fake_qemu::end(pid);
        let _host = f.restart();
        assert!(!f.has_cgroup(&id), "its cgroup is left");
        assert!(
            f.state.join(&id).exists(),
            "its directory is the server's to remove"
        );
    }

    #[tokio::test]
    async fn a_fresh_directory_ends_the_qemu_still_in_it() {
        let f = FakeHost::new("fresh-dir");
        let id = f.id("m");
        let old = f.leave_qemu(&id);
        f.set(crate::fake_qemu::Fake::Exits);
        let _ = f.host.start(&f.spec(&id)).await;
        assert!(gone(old), "QEMU {old} runs on without its directory");
        assert!(!f.has_cgroup(&id));
    }
}
