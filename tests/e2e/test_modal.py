"""Modal's sandbox flows, written as Modal's users write them, with only the
import changed (`withruntime.modal`), on an image built from a Dockerfile
whose base is Runtime's `default` image (no registry: `Image.debian_slim()`
needs one, test_registry_images.py): create with app, name, env and tags,
`exec` (argv, output streams, stdin, exit, workdir, a timeout), the
filesystem API with exact bytes, an entrypoint command with its stdin,
output, wait and returncode, an encrypted port's tunnel, `from_id`,
`from_name` and `list` (reconnect), a filesystem snapshot as an image for a
new sandbox, a memory snapshot and a sandbox continuing it, terminate. One
sandbox for the module where the state does not matter."""
from __future__ import annotations

import hashlib
import os
import uuid

import pytest
from conftest import preview_fetch, qemu_gone

APP = f"modal-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def image(server, tmp_path_factory):
    from withruntime import modal
    folder = tmp_path_factory.mktemp("modal-image")
    dockerfile = folder / "Dockerfile"
    dockerfile.write_text("FROM default\nRUN echo built-by-modal > /opt/built.txt\n")
    return modal.Image.from_dockerfile(str(dockerfile))


@pytest.fixture(scope="module")
def app(server):
    from withruntime import modal
    return modal.App.lookup(APP, create_if_missing=True)


@pytest.fixture(scope="module")
def sb(app, image):
    from withruntime import modal
    made = modal.Sandbox.create(app=app, image=image, name="main", cpu=1, memory=1024, timeout=1800,
                                env={"GREETING": "hello modal"})
    try:
        yield made
    finally:
        try:
            made.terminate()
        except Exception:  # noqa: BLE001 - the session teardown sweeps what is left
            pass


def test_the_image_was_built_from_the_dockerfile(sb):
    process = sb.exec("cat", "/opt/built.txt")
    assert process.stdout.read() == "built-by-modal\n"
    assert process.wait() == 0
    assert sb.exec("nproc").stdout.read() == "1\n"


def test_exec_streams_output_and_takes_stdin(sb):
    process = sb.exec("sh", "-c", "uname -s; echo $GREETING; echo to-err >&2; exit 3")
    assert process.wait() == 3 and process.returncode == 3
    assert process.stdout.read() == "Linux\nhello modal\n" and process.stderr.read() == "to-err\n"
    lines = list(sb.exec("sh", "-c", "for i in 1 2 3; do echo n$i; done", bufsize=1).stdout)
    assert lines == ["n1\n", "n2\n", "n3\n"]
    assert sb.exec("printf", "<%s>", "a b", "$HOME").stdout.read() == "<a b><$HOME>"
    moved = sb.exec("sh", "-c", "pwd; echo $EXTRA", workdir="/tmp", env={"EXTRA": "added"})
    assert moved.stdout.read() == "/tmp\nadded\n"
    fed = sb.exec("sha256sum")
    fed.stdin.write(b"through stdin\n")
    fed.stdin.write_eof()
    fed.stdin.drain()
    assert fed.stdout.read().split()[0] == hashlib.sha256(b"through stdin\n").hexdigest()
    raw = sb.exec("printf", "a\\000b\\377", text=False)
    assert raw.stdout.read() == b"a\x00b\xff"
    assert sb.exec("sleep", "30", timeout=2).wait() == -1


def test_the_filesystem_keeps_exact_bytes(sb, tmp_path):
    from withruntime.modal.exception import SandboxFilesystemNotFoundError
    fs = sb.filesystem
    data = os.urandom(200_000) + b"\x00\xff"
    fs.write_bytes(data, "/workspace/data/blob.bin")
    assert fs.read_bytes("/workspace/data/blob.bin") == data
    guest = sb.exec("sha256sum", "/workspace/data/blob.bin").stdout.read().split()[0]
    assert guest == hashlib.sha256(data).hexdigest()
    fs.make_directory("/workspace/tree/sub")
    fs.write_text("alpha", "/workspace/tree/a.txt")
    names = sorted(entry.path.rsplit("/", 1)[-1] for entry in fs.list_files("/workspace/tree"))
    assert names == ["a.txt", "sub"]
    local = tmp_path / "back.bin"
    fs.copy_to_local("/workspace/data/blob.bin", str(local))
    assert local.read_bytes() == data
    fs.copy_from_local(str(local), "/workspace/copied.bin")
    assert sb.exec("cmp", "/workspace/copied.bin", "/workspace/data/blob.bin").wait() == 0
    fs.remove("/workspace/tree", recursive=True)
    with pytest.raises(SandboxFilesystemNotFoundError):
        fs.read_bytes("/workspace/tree/a.txt")


