"""FedAMP's attentive message passing on M stacked models: pairwise squared distances, the
attention-inducing mixing weights Ξ and the personalised cloud models U = ΞW.

Huang, Chu, Zhou, Wang, Liu, Pei & Zhang, "Personalized Cross-Silo Federated Learning on Non-IID
Data", AAAI 2021, arXiv:2007.03797 (docs/algorithms/fedamp.md). With W the M models as rows (a
pytree whose leaves have leading axis M; all of a row's leaves together are one vector w_i ∈ R^d)
and the attention-inducing function A(x) = 1 − e^{−x/σ}, so A'(x) = e^{−x/σ}/σ:

    D_ij = ‖w_i − w_j‖²                                        `pairwise_sq_distances`
    ξ_ij = α A'(D_ij) (j ≠ i),   ξ_ii = 1 − Σ_{j≠i} ξ_ij       `attention_weights` (paper)
    u_i  = Σ_j ξ_ij w_j,  i.e. U = Ξ W                         `mix_rows` (one matmul per leaf)

Unlike the rest of `ops` (one client's pytree), these act on the stacked rows of the clients of a
round, as `ops.graph` does: the pairwise structure is the point. Nothing is looped over pairs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Params = Any  # a pytree whose leaves have leading axis M


def _compute_dtype(rows: Params):
    """At least float32 whatever the storage (bfloat16 rows under --state-dtype bfloat16)."""
    return jnp.promote_types(jnp.result_type(*jax.tree.leaves(rows)), jnp.float32)


def pairwise_sq_distances(rows: Params) -> jax.Array:
    """D ∈ R^{M×M}, D_ij = ‖w_i − w_j‖² over all leaves of rows i and j together.

    One Gram matrix G = VVᵀ of the centred rows v_i = w_i − w̄ (w̄ the mean row), accumulated over
    the leaves flattened to [M, d_leaf], then D_ij = G_ii + G_jj − 2G_ij. Centring does not change
    any difference v_i − v_j = w_i − w_j, but it removes the common part of the rows, whose norm
    the identity would otherwise subtract away: models trained from one initialisation are close
    to each other and far from 0, and ‖w_i‖² + ‖w_j‖² − 2⟨w_i, w_j⟩ loses the digits of the small
    distance in float32. Rounding can still leave tiny negative values: D is clipped at 0 and its
    diagonal is exactly 0. Computed in at least float32. Costs O(M²d), one [M, M] array.

    Args:
      rows: M models, leaves [M, ...].
    Returns:
      [M, M] symmetric, non-negative, zero diagonal.
    """
    dtype = _compute_dtype(rows)
    leaves = jax.tree.leaves(rows)
    m = leaves[0].shape[0]
    gram = jnp.zeros((m, m), dtype)
    for leaf in leaves:
        flat = leaf.reshape(m, -1).astype(dtype)
        centred = flat - jnp.mean(flat, axis=0, keepdims=True)
        gram = gram + centred @ centred.T
    sq_norms = jnp.diag(gram)
    dist = jnp.maximum(sq_norms[:, None] + sq_norms[None, :] - 2.0 * gram, 0.0)
    return jnp.where(jnp.eye(m, dtype=bool), 0.0, dist)


def exp_attention_derivative(sq_dist: jax.Array, sigma: jax.typing.ArrayLike) -> jax.Array:
    """A'(x) = e^{−x/σ}/σ, the derivative of the paper's attention-inducing A(x) = 1 − e^{−x/σ}
    (increasing, concave, A(0) = 0, A'(0) = 1/σ finite, as Section 3 of the paper requires)."""
    return jnp.exp(-sq_dist / sigma) / sigma


def attention_weights(sq_dist: jax.Array, *, alpha: jax.typing.ArrayLike,
                      sigma: jax.typing.ArrayLike, self_weight: float | None = None) -> jax.Array:
    """Ξ ∈ R^{M×M}, row i the weights of client i's cloud model u_i = Σ_j ξ_ij w_j.

    self_weight None (the paper, eq. for u_i^k in Section 4; α the server step α_k):

        ξ_ij = α A'(D_ij) = α e^{−D_ij/σ}/σ      (j ≠ i)
        ξ_ii = 1 − Σ_{j≠i} ξ_ij

    This is the gradient step U = W − α∇𝒜(W) on 𝒜(W) = Σ_{i<j} A(‖w_i − w_j‖²) with the factor 2
    of ∇_{w_i} ‖w_i − w_j‖² absorbed into α, as the paper writes it. Rows sum to 1; every ξ_ij
    is ≥ 0 for j ≠ i, and ξ_ii ≥ 1 − α(M−1)/σ (A' ≤ 1/σ), so all weights are non-negative
    whenever α ≤ σ/(M−1). Far-apart models get e^{−D/σ} → 0 and ξ_ii → 1.

    self_weight s ∈ [0, 1] (the normalised form of the paper's HeurFedAMP, Section 5, whose
    kernel is e^{σ cos(w_i, w_j)} instead): the attention is normalised over the other clients
    and the self weight is fixed,

        ξ_ij = (1 − s) A'(D_ij) / Σ_{h≠i} A'(D_ih) = (1 − s) softmax_{j≠i}(−D_ij/σ)   (j ≠ i)
        ξ_ii = s

    computed as a masked softmax, so it is exact however large D/σ is; α does not enter. With a
    single model (M = 1) Ξ = [[1]].

    Args:
      sq_dist: [M, M] squared distances (`pairwise_sq_distances`).
      alpha: α_k > 0 (paper form only).
      sigma: σ > 0, the attention's length scale in squared-distance units.
      self_weight: None for the paper's form, or s ∈ [0, 1] for the normalised form.
    Returns:
      [M, M], every row summing to 1.
    """
    m = sq_dist.shape[0]
    eye = jnp.eye(m, dtype=bool)
    if self_weight is None:
        off = jnp.where(eye, 0.0, alpha * exp_attention_derivative(sq_dist, sigma))
        return off + jnp.diag(1.0 - jnp.sum(off, axis=1))
    if m == 1:
        return jnp.ones((1, 1), sq_dist.dtype)
    logits = jnp.where(eye, -jnp.inf, -sq_dist / sigma)
    others = jax.nn.softmax(logits, axis=1)          # exactly 0 on the diagonal
    return (1.0 - self_weight) * others + self_weight * eye.astype(sq_dist.dtype)


def mix_rows(weights: jax.Array, rows: Params) -> Params:
    """U = Ξ W: row i of the result is Σ_j ξ_ij w_j, one [M, M] × [M, d_leaf] matmul per leaf,
    in at least float32, returned in each leaf's dtype."""
    dtype = _compute_dtype(rows)
    w = weights.astype(dtype)
    return jax.tree.map(lambda x: jnp.tensordot(w, x.astype(dtype), axes=1).astype(x.dtype), rows)
