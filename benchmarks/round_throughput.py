#!/usr/bin/env python
"""FedAvg round throughput: the vectorised engine against the one-client-at-a-time loop backend.

    python benchmarks/round_throughput.py                      # the full grid (about 15 min on 2 CPUs)
    python benchmarks/round_throughput.py --clients 100 --models mlp --batch-sizes 10

Every configuration runs in a fresh subprocess (so peak memory is its own) on MNIST-shaped
random data (28×28×1 uint8, 10 classes), `--samples-per-client` training samples per client,
full participation, one local epoch of plain SGD. Reported per configuration:
  client-steps/s   local SGD steps summed over clients, per second of steady-state round time
                   (with --repeats, the upper median over independent processes, i.e. the
                   faster of 2; range in the JSON)
  samples/s        training samples processed per second (client-steps × batch)
  compile_s        jit compile time of round_fn (vmap/chunked); for the loop backend, the extra
                   time of the first round over a steady-state round (per-client jit compile)
  round_s          median steady-state seconds per round (after the first)
  peak_rss_mb      peak resident memory of the process (includes the ~0.4 GB JAX runtime)
  devices          XLA devices the clients are split over (one per CPU core by default; the
                   loop backend always runs one client at a time on one device)
  chunk            clients per chunk chosen by the automatic rule (--chunk-size 0); a chunk at
                   least as large as a device's clients runs as plain vmap

`--conv lax` swaps the CNN's im2col convolution for flax's nn.Conv (lax.conv_general_dilated) to
measure why the engine does not use it under vmap.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _cnn_with_lax_conv(num_classes: int):
    import flax.linen as nn

    from fedjax_pfl.models.layers import Dense, max_pool_2x2

    class LaxConvCNN(nn.Module):
        """The FedAvg CNN with flax's nn.Conv (lax.conv_general_dilated) instead of im2col."""

        @nn.compact
        def __call__(self, x):
            x = max_pool_2x2(nn.relu(nn.Conv(32, (5, 5), padding="VALID")(x)))
            x = max_pool_2x2(nn.relu(nn.Conv(64, (5, 5), padding="VALID")(x)))
            x = nn.relu(Dense(512)(x.reshape(x.shape[0], -1)))
            return Dense(num_classes)(x)

    return LaxConvCNN()


