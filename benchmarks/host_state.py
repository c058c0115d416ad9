#!/usr/bin/env python
"""Host against device client-state placement on a FEMNIST-shaped set (issue 33, item 2).

    python benchmarks/host_state.py                                  # M = 10 and 50, 3 repeats
    python benchmarks/host_state.py --algo pgfedmo --clients-per-round 10 --repeats 5

1,000 synthetic FEMNIST-like clients (`benchmarks/natural.py`'s SyntheticReader), `femnist_cnn`
(1.2 M parameters), Ditto (a 4.8 MB personal model per client: 4.8 GB of client state, which still
fits this 24 GB host's devices; `--persist-momentum` keeps two momentum rows more) with batch 10
and one local epoch on 2 XLA:CPU devices, participation M / N, the data on the devices. Three
programs compiled in one process: state on the devices (sharded), state on the host with the
rows of the next call gathered in the background (the default on accelerators), and on the host
without that prefetch (the default on CPU, where the background gather competes with the round
for the cores). They run interleaved: each repeat runs `--rounds` rounds of each program in
turn; per-repeat ratios, then their median (range).

Also reported: the host store after the last round (clients written, bytes) against the device
state's bytes, one call's row traffic (the world's rows a device, each way: on several devices
each holds the rows of the clients it trains, `core.dealt`), the calls whose rows crossed
devices, and the host program's memory plan a device.
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
    p.add_argument("--algo", default="ditto")
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--model", default="femnist_cnn")
    p.add_argument("--persist-momentum", action="store_true",
                   help="momentum 0.9 with per-client buffers kept (three rows per client)")
    natural.add_placement_args(p)
    args = p.parse_args()

    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()
    import jax

    from fedjax_pfl import algorithms, core, models

    data = natural.femnist_host_data(args.clients, args.cache_root or natural.CACHE_ROOT)
    kind = natural.devices_line()
    print(f"{args.algo} with {args.model}: {args.clients} clients, devices {kind}, JAX "
          f"{jax.__version__}, load {os.getloadavg()[0]:.1f}", flush=True)
    model = models.get(args.model, data.input_shape, data.num_classes, task=data.task)
    keys = jax.random.key(1)

    for m in args.ms:
        momentum = {"momentum": 0.9, "momentum_buffer": "persist"} if args.persist_momentum else {}
        algo = algorithms.get(args.algo, model=model, participation=m / args.clients,
                              batch_size=10, local_epochs=1, **momentum)
        programs = {}
        for name, placement in (("device", "device"), ("host", "host"),
                                ("host_no_prefetch", "host")):
            prog = core.Program(algo, data, mesh=core.client_mesh(), data_placement="device",
                                state_placement=placement)
            prog.prefetch_rows = name == "host"      # (the default: on accelerators only)
            prog.compile(keys)
            state = prog.init(jax.random.key(0))
            state, _ = prog.run_rounds(state, keys, 0, 1)          # warm: first call
            programs[name] = [prog, state, 1]
        times = {name: [] for name in programs}
        loads = []
        for _ in range(args.repeats):
            loads.append(os.getloadavg()[0])
            for name, entry in programs.items():
                prog, state, r = entry
                per = []
                for _ in range(args.rounds):
                    t0 = time.perf_counter()
                    state, _ = prog.run_rounds(state, keys, r, 1)
                    jax.block_until_ready(state.device if name != "device" else state)
                    per.append(time.perf_counter() - t0)
                    r += 1
                entry[1], entry[2] = state, r
                times[name].append(statistics.median(per))
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = [h / d for h, d in zip(times["host"], times["device"])]
        ratio_np = [h / d for h, d in zip(times["host_no_prefetch"], times["device"])]
        host_prog, host_state, _ = programs["host"]
        plan = host_prog.memory_plan()
        device_plan = programs["device"][0].memory_plan()
        store = host_state.store
        row = {"algo": args.algo, "m": m, "clients": args.clients, "devices": kind, "round_s": med,
               "round_s_range": {k: (min(v), max(v)) for k, v in times.items()},
               "host_over_device": statistics.median(ratio),
               "host_over_device_range": (min(ratio), max(ratio)),
               "no_prefetch_over_device": statistics.median(ratio_np),
               "rows_prefetch_hits": host_prog.rows_hits, "rows_prefetch_misses": host_prog.rows_misses,
               "store_clients": store.touched, "store_mb": store.nbytes() / 2**20,
               "device_state_mb": device_plan.state_per_client * device_plan.num_clients / 2**20,
               "row_mb": plan.host_row_bytes / 2**20, "world_rows": plan.world_rows,
               "host_plan_per_device_mb": plan.per_device / 2**20,
               "host_working_set_mb": max(plan.working_set, plan.eval_working_set) / 2**20,
               "world_crossings": host_prog.world_crossings,
               "load": (min(loads), max(loads)), "repeats": args.repeats, "rounds": args.rounds}
        print(f"M = {m}: round s device {med['device']:.3f}, host {med['host']:.3f}, host without "
              f"prefetch {med['host_no_prefetch']:.3f}; host/device {row['host_over_device']:.3f} "
              f"({min(ratio):.3f}–{max(ratio):.3f}), without prefetch "
              f"{row['no_prefetch_over_device']:.3f}; store {store.touched} clients, "
              f"{row['store_mb']:.1f} MB against {row['device_state_mb']:.1f} MB on the devices; "
              f"{plan.world_rows} rows of {row['row_mb']:.2f} MB a device moved each way a call "
              f"({host_prog.world_crossings} calls with rows crossing devices); host plan "
              f"{row['host_plan_per_device_mb']:.0f} MB a device (working set "
              f"{row['host_working_set_mb']:.0f} MB); load {min(loads):.1f}–{max(loads):.1f}",
              flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
