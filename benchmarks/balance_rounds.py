#!/usr/bin/env python
"""Times the first rounds of PGFed's Dirichlet protocol (preset pgfed_paper, FedAvg CNN, 2 XLA
devices) and prints, per round, how evenly the sampled clients' steps split over the devices.
Imports fedjax_pfl from the current directory, so an older commit can be timed from its own
worktree against the same script:

    python benchmarks/balance_rounds.py 1 6                      # 1 local epoch, rounds 0-5
    git worktree add /tmp/base 6e790bf
    (cd /tmp/base && python /path/to/benchmarks/balance_rounds.py 1 6)   # snake order

Arguments: local epochs, rounds. Alternate the two sides; the machine drifts by a few percent.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "experiments"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))     # balance.py beside this script


def main(argv: list[str]) -> None:
    epochs, rounds = argv[0], int(argv[1])
    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()
    import jax
    import numpy as np

    import run as cli
    from balance import busiest
    from fedjax_pfl import core, runner

    argv = ["--algo", "fedavg", "--preset", "pgfed_paper", "--dataset", "fashion_mnist", "--model",
            "cnn", "--quiet", "--no-memory-check", "--local-epochs", epochs]
    prep = runner.prepare(cli.config_from_args(cli.parse(argv)))
    prep.program.compile(prep.round_keys)
    state = prep.program.init(jax.random.fold_in(prep.root, 0))
    counts = np.asarray(prep.data.clients.train_count)
    total_time = total_steps = 0
    for r in range(rounds):
        t0 = time.perf_counter()
        state, metrics = prep.program.run_rounds(state, prep.round_keys, r, 1)
        jax.block_until_ready(state)
        seconds = time.perf_counter() - t0
        idx = np.asarray(metrics[0]["sampled"])                  # in the round's row order
        steps = int(epochs) * np.asarray(core.steps_per_epoch(counts[idx], prep.hparams["batch_size"],
                                                              prep.hparams["drop_last"]))
        ratio = busiest(steps, np.arange(len(idx))) / (steps.sum() / 2)
        total_time, total_steps = total_time + seconds, total_steps + steps.sum()
        print(f"round {r}: {seconds:.2f} s, {steps.sum()} steps, busiest device / half "
              f"{ratio:.3f}, {1e3 * seconds / steps.sum():.2f} ms a step")
    print(f"all rounds: {1e3 * total_time / total_steps:.3f} ms a step")


if __name__ == "__main__":
    main(sys.argv[1:] or ["1", "6"])
