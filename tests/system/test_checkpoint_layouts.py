"""A checkpoint resumes on another layout: written on 2 CPU devices and resumed on 1, or on 1 and
resumed on 2, or by two processes and resumed by one, the state restored is the saved one bit for
bit, placed for the resuming run's devices, and the run continues; with device or host state
placement (`--state-placement host`: the client rows in a host store). What only a layout can
make unrestorable, another count of client slots (N padded to a multiple of the device count), is
refused in one line before compiling.

What the later rounds may differ in (measured, docs/checkpoints.md): a round computes each
client's steps and evaluation on one device, whatever the device count, so state and metrics that
depend only on per-client arithmetic are the same bits on every layout (`local`: every round and
metric equal, uninterrupted, resumed on another layout, or not). Sums over the clients of
several devices (the server's aggregate, PGFedMo's ḡ and α updates) add each device's partial
sum and then the devices' sums, so 2 devices round differently from 1: the state after round 2
already differs in its last bits, and the resumed run's later rounds agree with an uninterrupted
run of the resuming layout to rounding, not bit for bit (measured, 8 clients: the losses within
5e-8 relative, the accuracies and α statistics equal; the test allows 1e-6)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import helpers
import numpy as np
import pytest

from fedjax_pfl import checkpoint

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow          # each case starts JAX and compiles 3-4 times

COMMON = ["--clients", "8", "--participation", "0.5", "--local-steps", "2", "--quiet",
          "--checkpoint-every", "2"]


def _env(devices):
    env = {**os.environ, "FEDJAX_PFL_CPU_DEVICES": str(devices), "PYTHONPATH": str(ROOT)}
    env["XLA_FLAGS"] = helpers.without_device_count(env.get("XLA_FLAGS", ""))
    return env


def _start(argv, devices, script="run_no_figures.py"):
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "support" / script), *argv],
                            env=_env(devices), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(proc, status=0):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == status, err[-3000:]
    return out, err


def _run(out, rounds, devices, *flags):
    return _finish(_start(["--out", str(out), "--rounds", str(rounds), *COMMON, *flags], devices))


def _restored(out, dump, devices, placement):
    _finish(_start([str(out), str(dump), "--state-placement", placement], devices,
                   script="restored_state.py"))
    with np.load(dump) as z:
        return {k: z[k] for k in z.files}


def _assert_restored_is_saved(got, ckpt, devices):
    """The restored leaves are the saved arrays bit for bit (`checkpoint.load_numpy` reads them
    without any state); each device leaf placed on the resuming run's devices. Under host state
    placement each client slot's rows are the store's saved rows, or, for a slot no round wrote,
    its initial rows (rebuilt here from the saved ids, values and initial rows)."""
    saved = checkpoint.load_numpy(str(ckpt))
    assert int(got.pop("local_devices")) == devices
    placed = {k[len("devices:"):]: int(got.pop(k)) for k in list(got) if k.startswith("devices:")}
    rows = {k[len("rows:"):]: got.pop(k) for k in list(got) if k.startswith("rows:")}
    assert list(got) == list(placed) and len(got) == len(saved) and saved
    if rows:               # (a host checkpoint's tree is the list of the device leaves, in order)
        saved = dict(zip(got, saved.values()))
    assert set(got) == set(saved)
    for name in saved:
        assert got[name].shape == saved[name].shape, name
        assert got[name].tobytes() == saved[name].tobytes(), name
        assert placed[name] == devices, name
    if rows:               # (one store part, "store", or one a process: "store.p0", ...)
        host = checkpoint.read_host(str(ckpt))
        parts = sorted({k.split("/")[0] for k in host if k.startswith("store")})
        assert parts
        for j, name in enumerate(rows):
            initial = host[f"{parts[0]}/{j}/initial"]
            want = np.broadcast_to(initial, (rows[name].shape[0],) + initial.shape).copy()
            for part in parts:
                want[np.asarray(host[f"{part}/ids"])] = host[f"{part}/{j}/values"]
            assert rows[name].view(want.dtype).tobytes() == want.tobytes(), name


def _close_rows(got, want, rtol):
    assert [r["round"] for r in got] == [r["round"] for r in want]
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys()
        for key, value in b.items():
            if isinstance(value, float):
                assert abs(a[key] - value) <= rtol * max(1.0, abs(value)), (a["round"], key)
            else:
                assert a[key] == value, (a["round"], key)


# The full suite writes on 2 devices and resumes on 1 with host state, and the reverse with
# device state; `--extended` adds the other directions and Ditto's 5 clients on uneven slots.
@pytest.mark.parametrize("algo,placement,written,resumed,clients", [
    pytest.param("local", "device", 2, 1, 8, marks=pytest.mark.extended),
    ("local", "device", 1, 2, 8),
    ("pgfedmo", "host", 2, 1, 8),
    pytest.param("pgfedmo", "host", 1, 2, 8, marks=pytest.mark.extended),
    pytest.param("ditto", "host", 2, 1, 5, marks=pytest.mark.extended),
])
def test_a_checkpoint_resumes_on_another_device_count(tmp_path, algo, placement, written, resumed,
                                                      clients):
    """Round 2's checkpoint written on `written` devices, resumed on `resumed`: exit 0, the state
    restored bit for bit, rounds 1-2 as the writer logged them, rounds 3-4 those of an
    uninterrupted run on `resumed` devices: bit for bit for `local` (per-client arithmetic only,
    and its final checkpoint too), to rounding for PGFedMo and Ditto (sums over devices: module
    docstring). Ditto's 5 clients are 6 slots on 2 devices and 5 on one: under host placement
    its store holds real clients' rows only and its device leaves do not depend on N, so it
    restores across the paddings."""
    flags = ["--algo", algo, "--state-placement", placement, "--clients", str(clients)]
    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    _run(stopped, 2, written, *flags)
    writer_rows = helpers.metric_rows(stopped)
    ckpt = stopped / "checkpoints" / "round_000002"
    _assert_restored_is_saved(_restored(stopped, tmp_path / "dump.npz", resumed, placement),
                              ckpt, resumed)
    _run(stopped, 4, resumed, *flags, "--resume")
    _run(whole, 4, resumed, *flags)
    got, want = helpers.metric_rows(stopped), helpers.metric_rows(whole)
    assert got[:2] == writer_rows
    if algo == "local":
        assert got == want
        final = [checkpoint.load_numpy(str(d / "checkpoints" / "round_000004")) for d in (stopped, whole)]
        assert final[0].keys() == final[1].keys()
        for k in final[1]:
            np.testing.assert_array_equal(final[0][k], final[1][k], err_msg=k)
    else:
        _close_rows(got[2:], want[2:], rtol=1e-6)


@pytest.mark.parametrize("written,resumed", [(2, 1), pytest.param(1, 2, marks=pytest.mark.extended)])
def test_a_checkpoint_of_other_client_slots_is_refused_in_one_line_before_compiling(
        tmp_path, written, resumed):
    """5 clients are 6 client slots on 2 devices (padded to a multiple of the device count) and
    5 on one: PGFedMo's [N, ...] rows and N x N α cannot be restored into the other count.
    The resume exits 2 with one line naming the checkpoint, the first leaf that differs and
    both paddings, before compiling (no memory plan, which follows the compilation) and with
    the run's files untouched."""
    out = tmp_path / "run"
    flags = ["--algo", "pgfedmo", "--clients", "5"]
    _run(out, 2, written, *flags)
    before = {n: (out / n).read_bytes() for n in os.listdir(out) if (out / n).is_file()}
    stdout, stderr = _finish(_start(["--out", str(out), "--rounds", "3", *COMMON, *flags,
                                     "--resume"], resumed), status=2)
    assert "memory plan" not in stdout and "Traceback" not in stderr      # before compiling
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    slots = {1: 5, 2: 6}
    assert str(out / "checkpoints" / "round_000002") in lines[0]
    assert (f"is float32[{slots[written]}, 100] there but float32[{slots[resumed]}, 100] here"
            in lines[0])
    assert (f"padded to {slots[written]} slots for {written} device" in lines[0]
            and f"to {slots[resumed]} for {resumed} device" in lines[0])
    assert {n: (out / n).read_bytes() for n in os.listdir(out) if (out / n).is_file()} == before


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("algo,placement", [pytest.param("local", "device", marks=pytest.mark.extended),
                                             ("pgfedmo", "host")])
