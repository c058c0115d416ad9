"""A checkpoint costs nothing before the rounds and compiles nothing: saving and restoring a state
compiles no XLA program, on one device and on two, with the state on the devices or (host state
placement) in a host store, and the state restored is the saved one bit for bit, in the sharding
asked for; orbax is imported by the first save or restore, not by the library or the runner; a
run's first checkpoint follows round `--checkpoint-every`, never the start.

Why a count: orbax's default replica-parallel writing took every replicated leaf's slice on each
of its devices with `lax.slice_in_dim`, one `jit(slice)` program per replicated leaf per device,
compiled (0.03 s each on CPU) at a run's first checkpoint: 10 for FedAvg's server state on 2
CPU devices, 16 for PGFedMo's (`checkpoint._writer`). On one device a leaf has one replica, so
only the two-device cases can see those programs; the scenario's state holds three replicated
leaves with a dimension 2 divides (6×4, 4, and a key's 2 words) and one scalar, so the old
writer compiled 3 × 2 = 6 programs there.

Programs are counted with `compiles.record()`, which also counts a program the persistent
compilation cache supplies, so a warm cache cannot hide one; each scenario also records one
jitted op, to show that the recorder sees programs in that process."""

import json
import os
import subprocess
import sys

import checkpoint_compiles
import helpers
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = ("save", "save_again", "restore", "restore_abstract", "restore_other_layout")


def _env(devices: int) -> dict:
    env = {**os.environ, "FEDJAX_PFL_CPU_DEVICES": str(devices), "PYTHONPATH": ROOT}
    env["XLA_FLAGS"] = helpers.without_device_count(env.get("XLA_FLAGS", ""))
    return env


def _check(found: dict, devices: int) -> None:
    assert found["devices"] == devices
    assert found["probe"] == ["jit(<lambda>)"]                 # the recorder sees a program here
    assert found["programs"] == {step: [] for step in STEPS}   # and none in a save or restore
    assert found["different"] == {step: [] for step in STEPS[2:]}
    assert found["host_equal"] and found["shardings_as_asked"]


def test_save_and_restore_compile_nothing_on_one_device(tmp_path):
    _check(checkpoint_compiles.scenario(str(tmp_path)), devices=1)


@pytest.mark.slow
def test_save_and_restore_compile_nothing_on_two_devices(tmp_path):
    """The layout orbax's replica-parallel writing sliced: 2 CPU devices, in a subprocess."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "support", "checkpoint_compiles.py"),
         str(tmp_path)], env=_env(2), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check(json.loads(proc.stdout.strip().splitlines()[-1]), devices=2)


# A run's checkpoints, in the runner: the main job (8 clients) for 2 rounds with a checkpoint
# after each, then resumed to round 3; every `checkpoint.save` and `checkpoint.restore` it makes
# is recorded.
_RUN = """
import json, sys
import run
import no_figures
from fedjax_pfl import checkpoint, compiles

no_figures.stub_all()
calls = []

def recorded(name, f):
    def call(*args, **kwargs):
        with compiles.record() as log:
            out = f(*args, **kwargs)
        calls.append([name, log.names])
        return out
    return call

checkpoint.save = recorded("save", checkpoint.save)
checkpoint.restore = recorded("restore", checkpoint.restore)
out, placement = sys.argv[1], sys.argv[2]
flags = ["--clients", "8", "--participation", "0.5", "--local-steps", "2", "--quiet"]
assert run.main(["--algo", "fedavg", "--out", out, "--rounds", "2", "--checkpoint-every", "1",
                 "--state-placement", placement, *flags]) == 0
assert run.main(["--resume", out, "--rounds", "3", "--quiet"]) == 0
import jax
print(json.dumps({"devices": jax.device_count(), "calls": calls}))
"""


# Device state on one device and host state on two; `--extended` adds the other two.
@pytest.mark.slow           # each case starts JAX and compiles a run's programs
@pytest.mark.parametrize("placement, devices", [
    ("device", 1), ("host", 2), pytest.param("device", 2, marks=pytest.mark.extended),
    pytest.param("host", 1, marks=pytest.mark.extended)])
def test_a_runs_checkpoints_compile_nothing(tmp_path, placement, devices):
    """Rounds 1 and 2 each end with a save, the resume restores round 2's and round 3 ends with a
    save: save, save, restore, save, none compiling a program."""
    proc = subprocess.run([sys.executable, "-c", _RUN, str(tmp_path / "run"), placement],
                          env={**_env(devices), "PYTHONPATH": os.pathsep.join(
                              [ROOT, os.path.join(ROOT, "experiments"), os.path.join(ROOT, "tests", "support")])},
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["devices"] == devices
    assert found["calls"] == [["save", []], ["save", []], ["restore", []], ["save", []]]


_IMPORTS = """
import sys
import numpy as np
import fedjax_pfl.runner
from fedjax_pfl import checkpoint
from fedjax_pfl.runner import checkpoints
before = sorted(m for m in sys.modules if m.split(".")[0] in ("orbax", "tensorstore"))
checkpoint.save(sys.argv[1], {"w": np.arange(3)})
print(before, "orbax.checkpoint" in sys.modules)
"""


@pytest.mark.slow
def test_orbax_is_imported_by_the_first_save_not_before(tmp_path):
    """orbax and TensorStore cost ~0.15-0.4 s to import (`python -X importtime`): the library
    and the runner leave them to the first checkpoint (a run without one never pays)."""
    proc = subprocess.run([sys.executable, "-c", _IMPORTS, str(tmp_path / "c")], env=_env(1),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["[]", "True"]


def test_the_first_checkpoint_follows_round_every_not_the_start(monkeypatch, tmp_path):
    """`Checkpointer(every=3)` over a 7-round run writes after rounds 3, 6 and the last, 7, and
    nothing when it is made or the run starts (its state is only at hand at a call's end: rounds
    whose event has no state are skipped, as inside a --rounds-per-call call)."""
    from fedjax_pfl.callbacks import RoundEnd, RunStart
    from fedjax_pfl.runner import checkpoints

    written = []
    monkeypatch.setattr(checkpoints, "save", lambda cfg, out, state, *rest: written.append(state))
    ckpt = checkpoints.Checkpointer(None, str(tmp_path), None, None, 0.0, every=3)
    ckpt.on_run_start(RunStart(str(tmp_path), {}, 0, 7))
    assert written == [] and os.listdir(tmp_path) == []
    for r in range(1, 8):
        ckpt.on_round_end(RoundEnd(r, {}, np.zeros(0), state=f"after {r}", final=r == 7))
    ckpt.on_round_end(RoundEnd(8, {}, np.zeros(0), state=None))
    assert written == ["after 3", "after 6", "after 7"]
