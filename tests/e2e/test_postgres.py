"""The store on PostgreSQL: a server of this module's own started with
`--store postgres://...` against a throwaway cluster the module starts
(initdb into a temp dir, pg_ctl on a free port; as root the cluster runs as
`nobody`). The official client creates a sandbox and runs a command; the
server restarts and finds the sandbox again; the records are in the
database, not in a `runtime.db`. Without PostgreSQL's binaries the module
fails in CI and skips elsewhere (scripts/host-packages.sh installs them)."""
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
        self.run("pg_ctl", "-D", str(self.data), "-l", str(root / "pg.log"), "-w", "-o",
                 f"-p {self.port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start")
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

    def stop(self) -> None:
        subprocess.run([*self.as_user, str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                        "-w", "stop"], capture_output=True, timeout=60, cwd=self.root)


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
