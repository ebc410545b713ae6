"""Memory as a first-class thing, through the official client: pause and
wake keep a process whose state lives only in memory, auto-wake, repeated
pause/wake cycles, fork with memory, snapshot and a create from it."""
from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
from withruntime import AsyncRuntime, ConflictError, NotFoundError, Sandbox

SHAPE = {"vcpu": 1, "memory_mib": 1024}

# A counter whose value lives in a shell variable: only memory keeps it.
COUNTER = ("setsid bash -c 'x=0; while true; do x=$((x+1)); echo $x > /tmp/c.new; "
           "mv -f /tmp/c.new /tmp/c; sleep 0.2; done' >/dev/null 2>&1 </dev/null & sleep 0.5")


def counter(sbx) -> int:
    result = sbx.exec("cat /tmp/c")
    assert result.exit_code == 0, result
    return int(result.stdout)


def wait_counter_above(sbx, floor: int, timeout: float = 20) -> int:
    deadline = time.monotonic() + timeout
    while True:
        value = counter(sbx)
        if value > floor or time.monotonic() > deadline:
            return value
        time.sleep(0.3)


@pytest.fixture
def mem_sbx(server):
    sbx = Sandbox.create(**SHAPE)
    try:
        yield sbx
    finally:
        try:
            sbx.delete()
        except Exception:  # noqa: BLE001 - the session teardown sweeps what is left
            pass


def test_pause_and_wake_keep_a_process_and_its_memory(server, runtime, mem_sbx):
    sbx = mem_sbx
    assert sbx.exec(COUNTER).exit_code == 0
    sbx.files.write("/tmp/tmpfs.txt", "kept in /tmp")
    before = wait_counter_above(sbx, 2)
    sbx.pause()
    assert sbx.state == "paused"
    assert sbx.info["status"] == "paused"
    assert sbx.info["pausedAt"]
    assert runtime.sandboxes.get(sbx.id).state == "paused"
    time.sleep(1)
    sbx.wake()
    assert sbx.state == "running"
    after = counter(sbx)
    # It went on from where it was, not from 0, and it still counts.
    assert after >= before, (before, after)
    assert wait_counter_above(sbx, after) > after
    assert sbx.files.read("/tmp/tmpfs.txt") == b"kept in /tmp"
    # Waking an awake sandbox is fine.
    sbx.wake()
    assert sbx.state == "running"


def test_a_call_wakes_a_paused_sandbox(server, runtime, mem_sbx):
    sbx = mem_sbx
    sbx.exec(COUNTER)
    before = wait_counter_above(sbx, 1)
    sbx.pause()
    # No explicit wake: the exec wakes it, then runs.
    after = counter(sbx)
    assert after >= before
    assert runtime.sandboxes.get(sbx.id).state == "running"


def test_without_auto_wake_a_paused_sandbox_refuses(server):
    with Sandbox.create(auto_wake=False, **SHAPE) as sbx:
        sbx.pause()
        with pytest.raises(ConflictError) as caught:
            sbx.exec("true")
        assert caught.value.code == "sandbox_paused"
        sbx.wake()
        assert sbx.exec("echo ok").stdout == "ok\n"


def test_twenty_pause_wake_cycles_each_adding_a_file(server, mem_sbx):
    sbx = mem_sbx
    sandbox_id = sbx.id
    for i in range(20):
        sbx.files.write(f"/workspace/cycle-{i}.txt", f"cycle {i}")
        sbx.pause()
        assert sbx.state == "paused"
        sbx.wake()
        assert sbx.state == "running" and sbx.id == sandbox_id
    listing = sbx.exec("ls /workspace | grep -c '^cycle-'")
    assert listing.stdout == "20\n", listing
    for i in range(20):
        assert sbx.files.read(f"/workspace/cycle-{i}.txt") == f"cycle {i}".encode()


