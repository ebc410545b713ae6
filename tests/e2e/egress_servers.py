"""Local servers that stand for hosts on the internet in the network tests.

Private and loopback addresses are always refused by the egress proxy, so the
server is started with its TEST-ONLY settings (`--egress-test-map`,
`--egress-test-root`) that send example host names to these servers:

- `example.com`, `example.org`, `*.example.org` -> an HTTPS server whose
  certificate comes from a CA made here (trusted by the egress proxy through
  `--egress-test-root`; a guest trusts it only if a test gives it the file);
- `example.net`, `*.example.net` -> the same handler over plain HTTP;
- `ssh.example.com` -> a raw TCP server that speaks first, as sshd does
  (`SSH-2.0-RuntimeTest`), then echoes each line it gets upper-cased: what
  programs that ignore the proxy variables (ssh, database clients) reach.
- `udp.example.com` -> a UDP server that answers each datagram with it
  upper-cased and the count of datagrams it has had (outbound UDP).

Both answer: `/echo...` with a JSON account of the request (method, path,
headers, body); a PEP 503 index under `/simple/` with one wheel; an npm
registry under `/npm/`; a git repository over git's dumb HTTP protocol under
`/git/`; `/big` with 8 MiB of known bytes.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import ssl
import subprocess
import socketserver
import tarfile
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional

HTTPS_NAMES = ["example.com", "example.org", "*.example.org"]
HTTP_NAMES = ["example.net", "*.example.net"]
BANNER_NAME = "ssh.example.com"
BANNER = b"SSH-2.0-RuntimeTest\r\n"
UDP_NAME = "udp.example.com"
BIG = hashlib.sha256(b"runtime").digest() * (8 * 1024 * 1024 // 32)
WHEEL = "rtdemo-1.0-py3-none-any.whl"
NPM_TGZ = "rtdemo-1.0.0.tgz"


def _wheel() -> bytes:
    buf = io.BytesIO()
    files = {
        "rtdemo/__init__.py": "ANSWER = 42\n",
        "rtdemo-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: rtdemo\nVersion: 1.0\n",
        "rtdemo-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + "rtdemo-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(buf, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr("rtdemo-1.0.dist-info/RECORD", record)
    return buf.getvalue()


def _npm_tgz() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name, text in {
            "package/package.json": json.dumps({"name": "rtdemo", "version": "1.0.0", "main": "index.js"}),
            "package/index.js": "module.exports = 42;\n",
        }.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o644
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(root: Path, pem: Path, key: Path) -> None:
    """A test CA (`pem`, `key`), the kind `--egress-test-root` trusts."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-subj", "/CN=runtime e2e test CA", "-keyout", str(key), "-out", str(pem),
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign")


