"""Per-task losses and metrics (models/tasks.py) against float64 NumPy formulas and brute-force
Python loops; padding (PAD tokens, −1 tags, PAD-only examples) changes nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedjax_pfl.data.natural import Task
from fedjax_pfl.models import tasks


def _log_softmax64(z):
    z = np.asarray(z, np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def _sequence_batch(rng, b=4, t=7, v=6, pad_prob=0.3):
    logits = rng.normal(size=(b, t, v)) * 2
    labels = rng.integers(1, v, size=(b, t))
    labels[rng.random((b, t)) < pad_prob] = 0
    labels[-1] = 0                                   # a PAD-only example
    return logits, labels


def test_sequence_cross_entropy_and_weight_equal_a_float64_loop(x64):
    logits, labels = _sequence_batch(np.random.default_rng(0))
    got = tasks.sequence_cross_entropy(jnp.asarray(logits), jnp.asarray(labels))
    got_w = tasks.token_weight(jnp.asarray(labels))
    for b in range(labels.shape[0]):
        want, n = 0.0, 0
        for t in range(labels.shape[1]):
            if labels[b, t] != 0:
                want -= _log_softmax64(logits[b, t])[labels[b, t]]
                n += 1
        np.testing.assert_allclose(got[b], want, rtol=1e-12, atol=1e-14)
        assert got_w[b] == n
    assert got[-1] == 0 and got_w[-1] == 0


@jax.jit
def _mean_loss_and_grad(logits, labels):
    """The engine's batch loss Σ_b loss_b / max(Σ_b weight_b, 1) and its gradient."""
    def mean_loss(lg):
        return (tasks.sequence_cross_entropy(lg, labels).sum()
                / jnp.maximum(tasks.token_weight(labels).sum(), 1))

    return jax.value_and_grad(mean_loss)(logits)


def test_padding_changes_neither_mean_loss_nor_gradient_nor_accuracy():
    """The engine's mean Σ loss / Σ weight, its gradient w.r.t. the real logits and token accuracy
    equal the hand computation on the unpadded tokens, whatever padding is added (extra PAD
    positions with arbitrary logits, and PAD-only examples)."""
    rng = np.random.default_rng(1)
    lengths = [3, 5, 1]
    v = 5
    seqs = [rng.integers(1, v, size=n) for n in lengths]
    real_logits = [rng.normal(size=(n, v)).astype(np.float32) for n in lengths]

    # Hand computation on the unpadded tokens (float64): mean CE, its gradient softmax − onehot
    # divided by the token count, and the number of correct argmaxes.
    total = sum(lengths)
    want_loss = sum(-_log_softmax64(z)[np.arange(len(s)), s].sum()
                    for z, s in zip(real_logits, seqs)) / total
    want_grad = [(np.exp(_log_softmax64(z)) - np.eye(v)[s]) / total
                 for z, s in zip(real_logits, seqs)]
    want_hits = sum(int((z.argmax(-1) == s).sum()) for z, s in zip(real_logits, seqs))

    metric = tasks.token_accuracy(())
    for t, extra_examples in ((5, 0), (9, 2)):
        b = len(seqs) + extra_examples
        logits = rng.normal(size=(b, t, v)).astype(np.float32) * 50   # junk at PAD positions
        labels = np.zeros((b, t), np.int64)
        for i, (z, s) in enumerate(zip(real_logits, seqs)):
            logits[i, : len(s)] = z
            labels[i, : len(s)] = s
        labels_j = jnp.asarray(labels)
        loss, grad = _mean_loss_and_grad(jnp.asarray(logits), labels_j)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        grad = np.asarray(grad)
        for i, s in enumerate(seqs):
            np.testing.assert_allclose(grad[i, : len(s)], want_grad[i], atol=1e-6)
            assert np.all(grad[i, len(s):] == 0)
        assert np.all(grad[len(seqs):] == 0)
        hits, count = metric(jnp.asarray(logits), labels_j)
        assert float(hits.sum()) == want_hits and float(count.sum()) == total


@pytest.mark.parametrize("excluded", [(), (3,), (3, 4)])
def test_token_accuracy_equals_a_python_loop(excluded):
    rng = np.random.default_rng(2)
    logits, labels = _sequence_batch(rng, b=5, t=9, v=6)
    # Make some predictions right so hits are not all zero.
    for b in range(5):
        for t in range(9):
            if rng.random() < 0.5 and labels[b, t]:
                logits[b, t, labels[b, t]] += 10
    hits, count = tasks.token_accuracy(excluded)(jnp.asarray(logits), jnp.asarray(labels))
    for b in range(5):
        h = c = 0
        for t in range(9):
            y = labels[b, t]
            if y == 0 or y in excluded:
                continue
            c += 1
            h += int(max(range(6), key=lambda k: logits[b, t, k]) == y)
        assert (float(hits[b]), float(count[b])) == (h, c)
    assert float(hits.sum()) > 0


