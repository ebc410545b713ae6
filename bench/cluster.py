"""Several control planes on one PostgreSQL store, through the official client.

    .venv/bin/python bench/cluster.py          # 20 rounds
    .venv/bin/python bench/cluster.py -n 50

Starts a throwaway PostgreSQL cluster (Debian's binaries: initdb, pg_ctl) and
two `runtime serve` on it, A and B, each with its own data directory (so its
own machines), then, interleaved in each round, for one sandbox on A:

- `GET /v1/sandboxes/{id}` and an exec of `true`, asked of A (its owner)
  and of B (which carries the request to A): what carrying costs;
- a create until running asked of A and one asked of B (each made where it
  is asked), then both deleted.

Then creates at once (`--at-once`, 12), each until running, sent round
robin over 1 node (A) and then over 3 (A, B and a third, C), as a load
balancer would: creates per second and each create's p95. Last, the
placement simulation (`runtime host simulate`): 1,000 hosts and 100,000
creates ranked by the server's own code, and the read of 1,000 nodes' rows
timed on the same PostgreSQL.

Prints Markdown tables and writes the samples to
bench/results/cluster-<timestamp>.json. All servers share this machine's
cores: the figures say what carrying and placement add, not how creates
scale with machines.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import glob
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import REPO, OwnServer, free_port, percentile  # noqa: E402

METRICS = [
    ("get_owner", "GET sandbox, asked of its node"),
    ("get_carried", "GET sandbox, asked of the other node (carried)"),
    ("exec_owner", "exec `true`, asked of its node"),
    ("exec_carried", "exec `true`, asked of the other node (carried)"),
    ("create_a", "create until running, asked of A"),
    ("create_b", "create until running, asked of B"),
]


class Postgres:
    """A throwaway cluster on a free port (as `nobody` when run as root)."""

    def __init__(self) -> None:
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
        if not found:
            sys.exit("PostgreSQL is not installed (scripts/host-packages.sh installs it)")
        self.bin = Path(found[-1]).parent
        self.root = Path(tempfile.mkdtemp(prefix="runtime-bench-pg-"))
        self.as_user = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
        user = "nobody" if os.geteuid() == 0 else os.environ.get("USER", "postgres")
        if self.as_user:
            shutil.chown(self.root, user="nobody")
        self.port = free_port()
        self.data = self.root / "pgdata"
        self.run("initdb", "-D", str(self.data), "-A", "trust", "-U", user, "-E", "UTF8", "--locale=C", "--no-sync")
        self.run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "pg.log"), "-w", "-o",
                 f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1", "start")
        self.run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", user, "runtime")
        self.url = f"postgres://{user}@127.0.0.1:{self.port}/runtime"

    def run(self, tool: str, *args: str) -> None:
        subprocess.run([*self.as_user, str(self.bin / tool), *args], cwd=self.root, check=True,
                       capture_output=True, timeout=120, stdin=subprocess.DEVNULL)

    def close(self) -> None:
        subprocess.run([*self.as_user, str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w",
                        "stop"], cwd=self.root, capture_output=True, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)


def creates_at_once(Runtime, key: str, hosts: tuple, n: int) -> dict:
    """`n` creates sent at once, round robin over `hosts`, each until
    running; then all deleted. Where each was made is read from its node."""
    clients = [Runtime(api_key=key, base_url=h.url) for h in hosts]
    try:
        def one(i: int):
            t0 = time.perf_counter()
            made = clients[i % len(clients)].sandboxes.create(labels={"bench": "cluster-burst"})
            return made, (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            results = list(pool.map(one, range(n)))
        wall = time.perf_counter() - t0
        per_node = []
        for h in hosts:
            node = (h.root / "data" / "node.id").read_text().strip()
            per_node.append(sum(1 for m, _ in results if node_of_sandbox(h, m.id) == node))
        for m, _ in results:
            m.delete()
        print(f"{len(hosts)} hosts: {n} creates in {wall:.1f} s", file=sys.stderr)
        return {"per_second": n / wall, "ms": [ms for _, ms in results], "per_node": per_node}
    finally:
        for c in clients:
            c.close()


def node_of_sandbox(srv, sandbox_id: str) -> str:
    """The node whose data directory holds the sandbox's machine."""
    return ((srv.root / "data" / "node.id").read_text().strip()
            if (srv.root / "data" / "vms" / sandbox_id).exists() else "")


