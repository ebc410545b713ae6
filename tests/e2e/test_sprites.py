"""Sprites' main flows, written as Sprites' users write them, with only the
import changed (`withruntime.sprites`): create a sprite with its config and
labels, commands (`output`, `run`, `combined_output`, `ExitError`, stdin,
binary output streamed to a sink, env and cwd), the filesystem's paths with
exact bytes, a command running in the background seen as a session and
attached to, the sprite's URL (private, then public), get and list
(reconnect by name), labels updated, checkpoints, destroy. One sprite for
the module where the state does not matter."""
from __future__ import annotations

import hashlib
import io
import os
import threading
import time
import uuid

import pytest
from conftest import preview_fetch, qemu_gone

PREFIX = f"sprite-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def client(server):
    from withruntime.sprites import SpritesClient
    # As Sprites' users write it, with the key from the environment.
    with SpritesClient() as made:
        yield made


@pytest.fixture(scope="module")
def sprite(client):
    from withruntime.sprites import SpriteConfig
    made = client.create_sprite(f"{PREFIX}-main", config=SpriteConfig(ram_mb=1024, cpus=1), labels=["suite"])
    try:
        yield made
    finally:
        try:
            client.delete_sprite(made.name)
        except Exception:  # noqa: BLE001 - the session teardown sweeps what is left
            pass


def test_a_sprite_has_its_config(sprite):
    assert (sprite.config.cpus, sprite.config.ram_mb) == (1, 1024)
    assert sprite.status == "running" and sprite.labels == ["suite"]
    assert sprite.command("nproc").output() == b"1\n"


def test_commands_return_the_guests_bytes_and_exit(sprite):
    from withruntime.sprites import ExitError
    assert sprite.command("cat", "/proc/sys/kernel/ostype").output() == b"Linux\n"
    with pytest.raises(ExitError) as raised:
        sprite.command("sh", "-c", "echo out; echo err >&2; exit 3").output()
    assert raised.value.exit_code() == 3
    assert (raised.value.stdout, raised.value.stderr) == (b"out\n", b"err\n")
    done = sprite.run("sh", "-c", "echo kept; exit 2", capture_output=True)
    assert (done.returncode, done.stdout) == (2, b"kept\n")
    assert sorted(sprite.command("sh", "-c", "echo a; echo b >&2").combined_output().splitlines()) == [b"a", b"b"]
    # Arguments stay words; env and cwd reach the guest.
    assert sprite.command("printf", "<%s>", "a b", "$HOME").output() == b"<a b><$HOME>"
    assert sprite.command("sh", "-c", "echo $GREETING; pwd", env={"GREETING": "hi sprite"}, cwd="/tmp").output() \
        == b"hi sprite\n/tmp\n"
    data = os.urandom(50_000)
    fed = sprite.command("sha256sum", stdin=io.BytesIO(data)).output()
    assert fed.split()[0].decode() == hashlib.sha256(data).hexdigest()
    # Output that is not text, streamed to a sink, arrives byte for byte.
    sink = io.BytesIO()
    sprite.command("printf", "a\\000b\\377c", stdout=sink).run()
    assert sink.getvalue() == b"a\x00b\xffc"


def test_the_filesystem_keeps_exact_bytes(sprite):
    from withruntime.sprites import FileNotFoundError_
    fs = sprite.filesystem("/workspace")
    data = os.urandom(100_000) + b"\x00\xff"
    blob = fs / "data" / "blob.bin"
    blob.write_bytes(data)
    assert blob.read_bytes() == data
    guest = sprite.command("sha256sum", "/workspace/data/blob.bin").output().split()[0].decode()
    assert guest == hashlib.sha256(data).hexdigest()
    info = blob.stat()
    assert (info.size, info.is_file) == (len(data), True)
    tree = fs.path("tree", "deep")
    tree.mkdir(parents=True)
    assert tree.is_dir() and not tree.is_file()
    (tree / "a.txt").write_text("alpha", mode=0o600)
    assert sprite.command("stat", "-c", "%a", "/workspace/tree/deep/a.txt").output() == b"600\n"
    assert fs.path("tree").listdir() == ["deep"]
    moved = (tree / "a.txt").rename("b.txt")
    assert str(moved) == "/workspace/tree/deep/b.txt" and moved.read_text() == "alpha"
    copy = moved.copy_to("c.txt")
    assert copy.read_text() == "alpha" and sorted(tree.listdir()) == ["b.txt", "c.txt"]
    copy.unlink()
    assert not copy.exists()
    fs.path("tree").rmtree()
    assert not fs.path("tree").exists()
    with pytest.raises(FileNotFoundError_):
        (fs / "no-such-file").read_bytes()


