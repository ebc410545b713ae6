"""Build contexts through the official client (docs/images.md "Build
contexts"): `runtime.images.build(dockerfile=..., context_dir=...)` packs a
folder, uploads the chunks the server lacks and builds; COPY and ADD read
the context (`.dockerignore`, directories, `--chown`/`--chmod`, a local
tar.gz unpacked), heredocs, ARG before FROM, stages and `target`; a rebuild
with one file changed reruns only the steps from its COPY; refusals name
the Dockerfile's line; the chunk routes are per key and checked."""
from __future__ import annotations

import hashlib
import io
import os
import tarfile
import uuid
from pathlib import Path

import pytest
from withruntime import InvalidRequestError
from withruntime import RuntimeError as ClientError

from conftest import assert_error_body, http
from egress_servers import BIG

DOCKERFILE = """\
# syntax=docker/dockerfile:1
ARG BASE=runtime
FROM ${BASE} AS base
ARG TARGETARCH
RUN echo "arch=$TARGETARCH" > /arch.txt

FROM base AS app
WORKDIR /srv/app
COPY --chown=runtime:runtime --chmod=0750 tools/run.sh /usr/local/bin/run-app
ADD vendor.tar.gz /opt/vendor/
COPY <<EOF /etc/app.conf
mode = heredoc
EOF
RUN <<EOF
python3 -c "print(open('/etc/app.conf').read().split()[-1])" > /srv/app/built.txt
EOF
ADD --checksum=sha256:BIG_SHA http://pypi.example.net/big /opt/dl/
COPY . /ctx/
COPY app/ ./
RUN cat config.txt > config.copy

FROM app AS extra
RUN echo should-not-run > /extra.txt
"""
# `ADD <url>` fetches this 8 MiB body from the local server that plays
# pypi.example.net, through the build machine's egress proxy.
DOCKERFILE = DOCKERFILE.replace("BIG_SHA", hashlib.sha256(BIG).hexdigest())


def _folder(root: Path, config: str) -> Path:
    (root / "app" / "sub").mkdir(parents=True, exist_ok=True)
    (root / "tools").mkdir(exist_ok=True)
    (root / "secret").mkdir(exist_ok=True)
    (root / "Dockerfile").write_text(DOCKERFILE)
    (root / ".dockerignore").write_text("**/*.log\nsecret/\n")
    (root / "app" / "app.py").write_text("print('hello from the context')\n")
    (root / "app" / "config.txt").write_text(config)
    (root / "app" / "sub" / "x.txt").write_text("nested\n")
    (root / "app" / "notes.log").write_text("ignored\n")
    (root / "debug.log").write_text("ignored\n")
    (root / "secret" / "key.txt").write_text("never leaves the laptop\n")
    (root / "tools" / "run.sh").write_text("#!/bin/sh\necho run\n")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        data = b"from the tarball\n"
        info = tarfile.TarInfo("pkg/hello.txt")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    (root / "vendor.tar.gz").write_bytes(buf.getvalue())
    return root


def _states(image: dict) -> list[str]:
    return [s["state"] for s in image["steps"]]


