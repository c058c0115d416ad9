#!/usr/bin/env python
"""Scale: memory and round time against the client count N at fixed M, skewed client sizes,
vmapped seeds, and one run over several processes.

    python benchmarks/scale.py clients --algos fedavg pfedsop pgfedmo --clients 100 1000 10000 100000
    python benchmarks/scale.py clients ... --devices 1 2 --json benchmarks/scale.jsonl
    python benchmarks/scale.py skew
    python benchmarks/scale.py seeds --seeds 8 32
    python benchmarks/scale.py processes --processes 2 -- --algo ditto --dataset synthetic \
        --synthetic-clients 20000 --participation 1.0 --local-steps 1 --rounds 1

clients, skew, seeds: every configuration runs in a fresh process (so its peak memory is its own)
with --devices XLA:CPU devices (`use_cpu_cores`), or on the accelerator where one is present,
built as the command line builds it (`runner.prepare`, data and client state on the devices).
Data are random: MNIST-shaped 28×28 uint8 images (`--image 28`) or 8×8 (`--image 8`, for
N = 10⁶), 20 training and 5 test samples per client, 10 classes; M = 100 clients per round, one
local epoch of batch 10 (2 steps per client), no evaluation inside the timed rounds.
  clients  reports peak RSS of the process (MB; on GPU the device's peak bytes in use), compile
           seconds (`Program.compile`), seconds per round (median of the timed rounds after the
           first), rounds per hour and the memory plan's bytes per device (`Program.memory_plan`).
  skew     FedAvg with the MLP, N = 10,000: one client of 20,000 training samples and the rest of
           20 ("skewed"), against the same total spread evenly ("uniform"); also the median round
           with the big client in it.
  seeds    FedAvg with the MLP, 20 clients of 100 samples, 10 rounds: `--seeds` runs as one
           vmapped program (`fedjax_pfl.sweep.run_group`, as `run.py --seeds`) against one run
           after another (`runner.run`, each compiling its own); total seconds and peak memory.

processes: `experiments/run.py` with the flags after `--`, over --processes processes on the
loopback address (one CPU device each), reporting each process's exit status, wall time and
peak resident memory (`os.wait4`'s ru_maxrss). `--tree` runs another checkout's run.py (e.g. a
`git worktree` of an older commit) for before/after figures on the same machine; `--out` is
added (a fresh temporary directory) unless the flags give one.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)          # this checkout's library


def _data(n, per, test, image, sizes=None):
    import numpy as np

    from fedjax_pfl.data import FederatedData

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
    """One clients/skew/seeds configuration, in this process."""
    os.environ["FEDJAX_PFL_CPU_DEVICES"] = str(cfg.get("devices", 1))
    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()
    import jax
    import numpy as np

    from fedjax_pfl import runner

    if cfg["kind"] == "seeds":
        return _seeds(cfg)
    out = dict(cfg)
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
    rc = runner.RunConfig(algo=cfg["algo"], model=cfg["model"], progress=False, memory_check=False,
                          state_dtype=cfg.get("state_dtype", "float32"), data_placement="device",
                          state_placement="device",
                          hparams=dict(participation=cfg["m"] / n, batch_size=10, local_epochs=1))
    prep = runner.prepare(rc, data=data)
    program = prep.program
    out["compile_s"] = program.compile(prep.round_keys)
    plan = program.memory_plan()
    out["plan_per_device_mb"] = plan.per_device / 2**20
    out["plan_state_per_device_mb"] = plan.client_state_per_device / 2**20
    state = program.init(jax.random.fold_in(prep.root, 0))
    jax.block_until_ready(state)
    times, big_rounds = [], []
    for r in range(cfg["rounds"]):
        t1 = time.perf_counter()
        state, m = program.run_rounds(state, prep.round_keys, r, 1)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t1)
        if cfg["kind"] == "skew":
            big_rounds.append(bool(0 in set(np.asarray(m[0]["sampled"]).tolist())))
    timed = times[1:] if len(times) > 1 else times
    out["round_s"] = float(np.median(timed))
    out["round_mean_s"] = float(np.mean(timed))
    out["rounds_per_hour"] = 3600.0 / out["round_s"]
    if cfg["kind"] == "skew":
        with_big = [t for t, b in zip(times, big_rounds) if b]
        with_big = with_big[1:] or with_big        # (the first of them may be round 0, the warm-up)
        out["rounds_with_big_client"] = int(sum(big_rounds))
        out["round_with_big_s"] = float(np.median(with_big)) if with_big else None
    out["peak_mb"] = _peak_mb()
    out["devices_used"] = len(jax.devices())
    out["platform"] = jax.devices()[0].platform
    return out


def _seeds(cfg: dict) -> dict:
    """`seeds` runs of FedAvg: one vmapped program against one run after another."""
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


def configurations(args) -> list[dict]:
    if args.what == "clients":
        return [dict(kind="clients", algo=a, clients=n, devices=d, model=args.model,
                     image=args.image, m=args.m, rounds=args.rounds, state_dtype=args.state_dtype)
                for a in args.algos for n in args.clients for d in args.devices]
    if args.what == "skew":
        return [dict(kind="skew", algo="fedavg", clients=10_000, devices=d, model="mlp", image=28,
                     m=100, rounds=args.rounds, layout=layout, big=20_000, small=20)
                for layout in ("uniform", "skewed") for d in args.devices]
    return [dict(kind="seeds", algo="fedavg", seeds=s, mode=mode, rounds=10, devices=d)
            for s in args.seeds for mode in ("vmapped", "sequential") for d in args.devices]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes(args) -> int:
    """One experiments/run.py run over args.processes processes; each one's wall time and peak RSS."""
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    if args.processes < 1:
        raise SystemExit("scale.py processes: error: --processes must be at least 1")
    out = [] if "--out" in flags else ["--out", tempfile.mkdtemp(prefix="fedjax_pfl_mp_")]
    tree = os.path.abspath(args.tree)
    env = {**os.environ, "FEDJAX_PFL_CPU_DEVICES": "1", "PYTHONPATH": tree}
    port = _free_port()
    started = time.perf_counter()
    procs = {}
    for k in range(args.processes):
        cmd = [sys.executable, os.path.join(tree, "experiments", "run.py"), *flags, *out, "--quiet",
               "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(args.processes),
               "--process-id", str(k)]
        log = open(os.path.join(tempfile.gettempdir(), f"fedjax_pfl_mp_{port}_{k}.log"), "w")
        procs[subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).pid] = (k, log)
    results = {}
    while procs:
        pid, status, usage = os.wait4(-1, 0)
        if pid not in procs:
            continue
        k, log = procs.pop(pid)
        log.close()
        results[k] = (os.waitstatus_to_exitcode(status), time.perf_counter() - started,
                      usage.ru_maxrss / 2**20)
    print(f"tree {tree}, {args.processes} processes, flags: {' '.join(flags)}")
    for k in sorted(results):
        code, wall, rss = results[k]
        print(f"  process {k}: exit {code}, wall {wall:.1f} s, peak RSS {rss:.2f} GB "
              f"(log {tempfile.gettempdir()}/fedjax_pfl_mp_{port}_{k}.log)")
    return max(code != 0 for code, _, _ in results.values())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True, metavar="{clients,skew,seeds,processes}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--devices", nargs="+", type=int, default=[1, 2],
                        help="XLA:CPU device counts, one configuration each (default 1 2)")
    common.add_argument("--json", default=None, help="append one JSON line per configuration here")
    common.add_argument("--one", default=None, help=argparse.SUPPRESS)
    c = sub.add_parser("clients", parents=[common], help="memory and round time against N at fixed M")
    c.add_argument("--algos", nargs="+", default=["fedavg", "pfedsop", "pgfedmo"])
    c.add_argument("--clients", nargs="+", type=int, default=[100, 1000, 10000])
    c.add_argument("--model", default="mlp")
    c.add_argument("--image", type=int, default=28, help="image side (28, or 8 for N = 10⁶)")
    c.add_argument("--m", type=int, default=100, help="clients per round")
    c.add_argument("--rounds", type=int, default=6)
    c.add_argument("--state-dtype", default="float32")
    s = sub.add_parser("skew", parents=[common], help="one large client against an even split")
    s.add_argument("--rounds", type=int, default=6)
    s = sub.add_parser("seeds", parents=[common], help="vmapped seeds against one run after another")
    s.add_argument("--seeds", nargs="+", type=int, default=[8, 32])
    s = sub.add_parser("processes", help="one run.py run over several processes on this host")
    s.add_argument("--processes", type=int, default=2)
    s.add_argument("--tree", default=ROOT, help="the checkout whose experiments/run.py runs")
    s.add_argument("flags", nargs=argparse.REMAINDER, help="-- then experiments/run.py's flags")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.what == "processes":
        return processes(args)
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return 0
    for cfg in configurations(args):
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