def test_a_background_command_is_a_session_that_can_be_attached(sprite):
    sink = io.BytesIO()
    command = sprite.command("sh", "-c", "echo first; sleep 5; echo second", stdout=sink)
    failures: list[BaseException] = []

    def run() -> None:
        try:
            command.run()
        except BaseException as error:  # noqa: BLE001 - reported below
            failures.append(error)
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    deadline = time.monotonic() + 60
    sessions = []
    while time.monotonic() < deadline:
        sessions = [one for one in sprite.list_sessions() if "echo second" in one.command]
        if sessions:
            break
        time.sleep(0.2)
    assert len(sessions) == 1, sprite.list_sessions()
    assert sessions[0].is_active and not sessions[0].tty
    # Another handle attaches to it and reads its output to the end.
    attached = sprite.attach_session(sessions[0].id).output()
    assert attached == b"first\nsecond\n"
    worker.join(60)
    assert not failures and command.exit_code == 0
    assert sink.getvalue() == b"first\nsecond\n"
    assert not [one for one in sprite.list_sessions() if one.id == sessions[0].id]


def test_the_sprites_url_serves_port_8080(server, sprite):
    from urllib.parse import urlsplit
    from withruntime.sprites import URLSettings
    # A session of its own, there before the command returns: what a command
    # leaves in its process group ends with it here (docs/api.md).
    sprite.command("sh", "-c", "mkdir -p /tmp/site && echo served by the guest > /tmp/site/index.html && "
                   "setsid -f sh -c 'echo $$ > /tmp/web.pid; exec python3 -m http.server 8080 --bind 127.0.0.1 "
                   "--directory /tmp/site' > /dev/null 2>&1; until [ -s /tmp/web.pid ]; do sleep 0.05; done").run()
    sprite.update_url_settings(URLSettings(auth="sprite"))
    token = urlsplit(sprite.url).query
    assert token.startswith("runtime_preview_token=")
    answer = preview_fetch(server, sprite.url, f"/index.html?{token}")
    assert (answer.status, answer.body) == (200, b"served by the guest\n")
    assert preview_fetch(server, sprite.url, "/index.html").status == 401
    sprite.update_url_settings(URLSettings(auth="public"))
    assert preview_fetch(server, sprite.url, "/index.html").status == 200
    sprite.command("pkill", "-f", "http[.]server").run()


def test_get_and_list_find_the_sprite_again(client, sprite):
    from withruntime.sprites import ListOptions, NotFoundError
    sprite.filesystem("/workspace").path("seen.txt").write_text("seen again")
    again = client.sprite(sprite.name)
    assert again.command("cat", "/workspace/seen.txt").output() == b"seen again"
    got = client.get_sprite(sprite.name)
    assert (got.id, got.status) == (sprite.id, "running")
    listed = client.list_sprites(ListOptions(prefix=PREFIX))
    assert [one.name for one in listed.sprites] == [sprite.name] and listed.running == 1
    assert [one.name for one in client.list_all_sprites(prefix=PREFIX)] == [sprite.name]
    client.update_sprite(sprite.name, labels=["suite", "relabelled"])
    assert client.get_sprite(sprite.name).labels == ["suite", "relabelled"]
    with pytest.raises(NotFoundError):
        client.get_sprite(f"{PREFIX}-missing")


def test_checkpoints_are_created_listed_and_got(sprite):
    from withruntime._compat import CompatibilityError
    sprite.command("sh", "-c", "echo at-checkpoint > /workspace/state.txt").run()
    messages = list(sprite.create_checkpoint("before the change"))
    assert messages[-1].type == "complete", messages
    made = messages[-1].data
    assert [c.id for c in sprite.list_checkpoints()] == [made]
    got = sprite.get_checkpoint(made)
    assert got.comment == "before the change" and got.id == made
    # Runtime does not restore in place; the layer says so before anything is done.
    with pytest.raises(CompatibilityError):
        sprite.restore_checkpoint(made)
    assert sprite.command("cat", "/workspace/state.txt").output() == b"at-checkpoint\n"


def test_destroy_ends_the_sprite(server, client):
    from withruntime.sprites import NotFoundError
    doomed = client.create_sprite(f"{PREFIX}-doomed")
    assert doomed.command("true").output() == b""
    sandbox_id = doomed.id
    client.destroy_sprite(doomed.name)
    assert qemu_gone(server, sandbox_id)
    with pytest.raises(NotFoundError):
        client.get_sprite(doomed.name)
