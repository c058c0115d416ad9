#!/usr/bin/env python
"""Compile and run time of one algorithm's round at XLA's LLVM optimisation levels, with XLA:CPU's
fusion emitters (its default) and with its older elemental emitters.

    python benchmarks/compile_opt_level.py pgfed            # the CLI's default configuration
    python benchmarks/compile_opt_level.py tdpfed --rounds 5

Why the test suite compiles at -O0 with the elemental emitters (tests/conftest.py): its time is
compilation, which that cuts by about 70 % on these rounds; they run ~5x slower, which the
suite's few-round tests do not notice.
Extra arguments are run.py flags.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import run as cli  # noqa: E402
from fedjax_pfl import runner  # noqa: E402

SETTINGS = ((2, True), (1, True), (0, True), (2, False), (1, False), (0, False))
ROUNDS = 5


def measure(algo: str, flags: list[str], level: int, fusion: bool) -> str:
    """Compile the round once at these settings (in this process) and time 5 rounds."""
    prep = runner.prepare(cli.config_from_args(cli.parse(["--algo", algo, "--quiet", *flags])))
    program = prep.program
    lowered = program._round_function(1).lower(program.abstract_sharded_state(), program.data,
                                               prep.round_keys, jax.ShapeDtypeStruct((), jnp.int32))
    state = program.init(jax.random.fold_in(prep.root, 0))
    t0 = time.perf_counter()
    compiled = lowered.compile(compiler_options={"xla_backend_optimization_level": level,
                                                 "xla_cpu_use_fusion_emitters": fusion})
    compile_s = time.perf_counter() - t0
    s, _ = compiled(state, program.data, prep.round_keys, jnp.int32(0))   # warm-up round
    jax.block_until_ready(s)
    t0 = time.perf_counter()
    for r in range(1, ROUNDS + 1):
        s, _ = compiled(s, program.data, prep.round_keys, jnp.int32(r))
    jax.block_until_ready(s)
    per_round = (time.perf_counter() - t0) / ROUNDS
    emitters = "fusion emitters" if fusion else "elemental      "
    return f"  -O{level} {emitters}: compile {compile_s:5.2f} s, {1000 * per_round:7.1f} ms a round"


def main(argv: list[str]) -> None:
    if os.environ.get("_COMPILE_OPT_SETTING"):           # a child: one setting
        level, fusion = os.environ["_COMPILE_OPT_SETTING"].split(",")
        print(measure(argv[0], argv[1:], int(level), fusion == "1"), flush=True)
        return
    # Each setting in a fresh process: compiling several in one process skews the later ones.
    print(f"{argv[0]}: one round of the default configuration {' '.join(argv[1:])}")
    for level, fusion in SETTINGS:
        env = {**os.environ, "_COMPILE_OPT_SETTING": f"{level},{int(fusion)}"}
        out = subprocess.run([sys.executable, __file__, *argv], env=env, capture_output=True,
                             text=True, check=True).stdout
        print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["pgfed"])
