"""A two-process run (jax.distributed on the loopback address, one CPU device each) gives the
results of a one-process run: the CLI's --coordinator/--num-processes/--process-id path. The
algorithm is FedPC, whose initial state (a kNN graph over every client's samples) is computed
on the host, outside any program: each process computes it and places its own device's shards
of it (`placement.put_agreed`). PGFed-Mo's two-process runs: tests/system/test_multiprocess.py."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import helpers
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(tmp, name, extra, algo="pgfedmo"):
    env = {**os.environ, "FEDJAX_PFL_CPU_DEVICES": "1", "PYTHONPATH": str(ROOT)}
    env["XLA_FLAGS"] = helpers.without_device_count(env.get("XLA_FLAGS", ""))
    # run.py drawing no PNGs (tests/support/run_no_figures.py; ~1.5 s of CPU a run): only the metrics
    # and the summary are compared.
    argv = [sys.executable, str(ROOT / "tests" / "support" / "run_no_figures.py"), "--algo", algo,
            "--rounds", "3", "--clients", "7", "--participation", "0.45", "--quiet",
            "--out", str(tmp / name), *extra]
    return subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
    port = _free_port()
    flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    procs = [_cli(tmp_path, "two", flags + ["--process-id", str(i)], "fedpc") for i in (0, 1)]
    single = _cli(tmp_path, "one", [], "fedpc")
    for p in procs + [single]:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    two = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    one = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert len(summary["devices"]) == 2                       # the mesh spanned both processes
    assert summary["memory_plan"]["devices"] == 2
    for a, b in zip(two, one):
        assert a["round"] == b["round"]
        for key in ("train_loss", "acc_mean", "acc_std", "admm_primal", "admm_dual"):
            assert abs(a[key] - b[key]) <= 1e-4 * max(1.0, abs(b[key])), (key, a[key], b[key])


@pytest.mark.slow       # (two processes; the quick suite has no multi-process test)
def test_processes_with_other_data_stop_before_running(tmp_path):
    """Each process of a run provides its own devices' copy of the dataset, so all must hold the
    same one: two processes given other partitions (here other --seed values) both stop at once,
    naming the mismatch, instead of training on different data."""
    port = _free_port()
    flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    procs = [_cli(tmp_path, "two", flags + ["--process-id", str(i), "--seed", str(i)])
             for i in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode != 0 and "hold other values than process 0" in err, err[-3000:]