def test_a_context_build_its_copies_stages_and_a_rebuild(runtime, tmp_path):
    folder = _folder(tmp_path / "ctx", "version=1\n")
    image = runtime.images.build(name="e2e-ctx", dockerfile=DOCKERFILE, context_dir=str(folder),
                                 target="app", poll_seconds=0.5)
    assert image["state"] == "ready", image.get("error")
    assert "cached" not in _states(image), image["steps"]
    # The stage `extra` was not built; `base` and `app` were, as one chain.
    assert not any("should-not-run" in s["instruction"] for s in image["steps"])
    assert len(image["steps"]) == 10, image["steps"]

    with runtime.sandboxes.create(image="e2e-ctx") as sbx:
        def sh(cmd: str) -> str:
            r = sbx.exec(cmd)
            assert r.exit_code == 0, (cmd, r.stdout, r.stderr)
            return r.stdout
        assert sh("cat /arch.txt") == "arch=amd64\n"
        # COPY app/ ./ copied the directory's contents into the workdir.
        assert sh("cat /srv/app/app.py /srv/app/sub/x.txt") == "print('hello from the context')\nnested\n"
        assert sh("cat /srv/app/config.copy") == "version=1\n"
        # Docker's owner without --chown is root; with it, the file is runtime's.
        assert sh("stat -c '%U' /srv/app/app.py") == "root\n"
        assert sh("stat -c '%U %a' /usr/local/bin/run-app") == "runtime 750\n"
        assert sh("run-app") == "run\n"
        # ADD unpacked the local tar.gz; the heredocs made a file and ran.
        assert sh("cat /opt/vendor/pkg/hello.txt") == "from the tarball\n"
        assert sh("cat /etc/app.conf /srv/app/built.txt") == "mode = heredoc\nheredoc\n"
        # ADD of a URL downloaded it (root's, 0600, as Docker leaves it).
        assert sh("stat -c '%U %a' /opt/dl/big") == "root 600\n"
        assert sh("sudo sha256sum /opt/dl/big").split()[0] == hashlib.sha256(BIG).hexdigest()
        # What .dockerignore leaves out never reached the image.
        listing = sh("cd /ctx && find . -type f | sort").split()
        assert "./app/app.py" in listing and "./Dockerfile" in listing, listing
        assert not any(p.endswith(".log") or p.startswith("./secret") for p in listing), listing
        assert sbx.exec("test -e /extra.txt").exit_code == 1
        assert sbx.exec("ls /.runtime-copy 2>/dev/null | wc -l").stdout.strip() == "0"

    # One file changed: the steps before its COPY come from the cache.
    (folder / "app" / "config.txt").write_text("version=2\n")
    again = runtime.images.build(name="e2e-ctx", dockerfile=DOCKERFILE, context_dir=str(folder),
                                 target="app", poll_seconds=0.5)
    states = _states(again)
    assert states == ["cached"] * 7 + ["done"] * 3, again["steps"]
    with runtime.sandboxes.create(image="e2e-ctx") as sbx:
        assert sbx.exec("cat /srv/app/config.copy").stdout == "version=2\n"


def test_a_download_that_is_not_its_checksum_fails_the_build(runtime, tmp_path):
    (tmp_path / "keep.txt").write_text("k\n")
    wrong = "0" * 64
    with pytest.raises(ClientError) as caught:
        runtime.images.build(dockerfile=f"FROM runtime\nADD --checksum=sha256:{wrong} http://pypi.example.net/big /big\n",
                             context_dir=str(tmp_path), poll_seconds=0.5)
    assert "step 1 (ADD http://pypi.example.net/big /big (sha256 000000000000)) exited with code 1" in str(caught.value)


def test_refusals_name_the_line_and_what_to_do(runtime, tmp_path):
    folder = tmp_path / "small"
    folder.mkdir()
    (folder / "a.txt").write_text("a\n")
    for text, wanted in [
        ("FROM runtime\nRUN --mount=type=secret,id=tok cat /run/secrets/tok\n",
         "Dockerfile line 2 (RUN): RUN --mount=type=secret is not supported"),
        ("FROM runtime\n\nONBUILD RUN true\n", "Dockerfile line 3 (ONBUILD): ONBUILD is not supported"),
        ("FROM runtime\nADD https://example.com/r.git /src\n", "ADD of a git repository is not supported"),
        ("FROM runtime\nCOPY --exclude=*.md . /x\n", "COPY --exclude is not supported"),
        ("FROM runtime\nCOPY nope.txt /x\n", "nope.txt: no such file or directory in the build context"),
    ]:
        with pytest.raises(InvalidRequestError) as caught:
            runtime.images.create(dockerfile=text, context_dir=str(folder))
        assert wanted in _issues(caught.value.details), (text, caught.value.details)
    with pytest.raises(InvalidRequestError) as caught:
        runtime.images.create(dockerfile="FROM runtime AS a\n", context_dir=str(folder), target="b")
    assert caught.value.details["issues"] == [{"field": "target", "message": "no stage is named b"}]


