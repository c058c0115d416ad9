"""Compile time of one round with the capped stages for unequal clients vs one stage.

    python benchmarks/compile_stages.py

Builds the PGFed round of tests/algorithms/test_pgfed.py (quadratic clients, 2 local epochs)
twice: once as the engine compiles it for unequal clients (`_run_capped`: stage 1 plus the
narrow stages), once with the single stage the engine uses when every client takes 0 or K steps
(`ClientLoop.uniform`, i.e. a fixed --local-steps). Prints XLA's compile time of `round_fn`.
"""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = r'''
import logging, os, sys
sys.path[:0] = ["tests", "tests/algorithms"]
import jax
from fedjax_pfl.core import execution, placement
if sys.argv[1] == "one-stage":
    run_capped = execution._run_capped
    execution._run_capped = lambda loop, *a: run_capped(loop._replace(uniform=True), *a)
times = []
class Compiles(logging.Handler):
    def emit(self, record):
        msg = record.getMessage()
        if "Finished XLA compilation of jit(round_fn)" in msg:
            times.append(float(msg.split(" in ")[1].split()[0]))
jax.config.update("jax_log_compiles", True)
jax.config.update("jax_enable_x64", True)
logging.getLogger("jax").addHandler(Compiles())
import test_pgfed
test_pgfed.test_zero_alpha_and_zero_alpha_lr_is_fedavg_training(None)
print(sys.argv[1], " + ".join(f"{t:.2f}" for t in times), "s")
'''

if __name__ == "__main__":
    env = {**os.environ, "FEDJAX_PFL_CPU_DEVICES": "1"}
    for mode in ("capped", "one-stage"):
        out = subprocess.run([sys.executable, "-c", CHILD, mode], cwd=ROOT, env=env,
                             capture_output=True, text=True)
        print(out.stdout.strip().splitlines()[-1] if out.returncode == 0 else out.stderr[-2000:])
