"""Daytona's declarative images through the official client
(`withruntime.daytona`), written as Daytona's users write them:
`create(CreateSandboxFromImageParams(image=Image...))` with the build's
logs, a second create from the same Image served by the image already built,
`Image.from_dockerfile` with files of its context, and
`snapshot.create(CreateSnapshotParams(image=...))` then a sandbox from that
snapshot's name. Every Image here starts from Runtime's own image
(`Image.base("default")`); registry bases (`Image.base("python:3.12-slim")`,
`Image.debian_slim()`) are in test_registry_images.py, which runs a registry.
Three image builds in all, each a build machine under TCG."""
from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def daytona(server):
    from withruntime.daytona import Daytona
    with Daytona() as client:
        yield client


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """Files on this machine that the Images add: one file (random bytes,
    executable) and a directory with a subdirectory."""
    root = tmp_path_factory.mktemp("daytona-local")
    blob = root / "tool.bin"
    blob.write_bytes(os.urandom(20_000) + b"\x00\xff")
    blob.chmod(0o755)
    tree = root / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "top.txt").write_text("top\n")
    (tree / "sub" / "deep.txt").write_text("deep\n")
    return {"blob": blob, "tree": tree}


def app_image(local):
    """A fresh Image each call (Image's methods add to the one they are
    called on), the same Dockerfile and files each time."""
    from withruntime.daytona import Image
    return (Image.base("default")
            .run_commands("echo built-by-$(id -un) > /opt/built.txt", "echo marker-$((6 * 7))-from-the-build")
            .env({"APP_MODE": "e2e", "SPACED": "two words"})
            .workdir("/opt/app")
            .run_commands("pwd > where.txt && echo $APP_MODE > mode.txt")
            .add_local_file(str(local["blob"]), "/opt/tool.bin")
            .add_local_dir(str(local["tree"]), "/opt/tree"))


@pytest.fixture(scope="module")
def built(daytona, local):
    from withruntime.daytona import CreateSandboxFromImageParams
    logs: list[str] = []
    started = time.monotonic()
    sandbox = daytona.create(CreateSandboxFromImageParams(image=app_image(local), labels={"suite": "daytona-images"}),
                             timeout=300, on_snapshot_create_logs=logs.append)
    try:
        yield sandbox, logs, time.monotonic() - started
    finally:
        try:
            daytona.delete(sandbox)
        except Exception:  # noqa: BLE001 - the session teardown sweeps what is left
            pass


def test_a_sandbox_from_an_image_has_what_its_build_made(built, local):
    sandbox, logs, _ = built
    # Each step ran in the build machine, as root until a USER.
    assert sandbox.process.exec("cat /opt/built.txt").result == "built-by-root\n"
    # The WORKDIR made the later step run there, with the image's env.
    r = sandbox.process.exec("cat /opt/app/where.txt /opt/app/mode.txt")
    assert (r.exit_code, r.result) == (0, "/opt/app\ne2e\n")
    # The image's env is every command's; the Image's quoting is undone.
    assert sandbox.process.exec("echo \"$APP_MODE|$SPACED\"").result == "e2e|two words\n"
    # add_local_file: the same bytes and its mode; add_local_dir: its tree.
    digest = sandbox.process.exec("sha256sum /opt/tool.bin | cut -d' ' -f1; stat -c %a /opt/tool.bin").result
    assert digest.split() == [hashlib.sha256(local["blob"].read_bytes()).hexdigest(), "755"]
    assert sandbox.process.exec("cat /opt/tree/top.txt /opt/tree/sub/deep.txt").result == "top\ndeep\n"
    assert sandbox.fs.download_file("/opt/tree/sub/deep.txt") == b"deep\n"
    # The build's own output reached on_snapshot_create_logs as it ran.
    text = "".join(logs)
    assert all(line.endswith("\n") for line in logs), logs[:5]
    assert "marker-42-from-the-build" in text, text[-3000:]
    assert "built-by-root" not in text  # written to the file, not printed


def test_the_same_image_again_is_served_from_the_built_one(daytona, built, local, runtime):
    from withruntime.daytona import CreateSandboxFromImageParams
    first, _, took = built
    logs: list[str] = []
    started = time.monotonic()
    again = daytona.create(CreateSandboxFromImageParams(image=app_image(local)), on_snapshot_create_logs=logs.append)
    try:
        quick = time.monotonic() - started
        # No build at all: the image the first create built, by its name.
        assert logs == []
        assert again.withruntime.info["image"] == first.withruntime.info["image"]
        name = runtime.images.get(first.withruntime.info["image"])["name"]
        assert name.startswith("daytona-image-")
        assert [i["version"] for i in runtime.images.list(name=name).to_list()] == [1]
        assert quick < took, (quick, took)
        assert again.process.exec("cat /opt/built.txt /opt/tree/top.txt").result == "built-by-root\ntop\n"
    finally:
        daytona.delete(again)


