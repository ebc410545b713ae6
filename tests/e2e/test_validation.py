"""Bad input is refused with 400 and every wrong field named."""
from __future__ import annotations

import json

import pytest
from withruntime import InvalidRequestError

from conftest import assert_error_body, http


def test_create_names_each_bad_field(server, runtime):
    before = {s.id for s in runtime.sandboxes.list(include_stopped=True)}
    with pytest.raises(InvalidRequestError) as raised:
        runtime.sandboxes.create(vcpu=0, memory_mib=1, disk_mib=10)
    error = raised.value
    assert error.status == 400
    details = json.dumps(error.details)
    for field in ("vcpu", "memoryMiB", "diskMiB"):
        assert field in details, f"{field} not named in details {error.details}"
    after = {s.id for s in runtime.sandboxes.list(include_stopped=True)}
    assert after == before


def test_wrong_types_and_unknown_fields_on_the_wire(server):
    answer = http(server, "POST", "/v1/sandboxes",
                  {"vcpu": "two", "memoryMiB": 100000000, "bogusField": 1, "otherBogus": True})
    error = assert_error_body(answer, 400)
    details = json.dumps(error.get("details"))
    for field in ("vcpu", "memoryMiB", "bogusField", "otherBogus"):
        assert field in details, f"{field} not named in {error}"


def test_a_body_that_is_not_an_object(server):
    assert_error_body(http(server, "POST", "/v1/sandboxes", raw=b"[1, 2]"), 400)
    assert_error_body(http(server, "POST", "/v1/sandboxes", raw=b"not json"), 400)


def test_exec_needs_a_command(server, sbx):
    assert_error_body(http(server, "POST", f"/v1/sandboxes/{sbx.id}:exec", {}), 400)
    error = assert_error_body(http(server, "POST", f"/v1/sandboxes/{sbx.id}:exec", {"command": "true",
                                                                                    "timeoutMs": "soon"}), 400)
    assert "timeoutMs" in json.dumps(error.get("details")) or "timeoutMs" in error["message"]
