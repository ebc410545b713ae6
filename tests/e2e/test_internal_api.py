"""The API from inside a sandbox (`http://runtime.internal`) and
`/run/runtime/environment.json`: the official client, copied into the guest,
finds the API on its own (no RUNTIME_API_URL) and runs a child sandbox with
the key the sandbox was given; curl sees the same auth, the sandbox's rules
and the transparent path. Real VMs, one parent sandbox for the module."""
from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import withruntime

from conftest import client_for
from conftest import http as call

CLIENT_DIR = Path(withruntime.__file__).parent
LIB = "/workspace/pylib"

CHILD_SCRIPT = r"""
import json, os
from withruntime import Sandbox
assert "RUNTIME_API_URL" not in os.environ, os.environ.get("RUNTIME_API_URL")
child = Sandbox.create()
print(json.dumps({"made": child.id}), flush=True)
r = child.exec("cat /run/runtime/environment.json; echo child-$((6*7))")
child.delete()
print(json.dumps({"id": child.id, "exit": r.exit_code, "out": r.stdout}), flush=True)
"""


def run(sbx, command: str, timeout_ms: int = 120_000) -> tuple[int, str, str]:
    r = sbx.exec(command, timeout_ms=timeout_ms)
    return r.exit_code, r.stdout, r.stderr


def client_tarball() -> bytes:
    """The installed client's package (sources only), as a .tar.gz."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(CLIENT_DIR.rglob("*")):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            tar.add(path, arcname=str(Path("withruntime") / path.relative_to(CLIENT_DIR)))
    return buf.getvalue()


@pytest.fixture(scope="module")
def key(server):
    return server.create_key(name="e2e-inside")


@pytest.fixture(scope="module")
def inside(server, key):
    """A sandbox of `key`'s, given the key as its users do, with the client
    copied in (the image has no `withruntime`; pip has no network here)."""
    with client_for(server, key) as rt:
        sbx = rt.sandboxes.create(env={"RUNTIME_API_KEY": key})
        try:
            sbx.files.write("/tmp/withruntime.tar.gz", client_tarball())
            code, out, err = run(sbx, f"mkdir -p {LIB} && tar -xzf /tmp/withruntime.tar.gz -C {LIB}")
            assert code == 0, (out, err)
            yield sbx
        finally:
            try:
                sbx.delete()
            except Exception:  # noqa: BLE001 - the session teardown sweeps what is left
                pass


def curl(sbx, path: str, *extra: str) -> tuple[int, dict[str, str], str]:
    """curl in the guest (through the proxy unless `extra` says otherwise):
    (status, headers, body)."""
    code, out, err = run(sbx, "curl -sS --max-time 60 -D /tmp/h -o /tmp/b "
                              f"{' '.join(extra)} 'http://runtime.internal{path}' -w '%{{http_code}}';"
                              " echo; cat /tmp/h; echo '--body--'; cat /tmp/b")
    assert code == 0, (out, err)
    status, rest = out.split("\n", 1)
    head, body = rest.split("--body--\n", 1)
    headers = {}
    for line in head.splitlines()[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    return int(status), headers, body


def test_the_environment_file_names_the_sandbox_and_the_api_answers_the_same(inside):
    code, out, err = run(inside, "stat -c '%U %a' /run/runtime/environment.json; "
                                 "cat /run/runtime/environment.json")
    assert code == 0, err
    owner, text = out.split("\n", 1)
    assert owner == "root 644", owner
    env = json.loads(text)
    assert env["RUNTIME_SANDBOX_ID"] == inside.id
    assert env["RUNTIME_API_URL"] == "http://runtime.internal"
    # Without a key: the same facts, nothing secret.
    status, _, body = curl(inside, "/v1/environment")
    assert status == 200, body
    assert json.loads(body) == env


def test_curl_with_the_key_is_that_key_and_without_is_401(server, inside, key):
    status, headers, body = curl(inside, "/v1/me", f"-H 'Authorization: Bearer {key}'")
    assert status == 200, body
    me = json.loads(body)
    assert me["credentialName"] == "e2e-inside" and me["role"] == "developer", me
    assert headers["x-request-id"].startswith("req_"), headers
    status, _, body = curl(inside, "/v1/me")
    assert status == 401, body
    assert json.loads(body)["error"]["status"] == 401, body
    # The channel grants nothing by itself: another key, asking from inside
    # this very sandbox, does not see it (as from outside).
    other = server.create_key(name="e2e-inside-stranger")
    status, _, body = curl(inside, f"/v1/sandboxes/{inside.id}", f"-H 'Authorization: Bearer {other}'")
    assert status == 404, body
    status, _, body = curl(inside, f"/v1/sandboxes/{inside.id}", f"-H 'Authorization: Bearer {key}'")
    assert status == 200 and json.loads(body)["id"] == inside.id, body
    status, _, body = curl(inside, "/login/anything")
    assert status == 404 and json.loads(body)["error"]["code"] == "route_not_found", body
    # A program that ignores the proxy variables gets there too (its name
    # resolves inside, its connection is carried as a CONNECT).
    status, _, body = curl(inside, "/v1/me", "--noproxy '*'", f"-H 'Authorization: Bearer {key}'")
    assert status == 200 and json.loads(body)["credentialName"] == "e2e-inside", body


def test_the_official_client_inside_runs_a_child_sandbox_with_the_sandboxs_key(server, inside, key):
    inside.files.write("/workspace/child.py", CHILD_SCRIPT)
    code, out, err = run(inside, f"PYTHONPATH={LIB} python3 /workspace/child.py", timeout_ms=600_000)
    assert code == 0, (out, err)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    made, done = lines[0]["made"], lines[-1]
    assert done["id"] == made and done["exit"] == 0, done
    env_text, answer = done["out"].split("\n", 1)
    # Only the child's VM knows its own id this way.
    assert json.loads(env_text)["RUNTIME_SANDBOX_ID"] == made
    assert answer == "child-42\n", done
    assert made != inside.id
    # From outside: the child was the key's, and it is gone.
    with client_for(server, key) as rt:
        types = [e["type"] for e in rt.events.list(resource_id=made)["data"]]
        assert "sandbox.created" in types and "sandbox.deleted" in types, types
    gone = call(server, "GET", f"/v1/sandboxes/{made}", key=key)
    assert gone.status == 404, gone
    admin_only = client_for(server, server.create_key(name="e2e-inside-other"))
    with admin_only:
        assert admin_only.events.list(resource_id=made)["data"] == []


@pytest.mark.parametrize("rules, code", [
    ({"internet": False}, "internet-off"),
    ({"internet": True, "allow": ["example.com"]}, "rule-not-allowed"),
    ({"internet": True, "deny": ["runtime.internal"]}, "rule-denied"),
    ({"internet": True, "allow": ["runtime.internal"]}, None),
])
def test_the_sandboxs_rules_apply_to_runtime_internal(inside, key, rules, code):
    inside.network.set(**rules)
    try:
        status, headers, body = curl(inside, "/v1/me", f"-H 'Authorization: Bearer {key}'")
        if code is None:
            assert status == 200 and json.loads(body)["credentialName"] == "e2e-inside", body
        else:
            assert status == 403, body
            assert headers.get("x-runtime-egress") == code, headers
    finally:
        inside.network.set(internet=True)


def test_streams_pass_as_they_come_and_the_17th_open_request_is_429_api_busy(inside, key):
    """Sixteen followed outputs of a process that ticks hold the sandbox's
    sixteen slots; each gets its lines while the process still runs; the
    seventeenth request is refused until they end."""
    ticker = inside.spawn("for i in $(seq 1 600); do echo tick-$i; sleep 0.2; done")
    follow = (f"http://runtime.internal/v1/sandboxes/{inside.id}/processes/{ticker.id}/output?follow=true")
    auth = f"-H 'Authorization: Bearer {key}'"
    script = f"""
