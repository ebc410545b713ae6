"""Quotas per key through the official client, on a server of this module's
own started with small ones: `/v1/limits` lists them with what the key
uses, a create past one fails `quota_exceeded` naming it (the client's
create waits for room: here it is told not to), and a paused sandbox gives
its room back."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from conftest import Server

QUOTAS = ("--quota", "sandbox.count=1", "--quota", "volume.count=1")


@pytest.fixture(scope="module")
def small():
    root = Path(tempfile.mkdtemp(prefix="runtime-e2e-quotas-"))
    os.chmod(root, 0o711)
    srv = Server(root, QUOTAS)
    srv.start()
    try:
        yield srv
    finally:
        srv.delete_all_sandboxes()
        srv.stop()
        srv.egress.close()
        srv.kill_leftover_qemu()
        shutil.rmtree(root, ignore_errors=True)


def rows(rt) -> dict:
    return {r["limit"]: r for r in rt.limits.get()["account"]}


def test_a_key_runs_only_what_its_quota_allows(small):
    from withruntime import Runtime
    from withruntime._errors import RuntimeError as RuntimeErr

    with Runtime(api_key=small.admin_key(), base_url=small.url, wait_for_capacity=0) as rt:
        before = rows(rt)
        assert before["sandbox.count"]["max"] == 1
        assert before["sandbox.count"]["used"] == 0
        assert before["sandbox.memory_mib"]["unit"] == "mib"
        first = rt.sandboxes.create(memory_mib=512)
        try:
            assert rows(rt)["sandbox.count"]["used"] == 1
            with pytest.raises(RuntimeErr) as refused:
                rt.sandboxes.create(memory_mib=512)
            assert refused.value.code == "quota_exceeded", refused.value
            assert refused.value.details["limit"] == "sandbox.count"
            assert "sandbox.count" in refused.value.message

            # Paused, it holds no machine: another may run, then its wake
            # is what the quota refuses.
            first.pause()
            second = rt.sandboxes.create(memory_mib=512)
            assert second.exec("echo ran").stdout == "ran\n"
            with pytest.raises(RuntimeErr) as refused:
                first.wake()
            assert refused.value.code == "quota_exceeded"
            rt.sandboxes.delete(second.id)
            first.wake()
            assert first.exec("echo awake").stdout == "awake\n"
        finally:
            rt.sandboxes.delete(first.id)

        vol = rt.volumes.create(size_mib=64)
        try:
            with pytest.raises(RuntimeErr) as refused:
                rt.volumes.create(size_mib=64)
            assert refused.value.details["limit"] == "volume.count"
            assert rows(rt)["volume.mib"]["used"] == 64
        finally:
            rt.volumes.delete(vol["id"])