def _issues(details: dict) -> str:
    return " ".join(f"{i['field']}: {i['message']}" for i in details["issues"])


def _chunk(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_chunks_are_per_key_checked_and_a_build_needs_them_all(server, runtime):
    other = server.create_key()
    data = os.urandom(1000)
    sha = _chunk(data)
    # Missing for both; uploaded by one, still missing for the other.
    asked = http(server, "POST", "/v1/images/context/missing", {"digests": [sha, sha]})
    assert asked.status == 200 and asked.json() == {"missing": [sha]}, asked
    put = http(server, "PUT", f"/v1/images/context/{sha}", raw=data,
               headers={"Content-Type": "application/octet-stream"})
    assert put.status == 200 and put.json()["size"] == 1000, put
    assert http(server, "POST", "/v1/images/context/missing", {"digests": [sha]}).json() == {"missing": []}
    assert http(server, "POST", "/v1/images/context/missing", {"digests": [sha]},
                key=other).json() == {"missing": [sha]}
    # A body that is not its digest is refused, naming both.
    wrong = _chunk(b"something else")
    bad = http(server, "PUT", f"/v1/images/context/{wrong}", raw=data,
               headers={"Content-Type": "application/octet-stream"}, key=other)
    error = _issues(assert_error_body(bad, 400, "invalid_request")["details"])
    assert wrong in error and sha in error, error
    assert http(server, "POST", "/v1/images/context/missing", {"digests": [wrong]},
                key=other).json() == {"missing": [wrong]}
    # Over a chunk's size, and a name that is no digest.
    big = os.urandom((1 << 20) + 1)
    assert http(server, "PUT", f"/v1/images/context/{_chunk(big)}", raw=big,
                headers={"Content-Type": "application/octet-stream"}).status == 413
    assert_error_body(http(server, "POST", "/v1/images/context/missing", {"digests": ["abc"]}), 400)

    # A build naming a chunk this key never uploaded lists it.
    never = _chunk(uuid.uuid4().bytes)
    body = {"dockerfile": "FROM runtime\nCOPY a /a\n",
            "context": {"archive": {"sha256": never, "size": 10, "chunks": [never]},
                        "files": [{"path": "a", "sha256": sha, "size": 1, "mode": 420}]}}
    answer = http(server, "POST", "/v1/images", body)
    error = _issues(assert_error_body(answer, 400, "invalid_request")["details"])
    assert error.startswith("context: chunks missing") and never in error, error
    # Another key's chunk is as good as missing.
    body["context"]["archive"] = {"sha256": sha, "size": 1000, "chunks": [sha]}
    error = _issues(assert_error_body(http(server, "POST", "/v1/images", body, key=other), 400)["details"])
    assert error.startswith("context: chunks missing") and sha in error, error
    # The owner's chunk is there, but it is no gzipped tar of what files lists.
    error = _issues(assert_error_body(http(server, "POST", "/v1/images", body), 400)["details"])
    assert "not a gzipped tar" in error, error
    # A whole archive whose hash is not archive.sha256.
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        info = tarfile.TarInfo("../escape")
        info.size = 1
        t.addfile(info, io.BytesIO(b"x"))
    evil = buf.getvalue()
    assert http(server, "PUT", f"/v1/images/context/{_chunk(evil)}", raw=evil,
                headers={"Content-Type": "application/octet-stream"}).status == 200
    body["context"]["archive"] = {"sha256": sha, "size": len(evil), "chunks": [_chunk(evil)]}
    error = _issues(assert_error_body(http(server, "POST", "/v1/images", body), 400)["details"])
    assert "not archive.size and archive.sha256" in error, error
    # The right hash, but an entry that climbs out.
    body["context"]["archive"]["sha256"] = _chunk(evil)
    error = _issues(assert_error_body(http(server, "POST", "/v1/images", body), 400)["details"])
    assert "archive entry ../escape" in error, error
