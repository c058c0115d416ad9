"""Proximal operators of norms: soft-thresholding, ℓ1-ball projection, prox of ‖·‖_p (FedPC).

FedPC's W-update (docs/algorithms/fedpc.md#round, step 4) applies, to every edge column v ∈ R^{d2}
of V = ZQ − Ω/ρ, the proximal operator

    prox_{τ‖·‖_p}(v) = argmin_w  τ‖w‖_p + ½‖w − v‖²,      τ = λ/ρ,  p ∈ {1, 2, ∞}.

**[fix]** The draft's single formula (1 − 1/‖(ρ/λ)v‖_q)_+ v is this prox only for p = 2. For every
p, Moreau's decomposition gives it through the projection onto the unit ball of the dual norm q
(1/p + 1/q = 1):

    prox_{τ‖·‖_p}(v) = v − τ · Proj_{‖·‖_q ≤ 1}(v / τ) = v − Proj_{‖·‖_q ≤ τ}(v),

    p = 1  (q = ∞): elementwise soft-thresholding          sign(v) max(|v| − τ, 0)
    p = 2  (q = 2): block soft-thresholding                 (1 − τ/‖v‖₂)_+ v
    p = ∞  (q = 1): v − Proj_{ℓ1-ball of radius τ}(v)      (sort-based projection, O(d log d))

Every function here acts on ONE vector (the last axis is the vector); vmap it over the edges.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

NORM_ORDERS = ("1", "2", "inf")


def norm_order(p) -> str:
    """'1', '2' or 'inf' for p given as 1, 2, inf, np.inf or one of those strings."""
    if isinstance(p, str):
        key = p.strip().lower()
        key = "inf" if key in ("inf", "infinity", "∞") else key
    elif p in (1, 2):
        key = str(int(p))
    elif isinstance(p, (int, float)) and math.isinf(p) and p > 0:
        key = "inf"
    else:
        key = repr(p)
    if key not in NORM_ORDERS:
        raise ValueError(f"p must be one of 1, 2, inf, got {p!r}")
    return key


def norm_p(v: jax.Array, p) -> jax.Array:
    """‖v‖_p over the last axis."""
    key = norm_order(p)
    if key == "1":
        return jnp.sum(jnp.abs(v), axis=-1)
    if key == "2":
        return jnp.sqrt(jnp.sum(v * v, axis=-1))
    return jnp.max(jnp.abs(v), axis=-1, initial=0.0)


def soft_threshold(v: jax.Array, tau: jax.typing.ArrayLike) -> jax.Array:
    """sign(v) · max(|v| − τ, 0), elementwise: the minimiser of τ‖w‖₁ + ½‖w − v‖² (τ ≥ 0).

    It is also the minimiser of ‖r‖₁ + (ρ/2)‖r − a‖² with τ = 1/ρ: FedPC's compression r-step
    thresholds at 1/ρ_c (docs/algorithms/fedpc.md#f2; the draft writes ρ).
    """
    return jnp.sign(v) * jnp.maximum(jnp.abs(v) - tau, 0.0).astype(v.dtype)


def project_l1_ball(v: jax.Array, radius: jax.typing.ArrayLike = 1.0) -> jax.Array:
    """Euclidean projection of a vector onto {w : ‖w‖₁ ≤ radius} (radius ≥ 0), by sorting.

    Proj(v) = sign(v) max(|v| − θ, 0), with θ = 0 when ‖v‖₁ ≤ radius, else the θ > 0 with
    Σ_i max(|v_i| − θ, 0) = radius. With u = |v| sorted in decreasing order and s_j = Σ_{i≤j} u_i,
    θ = (s_ρ − radius)/ρ for ρ = max{ j : u_j > (s_j − radius)/j } (Duchi et al., ICML 2008,
    Fig. 1). O(d log d); works on the last axis of `v` only as a single vector (vmap for more).
    """
    if v.shape[-1] == 0:
        return v
    a = jnp.abs(v)
    u = jnp.sort(a)[::-1]
    s = jnp.cumsum(u)
    j = jnp.arange(1, v.shape[-1] + 1, dtype=v.dtype)
    positive = u > (s - radius) / j
    count = jnp.maximum(jnp.sum(positive), 1)            # ρ ≥ 1 whenever radius > 0
    theta = (s[count - 1] - radius) / count.astype(v.dtype)
    projected = jnp.sign(v) * jnp.maximum(a - jnp.maximum(theta, 0.0), 0.0)
    inside = jnp.sum(a) <= radius
    return jnp.where(inside, v, jnp.where(radius > 0, projected, jnp.zeros_like(v)))


def prox_norm(v: jax.Array, tau: jax.typing.ArrayLike, p) -> jax.Array:
    """prox_{τ‖·‖_p}(v) = argmin_w τ‖w‖_p + ½‖w − v‖² for p ∈ {1, 2, ∞}
    (docs/algorithms/fedpc.md#f1).

    By Moreau's decomposition, v − Proj_{‖·‖_q ≤ τ}(v) with q the dual exponent (module
    docstring). τ = 0 returns v. One vector (last axis); vmap over the columns of a d2 × M matrix.

    Args:
      v: [d] vector.
      tau: τ ≥ 0 (FedPC: λ/ρ).
      p: 1, 2 or inf (also '1', '2', 'inf').
    Returns:
      [d], the prox. Costs O(d) for p ∈ {1, 2}, O(d log d) for p = ∞.
    """
    key = norm_order(p)
    tau = jnp.asarray(tau, v.dtype)
    if key == "1":
        return soft_threshold(v, tau)
    if key == "2":
        norm = jnp.sqrt(jnp.sum(v * v))
        scale = jnp.where(norm > tau, 1.0 - tau / jnp.where(norm > 0, norm, 1.0), 0.0)
        return (scale * v).astype(v.dtype)
    return v - project_l1_ball(v, tau)
