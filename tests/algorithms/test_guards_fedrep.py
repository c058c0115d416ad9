"""Guard for FedRep (issue 30, item 10): the head phase and the body phase draw their own batch
orders. A head phase that reuses the body phase's key visits the client's samples in the same
order as the body phase, in every round.

The orders are recovered by brute force, independently of the engine's shuffle: with batch size
1 and plain SGD on softmax regression (body w, head b), the head after the head phase depends
on the order its samples were visited, and so does the body after the body phase. For each
round (one client sampled, so its body is the new global body) every one of the 4! orders is
simulated in float64 NumPy,

    head phase:  b ← b − η (softmax(x_j w + b) − e_{y_j})          for j in π_h   (w frozen)
    body phase:  w ← w − η x_jᵀ(softmax(x_j w + b) − e_{y_j})     for j in π_b   (b frozen)

and exactly one order must reproduce the algorithm's head (then body) to float64 rounding (the
test runs under x64; two orders can differ by as little as 1e-5 here), so
each phase visited a permutation of the client's samples. Over 8 rounds the two phases' orders
must not coincide every time (independent orders coincide with probability 1/24 per round)."""

import itertools

import jax
import numpy as np
from helpers import linear_model, make_data, make_raw

from fedjax_pfl import algorithms

SIZES = [4, 4, 4]
FEATURES, CLASSES, LR = 3, 3, 0.8


def _error(w, b, x, y):
    logits = x @ w + b
    p = np.exp(logits - logits.max())
    return p / p.sum() - np.eye(CLASSES)[y]


def _head_after(order, w, b, x, y):
    for j in order:
        b = b - LR * _error(w, b, x[j], y[j])
    return b


def _body_after(order, w, b, x, y):
    for j in order:
        w = w - LR * np.outer(x[j], _error(w, b, x[j], y[j]))
    return w


def _unique_order(simulate, got):
    """The one permutation whose simulation gives `got`; the runner-up must be far off."""
    dist = sorted((np.abs(simulate(order) - got).max(), order)
                  for order in itertools.permutations(range(SIZES[0])))
    (best, order), (second, _) = dist[0], dist[1]
    assert best < 1e-10 and second > 1e-8, (best, second)
    return order


def test_the_head_phase_does_not_reuse_the_body_phases_batch_order(x64):
    data = make_data(SIZES, num_classes=CLASSES, feature_dim=FEATURES, seed=4)
    x_raw, y_raw, train, _, _, _ = make_raw(SIZES, num_classes=CLASSES, feature_dim=FEATURES, seed=4)
    algo = algorithms.get("fedrep", model=linear_model(FEATURES, CLASSES), head="^b$",
                          head_epochs=1, local_epochs=2, batch_size=1, lr=LR, momentum=0.0,
                          participation=1 / len(SIZES))
    state = algo.init(jax.random.key(0), data)
    step = jax.jit(algo.round_fn)
    same = []
    for r in range(8):
        new, metrics = step(state, data, jax.random.key(r))
        (i,) = np.asarray(metrics["sampled"]).tolist()
        x = np.asarray(x_raw[train[i]], np.float64)
        y = y_raw[train[i]]
        w0 = np.asarray(state.body["w"], np.float64)
        b0 = np.asarray(state.heads["b"][i], np.float64)
        b1 = np.asarray(new.heads["b"][i], np.float64)
        w1 = np.asarray(new.body["w"], np.float64)
        head_order = _unique_order(lambda o: _head_after(o, w0, b0, x, y), b1)
        body_order = _unique_order(lambda o: _body_after(o, w0, b1, x, y), w1)
        same.append(head_order == body_order)
        state = new
    assert not all(same), "the head phase visited the samples in the body phase's order every round"
    assert sum(same) <= 2, same         # 8 rounds at 1/24 each: more than 2 has probability < 1 %
