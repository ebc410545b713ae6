"""Docker inside a sandbox: starting the preinstalled engine, beside
installing it on demand (docs/environment.md, "Docker inside").

    .venv/bin/python bench/docker.py            # starts its own server
    .venv/bin/python bench/docker.py -n 5 --no-install

In one server and one run, through the official client, on fresh default
sandboxes (1 vCPU, 1 GiB): for each of N runs, `sudo enable-docker` until
the engine answers, then `docker info` and `docker ps` (a round trip to the
running engine), and the guest memory dockerd and containerd hold
(their RSS, from /proc). The reference, once unless --no-install: what
choosing "install on first use" would cost in the same run, the Debian
packages fetched from the image's own mirror through the sandbox's egress
proxy and unpacked (`apt-get update`, then `apt-get install --reinstall`
of the same packages), timed in one more sandbox. Prints Markdown and
writes bench/results/docker-<timestamp>.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import REPO, OwnServer, percentile  # noqa: E402

SHAPE = {"vcpu": 1, "memory_mib": 1024}
PACKAGES = "docker.io docker-cli containerd runc tini docker-compose iptables"
RSS = ("for p in $(pidof dockerd containerd); do awk '/^VmRSS/ {print $2}' /proc/$p/status; done"
       " | awk '{s += $1} END {print s}'")


def timed(sbx, command: str, timeout_ms: int = 900_000) -> tuple[float, str]:
    t = time.monotonic()
    r = sbx.exec(command, timeout_ms=timeout_ms)
    ms = (time.monotonic() - t) * 1000
    if r.exit_code != 0:
        sys.exit(f"`{command}` failed ({r.exit_code}):\n{(r.stdout + r.stderr)[-3000:]}")
    return ms, r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=3, help="fresh sandboxes that start the engine (default 3)")
    ap.add_argument("--no-install", action="store_true", help="skip the install-on-demand reference")
    ap.add_argument("--binary", type=Path, default=REPO / "target" / "release" / "runtime")
    args = ap.parse_args()

    from withruntime import Runtime, Sandbox

    server = OwnServer(args.binary, timeout=600)
    samples: dict[str, list[float]] = {"enable": [], "info": [], "ps": [], "rss_mib": []}
    install: dict[str, float] = {}
    try:
        with Runtime(api_key=server.key, base_url=server.url) as rt:
            for i in range(args.n):
                with Sandbox.create(client=rt, **SHAPE) as sbx:
                    ms, out = timed(sbx, "sudo enable-docker")
                    samples["enable"].append(ms)
                    samples["info"].append(timed(sbx, "docker info --format '{{.ServerVersion}}'")[0])
                    samples["ps"].append(timed(sbx, "docker ps -q")[0])
                    samples["rss_mib"].append(int(timed(sbx, RSS)[1].strip() or 0) / 1024)
                    print(f"run {i + 1}: enable-docker {ms:.0f} ms ({out.splitlines()[0]})", file=sys.stderr)
            if not args.no_install:
                with Sandbox.create(client=rt, **SHAPE) as sbx:
                    install["apt_update"], _ = timed(sbx, "sudo apt-get update -q")
                    install["apt_install"], out = timed(
                        sbx, f"sudo DEBIAN_FRONTEND=noninteractive apt-get install -q -y --reinstall {PACKAGES}")
                    got = [l for l in out.splitlines() if l.startswith(("Need to get", "Fetched"))]
                    install["fetched"] = " / ".join(got)
                    print(f"install: update {install['apt_update']:.0f} ms, install {install['apt_install']:.0f} ms"
                          f" ({install['fetched']})", file=sys.stderr)
        accel = server.accelerator()
    finally:
        server.close()

    def row(name: str, what: str, unit: str = "ms") -> str:
        s = samples[name]
        return f"| {what} | {statistics.median(s):.0f} / {percentile(s, 95):.0f} {unit} |"

    lines = [f"Accelerator: {accel}; n={args.n}, {SHAPE['vcpu']} vCPU, {SHAPE['memory_mib']} MiB.", "",
             "| operation | median / p95 |", "|---|---:|",
             row("enable", "`sudo enable-docker` on a fresh sandbox until the engine answers"),
             row("info", "`docker info` on the running engine"),
             row("ps", "`docker ps` on the running engine"),
             row("rss_mib", "guest memory of dockerd and containerd (RSS)", "MiB")]
    if install:
        lines += [f"| reference: `apt-get update` through the egress proxy | {install['apt_update']:.0f} ms |",
                  f"| reference: `apt-get install --reinstall` of the same packages | {install['apt_install']:.0f} ms |",
                  "", f"apt: {install['fetched']}"]
    print("\n".join(lines))
    out = REPO / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = out / f"docker-{stamp}.json"
    path.write_text(json.dumps({"accelerator": accel, "shape": SHAPE, "samples": samples, "install": install},
                               indent=2))
    print(f"\nwritten {path.relative_to(REPO)}", file=sys.stderr)


if __name__ == "__main__":
    main()
