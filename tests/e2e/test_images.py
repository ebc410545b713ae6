"""Custom images through the official client: recipe and Dockerfile builds
(pip and npm from the local test registries that stand for PyPI and npm,
apt from the Debian mirror of the guest's apt sources, commands, files, env,
workdir, user, a Dockerfile FROM one of ours), the step cache, a failed
step's report, sandboxes created from an image, and `runtime image build
--file recipe.toml`."""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from withruntime import ConflictError, InvalidRequestError, NotFoundError
from withruntime import RuntimeError as ClientError

from conftest import BINARY

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
        assert sbx.exec("stat -c %U /workspace/app/last.txt").stdout == "runtime\n"

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
        # A version deleted while a sandbox runs on it is gone from the API;
        # the sandbox keeps it, through a pause and a wake too.
        runtime.images.delete(again["id"])
        with pytest.raises(NotFoundError):
            runtime.images.get(again["id"])
        with pytest.raises(NotFoundError):
            runtime.sandboxes.create(image=again["id"])
        assert again["id"] not in [d["id"] for d in runtime.images.list(name="e2e-app").data]
        sbx.pause()
        sbx.wake()
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
        "RUN chmod 755 app.py && id -un > built-by.txt && mkdir out && chown runtime out",
        "USER runtime",
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
        assert sbx.exec("cat /srv/app/built-by.txt /srv/app/out/by.txt").stdout == "root\nruntime\n"
        assert sbx.exec("echo $MODE $OTHER").stdout == "spicy x\n"

    # FROM one of ours goes on as its USER, in its WORKDIR, with its ENV.
    child = runtime.images.build(name="e2e-docker-child", dockerfile="\n".join([
        "FROM e2e-docker",
        "RUN (id -un; pwd; echo $MODE) > out/by-child.txt",
    ]), poll_seconds=0.5)
    assert child["state"] == "ready" and child["user"] == "user", child
    with runtime.sandboxes.create(image="e2e-docker-child") as sbx:
        assert sbx.exec("cat /srv/app/out/by-child.txt").stdout == "runtime\n/srv/app\nspicy\n"


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


def test_a_build_log_is_followed_as_it_is_written(server, runtime):
    recipe = {"commands": ["echo first-line; sleep 4; echo second-line"]}
    image = runtime.images.create(name="e2e-follow", recipe=recipe)
    request = urllib.request.Request(
        f"{server.url}/v1/images/{image['id']}/logs?follow=true",
        headers={"Authorization": f"Bearer {server.admin_key()}", "Accept": "application/x-ndjson"})
    events, state_at_first_line = [], None
    with urllib.request.urlopen(request, timeout=600) as response:
        assert response.headers["Content-Type"].startswith("application/x-ndjson")
        for raw in response:
            if not raw.strip():
                continue  # a heartbeat
            event = json.loads(raw)
            events.append(event)
            if event.get("text") == "first-line":
                # The step's first output arrives while the step still runs.
                state_at_first_line = runtime.images.get(image["id"])["state"]
            if event["type"] in ("done", "error"):
                break
    assert state_at_first_line == "building", events
    *lines, last = events
    assert last["type"] == "done" and last["image"]["state"] == "ready", last
    assert all(e["type"] == "line" and {"seq", "step", "stream", "text"} <= e.keys() for e in lines), lines
    texts = [e["text"] for e in lines]
    assert texts.index("first-line") < texts.index("second-line"), texts
    # The client's on_log gets the same lines through the stream; a rebuild
    # is cached whole.
    seen = []
    again = runtime.images.build(name="e2e-follow", recipe=recipe, on_log=seen.append)
    assert again["state"] == "ready" and again["version"] == 2
    assert any("(cached)" in line["text"] for line in seen), seen
    assert [line["seq"] for line in seen] == sorted(line["seq"] for line in seen)
    # Tags by hand: `prod` on version 1, then on 2; the name lists them
    # when a reference names nothing.
    first = runtime.images.tag(image["id"], "prod")
    assert "prod" in first["tags"]
    runtime.images.tag("e2e-follow@2", "prod")
    assert runtime.images.resolve("e2e-follow:prod")["id"] == again["id"]
    assert "prod" not in runtime.images.get(image["id"])["tags"]
    runtime.images.untag("e2e-follow@2", "prod")
    with pytest.raises(ClientError) as caught:
        runtime.images.resolve("e2e-follow:prod")
    assert caught.value.code == "image_not_found"
    assert "latest" in str(caught.value) and "1, 2" in str(caught.value)


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


def _mirror(runtime) -> str:
    """The first Debian mirror of the guest's apt sources."""
    with runtime.sandboxes.create() as sbx:
        sources = sbx.exec("cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null; "
                           "cat /etc/apt/sources.list.d/*.sources 2>/dev/null; true").stdout
    found = re.search(r"^(?:deb\s+(?:\[[^]]*\]\s+)?|URIs:\s*)(\S+://\S+)", sources, re.M)
    assert found, f"no mirror in the guest's apt sources:\n{sources}"
    return found.group(1)