DOCKERFILE = """\
FROM default
ARG GREETING=hello
ENV FROM_FILE=yes
WORKDIR /srv
COPY app.txt ./app.txt
COPY ./conf/ /etc/e2e-conf/
RUN tr a-z A-Z < app.txt > upper.txt && echo "$GREETING-$(ls /etc/e2e-conf | wc -l)" > greeting.txt
CMD ["bash", "-c", "echo started-in-$(pwd) > /tmp/started; exec sleep 600"]
"""


def test_an_image_from_a_dockerfile_with_its_context(daytona, tmp_path):
    from withruntime.daytona import CreateSandboxFromImageParams, Image
    (tmp_path / "Dockerfile").write_text(DOCKERFILE)
    (tmp_path / "app.txt").write_text("from the context\n")
    (tmp_path / "conf" / "more").mkdir(parents=True)
    (tmp_path / "conf" / "a.conf").write_text("a = 1\n")
    (tmp_path / "conf" / "more" / "b.conf").write_text("b = 2\n")
    sandbox = daytona.create(CreateSandboxFromImageParams(image=Image.from_dockerfile(str(tmp_path / "Dockerfile"))),
                             timeout=300)
    try:
        r = sandbox.process.exec("cat /srv/app.txt /srv/upper.txt /srv/greeting.txt; echo $FROM_FILE")
        assert (r.exit_code, r.result) == (0, "from the context\nFROM THE CONTEXT\nhello-2\nyes\n")
        # A directory of the context, copied as Docker copies one: its contents.
        assert sandbox.process.exec("cat /etc/e2e-conf/a.conf /etc/e2e-conf/more/b.conf").result == \
            "a = 1\nb = 2\n"
        # The Dockerfile's CMD ran in the new sandbox, in its WORKDIR.
        deadline = time.monotonic() + 60
        out = ""
        while not out and time.monotonic() < deadline:
            out = sandbox.process.exec("cat /tmp/started 2>/dev/null").result
            time.sleep(0.5)
        assert out == "started-in-/srv\n"
    finally:
        daytona.delete(sandbox)


def test_a_snapshot_from_an_image_then_a_sandbox_from_its_name(daytona, built, local, runtime):
    from withruntime.daytona import CreateSandboxFromSnapshotParams, CreateSnapshotParams
    name = f"e2e-daytona-image-{os.getpid()}"
    logs: list[str] = []
    snapshot = daytona.snapshot.create(
        CreateSnapshotParams(name=name, image=app_image(local).run_commands("echo extra-$APP_MODE > extra.txt")),
        on_logs=logs.append)
    sandbox = None
    try:
        assert (snapshot.name, snapshot.state) == (name, "active")
        assert daytona.snapshot.get(name).id == snapshot.id
        assert name in [s.name for s in daytona.snapshot.list().items]
        # The same steps as the first Image were not run again: only the
        # one added.
        steps = runtime.images.get(snapshot.id)["steps"]
        assert [s["state"] for s in steps[:-1]] == ["cached"] * (len(steps) - 1), steps
        assert steps[-1]["state"] == "done" and "extra" in steps[-1]["instruction"], steps[-1]
        assert "(cached)" in "".join(logs), logs
        sandbox = daytona.create(CreateSandboxFromSnapshotParams(snapshot=name))
        r = sandbox.process.exec("cat /opt/app/extra.txt /opt/built.txt")
        assert (r.exit_code, r.result) == (0, "extra-e2e\nbuilt-by-root\n")
    finally:
        if sandbox is not None:
            daytona.delete(sandbox)
    from withruntime.daytona import DaytonaNotFoundError
    # Daytona's delete is Runtime's stop: the stopped sandbox is kept (its
    # disk rests on the image). The snapshot is deleted all the same, as
    # Runtime deletes a version its sandboxes use (images.md, "Deleting a
    # version"): gone by name, while the kept sandbox still holds it.
    daytona.snapshot.delete(name)
    with pytest.raises(DaytonaNotFoundError):
        daytona.snapshot.get(name)
    assert runtime.sandboxes.get(sandbox.id).info["image"] == snapshot.id
    runtime.sandboxes.delete(sandbox.id)


def test_an_image_whose_build_fails_says_which_step(daytona):
    from withruntime.daytona import CreateSandboxFromImageParams, DaytonaError, Image
    image = Image.base("default").run_commands("echo about-to-fail; exit 3")
    logs: list[str] = []
    with pytest.raises(DaytonaError) as e:
        daytona.create(CreateSandboxFromImageParams(image=image), on_snapshot_create_logs=logs.append)
    # The image's error: the step, how it ended and its last output.
    assert "step 1 (RUN echo about-to-fail; exit 3) exited with code 3" in str(e.value), str(e.value)
    assert "about-to-fail" in str(e.value).split("exited with code 3", 1)[1], str(e.value)
    assert "about-to-fail" in "".join(logs)
