"""APFL: the α and v gradients against their closed forms (NumPy softmax regression), two rounds
against a NumPy transcription, α kept in [0, 1], the mixed model evaluated, backends equal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import linear_model, make_data, tree_allclose

from fedjax_pfl import algorithms, core
from fedjax_pfl.algorithms import apfl
from fedjax_pfl.core.local import masked_mean_loss
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.models.model import Model

QUADRATIC = Model(init=lambda key: {"w": jnp.array([0.5, -1.0])}, apply=lambda p, x: p["w"] - x,
                  loss=lambda out, y: 0.5 * jnp.sum(out**2, axis=-1))
DATA = make_data([7, 23, 12, 9])


def softmax_regression_grad(params, x, y):
    """NumPy ∇ of the mean softmax cross-entropy of x @ W + b (float64)."""
    logits = x @ params["w"] + params["b"]
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return {"w": x.T @ p / len(y), "b": p.mean(axis=0)}


@pytest.mark.slow
def test_mixed_gradients_match_the_closed_form(x64):
    # ∂f(αv + (1−α)w)/∂α = ⟨∇f(v̄), v − w⟩ and ∇_v f(v̄) = α ∇f(v̄).
    rng = np.random.default_rng(0)
    w = {"w": rng.normal(size=(5, 3)), "b": rng.normal(size=3)}
    v = {"w": rng.normal(size=(5, 3)), "b": rng.normal(size=3)}
    x, y = rng.normal(size=(6, 5)), rng.integers(0, 3, 6)
    alpha = 0.3
    loss_fn = lambda p: masked_mean_loss(linear_model(), p, jnp.asarray(x), jnp.asarray(y),
                                         jnp.ones(6, bool))
    _, (g_v, g_a) = apfl.mixed_gradients(loss_fn, jax.tree.map(jnp.asarray, w),
                                         jax.tree.map(jnp.asarray, v), jnp.asarray(alpha))
    mix = {k: alpha * v[k] + (1 - alpha) * w[k] for k in w}
    g_mix = softmax_regression_grad(mix, x, y)
    expected_a = sum(np.vdot(g_mix[k], v[k] - w[k]) for k in w)
    np.testing.assert_allclose(g_a, expected_a, rtol=1e-10)
    for k in w:
        np.testing.assert_allclose(g_v[k], alpha * g_mix[k], rtol=1e-10)


def quadratic_data():
    x = np.array([[1, 0], [3, 0], [0, 3], [0, 6], [0, 0], [9, 9], [9, 9], [9, 9]], np.float64)
    return FederatedData.from_arrays(x, np.zeros(8), [np.array([0, 1]), np.array([2, 3, 4])],
                                     [np.array([5]), np.array([6, 7])], num_classes=1)


@pytest.mark.slow
def test_two_rounds_against_numpy(x64):
    lr, alpha_lr, epochs = 0.3, 0.2, 2
    algo = algorithms.get("apfl", model=QUADRATIC, alpha=0.4, alpha_lr=alpha_lr, lr=lr,
                          batch_size=8, local_epochs=epochs, participation=1.0)
    data = quadratic_data()
    state = algo.init(jax.random.key(0), data)
    w = np.array([0.5, -1.0])
    v, a = [w.copy(), w.copy()], [0.4, 0.4]
    for r in range(2):
        state, m = jax.jit(algo.round_fn)(state, data, jax.random.key(r))
        ends = []
        for k, mean in enumerate((np.array([2.0, 0.0]), np.array([0.0, 3.0]))):
            wk = w.copy()
            for _ in range(epochs):                       # full batch: ∇f(u) = u − x̄_k
                g_mix = a[k] * v[k] + (1 - a[k]) * wk - mean
                grad_a = np.dot(g_mix, v[k] - wk)
                wk, v[k] = wk - lr * (wk - mean), v[k] - lr * a[k] * g_mix
                a[k] = min(max(a[k] - alpha_lr * grad_a, 0.0), 1.0)
            ends.append(wk)
        w = (2 * ends[0] + 3 * ends[1]) / 5
        np.testing.assert_allclose(state.params["w"], w, rtol=1e-12)
        np.testing.assert_allclose(state.local["w"], np.stack(v), rtol=1e-12)
        np.testing.assert_allclose(state.alpha, a, rtol=1e-12)
    assert abs(a[0] - 0.4) > 1e-3 and abs(a[1] - 0.4) > 1e-3        # α really moved
    # The evaluated model is α_k v_k + (1 − α_k) w with the current global w.
    ev = algo.evaluate(state, data)["client"]
    mixed = np.stack([a[k] * v[k] + (1 - a[k]) * w for k in range(2)])   # test rows: all [9, 9]
    expected = [0.5 * np.sum((mixed[0] - 9) ** 2), 2 * 0.5 * np.sum((mixed[1] - 9) ** 2)]
    np.testing.assert_allclose(ev.loss_sum, expected, rtol=1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("alpha_lr", [0.0, 50.0])
def test_alpha_stays_in_the_unit_interval(alpha_lr):
    algo = algorithms.get("apfl", model=linear_model(), alpha=0.5, alpha_lr=alpha_lr, lr=0.1,
                          batch_size=4, participation=1.0)
    state = algo.init(jax.random.key(0), DATA)
    for r in range(3):
        state, m = jax.jit(algo.round_fn)(state, DATA, jax.random.key(r))
    alpha = np.asarray(state.alpha)
    assert np.all((alpha >= 0) & (alpha <= 1))
    if alpha_lr == 0:
        np.testing.assert_array_equal(alpha, 0.5)                 # fixed α (the PGFed code)
    else:
        assert np.any((alpha == 0) | (alpha == 1))                # the projection was active
    np.testing.assert_allclose(m["alpha_mean"], alpha.mean(), rtol=1e-6)


def _rounds(backend, data):
    algo = algorithms.get("apfl", model=linear_model(), backend=backend, chunk_size=2, lr=0.1,
                          batch_size=4, local_epochs=2, participation=0.5, alpha_lr=0.5,
                          momentum=0.5, momentum_buffer="persist")
    step = algo.round_fn if backend == "loop" else jax.jit(algo.round_fn)
    state = algo.init(jax.random.key(0), data)
    for r in range(3):
        state, _ = step(state, data, jax.random.key(r))
    return state, algo, algo.evaluate(state, data)


@pytest.mark.slow      # the loop backend runs rounds eagerly
def test_vmapped_and_chunked_equal_loop_backend(ragged_data):
    ref, _, ref_eval = _rounds("loop", ragged_data)
    for backend in ("vmap", "chunked"):
        state, algo, ev = _rounds(backend, ragged_data)
        tree_allclose(state, ref, rtol=2e-5, atol=1e-6)
        for key in ref_eval:
            np.testing.assert_allclose(ev[key].correct, ref_eval[key].correct)
    # evaluate(ids) is the mixed model of those clients only.
    ids = jnp.array([3, 1], jnp.int32)
    sub = algo.evaluate(state, ragged_data, ids)["client"]
    mixed = jax.tree.map(lambda v, w: state.alpha[ids].reshape((-1,) + (1,) * w.ndim) * v[ids]
                         + (1 - state.alpha[ids].reshape((-1,) + (1,) * w.ndim)) * w,
                         state.local, state.params)
    expected = core.Evaluator(linear_model(), batch_size=8, mapper=core.client_mapper("loop"))
    np.testing.assert_allclose(sub.loss_sum, expected.rows(ragged_data, mixed, ids).loss_sum,
                               rtol=1e-5)


def test_cli_help_explains_the_flags():
    import run as cli

    text = " ".join(cli.build_parser().format_help().split())
    assert "--apfl-alpha FLOAT initial mixing weight α_k" in text
    assert "--apfl-alpha-lr FLOAT η_α, step size of the projected SGD on α_k" in text
