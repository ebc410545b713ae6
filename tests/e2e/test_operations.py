"""What an operator sees: `GET /metrics` moved by real work through the
official client (a sandbox, a command, a download through the egress
proxy, a refusal), who may read it, and `--log-format json` lines that
carry the request id the answer names."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from conftest import Server, http


def scrape(server, key="admin") -> dict[str, float]:
    answer = http(server, "GET", "/metrics", key=key)
    assert answer.status == 200, answer
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4"), answer.headers
    series = {}
    for line in answer.body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            series[name] = float(value)
    return series


def test_metrics_follow_what_the_server_does(server, sbx):
    before = scrape(server)
    assert before["runtime_sandboxes{state=\"running\"}"] >= 1, before
    assert before["runtime_host_memory_total_bytes"] > 0
    assert before["runtime_host_disk_free_bytes"] > 0

    r = sbx.exec("echo counted", timeout_ms=60_000)
    assert r.exit_code == 0 and r.stdout == "counted\n", r
    # 8 MiB from a host of the egress tests, through the guest's proxy.
    r = sbx.exec("curl -sSf --max-time 60 -o /dev/null -w '%{size_download}' http://example.net/big",
                 timeout_ms=120_000)
    assert r.exit_code == 0 and r.stdout == str(8 * 1024 * 1024), r
    missing = http(server, "GET", "/v1/sandboxes/sbx_no_such_sandbox")
    assert missing.status == 404, missing

    after = scrape(server)
    assert after["runtime_processes_started_total{kind=\"exec\"}"] >= before.get(
        "runtime_processes_started_total{kind=\"exec\"}", 0) + 2
    received = after["runtime_egress_bytes_total{direction=\"received\"}"] - before.get(
        "runtime_egress_bytes_total{direction=\"received\"}", 0)
    assert received >= 8 * 1024 * 1024, (received, after)
    assert after["runtime_egress_bytes_total{direction=\"sent\"}"] > before.get(
        "runtime_egress_bytes_total{direction=\"sent\"}", 0)
    assert after["runtime_egress_connections_total"] >= before.get("runtime_egress_connections_total", 0) + 1
    assert after["runtime_refusals_total{code=\"sandbox_not_found\"}"] >= before.get(
        "runtime_refusals_total{code=\"sandbox_not_found\"}", 0) + 1
    assert after["runtime_machine_starts_total{from=\"image\",result=\"ok\"}"] >= 1
    assert after["runtime_machine_start_seconds_count{from=\"image\"}"] >= 1
    assert after["runtime_http_responses_total{class=\"2xx\"}"] > before["runtime_http_responses_total{class=\"2xx\"}"]


def test_only_the_accounts_keys_read_the_metrics(server):
    assert http(server, "GET", "/metrics", key=None).status == 401
    tenant = server.create_key()
    refused = http(server, "GET", "/metrics", key=tenant)
    assert refused.status == 403, refused
    assert refused.json()["error"]["code"] == "forbidden"
    scraper = server.create_key(read_only=True)
    assert "runtime_uptime_seconds" in scrape(server, key=scraper)


@pytest.fixture(scope="module")
def json_logs():
    root = Path(tempfile.mkdtemp(prefix="runtime-e2e-logs-"))
    os.chmod(root, 0o711)
    srv = Server(root, ("--log-format", "json"))
    old = os.environ.get("RUNTIME_LOG")
    os.environ["RUNTIME_LOG"] = "info,runtime_server::http=debug"
    try:
        srv.start()
    finally:
        if old is None:
            os.environ.pop("RUNTIME_LOG", None)
        else:
            os.environ["RUNTIME_LOG"] = old
    try:
        yield srv
    finally:
        srv.stop()
        srv.egress.close()
        shutil.rmtree(root, ignore_errors=True)


def test_json_logs_carry_the_request_id_of_the_answer(json_logs):
    answer = http(json_logs, "GET", "/v1/sandboxes/sbx_not_here")
    assert answer.status == 404, answer
    rid = answer.headers["x-request-id"]
    assert answer.json()["error"]["requestId"] == rid
    json_logs.stop()
    records = []
    for line in json_logs.log_path.read_text().splitlines():
        if line.startswith("{"):
            records.append(json.loads(line))
    assert records, "no JSON log line"
    assert all({"timestamp", "level", "message"} <= r.keys() for r in records)
    mine = [r for r in records if r.get("span", {}).get("request_id") == rid]
    assert mine, f"no line with {rid}"
    answered = [r for r in mine if r["message"] == "answered"]
    assert answered and answered[0]["status"] == 404, mine
    assert answered[0]["span"]["path"] == "/v1/sandboxes/sbx_not_here"


@pytest.fixture(scope="module")
def inspected():
    """A server whose guests trust its test servers' CA (`--guest-ca`), as
    an operator behind a TLS-inspecting proxy gives that proxy's CA."""
    root = Path(tempfile.mkdtemp(prefix="runtime-e2e-guest-ca-"))
    os.chmod(root, 0o711)
    srv = Server(root)
    # A key and a comment beside the certificate: only the certificate goes in.
    bundle = root / "operator-ca.pem"
    bundle.write_text("# the inspecting proxy's CA\n" + srv.egress.ca_pem.read_text()
                      + (srv.egress.root / "ca.key").read_text())
    srv.extra_args += ["--guest-ca", str(bundle)]
    srv.start()
    try:
        yield srv
    finally:
        srv.delete_all_sandboxes()
        srv.stop()
        srv.egress.close()
        srv.kill_leftover_qemu()
        shutil.rmtree(root, ignore_errors=True)


# HTTPS to a test server whose certificate only the test CA signs; no -k.
VERIFIED = "curl -sS --max-time 60 https://example.com/echo/tls"


def test_guest_ca_is_trusted_in_the_sandboxes_of_the_server_given_it(server, sbx, inspected):
    from withruntime import Runtime

    # Without --guest-ca the test servers' certificate is nobody's.
    r = sbx.exec(VERIFIED, timeout_ms=120_000)
    assert r.exit_code != 0 and "certificate" in r.stderr, r
    with Runtime(api_key=inspected.admin_key(), base_url=inspected.url) as rt:
        s = rt.sandboxes.create(memory_mib=512)
        try:
            r = s.exec(VERIFIED, timeout_ms=120_000)
            assert r.exit_code == 0 and json.loads(r.stdout)["host"] == "example.com", r
            # Node reads NODE_EXTRA_CA_CERTS: the sandbox's CA and the operator's.
            r = s.exec("node -e \"fetch('https://example.com/echo/node').then(r => r.json())"
                       ".then(j => console.log(j.path))\"", timeout_ms=120_000)
            assert r.exit_code == 0 and r.stdout.strip() == "/echo/node", r
            bundle = s.exec("cat \"$NODE_EXTRA_CA_CERTS\"").stdout
            assert bundle.count("BEGIN CERTIFICATE") == 2 and "PRIVATE KEY" not in bundle, bundle
            assert "the inspecting proxy" not in bundle
        finally:
            s.delete()


def test_a_guest_ca_file_without_a_certificate_stops_the_server(tmp_path):
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    srv = Server(tmp_path / "srv", ("--guest-ca", str(bad)))
    try:
        with pytest.raises(RuntimeError) as failed:
            srv.start()
        assert "--guest-ca" in str(failed.value) and "holds no PEM certificate" in str(failed.value), failed.value
    finally:
        srv.stop()
        srv.egress.close()
