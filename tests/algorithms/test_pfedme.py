"""pFedMe's server mean (docs/algorithms/pfedme.md#a3): the authors' data-size weights by default,
the paper's uniform mean with --pfedme-weights uniform; both against a NumPy float64
transcription of one round (every client's K inner steps and local update, then the mean of the
sampled clients' local models)."""

import jax
import numpy as np
import pytest
from helpers import linear_model, make_data, make_raw

from fedjax_pfl import algorithms

SIZES = [6, 9, 4]                               # unequal: the two weightings differ
HP = dict(lam=4.0, personal_lr=0.1, personal_steps=2, beta=0.8, lr=0.05, momentum=0.0,
          participation=0.67, batch_size=16, local_steps=1)


def _grad(theta, x, y):
    z = x @ theta["w"] + theta["b"]
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    d = (p - np.eye(3)[y]) / len(y)
    return {"w": x.T @ d, "b": d.sum(0)}


@pytest.mark.parametrize("weights", ["data_size", "uniform"])
def test_server_mean_weights(x64, weights):
    data = make_data(SIZES, feature_dim=5, num_classes=3, seed=3)
    x, y, train, _, _, _ = make_raw(SIZES, feature_dim=5, num_classes=3, seed=3)
    algo = algorithms.get("pfedme", model=linear_model(), weights=weights, **HP)
    state = algo.init(jax.random.key(0), data)
    w = {k: np.asarray(v, np.float64) for k, v in state.params.items()}
    state, m = jax.jit(algo.round_fn)(state, data, jax.random.key(1))
    sampled = np.asarray(m["sampled"]).tolist()
    assert len(sampled) == 2
    locals_ = []
    for k in range(3):
        xk, yk = np.asarray(x, np.float64)[train[k]], np.asarray(y)[train[k]]
        theta, local = dict(w), dict(w)
        for _ in range(HP["personal_steps"]):
            g = _grad(theta, xk, yk)
            theta = {a: theta[a] - HP["personal_lr"] * (g[a] + HP["lam"] * (theta[a] - local[a]))
                     for a in theta}
        locals_.append({a: local[a] - HP["lr"] * HP["lam"] * (local[a] - theta[a]) for a in local})
    n = np.array([SIZES[k] for k in sampled], float)
    p = n / n.sum() if weights == "data_size" else np.full(2, 0.5)
    for a in w:
        want = (1 - HP["beta"]) * w[a] + HP["beta"] * sum(pk * locals_[k][a] for pk, k in zip(p, sampled))
        np.testing.assert_allclose(state.params[a], want, rtol=1e-9, atol=1e-11)


def test_unknown_weights_are_refused():
    with pytest.raises(ValueError, match="weights"):
        algorithms.get("pfedme", model=linear_model(), weights="size", **HP)
