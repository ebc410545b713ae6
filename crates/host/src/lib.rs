//! One machine's sandboxes: QEMU microVMs, their disks, and the link to each
//! guest agent. The control plane sees only the [`Host`] trait and the plain
//! types beside it; it never speaks the guest protocol (`runtime-proto`),
//! which stays inside this crate.
//!
//! Depends on `runtime-proto` (the guest protocol) and `runtime-egress` (the
//! egress proxy it runs for its guests) among workspace crates.
//!
//! Modules:
//! - `types`: the [`Host`] trait and the plain types the control plane sees.
//! - `machine`: [`QemuHost`], its registry of running machines, links and outbound tunnels, and `impl Host`.
//! - `accel`: the accelerator choice ([`choose_accel`]) and the probe boot ([`probe_boot`]).
//! - `launch`: the boot and restore sequence, from QEMU's spawn to a set-up guest, in named steps.
//! - `capture`: capture, resume and state loading through QMP; the pause and capture flows.
//! - `templates`: pre-booted templates per machine shape, built in the background and restored on start.
//! - `teardown`: the one way a machine ends, machines not registered yet, and what a crash of the server left (ended or adopted).
//! - `disks`: a machine's directory, overlay, `snapshot` volume copies and drive files.
//! - `ram`: where guests' RAM lives (tmpfs or disk), RAM plans, sparse RAM copies.
//! - `guest_setup`: the guest's `Setup`, volume mounting (`mount_volumes.sh`), flushing its writes.
//! - `pump`: exec event pumps between a process's stream and its [`ExecHandle`].
//! - `convert`: mapping between guest-protocol (`runtime-proto`) and host types.
//! - `uid`: QEMU's own uid per machine when running as root, and the directories it must reach.
//! - `cpu_time`: a guest's vCPU time, from `/proc`.
//! - `inspect`: test-only inspection of machines for `tests/vm.rs` (`#[doc(hidden)]`).
//! - `qemu`: QEMU's command line, spawning and ending it; `qmp`: a minimal QMP client.
//! - `network`: the egress proxy of the guests' outbound connections, per sandbox as the control plane sets it.
//! - `link`: the multiplexed agent channel; `tunnel`: TCP tunnels over its streams.
//! - `cgroup`: a cgroup per machine; `artifacts`: kernel and base image; `volume`: volume files.
//! - `share`: shared volumes: the 9P relay, its server process (`runtime 9p-serve`).
//! - `oci`: pulling registry images (manifests, blobs, the blob cache) through the egress proxy.

mod accel;
pub mod artifacts;
mod capture;
mod cgroup;
mod convert;
mod cpu_time;
pub mod disk_files;
mod disks;
#[cfg(test)]
mod fake_guest;
#[cfg(test)]
mod fake_qemu;
mod guest_setup;
mod inspect;
mod jail;
mod launch;
mod link;
mod machine;
mod network;
pub mod oci;
mod pump;
mod qemu;
mod qmp;
mod ram;
mod read;
pub mod share;
mod teardown;
mod templates;
mod tunnel;
mod types;
mod uid;
pub mod volume;

pub use accel::{choose_accel, probe_boot};
pub use machine::{QemuConfig, QemuHost};
pub use qemu::{host_tsc_khz, Accel};
pub use share::ShareSpec;
pub use tunnel::MAX_TUNNELS;
pub use types::*;
pub use uid::{as_root, UidPool, VOLUME_UIDS};
