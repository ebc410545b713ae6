"""Registry image benchmarks: pulls cold, with the blobs cached, with the
unpacked layer cached; creates from a pulled image beside creates from the
default image.

    .venv/bin/python bench/registry_images.py            # starts its own server and registry
    .venv/bin/python bench/registry_images.py -n 5

A real registry (Debian's docker-registry, tests/e2e/pull_registry.py) on
loopback plays `registry.example.com` (a test CA made here, given to the
server with the test-only egress flags). Each run pushes an image of about
3 MiB compressed (the host's bash with its libraries, busybox, and a file
that makes its layers new), then through the official client, until
ready: `images.build(image=...)` of it (pull, unpack in a machine, layer
kept); of a second manifest with the same layers and another config (blobs
cached, unpacked again); of the first again (manifest fetched, layer
cached). Then creates until running (2 vCPU, 1 GiB) from the default image
and from the pulled image, each after its shape's template is built.
Prints Markdown and writes bench/results/registry-images-<timestamp>.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "e2e"))
from run import REPO, OwnServer, percentile  # noqa: E402
from pull_registry import NAME, Layer, Registry, base_layer  # noqa: E402

SHAPE = {"vcpu": 2, "memory_mib": 1024}
METRICS = [
    ("pull_cold", "image= build of a new ~3 MiB image (pull, unpack, keep)"),
    ("pull_blobs_cached", "same layers, another manifest (blobs cached, unpacked again)"),
    ("pull_layer_cached", "the same reference again (manifest only, layer cached)"),
    ("create_default", "create from the default image until running"),
    ("create_pulled", "create from the pulled image until running"),
]


def timed(f):
    t = time.perf_counter()
    out = f()
    return (time.perf_counter() - t) * 1000, out


def make_ca(root: Path) -> tuple[Path, Path]:
    root.mkdir(parents=True, exist_ok=True)
    key, pem = root / "ca.key", root / "ca.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=runtime bench CA", "-keyout", str(key), "-out", str(pem),
                    "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign"],
                   check=True, capture_output=True, timeout=60)
    return pem, key


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--runs", type=int, default=5)
    parser.add_argument("--binary", type=Path, default=REPO / "target" / "release" / "runtime")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    from withruntime import Runtime

    import tempfile
    scratch = Path(tempfile.mkdtemp(prefix="runtime-bench-registry-"))
    pem, key = make_ca(scratch / "ca")
    reg = Registry(scratch / "registry", pem, key)
    own = OwnServer(args.binary, 1200, (*reg.args, "--egress-test-root", str(pem)))
    s: dict[str, list[float]] = {k: [] for k, _ in METRICS}
    try:
        with Runtime(api_key=own.key, base_url=own.url) as rt:
            rt.sandboxes.create(**SHAPE).delete()
            image = None
            for i in range(args.runs):
                nonce = uuid.uuid4().hex
                layer = base_layer().file("nonce", nonce.encode()).bytes()
                cfg = {"Env": ["PATH=/bin", f"NONCE={nonce}"], "Cmd": ["sleep", "600"]}
                reg.image("bench/app", nonce, [(layer, "gzip")], cfg)
                reg.image("bench/app", nonce + "-b", [(layer, "gzip")], {**cfg, "WorkingDir": "/srv"})
                ref = f"{NAME}/bench/app:{nonce}"
                ms, image = timed(lambda: rt.images.build(name="bench-pull", image=ref, poll_seconds=0.2))
                assert image["state"] == "ready", image["error"]
                s["pull_cold"].append(ms)
                ms, other = timed(lambda: rt.images.build(image=ref + "-b", poll_seconds=0.2))
                assert other["state"] == "ready" and "pulled" not in other["log"].replace("pulled from", "")
                s["pull_blobs_cached"].append(ms)
                ms, again = timed(lambda: rt.images.build(image=ref, poll_seconds=0.2))
                assert again["state"] == "ready" and "(cached)" in again["log"]
                s["pull_layer_cached"].append(ms)
                print(f"run {i + 1}/{args.runs}: cold {s['pull_cold'][-1]:.0f} ms, blobs cached "
                      f"{s['pull_blobs_cached'][-1]:.0f} ms, layer cached {s['pull_layer_cached'][-1]:.0f} ms",
                      file=sys.stderr)
            assert image is not None
            rt.sandboxes.create(image=image["id"], **SHAPE).delete()
            time.sleep(20)
            for _ in range(args.runs):
                ms, sbx = timed(lambda: rt.sandboxes.create(**SHAPE))
                s["create_default"].append(ms)
                assert sbx.exec("true").exit_code == 0
                sbx.delete()
                ms, sbx = timed(lambda: rt.sandboxes.create(image=image["id"], **SHAPE))
                s["create_pulled"].append(ms)
                assert sbx.exec("echo $NONCE").stdout.strip()
                sbx.delete()
        accel = own.accelerator()
    finally:
        own.close()
        reg.close()
    summary = {k: {"median_ms": statistics.median(v), "p95_ms": percentile(v, 95), "samples_ms": v}
               for k, v in s.items()}
    now = datetime.now(timezone.utc)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"registry-images-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps({"date": now.isoformat(timespec="seconds"), "accelerator": accel,
                                "command": "python bench/registry_images.py " + " ".join(sys.argv[1:]),
                                "shape": SHAPE, "metrics": summary}, indent=2) + "\n")
    print(f"| operation (n={args.runs}) | median ms | p95 ms |\n|---|---:|---:|")
    for k, label in METRICS:
        print(f"| {label} | {summary[k]['median_ms']:.0f} | {summary[k]['p95_ms']:.0f} |")
    print(f"\naccelerator: {accel}; samples in {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
