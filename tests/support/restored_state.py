"""The state a resume of a run directory restores, written out, for tests that compare it with
the checkpoint it came from: `python tests/support/restored_state.py OUT DUMP.npz [--state-placement
P]` prepares the run in OUT as `--resume` would (`runner.resume_config`, on this process's devices:
$FEDJAX_PFL_CPU_DEVICES), restores its newest checkpoint as the runner does
(`runner.checkpoints.load`) and saves to DUMP.npz every restored leaf as a host array keyed by its
pytree path (PRNG keys as their key data, as `checkpoint.load_numpy` keys them). Under host state
placement the device leaves are saved so and each host leaf's rows of all N client slots under
"rows:PATH". "devices:PATH" holds the number of devices each device leaf is placed on, and
"local_devices" this process's device count."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import fedjax_pfl  # noqa: E402

fedjax_pfl.use_cpu_cores()          # before JAX starts, as experiments/run.py does

import jax  # noqa: E402
import numpy as np  # noqa: E402

from fedjax_pfl import runner  # noqa: E402
from fedjax_pfl.core import transfer  # noqa: E402
from fedjax_pfl.runner import checkpoints  # noqa: E402


def _host(leaf):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.asarray(transfer.to_host(leaf))


def main(out: str, dump: str, placement: str | None) -> None:
    cfg = runner.resume_config(out, **({"state_placement": placement} if placement else {}))
    prep = runner.prepare(cfg)
    program = prep.program
    path = checkpoints.latest_checkpoint(out)
    state = checkpoints.load(path, program.abstract_sharded_state(), prep)[0]
    arrays = {"local_devices": np.asarray(jax.local_device_count())}
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(program.abstract_state)[0]]
    if program.placements.state.name == "host":
        splitter = program.placements.state.host
        dev_paths, host_paths = splitter.split(paths)
        for name, leaf in zip(dev_paths, state.device, strict=True):
            arrays[name] = _host(leaf)
            arrays[f"devices:{name}"] = np.asarray(len(leaf.sharding.device_set))
        rows = state.store.gather(np.arange(program.num_clients))
        for name, r in zip(host_paths, rows, strict=True):
            arrays[f"rows:{name}"] = np.asarray(r)
    else:
        for name, leaf in zip(paths, jax.tree.leaves(state), strict=True):
            arrays[name] = _host(leaf)
            arrays[f"devices:{name}"] = np.asarray(len(leaf.sharding.device_set))
    # (.npz has no bfloat16: such leaves are saved as their bits, as the store saves its rows)
    arrays = {k: (v.view(np.uint16) if v.dtype == jax.numpy.bfloat16 else v) for k, v in arrays.items()}
    np.savez(dump, **arrays)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--state-placement"
         else None)
