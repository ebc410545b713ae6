"""Network benchmarks: previews and egress through the agent channel.

    .venv/bin/python bench/network.py            # starts its own server
    .venv/bin/python bench/network.py -n 20

Starts a local HTTP server on the host holding a 32 MiB file and points the
server's TEST-ONLY egress map at it (`bench.example.net`). Then, through the
official client, in one sandbox:

- preview first byte: a GET of a small file from a server in the guest
  through a public preview, request sent until the first byte of the answer
  (a new connection into the guest each time), N runs;
- preview throughput: the 32 MiB file served by the guest, read through the
  preview (MiB/s), 3 runs;
- egress throughput: `curl` in the guest downloading the host's 32 MiB file
  through the agent's proxy and the host's egress proxy (MiB/s, from curl's
  own timing), 3 runs, beside the host's own download of the same file from
  the same server in the same run (the floor).

Prints Markdown and writes bench/results/network-<timestamp>.json.
"""
from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import statistics
import sys
import threading
import time
import urllib.request
from datetime import datetime, timezone
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import REPO, OwnServer, percentile  # noqa: E402

SIZE = 32 << 20


def host_server(root: Path) -> ThreadingHTTPServer:
    root.mkdir(parents=True, exist_ok=True)
    (root / "big.bin").write_bytes(hashlib.sha256(b"bench").digest() * (SIZE // 32))

    class Quiet(SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(root), **kw)

        def log_message(self, *_a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def first_byte_ms(port: int, host: str, path: str) -> float:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    start = time.perf_counter()
    c.request("GET", path, headers={"Host": host})
    r = c.getresponse()
    r.read(1)
    elapsed = (time.perf_counter() - start) * 1000
    r.read()
    c.close()
    assert r.status == 200, r.status
    return elapsed


def read_mib_s(port: int, host: str, path: str) -> float:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    start = time.perf_counter()
    c.request("GET", path, headers={"Host": host})
    r = c.getresponse()
    n = len(r.read())
    elapsed = time.perf_counter() - start
    c.close()
    assert n == SIZE, n
    return SIZE / (1 << 20) / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--runs", type=int, default=20)
    parser.add_argument("--binary", type=Path, default=REPO / "target" / "release" / "runtime")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    from withruntime import Runtime

    files = host_server(Path(__import__("tempfile").mkdtemp(prefix="runtime-bench-files-")))
    target = f"127.0.0.1:{files.server_address[1]}"
    own = OwnServer(args.binary, 1200, ("--egress-test-map", f"bench.example.net={target}"))
    results: dict[str, list[float]] = {"preview_first_byte_ms": [], "preview_mib_s": [],
                                       "egress_mib_s": [], "host_mib_s": []}
    try:
        with Runtime(api_key=own.key, base_url=own.url) as rt:
            sbx = rt.sandboxes.create()
            try:
                sbx.files.write("/tmp/site/small.txt", "x" * 1024)
                sbx.exec("head -c %d /dev/urandom > /tmp/site/big.bin" % SIZE)
                sbx.spawn("cd /tmp/site && python3 -m http.server 8000 --bind 127.0.0.1")
                sbx.previews.create(8000, visibility="public")
                host = f"8000-{sbx.id}.localhost:{own.port}"
                deadline = time.monotonic() + 60
                while True:
                    try:
                        first_byte_ms(own.port, host, "/small.txt")
                        break
                    except (AssertionError, OSError):
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.5)
                for _ in range(args.runs):
                    results["preview_first_byte_ms"].append(first_byte_ms(own.port, host, "/small.txt"))
                for _ in range(3):
                    results["preview_mib_s"].append(read_mib_s(own.port, host, "/big.bin"))
                for _ in range(3):
                    r = sbx.exec("curl -sS -o /dev/null -w '%{size_download} %{time_total}' "
                                 "http://bench.example.net/big.bin", timeout_ms=600_000)
                    size, seconds = r.stdout.split()
                    assert int(size) == SIZE, r.stdout + r.stderr
                    results["egress_mib_s"].append(SIZE / (1 << 20) / float(seconds))
                    start = time.perf_counter()
                    n = len(urllib.request.urlopen(f"http://{target}/big.bin", timeout=300).read())
                    assert n == SIZE
                    results["host_mib_s"].append(SIZE / (1 << 20) / (time.perf_counter() - start))
            finally:
                sbx.delete()
        accel = own.accelerator()
    finally:
        own.close()
        files.shutdown()
    summary = {k: {"median": statistics.median(v), "p95": percentile(v, 95), "samples": v}
               for k, v in results.items()}
    now = datetime.now(timezone.utc)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"network-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps({"date": now.isoformat(timespec="seconds"), "accelerator": accel,
                                "command": "python bench/network.py " + " ".join(sys.argv[1:]),
                                "metrics": summary}, indent=2) + "\n")
    print("| measure | median | p95 |\n|---|---:|---:|")
    print(f"| preview first byte, ms (n={args.runs}) | {summary['preview_first_byte_ms']['median']:.1f} | "
          f"{summary['preview_first_byte_ms']['p95']:.1f} |")
    for k, label in [("preview_mib_s", "preview download of 32 MiB, MiB/s (n=3)"),
                     ("egress_mib_s", "egress download of 32 MiB through the proxy, MiB/s (n=3)"),
                     ("host_mib_s", "the host's own download of the same file, MiB/s (n=3)")]:
        print(f"| {label} | {summary[k]['median']:.1f} | {summary[k]['p95']:.1f} |")
    print(f"\naccelerator: {accel}; samples in {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
