#!/usr/bin/env python
"""Start-up: what a run pays before its first results, and what JAX's persistent compilation
cache saves of it on a second run.

    python benchmarks/startup.py pgfed                          # the CLI's default configuration
    python benchmarks/startup.py fedavg pgfedmo --run-args "--model cnn"
    PYTHONPATH=/path/to/other/checkout python benchmarks/startup.py pgfed    # another version
    python benchmarks/startup.py --cache fedavg pgfedmo --repeats 2          # the compilation cache
    FEDJAX_PFL_CPU_DEVICES=2 python benchmarks/startup.py --cache pgfedmo --repeats 1 \
        --run-args "--data-placement host"

Default: one fresh process per algorithm imports the library, runs `runner.prepare` on
experiments/run.py's flags (`--algo ALGO --quiet`, then --run-args: data, model, algorithm,
program), compiles the round and the evaluation, runs one round and the first evaluation, at XLA's
default flags and without the persistent cache, as `python experiments/run.py --algo ALGO` pays it
cold (the automatic chunk size's and evaluation batch's analyses included). Printed per algorithm:
seconds for imports and prepare, and for compile + round + evaluation. The library is the one
Python imports (PYTHONPATH first), so another checkout's can be timed with this script.

--cache: per algorithm and repeat, from an empty cache directory, three fresh processes of
`experiments/run.py --algo ALGO --rounds R --quiet` (then --run-args): with --no-compile-cache, the
first cached run (it fills the cache) and the second (it reads it). Printed: the compile seconds
that run's summary.json reports and the process's wall seconds. The three alternate within a
repeat, so the machine's drift hits them alike.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()     # (a child's imports are part of its start-up)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def in_process(algo: str, flags: list[str]) -> None:
    """One algorithm's start-up, timed from this process's start."""
    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import jax
    import run as cli

    from fedjax_pfl import runner

    prep = runner.prepare(cli.config_from_args(cli.parse(["--algo", algo, "--quiet", *flags])))
    state = prep.program.init(jax.random.fold_in(prep.root, 0))
    t1 = time.perf_counter()
    prep.program.compile(prep.round_keys)
    state, _ = prep.program.run_rounds(state, prep.round_keys, 0, 1)
    jax.block_until_ready(prep.program.evaluate(state))
    t2 = time.perf_counter()
    print(f"{algo}: imports and prepare {t1 - T0:.2f} s, compile + round + evaluation {t2 - t1:.2f} s",
          flush=True)


def cached_run(algo: str, rounds: int, cache: str, flags: list[str]) -> tuple[float, float]:
    """(compile seconds from summary.json, wall seconds of the process) of one CLI run."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "FEDJAX_PFL_COMPILE_CACHE": cache}
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "run.py"), "--algo", algo,
                        "--rounds", str(rounds), "--out", os.path.join(out, "run"), "--quiet",
                        *flags], check=True, env=env, capture_output=True)
        wall = time.perf_counter() - t0
        with open(os.path.join(out, "run", "summary.json")) as f:
            return json.load(f)["compile_time_s"], wall


def cache(args, flags: list[str]) -> None:
    print(f"{'algo':<10} {'repeat':>6} {'no cache':>18} {'first (fills)':>18} {'second (reads)':>18}")
    print(f"{'':<10} {'':>6} {'compile / wall s':>18} {'compile / wall s':>18} {'compile / wall s':>18}")
    for algo in args.algos:
        for r in range(args.repeats):
            with tempfile.TemporaryDirectory() as directory:
                off = cached_run(algo, args.rounds, directory, ["--no-compile-cache", *flags])
                first = cached_run(algo, args.rounds, directory, flags)
                second = cached_run(algo, args.rounds, directory, flags)
            cells = [f"{c:6.1f} / {w:6.1f}" for c, w in (off, first, second)]
            print(f"{algo:<10} {r:>6} {cells[0]:>18} {cells[1]:>18} {cells[2]:>18}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("algos", nargs="*", default=["pgfed"], help="algorithms (default pgfed)")
    p.add_argument("--cache", action="store_true",
                   help="compare fresh CLI runs with and without the persistent compilation cache")
    p.add_argument("--run-args", default="", help="more experiments/run.py flags, e.g. '--model cnn'")
    p.add_argument("--rounds", type=int, default=10, help="--cache: rounds a run (default 10)")
    p.add_argument("--repeats", type=int, default=2, help="--cache: repeats per algorithm (default 2)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    flags = shlex.split(args.run_args)
    if args.child:
        return in_process(args.algos[0], flags)
    if args.cache:
        return cache(args, flags)
    for algo in args.algos:        # each in a fresh process: imports and compilations are its own
        subprocess.run([sys.executable, os.path.abspath(__file__), "--child", algo,
                        f"--run-args={args.run_args}"], check=True)


if __name__ == "__main__":
    main()