def test_an_entrypoint_reads_stdin_and_ends_the_sandbox(app, image):
    from withruntime import modal
    box = modal.Sandbox.create("sh", "-c", "echo ready; read line; echo got $line; exit 7", app=app, image=image,
                               cpu=1, memory=1024)
    try:
        box.stdin.write("hello\n")
        box.stdin.write_eof()
        box.stdin.drain()
        box.wait(raise_on_termination=False)
        assert box.returncode == 7 and box.poll() == 7
        assert box.stdout.read() == "ready\ngot hello\n"
        assert box._sandbox.refresh().state in ("stopping", "stopped")
    finally:
        box.terminate()


def test_an_encrypted_port_is_a_tunnel(server, app, image):
    from withruntime import modal
    box = modal.Sandbox.create("python3", "-m", "http.server", "8000", "--bind", "127.0.0.1", "--directory", "/opt",
                               app=app, image=image, encrypted_ports=[8000], cpu=1, memory=1024)
    try:
        tunnel = box.tunnels()[8000]
        answer = preview_fetch(server, tunnel.url, "/built.txt")
        assert (answer.status, answer.body) == (200, b"built-by-modal\n")
    finally:
        box.terminate()


def test_from_id_from_name_and_list_reconnect(app, sb):
    from withruntime import modal
    sb.set_tags({"suite": APP})
    assert sb.get_tags() == {"suite": APP}
    sb.filesystem.write_text("seen again", "/workspace/seen.txt")
    again = modal.Sandbox.from_id(sb.object_id)
    assert again.exec("cat", "/workspace/seen.txt").stdout.read() == "seen again"
    named = modal.Sandbox.from_name(APP, "main")
    assert named.object_id == sb.object_id
    assert [one.object_id for one in modal.Sandbox.list(app_id=APP, tags={"suite": APP})] == [sb.object_id]


def test_a_filesystem_snapshot_is_an_image_for_a_new_sandbox(app, sb):
    from withruntime import modal
    marker = uuid.uuid4().hex
    sb.filesystem.write_text(marker, "/workspace/marker.txt")
    snapshot_image = sb.snapshot_filesystem()
    copy = modal.Sandbox.create(app=app, image=snapshot_image, cpu=1, memory=1024)
    try:
        assert copy.object_id != sb.object_id
        assert copy.exec("cat", "/workspace/marker.txt", "/opt/built.txt").stdout.read() == \
            f"{marker}built-by-modal\n"
    finally:
        copy.terminate()


def test_a_memory_snapshot_continues_its_processes(runtime, app, image):
    from withruntime import modal
    ours = {"compat.provider": "modal", "modal.app": APP}
    before = {one.id for one in runtime.sandboxes.list(labels=ours)}
    box = modal.Sandbox.create("sh", "-c", "echo $$ > /tmp/entry.pid; sleep 900", app=app, image=image,
                               cpu=1, memory=1024)
    try:
        pid = ""
        for _ in range(100):
            pid = box.exec("cat", "/tmp/entry.pid").stdout.read().strip()
            if pid:
                break
        assert pid
        snapshot = box._experimental_snapshot()
        restored = modal.Sandbox._experimental_from_snapshot(snapshot)
        assert restored.object_id != box.object_id
        assert restored.exec("sh", "-c", f"cat /tmp/entry.pid; kill -0 {pid} && echo alive").stdout.read() == \
            f"{pid}\nalive\n"
    finally:
        box.terminate()
        # The restored copy, also one the layer made before it failed.
        for left in {one.id for one in runtime.sandboxes.list(labels=ours)} - before - {box.object_id}:
            runtime.sandboxes.delete(left)


def test_terminate_ends_the_sandbox(server, app, image):
    from withruntime import modal
    box = modal.Sandbox.create(app=app, image=image, cpu=1, memory=1024)
    assert box.exec("true").wait() == 0
    box.terminate()
    assert box.returncode == 137
    assert box._sandbox.refresh().state in ("stopping", "stopped")
    box._sandbox.wait_for("stopped")
    assert qemu_gone(server, box.object_id)
