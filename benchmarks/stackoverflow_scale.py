#!/usr/bin/env python
"""A Stack Overflow-shaped run at full scale with the data streamed from the host (issue 33,
item 8).

    python benchmarks/stackoverflow_scale.py                      # M = 50 and 200, 2 rounds each
    python benchmarks/stackoverflow_scale.py --clients 100000     # a smaller stand-in, stated

342,477 synthetic clients (`benchmarks/natural.py`'s "stackoverflow_full": sentences of 20
tokens over TFF's 10,004-word vocabulary, 5–20 real tokens each; lognormal client sizes with
median 130 and σ = 1.5 clipped to [1, 20,000], mean ≈ 390 against the real set's 397; 10 %
held out), converted once into a dataset cache (about 24 GB of int32 tokens on disk). FedAvg with
the word LSTM of TFF's experiments (`word_lstm`: embedding 96, LSTM 670, projection 96; batch
16, one local epoch), `--data-placement host` on 2 XLA:CPU devices: the dataset stays in the
memory-mapped cache and each round moves its M participants' sentences.

Reported: conversion time and cache size; start-up from the cache (open, program, init, compile);
seconds per round at each M (the rounds after the first of each program: medians); peak RSS of
the process (mapped pages included) against the cache size; checkpoint size and time of the
run's state; and the memory plan of a personalised algorithm holding a model per client (ditto)
with the same data, which does not fit: per-client state is held on the devices for now.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _du_mb(path: str) -> float:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=342477)
    p.add_argument("--clients-per-round", nargs="+", type=int, default=[50, 200], dest="ms")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default="word_lstm")
    p.add_argument("--cache-root", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                        "fedjax_pfl_bench_natural"))
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()
    import jax
    import numpy as np

    from fedjax_pfl import algorithms, checkpoint, core, models
    from fedjax_pfl.data import cache, formats
    from natural import SyntheticReader

    out: dict = {"clients": args.clients, "model": args.model, "devices": None}
    cache_dir = os.path.join(args.cache_root, f"stackoverflow_full_{args.clients}")
    if not os.path.exists(os.path.join(cache_dir, "meta.json")):
        reader = SyntheticReader("stackoverflow_full", args.clients)
        t0 = time.perf_counter()
        cache.build(reader, cache_dir)
        out["conversion_s"] = time.perf_counter() - t0 - reader.generate_s
        out["generate_s"] = reader.generate_s
    out["cache_gb"] = _du_mb(cache_dir) / 1024
    t_start = time.perf_counter()
    nc = cache.open(cache_dir)
    data = formats.to_federated(nc, device=False)
    out["open_s"] = time.perf_counter() - t_start
    out["sentences"] = {"train": int(nc.train_counts().sum()), "test": int(nc.test_counts().sum())}
    out["rss_after_open_mb"] = _rss_mb()
    model = models.get(args.model, data.input_shape, data.num_classes, task=data.task)
    out["devices"] = len(jax.devices())
    print(f"{args.clients:,} clients, {out['sentences']['train']:,} training sentences, cache "
          f"{out['cache_gb']:.1f} GB, opened in {out['open_s']:.2f} s; {out['devices']} devices; "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    keys = jax.random.key(1)
    out["runs"] = []
    for m in args.ms:
        row = {"m": m}
        t0 = time.perf_counter()
        algo = algorithms.get("fedavg", model=model, participation=m / args.clients,
                              batch_size=16, local_epochs=1)
        program = core.Program(algo, data, mesh=core.client_mesh(), data_placement="host")
        state = program.init(jax.random.key(0))
        jax.block_until_ready(state)
        row["init_s"] = time.perf_counter() - t0
        row["compile_s"] = program.compile(keys)
        row["startup_s"] = out["open_s"] + row["init_s"] + row["compile_s"]
        times, steps = [], []
        for r in range(args.rounds):
            t0 = time.perf_counter()
            state, metrics = program.run_rounds(state, keys, r, 1)
            times.append(time.perf_counter() - t0)
            steps.append(int(metrics[0]["client_steps"]))
            print(f"  M = {m}: round {r + 1} {times[-1]:.1f} s, {steps[-1]} client steps, load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
        row["round_s"] = times
        row["round_s_median"] = statistics.median(times[1:] or times)
        row["client_steps"] = steps
        row["rss_mb"] = _rss_mb()
        row["buffer_rows"] = program.stream.round_rows
        row["plan"] = program.memory_plan().describe()
        ckpt = tempfile.mkdtemp(prefix="fedjax_pfl_ckpt_")
        t0 = time.perf_counter()
        checkpoint.save(os.path.join(ckpt, "c"), state)
        row["checkpoint_s"] = time.perf_counter() - t0
        row["checkpoint_mb"] = _du_mb(ckpt)
        shutil.rmtree(ckpt, ignore_errors=True)
        program.stream.close()
        print(f"M = {m}: start-up {row['startup_s']:.1f} s (open {out['open_s']:.2f}, init "
              f"{row['init_s']:.1f}, compile {row['compile_s']:.1f}); round {row['round_s_median']:.1f} s; "
              f"peak RSS {row['rss_mb']:,.0f} MB; checkpoint {row['checkpoint_mb']:.1f} MB in "
              f"{row['checkpoint_s']:.2f} s\n{row['plan']}", flush=True)
        out["runs"].append(row)
    # A model per client: the memory plan of ditto on the same data (nothing is allocated).
    ditto = algorithms.get("ditto", model=model, participation=args.ms[0] / args.clients,
                           batch_size=16, local_epochs=1)
    plan = core.Program(ditto, data, mesh=core.client_mesh(), data_placement="host").memory_plan()
    out["ditto_plan"] = plan.describe()
    out["ditto_state_per_client_mb"] = plan.state_per_client / 2**20
    out["ditto_total_gib"] = plan.total / 2**30
    print(f"ditto with a model per client: {plan.describe()}", flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
