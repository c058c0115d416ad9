#!/usr/bin/env python
"""Natural-client workloads at the real sets' shapes: conversion, compile, round throughput and
memory of FedAvg and PGFedMo (issue 32, item 6).

    python benchmarks/natural.py                                   # the full grid (slow on 2 cores)
    python benchmarks/natural.py --datasets femnist --algos fedavg --clients-per-round 10 50 100
    python benchmarks/natural.py --datasets stackoverflow --clients-per-round 10 --rounds 3
    python benchmarks/natural.py --quick                           # a smoke test: 1/10 the clients
    python benchmarks/natural.py ... --json benchmarks/natural.jsonl

Data are synthetic (random pixels / token ids), generated client by client by a fake reader
(`SyntheticReader`, the `data.natural.NaturalReader` protocol) and converted with
`data.cache.build` exactly as a real LEAF/TFF file is, so the conversion time is the cache
writer's (the reader's own generation time is measured and reported apart). Shapes and client
sizes follow the published sets; the size distributions are ASSUMED lognormal fits, not read
from the files:

  femnist        3,400 clients (FedJAX's EMNIST-62 writers), train sizes lognormal with mean
                 ≈ 226, sd ≈ 89 (LEAF FEMNIST's 226.8 ± 88.9 samples per writer), clipped to
                 [10, 700], plus 10 % as many test samples; 28×28×1 uint8, 62 classes;
                 `femnist_cnn`; batch 10.
  shakespeare    715 clients (TFF's speaking roles), sequences of 80 tokens (vocabulary 90, the
                 last sequence of each client padded), heavy-tailed: lognormal median 30,
                 σ = 1.3 (mean ≈ 70 sequences, ≈ 5,600 characters), clipped to [1, 3,000],
                 test 20 %; `char_lstm`, per-token next-character task; batch 4 (FedJAX's).
  stackoverflow  1/10 of TFF's 342,477 clients: 34,000 clients of sentences of 20 tokens
                 (vocabulary 10,004; 5–20 real tokens, then padding), lognormal median 20,
                 σ = 1.2, clipped to [1, 256] (SCALED DOWN: the real set averages ≈ 400
                 sentences per client, ≈ 10× this, which would take ≈ 2 GB as int32 here),
                 test 10 %; `word_lstm`; batch 16 (TFF's).
  `--size-scale F` multiplies every client's sample count by F (the output says so).

Each configuration (dataset, algorithm, M) runs in a fresh process (its peak RSS is its own) on
2 XLA:CPU devices (`use_cpu_cores`, as run.py), participation = M / N, 1 local epoch, the
algorithm's other defaults (PGFedMo's local epochs set to 1 as well). The first process of a
dataset converts it into `--cache-root` (kept for the next ones; `--rebuild` converts again).

Reported per configuration: conversion s (cache.build, its own part), open s (cache.open),
to-device s (`formats.to_federated`), compile s (`Program.compile`: round and evaluation),
round s (median of the rounds after the first, and range), rounds/s, client-steps/s (the sampled
clients' local steps / round time), peak RSS MB (`resource.getrusage`), and the memory plan
(`Program.memory_plan()`: total GiB and whether it fits). A configuration whose plan does not fit
is not run (the plan and the client count that would fit are reported instead).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

# name -> shape of the synthetic set (see the module docstring)
DATASETS = {
    "femnist": dict(clients=3400, model="femnist_cnn", batch=10, test_frac=0.1,
                    mean=226.0, sd=89.0, lo=10, hi=700),
    "shakespeare": dict(clients=715, model="char_lstm", batch=4, test_frac=0.2,
                        median=30.0, sigma=1.3, lo=1, hi=3000, seq=80, vocab=90),
    "stackoverflow": dict(clients=34000, model="word_lstm", batch=16, test_frac=0.1,
                          median=20.0, sigma=1.2, lo=1, hi=256, seq=20, vocab=10004),
    # Full scale (benchmarks/stackoverflow_scale.py): TFF's 342,477 training clients; lognormal
    # median 130, sigma 1.5 clipped to [1, 20,000] (mean ≈ 390 against the real 397 sentences
    # per client: 135.8 M sentences), 10 % held out.
    "stackoverflow_full": dict(clients=342477, model="word_lstm", batch=16, test_frac=0.1,
                               median=130.0, sigma=1.5, lo=1, hi=20000, seq=20, vocab=10004),
}


def client_sizes(name: str, clients: int, size_scale: float = 1.0, seed: int = 0):
    """(train, test) sample counts per client: the lognormal fit of `DATASETS[name]`."""
    import numpy as np

    d = DATASETS[name]
    rng = np.random.default_rng(seed)
    if "mean" in d:                    # lognormal with the given mean and sd
        s2 = np.log1p((d["sd"] / d["mean"]) ** 2)
        mu, sigma = np.log(d["mean"]) - s2 / 2, np.sqrt(s2)
    else:
        mu, sigma = np.log(d["median"]), d["sigma"]
    train = np.clip(np.round(rng.lognormal(mu, sigma, clients) * size_scale), d["lo"], d["hi"])
    train = train.astype(np.int64)
    test = np.maximum(np.round(train * d["test_frac"]), 1).astype(np.int64)
    return train, test


class SyntheticReader:
    """A `NaturalReader` of random data with a named set's shapes, client by client."""

    def __init__(self, name: str, clients: int, size_scale: float = 1.0, seed: int = 0):
        from fedjax_pfl.data.natural import SourceInfo, Task

        self.name, self.seed = name, seed
        self.d = DATASETS[name]
        self.train, self.test = client_sizes(name, clients, size_scale, seed)
        if name == "femnist":
            self._task = Task(kind="classify", num_classes=62, inputs="image",
                              default_model="femnist_cnn")
            self._source = SourceInfo(f"synthetic_{name}", "synthetic", (), input_scale=1 / 255)
        else:
            v = self.d["vocab"]
            self._task = Task(kind="sequence", num_classes=v, inputs="tokens", vocab_size=v,
                              default_model=self.d["model"])
            self._source = SourceInfo(f"synthetic_{name}", "synthetic", ())
        self.generate_s = 0.0          # time spent making random data inside clients()

    def task(self):
        return self._task

    def source(self):
        return self._source

    def _split(self, rng, n):
        import numpy as np

        if self.name == "femnist":
            return (rng.integers(0, 256, (n, 28, 28, 1), dtype=np.uint8),
                    rng.integers(0, 62, n).astype(np.int32))
        seq, v = self.d["seq"], self.d["vocab"]
        tok = rng.integers(1, v, (n, seq + 1)).astype(np.int32)
        if self.name == "shakespeare":      # the last window of the text is partly padding
            lengths = np.full(n, seq + 1)
            if n:
                lengths[-1] = rng.integers(2, seq + 2)
        else:                               # sentences of 5..20 real tokens
            lengths = rng.integers(6, seq + 2, n)
        tok[np.arange(seq + 1)[None, :] >= lengths[:, None]] = 0
        return tok[:, :-1].copy(), tok[:, 1:].copy()

    def clients(self):
        import numpy as np

        from fedjax_pfl.data.natural import ClientBlock

        for i, (n, k) in enumerate(zip(self.train, self.test)):
            t0 = time.perf_counter()
            rng = np.random.default_rng((self.seed, i))
            block = ClientBlock(f"{self.name}_{i:06d}", *self._split(rng, int(n)),
                                *self._split(rng, int(k)))
            self.generate_s += time.perf_counter() - t0
            yield block


