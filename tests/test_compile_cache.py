"""JAX's persistent compilation cache, on by default for the command line: a second run of the
same configuration loads the compiled round instead of compiling it, and computes the same bits.
(How much time it saves is measured in benchmarks/RESULTS.md, "Compile time and start-up".)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import helpers

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--algo", "fedavg", "--rounds", "2", "--clients", "4", "--quiet"]


def _run(out, cache, *extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FEDJAX_PFL_COMPILE_CACHE": str(cache)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)      # the suite's own cache (tests/conftest.py)
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "run.py"), *FLAGS,
                           "--out", str(out), *extra], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_second_run_reads_the_cache_and_computes_the_same_bits(tmp_path):
    cache = tmp_path / "cache"
    _run(tmp_path / "off", cache, "--no-compile-cache")
    assert not cache.exists() or not os.listdir(cache)        # --no-compile-cache writes nothing
    _run(tmp_path / "first", cache)
    entries = set(os.listdir(cache))
    assert entries                                             # the round, evaluation, …
    _run(tmp_path / "second", cache)
    assert set(os.listdir(cache)) == entries                   # every program came from the cache
    rows = {name: helpers.metric_rows(tmp_path / name) for name in ("off", "first", "second")}
    assert rows["first"] == rows["off"] and rows["second"] == rows["off"]
