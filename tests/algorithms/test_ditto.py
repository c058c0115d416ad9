"""Ditto: the global model is FedAvg's bit for bit, λ → ∞ pins the personal model to the received
global model, the personal update against a NumPy transcription, backends equal, --help."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import linear_model, make_data, tree_allclose, tree_equal

from fedjax_pfl import algorithms
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.models.model import Model

QUADRATIC = Model(init=lambda key: {"w": jnp.array([0.5, -1.0])}, apply=lambda p, x: p["w"] - x,
                  loss=lambda out, y: 0.5 * jnp.sum(out**2, axis=-1))
DATA = make_data([7, 23, 12, 9])
MEANS = (np.array([2.0, 0.0]), np.array([0.0, 3.0]))


def quadratic_data():
    # Client A trains on [1,0], [3,0] (mean [2,0]); client B on [0,3], [0,6], [0,0] (mean [0,3]).
    x = np.array([[1, 0], [3, 0], [0, 3], [0, 6], [0, 0], [9, 9], [9, 9], [9, 9]], np.float64)
    return FederatedData.from_arrays(x, np.zeros(8), [np.array([0, 1]), np.array([2, 3, 4])],
                                     [np.array([5]), np.array([6, 7])], num_classes=1)


def _rounds(name, rounds=2, data=DATA, backend="vmap", **hp):
    algo = algorithms.get(name, model=linear_model(), backend=backend, chunk_size=2, lr=0.1,
                          batch_size=4, local_epochs=2, participation=0.5, **hp)
    step = algo.round_fn if backend == "loop" else jax.jit(algo.round_fn)
    state, metrics = algo.init(jax.random.key(0), data), []
    for r in range(rounds):
        state, m = step(state, data, jax.random.key(r))
        metrics.append(m)
    return state, metrics, algo.evaluate(state, data)


@pytest.mark.slow
def test_global_model_is_fedavg_bit_for_bit():
    s_dit, m_dit, e_dit = _rounds("ditto", lam=0.5)
    s_avg, m_avg, e_avg = _rounds("fedavg")
    tree_equal(s_dit.params, s_avg.params)
    for a, b in zip(m_dit, m_avg):
        np.testing.assert_array_equal(a["sampled"], b["sampled"])
        np.testing.assert_array_equal(a["train_loss"], b["train_loss"])
    tree_equal(e_dit["global"], e_avg["client"])
    assert not np.allclose(e_dit["client"].loss_sum, e_dit["global"].loss_sum)


@pytest.mark.parametrize("prox_step", ["explicit", pytest.param("implicit", marks=pytest.mark.slow)])
def test_personal_update_against_numpy(x64, prox_step):
    lr, lam, epochs = 0.3, 0.7, 2
    algo = algorithms.get("ditto", model=QUADRATIC, lam=lam, prox_step=prox_step, lr=lr,
                          batch_size=8, local_epochs=epochs, participation=1.0)
    data = quadratic_data()
    state = algo.init(jax.random.key(0), data)
    w = np.array([0.5, -1.0])
    v = [w.copy(), w.copy()]
    for r in range(2):
        state, _ = jax.jit(algo.round_fn)(state, data, jax.random.key(r))
        ends = []
        for k, mean in enumerate(MEANS):                 # full batches: ∇F_k(u) = u − x̄_k
            wk = w.copy()
            for _ in range(epochs):
                wk = wk - lr * (wk - mean)
                if prox_step == "explicit":              # v − η(∇F + λ(v − w^t))
                    v[k] = v[k] - lr * ((v[k] - mean) + lam * (v[k] - w))
                else:                                    # (v − η∇F + ηλ w^t) / (1 + ηλ)
                    v[k] = (v[k] - lr * (v[k] - mean) + lr * lam * w) / (1 + lr * lam)
            ends.append(wk)
        w = (2 * ends[0] + 3 * ends[1]) / 5
        np.testing.assert_allclose(state.params["w"], w, rtol=1e-12)
        np.testing.assert_allclose(state.personal["w"], np.stack(v), rtol=1e-12)


@pytest.mark.slow
def test_huge_lambda_keeps_the_personal_model_at_the_received_global(x64):
    algo = algorithms.get("ditto", model=linear_model(), lam=1e12, prox_step="implicit", lr=0.1,
                          batch_size=4, local_epochs=2, participation=1.0)
    state = algo.init(jax.random.key(0), DATA)
    step = jax.jit(algo.round_fn)
    state, _ = step(state, DATA, jax.random.key(0))
    received = state.params                                        # w^1, the anchor of round 2
    assert not np.allclose(received["w"], state.personal["w"][0])  # v_k is still at w^0
    state, _ = step(state, DATA, jax.random.key(1))
    for k in range(4):
        tree_allclose(jax.tree.map(lambda x: x[k], state.personal), received, rtol=0, atol=1e-9)
    # With λ = 0 the personal model is the client's own local training instead.
    free = algorithms.get("ditto", model=linear_model(), lam=0.0, lr=0.1, batch_size=4,
                          local_epochs=2, participation=1.0)
    s0 = free.init(jax.random.key(0), DATA)
    s0, _ = jax.jit(free.round_fn)(s0, DATA, jax.random.key(0))
    assert np.abs(np.asarray(s0.personal["w"]) - np.asarray(s0.params["w"])).max() > 1e-2


@pytest.mark.slow      # the loop backend runs rounds eagerly
def test_vmapped_and_chunked_equal_loop_backend(ragged_data):
    hp = dict(lam=0.5, momentum=0.5, momentum_buffer="persist")
    ref, _, ref_eval = _rounds("ditto", data=ragged_data, backend="loop", **hp)
    for backend in ("vmap", "chunked"):
        state, _, ev = _rounds("ditto", data=ragged_data, backend=backend, **hp)
        tree_allclose(state, ref, rtol=2e-5, atol=1e-6)
        for key in ref_eval:
            np.testing.assert_allclose(ev[key].correct, ref_eval[key].correct)


@pytest.mark.slow
def test_evaluate_honours_ids_and_cli_help():
    state, _, full = _rounds("ditto", rounds=1, lam=0.5)
    algo = algorithms.get("ditto", model=linear_model(), lam=0.5)
    sub = algo.evaluate(state, DATA, jnp.array([3, 0], jnp.int32))
    for key in ("client", "global"):
        np.testing.assert_allclose(sub[key].loss_sum, np.asarray(full[key].loss_sum)[[3, 0]], rtol=1e-6)
    import run as cli

    text = " ".join(cli.build_parser().format_help().split())
    assert "--ditto-lam FLOAT λ, strength of the personal models' pull" in text
    assert "--ditto-prox-step {explicit,implicit} how the personal step treats" in text