CACHE_ROOT = os.path.join(os.environ.get("TMPDIR", "/tmp"), "fedjax_pfl_bench_natural")


def devices_line() -> str:
    """'D × KIND (platform)': the devices a benchmark ran on, for its header line."""
    import jax

    d = jax.devices()
    return f"{len(d)} × {d[0].device_kind} ({d[0].platform})"


def femnist_host_data(clients: int, cache_root: str = CACHE_ROOT):
    """The FEMNIST-shaped synthetic set of `clients` clients as host data (memory-mapped from
    its cache under `cache_root`, built on first use): what benchmarks/placement.py runs on."""
    from fedjax_pfl.data import cache, formats

    cache_dir = os.path.join(cache_root, f"femnist_{clients}_1")
    if not os.path.exists(os.path.join(cache_dir, "meta.json")):
        cache.build(SyntheticReader("femnist", clients), cache_dir)
    return formats.to_federated(cache.open(cache_dir), device=False)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_one(cfg: dict) -> dict:
    """One (dataset, algorithm, M) configuration, in this process."""
    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()
    import jax
    import numpy as np

    from fedjax_pfl import runner
    from fedjax_pfl.data import cache, formats

    out = dict(cfg)
    name = cfg["dataset"]
    d = DATASETS[name]
    cache_dir = os.path.join(cfg["cache_root"], f"{name}_{cfg['clients']}_{cfg['size_scale']:g}")
    reader = SyntheticReader(name, cfg["clients"], cfg["size_scale"])
    if cfg.get("rebuild") or not os.path.exists(os.path.join(cache_dir, "meta.json")):
        t0 = time.perf_counter()
        cache.build(reader, cache_dir)
        total = time.perf_counter() - t0
        out["generate_s"] = reader.generate_s
        out["conversion_s"] = total - reader.generate_s
        out["cache_mb"] = sum(os.path.getsize(os.path.join(cache_dir, f))
                              for f in os.listdir(cache_dir)) / 2**20
    t0 = time.perf_counter()
    nc = cache.open(cache_dir)
    out["open_s"] = time.perf_counter() - t0
    train = nc.train_counts()
    out["samples"] = {"train": int(train.sum()), "test": int(nc.test_counts().sum()),
                      "per_client_train": {"min": int(train.min()), "median": float(np.median(train)),
                                           "mean": float(train.mean()), "max": int(train.max())}}
    t0 = time.perf_counter()
    data = formats.to_federated(nc)
    jax.block_until_ready(data.x)
    out["to_device_s"] = time.perf_counter() - t0
    out["rss_after_data_mb"] = _peak_rss_mb()
    n = data.num_real_clients
    m = cfg["m"]
    hp = dict(participation=m / n, batch_size=cfg.get("batch") or d["batch"], local_epochs=1)
    prep = runner.prepare(runner.RunConfig(algo=cfg["algo"], model=d["model"], hparams=hp,
                                           progress=False, memory_check=False,
                                           data_placement="device", state_placement="device"),
                          data=data)
    program, keys = prep.program, prep.round_keys
    out["compile_s"] = program.compile(keys)
    plan = program.memory_plan()
    out["plan_gib"] = plan.total / 2**30
    out["plan_available_gib"] = plan.available / 2**30
    out["plan_state_per_client_mb"] = plan.state_per_client / 2**20
    out["plan_fits"] = bool(plan.fits())
    out["plan_parts_mb"] = {k: getattr(plan, k) / 2**20 for k in (
        "client_state_per_device", "replicated_state", "data", "working_set", "eval_working_set")}
    out["devices"] = len(jax.devices())
    if not plan.fits():
        out["plan_max_clients"] = int(plan.max_clients() or 0)
        out["skipped"] = "memory plan does not fit"
        out["peak_rss_mb"] = _peak_rss_mb()
        return out
    state = program.init(jax.random.fold_in(prep.root, 0))
    jax.block_until_ready(state)
    times, steps = [], []
    for r in range(cfg["rounds"]):
        t0 = time.perf_counter()
        state, metrics = program.run_rounds(state, keys, r, 1)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t0)
        steps.append(int(metrics[0]["client_steps"]))
    timed = times[1:] if len(times) > 1 else times
    tsteps = steps[1:] if len(steps) > 1 else steps
    med = float(np.median(timed))
    out["round_s"] = med
    out["round_s_range"] = [float(min(timed)), float(max(timed))]
    out["first_round_s"] = times[0]
    out["rounds_per_s"] = 1.0 / med
    out["client_steps_per_round"] = tsteps
    # each round's steps over its own time, then the median
    out["client_steps_per_s"] = float(np.median([s / t for s, t in zip(tsteps, timed)]))
    out["peak_rss_mb"] = _peak_rss_mb()
    return out


