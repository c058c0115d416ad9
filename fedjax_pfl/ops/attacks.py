"""Model poisoning: what a round's malicious clients upload in place of their honest update, as
pure functions over the round's STACKED updates Δ (leaves [M, ...]) and two [M] masks.

`malicious` marks the slots whose upload is replaced; `benign` the honest participants (the
slots that hold a client and are not malicious: a Poisson round's empty slots are in neither).
Every function returns the stack with the malicious rows replaced and every other row as it was,
bit for bit (a select, no arithmetic on them). n below is the round's participants, f the
malicious among them, μ and σ the benign updates' coordinate-wise mean and standard deviation:

    attack      malicious row Δ'_i                      source
    sign_flip   −S·Δ_i                                  e.g. Karimireddy et al., ICML 2021 (§ 6)
    scale       S·Δ_i                                   Bagdasaryan et al., AISTATS 2020 (model
                                                        replacement: S = n/η, the server's step η)
    gaussian    N(0, σ_g² I), pure noise                Blanchard et al., NeurIPS 2017 (§ 5)
    alie        μ − z·σ                                 Baruch et al., NeurIPS 2019 ("A little is
                                                        enough"), z from n and f (`alie_z`)
    ipm         −ε·μ                                    Xie et al., UAI 2020 (inner-product
                                                        manipulation)

ALIE and IPM are omniscient: they read the benign updates of the same round (μ and σ over the
benign slots, uniformly: the papers' mean over the honest workers; σ the population standard
deviation, 1/n_b), as their papers' attackers do; every malicious slot sends the same vector.
Gaussian noise replaces the update (the "Gaussian Byzantine" of Blanchard et al.; adding noise
to the honest update is the milder variant we do not implement). Computation is in float32
(float64 inputs keep float64); the result has the leaves' dtype.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.scipy.special import ndtri

Params = Any

# --attack: none, the data poisoning of local training (`ops.poison`), the model poisoning here.
DATA_ATTACKS = ("label_flip", "backdoor")
MODEL_ATTACKS = ("sign_flip", "scale", "gaussian", "alie", "ipm")
ATTACKS = ("none",) + DATA_ATTACKS + MODEL_ATTACKS


def _wide(a: jax.Array) -> jax.Array:
    return a.astype(jnp.promote_types(a.dtype, jnp.float32))


def _rows(mask: jax.Array, leaf: jax.Array) -> jax.Array:
    """[M] mask shaped to broadcast against a leaf [M, ...]."""
    return mask.reshape(mask.shape + (1,) * (leaf.ndim - 1))


def replace_rows(deltas: Params, malicious: jax.Array, sent: Params) -> Params:
    """Δ with row i replaced by sent_i where malicious_i (`sent` leaves [M, ...] or, one vector
    for every malicious slot, [...]); the other rows are Δ's own values."""
    def one(d, s):
        s = jnp.broadcast_to(s.astype(d.dtype), d.shape)
        return jnp.where(_rows(malicious, d), s, d)

    return jax.tree.map(one, deltas, sent)


def sign_flip(deltas: Params, malicious: jax.Array, scale: float = 1.0) -> Params:
    """Δ'_i = −S·Δ_i for the malicious rows (S = `scale`; 1: the plain sign flip)."""
    return replace_rows(deltas, malicious, jax.tree.map(lambda d: -scale * _wide(d), deltas))


def scale_update(deltas: Params, malicious: jax.Array, scale: float) -> Params:
    """Δ'_i = S·Δ_i for the malicious rows: model replacement (Bagdasaryan et al. 2020, eq. 3:
    S = n/η makes the server's new model the attacker's when the others' updates cancel)."""
    return replace_rows(deltas, malicious, jax.tree.map(lambda d: scale * _wide(d), deltas))


def gaussian(deltas: Params, malicious: jax.Array, key: jax.Array, std: float) -> Params:
    """Δ'_i ~ N(0, σ² I) for the malicious rows (σ = `std`), each slot its own draw; one key
    per leaf (split from `key` in the leaves' order)."""
    leaves, treedef = jax.tree.flatten(deltas)
    keys = jax.random.split(key, max(len(leaves), 1))
    noise = [std * jax.random.normal(k, d.shape, _wide(d).dtype) for k, d in zip(keys, leaves)]
    return replace_rows(deltas, malicious, jax.tree.unflatten(treedef, noise))


