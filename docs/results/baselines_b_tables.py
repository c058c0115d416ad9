#!/usr/bin/env python
"""The tables of docs/results/baselines_b.md from runs/baselines_b (experiments/compare.py output).

    python docs/results/baselines_b_tables.py [runs/baselines_b]

Seed groups (pgfed_digits, pgfed_digits_seed1, ...) give mean ± std over seeds (population std,
as pgfed.md) and the per-seed last-round means; every other group (pgfed_fashion_mnist,
pfedsop_*) one row per run.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np


def load(group):
    return {r["label"]: r for r in json.load(open(os.path.join(group, "results.json")))}


def seeds_table(groups):
    runs = [load(g) for g in groups]
    labels = list(runs[0])
    print("| method | mean, last round | mean, best round | worst 10 % | global model | "
          "last round, seeds " + " / ".join(str(i) for i in range(len(runs))) + " |")
    print("|---|---|---|---|---|---|")
    for label in labels:
        rows = [r[label] for r in runs if label in r]
        stat = lambda k: np.array([100 * r[k] for r in rows if r.get(k) is not None])
        cell = lambda k: (f"{stat(k).mean():.2f} ± {stat(k).std():.2f}" if len(stat(k)) else "–")
        per_seed = " / ".join(f"{100 * r['acc_last']:.2f}" for r in rows)
        print(f"| {label} | {cell('acc_last')} | {cell('acc_best')} | {cell('worst10_last')} | "
              f"{cell('global_last')} | {per_seed} |")


def group_table(group):
    print("| method | mean, last round | mean, best round | worst 10 % | participant-best | "
          "global model | up floats / round |")
    print("|---|---|---|---|---|---|---|")
    pct = lambda v: "–" if v is None else f"{100 * v:.2f}"
    for label, r in load(group).items():
        up = r["communication"].get("up_floats_per_round")
        print(f"| {label} | {pct(r['acc_last'])} | {pct(r['acc_best'])} | {pct(r['worst10_last'])} | "
              f"{pct(r['participant_best'])} | {pct(r['global_last'])} | "
              f"{'–' if up is None else format(int(up), ',')} |")


def main() -> int:
    root = sys.argv[1] if len(sys.argv) > 1 else "runs/baselines_b"
    seeds = [os.path.join(root, d) for d in ("pgfed_digits", "pgfed_digits_seed1", "pgfed_digits_seed2")
             if os.path.exists(os.path.join(root, d, "results.json"))]
    if seeds:
        print(f"## PGFed protocol, digits, seeds: {len(seeds)}\n")
        seeds_table(seeds)
    for d in sorted(os.listdir(root)):
        group = os.path.join(root, d)
        if group not in seeds and os.path.exists(os.path.join(group, "results.json")):
            print(f"\n## {d}\n")
            group_table(group)
    return 0


if __name__ == "__main__":
    sys.exit(main())
