"""Real processes, real signals: a run killed (SIGKILL) or stopped with Ctrl-C (SIGINT) at round
k and resumed from its directory ends exactly as a run that was never stopped; Ctrl-C at any
moment (start-up, compilation, rounds) exits 130 without a traceback and leaves a consistent
record. Two CPU devices, so the client state is sharded; bfloat16 state and fused rounds too.
And, in this process, `deferred_signals`: a held signal is raised when its block ends, unless
the block raised (its own exception wins)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import helpers
import numpy as np
import pytest

from fedjax_pfl import checkpoint

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "experiments" / "run.py")
PAUSE_SCRIPT = str(ROOT / "tests" / "support" / "pause_run.py")    # run.py with a pause after round R
# run.py drawing no PNGs (~1.5 s of CPU a run), for the runs whose figures no test reads: the
# uninterrupted reference and the resumed run (the stopped runs draw theirs, checked below).
NO_FIGURES_SCRIPT = str(ROOT / "tests" / "support" / "run_no_figures.py")
# The real processes are slow (each case starts JAX and compiles 2–3 times); the checks of
# `deferred_signals` in this process at the end are quick.
SLOW = pytest.mark.slow

COMMON = ["--clients", "8", "--participation", "0.5", "--local-steps", "2", "--rounds", "12"]


def _env(**extra):
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
            "FEDJAX_PFL_CPU_DEVICES": "2", **extra}


def _run(argv, script=SCRIPT, **env):
    with helpers.ctrl_c_for_children():
        proc = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True,
                              env=_env(**env), timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def _start(argv, pause_after=None, **env):
    script = [SCRIPT] if pause_after is None else [PAUSE_SCRIPT, str(pause_after)]
    with helpers.ctrl_c_for_children():
        return subprocess.Popen([sys.executable, *script, *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=_env(**env))


def _wait_for(proc, text, timeout=300):
    """Reads the process's stdout until a line contains `text`."""
    deadline = time.time() + timeout
    for line in proc.stdout:
        if text in line:
            return
        assert time.time() < deadline, f"no {text!r} in time"
    raise AssertionError(f"process ended before printing {text!r}: {proc.stderr.read()[-2000:]}")


_rows = helpers.metric_rows


def _final_arrays(out, rounds=12):
    return checkpoint.load_numpy(str(out / "checkpoints" / f"round_{rounds:06d}"))


def _assert_same_run(a, b):
    assert _rows(a) == _rows(b)
    fa, fb = _final_arrays(a), _final_arrays(b)
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (a, b))
    assert sa["best"] == sb["best"] and sa["best_round"] == sb["best_round"]
    assert sa["last"]["acc_mean"] == sb["last"]["acc_mean"] and not sb["interrupted"]


@SLOW
@pytest.mark.parametrize("algo,flags,stop,sig", [
    # pFedSOP's per-client Δ and x in bfloat16, sharded over 2 devices; killed with SIGKILL.
    ("pfedsop", ["--state-dtype", "bfloat16", "--checkpoint-every", "1"], 7, signal.SIGKILL),
    # PGFed's N × N α matrix and persistent momentum rows, 2 rounds per call; Ctrl-C.
    ("pgfed", ["--rounds-per-call", "2", "--eval-every", "2", "--checkpoint-every", "2",
               "--momentum", "0.9", "--momentum-buffer", "persist"], 8, signal.SIGINT),
    # FedAvg stopped by SIGTERM (kill, timeout, a scheduler's preemption): exit 143, resumable.
    ("fedavg", ["--checkpoint-every", "3"], 6, signal.SIGTERM),
])
def test_stopped_run_resumes_bit_for_bit(tmp_path, algo, flags, stop, sig):
    argv = ["--algo", algo, *COMMON, *flags, "--quiet"]
    _run(argv + ["--out", str(tmp_path / "full")], script=NO_FIGURES_SCRIPT)

    out = tmp_path / "stopped"
    proc = _start(argv + ["--out", str(out)], pause_after=stop)
    _wait_for(proc, f"paused after round {stop}")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    if sig in (signal.SIGINT, signal.SIGTERM):
        status, said = (130, "interrupted") if sig == signal.SIGINT else (143, "terminated (SIGTERM)")
        assert proc.returncode == status and "Traceback" not in err, err
        assert err.strip().splitlines()[-1].startswith(f"run.py: {said} after round {stop};")
        summary = json.loads((out / "summary.json").read_text())
        assert summary["interrupted"] and summary["last_completed_round"] == stop
        assert summary["interrupted_by"] == signal.Signals(sig).name
        names = sorted(os.listdir(out / "checkpoints"))
        assert not [n for n in names if n.startswith(".")], names   # no save's temporary left
        assert len(names) <= 2 and names[-1] == f"round_{stop:06d}", names   # the last two kept
        assert summary["last_checkpoint_round"] == stop
        assert (out / "learning_curve.png").exists() and (out / "client_metrics.npz").exists()
    else:
        assert proc.returncode == -signal.SIGKILL
    assert len(_rows(out)) == stop
    assert runner_latest(out).endswith(f"round_{stop:06d}")

    resumed = _run(["--resume", str(out), "--quiet"], script=NO_FIGURES_SCRIPT)
    assert f"resuming from {out}/checkpoints/round_{stop:06d}" in resumed.stdout
    _assert_same_run(tmp_path / "full", out)


