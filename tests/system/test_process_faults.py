"""Faults of a multi-process run as a user meets them (two processes on the loopback address,
`fedjax_pfl.distributed`): a process killed (SIGKILL) or hung (SIGSTOP) mid-run, the coordinator
killed, workers started with another process count or other flags, a coordinator that is not
there (with a time-out, and with SIGTERM during the wait), and each process's own CPU devices.
Each case asserts the one line, the exit status, the time bound and the files left."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import helpers
import pytest

ROOT = Path(__file__).resolve().parents[2]
PEER_TIMEOUT = 8          # seconds (--peer-timeout): survivors must stop within it and a margin


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(out, process_id, port, extra=(), num_processes=2, devices="1", rounds="400"):
    env = {**os.environ, "FEDJAX_PFL_CPU_DEVICES": devices, "PYTHONPATH": str(ROOT)}
    env["XLA_FLAGS"] = helpers.without_device_count(env.get("XLA_FLAGS", ""))
    argv = [sys.executable, str(ROOT / "tests" / "support" / "run_no_figures.py"), "--algo",
            "fedavg", "--rounds", rounds, "--clients", "6", "--participation", "0.5", "--quiet",
            "--checkpoint-every", "2", "--peer-timeout", str(PEER_TIMEOUT), "--out", str(out),
            "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(num_processes),
            "--process-id", str(process_id), *extra]
    return subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _pair(out, extra=(), **kw):
    port = _free_port()
    return [_start(out, i, port, extra, **kw) for i in (0, 1)]


def _wait_rounds(out, rounds, procs, limit=240):
    """Until metrics.jsonl holds `rounds` rows (the run is past compilation and checkpoints)."""
    path = Path(out) / "metrics.jsonl"
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= rounds:
            return
        for p in procs:
            assert p.poll() is None, p.stderr.read()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no {rounds} rounds within {limit} s")


def _last_line(proc):
    """The process's one line: its stderr without gloo's and XLA's own log lines."""
    lines = [line for line in proc.stderr.read().splitlines()
             if line.strip() and not line.startswith(("[Gloo]", "W0000", "I0000", "E0000"))]
    assert len(lines) == 1, lines
    return lines[0]


def _ended_within(proc, start, bound):
    status = proc.wait(timeout=bound + 60)
    took = time.monotonic() - start
    assert took <= bound, took
    return status


