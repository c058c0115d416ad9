"""Evaluation against a direct computation on each client's test rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import linear_model, make_data, make_raw

from fedjax_pfl import algorithms, core
from fedjax_pfl.data.federated import FederatedData


@pytest.mark.parametrize("backend", ["vmap", "chunked", "loop"])
@pytest.mark.slow
def test_personal_and_shared_evaluation(backend):
    data = make_data([5, 9, 4], test_sizes=[7, 1, 12])
    x, y, _, test, _, _ = make_raw([5, 9, 4], test_sizes=[7, 1, 12])
    model = linear_model()
    ev = core.Evaluator(model, batch_size=4, mapper=core.client_mapper(backend))
    keys = jax.random.split(jax.random.key(0), 3)
    params = jax.vmap(model.init)(keys)
    personal = ev.personal(data, params)
    shared = ev.shared(data, jax.tree.map(lambda x: x[1], params))
    x = np.asarray(x, np.float64)
    for i, rows in enumerate(test):            # raw rows: independent of the on-device layout
        n = len(rows)
        for got, p in ((personal, jax.tree.map(lambda a: a[i], params)),
                       (shared, jax.tree.map(lambda a: a[1], params))):
            logits = x[rows] @ np.asarray(p["w"], np.float64) + np.asarray(p["b"], np.float64)
            log_probs = logits - np.log(np.exp(logits).sum(1, keepdims=True))
            assert got.count[i] == n
            assert got.correct[i] == np.sum(logits.argmax(1) == y[rows])
            np.testing.assert_allclose(got.loss_sum[i], -log_probs[np.arange(n), y[rows]].sum(),
                                       rtol=1e-5)
    np.testing.assert_allclose(personal.accuracy, personal.correct / np.array([7, 1, 12]))


@pytest.mark.parametrize("width", [1, 4])
@pytest.mark.slow
def test_evaluating_every_clients_model_holds_a_few_of_them_at_once(width):
    """Every client's personal model on its test split (N = 160, unequal test splits, lanes of
    4, or one client at a time): the evaluation's temporaries stay below a quarter of all the
    models (it held every model twice over: the stage-1 carries, which hold each client's model,
    or a copy of all of them sorted by length); the results equal a float64 computation on the
    raw rows."""
    n = 160
    test_sizes = [1 + (7 * i) % 23 for i in range(n)]
    data = make_data([2] * n, test_sizes=test_sizes, feature_dim=64, num_classes=10)
    x, y, _, test, _, _ = make_raw([2] * n, test_sizes=test_sizes, feature_dim=64, num_classes=10)
    model = linear_model(64, 10)
    ev = core.Evaluator(model, batch_size=8, mapper=core.client_mapper("chunked", width))
    params = jax.vmap(model.init)(jax.random.split(jax.random.key(2), n))
    run = jax.jit(lambda p: ev.personal(data, p))
    models = sum(leaf.nbytes for leaf in jax.tree.leaves(params))
    assert run.lower(params).compile().memory_analysis().temp_size_in_bytes < models / 4
    got = run(params)
    w, b = np.asarray(params["w"], np.float64), np.asarray(params["b"], np.float64)
    x = np.asarray(x, np.float64)
    for i, rows in enumerate(test):
        logits = x[rows] @ w[i] + b[i]
        log_probs = logits - np.log(np.exp(logits).sum(1, keepdims=True))
        assert got.count[i] == len(rows) and got.correct[i] == np.sum(logits.argmax(1) == y[rows])
        np.testing.assert_allclose(got.loss_sum[i], -log_probs[np.arange(len(rows)), y[rows]].sum(),
                                   rtol=1e-5)


@pytest.mark.slow
def test_evaluating_a_subset_of_clients_and_the_batch_size():
    data = make_data([5, 9, 4, 6], test_sizes=[7, 1, 12, 3])
    model = linear_model()
    ev = core.Evaluator(model, batch_size=256, mapper=core.client_mapper("chunked", 2))
    # The batch follows the largest test split (12, rounded up to 16), not the configured 256.
    assert ev.batch_for(data) == 16
    params = jax.vmap(model.init)(jax.random.split(jax.random.key(1), 4))
    every = ev.personal(data, params)
    some = ev.personal(data, params, jnp.array([3, 1]))
    np.testing.assert_array_equal(some.correct, every.correct[jnp.array([3, 1])])
    np.testing.assert_allclose(some.loss_sum, every.loss_sum[jnp.array([3, 1])], rtol=1e-6)
    one = jax.tree.map(lambda a: a[0], params)
    np.testing.assert_allclose(ev.shared(data, one, jnp.array([2])).loss_sum,
                               ev.shared(data, one).loss_sum[2:3], rtol=1e-6)


def test_automatic_evaluation_batch_keeps_the_temporaries_in_cache():
    """--eval-batch-size 0: the largest multiple of 8 up to 256 within 2 MiB of temporaries.
    The FedAvg CNN on 28×28: conv 2's im2col patches alone are 8·8·800 floats = 204.8 KB a
    sample, 3.3 MB at batch 16 > 2 MiB, so 8. The 784-100-10 MLP: even with every activation a
    temporary (894 floats, 3.6 KB a sample) 256 samples take 0.9 MB, so 256."""
    from fedjax_pfl import models

    shape = (28, 28, 1)
    cnn, mlp = models.get("cnn", shape, 10), models.get("mlp", shape, 10)
    assert core.auto_eval_batch(mlp, shape) == 256
    assert core.auto_eval_batch(cnn, shape) == 8
    budgets = [0, 4 << 20, 16 << 20, 64 << 20, 1 << 30]
    batches = [core.auto_eval_batch(cnn, shape, b) for b in budgets]
    assert batches[0] == 8 and batches[-1] == 256                  # the bounds
    assert batches == sorted(batches) and all(b % 8 == 0 for b in batches)
    assert 8 < batches[2] < 256                                     # in between, a multiple of 8
    # The Evaluator asks for it: on 28×28 images the CNN evaluates in batches of 8.
    from fedjax_pfl.data.federated import FederatedData
    images = FederatedData.from_arrays(np.zeros((40, *shape), np.float32), np.zeros(40),
                                       [np.arange(0, 10), np.arange(10, 20)],
                                       [np.arange(20, 25), np.arange(25, 40)], num_classes=10)
    auto = core.Evaluator(cnn, batch_size=core.AUTO_EVAL_BATCH, mapper=core.client_mapper("chunked"))
    assert auto.batch_for(images) == 8                        # not min(256, 15 rounded up) = 16
    # So does PGFed's full-data gradient pass (FullPass with batch 0).
    from fedjax_pfl.core.local import FullPass
    assert FullPass(cnn, batch_size=0, mapper=core.client_mapper("chunked")).batch_for(images) == 8
    assert FullPass(mlp, batch_size=0, mapper=core.client_mapper("chunked")).batch_for(images) == 256
    # Automatic or explicit, the batch never exceeds the largest test split rounded up to 8.
    tiny = linear_model()                                     # a few bytes a sample: 256
    for sizes, expected in (([300, 1, 12], 256), ([5, 1, 12], 16)):
        data = make_data([5, 9, 4], test_sizes=sizes)
        ev = core.Evaluator(tiny, batch_size=core.AUTO_EVAL_BATCH, mapper=core.client_mapper("chunked"))
        assert ev.batch_for(data) == expected

# -- Guard for core/evaluate.py (issue 30, item 10): the evaluation counts only each client's real ----


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
@pytest.mark.slow
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
