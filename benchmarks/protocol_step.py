#!/usr/bin/env python
"""The engine alone on PGFed's CNN protocol (vs_pytorch.py's engine side, shorter): compile time,
ms per local step and evaluation seconds per round (the runner's: personalised models only
where the round changed them), under the current XLA_FLAGS.

    python benchmarks/protocol_step.py fedavg 10 --eval-batch-size 256
    python benchmarks/protocol_step.py fedavg 10                      # automatic evaluation batch
    XLA_FLAGS=--xla_cpu_use_fusion_emitters=false python benchmarks/protocol_step.py fedavg 60

Arguments: algorithm, local steps per client (instead of 5 epochs, for a short round), then
run.py flags. Fashion-MNIST (Debian package), IID split, preset pgfed_paper, the FedAvg CNN;
medians of 3 rounds and 3 evaluations after a warm-up. The last field, a digest of the state's
bytes after the 4 rounds, tells whether a flag or a change altered the results (same digest: the
same bits).
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_pytorch import _engine, warm_evaluation  # noqa: E402  (the protocol's run.py flags, one definition)


def main(argv: list[str]) -> None:
    algo, steps, flags = argv[0], argv[1], argv[2:]
    import fedjax_pfl

    fedjax_pfl.use_cpu_cores()      # as run.py and vs_pytorch.py: one XLA device per core
    prep = _engine(algo, "iid", ["--local-steps", steps, *flags])
    program = prep.program
    t0 = time.perf_counter()
    program.compile(prep.round_keys)
    compile_s = time.perf_counter() - t0
    state = program.init(jax.random.fold_in(prep.root, 0))
    evaluation = warm_evaluation(program, state)
    state, metrics = program.run_rounds(state, prep.round_keys, 0, 1)          # warm-up
    evaluation.changed(metrics[0]["sampled"])
    jax.block_until_ready(evaluation(state))
    train, evaluate = [], []
    for r in range(1, 4):
        t0 = time.perf_counter()
        state, metrics = program.run_rounds(state, prep.round_keys, r, 1)
        jax.block_until_ready(state)
        train.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        evaluation.changed(metrics[0]["sampled"])      # as the runner evaluates
        jax.block_until_ready(evaluation(state))
        evaluate.append(time.perf_counter() - t0)
    n = int(np.sum(metrics[0]["client_steps"]))
    digest = hashlib.sha256(b"".join(np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(state)
                                     if jax.numpy.issubdtype(leaf.dtype, jax.numpy.floating)))
    print(f"{algo} {' '.join(flags)} on {jax.device_count()} device(s), XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}: compile "
          f"{compile_s:.1f} s, training {np.median(train):.3f} s a round ({n} steps, "
          f"{1000 * np.median(train) / max(n, 1):.2f} ms a step), evaluation {np.median(evaluate):.3f} s, "
          f"state digest {digest.hexdigest()[:12]}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["fedavg", "10"])
