"""E2B's main flows, written as E2B's users write them, with only the import
changed (`withruntime.e2b`, `withruntime.e2b.code_interpreter`): create, run
commands and read their output, exact bytes in and out, background commands,
list and reconnect, pause and connect, the code interpreter, kill. One
sandbox for the module where the state does not matter."""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def e2b(server):
    from withruntime.e2b import Sandbox
    sandbox = Sandbox.create(metadata={"suite": "e2b"})
    try:
        yield sandbox
    finally:
        try:
            sandbox.kill()
        except Exception:  # noqa: BLE001 - the session teardown sweeps what is left
            pass


def test_commands_run_in_the_vm(e2b):
    from withruntime.e2b import CommandExitException
    # As in E2B, a non-zero exit raises, carrying the result.
    with pytest.raises(CommandExitException) as raised:
        e2b.commands.run("uname -s; cat /proc/sys/kernel/hostname; echo err >&2; exit 3")
    result = raised.value
    assert result.exit_code == 3
    assert result.stdout.splitlines()[0] == "Linux"
    assert result.stderr == "err\n"
    # The hostname the guest's own kernel reports, as the file says.
    assert result.stdout.splitlines()[1] == e2b.commands.run("hostname").stdout.strip()
    streamed: list[str] = []
    done = e2b.commands.run("for i in 1 2 3; do echo line$i; done", on_stdout=streamed.append)
    assert done.exit_code == 0 and "".join(streamed) == "line1\nline2\nline3\n"
    assert e2b.commands.run("echo $GREETING", envs={"GREETING": "hi there"}).stdout == "hi there\n"


def test_files_keep_exact_bytes_and_home_is_linked(e2b):
    data = os.urandom(70_000) + b"\x00\xff"
    e2b.files.write("/home/user/blob.bin", data)
    assert e2b.files.read("/home/user/blob.bin", format="bytes") == bytes(data)
    sha = e2b.commands.run("sha256sum /home/user/blob.bin | cut -d' ' -f1").stdout.strip()
    import hashlib
    assert sha == hashlib.sha256(data).hexdigest()
    e2b.files.write("/home/user/notes/a.txt", "alpha")
    names = {entry.name for entry in e2b.files.list("/home/user/notes")}
    assert names == {"a.txt"}
    assert e2b.files.exists("/home/user/notes/a.txt") and not e2b.files.exists("/home/user/notes/b.txt")
    e2b.files.rename("/home/user/notes/a.txt", "/home/user/notes/b.txt")
    assert e2b.files.read("/home/user/notes/b.txt") == "alpha"
    e2b.files.remove("/home/user/notes")
    assert not e2b.files.exists("/home/user/notes")
    from withruntime.e2b import FileNotFoundException
    with pytest.raises(FileNotFoundException):
        e2b.files.read("/home/user/no-such-file")


def test_a_background_command_is_listed_connected_to_and_killed(e2b):
    handle = e2b.commands.run("echo started; sleep 300", background=True)
    pids = [p.pid for p in e2b.commands.list()]
    assert handle.pid in pids
    again = e2b.commands.connect(handle.pid)
    assert again.pid == handle.pid
    assert e2b.commands.kill(handle.pid)
    # E2B's wait on a killed command raises its exit.
    from withruntime.e2b import CommandExitException
    with pytest.raises(CommandExitException):
        handle.wait()
    assert not e2b.commands.kill(handle.pid)
    assert handle.pid not in [p.pid for p in e2b.commands.list()]
    quick = e2b.commands.run("echo out; echo err >&2", background=True)
    finished = quick.wait()
    assert (finished.exit_code, finished.stdout, finished.stderr) == (0, "out\n", "err\n")


def test_list_connect_and_info(server, e2b):
    from withruntime.e2b import Sandbox, SandboxQuery
    page = Sandbox.list(query=SandboxQuery(metadata={"suite": "e2b"}))
    ids = [info.sandbox_id for info in page.next_items()]
    assert e2b.sandbox_id in ids
    other = Sandbox.connect(e2b.sandbox_id)
    assert other.commands.run("cat /home/user/blob.bin | wc -c").stdout.strip() == "70002"
    info = e2b.get_info()
    assert info.sandbox_id == e2b.sandbox_id and info.metadata.get("suite") == "e2b"
    assert e2b.is_running()


def test_pause_then_connect_keeps_memory(server):
    from withruntime.e2b import Sandbox
    sandbox = Sandbox.create()
    try:
        sandbox.commands.run("echo kept-in-tmp > /tmp/mark", background=False)
        sandbox.commands.run("sleep 600", background=True)
        assert sandbox.pause()
        back = Sandbox.connect(sandbox.sandbox_id)
        assert back.commands.run("cat /tmp/mark").stdout == "kept-in-tmp\n"
        assert any("sleep 600" in (p.cmd + " " + " ".join(p.args)) for p in back.commands.list())
    finally:
        assert sandbox.kill()
    from withruntime.e2b import SandboxException
    with pytest.raises(SandboxException):
        Sandbox.connect(sandbox.sandbox_id)


def test_the_code_interpreter_keeps_state(server):
    from withruntime.e2b.code_interpreter import Sandbox
    with Sandbox.create() as ci:
        ci.run_code("x = 6 * 7")
        execution = ci.run_code("print('printed', x); x + 1")
        assert execution.logs.stdout == ["printed 42\n"]
        assert execution.text == "43"
        failed = ci.run_code("1 / 0")
        assert failed.error is not None and failed.error.name == "ZeroDivisionError"
        js = ci.run_code("const a = [1, 2, 3]; a.map(v => v * 2).join(',')", language="javascript")
        assert js.text.strip("'\"") == "2,4,6"


def test_signed_urls_download_and_upload_without_a_key(e2b):
    import urllib.request
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    e2b.files.write("/home/user/shared.txt", "made in the sandbox\n")
    url = e2b.download_url("/home/user/shared.txt", use_signature_expiration=120)
    with opener.open(url, timeout=60) as answer:
        assert answer.read() == b"made in the sandbox\n"
    up = e2b.upload_url("/home/user/uploaded.bin")
    body = os.urandom(5000)
    request = urllib.request.Request(up, data=body, method="PUT")
    with opener.open(request, timeout=60) as answer:
        assert answer.status == 200
    assert e2b.files.read("/home/user/uploaded.bin", format="bytes") == body
