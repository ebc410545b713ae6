"""The network through the official client: egress rules enforced by the
host's proxy (root in the guest included), secrets the guest never sees,
previews, terminals and port forwarding.

Internet hosts are played by local servers (egress_servers.py) that the
server reaches through its TEST-ONLY `--egress-test-map`: `example.com`,
`example.org` and `*.example.org` over HTTPS, `example.net` and
`*.example.net` over HTTP.
"""
from __future__ import annotations

import hashlib
import http.client
import json
import socket
import time
import urllib.request

import pytest
from withruntime import Sandbox

from egress_servers import BIG


def run(sbx, command: str, **kw) -> tuple[int, str, str]:
    r = sbx.exec(command, timeout_ms=kw.pop("timeout_ms", 120_000), **kw)
    return r.exit_code, r.stdout, r.stderr


def curl(sbx, url: str, *extra: str) -> tuple[int, str]:
    """curl in the guest through the environment's proxy; (exit code, body or error)."""
    code, out, err = run(sbx, f"curl -sSf --max-time 30 {' '.join(extra)} \"{url}\"")
    return code, out if code == 0 else err


@pytest.fixture(scope="module")
def net_sbx(server):
    s = Sandbox.create()
    yield s
    s.delete()


def test_the_guest_has_only_loopback_and_the_proxy_in_its_environment(net_sbx):
    code, out, _ = run(net_sbx, "ls /sys/class/net; env | grep -i _proxy | sort")
    assert code == 0
    lines = out.split()
    assert lines[0] == "lo" and "eth0" not in lines, out
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        assert f"{name}=http://127.0.0.1:10800" in lines, out
    assert "ALL_PROXY=socks5h://127.0.0.1:10800" in lines, out


def test_default_rules_reach_public_hosts_and_refuse_private_ones(net_sbx):
    code, body = curl(net_sbx, "http://example.net/echo/plain")
    assert code == 0, body
    assert json.loads(body)["path"] == "/echo/plain"
    # HTTPS through CONNECT; the test servers' own CA is not the guest's.
    code, body = curl(net_sbx, "https://example.com/echo/tls", "-k")
    assert code == 0, body
    assert json.loads(body)["host"] == "example.com"
    # socks5h, as ALL_PROXY says.
    code, body = curl(net_sbx, "http://a.example.net/echo/socks", "--proxy socks5h://127.0.0.1:10800")
    assert code == 0, body
    # Python's urllib reads the proxy variables too.
    code, out, err = run(net_sbx, "python3 -c \"import urllib.request;"
                                  "print(urllib.request.urlopen('http://example.net/echo/py').read().decode())\"")
    assert code == 0 and json.loads(out)["path"] == "/echo/py", err
    for target in ("http://10.0.0.1/", "http://169.254.169.254/latest/meta-data/",
                   "http://[::1]:8080/", "http://localhost:22/", "https://127.0.0.1/"):
        code, out = curl(net_sbx, target, "-k")
        assert code != 0, f"{target} was reached: {out}"


def test_allow_wildcards_deny_and_ports_change_at_once(server):
    with Sandbox.create(network={"internet": True, "allow": ["*.example.org"]}) as s:
        assert curl(s, "https://a.example.org/echo", "-k")[0] == 0
        assert curl(s, "https://b.c.example.org/echo", "-k")[0] == 0
        code, err = curl(s, "https://example.org/echo", "-k")
        assert code != 0, "the apex passed a *.example.org rule"
        assert curl(s, "http://example.net/echo")[0] != 0
        rules = s.network.get()
        assert rules["allow"] == ["*.example.org"] and rules["enforced"] is True

        s.network.set(internet=True, allow=["*.example.org"], deny=["b.example.org"])
        assert curl(s, "https://b.example.org/echo", "-k")[0] != 0, "deny did not win"
        assert curl(s, "https://a.example.org/echo", "-k")[0] == 0

        # Ports beyond 80 and 443 need a connect entry.
        assert curl(s, "https://a.example.org:8443/echo", "-k")[0] != 0
        answer = s.network.set(internet=True, connect=["a.example.org:8443"])
        assert 8443 in answer["ports"]
        assert curl(s, "https://a.example.org:8443/echo", "-k")[0] == 0

        s.network.off()
        assert s.network.get()["internet"] is False
        for url in ("https://a.example.org/echo", "http://example.net/echo"):
            assert curl(s, url, "-k")[0] != 0


