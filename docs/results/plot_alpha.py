#!/usr/bin/env python
"""The α statistics PGFed logs every round (docs/results/pgfed.md): mean, largest row mean and
fraction of zeros of A, and the mean norm of the held auxiliary gradient, for several runs.

    python docs/results/plot_alpha.py --png docs/results/pgfed_alpha.png runs/pgfed/fashion_mnist/pgfed ...
"""

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+", help="run directories (with metrics.jsonl)")
    p.add_argument("--png", required=True)
    args = p.parse_args()
    keys = [("alpha_mean", "mean of A"), ("alpha_row_mean_max", "largest row mean of A"),
            ("alpha_zero_fraction", "fraction of zeros in A"), ("aux_norm_mean", "‖g̃_i‖ (sampled)")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for run in args.runs:
        rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
        for ax, (key, title) in zip(axes, keys):
            ax.plot([r["round"] for r in rows], [r[key] for r in rows], label=os.path.basename(run))
            ax.set_title(title)
            ax.set_xlabel("round")
            ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[3].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.png, dpi=100)


if __name__ == "__main__":
    main()
