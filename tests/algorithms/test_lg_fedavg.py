"""LG-FedAvg: its limits (everything global = FedAvg, nothing global = Local, bit for bit), the
swapped split equals FedPer, rounds against a NumPy float64 transcription, backends equal."""

import functools

import jax
import mlp_reference as ref
import numpy as np
import pytest
from helpers import make_data, make_raw, tree_allclose, tree_equal

from fedjax_pfl import algorithms, models
from fedjax_pfl.models import nets

MLP = models.from_flax(nets.MLP(3, hidden=(4,)), (5,))       # Dense_0 (body) → Dense_1 (head)
SIZES = [7, 23, 12, 9]
DATA = make_data(SIZES)
RAW = make_raw(SIZES)


@functools.lru_cache(maxsize=None)
def _run(name, backend, hp_items):
    algo = algorithms.get(name, model=MLP, backend=backend, lr=0.1, batch_size=4, participation=0.5,
                          **dict(hp_items))
    state = algo.init(jax.random.key(0), DATA)
    step = algo.round_fn if backend == "loop" else jax.jit(algo.round_fn)
    metrics = []
    for r in range(2):
        state, m = step(state, DATA, jax.random.key(r))
        metrics.append(m)
    return state, metrics, algo.evaluate(state, DATA)["client"]


def run(name, backend="vmap", **hp):
    return _run(name, backend, tuple(sorted(hp.items())))


@pytest.mark.slow
def test_everything_global_is_fedavg_bit_for_bit():
    s_lg, m_lg, e_lg = run("lg_fedavg", head="all")
    s_avg, m_avg, e_avg = run("fedavg")
    tree_equal(s_lg.body, s_avg.params)
    for a, b in zip(m_lg, m_avg):
        tree_equal(a, b)
    tree_equal(e_lg, e_avg)


@pytest.mark.slow
def test_nothing_global_is_local_bit_for_bit():
    s_lg, m_lg, e_lg = run("lg_fedavg", head="none")
    s_loc, _, e_loc = run("local")
    tree_equal(s_lg.heads, s_loc.params)
    assert all(float(m["comm_up_floats"]) == 0.0 for m in m_lg)
    tree_equal(e_lg, e_loc)


@pytest.mark.slow
def test_the_swapped_split_is_fedper():
    # Global layers = the body (Dense_0) leaves the head (Dense_1) local: FedPer's split.
    s_lg, m_lg, e_lg = run("lg_fedavg", head="^Dense_0/")
    s_per, m_per, e_per = run("fedper")
    tree_equal(s_lg, s_per)
    for a, b in zip(m_lg, m_per):
        tree_equal(a, b)
    tree_equal(e_lg, e_per)
    # The default split is the other one: the head is averaged, each client keeps its Dense_0.
    s_def, m_def, _ = run("lg_fedavg")
    assert s_def.body["Dense_0"]["kernel"] is None and s_def.heads["Dense_1"]["kernel"] is None
    head = 4 * 3 + 3
    assert float(m_def[0]["comm_up_floats"]) == 2 * head        # M = 2 clients send the head


def test_rounds_match_numpy_transcription(x64):
    algo = algorithms.get("lg_fedavg", model=ref.TWO_LAYER, lr=0.3, batch_size=32,
                          participation=0.5, local_epochs=2)
    state = algo.init(jax.random.key(0), DATA)
    p0 = ref.to_numpy(ref.TWO_LAYER.init(jax.random.key(0)))
    glob = {"Dense_1": p0["Dense_1"]}
    local = [{"Dense_0": p0["Dense_0"]} for _ in SIZES]
    for r in range(3):
        state, m = jax.jit(algo.round_fn)(state, DATA, jax.random.key(r))
        sampled = np.asarray(m["sampled"]).tolist()
        heads = []
        for i in sampled:                      # joint full-batch GD on (ℓ_i, θ_G), E = 2 steps
            p = local[i] | glob
            for _ in range(2):
                p = ref.axpy(-0.3, ref.ce_grad(p, *ref.client_xy(RAW, i)), p)
            local[i] = {"Dense_0": p["Dense_0"]}
            heads.append({"Dense_1": p["Dense_1"]})
        glob = ref.weighted_mean(heads, [SIZES[i] for i in sampled])
        tree_allclose(state.body["Dense_1"], glob["Dense_1"], rtol=1e-10, atol=1e-12)
        for i in range(len(SIZES)):
            tree_allclose(jax.tree.map(lambda a: a[i], state.heads["Dense_0"]), local[i]["Dense_0"],
                          rtol=1e-10, atol=1e-12)


@pytest.mark.slow      # the loop backend runs the round eagerly
def test_backends_agree():
    ref_state, _, ref_eval = run("lg_fedavg", "loop")
    for backend in ("vmap", "chunked"):
        extra = {"chunk_size": 1} if backend == "chunked" else {}
        state, _, ev = run("lg_fedavg", backend, **extra)
        tree_allclose(state, ref_state, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(ev.correct, ref_eval.correct)


def test_help_explains_the_flag():
    import run as cli

    text = " ".join(cli.build_parser().format_help().split())
    assert "--lg-fedavg-head" in text and "the GLOBAL layers, averaged by the server" in text
