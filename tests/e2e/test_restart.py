"""A sandbox outlives a restart of the server: same id, its files, and a
background process still running."""
from __future__ import annotations


def test_sandbox_survives_server_restart(server, runtime):
    sbx = runtime.sandboxes.create(labels={"suite": "e2e-restart"})
    try:
        sbx.files.write("/workspace/keep.txt", "still here")
        proc = sbx.spawn("sleep 900")
        assert sbx.exec("pgrep -fx 'sleep 900' >/dev/null && echo running").stdout == "running\n"
        boot_id = sbx.exec("cat /proc/sys/kernel/random/boot_id").stdout

        server.restart()

        again = runtime.sandboxes.get(sbx.id)
        assert again.id == sbx.id
        assert again.state == "running", again.info
        assert sbx.id in [s.id for s in runtime.sandboxes.list(labels={"suite": "e2e-restart"})]
        assert again.files.read("/workspace/keep.txt") == b"still here"
        assert again.exec("pgrep -fx 'sleep 900' >/dev/null && echo running").stdout == "running\n"
        # The same boot, not a fresh VM on the same disk.
        assert again.exec("cat /proc/sys/kernel/random/boot_id").stdout == boot_id
        assert again.process(proc.id).state == "running"
    finally:
        runtime.sandboxes.delete(sbx.id)


def test_server_answers_after_restart(server, runtime):
    with runtime.sandboxes.create() as sbx:
        assert sbx.exec("echo after restart").stdout == "after restart\n"
