"""The engine on per-token tasks: token inputs reach the model as int32 ids, and a model's
`weight` (real tokens) and `metric` (scored units) decide the training loss, the full-data pass
and the evaluation. References are NumPy float64 computations on the unpadded tokens.

The model is a bigram table: logits[b, t] = E[x[b, t]] (E: [V, V]); label 0 is padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfl import core
from fedjax_pfl.data.federated import FederatedData
from fedjax_pfl.data.natural import Task
from fedjax_pfl.models.model import Model

V, T = 5, 4
TASK = Task(kind="sequence", inputs="tokens", num_classes=V, vocab_size=V)


def bigram_model(excluded=()) -> Model:
    def init(key):
        return {"E": 0.5 * jax.random.normal(key, (V, V))}

    def apply(params, x):
        assert x.dtype == jnp.int32          # ids, not normalised floats
        return params["E"][x]

    def loss(logits, labels):
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]
        return jnp.sum(jnp.where(labels != 0, ce, 0.0), axis=-1)

    def weight(labels):
        return jnp.sum(labels != 0, axis=-1).astype(jnp.float32)

    def metric(logits, labels):
        scored = labels != 0
        for e in excluded:
            scored &= labels != e
        hits = (jnp.argmax(logits, -1) == labels) & scored
        return jnp.sum(hits, -1).astype(jnp.float32), jnp.sum(scored, -1).astype(jnp.float32)

    return Model(init=init, apply=apply, loss=loss, name="bigram", weight=weight, metric=metric)


def token_data(train_sizes=(3, 5), test_sizes=(4, 2), seed=0):
    """Sequences with a ragged tail of padding (label 0) and a fully padded sequence."""
    rng = np.random.default_rng(seed)
    n = sum(train_sizes) + sum(test_sizes)
    x = rng.integers(1, V, (n, T)).astype(np.int32)
    y = rng.integers(1, V, (n, T)).astype(np.int32)
    lengths = rng.integers(0, T + 1, n)
    lengths[1] = 0                                       # a sequence of padding only
    for i, k in enumerate(lengths):
        x[i, k:] = 0
        y[i, k:] = 0
    data = FederatedData.from_blocks(x, y, np.array(train_sizes), np.array(test_sizes),
                                     num_classes=V, name="tokens", task=TASK)
    return data, x, y


def ref_ce(E, x, y):
    """Per-token cross-entropy (float64), 0 where the label is padding."""
    logits = E[x]
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, y[..., None], -1)[..., 0]
    return np.where(y != 0, ce, 0.0)


def test_masked_mean_divides_by_real_tokens_of_real_examples():
    model = bigram_model()
    data, x, y = token_data()
    params = model.init(jax.random.key(1))
    E = np.asarray(params["E"], np.float64)
    mask = np.array([True, True, False, True, True, False, True, True])
    got = core.masked_mean_loss(model, params, jnp.asarray(x[:8]), jnp.asarray(y[:8]),
                                jnp.asarray(mask))
    ce = ref_ce(E, x[:8], y[:8])
    want = ce[mask].sum() / (y[:8][mask] != 0).sum()
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("backend", ["chunked", "loop"])
def test_evaluation_counts_real_and_scored_tokens(backend):
    model = bigram_model(excluded=(4,))
    data, x, y = token_data()
    ev = core.Evaluator(model, batch_size=3, mapper=core.client_mapper(backend))
    params = jax.vmap(model.init)(jax.random.split(jax.random.key(2), 2))
    got = ev.personal(data, params)
    test_rows = [np.arange(8, 12), np.arange(12, 14)]
    for i, rows in enumerate(test_rows):
        E = np.asarray(params["E"][i], np.float64)
        ce = ref_ce(E, x[rows], y[rows])
        scored = (y[rows] != 0) & (y[rows] != 4)
        hits = (E[x[rows]].argmax(-1) == y[rows]) & scored
        np.testing.assert_allclose(got.loss_sum[i], ce.sum(), rtol=1e-5)
        assert got.loss_count[i] == (y[rows] != 0).sum()
        assert got.count[i] == scored.sum()
        assert got.correct[i] == hits.sum()
    stats = core.summarize(got.correct, got.loss_sum, got.count, loss_count=got.loss_count)
    per_token = [np.asarray(got.loss_sum[i]) / np.asarray(got.loss_count[i]) for i in range(2)]
    np.testing.assert_allclose(stats["loss"], np.mean(per_token), rtol=1e-6)


def test_full_pass_is_the_mean_over_real_tokens():
    model = bigram_model()
    data, x, y = token_data()
    full = core.FullPass(model, batch_size=2, mapper=core.client_mapper("chunked"))
    params = jax.vmap(model.init)(jax.random.split(jax.random.key(3), 2))
    clients = data.clients
    loss, grads = full(data, params, clients)
    for i, rows in enumerate([np.arange(0, 3), np.arange(3, 8)]):
        E = np.asarray(params["E"][i], np.float64)
        xs, ys = x[rows], y[rows]
        units = (ys != 0).sum()
        np.testing.assert_allclose(loss[i], ref_ce(E, xs, ys).sum() / units, rtol=1e-5)
        # d CE / d logits = softmax − onehot at each real token, scattered to E's row x.
        logits = E[xs]
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        g = np.zeros_like(E)
        for b in range(len(rows)):
            for t in range(T):
                if ys[b, t] != 0:
                    d = p[b, t].copy()
                    d[ys[b, t]] -= 1
                    g[xs[b, t]] += d
        np.testing.assert_allclose(grads["E"][i], g / units, rtol=1e-4, atol=1e-6)


def test_local_training_reports_the_token_mean_loss_of_its_steps():
    """One full-batch step from E: the reported loss is the token mean at E (not the example
    mean), and the update is −lr times its gradient."""
    import optax

    model = bigram_model()
    data, x, y = token_data(train_sizes=(3, 5))
    trainer = core.LocalTrainer(model, optax.sgd(0.5), batch_size=8, steps=1,
                                mapper=core.client_mapper("chunked"))
    params = jax.vmap(model.init)(jax.random.split(jax.random.key(4), 2))
    opt = jax.vmap(trainer.init_opt_state)(params)
    result = trainer(data, params, opt, data.clients, jax.random.split(jax.random.key(5), 2))
    for i, rows in enumerate([np.arange(0, 3), np.arange(3, 8)]):
        E = np.asarray(params["E"][i], np.float64)
        want = ref_ce(E, x[rows], y[rows]).sum() / (y[rows] != 0).sum()
        np.testing.assert_allclose(result.loss[i], want, rtol=1e-5)


def test_label_counts_count_real_tokens_per_client():
    """data.label_counts and FedRoD's class prior (algorithms/fedrod.train_label_counts) count
    every non-padding target token of each client's split."""
    from fedjax_pfl.algorithms.fedrod import train_label_counts
    from fedjax_pfl.data.federated import label_counts

    data, x, y = token_data()
    blocks = {"train": [np.arange(0, 3), np.arange(3, 8)], "test": [np.arange(8, 12), np.arange(12, 14)]}
    for split, rows in blocks.items():
        want = np.zeros((2, V), np.int64)
        for i, r in enumerate(rows):
            for label in y[r].reshape(-1):
                if label != 0:
                    want[i, label] += 1
        np.testing.assert_array_equal(label_counts(data, split), want)
        if split == "train":
            np.testing.assert_array_equal(train_label_counts(data), want)
