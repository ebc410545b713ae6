//! QEMU microVM processes: the command line, spawning it unprivileged in its
//! own session (so it outlives a restart of the server), and ending it.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Accelerator chosen for this host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    Kvm,
    Tcg,
}

impl std::fmt::Display for Accel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        })
    }
}

/// The CPU model for an accelerator. Part of what a capture must be restored
/// with, so template keys include it.
pub(crate) fn cpu_model(accel: Accel) -> &'static str {
    match accel {
        Accel::Kvm => "host",
        Accel::Tcg => "max",
    }
}

/// Files of one VM, all inside its directory.
#[derive(Debug, Clone)]
pub(crate) struct VmPaths {
    pub dir: PathBuf,
}

impl VmPaths {
    pub(crate) fn new(dir: PathBuf) -> Self {
        VmPaths { dir }
    }
    pub(crate) fn overlay(&self) -> PathBuf {
        self.dir.join("disk.qcow2")
    }
    pub(crate) fn agent_sock(&self) -> PathBuf {
        self.dir.join("agent.sock")
    }
    pub(crate) fn qmp_sock(&self) -> PathBuf {
        self.dir.join("qmp.sock")
    }
    pub(crate) fn console(&self) -> PathBuf {
        self.dir.join("console.log")
    }
    pub(crate) fn qemu_log(&self) -> PathBuf {
        self.dir.join("qemu.log")
    }
    /// A `snapshot` volume's copy for this machine (the `i`th volume).
    pub(crate) fn volume_copy(&self, i: usize) -> PathBuf {
        self.dir.join(format!("volume-{i}.ext4"))
    }
    pub(crate) fn pidfile(&self) -> PathBuf {
        self.dir.join("qemu.pid")
    }
    /// Written by QEMU (as the VM's uid) when the machine is captured.
    pub(crate) fn capture_state(&self) -> PathBuf {
        self.dir.join("capture.state")
    }
    /// The memory and device state of a paused machine.
    pub(crate) fn paused_state(&self) -> PathBuf {
        self.dir.join("paused.state")
    }
    /// The RAM of a paused machine that had a RAM file of its own (its
    /// state then holds the devices only).
    pub(crate) fn paused_ram(&self) -> PathBuf {
        self.dir.join("paused.ram")
    }
    /// There from before QEMU is spawned until the machine is registered
    /// (set up, its volumes mounted): a QEMU found beside it after a crash
    /// of the server never finished starting.
    pub(crate) fn starting(&self) -> PathBuf {
        self.dir.join("starting")
    }
}

pub(crate) struct VmConfig<'a> {
    pub qemu: &'a Path,
    pub kernel: &'a Path,
    pub initrd: &'a Path,
    pub accel: Accel,
    pub vcpu: u32,
    pub memory_mib: u32,
    pub paths: &'a VmPaths,
    /// Run QEMU as this uid/gid (when the server is root).
    pub run_as: Option<(u32, u32)>,
    /// Load the machine's state from this open file (fd 3 in QEMU) instead
    /// of booting: a wake, a fork copy, or a start from a snapshot.
    pub incoming: Option<std::os::fd::RawFd>,
    /// Volume drives after the root disk, with serials `vol0`, `vol1`, ….
    pub volumes: &'a [PathBuf],
    /// Where the guest's RAM lives.
    pub ram: Ram<'a>,
}

/// Where a guest's RAM lives (docs/memory.md, "Guest RAM").
#[derive(Debug, Clone, Copy)]
pub(crate) enum Ram<'a> {
    /// The machine's own file on the host's memory file system, mapped
    /// shared: what the guest writes lands in the file, so a copy of the
    /// file's data is a copy of its memory, and a capture with
    /// `x-ignore-shared` leaves the RAM out of the state.
    Own(&'a Path),
    /// A fork's frozen copy of its source's file, opened read-only and
    /// mapped private: writes are copy-on-write, and the copies of one fork
    /// share every page none of them wrote.
    CopyOf(&'a Path),
    /// Anonymous memory: a machine restored from a state that holds its
    /// whole memory. Loading such a state reads every page, which in a file
    /// would allocate every page of it; anonymous zero pages cost nothing.
    Anon,
}

impl Ram<'_> {
    /// Whether an incoming state holds no RAM (the file does).
    pub(crate) fn file_backed(&self) -> bool {
        !matches!(self, Ram::Anon)
    }
}

