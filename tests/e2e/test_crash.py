"""Crashes tell the truth: the server is killed (SIGKILL) at an exact step
of a snapshot, a pause, a wake, a delete, an idempotent create, an image
build and a volume's attach, then started
again; every record is then true, nothing runs that no record owns, and a
resend acts once.

The step is hit by the hidden test-only flag `--test-crash-at POINT`, at
which `runtime serve` kills itself, so no timer races the emulated guest.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from conftest import client_for

CRASH_WAIT = 120.0


def start_with_crash_point(server, point: str) -> None:
    """Restarts the server so that it kills itself at `point`."""
    server.stop()
    server.extra_args = ["--test-crash-at", point]
    try:
        server.start()
    finally:
        server.extra_args = []


def crashes(server, action) -> set[int]:
    """Runs `action`, which the crash point cuts off, checks that the
    server died by SIGKILL there, and starts it again without the point.
    Answers the QEMU processes that ran while the server was down (before
    the restart settled them)."""
    proc = server.proc
    assert proc is not None
    with pytest.raises(Exception):
        action()
    proc.wait(CRASH_WAIT)
    assert proc.returncode == -signal.SIGKILL, f"the server ended with {proc.returncode}, not at its crash point"
    left = qemu_of(server)
    server.proc = None
    server.start()
    return left


def settled(runtime, sandbox_id: str, states: tuple[str, ...], timeout: float = 180):
    """The sandbox once its state is one of `states`."""
    deadline = time.monotonic() + timeout
    while True:
        sbx = runtime.sandboxes.get(sandbox_id)
        if sbx.state in states or time.monotonic() > deadline:
            return sbx
        time.sleep(0.5)


def boot_id(sbx) -> str:
    return sbx.exec("cat /proc/sys/kernel/random/boot_id").stdout


def test_a_snapshot_cut_short_fails_and_its_source_runs_on(server, runtime):
    start_with_crash_point(server, "capture_running")
    sbx = runtime.sandboxes.create(labels={"suite": "e2e-crash"})
    try:
        sbx.files.write("/workspace/kept.txt", "before the crash")
        booted = boot_id(sbx)
        with client_for(server, server.admin_key()) as once:
            source = once.sandboxes.get(sbx.id)
            crashes(server, lambda: source.snapshot(name="cut-short", timeout_seconds=120))

        snaps = list(runtime.snapshots.list(sandbox_id=sbx.id))
        assert [s["state"] for s in snaps] == ["failed"], snaps
        assert not (server.data_dir / "snapshots" / snaps[0]["id"]).exists(), "its partial capture is left"
        again = runtime.sandboxes.get(sbx.id)
        assert again.state == "running", again.info
        # The same machine, run on after the capture stopped it: not rebooted.
        assert boot_id(again) == booted
        assert again.files.read("/workspace/kept.txt") == b"before the crash"
        assert again.exec("echo usable").stdout == "usable\n"
    finally:
        runtime.sandboxes.delete(sbx.id)


@pytest.mark.parametrize("point", ["pause_capture", "pause_kept"])
def test_a_pause_cut_short_is_running_or_wakes(server, runtime, point):
    start_with_crash_point(server, point)
    sbx = runtime.sandboxes.create(labels={"suite": "e2e-crash"})
    try:
        sbx.files.write("/workspace/kept.txt", "before the crash")
        sbx.exec("echo in-memory > /tmp/mem.txt")
        booted = boot_id(sbx)
        with client_for(server, server.admin_key()) as once:
            source = once.sandboxes.get(sbx.id)
            crashes(server, lambda: source.pause())

        again = settled(runtime, sbx.id, ("running", "paused", "stopped"))
        assert again.state in ("running", "paused"), again.info
        if point == "pause_kept":
            # Its state was whole when the server died: a wakeable pause.
            assert again.state == "paused", again.info
        if again.state == "paused":
            again.wake()
        # Its memory is there, whichever way it went: not a fresh boot.
        assert boot_id(again) == booted
        assert again.exec("cat /tmp/mem.txt").stdout == "in-memory\n"
        assert again.files.read("/workspace/kept.txt") == b"before the crash"
    finally:
        runtime.sandboxes.delete(sbx.id)


def test_a_delete_cut_short_leaves_no_qemu(server, runtime):
    start_with_crash_point(server, "delete_destroy")
    sbx = runtime.sandboxes.create(labels={"suite": "e2e-crash"})
    assert server.qemu_pids(sbx.id), "no QEMU to begin with"
    with client_for(server, server.admin_key()) as once:
        crashes(server, lambda: once.sandboxes.delete(sbx.id))

    # Answered once recovery is over.
    assert sbx.id not in [s.id for s in runtime.sandboxes.list(include_stopped=True)]
    left = subprocess.run(["pgrep", "-af", sbx.id], capture_output=True, text=True, timeout=30)
    assert left.returncode == 1, f"still running for the deleted sandbox:\n{left.stdout}"
    assert not (server.data_dir / "vms" / sbx.id).exists(), "its VM directory is left"


def test_an_idempotent_create_cut_short_makes_one_sandbox(server, runtime):
    labels = {"suite": "e2e-crash-idempotent"}
    key = "crash-create-1"
    start_with_crash_point(server, "create_answer")
    with client_for(server, server.admin_key()) as once:
        crashes(server, lambda: once.sandboxes.create(labels=labels, idempotency_key=key))

    sbx = runtime.sandboxes.create(labels=labels, idempotency_key=key)
    try:
        made = list(runtime.sandboxes.list(labels=labels, include_stopped=True))
        assert [s.id for s in made] == [sbx.id], [s.info for s in made]
        assert settled(runtime, sbx.id, ("running",)).state == "running"
        assert sbx.exec("echo once").stdout == "once\n"
    finally:
        for s in runtime.sandboxes.list(labels=labels, include_stopped=True):
            runtime.sandboxes.delete(s.id)


def test_a_start_cut_short_after_its_machine_is_up_still_runs_the_images_start_command(server, runtime):
    image = runtime.images.build(name="e2e-crash-start", recipe={"commands": ["touch built"]},
                                 start={"command": "echo started > /tmp/start-ran; exec sleep 600"},
                                 poll_seconds=0.5)
    assert image["state"] == "ready", image
    labels = {"suite": "e2e-crash-start"}
    start_with_crash_point(server, "machine_up")
    with client_for(server, server.admin_key()) as once:
        crashes(server, lambda: once.sandboxes.create(image="e2e-crash-start", labels=labels))
    made = list(runtime.sandboxes.list(labels=labels, include_stopped=True))
    assert len(made) == 1, [s.info for s in made]
    sbx = made[0]
    try:
        # Its machine was up when the server went: it runs, and the
        # image's start command runs in it once, as in any new sandbox.
        assert settled(runtime, sbx.id, ("running",)).state == "running"
        deadline = time.monotonic() + 60
        out = ""
        while time.monotonic() < deadline and not out:
            out = sbx.exec("cat /tmp/start-ran 2>/dev/null || true").stdout
            time.sleep(0.5)
        assert out == "started\n"
        commands = [p["command"] for p in sbx.processes()]
        assert sum("sleep 600" in c for c in commands) == 1, commands
    finally:
        runtime.sandboxes.delete(sbx.id)
        runtime.images.delete(image["id"])


def test_an_idempotent_fork_and_snapshot_cut_short_act_once(server, runtime):
    labels = {"suite": "e2e-crash-idempotent-copy"}
    sbx = runtime.sandboxes.create(labels=labels)
    try:
        sbx.files.write("/workspace/copied.txt", "in every copy")
        # The fork: the server dies once its copies are recorded, before it answers.
        start_with_crash_point(server, "fork_answer")
        with client_for(server, server.admin_key()) as once:
            source = once.sandboxes.get(sbx.id)
            crashes(server, lambda: source.fork(count=2, idempotency_key="crash-fork-1"))
        copies = runtime.sandboxes.get(sbx.id).fork(count=2, idempotency_key="crash-fork-1")
        made = [s for s in runtime.sandboxes.list(labels=labels, include_stopped=True) if s.id != sbx.id]
        assert sorted(c.id for c in copies) == sorted(s.id for s in made), [s.info for s in made]
        assert len(made) == 2
        # The copies the crash cut short are failed starts, never running with no machine.
        for c in made:
            assert settled(runtime, c.id, ("running", "stopped")).state in ("running", "stopped")

        # The snapshot: likewise.
        start_with_crash_point(server, "snapshot_answer")
        with client_for(server, server.admin_key()) as once:
            source = once.sandboxes.get(sbx.id)
            crashes(server, lambda: source.snapshot(name="once", idempotency_key="crash-snap-1"))
        snap = runtime.sandboxes.get(sbx.id).snapshot(name="once", idempotency_key="crash-snap-1")
        snaps = list(runtime.snapshots.list(sandbox_id=sbx.id))
        assert [s["id"] for s in snaps] == [snap["id"]], snaps
        assert snap["state"] in ("ready", "failed", "capturing"), snap
    finally:
        for s in runtime.sandboxes.list(labels=labels, include_stopped=True):
            runtime.sandboxes.delete(s.id)
        for s in runtime.snapshots.list(sandbox_id=sbx.id):
            runtime.snapshots.delete(s["id"])


def qemu_of(server) -> set[int]:
    """Every live QEMU of this server's data dir."""
    return {pid for pid in server.qemu_pids("")}


