#!/usr/bin/env python
"""What client-level DP costs a round (issue 35: ≤ 10 % of a round at M = 100 on the MLP).

    python benchmarks/privacy_overhead.py                       # M = 100, 5 repeats
    python benchmarks/privacy_overhead.py --clients 200 --clients-per-round 50 --repeats 3

FedAvg with the MLP on N synthetic Fashion-MNIST-shaped clients (28×28 uint8 images, 10 classes,
`--samples` training and a quarter as many test samples each), M = `--clients-per-round`, one
local epoch of B = 10, on the CLI's devices (one XLA:CPU device per core), each program built as
the command line builds it (`runner.prepare`). Four programs compiled in one process: plain
FedAvg; DP-FedAvg with --dp-clip 1 --dp-noise-multiplier 1 (per-client clipping in the
vectorised step, the clipped sum, Gaussian noise, the fixed denominator); the clipping alone
(--dp-clip 1, no noise); and DP-FedAvg with Poisson sampling at the same expected M (--sampling
poisson: K slots, K − |S| of them empty). They run interleaved, `--rounds` rounds of each per
repeat, after one warm-up round each; per repeat the ratio of their median round times, then the
median (range) of the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))          # this checkout's library


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=400)
    p.add_argument("--clients-per-round", type=int, default=100)
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--chunk-size", type=int, default=0, help="clients per chunk (0: automatic)")
    args = p.parse_args()

    import fedjax_pfl
    fedjax_pfl.use_cpu_cores()
    import jax
    import numpy as np

    from fedjax_pfl import runner
    from fedjax_pfl.data import FederatedData

    rng = np.random.default_rng(0)
    n, s, t = args.clients, args.samples, max(1, args.samples // 4)
    x = rng.integers(0, 256, (n * (s + t), 28, 28, 1), dtype=np.uint8)
    y = rng.integers(0, 10, n * (s + t)).astype(np.int32)
    starts = np.arange(n) * (s + t)
    data = FederatedData.from_arrays(x, y, [np.arange(a, a + s) for a in starts],
                                     [np.arange(a + s, a + s + t) for a in starts],
                                     num_classes=10, input_scale=1 / 255, name="fmnist-shaped")
    common = dict(participation=args.clients_per_round / n, batch_size=10, lr=0.05,
                  chunk_size=args.chunk_size)
    programs = {}
    variants = (("plain", {}), ("private", {"dp_clip": 1.0, "dp_noise_multiplier": 1.0}),
                ("clip only", {"dp_clip": 1.0}),
                ("poisson", {"dp_clip": 1.0, "dp_noise_multiplier": 1.0, "sampling": "poisson"}))
    for name, extra in variants:
        prep = runner.prepare(runner.RunConfig(algo="fedavg", model="mlp", progress=False,
                                               memory_check=False, data_placement="device",
                                               state_placement="device",
                                               hparams={**common, **extra}), data=data)
        state = prep.program.init(jax.random.fold_in(prep.root, 0))
        state, _ = prep.program.run_rounds(state, prep.round_keys, 0, 1)     # compile, warm up
        jax.block_until_ready(state)
        programs[name] = [prep, state]
    print(f"devices {len(jax.devices())} ({jax.devices()[0].platform}), jax {jax.__version__}, "
          f"N = {n}, M = {args.clients_per_round}, {s} samples a client")
    ratios = []
    for rep in range(args.repeats):
        medians = {}
        for name, entry in programs.items():
            prep, state = entry
            times = []
            for r in range(args.rounds):
                t0 = time.perf_counter()
                state, m = prep.program.run_rounds(state, prep.round_keys, 1 + rep * args.rounds + r, 1)
                jax.block_until_ready(state)
                times.append(time.perf_counter() - t0)
            entry[1] = state
            medians[name] = statistics.median(times)
        others = [name for name, _ in variants[1:]]
        ratios.append(tuple(medians[name] / medians["plain"] for name in others))
        print(f"repeat {rep + 1}: " + ", ".join(f"{k} {v:.3f} s" for k, v in medians.items())
              + " a round; " + ", ".join(f"{k} ÷ plain {r:.3f}" for k, r in zip(others, ratios[-1])))
    for i, name in enumerate(others):
        r = [x[i] for x in ratios]
        print(f"{name} ÷ plain: median {statistics.median(r):.3f} ({min(r):.3f}–{max(r):.3f}) "
              f"over {args.repeats} repeats")


if __name__ == "__main__":
    main()
