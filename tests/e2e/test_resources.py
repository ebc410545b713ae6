"""vcpu, memoryMiB and diskMiB reach the guest."""
from __future__ import annotations

import pytest


def guest_resources(sbx):
    nproc = int(sbx.exec("nproc").stdout)
    mem_kib = int(sbx.exec("awk '/^MemTotal:/ {print $2}' /proc/meminfo").stdout)
    disk_mib = int(sbx.exec("df -m / | awk 'NR==2 {print $2}'").stdout)
    return nproc, mem_kib / 1024, disk_mib


def assert_close(actual_mib: float, asked_mib: int, what: str) -> None:
    # The kernel and the filesystem keep some for themselves; never more than asked.
    assert 0.80 * asked_mib <= actual_mib <= asked_mib * 1.01, f"{what}: {actual_mib:.0f} MiB for {asked_mib} MiB"


def test_defaults(sbx):
    assert (sbx.info["vcpu"], sbx.info["memoryMiB"], sbx.info["diskMiB"]) == (2, 4096, 4096)
    nproc, mem, disk = guest_resources(sbx)
    assert nproc == 2
    assert_close(mem, 4096, "memory")
    assert_close(disk, 4096, "disk")


@pytest.mark.parametrize("vcpu,memory,disk", [(1, 1024, 3072), (3, 2048, 6144)])
def test_requested_sizes(server, runtime, vcpu, memory, disk):
    with runtime.sandboxes.create(vcpu=vcpu, memory_mib=memory, disk_mib=disk) as sbx:
        assert (sbx.info["vcpu"], sbx.info["memoryMiB"], sbx.info["diskMiB"]) == (vcpu, memory, disk)
        got = runtime.sandboxes.get(sbx.id).info
        assert (got["vcpu"], got["memoryMiB"], got["diskMiB"]) == (vcpu, memory, disk)
        nproc, mem, disk_seen = guest_resources(sbx)
        assert nproc == vcpu
        assert_close(mem, memory, "memory")
        assert_close(disk_seen, disk, "disk")
        # The free space the guest reports is real (the OS image takes its share of the disk).
        avail = int(sbx.exec("df -m --output=avail /workspace | tail -1").stdout)
        assert avail > 512, f"only {avail} MiB free on a {disk} MiB disk"
        fill = int(avail * 0.9)
        result = sbx.exec(f"fallocate -l {fill}M /workspace/fill && echo ok")
        assert result.stdout == "ok\n", result