def test_a_change_cuts_a_connection_already_open(server):
    with Sandbox.create() as s:
        # One keep-alive connection through the proxy: a request, then
        # another after the rules changed.
        script = (
            "import socket,os,time\n"
            "c=socket.create_connection(('127.0.0.1',10800))\n"
            "req=b'GET http://example.net/echo/1 HTTP/1.1\\r\\nHost: example.net\\r\\n\\r\\n'\n"
            "c.sendall(req); d=b''\n"
            "while b'\\r\\n\\r\\n' not in d: d+=c.recv(65536)\n"
            "head,body=d.split(b'\\r\\n\\r\\n',1)\n"
            "n=int([l.split(b':')[1] for l in head.split(b'\\r\\n') if l.lower().startswith(b'content-length')][0])\n"
            "while len(body)<n: body+=c.recv(65536)\n"
            "print('first', head.split(b' ')[1].decode(), flush=True)\n"
            "while not os.path.exists('/tmp/go'): time.sleep(0.05)\n"
            "try:\n"
            "  c.sendall(req.replace(b'/1',b'/2')); c.settimeout(20); d=c.recv(65536)\n"
            "  print('second', d.split(b' ')[1].decode() if d else 'closed')\n"
            "except OSError as e: print('second', 'closed', e)\n"
        )
        s.files.write("/tmp/keep.py", script)
        proc = s.spawn("python3 /tmp/keep.py")
        events = proc.output(timeout_seconds=60)
        first = next(e for e in events if e["type"] in ("stdout", "exit"))
        events.close()
        assert first.get("data", "").startswith("first 200"), first
        s.network.off()
        s.files.write("/tmp/go", "")
        result = proc.wait()
        assert "second closed" in result.stdout, result.stdout + result.stderr


def test_root_has_no_other_way_out(server):
    with Sandbox.create(user="root") as s:
        probes = {
            # a direct connection is carried to the proxy (docs/network.md,
            # transparent egress), which refuses a port the rules do not open
            "direct": "python3 -c \"import socket; c=socket.create_connection(('93.184.215.14', 8080), timeout=15);"
                      " c.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n'); assert c.recv(100)\"",
            # a raw socket can be made by root, but nothing comes back
            "raw": "python3 -c \"import socket; r=socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP);"
                   " r.settimeout(3); r.sendto(b'\\x08\\x00\\xf7\\xff\\x00\\x00\\x00\\x00', ('93.184.215.14', 0));"
                   " r.recvfrom(2048)\"",
            # without the proxy variables, private addresses stay refused
            "unset": "env -u http_proxy -u HTTP_PROXY -u ALL_PROXY -u all_proxy curl -sS --max-time 10 http://10.0.0.1/",
            # another proxy port: nothing listens there
            "other proxy": "curl -sS --max-time 10 -x http://127.0.0.1:3128 http://example.net/",
            # a new interface cannot be made to carry anything either
            "dummy": "ip link add d0 type dummy && ip addr add 192.0.2.2/24 dev d0 && ip link set d0 up && "
                     "curl -sS --noproxy '*' --max-time 10 http://192.0.2.1/",
        }
        for what, command in probes.items():
            code, out, err = run(s, command, timeout_ms=60_000)
            assert code != 0, f"{what} got out: {out} {err}"
        s.network.off()
        assert curl(s, "http://example.net/echo")[0] != 0


def test_pip_npm_and_git_work_through_the_proxy(net_sbx, server):
    code, out, err = run(net_sbx, "pip install --index-url http://pypi.example.net/simple/ "
                                  "--trusted-host pypi.example.net rtdemo && python3 -c 'import rtdemo; print(rtdemo.ANSWER)'",
                         timeout_ms=300_000)
    assert code == 0 and out.strip().endswith("42"), out + err
    code, out, err = run(net_sbx, "mkdir -p /tmp/npmt && cd /tmp/npmt && "
                                  "npm install --no-audit --no-fund --registry http://npm.example.net/npm/ rtdemo && "
                                  "node -e 'console.log(require(\"rtdemo\"))'", timeout_ms=300_000)
    assert code == 0 and out.strip().endswith("42"), out + err
    # git over HTTPS (the test servers' CA given to git for this clone)
    net_sbx.files.write("/tmp/test-ca.pem", server.egress.ca_pem.read_text())
    code, out, err = run(net_sbx, "GIT_SSL_CAINFO=/tmp/test-ca.pem git clone -q https://example.com/git/repo.git "
                                  "/tmp/repo && cat /tmp/repo/README", timeout_ms=300_000)
    assert code == 0 and "cloned through the egress proxy" in out, out + err


def test_egress_throughput_is_whole(net_sbx):
    code, out, err = run(net_sbx, "curl -sS --max-time 120 http://example.net/big | sha256sum", timeout_ms=180_000)
    assert code == 0, err
    assert out.split()[0] == hashlib.sha256(BIG).hexdigest()


