"""What a guest that took over its QEMU would hold: a uid of its own, a
network namespace with nothing in it, and no way to read another machine's
files. Checked on the live QEMU processes of real sandboxes."""
from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="QEMU drops to a uid of its own only when the server is root")


def _uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[2])  # effective
    raise AssertionError(f"no Uid line for {pid}")


def _one_qemu(server, sandbox_id: str) -> int:
    pids = server.qemu_pids(sandbox_id)
    assert len(pids) == 1, pids
    return pids[0]


def test_each_qemu_runs_alone_in_uid_network_and_files(server, runtime):
    a = runtime.sandboxes.create(memory_mib=512)
    b = runtime.sandboxes.create(memory_mib=512)
    try:
        seen = {}
        for sbx in (a, b):
            pid = _one_qemu(server, sbx.id)
            uid = _uid(pid)
            assert uid >= 2_000_000_000, uid
            # A network namespace of its own, holding only a loopback.
            net = os.readlink(f"/proc/{pid}/ns/net")
            assert net != os.readlink("/proc/self/ns/net")
            devices = [line.split(":")[0].strip()
                       for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]]
            assert devices == ["lo"], devices
            # Its directory (QEMU's working directory) and disk are its own.
            vm_dir = Path(os.readlink(f"/proc/{pid}/cwd"))
            st = vm_dir.stat()
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (uid, 0o700), (vm_dir, oct(st.st_mode))
            disks = [f for f in vm_dir.iterdir() if f.suffix == ".qcow2"]
            assert disks, list(vm_dir.iterdir())
            seen[sbx.id] = (uid, net, vm_dir, disks[0])
        assert seen[a.id][0] != seen[b.id][0]
        assert seen[a.id][1] != seen[b.id][1]
        # As b's QEMU's uid, a's directory cannot be listed nor its disk read;
        # as a's own, it can.
        for as_uid, ok in ((seen[b.id][0], False), (seen[a.id][0], True)):
            for argv in (["ls", str(seen[a.id][2])], ["head", "-c", "1", str(seen[a.id][3])]):
                run = subprocess.run(["setpriv", f"--reuid={as_uid}", f"--regid={as_uid}", "--clear-groups",
                                      *argv], capture_output=True, timeout=30)
                assert (run.returncode == 0) == ok, (as_uid, argv, run.stderr)
        # The machine still pauses and wakes (QEMU reopens its disk as its
        # own uid after the migration), in a namespace of its own again.
        a.pause()
        a.wake()
        assert a.exec("echo awake").stdout == "awake\n"
        pid = _one_qemu(server, a.id)
        assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
        # Each uid is a claim of the persisted pool beside the machines'
        # directories, kept across the wake and given back on delete.
        assert _uid(pid) == seen[a.id][0]
        pool = seen[a.id][2].parent / ".uids"
        for sbx in (a, b):
            uid = seen[sbx.id][0]
            assert (pool / "by-owner" / sbx.id).read_text() == str(uid)
            assert (pool / "by-uid" / str(uid)).read_text() == sbx.id
        runtime.sandboxes.delete(b.id)
        deadline = time.monotonic() + 60  # the machine ends after the answer
        while (pool / "by-owner" / b.id).exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not (pool / "by-owner" / b.id).exists()
        assert not (pool / "by-uid" / str(seen[b.id][0])).exists()
        assert (pool / "by-owner" / a.id).exists()
    finally:
        runtime.sandboxes.delete(a.id)
        try:
            runtime.sandboxes.delete(b.id)
        except Exception:
            pass


def _backing(disk: Path) -> str:
    info = subprocess.run(["qemu-img", "info", "-U", "--output=json", str(disk)],
                          capture_output=True, text=True, timeout=30, check=True)
    import json
    return json.loads(info.stdout)["full-backing-filename"]


def test_a_qemu_sees_only_its_own_files_and_its_disk_chain_is_checked(server, runtime):
    a = runtime.sandboxes.create(memory_mib=512)
    b = runtime.sandboxes.create(memory_mib=512)
    try:
        pid = _one_qemu(server, a.id)
        root = Path(f"/proc/{pid}/root")
        vm_a = Path(os.readlink(f"/proc/{pid}/cwd"))
        vm_b = Path(os.readlink(f"/proc/{_one_qemu(server, b.id)}/cwd"))
        inside = lambda p: root / Path(p).relative_to("/")  # noqa: E731
        # Its own directory, disk chain and the system's programs are there,
        # at their host paths...
        assert inside(vm_a).is_dir()
        disk = next(f for f in vm_a.iterdir() if f.suffix == ".qcow2")
        assert inside(_backing(disk)).is_file()
        assert inside("/usr/bin").is_dir()
        # ...nothing else of the host: not the store, not the data directory's
        # other machines, not /etc, not /home.
        for p in (server.data_dir / "runtime.db", vm_b, server.data_dir / "admin.key", "/etc/passwd"):
            assert Path(p).exists(), p  # there on the host
            assert not inside(p).exists(), p
        # The root itself is read-only, the base image too.
        probe = subprocess.run(["nsenter", "-t", str(pid), "-m", "touch", "/x"], capture_output=True, timeout=30)
        assert probe.returncode != 0
        probe = subprocess.run(["nsenter", "-t", str(pid), "-m", "sh", "-c", f"echo >> {_backing(disk)}"],
                               capture_output=True, timeout=30)
        assert probe.returncode != 0 and b"Read-only" in probe.stderr, probe.stderr
        # A disk header naming a file outside the server's images (as a QEMU
        # that took over could write it) refuses the next start, before QEMU
        # opens it as root; the true header starts again.
        a.pause()
        true_base = _backing(disk)
        subprocess.run(["qemu-img", "rebase", "-u", "-f", "qcow2", "-F", "raw",
                        "-b", str(server.data_dir / "runtime.db"), str(disk)], check=True, timeout=30)
        with pytest.raises(Exception) as refused:
            a.wake()
        assert "wake_failed" in str(refused.value), refused.value
        assert runtime.sandboxes.get(a.id).state == "paused"
        assert server.qemu_pids(a.id) == []
        subprocess.run(["qemu-img", "rebase", "-u", "-f", "qcow2", "-F", "qcow2", "-b", true_base, str(disk)],
                       check=True, timeout=30)
        a.wake()
        assert a.exec("echo back").stdout == "back\n"
    finally:
        for sbx in (a, b):
            try:
                runtime.sandboxes.delete(sbx.id)
            except Exception:
                pass