def test_a_pause_during_a_streamed_exec_loses_nothing(server, runtime, mem_sbx):
    sbx = mem_sbx
    seen: list[str] = []
    pauser_error: list[BaseException] = []
    paused: list[tuple[str, int]] = []

    def pause_midway():
        try:
            deadline = time.monotonic() + 30
            while "".join(seen).count("\n") < 10 and time.monotonic() < deadline:
                time.sleep(0.05)
            lines_before = "".join(seen).count("\n")
            paused.append((runtime.sandboxes.get(sbx.id).pause().state, lines_before))
        except BaseException as error:  # noqa: BLE001 - reported by the test
            pauser_error.append(error)

    pauser = threading.Thread(target=pause_midway)
    pauser.start()
    # The stream ends with `continue` at the pause; the client resumes from
    # its cursor, which wakes the sandbox, and gets the rest.
    result = sbx.exec("for i in $(seq 1 60); do echo $i; sleep 0.1; done", on_stdout=seen.append)
    pauser.join(60)
    assert not pauser_error, pauser_error
    # The pause really cut the stream: it came while the command ran (the
    # resuming client may have woken the sandbox before the pause answered).
    assert len(paused) == 1 and paused[0][1] < 60, paused
    assert paused[0][0] in ("paused", "resuming", "running"), paused
    assert result.exit_code == 0, result
    assert result.stdout == "".join(f"{i}\n" for i in range(1, 61)), result.stdout
    assert "".join(seen) == result.stdout
    assert runtime.sandboxes.get(sbx.id).state == "running"


def test_a_spawned_process_runs_on_across_pause_and_wake(server, mem_sbx):
    sbx = mem_sbx
    proc = sbx.spawn("for i in $(seq 1 30); do echo $i; sleep 0.1; done; exit 3")
    time.sleep(1)
    sbx.pause()
    assert sbx.process(proc.id).state == "running"
    sbx.wake()
    result = proc.wait()
    assert result.exit_code == 3, result
    assert result.stdout == "".join(f"{i}\n" for i in range(1, 31)), result.stdout
    assert proc.refresh()["state"] == "exited"


def test_fork_of_a_paused_sandbox(server, runtime, mem_sbx):
    sbx = mem_sbx
    sbx.exec(COUNTER)
    sbx.files.write("/workspace/paused.txt", "forked while paused")
    at_pause = wait_counter_above(sbx, 2)
    sbx.pause()
    copy = sbx.fork()
    try:
        assert copy.state == "running" and copy.id != sbx.id
        assert runtime.sandboxes.get(sbx.id).state == "paused"
        assert copy.files.read("/workspace/paused.txt") == b"forked while paused"
        value = counter(copy)
        assert value >= at_pause, (at_pause, value)
        assert wait_counter_above(copy, value) > value
    finally:
        copy.delete()
    # The source wakes as it was.
    assert counter(sbx) >= at_pause


def test_a_server_restart_while_paused(server, runtime, mem_sbx):
    sbx = mem_sbx
    sbx.exec(COUNTER)
    sbx.files.write("/workspace/restart.txt", "kept")
    before = wait_counter_above(sbx, 2)
    sbx.pause()
    server.restart()
    assert runtime.sandboxes.get(sbx.id).state == "paused"
    again = runtime.sandboxes.get(sbx.id)
    again.wake()
    assert again.state == "running" and again.id == sbx.id
    after = counter(again)
    # The memory-only counter went on from where it was.
    assert after >= before, (before, after)
    assert wait_counter_above(again, after) > after
    assert again.files.read("/workspace/restart.txt") == b"kept"


def test_a_persistent_sandbox_restarts_with_its_files(server, runtime):
    sbx = Sandbox.create(persistent=True, **SHAPE)
    try:
        sbx.files.write("/workspace/persist.txt", "on the disk")
        boot_id = sbx.exec("cat /proc/sys/kernel/random/boot_id").stdout
        sbx.stop()
        assert sbx.state == "stopped"
        sbx.restart()
        assert sbx.state == "running"
        assert runtime.sandboxes.get(sbx.id).state == "running"
        assert sbx.files.read("/workspace/persist.txt") == b"on the disk"
        # A fresh boot of the same files.
        assert sbx.exec("cat /proc/sys/kernel/random/boot_id").stdout != boot_id
    finally:
        sbx.delete()
    with Sandbox.create(**SHAPE) as plain:
        plain.stop()
        with pytest.raises(ConflictError) as caught:
            plain.restart()
        assert caught.value.code == "not_persistent"


