"""The record fields the client's vendor drop-ins read, and the rules they
rely on: sandbox lists oldest first, `:update` taking limits away, the
snapshot record's names (Runloop's and Sprites' checkpoints), the process
record's `cwd` (Blaxel's process calls), and the products not served here
answering 501 `unavailable`. Each vendor's own flows are in its module
(test_e2b.py, test_vercel.py, test_runloop.py, test_blaxel.py,
test_sprites.py, ...).
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
