"""Keys: bad, read-only, per-key visibility and account-wide keys."""
from __future__ import annotations

import pytest
from withruntime import AuthenticationError, NotFoundError, PermissionDeniedError, Runtime

from conftest import assert_error_body, client_for, http


def test_bad_key_is_refused(server):
    with Runtime(api_key="rtcloud_not-a-real-key", base_url=server.url, max_retries=0) as rt:
        with pytest.raises(AuthenticationError) as raised:
            rt.sandboxes.list()
        assert raised.value.status == 401
        assert raised.value.code == "unauthorized"
        with pytest.raises(AuthenticationError):
            rt.sandboxes.create()
    assert_error_body(http(server, "GET", "/v1/sandboxes", key=None), 401, "unauthorized")
    assert_error_body(http(server, "GET", "/v1/sandboxes", key="wrong"), 401, "unauthorized")


def test_read_only_key_cannot_change_anything(server):
    key = server.create_key(read_only=True, name="e2e-read-only")
    with client_for(server, key) as rt:
        assert isinstance(rt.sandboxes.list().to_list(), list)
        with pytest.raises(PermissionDeniedError) as raised:
            rt.sandboxes.create()
        assert raised.value.status == 403
        assert raised.value.code == "forbidden"
    assert_error_body(http(server, "POST", "/v1/sandboxes", {}, key=key), 403, "forbidden")


def test_keys_see_only_their_own_sandboxes(server):
    owner_key = server.create_key(name="e2e-owner")
    other_key = server.create_key(name="e2e-other")
    wide_key = server.create_key(account_wide=True, name="e2e-wide")
    with client_for(server, owner_key) as owner, client_for(server, other_key) as other, \
            client_for(server, wide_key) as wide:
        sbx = owner.sandboxes.create()
        try:
            assert sbx.id in [s.id for s in owner.sandboxes.list()]

            with pytest.raises(NotFoundError):
                other.sandboxes.get(sbx.id)
            assert sbx.id not in [s.id for s in other.sandboxes.list(include_stopped=True)]
            assert_error_body(http(server, "POST", f"/v1/sandboxes/{sbx.id}:exec", {"command": "echo no"},
                                   key=other_key), 404)
            assert_error_body(http(server, "GET", f"/v1/sandboxes/{sbx.id}/files/content?path=/workspace",
                                   key=other_key), 404)
            with pytest.raises(NotFoundError):
                other.sandboxes.delete(sbx.id)
            assert owner.sandboxes.get(sbx.id).state == "running"

            seen = wide.sandboxes.get(sbx.id)
            assert seen.id == sbx.id
            assert sbx.id in [s.id for s in wide.sandboxes.list()]
            assert seen.exec("echo wide").stdout == "wide\n"
        finally:
            owner.sandboxes.delete(sbx.id)
