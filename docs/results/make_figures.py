#!/usr/bin/env python
"""Tables and figures of docs/results/*.md from the run directories of experiments/compare.py.

    python docs/results/make_figures.py runs/pfedsop/fashion_mnist_pfedsop_paper \\
        --methods "local" "fedavg" "fedavg_ft" "pfedsop keep=newton" "pfedsop keep=sgd" \\
        --png docs/results/pfedsop_fashion_dir.png

For every method (a label prefix), the run with the best best-round mean accuracy is selected
(the papers tune the learning rate on test accuracy); its row goes into a markdown table printed
to stdout and its learning curve into the PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from fedjax_pfl.runner import plot_learning_curves  # noqa: E402
from experiments.compare import slug  # noqa: E402


def pct(v):
    return "–" if v is None else f"{100 * v:.2f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("group", help="a directory written by experiments/compare.py")
    p.add_argument("--methods", nargs="+", required=True, help="label prefixes, one per method")
    p.add_argument("--png", required=True)
    p.add_argument("--title", default="")
    args = p.parse_args()

    rows = [r for r in json.load(open(os.path.join(args.group, "results.json"))) if not r.get("diverged")]
    chosen = []
    for method in args.methods:
        # A label belongs to the method whose prefix is longest among those it starts with.
        mine = [r for r in rows if max((m for m in args.methods if r["label"].startswith(m + " ")
                                        or r["label"] == m), key=len, default=None) == method]
        if mine:
            chosen.append((method, max(mine, key=lambda r: r["acc_best"])))
    print("| method (selected run) | mean, last round | mean, best round | worst 10 % | "
          "participant-best (Table II statistic) | global model |")
    print("|---|---|---|---|---|---|")
    curves = {}
    for method, r in chosen:
        print(f"| {r['label']} | {pct(r['acc_last'])} | {pct(r['acc_best'])} | "
              f"{pct(r['worst10_last'])} | {pct(r['participant_best'])} | {pct(r['global_last'])} |")
        with open(os.path.join(args.group, slug(r["label"]), "metrics.jsonl")) as f:
            curves[r["label"]] = [json.loads(line) for line in f]
    plot_learning_curves(curves, args.png, args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
