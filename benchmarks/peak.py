"""This machine's float32 matrix-multiply peak under XLA, the roofline the speed targets use.

    python benchmarks/peak.py                 # 1 XLA:CPU device (XLA threads it over all cores)
    python benchmarks/peak.py --devices 2     # one device per core, both busy at once

Prints GFLOP/s for square and for the engine's typical shapes (the CNN's im2col GEMM of a batch of
10, the MLP's first layer at batch 10), best of a few timed repetitions of ~2 GFLOP each.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

SHAPES = {
    "square 1024": (1024, 1024, 1024),
    "square 2048": (2048, 2048, 2048),
    "cnn conv2 im2col, B=10 (1440x800 @ 800x64)": (1440, 800, 64),
    "cnn dense 512, B=10 (10x1024 @ 1024x512)": (10, 1024, 512),
    "mlp layer 1, B=10 (10x784 @ 784x100)": (10, 784, 100),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1,
                        help="XLA:CPU devices to force (default 1); with more, each multiplies its own pair at once")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions, best is kept (default 5)")
    args = parser.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}")
    import jax
    import jax.numpy as jnp

    devices = jax.devices()[:args.devices]
    matmul = jax.jit(lambda a, b: a @ b)
    print(f"{jax.default_backend()} x{len(devices)}, jax {jax.__version__}, {os.cpu_count()} cores")
    for name, (n, k, m) in SHAPES.items():
        xs = [jax.device_put(jnp.ones((n, k), jnp.float32), d) for d in devices]
        ys = [jax.device_put(jnp.ones((k, m), jnp.float32), d) for d in devices]
        for a, b in zip(xs, ys):
            matmul(a, b).block_until_ready()
        reps = max(3, int(2e9 / (2 * n * k * m)))
        best = 0.0
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(reps):
                outs = [matmul(a, b) for a, b in zip(xs, ys)]
            for out in outs:
                out.block_until_ready()
            best = max(best, 2 * n * k * m * reps * len(devices) / (time.perf_counter() - start) / 1e9)
        print(f"{name:48s} {best:7.1f} GFLOP/s")


if __name__ == "__main__":
    sys.exit(main())