def timed(f) -> float:
    t0 = time.perf_counter()
    f()
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", "--runs", type=int, default=20)
    ap.add_argument("--at-once", type=int, default=12)
    ap.add_argument("--binary", type=Path, default=REPO / "target" / "release" / "runtime")
    args = ap.parse_args()
    from withruntime import Runtime

    pg = Postgres()
    a = b = c = None
    burst: dict[str, dict] = {}
    try:
        a = OwnServer(args.binary, 600, ("--store", pg.url))
        b = OwnServer(args.binary, 600, ("--store", pg.url), secrets_key=a.root / "data" / "secrets.key")
        samples: dict[str, list[float]] = {k: [] for k, _ in METRICS}
        with Runtime(api_key=a.key, base_url=a.url) as ra, Runtime(api_key=a.key, base_url=b.url) as rb:
            sbx = ra.sandboxes.create(labels={"bench": "cluster"})
            via_a, via_b = ra.sandboxes.get(sbx.id), rb.sandboxes.get(sbx.id)
            via_a.exec("true")
            via_b.exec("true")
            for i in range(args.runs):
                samples["get_owner"].append(timed(lambda: ra.sandboxes.get(sbx.id)))
                samples["get_carried"].append(timed(lambda: rb.sandboxes.get(sbx.id)))
                samples["exec_owner"].append(timed(lambda: via_a.exec("true")))
                samples["exec_carried"].append(timed(lambda: via_b.exec("true")))
                made = []
                for key, rt in (("create_a", ra), ("create_b", rb)):
                    t0 = time.perf_counter()
                    made.append(rt.sandboxes.create(labels={"bench": "cluster"}))
                    samples[key].append((time.perf_counter() - t0) * 1000)
                for m in made:
                    m.delete()
                print(f"round {i + 1}/{args.runs}: exec {samples['exec_owner'][-1]:.1f} / "
                      f"{samples['exec_carried'][-1]:.1f} ms", file=sys.stderr)
            sbx.delete()
        c = OwnServer(args.binary, 600, ("--store", pg.url), secrets_key=a.root / "data" / "secrets.key")
        for hosts in ((a,), (a, b, c)):
            burst[f"{len(hosts)} hosts"] = creates_at_once(Runtime, a.key, hosts, args.at_once)
        accel = a.accelerator()
        sim = json.loads(subprocess.run([str(args.binary), "host", "simulate", "--hosts", "1000", "--creates",
                                         "100000", "--store", pg.url], check=True, capture_output=True,
                                        text=True, timeout=600).stdout)
    finally:
        for s in (a, b, c):
            if s is not None:
                s.close()
        pg.close()
    print(f"\nTwo control planes on one PostgreSQL, {args.runs} rounds, accelerator {accel}, "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print("| operation | median ms | p95 ms |")
    print("|---|---:|---:|")
    for key, label in METRICS:
        s = samples[key]
        print(f"| {label} | {statistics.median(s):.1f} | {percentile(s, 95):.1f} |")
    print(f"\n{args.at_once} creates at once, each until running, round robin over the nodes\n")
    print("| nodes | creates/s | median ms | p95 ms | made on (per node) |")
    print("|---|---:|---:|---:|---|")
    for label, r in burst.items():
        print(f"| {label} | {r['per_second']:.2f} | {statistics.median(r['ms']):.0f} | "
              f"{percentile(r['ms'], 95):.0f} | {' / '.join(str(n) for n in r['per_node'])} |")
    print(f"\nPlacement simulation: {sim['hosts']} hosts, {sim['creates']} creates\n")
    print("| measure | value |")
    print("|---|---:|")
    print(f"| decisions per second (every host ranked per create) | {sim['decisionsPerSecond']:.0f} |")
    print(f"| one decision, median / p95 µs | {sim['decisionP50Us']:.0f} / {sim['decisionP95Us']:.0f} |")
    print(f"| placed / refused | {sim['placed']} / {sim['refused']} |")
    print(f"| store reads a create adds for placement | {sim['storeReadsPerCreate']} "
          f"({sim['rowsPerRead']} rows) |")
    print(f"| that read on PostgreSQL, median / p95 ms | {sim['readP50Ms']:.2f} / {sim['readP95Ms']:.2f} |")
    print(f"| statements all hosts write each second (beats, lease tries) | "
          f"{sim['storeWritesPerSecondAllHosts']:.0f} |")
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cluster-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps({"accelerator": accel, "host": platform.node(), "runs": args.runs,
                                "samples": samples, "at_once": burst, "simulation": sim}, indent=1))
    print(f"\nsamples: {path.relative_to(REPO)}", file=sys.stderr)


if __name__ == "__main__":
    main()
