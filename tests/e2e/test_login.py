"""`runtime login` end to end: the CLI asks, a person approves on the
server's page in a real (headless) Chromium, driven over the DevTools
protocol, and then `Sandbox.create()` works from the saved login with no key
in the environment."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import BINARY

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    """One Chromium tab over the DevTools protocol (websockets' sync client)."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.next_id = 0
        self.call("Page.enable")
        self.call("Runtime.enable")

    def call(self, method: str, **params):
        self.next_id += 1
        mine = self.next_id
        self.ws.send(json.dumps({"id": mine, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == mine:
                assert "error" not in message, message
                return message.get("result", {})

    def wait_event(self, name: str, timeout: float = 60):
        deadline = time.monotonic() + timeout
        while True:
            message = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("method") == name:
                return message.get("params", {})

    def js(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def load(self, action) -> None:
        """Runs `action` (a navigation or a submit) and waits for the new page."""
        action()
        self.wait_event("Page.loadEventFired")


@pytest.fixture
def chromium(tmp_path):
    if CHROMIUM is None:
        pytest.fail("chromium is not installed (scripts/host-packages.sh installs Debian's package)")
    profile = tmp_path / "chromium-profile"
    proc = subprocess.Popen(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
         f"--user-data-dir={profile}", "about:blank"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=(tmp_path / "chromium.log").open("w"),
        start_new_session=True)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None, (tmp_path / "chromium.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        targets = json.loads(opener.open(f"http://127.0.0.1:{port}/json/list", timeout=30).read())
        from websockets.sync.client import connect
        url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        with connect(url, max_size=None, open_timeout=30) as ws:
            yield Page(ws)
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(30)


def test_login_in_the_browser_then_sandbox_create_with_no_key(server, chromium, tmp_path):
    config = tmp_path / "config"
    env = {k: v for k, v in os.environ.items() if k not in ("RUNTIME_API_KEY", "RUNTIME_AUTH_URL")}
    env.update(XDG_CONFIG_HOME=str(config), HOME=str(tmp_path))
    cli = subprocess.Popen([str(BINARY), "login", "--url", server.url, "--no-browser", "--computer", "e2e-laptop"],
                           env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, start_new_session=True)
    try:
        approve_url = cli.stdout.readline().strip()
        assert approve_url.startswith(server.url + "/login/"), approve_url
        shown = cli.stderr.readline()
        code = shown.strip().rsplit(" ", 1)[-1].rstrip(":")

        page = chromium
        page.load(lambda: page.call("Page.navigate", url=approve_url))
        assert page.js("document.getElementById('code').textContent") == code
        assert page.js("document.getElementById('computer').textContent") == "e2e-laptop"

        def submit(admin_key: str) -> None:
            page.js(f"""(() => {{
                document.getElementById('adminKey').value = {json.dumps(admin_key)};
                document.getElementById('name').value = 'e2e laptop key';
                document.getElementById('dailyLimit').value = '2.50';
                document.getElementById('approve').click();
            }})()""")

        # A wrong key approves nothing; the page says so.
        page.load(lambda: submit("rtcloud_not-the-admin-key"))
        assert "not an admin key" in page.js("document.getElementById('error').textContent")
        page.load(lambda: submit(server.admin_key()))
        assert "Approved" in page.js("document.getElementById('result').textContent")

        assert cli.wait(60) == 0, cli.stderr.read()
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, 9)
            cli.wait(30)

    # Saved where the client reads it, private as it requires.
    folder = config / "runtime-cloud"
    files = list(folder.iterdir())
    assert len(files) == 1, files
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    assert json.loads(files[0].read_text())["apiOrigin"] == server.url

    # A fresh Python with no key in its environment: the saved login is used.
    script = """
import json
from withruntime import Runtime, Sandbox
with Runtime() as rt:
    me, limits = rt.me(), rt.request("GET", "/v1/limits")
sbx = Sandbox.create(vcpu=1, memory_mib=1024, disk_mib=3072)
try:
    out = sbx.exec("echo logged-in").stdout
finally:
    sbx.delete()
print(json.dumps({"name": me["credentialName"], "limit": limits["daily"]["limitMicros"], "out": out}))
"""
    env["RUNTIME_API_URL"] = server.url
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"name": "e2e laptop key", "limit": "2500000", "out": "logged-in\n"}

    # Without the saved login the same script has no key.
    shutil.rmtree(folder)
    failed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    assert failed.returncode != 0


def own_address() -> str | None:
    """An address of this machine that is not loopback (connections from it
    to 127.0.0.1 stay on this machine but do not come from loopback)."""
    import socket
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.250", 9))  # no packet is sent: picks a route
        ip = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if ip.startswith("127.") else ip


def test_the_approval_page_is_not_served_over_plain_http_to_another_address(server):
    """Without TLS, the page that takes the admin key answers only this
    machine's loopback: a browser elsewhere gets a 403 that says why, and
    a post of the key from there approves nothing."""
    import http.client

    source = own_address()
    if source is None:
        pytest.skip("this machine has no address but loopback to connect from")

    def call(method: str, path: str, body: str | None, frm: str | None):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30,
                                          source_address=(frm, 0) if frm else None)
        try:
            headers = {"content-type": "application/json" if path.startswith("/v1/")
                       else "application/x-www-form-urlencoded"}
            conn.request(method, path, body=body, headers=headers)
            r = conn.getresponse()
            return r.status, r.read().decode()
        finally:
            conn.close()

    status, body = call("POST", "/v1/login/requests", json.dumps({"computer": "elsewhere"}), source)
    assert status == 201, body
    req = json.loads(body)
    status, page = call("GET", req["approvePath"], None, source)
    assert status == 403 and "plain HTTP" in page and "adminKey" not in page, page
    status, _ = call("POST", req["approvePath"], f"adminKey={server.admin_key()}&decision=approve", source)
    assert status == 403
    poll = json.dumps({"pollToken": req["pollToken"]})
    status, body = call("POST", f"/v1/login/requests/{req['id']}:poll", poll, source)
    assert status == 200 and json.loads(body)["status"] == "pending", body
    # From loopback the same page is served.
    status, page = call("GET", req["approvePath"], None, None)
    assert status == 200 and "adminKey" in page, page
