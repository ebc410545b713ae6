"""The registry fixture itself (tests/e2e/registry.py), with plain HTTP
calls: what it pushes is served back byte for byte,
the index has both platforms, the private instance refuses anonymous pulls,
a corrupted blob no longer matches its digest, and (with a server of its
own) a guest reaches both by name through the egress proxy."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path

import pytest
import zstandard

import registry as R
from conftest import Server


@pytest.fixture(scope="module")
def regs(tmp_path_factory):
    r = R.Registries(Path(tmp_path_factory.mktemp("registries")), extra_names=("mirror.example.com",))
    yield r
    r.close()


def get_json(reg: R.Registry, repo: str, ref: str, accept: str, auth="default") -> tuple[int, dict, bytes]:
    status, headers, body = reg.request("GET", f"/v2/{repo}/manifests/{ref}", headers={"accept": accept},
                                        auth=auth)
    return status, headers, body


def layer_members(reg: R.Registry, repo: str, desc: dict) -> dict[str, tarfile.TarInfo]:
    status, _, blob = reg.request("GET", f"/v2/{repo}/blobs/{desc['digest']}")
    assert status == 200
    assert "sha256:" + hashlib.sha256(blob).hexdigest() == desc["digest"]
    if desc["mediaType"].endswith("+zstd"):
        raw = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(blob)).read()
    else:
        raw = gzip.decompress(blob)
    with tarfile.open(fileobj=io.BytesIO(raw)) as t:
        return {m.name: m for m in t.getmembers()}


def test_a_pushed_image_comes_back_with_its_config_and_layers(regs):
    pushed = R.publish(regs.public, "library/python", "3.11-slim-bookworm")
    assert pushed.ref == "registry.example.com/library/python:3.11-slim-bookworm"
    status, headers, body = get_json(regs.public, "library/python", "3.11-slim-bookworm", R.OCI_MANIFEST)
    assert status == 200, body
    assert headers["docker-content-digest"] == pushed.digest
    assert "sha256:" + hashlib.sha256(body).hexdigest() == pushed.digest
    manifest = json.loads(body)
    assert manifest["mediaType"] == R.OCI_MANIFEST
    assert [l["mediaType"] for l in manifest["layers"]] == [R.OCI_LAYER_GZIP] * 2
    status, _, raw_config = regs.public.request("GET", f"/v2/library/python/blobs/{manifest['config']['digest']}")
    config = json.loads(raw_config)
    assert config["config"]["WorkingDir"] == "/srv/app"
    assert config["config"]["User"] == "1000:1000"
    assert config["config"]["Entrypoint"] == ["/bin/sh", "-c"]
    assert "GREETING=hello from the registry" in config["config"]["Env"]
    base = layer_members(regs.public, "library/python", manifest["layers"][0])
    assert base["bin/busybox"].isfile() and base["bin/busybox"].mode & 0o111
    assert base["bin/bash"].size > 1_000_000
    assert base["bin/sh"].issym() and base["bin/sh"].linkname == "bash"
    assert base["bin/ls"].linkname == "busybox" and base["bin/cat"].linkname == "busybox"
    assert base["tmp"].mode & 0o1777 == 0o1777
    assert {"etc/passwd", "etc/group"} <= set(base)
    # The diff ids are the uncompressed tars' digests.
    status, _, blob = regs.public.request("GET", f"/v2/library/python/blobs/{manifest['layers'][0]['digest']}")
    assert config["rootfs"]["diff_ids"][0] == "sha256:" + hashlib.sha256(gzip.decompress(blob)).hexdigest()
    # A Docker-typed push of the same content is served under Docker's types.
    docker = R.publish(regs.public, "library/python", "docker-types", docker=True)
    status, headers, body = get_json(regs.public, "library/python", "docker-types", R.DOCKER_MANIFEST)
    assert json.loads(body)["layers"][0]["mediaType"] == R.DOCKER_LAYER
    assert headers["docker-content-digest"] == docker.digest


def test_the_index_has_both_platforms_and_the_arm64_one_differs(regs):
    pushed = R.publish_multiplatform(regs.public)
    status, headers, body = get_json(regs.public, "test/multi", "latest", R.OCI_INDEX)
    assert status == 200, body
    index = json.loads(body)
    assert index["mediaType"] == R.OCI_INDEX
    platforms = {m["platform"]["architecture"]: m["digest"] for m in index["manifests"]}
    assert platforms == pushed.manifests and set(platforms) == {"amd64", "arm64"}
    notes = {}
    for arch, digest in platforms.items():
        status, _, raw = get_json(regs.public, "test/multi", digest, R.OCI_MANIFEST)
        manifest = json.loads(raw)
        members = layer_members(regs.public, "test/multi", manifest["layers"][0])
        status, _, blob = regs.public.request("GET", f"/v2/test/multi/blobs/{manifest['layers'][0]['digest']}")
        with tarfile.open(fileobj=io.BytesIO(gzip.decompress(blob))) as t:
            notes[arch] = t.extractfile(members["etc/platform"]).read()
        status, _, raw_config = regs.public.request("GET", f"/v2/test/multi/blobs/{manifest['config']['digest']}")
        assert json.loads(raw_config)["architecture"] == arch
    assert notes == {"amd64": b"amd64\n", "arm64": b"arm64\n"}


def test_zstd_and_whiteout_layers(regs):
    z = R.publish_zstd(regs.public)
    _, _, body = get_json(regs.public, "test/zstd", "latest", R.OCI_MANIFEST)
    layers = json.loads(body)["layers"]
    assert [l["mediaType"] for l in layers] == [R.OCI_LAYER_ZSTD] * 2
    assert "bin/bash" in layer_members(regs.public, "test/zstd", layers[0])
    assert z.layers == [l["digest"] for l in layers]

    R.publish_whiteouts(regs.public)
    _, _, body = get_json(regs.public, "test/whiteouts", "latest", R.OCI_MANIFEST)
    layers = json.loads(body)["layers"]
    assert len(layers) == 3
    top = layer_members(regs.public, "test/whiteouts", layers[2])
    assert {"data/.wh.gone", "data/.wh.olddir", "data/dir/.wh..wh..opq", "data/dir/new"} <= set(top)
    middle = layer_members(regs.public, "test/whiteouts", layers[1])
    assert {"data/gone", "data/dir/old", "data/dir/sub/deep", "data/olddir/x"} <= set(middle)


def test_the_private_registry_needs_its_credentials(regs):
    pushed = R.publish_private(regs)
    status, headers, _ = regs.private.request("GET", "/v2/", auth=None)
    assert status == 401
    assert headers["www-authenticate"].lower().startswith("basic")
    status, _, _ = get_json(regs.private, pushed.repo, pushed.tag, R.OCI_MANIFEST, auth=None)
    assert status == 401
    status, _, _ = get_json(regs.private, pushed.repo, pushed.tag, R.OCI_MANIFEST, auth=(R.USER, "wrong"))
    assert status == 401
    status, headers, body = get_json(regs.private, pushed.repo, pushed.tag, R.OCI_MANIFEST)
    assert status == 200, body
    assert headers["docker-content-digest"] == pushed.digest
    # The public one has no such repository.
    status, _, _ = get_json(regs.public, pushed.repo, pushed.tag, R.OCI_MANIFEST)
    assert status == 404


def test_a_corrupted_blob_is_served_with_other_bytes(regs):
    pushed = R.publish(regs.public, "test/corrupt", "latest")
    digest = pushed.layers[1]
    _, _, before = regs.public.request("GET", f"/v2/test/corrupt/blobs/{digest}")
    regs.public.corrupt_blob(digest)
    status, _, after = regs.public.request("GET", f"/v2/test/corrupt/blobs/{digest}")
    assert status == 200
    assert len(after) == len(before) and after != before
    assert "sha256:" + hashlib.sha256(after).hexdigest() != digest


def test_args_map_the_names_to_the_instances(regs):
    args = regs.args
    pairs = dict(args[i + 1].split("=", 1) for i in range(0, len(args), 2) if args[i] == "--egress-test-map")
    assert pairs == {R.PUBLIC: f"127.0.0.1:{regs.public.port}", R.PRIVATE: f"127.0.0.1:{regs.private.port}",
                     "mirror.example.com": f"127.0.0.1:{regs.public.port}"}
    assert args[-2:] == ["--egress-test-root", str(regs.ca_pem)]


@pytest.fixture(scope="module")
def proxied():
    """A server of its own whose egress proxy reaches the registries by
    their names, the CA shared with its EgressServers."""
    root = Path(tempfile.mkdtemp(prefix="runtime-e2e-registry-"))
    os.chmod(root, 0o711)
    srv = Server(root)
    regs = R.Registries(root / "registries", egress=srv.egress)
    srv.extra_args += regs.args
    try:
        srv.start()
        yield srv, regs
    finally:
        srv.delete_all_sandboxes()
        srv.stop()
        srv.egress.close()
        regs.close()
        srv.kill_leftover_qemu()
        shutil.rmtree(root, ignore_errors=True)


def test_a_guest_reaches_both_by_name_through_the_egress_proxy(proxied):
    """The names resolve to the instances through the proxy, with the
    certificate of the one test CA, as real registries would be reached."""
    from withruntime import Runtime
    srv, regs = proxied
    assert "--egress-test-root" not in regs.args  # the EgressServers' CA serves both
    pushed = R.publish_private(regs, "team/app", "v1")
    with Runtime(api_key=srv.admin_key(), base_url=srv.url) as rt:
        sbx = rt.sandboxes.create()
        try:
            sbx.files.write("/tmp/ca.pem", regs.ca_pem.read_bytes())
            def code(url: str, *extra: str) -> str:
                r = sbx.exec(f"curl -s --max-time 30 --cacert /tmp/ca.pem -o /dev/null -w '%{{http_code}}' "
                             f"{' '.join(extra)} '{url}'", timeout_ms=60_000)
                return r.stdout.strip()
            assert code(f"https://{R.PUBLIC}/v2/") == "200"
            assert code(f"https://{R.PRIVATE}/v2/{pushed.repo}/manifests/{pushed.tag}") == "401"
            assert code(f"https://{R.PRIVATE}/v2/{pushed.repo}/manifests/{pushed.tag}",
                        f"-u {R.USER}:{R.PASSWORD}", f"-H 'accept: {R.OCI_MANIFEST}'") == "200"
        finally:
            sbx.delete()