def run_one(args) -> dict:
    import fedjax_pfl

    if args.cpu_devices:
        os.environ["FEDJAX_PFL_CPU_DEVICES"] = str(args.cpu_devices)
    fedjax_pfl.use_cpu_cores()
    import jax
    import numpy as np

    from fedjax_pfl import algorithms, core, models
    from fedjax_pfl.data.federated import FederatedData

    n, per = args.clients, args.samples_per_client
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n * per + n * 8, 28, 28, 1), dtype=np.uint8)
    y = rng.integers(0, 10, x.shape[0])
    train = [np.arange(i * per, (i + 1) * per) for i in range(n)]
    test = [n * per + np.arange(i * 8, (i + 1) * 8) for i in range(n)]
    data = FederatedData.from_arrays(x, y, train, test, num_classes=10, input_scale=2 / 255,
                                     input_shift=-1.0)
    if args.models == "cnn" and args.conv == "lax":
        model = models.from_flax(_cnn_with_lax_conv(10), (28, 28, 1), name="cnn-laxconv")
    else:
        model = models.get(args.models, (28, 28, 1), 10)
    algo = algorithms.get("fedavg", model=model, backend=args.backends, participation=1.0,
                          batch_size=args.batch_sizes, lr=0.01, chunk_size=args.chunk_size)
    state = algo.init(jax.random.key(0), data)
    mesh = core.client_mesh() if args.backends != "loop" else None
    data, state = core.replicate((data, state), mesh)
    keys = [jax.random.fold_in(jax.random.key(1), r) for r in range(args.rounds + 1)]
    if args.backends == "loop":
        step = algo.round_fn
        compile_s = None
    else:
        t0 = time.perf_counter()
        out = None if mesh is None else core.replicated_sharding(mesh)
        step = jax.jit(algo.round_fn, donate_argnums=0, out_shardings=out).lower(
            state, data, keys[0]).compile()
        compile_s = time.perf_counter() - t0
    times, steps = [], 0
    for r in range(args.rounds + 1):
        t0 = time.perf_counter()
        state, m = step(state, data, keys[r])
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
        steps = int(m["client_steps"])
    steady = float(np.median(times[1:]))
    if compile_s is None:
        compile_s = times[0] - steady
    return {
        "model": args.models + ("-laxconv" if args.models == "cnn" and args.conv == "lax" else ""),
        "backend": args.backends, "clients": n, "batch": args.batch_sizes,
        "client_steps_per_s": steps / steady, "samples_per_s": n * per / steady,
        "compile_s": compile_s, "round_s": steady,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "devices": len(jax.devices()) if args.backends != "loop" else 1,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", default=[20, 100, 500])
    p.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=["mlp", "cnn"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[10, 32])
    p.add_argument("--backends", nargs="+", default=["vmap", "loop"],
                   choices=["vmap", "chunked", "loop"])
    p.add_argument("--conv", default="im2col", choices=["im2col", "lax"],
                   help="im2col: the engine's Conv2D (impl auto: Winograd on CPU where it pays); "
                        "lax: flax's nn.Conv")
    p.add_argument("--samples-per-client", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=0, help="0: automatic (the engine's default)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after the first")
    p.add_argument("--cpu-devices", type=int, default=0,
                   help="XLA:CPU devices to split clients over (default: one per core; 1 = off)")
    p.add_argument("--repeats", type=int, default=1,
                   help="independent runs (fresh processes) per configuration; the row reports the "
                        "upper median client-steps/s (the faster of 2) and its min-max range (this VM varies ±20 %%)")
    p.add_argument("--json", default=None, help="append result rows to this JSON-lines file")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.one:
        for name in ("clients", "models", "batch_sizes", "backends"):
            setattr(args, name, getattr(args, name)[0])
        print(json.dumps(run_one(args)))
        return

    header = (f"{'model':<12} {'backend':<8} {'clients':>7} {'batch':>5} {'client-steps/s':>15} "
              f"{'samples/s':>10} {'compile_s':>9} {'round_s':>8} {'peak_MB':>8} {'devices':>7} chunk")
    print(header)
    print("-" * len(header))
    for model in args.models:
        for batch in args.batch_sizes:
            for clients in args.clients:
                for backend in args.backends:
                    cmd = [sys.executable, __file__, "--one", "--clients", str(clients),
                           "--models", model, "--batch-sizes", str(batch), "--backends", backend,
                           "--conv", args.conv, "--samples-per-client", str(args.samples_per_client),
                           "--chunk-size", str(args.chunk_size), "--rounds", str(args.rounds),
                           "--cpu-devices", str(args.cpu_devices)]
                    runs = []
                    for _ in range(args.repeats):
                        proc = subprocess.run(cmd, capture_output=True, text=True,
                                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
                        if proc.returncode != 0:
                            break
                        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
                    if len(runs) < args.repeats:
                        print(f"{model:<12} {backend:<8} {clients:>7} {batch:>5}  FAILED: "
                              f"{proc.stderr.strip().splitlines()[-1] if proc.stderr else proc.returncode}")
                        continue
                    runs.sort(key=lambda r: r["client_steps_per_s"])
                    row = dict(runs[len(runs) // 2])
                    row["client_steps_per_s_range"] = [runs[0]["client_steps_per_s"],
                                                       runs[-1]["client_steps_per_s"]]
                    print(f"{row['model']:<12} {backend:<8} {clients:>7} {batch:>5} "
                          f"{row['client_steps_per_s']:>15.0f} {row['samples_per_s']:>10.0f} "
                          f"{row['compile_s']:>9.2f} {row['round_s']:>8.3f} {row['peak_rss_mb']:>8.0f} "
                          f"{row['devices']:>7}",
                          flush=True)
                    if args.json:
                        with open(args.json, "a") as f:
                            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
