"""Latency benchmark of a `runtime` server through the official client.

    .venv/bin/python bench/run.py            # starts its own server (like the e2e suite)
    .venv/bin/python bench/run.py -n 50      # more runs
    RUNTIME_API_URL=... RUNTIME_API_KEY=... .venv/bin/python bench/run.py   # an existing server
    .venv/bin/python bench/run.py --creates  # create until running: pool on/off, 1, 10, 50 at once
    .venv/bin/python bench/run.py --execs    # exec `true`: 1, 10 and 50 at once over 10 sandboxes

Over N sequential runs (default 20), each with a fresh sandbox, it measures:
create until running; create through the first `python3 -c pass` exec; an
exec of `true` in the running sandbox; delete; and, side by side, a local
`python3 -c pass` subprocess as the floor. Prints a Markdown table and writes
the samples to bench/results/<timestamp>.json.

With --creates it measures create until running instead, at each level of
--levels (creates sent at once, default 1,10,50), on three servers it starts
in turn: cold boots (`--no-templates --warm-pool 0`, one at a time only: the
reference), template restores (`--warm-pool 0`), and the warm pool
(`--warm-pool P`, P the largest level, refilled before each round). Shape
1 vCPU, 1 GiB. Each level gets at least --samples samples (default 20).

With --execs it measures exec `true` round trips through the official
client on one server with its defaults and 10 running sandboxes (1 vCPU,
1 GiB): one at a time (the reference), 10 at once (one per sandbox) and 50
at once (five per sandbox), threads behind a barrier; every exec must
succeed. Each level gets at least --samples samples.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
METRICS = [
    ("create_until_running", "create until running"),
    ("create_to_first_exec", "create through first `python3 -c pass`"),
    ("python_running", "exec `python3 -c pass` (running sandbox, its second)"),
    ("exec_true", "exec `true` (running sandbox)"),
    ("delete", "delete"),
    ("local_python_floor", "local `python3 -c pass` (floor)"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnServer:
    """`runtime serve` on a free port and a temporary data directory."""

    def __init__(self, binary: Path, timeout: float, extra: tuple[str, ...] = (),
                 secrets_key: Path | None = None) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="runtime-bench-"))
        # As root each VM's QEMU runs as its own uid and must reach the data dir.
        os.chmod(self.root, 0o711)
        if secrets_key is not None:
            # Another node of the same store: the same key seals secrets.
            (self.root / "data").mkdir()
            shutil.copy2(secrets_key, self.root / "data" / "secrets.key")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = self.root / "server.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [str(binary), "serve", "--listen", f"127.0.0.1:{self.port}", "--data-dir", str(self.root / "data"),
                 *extra],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while f"listening on {self.url}" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                sys.exit(f"runtime serve did not start; log tail:\n{self.log.read_text(errors='replace')[-4000:]}")
            time.sleep(0.2)
        self.key = (self.root / "data" / "admin.key").read_text().strip()

    def accelerator(self) -> str:
        found = re.search(r"accelerator (\S+)", self.log.read_text(errors="replace"))
        return found.group(1) if found else "unknown"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        for ram_dir in kill_qemu_under(self.root):
            shutil.rmtree(ram_dir, ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)


def kill_qemu_under(root: Path) -> set[Path]:
    """SIGKILL every QEMU whose command line names `root`; the directories of
    the RAM files they mapped (on the host's memory file system, outside
    `root`), which a server that stopped while its machines ran leaves."""
    needle = str(root).encode()
    ram_dirs = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"qemu-system" in cmd.split(b"\0", 1)[0] and needle in cmd:
                for path in re.findall(rb"mem-path=([^,\0]+)", cmd):
                    ram = Path(path.decode())
                    if ram.parent.name.startswith("runtime-"):
                        ram_dirs.add(ram.parent)
                try:
                    os.kill(int(entry.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return ram_dirs


def percentile(samples: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(samples)
    rank = max(1, int(-(-p * len(ordered) // 100)))
    return ordered[rank - 1]


def measure(rt, runs: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name, _ in METRICS}
    for i in range(runs):
        t0 = time.perf_counter()
        sbx = rt.sandboxes.create(labels={"bench": "run"})
        t1 = time.perf_counter()
        first = sbx.exec(["python3", "-c", "pass"])
        t2 = time.perf_counter()
        assert sbx.state == "running" and first.exit_code == 0, (sbx.info, first)
        t2b = time.perf_counter()
        second = sbx.exec(["python3", "-c", "pass"])
        t2c = time.perf_counter()
        assert second.exit_code == 0, second
        t3 = time.perf_counter()
        done = sbx.exec("true")
        t4 = time.perf_counter()
        assert done.exit_code == 0, done
        sbx.delete()
        t5 = time.perf_counter()
        local = subprocess.run(["python3", "-c", "pass"], check=True)
        t6 = time.perf_counter()
        assert local.returncode == 0
        samples["create_until_running"].append((t1 - t0) * 1000)
        samples["create_to_first_exec"].append((t2 - t0) * 1000)
        samples["python_running"].append((t2c - t2b) * 1000)
        samples["exec_true"].append((t4 - t3) * 1000)
        samples["delete"].append((t5 - t4) * 1000)
        samples["local_python_floor"].append((t6 - t5) * 1000)
        print(f"run {i + 1}/{runs}: create {samples['create_until_running'][-1]:.0f} ms, "
              f"first exec {samples['create_to_first_exec'][-1]:.0f} ms, "
              f"exec true {samples['exec_true'][-1]:.0f} ms, delete {samples['delete'][-1]:.0f} ms", file=sys.stderr)
    return samples


CREATE_SHAPE = {"vcpu": 1, "memory_mib": 1024}


def warm_machines(url: str, key: str) -> float:
    import urllib.request
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {key}"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    text = opener.open(req, timeout=60).read().decode()
    found = re.search(r"^runtime_warm_machines (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def create_round(rt, at_once: int) -> list[float]:
    """`at_once` creates sent together; each one's create until running, ms."""
    from concurrent.futures import ThreadPoolExecutor
    import threading
    gate = threading.Barrier(at_once)

    def one(_):
        gate.wait()
        t0 = time.perf_counter()
        sbx = rt.sandboxes.create(**CREATE_SHAPE)
        took = (time.perf_counter() - t0) * 1000
        assert sbx.state == "running", sbx.info
        return sbx.id, took

    with ThreadPoolExecutor(at_once) as ex:
        made = list(ex.map(one, range(at_once)))
    with ThreadPoolExecutor(min(at_once, 10)) as ex:
        list(ex.map(lambda m: rt.sandboxes.delete(m[0]), made))
    return [took for _, took in made]


