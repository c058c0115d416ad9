#!/usr/bin/env python
"""Where a round's time goes, per XLA op: the engine's round on PGFed's CNN protocol (as
protocol_step.py), traced with jax.profiler and summed per HLO instruction.

    python benchmarks/profile_round.py fedavg 100                           # 2 devices
    FEDJAX_PFL_CPU_DEVICES=1 taskset -c 0 python benchmarks/profile_round.py fedavg 100   # one core

Arguments: algorithm, local steps per client, then run.py flags. Prints the round's ms per local
step, then the top ops: µs per local step, calls, output shape and the op's source (jax op_name),
so each line names the layer and pass it belongs to. Times are summed over threads, so with two
devices they add up to about twice the wall time.
"""

from __future__ import annotations

import collections
import glob
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_pytorch import _engine  # noqa: E402  (the protocol's run.py flags, one definition)


def op_sources(hlo_text: str) -> dict[str, tuple[str, str]]:
    """HLO instruction name -> (output shape, jax op_name) from a compiled module's text."""
    out = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ", line)
        if m:
            src = re.search(r'op_name="([^"]*)"', line)
            out[m.group(1)] = (m.group(2)[:36], src.group(1) if src else "")
    return out


def main(argv: list[str]) -> None:
    algo, steps, flags = argv[0], argv[1], argv[2:]
    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()      # as run.py and vs_pytorch.py: one XLA device per core
    prep = _engine(algo, "iid", ["--local-steps", steps, *flags])
    program = prep.program
    program.compile(prep.round_keys)
    state = program.init(jax.random.fold_in(prep.root, 0))
    times = []
    for r in range(3):                      # the first is a warm-up
        t0 = time.perf_counter()
        state, metrics = program.run_rounds(state, prep.round_keys, r, 1)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
    n = int(np.sum(metrics[0]["client_steps"]))
    print(f"{algo}: {1000 * min(times[1:]) / n:.2f} ms a local step ({n} steps a round)")
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        state, _ = program.run_rounds(state, prep.round_keys, 3, 1)
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        trace = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
        profile = jax.profiler.ProfileData.from_file(trace)
    total, calls = collections.Counter(), collections.Counter()
    for plane in profile.planes:
        for line in plane.lines:
            if "Eigen" not in line.name and "XLA" not in line.name:
                continue
            for event in line.events:
                if not event.name.startswith("ThunkExecutor"):
                    total[event.name] += event.duration_ns
                    calls[event.name] += 1
    sources = op_sources(program._round_compiled.as_text())
    print(f"{'us/step':>8} {'calls':>6}  {'op':28} {'shape':36} source")
    for name, ns in total.most_common(30):
        shape, src = sources.get(name, ("", ""))
        print(f"{ns / 1e3 / n:8.1f} {calls[name]:6d}  {name[:28]:28} {shape:36} {src[-90:]}")
    # The same time grouped by pass, layer and op (e.g. every dynamic_update_slice of conv 2's
    # col2im together), since one jax op can become many XLA instructions.
    groups = collections.Counter()
    for name, ns in total.items():
        src = sources.get(name, ("", ""))[1]
        pass_ = "backward" if "transpose(" in src else "forward" if "jvp(" in src else "other"
        groups[f"{pass_} {'/'.join(src.split('/')[-2:])}"] += ns
    print(f"\n{'us/step':>8}  pass, layer/op")
    for group, ns in groups.most_common(25):
        print(f"{ns / 1e3 / n:8.1f}  {group}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["fedavg", "100"])
