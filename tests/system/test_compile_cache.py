"""JAX's persistent compilation cache, on by default for the command line: a second run of the
same configuration loads the compiled round instead of compiling it, and computes the same bits;
the summary and the closing line say how many programs came from the cache. (How much time it
saves is measured in benchmarks/RESULTS.md, "Start-up"; the notebook API's runs:
tests/runner/test_compile_cache_setting.py.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import helpers
import pytest

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--algo", "fedavg", "--rounds", "2", "--clients", "4", "--quiet"]


def _run(out, cache, *extra, devices=None, stdout=False):
    """(summary.json, stderr) of one run.py process with `cache` as $FEDJAX_PFL_COMPILE_CACHE
    (None: the suite's session cache, tests/conftest.py); with `stdout`, its stdout too."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if cache is not None:
        env["FEDJAX_PFL_COMPILE_CACHE"] = str(cache)
        env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the suite's own cache (tests/conftest.py)
    if devices:
        env["FEDJAX_PFL_CPU_DEVICES"] = str(devices)
        env["XLA_FLAGS"] = helpers.without_device_count(env.get("XLA_FLAGS", ""))
    env["JAX_EXPLAIN_CACHE_MISSES"] = "true"        # (JAX says why it writes no cache entry)
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "run.py"), *FLAGS,
                           "--out", str(out), *extra], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    return (summary, proc.stderr, proc.stdout) if stdout else (summary, proc.stderr)


def _done_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("done in "))


@pytest.mark.slow
def test_second_run_reads_the_cache_and_computes_the_same_bits(tmp_path):
    cache = tmp_path / "cache"
    off, _, off_out = _run(tmp_path / "off", cache, "--no-compile-cache", stdout=True)
    assert not cache.exists() or not os.listdir(cache)        # --no-compile-cache writes nothing
    n = off["compile"]["programs"]
    assert off["compile"]["cache_dir"] is None and off["compile"]["from_cache"] == 0 and n > 0
    assert f"{n} programs, no cache, " in _done_line(off_out)
    first, _, first_out = _run(tmp_path / "first", cache, stdout=True)
    entries = set(os.listdir(cache))
    # The round, evaluation, …: one entry for each program the run compiled (and for those of
    # the data's staging and keys, compiled before runner.run starts counting).
    assert len(entries) >= n
    assert first["compile"] == {**first["compile"], "programs": n, "from_cache": 0,
                                "cache_dir": str(cache)}
    assert f"{n} programs, none from the cache, " in _done_line(first_out)
    second, _, second_out = _run(tmp_path / "second", cache, stdout=True)
    assert set(os.listdir(cache)) == entries                   # every program came from the cache
    assert second["compile"]["programs"] == second["compile"]["from_cache"] == n
    assert f"(compile {second['compile_time_s']:.1f}s, {n} of {n} programs from the cache, " in (
        _done_line(second_out))
    rows = {name: helpers.metric_rows(tmp_path / name) for name in ("off", "first", "second")}
    assert rows["first"] == rows["off"] and rows["second"] == rows["off"]


def test_the_flag_is_the_run_configs_field(tmp_path):
    """--no-compile-cache is RunConfig.compile_cache False (what runner.prepare applies), in
    run.py and for each run of a sweep; --common cannot set it for one run."""
    import run as cli
    import sweep as sweep_cli

    assert cli.config_from_args(cli.parse(["--quiet"])).compile_cache is True
    assert cli.config_from_args(cli.parse(["--quiet", "--no-compile-cache"])).compile_cache is False
    for flags, want in (([], True), (["--no-compile-cache"], False)):
        args = sweep_cli.build_parser().parse_args(["--out", str(tmp_path / "s"), "--seeds", "0", "1", *flags])
        groups = sweep_cli.plan(args).groups
        assert groups and {g.cfg.compile_cache for g in groups} == {want}
        assert {g.run_config(r).compile_cache for g in groups for r in g.runs} == {want}
    args = sweep_cli.build_parser().parse_args(["--out", str(tmp_path / "s"), "--common=--no-compile-cache"])
    with pytest.raises(sweep_cli.SweepError, match="--no-compile-cache is not a per-run flag"):
        sweep_cli.plan(args)


@pytest.mark.slow
def test_an_unusable_cache_is_one_warning_line_and_the_run_finishes(tmp_path):
    (tmp_path / "file").write_text("")
    blocked = tmp_path / "file" / "jit"                        # (no directory there, for root too)
    summary, stderr, stdout = _run(tmp_path / "run", blocked, stdout=True)
    said = [line for line in stderr.splitlines() if "compilation cache" in line]
    assert said == [f"run.py: warning: the compilation cache {blocked} cannot be used "
                    f"(NotADirectoryError: Not a directory); compiling without it (set "
                    f"$FEDJAX_PFL_COMPILE_CACHE to another directory, or off)"]
    assert summary["last_completed_round"] == 2 and summary["compile"]["cache_dir"] is None
    assert ", no cache, " in _done_line(stdout)


@pytest.mark.slow
def test_the_suite_runs_in_its_session_cache(tmp_path):
    """A run.py the suite starts inherits tests/conftest.py's session cache (the user's own JAX
    cache, which the default setting respects), not ~/.cache/fedjax_pfl/jax."""
    summary, _ = _run(tmp_path / "run", None)
    assert summary["compile"]["cache_dir"] == os.environ["JAX_COMPILATION_CACHE_DIR"]


@pytest.mark.slow
@pytest.mark.extended      # (the cache itself: test_second_run_reads_the_cache_and_computes_the_same_bits)
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
