"""Shared volumes through the official client (sync and async): a directory
on the host, attached to running sandboxes as a 9P mount, many at once;
writes of one are read by the other, detach ends the mount, a pause and
wake keep it, the size is enforced, and nothing outside the volume's
directory is reachable from it."""
from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path

import pytest
from withruntime import ConflictError, InvalidRequestError, NotFoundError

from conftest import assert_error_body, http


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _run(sbx, cmd: str):
    out = sbx.exec(cmd)
    assert out.exit_code == 0, (cmd, out.stdout, out.stderr)
    return out.stdout


@pytest.fixture(scope="module")
def pair(server, runtime):
    from withruntime import Sandbox
    a = Sandbox.create()
    b = Sandbox.create()
    try:
        yield a, b
    finally:
        for s in (a, b):
            try:
                s.delete()
            except Exception:  # noqa: BLE001 - the session teardown sweeps what is left
                pass


def test_two_sandboxes_share_one_volume(server, runtime, pair):
    a, b = pair
    volume = runtime.volumes.create(32, name="e2e-shared-dir", shared=True)
    assert volume["shared"] is True and volume["attachments"] == []
    vid = volume["id"]
    # Its directory on the host: private, not root's.
    d = server.data_dir / "volumes" / f"{vid}.d"
    assert d.is_dir() and (d.stat().st_mode & 0o777) == 0o700
    ata = runtime.volumes.attach(vid, a.id, "/mnt/shared")
    assert ata["kind"] == "volume_attachment" and ata["state"] == "attached", ata
    assert ata["id"].startswith("va-") and ata["sandboxId"] == a.id and ata["mode"] == "rw"
    atb = runtime.volumes.attach(vid, b.id, "/workspace/shared")
    got = runtime.volumes.get(vid)
    assert sorted(x["id"] for x in got["attachments"]) == sorted([ata["id"], atb["id"]])
    assert runtime.volumes.get_attachment(vid, atb["id"])["path"] == "/workspace/shared"

    # Exact bytes written in one are read in the other.
    _run(a, "head -c 300000 /dev/urandom > /mnt/shared/blob && mkdir -p /mnt/shared/d && echo hi > /mnt/shared/d/x")
    want = _run(a, "sha256sum /mnt/shared/blob").split()[0]
    assert _run(b, "sha256sum /workspace/shared/blob").split()[0] == want
    assert b.files.read("/workspace/shared/d/x") == b"hi\n"
    # The sandbox user owns what it sees; the host's files are not root's.
    owners = _run(b, "ls -ln /workspace/shared | awk 'NR>1 {print $3}' | sort -u").split()
    assert owners == ["1000"], owners
    assert _run(b, "stat -c %U /workspace/shared/blob").strip() == "runtime"
    assert (d / "blob").stat().st_uid != 0 and hashlib.sha256((d / "blob").read_bytes()).hexdigest() == want
    assert runtime.volumes.get(vid)["usedBytes"] >= 300000

    # A fork of a sandbox with an attachment is refused.
    with pytest.raises(ConflictError) as caught:
        a.fork()
    assert caught.value.code == "volume_attached"
    # Deleting the volume while attached is refused.
    with pytest.raises(ConflictError) as caught:
        runtime.volumes.delete(vid)
    assert caught.value.code == "volume_in_use"

    # Pause and wake keep the attachment and its data.
    a.pause()
    a.wake()
    assert _run(a, "sha256sum /mnt/shared/blob").split()[0] == want
    _run(a, "echo after-wake > /mnt/shared/woken")
    assert b.files.read("/workspace/shared/woken") == b"after-wake\n"
    assert runtime.volumes.get_attachment(vid, ata["id"])["state"] == "attached"

    # Detach ends the mount in that sandbox; the other still reads it.
    done = runtime.volumes.detach(vid, ata["id"])
    assert done["state"] == "detached" and done["detachedAt"], done
    left = _run(a, "ls -A /mnt/shared 2>/dev/null || true").split()
    assert left == [], left
    assert _run(b, "cat /workspace/shared/woken") == "after-wake\n"
    # Detach twice: refused, the record unchanged.
    with pytest.raises(ConflictError) as caught:
        runtime.volumes.detach(vid, ata["id"])
    assert caught.value.code == "volume_not_attached"
    assert [x["id"] for x in runtime.volumes.get(vid)["attachments"]] == [atb["id"]]
    runtime.volumes.detach(vid, atb["id"])
    runtime.volumes.delete(vid)
    assert not d.exists()