def test_secrets_reach_their_hosts_and_never_the_guest(server, runtime):
    value = "sk-e2e-" + hashlib.sha256(str(time.time()).encode()).hexdigest()[:24]
    secret = runtime.secrets.set("E2E_TOKEN", value=value, hosts=["api.example.org"],
                                 header="Authorization", format="Bearer {value}")
    placeholder = secret["placeholder"]
    plain = runtime.secrets.set("E2E_PLAIN", value=value + "-p", hosts=["api.example.org", "api.example.net"])
    try:
        with Sandbox.create() as s:
            code, out, _ = run(s, "echo $E2E_TOKEN; echo $E2E_PLAIN")
            assert out.split() == [placeholder, plain["placeholder"]], out
            code, out, _ = run(s, f"grep -rl -- '{value}' /etc /tmp /workspace /root 2>/dev/null; "
                                  f"cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c -- '{value}'")
            assert value not in out.replace(f"grep -c -- '{value}'", ""), out

            # The guest trusts its sandbox's CA: no -k here. The placeholder
            # is in the path, the query, a credential header, a header the
            # host reflects and the body; the echo host sends it all back.
            code, body = curl(s, "https://api.example.org/echo/$E2E_PLAIN?k=$E2E_PLAIN",
                              '-H "x-api-key: $E2E_PLAIN"', '-H "x-whatever: $E2E_PLAIN"', '-d "$E2E_PLAIN"')
            assert code == 0, body
            got = server.egress.seen[-1]
            assert got["headers"]["authorization"] == f"Bearer {value}"
            assert got["headers"]["x-api-key"] == value + "-p"
            assert got["headers"]["x-whatever"] == plain["placeholder"], "a non-credential header got the value"
            assert got["path"] == f"/echo/{plain['placeholder']}?k={value}-p", "the path got the value"
            assert got["headers"]["accept-encoding"] == "identity"
            assert got["body"] == plain["placeholder"], "a body was rewritten"
            # What the guest saw: the echo, scrubbed of every value.
            assert value not in body, body
            seen = json.loads(body)
            # (a secret with a header: that whole header is masked)
            assert seen["headers"]["authorization"] == "*" * len(f"Bearer {value}")
            assert seen["headers"]["x-api-key"] == "*" * len(value + "-p")
            assert seen["path"] == f"/echo/{plain['placeholder']}?k=" + "*" * len(value + "-p")
            # TRACE would echo the request: refused by the proxy.
            code, out, err = run(s, "curl -sS --max-time 30 -X TRACE -o /dev/null -w '%{http_code}' "
                                    "-H \"x-api-key: $E2E_PLAIN\" https://api.example.org/echo")
            assert out.strip() == "405", out + err
            # Plain HTTP never carries a secret.
            code, body = curl(s, "http://api.example.net/echo", '-H "x-api-key: $E2E_PLAIN"')
            assert code == 0 and json.loads(body)["headers"]["x-api-key"] == plain["placeholder"]
            # Another host gets the placeholder.
            code, body = curl(s, "https://example.com/echo", "-k", '-H "x-api-key: $E2E_PLAIN"')
            assert code == 0 and json.loads(body)["headers"]["x-api-key"] == plain["placeholder"]
            # A new value reaches running sandboxes (at once on their node,
            # within a second when another node took the change); the
            # placeholder stays.
            again = runtime.secrets.set("E2E_PLAIN", value=value + "-q", hosts=["api.example.org"])
            assert again["placeholder"] == plain["placeholder"]
            deadline = time.monotonic() + 5
            while True:
                code, body = curl(s, "https://api.example.org/echo", '-H "x-api-key: $E2E_PLAIN"')
                assert code == 0 and value not in body, body
                sent = server.egress.seen[-1]["headers"]["x-api-key"]
                if sent == value + "-q" or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert sent == value + "-q"
        listed = {x["name"]: x for x in runtime.secrets.list()}
        assert "E2E_TOKEN" in listed and value not in json.dumps(listed)
    finally:
        for name in ("E2E_TOKEN", "E2E_PLAIN"):
            runtime.secrets.delete(name)


GUEST_SERVER = r"""
import base64, hashlib, socket, threading, http.server, os, sys
class H(http.server.SimpleHTTPRequestHandler):
    def do_GET(self):
        if self.headers.get('upgrade', '').lower() == 'websocket':
            key = self.headers['sec-websocket-key']
            accept = base64.b64encode(hashlib.sha1((key + '258EAFA5-E914-47DA-95CA-C5AB0DC85B11').encode()).digest()).decode()
            self.send_response(101)
            self.send_header('Upgrade', 'websocket'); self.send_header('Connection', 'Upgrade')
            self.send_header('Sec-WebSocket-Accept', accept); self.end_headers(); self.wfile.flush()
            c = self.connection
            while True:
                h = c.recv(2)
                if len(h) < 2: return
                n = h[1] & 0x7f
                mask = c.recv(4); data = b''
                while len(data) < n: data += c.recv(n - len(data))
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
                if h[0] & 0x0f == 8: return
                c.sendall(bytes([0x81, len(data)]) + data)
        return super().do_GET()
os.chdir('/tmp/site')
http.server.ThreadingHTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()
"""


