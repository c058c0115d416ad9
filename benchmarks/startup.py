#!/usr/bin/env python
"""Start-up cost of a default run: `runner.prepare` (data, model, algorithm), then compiling the
round, one round and the first evaluation (the automatic chunk size's and evaluation batch's
analyses included), at XLA's default flags, as `python experiments/run.py --algo ALGO` pays it.

    python benchmarks/startup.py pgfed
    PYTHONPATH=/path/to/other/checkout python benchmarks/startup.py pgfed    # another version
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

t0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import jax  # noqa: E402
import run as cli  # noqa: E402
from fedjax_pfl import runner  # noqa: E402


def main(algo: str) -> None:
    prep = runner.prepare(cli.config_from_args(cli.parse(["--algo", algo, "--quiet"])))
    state = prep.program.init(jax.random.fold_in(prep.root, 0))
    t1 = time.perf_counter()
    prep.program.compile(prep.round_keys)
    state, _ = prep.program.run_rounds(state, prep.round_keys, 0, 1)
    jax.block_until_ready(prep.program.evaluate(state))
    t2 = time.perf_counter()
    print(f"{algo}: imports and prepare {t1 - t0:.2f} s, compile + round + evaluation {t2 - t1:.2f} s")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "pgfed")