def test_fork_copies_memory_and_files_that_then_diverge(server, runtime, mem_sbx):
    sbx = mem_sbx
    sbx.exec(COUNTER)
    sbx.files.write("/workspace/shared.txt", "before the fork")
    at_fork = wait_counter_above(sbx, 2)
    copies = sbx.fork(count=2)
    try:
        assert len(copies) == 2
        ids = {c.id for c in copies}
        assert sbx.id not in ids and len(ids) == 2
        assert runtime.sandboxes.get(sbx.id).state == "running"
        for i, copy in enumerate(copies):
            assert copy.state == "running"
            assert copy.files.read("/workspace/shared.txt") == b"before the fork"
            # The counter process came along with its memory and goes on.
            value = counter(copy)
            assert value >= at_fork, (at_fork, value)
            assert wait_counter_above(copy, value) > value
            copy.files.write("/workspace/mine.txt", f"copy {i}")
        sbx.files.write("/workspace/mine.txt", "source")
        assert copies[0].files.read("/workspace/mine.txt") == b"copy 0"
        assert copies[1].files.read("/workspace/mine.txt") == b"copy 1"
        assert sbx.files.read("/workspace/mine.txt") == b"source"
        # Processes diverge too: ending the counter in one copy leaves the others counting.
        copies[0].exec("pkill -f c.new; sleep 0.5")
        stopped = counter(copies[0])
        time.sleep(1)
        assert counter(copies[0]) == stopped
        for other in (copies[1], sbx):
            value = counter(other)
            assert wait_counter_above(other, value) > value
    finally:
        for copy in copies:
            try:
                copy.delete()
            except Exception:  # noqa: BLE001
                pass


def test_snapshot_then_create_from_it(server, runtime, mem_sbx):
    sbx = mem_sbx
    sbx.exec(COUNTER)
    sbx.files.write("/workspace/snap.txt", "in the snapshot")
    at_snapshot = wait_counter_above(sbx, 2)
    snap = sbx.snapshot(name="e2e-memory")
    assert snap["state"] == "ready" and snap["mode"] == "memory", snap
    assert runtime.snapshots.get(snap["id"])["state"] == "ready"
    assert any(s["id"] == snap["id"] for s in runtime.snapshots.list(sandbox_id=sbx.id))
    assert runtime.sandboxes.get(sbx.id).state == "running"
    with Sandbox.create(snapshot=snap["id"]) as restored:
        assert restored.state == "running"
        assert (restored.info["vcpu"], restored.info["memoryMiB"]) == (1, 1024)
        assert restored.files.read("/workspace/snap.txt") == b"in the snapshot"
        value = counter(restored)
        assert value >= at_snapshot
        assert wait_counter_above(restored, value) > value
    runtime.snapshots.delete(snap["id"])


def test_async_pause_wake_and_fork(server):
    async def scenario():
        async with AsyncRuntime() as rt:
            sbx = await rt.sandboxes.create(**SHAPE)
            async with sbx:
                await sbx.exec(COUNTER)
                await asyncio.sleep(1)
                before = int((await sbx.exec("cat /tmp/c")).stdout)
                await sbx.pause()
                assert sbx.state == "paused"
                await sbx.wake()
                assert sbx.state == "running"
                after = int((await sbx.exec("cat /tmp/c")).stdout)
                assert after >= before
                copy = await sbx.fork()
                async with copy:
                    assert copy.state == "running" and copy.id != sbx.id
                    assert int((await copy.exec("cat /tmp/c")).stdout) >= after

    asyncio.run(scenario())


def test_retention_dates_the_deletion_of_a_paused_sandbox(server):
    from datetime import datetime
    with Sandbox.create() as s:
        s.set_retention(3)
        assert s.refresh().state == "running"
        s.pause()
        assert s.refresh().state == "paused"
        info = server_get(server, s.id)
        paused = datetime.fromisoformat(info["pausedAt"].replace("Z", "+00:00"))
        expires = datetime.fromisoformat(info["pausedExpiresAt"].replace("Z", "+00:00"))
        assert (expires - paused).total_seconds() == 3 * 86400, info


