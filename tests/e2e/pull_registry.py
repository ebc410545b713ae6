"""A real container registry on loopback for the registry-image tests.

Debian's `docker-registry` (the reference registry) serves HTTPS with a
certificate for `registry.example.com` signed by the e2e test CA (the one
`--egress-test-root` makes the server trust), and the server maps that name
to it with `--egress-test-map`. Test images are pushed with the registry's
HTTP API: layers are tars made here from the host's own `bash` (and its
libraries) and static `busybox`, compressed with gzip or zstd.
"""
from __future__ import annotations

import gzip
import hashlib
import http.client
import io
import json
import os
import shutil
import ssl
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Optional

NAME = "registry.example.com"
BINARY = shutil.which("docker-registry") or "/usr/bin/docker-registry"

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"


def digest(b: bytes) -> str:
    return "sha256:" + hashlib.sha256(b).hexdigest()


class Layer:
    """A tar built in memory."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buf, mode="w", format=tarfile.PAX_FORMAT)

    def dir(self, path: str, mode: int = 0o755) -> "Layer":
        info = tarfile.TarInfo(path.lstrip("/"))
        info.type, info.mode = tarfile.DIRTYPE, mode
        self.tar.addfile(info)
        return self

    def file(self, path: str, data: bytes, mode: int = 0o644) -> "Layer":
        info = tarfile.TarInfo(path.lstrip("/"))
        info.size, info.mode = len(data), mode
        self.tar.addfile(info, io.BytesIO(data))
        return self

    def symlink(self, path: str, target: str) -> "Layer":
        info = tarfile.TarInfo(path.lstrip("/"))
        info.type, info.linkname = tarfile.SYMTYPE, target
        self.tar.addfile(info)
        return self

    def host_file(self, path: str) -> "Layer":
        real = os.path.realpath(path)
        with open(real, "rb") as f:
            return self.file(path, f.read(), os.stat(real).st_mode & 0o7777)

    def bytes(self) -> bytes:
        self.tar.close()
        return self.buf.getvalue()


def base_layer() -> Layer:
    """bash with its libraries, and busybox for the usual commands."""
    layer = Layer()
    for d in ("bin", "usr", "usr/bin", "lib", "lib64", "lib/x86_64-linux-gnu", "etc", "tmp", "srv",
              "srv/app", "opt", "opt/data"):
        layer.dir(d, 0o1777 if d == "tmp" else 0o755)
    layer.host_file("/bin/bash")
    out = subprocess.run(["ldd", "/bin/bash"], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        parts = line.split()
        lib = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if lib.startswith("/"):
            layer.host_file(lib)
    layer.host_file("/bin/busybox")
    for tool in ("sh", "cat", "ls", "id", "env", "pwd", "echo", "sleep", "mkdir", "test", "touch",
                 "rm", "sync", "mount", "umount", "uname", "head", "tr", "wc", "stat", "grep"):
        layer.symlink(f"bin/{tool}", "busybox")
    layer.file("etc/passwd", b"root:x:0:0:root:/root:/bin/bash\n")
    layer.file("etc/group", b"root:x:0:\n")
    layer.file("srv/app/remove-me", b"a whiteout removes this\n")
    layer.file("srv/app/keep-me", b"kept\n")
    layer.file("opt/data/old1", b"1\n")
    layer.file("opt/data/old2", b"2\n")
    return layer


def alpine_layer() -> Layer:
    """An Alpine-like root: the static busybox and its applets, `/bin/sh`
    -> busybox, no bash, no libc."""
    layer = Layer()
    for d in ("bin", "sbin", "usr", "usr/bin", "etc", "tmp", "root", "var"):
        layer.dir(d, 0o1777 if d == "tmp" else 0o755)
    layer.host_file("/bin/busybox")
    applets = subprocess.run(["/bin/busybox", "--list"], check=True, capture_output=True,
                             text=True).stdout.split()
    for a in sorted(set(applets) - {"busybox", "bash"}):
        layer.symlink(f"bin/{a}", "busybox")
    layer.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n")
    layer.file("etc/group", b"root:x:0:\n")
    layer.file("etc/os-release", b"NAME=\"alpine-like test image\"\nID=alpine\n")
    return layer


class Registry:
    """`docker-registry serve` on 127.0.0.1, HTTPS for `registry.example.com`."""

    def __init__(self, root: Path, ca_pem: Path, ca_key: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.storage = root / "storage"
        self._cert(ca_pem, ca_key)
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        (root / "config.yml").write_text(json.dumps({
            "version": 0.1,
            "log": {"level": "warn"},
            "storage": {"filesystem": {"rootdirectory": str(self.storage)}, "delete": {"enabled": True}},
            "http": {"addr": f"127.0.0.1:{self.port}",
                     "tls": {"certificate": str(root / "leaf.pem"), "key": str(root / "leaf.key")}},
        }))
        self.log = (root / "registry.log").open("w")
        self.proc = subprocess.Popen([BINARY, "serve", str(root / "config.yml")], stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.ctx = ssl.create_default_context(cafile=str(ca_pem))
        deadline = time.monotonic() + 30
        while True:
            try:
                status, _, _ = self._req("GET", "/v2/")
                if status in (200, 401):
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"docker-registry did not start: {(root / 'registry.log').read_text()}")
            time.sleep(0.2)

    def _cert(self, ca_pem: Path, ca_key: Path) -> None:
        r = self.root
        run = lambda *a: subprocess.run(a, check=True, capture_output=True, timeout=60)  # noqa: E731
        (r / "leaf.ext").write_text(f"subjectAltName=DNS:{NAME},IP:127.0.0.1\n")
        run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={NAME}",
            "-keyout", str(r / "leaf.key"), "-out", str(r / "leaf.csr"))
        run("openssl", "x509", "-req", "-in", str(r / "leaf.csr"), "-CA", str(ca_pem), "-CAkey", str(ca_key),
            "-CAcreateserial", "-days", "2", "-out", str(r / "leaf.pem"), "-extfile", str(r / "leaf.ext"))

    @property
    def args(self) -> list[str]:
        return ["--egress-test-map", f"{NAME}=127.0.0.1:{self.port}"]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()

    # -- the registry API ------------------------------------------------
    def _req(self, method: str, path: str, body: bytes = b"",
             headers: Optional[dict] = None) -> tuple[int, dict, bytes]:
        c = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.ctx, timeout=60)
        try:
            c.request(method, path, body=body or None, headers=headers or {})
            r = c.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            c.close()

    def blob(self, repo: str, data: bytes) -> str:
        d = digest(data)
        status, h, body = self._req("POST", f"/v2/{repo}/blobs/uploads/")
        assert status == 202, (status, body)
        loc = h["Location"]
        loc = loc.split(str(self.port), 1)[1] if loc.startswith("http") else loc
        sep = "&" if "?" in loc else "?"
        status, _, body = self._req("PUT", f"{loc}{sep}digest={d}", data,
                                    {"Content-Type": "application/octet-stream"})
        assert status == 201, (status, body)
        return d

    def manifest(self, repo: str, ref: str, doc: dict, media_type: str) -> str:
        data = json.dumps(doc).encode()
        status, _, body = self._req("PUT", f"/v2/{repo}/manifests/{ref}", data, {"Content-Type": media_type})
        assert status == 201, (status, body)
        return digest(data)

    def image(self, repo: str, tag: Optional[str], layers: list[tuple[bytes, str]], config: dict,
              arch: str = "amd64") -> tuple[str, int]:
        """Pushes `layers` (tar, "gzip"|"zstd") and a config; returns the
        manifest's digest and size."""
        descs, diff_ids = [], []
        for tar, kind in layers:
            diff_ids.append(digest(tar))
            if kind == "gzip":
                blob, mt = gzip.compress(tar, mtime=0), LAYER_GZIP
            else:
                blob = subprocess.run(["zstd", "-q", "-c"], input=tar, check=True, capture_output=True).stdout
                mt = LAYER_ZSTD
            descs.append({"mediaType": mt, "digest": self.blob(repo, blob), "size": len(blob)})
        cfg = json.dumps({"architecture": arch, "os": "linux", "config": config,
                          "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
        doc = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
               "config": {"mediaType": OCI_CONFIG, "digest": self.blob(repo, cfg), "size": len(cfg)},
               "layers": descs}
        data = json.dumps(doc).encode()
        d = self.manifest(repo, tag or digest(data), doc, OCI_MANIFEST)
        return d, len(data)

    def index(self, repo: str, tag: str, manifests: list[tuple[str, int, str]]) -> str:
        doc = {"schemaVersion": 2, "mediaType": OCI_INDEX,
               "manifests": [{"mediaType": OCI_MANIFEST, "digest": d, "size": n,
                              "platform": {"architecture": arch, "os": "linux"}}
                             for d, n, arch in manifests]}
        return self.manifest(repo, tag, doc, OCI_INDEX)

    def corrupt(self, blob_digest: str) -> None:
        """Changes a stored blob's bytes, so the registry serves it wrong."""
        hexd = blob_digest.split(":", 1)[1]
        data = self.storage / "docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
