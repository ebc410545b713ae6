"""Prime Intellect's sandbox flows, written as Prime's users write them, with
only the import changed (`withruntime.prime`), on the `default` image (no
registry): create with a start command, environment and labels, wait for
creation, `execute_command` (output, exit, env, working directory, timeout),
files in and out as exact bytes and `read_file`'s windows, background jobs,
list and statuses, network rules, filesystem checkpoints and a sandbox
restored from one, delete. One sandbox for the module where the state does
not matter."""
from __future__ import annotations

import hashlib
import os
import time
import uuid

import pytest
from conftest import qemu_gone

SUITE = f"prime-{uuid.uuid4().hex[:8]}"

# The guest's sleep's pid once it runs: a process just started may not have
# exec'd yet.
STARTED_SLEEP = "for i in $(seq 300); do pgrep -x sleep && exit 0; sleep 0.1; done; exit 1"


def request(**fields):
    from withruntime.prime import CreateSandboxRequest
    base = {"name": f"{SUITE}-{uuid.uuid4().hex[:6]}", "docker_image": "default", "cpu_cores": 1, "memory_gb": 1,
            "disk_size_gb": 4, "labels": [SUITE]}
    return CreateSandboxRequest(**{**base, **fields})


@pytest.fixture(scope="module")
def client(server):
    from withruntime.prime import SandboxClient
    # As Prime's users write it, with the key from the environment.
    with SandboxClient() as made:
        yield made


@pytest.fixture(scope="module")
def sandbox(client):
    from withruntime.prime import StartCommand
    made = client.create(request(environment_vars={"GREETING": "hello prime"},
                                 start_command=StartCommand("sh", ["-c", "echo started by prime; sleep 900"])))
    try:
        client.wait_for_creation(made.id)
        yield made
    finally:
        try:
            client.delete(made.id)
        except Exception:  # noqa: BLE001 - the session teardown sweeps what is left
            pass


def test_the_sandbox_runs_its_start_command(client, sandbox):
    got = client.get(sandbox.id)
    assert got.status == "RUNNING" and got.labels == [SUITE]
    assert (got.cpu_cores, got.memory_gb, got.disk_mount_path) == (1, 1, "/workspace")
    deadline = time.monotonic() + 60
    while "started by prime" not in client.get_logs(sandbox.id) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert client.get_logs(sandbox.id) == "started by prime\n"
    assert client.execute_command(sandbox.id, f"{{ {STARTED_SLEEP}; }} | wc -l").stdout == "1\n"


def test_execute_command_reports_the_guests_output(client, sandbox):
    from withruntime.prime import CommandTimeoutError
    result = client.execute_command(sandbox.id, "uname -s; echo $GREETING; echo to-err >&2; exit 5")
    assert (result.exit_code, result.stdout, result.stderr) == (5, "Linux\nhello prime\n", "to-err\n")
    moved = client.execute_command(sandbox.id, "pwd; echo $EXTRA", working_dir="/tmp", env={"EXTRA": "added"})
    assert moved.stdout == "/tmp\nadded\n"
    assert client.execute_command(sandbox.id, "nproc").stdout == "1\n"
    with pytest.raises(CommandTimeoutError):
        client.execute_command(sandbox.id, "sleep 30", timeout=2)


def test_files_travel_as_exact_bytes(client, sandbox, tmp_path):
    data = os.urandom(250_000) + b"\x00\xff"
    uploaded = client.upload_bytes(sandbox.id, "/workspace/blob.bin", data, "blob.bin")
    assert uploaded.success and uploaded.size == len(data)
    guest = client.execute_command(sandbox.id, "sha256sum /workspace/blob.bin").stdout.split()[0]
    assert guest == hashlib.sha256(data).hexdigest()
    local = tmp_path / "back.bin"
    client.download_file(sandbox.id, "/workspace/blob.bin", str(local))
    assert local.read_bytes() == data
    source = tmp_path / "notes.txt"
    source.write_text("line one\nline two\n")
    client.upload_file(sandbox.id, "/workspace/notes.txt", str(source))
    whole = client.read_file(sandbox.id, "/workspace/notes.txt")
    assert (whole.content, whole.total_size, whole.truncated) == ("line one\nline two\n", 18, False)
    window = client.read_file(sandbox.id, "/workspace/notes.txt", offset=5, length=3)
    assert (window.content, window.offset, window.truncated) == ("one", 5, True)
    assert client.read_file(sandbox.id, "/workspace/notes.txt", offset=-4).content == "two\n"


