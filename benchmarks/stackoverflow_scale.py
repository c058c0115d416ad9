#!/usr/bin/env python
"""A Stack Overflow-shaped run at full scale with the data streamed from the host (issue 33,
items 2 and 8).

    python benchmarks/stackoverflow_scale.py                      # FedAvg, M = 50 and 200, 2 rounds each
    python benchmarks/stackoverflow_scale.py --clients 100000     # a smaller stand-in, stated
    python benchmarks/stackoverflow_scale.py --algo ditto --state-placement host \
        --clients-per-round 50 --rounds 3                         # a model per client

342,477 synthetic clients (`benchmarks/natural.py`'s "stackoverflow_full": sentences of 20
tokens over TFF's 10,004-word vocabulary, 5–20 real tokens each; lognormal client sizes with
median 130 and σ = 1.5 clipped to [1, 20,000], mean ≈ 390 against the real set's 397; 10 %
held out), converted once into a dataset cache (about 24 GB of int32 tokens on disk). FedAvg with
the word LSTM of TFF's experiments (`word_lstm`: embedding 96, LSTM 670, projection 96; batch
16, one local epoch), `--data-placement host` on 2 XLA:CPU devices, each program built as the
command line builds it (`runner.prepare`): the dataset stays in the memory-mapped cache and each
round moves its M participants' sentences.

Reported: conversion time and cache size; start-up from the cache (open, program, init, compile);
seconds per round at each M (the rounds after the first of each program: medians); peak RSS of
the process (mapped pages included) against the cache size; checkpoint size and time of the
run's state; and the memory plan of a personalised algorithm holding a model per client (ditto)
with the same data and its client state on the devices, which does not fit.

`--algo ditto --state-placement host` runs that personalised algorithm (a personal model per
client, 15.5 MB each with word_lstm) at full N with its client rows in the copy-on-write host
store: each call moves only its participants' rows to the devices, and the store grows with the
clients some round has written, not with N (the RSS after every round; the store's size after the
last, as the host arrays of `Program.checkpoint_parts`). Also reported: the memory plan with host
state, the plan the same program would need with device state (not allocated), and the
checkpoint of that state (`Program.checkpoint_parts`: device leaves by orbax, the store's rows as
host arrays).
`--state-placement device` with ditto runs only where its plan fits (it does not at full N);
with host state an M whose compiled plan does not fit is skipped too (each device receives the
rows of the clients it trains: M = 200 plans 19.0 GB on 2 devices, which a 24 GB host holds;
benchmarks/RESULTS.md, "Stack Overflow at full scale").
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


def _current_rss_mb() -> float:
    """Resident memory now (VmRSS; mapped cache pages included), MB; 0 where /proc is absent."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _load() -> float:
    return os.getloadavg()[0]


def _du_mb(path: str) -> float:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total / 2**20


