"""Client state split across several XLA devices gives the same results as the one-client loop,
for every algorithm, with N and M not divisible by the device count.

Runs in subprocesses because the device count is fixed when JAX starts.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import json, sys
    sys.path.insert(0, "tests")
    import fedjax_pfl
    assert fedjax_pfl.use_cpu_cores(2) == 2
    import jax, numpy as np
    from fedjax_pfl import algorithms, core
    from helpers import linear_model, make_data
    assert len(jax.devices()) == 2
    name, hp = sys.argv[1], json.loads(sys.argv[2])
    data = make_data([7, 23, 12, 1, 9])          # N = 5 (padded to 6), M = 3 at 60 %
    keys = jax.random.key(3)
    results = {}
    for backend in ("loop", "chunked"):
        algo = algorithms.get(name, model=linear_model(), backend=backend, chunk_size=2,
                              participation=0.6, batch_size=4, **hp)
        mesh = core.client_mesh() if backend != "loop" else None
        d = core.prepare_data(data, mesh)
        program = core.Program(algo, d, mesh=mesh, jit=backend != "loop")
        state = program.init(jax.random.key(0))    # (FedPC's init runs on the host)
        for r in range(3):
            state, m = program.run_rounds(state, keys, r, 1)
        evals = program.evaluate(state)
        results[backend] = (state, m[0], evals, d.num_clients)
    (ref, ref_m, ref_ev, n), (got, got_m, got_ev, n_pad) = results["loop"], results["chunked"]

    def canonical(state):
        """PGFed keeps last round's uploads in the round's row order: sort them by client id."""
        if not hasattr(state, "prev_idx"):
            return state
        order = np.argsort(np.asarray(state.prev_idx))
        take = lambda t: jax.tree.map(lambda a: np.asarray(a)[order], t)
        return state._replace(prev_idx=take(state.prev_idx), prev_grads=take(state.prev_grads),
                              prev_b=take(state.prev_b))

    ref, got = canonical(ref), canonical(got)
    assert n == 5 and n_pad == 6
    sharded = 0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        a_host = np.asarray(a)
        if a.ndim >= 1 and a.shape[0] == n_pad:          # a per-client leaf: split over devices
            assert [s.data.shape[0] for s in a.addressable_shards] == [3, 3], a.sharding
            sharded += 1
            a_host = a_host[tuple(slice(0, n) if (sa, sb) == (n_pad, n) else slice(None)
                                  for sa, sb in zip(a.shape, b.shape))]
        np.testing.assert_allclose(a_host, np.asarray(b), rtol=5e-5, atol=2e-6)
    # With two devices the round's rows are in the device-balanced order: the same clients.
    np.testing.assert_array_equal(np.sort(got_m["sampled"]), np.sort(ref_m["sampled"]))
    np.testing.assert_allclose(got_ev["client"].loss_sum[:n], ref_ev["client"].loss_sum, rtol=5e-5)
    print(json.dumps({"sharded_leaves": sharded}))
''')

CASES = {
    "fedavg": {"momentum": 0.9, "momentum_buffer": "persist"},
    "fedavg_ft": {},
    "local": {},
    "pfedsop": {},
    "pgfed": {},
    "pgfedmo": {},
    "pgfed_ce": {},
    "tdpfed": {"cr": 1.2, "local_steps": 2},
    "pfedme": {"local_steps": 2},
    "fedavg_sar": {"mask_fill": "keep"},
    "fedper": {},
    "fedpc": {"local_steps": 1},
    # The linear model {w, b}: the bias as head, so that both parts are non-empty.
    "fedrep": {"head": "^b$", "momentum": 0.9, "momentum_buffer": "persist"},
    "lg_fedavg": {"head": "^b$"},
    "fedrod": {"head": "^b$"},
    "fedbabu": {"head": "^b$", "momentum": 0.9, "momentum_buffer": "persist"},
    "fedprox": {"momentum": 0.9, "momentum_buffer": "persist"},
    "fedprox_ft": {"momentum": 0.9, "momentum_buffer": "persist"},
    "feddyn": {},
    "ditto": {"momentum": 0.5, "momentum_buffer": "persist"},
    "apfl": {},
    "perfedavg": {"variant": "hf", "momentum": 0.5, "momentum_buffer": "persist"},
}


# One subprocess per algorithm (JAX start-up, the loop and the sharded compile): the quick
# suite keeps three that cover the three state layouts (global model with per-client buffers,
# per-client models only, per-client models with an N×N matrix); the rest run with the slow ones.
QUICK = ("fedavg", "pfedsop", "pgfed")


@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(CASES)])
def test_sharded_state_on_two_devices_equals_the_loop(name):
    env = {**os.environ, "FEDJAX_PFL_CPU_DEVICES": "2"}
    env.pop("XLA_FLAGS", None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, name, json.dumps(CASES[name])],
                          capture_output=True, text=True, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if name not in ("fedavg_ft",):        # FedAvg-FT has no per-client state
        assert result["sharded_leaves"] >= 1


def test_every_registered_algorithm_is_covered():
    from fedjax_pfl import algorithms

    assert set(CASES) == set(algorithms.names())
