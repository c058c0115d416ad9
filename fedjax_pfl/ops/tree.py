"""Vector-space arithmetic on pytrees, treating all leaves together as one vector in R^d.

Every dot product and norm here is GLOBAL: it sums over all leaves. Per-leaf (per-layer) versions
would give different angles and step sizes and are wrong for the algorithms in this package
(docs/algorithms/pfedsop.md#global-norms).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Params = Any  # a pytree of arrays


def tree_vdot(a: Params, b: Params) -> jax.Array:
    """⟨a, b⟩ = Σ over all leaves of the elementwise product, as one scalar."""
    products = [jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    return sum(products, start=jnp.zeros((), jnp.result_type(*jax.tree.leaves(a))))


def tree_sq_norm(a: Params) -> jax.Array:
    """‖a‖² over all leaves."""
    return tree_vdot(a, a)


def tree_norm(a: Params) -> jax.Array:
    """‖a‖ over all leaves."""
    return jnp.sqrt(tree_sq_norm(a))


def tree_add(a: Params, b: Params) -> Params:
    """a + b."""
    return jax.tree.map(jnp.add, a, b)


def tree_sub(a: Params, b: Params) -> Params:
    """a − b."""
    return jax.tree.map(jnp.subtract, a, b)


def tree_scale(c: jax.typing.ArrayLike, a: Params) -> Params:
    """c·a for a scalar c."""
    return jax.tree.map(lambda x: (c * x).astype(x.dtype), a)


def tree_axpy(c: jax.typing.ArrayLike, x: Params, y: Params) -> Params:
    """c·x + y for a scalar c (BLAS axpy)."""
    return jax.tree.map(lambda xi, yi: (c * xi + yi).astype(yi.dtype), x, y)


def tree_lerp(a: Params, b: Params, weight_b: jax.typing.ArrayLike) -> Params:
    """(1 − w)·a + w·b: a convex blend that puts weight w on `b`."""
    return jax.tree.map(lambda x, y: ((1 - weight_b) * x + weight_b * y).astype(x.dtype), a, b)


def tree_zeros_like(a: Params) -> Params:
    """A pytree of zeros shaped like `a`."""
    return jax.tree.map(jnp.zeros_like, a)


def tree_size(a: Params) -> int:
    """d: the total number of scalars in the pytree."""
    return sum(int(x.size) for x in jax.tree.leaves(a))
