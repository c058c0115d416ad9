"""pFedSOP through the real round_fn: docs/algorithms/pfedsop.md#tests, T18–T32 and T34."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_states_close, linear_model, states_per_backend, tree_equal

from fedjax_pfl import algorithms, core, ops
from fedjax_pfl.algorithms.pfedsop import ClientState
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.models.model import Model

# P_i(x) = ½‖x − c_i‖² with c_i the client's (single) training row: gradient x − c_i.
QUADRATIC = Model(init=lambda key: {"x": jnp.zeros(2)}, apply=lambda p, x: p["x"] - x,
                  loss=lambda out, y: 0.5 * jnp.sum(out**2, axis=-1))


def centres_data(centres, repeats=None):
    """Client i holds `repeats[i]` copies of centre c_i (full-batch gradient x − c_i)."""
    repeats = repeats or [1] * len(centres)
    rows, train = [], []
    for c, r in zip(centres, repeats):
        train.append(np.arange(len(rows), len(rows) + r))
        rows += [c] * r
    x = np.asarray(rows, np.float64)
    return FederatedData.from_arrays(x, np.zeros(len(rows)), train, train, num_classes=1)


def golden(keep="newton", **hp):
    # T28: d = 2, K = K' = 2, c₁ = [1,0], c₂ = [0,1], 𝒯 = 2 full-batch steps, η₂ = 0.5, η₁ = 1,
    # ρ = 1, λ = 1, x0 = [0,0].
    hp = dict(participation=1.0, local_epochs=2, batch_size=1, eta_local=0.5, eta_personal=1.0,
              rho=1.0, gompertz_lambda=1.0, keep=keep) | hp
    return algorithms.get("pfedsop", model=QUADRATIC, **hp), centres_data([[1, 0], [0, 1]])


def test_golden_two_client_example(x64):
    algo, data = golden()
    step = jax.jit(algo.round_fn)
    state = algo.init(jax.random.key(0), data)
    state, m1 = step(state, data, jax.random.key(1))
    # Round 1 (T29): both clients new, start at x0, Δ₁ = [−1.5, 0], Δ₂ = [0, −1.5].
    np.testing.assert_allclose(state.clients.delta["x"], [[-1.5, 0], [0, -1.5]], rtol=1e-12)
    np.testing.assert_allclose(state.delta_glob["x"], [-0.75, -0.75], rtol=1e-12)
    np.testing.assert_array_equal(state.clients.x["x"], np.zeros((2, 2)))     # R1: x stays x0
    assert int(m1["returning_clients"]) == 0 and np.isnan(m1["beta_mean"])
    state, m2 = step(state, data, jax.random.key(2))
    # Round 2 (T30–T32).
    assert float(m2["beta_mean"]) == pytest.approx(0.710432928, abs=1e-9)
    assert float(m2["angle_mean"]) == pytest.approx(0.785398163, abs=1e-9)
    np.testing.assert_allclose(state.clients.x["x"],
                               [[0.435796031, 0.240083558], [0.240083558, 0.435796031]], atol=1e-9)
    np.testing.assert_allclose(state.clients.delta["x"],
                               [[-0.846305953, 0.360125337], [0.360125337, -0.846305953]], atol=1e-9)
    np.testing.assert_allclose(state.delta_glob["x"], [-0.243090308, -0.243090308], atol=1e-9)


@pytest.mark.slow
def test_keep_sgd_persists_the_end_of_local_sgd(x64):
    # T27 (R2): the kept model is x − η₂Δ_i, the SGD end point; round 1 from x0 = 0 gives
    # z₁ = [0.75, 0] (two steps of 0.5 towards [1, 0]).
    algo, data = golden(keep="sgd")
    state = algo.init(jax.random.key(0), data)
    state, _ = jax.jit(algo.round_fn)(state, data, jax.random.key(1))
    np.testing.assert_allclose(state.clients.x["x"], [[0.75, 0], [0, 0.75]], rtol=1e-12)
    np.testing.assert_allclose(state.clients.x["x"], 0 - 0.5 * state.clients.delta["x"], rtol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("blend,beta", [("local", 0.0), ("global", 1.0)])
def test_blend_ablation(x64, blend, beta):
    # Round 2 of the golden setup with β fixed: Δᵖ = Δ_i (local) or Δ (global).
    algo, data = golden(blend=blend)
    state = algo.init(jax.random.key(0), data)
    step = jax.jit(algo.round_fn)
    state, _ = step(state, data, jax.random.key(1))
    delta_p = (1 - beta) * np.array([-1.5, 0.0]) + beta * np.array([-0.75, -0.75])
    expected_x1 = -1.0 * delta_p / (1.0 + delta_p @ delta_p)
    state, m = step(state, data, jax.random.key(2))
    assert float(m["beta_mean"]) == beta
    np.testing.assert_allclose(state.clients.x["x"][0], expected_x1, rtol=1e-12)


def test_local_pseudo_gradient_closed_form(x64):
    # T19: from x, 𝒯 full-batch steps give Δ = (1 − (1 − η₂)^𝒯)(x − c)/η₂ — the sum of the 𝒯
    # gradients (T18). Clients hold 3 and 1 copies of their centre: same full-batch gradient.
    data = centres_data([[2.0, -1.0], [0.5, 4.0]], repeats=[3, 1])
    algo = algorithms.get("pfedsop", model=QUADRATIC, participation=1.0, local_epochs=5,
                          batch_size=3, eta_local=0.2, eta_personal=0.0)
    state = algo.init(jax.random.key(0), data)
    state, _ = jax.jit(algo.round_fn)(state, data, jax.random.key(1))
    for i, c in enumerate([[2.0, -1.0], [0.5, 4.0]]):
        expected = (1 - 0.8**5) * (0 - np.array(c)) / 0.2
        np.testing.assert_allclose(state.clients.delta["x"][i], expected, rtol=1e-12)
    # T21: the server mean is unweighted (3 samples vs 1 sample count equally).
    np.testing.assert_allclose(state.delta_glob["x"], state.clients.delta["x"].mean(0), rtol=1e-12)


@pytest.mark.slow
def test_new_client_at_a_later_round_and_returning_client(x64):
    # T23–T24. Client 0 returns with its own (stale) Δ₀ and model; client 1 is new at round t > 1.
    data = centres_data([[1.0, 0.0], [0.0, 1.0]])
    algo = algorithms.get("pfedsop", model=QUADRATIC, participation=1.0, local_epochs=1,
                          batch_size=1, eta_local=0.5, eta_personal=1.0, keep="newton")
    state = algo.init(jax.random.key(0), data)
    x_old, d_old, d_glob = np.array([0.3, 0.1]), np.array([-0.4, 0.2]), np.array([0.1, -0.5])
    clients = ClientState(x={"x": jnp.asarray([x_old, [9.0, 9.0]])},
                          delta={"x": jnp.asarray([d_old, [7.0, 7.0]])},
                          is_new=jnp.array([False, True]))
    state = state._replace(clients=clients, delta_glob={"x": jnp.asarray(d_glob)},
                           round=jnp.asarray(5, jnp.int32))
    new, m = jax.jit(algo.round_fn)(state, data, jax.random.key(3))
    # Returning client: Newton step from its own x with its own Δ and the previous global Δ.
    phi = np.arccos(d_old @ d_glob / np.linalg.norm(d_old) / np.linalg.norm(d_glob))
    beta = 1 - np.exp(-np.exp(-(phi - 1)))
    delta_p = (1 - beta) * d_old + beta * d_glob
    x0 = x_old - delta_p / (1 + delta_p @ delta_p)
    np.testing.assert_allclose(new.clients.x["x"][0], x0, rtol=1e-12)
    np.testing.assert_allclose(new.clients.delta["x"][0], x0 - [1.0, 0.0], rtol=1e-12)
    # New client: starts from the shared initial model x0 = 0 (not its stored row), no Newton step.
    np.testing.assert_array_equal(new.clients.x["x"][1], [0.0, 0.0])
    np.testing.assert_allclose(new.clients.delta["x"][1], [0.0, -1.0], rtol=1e-12)
    assert int(m["returning_clients"]) == 1 and not bool(new.clients.is_new.any())
    # Each of the 2 participants sends its Δ_i and receives Δ: 2 floats each way per client.
    assert (float(m["comm_up_floats"]), float(m["comm_down_floats"])) == (4.0, 4.0)


@pytest.mark.slow
def test_unsampled_clients_are_bitwise_unchanged(ragged_data):
    algo = algorithms.get("pfedsop", model=linear_model(), participation=0.5)
    state = algo.init(jax.random.key(0), ragged_data)
    step = jax.jit(algo.round_fn)
    state, _ = step(state, ragged_data, jax.random.key(1))
    new, m = step(state, ragged_data, jax.random.key(2))
    sampled = set(np.asarray(m["sampled"]).tolist())
    assert len(sampled) == 2
    for i in set(range(4)) - sampled:
        tree_equal(jax.tree.map(lambda x: x[i], state.clients), jax.tree.map(lambda x: x[i], new.clients))


@pytest.mark.slow
def test_zero_personal_lr_keeps_every_model_at_x0(ragged_data):
    # T34: η₁ = 0 under R1: personalised models never move.
    algo = algorithms.get("pfedsop", model=linear_model(), participation=0.5, eta_personal=0.0,
                          keep="newton")
    state = algo.init(jax.random.key(0), ragged_data)
    step = jax.jit(algo.round_fn)
    for r in range(4):
        state, _ = step(state, ragged_data, jax.random.key(r))
    tree_equal(state.clients.x, core.broadcast(state.x0, 4))
    assert float(ops.tree_norm(state.delta_glob)) > 0


@pytest.mark.slow
@pytest.mark.parametrize("keep", [pytest.param("newton", marks=pytest.mark.slow), "sgd"])
def test_vmapped_equals_loop_backend(ragged_data, keep):
    runs = states_per_backend("pfedsop", ragged_data, model=linear_model(), participation=0.75,
                              keep=keep, chunk_size=2, local_epochs=2, batch_size=4)
    for backend in ("vmap", "chunked"):       # every field: clients, delta_glob, x0, round
        assert_states_close(runs[backend], runs["loop"])


def test_probe_must_be_plain_sgd():
    with pytest.raises(ValueError, match="--momentum must be 0"):
        algorithms.get("pfedsop", model=linear_model(), momentum=0.9)


def test_defaults_are_the_reading_that_trains():
    # keep="sgd" (R2) and η₁ = 1: the literal R1 with η₁ = --lr stays at chance on digits
    # (tests/runner/test_defaults_train.py); both remain options.
    hp = algorithms.get("pfedsop", model=linear_model(), lr=0.3).hparams
    assert (hp["keep"], hp["eta_personal"], hp["eta_local"], hp["rho"], hp["blend"]) == \
        ("sgd", 1.0, None, 1.0, "gompertz")
    assert algorithms.get("pfedsop", model=linear_model(), keep="newton").hparams["keep"] == "newton"