def _fmt(v, spec=".1f"):
    return "–" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    lines = ["| dataset | algo | M | conversion s | to-device s | compile s | round s (range) | "
             "rounds/s | client-steps/s | steps/round | peak RSS MB | plan GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['dataset']} | {r['algo']} | {r['m']} | error: {r['error'][:120]} |"
                         + " |" * 8)
            continue
        if r.get("skipped"):
            lines.append(f"| {r['dataset']} | {r['algo']} | {r['m']} | {_fmt(r.get('conversion_s'))} | "
                         f"{_fmt(r.get('to_device_s'))} | {_fmt(r.get('compile_s'))} | not run: plan "
                         f"{r['plan_gib']:.1f} GiB > {r['plan_available_gib']:.1f} available (fits "
                         f"≈ {r.get('plan_max_clients', 0):,} clients) | – | – | – | "
                         f"{_fmt(r.get('peak_rss_mb'), '.0f')} | {r['plan_gib']:.1f} |")
            continue
        lo, hi = r["round_s_range"]
        sp = r["client_steps_per_round"]
        lines.append(
            f"| {r['dataset']} | {r['algo']} | {r['m']} | {_fmt(r.get('conversion_s'))} | "
            f"{_fmt(r['to_device_s'])} | {_fmt(r['compile_s'])} | {r['round_s']:.2f} "
            f"({lo:.2f}–{hi:.2f}) | {r['rounds_per_s']:.3f} | {r['client_steps_per_s']:.0f} | "
            f"{min(sp)}–{max(sp)} | {r['peak_rss_mb']:.0f} | {r['plan_gib']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    p.add_argument("--algos", nargs="+", default=["fedavg", "pgfedmo"])
    p.add_argument("--clients-per-round", nargs="+", type=int, default=[10, 50, 100], dest="ms")
    p.add_argument("--rounds", type=int, default=4, help="rounds per configuration (the first "
                   "is not timed)")
    p.add_argument("--batch", type=int, default=None, help="override each dataset's batch size")
    p.add_argument("--size-scale", type=float, default=1.0,
                   help="multiply every client's sample count by this (scale down to save time)")
    p.add_argument("--quick", action="store_true",
                   help="1/10 of the clients, M = 10, 3 rounds: a smoke test, not a measurement")
    p.add_argument("--cache-root", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                        "fedjax_pfl_natural_bench"))
    p.add_argument("--rebuild", action="store_true", help="convert again even if cached")
    p.add_argument("--timeout", type=float, default=1200, help="seconds per configuration")
    p.add_argument("--json", default=None, help="append one JSON line per configuration here")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return
    ms, rounds = args.ms, args.rounds
    if args.quick:
        ms, rounds = [10], 3
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S')}; load {os.getloadavg()}; "
          f"size scale {args.size_scale:g}{' (SCALED DOWN sample counts)' if args.size_scale < 1 else ''}"
          f"{'; --quick: 1/10 of the clients' if args.quick else ''}", flush=True)
    rows = []
    for name in args.datasets:
        clients = DATASETS[name]["clients"] // (10 if args.quick else 1)
        first = True
        for algo in args.algos:
            for m in ms:
                cfg = dict(dataset=name, algo=algo, m=m, clients=clients, rounds=rounds,
                           size_scale=args.size_scale, batch=args.batch,
                           cache_root=args.cache_root, rebuild=args.rebuild and first)
                first = False
                t0 = time.perf_counter()
                try:
                    proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(cfg)],
                                          capture_output=True, text=True, timeout=args.timeout)
                    if proc.returncode != 0:
                        err = (proc.stderr.strip().splitlines() or ["?"])[-1][:300]
                        row = {**cfg, "error": err}
                    else:
                        row = json.loads(proc.stdout.strip().splitlines()[-1])
                except subprocess.TimeoutExpired:
                    row = {**cfg, "error": f"timed out after {args.timeout:.0f} s"}
                row["wall_s"] = time.perf_counter() - t0
                row["load"] = os.getloadavg()[0]
                row["date"] = time.strftime("%Y-%m-%d %H:%M")
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
