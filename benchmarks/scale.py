#!/usr/bin/env python
"""Large client counts: memory and round time against N at fixed M, skewed client sizes, and
vmapped seeds.

    python benchmarks/scale.py clients --algos fedavg pfedsop pgfedmo --clients 100 1000 10000 100000
    python benchmarks/scale.py skew
    python benchmarks/scale.py seeds --seeds 8 32
    python benchmarks/scale.py clients ... --devices 1 2 --json benchmarks/scale.jsonl

Every configuration runs in a fresh subprocess (so its peak memory is its own) with
--devices XLA:CPU devices (`use_cpu_cores`), or on the accelerator where one is present. Data are
random: MNIST-shaped 28×28 uint8 images (`--image 28`) or 8×8 (`--image 8`, for N = 10⁶), 20
training and 5 test samples per client, 10 classes. M = 100 clients per round, one local epoch of
batch 10 (2 steps per client), no evaluation inside the timed rounds.

Reported: peak RSS of the process (MB; on GPU the device's peak bytes in use), compile seconds,
seconds per round (median of the timed rounds), rounds per hour, the memory plan's bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time


def _data(n, per, test, image, sizes=None):
    import numpy as np

    from fedjax_pfl.data.federated import FederatedData

    rng = np.random.default_rng(0)
    sizes = np.full(n, per) if sizes is None else np.asarray(sizes)
    total = int(sizes.sum()) + n * test
    x = rng.integers(0, 256, (total, image, image, 1), dtype=np.uint8)
    y = rng.integers(0, 10, total).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(sizes + test)[:-1]])
    train = [np.arange(s, s + k) for s, k in zip(starts, sizes)]
    tests = [np.arange(s + k, s + k + test) for s, k in zip(starts, sizes)]
    return FederatedData.from_arrays(x, y, train, tests, num_classes=10, input_scale=2 / 255,
                                     input_shift=-1.0)


def _peak_mb() -> float:
    import jax

    dev = jax.devices()[0]
    if dev.platform != "cpu":
        stats = dev.memory_stats() or {}
        return stats.get("peak_bytes_in_use", 0) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_one(cfg: dict) -> dict:
    os.environ["FEDJAX_PFL_CPU_DEVICES"] = str(cfg.get("devices", 1))
    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()
    import jax
    import numpy as np

    from fedjax_pfl import algorithms, core, models

    out = dict(cfg)
    if cfg["kind"] == "seeds":
        return _seeds(cfg)
    n = cfg["clients"]
    sizes = None
    if cfg["kind"] == "skew":
        # One client holds `big` samples, the rest `small`; "uniform" spreads the same total.
        if cfg["layout"] == "skewed":
            sizes = np.full(n, cfg["small"])
            sizes[0] = cfg["big"]
        else:
            total = cfg["big"] + (n - 1) * cfg["small"]
            sizes = np.full(n, total // n)
            sizes[: total % n] += 1
    t0 = time.perf_counter()
    data = _data(n, 20, 5, cfg["image"], sizes)
    out["data_s"] = time.perf_counter() - t0
    model = models.get(cfg["model"], data.input_shape, 10)
    hp = dict(participation=cfg["m"] / n, batch_size=10, local_epochs=1)
    algo = algorithms.get(cfg["algo"], model=model, **hp)
    mesh = core.client_mesh()
    data = core.prepare_data(data, mesh)
    program = core.Program(algo, data, mesh=mesh, state_dtype=cfg.get("state_dtype", "float32"))
    keys = jax.random.key(1)
    t0 = time.perf_counter()
    out["compile_s"] = program.compile(keys)
    plan = program.memory_plan()
    out["plan_per_device_mb"] = plan.per_device / 2**20
    out["plan_state_per_device_mb"] = plan.client_state_per_device / 2**20
    state = program.init(jax.random.key(0))
    jax.block_until_ready(state)
    times = []
    rounds = cfg["rounds"]
    steps = 0
    big_rounds = []
    for r in range(rounds):
        t1 = time.perf_counter()
        state, m = program.run_rounds(state, keys, r, 1)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t1)
        steps += int(m[0]["client_steps"])
        if cfg["kind"] == "skew":
            big_rounds.append(bool(0 in set(np.asarray(m[0]["sampled"]).tolist())))
    timed = times[1:] if len(times) > 1 else times
    out["round_s"] = float(np.median(timed))
    out["round_mean_s"] = float(np.mean(timed))
    out["rounds_per_hour"] = 3600.0 / out["round_s"]
    if cfg["kind"] == "skew":
        with_big = [t for t, b in zip(times, big_rounds) if b][1:] or [t for t, b in zip(times, big_rounds) if b]
        out["rounds_with_big_client"] = int(sum(big_rounds))
        out["round_with_big_s"] = float(np.median(with_big)) if with_big else None
    out["peak_mb"] = _peak_mb()
    out["devices_used"] = len(jax.devices())
    out["platform"] = jax.devices()[0].platform
    return out


def _seeds(cfg: dict) -> dict:
    """`seeds` runs of FedAvg (MLP, 20 clients of 100 samples, 10 rounds): one vmapped program
    against one run after another (each compiling its own)."""
    import jax

    from fedjax_pfl import runner, sweep

    data = _data(20, 100, 20, 28)
    out = dict(cfg)
    rc = runner.RunConfig(algo=cfg["algo"], rounds=cfg["rounds"], model="mlp", progress=False,
                          memory_check=False, eval_every=cfg["rounds"],
                          hparams={"participation": 0.5, "batch_size": 10})
    runs = [sweep.RunSpec(s) for s in range(cfg["seeds"])]
    t0 = time.perf_counter()
    if cfg["mode"] == "vmapped":
        sweep.run_group(rc, runs, data=data, data_info={}, out=None, progress=False)
    else:
        for spec in runs:
            rc.seed = spec.seed
            runner.run(rc, data=data, data_info={}, log=lambda *_: None)
    out["total_s"] = time.perf_counter() - t0
    out["peak_mb"] = _peak_mb()
    out["devices_used"] = len(jax.devices())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("clients", "skew", "seeds"))
    p.add_argument("--algos", nargs="+", default=["fedavg", "pfedsop", "pgfedmo"])
    p.add_argument("--clients", nargs="+", type=int, default=[100, 1000, 10000])
    p.add_argument("--devices", nargs="+", type=int, default=[1, 2])
    p.add_argument("--model", default="mlp")
    p.add_argument("--image", type=int, default=28)
    p.add_argument("--m", type=int, default=100, help="clients per round")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seeds", nargs="+", type=int, default=[8, 32])
    p.add_argument("--state-dtype", default="float32")
    p.add_argument("--json", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    if args.what == "clients":
        configs = [dict(kind="clients", algo=a, clients=n, devices=d, model=args.model,
                        image=args.image, m=args.m, rounds=args.rounds, state_dtype=args.state_dtype)
                   for a in args.algos for n in args.clients for d in args.devices]
    elif args.what == "skew":
        configs = [dict(kind="skew", algo="fedavg", clients=10_000, devices=d, model="mlp", image=28,
                        m=100, rounds=args.rounds, layout=layout, big=20_000, small=20)
                   for layout in ("uniform", "skewed") for d in args.devices]
    else:
        configs = [dict(kind="seeds", algo="fedavg", seeds=s, mode=mode, rounds=10, devices=d)
                   for s in args.seeds for mode in ("vmapped", "sequential") for d in args.devices]
    for cfg in configs:
        proc = subprocess.run([sys.executable, __file__, args.what, "--one", json.dumps(cfg)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            row = json.dumps({**cfg, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:300]})
        else:
            row = proc.stdout.strip().splitlines()[-1]
        print(row, flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(row + "\n")


if __name__ == "__main__":
    main()
