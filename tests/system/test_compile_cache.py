"""JAX's persistent compilation cache, on by default for the command line: a second run of the
same configuration loads the compiled round instead of compiling it, and computes the same bits.
(How much time it saves is measured in benchmarks/RESULTS.md, "Start-up".)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import helpers
import pytest

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--algo", "fedavg", "--rounds", "2", "--clients", "4", "--quiet"]


def _run(out, cache, *extra, devices=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FEDJAX_PFL_COMPILE_CACHE": str(cache)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)      # the suite's own cache (tests/conftest.py)
    if devices:
        env["FEDJAX_PFL_CPU_DEVICES"] = str(devices)
        env["XLA_FLAGS"] = helpers.without_device_count(env.get("XLA_FLAGS", ""))
    env["JAX_EXPLAIN_CACHE_MISSES"] = "true"        # (JAX says why it writes no cache entry)
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "run.py"), *FLAGS,
                           "--out", str(out), *extra], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((out / "summary.json").read_text()), proc.stderr


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


@pytest.mark.slow
def test_host_data_on_two_devices_is_read_from_the_cache(tmp_path):
    """With the data in per-device blocks (--data-placement host on two devices) the rounds and
    the evaluation check that each client ran on the device holding its samples. That check is
    an output of the program, not a host callback: JAX writes no program holding a callback to
    its persistent cache, so each run compiled its rounds again."""
    cache = tmp_path / "cache"
    flags = ("--data-placement", "host", "--participation", "0.5")
    first, log = _run(tmp_path / "first", cache, *flags, devices=2)
    assert first["memory_plan"]["data_placement"] == "host" and first["memory_plan"]["devices"] == 2
    assert "PERSISTENT COMPILATION CACHE MISS" in log          # (JAX explains its cache here)
    assert "host callbacks" not in log, log[-2000:]
    entries = set(os.listdir(cache))
    _run(tmp_path / "second", cache, *flags, devices=2)
    assert set(os.listdir(cache)) == entries                   # every program came from the cache
    assert helpers.metric_rows(tmp_path / "second") == helpers.metric_rows(tmp_path / "first")
