"""The end-to-end suite's server: one `runtime serve` per session, driven
through the official client (`withruntime`), plus raw HTTP for the wire
details the client hides.

The server gets a free loopback port and a fresh data directory. Teardown
deletes every sandbox still listed, stops the server (SIGTERM, then SIGKILL)
and kills any QEMU left behind whose command line names the data directory.
When a test failed, the data directory (server log, VM consoles) is kept and
its path printed, with the tail of the server log.

Environment knobs: RUNTIME_BIN (the binary, default target/release/runtime),
RUNTIME_E2E_START_TIMEOUT (seconds to wait for `listening on`, default 1200:
the first start may build the guest kernel and image), RUNTIME_E2E_KEEP=1
(keep the data directory even when everything passed), RUNTIME_E2E_CLUSTER=1
(the suite's server is two nodes on one PostgreSQL: `ClusterServer`).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Optional

import pytest

from egress_servers import EgressServers

REPO = Path(__file__).resolve().parents[2]
BINARY = Path(os.environ.get("RUNTIME_BIN", REPO / "target" / "release" / "runtime"))
# test_events.py's receivers listen on loopback over plain HTTP, which
# webhooks may reach only when the operator allows it; a minute of the
# retry schedule lasts 1.2 s. Only webhooks read either flag.
WEBHOOK_ARGS = ["--webhook-allow-host", "127.0.0.1", "--webhook-test-second-ms", "20"]
START_TIMEOUT = float(os.environ.get("RUNTIME_E2E_START_TIMEOUT", "1200"))
STOP_TIMEOUT = 30.0

# The example's scripted model is shared with the LangChain tests.
sys.path.insert(0, str(REPO / "examples"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 80) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as error:
        return f"(cannot read {path}: {error})"


class Server:
    """A `runtime serve` child on a fixed port and data directory."""

    def __init__(self, root: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.root = root
        self.data_dir = root / "data"
        self.log_path = root / "server.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The port it listens on: the client's (`port`) unless another
        # node answers the client (ClusterServer).
        self.listen_port = self.port
        # What its process's environment has beyond the suite's (read at
        # each start): RUNTIME_STORE only for a node given one (the CLI's
        # commands of a cluster session read it; no other server may join
        # that store).
        self.env: dict[str, str] = {}
        self.proc: Optional[subprocess.Popen] = None
        self.starts = 0
        self.keys: list[str] = []
        # More `runtime serve` flags for the next start: a module's own
        # server's settings (test_quotas.py), test-only crash points
        # (test_crash.py).
        self.extra_args: list[str] = list(extra_args)
        # The local servers that stand for internet hosts (egress_servers.py).
        self.egress = EgressServers(root / "egress")

    # -- process ---------------------------------------------------------
    def start(self) -> None:
        if not BINARY.exists():
            raise RuntimeError(f"{BINARY} does not exist: build it first (bash scripts/build.sh)")
        self.starts += 1
        mark = f"listening on http://127.0.0.1:{self.listen_port}"
        with self.log_path.open("a") as log:
            log.write(f"\n===== start {self.starts} =====\n")
            log.flush()
            offset = self.log_path.stat().st_size
            self.proc = subprocess.Popen(
                [str(BINARY), "serve", "--listen", f"127.0.0.1:{self.listen_port}", "--data-dir", str(self.data_dir),
                 *self.egress.args, *WEBHOOK_ARGS, *self.extra_args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**{k: v for k, v in os.environ.items() if k != "RUNTIME_STORE"}, **self.env,
                     "RUST_BACKTRACE": "1"})
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            with self.log_path.open("rb") as log:
                log.seek(offset)
                if mark.encode() in log.read():
                    return
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"runtime serve exited with {code} before listening; log tail:\n"
                                   f"{tail(self.log_path)}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"runtime serve did not print {mark!r} within {START_TIMEOUT:.0f} s; "
                                   f"log tail:\n{tail(self.log_path)}")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM to the server alone (its VMs are its business), then SIGKILL."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT)

    def restart(self) -> None:
        self.stop()
        self.start()

    def shut_down(self) -> None:
        """A test module's own server at its end: its sandboxes deleted
        (when it runs), the server and its egress servers stopped, any QEMU
        of its data dir left over killed."""
        if self.proc is not None:
            self.delete_all_sandboxes()
        self.stop()
        self.egress.close()
        self.kill_leftover_qemu()

    def rss_kib(self) -> int:
        """The server process's resident memory now, in KiB."""
        assert self.proc is not None, "the server is not running"
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS in the server's status")

    def admin_key(self) -> str:
        return (self.data_dir / "admin.key").read_text().strip()

    def qemu_pids(self, sandbox_id: str) -> list[int]:
        """The live QEMU processes of one of this server's sandboxes."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes()
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if (b"qemu-system" in cmd.split(b"\0", 1)[0] and str(self.data_dir).encode() in cmd
                    and sandbox_id.encode() in cmd and state != "Z"):
                pids.append(int(entry.name))
        return pids

    def create_key(self, *, read_only: bool = False, account_wide: bool = False,
                   name: Optional[str] = None) -> str:
        args = [str(BINARY), "keys", "create", "--data-dir", str(self.data_dir)]
        if read_only:
            args.append("--read-only")
        if account_wide:
            args.append("--account-wide")
        if name:
            args += ["--name", name]
        out = subprocess.run(args, check=True, capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL)
        key = out.stdout.strip()
        assert key and len(key.split()) == 1, f"keys create printed {out.stdout!r}"
        self.keys.append(key)
        return key

    # -- clean-up --------------------------------------------------------
    def delete_all_sandboxes(self) -> list[str]:
        from withruntime import Runtime
        problems = []
        for key in [self.admin_key(), *self.keys]:
            try:
                with Runtime(api_key=key, base_url=self.url, timeout=60, max_retries=0) as rt:
                    for sbx in rt.sandboxes.list(include_stopped=True):
                        try:
                            rt.sandboxes.delete(sbx.id)
                        except Exception as error:  # noqa: BLE001 - keep cleaning
                            problems.append(f"delete {sbx.id}: {error}")
            except Exception as error:  # noqa: BLE001 - a read-only or revoked key, a dead server
                problems.append(f"list with key …{key[-6:]}: {error}")
        return problems

    def kill_leftover_qemu(self) -> list[int]:
        """SIGKILL every QEMU of this server's data dir, and remove the
        directories of the RAM files they mapped (on the host's memory file
        system, outside the data dir): nothing else would."""
        killed = []
        ram_dirs = set()
        needle = str(self.root).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"qemu-system" in cmdline.split(b"\0", 1)[0] and needle in cmdline:
                for path in re.findall(rb"mem-path=([^,\0]+)", cmdline):
                    ram = Path(path.decode())
                    if ram.parent.name.startswith("runtime-"):
                        ram_dirs.add(ram.parent)
                try:
                    os.kill(int(entry.name), signal.SIGKILL)
                    killed.append(int(entry.name))
                except ProcessLookupError:
                    pass
        for ram_dir in ram_dirs:
            shutil.rmtree(ram_dir, ignore_errors=True)
        return killed


class ClusterServer(Server):
    """`RUNTIME_E2E_CLUSTER=1`: the suite's server is a deployment of two
    nodes on one PostgreSQL of the session's own (pg_cluster.py). This
    object is the host node H, whose machines the tests look at (its data
    directory, its QEMUs, its log, `restart`), while the client talks to
    `front`, a control plane that keeps more memory free than any machine
    has: every create is carried to H, and every request about a sandbox
    too. The CLI's commands reach the store through RUNTIME_STORE."""

    def __init__(self, root: Path) -> None:
        from pg_cluster import Cluster
        (root / "pg").mkdir()
        self.cluster = Cluster(root / "pg")
        super().__init__(root, ("--store", self.cluster.url))
        self.env["RUNTIME_STORE"] = self.cluster.url
        front_root = root / "front"
        front_root.mkdir()
        self.front = Server(front_root, ("--store", self.cluster.url, "--reserve-memory-mib", "100000000"))
        self.url, self.port = self.front.url, self.front.port
        os.environ["RUNTIME_STORE"] = self.cluster.url

    def start(self) -> None:
        super().start()
        if self.front.proc is None:
            self.front.data_dir.mkdir(parents=True, exist_ok=True)
            if not (self.front.data_dir / "secrets.key").exists():
                shutil.copy2(self.data_dir / "secrets.key", self.front.data_dir / "secrets.key")
            self.front.start()

    def close(self) -> None:
        """The front node and the database, after H's teardown."""
        self.front.stop()
        self.front.egress.close()
        self.cluster.stop()
        os.environ.pop("RUNTIME_STORE", None)


