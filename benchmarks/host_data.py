#!/usr/bin/env python
"""Host and sharded against device data placement on a FEMNIST-shaped set (issue 33, item 8).

    python benchmarks/host_data.py                                   # M = 10 and 50, 3 repeats
    python benchmarks/host_data.py --clients-per-round 10 --repeats 5 --rounds 4

3,400 synthetic FEMNIST-like clients (`benchmarks/natural.py`'s SyntheticReader: lognormal sizes
of mean ≈ 226, 28×28 uint8, 62 classes), converted once into a cache, `femnist_cnn`, FedAvg with
batch 10 and one local epoch on 2 XLA:CPU devices, participation M / N. Three programs are
compiled in one process: device placement (the dataset replicated on both devices), host
placement with the prefetch (the next round's participants gathered and transferred in the
background), host placement without it (each round stages its own participants first) and
sharded placement (each device holds half the clients; a round's participants' samples move
between the devices, `core.sharded`).
They then run interleaved: each repeat runs `--rounds` rounds of each program, in turn, and the
median round time of each is taken; ratios are per repeat, then the median (range) over repeats.

Also reported: the time to stage one round alone (participants probe, host gather, transfer; for
sharded: the probe and the exchange between the devices), and what the prefetch hides:
1 − (host − device) / (host without prefetch − device).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import natural  # noqa: E402  (benchmarks/natural.py; imports no JAX)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=3400)
    natural.add_placement_args(p)
    args = p.parse_args()

    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()
    import jax

    from fedjax_pfl import algorithms, core, models

    host_data = natural.femnist_host_data(args.clients, args.cache_root or natural.CACHE_ROOT)
    kind = natural.devices_line()
    print(f"{args.clients} clients, {host_data.x.shape[0]:,} samples ({host_data.x.nbytes / 2**20:.0f} MB "
          f"of images), devices {kind}, JAX {jax.__version__}, load {os.getloadavg()[0]:.1f}", flush=True)
    model = models.get("femnist_cnn", host_data.input_shape, host_data.num_classes, task=host_data.task)
    keys = jax.random.key(1)

    for m in args.ms:
        algo = algorithms.get("fedavg", model=model, participation=m / args.clients, batch_size=10,
                              local_epochs=1)
        programs = {}
        for name, placement in (("device", "device"), ("host", "host"), ("host_no_prefetch", "host"),
                                ("sharded", "sharded")):
            prog = core.Program(algo, host_data, mesh=core.client_mesh(), data_placement=placement)
            if placement == "host":       # (the prefetch is off by default on CPU)
                prog.stream.prefetch_enabled = name == "host"
            t0 = time.perf_counter()
            prog.compile(keys)
            state = prog.init(jax.random.key(0))
            state, _ = prog.run_rounds(state, keys, 0, 1)          # warm: first call
            programs[name] = [prog, state, 1, time.perf_counter() - t0]
        stage_s, exchange_s = [], []
        host, sharded = programs["host"][0], programs["sharded"][0]
        for r in range(5):
            for prog, out in ((host, stage_s), (sharded, exchange_s)):
                t0 = time.perf_counter()
                staged = prog.stream.stage(keys, 100 + r, 1)
                jax.block_until_ready(staged.data.x.rows)
                out.append(time.perf_counter() - t0)
        times = {name: [] for name in programs}
        loads = []
        for rep in range(args.repeats):
            loads.append(os.getloadavg()[0])
            for name, entry in programs.items():
                prog, state, r, _ = entry
                per = []
                for _ in range(args.rounds):
                    t0 = time.perf_counter()
                    state, _ = prog.run_rounds(state, keys, r, 1)
                    per.append(time.perf_counter() - t0)
                    r += 1
                entry[1], entry[2] = state, r
                times[name].append(statistics.median(per))
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = [h / d for h, d in zip(times["host"], times["device"])]
        ratio_np = [h / d for h, d in zip(times["host_no_prefetch"], times["device"])]
        ratio_sh = [h / d for h, d in zip(times["sharded"], times["device"])]
        exposed = med["host_no_prefetch"] - med["device"]
        hidden = 1 - (med["host"] - med["device"]) / exposed if exposed > 0 else float("nan")
        row = {"m": m, "clients": args.clients, "devices": kind, "round_s": med,
               "round_s_range": {k: (min(v), max(v)) for k, v in times.items()},
               "host_over_device": statistics.median(ratio), "host_over_device_range": (min(ratio), max(ratio)),
               "no_prefetch_over_device": statistics.median(ratio_np),
               "sharded_over_device": statistics.median(ratio_sh),
               "sharded_over_device_range": (min(ratio_sh), max(ratio_sh)),
               "stage_s": statistics.median(stage_s), "hidden_fraction": hidden,
               "exchange_s": statistics.median(exchange_s),
               "buffer_rows": host.stream.round_rows, "block_rows": host.stream.block_rows,
               "range_rows": sharded.stream.layout.rows,
               "data_per_device": {k: v[0].memory_plan().data for k, v in programs.items()},
               "load": (min(loads), max(loads)), "repeats": args.repeats, "rounds": args.rounds}
        print(f"M = {m}: round s device {med['device']:.3f}, host {med['host']:.3f}, host without "
              f"prefetch {med['host_no_prefetch']:.3f}; host/device {row['host_over_device']:.3f} "
              f"({min(ratio):.3f}–{max(ratio):.3f}), without prefetch "
              f"{row['no_prefetch_over_device']:.3f}; staging one round {row['stage_s'] * 1e3:.1f} ms "
              f"({host.stream.block_rows} rows a device); prefetch hides {hidden:.0%}; sharded "
              f"{med['sharded']:.3f}, sharded/device {row['sharded_over_device']:.3f} "
              f"({min(ratio_sh):.3f}–{max(ratio_sh):.3f}), exchange one round "
              f"{row['exchange_s'] * 1e3:.1f} ms; data per device MB "
              f"{ {k: round(v / 2**20, 1) for k, v in row['data_per_device'].items()} }; load "
              f"{min(loads):.1f}–{max(loads):.1f}", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
        for prog, *_ in programs.values():
            if prog.stream is not None:
                prog.stream.close()


if __name__ == "__main__":
    main()
