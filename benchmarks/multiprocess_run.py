"""A run of `experiments/run.py` over P processes on the loopback address (one CPU device each),
reporting each process's wall time and peak resident memory (`os.wait4`'s ru_maxrss).

    python benchmarks/multiprocess_run.py [--processes 2] [--tree DIR] -- RUN.PY FLAGS...

`--tree` runs another checkout's `experiments/run.py` (a `git worktree` of an older commit), for
before/after figures taken one after the other on the same machine. `--out` is added (a fresh
temporary directory) unless the flags give one. The figures in benchmarks/RESULTS.md §19
("Large Synthetic runs over two processes") come from

    python benchmarks/multiprocess_run.py -- --algo ditto --dataset synthetic \\
        --synthetic-clients 20000 --participation 1.0 --local-steps 1 --rounds 1 \\
        --checkpoint-every 1 --state-placement host --data-placement device --no-compile-cache
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--tree", default=ROOT, help="the checkout whose experiments/run.py runs")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="-- then experiments/run.py's flags")
    args = parser.parse_args(argv)
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    if args.processes < 1:
        parser.error("--processes must be at least 1")
    out = [] if "--out" in flags else ["--out", tempfile.mkdtemp(prefix="fedjax_pfl_mp_")]
    tree = os.path.abspath(args.tree)
    env = {**os.environ, "FEDJAX_PFL_CPU_DEVICES": "1", "PYTHONPATH": tree}
    port = _free_port()
    started = time.perf_counter()
    procs = {}
    for k in range(args.processes):
        cmd = [sys.executable, os.path.join(tree, "experiments", "run.py"), *flags, *out, "--quiet",
               "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(args.processes),
               "--process-id", str(k)]
        log = open(os.path.join(tempfile.gettempdir(), f"fedjax_pfl_mp_{port}_{k}.log"), "w")
        procs[subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).pid] = (k, log)
    results = {}
    while procs:
        pid, status, usage = os.wait4(-1, 0)
        if pid not in procs:
            continue
        k, log = procs.pop(pid)
        log.close()
        results[k] = (os.waitstatus_to_exitcode(status), time.perf_counter() - started,
                      usage.ru_maxrss / 2**20)
    print(f"tree {tree}, {args.processes} processes, flags: {' '.join(flags)}")
    for k in sorted(results):
        code, wall, rss = results[k]
        print(f"  process {k}: exit {code}, wall {wall:.1f} s, peak RSS {rss:.2f} GB "
              f"(log {tempfile.gettempdir()}/fedjax_pfl_mp_{port}_{k}.log)")
    return max(code != 0 for code, _, _ in results.values())


if __name__ == "__main__":
    sys.exit(main())
