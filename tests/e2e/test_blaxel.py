"""Blaxel's main flows, written as Blaxel's users write them, with only the
import changed (`withruntime.blaxel`, its sync API): create with envs and
labels, `process.exec` waited for (output, exit, working directory, log
callbacks) and in the background (`wait`, `get`, `logs`, `list`, stdin,
`kill`), `fs` with exact bytes and its `ls`/`find`/`grep`/`cp`/`rm`, a
private preview and its token, get by name (reconnect) and list, a snapshot
and a sandbox forked from it running as it was, a fork of a live sandbox,
archive (standby) and the wake on the next call, delete. One sandbox for the
module where the state does not matter."""
from __future__ import annotations

import hashlib
import os
import uuid

import pytest
from conftest import preview_fetch, qemu_gone

MEMORY = 1024

# The guest's sleep's pid once it runs: a process just started may not have
# exec'd yet.
STARTED_SLEEP = "for i in $(seq 300); do pgrep -x sleep && exit 0; sleep 0.1; done; exit 1"


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def box(server):
    from withruntime.blaxel import SyncSandboxInstance as SandboxInstance
    made = SandboxInstance.create({"name": unique("blaxel"), "memory": MEMORY, "labels": {"suite": "blaxel"},
                                   "envs": [{"name": "GREETING", "value": "hello blaxel"}]})
    try:
        yield made
    finally:
        try:
            made.delete()
        except Exception:  # noqa: BLE001 - the session teardown sweeps what is left
            pass


def test_the_sandbox_is_deployed_with_its_envs_and_labels(box):
    from withruntime.blaxel import SandboxState, Status
    assert (box.status, box.state) == (Status.DEPLOYED, SandboxState.RUNNING)
    assert box.metadata.labels == {"suite": "blaxel"}
    assert box.spec.runtime.memory == MEMORY
    done = box.process.exec({"command": "echo $GREETING; nproc; pwd", "wait_for_completion": True})
    assert done.stdout == "hello blaxel\n1\n/workspace\n"
    assert done.working_dir == "/blaxel"


def test_exec_waited_for_reports_output_exit_and_lines(box):
    from withruntime.blaxel import ProcessResponseStatus
    done = box.process.exec({"name": "greet", "command": "cd /tmp && pwd && uname -s && echo to-err >&2",
                             "wait_for_completion": True})
    assert (done.exit_code, done.status) == (0, ProcessResponseStatus.COMPLETED)
    assert done.stdout == "/tmp\nLinux\n" and done.stderr == "to-err\n"
    failed = box.process.exec({"command": "exit 6", "wait_for_completion": True})
    assert (failed.exit_code, failed.status) == (6, ProcessResponseStatus.FAILED)
    lines: list[str] = []
    errors: list[str] = []
    streamed = box.process.exec({"command": "for i in 1 2 3; do echo l$i; done; echo oops >&2",
                                 "wait_for_completion": True, "on_stdout": lines.append, "on_stderr": errors.append})
    assert lines == ["l1", "l2", "l3"] and errors == ["oops"]
    assert streamed.exit_code == 0
    in_dir = box.process.exec({"command": "pwd", "working_dir": "/tmp", "wait_for_completion": True,
                               "env": {"EXTRA": "x"}})
    assert in_dir.stdout == "/tmp\n" and in_dir.working_dir == "/tmp"


def test_background_processes_are_waited_for_read_listed_fed_and_killed(box):
    from withruntime.blaxel import ProcessResponseStatus
    slow = box.process.exec({"name": "slow", "command": "echo early; sleep 1; echo late >&2", "working_dir": "/tmp"})
    assert slow.status == ProcessResponseStatus.RUNNING
    ended = box.process.wait("slow", max_wait=60000, interval=200)
    assert ended.status == ProcessResponseStatus.COMPLETED and ended.pid == slow.pid
    got = box.process.get("slow")
    assert (got.stdout, got.stderr, got.working_dir) == ("early\n", "late\n", "/tmp")
    assert box.process.logs("slow", "stdout") == "early\n"
    assert sorted(box.process.logs("slow").splitlines()) == ["early", "late"]

    fed = box.process.exec({"name": "fed", "command": "sha256sum", "stdin": True})
    box.process.write_stdin("fed", "through stdin\n")
    box.process.close_stdin("fed")
    assert box.process.wait("fed", max_wait=60000, interval=200).stdout.split()[0] == \
        hashlib.sha256(b"through stdin\n").hexdigest()
    assert fed.name == "fed"

    box.process.exec({"name": "sleeper", "command": "sleep 300"})
    assert "sleeper" in [one.name for one in box.process.list()]
    assert box.process.get("sleeper").status == ProcessResponseStatus.RUNNING
    box.process.kill("sleeper")
    assert box.process.get("sleeper").status == ProcessResponseStatus.KILLED
    assert box.process.exec({"command": "pgrep -x sleep", "wait_for_completion": True}).exit_code == 1


