#!/usr/bin/env python
"""A grid of runs: algorithms × hyperparameters × seeds × datasets, into one table and one figure.

    python experiments/sweep.py --out runs/sweep --algos fedavg pgfedmo --seeds 0 1 2 \\
        --grid lr=0.01,0.05 --grid mu=0.01,0.1 --common "--rounds 30 --clients 20"
    python experiments/sweep.py --out runs/sweep --config sweep.json     # the same from a file
    python experiments/sweep.py --out runs/sweep --config sweep.json --resume

A config file holds {"algos": [...], "datasets": [...], "seeds": [...], "grid": {name: [values]},
"common": "run.py flags"}; flags given on the command line win. Grid names are hyperparameter
names (`lr`, `mu`, `lam`, `batch_size`, …; see run.py --help): a name an algorithm does not have
is skipped for it.

Runs of one algorithm on one dataset that differ only in seed and in scalar hyperparameters the
algorithm uses only in arithmetic (its `traceable` list: lr, μ, λ, β, …) run as ONE vmapped,
compiled program (fedjax_pfl.sweep); other hyperparameters (batch size, epochs, choices) make
separate programs, run one after another, and so do algorithms whose initialisation needs
concrete data (FedPC's graph). Seeds vary the model initialisation and client sampling; the
partition comes from --seed in --common (so all seeds see the same clients).

OUT/results.md: one row per (dataset, algorithm, hyperparameters): mean ± std over seeds of the
best-round and last-round mean client accuracy, the last worst-10 % and global accuracy.
OUT/curves.png: mean accuracy per round (± std over seeds). Every run keeps its own
metrics.jsonl / summary.json under OUT/<dataset>/<algo>/<hyperparameters>/<seed>/; --resume
reuses the runs whose summary.json is there.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as cli  # noqa: E402


def _parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_grid(items: list[str]) -> dict[str, list]:
    grid = {}
    for item in items:
        name, sep, values = item.partition("=")
        if not sep or not values:
            raise ValueError(f"--grid wants NAME=V1,V2,…, got {item!r}")
        grid[name.strip().replace("-", "_")] = [_parse_value(v) for v in values.split(",")]
    return grid


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--config", default=None, help="JSON file with algos/datasets/seeds/grid/common")
    p.add_argument("--algos", nargs="+", default=None)
    p.add_argument("--datasets", nargs="+", default=None)
    p.add_argument("--seeds", nargs="+", type=int, default=None)
    p.add_argument("--grid", action="append", default=[], help="NAME=V1,V2,… (repeatable)")
    p.add_argument("--common", default=None, help="run.py flags shared by every run")
    p.add_argument("--resume", action="store_true", help="reuse runs that already have a summary")
    p.add_argument("--sequential", action="store_true",
                   help="run every run on its own (no vmapped groups): the reference")
    args = p.parse_args(argv)
    config = json.load(open(args.config)) if args.config else {}
    try:
        algos = args.algos or config.get("algos") or ["fedavg"]
        datasets = args.datasets or config.get("datasets") or ["digits"]
        seeds = args.seeds or config.get("seeds") or [0]
        grid = {**{k.replace("-", "_"): list(v) for k, v in config.get("grid", {}).items()},
                **parse_grid(args.grid)}
        common = args.common if args.common is not None else config.get("common", "")
    except ValueError as e:
        cli._fail(str(e))

    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()
    from fedjax_pfl import algorithms, runner, sweep

    os.makedirs(args.out, exist_ok=True)
    rows, curves = [], {}
    for dataset in datasets:
        data_cache = None
        for algo in algos:
            try:
                base = cli.config_from_args(cli.parse(shlex.split(common) + ["--dataset", dataset,
                                                                             "--algo", algo, "--quiet"]))
                base.validate()
                if data_cache is None:
                    data_cache = runner.load_data(base)
                spec = algorithms.spec(algo)
            except ValueError as e:
                cli._fail(" ".join(str(e).split()))
            data, info = data_cache
            names = {hp.name for hp, _ in spec.all_hparams()}
            mine = {k: v for k, v in grid.items() if k in names}
            skipped = sorted(set(grid) - set(mine))
            if skipped:
                print(f"{algo}: no hyperparameter {skipped}; not varied for it")
            traced = {k: v for k, v in mine.items()
                      if k in spec.traceable and all(isinstance(x, (int, float)) for x in v)}
            static = {k: v for k, v in mine.items() if k not in traced}
            for static_combo in sweep.grid(static):
                cfg = copy.deepcopy(base)
                cfg.hparams = {**cfg.hparams, **static_combo}
                static_label = " ".join(f"{k}={v}" for k, v in static_combo.items())
                group_dir = os.path.join(args.out, dataset, algo,
                                         sweep.slug(static_label) if static_label else "default")
                runs = [sweep.RunSpec(seed, tuple(sorted(tc.items())))
                        for tc in sweep.grid(traced) for seed in seeds]
                summaries = _run_or_resume(cfg, runs, data, info, group_dir, args, runner, sweep)
                for tc in sweep.grid(traced):
                    label = " ".join(f"{k}={v}" for k, v in {**static_combo, **tc}.items())
                    cell = [s for s in summaries if s["traced"] == tc]
                    rows.append(_row(dataset, algo, label, cell))
                    curves[f"{dataset} {algo} {label}".strip()] = [s["rows"] for s in cell]
    _write(args.out, rows, curves)
    print(f"wrote {os.path.join(args.out, 'results.md')}")
    return 0


def _run_or_resume(cfg, runs, data, info, group_dir, args, runner, sweep) -> list[dict]:
    """The group's summaries: reused (--resume), vmapped, or one run after another."""
    paths = [os.path.join(group_dir, sweep.slug(r.label), "summary.json") for r in runs]
    if args.resume and all(os.path.exists(p) for p in paths):
        out = []
        for p in paths:
            summary = json.load(open(p))
            with open(os.path.join(os.path.dirname(p), "metrics.jsonl")) as f:
                summary["rows"] = [json.loads(line) for line in f]
            out.append(summary)
        print(f"== {cfg.algo} {group_dir}: reused {len(runs)} runs")
        return out
    print(f"== {cfg.algo} {group_dir}: {len(runs)} runs", flush=True)
    vectorised = not args.sequential and cfg.validate()["backend"] != "loop"
    if vectorised:
        try:
            return sweep.run_group(cfg, runs, data=data, data_info=info, out=group_dir,
                                   progress=False)
        except (ValueError, TypeError) as e:            # e.g. FedPC's host-side init
            print(f"   not vectorisable ({' '.join(str(e).split())[:120]}): one run at a time")
    out = []
    for r in runs:
        run_cfg = copy.deepcopy(cfg)
        run_cfg.seed = r.seed
        run_cfg.hparams = {**run_cfg.hparams, **dict(r.traced)}
        run_cfg.out = os.path.join(group_dir, sweep.slug(r.label))
        run_cfg.progress = False
        run_cfg.partition = cfg.partition               # the group's shared partition seed
        summary = runner.run(run_cfg, data=data, data_info=info, log=lambda *_: None)
        summary["traced"] = dict(r.traced)
        with open(os.path.join(run_cfg.out, "metrics.jsonl")) as f:
            summary["rows"] = [json.loads(line) for line in f]
        out.append(summary)
    return out


