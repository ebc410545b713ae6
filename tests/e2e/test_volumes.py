"""Volumes through the official client: data that outlives every sandbox
using it (and the server), one writer at a time, private snapshot views,
no copies of a machine with volumes."""
from __future__ import annotations

import time

import pytest
from withruntime import ConflictError, InvalidRequestError, NotFoundError


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
