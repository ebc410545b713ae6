"""Images from a container registry through the official client: a real
registry (Debian's docker-registry, pull_registry.py) on loopback plays
`registry.example.com`, reached through the build's egress. `image=` builds
boot with the image's env, workdir, user and start command; `FROM <ref>`
goes on with a RUN; an index gives its amd64 image; gzip and zstd layers,
whiteouts and opaque directories apply; a second build reuses the blob
cache and the unpacked layer; unknown references and corrupt blobs fail
clearly and leave nothing half-made. The drop-ins that build an image for
every create work against it as Docker Hub's mirror: Prime's `docker_image`,
Modal's `Image.debian_slim()` and Daytona's `CreateSandboxFromImageParams`
(a reference, and `Image.debian_slim()` with steps on it)."""
from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

from conftest import Server
from pull_registry import NAME, Layer, Registry, alpine_layer, base_layer

REPO = "e2e/app"
APP = f"{NAME}/{REPO}:1"
ALPINE = f"{NAME}/e2e/alpine:3"
DISTROLESS = f"{NAME}/e2e/distroless:1"
CONFIG = {
    "Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "GREETING=hello from the registry"],
    "WorkingDir": "/srv/app",
    "Entrypoint": ["bash", "-c"],
    "Cmd": ["echo started-in-$(pwd) > /tmp/started; exec sleep 600"],
}