def test_the_size_is_enforced_and_links_stay_inside(server, runtime, pair):
    a, _ = pair
    volume = runtime.volumes.create(16, shared=True)
    vid = volume["id"]
    at = runtime.volumes.attach(vid, a.id, "/srv/small")
    try:
        out = a.exec("dd if=/dev/zero of=/srv/small/big bs=1M count=40 conv=fsync 2>&1; "
                     "sleep 2; dd if=/dev/zero of=/srv/small/more bs=64k count=4 2>&1")
        assert "No space left on device" in out.stdout + out.stderr, out
        assert runtime.volumes.get(vid)["usedBytes"] <= (16 << 20) + (8 << 20)
        # Its 9P server runs in a network namespace with nothing in it.
        if os.geteuid() == 0:
            servers = [p for p in (int(x) for x in os.listdir("/proc") if x.isdigit())
                       if "9p-serve" in _cmdline(p) and f"{vid}.d" in " ".join(_cmdline(p))]
            assert servers, "no 9p-serve for the volume"
            for p in servers:
                assert os.readlink(f"/proc/{p}/ns/net") != os.readlink("/proc/self/ns/net")
                devices = [line.split(":")[0].strip()
                           for line in Path(f"/proc/{p}/net/dev").read_text().splitlines()[2:]]
                assert devices == ["lo"], devices
        # The guest cannot make links or device nodes in a share (the 9P
        # server refuses them) ...
        _run(a, "rm -f /srv/small/big /srv/small/more")
        made = a.exec("ln -s /etc /srv/small/etc")
        assert made.exit_code != 0 and "Permission denied" in made.stderr, made
        assert a.exec("mknod /srv/small/null c 1 3").exit_code != 0
        # ... and a link that is in the tree anyway (planted on the host
        # here) is followed by the guest's kernel in its own file system,
        # never by the host: the host's /etc/hostname bytes never appear.
        d = server.data_dir / "volumes" / f"{vid}.d"
        (d / "etc").symlink_to("/etc")
        (d / "up").symlink_to("..")
        (d / "h").symlink_to("../../../../../etc/hostname")
        host_name = Path("/etc/hostname").read_bytes().strip()
        guest_name = a.exec("cat /etc/hostname").stdout.strip().encode()
        assert host_name and host_name != guest_name
        seen = a.exec("cat /srv/small/etc/hostname /srv/small/h; ls /srv/small/up/; "
                      "cat /srv/small/up/*/hostname 2>&1")
        assert host_name not in (seen.stdout + seen.stderr).encode(), seen
        assert guest_name in seen.stdout.encode(), seen
    finally:
        runtime.volumes.detach(vid, at["id"])
        runtime.volumes.delete(vid)


def test_bad_input(server, runtime, pair):
    a, _ = pair
    plain = runtime.volumes.create(16)
    shared = runtime.volumes.create(16, shared=True)
    try:
        # Only shared volumes attach to a running sandbox.
        with pytest.raises(ConflictError) as caught:
            runtime.volumes.attach(plain["id"], a.id, "/mnt/p")
        assert caught.value.code == "volume_not_shared"
        with pytest.raises(NotFoundError):
            runtime.volumes.attach("no-such-volume", a.id, "/mnt/p")
        with pytest.raises(NotFoundError):
            runtime.volumes.attach(shared["id"], "no-such-sandbox", "/mnt/p")
        with pytest.raises(NotFoundError):
            runtime.volumes.get_attachment(shared["id"], "va-nope")
        with pytest.raises(NotFoundError):
            runtime.volumes.detach(shared["id"], "va-nope")
        for bad in ["relative", "/etc/x", "/workspace", "/a/../b"]:
            with pytest.raises(InvalidRequestError):
                runtime.volumes.attach(shared["id"], a.id, bad)
        answer = http(server, "POST", f"/v1/volumes/{shared['id']}:attach", {"path": "/x/../y", "nope": 1})
        error = assert_error_body(answer, 400)
        fields = sorted(i["field"] for i in error.get("issues", error.get("details", {}).get("issues", [])))
        assert fields == ["nope", "path", "sandboxId"], error
        # A shared volume is not named in a create.
        with pytest.raises(InvalidRequestError):
            runtime.sandboxes.create(volumes=[{"volume_id": shared["id"], "path": "/data"}])
        # A stopped sandbox: 409.
        from withruntime import Sandbox
        s = Sandbox.create()
        s.stop()
        with pytest.raises(ConflictError) as caught:
            runtime.volumes.attach(shared["id"], s.id, "/mnt/p")
        assert caught.value.code == "sandbox_not_running"
        s.delete()
        # One path once per sandbox; a nested path is refused.
        at = runtime.volumes.attach(shared["id"], a.id, "/mnt/p")
        with pytest.raises(ConflictError):
            runtime.volumes.attach(shared["id"], a.id, "/mnt/p")
        with pytest.raises(InvalidRequestError):
            runtime.volumes.attach(shared["id"], a.id, "/mnt/p/inner")
        runtime.volumes.detach(shared["id"], at["id"])
    finally:
        runtime.volumes.delete(plain["id"])
        runtime.volumes.delete(shared["id"])


def test_async_client(server, pair):
    from withruntime import AsyncRuntime
    a, b = pair

    async def main():
        async with AsyncRuntime(api_key=server.admin_key(), base_url=server.url) as rt:
            v = await rt.volumes.create(16, shared=True)
            x = await rt.volumes.attach(v["id"], a.id, "/mnt/async")
            y = await rt.volumes.attach(v["id"], b.id, "/mnt/async")
            assert (await rt.volumes.get_attachment(v["id"], x["id"]))["state"] == "attached"
            return v, x, y

    v, x, y = asyncio.run(main())
    _run(a, "printf 'from a' > /mnt/async/f")
    assert b.files.read("/mnt/async/f") == b"from a"

    async def end():
        async with AsyncRuntime(api_key=server.admin_key(), base_url=server.url) as rt:
            assert (await rt.volumes.detach(v["id"], x["id"]))["state"] == "detached"
            assert (await rt.volumes.detach(v["id"], y["id"]))["state"] == "detached"
            await rt.volumes.delete(v["id"])

    asyncio.run(end())
