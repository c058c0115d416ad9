#!/usr/bin/env python
"""Round throughput: local steps a second in the engine's round, on synthetic clients, on PGFed's
CNN protocol, and against this machine's matrix-multiply peak.

    python benchmarks/round_throughput.py                      # the grid (about 15 min on 2 CPUs)
    python benchmarks/round_throughput.py --clients 100 --models mlp --batch-sizes 10
    python benchmarks/round_throughput.py --algos tdpfed --clients 20 200 --samples-per-client 200 \
        --batch-sizes 20 --backends chunked loop               # TDPFed's round, engine vs loop
    python benchmarks/round_throughput.py --protocol --local-steps 10          # PGFed's protocol
    python benchmarks/round_throughput.py --protocol --algos fedavg pgfedmo --split dirichlet
    python benchmarks/round_throughput.py --peak --cpu-devices 2              # the roofline

The grid (default): each algorithm (`--algos`, default FedAvg) on MNIST-shaped random data
(28×28×1 uint8, 10 classes), `--samples-per-client` training samples per client, full
participation, the algorithm's other defaults (FedAvg: one local epoch of plain SGD), for each
backend: the vectorised engine (`chunked`, the default, or one `vmap`) against `loop`, one jitted
call per client on one device. Every configuration runs in a fresh process (its peak memory is its
own), built as the command line builds it (`runner.prepare`). Reported per configuration:
  client-steps/s   local steps summed over clients, per second of steady-state round time
                   (with --repeats, the upper median over independent processes, i.e. the
                   faster of 2; range in the JSON)
  samples/s        training samples per second (client-steps × batch)
  compile_s        `Program.compile` (the round and the evaluation); for the loop backend, the
                   first round's extra time over a steady-state round (per-client jit compile)
  round_s          median steady-state seconds per round (after the first)
  peak_rss_mb      peak resident memory of the process (includes the ~0.4 GB JAX runtime)
  devices          XLA devices the clients are split over (one per CPU core by default; the
                   loop backend always runs one client at a time on one device)

--protocol: the engine alone on PGFed's CNN protocol (`vs_pytorch.py`'s engine side: preset
pgfed_paper, Fashion-MNIST, the FedAvg CNN, 6 of 25 clients a round), under the current
XLA_FLAGS. Every algorithm of --algos is compiled in this process, warmed up by one round, then
their rounds run interleaved (`--rounds` each), each followed by the runner's evaluation
(personalised models only where the round changed them). Printed per algorithm: compile s,
training s a round and ms a local step (medians), evaluation s, each later algorithm's round time
over the first's (per-round ratios: median and range; FedAvg and the PGFed family sample the same
clients under the same keys, so `--algos fedavg pgfedmo` is PGFedMo's overhead), and a digest of
the state's floating-point bytes (same digest: the same bits, e.g. with and without a flag).

--peak: float32 GEMM through XLA for square shapes and the engine's typical ones (the CNN's im2col
GEMM and dense layer at batch 10, the MLP's first layer), best of --repeats timed repetitions of
~2 GFLOP each; with --cpu-devices D > 1 each of D devices multiplies its own pair at once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]      # this checkout's library; vs_pytorch.py's protocol beside it

PEAK_SHAPES = {
    "square 1024": (1024, 1024, 1024),
    "square 2048": (2048, 2048, 2048),
    "cnn conv2 im2col, B=10 (1440x800 @ 800x64)": (1440, 800, 64),
    "cnn dense 512, B=10 (10x1024 @ 1024x512)": (10, 1024, 512),
    "mlp layer 1, B=10 (10x784 @ 784x100)": (10, 784, 100),
}


def run_one(args) -> dict:
    """One grid configuration (scalar --algos/--models/--batch-sizes/--clients/--backends), here."""
    import fedjax_pfl

    if args.cpu_devices:
        os.environ["FEDJAX_PFL_CPU_DEVICES"] = str(args.cpu_devices)
    fedjax_pfl.use_cpu_cores()
    import jax
    import numpy as np

    from fedjax_pfl import runner
    from fedjax_pfl.data import FederatedData

    n, per = args.clients, args.samples_per_client
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n * per + n * 8, 28, 28, 1), dtype=np.uint8)
    y = rng.integers(0, 10, x.shape[0])
    train = [np.arange(i * per, (i + 1) * per) for i in range(n)]
    test = [n * per + np.arange(i * 8, (i + 1) * 8) for i in range(n)]
    data = FederatedData.from_arrays(x, y, train, test, num_classes=10, input_scale=2 / 255,
                                     input_shift=-1.0)
    hparams = dict(backend=args.backends, participation=1.0, batch_size=args.batch_sizes,
                   chunk_size=args.chunk_size)
    if args.lr is not None:
        hparams["lr"] = args.lr
    cfg = runner.RunConfig(algo=args.algos, model=args.models, model_conv=args.conv,
                           hparams=hparams, progress=False, memory_check=False,
                           data_placement="device", state_placement="device")
    prep = runner.prepare(cfg, data=data)
    program = prep.program
    compile_s = program.compile(prep.round_keys) if args.backends != "loop" else None
    state = program.init(jax.random.fold_in(prep.root, 0))
    jax.block_until_ready(state)
    times, steps = [], 0
    for r in range(args.rounds + 1):
        t0 = time.perf_counter()
        state, metrics = program.run_rounds(state, prep.round_keys, r, 1)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
        steps = int(np.sum(metrics[0]["client_steps"]))
    steady = float(np.median(times[1:]))
    if compile_s is None:
        compile_s = times[0] - steady
    return {
        "algo": args.algos, "model": args.models, "conv": args.conv, "backend": args.backends,
        "clients": n, "batch": args.batch_sizes,
        "client_steps_per_s": steps / steady, "samples_per_s": steps * args.batch_sizes / steady,
        "compile_s": compile_s, "round_s": steady,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "devices": len(jax.devices()) if args.backends != "loop" else 1,
    }


def grid(args) -> None:
    header = (f"{'algo':<8} {'model':<8} {'backend':<8} {'clients':>7} {'batch':>5} "
              f"{'client-steps/s':>15} {'samples/s':>10} {'compile_s':>9} {'round_s':>8} "
              f"{'peak_MB':>8} {'devices':>7}")
    print(header)
    print("-" * len(header))
    for algo in args.algos:
        for model in args.models:
            for batch in args.batch_sizes:
                for clients in args.clients:
                    for backend in args.backends:
                        cmd = [sys.executable, __file__, "--one", "--algos", algo, "--clients",
                               str(clients), "--models", model, "--batch-sizes", str(batch),
                               "--backends", backend, "--conv", args.conv,
                               "--samples-per-client", str(args.samples_per_client),
                               "--chunk-size", str(args.chunk_size), "--rounds", str(args.rounds),
                               "--cpu-devices", str(args.cpu_devices)]
                        if args.lr is not None:
                            cmd += ["--lr", str(args.lr)]
                        _grid_row(cmd, args, algo, model, backend, clients, batch)


def _grid_row(cmd, args, algo, model, backend, clients, batch) -> None:
    runs = []
    for _ in range(args.repeats):
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if proc.returncode != 0:
            reason = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode
            print(f"{algo:<8} {model:<8} {backend:<8} {clients:>7} {batch:>5}  FAILED: {reason}")
            return
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    runs.sort(key=lambda r: r["client_steps_per_s"])
    row = dict(runs[len(runs) // 2])
    row["client_steps_per_s_range"] = [runs[0]["client_steps_per_s"], runs[-1]["client_steps_per_s"]]
    print(f"{algo:<8} {model:<8} {backend:<8} {clients:>7} {batch:>5} "
          f"{row['client_steps_per_s']:>15.0f} {row['samples_per_s']:>10.0f} "
          f"{row['compile_s']:>9.2f} {row['round_s']:>8.3f} {row['peak_rss_mb']:>8.0f} "
          f"{row['devices']:>7}", flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


def protocol(args) -> None:
    import fedjax_pfl

    fedjax_pfl.use_cpu_cores(args.cpu_devices or None)    # as run.py: one XLA device per core
    import jax
    import numpy as np
    from vs_pytorch import protocol_program, warm_evaluation

    extra = (["--local-steps", str(args.local_steps)] if args.local_steps else [])
    extra += shlex.split(args.run_args)
    runs = {}
    for algo in args.algos:
        prep = protocol_program(algo, args.split, extra)
        t0 = time.perf_counter()
        prep.program.compile(prep.round_keys)
        compile_s = time.perf_counter() - t0
        state = prep.program.init(jax.random.fold_in(prep.root, 0))
        evaluation = warm_evaluation(prep.program, state)
        state, metrics = prep.program.run_rounds(state, prep.round_keys, 0, 1)     # warm-up
        evaluation.changed(metrics[0]["sampled"])
        jax.block_until_ready(evaluation(state))
        runs[algo] = {"prep": prep, "state": state, "evaluation": evaluation,
                      "compile_s": compile_s, "train": [], "evaluate": [], "steps": []}
    for r in range(1, args.rounds + 1):
        for algo, run in runs.items():     # interleaved: a slow phase of the machine hits all alike
            program = run["prep"].program
            t0 = time.perf_counter()
            run["state"], metrics = program.run_rounds(run["state"], run["prep"].round_keys, r, 1)
            jax.block_until_ready(run["state"])
            run["train"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            run["evaluation"].changed(metrics[0]["sampled"])      # as the runner evaluates
            jax.block_until_ready(run["evaluation"](run["state"]))
            run["evaluate"].append(time.perf_counter() - t0)
            run["steps"].append(int(np.sum(metrics[0]["client_steps"])))
    first = runs[args.algos[0]]
    print(f"PGFed's protocol ({args.split}{', ' + ' '.join(extra) if extra else ''}) on "
          f"{jax.device_count()} device(s), XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, "
          f"medians of {args.rounds} rounds:")
    for algo, run in runs.items():
        train = float(np.median(run["train"]))
        steps = int(np.median(run["steps"]))
        floats = [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(run["state"])
                  if jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating)]
        digest = hashlib.sha256(b"".join(floats)).hexdigest()[:12]
        line = (f"  {algo}: compile {run['compile_s']:.1f} s, training {train:.3f} s a round "
                f"({steps} steps, {1000 * train / max(steps, 1):.2f} ms a step), evaluation "
                f"{np.median(run['evaluate']):.3f} s")
        if run is not first:
            ratios = [a / b for a, b in zip(run["train"], first["train"])]
            line += (f", ÷ {args.algos[0]} {np.median(ratios):.3f} "
                     f"({min(ratios):.3f}–{max(ratios):.3f})")
        print(f"{line}, state digest {digest}", flush=True)


def peak(args) -> None:
    devices_wanted = max(args.cpu_devices, 1)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={devices_wanted}")
    import jax
    import jax.numpy as jnp

    devices = jax.devices()[:devices_wanted]
    matmul = jax.jit(lambda a, b: a @ b)
    print(f"{jax.default_backend()} x{len(devices)}, jax {jax.__version__}, {os.cpu_count()} cores")
    for name, (n, k, m) in PEAK_SHAPES.items():
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--protocol", action="store_true", help="PGFed's CNN protocol instead of the grid")
    mode.add_argument("--peak", action="store_true",
                      help="this machine's float32 matmul peak instead of the grid")
    p.add_argument("--algos", nargs="+", default=["fedavg"],
                   help="algorithms (default fedavg); --protocol: timed in turn, each after the "
                        "first also as a ratio to it")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after the first (default 3)")
    p.add_argument("--repeats", type=int, default=None,
                   help="grid: independent runs (fresh processes) per configuration; the row "
                        "reports the upper median client-steps/s (the faster of 2) and its "
                        "min-max range (this VM varies ±20 %%) (default 1); --peak: timed "
                        "repetitions, the best kept (default 5)")
    p.add_argument("--cpu-devices", type=int, default=0,
                   help="XLA:CPU devices (default: one per core; 1 = one device; --peak: 1)")
    g = p.add_argument_group("the grid")
    g.add_argument("--clients", type=int, nargs="+", default=[20, 100, 500])
    g.add_argument("--models", nargs="+", default=["mlp", "cnn"],
                   help="models.get names for 28×28×1 images (default mlp cnn)")
    g.add_argument("--batch-sizes", type=int, nargs="+", default=[10, 32])
    g.add_argument("--backends", nargs="+", default=["vmap", "loop"],
                   choices=["vmap", "chunked", "loop"])
    g.add_argument("--conv", default="auto", choices=["auto", "im2col", "winograd"],
                   help="how the CNN's convolutions are computed (run.py's --conv; default auto)")
    g.add_argument("--samples-per-client", type=int, default=64)
    g.add_argument("--chunk-size", type=int, default=0, help="0: automatic (the engine's default)")
    g.add_argument("--lr", type=float, default=None, help="local learning rate (default: the algorithm's)")
    g.add_argument("--json", default=None, help="append result rows to this JSON-lines file")
    g.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    g = p.add_argument_group("--protocol")
    g.add_argument("--split", choices=("iid", "dirichlet"), default="iid",
                   help="iid: 2,100 training samples per client; dirichlet: the preset's Dir(0.3) split")
    g.add_argument("--local-steps", type=int, default=0,
                   help="local steps per client instead of the protocol's 5 epochs (0: the 5 epochs)")
    g.add_argument("--run-args", default="",
                   help="more experiments/run.py flags, after the protocol's (so they win), "
                        "e.g. '--eval-batch-size 256'")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.peak:
        args.repeats = args.repeats or 5
        return peak(args)
    if args.protocol:
        return protocol(args)
    args.repeats = args.repeats or 1
    if args.one:
        for name in ("algos", "clients", "models", "batch_sizes", "backends"):
            setattr(args, name, getattr(args, name)[0])
        print(json.dumps(run_one(args)))
        return
    grid(args)


if __name__ == "__main__":
    main()
