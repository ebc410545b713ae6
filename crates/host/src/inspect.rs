//! Inspection of a [`QemuHost`]'s machines for the crate's VM tests
//! (`tests/vm.rs`): public only because those tests are another crate; the
//! server never calls them.

use std::path::PathBuf;

use crate::cgroup;
use crate::machine::QemuHost;
use crate::qemu;

impl QemuHost {
    /// The RAM file a running machine maps as its own, if it has one (a
    /// fork's copy maps its source's frozen file instead).
    #[doc(hidden)]
    pub fn ram_file(&self, id: &str) -> Option<PathBuf> {
        self.vm(id).ok()?.ram.clone()
    }

    /// The memory limit of a VM's cgroup in bytes, if cgroups are in use.
    #[doc(hidden)]
    pub fn memory_limit(&self, id: &str) -> Option<u64> {
        cgroup::memory_limit(self.cgroups, id)
    }

    /// The pid of a VM's QEMU.
    #[doc(hidden)]
    pub fn qemu_pid(&self, id: &str) -> Option<u32> {
        self.vm(id).ok().map(|v| v.pid)
    }

    /// The serial console so far.
    #[doc(hidden)]
    pub fn console(&self, id: &str) -> String {
        qemu::console_tail(&self.paths(id), 1 << 20)
    }
}
