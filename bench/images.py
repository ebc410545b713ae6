"""Image benchmarks: builds cold and with a cached prefix; a build
context of 1,000 files uploaded and built, then again with one file
changed; creates from a custom image beside creates from the default image.

    .venv/bin/python bench/images.py            # starts its own server
    .venv/bin/python bench/images.py -n 5

Over N runs (default 5), in one server, through the official client: a
cold build of a small recipe (env variables, a workdir, a file and four
commands; each run's env differs, so nothing is cached) until
ready; the same recipe with only its last command changed (every step but
the last cached) until ready; then creates until running from the default
image and from the custom image, each after its shape's template is built
(2 vCPU, 1 GiB). No network in the recipe: the numbers are the build
machinery's, not a registry's.

The context: each run a fresh folder of 1,000 files (4 KiB each, in 10
directories, distinct per run) is packed by the client (the local floor:
`pack_context`, the tar and gzip alone), uploaded (`upload_context`: the
packing, `context/missing` and the chunks the server lacks) and built by
a Dockerfile that COPYs it and counts the files; then one file changes and
the same is timed again (only the changed chunks go; the COPY step and the
one after it run again, the base is cached). Prints Markdown and writes
bench/results/images-<timestamp>.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run import REPO, OwnServer, percentile  # noqa: E402

SHAPE = {"vcpu": 2, "memory_mib": 1024}
METRICS = [
    ("build_cold", "build of a small recipe, nothing cached (6 steps)"),
    ("build_cached_prefix", "rebuild with only the last step changed"),
    ("context_pack_local", "pack 1,000 files locally (tar + gzip, the client's floor)"),
    ("context_upload_cold", "upload a context of 1,000 files, nothing on the server"),
    ("context_build_cold", "build it (COPY . and one RUN) after the upload"),
    ("context_upload_one_changed", "upload again with one file changed"),
    ("context_build_one_changed", "rebuild with one file changed (COPY and RUN again)"),
    ("create_default", "create from the default image until running"),
    ("create_custom", "create from the custom image until running"),
]


def recipe(nonce: str, last: str) -> dict:
    return {
        # In every step's key: nothing of a new nonce's build is cached.
        "env": {"APP_MODE": "bench", "NONCE": nonce},
        "workdir": "/workspace/app",
        "files": {"/workspace/app/settings.txt": f"nonce={nonce}\n"},
        "commands": [f"echo {nonce} > nonce.txt", "python3 -c 'print(6*7)' > answer.txt",
                     "seq 1 10000 > numbers.txt", last],
    }


CONTEXT_DOCKERFILE = "FROM runtime\nCOPY . /workspace/ctx/\nRUN find /workspace/ctx -type f | wc -l > /workspace/count.txt\n"


def make_context(root: Path, nonce: str) -> None:
    for d in range(10):
        (root / f"d{d}").mkdir(parents=True, exist_ok=True)
        for f in range(100):
            body = (f"{nonce} {d} {f}\n" * 128)[:4096]
            (root / f"d{d}" / f"f{f}.txt").write_text(body)


def timed(f):
    t = time.perf_counter()
    out = f()
    return (time.perf_counter() - t) * 1000, out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--runs", type=int, default=5)
    parser.add_argument("--binary", type=Path, default=REPO / "target" / "release" / "runtime")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    from withruntime import Runtime
    from withruntime._sync_products.images import pack_context

    own = OwnServer(args.binary, 1200)
    s: dict[str, list[float]] = {k: [] for k, _ in METRICS}
    try:
        with Runtime(api_key=own.key, base_url=own.url) as rt:
            # Warm-up: the build machine's template and the default shape's.
            rt.images.build(name="bench-warm", recipe=recipe("warm", "true"), poll_seconds=0.2)
            rt.sandboxes.create(**SHAPE).delete()
            image = None
            for i in range(args.runs):
                nonce = uuid.uuid4().hex
                ms, image = timed(lambda: rt.images.build(name="bench", recipe=recipe(nonce, "echo a > last.txt"),
                                                          poll_seconds=0.2))
                s["build_cold"].append(ms)
                assert all(st["state"] == "done" for st in image["steps"]), image["steps"]
                ms, image = timed(lambda: rt.images.build(name="bench", recipe=recipe(nonce, "echo b > last.txt"),
                                                          poll_seconds=0.2))
                s["build_cached_prefix"].append(ms)
                assert [st["state"] for st in image["steps"]][-2:] == ["cached", "done"], image["steps"]
                print(f"run {i + 1}/{args.runs}: cold {s['build_cold'][-1]:.0f} ms, "
                      f"cached prefix {s['build_cached_prefix'][-1]:.0f} ms", file=sys.stderr)
                with tempfile.TemporaryDirectory() as tmp:
                    folder = Path(tmp)
                    make_context(folder, nonce)
                    ms, _ = timed(lambda: pack_context(str(folder)))
                    s["context_pack_local"].append(ms)
                    for kind in ("cold", "one_changed"):
                        if kind == "one_changed":
                            (folder / "d3" / "f7.txt").write_text(f"changed {nonce}\n")
                        ms, up = timed(lambda: rt.images.upload_context(str(folder)))
                        s[f"context_upload_{kind}"].append(ms)
                        ms, built = timed(lambda: rt.images.build(
                            name="bench-context", dockerfile=CONTEXT_DOCKERFILE, context=up["context"],
                            poll_seconds=0.2))
                        s[f"context_build_{kind}"].append(ms)
                        assert [st["state"] for st in built["steps"]] == ["done", "done"], built["steps"]
                print(f"run {i + 1}/{args.runs}: context upload {s['context_upload_cold'][-1]:.0f} ms, "
                      f"build {s['context_build_cold'][-1]:.0f} ms; one changed: "
                      f"{s['context_upload_one_changed'][-1]:.0f} + {s['context_build_one_changed'][-1]:.0f} ms",
                      file=sys.stderr)
            assert image is not None
            # The custom image's template for this shape: first create, then wait.
            rt.sandboxes.create(image=image["id"], **SHAPE).delete()
            time.sleep(20)
            for _ in range(args.runs):
                ms, sbx = timed(lambda: rt.sandboxes.create(**SHAPE))
                s["create_default"].append(ms)
                assert sbx.exec("true").exit_code == 0
                sbx.delete()
                ms, sbx = timed(lambda: rt.sandboxes.create(image=image["id"], **SHAPE))
                s["create_custom"].append(ms)
                assert sbx.exec("cat /workspace/app/last.txt").stdout == "b\n"
                sbx.delete()
        accel = own.accelerator()
    finally:
        own.close()
    summary = {k: {"median_ms": statistics.median(v), "p95_ms": percentile(v, 95), "samples_ms": v}
               for k, v in s.items()}
    now = datetime.now(timezone.utc)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"images-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps({"date": now.isoformat(timespec="seconds"), "accelerator": accel,
                                "command": "python bench/images.py " + " ".join(sys.argv[1:]),
                                "shape": SHAPE, "metrics": summary}, indent=2) + "\n")
    print(f"| operation (n={args.runs}) | median ms | p95 ms |\n|---|---:|---:|")
    for k, label in METRICS:
        print(f"| {label} | {summary[k]['median_ms']:.0f} | {summary[k]['p95_ms']:.0f} |")
    print(f"\naccelerator: {accel}; samples in {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