def measure_creates(binary: Path, timeout: float, levels: list[int], samples: int) -> dict:
    """Create until running per server kind and level (ms samples)."""
    from withruntime import Runtime
    pool = max(levels)
    kinds = [
        ("cold boot", ("--no-templates", "--warm-pool", "0"), [1]),
        ("template restore", ("--warm-pool", "0"), levels),
        (f"warm pool ({pool})", ("--warm-pool", str(pool), "--warm-pool-memory-mib", str(pool * 256)), levels),
    ]
    out: dict = {}
    for name, flags, kind_levels in kinds:
        own = OwnServer(binary, timeout, flags)
        try:
            with Runtime(api_key=own.key, base_url=own.url, timeout=900) as rt:
                # Untimed: the first create of the shape (it builds the template).
                create_round(rt, 1)
                for level in kind_levels:
                    got: list[float] = []
                    while len(got) < (samples if name != "cold boot" else max(5, samples // 4)):
                        if "pool" in name:
                            # A full pool: no refill runs while a round is timed
                            # (the round's own takes start refills).
                            deadline = time.monotonic() + 600
                            while warm_machines(own.url, own.key) < pool:
                                assert time.monotonic() < deadline, "the pool did not refill"
                                time.sleep(0.5)
                        time.sleep(1)  # the deletes' teardown settles
                        got += create_round(rt, level)
                        print(f"{name}, {level} at once: {len(got)} samples, last round p50 "
                              f"{statistics.median(got[-level:]):.0f} ms", file=sys.stderr)
                    out[f"{name}|{level}"] = got
            out["accelerator"] = own.accelerator()
        finally:
            own.close()
    return out


def exec_round(sandboxes: list, at_once: int) -> list[float]:
    """`at_once` execs of `true` sent together, spread over `sandboxes`;
    each one's round trip, ms. Every one must succeed."""
    from concurrent.futures import ThreadPoolExecutor
    import threading
    gate = threading.Barrier(at_once)

    def one(i):
        sbx = sandboxes[i % len(sandboxes)]
        gate.wait()
        t0 = time.perf_counter()
        done = sbx.exec(["true"])
        took = (time.perf_counter() - t0) * 1000
        assert done.exit_code == 0, done
        return took

    with ThreadPoolExecutor(at_once) as ex:
        return list(ex.map(one, range(at_once)))


def measure_execs(binary: Path, timeout: float, levels: list[int], samples: int) -> dict:
    """Exec `true` round trips at each level, over 10 running sandboxes."""
    from withruntime import Runtime
    own = OwnServer(binary, timeout)
    out: dict = {}
    try:
        with Runtime(api_key=own.key, base_url=own.url, timeout=900, max_connections=64) as rt:
            sandboxes = [rt.sandboxes.create(**CREATE_SHAPE) for _ in range(10)]
            for sbx in sandboxes:
                assert sbx.exec(["true"]).exit_code == 0  # untimed: each one's first
            time.sleep(5)  # the pool's refills settle
            for level in levels:
                got: list[float] = []
                while len(got) < samples:
                    got += exec_round(sandboxes, level)
                print(f"exec true, {level} at once: {len(got)} samples, p50 {statistics.median(got):.0f} ms",
                      file=sys.stderr)
                out[f"exec `true`|{level}"] = got
            for sbx in sandboxes:
                sbx.delete()
        out["accelerator"] = own.accelerator()
    finally:
        own.close()
    return out


def creates_table(found: dict) -> str:
    lines = ["| what | at once | n | median ms | p95 ms | p95 / median of one |",
             "|---|---:|---:|---:|---:|---:|"]
    for key, v in found.items():
        if "|" not in key:
            continue
        name, level = key.split("|")
        one = found.get(f"{name}|1")
        ratio = percentile(v, 95) / statistics.median(one) if one else float("nan")
        lines.append(f"| {name} | {level} | {len(v)} | {statistics.median(v):.0f} | {percentile(v, 95):.0f} "
                     f"| {ratio:.1f} |")
    return "\n".join(lines)


def table(summary: dict[str, dict[str, float]], runs: int) -> str:
    lines = [f"| operation (n={runs}) | median ms | p95 ms |", "|---|---:|---:|"]
    for name, label in METRICS:
        s = summary[name]
        lines.append(f"| {label} | {s['median_ms']:.0f} | {s['p95_ms']:.0f} |")
    first, again = summary["create_to_first_exec"]["median_ms"], summary["python_running"]["median_ms"]
    lines.append(f"\ncreate through first `python3 -c pass` / the same exec in a running sandbox: "
                 f"{first / again:.2f} × (medians)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--runs", type=int, default=20)
    parser.add_argument("--binary", type=Path, default=REPO / "target" / "release" / "runtime")
    parser.add_argument("--start-timeout", type=float, default=1200)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--creates", action="store_true",
                        help="create until running with the pool on and off, at each level of --levels")
    parser.add_argument("--execs", action="store_true",
                        help="exec `true` round trips at each level of --levels at once, over 10 sandboxes")
    parser.add_argument("--levels", default="1,10,50")
    parser.add_argument("--samples", type=int, default=20)
    args = parser.parse_args()

    if args.creates or args.execs:
        levels = [int(x) for x in args.levels.split(",")]
        measure_kind = measure_creates if args.creates else measure_execs
        found = measure_kind(args.binary, args.start_timeout, levels, args.samples)
        now = datetime.now(timezone.utc)
        result = {
            "date": now.isoformat(timespec="seconds").replace("+00:00", "Z"),
            "command": "python bench/run.py " + " ".join(sys.argv[1:]),
            "accelerator": found.get("accelerator"),
            "shape": CREATE_SHAPE,
            "host": {"cpus": os.cpu_count(), "kernel": platform.release()},
            "samples_ms": {k: v for k, v in found.items() if "|" in k},
        }
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"{'creates' if args.creates else 'execs'}-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(creates_table(found))
        print(f"\naccelerator: {found.get('accelerator')}; samples in {path}")
        return 0

    from withruntime import Runtime, __version__

    own = None
    url, key = os.environ.get("RUNTIME_API_URL"), os.environ.get("RUNTIME_API_KEY")
    if not url:
        own = OwnServer(args.binary, args.start_timeout)
        url, key = own.url, own.key
    if not key:
        sys.exit("RUNTIME_API_URL is set but RUNTIME_API_KEY is not")
    try:
        with Runtime(api_key=key, base_url=url) as rt:
            # One untimed warm-up run (page cache, first QEMU start).
            measure(rt, 1)
            samples = measure(rt, args.runs)
        accelerator = own.accelerator() if own else "unknown (external server)"
    finally:
        if own:
            own.close()

    summary = {name: {"median_ms": statistics.median(v), "p95_ms": percentile(v, 95), "samples_ms": v}
               for name, v in samples.items()}
    now = datetime.now(timezone.utc)
    result = {
        "date": now.isoformat(timespec="seconds").replace("+00:00", "Z"),
        "command": "python bench/run.py " + " ".join(sys.argv[1:]),
        "runs": args.runs,
        "server": "started by the benchmark" if own else "external (RUNTIME_API_URL)",
        "accelerator": accelerator,
        "client": f"withruntime {__version__}",
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                 "kernel": platform.release()},
        "metrics": summary,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(table(summary, args.runs))
    print(f"\naccelerator: {accelerator}; samples in {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
