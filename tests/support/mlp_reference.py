"""A two-layer tanh network as a hand-written `Model` (float64 under x64, unlike flax's float32
parameters) and its NumPy float64 transcription with hand-derived gradients, for the
split-model baselines (FedRep, LG-FedAvg, FedRoD, FedBABU).

Parameters are named like flax's, {"Dense_0": {kernel, bias}, "Dense_1": {kernel, bias}}, so the
default head pattern ("head" = the last dense layer) selects Dense_1.

With full batches (B ≥ every n_i) each epoch is one gradient step on all of a client's samples,
so the engine's batch order cannot matter and a round is plain gradient descent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_pfl.models.model import Model

F, H, C = 5, 4, 3


def init(key):
    k0, k1, k2, k3 = jax.random.split(key, 4)
    return {"Dense_0": {"kernel": 0.5 * jax.random.normal(k0, (F, H)),
                        "bias": 0.1 * jax.random.normal(k1, (H,))},
            "Dense_1": {"kernel": 0.5 * jax.random.normal(k2, (H, C)),
                        "bias": 0.1 * jax.random.normal(k3, (C,))}}


def apply(p, x):
    h = jnp.tanh(x.reshape(x.shape[0], -1) @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    return h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]


TWO_LAYER = Model(init=init, apply=apply, name="two_layer")


def to_numpy(tree):
    return jax.tree.map(lambda a: np.array(a, np.float64), tree)


def features(p, x):
    return np.tanh(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])


def logits(p, x):
    return features(p, x) @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]


def softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def ce_dlogits(z, y):
    """d/dz of mean_j −log softmax(z_j)_{y_j}: (softmax(z) − onehot(y)) / B."""
    g = softmax(z)
    g[np.arange(len(y)), y] -= 1.0
    return g / len(y)


def backprop(p, x, dz):
    """Gradients of a loss whose derivative with respect to the logits is dz [B, C]."""
    h = features(p, x)
    dpre = (dz @ p["Dense_1"]["kernel"].T) * (1.0 - h**2)
    return {"Dense_0": {"kernel": x.T @ dpre, "bias": dpre.sum(0)},
            "Dense_1": {"kernel": h.T @ dz, "bias": dz.sum(0)}}


def ce_grad(p, x, y):
    return backprop(p, x, ce_dlogits(logits(p, x), y))


def axpy(a, x, y):
    """a·x + y on nested dicts of arrays."""
    return {k: axpy(a, x[k], y[k]) if isinstance(x[k], dict) else a * x[k] + y[k] for k in x}


def weighted_mean(trees, weights):
    w = np.asarray(weights, np.float64) / np.sum(weights)
    out = jax.tree.map(lambda a: 0.0 * a, trees[0])
    for wi, t in zip(w, trees):
        out = axpy(wi, t, out)
    return out


def client_xy(raw, i, split="train"):
    """Client i's (x, y) from `helpers.make_raw`'s arrays."""
    x, y, train, test = raw[:4]
    rows = (train if split == "train" else test)[i]
    return np.asarray(x[rows], np.float64), np.asarray(y[rows])
