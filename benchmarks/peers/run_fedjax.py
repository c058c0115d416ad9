"""Runs a prepared job in fedjax_pfl (the repository's environment) and prints its RESULT line.

    python benchmarks/peers/run_fedjax.py work/pgfed.npz --algo fedavg --rounds 5 [--devices 1]
    python benchmarks/peers/run_fedjax.py work/pgfed.npz --algo fedavg --rounds 5 --device cuda

The Program is the one `experiments/run.py` builds (its flags give the hyperparameters: model,
local epochs, batch, lr, momentum with a buffer reset every round, as the peers' fresh
optimizers have; no drop_last: ⌈n/B⌉ steps an epoch, the last batch partial), on the job's data
(`FederatedData.from_blocks`) and with the job's per-round clients: the algorithm's round is
wrapped so that `core.sample_clients` returns `schedule[state.round]` instead of drawing, and
every round's "sampled" metric is checked against the schedule. Start-up (process start to the
first round: imports, data to device, compile of the round and evaluation, init) is reported
apart from the rounds; the job's accuracy is evaluated once after the last round.

`--device cpu` (default) runs on XLA:CPU with one device per core (or `--devices`); `--device
cuda` on JAX's GPU backend (JAX_PLATFORMS=cuda, one GPU: the engine's mesh holds the local GPUs).
The job's initial weights were made on XLA:CPU (`prepare.py`); on a GPU the engine's own
initial weights are compared with them (the same draws, computed by another backend)
rather than bit for bit (to 1e-5 relative), and the largest difference is reported.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)

import common  # noqa: E402


def scheduled(algo, schedule):
    """`algo` whose rounds train `schedule[state.round]` (ids [R, M]) instead of sampling.

    The wrapper puts the traced round counter where the patched `core.sample_clients` (called by
    `Engine.sample`, which keeps its device-balancing order) can read it while the round traces."""
    import jax.numpy as jnp

    from fedjax_pfl import core

    table = jnp.asarray(schedule, jnp.int32)
    current = {}
    draw = core.sample_clients

    def sample_clients(key, num_clients, num_sampled):
        if "round" not in current:
            return draw(key, num_clients, num_sampled)
        if num_sampled != table.shape[1]:
            raise ValueError(f"the engine samples {num_sampled} clients a round, the schedule {table.shape[1]}")
        return table[jnp.minimum(current["round"], table.shape[0] - 1)]

    def round_fn(state, data, key):
        current["round"] = state.round
        try:
            return algo.round_fn(state, data, key)
        finally:
            current.pop("round", None)

    core.sample_clients = sample_clients
    return algo._replace(round_fn=round_fn)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job")
    parser.add_argument("--algo", default="fedavg", choices=("fedavg", "pgfedmo"))
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="JAX's backend: XLA:CPU (default) or the GPU")
    parser.add_argument("--devices", type=int, default=None,
                        help="XLA:CPU devices (default: one per core, as run.py; --device cpu only)")
    parser.add_argument("--compile-cache", action="store_true",
                        help="use JAX's persistent compilation cache (default off: a cold start)")
    parser.add_argument("--memory-margin", type=float, default=0.5,
                        help="start only if the memory plan needs at most this share of the "
                             "available memory (default 0.5)")
    args = parser.parse_args(argv)
    t_launch = common.launch_time()
    load_start = common.loadavg()

    # Before JAX starts: a GPU that fails to start is an error, not a silent fall-back to the CPU.
    os.environ["JAX_PLATFORMS"] = "cpu" if args.device == "cpu" else "cuda,cpu"
    import fedjax_pfl

    devices = fedjax_pfl.use_cpu_cores(args.devices) if args.device == "cpu" else 1
    if args.compile_cache:
        fedjax_pfl.use_compile_cache()
    import jax
    import numpy as np

    if args.device == "cuda" and jax.devices()[0].platform != "gpu":
        raise SystemExit(f"--device cuda: JAX runs on {jax.devices()[0].platform}")
    from experiments import run as cli
    from fedjax_pfl import algorithms, core, models
    from fedjax_pfl.data.federated import FederatedData

    job = common.Job(args.job)
    m = job.meta
    if args.rounds > job.schedule.shape[0]:
        raise SystemExit(f"the job schedules {job.schedule.shape[0]} rounds, asked for {args.rounds}")
    flags = ["--algo", args.algo, "--model", m["model"], "--clients", str(job.num_clients),
             "--participation", repr(m["per_round"] / job.num_clients),
             "--local-epochs", str(m["local_epochs"]), "--batch-size", str(m["batch_size"]),
             "--lr", repr(m["lr"]), "--momentum", repr(m["momentum"]), "--momentum-buffer", "reset",
             "--rounds", str(args.rounds), "--seed", str(m["seed"]), "--quiet", "--no-memory-check",
             "--no-compile-cache"]
    if args.algo == "pgfedmo":
        flags += ["--pgfed-mu", "0.1", "--pgfed-alpha-lr", "0.01"]     # the pgfed_paper preset's
    cfg = cli.config_from_args(cli.parse(flags))
    hparams = dict(cfg.validate())
    # PGFed's registered defaults (its paper protocol) include drop_last, which the command line
    # can only switch on: every side here takes ⌈n/B⌉ steps an epoch, the last batch partial.
    hparams["drop_last"] = False
    data = FederatedData.from_blocks(job.x, job.y, job.train_counts, job.test_counts,
                                     num_classes=m["num_classes"], input_scale=m["input_scale"],
                                     input_shift=m["input_shift"], name=m["job"])
    model = models.get(m["model"], data.input_shape, data.num_classes, conv=cfg.model_conv)
    algo = scheduled(algorithms.get(args.algo, model=model, **hparams), job.schedule)
    program = core.Program(algo, data, mesh=core.client_mesh(), jit=True)
    root = jax.random.key(m["seed"])
    round_keys = jax.random.fold_in(root, 1)
    compile_s = program.compile(round_keys)         # (allocates no state)
    # The plan after compiling: before, it has no working set. PGFedMo on the cifar10 job (1,000
    # clients) was planned before compiling at 13.4 GB of 20.4 GB and peaked at 21.6 GB (killed
    # by the OOM killer on 2026-11-25). XLA's compiler itself holds ~0.8 GB more than the plan
    # (pgfedmo, 300 clients: plan 6.4 GB, growth 7.2 GB), hence the margin.
    plan = program.memory_plan()
    if not plan.fits() or (plan.available > 0 and plan.total > args.memory_margin * plan.available):
        common.emit(dict(framework="fedjax_pfl", algo=args.algo, job=m["job"], rounds=args.rounds,
                         skipped=" ".join(plan.describe().split())))
        return 0
    state = program.init(jax.random.fold_in(root, 0))
    init_diff = 0.0
    if args.algo == "fedavg":       # the peers load the same initial weights (prepare.py)
        for name, leaf in jax.tree_util.tree_flatten_with_path(state.params)[0]:
            key = "/".join(str(getattr(k, "key", k)) for k in name)
            ours, theirs = np.asarray(leaf), job.params[key]
            init_diff = max(init_diff, float(np.max(np.abs(ours - theirs))) if ours.size else 0.0)
            same = (np.array_equal(ours, theirs) if args.device == "cpu"
                    else ours.shape == theirs.shape and np.allclose(ours, theirs, rtol=1e-5, atol=1e-6))
            if not same:
                raise SystemExit(f"the engine's initial {key} differs from the job's "
                                 f"(max |diff| {init_diff:.3g})")
    jax.block_until_ready(program.evaluate(state))         # compiled before the clock starts
    jax.block_until_ready(state)
    t_ready = time.time()

    round_s, steps = [], []
    t_prev = t_ready
    for r in range(args.rounds):
        state, metrics = program.run_rounds(state, round_keys, r, 1)
        jax.block_until_ready(state)
        now = time.time()
        round_s.append(now - t_prev)
        t_prev = now
        sampled = sorted(int(i) for i in np.asarray(metrics[0]["sampled"]))
        if sampled != sorted(int(i) for i in job.schedule[r]):
            raise SystemExit(f"round {r}: the engine trained {sampled}, the schedule says {job.schedule[r].tolist()}")
        steps.append(int(metrics[0]["client_steps"]))
    t0 = time.time()
    result = program.evaluate(state)["client"]
    correct, count = int(np.sum(result.correct)), int(np.sum(result.count))
    eval_s = time.time() - t0
    common.emit(dict(framework="fedjax_pfl", algo=args.algo, job=m["job"], rounds=args.rounds,
                     startup_s=t_ready - t_launch, compile_s=compile_s, round_s=round_s,
                     steps=steps, accuracy=common.weighted_accuracy(correct, count),
                     eval_s=eval_s, load_start=load_start, load_end=common.loadavg(),
                     settings=dict(device=args.device, device_kind=jax.devices()[0].device_kind,
                                   xla_devices=len(jax.devices()), requested_devices=devices,
                                   init_max_abs_diff=init_diff,
                                   xla_flags=os.environ.get("XLA_FLAGS", ""),
                                   hparams={k: hparams[k] for k in ("lr", "momentum", "momentum_buffer",
                                            "drop_last", "local_epochs", "batch_size") if k in hparams},
                                   jax=jax.__version__, version=fedjax_pfl.__version__)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
