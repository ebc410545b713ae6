"""Morph Cloud's main flows, written as Morph's users write them, with only the
import changed (`withruntime.morph`): a snapshot made from the base image at
a size (cached by its digest), instances started from it, `exec` (a shell
string or argv, streamed output, a timeout), files and folders uploaded and
downloaded as exact bytes, list and get (reconnect), metadata and time
limits, an HTTP service exposed and hidden, a snapshot of a running instance
and a copy running as it was, `branch`, `setup` (a cached build step), pause
and resume, stop. (Morph's `boot` at another size is in test_resize.py.) One
instance for the module where the state does not matter."""
from __future__ import annotations

import hashlib
import os
import uuid

import pytest
from conftest import preview_fetch, qemu_gone

SUITE = uuid.uuid4().hex[:10]

# The guest's sleep's pid once it runs: a process just started may not have
# exec'd yet.
STARTED_SLEEP = "for i in $(seq 300); do pgrep -x sleep && exit 0; sleep 0.1; done; exit 1"


def detached(command: str) -> str:
    """A shell line starting `command` in a session of its own and returning
    once it is there: what a foreground exec leaves in its process group ends
    when it returns here (docs/api.md), so Morph's `command &` would not
    outlive it."""
    mark = f"/tmp/detached-{uuid.uuid4().hex[:8]}.pid"
    return (f"setsid -f sh -c 'echo $$ > {mark}; exec {command}' > /dev/null 2>&1; "
            f"until [ -s {mark} ]; do sleep 0.05; done")


@pytest.fixture(scope="module")
def client(server):
    from withruntime.morph import MorphCloudClient
    # As Morph's users write it, with the key from the environment.
    return MorphCloudClient()


@pytest.fixture(scope="module")
def base(client):
    snapshot = client.snapshots.create(vcpus=1, memory=1024, digest=f"base-{SUITE}", metadata={"suite": SUITE})
    try:
        yield snapshot
    finally:
        try:
            snapshot.delete()
        except Exception:  # noqa: BLE001 - the session teardown sweeps what is left
            pass


@pytest.fixture(scope="module")
def instance(client, base):
    made = client.instances.start(base.id, metadata={"suite": SUITE}, ttl_seconds=1800, timeout=300)
    try:
        yield made
    finally:
        try:
            made.stop()
        except Exception:  # noqa: BLE001 - the session teardown sweeps what is left
            pass


def test_a_snapshot_of_the_base_image_at_a_size_is_cached_by_digest(client, base):
    from withruntime.morph.api import SnapshotStatus
    assert base.status == SnapshotStatus.READY
    assert (base.spec.vcpus, base.spec.memory) == (1, 1024) and base.spec.disk_size > 0
    assert base.digest == f"base-{SUITE}" and base.metadata == {"suite": SUITE}
    assert base.refs.image_id == "morphvm-minimal"
    # The same digest answers the snapshot already made, with no new machine.
    again = client.snapshots.create(vcpus=1, memory=1024, digest=f"base-{SUITE}")
    assert again.id == base.id
    assert [one.id for one in client.snapshots.list(digest=f"base-{SUITE}")] == [base.id]
    assert base.id in [one.id for one in client.snapshots.list(metadata={"suite": SUITE})]
    base.set_metadata({"suite": SUITE, "stage": "base"})
    assert client.snapshots.get(base.id).metadata == {"suite": SUITE, "stage": "base"}
    base.set_ttl(2 * 86_400)
    assert client.snapshots.get(base.id).ttl.ttl_seconds == 2 * 86_400


def test_an_instance_runs_the_snapshot_at_its_size(base, instance):
    from withruntime.morph.api import InstanceStatus
    assert instance.status == InstanceStatus.READY
    assert (instance.spec.vcpus, instance.spec.memory) == (1, 1024)
    assert instance.refs.snapshot_id == base.id and instance.metadata == {"suite": SUITE}
    assert instance.exec("nproc").stdout == "1\n"
    total_kib = int(instance.exec("sed -n 's/^MemTotal: *\\([0-9]*\\) kB/\\1/p' /proc/meminfo").stdout)
    assert 800 * 1024 < total_kib <= 1024 * 1024


def test_exec_runs_shell_strings_and_argv(instance):
    result = instance.exec("uname -s; echo to-err >&2; exit 4")
    assert (result.exit_code, result.stdout, result.stderr) == (4, "Linux\n", "to-err\n")
    assert instance.exec(["printf", "<%s>", "a b", "$HOME"]).stdout == "<a b><$HOME>"
    seen: list[str] = []
    done = instance.exec("for i in 1 2 3; do echo n$i; done", on_stdout=seen.append)
    assert done.exit_code == 0 and "".join(seen) == "n1\nn2\nn3\n"
    with pytest.raises(TimeoutError):
        instance.exec("sleep 30", timeout=2)


def test_files_and_folders_travel_as_exact_bytes(instance, tmp_path):
    data = os.urandom(300_000) + b"\x00\xff"
    local = tmp_path / "blob.bin"
    local.write_bytes(data)
    instance.upload(str(local), "/workspace/blob.bin")
    guest = instance.exec("sha256sum /workspace/blob.bin").stdout.split()[0]
    assert guest == hashlib.sha256(data).hexdigest()
    back = tmp_path / "back.bin"
    instance.download("/workspace/blob.bin", str(back))
    assert back.read_bytes() == data
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("alpha\n")
    (folder / "sub" / "b.bin").write_bytes(b"\x01\x02")
    instance.upload(str(folder), "/workspace/folder", recursive=True)
    assert instance.exec("cat /workspace/folder/a.txt; od -An -tx1 /workspace/folder/sub/b.bin").stdout == \
        "alpha\n 01 02\n"
    instance.exec("echo made in the guest > /workspace/folder/sub/c.txt")
    out = tmp_path / "out"
    instance.download("/workspace/folder", str(out), recursive=True)
    assert (out / "sub" / "c.txt").read_text() == "made in the guest\n"
    assert (out / "sub" / "b.bin").read_bytes() == b"\x01\x02"


