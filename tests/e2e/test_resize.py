"""`Sandbox.resize`: a restart at a new shape from the sandbox's own disk, and
a larger disk grown while the sandbox runs, through the official client."""
from __future__ import annotations

import pytest
from withruntime import ConflictError, InvalidRequestError


def _mem_total_mib(sbx) -> int:
    out = sbx.exec("awk '/^MemTotal/ {print $2}' /proc/meminfo").stdout
    return int(out) // 1024


def _root_mib(sbx) -> int:
    return int(sbx.exec("df -m --output=size / | tail -1").stdout)


def test_a_resize_restarts_at_the_new_shape_keeping_id_disk_and_name(runtime):
    sbx = runtime.sandboxes.create(vcpu=1, memory_mib=1024, name="e2e-resize-shape")
    try:
        sbx.files.write("/workspace/kept.txt", "still here\n")
        sbx.spawn("sleep 600")
        assert sbx.exec("sleep 0.5; pgrep -x sleep").stdout.strip().isdigit()
        assert sbx.exec("nproc").stdout.strip() == "1"
        assert _mem_total_mib(sbx) < 1024

        sbx.resize(vcpu=2, memory_mib=2048)
        info = sbx.info
        assert (info["state"], info["vcpu"], info["memoryMiB"]) == ("running", 2, 2048), info
        assert info["name"] == "e2e-resize-shape"
        again = runtime.sandboxes.get(sbx.id)
        assert (again.info["vcpu"], again.info["memoryMiB"]) == (2, 2048)

        # The guest booted at the new shape, from the same disk; its programs ended.
        assert sbx.exec("nproc").stdout.strip() == "2"
        assert 1536 < _mem_total_mib(sbx) <= 2048
        assert sbx.files.read("/workspace/kept.txt") == b"still here\n"
        alive = sbx.exec("pgrep -x sleep || true").stdout.strip()
        assert alive == "", f"a sleep outlived the restart: {alive}"

        # A disk only grows; an unknown field is named.
        with pytest.raises(InvalidRequestError) as small:
            sbx.resize(disk_mib=3072)
        assert "diskMiB" in str(small.value)
    finally:
        runtime.sandboxes.delete(sbx.id)


def test_a_larger_disk_grows_while_the_sandbox_runs_and_its_programs_run_on(runtime):
    sbx = runtime.sandboxes.create(vcpu=1, memory_mib=1024, disk_mib=4096)
    try:
        before = _root_mib(sbx)
        assert 3500 < before <= 4096, before
        sbx.spawn("sleep 600")
        pid = sbx.exec("sleep 0.5; pgrep -x sleep").stdout.strip()
        assert pid.isdigit(), pid
        booted = sbx.exec("cat /proc/sys/kernel/random/boot_id").stdout

        sbx.resize(disk_mib=6144, restart=False)
        assert sbx.info["diskMiB"] == 6144
        after = _root_mib(sbx)
        assert after > before + 1800, (before, after)
        # No restart: the same boot, the same process.
        assert sbx.exec("cat /proc/sys/kernel/random/boot_id").stdout == booted
        assert sbx.exec(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"
        # The room is real: a file larger than the old disk's free space fits.
        free_before = before - int(sbx.exec("df -m --output=used / | tail -1").stdout)
        big = max(free_before + 256, 512)
        wrote = sbx.exec(f"fallocate -l {big}M /workspace/big && echo ok")
        assert wrote.stdout.strip() == "ok", wrote

        # More vCPUs need a restart, which restart=False refuses; nothing changed.
        with pytest.raises(ConflictError) as refused:
            sbx.resize(vcpu=2, restart=False)
        assert refused.value.code == "resize_needs_restart"
        assert runtime.sandboxes.get(sbx.id).info["vcpu"] == 1
        assert sbx.exec(f"kill -0 {pid} && echo alive").stdout.strip() == "alive"
    finally:
        runtime.sandboxes.delete(sbx.id)


def test_morphs_boot_of_a_snapshot_at_another_size_resizes_its_copy(runtime):
    """Morph users boot a running machine's snapshot at another size: the
    drop-in starts the copy, then resizes it."""
    from withruntime.morph import MorphCloudClient
    client = MorphCloudClient(runtime=runtime)
    sbx = runtime.sandboxes.create(vcpu=1, memory_mib=1024)
    booted = None
    try:
        sbx.files.write("/workspace/morph.txt", "from the source\n")
        snap = client.instances.get(sbx.id).snapshot()
        booted = client.instances.boot(snap.id, vcpus=2, memory=2048)
        assert booted.id != sbx.id
        assert booted.exec("nproc").stdout.strip() == "2"
        assert booted.exec("cat /workspace/morph.txt").stdout == "from the source\n"
        info = runtime.sandboxes.get(booted.id).info
        assert (info["vcpu"], info["memoryMiB"]) == (2, 2048), info
    finally:
        if booted is not None:
            runtime.sandboxes.delete(booted.id)
        runtime.sandboxes.delete(sbx.id)


def test_a_disk_snapshot_boots_at_another_shape_on_a_larger_disk(runtime):
    sbx = runtime.sandboxes.create(vcpu=1, memory_mib=1024, disk_mib=4096)
    copy = None
    try:
        sbx.files.write("/workspace/saved.txt", "on the saved disk\n")
        snap = sbx.snapshot(mode="disk")
        copy = runtime.sandboxes.create(snapshot=snap["id"], vcpu=2, memory_mib=2048, disk_mib=6144)
        assert (copy.info["vcpu"], copy.info["memoryMiB"], copy.info["diskMiB"]) == (2, 2048, 6144)
        assert copy.exec("nproc").stdout.strip() == "2"
        assert _root_mib(copy) > 5800
        assert copy.files.read("/workspace/saved.txt") == b"on the saved disk\n"
        with pytest.raises(InvalidRequestError) as small:
            runtime.sandboxes.create(snapshot=snap["id"], disk_mib=3072)
        assert "diskMiB" in str(small.value)
    finally:
        if copy is not None:
            runtime.sandboxes.delete(copy.id)
        runtime.sandboxes.delete(sbx.id)
