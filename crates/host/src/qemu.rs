//! QEMU microVM processes: the command line, spawning it unprivileged in its
//! own session (so it outlives a restart of the server), and ending it.

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::jail::{self, Access, Jail};

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
    /// The directories the files a disk rests on may be in (the server's
    /// images and base images): [`backing_chain`].
    pub disk_roots: &'a [PathBuf],
}

/// Where a guest's RAM lives (docs/memory.md, "Guest RAM").
#[derive(Debug, Clone, Copy)]
pub(crate) enum Ram<'a> {
    /// The machine's own file on the host's memory file system, mapped
    /// shared: what the guest writes lands in the file, so a copy of the
    /// file's data is a copy of its memory, and a capture with
    /// `x-ignore-shared` leaves the RAM out of the state.
    Own(&'a Path),
    /// A frozen RAM file (a fork's copy of its source's, or a template's),
    /// opened read-only and mapped private: writes are copy-on-write, and
    /// the machines started from it share every page none of them wrote.
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
///
/// `tsc=reliable`: under emulation (TCG) the guest's timer ticks come late,
/// so the clocksource watchdog, comparing the TSC (the host's own counter,
/// right) with the ticks (late), marked the TSC unstable and fell back to
/// jiffies: a clock of 4 ms steps and no high-resolution timers, so every
/// timed wait in the guest (poll, sleep, the scheduler's) took whole ticks.
/// Under KVM the guest uses kvm-clock and this changes nothing.
///
/// `tsc=reliable` alone is not enough: the kernel calibrates the TSC
/// against the PIT, which under emulation often fails ("could not calculate
/// TSC khz", then jiffies again). So the host gives the frequency it
/// measured itself ([`host_tsc_khz`]) as `tsc_early_khz`: the guest's TSC
/// is the host's under TCG.
///
/// `no_timer_check`: at boot the kernel waits a few ticks for the timer's
/// interrupt through the IO-APIC and panics ("IO-APIC + timer doesn't
/// work!") when none comes in time, which under emulation on a busy host
/// (twenty guests booting at once on two cores) happened to one boot in
/// seven. The virtual timer works; the check is skipped, as cloud guests
/// do.
pub(crate) const KERNEL_CMDLINE: &str = "console=ttyS0 reboot=t panic=-1 quiet loglevel=4 \
random.trust_cpu=on tsc=reliable no_timer_check";

/// The host's TSC frequency in kHz (rounded to 100 kHz so that it reads
/// the same at every start of the server), or `None` where the TSC is not
/// constant and nonstop or the measurements disagree (the guest then
/// calibrates it itself, as before). Measured once per process, about
/// 150 ms; the CLI asks for it at start.
pub fn host_tsc_khz() -> Option<u64> {
    static KHZ: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *KHZ.get_or_init(measure_tsc_khz)
}

#[cfg(target_arch = "x86_64")]
fn measure_tsc_khz() -> Option<u64> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let flags = cpuinfo.lines().find(|l| l.starts_with("flags"))?;
    let has = |f: &str| flags.split_whitespace().any(|x| x == f);
    if !(has("constant_tsc") && has("nonstop_tsc")) {
        return None;
    }
    let sample = || {
        let (t0, c0) = (std::time::Instant::now(), tsc());
        std::thread::sleep(std::time::Duration::from_millis(50));
        let (c1, dt) = (tsc(), t0.elapsed());
        c1.saturating_sub(c0) as f64 / dt.as_secs_f64() / 1000.0
    };
    let mut khz = [sample(), sample(), sample()];
    khz.sort_by(f64::total_cmp);
    // Three readings within 0.05% of each other, or none is trusted.
    if !(khz[0] > 100_000.0 && (khz[2] - khz[0]) / khz[1] < 5e-4) {
        tracing::warn!(
            ?khz,
            "the host's TSC frequency could not be measured steadily"
        );
        return None;
    }
    Some((khz[1] / 100.0).round() as u64 * 100)
}

#[cfg(target_arch = "x86_64")]
fn tsc() -> u64 {
    // SAFETY: RDTSC has no preconditions on x86_64.
    unsafe { std::arch::x86_64::_rdtsc() }
}

