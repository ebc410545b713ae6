"""Memory benchmarks: pause, wake, fork and snapshots beside a cold boot.

    .venv/bin/python bench/memory.py            # starts its own server
    .venv/bin/python bench/memory.py -n 20

Over N runs (default 20), in one server and one run, through the official
client: a cold create (boot) until running; pause until paused; wake until
running; wake through the next command (auto-wake by an exec); fork of one
until the copy runs; fork of four until all run; snapshot (memory) until
ready; create from that snapshot until running. Then host memory of the
QEMU processes (every page once, guest RAM files included, beside summed
PSS and RSS): one idle 1 GiB sandbox, four idle forks of it, and the peak
of ten idle sandboxes. Prints Markdown and writes
bench/results/memory-<timestamp>.json.

    .venv/bin/python bench/memory.py --density              # 1, 10 and 50 at once
    .venv/bin/python bench/memory.py --density --levels 1,10
    .venv/bin/python bench/memory.py --density --variants shared

With --density it measures idle density instead, on one server with its
defaults: for each level, that many idle 1 GiB sandboxes at once (created
one after another, each having run `true`, then left idle for 10 s), the
host MiB of their QEMU processes (as above, sampled five times a second
apart, the peak) and that per sandbox. It does so twice by default, on a
server with its defaults (`copied`: each restore copies the template's
memory) and on one with `--share-template-memory` (`shared`: restores map
the template's memory copy-on-write), and on each times what the sharing
costs: pause (the first after the template was made, then later ones),
wake, fork of one and a memory snapshot of a sandbox from the template.
Writes bench/results/density-<timestamp>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import REPO, OwnServer, percentile  # noqa: E402

SHAPE = {"vcpu": 1, "memory_mib": 1024}
METRICS = [
    ("cold_create", "create (cold boot, `--no-templates`) until running"),
    ("template_create", "create (from the pre-booted template) until running"),
    ("pause", "pause until paused"),
    ("wake", "wake until running"),
    ("wake_through_exec", "wake through the next command (auto-wake)"),
    ("fork_one", "fork of one until the copy runs"),
    ("fork_four", "fork of four until all run"),
    ("snapshot", "snapshot (memory) until ready"),
    ("create_from_snapshot", "create from a snapshot until running"),
]


def qemu_memory(server_root: Path, ids: list[str]) -> dict[str, float]:
    """Host memory (MiB) of the QEMU processes of these sandboxes.

    `host_mib` counts every page once: each process's own pages (its PSS
    less what it maps of guest RAM files) plus every guest RAM file mapped
    (its own on tmpfs, or a fork's frozen file, found through
    /proc/<pid>/map_files even once unlinked) at its whole allocated size,
    once however many machines map it. The copy-on-write pages a fork's copy
    wrote are its own (anonymous) and count with it. PSS and RSS are summed
    too.
    """
    pss = rss = own = 0
    files: dict[tuple[int, int], int] = {}
    found = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"qemu-system" not in cmd.split(b"\0", 1)[0] or str(server_root).encode() not in cmd:
            continue
        if not any(i.encode() in cmd for i in ids):
            continue
        found += 1
        ram_mapping = False
        mapping_pss = 0
        for line in (entry / "smaps").read_text().splitlines():
            fields = line.split()
            if "-" in fields[0] and ":" not in fields[0]:
                # A mapping's header: address range, perms, offset, dev, inode, path.
                path = fields[5] if len(fields) > 5 else ""
                ram_mapping = path.endswith(".ram")
                if ram_mapping:
                    st = os.stat(entry / "map_files" / fields[0])
                    files[(st.st_dev, st.st_ino)] = st.st_blocks * 512
            elif fields[0] == "Pss:":
                mapping_pss = int(fields[1])
                pss += mapping_pss
                own += mapping_pss
            elif fields[0] == "Rss:":
                rss += int(fields[1])
            elif ram_mapping and fields[0] == "Anonymous:":
                # The file's pages (counted once, below); its written
                # copy-on-write pages are this process's own.
                own -= mapping_pss - int(fields[1])
    assert found == len(ids), f"found {found} QEMU processes for {len(ids)} sandboxes"
    host = own * 1024 + sum(files.values())
    return {"host_mib": host / 2**20, "pss_mib": pss / 1024, "rss_mib": rss / 1024,
            "ram_files": len(files), "processes": found}


def timed(f):
    t = time.perf_counter()
    out = f()
    return (time.perf_counter() - t) * 1000, out


def cold(rt, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        ms, sbx = timed(lambda: rt.sandboxes.create(labels={"bench": "memory"}, **SHAPE))
        assert sbx.exec("true").exit_code == 0
        sbx.delete()
        out.append(ms)
    return out


def measure(rt, runs: int) -> dict[str, list[float]]:
    s: dict[str, list[float]] = {name: [] for name, _ in METRICS if name != "cold_create"}
    for i in range(runs):
        ms, sbx = timed(lambda: rt.sandboxes.create(labels={"bench": "memory"}, **SHAPE))
        s["template_create"].append(ms)
        assert sbx.exec("echo $((6*7)) > /tmp/x").exit_code == 0
        ms, _ = timed(sbx.pause)
        s["pause"].append(ms)
        assert sbx.state == "paused", sbx.info
        ms, _ = timed(sbx.wake)
        s["wake"].append(ms)
        assert sbx.state == "running", sbx.info
        sbx.pause()
        ms, r = timed(lambda: sbx.exec("cat /tmp/x"))
        s["wake_through_exec"].append(ms)
        assert r.stdout == "42\n", r
        ms, copy = timed(sbx.fork)
        s["fork_one"].append(ms)
        assert copy.exec("cat /tmp/x").stdout == "42\n"
        ms, copies = timed(lambda: sbx.fork(count=4))
        s["fork_four"].append(ms)
        assert len(copies) == 4
        ms, snap = timed(lambda: sbx.snapshot(name=f"bench-{i}"))
        s["snapshot"].append(ms)
        ms, from_snap = timed(lambda: rt.sandboxes.create(snapshot=snap["id"], labels={"bench": "memory"}))
        s["create_from_snapshot"].append(ms)
        assert from_snap.exec("cat /tmp/x").stdout == "42\n"
        for x in [sbx, copy, *copies, from_snap]:
            x.delete()
        rt.snapshots.delete(snap["id"])
        print(f"run {i + 1}/{runs}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in s.items()), file=sys.stderr)
    return s


def memory(rt, root: Path) -> dict[str, dict]:
    out = {}
    one = rt.sandboxes.create(labels={"bench": "memory"}, **SHAPE)
    one.exec("true")
    time.sleep(3)
    out["one_idle_1gib"] = qemu_memory(root, [one.id])
    forks = one.fork(count=4)
    time.sleep(3)
    out["four_idle_forks_of_it"] = qemu_memory(root, [f.id for f in forks])
    for f in [one, *forks]:
        f.delete()
    ten = [rt.sandboxes.create(labels={"bench": "memory"}, **SHAPE) for _ in range(10)]
    peak = {"host_mib": 0.0, "pss_mib": 0.0, "rss_mib": 0.0, "ram_files": 0, "processes": 10}
    for _ in range(5):
        time.sleep(1)
        m = qemu_memory(root, [t.id for t in ten])
        peak = {k: max(peak[k], m[k]) for k in peak}
    out["peak_ten_idle"] = peak
    for t in ten:
        t.delete()
    return out


def density(rt, root: Path, levels: list[int]) -> dict[str, dict]:
    """Host memory of `n` idle 1 GiB sandboxes at once, for each level."""
    out = {}
    for n in levels:
        made = []
        try:
            for _ in range(n):
                sbx = rt.sandboxes.create(labels={"bench": "density"}, **SHAPE)
                assert sbx.exec("true").exit_code == 0
                made.append(sbx)
            time.sleep(10)
            peak = {"host_mib": 0.0, "pss_mib": 0.0, "rss_mib": 0.0}
            for _ in range(5):
                m = qemu_memory(root, [x.id for x in made])
                peak = {k: max(peak[k], m[k]) for k in peak}
                time.sleep(1)
            peak["host_mib_per_sandbox"] = peak["host_mib"] / n
            out[str(n)] = peak
            print(f"{n} idle: host {peak['host_mib']:.0f} MiB, {peak['host_mib_per_sandbox']:.0f} per sandbox",
                  file=sys.stderr)
        finally:
            for x in made:
                x.delete()
        time.sleep(3)
    return out


CAPTURE_COSTS = [
    ("first_pause", "first pause after the template was made"),
    ("pause", "pause (later ones)"),
    ("wake", "wake until running"),
    ("fork_one", "fork of one until the copy runs"),
    ("snapshot", "memory snapshot until ready"),
]


def capture_costs(rt, runs: int) -> dict[str, list[float]]:
    """What pause, wake, fork and snapshot of a sandbox from the template
    take; the first pause apart (with shared memory it reads the template's
    whole file through the page cache)."""
    s: dict[str, list[float]] = {name: [] for name, _ in CAPTURE_COSTS}
    for i in range(runs + 1):
        sbx = rt.sandboxes.create(labels={"bench": "density"}, **SHAPE)
        assert sbx.exec("echo $((6*7)) > /tmp/x").exit_code == 0
        ms, _ = timed(sbx.pause)
        s["first_pause" if i == 0 else "pause"].append(ms)
        ms, _ = timed(sbx.wake)
        s["wake"].append(ms)
        assert sbx.exec("cat /tmp/x").stdout == "42\n"
        ms, copy = timed(sbx.fork)
        s["fork_one"].append(ms)
        assert copy.exec("cat /tmp/x").stdout == "42\n"
        ms, snap = timed(lambda: sbx.snapshot(name=f"density-{i}"))
        s["snapshot"].append(ms)
        for x in [copy, sbx]:
            x.delete()
        rt.snapshots.delete(snap["id"])
    return s


VARIANTS = {"copied": (), "shared": ("--share-template-memory",)}


def main_density(args) -> int:
    from withruntime import Runtime
    levels = [int(x) for x in args.levels.split(",")]
    variants = args.variants.split(",")
    load = os.getloadavg()[0]
    found: dict[str, dict] = {}
    costs: dict[str, dict] = {}
    for variant in variants:
        own = OwnServer(args.binary, 1200, VARIANTS[variant])
        try:
            with Runtime(api_key=own.key, base_url=own.url, timeout=600) as rt:
                # The first create of the shape boots and builds its template.
                rt.sandboxes.create(labels={"bench": "density"}, **SHAPE).delete()
                time.sleep(15)
                costs[variant] = capture_costs(rt, args.cost_runs)
                found[variant] = density(rt, own.root, levels)
            accel = own.accelerator()
        finally:
            own.close()
    now = datetime.now(timezone.utc)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"density-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps({"date": now.isoformat(timespec="seconds"), "accelerator": accel,
                                "command": "python bench/memory.py " + " ".join(sys.argv[1:]),
                                "load_average_at_start": load, "shape": SHAPE, "density": found,
                                "capture_costs_ms": costs},
                               indent=2) + "\n")
    print("| template memory | idle 1 GiB sandboxes at once | host MiB | host MiB per sandbox | PSS MiB | RSS MiB |\n"
          "|---|---:|---:|---:|---:|---:|")
    for variant, levels_found in found.items():
        for n, m in levels_found.items():
            print(f"| {variant} | {n} | {m['host_mib']:.0f} | {m['host_mib_per_sandbox']:.0f} | {m['pss_mib']:.0f} "
                  f"| {m['rss_mib']:.0f} |")
    print("\n| operation (1 vCPU, 1 GiB) | " + " | ".join(f"{v}: median / max ms" for v in costs) + " |\n"
          "|---|" + "---:|" * len(costs))
    for key, label in CAPTURE_COSTS:
        cells = [f"{statistics.median(costs[v][key]):.0f} / {max(costs[v][key]):.0f}" for v in costs]
        print(f"| {label} | " + " | ".join(cells) + " |")
    print(f"\naccelerator: {accel}; load average at start {load:.2f}; samples in {path.relative_to(REPO)}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--runs", type=int, default=20)
    parser.add_argument("--binary", type=Path, default=REPO / "target" / "release" / "runtime")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    parser.add_argument("--density", action="store_true",
                        help="host memory per idle 1 GiB sandbox, at each level of --levels at once")
    parser.add_argument("--levels", default="1,10,50")
    parser.add_argument("--variants", default="copied,shared",
                        help="template memory: copied (the default server), shared (--share-template-memory)")
    parser.add_argument("--cost-runs", type=int, default=3,
                        help="pauses, wakes, forks and snapshots timed after the first pause")
    args = parser.parse_args()
    if args.density:
        return main_density(args)
    from withruntime import Runtime

    # Cold boots first, on a server that never restores templates.
    booting = OwnServer(args.binary, 1200, ("--no-templates",))
    try:
        with Runtime(api_key=booting.key, base_url=booting.url) as rt:
            cold(rt, 1)
            cold_samples = cold(rt, args.runs)
    finally:
        booting.close()
    own = OwnServer(args.binary, 1200)
    try:
        with Runtime(api_key=own.key, base_url=own.url) as rt:
            # The first create of the shape boots and builds its template.
            first = rt.sandboxes.create(labels={"bench": "memory"}, **SHAPE)
            time.sleep(15)
            first.delete()
            measure(rt, 1)  # warm-up
            samples = measure(rt, args.runs)
            samples["cold_create"] = cold_samples
            mem = memory(rt, own.root)
        accel = own.accelerator()
    finally:
        own.close()
    summary = {k: {"median_ms": statistics.median(v), "p95_ms": percentile(v, 95), "samples_ms": v}
               for k, v in samples.items()}
    now = datetime.now(timezone.utc)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"memory-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps({"date": now.isoformat(timespec="seconds"), "accelerator": accel,
                                "command": "python bench/memory.py " + " ".join(sys.argv[1:]),
                                "shape": SHAPE, "metrics": summary, "memory": mem}, indent=2) + "\n")
    print(f"| operation (n={args.runs}, 1 vCPU, 1 GiB) | median ms | p95 ms |\n|---|---:|---:|")
    for k, label in METRICS:
        print(f"| {label} | {summary[k]['median_ms']:.0f} | {summary[k]['p95_ms']:.0f} |")
    print("\n| host memory of the QEMU processes | host MiB | PSS MiB | RSS MiB |\n|---|---:|---:|---:|")
    for k, label in [("one_idle_1gib", "one idle 1 GiB sandbox"), ("four_idle_forks_of_it", "four idle forks of it"),
                     ("peak_ten_idle", "peak of ten idle 1 GiB sandboxes")]:
        print(f"| {label} | {mem[k]['host_mib']:.0f} | {mem[k]['pss_mib']:.0f} | {mem[k]['rss_mib']:.0f} |")
    print(f"\naccelerator: {accel}; samples in {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
