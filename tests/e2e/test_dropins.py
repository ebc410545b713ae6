"""The client's vendor drop-ins, each flow written as that vendor's users
write it, and the record fields they read: the snapshot record's names
(Runloop's and Sprites' checkpoints), the process record's `cwd` and the
output's JSON polling form (Blaxel's process calls), sandbox lists oldest
first, `:update` taking limits away, and the products not served here
answering 501 `unavailable`. Each asserts what only the VM can produce.
"""
from __future__ import annotations

import uuid

import pytest
from withruntime import ConflictError, ServiceUnavailableError

SHAPE = {"vcpu": 1, "memory_mib": 1024}


def test_sandboxes_are_listed_oldest_first(runtime):
    tag = uuid.uuid4().hex[:12]
    first = runtime.sandboxes.create(labels={"order": tag}, **SHAPE)
    second = runtime.sandboxes.create(labels={"order": tag}, **SHAPE)
    try:
        ids = [s.id for s in runtime.sandboxes.list(labels={"order": tag})]
        assert ids == [first.id, second.id]
        # A page of one, then the next: the same order across pages.
        page = runtime.sandboxes.list(labels={"order": tag}, limit=1)
        assert [s.id for s in page] == [first.id, second.id]
    finally:
        first.delete()
        second.delete()


def test_update_takes_the_time_limit_away_with_zero_and_idle_pause_has_the_clients_default(runtime):
    sbx = runtime.sandboxes.create(timeout_seconds=600, **SHAPE)
    try:
        assert sbx.info["idlePauseSeconds"] == 300
        assert sbx.info["endsAt"] is not None
        sbx.update(timeout_seconds=0, idle_pause_seconds=5)
        sbx.refresh()
        assert sbx.info["endsAt"] is None and sbx.info["timeoutSeconds"] is None
        assert sbx.info["idlePauseSeconds"] == 60, "a shorter one is raised to a minute"
        assert sbx.exec("echo alive").stdout == "alive\n"
    finally:
        sbx.delete()


def test_a_snapshot_record_has_the_clients_names_and_takes_update_and_extend(runtime):
    sbx = runtime.sandboxes.create(**SHAPE)
    try:
        sbx.files.write("/workspace/kept.txt", "kept by the snapshot\n")
        snap = sbx.snapshot(mode="disk", labels={"stage": "one"})
        got = runtime.snapshots.get(snap["id"])
        assert got["state"] == "ready"
        assert got["sourceSandboxId"] == sbx.id
        assert got["shape"] == {"vcpu": 1, "memoryMiB": 1024, "diskMiB": sbx.info["diskMiB"]}
        assert got["storedBytes"] > 0 and got["meteredBytes"] == got["storedBytes"]
        by_source = [s["id"] for s in runtime.snapshots.list(sandbox_id=sbx.id)]
        assert by_source == [snap["id"]]

        updated = runtime.snapshots.update(snap["id"], name="renamed", labels={"stage": "two"},
                                           if_labels={"stage": "one"})
        assert (updated["name"], updated["labels"]) == ("renamed", {"stage": "two"})
        with pytest.raises(ConflictError) as fenced:
            runtime.snapshots.update(snap["id"], labels={"stage": "three"}, if_labels={"stage": "one"})
        assert fenced.value.code == "snapshot_metadata_changed" and fenced.value.status == 409
        assert runtime.snapshots.get(snap["id"])["labels"] == {"stage": "two"}
        extended = runtime.snapshots.extend(snap["id"], 30)
        assert extended["retentionDays"] == 30 and extended["expiresAt"] > got["expiresAt"]
        runtime.snapshots.delete(snap["id"])
    finally:
        sbx.delete()


def test_runloop_disk_snapshot_update_and_a_devbox_from_it(runtime):
    from withruntime.runloop import RunloopSDK

    sdk = RunloopSDK(runtime=runtime)
    devbox = sdk.devbox.create(launch_parameters={"custom_cpu_cores": 1, "custom_gb_memory": 1})
    clone = None
    try:
        marker = uuid.uuid4().hex
        assert devbox.cmd.exec(f"echo {marker} > /workspace/marker && uname -s").stdout() == "Linux\n"
        snapshot = devbox.snapshot_disk(name="checkpoint", metadata={"step": "1"})
        info = snapshot.await_completed()
        assert info.status == "complete"
        assert info.snapshot.source_devbox_id == devbox.id
        assert info.snapshot.metadata == {"step": "1"}
        assert snapshot.update(metadata={"step": "2"}).metadata == {"step": "2"}
        clone = snapshot.create_devbox()
        assert clone.cmd.exec("cat /workspace/marker").stdout() == f"{marker}\n"
    finally:
        devbox.shutdown()
        if clone is not None:
            clone.shutdown()


def test_sprites_checkpoints_are_listed(runtime):
    from withruntime.sprites import SpritesClient

    client = SpritesClient(runtime=runtime)
    sprite = client.create_sprite(f"sprite-{uuid.uuid4().hex[:10]}", config=None)
    try:
        assert sprite.command("cat", "/proc/sys/kernel/ostype").output() == b"Linux\n"
        messages = list(sprite.create_checkpoint("before the change"))
        assert messages[-1].type == "complete", messages
        made = messages[-1].data
        assert [c.id for c in sprite.list_checkpoints()] == [made]
        assert sprite.get_checkpoint(made).comment == "before the change"
    finally:
        client.delete_sprite(sprite.name)


def test_blaxel_processes_run_and_their_output_is_read(server):
    from withruntime import Runtime
    from withruntime.blaxel import ProcessResponseStatus, use_client
    from withruntime.blaxel import SyncSandboxInstance as SandboxInstance

    with Runtime(api_key=server.admin_key(), base_url=server.url) as client:
        use_client(client)
        box = SandboxInstance.create({"memory": 1024})
        try:
            done = box.process.exec({"name": "greet", "command": "cd /tmp && pwd && echo to-err >&2",
                                     "wait_for_completion": True})
            assert done.exit_code == 0
            assert done.stdout == "/tmp\n" and done.stderr == "to-err\n"
            slow = box.process.exec({"name": "slow", "command": "sleep 1; echo late", "working_dir": "/tmp"})
            ended = box.process.wait("slow", max_wait=30000, interval=200)
            assert ended.status == ProcessResponseStatus.COMPLETED, ended
            assert box.process.get("slow").stdout == "late\n"
            assert slow.pid == ended.pid
            assert box.process.get("slow").working_dir == "/tmp"
        finally:
            box.delete()
            use_client(None)


def test_a_process_record_has_its_cwd(sbx):
    p = sbx.spawn("sleep 0.2; pwd", cwd="/tmp")
    assert p.info["cwd"] == "/tmp"
    result = p.wait()
    assert (result.exit_code, result.stdout) == (0, "/tmp\n")
    assert p.refresh()["cwd"] == "/tmp"
    default = sbx.spawn("pwd")
    assert default.info["cwd"] == "/workspace"
    assert default.wait().stdout == "/workspace\n"


@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/otel-exports"),
    ("GET", "/v1/containers"),
    ("GET", "/v1/jobs"),
    ("GET", "/v1/sandboxes/{id}/mounts"),
    ("POST", "/v1/sandboxes/{id}/desktop:start"),
])
def test_products_not_served_here_answer_unavailable(server, runtime, sbx, method, path):
    with pytest.raises(ServiceUnavailableError) as caught:
        runtime.request(method, path.format(id=sbx.id), **({"body": {}} if method == "POST" else {}))
    assert (caught.value.status, caught.value.code) == (501, "unavailable"), caught.value
    assert "not served" in str(caught.value)
