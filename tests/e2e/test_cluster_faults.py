"""Faults of a deployment of two nodes on one PostgreSQL store (issue 17's
"Failure"): a host killed with SIGKILL in the middle of a create it was
carried, a control plane killed in the middle of a stream it carried,
everything (both nodes and the database) killed and started again, and a
node cut from the store while its machines run. After each, the records
are true (what is `running` runs, what is `stopped` has no machine),
nothing the client was told about is lost, and a resend acts once.

The nodes: H, the host, reaches the store through a relay of this module
(`StoreLink`) that the test cuts and mends; C, a control plane, keeps more
memory free than any machine has (`--reserve-memory-mib`), so every create
it takes is carried to H. The client holds one API key for both."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from pathlib import Path

import pytest

from conftest import Server, free_port, qemu_gone
from conftest import http as request_of
from pg_cluster import Cluster, came_back, host_cli, host_state, node_of

LABELS = {"suite": "e2e-cluster-faults"}


class StoreLink:
    """A TCP relay from one node to PostgreSQL. `cut` ends every
    connection through it and refuses new ones (the node's store calls fail
    at once, as when the database's machine refuses it); `mend` listens
    again on the same port."""

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.port = free_port()
        self.lock = threading.Lock()
        self.open: list[socket.socket] = []
        self.listener: socket.socket | None = None
        self.mend()

    def mend(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                near, _ = listener.accept()
            except OSError:
                return
            try:
                far = socket.create_connection(self.target, timeout=5)
                far.settimeout(None)
            except OSError:
                near.close()
                continue
            with self.lock:
                self.open += [near, far]
            for a, b in ((near, far), (far, near)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        assert self.listener is not None
        listener, self.listener = self.listener, None
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        with self.lock:
            cut, self.open = self.open, []
        for s in cut:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def url_for(self, cluster: Cluster) -> str:
        """The store URL that reaches `cluster` through this link."""
        return cluster.url.replace(f":{cluster.port}/", f":{self.port}/")


@pytest.fixture(scope="module")
def two_nodes():
    root = Path(tempfile.mkdtemp(prefix="runtime-e2e-faults-"))
    os.chmod(root, 0o711)
    (root / "pg").mkdir()
    cluster = Cluster(root / "pg")
    link = StoreLink(cluster.port)
    (root / "c").mkdir()
    (root / "h").mkdir()
    # C has room for nothing: what it takes is carried to H.
    c = Server(root / "c", ("--store", cluster.url, "--reserve-memory-mib", "100000000"))
    h = Server(root / "h", ("--store", link.url_for(cluster)))
    try:
        c.start()
        h.data_dir.mkdir()
        shutil.copy2(c.data_dir / "secrets.key", h.data_dir / "secrets.key")
        h.start()
        yield h, c, cluster, link
    finally:
        for srv in (h, c):
            if srv.proc is not None:
                srv.delete_all_sandboxes()
        for srv in (c, h):
            srv.stop()
            srv.egress.close()
            srv.kill_leftover_qemu()
        cluster.stop()
        if not os.environ.get("RUNTIME_E2E_KEEP"):
            shutil.rmtree(root, ignore_errors=True)


def runtime_at(srv: Server, key: str, **kwargs):
    from withruntime import Runtime
    return Runtime(api_key=key, base_url=srv.url, **kwargs)


def node_in_store(cluster: Cluster, sandbox_id: str) -> str:
    return cluster.psql(f"SELECT node FROM sandboxes WHERE id = '{sandbox_id}'")


def records_are_true(cluster: Cluster, h: Server) -> list[str]:
    """Every sandbox of this module's that the store says runs has a
    machine on H, and every other has none. Answers the running ones."""
    rows = cluster.psql("SELECT id, state FROM sandboxes WHERE deleted IS NULL "
                        "AND record LIKE '%e2e-cluster-faults%' ORDER BY id")
    running = []
    for line in filter(None, rows.splitlines()):
        sandbox_id, state = line.split("|")
        assert state in ("running", "stopped", "paused"), f"{sandbox_id} left {state}"
        if state == "running":
            assert h.qemu_pids(sandbox_id), f"{sandbox_id} is recorded running without a machine"
            running.append(sandbox_id)
        else:
            assert qemu_gone(h, sandbox_id), f"{sandbox_id} is recorded {state} and its machine runs"
    return running


def takes_creates(cluster: Cluster, srv: Server, timeout: float = 60) -> None:
    """Waits until `runtime host list` shows `srv`'s node ready with room
    for a machine: its peers place creates on it from then on."""
    deadline = time.monotonic() + timeout
    while True:
        listed = host_cli(cluster, "list")
        row = next((line.split() for line in listed.splitlines() if line.startswith(node_of(srv))), None)
        if row is not None and row[4] == "ready" and int(row[3]) >= 1024:
            return
        assert time.monotonic() < deadline, listed
        time.sleep(0.5)


def test_a_create_carried_to_a_host_that_dies_before_answering_is_made_once(two_nodes):
    """C carries the create to H, which makes the sandbox and dies (SIGKILL)
    before it answers; a resend while H is down makes nothing elsewhere;
    H back, the resend through C answers the sandbox H made, and no second
    one exists."""
    from withruntime import RuntimeError as ClientError

    h, c, cluster, _ = two_nodes
    key = c.admin_key()
    h.stop()
    h.extra_args = [*h.extra_args, "--test-crash-at", "create_answer"]
    try:
        h.start()
    finally:
        h.extra_args = h.extra_args[:-2]
    proc = h.proc
    assert proc is not None
    takes_creates(cluster, h)
    with runtime_at(c, key, max_retries=0, wait_for_capacity=0) as rc:
        with pytest.raises(ClientError) as cut:
            rc.sandboxes.create(labels=LABELS, idempotency_key="faults-carried-1")
        assert cut.value.code == "host_unavailable", cut.value
        proc.wait(120)
        assert proc.returncode == -signal.SIGKILL, f"H ended with {proc.returncode}, not at its crash point"
        h.proc = None
        # H down: the resend names the sandbox H made (recorded before H
        # died) or says its host is away; nothing is made anywhere else.
        try:
            early = rc.sandboxes.create(labels=LABELS, idempotency_key="faults-carried-1").id
        except ClientError as refused:
            assert refused.code in ("no_capacity", "host_unavailable"), refused
            early = None

        h.start()
        takes_creates(cluster, h)
        sbx = rc.sandboxes.create(labels=LABELS, idempotency_key="faults-carried-1")
        assert early in (None, sbx.id)
        made = [s.id for s in rc.sandboxes.list(labels=LABELS, include_stopped=True)]
        assert made == [sbx.id], made
        assert node_in_store(cluster, sbx.id) == node_of(h)
        assert sbx.exec("echo once").stdout == "once\n"
        assert records_are_true(cluster, h) == [sbx.id]
        rc.sandboxes.delete(sbx.id)


def test_a_control_plane_killed_mid_stream_leaves_every_command_running_and_everything_restarts(two_nodes):
    """Two commands stream their output from one sandbox on H, one through
    C (carried) and one through H itself. C dies (SIGKILL) while both run:
    the stream through H goes on to its end, and so does the command C
    carried, on H; the client follows the cut stream again once C is back
    and gets every line once. Then H, C and the
    database all die at once and start again: the sandbox runs on with its
    files and processes' results, and every record is true."""
    h, c, cluster, _ = two_nodes
    key = c.admin_key()
    script = ("touch /tmp/{name}.started; for i in $(seq 1 40); do echo $i; sleep 0.1; done; "
              "echo done > /tmp/{name}.done")
    lines = "".join(f"{i}\n" for i in range(1, 41))
    with runtime_at(h, key) as rh, runtime_at(c, key) as rc:
        sbx = rh.sandboxes.create(labels=LABELS)
        through_c = rc.sandboxes.get(sbx.id)
        results: dict[str, object] = {}

        def run(name: str, handle) -> None:
            chunks: list[str] = []
            try:
                handle.exec(script.format(name=name), on_stdout=chunks.append, check=True)
                results[name] = "".join(chunks)
            except Exception as error:  # noqa: BLE001 - the cut stream's error is the result
                results[name] = error

        threads = [threading.Thread(target=run, args=("direct", sbx)),
                   threading.Thread(target=run, args=("carried", through_c))]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while sbx.exec("ls /tmp/direct.started /tmp/carried.started >/dev/null 2>&1 && echo both",
                       ).stdout != "both\n":
            assert time.monotonic() < deadline, results
            time.sleep(0.1)
        c.proc.send_signal(signal.SIGKILL)
        c.proc.wait(30)
        c.proc = None
        threads[0].join(120)
        assert results.get("direct") == lines, results
        # The command C carried runs on to its end on H, C still down.
        deadline = time.monotonic() + 30
        while sbx.exec("cat /tmp/carried.done 2>/dev/null").stdout != "done\n":
            assert time.monotonic() < deadline, "the command C carried did not run to its end"
            time.sleep(0.5)
        # The client follows the cut stream again from its cursor once C
        # is back: every line once.
        assert threads[1].is_alive(), results
        c.start()
        threads[1].join(120)
        assert results.get("carried") == lines, results

        # Everything dies at once: both nodes and the database.
        for srv in (h, c):
            srv.proc.send_signal(signal.SIGKILL)
            srv.proc.wait(30)
            srv.proc = None
        cluster.stop()
        cluster.start()
        h.start()
        c.start()
        again = rc.sandboxes.get(sbx.id)
        assert again.state == "running", again.info
        assert again.exec("cat /tmp/direct.done /tmp/carried.done").stdout == "done\ndone\n"
        assert sbx.id in records_are_true(cluster, h)
        rh.sandboxes.delete(sbx.id)


def test_a_node_cut_from_the_store_answers_at_once_is_held_lost_and_settles_when_it_is_back(two_nodes):
    """H's way to the store is cut while its machines run. H answers its
    callers at once (`503 store_unavailable`, retryable) instead of
    waiting; C holds it lost within `--host-lost-after` (30 s) and records
    its running sandboxes `stopped`/`host_lost`. The way mended, H settles
    what C recorded: its persistent sandbox runs again as it was (the
    machine never stopped), the other's machine ends, and H is `ready`."""
    from withruntime import RuntimeError as ClientError

    h, c, cluster, link = two_nodes
    key = c.admin_key()
    lost_after = 30
    with runtime_at(h, key) as rh, runtime_at(c, key, max_retries=0) as rc:
        kept = rh.sandboxes.create(labels=LABELS, persistent=True)
        plain = rh.sandboxes.create(labels=LABELS)
        kept.exec("echo before > /workspace/mark")
        assert h.qemu_pids(kept.id) and h.qemu_pids(plain.id)

        link.cut()
        cut_at = time.monotonic()
        asked = time.monotonic()
        answer = request_of(h, "GET", f"/v1/sandboxes/{kept.id}", key=key, timeout=60)
        assert time.monotonic() - asked < 30, "H waited on a store that does not answer"
        assert answer.status == 503, answer
        error = answer.json()["error"]
        assert error["code"] == "store_unavailable" and error["retryable"] is True, error

        while True:
            try:
                state = rc.sandboxes.get(kept.id)
            except ClientError as refused:  # carried to H, which cannot reach the store
                assert refused.code in ("store_unavailable", "host_unavailable"), refused
                state = None
            if state is not None and state.state == "stopped":
                break
            assert time.monotonic() - cut_at < lost_after + 25, "H was not held lost within its bound"
            time.sleep(1)
        assert state.info.get("stopReason") == "host_lost", state.info
        assert rc.sandboxes.get(plain.id).info.get("stopReason") == "host_lost"
        assert host_state(cluster, h) == "lost"
        # Cut from the store is not dead: its machines ran on meanwhile.
        assert h.qemu_pids(kept.id) and h.qemu_pids(plain.id)

        link.mend()
        came_back(rc, h, kept.id, plain.id)
        assert host_state(cluster, h) == "ready"
        assert kept.id in records_are_true(cluster, h)
        for s in (kept, plain):
            rc.sandboxes.delete(s.id)


def test_a_file_link_made_through_one_node_serves_through_the_other(two_nodes):
    """A file link is used without a key, at whichever node it reaches: C,
    which has no machine, carries it to the node of the link's sandbox
    (found in the store), for a download and an upload."""
    import urllib.request

    h, c, cluster, _ = two_nodes
    takes_creates(cluster, h)
    key = c.admin_key()
    with runtime_at(c, key) as rc:
        sbx = rc.sandboxes.create(labels=LABELS)
        assert node_in_store(cluster, sbx.id) == node_of(h)
        sbx.files.write("/workspace/digits", "0123456789")
        link = sbx.files.download_url("/workspace/digits", expires_in_seconds=300)
        assert link["url"].startswith(c.url), link
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(link["url"], timeout=60) as answer:
            assert (answer.status, answer.read()) == (200, b"0123456789")
        up = sbx.files.upload_url("/workspace/up.txt", expires_in_seconds=300)
        put = urllib.request.Request(up["url"], data=b"through C", method="PUT")
        with opener.open(put, timeout=60) as answer:
            assert answer.status == 200
        assert sbx.files.read("/workspace/up.txt") in ("through C", b"through C")
        rc.sandboxes.delete(sbx.id)


def test_a_secret_changed_through_one_node_reaches_sandboxes_on_the_other(two_nodes):
    """Secrets are the key's, not a sandbox's: one changed through C (which
    runs no machine) is used by H's egress proxy for H's running sandbox
    within a second, without the value ever reaching the guest."""
    import hashlib

    h, c, cluster, _ = two_nodes
    takes_creates(cluster, h)
    key = c.admin_key()
    value = "sk-e2e-" + hashlib.sha256(str(time.time()).encode()).hexdigest()[:24]
    with runtime_at(c, key) as rc:
        placeholder = rc.secrets.set("E2E_NODES", value=value + "-a", hosts=["api.example.org"])["placeholder"]
        try:
            sbx = rc.sandboxes.create(labels=LABELS)
            assert node_in_store(cluster, sbx.id) == node_of(h)

            def sent() -> str:
                out = sbx.exec('curl -sSf --max-time 30 -H "x-api-key: $E2E_NODES" https://api.example.org/echo')
                assert out.exit_code == 0 and value not in out.stdout, out.stdout + out.stderr
                return h.egress.seen[-1]["headers"]["x-api-key"]

            assert sent() == value + "-a"
            again = rc.secrets.set("E2E_NODES", value=value + "-b", hosts=["api.example.org"])
            assert again["placeholder"] == placeholder
            deadline = time.monotonic() + 10
            while (got := sent()) != value + "-b":
                assert got == value + "-a" and time.monotonic() < deadline, got
                time.sleep(0.5)
            rc.sandboxes.delete(sbx.id)
        finally:
            rc.secrets.delete("E2E_NODES")