def unowned(server, runtime, pids: set[int]) -> list[str]:
    """Those of `pids` still running that no live sandbox owns."""
    live = [s.id for s in runtime.sandboxes.list(include_stopped=True) if s.state != "stopped"]
    owned = {pid for sid in live for pid in server.qemu_pids(sid)}
    return [" ".join(_cmdline(p))[:300] for p in sorted(pids - owned) if p in qemu_of(server)]


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def test_a_wake_cut_short_runs_with_its_memory_and_no_state_left(server, runtime):
    sbx = runtime.sandboxes.create(labels={"suite": "e2e-crash"})
    try:
        sbx.exec("echo in-memory > /tmp/mem.txt")
        booted = boot_id(sbx)
        sbx.pause()
        state = server.data_dir / "vms" / sbx.id / "paused.state"
        assert state.is_file(), "no paused state to wake from"
        # The server dies once the woken machine is registered, before the
        # state it woke from is removed.
        start_with_crash_point(server, "wake_running")
        with client_for(server, server.admin_key()) as once:
            left = crashes(server, lambda: once.sandboxes.get(sbx.id).wake())

        again = settled(runtime, sbx.id, ("running", "paused", "stopped"))
        assert again.state == "running", again.info
        assert boot_id(again) == booted
        assert again.exec("cat /tmp/mem.txt").stdout == "in-memory\n"
        # A running machine keeps no state to wake from (a second wake from
        # it would take the sandbox back in time).
        assert not state.exists(), "the woken machine's old state is left"
        assert len(server.qemu_pids(sbx.id)) == 1
        assert unowned(server, runtime, left) == []
        again.pause()
        again.wake()
        assert again.exec("cat /tmp/mem.txt").stdout == "in-memory\n"
    finally:
        runtime.sandboxes.delete(sbx.id)


