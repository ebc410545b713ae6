"""Commands: argv, stdin, cwd, env, exit codes, timeouts, users, streaming
and a flood of output, on one sandbox shared by the module."""
from __future__ import annotations

import time

import pytest
from withruntime import CommandError, InvalidRequestError


def test_shell_string_and_exit_code(sbx):
    result = sbx.exec("echo out; echo err >&2; exit 3")
    assert result.exit_code == 3
    assert result.stdout == "out\n"
    assert result.stderr == "err\n"
    assert result.timed_out is False
    assert sbx.exec("true").exit_code == 0
    assert sbx.exec("false").exit_code == 1


def test_check_raises_command_error(sbx):
    with pytest.raises(CommandError) as raised:
        sbx.exec("echo nope >&2; exit 7", check=True)
    assert raised.value.exit_code == 7
    assert "nope" in raised.value.stderr


def test_argv_is_not_a_shell(sbx):
    result = sbx.exec(["printf", "%s|", "a b", "$HOME", "c;d"])
    assert result.exit_code == 0, result
    assert result.stdout == "a b|$HOME|c;d|"


def test_missing_program_in_argv(sbx):
    # The contract leaves this open: a shell's 127, or a 400 naming the program.
    try:
        result = sbx.exec(["/no/such/program"])
    except InvalidRequestError as error:
        assert error.code == "command_not_found" and "/no/such/program" in error.message
    else:
        assert result.exit_code == 127, result


def test_stdin_text_and_bytes(sbx):
    assert sbx.exec(["cat"], stdin="hello\nworld\n").stdout == "hello\nworld\n"
    assert sbx.exec(["wc", "-c"], stdin=b"\x00\x01\x02\xff").stdout.strip() == "4"
    assert sbx.exec("read line; echo got:$line", stdin="abc\n").stdout == "got:abc\n"


def test_cwd(sbx):
    assert sbx.exec("pwd").stdout == "/workspace\n"
    assert sbx.exec("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sbx.exec(["pwd"], cwd="/").stdout == "/\n"


def test_env(sbx):
    result = sbx.exec("echo $FOO-$BAR", env={"FOO": "one", "BAR": "two words"})
    assert result.stdout == "one-two words\n"
    assert sbx.exec("echo ${FOO:-unset}").stdout == "unset\n"


def test_timeout_is_a_result(sbx):
    started = time.monotonic()
    result = sbx.exec("echo before; sleep 30; echo after", timeout_ms=1500)
    assert result.timed_out is True
    assert result.exit_code is None
    assert "after" not in result.stdout
    assert time.monotonic() - started < 30
    # The sandbox still answers, and the sleep is gone.
    assert sbx.exec("echo alive").stdout == "alive\n"
    assert sbx.exec("pgrep -fx 'sleep 30' || echo none").stdout.strip() == "none"


def test_users(sbx):
    assert sbx.exec("id -u").stdout == "1000\n"
    assert sbx.exec("id -u", user="root").stdout == "0\n"
    assert sbx.exec("id -u", user="sandbox").stdout == "1000\n"
    assert sbx.exec("echo $HOME").stdout == "/workspace\n"
    assert sbx.exec("touch /workspace/mine && stat -c %u /workspace/mine").stdout == "1000\n"
    # The sandbox user cannot write where only root may, root can.
    assert sbx.exec("touch /etc/e2e-denied").exit_code != 0
    assert sbx.exec("touch /etc/e2e-root && echo ok", user="root").stdout == "ok\n"
    assert sbx.exec("sudo -n id -u").stdout == "0\n"


def test_the_sandbox_user_reopens_its_own_stdio(sbx):
    # The agent makes the pipes as root: the user's process must still open
    # /dev/stdout and /dev/stderr by name (tee, loggers, the R driver do).
    result = sbx.exec("echo out > /dev/stdout; echo err | tee /dev/stderr >/dev/null")
    assert (result.exit_code, result.stdout, result.stderr) == (0, "out\n", "err\n"), result
    assert sbx.exec("cat > /dev/stdout", stdin="piped\n").stdout == "piped\n"
    # /dev/null stays root's, readable and writable by all.
    assert sbx.exec("stat -c '%u %a' /dev/null").stdout == "0 666\n"


def test_streamed_output_arrives_while_the_command_runs(sbx):
    """The command prints, then waits for a file that only the callback
    creates: it can finish only if the first chunk is delivered while it runs."""
    sbx.exec("rm -f /tmp/e2e-go")
    chunks: list[str] = []

    def on_stdout(data: str) -> None:
        if not chunks:
            sbx.exec("touch /tmp/e2e-go")
        chunks.append(data)

    result = sbx.exec("echo ready; while [ ! -e /tmp/e2e-go ]; do sleep 0.1; done; echo done",
                      on_stdout=on_stdout, timeout_ms=45_000)
    assert result.timed_out is False, result
    assert result.exit_code == 0
    assert result.stdout == "ready\ndone\n"
    assert "".join(chunks) == "ready\ndone\n"
    assert len(chunks) >= 2


def test_stream_events(sbx):
    events = list(sbx.exec_stream("echo a; echo b >&2; echo c; exit 4"))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "start" and events[0]["processId"]
    assert kinds[-1] == "exit"
    assert events[-1]["exitCode"] == 4
    assert "truncated" not in kinds
    out = "".join(e["data"] for e in events if e["type"] == "stdout")
    err = "".join(e["data"] for e in events if e["type"] == "stderr")
    assert out == "a\nc\n" and err == "b\n"
    offsets = [e["offset"] for e in events if e["type"] in ("stdout", "stderr")]
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_stderr_callback(sbx):
    seen: list[str] = []
    result = sbx.exec("echo to-err >&2", on_stderr=seen.append)
    assert result.exit_code == 0
    assert "".join(seen) == "to-err\n" == result.stderr


def test_ten_mib_of_output_is_truncated_and_the_server_copes(sbx):
    size = 10 * 1024 * 1024
    result = sbx.exec(f"head -c {size} /dev/zero | tr '\\0' a")
    assert result.exit_code == 0, (result.exit_code, result.stderr[-500:])
    assert result.stdout_truncated is True
    assert 0 < len(result.stdout) < size
    assert set(result.stdout) == {"a"}
    assert result.stderr_truncated is False
    # Streamed, every byte arrives or the loss is reported.
    received = []
    streamed = sbx.exec(f"head -c {size} /dev/zero | tr '\\0' b", on_stdout=lambda d: received.append(len(d)))
    assert streamed.exit_code == 0
    assert sum(received) == len(streamed.stdout)
    assert streamed.stdout_truncated or len(streamed.stdout) == size
    # The sandbox and server still answer.
    assert sbx.exec("echo fine").stdout == "fine\n"


def test_concurrent_commands(sbx):
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: sbx.exec(f"sleep 1; echo {i}"), range(4)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(4)]


