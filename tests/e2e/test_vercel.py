"""Vercel Sandbox's main flows, written as Vercel's users write them, with only
the import changed (`withruntime.vercel.sandbox.sync`): create, run a process
(argv kept word for word, output streamed, exit code), exact bytes through
`fs`, a detached process and its output, get by name (reconnect), extend the
time limit, a port shared as a route, fork (memory and processes copied),
stop (a persistent sandbox pauses and keeps its memory), and a snapshot that
stops its source and seeds a new sandbox. One sandbox for the module where
the state does not matter."""
from __future__ import annotations

import hashlib
import os
import subprocess
import uuid
from datetime import timedelta

import pytest
from conftest import preview_fetch

SMALL = {"vcpus": 1, "memory": 1024}

# The guest's sleep's pid once it runs: a process just started may not have
# exec'd yet.
STARTED_SLEEP = "for i in $(seq 300); do pgrep -x sleep && exit 0; sleep 0.1; done; exit 1"


@pytest.fixture(scope="module")
def box(server):
    from withruntime.vercel.sandbox import sync as sandbox
    made = sandbox.create_sandbox(name=f"vercel-{uuid.uuid4().hex[:10]}", resources=sandbox.SandboxResources(**SMALL),
                                  tags={"suite": "vercel"}, execution_time_limit=timedelta(minutes=30))
    try:
        yield made
    finally:
        try:
            made.destroy()
        except Exception:  # noqa: BLE001 - the session teardown sweeps what is left
            pass


class Lines:
    """A file-like sink, as a user passes to run_process(stdout=...)."""

    def __init__(self) -> None:
        self.chunks: list[str] = []

    def write(self, text: str) -> None:
        self.chunks.append(text)


def test_the_sandbox_has_vercels_shape(box):
    from withruntime.vercel.sandbox import sync as sandbox
    assert box.status == sandbox.SandboxStatus.RUNNING
    assert (box.vcpus, box.memory) == (1, 1024)
    assert box.tags == {"suite": "vercel"}
    assert box.persistent
    # What the guest's own kernel reports matches the machine asked for.
    cpus = box.run_process("nproc", capture_output=True)
    assert cpus.stdout == "1\n"
    total_kib = int(box.run_process("sh", ["-c", "sed -n 's/^MemTotal: *\\([0-9]*\\) kB/\\1/p' /proc/meminfo"],
                                    capture_output=True).stdout)
    assert 800 * 1024 < total_kib <= 1024 * 1024


