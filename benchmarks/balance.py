#!/usr/bin/env python
"""How evenly `core.balanced_order` splits a round's local steps over two devices, on PGFed's
protocol split (preset pgfed_paper: Fashion-MNIST from the Debian package, class-wise Dir(0.3),
25 clients of 828-3,724 training samples, 6 sampled per round, 5 epochs of batch 10).

    python benchmarks/balance.py                 # 2,000 random rounds
    python benchmarks/balance.py --rounds 500 --sampled 12

A device runs its clients one after another, so a round lasts as long as its busiest device:
the table gives the busiest device's steps over half the round's steps (1.000 = even), for the
order the engine uses, the snake order it used before (rows dealt longest first 0, 1, 1, 0, ...)
and the best split into two blocks of equal client count (brute force; up to 16 sampled).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "experiments"))


def busiest(steps: np.ndarray, order: np.ndarray) -> int:
    half = -(-len(steps) // 2)
    return max(int(steps[order[:half]].sum()), int(steps[order[half:]].sum()))


def best_equal_split(steps: np.ndarray) -> int:
    total, half = int(steps.sum()), -(-len(steps) // 2)
    return min(max(int(steps[list(s)].sum()), total - int(steps[list(s)].sum()))
               for s in itertools.combinations(range(len(steps)), half))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2000, help="random rounds (default 2000)")
    parser.add_argument("--sampled", type=int, default=6, help="clients per round (default 6)")
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    import run as cli
    from fedjax_pfl import core, runner
    from fedjax_pfl.core import execution, placement

    cfg = cli.config_from_args(cli.parse(["--algo", "fedavg", "--preset", "pgfed_paper", "--dataset",
                                          "fashion_mnist", "--model", "cnn", "--quiet"]))
    data, _ = runner.load_data(cfg)
    counts = np.asarray(data.clients.train_count)[:data.num_real_clients]
    hp = cfg.validate()
    steps_all = hp["local_epochs"] * np.asarray(core.steps_per_epoch(counts, hp["batch_size"], hp["drop_last"]))
    greedy = jax.jit(placement.balanced_order, static_argnums=1)
    snake = jax.jit(placement._snake_order, static_argnums=1)
    rng = np.random.default_rng(0)
    ratios = {"balanced_order (now)": [], "snake order (before)": [], "best equal-count split": []}
    for _ in range(args.rounds):
        steps = steps_all[rng.choice(len(counts), args.sampled, replace=False)]
        half = steps.sum() / 2
        ratios["balanced_order (now)"].append(busiest(steps, np.asarray(greedy(jnp.asarray(steps), 2))) / half)
        ratios["snake order (before)"].append(busiest(steps, np.asarray(snake(jnp.asarray(steps), 2))) / half)
        if args.sampled <= 16:
            ratios["best equal-count split"].append(best_equal_split(steps) / half)
    print(f"{len(counts)} clients ({counts.min()}-{counts.max()} training samples), {args.sampled} "
          f"sampled per round, 2 devices, {args.rounds} random rounds")
    print("| order | busiest device / half, mean | 90th percentile |\n|---|---|---|")
    for name, r in ratios.items():
        if r:
            print(f"| {name} | {np.mean(r):.4f} | {np.percentile(r, 90):.4f} |")


if __name__ == "__main__":
    main()
