//! Pre-booted templates: per machine shape, a capture (memory and disk) of
//! a machine booted to its agent, built in the background after the first
//! boot of that shape, that later starts of the shape restore.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::disks::copy_sparse;
use crate::machine::{QemuHost, Vm};
use crate::qemu;
use crate::ram::copy_ram;
use crate::types::{BootStage, Host, HostError, MachineSpec};

impl QemuHost {
    pub(crate) fn templates_dir(&self) -> PathBuf {
        self.cfg.state_dir.join(".templates")
    }

    /// Starts `spec` by restoring its shape's template, when templates are
    /// on and the spec can use one: `true` when it did. Without a template
    /// yet, one is built in the background (once per shape at a time); a
    /// template that fails to restore is dropped. `false`: boot instead.
    pub(crate) async fn start_from_template(&self, spec: &MachineSpec) -> bool {
        match self.template_for(spec) {
            Some(dir) => match self.restore(spec, &dir).await {
                Ok(()) => true,
                Err(error) => {
                    tracing::warn!(sandbox_id = %spec.id, %error, "restoring the template failed; booting");
                    let _ = std::fs::remove_dir_all(&dir);
                    false
                }
            },
            None => false,
        }
    }

    /// A warm machine (docs/memory.md, "Warm machines"): `spec` restored
    /// from its shape's template, never booted. `Ok(false)` when there is
    /// no template yet (one is then being built) or the spec cannot use
    /// one.
    pub(crate) async fn start_warm_machine(&self, spec: &MachineSpec) -> Result<bool, HostError> {
        let Some(dir) = self.template_for(spec) else {
            return Ok(false);
        };
        // A failure here may be the host's load: the template stays (a
        // create's own restore that fails drops it, as before).
        self.restore(spec, &dir).await?;
        // A practice run of the setup a take sends (a CA written, the
        // bundle rebuilt): under emulation the first run of that code in a
        // restored guest is most of its time, and it should not be the
        // take's. The take's own setup replaces this certificate.
        let began = Instant::now();
        let practice = async {
            let link = self.link(&spec.id).await?;
            crate::guest_setup::setup(&link, &spec.id, &spec.hostname, Some(PRACTICE_CA))
                .await
                .map_err(|e| self.start_failed(&spec.id, BootStage::Agent, e.to_string()))?;
            // And a sandbox's usual first commands (the shell, Python): the
            // template's page cache holds their files, but under TCG their
            // code is translated again in every new QEMU, which is most of
            // a first `python3`'s time. Best effort, like the template's.
            if self.cfg.accel == crate::qemu::Accel::Tcg {
                crate::guest_setup::run_warm_up(&link).await;
            }
            Ok::<(), HostError>(())
        };
        if let Err(error) = practice.await {
            let _ = self.destroy(&spec.id).await;
            return Err(error);
        }
        tracing::info!(
            sandbox_id = %spec.id,
            ms = began.elapsed().as_millis() as u64,
            "warm machine practised its setup"
        );
        Ok(true)
    }

    /// The template directory `spec` restores from, if templates are on, the
    /// spec can use one and it is there. Without it yet, its build starts
    /// in the background (once per shape at a time).
    fn template_for(&self, spec: &MachineSpec) -> Option<PathBuf> {
        // A template's machine has no volume drives, and a restored machine
        // must have exactly the devices it was captured with: boot instead.
        if !(self.cfg.templates && spec.volumes.is_empty() && !spec.no_template) {
            return None;
        }
        let key = template_key(
            &self.cfg.artifacts.key,
            qemu::cpu_model(self.cfg.accel),
            spec,
        );
        let dir = self.templates_dir().join(&key);
        if dir.join("memory.state").exists() {
            return Some(dir);
        }
        if self
            .building
            .lock()
            .map(|mut b| b.insert(key.clone()))
            .unwrap_or(false)
        {
            let me = self.clone();
            let shape = spec.clone();
            tokio::spawn(async move {
                if let Err(error) = me.build_template(key.clone(), shape).await {
                    tracing::warn!(template = %key, %error, "building the template failed");
                }
                if let Ok(mut b) = me.building.lock() {
                    b.remove(&key);
                }
            });
        }
        None
    }

    /// Templates of other artifacts, and templates cut short.
    pub(crate) fn drop_stale_templates(&self) {
        let Ok(entries) = std::fs::read_dir(self.templates_dir()) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if is_stale(&name, &self.cfg.artifacts.key) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }

