#![allow(clippy::unwrap_used, clippy::expect_used)] // test helpers outside #[test] fns panic on purpose
//! The host against real QEMU: a real kernel, the real root filesystem and
//! the real agent (TCG where KVM does not work; never skipped).
//!
//! Needs the static agent (scripts/build.sh) and uses the artifact cache
//! (`RUNTIME_CACHE_DIR`, default `~/.cache/runtime`), building it if empty.

use std::path::PathBuf;
use std::time::Duration;

use runtime_host::*;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn cache() -> PathBuf {
    std::env::var_os("RUNTIME_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            // The same default as `runtime` itself.
            if unsafe { libc::geteuid() } == 0 {
                PathBuf::from("/var/cache/runtime")
            } else {
                PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/runtime")
            }
        })
}

struct TestHost {
    host: QemuHost,
    state: PathBuf,
    _cleanup: Cleanup,
}

/// Even when a test fails: no QEMU left running, no state left on disk,
/// no RAM file left in the host's memory.
struct Cleanup(PathBuf, PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        kill_all(&self.0);
        let _ = std::fs::remove_dir_all(&self.1);
    }
}

fn kill_all(state: &std::path::Path) {
    if let Ok(dirs) = std::fs::read_dir(state) {
        for d in dirs.flatten() {
            if let Ok(pid) = std::fs::read_to_string(d.path().join("qemu.pid")) {
                if let Ok(pid) = pid.trim().parse::<i32>() {
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(state);
}

fn agent_path() -> PathBuf {
    std::env::var_os("RUNTIME_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            workspace().join("target/x86_64-unknown-linux-gnu/release/runtime-agent")
        })
}

fn host() -> TestHost {
    host_with(None)
}

/// A host whose guests' outbound connections go to `outbound` (a stand-in
/// for the egress proxy) when given.
fn host_with(outbound: Option<Arc<dyn Outbound>>) -> TestHost {
    let arts =
        artifacts::ensure(&cache(), &agent_path()).expect("artifacts (run scripts/build.sh first)");
    let state = std::env::temp_dir().join(format!(
        "rt-host-test-{}-{}",
        std::process::id(),
        rand_suffix()
    ));
    let (accel, _) = choose_accel();
    let cfg = QemuConfig {
        state_dir: state.clone(),
        images_dir: state.join("images"),
        qemu_binary: "qemu-system-x86_64".into(),
        artifacts: arts,
        accel,
        boot_timeout: Duration::from_secs(120),
        templates: false,
        share_template_memory: false,
        egress: Default::default(),
        test_crash_at: None,
    };
    let host = match outbound {
        Some(o) => QemuHost::with_outbound(cfg, o),
        None => QemuHost::new(cfg),
    }
    .unwrap();
    let ram = host.ram_dir().to_owned();
    TestHost {
        host,
        _cleanup: Cleanup(state.clone(), ram),
        state,
    }
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

fn spec(id: &str) -> MachineSpec {
    MachineSpec {
        id: id.into(),
        vcpu: 2,
        memory_mib: 1024,
        disk_mib: 4096,
        hostname: "sbx-test".into(),
        guest_ca_pem: None,
        volumes: Vec::new(),
        image: None,
        no_template: false,
    }
}

/// A foreground command as the sandbox user, without stdin or limit.
fn cmd(argv: &[&str]) -> ExecSpec {
    ExecSpec {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        cwd: None,
        env: vec![],
        user: RunAs::Sandbox,
        timeout: None,
        stdin: false,
        pty: None,
        kill_group_on_exit: true,
        trace_files: false,
    }
}

async fn run(
    h: &QemuHost,
    id: &str,
    argv: &[&str],
    user: RunAs,
    timeout: Option<Duration>,
) -> (String, String, ExitStatus) {
    let mut handle = h
        .exec(
            id,
            ExecSpec {
                env: vec![("GREETING".into(), "hi there".into())],
                user,
                timeout,
                ..cmd(argv)
            },
        )
        .await
        .unwrap();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    loop {
        match tokio::time::timeout(Duration::from_secs(60), handle.events.recv())
            .await
            .unwrap_or_else(|_| panic!("exec stalled: {argv:?}"))
        {
            Some(ExecEvent::Stdout(b)) => out.extend(b),
            Some(ExecEvent::Stderr(b)) => err.extend(b),
            Some(ExecEvent::Exited(s)) => {
                return (
                    String::from_utf8_lossy(&out).into(),
                    String::from_utf8_lossy(&err).into(),
                    s,
                )
            }
            None => panic!("link lost during exec"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boots_runs_commands_moves_files_and_cleans_up() {
    let t = host();
    let h = &t.host;
    let id = "00000000-0000-4000-8000-00000000a001";
    h.start(&spec(id))
        .await
        .unwrap_or_else(|e| panic!("start: {e:?}"));

    let (out, _, st) = run(
        h,
        id,
        &[
            "bash",
            "-c",
            "echo $GREETING; id -u; echo $HOME; pwd; nproc; hostname",
        ],
        RunAs::Sandbox,
        None,
    )
    .await;
    assert_eq!(st.code, Some(0));
    assert_eq!(out, "hi there\n1000\n/workspace\n/workspace\n2\nsbx-test\n");

    let (out, _, _) = run(h, id, &["id", "-u"], RunAs::Root, None).await;
    assert_eq!(out.trim(), "0");

    // numpy's BLAS picks its kernels from the CPU the guest is offered: they
    // must run (the default TCG model made numpy.dot die with SIGILL).
    let (out, err, st) = run(
        h,
        id,
        &[
            "python3",
            "-c",
            "import numpy as n; print(int(n.dot(n.ones((64, 64)), n.ones((64, 64)))[0][0]))",
        ],
        RunAs::Sandbox,
        None,
    )
    .await;
    assert_eq!((st.code, out.as_str()), (Some(0), "64\n"), "{err}");

    let (out, _, _) = run(
        h,
        id,
        &[
            "bash",
            "-c",
            "grep MemTotal /proc/meminfo | awk '{print $2}'; df -m / | tail -1 | awk '{print $2}'",
        ],
        RunAs::Sandbox,
        None,
    )
    .await;
    let mut lines = out.lines();
    let mem_kib: u64 = lines.next().unwrap().parse().unwrap();
    let disk_mib: u64 = lines.next().unwrap().parse().unwrap();
    assert!(
        (900_000..=1_048_576).contains(&mem_kib),
        "MemTotal {mem_kib} KiB for 1024 MiB"
    );
    assert!(
        (3800..=4096).contains(&disk_mib),
        "root is {disk_mib} MiB for a 4096 MiB disk"
    );

    let (_, err, st) = run(
        h,
        id,
        &["bash", "-c", "echo oops >&2; exit 3"],
        RunAs::Sandbox,
        None,
    )
    .await;
    assert_eq!((st.code, err.as_str()), (Some(3), "oops\n"));

    let (_, _, st) = run(
        h,
        id,
        &["sleep", "30"],
        RunAs::Sandbox,
        Some(Duration::from_millis(500)),
    )
    .await;
    assert!(st.timed_out && st.code.is_none(), "{st:?}");
    // Timers work in the guest: coreutils `timeout` (alarm/timer_create).
    let (out, _, _) = run(
        h,
        id,
        &["bash", "-c", "timeout 1 sleep 20; echo $?"],
        RunAs::Sandbox,
        Some(Duration::from_secs(15)),
    )
    .await;
    assert_eq!(out, "124\n");

    // A timeout ends the whole process group, not only the shell.
    let (out, _, st) = run(
        h,
        id,
        &["bash", "-c", "echo before; sleep 31; echo after"],
        RunAs::Sandbox,
        Some(Duration::from_millis(1500)),
    )
    .await;
    assert!(st.timed_out && out == "before\n", "{st:?} {out:?}");
    let (out, _, _) = run(
        h,
        id,
        &["bash", "-c", "pgrep -fx 'sleep 31' || echo none"],
        RunAs::Root,
        None,
    )
    .await;
    assert_eq!(out, "none\n");

    let big: Vec<u8> = (0..3 * 1024 * 1024u32).map(|i| (i % 251) as u8).collect();
    h.write_file(
        id,
        "/workspace/d/big.bin",
        Some(0o600),
        RunAs::Sandbox,
        big.clone(),
    )
    .await
    .unwrap();
    assert_eq!(
        h.read_file(id, "/workspace/d/big.bin", RunAs::Sandbox)
            .await
            .unwrap(),
        big
    );
    match h
        .file_op(
            id,
            FileOp::Stat {
                path: "/workspace/d/big.bin".into(),
            },
            RunAs::Sandbox,
        )
        .await
        .unwrap()
    {
        FileOpResult::Stat(Some(e)) => assert_eq!(
            (e.size, e.mode & 0o777, e.kind),
            (big.len() as u64, 0o600, EntryKind::File)
        ),
        other => panic!("{other:?}"),
    }
    let err = h
        .read_file(id, "/etc/shadow", RunAs::Sandbox)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            HostError::Guest {
                failure: GuestFailure::PermissionDenied,
                ..
            }
        ),
        "{err:?}"
    );
    let err = h
        .read_file(id, "/workspace/missing", RunAs::Sandbox)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            HostError::Guest {
                failure: GuestFailure::FileNotFound,
                ..
            }
        ),
        "{err:?}"
    );

    // Metering: the host measures the vCPU threads' CPU time. An idle guest
    // uses little of it; a busy loop adds at least its share and never more
    // than the machine's vCPUs could have used in that wall time. (The
    // guest's own accounting cannot be the yardstick under TCG: it also counts
    // time its vCPU thread waited for a host core.)
    let before = h.cpu_time(id).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle = h.cpu_time(id).await.unwrap() - before;
    let before = h.cpu_time(id).await.unwrap();
    let wall = std::time::Instant::now();
    let (_, _, st) = run(
        h,
        id,
        &[
            "bash",
            "-c",
            "i=0; while [ $i -lt 30000 ]; do i=$((i+1)); done",
        ],
        RunAs::Sandbox,
        None,
    )
    .await;
    let (busy, wall) = (h.cpu_time(id).await.unwrap() - before, wall.elapsed());
    assert_eq!(st.code, Some(0));
    assert!(
        idle < Duration::from_millis(1500),
        "an idle guest used {idle:?} in 2 s"
    );
    assert!(
        busy >= idle + Duration::from_millis(200),
        "a busy loop metered {busy:?} (idle {idle:?})"
    );
    assert!(
        busy <= wall * 2 + Duration::from_millis(500),
        "{busy:?} of CPU in {wall:?} on 2 vCPUs"
    );

    // QEMU runs unprivileged, under its seccomp filter, inside a memory limit.
    let pid = h.qemu_pid(id).unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid_line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    let is_root = unsafe { libc::geteuid() } == 0;
    if is_root {
        assert!(
            !uid_line.split_whitespace().skip(1).any(|u| u == "0"),
            "QEMU runs as root: {uid_line}"
        );
        assert!(
            status.lines().any(|l| l == "Seccomp:\t2"),
            "no seccomp filter"
        );
        if let Some(limit) = h.memory_limit(id) {
            assert_eq!(limit, (1024 + 512) * 1024 * 1024);
        }
    }
    assert!(
        h.console(id).contains("agent: channel open"),
        "the serial console is kept: {}",
        h.console(id)
    );

    h.destroy(id).await.unwrap();
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists()
            || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|s| s.contains(") Z"))
                .unwrap_or(true)
    );
    assert!(!t.state.join(id).exists(), "the VM directory is removed");
    let err = h.exec(id, cmd(&["true"])).await.unwrap_err();
    assert!(matches!(err, HostError::NoSuchMachine { .. }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_host_process_recovers_a_running_machine() {
    let t = host();
    let id = "00000000-0000-4000-8000-00000000a002";
    t.host
        .start(&spec(id))
        .await
        .unwrap_or_else(|e| panic!("start: {e:?}"));
    let (_, _, st) = run(
        &t.host,
        id,
        &[
            "bash",
            "-c",
            "echo kept > /tmp/mem-only; sleep 600 >/dev/null 2>&1 &",
        ],
        RunAs::Sandbox,
        None,
    )
    .await;
    assert_eq!(st.code, Some(0));
    let pid = t.host.qemu_pid(id).unwrap();
    // A process still running when the server goes away.
    let spec_exec = cmd(&["bash", "-c", "sleep 3; echo late"]);
    let handle = t.host.exec(id, spec_exec).await.unwrap();
    let (token, guest_pid) = (handle.token, handle.pid);
    drop(handle);
    let TestHost {
        host,
        state,
        _cleanup,
    } = t;
    drop(host);

    // As after a restart of the server: a fresh host on the same state dir.
    let (accel, _) = choose_accel();
    let arts = artifacts::ensure(&cache(), &agent_path()).unwrap();
    let h2 = QemuHost::new(QemuConfig {
        state_dir: state.clone(),
        images_dir: state.join("images"),
        qemu_binary: "qemu-system-x86_64".into(),
        artifacts: arts,
        accel,
        boot_timeout: Duration::from_secs(60),
        templates: false,
        share_template_memory: false,
        egress: Default::default(),
        test_crash_at: None,
    })
    .unwrap();
    assert!(h2.recover(&spec(id)).await.unwrap());
    assert_eq!(h2.qemu_pid(id), Some(pid));
    let (out, _, _) = run(&h2, id, &["cat", "/tmp/mem-only"], RunAs::Sandbox, None).await;
    assert_eq!(out, "kept\n");
    let mut again = h2.attach(id, token).await.unwrap();
    assert_eq!(again.pid, guest_pid);
    let mut out = Vec::new();
    loop {
        match tokio::time::timeout(Duration::from_secs(30), again.events.recv())
            .await
            .unwrap()
        {
            Some(ExecEvent::Stdout(b)) => out.extend(b),
            Some(ExecEvent::Exited(st)) => {
                assert_eq!(st.code, Some(0));
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(out, b"late\n");
    assert!(!h2
        .recover(&spec("00000000-0000-4000-8000-00000000a0ff"))
        .await
        .unwrap());
    h2.destroy(id).await.unwrap();
}

const COUNTER: &str = "setsid bash -c 'x=0; while true; do x=$((x+1)); echo $x > /tmp/counter.new; mv -f /tmp/counter.new /tmp/counter; sleep 0.2; done' >/dev/null 2>&1 < /dev/null & sleep 0.5; echo started";

async fn counter(h: &QemuHost, id: &str) -> u64 {
    let (out, err, _) = run(h, id, &["cat", "/tmp/counter"], RunAs::Sandbox, None).await;
    out.trim()
        .parse()
        .unwrap_or_else(|_| panic!("counter: {out:?} {err:?}"))
}

/// Volumes: data written by one machine is there for the next; a
/// `snapshot` view is the machine's own (the file is untouched); mounts
/// survive a pause; the sandbox user owns the volume's root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_outlive_machines_and_snapshot_views_stay_private() {
    let t = host();
    let h = &t.host;
    let dir = t.state.join("volumes");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("v.ext4");
    volume::create_volume_file(&file, 64).unwrap();
    let sh = |c: &str| vec!["bash".to_owned(), "-c".to_owned(), c.to_owned()];
    let vol = |path: &str, snapshot: bool| VolumeDrive {
        file: file.clone(),
        path: path.into(),
        snapshot,
    };

    let a = "00000000-0000-4000-8000-00000000c001";
    h.start(&MachineSpec {
        volumes: vec![vol("/data", false)],
        ..spec(a)
    })
    .await
    .unwrap_or_else(|e| panic!("start: {e:?}"));
    let w = sh("echo from-a > /data/f && stat -c %U /data && findmnt -no OPTIONS /data");
    let w: Vec<&str> = w.iter().map(String::as_str).collect();
    let (out, err, st) = run(h, a, &w, RunAs::Sandbox, None).await;
    assert_eq!(st.code, Some(0), "{out} {err}");
    assert!(out.starts_with("runtime\n"), "{out}");
    assert!(out.contains("nosuid") && out.contains("nodev"), "{out}");
    h.destroy(a).await.unwrap();
    assert!(file.exists(), "the volume outlives its machine");

    let b = "00000000-0000-4000-8000-00000000c002";
    let spec_b = MachineSpec {
        volumes: vec![vol("/data", false), vol("/workspace/view", true)],
        ..spec(b)
    };
    h.start(&spec_b)
        .await
        .unwrap_or_else(|e| panic!("start: {e:?}"));
    let (out, err, st) = run(
        h,
        b,
        &[
            "bash",
            "-c",
            "cat /data/f /workspace/view/f && echo mine > /workspace/view/g && echo kept > /data/h",
        ],
        RunAs::Sandbox,
        None,
    )
    .await;
    assert_eq!(st.code, Some(0), "{err}");
    assert_eq!(out, "from-a\nfrom-a\n");
    h.pause(b).await.unwrap();
    h.wake(&spec_b)
        .await
        .unwrap_or_else(|e| panic!("wake: {e:?}"));
    let (out, _, st) = run(
        h,
        b,
        &["bash", "-c", "cat /workspace/view/g /data/h; ls /data"],
        RunAs::Sandbox,
        None,
    )
    .await;
    assert_eq!(st.code, Some(0));
    assert_eq!(
        out, "mine\nkept\nf\nh\nlost+found\n",
        "the view's write is not in the volume"
    );
    h.destroy(b).await.unwrap();
    assert!(!t.state.join(b).exists(), "the view went with its machine");

    // A third machine sees h (rw) but never g (written to a view).
    let c = "00000000-0000-4000-8000-00000000c003";
    h.start(&MachineSpec {
        volumes: vec![vol("/mnt/v", false)],
        ..spec(c)
    })
    .await
    .unwrap_or_else(|e| panic!("start: {e:?}"));
    let (out, _, _) = run(h, c, &["bash", "-c", "ls /mnt/v"], RunAs::Sandbox, None).await;
    assert_eq!(out, "f\nh\nlost+found\n");
    h.destroy(c).await.unwrap();
}

/// A custom image: a captured disk becomes the disk new machines boot on
/// (an overlay on it); the base image is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_captured_disk_serves_as_an_image_for_new_machines() {
    let t = host();
    let h = &t.host;
    let a = "00000000-0000-4000-8000-00000000c101";
    h.start(&spec(a))
        .await
        .unwrap_or_else(|e| panic!("start: {e:?}"));
    let (_, err, st) = run(
        h,
        a,
        &["bash", "-c", "echo baked > /opt/marker && sync"],
        RunAs::Root,
        None,
    )
    .await;
    assert_eq!(st.code, Some(0), "{err}");
    // Under the host's images, the only place an image's disk may be.
    let layer = t.state.join("images").join("layer");
    std::fs::create_dir_all(t.state.join("images")).unwrap();
    h.capture(a, &layer, false).await.unwrap();
    h.destroy(a).await.unwrap();
    let disk = layer.join("disk.qcow2");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&layer, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&disk, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let image = ImageDisk {
        key: "test".into(),
        disk: disk.clone(),
    };
    let b = "00000000-0000-4000-8000-00000000c102";
    h.start(&MachineSpec {
        image: Some(image),
        ..spec(b)
    })
    .await
    .unwrap_or_else(|e| panic!("start: {e:?}"));
    let (out, _, _) = run(
        h,
        b,
        &["bash", "-c", "cat /opt/marker; echo more >> /opt/marker"],
        RunAs::Root,
        None,
    )
    .await;
    assert_eq!(out, "baked\n");
    h.destroy(b).await.unwrap();
    // A machine on the default image has no marker.
    let c = "00000000-0000-4000-8000-00000000c103";
    h.start(&spec(c))
        .await
        .unwrap_or_else(|e| panic!("start: {e:?}"));
    let (out, _, _) = run(
        h,
        c,
        &[
            "bash",
            "-c",
            "test -e /opt/marker && echo present || echo absent",
        ],
        RunAs::Root,
        None,
    )
    .await;
    assert_eq!(out, "absent\n");
    h.destroy(c).await.unwrap();
    assert!(disk.exists(), "the image outlives the machines on it");
}

/// `RUNTIME_RAM_DIR` puts the guests' RAM files elsewhere (here a disk
/// directory, as on a host whose /dev/shm is too small); machines run,
/// pause and wake the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ram_files_can_live_in_a_chosen_directory() {
    let chosen = std::env::temp_dir().join(format!("rt-ram-dir-{}", rand_suffix()));
    // Each test runs in a process of its own (nextest): the variable is ours.
    std::env::set_var("RUNTIME_RAM_DIR", &chosen);
    let t = host();
    let h = &t.host;
    assert_eq!(h.ram_dir(), chosen.as_path());
    let id = "00000000-0000-4000-8000-00000000a010";
    h.start(&spec(id))
        .await
        .unwrap_or_else(|e| panic!("start: {e:?}"));
    let own = h.ram_file(id).expect("its own RAM file");
    assert!(own.starts_with(&chosen), "{}", own.display());
    run(
        h,
        id,
        &["bash", "-c", "echo kept > /tmp/m"],
        RunAs::Sandbox,
        None,
    )
    .await;
    h.pause(id).await.unwrap();
    h.wake(&spec(id))
        .await
        .unwrap_or_else(|e| panic!("wake: {e:?}"));
    let (out, _, _) = run(h, id, &["cat", "/tmp/m"], RunAs::Sandbox, None).await;
    assert_eq!(out, "kept\n");
    h.destroy(id).await.unwrap();
    assert!(!own.exists());
    let _ = std::fs::remove_dir_all(&chosen);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_wake_keep_memory_processes_and_files() {
    let t = host();
    let h = &t.host;
    let id = "00000000-0000-4000-8000-00000000a003";
    h.start(&spec(id))
        .await
        .unwrap_or_else(|e| panic!("start: {e:?}"));
    run(h, id, &["bash", "-c", COUNTER], RunAs::Sandbox, None).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    for round in 0..3 {
        let before = counter(h, id).await;
        h.write_file(
            id,
            &format!("/workspace/f{round}"),
            None,
            RunAs::Sandbox,
            vec![b'x'; 10],
        )
        .await
        .unwrap();
        let pid = h.qemu_pid(id).unwrap();
        let own = h.ram_file(id).expect("its own RAM file");
        h.pause(id).await.unwrap();
        assert!(h.qemu_pid(id).is_none(), "no machine while paused");
        // The memory went to the data directory (the pages the guest
        // touched), the state holds the devices only, the RAM file is gone.
        let dir = t.state.join(id);
        let ram = std::fs::metadata(dir.join("paused.ram")).expect("paused.ram");
        assert_eq!(ram.len(), 1024 << 20, "the whole address space, sparse");
        let state = std::fs::metadata(dir.join("paused.state")).unwrap().len();
        assert!(
            state < 4 << 20,
            "the state leaves the RAM out: {state} bytes"
        );
        assert!(!own.exists(), "no host memory held while paused");
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}/cmdline")).exists()
                || std::fs::read(format!("/proc/{pid}/cmdline"))
                    .map(|c| c.is_empty())
                    .unwrap_or(true),
            "QEMU ended"
        );
        h.wake(&spec(id))
            .await
            .unwrap_or_else(|e| panic!("wake: {e:?}"));
        let after = counter(h, id).await;
        // The loop's variable lives only in memory: it goes on from where it was.
        assert!(
            after >= before && after < before + 50,
            "round {round}: {before} -> {after}"
        );
    }
    let (out, _, _) = run(
        h,
        id,
        &[
            "bash",
            "-c",
            "ls /workspace | grep -c '^f'; pgrep -c -f 'x=\\$'",
        ],
        RunAs::Sandbox,
        None,
    )
    .await;
    assert_eq!(out.lines().next(), Some("3"), "{out}");
    h.destroy(id).await.unwrap();
}

/// A pause whose state cannot be kept (here the rename onto `paused.state`
/// fails) leaves the machine running and tracked, its memory and processes
/// as they were; a later pause and wake work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_that_cannot_keep_its_state_leaves_the_machine_running() {
    let t = host();
    let h = &t.host;
    let id = "00000000-0000-4000-8000-00000000a011";
    h.start(&spec(id))
        .await
        .unwrap_or_else(|e| panic!("start: {e:?}"));
    run(h, id, &["bash", "-c", COUNTER], RunAs::Sandbox, None).await;
    let pid = h.qemu_pid(id).unwrap();
    let in_the_way = t.state.join(id).join("paused.state");
    std::fs::create_dir_all(in_the_way.join("x")).unwrap();
    let err = h.pause(id).await.unwrap_err();
    assert!(
        !matches!(err, HostError::NoSuchMachine { .. }),
        "the machine ran on: {err:?}"
    );
    assert_eq!(h.qemu_pid(id), Some(pid), "the machine is tracked");
    let before = counter(h, id).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(counter(h, id).await > before, "the guest runs");
    for leftover in ["capture.state", "paused.ram"] {
        assert!(!t.state.join(id).join(leftover).exists(), "{leftover}");
    }
    std::fs::remove_dir_all(&in_the_way).unwrap();
    h.pause(id).await.unwrap();
    h.wake(&spec(id))
        .await
        .unwrap_or_else(|e| panic!("wake: {e:?}"));
    assert!(counter(h, id).await >= before);
    h.destroy(id).await.unwrap();
}

/// Talks to QEMU's monitor: each command's answer, in order.
fn qmp(sock: &std::path::Path, commands: &[&str]) -> Vec<String> {
    use std::io::{BufRead, Write};
    let s = std::os::unix::net::UnixStream::connect(sock).unwrap();
    let mut rd = std::io::BufReader::new(s.try_clone().unwrap());
    let mut wr = s;
    let mut line = String::new();
    rd.read_line(&mut line).unwrap();
    let mut answers = Vec::new();
    for c in std::iter::once("qmp_capabilities").chain(commands.iter().copied()) {
        writeln!(wr, "{{\"execute\": \"{c}\"}}").unwrap();
        loop {
            line.clear();
            rd.read_line(&mut line).unwrap();
            if !line.contains("\"event\"") {
                break;
            }
        }
        answers.push(line.trim().to_owned());
    }
    answers.remove(0);
    answers
}

/// A server that died during a capture (a pause, a snapshot) left its
/// machine stopped: the next one runs it on and adopts it, memory and all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_left_stopped_by_a_crash_mid_capture_is_recovered_running() {
    let t = host();
    let id = "00000000-0000-4000-8000-00000000a012";
    t.host
        .start(&spec(id))
        .await
        .unwrap_or_else(|e| panic!("start: {e:?}"));
    run(
        &t.host,
        id,
        &["bash", "-c", "echo kept > /tmp/mem-only"],
        RunAs::Sandbox,
        None,
    )
    .await;
    let pid = t.host.qemu_pid(id).unwrap();
    let sock = t.state.join(id).join("qmp.sock");
    let answers = qmp(&sock, &["stop", "query-status"]);
    assert!(answers[1].contains("\"paused\""), "{answers:?}");
    std::fs::write(t.state.join(id).join("capture.state"), b"cut short").unwrap();
    let TestHost {
        host,
        state,
        _cleanup,
    } = t;
    drop(host);

    let (accel, _) = choose_accel();
    let arts = artifacts::ensure(&cache(), &agent_path()).unwrap();
    let h2 = QemuHost::new(QemuConfig {
        state_dir: state.clone(),
        images_dir: state.join("images"),
        qemu_binary: "qemu-system-x86_64".into(),
        artifacts: arts,
        accel,
        boot_timeout: Duration::from_secs(60),
        templates: false,
        share_template_memory: false,
        egress: Default::default(),
        test_crash_at: None,
    })
    .unwrap();
    assert!(
        h2.recover(&spec(id)).await.unwrap(),
        "the machine is adopted"
    );
    assert_eq!(h2.qemu_pid(id), Some(pid));
    let (out, _, _) = run(&h2, id, &["cat", "/tmp/mem-only"], RunAs::Sandbox, None).await;
    assert_eq!(out, "kept\n");
    assert!(!state.join(id).join("capture.state").exists());
    h2.destroy(id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn captures_restore_into_copies_that_diverge() {
    let t = host();
    let h = &t.host;
    let src = "00000000-0000-4000-8000-00000000a004";
    h.start(&spec(src))
        .await
        .unwrap_or_else(|e| panic!("start: {e:?}"));
    run(h, src, &["bash", "-c", COUNTER], RunAs::Sandbox, None).await;
    h.write_file(
        src,
        "/workspace/shared",
        None,
        RunAs::Sandbox,
        b"from source".to_vec(),
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(600)).await;
    // Where the server puts a fork's capture (another file system).
    let cap = h.scratch_dir().expect("a scratch dir").join("capture-1");
    h.capture(src, &cap, true).await.unwrap();
    let copies = [
        "00000000-0000-4000-8000-00000000a005",
        "00000000-0000-4000-8000-00000000a006",
    ];
    for c in copies {
        h.restore(
            &MachineSpec {
                hostname: format!("copy-{}", &c[c.len() - 1..]),
                ..spec(c)
            },
            &cap,
        )
        .await
        .unwrap_or_else(|e| panic!("restore: {e:?}"));
    }
    // The source has its own RAM file; the capture holds a copy of it and
    // a state without the RAM; the copies map that copy privately and own
    // no file.
    let own = h.ram_file(src).expect("the source's own RAM file");
    assert!(own.exists());
    assert!(cap.join("memory.ram").exists());
    let state_len = std::fs::metadata(cap.join("memory.state")).unwrap().len();
    assert!(
        state_len < 4 << 20,
        "the state leaves the RAM out: {state_len} bytes"
    );
    for c in copies {
        assert_eq!(h.ram_file(c), None, "a copy maps its source's file");
    }
    // The copies no longer need the capture.
    std::fs::remove_dir_all(&cap).unwrap();
    // Memory diverges: /tmp is the guest's memory (tmpfs).
    run(
        h,
        copies[0],
        &["bash", "-c", "echo zero > /tmp/only-here"],
        RunAs::Sandbox,
        None,
    )
    .await;
    for other in [src, copies[1]] {
        let (out, _, code) = run(
            h,
            other,
            &["bash", "-c", "cat /tmp/only-here 2>&1"],
            RunAs::Sandbox,
            None,
        )
        .await;
        assert_ne!(code.code, Some(0), "{other} sees a copy's memory: {out}");
    }
    let base = counter(h, src).await;
    for (i, c) in copies.iter().enumerate() {
        assert!(counter(h, c).await >= 1, "the copy's memory-only loop runs");
        assert_eq!(
            h.read_file(c, "/workspace/shared", RunAs::Sandbox)
                .await
                .unwrap(),
            b"from source"
        );
        h.write_file(
            c,
            "/workspace/mine",
            None,
            RunAs::Sandbox,
            format!("copy {i}").into_bytes(),
        )
        .await
        .unwrap();
    }
    assert!(counter(h, src).await >= base, "the source runs on");
    assert_eq!(
        h.read_file(copies[0], "/workspace/mine", RunAs::Sandbox)
            .await
            .unwrap(),
        b"copy 0"
    );
    assert_eq!(
        h.read_file(copies[1], "/workspace/mine", RunAs::Sandbox)
            .await
            .unwrap(),
        b"copy 1"
    );
    assert!(
        h.read_file(src, "/workspace/mine", RunAs::Sandbox)
            .await
            .is_err(),
        "the source does not see the copies' files"
    );
    let (out, _, _) = run(h, copies[1], &["hostname"], RunAs::Sandbox, None).await;
    assert_eq!(out.trim(), "copy-6");

    // A capture of a copy (no RAM file of its own) carries the whole
    // memory in its state, and restores into a machine with its own file.
    let cap2 = t.state.join("capture-2");
    h.capture(copies[0], &cap2, true).await.unwrap();
    assert!(!cap2.join("memory.ram").exists());
    let g = "00000000-0000-4000-8000-00000000a008";
    h.restore(&spec(g), &cap2)
        .await
        .unwrap_or_else(|e| panic!("restore of a copy's capture: {e:?}"));
    let (out, _, _) = run(
        h,
        g,
        &["cat", "/tmp/only-here", "/workspace/mine"],
        RunAs::Sandbox,
        None,
    )
    .await;
    assert_eq!(out, "zero\ncopy 0");
    assert_eq!(
        h.ram_file(g),
        None,
        "a whole-memory state loads into anonymous memory"
    );
    let grand = counter(h, g).await;
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert!(counter(h, g).await > grand, "the copy's copy runs its loop");
    h.destroy(g).await.unwrap();

    // A disk-only capture boots a fresh machine with the files but not the processes.
    let disk = t.state.join("capture-disk");
    h.capture(src, &disk, false).await.unwrap();
    let d = "00000000-0000-4000-8000-00000000a007";
    h.restore(&spec(d), &disk)
        .await
        .unwrap_or_else(|e| panic!("restore disk: {e:?}"));
    assert_eq!(
        h.read_file(d, "/workspace/shared", RunAs::Sandbox)
            .await
            .unwrap(),
        b"from source"
    );
    let err = h
        .read_file(d, "/tmp/counter", RunAs::Sandbox)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            HostError::Guest {
                failure: GuestFailure::FileNotFound,
                ..
            }
        ),
        "{err:?}"
    );
    for id in [src, copies[0], copies[1], d] {
        h.destroy(id).await.unwrap();
    }
    assert!(!own.exists(), "a machine's RAM file goes with it");
}

/// A host with templates (sharing their memory or not) whose first machine
/// `first` booted and whose template of that shape is built.
async fn host_with_a_template(share: bool, first: &str) -> (QemuHost, Cleanup, PathBuf) {
    let arts = artifacts::ensure(&cache(), &agent_path()).unwrap();
    let state = std::env::temp_dir().join(format!(
        "rt-host-tpl-{}-{}",
        std::process::id(),
        rand_suffix()
    ));
    let mut cleanup = Cleanup(state.clone(), PathBuf::new());
    let (accel, _) = choose_accel();
    let h = QemuHost::new(QemuConfig {
        state_dir: state.clone(),
        images_dir: state.join("images"),
        qemu_binary: "qemu-system-x86_64".into(),
        artifacts: arts,
        accel,
        boot_timeout: Duration::from_secs(120),
        templates: true,
        share_template_memory: share,
        egress: Default::default(),
        test_crash_at: None,
    })
    .unwrap();
    cleanup.1 = h.ram_dir().to_owned();
    h.start(&spec(first))
        .await
        .unwrap_or_else(|e| panic!("start: {e:?}"));
    // The first start of a shape boots and builds its template beside.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    // (Built in `<key>.partial`, renamed to `<key>` once whole.)
    let built = || {
        std::fs::read_dir(state.join(".templates"))
            .ok()
            .and_then(|d| {
                d.flatten()
                    .find(|e| {
                        !e.file_name().to_string_lossy().ends_with(".partial")
                            && e.path().join("memory.state").exists()
                    })
                    .map(|e| e.path())
            })
    };
    let template = loop {
        if let Some(t) = built() {
            break t;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no template was built"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    (h, cleanup, template)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn starts_restore_a_template_with_fresh_entropy() {
    let first = "00000000-0000-4000-8000-00000000b001";
    let (h, _cleanup, _) = host_with_a_template(false, first).await;
    let copies = [
        "00000000-0000-4000-8000-00000000b002",
        "00000000-0000-4000-8000-00000000b003",
    ];
    let mut randoms = Vec::new();
    for c in copies {
        h.start(&MachineSpec {
            hostname: format!("h{}", &c[c.len() - 1..]),
            ..spec(c)
        })
        .await
        .unwrap_or_else(|e| panic!("start: {e:?}"));
        let (out, _, st) = run(&h, c, &["bash", "-c", "cat /proc/sys/kernel/random/boot_id; head -c 16 /dev/urandom | od -An -tx1; hostname; echo hi > /workspace/own"], RunAs::Sandbox, None).await;
        assert_eq!(st.code, Some(0));
        let lines: Vec<&str> = out.lines().collect();
        randoms.push(lines[1].to_string());
        assert_eq!(lines[2], format!("h{}", &c[c.len() - 1..]));
    }
    // Both copies come from the pre-booted memory: their consoles show no
    // boot (the agent logs "channel open" once, when it starts as PID 1).
    assert!(h.console(first).contains("agent: channel open"));
    for c in copies {
        assert!(
            !h.console(c).contains("agent: channel open"),
            "{c} booted: {}",
            h.console(c)
        );
    }
    // ...yet do not share their random numbers.
    assert_ne!(randoms[0], randoms[1]);
    for id in [first, copies[0], copies[1]] {
        h.destroy(id).await.unwrap();
    }
}

/// With `share_template_memory`, a template's restores map its RAM file
/// privately: no file of their own, what one writes is its own, and a
/// pause (its whole memory through the migration) and a wake keep it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_template_restores_map_its_memory_and_keep_their_own_writes() {
    let first = "00000000-0000-4000-8000-00000000b011";
    let (h, _cleanup, template) = host_with_a_template(true, first).await;
    let ram = template.join("memory.ram");
    assert!(
        h.ram_file(first).is_some(),
        "a boot has a RAM file of its own"
    );
    let copies = [
        "00000000-0000-4000-8000-00000000b012",
        "00000000-0000-4000-8000-00000000b013",
    ];
    for c in copies {
        h.start(&spec(c))
            .await
            .unwrap_or_else(|e| panic!("start: {e:?}"));
        assert_eq!(h.ram_file(c), None, "{c} copied the template's memory");
        let maps =
            std::fs::read_to_string(format!("/proc/{}/maps", h.qemu_pid(c).unwrap())).unwrap();
        let line = maps
            .lines()
            .find(|l| l.ends_with(ram.to_str().unwrap()))
            .unwrap_or_else(|| panic!("{c} does not map {}:\n{maps}", ram.display()));
        assert!(
            line.split_whitespace().nth(1).unwrap().ends_with('p'),
            "a private mapping: {line}"
        );
        let (_, _, st) = run(
            &h,
            c,
            &[
                "bash",
                "-c",
                &format!("echo {c} > /tmp/mine; echo 3 > /proc/sys/vm/drop_caches"),
            ],
            RunAs::Root,
            None,
        )
        .await;
        assert_eq!(st.code, Some(0));
    }
    for c in copies {
        let (out, _, _) = run(&h, c, &["cat", "/tmp/mine"], RunAs::Sandbox, None).await;
        assert_eq!(out.trim(), c, "each keeps what it wrote");
    }
    let before = std::fs::metadata(&ram).unwrap().modified().unwrap();
    let c = copies[0];
    h.pause(c).await.unwrap();
    h.wake(&spec(c))
        .await
        .unwrap_or_else(|e| panic!("wake: {e:?}"));
    let (out, _, _) = run(&h, c, &["cat", "/tmp/mine"], RunAs::Sandbox, None).await;
    assert_eq!(out.trim(), c, "a pause and wake keep its memory");
    assert_eq!(
        std::fs::metadata(&ram).unwrap().modified().unwrap(),
        before,
        "no machine wrote the template's memory"
    );
    for id in [first, copies[0], copies[1]] {
        h.destroy(id).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exec_streaming_across_a_pause_loses_nothing() {
    let t = host();
    let h = &t.host;
    let id = "00000000-0000-4000-8000-00000000c001";
    h.start(&spec(id))
        .await
        .unwrap_or_else(|e| panic!("start: {e:?}"));
    let mut handle = h
        .exec(
            id,
            cmd(&[
                "bash",
                "-c",
                "for i in $(seq 1 40); do echo $i; sleep 0.05; done",
            ]),
        )
        .await
        .unwrap();
    let token = handle.token;
    let mut out = Vec::new();
    while out.len() < 6 {
        match handle.events.recv().await {
            Some(ExecEvent::Stdout(b)) => out.extend(b),
            other => panic!("{other:?}"),
        }
    }
    let phase1 = out.len();
    h.pause(id).await.unwrap();
    // Whatever reached the host before the pause is still delivered.
    while let Some(ev) = handle.events.recv().await {
        match ev {
            ExecEvent::Stdout(b) => out.extend(b),
            other => panic!("{other:?}"),
        }
    }
    h.wake(&spec(id))
        .await
        .unwrap_or_else(|e| panic!("wake: {e:?}"));
    let phase2 = out.len();
    let mut again = h.attach(id, token).await.unwrap();
    loop {
        match tokio::time::timeout(Duration::from_secs(30), again.events.recv())
            .await
            .unwrap()
        {
            Some(ExecEvent::Stdout(b)) => out.extend(b),
            Some(ExecEvent::Exited(st)) => {
                assert_eq!(st.code, Some(0));
                break;
            }
            other => panic!("{other:?}"),
        }
    }
    let expected: String = (1..=40).map(|i| format!("{i}\n")).collect();
    assert_eq!(
        String::from_utf8_lossy(&out),
        expected,
        "split at bytes {phase1} (pause) and {phase2} (wake); console: {}",
        h.console(id)
    );
    h.destroy(id).await.unwrap();
}

// ---------------------------------------------------------------------------
// TCP tunnels over the agent channel: into the guest (`connect`) and out of
// it (the agent's proxy port, handed to an `Outbound` handler).

use sha2::{Digest, Sha256};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

/// A public test CA (its key is thrown away): the guest must trust it.
const TEST_CA: &str = "-----BEGIN CERTIFICATE-----
MIIBmjCCAUGgAwIBAgIUMcnGyhA0pFq93j9sPkvdWKbCDwEwCgYIKoZIzj0EAwIw
IjEgMB4GA1UEAwwXcnVudGltZSB0ZXN0IHNhbmRib3ggQ0EwIBcNMjYxMTI5MTQz
MDMwWhgPMjEyNjExMDUxNDMwMzBaMCIxIDAeBgNVBAMMF3J1bnRpbWUgdGVzdCBz
YW5kYm94IENBMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEIyWUp1ekF5zCGMxK
/UCyrYj0GVm1WYMSFoLszhmUOwmM1xW8Vl9E+/6bUWznUFXEl7z9JhM1wCNIqapv
P+jQZ6NTMFEwHQYDVR0OBBYEFM4S1J+QOuSq3cGK2t6PjajVWX4YMB8GA1UdIwQY
MBaAFM4S1J+QOuSq3cGK2t6PjajVWX4YMA8GA1UdEwEB/wQFMAMBAf8wCgYIKoZI
zj0EAwIDRwAwRAIgGVesHc7jjmMYVLbjVkShaAMHTpIJkO6QVdGqJLtIoPsCIFo+
QMTXcEV8TWd82nB+MxEwTaG32AqtBY85pfg1h5d7
-----END CERTIFICATE-----
";

const CANNED_BODY: &str = "hello from the egress test\n";

/// The bytes `SOURCE n` sends: deterministic, not periodic at 2^k.
fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| ((i * 7) ^ (i >> 11)) as u8).collect()
}

fn sha_hex(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

/// A stand-in for the egress proxy, driven by the first line a guest
/// process sends: an HTTP proxy request (canned answer), `ECHO`, `SINK`
/// (answers the sha256 of the rest), `SOURCE n`, or `HOLD` (writes until
/// the guest stops taking bytes, counting them).
#[derive(Default)]
struct TestEgress {
    held: Arc<AtomicUsize>,
    accepted: Arc<AtomicUsize>,
    sandboxes: Arc<std::sync::Mutex<Vec<String>>>,
}

impl Outbound for TestEgress {
    fn accept(&self, sandbox_id: &str, conn: DuplexStream) {
        self.accepted.fetch_add(1, Ordering::SeqCst);
        self.sandboxes.lock().unwrap().push(sandbox_id.to_owned());
        let held = self.held.clone();
        tokio::spawn(async move {
            let (rd, mut wr) = tokio::io::split(conn);
            let mut rd = BufReader::new(rd);
            let mut line = String::new();
            if rd.read_line(&mut line).await.is_err() {
                return;
            }
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["GET", url, _] => {
                    // The rest of the request head.
                    let mut l = String::new();
                    while rd.read_line(&mut l).await.map(|n| n > 2).unwrap_or(false) {
                        l.clear();
                    }
                    let body = format!("{CANNED_BODY}{url}\n");
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = wr.write_all(answer.as_bytes()).await;
                    let _ = wr.shutdown().await;
                }
                ["ECHO"] => {
                    let _ = tokio::io::copy(&mut rd, &mut wr).await;
                    let _ = wr.shutdown().await;
                }
                ["SINK"] => {
                    let mut h = Sha256::new();
                    let mut buf = vec![0u8; 64 * 1024];
                    let mut n = 0usize;
                    loop {
                        match rd.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(k) => {
                                h.update(&buf[..k]);
                                n += k;
                            }
                        }
                    }
                    let _ = wr
                        .write_all(format!("{} {n}\n", hex::encode(h.finalize())).as_bytes())
                        .await;
                    let _ = wr.shutdown().await;
                }
                ["SOURCE", n] => {
                    let data = pattern(n.parse().unwrap());
                    let _ = wr.write_all(&data).await;
                    let _ = wr.shutdown().await;
                }
                ["HOLD"] => {
                    let chunk = vec![b'h'; 16 * 1024];
                    while wr.write_all(&chunk).await.is_ok() {
                        held.fetch_add(chunk.len(), Ordering::SeqCst);
                    }
                }
                _ => {}
            }
        });
    }
}

/// Guest-side helpers: servers for `connect` and clients of the proxy.
const GUEST_PY: &str = r#"
import hashlib, os, socket, sys, threading

def recv_all(s):
    out = bytearray()
    while True:
        b = s.recv(1 << 16)
        if not b:
            return bytes(out)
        out += b

def serve(port, handler):
    l = socket.socket()
    l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    l.bind(("127.0.0.1", port))
    l.listen(64)
    while True:
        c, _ = l.accept()
        threading.Thread(target=handler, args=(c,), daemon=True).start()

def sink(c):
    data = recv_all(c)
    c.sendall(("%s %d\n" % (hashlib.sha256(data).hexdigest(), len(data))).encode())
    c.close()

def echo(c):
    while True:
        b = c.recv(1 << 16)
        if not b:
            break
        c.sendall(b)
    c.close()

def proxy():
    return socket.create_connection(("127.0.0.1", 10800))

mode = sys.argv[1]
if mode == "servers":
    threading.Thread(target=serve, args=(8001, sink), daemon=True).start()
    serve(8002, echo)
elif mode == "sink":
    data = os.urandom(int(sys.argv[2]))
    s = proxy()
    s.sendall(b"SINK\n" + data)
    s.shutdown(socket.SHUT_WR)
    print(hashlib.sha256(data).hexdigest(), len(data))
    print(recv_all(s).decode().strip())
elif mode == "source":
    s = proxy()
    s.sendall(b"SOURCE %s\n" % sys.argv[2].encode())
    s.shutdown(socket.SHUT_WR)
    data = recv_all(s)
    print(hashlib.sha256(data).hexdigest(), len(data))
elif mode == "echo":
    n, size = int(sys.argv[2]), int(sys.argv[3])
    ok = []
    def one():
        data = os.urandom(size)
        s = proxy()
        t = threading.Thread(target=lambda: (s.sendall(b"ECHO\n" + data), s.shutdown(socket.SHUT_WR)))
        t.start()
        back = recv_all(s)
        t.join()
        ok.append(back == data)
    ts = [threading.Thread(target=one) for _ in range(n)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    print(sum(ok), len(ok))
elif mode == "hold":
    s = proxy()
    s.sendall(b"HOLD\n")
    print("holding", flush=True)
    threading.Event().wait()
elif mode == "chat":
    s = proxy()
    s.sendall(b"ECHO\n")
    for line in sys.stdin:
        s.sendall(line.encode())
        print(s.recv(1 << 16).decode(), end="", flush=True)
elif mode == "direct":
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect(("1.1.1.1", 80))
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        print("answer", s.recv(100))
    except OSError as e:
        print("errno", e.errno)
"#;

async fn put_guest_py(h: &QemuHost, id: &str) {
    h.write_file(
        id,
        "/workspace/t.py",
        None,
        RunAs::Sandbox,
        GUEST_PY.as_bytes().to_vec(),
    )
    .await
    .unwrap();
}

/// Starts a long-lived guest process (its own session, output logged):
/// the starting shell leaves it running (no group kill on exit).
async fn background(h: &QemuHost, id: &str, cmd_line: &str) {
    let mut handle = h
        .exec(
            id,
            ExecSpec {
                kill_group_on_exit: false,
                trace_files: false,
                ..cmd(&[
                    "bash",
                    "-c",
                    &format!("setsid {cmd_line} >>/tmp/background.log 2>&1 < /dev/null &"),
                ])
            },
        )
        .await
        .unwrap();
    loop {
        match handle.events.recv().await {
            Some(ExecEvent::Exited(st)) => {
                assert_eq!(st.code, Some(0));
                return;
            }
            Some(_) => {}
            None => panic!("link lost"),
        }
    }
}

/// Connects once the guest's server listens (each refusal is a real answer).
async fn connect_when_up(h: &QemuHost, id: &str, port: u16) -> DuplexStream {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        match h.connect(id, port).await {
            Ok(c) => return c,
            Err(HostError::Guest {
                failure: GuestFailure::ConnectionRefused,
                ..
            }) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => {
                let (out, _, _) = run(
                    h,
                    id,
                    &["bash", "-c", "cat /tmp/background.log; ps -ef"],
                    RunAs::Root,
                    None,
                )
                .await;
                panic!("connect {port}: {e:?}\n{out}")
            }
        }
    }
}

/// Sends `data` into the guest's sink server and returns its answer.
async fn sink_in_guest(h: &QemuHost, id: &str, data: &[u8]) -> String {
    let c = h.connect(id, 8001).await.unwrap();
    let (mut rd, mut wr) = tokio::io::split(c);
    let data = data.to_vec();
    let writer = tokio::spawn(async move {
        wr.write_all(&data).await.unwrap();
        wr.shutdown().await.unwrap();
    });
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(120), rd.read_to_string(&mut answer))
        .await
        .expect("the sink answered in time")
        .unwrap();
    writer.await.unwrap();
    answer.trim().to_owned()
}

/// An HTTP/1.0 GET into the guest: the whole answer, read until EOF.
async fn http_get(h: &QemuHost, id: &str, port: u16, path: &str) -> Vec<u8> {
    let mut c = h.connect(id, port).await.unwrap();
    c.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut all = Vec::new();
    tokio::time::timeout(Duration::from_secs(120), c.read_to_end(&mut all))
        .await
        .expect("the answer ended in time")
        .unwrap();
    let head_end = all
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP head: {:?}", String::from_utf8_lossy(&all)));
    assert!(all.starts_with(b"HTTP/1.0 200"), "{:?}", &all[..head_end]);
    all.split_off(head_end + 4)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnels_carry_tcp_into_and_out_of_the_guest() {
    let egress = Arc::new(TestEgress::default());
    let t = host_with(Some(egress.clone()));
    let h = &t.host;
    let id = "00000000-0000-4000-8000-00000000d001";
    h.start(&MachineSpec {
        guest_ca_pem: Some(TEST_CA.into()),
        ..spec(id)
    })
    .await
    .unwrap_or_else(|e| panic!("start: {e:?}"));
    put_guest_py(h, id).await;
    const BIG: usize = 20 << 20;

    // Into the guest: a file from a web server started there.
    let (_, err, st) = run(
        h,
        id,
        &[
            "bash",
            "-c",
            "mkdir -p /tmp/www && head -c 20971520 /dev/urandom > /tmp/www/big && \
             head -c 1048576 /dev/urandom > /tmp/www/small",
        ],
        RunAs::Sandbox,
        None,
    )
    .await;
    assert_eq!(st.code, Some(0), "{err}");
    let (out, _, _) = run(
        h,
        id,
        &["sha256sum", "/tmp/www/big", "/tmp/www/small"],
        RunAs::Sandbox,
        None,
    )
    .await;
    let sums: Vec<&str> = out.lines().map(|l| &l[..64]).collect();
    background(
        h,
        id,
        "python3 -m http.server 8000 --bind 127.0.0.1 --directory /tmp/www",
    )
    .await;
    background(h, id, "python3 /workspace/t.py servers").await;
    drop(connect_when_up(h, id, 8000).await);
    drop(connect_when_up(h, id, 8001).await);
    let started = std::time::Instant::now();
    let big = http_get(h, id, 8000, "/big").await;
    assert_eq!((big.len(), sha_hex(&big).as_str()), (BIG, sums[0]));
    eprintln!(
        "20 MiB out of the guest via connect: {:?}",
        started.elapsed()
    );

    // Into the guest, 20 MiB the other way; the host's half-close is the
    // sink's end of input (read until EOF), its answer comes back after it.
    let data = pattern(BIG);
    let started = std::time::Instant::now();
    assert_eq!(
        sink_in_guest(h, id, &data).await,
        format!("{} {BIG}", sha_hex(&data))
    );
    eprintln!("20 MiB into the guest via connect: {:?}", started.elapsed());

    // 20 connections at once.
    let gets = (0..20).map(|_| http_get(h, id, 8000, "/small"));
    for body in futures_join_all(gets).await {
        assert_eq!(sha_hex(&body), sums[1]);
    }

    // Nothing listens: refused.
    let err = h.connect(id, 8999).await.unwrap_err();
    assert!(
        matches!(
            err,
            HostError::Guest {
                failure: GuestFailure::ConnectionRefused,
                ..
            }
        ),
        "{err:?}"
    );

    // Out of the guest: curl through the environment's proxy, and a plain
    // socket to the proxy port, both reach the handler with raw bytes.
    let (out, err, st) = run(
        h,
        id,
        &["curl", "-sS", "http://example.com/"],
        RunAs::Sandbox,
        Some(Duration::from_secs(60)),
    )
    .await;
    assert_eq!(
        (st.code, out.as_str()),
        (Some(0), "hello from the egress test\nhttp://example.com/\n"),
        "{err}"
    );
    assert_eq!(egress.sandboxes.lock().unwrap()[0], id);
    let started = std::time::Instant::now();
    let (out, err, st) = run(
        h,
        id,
        &["python3", "/workspace/t.py", "sink", &BIG.to_string()],
        RunAs::Sandbox,
        Some(Duration::from_secs(180)),
    )
    .await;
    assert_eq!(st.code, Some(0), "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert_eq!(lines[0], lines[1], "the host received other bytes");
    eprintln!("20 MiB out via the proxy: {:?}", started.elapsed());
    let started = std::time::Instant::now();
    let (out, err, st) = run(
        h,
        id,
        &["python3", "/workspace/t.py", "source", &BIG.to_string()],
        RunAs::Sandbox,
        Some(Duration::from_secs(180)),
    )
    .await;
    assert_eq!(st.code, Some(0), "{err}");
    assert_eq!(out.trim(), format!("{} {BIG}", sha_hex(&pattern(BIG))));
    eprintln!("20 MiB in via the proxy: {:?}", started.elapsed());
    let (out, err, st) = run(
        h,
        id,
        &["python3", "/workspace/t.py", "echo", "20", "200000"],
        RunAs::Sandbox,
        Some(Duration::from_secs(120)),
    )
    .await;
    assert_eq!((st.code, out.trim()), (Some(0), "20 20"), "{err}");

    // Flow control: a guest process that never reads its socket holds at
    // most its socket buffers and one window; an exec and another tunnel
    // go on meanwhile.
    let mut holder = h
        .exec(id, cmd(&["python3", "/workspace/t.py", "hold"]))
        .await
        .unwrap();
    match holder.events.recv().await {
        Some(ExecEvent::Stdout(b)) => assert_eq!(b, b"holding\n"),
        other => panic!("{other:?}"),
    }
    // Wait until the handler is stuck (its count stops growing).
    let mut last = usize::MAX;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = egress.held.load(Ordering::SeqCst);
        if now == last && now > 0 {
            break;
        }
        last = now;
    }
    let held = egress.held.load(Ordering::SeqCst);
    eprintln!("a guest that never reads took {held} bytes");
    assert!(
        held < 16 << 20,
        "{held} bytes were taken from a writer the guest never reads"
    );
    let (out, _, st) = run(h, id, &["echo", "still here"], RunAs::Sandbox, None).await;
    assert_eq!((st.code, out.as_str()), (Some(0), "still here\n"));
    let body = http_get(h, id, 8000, "/small").await;
    assert_eq!(sha_hex(&body), sums[1]);
    assert_eq!(
        egress.held.load(Ordering::SeqCst),
        held,
        "the stuck tunnel stays stuck"
    );
    holder.control.send(ExecControl::Signal(9)).await.unwrap();
    while let Some(ev) = holder.events.recv().await {
        if matches!(ev, ExecEvent::Exited(_)) {
            break;
        }
    }

    // No other way out, even for root: loopback and the dummy interface of
    // transparent egress (docs/network.md), whose every TCP connection goes
    // to the host's egress like the proxy's do.
    let (out, _, _) = run(
        h,
        id,
        &[
            "bash",
            "-c",
            "ls /sys/class/net; ip -o link 2>/dev/null | awk '{print $2}'",
        ],
        RunAs::Root,
        None,
    )
    .await;
    assert!(
        out.lines().any(|l| l == "lo")
            && out
                .lines()
                .all(|l| ["lo", "lo:", "runtime0", "runtime0:"].contains(&l)),
        "{out}"
    );
    let accepted = egress.accepted.load(Ordering::SeqCst);
    let (out, _, _) = run(
        h,
        id,
        &["python3", "/workspace/t.py", "direct"],
        RunAs::Root,
        None,
    )
    .await;
    // This test's egress answers no `CONNECT`: the program gets nothing.
    assert!(!out.contains("HTTP"), "{out}");
    assert!(
        egress.accepted.load(Ordering::SeqCst) > accepted,
        "a direct connection went to the host's egress: {out}"
    );
    let accepted = egress.accepted.load(Ordering::SeqCst);
    let (_, _, st) = run(
        h,
        id,
        &[
            "env",
            "-i",
            "PATH=/usr/bin:/bin",
            "curl",
            "-sS",
            "--max-time",
            "10",
            "http://example.com/",
        ],
        RunAs::Root,
        None,
    )
    .await;
    assert_ne!(st.code, Some(0));
    assert!(egress.accepted.load(Ordering::SeqCst) > accepted);

    // The sandbox's CA is trusted system-wide.
    let (out, _, _) = run(
        h,
        id,
        &[
            "bash",
            "-c",
            "echo $SSL_CERT_FILE; echo $NODE_EXTRA_CA_CERTS; \
             grep -c 'BEGIN CERTIFICATE' /etc/ssl/certs/ca-certificates.crt.system $SSL_CERT_FILE; \
             tail -n 11 $SSL_CERT_FILE",
        ],
        RunAs::Sandbox,
        None,
    )
    .await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], "/etc/ssl/certs/ca-certificates.crt");
    assert_eq!(
        lines[1],
        "/usr/local/share/ca-certificates/runtime-egress.crt"
    );
    let count = |l: &str| l.rsplit(':').next().unwrap().parse::<u32>().unwrap();
    assert_eq!(count(lines[3]), count(lines[2]) + 1, "{out}");
    assert_eq!(lines[4..].join("\n") + "\n", TEST_CA);
    h.destroy(id).await.unwrap();
}

