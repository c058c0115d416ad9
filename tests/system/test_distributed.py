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
import time
from pathlib import Path

import helpers
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli(tmp, name, extra, algo="pgfedmo", env=None):
    env = {**os.environ, "FEDJAX_PFL_CPU_DEVICES": "1", "PYTHONPATH": str(ROOT), **(env or {})}
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


def _write_mnist(folder: Path, seed: int, n: int = 40) -> None:
    """MNIST's four IDX files (gzip), `n` train and `n` test images of random pixels."""
    import gzip
    import struct

    import numpy as np

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    for split in ("train", "t10k"):
        for kind, arr in (("images-idx3", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)),
                          ("labels-idx1", rng.integers(0, 10, n, dtype=np.uint8))):
            head = bytes([0, 0, 8, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
            (folder / f"{split}-{kind}-ubyte.gz").write_bytes(gzip.compress(head + arr.tobytes()))


@pytest.mark.slow       # (two processes, twice; the quick suite has no multi-process test)
def test_processes_with_other_data_stop_before_running(tmp_path):
    """Each process of a run provides its own devices' copy of the dataset, so all must hold the
    same one. Other flags (here --seed, another partition) are refused at the start, before any
    data is read; the same flags reading other files (each process's own $FEDJAX_PFL_DATA_DIR)
    make both stop at the data's fingerprint, naming the mismatch, instead of training on
    different data."""
    port = _free_port()
    flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    procs = [_cli(tmp_path, "two", flags + ["--process-id", str(i), "--seed", str(i)])
             for i in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 2 and err.strip().splitlines()[-1] == (
            "run.py: error: process 1 was started with --seed 1, process 0 with 0: start every "
            "process with the same flags"), err[-3000:]
    for i in (0, 1):
        _write_mnist(tmp_path / f"data{i}" / "mnist", seed=i)
    port = _free_port()
    flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--dataset", "mnist",
             "--clients", "4"]
    procs = [_cli(tmp_path, "files", flags + ["--process-id", str(i)],
                  env={"FEDJAX_PFL_DATA_DIR": str(tmp_path / f"data{i}")}) for i in (0, 1)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode != 0 and "hold other values than process 0" in err, err[-3000:]


# ---- fedjax_pfl.distributed's parts, in one process (quick) -----------------------------------

def _handshake(facts_of, port=None, num_processes=2, ids=None):
    """Process 0's `_lead` and the others' `_join` in threads: each process's StartupError
    message (None: it passed)."""
    import threading

    from fedjax_pfl import distributed

    port = port or _free_port()
    ids = ids or list(range(1, num_processes))
    said = {}

    def side(who, slot):
        hello = {"num_processes": num_processes, "code": "c0", **facts_of(who)}
        try:
            if who == 0:
                distributed._lead(port, num_processes, hello, timeout=5)
            else:
                distributed._join("127.0.0.1", port, {**hello, "process_id": who}, timeout=5)
            said[slot] = None
        except distributed.StartupError as e:
            said[slot] = str(e)

    threads = [threading.Thread(target=side, args=(w, k)) for k, w in enumerate([0] + ids)]
    threads[0].start()
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(30)
    return [said.get(k, "no answer") for k in range(len(threads))]


def test_the_handshake_passes_agreeing_processes_and_names_the_first_disagreement():
    assert _handshake(lambda who: {"flags": {"rounds": 5}}) == [None, None]
    expected = ("process 1 was started with rounds 4, process 0 with 5: start every process "
                "with the same flags")
    assert _handshake(lambda who: {"flags": {"rounds": 5 - who}}) == [expected, expected]
    code = _handshake(lambda who: {"code": f"c{who}"})
    assert code[0] == code[1] and code[0].startswith("process 1 runs other code than process 0")
    # Three processes of which two say they are process 1: every one that met process 0 is told.
    twice = _handshake(lambda who: {}, num_processes=3, ids=[1, 1])
    assert twice[0] == "two processes were started with process_id 1"
    assert twice.count(twice[0]) >= 2, twice
    assert _handshake(lambda who: {}, ids=[4]) == [
        "a process joined with process_id 4, outside 1 .. 1 of process 0's num_processes 2"] * 2


def test_the_handshake_refuses_a_coordinator_port_already_taken():
    from fedjax_pfl import distributed

    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(distributed.StartupError, match=f"cannot listen on the coordinator port {port}"):
            distributed._lead(port, 2, {}, timeout=1)


class _Store:
    """A key-value store as JAX's coordination client offers it (key_value_set/try_get)."""

    def __init__(self):
        self.values = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        self.values[key] = value

    def key_value_try_get(self, key):
        if key not in self.values:
            raise KeyError(key)
        return self.values[key]


@pytest.mark.slow
def test_the_watchdog_finds_the_process_whose_counter_stopped_and_stops_the_main_thread():
    """Process 2 of 3 stops beating after 0.5 s, process 1 beats on: the watchdog (timeout
    1 s) names process 2, and the main thread, inside `stop_signals`, gets `PeerLost` (as a
    KeyboardInterrupt, where SIGTERM would give `Terminated`); `explain` maps a collective's
    failure to it, and an unrelated error to None."""
    import threading

    from fedjax_pfl import distributed, interrupts

    store, beating = _Store(), {1: True, 2: True}

    def peer(p):
        count = 0
        while beating[p]:
            count += 1
            store.key_value_set(f"fedjax_pfl/alive/{p}", str(count))
            time.sleep(0.05)

    peers = [threading.Thread(target=peer, args=(p,), daemon=True) for p in (1, 2)]
    for t in peers:
        t.start()
    timer = threading.Timer(0.5, lambda: beating.__setitem__(2, False))
    timer.start()
    dog = distributed.Watchdog(1.0, period=0.05, grace=3600, client=store, process=0, processes=3)
    start = time.monotonic()
    try:
        caught = None
        try:                 # (a KeyboardInterrupt that is no PeerLost must not end pytest)
            with interrupts.stop_signals():
                dog.start()
                while time.monotonic() - start < 10:
                    time.sleep(0.01)
        except KeyboardInterrupt as e:
            caught = e
        took = time.monotonic() - start
        assert isinstance(caught, distributed.PeerLost), caught
        assert caught.process == 2 and 1.5 - 0.2 <= took <= 1.5 + 1.5, took
        assert interrupts.exit_status(caught) == 75
        assert interrupts.signal_name(caught) == "lost process 2"
        assert distributed.explain(ValueError("Gloo AllGather failed: Connection closed by peer"),
                                   wait=0) is caught
    finally:
        beating[1] = False
        distributed.reset()
    assert distributed.explain(ValueError("Gloo AllGather failed"), wait=0) is None   # no watchdog
    assert interrupts._lost == []


def test_a_process_that_ended_normally_is_not_lost_and_stop_ends_the_watch():
    """Process 1 beats, then says "done" (its watchdog's `stop` at a normal exit) and falls
    silent for 3 timeouts: process 0's watchdog does not count it lost. `stop` then ends process
    0's watch at once (no thread left inside the coordination client at the interpreter's
    finalisation) and publishes its own "done"."""
    import threading

    from fedjax_pfl import distributed

    store = _Store()
    store.key_value_set("fedjax_pfl/alive/1", "1")
    dog = distributed.Watchdog(0.3, period=0.02, grace=3600, client=store, process=0, processes=2)
    try:
        dog.start()
        time.sleep(0.1)
        store.key_value_set("fedjax_pfl/alive/1", "done")
        time.sleep(1.0)                                   # > 3 timeouts of silence
        assert distributed.lost() is None and dog.is_alive()
        began = time.monotonic()
        dog.stop()
        assert not dog.is_alive() and time.monotonic() - began < 0.5
        assert store.values["fedjax_pfl/alive/0"] == "done"
        assert dog not in threading.enumerate()
    finally:
        dog.stop()
        distributed.reset()


def test_the_facts_are_said_by_name(monkeypatch):
    import fedjax_pfl
    from fedjax_pfl import distributed
    from fedjax_pfl.errors import render

    assert distributed.conflict({"a": 1, "flags": {"x": None}}, {"a": 1, "flags": {"x": None}}, 1) is None
    assert render(distributed.conflict({"num_processes": 2}, {"num_processes": 3}, 2)) == (
        "process 2 has num_processes 3, process 0 has 2")
    # The code's digest covers the release too (and every source file: see code_version).
    digest = distributed.code_version()
    monkeypatch.setattr(fedjax_pfl, "__version__", fedjax_pfl.__version__ + ".dev1")
    assert distributed.code_version() != digest and len(digest) == 16


def test_a_launchers_layout_that_is_not_there_is_one_line(monkeypatch):
    from jax._src import clusters

    from fedjax_pfl import distributed

    for env in clusters.ClusterEnv._cluster_types:
        monkeypatch.setattr(env, "is_env_present", classmethod(lambda cls: False))
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    with pytest.raises(distributed.StartupError) as e:
        distributed.start()
    assert str(e.value).startswith("distributed auto: no launcher's process layout here")
    with pytest.raises(distributed.StartupError, match="give all of coordinator, num_processes"):
        distributed.start("127.0.0.1:1", None, 0)