def test_files_keep_exact_bytes_and_are_found(box):
    from withruntime.blaxel import ResponseError
    data = os.urandom(120_000) + b"\x00\xff"
    box.fs.write_binary("/blaxel/data/blob.bin", data)
    assert box.fs.read_binary("/blaxel/data/blob.bin") == data
    guest = box.process.exec({"command": "sha256sum /workspace/data/blob.bin", "wait_for_completion": True})
    assert guest.stdout.split()[0] == hashlib.sha256(data).hexdigest()
    box.fs.mkdir("/blaxel/tree/sub")
    box.fs.write("/blaxel/tree/a.txt", "needle here\n")
    box.fs.write("/blaxel/tree/sub/b.md", "nothing\nNeedle again\n")
    listed = box.fs.ls("/blaxel/tree")
    assert [f.name for f in listed.files] == ["a.txt"] and [d.name for d in listed.subdirectories] == ["sub"]
    assert listed.files[0].size == len("needle here\n")
    found = box.fs.find("/blaxel/tree", type="file")
    assert sorted(m.path for m in found.matches) == ["a.txt", "sub/b.md"]
    hits = box.fs.grep("needle", "/blaxel/tree")
    assert sorted((m.path, m.line) for m in hits.matches) == [("a.txt", 1), ("sub/b.md", 2)]
    box.fs.cp("/blaxel/tree", "/blaxel/copy")
    assert box.fs.read("/blaxel/copy/sub/b.md") == "nothing\nNeedle again\n"
    # A path only root may write, as Blaxel's root sandbox API can.
    box.fs.write("/etc/blaxel-test.conf", "root-owned place\n")
    assert box.process.exec({"command": "cat /etc/blaxel-test.conf", "wait_for_completion": True}).stdout == \
        "root-owned place\n"
    with pytest.raises(ResponseError) as not_empty:
        box.fs.rm("/blaxel/copy")
    assert not_empty.value.status == 422
    box.fs.rm("/blaxel/copy", recursive=True)
    with pytest.raises(ResponseError) as missing:
        box.fs.rm("/blaxel/copy")
    assert missing.value.status == 404
    assert box.process.exec({"command": "test -e /workspace/copy", "wait_for_completion": True}).exit_code == 1


def test_a_private_preview_needs_its_token(server, box):
    from datetime import datetime, timedelta, timezone
    box.fs.write("/blaxel/site/index.html", "served by the guest\n")
    box.process.exec({"name": "web", "command": "python3 -m http.server 8000 --bind 127.0.0.1",
                      "working_dir": "/blaxel/site"})
    preview = box.previews.create({"metadata": {"name": "web"}, "spec": {"port": 8000, "public": False}})
    assert (preview.name, preview.spec.port, preview.spec.public) == ("web", 8000, False)
    token = preview.tokens.create(datetime.now(timezone.utc) + timedelta(hours=1))
    answer = preview_fetch(server, preview.url, "/index.html", {"x-runtime-preview-token": token.value})
    assert (answer.status, answer.body) == (200, b"served by the guest\n")
    assert preview_fetch(server, preview.url, "/index.html").status == 401
    assert [one.name for one in box.previews.list()] == ["web"]
    assert box.previews.get("web").url == preview.url
    box.previews.delete("web")
    assert preview_fetch(server, preview.url, "/index.html").status == 404
    box.process.kill("web")


def test_get_by_name_reconnects_and_list_finds_it(box):
    from withruntime.blaxel import SandboxAPIError
    from withruntime.blaxel import SyncSandboxInstance as SandboxInstance
    box.fs.write("/blaxel/reconnect.txt", "seen again")
    again = SandboxInstance.get(box.metadata.name)
    assert again.withruntime.id == box.withruntime.id
    assert again.fs.read("/blaxel/reconnect.txt") == "seen again"
    # A fresh client finds the process by its name.
    assert again.process.get("greet").stdout == "/tmp\nLinux\n"
    assert box.metadata.name in [one.metadata.name for one in SandboxInstance.list()]
    with pytest.raises(SandboxAPIError):
        SandboxInstance.get(unique("no-such"))