def test_a_two_process_checkpoint_resumes_in_one_process_on_one_device(tmp_path, algo, placement):
    """Two processes on the loopback address (one CPU device each) write round 2's checkpoint,
    each its own shards (and, under host placement, its own store part); one process on one
    device resumes it: exit 0, the state restored bit for bit (both store parts' rows), rounds
    1-2 as the two processes logged them, rounds 3-4 those of an uninterrupted one-process
    one-device run (bit for bit for `local`; PGFedMo's sums over the two devices to rounding)."""
    flags = ["--algo", algo, "--state-placement", placement]
    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    port = _free_port()
    procs = [_start(["--out", str(stopped), "--rounds", "2", *COMMON, *flags, "--coordinator",
                     f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)], 1)
             for i in (0, 1)]
    for p in procs:
        _finish(p)
    ckpt = stopped / "checkpoints" / "round_000002"
    assert (ckpt / "host-00001.npz").exists() == (placement == "host")     # process 1's rows
    assert json.loads((ckpt / "meta.json").read_text())["metadata"]["layout"]["processes"] == 2
    writer_rows = helpers.metric_rows(stopped)
    _assert_restored_is_saved(_restored(stopped, tmp_path / "dump.npz", 1, placement), ckpt, 1)
    _run(stopped, 4, 1, *flags, "--resume")
    _run(whole, 4, 1, *flags)
    got, want = helpers.metric_rows(stopped), helpers.metric_rows(whole)
    assert got[:2] == writer_rows
    if algo == "local":
        assert got == want
    else:
        _close_rows(got[2:], want[2:], rtol=1e-6)
