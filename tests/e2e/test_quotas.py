"""Quotas per key through the official client, on a server of this module's
own started with small ones: `/v1/limits` lists them with what the key
uses, a create past one fails `quota_exceeded` naming it (the client's
create waits for room: here it is told not to), and a paused sandbox gives
its room back."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import BINARY, Server

QUOTAS = ("--quota", "sandbox.count=1", "--quota", "volume.count=1", "--quota", "image.builds=1")


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


def keys_cli(srv: Server, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BINARY), "keys", *args, "--data-dir", str(srv.data_dir)],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def test_a_keys_own_quotas_are_set_by_the_operator_while_the_server_runs(small):
    """`runtime keys quota` gives one key its own quotas in place of the
    server's, higher or lower; the running server holds that key to them on
    its next request, and the other keys keep the server's."""
    from withruntime import Runtime
    from withruntime._errors import RuntimeError as RuntimeErr

    key = small.create_key(name="team-" + os.urandom(3).hex())
    key_id = key.split("_")[1]
    bad = keys_cli(small, "quota", key_id, "sandbox.count=2", "sandbox.cores=4", "volume.count=lots")
    assert bad.returncode != 0
    assert "sandbox.cores" in bad.stderr and "lots" in bad.stderr, bad.stderr
    done = keys_cli(small, "quota", key_id, "sandbox.count=2", "volume.count=0")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["sandbox.count=2", "volume.count=0"], done.stdout
    listed = [json.loads(line) for line in keys_cli(small, "list", "--json").stdout.splitlines()]
    assert next(k for k in listed if k["id"] == key_id)["quotas"] == {"sandbox.count": 2, "volume.count": 0}

    with Runtime(api_key=key, base_url=small.url, wait_for_capacity=0) as rt, \
            Runtime(api_key=small.admin_key(), base_url=small.url, wait_for_capacity=0) as admin:
        assert rows(rt)["sandbox.count"]["max"] == 2
        assert rows(admin)["sandbox.count"]["max"] == 1
        made = [rt.sandboxes.create(memory_mib=512) for _ in range(2)]
        try:
            assert [s.exec("echo $((20+1))").stdout for s in made] == ["21\n", "21\n"]
            with pytest.raises(RuntimeErr) as refused:
                rt.sandboxes.create(memory_mib=512)
            assert refused.value.code == "quota_exceeded"
            assert refused.value.details["max"] == 2, refused.value.details
            with pytest.raises(RuntimeErr) as refused:
                rt.volumes.create(size_mib=64)
            assert refused.value.details["limit"] == "volume.count"
            # Back to the server's quota: the key is over it, and a create
            # is refused at the server's maximum.
            assert keys_cli(small, "quota", key_id, "sandbox.count=default").returncode == 0
            assert rows(rt)["sandbox.count"]["max"] == 1
            with pytest.raises(RuntimeErr) as refused:
                rt.sandboxes.create(memory_mib=512)
            assert refused.value.details["max"] == 1, refused.value.details
        finally:
            for s in made:
                rt.sandboxes.delete(s.id)


def test_a_snapshot_is_refused_up_front_when_its_size_would_pass_the_quota(small):
    """The host estimates a capture's size (the disk as written, the memory
    held) before it starts: a sandbox that wrote 96 MiB cannot be captured
    by a key with 64 MiB of snapshot quota, and nothing is left capturing."""
    from withruntime import Runtime
    from withruntime._errors import RuntimeError as RuntimeErr

    key = small.create_key(name="snaps-" + os.urandom(3).hex())
    key_id = key.split("_")[1]
    assert keys_cli(small, "quota", key_id, "snapshot.mib=64").returncode == 0
    with Runtime(api_key=key, base_url=small.url, wait_for_capacity=0) as rt:
        sbx = rt.sandboxes.create(memory_mib=512)
        try:
            small_snap = sbx.snapshot(mode="disk")
            assert small_snap["state"] == "ready", small_snap
            rt.snapshots.delete(small_snap["id"])
            sbx.exec("head -c 96M /dev/urandom > /workspace/big && sync")
            with pytest.raises(RuntimeErr) as refused:
                sbx.snapshot(mode="disk")
            assert refused.value.code == "quota_exceeded", refused.value
            assert refused.value.details["limit"] == "snapshot.mib"
            assert refused.value.details["asked"] >= 96, refused.value.details
            assert [s for s in rt.snapshots.list() if s["state"] not in ("failed", "deleted")] == []
        finally:
            rt.sandboxes.delete(sbx.id)


def test_a_key_runs_its_quota_of_builds_at_once_and_queues_the_rest(small):
    import time

    from withruntime import Runtime

    with Runtime(api_key=small.admin_key(), base_url=small.url, wait_for_capacity=0) as rt:
        first = rt.images.create(name="e2e-quota-build", recipe={"commands": ["sleep 8"]})
        second = rt.images.create(name="e2e-quota-build-2", recipe={"commands": ["true"]})
        deadline = time.monotonic() + 300
        states = []
        while "building" not in states and time.monotonic() < deadline:
            states = sorted(rt.images.get(i["id"])["state"] for i in (first, second))
            time.sleep(0.2)
        # One runs (image.builds=1); the other waits its turn, queued.
        assert states == ["building", "queued"], states
        assert rows(rt)["image.builds"]["used"] == 1
        # Both are built in the end, through the client's own wait.
        done = rt.images.build(name="e2e-quota-build-3", recipe={"commands": ["true"]}, poll_seconds=0.5)
        assert done["state"] == "ready", done
        for image in (first, second):
            assert rt.images.get(image["id"])["state"] == "ready"
        assert rows(rt)["image.builds"]["used"] == 0
        for image in rt.images.list().data:
            rt.images.delete(image["id"])
