"""FedFomo's first-order model weights on stacked models: the validation split, the ε-greedy
choice of candidates from an affinity matrix, the weights and the personalised update as one
matmul per leaf.

Zhang, Sapra, Fidler, Yeung & Alvarez, "Personalized Federated Learning with First Order Model
Optimization", ICLR 2021, arXiv:2012.08565, Section 3 (docs/algorithms/fedfomo.md). For a sampled
client i with model θ_i, candidates θ_j (j in its download set) and its validation loss L_i:

    w_ij = max(0, (L_i(θ_i) − L_i(θ_j)) / ‖θ_j − θ_i‖)                  `fomo_weights`
    w_ij ← w_ij / Σ_k w_ik  if any w_ik > 0, else all 0 (i keeps θ_i)
    θ_i ← θ_i + Σ_j w_ij (θ_j − θ_i) = (1 − Σ_j w_ij) θ_i + Σ_j w_ij θ_j   `fomo_update`

Like `ops.attention_mix`, these act on the rows of a round's clients, not on one client: the
pairwise structure is the point, and nothing is looped over pairs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedjax_pfl.ops import attention_mix

Params = Any  # a pytree whose leaves have a leading row axis


def validation_counts(train_count: jax.Array, fraction: float) -> jax.Array:
    """v_i = min(⌈f·n_i⌉, n_i − 1) validation samples carved from n_i training samples (0 for
    n_i ≤ 1): at least one training sample stays, and every client with two or more samples has
    a validation sample. f·n_i within 10⁻³ above an integer counts as that integer, so that
    float32 rounding of e.g. 0.2 · 10 cannot add a sample."""
    n = jnp.asarray(train_count, jnp.int32)
    v = jnp.ceil(n.astype(jnp.float32) * fraction - 1e-3).astype(jnp.int32)
    return jnp.clip(v, 0, jnp.maximum(n - 1, 0))


def select_candidates(keys: jax.Array, affinity: jax.Array, valid: jax.Array, num: int,
                      epsilon: jax.typing.ArrayLike) -> tuple[jax.Array, jax.Array]:
    """Each row's `num` downloaded candidates out of P pool entries, ε-greedy on the affinity.

    For row i, K_i ~ Binomial(num, ε) of its slots explore: the num − K_i valid entries of highest
    affinity (ties broken at random) and K_i drawn uniformly from its other valid entries. With
    ε = 0 this is the top-`num` by affinity (PGFed's reference code); with num ≥ the valid count,
    every valid entry. Invalid entries (`valid` False: the client itself) are never chosen; a row
    with fewer than `num` valid entries gets invalid slots. Row i's draws use keys[i] only, so a
    client's choice does not depend on the order of the rows (pass keys folded from client ids).

    Args:
      keys: [m] one key per row (exploration and tie-breaks).
      affinity: [m, P] the rows' affinities to the pool entries.
      valid: [m, P] bool, which entries a row may download.
      num: slots per row, ≤ P.
      epsilon: exploration probability ε ∈ [0, 1].
    Returns:
      (slots [m, num] int32 pool positions, slot_valid [m, num] bool).
    """

    def one_row(key, affinity, valid):
        k_explore, k_tie, k_pick = jax.random.split(key, 3)
        explored = jnp.sum(jax.random.bernoulli(k_explore, epsilon, (num,)))          # K_i
        tie = jax.random.uniform(k_tie, affinity.shape)
        score = jnp.where(valid, affinity.astype(jnp.float32), -jnp.inf)
        order = jnp.lexsort((-tie, -score))               # by affinity desc, ties at random
        rank = jnp.argsort(order)                         # each entry's place in that order
        greedy = valid & (rank < num - explored)
        # Greedy entries first (key 2), then uniform random keys in [0, 1) among the other valid
        # entries, invalid ones last (−1): the top `num` keys are the greedy set plus K_i random.
        pick = jnp.where(greedy, 2.0, jax.random.uniform(k_pick, affinity.shape))
        top, slots = jax.lax.top_k(jnp.where(valid, pick, -1.0), num)
        return slots.astype(jnp.int32), top >= 0.0

    return jax.vmap(one_row)(keys, affinity, valid)


def fomo_weights(own_loss: jax.Array, cand_loss: jax.Array, dist: jax.Array,
                 valid: jax.Array) -> jax.Array:
    """The normalised first-order weights W ∈ R^{m×C} (paper Section 3.2, eqs. 5–6):

        w_ij = max(0, (L_i(θ_i) − L_i(θ_j)) / ‖θ_j − θ_i‖),   w_ij ← w_ij / Σ_k w_ik

    a row of zeros where no weight is positive (the client keeps θ_i). A pair that is not valid
    (no candidate in the slot, no validation data, a NaN loss) or whose models are equal
    (‖θ_j − θ_i‖ = 0, so mixing it cannot change θ_i) gets weight 0. PGFed's code adds 10⁻⁵ to the
    distance instead; we do not, so the weights are the paper's exactly.

    Args:
      own_loss: [m] L_i(θ_i), each client's validation loss of its own model.
      cand_loss: [m, C] L_i(θ_j) of its candidates on its validation data.
      dist: [m, C] ‖θ_j − θ_i‖ (Euclidean over all parameters).
      valid: [m, C] bool.
    Returns:
      [m, C], non-negative, each row summing to 1 or 0.
    """
    ok = valid & (dist > 0) & jnp.isfinite(cand_loss) & jnp.isfinite(own_loss)[:, None]
    gain = jnp.where(ok, own_loss[:, None] - cand_loss, 0.0)
    raw = jnp.where(ok, gain / jnp.where(ok, dist, 1.0), 0.0)
    pos = jnp.maximum(raw, 0.0)
    total = jnp.sum(pos, axis=1, keepdims=True)
    return jnp.where(total > 0, pos / jnp.where(total > 0, total, 1.0), 0.0)


def candidate_distances(own: Params, pool: Params, slots: jax.Array) -> jax.Array:
    """[m, C] ‖θ_{pool[slots[i, c]]} − θ_i‖ from one Gram matrix of the m + P stacked rows
    (`attention_mix.pairwise_sq_distances`, centred, at least float32)."""
    m = slots.shape[0]
    rows = jax.tree.map(lambda a, b: jnp.concatenate([a, b.astype(a.dtype)]), own, pool)
    sq = attention_mix.pairwise_sq_distances(rows)[:m, m:]                    # [m, P]
    return jnp.sqrt(jnp.take_along_axis(sq, slots, axis=1))


def fomo_update(weights: jax.Array, slots: jax.Array, own: Params, pool: Params) -> Params:
    """θ_i + Σ_c w_ic (θ_{pool[slots[i, c]]} − θ_i) for every row i, as one matmul per leaf:
    [θ_new] = [diag(1 − Σ_c w_ic) | A] [θ_own; θ_pool] with A_ip = Σ_{c: slots[i,c] = p} w_ic,
    in at least float32 (`attention_mix.mix_rows`), returned in each leaf's dtype.

    Args:
      weights: [m, C] (`fomo_weights`).
      slots: [m, C] pool positions of the candidates.
      own: m models θ_i, leaves [m, ...].
      pool: P models, leaves [P, ...].
    """
    p = jax.tree.leaves(pool)[0].shape[0]
    to_pool = jnp.einsum("ic,icp->ip", weights, jax.nn.one_hot(slots, p, dtype=weights.dtype))
    mix = jnp.concatenate([jnp.diag(1.0 - jnp.sum(weights, axis=1)), to_pool], axis=1)
    rows = jax.tree.map(lambda a, b: jnp.concatenate([a, b.astype(a.dtype)]), own, pool)
    return attention_mix.mix_rows(mix, rows)
