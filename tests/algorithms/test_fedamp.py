"""FedAMP (fedjax_pfl/algorithms/fedamp.py; docs/algorithms/fedamp.md#tests) against a naive float64
transcription of its round, one client and one pair of clients at a time, on quadratic clients
whose full-batch gradient steps can be written out by hand."""

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_states_close, linear_model, tree_equal

from fedjax_pfl import algorithms
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.models.model import Model

THETA0 = np.array([0.5, -0.2, 0.1])
# f_i(w) = mean_k ½‖w − x_k‖² over client i's samples: gradient w − mean(x).
QUADRATIC = Model(init=lambda key: {"x": jnp.asarray(THETA0)}, apply=lambda p, x: p["x"] - x,
                  loss=lambda out, y: 0.5 * jnp.sum(out**2, axis=-1))
# A loss that is identically 0: local training moves w only by the proximal term.
ZERO_LOSS = QUADRATIC._replace(loss=lambda out, y: 0.0 * jnp.sum(out**2, axis=-1))
SIZES = [3, 5, 2, 4, 6]


def quadratic_clients(seed=0, identical=False):
    rng = np.random.default_rng(seed)
    if identical:
        x = rng.normal(size=(4, 3))
        xs = [x] * len(SIZES)
    else:
        xs = [rng.normal(size=(n, 3)) + rng.normal(size=3) * 2 for n in SIZES]
    sizes = [len(x) for x in xs]
    starts = np.cumsum([0] + sizes)
    train = [np.arange(a, b) for a, b in zip(starts[:-1], starts[1:])]
    return FederatedData.from_arrays(np.concatenate(xs), np.zeros(starts[-1]), train, train,
                                     num_classes=1), xs


def naive_cloud_models(w, sampled, *, alpha, sigma, self_weight):
    """{i: (ξ_i· over sampled, u_i)} for i ∈ S, one pair at a time in float64 (the paper's ξ, or the
    normalised one with a self weight)."""
    out = {}
    for i in sampled:
        a = {j: np.exp(-np.sum((w[i] - w[j]) ** 2) / sigma) / sigma for j in sampled if j != i}
        if self_weight is None:
            xi = {j: alpha * a[j] for j in a}
            xi[i] = 1.0 - sum(xi.values())
        else:
            xi = {j: (1 - self_weight) * a[j] / sum(a.values()) for j in a}
            xi[i] = self_weight
        out[i] = (xi, sum(xi[j] * w[j] for j in sampled))
    return out


def reference_rounds(xs, sampled_per_round, *, alpha, sigma, lam, eta, epochs, self_weight, start):
    """The paper's round (docs/algorithms/fedamp.md#round) literally, in float64, with full batches
    (B ≥ n_i: one gradient step of all n_i samples per epoch, so batch order cannot matter)."""
    w = [THETA0.copy() for _ in xs]
    history = []
    for sampled in sampled_per_round:
        clouds = naive_cloud_models(w, sampled, alpha=alpha, sigma=sigma, self_weight=self_weight)
        new = {}
        for i in sampled:
            u = clouds[i][1]
            th = u.copy() if start == "cloud" else w[i].copy()
            for _ in range(epochs):
                th = th - eta * ((th - xs[i].mean(0)) + lam / alpha * (th - u))
            new[i] = th
        for i, th in new.items():
            w[i] = th
        history.append((np.array(w), clouds))
    return history


HP = dict(participation=0.6, local_epochs=2, batch_size=8, lr=0.1, alpha=0.2, sigma=0.5, lam=0.1)


@pytest.mark.parametrize("self_weight,start", [(None, "cloud"), (0.3, "own")])
@pytest.mark.slow
def test_rounds_match_the_naive_transcription(x64, self_weight, start):
    # T1–T3, T5: distances, weights, cloud models, proximal local training, unsampled clients.
    data, xs = quadratic_clients()
    hp = dict(HP, start=start) | ({} if self_weight is None else {"self_weight": self_weight})
    algo = algorithms.get("fedamp", model=QUADRATIC, **hp)
    step = jax.jit(algo.round_fn)
    state = algo.init(jax.random.key(0), data)
    states, sampled, metrics = [], [], []
    for r in range(4):
        new, m = step(state, data, jax.random.key(r))
        s = np.asarray(m["sampled"]).tolist()
        assert len(s) == 3                                       # M = ⌊0.6 · 5⌋
        for i in set(range(5)) - set(s):                         # T5: unsampled rows untouched
            tree_equal(jax.tree.map(lambda x: x[i], state.params),
                       jax.tree.map(lambda x: x[i], new.params))
        state = new
        states.append(state), sampled.append(s), metrics.append(m)
    ref = reference_rounds(xs, sampled, eta=0.1, epochs=2, self_weight=self_weight, start=start,
                           alpha=0.2, sigma=0.5, lam=0.1)
    nontrivial = False
    for state, m, s, (w, clouds) in zip(states, metrics, sampled, ref):
        np.testing.assert_allclose(state.params["x"], w, rtol=1e-10, atol=1e-12)
        xi = np.array([[clouds[i][0][j] for j in s] for i in s])
        np.testing.assert_allclose(m["xi_self_mean"], np.mean(np.diag(xi)), rtol=1e-10)
        np.testing.assert_allclose(m["xi_self_min"], np.min(np.diag(xi)), rtol=1e-10)
        off = ~np.eye(3, dtype=bool)
        np.testing.assert_allclose(m["xi_other_mean"], xi[off].mean(), rtol=1e-10)
        np.testing.assert_allclose(m["xi_other_max"], xi[off].max(), rtol=1e-10)
        np.testing.assert_allclose(xi.sum(axis=1), 1.0, rtol=1e-12)           # T2
        assert np.all(xi >= 0)                                                # α ≤ σ/(M−1)
        nontrivial |= bool(np.ptp(xi[off]) > 0.01)
    assert nontrivial                  # the attention did discriminate between clients somewhere


