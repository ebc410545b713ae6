"""Real container registries on loopback for the end-to-end tests.

`Registries(root)` starts two instances of Debian's `docker-registry` (the
reference implementation, "distribution") over TLS:

- `registry.example.com`: public, anyone may pull (and push);
- `private.example.com`: htpasswd (bcrypt) authentication, `USER`/`PASSWORD`.

Their certificate is signed by the egress test CA (`egress_servers.make_ca`;
the CA of an `EgressServers` when one is given, so one `--egress-test-root`
serves both), and `args` are the `runtime serve` flags that send those names
to them through the egress proxy, as real registries would be reached.
`Registries(root, extra_names=["mirror.example.com"])` adds names served by
the public instance, e.g. a Docker Hub mirror for `--registry-mirror`.
With a server of a test module's own, share its CA:

    srv = Server(root)
    regs = Registries(root / "registries", egress=srv.egress)
    srv.extra_args += regs.args
    srv.start()

Images are pushed with the OCI distribution API in plain Python
(`Registry.push_image`, `Registry.push_index`). Their root file system is
built with no network from the host's `busybox-static` and `bash-static`
(scripts/host-packages.sh installs them): `/bin/busybox` with its applets as
symlinks, a static `/bin/bash`, `/bin/sh` -> bash, `/etc/passwd`,
`/etc/group`, `/tmp`. It has no Python, libc or package manager.

The ready-made images (`publish_*`) return an `Pushed` with the digests and
what a test should find in the image.
"""
from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import shutil
import socket
import ssl
import subprocess
import tarfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import zstandard

from egress_servers import make_ca, make_leaf

PUBLIC = "registry.example.com"
PRIVATE = "private.example.com"
USER = "registry-tester"
PASSWORD = "registry-test-password-7c1e"

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_ZSTD = "application/vnd.oci.image.layer.v1.tar+zstd"
OCI_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"