def preview_get(server, host: str, path: str, headers: dict | None = None) -> tuple[int, bytes, dict]:
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    c.request("GET", path, headers={"Host": host, **(headers or {})})
    r = c.getresponse()
    body = r.read()
    c.close()
    return r.status, body, dict(r.getheaders())


def test_previews_serve_a_guest_port_with_tokens_and_websockets(server):
    with Sandbox.create() as s:
        s.files.write("/tmp/site/index.html", "hello from the guest\n")
        s.files.write("/tmp/serve.py", GUEST_SERVER)
        s.spawn("python3 /tmp/serve.py 8000")
        preview = s.previews.create(8000)
        host = f"8000-{s.id}.localhost:{server.port}"
        assert preview["url"] == f"http://{host}/"
        assert preview["visibility"] == "private" and preview["token"]
        deadline = time.monotonic() + 60
        while True:
            status, body, _ = preview_get(server, host, "/index.html",
                                          {"x-runtime-preview-token": preview["token"]})
            if status == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert (status, body) == (200, b"hello from the guest\n")
        assert preview_get(server, host, "/index.html")[0] == 401
        # The link with the token works in a browser: it sets a cookie.
        status, body, headers = preview_get(server, host, f"/index.html?runtime_preview_token={preview['token']}")
        assert status == 200 and "runtime_preview_token" in headers.get("set-cookie", "")

        # A WebSocket through the preview.
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        sock.sendall((f"GET /ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                      f"x-runtime-preview-token: {preview['token']}\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(1)
        assert head.startswith(b"HTTP/1.1 101"), head
        assert b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" in head
        sock.sendall(bytes([0x81, 0x84, 1, 2, 3, 4]) + bytes(b ^ m for b, m in zip(b"ping", [1, 2, 3, 4])))
        reply = sock.recv(16)
        assert reply == bytes([0x81, 4]) + b"ping", reply

        rotated = s.previews.rotate(8000)
        assert preview_get(server, host, "/index.html", {"x-runtime-preview-token": preview["token"]})[0] == 403
        # The WebSocket opened with the old token is closed.
        sock.settimeout(10)
        try:
            assert sock.recv(16) == b""
        except OSError:
            pass
        sock.close()
        assert preview_get(server, host, "/index.html", {"x-runtime-preview-token": rotated["token"]})[0] == 200
        s.previews.create(8000, visibility="public")
        assert preview_get(server, host, "/index.html")[0] == 200
        assert len(s.previews.list()) == 1
        s.previews.delete(8000)
        assert preview_get(server, host, "/index.html")[0] == 404


def test_a_preview_visit_wakes_a_paused_sandbox(server):
    with Sandbox.create() as s:
        s.files.write("/tmp/site/index.html", "awake\n")
        s.files.write("/tmp/serve.py", GUEST_SERVER)
        s.spawn("python3 /tmp/serve.py 8001")
        s.previews.create(8001, visibility="public")
        host = f"8001-{s.id}.localhost:{server.port}"
        deadline = time.monotonic() + 60
        while preview_get(server, host, "/index.html")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        s.pause()
        assert s.refresh().state == "paused"
        status, body, _ = preview_get(server, host, "/index.html")
        assert (status, body) == (200, b"awake\n")


def test_terminal_runs_a_shell(net_sbx):
    term = net_sbx.terminal(cols=100, rows=30)
    assert term.process_id
    term.write("echo term-$((40+2)); tput cols; exit 3\n")
    seen = b""
    while True:
        chunk = term.recv()
        if chunk is None:
            break
        seen += chunk
    assert b"term-42" in seen, seen
    assert b"100" in seen, seen
    assert term.exit_code == 3


def test_forward_port_carries_many_connections_and_big_bodies(net_sbx):
    net_sbx.files.write("/tmp/fwd/big.bin", BIG)
    net_sbx.spawn("cd /tmp/fwd && python3 -m http.server 8002 --bind 127.0.0.1")
    with net_sbx.forward_port(8002, local_port=0) as fwd:
        url = f"http://127.0.0.1:{fwd.local_port}/big.bin"
        deadline = time.monotonic() + 60
        while True:
            try:
                data = urllib.request.urlopen(url, timeout=60).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert hashlib.sha256(data).hexdigest() == hashlib.sha256(BIG).hexdigest()
        for _ in range(5):
            assert len(urllib.request.urlopen(url, timeout=60).read()) == len(BIG)
