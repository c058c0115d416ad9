"""FedPer: its two limits (no head = FedAvg, all head = Local), round 1 against FedAvg and Local,
unsampled heads untouched, backends equal, compile once."""

import functools

import chex
import jax
import numpy as np
import pytest
from helpers import make_data, tree_allclose, tree_equal

from fedjax_pfl import algorithms, models
from fedjax_pfl.models import nets

MLP = models.from_flax(nets.MLP(3, hidden=(4,)), (5,))       # Dense_0 (body) → Dense_1 (head)


@pytest.fixture
def data():
    return DATA


DATA = make_data([7, 23, 12, 9])


@functools.lru_cache(maxsize=None)
def _run(name, backend, hp_items):
    algo = algorithms.get(name, model=MLP, backend=backend, lr=0.1, batch_size=4, participation=0.5,
                          **dict(hp_items))
    state = algo.init(jax.random.key(0), DATA)
    chex.clear_trace_counter()        # chex identifies functions by source and call site
    step = algo.round_fn if backend == "loop" else jax.jit(chex.assert_max_traces(algo.round_fn, n=1))
    states, metrics = [], []
    for r in range(2):
        state, m = step(state, DATA, jax.random.key(r))
        states.append(state)
        metrics.append(m)
    return states, metrics, algo.evaluate(state, DATA)["client"], algo


def run(name, data, rounds=2, backend="vmap", **hp):
    """(None, state after `rounds` rounds, metrics of every round, final evaluation); cached."""
    assert data is DATA
    states, metrics, ev, _ = _run(name, backend, tuple(sorted(hp.items())))
    return None, states[rounds - 1], metrics[:rounds], ev


@pytest.mark.slow
def test_no_head_is_fedavg_bit_for_bit(data):
    _, s_per, m_per, e_per = run("fedper", data, head="none")
    _, s_avg, m_avg, e_avg = run("fedavg", data)
    tree_equal(s_per.body, s_avg.params)
    for a, b in zip(m_per, m_avg):
        tree_equal(a, b)
    tree_equal(e_per, e_avg)


@pytest.mark.slow
def test_all_head_is_local_bit_for_bit(data):
    _, s_per, m_per, e_per = run("fedper", data, head="all")
    _, s_loc, m_loc, e_loc = run("local", data)
    tree_equal(s_per.heads, s_loc.params)
    for a, b in zip(m_per, m_loc):
        tree_equal({k: a[k] for k in b}, b)
        assert float(a["comm_up_floats"]) == 0.0          # nothing is shared
    tree_equal(e_per, e_loc)


@pytest.mark.slow      # three algorithms compile
def test_round_one_averages_the_body_and_keeps_each_head(data):
    # In round 1 every client starts from θ0, as in FedAvg and Local with the same keys: the body
    # is FedAvg's weighted mean of the body, each sampled head is Local's trained head.
    _, s_per, m_per, _ = run("fedper", data, rounds=1)
    _, s_avg, _, _ = run("fedavg", data, rounds=1)
    _, s_loc, _, _ = run("local", data, rounds=1)
    tree_allclose(s_per.body["Dense_0"], s_avg.params["Dense_0"], rtol=1e-6, atol=1e-7)
    assert s_per.body["Dense_1"]["kernel"] is None
    sampled = np.asarray(m_per[0]["sampled"])
    theta0 = algorithms.get("fedper", model=MLP).init(jax.random.key(0), data).heads
    for i in range(4):
        mine = jax.tree.map(lambda x: x[i], s_per.heads["Dense_1"])
        if i in sampled:
            tree_allclose(mine, jax.tree.map(lambda x: x[i], s_loc.params["Dense_1"]), rtol=1e-6, atol=1e-7)
        else:
            tree_equal(mine, jax.tree.map(lambda x: x[i], theta0["Dense_1"]))


@pytest.mark.slow      # the loop backend runs the round eagerly
def test_backends_agree_and_round_fn_compiles_once(data):
    # Every jitted run above and here traces round_fn once (chex.assert_max_traces in _run).
    _, ref, _, ref_eval = run("fedper", data, backend="loop")
    for backend in ("vmap", "chunked"):
        extra = {"chunk_size": 1} if backend == "chunked" else {}          # really chunked
        _, state, _, ev = run("fedper", data, backend=backend, **extra)
        tree_allclose(state, ref, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(ev.correct, ref_eval.correct)


def test_bad_head_pattern():
    with pytest.raises(ValueError, match="--fedper-head must be 'head', 'all', 'none' or a regex"):
        algorithms.get("fedper", model=MLP, head="Dense_(")
    with pytest.raises(ValueError, match="matches no parameter"):
        algorithms.get("fedper", model=MLP, head="Conv")