def server_get(server, sandbox_id: str) -> dict:
    import json
    import urllib.request
    req = urllib.request.Request(f"{server.url}/v1/sandboxes/{sandbox_id}",
                                 headers={"Authorization": f"Bearer {server.admin_key()}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def clock_lag(sbx) -> tuple[float, float]:
    """How far the guest's clock is behind the host's (seconds), and the
    uncertainty of that reading (half the exec's round trip)."""
    before = time.time()
    r = sbx.exec("date +%s.%N")
    after = time.time()
    assert r.exit_code == 0, r
    return (before + after) / 2 - float(r.stdout), (after - before) / 2


def assert_clock_right(sbx, when: str) -> None:
    lag, slack = clock_lag(sbx)
    assert abs(lag) <= 1.0 + slack, f"{when}: the guest's clock is {lag:.3f} s behind the host's"


def test_the_clock_is_right_after_a_minute_paused_and_after_a_snapshot(server, runtime, mem_sbx):
    sbx = mem_sbx
    assert_clock_right(sbx, "after the create")
    sbx.pause()
    time.sleep(60)
    sbx.wake()
    assert_clock_right(sbx, "after a minute paused")
    # A snapshot stops the vCPUs while it copies the memory and the disk
    # (made bigger here, so the stop is long enough to show).
    assert sbx.exec("dd if=/dev/zero of=/workspace/fill bs=1M count=256 status=none && sync",
                    timeout_ms=120_000).exit_code == 0
    snap = sbx.snapshot(name="e2e-clock")
    try:
        assert_clock_right(sbx, "after a snapshot of the running sandbox")
        with Sandbox.create(snapshot=snap["id"]) as restored:
            assert_clock_right(restored, "in a sandbox made from the snapshot")
    finally:
        runtime.snapshots.delete(snap["id"])


def _lines_after(proc, cursor: int, count: int) -> list[str]:
    """The next `count` whole lines the process prints from `cursor` on."""
    text = ""
    for event in proc.output(cursor, timeout_seconds=30):
        if event["type"] == "stdout":
            text += event["data"]
            if text.count("\n") >= count:
                break
    return text.splitlines()[:count]


def test_the_copies_of_a_sandbox_carry_its_running_processes(runtime, mem_sbx):
    sbx = mem_sbx
    ticker = sbx.spawn("i=0; while :; do i=$((i+1)); echo tick-$i; sleep 0.2; done")
    assert _lines_after(ticker, 0, 2) == ["tick-1", "tick-2"]
    copy = sbx.fork()
    snap = None
    try:
        carried = copy.process(ticker.id)
        assert carried.info["state"] == "running", carried.info
        assert carried.info["command"] == ticker.info["command"]
        # Its output goes on in the copy from where the capture left it.
        ticks = _lines_after(carried, carried.info.get("outputBytes", 0) or 0, 2)
        assert all(t.startswith("tick-") for t in ticks), ticks
        assert int(ticks[0][5:]) > 2, ticks
        # Ended in the copy, it runs on in the source.
        carried.kill("SIGKILL")
        carried.wait()
        assert copy.process(ticker.id).info["state"] == "exited"
        assert sbx.process(ticker.id).info["state"] == "running"
        # A memory snapshot carries it too, into a create from it.
        snap = sbx.snapshot(name="e2e-carried")
        assert snap["state"] == "ready", snap
        with Sandbox.create(snapshot=snap["id"]) as restored:
            again = restored.process(ticker.id)
            assert again.info["state"] == "running", again.info
            more = _lines_after(again, again.info.get("outputBytes", 0) or 0, 1)
            assert more and more[0].startswith("tick-"), more
        with pytest.raises(NotFoundError):
            copy.process("proc_" + "0" * 32)
    finally:
        copy.delete()
        if snap is not None:
            runtime.snapshots.delete(snap["id"])
