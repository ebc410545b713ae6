"""Runloop's main flows, written as Runloop's users write them, with only the
import changed (`withruntime.runloop`): a devbox created with environment
variables, file mounts and launch commands; `cmd.exec` and its output, named
shells that keep their directory and variables, `exec_async` with its state,
result, streamed output, stdin and kill; files in and out as exact bytes;
reconnect by id and list; a disk snapshot, its record and a devbox from it;
suspend and resume (the disk kept, a new boot); shutdown. One devbox for the
module where the state does not matter."""
from __future__ import annotations

import hashlib
import os
import uuid

import pytest

SMALL = {"custom_cpu_cores": 1, "custom_gb_memory": 1}

# The guest's sleep's pid once it runs: a process just started may not have
# exec'd yet.
STARTED_SLEEP = "for i in $(seq 300); do pgrep -x sleep && exit 0; sleep 0.1; done; exit 1"


@pytest.fixture(scope="module")
def sdk(server):
    from withruntime.runloop import RunloopSDK
    # As Runloop's users write it: the key and address come from the environment.
    with RunloopSDK() as client:
        yield client


@pytest.fixture(scope="module")
def devbox(sdk):
    made = sdk.devbox.create(
        name=f"runloop-{uuid.uuid4().hex[:10]}", environment_variables={"GREETING": "hello runloop"},
        metadata={"suite": "runloop"}, file_mounts={"/workspace/mounted.txt": "mounted by create\n"},
        launch_parameters={**SMALL, "keep_alive_time_seconds": 1800,
                           "launch_commands": ["echo launched $GREETING > /workspace/launch.txt"]})
    try:
        yield made
    finally:
        try:
            made.shutdown()
        except Exception:  # noqa: BLE001 - the session teardown sweeps what is left
            pass


def test_create_applies_env_mounts_and_launch_commands(devbox):
    info = devbox.get_info()
    assert info.status == "running" and info.metadata == {"suite": "runloop"}
    assert devbox.file.read(file_path="/workspace/mounted.txt") == "mounted by create\n"
    # The launch command ran in the guest with the devbox's environment.
    assert devbox.cmd.exec("cat /workspace/launch.txt").stdout() == "launched hello runloop\n"
    assert devbox.cmd.exec("nproc").stdout() == "1\n"


def test_exec_returns_the_guests_output_and_exit(devbox):
    result = devbox.cmd.exec("uname -s; echo $GREETING; echo to-err >&2; exit 4")
    assert (result.exit_code, result.success, result.failed) == (4, False, True)
    assert result.stdout() == "Linux\nhello runloop\n" and result.stderr() == "to-err\n"
    assert result.stdout(num_lines=1) == "hello runloop"
    assert result.result.exit_status == 4
    seen_out: list[str] = []
    seen_all: list[str] = []
    streamed = devbox.cmd.exec("for i in 1 2 3; do echo n$i; done; echo e >&2", stdout=seen_out.append,
                               output=seen_all.append)
    assert streamed.success and "".join(seen_out) == "n1\nn2\nn3\n"
    assert sorted("".join(seen_all).splitlines()) == ["e", "n1", "n2", "n3"]


def test_a_named_shell_keeps_its_directory_and_variables(devbox):
    shell = devbox.shell("build")
    assert shell.exec("cd /tmp && export STEP=two").success
    assert shell.exec("pwd; echo $STEP").stdout() == "/tmp\ntwo\n"
    # Another shell starts afresh.
    assert devbox.shell("other").exec("pwd; echo ${STEP:-unset}").stdout() == "/workspace\nunset\n"


def test_exec_async_runs_in_the_background(sdk, devbox):
    execution = devbox.cmd.exec_async("echo begin; sleep 4; echo end >&2; exit 2")
    assert execution.get_state().status == "running"
    done = execution.result()
    assert (done.exit_code, done.stdout(), done.stderr()) == (2, "begin\n", "end\n")
    state = execution.get_state()
    assert (state.status, state.exit_status) == ("completed", 2)
    # Runloop's REST client reads the same execution by its id.
    api = sdk.api.devboxes
    chunks = api.executions.stream_stdout_updates(execution.execution_id, devbox_id=devbox.id)
    assert "".join(chunk.output for chunk in chunks) == "begin\n"
    assert api.executions.retrieve(execution.execution_id, devbox_id=devbox.id).exit_status == 2

    reader = devbox.cmd.exec_async("sha256sum", attach_stdin=True)
    reader.send_std_in("fed through stdin\n")
    reader.close_std_in()
    expected = hashlib.sha256(b"fed through stdin\n").hexdigest()
    assert reader.result().stdout().split()[0] == expected

    sleeper = devbox.cmd.exec_async("sleep 300")
    assert devbox.cmd.exec(STARTED_SLEEP).success
    sleeper.kill()
    assert sleeper.result().exit_code != 0
    assert sleeper.get_state().status == "completed"
    assert not devbox.cmd.exec("pgrep -x sleep").success


