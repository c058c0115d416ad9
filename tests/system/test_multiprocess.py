"""Multi-process runs as a user starts them (two processes on the loopback address, one CPU device
each): `--seeds 0 1` (the vmapped sweep path, whose results are sharded over both processes'
devices) gives the one-process results; only process 0 prints; the memory plan counts this
host's devices against this host's memory; host data placement, host state placement (stopped
and resumed) and experiments/sweep.py over two processes equal one process; a run with its data
sharded over the processes whose process 1 is interrupted resumes exactly."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import helpers
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices="1"):
    """The subprocesses' environment: this session's XLA flags (less a forced device count) and
    compilation cache (tests/conftest.py)."""
    env = {**os.environ, "FEDJAX_PFL_CPU_DEVICES": devices, "PYTHONPATH": str(ROOT)}
    env["XLA_FLAGS"] = helpers.without_device_count(env.get("XLA_FLAGS", ""))
    return env


def _cli(tmp, name, extra, devices="1", host_reads=None):
    env = _env(devices)
    if host_reads is not None:                       # (tests/support/run_no_figures.py)
        env["FEDJAX_PFL_TEST_HOST_READS"] = str(host_reads)
    argv = [sys.executable, str(ROOT / "tests" / "support" / "run_no_figures.py"), "--algo",
            "fedavg", "--rounds", "2", "--clients", "6", "--participation", "0.5", "--quiet",
            "--out", str(tmp / name), *extra]         # later flags (--algo, --rounds) win
    return subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_seeds_over_two_processes_equal_one_process_and_only_process_0_prints(tmp_path):
    port = _free_port()
    flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--seeds", "0", "1"]
    procs = [_cli(tmp_path, "two", flags + ["--process-id", str(i)]) for i in (0, 1)]
    single = _cli(tmp_path, "one", ["--seeds", "0", "1"], devices="2")
    outputs = []
    for p in procs + [single]:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        outputs.append(out)
    assert outputs[0].strip() and outputs[1] == ""          # process 1 says nothing
    for seed in ("seed=0", "seed=1"):
        two, one = _rows(tmp_path / "two" / seed / "metrics.jsonl"), _rows(tmp_path / "one" / seed / "metrics.jsonl")
        assert len(two) == len(one) == 2
        for a, b in zip(two, one):
            for key in ("train_loss", "acc_mean", "loss"):
                assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(b[key])), (seed, key, a[key], b[key])


def test_memory_plan_counts_this_hosts_devices():
    """Two hosts of 2 CPU devices each: each host needs 2 × per-device bytes of its own memory,
    not 4 ×; N that fits grows with the global device count."""
    from fedjax_pfl import core

    plan = core.MemoryPlan(devices=4, platform="cpu", num_clients=100, state_per_client=1000,
                           client_state_per_device=25_000, replicated_state=500, data=1500,
                           working_set=3000, eval_working_set=1000, available=100_000,
                           local_devices=2)
    per_device = 25_000 + 500 + 1500 + 3000
    assert plan.per_device == per_device and plan.total == 2 * per_device
    # budget per device 50,000 − fixed 5,000 = 45,000 bytes of state: 45 clients a device, 4 devices.
    assert plan.max_clients() == 180
    one_host = core.MemoryPlan(**{**plan.__dict__, "local_devices": 0})
    assert one_host.total == 4 * per_device                  # all four on this host
    # Host state over several processes: each device first receives its process's rows of the
    # whole world (3 clients of 2,000 bytes), a transient larger than the round's 3,000 bytes of
    # temporaries, so it is the working set.
    staged = core.MemoryPlan(**{**plan.__dict__, "state_placement": "host", "host_row_bytes": 2000,
                                "world_rows": 2, "staging_rows": 3})
    assert staged.staging == 6000 and staged.per_device == 25_000 + 500 + 1500 + 6000
    assert "whole world (3 clients" in staged.describe()


def _two(tmp, name, extra, **kwargs):
    port = _free_port()
    flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", *extra]
    procs = [_cli(tmp, name, flags + ["--process-id", str(i)], **kwargs) for i in (0, 1)]
    outputs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        outputs.append(out)
    return outputs


# Extended: the full suite has two processes' host state in test_checkpoint_layouts (written by
# two, resumed by one) and their host data in test_data_placement.
@pytest.mark.slow
@pytest.mark.extended
def test_two_processes_with_host_placement_equal_one_process_and_resume(tmp_path):
    """--data-placement host and --state-placement host over two processes: each stages the
    round's participants from its host copy and provides its own device's replica of the buffer;
    each process's host store holds only its own range of clients' rows (checked in the
    checkpoint, where each process saves its part), and each call's rows are assembled on the
    devices from both. Stopped after round 2's checkpoint and resumed with two processes, or
    with one, the run ends with the metrics of one process holding the dataset and the client
    state on both of its devices (pgfedmo: per-client rows, the α matrix by rows); so do the
    two-process host checkpoint resumed with the rows on the devices (each process reading only
    its own part of it) and the one-process device checkpoint resumed by two processes with the
    rows on the host."""
    algo = ["--algo", "pgfedmo", "--checkpoint-every", "2"]
    host = algo + ["--data-placement", "host", "--state-placement", "host"]
    _two(tmp_path, "host", host + ["--rounds", "2"])
    # Each process's store holds only its own range of clients (6 clients: 0-2 on process 0,
    # 3-5 on process 1), and saves them in its own part of the checkpoint: together exactly
    # the clients that rounds 1 and 2 trained.
    from fedjax_pfl import checkpoint

    # The memory plan counts the rows each device receives before the world is assembled: the
    # larger of a call's world (M = 3 of 6 clients) and an evaluation group (the power of two at
    # or above M: 4), one host row each.
    plan = json.loads((tmp_path / "host" / "summary.json").read_text())["memory_plan"]
    assert plan["staging_rows"] == 4 and plan["host_row_bytes"] > 0
    saved = tmp_path / "host" / "checkpoints" / "round_000002"
    parts = {}
    for k in (0, 1):
        with np.load(saved / f"host-{k:05d}.npz") as z:
            parts[k] = set(z[f"store.p{k}/ids"].tolist())
    assert parts[0] <= {0, 1, 2} and parts[1] <= {3, 4, 5}
    trained = set(np.concatenate(checkpoint.read_host(str(saved))["sampled"]).tolist())
    assert parts[0] | parts[1] == trained and parts[0] and parts[1]
    shutil.copytree(tmp_path / "host", tmp_path / "host_one")
    shutil.copytree(tmp_path / "host", tmp_path / "host_dev")
    _two(tmp_path, "host", host + ["--rounds", "3", "--resume"])
    # Resumed by two processes with the rows on the devices: each process reads the rows of
    # only the part that holds its device's clients (0-2 on process 0's device, 3-5 on process
    # 1's); of the other part, its client ids (and, for process 1, the shared initial rows, which
    # come from the first part).
    reads = tmp_path / "reads"
    reads.mkdir()
    _two(tmp_path, "host_dev", algo + ["--rounds", "3", "--resume", "--data-placement", "device",
                                       "--state-placement", "device"], host_reads=reads)
    for k in (0, 1):
        got = json.loads((reads / f"reads-{k}.json").read_text())["parts"]
        other = f"store.p{1 - k}/"
        assert got and all(n.startswith(f"store.p{k}/") or n == other + "ids" or
                           (k == 1 and n.startswith(other) and n.endswith("/initial"))
                           for n in got), (k, got)
        assert any(n.startswith(f"store.p{k}/") and n.endswith("/values") for n in got), (k, got)
    # The two processes' checkpoint resumed by one process (both parts of the store read).
    one_of_two = _cli(tmp_path, "host_one", host + ["--rounds", "3", "--resume"], devices="2")
    single = _cli(tmp_path, "one", algo + ["--rounds", "3", "--data-placement", "device",
                                           "--state-placement", "device"],
                  devices="2")
    for p in (one_of_two, single):
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    one_plan = json.loads((tmp_path / "host_one" / "summary.json").read_text())["memory_plan"]
    assert one_plan["staging_rows"] == 0          # one process: its rows go to the devices as they are
    # The one-process run's round-2 checkpoint (its rows on the devices) resumed by two
    # processes with the rows on the host: each keeps its own range from its device's shards.
    shutil.copytree(tmp_path / "one", tmp_path / "dev_host")
    shutil.rmtree(tmp_path / "dev_host" / "checkpoints" / "round_000003")
    _two(tmp_path, "dev_host", host + ["--rounds", "3", "--resume"])
    want = _rows(tmp_path / "one" / "metrics.jsonl")
    for run in ("host", "host_one", "host_dev", "dev_host"):
        got = _rows(tmp_path / run / "metrics.jsonl")
        assert [r["round"] for r in got] == [1, 2, 3]
        for a, b in zip(got, want, strict=True):
            for key in ("train_loss", "acc_mean", "global_acc_mean", "alpha_mean"):
                assert a[key] == b[key], (run, a["round"], key, a[key], b[key])


# Extended: the full suite's two-process sweep is the vmapped seeds of
# test_seeds_over_two_processes_equal_one_process_and_only_process_0_prints.
@pytest.mark.slow
@pytest.mark.extended
def test_a_sweep_over_two_processes_equals_one_process(tmp_path):
    """experiments/sweep.py with --coordinator: both processes run the sweep (one vmapped group of
    two seeds and a second algorithm), process 0 alone prints and writes results.md / .json;
    the results equal a one-process sweep on two devices."""
    sweep = [sys.executable, str(ROOT / "experiments" / "sweep.py"), "--algos", "fedavg",
             "pgfedmo", "--seeds", "0", "1", "--common",
             "--rounds 2 --clients 6 --participation 0.5"]
    port = _free_port()
    procs = [subprocess.Popen(sweep + ["--out", str(tmp_path / "two"), "--coordinator",
                                       f"127.0.0.1:{port}", "--num-processes", "2",
                                       "--process-id", str(i)],
                              env=_env("1"), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in (0, 1)]
    single = subprocess.Popen(sweep + ["--out", str(tmp_path / "one")],
                              env=_env("2"), cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outputs = []
    for p in procs + [single]:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-3000:]
        outputs.append(out)
    assert "wrote" in outputs[0] and outputs[1] == ""                 # process 1 says nothing
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    one = json.loads((tmp_path / "one" / "results.json").read_text())
    assert [r["algo"] for r in two] == ["fedavg", "pgfedmo"] and two == one


@pytest.mark.slow
def test_an_interrupted_process_leaves_a_resumable_run(tmp_path):
    """Two processes, checkpoints every round (pgfedmo: per-client state rows on both processes),
    the data sharded over them (`--data-placement sharded`: each process holds its own range of
    clients): Ctrl-C to process 1 after round 2's checkpoint
    (process 0, its peer gone, is then ended as a launcher ends the group); a byte of round 2's
    checkpoint damaged in a file only process 1 hashes (the processes verify a checkpoint
    together, each a share of its files); `--resume` with two processes then continues from
    round 1 in both and reports the metrics of an uninterrupted run with the data on every
    device."""
    algo = ["--algo", "pgfedmo", "--checkpoint-every", "1"]
    # The uninterrupted reference: one process on two devices (two processes give its results:
    # test_seeds_over_two_processes_equal_one_process_and_only_process_0_prints).
    whole = _cli(tmp_path, "whole", algo + ["--rounds", "4", "--data-placement", "device"],
                 devices="2")
    assert whole.wait(timeout=600) == 0, whole.stderr.read()[-3000:]
    algo += ["--data-placement", "sharded"]
    env = {**_env("1"), "FEDJAX_PFL_TEST_NO_FIGURES": "1"}       # (tests/support/pause_run.py)
    port = _free_port()
    with helpers.ctrl_c_for_children():
        procs = [subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "support" / "pause_run.py"), "2", "--rounds", "4",
             "--clients", "6", "--participation", "0.5", "--quiet", "--out",
             str(tmp_path / "parts"), *algo, "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", "2", "--process-id", str(i)],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in (0, 1)]
    seen = []                                           # process 0: round 2 and its checkpoint
    while not any("paused after round 2" in s for s in seen):
        line = procs[0].stdout.readline()
        assert line, (seen, procs[0].stderr.read()[-2000:])
        seen.append(line)
    procs[1].send_signal(signal.SIGINT)
    assert procs[1].wait(timeout=120) == 130
    # Process 1 writes nothing, and says what is true of it (not "before the run started").
    said = procs[1].stderr.read().strip().splitlines()[-1]
    assert said.startswith("run.py: process 1: interrupted after round ") and said.endswith(
        "; process 0 records the run"), said
    procs[0].kill()                                     # the launcher ends the group
    procs[0].wait(timeout=60)
    # Both processes wrote their shards of the client state into each checkpoint that process 0
    # committed (the round-3 one, if started, never was).
    assert {"round_000001", "round_000002"} <= set(os.listdir(tmp_path / "parts" / "checkpoints"))
    # One byte of round 2's checkpoint changed, in a file that process 1 alone hashes when the
    # two verify it together (`checkpoint.verify_shares`): both find the damage and resume from
    # round 1.
    from fedjax_pfl import checkpoint

    newest = tmp_path / "parts" / "checkpoints" / "round_000002"
    files = json.loads((newest / "manifest.json").read_text())["files"]
    names = list(files)
    share = checkpoint.verify_shares([files[n]["size"] for n in names], 2)
    victim = newest / next(names[i] for i in share[1] if files[names[i]]["size"] > 0)
    damaged = bytearray(victim.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    victim.write_bytes(bytes(damaged))
    reads = tmp_path / "reads"
    reads.mkdir()
    out = _two(tmp_path, "parts", algo + ["--rounds", "4", "--resume"], host_reads=reads)[0]
    assert (f"round_000002 is damaged (checkpoint {newest}: file {victim.relative_to(newest)} "
            "does not match its SHA-256 in the manifest (damaged) (found by process 1)"
            ) in " ".join(out.split()), out[-2000:]
    # Each process hashed only its own share of round 2's files (process 1 up to the damaged one).
    mine = [[names[i] for i in share[0]], [names[i] for i in share[1]]]
    mine[1] = mine[1][:mine[1].index(str(victim.relative_to(newest))) + 1]
    for k in (0, 1):
        hashed = [os.path.relpath(f, newest) for f in json.loads(
            (reads / f"reads-{k}.json").read_text())["hashed"] if f.startswith(str(newest) + os.sep)]
        assert hashed == mine[k], (k, hashed, mine[k])
    whole, parts = _rows(tmp_path / "whole" / "metrics.jsonl"), _rows(tmp_path / "parts" / "metrics.jsonl")
    assert [r["round"] for r in parts] == [1, 2, 3, 4]
    for a, b in zip(parts, whole, strict=True):
        for key in ("train_loss", "acc_mean", "global_acc_mean", "alpha_mean"):
            assert a[key] == b[key], (a["round"], key, a[key], b[key])


@pytest.mark.slow
def test_two_processes_generate_only_their_own_synthetic_clients(tmp_path):
    """Synthetic data sharded over two processes: each generates only the clients its device
    holds (`synthetic._generate_synthetic`'s `materialise`), and the run reports the metrics of
    one process that generated every client and holds the data on both of its devices."""
    data = ["--dataset", "synthetic", "--synthetic-clients", "40", "--clients", "40",
            "--participation", "0.25", "--rounds", "3"]
    _two(tmp_path, "parts", data + ["--data-placement", "sharded"])
    one = _cli(tmp_path, "one", data + ["--data-placement", "device"], devices="2")
    assert one.wait(timeout=600) == 0, one.stderr.read()[-3000:]
    parts, whole = _rows(tmp_path / "parts" / "metrics.jsonl"), _rows(tmp_path / "one" / "metrics.jsonl")
    assert [r["round"] for r in parts] == [1, 2, 3]
    for a, b in zip(parts, whole, strict=True):
        for key in ("train_loss", "acc_mean"):
            assert a[key] == b[key], (a["round"], key, a[key], b[key])
        # (the evaluation loss sums over devices in another order: equal to float32's rounding)
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(b["loss"]), (a["round"], a["loss"], b["loss"])