def test_list_get_metadata_and_ttl(client, instance):
    assert instance.id in [one.id for one in client.instances.list(metadata={"suite": SUITE})]
    again = client.instances.get(instance.id)
    assert again.exec("cat /proc/sys/kernel/random/boot_id").stdout == \
        instance.exec("cat /proc/sys/kernel/random/boot_id").stdout
    instance.set_metadata({"role": "main"})
    assert client.instances.get(instance.id).metadata == {"suite": SUITE, "role": "main"}
    assert instance.ttl.ttl_seconds == 1800 and instance.ttl.ttl_action == "stop"
    before = instance.ttl.ttl_expire_at
    instance.set_ttl(3600)
    assert instance.ttl.ttl_expire_at > before


def test_an_http_service_is_exposed_and_hidden(server, instance):
    instance.exec("mkdir -p /tmp/site && echo served by the guest > /tmp/site/index.html && "
                  + detached("python3 -m http.server 8000 --bind 127.0.0.1 --directory /tmp/site"))
    url = instance.expose_http_service("web", 8000)
    assert [(one.name, one.port, one.url) for one in instance.networking.http_services] == [("web", 8000, url)]
    answer = preview_fetch(server, url, "/index.html")
    assert (answer.status, answer.body) == (200, b"served by the guest\n")
    instance.hide_http_service("web")
    assert instance.networking.http_services == []
    assert preview_fetch(server, url, "/index.html").status == 404
    instance.exec("pkill -f 'http[.]server'")


def test_a_snapshot_of_a_running_instance_starts_as_it_was(client, instance):
    instance.exec("echo in-memory > /tmp/mark; " + detached("sleep 900"))
    pid = instance.exec(STARTED_SLEEP).stdout.strip()
    assert pid
    snapshot = instance.snapshot(metadata={"from": "running"})
    try:
        assert snapshot.metadata == {"from": "running"}
        # The source runs on.
        assert instance.exec("cat /tmp/mark").stdout == "in-memory\n"
        with client.instances.start(snapshot.id, timeout=300) as copy:
            assert copy.id != instance.id and copy.refs.snapshot_id == snapshot.id
            assert copy.exec("cat /tmp/mark; pgrep -x sleep").stdout == f"in-memory\n{pid}\n"
            copy_id = copy.id
        assert copy_id not in [one.id for one in client.instances.list()]
    finally:
        snapshot.delete()
    instance.exec("pkill -x sleep")


def test_branch_makes_running_copies(client, instance):
    instance.exec("echo branched > /tmp/branch-mark")
    before = {one.id for one in client.instances.list()}
    snapshot, copies = None, []
    try:
        snapshot, copies = instance.branch(2)
        assert len(copies) == 2 and len({one.id for one in copies} | {instance.id}) == 3
        for copy in copies:
            copy.wait_until_ready(timeout=300)
            assert copy.refs.snapshot_id == snapshot.id
            assert copy.exec("cat /tmp/branch-mark").stdout == "branched\n"
        copies[0].exec("echo only-here > /tmp/branch-mark")
        assert copies[1].exec("cat /tmp/branch-mark").stdout == "branched\n"
    finally:
        # The copies, also those a failed branch left running.
        for left in {one.id for one in client.instances.list()} - before:
            client.instances.stop(left)
        if snapshot is not None:
            snapshot.delete()


def test_setup_builds_a_step_once(client, base):
    built = base.setup("echo built-by-setup > /workspace/built.txt")
    try:
        assert built.id != base.id and built.digest
        assert base.setup("echo built-by-setup > /workspace/built.txt").id == built.id, "the step is cached"
        with client.instances.start(built.id, timeout=300) as started:
            assert started.exec("cat /workspace/built.txt").stdout == "built-by-setup\n"
    finally:
        built.delete()


def test_pause_keeps_processes_and_resume_runs_on(instance):
    from withruntime.morph.api import InstanceStatus
    instance.exec(detached("sleep 900"))
    pid = instance.exec(STARTED_SLEEP).stdout.strip()
    assert pid
    instance.pause()
    assert instance.status == InstanceStatus.PAUSED and instance.native.state == "paused"
    instance.resume()
    assert instance.status == InstanceStatus.READY
    assert instance.exec("pgrep -x sleep").stdout.strip() == pid
    instance.exec("pkill -x sleep")


def test_stop_deletes_the_instance_and_keeps_its_snapshots(server, client, base):
    from withruntime.morph.api import ApiError
    doomed = client.instances.start(base.id, timeout=300)
    kept = doomed.snapshot()
    try:
        doomed.stop()
        assert qemu_gone(server, doomed.id)
        with pytest.raises(ApiError) as gone:
            client.instances.get(doomed.id).exec("true")
        assert gone.value.status_code in (404, 409)
        assert client.snapshots.get(kept.id).id == kept.id
    finally:
        kept.delete()
