"""Idempotency-Key on the wire: the same key and body replay the first
answer (`"replayed": true`) without doing the work again; the same key with
another body is 422 `idempotency_key_reused`."""
from __future__ import annotations

import uuid

from withruntime import NotFoundError

from conftest import assert_error_body, http


def test_create_replays(server, runtime):
    key = f"e2e-create-{uuid.uuid4()}"
    body = {"labels": {"suite": "e2e-idem"}}
    headers = {"Idempotency-Key": key, "Prefer": "wait=60"}
    first = http(server, "POST", "/v1/sandboxes", body, headers=headers)
    assert 200 <= first.status < 300, first
    created = first.json()
    try:
        assert not created.get("replayed")
        again = http(server, "POST", "/v1/sandboxes", body, headers=headers)
        assert again.status == first.status, again
        replay = again.json()
        assert replay["id"] == created["id"]
        assert replay["replayed"] is True
        # Only one sandbox was made.
        labelled = [s.id for s in runtime.sandboxes.list(labels={"suite": "e2e-idem"})]
        assert labelled == [created["id"]]

        other = http(server, "POST", "/v1/sandboxes", {"labels": {"suite": "e2e-idem-other"}}, headers=headers)
        assert_error_body(other, 422, "idempotency_key_reused")
        assert runtime.sandboxes.list(labels={"suite": "e2e-idem-other"}).to_list() == []
    finally:
        runtime.sandboxes.delete(created["id"])
    try:
        runtime.sandboxes.get(created["id"])
        raise AssertionError("the sandbox should be gone")
    except NotFoundError:
        pass


def test_exec_runs_once(server, sbx):
    key = f"e2e-exec-{uuid.uuid4()}"
    body = {"command": "echo x >> /workspace/idem-count; wc -l < /workspace/idem-count; echo $RANDOM$RANDOM"}
    path = f"/v1/sandboxes/{sbx.id}:exec"
    sbx.exec("rm -f /workspace/idem-count")
    first = http(server, "POST", path, body, headers={"Idempotency-Key": key})
    assert first.status == 200, first
    answer = first.json()
    assert answer["exitCode"] == 0 and answer["stdout"].startswith("1\n"), answer
    again = http(server, "POST", path, body, headers={"Idempotency-Key": key})
    assert again.status == 200, again
    replay = again.json()
    assert replay["replayed"] is True
    assert replay["stdout"] == answer["stdout"]
    # The command did not run a second time.
    assert sbx.exec("wc -l < /workspace/idem-count").stdout.strip() == "1"

    reused = http(server, "POST", path, {"command": "echo different"}, headers={"Idempotency-Key": key})
    assert_error_body(reused, 422, "idempotency_key_reused")


def test_client_idempotency_key(server, sbx):
    """The client's own idempotency_key argument reaches the server the same way."""
    key = f"e2e-client-{uuid.uuid4()}"
    sbx.exec("rm -f /workspace/idem-client")
    first = sbx.exec("echo y >> /workspace/idem-client; wc -l < /workspace/idem-client", idempotency_key=key)
    second = sbx.exec("echo y >> /workspace/idem-client; wc -l < /workspace/idem-client", idempotency_key=key)
    assert first.stdout == second.stdout == "1\n"
    assert second.replayed is True
    assert sbx.exec("wc -l < /workspace/idem-client").stdout == "1\n"
