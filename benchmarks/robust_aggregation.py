#!/usr/bin/env python
"""What each robust aggregator (--aggregator, ops/robust.py) costs over the weighted mean.

    python benchmarks/robust_aggregation.py                          # M = 10, 100, 1000
    python benchmarks/robust_aggregation.py --clients 10 100 --repeats 5 --rules median krum

M stacked client updates shaped like the default CNN's parameters (`--model cnn` on 28×28×1
images, 10 classes: 582,026 floats, four layers' kernels and biases), random normal float32, on
this machine's first device; each rule jitted on its own (f = ⌊M/10⌋ for Krum, Multi-Krum and
Bulyan, β = 0.1, RFA's and centered clipping's default iterations, medians for τ and ρ) and
timed after a warm-up call (compile excluded), interleaved with the weighted mean
(`core.mean_over_clients`, today's link) in each repeat; reported: the median time (ms) and the
median of the per-repeat ratios to the mean. A (rule, M) whose first call exceeds
`--max-seconds` is timed once only; `--skip RULE@M` leaves a pair out (Bulyan at M = 1,000 by
default: its coordinate stage holds about five [M, d] float32 temporaries, ~12 GB).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))          # this checkout's library

RULES = ("median", "trimmed_mean", "krum", "multi_krum", "bulyan", "geomed", "centered_clip",
         "norm_bound")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    p.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-seconds", type=float, default=20.0)
    p.add_argument("--skip", nargs="*", default=["bulyan@1000"])
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from fedjax_pfl import core, ops
    from fedjax_pfl.models import zoo
    from fedjax_pfl.ops import robust

    model = zoo.get("cnn", (28, 28, 1), 10)
    shapes = jax.eval_shape(model.init, jax.random.key(0))
    d = ops.tree_size(shapes)
    print(f"# CNN parameters d = {d:,}; device {jax.devices()[0]}; jax {jax.__version__}")
    print("| M | rule | ms (median) | × mean | repeats |")
    print("|---:|---|---:|---:|---:|")
    for m in args.clients:
        key = jax.random.key(m)
        leaves, treedef = jax.tree.flatten(shapes)
        keys = jax.random.split(key, len(leaves))
        stack = treedef.unflatten([jax.random.normal(k, (m, *s.shape), jnp.float32)
                                   for k, s in zip(keys, leaves)])
        weights = jnp.asarray(np.random.default_rng(m).integers(10, 100, m), jnp.float32)
        center = jax.tree.map(lambda x: jnp.zeros_like(x[0]), stack)
        f = m // 10

        def timed(fn, stack=stack, weights=weights):
            t = time.perf_counter()
            jax.block_until_ready(fn(stack, weights))
            return time.perf_counter() - t

        mean = jax.jit(lambda u, w: core.mean_over_clients(u, w))
        fns = {"mean": mean}
        for rule in args.rules:
            if f"{rule}@{m}" in args.skip:
                print(f"| {m} | {rule} | skipped | | |", flush=True)
                continue
            fns[rule] = jax.jit(lambda u, w, rule=rule: robust.aggregate(
                rule, u, w, center=center, f=f, beta=0.1))
        first = {}
        for name, fn in fns.items():          # warm-up: compile and one call
            timed(fn)
            first[name] = timed(fn)
        times: dict[str, list[float]] = {name: [first[name]] for name in fns}
        ratios: dict[str, list[float]] = {name: [first[name] / first["mean"]] for name in fns}
        for _ in range(args.repeats - 1):
            base = timed(mean)
            times["mean"].append(base)
            for name, fn in fns.items():
                if name == "mean" or first[name] > args.max_seconds:
                    continue
                t = timed(fn)
                times[name].append(t)
                ratios[name].append(t / base)
        for name in fns:
            print(f"| {m} | {name} | {statistics.median(times[name]) * 1e3:.1f} | "
                  f"{statistics.median(ratios[name]):.1f} | {len(times[name])} |", flush=True)
        del stack, timed                    # (the next M's stack replaces this one)


if __name__ == "__main__":
    main()