set -u
for i in $(seq 1 16); do
  curl -sN --max-time 100 {auth} -o /tmp/f$i '{follow}' &
done
status=none
for t in $(seq 1 120); do
  status=$(curl -s --max-time 20 -o /tmp/busy -D /tmp/busyh -w '%{{http_code}}' {auth} http://runtime.internal/v1/me)
  [ "$status" = 429 ] && break
  sleep 0.5
done
echo "status=$status"
grep -i '^x-runtime-egress' /tmp/busyh || true
cat /tmp/busy; echo
sleep 2
echo "ticks=$(grep -c tick- /tmp/f1)"
kill $(jobs -p) 2>/dev/null; wait 2>/dev/null
for t in $(seq 1 60); do
  after=$(curl -s --max-time 20 -o /dev/null -w '%{{http_code}}' {auth} http://runtime.internal/v1/me)
  [ "$after" = 200 ] && break
  sleep 0.5
done
echo "after=$after"
"""
    inside.files.write("/workspace/busy.sh", script)
    try:
        code, out, err = run(inside, "bash /workspace/busy.sh", timeout_ms=600_000)
    finally:
        ticker.kill()
    assert code == 0, (out, err)
    assert "status=429" in out, out
    assert "x-runtime-egress: api-busy" in out.lower(), out
    assert "16 requests to runtime.internal open" in out, out
    # The followed output came while the process ran: nothing waited for its end.
    ticks = int(out.split("ticks=")[1].split()[0])
    assert ticks >= 1, out
    assert "after=200" in out, out


def test_a_fork_and_a_woken_sandbox_name_themselves(inside, key):
    """A copy restored from the parent's memory gets its own file and its
    own answer from runtime.internal; the parent, paused and woken, keeps its."""
    copy = inside.fork()
    try:
        assert copy.id != inside.id
        code, out, err = run(copy, "cat /run/runtime/environment.json; "
                                   "curl -s --max-time 60 http://runtime.internal/v1/environment")
        assert code == 0, err
        first, second = out.strip().split("\n")
        assert json.loads(first)["RUNTIME_SANDBOX_ID"] == copy.id, out
        assert json.loads(second)["RUNTIME_SANDBOX_ID"] == copy.id, out
    finally:
        copy.delete()
    inside.pause()
    inside.wake()
    code, out, err = run(inside, "cat /run/runtime/environment.json")
    assert code == 0 and json.loads(out)["RUNTIME_SANDBOX_ID"] == inside.id, (out, err)