def test_multilabel_sigmoid_loss_equals_float64_binary_cross_entropy(x64):
    rng = np.random.default_rng(3)
    c = 7
    logits = rng.normal(size=(4, c)) * 3
    labels = np.array([[1, 4, -1], [0, 0, 6], [-1, -1, -1], [2, 3, 5]])   # a repeat, no tags
    y = np.zeros((4, c))
    for b in range(4):
        for tag in labels[b]:
            if tag >= 0:
                y[b, tag] = 1.0
    p = 1.0 / (1.0 + np.exp(-logits))
    want = -(y * np.log(p) + (1 - y) * np.log(1 - p)).sum(-1)
    got = tasks.multilabel_sigmoid_loss(jnp.asarray(logits), jnp.asarray(labels))
    np.testing.assert_allclose(got, want, rtol=1e-12)
    # Extra −1 columns change nothing.
    padded = np.concatenate([labels, -np.ones((4, 2), int)], axis=1)
    np.testing.assert_allclose(
        tasks.multilabel_sigmoid_loss(jnp.asarray(logits), jnp.asarray(padded)), want, rtol=1e-12)


def test_multilabel_sigmoid_loss_is_finite_for_large_logits():
    logits = jnp.array([[80.0, -80.0, 0.0]])
    got = tasks.multilabel_sigmoid_loss(logits, jnp.array([[1, -1]]))
    # softplus(80) − 0 + softplus(−80) − (−80)·1 + log 2 = 80 + 80 + log 2 (up to e^−80).
    np.testing.assert_allclose(got, [160.0 + np.log(2.0)], rtol=1e-6)


def _recall_loop(logits, labels, k):
    per = []
    for z, tags in zip(logits, labels):
        true = {int(t) for t in tags if t >= 0}
        # Highest score first, lower index first among equals (tf.math.top_k / lax.top_k).
        top = sorted(range(len(z)), key=lambda j: (-z[j], j))[:k]
        per.append((len(true & set(top)), len(true)))
    return per


@pytest.mark.parametrize("k", [1, 2, 5, 9])
def test_recall_at_k_equals_a_python_loop(k):
    rng = np.random.default_rng(4)
    c = 8
    logits = rng.normal(size=(6, c)).astype(np.float32)
    logits[0] = np.round(logits[0])                   # ties
    logits[1] = 0.0                                   # all tied: the k lowest indices
    labels = rng.integers(-1, c, size=(6, 4))
    labels[2] = -1                                    # no tags: counts nothing
    labels[3] = [5, 5, 1, -1]                         # a repeated tag counts once
    hits, count = tasks.recall_at_k(k)(jnp.asarray(logits), jnp.asarray(labels))
    want = _recall_loop(logits, labels, k)
    assert [(float(h), float(n)) for h, n in zip(hits, count)] == want
    assert (float(hits[2]), float(count[2])) == (0.0, 0.0)


def test_recall_at_k_rejects_k_below_one():
    with pytest.raises(ValueError, match="k >= 1"):
        tasks.recall_at_k(0)


def test_for_task_gives_each_kind_its_triple():
    rng = np.random.default_rng(5)
    z = rng.normal(size=(3, 4)).astype(np.float32)
    y = np.array([0, 3, 1])
    cls = tasks.for_task(Task("classify", 4))
    assert cls["weight"] is None and cls["metric"] is None
    np.testing.assert_allclose(cls["loss"](jnp.asarray(z), jnp.asarray(y)),
                               -_log_softmax64(z)[np.arange(3), y], rtol=1e-5)

    seq = tasks.for_task(Task("sequence", 6, "tokens", 6, metric_excluded=(5,)))
    zs, ys = _sequence_batch(rng, b=2, t=4, v=6)
    ys[0, 0] = 5
    np.testing.assert_allclose(seq["weight"](jnp.asarray(ys)), (ys != 0).sum(-1))
    _, count = seq["metric"](jnp.asarray(zs), jnp.asarray(ys))
    np.testing.assert_allclose(count, ((ys != 0) & (ys != 5)).sum(-1))     # 5 excluded

    ml = tasks.for_task(Task("multilabel", 4, "tokens", 9, topk=1))
    assert ml["weight"] is None
    hits, count = ml["metric"](jnp.asarray(z), jnp.asarray([[int(z[0].argmax()), -1]] * 3))
    assert float(count.sum()) == 3 and float(hits[0]) == 1      # recall@1: the argmax only
