"""Sandbox create, get, list, stop and delete through the official client."""
from __future__ import annotations

import re
import uuid

import pytest
from withruntime import NotFoundError, Sandbox

from conftest import assert_error_body, http

UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
ISO_Z = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z$")


def test_with_block_writes_and_runs_a_program(server, runtime):
    with Sandbox.create() as sbx:
        assert sbx.state == "running"
        sbx.files.write("/workspace/a.py", "print(6 * 7)\n")
        result = sbx.exec("python3 /workspace/a.py")
        assert result.exit_code == 0, result
        assert result.stdout == "42\n"
        sandbox_id = sbx.id
    # Leaving the block deletes the sandbox.
    with pytest.raises(NotFoundError):
        runtime.sandboxes.get(sandbox_id)


def test_create_get_list_stop_delete(server, runtime):
    name = f"e2e-life-{uuid.uuid4().hex[:8]}"
    sbx = runtime.sandboxes.create(name=name, labels={"suite": "e2e-life"})
    try:
        info = sbx.info
        assert UUID.match(sbx.id), sbx.id
        assert info["kind"] == "sandbox"
        assert info["name"] == name
        assert info["labels"] == {"suite": "e2e-life"}
        assert sbx.state == "running"
        assert info["status"] == "active"
        assert (info["vcpu"], info["memoryMiB"], info["diskMiB"]) == (2, 4096, 4096)
        assert ISO_Z.match(info["createdAt"]), info["createdAt"]

        got = runtime.sandboxes.get(sbx.id)
        assert got.id == sbx.id and got.state == "running" and got.info["name"] == name

        listed = [s.id for s in runtime.sandboxes.list()]
        assert sbx.id in listed
        assert [s.id for s in runtime.sandboxes.list(labels={"suite": "e2e-life"})] == [sbx.id]
        assert [s.id for s in runtime.sandboxes.list(name=name)] == [sbx.id]
        assert sbx.id not in [s.id for s in runtime.sandboxes.list(labels={"suite": "no-such-label"})]

        stopped = sbx.stop()
        assert stopped.state == "stopped"
        assert runtime.sandboxes.get(sbx.id).info["status"] == "stopped"
        assert sbx.id not in [s.id for s in runtime.sandboxes.list()]
        assert sbx.id in [s.id for s in runtime.sandboxes.list(include_stopped=True)]
    finally:
        deleted = runtime.sandboxes.delete(sbx.id)
    assert deleted["id"] == sbx.id
    assert deleted["status"] == "deleted"
    # Deleting again answers the same; then the sandbox is gone.
    again = runtime.sandboxes.delete(sbx.id)
    assert again["status"] == "deleted" and again["id"] == sbx.id
    with pytest.raises(NotFoundError):
        runtime.sandboxes.get(sbx.id)
    assert sbx.id not in [s.id for s in runtime.sandboxes.list(include_stopped=True)]


def test_delete_a_running_sandbox_ends_it(server, runtime):
    sbx = runtime.sandboxes.create()
    assert sbx.exec("echo up").stdout == "up\n"
    answer = sbx.delete()
    assert answer["status"] == "deleted"
    with pytest.raises(NotFoundError):
        sbx.exec("echo still here")
    with pytest.raises(NotFoundError):
        runtime.sandboxes.get(sbx.id)


def test_unknown_sandbox_is_not_found(server, runtime):
    with pytest.raises(NotFoundError) as raised:
        runtime.sandboxes.get(str(uuid.uuid4()))
    assert raised.value.status == 404


def test_error_body_shape_on_the_wire(server):
    missing = http(server, "GET", f"/v1/sandboxes/{uuid.uuid4()}")
    assert_error_body(missing, 404)

    malformed = http(server, "POST", "/v1/sandboxes", raw=b'{"vcpu": ')
    assert_error_body(malformed, 400)

    no_route = http(server, "GET", "/v1/no-such-thing")
    assert_error_body(no_route, 404)


def test_record_carries_request_id_header(server):
    answer = http(server, "GET", "/v1/sandboxes")
    assert answer.status == 200, answer
    body = answer.json()
    assert isinstance(body["data"], list)
    assert "nextCursor" in body
    assert answer.headers.get("x-request-id"), answer.headers