def _model_options(pairs: list[str]) -> dict:
    """--model-option key=value (repeatable): the text models' sizes (ints where they parse)."""
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if not value:
            raise SystemExit(f"--model-option wants key=value, got {pair!r}")
        try:
            out[key] = int(value)
        except ValueError:
            out[key] = {"true": True, "false": False}.get(value.lower(), value)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=342477)
    p.add_argument("--clients-per-round", nargs="+", type=int, default=[50, 200], dest="ms")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--algo", choices=("fedavg", "ditto"), default="fedavg",
                   help="fedavg (default; a shared model only) or ditto (a personal model per "
                        "client: run it with --state-placement host at full scale)")
    p.add_argument("--state-placement", choices=("device", "host"), default=None,
                   help="where per-client state waits (default: device for fedavg, host for ditto)")
    p.add_argument("--model", default="word_lstm")
    p.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a text model's size, e.g. hidden=128 (repeatable; default: TFF's sizes)")
    p.add_argument("--cache-root", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                        "fedjax_pfl_bench_natural"))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    placement = args.state_placement or ("host" if args.algo == "ditto" else "device")

    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()
    import jax
    import numpy as np
    from natural import SyntheticReader

    from fedjax_pfl import checkpoint, models, runner
    from fedjax_pfl.data import cache, formats

    options = _model_options(args.model_option)
    out: dict = {"clients": args.clients, "model": args.model, "devices": None}
    if args.algo != "fedavg" or placement != "device" or options:
        out.update(algo=args.algo, state_placement=placement, model_options=options)
    cache_dir = os.path.join(args.cache_root, f"stackoverflow_full_{args.clients}")
    if not os.path.exists(os.path.join(cache_dir, "meta.json")):
        reader = SyntheticReader("stackoverflow_full", args.clients)
        t0 = time.perf_counter()
        load0 = _load()
        cache.build(reader, cache_dir)
        out["conversion_s"] = time.perf_counter() - t0 - reader.generate_s
        out["generate_s"] = reader.generate_s
        out["conversion_load"] = [load0, _load()]
        print(f"cache built in {out['conversion_s'] + out['generate_s']:.0f} s (conversion "
              f"{out['conversion_s']:.0f} s, generating {out['generate_s']:.0f} s); load "
              f"{load0:.1f} -> {_load():.1f}", flush=True)
    out["cache_gb"] = _du_mb(cache_dir) / 1024
    t_start = time.perf_counter()
    nc = cache.open(cache_dir)
    data = formats.to_federated(nc, device=False)
    out["open_s"] = time.perf_counter() - t_start
    out["sentences"] = {"train": int(nc.train_counts().sum()), "test": int(nc.test_counts().sum())}
    out["rss_after_open_mb"] = _rss_mb()

    def prepare(algo: str, m: int, state_placement: str):
        """runner.prepare of `algo` on the cached set, its data on the host (nothing compiled,
        nothing allocated yet)."""
        cfg = runner.RunConfig(algo=algo, model=args.model, model_options=options, progress=False,
                               memory_check=False, data_placement="host",
                               state_placement=state_placement,
                               hparams=dict(participation=m / args.clients, batch_size=16,
                                            local_epochs=1))
        return runner.prepare(cfg, data=data)

    out["devices"] = len(jax.devices())
    print(f"{args.clients:,} clients, {out['sentences']['train']:,} training sentences, cache "
          f"{out['cache_gb']:.1f} GB, opened in {out['open_s']:.2f} s; {out['devices']} devices; "
          f"load {_load():.1f}", flush=True)
    out["runs"] = []
    for m in args.ms:
        row = {"m": m}
        t0 = time.perf_counter()
        if placement == "device" and args.algo != "fedavg":
            # A model per client on the devices: run only where its plan fits (not at full N).
            plan = prepare(args.algo, m, "device").program.memory_plan()
            if not plan.fits():
                print(f"M = {m}: {args.algo} with its client state on the devices does not fit; "
                      f"not run (use --state-placement host):\n{plan.describe()}", flush=True)
                row.update(skipped="does not fit", plan=plan.describe(), plan_total=plan.total)
                out["runs"].append(row)
                continue
        prep = prepare(args.algo, m, placement)
        program = prep.program
        if "parameters" not in out:
            model = models.get(args.model, data.input_shape, data.num_classes, task=data.task,
                               options=options)
            out["parameters"] = int(sum(np.prod(a.shape) for a in jax.tree.leaves(
                jax.eval_shape(model.init, jax.random.key(0)))))
            if args.algo != "fedavg" or options:
                print(f"{args.algo} with {args.model} {options or ''}({out['parameters']:,} "
                      f"parameters), --state-placement {placement}, --data-placement host",
                      flush=True)
        row["program_s"] = time.perf_counter() - t0
        state = program.init(jax.random.fold_in(prep.root, 0))
        jax.block_until_ready(state)           # (host state: its device leaves are not a pytree)
        row["init_s"] = time.perf_counter() - t0
        row["compile_s"] = program.compile(prep.round_keys)
        row["startup_s"] = out["open_s"] + row["init_s"] + row["compile_s"]
        row["startup_load"] = _load()
        row["rss_after_compile_mb"] = _current_rss_mb()
        if args.algo != "fedavg" and not program.memory_plan().fits():
            # The call's client world (its participants' rows) and the round's working set grow
            # with M: where they do not fit, the rounds would only be killed.
            plan = program.memory_plan()
            print(f"M = {m}: {args.algo}'s compiled plan does not fit in the memory available "
                  f"now; not run:\n{plan.describe()}", flush=True)
            row.update(skipped="does not fit", plan=plan.describe(), plan_total=plan.total)
            del prep, program, state
            out["runs"].append(row)
            continue
        print(f"M = {m}: start-up {row['startup_s']:.1f} s (open {out['open_s']:.2f}, init "
              f"{row['init_s']:.1f}, compile {row['compile_s']:.1f}); load "
              f"{row['startup_load']:.1f}; RSS {row['rss_after_compile_mb']:,.0f} MB", flush=True)
        times, steps, loads, rounds = [], [], [], []
        for r in range(args.rounds):
            t0 = time.perf_counter()
            state, metrics = program.run_rounds(state, prep.round_keys, r, 1)
            times.append(time.perf_counter() - t0)
            steps.append(int(metrics[0]["client_steps"]))
            loads.append(_load())
            rounds.append({"rss_mb": _current_rss_mb(), "peak_rss_mb": _rss_mb()})
            print(f"  M = {m}: round {r + 1} {times[-1]:.1f} s, {steps[-1]} client steps, load "
                  f"{loads[-1]:.1f}; RSS {rounds[-1]['rss_mb']:,.0f} MB (peak "
                  f"{rounds[-1]['peak_rss_mb']:,.0f})", flush=True)
        row["round_s"] = times
        row["round_s_median"] = statistics.median(times[1:] or times)
        row["client_steps"] = steps
        row["round_load"] = loads
        row["rounds"] = rounds
        row["rss_mb"] = _rss_mb()
        plan = program.memory_plan()
        row["plan"] = plan.describe()
        row["plan_total"] = plan.total
        ckpt = tempfile.mkdtemp(prefix="fedjax_pfl_ckpt_")
        try:
            t0 = time.perf_counter()
            tree, host = program.checkpoint_parts(state)
            checkpoint.save(os.path.join(ckpt, "c"), tree, host=host or None)
            row["checkpoint_s"] = time.perf_counter() - t0
            row["checkpoint_mb"] = _du_mb(ckpt)
            row["checkpoint_load"] = _load()
            if placement == "host":   # the store: the rows of the clients some round has written
                row["store_mb"] = sum(a.nbytes for a in host.values()) / 2**20
        finally:
            shutil.rmtree(ckpt, ignore_errors=True)
        store = f"; store {row['store_mb']:,.1f} MB" if "store_mb" in row else ""
        print(f"M = {m}: start-up {row['startup_s']:.1f} s (open {out['open_s']:.2f}, init "
              f"{row['init_s']:.1f}, compile {row['compile_s']:.1f}); round {row['round_s_median']:.1f} s; "
              f"peak RSS {row['rss_mb']:,.0f} MB; checkpoint {row['checkpoint_mb']:.1f} MB in "
              f"{row['checkpoint_s']:.2f} s (load {row['checkpoint_load']:.1f}){store}\n{row['plan']}",
              flush=True)
        del prep, program, state, tree, host
        if placement == "host":
            # What the same program would need with the client rows on the devices (a plan only:
            # nothing is allocated or compiled).
            dplan = prepare(args.algo, m, "device").program.memory_plan()
            row["device_plan"] = dplan.describe()
            row["device_plan_total"] = dplan.total
            print(f"M = {m}, the same program with --state-placement device (not compiled, "
                  f"not allocated): {dplan.total / 2**30:,.1f} GiB\n{dplan.describe()}", flush=True)
        out["runs"].append(row)
    if args.algo == "fedavg":
        # A model per client: the memory plan of ditto on the same data (nothing is allocated).
        plan = prepare("ditto", args.ms[0], "device").program.memory_plan()
        out["ditto_plan"] = plan.describe()
        out["ditto_state_per_client_mb"] = plan.state_per_client / 2**20
        out["ditto_total_gib"] = plan.total / 2**30
        print(f"ditto with a model per client, its client state on the devices: {plan.describe()}"
              f"\n  (--algo ditto --state-placement host keeps it on the host)", flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
