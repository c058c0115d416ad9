"""The Gompertz weight of pFedSOP."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gompertz_weight(phi: jax.typing.ArrayLike, lam: jax.typing.ArrayLike) -> jax.Array:
    """β = 1 − exp(−exp(−λ(φ − 1)))  (pFedSOP eq. 14, the double-exponential reading,
    docs/algorithms/pfedsop.md#a1).

    β ∈ (0, 1) is strictly decreasing in the angle φ, equals 1 − 1/e at φ = 1 rad for every λ, and
    weights the GLOBAL pseudo-gradient in the blend (eq. 15, docs/algorithms/pfedsop.md#a2): aligned
    local and global updates (small φ) lean on the global one. The paper's LaTeX parses literally as
    1 − e^{eλ(φ−1)}, which leaves [0, 1]; we implement the reading above
    (docs/algorithms/pfedsop.md#a1).

    1 − e^{−u} is computed as −expm1(−u), which keeps precision when β is near 0.

    Args:
      phi: angle(s) in radians, in [0, π].
      lam: steepness λ > 0.
    """
    return -jnp.expm1(-jnp.exp(-lam * (phi - 1.0)))
