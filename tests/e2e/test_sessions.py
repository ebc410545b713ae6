"""Sessions (tokens for one sandbox, `Sandbox.from_session`) and metrics
(`sbx.metrics`, E2B's `get_metrics`), through the official client, on one
sandbox shared by the module."""
from __future__ import annotations

import http.client
import time

import pytest
from withruntime import RuntimeError as ClientError
from withruntime import Sandbox

from conftest import assert_error_body
from conftest import http as call


def test_a_session_runs_commands_and_files_in_its_sandbox_and_nothing_else(server, sbx):
    made = sbx.sessions.create(ttl_seconds=600, origins=["https://app.example.com"], name="frontend")
    assert made["token"].startswith("rtsess_")
    assert made["state"] == "active" and made["sandboxId"] == sbx.id
    front = Sandbox.from_session(made["token"], sbx.id, api_url=server.url)
    # What only this VM can answer: its hostname file and a file written now.
    sbx.files.write("/workspace/from-backend.txt", "backend wrote this\n")
    assert front.exec("cat /workspace/from-backend.txt; echo $((6*7))").stdout == "backend wrote this\n42\n"
    front.files.write("/workspace/from-frontend.bin", b"\x00\x01\xfe\xff")
    assert sbx.files.read("/workspace/from-frontend.bin") == b"\x00\x01\xfe\xff"
    # Lifecycle changes, other sandboxes and account routes are refused.
    with pytest.raises(ClientError) as refused:
        front.pause()
    assert refused.value.status == 403
    assert_error_body(call(server, "GET", "/v1/sandboxes", key=made["token"]), 403, "forbidden")
    assert_error_body(call(server, "POST", f"/v1/sandboxes/{sbx.id}/sessions", {}, key=made["token"]),
                      403, "forbidden")
    # A page of another origin may not use it; its own page may.
    page = call(server, "GET", f"/v1/sandboxes/{sbx.id}", key=made["token"],
                headers={"Origin": "https://app.example.com"})
    assert page.status == 200 and page.headers["access-control-allow-origin"] == "https://app.example.com"
    assert_error_body(call(server, "GET", f"/v1/sandboxes/{sbx.id}", key=made["token"],
                           headers={"Origin": "https://other.example.org"}), 403, "forbidden")
    # Listed, then revoked: the next request is refused.
    assert made["id"] in [s["id"] for s in sbx.sessions.list()]
    assert sbx.sessions.revoke(made["id"])["state"] == "revoked"
    with pytest.raises(ClientError) as ended:
        front.exec("true")
    assert ended.value.status == 401


def test_bad_sessions_are_refused_naming_each_field(server, sbx):
    answer = call(server, "POST", f"/v1/sandboxes/{sbx.id}/sessions",
                  {"ttlSeconds": 999999, "origins": ["app.example.com"], "name": ""})
    error = assert_error_body(answer, 400, "invalid_request")
    fields = {i["field"] for i in error["details"]["issues"]}
    assert {"ttlSeconds", "origins[0]", "name"} <= fields, error
    with pytest.raises(ClientError):
        Sandbox.from_session("rtcloud_not_a_session", sbx.id, api_url=server.url)
    forged = Sandbox.from_session("rtsess_sess_0_forged", sbx.id, api_url=server.url)
    with pytest.raises(ClientError) as refused:
        forged.exec("true")
    assert refused.value.status == 401
    assert_error_body(call(server, "POST", "/v1/sandboxes/no-such-sandbox/sessions", {}), 404)


def test_metrics_show_the_cpu_the_guest_burned(sbx):
    # Two seconds of one busy vCPU inside two readings' time.
    sbx.exec("timeout 12 sh -c 'while :; do :; done' || true", timeout_ms=30_000)
    deadline = time.time() + 30
    m = sbx.metrics(range="15m")
    while time.time() < deadline and not any((p["cpuPercent"] or 0) > 20 for p in m["points"]):
        time.sleep(2)
        m = sbx.metrics(range="15m")
    assert m["stepSeconds"] == 10 and m["vcpu"] == sbx.info["vcpu"]
    busy = [p for p in m["points"] if (p["cpuPercent"] or 0) > 20]
    assert busy, m
    assert all(p["memoryBytes"] and p["memoryBytes"] > 16 << 20 for p in busy), busy
    assert m["latest"] is not None and m["latest"]["memoryBytes"] > 0
    assert sbx.metrics(range="24h")["stepSeconds"] == 480
    with pytest.raises(ClientError) as bad:
        sbx.metrics(range="2h")
    assert bad.value.status == 400


def test_e2b_metrics_and_host_name_this_sandbox(server, sbx):
    from withruntime.e2b import Sandbox as E2BSandbox
    e2b = E2BSandbox.connect(sbx.id)
    readings = e2b.get_metrics()
    assert readings and all(r.cpu_count == sbx.info["vcpu"] for r in readings)
    assert any(r.cpu_used_pct > 20 for r in readings), readings
    assert readings[0].mem_total == sbx.info["memoryMiB"] << 20
    # get_host names <port>-<id without dashes>: this server serves that name.
    host = e2b.get_host(8123)
    label = host.split(".", 1)[0]
    assert label == f"8123-{sbx.id.replace('-', '')}"
    sbx.spawn("python3 -m http.server 8123 --bind 127.0.0.1 --directory /etc")
    deadline = time.monotonic() + 60
    while True:
        c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        c.request("GET", "/hostname", headers={"Host": f"{label}.localhost:{server.port}"})
        r = c.getresponse()
        status, body = r.status, r.read()
        c.close()
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert status == 200, body
    assert body.decode().strip() == sbx.exec("cat /etc/hostname").stdout.strip()


def _get(url: str, headers: dict | None = None) -> tuple[int, bytes, dict]:
    import urllib.error
    import urllib.request
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, headers=headers or {}), timeout=60) as a:
            return a.status, a.read(), {k.lower(): v for k, v in a.headers.items()}
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read(), {k.lower(): v for k, v in e.headers.items()}


def test_file_links_serve_files_folders_and_ranges_until_revoked(sbx):
    import io
    import tarfile
    sbx.exec("mkdir -p /workspace/out/sub && printf 0123456789 > /workspace/out/digits"
             " && echo deep > /workspace/out/sub/deep.txt")
    link = sbx.files.download_url("/workspace/out/digits", expires_in_seconds=300, filename="d.txt")
    status, body, headers = _get(link["url"])
    assert (status, body) == (200, b"0123456789")
    assert 'filename="d.txt"' in headers["content-disposition"]
    status, body, headers = _get(link["url"], {"Range": "bytes=2-4"})
    assert (status, body, headers["content-range"]) == (206, b"234", "bytes 2-4/10")
    folder = sbx.files.download_url("/workspace/out", archive=True)
    status, body, _ = _get(folder["url"])
    assert status == 200
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:gz") as t:
        names = {m.name.lstrip("./") for m in t.getmembers() if m.isfile()}
    assert {"digits", "sub/deep.txt"} <= names, names
    assert sbx.files.revoke_links()["revoked"] >= 2
    status, body, _ = _get(link["url"])
    assert status == 410 and b"link_revoked" in body
    status, _, _ = _get(link["url"].rsplit("/", 1)[0] + "/rtlnk_forged")
    assert status == 404
