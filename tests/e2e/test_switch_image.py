"""`:switch-image` through the official client: a sandbox moved to another
image keeps its id, name, `/workspace` and environment, loses the rest of
its old disk and its processes, and runs the new image's start command; a
switch that cannot be done is refused with nothing changed."""
from __future__ import annotations

import uuid

import pytest
from withruntime import ConflictError, NotFoundError, Sandbox

from conftest import http


@pytest.fixture(scope="module")
def images(runtime):
    """Two versions of one image: each leaves a marker in /opt and starts a
    command that records that it ran."""
    made = []
    for n in ("one", "two"):
        dockerfile = (
            "FROM default\n"
            f"RUN echo built-{n} | sudo tee /opt/marker.txt >/dev/null\n"
            f'CMD ["sh", "-c", "echo started-{n} > /tmp/started.txt; sleep 3600"]\n'
        )
        made.append(runtime.images.build(name="e2e-switch", dockerfile=dockerfile, tags=[n], poll_seconds=0.5))
    return made


def _wait_for_file(sbx, path: str, tries: int = 60) -> str:
    for _ in range(tries):
        r = sbx.exec(f"cat {path} 2>/dev/null")
        if r.exit_code == 0 and r.stdout:
            return r.stdout
        sbx.exec("sleep 0.5")
    return ""


def test_a_switch_keeps_workspace_and_loses_the_rest(runtime, images):
    name = f"switch-{uuid.uuid4().hex[:8]}"
    with Sandbox.create(image="e2e-switch:one", name=name, env={"KEPT": "yes"}) as sbx:
        assert _wait_for_file(sbx, "/tmp/started.txt") == "started-one\n"
        marker = uuid.uuid4().hex
        sbx.files.write("/workspace/notes/keep.txt", marker)
        sbx.exec("echo lost | sudo tee /etc/lost.txt >/dev/null && ln -s notes/keep.txt /workspace/link")
        sleeper = sbx.spawn("sleep 3600")
        sbx.switch_image("e2e-switch:two", keep="workspace")
        assert sbx.info["state"] == "running", sbx.info
        assert sbx.info["image"] == images[1]["id"], sbx.info
        again = runtime.sandboxes.get(sbx.id)
        assert again.info["name"] == name
        assert sbx.exec("cat /opt/marker.txt").stdout == "built-two\n"
        assert sbx.files.read("/workspace/notes/keep.txt") == marker.encode()
        assert sbx.exec("readlink /workspace/link; stat -c %U /workspace/notes/keep.txt").stdout == \
            "notes/keep.txt\nruntime\n"
        assert sbx.exec("test -e /etc/lost.txt").exit_code != 0
        assert sbx.exec("echo $KEPT").stdout == "yes\n"
        # Its processes ended with its old machine; the new image's start command runs.
        with pytest.raises(NotFoundError):
            sbx.process(sleeper.id)
        assert _wait_for_file(sbx, "/tmp/started.txt") == "started-two\n"
        # The same image again changes nothing.
        same = sbx.switch_image("e2e-switch:two", keep="workspace")
        assert same.info["state"] == "running"


def test_a_paused_sandbox_is_switched_and_runs(runtime, images):
    with Sandbox.create(image="e2e-switch:one") as sbx:
        sbx.files.write("/workspace/p.txt", "paused before")
        sbx.pause()
        sbx.switch_image("e2e-switch:two", keep="workspace")
        assert sbx.info["state"] == "running", sbx.info
        assert sbx.files.read("/workspace/p.txt") == b"paused before"
        assert sbx.exec("cat /opt/marker.txt").stdout == "built-two\n"


def test_a_switch_refused_changes_nothing(server, runtime, images):
    with Sandbox.create(image="e2e-switch:one") as sbx:
        a = http(server, "POST", f"/v1/sandboxes/{sbx.id}:switch-image", {"image": "e2e-switch:two"})
        assert a.status == 400 and a.json()["error"]["details"]["issues"][0]["field"] == "keep", a
        a = http(server, "POST", f"/v1/sandboxes/{sbx.id}:switch-image", {"keep": "everything"})
        assert a.status == 400, a
        assert {i["field"] for i in a.json()["error"]["details"]["issues"]} == {"image", "keep"}, a
        with pytest.raises(NotFoundError) as caught:
            sbx.switch_image("e2e-no-such-image", keep="workspace")
        assert caught.value.code == "image_not_found"
        assert runtime.sandboxes.get(sbx.id).info["image"] == images[0]["id"]
        assert sbx.exec("cat /opt/marker.txt").stdout == "built-one\n"
    plain = Sandbox.create(image="e2e-switch:one")
    try:
        plain.stop()
        with pytest.raises(ConflictError) as caught:
            plain.switch_image("e2e-switch:two", keep="workspace")
        assert caught.value.code == "not_persistent"
    finally:
        plain.delete()
