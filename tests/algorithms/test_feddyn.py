"""FedDyn: two rounds against a NumPy float64 transcription of Algorithm 1 (server model, h-state,
per-client correction), backends equal, the flag in --help."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import linear_model, tree_allclose

from fedjax_pfl import algorithms
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.models.model import Model

# Linear regression ŷ = x·w + b, per-example loss ½(ŷ − y)².
REGRESSION = Model(init=lambda key: {"w": 0.1 * jax.random.normal(key, (3,)), "b": jnp.zeros(())},
                   apply=lambda p, x: x @ p["w"] + p["b"], loss=lambda out, y: 0.5 * (out - y) ** 2)
SIZES = [3, 5, 2, 4]


def regression_data():
    rng = np.random.default_rng(1)
    n = sum(SIZES) + 4
    x, y = rng.normal(size=(n, 3)), rng.integers(0, 4, n)      # labels are stored as int32
    train, test, start = [], [], 0
    for s in SIZES:
        train.append(np.arange(start, start + s))
        test.append(np.array([n - 1]))
        start += s
    return FederatedData.from_arrays(x, y, train, test, num_classes=4), x, y, train


def numpy_grad(w, b, x, y):
    """∇ of the mean of ½(x·w + b − y)² (float64)."""
    r = x @ w + b - y
    return x.T @ r / len(y), np.mean(r)


def test_two_rounds_against_numpy_transcription(x64):
    alpha, lr, epochs = 0.3, 0.2, 3
    data, x, y, train = regression_data()
    algo = algorithms.get("feddyn", model=REGRESSION, alpha=alpha, lr=lr, batch_size=8,
                          local_epochs=epochs, participation=0.5)
    state = algo.init(jax.random.key(0), data)
    th_w, th_b = np.asarray(state.params["w"]), float(state.params["b"])
    h_w, h_b = np.zeros(3), 0.0
    g = {k: (np.zeros(3), 0.0) for k in range(4)}                  # ∇L_k(θ_k^0) = 0
    for r in range(2):
        state, metrics = jax.jit(algo.round_fn)(state, data, jax.random.key(r))
        sampled = np.asarray(metrics["sampled"])
        assert len(sampled) == 2
        ends = []
        for k in sampled:                                           # full batches (B ≥ n_k)
            w, b = th_w.copy(), th_b
            for _ in range(epochs):                                 # ∇L − g_k + α(θ − θ^{t−1})
                gw, gb = numpy_grad(w, b, x[train[k]], y[train[k]])
                w, b = (w - lr * (gw - g[k][0] + alpha * (w - th_w)),
                        b - lr * (gb - g[k][1] + alpha * (b - th_b)))
            g[k] = (g[k][0] - alpha * (w - th_w), g[k][1] - alpha * (b - th_b))   # line 6
            ends.append((w, b))
        h_w = h_w - alpha / 4 * sum(w - th_w for w, _ in ends)     # line 9, m = N = 4
        h_b = h_b - alpha / 4 * sum(b - th_b for _, b in ends)
        th_w = np.mean([w for w, _ in ends], axis=0) - h_w / alpha  # line 10
        th_b = np.mean([b for _, b in ends]) - h_b / alpha
        np.testing.assert_allclose(state.params["w"], th_w, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(state.params["b"], th_b, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(state.h["w"], h_w, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(state.h["b"], h_b, rtol=1e-10, atol=1e-12)
        for k in range(4):
            np.testing.assert_allclose(state.grad_corr["w"][k], g[k][0], rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(state.grad_corr["b"][k], g[k][1], rtol=1e-10, atol=1e-12)
    assert np.abs(h_w).max() > 1e-3                   # the h-state and corrections are exercised


def _rounds(backend, data):
    algo = algorithms.get("feddyn", model=linear_model(), backend=backend, chunk_size=2, lr=0.1,
                          batch_size=4, local_epochs=2, participation=0.5, alpha=0.1, momentum=0.5,
                          momentum_buffer="persist")
    step = algo.round_fn if backend == "loop" else jax.jit(algo.round_fn)
    state = algo.init(jax.random.key(0), data)
    for r in range(3):
        state, _ = step(state, data, jax.random.key(r))
    return state, algo.evaluate(state, data), algo.evaluate(state, data, jnp.array([2, 0]))


@pytest.mark.slow      # the loop backend runs rounds eagerly
def test_vmapped_and_chunked_equal_loop_backend(ragged_data):
    ref, ref_eval, _ = _rounds("loop", ragged_data)
    for backend in ("vmap", "chunked"):
        state, ev, sub = _rounds(backend, ragged_data)
        tree_allclose(state, ref, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(ev["client"].correct, ref_eval["client"].correct)
        np.testing.assert_allclose(sub["client"].correct, np.asarray(ev["client"].correct)[[2, 0]])


def test_cli_help_explains_the_flag():
    import run as cli

    text = " ".join(cli.build_parser().format_help().split())
    assert "--feddyn-alpha FLOAT α, FedDyn's regulariser" in text
    with pytest.raises(ValueError, match="--feddyn-alpha must be > 0"):
        algorithms.get("feddyn", model=linear_model(), alpha=0.0)
