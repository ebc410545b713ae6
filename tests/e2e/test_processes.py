"""Background processes through `sbx.spawn`: output, stdin, kill, wait."""
from __future__ import annotations

import time


def test_spawn_and_wait(sbx):
    proc = sbx.spawn("for i in 1 2 3; do echo line $i; done; echo oops >&2; exit 5")
    assert proc.id
    result = proc.wait()
    assert result.stdout == "line 1\nline 2\nline 3\n"
    assert result.stderr == "oops\n"
    assert result.exit_code == 5
    assert proc.exit_code == 5
    assert proc.state != "running"


def test_spawn_returns_at_once_and_runs_beside_exec(sbx):
    started = time.monotonic()
    proc = sbx.spawn("sleep 20; echo late")
    assert time.monotonic() - started < 15
    assert proc.refresh()["state"] == "running"
    assert proc.id in [p["id"] for p in sbx.processes()]
    # An exec is answered while the background process still runs.
    assert sbx.exec("echo meanwhile").stdout == "meanwhile\n"
    assert sbx.process(proc.id).state == "running"
    proc.kill("SIGKILL")
    result = proc.wait()
    assert "late" not in result.stdout
    assert result.exit_code is None
    assert proc.refresh()["state"] != "running"


def test_write_to_stdin(sbx):
    proc = sbx.spawn(["cat"], stdin="pipe")
    proc.write("hello\n")
    proc.write(b"world\n", eof=True)
    result = proc.wait()
    assert result.stdout == "hello\nworld\n"
    assert result.exit_code == 0


def test_kill_with_sigterm(sbx):
    proc = sbx.spawn("trap 'echo got-term; exit 9' TERM; echo waiting; while true; do sleep 0.2; done")
    # Wait for the trap to be in place before signalling.
    events = proc.output(timeout_seconds=60)
    first = next(e for e in events if e["type"] == "stdout")
    events.close()
    assert first["data"].startswith("waiting")
    proc.kill()
    result = proc.wait()
    assert "got-term" in result.stdout
    assert result.exit_code == 9


def test_output_events(sbx):
    proc = sbx.spawn("echo a; echo b >&2; echo c")
    events = list(proc.output())
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "exit" and events[-1]["exitCode"] == 0
    assert "".join(e["data"] for e in events if e["type"] == "stdout") == "a\nc\n"
    assert "".join(e["data"] for e in events if e["type"] == "stderr") == "b\n"
    # Reading again from the start gives the same output (it is kept).
    again = list(proc.output())
    assert "".join(e["data"] for e in again if e["type"] == "stdout") == "a\nc\n"


def test_spawn_as_root_with_env_and_cwd(sbx):
    proc = sbx.spawn("id -u; pwd; echo $E2E_VAR", user="root", cwd="/tmp", env={"E2E_VAR": "set"})
    assert proc.wait().stdout == "0\n/tmp\nset\n"
