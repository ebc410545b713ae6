"""`runtime sandbox ...`, `runtime image ...` and `runtime keys` as a person
runs them: the binary as a subprocess (a real pty for `shell`) against the
suite's server, found through RUNTIME_API_URL and RUNTIME_API_KEY as the
server fixture sets them. One sandbox is shared by the module; the tests
that change its state (pause, wake, fork, snapshot) run last."""
from __future__ import annotations

import hashlib
import json
import os
import pty
import select
import signal
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from conftest import BINARY, free_port, http


def cli(*args: str, input: bytes | None = None, timeout: float = 180, check: bool = True,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    out = subprocess.run([str(BINARY), *args], input=input, capture_output=True, timeout=timeout,
                         stdin=None if input is not None else subprocess.DEVNULL,
                         env={**os.environ, **(env or {})})
    if check and out.returncode != 0:
        raise AssertionError(f"runtime {' '.join(args)} exited {out.returncode}:\n"
                             f"stdout: {out.stdout[-2000:]!r}\nstderr: {out.stderr[-2000:]!r}")
    return out


def one_line(stderr: bytes) -> str:
    lines = stderr.decode().strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {lines!r}"
    return lines[0]


@pytest.fixture(scope="module")
def name() -> str:
    return f"cli-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def sid(server, name):
    out = cli("sandbox", "create", "--name", name, "--label", "suite=cli", "--memory", "1024")
    ident = out.stdout.decode().strip()
    assert len(ident) == 36 and "\n" not in ident, out.stdout
    assert b"running" in out.stderr, out.stderr
    yield ident
    cli("sandbox", "rm", ident, check=False)


def test_ls_and_get(sid, name):
    listed = json.loads(cli("sandbox", "ls", "--json").stdout)
    assert isinstance(listed, list)
    mine = [s for s in listed if s["id"] == sid]
    assert mine and mine[0]["state"] == "running" and mine[0]["name"] == name, listed
    table = cli("sandbox", "ls", "--label", "suite=cli").stdout.decode()
    assert table.splitlines()[0].split()[:3] == ["ID", "NAME", "STATE"], table
    assert sid in table and name in table
    got = json.loads(cli("sandbox", "get", sid, "--json").stdout)
    assert got["id"] == sid and got["labels"] == {"suite": "cli"}
    # A name works where an id does.
    human = cli("sandbox", "get", name).stdout.decode()
    assert sid in human and "running" in human, human


def test_exec_streams_and_exits_with_the_code(sid):
    proc = subprocess.Popen([str(BINARY), "sandbox", "exec", sid, "echo one; sleep 3; echo two >&2; exit 3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        first = proc.stdout.readline()
        # The first line arrives while the command still runs.
        assert first == b"one\n"
        assert proc.poll() is None, "the output came only at the end"
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 3
    assert b"two\n" in err
    out = cli("sandbox", "exec", sid, "--", "python3", "-c", "print(6 * 7)")
    assert out.stdout == b"42\n"
    piped = cli("sandbox", "exec", sid, "--env", "GREETING=hi", "--", "sh", "-c", 'read x; echo "$GREETING $x"',
                input=b"there\n")
    assert piped.stdout == b"hi there\n"
    assert cli("sandbox", "exec", sid, "exit 7", check=False).returncode == 7
    result = cli("sandbox", "exec", sid, "--json", "echo json; exit 4", check=False)
    assert result.returncode == 4
    assert json.loads(result.stdout)["stdout"] == "json\n"


def test_exec_follows_its_command_across_a_pause(server, sid):
    proc = subprocess.Popen([str(BINARY), "sandbox", "exec", sid, "echo before; sleep 4; echo after; exit 6"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout.readline() == b"before\n"
        paused = http(server, "POST", f"/v1/sandboxes/{sid}:pause", {}, headers={"Prefer": "wait=120"})
        assert paused.status == 200 and paused.json()["state"] == "paused", paused
        # The server ends the stream with `continue`; following the process
        # from its cursor wakes the sandbox, and the rest arrives once.
        rest, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert rest == b"after\n", err
    assert proc.returncode == 6, err
    assert json.loads(cli("sandbox", "get", sid, "--json").stdout)["state"] == "running"


def test_cp_files_both_ways(sid, tmp_path):
    big = os.urandom(1_500_000)  # past 1 MiB: chunked uploads
    (tmp_path / "big.bin").write_bytes(big)
    script = tmp_path / "run.sh"
    script.write_bytes(b"#!/bin/sh\necho ran\n")
    script.chmod(0o755)
    cli("sandbox", "cp", str(tmp_path / "big.bin"), f"{sid}:/workspace/cli/big.bin")
    cli("sandbox", "cp", str(script), f"{sid}:/workspace/cli/")
    assert cli("sandbox", "exec", sid, "/workspace/cli/run.sh").stdout == b"ran\n"
    sums = cli("sandbox", "exec", sid, "sha256sum /workspace/cli/big.bin").stdout.decode()
    assert sums.split()[0] == hashlib.sha256(big).hexdigest()
    back = tmp_path / "back"
    back.mkdir()
    cli("sandbox", "cp", f"{sid}:/workspace/cli/big.bin", str(back / "big.bin"))
    cli("sandbox", "cp", f"{sid}:/workspace/cli/run.sh", str(back))
    assert (back / "big.bin").read_bytes() == big
    assert (back / "run.sh").read_bytes() == script.read_bytes()
    assert (back / "run.sh").stat().st_mode & 0o777 == 0o755


def tree(root: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p))
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = (p.read_bytes(), p.stat().st_mode & 0o777)
    return out


def test_cp_folders_both_ways(sid, tmp_path):
    src = tmp_path / "project"
    (src / "pkg" / "deep").mkdir(parents=True)
    (src / "empty").mkdir()
    (src / "main.py").write_text("print('hi')\n")
    (src / "pkg" / "deep" / ("n" * 120 + ".txt")).write_bytes(b"a long name\n")
    (src / "pkg" / "data.bin").write_bytes(os.urandom(700_000))  # batches past 1 MiB together
    (src / "pkg" / "more.bin").write_bytes(os.urandom(600_000))
    (src / "big.bin").write_bytes(os.urandom(1_200_000))  # on its own
    tool = src / "tool.sh"
    tool.write_text("#!/bin/sh\necho tool\n")
    tool.chmod(0o755)
    (src / "link").symlink_to("main.py")
    cli("sandbox", "cp", str(src), f"{sid}:/workspace/project")
    assert cli("sandbox", "exec", sid, "cd /workspace/project && python3 main.py && ./tool.sh").stdout \
        == b"hi\ntool\n"
    back = tmp_path / "copy"
    cli("sandbox", "cp", f"{sid}:/workspace/project", str(back))
    assert tree(back) == tree(src)


def test_logs_of_a_process(server, sid):
    spawned = http(server, "POST", f"/v1/sandboxes/{sid}/processes",
                   {"command": "echo hello; echo oops >&2"})
    assert spawned.status == 201, spawned
    pid = spawned.json()["id"]
    followed = cli("sandbox", "logs", sid, pid, "-f")
    assert followed.stdout == b"hello\n" and b"oops\n" in followed.stderr
    now = cli("sandbox", "logs", sid, pid)
    assert now.stdout == b"hello\n"
    listed = cli("sandbox", "logs", sid, "--json")
    assert pid in [p["id"] for p in json.loads(listed.stdout)]


def test_previews(sid):
    made = json.loads(cli("sandbox", "preview", sid, "8000", "--public", "--json").stdout)
    assert made["port"] == 8000 and made["visibility"] == "public" and made["url"], made
    listed = json.loads(cli("sandbox", "preview", sid, "--json").stdout)
    assert [p["port"] for p in listed] == [8000]
    cli("sandbox", "preview", sid, "8000", "--rm")
    assert json.loads(cli("sandbox", "preview", sid, "--json").stdout) == []


def test_port_forward(server, sid):
    started = http(server, "POST", f"/v1/sandboxes/{sid}/processes",
                   {"command": "mkdir -p /tmp/site && echo forwarded > /tmp/site/index.html && "
                               "cd /tmp/site && exec python3 -m http.server 8123 --bind 127.0.0.1"})
    assert started.status == 201, started
    port = free_port()
    fwd = subprocess.Popen([str(BINARY), "sandbox", "port-forward", sid, f"{port}:8123"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        body, deadline = None, time.monotonic() + 120
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while time.monotonic() < deadline:
            try:
                with opener.open(f"http://127.0.0.1:{port}/index.html", timeout=30) as answer:
                    body = answer.read()
                    break
            except OSError:
                time.sleep(1)
        assert body == b"forwarded\n"
    finally:
        fwd.send_signal(signal.SIGINT)
        try:
            _, err = fwd.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            fwd.kill()
            _, err = fwd.communicate()
    assert fwd.returncode == 0, err
    assert b"forwarding" in err


def test_shell_through_a_pty(sid):
    child, fd = pty.fork()
    if child == 0:  # pragma: no cover - the child becomes the CLI
        os.execv(str(BINARY), [str(BINARY), "sandbox", "shell", sid])
    seen, sent = b"", False
    start = time.monotonic()
    try:
        while time.monotonic() - start < 120:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if ready:
                try:
                    data = os.read(fd, 4096)
                except OSError:  # EIO: the CLI exited and the pty closed
                    break
                if not data:
                    break
                seen += data
            if not sent and (seen or time.monotonic() - start > 15):
                time.sleep(0.5)
                os.write(fd, b"echo $((6*7)); exit 5\r")
                sent = True
        _, status = os.waitpid(child, 0)
    finally:
        os.close(fd)
    assert b"42" in seen.replace(b"$((6*7))", b""), seen
    assert os.waitstatus_to_exitcode(status) == 5, seen
    # Piped input is typed in; the shell's own exit status comes back.
    piped = cli("sandbox", "shell", sid, input=b"echo piped-$((1+1)); exit 4\n", check=False)
    assert b"piped-2" in piped.stdout.replace(b"piped-$((1+1))", b""), piped
    assert piped.returncode == 4, piped
    # Without an exit, the end of the input ends the shell (Ctrl-D).
    ended = cli("sandbox", "shell", sid, input=b"echo at-$((2+3))\n", timeout=60, check=False)
    assert b"at-5" in ended.stdout.replace(b"at-$((2+3))", b"") and ended.returncode == 0, ended


def test_an_error_is_one_line_with_the_request_id():
    missing = str(uuid.uuid4())
    out = cli("sandbox", "get", missing, check=False)
    assert out.returncode != 0 and out.stdout == b""
    line = one_line(out.stderr)
    assert missing in line and "404" in line and ", request " in line, line
    out = cli("sandbox", "exec", missing, "true", check=False)
    assert out.returncode == 1 and "404" in one_line(out.stderr)
    out = cli("sandbox", "create", "--vcpu", "99", check=False)
    line = one_line(out.stderr)
    assert out.returncode == 1 and "--vcpu" in line and "400" in line, line
    out = cli("sandbox", "ls", env={"RUNTIME_API_KEY": "rtcloud_nope"}, check=False)
    assert out.returncode == 1 and "401" in one_line(out.stderr)


def test_the_saved_login_is_used(server, sid, tmp_path):
    config = tmp_path / "config"
    folder = config / "runtime-cloud"
    folder.mkdir(parents=True)
    folder.chmod(0o700)
    # Where `runtime login` (and the Python client) keep a login.
    name = hashlib.sha256(f"https://withruntime.com\n{server.url}".encode()).hexdigest()
    saved = folder / f"{name}.json"
    saved.write_text(json.dumps({"apiOrigin": server.url, "key": server.admin_key()}))
    saved.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k not in ("RUNTIME_API_URL", "RUNTIME_API_KEY", "RUNTIME_AUTH_URL")}

    def ls(config_home: Path) -> subprocess.CompletedProcess:
        return subprocess.run([str(BINARY), "sandbox", "ls", "--json"], capture_output=True, timeout=60,
                              stdin=subprocess.DEVNULL, env={**env, "XDG_CONFIG_HOME": str(config_home)})

    out = ls(config)
    assert out.returncode == 0, out.stderr
    assert sid in [s["id"] for s in json.loads(out.stdout)]
    out = ls(tmp_path / "nothing")
    assert out.returncode == 1 and "runtime login" in one_line(out.stderr)


def test_keys_limit_and_revoke_take_the_key_itself(server):
    data = str(server.data_dir)
    # Made here, not by server.create_key: the teardown lists with every key
    # that made, and this one ends revoked.
    key = cli("keys", "create", "--data-dir", data, "--name", f"cli-{uuid.uuid4().hex[:6]}").stdout.decode().strip()
    cli("keys", "limit", "--data-dir", data, key, "--daily-limit-micros", "2500000")
    key_id = key.split("_")[1]
    listed = [json.loads(line) for line in cli("keys", "list", "--data-dir", data, "--json").stdout.splitlines()]
    assert [k["dailyLimitMicros"] for k in listed if k["id"] == key_id] == [2500000]
    # A key that is not this server's is refused, and its secret not repeated.
    forged = f"rtcloud_{key_id}_{'x' * 43}"
    out = cli("keys", "limit", "--data-dir", data, forged, "--none", check=False)
    assert out.returncode != 0 and b"x" * 43 not in out.stderr and key_id.encode() in out.stderr
    cli("keys", "revoke", "--data-dir", data, key)
    out = cli("sandbox", "ls", env={"RUNTIME_API_KEY": key}, check=False)
    assert out.returncode == 1 and "401" in one_line(out.stderr)


def test_pause_wake_fork_snapshot_rm(server, sid):
    assert b"paused" in cli("sandbox", "pause", sid).stdout
    assert json.loads(cli("sandbox", "get", sid, "--json").stdout)["state"] == "paused"
    assert b"running" in cli("sandbox", "wake", sid).stdout
    assert cli("sandbox", "exec", sid, "cat /workspace/project/main.py").stdout == b"print('hi')\n"
    forks = cli("sandbox", "fork", sid).stdout.decode().split()
    assert len(forks) == 1 and forks[0] != sid
    try:
        assert cli("sandbox", "exec", forks[0], "cat /workspace/project/main.py").stdout == b"print('hi')\n"
    finally:
        cli("sandbox", "rm", forks[0])
    gone = cli("sandbox", "get", forks[0], check=False)
    assert gone.returncode == 1 and "404" in one_line(gone.stderr)
    snap = cli("sandbox", "snapshot", sid, "--name", "cli-snap").stdout.decode().strip()
    try:
        assert http(server, "GET", f"/v1/snapshots/{snap}").json()["state"] == "ready"
    finally:
        http(server, "DELETE", f"/v1/snapshots/{snap}")


@pytest.mark.timeout(600)
def test_images_ls_logs_tag_rm(tmp_path):
    name = f"cli-img-{uuid.uuid4().hex[:6]}"
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(f'name = "{name}"\ncommands = ["echo built-by-cli | tee /workspace/built.txt"]\n')
    url = os.environ["RUNTIME_API_URL"]
    built = cli("image", "build", "--file", str(recipe), "--url", url, timeout=550)
    assert b"ready" in built.stdout, built
    images = json.loads(cli("image", "ls", "--json").stdout)
    mine = [i for i in images if i["name"] == name]
    assert len(mine) == 1 and mine[0]["state"] == "ready", images
    assert name in cli("image", "ls").stdout.decode()
    assert b"built-by-cli" in cli("image", "logs", name).stdout
    # Tags by hand (docs/images.md): on, then off.
    assert cli("image", "tag", name, "stable").stdout.decode().startswith(mine[0]["id"])
    listed = [i for i in json.loads(cli("image", "ls", "--json").stdout) if i["id"] == mine[0]["id"]]
    assert "stable" in listed[0]["tags"], listed
    cli("image", "untag", name, "stable")
    listed = [i for i in json.loads(cli("image", "ls", "--json").stdout) if i["id"] == mine[0]["id"]]
    assert "stable" not in listed[0]["tags"], listed
    assert cli("image", "rm", name).stdout.decode().strip() == f"deleted {mine[0]['id']}"
    assert name not in [i["name"] for i in json.loads(cli("image", "ls", "--json").stdout)]


@pytest.mark.timeout(600)
def test_image_build_of_a_folder_and_from_an_image(server, tmp_path):
    # `runtime image build DIR -t name:tag`, as the product's first example:
    # the folder is the context, less what its .dockerignore leaves out.
    name = f"cli-dir-{uuid.uuid4().hex[:6]}"
    ctx = tmp_path / "app"
    deep = ctx / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    (ctx / "node_modules").mkdir()
    (ctx / "Dockerfile").write_text("FROM runtime\nARG GREETING=plain\nCOPY . /srv/app/\n"
                                    "RUN echo $GREETING > /srv/greeting.txt\n")
    (ctx / ".dockerignore").write_text("secret.txt\nnode_modules\n")
    (ctx / "a.txt").write_text("from the folder\n")
    (ctx / "secret.txt").write_text("left out\n")
    (ctx / "node_modules" / "big.js").write_text("left out too\n")
    (deep / "long.txt").write_text("a path over 100 characters\n")
    url = os.environ["RUNTIME_API_URL"]
    built = cli("image", "build", str(ctx), "-t", f"{name}:v1", "--build-arg", "GREETING=spicy",
                "--url", url, timeout=550)
    assert b"ready" in built.stdout, built
    assert b"context: 4 files" in built.stderr, built.stderr
    image = http(server, "GET", f"/v1/images/resolve?ref={name}:v1").json()
    assert image["state"] == "ready" and "v1" in image["tags"], image
    from withruntime import Runtime
    with Runtime(api_key=server.admin_key(), base_url=url) as rt:
        with rt.sandboxes.create(image=f"{name}:v1") as sbx:
            long = f"/srv/app/{'d' * 60}/{'e' * 60}/long.txt"
            assert sbx.exec(f"cat /srv/app/a.txt {long} /srv/greeting.txt").stdout == \
                "from the folder\na path over 100 characters\nspicy\n"
            assert sbx.exec("test -e /srv/app/secret.txt || test -e /srv/app/node_modules || echo none")\
                .stdout == "none\n"
    # The same folder again: every chunk is on the server already, the
    # steps are cached.
    again = cli("image", "build", str(ctx), "-t", f"{name}:v2", "--build-arg", "GREETING=spicy",
                "--url", url, timeout=550)
    assert b"0 of 1 chunks sent" in again.stderr and b"(cached)" in again.stderr, again.stderr
    # --from builds an image as it is (here one of ours, by name).
    cli("image", "build", "--from", f"{name}:v1", "-t", f"{name}-copy", "--url", url, timeout=550)
    copy = http(server, "GET", f"/v1/images/resolve?ref={name}-copy").json()
    assert copy["state"] == "ready" and copy["base"] == image["id"], copy
    # Two names in one build are refused before anything is sent.
    two = cli("image", "build", str(ctx), "-t", "a:1", "-t", "b:1", "--url", url, check=False)
    assert two.returncode != 0 and b"one name" in two.stderr, two.stderr