def runner_latest(out):
    from fedjax_pfl import runner

    return runner.latest_checkpoint(str(out))


@SLOW
def test_ctrl_c_during_compilation_exits_130_and_records_it(tmp_path):
    out = tmp_path / "run"
    proc = _start(["--algo", "pgfedmo", *COMMON, "--out", str(out)])
    _wait_for(proc, "compiling pgfedmo")                # printed just before XLA compiles
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "Segmentation" not in err
    assert err.strip().splitlines()[-1].startswith("run.py: interrupted during compilation;")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and summary["interrupted_during"] == "compile"
    assert summary["last_completed_round"] == 0 and summary["last_checkpoint_round"] is None
    assert (out / "config.json").exists()
    # That directory holds a run now: a new run there is refused, --resume starts it over.
    refused = subprocess.run([sys.executable, SCRIPT, "--out", str(out), "--quiet"],
                             capture_output=True, text=True, env=_env())
    assert refused.returncode == 2 and "--overwrite" in refused.stderr


@SLOW
@pytest.mark.parametrize("delay", [0.3, 2.0])
def test_ctrl_c_at_start_up_exits_130_without_traceback(tmp_path, delay):
    proc = _start(["--algo", "fedavg", *COMMON, "--out", str(tmp_path / "run")])
    time.sleep(delay)                                   # importing JAX, loading data, tracing
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("run.py: interrupted")


# --- deferred_signals, in this process ------------------------------------------------------

def _outcome(block) -> BaseException | None:
    """What leaves a `deferred_signals()` block running `block` (caught here, KeyboardInterrupt
    too, so that a signal that escapes fails the test rather than stopping pytest)."""
    from fedjax_pfl.interrupts import deferred_signals

    try:
        with deferred_signals():
            block()
    except BaseException as e:          # noqa: BLE001 (the outcome is what is tested)
        return e
    return None


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_held_signal_is_raised_at_the_end_of_a_block_that_ended_normally(sig):
    from fedjax_pfl.interrupts import Terminated

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    seen = []
    e = _outcome(lambda: (signal.raise_signal(sig), seen.append("after the signal")))
    assert seen == ["after the signal"]                 # the block was not cut
    assert type(e) is (Terminated if sig == signal.SIGTERM else KeyboardInterrupt)
    assert {s: signal.getsignal(s) for s in handlers} == handlers


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_blocks_own_exception_wins_over_a_held_signal(sig):
    """The module's contract ("raised at its end ... unless the block raised"): a checkpoint save
    that fails while Ctrl-C is held reports its own error (the run's record of why it stopped
    needs it); the held signal must not mask it."""
    class SaveFailed(OSError):
        pass

    def block():
        signal.raise_signal(sig)
        raise SaveFailed("disk full")

    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    e = _outcome(block)
    assert type(e) is SaveFailed and str(e) == "disk full"
    assert {s: signal.getsignal(s) for s in handlers} == handlers
