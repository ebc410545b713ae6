//! A cgroup per VM holding QEMU's memory and CPU to the sandbox's shape plus
//! a bounded overhead. Supports the unified hierarchy (v2) and the legacy
//! per-controller one (v1, as on hybrid hosts).

use std::path::{Path, PathBuf};

const ROOT: &str = "/sys/fs/cgroup";
const GROUP: &str = "runtime";
/// What QEMU itself may use beyond guest RAM (TCG's translation cache is
/// capped at 256 MiB on the command line).
pub(crate) const OVERHEAD_MIB: u64 = 512;
const CPU_PERIOD_US: u64 = 100_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    V2,
    V1,
    None,
}

pub(crate) fn detect() -> Layout {
    let root = Path::new(ROOT);
    if root.join("cgroup.controllers").exists() {
        Layout::V2
    } else if root.join("memory").is_dir() && root.join("cpu").is_dir() {
        Layout::V1
    } else {
        Layout::None
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Limits {
    pub memory_mib: u32,
    pub vcpu: u32,
}

/// The directories that make up one VM's cgroup.
pub(crate) fn dirs(layout: Layout, id: &str) -> Vec<PathBuf> {
    let root = Path::new(ROOT);
    match layout {
        Layout::V2 => vec![root.join(GROUP).join(id)],
        Layout::V1 => ["memory", "cpu", "pids"]
            .iter()
            .map(|c| root.join(c).join(GROUP).join(id))
            .collect(),
        Layout::None => vec![],
    }
}

fn write(path: &Path, value: &str) -> std::io::Result<()> {
    std::fs::write(path, value)
}

/// Creates the cgroup with its limits and moves `pid` into it.
pub(crate) fn place(layout: Layout, id: &str, pid: u32, limits: &Limits) -> std::io::Result<()> {
    let mem = (u64::from(limits.memory_mib) + OVERHEAD_MIB) * 1024 * 1024;
    let quota = u64::from(limits.vcpu) * CPU_PERIOD_US;
    match layout {
        Layout::None => Ok(()),
        Layout::V2 => {
            let parent = Path::new(ROOT).join(GROUP);
            std::fs::create_dir_all(&parent)?;
            // Delegate the controllers to our subtree (ignore ones the host lacks).
            for c in ["+memory", "+cpu", "+pids"] {
                let _ = write(&Path::new(ROOT).join("cgroup.subtree_control"), c);
                let _ = write(&parent.join("cgroup.subtree_control"), c);
            }
            let dir = parent.join(id);
            std::fs::create_dir_all(&dir)?;
            write(&dir.join("memory.max"), &mem.to_string())?;
            let _ = write(&dir.join("memory.swap.max"), "0");
            write(&dir.join("cpu.max"), &format!("{quota} {CPU_PERIOD_US}"))?;
            let _ = write(&dir.join("pids.max"), "4096");
            write(&dir.join("cgroup.procs"), &pid.to_string())
        }
        Layout::V1 => {
            let root = Path::new(ROOT);
            let m = root.join("memory").join(GROUP).join(id);
            std::fs::create_dir_all(&m)?;
            write(&m.join("memory.limit_in_bytes"), &mem.to_string())?;
            write(&m.join("cgroup.procs"), &pid.to_string())?;
            let c = root.join("cpu").join(GROUP).join(id);
            std::fs::create_dir_all(&c)?;
            write(&c.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())?;
            write(&c.join("cpu.cfs_quota_us"), &quota.to_string())?;
            write(&c.join("cgroup.procs"), &pid.to_string())?;
            let p = root.join("pids").join(GROUP).join(id);
            if std::fs::create_dir_all(&p).is_ok() {
                let _ = write(&p.join("pids.max"), "4096");
                let _ = write(&p.join("cgroup.procs"), &pid.to_string());
            }
            Ok(())
        }
    }
}

/// Removes the VM's cgroup directories (they must be empty: call after the
/// process is gone); `true` when none is left.
pub(crate) fn remove(layout: Layout, id: &str) -> bool {
    dirs(layout, id).iter().fold(true, |all, d| {
        let gone = match std::fs::remove_dir(d) {
            Ok(()) => true,
            Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        };
        all && gone
    })
}

/// How long a removal waits for a process on its way out to leave the
/// cgroup (a killed or exiting QEMU is gone from `/proc` a moment before
/// the kernel lets its cgroup go: until then removal fails as busy).
const LEAVE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
const LEAVE_STEP: std::time::Duration = std::time::Duration::from_millis(10);

/// [`remove`], retried for up to [`LEAVE_WAIT`] while the cgroup is busy.
pub(crate) async fn remove_soon(layout: Layout, id: &str) {
    let tries = LEAVE_WAIT.as_millis() / LEAVE_STEP.as_millis();
    for _ in 0..tries {
        if remove(layout, id) {
            return;
        }
        tokio::time::sleep(LEAVE_STEP).await;
    }
    tracing::warn!(machine = id, "its cgroup is still busy: left in place");
}

/// [`remove_soon`] for where no runtime runs the wait (a host starting up,
/// a guard dropped without one).
pub(crate) fn remove_soon_blocking(layout: Layout, id: &str) {
    let tries = LEAVE_WAIT.as_millis() / LEAVE_STEP.as_millis();
    for _ in 0..tries {
        if remove(layout, id) {
            return;
        }
        std::thread::sleep(LEAVE_STEP);
    }
    tracing::warn!(machine = id, "its cgroup is still busy: left in place");
}

/// The memory limit in force for the VM, in bytes (for tests and diagnostics).
pub(crate) fn memory_limit(layout: Layout, id: &str) -> Option<u64> {
    let file = match layout {
        Layout::V2 => dirs(layout, id).first()?.join("memory.max"),
        Layout::V1 => dirs(layout, id).first()?.join("memory.limit_in_bytes"),
        Layout::None => return None,
    };
    std::fs::read_to_string(file).ok()?.trim().parse().ok()
}