def test_proximal_gradient_is_lambda_over_alpha_times_w_minus_u(x64):
    # T4: with a zero loss, one SGD step from w_i (--fedamp-start own) moves w_i by exactly
    # −η ∇_w (λ/(2α))‖w − u_i‖² = −η (λ/α)(w_i − u_i), u_i the naive cloud model.
    data, _ = quadratic_clients()
    alpha, sigma, lam, eta = 1.0, 5.0, 0.3, 0.05
    algo = algorithms.get("fedamp", model=ZERO_LOSS, participation=1.0, local_steps=1,
                          batch_size=8, lr=eta, alpha=alpha, sigma=sigma, lam=lam, start="own")
    state = algo.init(jax.random.key(0), data)
    w = np.random.default_rng(1).normal(size=(5, 3))
    state = state._replace(params={"x": jnp.asarray(w)})
    new, _ = jax.jit(algo.round_fn)(state, data, jax.random.key(0))
    clouds = naive_cloud_models(list(w), list(range(5)), alpha=alpha, sigma=sigma, self_weight=None)
    for i in range(5):
        u = clouds[i][1]
        prox = jax.grad(lambda v: lam / (2 * alpha) * jnp.sum((v - u) ** 2))(jnp.asarray(w[i]))
        np.testing.assert_allclose(prox, lam / alpha * (w[i] - u), rtol=1e-12)
        np.testing.assert_allclose(new.params["x"][i], w[i] - eta * prox, rtol=1e-12)
        assert np.linalg.norm(w[i] - u) > 0.1                # the pull is not trivially zero


def test_identical_clients_mix_uniformly_and_train_as_prox_sgd(x64):
    # T6: identical data and full participation keep every w_i equal: D = 0, so with α = σ/M the
    # mixture is uniform, u_i = w, and a round is each client's full-batch prox SGD from w
    # (whose pull then vanishes at the first step and acts from the second on).
    data, xs = quadratic_clients(identical=True)
    sigma, lam, eta = 0.8, 0.2, 0.1
    alpha = sigma / 5
    algo = algorithms.get("fedamp", model=QUADRATIC, participation=1.0, local_epochs=3,
                          batch_size=8, lr=eta, alpha=alpha, sigma=sigma, lam=lam)
    step = jax.jit(algo.round_fn)
    state = algo.init(jax.random.key(0), data)
    w, mean = THETA0.copy(), xs[0].mean(0)
    for r in range(3):
        state, m = step(state, data, jax.random.key(r))
        np.testing.assert_allclose([m["xi_self_mean"], m["xi_other_mean"], m["xi_other_max"]],
                                   0.2, rtol=1e-12)
        assert float(m["sq_dist_mean"]) < 1e-25     # equal up to the rounding of batch order
        u, th = w.copy(), w.copy()
        for _ in range(3):
            th = th - eta * ((th - mean) + lam / alpha * (th - u))
        w = th
        np.testing.assert_allclose(state.params["x"], np.tile(w, (5, 1)), rtol=1e-12)


@pytest.mark.slow      # the loop backend runs rounds eagerly (a consistency check)
def test_loop_backend_equals_chunked(ragged_data):
    # T7: ragged clients (7, 23, 12, 1 samples), persistent momentum rows, chunks of 2.
    states = helpers.states_per_backend(
        "fedamp", ragged_data, backends=("loop", "chunked"), model=linear_model(),
        participation=0.75, local_epochs=2, batch_size=4, chunk_size=2, momentum=0.5,
        momentum_buffer="persist", alpha=0.1, sigma=0.5, self_weight=0.4)
    assert_states_close(states["chunked"], states["loop"])


def test_flags_are_validated():
    with pytest.raises(ValueError, match="--fedamp-self-weight must be in"):
        algorithms.get("fedamp", model=linear_model(), self_weight=1.5)
    with pytest.raises(ValueError, match="--fedamp-start must be one of"):
        algorithms.get("fedamp", model=linear_model(), start="global")
    with pytest.raises(ValueError, match="--fedamp-sigma must be > 0"):
        algorithms.get("fedamp", model=linear_model(), sigma=0.0)
    hp = algorithms.get("fedamp", model=linear_model()).hparams
    assert (hp["participation"], hp["alpha"], hp["sigma"], hp["lam"], hp["self_weight"],
            hp["start"]) == (1.0, 0.05, 1.0, 0.005, None, "cloud")
