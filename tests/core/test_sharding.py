"""Client state split across several XLA devices gives the same results as the one-client loop,
for every registered algorithm (each with its declared `AlgorithmSpec.test_hparams`), with N and
M not divisible by the device count; each device evaluates the personal models it holds.

Runs in subprocesses because the device count is fixed when JAX starts.
"""

import json
import os
import subprocess
import sys
import textwrap

import helpers
import pytest

from fedjax_pfl import algorithms

SCRIPT = textwrap.dedent('''
    import json, sys, traceback
    sys.path.insert(0, "tests/support")
    import fedjax_pfl
    assert fedjax_pfl.use_cpu_cores(2) == 2
    import jax, numpy as np
    from fedjax_pfl import algorithms, core
    from helpers import linear_model, make_data
    assert len(jax.devices()) == 2
    data = make_data([7, 23, 12, 1, 9])          # N = 5 (padded to 6), M = 3 at 60 %


    def canonical(state):
        """PGFed keeps last round's uploads in the round's row order: sort them by client id.
        (Recognised by all three of its fields, not by `prev_idx` alone.)"""
        if not all(hasattr(state, f) for f in ("prev_idx", "prev_grads", "prev_b")):
            return state
        order = np.argsort(np.asarray(state.prev_idx))
        take = lambda t: jax.tree.map(lambda a: np.asarray(a)[order], t)
        return state._replace(prev_idx=take(state.prev_idx), prev_grads=take(state.prev_grads),
                              prev_b=take(state.prev_b))


    def check(name, hp):
        """Three rounds and an evaluation of `name` sharded on 2 devices against the loop;
        returns how many leaves were split across the devices, and how many leaves the state's
        declared per-client fields (CLIENT_FIELDS) hold."""
        keys = jax.random.key(3)
        results = {}
        for backend in ("loop", "chunked"):
            algo = algorithms.get(name, model=linear_model(), **{
                "participation": 0.6, "batch_size": 4, **hp, "backend": backend, "chunk_size": 2})
            mesh = core.client_mesh() if backend != "loop" else None
            d = core.prepare_data(data, mesh)
            program = core.Program(algo, d, mesh=mesh, jit=backend != "loop")
            state = program.init(jax.random.key(0))    # (FedPC's init runs on the host)
            for r in range(3):
                state, m = program.run_rounds(state, keys, r, 1)
            evals = program.evaluate(state)
            if name == "pgfed" and backend != "loop":
                # Each device evaluates the personal models it holds: the compiled evaluation
                # gathers no client's model rows from the other device (it all-gathered them).
                text = jax.jit(lambda s: program.algo.evaluate(s, d)).lower(state).compile().as_text()
                moved = [l for l in text.splitlines() if "all-gather(" in l and " f32[6," in l]
                assert not moved, moved
            results[backend] = (state, m[0], evals, d.num_clients)
        (ref, ref_m, ref_ev, n), (got, got_m, got_ev, n_pad) = results["loop"], results["chunked"]
        ref, got = canonical(ref), canonical(got)
        assert n == 5 and n_pad == 6
        sharded = 0
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
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
        declared = sum(len(jax.tree.leaves(getattr(got, field)))
                       for field in getattr(type(got), "CLIENT_FIELDS", ()))
        return sharded, declared


    report = {}
    for name in json.loads(sys.argv[1]):
        try:
            sharded, declared = check(name, dict(algorithms.spec(name).test_hparams))
            report[name] = {"sharded_leaves": sharded, "client_leaves": declared}
        except Exception:
            report[name] = {"error": traceback.format_exc()[-3000:]}
    print(json.dumps(report))
''')

# Every registered algorithm, with the test configuration it declares (`test_hparams`): a new
# algorithm is covered when it registers. One subprocess per group of algorithms (JAX starts
# once, and the loop's eager operations, shared by all, compile once). The quick suite keeps
# PGFed, the richest state layout (per-client models, momentum rows and an N×N matrix); the full
# suite adds the representative algorithms (helpers.REPRESENTATIVE), and `--extended` the rest in
# two groups that the two xdist workers share.
QUICK = ("pgfed",)
REPRESENTATIVE = tuple(sorted(set(helpers.REPRESENTATIVE) - set(QUICK)))
REST = sorted(set(algorithms.names()) - set(QUICK) - set(REPRESENTATIVE))
GROUPS = {"quick": QUICK, "representative": REPRESENTATIVE, "rest_a": tuple(REST[0::2]),
          "rest_b": tuple(REST[1::2])}
_MARKS = {"quick": (), "representative": pytest.mark.slow,
          "rest_a": (pytest.mark.slow, pytest.mark.extended),
          "rest_b": (pytest.mark.slow, pytest.mark.extended)}


@pytest.mark.matrix
@pytest.mark.parametrize("group", [pytest.param(g, marks=_MARKS[g]) for g in GROUPS])
def test_sharded_state_on_two_devices_equals_the_loop(group):
    env = {**os.environ, "FEDJAX_PFL_CPU_DEVICES": "2"}
    env["XLA_FLAGS"] = helpers.without_device_count(env.get("XLA_FLAGS", ""))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cases = list(GROUPS[group])
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)],
                          capture_output=True, text=True, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = {name: r["error"] for name, r in report.items() if "error" in r}
    assert not failed, "\n\n".join(f"{name}:\n{err}" for name, err in failed.items())
    assert set(report) == set(cases)
    for name, r in report.items():
        # A state that declares per-client leaves has them split over the devices (FedAvg-FT
        # without persistent momentum declares none: its optimizer rows are None).
        assert (r["sharded_leaves"] >= 1) == (r["client_leaves"] >= 1), (name, r)


def test_every_registered_algorithm_is_in_one_group():
    assert sorted(sum(GROUPS.values(), ())) == algorithms.names()