    /// Boots a machine of this shape, captures it (memory and disk) once its
    /// agent answers, and keeps that as the shape's template.
    async fn build_template(&self, key: String, shape: MachineSpec) -> Result<(), HostError> {
        let dir = self.templates_dir().join(&key);
        let partial = self.templates_dir().join(format!("{key}.partial"));
        let id = template_id(&key);
        // The template is shared: no sandbox's CA (each start installs its own).
        let spec = MachineSpec {
            id: id.clone(),
            hostname: "sandbox".into(),
            guest_ca_pem: None,
            volumes: Vec::new(),
            ..shape
        };
        let started = Instant::now();
        let vm = match self.boot(&spec).await {
            Ok(vm) => vm,
            Err(e) => {
                // The machine is ended; its directory goes too.
                let _ = std::fs::remove_dir_all(self.paths(&id).dir);
                return Err(e);
            }
        };
        crate::guest_setup::warm_up(vm.vm()).await;
        let result = self.keep_template(&id, vm.vm(), &partial, &dir).await;
        let vm_dir = vm.vm().paths.dir.clone();
        vm.end().await;
        let _ = std::fs::remove_dir_all(&vm_dir);
        if result.is_err() {
            let _ = std::fs::remove_dir_all(&partial);
        } else {
            tracing::info!(template = %key, ms = started.elapsed().as_millis() as u64, "template ready");
        }
        result
    }

    /// Captures template machine `id` into `partial`, which becomes `dir`
    /// once complete.
    async fn keep_template(
        &self,
        id: &str,
        vm: &Vm,
        partial: &Path,
        dir: &Path,
    ) -> Result<(), HostError> {
        let _ = std::fs::remove_dir_all(partial);
        std::fs::create_dir_all(partial).map_err(Self::io(id, "create template dir"))?;
        let file = self
            .capture_stopped(id, vm)
            .await
            .map_err(|failed| failed.error)?;
        if let Some(ram) = &vm.ram {
            copy_ram(ram, &partial.join("memory.ram"))
                .await
                .map_err(Self::io(id, "keep template memory"))?;
        }
        std::fs::rename(&file, partial.join("memory.state"))
            .map_err(Self::io(id, "keep template"))?;
        copy_sparse(&vm.paths.overlay(), &partial.join("disk.qcow2"))
            .await
            .map_err(Self::io(id, "copy template disk"))?;
        crate::disks::sync_dir_async(partial)
            .await
            .map_err(Self::io(id, "sync template"))?;
        std::fs::rename(partial, dir).map_err(Self::io(id, "keep template"))?;
        let parent = dir.parent().unwrap_or(dir);
        crate::disks::sync_files(Vec::new(), parent)
            .await
            .map_err(Self::io(id, "sync template"))
    }
}

/// What a warm machine installs as its CA until a sandbox takes it: no
/// certificate of anyone (the agent checks only its PEM frame), replaced by
/// the sandbox's own at the take.
const PRACTICE_CA: &str = "-----BEGIN CERTIFICATE-----\nd2FybSBtYWNoaW5lOiBubyBjZXJ0aWZpY2F0ZQ==\n-----END CERTIFICATE-----\n";

/// Templates are keyed by the artifacts (kernel, image, agent), QEMU's CPU
/// model and the machine's shape: a restore needs exactly the machine it
/// was taken on.
fn template_key(artifacts_key: &str, cpu_model: &str, spec: &MachineSpec) -> String {
    let image = match &spec.image {
        Some(i) => format!("-img-{}", i.key),
        None => String::new(),
    };
    // `r2`: the RAM is a backend named `ram`, the template's a file
    // beside a state without it (captures made before are of another
    // machine and never restored). `r3`: booted with `tsc=reliable` and the
    // host's TSC frequency (qemu.rs), whose clock a template keeps.
    format!(
        "{}-{}-r3-{}c-{}m-{}d{image}{}",
        artifacts_key,
        cpu_model,
        spec.vcpu,
        spec.memory_mib,
        spec.disk_mib,
        tsc_suffix()
    )
}

/// The host's TSC frequency as a template key names it (empty when unknown).
fn tsc_suffix() -> String {
    crate::qemu::host_tsc_khz().map_or(String::new(), |k| format!("-tsc{k}"))
}

/// The id of the machine that builds the template `key`: unique per key
/// (shapes of one image differ only in the middle).
fn template_id(key: &str) -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    format!("template-{:016x}", h.finish())
}

/// Whether the machine directory `name` is a template's machine (see
/// [`template_id`]): no sandbox's, so nothing but its build owns it.
pub(crate) fn is_template_machine(name: &str) -> bool {
    name.starts_with("template-")
}

