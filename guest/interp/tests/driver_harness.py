"""Starts an interpreter driver on this host, without a VM, and speaks its line
protocol as the server does.

Everything here reproduces crates/server/src/interpreter.rs:

- `argv_for` is that file's `argv_for`: the same command line per language,
  with the driver's source as an argument.
- `Driver` starts it as `start_kernel` does through the guest agent (which
  calls setsid, so the driver leads its own process group): environment with
  `OPENBLAS_CORETYPE=Prescott` and `PYTHONUNBUFFERED=1`, stdin a pipe, the
  nonce (a UUID as 32 hex digits) as the first stdin line, then `ready`.
- `Driver.run` sends what `run_cell` sends, `{"code":…,"id":"exec_…"}` as
  serde_json writes it (compact, keys sorted), and reads until the `end`
  event that carries that id; a timeout or interrupt is SIGINT to the group.
- Stdout is split as `Kernel::split_stdout` splits it: a line that starts with
  `NONCE ` and whose rest parses as JSON is a protocol event, any other line
  is plain stdout (event `{"k": "plain"}` here). Bytes are split on newlines
  over the whole stream, as if every write arrived in one read (the server
  sends a partial line early only when its read happens to end there), so a
  protocol line glued to output without a newline counts as plain, as it can
  in the guest. The driver's own stderr is `{"k": "raw-stderr"}`.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

DRIVERS = Path(__file__).resolve().parents[1]

# The per-language process, as argv_for in crates/server/src/interpreter.rs.
JAVA_LAUNCH = (
    'd=$(mktemp -d /tmp/.runtime-java.XXXXXX) && printf %s "$1" > "$d/RuntimeJShell.java" '
    "&& exec java -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Djava.awt.headless=true "
    '"$d/RuntimeJShell.java"'
)


def source(name: str) -> str:
    return (DRIVERS / name).read_text()


def argv_for(language: str) -> list[str]:
    if language == "javascript":
        return ["node", "-e", source("driver.js")]
    if language == "typescript":
        return ["node", "-e", source("driver.js"), "typescript"]
    if language == "r":
        return ["stdbuf", "-oL", "Rscript", "--vanilla", "-e",
                "eval(parse(text = commandArgs(TRUE)[1]))", source("driver.R")]
    if language == "java":
        return ["bash", "-c", JAVA_LAUNCH, "bash", source("RuntimeJShell.java")]
    return ["python3", "-u", "-c", source("driver.py"), language]


def run_line(code: str, rid: str) -> bytes:
    """The stdin line of a run, as serde_json writes `json!({"id", "code"})`."""
    return (json.dumps({"code": code, "id": rid}, ensure_ascii=False,
                       separators=(",", ":")) + "\n").encode()


class DriverGone(AssertionError):
    pass


class Run:
    def __init__(self, language: str, rid: str, events: list[dict], end: dict | None):
        self.language, self.id, self.events, self.end = language, rid, events, end

    def kinds(self) -> set[str]:
        return {e["k"] for e in self.events}

    def text(self, *kinds: str) -> str:
        return "".join(e["text"] for e in self.events if e["k"] in kinds)

    @property
    def stdout(self) -> str:
        """What the server reports as stdout: `stdout` events and plain lines."""
        return self.text("stdout", "plain")

    @property
    def stderr(self) -> str:
        return self.text("stderr", "raw-stderr")

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["k"] == kind]

    def __repr__(self) -> str:
        return f"Run({self.language} {self.id}, end={self.end}, events={self.events})"


class Driver:
    def __init__(self, language: str, cwd: Path, start_timeout: float = 120):
        self.language = language
        self.nonce = uuid.uuid4().hex
        env = dict(os.environ)
        env["OPENBLAS_CORETYPE"] = "Prescott"
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(
            argv_for(language), cwd=cwd, env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.events: queue.Queue[dict] = queue.Queue()
        self.backlog: list[dict] = []
        threading.Thread(target=self._stdout, daemon=True).start()
        threading.Thread(target=self._stderr, daemon=True).start()
        self.proc.stdin.write(f"{self.nonce}\n".encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + start_timeout
        said = []
        while True:
            ev = self._next(deadline, said)
            if ev["k"] == "ready":
                self.ready = ev
                return
            said.append(ev)

    # -- reading -----------------------------------------------------------
    def _stdout(self):
        prefix = (self.nonce + " ").encode()
        buf = b""
        while True:
            chunk = self.proc.stdout.read1(65536)
            if not chunk:
                break
            buf += chunk
            while (i := buf.find(b"\n")) >= 0:
                line, buf = buf[: i + 1], buf[i + 1:]
                body = line[:-1]
                ev = None
                if body.startswith(prefix):
                    try:
                        ev = json.loads(body[len(prefix):])
                    except ValueError:
                        ev = None
                    if not isinstance(ev, dict):
                        ev = None
                if ev is None:
                    ev = {"k": "plain", "text": line.decode("utf-8", "replace")}
                self.events.put(ev)
        if buf:
            self.events.put({"k": "plain", "text": buf.decode("utf-8", "replace")})
        self.events.put({"k": "exit"})

    def _stderr(self):
        while True:
            chunk = self.proc.stderr.read1(65536)
            if not chunk:
                return
            self.events.put({"k": "raw-stderr", "text": chunk.decode("utf-8", "replace")})

    def _next(self, deadline: float, seen: list) -> dict:
        try:
            ev = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"{self.language}: no answer in time; so far {seen}") from None
        if ev["k"] == "exit":
            self.events.put(ev)  # stays gone for later calls
            raise DriverGone(f"{self.language}: the driver exited ({self.proc.poll()}); got {seen}")
        return ev

    # -- running -----------------------------------------------------------
    def alive(self) -> bool:
        return self.proc.poll() is None

    def interrupt(self):
        """SIGINT to the driver's process group, as ExecControl::Signal(2)."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def run(self, code: str, timeout: float = 90, interrupt_on: str | None = None,
            interrupts: int = 1, rid: str | None = None) -> Run:
        """One run: its events up to (not including) its `end`. With
        `interrupt_on`, SIGINT goes to the group once that text was printed
        (`interrupts` times, 0.3 s apart)."""
        rid = rid or "exec_" + uuid.uuid4().hex
        started = time.monotonic()
        self.proc.stdin.write(run_line(code, rid))
        self.proc.stdin.flush()
        deadline = started + timeout
        events: list[dict] = []
        sent = False
        while True:
            ev = self._next(deadline, events)
            if ev["k"] == "end" and ev.get("id") == rid:
                return Run(self.language, rid, events, ev)
            events.append(ev)
            if interrupt_on and not sent and interrupt_on in Run(self.language, rid, events, None).stdout:
                sent = True
                self.interrupted_at = time.monotonic()
                self.interrupt()
                for k in range(1, interrupts):
                    threading.Timer(0.3 * k, self.interrupt).start()

    def close(self):
        pid = self.proc.pid
        leftovers = [Path(f"/tmp/.runtime-interp-{pid}"), Path(f"/tmp/.runtime-go-{pid}")]
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            leftovers += [Path(a.decode()).parent for a in args
                          if a.endswith(b"/RuntimeJShell.java") and a.startswith(b"/tmp/.runtime-java.")]
        except OSError:
            pass
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        for p in leftovers:
            shutil.rmtree(p, ignore_errors=True)
