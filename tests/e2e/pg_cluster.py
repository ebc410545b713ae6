"""A PostgreSQL cluster of a test module's own (initdb into a temp dir,
pg_ctl on a free port; as root it runs as `nobody`) and the helpers of
tests that run several nodes on it (test_postgres.py,
test_cluster_faults.py). Without PostgreSQL's binaries a module fails in
CI and skips elsewhere (scripts/host-packages.sh installs them)."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import BINARY, Server, free_port


def pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    return Path(found[-1]).parent if found else None


class Cluster:
    def __init__(self, root: Path) -> None:
        bin_dir = pg_bin()
        if bin_dir is None:
            message = "PostgreSQL is not installed (scripts/host-packages.sh installs it)"
            if os.environ.get("CI"):
                pytest.fail(message)
            pytest.skip(message)
        self.bin = bin_dir
        self.root = root
        self.data = root / "pgdata"
        self.port = free_port()
        self.as_user = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
        self.user = "nobody" if os.geteuid() == 0 else os.environ.get("USER", "postgres")
        if self.as_user:
            shutil.chown(root, user="nobody")
        self.run("initdb", "-D", str(self.data), "-A", "trust", "-U", self.user, "-E", "UTF8",
                 "--locale=C", "--no-sync")
        self.start()
        self.run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, "runtime")
        self.url = f"postgres://{self.user}@127.0.0.1:{self.port}/runtime"

    def run(self, tool: str, *args: str) -> str:
        out = subprocess.run([*self.as_user, str(self.bin / tool), *args], cwd=self.root,
                             capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, f"{tool} failed: {out.stdout}{out.stderr}"
        return out.stdout

    def psql(self, sql: str) -> str:
        return self.run("psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, "-d", "runtime",
                        "-At", "-c", sql).strip()

    def start(self) -> None:
        """Starts the server (again, after `stop`: same data and port)."""
        self.run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "pg.log"), "-w", "-o",
                 f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off", "start")

    def stop(self) -> None:
        """Stops the server at once (`immediate`: as if its machine died)."""
        subprocess.run([*self.as_user, str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                        "-w", "stop"], capture_output=True, timeout=60, cwd=self.root)


def node_of(srv) -> str:
    return (srv.data_dir / "node.id").read_text().strip()


def another_node(first: Server, cluster: "Cluster", prefix: str, *args: str) -> Server:
    """A second node of `first`'s store, with its own data directory that
    holds the store's `secrets.key` (every node of one store needs it)."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(root, 0o711)
    srv = Server(root, ("--store", cluster.url, *args))
    srv.data_dir.mkdir()
    shutil.copy2(first.data_dir / "secrets.key", srv.data_dir / "secrets.key")
    return srv


def host_state(cluster: "Cluster", srv: Server) -> str:
    """The STATE column of `runtime host list` for `srv`'s node."""
    listed = host_cli(cluster, "list")
    row = next(line for line in listed.splitlines() if line.startswith(node_of(srv)))
    return row.split()[4]


def host_cli(cluster: "Cluster", *args: str) -> str:
    out = subprocess.run([str(BINARY), "host", *args, "--store", cluster.url], capture_output=True,
                         text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    return out.stdout




def came_back(rt, srv: Server, kept_id: str, plain_id: str) -> None:
    """After node `srv` was held lost and is back: its persistent sandbox
    `kept_id` (which wrote "before" to /workspace/mark) runs again as it
    was, and `plain_id` stays stopped with no machine left."""
    import time

    from conftest import qemu_gone
    deadline = time.monotonic() + 60
    while rt.sandboxes.get(kept_id).state != "running":
        assert time.monotonic() < deadline, rt.sandboxes.get(kept_id).info
        time.sleep(0.5)
    back = rt.sandboxes.get(kept_id)
    assert back.info.get("stopReason") is None, back.info
    assert back.exec("cat /workspace/mark").stdout == "before\n"
    assert rt.sandboxes.get(plain_id).state == "stopped"
    assert qemu_gone(srv, plain_id), "the sandbox recorded stopped kept its machine"
