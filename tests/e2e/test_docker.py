"""Docker inside a sandbox, through the official client (docs/environment.md,
"Docker inside"): `sudo enable-docker` starts the preinstalled Docker Engine
and the sandbox user drives it without sudo; `docker run` of an image from
a registry, `docker build` and containers reach the network only under the
sandbox's rules (their connections carried like the guest's own, their
names answered inside); `docker compose up` publishes a port that a preview
and the client's `forward_port` reach.

The registry is the suite's (registry.py: Debian's docker-registry over TLS
as `registry.example.com`, its busybox image); the web is the egress test
servers (`example.net` over plain HTTP, `ssh.example.com` a raw TCP server
that speaks first)."""
from __future__ import annotations

import os
import shutil
import tempfile
import urllib.request
from pathlib import Path

import pytest
from withruntime import Runtime, Sandbox

from conftest import Server, preview_fetch
from egress_servers import BANNER_NAME
from registry import PUBLIC, Registries, publish
from test_transparent import DELETE_TABLE

IMAGE = f"{PUBLIC}/test/busybox:1"


def fetch(url: str, *options: str) -> str:
    """A `docker run` that fetches `url` with busybox's wget, at most 20 s
    (the shell stays the container's PID 1: a signal to a PID 1 with no
    handler is ignored, so `timeout` could not end a wget exec'd there),
    and prints wget's exit status."""
    return f"docker run --rm {' '.join(options)} {IMAGE} 'timeout 20 wget -qO- {url}; echo wget-exit=$?'"

COMPOSE = f"""
services:
  web:
    image: {IMAGE}
    command: ["mkdir -p /tmp/www && echo hello from compose > /tmp/www/index.html && exec httpd -f -p 8000 -h /tmp/www"]
    ports: ["8080:8000"]
"""

DOCKERFILE = f"""FROM {IMAGE}
RUN wget -qO /tmp/fetched http://example.net/echo/from-a-build
CMD ["cat /tmp/fetched"]
"""


@pytest.fixture(scope="module")
def env():
    """A server of this module's own whose egress also reaches the registry,
    the busybox image pushed to it, and one sandbox with Docker started."""
    root = Path(tempfile.mkdtemp(prefix="runtime-e2e-docker-"))
    os.chmod(root, 0o711)
    srv = Server(root)
    regs = Registries(root / "registries", egress=srv.egress)
    srv.extra_args += regs.args
    try:
        publish(regs.public, "test/busybox", "1", docker=True)
        srv.start()
    except Exception:
        regs.close()
        srv.egress.close()
        raise
    try:
        with Runtime(api_key=srv.admin_key(), base_url=srv.url) as client:
            sbx = Sandbox.create(client=client)
            yield srv, sbx, regs.ca_pem.read_text()
    finally:
        srv.shut_down()
        regs.close()
        shutil.rmtree(root, ignore_errors=True)


def run(sbx, command: str, timeout_ms: int = 300_000) -> tuple[int, str]:
    r = sbx.exec(command, timeout_ms=timeout_ms)
    return r.exit_code, (r.stdout + r.stderr).strip()


@pytest.fixture(scope="module")
def docker(env):
    srv, sbx, ca = env
    code, out = run(sbx, "sudo enable-docker")
    assert code == 0, out
    assert "Docker Engine" in out and "is running" in out and "Docker Compose version" in out, out
    # The registry's certificate is signed by the suite's CA: Docker trusts
    # it for that registry (as an operator's private CA would be given).
    sbx.files.write("/tmp/registry-ca.crt", ca)
    code, out = run(sbx, f"sudo mkdir -p /etc/docker/certs.d/{PUBLIC} &&"
                         f" sudo cp /tmp/registry-ca.crt /etc/docker/certs.d/{PUBLIC}/ca.crt")
    assert code == 0, out
    return srv, sbx


def test_enable_docker_starts_the_engine_for_the_sandbox_user(docker):
    _, sbx = docker
    # The sandbox user, without sudo: the socket's group is theirs.
    code, out = run(sbx, "whoami; docker info --format '{{.Driver}} cgroup-v{{.CgroupVersion}} {{.OperatingSystem}}'")
    assert code == 0, out
    assert out.splitlines()[0] == "runtime", out
    assert out.splitlines()[1].startswith("overlay2 cgroup-v2"), out
    # Again: harmless, says so.
    code, out = run(sbx, "sudo enable-docker")
    assert code == 0 and "already running" in out, out


