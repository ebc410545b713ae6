"""Leases and the awkward transitions, through the official client: lease
ends (`pause`, `stop`, `delete`) that fall while the server is down and are
applied when it returns, `:extend`, `:update`, a wake with a new lease,
`idlePauseSeconds`, two wakes at once, a delete while paused.

The API's floor for both `timeoutSeconds` and `idlePauseSeconds` is 60
seconds, so each test here waits about a minute."""
from __future__ import annotations

import threading
import time
from datetime import datetime

import pytest
from withruntime import NotFoundError, Sandbox

SHAPE = {"vcpu": 1, "memory_mib": 1024}


def at(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def test_leases_that_end_while_the_server_is_down_apply_on_its_return(server, runtime):
    paused = Sandbox.create(timeout_seconds=60, **SHAPE)  # onLeaseEnd: pause (default)
    stopped = Sandbox.create(timeout_seconds=60, on_lease_end="stop", **SHAPE)
    deleted = Sandbox.create(timeout_seconds=60, on_lease_end="delete", **SHAPE)
    kept = Sandbox.create(timeout_seconds=60, on_lease_end="delete", **SHAPE)
    for s in (paused, stopped, deleted, kept):
        assert s.state == "running", s.info
    assert paused.info["onLeaseEnd"] == "pause" and stopped.info["onLeaseEnd"] == "stop"
    paused.exec("echo 'in memory' > /tmp/m")

    # :extend moves the end; :update changes what happens then.
    before = at(kept.refresh().info["endsAt"])
    kept.extend(600)
    assert at(kept.info["endsAt"]) >= before + 590, (before, kept.info["endsAt"])
    kept.update(on_lease_end="delete")  # the create's name for it
    assert kept.refresh().info["onLeaseEnd"] == "delete"
    kept.update(on_timeout="stop")  # the contract's name for it
    assert kept.refresh().info["onLeaseEnd"] == "stop"

    ends = max(at(s.refresh().info["endsAt"]) for s in (paused, stopped, deleted))
    server.stop()
    time.sleep(max(0.0, ends - time.time()) + 2)
    server.start()

    # Applied as the server comes back (the first read may see `pausing`).
    assert Sandbox.connect(paused.id).wait_for("paused", 60).state == "paused"
    assert Sandbox.connect(stopped.id).wait_for("stopped", 60).state == "stopped"
    deadline = time.time() + 60
    while True:
        try:
            runtime.sandboxes.get(deleted.id)
        except NotFoundError:
            break
        assert time.time() < deadline, "a lease ending in delete left the sandbox"
        time.sleep(0.5)
    assert runtime.sandboxes.get(kept.id).state == "running"

    # A wake with its own lease: memory kept, a new end about that far off.
    woken = Sandbox.connect(paused.id)
    woken.wake(timeout_seconds=300)
    assert woken.state == "running" and woken.id == paused.id
    assert abs(at(woken.info["endsAt"]) - (time.time() + 300)) < 30, woken.info["endsAt"]
    assert woken.exec("cat /tmp/m").stdout == "in memory\n"
    for s in (woken, kept):
        s.delete()
    runtime.sandboxes.get(stopped.id).delete()


def test_idle_pause_then_two_wakes_at_once_then_a_delete_while_paused(server, runtime):
    sbx = Sandbox.create(idle_pause_seconds=60, **SHAPE)
    sbx.exec("echo kept > /tmp/k")
    # No call touches it from here (reading its record is not activity).
    deadline = time.time() + 150
    while runtime.sandboxes.get(sbx.id).state != "paused":
        assert time.time() < deadline, "an idle sandbox did not pause itself"
        time.sleep(5)
    idle_for = time.time() - at(runtime.sandboxes.get(sbx.id).info["lastActiveAt"])
    assert idle_for >= 55, idle_for

    # Two wakes at once: both answer running, one machine, memory intact.
    results: list[object] = []

    def wake() -> None:
        try:
            results.append(Sandbox.connect(sbx.id).wake().state)
        except Exception as error:  # noqa: BLE001 - reported below
            results.append(error)

    threads = [threading.Thread(target=wake) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == ["running", "running"], results
    assert sbx.exec("cat /tmp/k").stdout == "kept\n"
    assert len(server.qemu_pids(sbx.id)) == 1

    # A delete while paused ends it for good: no record, no machine.
    sbx.pause()
    assert sbx.state == "paused"
    vm_dir = server.data_dir / "vms" / sbx.id
    assert (vm_dir / "paused.state").exists() and server.qemu_pids(sbx.id) == []
    sbx.delete()
    with pytest.raises(NotFoundError):
        runtime.sandboxes.get(sbx.id)
    deadline = time.time() + 10
    while vm_dir.exists() and time.time() < deadline:
        time.sleep(0.2)
    assert not vm_dir.exists(), "the paused machine's memory and disk are gone"
    assert server.qemu_pids(sbx.id) == []
