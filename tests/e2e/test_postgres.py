"""The store on PostgreSQL: a server of this module's own started with
`--store postgres://...` against a throwaway cluster the module starts
(initdb into a temp dir, pg_ctl on a free port; as root the cluster runs as
`nobody`). The official client creates a sandbox and runs a command; the
server restarts and finds the sandbox again; the records are in the
database, not in a `runtime.db`. Without PostgreSQL's binaries the module
fails in CI and skips elsewhere (scripts/host-packages.sh installs them)."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import BINARY, Server, free_port
from conftest import http as request_of
from pg_cluster import Cluster, another_node, came_back, host_cli, host_state, node_of


@pytest.fixture(scope="module")
def on_pg():
    root = Path(tempfile.mkdtemp(prefix="runtime-e2e-pg-"))
    os.chmod(root, 0o711)
    pg_root = root / "pg"
    pg_root.mkdir()
    cluster = Cluster(pg_root)
    srv = Server(root, ("--store", cluster.url))
    try:
        srv.start()
        yield srv, cluster
    finally:
        srv.shut_down()
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_a_sandbox_on_a_postgres_store_outlives_a_restart(on_pg):
    from withruntime import Runtime

    srv, cluster = on_pg
    # The store is the database: no SQLite file in the data directory.
    assert not (srv.data_dir / "runtime.db").exists()
    assert cluster.psql("SELECT version FROM schema_version") != ""
    with Runtime(api_key=srv.admin_key(), base_url=srv.url) as rt:
        sbx = rt.sandboxes.create(labels={"suite": "e2e-pg"})
        try:
            assert sbx.exec("echo on postgres").stdout == "on postgres\n"
            sbx.files.write("/workspace/keep.txt", "kept")
            assert cluster.psql(f"SELECT state FROM sandboxes WHERE id = '{sbx.id}'") == "running"
            # A key made by `runtime keys create --store` works on the server.
            out = subprocess.run([str(BINARY), "keys", "create", "--data-dir", str(srv.data_dir),
                                  "--store", cluster.url, "--name", "pg-cli"],
                                 check=True, capture_output=True, text=True, timeout=60,
                                 stdin=subprocess.DEVNULL)
            other = out.stdout.strip()
            with Runtime(api_key=other, base_url=srv.url, max_retries=0) as rt2:
                # Accepted (not 401), and it sees only its own sandboxes.
                assert [s.id for s in rt2.sandboxes.list()] == []

            srv.restart()

            again = rt.sandboxes.get(sbx.id)
            assert again.state == "running", again.info
            assert sbx.id in [s.id for s in rt.sandboxes.list(labels={"suite": "e2e-pg"})]
            assert again.exec("cat /workspace/keep.txt").stdout == "kept"
        finally:
            rt.sandboxes.delete(sbx.id)
    assert cluster.psql(f"SELECT deleted IS NOT NULL FROM sandboxes WHERE id = '{sbx.id}'") == "t"


def test_a_store_url_that_does_not_answer_stops_serve_naming_it_without_its_password(tmp_path):
    port = free_port()
    out = subprocess.run([str(BINARY), "serve", "--listen", f"127.0.0.1:{free_port()}",
                          "--data-dir", str(tmp_path / "data"),
                          "--store", f"postgres://me:hunter2@127.0.0.1:{port}/runtime"],
                         capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode != 0
    assert f"postgres://me:***@127.0.0.1:{port}/runtime" in out.stderr, out.stderr
    assert "hunter2" not in out.stderr + out.stdout


def test_two_control_planes_on_one_store_serve_each_others_sandboxes(on_pg):
    """Two `runtime serve` on one database, each with its own data directory
    and machines: the client through either reaches every sandbox (exec,
    files, a streamed command, a terminal's WebSocket, a preview), each
    node acts only on its own machines, one holds the housekeeping lease,
    and a node that is down is said plainly by the other."""
    import http.client
    import time

    from withruntime import Runtime, RuntimeError as ClientError

    a, cluster = on_pg
    b = another_node(a, cluster, "runtime-e2e-pg-b-")
    root_b = b.root
    b.start()
    key = a.admin_key()
    try:
        with Runtime(api_key=key, base_url=a.url) as ra, \
                Runtime(api_key=key, base_url=b.url, max_retries=0) as rb:
            on_a = ra.sandboxes.create(labels={"suite": "e2e-pg-nodes"})
            on_b = rb.sandboxes.create(labels={"suite": "e2e-pg-nodes"})
            # Each create ran on the node it reached: its machine is there.
            assert cluster.psql(f"SELECT node FROM sandboxes WHERE id = '{on_a.id}'") == node_of(a)
            assert cluster.psql(f"SELECT node FROM sandboxes WHERE id = '{on_b.id}'") == node_of(b)
            assert a.qemu_pids(on_a.id) and not b.qemu_pids(on_a.id)
            assert b.qemu_pids(on_b.id) and not a.qemu_pids(on_b.id)
            assert set(cluster.psql("SELECT url FROM nodes ORDER BY url").split("\n")) == {a.url, b.url}

            # Through B, A's sandbox: record, exec, files, a streamed command.
            via_b = rb.sandboxes.get(on_a.id)
            assert via_b.state == "running"
            via_b.files.write("/workspace/from-b.txt", "written through b")
            assert on_a.exec("cat /workspace/from-b.txt").stdout == "written through b"
            chunks: list[str] = []
            out = via_b.exec("for i in 1 2 3; do echo line$i; sleep 0.2; done",
                             on_stdout=chunks.append)
            assert out.stdout == "line1\nline2\nline3\n" and "".join(chunks) == out.stdout
            # A terminal is a WebSocket: the upgrade is carried too.
            term = via_b.terminal(cols=90, rows=20)
            term.write("echo term-$((40+2)); exit 4\n")
            seen = b""
            while (chunk := term.recv()) is not None:
                seen += chunk
            assert b"term-42" in seen and term.exit_code == 4, seen
            # And the other way: A carries to B's sandbox.
            assert ra.sandboxes.get(on_b.id).exec("echo from a").stdout == "from a\n"

            # A preview of A's sandbox, asked of B by its host name.
            on_a.files.write("/tmp/site/index.html", "preview through b\n")
            on_a.spawn("cd /tmp/site && python3 -m http.server 8000")
            preview = on_a.previews.create(8000, visibility="public")
            host = f"8000-{on_a.id}.localhost:{b.port}"
            deadline = time.monotonic() + 60
            while True:
                c = http.client.HTTPConnection("127.0.0.1", b.port, timeout=60)
                c.request("GET", "/index.html", headers={"Host": host})
                r = c.getresponse()
                body = r.read()
                c.close()
                if r.status == 200 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert (r.status, body) == (200, b"preview through b\n"), (preview, r.status, body)

            # A fork and a snapshot asked of B are made where the source runs
            # (A), and so is a create from that snapshot or from an image A built.
            snap = via_b.snapshot(name="e2e-pg-nodes")
            assert snap["state"] == "ready", snap
            from_snap = rb.sandboxes.create(snapshot=snap["id"])
            forks = via_b.fork(count=1)
            image = ra.images.build(name="e2e-pg-nodes",
                                    dockerfile="FROM runtime\nRUN echo built on a > /srv/built.txt\n",
                                    poll_seconds=0.5)
            assert image["state"] == "ready", image
            from_image = rb.sandboxes.create(image="e2e-pg-nodes")
            for made in [from_snap, *forks, from_image]:
                assert cluster.psql(f"SELECT node FROM sandboxes WHERE id = '{made.id}'") == node_of(a), made.id
                assert a.qemu_pids(made.id) and not b.qemu_pids(made.id), made.id
            assert from_snap.files.read("/workspace/from-b.txt") == b"written through b"
            assert from_image.exec("cat /srv/built.txt").stdout == "built on a\n"
            for made in [from_snap, *forks, from_image]:
                rb.sandboxes.delete(made.id)

            # Every node lists every sandbox; one node holds the housekeeping lease.
            listed = {s.id for s in rb.sandboxes.list(labels={"suite": "e2e-pg-nodes"})}
            assert {on_a.id, on_b.id} <= listed
            assert cluster.psql("SELECT holder FROM leases WHERE name = 'housekeeping'") in \
                {node_of(a), node_of(b)}

            # One create sent to both nodes at once under one Idempotency-Key
            # is acted on once: the node that claimed it first makes the
            # sandbox, the other waits for that answer and replays it.
            import uuid
            from concurrent.futures import ThreadPoolExecutor
            once = {"Idempotency-Key": f"both-nodes-{uuid.uuid4()}", "Prefer": "wait=120"}
            label = {"suite": "e2e-pg-once"}
            with ThreadPoolExecutor(2) as pool:
                both = list(pool.map(lambda srv: request_of(srv, "POST", "/v1/sandboxes", {"labels": label},
                                                            key=key, headers=once), [a, b]))
            assert all(200 <= x.status < 300 for x in both), both
            made = {x.json()["id"] for x in both}
            assert len(made) == 1, f"two sandboxes for one request: {made}"
            assert [x.headers.get("idempotency-replayed") for x in both].count("true") == 1, both
            assert {s.id for s in ra.sandboxes.list(labels=label)} == made
            rb.sandboxes.delete(made.pop())

            # B's restart recovers B's machines only: A's sandbox stays running
            # (it would be `stopped`, host_lost, if B took it for its own).
            b.restart()
            assert ra.sandboxes.get(on_a.id).state == "running"
            assert on_a.exec("echo still").stdout == "still\n"
            assert rb.sandboxes.get(on_b.id).exec("echo b again").stdout == "b again\n"

            # B down: A says so for B's sandbox, naming B's node; back, it serves again.
            b.stop()
            with pytest.raises(ClientError) as down:
                with Runtime(api_key=key, base_url=a.url, max_retries=0) as ra0:
                    ra0.sandboxes.get(on_b.id)
            assert down.value.status == 503 and down.value.code == "host_unavailable", down.value
            assert node_of(b) in str(down.value), down.value
            assert on_a.exec("echo a unaffected").stdout == "a unaffected\n"
            b.start()
            assert ra.sandboxes.get(on_b.id).state == "running"
            rb.sandboxes.delete(on_a.id)
            ra.sandboxes.delete(on_b.id)
            assert cluster.psql(
                f"SELECT COUNT(*) FROM sandboxes WHERE id IN ('{on_a.id}', '{on_b.id}') AND deleted IS NULL") == "0"
            assert not a.qemu_pids(on_a.id) and not b.qemu_pids(on_b.id)
    finally:
        b.shut_down()
        shutil.rmtree(root_b, ignore_errors=True)


def test_a_node_with_another_secrets_key_is_refused_naming_the_file(on_pg):
    """Every node of one store seals secrets with one key: a node without
    the store's `secrets.key`, or with another, does not start."""
    a, cluster = on_pg
    root = Path(tempfile.mkdtemp(prefix="runtime-e2e-pg-keys-"))
    os.chmod(root, 0o711)
    try:
        lacking = Server(root / "lacking", ("--store", cluster.url))
        with pytest.raises(RuntimeError):
            lacking.start()
        said = lacking.log_path.read_text(errors="replace")
        assert "has no" in said and "secrets.key" in said and "copy" in said, said[-3000:]
        other = Server(root / "other", ("--store", cluster.url))
        other.data_dir.mkdir(parents=True)
        (other.data_dir / "secrets.key").write_bytes(os.urandom(32))
        os.chmod(other.data_dir / "secrets.key", 0o600)
        with pytest.raises(RuntimeError):
            other.start()
        said = other.log_path.read_text(errors="replace")
        assert "is not the key the store's secrets are sealed with" in said, said[-3000:]
        # Neither became a node of the store.
        assert cluster.psql("SELECT COUNT(*) FROM nodes WHERE url IN "
                            f"('{lacking.url}', '{other.url}')") == "0"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_creates_go_where_there_is_room_and_a_node_that_stays_away_is_noticed(on_pg):
    """Placement and failure across two nodes: a full node carries a create
    to one with room; a drained node takes none (and with no room anywhere
    the create is refused `no_capacity`); a node killed with SIGKILL is
    held lost within its bound and its sandboxes recorded
    `stopped`/`host_lost` by the other; back, its persistent sandbox runs
    again (its machine outlived the server) and the other's machine ends."""
    import signal
    import time

    from withruntime import Runtime, RuntimeError as ClientError

    a, cluster = on_pg
    # F keeps more memory free than any machine has: it has room for nothing.
    full = another_node(a, cluster, "runtime-e2e-pg-full-", "--reserve-memory-mib", "100000000")
    full.start()
    key = a.admin_key()
    lost_after = 30  # the default --host-lost-after; the lease holder's watch runs every 5 s
    try:
        with Runtime(api_key=key, base_url=full.url, max_retries=0, wait_for_capacity=0) as rf:
            placed = rf.sandboxes.create(labels={"suite": "e2e-pg-place"})
            assert cluster.psql(f"SELECT node FROM sandboxes WHERE id = '{placed.id}'") == node_of(a)
            assert placed.exec("echo placed").stdout == "placed\n"
            listed = host_cli(cluster, "list")
            row_full = next(line for line in listed.splitlines() if line.startswith(node_of(full)))
            assert row_full.split()[3] == "0", listed  # FREE MIB
            row_a = next(line for line in listed.splitlines() if line.startswith(node_of(a)))
            assert int(row_a.split()[3]) >= 1024 and row_a.split()[4] == "ready", listed

            # A drained: no node has room, through either of them.
            assert "drained" in host_cli(cluster, "drain", node_of(a))
            for url in (full.url, a.url):
                with Runtime(api_key=key, base_url=url, max_retries=0, wait_for_capacity=0) as r:
                    with pytest.raises(ClientError) as refused:
                        r.sandboxes.create(labels={"suite": "e2e-pg-place"})
                    assert refused.value.code == "no_capacity", refused.value
            assert host_state(cluster, a) == "drained"
            host_cli(cluster, "resume", node_of(a))

            kept = rf.sandboxes.create(labels={"suite": "e2e-pg-place"}, persistent=True)
            plain = rf.sandboxes.create(labels={"suite": "e2e-pg-place"})
            for s in (kept, plain):
                assert cluster.psql(f"SELECT node FROM sandboxes WHERE id = '{s.id}'") == node_of(a)
            kept.exec("echo before > /workspace/mark")
            plain_qemu = a.qemu_pids(plain.id)
            assert plain_qemu and a.qemu_pids(kept.id)

            # A dies (SIGKILL: no clean stop, its leases lapse); its machines live on.
            a.proc.send_signal(signal.SIGKILL)
            a.proc.wait(30)
            a.proc = None
            killed = time.monotonic()
            while True:
                try:
                    state = rf.sandboxes.get(kept.id)
                except ClientError as error:  # not yet held lost: its node does not answer
                    assert error.code == "host_unavailable", error
                    state = None
                if state is not None and state.state == "stopped":
                    break
                assert time.monotonic() - killed < lost_after + 12, "A was not held lost within its bound"
                time.sleep(1)
            waited = time.monotonic() - killed
            # Counted from its last beat (every 5 s), checked every 5 s.
            assert waited >= lost_after - 6, f"held lost after {waited:.0f} s, before its bound"
            assert state.info.get("stopReason") == "host_lost", state.info
            gone = rf.sandboxes.get(plain.id)
            assert gone.state == "stopped" and gone.info.get("stopReason") == "host_lost", gone.info
            assert host_state(cluster, a) == "lost"
            # What needs its machine is still its node's: said plainly.
            with pytest.raises(ClientError) as down:
                kept.exec("true")
            assert down.value.code == "host_unavailable", down.value

            a.start()
            came_back(rf, a, kept.id, plain.id)
            assert host_state(cluster, a) == "ready"
            for s in (placed, kept, plain):
                rf.sandboxes.delete(s.id)
    finally:
        if a.proc is None:
            a.start()
        full.shut_down()
        shutil.rmtree(full.root, ignore_errors=True)