CLUSTER = os.environ.get("RUNTIME_E2E_CLUSTER") == "1"


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        item.session.e2e_failed = True


@pytest.fixture(scope="session")
def server(request):
    root = Path(tempfile.mkdtemp(prefix="runtime-e2e-"))
    # As root, each VM's QEMU runs as a uid of its own that must reach the
    # data dir (serve refuses a data dir others cannot traverse).
    os.chmod(root, 0o711)
    srv = ClusterServer(root) if CLUSTER else Server(root)
    saved = {k: os.environ.get(k) for k in ("RUNTIME_API_URL", "RUNTIME_API_KEY", "NO_PROXY", "no_proxy")}
    try:
        srv.start()
    except Exception:
        srv.kill_leftover_qemu()
        print(f"\n[e2e] the server did not start; kept {root}", file=sys.stderr)
        raise
    os.environ["RUNTIME_API_URL"] = srv.url
    os.environ["RUNTIME_API_KEY"] = srv.admin_key()
    # Proxy variables apply to loopback too unless excluded.
    for name in ("NO_PROXY", "no_proxy"):
        os.environ[name] = ",".join(filter(None, [os.environ.get(name), "127.0.0.1", "localhost"]))
    try:
        yield srv
    finally:
        problems = srv.delete_all_sandboxes() if srv.proc is not None else ["server not running at teardown"]
        srv.stop()
        srv.egress.close()
        if isinstance(srv, ClusterServer):
            srv.close()
        killed = srv.kill_leftover_qemu()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        failed = getattr(request.session, "e2e_failed", False) or problems or killed
        if failed or os.environ.get("RUNTIME_E2E_KEEP"):
            print(f"\n[e2e] kept {root} (server.log, data/)", file=sys.stderr)
            for p in problems:
                print(f"[e2e] teardown: {p}", file=sys.stderr)
            if killed:
                print(f"[e2e] teardown: killed leftover QEMU {killed}", file=sys.stderr)
            print(f"[e2e] server log tail:\n{tail(srv.log_path)}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def runtime(server):
    """A client with the admin key (the same one `Sandbox.create()` uses)."""
    from withruntime import Runtime
    with Runtime(api_key=server.admin_key(), base_url=server.url) as rt:
        yield rt


@pytest.fixture(scope="module")
def sbx(server):
    """One sandbox shared by a module's tests where state does not matter."""
    from withruntime import Sandbox
    sandbox = Sandbox.create()
    try:
        yield sandbox
    finally:
        try:
            sandbox.delete()
        except Exception:  # noqa: BLE001 - the session teardown sweeps what is left
            pass


def client_for(server: Server, key: str):
    from withruntime import Runtime
    return Runtime(api_key=key, base_url=server.url, max_retries=0)


class Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def json(self) -> Any:
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"Answer({self.status}, {self.body[:500]!r})"


def http(server: Server, method: str, path: str, body: Any = None, *, key: Optional[str] = "admin",
         headers: Optional[dict[str, str]] = None, raw: Optional[bytes] = None, timeout: float = 180) -> Answer:
    """One raw request; non-2xx answers are returned, not raised."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    hdrs = {"Accept": "application/json"}
    if data is not None:
        hdrs["Content-Type"] = "application/json"
    if key == "admin":
        key = server.admin_key()
    if key is not None:
        hdrs["Authorization"] = f"Bearer {key}"
    if method != "GET" and not any(h.lower() == "idempotency-key" for h in (headers or {})):
        hdrs["Idempotency-Key"] = str(uuid.uuid4())
    hdrs.update(headers or {})
    request = urllib.request.Request(server.url + path, data=data, method=method, headers=hdrs)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout) as answer:
            return Answer(answer.status, {k.lower(): v for k, v in answer.headers.items()}, answer.read())
    except urllib.error.HTTPError as error:
        with error:
            return Answer(error.code, {k.lower(): v for k, v in error.headers.items()}, error.read())


def assert_error_body(answer: Answer, status: int, code: Optional[str] = None) -> dict[str, Any]:
    """The contract's one error shape: {"error": {code, status, message, requestId, ...}}."""
    assert answer.status == status, answer
    assert answer.headers.get("content-type", "").startswith("application/json"), answer.headers
    error = answer.json()["error"]
    assert isinstance(error["code"], str) and error["code"], error
    if code is not None:
        assert error["code"] == code, error
    assert error["status"] == status, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["requestId"], str) and error["requestId"], error
    return error


def preview_fetch(server: Server, url: str, path: str = "/", headers: Optional[dict[str, str]] = None,
                  timeout: float = 60) -> Answer:
    """A GET of a preview's address as a browser sends it, to this server on
    loopback with the address's host (its `*.localhost` names resolve nowhere
    here). Waits up to `timeout` for the guest's server to answer; answers
    the last reply (non-2xx returned, not raised)."""
    import http.client
    from urllib.parse import urlsplit
    host = urlsplit(url).netloc
    deadline = time.monotonic() + timeout
    while True:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        try:
            connection.request("GET", path, headers={"Host": host, **(headers or {})})
            reply = connection.getresponse()
            answer = Answer(reply.status, {k.lower(): v for k, v in reply.getheaders()}, reply.read())
        finally:
            connection.close()
        # 502: the preview is there, the guest's server not yet listening.
        if answer.status != 502 or time.monotonic() > deadline:
            return answer
        time.sleep(0.5)


def qemu_gone(server: Server, sandbox_id: str, timeout: float = 60) -> bool:
    """Whether the sandbox's QEMU has ended within `timeout` seconds: a delete
    answers before the machine's teardown is over."""
    deadline = time.monotonic() + timeout
    while server.qemu_pids(sandbox_id):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True
