"""A checkpoint costs no compile: saving and restoring a state compiles no XLA program, on one
device and on two, with the state on the devices or (host state placement) in a host store, and
the state restored is the saved one bit for bit, in the sharding asked for.

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
from fedjax_pfl import checkpoint, compiles, plots

plots.plot_label_distribution = plots.plot_learning_curves = lambda *a, **k: None
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


@pytest.mark.slow           # each case starts JAX and compiles a run's programs
@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("placement", ["device", "host"])
def test_a_runs_checkpoints_compile_nothing(tmp_path, devices, placement):
    """Rounds 1 and 2 each end with a save, the resume restores round 2's and round 3 ends with a
    save: save, save, restore, save, none compiling a program."""
    proc = subprocess.run([sys.executable, "-c", _RUN, str(tmp_path / "run"), placement],
                          env={**_env(devices), "PYTHONPATH": os.pathsep.join(
                              [ROOT, os.path.join(ROOT, "experiments")])},
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["devices"] == devices
    assert found["calls"] == [["save", []], ["save", []], ["restore", []], ["save", []]]
