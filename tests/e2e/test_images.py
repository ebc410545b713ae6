"""Custom images through the official client: recipe and Dockerfile builds
(pip and npm from the local test registries that stand for PyPI and npm,
commands, files, env, workdir, user), the step cache, a failed step's
report, and sandboxes created from an image."""
from __future__ import annotations

import time

import pytest
from withruntime import ConflictError, InvalidRequestError
from withruntime import RuntimeError as ClientError

# The test servers of egress_servers.py play the registries (see
# test_network.py): the build reaches them through the egress proxy.
REGISTRY_ENV = {
    "PIP_INDEX_URL": "http://pypi.example.net/simple/",
    "PIP_TRUSTED_HOST": "pypi.example.net",
    "NPM_CONFIG_REGISTRY": "http://npm.example.net/npm/",
}


def _recipe(last_command: str) -> dict:
    return {
        "env": {**REGISTRY_ENV, "GREETING": "hello from the image"},
        "workdir": "/workspace/app",
        "pip": ["rtdemo"],
        "npm": ["rtdemo"],
        "files": {"/workspace/app/config.txt": "answer=42\n"},
        "commands": ["python3 -c 'import rtdemo; print(rtdemo.ANSWER)' > from-build.txt", last_command],
    }


def _states(image: dict) -> list[str]:
    return [s["state"] for s in image["steps"]]


def test_recipe_build_cache_and_sandboxes_from_it(runtime):
    started = time.monotonic()
    image = runtime.images.build(name="e2e-app", recipe=_recipe("echo one > last.txt"), poll_seconds=0.5)
    cold = time.monotonic() - started
    assert image["state"] == "ready" and image["version"] == 1 and "latest" in image["tags"]
    assert "cached" not in _states(image), image["steps"]
    assert "pip install rtdemo" in image["log"] and "npm install -g rtdemo" in image["log"]

    with runtime.sandboxes.create(image="e2e-app") as sbx:
        assert sbx.info["image"] == image["id"]
        # The packages, files, env, workdir and the commands' results are there.
        assert sbx.exec("python3 -c 'import rtdemo; print(rtdemo.ANSWER)'").stdout == "42\n"
        assert sbx.exec("ls /usr/local/lib/node_modules/rtdemo/package.json").exit_code == 0
        assert sbx.exec("cat /workspace/app/config.txt").stdout == "answer=42\n"
        assert sbx.exec("cat /workspace/app/from-build.txt /workspace/app/last.txt").stdout == "42\none\n"
        assert sbx.exec("echo $GREETING").stdout == "hello from the image\n"
        # Recipe commands run as the sandbox user: what they make is theirs.
        assert sbx.exec("stat -c %U /workspace/app/last.txt").stdout == "user\n"
        with pytest.raises(ConflictError) as caught:
            runtime.images.delete(image["id"])
        assert caught.value.code == "image_in_use"

    # Only the last step changed: every step before it comes from the cache.
    started = time.monotonic()
    again = runtime.images.build(name="e2e-app", recipe=_recipe("echo two > last.txt"), poll_seconds=0.5)
    warm = time.monotonic() - started
    states = _states(again)
    assert states[:-1] == ["cached"] * (len(states) - 1) and states[-1] == "done", again["steps"]
    assert "(cached)" in again["log"]
    assert again["version"] == 2 and warm < cold, (cold, warm)
    # `latest` moved to the new version; the old one is still there by version.
    assert runtime.images.resolve("e2e-app")["id"] == again["id"]
    assert runtime.images.resolve("e2e-app@1")["id"] == image["id"]
    with runtime.sandboxes.create(image="e2e-app@2") as sbx:
        assert sbx.exec("cat /workspace/app/last.txt").stdout == "two\n"
    with runtime.sandboxes.create(image=image["id"]) as sbx:
        assert sbx.exec("cat /workspace/app/last.txt").stdout == "one\n"
    # The default image knows nothing of it.
    with runtime.sandboxes.create() as sbx:
        assert sbx.exec("test -e /workspace/app || echo absent").stdout == "absent\n"


def test_dockerfile_build_with_arg_env_workdir_copy_user(runtime):
    dockerfile = "\n".join([
        "FROM runtime",
        "ARG FLAVOR=plain",
        "ENV MODE=$FLAVOR \\",
        "    OTHER=x",
        "WORKDIR /srv/app",
        "COPY app.py ./",
        "RUN chmod 755 app.py && id -un > built-by.txt && mkdir out && chown user out",
        "USER user",
        "RUN python3 app.py > out/out.txt && id -un > out/by.txt",
        "CMD [\"python3\", \"app.py\"]",
    ])
    image = runtime.images.build(name="e2e-docker", dockerfile=dockerfile, build_args={"FLAVOR": "spicy"},
                                 files={"app.py": "import os\nprint('mode', os.environ['MODE'])\n"},
                                 poll_seconds=0.5)
    assert image["state"] == "ready" and image["start"] == {"command": "'python3' 'app.py'"}
    with runtime.sandboxes.create(image="e2e-docker:latest") as sbx:
        assert sbx.exec("cat /srv/app/out/out.txt").stdout == "mode spicy\n"
        # Before USER, steps ran as root; after it, as the sandbox user.
        assert sbx.exec("cat /srv/app/built-by.txt /srv/app/out/by.txt").stdout == "root\nuser\n"
        assert sbx.exec("echo $MODE $OTHER").stdout == "spicy x\n"


def test_a_failed_build_names_the_step_and_its_output(runtime):
    recipe = {"commands": ["echo fine", "echo something-went-wrong >&2; exit 3", "echo never"]}
    with pytest.raises(ClientError) as caught:
        runtime.images.build(name="e2e-broken", recipe=recipe, poll_seconds=0.5)
    assert caught.value.code == "image_build_failed"
    failed = runtime.images.list(name="e2e-broken").data[0]
    assert failed["state"] == "failed"
    assert "step 2" in failed["error"] and "exited with code 3" in failed["error"]
    assert "something-went-wrong" in failed["error"]
    assert _states(failed) == ["done", "failed", "pending"]
    with pytest.raises(ConflictError):
        runtime.sandboxes.create(image=failed["id"])
    with pytest.raises(InvalidRequestError):
        runtime.images.create(dockerfile="FROM runtime\nONBUILD RUN true\n")


def test_an_images_start_command_runs_in_each_new_sandbox(runtime):
    image = runtime.images.build(name="e2e-start", recipe={"workdir": "/srv/s", "commands": ["touch built"]},
                                 start={"command": "echo up-$(pwd) > /tmp/start-ran; exec sleep 600"},
                                 poll_seconds=0.5)
    assert image["state"] == "ready", image
    for _ in range(2):
        with runtime.sandboxes.create(image="e2e-start") as sbx:
            deadline = time.monotonic() + 60
            out = ""
            while time.monotonic() < deadline:
                out = sbx.exec("cat /tmp/start-ran 2>/dev/null || true").stdout
                if out:
                    break
                time.sleep(0.5)
            assert out == "up-/srv/s\n"
            commands = [p["command"] for p in sbx.processes()]
            assert any("sleep 600" in c for c in commands), commands