def test_files_in_and_out_keep_exact_bytes(sdk, devbox):
    devbox.file.write(file_path="/workspace/notes.txt", contents="written by runloop\n")
    assert devbox.cmd.exec("cat /workspace/notes.txt").stdout() == "written by runloop\n"
    data = os.urandom(150_000) + b"\x00\xff"
    devbox.file.upload(path="/workspace/blob.bin", file=data)
    assert devbox.file.download(path="/workspace/blob.bin") == data
    guest_sha = devbox.cmd.exec("sha256sum /workspace/blob.bin").stdout().split()[0]
    assert guest_sha == hashlib.sha256(data).hexdigest()
    answer = sdk.api.devboxes.download_file(devbox.id, path="/workspace/blob.bin")
    assert answer.read() == data
    assert sdk.api.devboxes.read_file_contents(devbox.id, file_path="/workspace/notes.txt") == "written by runloop\n"


def test_reconnect_by_id_and_list(sdk, devbox):
    again = sdk.devbox.from_id(devbox.id)
    assert again.cmd.exec("cat /proc/sys/kernel/random/boot_id").stdout() == \
        devbox.cmd.exec("cat /proc/sys/kernel/random/boot_id").stdout()
    assert devbox.id in [one.id for one in sdk.devbox.list()]
    assert sdk.api.devboxes.retrieve(devbox.id).status == "running"
    before = devbox._sandbox().info["endsAt"]
    assert sdk.api.devboxes.keep_alive(devbox.id).status == "running"
    assert devbox._sandbox().info["endsAt"] > before


def test_disk_snapshot_update_and_a_devbox_from_it(sdk, devbox):
    marker = uuid.uuid4().hex
    assert devbox.cmd.exec(f"echo {marker} > /workspace/marker && uname -s").stdout() == "Linux\n"
    snapshot = devbox.snapshot_disk(name="checkpoint", metadata={"step": "1"}, commit_message="first")
    clone = None
    try:
        info = snapshot.await_completed()
        assert info.status == "complete"
        assert info.snapshot.source_devbox_id == devbox.id
        assert (info.snapshot.name, info.snapshot.metadata, info.snapshot.commit_message) == \
            ("checkpoint", {"step": "1"}, "first")
        assert info.snapshot.size_bytes > 0
        assert snapshot.update(metadata={"step": "2"}).metadata == {"step": "2"}
        assert snapshot.get_info().snapshot.name == "checkpoint", "an update keeps what it does not name"
        assert [one.id for one in sdk.snapshot.list(devbox_id=devbox.id)] == [snapshot.id]
        clone = snapshot.create_devbox()
        assert clone.id != devbox.id
        assert clone.cmd.exec("cat /workspace/marker").stdout() == f"{marker}\n"
        # The clone keeps the saved environment.
        assert clone.cmd.exec("echo $GREETING").stdout() == "hello runloop\n"
    finally:
        if clone is not None:
            clone.shutdown()
        snapshot.delete()
    assert snapshot.id not in [one.id for one in sdk.snapshot.list(devbox_id=devbox.id)]


def test_suspend_keeps_the_disk_and_resume_boots_again(sdk):
    box = sdk.devbox.create(launch_parameters=SMALL)
    try:
        box.cmd.exec("echo on-disk > /workspace/kept.txt && sync")
        boot = box.cmd.exec("cat /proc/sys/kernel/random/boot_id").stdout()
        assert box.suspend().status == "suspended"
        assert box._sandbox().state == "stopped"
        assert box.resume().status == "running"
        assert box.cmd.exec("cat /workspace/kept.txt").stdout() == "on-disk\n"
        assert box.cmd.exec("cat /proc/sys/kernel/random/boot_id").stdout() != boot
    finally:
        info = box.shutdown()
    assert info.status == "shutdown"
    assert sdk.api.devboxes.retrieve(box.id).status == "shutdown"