def _skip_unless_reachable(url: str) -> None:
    """Skips when the mirror cannot be reached from this host at all (the
    egress proxy runs here, so the guest cannot reach it either)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        opener.open(urllib.request.Request(url, method="HEAD"), timeout=15).close()
    except urllib.error.HTTPError:
        pass  # it answered
    except (urllib.error.URLError, OSError) as error:
        pytest.skip(f"the Debian mirror {url} is unreachable from this host: {error}")


@pytest.mark.timeout(1500)
def test_apt_packages_come_from_the_debian_mirror(runtime):
    _skip_unless_reachable(_mirror(runtime))
    # apt-get update under emulation takes a while; the build has its own
    # 30-minute step timeout, the test a little more.
    image = runtime.images.build(name="e2e-apt", recipe={"apt": ["hello"]}, poll_seconds=2)
    assert image["state"] == "ready", image
    assert "apt install hello" in image["log"] and "Setting up hello" in image["log"], image["log"][-2000:]
    with runtime.sandboxes.create(image="e2e-apt") as sbx:
        assert sbx.exec("hello").stdout == "Hello, world!\n"
        assert sbx.exec("dpkg-query -W -f '${Status}' hello").stdout == "install ok installed"


def _cli(server, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "RUNTIME_API_KEY": server.admin_key()}
    env.pop("RUNTIME_API_URL", None)
    return subprocess.run([str(BINARY), "image", "build", "--url", server.url, *args], env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.timeout(900)
def test_the_cli_builds_an_image_from_a_toml_recipe(server, runtime, tmp_path):
    registry_env = "\n".join(f'{k} = "{v}"' for k, v in REGISTRY_ENV.items())
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f"""
name = "overridden-by-the-command-line"
workdir = "/workspace/cli"
pip = ["rtdemo"]
commands = ["python3 -c 'import rtdemo; print(rtdemo.ANSWER)' > answer.txt"]
start = "echo started > /tmp/cli-start; exec sleep 600"

[env]
{registry_env}
FROM_TOML = "yes"

[files]
"/workspace/cli/notes.txt" = "written by the recipe\\n"
""")
    done = _cli(server, "--file", str(recipe), "--name", "e2e-cli", "--tag", "latest", "--tag", "first")
    assert done.returncode == 0, done
    # Each step as it starts and ends, then the image's id and name.
    assert re.search(r"step 2/4 pip install rtdemo \.\.\.", done.stderr), done.stderr
    assert re.search(r"step 4/4 done in [0-9.]+ s", done.stderr), done.stderr
    final = done.stdout.strip().splitlines()[-1]
    found = re.fullmatch(r"image (\S+) e2e-cli@1 ready in [0-9.]+ s \(tags: latest, first\)", final)
    assert found, done.stdout
    image = runtime.images.get(found.group(1))
    assert image["name"] == "e2e-cli" and image["state"] == "ready" and image["tags"] == ["latest", "first"]
    assert image["start"] == {"command": "echo started > /tmp/cli-start; exec sleep 600"}
    with runtime.sandboxes.create(image="e2e-cli:first") as sbx:
        assert sbx.exec("cd /workspace/cli && cat answer.txt notes.txt").stdout == "42\nwritten by the recipe\n"
        assert sbx.exec("echo $FROM_TOML; stat -c %U /workspace/cli/answer.txt").stdout == "yes\nruntime\n"

    # A failed build exits non-zero with the failing step and its output.
    broken = tmp_path / "broken.toml"
    broken.write_text('commands = ["echo fine", "echo cli-went-wrong >&2; exit 3"]\n')
    failed = _cli(server, "--file", str(broken), "--name", "e2e-cli-broken")
    assert failed.returncode != 0, failed
    assert "step 2/2 RUN echo cli-went-wrong >&2; exit 3 FAILED" in failed.stderr, failed.stderr
    assert "step 2 (RUN echo cli-went-wrong" in failed.stderr and "exited with code 3" in failed.stderr
    assert "cli-went-wrong" in failed.stderr.split("its last output:", 1)[-1], failed.stderr

    # A misspelt field is refused before anything is sent; so is a call without a key.
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('pakages = ["jq"]\n')
    refused = _cli(server, "--file", str(wrong), timeout=60)
    assert refused.returncode != 0 and "`pakages` is not a recipe field" in refused.stderr, refused
    env = {k: v for k, v in os.environ.items() if k not in ("RUNTIME_API_KEY", "RUNTIME_API_URL")}
    no_key = subprocess.run([str(BINARY), "image", "build", "--url", server.url, "--file", str(recipe)],
                            env={**env, "XDG_CONFIG_HOME": str(tmp_path / "config")}, capture_output=True,
                            text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert no_key.returncode != 0 and "no API key" in no_key.stderr, no_key
    # The key `runtime login` saved for the server is used when none is given.
    auth = os.environ.get("RUNTIME_AUTH_URL", "https://withruntime.com").rstrip("/")
    saved = tmp_path / "config" / "runtime-cloud"
    saved.mkdir(parents=True, mode=0o700)
    name = hashlib.sha256(f"{auth}\n{server.url}".encode()).hexdigest()
    (saved / f"{name}.json").write_text(json.dumps({"apiOrigin": server.url, "key": server.admin_key()}))
    (saved / f"{name}.json").chmod(0o600)
    empty = tmp_path / "empty.toml"
    empty.write_text("# nothing: the server's own image under a name\n")
    logged_in = subprocess.run([str(BINARY), "image", "build", "--url", server.url, "--file", str(empty),
                                "--name", "e2e-cli-login"],
                               env={**env, "XDG_CONFIG_HOME": str(tmp_path / "config")}, capture_output=True,
                               text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert logged_in.returncode == 0 and "e2e-cli-login@1 ready" in logged_in.stdout, logged_in
