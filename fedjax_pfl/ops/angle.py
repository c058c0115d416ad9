"""The angle between two pytrees, with GLOBAL norms over all leaves."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_pfl.ops.tree import Params, tree_sq_norm, tree_vdot


def cosine_similarity(a: Params, b: Params, eps: float = 1e-30) -> jax.Array:
    """sim = ⟨a, b⟩ / max(‖a‖‖b‖, ε), clipped to [−1, 1] (pFedSOP Algorithm 1, step 1).

    Dot product and norms sum over ALL leaves: one cosine for the whole parameter vector, not one
    per layer (docs/algorithms/pfedsop.md#global-norms). If either vector is zero the numerator is
    0, so sim = 0 (docs/algorithms/pfedsop.md#a7): no NaN. The clip removes rounding that would put
    |sim| above 1 (e.g. a == b).
    """
    norms = _safe_sqrt(tree_sq_norm(a)) * _safe_sqrt(tree_sq_norm(b))
    return jnp.clip(tree_vdot(a, b) / jnp.maximum(norms, eps), -1.0, 1.0)


def _safe_sqrt(x: jax.Array) -> jax.Array:
    """√x with a finite (zero) gradient at x = 0, so a zero vector never produces NaN."""
    positive = x > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, x, 1.0)), 0.0)


def cosine_angle(a: Params, b: Params, eps: float = 1e-30) -> jax.Array:
    """φ = arccos(sim) ∈ [0, π] (pFedSOP Algorithm 1, step 2; the paper's θ).

    φ = π/2 when either vector is zero (documented convention, docs/algorithms/pfedsop.md#a7); never
    NaN.
    """
    return jnp.arccos(cosine_similarity(a, b, eps))
