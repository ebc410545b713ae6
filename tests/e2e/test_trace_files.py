"""Traced files (`trace_files=True`): what a command and everything it
started opened and wrote, seen by the guest's kernel (fanotify on a mount
namespace of the command's own), through the official client."""
from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from conftest import assert_error_body, http

SETUP = (
    "set -e; mkdir -p /workspace/trace/real; ln -sfn /workspace/trace/real /workspace/trace/link; "
    "echo known > /workspace/trace/known.txt; echo other > /workspace/trace/other.txt; "
    "rm -f /workspace/trace/real/*.txt"
)


@pytest.fixture(scope="module")
def tree(sbx):
    assert sbx.exec(SETUP).exit_code == 0
    return sbx


def realpath(sbx, path: str) -> str:
    return sbx.exec(["readlink", "-f", path]).stdout.strip()


def test_exec_lists_reads_writes_and_what_its_children_opened(tree):
    sbx = tree
    script = (
        "cat /workspace/trace/known.txt; echo made > /workspace/trace/link/new.txt; "
        "ls /workspace/trace/real > /dev/null; "
        "sh -c 'cat /etc/hostname; python3 -c \"open(\\\"/workspace/trace/real/py.txt\\\", \\\"w\\\").write(\\\"x\\\")\"'"
    )
    result = sbx.exec(script, trace_files=True)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.startswith("known\n")
    files = result.files
    assert files is not None, "a traced exec answers its files"
    assert not files.truncated
    assert files.read == sorted(files.read)
    assert files.written == sorted(files.written)
    assert all(p.startswith("/") for p in files.read + files.written), files
    # What the command itself read.
    assert "/workspace/trace/known.txt" in files.read
    # A write through a symlinked directory: the real path, never the link's.
    assert "/workspace/trace/real/new.txt" in files.written
    assert not any(p.startswith("/workspace/trace/link/") for p in files.read + files.written), files
    # A directory listed: with a trailing slash.
    assert "/workspace/trace/real/" in files.read
    # What its children (sh, then python3) opened.
    assert realpath(sbx, "/etc/hostname") in files.read
    assert "/workspace/trace/real/py.txt" in files.written
    python = realpath(sbx, "/usr/bin/python3")
    assert python in files.read
    if python != "/usr/bin/python3":
        assert "/usr/bin/python3" not in files.read
    # Only what was written is in `written`; nothing under /proc or /dev.
    assert "/workspace/trace/known.txt" not in files.written
    assert not any(p.startswith(("/proc/", "/sys/", "/dev/")) for p in files.read), files
    # Untraced, an exec says nothing of files.
    assert sbx.exec("cat /workspace/trace/known.txt").files is None


def test_another_untraced_command_running_meanwhile_is_not_seen(tree):
    sbx = tree
    marker = f"/workspace/trace/busy-{uuid.uuid4().hex[:8]}.txt"
    busy = sbx.spawn(f"echo x > {marker}; while true; do cat {marker} /workspace/trace/other.txt > /dev/null; "
                     "sleep 0.05; done")
    try:
        # The busy loop runs (it has read its file at least once).
        deadline = time.monotonic() + 60
        while sbx.exec(["test", "-s", marker]).exit_code != 0:
            assert time.monotonic() < deadline, "the busy loop did not start"
            time.sleep(0.2)
        result = sbx.exec("sleep 1; cat /workspace/trace/known.txt", trace_files=True)
        assert result.exit_code == 0
        assert "/workspace/trace/known.txt" in result.files.read
        assert marker not in result.files.read + result.files.written, result.files
        assert "/workspace/trace/other.txt" not in result.files.read, result.files
    finally:
        busy.kill("SIGKILL")
        busy.wait()


def test_spawn_files_answer_once_it_ended(tree):
    from withruntime import ConflictError

    sbx = tree
    proc = sbx.spawn("sleep 3; cat /workspace/trace/known.txt; echo out > /workspace/trace/real/spawned.txt",
                     trace_files=True)
    with pytest.raises(ConflictError) as running:
        proc.files()
    assert running.value.code == "process_running"
    assert running.value.status == 409
    result = proc.wait()
    assert result.exit_code == 0
    files = proc.files()
    assert "/workspace/trace/known.txt" in files.read
    assert "/workspace/trace/real/spawned.txt" in files.written
    assert not files.truncated
    # A process started without tracing says so.
    plain = sbx.spawn("true")
    plain.wait()
    with pytest.raises(ConflictError) as untraced:
        plain.files()
    assert untraced.value.code == "process_not_traced"


def test_exec_stream_exit_event_carries_files(tree):
    sbx = tree
    events = list(sbx.exec_stream("cat /workspace/trace/known.txt; echo s > /workspace/trace/real/streamed.txt",
                                  trace_files=True))
    exit_event = events[-1]
    assert exit_event["type"] == "exit" and exit_event["exitCode"] == 0
    assert "/workspace/trace/known.txt" in exit_event["files"]["read"]
    assert exit_event["files"]["written"] == ["/workspace/trace/real/streamed.txt"]
    # exec() that streams its output builds its result from that event.
    seen = []
    result = sbx.exec("cat /workspace/trace/other.txt", trace_files=True, on_stdout=seen.append)
    assert "".join(seen) == "other\n"
    assert "/workspace/trace/other.txt" in result.files.read


def test_async_client_traces_too(tree):
    from withruntime import AsyncRuntime

    async def scenario():
        async with AsyncRuntime() as rt:
            sbx = await rt.sandboxes.get(tree.id)
            result = await sbx.exec("cat /workspace/trace/known.txt", trace_files=True)
            assert "/workspace/trace/known.txt" in result.files.read
            proc = await sbx.spawn("cat /workspace/trace/other.txt", trace_files=True)
            await proc.wait()
            files = await proc.files()
            assert "/workspace/trace/other.txt" in files.read

    asyncio.run(scenario())


def test_raw_requests_name_a_wrong_field_and_unknown_processes(server, tree):
    answer = http(server, "POST", f"/v1/sandboxes/{tree.id}:exec", {"command": "true", "traceFiles": "yes"})
    error = assert_error_body(answer, 400, "invalid_request")
    assert [i["field"] for i in error["details"]["issues"]] == ["traceFiles"]
    answer = http(server, "GET", f"/v1/sandboxes/{tree.id}/processes/proc_nope/files")
    assert_error_body(answer, 404, "process_not_found")