def _stat(values):
    import numpy as np

    values = [v for v in values if v is not None]
    if not values:
        return "–"
    return f"{100 * np.mean(values):.2f} ± {100 * np.std(values):.2f}"


def _row(dataset, algo, label, summaries) -> dict:
    get = lambda kind, key: [s[kind].get(key) for s in summaries]
    return {"dataset": dataset, "algo": algo, "hparams": label or "defaults",
            "seeds": len(summaries),
            "best": _stat(get("best", "acc_mean")), "last": _stat(get("last", "acc_mean")),
            "worst10": _stat(get("last", "acc_worst10")),
            "global": _stat(get("last", "global_acc_mean"))}


def _write(out, rows, curves) -> None:
    import numpy as np

    lines = ["# Sweep", "", "Mean client accuracy (%) as mean ± std over seeds: best round, last "
             "round, worst 10 % of clients (last), global model (last).", "",
             "| dataset | algorithm | hyperparameters | seeds | best | last | worst 10% | global |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['dataset']} | {r['algo']} | {r['hparams']} | {r['seeds']} | {r['best']} | "
              f"{r['last']} | {r['worst10']} | {r['global']} |" for r in rows]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(rows, f, indent=2)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for label, runs in curves.items():
        series = [[(r["round"], r["acc_mean"]) for r in rows_ if "acc_mean" in r] for rows_ in runs]
        if not series or not series[0]:
            continue
        rounds = [x for x, _ in series[0]]
        values = np.array([[y for _, y in s] for s in series if len(s) == len(rounds)])
        mean, std = values.mean(axis=0), values.std(axis=0)
        ax.plot(rounds, mean, label=label)
        ax.fill_between(rounds, mean - std, mean + std, alpha=0.2)
    ax.set_xlabel("round")
    ax.set_ylabel("mean client test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "curves.png"), dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
