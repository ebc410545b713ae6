"""Where the time of one short command goes (issue #18, "a shorter exec path").

    .venv/bin/python bench/exec_path.py            # starts its own server
    .venv/bin/python bench/exec_path.py -n 100     # more rounds

In one running sandbox, interleaved round by round (so a busy host slows
every figure alike), through the official client:

- `api_get`: `GET` of the sandbox's record: HTTP and the server, no guest;
- `file_read`: reading a 6-byte file: HTTP, the server, the channel and the
  agent, no process;
- `exec_argv`: `exec(["/bin/true"])`: no shell;
- `exec_builtin`: `exec("true")`: `bash -c true` (a builtin, no second program);
- `exec_shell_program`: `exec("/bin/true")`: bash, then the program;
- and the guest's own floor, measured inside the guest by one Python
  process: `posix_spawn` + `waitpid` of `/bin/true` (`guest_spawn`) and of
  `bash -c true` (`guest_spawn_bash`).

`exec_argv` minus `guest_spawn` is what the path adds (HTTP, the server, the
channel, the agent); the issue's goal is `exec_argv` (and `exec_builtin`)
at most 2 x `guest_spawn`. Prints a Markdown table and writes the samples to
bench/results/exec-path-<timestamp>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import REPO, OwnServer, percentile  # noqa: E402

METRICS = [
    ("api_get", "`GET` the sandbox (HTTP and server, no guest)"),
    ("file_read", "read a 6-byte file (HTTP, server, channel, agent; no process)"),
    ("exec_argv", "exec `[\"/bin/true\"]` (no shell)"),
    ("exec_builtin", "exec `\"true\"` (`bash -c`, a builtin)"),
    ("exec_shell_program", "exec `\"/bin/true\"` (`bash -c`, then the program)"),
    ("guest_spawn", "in the guest: spawn and reap `/bin/true` (floor)"),
    ("guest_spawn_bash", "in the guest: spawn and reap `bash -c true`"),
]

# Times `rounds` spawns of each program inside the guest, in milliseconds.
GUEST = r"""
import json, os, sys, time
out = {"guest_spawn": [], "guest_spawn_bash": []}
for _ in range(int(sys.argv[1])):
    for name, argv in (("guest_spawn", ["/bin/true"]), ("guest_spawn_bash", ["/bin/bash", "-c", "true"])):
        t = time.perf_counter()
        pid = os.posix_spawn(argv[0], argv, os.environ)
        os.waitpid(pid, 0)
        out[name].append((time.perf_counter() - t) * 1000)
print(json.dumps(out))
"""


def measure(rt, sbx, rounds: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name, _ in METRICS}
    sbx.files.write("/tmp/spawn.py", GUEST)
    sbx.files.write("/tmp/six", "six b\n")
    calls = [
        ("api_get", lambda: rt.sandboxes.get(sbx.id)),
        ("file_read", lambda: sbx.files.read("/tmp/six")),
        ("exec_argv", lambda: sbx.exec(["/bin/true"])),
        ("exec_builtin", lambda: sbx.exec("true")),
        ("exec_shell_program", lambda: sbx.exec("/bin/true")),
    ]
    for i in range(rounds):
        for name, call in calls:
            t = time.perf_counter()
            r = call()
            samples[name].append((time.perf_counter() - t) * 1000)
            if name.startswith("exec"):
                assert r.exit_code == 0, r
        # The guest's own floor, a few spawns per round, in the same rounds.
        r = sbx.exec(["python3", "/tmp/spawn.py", "5"])
        assert r.exit_code == 0, r
        for name, values in json.loads(r.stdout).items():
            samples[name].extend(values)
        print(f"round {i + 1}/{rounds}: " + ", ".join(f"{n} {samples[n][-1]:.1f} ms" for n, _ in METRICS),
              file=sys.stderr)
    return samples


def table(summary: dict[str, dict[str, float]], rounds: int) -> str:
    floor = summary["guest_spawn"]["median_ms"]
    lines = [f"| what (n={rounds} rounds) | median ms | p95 ms | x guest spawn |", "|---|---:|---:|---:|"]
    for name, label in METRICS:
        s = summary[name]
        lines.append(f"| {label} | {s['median_ms']:.1f} | {s['p95_ms']:.1f} | {s['median_ms'] / floor:.1f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--rounds", type=int, default=40)
    parser.add_argument("--binary", type=Path, default=REPO / "target" / "release" / "runtime")
    parser.add_argument("--start-timeout", type=float, default=1200)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()

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
            sbx = rt.sandboxes.create(labels={"bench": "exec-path"})
            try:
                measure(rt, sbx, 3)  # warm-up: page cache, the first bash and python3
                samples = measure(rt, sbx, args.rounds)
            finally:
                sbx.delete()
        accelerator = own.accelerator() if own else "unknown (external server)"
    finally:
        if own:
            own.close()

    summary = {name: {"median_ms": statistics.median(v), "p95_ms": percentile(v, 95), "samples_ms": v}
               for name, v in samples.items()}
    now = datetime.now(timezone.utc)
    result = {
        "date": now.isoformat(timespec="seconds").replace("+00:00", "Z"),
        "command": "python bench/exec_path.py " + " ".join(sys.argv[1:]),
        "rounds": args.rounds,
        "accelerator": accelerator,
        "client": f"withruntime {__version__}",
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
                 "kernel": platform.release(), "load1": os.getloadavg()[0]},
        "metrics": summary,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"exec-path-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(table(summary, args.rounds))
    print(f"\naccelerator: {accelerator}; load average {os.getloadavg()[0]:.1f}; samples in "
          f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
