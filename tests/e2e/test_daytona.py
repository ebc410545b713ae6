"""Daytona's main flows, written as Daytona's users write them, with only the
import changed (`withruntime.daytona`): create, run commands and code, exact
bytes in and out, sessions that keep their state and run commands in the
background, list and get, stop and start again keeping memory, snapshots,
another user, delete. One sandbox for the module where state does not
matter."""
from __future__ import annotations

import os
import time

import pytest


@pytest.fixture(scope="module")
def daytona(server):
    from withruntime.daytona import Daytona
    with Daytona() as client:
        yield client


@pytest.fixture(scope="module")
def box(daytona):
    from withruntime.daytona import CreateSandboxFromSnapshotParams
    sandbox = daytona.create(CreateSandboxFromSnapshotParams(labels={"suite": "daytona"}))
    try:
        yield sandbox
    finally:
        try:
            daytona.delete(sandbox)
        except Exception:  # noqa: BLE001 - the session teardown sweeps what is left
            pass


def test_commands_and_code_run_in_the_vm(box):
    r = box.process.exec("uname -s; echo $((6 * 7)); echo oops >&2")
    assert r.exit_code == 0
    assert r.result == "Linux\n42\noops\n"
    # A non-zero exit is a result, as in Daytona.
    assert box.process.exec("exit 4").exit_code == 4
    assert box.process.exec("pwd").result.strip() == box.get_work_dir()
    ran = box.process.code_run("import platform, sys; print(platform.system(), sys.version_info[0], sum(range(10)))")
    assert (ran.exit_code, ran.result) == (0, "Linux 3 45\n")
    assert box.process.exec("echo $DAYTONA_GREETING", env={"DAYTONA_GREETING": "hello"}).result == "hello\n"


def test_typescript_code_runs_under_bun(daytona):
    from withruntime.daytona import CreateSandboxFromSnapshotParams
    ts = daytona.create(CreateSandboxFromSnapshotParams(language="typescript"))
    try:
        ran = ts.process.code_run("const n: number = [1, 2, 3].reduce((a, b) => a + b); console.log(n, typeof Bun)")
        assert (ran.exit_code, ran.result) == (0, "6 object\n")
    finally:
        daytona.delete(ts)


def test_files_keep_exact_bytes(box):
    data = os.urandom(70_000) + b"\x00\xff"
    box.fs.create_folder("data", "755")
    box.fs.upload_file(data, "data/blob.bin")
    assert box.fs.download_file("data/blob.bin") == data
    assert box.fs.get_file_info("data/blob.bin").size == len(data)
    assert "blob.bin" in [f.name for f in box.fs.list_files("data")]
    # The VM computed the digest of what it holds.
    digest = box.process.exec("sha256sum data/blob.bin | cut -d' ' -f1").result.strip()
    import hashlib
    assert digest == hashlib.sha256(data).hexdigest()
    box.fs.upload_file(b"alpha beta alpha\n", "data/words.txt")
    assert [m.file for m in box.fs.find_files("data", "beta")] == [f"{box.get_work_dir()}/data/words.txt"]
    box.fs.replace_in_files([f"{box.get_work_dir()}/data/words.txt"], "alpha", "gamma")
    assert box.fs.download_file("data/words.txt") == b"gamma beta gamma\n"


def test_a_session_keeps_its_state_and_runs_commands_in_the_background(box):
    from withruntime.daytona import SessionExecuteRequest
    box.process.create_session("work")
    try:
        box.process.execute_session_command("work", SessionExecuteRequest(command="cd /tmp && export COUNT=7"))
        r = box.process.execute_session_command("work", SessionExecuteRequest(command="echo $COUNT $(pwd)"))
        assert (r.exit_code, r.output) == (0, "7 /tmp\n")
        started = box.process.execute_session_command(
            "work", SessionExecuteRequest(command="sleep 1; echo finished; (exit 5)", run_async=True))
        assert started.cmd_id and started.exit_code is None
        deadline = time.monotonic() + 60
        while box.process.get_session_command("work", started.cmd_id).exit_code is None:
            assert time.monotonic() < deadline, "the background command did not end"
            time.sleep(0.3)
        assert box.process.get_session_command("work", started.cmd_id).exit_code == 5
        logs = box.process.get_session_command_logs("work", started.cmd_id)
        assert "finished" in (logs.output or logs.stdout)
        assert "work" in [s.session_id for s in box.process.list_sessions()]
    finally:
        box.process.delete_session("work")


def test_list_get_and_stop_then_start_keeps_memory(daytona, box):
    from withruntime.daytona import SessionExecuteRequest
    assert box.id in [s.id for s in daytona.list()]
    assert daytona.get(box.id).id == box.id
    # A long-running program, started as Daytona users do: in a session.
    box.process.create_session("holder")
    box.process.execute_session_command(
        "holder", SessionExecuteRequest(command="echo $$ > /tmp/holder.pid; sleep 900", run_async=True))
    deadline = time.monotonic() + 30
    pid = ""
    while not pid.isdigit():
        assert time.monotonic() < deadline, "the session's command did not start"
        time.sleep(0.3)
        pid = box.process.exec("cat /tmp/holder.pid 2>/dev/null").result.strip()
    box.stop()
    # Daytona's stop keeps files and memory: on Runtime, a pause.
    assert daytona.get(box.id).withruntime.state == "paused"
    box.start()
    # Paused, not rebooted: the same process is still there.
    assert box.process.exec(f"kill -0 {pid} && echo alive").result == "alive\n"


def test_a_snapshot_and_a_sandbox_from_it(daytona, box, runtime):
    from withruntime.daytona import CreateSandboxFromSnapshotParams
    box.fs.upload_file(b"kept in the snapshot\n", "snap.txt")
    name = f"e2e-daytona-{os.getpid()}"
    box.create_snapshot(name)
    copy = daytona.create(CreateSandboxFromSnapshotParams(snapshot=name))
    try:
        assert copy.fs.download_file("snap.txt") == b"kept in the snapshot\n"
        assert copy.id != box.id
    finally:
        daytona.delete(copy)
        for snap in runtime.snapshots.list(name=name).to_list():
            runtime.snapshots.delete(snap["id"])


def test_the_owner_user_is_the_sandbox_user(daytona):
    from withruntime.daytona import CreateSandboxFromSnapshotParams
    sandbox = daytona.create(CreateSandboxFromSnapshotParams(os_user="daytona"))
    try:
        who = sandbox.process.exec("id -un; id -u; echo $HOME").result.split()
        assert who == ["runtime", "1000", "/workspace"], who
        assert sandbox.get_user_home_dir() == "/workspace"
    finally:
        daytona.delete(sandbox)