def make_leaf(root: Path, ca_pem: Path, ca_key: Path, stem: str, names: list[str],
              ips: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """A server certificate for `names` (and `ips`) signed by the CA:
    `root/<stem>.pem` and `root/<stem>.key`."""
    sans = [f"DNS:{n}" for n in names] + [f"IP:{i}" for i in ips]
    (root / f"{stem}.ext").write_text("subjectAltName=" + ",".join(sans) + "\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={names[0]}",
             "-keyout", str(root / f"{stem}.key"), "-out", str(root / f"{stem}.csr"))
    _openssl("x509", "-req", "-in", str(root / f"{stem}.csr"), "-CA", str(ca_pem),
             "-CAkey", str(ca_key), "-CAcreateserial", "-days", "2", "-out", str(root / f"{stem}.pem"),
             "-extfile", str(root / f"{stem}.ext"))
    return root / f"{stem}.pem", root / f"{stem}.key"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    wheel = b""
    tgz = b""
    git_root: Optional[Path] = None
    seen: list = []  # every /echo request's account, newest last (per EgressServers)

    def log_message(self, *_args) -> None:  # quiet
        pass

    def _send(self, code: int, body: bytes, ctype: str = "application/octet-stream") -> None:
        self.send_response(code)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _handle(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        path = self.path
        host = self.headers.get("host", "")
        if path.startswith("/echo"):
            account = {"method": self.command, "path": path, "host": host,
                       "headers": {k.lower(): v for k, v in self.headers.items()},
                       "body": body.decode(errors="replace")}
            self.seen.append(account)
            del self.seen[:-100]
            return self._send(200, json.dumps(account).encode(), "application/json")
        if path == "/big":
            return self._send(200, BIG)
        if path.rstrip("/") == "/simple/rtdemo":
            page = f'<html><body><a href="/files/{WHEEL}#sha256={hashlib.sha256(self.wheel).hexdigest()}">{WHEEL}</a></body></html>'
            return self._send(200, page.encode(), "text/html")
        if path == f"/files/{WHEEL}":
            return self._send(200, self.wheel)
        if path == "/npm/rtdemo":
            tarball = f"http://{host}/npm/rtdemo/-/{NPM_TGZ}"
            integrity = "sha512-" + __import__("base64").b64encode(hashlib.sha512(self.tgz).digest()).decode()
            doc = {"name": "rtdemo", "dist-tags": {"latest": "1.0.0"},
                   "versions": {"1.0.0": {"name": "rtdemo", "version": "1.0.0", "main": "index.js",
                                          "dist": {"tarball": tarball, "integrity": integrity,
                                                   "shasum": hashlib.sha1(self.tgz).hexdigest()}}}}
            return self._send(200, json.dumps(doc).encode(), "application/json")
        if path == f"/npm/rtdemo/-/{NPM_TGZ}":
            return self._send(200, self.tgz)
        if path.startswith("/git/") and self.git_root is not None:
            rel = path[len("/git/"):].split("?", 1)[0]
            target = (self.git_root / rel).resolve()
            if str(target).startswith(str(self.git_root.resolve())) and target.is_file():
                return self._send(200, target.read_bytes())
        self._send(404, b"not found\n", "text/plain")

    do_GET = do_POST = do_PUT = do_HEAD = _handle


class BannerHandler(socketserver.StreamRequestHandler):
    """Speaks first, then echoes lines upper-cased until the client leaves."""

    def handle(self) -> None:
        self.request.settimeout(60)
        try:
            self.wfile.write(BANNER)
            for line in self.rfile:
                self.wfile.write(line.upper())
        except OSError:
            pass


class BannerServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class UdpHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        data, sock = self.request
        self.server.count += 1
        sock.sendto(data.upper() + f" #{self.server.count}".encode(), self.client_address)


class UdpServer(socketserver.ThreadingUDPServer):
    daemon_threads = True
    count = 0


class EgressServers:
    """Starts both servers; `args` are the `runtime serve` flags that use them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.ca_pem = root / "test-ca.pem"
        self.ca_key = root / "ca.key"
        self._make_certs()
        git_root = root / "git"
        self._make_repo(git_root)
        # What the destinations received, as a test checks it (the guest may
        # see an answer scrubbed of a secret's value).
        self.seen: list = []
        handler = type("H", (Handler,), {"wheel": _wheel(), "tgz": _npm_tgz(), "git_root": git_root,
                                         "seen": self.seen})
        self.https = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(root / "leaf.pem", root / "leaf.key")
        self.https.socket = ctx.wrap_socket(self.https.socket, server_side=True)
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.banner = BannerServer(("127.0.0.1", 0), BannerHandler)
        self.udp = UdpServer(("127.0.0.1", 0), UdpHandler)
        for s in (self.https, self.http, self.banner, self.udp):
            threading.Thread(target=s.serve_forever, daemon=True).start()

    def _make_certs(self) -> None:
        make_ca(self.root, self.ca_pem, self.ca_key)
        make_leaf(self.root, self.ca_pem, self.ca_key, "leaf", HTTPS_NAMES)

    def _make_repo(self, git_root: Path) -> None:
        work = self.root / "git-work"
        work.mkdir()
        env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
               "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com"}
        (work / "README").write_text("cloned through the egress proxy\n")
        for args in (["git", "init", "-q", "-b", "main"], ["git", "add", "README"],
                     ["git", "commit", "-q", "-m", "first"]):
            subprocess.run(args, check=True, capture_output=True, cwd=work, env=env, timeout=60)
        git_root.mkdir()
        subprocess.run(["git", "clone", "-q", "--bare", str(work), str(git_root / "repo.git")],
                       check=True, capture_output=True, timeout=60)
        subprocess.run(["git", "update-server-info"], check=True, capture_output=True,
                       cwd=git_root / "repo.git", timeout=60)

    @property
    def args(self) -> list[str]:
        out = ["--egress-test-map", f"{BANNER_NAME}=127.0.0.1:{self.banner.server_address[1]}",
               "--egress-test-map", f"{UDP_NAME}=127.0.0.1:{self.udp.server_address[1]}"]
        for name in HTTPS_NAMES:
            out += ["--egress-test-map", f"{name}=127.0.0.1:{self.https.server_address[1]}"]
        for name in HTTP_NAMES:
            out += ["--egress-test-map", f"{name}=127.0.0.1:{self.http.server_address[1]}"]
        return out + ["--egress-test-root", str(self.ca_pem)]

    def close(self) -> None:
        for s in (self.https, self.http, self.banner, self.udp):
            s.shutdown()
            s.server_close()