def test_run_process_keeps_argv_streams_output_and_reports_the_exit(box):
    done = box.run_process("sh", ["-c", "uname -s; echo to-err >&2; exit 3"], capture_output=True)
    assert (done.returncode, done.stdout, done.stderr) == (3, "Linux\n", "to-err\n")
    assert done.cwd == "/vercel/sandbox"
    with pytest.raises(subprocess.CalledProcessError) as raised:
        box.run_process("sh", ["-c", "exit 7"], check=True)
    assert raised.value.returncode == 7
    # Each argument is one word in the guest, spaces and quotes included.
    words = box.run_process("printf", ["<%s>", "a b", "it's", "$HOME"], capture_output=True)
    assert words.stdout == "<a b><it's><$HOME>"
    streamed = Lines()
    box.run_process("sh", ["-c", "for i in 1 2 3; do echo line$i; done"], stdout=streamed)
    assert "".join(streamed.chunks) == "line1\nline2\nline3\n"
    merged = box.run_process("sh", ["-c", "echo out; echo err >&2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert sorted(merged.stdout.splitlines()) == ["err", "out"] and not merged.stderr
    env = box.run_process("sh", ["-c", "echo $GREETING; pwd"], env={"GREETING": "hi there"}, cwd="/tmp",
                          capture_output=True)
    assert env.stdout == "hi there\n/tmp\n"
    # Vercel's home is the guest's /workspace, also reachable by its own name.
    box.fs.write_text("home.txt", "in the home\n")
    assert box.run_process("cat", ["/vercel/sandbox/home.txt"], capture_output=True).stdout == "in the home\n"
    assert box.run_process("cat", ["/workspace/home.txt"], capture_output=True).stdout == "in the home\n"


def test_files_keep_exact_bytes(box):
    from withruntime.vercel.sandbox import sync as sandbox
    data = os.urandom(200_000) + b"\x00\xff\r\n"
    box.fs.write_bytes("data/blob.bin", data)
    assert box.fs.read_bytes("/vercel/sandbox/data/blob.bin") == data
    sha = box.run_process("sha256sum", ["/workspace/data/blob.bin"], capture_output=True).stdout.split()[0]
    assert sha == hashlib.sha256(data).hexdigest()
    box.fs.mkdir("tree/a/b")
    assert box.fs.is_dir("tree/a/b") and not box.fs.is_file("tree/a/b")
    box.fs.write_text("tree/a/one.txt", "one", mode=0o600)
    assert box.run_process("stat", ["-c", "%a", "tree/a/one.txt"], capture_output=True).stdout == "600\n"
    with box.fs.batch(cwd="tree") as batch:
        batch.write_text("two.txt", "two")
        batch.write_bytes("a/b/three.bin", b"\x03")
    listed = {(entry.path, entry.kind) for entry in box.fs.listdir("tree")}
    assert listed == {("a", "directory"), ("two.txt", "file")}
    assert box.run_process("cat", ["tree/two.txt", "tree/a/b/three.bin"], capture_output=True).stdout == "two\x03"
    with box.fs.open("tree/handle.txt", "w") as handle:
        handle.write("first\n")
        handle.writelines(["second\n"])
    with box.fs.open("tree/handle.txt") as handle:
        assert handle.readline() == "first\n" and handle.read() == "second\n"
    box.fs.rename("tree/two.txt", "tree/renamed.txt")
    assert not box.fs.exists("tree/two.txt") and box.fs.read_text("tree/renamed.txt") == "two"
    box.fs.remove("tree", recursive=True)
    assert not box.fs.exists("tree")
    assert box.run_process("test", ["-e", "/workspace/tree"]).returncode == 1
    with pytest.raises(sandbox.SandboxPathNotFoundError):
        box.fs.read_bytes("no-such-file")
    with pytest.raises(sandbox.SandboxPathNotFoundError):
        box.fs.remove("no-such-file")
    box.fs.remove("no-such-file", missing_ok=True)


def test_a_detached_process_is_read_waited_for_and_found_again(box):
    from withruntime.vercel.sandbox import sync as sandbox
    process = box.create_process("sh", ["-c", "echo started $$; sleep 2; echo ending >&2; exit 5"])
    first = process.stdout.readline()
    assert first.startswith("started ")
    guest_pid = first.split()[1]
    assert process.wait() == 5
    assert process.status == sandbox.ProcessStatus.EXITED and process.returncode == 5
    assert process.stderr.read() == "ending\n"
    again = box.get_process(process.id, wait=True)
    assert again.returncode == 5
    assert again.communicate() == (f"started {guest_pid}\n", "ending\n")

    sleeper = box.create_process("sleep", ["300"])
    assert sleeper.id in [one.id for one in box.query_processes()]
    pid = box.run_process("sh", ["-c", STARTED_SLEEP], capture_output=True).stdout.split()
    assert len(pid) == 1
    sleeper.kill()
    assert sleeper.wait() != 0
    assert box.run_process("pgrep", ["-x", "sleep"]).returncode == 1


def test_get_sandbox_by_name_reconnects(box):
    from withruntime.vercel.sandbox import sync as sandbox
    box.fs.write_text("reconnect.txt", "seen again\n")
    again = sandbox.get_sandbox(name=box.name)
    assert again.withruntime.id == box.withruntime.id
    assert again.run_process("cat", ["reconnect.txt"], capture_output=True).stdout == "seen again\n"
    by_id = sandbox.get_sandbox(name=box.withruntime.id)
    assert by_id.name == box.name
    found = [one.name for one in sandbox.query_sandboxes(
        sandbox.SandboxQueryByName(name_prefix="vercel-", tag=sandbox.TagFilter(key="suite", value="vercel")))]
    assert box.name in found
    with pytest.raises(sandbox.SandboxApiError) as missing:
        sandbox.get_sandbox(name=f"no-such-{uuid.uuid4().hex[:8]}")
    assert missing.value.status_code == 404


def test_extend_moves_the_end_later(box):
    before = box.execution_time_limit
    ends = box.withruntime.info["endsAt"]
    box.extend_execution_time_limit(timedelta(minutes=5))
    assert box.execution_time_limit == before + timedelta(minutes=5)
    box.refresh()
    assert box.withruntime.info["endsAt"] > ends
    assert box.run_process("true").returncode == 0


def test_a_port_is_shared_as_a_route(server, box):
    box.fs.write_text("site/index.html", "served by the guest\n")
    web = box.create_process("python3", ["-m", "http.server", "8000", "--bind", "127.0.0.1",
                                         "--directory", "/workspace/site"])
    box.update(ports=[8000])
    [route] = box.routes
    assert route.port == 8000 and route.subdomain.startswith("8000-")
    answer = preview_fetch(server, route.url, "/index.html")
    assert (answer.status, answer.body) == (200, b"served by the guest\n")
    box.update(ports=[])
    assert box.routes == ()
    assert preview_fetch(server, route.url, "/index.html").status == 404
    web.kill()
    assert web.wait() != 0


def test_a_fork_copies_memory_and_goes_its_own_way(box):
    from withruntime.vercel.sandbox import sync as sandbox
    box.run_process("sh", ["-c", "echo before-fork > /tmp/fork-mark"])
    box.create_process("sleep", ["900"])
    pid = box.run_process("sh", ["-c", STARTED_SLEEP], capture_output=True).stdout.strip()
    assert pid
    with sandbox.fork_sandbox(source_sandbox=box.name) as copy:
        assert copy.withruntime.id != box.withruntime.id
        assert copy.run_process("cat", ["/tmp/fork-mark"], capture_output=True).stdout == "before-fork\n"
        assert copy.run_process("pgrep", ["-x", "sleep"], capture_output=True).stdout.strip() == pid
        copy.fs.write_text("only-in-fork.txt", "fork")
        assert not box.fs.exists("only-in-fork.txt")
    copy.refresh()
    assert copy.withruntime.state in ("stopping", "stopped")
    box.run_process("pkill", ["-x", "sleep"])


def test_stop_pauses_a_persistent_sandbox_and_the_next_call_wakes_it(server):
    from withruntime.vercel.sandbox import sync as sandbox
    made = sandbox.create_sandbox(resources=sandbox.SandboxResources(**SMALL))
    try:
        made.run_process("sh", ["-c", "echo in-memory > /tmp/mark"])
        sleeper = made.create_process("sleep", ["600"])
        pid = made.run_process("sh", ["-c", STARTED_SLEEP], capture_output=True).stdout.strip()
        assert pid
        made.stop()
        assert made.status == sandbox.SandboxStatus.STOPPED
        assert made.withruntime.state == "paused"
        # The next call wakes it: tmpfs and the process survived the pause.
        assert made.run_process("cat", ["/tmp/mark"], capture_output=True).stdout == "in-memory\n"
        assert made.run_process("pgrep", ["-x", "sleep"], capture_output=True).stdout.strip() == pid
        assert made.status == sandbox.SandboxStatus.RUNNING
        sleeper.kill()
    finally:
        made.destroy()
    assert made.withruntime.state in ("stopping", "stopped")
    # The sync module does not re-export this error; the package does.
    from withruntime.vercel.sandbox import SandboxInvalidHandleError
    with pytest.raises(SandboxInvalidHandleError):
        made.run_process("true")


def test_a_snapshot_stops_its_source_and_seeds_a_new_sandbox(server):
    from withruntime.vercel.sandbox import sync as sandbox
    marker = uuid.uuid4().hex
    source = sandbox.create_sandbox(resources=sandbox.SandboxResources(**SMALL), persistent=False)
    copy = None
    try:
        source.fs.write_text("marker.txt", marker)
        source.create_process("sleep", ["600"])
        snap = source.snapshot(expiration=timedelta(days=2))
        assert snap.status == "created" and snap.source_session_id == source.withruntime.id
        assert snap.size_bytes > 0 and snap.expires_at > snap.created_at
        source.refresh()
        assert source.status == sandbox.SandboxStatus.STOPPED and source.withruntime.state == "stopped"
        assert sandbox.get_snapshot(snapshot_id=snap.id).id == snap.id
        copy = sandbox.create_sandbox(source=sandbox.SnapshotSource(snapshot_id=snap.id))
        assert copy.withruntime.id != source.withruntime.id
        assert copy.fs.read_text("marker.txt") == marker
        # A disk snapshot restores files, not processes.
        assert copy.run_process("pgrep", ["-x", "sleep"]).returncode == 1
        assert snap.delete().status == "deleted"
    finally:
        source.destroy()
        if copy is not None:
            copy.destroy()


def test_the_async_api_runs_and_destroys_on_exit(runtime):
    """`from vercel import sandbox` is Vercel's async API: the same flows, awaited."""
    import asyncio

    from withruntime.vercel import sandbox

    async def main() -> str:
        async with sandbox.create_sandbox(resources=sandbox.SandboxResources(**SMALL), persistent=False) as made:
            done = await made.run_process("sh", ["-c", "uname -s; exit 2"], capture_output=True)
            assert (done.returncode, done.stdout) == (2, "Linux\n")
            data = os.urandom(20_000) + b"\x00"
            await made.fs.write_bytes("async.bin", data)
            assert await made.fs.read_bytes("async.bin") == data
            guest = await made.run_process("sha256sum", ["async.bin"], capture_output=True)
            assert guest.stdout.split()[0] == hashlib.sha256(data).hexdigest()
            process = await made.create_process("sh", ["-c", "echo one; echo two >&2; exit 4"])
            assert await process.wait() == 4
            assert (await process.stdout.read(), await process.stderr.read()) == ("one\n", "two\n")
            return made.withruntime.id
    sandbox_id = asyncio.run(main())
    # Leaving the block destroyed it.
    assert runtime.sandboxes.get(sandbox_id).state in ("stopping", "stopped")