def test_docker_run_pulls_from_a_registry_under_the_rules(docker):
    _, sbx = docker
    # The registry is not allowed: the pull is refused.
    sbx.network.set(internet=False, allow=["example.net"])
    code, out = run(sbx, f"docker pull {IMAGE}")
    assert code != 0, out
    assert "Downloaded newer image" not in out and "Pull complete" not in out, out
    sbx.network.set(internet=True)
    code, out = run(sbx, f"docker run --rm {IMAGE} 'echo in a container as $(id -u) on $(uname -n)'")
    assert code == 0, out
    assert "in a container as 1000 on " in out, out
    # The container is not the sandbox: its own hostname and file system.
    sbx.files.write("/workspace/only-in-the-sandbox", "x")
    code, out = run(sbx, f"docker run --rm {IMAGE} 'cat /etc/hostname;"
                         f" [ -e /workspace/only-in-the-sandbox ] && echo seen || echo absent'")
    assert code == 0 and out.splitlines()[0] != "sandbox", out
    assert out.splitlines()[1] == "absent", out


def test_containers_reach_the_network_only_under_the_rules(docker):
    _, sbx = docker
    # A name resolves inside the container (answered by the sandbox), the
    # connection is carried by the sandbox's proxy: the server saw the path.
    code, out = run(sbx, fetch("http://example.net/echo/from-a-container"))
    assert code == 0 and "wget-exit=0" in out, out
    assert '"path": "/echo/from-a-container"' in out, out
    # Raw TCP on a port the rules do not open: refused.
    nc = f"docker run --rm {IMAGE} 'echo hello | nc -w 10 {BANNER_NAME} 22'"
    code, out = run(sbx, nc)
    assert "SSH-2.0" not in out, out
    # Opened: the banner and the echo come back.
    sbx.network.set(internet=True, connect=[f"{BANNER_NAME}:22"])
    try:
        code, out = run(sbx, nc)
        assert "SSH-2.0-RuntimeTest" in out and "HELLO" in out, out
    finally:
        sbx.network.set(internet=True)
    # Internet off: the container reaches nothing.
    sbx.network.off()
    try:
        code, out = run(sbx, fetch("http://example.net/echo/off"))
        assert code == 0 and "wget-exit=0" not in out and "/echo/off" not in out, out
    finally:
        sbx.network.on()


def test_docker_build_runs_its_steps_under_the_rules(docker):
    _, sbx = docker
    sbx.files.write("/workspace/app/Dockerfile", DOCKERFILE)
    code, out = run(sbx, "cd /workspace/app && docker build -q -t app:1 . && docker run --rm app:1")
    assert code == 0, out
    assert '"/echo/from-a-build"' in out, out


def test_compose_up_publishes_a_port_a_preview_and_forward_port_reach(docker):
    srv, sbx = docker
    sbx.files.write("/workspace/web/compose.yaml", COMPOSE)
    code, out = run(sbx, "cd /workspace/web && docker compose up -d")
    assert code == 0, out
    try:
        preview = sbx.previews.create(8080, visibility="public")
        answer = preview_fetch(srv, preview["url"], "/index.html", timeout=120)
        assert (answer.status, answer.body) == (200, b"hello from compose\n"), answer
        # And the client's port forward to the same port.
        with sbx.forward_port(8080, local_port=0) as fwd:
            url = f"http://127.0.0.1:{fwd.local_port}/index.html"
            assert urllib.request.urlopen(url, timeout=60).read() == b"hello from compose\n"
    finally:
        run(sbx, "cd /workspace/web && docker compose down")


def test_a_container_cannot_go_around_the_rules(docker):
    """Last in this module: it deletes the sandbox's nat rules."""
    _, sbx = docker
    around = fetch("http://example.net/echo/around")
    code, out = run(sbx, around)
    assert code == 0 and "wget-exit=0" in out and "/echo/around" in out, out
    # A privileged container cannot reach the guest's rules: it has a
    # network of its own (the rules live in the guest's).
    code, out = run(sbx, f"docker run --rm --privileged {IMAGE} 'cat /proc/net/dev'")
    assert code == 0 and "eth0:" in out and "runtime0" not in out, out
    # Root in the guest deletes the rules: a container's connections then go
    # to the agent's interface and die there; nothing else carries them.
    sbx.files.write("/tmp/delete_table.py", DELETE_TABLE)
    code, out = run(sbx, "sudo python3 /tmp/delete_table.py")
    assert code == 0 and out == "deleted 0", out
    code, out = run(sbx, around)
    assert code == 0 and "wget-exit=0" not in out and "/echo/around" not in out, out
    code, out = run(sbx, fetch("http://example.net/echo/around", "--network host"))
    assert code == 0 and "wget-exit=0" not in out and "/echo/around" not in out, out