/// The id of the RAM backend; part of the machine a capture must be
/// restored into.
const RAM_ID: &str = "ram";

/// The fd number a restoring QEMU reads its state from.
const INCOMING_FD: i32 = 3;
/// What `migrate-incoming` loads a deferred state from.
pub(crate) const INCOMING_URI: &str = "fd:3";

/// The kernel command line. The agent is `/init` of the initramfs; it mounts
/// `/dev/vda` and switches root itself. A panic or reboot ends QEMU.
pub(crate) const KERNEL_CMDLINE: &str =
    "console=ttyS0 reboot=t panic=-1 quiet loglevel=4 random.trust_cpu=on";

pub(crate) fn command_line(cfg: &VmConfig<'_>) -> Vec<OsString> {
    let p = cfg.paths;
    let mut a: Vec<OsString> = Vec::new();
    let mut push = |s: &str| a.push(OsString::from(s));
    // acpi=off: the custom kernel takes its virtio-mmio devices from the
    // command line and keeps the legacy PIC/PIT it programs itself, which
    // boots reliably under TCG (shared/docs/feasibility-qemu.md §9).
    push("-M");
    push(&format!("microvm,acpi=off,memory-backend={RAM_ID}"));
    push("-object");
    push(&match cfg.ram {
        Ram::Anon => format!("memory-backend-ram,id={RAM_ID},size={}M", cfg.memory_mib),
        Ram::Own(file) => format!(
            "memory-backend-file,id={RAM_ID},size={}M,mem-path={},share=on",
            cfg.memory_mib,
            file.display()
        ),
        Ram::CopyOf(file) => format!(
            "memory-backend-file,id={RAM_ID},size={}M,mem-path={},share=off,readonly=on,rom=off",
            cfg.memory_mib,
            file.display()
        ),
    });
    push("-accel");
    match cfg.accel {
        Accel::Kvm => push("kvm"),
        Accel::Tcg => push("tcg,thread=multi,tb-size=256"),
    }
    // Under TCG the default model (qemu64) misleads OpenBLAS into kernels
    // that die with SIGILL (numpy.dot, every matplotlib draw); `max` offers
    // what TCG really emulates.
    push("-cpu");
    push(cpu_model(cfg.accel));
    // Named threads ("CPU 0/TCG"): metering reads the vCPU threads' time.
    push("-name");
    push("runtime,debug-threads=on");
    push("-m");
    push(&format!("{}M", cfg.memory_mib));
    push("-smp");
    push(&cfg.vcpu.to_string());
    for s in [
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
    ] {
        push(s);
    }
    // QEMU's own seccomp filter: no spawning, no obsolete or resource calls.
    // `elevateprivileges=deny` would also forbid the setuid of `-run-with
    // user=`, which happens after the filter is installed; once QEMU has
    // dropped to an unprivileged uid it has no capabilities to regain.
    push("-sandbox");
    push("on,obsolete=deny,spawn=deny,resourcecontrol=deny");
    if let Some((uid, gid)) = cfg.run_as {
        // Files are opened as the server's user, then QEMU drops to its own uid.
        push("-run-with");
        push(&format!("user={uid}:{gid}"));
    }
    push("-serial");
    push(&format!("file:{}", p.console().display()));
    push("-kernel");
    a.push(cfg.kernel.as_os_str().to_owned());
    a.push(OsString::from("-initrd"));
    a.push(cfg.initrd.as_os_str().to_owned());
    let mut push = |s: &str| a.push(OsString::from(s));
    push("-append");
    push(KERNEL_CMDLINE);
    push("-drive");
    push(&format!(
        "file={},if=none,id=root,format=qcow2,discard=unmap,cache=writeback",
        p.overlay().display()
    ));
    push("-device");
    push("virtio-blk-device,drive=root");
    for (i, file) in cfg.volumes.iter().enumerate() {
        push("-drive");
        push(&format!(
            "file={},if=none,id=vol{i},format=raw,discard=unmap,cache=writeback",
            file.display()
        ));
        push("-device");
        push(&format!("virtio-blk-device,drive=vol{i},serial=vol{i}"));
    }
    push("-device");
    push("virtio-rng-device");
    push("-device");
    push("virtio-serial-device,max_ports=2");
    push("-chardev");
    push(&format!(
        "socket,id=agent,path={},server=on,wait=off",
        p.agent_sock().display()
    ));
    push("-device");
    push(&format!(
        "virtserialport,chardev=agent,name={}",
        runtime_proto::PORT_NAME
    ));
    push("-qmp");
    push(&format!(
        "unix:{},server=on,wait=off",
        p.qmp_sock().display()
    ));
    push("-pidfile");
    push(&p.pidfile().display().to_string());
    if cfg.incoming.is_some() {
        push("-incoming");
        if cfg.ram.file_backed() {
            // The state was saved without the RAM the file holds: the load
            // waits for `x-ignore-shared` ([`INCOMING_URI`]).
            push("defer");
        } else {
            push(&format!("fd:{INCOMING_FD}"));
        }
    }
    a
}

