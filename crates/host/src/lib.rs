//! One machine's sandboxes: QEMU microVMs, their disks, and the link to each
//! guest agent. The control plane sees only the [`Host`] trait and the plain
//! types beside it; it never speaks the guest protocol (`runtime-proto`),
//! which stays inside this crate.
//!
//! Depends on `runtime-proto` only among workspace crates.

mod accel;
pub mod artifacts;
mod capture;
mod cgroup;
mod convert;
mod cpu_time;
mod disks;
#[cfg(test)]
mod fake_guest;
mod guest_setup;
mod inspect;
mod launch;
mod link;
mod machine;
mod pump;
mod qemu;
mod qmp;
mod ram;
mod templates;
mod tunnel;
mod types;
mod uid;
pub mod volume;

pub use accel::{choose_accel, probe_boot};
pub use machine::{QemuConfig, QemuHost};
pub use qemu::Accel;
pub use tunnel::MAX_TUNNELS;
pub use types::*;
