"""Robust aggregation rules over a round's STACKED client updates (leaves [M, ...]): pure
functions that return one update shaped like a client's, in place of the weighted mean.

Every rule takes the updates Δ_i (a pytree whose leaves carry the client axis M first), an
optional `mask` [M] bool of the slots that hold a participant (a Poisson round's empty slots are
False: they never influence the result, not even by a NaN) and, where the rule has a reading for
them, `weights` [M] (FedAvg's n_i; None: uniform). n below is the number of participants (M
without a mask).

    rule                 geometry           weights          source
    coordinate_median    per coordinate     unweighted       Yin et al., ICML 2018
    trimmed_mean         per coordinate     unweighted       Yin et al., ICML 2018
    krum / multi_krum    whole vector       unweighted       Blanchard et al., NeurIPS 2017
    bulyan               both               unweighted       El Mhamdi et al., ICML 2018
    geometric_median     whole vector       weighted (α_i)   Pillutla et al., IEEE TSP 2022 (RFA)
    centered_clip        whole vector       weighted (α_i)   Karimireddy et al., ICML 2021
    norm_bound           whole vector       weighted (α_i)   Sun et al., arXiv:1911.07963 (2019)

α_i = w_i / Σ_k w_k over the participants. The unweighted rules are defined on a multiset of
vectors in their papers, and a weight has no sound reading inside an order statistic or a
nearest-neighbour score (a client with twice the samples is not two clients that agree), so they
ignore `weights`; the weighted ones reduce to the run's weighted mean in a limit (RFA at zero
iterations or ν → ∞, centered clipping and norm bounding at an infinite radius), so they take
the run's weights.

Whole-vector rules treat all leaves together as one vector in R^d (as `ops.tree` does): the
distances and norms sum over leaves, but no [M, d] concatenation is built. Krum's and Bulyan's
pairwise squared distances come from one [M, M] Gram matrix, ‖a − b‖² = ‖a‖² + ‖b‖² − 2a·b,
summed over leaves (a matrix product per leaf on the devices, O(M²d) work, O(M²) memory), with
the float32 cancellation that costs when two updates are close compared with their norms
(relative error about ε‖a‖²/‖a − b‖²; negatives are clamped to 0). Coordinate-wise rules sort
each leaf's [M, size] columns (O(M log M · d)).

A rule that needs more participants than the slots hold for its f refuses in one line
(ValueError naming the argument); with a mask the slots M are checked (n is known only inside
the round), and a round with fewer participants clamps the neighbour count at 0 (every score
ties; the lowest slot wins). A round with no participant aggregates to the zero update.
Computation is in float32 (float64 inputs keep float64); the result has the leaves' dtype.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

Params = Any

# The rules of --aggregator (mean: the run's weighted mean, `core.server.weighted_mean`).
AGGREGATORS = ("mean", "median", "trimmed_mean", "krum", "multi_krum", "bulyan", "geomed",
               "centered_clip", "norm_bound")
# The default iterations of the iterative rules (--aggregator-iters unset): Karimireddy et al.'s
# reference code runs one clipping iteration from the previous round's aggregate; five
# smoothed-Weiszfeld steps from the weighted mean (our choice: the iteration contracts fast
# from there; raise it to come closer to the geometric median).
DEFAULT_ITERS = {"geomed": 5, "centered_clip": 1}
_TINY = float(jnp.finfo(jnp.float32).tiny)


# -- shared pieces ------------------------------------------------------------------------------


def _wide(x: jax.Array) -> jax.Array:
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _slots(updates: Params) -> int:
    leaves = jax.tree.leaves(updates)
    if not leaves:
        raise ValueError("updates has no leaves: nothing to aggregate")
    return int(leaves[0].shape[0])


def _count(mask: jax.Array | None, m: int):
    """n: the participants (M, static, without a mask; traced with one)."""
    return m if mask is None else jnp.sum(mask.astype(jnp.int32))


def _rows(x: jax.Array, mask: jax.Array | None) -> jax.Array:
    """One leaf as [M, size] (wide), the masked-out rows zero (a NaN there cannot leak)."""
    rows = _wide(x).reshape(x.shape[0], -1)
    if mask is not None:
        rows = jnp.where(mask[:, None], rows, 0.0)
    return rows


def _out(flat: jax.Array, x: jax.Array, mask: jax.Array | None, n) -> jax.Array:
    """A leaf's aggregate [size] back in the shape and dtype of one client's leaf; zero where a
    masked round held no participant."""
    if mask is not None:
        flat = jnp.where(n > 0, flat, 0.0)
    return flat.reshape(x.shape[1:]).astype(x.dtype)


def _alphas(weights: jax.Array | None, mask: jax.Array | None, m: int) -> jax.Array:
    """α_i = w_i / Σ w over the participants ([M], 0 for the masked-out slots)."""
    w = jnp.ones((m,), jnp.float32) if weights is None else _wide(jnp.asarray(weights))
    if mask is not None:
        w = jnp.where(mask, w, 0.0)
    return w / jnp.maximum(jnp.sum(w), _TINY)


def _combine(coefficients: jax.Array, rows: jax.Array) -> jax.Array:
    """Σ_i c_i x_i as one dot over the client axis (XLA:CPU reduces across rows far slower:
    ops/dp.py's measurements)."""
    return jnp.tensordot(coefficients.astype(rows.dtype), rows, axes=1,
                         precision=jax.lax.Precision.HIGHEST)


def weighted_sum(updates: Params, coefficients: jax.Array, mask: jax.Array | None = None
                 ) -> Params:
    """Σ_i c_i Δ_i per leaf (masked-out rows read as zero)."""
    n = _count(mask, _slots(updates))
    return jax.tree.map(lambda x: _out(_combine(coefficients, _rows(x, mask)), x, mask, n),
                        updates)


def _sorted_columns(x: jax.Array, mask: jax.Array | None) -> jax.Array:
    """A leaf's [M, size] columns sorted ascending, the masked-out slots last (+inf)."""
    rows = _wide(x).reshape(x.shape[0], -1)
    if mask is not None:
        rows = jnp.where(mask[:, None], rows, jnp.inf)
    return jnp.sort(rows, axis=0)


def _middle(s: jax.Array, n) -> jax.Array:
    """The median of each column of the sorted `s` whose first n rows are the values: the middle
    one (n odd) or the mean of the two middle ones (n even)."""
    lo = jnp.take(s, jnp.maximum((n - 1) // 2, 0), axis=0)
    hi = jnp.take(s, n // 2, axis=0)
    return 0.5 * (lo + hi)


def masked_median(values: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """The median of the participants' entries of a [M] vector (0 with none)."""
    m = values.shape[0]
    n = _count(mask, m)
    s = _sorted_columns(values[:, None], mask)
    out = _middle(s, n)[0]
    return out if mask is None else jnp.where(n > 0, out, 0.0)


def row_norms(updates: Params, center: Params | None = None, mask: jax.Array | None = None
              ) -> jax.Array:
    """[M] ‖Δ_i − center‖ over the whole tree (center None: ‖Δ_i‖); 0 for masked-out slots."""
    leaves, treedef = jax.tree.flatten(updates)
    centers = [None] * len(leaves) if center is None else treedef.flatten_up_to(center)
    sq = sum(jnp.sum(jnp.square(_rows(x, mask) - (0.0 if c is None else _wide(c).reshape(1, -1))),
                     axis=1) for x, c in zip(leaves, centers, strict=True))
    norms = jnp.sqrt(sq)
    return norms if mask is None else jnp.where(mask, norms, 0.0)


# -- coordinate-wise rules ----------------------------------------------------------------------


def coordinate_median(updates: Params, mask: jax.Array | None = None) -> Params:
    """The coordinate-wise median (Yin, Chen, Ramchandran & Bartlett, "Byzantine-Robust
    Distributed Learning: Towards Optimal Statistical Rates", ICML 2018, Definition 1):

        med(Δ)_j = median{Δ_{1,j}, …, Δ_{n,j}}     for every coordinate j

    the middle value for odd n, the mean of the two middle values for even n (numpy's reading).
    Unweighted. Ties need no rule (equal values are one value); the median of n identical
    updates is that update, bit for bit."""
    m = _slots(updates)
    n = _count(mask, m)
    return jax.tree.map(lambda x: _out(_middle(_sorted_columns(x, mask), n), x, mask, n), updates)


def trim_count(beta: float, n) -> Any:
    """k = ⌊β·n⌋, the values trimmed from EACH end (a 1e-9 slack against float rounding:
    β = 0.3 of n = 10 trims 3, not 2)."""
    if isinstance(n, int):
        return int(math.floor(beta * n + 1e-9))
    return jnp.floor(beta * n + 1e-9).astype(jnp.int32)


def trimmed_mean(updates: Params, beta: float, mask: jax.Array | None = None) -> Params:
    """The coordinate-wise β-trimmed mean (Yin et al., ICML 2018, Definition 2): for every
    coordinate j, the mean of the values left after removing the k = ⌊β·n⌋ largest and the k
    smallest (`trim_count`),

        trmean_β(Δ)_j = 1/(n − 2k) Σ_{i ∈ U_j} Δ_{i,j}      |U_j| = n − 2k

    β ∈ [0, 1/2) (so 2k < n: something is always left); β = 0 is the uniform mean.
    Unweighted. Ties need no rule (which of equal values is removed does not change the sum)."""
    if not 0.0 <= beta < 0.5:
        raise ValueError(f"beta must be in [0, 0.5), got {beta!r}")
    m = _slots(updates)
    n = _count(mask, m)
    k = trim_count(beta, n)
    i = jnp.arange(m)
    keep = ((i >= k) & (i < n - k)).astype(jnp.float32) / jnp.maximum(n - 2 * k, 1)

    def leaf(x):
        s = _sorted_columns(x, mask)
        if mask is not None:                 # the +inf of the empty slots sit past n − k
            s = jnp.where((i < n)[:, None], s, 0.0)
        return _out(_combine(keep, s), x, mask, n)

    return jax.tree.map(leaf, updates)


# -- Krum and Multi-Krum ------------------------------------------------------------------------


def pairwise_sq_distances(updates: Params, mask: jax.Array | None = None) -> jax.Array:
    """[M, M] ‖Δ_i − Δ_j‖² over the whole tree from one Gram matrix G = Σ_leaves X Xᵀ:
    G_ii + G_jj − 2 G_ij, clamped at 0, the diagonal 0 exactly (module docstring). Masked-out
    slots read as the zero update."""
    gram = sum(jnp.matmul(r, r.T, precision=jax.lax.Precision.HIGHEST)
               for r in (_rows(x, mask) for x in jax.tree.leaves(updates)))
    sq = jnp.diagonal(gram)
    return jnp.maximum(sq[:, None] + sq[None, :] - 2.0 * gram, 0.0)


def default_f(kind: str, m: int) -> int:
    """f when unset: the most Byzantine clients the rule tolerates among m (Krum and Multi-Krum
    need 2f + 2 < m, Blanchard et al. Proposition 1; Bulyan m ≥ 4f + 3, El Mhamdi et al.)."""
    return max((m - 3) // 4 if kind == "bulyan" else (m - 3) // 2, 0)


def check_f(kind: str, f: int, m: int) -> None:
    """ValueError where m slots are too few for f (one line, naming f)."""
    if f < 0:
        raise ValueError(f"f must be >= 0, got {f}")
    need = 4 * f + 3 if kind == "bulyan" else 2 * f + 3
    if m < need:
        rule = "n >= 4f + 3" if kind == "bulyan" else "n > 2f + 2"
        raise ValueError(f"{kind} with f = {f} needs {rule}: at least {need} clients a round, "
                         f"got {m}")


def _scores(dist: jax.Array, members: jax.Array, f: int) -> jax.Array:
    """Krum's score of every member i among the `members` [M] bool: the sum of its k = r − f − 2
    smallest squared distances to the OTHER members (r = the members; clamped at 0); +inf for
    the non-members."""
    m = dist.shape[0]
    r = jnp.sum(members.astype(jnp.int32))
    k = jnp.maximum(r - f - 2, 0)
    excluded = jnp.eye(m, dtype=bool) | ~members[None, :]
    s = jnp.sort(jnp.where(excluded, jnp.inf, dist), axis=1)
    total = jnp.sum(jnp.where(jnp.arange(m)[None, :] < k, s, 0.0), axis=1)
    return jnp.where(members, total, jnp.inf)


def krum_scores(updates: Params, f: int, mask: jax.Array | None = None) -> jax.Array:
    """[M] Krum's scores (Blanchard, El Mhamdi, Guerraoui & Stainer, "Machine Learning with
    Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS 2017, Section 4):

        s(i) = Σ_{j ∈ N_i} ‖Δ_i − Δ_j‖²     N_i: the n − f − 2 updates closest to Δ_i (j ≠ i)

    +inf for the masked-out slots. Refuses M < 2f + 3."""
    m = _slots(updates)
    check_f("krum", f, m)
    members = jnp.ones((m,), bool) if mask is None else mask
    return _scores(pairwise_sq_distances(updates, mask), members, f)


def _lowest(scores: jax.Array, count) -> jax.Array:
    """[M] bool: the `count` lowest scores (ties: the lower slot first, a stable sort)."""
    order = jnp.argsort(scores, stable=True)
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(scores.shape[0], dtype=order.dtype))
    return rank < count


def krum_select(updates: Params, f: int | None = None, m: int | None = None,
                mask: jax.Array | None = None) -> jax.Array:
    """[M] bool: Multi-Krum's choice, the m participants of lowest Krum score (`krum_scores`;
    ties to the lower slot). f None: `default_f` of the slots; m None: n − f (m = 1: Krum).
    With a mask m is clamped to the participants."""
    slots = _slots(updates)
    f = default_f("krum", slots) if f is None else f
    scores = krum_scores(updates, f, mask)
    n = _count(mask, slots)
    count = n - f if m is None else m
    if isinstance(count, int) and not 1 <= count <= slots:
        raise ValueError(f"m must be in [1, {slots}] (the clients a round), got {count}")
    if mask is not None:
        count = jnp.minimum(count, n)
    return _lowest(scores, count) & (True if mask is None else mask)


def multi_krum(updates: Params, f: int | None = None, m: int | None = None,
               mask: jax.Array | None = None) -> Params:
    """Multi-Krum (Blanchard et al. 2017, Section 4): the uniform mean of the m updates of
    lowest Krum score (`krum_select`), (1/m) Σ_{i ∈ S} Δ_i. Unweighted (the paper averages the
    selected gradients uniformly). With m = n and f = 0 it is the uniform mean."""
    chosen = krum_select(updates, f, m, mask)
    c = chosen.astype(jnp.float32)
    return weighted_sum(updates, c / jnp.maximum(jnp.sum(c), 1.0), mask)


def krum(updates: Params, f: int | None = None, mask: jax.Array | None = None) -> Params:
    """Krum (Blanchard et al. 2017, Section 4): the one update of lowest score, Δ_{i*}, i* =
    argmin_i s(i) (ties: the lower slot). Unweighted."""
    return multi_krum(updates, f, 1, mask)


# -- Bulyan -------------------------------------------------------------------------------------


def bulyan_select(updates: Params, f: int | None = None, mask: jax.Array | None = None
                  ) -> jax.Array:
    """[M] bool: Bulyan's selection set (El Mhamdi, Guerraoui & Rouault, "The Hidden
    Vulnerability of Distributed Learning in Byzantium", ICML 2018, Algorithm 1): θ = n − 2f
    updates chosen by Krum recursively, each time the lowest score among those not yet chosen
    (the neighbour count r − f − 2 of the r remaining), ties to the lower slot."""
    m = _slots(updates)
    f = default_f("bulyan", m) if f is None else f
    check_f("bulyan", f, m)
    dist = pairwise_sq_distances(updates, mask)
    theta = _count(mask, m) - 2 * f
    start = jnp.ones((m,), bool) if mask is None else mask

    def pick(t, carry):
        remaining, chosen = carry
        best = jnp.argmin(_scores(dist, remaining, f))
        one = (jnp.arange(m) == best) & (t < theta)
        return remaining & ~one, chosen | one

    _, chosen = jax.lax.fori_loop(0, m - 2 * f, pick, (start, jnp.zeros((m,), bool)))
    return chosen


def bulyan(updates: Params, f: int | None = None, mask: jax.Array | None = None) -> Params:
    """Bulyan (El Mhamdi et al., ICML 2018, Algorithm 1) over Krum: the θ = n − 2f updates of
    `bulyan_select`, then for every coordinate j the mean of the β = θ − 2f selected values
    closest to their median,

        Bulyan(Δ)_j = (1/β) Σ_{x ∈ M_j} x      M_j = the β of {Δ_{i,j} : i ∈ S} nearest med_j

    (med_j the median of the θ values, the mean of the two middle ones for even θ; ties in
    |x − med_j| go to the smaller value). Unweighted. Needs n ≥ 4f + 3; f = 0 is the mean."""
    m = _slots(updates)
    f = default_f("bulyan", m) if f is None else f
    chosen = bulyan_select(updates, f, mask)
    n = _count(mask, m)
    theta = n - 2 * f
    beta = theta - 2 * f
    i = jnp.arange(m)[:, None]

    def leaf(x):
        s = _sorted_columns(x, chosen)                       # the θ chosen first, +inf after
        med = _middle(s, theta)
        far = jnp.where(i < theta, jnp.abs(s - med[None, :]), jnp.inf)
        order = jnp.argsort(far, axis=0, stable=True)
        near = jnp.take_along_axis(s, order, axis=0)
        total = jnp.sum(jnp.where(i < beta, near, 0.0), axis=0)
        return _out(total / jnp.maximum(beta, 1), x, mask, n)

    return jax.tree.map(leaf, updates)


# -- whole-vector iterative rules ---------------------------------------------------------------


def geometric_median(updates: Params, weights: jax.Array | None = None,
                     mask: jax.Array | None = None, *, iters: int = DEFAULT_ITERS["geomed"],
                     nu: float = 1e-6) -> Params:
    """RFA's approximate weighted geometric median (Pillutla, Kakade & Harchaoui, "Robust
    Aggregation for Federated Learning", IEEE TSP 2022, Algorithm 2, the smoothed Weiszfeld
    iteration) of argmin_v Σ_i α_i ‖v − Δ_i‖:

        v⁰ = Σ_i α_i Δ_i,     β_i^r = α_i / max(ν, ‖v^r − Δ_i‖),     v^{r+1} = Σ_i β_i^r Δ_i / Σ_i β_i^r

    R = `iters` steps, ν = `nu` (the smoothing: an update within ν of v weighs as if at ν).
    Weighted: α_i = w_i / Σ w, RFA's weights (the clients' sample counts in its experiments)."""
    m = _slots(updates)
    n = _count(mask, m)
    alpha = _alphas(weights, mask, m)
    leaves, treedef = jax.tree.flatten(updates)
    rows = [_rows(x, mask) for x in leaves]
    v0 = [_combine(alpha, r) for r in rows]

    def step(_, v):
        dist = jnp.sqrt(sum(jnp.sum(jnp.square(r - c[None, :]), axis=1)
                            for r, c in zip(rows, v, strict=True)))
        b = alpha / jnp.maximum(nu, dist)
        b = b / jnp.maximum(jnp.sum(b), _TINY)
        return [_combine(b, r) for r in rows]

    v = jax.lax.fori_loop(0, iters, step, v0)
    return treedef.unflatten([_out(c, x, mask, n) for c, x in zip(v, leaves, strict=True)])


def centered_clip(updates: Params, center: Params, weights: jax.Array | None = None,
                  mask: jax.Array | None = None, *, tau: float | None = None,
                  iters: int = DEFAULT_ITERS["centered_clip"]) -> Params:
    """Centered clipping (Karimireddy, He & Jaggi, "Learning from History for Byzantine Robust
    Optimization", ICML 2021, Eq. (CC)): L = `iters` steps from v⁰ = `center` (the previous
    round's aggregate: the link keeps it as its state),

        v^{l+1} = v^l + Σ_i α_i (Δ_i − v^l) · min(1, τ / ‖Δ_i − v^l‖)

    Weighted: α_i = w_i / Σ w (the paper's 1/n for uniform weights), so that τ = ∞ gives the
    run's weighted mean in one step. τ None: the median of the participants' ‖Δ_i − v^l‖ at
    each step (a scale-free reading of ours; the paper fixes τ)."""
    m = _slots(updates)
    n = _count(mask, m)
    alpha = _alphas(weights, mask, m)
    leaves, treedef = jax.tree.flatten(updates)
    rows = [_rows(x, mask) for x in leaves]
    v0 = [_wide(c).reshape(-1) for c in treedef.flatten_up_to(center)]

    def step(_, v):
        dist = jnp.sqrt(sum(jnp.sum(jnp.square(r - c[None, :]), axis=1)
                            for r, c in zip(rows, v, strict=True)))
        radius = masked_median(dist, mask) if tau is None else tau
        c = alpha * jnp.minimum(1.0, radius / jnp.maximum(dist, _TINY))
        return [vi + _combine(c, r) - jnp.sum(c) * vi for r, vi in zip(rows, v, strict=True)]

    v = jax.lax.fori_loop(0, iters, step, v0)
    return treedef.unflatten([_out(c, x, mask, n) for c, x in zip(v, leaves, strict=True)])


def norm_bound(updates: Params, weights: jax.Array | None = None,
               mask: jax.Array | None = None, *, radius: float | None = None) -> Params:
    """Norm bounding (Sun, Kairouz, Suresh & McMahan, "Can You Really Backdoor Federated
    Learning?", arXiv:1911.07963, 2019, Section 3): each update clipped to L2 norm ρ = `radius`,
    then averaged as FedAvg averages,

        Δ = Σ_i α_i Δ_i / max(1, ‖Δ_i‖ / ρ)

    Weighted (α_i = w_i / Σ w): a large radius gives the run's weighted mean. ρ None: the
    median of the participants' update norms (a scale-free reading of ours; the paper fixes ρ)."""
    m = _slots(updates)
    norms = row_norms(updates, mask=mask)
    rho = masked_median(norms, mask) if radius is None else radius
    c = _alphas(weights, mask, m) * jnp.minimum(1.0, rho / jnp.maximum(norms, _TINY))
    return weighted_sum(updates, c, mask)


def aggregate(kind: str, updates: Params, weights: jax.Array | None = None,
              mask: jax.Array | None = None, *, center: Params | None = None,
              beta: float = 0.1, f: int | None = None, m: int | None = None,
              iters: int | None = None, nu: float = 1e-6, tau: float | None = None,
              radius: float | None = None) -> Params:
    """The robust rule `kind` (one of AGGREGATORS but "mean") with its parameters: beta
    (trimmed_mean), f (krum, multi_krum, bulyan), m (multi_krum), iters (geomed,
    centered_clip; None: DEFAULT_ITERS), nu (geomed), tau and `center` (centered_clip), radius
    (norm_bound). The unweighted rules ignore `weights` (module docstring)."""
    if kind == "median":
        return coordinate_median(updates, mask)
    if kind == "trimmed_mean":
        return trimmed_mean(updates, beta, mask)
    if kind == "krum":
        return krum(updates, f, mask)
    if kind == "multi_krum":
        return multi_krum(updates, f, m, mask)
    if kind == "bulyan":
        return bulyan(updates, f, mask)
    if kind == "geomed":
        return geometric_median(updates, weights, mask, iters=iters or DEFAULT_ITERS[kind], nu=nu)
    if kind == "centered_clip":
        if center is None:
            raise ValueError("centered_clip needs center (the previous round's aggregate)")
        return centered_clip(updates, center, weights, mask, tau=tau,
                             iters=iters or DEFAULT_ITERS[kind])
    if kind == "norm_bound":
        return norm_bound(updates, weights, mask, radius=radius)
    raise ValueError(f"kind must be one of {list(AGGREGATORS[1:])}, got {kind!r}")