#[cfg(not(target_arch = "x86_64"))]
fn measure_tsc_khz() -> Option<u64> {
    None
}

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
    // Appended to (not truncated at open), so the bound below can cut it
    // while QEMU writes on.
    push("-chardev");
    push(&format!(
        "file,id=serial0,path={},append=on",
        p.console().display()
    ));
    push("-serial");
    push("chardev:serial0");
    push("-kernel");
    a.push(cfg.kernel.as_os_str().to_owned());
    a.push(OsString::from("-initrd"));
    a.push(cfg.initrd.as_os_str().to_owned());
    let mut push = |s: &str| a.push(OsString::from(s));
    push("-append");
    push(&match host_tsc_khz() {
        Some(khz) => format!("{KERNEL_CMDLINE} tsc_early_khz={khz}"),
        None => KERNEL_CMDLINE.to_owned(),
    });
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
    // A QEMU of its own uid also gets a network namespace of its own, with
    // nothing in it: it needs no network (the guest's traffic goes through
    // the server over its channel), so a guest that took over its QEMU
    // reaches no service of the host, not even on loopback.
    let own_net = cfg.run_as.is_some() && own_netns_works();
    // A header the VM's uid wrote names nothing outside the images.
    let chain = if cfg.run_as.is_some() {
        backing_chain(&cfg.paths.overlay(), cfg.disk_roots)?
    } else {
        Vec::new()
    };
    // And a mount namespace whose root shows only what it opens.
    let jail = if own_net {
        let root = jail_root(cfg.paths)?;
        if jail::works(&root) {
            Some(Jail::plan(
                &root,
                &jailed_paths(cfg, chain)?,
                &cfg.paths.dir,
            )?)
        } else {
            None
        }
    } else {
        None
    };
    // SAFETY: setsid, unshare and dup2 are async-signal-safe system calls
    // that touch no memory of the parent; `incoming` is an fd the caller
    // keeps open across spawn.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            if own_net {
                unshare_net()?;
            }
            if let Some(fd) = incoming {
                // dup2 clears close-on-exec on the new descriptor.
                if libc::dup2(fd, INCOMING_FD) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if let Some(jail) = &jail {
                jail.enter()?;
            }
            Ok(())
        });
    }
    // A fresh console for each QEMU (it appends).
    let _ = std::fs::remove_file(cfg.paths.console());
    let child = cmd.spawn()?;
    let pid = child.id();
    keep_console_bounded(pid, cfg.paths);
    // The child is reaped by a thread so it never lingers as a zombie while
    // this server runs; after a restart init reaps it.
    std::thread::spawn(move || {
        let mut child = child;
        let _ = child.wait();
    });
    Ok(pid)
}

/// The empty directory the jails' roots are mounted on (each in its own
/// mount namespace), beside the machines' directories.
fn jail_root(paths: &VmPaths) -> std::io::Result<PathBuf> {
    let root = paths.dir.parent().unwrap_or(Path::new("/")).join(".jail");
    match std::fs::create_dir(&root) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
        _ => {}
    }
    Ok(root)
}

/// The longest chain of backing files a disk may rest on.
const MAX_CHAIN: usize = 64;

/// The files the disk `overlay` rests on, checked before QEMU opens them
/// as root: the overlay's header is the VM's uid's to write, so each file
/// named must be a regular file (not a link) under one of `roots` (the
/// server's images and base images), and the chain at most [`MAX_CHAIN`]
/// long. A header naming anything else (`/dev/sda`, `runtime.db`) refuses
/// the launch.
pub(crate) fn backing_chain(overlay: &Path, roots: &[PathBuf]) -> std::io::Result<Vec<PathBuf>> {
    let mut chain = Vec::new();
    let mut at = overlay.to_owned();
    while let Some(next) = crate::disk_files::backing_file_nofollow(&at)? {
        let next = jail::normal(&next);
        if chain.len() == MAX_CHAIN || !roots.iter().any(|r| next.starts_with(r)) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!(
                    "the disk rests on {}, which is not one of the server's images: refused",
                    next.display()
                ),
            ));
        }
        chain.push(next.clone());
        at = next;
    }
    Ok(chain)
}

