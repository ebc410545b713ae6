"""Interpreter benchmarks: first run and next run per language.

    .venv/bin/python bench/interpreter.py          # starts its own server
    .venv/bin/python bench/interpreter.py -n 3 --languages python,r

For each of N rounds, one fresh sandbox (default shape); in it, for each
language in turn: the first run of its default context (the kernel starts:
`contextStarted: true`), then M next runs in the same process. Each run is a
small cell that uses state (defines, then reads a variable), timed from the
client's call to its answer through the official client. Prints Markdown
and writes bench/results/interpreter-<timestamp>.json.
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

# (first cell, next cell, the next cell's text/plain or stdout)
CELLS = {
    "python": ("n = 20", "n + 1", "21"),
    "javascript": ("var n = 20", "n + 1", "21"),
    "typescript": ("var n: number = 20", "n + 1", "21"),
    "r": ("n <- 20", "n + 1", "[1] 21"),
    "java": ("int n = 20;", "n + 1", "21"),
    "bash": ("n=20", "echo $((n + 1))", "21\n"),
    "go": ("n := 20", "n + 1", "21"),
}


def timed(f):
    t = time.perf_counter()
    out = f()
    return (time.perf_counter() - t) * 1000, out


def shown(run: dict) -> str:
    for r in run["results"]:
        if r["main"]:
            return r["data"]["text/plain"]
    return run["stdout"]


def round_(rt, languages: list[str], nexts: int, samples: dict) -> None:
    sbx = rt.sandboxes.create(labels={"bench": "interpreter"})
    try:
        for lang in languages:
            first, nxt, want = CELLS[lang]
            ms, run = timed(lambda: sbx.interpreter.run(first, language=lang, timeout_ms=300_000))
            assert run["status"] == "ok" and run["contextStarted"], (lang, run)
            samples[lang]["first"].append(ms)
            for _ in range(nexts):
                ms, run = timed(lambda: sbx.interpreter.run(nxt, language=lang, timeout_ms=300_000))
                assert run["status"] == "ok" and not run["contextStarted"], (lang, run)
                assert shown(run) == want, (lang, run)
                samples[lang]["next"].append(ms)
    finally:
        sbx.delete()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--runs", type=int, default=3, help="fresh sandboxes (first runs per language)")
    parser.add_argument("-m", "--next", type=int, default=5, help="next runs per language and sandbox")
    parser.add_argument("--languages", default=",".join(CELLS))
    parser.add_argument("--binary", type=Path, default=REPO / "target" / "release" / "runtime")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    languages = [lang for lang in args.languages.split(",") if lang]
    from withruntime import Runtime

    own = OwnServer(args.binary, 1200)
    samples = {lang: {"first": [], "next": []} for lang in languages}
    try:
        with Runtime(api_key=own.key, base_url=own.url) as rt:
            for _ in range(args.runs):
                round_(rt, languages, args.next, samples)
        accel = own.accelerator()
    finally:
        own.close()

    def stats(v):
        return {"median_ms": statistics.median(v), "p95_ms": percentile(v, 95), "samples_ms": v}

    summary = {lang: {k: stats(v) for k, v in s.items()} for lang, s in samples.items()}
    now = datetime.now(timezone.utc)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"interpreter-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps({"date": now.isoformat(timespec="seconds"), "accelerator": accel,
                                "command": "python bench/interpreter.py " + " ".join(sys.argv[1:]),
                                "metrics": summary}, indent=2) + "\n")
    print(f"| language | first run (n={args.runs}) median ms | p95 ms "
          f"| next run (n={args.runs * args.next}) median ms | p95 ms |")
    print("|---|---:|---:|---:|---:|")
    for lang in languages:
        f, n = summary[lang]["first"], summary[lang]["next"]
        print(f"| {lang} | {f['median_ms']:.0f} | {f['p95_ms']:.0f} | {n['median_ms']:.0f} | {n['p95_ms']:.0f} |")
    print(f"\naccelerator: {accel}; samples in {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