def benign_moments(deltas: Params, benign: jax.Array) -> tuple[Params, Params]:
    """(μ, σ): the coordinate-wise mean and population standard deviation of the benign rows,
    μ = Σ_{i∈B} Δ_i / n_b, σ = (Σ_{i∈B} (Δ_i − μ)² / n_b)^{1/2}, n_b = |B| (zeros without one)."""
    count = jnp.maximum(jnp.sum(benign), 1)

    def mean(d):
        return jnp.sum(jnp.where(_rows(benign, d), _wide(d), 0.0), axis=0) / count

    mu = jax.tree.map(mean, deltas)

    def std(d, m):
        dev = jnp.where(_rows(benign, d), _wide(d) - m[None], 0.0)
        return jnp.sqrt(jnp.sum(dev * dev, axis=0) / count)

    return mu, jax.tree.map(std, deltas, mu)


def alie_z(n, f) -> jax.Array:
    """z_max of Baruch et al. 2019 (§ 4, Algorithm 3) for n clients of which f are malicious:

        s = ⌊n/2 + 1⌋ − f        the benign clients the attackers need on their side
        z = Φ⁻¹((n − s)/n)       the largest z with Φ(z) < (n − s)/n (Φ the normal CDF)

    s is taken at least 1 (where f ≥ ⌊n/2⌋, a malicious majority, the paper's s ≤ 0 would give
    an infinite z): z is at most Φ⁻¹((n − 1)/n). Traceable in n and f."""
    n = jnp.asarray(n, jnp.float32)
    f = jnp.asarray(f, jnp.float32)
    s = jnp.maximum(jnp.floor(n / 2.0 + 1.0) - f, 1.0)
    return ndtri((n - s) / jnp.maximum(n, 1.0))


def alie(deltas: Params, malicious: jax.Array, benign: jax.Array, z) -> Params:
    """Δ'_i = μ − z·σ for the malicious rows (`benign_moments`): "A little is enough" (Baruch et
    al., NeurIPS 2019), each coordinate moved z benign standard deviations from the benign mean,
    within the spread a coordinate-wise rule keeps."""
    mu, sigma = benign_moments(deltas, benign)
    return replace_rows(deltas, malicious, jax.tree.map(lambda m, s: m - z * s, mu, sigma))


def ipm(deltas: Params, malicious: jax.Array, benign: jax.Array, eps: float) -> Params:
    """Δ'_i = −ε·μ for the malicious rows, μ the benign mean (Xie, Koyejo & Gupta, "Fall of
    empires: breaking Byzantine-tolerant SGD by inner product manipulation", UAI 2020, § 3):
    a small ε keeps the upload close to the benign ones (it passes Krum), a large one (ε > (n −
    f)/f for the mean) turns the mean's inner product with μ negative."""
    mu, _ = benign_moments(deltas, benign)
    return replace_rows(deltas, malicious, jax.tree.map(lambda m: -eps * m, mu))


def poison_updates(kind: str, deltas: Params, malicious: jax.Array, benign: jax.Array, *,
                   key: jax.Array, scale: float = 1.0, std: float = 1.0, z=None,
                   eps: float = 0.1) -> Params:
    """The stack Δ with the malicious rows replaced by `kind`'s upload (one of MODEL_ATTACKS;
    the module's table); z None: `alie_z` of the round's participants n = |benign| + |malicious|
    and f = |malicious|."""
    if kind == "sign_flip":
        return sign_flip(deltas, malicious, scale)
    if kind == "scale":
        return scale_update(deltas, malicious, scale)
    if kind == "gaussian":
        return gaussian(deltas, malicious, key, std)
    if kind == "alie":
        if z is None:
            f = jnp.sum(malicious)
            z = alie_z(jnp.sum(benign) + f, f)
        return alie(deltas, malicious, benign, z)
    if kind == "ipm":
        return ipm(deltas, malicious, benign, eps)
    raise ValueError(f"kind must be one of {list(MODEL_ATTACKS)}, got {kind!r}")