/// What a QEMU opens, for its jail ([`crate::jail`]): its directory, its
/// kernel and initrd, `chain` (the files its disk rests on, checked), its
/// volumes, its RAM file, `/dev/kvm` under KVM, and its binary.
fn jailed_paths(
    cfg: &VmConfig<'_>,
    chain: Vec<PathBuf>,
) -> std::io::Result<Vec<(PathBuf, Access)>> {
    let mut out = vec![
        (cfg.paths.dir.clone(), Access::ReadWrite),
        (cfg.kernel.to_owned(), Access::ReadOnly),
        (cfg.initrd.to_owned(), Access::ReadOnly),
    ];
    // QEMU's own directory, when it is not under `/usr` (where it is
    // already shown).
    if let Some(dir) = cfg.qemu.parent().filter(|_| cfg.qemu.is_absolute()) {
        out.push((dir.to_owned(), Access::ReadOnly));
    }
    out.extend(chain.into_iter().map(|f| (f, Access::ReadOnly)));
    for v in cfg.volumes {
        out.push((v.clone(), Access::ReadWrite));
    }
    match cfg.ram {
        Ram::Own(f) => {
            // QEMU would make it (as root, before it drops); made here so
            // that the jail can show it. A failed start removes it.
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .mode(0o600)
                .open(f)?;
            out.push((f.to_owned(), Access::ReadWrite));
        }
        Ram::CopyOf(f) => out.push((f.to_owned(), Access::ReadOnly)),
        Ram::Anon => {}
    }
    if matches!(cfg.accel, Accel::Kvm) {
        out.push((PathBuf::from("/dev/kvm"), Access::ReadWrite));
    }
    Ok(out)
}