def test_background_jobs_run_and_report(client, sandbox):
    job = client.start_background_job(sandbox.id, "echo out; echo err >&2; sleep 5; exit 3", working_dir="/tmp")
    status = client.get_background_job_status(sandbox.id, job)
    assert status.job_id == job.job_id and not status.completed
    deadline = time.monotonic() + 60
    while not client.get_background_job(sandbox.id, job).completed and time.monotonic() < deadline:
        time.sleep(0.5)
    done = client.get_background_job(sandbox.id, job)
    assert (done.completed, done.exit_code, done.stdout, done.stderr) == (True, 3, "out\n", "err\n")
    ran = client.run_background_job(sandbox.id, "pwd; echo $GREETING", working_dir="/tmp", poll_interval=1)
    assert (ran.exit_code, ran.stdout) == (0, "/tmp\nhello prime\n")
    both = client.get_background_jobs([job])
    assert [one.exit_code for one in both] == [3]


def test_list_statuses_and_network(client, sandbox):
    listed = client.list(labels=[SUITE], exclude_terminated=True)
    assert [one.id for one in listed.sandboxes] == [sandbox.id]
    statuses = client.get_sandbox_statuses([sandbox.id, str(uuid.uuid4())])
    assert [(one.sandbox_id, one.status) for one in statuses.statuses] == [(sandbox.id, "RUNNING")]
    assert [one.code for one in statuses.errors] == ["NOT_FOUND"]
    assert client.get_network(sandbox.id).policy.allowlist is None
    changed = client.set_network(sandbox.id, deny=["example.com"])
    assert changed.applied and changed.policy.denylist == ["example.com"]
    assert client.get_network(sandbox.id).policy.denylist == ["example.com"]
    client.set_network(sandbox.id, allow=["*"])


def test_a_checkpoint_restores_into_a_new_sandbox(client, sandbox):
    marker = uuid.uuid4().hex
    client.execute_command(sandbox.id, f"echo {marker} > /workspace/marker.txt")
    checkpoint = client.checkpoint(sandbox.id)
    restored = None
    try:
        assert client.wait_for_checkpoint(checkpoint.id).state == "DURABLE"
        assert checkpoint.sandbox_id == sandbox.id and checkpoint.docker_image == "default"
        assert [one.id for one in client.list_checkpoints(sandbox.id)] == [checkpoint.id]
        assert client.get_checkpoint(checkpoint.id).stored_bytes > 0
        # The source runs on after the capture.
        assert client.execute_command(sandbox.id, "cat /workspace/marker.txt").stdout == f"{marker}\n"
        restored = client.create(request(docker_image=None, disk_size_gb=None, checkpoint_id=checkpoint.id))
        client.wait_for_creation(restored.id)
        assert restored.id != sandbox.id
        assert client.execute_command(restored.id, "cat /workspace/marker.txt").stdout == f"{marker}\n"
        # A checkpoint keeps files, not processes: the start command is not running.
        assert client.execute_command(restored.id, "pgrep -x sleep | wc -l").stdout == "0\n"
    finally:
        if restored is not None:
            client.delete(restored.id)
        client.delete_checkpoint(checkpoint.id)
    assert client.list_checkpoints(sandbox.id) == []


def test_delete_terminates(server, client):
    doomed = client.create(request())
    client.wait_for_creation(doomed.id)
    assert client.execute_command(doomed.id, "echo alive").stdout == "alive\n"
    client.delete(doomed.id)
    assert client.get(doomed.id).status == "TERMINATED"
    assert qemu_gone(server, doomed.id)
    assert doomed.id not in [one.id for one in client.list(labels=[SUITE], exclude_terminated=True).sandboxes]
