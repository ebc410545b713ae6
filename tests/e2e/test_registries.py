"""Private-registry credentials end to end: the official client's
`runtime.images.registries.set/list/delete` and `runtime image registry
set|ls|rm` against the suite's server. The secret is never answered, never
in the server's log and never in its data dir in the clear; each key has
its own; read-only keys list only."""
from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest
from withruntime import InvalidRequestError, NotFoundError, PermissionDeniedError

from conftest import BINARY, client_for


def cli(*args: str, input: bytes | None = None, key: str | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, **({"RUNTIME_API_KEY": key} if key else {})}
    out = subprocess.run([str(BINARY), *args], input=input, capture_output=True, timeout=120,
                         stdin=None if input is not None else subprocess.DEVNULL, env=env)
    if check and out.returncode != 0:
        raise AssertionError(f"runtime {' '.join(args)} exited {out.returncode}:\n"
                             f"stdout: {out.stdout[-2000:]!r}\nstderr: {out.stderr[-2000:]!r}")
    return out


def nowhere_on_disk(server, secret: str) -> None:
    needle = secret.encode()
    assert needle not in server.log_path.read_bytes(), "the secret is in the server's log"
    for p in Path(server.data_dir).iterdir():
        if p.is_file() and p.stat().st_size < (256 << 20):
            assert needle not in p.read_bytes(), f"{p.name} holds the secret"


def test_the_client_sets_lists_and_deletes_without_ever_seeing_the_secret(server):
    key = server.create_key(name=f"reg-{uuid.uuid4().hex[:6]}")
    other = server.create_key(name=f"reg-other-{uuid.uuid4().hex[:6]}")
    viewer = server.create_key(read_only=True, account_wide=True)
    secret = f"hub-token-{uuid.uuid4().hex}"
    with client_for(server, key) as rt, client_for(server, other) as rt2, client_for(server, viewer) as ro:
        with pytest.raises(InvalidRequestError) as e:
            rt.images.registries.set("ghcr.io/owner", username="a:b")
        fields = sorted(i["field"] for i in e.value.details["issues"])
        assert fields == ["password", "registry", "username"], e.value.details

        entry = rt.images.registries.set("https://index.docker.io/v1/", username="me", password=secret)
        assert entry["registry"] == "docker.io" and entry["username"] == "me", entry
        assert entry["kind"] == "password" and entry["createdAt"] and entry["updatedAt"]
        assert secret not in json.dumps(entry)
        ecr = rt.images.registries.set("123456789012.dkr.ecr.us-east-1.amazonaws.com",
                                       access_key_id="AKIAIOSFODNN7EXAMPLE",
                                       secret_access_key=f"aws{secret}")
        assert ecr["kind"] == "ecr" and ecr["accessKeyId"] == "AKIAIOSFODNN7EXAMPLE"

        listed = rt.images.registries.list()
        assert [r["registry"] for r in listed] == ["123456789012.dkr.ecr.us-east-1.amazonaws.com", "docker.io"]
        assert secret not in json.dumps(listed)
        # Another key has its own (none), and cannot delete these.
        assert rt2.images.registries.list() == []
        with pytest.raises(NotFoundError):
            rt2.images.registries.delete("docker.io")
        # A read-only key lists (its own) but never changes.
        assert ro.images.registries.list() == []
        with pytest.raises(PermissionDeniedError):
            ro.images.registries.set("ghcr.io", username="me", password="x")
        with pytest.raises(PermissionDeniedError):
            ro.images.registries.delete("docker.io")

        nowhere_on_disk(server, secret)

        gone = rt.images.registries.delete("registry-1.docker.io")
        assert gone == {"registry": "docker.io", "deleted": True}
        with pytest.raises(NotFoundError):
            rt.images.registries.delete("docker.io")
        assert [r["registry"] for r in rt.images.registries.list()] == [
            "123456789012.dkr.ecr.us-east-1.amazonaws.com"]


def test_the_cli_reads_the_secret_from_stdin(server):
    key = server.create_key(name=f"reg-cli-{uuid.uuid4().hex[:6]}")
    token = f"ghp_{uuid.uuid4().hex}"
    out = cli("image", "registry", "set", "GHCR.io", "--username", "me", input=f"{token}\n".encode(), key=key)
    assert out.stdout.decode().split() == ["ghcr.io", "password"]
    rows = json.loads(cli("image", "registry", "ls", "--json", key=key).stdout)
    assert [(r["registry"], r["username"]) for r in rows] == [("ghcr.io", "me")]
    table = cli("image", "registry", "ls", key=key).stdout.decode()
    assert "REGISTRY" in table and "ghcr.io" in table and token not in table
    with client_for(server, key) as rt:
        assert [r["registry"] for r in rt.images.registries.list()] == ["ghcr.io"]
    # The trailing line break is not part of the secret: a set of the same
    # token without one is the same credential (the CLI's set is a replace).
    cli("image", "registry", "set", "ghcr.io", "--username", "me2", input=token.encode(), key=key)
    rows = json.loads(cli("image", "registry", "ls", "--json", key=key).stdout)
    assert [(r["registry"], r["username"]) for r in rows] == [("ghcr.io", "me2")]
    # Nothing on stdin is refused before any call.
    empty = cli("image", "registry", "set", "quay.io", "--username", "me", input=b"", key=key, check=False)
    assert empty.returncode != 0 and b"no secret" in empty.stderr
    bad = cli("image", "registry", "set", "not a host", "--username", "me", input=b"x\n", key=key, check=False)
    assert bad.returncode != 0 and b"registry" in bad.stderr
    ecr = "123456789012.dkr.ecr.eu-west-1.amazonaws.com"
    out = cli("image", "registry", "set", ecr, "--access-key-id", "AKIAIOSFODNN7EXAMPLE",
              input=f"aws-{token}\n".encode(), key=key)
    assert out.stdout.decode().split() == [ecr, "ecr"]
    assert "AKIAIOSFODNN7EXAMPLE" in cli("image", "registry", "ls", key=key).stdout.decode()
    nowhere_on_disk(server, token)
    cli("image", "registry", "rm", ecr, key=key)
    out = cli("image", "registry", "rm", "ghcr.io", key=key)
    assert out.stdout.decode().strip() == "deleted ghcr.io"
    assert json.loads(cli("image", "registry", "ls", "--json", key=key).stdout) == []
    missing = cli("image", "registry", "rm", "ghcr.io", key=key, check=False)
    assert missing.returncode != 0 and b"registry_not_found" in missing.stderr
