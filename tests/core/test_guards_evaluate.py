"""Guard for core/evaluate.py (issue 30, item 10): the evaluation counts only each client's real
test samples, never the padded positions of its last batch.

Reference: a float64 NumPy evaluation of the same parameters on each client's unpadded test rows
(taken from the raw arrays, independent of the on-device layout). The data are built so that a
padded position would be noticed in all three sums: every client's test split ends in a partial
batch, and a padded position reads the client's first test row, whose label is set to the
model's own prediction, so counting it would add hits, loss and count."""

import jax
import numpy as np
import pytest
from helpers import linear_model

from fedjax_pfl import algorithms, core
from fedjax_pfl.data.federated import FederatedData

TRAIN = [6, 4, 9, 5]
TEST = [5, 1, 11, 3]        # with batch 4: 3, 3, 1 and 1 padded positions; auto batch 16: all padded
FEATURES, CLASSES = 5, 3


def _params_np(params):
    return {k: np.asarray(v, np.float64) for k, v in params.items()}


def _logits(p, x):
    return x @ p["w"] + p["b"]


def _data_whose_first_test_rows_are_hits(params_per_client, seed=0):
    """(FederatedData, x, y, test rows) with random labels except each client's first test row,
    labelled with client i's model prediction (a guaranteed hit)."""
    rng = np.random.default_rng(seed)
    total = sum(TRAIN) + sum(TEST)
    x = rng.normal(size=(total, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, total)
    train, test, start = [], [], 0
    for i, (a, b) in enumerate(zip(TRAIN, TEST)):
        train.append(np.arange(start, start + a))
        test.append(np.arange(start + a, start + a + b))
        first = test[-1][0]
        y[first] = int(np.argmax(_logits(params_per_client[i], x[first].astype(np.float64))))
        start += a + b
    data = FederatedData.from_arrays(x, y, train, test, num_classes=CLASSES, name="guard")
    return data, x.astype(np.float64), y, test


def _reference(p, x, y, rows):
    """(correct, loss_sum, count) of softmax regression p on rows, in float64."""
    logits = _logits(p, x[rows])
    log_probs = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - logits.max(1, keepdims=True)
    return (int(np.sum(logits.argmax(1) == y[rows])),
            float(-log_probs[np.arange(len(rows)), y[rows]].sum()), len(rows))


def _check(got, params_per_client, x, y, test):
    for i, rows in enumerate(test):
        correct, loss_sum, count = _reference(params_per_client[i], x, y, rows)
        assert int(got.count[i]) == count, (i, int(got.count[i]), count)
        assert float(got.correct[i]) == correct, (i, float(got.correct[i]), correct)
        np.testing.assert_allclose(float(got.loss_sum[i]), loss_sum, rtol=1e-5, err_msg=f"client {i}")
        np.testing.assert_allclose(float(got.accuracy[i]), correct / count, rtol=1e-6)


@pytest.mark.parametrize("backend", ["chunked", "loop"])
def test_personal_and_shared_evaluation_ignore_padded_test_positions(backend):
    model = linear_model(FEATURES, CLASSES)
    stacked = jax.vmap(model.init)(jax.random.split(jax.random.key(3), len(TRAIN)))
    personal_np = [_params_np(jax.tree.map(lambda a: a[i], stacked)) for i in range(len(TRAIN))]
    data, x, y, test = _data_whose_first_test_rows_are_hits(personal_np)
    ev = core.Evaluator(model, batch_size=4, mapper=core.client_mapper(backend, 2))
    _check(ev.personal(data, stacked), personal_np, x, y, test)

    shared = jax.tree.map(lambda a: a[0], stacked)
    data, x, y, test = _data_whose_first_test_rows_are_hits([personal_np[0]] * len(TRAIN), seed=1)
    _check(ev.shared(data, shared), [personal_np[0]] * len(TRAIN), x, y, test)


def test_an_algorithms_evaluation_ignores_padded_test_positions():
    """Through the public API: FedAvg's evaluate (the global model on every client, at the
    automatic evaluation batch: 16 here, so every client's split is padded)."""
    model = linear_model(FEATURES, CLASSES)
    algo = algorithms.get("fedavg", model=model, participation=1.0, batch_size=4)
    params = model.init(jax.random.key(5))
    p = _params_np(params)
    data, x, y, test = _data_whose_first_test_rows_are_hits([p] * len(TRAIN), seed=2)
    state = algo.init(jax.random.key(5), data)
    np.testing.assert_array_equal(np.asarray(state.params["w"]), np.asarray(params["w"]))
    _check(algo.evaluate(state, data)["client"], [p] * len(TRAIN), x, y, test)