/// Joins futures on this task (no extra crate).
async fn futures_join_all<F: std::future::Future>(fs: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut set = Vec::new();
    for f in fs {
        set.push(f);
    }
    let mut out = Vec::new();
    let mut pinned: Vec<_> = set.into_iter().map(Box::pin).collect();
    let mut results: Vec<Option<F::Output>> = (0..pinned.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, f) in pinned.iter_mut().enumerate() {
            if results[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => results[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    for r in results {
        out.push(r.unwrap());
    }
    out
}

/// Writes `msg` and reads it back from an echo tunnel.
async fn echo_roundtrip(c: &mut DuplexStream, msg: &[u8]) {
    c.write_all(msg).await.unwrap();
    let mut back = vec![0u8; msg.len()];
    tokio::time::timeout(Duration::from_secs(30), c.read_exact(&mut back))
        .await
        .expect("echo in time")
        .unwrap();
    assert_eq!(back, msg);
}

/// One line through the guest's `chat` process (stdin -> proxy -> echo).
async fn chat(handle: &mut ExecHandle, line: &str) {
    handle
        .control
        .send(ExecControl::Stdin(line.as_bytes().to_vec()))
        .await
        .unwrap();
    let mut got = Vec::new();
    while got.len() < line.len() {
        match tokio::time::timeout(Duration::from_secs(30), handle.events.recv())
            .await
            .expect("chat answered in time")
        {
            Some(ExecEvent::Stdout(b)) => got.extend(b),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(String::from_utf8_lossy(&got), line);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tunnels_survive_a_capture_and_end_with_a_pause() {
    let egress = Arc::new(TestEgress::default());
    let t = host_with(Some(egress.clone()));
    let h = &t.host;
    let id = "00000000-0000-4000-8000-00000000d002";
    h.start(&spec(id))
        .await
        .unwrap_or_else(|e| panic!("start: {e:?}"));
    put_guest_py(h, id).await;
    background(h, id, "python3 /workspace/t.py servers").await;
    let mut echo = connect_when_up(h, id, 8002).await;
    echo_roundtrip(&mut echo, b"one").await;
    let mut talker = h
        .exec(
            id,
            ExecSpec {
                stdin: true,
                ..cmd(&["python3", "/workspace/t.py", "chat"])
            },
        )
        .await
        .unwrap();
    chat(&mut talker, "a\n").await;

    // A capture of the running machine (a fork, a snapshot) stops it for a
    // moment: both tunnels go on afterwards.
    let cap = t.state.join("capture-tunnels");
    h.capture(id, &cap, true).await.unwrap();
    echo_roundtrip(&mut echo, b"two").await;
    chat(&mut talker, "b\n").await;

    // A copy has the servers in its memory but none of the source's
    // tunnels; its own work.
    let copy = "00000000-0000-4000-8000-00000000d003";
    h.restore(&spec(copy), &cap)
        .await
        .unwrap_or_else(|e| panic!("restore: {e:?}"));
    let mut copy_echo = connect_when_up(h, copy, 8002).await;
    echo_roundtrip(&mut copy_echo, b"copy").await;
    echo_roundtrip(&mut echo, b"three").await;
    let accepted = egress.accepted.load(Ordering::SeqCst);
    h.destroy(copy).await.unwrap();
    let mut rest = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(10), copy_echo.read_to_end(&mut rest))
        .await
        .expect("a destroyed machine's tunnel ends");
    assert!(r.is_err() || rest.is_empty(), "{r:?}");

    // A pause ends every tunnel (the caller sees the end), a wake serves new ones.
    h.pause(id).await.unwrap();
    let mut rest = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(10), echo.read_to_end(&mut rest))
        .await
        .expect("a paused machine's tunnel ends");
    assert!(r.is_err() || rest.is_empty(), "{r:?}");
    h.wake(&spec(id))
        .await
        .unwrap_or_else(|e| panic!("wake: {e:?}"));
    let mut again = h.connect(id, 8002).await.unwrap();
    echo_roundtrip(&mut again, b"after wake").await;
    let (out, err, st) = run(
        h,
        id,
        &["curl", "-sS", "http://example.com/after"],
        RunAs::Sandbox,
        Some(Duration::from_secs(60)),
    )
    .await;
    assert_eq!(
        (st.code, out.as_str()),
        (
            Some(0),
            "hello from the egress test\nhttp://example.com/after\n"
        ),
        "{err}"
    );
    assert!(egress.accepted.load(Ordering::SeqCst) > accepted);
    h.destroy(id).await.unwrap();
}