/// Whether the entry `name` of the templates directory is of other
/// artifacts than `artifacts_key`, or cut short.
fn is_stale(name: &str, artifacts_key: &str) -> bool {
    let prefix = format!("{artifacts_key}-");
    !name.starts_with(&prefix) || name.ends_with(".partial")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::ImageDisk;

    fn shape() -> MachineSpec {
        MachineSpec {
            id: "sbx-1".into(),
            vcpu: 2,
            memory_mib: 1024,
            disk_mib: 4096,
            hostname: "sbx".into(),
            ..MachineSpec::default()
        }
    }

    #[test]
    fn a_template_key_names_artifacts_cpu_and_shape() {
        let tsc = tsc_suffix();
        assert_eq!(
            template_key("arts9", "max", &shape()),
            format!("arts9-max-r3-2c-1024m-4096d{tsc}")
        );
        let with_image = MachineSpec {
            image: Some(ImageDisk {
                key: "py312".into(),
                disk: "/images/py312.qcow2".into(),
            }),
            ..shape()
        };
        assert_eq!(
            template_key("arts9", "host", &with_image),
            format!("arts9-host-r3-2c-1024m-4096d-img-py312{tsc}")
        );
    }

    #[test]
    fn a_template_key_ignores_what_each_start_sets_itself() {
        let other = MachineSpec {
            id: "sbx-2".into(),
            hostname: "other".into(),
            guest_ca_pem: Some("PEM".into()),
            ..shape()
        };
        assert_eq!(
            template_key("a", "max", &shape()),
            template_key("a", "max", &other)
        );
        let bigger = MachineSpec {
            memory_mib: 2048,
            ..shape()
        };
        assert_ne!(
            template_key("a", "max", &shape()),
            template_key("a", "max", &bigger)
        );
    }

    #[test]
    fn each_template_has_its_own_machine_id() {
        let a = template_id("arts9-max-r2-2c-1024m-4096d");
        let b = template_id("arts9-max-r2-4c-1024m-4096d");
        assert_ne!(a, b);
        assert_eq!(a, template_id("arts9-max-r2-2c-1024m-4096d"));
        let hex = a.strip_prefix("template-").unwrap_or_default();
        assert_eq!(hex.len(), 16);
        assert!(hex.chars().all(|c| c.is_ascii_hexdigit()));
        assert!(is_template_machine(&a));
        assert!(!is_template_machine("00000000-0000-4000-8000-00000000a001"));
    }

    #[tokio::test]
    async fn a_template_build_that_fails_leaves_nothing() {
        use crate::fake_qemu::{Fake, FakeHost};
        let f = FakeHost::with("template-fails", true);
        f.set(Fake::Exits);
        let id = f.id("m");
        assert!(f.host.start(&f.spec(&id)).await.is_err());
        for _ in 0..1000 {
            if f.host.building.lock().unwrap().is_empty() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(f.host.building.lock().unwrap().is_empty(), "still building");
        let left: Vec<_> = std::fs::read_dir(&f.state)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| is_template_machine(n))
            .collect();
        assert!(left.is_empty(), "left behind: {left:?}");
        let partial: Vec<_> = std::fs::read_dir(f.state.join(".templates"))
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(partial.is_empty(), "left behind: {partial:?}");
    }

    #[tokio::test]
    async fn a_warm_machine_starts_only_from_a_template() {
        use crate::fake_qemu::{Fake, FakeHost};
        // Templates off: nothing starts.
        let f = FakeHost::new("warm-off");
        let id = f.id("w");
        assert!(!f.host.start_warm(&f.spec(&id)).await.unwrap());
        assert!(!f.paths(&id).dir.exists(), "a machine was started");
        assert!(matches!(
            f.host.assume(&f.spec(&id)).await,
            Err(HostError::NoSuchMachine { .. })
        ));
        // Templates on, none built yet: nothing starts; the build begins.
        let f = FakeHost::with("warm-none", true);
        f.set(Fake::Exits);
        let id = f.id("w");
        assert!(!f.host.start_warm(&f.spec(&id)).await.unwrap());
        assert!(!f.paths(&id).dir.exists(), "a machine was booted");
        for _ in 0..1000 {
            if f.host.building.lock().unwrap().is_empty() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(f.host.building.lock().unwrap().is_empty(), "still building");
    }

    #[test]
    fn templates_of_other_artifacts_or_cut_short_are_stale() {
        assert!(!is_stale("arts9-max-r2-2c-1024m-4096d", "arts9"));
        assert!(is_stale("arts9-max-r2-2c-1024m-4096d.partial", "arts9"));
        assert!(is_stale("arts8-max-r2-2c-1024m-4096d", "arts9"));
        // A key that merely starts with the same letters.
        assert!(is_stale("arts90-max-r2-2c-1024m-4096d", "arts9"));
        assert!(is_stale("unrelated", "arts9"));
    }
}
