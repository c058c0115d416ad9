#!/usr/bin/env python
"""TDPFed benchmarks: the CP layers' two forwards, and a TDPFed round, engine vs loop backend.

    python benchmarks/tdpfed_bench.py cp-forward      # factored vs reconstruct-then-dense
    python benchmarks/tdpfed_bench.py round           # tdpfed round at 20 and 200 clients

Every configuration runs in a fresh subprocess on MNIST-shaped (or CIFAR-shaped, for VGG8)
random uint8 data, with the engine's default two XLA:CPU devices (`use_cpu_cores`); the loop
backend runs one client at a time. Printed as JSON lines (and appended to --json).

cp-forward: FedAvg training of CP-DNN (784-100-10) and CP-VGG8 at CR 2 whose layers use the
  factored forward (TDPFed eqs. 4, 7–10) or reconstruct the kernel first, under the engine's
  automatic chunked backend: client-steps/s, and the time to evaluate one global CP model on
  every client's test split (Evaluator.shared).
round: tdpfed with the paper's MNIST setting (τ = 23, s = 5, s' = 17, |B| = 20, CR 2, AFM, Adam)
  on the 784-100-10 DNN: seconds per round (median of the timed rounds after the first).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _data(n, per, shape):
    import numpy as np

    from fedjax_pfl.data.federated import FederatedData

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n * per + n * 50, *shape), dtype=np.uint8)
    y = rng.integers(0, 10, x.shape[0])
    train = [np.arange(i * per, (i + 1) * per) for i in range(n)]
    test = [n * per + np.arange(i * 50, (i + 1) * 50) for i in range(n)]
    return FederatedData.from_arrays(x, y, train, test, num_classes=10, input_scale=2 / 255,
                                     input_shift=-1.0)


def _timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def run_one(cfg: dict) -> dict:
    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()
    import jax

    from fedjax_pfl import algorithms, core, models
    from fedjax_pfl.models import cp

    out = dict(cfg)
    if cfg["kind"] == "cp-forward":
        shape = (28, 28, 1) if cfg["model"] == "cp_mlp" else (32, 32, 3)
        data = _data(cfg["clients"], 100, shape)
        factored = cfg["forward"] == "factored"
        module = (cp.CPMLP(10, cr=2.0, factored=factored) if cfg["model"] == "cp_mlp"
                  else cp.CPVGG8(10, cr=2.0, factored=factored))
        model = models.from_flax(module, shape)
        algo = algorithms.get("fedavg", model=model, participation=1.0, batch_size=20,
                              local_steps=cfg["steps"], lr=0.01)
        state = jax.jit(algo.init)(jax.random.key(0), data)
        mesh = core.client_mesh()
        data, state = core.replicate((data, state), mesh)
        step = jax.jit(algo.round_fn)
        state, m = step(state, data, jax.random.key(0))
        jax.block_until_ready(state)
        steps = int(m["client_steps"])

        def one_round():
            nonlocal state
            state, _ = step(state, data, jax.random.key(1))
            jax.block_until_ready(state)

        round_s = _timed(one_round, cfg["repeats"])
        evaluate = jax.jit(algo.evaluate)
        jax.block_until_ready(evaluate(state, data))
        eval_s = _timed(lambda: jax.block_until_ready(evaluate(state, data)), cfg["repeats"])
        out.update(client_steps_per_s=steps / round_s, round_s=round_s, eval_s=eval_s)
    else:
        data = _data(cfg["clients"], 200, (28, 28, 1))
        model = models.get("mlp", (28, 28, 1), 10)
        algo = algorithms.get("tdpfed", model=model, backend=cfg["backend"])
        state = algo.init(jax.random.key(0), data)
        if cfg["backend"] != "loop":
            data, state = core.replicate((data, state), core.client_mesh())
            step = jax.jit(algo.round_fn)
        else:
            step = algo.round_fn
        t0 = time.perf_counter()
        state, m = step(state, data, jax.random.key(0))
        jax.block_until_ready(state)
        first = time.perf_counter() - t0

        def one_round():
            nonlocal state
            state, _ = step(state, data, jax.random.key(1))
            jax.block_until_ready(state)

        round_s = _timed(one_round, cfg["repeats"])
        out.update(round_s=round_s, first_round_s=first, data_steps=int(m["client_steps"]))
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["devices"] = len(jax.devices())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("cp-forward", "round"))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="append result rows to this JSON-lines file")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    if args.what == "cp-forward":
        configs = [dict(kind="cp-forward", model=m, forward=f, clients=c, steps=s, repeats=args.repeats)
                   for m, c, s in (("cp_mlp", 20, 10), ("cp_vgg8", 10, 2))
                   for f in ("factored", "reconstruct")]
    else:
        configs = [dict(kind="round", clients=c, backend=b, repeats=args.repeats)
                   for c in (20, 200) for b in ("chunked", "loop")]
    for cfg in configs:
        proc = subprocess.run([sys.executable, __file__, args.what, "--one", json.dumps(cfg)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            print(json.dumps({**cfg, "error": proc.stderr.strip().splitlines()[-1:]}))
            continue
        row = proc.stdout.strip().splitlines()[-1]
        print(row, flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(row + "\n")


if __name__ == "__main__":
    main()
