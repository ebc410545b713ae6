"""Volumes through the official client: data that outlives every sandbox
using it (and the server), one writer at a time, private snapshot views,
no copies of a machine with volumes."""
from __future__ import annotations

import time

import pytest
from withruntime import ConflictError, InvalidRequestError, NotFoundError, ServiceUnavailableError

from conftest import client_for


def _vol(volume_id: str, path: str, mode: str = "rw") -> dict:
    return {"volume_id": volume_id, "path": path, "mode": mode}


def _create_when_released(runtime, **kw):
    """A create that waits out `volume_releasing` (the client does too, for
    up to 120 s; this keeps the test's own bound short and explicit)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return runtime.sandboxes.create(**kw)
        except ConflictError as error:
            if error.code != "volume_releasing" or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_volume_data_outlives_sandboxes_and_the_server(server, runtime):
    volume = runtime.volumes.create(64, name="e2e-shared")
    assert volume["state"] == "ready" and volume["sizeMiB"] == 64
    vid = volume["id"]
    assert runtime.volumes.get(vid)["name"] == "e2e-shared"
    assert vid in [v["id"] for v in runtime.volumes.list().data]

    writer = runtime.sandboxes.create(volumes=[_vol(vid, "/data")])
    try:
        # The sandbox user owns the volume's root; writes go straight in.
        out = writer.exec("stat -c %U /data && echo hello > /data/greeting && mkdir -p /data/sub "
                          "&& head -c 1048576 /dev/urandom > /data/sub/blob && sha256sum /data/sub/blob")
        assert out.exit_code == 0, out.stderr
        owner, digest = out.stdout.split("\n")[0], out.stdout.split("\n")[1].split()[0]
        assert owner == "runtime"
        # One writer at a time, by id or by name.
        with pytest.raises(ConflictError) as caught:
            runtime.sandboxes.create(volumes=[_vol("e2e-shared", "/other")])
        assert caught.value.code == "volume_in_use"
        # A snapshot view beside the writer: its own copy, writes stay in it.
        with runtime.sandboxes.create(volumes=[_vol(vid, "/workspace/view", "snapshot")]) as viewer:
            assert viewer.exec("cat /workspace/view/greeting").stdout == "hello\n"
            assert viewer.exec("echo mine > /workspace/view/only-here && rm /workspace/view/greeting").exit_code == 0
        assert writer.exec("ls /data").stdout.split() == ["greeting", "lost+found", "sub"]
        # No fork or memory snapshot of a machine with a volume.
        with pytest.raises(ConflictError) as caught:
            writer.fork()
        assert caught.value.code == "volume_attached"
        with pytest.raises(ConflictError):
            runtime.volumes.delete(vid)
        # Across a pause the mount and the data stay.
        writer.pause()
        writer.wake()
        assert writer.exec("cat /data/greeting").stdout == "hello\n"
    finally:
        runtime.sandboxes.delete(writer.id)

    server.restart()

    assert runtime.volumes.get(vid)["id"] == vid
    reader = _create_when_released(runtime, volumes=[_vol(vid, "/mnt/v")])
    try:
        assert reader.exec("cat /mnt/v/greeting").stdout == "hello\n"
        assert reader.exec("sha256sum /mnt/v/sub/blob").stdout.split()[0] == digest
        assert reader.exec("test -e /mnt/v/only-here || echo absent").stdout == "absent\n"
        # The guest cannot use the volume for set-uid programs or devices.
        opts = reader.exec("findmnt -no OPTIONS /mnt/v").stdout
        assert "nosuid" in opts and "nodev" in opts
    finally:
        runtime.sandboxes.delete(reader.id)

    deadline = time.monotonic() + 60
    while True:
        try:
            assert runtime.volumes.delete(vid)["status"] == "deleted"
            break
        except ConflictError:
            assert time.monotonic() < deadline, "the volume stayed held after its sandboxes went"
            time.sleep(0.2)
    with pytest.raises(NotFoundError):
        runtime.volumes.get(vid)


def test_volume_paths_are_checked(runtime):
    vid = runtime.volumes.create(16)["id"]
    try:
        for path in ["relative", "/", "/etc", "/proc/x", "/data/../etc", "/workspace"]:
            with pytest.raises(InvalidRequestError):
                runtime.sandboxes.create(volumes=[_vol(vid, path)])
        with pytest.raises(NotFoundError):
            runtime.sandboxes.create(volumes=[_vol("no-such-volume", "/data")])
    finally:
        runtime.volumes.delete(vid)


def _delete_when_released(runtime, volume_id: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            runtime.volumes.delete(volume_id)
            return
        except ConflictError:
            assert time.monotonic() < deadline, "the volume stayed held after its sandboxes went"
            time.sleep(0.2)


def _df_mib(sandbox, path: str) -> int:
    out = sandbox.exec(f"df -m --output=size {path} | tail -1")
    assert out.exit_code == 0, out.stderr
    return int(out.stdout.strip())


def test_backup_restore_and_resize(server, runtime):
    """A running writer's volume is backed up (frozen for the copy), its
    bytes change, and the backup restored into a new volume, grown, brings
    the original bytes back in a new sandbox, on a larger file system."""
    vid = runtime.volumes.create(32, name="e2e-backed")["id"]
    writer = runtime.sandboxes.create(volumes=[_vol(vid, "/data")])
    restored_id = None
    try:
        out = writer.exec("echo original > /data/greeting && head -c 300000 /dev/urandom > /data/blob "
                          "&& sha256sum /data/blob")
        assert out.exit_code == 0, out.stderr
        digest = out.stdout.split()[0]
        before = _df_mib(writer, "/data")

        backup = runtime.volumes.backup(vid, name="before-change", retention_days=2)
        assert backup["state"] == "ready" and backup["volumeId"] == vid, backup
        assert backup["sizeMiB"] == 32 and backup["name"] == "before-change"
        assert backup["retentionDays"] == 2 and backup["expiresAt"] > backup["createdAt"]
        # The writer was thawed: it writes on.
        out = writer.exec("echo changed > /data/greeting && cat /data/greeting")
        assert out.stdout == "changed\n", out.stderr

        # A policy of daily backups is kept; schedules of their own are not served.
        policy = runtime.volumes.set_backup_policy(vid, daily=True, retention_days=14)["backupPolicy"]
        assert policy == {"daily": True, "retentionDays": 14, "schedule": None}
        with pytest.raises(ServiceUnavailableError):
            runtime.volumes.set_backup_policy(vid, every_minutes=30)
        assert runtime.volumes.get_backup(backup["id"])["id"] == backup["id"]
        assert [b["id"] for b in runtime.volumes.backups(vid).data] == [backup["id"]]
        # An attached volume keeps its size.
        with pytest.raises(ConflictError):
            runtime.volumes.resize(vid, 64)

        # Another key sees none of it, and restores nothing of it.
        with client_for(server, server.create_key()) as other:
            with pytest.raises(NotFoundError):
                other.volumes.get_backup(backup["id"])
            assert other.volumes.backups().data == []
            with pytest.raises(NotFoundError):
                other.volumes.restore(backup["id"])
            with pytest.raises(NotFoundError):
                other.volumes.delete_backup(backup["id"])

        restored = runtime.volumes.restore(backup["id"], name="e2e-restored")
        restored_id = restored["id"]
        assert restored["restoredFrom"] == backup["id"] and restored["sizeMiB"] == 32, restored
        # A detached volume grows (never shrinks); the guest grows its file
        # system when it mounts it.
        with pytest.raises(InvalidRequestError):
            runtime.volumes.resize(restored_id, 16)
        assert runtime.volumes.resize(restored_id, 96)["sizeMiB"] == 96

        reader = _create_when_released(runtime, volumes=[_vol(restored_id, "/mnt/r")])
        try:
            assert reader.exec("cat /mnt/r/greeting").stdout == "original\n"
            assert reader.exec("sha256sum /mnt/r/blob").stdout.split()[0] == digest
            grown = _df_mib(reader, "/mnt/r")
            assert grown > before + 50, (before, grown)
            assert reader.exec("echo new > /mnt/r/more && cat /mnt/r/more").stdout == "new\n"
        finally:
            runtime.sandboxes.delete(reader.id)

        assert runtime.volumes.delete_backup(backup["id"])["status"] == "deleted"
        with pytest.raises(NotFoundError):
            runtime.volumes.get_backup(backup["id"])
    finally:
        runtime.sandboxes.delete(writer.id)
        _delete_when_released(runtime, vid)
        if restored_id:
            _delete_when_released(runtime, restored_id)
