"""Our create through the first command beside what other isolation costs
(issue #18, "peers").

    .venv/bin/python bench/peers.py            # starts its own server
    .venv/bin/python bench/peers.py -n 20      # more rounds

Interleaved round by round (so a busy host slows every figure alike), each
round times one fresh isolated `python3 -c pass`:

- `runtime`: a sandbox's create through its first `python3 -c pass`, through
  the official client, on a server the benchmark starts with its defaults
  (templates and the warm pool on), and of it the create until running;
  the delete that follows is not timed;
- `runsc`: `runsc --network=none do python3 -c pass`: a gVisor sandbox
  (its default platform, systrap; no KVM) over the host's root, made and
  torn down by the one command;
- `bwrap`: `bwrap --unshare-all` with the host's root read-only, a fresh
  /dev, /proc and /tmp: namespaces only, the host's kernel;
- `local`: a plain `python3 -c pass` on the host (the floor).

It needs, beside the server's own: Debian's `bubblewrap` (`bwrap`) and
`runsc` (bookworm-backports carries a 2024 gVisor) on PATH; a peer whose
program is missing is left out of the table (and named). Runs as root (as
the e2e suite does). Prints a Markdown table and writes the samples to
bench/results/peers-<timestamp>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import REPO, OwnServer, percentile  # noqa: E402

PYTHON = ["python3", "-c", "pass"]
PEERS = {
    "runsc": ["runsc", "--network=none", "do", *PYTHON],
    "bwrap": ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
              "--unshare-all", "--die-with-parent", *PYTHON],
    "local": PYTHON,
}
LABELS = {
    "runtime": "runtime: create through first `python3 -c pass` (microVM, TCG)",
    "runtime_running": "of it: create until running",
    "runsc": "gVisor `runsc do python3 -c pass` (systrap)",
    "bwrap": "bubblewrap `--unshare-all` `python3 -c pass` (namespaces)",
    "local": "local `python3 -c pass` (floor)",
}


def run_peer(argv: list[str]) -> float:
    t = time.perf_counter()
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=300)
    took = (time.perf_counter() - t) * 1000
    if done.returncode != 0:
        sys.exit(f"{argv[0]} failed ({done.returncode}): {done.stderr.decode(errors='replace')[-2000:]}")
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--rounds", type=int, default=10)
    parser.add_argument("--binary", type=Path, default=REPO / "target" / "release" / "runtime")
    parser.add_argument("--start-timeout", type=float, default=1200)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()

    from withruntime import Runtime, __version__

    peers = {name: argv for name, argv in PEERS.items() if shutil.which(argv[0])}
    missing = sorted(set(PEERS) - set(peers))
    if missing:
        print(f"left out (not installed): {', '.join(missing)}", file=sys.stderr)
    load = os.getloadavg()[0]
    own = OwnServer(args.binary, args.start_timeout)
    samples: dict[str, list[float]] = {"runtime": [], "runtime_running": [], **{name: [] for name in peers}}
    try:
        with Runtime(api_key=own.key, base_url=own.url, timeout=600) as rt:

            def ours() -> float:
                t = time.perf_counter()
                sbx = rt.sandboxes.create(labels={"bench": "peers"})
                running = (time.perf_counter() - t) * 1000
                first = sbx.exec(PYTHON)
                took = (time.perf_counter() - t) * 1000
                assert first.exit_code == 0, first
                sbx.delete()
                samples["runtime_running"].append(running)
                return took

            # One untimed warm-up of each (templates, page cache).
            ours()
            samples["runtime_running"].clear()
            for argv in peers.values():
                run_peer(argv)
            for i in range(args.rounds):
                samples["runtime"].append(ours())
                for name, argv in peers.items():
                    samples[name].append(run_peer(argv))
                print(f"round {i + 1}/{args.rounds}: "
                      + ", ".join(f"{k} {v[-1]:.0f} ms" for k, v in samples.items()), file=sys.stderr)
        accelerator = own.accelerator()
    finally:
        own.close()

    floor = statistics.median(samples["local"]) if samples.get("local") else float("nan")
    lines = [f"| what (n={args.rounds} rounds) | median ms | p95 ms | × local python |",
             "|---|---:|---:|---:|"]
    for name, v in samples.items():
        med = statistics.median(v)
        lines.append(f"| {LABELS[name]} | {med:.0f} | {percentile(v, 95):.0f} | {med / floor:.1f} |")
    versions = {}
    for name in ("runsc", "bwrap"):
        if name in peers:
            out = subprocess.run([name, "--version"], capture_output=True, text=True)
            versions[name] = (out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else ""
    now = datetime.now(timezone.utc)
    result = {
        "date": now.isoformat(timespec="seconds").replace("+00:00", "Z"),
        "command": "python bench/peers.py " + " ".join(sys.argv[1:]),
        "rounds": args.rounds,
        "accelerator": accelerator,
        "load_average_at_start": load,
        "client": f"withruntime {__version__}",
        "peers": {name: " ".join(argv) for name, argv in peers.items()},
        "versions": versions,
        "left_out": missing,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "kernel": platform.release()},
        "samples_ms": samples,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"peers-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(lines))
    print(f"\naccelerator: {accelerator}; load average at start {load:.2f}; versions {versions}; samples in "
          f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
