"""Warm machines (docs/memory.md, "Warm machines") through the official
client, on servers of this module's own: a create takes a machine of the
pool of its image and shape; nothing of one sandbox made from the pool is
visible in another (files, /tmp, processes, what its kernel cached,
entropy); warm machines are never listed nor counted; a create works with
the pool empty or off; 50 creates at once all succeed; no warm machine
outlives a shutdown or a crash of the server; and with the template's
memory shared (`--share-template-memory`) the same isolation holds while
pause, wake and fork keep what a guest held in memory."""
from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import Server, http

# A shape no other module of this server uses: its pool is this module's.
SHAPE = {"vcpu": 1, "memory_mib": 1024}


def metric(srv: Server, name: str) -> float:
    answer = http(srv, "GET", "/metrics")
    assert answer.status == 200, answer
    found = re.search(rf"^{re.escape(name)} (\S+)$", answer.body.decode(), re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


POOL_STARTS = 'runtime_machine_starts_total{from="pool",result="ok"}'


def wait_warm(srv: Server, at_least: int, timeout: float = 280) -> None:
    deadline = time.monotonic() + timeout
    while metric(srv, "runtime_warm_machines") < at_least:
        assert time.monotonic() < deadline, f"the pool did not reach {at_least} warm machines"
        time.sleep(0.5)


def qemu_ids(srv: Server) -> set[str]:
    """The machine ids (directory names) of the QEMUs running in `srv`'s data dir."""
    vms = str(srv.data_dir / "vms") + "/"
    ids = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if "qemu-system" in cmd.split("\0", 1)[0] and state != "Z":
            found = re.search(re.escape(vms) + r"([^/\0]+)/agent\.sock", cmd)
            if found:
                ids.add(found.group(1))
    return ids


def own_server(prefix: str, *args: str):
    root = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(root, 0o711)
    srv = Server(root, args)
    srv.start()
    return srv


def close_server(srv: Server) -> None:
    if srv.proc is not None:
        srv.delete_all_sandboxes()
    srv.stop()
    srv.egress.close()
    srv.kill_leftover_qemu()
    if os.environ.get("RUNTIME_E2E_KEEP"):
        print(f"\n[e2e] kept {srv.root}")
    else:
        shutil.rmtree(srv.root, ignore_errors=True)


@pytest.fixture(scope="module")
def pooled():
    srv = own_server("runtime-e2e-pool-", "--warm-pool", "2")
    try:
        yield srv
    finally:
        close_server(srv)


def client(srv: Server):
    from withruntime import Runtime
    return Runtime(api_key=srv.admin_key(), base_url=srv.url, timeout=600)


def sh(sbx, command: str, user: str | None = None) -> str:
    kwargs = {"user": user} if user else {}
    r = sbx.exec(["bash", "-c", command], **kwargs)
    assert r.exit_code == 0, (command, r.stdout, r.stderr)
    return r.stdout


def disk_count(sbx, mark: str, sync: bool = False) -> int:
    """How many NUL-separated records of the sandbox's root disk hold `mark`."""
    r = sbx.exec(["bash", "-c", ("sync; " if sync else "") + "dev=$(awk '$2==\"/\" {print $1}' /proc/mounts); "
                  f"test -b \"$dev\" && LC_ALL=C grep -c -a -z -F {mark} \"$dev\"; echo rc=$?"],
                 user="root", timeout_ms=600_000)
    count, rc = r.stdout.split()
    assert rc in ("rc=0", "rc=1"), (r.stdout, r.stderr)
    return int(count)


@pytest.fixture(scope="module")
def pooled_shared():
    srv = own_server("runtime-e2e-pool-shared-", "--warm-pool", "2", "--share-template-memory")
    try:
        yield srv
    finally:
        close_server(srv)


@pytest.mark.timeout(900)
def test_sandboxes_from_the_pool_share_nothing(pooled):
    with client(pooled) as rt:
        a, b, _ = share_nothing(rt, pooled)
        rt.sandboxes.delete(a.id)
        rt.sandboxes.delete(b.id)


def qemu_maps(srv: Server, sandbox_id: str) -> str:
    """/proc/<pid>/maps of the QEMU of that sandbox."""
    needle = f"/vms/{sandbox_id}/"
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "qemu-system" in cmd.split("\0", 1)[0] and str(srv.data_dir) in cmd and needle in cmd:
                return (entry / "maps").read_text()
    raise AssertionError(f"no QEMU for {sandbox_id}")


@pytest.mark.timeout(900)
def test_sandboxes_sharing_the_templates_memory_share_nothing_else(pooled_shared):
    """With --share-template-memory (docs/memory.md, "Sharing a template's
    memory"): the same isolation, each QEMU maps the template's memory
    privately, and a pause, a wake and a fork keep what the guest held in
    memory only."""
    srv = pooled_shared
    with client(srv) as rt:
        a, b, mark = share_nothing(rt, srv)
        templates = str(srv.data_dir / "vms" / ".templates") + "/"
        for sbx in (a, b):
            mapped = [line for line in qemu_maps(srv, sbx.id).splitlines()
                      if templates in line and line.endswith("/memory.ram")]
            assert len(mapped) == 1, f"{sbx.id} does not map its template's memory: {mapped}"
            assert mapped[0].split()[1].endswith("p"), f"not a private mapping: {mapped[0]}"
        # What only A's memory holds (a shell variable in a running process,
        # /tmp on tmpfs) goes through a pause and wake, and into a fork.
        sh(a, f"mkdir -p /dev/shm/m && echo {mark} > /dev/shm/m/mark")
        a.pause()
        assert a.state == "paused"
        a.wake()
        assert sh(a, "cat /dev/shm/m/mark") == mark + "\n"
        assert mark in sh(a, "ps -eo args"), "its process went on"
        copy = a.fork()
        assert sh(copy, "cat /dev/shm/m/mark") == mark + "\n"
        assert sh(b, "test ! -e /dev/shm/m/mark && echo none") == "none\n"
        for sbx in (copy, a, b):
            rt.sandboxes.delete(sbx.id)


def share_nothing(rt, pooled: Server):
    """Two sandboxes from the pool, A marked in files, /tmp, a process and
    its disk, B shown to hold none of it; both left running, and the mark."""
    # The first create of the shape restores no template (there is none
    # yet); the pool fills once the template is built.
    rt.sandboxes.delete(rt.sandboxes.create(**SHAPE).id)
    wait_warm(pooled, 2)
    # Warm machines are nobody's: not listed, not counted.
    assert [s.id for s in rt.sandboxes.list()] == []
    used = {r["limit"]: r["used"] for r in rt.limits.get()["account"]}
    assert used["sandbox.count"] == 0, used

    before = metric(pooled, POOL_STARTS)
    a = rt.sandboxes.create(**SHAPE)
    assert metric(pooled, POOL_STARTS) == before + 1, "the create did not take a warm machine"
    assert {s.id for s in rt.sandboxes.list()} == {a.id}
    mark = "pool-" + secrets.token_hex(8)
    # Files in the workspace and /tmp, read back (in the page cache of
    # A's kernel, not synced), and a process that names the mark.
    sh(a, f"echo {mark} > /workspace/{mark}.txt && echo {mark} > /tmp/{mark} && cat /workspace/{mark}.txt /tmp/{mark}")
    sh(a, f"setsid -f bash -c 'sleep 600; : {mark}' </dev/null >/dev/null 2>&1")
    assert mark in sh(a, "ps -eo args")
    a_random = sh(a, "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'")
    a_boot = sh(a, "cat /proc/sys/kernel/random/boot_id")
    a_host = sh(a, "hostname")

    wait_warm(pooled, 1)
    before = metric(pooled, POOL_STARTS)
    b = rt.sandboxes.create(**SHAPE)
    assert metric(pooled, POOL_STARTS) == before + 1, "the create did not take a warm machine"
    assert b.id != a.id
    # Nothing of A: its files, /tmp, its process, anything on B's disk
    # (read through B's kernel, so through its page cache).
    assert sh(b, f"ls /workspace /tmp; test ! -e /workspace/{mark}.txt && test ! -e /tmp/{mark} && echo none").endswith("none\n")
    assert mark not in sh(b, "ps -eo args")
    found = b.exec(["bash", "-c", f"grep -rl {mark} /workspace /tmp /var/tmp /dev/shm /root /home 2>/dev/null"],
                   user="root")
    assert found.stdout == "", found.stdout
    # The whole root disk, read through B's kernel (and so through its
    # page cache): A's bytes are on A's disk only. (The same search in A
    # finds them: it can fail.)
    assert disk_count(a, mark, sync=True) >= 1
    assert disk_count(b, mark) == 0
    # Its own identity and entropy.
    assert sh(b, "hostname") != a_host
    assert sh(b, "hostname").strip() == "sbx-" + b.id[:8]
    assert sh(b, "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'") != a_random
    assert sh(b, "cat /proc/sys/kernel/random/boot_id") != a_boot
    # Its own CA, trusted: the one its egress proxy signs with.
    ca = sh(b, "cat /usr/local/share/ca-certificates/runtime-egress.crt")
    assert "BEGIN CERTIFICATE" in ca
    assert ca != sh(a, "cat /usr/local/share/ca-certificates/runtime-egress.crt")
    assert sh(b, "tail -c 2000 /etc/ssl/certs/ca-certificates.crt").strip().endswith(ca.strip()[-200:])
    # A sees its own things still.
    assert sh(a, f"cat /workspace/{mark}.txt") == mark + "\n"
    return a, b, mark


@pytest.mark.timeout(900)
def test_a_create_works_with_the_pool_empty_or_off(pooled):
    with client(pooled) as rt:
        # A shape nobody used: its pool is empty.
        before = metric(pooled, POOL_STARTS)
        s = rt.sandboxes.create(vcpu=1, memory_mib=768)
        assert s.state == "running"
        assert sh(s, "echo ran") == "ran\n"
        assert metric(pooled, POOL_STARTS) == before
        rt.sandboxes.delete(s.id)
    off = own_server("runtime-e2e-pool-off-", "--warm-pool", "0")
    try:
        with client(off) as rt:
            first = rt.sandboxes.create(**SHAPE)
            rt.sandboxes.delete(first.id)
            s = rt.sandboxes.create(**SHAPE)
            assert sh(s, "echo ran") == "ran\n"
            assert metric(off, POOL_STARTS) == 0
            assert metric(off, "runtime_warm_machines") == 0
            # Only the sandbox's machine runs (and the template's build, a
            # while): none of a pool.
            deadline = time.monotonic() + 120
            while (machines := {i for i in qemu_ids(off) if not i.startswith("template-")}) != {s.id}:
                assert time.monotonic() < deadline, machines
                time.sleep(1)
            time.sleep(5)
            assert {i for i in qemu_ids(off) if not i.startswith("template-")} == {s.id}
            rt.sandboxes.delete(s.id)
    finally:
        close_server(off)


@pytest.mark.timeout(1500)
def test_fifty_creates_at_once_all_succeed(pooled):
    with client(pooled) as rt:
        rt.sandboxes.delete(rt.sandboxes.create(**SHAPE).id)
        wait_warm(pooled, 2)
        def create(_):
            s = rt.sandboxes.create(**SHAPE)
            return s.id, s.state
        with ThreadPoolExecutor(50) as ex:
            made = list(ex.map(create, range(50)))
        try:
            assert len({i for i, _ in made}) == 50
            assert all(state == "running" for _, state in made), made
            listed = {s.id for s in rt.sandboxes.list()}
            assert listed == {i for i, _ in made}
            last = rt.sandboxes.get(made[-1][0])
            assert sh(last, "echo ran") == "ran\n"
        finally:
            with ThreadPoolExecutor(10) as ex:
                list(ex.map(lambda m: rt.sandboxes.delete(m[0]), made))


@pytest.mark.timeout(900)
def test_no_warm_machine_outlives_a_shutdown_or_a_crash(pooled):
    with client(pooled) as rt:
        keep = rt.sandboxes.create(**SHAPE)
        wait_warm(pooled, 2)
        warm = qemu_ids(pooled) - {keep.id}
        assert len(warm) >= 2, warm
        # A shutdown ends them; the sandbox runs on.
        pooled.stop()
        left = qemu_ids(pooled)
        assert keep.id in left
        assert not (warm & left), "warm machines outlived the shutdown"
        pooled.start()
    with client(pooled) as rt:
        assert rt.sandboxes.get(keep.id).state == "running"
        # A new server's pools are made by its creates.
        rt.sandboxes.delete(rt.sandboxes.create(**SHAPE).id)
        wait_warm(pooled, 2)
        warm = qemu_ids(pooled) - {keep.id}
        assert len(warm) >= 2, warm
        # A crash leaves them running; the next start ends them (no record
        # owns them) before it serves.
        pooled.proc.send_signal(signal.SIGKILL)
        pooled.proc.wait(30)
        pooled.proc = None
        assert warm <= qemu_ids(pooled)
        pooled.start()
        # The start SIGKILLs them before it serves; a QEMU giving back 1 GiB
        # on a loaded machine may take a few seconds more to be gone.
        deadline = time.monotonic() + 30
        while warm & qemu_ids(pooled) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not (warm & qemu_ids(pooled)), "warm machines of the crashed server still run"
        assert keep.id in qemu_ids(pooled)
        rt.sandboxes.delete(keep.id)