def test_a_snapshot_forks_a_sandbox_running_as_it_was(box):
    from withruntime.blaxel import SyncSandboxInstance as SandboxInstance
    from withruntime.blaxel import SyncSnapshot as Snapshot
    box.process.exec({"command": "echo at-snapshot > /tmp/mark", "wait_for_completion": True})
    box.process.exec({"name": "kept", "command": "sleep 900"})
    pid = box.process.exec({"command": STARTED_SLEEP, "wait_for_completion": True}).stdout.strip()
    assert pid
    snap = box.snapshots.create("before-change")
    target = unique("from-snap")
    try:
        assert (snap.name, snap.status) == ("before-change", "ready")
        assert snap.source.name == box.metadata.name
        assert box.snapshots.get("before-change").id == snap.id
        assert Snapshot.get(snap.id).name == "before-change"
        box.process.exec({"command": "echo after > /tmp/mark", "wait_for_completion": True})
        assert snap.fork(target).name == target
        copy = SandboxInstance.get(target)
        assert copy.withruntime.id != box.withruntime.id
        out = copy.process.exec({"command": "cat /tmp/mark; pgrep -x sleep; echo $GREETING",
                                 "wait_for_completion": True})
        assert out.stdout == f"at-snapshot\n{pid}\nhello blaxel\n", (out.stdout, out.stderr, out.exit_code)
    finally:
        try:
            SandboxInstance.delete(target)
        finally:
            box.snapshots.delete("before-change")
    assert snap.id not in [one.id for one in box.snapshots.list()]
    box.process.kill("kept")


def test_a_fork_of_a_live_sandbox_is_its_own(box):
    from withruntime.blaxel import SyncSandboxInstance as SandboxInstance
    box.fs.write("/blaxel/shared.txt", "from the source")
    target = unique("fork")
    try:
        assert box.fork(target).name == target
        copy = SandboxInstance.get(target)
        assert copy.fs.read("/blaxel/shared.txt") == "from the source"
        copy.fs.write("/blaxel/shared.txt", "changed in the fork")
        assert box.fs.read("/blaxel/shared.txt") == "from the source"
    finally:
        SandboxInstance.delete(target)


def test_archive_is_standby_and_the_next_call_wakes_it(box):
    from withruntime.blaxel import SandboxState, Status
    box.process.exec({"name": "survivor", "command": "sleep 900"})
    pid = box.process.exec({"command": STARTED_SLEEP, "wait_for_completion": True}).stdout.strip()
    assert pid
    box.archive()
    assert (box.status, box.state) == (Status.ARCHIVED, SandboxState.STANDBY)
    assert box.withruntime.state == "paused"
    # The next call wakes it, with its memory and processes.
    assert box.process.exec({"command": "pgrep -x sleep", "wait_for_completion": True}).stdout.strip() == pid
    box.unarchive()
    box.withruntime.refresh()
    assert box.withruntime.state == "running"
    box.process.kill("survivor")


def test_delete_terminates(server):
    from withruntime.blaxel import SandboxAPIError, Status
    from withruntime.blaxel import SyncSandboxInstance as SandboxInstance
    made = SandboxInstance.create({"name": unique("gone"), "memory": MEMORY})
    name = made.metadata.name
    assert made.process.exec({"command": "true", "wait_for_completion": True}).exit_code == 0
    assert SandboxInstance.delete(name).status in (Status.DELETING, Status.TERMINATED)
    made.withruntime.wait_for("stopped")
    assert qemu_gone(server, made.withruntime.id)
    with pytest.raises(SandboxAPIError) as gone:
        SandboxInstance.get(name)
    assert gone.value.status_code == 404


def test_the_async_api_runs_and_deletes(runtime):
    """`SandboxInstance` is Blaxel's async API: the same flows, awaited."""
    import asyncio

    from withruntime.blaxel import SandboxInstance

    async def main() -> str:
        made = await SandboxInstance.create({"name": unique("async"), "memory": MEMORY})
        try:
            done = await made.process.exec({"command": "uname -s; exit 3", "wait_for_completion": True})
            assert (done.exit_code, done.stdout) == (3, "Linux\n")
            data = os.urandom(20_000) + b"\x00"
            await made.fs.write_binary("/blaxel/async.bin", data)
            assert await made.fs.read_binary("/blaxel/async.bin") == data
            await made.process.exec({"name": "bg", "command": "sleep 1; echo later"})
            ended = await made.process.wait("bg", max_wait=60000, interval=200)
            assert ended.exit_code == 0 and (await made.process.get("bg")).stdout == "later\n"
            return made.withruntime.id
        finally:
            await made.delete()
    sandbox_id = asyncio.run(main())
    assert runtime.sandboxes.get(sandbox_id).state in ("stopping", "stopped")


def test_the_docker_template_runs_docker_after_enable_docker(server):
    # Blaxel's `docker-in-sandbox` template is the stock image here; its
    # users start Docker as on Blaxel, with `sudo enable-docker`.
    from withruntime.blaxel import SyncSandboxInstance as SandboxInstance
    made = SandboxInstance.create({"name": unique("blaxel-docker"), "memory": MEMORY,
                                   "image": "blaxel/docker-in-sandbox:latest"})
    try:
        started = made.process.exec({"command": "sudo enable-docker", "wait_for_completion": True})
        assert started.exit_code == 0, started.logs
        info = made.process.exec({"command": "docker info --format '{{.ServerVersion}} {{.Driver}}'",
                                  "wait_for_completion": True})
        assert info.exit_code == 0 and info.stdout.split()[1] == "overlay2", info.logs
    finally:
        made.delete()
