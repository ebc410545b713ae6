//! Which accelerator QEMU uses: KVM where it is real and a guest boots
//! under it, TCG otherwise.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::machine::{QemuConfig, QemuHost};
use crate::qemu::Accel;
use crate::types::{Host, HostError, MachineSpec};

/// Picks KVM where it is real hardware virtualisation, TCG otherwise. A
/// software KVM (PVM, as on nested cloud machines) crashes stock guest
/// kernels, so it counts as no KVM.
pub fn choose_accel() -> (Accel, String) {
    if !Path::new("/dev/kvm").exists() {
        return (Accel::Tcg, "no /dev/kvm".into());
    }
    if Path::new("/sys/module/kvm_pvm").exists() {
        return (Accel::Tcg, "/dev/kvm is the PVM software hypervisor".into());
    }
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        Ok(_) => (Accel::Kvm, "/dev/kvm usable".into()),
        Err(e) => (Accel::Tcg, format!("/dev/kvm not usable: {e}")),
    }
}

/// Boots a throwaway machine with `cfg` (its accelerator, a short timeout)
/// and ends it: `Ok` when its agent answered. `serve` uses it to keep KVM
/// only where a guest really boots under it.
pub async fn probe_boot(cfg: QemuConfig) -> Result<Duration, HostError> {
    let state = cfg.state_dir.join("probe");
    let host = QemuHost::new(QemuConfig {
        state_dir: state.clone(),
        images_dir: state.join("images"),
        boot_timeout: Duration::from_secs(30),
        ..cfg
    })
    .map_err(|source| HostError::Io {
        id: "probe".into(),
        op: "probe dir",
        source,
    })?;
    let spec = MachineSpec {
        id: "probe".into(),
        vcpu: 1,
        memory_mib: 256,
        disk_mib: 3072,
        hostname: "probe".into(),
        guest_ca_pem: None,
        volumes: Vec::new(),
        image: None,
        no_template: false,
    };
    let started = Instant::now();
    let r = host.start(&spec).await;
    let _ = host.destroy("probe").await;
    let _ = std::fs::remove_dir_all(state);
    r.map(|_| started.elapsed())
}