def test_an_image_build_cut_short_fails_ends_its_machine_and_builds_again(server, runtime):
    recipe = {"commands": ["sudo sh -c 'echo built > /etc/crash-built'"]}
    start_with_crash_point(server, "build_step")
    with client_for(server, server.admin_key()) as once:
        left = crashes(
            server, lambda: once.images.build(name="e2e-crash-build", recipe=recipe, poll_seconds=0.5))
    assert left, "no build machine was running when the server died"

    made = runtime.images.list(name="e2e-crash-build").data
    assert len(made) == 1, made
    image = made[0]
    assert image["state"] == "failed", image
    assert "restarted during the build" in (image.get("error") or ""), image
    # Its build machine is gone with everything else no record owns.
    assert unowned(server, runtime, left) == []
    again = runtime.images.build(name="e2e-crash-build", recipe=recipe, poll_seconds=0.5)
    assert again["state"] == "ready", again
    sbx = runtime.sandboxes.create(image="e2e-crash-build")
    try:
        assert sbx.exec("cat /etc/crash-built").stdout == "built\n"
    finally:
        runtime.sandboxes.delete(sbx.id)
        for i in runtime.images.list(name="e2e-crash-build").data:
            runtime.images.delete(i["id"])


def test_a_volume_attach_cut_short_is_undone_and_attaches_again(server, runtime):
    sbx = runtime.sandboxes.create(labels={"suite": "e2e-crash"})
    volume = runtime.volumes.create(16, name="e2e-crash-attach", shared=True)
    vid = volume["id"]
    try:
        # The server dies once the guest has mounted the share, before the
        # attachment is recorded as attached.
        start_with_crash_point(server, "attach_served")
        with client_for(server, server.admin_key()) as once:
            crashes(server, lambda: once.volumes.attach(vid, sbx.id, "/mnt/cut"))

        # Undone: no attachment, no mount in the guest, no 9P server.
        assert runtime.volumes.get(vid)["attachments"] == []
        again = runtime.sandboxes.get(sbx.id)
        assert again.state == "running", again.info
        assert again.exec("grep -c ' /mnt/cut ' /proc/mounts || true").stdout.strip() == "0"
        servers = [p for p in (int(x) for x in os.listdir("/proc") if x.isdigit())
                   if "9p-serve" in _cmdline(p) and f"{vid}.d" in " ".join(_cmdline(p))]
        assert servers == [], "a 9P server of the volume is left"
        # The same attach then works, once.
        at = runtime.volumes.attach(vid, sbx.id, "/mnt/cut")
        assert at["state"] == "attached", at
        assert again.exec("echo through > /mnt/cut/f && cat /mnt/cut/f").stdout == "through\n"
        assert [a["id"] for a in runtime.volumes.get(vid)["attachments"]] == [at["id"]]
        runtime.volumes.detach(vid, at["id"])
    finally:
        runtime.sandboxes.delete(sbx.id)
        runtime.volumes.delete(vid)
