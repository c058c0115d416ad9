#!/usr/bin/env python
"""Where clients wait between rounds: the samples on the devices, on the host or sharded over the
devices, and the per-client state on the devices or on the host, on a FEMNIST-shaped set.

    python benchmarks/placement.py data                            # M = 10 and 50, 3 repeats
    python benchmarks/placement.py data --clients-per-round 10 --repeats 5 --rounds 4
    python benchmarks/placement.py state                           # Ditto, 1,000 clients
    python benchmarks/placement.py state --algo pgfedmo --clients-per-round 10 --repeats 5

Data: synthetic FEMNIST-like clients (`natural.py`'s SyntheticReader: lognormal sizes of mean
≈ 226, 28×28 uint8, 62 classes), converted once into a dataset cache under --cache-root and
memory-mapped from it, `femnist_cnn`, batch 10, one local epoch, participation M / N, on the
machine's devices (one XLA:CPU device per core). Each program is built as the command line
builds it (`runner.prepare`) and compiled in this process; the programs then run interleaved:
each repeat runs --rounds rounds of each program in turn, a repeat's round time is the median of
its rounds, and the table gives the median over repeats and each program's time over device
placement's (per repeat, then median and range).

  data   FedAvg on 3,400 clients, three programs: `--data-placement device` (the dataset on every
         device), `host` (each round's participants' samples moved to the devices) and
         `sharded` (each device holds its own range of clients; a round's participants' samples
         move between the devices; device placement on one device). Also printed: the data
         bytes each program holds a device (`Program.memory_plan`).
  state  Ditto (a 4.8 MB personal model per client) on 1,000 clients, the data on the devices,
         two programs: `--state-placement device` (the client state sharded over the devices)
         and `host` (a host store of the rows some round has written; each call moves its
         participants' rows). Also printed: the store's size after the last round (the host
         arrays `Program.checkpoint_parts` returns), the client state the devices hold under
         device placement, and the host program's memory plan a device.

Both placements prefetch the next call's samples or rows in the background on accelerators only
(the library's default); what that hides on CPU is in docs/decisions/host-prefetch.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]     # this checkout's library; natural.py beside it

import natural  # noqa: E402  (benchmarks/natural.py; imports no JAX)


def build(algo: str, model: str, m: int, data, data_placement: str, state_placement: str,
          hparams: dict | None = None):
    """(runner.prepare's result, its compiled program's state after one warm-up round)."""
    import jax

    from fedjax_pfl import runner

    cfg = runner.RunConfig(algo=algo, model=model, progress=False, memory_check=False,
                           data_placement=data_placement, state_placement=state_placement,
                           hparams=dict(participation=m / data.num_real_clients, batch_size=10,
                                        local_epochs=1, **(hparams or {})))
    prep = runner.prepare(cfg, data=data)
    prep.program.compile(prep.round_keys)
    state = prep.program.init(jax.random.fold_in(prep.root, 0))
    state, _ = prep.program.run_rounds(state, prep.round_keys, 0, 1)      # warm: the first call
    return prep, state


def interleaved(programs: dict, rounds: int, repeats: int) -> tuple[dict, list]:
    """Each repeat: `rounds` rounds of every program in turn. Returns ({name: [median round s of
    each repeat]}, 1-minute loads at the start of each repeat). `programs` maps a name to
    [prep, state, next round] (updated)."""
    import jax

    times = {name: [] for name in programs}
    loads = []
    for _ in range(repeats):
        loads.append(os.getloadavg()[0])
        for name, entry in programs.items():
            prep, state, r = entry
            per = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                state, _ = prep.program.run_rounds(state, prep.round_keys, r, 1)
                # (a no-op for host state: its round has returned its rows to the store)
                jax.block_until_ready(state)
                per.append(time.perf_counter() - t0)
                r += 1
            entry[1], entry[2] = state, r
            times[name].append(statistics.median(per))
    return times, loads


def ratios(times: dict, name: str) -> list[float]:
    return [t / d for t, d in zip(times[name], times["device"])]


def data_mode(args, kind: str) -> None:
    import jax

    data = natural.femnist_host_data(args.clients, args.cache_root)
    print(f"{args.clients} clients, {data.x.shape[0]:,} samples ({data.x.nbytes / 2**20:.0f} MB "
          f"of images), devices {kind}, JAX {jax.__version__}, load {os.getloadavg()[0]:.1f}",
          flush=True)
    for m in args.ms:
        programs = {p: [*build("fedavg", "femnist_cnn", m, data, p, "device"), 1]
                    for p in ("device", "host", "sharded")}
        times, loads = interleaved(programs, args.rounds, args.repeats)
        med = {k: statistics.median(v) for k, v in times.items()}
        per_device = {k: v[0].program.memory_plan().data for k, v in programs.items()}
        row = {"mode": "data", "m": m, "clients": args.clients, "devices": kind, "round_s": med,
               "round_s_range": {k: (min(v), max(v)) for k, v in times.items()},
               **{f"{p}_over_device": statistics.median(ratios(times, p)) for p in ("host", "sharded")},
               **{f"{p}_over_device_range": (min(ratios(times, p)), max(ratios(times, p)))
                  for p in ("host", "sharded")},
               "data_per_device": per_device, "load": (min(loads), max(loads)),
               "repeats": args.repeats, "rounds": args.rounds}
        print(f"M = {m}: round s device {med['device']:.3f}, host {med['host']:.3f}, sharded "
              f"{med['sharded']:.3f}; host/device {row['host_over_device']:.3f} "
              f"({row['host_over_device_range'][0]:.3f}–{row['host_over_device_range'][1]:.3f}), "
              f"sharded/device {row['sharded_over_device']:.3f} "
              f"({row['sharded_over_device_range'][0]:.3f}–{row['sharded_over_device_range'][1]:.3f}); "
              f"data per device MB { {k: round(v / 2**20, 1) for k, v in per_device.items()} }; "
              f"load {min(loads):.1f}–{max(loads):.1f}", flush=True)
        _log(args, row)
        del programs


def state_mode(args, kind: str) -> None:
    import jax

    data = natural.femnist_host_data(args.clients, args.cache_root)
    print(f"{args.algo} with {args.model}: {args.clients} clients, devices {kind}, JAX "
          f"{jax.__version__}, load {os.getloadavg()[0]:.1f}", flush=True)
    momentum = {"momentum": 0.9, "momentum_buffer": "persist"} if args.persist_momentum else {}
    for m in args.ms:
        programs = {p: [*build(args.algo, args.model, m, data, "device", p, momentum), 1]
                    for p in ("device", "host")}
        times, loads = interleaved(programs, args.rounds, args.repeats)
        med = {k: statistics.median(v) for k, v in times.items()}
        host_prep, host_state, _ = programs["host"]
        plan = host_prep.program.memory_plan()
        device_plan = programs["device"][0].program.memory_plan()
        _, store = host_prep.program.checkpoint_parts(host_state)
        ratio = ratios(times, "host")
        row = {"mode": "state", "algo": args.algo, "m": m, "clients": args.clients, "devices": kind,
               "round_s": med, "round_s_range": {k: (min(v), max(v)) for k, v in times.items()},
               "host_over_device": statistics.median(ratio),
               "host_over_device_range": (min(ratio), max(ratio)),
               "store_mb": sum(a.nbytes for a in store.values()) / 2**20,
               "device_state_mb": device_plan.state_per_client * device_plan.num_clients / 2**20,
               "host_plan_per_device_mb": plan.per_device / 2**20,
               "host_working_set_mb": max(plan.working_set, plan.eval_working_set) / 2**20,
               "load": (min(loads), max(loads)), "repeats": args.repeats, "rounds": args.rounds}
        print(f"M = {m}: round s device {med['device']:.3f}, host {med['host']:.3f}; host/device "
              f"{row['host_over_device']:.3f} ({min(ratio):.3f}–{max(ratio):.3f}); store "
              f"{row['store_mb']:.1f} MB against {row['device_state_mb']:.1f} MB on the devices; "
              f"host plan {row['host_plan_per_device_mb']:.0f} MB a device (working set "
              f"{row['host_working_set_mb']:.0f} MB); load {min(loads):.1f}–{max(loads):.1f}",
              flush=True)
        _log(args, row)
        del programs, host_state, store


def _log(args, row: dict) -> None:
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True, metavar="{data,state}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--clients-per-round", nargs="+", type=int, default=[10, 50], dest="ms")
    common.add_argument("--rounds", type=int, default=3, help="rounds of each program per repeat")
    common.add_argument("--repeats", type=int, default=3)
    common.add_argument("--cache-root", default=natural.CACHE_ROOT,
                        help="where the synthetic set's cache is built once (default %(default)s)")
    common.add_argument("--json", default=None, help="append one JSON line per M here")
    d = sub.add_parser("data", parents=[common], help="device, host and sharded data placement (FedAvg)")
    d.add_argument("--clients", type=int, default=3400)
    s = sub.add_parser("state", parents=[common], help="device and host client-state placement (Ditto)")
    s.add_argument("--clients", type=int, default=1000)
    s.add_argument("--algo", default="ditto", help="an algorithm with per-client state (default ditto)")
    s.add_argument("--model", default="femnist_cnn")
    s.add_argument("--persist-momentum", action="store_true",
                   help="momentum 0.9 with per-client buffers kept (three rows per client)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()
    kind = natural.devices_line()
    (data_mode if args.mode == "data" else state_mode)(args, kind)


if __name__ == "__main__":
    main()