BUSYBOX = Path("/bin/busybox")
BASH_STATIC = Path("/bin/bash-static")
# The image's user, as the sandbox's (docs/environment.md).
PASSWD = ("root:x:0:0:root:/root:/bin/bash\n"
          "runtime:x:1000:1000:runtime:/workspace:/bin/bash\n"
          "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
GROUP = "root:x:0:\nruntime:x:1000:\nnogroup:x:65534:\n"
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Fixed, so that one content gives one digest.
MTIME = 1_700_000_000


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------
# Layers


@dataclass
class Entry:
    """One tar member: a file (`data`), a directory, or a symlink (`link`)."""
    path: str
    data: Optional[bytes] = None
    mode: int = 0o644
    link: Optional[str] = None
    dir: bool = False
    uid: int = 0
    gid: int = 0


def file(path: str, data: bytes | str, mode: int = 0o644, uid: int = 0, gid: int = 0) -> Entry:
    return Entry(path, data.encode() if isinstance(data, str) else data, mode, uid=uid, gid=gid)


def directory(path: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> Entry:
    return Entry(path, mode=mode, dir=True, uid=uid, gid=gid)


def symlink(path: str, target: str) -> Entry:
    return Entry(path, mode=0o777, link=target)


def whiteout(path: str) -> Entry:
    """Deletes `path` of the layers below (`dir/.wh.name`)."""
    head, _, name = path.rstrip("/").rpartition("/")
    return file(f"{head}/.wh.{name}", b"")


def opaque(dir_path: str) -> Entry:
    """Hides everything the layers below have in `dir_path`."""
    return file(f"{dir_path.rstrip('/')}/.wh..wh..opq", b"")


def tar_of(entries: list[Entry]) -> bytes:
    """An uncompressed layer tar, byte for byte the same for the same
    entries (paths relative, `./`-less, as image builders write them)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for e in entries:
            info = tarfile.TarInfo(e.path.lstrip("/"))
            info.mtime, info.mode, info.uid, info.gid = MTIME, e.mode, e.uid, e.gid
            if e.dir:
                info.type = tarfile.DIRTYPE
                t.addfile(info)
            elif e.link is not None:
                info.type, info.linkname = tarfile.SYMTYPE, e.link
                t.addfile(info)
            else:
                data = e.data or b""
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def compress(tar: bytes, how: str) -> tuple[bytes, str]:
    """The layer blob and its media type: `gzip`, `zstd`, `none` or
    `docker` (gzip under Docker's media type)."""
    if how in ("gzip", "docker"):
        out = io.BytesIO()
        with gzip.GzipFile(fileobj=out, mode="wb", mtime=0) as g:
            g.write(tar)
        return out.getvalue(), OCI_LAYER_GZIP if how == "gzip" else DOCKER_LAYER
    if how == "zstd":
        return zstandard.ZstdCompressor(level=3).compress(tar), OCI_LAYER_ZSTD
    if how == "none":
        return tar, OCI_LAYER_TAR
    raise ValueError(how)


def applets() -> list[str]:
    out = subprocess.run([str(BUSYBOX), "--list"], check=True, capture_output=True, text=True,
                         timeout=30).stdout.split()
    return sorted(set(out) - {"busybox", "sh", "bash"})


def rootfs(platform_note: str = "amd64") -> list[Entry]:
    """The base file system (see the module's doc); `/etc/platform` holds
    `platform_note` so that images of two platforms differ."""
    for p in (BUSYBOX, BASH_STATIC):
        if not p.is_file():
            raise RuntimeError(f"{p} is missing: run scripts/host-packages.sh (busybox-static, bash-static)")
    entries = [directory(d) for d in ("bin", "sbin", "etc", "usr", "usr/bin", "usr/sbin", "usr/local",
                                      "usr/local/bin", "root", "dev", "proc", "sys", "run", "var",
                                      "home")]
    entries += [directory("tmp", 0o1777), directory("var/tmp", 0o1777),
                directory("workspace", 0o755, uid=1000, gid=1000)]
    entries.append(file("bin/busybox", BUSYBOX.read_bytes(), 0o755))
    entries.append(file("bin/bash", BASH_STATIC.read_bytes(), 0o755))
    entries.append(symlink("bin/sh", "bash"))
    entries += [symlink(f"bin/{a}", "busybox") for a in applets()]
    # Scripts name /usr/bin/env.
    entries.append(symlink("usr/bin/env", "/bin/busybox"))
    entries += [file("etc/passwd", PASSWD), file("etc/group", GROUP),
                file("etc/hostname", "image\n"), file("etc/platform", platform_note + "\n"),
                file("etc/os-release", 'NAME="runtime test image"\nID=rttest\n')]
    return entries


# --------------------------------------------------------------------------
# Registries


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Pushed:
    """What a push made: the reference parts, the top digest (manifest or
    index), and the blobs by role, for tests to check or corrupt."""
    registry: str
    repo: str
    tag: str
    digest: str
    media_type: str
    manifests: dict[str, str] = field(default_factory=dict)  # platform -> manifest digest
    config: Optional[str] = None
    layers: list[str] = field(default_factory=list)

    @property
    def ref(self) -> str:
        return f"{self.registry}/{self.repo}:{self.tag}"

    @property
    def pinned(self) -> str:
        return f"{self.registry}/{self.repo}@{self.digest}"


class Registry:
    """One running `docker-registry`: `name` is the host it plays, `url`
    its loopback address (the certificate names 127.0.0.1 too)."""

    def __init__(self, root: Path, name: str, cert: Path, key: Path, ca_pem: Path,
                 auth: Optional[tuple[str, str]] = None) -> None:
        self.root, self.name, self.auth, self.ca_pem = root, name, auth, ca_pem
        root.mkdir(parents=True, exist_ok=True)
        self.storage = root / "storage"
        self.port = _free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        config: dict[str, Any] = {
            "version": 0.1,
            "log": {"level": "warn", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(self.storage)}, "delete": {"enabled": True}},
            "http": {"addr": f"127.0.0.1:{self.port}", "tls": {"certificate": str(cert), "key": str(key)}},
        }
        if auth is not None:
            htpasswd = root / "htpasswd"
            subprocess.run(["htpasswd", "-Bbc", str(htpasswd), auth[0], auth[1]], check=True,
                           capture_output=True, timeout=60)
            config["auth"] = {"htpasswd": {"realm": name, "path": str(htpasswd)}}
        # JSON is YAML.
        (root / "config.yml").write_text(json.dumps(config))
        self.log = open(root / "registry.log", "wb")
        self.proc = subprocess.Popen(["docker-registry", "serve", str(root / "config.yml")],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self._ctx = ssl.create_default_context(cafile=str(ca_pem))
        deadline = time.monotonic() + 30
        while True:
            try:
                status, _, _ = self.request("GET", "/v2/", auth=None)
                if status in (200, 401):
                    break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{name}: docker-registry did not start:\n"
                                   + (root / "registry.log").read_text(errors="replace")[-2000:])
            time.sleep(0.1)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait(timeout=10)
        self.log.close()

    # -- HTTP ---------------------------------------------------------------

    def request(self, method: str, path: str, body: Optional[bytes] = None,
                headers: Optional[dict[str, str]] = None,
                auth: Any = "default") -> tuple[int, dict[str, str], bytes]:
        """One call to the registry (`path` from `/v2/`, or an absolute URL
        it answered): status, headers (lower-cased), body. `auth`: the
        instance's credentials by default, `None` for none, or a pair."""
        url = path if path.startswith("https://") else self.url + path
        req = urllib.request.Request(url, data=body, method=method, headers=dict(headers or {}))
        creds = self.auth if auth == "default" else auth
        if creds is not None:
            req.add_header("Authorization", "Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode())
        try:
            with urllib.request.urlopen(req, context=self._ctx, timeout=60) as r:
                return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
        except urllib.error.HTTPError as e:
            return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()

    def _ok(self, what: str, status: int, body: bytes, *want: int) -> None:
        if status not in want:
            raise RuntimeError(f"{self.name}: {what}: {status} {body[:500]!r}")

    # -- push ---------------------------------------------------------------

    def push_blob(self, repo: str, data: bytes) -> str:
        """Uploads `data` (monolithic: POST then PUT ?digest=); its digest."""
        digest = sha256(data)
        status, _, _ = self.request("HEAD", f"/v2/{repo}/blobs/{digest}")
        if status == 200:
            return digest
        status, h, body = self.request("POST", f"/v2/{repo}/blobs/uploads/", b"")
        self._ok("start upload", status, body, 202)
        location = h["location"]
        if location.startswith("/"):
            location = self.url + location
        sep = "&" if "?" in location else "?"
        status, _, body = self.request("PUT", f"{location}{sep}digest={digest}", data,
                                       {"content-type": "application/octet-stream"})
        self._ok("put blob", status, body, 201)
        return digest

    def push_manifest(self, repo: str, ref: str, doc: dict[str, Any]) -> str:
        raw = json.dumps(doc, separators=(",", ":")).encode()
        status, _, body = self.request("PUT", f"/v2/{repo}/manifests/{ref}", raw,
                                       {"content-type": doc["mediaType"]})
        self._ok(f"put manifest {repo}:{ref}", status, body, 201)
        return sha256(raw)

    def push_image(self, repo: str, tag: Optional[str], layers: list[tuple[list[Entry], str]],
                   config: Optional[dict[str, Any]] = None, arch: str = "amd64",
                   docker: bool = False) -> Pushed:
        """A single-platform image: `layers` are (entries, compression),
        bottom first; `config` the image config's `config` (Env,
        WorkingDir, User, Cmd, Entrypoint...). `tag` None pushes it by
        digest only (for an index)."""
        descs, diff_ids = [], []
        for entries, how in layers:
            tar = tar_of(entries)
            blob, media = compress(tar, "docker" if docker and how == "gzip" else how)
            descs.append({"mediaType": media, "digest": self.push_blob(repo, blob), "size": len(blob)})
            diff_ids.append(sha256(tar))
        image_config = {
            "created": "2026-01-01T00:00:00Z",
            "architecture": arch,
            "os": "linux",
            "config": config or {},
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
            "history": [{"created": "2026-01-01T00:00:00Z", "created_by": "tests/e2e/registry.py"}
                        for _ in layers],
        }
        raw_config = json.dumps(image_config, sort_keys=True).encode()
        config_digest = self.push_blob(repo, raw_config)
        manifest = {
            "schemaVersion": 2,
            "mediaType": DOCKER_MANIFEST if docker else OCI_MANIFEST,
            "config": {"mediaType": DOCKER_CONFIG if docker else OCI_CONFIG, "digest": config_digest,
                       "size": len(raw_config)},
            "layers": descs,
        }
        raw = json.dumps(manifest, separators=(",", ":")).encode()
        digest = self.push_manifest(repo, tag or sha256(raw), manifest)
        return Pushed(self.name, repo, tag or "", digest, manifest["mediaType"],
                      {arch: digest}, config_digest, [d["digest"] for d in descs])

    def push_index(self, repo: str, tag: str, images: list[Pushed], docker: bool = False) -> Pushed:
        """An index (manifest list) of images already pushed to `repo`."""
        manifests = []
        for img in images:
            status, _, raw = self.request("GET", f"/v2/{repo}/manifests/{img.digest}",
                                          headers={"accept": img.media_type})
            self._ok("get manifest", status, raw, 200)
            (arch,) = img.manifests.keys()
            platform = {"architecture": arch, "os": "linux"}
            if arch == "arm64":
                platform["variant"] = "v8"
            manifests.append({"mediaType": img.media_type, "digest": img.digest, "size": len(raw),
                              "platform": platform})
        index = {"schemaVersion": 2, "mediaType": DOCKER_LIST if docker else OCI_INDEX,
                 "manifests": manifests}
        digest = self.push_manifest(repo, tag, index)
        return Pushed(self.name, repo, tag, digest, index["mediaType"],
                      {next(iter(i.manifests)): i.digest for i in images})

    # -- damage -------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        algo, hexdigest = digest.split(":", 1)
        return self.storage / "docker/registry/v2/blobs" / algo / hexdigest[:2] / hexdigest / "data"

    def corrupt_blob(self, digest: str) -> None:
        """The registry serves other bytes of the same length under
        `digest` (its stored data flipped in place)."""
        p = self.blob_path(digest)
        data = bytearray(p.read_bytes())
        for i in range(0, len(data), max(1, len(data) // 64)):
            data[i] ^= 0xFF
        p.write_bytes(bytes(data))


class Registries:
    """The public and private registries (see the module's doc)."""

    def __init__(self, root: Path, egress: Any = None, extra_names: tuple[str, ...] = ()) -> None:
        for tool in ("docker-registry", "htpasswd"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} is missing: run scripts/host-packages.sh")
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        if egress is not None:
            self.ca_pem, self.ca_key, self.own_ca = egress.ca_pem, egress.ca_key, False
        else:
            self.ca_pem, self.ca_key, self.own_ca = root / "test-ca.pem", root / "ca.key", True
            make_ca(root, self.ca_pem, self.ca_key)
        self.extra_names = list(extra_names)
        cert, key = make_leaf(root, self.ca_pem, self.ca_key, "registry",
                              [PUBLIC, PRIVATE, *self.extra_names], ips=("127.0.0.1",))
        self.public = Registry(root / "public", PUBLIC, cert, key, self.ca_pem)
        try:
            self.private = Registry(root / "private", PRIVATE, cert, key, self.ca_pem, auth=(USER, PASSWORD))
        except Exception:
            self.public.close()
            raise

    @property
    def args(self) -> list[str]:
        """The `runtime serve` flags that reach both through the egress
        proxy (and the extra names, on the public one)."""
        out = ["--egress-test-map", f"{PUBLIC}=127.0.0.1:{self.public.port}",
               "--egress-test-map", f"{PRIVATE}=127.0.0.1:{self.private.port}"]
        for n in self.extra_names:
            out += ["--egress-test-map", f"{n}=127.0.0.1:{self.public.port}"]
        if self.own_ca:
            out += ["--egress-test-root", str(self.ca_pem)]
        return out

    def close(self) -> None:
        self.private.close()
        self.public.close()

    def __enter__(self) -> "Registries":
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------
# Ready-made images

BASE_CONFIG = {
    "Env": [PATH_ENV, "GREETING=hello from the registry", "LANG=C.UTF-8"],
    "WorkingDir": "/srv/app",
    "User": "1000:1000",
    "Entrypoint": ["/bin/sh", "-c"],
    "Cmd": ["echo started > /tmp/started; sleep 3600"],
    "Labels": {"org.example.test": "registry-fixture"},
}
APP_FILE = ("srv/app/hello.sh", "#!/bin/sh\necho hello from the image\n")


def base_layers(how: str = "gzip", note: str = "amd64") -> list[tuple[list[Entry], str]]:
    """The root file system, then an app layer (`/srv/app/hello.sh`)."""
    app = [directory("srv"), directory("srv/app", uid=1000, gid=1000),
           file(APP_FILE[0], APP_FILE[1], 0o755)]
    return [(rootfs(note), how), (app, how)]


def publish(reg: Registry, repo: str, tag: str, docker: bool = False) -> Pushed:
    """The test image (gzip layers, `BASE_CONFIG`) as `repo:tag`, e.g.
    `library/python:3.11-slim-bookworm` on a Docker Hub mirror."""
    return reg.push_image(repo, tag, base_layers(), BASE_CONFIG, docker=docker)


def publish_multiplatform(reg: Registry, repo: str = "test/multi", tag: str = "latest") -> Pushed:
    """An index of an amd64 and an arm64 image; `/etc/platform` says which
    (the arm64 one holds the same x86-64 binaries: it is never run)."""
    amd = reg.push_image(repo, None, base_layers(note="amd64"), BASE_CONFIG, arch="amd64")
    arm = reg.push_image(repo, None, base_layers(note="arm64"),
                         {**BASE_CONFIG, "Env": [*BASE_CONFIG["Env"], "IMAGE_ARCH=arm64"]}, arch="arm64")
    return reg.push_index(repo, tag, [amd, arm])


def publish_zstd(reg: Registry, repo: str = "test/zstd", tag: str = "latest") -> Pushed:
    """The test image with zstd-compressed layers."""
    return reg.push_image(repo, tag, base_layers("zstd"), BASE_CONFIG)


# What `publish_whiteouts` leaves: present and absent paths.
WHITEOUT_PRESENT = {"/data/keep": "kept\n", "/data/dir/new": "new\n", "/data/later": "later\n"}
WHITEOUT_ABSENT = ["/data/gone", "/data/dir/old", "/data/dir/sub/deep", "/data/olddir"]


def publish_whiteouts(reg: Registry, repo: str = "test/whiteouts", tag: str = "latest") -> Pushed:
    """Three layers: the root file system; files under /data; then a
    whiteout of `/data/gone` and of the directory `/data/olddir`, an opaque
    `/data/dir` (its earlier files hidden) with a new file, and a new file."""
    second = [directory("data"), file("data/keep", "kept\n"), file("data/gone", "gone\n"),
              directory("data/olddir"), file("data/olddir/x", "x\n"),
              directory("data/dir"), file("data/dir/old", "old\n"),
              directory("data/dir/sub"), file("data/dir/sub/deep", "deep\n")]
    third = [directory("data"), whiteout("data/gone"), whiteout("data/olddir"),
             directory("data/dir"), opaque("data/dir"), file("data/dir/new", "new\n"),
             file("data/later", "later\n")]
    return reg.push_image(repo, tag, [(rootfs(), "gzip"), (second, "gzip"), (third, "gzip")],
                          BASE_CONFIG)


def publish_private(regs: Registries, repo: str = "team/private", tag: str = "latest") -> Pushed:
    """The test image on the private registry (needs `USER`/`PASSWORD`)."""
    return publish(regs.private, repo, tag)
