"""Evaluation against a direct computation on each client's test rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfl import core
from helpers import linear_model, make_data


@pytest.mark.parametrize("backend", ["vmap", "loop"])
def test_personal_and_shared_evaluation(backend):
    data = make_data([5, 9, 4], test_sizes=[7, 1, 12])
    model = linear_model()
    ev = core.Evaluator(model, batch_size=4, mapper=core.client_mapper(backend))
    keys = jax.random.split(jax.random.key(0), 3)
    params = jax.vmap(model.init)(keys)
    personal = ev.personal(data, params)
    shared = ev.shared(data, jax.tree.map(lambda x: x[1], params))
    x, y = np.asarray(data.x, np.float64), np.asarray(data.y)
    starts = [5, 5 + 7 + 9, 5 + 7 + 9 + 1 + 4]
    for i, (start, n) in enumerate(zip(starts, [7, 1, 12])):
        rows = slice(start, start + n)
        for got, p in ((personal, jax.tree.map(lambda a: a[i], params)),
                       (shared, jax.tree.map(lambda a: a[1], params))):
            logits = x[rows] @ np.asarray(p["w"], np.float64) + np.asarray(p["b"], np.float64)
            log_probs = logits - np.log(np.exp(logits).sum(1, keepdims=True))
            assert got.count[i] == n
            assert got.correct[i] == np.sum(logits.argmax(1) == y[rows])
            np.testing.assert_allclose(got.loss_sum[i], -log_probs[np.arange(n), y[rows]].sum(),
                                       rtol=1e-5)
    np.testing.assert_allclose(personal.accuracy, personal.correct / np.array([7, 1, 12]))