@pytest.fixture(scope="module")
def env():
    """A server of this module's own (its egress maps registry.example.com
    to the registry), the registry and the images pushed to it."""
    root = Path(tempfile.mkdtemp(prefix="runtime-e2e-registry-"))
    os.chmod(root, 0o711)
    srv = Server(root)
    reg = Registry(root / "registry", srv.egress.ca_pem, srv.egress.root / "ca.key")
    # The registry is also the Docker Hub mirror.
    srv.extra_args += reg.args + ["--registry-mirror", f"docker.io={NAME}"]
    images = {}
    try:
        base = base_layer().bytes()
        # A zstd layer over it: a whiteout, an opaque directory, a new file.
        top = (Layer().dir("srv").dir("srv/app").file("srv/app/.wh.remove-me", b"")
               .dir("opt").dir("opt/data").file("opt/data/.wh..wh..opq", b"")
               .file("opt/data/new", b"new\n").file("etc/zstd-was-here", b"zstd\n").bytes())
        images["app"] = reg.image(REPO, "1", [(base, "gzip"), (top, "zstd")], CONFIG)
        # An index: arm64 first, then amd64, each marking its platform.
        arm = reg.image("e2e/multi", None, [(base, "gzip"), (Layer().file("platform", b"arm64\n").bytes(), "gzip")],
                        {"Env": ["PATH=/bin"]}, arch="arm64")
        amd = reg.image("e2e/multi", None, [(base, "gzip"), (Layer().file("platform", b"amd64\n").bytes(), "gzip")],
                        {"Env": ["PATH=/bin"]})
        reg.index("e2e/multi", "1", [(arm[0], arm[1], "arm64"), (amd[0], amd[1], "amd64")])
        # An image whose one layer the registry serves corrupted.
        bad_layer = Layer().file("bad", b"x" * 4096).bytes()
        images["corrupt"] = reg.image("e2e/corrupt", "1", [(bad_layer, "gzip")], {"Env": ["PATH=/bin"]})
        # An Alpine-like image: busybox's sh, no bash.
        images["alpine"] = reg.image("e2e/alpine", "3", [(alpine_layer().bytes(), "gzip")],
                                     {"Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], "Cmd": ["/bin/sh"]})
        # A distroless-like image: files and users, no shell, no busybox.
        bare = (Layer().dir("etc").dir("app").dir("tmp", 0o1777)
                .file("etc/passwd", b"root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532::/home/nonroot:/sbin/nologin\n")
                .file("etc/group", b"root:x:0:\nnonroot:x:65532:\n")
                .file("app/greeting.txt", b"hello from distroless\n").bytes())
        images["distroless"] = reg.image("e2e/distroless", "1", [(bare, "gzip")],
                                         {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"]})
        srv.start()
    except Exception:
        reg.close()
        srv.egress.close()
        raise
    try:
        yield srv, reg, images
    finally:
        srv.delete_all_sandboxes()
        srv.stop()
        srv.egress.close()
        srv.kill_leftover_qemu()
        reg.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def rt(env):
    from withruntime import Runtime
    srv = env[0]
    with Runtime(api_key=srv.admin_key(), base_url=srv.url) as client:
        yield client


@pytest.fixture(scope="module")
def app_image(rt):
    return rt.images.build(name="py", image=APP, poll_seconds=0.5)


def _failed_build(rt, **fields) -> dict:
    image = rt.images.create(**fields)
    while image["state"] in ("queued", "building"):
        time.sleep(0.5)
        image = rt.images.get(image["id"])
    return image


def test_an_image_boots_with_its_config_and_layers(env, rt, app_image):
    digest = env[2]["app"][0]
    assert app_image["state"] == "ready", app_image["error"]
    assert app_image["source"] == "image"
    assert app_image["pulled"] == f"{APP}@{digest}"
    assert app_image["workdir"] == "/srv/app" and app_image["user"] == "root"
    assert app_image["start"] == {"command": CONFIG["Entrypoint"] + CONFIG["Cmd"]}
    assert "GREETING" in app_image["env"]
    log = app_image["log"]
    assert "layer 1/2" in log and "layer 2/2" in log and "MiB" in log, log
    with rt.sandboxes.create(image="py") as sbx:
        assert sbx.exec("echo $GREETING").stdout == "hello from the registry\n"
        # The start command ran in the image's workdir.
        deadline = time.monotonic() + 60
        out = ""
        while time.monotonic() < deadline and not out:
            out = sbx.exec("cat /tmp/started 2>/dev/null || true").stdout
            time.sleep(0.5)
        assert out == "started-in-/srv/app\n"
        # The zstd layer's whiteout and opaque directory, and its new file.
        assert sbx.exec("ls /srv/app").stdout.split() == ["keep-me"]
        assert sbx.exec("ls /opt/data").stdout.split() == ["new"]
        assert sbx.exec("cat /etc/zstd-was-here").stdout == "zstd\n"
        # The sandbox user was added, owning /workspace; files work.
        assert sbx.exec("id -u; stat -c %u /workspace").stdout.split() == ["1000", "1000"]
        sbx.files.write("/workspace/note.txt", "written through the API\n")
        assert sbx.exec("cat /workspace/note.txt").stdout == "written through the API\n"
        # Pause and wake, then a fork, on the pulled root file system.
        sbx.pause()
        sbx.wake()
        assert sbx.exec("cat /workspace/note.txt; cat /tmp/started").stdout == \
            "written through the API\nstarted-in-/srv/app\n"
        copy = sbx.fork()
        try:
            assert copy.id != sbx.id
            assert copy.exec("cat /workspace/note.txt /etc/zstd-was-here").stdout == \
                "written through the API\nzstd\n"
        finally:
            copy.delete()


def test_from_a_registry_image_with_a_run_step_and_the_cache(env, rt, app_image):
    srv = env[0]
    image = rt.images.build(name="py-run", dockerfile=f"FROM {APP}\nRUN echo built-$GREETING > /srv/app/built\n",
                            poll_seconds=0.5)
    assert image["state"] == "ready", image["error"]
    # The second pull of the same image: blobs and the unpacked layer kept.
    assert "(cached)" in image["log"] and "pulled" not in image["log"].replace("pulled image", ""), image["log"]
    assert image["start"] == app_image["start"]
    with rt.sandboxes.create(image="py-run") as sbx:
        assert sbx.exec("cat /srv/app/built").stdout == "built-hello from the registry\n"
    blobs = list((srv.data_dir / "images/blobs/sha256").iterdir())
    assert blobs and not [b for b in blobs if "partial" in b.name]
    # A recipe's base: its commands run as the image's user (root), in its
    # workdir, with its env.
    image = rt.images.build(name="py-recipe", recipe={"base": APP, "commands": ["echo $GREETING-$(id -u) > r.txt"]},
                            poll_seconds=0.5)
    assert image["state"] == "ready", image["error"]
    with rt.sandboxes.create(image="py-recipe") as sbx:
        assert sbx.exec("cat /srv/app/r.txt").stdout == "hello from the registry-0\n"


def test_an_index_gives_its_amd64_image(rt):
    image = rt.images.build(name="multi", image=f"{NAME}/e2e/multi:1", poll_seconds=0.5)
    assert image["state"] == "ready", image["error"]
    assert "linux/amd64" in image["log"]
    with rt.sandboxes.create(image="multi") as sbx:
        assert sbx.exec("cat /platform").stdout == "amd64\n"


def test_docker_hub_names_go_to_the_mirror_first(rt):
    # `e2e/multi:1` is Docker Hub's `docker.io/e2e/multi:1`: the mirror has it.
    image = rt.images.build(image="e2e/multi:1", poll_seconds=0.5)
    assert image["state"] == "ready", image["error"]
    assert image["pulled"].startswith("docker.io/e2e/multi:1@sha256:"), image["pulled"]
    assert f"pulled from mirror {NAME}" in image["log"], image["log"]
    # One the mirror lacks goes on to Docker Hub itself (out of reach here,
    # or refusing an unknown repository: either way a failure naming it).
    image = _failed_build(rt, image="e2e/not-on-the-mirror:1")
    assert image["state"] == "failed" and "docker.io/e2e/not-on-the-mirror:1" in image["error"], image["error"]
    assert f"mirror {NAME}:" in image["log"] and "pulling from docker.io" in image["log"], image["log"]


def test_an_unknown_tag_fails_naming_it(env, rt):
    image = _failed_build(rt, image=f"{NAME}/e2e/app:nope")
    assert image["state"] == "failed"
    assert f"{NAME}/e2e/app:nope" in image["error"] and "MANIFEST_UNKNOWN" in image["error"], image["error"]
    image = _failed_build(rt, image=f"{NAME}/e2e/nothing-here:1")
    assert image["state"] == "failed" and "not found" in image["error"], image["error"]


def test_a_corrupt_blob_is_refused_by_digest(env, rt):
    srv, reg, images = env
    import json
    import urllib.request  # noqa: F401
    # The layer of e2e/corrupt, spoiled in the registry's storage.
    status, _, body = reg._req("GET", f"/v2/e2e/corrupt/manifests/1",
                               headers={"Accept": "application/vnd.oci.image.manifest.v1+json"})
    layer = json.loads(body)["layers"][0]["digest"]
    reg.corrupt(layer)
    image = _failed_build(rt, name="bad", image=f"{NAME}/e2e/corrupt:1")
    assert image["state"] == "failed"
    assert layer in image["error"] and "corrupt" in image["error"], image["error"]
    hexd = layer.split(":")[1]
    assert not (srv.data_dir / "images/blobs/sha256" / hexd).exists()
    assert not [p for p in (srv.data_dir / "images/blobs/sha256").iterdir() if "partial" in p.name]
    layers = srv.data_dir / "images/layers"
    assert not [p for p in layers.iterdir() if p.name.endswith(".partial")]
    assert not (srv.data_dir / "images/unpack").exists() or not list((srv.data_dir / "images/unpack").iterdir())


def test_bad_references_are_refused_naming_the_field(rt):
    from withruntime import InvalidRequestError
    with pytest.raises(InvalidRequestError) as e:
        rt.images.create(image="Not A Ref")
    issues = e.value.details["issues"]
    assert [i["field"] for i in issues] == ["image"], issues
    assert "Not A Ref" in issues[0]["message"] and "repository" in issues[0]["message"], issues
    with pytest.raises(InvalidRequestError) as e:
        rt.images.create(dockerfile="FROM registry.example.com/x:-bad\n")
    issues = e.value.details["issues"]
    assert [i["field"] for i in issues] == ["dockerfile"] and "tag" in issues[0]["message"], issues


def test_a_private_image_pulls_with_the_keys_credentials():
    """The private registry of tests/e2e/registry.py (htpasswd, Basic):
    refused without credentials, pulled with the key's images.registries."""
    from withruntime import Runtime
    from registry import PRIVATE, PASSWORD, USER, Registries, publish_private
    root = Path(tempfile.mkdtemp(prefix="runtime-e2e-private-"))
    os.chmod(root, 0o711)
    srv = Server(root)
    regs = Registries(root / "registries", egress=srv.egress)
    try:
        srv.extra_args += regs.args
        publish_private(regs)
        srv.start()
        with Runtime(api_key=srv.admin_key(), base_url=srv.url) as rt:
            ref = f"{PRIVATE}/team/private:latest"
            image = _failed_build(rt, image=ref)
            assert image["state"] == "failed" and "refused access" in image["error"], image["error"]
            rt.images.registries.set(PRIVATE, username=USER, password=PASSWORD)
            image = rt.images.build(name="private", image=ref, poll_seconds=0.5)
            assert image["state"] == "ready", image["error"]
            assert PASSWORD not in image["log"]
            with rt.sandboxes.create(image="private") as sbx:
                assert sbx.exec("echo $GREETING").stdout == "hello from the registry\n"
    finally:
        if srv.proc is not None:
            srv.delete_all_sandboxes()
        srv.stop()
        srv.egress.close()
        srv.kill_leftover_qemu()
        regs.close()
        shutil.rmtree(root, ignore_errors=True)


def _publish_slim(reg, tag: str) -> None:
    """A small image under Docker Hub's `python` name on the mirror, as the
    drop-ins ask for it (bash and busybox; no Python: the flows below need
    none)."""
    reg.image("library/python", tag, [(base_layer().bytes(), "gzip")],
              {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "FROM_IMAGE=" + tag], "Cmd": ["bash"]})


def test_the_prime_drop_in_creates_from_a_docker_image(env, rt):
    from withruntime.prime import CreateSandboxRequest, SandboxClient
    _, reg, _ = env
    _publish_slim(reg, "3.11-slim")
    client = SandboxClient(rt)
    created = client.create(CreateSandboxRequest(name="prime-e2e", docker_image="python:3.11-slim",
                                                 disk_size_gb=3, environment_vars={"WHO": "prime"}))
    try:
        client.wait_for_creation(created.id)
        out = client.execute_command(created.id, "echo $FROM_IMAGE $WHO; cat /srv/app/keep-me")
        assert out.exit_code == 0, out
        assert out.stdout == "3.11-slim prime\nkept\n", out
        # Built as the Dockerfile the drop-in writes, on the pulled image.
        image = rt.images.get(rt.sandboxes.get(created.id).info["image"])
        assert "library/python" in image["pulled"] and "@sha256:" in image["pulled"], image
        assert image["source"] == "dockerfile", image
    finally:
        client.delete(created.id)


def test_the_modal_drop_in_builds_debian_slim_for_a_create(env, rt):
    from withruntime import modal
    _, reg, _ = env
    _publish_slim(reg, "3.11-slim-bookworm")
    lines = []
    image = modal.Image.debian_slim(python_version="3.11")
    app = modal.App.lookup("e2e-modal", create_if_missing=True, client=rt)
    sb = modal.Sandbox.create(app=app, image=image, client=rt, env={"WHO": "modal"})
    try:
        process = sb.exec("bash", "-c", "echo $FROM_IMAGE $WHO $(id -u)")
        process.wait()
        assert process.returncode == 0
        assert process.stdout.read() == "3.11-slim-bookworm modal 0\n"
    finally:
        sb.terminate()
    # Its image was built from the Dockerfile Modal writes, on the pulled base.
    pulled = [i["pulled"] for i in rt.images.list().data if i.get("source") == "dockerfile" and i.get("pulled")]
    assert any("library/python" in p for p in pulled), pulled


# The stand-ins of the Daytona test's python image: the test image has no
# Debian or Python, so its apt-get, pip and python record how the build
# called them, in the build machine.
RECORDER = b'#!/bin/bash\necho "${0##*/} $*" >> /var/log/calls\n'


def _publish_daytona_python(reg) -> None:
    """Docker Hub's `python:3.12-slim` and `python:3.12-slim-bookworm` (what
    Daytona's `Image.debian_slim("3.12")` starts from) on the mirror: one
    image under both tags, so it is unpacked once. Over the base layer, the
    recorders above and the busybox applets a COPY step uses."""
    layer = Layer().dir("usr/local").dir("usr/local/bin").dir("var").dir("var/log")
    for tool in ("apt-get", "pip", "python"):
        layer.file(f"usr/local/bin/{tool}", RECORDER, 0o755)
    for applet in ("base64", "chmod", "chown"):
        layer.symlink(f"bin/{applet}", "busybox")
    top = layer.bytes()
    for tag in ("3.12-slim", "3.12-slim-bookworm"):
        reg.image("library/python", tag, [(base_layer().bytes(), "gzip"), (top, "gzip")],
                  {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin", "FROM_IMAGE=python-slim"], "Cmd": ["bash"]})


def test_the_daytona_drop_in_creates_from_registry_images(env, rt, tmp_path):
    from withruntime.daytona import CreateSandboxFromImageParams, Daytona, Image
    _, reg, _ = env
    _publish_daytona_python(reg)
    daytona = Daytona(client=rt)
    # A reference as it is: pulled through the mirror, nothing built on it.
    sandbox = daytona.create(CreateSandboxFromImageParams(image="python:3.12-slim"), timeout=300)
    try:
        r = sandbox.process.exec("echo $FROM_IMAGE; cat /srv/app/keep-me")
        assert (r.exit_code, r.result) == (0, "python-slim\nkept\n"), r
        image = rt.images.get(sandbox.withruntime.info["image"])
        assert image["source"] == "image" and image["name"] == "python-3.12-slim", image
        assert image["pulled"].startswith("docker.io/library/python:3.12-slim@sha256:"), image["pulled"]
    finally:
        daytona.delete(sandbox)
    # debian_slim with Daytona's steps on it: the Dockerfile the client
    # writes runs on the pulled image, as the image's user (root).
    local = tmp_path / "local.txt"
    local.write_bytes(b"from this machine\n")
    image = (Image.debian_slim("3.12").pip_install("rtdemo").env({"WHO": "daytona"}).workdir("/srv/app")
             .run_commands("echo $FROM_IMAGE-$WHO-$(id -u) > made.txt").add_local_file(str(local), "/opt/local.txt"))
    logs: list[str] = []
    sandbox = daytona.create(CreateSandboxFromImageParams(image=image), timeout=300,
                             on_snapshot_create_logs=logs.append)
    try:
        r = sandbox.process.exec("cat /var/log/calls /srv/app/made.txt /opt/local.txt")
        assert r.exit_code == 0, r
        assert r.result == ("apt-get update\n"
                            "apt-get install -y --no-install-recommends gcc gfortran build-essential\n"
                            "pip install --upgrade pip\n"
                            "python -m pip install rtdemo\n"
                            "python-slim-daytona-0\n"
                            "from this machine\n"), r.result
        built = rt.images.get(sandbox.withruntime.info["image"])
        assert built["source"] == "dockerfile", built
        assert built["pulled"].startswith("docker.io/library/python:3.12-slim-bookworm@sha256:"), built["pulled"]
        # The second tag is the same manifest: its unpacked layer was reused.
        assert "pulled from mirror" in "".join(logs) and "(cached)" in "".join(logs), logs
    finally:
        daytona.delete(sandbox)


def test_an_image_without_bash_runs_shell_commands_through_sh(rt):
    image = rt.images.build(name="alpine-like", dockerfile=f"FROM {ALPINE}\nRUN echo $((2+3)) > /five\n",
                            poll_seconds=0.5)
    assert image["state"] == "ready", image["error"]
    with rt.sandboxes.create(image="alpine-like") as sbx:
        # No bash there: the string runs through the image's sh (busybox).
        assert sbx.exec("test -e /bin/bash || test -e /usr/bin/bash || echo no-bash").stdout == "no-bash\n"
        assert sbx.exec("echo $((1+2))").stdout == "3\n"
        assert sbx.exec("cat /five; echo $SHELL").stdout == "5\n/bin/sh\n"
        # Files and argv commands as before.
        sbx.files.write("/tmp/note", "via files\n")
        assert sbx.exec("cat /tmp/note").stdout == "via files\n"



def test_an_image_without_any_shell_gets_ours(rt, tmp_path):
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "added.txt").write_text("from the context\n")
    image = rt.images.build(name="distroless-like", context_dir=str(ctx), poll_seconds=0.5,
                            dockerfile=f"FROM {DISTROLESS}\nCOPY added.txt /app/added.txt\n"
                                       "RUN echo $((6*7)) > /app/answer\n")
    assert image["state"] == "ready", image["error"]
    # Each step's size is measured (maxImageMiB) by the supplied busybox's df.
    sized = [line for line in image["log"].splitlines() if line.endswith(" MiB in the image")]
    assert len(sized) == len(image["steps"]) >= 2, image["log"]
    assert "no df in the image" not in image["log"], image["log"]
    with rt.sandboxes.create(image="distroless-like") as sbx:
        # No shell of its own: strings run through the busybox supplied at
        # the unpack, its applets after the image's PATH.
        assert sbx.exec("test -e /bin/sh || test -e /usr/bin/sh || echo no-sh-of-its-own").stdout \
            == "no-sh-of-its-own\n"
        assert sbx.exec("echo $((1+2))").stdout == "3\n"
        assert sbx.exec("cat /app/greeting.txt /app/added.txt /app/answer").stdout == \
            "hello from distroless\nfrom the context\n42\n"
        assert sbx.exec("echo $SHELL; id -u").stdout == "/usr/lib/runtime/bin/sh\n1000\n"
        # sudo is supplied too, as for any image without one.
        assert sbx.exec("sudo id -u").stdout == "0\n"
        sbx.files.write("/tmp/note", "via files\n")
        assert sbx.exec("wc -l < /tmp/note").stdout.strip() == "1"


def test_add_unpacks_each_compression_with_busybox_tar(rt, tmp_path):
    # Busybox's tar (Alpine's, Debian's) guesses no compression from a file:
    # ADD tells it, from the archive's name, as GNU tar would guess.
    ctx, src = tmp_path / "ctx", tmp_path / "src"
    ctx.mkdir()
    (src / "d").mkdir(parents=True)
    (src / "d" / "f.txt").write_text("packed\n")
    kinds = [("a.tar", "w"), ("b.tgz", "w:gz"), ("c.tar.bz2", "w:bz2"), ("e.tar.xz", "w:xz")]
    for name, mode in kinds:
        with tarfile.open(ctx / name, mode) as t:
            t.add(src / "d", arcname="d")
    adds = "".join(f"ADD {name} /x/{name}/\n" for name, _ in kinds)
    image = rt.images.build(name="alpine-add", context_dir=str(ctx), poll_seconds=0.5,
                            dockerfile=f"FROM {ALPINE}\n{adds}")
    assert image["state"] == "ready", image["error"]
    with rt.sandboxes.create(image="alpine-add") as sbx:
        paths = " ".join(f"/x/{name}/d/f.txt" for name, _ in kinds)
        assert sbx.exec(f"cat {paths}").stdout == "packed\n" * len(kinds)


def test_an_image_without_sudo_gets_runtimes(rt):
    rt.images.build(name="no-sudo", image=ALPINE, poll_seconds=0.5)
    with rt.sandboxes.create(image="no-sudo") as sbx:
        assert sbx.exec("id -u").stdout == "1000\n"
        # Passwordless, as in the default image, for the sandbox user.
        assert sbx.exec("sudo id -u").stdout == "0\n"
        assert sbx.exec("sudo -u '#1234' id -u").stdout == "1234\n"
        assert sbx.exec("ls -l /usr/bin/sudo").stdout.startswith("-rwsr-xr-x")
        # The environment is reset unless -E keeps it.
        assert "SECRET_X" not in sbx.exec("sudo env", env={"SECRET_X": "1"}).stdout
        assert "SECRET_X=1" in sbx.exec("sudo -E env", env={"SECRET_X": "1"}).stdout
        assert "SUDO_USER=" in sbx.exec("sudo env").stdout
        # Root-owned files become writable through it, and only through it.
        assert sbx.exec("echo x > /etc/owned-by-root").exit_code != 0
        assert sbx.exec("sudo sh -c 'echo made > /etc/owned-by-root' && cat /etc/owned-by-root").stdout == "made\n"
        # Another user may not use it.
        other = sbx.exec("sudo -u '#1234' sudo id -u")
        assert other.exit_code != 0 and "only the sandbox user" in other.stderr, other
        # Under another name the setuid binary does nothing.
        renamed = sbx.exec("cp /usr/bin/sudo /tmp/x 2>/dev/null; ln -s /usr/bin/sudo /tmp/agent; /tmp/agent id -u")
        assert renamed.exit_code != 0 and renamed.stdout == "", renamed


MULTI = f"""\
FROM {APP} AS build
RUN mkdir -p /out && echo "made-from-$(cat /etc/zstd-was-here)-$((6*7))" > /out/value \\
 && mkdir -p /out/tree/sub && echo deep > /out/tree/sub/file
FROM {APP} AS unused
RUN echo never-built-marker
FROM {ALPINE}
WORKDIR /app
COPY --from=build /out/value ./value
COPY --from=build --chown=runtime:runtime --chmod=0700 /out/tree /app/tree
COPY --from={APP} /srv/app/keep-me /from-image
CMD ["cat", "/app/value"]
"""


def test_a_multi_stage_build_copies_from_its_stages_and_an_image(rt):
    image = rt.images.build(name="multi-stage", dockerfile=MULTI, poll_seconds=0.5)
    assert image["state"] == "ready", image["error"]
    log = image["log"]
    # The stage nobody copies from is not built.
    assert "never-built-marker" not in log, log
    assert "COPY --from=build /out/value ./value (from layer" in log, log
    with rt.sandboxes.create(image="multi-stage") as sbx:
        # What only the build stage could make (a file of its image, its
        # bash arithmetic), in the slim image; a directory's contents;
        # a file of the image named by reference.
        assert sbx.exec("cat /app/value").stdout == "made-from-zstd-42\n"
        # (commands run as the sandbox user, uid 1000, which --chown made the owner)
        r = sbx.exec("cat /app/tree/sub/file; stat -c '%a %u' /app/tree/sub /app/tree/sub/file")
        assert r.stdout == "deep\n700 1000\n700 1000\n", (r.stdout, r.stderr)
        assert sbx.exec("cat /from-image").stdout == "kept\n"
        # The final stage is the Alpine-like one: no bash came along.
        assert sbx.exec("test -e /bin/bash || echo no-bash").stdout == "no-bash\n"
    # The same build again: every step is cached, the copies included.
    again = rt.images.build(name="multi-stage", dockerfile=MULTI, poll_seconds=0.5)
    assert again["state"] == "ready", again["error"]
    assert {s["state"] for s in again["steps"]} == {"cached"}, again["steps"]
    # A change in the build stage reruns the copy out of it, not the
    # other stage's steps before it.
    changed = rt.images.build(name="multi-stage", dockerfile=MULTI.replace("6*7", "6*8"), poll_seconds=0.5)
    assert changed["state"] == "ready", changed["error"]
    states = {s["instruction"].split(" (")[0]: s["state"] for s in changed["steps"]}
    assert states["WORKDIR /app"] == "cached", states
    assert states["COPY --from=build /out/value ./value"] == "done", states
    with rt.sandboxes.create(image="multi-stage") as sbx:
        assert sbx.exec("cat /app/value").stdout == "made-from-zstd-48\n"


def test_copy_from_an_unknown_stage_is_refused_naming_the_line(rt):
    from withruntime import InvalidRequestError
    with pytest.raises(InvalidRequestError) as e:
        rt.images.create(dockerfile=f"FROM {APP} AS build\nRUN true\nFROM {ALPINE}\nCOPY --from=biuld /x /y\n")
    issues = e.value.details["issues"]
    assert [i["field"] for i in issues] == ["dockerfile"], issues
    assert issues[0]["message"].startswith(
        "Dockerfile line 4 (COPY): COPY --from=biuld: no stage is named biuld (the stages: build)"), issues