def test_guest_timers_work(sbx):
    # coreutils timeout and Python's signal.alarm need the kernel's POSIX timers.
    assert sbx.exec("timeout 1 sleep 20; echo $?", timeout_ms=30000).stdout == "124\n"
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGALRM, lambda *a: (print('alarm'), sys.exit(0)))\n"
            "signal.alarm(1)\n"
            "time.sleep(20)\n")
    sbx.files.write("/workspace/alarm.py", code)
    result = sbx.exec("python3 /workspace/alarm.py", timeout_ms=30000)
    assert (result.exit_code, result.stdout) == (0, "alarm\n"), result


# Fills memory 32 MiB at a time until the kernel's out-of-memory killer ends it.
FILL_MEMORY = "import sys\nheld = []\nwhile True:\n    held.append(b'x' * (32 << 20))\n"


def test_a_command_the_kernel_kills_for_memory_reports_out_of_memory(server):
    from withruntime import Sandbox

    with Sandbox.create(vcpu=1, memory_mib=512) as small:
        result = small.exec(["python3", "-c", FILL_MEMORY], timeout_ms=120_000)
        assert result.exit_code != 0 and not result.timed_out, result.to_dict()
        oom = result.out_of_memory
        assert isinstance(oom, dict), result.to_dict()
        assert (oom["code"], oom["memoryMiB"]) == ("out_of_memory", 512)
        assert oom["processesKilled"] >= 1
        assert "512 MiB" in oom["message"] and oom["hint"]
        # check=True raises it as out_of_memory, not as a plain failure.
        with pytest.raises(CommandError) as raised:
            small.exec(["bash", "-c", f"python3 -c \"{FILL_MEMORY}\"; exit 1"], check=True,
                       timeout_ms=120_000)
        assert raised.value.code == "out_of_memory", raised.value
        # The sandbox lives on, and an ordinary command reports none (it
        # runs in the group the killed ones ran in, kept for reuse: only
        # what came after counts).
        fine = small.exec("echo fine")
        assert (fine.stdout, fine.out_of_memory) == ("fine\n", None)
        # An ended command's empty group is reused, not piled up: one
        # command at a time needs one.
        groups = small.exec("ls -d /sys/fs/cgroup/cmd-*").stdout.split()
        assert len(groups) == 1, groups