/// For a forked child before exec: a network namespace of its own.
pub(crate) fn unshare_net() -> std::io::Result<()> {
    // SAFETY: unshare is an async-signal-safe system call.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Whether a child of this process can have a network namespace of its
/// own (root, and not refused by a container's rules): probed once.
pub(crate) fn own_netns_works() -> bool {
    static WORKS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WORKS.get_or_init(|| {
        let mut probe = Command::new("true");
        probe
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: `unshare_net` makes one system call.
        unsafe {
            probe.pre_exec(unshare_net);
        }
        let works = probe.status().is_ok_and(|s| s.success());
        if !works {
            tracing::warn!(
                "QEMU cannot have a network namespace of its own here: it shares the host's"
            );
        }
        works
    })
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

/// [`is_our_qemu`] off the async workers, for async code: reading a
/// process's command line takes its memory map's lock, which a QEMU
/// mapping or faulting in its RAM on a busy host holds for seconds (twenty
/// busy guests and one restoring stalled every request of the server for
/// 3 to 13 s while a launch checked on its QEMU from a worker).
pub(crate) async fn is_our_qemu_async(pid: u32, dir: &Path) -> bool {
    let dir = dir.to_owned();
    tokio::task::spawn_blocking(move || is_our_qemu(pid, &dir))
        .await
        .unwrap_or(false)
}

/// [`may_be_ours`] off the async workers (see [`is_our_qemu_async`]).
pub(crate) async fn may_be_ours_async(pid: u32, dir: &Path) -> bool {
    let dir = dir.to_owned();
    tokio::task::spawn_blocking(move || may_be_ours(pid, &dir))
        .await
        .unwrap_or(false)
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

/// How many 10 ms steps a kill waits for the process to be gone: a QEMU
/// giving back gigabytes on a loaded machine can take seconds to exit.
const KILL_WAIT_STEPS: u32 = 1000;

/// SIGKILL, then wait (bounded) for the process to disappear.
pub(crate) async fn kill(pid: u32) {
    sigkill(pid);
    for _ in 0..KILL_WAIT_STEPS {
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
    for _ in 0..KILL_WAIT_STEPS {
        if ended(pid) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// The guest writes its serial console as fast as it likes: the file is
/// kept within its bound for as long as QEMU `pid` lives (from its spawn,
/// and again when a restarted server takes the machine up).
pub(crate) fn keep_console_bounded(pid: u32, paths: &VmPaths) {
    let (console, dir) = (paths.console(), paths.dir.clone());
    std::thread::spawn(move || {
        while may_be_ours(pid, &dir) {
            std::thread::sleep(std::time::Duration::from_secs(2));
            if let Err(e) = bound_console(&console) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::debug!(error = %e, "bounding the console failed");
                }
            }
        }
    });
}

/// Largest the serial console file grows before it is cut.
pub(crate) const CONSOLE_MAX: u64 = 4 << 20;
/// What a cut keeps: the console's last bytes.
const CONSOLE_KEEP: u64 = 256 << 10;

/// Cuts the console file at `path` to its last [`CONSOLE_KEEP`] bytes once
/// it is over [`CONSOLE_MAX`]; `true` when it did. QEMU appends, so it goes
/// on writing at the new end (what it writes during the cut may be lost).
pub(crate) fn bound_console(path: &Path) -> std::io::Result<bool> {
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    let len = f.metadata()?.len();
    if len <= CONSOLE_MAX {
        return Ok(false);
    }
    f.seek(SeekFrom::Start(len - CONSOLE_KEEP))?;
    let mut tail = Vec::with_capacity(CONSOLE_KEEP as usize);
    Read::by_ref(&mut f)
        .take(CONSOLE_KEEP)
        .read_to_end(&mut tail)?;
    f.set_len(0)?;
    f.seek(SeekFrom::Start(0))?;
    f.write_all(b"[runtime: earlier console output cut]\n")?;
    f.write_all(&tail)?;
    Ok(true)
}

/// The last `max` bytes of the serial console, as text (only those are read).
pub(crate) fn console_tail(paths: &VmPaths, max: usize) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(paths.console()) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(max as u64);
    let mut data = Vec::new();
    if f.seek(SeekFrom::Start(start)).is_ok() {
        let _ = f.take(max as u64).read_to_end(&mut data);
    }
    String::from_utf8_lossy(&data).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qemu_img(args: &[&str]) {
        let out = Command::new("qemu-img").args(args).output().unwrap();
        assert!(out.status.success(), "{out:?}");
    }

    /// A new qcow2 `file` on `backing`.
    fn overlay(backing: &Path, file: &Path) {
        let (b, f) = (backing.to_str().unwrap(), file.to_str().unwrap());
        qemu_img(&["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", b, f]);
    }

    /// `file`'s header rewritten to name `backing` (nothing else changes).
    fn rebase(file: &Path, backing: &str) {
        let f = file.to_str().unwrap();
        qemu_img(&[
            "rebase", "-u", "-f", "qcow2", "-F", "qcow2", "-b", backing, f,
        ]);
    }

    #[test]
    fn a_disk_rests_only_on_regular_files_under_the_images_and_not_endlessly() {
        let t = std::env::temp_dir().join(format!("rt-chain-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&t);
        let images = t.join("images");
        std::fs::create_dir_all(&images).unwrap();
        let (base, layer, top) = (images.join("base"), images.join("layer"), t.join("top"));
        let p = |f: &Path| f.to_str().unwrap().to_owned();
        qemu_img(&["create", "-q", "-f", "qcow2", &p(&base), "64M"]);
        overlay(&base, &layer);
        overlay(&layer, &top);
        let roots = [images.clone()];
        assert_eq!(
            backing_chain(&top, &roots).unwrap(),
            [layer.clone(), base.clone()]
        );
        // A header naming a file outside the roots, even through `..`.
        rebase(&layer, &format!("{}/../top", images.display()));
        let e = backing_chain(&top, &roots).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
        // A link under the roots is not followed.
        let link = images.join("link");
        std::os::unix::fs::symlink(&base, &link).unwrap();
        rebase(&layer, &p(&link));
        assert!(backing_chain(&top, &roots).is_err());
        // A circle ends at the chain's bound.
        rebase(&base, &p(&layer));
        rebase(&layer, &p(&base));
        let e = backing_chain(&top, &roots).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
        std::fs::remove_dir_all(&t).unwrap();
    }

    #[test]
    fn the_console_is_cut_to_its_tail_beyond_its_bound_and_read_from_the_end() {
        let dir = std::env::temp_dir().join(format!("rt-console-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let paths = VmPaths::new(dir.clone());
        let path = paths.console();
        std::fs::write(&path, vec![b'a'; CONSOLE_MAX as usize]).unwrap();
        assert!(!bound_console(&path).unwrap(), "cut at its bound");
        // Over it: what stays is a mark and the last bytes, the newest last.
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap();
        std::io::Write::write_all(&mut f, b"bz").unwrap();
        assert!(bound_console(&path).unwrap());
        let kept = std::fs::read(&path).unwrap();
        assert!(kept.len() as u64 <= CONSOLE_KEEP + 64, "{}", kept.len());
        assert!(kept.starts_with(b"[runtime: earlier console output cut]\n"));
        assert!(kept.ends_with(b"abz"));
        // A writer that appends goes on at the new end.
        std::io::Write::write_all(&mut f, b"!").unwrap();
        assert!(console_tail(&paths, 4).ends_with("abz!"));
        assert_eq!(console_tail(&paths, 2), "z!");
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(console_tail(&paths, 10), "");
    }
}