/// Starts QEMU in a session of its own, detached from the server, so a
/// restart of the server leaves it running. Returns its pid.
pub(crate) fn spawn(cfg: &VmConfig<'_>) -> std::io::Result<u32> {
    let log = std::fs::File::create(cfg.paths.qemu_log())?;
    let log2 = log.try_clone()?;
    let mut cmd = Command::new(cfg.qemu);
    cmd.args(command_line(cfg))
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(log2))
        .current_dir(&cfg.paths.dir);
    let incoming = cfg.incoming;
    // SAFETY: setsid and dup2 are async-signal-safe and touch no memory of
    // the parent; `incoming` is an fd the caller keeps open across spawn.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some(fd) = incoming {
                // dup2 clears close-on-exec on the new descriptor.
                if libc::dup2(fd, INCOMING_FD) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let child = cmd.spawn()?;
    let pid = child.id();
    // The child is reaped by a thread so it never lingers as a zombie while
    // this server runs; after a restart init reaps it.
    std::thread::spawn(move || {
        let mut child = child;
        let _ = child.wait();
    });
    Ok(pid)
}

/// Whether `pid` is alive and is a QEMU whose command line names `dir`.
pub(crate) fn is_our_qemu(pid: u32, dir: &Path) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let needle = dir.join("agent.sock");
    let needle = needle.to_string_lossy();
    let text = String::from_utf8_lossy(&cmdline);
    text.contains("qemu-system") && text.contains(needle.as_ref())
}

pub(crate) fn read_pid(paths: &VmPaths) -> Option<u32> {
    std::fs::read_to_string(paths.pidfile())
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Whether `pid` may still be the machine in `dir`: its QEMU, or a zombie
/// (a QEMU that exited and whose threads may still hold its files).
pub(crate) fn may_be_ours(pid: u32, dir: &Path) -> bool {
    is_our_qemu(pid, dir) || state(pid) == Some('Z')
}

/// The state letter of `pid` in `/proc/<pid>/stat` (`None`: no such process).
fn state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')').next()?.trim_start().chars().next()
}

/// Whether `pid` has ended: gone, or a zombie left alone. The leader of a
/// killed QEMU turns zombie while its other threads are still exiting and
/// holding the files (the image locks): only a zombie left alone counts.
fn ended(pid: u32) -> bool {
    if !Path::new(&format!("/proc/{pid}")).exists() {
        return true;
    }
    let threads = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| d.count())
        .unwrap_or(0);
    match state(pid) {
        None => true,
        Some('Z') => threads <= 1,
        Some(_) => false,
    }
}

/// SIGKILL, without waiting.
pub(crate) fn sigkill(pid: u32) {
    // 0 and what does not fit would name process groups, not a process.
    let Ok(pid) = i32::try_from(pid) else { return };
    if pid <= 0 {
        return;
    }
    // SAFETY: kill has no memory-safety preconditions.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
}

/// SIGKILL, then wait (bounded) for the process to disappear.
pub(crate) async fn kill(pid: u32) {
    sigkill(pid);
    for _ in 0..200 {
        if ended(pid) {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// [`kill`] for where no runtime runs the wait (a host starting up, a guard
/// dropped).
pub(crate) fn kill_blocking(pid: u32) {
    sigkill(pid);
    for _ in 0..200 {
        if ended(pid) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// The last `max` bytes of the serial console, as text.
pub(crate) fn console_tail(paths: &VmPaths, max: usize) -> String {
    let data = std::fs::read(paths.console()).unwrap_or_default();
    let start = data.len().saturating_sub(max);
    String::from_utf8_lossy(&data[start..]).into_owned()
}
