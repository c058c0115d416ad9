#!/usr/bin/env python
"""The FedAvg CNN's local step alone, outside the engine: a jitted lax.scan of SGD-momentum steps
(lr 0.005, momentum 0.9) on one device, the yardstick that profile_round.py's engine step is
compared against.

    taskset -c 0 python benchmarks/cnn_step.py                    # one core, batch 10
    taskset -c 0 python benchmarks/cnn_step.py --batch 32
    XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type=dot,individual_dot taskset -c 0 python benchmarks/cnn_step.py

Prints ms per step (minimum and median of 5 timed scans of --steps steps, after a warm-up) on
random 28×28×1 inputs.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=1").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from fedjax_pfl import models  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    model = models.get("cnn", (28, 28, 1), 10)
    keys = jax.random.split(jax.random.key(0), 2)
    xs = jax.random.normal(keys[0], (args.steps, args.batch, 28, 28, 1))
    ys = jax.random.randint(keys[1], (args.steps, args.batch), 0, 10)
    params = model.init(jax.random.key(2))
    optimizer = optax.sgd(0.005, momentum=0.9)

    def loss(params, x, y):
        return jnp.mean(model.loss(model.apply(params, x), y))

    @jax.jit
    def train(params, xs, ys):
        def step(carry, xy):
            params, opt_state = carry
            updates, opt_state = optimizer.update(jax.grad(loss)(params, *xy), opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), None

        return jax.lax.scan(step, (params, optimizer.init(params)), (xs, ys))[0][0]

    jax.block_until_ready(train(params, xs, ys))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(train(params, xs, ys))
        times.append(time.perf_counter() - t0)
    print(f"FedAvg CNN, batch {args.batch}, XLA_FLAGS={os.environ['XLA_FLAGS']!r}: "
          f"{1000 * min(times) / args.steps:.2f} ms a step (min), "
          f"{1000 * np.median(times) / args.steps:.2f} (median)")


if __name__ == "__main__":
    main()