def _kill(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _lose(out, after_rounds, victim, how, bound):
    """Two processes past `after_rounds` rounds; `how` (SIGKILL, SIGSTOP) sent to process
    `victim`; the other must exit 75 within `bound` seconds. Its one line."""
    procs = _pair(out)
    survivor = procs[1 - victim]
    try:
        _wait_rounds(out, after_rounds, procs)
        procs[victim].send_signal(how)
        start = time.monotonic()
        assert _ended_within(survivor, start, bound) == 75
    finally:
        _kill(procs)
    return _last_line(survivor)


def _rounds(out):
    return [json.loads(line)["round"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_killed_process_stops_the_other_as_sigterm_would_and_the_run_resumes(tmp_path):
    out = tmp_path / "run"
    said = _lose(out, 5, 1, signal.SIGKILL, PEER_TIMEOUT + 15)       # SIGKILL: no goodbye
    assert said.startswith("run.py: stopped: lost process 1") and "continue with: python " \
        f"experiments/run.py --resume {out}" in said, said
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and summary["interrupted_by"] == "lost process 1"
    done, ckpt = summary["last_completed_round"], summary["last_checkpoint_round"]
    assert done >= 5 and ckpt is not None and done - 2 <= ckpt <= done and ckpt % 2 == 0, summary
    assert _rounds(out) == list(range(1, done + 1))
    # The last complete checkpoint resumes (both processes again) to the end.
    procs = _pair(out, ["--resume", "--rounds", str(done + 2)], rounds=str(done + 2))
    try:
        for p in procs:
            assert p.wait(timeout=300) == 0, p.stderr.read()[-3000:]
    finally:
        _kill(procs)
    summary = json.loads((out / "summary.json").read_text())
    assert not summary["interrupted"] and summary["last_completed_round"] == done + 2
    assert _rounds(out) == list(range(1, done + 3))


@pytest.mark.slow
def test_a_hung_process_is_lost_after_the_peer_timeout(tmp_path):
    """SIGSTOP: process 0 waits inside a collective that never ends; its watchdog records the
    run as interrupted and ends it (the main thread cannot take an exception there)."""
    out = tmp_path / "run"
    said = _lose(out, 3, 1, signal.SIGSTOP, PEER_TIMEOUT + 10 + 15)
    assert said.startswith("process 0: lost process 1: no sign of life for"), said
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and summary["interrupted_by"] == "lost process 1", summary


@pytest.mark.slow
def test_the_coordinators_death_stops_the_others_in_one_line(tmp_path):
    said = _lose(tmp_path / "run", 3, 0, signal.SIGKILL, PEER_TIMEOUT + 10 + 15)
    assert "lost process 0" in said and said.count("\n") == 0, said


@pytest.mark.slow
@pytest.mark.parametrize("second, expected", [
    (["--num-processes", "3"], "process 1 was started with --num-processes 3, process 0 with 2"),
    (["--lr", "0.3"], "process 1 was started with --lr 0.3, process 0 with (not given)"),
])
def test_workers_that_disagree_stop_before_anything_runs(tmp_path, second, expected):
    out = tmp_path / "run"
    port = _free_port()
    start = time.monotonic()
    procs = [_start(out, 0, port), _start(out, 1, port, second)]
    try:
        statuses = [p.wait(timeout=120) for p in procs]
    finally:
        _kill(procs)
    assert statuses == [2, 2] and time.monotonic() - start < 60
    for p in procs:
        assert _last_line(p) == f"run.py: error: {expected}: start every process with the same flags"
    assert not out.exists()                                  # nothing written, nothing compiled


@pytest.mark.slow
def test_an_absent_coordinator_times_out_and_sigterm_ends_the_wait(tmp_path):
    port = _free_port()
    start = time.monotonic()
    lone = _start(tmp_path / "a", 1, port, ["--coordinator-timeout", "3"])
    assert _ended_within(lone, start, 3 + 20) == 2
    assert _last_line(lone) == (f"run.py: error: process 1: no answer from the --coordinator "
                                f"127.0.0.1:{port} within 3 s (--coordinator-timeout): is process "
                                "0 running, at that address and port?")
    alone = _start(tmp_path / "b", 0, port, ["--coordinator-timeout", "3"])
    assert _ended_within(alone, start, 2 * (3 + 20)) == 2
    assert "process 0 waited 3 s (--coordinator-timeout) for the other processes of " \
        "--num-processes 2; process 1 did not join" in _last_line(alone)
    waiting = _start(tmp_path / "c", 1, port)                # the default: a minute
    time.sleep(6)                                            # (imports done: in the wait)
    assert waiting.poll() is None
    waiting.send_signal(signal.SIGTERM)
    assert _ended_within(waiting, time.monotonic(), 3) == 143
    assert _last_line(waiting) == "run.py: terminated (SIGTERM) before the run started; nothing was written"
    assert not any((tmp_path / d).exists() for d in "abc")


@pytest.mark.slow
def test_each_process_exposes_its_own_cpu_devices(tmp_path):
    """FEDJAX_PFL_CPU_DEVICES=2 in each of two processes: four devices, the results of one
    process with four."""
    procs = _pair(tmp_path / "two", devices="2", rounds="2")
    env = {**os.environ, "FEDJAX_PFL_CPU_DEVICES": "4", "PYTHONPATH": str(ROOT)}
    env["XLA_FLAGS"] = helpers.without_device_count(env.get("XLA_FLAGS", ""))
    one = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "support" / "run_no_figures.py"), "--algo", "fedavg",
         "--rounds", "2", "--clients", "6", "--participation", "0.5", "--quiet", "--out",
         str(tmp_path / "one")], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    try:
        for p in procs:
            assert p.wait(timeout=300) == 0, p.stderr.read()[-3000:]
    finally:
        _kill(procs)
    assert one.returncode == 0, one.stderr[-3000:]
    two, single = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("two", "one"))
    assert len(two["devices"]) == len(single["devices"]) == 4
    rows = [[json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("two", "one")]
    for a, b in zip(*rows, strict=True):
        for key in ("train_loss", "acc_mean", "loss"):
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(b[key])), (key, a[key], b[key])
