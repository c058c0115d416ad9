#!/usr/bin/env python
"""First and second run of the same configuration with JAX's persistent compilation cache (the
CLI's default), against --no-compile-cache: compile seconds and wall seconds, as summary.json
and the process report them.

    python benchmarks/compile_cache.py --algos fedavg pgfedmo --repeats 2
    python benchmarks/compile_cache.py --algos pgfedmo -- --data-placement host

Flags after `--` go to every run (`experiments/run.py`'s flags).

Each repeat starts from an empty cache directory and runs, in fresh processes: the uncached run,
the first cached run (which fills the cache) and the second (which reads it). The three alternate
within a repeat, so machine noise hits them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_run(algo: str, rounds: int, cache: str, extra: list[str]) -> tuple[float, float]:
    """(compile seconds from summary.json, wall seconds of the process)."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "FEDJAX_PFL_COMPILE_CACHE": cache}
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "run.py"), "--algo", algo,
                        "--rounds", str(rounds), "--out", os.path.join(out, "run"), "--quiet",
                        *extra], check=True, env=env, capture_output=True)
        wall = time.perf_counter() - t0
        with open(os.path.join(out, "run", "summary.json")) as f:
            return json.load(f)["compile_time_s"], wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algos", nargs="+", default=["fedavg", "pgfedmo"])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("extra", nargs="*", help="flags for experiments/run.py (after --)")
    args = p.parse_args()
    print(f"{'algo':<10} {'repeat':>6} {'no cache':>18} {'first (fills)':>18} {'second (reads)':>18}")
    print(f"{'':<10} {'':>6} {'compile / wall s':>18} {'compile / wall s':>18} {'compile / wall s':>18}")
    for algo in args.algos:
        for r in range(args.repeats):
            with tempfile.TemporaryDirectory() as cache:
                off = one_run(algo, args.rounds, cache, ["--no-compile-cache", *args.extra])
                first = one_run(algo, args.rounds, cache, args.extra)
                second = one_run(algo, args.rounds, cache, args.extra)
            cells = [f"{c:6.1f} / {w:6.1f}" for c, w in (off, first, second)]
            print(f"{algo:<10} {r:>6} {cells[0]:>18} {cells[1]:>18} {cells[2]:>18}", flush=True)


if __name__ == "__main__":
    main()
